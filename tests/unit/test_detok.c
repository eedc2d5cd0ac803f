/* Streaming detokenizer: the byte-level UTF-8 repairer (no tokenizer
 * needed), then token streams through the real SmolLM2 tokenizer.
 *
 * Expected outputs for invalid input are literals computed with Python's
 * bytes.decode("utf-8", "replace"), which follows the same maximal-subpart
 * rule as Rust's String::from_utf8_lossy. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../../services/core/err.h"
#include "../../services/model/gguf.h"
#include "../../services/tokenizer/detok.h"
#include "../../services/tokenizer/tok.h"

#define FFFD "\xEF\xBF\xBD"

/* Pushes in[0..n) in pieces cut at the given offsets (ascending, each in
 * (0, n)), checks that every piece of output is valid UTF-8 on its own,
 * and returns the concatenation plus flush in out (NUL-terminated). */
static size_t stream_split(const char *in, size_t n, const size_t *cuts, size_t n_cuts, char *out, size_t cap) {
    detok_utf8 u;
    detok_utf8_init(&u);
    size_t w = 0, start = 0;
    for (size_t c = 0; c <= n_cuts; c++) {
        size_t end = c < n_cuts ? cuts[c] : n;
        assert_true(end >= start && end <= n);
        char chunk[256];
        assert_true(DETOK_UTF8_MAX_OUT(end - start) <= sizeof chunk);
        size_t k = detok_utf8_push(&u, in + start, end - start, chunk, sizeof chunk);
        assert_true(detok_utf8_valid(chunk, k));
        assert_true(w + k < cap);
        memcpy(out + w, chunk, k);
        w += k;
        start = end;
    }
    char tail[3];
    size_t k = detok_utf8_flush(&u, tail, sizeof tail);
    assert_false(detok_utf8_pending(&u));
    assert_true(w + k < cap);
    memcpy(out + w, tail, k);
    w += k;
    out[w] = '\0';
    return w;
}

static void assert_lossy(const char *in, size_t n, const char *want) {
    char out[512];
    size_t w = stream_split(in, n, NULL, 0, out, sizeof out);
    assert_int_equal(w, strlen(want));
    assert_memory_equal(out, want, w);
}

#define LOSSY(in, want) assert_lossy(in, sizeof(in) - 1, want)

static void test_utf8_ascii_passes_through(void **state) {
    (void)state;
    LOSSY("hello, world", "hello, world");
    LOSSY("", "");
}

static void test_utf8_valid_multibyte_passes_through(void **state) {
    (void)state;
    /* 2-, 3- and 4-byte characters, the edges of each range, and U+FFFD
     * itself (valid input that must not count as a replacement). */
    LOSSY("\xC2\x80\xDF\xBF", "\xC2\x80\xDF\xBF");
    LOSSY("\xE0\xA0\x80\xED\x9F\xBF\xEE\x80\x80\xEF\xBF\xBF", "\xE0\xA0\x80\xED\x9F\xBF\xEE\x80\x80\xEF\xBF\xBF");
    LOSSY("\xF0\x90\x80\x80\xF4\x8F\xBF\xBF", "\xF0\x90\x80\x80\xF4\x8F\xBF\xBF");
    LOSSY(FFFD, FFFD);
    assert_true(detok_utf8_valid(FFFD, 3));
}

static void test_utf8_lone_continuation_bytes_each_replaced(void **state) {
    (void)state;
    LOSSY("\x80", FFFD);
    LOSSY("\xBF\x80", FFFD FFFD);
}

static void test_utf8_overlong_forms_replaced_byte_by_byte(void **state) {
    (void)state;
    /* C0/C1 can never start a character; E0 80, F0 80 fail at the second
     * byte, so the lead alone is the maximal subpart. */
    LOSSY("\xC0\xAF", FFFD FFFD);
    LOSSY("\xC1\xBF", FFFD FFFD);
    LOSSY("\xE0\x80\xAF", FFFD FFFD FFFD);
    LOSSY("\xE0\x9F\xBF", FFFD FFFD FFFD);
    LOSSY("\xF0\x80\x80\xAF", FFFD FFFD FFFD FFFD);
    LOSSY("\xF0\x8F\xBF\xBF", FFFD FFFD FFFD FFFD);
}

static void test_utf8_surrogates_replaced_byte_by_byte(void **state) {
    (void)state;
    LOSSY("\xED\xA0\x80", FFFD FFFD FFFD); /* U+D800 */
    LOSSY("\xED\xBF\xBF", FFFD FFFD FFFD); /* U+DFFF */
}

static void test_utf8_above_max_code_point_replaced(void **state) {
    (void)state;
    LOSSY("\xF4\x90\x80\x80", FFFD FFFD FFFD FFFD); /* U+110000 */
    LOSSY("\xF5\x80\x80\x80", FFFD FFFD FFFD FFFD);
    LOSSY("\xFF", FFFD);
    LOSSY("\xFE", FFFD);
}

static void test_utf8_truncated_character_is_one_replacement(void **state) {
    (void)state;
    LOSSY("\xC3", FFFD);
    LOSSY("\xE2\x82", FFFD);
    LOSSY("\xF0\x9F\x98", FFFD);
    LOSSY("a\xE2\x82\xAC"
          "b\xE2\x82",
          "a\xE2\x82\xAC"
          "b" FFFD);
    /* A truncated prefix followed by something that cannot continue it. */
    LOSSY("\xE2\x82"
          "a",
          FFFD "a");
    LOSSY("\xF0\x9F\x98\xE2\x82\xAC", FFFD "\xE2\x82\xAC");
    LOSSY("\xF1\x80\x80\xC3\xA9", FFFD "\xC3\xA9");
}

static void test_utf8_mixed_invalid_matches_python(void **state) {
    (void)state;
    /* b"a\xF1\x80\x80\xE1\x80\xC2b\x80c\x80\xBFd".decode("utf-8","replace") */
    LOSSY("a\xF1\x80\x80\xE1\x80\xC2"
          "b\x80"
          "c\x80\xBF"
          "d",
          "a" FFFD FFFD FFFD "b" FFFD "c" FFFD FFFD "d");
}

static void test_utf8_char_split_at_every_point_is_held_back(void **state) {
    (void)state;
    static const char *chars[] = {"\xC3\xA9", "\xE2\x82\xAC", "\xE4\xB8\xAD", "\xF0\x9F\x98\x80", "\xF4\x8F\xBF\xBF"};
    for (size_t c = 0; c < sizeof chars / sizeof chars[0]; c++) {
        size_t len = strlen(chars[c]);
        for (size_t cut = 1; cut < len; cut++) {
            detok_utf8 u;
            detok_utf8_init(&u);
            char out[32];
            size_t k = detok_utf8_push(&u, chars[c], cut, out, sizeof out);
            assert_int_equal(k, 0);
            assert_true(detok_utf8_pending(&u));
            k = detok_utf8_push(&u, chars[c] + cut, len - cut, out, sizeof out);
            assert_int_equal(k, len);
            assert_memory_equal(out, chars[c], len);
            assert_false(detok_utf8_pending(&u));
        }
        /* And one byte at a time: nothing until the last byte. */
        detok_utf8 u;
        detok_utf8_init(&u);
        char out[8];
        for (size_t i = 0; i < len; i++) {
            size_t k = detok_utf8_push(&u, chars[c] + i, 1, out, sizeof out);
            assert_int_equal(k, i + 1 < len ? 0 : len);
        }
        assert_memory_equal(out, chars[c], len);
    }
}

/* Every input split into three pushes at every pair of points must give
 * the same text as the whole input in one push (which the LOSSY tests pin
 * to Python's output), with every piece valid on its own. */
static void test_utf8_any_split_gives_the_same_text(void **state) {
    (void)state;
    static const struct {
        const char *in, *want;
    } cases[] = {
        {"a\xF1\x80\x80\xE1\x80\xC2"
         "b\x80"
         "c\x80\xBF"
         "d",
         "a" FFFD FFFD FFFD "b" FFFD "c" FFFD FFFD "d"},
        {"\xF0\x9F\x98\x80\xE4\xB8\xAD\xC3\xA9!", "\xF0\x9F\x98\x80\xE4\xB8\xAD\xC3\xA9!"},
        {"\xED\xA0\x80\xF0\x9F\x98\xE2\x82\xAC\xE2\x82", FFFD FFFD FFFD FFFD "\xE2\x82\xAC" FFFD},
        {"\xF4\x90\x80\x80\xC0\xAF\xE0\x80\xAFx", FFFD FFFD FFFD FFFD FFFD FFFD FFFD FFFD FFFD "x"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        size_t n = strlen(cases[c].in);
        for (size_t i = 0; i <= n; i++) {
            for (size_t j = i; j <= n; j++) {
                size_t cuts[2] = {i, j};
                char out[256];
                size_t w = stream_split(cases[c].in, n, cuts, 2, out, sizeof out);
                assert_int_equal(w, strlen(cases[c].want));
                assert_memory_equal(out, cases[c].want, w);
            }
        }
    }
}

static void test_utf8_valid_rejects_each_kind_of_error(void **state) {
    (void)state;
    assert_true(detok_utf8_valid("", 0));
    assert_true(detok_utf8_valid("a\xC3\xA9\xF0\x9F\x98\x80", 7));
    assert_false(detok_utf8_valid("\x80", 1));
    assert_false(detok_utf8_valid("\xC0\xAF", 2));
    assert_false(detok_utf8_valid("\xED\xA0\x80", 3));
    assert_false(detok_utf8_valid("\xF4\x90\x80\x80", 4));
    assert_false(detok_utf8_valid("ok\xE2\x82", 4)); /* truncated at the end */
}

static void test_utf8_flush_without_pending_writes_nothing(void **state) {
    (void)state;
    detok_utf8 u;
    detok_utf8_init(&u);
    char out[16];
    assert_int_equal(detok_utf8_push(&u, "ab", 2, out, sizeof out), 2);
    assert_int_equal(detok_utf8_flush(&u, out, sizeof out), 0);
    /* After a flush of a truncated tail the stream starts clean. */
    assert_int_equal(detok_utf8_push(&u, "\xE2", 1, out, sizeof out), 0);
    assert_int_equal(detok_utf8_flush(&u, out, sizeof out), 3);
    assert_memory_equal(out, FFFD, 3);
    assert_int_equal(detok_utf8_push(&u, "\x82\xAC", 2, out, sizeof out), 6);
    assert_memory_equal(out, FFFD FFFD, 6);
}

/* ---- with the real tokenizer ------------------------------------------- */

#define MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

typedef struct fixture {
    gguf_file *f;
    tok *t;
} fixture;

static int tok_setup(void **state) {
    fixture *fx = calloc(1, sizeof *fx);
    assert_non_null(fx);
    ae_error err = {0};
    if (gguf_open(&fx->f, MODEL, &err) != AE_OK) {
        fprintf(stderr, "cannot open %s (run from the repo root after `make model`): %s\n", MODEL, err.msg);
        free(fx);
        return -1;
    }
    if (tok_load_gguf(&fx->t, fx->f, &err) != AE_OK) {
        fprintf(stderr, "tok_load_gguf: %s\n", err.msg);
        gguf_close(fx->f);
        free(fx);
        return -1;
    }
    *state = fx;
    return 0;
}

static int tok_teardown(void **state) {
    fixture *fx = *state;
    if (fx) {
        tok_free(fx->t);
        gguf_close(fx->f);
        free(fx);
    }
    return 0;
}

/* Streams ids through a detok, checks each chunk is valid UTF-8 and the
 * whole equals tok_decode. Returns how many pushes ended with bytes held
 * back, so callers can prove the split path was exercised. */
static size_t stream_ids_matches_decode(const tok *t, const int32_t *ids, size_t n, bool skip_special) {
    ae_error err = {0};
    detok *d = NULL;
    assert_int_equal(detok_init(&d, t, skip_special, &err), AE_OK);
    size_t cap = detok_max_out(d);
    char *chunk = malloc(cap);
    size_t total_cap = n * cap + 4;
    char *streamed = malloc(total_cap);
    assert_non_null(chunk);
    assert_non_null(streamed);
    size_t w = 0, held = 0;
    for (size_t i = 0; i < n; i++) {
        size_t k = 0;
        assert_int_equal(detok_push(d, ids[i], chunk, cap, &k, &err), AE_OK);
        assert_true(detok_utf8_valid(chunk, k));
        memcpy(streamed + w, chunk, k);
        w += k;
        if (detok_pending(d)) held++;
    }
    w += detok_flush(d, streamed + w, total_cap - w);

    /* Lossy decoding never writes more than 3 bytes per input byte, so the
     * stream's worst case is also room enough for tok_decode. */
    size_t need = 0;
    char *whole = malloc(total_cap);
    assert_non_null(whole);
    assert_int_equal(tok_decode(t, ids, n, skip_special, whole, total_cap, &need, &err), AE_OK);
    assert_true(need < total_cap);
    assert_int_equal(w, need);
    assert_memory_equal(streamed, whole, need);
    free(whole);
    free(streamed);
    free(chunk);
    detok_free(d);
    return held;
}

static void test_tok_emoji_and_cjk_split_across_tokens(void **state) {
    fixture *fx = *state;
    static const char *texts[] = {
        "Hello 😀 world 🎉🎉 done",
        "中文分词测试：你好，世界！",
        "mixed: naïve café 日本語 👩‍👩‍👧 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    };
    size_t held_total = 0;
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        ae_error err = {0};
        int32_t ids[256];
        size_t n = 0;
        assert_int_equal(tok_encode(fx->t, texts[i], strlen(texts[i]), 0, ids, 256, &n, &err), AE_OK);
        held_total += stream_ids_matches_decode(fx->t, ids, n, false);
    }
    /* If no token ever ended inside a character, this test proved nothing. */
    assert_true(held_total > 0);
}

static void test_tok_stream_of_the_whole_text_equals_it(void **state) {
    fixture *fx = *state;
    const char *text = "Grüße 👋 — ok";
    ae_error err = {0};
    int32_t ids[64];
    size_t n = 0;
    assert_int_equal(tok_encode(fx->t, text, strlen(text), 0, ids, 64, &n, &err), AE_OK);
    detok *d = NULL;
    assert_int_equal(detok_init(&d, fx->t, false, &err), AE_OK);
    char *chunk = malloc(detok_max_out(d));
    char got[128];
    size_t w = 0;
    for (size_t i = 0; i < n; i++) {
        size_t k = 0;
        assert_int_equal(detok_push(d, ids[i], chunk, detok_max_out(d), &k, &err), AE_OK);
        assert_true(w + k < sizeof got);
        memcpy(got + w, chunk, k);
        w += k;
    }
    assert_int_equal(detok_flush(d, got + w, sizeof got - w), 0);
    assert_int_equal(w, strlen(text));
    assert_memory_equal(got, text, w);
    free(chunk);
    detok_free(d);
}

static void test_tok_invalid_bytes_become_replacement_like_decode(void **state) {
    fixture *fx = *state;
    /* Byte-level BPE has a token for every single byte; U+00E2 "â" is the
     * GPT-2 byte map's name for the raw byte 0xE2, which starts a 3-byte
     * character that the next token ("a") cannot continue. */
    int32_t lead = tok_find(fx->t, "\xC3\xA2", 2);
    int32_t a = tok_find(fx->t, "a", 1);
    assert_true(lead >= 0 && a >= 0);
    int32_t ids[] = {a, lead, a, lead};
    stream_ids_matches_decode(fx->t, ids, 4, false);

    ae_error err = {0};
    detok *d = NULL;
    assert_int_equal(detok_init(&d, fx->t, false, &err), AE_OK);
    char *chunk = malloc(detok_max_out(d));
    size_t k = 0;
    assert_int_equal(detok_push(d, lead, chunk, detok_max_out(d), &k, &err), AE_OK);
    assert_int_equal(k, 0);
    assert_int_equal(detok_push(d, a, chunk, detok_max_out(d), &k, &err), AE_OK);
    assert_int_equal(k, 4);
    assert_memory_equal(chunk, FFFD "a", 4);
    assert_int_equal(detok_push(d, lead, chunk, detok_max_out(d), &k, &err), AE_OK);
    assert_int_equal(detok_flush(d, chunk, detok_max_out(d)), 3);
    assert_memory_equal(chunk, FFFD, 3);
    free(chunk);
    detok_free(d);
}

static void test_tok_special_tokens_skipped_like_decode(void **state) {
    fixture *fx = *state;
    const char *text = "<|im_start|>user\nhé 😀<|im_end|>\n";
    ae_error err = {0};
    int32_t ids[64];
    size_t n = 0;
    assert_int_equal(tok_encode(fx->t, text, strlen(text), TOK_PARSE_SPECIAL, ids, 64, &n, &err), AE_OK);
    int32_t im_start = tok_find(fx->t, "<|im_start|>", 12);
    assert_true(im_start >= 0);
    assert_int_equal(ids[0], im_start);
    assert_true(tok_is_special(fx->t, im_start));
    stream_ids_matches_decode(fx->t, ids, n, false);
    stream_ids_matches_decode(fx->t, ids, n, true);

    detok *d = NULL;
    assert_int_equal(detok_init(&d, fx->t, true, &err), AE_OK);
    char *chunk = malloc(detok_max_out(d));
    size_t k = 99;
    assert_int_equal(detok_push(d, im_start, chunk, detok_max_out(d), &k, &err), AE_OK);
    assert_int_equal(k, 0);
    free(chunk);
    detok_free(d);
}

static void test_tok_bad_id_and_small_buffer_are_errors(void **state) {
    fixture *fx = *state;
    ae_error err = {0};
    detok *d = NULL;
    assert_int_equal(detok_init(&d, fx->t, false, &err), AE_OK);
    char buf[4];
    size_t k = 0;
    assert_int_equal(detok_push(d, tok_vocab_size(fx->t), buf, sizeof buf, &k, &err), AE_ERR);
    assert_non_null(strstr(err.msg, "out of range"));
    err_clear(&err);
    assert_int_equal(detok_push(d, -1, buf, sizeof buf, &k, &err), AE_ERR);
    err_clear(&err);

    /* This token is one raw byte, 0xE2 (a lead byte): the worst case is
     * 3 bytes for it plus 3 for what was held, 6 in all, more than 2. The
     * stream is left untouched by the refusal. */
    int32_t lead = tok_find(fx->t, "\xC3\xA2", 2);
    assert_int_equal(detok_push(d, lead, buf, 2, &k, &err), AE_ERR);
    assert_non_null(strstr(err.msg, "buffer"));
    assert_false(detok_pending(d));
    assert_int_equal(detok_push(d, lead, buf, sizeof buf, &k, &err), AE_ERR);
    err_clear(&err);
    detok_reset(d);
    detok_free(d);
    detok_free(NULL);
}

int main(void) {
    const struct CMUnitTest bytes[] = {
        cmocka_unit_test(test_utf8_ascii_passes_through),
        cmocka_unit_test(test_utf8_valid_multibyte_passes_through),
        cmocka_unit_test(test_utf8_lone_continuation_bytes_each_replaced),
        cmocka_unit_test(test_utf8_overlong_forms_replaced_byte_by_byte),
        cmocka_unit_test(test_utf8_surrogates_replaced_byte_by_byte),
        cmocka_unit_test(test_utf8_above_max_code_point_replaced),
        cmocka_unit_test(test_utf8_truncated_character_is_one_replacement),
        cmocka_unit_test(test_utf8_mixed_invalid_matches_python),
        cmocka_unit_test(test_utf8_char_split_at_every_point_is_held_back),
        cmocka_unit_test(test_utf8_any_split_gives_the_same_text),
        cmocka_unit_test(test_utf8_valid_rejects_each_kind_of_error),
        cmocka_unit_test(test_utf8_flush_without_pending_writes_nothing),
    };
    const struct CMUnitTest with_tok[] = {
        cmocka_unit_test(test_tok_emoji_and_cjk_split_across_tokens),
        cmocka_unit_test(test_tok_stream_of_the_whole_text_equals_it),
        cmocka_unit_test(test_tok_invalid_bytes_become_replacement_like_decode),
        cmocka_unit_test(test_tok_special_tokens_skipped_like_decode),
        cmocka_unit_test(test_tok_bad_id_and_small_buffer_are_errors),
    };
    int failed = cmocka_run_group_tests_name("detok_utf8", bytes, NULL, NULL);
    failed += cmocka_run_group_tests_name("detok_tok", with_tok, tok_setup, tok_teardown);
    return failed ? 1 : 0;
}
