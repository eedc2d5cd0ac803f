/* The CPU's MLA and mixture-of-experts ops (kernels.h): per-head
 * products, the router, and the routed experts. Each token's arithmetic
 * is its own and in a fixed order, so none depends on the batch. */
#include <math.h>
#include <string.h>

#include "kn_cpu_impl.h"

/* ---- per-head products ---------------------------------------------------- */

typedef struct heads_job {
    const kn_weight *w;
    int32_t n_heads;
    const float *x;
    int64_t x_head, y_head, m;
    float *y;
} heads_job;

/* 8 partial sums, combined pairwise: a fixed order the compiler can keep
 * in vector registers. */
static float dot(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    for (int j = 0; i < n; i++, j++) acc[j] += a[i] * b[i];
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

/* Task: the (token, head) pairs [task * total / n, ...). */
static void heads_task(void *ctx, int task, int n_tasks) {
    const heads_job *j = ctx;
    const int64_t n = j->w->rows / j->n_heads, k = j->w->cols, total = j->m * j->n_heads;
    for (int64_t p = total * task / n_tasks; p < total * (task + 1) / n_tasks; p++) {
        int64_t t = p / j->n_heads, h = p % j->n_heads;
        const float *x = j->x + (t * j->n_heads + h) * j->x_head;
        float *y = j->y + (t * j->n_heads + h) * j->y_head;
        for (int64_t o = 0; o < n; o++) {
            const float *row =
                (const float *)(const void *)((const char *)j->w->data + (size_t)(h * n + o) * j->w->row_bytes);
            y[o] = dot(row, x, k);
        }
    }
}

void kn_cpu_matmul_heads(kn_stream *s, const kn_weight *w, int32_t n_heads, const float *x, int64_t x_head, float *y,
                         int64_t y_head, int64_t m) {
    heads_job j = {w, n_heads, x, x_head, y_head, m, y};
    int64_t total = m * n_heads, threads = pool_threads(KN_CPU(s)->pool);
    pool_run(KN_CPU(s)->pool, heads_task, &j, (int)(total < threads ? total : threads));
}

/* ---- the router ---------------------------------------------------------- */

void kn_cpu_moe_route(kn_stream *s, const float *logits, const float *bias, int64_t m, const kn_route *r, int32_t *idx,
                      float *w) {
    const int32_t E = r->n_experts, G = r->n_group, per = E / G, K = r->top_k;
    float sc[KN_MAX_EXPERTS], ch[KN_MAX_EXPERTS], gs[KN_MAX_EXPERT_GROUPS], val[KN_MAX_EXPERT_GROUPS];
    for (int64_t t = 0; t < m; t++) {
        const float *l = logits + t * E;
        for (int32_t e = 0; e < E; e++) {
            sc[e] = 1.0f / (1.0f + expf(-l[e]));
            ch[e] = sc[e] + bias[e];
        }
        if (G > 1) {
            int32_t top[2], keep[KN_MAX_EXPERT_GROUPS];
            for (int32_t g = 0; g < G; g++) {
                kn_cpu_topk(s, ch + g * per, 1, per, 2, top, val);
                gs[g] = val[0] + val[1];
            }
            kn_cpu_topk(s, gs, 1, G, r->topk_group, keep, val);
            for (int32_t g = 0; g < G; g++) {
                bool kept = false;
                for (int32_t q = 0; q < r->topk_group; q++) kept = kept || keep[q] == g;
                if (!kept)
                    for (int32_t e = g * per; e < (g + 1) * per; e++) ch[e] = -INFINITY;
            }
        }
        int32_t *id = idx + t * K;
        float *wt = w + t * K;
        kn_cpu_topk(s, ch, 1, E, K, id, val);
        float sum = 0.0f;
        for (int32_t j = 0; j < K; j++) {
            wt[j] = sc[id[j]];
            sum += wt[j];
        }
        for (int32_t j = 0; j < K; j++) wt[j] = (r->norm ? wt[j] / (sum + 1e-20f) : wt[j]) * r->scale;
    }
}

/* ---- the routed experts ---------------------------------------------------- */

void kn_cpu_moe_ffn(kn_stream *s, const kn_experts *e, const float *x, const int32_t *idx, const float *w, int64_t m,
                    int32_t top_k, float *scratch, float *y) {
    const int64_t H = e->gate[0].cols, F = e->gate[0].rows;
    float *xs = scratch, *g = xs + m * H, *u = g + m * F, *ys = u + m * F, *wt = ys + m * H;
    int32_t *tok = (int32_t *)(void *)(wt + m);
    memset(y, 0, (size_t)(m * H) * sizeof *y);
    /* Expert by expert in increasing order: each token's terms are added
     * in that order, and an expert's weights are read once for all its
     * tokens. */
    for (int32_t ex = 0; ex < e->n_experts; ex++) {
        int64_t n = 0;
        for (int64_t t = 0; t < m; t++)
            for (int32_t j = 0; j < top_k; j++)
                if (idx[t * top_k + j] == ex) {
                    tok[n] = (int32_t)t;
                    wt[n] = w[t * top_k + j];
                    memcpy(xs + n * H, x + t * H, (size_t)H * sizeof *x);
                    n++;
                }
        if (n == 0) continue;
        kn_cpu_matmul_swiglu(s, &e->gate[ex], &e->up[ex], xs, g, u, n);
        kn_cpu_matmul(s, &e->down[ex], g, ys, n);
        for (int64_t i = 0; i < n; i++) {
            float *dst = y + (int64_t)tok[i] * H;
            const float *src = ys + i * H;
            for (int64_t c = 0; c < H; c++) dst[c] += wt[i] * src[c];
        }
    }
}
