/* Speculative decoding on the target: draft trees in, verified tokens out.
 *
 * Per sequence the target keeps a root: the last token decided (sampled,
 * or the last prompt token) whose KV is not written yet. A step:
 *
 *   1. asks the drafter, for every sequence at once, for a tree under its
 *      root, telling it the pairs committed since the last call
 *      (feature captured at position j, token at j + 1);
 *   2. runs one engine step over all the trees (ENGINE_TREE), capturing the
 *      EAGLE-3 features of every node;
 *   3. accepts per sequence (verify.h): a drafted token is kept when it is
 *      the target's own argmax or keyed draw at its position, so the
 *      tokens are plain decoding's whatever the draft proposed;
 *   4. commits the accepted path's KV, keeps its features for the next
 *      call, and makes the bonus token the new root.
 *
 * A sequence without a tree (no drafter, a drafter that failed or sent a
 * bad tree, nothing fed yet, a pause after failures) verifies its root alone: a one-node tree is
 * a plain decode step, with the same bits (batch invariance), so greedy
 * output never depends on the draft. Chains are trees like any other.
 *
 * The drafter is an interface (services/spec/spec_drafter.h): in one
 * process it calls draft/drafter.h; the services put the RPC link behind
 * it. Trees from it are checked like input from the network. */
#ifndef AERIE_TARGET_SPEC_H
#define AERIE_TARGET_SPEC_H

#include <stdbool.h>
#include <stdint.h>

#include "../services/spec/spec_drafter.h"
#include "engine.h"
#include "grammar.h"
#include "penalty.h"
#include "policy.h"
#include "sample.h"

/* Adaptive speculation: the policy (policy.h) picks each step's tree
 * within the configured shape, from a chain to a small tree to none at
 * all, by the tokens per second it expects from the verify pass's cost
 * curve, the drafter's cost and the head's acceptance by depth and rank,
 * all measured on the steps it runs (timed with cfg.clock_ns). Without
 * adaptation every step asks for the configured shape.
 * Plain steps still capture features. While the policy keeps the drafter
 * in step (policy_keep_drafter: a tree comes near paying), prompts and,
 * every SPEC_FEED_AT plain steps, the pending pairs are fed to it without
 * asking for trees; otherwise, when drafting comes back, the drafter is
 * reset with the last ENGINE_MAX_TREE pairs (as after a failure).
 *
 * Sampled sequences follow the policy like greedy ones: their draws are
 * keyed by (seed, choice, position) (sample.h), so neither the tree nor
 * the choice to draft at all changes their tokens. */

typedef struct spec_config {
    int32_t n_capture;                    /* FORWARD_MAX_CAPTURE */
    int32_t capture[FORWARD_MAX_CAPTURE]; /* target layers whose input is captured */
    spec_shape shape;
    int32_t max_seqs;         /* the engine's */
    int32_t max_batch_tokens; /* the engine's */
    bool adaptive;            /* the policy picks each step's tree (above); shape bounds it */
    /* The clock steps are timed with for the policy (tests give their
     * own); NULL: the monotonic clock. */
    int64_t (*clock_ns)(void *ctx);
    void *clock_ctx;
} spec_config;

/* The one place spec_config's defaults live: the given tree shape and the
 * engine's limits, EAGLE-3's FORWARD_MAX_CAPTURE capture layers (all 0:
 * the caller names them, with draft_link_capture or
 * capture_default_layers), a fixed shape (no adaptation) and the
 * monotonic clock. Callers change the fields they need after it. */
spec_config spec_config_default(spec_shape shape, int32_t max_seqs, int32_t max_batch_tokens);

#define SPEC_MAX_DEPTH ENGINE_MAX_TREE

typedef struct spec_stats {
    int64_t steps;             /* steps that verified a drafted tree */
    int64_t plain_steps;       /* steps that verified the root alone */
    int64_t drafted;           /* drafted nodes verified (roots not counted) */
    int64_t accepted;          /* drafted tokens accepted */
    int64_t emitted;           /* tokens out: accepted + one bonus per step */
    int64_t bad_trees;         /* trees refused (malformed, wrong root) */
    int64_t draft_failures;    /* propose calls that failed (total only) */
    int64_t state_gone;        /* sequences the drafter had lost, reset on the next call */
    int64_t adapt_plain_steps; /* plain steps the policy chose, probes included (total only) */
    int64_t adapt_off;         /* times the policy's choice went from a tree to plain (total only) */
    int64_t explore_steps;     /* steps the policy ran to measure, settling included (total only) */
    int64_t draft_ns;          /* time in the drafter (propose calls of steps) */
    int64_t verify_ns;         /* time in the verify pass, acceptance and commit */
    int64_t explore_ns;        /* of draft_ns + verify_ns, the steps the policy ran to measure (total only) */
    int64_t feed_ns; /* time feeding the drafter outside steps: prompts, and plain steps' pairs (total only) */
    int64_t accepted_at[SPEC_MAX_DEPTH]; /* [d]: steps that accepted a token at depth d + 1 */
} spec_stats;

/* Mean acceptance length: (accepted + steps) / steps over speculative
 * steps (0 when there were none). */
double spec_stats_accept_len(const spec_stats *st);

typedef struct spec spec;

/* e and d (NULL: no drafter) must outlive the spec. */
int spec_init(spec **out, engine *e, const spec_drafter *d, const spec_config *cfg, ae_error *err);
void spec_free(spec *s); /* NULL is a no-op */
/* Bytes spec_init takes beyond what the memory plan's per-token workspace
 * already counts (a step's logits and captured features): per sequence
 * its state and the features of up to ENGINE_MAX_TREE pairs waiting for the
 * drafter. */
size_t spec_bytes(const model *m, const spec_config *cfg);

/* Starts a fresh engine sequence (length 0) on prompt[n]: prefills all
 * but the last token in chunks of at most `chunk`, feeding the drafter as
 * it goes; the last token becomes the root. */
int spec_seq_start(spec *s, int32_t seq, const int32_t *prompt, int32_t n, int32_t chunk, ae_error *err);

/* The same one chunk at a time, for a scheduler that runs other steps in
 * between: *done is the prompt tokens prefilled so far (0 to begin with a
 * fresh engine sequence); the call prefills the next chunk and advances
 * it. The sequence is ready for spec_step once *done == n - 1. Unless
 * always_feed, the prompt is not sent to the drafter while the policy
 * runs plainly (spec_seq_start always sends it). */
int spec_seq_prefill(spec *s, int32_t seq, const int32_t *prompt, int32_t n, int32_t chunk, int32_t *done,
                     bool always_feed, ae_error *err);
void spec_seq_end(spec *s, int32_t seq); /* tells the drafter to drop its state */
/* dst (a fresh engine sequence forked from src, engine_seq_fork) continues
 * from where src is: the same root and pairs waiting for the drafter, and
 * at the drafter a copy of src's state, taken on dst's first call there
 * (spec_feed.fork). OpenAI's n choices of one prompt. */
int spec_seq_fork(spec *s, int32_t src, int32_t dst, ae_error *err);

typedef struct spec_in {
    int32_t seq;
    const sample_params *params;
    const sample_rng *rng; /* the key of its draws (sample.h) */
    /* The sequence's penalties and biases (penalty.h), or NULL; each token
     * decided is pushed to it. */
    penalty *pen;
    /* The sequence's grammar (grammar.h), or NULL: each row decided at is
     * masked to the tokens it allows next, and each token decided is
     * taken by it. */
    grammar_matcher *gm;
    /* Each token's log-probability, and the top_logprobs
     * (0..SAMPLE_MAX_TOP_LOGPROBS) most likely tokens at its position
     * (sample_logprobs: the target's raw row, before penalties and
     * temperature). */
    bool logprobs;
    int32_t top_logprobs;
} spec_in;

typedef struct spec_out {
    int32_t n;                           /* tokens decided this step, >= 1 */
    int32_t tokens[ENGINE_MAX_TREE + 1]; /* accepted drafted tokens, then the bonus */
    int32_t drafted;                     /* nodes proposed besides the root */
    bool refused;                        /* the grammar refused a token decided (it allowed none) */
    /* With logprobs: token j's log-probability, and n_top tokens
     * with theirs. A token's row is the one of the tree node it was
     * decided at, which is plain decoding's row bit for bit (batch
     * invariance), so the values are plain decoding's. */
    float logprob[ENGINE_MAX_TREE + 1];
    int32_t n_top;
    sample_logprob top[ENGINE_MAX_TREE + 1][SAMPLE_MAX_TOP_LOGPROBS];
} spec_out;

/* One step for n sequences. Fails (nothing changed) only on a bad input
 * or when the KV cache is full. */
int spec_step(spec *s, const spec_in *in, int32_t n, spec_out *out, ae_error *err);

/* New bounds (or the fixed shape); the policy starts over. */
void spec_set_shape(spec *s, const spec_shape *shape);
/* The policy's choice and the figures behind it, for batches of n (n <= 0:
 * the last step's); zeros without a drafter. */
void spec_policy_report(const spec *s, int32_t n, policy_report *r);
const spec_stats *spec_seq_stats(const spec *s, int32_t seq);
const spec_stats *spec_total_stats(const spec *s);

#endif
