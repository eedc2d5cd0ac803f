#!/usr/bin/env python3
"""Golden data for services/model/quant.c, made by an independent decoder.

Uses the PyPI `gguf` package (llama.cpp's own Python reader and numpy
dequantizers) so the C code is checked against a second implementation,
not against itself.

Writes:
  tests/golden/quant/smollm2.json    sampled rows and float64 sums of real
                                     tensors of the default model
  tests/golden/quant/synthetic.json  random blocks of every format the
                                     package can dequantize, with the
                                     expected f32 bit patterns

Usage: tools/gen_quant_golden.py [MODEL.gguf]   (run from the repo root)
"""
import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = ROOT / "tests" / "golden" / "quant"

# (tensor name, rows to sample); 64 leading columns of each row.
SAMPLES = [
    ("token_embd.weight", [0, 1, 2, 3, -1]),   # Q8_0 [576, 49152]
    ("blk.0.attn_q.weight", [0, -1]),          # Q4_1 [576, 576]
    ("blk.0.ffn_down.weight", [0, -1]),        # Q4_1 [1536, 576]
    ("blk.0.attn_norm.weight", [0]),           # F32 [576]
    ("output_norm.weight", [0]),               # F32 [576]
]
COLS = 64

# Byte ranges of each format's f16 scale fields: random bytes there could
# be inf/nan, which would only test nan propagation, so they get finite
# values instead.
HALF_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2],
    T.Q6_K: [208],
}


# Types added after the cases above were committed. They draw from their
# own generator, after the others, so the older cases keep their bytes.
# IQ4_XS's u16 at 2 is bit fields, not a half; MXFP4's scale is an E8M0
# byte, set to the edge values below in its first blocks.
LATER_HALF_FIELDS = {T.IQ4_NL: [0], T.IQ4_XS: [0], T.MXFP4: []}
MXFP4_EDGE_E = [0, 1, 2, 127, 128, 254, 255]


def real_model(path):
    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    out = []
    for name, rows in SAMPLES:
        t = tensors[name]
        x = dequantize(t.data, t.tensor_type).astype(np.float32)
        x = x.reshape(-1, int(t.shape[0]))  # rows of ne[0] elements
        x64 = x.astype(np.float64)
        samples = []
        for r in rows:
            r = r % x.shape[0]
            samples.append({"row": r, "values": [float(v) for v in x[r, :COLS]]})
        out.append({
            "name": name,
            "type": t.tensor_type.name,
            "ne": [int(d) for d in t.shape],
            "sum": float(x64.sum()),
            "sum_abs": float(np.abs(x64).sum()),
            "samples": samples,
        })
    return {"model": path.name, "cols": COLS, "tensors": out}


def synthetic():
    rng = np.random.default_rng(20240531)
    cases = []
    for qt, fields in HALF_FIELDS.items():
        _, type_size = GGML_QUANT_SIZES[qt]
        blocks = rng.integers(0, 256, size=(2, type_size), dtype=np.uint8)
        for b in range(2):
            for off in fields:
                h = np.float16(rng.uniform(-2.0, 2.0))
                blocks[b, off:off + 2] = np.frombuffer(h.tobytes(), dtype=np.uint8)
        cases.append((qt, blocks.reshape(-1)))
    # Every f16 and bf16 bit pattern class: random bits, so subnormals,
    # infinities and nans appear too.
    cases.append((T.F16, rng.integers(0, 256, size=256, dtype=np.uint8)))
    cases.append((T.BF16, rng.integers(0, 256, size=256, dtype=np.uint8)))
    rng = np.random.default_rng(20250807)
    for qt, fields in LATER_HALF_FIELDS.items():
        _, type_size = GGML_QUANT_SIZES[qt]
        n_blocks = len(MXFP4_EDGE_E) + 1 if qt == T.MXFP4 else 2
        blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
        for b in range(n_blocks):
            for off in fields:
                h = np.float16(rng.uniform(-2.0, 2.0))
                blocks[b, off:off + 2] = np.frombuffer(h.tobytes(), dtype=np.uint8)
        if qt == T.MXFP4:
            blocks[:len(MXFP4_EDGE_E), 0] = MXFP4_EDGE_E
        cases.append((qt, blocks.reshape(-1)))
    out = []
    for qt, raw in cases:
        with np.errstate(over="ignore"):  # MXFP4 at e = 255: 12 * 2^127 is inf
            y = dequantize(raw, qt).astype(np.float32).reshape(-1)
        out.append({
            "type": qt.name,
            "n": int(y.size),
            "bytes_hex": raw.tobytes().hex(),
            # Each value's f32 bit pattern as 8 hex digits, most significant
            # first, concatenated.
            "expect_f32_bits": "".join(f"{int(v):08x}" for v in y.view(np.uint32)),
        })
    return {"cases": out}


def main():
    model = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_MODEL
    if not model.exists():
        sys.exit(f"{model}: missing; run `make model` first")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "smollm2.json").write_text(json.dumps(real_model(model), indent=1) + "\n")
    (OUT / "synthetic.json").write_text(json.dumps(synthetic(), indent=1) + "\n")
    print(f"wrote {OUT / 'smollm2.json'} and {OUT / 'synthetic.json'}")


if __name__ == "__main__":
    main()
