#!/usr/bin/env python3
"""Golden data for the model features the default model does not exercise:
Qwen2's q/k/v biases, Llama-3 rope scaling (rope_type "llama3"), an explicit
head_dim that differs from hidden / heads, an untied lm_head, and a Hugging
Face checkpoint (config.json + model.safetensors) written by `transformers`
itself rather than by our own writer.

Writes, for each model NAME in {qwen2, llama3}, tests/golden/tiny/NAME/:
  config.json        as transformers' save_pretrained wrote it
  model.safetensors  as save_pretrained(safe_serialization=True) wrote it,
                     every tensor float32
  expected.json      {"model", "config" (a summary of what the test asserts),
                      "prompts": [{"ids", "generated", "margins",
                                   "last_logits"}]}
    ids          prompt token ids (no BOS; one prompt is longer than the
                 llama3 model's original_max_position_embeddings)
    generated    greedy continuation, exactly 16 tokens (no EOS stop)
    margins      top1 - top2 logit at each generated step (6 significant
                 digits), so a failure can be told from a near tie
    last_logits  all logits at the last prompt position (those that predict
                 generated[0]), 9 significant digits (round-trips float32)
generation_config.json is deleted: the loader ignores it.

The models are tiny random ones (hidden 32, 2 layers, vocabulary 256: about
130 KB of weights each) built with a fixed torch seed. Weights are drawn with
initializer_range 0.1 and the lm_head scaled by 4 so logits spread over a
few units; the q/k/v biases and the
RMSNorm weights, which transformers initialises to 0 and 1, are overwritten
with random values so that a loader that drops or misplaces them fails.
The llama3 model's rope_scaling has original_max_position_embeddings 64 so
that, at head_dim 16 and rope_theta 500000, its frequencies fall in all three
bands of the Llama-3 formula (divided by factor, blended, unchanged); the
script asserts this.

Method: transformers (PyTorch, CPU, float32, attn_implementation="eager"),
model.eval(), torch.no_grad(); model.generate(do_sample=False,
max_new_tokens=16, all-ones attention_mask, eos_token_id=None). The greedy
tokens and prompt logits are cross-checked against a plain no-cache greedy
loop of full forward passes, and every margin must exceed MIN_MARGIN so
float rounding in another implementation cannot flip a token.

Needs (CPU only): pip install torch transformers safetensors numpy
Run from anywhere:
  python3 tools/gen_tiny_golden.py           # rewrite tests/golden/tiny/
  python3 tools/gen_tiny_golden.py --check   # exit 1 if a file is stale
It takes a few seconds on 2 threads. Two runs with the same package versions
give byte-identical files (config.json records transformers_version; other
torch/transformers versions may change the last bits of weights or logits).
"""
import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "golden" / "tiny"

SEED = 1234
N_NEW = 16
MIN_MARGIN = 1e-3
THREADS = 2
VOCAB = 256
LLAMA3_ORIG_MAX_POS = 64
LM_HEAD_SCALE = 4.0  # logits with a spread of a few units, not ~0.5


def build(name):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, vocab_size=VOCAB,
                  max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.1,
                  rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(SEED)
    if name == "qwen2":
        cfg = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, **common)
        cls = Qwen2ForCausalLM
    else:
        cfg = LlamaConfig(num_attention_heads=4, num_key_value_heads=1, head_dim=16, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": LLAMA3_ORIG_MAX_POS},
                          **common)
        cls = LlamaForCausalLM
    model = cls._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(1.0 + 0.2 * torch.randn(norm.weight.shape, generator=g))
            if name == "qwen2":
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    assert proj.bias is not None, "qwen2 q/k/v must have biases"
                    proj.bias.copy_(0.5 * torch.randn(proj.bias.shape, generator=g))
                assert layer.self_attn.o_proj.bias is None
            else:
                assert layer.self_attn.q_proj.bias is None
        model.model.norm.weight.copy_(1.0 + 0.2 * torch.randn(model.model.norm.weight.shape, generator=g))
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    return model


def check_llama3_bands(model):
    """Every band of the Llama-3 formula must hold at least one frequency."""
    import torch
    c = model.config
    rp = c.rope_parameters
    d = c.head_dim
    base = 1.0 / (rp["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    inv = model.model.rotary_emb.inv_freq.float()
    orig = rp["original_max_position_embeddings"]
    low_wl, high_wl = orig / rp["low_freq_factor"], orig / rp["high_freq_factor"]
    bands = {"scaled": 0, "blended": 0, "unchanged": 0}
    for b, f in zip(base.tolist(), inv.tolist()):
        wl = 2 * math.pi / b
        if wl > low_wl:
            bands["scaled"] += 1
            assert math.isclose(f, b / rp["factor"], rel_tol=1e-6)
        elif wl < high_wl:
            bands["unchanged"] += 1
            assert math.isclose(f, b, rel_tol=1e-6)
        else:
            bands["blended"] += 1
            assert b / rp["factor"] < f < b
    assert all(bands.values()), bands
    return bands


def prompts():
    import torch
    g = torch.Generator().manual_seed(SEED + 2)
    lens = [5, 19, LLAMA3_ORIG_MAX_POS + 16]
    out = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]
    out[0][0], out[1][-1] = 0, VOCAB - 1  # the ends of the vocabulary
    return out


def f9(x):
    return float(f"{x:.9g}")


def f6(x):
    return float(f"{x:.6g}")


def run(model, ids):
    import torch
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=N_NEW,
                             eos_token_id=None, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
        gen = out.sequences[0, len(ids):].tolist()
        assert len(gen) == N_NEW, gen
        last = model(x).logits[0, -1].float()
        # No-cache greedy loop: the same tokens, the same first-step logits.
        seq = list(ids)
        margins = []
        for step in range(N_NEW):
            lg = model(torch.tensor([seq])).logits[0, -1].float()
            if step == 0:
                assert torch.allclose(lg, last, rtol=1e-5, atol=1e-5)
            assert torch.allclose(lg, out.scores[step][0].float(), rtol=1e-4, atol=1e-4)
            top = torch.topk(lg, 2)
            assert int(top.indices[0]) == gen[step], (step, int(top.indices[0]), gen[step])
            margins.append(float(top.values[0] - top.values[1]))
            seq.append(gen[step])
    assert min(margins) > MIN_MARGIN, margins
    return {"ids": ids, "generated": gen, "margins": [f6(m) for m in margins],
            "last_logits": [f9(v) for v in last.tolist()]}


def write_model(name, dest):
    model = build(name)
    summary = {"model_type": model.config.model_type, "hidden": model.config.hidden_size,
               "heads": model.config.num_attention_heads, "kv_heads": model.config.num_key_value_heads,
               "head_dim": getattr(model.config, "head_dim", None) or
               model.config.hidden_size // model.config.num_attention_heads,
               "vocab": VOCAB, "tied_embeddings": False, "qkv_bias": name == "qwen2"}
    if name == "llama3":
        summary["rope_bands"] = check_llama3_bands(model)
        summary["rope_factor"] = model.config.rope_parameters["factor"]
        summary["rope_theta"] = model.config.rope_parameters["rope_theta"]
    else:
        summary["rope_theta"] = model.config.rope_parameters["rope_theta"]
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    gc = dest / "generation_config.json"
    if gc.exists():
        gc.unlink()
    files = sorted(p.name for p in dest.iterdir())
    assert files == ["config.json", "model.safetensors"], files
    exp = {"model": name, "config": summary, "prompts": [run(model, p) for p in prompts()]}
    (dest / "expected.json").write_text(json.dumps(exp, indent=None, separators=(",", ":")) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a committed file differs")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    stale = []
    for name in ("qwen2", "llama3"):
        with tempfile.TemporaryDirectory() as tmp:
            tmpdir = Path(tmp) / name
            write_model(name, tmpdir)
            dest = OUT / name
            for f in sorted(tmpdir.iterdir()):
                target = dest / f.name
                same = target.exists() and target.read_bytes() == f.read_bytes()
                if args.check:
                    if not same:
                        stale.append(str(target.relative_to(ROOT)))
                elif not same:
                    dest.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(f, target)
                    print(f"wrote {target.relative_to(ROOT)} ({f.stat().st_size} bytes)")
    if args.check:
        if stale:
            print("stale: " + ", ".join(stale), file=sys.stderr)
            return 1
        print("tests/golden/tiny is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
