#!/usr/bin/env python3
"""Aerie against llama.cpp on the GGUF files people download.

Makes a model of a real shape with `aerie make-model` (random weights, the
Llama-3.1-8B shape cut to a few layers and a smaller vocabulary, f16), has
llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize) write
each file type from it, and measures every file with both engines in the
same run, at the same thread count, batch 1:

  - decode tok/s: greedy steps of one token after a prompt;
  - prefill tok/s: the prompt's tokens over the time of its pass;
  - the cost of an 8-token pass over a 1-token pass, after the same prefix
    and with logits for every token (what verifying a draft costs);
  - aerie's bytes of weights read per decode step over the file's size.

Aerie is `aerie bench` (cli/bench.c: its decode, prefill and verify-cost
figures, and weight_bytes_per_step). llama.cpp is measured here through
llama-cpp-python's C API in the same way as bench.c measures aerie: the
same synthetic prompt tokens (splitmix64, seed 1), a warm-up prefill, the
timed prefill, greedy decode steps (one llama_decode each, the argmax of
its logits picked), then chains of 1, 2, 4, 8, 16 and 32 tokens after the
prompt, the KV cache cut back to the prompt before each
(llama_memory_seq_rm), sizes interleaved, the median of --verify-repeat
passes each. Logits for every token of a chain are asked for, as a
verify pass needs them: with the last token's only, llama.cpp drops the
other tokens after the last layer's attention, and an 8-token pass of a
1-layer model cost 59 ms instead of 221.

Each round measures every file with both engines, one after the other,
the engine that goes first alternating from file to file and round to
round, so the host's noise hits both alike; each measurement is a fresh
process. The table gives medians over the --repeat rounds, its ratios the
median of each round's aerie/llama.cpp ratio. A measurement that fails or
times out becomes an error cell, explained under the table; the run goes
on.

  python3 tools/bench_files.py                      # 5 types, 4 layers, 3 rounds
  python3 tools/bench_files.py --types Q4_K_M,Q4_0 --aerie-args "--act-bits 8"
  python3 tools/bench_files.py --layers 1 --vocab 8192 --types Q4_0,Q8_0 --repeat 1
  python3 tools/bench_files.py --json out.json     # also every round's figures

A type is a llama.cpp file type (Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, Q5_0,
Q3_K_M, Q2_K, IQ4_NL, ...: LLAMA_FTYPE_MOSTLY_<type>), the source type
itself (F16), or aerie-<type> for a file `aerie make-model --type <type>`
writes (aerie-q4_0: every matrix Q4_0). The files are kept in --cache and
reused (--rebuild makes them again). llama.cpp will not load a file that
has no tokenizer, and make-model writes none, so the source file gets
tokenizer.ggml.model "none" and llama.vocab_size, which the quantizer
copies into every file it writes.

The figures are as steady as the host: llama.cpp's threads spin at
barriers, and while other work holds a core its 2-thread decode moved
between 6 and 25 tok/s from one file to the next in one run.

Needs: make build/aerie; pip install numpy llama-cpp-python (0.3.36 tested).
"""
import argparse
import json
import multiprocessing
import os
import shlex
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TYPES = "Q4_K_M,Q5_K_M,Q6_K,Q8_0,Q4_0"
VERIFY_SIZES = (1, 2, 4, 8, 16, 32)  # as cli/bench.c
SHAPE_VOCAB = {"llama-3.1-8b": 128256, "smollm2-135m": 49152}


def log(msg):
    print("bench_files: " + msg, file=sys.stderr, flush=True)


class Failed(Exception):
    """A measurement or a file that could not be had; its message goes in the table's notes."""


# ---- the files ---------------------------------------------------------------

GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
GGUF_STRING, GGUF_ARRAY, GGUF_UINT32 = 8, 9, 4


def gguf_str(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_add_vocab(src, dst, vocab):
    """Copies the GGUF file src to dst with tokenizer.ggml.model "none" and
    llama.vocab_size added: what llama.cpp needs to load a file without a
    tokenizer (it then has `vocab` dummy tokens). The tensor data is copied
    as it is; only its start moves, to the file's alignment."""
    with open(src, "rb") as f:
        head = f.read(24)
        magic, version, n_tensors, n_kv = struct.unpack("<4sIQQ", head)
        if magic != b"GGUF" or version < 2:
            raise Failed("%s: not a GGUF v2/v3 file" % src)

        def read_str():
            (n,) = struct.unpack("<Q", f.read(8))
            return f.read(n).decode("utf-8", "replace")

        def skip_value(t):
            if t == GGUF_STRING:
                read_str()
            elif t == GGUF_ARRAY:
                et, n = struct.unpack("<IQ", f.read(12))
                if et in GGUF_SCALAR:
                    f.seek(GGUF_SCALAR[et] * n, 1)
                else:
                    for _ in range(n):
                        skip_value(et)
            else:
                f.seek(GGUF_SCALAR[t], 1)

        align, arch, keys = 32, "llama", set()
        for _ in range(n_kv):
            key = read_str()
            keys.add(key)
            (t,) = struct.unpack("<I", f.read(4))
            if key == "general.alignment" and t == GGUF_UINT32:
                (align,) = struct.unpack("<I", f.read(4))
            elif key == "general.architecture" and t == GGUF_STRING:
                arch = read_str()
            else:
                skip_value(t)
        kv_end = f.tell()
        for _ in range(n_tensors):
            read_str()
            (nd,) = struct.unpack("<I", f.read(4))
            f.seek(8 * nd + 4 + 8, 1)
        info_end = f.tell()
        data_start = (info_end + align - 1) // align * align
        f.seek(24)
        kvs = f.read(kv_end - 24)
        infos = f.read(info_end - kv_end)
        add = b""
        if "tokenizer.ggml.model" not in keys:
            add += gguf_str("tokenizer.ggml.model") + struct.pack("<I", GGUF_STRING) + gguf_str("none")
            n_kv += 1
        if arch + ".vocab_size" not in keys:
            add += gguf_str(arch + ".vocab_size") + struct.pack("<II", GGUF_UINT32, vocab)
            n_kv += 1
        header = struct.pack("<4sIQQ", magic, version, n_tensors, n_kv) + kvs + add + infos
        header += b"\0" * ((-len(header)) % align)
        tmp = Path(str(dst) + ".part")
        with open(tmp, "wb") as out:
            out.write(header)
            f.seek(data_start)
            while True:
                chunk = f.read(64 << 20)
                if not chunk:
                    break
                out.write(chunk)
        os.replace(tmp, dst)


def model_vocab(args):
    return args.vocab or SHAPE_VOCAB.get(args.shape, 0)


def stem(args):
    return "%s-%dl-%dv" % (args.shape, args.layers, model_vocab(args))


def aerie_make(args, mtype):
    """A file `aerie make-model --type mtype` writes, llama.cpp-loadable; reused when in the cache."""
    dst = Path(args.cache) / ("%s-aerie-%s.gguf" % (stem(args), mtype))
    if dst.exists() and not args.rebuild:
        return dst
    raw = Path(str(dst) + ".raw")
    cmd = [str(args.aerie), "make-model", "--shape", args.shape, "--layers", str(args.layers),
           "--vocab", str(args.vocab), "--type", mtype, "--out", str(raw)]
    log(" ".join(shlex.quote(c) for c in cmd))
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise Failed("aerie make-model --type %s: %s" % (mtype, last_line(r.stderr) or "exit %d" % r.returncode))
    try:
        gguf_add_vocab(raw, dst, model_vocab(args))
    finally:
        raw.unlink(missing_ok=True)
    return dst


def quantize_worker(src, dst, ftype_name, nthread):
    """In a child process: llama.cpp's quantizer writes dst from src."""
    import ctypes
    import llama_cpp
    ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype_name, None)
    if ftype is None:
        raise Failed("llama.cpp has no file type %s (LLAMA_FTYPE_MOSTLY_%s)" % (ftype_name, ftype_name))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = nthread
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise Failed("llama_model_quantize returned %d" % rc)
    return os.path.getsize(dst)


def file_for(args, src, typ):
    """The file of one type: the source itself, aerie's own, or llama.cpp's quantizer's."""
    if typ.lower() in (args.source_type, "aerie-" + args.source_type):
        return src
    if typ.lower().startswith("aerie-"):
        return aerie_make(args, typ[len("aerie-"):].lower())
    dst = Path(args.cache) / ("%s-%s.gguf" % (stem(args), typ.upper()))
    if dst.exists() and not args.rebuild:
        return dst
    part = Path(str(dst) + ".part")
    log("llama.cpp quantizes %s -> %s" % (src.name, dst.name))
    t0 = time.time()
    try:
        in_child(quantize_worker, (str(src), str(part), typ.upper(), args.threads), args.timeout)
        os.replace(part, dst)
    finally:
        part.unlink(missing_ok=True)
    log("  %.1f GB in %.0f s" % (os.path.getsize(dst) / 1e9, time.time() - t0))
    return dst


# ---- the child processes -------------------------------------------------------

def last_line(text, n=1):
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " / ".join(lines[-n:])


def child_main(conn, fn, fn_args, log_path):
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        conn.send(("ok", fn(*fn_args)))
    except BaseException as e:  # the parent reports it; a crash sends nothing
        conn.send(("error", str(e) if isinstance(e, Failed) else "%s: %s" % (type(e).__name__, e)))


def in_child(fn, fn_args, timeout):
    """fn(*fn_args) in a fresh process (a crash or an abort in llama.cpp
    does not end the run, and memory is returned between measurements);
    raises Failed with the reason and the last lines it logged."""
    ctx = multiprocessing.get_context("spawn")
    fd, log_path = tempfile.mkstemp(prefix="bench_files.", suffix=".log")
    os.close(fd)
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=child_main, args=(send, fn, fn_args, log_path))
    p.start()
    send.close()
    status, value = "error", None
    try:
        if recv.poll(timeout):
            status, value = recv.recv()
        else:
            value = "timed out after %d s" % timeout
    except EOFError:
        pass
    finally:
        p.join(60 if status == "ok" else 0)
        if p.is_alive():
            p.kill()
            p.join()
        text = Path(log_path).read_text(errors="replace")
        errs = [ln for ln in text.splitlines() if "error" in ln.lower() or "failed" in ln.lower()]
        tail = last_line("\n".join(errs) if errs else text, 2)
        os.unlink(log_path)
    if status == "ok":
        return value
    if value is None:
        value = "process died (exit %s)" % p.exitcode
    raise Failed(value + (" [log: %s]" % tail if tail else ""))


# ---- the measurements --------------------------------------------------------

def splitmix64_tokens(seed, n, vocab):
    """cli/bench.c's synthetic prompt: splitmix64 from seed, mod vocab."""
    m = (1 << 64) - 1
    s, out = seed, []
    for _ in range(n):
        s = (s + 0x9E3779B97F4A7C15) & m
        z = s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        z ^= z >> 31
        out.append(z % vocab)
    return out


def llama_worker(path, threads, n_prompt, n_gen, reps):
    """In a child process: llama.cpp's figures for one file, as cli/bench.c takes aerie's."""
    import numpy as np
    import llama_cpp
    from llama_cpp import Llama
    vmax = max(VERIFY_SIZES)
    n_batch = max(n_prompt, vmax)
    kw = dict(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_prompt + max(n_gen, vmax) + 8,
              n_batch=n_batch, n_ubatch=min(n_batch, 512), logits_all=False)
    t0 = time.perf_counter()
    try:
        llm = Llama(verbose=False, **kw)
    except ValueError:  # verbose=False hid llama.cpp's reason: load again to log it
        Llama(verbose=True, **kw)
        raise
    load_s = time.perf_counter() - t0
    ctx = llm.ctx
    mem = llama_cpp.llama_get_memory(ctx)
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm.model))
    if vocab <= 0:
        raise Failed("llama.cpp sees no vocabulary")
    batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
    try:
        def fill(tokens, pos0, all_logits):
            batch.n_tokens = len(tokens)
            for i, t in enumerate(tokens):
                batch.token[i] = t
                batch.pos[i] = pos0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = all_logits or i == len(tokens) - 1

        def decode():
            rc = llama_cpp.llama_decode(ctx, batch)
            if rc != 0:
                raise Failed("llama_decode returned %d" % rc)
            llama_cpp.llama_synchronize(ctx)

        def greedy():
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(vocab,))
            return int(np.argmax(row))

        # Warm-up (bench.c: another prompt, seed 2), then the timed prompt (seed 1).
        fill(splitmix64_tokens(2, n_prompt, vocab), 0, False)
        decode()
        llama_cpp.llama_memory_clear(mem, True)
        fill(splitmix64_tokens(1, n_prompt, vocab), 0, False)
        t0 = time.perf_counter()
        decode()
        nxt = greedy()
        t_prefill = time.perf_counter() - t0
        t_decode = 0.0
        for g in range(n_gen):
            t0 = time.perf_counter()
            fill([nxt], n_prompt + g, False)
            decode()
            nxt = greedy()
            t_decode += time.perf_counter() - t0
        # Verify: a chain of n tokens after the prompt, logits for each; bench.c's tokens.
        times = {n: [] for n in VERIFY_SIZES}
        for _ in range(reps):
            for n in VERIFY_SIZES:
                if not llama_cpp.llama_memory_seq_rm(mem, 0, n_prompt, -1):
                    raise Failed("llama_memory_seq_rm could not cut the cache back to the prompt")
                fill([(i * 7919 + 13) % vocab for i in range(n)], n_prompt, True)
                t0 = time.perf_counter()
                decode()
                times[n].append(time.perf_counter() - t0)
    finally:
        llama_cpp.llama_batch_free(batch)
    med = {n: statistics.median(v) for n, v in times.items()}
    return {"prefill_tok_per_s": n_prompt / t_prefill, "decode_tok_per_s": n_gen / t_decode,
            "verify_1_ms": med[1] * 1e3, "verify_cost": {str(n): med[n] / med[1] for n in VERIFY_SIZES},
            "load_seconds": load_s, "n_vocab": vocab}


def run_llama(args, path):
    return in_child(llama_worker, (str(path), args.threads, args.prompt_tokens, args.gen_tokens,
                                   args.verify_repeat), args.timeout)


def run_aerie(args, path):
    cmd = [str(args.aerie), "bench", "--model", str(path), "--device", "cpu", "--threads", str(args.threads),
           "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens),
           "--repeat", str(args.verify_repeat)] + shlex.split(args.aerie_args)
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        raise Failed("timed out after %d s" % args.timeout)
    if r.returncode != 0:
        raise Failed(last_line(r.stderr, 2) or "exit %d" % r.returncode)
    try:
        out = json.loads(r.stdout.strip().splitlines()[-1])
        out["verify_cost"] = {str(k): v for k, v in out["verify_cost"].items()}
        for key in ("decode_tok_per_s", "prefill_tok_per_s", "weight_bytes_per_step"):
            float(out[key])
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise Failed("unreadable output (%s): %s" % (e, r.stdout[-200:]))
    return out


# ---- the table ----------------------------------------------------------------

class Notes:
    """Error messages, numbered once each, for the cells that cite them."""

    def __init__(self):
        self.msgs = []

    def ref(self, msg):
        if msg not in self.msgs:
            self.msgs.append(msg)
        return self.msgs.index(msg) + 1


def summarize(typ, runs, size):
    """Medians over the rounds of one file's runs: {engine: [result or Failed or None per round]}."""
    ok = {e: [r for r in rs if isinstance(r, dict)] for e, rs in runs.items()}

    def med(engine, get):
        vals = [get(r) for r in ok[engine]]
        return statistics.median(vals) if vals else None

    def paired(get):
        vals = [get(a) / get(b) for a, b in zip(runs["aerie"], runs["llama.cpp"])
                if isinstance(a, dict) and isinstance(b, dict) and get(b)]
        return statistics.median(vals) if vals else None

    s = {"type": typ, "file_bytes": size, "rounds": {e: len(rs) for e, rs in runs.items()},
         "ok_rounds": {e: len(v) for e, v in ok.items()}}
    for e in runs:
        s[e] = {"decode_tok_per_s": med(e, lambda r: r["decode_tok_per_s"]),
                "prefill_tok_per_s": med(e, lambda r: r["prefill_tok_per_s"]),
                "verify_cost_8": med(e, lambda r: r["verify_cost"]["8"]),
                "verify_1_ms": med(e, lambda r: r["verify_1_ms"]),
                "errors": [str(r) for r in runs[e] if isinstance(r, Failed)]}
    wb = med("aerie", lambda r: r["weight_bytes_per_step"])
    s["aerie"]["weight_bytes_per_step"] = wb
    s["aerie_bytes_per_step_over_file"] = wb / size if wb and size else None
    s["decode_ratio"] = paired(lambda r: r["decode_tok_per_s"])
    s["prefill_ratio"] = paired(lambda r: r["prefill_tok_per_s"])
    return s


def cell(s, engine, value, fmt, notes):
    if value is not None:
        return fmt % value
    if engine is None:
        return "—"
    errs = s[engine]["errors"] if engine in s else []
    if errs:
        return "error [%d]" % notes.ref("%s, %s: %s" % (s["type"], engine, errs[0]))
    return "—"


def table(summaries, notes):
    head = ["file", "GB", "aerie decode tok/s", "llama.cpp decode tok/s", "decode ratio",
            "aerie prefill tok/s", "llama.cpp prefill tok/s", "prefill ratio",
            "aerie 8-tok/1-tok", "llama.cpp 8-tok/1-tok", "aerie read/step ÷ file"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        if "file_error" in s:
            ref = notes.ref("%s: %s" % (s["type"], s["file_error"]))
            lines.append("| %s | error [%d] |%s" % (s["type"], ref, " |" * (len(head) - 2)))
            continue
        a, l = s["aerie"], s["llama.cpp"]
        both = "aerie" if a["errors"] else "llama.cpp"  # which failure a ratio's empty cell cites
        wb = a["weight_bytes_per_step"]
        read = ("%.2f GB = %.2fx" % (wb / 1e9, s["aerie_bytes_per_step_over_file"])) if wb else None
        row = [s["type"], "%.2f" % (s["file_bytes"] / 1e9),
               cell(s, "aerie", a["decode_tok_per_s"], "%.1f", notes),
               cell(s, "llama.cpp", l["decode_tok_per_s"], "%.1f", notes),
               cell(s, both, s["decode_ratio"], "%.2fx", notes),
               cell(s, "aerie", a["prefill_tok_per_s"], "%.1f", notes),
               cell(s, "llama.cpp", l["prefill_tok_per_s"], "%.1f", notes),
               cell(s, both, s["prefill_ratio"], "%.2fx", notes),
               cell(s, "aerie", a["verify_cost_8"], "%.2f", notes),
               cell(s, "llama.cpp", l["verify_cost_8"], "%.2f", notes),
               cell(s, "aerie", read, "%s", notes)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[1:]))
    ap.add_argument("--types", default=TYPES, help="comma-separated file types (default: %(default)s)")
    ap.add_argument("--shape", default="llama-3.1-8b", help="aerie make-model --shape (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=4, help="blocks of the model (default: %(default)s)")
    ap.add_argument("--vocab", type=int, default=49152, help="its vocabulary (default: %(default)s)")
    ap.add_argument("--source-type", default="f16", choices=["f16", "bf16", "f32"],
                    help="what make-model writes for the quantizer to read (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="threads of both engines, and the quantizer's (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the table has their medians (default: %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt before decoding and verifying (default: %(default)s)")
    ap.add_argument("--gen-tokens", type=int, default=128, help="decode steps (default: %(default)s)")
    ap.add_argument("--verify-repeat", type=int, default=5,
                    help="passes of each chain size, median (both engines; aerie bench --repeat) (default: %(default)s)")
    ap.add_argument("--aerie", default=str(ROOT / "build" / "aerie"))
    ap.add_argument("--aerie-args", default="", help='more flags for `aerie bench`, as one string (e.g. "--act-bits 8")')
    ap.add_argument("--cache", default=str(ROOT / "build" / "bench_files"), help="where the files are kept (default: %(default)s)")
    ap.add_argument("--rebuild", action="store_true", help="make the files again even when cached")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds for one measurement or file (default: %(default)s)")
    ap.add_argument("--no-llama", action="store_true", help="aerie only")
    ap.add_argument("--no-aerie", action="store_true", help="llama.cpp only")
    ap.add_argument("--json", nargs="?", const="-", metavar="FILE",
                    help="also every round's figures as JSON, to FILE (- or nothing: one line on stdout)")
    args = ap.parse_args()
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    if not types or args.repeat < 1 or args.layers < 0 or args.vocab < 0:
        ap.error("need at least one type, --repeat >= 1")
    if not model_vocab(args):
        ap.error("--vocab 0 with an unknown shape")
    if not Path(args.aerie).exists():
        raise SystemExit("bench_files: %s not found (make build/aerie)" % args.aerie)
    try:
        import llama_cpp
        llama_version = llama_cpp.__version__
    except ImportError:
        llama_version = "not installed"
        if not args.no_llama:
            raise SystemExit("bench_files: llama_cpp not installed (pip install llama-cpp-python, or --no-llama)")
    Path(args.cache).mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    # The files.
    try:
        src = aerie_make(args, args.source_type)
    except Failed as e:
        raise SystemExit("bench_files: the source model: %s" % e)
    files, file_errors = {}, {}
    for typ in types:
        try:
            files[typ] = file_for(args, src, typ)
        except Failed as e:
            log("%s: %s" % (typ, e))
            file_errors[typ] = str(e)

    # The rounds.
    engines = [e for e, off in (("aerie", args.no_aerie), ("llama.cpp", args.no_llama)) if not off]
    runs = {typ: {"aerie": [], "llama.cpp": []} for typ in files}
    measure = {"aerie": run_aerie, "llama.cpp": run_llama}
    for rnd in range(args.repeat):
        for i, (typ, path) in enumerate(files.items()):
            order = engines if (rnd + i) % 2 == 0 else engines[::-1]
            for engine in order:
                t0 = time.time()
                try:
                    r = measure[engine](args, path)
                    log("round %d/%d %s %s: decode %.1f tok/s, prefill %.1f tok/s, 8/1 %.2f (%.0f s)" % (
                        rnd + 1, args.repeat, typ, engine, r["decode_tok_per_s"], r["prefill_tok_per_s"],
                        r["verify_cost"]["8"], time.time() - t0))
                except Failed as e:
                    r = e
                    log("round %d/%d %s %s: failed: %s" % (rnd + 1, args.repeat, typ, engine, e))
                runs[typ][engine].append(r)

    # The table.
    notes = Notes()
    summaries = []
    for typ in types:
        if typ in file_errors:
            summaries.append({"type": typ, "file_error": file_errors[typ]})
            continue
        s = summarize(typ, runs[typ], os.path.getsize(files[typ]))
        s["file"] = str(files[typ])
        summaries.append(s)
    aerie_any = next((r for rs in runs.values() for r in rs["aerie"] if isinstance(r, dict)), {})
    print("%s shape, %d layers, vocabulary %d, from %s by llama.cpp's quantizer (llama-cpp-python %s); "
          "batch 1, %d threads, %d-token prompt, %d decode steps; medians of %d rounds, ratios aerie over "
          "llama.cpp%s%s." % (
              args.shape, args.layers, model_vocab(args), args.source_type, llama_version, args.threads,
              args.prompt_tokens, args.gen_tokens, args.repeat,
              ("; aerie %s, %s-bit activations" % (aerie_any["simd"], aerie_any["act_bits"])) if aerie_any else "",
              ("; aerie bench " + args.aerie_args) if args.aerie_args else ""))
    print()
    print(table(summaries, notes))
    if notes.msgs:
        print()
        for i, m in enumerate(notes.msgs, 1):
            print("[%d] %s" % (i, m))
    if args.json:
        doc = {"shape": args.shape, "layers": args.layers, "vocab": model_vocab(args), "source_type": args.source_type,
               "threads": args.threads, "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
               "rounds": args.repeat, "verify_repeat": args.verify_repeat, "aerie_args": args.aerie_args,
               "llama_cpp_version": llama_version, "seconds": round(time.time() - t_start, 1), "files": summaries,
               "runs": {typ: {e: [r if isinstance(r, dict) else {"error": str(r)} for r in rs]
                              for e, rs in er.items()} for typ, er in runs.items()}}
        text = json.dumps(doc)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
