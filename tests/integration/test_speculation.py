"""`aerie generate --draft` and `aerie bench --draft` with EAGLE-3 heads:
a random head shaped for the default model (written by
tools/gen_eagle_fixture.py --default-head; `make test` makes it) and the
tiny fixture's head, which does not fit the default model. Greedy output
with speculation is the plain output, --stats reports the acceptance
figures, and a head that does not fit is refused with one line."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, GOLDEN

HEAD = ROOT / "build" / "heads" / "smollm2-random"
TINY_HEAD = GOLDEN / "eagle" / "tiny" / "head"
MAX = ["--max-tokens", "12", "--ignore-eos", "--max-seq-len", "256"]


@pytest.fixture(scope="module")
def head():
    if not (HEAD / "model.safetensors").exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "gen_eagle_fixture.py"), "--default-head", str(HEAD)],
                       check=True)
    return HEAD


def stats_of(r):
    return json.loads(r.err.strip().splitlines()[-1])


@pytest.mark.parametrize("shape", [("4", "1", "5"), ("4", "3", "8"), ("8", "4", "32")],
                         ids=["chain", "wide", "deep"])
def test_greedy_output_is_the_plain_output(aerie, model, head, shape):
    steps, topk, tokens = shape
    for prompt in ["The capital of France is", "def fib(n):", "x"]:
        plain = aerie("generate", "--model", model, "--prompt", prompt, "--ids", *MAX)
        spec = aerie("generate", "--model", model, "--prompt", prompt, "--ids", *MAX, "--draft", head,
                     "--spec-steps", steps, "--spec-topk", topk, "--spec-tokens", tokens, "--stats")
        assert plain.rc == 0 and spec.rc == 0, plain.err + spec.err
        assert spec.json() == plain.json()
        st = stats_of(spec)
        assert st["speculation"] is True
        assert (st["spec_steps"], st["spec_topk"], st["spec_tokens"]) == (int(steps), int(topk), int(tokens))
        assert len(st["accept_per_depth"]) == int(steps)


def test_stats_report_the_acceptance_figures(aerie, model, head):
    r = aerie("generate", "--model", model, "--prompt", "Once upon a time", "--ids", *MAX, "--draft", head,
              "--stats")
    assert r.rc == 0, r.err
    st = stats_of(r)
    assert st["generated_tokens"] == 12
    # Each step emits its accepted tokens and a bonus; the last step may
    # overshoot max-tokens, and the extra tokens are dropped.
    assert st["emitted_tokens"] == st["verify_steps"] + st["plain_steps"] + st["accepted_tokens"]
    assert 12 <= st["emitted_tokens"] < 12 + 5
    assert st["drafted_tokens"] == 7 * st["verify_steps"]  # default shape: 8 nodes, root included
    assert st["draft_failures"] == 0 and st["bad_trees"] == 0
    assert st["mean_accept_len"] == pytest.approx(1 + st["accepted_tokens"] / st["verify_steps"], abs=1e-4)
    assert 0 < st["draft_time_share"] < 1
    assert st["decode_tok_per_s"] > 0


def test_sampled_speculation_is_reproducible_by_seed(aerie, model, head):
    args = ["generate", "--model", model, "--prompt", "Once upon a time", "--ids", *MAX, "--draft", head,
            "--temperature", "0.9", "--top-k", "40"]
    a = aerie(*args, "--seed", "3")
    b = aerie(*args, "--seed", "3")
    c = aerie(*args, "--seed", "4")
    assert a.rc == 0, a.err
    assert a.json() == b.json()
    assert a.json() != c.json()


@pytest.mark.parametrize("shape", [("4", "1", "5"), ("4", "3", "8"), ("8", "4", "32")],
                         ids=["chain", "wide", "deep"])
def test_sampled_output_is_the_plain_output_for_the_same_seed(aerie, model, head, shape):
    # The token at each position is the target's keyed draw for (seed,
    # position): the tree only decides how many are checked in one pass.
    steps, topk, tokens = shape
    for prompt, sampling in [("Once upon a time", ["--temperature", "0.9", "--top-k", "40"]),
                             ("def fib(n):", ["--temperature", "1.2", "--top-p", "0.95"])]:
        args = ["generate", "--model", model, "--prompt", prompt, "--ids", *MAX, *sampling, "--seed", "11"]
        plain = aerie(*args)
        spec = aerie(*args, "--draft", head, "--spec-steps", steps, "--spec-topk", topk, "--spec-tokens", tokens,
                     "--stats")
        assert plain.rc == 0 and spec.rc == 0, plain.err + spec.err
        assert spec.json() == plain.json()
        assert stats_of(spec)["verify_steps"] > 0


def test_a_head_for_another_model_is_refused_naming_the_tensor(aerie, model):
    r = aerie("generate", "--model", model, "--prompt", "x", "--draft", TINY_HEAD)
    assert r.rc == 2
    assert r.err == (f"aerie generate: head {TINY_HEAD}: fc.weight is [32, 96], the target (hidden 576) "
                     "needs [576, 1728]\n")


def test_a_head_rounded_to_q8_0_gives_the_same_output(aerie, model, head):
    args = ["generate", "--model", model, "--prompt", "The capital of France is", "--ids", *MAX]
    plain = aerie(*args)
    q8 = aerie(*args, "--draft", head, "--draft-weights", "q8_0", "--stats")
    assert q8.rc == 0, q8.err
    assert q8.json() == plain.json()
    assert stats_of(q8)["verify_steps"] > 0


def test_bad_speculation_settings_exit_2(aerie, model, head):
    r = aerie("generate", "--model", model, "--prompt", "x", "--draft", head, "--spec-topk", "9")
    assert (r.rc, r.err) == (2, "aerie generate: --spec-topk: 9 is outside 1..8\n")
    r = aerie("generate", "--model", model, "--prompt", "x", "--draft", head, "--draft-weights", "q4")
    assert (r.rc, r.err) == (2, 'aerie generate: draft weights "q4": expected file or q8_0\n')
    r = aerie("generate", "--model", model, "--prompt", "x", "--draft", ROOT / "no-such-head")
    assert r.rc == 2
    assert "no-such-head/config.json: cannot open" in r.err


def test_print_config_shows_the_speculation_settings(aerie, model, head):
    r = aerie("generate", "--model", model, "--prompt", "x", "--draft", head, "--spec-steps", "3",
              "--print-config")
    assert r.rc == 0, r.err
    c = r.json()
    assert c["draft"] == {"value": str(head), "source": "flag"}
    assert c["spec-steps"] == {"value": 3, "source": "flag"}
    assert c["spec-topk"] == {"value": 4, "source": "default"}
    assert c["spec-tokens"] == {"value": 8, "source": "default"}


def test_bench_reports_speculative_and_plain_decoding_side_by_side(aerie, model, head):
    r = aerie("bench", "--model", model, "--draft", head, "--prompt-tokens", "16", "--gen-tokens", "8",
              "--repeat", "1", "--bandwidth-mib", "16", timeout=300)
    assert r.rc == 0, r.err
    b = r.json()
    assert b["spec_output_identical"] is True
    assert b["plain_decode_tok_per_s"] > 0 and b["spec_decode_tok_per_s"] > 0
    assert b["spec_speedup"] == pytest.approx(b["spec_decode_tok_per_s"] / b["plain_decode_tok_per_s"], rel=0.01)
    # Three rounds of 8 tokens, 7 drafted nodes per verify step.
    assert b["drafted_tokens"] == 7 * b["verify_steps"]
    assert b["emitted_tokens"] == b["verify_steps"] + b["plain_steps"] + b["accepted_tokens"]
    assert 3 * 8 <= b["emitted_tokens"] < 3 * (8 + 5)


SHIPPED = ROOT / "models" / "smollm2-135m-eagle3"


def test_the_default_model_drafts_with_its_shipped_head(aerie, model):
    r = aerie("generate", "--model", model, "--prompt", "x", "--print-config")
    assert r.rc == 0, r.err
    assert r.json()["draft"] == {"value": str(SHIPPED), "source": "auto"}
    args = ["generate", "--model", model, "--chat", "--prompt", '[{"role":"user","content":"Write a short poem about the sea."}]',
            "--ids", "--max-tokens", "48", "--stats"]
    spec = aerie(*args)
    always = aerie(*args, "--no-spec-adaptive")
    plain = aerie(*args, "--draft", "none")
    assert spec.rc == 0 and always.rc == 0 and plain.rc == 0, spec.err + always.err + plain.err
    assert spec.json() == plain.json() == always.json()
    assert stats_of(spec)["speculation"] is True and stats_of(plain)["speculation"] is False
    # Adaptive: the first steps are a plain probe (PLAIN_PROBE_STEPS, target/spec.h).
    assert len(spec.json()) == 48 and stats_of(spec)["adaptive_plain_steps"] >= 5
    # Drafting on every step, the trained head has tokens accepted (the
    # random head never does).
    st = stats_of(always)
    assert st["adaptive_plain_steps"] == 0 and st["plain_steps"] == 0
    assert st["accepted_tokens"] > 0 and st["mean_accept_len"] > 1.3


def test_a_model_without_a_head_beside_it_decodes_plainly(aerie, model, tmp_path):
    lone = tmp_path / model.name
    lone.symlink_to(model)
    r = aerie("generate", "--model", lone, "--prompt", "x", "--print-config")
    assert r.json()["draft"] == {"value": "none", "source": "auto"}
    # A directory beside it whose training.json names another model is not taken.
    other = tmp_path / "other-eagle3"
    other.mkdir()
    (other / "training.json").write_text('{"target_model": "another.gguf"}')
    r = aerie("generate", "--model", lone, "--prompt", "x", "--print-config")
    assert r.json()["draft"] == {"value": "none", "source": "auto"}
