/* Many sequences generated together on one engine: the data generator
 * behind `aerie gen-prompts` and `aerie dump-features`.
 *
 * Sequences come from the caller one at a time (next) and go back to it as
 * each finishes (done), so any number of them stream through max_seqs
 * engine slots. Every step packs one decode token of each sequence that is
 * generating and fills the rest of the pass with prompt chunks.
 *
 * Optionally it records what EAGLE-3 training needs, per token t of a
 * sequence: the captured target features of t (the input of the chosen
 * layers, f16) and the target's K most likely tokens after t with their
 * probabilities (f16, at temperature 1 over the full vocabulary, most
 * likely first). Features exist for every token the engine ran (all but
 * the last); top-K for the tokens from the last prompt token on. Rows that
 * have none stay as the caller left them. */
#ifndef AERIE_CLI_BATCHGEN_H
#define AERIE_CLI_BATCHGEN_H

#include <stdbool.h>
#include <stdint.h>

#include "../target/engine.h"
#include "../target/sample.h"

typedef struct batchgen_seq {
    /* Set by the caller. */
    int64_t index;    /* the caller's own number for it */
    int32_t *ids;     /* [cap]: the prompt, then what is generated */
    int32_t n_prompt; /* >= 1 */
    int32_t cap;      /* n_prompt + the most tokens to generate */
    sample_params sp;
    sample_rng rng;
    uint16_t *hidden;  /* [cap][n_capture * hidden] or NULL */
    int32_t *topk_ids; /* [cap][topk] or NULL */
    uint16_t *topk_p;  /* [cap][topk] or NULL */
    /* Set by the generator. */
    int32_t n;    /* tokens in ids */
    bool stopped; /* ended on the stop token, which is ids[n - 1] */
    bool done;    /* handed back through batchgen_done_fn: the caller's again */
    /* Private. */
    int32_t eng_seq, fed;
} batchgen_seq;

typedef struct batchgen_config {
    int32_t max_seqs;    /* sequences in flight; the engine's plan must hold them */
    int32_t step_tokens; /* tokens in one pass, at most the engine's max_batch_tokens */
    int32_t stop;        /* token that ends a sequence, -1: none */
    int32_t n_capture;   /* 0: no features */
    int32_t capture[FORWARD_MAX_CAPTURE];
    int32_t topk; /* 0: no top-K */
} batchgen_config;

/* Hands out the next sequence (*s, its ids holding the prompt), or sets *s
 * to NULL when there is none to start now (asked again once a sequence
 * finishes), or returns false when there are no more. */
typedef bool (*batchgen_next_fn)(void *ctx, batchgen_seq **s);
/* Takes a finished sequence back; AE_ERR stops the run with err. */
typedef int (*batchgen_done_fn)(void *ctx, batchgen_seq *s, ae_error *err);

/* Runs until next has nothing more and every sequence is done. */
int batchgen_run(engine *e, const batchgen_config *cfg, batchgen_next_fn next, batchgen_done_fn done, void *ctx,
                 ae_error *err);

/* The k most likely tokens of softmax(logits) f32 [vocab], most likely
 * first (equal probability: lower id first), into ids and probs [k]. */
void batchgen_topk(const float *logits, int32_t vocab, int32_t k, int32_t *ids, float *probs);

#endif
