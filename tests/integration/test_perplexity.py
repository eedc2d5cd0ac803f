"""`aerie perplexity` on a small committed text against a small committed
base written by tools/gen_ppl_base.py (f32 transformers, --ctx 128): the
window count, perplexity next to transformers', KL divergence and top-1
agreement within bounds measured on this engine, and clean failures.

The bounds at 15-bit activations (measured: ppl 47.15629 against
transformers' 47.15555, relative 1.6e-5; kld_mean 1.56e-7; kld_p99 6.3e-7;
top1_agree 1.0) leave about ten times room for the last bits of the
arithmetic, and fail at once if the engine's numbers drift the way an
8-bit activation path would move them. The 8-bit default has bounds of its
own, measured the same way (PPL_8BIT)."""
import math
import struct

import pytest

from conftest import GOLDEN

PPL = GOLDEN / "ppl"
TEXT = PPL / "small.txt"
BASE = PPL / "small.base"
SLOW = 600  # ASan build, two full windows of logits
# The default model's perplexity at 8-bit activations, the default, as
# measured here (kld_mean 2.2e-3 against the base; top1_agree 0.929). Each
# precision's bits are the same on every SIMD path and thread count, so
# only a change to the arithmetic moves it.
PPL_8BIT = 46.884100


def base_ppl(path):
    """exp of the mean -logp_next of the base, read here independently."""
    data = path.read_bytes()
    assert data[:8] == b"AEPPLB01"
    vocab, ctx, windows, k, flags = struct.unpack_from("<5I", data, 8)
    off = 28 + 4 * windows * ctx
    n = windows * (ctx - 1 - ctx // 2)
    rec = 8 + 8 * k
    assert len(data) == off + n * rec
    nll = -sum(struct.unpack_from("<f", data, off + i * rec)[0] for i in range(n))
    return math.exp(nll / n), n


def test_small_text_scores_two_windows_close_to_transformers(aerie, model):
    r = aerie("perplexity", "--model", model, "--file", TEXT, "--ctx", "128", "--kl-base", BASE, "--act-bits", "15",
              timeout=SLOW)
    assert r.rc == 0, r.err
    o = r.json()
    assert o["windows"] == 2  # 362 tokens: two windows of 128, a tail of 106 dropped
    assert o["tokens"] == 2 * 63  # rows 64..126 of each window
    assert o["ctx"] == 128
    want, n = base_ppl(BASE)
    assert n == o["tokens"]
    assert o["base_ppl"] == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(47.155549, rel=1e-6)  # gen_ppl_base.py's own figure
    assert abs(o["ppl"] - want) / want < 2e-4
    assert 0 <= o["kld_mean"] < 2e-6
    assert 0 <= o["kld_p99"] < 1e-5
    assert o["top1_agree"] == 1.0
    assert o["act_bits"] == 15


def test_without_a_base_only_perplexity_is_reported_at_the_8bit_default(aerie, model):
    r = aerie("perplexity", "--model", model, "--file", TEXT, "--ctx", "128", timeout=SLOW)
    assert r.rc == 0, r.err
    o = r.json()
    assert (o["windows"], o["tokens"], o["act_bits"]) == (2, 126, 8)
    assert "kld_mean" not in o and "top1_agree" not in o and "base_ppl" not in o
    assert o["ppl"] == pytest.approx(PPL_8BIT, rel=1e-6)


def failure(aerie, *args):
    r = aerie("perplexity", *args)
    assert r.rc == 2
    assert r.out == ""
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    return lines[0]


def test_a_missing_text_fails_cleanly(aerie, model, tmp_path):
    missing = tmp_path / "none.txt"
    line = failure(aerie, "--model", model, "--file", missing)
    assert line == "aerie perplexity: %s: cannot open: No such file or directory" % missing
    assert failure(aerie, "--model", model) == "aerie perplexity: no text given (use --file FILE)"


def test_a_text_shorter_than_one_window_fails(aerie, model, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Only a few words here.")
    line = failure(aerie, "--model", model, "--file", short)
    assert line == ("aerie perplexity: %s: the text has 6 tokens, fewer than one window of --ctx 512"
                    % short)


def test_a_ctx_too_small_fails(aerie, model):
    line = failure(aerie, "--model", model, "--file", TEXT, "--ctx", "3")
    assert line == "aerie perplexity: --ctx: 3 is outside 4..1048576"


def test_a_base_for_another_ctx_fails(aerie, model):
    line = failure(aerie, "--model", model, "--file", TEXT, "--ctx", "64", "--kl-base", BASE)
    assert line == "aerie perplexity: --kl-base: the base was made with --ctx 128, not 64"


def test_a_base_for_another_text_fails(aerie, model, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text(TEXT.read_text(encoding="utf-8").replace("Translation Project", "Translation Office", 1),
                     encoding="utf-8")
    line = failure(aerie, "--model", model, "--file", other, "--ctx", "128", "--kl-base", BASE)
    assert line == ("aerie perplexity: --kl-base: the base's tokens differ from the text's at window 0 "
                    "position 2 (base 5265, text 7054): a different text or tokenizer")  # " Project", " Office"
    longer = tmp_path / "longer.txt"
    longer.write_text(TEXT.read_text(encoding="utf-8") * 3, encoding="utf-8")
    line = failure(aerie, "--model", model, "--file", longer, "--ctx", "128", "--kl-base", BASE)
    assert line == "aerie perplexity: --kl-base: the base holds 2 windows, the text makes 8 (a different text?)"


def test_a_truncated_or_foreign_base_fails(aerie, model, tmp_path):
    cut = tmp_path / "cut.base"
    data = BASE.read_bytes()
    cut.write_bytes(data[:-4])
    line = failure(aerie, "--model", model, "--file", TEXT, "--ctx", "128", "--kl-base", cut)
    assert line == ("aerie perplexity: --kl-base: %s: %d bytes, but its header (ctx 128, 2 windows, top_k 32) "
                    "makes it %d" % (cut, len(data) - 4, len(data)))
    line = failure(aerie, "--model", model, "--file", TEXT, "--ctx", "128", "--kl-base", TEXT)
    assert line == ("aerie perplexity: --kl-base: %s: not a perplexity base (no \"AEPPLB01\" header; "
                    "tools/gen_ppl_base.py writes them)" % TEXT)
