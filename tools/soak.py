#!/usr/bin/env python3
"""Soak: many concurrent streams through the whole stack for minutes, with
the draft killed (SIGKILL) half-way and started again, as a supervisor
would.

Starts aerie-draft (the trained head beside the model), aerie-target
(speculating through it) and aerie-gateway from build/ (release) on Unix
sockets in a temporary directory. --streams clients each loop over
streamed greedy /v1/chat/completions requests on their own keep-alive
connection until --seconds have passed. Checks, and reports as one JSON
line:

  errors      any status but 200, an error event, a stream without [DONE],
              a finish_reason other than stop/length, or a reply whose text
              differs from the first reply to the same prompt (greedy
              output must not change with load, batch or a dead draft)
  rss         each service's resident memory after the warm-up and at the
              end (the draft's end figure is its restarted process), and
              the growth in percent
  kv          the target's KV blocks in use once the load has stopped
              (Target.Info): it must be back to 0
  itl         inter-chunk latency percentiles seen by the clients, p50/p99

    tools/soak.py [--streams 64] [--seconds 300] [--warmup-s 20] [--max-tokens 64] [--threads 2]

It is a tool, not a test: run it by hand (about --seconds + 1 minute).
Exits 1 when any check fails.
"""
import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "tools"))
import aerie_rpc as rpc  # noqa: E402
from aerie_stack import Stack  # noqa: E402
from bench_gateway import pct, read_head, sse_events  # noqa: E402

HEAD = ROOT / "models" / "smollm2-135m-eagle3"
NAME = "SmolLM2-135M-Instruct.Q4_1"
PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Write a short poem about autumn leaves.",
    "How do I reverse a list in Python?",
    "Explain photosynthesis to a ten-year-old.",
    "What are the main differences between a cat and a dog as pets?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What is 17 times 23?",
    "Suggest a name for a small coffee shop.",
    "Why is the sky blue?",
    "List the planets of the solar system in order.",
    "How can I make my code easier to read?",
]


def rss_mib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


async def one_request(reader, writer, prompt, max_tokens, stats):
    body = json.dumps({"model": NAME, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    code, headers = await read_head(reader)
    if code != 200:
        detail = await reader.readexactly(int(headers.get("content-length", 0)))
        stats["errors"].append(f"status {code}: {detail[:200]!r}")
        return
    text, last, finish = [], None, None
    async for now, ev in sse_events(reader, stats["errors"]):
        ch = ev["choices"][0]
        finish = ch.get("finish_reason") or finish
        piece = ch["delta"].get("content") or ""
        if not piece:
            continue
        if last is not None:
            stats["itl"].append(now - last)
        last = now
        text.append(piece)
    if finish not in ("stop", "length"):
        stats["errors"].append(f"finish_reason {finish}")
    reply = "".join(text)
    first = stats["texts"].setdefault(prompt, reply)
    if reply != first:
        stats["errors"].append(f"text changed for {prompt!r}: {first[:60]!r} then {reply[:60]!r}")
    stats["requests"] += 1


async def client(port, idx, until, max_tokens, stats):
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    r = 0
    while time.monotonic() < until:
        try:
            await one_request(reader, writer, PROMPTS[(idx + r) % len(PROMPTS)], max_tokens, stats)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError) as e:
            stats["errors"].append(f"client {idx}: {e!r}")
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
        r += 1
    writer.close()


async def soak(stack, a, report):
    stats = {"itl": [], "errors": [], "texts": {}, "requests": 0}
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    until = t0 + a.seconds
    clients = [asyncio.create_task(client(stack.port, i, until, a.max_tokens, stats)) for i in range(a.streams)]
    await asyncio.sleep(a.warmup_s)
    report["rss_mib_start"] = {n: round(rss_mib(p.pid), 1) for n, p in
                               (("gateway", stack.gateway), ("target", stack.target), ("draft", stack.draft))}
    await asyncio.sleep(max(0.0, t0 + a.seconds / 2 - time.monotonic()))
    stack.draft.send_signal(signal.SIGKILL)
    stack.draft.wait()
    report["draft_killed_at_s"] = round(time.monotonic() - t0, 1)
    await asyncio.sleep(1.0)  # a supervisor's restart delay
    await loop.run_in_executor(None, stack.start_draft)
    report["draft_restarted_at_s"] = round(time.monotonic() - t0, 1)
    await asyncio.gather(*clients)
    report["wall_s"] = round(time.monotonic() - t0, 1)
    return stats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--warmup-s", type=float, default=20)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="aerie-soak-"))
    stack = Stack(tmp, draft=True, draft_args=["--draft", HEAD, "--threads", 1],
                  target_args=["--max-batch", max(a.streams, 1), "--max-seq-len", 1024, "--threads", a.threads],
                  gateway_args=["--health-interval-ms", 200])
    report = {"streams": a.streams, "seconds": a.seconds, "max_tokens": a.max_tokens, "logs": str(tmp)}
    ok = False
    try:
        stats = asyncio.run(soak(stack, a, report))
        time.sleep(1.0)  # let the target release the last sequences
        report["rss_mib_end"] = {n: round(rss_mib(p.pid), 1) for n, p in
                                 (("gateway", stack.gateway), ("target", stack.target), ("draft", stack.draft))}
        report["rss_growth_pct"] = {n: round((report["rss_mib_end"][n] / report["rss_mib_start"][n] - 1) * 100, 2)
                                    for n in report["rss_mib_start"]}
        _, load, _ = rpc.info(stack.target_addr)
        report["kv_blocks_used_after"] = load["kv_blocks_used"]
        report["target_requests_done"] = load["requests_done"]
        report["spec"] = load["spec"]
        report["requests"] = stats["requests"]
        report["errors"] = len(stats["errors"])
        report["error_samples"] = stats["errors"][:5]
        report["itl_ms_p50"] = round(pct(stats["itl"], 50) * 1e3, 2)
        report["itl_ms_p99"] = round(pct(stats["itl"], 99) * 1e3, 2)
        report["draft_starts"] = stack.draft_starts
        ok = (report["errors"] == 0 and report["kv_blocks_used_after"] == 0
              and all(g < 5 for n, g in report["rss_growth_pct"].items() if n != "draft"))
    finally:
        report["exit_codes"] = stack.stop()
        ok = ok and all(rc == 0 for rc in report["exit_codes"].values())
        report["ok"] = ok
        print(json.dumps(report))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
