/* Matrix product with quantized weights in integers: Q8_0, Q4_0, Q4_1,
 * Q5_0, Q5_1, IQ4_NL, MXFP4 and the 256-element Q2_K, Q3_K, Q4_K, Q5_K,
 * Q6_K and IQ4_XS (kernels.h states the contract of each).
 *
 * x is quantized per block of 32 to integers xi with |xi| <= 16256 (15
 * bits) or |xi| <= 127 (8 bits, the stream's choice) and one f32 scale
 * per block (kernels.h gives the exact rule). Each block of
 * a weight row then contributes an exact integer dot product, scaled in
 * f32 in a fixed order. Integer sums have no order, so every kernel (the
 * portable one here on the file's layout, the AVX-512 VNNI one on the
 * packed layout) gives the same bits by construction.
 *
 * Why integers: a decode step is bound by reading the weights, but only
 * if the kernel turns 4-bit weights into products faster than memory
 * delivers them. Widening every weight to f32 and using fmas did not
 * (0.19 of the bandwidth roofline at 2 threads); VNNI multiplies 64 byte
 * pairs per instruction. xi needs about 15 bits to keep the logits within
 * 1e-3 of the f32 reference (8-bit activations gave 5% error), so xi is
 * split into two signed bytes, hi and lo, and each block costs two
 * dot products per weight byte. The 8-bit precision keeps xi in one
 * signed byte, as llama.cpp's Q8_0 activations do: one dot product per
 * weight byte, half the work of a pass of several tokens, for about 5%
 * error in the logits.
 *
 * This file: x quantization, packing, the portable kernel (every type,
 * each block decoded to integers once per tile of tokens) and the
 * driver. SIMD kernels on the packed layouts: kn_qmatmul_avx512.c (VNNI:
 * Q8_0, Q4_0, Q4_1), kn_qmatmul_avx2.c (the same three),
 * kn_qmatmul_q5_avx2.c (Q5_0, Q5_1, IQ4_NL, MXFP4) and
 * kn_qmatmul_kquant_avx2.c (Q4_K, Q5_K, Q6_K, IQ4_XS). Q2_K and Q3_K run
 * the portable kernel. */
#include "kn_cpu_impl.h"

#include <float.h>
#include <math.h>
#include <string.h>

bool kn_qmatmul_type(ggml_type t) {
    switch (t) {
    case GGML_TYPE_Q8_0:
    case GGML_TYPE_Q4_0:
    case GGML_TYPE_Q4_1:
    case GGML_TYPE_Q5_0:
    case GGML_TYPE_Q5_1:
    case GGML_TYPE_IQ4_NL:
    case GGML_TYPE_MXFP4:
    case GGML_TYPE_Q2_K:
    case GGML_TYPE_Q3_K:
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q5_K:
    case GGML_TYPE_Q6_K:
    case GGML_TYPE_IQ4_XS: return true;
    default: return false;
    }
}

/* The types with a packed layout and SIMD kernels. */
static bool packed_type(ggml_type t) {
    return t == GGML_TYPE_Q8_0 || t == GGML_TYPE_Q4_0 || t == GGML_TYPE_Q4_1 || t == GGML_TYPE_Q5_0 ||
           t == GGML_TYPE_Q5_1 || t == GGML_TYPE_IQ4_NL || t == GGML_TYPE_MXFP4 || t == GGML_TYPE_Q2_K ||
           t == GGML_TYPE_Q3_K || t == GGML_TYPE_Q4_K || t == GGML_TYPE_Q5_K || t == GGML_TYPE_Q6_K ||
           t == GGML_TYPE_IQ4_XS;
}

/* ---- x ------------------------------------------------------------------ */

size_t kn_qx_row_bytes(int64_t k, int bits) {
    size_t nb = (size_t)(k / KN_QK);
    return (nb * (kn_qx_block_bytes(bits) + 5 * sizeof(float)) + 63) & ~(size_t)63;
}

kn_qx kn_qx_view(const uint8_t *row, int64_t k, int bits) {
    size_t nb = (size_t)(k / KN_QK);
    const uint8_t *a = row + nb * kn_qx_block_bytes(bits);
    kn_qx q = {
        .planes = (const int8_t *)row,
        .sx = (const float *)(const void *)a,
        .xs = (const float *)(const void *)(a + nb * sizeof(float)),
        .isx = (const int32_t *)(const void *)(a + 2 * nb * sizeof(float)),
        .isx16 = (const int32_t *)(const void *)(a + 3 * nb * sizeof(float)),
    };
    return q;
}

/* Round to the nearest integer, ties to even, for |v| < 2^22: adding and
 * subtracting 1.5 * 2^23 leaves the integer part in the mantissa. Exact
 * under the default rounding mode, and the compiler may vectorize it
 * (lrintf is a library call). */
static float round_even(float v) { return (v + 12582912.0f) - 12582912.0f; }

/* isx16 from the bytes of x already written: the AVX-512 quantizer
 * writes the rest of the row (the portable one sums the halves as it
 * goes). */
static void half_sums(int64_t k, int bits, uint8_t *row) {
    int64_t nb = k / KN_QK;
    size_t bpb = kn_qx_block_bytes(bits);
    int32_t *isx16 = (int32_t *)(void *)(row + (size_t)nb * bpb + 3 * (size_t)nb * sizeof(float));
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *hi = (const int8_t *)row + (size_t)b * bpb, *lo = hi + KN_QK;
        for (int h = 0; h < 2; h++) {
            int32_t sum = 0;
            for (int i = 16 * h; i < 16 * h + 16; i++) sum += bits == 8 ? hi[i] : 128 * hi[i] + lo[i];
            isx16[2 * b + h] = sum;
        }
    }
}

void kn_qx_quantize(const float *x, int64_t k, int bits, uint8_t *row) {
    AE_ASSERT(bits == 8 || bits == 15);
    if (kn_cpu_use_avx512vnni()) {
        kn_qx_quantize_avx512(x, k, bits, row);
        half_sums(k, bits, row);
        return;
    }
    int64_t nb = k / KN_QK;
    size_t bpb = kn_qx_block_bytes(bits);
    const int32_t lim = bits == 8 ? KN_QX8_MAX : KN_QX_MAX;
    float *sx = (float *)(void *)(row + (size_t)nb * bpb);
    float *xs = sx + nb;
    int32_t *isx = (int32_t *)(void *)(xs + nb), *isx16 = isx + nb;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * KN_QK;
        int8_t *hi = (int8_t *)row + (size_t)b * bpb, *lo = hi + KN_QK; /* at 8 bits, hi is xi */
        float amax = 0.0f;
        bool finite = true;
        for (int i = 0; i < KN_QK; i++) {
            float a = fabsf(xb[i]);
            finite &= a <= FLT_MAX; /* false for inf and NaN */
            amax = a > amax ? a : amax;
        }
        int32_t sum = 0, half = 0; /* half: the sum of elements 0..15 */
        if (!finite || amax < KN_QX_TINY) {
            /* Zero (or below KN_QX_TINY, where lim / amax would
             * overflow): every product is 0. Not finite: the scale is NaN,
             * so every output this block touches becomes NaN, as in f32. */
            memset(hi, 0, bpb);
            sx[b] = finite ? 0.0f : NAN;
        } else {
            float inv = (float)lim / amax;
            sx[b] = amax / (float)lim;
            for (int i = 0; i < KN_QK; i++) {
                int32_t v = (int32_t)round_even(xb[i] * inv);
                v = v > lim ? lim : v < -lim ? -lim : v;
                if (bits == 8) {
                    hi[i] = (int8_t)v;
                } else {
                    int32_t h = (v + 64) >> 7; /* floor: hi in [-127, 127], lo in [-64, 63] */
                    hi[i] = (int8_t)h;
                    lo[i] = (int8_t)(v - 128 * h);
                }
                sum += v;
                if (i == 15) half = sum;
            }
        }
        isx[b] = sum;
        isx16[2 * b] = half;
        isx16[2 * b + 1] = sum - half;
        xs[b] = sx[b] * (float)sum;
    }
}

/* ---- packing -------------------------------------------------------------- */

size_t kn_pack_block_bytes(ggml_type t) { return KN_PACK_ROWS * (size_t)quant_block_bytes(t); }

size_t kn_weight_packed_bytes(const kn_weight *w) {
    if (!packed_type(w->type)) return 0;
    return (size_t)(w->rows / KN_PACK_ROWS) * (size_t)(w->cols / quant_block_elems(w->type)) *
           kn_pack_block_bytes(w->type);
}

/* Row r's nibble pairs in a packed Q4-style group: vector v's lane r
 * holds elements 4v..4v+3 in its low nibbles and 4(v+4)..4(v+4)+3 in its
 * high ones. A block's bytes 0..15 hold elements 0..15 low and 16..31
 * high, so element 4v+e and element 16+4v+e share byte 4v+e: the pairs
 * are the block's own bytes, four at a time. */
static void pack_nibble_pairs(const uint8_t qs[16], int r, uint8_t *dst) {
    for (int v = 0; v < 4; v++) memcpy(dst + (v * 16 + r) * 4, qs + 4 * v, 4);
}

/* Packed (group, block), the layout the VNNI kernel reads: 32-bit lane r
 * of a 64-byte vector holds 4 consecutive elements of row r, so one
 * vpdpbusd against 4 broadcast bytes of x advances 16 rows by 4 elements.
 *   Q8_0: 8 vectors (elements 4v..4v+3), bytes q + 128 (unsigned), then
 *         the 16 rows' f16 d.
 *   Q4_*: 4 vectors of nibble pairs: low nibble elements 4v..4v+3, high
 *         nibble elements 4(v+4)..4(v+4)+3; then 16 d, then (Q4_1) 16 m. */
static void pack_kquant(ggml_type t, const uint8_t *const rows[KN_PACK_ROWS], int64_t b, uint8_t *dst);

/* Packed (group, block) of Q5_0, Q5_1, IQ4_NL and MXFP4 (the AVX2 kernel
 * of kn_qmatmul_q5_avx2.c reads it): the Q4 nibble pairs of the low four
 * bits (256 bytes); then Q5's fifth bits (64 bytes: bit v of byte 4r + e
 * is element 4v + e's); then the 16 rows' f16 d (MXFP4: their E8M0
 * bytes) and Q5_1's 16 f16 m. The same bytes as the 16 blocks. */
static void pack_q32(ggml_type t, const uint8_t *const rows[KN_PACK_ROWS], int64_t b, uint8_t *dst) {
    const size_t bb = quant_block_bytes(t);
    const bool q5 = t == GGML_TYPE_Q5_0 || t == GGML_TYPE_Q5_1;
    const size_t d_at = q5 ? 320 : 256;
    for (int r = 0; r < KN_PACK_ROWS; r++) {
        const uint8_t *blk = rows[r] + (size_t)b * bb;
        const uint8_t *qs = blk + (t == GGML_TYPE_Q5_0 ? 6 : t == GGML_TYPE_Q5_1 ? 8 : t == GGML_TYPE_MXFP4 ? 1 : 2);
        uint32_t hb = 0;
        if (q5) memcpy(&hb, blk + (t == GGML_TYPE_Q5_1 ? 4 : 2), 4);
        pack_nibble_pairs(qs, r, dst);
        if (q5)
            for (int e = 0; e < 4; e++) {
                uint8_t bits = 0;
                for (int v = 0; v < 8; v++) bits |= (uint8_t)(((hb >> (4 * v + e)) & 1u) << v);
                dst[256 + 4 * r + e] = bits;
            }
        if (t == GGML_TYPE_MXFP4)
            dst[d_at + r] = blk[0];
        else
            memcpy(dst + d_at + 2 * r, blk, 2);
        if (t == GGML_TYPE_Q5_1) memcpy(dst + d_at + 32 + 2 * r, blk + 2, 2);
    }
}

static void pack_block(ggml_type t, const uint8_t *const rows[KN_PACK_ROWS], int64_t b, uint8_t *dst) {
    size_t bb = quant_block_bytes(t);
    if (quant_block_elems(t) == 256) {
        pack_kquant(t, rows, b, dst);
        return;
    }
    if (t != GGML_TYPE_Q8_0 && t != GGML_TYPE_Q4_0 && t != GGML_TYPE_Q4_1) {
        pack_q32(t, rows, b, dst);
        return;
    }
    for (int r = 0; r < KN_PACK_ROWS; r++) {
        const uint8_t *blk = rows[r] + (size_t)b * bb;
        if (t == GGML_TYPE_Q8_0) {
            for (int v = 0; v < 8; v++)
                for (int e = 0; e < 4; e++) dst[(v * 16 + r) * 4 + e] = blk[2 + 4 * v + e] ^ 0x80;
            memcpy(dst + 512 + 2 * r, blk, 2);
        } else {
            pack_nibble_pairs(blk + (t == GGML_TYPE_Q4_1 ? 4 : 2), r, dst);
            memcpy(dst + 256 + 2 * r, blk, 2);
            if (t == GGML_TYPE_Q4_1) memcpy(dst + 288 + 2 * r, blk + 2, 2);
        }
    }
}

void kn_weight_pack(kn_weight *w, void *dst) {
    size_t total = kn_weight_packed_bytes(w);
    AE_ASSERT(total > 0 && ((uintptr_t)dst & 63) == 0);
    int64_t nb = w->cols / quant_block_elems(w->type), ng = w->rows / KN_PACK_ROWS;
    size_t pb = kn_pack_block_bytes(w->type);
    uint8_t *out = dst;
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *rows[KN_PACK_ROWS];
        for (int r = 0; r < KN_PACK_ROWS; r++)
            rows[r] = (const uint8_t *)w->data + (size_t)(g * KN_PACK_ROWS + r) * w->row_bytes;
        for (int64_t b = 0; b < nb; b++) pack_block(w->type, rows, b, out + ((size_t)g * (size_t)nb + (size_t)b) * pb);
    }
    w->packed = dst;
    w->pack_stride = (size_t)nb * pb;
}

/* ---- portable kernel ------------------------------------------------------ */

/* One block of a weight row as integers: v[i] the integer value of
 * element i (its quant less the type's offset), sc[h] and mn[h] the
 * integer scale and min of 16-element sub-block h (1 and 0 for the
 * 32-element types), d and dmin the float factors, and whether the type
 * adds a min (K-quants: - dmin * mn * sum xi; Q4_1, Q5_1: + m * xs). */
typedef struct qunit {
    int32_t n; /* elements: 32 or 256 */
    int8_t v[256];
    int16_t sc[16], mn[16];
    float d, dmin;
    enum { MIN_NONE, MIN_K, MIN_M } min;
} qunit;

static float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return quant_f16_to_f32(h);
}

/* The 6-bit (scale, min) pair j of Q4_K's and Q5_K's 12 scale bytes. */
static void k4_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Element i (0..31) of a 32-element run of nibbles in Q4_0's order. */
static int nib32(const uint8_t *qs, int i) { return i < 16 ? qs[i] & 15 : qs[i - 16] >> 4; }

static void decode_unit(ggml_type t, const uint8_t *b, qunit *u) {
    u->n = t == GGML_TYPE_Q2_K || t == GGML_TYPE_Q3_K || t == GGML_TYPE_Q4_K || t == GGML_TYPE_Q5_K ||
                   t == GGML_TYPE_Q6_K || t == GGML_TYPE_IQ4_XS
               ? 256
               : 32;
    u->min = MIN_NONE;
    u->dmin = 0.0f;
    for (int h = 0; h < u->n / 16; h++) u->sc[h] = 1, u->mn[h] = 0;
    switch (t) {
    case GGML_TYPE_Q8_0:
        u->d = half_at(b);
        for (int i = 0; i < 32; i++) u->v[i] = (int8_t)b[2 + i];
        break;
    case GGML_TYPE_Q4_0:
        u->d = half_at(b);
        for (int i = 0; i < 32; i++) u->v[i] = (int8_t)(nib32(b + 2, i) - 8);
        break;
    case GGML_TYPE_Q4_1:
        u->d = half_at(b), u->dmin = half_at(b + 2), u->min = MIN_M;
        for (int i = 0; i < 32; i++) u->v[i] = (int8_t)nib32(b + 4, i);
        break;
    case GGML_TYPE_Q5_0:
    case GGML_TYPE_Q5_1: {
        bool q51 = t == GGML_TYPE_Q5_1;
        const uint8_t *qh = b + (q51 ? 4 : 2), *qs = qh + 4;
        uint32_t hb = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
        u->d = half_at(b);
        if (q51) u->dmin = half_at(b + 2), u->min = MIN_M;
        for (int i = 0; i < 32; i++) u->v[i] = (int8_t)((nib32(qs, i) | (int)((hb >> i) & 1u) << 4) - (q51 ? 0 : 16));
        break;
    }
    case GGML_TYPE_IQ4_NL:
        u->d = half_at(b);
        for (int i = 0; i < 32; i++) u->v[i] = quant_kvalues_iq4nl[nib32(b + 2, i)];
        break;
    case GGML_TYPE_MXFP4:
        u->d = quant_e8m0_to_f32_half(b[0]);
        for (int i = 0; i < 32; i++) u->v[i] = quant_kvalues_mxfp4[nib32(b + 1, i)];
        break;
    case GGML_TYPE_Q2_K: {
        /* scales[16] (scale low nibble, min high), qs[64], d, dmin. Element
         * 128 h + 32 j + 16 g + l is bits 2j of qs[32 h + 16 g + l]. */
        const uint8_t *q = b + 16;
        u->d = half_at(b + 80), u->dmin = half_at(b + 82), u->min = MIN_K;
        for (int h = 0; h < 16; h++) u->sc[h] = b[h] & 15, u->mn[h] = b[h] >> 4;
        for (int e = 0; e < 256; e++) {
            int h = e / 128, j = e / 32 % 4, gl = e % 32;
            u->v[e] = (int8_t)((q[32 * h + gl] >> (2 * j)) & 3);
        }
        break;
    }
    case GGML_TYPE_Q3_K: {
        /* hmask[32], qs[64], scales[12] (sixteen 6-bit, offset 32), d.
         * Element 128 h + 32 j + 16 g + l: bits 2j of qs[32 h + 16 g + l],
         * less 4 when bit 4 h + j of hmask[16 g + l] is clear. */
        const uint8_t *hm = b, *q = b + 32, *s = b + 96;
        u->d = half_at(b + 108);
        for (int k = 0; k < 16; k++) {
            int lo = k < 8 ? s[k] & 15 : s[k - 8] >> 4, hi = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
            u->sc[k] = (int16_t)((lo | hi << 4) - 32);
        }
        for (int e = 0; e < 256; e++) {
            int h = e / 128, j = e / 32 % 4, gl = e % 32;
            int v = (q[32 * h + gl] >> (2 * j)) & 3;
            u->v[e] = (int8_t)(v - (((hm[gl] >> (4 * h + j)) & 1) ? 0 : 4));
        }
        break;
    }
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q5_K: {
        /* d, dmin, scales[12], (Q5_K: qh[32]), qs[128]. Element 64 c +
         * 32 p + l: nibble p of qs[32 c + l]; Q5_K's fifth bit is bit
         * 2 c + p of qh[l]. */
        bool q5 = t == GGML_TYPE_Q5_K;
        const uint8_t *qh = b + 16, *q = b + (q5 ? 48 : 16);
        u->d = half_at(b), u->dmin = half_at(b + 2), u->min = MIN_K;
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            k4_scale_min(b + 4, j, &sc, &mn);
            u->sc[2 * j] = u->sc[2 * j + 1] = (int16_t)sc;
            u->mn[2 * j] = u->mn[2 * j + 1] = (int16_t)mn;
        }
        for (int e = 0; e < 256; e++) {
            int c = e / 64, p = e / 32 % 2, l = e % 32;
            int v = (q[32 * c + l] >> (4 * p)) & 15;
            if (q5) v |= ((qh[l] >> (2 * c + p)) & 1) << 4;
            u->v[e] = (int8_t)v;
        }
        break;
    }
    case GGML_TYPE_Q6_K: {
        /* ql[128], qh[64], scales[16] (int8), d. Element 128 h + 32 r + l:
         * nibble r / 2 of ql[64 h + 32 (r % 2) + l], with bits 2r of
         * qh[32 h + l] above it; less 32. */
        const uint8_t *ql = b, *qh = b + 128;
        u->d = half_at(b + 208);
        for (int k = 0; k < 16; k++) u->sc[k] = (int8_t)b[192 + k];
        for (int e = 0; e < 256; e++) {
            int h = e / 128, r = e / 32 % 4, l = e % 32;
            int v = ((ql[64 * h + 32 * (r % 2) + l] >> (4 * (r / 2))) & 15) | ((qh[32 * h + l] >> (2 * r)) & 3) << 4;
            u->v[e] = (int8_t)(v - 32);
        }
        break;
    }
    case GGML_TYPE_IQ4_XS: {
        /* d, scales_h (u16: bits 2j of sub-block j's scale, high two),
         * scales_l[4] (nibble j % 2 of byte j / 2: the low four), qs[128]
         * (16 bytes a sub-block, in Q4_0's order); scale less 32. */
        uint32_t sh = (uint32_t)b[2] | (uint32_t)b[3] << 8;
        u->d = half_at(b);
        for (int j = 0; j < 8; j++) {
            int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (int)((sh >> (2 * j)) & 3u) << 4;
            u->sc[2 * j] = u->sc[2 * j + 1] = (int16_t)(ls - 32);
            for (int i = 0; i < 32; i++) u->v[32 * j + i] = quant_kvalues_iq4nl[nib32(b + 8 + 16 * j, i)];
        }
        break;
    }
    default: AE_ASSERT(!"decode_unit: a type the integer matmul does not take");
    }
}

/* Packed unit of Q4_K, Q5_K or Q6_K (kn_qmatmul_kquant_avx2.c reads it):
 * 16 rows of super-block b. Per 32-element sub-block j, 256 bytes at
 * 256 j: Q4 nibble pairs of the quants' low four bits (byte (16 v + r) 4
 * + e: element 4v + e of row r low, 4(v + 4) + e high). Then, per
 * sub-block, Q5_K's fifth bits (64 bytes at 2048 + 64 j: bit v of byte
 * 4r + e is element 4v + e's) or Q6_K's top two bits (128 bytes at 2048 +
 * 128 j: bits 2s of byte (16 u + r) 4 + e are element 4(u + 2s) + e's).
 * Then the scale bytes as planes (byte k of row r at 16 k + r: 12 for
 * Q4_K and Q5_K, 16 for Q6_K), then 16 f16 d and (not Q6_K) 16 dmin. The
 * same bytes as the 16 rows' blocks. Q6_K's quants are packed as stored,
 * 0..63, and the kernel takes the 32 off. */
/* IQ4_XS's packed unit: each sub-block's nibble pairs (its 16 bytes are in
 * Q4_0's order), then the six scale bytes (scales_h's two, scales_l's
 * four) as planes, then the 16 rows' f16 d: the same 2176 bytes as the 16
 * blocks. */
static void pack_iq4_xs(const uint8_t *const rows[KN_PACK_ROWS], int64_t b, uint8_t *dst) {
    for (int r = 0; r < KN_PACK_ROWS; r++) {
        const uint8_t *blk = rows[r] + (size_t)b * quant_block_bytes(GGML_TYPE_IQ4_XS);
        for (int j = 0; j < 8; j++) pack_nibble_pairs(blk + 8 + 16 * j, r, dst + 256 * j);
        for (int k = 0; k < 6; k++) dst[2048 + 16 * k + r] = blk[2 + k];
        memcpy(dst + 2048 + 96 + 2 * r, blk, 2);
    }
}

/* Q2_K's and Q3_K's packed unit: per sub-block j, the quants' low two
 * bits as 128 bytes at 128 j (bits 2s of byte (16 u + r) 4 + e are
 * element 4(u + 2s) + e's, u = 0, 1); then Q3_K's third bits, 64 bytes
 * per sub-block at 1024 + 64 j (bit v of byte 4r + e is element 4v + e's:
 * Q5_K's fifth-bit layout); then the scale bytes as planes (byte k of row
 * r at 16 k + r: Q2_K's 16, Q3_K's 12), then the 16 rows' f16 d and (Q2_K)
 * dmin. The same bytes as the 16 blocks: 1344 (Q2_K) and 1760 (Q3_K).
 * In the file, element l of sub-block j has its two bits at bits 2 (j %
 * 4) of qs[32 (j / 4) + l] and (Q3_K) its third at bit j of hmask[l]. */
static void pack_low_k(ggml_type t, const uint8_t *const rows[KN_PACK_ROWS], int64_t b, uint8_t *dst) {
    const bool q3 = t == GGML_TYPE_Q3_K;
    const size_t bb = quant_block_bytes(t), sc_at = q3 ? 1536 : 1024, d_at = sc_at + (q3 ? 192 : 256);
    for (int r = 0; r < KN_PACK_ROWS; r++) {
        const uint8_t *blk = rows[r] + (size_t)b * bb, *hm = blk, *qs = blk + (q3 ? 32 : 16);
        for (int j = 0; j < 8; j++) {
            const uint8_t *run = qs + 32 * (j / 4);
            const int cs = 2 * (j % 4);
            for (int u = 0; u < 2; u++)
                for (int e = 0; e < 4; e++) {
                    uint8_t crumbs = 0;
                    for (int s2 = 0; s2 < 4; s2++)
                        crumbs |= (uint8_t)(((run[4 * (u + 2 * s2) + e] >> cs) & 3) << (2 * s2));
                    dst[128 * j + (u * 16 + r) * 4 + e] = crumbs;
                }
            if (q3)
                for (int e = 0; e < 4; e++) {
                    uint8_t bits = 0;
                    for (int v = 0; v < 8; v++) bits |= (uint8_t)(((hm[4 * v + e] >> j) & 1) << v);
                    dst[1024 + 64 * j + 4 * r + e] = bits;
                }
        }
        for (int k = 0; k < (q3 ? 12 : 16); k++) dst[sc_at + 16 * (size_t)k + (size_t)r] = blk[q3 ? 96 + k : k];
        memcpy(dst + d_at + 2 * r, blk + (q3 ? 108 : 80), 2);
        if (!q3) memcpy(dst + d_at + 32 + 2 * r, blk + 82, 2);
    }
}

static void pack_kquant(ggml_type t, const uint8_t *const rows[KN_PACK_ROWS], int64_t b, uint8_t *dst) {
    if (t == GGML_TYPE_IQ4_XS) {
        pack_iq4_xs(rows, b, dst);
        return;
    }
    if (t == GGML_TYPE_Q2_K || t == GGML_TYPE_Q3_K) {
        pack_low_k(t, rows, b, dst);
        return;
    }
    /* Straight from the blocks' bytes (decode_unit's layouts): element l
     * of sub-block j sits in byte l of a 32-byte run, so the nibble pair
     * of elements 4v + e and 16 + 4v + e takes bytes 4v + e and 16 + 4v +
     * e of that run. */
    const size_t bb = quant_block_bytes(t);
    const bool q6 = t == GGML_TYPE_Q6_K;
    const size_t sc_at = t == GGML_TYPE_Q4_K ? 2048 : t == GGML_TYPE_Q5_K ? 2048 + 8 * 64 : 2048 + 8 * 128;
    const size_t d_at = sc_at + (q6 ? 256 : 192);
    for (int r = 0; r < KN_PACK_ROWS; r++) {
        const uint8_t *blk = rows[r] + (size_t)b * bb;
        for (int j = 0; j < 8; j++) {
            /* Sub-block j's low nibbles: Q4_K and Q5_K nibble j % 2 of
             * qs[32 (j / 2) + l]; Q6_K nibble (j % 4) / 2 of ql[64 (j / 4)
             * + 32 (j % 2) + l]. */
            const uint8_t *run =
                q6 ? blk + 64 * (j / 4) + 32 * (j % 2) : blk + (t == GGML_TYPE_Q5_K ? 48 : 16) + 32 * (j / 2);
            const int shift = q6 ? 4 * ((j % 4) / 2) : 4 * (j % 2);
            for (int v = 0; v < 4; v++)
                for (int e = 0; e < 4; e++) {
                    int l = 4 * v + e;
                    dst[256 * j + (v * 16 + r) * 4 + e] =
                        (uint8_t)(((run[l] >> shift) & 15) | ((run[16 + l] >> shift) & 15) << 4);
                }
            if (t == GGML_TYPE_Q5_K) {
                /* Element l's fifth bit: bit j of qh[l]. */
                const uint8_t *qh = blk + 16;
                for (int e = 0; e < 4; e++) {
                    uint8_t bits = 0;
                    for (int v = 0; v < 8; v++) bits |= (uint8_t)(((qh[4 * v + e] >> j) & 1) << v);
                    dst[2048 + 64 * j + 4 * r + e] = bits;
                }
            }
            if (q6) {
                /* Element l's top two bits: bits 2 (j % 4) of qh[32 (j / 4)
                 * + l], at 128 + that in the block. */
                const uint8_t *qh = blk + 128 + 32 * (j / 4);
                const int hs = 2 * (j % 4);
                for (int uu = 0; uu < 2; uu++)
                    for (int e = 0; e < 4; e++) {
                        uint8_t bits = 0;
                        for (int s2 = 0; s2 < 4; s2++)
                            bits |= (uint8_t)(((qh[4 * (uu + 2 * s2) + e] >> hs) & 3) << (2 * s2));
                        dst[2048 + 128 * j + (uu * 16 + r) * 4 + e] = bits;
                    }
            }
        }
        for (int k = 0; k < (q6 ? 16 : 12); k++) dst[sc_at + 16 * (size_t)k + (size_t)r] = blk[(q6 ? 192 : 4) + k];
        memcpy(dst + d_at + 2 * r, blk + (q6 ? 208 : 0), 2);
        if (!q6) memcpy(dst + d_at + 32 + 2 * r, blk + 2, 2);
    }
}

/* Activation block b against elements [32a, 32a + 32) of unit u, in the
 * order kernels.h fixes. The integer sums are exact: in int64 here, and
 * each fits int32 by the bounds kernels.h states. */
static float unit_block(const qunit *u, int a, const kn_qx *q, int64_t b, int bits, float acc) {
    const int8_t *xb = q->planes + (size_t)b * kn_qx_block_bytes(bits);
    int64_t isum = 0, imin = 0;
    for (int h = 0; h < 2; h++) {
        int64_t dot = 0;
        for (int i = 16 * h; i < 16 * h + 16; i++) {
            int32_t xi = bits == 8 ? xb[i] : 128 * xb[i] + xb[i + KN_QK];
            dot += (int64_t)u->v[32 * a + i] * xi;
        }
        isum += u->sc[2 * a + h] * dot;
        imin += (int64_t)u->mn[2 * a + h] * q->isx16[2 * b + h];
    }
    AE_ASSERT(isum >= INT32_MIN && isum <= INT32_MAX && imin >= INT32_MIN && imin <= INT32_MAX);
    acc = fmaf((float)(int32_t)isum, u->d * q->sx[b], acc);
    if (u->min == MIN_K) acc = fmaf(-(float)(int32_t)imin, u->dmin * q->sx[b], acc);
    if (u->min == MIN_M) acc = fmaf(u->dmin, q->xs[b], acc);
    return acc;
}

/* Weight row `row` (the file's layout) against tm tokens of quantized x
 * of nb blocks of 32, y[r * ldy] for token r: each unit of the row is
 * decoded once for all tm tokens. */
static void qdot_tile(ggml_type t, const uint8_t *row, const kn_qx *q, int tm, int64_t nb, int bits, float *y,
                      size_t ldy) {
    size_t bb = quant_block_bytes(t);
    int64_t per = quant_block_elems(t) / KN_QK; /* activation blocks a unit */
    float acc[KN_TILE_M] = {0};
    qunit u;
    for (int64_t b = 0; b < nb; b += per, row += bb) {
        decode_unit(t, row, &u);
        for (int r = 0; r < tm; r++)
            for (int a = 0; a < per; a++) acc[r] = unit_block(&u, a, &q[r], b + a, bits, acc[r]);
    }
    for (int r = 0; r < tm; r++) y[(size_t)r * ldy] = acc[r];
}

/* ---- driver ------------------------------------------------------------- */

#define KN_MM_MAX_W 4 /* weights per fused call */

/* Rows per unit of work: one packed group. The packed layout keeps a
 * thread's run of groups contiguous in memory, so small units cost no
 * streaming, and they split o_proj's 576 rows evenly over 2 threads
 * (64-row units left one thread 5 of 9). */
#define KN_QCHUNK KN_PACK_ROWS

typedef struct qmm_job {
    int n_w;
    const kn_weight *w[KN_MM_MAX_W];
    float *y[KN_MM_MAX_W];           /* [m][w->rows] each */
    int64_t chunks[KN_MM_MAX_W + 1]; /* prefix sums of each weight's chunks */
    const float *x;                  /* [m][k] */
    int64_t k;
    uint8_t *qx; /* [m][kn_qx_row_bytes(k)] */
    size_t qx_stride;
    int bits; /* 15 or 8: the stream's precision of x */
    int64_t m;
    bool vnni, avx2; /* packed groups: AVX-512 VNNI, else AVX2, else portable */
    bool swiglu;     /* w[0] gate, w[1] up: y[0] = swiglu(y[0], y[1]) */
} qmm_job;

static void quantize_task(void *ctx, int task, int n_tasks) {
    const qmm_job *job = ctx;
    int64_t r0 = job->m * task / n_tasks, r1 = job->m * (task + 1) / n_tasks;
    for (int64_t r = r0; r < r1; r++)
        kn_qx_quantize(job->x + r * job->k, job->k, job->bits, job->qx + (size_t)r * job->qx_stride);
}

/* Rows [j0, j1) of w for every token: packed groups through VNNI, the
 * rest (no packed copy, no VNNI, or the rows past the last whole group)
 * through qdot_tile. Tokens go in tiles of KN_TILE_M so that each packed block
 * is decoded once per tile. */
static void qmm_rows(const qmm_job *job, const kn_weight *w, float *y_all, int64_t j0, int64_t j1) {
    int64_t k = w->cols, nb = k / KN_QK, n = w->rows;
    for (int64_t r0 = 0; r0 < job->m; r0 += KN_TILE_M) {
        int tm = job->m - r0 < KN_TILE_M ? (int)(job->m - r0) : KN_TILE_M;
        kn_qx qx[KN_TILE_M];
        for (int r = 0; r < tm; r++) qx[r] = kn_qx_view(job->qx + (size_t)(r0 + r) * job->qx_stride, k, job->bits);
        float *y = y_all + r0 * n;
        int64_t j = j0;
        /* Q8_0, Q4_0 and Q4_1 have VNNI kernels; the other types AVX2
         * ones only, which CPUs with VNNI run too. */
        const bool kq = quant_block_elems(w->type) == 256,
                   q4 = w->type == GGML_TYPE_Q8_0 || w->type == GGML_TYPE_Q4_0 || w->type == GGML_TYPE_Q4_1;
        if ((job->vnni || job->avx2) && w->packed)
            for (; j + KN_PACK_ROWS <= j1 && j + KN_PACK_ROWS <= n / KN_PACK_ROWS * KN_PACK_ROWS; j += KN_PACK_ROWS) {
                if (kq)
                    kn_kgroup_avx2(w, j / KN_PACK_ROWS, qx, tm, job->bits, y, (size_t)n);
                else if (!q4)
                    kn_q5group_avx2(w, j / KN_PACK_ROWS, qx, tm, job->bits, y, (size_t)n);
                else if (job->vnni)
                    kn_qgroup_avx512(w, j / KN_PACK_ROWS, qx, tm, job->bits, y, (size_t)n);
                else
                    kn_qgroup_avx2(w, j / KN_PACK_ROWS, qx, tm, job->bits, y, (size_t)n);
            }
        for (; j < j1; j++) {
            const uint8_t *row = (const uint8_t *)w->data + (size_t)j * w->row_bytes;
            qdot_tile(w->type, row, qx, tm, nb, job->bits, y + j, (size_t)n);
        }
    }
}

/* The weights' chunks of KN_QCHUNK rows, numbered across the weights in
 * order; task t owns one contiguous run of them, so each core's
 * prefetchers stream their own part of the weights. */
static void qmm_task(void *ctx, int task, int n_tasks) {
    const qmm_job *job = ctx;
    int64_t total = job->swiglu ? job->chunks[1] : job->chunks[job->n_w];
    int64_t c0 = total * task / n_tasks, c1 = total * (task + 1) / n_tasks;
    if (job->swiglu) {
        /* Chunk c is rows [16c, 16c + 16) of gate and of up; their
         * products are combined while still in cache. */
        const kn_weight *g = job->w[0];
        for (int64_t c = c0; c < c1; c++) {
            int64_t j0 = c * KN_QCHUNK, j1 = j0 + KN_QCHUNK < g->rows ? j0 + KN_QCHUNK : g->rows;
            qmm_rows(job, g, job->y[0], j0, j1);
            qmm_rows(job, job->w[1], job->y[1], j0, j1);
            for (int64_t r = 0; r < job->m; r++) {
                float *yg = job->y[0] + r * g->rows;
                const float *yu = job->y[1] + r * g->rows;
                kn_swiglu_span(yg + j0, yu + j0, yg + j0, j1 - j0);
            }
        }
        return;
    }
    int i = 0;
    for (int64_t c = c0; c < c1; c++) {
        while (c >= job->chunks[i + 1]) i++;
        const kn_weight *w = job->w[i];
        int64_t j0 = (c - job->chunks[i]) * KN_QCHUNK, j1 = j0 + KN_QCHUNK < w->rows ? j0 + KN_QCHUNK : w->rows;
        qmm_rows(job, w, job->y[i], j0, j1);
    }
}

static void qmm_run(kn_stream *s, int n_w, const kn_weight *const *w, const float *x, float *const *y, int64_t m,
                    bool swiglu) {
    AE_ASSERT(n_w >= 1 && n_w <= KN_MM_MAX_W);
    int64_t k = w[0]->cols;
    AE_ASSERT(k % KN_QK == 0);
    size_t stride = kn_qx_row_bytes(k, s->act_bits);
    AE_ASSERT(KN_CPU(s)->work_bytes >= (size_t)m * stride);
    qmm_job job = {.n_w = n_w,
                   .x = x,
                   .k = k,
                   .qx = KN_CPU(s)->work,
                   .qx_stride = stride,
                   .bits = s->act_bits,
                   .m = m,
                   .vnni = kn_cpu_use_avx512vnni(),
                   .avx2 = kn_cpu_use_avx2(),
                   .swiglu = swiglu};
    for (int i = 0; i < n_w; i++) {
        AE_ASSERT(w[i]->cols == k && kn_qmatmul_type(w[i]->type));
        job.w[i] = w[i];
        job.y[i] = y[i];
        job.chunks[i + 1] = job.chunks[i] + (w[i]->rows + KN_QCHUNK - 1) / KN_QCHUNK;
    }
    int threads = pool_threads(KN_CPU(s)->pool);
    /* One row is quicker to quantize here than to hand out (0.6 us for
     * 1536 elements with AVX-512; a pool pass costs ~0.25 us). */
    if (m == 1 || threads == 1)
        quantize_task(&job, 0, 1);
    else
        pool_run(KN_CPU(s)->pool, quantize_task, &job, m < threads ? (int)m : threads);
    int64_t total = swiglu ? job.chunks[1] : job.chunks[n_w];
    pool_run(KN_CPU(s)->pool, qmm_task, &job, total < threads ? (int)total : threads);
}

void kn_qmatmul_n(kn_stream *s, int n_w, const kn_weight *const *w, const float *x, float *const *y, int64_t m) {
    qmm_run(s, n_w, w, x, y, m, false);
}

void kn_qmatmul_swiglu(kn_stream *s, const kn_weight *gate, const kn_weight *up, const float *x, float *y_gate,
                       float *y_up, int64_t m) {
    AE_ASSERT(gate->rows == up->rows);
    qmm_run(s, 2, (const kn_weight *[]){gate, up}, x, (float *[]){y_gate, y_up}, m, true);
}
