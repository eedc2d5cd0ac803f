/* AVX2 matmul kernel. It reproduces the portable kernel's arithmetic
 * exactly (kernels.h fixes the order): each quantized weight becomes the
 * float quant_dequantize gives (see deq8 for why Q4_1 may use one fma),
 * and each output is the same chain of fmas per lane followed by the same
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

INL __m128i load8(const uint8_t *p) { return _mm_loadl_epi64((const __m128i *)(const void *)p); }

/* Block b of a quantized row with its scale (and Q4_1 offset) in every
 * lane, ready for deq8. */
typedef struct qblk {
    const uint8_t *q;
    __m256 d, m;
} qblk;

INL qblk load_qblk(ggml_type type, const uint8_t *row, int64_t b) {
    qblk o;
    if (type == GGML_TYPE_Q4_1) {
        const kn_blk_q4_1 *blk = (const kn_blk_q4_1 *)(const void *)row + b;
        uint32_t dm;
        memcpy(&dm, blk, sizeof dm); /* d, m: two f16 */
        __m256 v = _mm256_cvtph_ps(_mm_set1_epi32((int32_t)dm));
        o.q = blk->q;
        o.d = _mm256_permute_ps(v, 0x00);
        o.m = _mm256_permute_ps(v, 0x55);
        return o;
    }
    uint16_t d;
    memcpy(&d, row + (size_t)b * (type == GGML_TYPE_Q4_0 ? sizeof(kn_blk_q4_0) : sizeof(kn_blk_q8_0)),
           sizeof d);
    o.d = _mm256_cvtph_ps(_mm_set1_epi16((short)d));
    o.m = _mm256_setzero_ps();
    o.q = type == GGML_TYPE_Q4_0 ? ((const kn_blk_q4_0 *)(const void *)row + b)->q
                                 : (const uint8_t *)((const kn_blk_q8_0 *)(const void *)row + b)->q;
    return o;
}

/* Elements 8g..8g+7 of a block with the values quant_dequantize gives:
 * (float)q * d for Q8_0, (float)(q - 8) * d for Q4_0, (float)q * d + m
 * for Q4_1. For Q4_1 one fma(q, d, m) gives the same float as the
 * product and the sum rounded separately: q <= 15 has 4 significant
 * bits and d (an f16) 11, so q * d is exact in f32 and the only rounding
 * left is the sum's. Nibble elements 0..15 are the low nibbles of bytes
 * 0..15, elements 16..31 the high ones. */
INL __m256 deq8(ggml_type type, const qblk *k, int g) {
    if (type == GGML_TYPE_Q8_0) {
        __m256i v = _mm256_cvtepi8_epi32(load8(k->q + 8 * g));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(v), k->d);
    }
    __m256i v = _mm256_cvtepu8_epi32(load8(k->q + 8 * (g & 1)));
    v = g < 2 ? _mm256_and_si256(v, _mm256_set1_epi32(0x0f)) : _mm256_srli_epi32(v, 4);
    if (type == GGML_TYPE_Q4_0)
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v, _mm256_set1_epi32(8))), k->d);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), k->d, k->m);
}

/* Rows [0, TM) of x against weight rows [j, j + TN) of a quantized W,
 * over blocks [b0, b1) of k. Each block of each weight row is decoded
 * once, 8 elements at a time, and applied to all TM rows of x. The
 * accumulators of a k segment that does not end the row are parked in
 * acc_io (weight row c, x row r at acc_io + (c * TM + r) * 8) and picked
 * up by the next segment: storing a float changes no bit, so the order of
 * kernels.h holds whatever the segmentation. */
INL void qtile(ggml_type type, int TM, int TN, const kn_tile *t, int64_t j, int64_t b0, int64_t b1,
               float *acc_io) {
    const kn_weight *w = t->w;
    int64_t nb = w->cols / KN_QK;
    const uint8_t *rows[8];
    const float *xr[KN_TILE_M];
    __m256 acc[KN_TILE_M][8];
#pragma GCC unroll 8
    for (int c = 0; c < TN; c++) rows[c] = (const uint8_t *)w->data + (size_t)(j + c) * w->row_bytes;
#pragma GCC unroll 8
    for (int r = 0; r < TM; r++) {
        xr[r] = t->x + (size_t)r * t->x_stride + (size_t)b0 * KN_QK;
#pragma GCC unroll 8
        for (int c = 0; c < TN; c++)
            acc[r][c] = b0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(acc_io + (c * TM + r) * 8);
    }
    /* The next TN rows are fetched while these are decoded: the hardware
     * prefetcher is slow to pick up many short row streams. */
    size_t bs = quant_block_bytes(type);
    size_t pf = j + 2 * TN <= w->rows ? (size_t)TN * w->row_bytes : 0;
    for (int64_t b = b0; b < b1; b++) {
        /* One weight row's block at a time keeps few registers live (its
         * scales and bytes); x comes again from L1 for each row. */
#pragma GCC unroll 8
        for (int c = 0; c < TN; c++) {
            _mm_prefetch((const char *)rows[c] + pf + (size_t)b * bs, _MM_HINT_T0);
            qblk kb = load_qblk(type, rows[c], b);
#pragma GCC unroll 4
            for (int g = 0; g < 4; g++) {
                __m256 wv = deq8(type, &kb, g);
#pragma GCC unroll 8
                for (int r = 0; r < TM; r++)
                    acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[r] + 8 * g), wv, acc[r][c]);
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < TM; r++) xr[r] += KN_QK;
    }
#pragma GCC unroll 8
    for (int r = 0; r < TM; r++)
#pragma GCC unroll 8
        for (int c = 0; c < TN; c++) {
            if (b1 == nb)
                t->y[(size_t)r * t->ldy + (size_t)(j + c)] = hsum8(acc[r][c]);
            else
                _mm256_store_ps(acc_io + (c * TM + r) * 8, acc[r][c]);
        }
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
 * chains hide the fma latency); TM >= 5 takes one, each decoded block
 * then feeding TM fmas. */
#define QTILE_FN(name, type, TM, TN)                                                            \
    static TGT void name(const kn_tile *t, int64_t j, int64_t b0, int64_t b1, float *acc_io) {   \
        qtile(type, TM, TN, t, j, b0, b1, acc_io);                                               \
    }
#define FTILE_FN(name, type, TM, TN)                                                            \
    static TGT void name(const kn_tile *t, int64_t j, int64_t b0, int64_t b1, float *acc_io) {   \
        (void)b0;                                                                                \
        (void)b1;                                                                                \
        (void)acc_io;                                                                            \
        ftile(type, TM, TN, t, j);                                                               \
    }

#define TILE_SET(pfx, body, type)                                            \
    body##_FN(pfx##_1x4, type, 1, 4)                                     \
    body##_FN(pfx##_1x1, type, 1, 1)                                     \
    body##_FN(pfx##_2x4, type, 2, 4)                                     \
    body##_FN(pfx##_2x1, type, 2, 1)                                     \
    body##_FN(pfx##_3x2, type, 3, 2)                                     \
    body##_FN(pfx##_3x1, type, 3, 1)                                     \
    body##_FN(pfx##_4x2, type, 4, 2)                                     \
    body##_FN(pfx##_4x1, type, 4, 1)                                     \
    body##_FN(pfx##_5x1, type, 5, 1)                                     \
    body##_FN(pfx##_6x1, type, 6, 1)                                     \
    body##_FN(pfx##_7x1, type, 7, 1)                                     \
    body##_FN(pfx##_8x1, type, 8, 1)                                     \
    static const tile_shape pfx[KN_TILE_M] = {                               \
        {pfx##_1x4, pfx##_1x1, 4}, {pfx##_2x4, pfx##_2x1, 4},                \
        {pfx##_3x2, pfx##_3x1, 2}, {pfx##_4x2, pfx##_4x1, 2},                \
        {pfx##_5x1, pfx##_5x1, 1}, {pfx##_6x1, pfx##_6x1, 1},                \
        {pfx##_7x1, pfx##_7x1, 1}, {pfx##_8x1, pfx##_8x1, 1},                \
    };

typedef void (*tile_fn)(const kn_tile *t, int64_t j, int64_t b0, int64_t b1, float *acc_io);

/* The kernels for one tile height: `wide` covers tn weight rows per call,
 * `narrow` one (the leftovers). */
typedef struct tile_shape {
    tile_fn wide, narrow;
    int tn;
} tile_shape;

TILE_SET(q8_0, QTILE, GGML_TYPE_Q8_0)
TILE_SET(q4_0, QTILE, GGML_TYPE_Q4_0)
TILE_SET(q4_1, QTILE, GGML_TYPE_Q4_1)
TILE_SET(f32, FTILE, GGML_TYPE_F32)
TILE_SET(f16t, FTILE, GGML_TYPE_F16)
TILE_SET(bf16, FTILE, GGML_TYPE_BF16)

/* Quantized W: k is cut into segments whose slice of the x tile stays in
 * L1 next to the chunk's slice of W (8 rows of a 1536-wide x are 48 KiB,
 * more than a 32 KiB L1). */
#define KN_X_L1_BYTES (24 * 1024)

void kn_tile_avx2(const kn_tile *t) {
    const tile_shape *set;
    bool quant = true;
    switch (t->w->type) {
    case GGML_TYPE_Q8_0: set = q8_0; break;
    case GGML_TYPE_Q4_0: set = q4_0; break;
    case GGML_TYPE_Q4_1: set = q4_1; break;
    case GGML_TYPE_F32: set = f32; quant = false; break;
    case GGML_TYPE_F16: set = f16t; quant = false; break;
    case GGML_TYPE_BF16: set = bf16; quant = false; break;
    default: AE_ASSERT(!"unsupported weight type"); return;
    }
    AE_ASSERT(t->tm >= 1 && t->tm <= KN_TILE_M);
    AE_ASSERT(t->j1 - t->j0 <= KN_CHUNK_N);
    const tile_shape *sh = &set[t->tm - 1];
    int64_t nb = t->w->cols / KN_QK, seg = nb;
    if (quant) { /* equal segments, each within the budget */
        int64_t most = KN_X_L1_BYTES / (t->tm * KN_QK * (int64_t)sizeof(float));
        int64_t n_seg = (nb + most - 1) / most;
        seg = (nb + n_seg - 1) / n_seg;
    }
    float acc_io[KN_CHUNK_N * KN_TILE_M * 8] __attribute__((aligned(32)));
    int64_t b0 = 0;
    do { /* one pass for float W */
        int64_t b1 = b0 + seg < nb ? b0 + seg : nb;
        int64_t j = t->j0;
        for (; j + sh->tn <= t->j1; j += sh->tn) sh->wide(t, j, b0, b1, acc_io + (j - t->j0) * t->tm * 8);
        for (; j < t->j1; j++) sh->narrow(t, j, b0, b1, acc_io + (j - t->j0) * t->tm * 8);
        b0 = b1;
    } while (quant && b0 < nb);
}

#else /* not x86: kn_cpu_use_avx2 is always false */

void kn_tile_avx2(const kn_tile *t) { kn_tile_scalar(t); }

#endif
