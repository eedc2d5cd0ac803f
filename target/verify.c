#include "verify.h"

int32_t verify_greedy(const verify_tree *t, int32_t *path, int32_t *bonus) {
    int32_t n_path = 0, cur = 0;
    path[n_path++] = 0;
    for (;;) {
        int32_t want = sample_greedy(t->logits + (size_t)cur * (size_t)t->vocab, t->vocab), next = -1;
        for (int32_t i = cur + 1; i < t->n; i++)
            if (t->parents[i] == cur && t->tokens[i] == want) {
                next = i;
                break;
            }
        if (next < 0) {
            *bonus = want;
            return n_path;
        }
        path[n_path++] = cur = next;
    }
}

int32_t verify_sample(const verify_tree *t, sampler *s, const sample_params *p, sample_rng *rng, float *probs,
                      int32_t *path, int32_t *bonus) {
    if (sample_is_greedy(p)) return verify_greedy(t, path, bonus);
    AE_ASSERT(sample_vocab(s) == t->vocab); /* probs holds one row of the sampler's vocabulary */
    int32_t n_path = 0, cur = 0;
    path[n_path++] = 0;
    for (;;) {
        sample_dist_dense(s, t->logits + (size_t)cur * (size_t)t->vocab, p, probs);
        int32_t next = -1;
        for (int32_t i = cur + 1; i < t->n && next < 0; i++) {
            if (t->parents[i] != cur) continue;
            int32_t x = t->tokens[i];
            if (x < 0 || x >= t->vocab || !(probs[x] > 0.0f)) continue;
            /* The mass still in play, summed afresh so rounding does not
             * build up over rejections. */
            double mass = 0;
            for (int32_t v = 0; v < t->vocab; v++) mass += probs[v];
            if (sample_rng_uniform(rng) * mass < (double)probs[x])
                next = i;
            else
                probs[x] = 0.0f;
        }
        if (next < 0) {
            *bonus = sample_from_weights(probs, t->vocab, rng);
            return n_path;
        }
        path[n_path++] = cur = next;
    }
}
