#!/usr/bin/env python3
"""Seed corpus for tests/fuzz/fuzz_gguf.c: a few tiny valid GGUF files.

Written with the PyPI `gguf` package's GGUFWriter (an independent writer),
then a v2 copy made by patching the version field, which is the only
difference between v2 and v3 for little-endian files.

Usage: tools/gen_fuzz_seeds.py   (writes tests/fuzz/corpus/gguf/*.gguf)
"""
import os
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, GGUFValueType as V
from gguf.constants import GGML_QUANT_SIZES

OUT = Path(__file__).resolve().parent.parent / "tests" / "fuzz" / "corpus" / "gguf"


def write(name, build, alignment=None):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        w = GGUFWriter(str(path), "llama")
        if alignment:
            w.add_custom_alignment(alignment)
        build(w)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        data = path.read_bytes()
    (OUT / name).write_bytes(data)
    return data


def raw_blocks(rng, qtype, n_blocks):
    """Random blocks with finite f16 scales in their usual places."""
    _, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    halves = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
              T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
    for off in halves.get(qtype, []):
        blocks[:, off:off + 2] = np.frombuffer(np.float16(0.5).tobytes(), dtype=np.uint8)
    return blocks


def all_values(w):
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 7)
    w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 1.5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "hello \"gguf\"\n")
    w.add_uint64("t.u64", 1 << 40)
    w.add_int64("t.i64", -(1 << 40))
    w.add_float64("t.f64", 0.1)
    w.add_array("t.arr_i32", [1, -2, 3])
    w.add_array("t.arr_str", ["a", "", "bc"])
    w.add_array("t.arr_f32", [0.5, 2.0])
    w.add_key_value("t.nested", [[1, 2], [3]], V.ARRAY, V.ARRAY)
    w.add_tensor("a", np.arange(4, dtype=np.float32))
    w.add_tensor("b", np.arange(6, dtype=np.float16).reshape(2, 3))


def quant_tensors(w):
    rng = np.random.default_rng(7)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "a", "b"])
    for qt in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K,
               T.Q6_K, T.BF16):
        blk, size = GGML_QUANT_SIZES[qt]
        raw = raw_blocks(rng, qt, 1) if blk > 1 else rng.integers(0, 256, size=(1, 64), dtype=np.uint8)
        w.add_tensor(f"w.{qt.name}", raw, raw_dtype=qt)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    v3 = write("values_v3.gguf", all_values)
    v2 = bytearray(v3)
    v2[4:8] = (2).to_bytes(4, "little")
    (OUT / "values_v2.gguf").write_bytes(bytes(v2))
    write("quants_align64.gguf", quant_tensors, alignment=64)
    write("empty.gguf", lambda w: None)
    for p in sorted(OUT.iterdir()):
        print(f"{p} {p.stat().st_size} bytes")


if __name__ == "__main__":
    main()
