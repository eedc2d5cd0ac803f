/* Perplexity scoring (target/ppl.h): the window arithmetic, perplexity and
 * KL divergence of known distributions, top-1 agreement, the nearest-rank
 * percentile, and the base file's checks. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "../../target/ppl.h"

static void test_windows_score_their_second_half(void **state) {
    (void)state;
    ppl_windows w;
    ae_error err = {0};
    assert_int_equal(ppl_windows_plan(1000, 128, &w, &err), AE_OK);
    assert_int_equal(w.ctx, 128);
    assert_int_equal(w.n_windows, 7); /* the 104-token tail fills no window */
    assert_int_equal(w.first, 64);
    assert_int_equal(w.scored, 63); /* rows 64..126 predict tokens 65..127 */
    assert_int_equal(ppl_windows_plan(41 * 512 + 511, 512, &w, &err), AE_OK);
    assert_int_equal(w.n_windows, 41);
    assert_int_equal(w.first, 256);
    assert_int_equal(w.scored, 255);
    assert_int_equal(ppl_windows_plan(10, 5, &w, &err), AE_OK); /* odd ctx: rows 2, 3 */
    assert_int_equal(w.n_windows, 2);
    assert_int_equal(w.first, 2);
    assert_int_equal(w.scored, 2);
    assert_int_equal(ppl_windows_plan(4, PPL_MIN_CTX, &w, &err), AE_OK);
    assert_int_equal(w.scored, 1);
}

static void test_windows_reject_a_short_text_and_a_tiny_ctx(void **state) {
    (void)state;
    ppl_windows w;
    ae_error err = {0};
    assert_int_equal(ppl_windows_plan(100, 128, &w, &err), AE_ERR);
    assert_string_equal(err.msg, "the text has 100 tokens, fewer than one window of --ctx 128");
    err = (ae_error){0};
    assert_int_equal(ppl_windows_plan(100, 3, &w, &err), AE_ERR);
    assert_string_equal(err.msg, "--ctx 3 is too small: a window needs at least 4 tokens");
}

/* Logits whose softmax is p (any shift is the same distribution). */
static void logits_of(const double *p, int n, float shift, float *out) {
    for (int i = 0; i < n; i++) out[i] = (float)log(p[i]) + shift;
}

static ppl_scorer *scorer(int32_t vocab, int64_t positions) {
    ppl_scorer *s;
    ae_error err = {0};
    assert_int_equal(ppl_scorer_init(&s, vocab, positions, &err), AE_OK);
    return s;
}

static void test_perplexity_is_exp_of_the_mean_nll(void **state) {
    (void)state;
    const double p[4] = {0.5, 0.25, 0.125, 0.125};
    float logits[4];
    logits_of(p, 4, 7.0f, logits);
    ppl_scorer *s = scorer(4, 2);
    ae_error err = {0};
    assert_int_equal(ppl_score_add(s, logits, 1, NULL, &err), AE_OK); /* -log 0.25 */
    assert_int_equal(ppl_score_add(s, logits, 0, NULL, &err), AE_OK); /* -log 0.5 */
    ppl_result r = ppl_scorer_result(s);
    assert_int_equal(r.tokens, 2);
    assert_false(r.has_ref);
    assert_true(fabs(r.ppl - sqrt(8.0)) < 1e-6);
    /* A third position is more than the scorer was sized for. */
    assert_int_equal(ppl_score_add(s, logits, 0, NULL, &err), AE_ERR);
    assert_string_equal(err.msg, "ppl scorer: more than 2 positions");
    ppl_scorer_free(s);
}

/* Base p = (1/2, 1/4, 1/8, 1/8) listed as top 2 {0, 1} and a rest of 1/4. */
static const int32_t ref_ids[2] = {0, 1};
static float ref_logp[2];

static ppl_ref ref_of(void) {
    ref_logp[0] = (float)log(0.5);
    ref_logp[1] = (float)log(0.25);
    return (ppl_ref){(float)log(0.25), (float)log(0.25), 2, ref_ids, ref_logp};
}

static void test_kl_counts_the_top_k_and_the_rest(void **state) {
    (void)state;
    const double base[4] = {0.5, 0.25, 0.125, 0.125}, uniform[4] = {0.25, 0.25, 0.25, 0.25};
    float same[4], flat[4];
    logits_of(base, 4, -3.0f, same);
    logits_of(uniform, 4, 0.0f, flat);
    ppl_ref ref = ref_of();
    ppl_scorer *s = scorer(4, 1);
    ae_error err = {0};
    assert_int_equal(ppl_score_add(s, same, 1, &ref, &err), AE_OK);
    ppl_result r = ppl_scorer_result(s);
    assert_true(r.has_ref);
    assert_true(fabs(r.kld_mean) < 1e-7);
    assert_true(fabs(r.base_ppl - 4.0) < 1e-5);
    ppl_scorer_free(s);

    /* Uniform q: 1/2 ln(1/2 / 1/4) + 1/4 ln 1 + (rest) 1/4 ln(1/4 / 1/2). */
    s = scorer(4, 1);
    assert_int_equal(ppl_score_add(s, flat, 1, &ref, &err), AE_OK);
    r = ppl_scorer_result(s);
    assert_true(fabs(r.kld_mean - 0.25 * log(2.0)) < 1e-7);
    assert_true(fabs(r.kld_p99 - 0.25 * log(2.0)) < 1e-7);
    ppl_scorer_free(s);
}

/* top-1 compares the first maximum with the base's first id; kld_p99 is
 * the ceil(0.99 n)-th smallest divergence. */
static void test_top1_agreement_and_the_nearest_rank_p99(void **state) {
    (void)state;
    const double base[4] = {0.5, 0.25, 0.125, 0.125}, uniform[4] = {0.25, 0.25, 0.25, 0.25};
    float same[4], flat[4], wrong[4] = {0, 0, 5, 0};
    logits_of(base, 4, 0.0f, same);
    logits_of(uniform, 4, 0.0f, flat); /* a four-way tie: id 0 wins, agrees */
    ppl_ref ref = ref_of();
    ae_error err = {0};
    for (int big = 1; big <= 2; big++) {
        ppl_scorer *s = scorer(4, 100);
        for (int i = 0; i < 100; i++) {
            const float *l = i < big ? flat : i == 50 ? wrong : same;
            assert_int_equal(ppl_score_add(s, l, 0, &ref, &err), AE_OK);
        }
        ppl_result r = ppl_scorer_result(s);
        assert_int_equal(r.tokens, 100);
        assert_true(fabs(r.top1_agree - 0.99) < 1e-12);
        /* "wrong" is the largest divergence; with one "flat" the 99th
         * smallest is the "flat" one, with two it is still "flat". */
        assert_true(fabs(r.kld_p99 - 0.25 * log(2.0)) < 1e-7);
        ppl_scorer_free(s);
    }
    /* All equal but one: the 99th smallest of 100 is an equal one. */
    ppl_scorer *s = scorer(4, 100);
    for (int i = 0; i < 100; i++) assert_int_equal(ppl_score_add(s, i == 7 ? flat : same, 0, &ref, &err), AE_OK);
    ppl_result r = ppl_scorer_result(s);
    assert_true(fabs(r.kld_p99) < 1e-7);
    assert_true(fabs(r.kld_mean - 0.0025 * log(2.0)) < 1e-8);
    assert_true(fabs(r.top1_agree - 1.0) < 1e-12);
    ppl_scorer_free(s);
}

/* ---- the base file ------------------------------------------------------ */

static char base_path[64];

static int make_base_path(void **state) {
    (void)state;
    strcpy(base_path, "/tmp/aerie-ppl-XXXXXX");
    int fd = mkstemp(base_path);
    if (fd < 0) return -1;
    close(fd);
    return 0;
}

static int remove_base_path(void **state) {
    (void)state;
    return unlink(base_path);
}

/* A base of one window of ctx 4 (tokens 7 8 9 10), top 2: one scored
 * position (row 2, predicting token 10). cut: bytes left off the end. */
static void write_base(const char *magic, uint32_t ctx, size_t cut) {
    uint8_t buf[256];
    size_t n = 0;
    memcpy(buf, magic, 8);
    n = 8;
    const uint32_t head[5] = {4, ctx, 1, 2, 0};
    memcpy(buf + n, head, sizeof head);
    n += sizeof head;
    const int32_t toks[4] = {7, 8, 9, 10};
    memcpy(buf + n, toks, sizeof toks);
    n += sizeof toks;
    const float lp[2] = {(float)log(0.25), (float)log(0.25)};
    memcpy(buf + n, lp, sizeof lp);
    n += sizeof lp;
    const int32_t ids[2] = {0, 3};
    memcpy(buf + n, ids, sizeof ids);
    n += sizeof ids;
    const float top[2] = {(float)log(0.5), (float)log(0.25)};
    memcpy(buf + n, top, sizeof top);
    n += sizeof top;
    FILE *f = fopen(base_path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(buf, 1, n - cut, f), n - cut);
    fclose(f);
}

static void test_base_reads_back_and_checks_its_tokens(void **state) {
    (void)state;
    write_base("AEPPLB01", 4, 0);
    ppl_base *b;
    ae_error err = {0};
    assert_int_equal(ppl_base_open(&b, base_path, &err), AE_OK);
    assert_int_equal(ppl_base_positions(b), 1);
    ppl_ref r = ppl_base_ref(b, 0);
    assert_int_equal(r.top_k, 2);
    assert_int_equal(r.ids[0], 0);
    assert_int_equal(r.ids[1], 3);
    assert_true(r.logp[0] == (float)log(0.5));
    assert_true(r.logp_next == (float)log(0.25));
    ppl_windows w;
    assert_int_equal(ppl_windows_plan(4, 4, &w, &err), AE_OK);
    const int32_t same[4] = {7, 8, 9, 10}, other[4] = {7, 8, 11, 10};
    assert_int_equal(ppl_base_check(b, &w, 4, same, &err), AE_OK);
    assert_int_equal(ppl_base_check(b, &w, 4, other, &err), AE_ERR);
    assert_string_equal(err.msg, "the base's tokens differ from the text's at window 0 position 2 (base 9, text "
                                 "11): a different text or tokenizer");
    err = (ae_error){0}; /* err keeps its first message */
    assert_int_equal(ppl_base_check(b, &w, 5, same, &err), AE_ERR);
    assert_string_equal(err.msg, "the base is for a vocabulary of 4 tokens, the model has 5");
    err = (ae_error){0};
    assert_int_equal(ppl_windows_plan(8, 4, &w, &err), AE_OK);
    assert_int_equal(ppl_base_check(b, &w, 4, same, &err), AE_ERR);
    assert_string_equal(err.msg, "the base holds 1 windows, the text makes 2 (a different text?)");
    err = (ae_error){0};
    assert_int_equal(ppl_windows_plan(5, 5, &w, &err), AE_OK);
    assert_int_equal(ppl_base_check(b, &w, 4, same, &err), AE_ERR);
    assert_string_equal(err.msg, "the base was made with --ctx 4, not 5");
    ppl_base_close(b);
}

static void test_base_rejects_a_bad_magic_and_a_wrong_size(void **state) {
    (void)state;
    ppl_base *b;
    ae_error err = {0};
    write_base("AEPPLB99", 4, 0);
    assert_int_equal(ppl_base_open(&b, base_path, &err), AE_ERR);
    assert_null(b);
    assert_non_null(strstr(err.msg, "not a perplexity base"));
    err = (ae_error){0};
    write_base("AEPPLB01", 4, 4);
    assert_int_equal(ppl_base_open(&b, base_path, &err), AE_ERR);
    assert_non_null(strstr(err.msg, ": 64 bytes, but its header (ctx 4, 1 windows, top_k 2) makes it 68"));
    err = (ae_error){0};
    write_base("AEPPLB01", 6, 0); /* ctx 6 promises more tokens and positions */
    assert_int_equal(ppl_base_open(&b, base_path, &err), AE_ERR);
    assert_non_null(strstr(err.msg, "bytes, but its header (ctx 6"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_windows_score_their_second_half),
        cmocka_unit_test(test_windows_reject_a_short_text_and_a_tiny_ctx),
        cmocka_unit_test(test_perplexity_is_exp_of_the_mean_nll),
        cmocka_unit_test(test_kl_counts_the_top_k_and_the_rest),
        cmocka_unit_test(test_top1_agreement_and_the_nearest_rank_p99),
        cmocka_unit_test_setup_teardown(test_base_reads_back_and_checks_its_tokens, make_base_path, remove_base_path),
        cmocka_unit_test_setup_teardown(test_base_rejects_a_bad_magic_and_a_wrong_size, make_base_path,
                                        remove_base_path),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
