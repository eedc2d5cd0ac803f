#include "tree.h"

#include <math.h>
#include <string.h>

int tree_params_check(const tree_params *p, ae_error *err) {
    if (p->steps < 1 || p->steps > TREE_MAX_STEPS)
        return err_set(err, "spec-steps %d is outside 1..%d", p->steps, TREE_MAX_STEPS);
    if (p->topk < 1 || p->topk > TREE_MAX_TOPK)
        return err_set(err, "spec-topk %d is outside 1..%d", p->topk, TREE_MAX_TOPK);
    if (p->num_draft_tokens < 2 || p->num_draft_tokens > TREE_MAX_NODES)
        return err_set(err, "spec-tokens %d is outside 2..%d", p->num_draft_tokens, TREE_MAX_NODES);
    return AE_OK;
}

void tree_begin(tree_build *b, const tree_params *p, int32_t root_token) {
    b->params = *p;
    b->root_token = root_token;
    b->depth = 0;
    b->n_pool = 0;
    b->n_frontier = 1;
    b->frontier[0] = -1;
}

bool tree_done(const tree_build *b) { return b->depth >= b->params.steps; }

/* The total order of tree.h: higher score, then earlier. */
static bool better(const tree_cand *pool, int32_t a, int32_t b) {
    if (pool[a].score != pool[b].score) return pool[a].score > pool[b].score;
    return a < b;
}

/* Indices of the best `keep` of pool[first .. first+n), best first. An
 * insertion into a short sorted list: keep is at most TREE_MAX_NODES. */
static int32_t select_best(const tree_cand *pool, int32_t first, int32_t n, int32_t keep, int32_t *out) {
    int32_t m = 0;
    for (int32_t i = first; i < first + n; i++) {
        if (m == keep && !better(pool, i, out[m - 1])) continue;
        int32_t j = m < keep ? m++ : m - 1;
        while (j > 0 && better(pool, i, out[j - 1])) {
            out[j] = out[j - 1];
            j--;
        }
        out[j] = i;
    }
    return m;
}

void tree_expand(tree_build *b, int32_t k, const int32_t *tokens, const float *probs) {
    AE_ASSERT(!tree_done(b));
    AE_ASSERT(k >= 1 && k <= b->params.topk);
    int32_t first = b->n_pool;
    AE_ASSERT(first + b->n_frontier * k <= TREE_MAX_POOL);
    for (int32_t i = 0; i < b->n_frontier; i++) {
        int32_t parent = b->frontier[i];
        float ps = parent < 0 ? 1.0f : b->pool[parent].score;
        int32_t pd = parent < 0 ? 0 : b->pool[parent].depth;
        for (int32_t j = 0; j < k; j++) {
            float p = probs[i * k + j];
            if (!(p > 0.0f)) p = 0.0f; /* NaN, negative and -0 */
            if (p > 1.0f) p = 1.0f;
            b->pool[b->n_pool++] = (tree_cand){tokens[i * k + j], parent, pd + 1, p, ps * p};
        }
    }
    b->n_frontier = select_best(b->pool, first, b->n_pool - first, b->params.topk, b->frontier);
    b->depth++;
}

void tree_finish(const tree_build *b, tree_out *out) {
    int32_t keep = b->params.num_draft_tokens - 1, best[TREE_MAX_NODES];
    int32_t n = select_best(b->pool, 0, b->n_pool, keep, best);
    /* Back to creation order, which puts parents before children. */
    for (int32_t i = 1; i < n; i++)
        for (int32_t j = i; j > 0 && best[j] < best[j - 1]; j--) {
            int32_t t = best[j];
            best[j] = best[j - 1];
            best[j - 1] = t;
        }
    out->n = 1 + n;
    out->tokens[0] = b->root_token;
    out->parents[0] = -1;
    out->probs[0] = 1.0f;
    for (int32_t i = 0; i < n; i++) {
        const tree_cand *c = &b->pool[best[i]];
        int32_t parent = 0;
        if (c->parent >= 0) {
            int32_t j = 0;
            while (j < i && best[j] != c->parent) j++;
            AE_ASSERT(j < i); /* the order above keeps every ancestor */
            parent = 1 + j;
        }
        out->tokens[1 + i] = c->token;
        out->parents[1 + i] = parent;
        out->probs[1 + i] = c->p;
    }
}
