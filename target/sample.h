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
 * Random numbers are keyed, not streamed: the draw for the token at
 * position pos of a sequence (its index in prompt + output) is a pure
 * function of (seed, choice, pos) and the distribution there, whatever
 * was drawn before and however many positions one pass decides. So a
 * seeded sequence is the same token for token with or without a draft
 * tree, for any tree and any batch (verify.h accepts a drafted token only
 * when it is this draw). The draw is an exponential race, the Gumbel-max
 * trick with G = -ln E: each kept token i gets E_i = -ln U_i, U_i uniform
 * from a counter-based hash of (seed, choice, pos, i), and the token with
 * the least E_i / w_i wins (w_i its unnormalised weight), which is token
 * i with probability w_i / sum w (exactly, but for the f32 rounding of
 * w_i and E_i). It costs one hash, one short
 * log polynomial and one division per kept token (the kept set only: ids
 * come in ascending order, so the draw depends only on the
 * distribution), in SIMD where the CPU has it, with the same bits on
 * every path (kn_cpu_limit_simd pins it). A sampler holds scratch sized
 * for the vocabulary at init; no call allocates afterwards. A sampler is
 * not shared between threads at once. */
#ifndef AERIE_TARGET_SAMPLE_H
#define AERIE_TARGET_SAMPLE_H

#include <stdbool.h>
#include <stdint.h>

#include "../kernels/kernels.h"
#include "../services/core/err.h"

typedef struct sample_params {
    float temperature; /* <= 0: greedy */
    int32_t top_k;     /* <= 0: off */
    float top_p;       /* >= 1: off */
    float min_p;       /* <= 0: off */
} sample_params;

/* The key of a sequence's random numbers (plain data on purpose: it
 * lives in the request). */
typedef struct sample_rng {
    uint64_t seed;
    uint32_t choice; /* which of a request's choices (OpenAI n), 0.. */
} sample_rng;

/* Key seed, choice 0. */
void sample_rng_seed(sample_rng *rng, uint64_t seed);
/* The uniform in (0, 1) that vocabulary entry id gets at position pos, and
 * its exponential E = -ln U as the draws compute it: within 3e-7
 * relative for E <= 1, where races are decided, and within 3 * 2^-25 / U
 * beyond (U rounded to f32). Pure functions of their arguments. */
double sample_rng_uniform(const sample_rng *rng, int32_t pos, int32_t id);
float sample_rng_exp(const sample_rng *rng, int32_t pos, int32_t id);

/* True when p selects greedy decoding (temperature <= 0). */
bool sample_is_greedy(const sample_params *p);

/* Whether a device can draw with p (kernels.h kn_sample): greedy, or
 * sampling without top-p and with top-k off or within KN_TOPK_MAX. */
bool sample_on_device(const sample_params *p);
/* kn_sample's draw of sample_token(p, rng, pos); greedy reads no rng. */
kn_draw sample_draw(const sample_params *p, const sample_rng *rng, int32_t pos);

/* argmax of logits f32 [vocab]; lowest id among equal maxima; NaN never
 * wins (a row of NaN: 0). The same pick as kn_argmax, which greedy steps
 * run on the device instead (engine_step with ids): an all -inf row picks 0,
 * [NaN, -inf, -inf] picks 1. */
int32_t sample_greedy(const float *logits, int32_t vocab);

/* OpenAI's limit on top_logprobs. */
#define SAMPLE_MAX_TOP_LOGPROBS 20

typedef struct sample_logprob {
    int32_t id;
    float logprob;
} sample_logprob;

/* The log-probability of token under the raw logits f32 [vocab] (the
 * log-softmax before temperature, filters and penalties: what vLLM
 * reports by default, raw_logprobs), and in top[0..k) the k most likely
 * tokens, best first, the lower id first among equal logits. In double:
 * m = the largest logit, lse = m + ln(sum over ids in order of
 * e^(x - m)), and a token's value is (float)(x - lse). It is a function
 * of the row alone, so equal rows give equal bits: a verified tree
 * node's row is the plain decode's (kernels.h, batch invariance). NaN
 * counts as -inf; the row must hold a finite logit; k <= vocab and
 * k <= SAMPLE_MAX_TOP_LOGPROBS. */
float sample_logprobs(const float *logits, int32_t vocab, int32_t token, int32_t k, sample_logprob *top);

typedef struct sample_state sample_state;

int sample_init(sample_state **out, int32_t vocab, ae_error *err);
void sample_free(sample_state *s); /* NULL is a no-op */
int32_t sample_vocab(const sample_state *s);

/* The filtered distribution for logits f32 [vocab]: *ids and *probs point
 * at int32 [n] and f32 [n] inside the sampler (valid until its next call),
 * probs summing to 1, in ascending id order (so a draw depends only on the
 * distribution, not on how the filters found it). Greedy gives one token
 * with probability 1. Returns n >= 1. */
int32_t sample_dist(sample_state *s, const float *logits, const sample_params *p, const int32_t **ids,
                    const float **probs);

/* The same distribution written densely: probs f32 [vocab], 0 for every
 * filtered token (the exact distribution, for tests). */
void sample_dist_dense(sample_state *s, const float *logits, const sample_params *p, float *probs);

/* The token at position pos: greedy when p says so (rng not read),
 * otherwise the keyed draw from sample_dist's distribution. */
int32_t sample_token(sample_state *s, const float *logits, const sample_params *p, const sample_rng *rng, int32_t pos);

#endif
