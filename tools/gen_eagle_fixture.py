#!/usr/bin/env python3
"""EAGLE-3 speculative-decoding fixtures: a tiny random target model in both
of the forms Aerie loads, a matching random EAGLE-3 draft head, and
references for both; or (--default-head) a random head shaped for
SmolLM2-135M, written with numpy alone.

Mode 1 (no arguments) writes tests/golden/eagle/tiny/:
  target/config.json, target/model.safetensors
      a random Llama (hidden 32, 4 heads of 8, 2 kv heads, ffn 64, 6 layers,
      vocabulary 32, tied embeddings, rms_norm_eps 1e-6, rope_theta 10000,
      max_position_embeddings 256, no bos/eos/pad), as transformers'
      save_pretrained(safe_serialization=True) wrote it, every tensor f32;
      generation_config.json is deleted (the loader ignores it)
  target.gguf
      the same weights, f32, written by the `gguf` package's GGUFWriter with
      the llama.* keys Aerie's loader reads (target/model.c load_gguf) and
      llama.cpp's tensor names. As llama.cpp's convert_hf_to_gguf.py does,
      the rows of every attn_q / attn_k are permuted within each head so that
      HF's half-split rotation of pairs (i, i + D/2) becomes a rotation of
      adjacent pairs (2i, 2i + 1): new row 2i = old row i, new row 2i + 1 =
      old row i + D/2. The loader relies on that (KN_ROPE_ADJACENT for GGUF
      llama). A numpy array of shape [rows, cols] is written with
      ne0 = cols, ne1 = rows, as the loader expects. No tokenizer keys: the
      model loader needs none, and the HF form has no tokenizer either.
  head/config.json, head/model.safetensors
      a random EAGLE-3 head in the published layout ("LlamaForCausalLMEagle3",
      eagle_config.eagle_aux_hidden_state_layer_ids [1, 3, 4], draft
      vocabulary 24), every float tensor F16, written by the `safetensors`
      package: fc.weight [H, 3H]; midlayer.self_attn.{q,k,v,o}_proj.weight
      ([heads*D, 2H], [kv*D, 2H], [kv*D, 2H], [H, heads*D]);
      midlayer.mlp.{gate,up,down}_proj.weight; midlayer.input_layernorm,
      midlayer.hidden_norm, midlayer.post_attention_layernorm, norm (all
      [H]); lm_head.weight [draft_vocab, H]; d2t int64 [draft_vocab];
      t2d bool [vocab]. No embed_tokens: a head uses its target's embedding.
      The draft vocabulary is draft_vocab distinct target ids drawn at
      random and sorted; d2t[i] = target_id[i] - i, t2d[t] = t is one of
      them.
  expected.json  (one line)
      "config"          a summary of the shapes above
      "draft_vocab"     the draft vocabulary's target ids, ascending
      "target_greedy"   4 prompts of random ids (lengths 1, 3, 7, 20), each
                        {"ids", "generated" (16 greedy tokens, no EOS stop),
                        "margins" (top1 - top2 logit per generated token, 6
                        significant digits), "last_logits" (all logits at the
                        last prompt position, 9 significant digits)}
      "head_reference"  {"step_a", "step_b"}, each {"tokens", "positions",
                        "logits" [token][draft_vocab], "hidden" [token][H],
                        "draft_argmax", "target_argmax" (= draft_argmax +
                        d2t[draft_argmax]), "margins"}; step_a also has
                        "features" [token][3H]

Target method: transformers (PyTorch, CPU, float32, eager attention),
model.generate(do_sample=False, max_new_tokens=16), cross-checked against a
plain no-cache greedy loop of full forward passes, as in
tools/gen_tiny_golden.py. The weights come from a fixed torch seed with
initializer_range 0.1; every RMSNorm weight is overwritten with
1 + 0.2 * randn so a loader that drops one fails, and the tied embedding is
scaled by EMBED_SCALE so logits spread over a few units. With a tied
embedding, a model this small and random greedily repeats its last token
forever (the token's own row dominates the residual and matches itself);
so q/k and gate/up are scaled by 3 and o_proj/down_proj by 4, after which
the continuations change token at most steps. Every greedy
margin must exceed MIN_MARGIN (the prompt seed was chosen so that it does),
so float rounding elsewhere cannot flip a token. The GGUF is read back with
GGUFReader: every tensor must equal the HF one (q/k after permutation), and
a numpy forward pass over the GGUF tensors with adjacent-pair RoPE must give
transformers' logits for every prompt and its continuation.

Head reference: numpy float64, the head's f16 weights widened exactly and
the target's f32 embedding table E (model.embed_tokens.weight). One call
takes explicit (token, position, input) triples; nothing is shifted or
paired implicitly:
  h = input @ fc.T            when the input is 3H wide (captured features);
                              an H-wide input is h itself (fc is skipped)
  x = [rmsnorm(E[token], input_layernorm), rmsnorm(h, hidden_norm)]
                              2H wide, embedding first;
                              rmsnorm(v, w) = v / sqrt(mean(v^2) + eps) * w
  q, k, v = x @ Wq.T, x @ Wk.T, x @ Wv.T; RoPE as HF (rotate_half: pairs
  (i, i + D/2), inv_freq_i = theta^(-2i/D)) on q and k at the token's
  position; attention over every key at a position <= the query's (this
  call's and earlier calls' K/V), scores / sqrt(D), softmax, GQA (q head j
  reads kv head j // (heads / kv_heads))
  h1 = h + attn @ Wo.T        (the residual is h, not the embedding)
  h2 = h1 + down(silu(gate(m)) * up(m)),  m = rmsnorm(h1, post_attention_layernorm)
  hidden = h2 (pre-norm; what the next draft step takes as its input)
  logits = rmsnorm(h2, norm) @ lm_head.T   (draft vocabulary wide)
Step A: 5 random target ids at positions 0..4, each with a random feature
row of width 3H (float32 ~N(0, 1); stored with 9 significant digits, which
round-trips float32, and computed from the stored values cast to float32).
Step B: one random id at position 5 whose input is step A's last hidden
(H wide), attending to step A's 5 K/V and its own. The reference is checked
against an independent float32 torch implementation in this script
(transformers' LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb and
LlamaMLP, torch's scaled_dot_product_attention with enable_gqa): for every
output, max |numpy - torch| / max |numpy| < 1e-4. Every draft argmax margin
must exceed MIN_MARGIN too.

Mode 2 (--default-head DIR) writes DIR/config.json and DIR/model.safetensors:
a random head for SmolLM2-135M (hidden 576, 9 heads of 64, 3 kv heads, ffn
1536, vocabulary 49152, draft vocabulary 4096, rms_norm_eps 1e-5, rope_theta
100000, max_position_embeddings 8192), the same layout and initialisation
as the tiny head, with num_hidden_layers 1 (the head's own layer count) and
no eagle_config, so the engine uses its default capture layers for the
30-layer target (2, 15, 27). It runs at test time where only numpy is
installed: it imports nothing but numpy and the standard library, writes
the safetensors file itself (u64 little-endian header length, JSON header
padded with spaces to a multiple of 8, then the tensors tiling the data
section in header order), takes well under 3 s, and rewrites byte-identical
files. Mode 1 checks that hand writer against the `safetensors` package.

Mode 3 (--deepseek-head DIR) writes the same kind of head for the tiny
DeepSeek-V3 model of tools/gen_tiny_golden.py (hidden 64, 4 heads of 16, 2
kv heads, ffn 128, vocabulary 256, draft vocabulary 64, capture layers
[1, 2, 3] in eagle_config, as Kimi-K2.5's published heads name theirs):
tests/golden/tiny/deepseek_head/.

Needs for mode 1 (CPU only): pip install torch transformers safetensors gguf numpy
Run from anywhere:
  python3 tools/gen_eagle_fixture.py                   # rewrite tests/golden/eagle/tiny/
  python3 tools/gen_eagle_fixture.py --check           # exit 1 if a file is stale
  python3 tools/gen_eagle_fixture.py --default-head DIR
  python3 tools/gen_eagle_fixture.py --deepseek-head tests/golden/tiny/deepseek_head
Mode 1 takes a few seconds on 2 threads. Two runs with the same package
versions give byte-identical files (target/config.json records
transformers_version; other torch/transformers versions may change the last
bits of the target's weights or logits).
"""
import argparse
import json
import math
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "golden" / "eagle" / "tiny"

TARGET_SEED = 4242
HEAD_SEED = 777
DATA_SEED = 2025  # prompts, draft vocabulary of the tiny head, head inputs
SMOLLM2_HEAD_SEED = 135
N_NEW = 16
MIN_MARGIN = 1e-3
THREADS = 2
EMBED_SCALE = 4.0   # tied: input embedding and logits; logits spread over a few units
QK_SCALE = 3.0      # sharper attention
MLP_IN_SCALE = 3.0  # gate/up: a less linear MLP
OUT_SCALE = 4.0     # o/down: layers outweigh the token's own embedding in the residual
PROMPT_LENS = [1, 3, 7, 20]
STEP_A_TOKENS = 5
HEAD_REL_TOL = 1e-4

TINY = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
            vocab_size=32, draft_vocab_size=24, rms_norm_eps=1e-6, rope_theta=10000.0,
            max_position_embeddings=256, aux_layer_ids=[1, 3, 4])
TINY_TARGET_LAYERS = 6
# A head in the layout published for Kimi-K2.5 (a Llama midlayer over the
# target's hidden size, capture layers named in eagle_config), shaped for
# tests/golden/tiny/deepseek (tools/gen_tiny_golden.py): hidden 64,
# vocabulary 256, 3 layers, so it captures the inputs of layers 1 and 2 and
# the last layer's output.
TINY_DEEPSEEK = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     intermediate_size=128, vocab_size=256, draft_vocab_size=64, rms_norm_eps=1e-6,
                     rope_theta=10000.0, max_position_embeddings=256, aux_layer_ids=[1, 2, 3])
DEEPSEEK_HEAD_SEED = 61
SMOLLM2 = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
               vocab_size=49152, draft_vocab_size=4096, rms_norm_eps=1e-5, rope_theta=100000.0,
               max_position_embeddings=8192, aux_layer_ids=None)


# ---- the head: numpy and the standard library only (mode 2 runs this) ----

def head_config(s):
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
           "hidden_size": s["hidden_size"], "intermediate_size": s["intermediate_size"],
           "num_attention_heads": s["num_attention_heads"], "num_key_value_heads": s["num_key_value_heads"],
           "head_dim": s["head_dim"], "num_hidden_layers": 1, "vocab_size": s["vocab_size"],
           "draft_vocab_size": s["draft_vocab_size"], "rms_norm_eps": s["rms_norm_eps"],
           "rope_theta": s["rope_theta"], "max_position_embeddings": s["max_position_embeddings"],
           "tie_word_embeddings": False, "torch_dtype": "float16"}
    if s["aux_layer_ids"] is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(s["aux_layer_ids"])}
    return cfg


def make_head(s, seed, draft_ids):
    """The head's tensors, in file order: [(name, ndarray)]. Matrices are
    N(0, (gain / sqrt(fan_in))^2) so that, with RMS-normed inputs, q.k / sqrt(D)
    spreads over a few units and the draft logits over a few units; norms are
    1 + 0.2 N(0, 1)."""
    H, F, V = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    QD, KD = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    rng = np.random.default_rng(seed)

    def mat(rows, cols, gain):
        w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(gain / math.sqrt(cols))
        return w.astype(np.float16)

    def norm():
        return (1.0 + 0.2 * rng.standard_normal(H, dtype=np.float32)).astype(np.float16)

    p = "midlayer."
    t = [("fc.weight", mat(H, 3 * H, 1.0)),
         (p + "self_attn.q_proj.weight", mat(QD, 2 * H, 1.5)),
         (p + "self_attn.k_proj.weight", mat(KD, 2 * H, 1.5)),
         (p + "self_attn.v_proj.weight", mat(KD, 2 * H, 1.0)),
         (p + "self_attn.o_proj.weight", mat(H, QD, 1.0)),
         (p + "mlp.gate_proj.weight", mat(F, H, 1.5)),
         (p + "mlp.up_proj.weight", mat(F, H, 1.5)),
         (p + "mlp.down_proj.weight", mat(H, F, 1.0)),
         (p + "input_layernorm.weight", norm()),
         (p + "hidden_norm.weight", norm()),
         (p + "post_attention_layernorm.weight", norm()),
         ("norm.weight", norm()),
         ("lm_head.weight", mat(s["draft_vocab_size"], H, 2.5))]
    ids = np.asarray(draft_ids, dtype=np.int64)
    assert ids.shape == (s["draft_vocab_size"],) and np.all(np.diff(ids) > 0) and 0 <= ids[0] and ids[-1] < V
    t2d = np.zeros(V, dtype=np.bool_)
    t2d[ids] = True
    t += [("d2t", ids - np.arange(len(ids), dtype=np.int64)), ("t2d", t2d)]
    return t


def draft_vocab(rng, vocab, n):
    return np.sort(rng.choice(vocab, size=n, replace=False)).astype(np.int64)


ST_DTYPES = {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32", np.dtype(np.int64): "I64",
             np.dtype(np.bool_): "BOOL"}


def safetensors_bytes(tensors):
    """A safetensors file: the tensors tile the data section in list order."""
    header, blobs, at = {}, [], 0
    for name, a in tensors:
        a = np.ascontiguousarray(a)
        b = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": ST_DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def write_head(dest, s, seed):
    """A random head of shape s: its draft vocabulary from seed, its weights from seed + 1."""
    dest.mkdir(parents=True, exist_ok=True)
    ids = draft_vocab(np.random.default_rng(seed), s["vocab_size"], s["draft_vocab_size"])
    tensors = make_head(s, seed + 1, ids)
    (dest / "config.json").write_text(json.dumps(head_config(s), indent=2) + "\n")
    (dest / "model.safetensors").write_bytes(safetensors_bytes(tensors))


def write_default_head(dest):
    write_head(dest, SMOLLM2, SMOLLM2_HEAD_SEED)


# ---- mode 1 -------------------------------------------------------------

def write_deepseek_head(dest):
    write_head(dest, TINY_DEEPSEEK, DEEPSEEK_HEAD_SEED)


def f9(x):
    return float(f"{x:.9g}")


def f6(x):
    return float(f"{x:.6g}")


def build_target():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    s = TINY
    cfg = LlamaConfig(hidden_size=s["hidden_size"], num_attention_heads=s["num_attention_heads"],
                      num_key_value_heads=s["num_key_value_heads"], head_dim=s["head_dim"],
                      intermediate_size=s["intermediate_size"], num_hidden_layers=TINY_TARGET_LAYERS,
                      vocab_size=s["vocab_size"], tie_word_embeddings=True, rms_norm_eps=s["rms_norm_eps"],
                      rope_theta=s["rope_theta"], max_position_embeddings=s["max_position_embeddings"],
                      initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(TARGET_SEED)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    g = torch.Generator().manual_seed(TARGET_SEED + 1)
    with torch.no_grad():
        norms = [n for layer in model.model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        for n in norms + [model.model.norm]:
            n.weight.copy_(1.0 + 0.2 * torch.randn(n.weight.shape, generator=g))
        for layer in model.model.layers:
            for proj, scale in ((layer.self_attn.q_proj, QK_SCALE), (layer.self_attn.k_proj, QK_SCALE),
                                (layer.mlp.gate_proj, MLP_IN_SCALE), (layer.mlp.up_proj, MLP_IN_SCALE),
                                (layer.self_attn.o_proj, OUT_SCALE), (layer.mlp.down_proj, OUT_SCALE)):
                proj.weight.mul_(scale)
        model.model.embed_tokens.weight.mul_(EMBED_SCALE)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "must be tied"
    return model


def greedy(model, ids):
    """transformers' greedy tokens, checked against a no-cache loop."""
    import torch
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=N_NEW,
                             eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        gen = out.sequences[0, len(ids):].tolist()
        assert len(gen) == N_NEW, gen
        seq, margins, last = list(ids), [], None
        for step in range(N_NEW):
            lg = model(torch.tensor([seq])).logits[0, -1].float()
            if step == 0:
                last = lg
            assert torch.allclose(lg, out.scores[step][0].float(), rtol=1e-4, atol=1e-4)
            top = torch.topk(lg, 2)
            assert int(top.indices[0]) == gen[step], (step, int(top.indices[0]), gen[step])
            margins.append(float(top.values[0] - top.values[1]))
            seq.append(gen[step])
        full = model(torch.tensor([seq])).logits[0].double().numpy()  # every position, for the GGUF check
    assert min(margins) > MIN_MARGIN, (ids, margins)
    return {"ids": ids, "generated": gen, "margins": [f6(m) for m in margins],
            "last_logits": [f9(v) for v in last.tolist()]}, seq, full


def rope_rows_to_adjacent(w, n_heads):
    """llama.cpp's q/k permutation: within each head, rows (i, i + D/2) become
    rows (2i, 2i + 1)."""
    rows, cols = w.shape
    d = rows // n_heads
    return w.reshape(n_heads, 2, d // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def gguf_tensors(sd):
    """HF state dict (numpy f32) -> [(gguf name, array)] in llama.cpp's naming."""
    s = TINY
    out = [("token_embd.weight", sd["model.embed_tokens.weight"])]
    for i in range(TINY_TARGET_LAYERS):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out += [(b + "attn_norm.weight", sd[p + "input_layernorm.weight"]),
                (b + "attn_q.weight", rope_rows_to_adjacent(sd[p + "self_attn.q_proj.weight"],
                                                            s["num_attention_heads"])),
                (b + "attn_k.weight", rope_rows_to_adjacent(sd[p + "self_attn.k_proj.weight"],
                                                            s["num_key_value_heads"])),
                (b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"]),
                (b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"]),
                (b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"]),
                (b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"]),
                (b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"]),
                (b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"])]
    out.append(("output_norm.weight", sd["model.norm.weight"]))
    return out


def write_gguf(path, sd):
    import gguf
    s = TINY
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("aerie-eagle-tiny-target")
    w.add_context_length(s["max_position_embeddings"])
    w.add_embedding_length(s["hidden_size"])
    w.add_block_count(TINY_TARGET_LAYERS)
    w.add_feed_forward_length(s["intermediate_size"])
    w.add_head_count(s["num_attention_heads"])
    w.add_head_count_kv(s["num_key_value_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_dimension_count(s["head_dim"])
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(s["rms_norm_eps"])
    w.add_vocab_size(s["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, a in gguf_tensors(sd):
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def rmsnorm(v, w, eps):
    return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * w


def silu(v):
    return v / (1.0 + np.exp(-v))


def attend(q, k, v, qpos, kpos):
    """q [n][heads][D], k/v [m][kv][D]: causal by position, GQA."""
    n, nh, d = q.shape
    group = nh // k.shape[1]
    out = np.zeros_like(q)
    for j in range(nh):
        sc = q[:, j] @ k[:, j // group].T / math.sqrt(d)
        sc = np.where(kpos[None, :] <= qpos[:, None], sc, -np.inf)
        p = np.exp(sc - sc.max(axis=1, keepdims=True))
        out[:, j] = (p / p.sum(axis=1, keepdims=True)) @ v[:, j // group]
    return out


def rope_cos_sin(pos, d, theta):
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.asarray(pos, dtype=np.float64)[:, None] * inv[None, :]  # [n][D/2]
    return np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]


def rope_half(x, pos, theta):
    """HF rotate_half: pairs (i, i + D/2). x [n][heads][D]."""
    d = x.shape[-1]
    c, s = rope_cos_sin(pos, d, theta)
    a, b = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def rope_adjacent(x, pos, theta):
    """ggml's normal rope: pairs (2i, 2i + 1). x [n][heads][D]."""
    d = x.shape[-1]
    c, s = rope_cos_sin(pos, d, theta)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, b * c + a * s
    return out


def check_gguf(path, sd, runs):
    """Reads the GGUF back: its tensors are the HF ones (q/k permuted), and a
    float64 forward pass over them with adjacent-pair RoPE gives
    transformers' logits at every position of every prompt + continuation."""
    import gguf
    s = TINY
    r = gguf.GGUFReader(str(path))
    got = {t.name: t for t in r.tensors}
    want = gguf_tensors(sd)
    assert sorted(got) == sorted(n for n, _ in want)
    for name, a in want:
        t = got[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
        assert list(t.shape) == list(reversed(a.shape)), (name, t.shape, a.shape)  # ne0 = columns
        assert np.array_equal(np.asarray(t.data).reshape(a.shape), a), name
    for n in ("q", "k"):
        heads = s["num_attention_heads"] if n == "q" else s["num_key_value_heads"]
        hf = sd[f"model.layers.0.self_attn.{n}_proj.weight"]
        gg = np.asarray(got[f"blk.0.attn_{n}.weight"].data).reshape(hf.shape)
        assert not np.array_equal(hf, gg)
        d = s["head_dim"]
        assert np.array_equal(gg[1], hf[d // 2]) and np.array_equal(gg[2], hf[1]), "adjacent-pair permutation"
    w = {name: np.asarray(t.data, dtype=np.float64).reshape(tuple(reversed([int(x) for x in t.shape])))
         for name, t in got.items()}
    H, D, eps, theta = s["hidden_size"], s["head_dim"], s["rms_norm_eps"], s["rope_theta"]
    worst = 0.0
    for seq, ref in runs:
        pos = np.arange(len(seq))
        x = w["token_embd.weight"][seq]
        for i in range(TINY_TARGET_LAYERS):
            b = f"blk.{i}."
            a = rmsnorm(x, w[b + "attn_norm.weight"], eps)
            q = rope_adjacent((a @ w[b + "attn_q.weight"].T).reshape(len(seq), -1, D), pos, theta)
            k = rope_adjacent((a @ w[b + "attn_k.weight"].T).reshape(len(seq), -1, D), pos, theta)
            v = (a @ w[b + "attn_v.weight"].T).reshape(len(seq), -1, D)
            x = x + attend(q, k, v, pos, pos).reshape(len(seq), -1) @ w[b + "attn_output.weight"].T
            m = rmsnorm(x, w[b + "ffn_norm.weight"], eps)
            x = x + (silu(m @ w[b + "ffn_gate.weight"].T) * (m @ w[b + "ffn_up.weight"].T)) @ w[b + "ffn_down.weight"].T
        logits = rmsnorm(x, w["output_norm.weight"], eps) @ w["token_embd.weight"].T
        assert logits.shape == ref.shape and H == x.shape[1]
        worst = max(worst, float(np.abs(logits - ref).max() / np.abs(ref).max()))
    assert worst < 1e-5, worst
    return worst


def head_forward(w, E, s, tokens, pos, inputs, cache):
    """The reference (see the module docstring), float64. cache: {"k", "v",
    "pos"} of earlier calls, extended in place. Returns (logits, hidden)."""
    H, D, eps = s["hidden_size"], s["head_dim"], s["rms_norm_eps"]
    n = len(tokens)
    pos = np.asarray(pos)
    h = inputs @ w["fc.weight"].T if inputs.shape[1] == 3 * H else inputs
    assert h.shape == (n, H)
    p = "midlayer."
    x = np.concatenate([rmsnorm(E[tokens], w[p + "input_layernorm.weight"], eps),
                        rmsnorm(h, w[p + "hidden_norm.weight"], eps)], axis=1)
    q = rope_half((x @ w[p + "self_attn.q_proj.weight"].T).reshape(n, -1, D), pos, s["rope_theta"])
    k = rope_half((x @ w[p + "self_attn.k_proj.weight"].T).reshape(n, -1, D), pos, s["rope_theta"])
    v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(n, -1, D)
    cache["k"] = np.concatenate([cache["k"], k]) if "k" in cache else k
    cache["v"] = np.concatenate([cache["v"], v]) if "v" in cache else v
    cache["pos"] = np.concatenate([cache["pos"], pos]) if "pos" in cache else pos
    att = attend(q, cache["k"], cache["v"], pos, cache["pos"]).reshape(n, -1)
    h1 = h + att @ w[p + "self_attn.o_proj.weight"].T
    m = rmsnorm(h1, w[p + "post_attention_layernorm.weight"], eps)
    h2 = h1 + (silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) \
        @ w[p + "mlp.down_proj.weight"].T
    return rmsnorm(h2, w["norm.weight"], eps) @ w["lm_head.weight"].T, h2


def head_forward_torch(w, E, s, steps):
    """The same computation, float32, from transformers' and torch's own
    pieces. steps: [(tokens, positions, inputs or None = previous hidden[-1])]."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding,
                                                          apply_rotary_pos_emb)
    H, nh, nkv, D = s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    cfg = LlamaConfig(hidden_size=H, intermediate_size=s["intermediate_size"], num_attention_heads=nh,
                      num_key_value_heads=nkv, head_dim=D, rope_theta=s["rope_theta"], hidden_act="silu",
                      max_position_embeddings=s["max_position_embeddings"], rms_norm_eps=s["rms_norm_eps"])
    t = {k: torch.from_numpy(np.asarray(a, dtype=np.float32)) for k, a in w.items() if a.dtype != np.int64}
    emb = torch.from_numpy(E.astype(np.float32))

    def norm(name):
        n = LlamaRMSNorm(H, eps=s["rms_norm_eps"])
        n.weight.data.copy_(t[name])
        return n
    p = "midlayer."
    in_norm, hid_norm = norm(p + "input_layernorm.weight"), norm(p + "hidden_norm.weight")
    post_norm, final_norm = norm(p + "post_attention_layernorm.weight"), norm("norm.weight")
    mlp = LlamaMLP(cfg)
    for n in ("gate", "up", "down"):
        getattr(mlp, n + "_proj").weight.data.copy_(t[p + f"mlp.{n}_proj.weight"])
    rot = LlamaRotaryEmbedding(cfg)
    ks, vs, kpos, out = [], [], [], []
    with torch.no_grad():
        for tokens, pos, inputs in steps:
            n = len(tokens)
            if inputs is None:
                h = out[-1][1][-1:]
            else:
                h = F.linear(torch.from_numpy(inputs.astype(np.float32)), t["fc.weight"])
            x = torch.cat([in_norm(emb[torch.tensor(tokens)]), hid_norm(h)], dim=-1)[None]  # [1][n][2H]
            q = F.linear(x, t[p + "self_attn.q_proj.weight"]).view(1, n, nh, D).transpose(1, 2)
            k = F.linear(x, t[p + "self_attn.k_proj.weight"]).view(1, n, nkv, D).transpose(1, 2)
            v = F.linear(x, t[p + "self_attn.v_proj.weight"]).view(1, n, nkv, D).transpose(1, 2)
            cos, sin = rot(v, torch.tensor([pos]))
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            ks.append(k), vs.append(v), kpos.extend(pos)
            mask = torch.tensor(kpos)[None, :] <= torch.tensor(pos)[:, None]
            a = F.scaled_dot_product_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), attn_mask=mask,
                                               enable_gqa=True)
            h1 = h + F.linear(a.transpose(1, 2).reshape(n, nh * D), t[p + "self_attn.o_proj.weight"])
            h2 = h1 + mlp(post_norm(h1))
            out.append((F.linear(final_norm(h2), t["lm_head.weight"]), h2))
    return [(lg.double().numpy(), hd.double().numpy()) for lg, hd in out]


def head_reference(head_tensors, E, rng):
    s = TINY
    H, V = s["hidden_size"], s["vocab_size"]
    w = {n: (a.astype(np.float64) if a.dtype == np.float16 else a) for n, a in head_tensors}
    d2t = w["d2t"]
    tok_a = rng.integers(0, V, size=STEP_A_TOKENS).tolist()
    feats = [[f9(v) for v in row] for row in rng.standard_normal((STEP_A_TOKENS, 3 * H), dtype=np.float32).tolist()]
    tok_b = rng.integers(0, V, size=1).tolist()
    pos_a, pos_b = list(range(STEP_A_TOKENS)), [STEP_A_TOKENS]
    f32 = np.array(feats, dtype=np.float32)
    cache = {}
    lg_a, hd_a = head_forward(w, E, s, tok_a, pos_a, f32.astype(np.float64), cache)
    lg_b, hd_b = head_forward(w, E, s, tok_b, pos_b, hd_a[-1:], cache)
    tch = head_forward_torch(w, E, s, [(tok_a, pos_a, f32), (tok_b, pos_b, None)])
    for (lg, hd), (tl, th) in zip([(lg_a, hd_a), (lg_b, hd_b)], tch):
        for ref, other in ((lg, tl), (hd, th)):
            rel = float(np.abs(ref - other).max() / np.abs(ref).max())
            assert rel < HEAD_REL_TOL, rel

    def step(tokens, pos, lg, hd):
        am = lg.argmax(axis=1)
        top2 = np.sort(lg, axis=1)[:, -2:]
        margins = (top2[:, 1] - top2[:, 0]).tolist()
        assert min(margins) > MIN_MARGIN, margins
        return {"tokens": tokens, "positions": pos,
                "logits": [[f9(v) for v in row] for row in lg.tolist()],
                "hidden": [[f9(v) for v in row] for row in hd.tolist()],
                "draft_argmax": am.tolist(), "target_argmax": (am + d2t[am]).tolist(),
                "margins": [f6(m) for m in margins]}
    a = step(tok_a, pos_a, lg_a, hd_a)
    a["features"] = feats
    ref = {"step_a": a, "step_b": step(tok_b, pos_b, lg_b, hd_b)}
    spread = float(np.concatenate([lg_a, lg_b]).std())
    assert 1.0 < spread < 10.0, spread  # "a few units"
    return ref


def check_hand_writer(tensors, path):
    """The numpy-only writer of mode 2 against the safetensors package."""
    from safetensors.numpy import load
    got = load(safetensors_bytes(tensors))
    ref = load(Path(path).read_bytes())
    assert sorted(got) == sorted(ref) == sorted(n for n, _ in tensors)
    for n, a in tensors:
        assert got[n].dtype == ref[n].dtype == a.dtype and np.array_equal(got[n], ref[n]), n


def write_tiny(dest):
    from safetensors.numpy import load_file, save_file
    s = TINY
    rng = np.random.default_rng(DATA_SEED)
    prompts = [rng.integers(0, s["vocab_size"], size=n).tolist() for n in PROMPT_LENS]
    ids = draft_vocab(rng, s["vocab_size"], s["draft_vocab_size"])

    model = build_target()
    tdir = dest / "target"
    tdir.mkdir(parents=True)
    model.save_pretrained(tdir, safe_serialization=True)
    gc = tdir / "generation_config.json"
    if gc.exists():
        gc.unlink()
    files = sorted(p.name for p in tdir.iterdir())
    assert files == ["config.json", "model.safetensors"], files
    sd = load_file(tdir / "model.safetensors")
    assert all(a.dtype == np.float32 for a in sd.values())
    assert "lm_head.weight" not in sd, "tied: only the embedding is stored"
    E = sd["model.embed_tokens.weight"]
    assert E.shape == (s["vocab_size"], s["hidden_size"])
    logit_std = []
    greedy_runs, gguf_runs = [], []
    for p in prompts:
        g, seq, full = greedy(model, p)
        greedy_runs.append(g)
        gguf_runs.append((seq, full))
        logit_std.append(full.std())
    assert 1.0 < float(np.mean(logit_std)) < 10.0, logit_std  # "a few units"
    changes = [sum(a != b for a, b in zip(r["generated"], r["generated"][1:])) for r in greedy_runs]
    assert min(changes) >= N_NEW // 2, changes  # not stuck repeating one token

    write_gguf(dest / "target.gguf", sd)
    check_gguf(dest / "target.gguf", sd, gguf_runs)

    head = make_head(s, HEAD_SEED, ids)
    hdir = dest / "head"
    hdir.mkdir()
    (hdir / "config.json").write_text(json.dumps(head_config(s), indent=2) + "\n")
    save_file(dict(head), hdir / "model.safetensors")
    check_hand_writer(head, hdir / "model.safetensors")
    ref = head_reference(head, E.astype(np.float64), rng)

    summary = {"target": {"model_type": "llama", "hidden": s["hidden_size"], "heads": s["num_attention_heads"],
                          "kv_heads": s["num_key_value_heads"], "head_dim": s["head_dim"],
                          "ffn": s["intermediate_size"], "layers": TINY_TARGET_LAYERS, "vocab": s["vocab_size"],
                          "tied_embeddings": True, "rms_norm_eps": s["rms_norm_eps"],
                          "rope_theta": s["rope_theta"], "context_length": s["max_position_embeddings"]},
               "head": {"hidden": s["hidden_size"], "heads": s["num_attention_heads"],
                        "kv_heads": s["num_key_value_heads"], "head_dim": s["head_dim"],
                        "ffn": s["intermediate_size"], "vocab": s["vocab_size"],
                        "draft_vocab": s["draft_vocab_size"], "aux_layer_ids": s["aux_layer_ids"],
                        "rms_norm_eps": s["rms_norm_eps"], "rope_theta": s["rope_theta"]}}
    exp = {"config": summary, "draft_vocab": ids.tolist(), "target_greedy": greedy_runs, "head_reference": ref}
    (dest / "expected.json").write_text(json.dumps(exp, separators=(",", ":")) + "\n")


def tree(d):
    return {p.relative_to(d).as_posix(): p for p in sorted(d.rglob("*")) if p.is_file()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a committed file differs")
    ap.add_argument("--default-head", metavar="DIR", help="write the random SmolLM2-135M head to DIR (numpy only)")
    ap.add_argument("--deepseek-head", metavar="DIR",
                    help="write the random head for tests/golden/tiny/deepseek to DIR (numpy only)")
    args = ap.parse_args()
    if args.deepseek_head:
        write_deepseek_head(Path(args.deepseek_head))
        return 0
    if args.default_head:
        write_default_head(Path(args.default_head))
        return 0
    import torch
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "tiny"
        fresh.mkdir()
        write_tiny(fresh)
        new, old = tree(fresh), tree(OUT) if OUT.exists() else {}
        stale = sorted(n for n in set(new) | set(old)
                       if n not in new or n not in old or new[n].read_bytes() != old[n].read_bytes())
        if args.check:
            if stale:
                print("stale: " + ", ".join(str((OUT / n).relative_to(ROOT)) for n in stale), file=sys.stderr)
                return 1
            print(f"{OUT.relative_to(ROOT)} is up to date")
            return 0
        for n in stale:
            target = OUT / n
            if n not in new:
                target.unlink()
                print(f"removed {target.relative_to(ROOT)}")
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(new[n], target)
            print(f"wrote {target.relative_to(ROOT)} ({new[n].stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
