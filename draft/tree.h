/* EAGLE-2 dynamic draft trees, built one depth at a time.
 *
 * The drafter runs the head on a frontier of nodes, takes each node's
 * top-k children from the head's distribution, and hands them here:
 *
 *   tree_begin(root)             frontier = {root}, score 1
 *   tree_expand(children)        once per depth (`steps` times): every
 *                                frontier node gets its k children, scored
 *                                parent score x p; the best `topk` of the
 *                                new candidates become the next frontier
 *   tree_finish(out)             the best num_draft_tokens - 1 candidates of
 *                                every depth, parents before children, under
 *                                the root (node 0)
 *
 * "Best" is a total order: higher score first, and among equal scores the
 * candidate created first (lower pool index). A child's score never
 * exceeds its parent's (p <= 1, and the product rounds monotonically), and
 * a parent is always created before its children, so the kept set holds
 * every ancestor of every node it holds. Candidates are created in
 * frontier order, then in the order the children were given.
 *
 * Plain data, no allocation: a tree_build sits in the drafter's scratch. */
#ifndef AERIE_DRAFT_TREE_H
#define AERIE_DRAFT_TREE_H

#include <stdbool.h>
#include <stdint.h>

#include "../services/core/err.h"

#define TREE_MAX_TOPK 8
#define TREE_MAX_STEPS 16
#define TREE_MAX_NODES 64 /* nodes of a finished tree, root included */
/* Candidates of a full build: topk at the first depth, topk^2 after. */
#define TREE_MAX_POOL (TREE_MAX_TOPK + (TREE_MAX_STEPS - 1) * TREE_MAX_TOPK * TREE_MAX_TOPK)

typedef struct tree_params {
    int32_t steps;            /* depths drafted, 1..TREE_MAX_STEPS */
    int32_t topk;             /* children per expanded node and frontier width, 1..TREE_MAX_TOPK */
    int32_t num_draft_tokens; /* nodes of the finished tree, root included, 2..TREE_MAX_NODES */
} tree_params;

/* Names the offending parameter and its range. */
int tree_params_check(const tree_params *p, ae_error *err);

typedef struct tree_cand {
    int32_t token;  /* target vocabulary id */
    int32_t parent; /* pool index, -1 = the root */
    int32_t depth;  /* 1 = a child of the root */
    float p;        /* the head's probability of token given its parent */
    float score;    /* product of p along the path from the root */
} tree_cand;

typedef struct tree_build {
    tree_params params;
    int32_t root_token;
    int32_t depth; /* tree_expand calls so far */
    int32_t n_pool;
    tree_cand pool[TREE_MAX_POOL];
    int32_t n_frontier;
    int32_t frontier[TREE_MAX_TOPK]; /* pool indices; -1 = the root */
} tree_build;

/* A finished tree (plain data; what the verifier takes). */
typedef struct tree_out {
    int32_t n;                       /* nodes, root included (>= 1) */
    int32_t tokens[TREE_MAX_NODES];  /* node 0 is the root */
    int32_t parents[TREE_MAX_NODES]; /* -1 for the root, else an earlier node */
    float probs[TREE_MAX_NODES];     /* p of each node given its parent (1 for the root) */
} tree_out;

/* p must pass tree_params_check. */
void tree_begin(tree_build *b, const tree_params *p, int32_t root_token);

/* True after `steps` expansions. */
bool tree_done(const tree_build *b);

/* The children of every frontier node, k per node (k <= topk; fewer when
 * the head's vocabulary is smaller): tokens[i * k + j] and probs[i * k + j]
 * for frontier node i, best first. A probability that is NaN or negative
 * counts as 0. */
void tree_expand(tree_build *b, int32_t k, const int32_t *tokens, const float *probs);

void tree_finish(const tree_build *b, tree_out *out);

#endif
