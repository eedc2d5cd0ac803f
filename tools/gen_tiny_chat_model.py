#!/usr/bin/env python3
"""Writes a tiny random Llama with SmolLM2's tokenizer and chat template:
the model the EAGLE-3 training pipeline's smoke test runs end to end
(gen-prompts, dump-features, train_eagle3.py, export, generate).

    gen_tiny_chat_model.py DIR

DIR gets config.json, model.safetensors (F16, Hugging Face names, tied
embeddings) and tokenizer.json + tokenizer_config.json copied from
tests/golden/tokenizer/smollm/. Hidden 64, 4 layers, 4 heads of 16 (2 KV
heads), FFN 128, vocabulary 49152: about 3.3 M parameters, nearly all in
the embedding. Weights are N(0, (gain / sqrt(fan_in))^2) from a fixed seed,
norms 1, so the file is the same on every run. numpy and the standard
library only.
"""
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np

from gen_eagle_fixture import safetensors_bytes  # numpy-only at import

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "tests" / "golden" / "tokenizer" / "smollm"
SEED = 20261129
CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 64,
       "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
       "num_hidden_layers": 4, "vocab_size": 49152, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
       "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
       "torch_dtype": "float16"}


def tensors():
    rng = np.random.default_rng(SEED)
    H, F, V = CFG["hidden_size"], CFG["intermediate_size"], CFG["vocab_size"]
    Q = CFG["num_attention_heads"] * CFG["head_dim"]
    KV = CFG["num_key_value_heads"] * CFG["head_dim"]

    def mat(rows, cols, gain=1.0):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(gain / math.sqrt(cols))).astype(
            np.float16)

    out = [("model.embed_tokens.weight", mat(V, H))]
    for i in range(CFG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", np.ones(H, np.float16)),
                (p + "self_attn.q_proj.weight", mat(Q, H)), (p + "self_attn.k_proj.weight", mat(KV, H)),
                (p + "self_attn.v_proj.weight", mat(KV, H)), (p + "self_attn.o_proj.weight", mat(H, Q)),
                (p + "post_attention_layernorm.weight", np.ones(H, np.float16)),
                (p + "mlp.gate_proj.weight", mat(F, H)), (p + "mlp.up_proj.weight", mat(F, H)),
                (p + "mlp.down_proj.weight", mat(H, F))]
    out.append(("model.norm.weight", np.ones(H, np.float16)))
    return out


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    dest = Path(sys.argv[1])
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(CFG, indent=2) + "\n")
    (dest / "model.safetensors").write_bytes(safetensors_bytes(tensors()))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER / f, dest / f)


if __name__ == "__main__":
    main()
