/* Attention over the paged KV cache, and KV writes.
 *
 * The arithmetic (kernels.h): a token's visible keys, in visible order
 * (prefix slots, then extra slots), are cut into chunks of KN_ATTN_CHUNK.
 * Each chunk gives a partial per head: its largest score mc, l = sum of
 * e^(s - mc) and o = sum of e^(s - mc) v, in key order. The partials are
 * then merged in chunk order. Nothing depends on the batch, on which
 * thread computed a chunk, or on when it was merged.
 *
 * Two ways to share the work, same bits:
 *   - many tokens (prefill): a task is (token, kv head); it walks its
 *     chunks and merges each at once, and the group's query heads share
 *     every K and V row loaded;
 *   - few tokens (decode, verify): a token has too few kv heads to keep
 *     the threads busy, and a task that reads one kv head's quarter of
 *     each row waited on DRAM. A task is then a run of (token, chunk)
 *     pairs over all heads, reading whole rows, and writes the partials
 *     to the stream's workspace; the merge follows.
 *
 * Plain C with GCC vector types, mul then add (no fma): the AVX2 build of
 * the same functions gives the portable build's bits. */
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

/* 8 floats as one value. GCC's vector extensions: each lane is the plain
 * IEEE operation, so the portable build (two SSE halves) and the AVX2
 * build (one register) give the same bits. */
typedef float v8f __attribute__((vector_size(32)));
/* The helpers taking and returning v8f are always inlined, so no call
 * passes one: the ABI note compilers give for the portable build is moot. */
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wpsabi"
#elif defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
typedef int32_t v8i __attribute__((vector_size(32)));

#define AI static inline __attribute__((always_inline))

AI v8f ld8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

AI void st8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* The lane tree of kernels.h. */
AI float tree8(v8f a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

AI v8f select8(v8i mask, v8f yes, v8f no) { return (v8f)(((v8i)yes & mask) | ((v8i)no & ~mask)); }

/* e^x for x <= 0 (attention only takes exp of a score minus the running
 * maximum) with KN_EXP_CORE, 8 lanes at a time. Below -87 (2^n would be
 * subnormal) the result is 0, so -inf gives 0; NaN gives NaN. */
#define CVT8(n) __builtin_convertvector((n), v8i)
AI v8f exp_neg8(v8f x) {
    const v8f lo = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f};
    v8i under = x < lo, nan = x != x;
    v8f xc = select8(under | nan, lo, x), y;
    KN_EXP_CORE(v8f, v8i, CVT8, xc, y);
    y = (v8f)((v8i)y & ~under);
    return select8(nan, x, y);
}

AI float exp_neg(float x) {
    v8f v = {x, x, x, x, x, x, x, x};
    return exp_neg8(v)[0];
}

typedef struct attn_job {
    const kn_kv_pool *kv;
    const kn_kv_map *map;
    const float *q; /* [m][n_heads][head_dim] */
    float *out;     /* [m][n_heads][head_dim] */
    int32_t n_heads;
    float scale;
    /* the split way */
    int32_t *first;  /* [m + 1]: (token, chunk) pairs of token t start at first[t] */
    float *part_m, *part_l, *part_o; /* [pairs][n_heads], [pairs][n_heads], [pairs][n_heads][hd] */
    int32_t parts;   /* tasks */
    bool simd;
} attn_job;

/* Visible keys [c0, c0 + n) of token t against heads [h0, h1) (h1 - h0 <=
 * KN_HEADS_PER_PASS): each head's chunk partial to pm[i], pl[i] and
 * po + i * hd. */
AI void chunk_partial(const attn_job *job, int32_t t, int64_t c0, int n, int32_t h0, int32_t h1, float *pm,
                      float *pl, float *po, const int hd) {
    const kn_kv_pool *kv = job->kv;
    const kn_kv_map *map = job->map;
    const int h8 = hd / 8;
    int32_t seq = map->seq[t], n_prefix = map->n_prefix[t];
    const int32_t *extra = map->extra + map->extra_start[t];
    int32_t group = job->n_heads / kv->n_kv_heads;
    int32_t g0 = h0 / group, g1 = (h1 - 1) / group + 1;
    size_t rows[KN_ATTN_CHUNK];
    for (int j = 0; j < n; j++) {
        int64_t vi = c0 + j;
        int32_t slot = vi < n_prefix ? (int32_t)vi : extra[vi - n_prefix];
        rows[j] = slot_row(kv, map, seq, slot);
    }
    /* A step streams every layer's weights through the caches, so this
     * layer's keys and values come from DRAM: ask for all of the chunk's
     * key lines at once so that the misses overlap; the value lines are
     * asked for while the first head's scores are computed (asking for
     * both at once overflowed the miss queue and the values came late). */
    for (int j = 0; j < n; j++)
        for (int d = g0 * hd; d < g1 * hd; d += 16) __builtin_prefetch(kv->k + rows[j] + d, 0, 2);
    const v8f zero = {0};
    float score[KN_ATTN_CHUNK] __attribute__((aligned(32)));
    for (int32_t h = h0; h < h1; h++) {
        size_t off = (size_t)(h / group) * (size_t)hd;
        const float *q = job->q + ((size_t)t * (size_t)job->n_heads + (size_t)h) * (size_t)hd;
        /* Scores, 4 keys at a time: 4 independent chains of adds. */
        int j = 0;
        for (; j + 4 <= n; j += 4) {
            if (h == h0)
                for (int k = 0; k < 4; k++)
                    for (int d = g0 * hd; d < g1 * hd; d += 16) __builtin_prefetch(kv->v + rows[j + k] + d, 0, 2);
            const float *k0 = kv->k + rows[j] + off, *k1 = kv->k + rows[j + 1] + off;
            const float *k2 = kv->k + rows[j + 2] + off, *k3 = kv->k + rows[j + 3] + off;
            v8f a0 = zero, a1 = zero, a2 = zero, a3 = zero;
            #pragma GCC unroll 32
            for (int d = 0; d < hd; d += 8) {
                v8f qv = ld8(q + d);
                v8f p0 = qv * ld8(k0 + d), p1 = qv * ld8(k1 + d);
                v8f p2 = qv * ld8(k2 + d), p3 = qv * ld8(k3 + d);
                a0 = a0 + p0;
                a1 = a1 + p1;
                a2 = a2 + p2;
                a3 = a3 + p3;
            }
            score[j] = tree8(a0) * job->scale;
            score[j + 1] = tree8(a1) * job->scale;
            score[j + 2] = tree8(a2) * job->scale;
            score[j + 3] = tree8(a3) * job->scale;
        }
        for (; j < n; j++) {
            if (h == h0)
                for (int d = g0 * hd; d < g1 * hd; d += 16) __builtin_prefetch(kv->v + rows[j] + d, 0, 2);
            const float *k0 = kv->k + rows[j] + off;
            v8f a0 = zero;
            #pragma GCC unroll 32
            for (int d = 0; d < hd; d += 8) {
                v8f p0 = ld8(q + d) * ld8(k0 + d);
                a0 = a0 + p0;
            }
            score[j] = tree8(a0) * job->scale;
        }
        float mc = -INFINITY;
        for (j = 0; j < n; j++) mc = score[j] > mc ? score[j] : mc;
        for (j = 0; j + 8 <= n; j += 8) st8(score + j, exp_neg8(ld8(score + j) - mc));
        for (; j < n; j++) score[j] = exp_neg(score[j] - mc);
        v8f o[KN_MAX_HEAD_DIM / 8];
        #pragma GCC unroll 32
        for (int d = 0; d < h8; d++) o[d] = zero;
        float l = 0.0f;
        for (j = 0; j < n; j++) {
            float p = score[j];
            l = l + p;
            const float *v = kv->v + rows[j] + off;
            #pragma GCC unroll 32
            for (int d = 0; d < h8; d++) {
                v8f pv = ld8(v + 8 * d) * p;
                o[d] = o[d] + pv;
            }
        }
        int i = h - h0;
        pm[i] = mc;
        pl[i] = l;
        #pragma GCC unroll 32
        for (int d = 0; d < h8; d++) st8(po + (size_t)i * (size_t)hd + 8 * d, o[d]);
    }
}

/* Merges a chunk's partial (m, l, o) into a head's state (*M, *L, O);
 * `first` starts the state from it. */
AI void merge(bool first, float *M, float *L, float *O, float m, float l, const float *o, const int hd) {
    if (first) {
        *M = m;
        *L = l;
        memcpy(O, o, (size_t)hd * sizeof(float));
        return;
    }
    float mn = m > *M ? m : *M;
    float a = exp_neg(*M - mn), b = exp_neg(m - mn);
    float la = *L * a, lb = l * b;
    *L = la + lb;
    *M = mn;
    for (int d = 0; d < hd; d += 8) {
        v8f x = ld8(O + d) * a, y = ld8(o + d) * b;
        st8(O + d, x + y);
    }
}

AI void finish(float *out, float L, const float *O, const int hd) {
    for (int d = 0; d < hd; d += 8) st8(out + d, ld8(O + d) / L);
}

/* The many-tokens way: token t, heads [h0, h1) of one kv group, chunks in
 * order, each merged at once. */
AI void attend_walk(const attn_job *job, int32_t t, int32_t h0, int32_t h1, const int hd) {
    const kn_kv_map *map = job->map;
    int64_t n_vis = (int64_t)map->n_prefix[t] + map->n_extra[t];
    AE_ASSERT(n_vis >= 1);
    float pm[KN_HEADS_PER_PASS], pl[KN_HEADS_PER_PASS], M[KN_HEADS_PER_PASS], L[KN_HEADS_PER_PASS];
    float po[KN_HEADS_PER_PASS * KN_MAX_HEAD_DIM], O[KN_HEADS_PER_PASS * KN_MAX_HEAD_DIM];
    for (int64_t c0 = 0; c0 < n_vis; c0 += KN_ATTN_CHUNK) {
        int n = n_vis - c0 < KN_ATTN_CHUNK ? (int)(n_vis - c0) : KN_ATTN_CHUNK;
        chunk_partial(job, t, c0, n, h0, h1, pm, pl, po, hd);
        for (int32_t i = 0; i < h1 - h0; i++)
            merge(c0 == 0, &M[i], &L[i], O + (size_t)i * (size_t)hd, pm[i], pl[i], po + (size_t)i * (size_t)hd, hd);
    }
    for (int32_t i = 0; i < h1 - h0; i++)
        finish(job->out + ((size_t)t * (size_t)job->n_heads + (size_t)(h0 + i)) * (size_t)hd, L[i],
               O + (size_t)i * (size_t)hd, hd);
}

/* Asks for every line (all kv heads) of visible keys [c0, c0 + n) of
 * token t, keys and values. */
static void prefetch_chunk(const attn_job *job, int32_t t, int64_t c0, int n) {
    const kn_kv_pool *kv = job->kv;
    const kn_kv_map *map = job->map;
    int32_t seq = map->seq[t], n_prefix = map->n_prefix[t];
    const int32_t *extra = map->extra + map->extra_start[t];
    int width = kv->n_kv_heads * kv->head_dim;
    for (int j = 0; j < n; j++) {
        int64_t vi = c0 + j;
        size_t row = slot_row(kv, map, seq, vi < n_prefix ? (int32_t)vi : extra[vi - n_prefix]);
        for (int d = 0; d < width; d += 16) {
            __builtin_prefetch(kv->k + row + d, 0, 2);
            __builtin_prefetch(kv->v + row + d, 0, 2);
        }
    }
}

/* The few-tokens way, part 1: pairs [p0, p1) of the (token, chunk) list,
 * all heads, partials to the workspace. */
AI void attend_pairs(const attn_job *job, int32_t p0, int32_t p1, const int hd) {
    int32_t t = 0;
    size_t H = (size_t)job->n_heads;
    for (int32_t p = p0; p < p1; p++) {
        while (p >= job->first[t + 1]) t++;
        int64_t n_vis = (int64_t)job->map->n_prefix[t] + job->map->n_extra[t];
        int64_t c0 = (int64_t)(p - job->first[t]) * KN_ATTN_CHUNK;
        int n = n_vis - c0 < KN_ATTN_CHUNK ? (int)(n_vis - c0) : KN_ATTN_CHUNK;
        if (p + 1 < p1) {
            /* The next chunk's keys and values are fetched while this one
             * is computed (its own prefetches come too late to hide the
             * first misses). */
            int32_t tn = p + 1 >= job->first[t + 1] ? t + 1 : t;
            int64_t vn = (int64_t)job->map->n_prefix[tn] + job->map->n_extra[tn];
            int64_t cn = (int64_t)(p + 1 - job->first[tn]) * KN_ATTN_CHUNK;
            prefetch_chunk(job, tn, cn, vn - cn < KN_ATTN_CHUNK ? (int)(vn - cn) : KN_ATTN_CHUNK);
        }
        for (int32_t h = 0; h < job->n_heads; h += KN_HEADS_PER_PASS) {
            int32_t h1 = h + KN_HEADS_PER_PASS < job->n_heads ? h + KN_HEADS_PER_PASS : job->n_heads;
            chunk_partial(job, t, c0, n, h, h1, job->part_m + (size_t)p * H + (size_t)h,
                          job->part_l + (size_t)p * H + (size_t)h,
                          job->part_o + ((size_t)p * H + (size_t)h) * (size_t)hd, hd);
        }
    }
}

/* Part 2: token t's partials merged in chunk order, per head. */
AI void merge_token(const attn_job *job, int32_t t, const int hd) {
    size_t H = (size_t)job->n_heads;
    for (size_t h = 0; h < H; h++) {
        float M = 0, L = 0, O[KN_MAX_HEAD_DIM];
        for (int32_t p = job->first[t]; p < job->first[t + 1]; p++)
            merge(p == job->first[t], &M, &L, O, job->part_m[(size_t)p * H + h], job->part_l[(size_t)p * H + h],
                  job->part_o + ((size_t)p * H + h) * (size_t)hd, hd);
        finish(job->out + ((size_t)t * H + h) * (size_t)hd, L, O, hd);
    }
}

/* One function per build (portable, AVX2) and way; head_dim 64 gets a
 * constant so the loops over it unroll. */
#define ATTN_FNS(sfx, attr)                                                                               \
    attr static void walk_##sfx(const attn_job *job, int32_t t, int32_t h0, int32_t h1) {                \
        if (job->kv->head_dim == 64)                                                                      \
            attend_walk(job, t, h0, h1, 64);                                                              \
        else                                                                                              \
            attend_walk(job, t, h0, h1, job->kv->head_dim);                                               \
    }                                                                                                     \
    attr static void pairs_##sfx(const attn_job *job, int32_t p0, int32_t p1) {                          \
        if (job->kv->head_dim == 64)                                                                      \
            attend_pairs(job, p0, p1, 64);                                                                \
        else                                                                                              \
            attend_pairs(job, p0, p1, job->kv->head_dim);                                                 \
    }                                                                                                     \
    attr static void merge_##sfx(const attn_job *job, int32_t t) {                                       \
        if (job->kv->head_dim == 64)                                                                      \
            merge_token(job, t, 64);                                                                      \
        else                                                                                              \
            merge_token(job, t, job->kv->head_dim);                                                       \
    }

ATTN_FNS(scalar, )
#if defined(__x86_64__) || defined(__i386__)
ATTN_FNS(avx2, __attribute__((target("avx2"))))
#else
#define walk_avx2 walk_scalar
#define pairs_avx2 pairs_scalar
#define merge_avx2 merge_scalar
#endif

/* Many tokens: task = (token, kv head, part of the group's heads). */
static void walk_task(void *ctx, int task, int n_tasks) {
    const attn_job *job = ctx;
    (void)n_tasks;
    int32_t n_kv = job->kv->n_kv_heads, group = job->n_heads / n_kv;
    int32_t t = task / n_kv, g = task % n_kv;
    for (int32_t h = g * group; h < (g + 1) * group; h += KN_HEADS_PER_PASS) {
        int32_t h1 = h + KN_HEADS_PER_PASS < (g + 1) * group ? h + KN_HEADS_PER_PASS : (g + 1) * group;
        if (job->simd)
            walk_avx2(job, t, h, h1);
        else
            walk_scalar(job, t, h, h1);
    }
}

static void pairs_task(void *ctx, int task, int n_tasks) {
    const attn_job *job = ctx;
    int32_t total = job->first[job->map->m];
    int32_t p0 = (int32_t)((int64_t)total * task / n_tasks), p1 = (int32_t)((int64_t)total * (task + 1) / n_tasks);
    if (job->simd)
        pairs_avx2(job, p0, p1);
    else
        pairs_scalar(job, p0, p1);
}

size_t kn_attention_workspace(int32_t n_heads, int32_t head_dim, int32_t max_keys) {
    size_t pairs = (size_t)KN_ATTN_SPLIT_M * (size_t)((max_keys + KN_ATTN_CHUNK - 1) / KN_ATTN_CHUNK);
    return (size_t)(KN_ATTN_SPLIT_M + 1) * sizeof(int32_t) + 64 +
           pairs * (size_t)n_heads * ((size_t)head_dim + 2) * sizeof(float) + 3 * 64;
}

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

void kn_attention(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *q,
                  float *out, int32_t n_heads) {
    check_map(kv, map);
    AE_ASSERT(n_heads > 0 && n_heads % kv->n_kv_heads == 0 && kv->head_dim % 8 == 0);
    AE_ASSERT((int64_t)map->m * n_heads <= INT32_MAX);
    attn_job job = {
        .kv = kv,
        .map = map,
        .q = q,
        .out = out,
        .n_heads = n_heads,
        .scale = 1.0f / sqrtf((float)kv->head_dim),
        .simd = kn_cpu_use_avx2(),
    };
    int threads = kn_stream_threads(s);
    int32_t m = map->m;
    if (m == 0) return;
    /* Few tokens, when their partials fit the workspace: split by chunk. */
    if (m <= KN_ATTN_SPLIT_M && (int64_t)m * kv->n_kv_heads < 4 * (int64_t)threads) {
        int32_t first[KN_ATTN_SPLIT_M + 1];
        first[0] = 0;
        for (int32_t t = 0; t < m; t++) {
            int64_t n_vis = (int64_t)map->n_prefix[t] + map->n_extra[t];
            AE_ASSERT(n_vis >= 1);
            first[t + 1] = first[t] + (int32_t)((n_vis + KN_ATTN_CHUNK - 1) / KN_ATTN_CHUNK);
        }
        size_t pairs = (size_t)first[m], H = (size_t)n_heads, hd = (size_t)kv->head_dim;
        size_t need = align64(pairs * H * sizeof(float)) * 2 + pairs * H * hd * sizeof(float);
        if (need <= s->work_bytes) {
            char *w = s->work;
            job.first = first;
            job.part_m = (float *)(void *)w;
            job.part_l = (float *)(void *)(w + align64(pairs * H * sizeof(float)));
            job.part_o = (float *)(void *)(w + 2 * align64(pairs * H * sizeof(float)));
            int tasks = pairs < (size_t)threads ? (int)pairs : threads;
            pool_run(s->pool, pairs_task, &job, tasks);
            for (int32_t t = 0; t < m; t++) {
                if (job.simd)
                    merge_avx2(&job, t);
                else
                    merge_scalar(&job, t);
            }
            return;
        }
    }
    pool_run(s->pool, walk_task, &job, (int)((int64_t)m * kv->n_kv_heads));
}
