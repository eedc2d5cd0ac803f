"""`aerie generate` on the CPU engine: greedy is deterministic, a seed
reproduces a sampled run, --ids and --stats print what README.md says, and
bad arguments exit 2 with one line."""
import json

MAX = ["--max-tokens", "8"]


def test_greedy_ids_are_deterministic_and_decode_to_the_text(aerie, model):
    a = aerie("generate", "--model", model, "--prompt", "The capital of France is", "--ids", *MAX)
    b = aerie("generate", "--model", model, "--prompt", "The capital of France is", "--ids", *MAX,
              "--threads", "1")
    assert a.rc == 0, a.err
    ids = a.json()
    assert len(ids) == 8
    assert b.json() == ids  # thread count does not change greedy output
    text = aerie("generate", "--model", model, "--prompt", "The capital of France is", *MAX)
    assert text.rc == 0, text.err
    decoded = aerie("detokenize", "--model", model, *ids).out
    assert text.out == decoded
    assert text.out.startswith(" Paris")


def test_seed_reproduces_a_sampled_run(aerie, model):
    args = ["generate", "--model", model, "--prompt", "Once upon a time", "--ids",
            "--temperature", "0.9", "--top-p", "0.95", *MAX]
    a = aerie(*args, "--seed", "7").json()
    b = aerie(*args, "--seed", "7").json()
    c = aerie(*args, "--seed", "8").json()
    assert a == b
    assert a != c


def test_stats_line_reports_throughput(aerie, model):
    r = aerie("generate", "--model", model, "--prompt", "Hello", "--stats", "--ids", "--draft", "none", *MAX)
    assert r.rc == 0, r.err
    stats = json.loads(r.err.strip().splitlines()[-1])
    assert stats["prompt_tokens"] == 1
    assert stats["generated_tokens"] == 8
    assert stats["speculation"] is False
    assert stats["decode_tok_per_s"] > 0 and stats["prefill_tok_per_s"] > 0


def test_chat_prompt_uses_the_template(aerie, model):
    r = aerie("generate", "--model", model, "--chat", "--ids", *MAX,
              "--prompt", '[{"role":"user","content":"Say hi"}]', "--stats")
    assert r.rc == 0, r.err
    stats = json.loads(r.err.strip().splitlines()[-1])
    # The default system prompt and the template's markers are in the prompt.
    assert stats["prompt_tokens"] == len(aerie("tokenize", "--model", model, "--chat",
                                               '[{"role":"user","content":"Say hi"}]').json())


def test_bad_generate_arguments_exit_2(aerie, model):
    r = aerie("generate", "--model", model)
    assert (r.rc, r.err) == (2, "aerie generate: no prompt given (use --prompt TEXT)\n")
    r = aerie("generate", "--model", model, "--prompt", "x", "--top-p", "1.5")
    assert (r.rc, r.err) == (2, "aerie generate: --top-p: 1.5 is outside 0..1\n")
    r = aerie("generate", "--model", model, "--prompt", "x", "--max-tokens", "9000")
    assert r.rc == 2
    assert r.err == ("aerie generate: prompt (1 tokens) + max-tokens (9000) exceeds the model's "
                     "context of 8192\n")


def test_impossible_memory_plan_exits_2_with_the_arithmetic_and_a_fix(aerie, model):
    import re
    # The model alone (--draft none): with its head the weights line adds the head's.
    r = aerie("generate", "--model", model, "--prompt", "x", "--mem-fraction", "0.01", "--draft", "none")
    assert r.rc == 2
    assert r.err.count("\n") == 1
    assert r.err.startswith("aerie generate: memory plan: one sequence of max-seq-len 8192 does not "
                            "fit: weights 92.1 MiB + workspace ")
    fix = re.search(r"would work: --mem-fraction ([0-9.]+), --max-seq-len ([0-9]+)$", r.err.strip())
    assert fix, r.err
    # The suggested settings work (with room for available memory moving
    # between the two runs).
    seq_len = int(fix.group(2)) // 2
    ok = aerie("generate", "--model", model, "--prompt", "x", "--mem-fraction", "0.01", "--draft", "none",
               "--max-seq-len", seq_len, "--max-tokens", "2", "--ids")
    assert ok.rc == 0, ok.err
    assert len(ok.json()) == 2


def test_print_config_resolves_auto_settings_with_their_source(aerie, model):
    r = aerie("generate", "--model", model, "--prompt", "x", "--print-config",
              env={"AERIE_MAX_BATCH": "2"})
    assert r.rc == 0, r.err
    c = r.json()
    assert c["mem-fraction"]["source"] == "auto" and 0.01 <= c["mem-fraction"]["value"] <= 0.9
    assert c["max-seq-len"] == {"value": 8192, "source": "auto"}  # the model's context
    assert c["max-batch"] == {"value": 2, "source": "env"}
    assert c["max-kv-tokens"]["source"] == "auto"
    assert c["max-kv-tokens"]["value"] == 2 * 8192  # what 2 sequences can use, all of it fits
    assert c["threads"]["source"] == "auto"
