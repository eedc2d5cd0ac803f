#!/usr/bin/env python3
"""Structured output's costs to everyone else, measured through the stack
(a benchmark, not a test: the machines are shared, so each figure is a
ratio against a reference taken in the same run).

Starts aerie-target and aerie-gateway from --build (default build/) on the
default model, then:

  1. stream: a plain greedy stream's tokens/s alone, and beside a request
     whose schema is costly to mask (an array of an anyOf of strings with
     different length ranges: 1,500 of them at n = 7, the issue's case;
     then 64, within the limits, at n = 16, where the mask budget is what
     protects the stream), in alternating rounds; the ratio beside /
     alone. The goal is at least 0.5.
  2. compile: how long requests with large enums take to be answered
     (compiled, or refused by a limit), and whether a tiny json_object
     request sent 1 s after a 20,000-entry enum whose client hung up waits
     for that compile.

Usage: python3 tools/bench_schema.py [--build DIR] [--rounds 3] [--tokens 160]
Prints one JSON line per measurement.
"""
import argparse
import json
import os
import random
import re
import string
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct.Q4_1"


def post(port, body, timeout=600):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def stream_rate(port, tokens):
    """A plain greedy stream: (tokens, seconds from the first token to the last)."""
    body = {"model": NAME, "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
            "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    first = last = None
    n = 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            ev = json.loads(line[6:])
            if ev["choices"] and ev["choices"][0]["delta"].get("content"):
                now = time.monotonic()
                first = first or now
                last = now
                n += 1
    return n, (last - first) if first and last else 0.0


def costly_schema(alternatives):
    return {"type": "array", "items": {"anyOf": [{"type": "string", "minLength": i, "maxLength": i + 3 + i % 5}
                                                 for i in range(alternatives)]}}


def enum_schema(n, seed=1):
    rnd = random.Random(seed)
    vals = ["".join(rnd.choice(string.ascii_letters) for _ in range(14)) for _ in range(n)]
    return {"type": "object", "properties": {"v": {"enum": vals}}, "required": ["v"]}


def fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=160)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-schema-")
    sock = f"unix:{tmp}/t.sock"
    logs = open(os.path.join(tmp, "log"), "w")
    target = subprocess.Popen([f"{a.build}/aerie-target", "--model", MODEL, "--listen", sock, "--max-batch", "24",
                               "--max-seq-len", "2048", "--log-interval-s", "0"], stdout=logs, stderr=logs)
    while not os.path.exists(f"{tmp}/t.sock"):
        if target.poll() is not None:
            sys.exit(open(os.path.join(tmp, "log")).read())
        time.sleep(0.05)
    gw_log = os.path.join(tmp, "gw")
    gw = subprocess.Popen([f"{a.build}/aerie-gateway", "--model", MODEL, "--targets", sock, "--port", "0",
                           "--log-interval-s", "0"], stdout=open(gw_log, "w"), stderr=subprocess.STDOUT)
    port = None
    while port is None:
        m = re.search(r"gateway_ready url=http://127\.0\.0\.1:(\d+)", open(gw_log).read())
        port = int(m.group(1)) if m else None
        time.sleep(0.05)
    try:
        stream_rate(port, 8)  # warm
        # 1. A plain stream beside a costly schema's request.
        for alternatives, n_choices in ((1500, 7), (64, 16)):
            stream_beside(port, a, alternatives, n_choices)
        compiles(port)
    finally:
        gw.terminate()
        gw.wait()
        t0 = time.monotonic()
        target.terminate()
        target.wait()
        print(json.dumps({"bench": "target_exit_after_sigterm", "secs": round(time.monotonic() - t0, 2),
                          "rc": target.returncode}), flush=True)


def target_stats(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=60) as r:
        return json.loads(r.read())["targets"][0]["stats"]


def rate_beside(port, a, body):
    """The plain stream's tokens/s while body's request runs (median of
    a.rounds), and that request's last (status, seconds, reply head)."""
    rates, outcome = [], None
    for _ in range(a.rounds):
        res = {}

        def other():
            t0 = time.monotonic()
            st, reply = post(port, body)
            res["status"], res["secs"], res["reply"] = st, time.monotonic() - t0, reply[:300].decode(errors="replace")
        th = threading.Thread(target=other)
        th.start()
        time.sleep(0.3)
        n, dt = stream_rate(port, a.tokens)
        rates.append(n / dt)
        th.join()
        outcome = res
    return sorted(rates)[len(rates) // 2], outcome


def stream_beside(port, a, alternatives, n_choices):
    """A plain stream alone, beside the costly schema's request, and beside
    the same request without its schema (the cost of n more sequences in
    the batch, which is not the masks')."""
    rates = []
    for _ in range(a.rounds):
        n, dt = stream_rate(port, a.tokens)
        rates.append(n / dt)
    ra = sorted(rates)[len(rates) // 2]
    body = {"model": NAME, "messages": [{"role": "user", "content": "List words."}], "max_tokens": 200,
            "n": n_choices, "temperature": 0.8}
    before = target_stats(port)
    rb, costly = rate_beside(port, a, dict(body, response_format=fmt(costly_schema(alternatives))))
    after = target_stats(port)
    ru, _ = rate_beside(port, a, body)
    masks = after["grammar_masks"] - before["grammar_masks"]
    mask_ms = after["grammar_mask_ms"] - before["grammar_mask_ms"]
    print(json.dumps({"bench": "stream_beside_costly_schema", "alternatives": alternatives, "n": n_choices,
                      "tok_s_alone": round(ra, 1), "tok_s_beside_schema": round(rb, 1),
                      "tok_s_beside_same_without_schema": round(ru, 1), "ratio": round(rb / ra, 3),
                      "ratio_to_same_without_schema": round(rb / ru, 3),
                      "masks": masks, "mask_ms_each": round(mask_ms / masks, 3) if masks else 0,
                      "mask_budget_spent": after.get("schemas", {}).get("mask_budget_spent", 0) -
                      before.get("schemas", {}).get("mask_budget_spent", 0),
                      "costly_status": costly["status"], "costly_secs": round(costly["secs"], 2),
                      "costly_reply": costly["reply"]}), flush=True)


def compiles(port):
    # 2. Compile times of large enums, answered or refused.
    for n in (1024, 12000):
        t0 = time.monotonic()
        st, body = post(port, {"model": NAME, "messages": [{"role": "user", "content": "Pick one."}],
                               "max_tokens": 8, "temperature": 0, "response_format": fmt(enum_schema(n, n))})
        print(json.dumps({"bench": "enum_compile", "entries": n, "status": st,
                          "secs": round(time.monotonic() - t0, 2),
                          "reply": body[:200].decode(errors="replace")}), flush=True)
    # An abandoned 20,000-entry enum, then a tiny json_object request.
    def abandoned():
        try:
            post(port, {"model": NAME, "messages": [{"role": "user", "content": "Pick one."}], "max_tokens": 8,
                        "response_format": fmt(enum_schema(20000, 7))}, timeout=1)
        except Exception:
            pass
    th = threading.Thread(target=abandoned)
    th.start()
    th.join()
    t0 = time.monotonic()
    st, body = post(port, {"model": NAME, "messages": [{"role": "user", "content": "Say hi as JSON."}],
                           "max_tokens": 8, "temperature": 0, "response_format": {"type": "json_object"}})
    print(json.dumps({"bench": "json_object_after_abandoned_20000_enum", "status": st,
                      "secs": round(time.monotonic() - t0, 2)}), flush=True)


if __name__ == "__main__":
    main()
