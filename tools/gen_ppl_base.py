#!/usr/bin/env python3
"""A perplexity base for `aerie perplexity --kl-base` (format: target/ppl.h),
from Hugging Face transformers in float32 on the default model file's
dequantized weights: the reference that aerie and llama.cpp are measured
against.

The model is loaded exactly as tools/gen_llama_golden.py loads it
(AutoModelForCausalLM.from_pretrained(gguf_file=..., dtype=float32,
attn_implementation="eager")), and every weight is checked bit-identical to
the `gguf` package's own dequantization with that script's check_weights.

Windows, as `aerie perplexity` cuts them: the text is tokenized with
tests/golden/tokenizer/smollm/tokenizer.json (SmolLM2's), as plain text
(add_special_tokens=False; special tokens in the text are not parsed, as
aerie tokenizes it), cut into n // ctx windows of ctx tokens; when the GGUF
says add_bos_token, each window's first token becomes BOS (SmolLM2: no).
Each window is one forward pass from an empty cache. For each scored
position (ctx // 2 .. ctx - 2 of each window) the base keeps, from
log_softmax in float64 of the f32 logits: the log-probability of the next
token, the top K log-probabilities (descending, ties by lower id) and the
log of the mass outside them (logsumexp of the rest).

  python3 tools/gen_ppl_base.py --text tests/golden/ppl/corpus.txt \\
      --out tests/golden/ppl/corpus.base                  # ctx 512, K 32
  python3 tools/gen_ppl_base.py --text tests/golden/ppl/small.txt --ctx 128 \\
      --out tests/golden/ppl/small.base

Needs: pip install torch transformers gguf tokenizers numpy; make model.
Uses 2 threads. Output is deterministic for given package versions.
"""
import argparse
import os
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_llama_golden as golden  # noqa: E402  (MODEL, check_weights, sha256)

MAGIC = b"AEPPLB01"
FLAG_BOS = 1


def windows_of(ids, ctx, bos):
    """The windows the model sees: [n // ctx][ctx], BOS first when given."""
    n_win = len(ids) // ctx
    if n_win == 0:
        raise SystemExit("the text has %d tokens, fewer than one window of --ctx %d" % (len(ids), ctx))
    wins = [list(ids[w * ctx:(w + 1) * ctx]) for w in range(n_win)]
    if bos is not None:
        for win in wins:
            win[0] = bos
    return wins


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=32)
    args = ap.parse_args()
    if args.ctx < 4:
        raise SystemExit("--ctx must be at least 4")

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF conversion bar
    import numpy as np
    import torch
    import transformers
    from gguf import GGUFReader
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    torch.set_num_threads(golden.THREADS)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    assert golden.sha256(golden.MODEL) == golden.MODEL_SHA256, "unexpected model file"

    reader = GGUFReader(str(golden.MODEL))

    def field(k):
        return reader.fields[k].contents() if k in reader.fields else None
    n_head = int(field("llama.attention.head_count"))
    n_kv = int(field("llama.attention.head_count_kv"))
    bos = int(field("tokenizer.ggml.bos_token_id")) if field("tokenizer.ggml.add_bos_token") else None

    tok = Tokenizer.from_file(str(golden.TOKENIZER))
    text = Path(args.text).read_text(encoding="utf-8")
    ids = tok.encode(text, add_special_tokens=False).ids
    wins = windows_of(ids, args.ctx, bos)
    ctx, k = args.ctx, args.top_k
    first = ctx // 2

    model = AutoModelForCausalLM.from_pretrained(
        str(golden.MODEL.parent), gguf_file=golden.MODEL.name, dtype=torch.float32,
        attn_implementation="eager").eval()
    golden.check_weights(model, reader, n_head, n_kv)
    vocab = model.config.vocab_size
    print("gen_ppl_base: %d tokens, %d windows of %d, %d scored, top %d; model checked (%.0fs)" % (
        len(ids), len(wins), ctx, len(wins) * (ctx - 1 - first), k, time.time() - t0), file=sys.stderr)

    records = []
    nll = 0.0
    n_scored = 0
    for w, win in enumerate(wins):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([win], dtype=torch.long), use_cache=False).logits[0]
        lp = torch.log_softmax(logits.double(), dim=-1).numpy()
        for pos in range(first, ctx - 1):
            row = lp[pos]
            cand = np.argpartition(-row, k)[:k + 1] if k < vocab else np.arange(vocab)
            order = cand[np.lexsort((cand, -row[cand]))][:k]
            rest = np.ones(vocab, dtype=bool)
            rest[order] = False
            log_rest = float(np.logaddexp.reduce(row[rest])) if rest.any() else float("-inf")
            nxt = win[pos + 1]
            nll -= row[nxt]
            n_scored += 1
            records.append(struct.pack("<ff", row[nxt], log_rest) +
                           np.asarray(order, dtype="<i4").tobytes() +
                           np.asarray(row[order], dtype="<f4").tobytes())
        print("gen_ppl_base: window %d/%d ppl %.4f (%.0fs)" % (
            w + 1, len(wins), np.exp(nll / n_scored), time.time() - t0), file=sys.stderr)

    header = MAGIC + struct.pack("<5I", vocab, ctx, len(wins), k, FLAG_BOS if bos is not None else 0)
    body = b"".join(np.asarray(win, dtype="<i4").tobytes() for win in wins)
    with open(args.out, "wb") as f:
        f.write(header + body + b"".join(records))
    print("gen_ppl_base: wrote %s: ppl %.6f over %d tokens, %d bytes, %.0fs (torch %s, transformers %s)" % (
        args.out, np.exp(nll / n_scored), n_scored, os.path.getsize(args.out), time.time() - t0,
        torch.__version__, transformers.__version__), file=sys.stderr)


if __name__ == "__main__":
    main()
