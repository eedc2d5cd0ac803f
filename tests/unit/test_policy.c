/* The speculation policy (target/policy.h) in synthetic worlds: a verify
 * pass, a drafter and a head with known costs and acceptance, fed to the
 * policy as spec.c feeds it real steps. The shapes it must pick follow
 * from the arithmetic of policy.h with the true figures; the numbers in
 * the comments are that arithmetic. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "../../target/policy.h"

#define RANKS 4
#define STEPS_SETTLING 32 /* the schedule: plain 6, tree 12, deepest chain 8, one-token chain 6 */

typedef struct world {
    double p[POLICY_MAX_DEPTH][RANKS];  /* true: the rank-r child is the target's token at depth d */
    double v0_us, v_slope_us;           /* V(t) = v0 + slope (t - 1), per sequence */
    double d0_us, d_step_us, d_node_us; /* D = d0 + step * steps + node * (1 + (steps - 1) topk) */
    double slowdown;                    /* every cost times this (0: 1): the host's speed moving */
    double noise;                       /* and each step's times 1 +- up to this, uniform */
    double feed_us;                     /* feeding the drafter one pair of a plain step (0: free) */
    int32_t pending;                    /* pairs of plain steps not yet fed, per sequence */
    uint64_t rng;
} world;

static double uniform(world *w) {
    w->rng ^= w->rng << 13;
    w->rng ^= w->rng >> 7;
    w->rng ^= w->rng << 17;
    return (double)(w->rng >> 11) / 9007199254740992.0;
}

static void set_acceptance(world *w, const double *ranks, const double *deeper) {
    for (int d = 0; d < POLICY_MAX_DEPTH; d++)
        for (int r = 0; r < RANKS; r++) w->p[d][r] = d == 0 || !deeper ? ranks[r] : deeper[r];
}

/* The drafter's tree for a shape (draft/tree.h's build, with the world's
 * probabilities as the head's): parents[] in creation order. */
static int32_t build_tree(const world *w, const policy_shape *s, int32_t *parents) {
    enum { POOL = 1024 };
    int32_t par[POOL], dep[POOL], n_pool = 0, frontier[POLICY_MAX_RANK] = {-1}, nf = 1;
    double score[POOL];
    for (int32_t d = 0; d < s->steps; d++) {
        int32_t first = n_pool;
        for (int32_t i = 0; i < nf; i++)
            for (int32_t r = 0; r < s->topk; r++) {
                double ps = frontier[i] < 0 ? 1.0 : score[frontier[i]];
                par[n_pool] = frontier[i], dep[n_pool] = d;
                score[n_pool++] = ps * (r < RANKS ? w->p[d][r] : 0.0);
            }
        /* next frontier: the best topk of this depth, earlier first among equals */
        nf = 0;
        for (int32_t k = 0; k < s->topk && k < n_pool - first; k++) {
            int32_t best = -1;
            for (int32_t i = first; i < n_pool; i++) {
                bool taken = false;
                for (int32_t j = 0; j < nf; j++) taken |= frontier[j] == i;
                if (!taken && (best < 0 || score[i] > score[best])) best = i;
            }
            frontier[nf++] = best;
        }
    }
    (void)dep;
    /* keep the best tokens - 1, then back to creation order */
    bool keep[POOL] = {false};
    int32_t kept = 0;
    for (; kept < s->tokens - 1 && kept < n_pool; kept++) {
        int32_t best = -1;
        for (int32_t i = 0; i < n_pool; i++)
            if (!keep[i] && (best < 0 || score[i] > score[best])) best = i;
        keep[best] = true;
    }
    int32_t node_of[POOL], n = 1;
    parents[0] = -1;
    for (int32_t i = 0; i < n_pool; i++)
        if (keep[i]) {
            node_of[i] = n;
            parents[n++] = par[i] < 0 ? 0 : node_of[par[i]];
        }
    return n;
}

/* The target's token at each reached node: rank r with probability p[d][r]
 * (none with the rest); accepted when that child is in the tree. */
static int32_t verify(world *w, const int32_t *parents, int32_t n, int32_t *path) {
    int32_t n_path = 1, node = 0;
    path[0] = 0;
    for (int32_t d = 0;; d++) {
        double u = uniform(w), c = 0;
        int32_t r = 0;
        for (; r < RANKS; r++) {
            c += w->p[d < POLICY_MAX_DEPTH ? d : POLICY_MAX_DEPTH - 1][r];
            if (u < c) break;
        }
        int32_t child = -1, seen = 0;
        for (int32_t i = 1; i < n && child < 0; i++)
            if (parents[i] == node && seen++ == r) child = i;
        if (r == RANKS || child < 0) return n_path;
        path[n_path++] = child;
        node = child;
    }
}

typedef struct tally {
    int64_t steps, settled_at, drafted_settled, explore_settled;
    int64_t plain_choice_settled;  /* steps plain by the choice, not in a probe */
    int64_t feeds;                 /* calls feeding the drafter after plain steps */
    double feed_us, plain_us;      /* the world's time of those calls, and of the plain steps */
    double settled_us, explore_us; /* the world's time of the settled steps, and of those exploring */
    policy_shape last;
} tally;

/* `steps` steps of a batch of n through the policy in world w. */
static void run(policy *p, world *w, int32_t n, int32_t steps, tally *t) {
    for (int32_t k = 0; k < steps; k++) {
        policy_report r;
        policy_get_report(p, n, &r);
        bool settled = r.settled; /* before the step: the step that ends settling still settles */
        policy_pick pk = policy_choose(p, n);
        int32_t parents[POLICY_MAX_NODES], path[POLICY_MAX_NODES], nodes = 1;
        double draft_us = 0;
        if (pk.shape.tokens >= 2) {
            nodes = build_tree(w, &pk.shape, parents);
            for (int32_t i = 0; i < n; i++) {
                int32_t n_path = verify(w, parents, nodes, path);
                policy_observe_tree(p, parents, nodes, path, n_path);
            }
            draft_us =
                w->d0_us + w->d_step_us * pk.shape.steps + w->d_node_us * (1 + (pk.shape.steps - 1) * pk.shape.topk);
        }
        double v_us = w->v0_us + w->v_slope_us * (nodes - 1), slow = w->slowdown > 0 ? w->slowdown : 1;
        if (w->noise > 0) slow *= 1 + w->noise * (2 * uniform(w) - 1);
        v_us *= slow, draft_us *= slow;
        policy_observe_step(p, n, &pk.shape, n * nodes, (int64_t)(draft_us * 1e3 * n), (int64_t)(v_us * 1e3 * n));
        /* As spec.c: a tree's call sends the pending pairs; after plain
         * steps they go in one call per 32, while the drafter is kept. */
        w->pending = pk.shape.tokens >= 2 ? 0 : w->pending + 1;
        if (pk.shape.tokens < 2 && w->pending >= 32 && policy_keep_drafter(p, n)) {
            policy_observe_feed(p, n, (int64_t)(w->feed_us * slow * 1e3 * n * w->pending));
            t->feed_us += w->feed_us * slow * w->pending;
            w->pending = 0;
            t->feeds++;
        }
        if (pk.shape.tokens < 2) t->plain_us += v_us;
        t->steps++;
        if (settled) {
            if (!t->settled_at) t->settled_at = t->steps;
            t->drafted_settled += pk.shape.tokens >= 2;
            t->explore_settled += pk.explore;
            t->plain_choice_settled += !pk.explore && pk.shape.tokens < 2;
            t->settled_us += draft_us + v_us;
            if (pk.explore) t->explore_us += draft_us + v_us;
        }
        policy_get_report(p, 0, &r);
        t->last = r.shape;
    }
}

static policy *open_policy(policy_shape max) {
    policy_config c = {max, true};
    policy *p;
    ae_error err = {0};
    if (policy_init(&p, &c, &err) != AE_OK) fail_msg("%s", err.msg);
    return p;
}

static void assert_shape(policy_shape got, int32_t steps, int32_t topk, int32_t tokens) {
    if (got.steps != steps || got.topk != topk || got.tokens != tokens)
        fail_msg("shape %d/%d/%d, expected %d/%d/%d", got.steps, got.topk, got.tokens, steps, topk, tokens);
}

static const policy_shape BOUND = {5, 4, 8};

/* A drafter that costs more than trees can give back (5 ms a call against
 * a 3 ms pass, 60% first-token acceptance): best tree 4/2/8 at 0.301
 * tokens/ms, plain 0.333. The batch settles after the schedule, is plain
 * a few dozen steps later (the first estimates are from a few trees) and
 * stays plain, drafting only in probes. Probes are paid in steps (2 per
 * 100) and in time (2% of it): a probe's trees cost 8-8.5 ms a step
 * against the choice's 3 ms, so they come about once per 280 steps, and
 * at a quarter of that rate while the estimate of the best tree is under
 * 80% of plain's (POLICY_EXPLORE_FAR; here it wavers at 0.77-0.85):
 * 30 steps in 5100. */
static void test_a_slow_draft_goes_plain_and_stays_plain(void **state) {
    (void)state;
    world w = {.v0_us = 3000, .d0_us = 5000, .d_step_us = 100, .rng = 1};
    set_acceptance(&w, (double[]){0.6, 0.1, 0.05, 0.02}, NULL);
    policy *p = open_policy(BOUND);
    tally t = {0};
    run(p, &w, 1, STEPS_SETTLING, &t);
    assert_int_equal(t.settled_at, 0);
    run(p, &w, 1, 48, &t);
    assert_int_equal(t.settled_at, STEPS_SETTLING + 1);
    assert_shape(t.last, 0, 0, 1);
    tally after = {0};
    run(p, &w, 1, 5100, &after);
    assert_shape(after.last, 0, 0, 1);
    policy_report r;
    policy_get_report(p, 0, &r);
    printf("slow draft: of %lld steps, %lld drafted, %lld exploring; since settling %lld of %lld\n",
           (long long)after.steps, (long long)after.drafted_settled, (long long)after.explore_settled,
           (long long)r.explore_steps, (long long)r.settled_steps);
    printf("slow draft: exploring %.2f%% of the settled time\n", 100 * after.explore_us / after.settled_us);
    assert_int_equal(after.drafted_settled, after.explore_settled);
    assert_int_equal(after.explore_settled, 30);
    assert_true(after.explore_us <= 0.02 * after.settled_us);
    assert_int_equal(policy_explore_steps(p), r.explore_steps);
    assert_true(r.explore_steps * 50 <= r.settled_steps);
    policy_free(p);
}

/* Far from paying (a 20 ms drafter against a 3 ms pass: the best tree
 * at a third of plain's rate), probes are paid at POLICY_EXPLORE_FAR,
 * 0.5% of the time: a probe of 2 steps at about 23 ms each waits some
 * 3,000 plain steps. They still come: a cheaper drafter would be found. */
static void test_far_from_paying_explores_less(void **state) {
    (void)state;
    world w = {.v0_us = 3000, .d0_us = 20000, .d_step_us = 100, .rng = 3};
    set_acceptance(&w, (double[]){0.6, 0.1, 0.05, 0.02}, NULL);
    policy *p = open_policy(BOUND);
    tally t = {0};
    run(p, &w, 1, STEPS_SETTLING + 100, &t);
    assert_shape(t.last, 0, 0, 1);
    tally after = {0};
    run(p, &w, 1, 20000, &after);
    printf("far from paying: %lld of %lld steps exploring, %.3f%% of the time\n", (long long)after.explore_settled,
           (long long)after.steps, 100 * after.explore_us / after.settled_us);
    assert_shape(after.last, 0, 0, 1);
    assert_true(after.explore_settled >= 2);
    assert_true(after.explore_us <= POLICY_EXPLORE_FAR * after.settled_us);
    assert_true(after.explore_us > 0.5 * POLICY_EXPLORE_FAR * after.settled_us);
    policy_free(p);
}

/* A step where some sequences got no tree (a drafter that lost one) or a
 * cut one verifies fewer nodes than its shape: it measures no size, and
 * its drafter served fewer trees. Here, 12 nodes for 8 sequences of a
 * one-token chain at 10x the cost: nothing moves. */
static void test_a_step_of_mixed_trees_measures_nothing(void **state) {
    (void)state;
    world w = {.v0_us = 3000, .v_slope_us = 100, .d0_us = 200, .d_step_us = 100, .rng = 5};
    set_acceptance(&w, (double[]){0.4, 0.0, 0.0, 0.0}, (double[]){0.1, 0.0, 0.0, 0.0});
    policy *p = open_policy(BOUND);
    tally t = {0};
    run(p, &w, 8, 100, &t);
    policy_report before, after;
    policy_get_report(p, 8, &before);
    const policy_shape chain = {1, 1, 2};
    policy_observe_step(p, 8, &chain, 12, 8 * 3000000LL, 8 * 32000000LL);
    policy_get_report(p, 8, &after);
    assert_shape(before.shape, 1, 1, 2); /* the chain pays here: its draft cost is reported */
    assert_memory_equal(before.verify_us, after.verify_us, sizeof before.verify_us);
    assert_true(before.drift == after.drift && before.draft_us == after.draft_us);
    policy_free(p);
}

/* Acceptance too low to pay for any tree (5% at the first child): plain. */
static void test_low_acceptance_runs_plainly(void **state) {
    (void)state;
    world w = {.v0_us = 3000, .v_slope_us = 150, .d0_us = 200, .d_step_us = 50, .d_node_us = 20, .rng = 2};
    set_acceptance(&w, (double[]){0.05, 0.02, 0.01, 0.01}, NULL);
    policy *p = open_policy(BOUND);
    tally t = {0};
    run(p, &w, 1, 600, &t);
    assert_shape(t.last, 0, 0, 1);
    assert_true(t.explore_settled * 50 <= t.steps - STEPS_SETTLING);
    policy_free(p);
}

/* High acceptance (90% at the first child, 5% at the second) and a verify
 * pass that costs the same at any size: the deepest chain, 5/1/6 at 1.116
 * tokens/ms, beats the tree 5/2/8 (1.039: its second children rarely pay
 * for the draft's wider passes) and the chain of 4 (1.024). */
static void test_high_acceptance_and_a_flat_verify_cost_pick_a_chain(void **state) {
    (void)state;
    world w = {.v0_us = 3000, .d0_us = 200, .d_step_us = 100, .d_node_us = 100, .rng = 3};
    set_acceptance(&w, (double[]){0.9, 0.05, 0.0, 0.0}, NULL);
    policy *p = open_policy(BOUND);
    tally t = {0};
    run(p, &w, 1, 800, &t);
    assert_shape(t.last, 5, 1, 6);
    policy_report r;
    policy_get_report(p, 0, &r);
    char line[512];
    policy_report_log(&r, line, sizeof line);
    printf("chain: %s\n", line);
    assert_true(r.tok_s > r.plain_tok_s);
    assert_true(t.explore_settled * 50 <= t.steps - STEPS_SETTLING);
    policy_free(p);
}

/* In between: the first child is accepted half the time and the second
 * 35%, but deeper nodes rarely (20%, 10%), a draft depth costs 1 ms and a
 * verified node 0.2 ms. The one-depth tree of two children, 1/2/3 (E = 0.85:
 * 0.398 tokens/ms), beats the single token 1/1/2 (0.337), plain (0.333)
 * and anything deeper (2/2/4: 0.328). Settling's cautious estimates pick
 * plain; the probes, paid from 2% of plain's time, find the tree within
 * 1200 steps. */
static void test_middling_acceptance_picks_a_small_tree(void **state) {
    (void)state;
    world w = {.v0_us = 3000, .v_slope_us = 200, .d0_us = 200, .d_step_us = 1000, .d_node_us = 50, .rng = 4};
    set_acceptance(&w, (double[]){0.5, 0.35, 0.0, 0.0}, (double[]){0.2, 0.1, 0.0, 0.0});
    policy *p = open_policy(BOUND);
    tally t = {0};
    run(p, &w, 1, 1200, &t);
    assert_shape(t.last, 1, 2, 3);
    policy_report r;
    policy_get_report(p, 0, &r);
    char line[512];
    policy_report_log(&r, line, sizeof line);
    printf("small tree: %s\n", line);
    policy_free(p);
}

/* The stages that learn the head's acceptance are sized in trees: the
 * bounding tree's 12 and the deepest chain's 8. A first range at batch 8
 * runs them in 2 steps each (12 / 8 rounded up, and 1 raised to the least
 * of 2: the first drafting step resets the drafter and is not timed), at
 * batch 4 in 3 and 2; plain and the one-token chain, there to measure
 * costs, keep their 6 steps. At batch 1 the schedule is the 32 steps of
 * the tests above. */
static void test_acceptance_stages_are_sized_in_trees(void **state) {
    (void)state;
    world w = {.v0_us = 3000, .d0_us = 5000, .d_step_us = 100, .rng = 1};
    set_acceptance(&w, (double[]){0.6, 0.1, 0.05, 0.02}, NULL);
    const int32_t batch[2] = {8, 4}, want[2][4] = {{6, 2, 2, 6}, {6, 3, 2, 6}};
    const policy_shape order[4] = {{0, 0, 1}, BOUND, {5, 1, 6}, {1, 1, 2}};
    for (int k = 0; k < 2; k++) {
        policy *p = open_policy(BOUND);
        for (int32_t st = 0; st < 4; st++)
            for (int32_t i = 0; i < want[k][st]; i++) {
                policy_pick pk = policy_choose(p, batch[k]);
                assert_shape(pk.shape, order[st].steps, order[st].topk, order[st].tokens);
                assert_true(pk.explore);
                int32_t parents[POLICY_MAX_NODES], path[POLICY_MAX_NODES], nodes = 1;
                if (pk.shape.tokens >= 2) {
                    nodes = build_tree(&w, &pk.shape, parents);
                    for (int32_t j = 0; j < batch[k]; j++)
                        policy_observe_tree(p, parents, nodes, path, verify(&w, parents, nodes, path));
                }
                policy_observe_step(p, batch[k], &pk.shape, batch[k] * nodes,
                                    pk.shape.tokens >= 2 ? batch[k] * 5200000LL : 0, batch[k] * 3000000LL);
            }
        policy_report r;
        policy_get_report(p, batch[k], &r);
        assert_true(r.settled);
        assert_false(policy_choose(p, batch[k]).explore);
        policy_free(p);
    }
}

/* Each range of batch sizes settles on its own, and a fixed policy always
 * asks for the bounding tree. A range that settles after another skips
 * the stages that only learn the head's acceptance (shared): plain, then
 * the one-token chain, 12 steps instead of 32. */
static void test_batch_ranges_settle_apart_and_a_fixed_policy_never_moves(void **state) {
    (void)state;
    world w = {.v0_us = 3000, .d0_us = 5000, .d_step_us = 100, .rng = 1}; /* the slow draft above */
    set_acceptance(&w, (double[]){0.6, 0.1, 0.05, 0.02}, NULL);
    policy *p = open_policy(BOUND);
    tally t1 = {0}, t8 = {0};
    run(p, &w, 1, STEPS_SETTLING + 48, &t1);
    assert_int_equal(t1.settled_at, STEPS_SETTLING + 1);
    assert_false(policy_drafting(p, 1));
    run(p, &w, 8, 6, &t8); /* batches of 8: 6 plain steps; the next drafts */
    assert_true(policy_drafting(p, 8));
    policy_pick pk8 = policy_choose(p, 8); /* then the one-token chain, not the bounding tree */
    assert_shape(pk8.shape, 1, 1, 2);
    assert_true(pk8.explore);
    policy_observe_step(p, 8, &pk8.shape, 16, 8 * 5100000, 8 * 3000000);
    t8.steps++;
    run(p, &w, 8, 4, &t8);
    assert_int_equal(t8.settled_at, 0);
    run(p, &w, 8, 8, &t8);
    assert_int_equal(t8.settled_at, 13);
    assert_false(policy_drafting(p, 8)); /* the slow draft: plain here too */
    policy_free(p);

    policy_config c = {{4, 3, 8}, false};
    ae_error err = {0};
    assert_int_equal(policy_init(&p, &c, &err), AE_OK);
    for (int32_t n = 1; n <= 64; n *= 2) {
        policy_pick pk = policy_choose(p, n);
        assert_shape(pk.shape, 4, 3, 8);
        assert_false(pk.explore);
        assert_true(policy_drafting(p, n));
    }
    policy_free(p);
    c.max.tokens = 65;
    assert_int_equal(policy_init(&p, &c, &err), AE_ERR);
    assert_string_equal(err.msg, "policy: tree of 4 steps, top-3, 65 nodes (need 1..16, 1..8, 2..64)");
}

/* What a verified tree teaches: the chances and hits at each depth and
 * rank, on top of the priors (1/2 for the first child, half the rank
 * above, the depth above). */
static void test_acceptance_is_counted_by_depth_and_rank(void **state) {
    (void)state;
    policy *p = open_policy(BOUND);
    /* Priors: 1/2 at every depth for the first child, 1/4 for the second. */
    assert_true(policy_accept(p, 0, 0) == 0.5);
    assert_true(policy_accept(p, 3, 1) == 0.25);
    /* A chain of 3 at 1/2: 1/2 + 1/4 + 1/8. A tree of 2 depths, width 2,
     * 4 nodes: children 1/2 and 1/4, then 1/4 under the first: 1. */
    policy_shape chain = {3, 1, 4}, tree = {2, 2, 4};
    assert_true(policy_expected_accepted(p, &chain) == 0.875);
    assert_true(policy_expected_accepted(p, &tree) == 1.0);
    /* Root with three children; the second is accepted, then its only
     * child is not. */
    int32_t parents[5] = {-1, 0, 0, 0, 2}, path[2] = {0, 2};
    policy_observe_tree(p, parents, 5, path, 2);
    /* depth 0: 3 chances, the hit at rank 1; depth 1: one chance, no hit */
    assert_true(policy_accept(p, 0, 0) == (0 + 2 * 0.5) / (1 + 2));
    double p00 = 1.0 / 3, p01 = (1 + 2 * 0.5 * p00) / 3, p02 = (0 + 2 * 0.5 * p01) / 3;
    assert_true(policy_accept(p, 0, 1) == p01);
    assert_true(policy_accept(p, 0, 2) == p02);
    assert_true(policy_accept(p, 1, 0) == (0 + 2 * p00) / 3);
    /* rank 3 at depth 0 had no chance: its prior, half of rank 2 */
    assert_true(policy_accept(p, 0, 3) == 0.5 * p02);
    policy_free(p);
}

/* The verify cost of sizes not measured is interpolated between the
 * nearest measured ones, and the report says it. */
static void test_the_verify_curve_is_interpolated_between_measured_sizes(void **state) {
    (void)state;
    policy *p = open_policy(BOUND);
    policy_shape plain = {0, 0, 1}, tree = {5, 4, 8};
    policy_observe_step(p, 2, &plain, 2, 0, 2 * 3000000);           /* 3 ms a sequence at 1 node */
    policy_observe_step(p, 2, &tree, 16, 2 * 800000, 2 * 10000000); /* 10 ms at 8 nodes */
    (void)policy_choose(p, 2);
    policy_report r;
    policy_get_report(p, 0, &r);
    assert_int_equal(r.batch, 2);
    assert_int_equal(r.n_verify, 8);
    assert_true(r.verify_us[0] == 3000.0);
    assert_true(r.verify_us[3] == 6000.0); /* 4 nodes: 3/7 of the way */
    assert_true(r.verify_us[7] == 10000.0);
    char json[1024];
    int len = policy_report_json(&r, json, sizeof json);
    assert_true(len > 0 && (size_t)len < sizeof json);
    printf("%s\n", json);
    assert_non_null(strstr(json, "\"verify_us\": {\"1\": 3000.0, \"2\": 4000.0, \"3\": 5000.0, \"4\": 6000.0"));
    assert_non_null(strstr(json, "\"shape\": \"plain\""));
    /* A short buffer: cut, terminated, and the length it needed. */
    char small[16];
    assert_int_equal(policy_report_json(&r, small, sizeof small), len);
    assert_int_equal(strlen(small), 15);
    policy_free(p);
}

/* A pass of more nodes never costs less than one of fewer: measured
 * figures that say otherwise (a slow step caught once at 2 and at 7 nodes,
 * as a loaded host gives) are capped by the cheapest larger size measured,
 * before anything is interpolated between them. Without the cap, one
 * 19 ms outlier at 2 nodes made a one-token chain look twice as dear as a
 * 3-node tree for the rest of the run. */
static void test_a_costlier_smaller_pass_is_capped_by_a_larger_one(void **state) {
    (void)state;
    policy *p = open_policy(BOUND);
    policy_shape plain = {0, 0, 1}, c2 = {1, 1, 2}, c3 = {2, 1, 3}, t7 = {5, 4, 7}, t8 = {5, 4, 8};
    policy_observe_step(p, 1, &plain, 1, 0, 8000000);    /* 8 ms at 1 node */
    policy_observe_step(p, 1, &c2, 2, 500000, 19000000); /* 19 ms at 2: the outlier */
    policy_observe_step(p, 1, &c3, 3, 600000, 10000000); /* 10 ms at 3 */
    policy_observe_step(p, 1, &t7, 7, 900000, 23000000); /* 23 ms at 7: another */
    policy_observe_step(p, 1, &t8, 8, 900000, 14000000); /* 14 ms at 8 */
    (void)policy_choose(p, 1);
    policy_report r;
    policy_get_report(p, 0, &r);
    assert_int_equal(r.n_verify, 8);
    static const double want[8] = {8000, 10000, 10000, 11000, 12000, 13000, 14000, 14000};
    for (int i = 0; i < 8; i++)
        if (r.verify_us[i] != want[i]) fail_msg("V(%d) = %.1f us, expected %.1f", i + 1, r.verify_us[i], want[i]);
    policy_free(p);
}

/* Slow steps now and then (the gateway taking the cores for a moment)
 * do not move a size's cost: it is the median of its last 5 steps. Two of
 * five steps at 3x leave the one-token chain at its 7 ms; an average
 * would have put it at 12.6 ms. */
static void test_a_few_slow_steps_do_not_move_a_cost(void **state) {
    (void)state;
    policy *p = open_policy(BOUND);
    policy_shape plain = {0, 0, 1}, c2 = {1, 1, 2};
    for (int k = 0; k < 20; k++) policy_observe_step(p, 1, &plain, 1, 0, 6000000);
    static const int64_t ms[5] = {7, 21, 7, 21, 7};
    for (int k = 0; k < 5; k++) policy_observe_step(p, 1, &c2, 2, 500000, ms[k] * 1000000);
    policy_report r;
    policy_get_report(p, 1, &r);
    printf("a few slow steps: V(1) %.1f us, V(2) %.1f us, drift %.3f\n", r.verify_us[0], r.verify_us[1], r.drift);
    /* Nor the range's factor: two slow ratios in five leave its median at
     * 1. */
    assert_true(r.drift == 1.0);
    assert_true(r.verify_us[0] == 6000.0 && r.verify_us[1] == 7000.0);
    policy_free(p);
}

/* A world where the one-token chain pays (1.4 tokens in 3.4 ms against
 * 1 in 3 ms; the second child at the root is never accepted), and a
 * policy 400 steps into it at batch 1, running the chain. */
static policy *running_the_chain(world *w) {
    *w = (world){.v0_us = 3000, .v_slope_us = 100, .d0_us = 200, .d_step_us = 100, .rng = 5};
    set_acceptance(w, (double[]){0.4, 0.0, 0.0, 0.0}, (double[]){0.1, 0.0, 0.0, 0.0});
    policy *p = open_policy(BOUND);
    tally t = {0};
    run(p, w, 1, 400, &t);
    assert_shape(t.last, 1, 1, 2);
    return p;
}

/* The host slows to half speed after settling (another process on the
 * cores) while the one-token chain runs. The range's drift factor moves
 * only with plain steps (policy.h), so at first the slowdown is charged to
 * the chain: stored at twice its cost, it loses to plain at the next
 * decision. The 8 plain steps of that choice move the factor to 2, and
 * the chain's samples since the last plain steps are restated at it: the
 * chain is back, and the rates reported are today's. Stored as measured
 * over a factor that every step moved, the chain would never have left;
 * but neither would a chain whose own pass grew dear
 * (test_a_dear_choice_is_dropped). */
static void test_a_slower_host_does_not_make_stale_costs_look_cheap(void **state) {
    (void)state;
    world w;
    policy *p = running_the_chain(&w);
    policy_report before;
    policy_get_report(p, 1, &before);
    w.slowdown = 2;
    tally slow = {0};
    run(p, &w, 1, 400, &slow);
    policy_report r;
    policy_get_report(p, 1, &r);
    char line[512];
    policy_report_log(&r, line, sizeof line);
    printf("slower host: %s; of %lld steps %lld plain by choice, %lld exploring\n", line, (long long)slow.steps,
           (long long)slow.plain_choice_settled, (long long)slow.explore_settled);
    assert_shape(slow.last, 1, 1, 2);
    assert_int_equal(slow.plain_choice_settled, 8);
    assert_true(fabs(r.drift - 2.0) < 1e-12);
    assert_true(fabs(r.plain_tok_s - before.plain_tok_s / 2) < 1e-9 * before.plain_tok_s);
    policy_free(p);
}

/* The chain's own pass grows dear while plain's does not (at batch 4-7
 * in a 32-stream run, a chain's pass cost 1.6x plain's while the policy
 * had them equal): it costs 6.1 ms against plain's 3 ms, and 1.4 tokens
 * in 6.4 ms lose to plain. Its steps are stored as measured (the factor
 * moves with plain steps only), so it is dropped at the next decisions
 * and the range runs plainly: plain's factor did not move, so nothing is
 * restated. A factor that every step moved read those steps as a slower
 * host and raised plain's estimate with them, and a larger size measured
 * long ago capped the chain's: it stayed. */
static void test_a_dear_choice_is_dropped(void **state) {
    (void)state;
    world w;
    policy *p = running_the_chain(&w);
    w.v_slope_us = 3100;
    tally dear = {0};
    run(p, &w, 1, 24, &dear);
    assert_shape(dear.last, 0, 0, 1);
    tally after = {0};
    run(p, &w, 1, 376, &after);
    printf("a dear chain: plain after %d steps; of %lld more, %lld plain by choice\n", 24, (long long)after.steps,
           (long long)after.plain_choice_settled);
    assert_shape(after.last, 0, 0, 1);
    assert_int_equal(after.plain_choice_settled + after.explore_settled, after.steps);
    policy_free(p);
}

/* Steps 30% slower or faster at random, on a host whose speed does not
 * move: the factor stays where it started. Measured against the stored
 * costs (themselves stored over the factor), it fed on its own noise and
 * wandered (the code before this test: from 6.5 over steps 1,000-5,000
 * to 2,325 over the last 4,000); measured against the range's
 * first plain step, it cannot. */
static void test_noisy_steps_do_not_make_the_factor_wander(void **state) {
    (void)state;
    world w = {.v0_us = 3000, .d0_us = 5000, .d_step_us = 100, .noise = 0.3, .rng = 11};
    set_acceptance(&w, (double[]){0.6, 0.1, 0.05, 0.02}, NULL);
    policy *p = open_policy(BOUND);
    tally t = {0};
    run(p, &w, 1, 1000, &t);
    policy_report r0, r;
    policy_get_report(p, 1, &r0);
    /* The factor's mean over the first and the last 4,000 of 20,000 more
     * steps (each step's median of 5 jitters by some 11%). */
    double first = 0, last = 0, v1 = 0;
    for (int i = 0; i < 2000; i++) {
        run(p, &w, 1, 10, &t);
        policy_get_report(p, 1, &r);
        if (i < 400) first += r.drift / 400;
        if (i >= 1600) last += r.drift / 400, v1 += r.verify_us[0] / 400;
    }
    printf("noisy steps: the factor %.3f after 1000 steps, mean %.3f over the next 4000 and %.3f over the last 4000 "
           "of 20000; V(1) %.0f us\n",
           r0.drift, first, last, v1);
    assert_true(fabs(last / first - 1) < 0.05);
    assert_true(fabs(v1 - 3000) < 0.1 * 3000);
    policy_free(p);
}

/* A tree size measured cheaper than plain (a probe in a quiet moment) is
 * raised to plain's V(1), not plain lowered to it. */
static void test_no_tree_costs_less_than_plain(void **state) {
    (void)state;
    world w = {.v0_us = 3000, .d0_us = 5000, .d_step_us = 100, .rng = 1};
    set_acceptance(&w, (double[]){0.6, 0.1, 0.05, 0.02}, NULL);
    policy *p = open_policy(BOUND);
    tally t = {0};
    run(p, &w, 1, 200, &t);
    const policy_shape chain = {1, 1, 2};
    for (int i = 0; i < 5; i++) policy_observe_step(p, 1, &chain, 2, 5100000, 1500000);
    policy_report r;
    policy_get_report(p, 1, &r);
    printf("a cheap chain probe: V(1) %.0f us, V(2) %.0f us\n", r.verify_us[0], r.verify_us[1]);
    assert_true(r.verify_us[0] == 3000.0 && r.verify_us[1] == 3000.0);
    policy_free(p);
}

/* A burst of slow plain steps (a plain probe while the host stalled)
 * leaves plain's estimate at 4x while a chain runs: no plain step moves
 * the factor back until the next probe, and every tree then looks cheap
 * beside plain (a one-token chain ran 42 steps at batch 8, where its pass
 * cost 2.5 plain steps, after one such burst). The chain's next pass, at
 * a quarter of that estimate, has the range measure plain again at once:
 * 3 plain steps, and the factor is back. */
static void test_a_stale_plain_estimate_is_measured_again(void **state) {
    (void)state;
    world w;
    policy *p = running_the_chain(&w);
    const policy_shape plain = {0, 0, 1};
    for (int i = 0; i < 5; i++) policy_observe_step(p, 1, &plain, 1, 0, 12000000);
    policy_report r;
    policy_get_report(p, 1, &r);
    assert_true(fabs(r.drift - 4.0) < 0.01);
    tally t = {0};
    run(p, &w, 1, 1, &t); /* the chain, at 3.1 ms against plain's 12 ms estimate */
    for (int i = 0; i < 3; i++) {
        policy_pick pk = policy_choose(p, 1);
        assert_shape(pk.shape, 0, 0, 1);
        assert_true(pk.explore);
        policy_observe_step(p, 1, &pk.shape, 1, 0, 3000000);
    }
    policy_get_report(p, 1, &r);
    printf("a stale plain estimate: the factor %.2f after 3 plain steps; the choice %d/%d/%d\n", r.drift, r.shape.steps,
           r.shape.topk, r.shape.tokens);
    assert_true(fabs(r.drift - 1.0) < 0.01);
    assert_shape(policy_choose(p, 1).shape, 1, 1, 2);
    policy_free(p);
}

/* A tree near paying but not paying (the one-token chain at 0.97 of
 * plain: 1.2 tokens in 3.7 ms against 1 in 3 ms) keeps the drafter in
 * step through the plain steps while that costs little: 30 us a pair is
 * 1% of a 3 ms step. At 300 us a pair (10%: at 8 sequences a step, the
 * draft's passes over every token on cores a compute-bound target needs)
 * it is dropped once 64 plain steps have measured it (after one feed),
 * and the report says so. */
static void test_the_drafter_is_kept_in_step_only_while_that_is_cheap(void **state) {
    (void)state;
    double feed_us[2] = {30, 300};
    int64_t feeds[2];
    for (int k = 0; k < 2; k++) {
        world w = {.v0_us = 3000, .v_slope_us = 300, .d0_us = 400, .feed_us = feed_us[k], .rng = 9};
        set_acceptance(&w, (double[]){0.2, 0.05, 0.02, 0.01}, (double[]){0.1, 0.02, 0.01, 0.0});
        policy *p = open_policy(BOUND);
        tally t = {0};
        /* The share, read every 8 steps over the last 320 (ten cycles
         * of feeding every 32 plain steps, probes between). */
        run(p, &w, 8, 1680, &t);
        policy_report r;
        double share = 0, feed0 = t.feed_us, plain0 = t.plain_us;
        for (int i = 0; i < 40; i++) {
            run(p, &w, 8, 8, &t);
            policy_get_report(p, 8, &r);
            share += r.feed_share / 40;
        }
        double real = (t.feed_us - feed0) / (t.plain_us - plain0); /* over those steps */
        char line[512];
        policy_report_log(&r, line, sizeof line);
        printf("feeding at %.0f us a pair: %lld feeds in %lld steps, mean share %.4f (%.4f over them); %s\n",
               feed_us[k], (long long)t.feeds, (long long)t.steps, share, real, line);
        assert_shape(t.last, 0, 0, 1);
        assert_true(policy_keep_drafter(p, 8) == (k == 0));
        assert_true(r.keep_drafter == (k == 0));
        /* Kept: within a cycle of 32 steps the decayed sums swing by 16%,
         * and a probe's tree sends the pairs itself now and then (a feed
         * fewer: under the 1% of feeding every 32 steps); the mean is
         * what feeding cost over those steps. Dropped: the share froze
         * at one feed over the first 64 plain steps (5%), over the bound
         * either way. */
        if (k == 0)
            assert_true(fabs(share - real) < 0.1 * real && real < feed_us[k] / w.v0_us);
        else
            assert_true(r.feed_share > POLICY_KEEP_COST && r.feed_share < feed_us[k] / w.v0_us);
        feeds[k] = t.feeds;
        policy_free(p);
    }
    /* A range that drafts needs its prompts fed anyway: feeds then count
     * for nothing (counted against its few plain probes, every prompt
     * of a 1-stream run made the share 50-110%, and the drafter was
     * dropped as soon as plain won a decision). */
    world w = {.v0_us = 3000, .v_slope_us = 100, .d0_us = 200, .d_step_us = 100, .rng = 5};
    set_acceptance(&w, (double[]){0.4, 0.0, 0.0, 0.0}, (double[]){0.1, 0.0, 0.0, 0.0});
    policy *p = open_policy(BOUND);
    tally t = {0};
    run(p, &w, 1, 200, &t);
    for (int k = 0; k < 12000; k++) {       /* past 64 plain steps (settling and probes) */
        policy_observe_feed(p, 1, 3000000); /* a prompt each step, as long as a step */
        run(p, &w, 1, 1, &t);
    }
    assert_shape(t.last, 1, 1, 2);
    policy_report r;
    char line0[512];
    policy_get_report(p, 1, &r);
    printf("drafting, a prompt fed each step: %s\n", (policy_report_log(&r, line0, sizeof line0), line0));
    assert_true(r.feed_share == 0.0 && r.keep_drafter);
    policy_free(p);
    /* Every 32 plain steps after the 16 of settling at batch 8: 62, less
     * at most one for each of the 14 probes (a probe's tree sends the
     * pairs itself). */
    assert_true(feeds[0] >= 62 - 14);
    assert_int_equal(feeds[1], 1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_a_slow_draft_goes_plain_and_stays_plain),
        cmocka_unit_test(test_far_from_paying_explores_less),
        cmocka_unit_test(test_a_step_of_mixed_trees_measures_nothing),
        cmocka_unit_test(test_low_acceptance_runs_plainly),
        cmocka_unit_test(test_high_acceptance_and_a_flat_verify_cost_pick_a_chain),
        cmocka_unit_test(test_middling_acceptance_picks_a_small_tree),
        cmocka_unit_test(test_acceptance_stages_are_sized_in_trees),
        cmocka_unit_test(test_batch_ranges_settle_apart_and_a_fixed_policy_never_moves),
        cmocka_unit_test(test_acceptance_is_counted_by_depth_and_rank),
        cmocka_unit_test(test_the_verify_curve_is_interpolated_between_measured_sizes),
        cmocka_unit_test(test_a_costlier_smaller_pass_is_capped_by_a_larger_one),
        cmocka_unit_test(test_a_slower_host_does_not_make_stale_costs_look_cheap),
        cmocka_unit_test(test_a_dear_choice_is_dropped),
        cmocka_unit_test(test_noisy_steps_do_not_make_the_factor_wander),
        cmocka_unit_test(test_no_tree_costs_less_than_plain),
        cmocka_unit_test(test_a_stale_plain_estimate_is_measured_again),
        cmocka_unit_test(test_a_few_slow_steps_do_not_move_a_cost),
        cmocka_unit_test(test_the_drafter_is_kept_in_step_only_while_that_is_cheap),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
