/* Attention over the paged KV cache, and KV writes.
 *
 * Each (token, kv head) pair is one unit of work: its query heads share
 * every K and V row loaded. Keys are visited in the token's visible order
 * (prefix slots, then extra slots) in chunks of KN_ATTN_CHUNK by visible
 * index, with an online softmax: the only order the result depends on is
 * that list, never the batch (kernels.h, batch invariance).
 *
 * Plain C: the 8-lane dot product below vectorizes as written, and
 * mul-then-add (no fma) keeps every build's bits the same, so the AVX2
 * build of the same function (attend_avx2) matches the portable one. */
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
static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int n) {
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

/* Heads [h0, h0 + nh) of token t, all reading kv head g. hd is the head
 * size; the callers pass a constant for the common one, so the loops over
 * it unroll and one head's accumulator stays in registers. Per (head,
 * element) the sums run in key order whatever the loop nest. */
static inline __attribute__((always_inline)) void attend(const attn_job *job, int32_t t, int32_t g, int32_t h0,
                                                         int nh, const int hd) {
    const kn_kv_pool *kv = job->kv;
    const kn_kv_map *map = job->map;
    int32_t seq = map->seq[t], n_prefix = map->n_prefix[t];
    const int32_t *extra = map->extra + map->extra_start[t];
    int64_t n_vis = (int64_t)n_prefix + map->n_extra[t];
    AE_ASSERT(n_vis >= 1);

    const float *q[KN_HEADS_PER_PASS];
    float acc[KN_HEADS_PER_PASS][KN_MAX_HEAD_DIM];
    float score[KN_HEADS_PER_PASS][KN_ATTN_CHUNK];
    float mx[KN_HEADS_PER_PASS], sum[KN_HEADS_PER_PASS];
    const float *krow[KN_ATTN_CHUNK], *vrow[KN_ATTN_CHUNK];
    for (int i = 0; i < nh; i++) {
        q[i] = job->q + ((size_t)t * (size_t)job->n_heads + (size_t)(h0 + i)) * (size_t)hd;
        for (int d = 0; d < hd; d++) acc[i][d] = 0.0f;
        mx[i] = -INFINITY;
        sum[i] = 0.0f;
    }
    size_t head_off = (size_t)g * (size_t)hd;
    for (int64_t c0 = 0; c0 < n_vis; c0 += KN_ATTN_CHUNK) {
        int n = n_vis - c0 < KN_ATTN_CHUNK ? (int)(n_vis - c0) : KN_ATTN_CHUNK;
        for (int j = 0; j < n; j++) {
            int64_t vi = c0 + j;
            int32_t slot = vi < n_prefix ? (int32_t)vi : extra[vi - n_prefix];
            size_t row = slot_row(kv, map, seq, slot) + head_off;
            krow[j] = kv->k + row;
            vrow[j] = kv->v + row;
        }
        /* A step streams every layer's weights through the caches, so
         * this layer's keys and values come from DRAM. Asking for all of
         * the chunk's lines at once overlaps the misses; visiting them
         * one row at a time waited for each (attention took a third of a
         * decode step). */
        for (int j = 0; j < n; j++)
            for (int d = 0; d < hd; d += 16) {
                __builtin_prefetch(krow[j] + d, 0, 2);
                __builtin_prefetch(vrow[j] + d, 0, 2);
            }
        for (int i = 0; i < nh; i++) {
            float cmax = -INFINITY;
            for (int j = 0; j < n; j++) {
                float sc = dot(q[i], krow[j], hd) * job->scale;
                score[i][j] = sc;
                if (sc > cmax) cmax = sc;
            }
            float m_new = cmax > mx[i] ? cmax : mx[i];
            float *a = acc[i];
            if (m_new != mx[i]) {
                /* Rescale what was summed under the old maximum (exp of
                 * -inf is 0 on the first chunk). */
                float corr = expf(mx[i] - m_new);
                sum[i] = sum[i] * corr;
                for (int d = 0; d < hd; d++) a[d] = a[d] * corr;
                mx[i] = m_new;
            }
            float s = sum[i];
            for (int j = 0; j < n; j++) {
                float p = expf(score[i][j] - m_new);
                s = s + p;
                const float *v = vrow[j];
                for (int d = 0; d < hd; d++) {
                    float pv = p * v[d];
                    a[d] = a[d] + pv;
                }
            }
            sum[i] = s;
        }
    }
    for (int i = 0; i < nh; i++) {
        float *o = job->out + ((size_t)t * (size_t)job->n_heads + (size_t)(h0 + i)) * (size_t)hd;
        for (int d = 0; d < hd; d++) o[d] = acc[i][d] / sum[i];
    }
}

/* A task is (token, kv head, part): part p of `parts` takes an equal
 * share of the group's query heads. One part per group shares each K and
 * V row among all the group's heads; a decode step has too few groups to
 * keep every thread busy, so it splits them. The split never changes a
 * head's result. */
typedef struct attn_split {
    attn_job job;
    int32_t parts;
    bool simd;
} attn_split;

static void attend_scalar(const attn_job *job, int32_t t, int32_t g, int32_t h0, int nh) {
    if (job->kv->head_dim == 64)
        attend(job, t, g, h0, nh, 64);
    else
        attend(job, t, g, h0, nh, job->kv->head_dim);
}

#if defined(__x86_64__) || defined(__i386__)
/* The same C compiled for AVX2: mul and add stay separate (ISO C mode
 * contracts nothing), so the bits are the portable build's. */
__attribute__((target("avx2"))) static void attend_avx2(const attn_job *job, int32_t t, int32_t g, int32_t h0, int nh) {
    if (job->kv->head_dim == 64)
        attend(job, t, g, h0, nh, 64);
    else
        attend(job, t, g, h0, nh, job->kv->head_dim);
}
#else
#define attend_avx2 attend_scalar
#endif

static void attn_task(void *ctx, int task, int n_tasks) {
    const attn_split *sp = ctx;
    const attn_job *job = &sp->job;
    (void)n_tasks;
    int32_t n_kv = job->kv->n_kv_heads;
    int32_t part = task % sp->parts, tg = task / sp->parts;
    int32_t t = tg / n_kv, g = tg % n_kv;
    int32_t group = job->n_heads / n_kv;
    int32_t a = group * part / sp->parts, b = group * (part + 1) / sp->parts;
    for (int32_t h = a; h < b; h += KN_HEADS_PER_PASS) {
        int nh = b - h < KN_HEADS_PER_PASS ? (int)(b - h) : KN_HEADS_PER_PASS;
        if (sp->simd)
            attend_avx2(job, t, g, g * group + h, nh);
        else
            attend_scalar(job, t, g, g * group + h, nh);
    }
}

void kn_attention(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *q,
                  float *out, int32_t n_heads) {
    check_map(kv, map);
    AE_ASSERT(n_heads > 0 && n_heads % kv->n_kv_heads == 0);
    AE_ASSERT((int64_t)map->m * n_heads <= INT32_MAX);
    attn_split sp = {
        .job = {
            .kv = kv,
            .map = map,
            .q = q,
            .out = out,
            .n_heads = n_heads,
            .scale = 1.0f / sqrtf((float)kv->head_dim),
        },
        .parts = 1,
        .simd = kn_cpu_use_avx2(),
    };
    int64_t groups = (int64_t)map->m * kv->n_kv_heads;
    int32_t group = n_heads / kv->n_kv_heads;
    /* Enough tasks for an even spread: at least 4 per thread. */
    while (sp.parts < group && groups * sp.parts < 4 * (int64_t)kn_stream_threads(s)) sp.parts++;
    pool_run(s->pool, attn_task, &sp, (int)(groups * sp.parts));
}
