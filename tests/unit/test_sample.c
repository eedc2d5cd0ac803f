/* Sampling: greedy, each filter's exact kept set, the order of filters,
 * the keyed random numbers (pinned values, a pure function of seed,
 * choice and position, the same bits at every SIMD level) and the
 * distribution of many draws. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../../kernels/backend.h"
#include "../../target/sample.h"
#include "../chisq.h"

static sample_state *make(int32_t vocab) {
    sample_state *s;
    ae_error err = {0};
    assert_int_equal(sample_init(&s, vocab, &err), AE_OK);
    return s;
}

/* Logits whose softmax is exactly proportional to w (log of weights). */
static void logits_from_weights(const double *w, int n, float *out) {
    for (int i = 0; i < n; i++) out[i] = w[i] > 0 ? (float)log(w[i]) : -INFINITY;
}

static void expect_ids(const int32_t *got, int32_t n, const int32_t *want, int32_t want_n) {
    assert_int_equal(n, want_n);
    for (int32_t i = 0; i < n; i++) assert_int_equal(got[i], want[i]);
}

static void test_greedy_takes_argmax_lowest_id_on_ties(void **state) {
    (void)state;
    const float logits[] = {1.0f, 3.0f, -2.0f, 3.0f, 2.5f};
    assert_int_equal(sample_greedy(logits, 5), 1);
    const float nan_first[] = {NAN, -1.0f, -0.5f};
    assert_int_equal(sample_greedy(nan_first, 3), 2);
    /* kn_argmax's picks (engine_step with ids runs it instead): -inf is a
     * value, NaN never is, and a row of NaN picks 0. */
    const float nan_then_ninf[] = {NAN, -INFINITY, -INFINITY}, all_nan[] = {NAN, NAN}, ninf[] = {-INFINITY, -INFINITY};
    assert_int_equal(sample_greedy(nan_then_ninf, 3), 1);
    assert_int_equal(sample_greedy(all_nan, 2), 0);
    assert_int_equal(sample_greedy(ninf, 2), 0);
    int32_t ids[3];
    const float rows[3][3] = {{NAN, -INFINITY, -INFINITY}, {NAN, NAN, NAN}, {1.0f, 3.0f, 3.0f}};
    kn_backend_cpu.argmax(NULL, &rows[0][0], ids, 3, 3); /* the CPU backend's, which needs no stream */
    for (int r = 0; r < 3; r++) assert_int_equal(ids[r], sample_greedy(rows[r], 3));
}

static void test_temperature_zero_is_greedy(void **state) {
    (void)state;
    sample_state *s = make(4);
    const float logits[] = {0.1f, 0.2f, 5.0f, 5.0f};
    sample_params p = {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f};
    /* Greedy reads no random numbers: no key at all. */
    for (int i = 0; i < 10; i++) assert_int_equal(sample_token(s, logits, &p, NULL, i), 2);
    const int32_t *ids;
    const float *probs;
    assert_int_equal(sample_dist(s, logits, &p, &ids, &probs), 1);
    assert_int_equal(ids[0], 2);
    assert_true(probs[0] == 1.0f);
    sample_free(s);
}

static void test_temperature_scales_the_distribution(void **state) {
    (void)state;
    sample_state *s = make(3);
    const float logits[] = {2.0f, 0.0f, 1.0f};
    sample_params p = {.temperature = 2.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f};
    float dense[3];
    sample_dist_dense(s, logits, &p, dense);
    /* softmax([1, 0, 0.5]) */
    double z = exp(1.0) + 1.0 + exp(0.5);
    assert_float_equal(dense[0], exp(1.0) / z, 1e-7);
    assert_float_equal(dense[1], 1.0 / z, 1e-7);
    assert_float_equal(dense[2], exp(0.5) / z, 1e-7);
    const int32_t *ids;
    const float *probs;
    const int32_t want[] = {0, 1, 2};
    expect_ids(ids, sample_dist(s, logits, &p, &ids, &probs), want, 3);
    sample_free(s);
}

static void test_top_k_keeps_k_best_and_ties_with_the_kth(void **state) {
    (void)state;
    sample_state *s = make(6);
    const float logits[] = {0.5f, 4.0f, 1.0f, 3.0f, 1.0f, -1.0f};
    sample_params p = {.temperature = 1.0f, .top_k = 2, .top_p = 1.0f, .min_p = 0.0f};
    const int32_t *ids;
    const float *probs;
    const int32_t want2[] = {1, 3};
    expect_ids(ids, sample_dist(s, logits, &p, &ids, &probs), want2, 2);
    assert_float_equal(probs[0], 1.0 / (1.0 + exp(-1.0)), 1e-7);
    /* k = 3: the 3rd best score 1.0 is shared by ids 2 and 4; both stay. */
    p.top_k = 3;
    const int32_t want3[] = {1, 2, 3, 4};
    expect_ids(ids, sample_dist(s, logits, &p, &ids, &probs), want3, 4);
    p.top_k = 6; /* k >= vocab: no filter */
    assert_int_equal(sample_dist(s, logits, &p, &ids, &probs), 6);
    sample_free(s);
}

static void test_top_p_keeps_smallest_prefix_reaching_p(void **state) {
    (void)state;
    sample_state *s = make(5);
    const double w[] = {0.1, 0.4, 0.05, 0.25, 0.2};
    float logits[5];
    logits_from_weights(w, 5, logits);
    sample_params p = {.temperature = 1.0f, .top_k = 0, .top_p = 0.6f, .min_p = 0.0f};
    const int32_t *ids;
    const float *probs;
    /* sorted: 0.4 (id 1), 0.25 (id 3), 0.2 (id 4), ...; 0.4 < 0.6, 0.65 >= 0.6 */
    const int32_t want[] = {1, 3};
    expect_ids(ids, sample_dist(s, logits, &p, &ids, &probs), want, 2);
    assert_float_equal(probs[0], 0.4 / 0.65, 1e-6);
    assert_float_equal(probs[1], 0.25 / 0.65, 1e-6);
    p.top_p = 0.9f; /* 0.4 + 0.25 + 0.2 = 0.85 < 0.9: one more */
    const int32_t want9[] = {0, 1, 3, 4};
    expect_ids(ids, sample_dist(s, logits, &p, &ids, &probs), want9, 4);
    p.top_p = 0.3f; /* the top token alone already reaches it */
    const int32_t want3[] = {1};
    expect_ids(ids, sample_dist(s, logits, &p, &ids, &probs), want3, 1);
    sample_free(s);
}

/* A long flat tail: the kept prefix needs tokens far below 1e-3 of the top,
 * so the heavy-token shortcut must fall back to a wider set. */
static void test_top_p_reaches_into_a_long_tail(void **state) {
    (void)state;
    enum { V = 5000 };
    sample_state *s = make(V);
    static float logits[V];
    logits[0] = 0.0f;                              /* weight 1 */
    for (int i = 1; i < V; i++) logits[i] = -8.0f; /* weight e^-8 ~ 3.4e-4 each */
    double tail = exp((double)-8.0f), z = 1.0 + (V - 1) * tail;
    sample_params p = {.temperature = 1.0f, .top_k = 0, .top_p = 0.9f, .min_p = 0.0f};
    const int32_t *ids;
    const float *probs;
    int32_t n = sample_dist(s, logits, &p, &ids, &probs);
    /* keep while mass before < 0.9 z: 1 + (n - 2) * tail < 0.9 z <= 1 + (n - 1) * tail */
    int32_t want = 2 + (int32_t)floor((0.9 * z - 1.0) / tail);
    assert_int_equal(n, want);
    assert_int_equal(ids[0], 0);
    for (int32_t i = 1; i < n; i++) assert_int_equal(ids[i], i); /* equal q: lower id first */
    sample_free(s);
}

static void test_min_p_keeps_tokens_above_fraction_of_top(void **state) {
    (void)state;
    sample_state *s = make(5);
    const double w[] = {0.1, 0.4, 0.05, 0.25, 0.2};
    float logits[5];
    logits_from_weights(w, 5, logits);
    sample_params p = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.3f};
    const int32_t *ids;
    const float *probs;
    /* threshold 0.3 x 0.4 = 0.12: ids 1 (0.4), 3 (0.25), 4 (0.2) */
    const int32_t want[] = {1, 3, 4};
    expect_ids(ids, sample_dist(s, logits, &p, &ids, &probs), want, 3);
    assert_float_equal(probs[0], 0.4 / 0.85, 1e-6);
    sample_free(s);
}

/* temperature, then top-k, then top-p (on the mass renormalised after
 * top-k), then min-p: each case below has a different kept set under any
 * other order. */
static void test_filters_apply_in_transformers_order(void **state) {
    (void)state;
    sample_state *s = make(6);
    const int32_t *ids;
    const float *probs;
    const double w[] = {0.30, 0.25, 0.20, 0.15, 0.06, 0.04};
    float logits[6];
    logits_from_weights(w, 6, logits);

    /* top-k 4 leaves mass 0.9, renormalised 0.333 0.278 0.222 0.167; top-p
     * 0.6 keeps 2 (0.333 < 0.6 <= 0.611). Top-p first on the raw mass would
     * keep 3 (0.30 + 0.25 = 0.55 < 0.6). */
    sample_params p = {.temperature = 1.0f, .top_k = 4, .top_p = 0.6f, .min_p = 0.0f};
    const int32_t want_kp[] = {0, 1};
    expect_ids(ids, sample_dist(s, logits, &p, &ids, &probs), want_kp, 2);

    /* Temperature first: at T = 4, (w_i / 0.30)^(1/4) >= 0.6 holds for all
     * six (w_i >= 0.0389); min-p 0.6 on the raw weights would keep 3. */
    p = (sample_params){.temperature = 4.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.6f};
    const int32_t want_t[] = {0, 1, 2, 3, 4, 5};
    expect_ids(ids, sample_dist(s, logits, &p, &ids, &probs), want_t, 6);

    /* top-p before min-p: w = 0.4 0.3 0.2 0.1, top-p 0.5 keeps 0.4 and 0.3,
     * min-p 0.6 (>= 0.24) keeps both. Min-p first would leave mass 0.7 and
     * top-p 0.5 of that (0.35) would keep 0.4 alone. */
    const double w4[] = {0.4, 0.3, 0.2, 0.1, 0.0, 0.0};
    logits_from_weights(w4, 6, logits);
    p = (sample_params){.temperature = 1.0f, .top_k = 0, .top_p = 0.5f, .min_p = 0.6f};
    expect_ids(ids, sample_dist(s, logits, &p, &ids, &probs), want_kp, 2);
    sample_free(s);
}

static void test_same_seed_same_tokens(void **state) {
    (void)state;
    enum { V = 50, N = 200 };
    sample_state *s = make(V);
    float logits[V];
    for (int i = 0; i < V; i++) logits[i] = (float)((i * 37) % 11) * 0.3f;
    sample_params p = {.temperature = 0.8f, .top_k = 20, .top_p = 0.95f, .min_p = 0.01f};
    sample_rng a, b, c;
    sample_rng_seed(&a, 1234);
    sample_rng_seed(&b, 1234);
    sample_rng_seed(&c, 1235);
    int32_t ta[N], tb[N], tc[N];
    for (int i = 0; i < N; i++) {
        ta[i] = sample_token(s, logits, &p, &a, i);
        tb[i] = sample_token(s, logits, &p, &b, i);
        tc[i] = sample_token(s, logits, &p, &c, i);
    }
    assert_memory_equal(ta, tb, sizeof ta);
    assert_memory_not_equal(ta, tc, sizeof ta);
    sample_free(s);
}

static void test_keyed_numbers_known_values(void **state) {
    (void)state;
    /* (seed, choice, pos, id) -> 32 hash bits, computed by an independent
     * Python model of sample.c's hash, so that a seed means the same
     * numbers in every release: U = 1 - (bits / 2 + 1/2) / 2^31. */
    const struct {
        uint64_t seed;
        uint32_t choice;
        int32_t pos, id;
        uint32_t bits;
    } known[] = {
        {0, 0, 0, 0, 0xbc1edd3eu}, {0, 0, 0, 1, 0xc571c214u}, {0, 0, 1, 0, 0x5192023cu},
        {7, 0, 5, 3, 0xa9dd3997u}, {7, 1, 5, 3, 0x319a33eeu}, {UINT64_MAX, 0, 100000, 49151, 0x5e788588u},
    };
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) {
        sample_rng r;
        sample_rng_seed(&r, known[i].seed);
        r.choice = known[i].choice;
        double want = 1.0 - ((double)(known[i].bits >> 1) + 0.5) * 0x1p-31;
        assert_true(sample_rng_uniform(&r, known[i].pos, known[i].id) == want);
    }
    sample_rng r;
    sample_rng_seed(&r, 0);
    assert_float_equal(sample_rng_uniform(&r, 0, 0), 0.2651540490332991, 1e-16);
}

/* E = -ln U as the draws compute it, against libm in double, over a
 * million numbers: within 3e-7 relative where E <= 1 (the races are
 * decided there); below U = 1/e, within 3 x 2^-25 / U, which is what
 * rounding U to f32 allows (sample.c). */
static void test_exponentials_are_minus_log_of_the_uniforms(void **state) {
    (void)state;
    sample_rng r;
    sample_rng_seed(&r, 3);
    double worst = 0, worst_tail = 0, least = 1e9, most = 0;
    for (int32_t pos = 0; pos < 1000; pos++)
        for (int32_t id = 0; id < 1000; id++) {
            double u = sample_rng_uniform(&r, pos, id), want = -log(u);
            float e = sample_rng_exp(&r, pos, id);
            double rel = fabs((double)e - want) / want, tail = fabs((double)e - want) * u / 0x1p-25;
            if (want <= 1 && rel > worst) worst = rel;
            if (want > 1 && tail > worst_tail) worst_tail = tail;
            if (e < least) least = e;
            if (e > most) most = e;
        }
    print_message("worst relative error %.3g (E <= 1), worst error %.3g x 2^-25 / U (E > 1), E from %.3g to %.3g\n",
                  worst, worst_tail, least, most);
    assert_true(worst < 3e-7);
    assert_true(worst_tail < 3);
    assert_true(least > 0 && least < 1e-5); /* near U = 1 the numbers stay fine-grained */
    assert_true(most > 10 && most < 17.33); /* U is kept >= 2^-25 */
}

/* The draw at (seed, choice, pos) does not depend on what was drawn
 * before: positions visited in another order, with draws of other keys
 * and other distributions in between, give the same tokens. Another
 * choice or seed gives others. */
static void test_a_draw_is_a_pure_function_of_seed_choice_and_position(void **state) {
    (void)state;
    enum { V = 64, N = 300 };
    sample_state *s = make(V);
    float logits[V], other[V];
    for (int i = 0; i < V; i++) logits[i] = (float)((i * 29) % 13) * 0.25f, other[i] = (float)(i % 5);
    sample_params p = {.temperature = 1.0f, .top_k = 0, .top_p = 0.98f, .min_p = 0.0f};
    sample_params q = {.temperature = 0.6f, .top_k = 7, .top_p = 1.0f, .min_p = 0.0f};
    sample_rng key, noise, choice1, seed2;
    sample_rng_seed(&key, 2024);
    sample_rng_seed(&noise, 9);
    sample_rng_seed(&choice1, 2024);
    choice1.choice = 1;
    sample_rng_seed(&seed2, 2025);
    int32_t forward[N], backward[N], c1[N], s2[N];
    for (int32_t pos = 0; pos < N; pos++) forward[pos] = sample_token(s, logits, &p, &key, pos);
    for (int32_t pos = N - 1; pos >= 0; pos--) {
        sample_token(s, other, &q, &noise, pos);
        sample_token(s, logits, &p, &key, pos + 7);
        backward[pos] = sample_token(s, logits, &p, &key, pos);
        c1[pos] = sample_token(s, logits, &p, &choice1, pos);
        s2[pos] = sample_token(s, logits, &p, &seed2, pos);
    }
    assert_memory_equal(forward, backward, sizeof forward);
    assert_memory_not_equal(forward, c1, sizeof forward);
    assert_memory_not_equal(forward, s2, sizeof forward);
    int same = 0;
    for (int i = 0; i < N; i++) same += forward[i] == c1[i];
    assert_true(same < N / 4); /* independent draws, not a shifted copy */
    sample_free(s);
}

/* The race runs in SIMD where the CPU has it: the same tokens at every
 * level, over a vocabulary the size of SmolLM2's with no filter. */
static void test_draws_are_the_same_bits_at_every_simd_level(void **state) {
    (void)state;
    enum { V = 49152, N = 40 };
    sample_state *s = make(V);
    float *logits = malloc(sizeof(float) * V);
    assert_non_null(logits);
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < V; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        logits[i] = (float)(x >> 40) * 0x1p-24f * 12.0f - 6.0f;
    }
    sample_params p = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f};
    sample_rng key;
    sample_rng_seed(&key, 5);
    int32_t got[3][N];
    for (int level = 0; level < 3; level++) {
        kn_cpu_limit_simd(level);
        for (int32_t pos = 0; pos < N; pos++) got[level][pos] = sample_token(s, logits, &p, &key, pos);
    }
    kn_cpu_limit_simd(2);
    print_message("SIMD here: %s\n", kn_cpu_simd());
    assert_memory_equal(got[0], got[1], sizeof got[0]);
    assert_memory_equal(got[0], got[2], sizeof got[0]);
    free(logits);
    sample_free(s);
}

/* 80000 draws from {0.5, 0.25, 0.125, 0.0625, 0.0625} with a fixed seed:
 * Pearson's chi-square (4 degrees of freedom) stays below 18.47, the 0.001
 * critical value. The seed is fixed, so the test is deterministic. */
static void test_draws_follow_the_distribution(void **state) {
    (void)state;
    enum { V = 5, N = 80000 };
    sample_state *s = make(V);
    const double w[V] = {0.5, 0.25, 0.125, 0.0625, 0.0625};
    float logits[V];
    logits_from_weights(w, V, logits);
    sample_params p = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f};
    sample_rng rng;
    sample_rng_seed(&rng, 42);
    int count[V] = {0};
    for (int i = 0; i < N; i++) count[sample_token(s, logits, &p, &rng, i)]++;
    double chi2 = 0;
    for (int i = 0; i < V; i++) {
        double e = N * w[i];
        chi2 += (count[i] - e) * (count[i] - e) / e;
    }
    assert_true(chi2 < 18.47);
    assert_true(chi2 > 0.0); /* exact expected counts would mean a broken generator */
    /* Filtered draws stay inside the kept set and follow its renormalised mass. */
    p.top_k = 2; /* {0.5, 0.25} -> {2/3, 1/3} */
    int kept[V] = {0};
    for (int i = 0; i < N; i++) kept[sample_token(s, logits, &p, &rng, N + i)]++;
    assert_int_equal(kept[2] + kept[3] + kept[4], 0);
    double e0 = N * 2.0 / 3.0, e1 = N / 3.0;
    double chi2k = (kept[0] - e0) * (kept[0] - e0) / e0 + (kept[1] - e1) * (kept[1] - e1) / e1;
    assert_true(chi2k < 10.83); /* 1 degree of freedom, 0.001 */
    sample_free(s);
}

/* Many tokens of near-equal weight, where the race is decided by the
 * smallest exponentials: 100000 draws over 512 tokens (weights 1 to 2)
 * fit the distribution (Pearson, 511 degrees of freedom, p > 0.001). */
static void test_draws_over_many_tokens_follow_the_distribution(void **state) {
    (void)state;
    enum { V = 512, N = 100000 };
    sample_state *s = make(V);
    double w[V], z = 0;
    float logits[V];
    for (int i = 0; i < V; i++) z += w[i] = 1.0 + (double)((i * 97) % V) / V;
    logits_from_weights(w, V, logits);
    sample_params p = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f};
    sample_rng rng;
    sample_rng_seed(&rng, 77);
    static long count[V];
    for (int i = 0; i < N; i++) count[sample_token(s, logits, &p, &rng, i)]++;
    double chi2 = 0;
    for (int i = 0; i < V; i++) {
        double e = N * w[i] / z;
        chi2 += (count[i] - e) * (count[i] - e) / e;
    }
    double pv = chisq_gamma_q(511 / 2.0, chi2 / 2);
    print_message("512 tokens: chi2 = %.1f, df = 511, p = %.3f\n", chi2, pv);
    assert_true(pv > 0.001);
    assert_true(pv < 0.999); /* nor too good a fit */
    sample_free(s);
}

static void test_masked_logits_are_never_drawn(void **state) {
    (void)state;
    sample_state *s = make(4);
    const float logits[] = {-INFINITY, 1.0f, NAN, 1.0f};
    sample_params p = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f};
    const int32_t *ids;
    const float *probs;
    const int32_t want[] = {1, 3};
    expect_ids(ids, sample_dist(s, logits, &p, &ids, &probs), want, 2);
    assert_true(probs[0] == 0.5f && probs[1] == 0.5f);
    sample_free(s);
}

/* The log-softmax of the raw row, against long double, and the top
 * tokens best first with the lower id first among equals. */
static void test_logprobs_are_the_raw_log_softmax_and_its_top(void **state) {
    (void)state;
    const float lg[6] = {1.0f, 3.0f, -2.5f, 3.0f, 0.25f, -INFINITY};
    long double sum = 0.0L;
    for (int i = 0; i < 5; i++) sum += expl((long double)lg[i]);
    sample_logprob top[5];
    for (int32_t t = 0; t < 6; t++) {
        float want = t == 5 ? -INFINITY : (float)((long double)lg[t] - logl(sum));
        float got = sample_logprobs(lg, 6, t, t == 0 ? 5 : 0, top);
        if (t == 5)
            assert_true(isinf(got) && got < 0);
        else
            assert_float_equal(got, want, 1e-6);
    }
    const int32_t ids[5] = {1, 3, 0, 4, 2};
    for (int j = 0; j < 5; j++) {
        assert_int_equal(top[j].id, ids[j]);
        assert_float_equal(top[j].logprob, (float)((long double)lg[ids[j]] - logl(sum)), 1e-6);
    }
    /* A shorter list is the front of the longer one. */
    sample_logprob two[2];
    (void)sample_logprobs(lg, 6, 2, 2, two);
    assert_int_equal(two[0].id, 1);
    assert_int_equal(two[1].id, 3);
    assert_true(two[0].logprob == top[0].logprob && two[1].logprob == top[1].logprob);
}

/* A uniform row: every token ln(1/4); NaN counts as -inf and is never a top. */
static void test_logprobs_of_a_uniform_row_and_nan(void **state) {
    (void)state;
    const float u[4] = {0.5f, 0.5f, 0.5f, 0.5f};
    sample_logprob top[4];
    assert_float_equal(sample_logprobs(u, 4, 2, 4, top), (float)-log(4.0), 1e-7);
    for (int j = 0; j < 4; j++) assert_int_equal(top[j].id, j);
    const float withnan[3] = {NAN, 0.0f, 0.0f};
    sample_logprob t2[3];
    assert_true(isinf(sample_logprobs(withnan, 3, 0, 3, t2)));
    assert_int_equal(t2[0].id, 1);
    assert_int_equal(t2[1].id, 2);
    assert_float_equal(t2[0].logprob, (float)-log(2.0), 1e-7);
}

static void test_init_rejects_empty_vocab(void **state) {
    (void)state;
    sample_state *s = (sample_state *)1;
    ae_error err = {0};
    assert_int_equal(sample_init(&s, 0, &err), AE_ERR);
    assert_null(s);
    assert_string_equal(err.msg, "sampler: vocabulary size 0 must be positive");
    sample_free(NULL);
}

static void test_tiny_temperature_is_near_greedy_not_overflow(void **state) {
    (void)state;
    /* logit / 1e-38 overflows to +inf for the best token; the scores are
     * taken relative to the maximum so it stays the most likely. */
    sample_state *sm;
    ae_error err = {0};
    assert_int_equal(sample_init(&sm, 3, &err), AE_OK);
    const float logits[3] = {10.0f, 0.5f, -3.0f};
    sample_params p = {.temperature = 1e-38f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f};
    const int32_t *ids;
    const float *probs;
    assert_int_equal(sample_dist(sm, logits, &p, &ids, &probs), 1);
    assert_int_equal(ids[0], 0);
    assert_true(probs[0] == 1.0f);
    /* min_p above 1 still keeps the top token. */
    sample_params q = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 2.0f};
    assert_int_equal(sample_dist(sm, logits, &q, &ids, &probs), 1);
    assert_int_equal(ids[0], 0);
    sample_free(sm);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_takes_argmax_lowest_id_on_ties),
        cmocka_unit_test(test_temperature_zero_is_greedy),
        cmocka_unit_test(test_temperature_scales_the_distribution),
        cmocka_unit_test(test_top_k_keeps_k_best_and_ties_with_the_kth),
        cmocka_unit_test(test_top_p_keeps_smallest_prefix_reaching_p),
        cmocka_unit_test(test_top_p_reaches_into_a_long_tail),
        cmocka_unit_test(test_min_p_keeps_tokens_above_fraction_of_top),
        cmocka_unit_test(test_filters_apply_in_transformers_order),
        cmocka_unit_test(test_same_seed_same_tokens),
        cmocka_unit_test(test_keyed_numbers_known_values),
        cmocka_unit_test(test_exponentials_are_minus_log_of_the_uniforms),
        cmocka_unit_test(test_a_draw_is_a_pure_function_of_seed_choice_and_position),
        cmocka_unit_test(test_draws_are_the_same_bits_at_every_simd_level),
        cmocka_unit_test(test_draws_follow_the_distribution),
        cmocka_unit_test(test_draws_over_many_tokens_follow_the_distribution),
        cmocka_unit_test(test_masked_logits_are_never_drawn),
        cmocka_unit_test(test_logprobs_are_the_raw_log_softmax_and_its_top),
        cmocka_unit_test(test_logprobs_of_a_uniform_row_and_nan),
        cmocka_unit_test(test_init_rejects_empty_vocab),
        cmocka_unit_test(test_tiny_temperature_is_near_greedy_not_overflow),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
