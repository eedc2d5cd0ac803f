#!/usr/bin/env python3
"""Seed corpus for tests/fuzz/fuzz_gguf.c: a few tiny valid GGUF files.

Written with the PyPI `gguf` package's GGUFWriter (an independent writer),
then a v2 copy made by patching the version field, which is the only
difference between v2 and v3 for little-endian files. The architectures'
seeds (llama, deepseek2) hold the keys llama.cpp's converter writes and
only the tensors their config readers look at (token_embd.weight, and
deepseek2's first router bias), so that the fuzzer reaches those readers
(model_config_gguf) in a few KB.

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


def write_arch(name, arch, build):
    """A seed for arch's config reader: build(w) adds its keys and tensors."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        w = GGUFWriter(str(path), arch)
        build(w)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        (OUT / name).write_bytes(path.read_bytes())


def llama_keys(w):
    """SmolLM2-135M's keys, less its tokenizer; a vocabulary of 2."""
    w.add_block_count(30)
    w.add_context_length(8192)
    w.add_embedding_length(576)
    w.add_feed_forward_length(1536)
    w.add_head_count(9)
    w.add_head_count_kv(3)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(64)
    w.add_tensor("token_embd.weight", np.zeros((2, 576), dtype=np.float16))


def deepseek2_keys(mla=True, yarn=True, experts=True):
    """The keys llama.cpp's converter writes for the tiny DeepSeek-V3
    (tests/golden/tiny/deepseek.gguf), less its tokenizer; a vocabulary of 8.
    mla: key_length_mla and value_length_mla, as current converters write
    (else the older files' full query and value lengths)."""
    def build(w):
        w.add_block_count(3)
        w.add_context_length(256)
        w.add_embedding_length(64)
        w.add_feed_forward_length(128)
        w.add_head_count(4)
        w.add_head_count_kv(1)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_uint32("deepseek2.attention.q_lora_rank", 32)
        w.add_uint32("deepseek2.attention.kv_lora_rank", 32)
        w.add_uint32("deepseek2.rope.dimension_count", 16)
        w.add_float32("deepseek2.rope.freq_base", 10000.0)
        if mla:
            w.add_uint32("deepseek2.attention.key_length", 48)
            w.add_uint32("deepseek2.attention.value_length", 32)
            w.add_uint32("deepseek2.attention.key_length_mla", 32)
            w.add_uint32("deepseek2.attention.value_length_mla", 16)
        else:
            w.add_uint32("deepseek2.attention.key_length", 32)
            w.add_uint32("deepseek2.attention.value_length", 16)
        if yarn:
            w.add_string("deepseek2.rope.scaling.type", "yarn")
            w.add_float32("deepseek2.rope.scaling.factor", 4.0)
            w.add_uint32("deepseek2.rope.scaling.original_context_length", 64)
            w.add_float32("deepseek2.rope.scaling.yarn_beta_fast", 32.0)
            w.add_float32("deepseek2.rope.scaling.yarn_beta_slow", 1.0)
            w.add_float32("deepseek2.rope.scaling.yarn_log_multiplier", 0.1)
        if experts:
            w.add_uint32("deepseek2.leading_dense_block_count", 1)
            w.add_uint32("deepseek2.expert_count", 8)
            w.add_uint32("deepseek2.expert_used_count", 2)
            w.add_uint32("deepseek2.expert_group_count", 4)
            w.add_uint32("deepseek2.expert_group_used_count", 2)
            w.add_uint32("deepseek2.expert_feed_forward_length", 64)
            w.add_uint32("deepseek2.expert_shared_count", 1)
            w.add_float32("deepseek2.expert_weights_scale", 2.5)
            w.add_bool("deepseek2.expert_weights_norm", True)
            if mla:  # sigmoid routing told by its bias tensor, as the tiny file does
                w.add_tensor("blk.1.exp_probs_b.bias", np.zeros(8, dtype=np.float32))
            else:  # or by the key newer converters write
                w.add_uint32("deepseek2.expert_gating_func", 2)
        w.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    return build


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    v3 = write("values_v3.gguf", all_values)
    v2 = bytearray(v3)
    v2[4:8] = (2).to_bytes(4, "little")
    (OUT / "values_v2.gguf").write_bytes(bytes(v2))
    write("quants_align64.gguf", quant_tensors, alignment=64)
    write("empty.gguf", lambda w: None)
    write_arch("llama_smollm2_keys.gguf", "llama", llama_keys)
    write_arch("deepseek2_mla_yarn_moe.gguf", "deepseek2", deepseek2_keys())
    write_arch("deepseek2_kvb_gating_key.gguf", "deepseek2", deepseek2_keys(mla=False))
    write_arch("deepseek2_dense_no_yarn.gguf", "deepseek2", deepseek2_keys(yarn=False, experts=False))
    for p in sorted(OUT.iterdir()):
        print(f"{p} {p.stat().st_size} bytes")


if __name__ == "__main__":
    main()
