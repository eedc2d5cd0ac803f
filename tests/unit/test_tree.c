/* EAGLE-2 draft trees: the exact tree for hand-written head distributions,
 * the frontier kept at each depth, the total order on ties, sanitised
 * probabilities, parameter checks, top-k, and a property test against a
 * brute-force model of the contract in draft/tree.h.
 *
 * Hand-written probabilities are dyadic (0.5, 0.375, ...), so every score
 * below is an exact float product and equal scores really are equal. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../../draft/tree.h"

static void begin(tree_build *b, int32_t steps, int32_t topk, int32_t num_draft_tokens, int32_t root) {
    tree_params p = {.steps = steps, .topk = topk, .num_draft_tokens = num_draft_tokens};
    ae_error err = {0};
    assert_int_equal(tree_params_check(&p, &err), AE_OK);
    tree_begin(b, &p, root);
}

static void expect_frontier(const tree_build *b, const int32_t *want, int32_t n) {
    assert_int_equal(b->n_frontier, n);
    for (int32_t i = 0; i < n; i++) assert_int_equal(b->frontier[i], want[i]);
}

static void expect_tree(const tree_out *t, int32_t n, const int32_t *tokens, const int32_t *parents,
                        const float *probs) {
    assert_int_equal(t->n, n);
    for (int32_t i = 0; i < n; i++) {
        assert_int_equal(t->tokens[i], tokens[i]);
        assert_int_equal(t->parents[i], parents[i]);
        assert_true(t->probs[i] == probs[i]);
    }
}

static void test_begin_has_the_root_alone_as_frontier(void **state) {
    (void)state;
    static tree_build b;
    begin(&b, 2, 3, 5, 42);
    assert_int_equal(b.root_token, 42);
    assert_int_equal(b.depth, 0);
    assert_int_equal(b.n_pool, 0);
    const int32_t f[] = {-1};
    expect_frontier(&b, f, 1);
    assert_false(tree_done(&b));
    /* Finished before any expansion: the root alone. */
    tree_out t;
    tree_finish(&b, &t);
    const int32_t tok[] = {42}, par[] = {-1};
    const float pr[] = {1.0f};
    expect_tree(&t, 1, tok, par, pr);
}

/* topk 1, steps 3: a chain root(10) -> 11 (0.5) -> 12 (0.75) -> 13 (0.5),
 * scores 0.5, 0.375, 0.1875; 4 nodes keep all three candidates. */
static void test_chain_of_topk_one(void **state) {
    (void)state;
    static tree_build b;
    begin(&b, 3, 1, 4, 10);
    const int32_t t1[] = {11}, t2[] = {12}, t3[] = {13};
    const float p1[] = {0.5f}, p2[] = {0.75f}, p3[] = {0.5f};

    tree_expand(&b, 1, t1, p1);
    const int32_t f1[] = {0};
    expect_frontier(&b, f1, 1);
    assert_false(tree_done(&b));
    tree_expand(&b, 1, t2, p2);
    const int32_t f2[] = {1};
    expect_frontier(&b, f2, 1);
    assert_false(tree_done(&b));
    tree_expand(&b, 1, t3, p3);
    const int32_t f3[] = {2};
    expect_frontier(&b, f3, 1);
    assert_true(tree_done(&b));

    assert_int_equal(b.n_pool, 3);
    assert_int_equal(b.depth, 3);
    const int32_t parent[] = {-1, 0, 1}, depth[] = {1, 2, 3};
    const float score[] = {0.5f, 0.375f, 0.1875f};
    for (int32_t i = 0; i < 3; i++) {
        assert_int_equal(b.pool[i].parent, parent[i]);
        assert_int_equal(b.pool[i].depth, depth[i]);
        assert_true(b.pool[i].score == score[i]);
    }

    tree_out t;
    tree_finish(&b, &t);
    const int32_t tok[] = {10, 11, 12, 13}, par[] = {-1, 0, 1, 2};
    const float pr[] = {1.0f, 0.5f, 0.75f, 0.5f};
    expect_tree(&t, 4, tok, par, pr);
}

/* topk 2, steps 3, 7 nodes. Pool (index: token p -> score):
 *
 *   depth 1, under the root:   0: A=20 0.5   -> 0.5
 *                              1: B=21 0.375 -> 0.375      frontier {0, 1}
 *   depth 2, under A:          2: C=30 0.5   -> 0.25
 *                              3: D=31 0.25  -> 0.125
 *            under B:          4: E=32 1.0   -> 0.375
 *                              5: F=33 0.5   -> 0.1875     frontier {4, 2} (E, C)
 *   depth 3, under E:          6: G=40 0.5   -> 0.1875
 *                              7: H=41 0.25  -> 0.09375
 *            under C:          8: I=42 1.0   -> 0.25
 *                              9: J=43 0.5   -> 0.125      frontier {8, 6} (I, G)
 *
 * Best first: A .5, B .375, E .375 (ties B, created later), C .25,
 * I .25 (ties C), F .1875, G .1875 (ties F, created later), D, J, H.
 * The best 6 are A B C E F I: depths 1, 1, 2, 2, 2, 3, under four
 * different parents; G loses to F on the tie, D to both on score. In
 * creation order: A(0) B(1) C(2) E(4) F(5) I(8). */
static void test_wide_tree_keeps_best_across_depths_and_parents(void **state) {
    (void)state;
    static tree_build b;
    begin(&b, 3, 2, 7, 7);
    const int32_t t1[] = {20, 21};
    const float p1[] = {0.5f, 0.375f};
    tree_expand(&b, 2, t1, p1);
    const int32_t f1[] = {0, 1};
    expect_frontier(&b, f1, 2);

    const int32_t t2[] = {30, 31, 32, 33}; /* A's children, then B's */
    const float p2[] = {0.5f, 0.25f, 1.0f, 0.5f};
    tree_expand(&b, 2, t2, p2);
    const int32_t f2[] = {4, 2};
    expect_frontier(&b, f2, 2);

    const int32_t t3[] = {40, 41, 42, 43}; /* E's children, then C's */
    const float p3[] = {0.5f, 0.25f, 1.0f, 0.5f};
    tree_expand(&b, 2, t3, p3);
    const int32_t f3[] = {8, 6};
    expect_frontier(&b, f3, 2);
    assert_true(tree_done(&b));

    const int32_t parent[] = {-1, -1, 0, 0, 1, 1, 4, 4, 2, 2};
    for (int32_t i = 0; i < 10; i++) assert_int_equal(b.pool[i].parent, parent[i]);
    assert_true(b.pool[6].score == 0.1875f && b.pool[5].score == 0.1875f);

    tree_out t;
    tree_finish(&b, &t);
    /*                        root  A   B   C   E   F   I */
    const int32_t tok[] = {7, 20, 21, 30, 32, 33, 42};
    const int32_t par[] = {-1, 0, 0, 1, 2, 2, 3};
    const float pr[] = {1.0f, 0.5f, 0.375f, 0.5f, 1.0f, 0.5f, 1.0f};
    expect_tree(&t, 7, tok, par, pr);
}

/* topk 2, steps 3. Pool:
 *
 *   depth 1:  0: A=1 0.5 -> 0.5,  1: B=2 0.5 -> 0.5         tie: frontier {0, 1}
 *   depth 2:  under A  2: C=3 0.5  -> 0.25,  3: D=4 0.25 -> 0.125
 *             under B  4: E=5 0.5  -> 0.25,  5: F=6 0.5  -> 0.25
 *             C, E, F tie at 0.25: the earliest two, frontier {2, 4}
 *   depth 3:  under C  6: G=7 1.0  -> 0.25,  7: H=8 0.5  -> 0.125
 *             under E  8: I=9 0.25 -> 0.0625, 9: J=10 0.5 -> 0.125
 *             frontier {6, 7}: H and J tie at 0.125, H is earlier
 *
 * Best first: A B (0.5), C E F G (0.25, by index), D H J (0.125), I. */
static void build_ties(tree_build *b, int32_t num_draft_tokens) {
    begin(b, 3, 2, num_draft_tokens, 0);
    const int32_t t1[] = {1, 2};
    const float p1[] = {0.5f, 0.5f};
    tree_expand(b, 2, t1, p1);
    const int32_t t2[] = {3, 4, 5, 6};
    const float p2[] = {0.5f, 0.25f, 0.5f, 0.5f};
    tree_expand(b, 2, t2, p2);
    const int32_t t3[] = {7, 8, 9, 10};
    const float p3[] = {1.0f, 0.5f, 0.25f, 0.5f};
    tree_expand(b, 2, t3, p3);
}

static void test_frontier_ties_go_to_the_earlier_candidate(void **state) {
    (void)state;
    static tree_build b;
    begin(&b, 3, 2, 7, 0);
    const int32_t t1[] = {1, 2};
    const float p1[] = {0.5f, 0.5f};
    tree_expand(&b, 2, t1, p1);
    const int32_t f1[] = {0, 1};
    expect_frontier(&b, f1, 2);
    const int32_t t2[] = {3, 4, 5, 6};
    const float p2[] = {0.5f, 0.25f, 0.5f, 0.5f};
    tree_expand(&b, 2, t2, p2);
    const int32_t f2[] = {2, 4}; /* C, E; F ties them but came last */
    expect_frontier(&b, f2, 2);
    const int32_t t3[] = {7, 8, 9, 10};
    const float p3[] = {1.0f, 0.5f, 0.25f, 0.5f};
    tree_expand(&b, 2, t3, p3);
    const int32_t f3[] = {6, 7}; /* G, then H over J on the tie */
    expect_frontier(&b, f3, 2);
}

/* Keep 6: A B C E F G. G has p = 1.0, so its score equals C's; C is
 * created first, is better, and is kept before it. */
static void test_child_with_p_one_follows_its_kept_parent(void **state) {
    (void)state;
    static tree_build b;
    build_ties(&b, 7);
    tree_out t;
    tree_finish(&b, &t);
    /*                        root A  B  C  E  F  G */
    const int32_t tok[] = {0, 1, 2, 3, 5, 6, 7};
    const int32_t par[] = {-1, 0, 0, 1, 2, 2, 3};
    const float pr[] = {1.0f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 1.0f};
    expect_tree(&t, 7, tok, par, pr);
}

/* Keep 3: A B C. C, E, F and G all score 0.25; C is the earliest. */
static void test_final_ties_go_to_the_earlier_candidate(void **state) {
    (void)state;
    static tree_build b;
    build_ties(&b, 4);
    tree_out t;
    tree_finish(&b, &t);
    const int32_t tok[] = {0, 1, 2, 3}, par[] = {-1, 0, 0, 1};
    const float pr[] = {1.0f, 0.5f, 0.5f, 0.5f};
    expect_tree(&t, 4, tok, par, pr);
}

/* Keep 5: A B C E F; G ties them on score but is the latest of the four,
 * so a p = 1.0 child can be dropped while its parent is kept. */
static void test_child_with_p_one_is_cut_after_equal_earlier_ones(void **state) {
    (void)state;
    static tree_build b;
    build_ties(&b, 6);
    tree_out t;
    tree_finish(&b, &t);
    const int32_t tok[] = {0, 1, 2, 3, 5, 6}, par[] = {-1, 0, 0, 1, 2, 2};
    const float pr[] = {1.0f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
    expect_tree(&t, 6, tok, par, pr);
}

/* topk 2, steps 2: 2 + 4 = 6 candidates; 64 nodes asked, all 6 kept in
 * creation order under the root. */
static void test_more_nodes_than_candidates_keeps_every_candidate(void **state) {
    (void)state;
    static tree_build b;
    begin(&b, 2, 2, TREE_MAX_NODES, 5);
    const int32_t t1[] = {11, 12};
    const float p1[] = {0.25f, 0.5f};
    tree_expand(&b, 2, t1, p1);
    const int32_t f1[] = {1, 0};
    expect_frontier(&b, f1, 2);
    const int32_t t2[] = {21, 22, 23, 24}; /* 12's children (pool 1), then 11's (pool 0) */
    const float p2[] = {0.5f, 0.125f, 0.75f, 1.0f};
    tree_expand(&b, 2, t2, p2);
    tree_out t;
    tree_finish(&b, &t);
    /* pool 0: 11, 1: 12, 2: 21 (under 12), 3: 22 (under 12), 4: 23 (under 11), 5: 24 (under 11) */
    const int32_t tok[] = {5, 11, 12, 21, 22, 23, 24}, par[] = {-1, 0, 0, 2, 2, 1, 1};
    const float pr[] = {1.0f, 0.25f, 0.5f, 0.5f, 0.125f, 0.75f, 1.0f};
    expect_tree(&t, 7, tok, par, pr);
}

/* NaN and negatives count as 0, anything above 1 (also +inf) as 1:
 * scores 0, 0, 1, 1, 0, 0.5. Frontier (topk 6) best first: 2 3 5 0 1 4;
 * keep 3: the two clamped ones and 0.5, never NaN. */
static void test_bad_probabilities_are_clamped_to_zero_and_one(void **state) {
    (void)state;
    static tree_build b;
    begin(&b, 1, 6, 4, 9);
    const int32_t tok[] = {30, 31, 32, 33, 34, 35};
    const float p[] = {NAN, -0.5f, 1.5f, INFINITY, -INFINITY, 0.5f};
    tree_expand(&b, 6, tok, p);
    const float want_p[] = {0.0f, 0.0f, 1.0f, 1.0f, 0.0f, 0.5f};
    for (int32_t i = 0; i < 6; i++) {
        assert_true(b.pool[i].p == want_p[i]);
        assert_true(b.pool[i].score == want_p[i]);
    }
    const int32_t f[] = {2, 3, 5, 0, 1, 4};
    expect_frontier(&b, f, 6);
    tree_out t;
    tree_finish(&b, &t);
    const int32_t wt[] = {9, 32, 33, 35}, wp[] = {-1, 0, 0, 0};
    const float wpr[] = {1.0f, 1.0f, 1.0f, 0.5f};
    expect_tree(&t, 4, wt, wp, wpr);
}

/* A head vocabulary of 2 under topk 4: the first depth has 2 candidates
 * and a frontier of 2, the second 4 (2 per frontier node) and a frontier
 * of 4. Pool: 0: 50 0.5, 1: 51 0.25 | under 50: 2: 60 0.5 (.25),
 * 3: 61 0.5 (.25) | under 51: 4: 62 1.0 (.25), 5: 63 0.5 (.125). */
static void test_fewer_children_than_topk(void **state) {
    (void)state;
    static tree_build b;
    begin(&b, 2, 4, 5, 1);
    const int32_t t1[] = {50, 51};
    const float p1[] = {0.5f, 0.25f};
    tree_expand(&b, 2, t1, p1);
    const int32_t f1[] = {0, 1};
    expect_frontier(&b, f1, 2);
    const int32_t t2[] = {60, 61, 62, 63};
    const float p2[] = {0.5f, 0.5f, 1.0f, 0.5f};
    tree_expand(&b, 2, t2, p2);
    const int32_t f2[] = {2, 3, 4, 5};
    expect_frontier(&b, f2, 4);
    assert_int_equal(b.pool[4].parent, 1);
    assert_int_equal(b.pool[5].parent, 1);
    /* Keep 4: 50 (.5), 51 (.25), 60 (.25), 61 (.25); 62 ties but is later. */
    tree_out t;
    tree_finish(&b, &t);
    const int32_t tok[] = {1, 50, 51, 60, 61}, par[] = {-1, 0, 0, 1, 1};
    const float pr[] = {1.0f, 0.5f, 0.25f, 0.5f, 0.5f};
    expect_tree(&t, 5, tok, par, pr);
}

static void expect_refused(tree_params p, const char *name, const char *range) {
    ae_error err = {0};
    assert_int_equal(tree_params_check(&p, &err), AE_ERR);
    assert_non_null(strstr(err.msg, name));
    assert_non_null(strstr(err.msg, range));
}

static void test_params_check_names_the_parameter_out_of_range(void **state) {
    (void)state;
    const tree_params ok = {.steps = 3, .topk = 4, .num_draft_tokens = 16};
    tree_params p = ok;
    p.steps = 0;
    expect_refused(p, "spec-steps 0", "1..16");
    p.steps = TREE_MAX_STEPS + 1;
    expect_refused(p, "spec-steps 17", "1..16");
    p = ok;
    p.topk = 0;
    expect_refused(p, "spec-topk 0", "1..8");
    p.topk = TREE_MAX_TOPK + 1;
    expect_refused(p, "spec-topk 9", "1..8");
    p = ok;
    p.num_draft_tokens = 1;
    expect_refused(p, "spec-tokens 1", "2..64");
    p.num_draft_tokens = TREE_MAX_NODES + 1;
    expect_refused(p, "spec-tokens 65", "2..64");
}

static void test_params_check_accepts_the_bounds(void **state) {
    (void)state;
    ae_error err = {0};
    const tree_params lo = {.steps = 1, .topk = 1, .num_draft_tokens = 2};
    const tree_params hi = {.steps = TREE_MAX_STEPS, .topk = TREE_MAX_TOPK, .num_draft_tokens = TREE_MAX_NODES};
    assert_int_equal(tree_params_check(&lo, &err), AE_OK);
    assert_int_equal(tree_params_check(&hi, &err), AE_OK);
    assert_string_equal(err.msg, "");
}

/* ---- property test against a brute-force model ---- */

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int32_t rng_int(uint64_t *s, int32_t lo, int32_t hi) { /* [lo, hi] */
    return lo + (int32_t)(rng_next(s) % (uint64_t)(hi - lo + 1));
}

/* Dyadic values make equal scores common, so the tie order is exercised;
 * the rest are NaN, out of range, or arbitrary. */
static float rng_prob(uint64_t *s) {
    static const float pick[] = {0.0f, 0.125f, 0.25f, 0.5f, 0.5f, 0.75f, 1.0f, 1.0f, NAN, -0.25f, 1.5f};
    int32_t n = (int32_t)(sizeof pick / sizeof pick[0]);
    int32_t i = rng_int(s, 0, n);
    if (i < n) return pick[i];
    return (float)(rng_next(s) >> 40) * 0x1.0p-24f;
}

typedef struct model {
    int32_t n;
    int32_t parent[TREE_MAX_POOL];
    float p[TREE_MAX_POOL];
    float score[TREE_MAX_POOL];
    int32_t depth[TREE_MAX_POOL];
} model;

/* The documented total order, written out: higher score, then earlier. */
static int model_cmp(const model *m, int32_t a, int32_t b) {
    if (m->score[a] > m->score[b]) return -1;
    if (m->score[a] < m->score[b]) return 1;
    return a < b ? -1 : a > b;
}

/* Sorts idx[0..n) best first (insertion sort: a plain reference, not speed). */
static void model_sort(const model *m, int32_t *idx, int32_t n) {
    for (int32_t i = 1; i < n; i++)
        for (int32_t j = i; j > 0 && model_cmp(m, idx[j], idx[j - 1]) < 0; j--) {
            int32_t t = idx[j];
            idx[j] = idx[j - 1];
            idx[j - 1] = t;
        }
}

static void check_one_random_build(uint64_t *rs, tree_build *b, model *m) {
    tree_params prm = {.steps = rng_int(rs, 1, TREE_MAX_STEPS),
                       .topk = rng_int(rs, 1, TREE_MAX_TOPK),
                       .num_draft_tokens = rng_int(rs, 2, TREE_MAX_NODES)};
    int32_t root = rng_int(rs, 0, 1000);
    tree_begin(b, &prm, root);
    m->n = 0;
    int32_t frontier[TREE_MAX_TOPK] = {-1}, n_frontier = 1;
    static int32_t all[TREE_MAX_POOL];
    while (!tree_done(b)) {
        int32_t k = rng_int(rs, 1, prm.topk), first = m->n;
        int32_t tokens[TREE_MAX_TOPK * TREE_MAX_TOPK];
        float probs[TREE_MAX_TOPK * TREE_MAX_TOPK];
        for (int32_t i = 0; i < n_frontier; i++) {
            int32_t par = frontier[i];
            for (int32_t j = 0; j < k; j++) {
                float p = rng_prob(rs);
                tokens[i * k + j] = 100000 + m->n; /* the token names the creation index */
                probs[i * k + j] = p;
                float c = isnan(p) || p < 0.0f ? 0.0f : p > 1.0f ? 1.0f : p;
                m->parent[m->n] = par;
                m->p[m->n] = c;
                m->score[m->n] = (par < 0 ? 1.0f : m->score[par]) * c;
                m->depth[m->n] = par < 0 ? 1 : m->depth[par] + 1;
                m->n++;
            }
        }
        tree_expand(b, k, tokens, probs);
        int32_t n_new = m->n - first;
        for (int32_t i = 0; i < n_new; i++) all[i] = first + i;
        model_sort(m, all, n_new);
        n_frontier = n_new < prm.topk ? n_new : prm.topk;
        memcpy(frontier, all, (size_t)n_frontier * sizeof *frontier);
        expect_frontier(b, frontier, n_frontier);
    }
    assert_int_equal(b->n_pool, m->n);
    for (int32_t i = 0; i < m->n; i++) {
        assert_int_equal(b->pool[i].token, 100000 + i);
        assert_int_equal(b->pool[i].parent, m->parent[i]);
        assert_int_equal(b->pool[i].depth, m->depth[i]);
        assert_true(b->pool[i].p == m->p[i]);
        assert_true(b->pool[i].score == m->score[i]);
    }

    /* Brute force: sort the whole pool, keep the best, back to creation order. */
    int32_t keep = prm.num_draft_tokens - 1;
    for (int32_t i = 0; i < m->n; i++) all[i] = i;
    model_sort(m, all, m->n);
    int32_t n_keep = m->n < keep ? m->n : keep;
    int32_t kept[TREE_MAX_NODES];
    memcpy(kept, all, (size_t)n_keep * sizeof *kept);
    for (int32_t i = 1; i < n_keep; i++)
        for (int32_t j = i; j > 0 && kept[j] < kept[j - 1]; j--) {
            int32_t t = kept[j];
            kept[j] = kept[j - 1];
            kept[j - 1] = t;
        }

    tree_out t;
    tree_finish(b, &t);
    assert_int_equal(t.n, 1 + n_keep);
    assert_int_equal(t.tokens[0], root);
    assert_int_equal(t.parents[0], -1);
    assert_true(t.probs[0] == 1.0f);
    float score[TREE_MAX_NODES];
    score[0] = 1.0f;
    for (int32_t i = 1; i < t.n; i++) {
        int32_t ci = kept[i - 1], par = t.parents[i];
        assert_int_equal(t.tokens[i], 100000 + ci); /* the kept set, in creation order */
        assert_true(t.probs[i] == m->p[ci]);
        assert_in_range(par, 0, i - 1);
        /* The parent node is the model's parent candidate (or the root). */
        if (m->parent[ci] < 0)
            assert_int_equal(par, 0);
        else
            assert_int_equal(t.tokens[par], 100000 + m->parent[ci]);
        score[i] = score[par] * t.probs[i];
        assert_true(score[i] <= score[par]);
        assert_true(score[i] == m->score[ci]);
    }
}

static void test_random_builds_match_the_brute_force_order(void **state) {
    (void)state;
    static tree_build b;
    static model m;
    uint64_t rs = 20240611;
    for (int run = 0; run < 2000; run++) check_one_random_build(&rs, &b, &m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_begin_has_the_root_alone_as_frontier),
        cmocka_unit_test(test_chain_of_topk_one),
        cmocka_unit_test(test_wide_tree_keeps_best_across_depths_and_parents),
        cmocka_unit_test(test_frontier_ties_go_to_the_earlier_candidate),
        cmocka_unit_test(test_child_with_p_one_follows_its_kept_parent),
        cmocka_unit_test(test_final_ties_go_to_the_earlier_candidate),
        cmocka_unit_test(test_child_with_p_one_is_cut_after_equal_earlier_ones),
        cmocka_unit_test(test_more_nodes_than_candidates_keeps_every_candidate),
        cmocka_unit_test(test_bad_probabilities_are_clamped_to_zero_and_one),
        cmocka_unit_test(test_fewer_children_than_topk),
        cmocka_unit_test(test_params_check_names_the_parameter_out_of_range),
        cmocka_unit_test(test_params_check_accepts_the_bounds),
        cmocka_unit_test(test_random_builds_match_the_brute_force_order),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
