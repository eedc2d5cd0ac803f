"""`aerie bench`: one JSON line whose figures agree with each other and with
the model file, settings with provenance, and bad arguments exit 2 with one
line.

The run is tiny (the ASan build is slow) and shared by the tests that read
its figures; the speeds themselves are not asserted, only their relations.
"""
import json
import statistics

import pytest

from conftest import MODEL

TINY = ["--prompt-tokens", "8", "--gen-tokens", "4", "--batch", "2", "--repeat", "1",
        "--bandwidth-mib", "64", "--threads", "2"]

KEYS = {"model", "device", "simd", "threads", "batch", "prompt_tokens", "gen_tokens", "prefill_tok_per_s",
        "decode_tok_per_s", "decode_step_per_s", "weight_bytes_per_step", "bandwidth_gb_per_s",
        "bandwidth_best_gb_per_s", "roofline_fraction_windows", "roofline_fraction_vs_best",
        "bandwidth_mib", "roofline_tok_per_s", "roofline_fraction", "verify_context", "verify_1_ms",
        "verify_cost", "wall_seconds", "act_bits", "deterministic", "cuda_graphs", "graph_captures",
        "graph_replays", "graph_bytes", "graph_max_nodes", "tp", "allreduce", "allreduces_per_step",
        "allreduce_bytes_per_step", "allreduce_ms_per_step", "verify_allreduces"}

# SmolLM2-135M Q4_1 ties its output projection to the embedding table, so a
# decode step reads every tensor of the file once: 30 layers x 7 Q4_1
# matrices (66,355,200 bytes), 61 f32 norm vectors (140,544 bytes: two per
# layer and the final one) and the Q8_0 embedding table used as the output
# projection (30,081,024 bytes).
SMOLLM2_DECODE_BYTES = 66355200 + 140544 + 30081024


@pytest.fixture(scope="module")
def tiny(aerie, model):
    r = aerie("bench", "--model", model, *TINY, timeout=600)
    assert r.rc == 0, r.err
    lines = r.out.splitlines()
    assert len(lines) == 1, r.out
    return json.loads(lines[0])


def test_prints_one_json_line_with_every_figure(tiny):
    assert set(tiny) == KEYS
    assert (tiny["threads"], tiny["batch"], tiny["prompt_tokens"], tiny["gen_tokens"]) == (2, 2, 8, 4)
    assert (tiny["bandwidth_mib"], tiny["verify_context"]) == (64, 8)
    assert tiny["act_bits"] == 8  # the default activation precision (SVC_ACT_BITS_OPTION, services/core/svc.h)
    assert tiny["model"] == str(MODEL)
    assert tiny["simd"] in {"avx512vnni+avx2", "avx2", "scalar"}  # kn_cpu_simd()
    assert tiny["device"] == "cpu"  # --device auto: no GPU here
    # the CPU backend is deterministic, and has no graphs
    assert tiny["deterministic"] is True
    assert (tiny["cuda_graphs"], tiny["graph_captures"], tiny["graph_replays"], tiny["graph_bytes"]) == (0, 0, 0, 0)
    # one rank: no allreduce
    assert (tiny["tp"], tiny["allreduces_per_step"], tiny["allreduce_bytes_per_step"]) == (1, 0, 0)
    assert tiny["allreduce"] == "none"
    assert all(v == {"calls": 0, "bytes": 0, "ms": 0} for v in tiny["verify_allreduces"].values())
    for k in ("prefill_tok_per_s", "decode_tok_per_s", "decode_step_per_s", "bandwidth_gb_per_s",
              "roofline_tok_per_s", "verify_1_ms", "wall_seconds"):
        assert tiny[k] > 0, k


def test_two_ranks_count_two_allreduces_a_layer_in_every_pass(aerie, model):
    """--tp 2: a decode pass of the batch's 2 tokens and every verify size
    make 60 allreduces (2 per layer, 30 layers), each of the pass's tokens
    x 576 hidden floats."""
    r = aerie("bench", "--model", model, *TINY, "--tp", "2", timeout=600)
    assert r.rc == 0, r.err
    b = json.loads(r.out)
    assert (b["tp"], b["allreduces_per_step"], b["allreduce_bytes_per_step"]) == (2, 60, 60 * 2 * 576 * 4)
    assert b["allreduce"] == "cpu"
    assert b["allreduce_ms_per_step"] > 0
    assert list(b["verify_allreduces"]) == ["1", "2", "4", "8", "16", "32"]
    for n, v in b["verify_allreduces"].items():
        assert (v["calls"], v["bytes"]) == (60, 60 * int(n) * 576 * 4), (n, v)


def test_verify_cost_has_the_six_sizes_relative_to_one_token(tiny):
    cost = tiny["verify_cost"]
    assert list(cost) == ["1", "2", "4", "8", "16", "32"]
    assert cost["1"] == 1.0
    assert all(v > 0 for v in cost.values())


def test_decode_figures_agree(tiny):
    # batch sequences advance one token per step
    assert tiny["decode_tok_per_s"] == pytest.approx(2 * tiny["decode_step_per_s"], abs=0.02)
    assert tiny["roofline_tok_per_s"] == pytest.approx(
        tiny["bandwidth_gb_per_s"] * 1e9 / tiny["weight_bytes_per_step"], rel=1e-3)
    # one bandwidth reading after each decode window (4 windows for 4 tokens);
    # the fraction is the median of the windows' fractions
    windows = tiny["roofline_fraction_windows"]
    assert len(windows) == 4
    assert tiny["roofline_fraction"] == pytest.approx(statistics.median(windows), abs=1e-4)
    assert tiny["bandwidth_best_gb_per_s"] >= tiny["bandwidth_gb_per_s"]
    assert tiny["roofline_fraction_vs_best"] == pytest.approx(
        tiny["decode_step_per_s"] / (tiny["bandwidth_best_gb_per_s"] * 1e9 / tiny["weight_bytes_per_step"]),
        rel=2e-3)


def test_weight_bytes_are_every_tensor_of_a_tied_model(aerie, model, tiny):
    info = aerie("info", "--model", model, "--json").json()
    assert tiny["weight_bytes_per_step"] == SMOLLM2_DECODE_BYTES
    assert tiny["weight_bytes_per_step"] == info["tensor_bytes"]
    types = info["tensor_types"]
    assert (types["Q4_1"]["bytes"], types["F32"]["bytes"], types["Q8_0"]["bytes"]) == (
        66355200, 140544, 30081024)


def test_print_config_shows_each_setting_and_its_source(aerie, model):
    r = aerie("bench", "--model", model, "--batch", "4", "--print-config",
              env={"AERIE_GEN_TOKENS": "16"})
    assert r.rc == 0, r.err
    c = r.json()
    assert c["batch"] == {"value": 4, "source": "flag"}
    assert c["gen-tokens"] == {"value": 16, "source": "env"}
    assert c["prompt-tokens"] == {"value": 128, "source": "default"}
    assert c["threads"] == {"value": "auto", "source": "default"}
    assert c["bandwidth-mib"] == {"value": "auto", "source": "default"}


def test_oracle_draft_fixes_the_acceptance_length(aerie, model):
    """--oracle-accept K proposes the target's own greedy tokens, K right then
    one wrong: every step accepts K drafts plus the target's token, so the
    mean acceptance length is exactly K + 1 when the output is a whole
    number of steps (33 = 11 x 3), and the output is plain decoding's."""
    r = aerie("bench", "--model", model, "--oracle-accept", "2", "--prompt-tokens", "16", "--gen-tokens", "33",
              "--repeat", "1", "--bandwidth-mib", "16", "--threads", "2", timeout=900)
    assert r.rc == 0, r.err
    out = json.loads(r.out)
    assert (out["draft"], out["oracle_accept"], out["oracle_misaligned"]) == ("oracle", 2, 0)
    assert out["spec_output_identical"] is True
    assert (out["spec_steps"], out["spec_topk"], out["spec_tokens"]) == (3, 1, 4)
    assert out["mean_accept_len"] == 3
    assert out["accept_per_depth"] == [1, 1, 0]
    assert out["spec_speedup"] > 0


@pytest.mark.parametrize("args, message", [
    ([], "no model given (use --model FILE)"),
    (["--model", MODEL, "--batch", "0"], "--batch: 0 is outside 1..256"),
    (["--model", MODEL, "--batch", "64", "--max-batch-tokens", "32"],
     "--batch 64 exceeds --max-batch-tokens 32"),
    (["--model", MODEL, "--prompt-tokens", "8190"],
     "prompt-tokens (8190) + max(gen-tokens, 32) exceeds the model's context of 8192"),
    (["--model", MODEL, "extra"], 'unexpected argument "extra"'),
])
def test_bad_arguments_exit_2_with_one_line(aerie, args, message):
    r = aerie("bench", *args)
    assert (r.rc, r.out, r.err) == (2, "", f"aerie bench: {message}\n")
