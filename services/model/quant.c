/* ggml tensor types: block layouts and dequantization to f32.
 *
 * Block layouts are those of ggml (little-endian, packed, no padding). The
 * arithmetic below keeps ggml's order of float operations (scale times
 * quant, then minus/plus the offset, each rounded to f32) so results match
 * ggml and the gguf Python package bit for bit. Keep products and sums in
 * separate statements: a compiler allowed to contract a*b+c into one fused
 * multiply-add would round once instead of twice. */
#include "quant.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define QK 32    /* elements per block of the 32-element formats */
#define QK_K 256 /* elements per super-block of the K-quants */

typedef struct type_info {
    const char *name;
    uint32_t block_elems; /* 0: layout unknown */
    uint32_t block_bytes;
    bool dequant;
} type_info;

/* Indexed by ggml_type. Types with a known size but no dequantizer here
 * (the i-quants, ternary and integer types) still let a reader validate a
 * tensor's byte size and skip it. */
static const type_info TYPES[GGML_TYPE_COUNT_MAX] = {
    [GGML_TYPE_F32] = {"F32", 1, 4, true},
    [GGML_TYPE_F16] = {"F16", 1, 2, true},
    [GGML_TYPE_Q4_0] = {"Q4_0", QK, 2 + QK / 2, true},
    [GGML_TYPE_Q4_1] = {"Q4_1", QK, 4 + QK / 2, true},
    [GGML_TYPE_Q5_0] = {"Q5_0", QK, 2 + 4 + QK / 2, true},
    [GGML_TYPE_Q5_1] = {"Q5_1", QK, 4 + 4 + QK / 2, true},
    [GGML_TYPE_Q8_0] = {"Q8_0", QK, 2 + QK, true},
    /* ggml's block_q8_1: half d, half s (= d * sum of qs), int8 qs[32]. */
    [GGML_TYPE_Q8_1] = {"Q8_1", QK, 4 + QK, true},
    [GGML_TYPE_Q2_K] = {"Q2_K", QK_K, QK_K / 16 + QK_K / 4 + 4, true},
    [GGML_TYPE_Q3_K] = {"Q3_K", QK_K, QK_K / 8 + QK_K / 4 + 12 + 2, true},
    [GGML_TYPE_Q4_K] = {"Q4_K", QK_K, 4 + 12 + QK_K / 2, true},
    [GGML_TYPE_Q5_K] = {"Q5_K", QK_K, 4 + 12 + QK_K / 8 + QK_K / 2, true},
    [GGML_TYPE_Q6_K] = {"Q6_K", QK_K, QK_K / 2 + QK_K / 4 + QK_K / 16 + 2, true},
    [GGML_TYPE_Q8_K] = {"Q8_K", QK_K, 4 + QK_K + 2 * (QK_K / 16), true},
    [16] = {"IQ2_XXS", QK_K, 66, false},
    [17] = {"IQ2_XS", QK_K, 74, false},
    [18] = {"IQ3_XXS", QK_K, 98, false},
    [19] = {"IQ1_S", QK_K, 50, false},
    [GGML_TYPE_IQ4_NL] = {"IQ4_NL", QK, 2 + QK / 2, true},
    [21] = {"IQ3_S", QK_K, 110, false},
    [22] = {"IQ2_S", QK_K, 82, false},
    [GGML_TYPE_IQ4_XS] = {"IQ4_XS", QK_K, 2 + 2 + QK_K / 64 + QK_K / 2, true},
    [GGML_TYPE_I8] = {"I8", 1, 1, false},
    [GGML_TYPE_I16] = {"I16", 1, 2, false},
    [GGML_TYPE_I32] = {"I32", 1, 4, false},
    [GGML_TYPE_I64] = {"I64", 1, 8, false},
    [GGML_TYPE_F64] = {"F64", 1, 8, false},
    [29] = {"IQ1_M", QK_K, 56, false},
    [GGML_TYPE_BF16] = {"BF16", 1, 2, true},
    [34] = {"TQ1_0", QK_K, 54, false},
    [35] = {"TQ2_0", QK_K, 66, false},
    [GGML_TYPE_MXFP4] = {"MXFP4", QK, 1 + QK / 2, true},
};

static const type_info *info_of(uint32_t t) {
    if (t >= GGML_TYPE_COUNT_MAX || TYPES[t].block_elems == 0) return NULL;
    return &TYPES[t];
}

bool quant_type_known(uint32_t t) { return info_of(t) != NULL; }

bool quant_can_dequantize(uint32_t t) {
    const type_info *ti = info_of(t);
    return ti && ti->dequant;
}

const char *quant_type_name(uint32_t t) {
    /* One buffer per thread: the name of an unknown type stays valid until
     * the same thread asks again. */
    static _Thread_local char unknown[24];
    const type_info *ti = info_of(t);
    if (ti) return ti->name;
    snprintf(unknown, sizeof unknown, "type%u", (unsigned)t);
    return unknown;
}

uint32_t quant_block_elems(ggml_type t) {
    const type_info *ti = info_of((uint32_t)t);
    return ti ? ti->block_elems : 0;
}

uint32_t quant_block_bytes(ggml_type t) {
    const type_info *ti = info_of((uint32_t)t);
    return ti ? ti->block_bytes : 0;
}

uint64_t quant_row_bytes(ggml_type t, uint64_t n) {
    const type_info *ti = info_of((uint32_t)t);
    if (!ti || n % ti->block_elems != 0) return 0;
    uint64_t blocks = n / ti->block_elems;
    if (blocks > UINT64_MAX / ti->block_bytes) return 0;
    return blocks * ti->block_bytes;
}

const int8_t quant_kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
const int8_t quant_kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* ---- f16 / bf16 ---------------------------------------------------------- */

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float quant_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13)); /* inf, nan */
    if (exp == 0) {
        if (man == 0) return bits_f32(sign);
        /* Subnormal: man * 2^-24. Shift the leading 1 up to the implicit
         * bit position; every half subnormal is a normal f32. */
        int e = 1;
        while (!(man & 0x400u)) {
            man <<= 1;
            e--;
        }
        man &= 0x3ffu;
        return bits_f32(sign | ((uint32_t)(e + 112) << 23) | (man << 13));
    }
    /* Rebias the exponent from 15 to 127. */
    return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t quant_f32_to_f16(float f) {
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) /* nan: keep the top payload bits, force quiet */
        return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    /* 65520 is halfway between 65504 (max half) and 65536; the tie goes to
     * the even neighbour, which overflows to inf. */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    if (ax >= 0x38800000u) {                   /* normal half: |f| >= 2^-14 */
        uint32_t h = (ax - 0x38000000u) >> 13; /* exponent rebias 127 -> 15 */
        uint32_t rest = ax & 0x1fffu;
        /* A carry out of the mantissa correctly bumps the exponent. */
        if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
        return (uint16_t)(sign | h);
    }
    /* |f| <= 2^-25 rounds to zero (2^-25 itself is a tie with even 0). */
    if (ax <= 0x33000000u) return sign;
    /* Subnormal half: value = m * 2^-24 with m = mantissa >> shift. */
    uint32_t man = (ax & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - (ax >> 23); /* 14..24 */
    uint32_t m = man >> shift;
    uint32_t rest = man & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (m & 1u))) m++; /* may become 2^-14 */
    return (uint16_t)(sign | m);
}

float quant_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t quant_f32_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet nan */
    /* Round to nearest even; overflow lands on inf as it should. */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* ---- little-endian loads ------------------------------------------------- */

static uint16_t ld16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static uint32_t ld32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static float ldh(const uint8_t *p) { return quant_f16_to_f32(ld16(p)); }

/* ---- one block of each format -------------------------------------------- */

/* Q4_0: half d; u8 qs[16]. Element j < 16 is the low nibble of qs[j],
 * element j + 16 its high nibble; value = (q - 8) * d. */
static void deq_q4_0(const uint8_t *b, float *y) {
    float d = ldh(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < QK / 2; j++) {
        y[j] = (float)((qs[j] & 0x0f) - 8) * d;
        y[j + QK / 2] = (float)((qs[j] >> 4) - 8) * d;
    }
}

/* Q4_1: half d; half m; u8 qs[16]; nibble order as Q4_0; value = q*d + m. */
static void deq_q4_1(const uint8_t *b, float *y) {
    float d = ldh(b), m = ldh(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < QK / 2; j++) {
        float lo = (float)(qs[j] & 0x0f) * d;
        float hi = (float)(qs[j] >> 4) * d;
        y[j] = lo + m;
        y[j + QK / 2] = hi + m;
    }
}

/* Q5_0: half d; u32 qh (bit j = fifth bit of element j); u8 qs[16] (low
 * four bits, nibble order as Q4_0); value = (q - 16) * d. */
static void deq_q5_0(const uint8_t *b, float *y) {
    float d = ldh(b);
    uint32_t qh = ld32(b + 2);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < QK / 2; j++) {
        int q0 = (qs[j] & 0x0f) | (int)(((qh >> j) & 1u) << 4);
        int q1 = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
        y[j] = (float)(q0 - 16) * d;
        y[j + QK / 2] = (float)(q1 - 16) * d;
    }
}

/* Q5_1: half d; half m; u32 qh; u8 qs[16]; value = q*d + m. */
static void deq_q5_1(const uint8_t *b, float *y) {
    float d = ldh(b), m = ldh(b + 2);
    uint32_t qh = ld32(b + 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < QK / 2; j++) {
        int q0 = (qs[j] & 0x0f) | (int)(((qh >> j) & 1u) << 4);
        int q1 = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
        float lo = (float)q0 * d;
        float hi = (float)q1 * d;
        y[j] = lo + m;
        y[j + QK / 2] = hi + m;
    }
}

/* Q8_0: half d; i8 qs[32]. Q8_1 has an extra half (the block sum) before
 * qs that dequantization ignores. */
static void deq_q8(const uint8_t *b, size_t qs_at, float *y) {
    float d = ldh(b);
    const uint8_t *qs = b + qs_at;
    for (int j = 0; j < QK; j++) y[j] = (float)(int8_t)qs[j] * d;
}

/* Q2_K: u8 scales[16] (low nibble scale, high nibble min, per 16
 * elements); u8 qs[64] (2-bit quants); half d; half dmin.
 * Each 128-element half uses 32 bytes of qs four times, at bit shifts
 * 0, 2, 4, 6; each shift covers two groups of 16 (bytes 0..15, 16..31).
 * value = d*scale*q - dmin*min. */
static void deq_q2_k(const uint8_t *b, float *y) {
    const uint8_t *sc = b;
    const uint8_t *q = b + 16;
    float d = ldh(b + 80), dmin = ldh(b + 82);
    int is = 0;
    for (int half = 0; half < 2; half++, q += 32) {
        for (int shift = 0; shift < 8; shift += 2) {
            for (int g = 0; g < 2; g++, is++) {
                float dl = d * (float)(sc[is] & 0x0f);
                float ml = dmin * (float)(sc[is] >> 4);
                for (int l = 0; l < 16; l++) {
                    float v = dl * (float)((q[16 * g + l] >> shift) & 3);
                    *y++ = v - ml;
                }
            }
        }
    }
}

/* Q3_K: u8 hmask[32]; u8 qs[64]; u8 scales[12] (sixteen 6-bit signed
 * scales, offset 32); half d. Low two bits of each quant come from qs as in
 * Q2_K; the third from hmask: bit k of hmask[l] belongs to the k-th
 * 32-element run, and a CLEAR bit subtracts 4. value = d*(scale-32)*q. */
static void deq_q3_k(const uint8_t *b, float *y) {
    const uint8_t *hm = b;
    const uint8_t *q = b + 32;
    const uint8_t *s = b + 96;
    float d = ldh(b + 108);
    int scales[16];
    for (int k = 0; k < 16; k++) {
        /* Low four bits: bytes 0..7, low nibbles then high nibbles. High
         * two bits: bytes 8..11, field k/4 of byte 8 + k%4. */
        int lo = k < 8 ? (s[k] & 0x0f) : (s[k - 8] >> 4);
        int hi = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
        scales[k] = (lo | (hi << 4)) - 32;
    }
    int is = 0;
    unsigned bit = 0;
    for (int half = 0; half < 2; half++, q += 32) {
        for (int shift = 0; shift < 8; shift += 2, bit++) {
            for (int g = 0; g < 2; g++, is++) {
                float dl = d * (float)scales[is];
                for (int l = 0; l < 16; l++) {
                    int idx = 16 * g + l;
                    int v = (q[idx] >> shift) & 3;
                    if (!((hm[idx] >> bit) & 1u)) v -= 4;
                    *y++ = dl * (float)v;
                }
            }
        }
    }
}

/* The 12-byte scale block of Q4_K and Q5_K: eight (scale, min) pairs of six
 * bits each. Pairs 0..3 are the low six bits of bytes 0..3 (scale) and
 * 4..7 (min); pairs 4..7 take their low four bits from the nibbles of bytes
 * 8..11 (scale low, min high) and their top two bits from the top two bits
 * of bytes 0..3 (scale) and 4..7 (min). */
static void scale_min_k4(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q4_K: half d; half dmin; u8 scales[12]; u8 qs[128]. Each 64-element
 * chunk uses 32 bytes of qs: low nibbles are the first 32 elements (pair
 * 2c), high nibbles the next 32 (pair 2c+1). value = d*sc*q - dmin*m. */
static void deq_q4_k(const uint8_t *b, float *y) {
    float d = ldh(b), dmin = ldh(b + 2);
    const uint8_t *s = b + 4;
    const uint8_t *q = b + 16;
    for (int c = 0; c < 4; c++, q += 32) {
        for (int part = 0; part < 2; part++) {
            int sc, mn;
            scale_min_k4(s, 2 * c + part, &sc, &mn);
            float dl = d * (float)sc;
            float ml = dmin * (float)mn;
            for (int l = 0; l < 32; l++) {
                float v = dl * (float)((q[l] >> (4 * part)) & 0x0f);
                *y++ = v - ml;
            }
        }
    }
}

/* Q5_K: half d; half dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]. As Q4_K
 * with a fifth bit: bit k of qh[l] is the high bit of element l of the
 * k-th 32-element run. */
static void deq_q5_k(const uint8_t *b, float *y) {
    float d = ldh(b), dmin = ldh(b + 2);
    const uint8_t *s = b + 4;
    const uint8_t *qh = b + 16;
    const uint8_t *q = b + 48;
    for (int c = 0; c < 4; c++, q += 32) {
        for (int part = 0; part < 2; part++) {
            int run = 2 * c + part, sc, mn;
            scale_min_k4(s, run, &sc, &mn);
            float dl = d * (float)sc;
            float ml = dmin * (float)mn;
            for (int l = 0; l < 32; l++) {
                int v = (q[l] >> (4 * part)) & 0x0f;
                v |= ((qh[l] >> run) & 1) << 4;
                float t = dl * (float)v;
                *y++ = t - ml;
            }
        }
    }
}

/* Q6_K: u8 ql[128] (low four bits); u8 qh[64] (high two bits); i8
 * scales[16] (one per 16 elements); half d. Each 128-element half uses 64
 * bytes of ql and 32 of qh: element l + 32r (r = 0..3, l = 0..31) takes
 * the low nibble of ql[l] (r=0), ql[l+32] (r=1), high nibble of ql[l]
 * (r=2), ql[l+32] (r=3), and bits 2r..2r+1 of qh[l]. value = d*sc*(q-32). */
static void deq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b;
    const uint8_t *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = ldh(b + 208);
    for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, y += 128) {
        for (int r = 0; r < 4; r++) {
            const uint8_t *lo = ql + 32 * (r & 1);
            int nib = 4 * (r >> 1);
            for (int l = 0; l < 32; l++) {
                int q = ((lo[l] >> nib) & 0x0f) | (((qh[l] >> (2 * r)) & 3) << 4);
                float dl = d * (float)sc[2 * r + l / 16];
                y[32 * r + l] = dl * (float)(q - 32);
            }
        }
    }
}

/* IQ4_NL: half d; u8 qs[16], nibble order as Q4_0. A nibble indexes a
 * non-uniform table instead of an offset: value = d * kvalues[q]. */
static void deq_iq4_nl(const uint8_t *b, float *y) {
    float d = ldh(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < QK / 2; j++) {
        y[j] = d * (float)quant_kvalues_iq4nl[qs[j] & 0x0f];
        y[j + QK / 2] = d * (float)quant_kvalues_iq4nl[qs[j] >> 4];
    }
}

/* IQ4_XS: half d; u16 scales_h; u8 scales_l[4]; u8 qs[128]. Eight runs of
 * 32, each with a 6-bit scale ls: low four bits from nibble j % 2 of
 * scales_l[j / 2], high two from bits 2j..2j+1 of scales_h. Run j uses qs
 * bytes 16j..16j+15 in IQ4_NL's nibble order. value = (d * (ls - 32)) *
 * kvalues[q], the first product rounded on its own. */
static void deq_iq4_xs(const uint8_t *b, float *y) {
    float d = ldh(b);
    uint16_t sh = ld16(b + 2);
    const uint8_t *sl = b + 4;
    const uint8_t *qs = b + 8;
    for (int j = 0; j < QK_K / QK; j++, qs += QK / 2, y += QK) {
        int ls = ((sl[j / 2] >> (4 * (j % 2))) & 0x0f) | (((sh >> (2 * j)) & 3) << 4);
        float dl = d * (float)(ls - 32);
        for (int l = 0; l < QK / 2; l++) {
            y[l] = dl * (float)quant_kvalues_iq4nl[qs[l] & 0x0f];
            y[l + QK / 2] = dl * (float)quant_kvalues_iq4nl[qs[l] >> 4];
        }
    }
}

float quant_e8m0_to_f32_half(uint8_t e) {
    /* 2^(e - 128): e < 2 lands among the f32 subnormals (bit 21 + e of the
     * mantissa), the rest are normal with exponent field e - 1. */
    return bits_f32(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
}

/* MXFP4: u8 e (E8M0); u8 qs[16], nibble order as Q4_0. The table holds
 * the FP4 (E2M1) values doubled, so the scale is halved:
 * value = kvalues_mxfp4[q] * 2^(e - 128). */
static void deq_mxfp4(const uint8_t *b, float *y) {
    float d = quant_e8m0_to_f32_half(b[0]);
    const uint8_t *qs = b + 1;
    for (int j = 0; j < QK / 2; j++) {
        y[j] = d * (float)quant_kvalues_mxfp4[qs[j] & 0x0f];
        y[j + QK / 2] = d * (float)quant_kvalues_mxfp4[qs[j] >> 4];
    }
}

/* Q8_K: f32 d; i8 qs[256]; i16 bsums[16] (ignored here). */
static void deq_q8_k(const uint8_t *b, float *y) {
    float d = bits_f32(ld32(b));
    for (int j = 0; j < QK_K; j++) y[j] = d * (float)(int8_t)b[4 + j];
}

bool quant_dequantize(ggml_type t, const void *src, float *dst, uint64_t n) {
    const type_info *ti = info_of((uint32_t)t);
    if (!ti || !ti->dequant || n % ti->block_elems != 0) return false;
    if (n == 0) return true;
    const uint8_t *b = src;
    switch (t) {
    case GGML_TYPE_F32: memcpy(dst, src, n * sizeof(float)); return true;
    case GGML_TYPE_F16:
        for (uint64_t i = 0; i < n; i++) dst[i] = quant_f16_to_f32(ld16(b + 2 * i));
        return true;
    case GGML_TYPE_BF16:
        for (uint64_t i = 0; i < n; i++) dst[i] = quant_bf16_to_f32(ld16(b + 2 * i));
        return true;
    default: break;
    }
    uint64_t blocks = n / ti->block_elems;
    for (uint64_t i = 0; i < blocks; i++, b += ti->block_bytes, dst += ti->block_elems) {
        switch (t) {
        case GGML_TYPE_Q4_0: deq_q4_0(b, dst); break;
        case GGML_TYPE_Q4_1: deq_q4_1(b, dst); break;
        case GGML_TYPE_Q5_0: deq_q5_0(b, dst); break;
        case GGML_TYPE_Q5_1: deq_q5_1(b, dst); break;
        case GGML_TYPE_Q8_0: deq_q8(b, 2, dst); break;
        case GGML_TYPE_Q8_1: deq_q8(b, 4, dst); break;
        case GGML_TYPE_Q2_K: deq_q2_k(b, dst); break;
        case GGML_TYPE_Q3_K: deq_q3_k(b, dst); break;
        case GGML_TYPE_Q4_K: deq_q4_k(b, dst); break;
        case GGML_TYPE_Q5_K: deq_q5_k(b, dst); break;
        case GGML_TYPE_Q6_K: deq_q6_k(b, dst); break;
        case GGML_TYPE_Q8_K: deq_q8_k(b, dst); break;
        case GGML_TYPE_IQ4_NL: deq_iq4_nl(b, dst); break;
        case GGML_TYPE_IQ4_XS: deq_iq4_xs(b, dst); break;
        case GGML_TYPE_MXFP4: deq_mxfp4(b, dst); break;
        default: return false; /* table and switch disagree: unreachable */
        }
    }
    return true;
}

void quant_quantize_q8_0(const float *src, void *dst, uint64_t n) {
    uint8_t *out = dst;
    for (uint64_t b = 0; b < n / QK; b++, src += QK, out += 2 + QK) {
        float amax = 0;
        for (int i = 0; i < QK; i++) amax = fabsf(src[i]) > amax ? fabsf(src[i]) : amax;
        uint16_t dh = quant_f32_to_f16(amax / 127.0f);
        if (dh >= 0x7c00u) dh = 0x7bffu; /* past f16's range: the largest half, never inf */
        float d = quant_f16_to_f32(dh), inv = d > 0 ? 1.0f / d : 0.0f;
        memcpy(out, &dh, 2);
        for (int i = 0; i < QK; i++) {
            float q = roundf(src[i] * inv);
            q = q > 127 ? 127 : q < -127 ? -127 : q;
            out[2 + i] = (uint8_t)(int8_t)q;
        }
    }
}
