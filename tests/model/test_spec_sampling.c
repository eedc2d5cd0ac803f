/* Speculative sampling keeps the target's distribution (a drafted token
 * is accepted when it is the target's keyed draw, target/verify.h), on
 * the tiny fixture (vocabulary 32) with its
 * EAGLE-3 head: the first two generated tokens of 100000 seeded samples
 * with speculation, and as many without, under temperature, top-k and
 * top-p. Three Pearson chi-square tests, each must give p > 0.001:
 *   - speculative counts against the exact joint distribution, computed
 *     from the target's own filtered distributions (sample_dist_dense);
 *   - plain counts against it (the control);
 *   - speculative against plain counts (homogeneity, 2 x K table).
 * Cells whose expected count is under 5 are pooled into one. Each seed
 * gives the same two tokens with speculation as without, bit for bit
 * (the draws are keyed on seed and position, sample.h). A fourth
 * check shows the test can fail: a sampler that always accepts the draft's
 * first child is rejected at p < 1e-6. A fifth runs 50000 seeds under
 * penalties and a bias (target/penalty.h) with a drafter that proposes
 * the whole vocabulary under the root, so every second token is decided
 * at a tree node: each pair is plain penalised decoding's, and the counts
 * fit the exact penalised joint distribution. Release build: 200000 generations
 * under ASan would take minutes. Run from the repo root. */
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
#include "../chisq.h"

#define FIX "tests/golden/eagle/tiny"
#define N_SAMPLES 100000
#define V 32
#define SEQ_LEN 64

static const int32_t prompt[3] = {3, 17, 9};
static const sample_params params = {0.9f, 20, 0.95f, 0};

typedef struct fixture {
    model *m;
    engine *e;
    draft_link link;
    spec *s;
} fixture;

static void fixture_open(fixture *f) {
    ae_error err = {0};
    memset(f, 0, sizeof *f);
    if (model_load(&f->m, FIX "/target", &kn_backend_cpu, &err) != AE_OK) fail_msg("%s", err.msg);
    engine_config ec = {64, 1, SEQ_LEN, SEQ_LEN, 16, 1, 0};
    if (engine_init(&f->e, f->m, &ec, &err) != AE_OK) fail_msg("%s", err.msg);
    drafter_config dc = {1, SEQ_LEN, 16, 1, engine_pool(f->e), 0};
    if (draft_link_open(&f->link, FIX "/head", model_embedding(f->m), EAGLE_WEIGHTS_FILE, &dc, &err) != AE_OK)
        fail_msg("%s", err.msg);
    spec_config sc = spec_config_default((spec_shape){4, 3, 8}, 1, 64);
    if (draft_link_capture(&f->link, sc.capture, &err) != AE_OK ||
        spec_init(&f->s, f->e, &f->link.iface, &sc, &err) != AE_OK)
        fail_msg("%s", err.msg);
}

static void fixture_close(fixture *f) {
    spec_free(f->s);
    draft_link_close(&f->link);
    engine_free(f->e);
    model_free(f->m);
}

/* The exact joint distribution of the first two tokens: P(a) P(b | a);
 * p1[V] = P(a) and p2[V][V] = P(b | a) as the target's filtered
 * distributions. */
static float p1[V], p2[V][V];
static void exact_joint(fixture *f, double *joint) {
    ae_error err = {0};
    sample_state *smp;
    assert_int_equal(sample_init(&smp, V, &err), AE_OK);
    float lg[V];
    int32_t seq;
    assert_int_equal(engine_seq_new(f->e, &seq, &err), AE_OK);
    engine_item it = {seq, ENGINE_APPEND, 3, prompt, NULL, false};
    assert_int_equal(engine_step(f->e, &it, 1, &(engine_outputs){.logits = lg}, &err), AE_OK);
    sample_dist_dense(smp, lg, &params, p1);
    engine_seq_free(f->e, seq);
    for (int32_t a = 0; a < V; a++) {
        for (int32_t b = 0; b < V; b++) joint[a * V + b] = 0;
        if (p1[a] == 0) continue;
        int32_t ids[4] = {prompt[0], prompt[1], prompt[2], a};
        assert_int_equal(engine_seq_new(f->e, &seq, &err), AE_OK);
        engine_item it2 = {seq, ENGINE_APPEND, 4, ids, NULL, false};
        assert_int_equal(engine_step(f->e, &it2, 1, &(engine_outputs){.logits = lg}, &err), AE_OK);
        sample_dist_dense(smp, lg, &params, p2[a]);
        for (int32_t b = 0; b < V; b++) joint[a * V + b] = (double)p1[a] * p2[a][b];
        engine_seq_free(f->e, seq);
    }
    sample_free(smp);
}

static int32_t plain_pair[N_SAMPLES][2]; /* seed i's first two tokens, plain */

static void plain_counts(fixture *f, int64_t *counts) {
    ae_error err = {0};
    sample_state *smp;
    assert_int_equal(sample_init(&smp, V, &err), AE_OK);
    float lg[V];
    for (int i = 0; i < N_SAMPLES; i++) {
        sample_rng rng;
        sample_rng_seed(&rng, (uint64_t)i);
        int32_t seq, t[2];
        assert_int_equal(engine_seq_new(f->e, &seq, &err), AE_OK);
        engine_item it = {seq, ENGINE_APPEND, 3, prompt, NULL, false};
        assert_int_equal(engine_step(f->e, &it, 1, &(engine_outputs){.logits = lg}, &err), AE_OK);
        t[0] = sample_token(smp, lg, &params, &rng, 3);
        engine_item d = {seq, ENGINE_APPEND, 1, &t[0], NULL, false};
        assert_int_equal(engine_step(f->e, &d, 1, &(engine_outputs){.logits = lg}, &err), AE_OK);
        t[1] = sample_token(smp, lg, &params, &rng, 4);
        counts[t[0] * V + t[1]]++;
        plain_pair[i][0] = t[0], plain_pair[i][1] = t[1];
        engine_seq_free(f->e, seq);
    }
    sample_free(smp);
}

/* A drafter that knows the target's distributions and proposes its most
 * likely tokens first: the first children are accepted often and the
 * later siblings matter, which is where a wrong rejection rule shows
 * (renormalising after a rejection, verify.h). Under the prompt's last
 * token: its 3 most likely successors, and 2 under each of the first two;
 * under a first token a: the 3 most likely successors of a. */
typedef struct informed {
    int32_t fed;
} informed;

static void top_of(const float *p, int32_t k, int32_t *out) {
    for (int32_t j = 0; j < k; j++) {
        int32_t best = -1;
        for (int32_t v = 0; v < V; v++) {
            bool taken = false;
            for (int32_t i = 0; i < j; i++) taken |= out[i] == v;
            if (!taken && (best < 0 || p[v] > p[best])) best = v;
        }
        out[j] = best;
    }
}

static int informed_propose(void *ctx, const spec_feed *feeds, int32_t n, const spec_shape *shape, spec_tree *trees,
                            ae_error *err) {
    informed *in = ctx;
    (void)n, (void)shape, (void)err;
    const spec_feed *f = &feeds[0];
    if (f->reset) in->fed = 0;
    in->fed += f->n;
    spec_tree *t = &trees[0];
    t->n = 0;
    if (!f->want_tree) return AE_OK;
    int32_t top[3];
    t->tokens[0] = in->fed == 2 ? prompt[2] : f->tokens[f->n - 1];
    t->parents[0] = -1;
    t->n = 1;
    top_of(in->fed == 2 ? p1 : p2[t->tokens[0]], 3, top);
    for (int32_t j = 0; j < 3; j++, t->n++) t->tokens[t->n] = top[j], t->parents[t->n] = 0;
    if (in->fed == 2)
        for (int32_t c = 1; c <= 2; c++) {
            top_of(p2[t->tokens[c]], 2, top);
            for (int32_t j = 0; j < 2; j++, t->n++) t->tokens[t->n] = top[j], t->parents[t->n] = c;
        }
    return AE_OK;
}

/* Counts the speculative pairs; returns how many seeds gave other tokens
 * than plain decoding. */
static int spec_counts(fixture *f, int64_t *counts) {
    ae_error err = {0};
    int differ = 0;
    for (int i = 0; i < N_SAMPLES; i++) {
        sample_rng rng;
        sample_rng_seed(&rng, (uint64_t)i);
        int32_t seq, t[2], got = 0;
        assert_int_equal(engine_seq_new(f->e, &seq, &err), AE_OK);
        if (spec_seq_start(f->s, seq, prompt, 3, 16, &err) != AE_OK) fail_msg("%s", err.msg);
        while (got < 2) {
            spec_in in = {.seq = seq, .params = &params, .rng = &rng};
            spec_out o;
            if (spec_step(f->s, &in, 1, &o, &err) != AE_OK) fail_msg("%s", err.msg);
            for (int32_t j = 0; j < o.n && got < 2; j++) t[got++] = o.tokens[j];
        }
        counts[t[0] * V + t[1]]++;
        differ += t[0] != plain_pair[i][0] || t[1] != plain_pair[i][1];
        spec_seq_end(f->s, seq);
        engine_seq_free(f->e, seq);
    }
    return differ;
}

static void test_speculative_sampling_keeps_the_target_distribution(void **state) {
    (void)state;
    fixture f;
    fixture_open(&f);
    static double joint[V * V];
    static int64_t plain[V * V], spec_c[V * V];
    exact_joint(&f, joint);
    plain_counts(&f, plain);
    int differ = spec_counts(&f, spec_c);
    printf("seeds whose speculative tokens differ from plain: %d of %d\n", differ, N_SAMPLES);
    assert_int_equal(differ, 0);
    const spec_stats *st = spec_total_stats(f.s);
    printf("speculative: %lld verify steps, %lld drafted, %lld accepted (mean acceptance length %.3f)\n",
           (long long)st->steps, (long long)st->drafted, (long long)st->accepted, spec_stats_accept_len(st));
    assert_true(st->accepted > N_SAMPLES / 10); /* the draft was right often enough to matter */
    chisq_result gs = chisq_fit(spec_c, joint, V * V, N_SAMPLES), gp = chisq_fit(plain, joint, V * V, N_SAMPLES);
    chisq_result h = chisq_homogeneity(spec_c, plain, joint, V * V, N_SAMPLES);
    printf("speculative vs exact: chi2 %.2f, df %d, p %.4f\n", gs.stat, gs.df, gs.p);
    printf("plain vs exact:       chi2 %.2f, df %d, p %.4f\n", gp.stat, gp.df, gp.p);
    printf("speculative vs plain: chi2 %.2f, df %d, p %.4f\n", h.stat, h.df, h.p);
    assert_true(gs.df > 20);
    assert_true(gs.p > 0.001);
    assert_true(gp.p > 0.001);
    assert_true(h.p > 0.001);

    /* Again with the informed drafter. */
    static int64_t informed_c[V * V];
    informed inf = {0};
    spec_drafter d = {&inf, informed_propose, NULL};
    spec_config sc = spec_config_default((spec_shape){4, 3, 8}, 1, 64);
    sc.capture[0] = 1;
    sc.capture[1] = 3;
    sc.capture[2] = 4;
    spec *head_spec = f.s;
    ae_error err = {0};
    assert_int_equal(spec_init(&f.s, f.e, &d, &sc, &err), AE_OK);
    assert_int_equal(spec_counts(&f, informed_c), 0);
    st = spec_total_stats(f.s);
    chisq_result gi = chisq_fit(informed_c, joint, V * V, N_SAMPLES);
    printf("informed drafter: %lld accepted in %lld steps (mean acceptance length %.3f)\n", (long long)st->accepted,
           (long long)st->steps, spec_stats_accept_len(st));
    printf("informed vs exact:    chi2 %.2f, df %d, p %.4f\n", gi.stat, gi.df, gi.p);
    assert_true(st->accepted > N_SAMPLES / 2);
    assert_true(gi.p > 0.001);
    spec_free(f.s);
    f.s = head_spec;
    fixture_close(&f);
}

/* The same machinery rejects a sampler that is wrong: accept the first
 * child of the root whenever the target allows it at all, which
 * over-weights the draft's favourite. */
static void test_a_biased_acceptor_is_detected(void **state) {
    (void)state;
    fixture f;
    fixture_open(&f);
    static double joint[V * V];
    static int64_t biased[V * V];
    exact_joint(&f, joint);
    ae_error err = {0};
    sample_state *smp;
    assert_int_equal(sample_init(&smp, V, &err), AE_OK);
    float lg[V], p[V];
    for (int i = 0; i < N_SAMPLES / 4; i++) {
        sample_rng rng;
        sample_rng_seed(&rng, (uint64_t)i);
        int32_t seq, t[2];
        assert_int_equal(engine_seq_new(f.e, &seq, &err), AE_OK);
        engine_item it = {seq, ENGINE_APPEND, 3, prompt, NULL, false};
        assert_int_equal(engine_step(f.e, &it, 1, &(engine_outputs){.logits = lg}, &err), AE_OK);
        sample_dist_dense(smp, lg, &params, p);
        /* The "draft" proposes the most likely token; it is always kept
         * when it has any probability. */
        t[0] = sample_greedy(lg, V);
        if (!(p[t[0]] > 0)) t[0] = sample_token(smp, lg, &params, &rng, 3);
        if (sample_rng_uniform(&rng, 3, V) < 0.5)
            t[0] = sample_token(smp, lg, &params, &rng, 3); /* a coin off the vocabulary */
        engine_item d = {seq, ENGINE_APPEND, 1, &t[0], NULL, false};
        assert_int_equal(engine_step(f.e, &d, 1, &(engine_outputs){.logits = lg}, &err), AE_OK);
        t[1] = sample_token(smp, lg, &params, &rng, 4);
        biased[t[0] * V + t[1]]++;
        engine_seq_free(f.e, seq);
    }
    chisq_result r = chisq_fit(biased, joint, V * V, N_SAMPLES / 4);
    printf("biased acceptor vs exact: chi2 %.2f, df %d, p %.3g\n", r.stat, r.df, r.p);
    assert_true(r.p < 1e-6);
    sample_free(smp);
    fixture_close(&f);
}

/* ---- with penalties ---- */

/* Penalties that make the second token depend on the first (frequency,
 * presence and repetition over the output), a bias, and min_tokens 1
 * holding token 7 back from the first position only. */
static const penalty_params pen = {.presence = 0.4f,
                                   .frequency = 1.2f,
                                   .repetition = 1.3f,
                                   .min_tokens = 1,
                                   .n_stop = 1,
                                   .stop = {7},
                                   .n_bias = 2,
                                   .bias_id = {2, 30},
                                   .bias = {1.5f, -0.7f}};

/* The drafter proposes every token of the vocabulary under the root, so
 * the first token is always accepted and the second is decided at the
 * child's row: the penalties of a tree node must follow its path. */
static int fan_propose(void *ctx, const spec_feed *feeds, int32_t n, const spec_shape *shape, spec_tree *trees,
                       ae_error *err) {
    (void)ctx, (void)n, (void)shape, (void)err;
    spec_tree *t = &trees[0];
    t->n = 0;
    if (!feeds[0].want_tree) return AE_OK;
    t->tokens[0] = prompt[2];
    t->parents[0] = -1;
    for (int32_t v = 0; v < V; v++) t->tokens[v + 1] = v, t->parents[v + 1] = 0;
    t->n = V + 1;
    return AE_OK;
}

/* 50000 seeds of two tokens under pen, speculating with the fan: each
 * seed's pair is the plain penalised decoding's, and the counts fit the
 * exact penalised joint distribution. */
static void test_penalised_sampling_under_speculation_keeps_the_penalised_distribution(void **state) {
    (void)state;
    enum { N = 50000 };
    fixture f;
    fixture_open(&f);
    ae_error err = {0};
    sample_state *smp;
    assert_int_equal(sample_init(&smp, V, &err), AE_OK);
    static double joint[V * V];
    static float q1[V], q2[V];
    float lg[V], scratch[V];
    int32_t seq;
    penalty *pn;
    /* The exact joint: the rows penalised as after the prompt, and after
     * the prompt and a. */
    assert_int_equal(penalty_init(&pn, &pen, V, prompt, 3, 0, &err), AE_OK);
    assert_int_equal(engine_seq_new(f.e, &seq, &err), AE_OK);
    engine_item it = {seq, ENGINE_APPEND, 3, prompt, NULL, false};
    assert_int_equal(engine_step(f.e, &it, 1, &(engine_outputs){.logits = lg}, &err), AE_OK);
    sample_dist_dense(smp, penalty_apply(pn, lg, scratch), &params, q1);
    engine_seq_free(f.e, seq);
    penalty_free(pn);
    assert_true(q1[7] == 0); /* min_tokens */
    for (int32_t a = 0; a < V; a++) {
        for (int32_t b = 0; b < V; b++) joint[a * V + b] = 0;
        if (q1[a] == 0) continue;
        int32_t ids[4] = {prompt[0], prompt[1], prompt[2], a};
        assert_int_equal(penalty_init(&pn, &pen, V, prompt, 3, 0, &err), AE_OK);
        penalty_push(pn, a);
        assert_int_equal(engine_seq_new(f.e, &seq, &err), AE_OK);
        engine_item it2 = {seq, ENGINE_APPEND, 4, ids, NULL, false};
        assert_int_equal(engine_step(f.e, &it2, 1, &(engine_outputs){.logits = lg}, &err), AE_OK);
        sample_dist_dense(smp, penalty_apply(pn, lg, scratch), &params, q2);
        for (int32_t b = 0; b < V; b++) joint[a * V + b] = (double)q1[a] * q2[b];
        engine_seq_free(f.e, seq);
        penalty_free(pn);
    }
    spec_drafter d = {NULL, fan_propose, NULL};
    spec_config sc = spec_config_default((spec_shape){1, 8, V + 1}, 1, 64);
    sc.capture[0] = 1;
    sc.capture[1] = 3;
    sc.capture[2] = 4;
    spec *sx;
    if (spec_init(&sx, f.e, &d, &sc, &err) != AE_OK) fail_msg("%s", err.msg);
    static int64_t counts[V * V];
    int differ = 0;
    for (int i = 0; i < N; i++) {
        sample_rng rng;
        sample_rng_seed(&rng, (uint64_t)i);
        int32_t t[2], got = 0, want[2];
        /* plain, penalised */
        assert_int_equal(penalty_init(&pn, &pen, V, prompt, 3, 0, &err), AE_OK);
        assert_int_equal(engine_seq_new(f.e, &seq, &err), AE_OK);
        assert_int_equal(engine_step(f.e, &(engine_item){seq, ENGINE_APPEND, 3, prompt, NULL, false}, 1,
                                     &(engine_outputs){.logits = lg}, &err),
                         AE_OK);
        want[0] = sample_token(smp, penalty_apply(pn, lg, scratch), &params, &rng, 3);
        penalty_push(pn, want[0]);
        assert_int_equal(engine_step(f.e, &(engine_item){seq, ENGINE_APPEND, 1, &want[0], NULL, false}, 1,
                                     &(engine_outputs){.logits = lg}, &err),
                         AE_OK);
        want[1] = sample_token(smp, penalty_apply(pn, lg, scratch), &params, &rng, 4);
        engine_seq_free(f.e, seq);
        penalty_free(pn);
        /* speculative */
        assert_int_equal(penalty_init(&pn, &pen, V, prompt, 3, 0, &err), AE_OK);
        assert_int_equal(engine_seq_new(f.e, &seq, &err), AE_OK);
        if (spec_seq_start(sx, seq, prompt, 3, 16, &err) != AE_OK) fail_msg("%s", err.msg);
        while (got < 2) {
            spec_in in = {.seq = seq, .params = &params, .rng = &rng, .pen = pn};
            static spec_out o;
            if (spec_step(sx, &in, 1, &o, &err) != AE_OK) fail_msg("%s", err.msg);
            for (int32_t j = 0; j < o.n && got < 2; j++) t[got++] = o.tokens[j];
        }
        spec_seq_end(sx, seq);
        engine_seq_free(f.e, seq);
        penalty_free(pn);
        counts[t[0] * V + t[1]]++;
        differ += t[0] != want[0] || t[1] != want[1];
    }
    const spec_stats *st = spec_total_stats(sx);
    chisq_result r = chisq_fit(counts, joint, V * V, N);
    printf("penalised: %d of %d seeds differ from plain; %lld of %lld steps accepted the first token; "
           "vs exact: chi2 %.2f, df %d, p %.4f\n",
           differ, N, (long long)st->accepted, (long long)st->steps, r.stat, r.df, r.p);
    assert_int_equal(differ, 0);
    assert_int_equal(st->accepted, (int64_t)N); /* every first token came from the fan */
    assert_true(r.df > 20);
    assert_true(r.p > 0.001);
    spec_free(sx);
    sample_free(smp);
    fixture_close(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_speculative_sampling_keeps_the_target_distribution),
        cmocka_unit_test(test_a_biased_acceptor_is_detected),
        cmocka_unit_test(test_penalised_sampling_under_speculation_keeps_the_penalised_distribution),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
