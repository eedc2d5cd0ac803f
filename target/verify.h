/* Accepting a verified tree: which drafted tokens the target keeps.
 *
 * The tree is the one the engine verified (ENG_TREE): node 0 is the root,
 * the last token already decided, and node i > 0 has parent parents[i] < i.
 * logits[i] is the target's row at node i, i.e. its prediction for the
 * token after node i. The output is the target's own:
 *
 *   - greedy: from the root, follow the child whose token equals the
 *     target's argmax at the current node (the first such child in node
 *     order); the bonus is the argmax at the last accepted node. Each
 *     emitted token is the argmax after its prefix, exactly what plain
 *     greedy decoding emits.
 *   - sampling: at the current node take the target's filtered
 *     distribution P (temperature, top-k, top-p, min-p: sample.h). For
 *     each child x in node order, accept it with probability
 *     P(x) / sum(P) (one uniform draw); on rejection set P(x) = 0 and go
 *     on. If no child is accepted, the bonus is drawn from what is left of
 *     P. Each stage draws exactly from P conditioned on the tokens
 *     already rejected, so every emitted token follows the target's
 *     distribution whatever the draft proposed (the draft is treated as
 *     deterministic, q = 1). Children with P(x) = 0 use no draw.
 *
 * path[0] = 0 (the root), then the accepted nodes, each the child of the
 * one before; its length is returned (1 + accepted draft tokens). */
#ifndef AERIE_TARGET_VERIFY_H
#define AERIE_TARGET_VERIFY_H

#include <stdint.h>

#include "sample.h"

typedef struct verify_tree {
    int32_t n;              /* nodes, root included, >= 1 */
    const int32_t *tokens;  /* [n] */
    const int32_t *parents; /* [n] */
    const float *logits;    /* [n][vocab] */
    int32_t vocab;
} verify_tree;

int32_t verify_greedy(const verify_tree *t, int32_t *path, int32_t *bonus);

/* probs: f32 [vocab] scratch. Greedy parameters take verify_greedy. */
int32_t verify_sample(const verify_tree *t, sampler *s, const sample_params *p, sample_rng *rng, float *probs,
                      int32_t *path, int32_t *bonus);

#endif
