/* Penalties and biases on a sequence's logits: OpenAI's presence_penalty,
 * frequency_penalty and logit_bias, and the extensions repetition_penalty
 * and min_tokens.
 *
 * A row is changed in this order, which is vLLM V1's (its logits
 * processors, then its penalties), before temperature and the filters of
 * sample.h:
 *
 *   1. min_tokens: while fewer than min_tokens tokens were generated, the
 *      end of sequence and the stop ids are -inf;
 *   2. logit_bias: logit[id] += bias (f32);
 *   3. repetition (r != 1) over every token of the prompt or the output:
 *      logit / r where logit > 0, else logit * r;
 *   4. frequency f and presence p over the output: logit - f * count - p
 *      (count: times the token was generated), in f32 as written.
 *
 * Generated tokens are the output so far, whatever path they took to the
 * target: the tokens a gateway resends after a failover are told apart
 * from the prompt (penalty_init's n_generated), so a retried request is
 * penalised as the first attempt was.
 *
 * Under speculation the state is of one sequence and follows the path
 * being accepted (verify.h): each tree node's row is penalised with the
 * tokens above it, and a token is pushed only once decided. So greedy
 * output with penalties is plain decoding's, and sampled output keeps its
 * distribution.
 *
 * Memory: a count per vocabulary entry (4 bytes each) and the distinct
 * tokens seen, allocated by penalty_init, only for requests that use a
 * penalty or a bias. */
#ifndef AERIE_TARGET_PENALTY_H
#define AERIE_TARGET_PENALTY_H

#include <stdbool.h>
#include <stdint.h>

#include "../services/core/err.h"

#define PENALTY_MAX_BIAS 300 /* logit_bias entries, as OpenAI allows */
#define PENALTY_MAX_STOP 17  /* ids masked under min_tokens: end of sequence + 16 stop ids */

typedef struct penalty_params {
    float presence;   /* -2..2; 0: off */
    float frequency;  /* -2..2; 0: off */
    float repetition; /* > 0; 1: off */
    int32_t min_tokens;
    int32_t n_stop; /* ids that may not end the output before min_tokens */
    int32_t stop[PENALTY_MAX_STOP];
    int32_t n_bias;
    int32_t bias_id[PENALTY_MAX_BIAS]; /* distinct */
    float bias[PENALTY_MAX_BIAS];      /* -100..100 */
} penalty_params;

/* True when p changes some row (a state is worth keeping). */
bool penalty_active(const penalty_params *p);
/* The words for a client when p is out of range or names an id outside
 * [0, vocab); AE_OK when p is usable. */
int penalty_check(const penalty_params *p, int32_t vocab, ae_error *err);

typedef struct penalty penalty;

/* A state for one sequence: prompt[0..n_prompt) of which the last
 * n_generated were generated (a resent output). */
int penalty_init(penalty **out, const penalty_params *p, int32_t vocab, const int32_t *prompt, int32_t n_prompt,
                 int32_t n_generated, ae_error *err);
void penalty_free(penalty *pn); /* NULL is a no-op */

/* The row as the state changes it, in scratch f32 [vocab] (returned), or
 * row itself when nothing changes it. */
const float *penalty_apply(const penalty *pn, const float *row, float *scratch);
/* Token was generated next. */
void penalty_push(penalty *pn, int32_t token);
/* Tokens generated so far. */
int32_t penalty_generated(const penalty *pn);

#endif
