#!/usr/bin/env python3
"""Writes the safetensors golden checkpoint that tests/unit/test_safetensors.c
reads: a 2-shard directory written by the reference `safetensors` package,
its model.safetensors.index.json, and expected.json with every value. Also
writes the seed corpus of tests/fuzz/fuzz_safetensors.c: the two shards and
a hand-laid file with what the reference never writes (odd offsets, a
scalar, a zero-size tensor).

Expected floats are the f32 bit patterns of each element widened exactly
(f16/bf16 -> f32), so -0.0, inf, nan and subnormals compare bit for bit.
Expected i64 values are decimal strings: a JSON number (a double in cJSON)
cannot hold all of int64.

Deterministic: rerunning rewrites byte-identical files.
Needs: pip install safetensors numpy
Usage: tools/gen_safetensors_golden.py
"""
import json
import os
import shutil
import struct

import numpy as np
import safetensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "golden", "safetensors")
CORPUS = os.path.join(ROOT, "tests", "fuzz", "corpus", "safetensors")

SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def f16(values, shape):
    return np.array(values, dtype=np.float16).reshape(shape)


def bf16_bits(values):
    """Exact bf16 encodings: every value below is representable, checked."""
    f = np.array(values, dtype=np.float32)
    bits = (f.view(np.uint32) >> 16).astype(np.uint16)
    back = (bits.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(back.view(np.uint32), f.view(np.uint32)), "not exact in bf16"
    return bits


# (name, shard index, dtype name for safetensors, numpy array of the stored
# values, or of the bits for bf16). The reference orders tensors of equal
# dtype through a hash map, so each shard holds at most one tensor per dtype
# to keep the output byte-identical across runs.
def tensors():
    inf = float("inf")
    out = []
    out.append(("model.embed_tokens.weight", 0, "float32",
                np.array([0.25 * i - 1.5 for i in range(10)] + [-0.0, 2.0 ** -149],
                         dtype=np.float32).reshape(4, 3)))
    out.append(("model.layers.0.self_attn.q_proj.weight", 0, "float16",
                f16([1.0, -2.0, 0.5, 65504.0, -65504.0, 2.0 ** -24, 2.0 ** -14, -0.0,
                     inf, 1.0 / 3.0], (2, 5))))
    out.append(("model.layers.0.self_attn.k_proj.bias", 0, "bfloat16",
                bf16_bits([1.0, -2.5, 0.15625, 2.0 ** -133, -inf, 3.0 * 2.0 ** 126]).reshape(6)))
    out.append(("d2t", 0, "int64",
                np.array([0, -1, 2 ** 62, -(2 ** 63), 2 ** 53 + 1], dtype=np.int64)))
    out.append(("t2d", 0, "bool",
                np.array([True, False, False, True, True, False, True], dtype=np.bool_)))
    out.append(("model.layers.0.mlp.up_proj.weight", 1, "float16",
                f16([0.125 * (i - 6) for i in range(12)], (3, 2, 2))))
    out.append(("model.norm.scale", 1, "float32", np.array([3.5], dtype=np.float32)))
    out.append(("positions", 1, "int32",
                np.array([[-(2 ** 31), 2 ** 31 - 1, 0], [7, -7, 123456]], dtype=np.int32)))
    out.append(("lm_head.weight", 1, "bfloat16",
                bf16_bits([0.5 * (i - 4) for i in range(8)]).reshape(2, 4)))
    return out


ST_NAME = {"float32": "F32", "float16": "F16", "bfloat16": "BF16",
           "int64": "I64", "int32": "I32", "bool": "BOOL"}


def expected_entry(shard, dtype, arr):
    e = {"file": SHARDS[shard], "dtype": ST_NAME[dtype], "shape": list(arr.shape)}
    flat = arr.reshape(-1)
    if dtype == "float32":
        e["f32_bits"] = [int(b) for b in flat.view(np.uint32)]
    elif dtype == "float16":
        e["f32_bits"] = [int(b) for b in flat.astype(np.float32).view(np.uint32)]
    elif dtype == "bfloat16":
        e["f32_bits"] = [int(b) << 16 for b in flat]
    elif dtype == "int64":
        e["i64"] = [str(int(v)) for v in flat]
    elif dtype == "int32":
        e["i32"] = [int(v) for v in flat]
    elif dtype == "bool":
        e["bool"] = [bool(v) for v in flat]
    return e


def main():
    os.makedirs(OUT, exist_ok=True)
    all_t = tensors()
    weight_map = {}
    expected = {"shards": {}, "tensors": {}}
    total = 0
    for si, shard in enumerate(SHARDS):
        specs, keep = {}, []
        for name, s, dtype, arr in all_t:
            if s != si:
                continue
            arr = np.ascontiguousarray(arr)
            keep.append(arr)
            specs[name] = safetensors.TensorSpec(dtype=dtype, shape=arr.shape,
                                                 data_ptr=arr.ctypes.data,
                                                 data_len=arr.nbytes)
            weight_map[name] = shard
            total += arr.nbytes
            expected["tensors"][name] = expected_entry(si, dtype, arr)
        # One key only: the reference writes metadata in hash-map order.
        meta = {"shard": str(si + 1)}
        path = os.path.join(OUT, shard)
        safetensors.serialize_file(specs, path, metadata=meta)
        expected["shards"][shard] = {"metadata": meta, "count": len(specs)}
        # Read back with the reference to check what was written.
        with open(path, "rb") as fp:
            back = dict(safetensors.deserialize(fp.read()))
        for name, arr in zip(specs, keep):
            assert bytes(back[name]["data"]) == arr.tobytes(), name
    index = {"metadata": {"total_size": total},
             "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(OUT, "model.safetensors.index.json"), "w") as fp:
        json.dump(index, fp, indent=2)
        fp.write("\n")
    with open(os.path.join(OUT, "expected.json"), "w") as fp:
        json.dump(expected, fp, indent=1, sort_keys=True)
        fp.write("\n")
    write_corpus()


def raw_file(entries, data, metadata=None):
    """A file image laid out by hand: entries are (name, dtype, shape,
    begin, end) in header order."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, begin, end in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def write_corpus():
    os.makedirs(CORPUS, exist_ok=True)
    for shard in SHARDS:
        shutil.copyfile(os.path.join(OUT, shard), os.path.join(CORPUS, shard))
    data = (bytes([1, 0, 1])                            # BOOL [3]
            + struct.pack("<4e", 1.0, -2.0, 0.5, 65504.0)  # F16 [2,2] at 3
            + struct.pack("<q", -(2 ** 63))             # I64 [] at 11
            + struct.pack("<f", 3.25))                  # F32 [1] at 19
    image = raw_file([("mask", "BOOL", [3], 0, 3),
                      ("half", "F16", [2, 2], 3, 11),
                      ("id", "I64", [], 11, 19),
                      ("none", "F32", [0, 5], 19, 19),
                      ("x", "F32", [1], 19, 23)],
                     data, metadata={"format": "pt"})
    with open(os.path.join(CORPUS, "odd-offsets.safetensors"), "wb") as fp:
        fp.write(image)


if __name__ == "__main__":
    main()
