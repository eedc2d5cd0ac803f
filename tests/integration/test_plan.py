"""`aerie plan`: the memory plan of a deployment from a config.json alone.

The figures for Kimi-K2.5 on 8 x 96 GiB at TP 8 are computed here by hand
from the public numbers of deploy/models/kimi-k2.5/config.json, not read
back from Aerie's code: parameter counts by where tensor parallelism puts
them, the bytes each GPU holds, the latent KV per token (replicated on every
rank), the tokens that fit in what the budget leaves, and the allreduces of
a verify pass.
"""
from conftest import ROOT, run_aerie

KIMI = ROOT / "deploy" / "models" / "kimi-k2.5"
GIB = 1 << 30

# Kimi-K2.5 (its model card and config)
L, H, HEADS, V = 61, 7168, 64, 163840
Q, R, NOPE, ROPE, VD = 1536, 512, 128, 64, 128
E, FE, SHARED, DENSE_F, DENSE_LAYERS = 384, 2048, 1, 18432, 1
MOE = L - DENSE_LAYERS


def plan(*args):
    r = run_aerie("plan", "--config", str(KIMI), "--devices", "8x96GiB", "--tp", "8", *args)
    assert r.rc == 0, r.err
    return r


def test_kimi_k25_parameters_by_placement():
    p = plan("--max-seq-len", "131072", "--json").json()
    experts = MOE * E * 3 * H * FE
    assert p["params_experts"] == experts == 1_014_686_023_680
    # divided: q_b and o_proj by heads; the dense and shared FFNs by features
    assert p["params_split"] == L * (Q * HEADS * (NOPE + ROPE) + HEADS * VD * H) + 3 * H * (
        DENSE_LAYERS * DENSE_F + MOE * SHARED * FE)
    # kv_b_proj, held as f32 per-head W_UK and W_UV
    assert p["params_split_f32"] == L * HEADS * R * (NOPE + VD)
    # whole: q_a and kv_a (the latent every rank computes), and the routers
    assert p["params_whole"] == L * (Q * H + (R + ROPE) * H) + MOE * E * H
    assert p["params_whole_f32"] == L * (2 * H + Q + R) + H + MOE * E
    assert p["params_embed"] == p["params_output"] == V * H


def test_kimi_k25_weights_per_gpu_and_kv_per_token():
    p = plan("--max-seq-len", "131072", "--json").json()
    int4 = 18 / 32  # bytes a parameter, as Q4_0
    gpu0 = (2 * p["params_whole"] + 4 * p["params_whole_f32"] + 2 * V * H + 2 * V * H
            + (2 * p["params_split"] + 4 * p["params_split_f32"]) / 8 + int4 * p["params_experts"] / 8)
    assert abs(p["weights_gpu0"] - gpu0) <= 1
    assert round(gpu0 / 1e9, 2) == 80.42
    assert round(p["weights_model"] / 1e9) == 595  # "about 600 GB"
    # (512 + 64) x 61 x 2 B, and not divided by the 8 ranks
    assert p["kv_bytes_per_token"] == (R + ROPE) * L * 2 == 70272


def test_kimi_k25_workspace_per_token_is_rank_0s():
    """f32 floats a token of a pass takes on rank 0 (8 of 64 heads, 256 of
    each expert's 2048 features, 2304 of the dense 18432, 256 of the shared
    2048): llama.c's buffers, then the logits and the captured features."""
    p = plan("--max-seq-len", "131072", "--json").json()
    nh, d, f, fe, k = HEADS // 8, R + ROPE, DENSE_F // 8, FE // 8, 8
    floats = (5 * H + 2 * nh * d + 3 * d + Q + nh * (NOPE + ROPE + VD) + R + 2 * max(f, fe)
              + E + 2 * k + (2 * H + 2 * fe + 2) + V + 3 * H)
    assert p["workspace_per_token"] == 4 * floats == 1026376
    assert p["step_tokens"] == 256
    assert p["workspace"] > p["step_tokens"] * p["workspace_per_token"]  # and the fixed scratch


def test_kimi_k25_tokens_that_fit_and_allreduces():
    p = plan("--max-seq-len", "131072", "--json").json()
    assert p["gpu_bytes"] == 96 * GIB
    assert p["mem_fraction"] == 0.9  # auto: leaves max(1 GiB, 10%)
    assert abs(p["budget"] - 0.9 * 96 * GIB) < 1
    left = p["budget"] - p["weights_gpu0"] - p["workspace"] - p["block_tables"] - p["graphs"]
    blocks = left // (16 * 70272)
    assert p["kv_tokens"] == 16 * blocks == 160384
    assert p["total"] <= p["budget"]
    assert p["block_tables"] == 8 * (131072 // 16) * 4
    assert p["allreduces_per_verify"] == 2 * L == 122
    assert p["allreduce_bytes"] == 32 * H * 4


def test_the_text_states_the_arithmetic_and_the_settings():
    r = plan("--max-seq-len", "131072")
    out = r.out
    assert "weights on GPU 0 (rank 0: 8 of 64 heads, 256 of each expert's 2048 features) = whole 2.18 GB + " \
           "embedding 2.35 GB + output 2.35 GB (rank 0 alone) + its divided 2.20 GB + its experts 71.35 GB = " \
           "80.42 GB (74.90 GiB)" in out
    assert "KV per token on every rank = (512 + 64) x 61 layers x 2 B = 70272 B" in out
    assert "tokens that fit: 160384 KV tokens = 1 whole sequence of max-seq-len 131072" in out
    assert "allreduces per verify pass: 2 per layer x 61 layers = 122" in out
    assert "SGLang --mem-fraction-static" in out and "Aerie --mem-fraction 0.900" in out


def test_a_plan_that_cannot_hold_a_sequence_says_what_would():
    r = run_aerie("plan", "--config", str(KIMI), "--devices", "8x96GiB", "--max-seq-len", "262144")
    assert r.rc == 2
    assert "one sequence of max-seq-len 262144 does not fit" in r.err
    assert "would work: --mem-fraction 0.976, --max-seq-len 151760" in r.err


def test_bad_devices_are_refused():
    r = run_aerie("plan", "--config", str(KIMI), "--devices", "eight")
    assert r.rc == 2
    assert "expected COUNTxSIZE" in r.err
    r = run_aerie("plan", "--config", str(KIMI), "--devices", "4x96GiB", "--tp", "8")
    assert r.rc == 2
    assert "--tp 8: more ranks than the 4 GPUs given" in r.err
    tiny = ROOT / "tests" / "golden" / "tiny" / "deepseek"
    r = run_aerie("plan", "--config", str(tiny), "--devices", "8x1GiB", "--tp", "8")
    assert r.rc == 2
    assert "--tp 8: tensor parallel: 8 ranks but only 4 heads; at most 4 ranks" in r.err


def test_aerie_config_in_the_environment_is_not_the_model_config(tmp_path):
    settings = tmp_path / "settings.json"
    settings.write_text("{}")
    r = run_aerie("plan", "--config", str(KIMI), "--devices", "8x96GiB", "--max-seq-len", "131072", "--json",
                  env={"AERIE_CONFIG": str(settings)})
    assert r.rc == 0, r.err
    assert r.json()["kv_tokens"] == 160384
