/* Tree verification: the exact greedy path and bonus on hand-built trees,
 * that sampling accepts a child exactly when it is the target's keyed
 * draw at its position, reproducibility, and that sampled output
 * follows the target's filtered distribution (Pearson chi-square, with a
 * biased acceptor as a negative control that the same check rejects). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../../target/verify.h"
#include "../chisq.h"

enum { GV = 8 }; /* vocabulary of the greedy trees */

/* Row `node` of logits [n][GV] with its argmax at `tok` and no ties. */
static void set_argmax(float *logits, int32_t node, int32_t tok) {
    float *row = logits + (size_t)node * GV;
    for (int32_t v = 0; v < GV; v++) row[v] = -0.1f * (float)v;
    row[tok] = 3.0f;
}

static void expect_path(const int32_t *got, int32_t n, const int32_t *want, int32_t want_n) {
    assert_int_equal(n, want_n);
    for (int32_t i = 0; i < n; i++) assert_int_equal(got[i], want[i]);
}

/*      0 (7)
 *     /  |  \
 *  1(1) 2(2) 3(3)
 *   |
 *  4(4)           the root's argmax is 5: no child has it. */
static void test_greedy_stops_at_root_when_no_child_matches(void **state) {
    (void)state;
    const int32_t tokens[] = {7, 1, 2, 3, 4}, parents[] = {-1, 0, 0, 0, 1};
    float logits[5 * GV];
    const int32_t argmax[] = {5, 4, 6, 0, 1};
    for (int32_t i = 0; i < 5; i++) set_argmax(logits, i, argmax[i]);
    verify_tree t = {5, tokens, parents, logits, GV, NULL, NULL};
    int32_t path[5], bonus = -1;
    const int32_t want[] = {0};
    expect_path(path, verify_greedy(&t, path, &bonus), want, 1);
    assert_int_equal(bonus, 5);
}

/* Same shape: the root's argmax 2 is node 2; node 2's argmax 6 has no
 * child (node 4 hangs under node 1 and is not looked at). */
static void test_greedy_accepts_one_level(void **state) {
    (void)state;
    const int32_t tokens[] = {7, 1, 2, 3, 6}, parents[] = {-1, 0, 0, 0, 1};
    float logits[5 * GV];
    const int32_t argmax[] = {2, 4, 6, 0, 1};
    for (int32_t i = 0; i < 5; i++) set_argmax(logits, i, argmax[i]);
    verify_tree t = {5, tokens, parents, logits, GV, NULL, NULL};
    int32_t path[5], bonus = -1;
    const int32_t want[] = {0, 2};
    expect_path(path, verify_greedy(&t, path, &bonus), want, 2);
    assert_int_equal(bonus, 6);
}

/* The same tree decided by row argmaxes alone (engine_step with ids): with no
 * logits at all, the path of test_greedy_accepts_one_level; with a rule
 * that reads rows (verify_proc), the ids are not used and the rows
 * decide. */
static const float *shift_row(void *ctx, const float *row) {
    float *out = ctx;
    for (int32_t v = 0; v < GV; v++) out[v] = row[(v + 1) % GV]; /* argmax a moves to a - 1 */
    return out;
}
static void push_nothing(void *ctx, int32_t tok) { (void)ctx, (void)tok; }

static void test_greedy_reads_row_argmaxes_when_given(void **state) {
    (void)state;
    const int32_t tokens[] = {7, 1, 2, 3, 6}, parents[] = {-1, 0, 0, 0, 1};
    const int32_t ids[] = {2, 4, 6, 0, 1};
    verify_tree t = {5, tokens, parents, NULL, GV, NULL, ids};
    int32_t path[5], bonus = -1;
    const int32_t want[] = {0, 2};
    expect_path(path, verify_greedy(&t, path, &bonus), want, 2);
    assert_int_equal(bonus, 6);
    /* With a rule: rows decide. Root row's argmax 2 becomes 1 (node 1),
     * node 1's argmax 7 becomes 6 (node 4), node 4's 0 becomes 7. */
    float logits[5 * GV], shifted[GV];
    const int32_t row_max[] = {2, 7, 6, 0, 0};
    for (int32_t i = 0; i < 5; i++) set_argmax(logits, i, row_max[i]);
    verify_proc proc = {shifted, shift_row, push_nothing};
    t.logits = logits;
    t.proc = &proc;
    const int32_t want2[] = {0, 1, 4};
    expect_path(path, verify_greedy(&t, path, &bonus), want2, 3);
    assert_int_equal(bonus, 7);
}

/*          0 (7)
 *       /   |    \
 *    1(1)  2(2)  3(3)
 *     |         /    \
 *    4(6)    5(5)    6(6)
 *                     |
 *                    7(0)
 * argmax: root 3, node 3 -> 6, node 6 -> 0, node 7 -> 2. Node 4 carries
 * token 6 too but is not a child of node 3; node 5 is the first child of
 * node 3 but has the wrong token. */
static void test_greedy_follows_a_deep_path_through_a_later_sibling(void **state) {
    (void)state;
    const int32_t tokens[] = {7, 1, 2, 3, 6, 5, 6, 0}, parents[] = {-1, 0, 0, 0, 1, 3, 3, 6};
    float logits[8 * GV];
    const int32_t argmax[] = {3, 6, 1, 6, 1, 1, 0, 2};
    for (int32_t i = 0; i < 8; i++) set_argmax(logits, i, argmax[i]);
    verify_tree t = {8, tokens, parents, logits, GV, NULL, NULL};
    int32_t path[8], bonus = -1;
    const int32_t want[] = {0, 3, 6, 7};
    expect_path(path, verify_greedy(&t, path, &bonus), want, 4);
    assert_int_equal(bonus, 2);
}

/*       0 (7)
 *      /    \
 *    1(4)   2(4)      two siblings with the argmax token 4: node 1 wins
 *     |      |
 *    3(6)   4(5)
 * node 1's argmax 6 -> node 3 (argmax 2 is the bonus). Through node 2 the
 * answer would be path 0 2 4 and bonus 3. */
static void test_greedy_takes_the_first_of_siblings_sharing_a_token(void **state) {
    (void)state;
    const int32_t tokens[] = {7, 4, 4, 6, 5}, parents[] = {-1, 0, 0, 1, 2};
    float logits[5 * GV];
    const int32_t argmax[] = {4, 6, 5, 2, 3};
    for (int32_t i = 0; i < 5; i++) set_argmax(logits, i, argmax[i]);
    verify_tree t = {5, tokens, parents, logits, GV, NULL, NULL};
    int32_t path[5], bonus = -1;
    const int32_t want[] = {0, 1, 3};
    expect_path(path, verify_greedy(&t, path, &bonus), want, 3);
    assert_int_equal(bonus, 2);
}

/* A chain 0(7) - 1(1) - 2(2) - 3(3) - 4(4), every token the argmax of the
 * node before: all four accepted, the bonus is node 4's argmax 6. */
static void test_greedy_accepts_a_whole_chain(void **state) {
    (void)state;
    const int32_t tokens[] = {7, 1, 2, 3, 4}, parents[] = {-1, 0, 1, 2, 3};
    float logits[5 * GV];
    const int32_t argmax[] = {1, 2, 3, 4, 6};
    for (int32_t i = 0; i < 5; i++) set_argmax(logits, i, argmax[i]);
    verify_tree t = {5, tokens, parents, logits, GV, NULL, NULL};
    int32_t path[5], bonus = -1;
    const int32_t want[] = {0, 1, 2, 3, 4};
    expect_path(path, verify_greedy(&t, path, &bonus), want, 5);
    assert_int_equal(bonus, 6);
}

/* The same chain with node 2's argmax 5 instead of 3: stops at node 2. */
static void test_greedy_stops_a_chain_at_the_first_mismatch(void **state) {
    (void)state;
    const int32_t tokens[] = {7, 1, 2, 3, 4}, parents[] = {-1, 0, 1, 2, 3};
    float logits[5 * GV];
    const int32_t argmax[] = {1, 2, 5, 4, 6};
    for (int32_t i = 0; i < 5; i++) set_argmax(logits, i, argmax[i]);
    verify_tree t = {5, tokens, parents, logits, GV, NULL, NULL};
    int32_t path[5], bonus = -1;
    const int32_t want[] = {0, 1, 2};
    expect_path(path, verify_greedy(&t, path, &bonus), want, 3);
    assert_int_equal(bonus, 5);
}

static sample_state *make(int32_t vocab) {
    sample_state *s;
    ae_error err = {0};
    assert_int_equal(sample_init(&s, vocab, &err), AE_OK);
    return s;
}

/* The deep tree above through verify_sample with temperature 0 (other
 * filters set, still greedy): the greedy path, and no key read. */
static void test_greedy_params_through_verify_sample_draw_nothing(void **state) {
    (void)state;
    const int32_t tokens[] = {7, 1, 2, 3, 6, 5, 6, 0}, parents[] = {-1, 0, 0, 0, 1, 3, 3, 6};
    float logits[8 * GV];
    const int32_t argmax[] = {3, 6, 1, 6, 1, 1, 0, 2};
    for (int32_t i = 0; i < 8; i++) set_argmax(logits, i, argmax[i]);
    verify_tree t = {8, tokens, parents, logits, GV, NULL, NULL};
    sample_state *s = make(GV);
    sample_params p = {.temperature = 0.0f, .top_k = 3, .top_p = 0.5f, .min_p = 0.1f};
    int32_t path[8], bonus = -1;
    const int32_t want[] = {0, 3, 6, 7};
    expect_path(path, verify_sample(&t, s, &p, NULL, 0, path, &bonus), want, 4);
    assert_int_equal(bonus, 2);
    sample_free(s);
}

/* Rows with every token possible (temperature 1, no filter). */
static void set_spread(float *logits, int32_t node) {
    for (int32_t v = 0; v < GV; v++) logits[(size_t)node * GV + v] = 0.3f * (float)((v * 5 + node * 3) % GV);
}

/*       0 (7)
 *     /   |   \
 *  1(x)  2(d0) 3(d0)     d0: the root's draw at pos; x any other token
 *          |
 *        4(y)            y: anything but node 2's draw d1 at pos + 1
 * Node 2 is accepted (the first child carrying the draw, node 3 not),
 * node 4 is not, and the bonus is d1. With d0 on no child, the path is
 * the root alone and the bonus d0. Over 200 positions, so that many
 * different draws are checked. */
static void test_sampling_accepts_a_child_only_when_it_is_the_keyed_draw(void **state) {
    (void)state;
    sample_state *s = make(GV);
    sample_params p = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f};
    float logits[5 * GV];
    for (int32_t i = 0; i < 5; i++) set_spread(logits, i);
    sample_rng rng;
    sample_rng_seed(&rng, 5);
    int distinct[GV] = {0};
    for (int32_t pos = 1; pos <= 200; pos++) {
        int32_t d0 = sample_token(s, logits, &p, &rng, pos), d1 = sample_token(s, logits + 2 * GV, &p, &rng, pos + 1);
        distinct[d0] = 1;
        int32_t tokens[] = {7, (d0 + 1) % GV, d0, d0, (d1 + 3) % GV}, parents[] = {-1, 0, 0, 0, 2};
        verify_tree t = {5, tokens, parents, logits, GV, NULL, NULL};
        int32_t path[5], bonus = -1;
        const int32_t want[] = {0, 2};
        expect_path(path, verify_sample(&t, s, &p, &rng, pos, path, &bonus), want, 2);
        assert_int_equal(bonus, d1);
        tokens[2] = tokens[3] = (d0 + 2) % GV;
        const int32_t root[] = {0};
        expect_path(path, verify_sample(&t, s, &p, &rng, pos, path, &bonus), root, 1);
        assert_int_equal(bonus, d0);
    }
    int n_distinct = 0;
    for (int32_t v = 0; v < GV; v++) n_distinct += distinct[v];
    assert_int_equal(n_distinct, GV);
    sample_free(s);
}

static void test_sampling_a_point_distribution_walks_the_greedy_path(void **state) {
    (void)state;
    const int32_t tokens[] = {7, 1, 2, 3, 6, 5, 6, 0}, parents[] = {-1, 0, 0, 0, 1, 3, 3, 6};
    float logits[8 * GV];
    const int32_t argmax[] = {3, 6, 1, 6, 1, 1, 0, 2};
    for (int32_t i = 0; i < 8; i++) set_argmax(logits, i, argmax[i]);
    verify_tree t = {8, tokens, parents, logits, GV, NULL, NULL};
    sample_state *s = make(GV);
    sample_params p = {.temperature = 0.8f, .top_k = 1, .top_p = 1.0f, .min_p = 0.0f};
    sample_rng rng;
    sample_rng_seed(&rng, 11);
    int32_t path[8], bonus = -1;
    const int32_t want[] = {0, 3, 6, 7};
    for (int i = 0; i < 100; i++) {
        expect_path(path, verify_sample(&t, s, &p, &rng, 8 * i, path, &bonus), want, 4);
        assert_int_equal(bonus, 2);
    }
    sample_free(s);
}

/* ---- the distribution of sampled output ---- */

/* The chi-square p-value of statistic c with df degrees of freedom. */
static double chi2_p(double chi2, int df) { return chisq_gamma_q(0.5 * df, 0.5 * chi2); }

/* Closed forms on both sides of x = a + 1: df 2 gives exp(-c / 2), df 4
 * gives exp(-c / 2) (1 + c / 2), df 1 gives erfc(sqrt(c / 2)); and the
 * table's 0.001 critical value for df 4 is 18.467. */
static void test_chi_square_p_value_matches_closed_forms(void **state) {
    (void)state;
    const double c[] = {0.01, 0.5, 1.9, 2.1, 5.0, 13.815510557964274, 40.0, 200.0};
    for (int i = 0; i < 8; i++) {
        double y = c[i] / 2;
        assert_float_equal(chi2_p(c[i], 2), exp(-y), 1e-12 * exp(-y) + 1e-15);
        assert_float_equal(chi2_p(c[i], 4), exp(-y) * (1 + y), 1e-12 * exp(-y) * (1 + y) + 1e-15);
        assert_float_equal(chi2_p(c[i], 1), erfc(sqrt(y)), 1e-12 * erfc(sqrt(y)) + 1e-15);
    }
    assert_float_equal(chi2_p(18.467, 4), 0.001, 1e-6);
    assert_float_equal(chi2_p(29.588, 10), 0.001, 1e-6);
}

enum { SV = 6, SN = 5 }; /* vocabulary and nodes of the sampled tree */

/*           0 (root)
 *        /    |     \
 *     1 (3)  2 (2)  3 (0)        token 0 likely, token 2 unlikely, token 3
 *                     |          filtered out by top-k 3 (4th at the root)
 *                   4 (1)
 * The low child comes before the high one, so acceptances after
 * rejections are exercised. Root logits are 0.7 ln w for
 * w = .6 .25 .15 .05 .03 .02, so that under top-k 3 and top-p 0.9 the
 * kept set is {0, 1, 2} (0.6 + 0.25 < 0.9). */
static const int32_t s_tokens[SN] = {5, 3, 2, 0, 1};
static const int32_t s_parents[SN] = {-1, 0, 0, 0, 3};
static const float s_logits[SN * SV] = {
    -0.36f, -0.97f, -1.33f, -2.10f, -2.46f, -2.74f, /* root */
    -0.50f, -1.20f, -1.10f, -0.60f, -0.70f, -1.40f, /* node 1 (token 3) */
    -1.90f, -0.40f, -0.60f, -1.30f, -1.50f, -2.00f, /* node 2 (token 2) */
    -1.50f, -0.95f, -1.80f, -1.20f, -1.90f, -0.55f, /* node 3 (token 0) */
    -0.30f, -0.80f, -1.00f, -1.20f, -1.40f, -1.60f, /* node 4 (token 1) */
};

typedef int32_t (*verify_fn)(const verify_tree *t, sample_state *s, const sample_params *p, const sample_rng *rng,
                             int32_t pos, int32_t *path, int32_t *bonus);

typedef struct fit {
    double chi2, p;
    int df;
} fit;

/* Pearson's statistic of count[n] against N * prob[n]; cells with
 * probability 0 must be empty and add no degree of freedom. */
static fit pearson(const long *count, const double *prob, int n, long total) {
    fit f = {0, 0, -1};
    for (int i = 0; i < n; i++) {
        if (prob[i] <= 0.0) {
            assert_int_equal(count[i], 0);
            continue;
        }
        double e = (double)total * prob[i];
        f.chi2 += ((double)count[i] - e) * ((double)count[i] - e) / e;
        f.df++;
    }
    f.p = chi2_p(f.chi2, f.df);
    return f;
}

/* Runs `fn` n times and fits
 *   joint: the first emitted token x, and when x is a child node c of the
 *          root, the second emitted token y too: P_root(x) P_c(y), or
 *          P_root(x) when x is not a child (then nothing else is decided);
 *   cond:  the second token given the first is node 3's token, against
 *          P at node 3.
 * The emitted tokens are the path's tokens after the root, then the bonus. */
static void fit_sampled_output(verify_fn fn, const sample_params *p, long n, uint64_t seed, fit *joint, fit *cond) {
    sample_state *s = make(SV);
    verify_tree t = {SN, s_tokens, s_parents, s_logits, SV, NULL, NULL};
    float dense[SN][SV];
    for (int32_t i = 0; i < SN; i++) sample_dist_dense(s, s_logits + (size_t)i * SV, p, dense[i]);
    int32_t node_of[SV]; /* the root's child with token x, or -1 */
    for (int32_t x = 0; x < SV; x++) node_of[x] = -1;
    for (int32_t i = 1; i < SN; i++)
        if (s_parents[i] == 0) node_of[s_tokens[i]] = i;

    long joint_count[SV * SV] = {0}, cond_count[SV] = {0};
    double joint_prob[SV * SV] = {0}, cond_prob[SV];
    for (int32_t x = 0; x < SV; x++) {
        if (node_of[x] < 0)
            joint_prob[x * SV] = dense[0][x];
        else
            for (int32_t y = 0; y < SV; y++) joint_prob[x * SV + y] = (double)dense[0][x] * dense[node_of[x]][y];
    }
    for (int32_t y = 0; y < SV; y++) cond_prob[y] = dense[3][y];

    sample_rng rng;
    sample_rng_seed(&rng, seed);
    int32_t path[SN], bonus;
    long n_cond = 0;
    for (long r = 0; r < n; r++) {
        int32_t len = fn(&t, s, p, &rng, (int32_t)(4 * r), path, &bonus); /* each run its own positions */
        int32_t x = len >= 2 ? s_tokens[path[1]] : bonus;
        int32_t y = len >= 3 ? s_tokens[path[2]] : bonus;
        if (len >= 2) assert_int_equal(node_of[x], path[1]);
        if (node_of[x] < 0)
            joint_count[x * SV]++;
        else
            joint_count[x * SV + y]++;
        if (len >= 2 && path[1] == 3) {
            cond_count[y]++;
            n_cond++;
        }
    }
    *joint = pearson(joint_count, joint_prob, SV * SV, n);
    *cond = pearson(cond_count, cond_prob, SV, n_cond);
    sample_free(s);
}

static void report(const char *what, fit f) {
    print_message("%s: chi2 = %.3f, df = %d, p = %.4g\n", what, f.chi2, f.df, f.p);
}

static void test_sampled_output_follows_target_at_temperature(void **state) {
    (void)state;
    sample_params p = {.temperature = 0.7f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f};
    fit joint, cond;
    fit_sampled_output(verify_sample, &p, 200000, 1, &joint, &cond);
    report("T 0.7 joint", joint);
    report("T 0.7 second | first = node 3", cond);
    assert_int_equal(joint.df, 3 * SV + 3 - 1); /* 3 children x 6 next tokens, 3 other firsts */
    assert_int_equal(cond.df, SV - 1);
    assert_true(joint.p > 0.001);
    assert_true(cond.p > 0.001);
}

static void test_sampled_output_follows_target_with_top_k_top_p(void **state) {
    (void)state;
    sample_params p = {.temperature = 0.7f, .top_k = 3, .top_p = 0.9f, .min_p = 0.0f};
    fit joint, cond;
    fit_sampled_output(verify_sample, &p, 200000, 2, &joint, &cond);
    report("top-k 3 top-p 0.9 joint", joint);
    report("top-k 3 top-p 0.9 second | first = node 3", cond);
    /* First token in {0, 1, 2}; token 3 (node 1) is filtered out. After
     * token 0 (node 3) and token 2 (node 2) the next token is one of the 3
     * those nodes keep (0.51 + 0.29 and 0.49 + 0.37 are under 0.9); token
     * 1 is not a child: 3 + 3 + 1 cells. */
    assert_int_equal(joint.df, 6);
    assert_true(joint.p > 0.001);
    assert_true(cond.p > 0.001);
}

/* Negative controls: two wrong acceptors, same machinery. */

/* An index drawn from weights w[n] (not all 0) with the uniform u. */
static int32_t from_weights(const float *w, int32_t n, double u) {
    double total = 0, acc = 0;
    int32_t last = 0;
    for (int32_t i = 0; i < n; i++)
        if (w[i] > 0.0f) total += w[i], last = i;
    for (int32_t i = 0; i < n; i++)
        if (w[i] > 0.0f && u * total < (acc += w[i])) return i;
    return last;
}

/* Accepts the first child with P > 0 at every node. */
static int32_t accept_first_child(const verify_tree *t, sample_state *s, const sample_params *p, const sample_rng *rng,
                                  int32_t pos, int32_t *path, int32_t *bonus) {
    float probs[SV];
    int32_t n_path = 0, cur = 0;
    path[n_path++] = 0;
    for (;;) {
        sample_dist_dense(s, t->logits + (size_t)cur * (size_t)t->vocab, p, probs);
        int32_t next = -1;
        for (int32_t i = cur + 1; i < t->n && next < 0; i++)
            if (t->parents[i] == cur && probs[t->tokens[i]] > 0.0f) next = i;
        if (next < 0) {
            *bonus = from_weights(probs, t->vocab, sample_rng_uniform(rng, pos + n_path - 1, 0));
            return n_path;
        }
        path[n_path++] = cur = next;
    }
}

/* Rejection sampling that accepts child x with probability P(x) from the
 * full distribution, not from what is left after the rejections before
 * it: the subtle bug of that rule. */
static int32_t accept_without_renormalising(const verify_tree *t, sample_state *s, const sample_params *p,
                                            const sample_rng *rng, int32_t pos, int32_t *path, int32_t *bonus) {
    float probs[SV];
    int32_t n_path = 0, cur = 0;
    path[n_path++] = 0;
    for (;;) {
        int32_t at = pos + n_path - 1;
        sample_dist_dense(s, t->logits + (size_t)cur * (size_t)t->vocab, p, probs);
        int32_t next = -1;
        for (int32_t i = cur + 1; i < t->n && next < 0; i++) {
            int32_t x = t->tokens[i];
            if (t->parents[i] != cur || !(probs[x] > 0.0f)) continue;
            if (sample_rng_uniform(rng, at, 1 + i) < (double)probs[x])
                next = i;
            else
                probs[x] = 0.0f;
        }
        if (next < 0) {
            *bonus = from_weights(probs, t->vocab, sample_rng_uniform(rng, at, 0));
            return n_path;
        }
        path[n_path++] = cur = next;
    }
}

static void test_chi_square_rejects_an_acceptor_that_takes_the_first_child(void **state) {
    (void)state;
    sample_params p = {.temperature = 0.7f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f};
    fit joint, cond;
    fit_sampled_output(accept_first_child, &p, 200000, 1, &joint, &cond);
    report("first-child acceptor joint", joint);
    assert_true(joint.p < 1e-6);
}

static void test_chi_square_rejects_an_acceptor_that_does_not_renormalise(void **state) {
    (void)state;
    sample_params p = {.temperature = 0.7f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f};
    fit joint, cond;
    fit_sampled_output(accept_without_renormalising, &p, 200000, 1, &joint, &cond);
    report("unrenormalised acceptor joint", joint);
    assert_true(joint.p < 1e-6);
}

/* 500 verifications from one seed, twice: the same paths and bonuses; a
 * different seed gives a different sequence. */
static void test_same_seed_same_paths_and_bonuses(void **state) {
    (void)state;
    enum { R = 500 };
    sample_state *s = make(SV);
    verify_tree t = {SN, s_tokens, s_parents, s_logits, SV, NULL, NULL};
    sample_params p = {.temperature = 0.7f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f};
    static int32_t got[3][R][SN + 2];
    const uint64_t seeds[3] = {77, 77, 78};
    for (int k = 0; k < 3; k++) {
        sample_rng rng;
        sample_rng_seed(&rng, seeds[k]);
        memset(got[k], 0xff, sizeof got[k]);
        for (int r = 0; r < R; r++) {
            int32_t *row = got[k][r];
            row[0] = verify_sample(&t, s, &p, &rng, 4 * r, row + 2, &row[1]);
        }
    }
    assert_memory_equal(got[0], got[1], sizeof got[0]);
    assert_memory_not_equal(got[0], got[2], sizeof got[0]);
    sample_free(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_stops_at_root_when_no_child_matches),
        cmocka_unit_test(test_greedy_accepts_one_level),
        cmocka_unit_test(test_greedy_reads_row_argmaxes_when_given),
        cmocka_unit_test(test_greedy_follows_a_deep_path_through_a_later_sibling),
        cmocka_unit_test(test_greedy_takes_the_first_of_siblings_sharing_a_token),
        cmocka_unit_test(test_greedy_accepts_a_whole_chain),
        cmocka_unit_test(test_greedy_stops_a_chain_at_the_first_mismatch),
        cmocka_unit_test(test_greedy_params_through_verify_sample_draw_nothing),
        cmocka_unit_test(test_sampling_accepts_a_child_only_when_it_is_the_keyed_draw),
        cmocka_unit_test(test_sampling_a_point_distribution_walks_the_greedy_path),
        cmocka_unit_test(test_chi_square_p_value_matches_closed_forms),
        cmocka_unit_test(test_sampled_output_follows_target_at_temperature),
        cmocka_unit_test(test_sampled_output_follows_target_with_top_k_top_p),
        cmocka_unit_test(test_chi_square_rejects_an_acceptor_that_takes_the_first_child),
        cmocka_unit_test(test_chi_square_rejects_an_acceptor_that_does_not_renormalise),
        cmocka_unit_test(test_same_seed_same_paths_and_bonuses),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
