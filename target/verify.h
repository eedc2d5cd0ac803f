/* Accepting a verified tree: which drafted tokens the target keeps.
 *
 * The tree is the one the engine verified (ENGINE_TREE): node 0 is the root,
 * the last token already decided, and node i > 0 has parent parents[i] < i.
 * logits[i] is the target's row at node i, i.e. its prediction for the
 * token after node i. The output is the target's own:
 *
 *   - greedy: from the root, follow the child whose token equals the
 *     target's argmax at the current node (the first such child in node
 *     order); the bonus is the argmax at the last accepted node. Each
 *     emitted token is the argmax after its prefix, exactly what plain
 *     greedy decoding emits.
 *   - sampling: the same walk with the target's keyed draw (sample.h)
 *     in place of the argmax: at the current node, at depth d under the
 *     root, the draw for position pos + d from the target's filtered
 *     distribution there (temperature, top-k, top-p, min-p); the first
 *     child carrying that token is accepted, and when none does, the draw
 *     is the bonus. Every emitted token is thus the draw plain decoding
 *     makes at its position, whatever the draft proposed: a child x is
 *     accepted with probability P(x), and some child with the sum of the
 *     children's P, as in rejection sampling against a one-hot draft.
 *
 * path[0] = 0 (the root), then the accepted nodes, each the child of the
 * one before; its length is returned (1 + accepted draft tokens). */
#ifndef AERIE_TARGET_VERIFY_H
#define AERIE_TARGET_VERIFY_H

#include <stdint.h>

#include "sample.h"

/* What a sequence's own rules make of a row (penalties, biases, and later
 * a grammar's mask): the walk asks for the row of each node it decides
 * at, and pushes each token it decides, so the rules follow the path
 * being accepted and see nothing of the branches left aside. Only the
 * nodes on that path are processed (lazily), never the whole tree. */
typedef struct verify_proc {
    void *ctx;
    /* The row to decide with after the path so far, given the target's
     * raw row: row itself, or a copy the rules changed. */
    const float *(*apply)(void *ctx, const float *row);
    /* token was decided after the path so far. */
    void (*push)(void *ctx, int32_t token);
} verify_proc;

typedef struct verify_tree {
    int32_t n;              /* nodes, root included, >= 1 */
    const int32_t *tokens;  /* [n] */
    const int32_t *parents; /* [n] */
    const float *logits;    /* [n][vocab] */
    int32_t vocab;
    const verify_proc *proc; /* NULL: the raw rows decide */
    /* [n] the token decided at each row, computed where the pass ran:
     * greedy's argmax (engine_step's ids) or the keyed draw at the row's
     * position (engine_step's draws), read instead of logits when there is
     * no proc (logits are then not read at all); NULL: from logits. */
    const int32_t *argmax;
} verify_tree;

int32_t verify_greedy(const verify_tree *t, int32_t *path, int32_t *bonus);

/* pos: the position of the token after the root (the root's + 1). Greedy
 * parameters give verify_greedy's answer and read no rng. */
int32_t verify_sample(const verify_tree *t, sample_state *s, const sample_params *p, const sample_rng *rng, int32_t pos,
                      int32_t *path, int32_t *bonus);

#endif
