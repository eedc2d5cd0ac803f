/* AVX2 matmul kernel for float W (F32, F16, BF16). It reproduces the
 * portable kernel's arithmetic exactly (kernels.h fixes the order): each
 * weight widened to f32, the same chain of fmas per lane, then the same
 * lane tree.
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
    return type == GGML_TYPE_F16 ? _cvtsh_ss(h) : quant_bf16_to_f32(h);
}

/* Float W: the whole row in one pass (no k segments). */
INL void ftile(ggml_type type, int TM, int TN, const kn_tile *t, int64_t j) {
    const kn_weight *w = t->w;
    int64_t k = w->cols, k8 = k / 8 * 8;
    const uint8_t *rows[8];
    __m256 acc[KN_TILE_M][8];
#pragma GCC unroll 8
    for (int c = 0; c < TN; c++) rows[c] = (const uint8_t *)w->data + (size_t)(j + c) * w->row_bytes;
#pragma GCC unroll 8
    for (int r = 0; r < TM; r++)
#pragma GCC unroll 8
        for (int c = 0; c < TN; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k8; i += 8) {
        __m256 wv[8];
#pragma GCC unroll 8
        for (int c = 0; c < TN; c++) wv[c] = load_w8(type, rows[c], i);
#pragma GCC unroll 8
        for (int r = 0; r < TM; r++) {
            __m256 xv = _mm256_loadu_ps(t->x + (size_t)r * t->x_stride + i);
#pragma GCC unroll 8
            for (int c = 0; c < TN; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < TM; r++)
#pragma GCC unroll 8
        for (int c = 0; c < TN; c++) {
            const float *x = t->x + (size_t)r * t->x_stride;
            float s = hsum8(acc[r][c]);
            for (int64_t i = k8; i < k; i++) s = fmaf(x[i], w_at(type, rows[c], i), s);
            t->y[(size_t)r * t->ldy + (size_t)(j + c)] = s;
        }
}

/* One instance per (type, TM, TN) so the tiles' accumulators live in
 * registers: TM * TN accumulators plus TN weight vectors fit the 16 ymm
 * registers. Small TM takes several weight rows at once (independent
 * chains hide the fma latency); TM >= 5 takes one, each loaded weight
 * vector then feeding TM fmas. */
#define FTILE_FN(name, type, TM, TN) \
    static TGT void name(const kn_tile *t, int64_t j) { ftile(type, TM, TN, t, j); }

#define TILE_SET(pfx, body, type) \
    body##_FN(pfx##_1x4, type, 1, 4) body##_FN(pfx##_1x1, type, 1, 1) body##_FN(pfx##_2x4, type, 2, 4) \
        body##_FN(pfx##_2x1, type, 2, 1) body##_FN(pfx##_3x2, type, 3, 2) body##_FN(pfx##_3x1, type, 3, 1) \
            body##_FN(pfx##_4x2, type, 4, 2) body##_FN(pfx##_4x1, type, 4, 1) body##_FN(pfx##_5x1, type, 5, 1) \
                body##_FN(pfx##_6x1, type, 6, 1) body##_FN(pfx##_7x1, type, 7, 1) \
                    body##_FN(pfx##_8x1, type, 8, 1) static const tile_shape pfx[KN_TILE_M] = { \
                        {pfx##_1x4, pfx##_1x1, 4}, {pfx##_2x4, pfx##_2x1, 4}, {pfx##_3x2, pfx##_3x1, 2}, \
                        {pfx##_4x2, pfx##_4x1, 2}, {pfx##_5x1, pfx##_5x1, 1}, {pfx##_6x1, pfx##_6x1, 1}, \
                        {pfx##_7x1, pfx##_7x1, 1}, {pfx##_8x1, pfx##_8x1, 1}, \
    };

typedef void (*tile_fn)(const kn_tile *t, int64_t j);

/* The kernels for one tile height: `wide` covers tn weight rows per call,
 * `narrow` one (the leftovers). */
typedef struct tile_shape {
    tile_fn wide, narrow;
    int tn;
} tile_shape;

TILE_SET(f32, FTILE, GGML_TYPE_F32)
TILE_SET(f16t, FTILE, GGML_TYPE_F16)
TILE_SET(bf16, FTILE, GGML_TYPE_BF16)

void kn_tile_avx2(const kn_tile *t) {
    const tile_shape *set;
    switch (t->w->type) {
    case GGML_TYPE_F32: set = f32; break;
    case GGML_TYPE_F16: set = f16t; break;
    case GGML_TYPE_BF16: set = bf16; break;
    default: AE_ASSERT(!"unsupported weight type"); return;
    }
    AE_ASSERT(t->tm >= 1 && t->tm <= KN_TILE_M);
    AE_ASSERT(t->j1 - t->j0 <= KN_CHUNK_N);
    const tile_shape *sh = &set[t->tm - 1];
    int64_t j = t->j0;
    for (; j + sh->tn <= t->j1; j += sh->tn) sh->wide(t, j);
    for (; j < t->j1; j++) sh->narrow(t, j);
}

#else /* not x86: kn_cpu_use_avx2 is always false */

void kn_tile_avx2(const kn_tile *t) { kn_tile_scalar(t); }

#endif
