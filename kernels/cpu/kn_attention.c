/* Attention over the paged KV cache, and KV writes.
 *
 * The arithmetic (kernels.h): a token's visible keys, in visible order
 * (prefix slots, then extra slots), are cut into chunks of KN_ATTN_CHUNK.
 * Each chunk gives a partial per head: its largest score mc, l = sum of
 * e^(s - mc) and o = sum of e^(s - mc) v, in key order. The partials are
 * then merged in chunk order. Nothing depends on the batch, on which
 * thread computed a chunk, on which other tokens shared it, or on when it
 * was merged.
 *
 * The pool holds f16. A chunk's rows of one kv head are widened once into
 * f32 buffers (F16C, or quant_f16_to_f32: both exact) and every query
 * head of the group, and every token that shares the chunk, reads the
 * buffers. Tokens of one sequence that are adjacent in the batch form a
 * run (a tree's nodes, a prefill chunk): chunk c lies wholly inside the
 * prefix of each token with n_prefix >= (c + 1) * KN_ATTN_CHUNK, and is
 * then the same keys for all of them, so it is loaded once for the run.
 * A token's later chunks (the end of its prefix, its extra slots) are its
 * own.
 *
 * Two ways to share the work between threads, same bits:
 *   - many tokens (prefill, decode batches): a task is a window of
 *     adjacent tokens and one kv head; it walks each run's chunks in order
 *     and merges every partial at once, accumulating in the output row;
 *   - few runs (decode of one sequence, one verify tree): a run has too
 *     few kv heads to keep the threads busy, and a task that reads one kv
 *     head's part of each row waited on DRAM. A task is then a stretch of
 *     (run, chunk) units over all kv heads, reading whole rows, and writes
 *     the partials to the stream's workspace; the merge follows.
 *
 * Plain C with GCC vector types, mul then add (no fma): the AVX2 build of
 * the same functions gives the portable build's bits. */
#include "kn_cpu_impl.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

/* Query heads of one group processed together; larger groups run in
 * several passes. Bounds the stack state below. */
#define KN_HEADS_PER_PASS 8

/* Most adjacent tokens one task of the many-tokens way takes, and so the
 * most that share one load of a chunk there. Bounds the stack state. */
#define KN_ATTN_WINDOW 16

/* The pool's elements: f16 bit patterns (kn_backend_cpu takes GGML_TYPE_F16
 * pools only). */
static inline uint16_t *pool_k(const kn_kv_pool *kv) { return kv->k; }
/* A latent pool (kernels.h) has no V: its values are its keys, widened
 * once (kf serves as vf; values_of). */
static inline uint16_t *pool_v(const kn_kv_pool *kv) { return kv->v; }
static inline const float *values_of(const kn_kv_pool *kv, const float *kf, const float *vf) { return kv->v ? vf : kf; }

/* Row of slot `slot` of sequence row `seq`: [n_kv_heads][head_dim]. */
static size_t slot_row(const kn_kv_pool *kv, const kn_kv_map *map, int32_t seq, int32_t slot) {
    AE_ASSERT(slot >= 0 && slot / kv->block_size < map->table_len);
    int32_t blk = map->block_tables[(size_t)seq * (size_t)map->table_len + (size_t)(slot / kv->block_size)];
    AE_ASSERT(blk >= 0 && blk < kv->n_blocks);
    size_t row = (size_t)blk * (size_t)kv->block_size + (size_t)(slot % kv->block_size);
    return row * (size_t)kv->n_kv_heads * (size_t)kv->head_dim;
}

/* ---- f16 <-> f32 -------------------------------------------------------- */

/* n floats to f16, round to nearest even (quant_f32_to_f16). */
static void narrow_portable(const float *x, uint16_t *h, size_t n) {
    for (size_t i = 0; i < n; i++) h[i] = quant_f32_to_f16(x[i]);
}

/* Keys and values of n rows (row j at rows[j] + off in the pools), hd
 * elements each, widened to kf[n][hd] and vf[n][hd]. */
typedef void (*widen_fn)(const kn_kv_pool *kv, const size_t *rows, int n, size_t off, int hd, float *kf, float *vf);

static void widen_portable(const kn_kv_pool *kv, const size_t *rows, int n, size_t off, int hd, float *kf, float *vf) {
    for (int j = 0; j < n; j++) {
        const uint16_t *k = pool_k(kv) + rows[j] + off, *v = kv->v ? pool_v(kv) + rows[j] + off : NULL;
        for (int i = 0; i < hd; i++) {
            kf[(size_t)j * (size_t)hd + (size_t)i] = quant_f16_to_f32(k[i]);
            if (v) vf[(size_t)j * (size_t)hd + (size_t)i] = quant_f16_to_f32(v[i]);
        }
    }
}

#if defined(__x86_64__) || defined(__i386__)
/* VCVTPS2PH with immediate 0 rounds to nearest even whatever MXCSR says,
 * keeps subnormals, overflows to inf and quiets NaN keeping the top
 * payload bits: quant_f32_to_f16's results (test_kernels pins it). */
__attribute__((target("avx2,f16c"))) static void narrow_f16c(const float *x, uint16_t *h, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i *)(void *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), 0));
    for (; i < n; i++) h[i] = quant_f32_to_f16(x[i]);
}

/* VCVTPH2PS is exact. It quiets a signalling NaN, which
 * quant_f16_to_f32 does not, but kn_kv_write never stores one. */
__attribute__((target("avx2,f16c"))) static void widen_f16c(const kn_kv_pool *kv, const size_t *rows, int n, size_t off,
                                                            int hd, float *kf, float *vf) {
    for (int j = 0; j < n; j++) {
        const uint16_t *k = pool_k(kv) + rows[j] + off, *v = kv->v ? pool_v(kv) + rows[j] + off : NULL;
        float *kd = kf + (size_t)j * (size_t)hd, *vd = vf + (size_t)j * (size_t)hd;
        for (int i = 0; i < hd; i += 8) {
            _mm256_storeu_ps(kd + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(k + i))));
            if (v) _mm256_storeu_ps(vd + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(v + i))));
        }
    }
}
#else
#define narrow_f16c narrow_portable
#define widen_f16c widen_portable
#endif

void kn_cpu_kv_write(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *k, const float *v) {
    (void)s;
    size_t width = (size_t)kv->n_kv_heads * (size_t)kv->head_dim;
    void (*narrow)(const float *, uint16_t *, size_t) = kn_cpu_use_avx2() ? narrow_f16c : narrow_portable;
    for (int32_t t = 0; t < map->m; t++) {
        size_t at = slot_row(kv, map, map->seq[t], map->slot[t]);
        narrow(k + (size_t)t * width, pool_k(kv) + at, width);
        if (kv->v) narrow(v + (size_t)t * width, pool_v(kv) + at, width);
    }
}

void kn_cpu_kv_move(kn_stream *s, const kn_kv_pool *kv, const int32_t *src_rows, const int32_t *dst_rows, int32_t n) {
    (void)s;
    const size_t row = (size_t)kv->n_kv_heads * (size_t)kv->head_dim;
    for (int32_t i = 0; i < n; i++) {
        if (src_rows[i] == dst_rows[i]) continue;
        memcpy(pool_k(kv) + (size_t)dst_rows[i] * row, pool_k(kv) + (size_t)src_rows[i] * row, row * sizeof(uint16_t));
        if (kv->v)
            memcpy(pool_v(kv) + (size_t)dst_rows[i] * row, pool_v(kv) + (size_t)src_rows[i] * row,
                   row * sizeof(uint16_t));
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
    bool simd;
    widen_fn widen;
    /* the walk way */
    int32_t window; /* tokens per task */
    /* the split way */
    const int32_t *first;            /* [m + 1]: the partials of token t's chunks start at first[t] */
    const int32_t *run_start;        /* [n_runs + 1]: run r is tokens [run_start[r], run_start[r + 1]) */
    const int32_t *unit_first;       /* [n_runs + 1]: run r's (run, chunk) units start at unit_first[r] */
    int32_t n_runs;                  /* runs of adjacent tokens of one sequence */
    float *part_m, *part_l, *part_o; /* [pairs][n_heads], [pairs][n_heads], [pairs][n_heads][hd] */
} attn_job;

/* Token t's visible keys, its chunks wholly inside its prefix (shared
 * with the run), and all its chunks. */
static int64_t n_visible(const kn_kv_map *map, int32_t t) { return (int64_t)map->n_prefix[t] + map->n_extra[t]; }
static int32_t full_chunks(const kn_kv_map *map, int32_t t) { return map->n_prefix[t] / KN_ATTN_CHUNK; }
static int32_t all_chunks(const kn_kv_map *map, int32_t t) {
    return (int32_t)((n_visible(map, t) + KN_ATTN_CHUNK - 1) / KN_ATTN_CHUNK);
}

/* Rows of the shared chunk c of sequence seq: slots c*CHUNK onwards. */
static void shared_rows(const attn_job *job, int32_t seq, int32_t c, size_t *rows) {
    for (int j = 0; j < KN_ATTN_CHUNK; j++) rows[j] = slot_row(job->kv, job->map, seq, c * KN_ATTN_CHUNK + j);
}

/* Rows of token t's own chunk c (n keys of its visible list); returns n. */
static int token_rows(const attn_job *job, int32_t t, int32_t c, size_t *rows) {
    const kn_kv_map *map = job->map;
    int64_t c0 = (int64_t)c * KN_ATTN_CHUNK, n_vis = n_visible(map, t);
    int n = n_vis - c0 < KN_ATTN_CHUNK ? (int)(n_vis - c0) : KN_ATTN_CHUNK;
    int32_t n_prefix = map->n_prefix[t];
    const int32_t *extra = map->extra + map->extra_start[t];
    for (int j = 0; j < n; j++) {
        int64_t vi = c0 + j;
        rows[j] = slot_row(job->kv, map, map->seq[t], vi < n_prefix ? (int32_t)vi : extra[vi - n_prefix]);
    }
    return n;
}

/* Asks for the lines of n rows, elements [off, off + len) of each, keys
 * and values, so that the misses overlap the work on the chunk before. */
static void prefetch_rows(const kn_kv_pool *kv, const size_t *rows, int n, size_t off, size_t len) {
    for (int j = 0; j < n; j++)
        for (size_t d = 0; d < len; d += 32) {
            __builtin_prefetch(pool_k(kv) + rows[j] + off + d, 0, 2);
            if (kv->v) __builtin_prefetch(pool_v(kv) + rows[j] + off + d, 0, 2);
        }
}

/* One query head's partial over a widened chunk: n keys kf[n][hd] and
 * values vf[n][hd] against q[hd], to (*pm, *pl, po[hd]). */
AI void partial(const float *kf, const float *vf, int n, const float *q, float scale, float *pm, float *pl, float *po,
                const int hd) {
    const int h8 = hd / 8;
    const v8f zero = {0};
    float score[KN_ATTN_CHUNK] __attribute__((aligned(32)));
    /* Scores, 4 keys at a time: 4 independent chains of adds. */
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *k0 = kf + (size_t)j * (size_t)hd, *k1 = k0 + hd, *k2 = k1 + hd, *k3 = k2 + hd;
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
        score[j] = tree8(a0) * scale;
        score[j + 1] = tree8(a1) * scale;
        score[j + 2] = tree8(a2) * scale;
        score[j + 3] = tree8(a3) * scale;
    }
    for (; j < n; j++) {
        const float *k0 = kf + (size_t)j * (size_t)hd;
        v8f a0 = zero;
#pragma GCC unroll 32
        for (int d = 0; d < hd; d += 8) {
            v8f p0 = ld8(q + d) * ld8(k0 + d);
            a0 = a0 + p0;
        }
        score[j] = tree8(a0) * scale;
    }
    float mc = -INFINITY;
    for (j = 0; j < n; j++) mc = score[j] > mc ? score[j] : mc;
    for (j = 0; j + 8 <= n; j += 8) st8(score + j, exp_neg8(ld8(score + j) - mc));
    for (; j < n; j++) score[j] = exp_neg(score[j] - mc);
    v8f o[KN_MAX_ATTN_DIM / 8];
#pragma GCC unroll 32
    for (int d = 0; d < h8; d++) o[d] = zero;
    float l = 0.0f;
    for (j = 0; j < n; j++) {
        float p = score[j];
        l = l + p;
        const float *v = vf + (size_t)j * (size_t)hd;
#pragma GCC unroll 32
        for (int d = 0; d < h8; d++) {
            v8f pv = ld8(v + 8 * d) * p;
            o[d] = o[d] + pv;
        }
    }
    *pm = mc;
    *pl = l;
#pragma GCC unroll 32
    for (int d = 0; d < h8; d++) st8(po + 8 * d, o[d]);
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

AI const float *q_at(const attn_job *job, int32_t t, int32_t h, const int hd) {
    return job->q + ((size_t)t * (size_t)job->n_heads + (size_t)h) * (size_t)hd;
}

AI float *out_at(const attn_job *job, int32_t t, int32_t h, const int hd) {
    return job->out + ((size_t)t * (size_t)job->n_heads + (size_t)h) * (size_t)hd;
}

/* The many-tokens way, one run: tokens [a, b) of one sequence (b - a <=
 * KN_ATTN_WINDOW), kv head g, query heads [h0, h1) of its group (h1 - h0
 * <= KN_HEADS_PER_PASS). Chunks in order; a token's state accumulates in
 * its output rows (O), each partial merged at once. */
AI void walk_run(const attn_job *job, int32_t a, int32_t b, int32_t g, int32_t h0, int32_t h1, const int hd) {
    const kn_kv_map *map = job->map;
    const kn_kv_pool *kv = job->kv;
    const size_t off = (size_t)g * (size_t)hd;
    int32_t seq = map->seq[a], most = 0, shared = 0;
    for (int32_t t = a; t < b; t++) {
        AE_ASSERT(n_visible(map, t) >= 1);
        most = all_chunks(map, t) > most ? all_chunks(map, t) : most;
        shared = full_chunks(map, t) > shared ? full_chunks(map, t) : shared;
    }
    float M[KN_ATTN_WINDOW][KN_HEADS_PER_PASS], L[KN_ATTN_WINDOW][KN_HEADS_PER_PASS];
    float kf[KN_ATTN_CHUNK * KN_MAX_ATTN_DIM] __attribute__((aligned(32)));
    float vf[KN_ATTN_CHUNK * KN_MAX_ATTN_DIM] __attribute__((aligned(32)));
    float po[KN_MAX_ATTN_DIM] __attribute__((aligned(32)));
    size_t rows[KN_ATTN_CHUNK], next[KN_ATTN_CHUNK];
    if (shared > 0) shared_rows(job, seq, 0, next);
    for (int32_t c = 0; c < most; c++) {
        if (c < shared) {
            memcpy(rows, next, sizeof rows);
            if (c + 1 < shared) {
                shared_rows(job, seq, c + 1, next);
                prefetch_rows(kv, next, KN_ATTN_CHUNK, off, (size_t)hd);
            }
            job->widen(kv, rows, KN_ATTN_CHUNK, off, hd, kf, vf);
            for (int32_t t = a; t < b; t++) {
                if (c >= full_chunks(map, t)) continue;
                for (int32_t h = h0; h < h1; h++) {
                    float pm, pl;
                    partial(kf, values_of(kv, kf, vf), KN_ATTN_CHUNK, q_at(job, t, h, hd), job->scale, &pm, &pl, po,
                            hd);
                    merge(c == 0, &M[t - a][h - h0], &L[t - a][h - h0], out_at(job, t, h, hd), pm, pl, po, hd);
                }
            }
        }
        for (int32_t t = a; t < b; t++) {
            if (c < full_chunks(map, t) || c >= all_chunks(map, t)) continue;
            int n = token_rows(job, t, c, rows);
            job->widen(kv, rows, n, off, hd, kf, vf);
            for (int32_t h = h0; h < h1; h++) {
                float pm, pl;
                partial(kf, values_of(kv, kf, vf), n, q_at(job, t, h, hd), job->scale, &pm, &pl, po, hd);
                merge(c == 0, &M[t - a][h - h0], &L[t - a][h - h0], out_at(job, t, h, hd), pm, pl, po, hd);
            }
        }
    }
    for (int32_t t = a; t < b; t++)
        for (int32_t h = h0; h < h1; h++) finish(out_at(job, t, h, hd), L[t - a][h - h0], out_at(job, t, h, hd), hd);
}

/* Tokens [t0, t1) of the batch, run by run. */
AI void walk_window(const attn_job *job, int32_t t0, int32_t t1, int32_t g, int32_t h0, int32_t h1, const int hd) {
    const int32_t *seq = job->map->seq;
    for (int32_t a = t0, b; a < t1; a = b) {
        for (b = a + 1; b < t1 && seq[b] == seq[a];) b++;
        walk_run(job, a, b, g, h0, h1, hd);
    }
}

/* The few-runs way, part 1: unit (run r, chunk c), all kv heads and
 * query heads, partials to the workspace. */
AI void attend_unit(const attn_job *job, int32_t r, int32_t c, const int hd) {
    const kn_kv_map *map = job->map;
    const kn_kv_pool *kv = job->kv;
    const size_t H = (size_t)job->n_heads;
    const int32_t a = job->run_start[r], b = job->run_start[r + 1], group = job->n_heads / kv->n_kv_heads;
    float kf[KN_ATTN_CHUNK * KN_MAX_ATTN_DIM] __attribute__((aligned(32)));
    float vf[KN_ATTN_CHUNK * KN_MAX_ATTN_DIM] __attribute__((aligned(32)));
    size_t rows[KN_ATTN_CHUNK];
    bool shared = false;
    for (int32_t t = a; t < b; t++) shared = shared || c < full_chunks(map, t);
    if (shared) shared_rows(job, map->seq[a], c, rows);
    for (int32_t g = 0; g < kv->n_kv_heads; g++) {
        const size_t off = (size_t)g * (size_t)hd;
        if (shared) {
            job->widen(kv, rows, KN_ATTN_CHUNK, off, hd, kf, vf);
            for (int32_t t = a; t < b; t++) {
                if (c >= full_chunks(map, t)) continue;
                size_t p = (size_t)(job->first[t] + c);
                for (int32_t h = g * group; h < (g + 1) * group; h++)
                    partial(kf, values_of(kv, kf, vf), KN_ATTN_CHUNK, q_at(job, t, h, hd), job->scale,
                            job->part_m + p * H + (size_t)h, job->part_l + p * H + (size_t)h,
                            job->part_o + (p * H + (size_t)h) * (size_t)hd, hd);
            }
        }
        for (int32_t t = a; t < b; t++) {
            if (c < full_chunks(map, t) || c >= all_chunks(map, t)) continue;
            size_t own[KN_ATTN_CHUNK];
            int n = token_rows(job, t, c, own);
            job->widen(kv, own, n, off, hd, kf, vf);
            size_t p = (size_t)(job->first[t] + c);
            for (int32_t h = g * group; h < (g + 1) * group; h++)
                partial(kf, values_of(kv, kf, vf), n, q_at(job, t, h, hd), job->scale, job->part_m + p * H + (size_t)h,
                        job->part_l + p * H + (size_t)h, job->part_o + (p * H + (size_t)h) * (size_t)hd, hd);
        }
    }
}

/* Units [u0, u1) in order; each asks for the next unit's shared rows
 * (whole rows: every kv head) before it starts, so that the misses
 * overlap its work. */
AI void attend_units(const attn_job *job, int32_t u0, int32_t u1, const int hd) {
    const size_t width = (size_t)job->kv->n_kv_heads * (size_t)hd;
    int32_t r = 0;
    for (int32_t u = u0; u < u1; u++) {
        while (u >= job->unit_first[r + 1]) r++;
        int32_t c = u - job->unit_first[r];
        if (u + 1 < u1) {
            int32_t rn = u + 1 >= job->unit_first[r + 1] ? r + 1 : r, cn = u + 1 - job->unit_first[rn];
            int32_t an = job->run_start[rn];
            bool any = false;
            for (int32_t t = an; t < job->run_start[rn + 1]; t++) any = any || cn < full_chunks(job->map, t);
            if (any) {
                size_t next[KN_ATTN_CHUNK];
                shared_rows(job, job->map->seq[an], cn, next);
                prefetch_rows(job->kv, next, KN_ATTN_CHUNK, 0, width);
            }
        }
        attend_unit(job, r, c, hd);
    }
}

/* Part 2: token t's partials merged in chunk order, per head. */
AI void merge_token(const attn_job *job, int32_t t, const int hd) {
    size_t H = (size_t)job->n_heads;
    for (size_t h = 0; h < H; h++) {
        float M = 0, L = 0, O[KN_MAX_ATTN_DIM] __attribute__((aligned(32)));
        for (int32_t p = job->first[t]; p < job->first[t + 1]; p++)
            merge(p == job->first[t], &M, &L, O, job->part_m[(size_t)p * H + h], job->part_l[(size_t)p * H + h],
                  job->part_o + ((size_t)p * H + h) * (size_t)hd, hd);
        finish(job->out + ((size_t)t * H + h) * (size_t)hd, L, O, hd);
    }
}

/* One function per build (portable, AVX2) and way; head_dim 64 gets a
 * constant so the loops over it unroll. */
#define ATTN_FNS(sfx, attr) \
    attr static void walk_##sfx(const attn_job *job, int32_t t0, int32_t t1, int32_t g, int32_t h0, int32_t h1) { \
        if (job->kv->head_dim == 64) \
            walk_window(job, t0, t1, g, h0, h1, 64); \
        else \
            walk_window(job, t0, t1, g, h0, h1, job->kv->head_dim); \
    } \
    attr static void units_##sfx(const attn_job *job, int32_t u0, int32_t u1) { \
        if (job->kv->head_dim == 64) \
            attend_units(job, u0, u1, 64); \
        else \
            attend_units(job, u0, u1, job->kv->head_dim); \
    } \
    attr static void merge_##sfx(const attn_job *job, int32_t t) { \
        if (job->kv->head_dim == 64) \
            merge_token(job, t, 64); \
        else \
            merge_token(job, t, job->kv->head_dim); \
    }

ATTN_FNS(scalar, )
#if defined(__x86_64__) || defined(__i386__)
ATTN_FNS(avx2, __attribute__((target("avx2"))))
#else
#define walk_avx2 walk_scalar
#define units_avx2 units_scalar
#define merge_avx2 merge_scalar
#endif

/* Many tokens: task = (window of job->window tokens, kv head). */
static void walk_task(void *ctx, int task, int n_tasks) {
    const attn_job *job = ctx;
    (void)n_tasks;
    int32_t n_kv = job->kv->n_kv_heads, group = job->n_heads / n_kv;
    int32_t w = task / n_kv, g = task % n_kv;
    int32_t t0 = w * job->window, t1 = t0 + job->window < job->map->m ? t0 + job->window : job->map->m;
    for (int32_t h = g * group; h < (g + 1) * group; h += KN_HEADS_PER_PASS) {
        int32_t h1 = h + KN_HEADS_PER_PASS < (g + 1) * group ? h + KN_HEADS_PER_PASS : (g + 1) * group;
        if (job->simd)
            walk_avx2(job, t0, t1, g, h, h1);
        else
            walk_scalar(job, t0, t1, g, h, h1);
    }
}

static void units_task(void *ctx, int task, int n_tasks) {
    const attn_job *job = ctx;
    int32_t total = job->unit_first[job->n_runs];
    int32_t u0 = (int32_t)((int64_t)total * task / n_tasks), u1 = (int32_t)((int64_t)total * (task + 1) / n_tasks);
    if (job->simd)
        units_avx2(job, u0, u1);
    else
        units_scalar(job, u0, u1);
}

size_t kn_attention_workspace(int32_t n_heads, int32_t head_dim, int32_t max_keys) {
    size_t pairs = (size_t)KN_ATTN_SPLIT_M * (size_t)((max_keys + KN_ATTN_CHUNK - 1) / KN_ATTN_CHUNK);
    return (size_t)(KN_ATTN_SPLIT_M + 1) * sizeof(int32_t) + 64 +
           pairs * (size_t)n_heads * ((size_t)head_dim + 2) * sizeof(float) + 3 * 64;
}

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

void kn_cpu_attention(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *q, float *out,
                      int32_t n_heads) {
    attn_job job = {
        .kv = kv,
        .map = map,
        .q = q,
        .out = out,
        .n_heads = n_heads,
        .scale = kv->scale > 0.0f ? kv->scale : 1.0f / sqrtf((float)kv->head_dim),
        .simd = kn_cpu_use_avx2(),
    };
    job.widen = job.simd ? widen_f16c : widen_portable;
    int threads = pool_threads(KN_CPU(s)->pool);
    int32_t m = map->m;
    if (m == 0) return;
    if (m <= KN_ATTN_SPLIT_M) {
        /* Few runs, when their partials fit the workspace: split by chunk. */
        int32_t first[KN_ATTN_SPLIT_M + 1], run_start[KN_ATTN_SPLIT_M + 1], unit_first[KN_ATTN_SPLIT_M + 1];
        int32_t n_runs = 0;
        first[0] = 0;
        unit_first[0] = 0;
        for (int32_t t = 0; t < m; t++) {
            AE_ASSERT(n_visible(map, t) >= 1);
            first[t + 1] = first[t] + all_chunks(map, t);
            if (t == 0 || map->seq[t] != map->seq[t - 1]) {
                run_start[n_runs++] = t;
                unit_first[n_runs] = unit_first[n_runs - 1];
            }
            int32_t r = n_runs - 1, have = unit_first[n_runs] - unit_first[r];
            if (all_chunks(map, t) > have) unit_first[n_runs] = unit_first[r] + all_chunks(map, t);
        }
        run_start[n_runs] = m;
        size_t pairs = (size_t)first[m], H = (size_t)n_heads, hd = (size_t)kv->head_dim;
        size_t need = align64(pairs * H * sizeof(float)) * 2 + pairs * H * hd * sizeof(float);
        if ((int64_t)n_runs * kv->n_kv_heads < 4 * (int64_t)threads && need <= KN_CPU(s)->work_bytes) {
            char *w = KN_CPU(s)->work;
            job.first = first;
            job.run_start = run_start;
            job.unit_first = unit_first;
            job.n_runs = n_runs;
            job.part_m = (float *)(void *)w;
            job.part_l = (float *)(void *)(w + align64(pairs * H * sizeof(float)));
            job.part_o = (float *)(void *)(w + 2 * align64(pairs * H * sizeof(float)));
            int32_t units = unit_first[n_runs];
            int tasks = units < threads ? (int)units : threads;
            pool_run(KN_CPU(s)->pool, units_task, &job, tasks);
            for (int32_t t = 0; t < m; t++) {
                if (job.simd)
                    merge_avx2(&job, t);
                else
                    merge_scalar(&job, t);
            }
            return;
        }
    }
    /* Windows small enough to give every thread a few tasks, large enough
     * to share chunks among a run's tokens. */
    int64_t w = (int64_t)m * kv->n_kv_heads / (4 * (int64_t)threads);
    job.window = w < 1 ? 1 : w > KN_ATTN_WINDOW ? KN_ATTN_WINDOW : (int32_t)w;
    int64_t windows = (m + job.window - 1) / job.window;
    pool_run(KN_CPU(s)->pool, walk_task, &job, (int)(windows * kv->n_kv_heads));
}
