#!/usr/bin/env python3
"""Encode throughput, ours against Hugging Face tokenizers, in one run.

    python3 tools/bench_tokenizer.py [--file F] [--model GGUF] [--reps N]

Without --file it builds a ~1.5 MB mixed text deterministically (prose, code,
numbers, whitespace runs, several scripts, emoji). Both sides encode the
whole text on one thread, special tokens parsed, best of N:
  HF    Tokenizer.encode(text, add_special_tokens=False) with the golden
        smollm tokenizer.json (RAYON_NUM_THREADS=1, TOKENIZERS_PARALLELISM=false)
  ours  `build/aerie bench-tokenizer --model M --file F --repeat N` (release build)
It prints both in MB/s and their ratio, and checks the two agree on the ids'
count (the exact ids are pinned by tests/unit/test_tokenizer.c).
"""
import os

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from tokenizers import Tokenizer  # noqa: E402

HF_JSON = "tests/golden/tokenizer/smollm/tokenizer.json"

WORDS = ("the of and to a in is it you that he was for on are with as I his they be at one have "
         "this from or had by word but what some we can out other were all there when up use your "
         "how said an each she which do their time if will way about many then them write would "
         "like so these her long make thing see him two has look more day could go come did number "
         "sound no most people my over know water than call first who may down side been now find "
         "tokenizer inference server speculative decoding gateway draft target merges vocabulary "
         "don't isn't I'm you're we've they'll she'd it's Hello World JSON HTTP GPU CPU").split()
CODE = [
    "def {n}(x, y=None):\n    if y is None:\n        return x * {k}\n    return [x + i for i in range(y)]\n\n",
    "static int {n}(const char *s, size_t len) {{\n\tfor (size_t i = 0; i < len; i++)\n\t\tif (s[i] == '\\n') return (int)i;\n\treturn -{k};\n}}\n\n",
    "fn {n}(v: &[u32]) -> u64 {{ v.iter().map(|x| *x as u64 * {k}).sum() }}\n",
    "const {n} = async (req, res) => {{ const data = await db.query('SELECT * FROM t WHERE id = $1', [{k}]); res.json(data); }};\n",
    "<div class=\"{n}\"><span id=\"k{k}\">{k}</span></div>\n",
]
OTHER = ["\u4eca\u5929\u5929\u6c14\u5f88\u597d\uff0c\u6211\u4eec\u53bb\u516c\u56ed\u6563\u6b65\u5427\u3002",
         "\u041f\u0440\u0438\u0432\u0435\u0442, \u043a\u0430\u043a \u0434\u0435\u043b\u0430? \u0412\u0441\u0451 \u0445\u043e\u0440\u043e\u0448\u043e.",
         "\u0645\u0631\u062d\u0628\u0627 \u0628\u0643\u0645 \u0641\u064a \u0627\u0644\u0639\u0627\u0644\u0645",
         "\u0928\u092e\u0938\u094d\u0924\u0947, \u0906\u092a \u0915\u0948\u0938\u0947 \u0939\u0948\u0902?",
         "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3067\u3059\u3002", "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e \u00e0 la fran\u00e7aise.",
         "Emoji \U0001F600\U0001F44D\U0001F3FD and \U0001F468\u200D\U0001F469\u200D\U0001F467 family."]


def build_text(target_bytes=1_500_000, seed=1234):
    rng = random.Random(seed)
    parts, size = [], 0
    while size < target_bytes:
        r = rng.random()
        if r < 0.55:
            sent = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 25)))
            s = sent[0].upper() + sent[1:] + rng.choice([".", "!", "?", ",", ";"]) + rng.choice([" ", " ", "\n", "\n\n"])
        elif r < 0.75:
            s = rng.choice(CODE).format(n="f" + str(rng.randint(0, 999)), k=rng.randint(0, 10**6))
        elif r < 0.85:
            s = " ".join(str(rng.randint(0, 10**rng.randint(1, 9))) for _ in range(rng.randint(1, 8))) + \
                rng.choice([" items.\n", "%, ", " USD; ", "\n"])
        elif r < 0.95:
            s = rng.choice(OTHER) + rng.choice([" ", "\n"])
        else:
            s = rng.choice(["    ", "\t\t", "\n\n\n", "  \n", "\r\n"]) + rng.choice(WORDS)
        parts.append(s)
        size += len(s.encode("utf-8"))
    return "".join(parts)


def bench_hf(text, reps):
    tk = Tokenizer.from_file(HF_JSON)
    tk.encode(text[:10000], add_special_tokens=False)  # warm up
    best, n = float("inf"), 0
    for _ in range(reps):
        t0 = time.perf_counter()
        n = len(tk.encode(text, add_special_tokens=False).ids)
        best = min(best, time.perf_counter() - t0)
    return n, best


def ours_command(model, path, reps):
    subprocess.run(["make", "--no-print-directory", "-s", "build/aerie"], check=True,
                   stdout=subprocess.DEVNULL)
    return ["build/aerie", "bench-tokenizer", "--model", model, "--file", path,
            "--repeat", str(reps)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--file")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    if args.file:
        with open(args.file, encoding="utf-8", newline="") as f:
            text = f.read()
        path = args.file
    else:
        text = build_text()
        tmp = tempfile.NamedTemporaryFile("w", encoding="utf-8", newline="", suffix=".txt",
                                          delete=False)
        tmp.write(text)
        tmp.close()
        path = tmp.name
    nbytes = len(text.encode("utf-8"))

    hf_tokens, hf_s = bench_hf(text, args.reps)
    out = subprocess.run(ours_command(args.model, path, args.reps), check=True,
                         capture_output=True, text=True).stdout
    ours = json.loads(out.strip().splitlines()[-1])
    if not args.file:
        os.unlink(path)

    hf_mbs = nbytes / hf_s / 1e6
    print(f"text: {nbytes} bytes, best of {args.reps}, one thread")
    print(f"hf tokenizers: {hf_tokens} tokens, {hf_s:.4f} s, {hf_mbs:.2f} MB/s")
    print(f"aerie:         {ours['tokens']} tokens, {ours['best_seconds']:.4f} s, {ours['mb_per_s']:.2f} MB/s")
    print(f"ratio (aerie / hf): {ours['mb_per_s'] / hf_mbs:.2f}x")
    if ours["tokens"] != hf_tokens:
        print(f"MISMATCH: token counts differ ({ours['tokens']} vs {hf_tokens})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
