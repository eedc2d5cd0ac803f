#include "verify.h"

/* The walk both rules share: the token the target decides after node cur
 * at depth d is greedy's argmax when s is NULL, else the keyed draw; ids
 * decided where the pass ran (t->argmax) are read instead of the rows
 * when nothing processes them. */
static int32_t walk(const verify_tree *t, sample_state *s, const sample_params *p, const sample_rng *rng, int32_t pos,
                    int32_t *path, int32_t *bonus) {
    int32_t n_path = 0, cur = 0;
    path[n_path++] = 0;
    for (;;) {
        int32_t want, next = -1;
        if (!t->proc && t->argmax) {
            want = t->argmax[cur];
        } else {
            const float *row = t->logits + (size_t)cur * (size_t)t->vocab;
            if (t->proc) row = t->proc->apply(t->proc->ctx, row);
            want = s ? sample_token(s, row, p, rng, pos + n_path - 1) : sample_greedy(row, t->vocab);
        }
        for (int32_t i = cur + 1; i < t->n; i++)
            if (t->parents[i] == cur && t->tokens[i] == want) {
                next = i;
                break;
            }
        if (t->proc) t->proc->push(t->proc->ctx, want);
        if (next < 0) {
            *bonus = want;
            return n_path;
        }
        path[n_path++] = cur = next;
    }
}

int32_t verify_greedy(const verify_tree *t, int32_t *path, int32_t *bonus) {
    return walk(t, NULL, NULL, NULL, 0, path, bonus);
}

int32_t verify_sample(const verify_tree *t, sample_state *s, const sample_params *p, const sample_rng *rng, int32_t pos,
                      int32_t *path, int32_t *bonus) {
    if (sample_is_greedy(p)) return verify_greedy(t, path, bonus);
    AE_ASSERT(sample_vocab(s) == t->vocab);
    return walk(t, s, p, rng, pos, path, bonus);
}
