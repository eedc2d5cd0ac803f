#!/usr/bin/env python3
"""Accuracy as users judge it: aerie and llama.cpp side by side against the
same f32 transformers base (tools/gen_ppl_base.py; format in target/ppl.h).

Both engines score the same windows of the same tokens: aerie through
`aerie perplexity --kl-base` (it tokenizes the text itself and must match
the base's tokens), llama.cpp through llama-cpp-python on the same GGUF, fed
the base's own window tokens, one window per context (reset between
windows, n_ctx = n_batch = ctx, logits for every position). The llama.cpp
side is scored here in numpy exactly as target/ppl.c scores aerie's rows:
log-softmax in float64, KL over the base's top K and the rest, argmax the
first maximum, kld_p99 the ceil(0.99 n)-th smallest.

  python3 tools/bench_ppl.py                        # corpus.txt, ctx 512
  python3 tools/bench_ppl.py --aerie-args "--threads 2"
  python3 tools/bench_ppl.py --no-llama             # aerie only
  python3 tools/bench_ppl.py --no-aerie --jobs 2 --threads 1
  python3 tools/bench_ppl.py --requantize Q4_K_M    # the file as llama.cpp requantizes it

llama.cpp's threads spin at barriers, which costs it dearly on a host
whose cores are shared with other work; --jobs 2 --threads 1 runs its
windows in two single-threaded processes instead (same numbers).

Extra settings for aerie (e.g. another activation precision, once the
engine has one) go in --aerie-args, which is passed to `aerie perplexity`
as it is. Prints a table and one JSON line.

Needs: make build/aerie; pip install numpy llama-cpp-python.
"""
import argparse
import json
import shlex
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = ROOT / "tests" / "golden" / "ppl" / "corpus.txt"
BASE = ROOT / "tests" / "golden" / "ppl" / "corpus.base"


def read_base(path):
    """The base as numpy arrays (see target/ppl.h for the layout)."""
    import numpy as np
    data = Path(path).read_bytes()
    if data[:8] != b"AEPPLB01":
        raise SystemExit("%s: not a perplexity base" % path)
    vocab, ctx, windows, k, flags = struct.unpack_from("<5I", data, 8)
    off = 28
    tokens = np.frombuffer(data, dtype="<i4", count=windows * ctx, offset=off).reshape(windows, ctx)
    off += 4 * windows * ctx
    first = ctx // 2
    scored = ctx - 1 - first
    rec = np.dtype([("logp_next", "<f4"), ("log_rest", "<f4"), ("ids", "<i4", (k,)), ("logp", "<f4", (k,))])
    recs = np.frombuffer(data, dtype=rec, offset=off)
    assert len(recs) == windows * scored, "base size does not match its header"
    return {"vocab": vocab, "ctx": ctx, "windows": windows, "k": k, "first": first, "scored": scored,
            "tokens": tokens, "recs": recs}


class Scorer:
    """numpy twin of target/ppl.c's scorer."""

    def __init__(self):
        self.nll = 0.0
        self.kld = []
        self.agree = 0
        self.base_nll = 0.0

    def add(self, logits, nxt, ref):
        import numpy as np
        x = logits.astype(np.float64)
        mx = x.max()
        e = np.exp(x - mx)
        z = e.sum()
        log_z = np.log(z) + mx
        self.nll += log_z - x[nxt]
        ids = ref["ids"]
        lp = ref["logp"].astype(np.float64)
        lq = x[ids] - log_z
        kl = float(np.sum(np.exp(lp) * (lp - lq)))
        if np.isfinite(ref["log_rest"]):
            mask = np.ones(len(x), dtype=bool)
            mask[ids] = False
            z_rest = e[mask].sum()
            lq_rest = np.log(z_rest) - np.log(z) if z_rest > 0 else -np.inf
            lr = float(ref["log_rest"])
            kl += np.exp(lr) * (lr - lq_rest)
        self.kld.append(kl)
        self.base_nll -= float(ref["logp_next"])
        self.agree += int(np.argmax(x)) == int(ids[0])

    def result(self):
        import numpy as np
        n = len(self.kld)
        v = sorted(self.kld)
        return {"ppl": float(np.exp(self.nll / n)), "tokens": n, "base_ppl": float(np.exp(self.base_nll / n)),
                "kld_mean": float(np.mean(self.kld)), "kld_p99": v[(99 * n + 99) // 100 - 1],
                "top1_agree": self.agree / n}


def llama_windows(job):
    """Scores windows [lo, hi) with llama.cpp; returns the scorer's sums."""
    model, threads, base_path, lo, hi = job
    from llama_cpp import Llama
    import numpy as np
    base = read_base(base_path)
    ctx = base["ctx"]
    t0 = time.time()
    llm = Llama(model_path=model, n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True,
                n_threads=threads, n_threads_batch=threads, verbose=False)
    sc = Scorer()
    for w in range(lo, hi):
        win = [int(t) for t in base["tokens"][w]]
        llm.reset()
        llm.eval(win)
        scores = np.asarray(llm.scores[:ctx], dtype=np.float32)
        for j in range(base["scored"]):
            pos = base["first"] + j
            sc.add(scores[pos], win[pos + 1], base["recs"][w * base["scored"] + j])
        print("bench_ppl: llama.cpp window %d/%d (%.0fs)" % (w + 1, base["windows"], time.time() - t0),
              file=sys.stderr, flush=True)
    return sc.nll, sc.kld, sc.agree, sc.base_nll


def run_llama(args, base):
    """The windows split among --jobs processes (a window's numbers do not
    depend on which process or how many threads ran it)."""
    import multiprocessing
    import llama_cpp
    t0 = time.time()
    n = base["windows"]
    jobs = [(str(args.model), args.threads, str(args.base), n * i // args.jobs, n * (i + 1) // args.jobs)
            for i in range(args.jobs)]
    if args.jobs == 1:
        parts = [llama_windows(jobs[0])]
    else:
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            parts = pool.map(llama_windows, jobs)
    sc = Scorer()
    for nll, kld, agree, base_nll in parts:
        sc.nll += nll
        sc.kld += kld
        sc.agree += agree
        sc.base_nll += base_nll
    r = sc.result()
    r["windows"] = n
    r["seconds"] = round(time.time() - t0, 2)
    r["version"] = llama_cpp.__version__
    return r


def run_aerie(args, base):
    cmd = [str(args.aerie), "perplexity", "--model", str(args.model), "--file", str(args.text),
           "--ctx", str(base["ctx"]), "--kl-base", str(args.base)] + shlex.split(args.aerie_args)
    print("bench_ppl: " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, stdout=subprocess.PIPE, check=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def requantize(src, ftype, threads):
    """src requantized by llama.cpp's own quantizer to ftype (a name of
    llama.cpp's, e.g. Q4_K_M), kept in build/bench_files/ and reused."""
    import llama_cpp
    dst = ROOT / "build" / "bench_files" / ("%s.%s.gguf" % (Path(src).name.rsplit(".", 2)[0], ftype))
    if dst.exists():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    code = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype, None)
    if code is None:
        raise SystemExit("--requantize %s: llama.cpp has no such file type" % ftype)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = code
    params.nthread = threads
    params.allow_requantize = True  # the shipped file is already quantized (Q4_1, its embedding Q8_0)
    tmp = dst.with_suffix(".part")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
        raise SystemExit("llama.cpp could not quantize %s to %s" % (src, ftype))
    tmp.rename(dst)
    return dst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--text", default=str(TEXT))
    ap.add_argument("--base", default=str(BASE))
    ap.add_argument("--aerie", default=str(ROOT / "build" / "aerie"))
    ap.add_argument("--aerie-args", default="", help="more settings for `aerie perplexity`, as one string")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (aerie: --aerie-args)")
    ap.add_argument("--jobs", type=int, default=1, help="llama.cpp processes, each scoring a share of the windows")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--no-aerie", action="store_true")
    ap.add_argument("--requantize", metavar="TYPE",
                    help="score --model requantized by llama.cpp's quantizer to TYPE (e.g. Q4_K_M) instead; "
                         "both engines read that file")
    args = ap.parse_args()
    if args.requantize:
        args.model = str(requantize(args.model, args.requantize, args.threads))
        print("requantized by llama.cpp: %s" % args.model, file=sys.stderr)
    base = read_base(args.base)
    rows = {}
    if not args.no_aerie:
        rows["aerie"] = run_aerie(args, base)
    if not args.no_llama:
        rows["llama.cpp"] = run_llama(args, base)
    any_row = next(iter(rows.values()))
    print("%d windows of %d tokens, %d scored; f32 transformers ppl %.4f" % (
        base["windows"], base["ctx"], any_row["tokens"], any_row["base_ppl"]))
    print("%-10s %10s %12s %12s %11s %9s" % ("engine", "ppl", "kld_mean", "kld_p99", "top1_agree", "seconds"))
    for name, r in rows.items():
        print("%-10s %10.4f %12.4g %12.4g %11.4f %9.1f" % (
            name, r["ppl"], r["kld_mean"], r["kld_p99"], r["top1_agree"], r["seconds"]))
    print(json.dumps({"ctx": base["ctx"], "windows": base["windows"], "tokens": any_row["tokens"],
                      "base_ppl": any_row["base_ppl"], "engines": rows}))


if __name__ == "__main__":
    main()
