/* The drafter: per-sequence EAGLE-3 state and tree proposals.
 *
 * A sequence's state is the head's KV over the pairs it has been fed and
 * the outcome of the last one: the pre-norm hidden state and the top
 * children it predicts. Each call feeds every sequence the pairs that the
 * target committed since the previous call,
 *
 *   pair j = (captured target feature at position j, token at j + 1),
 *
 * which extends that sequence's KV durably, and then drafts a tree whose
 * root is the token of the last pair fed (the target's last decided
 * token). Drafting expands the tree one depth at a time (tree.h); the
 * frontier nodes of all sequences run through the head in one batch, each
 * node attending to its sequence's pairs, its drafted ancestors and
 * itself. The KV of drafted nodes is scratch, dropped when the tree is
 * done.
 *
 * Keys are the caller's sequence ids, 0 .. max_seqs-1. All memory is
 * taken at drafter_init; a call allocates nothing.
 *
 * It runs on the head's backend (eagle.h). A call sends that backend the
 * pairs' features and each pass's positions and maps, keeps the hidden
 * states there, and brings back only the draft probabilities of the rows
 * it expands (the softmax runs there too). */
#ifndef AERIE_DRAFT_DRAFTER_H
#define AERIE_DRAFT_DRAFTER_H

#include <stdbool.h>
#include <stdint.h>

#include "../services/core/err.h"
#include "eagle.h"
#include "tree.h"

typedef struct drafter_config {
    int32_t max_seqs;    /* keys 0 .. max_seqs-1 */
    int32_t max_seq_len; /* pairs one sequence may hold */
    int32_t max_tokens;  /* pairs in one head pass (longer feeds are split) */
    int32_t threads;     /* of its own pool, when pool is NULL */
    /* A pool to share (not owned), e.g. the target engine's in one
     * process: two pools would spin against each other on the same cores
     * while one of them waits for the other's step. */
    struct pool *pool;
    /* Activation precision of the head's quantized matmuls (a Q8_0 head
     * or its quantized fc/lm_head), 15 or 8 (0: 15; kernels.h). */
    int32_t act_bits;
} drafter_config;

typedef struct drafter_feed {
    int32_t key;
    bool reset;            /* forget the key's state first (a new sequence, or a resync) */
    int32_t start;         /* pairs the caller believes the key holds (checked unless reset) */
    int32_t n;             /* pairs */
    const int32_t *tokens; /* [n] target ids: the token after each feature */
    const float *features; /* [n][3H] */
    bool want_tree;        /* draft a tree after feeding */
    /* >= 0: the key starts as a copy of this key's state (which holds
     * `start` pairs), taken before any feed of the call; reset is false.
     * The copy shares the pairs' KV (kv_seq_fork). -1: none. */
    int32_t fork_of;
} drafter_feed;

typedef struct drafter drafter;

int drafter_init(drafter **out, const eagle_head *h, const drafter_config *cfg, ae_error *err);
void drafter_free(drafter *d); /* NULL is a no-op */

/* Feeds every feed, then drafts trees[i] for each feed with want_tree
 * (trees[i].n = 0 otherwise, and for a sequence that has never been fed a
 * pair). Bad feeds (key out of range, a start that is not what the key
 * holds, token out of range, too long) fail the whole call with err
 * before any state changes. */
int drafter_propose(drafter *d, const drafter_feed *feeds, int32_t n, const tree_params *p, tree_out *trees,
                    ae_error *err);

/* Drops a key's state (its KV goes back to the pool). */
void drafter_release(drafter *d, int32_t key);

/* Pairs held for a key (0 when it has no state). */
int32_t drafter_len(const drafter *d, int32_t key);

/* Bytes drafter_init takes for these sizes, beyond the head's weights:
 * drafter_bytes in the memory of the head's backend (h->be), counting
 * drafter_host_bytes too when that memory is the host's; on any other
 * backend drafter_host_bytes are taken in host memory besides. */
size_t drafter_bytes(const eagle_head *h, const drafter_config *cfg);
size_t drafter_host_bytes(const eagle_head *h, const drafter_config *cfg);

#endif
