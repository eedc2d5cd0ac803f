/* Structured output's masks (target/grammar.h) on the default model's
 * vocabulary: what a mask allows, and what computing one costs.
 *
 * The cost is a benchmark's figure, printed and not asserted (the machines
 * are shared): a matcher is driven through a target JSON text, taking at
 * each step the longest allowed token that continues it, and every
 * grammar_fill_mask is timed. The target is 50 us per token on
 * this model. Release build; run from the repo root. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "../../target/grammar.h"
#include "../../services/tokenizer/tok_file.h"

#define MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

typedef struct fixture {
    tok_file tf;
    grammar_vocab *gv;
    int32_t V, eos;
    uint32_t *mask;
} fixture;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Resident memory of this process, KiB. */
static long rss_kib(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kib = -1;
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, "VmRSS:", 6) == 0) kib = strtol(line + 6, NULL, 10);
    if (f) fclose(f);
    return kib;
}

static void open_fixture(fixture *f) {
    ae_error err = {0};
    memset(f, 0, sizeof *f);
    if (tok_file_open(&f->tf, MODEL, &err) != AE_OK) fail_msg("%s", err.msg);
    f->V = tok_vocab_size(f->tf.tok);
    f->eos = tok_eos(f->tf.tok);
    long before = rss_kib();
    int64_t t0 = now_ns();
    if (grammar_vocab_init(&f->gv, f->tf.tok, f->V, f->eos, &err) != AE_OK) fail_msg("%s", err.msg);
    printf("the vocabulary's automaton: %.1f ms, %.1f MiB resident\n", (double)(now_ns() - t0) / 1e6,
           (double)(rss_kib() - before) / 1024);
    f->mask = calloc((size_t)(f->V + 31) / 32, sizeof *f->mask);
}

static void close_fixture(fixture *f) {
    free(f->mask);
    grammar_vocab_free(f->gv);
    tok_file_close(&f->tf);
}

static bool allowed(const fixture *f, int32_t id) { return f->mask[id / 32] >> (id % 32) & 1; }

static int32_t id_of(const fixture *f, const char *text) {
    int32_t id = tok_find(f->tf.tok, text, strlen(text));
    if (id < 0) fail_msg("no single token for '%s'", text);
    return id;
}

/* Drives m through text, the longest allowed token at each step; returns
 * the steps, and fills ns[] with each mask's time. */
static int drive(fixture *f, grammar_matcher *m, const char *text, int64_t *ns, int max) {
    size_t at = 0, n = strlen(text);
    int steps = 0;
    while (at < n && steps < max) {
        int64_t t0 = now_ns();
        grammar_fill_mask(m, f->mask);
        ns[steps] = now_ns() - t0;
        int32_t best = -1;
        size_t best_len = 0;
        for (int32_t id = 0; id < f->V; id++) {
            if (!allowed(f, id)) continue;
            size_t len;
            const uint8_t *b = tok_token_bytes(f->tf.tok, id, &len);
            if (len > best_len && len <= n - at && memcmp(b, text + at, len) == 0) best = id, best_len = len;
        }
        if (best < 0) fail_msg("no allowed token continues the text at byte %zu: '%s'", at, text + at);
        assert_true(grammar_accept(m, best));
        at += best_len;
        steps++;
    }
    return steps;
}

static int cmp64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static const char *SCHEMA =
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\",\"minimum\":0,"
    "\"maximum\":150},\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":4},\"address\":{\"type\":"
    "\"object\",\"properties\":{\"city\":{\"type\":\"string\"},\"zip\":{\"type\":\"string\",\"maxLength\":5}},"
    "\"required\":[\"city\",\"zip\"],\"additionalProperties\":false}},\"required\":[\"name\",\"age\",\"tags\","
    "\"address\"],\"additionalProperties\":false}";
static const char *TEXT = "{\"name\": \"Alice Johnson\", \"age\": 42, \"tags\": [\"engineer\", \"runner\", \"coffee "
                          "lover\"], \"address\": {\"city\": \"San Francisco\", \"zip\": \"94110\"}}";

/* What a mask allows at known points of a value. */
static void test_masks_allow_exactly_what_the_schema_allows(void **state) {
    (void)state;
    fixture f;
    open_fixture(&f);
    ae_error err = {0};
    grammar_matcher *m;
    assert_int_equal(grammar_matcher_init(&m, f.gv, SCHEMA, &err), AE_OK);
    grammar_fill_mask(m, f.mask);
    assert_true(allowed(&f, id_of(&f, "{")));
    assert_false(allowed(&f, id_of(&f, "[")));
    assert_false(allowed(&f, f.eos)); /* nothing complete yet */
    int64_t ns[256];
    drive(&f, m, "{\"name\": \"Al\", \"age\": ", ns, 256);
    grammar_fill_mask(m, f.mask);
    assert_true(allowed(&f, id_of(&f, "4")));
    assert_false(allowed(&f, id_of(&f, "\"")));       /* an integer, not a string */
    assert_false(allowed(&f, id_of(&f, "-")));        /* minimum 0 */
    assert_false(grammar_accept(m, id_of(&f, "\""))); /* refused, nothing changed */
    drive(&f, m, "42, \"tags\": [], \"address\": {\"city\": \"X\", \"zip\": \"1\"}}", ns, 256);
    grammar_fill_mask(m, f.mask);
    int n_allowed = 0;
    for (int32_t id = 0; id < f.V; id++) n_allowed += allowed(&f, id);
    assert_int_equal(n_allowed, 1); /* the value is complete: only eos */
    assert_true(allowed(&f, f.eos));
    assert_false(grammar_terminated(m));
    assert_true(grammar_accept(m, f.eos));
    assert_true(grammar_terminated(m));
    grammar_matcher_free(m);
    /* json_object: any object; special tokens never allowed. */
    assert_int_equal(grammar_matcher_init(&m, f.gv, NULL, &err), AE_OK);
    drive(&f, m, "{\"a\": [1, {\"b\": null}], \"c\": \"", ns, 256);
    grammar_fill_mask(m, f.mask);
    assert_true(allowed(&f, id_of(&f, "hello")));
    for (int32_t id = 0; id < f.V; id++)
        if (tok_is_special(f.tf.tok, id)) assert_false(allowed(&f, id));
    grammar_matcher_free(m);
    /* Whitespace between tokens is bounded. */
    assert_int_equal(grammar_matcher_init(&m, f.gv, NULL, &err), AE_OK);
    drive(&f, m, "{  ", ns, 256);
    grammar_fill_mask(m, f.mask);
    assert_false(allowed(&f, id_of(&f, "\xc4\xa0"))); /* " " (the vocabulary's mapped text) */
    assert_true(allowed(&f, id_of(&f, "\"")));
    grammar_matcher_free(m);
    /* A schema the engine cannot read is an error, not a crash. */
    assert_int_equal(grammar_matcher_init(&m, f.gv, "{\"type\": 3", &err), GRAMMAR_REFUSED);
    assert_null(m);
    printf("bad schema: %s\n", err.msg);
    /* One of the engine's refusals carries no words of its own (an
     * infinite bound): the reason is never empty. */
    err_clear(&err);
    assert_int_equal(grammar_matcher_init(&m, f.gv, "{\"type\":\"number\",\"minimum\":1e308,\"maximum\":1e309}", &err),
                     GRAMMAR_REFUSED);
    assert_string_equal(err.msg, "the schema cannot be compiled: the grammar engine refused it without a reason (check "
                                 "the schema's numbers and bounds)");
    close_fixture(&f);
}

/* The benchmark: mask cost per token along a 140-byte value, cold (the
 * first matcher of the schema) and warm. */
static void test_mask_cost_per_token(void **state) {
    (void)state;
    fixture f;
    open_fixture(&f);
    ae_error err = {0};
    for (int run = 0; run < 3; run++) {
        grammar_matcher *m;
        int64_t t0 = now_ns();
        assert_int_equal(grammar_matcher_init(&m, f.gv, SCHEMA, &err), AE_OK);
        int64_t compile = now_ns() - t0, ns[256];
        int steps = drive(&f, m, TEXT, ns, 256);
        grammar_fill_mask(m, f.mask);
        assert_true(allowed(&f, f.eos));
        int64_t sum = 0;
        for (int i = 0; i < steps; i++) sum += ns[i];
        qsort(ns, (size_t)steps, sizeof ns[0], cmp64);
        printf("mask cost, %s: %d tokens, mean %.1f us, p50 %.1f us, p90 %.1f us, max %.1f us; matcher init "
               "(compile or cache) %.2f ms\n",
               run == 0 ? "cold" : "warm", steps, (double)sum / steps / 1e3, (double)ns[steps / 2] / 1e3,
               (double)ns[steps * 9 / 10] / 1e3, (double)ns[steps - 1] / 1e3, (double)compile / 1e6);
        grammar_matcher_free(m);
    }
    close_fixture(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_masks_allow_exactly_what_the_schema_allows),
        cmocka_unit_test(test_mask_cost_per_token),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
