#!/usr/bin/env python3
"""The headline benchmark: what the draft gives a user of the whole stack.

Starts two stacks side by side, each as a new `make run` stack would be,
at the services' defaults (release builds, tools/aerie_stack.py): one with
aerie-draft (the head beside the model) and one whose target has
--draft-addr none. Sends the held-out chat prompts through each gateway
with the official `openai` client: greedy (temperature 0), up to
--max-tokens each, replies ending where the model ends them (finish_reason
stop or length).

The two stacks take turns request by request. At N streams, N clients each
send one prompt to one stack at once; when all N have their replies, the
same N prompts go to the other stack; the next N prompts start with the
other stack first (ABBA order, so slow drift of the host cancels out). Only
one stack is busy at a time: on 2 shared cores, two busy stacks would take
CPU from each other and each would see only half the streams. The last
group of a pass wraps around to the first prompts, so every group has N
streams. A group's time runs until its last reply ends. Tokens are the
replies' usage.completion_tokens; tokens/s of a stack are its tokens over
the summed time of its groups. Beside the wall time, the CPU time its
services used over the same groups (user and system, /proc), per token:
the work each stack does, which the host's other tenants move far less
than they move the wall time (on the development machine, 32-stream
wall-time ratios of one build ranged 0.87-1.13x from run to run). The
ratio of the two is cpu_ratio, plain's over the draft's: above 1 when the
draft saves work.

Every reply's text, finish reason and token count must be the same on both
stacks (and in every run): the first prompt where they differ is printed
and the script exits 1. A stack that does not start: its service's last
log lines, exit 1. SIGTERM or Ctrl-C stops both stacks, prints the JSON
line of the levels done and exits 1. The services' logs are removed after a clean run
(unless --keep-logs) and kept otherwise (the last line on stderr says where). A prompts file
without prompts: exit 2.

Prints, per streams value, each run's tokens/s with and without the draft
and their ratio, with the CPU ratio, and the medians over the runs; the draft stack's
mean acceptance length over the whole run; then one JSON line with
everything, including that target's Info as /server_info shows it
(speculation counters and the settings it chose). Progress goes to
stderr.

    tools/bench_spec.py [--prompts tools/prompts/heldout.jsonl] [--streams 1,8,32] [--runs 3]
                        [--max-tokens 128] [--model M] [--build build]
                        [--draft-target-args FLAGS] [--keep-logs]
"""
import argparse
import concurrent.futures
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai

from aerie_stack import BUILD, MODEL, ROOT, Stack, StackError

PROMPTS = ROOT / "tools" / "prompts" / "heldout.jsonl"
STACKS = ("draft", "plain")
LABEL = {"draft": "with the draft", "plain": "without the draft"}


class Differs(Exception):
    """Two replies to one prompt differ."""


class Stopped(Exception):
    """SIGTERM: the stacks are stopped before this exits, as on Ctrl-C."""


def on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the stopping short
    raise Stopped()


def progress(msg):
    print(f"bench_spec: {msg}", file=sys.stderr, flush=True)


def load_prompts(path):
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    prompt = json.loads(line).get("prompt")
                except (ValueError, AttributeError):
                    prompt = None
                if not isinstance(prompt, str) or not prompt:
                    raise ValueError(f"{path}:{n}: no \"prompt\" string")
                prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


class Bench:
    def __init__(self, stacks, prompts, max_tokens, streams):
        self.stacks, self.prompts, self.max_tokens = stacks, prompts, max_tokens
        self.clients = {name: openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="unused",
                                            max_retries=0, timeout=900) for name, s in stacks.items()}
        self.model = self.clients["plain"].models.list().data[0].id
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(streams))
        self.replies = {}  # prompt index -> (stack that first answered, (text, finish reason, tokens))

    def ask(self, stack, i):
        r = self.clients[stack].chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": self.prompts[i]}], temperature=0,
            max_tokens=self.max_tokens)
        choice = r.choices[0]
        return i, (choice.message.content, choice.finish_reason, r.usage.completion_tokens)

    def check(self, stack, i, reply):
        first_stack, first = self.replies.setdefault(i, (stack, reply))
        if reply != first:
            raise Differs(f"the reply to prompt {i + 1} differs: {self.prompts[i]!r}\n"
                          f"  the stack {LABEL[first_stack]}: {first!r}\n  the stack {LABEL[stack]}: {reply!r}")

    def group(self, stack, idx):
        """The prompts idx at once on one stack: (seconds, CPU seconds of its
        services, tokens, finish reasons)."""
        cpu0, t0 = self.stacks[stack].cpu_seconds(), time.monotonic()
        got = list(self.pool.map(lambda i: self.ask(stack, i), idx))
        wall, cpu = time.monotonic() - t0, self.stacks[stack].cpu_seconds() - cpu0
        for i, reply in got:
            self.check(stack, i, reply)
        return wall, cpu, sum(r[2] for _, r in got), [r[1] for _, r in got]

    def level(self, n):
        """Every prompt once on each stack, n streams at a time, the
        stacks taking turns by group: tokens/s of each and the counts."""
        secs = dict.fromkeys(STACKS, 0.0)
        cpus = dict.fromkeys(STACKS, 0.0)
        toks = dict.fromkeys(STACKS, 0)
        finish = {}
        groups = -(-len(self.prompts) // n)
        shown = time.monotonic()
        for g in range(groups):
            idx = [(g * n + k) % len(self.prompts) for k in range(n)]
            for stack in (STACKS if g % 2 == 0 else STACKS[::-1]):
                wall, cpu, tokens, reasons = self.group(stack, idx)
                secs[stack] += wall
                cpus[stack] += cpu
                toks[stack] += tokens
                if stack == "plain":
                    for reason in reasons:
                        finish[reason] = finish.get(reason, 0) + 1
            if time.monotonic() - shown > 60 and g + 1 < groups:
                shown = time.monotonic()
                progress(f"  {n} streams: {g + 1}/{groups} groups, {toks['plain']} tokens on each stack, "
                         f"{secs['plain'] / secs['draft']:.3f}x so far")
        return {"with_draft_tok_s": round(toks["draft"] / secs["draft"], 2),
                "without_draft_tok_s": round(toks["plain"] / secs["plain"], 2),
                "ratio": round((toks["draft"] / secs["draft"]) / (toks["plain"] / secs["plain"]), 4),
                "with_draft_cpu_ms_per_token": round(1e3 * cpus["draft"] / toks["draft"], 4),
                "without_draft_cpu_ms_per_token": round(1e3 * cpus["plain"] / toks["plain"], 4),
                "cpu_ratio": round((cpus["plain"] / toks["plain"]) / (cpus["draft"] / toks["draft"]), 4)
                if cpus["draft"] > 0 and toks["plain"] > 0 else 0,
                "requests": groups * n, "tokens": toks["plain"], "finish_reasons": finish}


def server_info(port, timeout=30):
    """The target's Info as the stack's /server_info shows it, once it shows
    the target idle: the gateway refreshes its copy every health check
    (--health-interval-ms), so the first one after the load may still show
    the last requests running."""
    t0 = time.monotonic()
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=30) as r:
            target = json.load(r)["targets"][0]
        stats = target["stats"]
        if stats["running"] + stats["prefilling"] + stats["waiting"] == 0 or time.monotonic() - t0 > timeout:
            return target
        time.sleep(0.2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=Path, default=PROMPTS, help="JSONL, one {\"prompt\": ...} per line")
    ap.add_argument("--streams", default="1,8,32", help="concurrent clients, comma-separated")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--build", type=Path, default=BUILD, help="where the service binaries are")
    ap.add_argument("--keep-logs", action="store_true",
                    help="keep the services' logs after a clean run too (the target's load lines show the policy)")
    ap.add_argument("--draft-target-args", default="",
                    help="extra aerie-target flags of the stack with the draft, e.g. "
                         "'--no-spec-adaptive --spec-steps 1 --spec-topk 1 --spec-tokens 2' (default: none, "
                         "as make run starts it)")
    a = ap.parse_args()
    streams = [int(x) for x in a.streams.split(",")]
    if a.runs < 1 or a.max_tokens < 1 or not streams or min(streams) < 1:
        ap.error("--runs, --max-tokens and each of --streams must be at least 1")
    try:
        prompts = load_prompts(a.prompts)
    except (OSError, ValueError) as e:
        progress(str(e))
        return 2

    t0 = time.monotonic()
    signal.signal(signal.SIGTERM, on_sigterm)
    tmp = Path(tempfile.mkdtemp(prefix="aerie-bench-spec-"))
    stacks = {}
    result = {"prompts": len(prompts), "prompts_file": str(a.prompts), "max_tokens": a.max_tokens, "draft_target_args": a.draft_target_args,
              "runs": a.runs, "streams": {}}
    ok = False
    try:
        for name in STACKS:
            progress(f"starting the stack {LABEL[name]} (logs in {tmp / name})")
            try:
                stacks[name] = Stack(tmp / name, draft=name == "draft", model=a.model, build=a.build,
                                     target_args=a.draft_target_args.split() if name == "draft" else ())
            except StackError as e:
                progress(f"the stack {LABEL[name]} did not start: {e}")
                return 1
        bench = Bench(stacks, prompts, a.max_tokens, streams)
        # Warm-up: the first request of a fresh stack pays for faulting in
        # the weights, which no user of a running server sees.
        for name in STACKS:
            bench.group(name, [0])
        rows = {n: [] for n in streams}
        for run in range(1, a.runs + 1):
            for n in streams:
                progress(f"run {run}/{a.runs}, {n} streams: {len(prompts)} prompts on each stack")
                row = bench.level(n)
                rows[n].append(row)
                progress(f"run {run}/{a.runs}, {n} streams: {row['with_draft_tok_s']} tok/s with the draft, "
                         f"{row['without_draft_tok_s']} without: {row['ratio']}x; CPU per token "
                         f"{row['with_draft_cpu_ms_per_token']} ms with, {row['without_draft_cpu_ms_per_token']} "
                         f"without: {row['cpu_ratio']}x")
                # kept as it goes, for the JSON line of a run stopped early
                result["streams"][str(n)] = {
                    "runs": rows[n], "median_ratio": round(statistics.median(r["ratio"] for r in rows[n]), 4),
                    "median_cpu_ratio": round(statistics.median(r["cpu_ratio"] for r in rows[n]), 4)}
        for n in streams:
            runs = "; ".join(f"run {k}: {r['with_draft_tok_s']} tok/s with the draft, {r['without_draft_tok_s']} "
                             f"without, {r['ratio']}x (CPU {r['cpu_ratio']}x)" for k, r in enumerate(rows[n], 1))
            print(f"{n} streams: {runs}; median {result['streams'][str(n)]['median_ratio']}x "
                  f"(CPU {result['streams'][str(n)]['median_cpu_ratio']}x)")
        result["identical"] = True
        result["draft_target"] = server_info(stacks["draft"].port)
        # Its accept_len is the last log interval's (0 once idle): the
        # whole run's mean is accepted + 1 per draft step.
        spec = result["draft_target"]["stats"]["spec"]
        result["accept_len_mean"] = round((spec["accepted"] + spec["steps"]) / spec["steps"], 3) if spec["steps"] else 0
        print(f"the target with the draft: mean acceptance length {result['accept_len_mean']} over {spec['steps']} "
              f"draft steps ({spec['plain_steps']} plain steps); spec {json.dumps(spec)}")
        ok = True
    except Differs as e:
        progress(str(e))
        result["identical"] = False
    except openai.APIError as e:
        progress(f"a request failed: {e!r}")
    except (Stopped, KeyboardInterrupt):
        progress("stopped by a signal: stopping both stacks")
    finally:
        codes = {name: s.stop() for name, s in stacks.items()}
        result["exit_codes"] = codes
        bad = [f"aerie-{svc} of the stack {LABEL[name]} exited with status {rc}" for name, c in codes.items()
               for svc, rc in c.items() if rc != 0]
        if bad:
            progress("; ".join(bad) + " when stopped")
            ok = False
        if ok and not a.keep_logs:
            shutil.rmtree(tmp)
        else:
            progress(f"the services' logs are in {tmp}")
    result["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
