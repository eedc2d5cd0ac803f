/* One script of drafter calls, run on two drafters of the tiny fixture's
 * head (tests/golden/eagle/tiny) that must draft the same bits: on the
 * CPU backend and on another (tests/cuda_cpu/test_cuda_spec.c: CUDA;
 * tests/unit/test_backend.c: "staged"), each placed where its copy of the
 * target's embedding table is. Three rounds over keys 0..DRAFT_ROUND_KEYS-1: feeds longer
 * than a pass (the drafters' max_tokens is 5) split into chunks, key 2
 * forked from key 1 in round 1, a key fed nothing, and a tree of another
 * shape each round. Features are a fixed pseudo-random pattern in
 * [-2, 2). Include after cmocka.h. */
#ifndef AERIE_TESTS_DRAFT_ROUNDS_H
#define AERIE_TESTS_DRAFT_ROUNDS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "../draft/drafter.h"
#include "../target/model.h"

#define DRAFT_ROUND_KEYS 3
#define DRAFT_ROUND_MAX_PAIRS 16

static inline void draft_round(int round, int32_t vocab, int32_t fw, float *feat, int32_t *toks,
                               drafter_feed f[DRAFT_ROUND_KEYS], int32_t *n) {
    static const int32_t pairs[3][DRAFT_ROUND_KEYS] = {{13, 4, 0}, {3, 1, 2}, {1, 0, 6}};
    static const int32_t start[3][DRAFT_ROUND_KEYS] = {{0, 0, 0}, {13, 4, 4}, {16, 5, 6}};
    uint32_t x = 2463534242u + (uint32_t)round;
    *n = 0;
    for (int32_t k = 0; k < DRAFT_ROUND_KEYS; k++) {
        int32_t np = pairs[round][k];
        if (round == 0 && np == 0) continue;
        float *fk = feat + (size_t)k * DRAFT_ROUND_MAX_PAIRS * (size_t)fw;
        int32_t *tk = toks + k * DRAFT_ROUND_MAX_PAIRS;
        for (int32_t i = 0; i < np * fw; i++) {
            x ^= x << 13, x ^= x >> 17, x ^= x << 5;
            fk[i] = (float)(x >> 8) / (float)(1u << 22) - 2.0f;
        }
        for (int32_t i = 0; i < np; i++) tk[i] = (int32_t)(((x >> 3) + 7u * (uint32_t)i) % (uint32_t)vocab);
        f[(*n)++] = (drafter_feed){k, round == 0, start[round][k], np, tk, fk, true, round == 1 && k == 2 ? 1 : -1};
    }
}

/* Runs the script on a and b, asserting every tree and every key's length
 * equal; *nodes counts the tree nodes, *probs those whose probability is
 * strictly between 0 and 1 (the comparison is of real values). Key 2
 * ends holding 12 pairs. rel_tol 0: probabilities bit for bit; else
 * within rel_tol of a's (a GPU's softmax calls the device's expf). */
static inline void draft_rounds_compare(drafter *a, drafter *b, int32_t fw, int32_t vocab, float rel_tol, int *nodes,
                                        int *probs) {
    ae_error err = {{0}};
    float *feat = calloc((size_t)DRAFT_ROUND_KEYS * DRAFT_ROUND_MAX_PAIRS * (size_t)fw, sizeof(float));
    assert_non_null(feat);
    int32_t toks[DRAFT_ROUND_KEYS * DRAFT_ROUND_MAX_PAIRS], n;
    drafter_feed f[DRAFT_ROUND_KEYS];
    tree_out ta[DRAFT_ROUND_KEYS], tb[DRAFT_ROUND_KEYS];
    const tree_params shapes[3] = {{4, 3, 8}, {5, 4, 16}, {3, 1, 4}};
    *nodes = *probs = 0;
    for (int round = 0; round < 3; round++) {
        draft_round(round, vocab, fw, feat, toks, f, &n);
        if (drafter_propose(a, f, n, &shapes[round], ta, &err) != AE_OK ||
            drafter_propose(b, f, n, &shapes[round], tb, &err) != AE_OK)
            fail_msg("round %d: %s", round, err.msg);
        for (int32_t i = 0; i < n; i++) {
            assert_int_equal(ta[i].n, shapes[round].num_draft_tokens);
            assert_int_equal(tb[i].n, ta[i].n);
            assert_memory_equal(tb[i].tokens, ta[i].tokens, (size_t)ta[i].n * sizeof(int32_t));
            assert_memory_equal(tb[i].parents, ta[i].parents, (size_t)ta[i].n * sizeof(int32_t));
            if (rel_tol == 0.0f) assert_memory_equal(tb[i].probs, ta[i].probs, (size_t)ta[i].n * sizeof(float));
            for (int32_t j = 0; j < ta[i].n; j++)
                if (fabsf(tb[i].probs[j] - ta[i].probs[j]) > rel_tol * ta[i].probs[j])
                    fail_msg("round %d key %d node %d: probability %.9g, the CPU's %.9g", round, f[i].key, j,
                             (double)tb[i].probs[j], (double)ta[i].probs[j]);
            *nodes += ta[i].n;
            for (int32_t j = 1; j < ta[i].n; j++) *probs += ta[i].probs[j] > 0.0f && ta[i].probs[j] < 1.0f;
        }
        for (int32_t k = 0; k < DRAFT_ROUND_KEYS; k++) assert_int_equal(drafter_len(b, k), drafter_len(a, k));
    }
    assert_int_equal(drafter_len(a, 2), 12); /* forked from key 1 at 4, then 2 and 6 more */
    free(feat);
}

/* The fixture's target and head on the CPU backend and on be; the script
 * on both. Run from the repo root. */
static inline void draft_rounds_on(const kn_backend *be, const char *name, float rel_tol) {
    ae_error err = {{0}};
    model *m[2];
    eagle_head *h[2];
    drafter *d[2];
    const kn_backend *bes[2] = {&kn_backend_cpu, be};
    drafter_config dc = {DRAFT_ROUND_KEYS, 64, 5, 2, NULL, 0};
    for (int k = 0; k < 2; k++) {
        if (model_load(&m[k], "tests/golden/eagle/tiny/target", bes[k], &err) != AE_OK) fail_msg("%s", err.msg);
        eagle_target t = model_embedding(m[k]);
        if (eagle_load(&h[k], "tests/golden/eagle/tiny/head", &t, EAGLE_WEIGHTS_FILE, &err) != AE_OK ||
            drafter_init(&d[k], h[k], &dc, &err) != AE_OK)
            fail_msg("%s", err.msg);
        assert_ptr_equal(h[k]->be, bes[k]); /* placed where its table is */
    }
    int nodes, probs;
    draft_rounds_compare(d[0], d[1], 3 * h[0]->cfg.hidden, h[0]->target.vocab, rel_tol, &nodes, &probs);
    printf("the head on %s: %d tree nodes over 3 rounds, the CPU's %s (%d probabilities in (0, 1))\n", name, nodes,
           rel_tol == 0.0f ? "bit for bit" : "with probabilities within the tolerance", probs);
    assert_true(probs > nodes / 2);
    for (int k = 0; k < 2; k++) {
        drafter_free(d[k]);
        eagle_free(h[k]);
        model_free(m[k]);
    }
}

#endif
