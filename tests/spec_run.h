/* Plain and speculative generation for the speculative decoding tests
 * (header-only; cmocka asserts inside). Both take one engine sequence from
 * start to finish and free it. */
#ifndef AERIE_TESTS_SPEC_RUN_H
#define AERIE_TESTS_SPEC_RUN_H

#include <stdint.h>
#include <stdlib.h>

#include "../target/spec.h"

/* Prompt i of a test set: 1 + (i * stride) % max_len ids drawn by
 * xorshift64 over [0, vocab). */
static inline int32_t spec_test_prompt(int i, int32_t vocab, int32_t max_len, int32_t stride, int32_t *ids) {
    uint64_t x = 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1);
    int32_t n = 1 + (i * stride) % max_len;
    for (int32_t t = 0; t < n; t++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ids[t] = (int32_t)(x % (uint64_t)vocab);
    }
    return n;
}

/* Plain greedy decoding: the prompt in chunks, then one token per pass. */
static inline void run_plain_greedy(engine *e, const int32_t *ids, int32_t n, int32_t chunk, int32_t n_gen,
                                    int32_t *out) {
    ae_error err = {0};
    int32_t seq, V = engine_model(e)->cfg.vocab;
    float *lg = malloc(sizeof(float) * (size_t)V);
    assert_non_null(lg);
    assert_int_equal(engine_seq_new(e, &seq, &err), AE_OK);
    for (int32_t at = 0; at < n; at += chunk) {
        engine_item it = {seq, ENGINE_APPEND, n - at < chunk ? n - at : chunk, ids + at, NULL, false};
        assert_int_equal(engine_step(e, &it, 1, &(engine_outputs){.logits = lg}, &err), AE_OK);
    }
    for (int32_t g = 0; g < n_gen; g++) {
        out[g] = sample_greedy(lg, V);
        engine_item it = {seq, ENGINE_APPEND, 1, &out[g], NULL, false};
        assert_int_equal(engine_step(e, &it, 1, &(engine_outputs){.logits = lg}, &err), AE_OK);
    }
    engine_seq_free(e, seq);
    free(lg);
}

/* Plain sampled decoding with sampling parameters sp and a rng seeded
 * with seed: the prompt in chunks, then one token per pass. */
static inline void run_plain_sampled(engine *e, const int32_t *ids, int32_t n, int32_t chunk, const sample_params *sp,
                                     uint64_t seed, int32_t n_gen, int32_t *out) {
    ae_error err = {0};
    int32_t seq, V = engine_model(e)->cfg.vocab;
    float *lg = malloc(sizeof(float) * (size_t)V);
    sample_state *smp;
    assert_non_null(lg);
    assert_int_equal(sample_init(&smp, V, &err), AE_OK);
    sample_rng rng;
    sample_rng_seed(&rng, seed);
    assert_int_equal(engine_seq_new(e, &seq, &err), AE_OK);
    for (int32_t at = 0; at < n; at += chunk) {
        engine_item it = {seq, ENGINE_APPEND, n - at < chunk ? n - at : chunk, ids + at, NULL, false};
        assert_int_equal(engine_step(e, &it, 1, &(engine_outputs){.logits = lg}, &err), AE_OK);
    }
    for (int32_t g = 0; g < n_gen; g++) {
        out[g] = sample_token(smp, lg, sp, &rng, n + g);
        engine_item it = {seq, ENGINE_APPEND, 1, &out[g], NULL, false};
        assert_int_equal(engine_step(e, &it, 1, &(engine_outputs){.logits = lg}, &err), AE_OK);
    }
    engine_seq_free(e, seq);
    sample_free(smp);
    free(lg);
}

/* Speculative decoding of n_gen tokens with sampling parameters sp and a
 * rng seeded with seed (a step may overshoot; the extra tokens are dropped
 * as a caller stopping at max-tokens would). */
static inline void run_spec(spec *s, engine *e, const int32_t *ids, int32_t n, int32_t chunk, const sample_params *sp,
                            uint64_t seed, int32_t n_gen, int32_t *out) {
    ae_error err = {0};
    int32_t seq, got = 0;
    sample_rng rng;
    sample_rng_seed(&rng, seed);
    assert_int_equal(engine_seq_new(e, &seq, &err), AE_OK);
    if (spec_seq_start(s, seq, ids, n, chunk, &err) != AE_OK) fail_msg("%s", err.msg);
    while (got < n_gen) {
        spec_in in = {.seq = seq, .params = sp, .rng = &rng};
        spec_out o;
        if (spec_step(s, &in, 1, &o, &err) != AE_OK) fail_msg("%s", err.msg);
        assert_true(o.n >= 1 && o.n <= o.drafted + 1);
        for (int32_t j = 0; j < o.n && got < n_gen; j++) out[got++] = o.tokens[j];
    }
    spec_seq_end(s, seq);
    engine_seq_free(e, seq);
}

#endif
