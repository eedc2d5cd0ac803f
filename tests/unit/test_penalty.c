/* Penalties, biases, min_tokens and log-probabilities (target/penalty.h,
 * sample_logprobs), alone and under speculation on the tiny fixture
 * (tests/golden/eagle/tiny/) with its EAGLE-3 head: penalised output and
 * log-probabilities must be plain decoding's, bit for bit, whatever the
 * draft proposed. Run from the repo root. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../../draft/draft_link.h"
#include "../../target/penalty.h"
#include "../../target/spec.h"
#include "../spec_run.h"

#define FIX "tests/golden/eagle/tiny"
#define V 32
#define N_PROMPTS 24
#define MAX_PROMPT 30
#define N_GEN 24
#define SEQ_LEN 96
#define CHUNK 16

static penalty_params none(void) { return (penalty_params){.repetition = 1.0f}; }

/* Each step of the order penalty.h gives, on a row of 8 whose values
 * are exact in f32. */
static void test_each_rule_changes_the_row_as_documented(void **state) {
    (void)state;
    ae_error err = {0};
    const float row[8] = {2.0f, -1.0f, 0.5f, 4.0f, -3.0f, 1.0f, 0.0f, 8.0f};
    float scratch[8], want[8];
    penalty *pn;
    /* Nothing asked: the row itself comes back. */
    penalty_params p = none();
    const int32_t prompt[4] = {0, 1, 3, 3};
    assert_false(penalty_active(&p));
    assert_int_equal(penalty_init(&pn, &p, 8, prompt, 4, 0, &err), AE_OK);
    assert_ptr_equal(penalty_apply(pn, row, scratch), row);
    penalty_push(pn, 7);
    penalty_push(pn, 7);
    /* Frequency and presence 0: the output's tokens keep their values. */
    const float *r = penalty_apply(pn, row, scratch);
    assert_memory_equal(r, row, sizeof row);
    penalty_free(pn);

    /* Repetition 2 over prompt {0, 1, 3} and output {7, 7, 2}; frequency
     * 0.5 and presence 0.25 over the output; bias +1 on 4 and -2 on 0;
     * min_tokens 4 holds back 6 and 5 while fewer than 4 are out. */
    p = (penalty_params){.presence = 0.25f,
                         .frequency = 0.5f,
                         .repetition = 2.0f,
                         .min_tokens = 4,
                         .n_stop = 2,
                         .stop = {6, 5},
                         .n_bias = 2,
                         .bias_id = {4, 0},
                         .bias = {1.0f, -2.0f}};
    assert_true(penalty_active(&p));
    assert_int_equal(penalty_init(&pn, &p, 8, prompt, 4, 0, &err), AE_OK);
    penalty_push(pn, 7);
    penalty_push(pn, 7);
    penalty_push(pn, 2);
    assert_int_equal(penalty_generated(pn), 3);
    r = penalty_apply(pn, row, scratch);
    assert_ptr_equal(r, scratch);
    /* 0: 2 - 2 (bias) = 0, in the prompt: 0 * 2 = 0 (not > 0) */
    want[0] = 0.0f;
    want[1] = -2.0f;                   /* prompt: -1 * 2 */
    want[2] = 0.5f / 2 - 0.5f - 0.25f; /* output once: 0.25 - 0.5 - 0.25 */
    want[3] = 2.0f;                    /* prompt: 4 / 2 */
    want[4] = -2.0f;                   /* bias only: -3 + 1 */
    want[5] = -INFINITY;               /* min_tokens */
    want[6] = -INFINITY;
    want[7] = 8.0f / 2 - 0.5f * 2 - 0.25f; /* output twice */
    assert_memory_equal(r, want, sizeof want);
    /* The fourth token lifts the mask. */
    penalty_push(pn, 1);
    r = penalty_apply(pn, row, scratch);
    assert_true(r[5] == 1.0f && r[6] == 0.0f);
    assert_true(r[1] == -1.0f * 2 - 0.5f - 0.25f);
    penalty_free(pn);

    /* A resent output (the last 2 of the prompt) counts as generated. */
    const int32_t resent[5] = {0, 1, 3, 7, 7};
    assert_int_equal(penalty_init(&pn, &p, 8, resent, 5, 2, &err), AE_OK);
    assert_int_equal(penalty_generated(pn), 2);
    r = penalty_apply(pn, row, scratch);
    assert_true(r[7] == 8.0f / 2 - 0.5f * 2 - 0.25f && r[5] == -INFINITY);
    penalty_free(pn);
}

static void test_bad_parameters_are_refused_with_their_reason(void **state) {
    (void)state;
    struct {
        penalty_params p;
        const char *msg;
    } bad[] = {
        {{.presence = 2.5f, .repetition = 1}, "presence_penalty 2.5 is out of range (-2..2)"},
        {{.frequency = NAN, .repetition = 1}, "frequency_penalty nan is out of range (-2..2)"},
        {{.repetition = 0}, "repetition_penalty 0 must be > 0"},
        {{.repetition = 1, .min_tokens = -1}, "min_tokens -1 must be >= 0"},
        {{.repetition = 1, .n_bias = 1, .bias_id = {8}, .bias = {1}},
         "logit_bias names token 8, not in the vocabulary of 8"},
        {{.repetition = 1, .n_bias = 1, .bias_id = {3}, .bias = {101}}, "logit_bias of token 3 is 101 (-100..100)"},
        {{.repetition = 1, .n_bias = 2, .bias_id = {3, 3}, .bias = {1, 1}}, "logit_bias names token 3 twice"},
        {{.repetition = 1, .n_stop = 1, .stop = {-1}}, "stop id -1 is not in the vocabulary of 8"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ae_error err = {0};
        penalty *pn = NULL;
        const int32_t prompt[1] = {0};
        assert_int_equal(penalty_init(&pn, &bad[i].p, 8, prompt, 1, 0, &err), AE_ERR);
        assert_null(pn);
        assert_string_equal(err.msg, bad[i].msg);
    }
}

/* sample_logprobs against a float64 log-softmax written out here. */
static void test_logprobs_are_the_raw_log_softmax(void **state) {
    (void)state;
    float row[V];
    for (int i = 0; i < V; i++) row[i] = (float)((i * 7) % 11) * 0.37f - 1.5f;
    row[9] = -INFINITY;
    double m = -INFINITY, sum = 0;
    for (int i = 0; i < V; i++) m = row[i] > m ? row[i] : m;
    for (int i = 0; i < V; i++) sum += row[i] > -INFINITY ? exp((double)row[i] - m) : 0;
    double lse = m + log(sum);
    sample_logprob top[5];
    for (int t = 0; t < V; t++) {
        float lp = sample_logprobs(row, V, t, 5, top);
        if (t == 9)
            assert_true(lp == -INFINITY);
        else
            assert_true(lp == (float)((double)row[t] - lse));
    }
    /* (i*7) % 11 == 10 at i = 3, 14, 25: equal logits, lower id first. */
    assert_int_equal(top[0].id, 3);
    assert_int_equal(top[1].id, 14);
    assert_int_equal(top[2].id, 25);
    assert_true(top[0].logprob == top[1].logprob && top[1].logprob == top[2].logprob);
    assert_true(top[3].logprob < top[2].logprob);
}

/* ---- under speculation ---- */

typedef struct fixture {
    model *m;
    engine *e;
    draft_link link;
} fixture;

static void fixture_open(fixture *f) {
    ae_error err = {0};
    memset(f, 0, sizeof *f);
    if (model_load(&f->m, FIX "/target", &kn_backend_cpu, &err) != AE_OK) fail_msg("%s", err.msg);
    engine_config ec = {128, 2, SEQ_LEN, 2 * SEQ_LEN, 16, 1, 0};
    if (engine_init(&f->e, f->m, &ec, &err) != AE_OK) fail_msg("%s", err.msg);
    drafter_config dc = {2, SEQ_LEN, CHUNK, 1, engine_pool(f->e), 0};
    if (draft_link_open(&f->link, FIX "/head", model_embedding(f->m), EAGLE_WEIGHTS_FILE, &dc, &err) != AE_OK)
        fail_msg("%s", err.msg);
}

static void fixture_close(fixture *f) {
    draft_link_close(&f->link);
    engine_free(f->e);
    model_free(f->m);
}

static spec *spec_open(fixture *f, const spec_drafter *d, spec_shape shape) {
    spec_config sc = spec_config_default(shape, 2, 128);
    ae_error err = {0};
    if (draft_link_capture(&f->link, sc.capture, &err) != AE_OK) fail_msg("%s", err.msg);
    spec *s;
    if (spec_init(&s, f->e, d, &sc, &err) != AE_OK) fail_msg("%s", err.msg);
    return s;
}

#define TOP 5

typedef struct run_out {
    int32_t tokens[N_GEN];
    float lp[N_GEN];
    sample_logprob top[N_GEN][TOP];
} run_out;

/* Plain decoding with penalties: one token per pass, the row penalised
 * then decided as sample.h says; log-probabilities from the raw row. */
static void plain_run(fixture *f, const int32_t *ids, int32_t n, const sample_params *sp, uint64_t seed,
                      const penalty_params *pp, run_out *o) {
    ae_error err = {0};
    int32_t seq;
    float lg[V], scratch[V];
    sample_state *smp;
    penalty *pn = NULL;
    sample_rng rng;
    sample_rng_seed(&rng, seed);
    assert_int_equal(sample_init(&smp, V, &err), AE_OK);
    if (penalty_active(pp)) assert_int_equal(penalty_init(&pn, pp, V, ids, n, 0, &err), AE_OK);
    assert_int_equal(engine_seq_new(f->e, &seq, &err), AE_OK);
    for (int32_t at = 0; at < n; at += CHUNK) {
        engine_item it = {seq, ENGINE_APPEND, n - at < CHUNK ? n - at : CHUNK, ids + at, NULL, false};
        assert_int_equal(engine_step(f->e, &it, 1, &(engine_outputs){.logits = lg}, &err), AE_OK);
    }
    for (int32_t g = 0; g < N_GEN; g++) {
        const float *row = pn ? penalty_apply(pn, lg, scratch) : lg;
        int32_t t = sample_token(smp, row, sp, &rng, n + g);
        o->tokens[g] = t;
        o->lp[g] = sample_logprobs(lg, V, t, TOP, o->top[g]);
        if (pn) penalty_push(pn, t);
        engine_item it = {seq, ENGINE_APPEND, 1, &o->tokens[g], NULL, false};
        assert_int_equal(engine_step(f->e, &it, 1, &(engine_outputs){.logits = lg}, &err), AE_OK);
    }
    engine_seq_free(f->e, seq);
    penalty_free(pn);
    sample_free(smp);
}

static void spec_run(spec *s, fixture *f, const int32_t *ids, int32_t n, const sample_params *sp, uint64_t seed,
                     const penalty_params *pp, run_out *o) {
    ae_error err = {0};
    int32_t seq, got = 0;
    penalty *pn = NULL;
    sample_rng rng;
    sample_rng_seed(&rng, seed);
    if (penalty_active(pp)) assert_int_equal(penalty_init(&pn, pp, V, ids, n, 0, &err), AE_OK);
    assert_int_equal(engine_seq_new(f->e, &seq, &err), AE_OK);
    if (spec_seq_start(s, seq, ids, n, CHUNK, &err) != AE_OK) fail_msg("%s", err.msg);
    static spec_out so;
    while (got < N_GEN) {
        spec_in in = {.seq = seq, .params = sp, .rng = &rng, .pen = pn, .logprobs = true, .top_logprobs = TOP};
        if (spec_step(s, &in, 1, &so, &err) != AE_OK) fail_msg("%s", err.msg);
        assert_int_equal(so.n_top, TOP);
        for (int32_t j = 0; j < so.n && got < N_GEN; j++, got++) {
            o->tokens[got] = so.tokens[j];
            o->lp[got] = so.logprob[j];
            memcpy(o->top[got], so.top[j], sizeof o->top[got]);
        }
    }
    spec_seq_end(s, seq);
    engine_seq_free(f->e, seq);
    penalty_free(pn);
}

/* Penalties that change greedy output on most prompts, and sampling on
 * top of them: with the head drafting, every prompt's tokens and
 * log-probabilities are plain decoding's, bit for bit. */
static void test_penalised_output_and_logprobs_under_speculation_are_plain(void **state) {
    (void)state;
    fixture f;
    fixture_open(&f);
    const penalty_params pens[3] = {
        {.presence = 0.6f, .frequency = 0.4f, .repetition = 1.3f},
        {.repetition = 1.0f,
         .n_bias = 3,
         .bias_id = {4, 11, 20},
         .bias = {2.5f, -100.0f, 1.0f},
         .min_tokens = 6,
         .n_stop = 2,
         .stop = {0, 1}},
        {.presence = -0.5f, .frequency = 1.5f, .repetition = 0.8f},
    };
    const sample_params sps[2] = {{0, 0, 1, 0}, {0.8f, 0, 0.95f, 0}};
    spec *s = spec_open(&f, &f.link.iface, (spec_shape){4, 3, 8});
    int changed = 0, total = 0;
    for (int k = 0; k < 3; k++)
        for (int si = 0; si < 2; si++)
            for (int i = 0; i < N_PROMPTS; i++) {
                int32_t ids[MAX_PROMPT];
                int32_t n = spec_test_prompt(i, V, MAX_PROMPT, 7, ids);
                run_out want, got, raw;
                plain_run(&f, ids, n, &sps[si], 100 + (uint64_t)i, &pens[k], &want);
                penalty_params off = none();
                plain_run(&f, ids, n, &sps[si], 100 + (uint64_t)i, &off, &raw);
                changed += memcmp(raw.tokens, want.tokens, sizeof raw.tokens) != 0;
                spec_run(s, &f, ids, n, &sps[si], 100 + (uint64_t)i, &pens[k], &got);
                if (memcmp(&want, &got, sizeof want) != 0)
                    fail_msg("penalties %d, %s, prompt %d: speculative output or logprobs differ from plain", k,
                             si ? "sampled" : "greedy", i);
                for (int g = 0; g < N_GEN && k == 1; g++) {
                    assert_int_not_equal(want.tokens[g], 11); /* biased -100 */
                    if (g < 6) assert_true(want.tokens[g] != 0 && want.tokens[g] != 1);
                }
                total++;
            }
    const spec_stats *st = spec_total_stats(s);
    printf("%d runs identical to plain (tokens and logprobs); the penalties changed the tokens of %d; "
           "%lld drafted, %lld accepted\n",
           total, changed, (long long)st->drafted, (long long)st->accepted);
    assert_true(changed > total / 2);
    assert_true(st->accepted > 100);
    spec_free(s);
    fixture_close(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_each_rule_changes_the_row_as_documented),
        cmocka_unit_test(test_bad_parameters_are_refused_with_their_reason),
        cmocka_unit_test(test_logprobs_are_the_raw_log_softmax),
        cmocka_unit_test(test_penalised_output_and_logprobs_under_speculation_are_plain),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
