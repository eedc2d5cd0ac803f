#!/usr/bin/env python3
"""Throughput of aerie-target at 1, 8 and 32 concurrent streams: plain
(no draft service), with the draft service speculating on every step, and
with adaptive speculation (the default), each against plain measured in
the same run.

Every configuration starts fresh services (release builds) on Unix sockets
in a temporary directory, warms up, then runs each level twice: cold (the
first time the server meets that batch size) and warm. A run is the streams (greedy, chat
prompts, max_tokens each, end of sequence ignored so every stream does the
same work); it counts generated tokens over wall time. Streams are also
checked against each other: the same prompt gives the same tokens in every
configuration. Prints one JSON line.

    tools/bench_services.py [--max-tokens 64] [--levels 1,8,32] [--threads 2]
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
import aerie_rpc as rpc  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
    "Explain what a CPU does.", "How do plants make food?", "Give me a tip for learning to cook.",
    "What is a black hole?", "Describe a cat in two sentences.", "Why is the sky blue?",
    "Name three rivers in Europe.", "What does a compiler do?", "How many legs does a spider have?",
    "Suggest a name for a bakery.", "What is the boiling point of water?", "Tell me about the moon.",
    "How do I make tea?",
]


def chat_ids(q):
    msgs = json.dumps([{"role": "user", "content": q}])
    out = subprocess.run([str(ROOT / "build" / "aerie"), "tokenize", "--model", str(MODEL), "--chat", msgs],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def start(name, args, addr, log):
    p = subprocess.Popen([str(ROOT / "build" / name), "--model", str(MODEL), "--listen", addr, *args],
                         stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    rpc.wait_for_socket(addr, p)
    return p


def run_level(addr, prompts, n, max_tokens):
    """n concurrent streams on one connection; 4 rounds of 1 for n = 1."""
    rounds = 4 if n == 1 else 1
    tokens, outs = 0, []
    t0 = time.monotonic()
    for r in range(rounds):
        c = rpc.Conn(addr)
        batch = [prompts[(r + i) % len(prompts)] for i in range(n)]
        ids = [rpc.start_generate(c, p, max_tokens, ignore_eos=True) for p in batch]
        got = rpc.collect(c, ids)
        c.close()
        for p, cid in zip(batch, ids):
            s = got[cid]
            assert s.status == "OK", s.error
            tokens += len(s.tokens)
            outs.append((tuple(p), tuple(s.tokens)))
    return tokens / (time.monotonic() - t0), outs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    levels = [int(x) for x in a.levels.split(",")]
    prompts = [chat_ids(q) for q in QUESTIONS]
    tmp = Path(tempfile.mkdtemp(prefix="aerie-bench-"))
    configs = {"plain": None, "draft_always": ["--no-spec-adaptive"], "draft_adaptive": []}
    result = {"max_tokens": a.max_tokens, "threads": a.threads}
    reference = {}
    for name, spec_args in configs.items():
        procs = []
        with open(tmp / f"{name}.log", "w") as log:
            targs = ["--max-batch", str(max(levels)), "--max-seq-len", "1024", "--threads", str(a.threads),
                     "--log-interval-s", "2"]
            if spec_args is not None:
                procs.append(start("aerie-draft", ["--max-seqs", "64", "--max-seq-len", "1024", "--threads",
                                                   str(a.threads)], f"unix:{tmp}/draft.sock", log))
                targs += ["--draft-addr", f"unix:{tmp}/draft.sock", *spec_args]
            procs.append(start("aerie-target", targs, f"unix:{tmp}/target.sock", log))
            try:
                run_level(f"unix:{tmp}/target.sock", prompts, 2, 16)  # warm-up
                row = {}
                for n in levels:
                    # First the level cold (adaptive speculation meets this
                    # batch size for the first time and probes), then again
                    # as a server that has been carrying this load.
                    for phase in ("cold", "warm"):
                        tps, outs = run_level(f"unix:{tmp}/target.sock", prompts, n, a.max_tokens)
                        row[str(n) if phase == "warm" else f"{n}_cold"] = round(tps, 1)
                        for p, t in outs:
                            assert reference.setdefault(p, t) == t, f"{name}: output differs from another configuration"
                _r, stats, _c = rpc.info(f"unix:{tmp}/target.sock")
                row["accept_len_last_interval"] = stats["accept_len"]
                row["spec"] = stats["spec"]
                result[name] = row
            finally:
                for p in reversed(procs):
                    p.send_signal(signal.SIGTERM)
                    p.wait(timeout=60)
    for name in ("draft_always", "draft_adaptive"):
        result[name + "_vs_plain"] = {k: round(result[name][k] / result["plain"][k], 3)
                                      for n in levels for k in (str(n), f"{n}_cold")}
    print(json.dumps(result))
    print(f"logs: {tmp}", file=sys.stderr)


if __name__ == "__main__":
    main()
