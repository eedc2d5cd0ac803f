#include "penalty.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct penalty {
    penalty_params p;
    int32_t vocab;
    int32_t generated;
    int32_t *count;     /* [vocab]: times generated */
    uint8_t *in_prompt; /* [vocab]: 1 when in the prompt (repetition only) */
    int32_t *seen;      /* [vocab]: distinct ids generated or in the prompt, in first-seen order */
    int32_t n_seen;
    uint8_t *listed; /* [vocab]: 1 when in seen */
};

bool penalty_active(const penalty_params *p) {
    return p->presence != 0.0f || p->frequency != 0.0f || p->repetition != 1.0f || p->min_tokens > 0 || p->n_bias > 0;
}

int penalty_check(const penalty_params *p, int32_t vocab, ae_error *err) {
    if (!(p->presence >= -2.0f && p->presence <= 2.0f))
        return err_set(err, "presence_penalty %g is out of range (-2..2)", (double)p->presence);
    if (!(p->frequency >= -2.0f && p->frequency <= 2.0f))
        return err_set(err, "frequency_penalty %g is out of range (-2..2)", (double)p->frequency);
    if (!(p->repetition > 0.0f && isfinite(p->repetition)))
        return err_set(err, "repetition_penalty %g must be > 0", (double)p->repetition);
    if (p->min_tokens < 0) return err_set(err, "min_tokens %d must be >= 0", p->min_tokens);
    if (p->n_stop < 0 || p->n_stop > PENALTY_MAX_STOP || p->n_bias < 0 || p->n_bias > PENALTY_MAX_BIAS)
        return err_set(err, "%d stop ids, %d biases (at most %d, %d)", p->n_stop, p->n_bias, PENALTY_MAX_STOP,
                       PENALTY_MAX_BIAS);
    for (int32_t i = 0; i < p->n_stop; i++)
        if (p->stop[i] < 0 || p->stop[i] >= vocab)
            return err_set(err, "stop id %d is not in the vocabulary of %d", p->stop[i], vocab);
    for (int32_t i = 0; i < p->n_bias; i++) {
        if (p->bias_id[i] < 0 || p->bias_id[i] >= vocab)
            return err_set(err, "logit_bias names token %d, not in the vocabulary of %d", p->bias_id[i], vocab);
        if (!(p->bias[i] >= -100.0f && p->bias[i] <= 100.0f))
            return err_set(err, "logit_bias of token %d is %g (-100..100)", p->bias_id[i], (double)p->bias[i]);
        for (int32_t j = 0; j < i; j++)
            if (p->bias_id[j] == p->bias_id[i]) return err_set(err, "logit_bias names token %d twice", p->bias_id[i]);
    }
    return AE_OK;
}

void penalty_free(penalty *pn) {
    if (!pn) return;
    free(pn->count);
    free(pn->in_prompt);
    free(pn->seen);
    free(pn->listed);
    free(pn);
}

static void see(penalty *pn, int32_t t) {
    if (pn->listed[t]) return;
    pn->listed[t] = 1;
    pn->seen[pn->n_seen++] = t;
}

int penalty_init(penalty **out, const penalty_params *p, int32_t vocab, const int32_t *prompt, int32_t n_prompt,
                 int32_t n_generated, ae_error *err) {
    *out = NULL;
    if (penalty_check(p, vocab, err) != AE_OK) return AE_ERR;
    if (n_generated < 0 || n_generated > n_prompt)
        return err_set(err, "%d generated tokens of a prompt of %d", n_generated, n_prompt);
    for (int32_t i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= vocab) return err_set(err, "token %d is not in the vocabulary", prompt[i]);
    penalty *pn = calloc(1, sizeof *pn);
    if (!pn) return err_set(err, "out of memory");
    pn->p = *p;
    pn->vocab = vocab;
    pn->count = calloc((size_t)vocab, sizeof *pn->count);
    pn->in_prompt = calloc((size_t)vocab, 1);
    pn->seen = malloc((size_t)vocab * sizeof *pn->seen);
    pn->listed = calloc((size_t)vocab, 1);
    if (!pn->count || !pn->in_prompt || !pn->seen || !pn->listed) {
        penalty_free(pn);
        return err_set(err, "out of memory for a request's penalties (%d-entry vocabulary)", vocab);
    }
    int32_t n_first = n_prompt - n_generated;
    for (int32_t i = 0; i < n_first; i++) {
        pn->in_prompt[prompt[i]] = 1;
        if (p->repetition != 1.0f) see(pn, prompt[i]);
    }
    for (int32_t i = n_first; i < n_prompt; i++) penalty_push(pn, prompt[i]);
    *out = pn;
    return AE_OK;
}

void penalty_push(penalty *pn, int32_t token) {
    AE_ASSERT(token >= 0 && token < pn->vocab);
    pn->count[token]++;
    pn->generated++;
    see(pn, token);
}

int32_t penalty_generated(const penalty *pn) { return pn->generated; }

const float *penalty_apply(const penalty *pn, const float *row, float *scratch) {
    const penalty_params *p = &pn->p;
    bool mask = pn->generated < p->min_tokens;
    if (!mask && p->n_bias == 0 && pn->n_seen == 0) return row;
    memcpy(scratch, row, (size_t)pn->vocab * sizeof *scratch);
    if (mask)
        for (int32_t i = 0; i < p->n_stop; i++) scratch[p->stop[i]] = -INFINITY;
    for (int32_t i = 0; i < p->n_bias; i++) scratch[p->bias_id[i]] += p->bias[i];
    const float r = p->repetition;
    for (int32_t i = 0; i < pn->n_seen; i++) {
        int32_t t = pn->seen[i];
        float x = scratch[t];
        if (r != 1.0f) x = x > 0.0f ? x / r : x * r; /* every seen id is in the prompt or the output */
        int32_t c = pn->count[t];
        if (c > 0) x = x - p->frequency * (float)c - p->presence;
        scratch[t] = x;
    }
    return scratch;
}
