/* What the target asks of a drafter, and what it gets back: the contract
 * between target/ (spec.h, which asks) and whatever drafts (draft/, in
 * this process through draft/draft_link.h, or over the RPC link through
 * target/draft_client.h). Both sides include this, so that neither
 * includes the other. */
#ifndef AERIE_SPEC_SPEC_DRAFTER_H
#define AERIE_SPEC_SPEC_DRAFTER_H

#include <stdbool.h>
#include <stdint.h>

#include "../core/err.h"

/* The tree a step asks for: EAGLE-2's parameters (draft/tree.h). tokens
 * 1: none (steps and topk are then 0). */
typedef struct spec_shape {
    int32_t steps;
    int32_t topk;
    int32_t tokens; /* nodes, root included */
} spec_shape;

#define SPEC_MAX_TREE 64 /* nodes in one tree (the target's ENGINE_MAX_TREE) */

typedef struct spec_tree {
    int32_t n;                      /* nodes, root included; 0 = none */
    int32_t tokens[SPEC_MAX_TREE];  /* node 0 must be the root */
    int32_t parents[SPEC_MAX_TREE]; /* -1 for the root, else 0 <= parent < i */
    float probs[SPEC_MAX_TREE];     /* the draft's p of each node given its parent */
} spec_tree;

/* What the drafter is told about one sequence. A drafter that does not
 * hold exactly `start` pairs for seq (it restarted, evicted the state, or
 * missed a call) must fail the call; the target then resets the sequence
 * there with the pairs it still has. */
typedef struct spec_feed {
    int32_t seq;           /* the engine's sequence id */
    bool reset;            /* drop any state held for seq, then take these pairs */
    int32_t start;         /* pairs the drafter holds for seq before this feed (0 with reset) */
    int32_t n;             /* pairs */
    const int32_t *tokens; /* [n] */
    const float *features; /* [n][feature_width] */
    bool want_tree;
    /* Start seq from what the drafter holds for fork_of (another choice
     * of the same prompt, OpenAI's n), which must be `start` pairs, as it
     * was before any feed of this call; then take these pairs. Without
     * that state the sequence is gone (SPEC_STATE_GONE). */
    bool fork;
    int32_t fork_of;
} spec_feed;

#define SPEC_STATE_GONE (-1)
/* What propose returns when no drafter is reachable at all (a link that is
 * down and reconnecting): asking costs nothing, so the calls pause one step
 * without backing off, and speculation resumes as soon as it is back. */
#define SPEC_DRAFT_DOWN 1

typedef struct spec_drafter {
    void *ctx;
    /* trees[i] for feeds[i] (n = 0: none; n = SPEC_STATE_GONE: the drafter
     * no longer holds what the feed assumed, so the sequence is reset there
     * on its next call, without a pause). A failure drafts nothing this
     * step; decoding goes on without, the calls pause (1, 2, 4 .. 64
     * steps after consecutive failures), and then every sequence of the
     * failed call is reset at the drafter with the pairs of its last
     * SPEC_MAX_TREE committed tokens (a shorter history costs acceptance,
     * never correctness; RoPE sees only relative positions). */
    int (*propose)(void *ctx, const spec_feed *feeds, int32_t n, const spec_shape *shape, spec_tree *trees,
                   ae_error *err);
    void (*release)(void *ctx, int32_t seq);
} spec_drafter;

#endif
