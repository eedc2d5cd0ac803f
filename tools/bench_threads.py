#!/usr/bin/env python3
"""How to size the threads of aerie-target and aerie-draft when they share
the cores of one machine (as `make run` does): tokens/s of one greedy
stream through the target with the draft speculating on every step, and
the CPU both services burn per token, for several thread splits.

Every configuration's services run at once (an idle service sleeps), and
the configurations take turns request by request, so that the host's
changing load falls on all of them alike. Each configuration is NAME=T,D
(target threads, draft threads; D = 0: no draft, plain decoding), and may
name another build directory as NAME=T,D,DIR (to compare builds).
Prints one JSON line: per configuration the median tokens/s over the
rounds, its ratio to the first configuration, and CPU ms per token (all
threads of both services, from /proc/PID/task/*/schedstat).

    tools/bench_threads.py [--rounds 5] [--max-tokens 64] [--prompts 4] [CONFIG ...]
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "tools"))
import aerie_rpc as rpc  # noqa: E402
from bench_services import MODEL, QUESTIONS, chat_ids  # noqa: E402


def cpu_ns(pid):
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except FileNotFoundError:
            pass
    return total


def start(binary, args, addr, log):
    p = subprocess.Popen([str(binary), "--model", str(MODEL), "--listen", addr, *args], stdout=log,
                         stderr=subprocess.STDOUT, cwd=ROOT)
    rpc.wait_for_socket(addr, p)
    return p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4, help="chat prompts per round (of tools/bench_services.py's)")
    ap.add_argument("configs", nargs="*", default=["t2_d2=2,2", "t2_d1=2,1", "t1_d1=1,1", "plain_t2=2,0"])
    a = ap.parse_args()
    prompts = [chat_ids(q) for q in QUESTIONS[:a.prompts]]
    tmp = Path(tempfile.mkdtemp(prefix="aerie-threads-"))
    stacks = []
    log = open(tmp / "services.log", "w")
    try:
        for spec in a.configs:
            name, rest = spec.split("=")
            parts = rest.split(",")
            t, d = int(parts[0]), int(parts[1])
            bdir = Path(parts[2]) if len(parts) > 2 else ROOT / "build"
            procs = []
            targs = ["--max-batch", "4", "--max-seq-len", "1024", "--threads", str(t), "--log-interval-s", "0"]
            if d:
                daddr = f"unix:{tmp}/{name}-draft.sock"
                procs.append(start(bdir / "aerie-draft", ["--max-seqs", "64", "--max-seq-len", "1024", "--threads",
                                                          str(d)], daddr, log))
                targs += ["--draft-addr", daddr, "--no-spec-adaptive"]
            taddr = f"unix:{tmp}/{name}-target.sock"
            procs.append(start(bdir / "aerie-target", targs, taddr, log))
            stacks.append({"name": name, "addr": taddr, "procs": procs, "tps": [], "cpu": 0, "tokens": 0})
        for s in stacks:  # warm-up
            c = rpc.Conn(s["addr"])
            rpc.collect(c, [rpc.start_generate(c, prompts[0], 16, ignore_eos=True)])
            c.close()
        reference = {}
        for _r in range(a.rounds):
            for s in stacks:
                tokens, t0 = 0, time.monotonic()
                c0 = sum(cpu_ns(p.pid) for p in s["procs"])
                c = rpc.Conn(s["addr"])
                for p in prompts:
                    got = rpc.collect(c, [cid := rpc.start_generate(c, p, a.max_tokens, ignore_eos=True)])[cid]
                    assert got.status == "OK", got.error
                    assert reference.setdefault(tuple(p), tuple(got.tokens)) == tuple(got.tokens), \
                        f"{s['name']}: output differs"
                    tokens += len(got.tokens)
                c.close()
                s["tps"].append(tokens / (time.monotonic() - t0))
                s["cpu"] += sum(cpu_ns(p.pid) for p in s["procs"]) - c0
                s["tokens"] += tokens
    finally:
        for s in stacks:
            for p in reversed(s["procs"]):
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=60)
        log.close()
    base = statistics.median(stacks[0]["tps"])
    out = {"rounds": a.rounds, "max_tokens": a.max_tokens, "streams": 1}
    for s in stacks:
        m = statistics.median(s["tps"])
        out[s["name"]] = {"tok_s": round(m, 1), "vs_first": round(m / base, 3),
                          "cpu_ms_per_token": round(s["cpu"] / s["tokens"] / 1e6, 3),
                          "tok_s_all": [round(x, 1) for x in s["tps"]]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
