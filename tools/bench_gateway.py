#!/usr/bin/env python3
"""Load on aerie-gateway: 1, 16 and 64 concurrent streaming clients, and
what the gateway adds per streamed token against calling the target's
Generate directly in the same run.

Starts a target (release build, plain decoding unless --draft) and a
gateway on Unix sockets in a temporary directory. Each client sends
streamed /v1/completions requests (greedy, max_tokens each, end of sequence
ignored so that every request does the same work) over its own keep-alive
connection and times, from its side:

  ttft  request written -> first text chunk
  itl   gap between text chunks (a chunk is one decode step's text: one
        token without a draft, the accepted tokens with one)

and the run's total tok/s. Errors: any status but 200, an error event, a
stream without [DONE] or with fewer tokens than asked. There must be none.

Overhead: single requests alternate between the gateway (streamed) and a
direct Generate on the target's socket (aerie_rpc, the same prompt ids);
(gateway time - direct time) / tokens is the latency the gateway adds per
token (the median of the pairs' differences), and the gateway's CPU time
(all threads, /proc/PID/task/*/schedstat) divided by its tokens is its cost
per token, under load and one request at a time. Prints one JSON line.

    tools/bench_gateway.py [--levels 1,16,64] [--max-tokens 64] [--max-batch 64] [--threads 2] [--draft]
"""
import argparse
import asyncio
import json
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
from aerie_stack import MODEL, Stack  # noqa: E402

NAME = "SmolLM2-135M-Instruct.Q4_1"
PROMPTS = [
    "The history of the printing press", "A recipe for bread starts with", "The best way to learn a language is",
    "Once upon a time in a small village", "The planets of the solar system are", "To write a good essay, you",
    "The ocean is home to", "In the year 2050, cities will",
]


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def read_chunked_sse(reader):
    """Yields each SSE data payload (bytes) from a chunked body."""
    buf = b""
    while True:
        size_line = await reader.readline()
        size = int(size_line.strip(), 16)
        if size == 0:
            await reader.readline()
            break
        buf += await reader.readexactly(size)
        await reader.readexactly(2)
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            if ev.startswith(b"data: "):
                yield ev[6:]


async def sse_events(reader, errors):
    """Yields (arrival time, parsed event) for each event of a streamed
    reply; error events and a stream without [DONE] go to errors."""
    done = False
    async for data in read_chunked_sse(reader):
        now = time.monotonic()
        if data == b"[DONE]":
            done = True
            continue
        ev = json.loads(data)
        if "error" in ev:
            errors.append(ev["error"]["message"])
            continue
        yield now, ev
    if not done:
        errors.append("no [DONE]")


async def read_head(reader):
    """(status code, headers with lower-case names) of an HTTP reply."""
    status = await reader.readline()
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        k, v = line.decode().split(":", 1)
        headers[k.strip().lower()] = v.strip()
    return int(status.split()[1]), headers


async def one_request(reader, writer, prompt, max_tokens, stats):
    body = json.dumps({"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    t0 = time.monotonic()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    code, headers = await read_head(reader)
    if code != 200:
        await reader.readexactly(int(headers.get("content-length", 0)))
        stats["errors"].append(f"status {code}")
        return 0
    first, last = None, None
    async for now, ev in sse_events(reader, stats["errors"]):
        text = ev["choices"][0]["text"]
        if not text:
            continue
        if first is None:
            first = now
            stats["ttft"].append(now - t0)
        else:
            stats["itl"].append(now - last)
        last = now
    stats["e2e"].append(time.monotonic() - t0)
    return max_tokens


async def client(port, idx, rounds, max_tokens, stats):
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    toks = 0
    for r in range(rounds):
        toks += await one_request(reader, writer, PROMPTS[(idx + r) % len(PROMPTS)], max_tokens, stats)
    writer.close()
    return toks


async def level(port, n, rounds, max_tokens):
    stats = {"ttft": [], "itl": [], "e2e": [], "errors": []}
    t0 = time.monotonic()
    toks = await asyncio.gather(*[client(port, i, rounds, max_tokens, stats) for i in range(n)])
    wall = time.monotonic() - t0
    ms = lambda x: round(x * 1e3, 2) if x is not None else None  # noqa: E731
    return {
        "clients": n, "requests": n * rounds, "tokens": sum(toks), "tok_per_s": round(sum(toks) / wall, 1),
        "ttft_ms_p50": ms(pct(stats["ttft"], 50)), "ttft_ms_p99": ms(pct(stats["ttft"], 99)),
        "itl_ms_p50": ms(pct(stats["itl"], 50)), "itl_ms_p99": ms(pct(stats["itl"], 99)),
        "errors": len(stats["errors"]), "error_samples": stats["errors"][:3],
    }


def cpu_seconds(pid):
    """CPU time of every thread of pid, in ns resolution (schedstat), not
    the 10 ms ticks of /proc/PID/stat."""
    total = 0
    for t in Path(f"/proc/{pid}/task").iterdir():
        total += int((t / "schedstat").read_text().split()[0])
    return total / 1e9


def tokenize(prompt):
    out = subprocess.run([str(ROOT / "build" / "aerie"), "tokenize", "--model", str(MODEL), prompt],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def overhead(port, target_addr, gw_pid, max_tokens, pairs):
    """Per-token latency of a streamed request through the gateway minus a
    direct Generate of the same ids, alternating; and the gateway's CPU
    time per token over its requests."""
    prompt = PROMPTS[0]
    ids = tokenize(prompt)
    gw, direct, cpu = [], [], 0.0
    for _ in range(pairs):
        c0 = cpu_seconds(gw_pid)
        t0 = time.monotonic()
        stats = {"ttft": [], "itl": [], "e2e": [], "errors": []}
        asyncio.run(client(port, 0, 1, max_tokens, stats))
        assert not stats["errors"], stats["errors"]
        gw.append(time.monotonic() - t0)
        cpu += cpu_seconds(gw_pid) - c0
        t0 = time.monotonic()
        s = rpc.generate(target_addr, ids, max_tokens, ignore_eos=True)
        assert s.status == "OK" and len(s.tokens) == max_tokens, s.error
        direct.append(time.monotonic() - t0)
    g, d = statistics.median(gw), statistics.median(direct)
    added = statistics.median(x - y for x, y in zip(gw, direct))
    return {"pairs": pairs, "gateway_ms": round(g * 1e3, 2), "direct_ms": round(d * 1e3, 2),
            "ratio": round(g / d, 4), "added_us_per_token": round(added / max_tokens * 1e6, 1),
            "gateway_cpu_us_per_token": round(cpu / (pairs * max_tokens) * 1e6, 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="1,16,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=21)
    ap.add_argument("--draft", action="store_true", help="speculate through an aerie-draft with the trained head")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="aerie-bench-gw-"))
    stack = Stack(tmp, draft=a.draft, draft_args=["--threads", 1],
                  target_args=["--max-batch", a.max_batch, "--max-seq-len", 512, "--threads", a.threads,
                               "--log-interval-s", 0],
                  gateway_args=["--health-interval-ms", 200, "--log-interval-s", 0])
    port, target_addr, gw = stack.port, stack.target_addr, stack.gateway
    try:
        asyncio.run(level(port, 4, 1, 8))  # warm-up
        out = {"max_tokens": a.max_tokens, "max_batch": a.max_batch, "threads": a.threads,
               "draft": a.draft, "levels": []}
        cpu0, toks = cpu_seconds(gw.pid), 0
        for n in map(int, a.levels.split(",")):
            rounds = 8 if n == 1 else (2 if n <= 16 else 1)
            r = asyncio.run(level(port, n, rounds, a.max_tokens))
            toks += r["tokens"]
            out["levels"].append(r)
        cpu = cpu_seconds(gw.pid) - cpu0
        out["gateway_cpu_us_per_token_under_load"] = round(cpu / max(toks, 1) * 1e6, 1)
        out["overhead"] = overhead(port, target_addr, gw.pid, a.max_tokens, a.pairs)
        print(json.dumps(out))
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
