/* Perplexity and divergence from a reference, scored the way
 * llama-perplexity scores a text (`aerie perplexity`, cli/perplexity.c).
 *
 * Windows: the text's tokens are cut into n / ctx windows of ctx tokens
 * each, back to back, the tail that does not fill a window dropped. Each
 * window is evaluated from an empty context, and only its second half is
 * scored: the logits at positions first = ctx / 2 .. ctx - 2 predict the
 * tokens at first + 1 .. ctx - 1, so every scored token has at least ctx / 2
 * tokens of context. A window scores ctx - 1 - ctx / 2 tokens.
 *
 * The base: reference log-probabilities (tools/gen_ppl_base.py writes them
 * from f32 transformers). A full-vocabulary row is 49152 f32, 196 KB per
 * position, too much to commit for 10k positions; the base keeps, for each
 * scored position, the top K tokens' log-probabilities, the log of the mass
 * outside them and the log-probability of the token that came. File layout,
 * all little-endian:
 *
 *   char     magic[8]   "AEPPLB01"
 *   u32      vocab, ctx, windows, top_k, flags (bit 0: each window's first
 *            token was replaced by BOS)
 *   i32      tokens[windows][ctx]   each window as the model saw it
 *   then for each scored position, window by window in order:
 *   f32      logp_next   log p(the token that came)
 *   f32      log_rest    log of the mass outside ids[] (-inf: none)
 *   i32      ids[top_k]  by log-probability descending, ties by lower id
 *   f32      logp[top_k]
 *
 * KL divergence KL(base || model) at a position is taken over K + 1 bins:
 * the K base tokens, and "any other token", whose model mass is the model's
 * probability summed over every token not in ids[]. This coarsening of the
 * full-vocabulary KL never exceeds it (the log-sum inequality) and equals it
 * when the two distributions have the same shape outside the top K
 * (docs/accuracy.md: how much mass the top 32 hold). top1 agreement compares the model's argmax (lowest id on
 * ties) with ids[0]. kld_p99 is the nearest-rank 99th percentile: the
 * ceil(0.99 n)-th smallest value. */
#ifndef AERIE_TARGET_PPL_H
#define AERIE_TARGET_PPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../services/core/err.h"

#define PPL_MIN_CTX 4 /* a window must score at least one token */
#define PPL_MAX_TOP_K 1024
#define PPL_FLAG_BOS 1u

typedef struct ppl_windows {
    int32_t ctx;
    int32_t n_windows;
    int32_t first;  /* first scored logit row of a window (ctx / 2) */
    int32_t scored; /* tokens scored per window (ctx - 1 - first) */
} ppl_windows;

/* The windows of a text of n_tokens tokens. Fails with a clear message
 * when ctx < PPL_MIN_CTX or the text does not fill one window. */
int ppl_windows_plan(int64_t n_tokens, int32_t ctx, ppl_windows *w, ae_error *err);

typedef struct ppl_base ppl_base;

/* Reads and checks a base file: magic, header bounds, and a size that is
 * exactly what the header promises. */
int ppl_base_open(ppl_base **out, const char *path, ae_error *err);
void ppl_base_close(ppl_base *b); /* NULL is a no-op */

/* Checks that the base was made for these windows of these tokens (the
 * windows as the model sees them: [n_windows][ctx]) and this vocabulary;
 * the error names the first difference. */
int ppl_base_check(const ppl_base *b, const ppl_windows *w, int32_t vocab, const int32_t *tokens, ae_error *err);

/* One scored position of the base: i counts scored positions from 0. */
typedef struct ppl_ref {
    float logp_next;
    float log_rest;
    int32_t top_k;
    const int32_t *ids; /* [top_k] */
    const float *logp;  /* [top_k] */
} ppl_ref;

int64_t ppl_base_positions(const ppl_base *b);
ppl_ref ppl_base_ref(const ppl_base *b, int64_t i);

/* Accumulates the scores of positions. Holds scratch sized for the
 * vocabulary and room for max_positions divergences; a call to
 * ppl_score_add allocates nothing. */
typedef struct ppl_scorer ppl_scorer;

int ppl_scorer_init(ppl_scorer **out, int32_t vocab, int64_t max_positions, ae_error *err);
void ppl_scorer_free(ppl_scorer *s); /* NULL is a no-op */

/* Scores one row of logits [vocab] that predicts `next`; with ref, also its
 * divergence from the base. Fails past max_positions. */
int ppl_score_add(ppl_scorer *s, const float *logits, int32_t next, const ppl_ref *ref, ae_error *err);

typedef struct ppl_result {
    int64_t tokens;  /* positions scored */
    double nll_sum;  /* -sum log p(next), natural log */
    double ppl;      /* exp(nll_sum / tokens) */
    bool has_ref;    /* every position had a ref */
    double base_ppl; /* exp(-mean logp_next of the base) */
    double kld_mean;
    double kld_p99;
    double top1_agree; /* fraction of positions whose argmax is the base's */
} ppl_result;

/* The figures so far. Sorts the divergences (for the percentile). */
ppl_result ppl_scorer_result(ppl_scorer *s);

#endif
