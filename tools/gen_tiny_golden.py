#!/usr/bin/env python3
"""Golden data for the model features the default model does not exercise:
Qwen2's q/k/v biases, Llama-3 rope scaling (rope_type "llama3"), an explicit
head_dim that differs from hidden / heads, an untied lm_head, and a Hugging
Face checkpoint (config.json + model.safetensors) written by `transformers`
itself rather than by our own writer.

It also writes DeepSeek-V3's layout (deepseek: MLA, experts, YaRN; and
deepseek_int4: the same with compressed-tensors int4 experts, packed by
compressed-tensors' own packer, so `pip install compressed-tensors` too);
build_deepseek says what they hold, and the seed is one whose routers
have no near tie (MIN_ROUTE_MARGIN) in either.

Writes, for each model NAME in {qwen2, llama3, deepseek, deepseek_int4},
tests/golden/tiny/NAME/:
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
    hidden       (deepseek, deepseek_int4) {"1", "2", "3"}: the residual
                 stream entering those layers at the last prompt position
                 (3: the final norm's input), 9 digits: what an EAGLE-3
                 head naming capture layers [1, 2, 3] reads
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


MODELS = ("qwen2", "llama3", "deepseek", "deepseek_int4")
DS_ORIG_MAX_POS = 64  # YaRN's original context: the longest prompt goes past it
DS_GROUP = 32         # compressed-tensors int4 group size (Kimi-K2.5's)
MIN_ROUTE_MARGIN = 1e-3
DS_CAPTURE = (1, 2, 3)  # the layers tests/golden/tiny/deepseek_head's config names
DS_SEED = int(os.environ.get("DS_SEED", "26"))  # a seed whose routers have no near tie


def build_deepseek():
    """DeepSeek-V3's layout at toy size: MLA with a q low rank, one dense
    layer then two MoE layers of 8 experts in 4 groups (2 kept, 2 experts a
    token) plus a shared expert, YaRN (factor = max_position_embeddings /
    original, as transformers derives it), sigmoid routing with a
    non-negative random correction bias (transformers starts it at 0)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(DS_SEED)
    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, v_head_dim=16,
        qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
        norm_topk_prob=True, max_position_embeddings=4 * DS_ORIG_MAX_POS, initializer_range=0.1,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": DS_ORIG_MAX_POS,
                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    model = DeepseekV3ForCausalLM._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    g = torch.Generator().manual_seed(DS_SEED + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            at = layer.self_attn
            norms = [layer.input_layernorm, layer.post_attention_layernorm, at.q_a_layernorm, at.kv_a_layernorm]
            for norm in norms:
                norm.weight.copy_(1.0 + 0.2 * torch.randn(norm.weight.shape, generator=g))
            if hasattr(layer.mlp, "gate"):
                gate = layer.mlp.gate
                gate.weight.copy_(0.3 * torch.randn(gate.weight.shape, generator=g))
                gate.e_score_correction_bias.copy_(0.3 * torch.rand(gate.e_score_correction_bias.shape, generator=g))
        model.model.norm.weight.copy_(1.0 + 0.2 * torch.randn(model.model.norm.weight.shape, generator=g))
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    return model


def quantize_experts(model):
    """Rounds every routed expert to compressed-tensors' symmetric int4 in
    groups of DS_GROUP with bf16 scales (the model then computes with the
    rounded weights) and returns the packed tensors by their file names,
    packed by compressed-tensors' own pack_to_int32."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out = {}
    with torch.no_grad():
        for li, layer in enumerate(model.model.layers):
            if not hasattr(layer.mlp, "gate"):
                continue
            ex = layer.mlp.experts
            F = ex.down_proj.shape[2]
            for e in range(ex.gate_up_proj.shape[0]):
                mats = {"gate_proj": ex.gate_up_proj[e, :F], "up_proj": ex.gate_up_proj[e, F:],
                        "down_proj": ex.down_proj[e]}
                for nm, w in mats.items():
                    rows, cols = w.shape
                    grp = w.reshape(rows, cols // DS_GROUP, DS_GROUP)
                    scale = (grp.abs().amax(-1) / 7.0).to(torch.bfloat16)
                    q = torch.clamp(torch.round(grp / scale.float().unsqueeze(-1)), -8, 7)
                    w.copy_((q * scale.float().unsqueeze(-1)).reshape(rows, cols))
                    pre = f"model.layers.{li}.mlp.experts.{e}.{nm}"
                    out[pre + ".weight_packed"] = pack_to_int32(q.reshape(rows, cols).to(torch.int8), 4)
                    out[pre + ".weight_scale"] = scale.contiguous()
                    out[pre + ".weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
    return out


def int4_config():
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "group_size": DS_GROUP, "strategy": "group"}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
                       "re:.*mlp\\.gate$"]}


def route_margins(model, ids):
    """The smallest gap of any routing decision over a no-cache pass of
    ids: between the kept and the first dropped group, and between the
    chosen and the first unchosen expert. A near tie could route another
    implementation's token elsewhere."""
    import torch
    gaps = []

    def hook(mod, inp, out):
        logits = out[0]
        c = logits.sigmoid() + mod.e_score_correction_bias
        per = mod.num_experts // mod.num_group
        gs = c.view(-1, mod.num_group, per).topk(2, dim=-1)[0].sum(-1).sort(-1, descending=True)[0]
        gaps.append(float((gs[:, mod.topk_group - 1] - gs[:, mod.topk_group]).min()))
        keep = gs[:, mod.topk_group - 1:mod.topk_group]
        grp = c.view(-1, mod.num_group, per).topk(2, dim=-1)[0].sum(-1)
        mask = (grp >= keep).repeat_interleave(per, dim=-1)
        cs = c.masked_fill(~mask, float("-inf")).sort(-1, descending=True)[0]
        gaps.append(float((cs[:, mod.top_k - 1] - cs[:, mod.top_k]).min()))

    hs = [l.mlp.gate.register_forward_hook(hook) for l in model.model.layers if hasattr(l.mlp, "gate")]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hs:
        h.remove()
    return min(gaps)


def capture_inputs(model, ids):
    """What an EAGLE-3 head captures at layers DS_CAPTURE for the last
    prompt token: the residual stream entering layer i, the final norm's
    input for i = num_hidden_layers; by forward-pre-hooks, 9 digits."""
    import torch
    got = {}
    layers = model.model.layers

    def keep(i):
        def hook(mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            got[str(i)] = [f9(v) for v in x[0, -1].float().tolist()]
        return hook

    hs = [(layers[i] if i < len(layers) else model.model.norm).register_forward_pre_hook(keep(i), with_kwargs=True)
          for i in DS_CAPTURE]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hs:
        h.remove()
    return got


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
    out = {"ids": ids, "generated": gen, "margins": [f6(m) for m in margins],
           "last_logits": [f9(v) for v in last.tolist()]}
    if hasattr(model.config, "n_routed_experts"):
        m = route_margins(model, seq)
        assert m > MIN_ROUTE_MARGIN, m
        out["hidden"] = capture_inputs(model, ids)
    return out


def write_deepseek(name, dest):
    """deepseek: every tensor f32; deepseek_int4: the same model with its
    routed experts in compressed-tensors int4 (and its reference outputs
    those of the rounded weights)."""
    import torch
    from safetensors.torch import load_file, save_file
    model = build_deepseek()
    packed = quantize_experts(model) if name == "deepseek_int4" else None
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    gc = dest / "generation_config.json"
    if gc.exists():
        gc.unlink()
    if packed:
        st = dest / "model.safetensors"
        tensors = {k: v for k, v in load_file(st).items() if ".mlp.experts." not in k}
        tensors.update(packed)
        save_file(dict(sorted(tensors.items())), st, metadata={"format": "pt"})
        cj = json.loads((dest / "config.json").read_text())
        cj["quantization_config"] = int4_config()
        (dest / "config.json").write_text(json.dumps(cj, indent=2, sort_keys=True) + "\n")
    c = model.config
    summary = {"model_type": c.model_type, "hidden": c.hidden_size, "heads": c.num_attention_heads,
               "kv_lora_rank": c.kv_lora_rank, "qk_rope_head_dim": c.qk_rope_head_dim, "experts": c.n_routed_experts,
               "rope_factor": c.rope_parameters["factor"], "vocab": VOCAB, "int4_experts": bool(packed)}
    exp = {"model": name, "config": summary, "prompts": [run(model, p) for p in prompts()]}
    (dest / "expected.json").write_text(json.dumps(exp, indent=None, separators=(",", ":")) + "\n")


def write_model(name, dest):
    if name.startswith("deepseek"):
        return write_deepseek(name, dest)
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
    ap.add_argument("models", nargs="*", default=list(MODELS), help="which (default: all)")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    stale = []
    for name in args.models:
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
