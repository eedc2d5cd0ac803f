/* AVX2 matmul kernels. They reproduce the portable kernels' arithmetic
 * exactly (kernels.h fixes the order): the integer lane sums of
 * maddubs + madd are exact, and each float step is the same single IEEE
 * operation (f16 -> f32 conversion, d_w * d_x, fma, the lane tree).
 *
 * Each function carries its own target attribute so the rest of the build
 * stays portable; kn_cpu_use_avx2 checks the CPU before these run. */
#include "kn_cpu_impl.h"

#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>
#include <math.h>
#include <string.h>

#define TGT __attribute__((target("avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

/* ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7)): the lane tree of kernels.h. */
INL float hsum8(__m256 v) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}

INL float f16(uint16_t h) { return _cvtsh_ss(h); }

/* 32 nibbles as bytes in element order: low nibbles are elements 0..15,
 * high nibbles 16..31. */
INL __m256i nibbles(const uint8_t *q) {
    __m128i raw = _mm_loadu_si128((const __m128i *)(const void *)q);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

/* A weight block's quants prepared once and applied to several
 * activation rows. */
typedef struct wblk {
    __m256i q;  /* Q4_1: unsigned nibbles; Q8_0/Q4_0: |w| */
    __m256i sg; /* Q8_0/Q4_0: w itself, whose sign moves onto the activation */
} wblk;

INL wblk load_wblk(ggml_type type, const uint8_t *row, int64_t b) {
    wblk o;
    if (type == GGML_TYPE_Q4_1) {
        o.q = nibbles(((const kn_blk_q4_1 *)(const void *)row + b)->q);
        o.sg = o.q;
    } else if (type == GGML_TYPE_Q4_0) {
        __m256i w = _mm256_sub_epi8(nibbles(((const kn_blk_q4_0 *)(const void *)row + b)->q),
                                    _mm256_set1_epi8(8));
        o.q = _mm256_sign_epi8(w, w); /* |w| */
        o.sg = w;
    } else {
        const kn_blk_q8_0 *blk = (const kn_blk_q8_0 *)(const void *)row + b;
        __m256i w = _mm256_loadu_si256((const __m256i *)(const void *)blk->q);
        o.q = _mm256_sign_epi8(w, w); /* |w|; |-128| reads as 128 unsigned */
        o.sg = w;
    }
    return o;
}

/* The f16 scale (and Q4_1 offset) of block b. */
INL void load_scales(ggml_type type, const uint8_t *row, int64_t b, float *d, float *m) {
    if (type == GGML_TYPE_Q4_1) {
        const kn_blk_q4_1 *blk = (const kn_blk_q4_1 *)(const void *)row + b;
        *d = f16(blk->d);
        *m = f16(blk->m);
    } else if (type == GGML_TYPE_Q4_0) {
        *d = f16(((const kn_blk_q4_0 *)(const void *)row + b)->d);
        *m = 0.0f;
    } else {
        *d = f16(((const kn_blk_q8_0 *)(const void *)row + b)->d);
        *m = 0.0f;
    }
}

/* Lane l = sum of the products of elements 4l..4l+3, exact: maddubs pairs
 * stay below 2 * 128 * 127 < 32767 so never saturate. */
INL __m256i lanes(ggml_type type, const wblk *w, __m256i a) {
    __m256i p16 = type == GGML_TYPE_Q4_1 ? _mm256_maddubs_epi16(w->q, a)
                                         : _mm256_maddubs_epi16(w->q, _mm256_sign_epi8(a, w->sg));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

/* Blocks whose weight scales are converted to f32 at once. */
#define SEG 64

/* Rows [0, TM) of x against weight rows [j, j + TN). The per-block scale
 * products d_w * d_x are formed 8 blocks at a time into a small buffer
 * and broadcast from there, and the Q4_1 offset term runs 8 blocks per
 * fma: per row and block the hot loop is maddubs, madd, cvt, fma. */
INL void qtile(ggml_type type, int TM, int TN, const kn_tile *t, int64_t j) {
    const kn_weight *w = t->w;
    int64_t nb = t->nb;
    const uint8_t *rows[4];
    __m256 acc[4][4], macc[4][4];
    float dw[4][SEG] __attribute__((aligned(32)));
    float mw[4][SEG] __attribute__((aligned(32)));
    float dd[4][4][8] __attribute__((aligned(32)));
#pragma GCC unroll 4
    for (int c = 0; c < TN; c++) rows[c] = (const uint8_t *)w->data + (size_t)(j + c) * w->row_bytes;
#pragma GCC unroll 4
    for (int r = 0; r < TM; r++)
#pragma GCC unroll 4
        for (int c = 0; c < TN; c++) acc[r][c] = macc[r][c] = _mm256_setzero_ps();
    for (int64_t s0 = 0; s0 < nb; s0 += SEG) {
        int sn = nb - s0 < SEG ? (int)(nb - s0) : SEG;
        for (int c = 0; c < TN; c++) {
            for (int i = 0; i < sn; i++) load_scales(type, rows[c], s0 + i, &dw[c][i], &mw[c][i]);
            for (int i = sn; i < (sn + 7) / 8 * 8; i++) dw[c][i] = mw[c][i] = 0.0f;
        }
        for (int g = 0; g < sn; g += 8) {
            int gn = sn - g < 8 ? sn - g : 8;
            int64_t b0 = s0 + g;
#pragma GCC unroll 4
            for (int r = 0; r < TM; r++) {
                /* The scale arrays are padded to 8, so this load is in
                 * bounds even for a short last group. */
                __m256 dx = _mm256_loadu_ps(t->xd + (size_t)r * (size_t)t->nbp + (size_t)b0);
#pragma GCC unroll 4
                for (int c = 0; c < TN; c++)
                    _mm256_store_ps(dd[r][c], _mm256_mul_ps(_mm256_load_ps(&dw[c][g]), dx));
            }
            for (int i = 0; i < gn; i++) {
                int64_t b = b0 + i;
                wblk wb[4];
#pragma GCC unroll 4
                for (int c = 0; c < TN; c++) wb[c] = load_wblk(type, rows[c], b);
#pragma GCC unroll 4
                for (int r = 0; r < TM; r++) {
                    const int8_t *xq = t->xq + ((size_t)r * (size_t)nb + (size_t)b) * KN_QK;
                    __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)xq);
#pragma GCC unroll 4
                    for (int c = 0; c < TN; c++) {
                        __m256 p = _mm256_cvtepi32_ps(lanes(type, &wb[c], a));
                        acc[r][c] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(&dd[r][c][i]), acc[r][c]);
                    }
                }
            }
            if (type != GGML_TYPE_Q4_1) continue;
            /* Offset term: lane i of macc takes block b0 + i; a short last
             * group runs over the zero padding (kernels.h counts it). */
#pragma GCC unroll 4
            for (int r = 0; r < TM; r++) {
                __m256 xs = _mm256_loadu_ps(t->xs + (size_t)r * (size_t)t->nbp + (size_t)b0);
#pragma GCC unroll 4
                for (int c = 0; c < TN; c++)
                    macc[r][c] = _mm256_fmadd_ps(_mm256_load_ps(&mw[c][g]), xs, macc[r][c]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < TM; r++)
#pragma GCC unroll 4
        for (int c = 0; c < TN; c++)
            t->y[(size_t)r * t->ldy + (size_t)(j + c)] = hsum8(acc[r][c]) + hsum8(macc[r][c]);
}

/* 8 weights of a float row as f32. */
INL __m256 load_w8(ggml_type type, const uint8_t *row, int64_t i) {
    if (type == GGML_TYPE_F32) return _mm256_loadu_ps((const float *)(const void *)row + i);
    __m128i h = _mm_loadu_si128((const __m128i *)(const void *)(row + 2 * i));
    if (type == GGML_TYPE_F16) return _mm256_cvtph_ps(h);
    /* bf16: the top half of an f32. */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

INL float w_at(ggml_type type, const uint8_t *row, int64_t i) {
    if (type == GGML_TYPE_F32) {
        float f;
        memcpy(&f, row + 4 * i, sizeof f);
        return f;
    }
    uint16_t h;
    memcpy(&h, row + 2 * i, sizeof h);
    return type == GGML_TYPE_F16 ? f16(h) : quant_bf16_to_f32(h);
}

INL void ftile(ggml_type type, int TM, int TN, const kn_tile *t, int64_t j) {
    const kn_weight *w = t->w;
    int64_t k = w->cols, k8 = k / 8 * 8;
    const uint8_t *rows[4];
    __m256 acc[4][4];
#pragma GCC unroll 4
    for (int c = 0; c < TN; c++) rows[c] = (const uint8_t *)w->data + (size_t)(j + c) * w->row_bytes;
#pragma GCC unroll 4
    for (int r = 0; r < TM; r++)
#pragma GCC unroll 4
        for (int c = 0; c < TN; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k8; i += 8) {
        __m256 wv[4];
#pragma GCC unroll 4
        for (int c = 0; c < TN; c++) wv[c] = load_w8(type, rows[c], i);
#pragma GCC unroll 4
        for (int r = 0; r < TM; r++) {
            __m256 xv = _mm256_loadu_ps(t->xf + (size_t)r * t->xf_stride + i);
#pragma GCC unroll 4
            for (int c = 0; c < TN; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < TM; r++)
#pragma GCC unroll 4
        for (int c = 0; c < TN; c++) {
            const float *x = t->xf + (size_t)r * t->xf_stride;
            float s = hsum8(acc[r][c]);
            for (int64_t i = k8; i < k; i++) s = fmaf(x[i], w_at(type, rows[c], i), s);
            t->y[(size_t)r * t->ldy + (size_t)(j + c)] = s;
        }
}

/* One instance per (type, TM, TN) so the tiles' accumulators live in
 * registers. TN is 4 for a single row of x (independent chains hide the
 * fma latency) and 2 otherwise (TM * TN accumulators fit 16 registers). */
#define TILE_FN(name, body, type, TM, TN)                                   \
    static TGT void name(const kn_tile *t, int64_t j) { body(type, TM, TN, t, j); }

#define TILE_SET(pfx, body, type)          \
    TILE_FN(pfx##_1x4, body, type, 1, 4)   \
    TILE_FN(pfx##_1x1, body, type, 1, 1)   \
    TILE_FN(pfx##_2x2, body, type, 2, 2)   \
    TILE_FN(pfx##_2x1, body, type, 2, 1)   \
    TILE_FN(pfx##_3x2, body, type, 3, 2)   \
    TILE_FN(pfx##_3x1, body, type, 3, 1)   \
    TILE_FN(pfx##_4x2, body, type, 4, 2)   \
    TILE_FN(pfx##_4x1, body, type, 4, 1)   \
    static const tile_fn pfx[4][2] = {     \
        {pfx##_1x4, pfx##_1x1},            \
        {pfx##_2x2, pfx##_2x1},            \
        {pfx##_3x2, pfx##_3x1},            \
        {pfx##_4x2, pfx##_4x1},            \
    };

typedef void (*tile_fn)(const kn_tile *t, int64_t j);

TILE_SET(q8_0, qtile, GGML_TYPE_Q8_0)
TILE_SET(q4_0, qtile, GGML_TYPE_Q4_0)
TILE_SET(q4_1, qtile, GGML_TYPE_Q4_1)
TILE_SET(f32, ftile, GGML_TYPE_F32)
TILE_SET(f16t, ftile, GGML_TYPE_F16)
TILE_SET(bf16, ftile, GGML_TYPE_BF16)

void kn_tile_avx2(const kn_tile *t) {
    const tile_fn(*set)[2];
    switch (t->w->type) {
    case GGML_TYPE_Q8_0: set = q8_0; break;
    case GGML_TYPE_Q4_0: set = q4_0; break;
    case GGML_TYPE_Q4_1: set = q4_1; break;
    case GGML_TYPE_F32: set = f32; break;
    case GGML_TYPE_F16: set = f16t; break;
    case GGML_TYPE_BF16: set = bf16; break;
    default: AE_ASSERT(!"unsupported weight type"); return;
    }
    AE_ASSERT(t->tm >= 1 && t->tm <= KN_TILE_M);
    tile_fn wide = set[t->tm - 1][0], narrow = set[t->tm - 1][1];
    int tn = t->tm == 1 ? 4 : 2;
    int64_t j = t->j0;
    for (; j + tn <= t->j1; j += tn) wide(t, j);
    for (; j < t->j1; j++) narrow(t, j);
}

#else /* not x86: kn_cpu_use_avx2 is always false */

void kn_tile_avx2(const kn_tile *t) { kn_tile_scalar(t); }

#endif
