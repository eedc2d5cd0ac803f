"""The `aerie` command as a user runs it: info, tokenize, detokenize,
bench-tokenizer, settings with their sources, and clean failures."""
import json

import pytest

from conftest import MODEL


def test_info_json_reports_smollm2_dimensions(aerie, model):
    r = aerie("info", "--model", model, "--json")
    assert r.rc == 0, r.err
    info = r.json()
    assert info["format"] == "gguf"
    assert info["gguf_version"] == 3
    assert info["architecture"] == "llama"
    assert info["layers"] == 30
    assert info["hidden_size"] == 576
    assert info["ffn_size"] == 1536
    assert info["heads"] == 9
    assert info["kv_heads"] == 3
    assert info["head_dim"] == 64
    assert info["vocab_size"] == 49152
    assert info["context_length"] == 8192
    assert info["rope_theta"] == 100000
    assert info["rms_norm_eps"] == 1e-05
    assert info["tensors"] == 272
    assert {k: v["count"] for k, v in info["tensor_types"].items()} == {
        "F32": 61, "Q4_1": 210, "Q8_0": 1}
    # token_embd.weight is Q8_0 [576 x 49152]: 34 bytes per 32 values.
    assert info["tensor_types"]["Q8_0"]["bytes"] == 576 * 49152 // 32 * 34
    tk = info["tokenizer"]
    assert tk == {"model": "gpt2", "kind": "byte-level BPE", "pre": "smollm",
                  "tokens": 49152, "merges": 48900, "bos": 1, "eos": 2,
                  "add_bos": False, "chat_template": "chatml-default-system"}


def test_info_text_lists_dimensions_and_types(aerie, model):
    r = aerie("info", "--model", model)
    assert r.rc == 0, r.err
    lines = {ln.split(None, 1)[0]: ln.split(None, 1)[1] for ln in r.out.splitlines()
             if ln and not ln.startswith(("tensor", "tokenizer"))}
    assert lines["layers"] == "30"
    assert lines["hidden_size"] == "576"
    assert lines["heads"] == "9"
    assert lines["kv_heads"] == "3"
    assert lines["vocab_size"] == "49152"
    assert "tensor types    F32 x61" in r.out
    assert "Q4_1 x210" in r.out and "Q8_0 x1" in r.out


def test_tokenize_and_detokenize_round_trip(aerie, model):
    text = "Hello world! 12345 ünïcödé 🙂"
    r = aerie("tokenize", "--model", model, text)
    assert r.rc == 0, r.err
    ids = json.loads(r.out)
    assert r.out.count("\n") == 1 and " " not in r.out  # one line, compact
    # Reference ids from the `tokenizers` library on the same text; digits
    # are split one by one (the smollm pre-tokenizer).
    assert ids == [19556, 905, 17, 216, 33, 34, 35, 36, 37, 5549, 137, 94, 25972, 83,
                   7466, 84, 2756, 47526]
    back = aerie("detokenize", "--model", model, *ids)
    assert back.rc == 0, back.err
    assert back.out == text + "\n"


def test_tokenize_file_matches_argument(aerie, model, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("line one\nline two\n")
    a = aerie("tokenize", "--model", model, "--file", f)
    b = aerie("tokenize", "--model", model, "line one\nline two\n")
    assert a.rc == 0 and b.rc == 0
    assert a.out == b.out


def test_special_tokens_parsed_unless_disabled(aerie, model):
    r = aerie("tokenize", "--model", model, "<|im_start|>user")
    assert r.json()[0] == 1
    r = aerie("tokenize", "--model", model, "--no-special", "<|im_start|>user")
    assert 1 not in r.json()


def test_print_config_shows_each_source(aerie, model, tmp_path):
    conf = tmp_path / "c.json"
    conf.write_text(json.dumps({"special": False}))
    r = aerie("tokenize", "--config", conf, "--model", model, "--print-config",
              env={"AERIE_LOG_LEVEL": "error"})
    assert r.rc == 0, r.err
    assert r.json() == {
        "model": {"value": str(model), "source": "flag"},
        "file": {"value": None, "source": "unset"},
        "special": {"value": False, "source": "file"},
        "chat": {"value": False, "source": "default"},
        "log-level": {"value": "error", "source": "env"},
    }


def test_startup_log_prints_the_settings_table(aerie, model):
    r = aerie("tokenize", "--model", model, "--log-level", "info", "hi")
    assert r.rc == 0
    table = [ln.split(" ", 2)[2] for ln in r.err.splitlines() if " config " in ln]
    assert table == [
        "config model     = " + f"{str(model):<24} source=flag",
        "config file      = (unset)                  source=unset",
        "config special   = true                     source=default",
        "config chat      = false                    source=default",
        "config log-level = info                     source=flag",
    ]


def test_bench_tokenizer_prints_one_json_line(aerie, model, tmp_path):
    f = tmp_path / "bench.txt"
    f.write_text("The quick brown fox jumps over the lazy dog. 0123456789\n" * 200)
    r = aerie("bench-tokenizer", "--model", model, "--file", f, "--repeat", "3")
    assert r.rc == 0, r.err
    b = r.json()
    assert b["bytes"] == 56 * 200
    assert b["repeat"] == 3 and b["threads"] == 1
    tokens = aerie("tokenize", "--model", model, "--file", f).json()
    assert b["tokens"] == len(tokens)
    assert b["mb_per_s"] > 0


@pytest.mark.parametrize("args,message", [
    (["frobnicate"], 'aerie: unknown command "frobnicate" (try `aerie help`)'),
    (["info"], "aerie info: no model given (use --model FILE)"),
    (["info", "--model", "/nonexistent.gguf"], "aerie info: /nonexistent.gguf: No such file or directory"),
    (["tokenize", "--model", str(MODEL)], "aerie tokenize: no TEXT given (or use --file F)"),
    (["tokenize", "--colour", "x"], "aerie tokenize: unknown option --colour"),
    (["detokenize", "--model", str(MODEL), "12", "x7"], 'aerie detokenize: "x7" is not a token id'),
    (["detokenize", "--model", str(MODEL), "49152"],
     "aerie detokenize: token id 49152 is out of range (vocabulary has 49152)"),
    (["bench-tokenizer", "--model", str(MODEL), "--repeat", "0", "--file", "x"],
     "aerie bench-tokenizer: --repeat: 0 is outside 1..1000"),
])
def test_bad_arguments_exit_2_with_one_line(aerie, args, message):
    r = aerie(*args)
    assert r.rc == 2
    assert r.err == message + "\n"
    assert r.out == ""
