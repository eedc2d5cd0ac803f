/* Attention over the paged KV cache, and KV writes.
 *
 * Each (token, kv head) pair is one unit of work: its query heads share
 * every K and V row loaded. Keys are visited in the token's visible order
 * (prefix slots, then extra slots) in chunks of KN_ATTN_CHUNK by visible
 * index, with an online softmax: the only order the result depends on is
 * that list, never the batch (kernels.h, batch invariance).
 *
 * Plain C, no SIMD dispatch: the 8-lane dot product below vectorizes as
 * written, and mul-then-add (no fma) keeps every build's bits the same. */
#include "kn_cpu_impl.h"

#include <math.h>
#include <string.h>

/* Query heads of one group processed together; larger groups run in
 * several passes. Bounds the stack state below. */
#define KN_HEADS_PER_PASS 8

static void check_map(const kn_kv_pool *kv, const kn_kv_map *map) {
    AE_ASSERT(kv->block_size > 0 && kv->n_blocks > 0 && kv->n_kv_heads > 0);
    AE_ASSERT(kv->head_dim > 0 && kv->head_dim <= KN_MAX_HEAD_DIM);
    AE_ASSERT(map->m >= 0 && map->n_seqs >= 0 && map->table_len >= 0 && map->n_extra_total >= 0);
    for (int32_t t = 0; t < map->m; t++) {
        AE_ASSERT(map->seq[t] >= 0 && map->seq[t] < map->n_seqs);
        AE_ASSERT(map->n_prefix[t] >= 0 && map->n_extra[t] >= 0);
        AE_ASSERT(map->extra_start[t] >= 0 &&
                  map->extra_start[t] <= map->n_extra_total - map->n_extra[t]);
    }
}

/* Row of slot `slot` of sequence row `seq`: [n_kv_heads][head_dim]. */
static size_t slot_row(const kn_kv_pool *kv, const kn_kv_map *map, int32_t seq, int32_t slot) {
    AE_ASSERT(slot >= 0 && slot / kv->block_size < map->table_len);
    int32_t blk = map->block_tables[(size_t)seq * (size_t)map->table_len +
                                    (size_t)(slot / kv->block_size)];
    AE_ASSERT(blk >= 0 && blk < kv->n_blocks);
    size_t row = (size_t)blk * (size_t)kv->block_size + (size_t)(slot % kv->block_size);
    return row * (size_t)kv->n_kv_heads * (size_t)kv->head_dim;
}

void kn_kv_write(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *k,
                 const float *v) {
    (void)s;
    check_map(kv, map);
    size_t width = (size_t)kv->n_kv_heads * (size_t)kv->head_dim;
    for (int32_t t = 0; t < map->m; t++) {
        size_t at = slot_row(kv, map, map->seq[t], map->slot[t]);
        memcpy(kv->k + at, k + (size_t)t * width, width * sizeof(float));
        memcpy(kv->v + at, v + (size_t)t * width, width * sizeof(float));
    }
}

/* The lane tree of kernels.h over 8 lanes of mul-then-add. */
static float dot(const float *a, const float *b, int n) {
    float acc[8] = {0};
    int n8 = n / 8 * 8;
    for (int i = 0; i < n8; i += 8)
        for (int l = 0; l < 8; l++) {
            float p = a[i + l] * b[i + l];
            acc[l] = acc[l] + p;
        }
    float lo = (acc[0] + acc[4]) + (acc[2] + acc[6]);
    float hi = (acc[1] + acc[5]) + (acc[3] + acc[7]);
    float sum = lo + hi;
    for (int i = n8; i < n; i++) {
        float p = a[i] * b[i];
        sum = sum + p;
    }
    return sum;
}

typedef struct attn_job {
    const kn_kv_pool *kv;
    const kn_kv_map *map;
    const float *q; /* [m][n_heads][head_dim] */
    float *out;     /* [m][n_heads][head_dim] */
    int32_t n_heads;
    float scale;
} attn_job;

/* Heads [h0, h0 + nh) of token t, all reading kv head g. */
static void attend(const attn_job *job, int32_t t, int32_t g, int32_t h0, int nh) {
    const kn_kv_pool *kv = job->kv;
    const kn_kv_map *map = job->map;
    int hd = kv->head_dim;
    int32_t seq = map->seq[t], n_prefix = map->n_prefix[t];
    const int32_t *extra = map->extra + map->extra_start[t];
    int64_t n_vis = (int64_t)n_prefix + map->n_extra[t];
    AE_ASSERT(n_vis >= 1);

    const float *q[KN_HEADS_PER_PASS];
    float acc[KN_HEADS_PER_PASS][KN_MAX_HEAD_DIM];
    float score[KN_HEADS_PER_PASS][KN_ATTN_CHUNK];
    float mx[KN_HEADS_PER_PASS], sum[KN_HEADS_PER_PASS];
    size_t rows[KN_ATTN_CHUNK];
    for (int i = 0; i < nh; i++) {
        q[i] = job->q + ((size_t)t * (size_t)job->n_heads + (size_t)(h0 + i)) * (size_t)hd;
        memset(acc[i], 0, (size_t)hd * sizeof(float));
        mx[i] = -INFINITY;
        sum[i] = 0.0f;
    }
    size_t head_off = (size_t)g * (size_t)hd;
    for (int64_t c0 = 0; c0 < n_vis; c0 += KN_ATTN_CHUNK) {
        int n = n_vis - c0 < KN_ATTN_CHUNK ? (int)(n_vis - c0) : KN_ATTN_CHUNK;
        for (int j = 0; j < n; j++) {
            int64_t vi = c0 + j;
            int32_t slot = vi < n_prefix ? (int32_t)vi : extra[vi - n_prefix];
            rows[j] = slot_row(kv, map, seq, slot) + head_off;
        }
        for (int i = 0; i < nh; i++) {
            float cmax = -INFINITY;
            for (int j = 0; j < n; j++) {
                float sc = dot(q[i], kv->k + rows[j], hd) * job->scale;
                score[i][j] = sc;
                if (sc > cmax) cmax = sc;
            }
            float m_new = cmax > mx[i] ? cmax : mx[i];
            if (m_new != mx[i]) {
                /* Rescale what was summed under the old maximum (exp of
                 * -inf is 0 on the first chunk). */
                float corr = expf(mx[i] - m_new);
                sum[i] = sum[i] * corr;
                for (int d = 0; d < hd; d++) acc[i][d] = acc[i][d] * corr;
                mx[i] = m_new;
            }
            for (int j = 0; j < n; j++) score[i][j] = expf(score[i][j] - m_new);
        }
        for (int j = 0; j < n; j++) {
            const float *vrow = kv->v + rows[j];
            for (int i = 0; i < nh; i++) {
                float p = score[i][j];
                sum[i] = sum[i] + p;
                for (int d = 0; d < hd; d++) {
                    float pv = p * vrow[d];
                    acc[i][d] = acc[i][d] + pv;
                }
            }
        }
    }
    for (int i = 0; i < nh; i++) {
        float *o = job->out + ((size_t)t * (size_t)job->n_heads + (size_t)(h0 + i)) * (size_t)hd;
        for (int d = 0; d < hd; d++) o[d] = acc[i][d] / sum[i];
    }
}

static void attn_task(void *ctx, int task, int n_tasks) {
    const attn_job *job = ctx;
    (void)n_tasks;
    int32_t n_kv = job->kv->n_kv_heads;
    int32_t t = task / n_kv, g = task % n_kv;
    int32_t group = job->n_heads / n_kv;
    for (int32_t h = 0; h < group; h += KN_HEADS_PER_PASS) {
        int nh = group - h < KN_HEADS_PER_PASS ? (int)(group - h) : KN_HEADS_PER_PASS;
        attend(job, t, g, g * group + h, nh);
    }
}

void kn_attention(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *q,
                  float *out, int32_t n_heads) {
    check_map(kv, map);
    AE_ASSERT(n_heads > 0 && n_heads % kv->n_kv_heads == 0);
    AE_ASSERT((int64_t)map->m * kv->n_kv_heads <= INT32_MAX);
    attn_job job = {
        .kv = kv,
        .map = map,
        .q = q,
        .out = out,
        .n_heads = n_heads,
        .scale = 1.0f / sqrtf((float)kv->head_dim),
    };
    pool_run(s->pool, attn_task, &job, map->m * kv->n_kv_heads);
}
