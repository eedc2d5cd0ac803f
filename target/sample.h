/* Token sampling: greedy, temperature, top-k, top-p, min-p.
 *
 * The filters run in the order transformers applies its logits warpers
 * (GenerationMixin._get_logits_processor: TemperatureLogitsWarper,
 * TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper), each on the
 * output of the one before, with min_tokens_to_keep = 1:
 *
 *   1. temperature T: s_i = logit_i / T (f32 division). T <= 0 means greedy.
 *   2. top-k (k > 0): keep every token whose s_i >= the k-th largest s
 *      (ties with the k-th value are kept, as torch.topk + `<` does).
 *   3. top-p (p < 1): with q_i = softmax(s) over the tokens kept so far,
 *      sorted by q descending (equal q: lower id first), keep token i while
 *      the mass strictly before it is < p: the smallest prefix whose mass
 *      reaches p.
 *   4. min-p (m > 0): keep tokens with q_i >= m * max q, i.e.
 *      exp(s_i - s_max) >= m (renormalisation does not change the ratio).
 * The top token always survives. Sampling then draws from softmax(s) over
 * the kept set.
 *
 * Greedy is argmax of the raw logits; among equal maxima the lowest id wins.
 *
 * The random stream is xoshiro256** seeded through splitmix64; its state
 * lives in the request (sample_rng), so one seed reproduces one sequence of
 * draws whatever else the server is doing. A sampler holds scratch sized for
 * the vocabulary at init; no call allocates afterwards. A sampler is not
 * shared between threads at once. */
#ifndef AERIE_TARGET_SAMPLE_H
#define AERIE_TARGET_SAMPLE_H

#include <stdbool.h>
#include <stdint.h>

#include "../services/core/err.h"

typedef struct sample_params {
    float temperature; /* <= 0: greedy */
    int32_t top_k;     /* <= 0: off */
    float top_p;       /* >= 1: off */
    float min_p;       /* <= 0: off */
} sample_params;

/* Per-request random state (plain data on purpose: it lives in the request). */
typedef struct sample_rng {
    uint64_t s[4];
} sample_rng;

void sample_rng_seed(sample_rng *rng, uint64_t seed);
uint64_t sample_rng_next(sample_rng *rng);
/* Uniform in [0, 1) with 53 random bits. */
double sample_rng_uniform(sample_rng *rng);

/* True when p selects greedy decoding (temperature <= 0). */
bool sample_is_greedy(const sample_params *p);

/* argmax of logits f32 [vocab]; lowest id among equal maxima; NaN never wins. */
int32_t sample_greedy(const float *logits, int32_t vocab);

typedef struct sampler sampler;

int sample_init(sampler **out, int32_t vocab, ae_error *err);
void sample_free(sampler *s); /* NULL is a no-op */
int32_t sample_vocab(const sampler *s);

/* The filtered distribution for logits f32 [vocab]: *ids and *probs point
 * at int32 [n] and f32 [n] inside the sampler (valid until its next call),
 * probs summing to 1, in ascending id order (so a draw depends only on the
 * distribution, not on how the filters found it). Greedy gives one token
 * with probability 1. Returns n >= 1. */
int32_t sample_dist(sampler *s, const float *logits, const sample_params *p,
                    const int32_t **ids, const float **probs);

/* The same distribution written densely: probs f32 [vocab], 0 for every
 * filtered token. For exact rejection sampling against a draft. */
void sample_dist_dense(sampler *s, const float *logits, const sample_params *p, float *probs);

/* One token: greedy when p says so (rng untouched), otherwise one draw
 * from sample_dist's distribution using one number from rng. */
int32_t sample_token(sampler *s, const float *logits, const sample_params *p, sample_rng *rng);

/* Draws an index from weights f32 [n] (>= 0, not all 0) with one number
 * from rng; for residual distributions in rejection sampling. */
int32_t sample_from_weights(const float *weights, int32_t n, sample_rng *rng);

#endif
