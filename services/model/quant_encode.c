/* Quantizers: f32 to each block type that quant.c dequantizes.
 *
 * They exist to write test files of random weights (aerie make-model) and
 * to check the kernels, not to compete with llama.cpp's quantizer: there
 * is no search for the best scales and no importance matrix. Each element
 * is rounded to its nearest level (roundf: ties away from zero); block
 * scales are chosen so that the levels cover the block, which is what
 * bounds the error. The bound for each type is stated at its quantizer as
 * a fraction of amax, the largest |x| of the block (the super-block for
 * the 256-element types), for data whose scales are normal f16 numbers;
 * tests/unit/test_quant.c checks every one. Everything is plain f32
 * arithmetic (no libm beyond ceilf and frexpf, which are exact),
 * so the bytes are the same on every machine.
 *
 * Shared rules: an all-zero block dequantizes to zeros; an f16 scale that
 * would overflow is stored as the largest finite half instead (so a file
 * never holds an inf or nan scale, though such input then loses its bound);
 * input must be finite. */
#include <math.h>
#include <string.h>

#include "quant.h"

#define QK 32
#define QK_K 256

static void st16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

/* f16 of d, rounded to nearest, never inf. */
static uint16_t half_of(float d) {
    uint16_t h = quant_f32_to_f16(d);
    if ((h & 0x7c00u) == 0x7c00u) h = (uint16_t)((h & 0x8000u) | 0x7bffu);
    return h;
}

/* The smallest f16 >= d, for d >= 0 (largest finite half at most): a
 * scale rounded up keeps every level inside its range. */
static uint16_t half_up(float d) {
    uint16_t h = half_of(d);
    if (quant_f16_to_f32(h) < d && h < 0x7bffu) h++;
    return h;
}

/* roundf(v) (ties away from zero) clamped to [lo, hi]; nan goes to lo.
 * Inside the range, truncation and the exact remainder v - trunc(v) give
 * the same integer as roundf without a call into libm. */
static int qround(float v, int lo, int hi) {
    if (!(v >= (float)lo)) return lo;
    if (v >= (float)hi) return hi;
    int i = (int)v;
    float rest = v - (float)i;
    return i + (rest >= 0.5f) - (rest <= -0.5f);
}

/* ceilf(v) clamped to [0, hi]. */
static int qceil(float v, int hi) {
    float r = ceilf(v);
    if (!(r >= 0.0f)) return 0;
    if (r > (float)hi) return hi;
    return (int)r;
}

static float amax_of(const float *x, int n) {
    float a = 0;
    for (int i = 0; i < n; i++) a = fabsf(x[i]) > a ? fabsf(x[i]) : a;
    return a;
}

/* The element of largest magnitude, signed (the first one on ties). */
static float signed_max(const float *x, int n) {
    float a = 0, m = 0;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > a) {
            a = fabsf(x[i]);
            m = x[i];
        }
    return m;
}

/* ---- 32-element formats ------------------------------------------------------ */

/* Q4_0 (nq = 8) and Q5_0 (nq = 16): d = m / -nq, m the element of largest
 * magnitude, so m lands on level -nq exactly; q = round(x / d) + nq
 * clamped to [0, 2nq - 1]. Only -m can clip (to nq - 1), so |error| <=
 * |d| = amax / nq, and (1 + nq 2^-11) times that for the f16 rounding of
 * d: 0.1255 amax for Q4_0, 0.0630 amax for Q5_0. */
static void q_sym(const float *x, uint8_t *b, int nq) {
    uint16_t dh = half_of(signed_max(x, QK) / (float)-nq);
    float d = quant_f16_to_f32(dh);
    st16(b, dh);
    int q[QK];
    for (int i = 0; i < QK; i++) q[i] = d != 0.0f ? qround(x[i] / d, -nq, nq - 1) + nq : nq;
    uint8_t *qs = b + (nq == 8 ? 2 : 6);
    uint32_t qh = 0;
    for (int j = 0; j < QK / 2; j++) {
        qs[j] = (uint8_t)((q[j] & 0x0f) | (q[j + QK / 2] & 0x0f) << 4);
        qh |= (uint32_t)(q[j] >> 4) << j | (uint32_t)(q[j + QK / 2] >> 4) << (j + QK / 2);
    }
    if (nq == 16) {
        uint8_t h[4] = {(uint8_t)qh, (uint8_t)(qh >> 8), (uint8_t)(qh >> 16), (uint8_t)(qh >> 24)};
        memcpy(b + 2, h, 4);
    }
}

/* Q4_1 (nmax = 15) and Q5_1 (nmax = 31): m = min, d = (max - min) / nmax,
 * both f16; q = round((x - m) / d) clamped to [0, nmax]. |error| <= d / 2
 * (max - min <= 2 amax) plus the f16 rounding of m and d (3 * 2^-11
 * amax): 0.0686 amax for Q4_1, 0.0342 amax for Q5_1. */
static void q_affine(const float *x, uint8_t *b, int nmax) {
    float lo = x[0], hi = x[0];
    for (int i = 1; i < QK; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
    }
    uint16_t dh = half_of((hi - lo) / (float)nmax), mh = half_of(lo);
    float d = quant_f16_to_f32(dh), m = quant_f16_to_f32(mh);
    st16(b, dh);
    st16(b + 2, mh);
    int q[QK];
    for (int i = 0; i < QK; i++) {
        float t = x[i] - m;
        q[i] = d > 0.0f ? qround(t / d, 0, nmax) : 0;
    }
    uint8_t *qs = b + (nmax == 15 ? 4 : 8);
    uint32_t qh = 0;
    for (int j = 0; j < QK / 2; j++) {
        qs[j] = (uint8_t)((q[j] & 0x0f) | (q[j + QK / 2] & 0x0f) << 4);
        qh |= (uint32_t)(q[j] >> 4) << j | (uint32_t)(q[j + QK / 2] >> 4) << (j + QK / 2);
    }
    if (nmax == 31) {
        uint8_t h[4] = {(uint8_t)qh, (uint8_t)(qh >> 8), (uint8_t)(qh >> 16), (uint8_t)(qh >> 24)};
        memcpy(b + 4, h, 4);
    }
}

/* The index of the IQ4_NL level nearest v (the lower one on a tie). */
static int nearest_iq4(float v) {
    static const float mid[15] = {-115.5f, -93.5f, -74.0f, -57.0f, -42.0f, -28.5f, -16.0f, -4.5f,
                                  7.0f,    19.0f,  31.5f,  45.5f,  61.0f,  79.0f,  101.0f};
    int k = 0;
    for (int i = 0; i < 15; i++) k += v > mid[i];
    return k;
}

/* 32 elements to IQ4_NL nibbles (Q4_0's order) at qs with scale d: each
 * the nearest level of x / d; d = 0 takes level 1 (zero after scaling). */
static void iq4_nibbles(const float *x, float d, uint8_t *qs) {
    int q[QK];
    for (int i = 0; i < QK; i++) q[i] = d != 0.0f ? nearest_iq4(x[i] / d) : 8;
    for (int j = 0; j < QK / 2; j++) qs[j] = (uint8_t)(q[j] | q[j + QK / 2] << 4);
}

/* IQ4_NL: d = m / -127, so m lands on the table's -127 exactly; each
 * element takes its nearest level. The levels' widest gap is 24 (89 to
 * 113) and -m may fall 14 past 113, so |error| <= 14 |d| = amax * 14/127
 * (0.1102; 0.1107 with the f16 rounding of d). */
static void q_iq4_nl(const float *x, uint8_t *b) {
    uint16_t dh = half_of(signed_max(x, QK) / -127.0f);
    st16(b, dh);
    iq4_nibbles(x, quant_f16_to_f32(dh), b + 2);
}

/* MXFP4: the scale 2^(e - 128) is the smallest power of two for which 12
 * levels (the table's largest, 6.0 in FP4 terms) reach amax, so nothing
 * clips (ggml rounds the exponent down and clips instead); each element
 * takes its nearest level. Levels are 0, 1, 2, 3, 4, 6, 8, 12 units and
 * amax is more than 6 units: up to 8 units the error is at most 1 unit
 * (under amax / 6), and a v of 8 to 12 units errs by at most min(v - 8,
 * 12 - v) <= v / 5, so |error| <= amax / 5. */
static void q_mxfp4(const float *x, uint8_t *b) {
    float a = amax_of(x, QK);
    int e = 0;
    if (a > 0.0f) {
        /* a = f * 2^ex, f in [0.5, 1): 12 * 2^(ex - 4) = 0.75 * 2^ex covers
         * f <= 0.75 (a is then 8 to 12 units), one more doubling the rest
         * (6 to 8 units). */
        int ex;
        float f = frexpf(a, &ex);
        e = 128 + ex - (f <= 0.75f ? 4 : 3);
        e = e < 0 ? 0 : e > 254 ? 254 : e;
    }
    b[0] = (uint8_t)e;
    float unit = quant_e8m0_to_f32_half((uint8_t)e);
    static const float mid[7] = {0.5f, 1.5f, 2.5f, 3.5f, 5.0f, 7.0f, 10.0f};
    int q[QK];
    for (int i = 0; i < QK; i++) {
        float v = fabsf(x[i]) / unit;
        int k = 0;
        for (int t = 0; t < 7; t++) k += v > mid[t];
        q[i] = k != 0 && x[i] < 0.0f ? k | 8 : k;
    }
    for (int j = 0; j < QK / 2; j++) b[1 + j] = (uint8_t)(q[j] | q[j + QK / 2] << 4);
}

/* ---- K-quants -------------------------------------------------------------- */

/* Sub-blocks with a scale and a min, value = (d * sc) * q - dmin * mn
 * (Q2_K, Q4_K, Q5_K): n_sub runs of len elements, q in [0, nmax], sc and
 * mn in [0, smax]. A run covers [lo, hi] with lo = min(x, 0) (mins are
 * subtracted, never added). dmin = f16 up of max(-lo) / smax and mn =
 * ceil(-lo / dmin), so the lowest level, -ml = -dmin * mn, is at or below
 * lo; then with top = hi + ml, d = f16 up of max(top) / (nmax * smax) and
 * sc = ceil(top / (nmax * d)), so the highest level is at or above hi.
 * Every element lies inside its run's levels: |error| <= (d * sc) / 2,
 * where d * sc <= (hi - lo + dmin) / nmax + d. In amax terms (hi - lo <= 2
 * amax, dmin <= amax / smax, d <= (2 + 1/smax) amax / (nmax * smax)):
 * Q2_K (nmax 3, smax 15) 0.368, Q4_K (15, 63) 0.0688, Q5_K (31, 63)
 * 0.0331. */
static void k_scale_min(const float *x, int n_sub, int len, int nmax, int smax, uint16_t *dh_out, uint16_t *dminh_out,
                        int *sc, int *mn, int *q) {
    float lo[16], hi[16], ml[16], max_min = 0, max_top = 0;
    for (int j = 0; j < n_sub; j++) {
        const float *r = x + j * len;
        float l = 0, h = r[0];
        for (int i = 0; i < len; i++) {
            l = r[i] < l ? r[i] : l;
            h = r[i] > h ? r[i] : h;
        }
        lo[j] = l;
        hi[j] = h;
        max_min = -l > max_min ? -l : max_min;
    }
    uint16_t dminh = half_up(max_min / (float)smax);
    float dmin = quant_f16_to_f32(dminh);
    for (int j = 0; j < n_sub; j++) {
        mn[j] = dmin > 0.0f ? qceil(-lo[j] / dmin, smax) : 0;
        ml[j] = dmin * (float)mn[j];
        float top = hi[j] + ml[j];
        max_top = top > max_top ? top : max_top;
    }
    float unit = max_top / (float)nmax;
    uint16_t dh = half_up(unit / (float)smax);
    float d = quant_f16_to_f32(dh);
    float dn = d * (float)nmax;
    *dh_out = dh;
    *dminh_out = dminh;
    for (int j = 0; j < n_sub; j++) {
        float top = hi[j] + ml[j];
        sc[j] = d > 0.0f ? qceil(top / dn, smax) : 0;
        float dl = d * (float)sc[j];
        const float *r = x + j * len;
        for (int i = 0; i < len; i++) {
            float t = r[i] + ml[j];
            q[j * len + i] = dl > 0.0f ? qround(t / dl, 0, nmax) : 0;
        }
    }
}

/* Sub-blocks with a signed scale, value = (d * sc) * q (Q3_K, Q6_K; and
 * IQ4_XS through its table): each run's ideal scale is s = m / -nq (m its
 * element of largest magnitude, landing on level -nq); d = f16 up of
 * max |s| / smax, and sc = s / d rounded away from zero, so |d * sc| >=
 * |s|: only -m can clip, to level nq - 1. |error| <= |d * sc| <= (1 +
 * 1/smax) amax / nq: Q3_K (nq 4, smax 31) 0.2581, Q6_K (32, 127)
 * 0.0315. */
static float k_signed(const float *x, int n_sub, int len, float nq, int smax, uint16_t *dh_out, int *sc) {
    float s[16], max_s = 0;
    for (int j = 0; j < n_sub; j++) {
        s[j] = signed_max(x + j * len, len) / -nq;
        max_s = fabsf(s[j]) > max_s ? fabsf(s[j]) : max_s;
    }
    uint16_t dh = half_up(max_s / (float)smax);
    float d = quant_f16_to_f32(dh);
    *dh_out = dh;
    for (int j = 0; j < n_sub; j++) {
        int a = d > 0.0f ? qceil(fabsf(s[j]) / d, smax) : 0;
        sc[j] = s[j] < 0.0f ? -a : a;
    }
    return d;
}

/* The 12-byte scale block of Q4_K and Q5_K (quant.c's scale_min_k4,
 * inverted). */
static void pack_k4_scales(uint8_t *s, const int *sc, const int *mn) {
    for (int j = 0; j < 4; j++) {
        s[j] = (uint8_t)(sc[j] | (sc[j + 4] >> 4) << 6);
        s[j + 4] = (uint8_t)(mn[j] | (mn[j + 4] >> 4) << 6);
        s[j + 8] = (uint8_t)((sc[j + 4] & 0x0f) | (mn[j + 4] & 0x0f) << 4);
    }
}

/* Q2_K: scale-min runs of 16, q in [0, 3], 4-bit sc and mn; bound 0.368
 * amax (k_scale_min). */
static void q_q2_k(const float *x, uint8_t *b) {
    int sc[16], mn[16], q[QK_K];
    uint16_t dh, dminh;
    k_scale_min(x, 16, 16, 3, 15, &dh, &dminh, sc, mn, q);
    for (int j = 0; j < 16; j++) b[j] = (uint8_t)(sc[j] | mn[j] << 4);
    uint8_t *qs = b + 16;
    memset(qs, 0, 64);
    /* Element e: qs[32 * (e / 128) + e % 32] at bits 2 * (e % 128 / 32). */
    for (int e = 0; e < QK_K; e++) qs[32 * (e / 128) + e % 32] |= (uint8_t)(q[e] << (2 * (e % 128 / 32)));
    st16(b + 80, dh);
    st16(b + 82, dminh);
}

/* Q3_K: signed runs of 16, q in [-4, 3], scales in [-31, 31] (stored +32
 * in six bits); bound 0.2581 amax (k_signed). */
static void q_q3_k(const float *x, uint8_t *b) {
    int sc[16];
    uint16_t dh;
    float d = k_signed(x, 16, 16, 4.0f, 31, &dh, sc);
    uint8_t *hm = b, *qs = b + 32, *s = b + 96;
    memset(b, 0, 108);
    for (int k = 0; k < 16; k++) {
        int l = sc[k] + 32;
        s[k % 8] |= (uint8_t)((l & 0x0f) << (k < 8 ? 0 : 4));
        s[8 + k % 4] |= (uint8_t)((l >> 4) << (2 * (k / 4)));
    }
    st16(b + 108, dh);
    for (int e = 0; e < QK_K; e++) {
        float dl = d * (float)sc[e / 16];
        int u = (dl != 0.0f ? qround(x[e] / dl, -4, 3) : 0) + 4; /* 0..7 */
        int run = e % 128 / 32, at = e % 32;
        qs[32 * (e / 128) + at] |= (uint8_t)((u & 3) << (2 * run));
        hm[at] |= (uint8_t)((u >> 2) << (4 * (e / 128) + run));
    }
}

/* Q4_K: scale-min runs of 32, q in [0, 15], 6-bit sc and mn; bound 0.0688
 * amax (k_scale_min). */
static void q_q4_k(const float *x, uint8_t *b) {
    int sc[8], mn[8], q[QK_K];
    uint16_t dh, dminh;
    k_scale_min(x, 8, 32, 15, 63, &dh, &dminh, sc, mn, q);
    st16(b, dh);
    st16(b + 2, dminh);
    pack_k4_scales(b + 4, sc, mn);
    uint8_t *qs = b + 16;
    /* Element e: nibble e % 64 / 32 of qs[32 * (e / 64) + e % 32]. */
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) qs[32 * c + l] = (uint8_t)(q[64 * c + l] | q[64 * c + 32 + l] << 4);
}

/* Q5_K: as Q4_K with q in [0, 31], the fifth bit in bit e / 32 of
 * qh[e % 32]; bound 0.0331 amax (k_scale_min). */
static void q_q5_k(const float *x, uint8_t *b) {
    int sc[8], mn[8], q[QK_K];
    uint16_t dh, dminh;
    k_scale_min(x, 8, 32, 31, 63, &dh, &dminh, sc, mn, q);
    st16(b, dh);
    st16(b + 2, dminh);
    pack_k4_scales(b + 4, sc, mn);
    uint8_t *qh = b + 16, *qs = b + 48;
    memset(qh, 0, 32);
    for (int e = 0; e < QK_K; e++) qh[e % 32] |= (uint8_t)((q[e] >> 4) << (e / 32));
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++)
            qs[32 * c + l] = (uint8_t)((q[64 * c + l] & 0x0f) | (q[64 * c + 32 + l] & 0x0f) << 4);
}

/* Q6_K: signed runs of 16, q in [-32, 31] (stored +32), int8 scales in
 * [-127, 127]; bound 0.0315 amax (k_signed). */
static void q_q6_k(const float *x, uint8_t *b) {
    int sc[16];
    uint16_t dh;
    float d = k_signed(x, 16, 16, 32.0f, 127, &dh, sc);
    uint8_t *ql = b, *qh = b + 128;
    memset(b, 0, 192);
    for (int k = 0; k < 16; k++) b[192 + k] = (uint8_t)(int8_t)sc[k];
    st16(b + 208, dh);
    /* Element e = 128h + 32r + l: low nibble in ql[64h + 32 (r & 1) + l]
     * at nibble r / 2, high two bits in qh[32h + l] at bits 2r. */
    for (int e = 0; e < QK_K; e++) {
        float dl = d * (float)sc[e / 16];
        int u = (dl != 0.0f ? qround(x[e] / dl, -32, 31) : 0) + 32;
        int h = e / 128, r = e % 128 / 32, l = e % 32;
        ql[64 * h + 32 * (r & 1) + l] |= (uint8_t)((u & 0x0f) << (4 * (r >> 1)));
        qh[32 * h + l] |= (uint8_t)((u >> 4) << (2 * r));
    }
}

/* IQ4_XS: signed runs of 32 on the IQ4_NL table (nq 127: each run's m on
 * level -127), 6-bit scales in [-31, 31] (stored +32). As IQ4_NL, |error|
 * <= 14 |d * sc| <= 14 (1 + 1/31) amax / 127 = 0.1138 amax. */
static void q_iq4_xs(const float *x, uint8_t *b) {
    int sc[8];
    uint16_t dh;
    float d = k_signed(x, 8, 32, 127.0f, 31, &dh, sc);
    st16(b, dh);
    uint16_t sh = 0;
    uint8_t *sl = b + 4;
    memset(sl, 0, 4);
    for (int j = 0; j < 8; j++) {
        int ls = sc[j] + 32;
        sl[j / 2] |= (uint8_t)((ls & 0x0f) << (4 * (j % 2)));
        sh |= (uint16_t)((ls >> 4) << (2 * j));
    }
    st16(b + 2, sh);
    for (int j = 0; j < 8; j++) {
        float dl = d * (float)sc[j];
        iq4_nibbles(x + 32 * j, dl, b + 8 + 16 * j);
    }
}

bool quant_quantize(ggml_type t, const float *src, void *dst, uint64_t n) {
    uint32_t be = quant_block_elems(t), bb = quant_block_bytes(t);
    if (be == 0 || n % be != 0) return false;
    uint8_t *out = dst;
    switch (t) {
    case GGML_TYPE_F32: memcpy(dst, src, n * sizeof(float)); return true;
    case GGML_TYPE_F16:
        for (uint64_t i = 0; i < n; i++) st16(out + 2 * i, quant_f32_to_f16(src[i]));
        return true;
    case GGML_TYPE_BF16:
        for (uint64_t i = 0; i < n; i++) st16(out + 2 * i, quant_f32_to_bf16(src[i]));
        return true;
    /* Q8_0: d = f16(amax / 127), q = round(x / d): |error| <= d / 2, about
     * amax / 254. */
    case GGML_TYPE_Q8_0: quant_quantize_q8_0(src, dst, n); return true;
    case GGML_TYPE_Q4_0:
    case GGML_TYPE_Q4_1:
    case GGML_TYPE_Q5_0:
    case GGML_TYPE_Q5_1:
    case GGML_TYPE_Q2_K:
    case GGML_TYPE_Q3_K:
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q5_K:
    case GGML_TYPE_Q6_K:
    case GGML_TYPE_IQ4_NL:
    case GGML_TYPE_IQ4_XS:
    case GGML_TYPE_MXFP4: break;
    default: return false;
    }
    for (uint64_t i = 0; i < n / be; i++, src += be, out += bb) {
        switch (t) {
        case GGML_TYPE_Q4_0: q_sym(src, out, 8); break;
        case GGML_TYPE_Q5_0: q_sym(src, out, 16); break;
        case GGML_TYPE_Q4_1: q_affine(src, out, 15); break;
        case GGML_TYPE_Q5_1: q_affine(src, out, 31); break;
        case GGML_TYPE_Q2_K: q_q2_k(src, out); break;
        case GGML_TYPE_Q3_K: q_q3_k(src, out); break;
        case GGML_TYPE_Q4_K: q_q4_k(src, out); break;
        case GGML_TYPE_Q5_K: q_q5_k(src, out); break;
        case GGML_TYPE_Q6_K: q_q6_k(src, out); break;
        case GGML_TYPE_IQ4_NL: q_iq4_nl(src, out); break;
        case GGML_TYPE_IQ4_XS: q_iq4_xs(src, out); break;
        case GGML_TYPE_MXFP4: q_mxfp4(src, out); break;
        default: return false;
        }
    }
    return true;
}

ggml_type quant_fit_type(ggml_type t, int64_t cols) {
    if (cols % (int64_t)quant_block_elems(t) == 0) return t;
    switch (t) {
    case GGML_TYPE_Q4_K: return GGML_TYPE_Q5_0;
    case GGML_TYPE_Q5_K: return GGML_TYPE_Q5_1;
    case GGML_TYPE_Q6_K: return GGML_TYPE_Q8_0;
    default: return GGML_TYPE_IQ4_NL; /* Q2_K, Q3_K, IQ4_XS */
    }
}
