/* quant.c: block layouts and dequantization.
 *
 * Each format has a test over a block built by hand from its layout, with
 * expected values worked out by hand (in the comments) rather than by a
 * second copy of the decoder. Two golden tests then compare against the
 * gguf Python package (tools/gen_quant_golden.py): random blocks of every
 * format, and real tensors of the default model. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <cjson/cJSON.h>
#include <math.h>

#include "../../services/model/gguf.h"
#include "../../services/model/quant.h"

#define MODEL_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Exact comparison, sign of zero and nan payload included. */
#define assert_f32(got, want) \
    do { \
        float g_ = (got), w_ = (want); \
        if (bits(g_) != bits(w_)) \
            fail_msg("%s = %.9g (0x%08x), expected %.9g (0x%08x)", #got, (double)g_, bits(g_), (double)w_, bits(w_)); \
    } while (0)

static void put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

/* f16 bit patterns used below. */
enum { H_ONE = 0x3c00, H_HALF = 0x3800, H_QUARTER = 0x3400, H_MINUS_ONE = 0xbc00 };

/* ---- f16 / bf16 ---------------------------------------------------------- */

static void f16_to_f32_decodes_every_class(void **state) {
    (void)state;
    assert_f32(quant_f16_to_f32(0x0000), 0.0f);
    assert_f32(quant_f16_to_f32(0x8000), -0.0f);
    assert_f32(quant_f16_to_f32(0x3c00), 1.0f);
    assert_f32(quant_f16_to_f32(0xc000), -2.0f);
    assert_f32(quant_f16_to_f32(0x3555), 0.333251953125f);
    assert_f32(quant_f16_to_f32(0x7bff), 65504.0f);
    assert_f32(quant_f16_to_f32(0xfbff), -65504.0f);
    assert_f32(quant_f16_to_f32(0x0400), 6.103515625e-05f);        /* 2^-14, min normal */
    assert_f32(quant_f16_to_f32(0x0001), 5.9604644775390625e-08f); /* 2^-24, min subnormal */
    assert_f32(quant_f16_to_f32(0x8001), -5.9604644775390625e-08f);
    assert_f32(quant_f16_to_f32(0x03ff), 6.0975551605224609375e-05f); /* 1023 * 2^-24 */
    assert_f32(quant_f16_to_f32(0x0200), 3.0517578125e-05f);          /* 512 * 2^-24 */
    assert_f32(quant_f16_to_f32(0x7c00), INFINITY);
    assert_f32(quant_f16_to_f32(0xfc00), -INFINITY);
    assert_int_equal(bits(quant_f16_to_f32(0x7e00)), 0x7fc00000u); /* quiet nan */
    assert_int_equal(bits(quant_f16_to_f32(0x7c01)), 0x7f802000u); /* payload kept */
    assert_int_equal(bits(quant_f16_to_f32(0xfe00)), 0xffc00000u);
}

static void f32_to_f16_rounds_to_nearest_even(void **state) {
    (void)state;
    assert_int_equal(quant_f32_to_f16(1.0f), 0x3c00);
    assert_int_equal(quant_f32_to_f16(-0.0f), 0x8000);
    /* 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties go to even. */
    assert_int_equal(quant_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);
    assert_int_equal(quant_f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);
    assert_int_equal(quant_f32_to_f16(1.0f + 0x1p-11f + 0x1p-20f), 0x3c01);
    /* Mantissa carry into the exponent: 2 - 2^-12 rounds to 2. */
    assert_int_equal(quant_f32_to_f16(2.0f - 0x1p-12f), 0x4000);
    assert_int_equal(quant_f32_to_f16(65504.0f), 0x7bff);
    assert_int_equal(quant_f32_to_f16(65519.0f), 0x7bff);
    assert_int_equal(quant_f32_to_f16(65520.0f), 0x7c00); /* tie -> even -> inf */
    assert_int_equal(quant_f32_to_f16(-1e10f), 0xfc00);
    assert_int_equal(quant_f32_to_f16(INFINITY), 0x7c00);
    assert_int_equal(quant_f32_to_f16(-INFINITY), 0xfc00);
}

static void f32_to_f16_handles_subnormals_and_nan(void **state) {
    (void)state;
    assert_int_equal(quant_f32_to_f16(0x1p-24f), 0x0001);
    assert_int_equal(quant_f32_to_f16(0x1p-25f), 0x0000); /* tie with 0 (even) */
    assert_int_equal(quant_f32_to_f16(-0x1p-25f), 0x8000);
    assert_int_equal(quant_f32_to_f16(nextafterf(0x1p-25f, 1.0f)), 0x0001);
    assert_int_equal(quant_f32_to_f16(3 * 0x1p-25f), 0x0002); /* 1.5: tie -> 2 */
    assert_int_equal(quant_f32_to_f16(5 * 0x1p-25f), 0x0002); /* 2.5: tie -> 2 */
    assert_int_equal(quant_f32_to_f16(0x1p-26f), 0x0000);
    assert_int_equal(quant_f32_to_f16(1e-30f), 0x0000);
    assert_int_equal(quant_f32_to_f16(0x1p-149f), 0x0000);          /* f32 subnormal */
    assert_int_equal(quant_f32_to_f16(1023.5f * 0x1p-24f), 0x0400); /* up into normal */
    assert_int_equal(quant_f32_to_f16(1022.5f * 0x1p-24f), 0x03fe);
    assert_int_equal(quant_f32_to_f16(0x1p-14f), 0x0400);
    uint16_t n = quant_f32_to_f16(NAN);
    assert_int_equal(n & 0x7c00, 0x7c00);
    assert_true((n & 0x03ff) != 0);
    /* A signalling nan whose payload lives only in the low bits must not
     * turn into inf. */
    assert_int_equal(quant_f32_to_f16(from_bits(0x7f800001u)), 0x7e00);
    assert_int_equal(quant_f32_to_f16(from_bits(0xff800001u)), 0xfe00);
}

static void f16_round_trips_every_pattern(void **state) {
    (void)state;
    for (uint32_t h = 0; h <= 0xffff; h++) {
        uint16_t back = quant_f32_to_f16(quant_f16_to_f32((uint16_t)h));
        bool is_nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
        if (is_nan) {
            if ((back & 0x7c00) != 0x7c00 || !(back & 0x3ff) || (back & 0x8000) != (h & 0x8000))
                fail_msg("nan 0x%04x came back as 0x%04x", h, back);
        } else if (back != h) {
            fail_msg("0x%04x came back as 0x%04x", h, back);
        }
    }
}

#ifdef __FLT16_MAX__
/* The compiler's own _Float16 conversion is an independent reference for
 * rounding: sweep f32 patterns with a stride that visits every exponent. */
static void f32_to_f16_matches_compiler(void **state) {
    (void)state;
    for (uint64_t u = 0; u <= 0xffffffffu; u += 0x1f3d) {
        float f = from_bits((uint32_t)u);
        if (isnan(f)) continue;
        _Float16 ref = (_Float16)f;
        uint16_t want;
        memcpy(&want, &ref, sizeof want);
        uint16_t got = quant_f32_to_f16(f);
        if (got != want) fail_msg("f32 0x%08x: got 0x%04x, compiler 0x%04x", (uint32_t)u, got, want);
    }
}
#endif

static void bf16_conversions_are_exact(void **state) {
    (void)state;
    assert_f32(quant_bf16_to_f32(0x3f80), 1.0f);
    assert_f32(quant_bf16_to_f32(0xc040), -3.0f);
    assert_f32(quant_bf16_to_f32(0x8000), -0.0f);
    assert_f32(quant_bf16_to_f32(0x0001), 0x1p-133f); /* smallest subnormal */
    assert_f32(quant_bf16_to_f32(0x7f80), INFINITY);
    assert_f32(quant_bf16_to_f32(0xff80), -INFINITY);
    assert_int_equal(bits(quant_bf16_to_f32(0x7fc1)), 0x7fc10000u);

    assert_int_equal(quant_f32_to_bf16(1.0f), 0x3f80);
    assert_int_equal(quant_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);     /* tie -> even */
    assert_int_equal(quant_f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82); /* tie -> even */
    assert_int_equal(quant_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
    assert_int_equal(quant_f32_to_bf16(from_bits(0x00018000u)), 0x0002); /* subnormal tie */
    assert_int_equal(quant_f32_to_bf16(from_bits(0x7f7f7fffu)), 0x7f7f);
    assert_int_equal(quant_f32_to_bf16(from_bits(0x7f7fffffu)), 0x7f80); /* FLT_MAX -> inf */
    assert_int_equal(quant_f32_to_bf16(-INFINITY), 0xff80);
    assert_int_equal(quant_f32_to_bf16(from_bits(0x7f800001u)), 0x7fc0); /* stays nan */
    assert_int_equal(quant_f32_to_bf16(from_bits(0xffc00000u)), 0xffc0);
}

/* ---- type table ---------------------------------------------------------- */

static void type_table_has_ggml_sizes(void **state) {
    (void)state;
    static const struct {
        ggml_type t;
        const char *name;
        uint32_t elems, bytes;
    } want[] = {
        {GGML_TYPE_F32, "F32", 1, 4},         {GGML_TYPE_F16, "F16", 1, 2},
        {GGML_TYPE_BF16, "BF16", 1, 2},       {GGML_TYPE_Q4_0, "Q4_0", 32, 18},
        {GGML_TYPE_Q4_1, "Q4_1", 32, 20},     {GGML_TYPE_Q5_0, "Q5_0", 32, 22},
        {GGML_TYPE_Q5_1, "Q5_1", 32, 24},     {GGML_TYPE_Q8_0, "Q8_0", 32, 34},
        {GGML_TYPE_Q8_1, "Q8_1", 32, 36},     {GGML_TYPE_Q2_K, "Q2_K", 256, 84},
        {GGML_TYPE_Q3_K, "Q3_K", 256, 110},   {GGML_TYPE_Q4_K, "Q4_K", 256, 144},
        {GGML_TYPE_Q5_K, "Q5_K", 256, 176},   {GGML_TYPE_Q6_K, "Q6_K", 256, 210},
        {GGML_TYPE_Q8_K, "Q8_K", 256, 292},   {GGML_TYPE_I8, "I8", 1, 1},
        {GGML_TYPE_I32, "I32", 1, 4},         {GGML_TYPE_F64, "F64", 1, 8},
        {GGML_TYPE_IQ4_NL, "IQ4_NL", 32, 18}, {GGML_TYPE_IQ4_XS, "IQ4_XS", 256, 136},
        {GGML_TYPE_MXFP4, "MXFP4", 32, 17},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        assert_true(quant_type_known(want[i].t));
        assert_string_equal(quant_type_name(want[i].t), want[i].name);
        assert_int_equal(quant_block_elems(want[i].t), want[i].elems);
        assert_int_equal(quant_block_bytes(want[i].t), want[i].bytes);
    }
}

static void unknown_types_are_named_by_number(void **state) {
    (void)state;
    assert_false(quant_type_known(4)); /* Q4_2, removed from ggml */
    assert_false(quant_type_known(63));
    assert_false(quant_type_known(64));
    assert_false(quant_type_known(0xffffffffu));
    assert_string_equal(quant_type_name(4), "type4");
    assert_string_equal(quant_type_name(4000000000u), "type4000000000");
    assert_int_equal(quant_block_elems((ggml_type)5), 0);
    assert_int_equal(quant_block_bytes((ggml_type)5), 0);
}

static void row_bytes_requires_whole_blocks(void **state) {
    (void)state;
    assert_int_equal(quant_row_bytes(GGML_TYPE_Q4_K, 512), 288);
    assert_int_equal(quant_row_bytes(GGML_TYPE_Q4_1, 576), 360);
    assert_int_equal(quant_row_bytes(GGML_TYPE_Q8_0, 576), 612);
    assert_int_equal(quant_row_bytes(GGML_TYPE_F32, 3), 12);
    assert_int_equal(quant_row_bytes(GGML_TYPE_Q4_K, 100), 0);
    assert_int_equal(quant_row_bytes(GGML_TYPE_Q4_0, 33), 0);
    assert_int_equal(quant_row_bytes((ggml_type)4, 32), 0);
    assert_int_equal(quant_row_bytes(GGML_TYPE_IQ4_NL, 576), 18 * 18);
    assert_int_equal(quant_row_bytes(GGML_TYPE_IQ4_XS, 4096), 16 * 136);
    assert_int_equal(quant_row_bytes(GGML_TYPE_MXFP4, 2880), 90 * 17);
    assert_int_equal(quant_row_bytes(GGML_TYPE_IQ4_XS, 576), 0);
}

static void dequantize_rejects_bad_requests(void **state) {
    (void)state;
    uint8_t src[300] = {0};
    float dst[256];
    assert_false(quant_dequantize(GGML_TYPE_Q4_0, src, dst, 33));
    assert_false(quant_dequantize((ggml_type)4, src, dst, 32));
    assert_false(quant_dequantize((ggml_type)16, src, dst, 256)); /* IQ2_XXS: size only */
    assert_false(quant_can_dequantize(16));
    assert_false(quant_can_dequantize(GGML_TYPE_I32));
    assert_true(quant_can_dequantize(GGML_TYPE_Q6_K));
    assert_true(quant_can_dequantize(GGML_TYPE_IQ4_NL));
    assert_true(quant_can_dequantize(GGML_TYPE_IQ4_XS));
    assert_true(quant_can_dequantize(GGML_TYPE_MXFP4));
    assert_true(quant_dequantize(GGML_TYPE_Q4_0, src, dst, 0));
}

/* ---- plain types ------------------------------------------------------------ */

static void f32_f16_bf16_dequantize(void **state) {
    (void)state;
    float src32[3] = {1.5f, -0.0f, 1e30f};
    float y[4];
    assert_true(quant_dequantize(GGML_TYPE_F32, src32, y, 3));
    assert_f32(y[0], 1.5f);
    assert_f32(y[1], -0.0f);
    assert_f32(y[2], 1e30f);

    uint8_t h[8];
    put16(h, 0x3c00);
    put16(h + 2, 0xc100); /* -2.5 */
    put16(h + 4, 0x0001);
    put16(h + 6, 0xfc00);
    assert_true(quant_dequantize(GGML_TYPE_F16, h, y, 4));
    assert_f32(y[0], 1.0f);
    assert_f32(y[1], -2.5f);
    assert_f32(y[2], 0x1p-24f);
    assert_f32(y[3], -INFINITY);

    put16(h, 0x4049);     /* 3.140625 */
    put16(h + 2, 0xbf80); /* -1 */
    assert_true(quant_dequantize(GGML_TYPE_BF16, h, y, 2));
    assert_f32(y[0], 3.140625f);
    assert_f32(y[1], -1.0f);
}

/* ---- 32-element formats ------------------------------------------------------ */

/* qs[j] = j | (15 - j) << 4: low nibble counts up, high nibble down. */
static void fill_nibbles(uint8_t *qs) {
    for (int j = 0; j < 16; j++) qs[j] = (uint8_t)(j | ((15 - j) << 4));
}

static void assert_block(const float *y, const float *want, int n) {
    for (int i = 0; i < n; i++)
        if (bits(y[i]) != bits(want[i])) fail_msg("element %d = %.9g, expected %.9g", i, (double)y[i], (double)want[i]);
}

static void q4_0_low_nibbles_first_then_high(void **state) {
    (void)state;
    uint8_t b[18];
    put16(b, H_HALF);
    fill_nibbles(b + 2);
    /* y[j] = (j - 8) / 2 from the low nibbles, then y[16 + j] = (7 - j) / 2
     * from the high nibbles of the same bytes (not interleaved). */
    static const float want[32] = {
        -4,  -3.5, -3,  -2.5, -2,  -1.5, -1,  -0.5, 0,    0.5, 1,    1.5, 2,    2.5, 3,    3.5,
        3.5, 3,    2.5, 2,    1.5, 1,    0.5, 0,    -0.5, -1,  -1.5, -2,  -2.5, -3,  -3.5, -4,
    };
    float y[32];
    assert_true(quant_dequantize(GGML_TYPE_Q4_0, b, y, 32));
    assert_block(y, want, 32);
}

static void q4_1_adds_the_block_minimum(void **state) {
    (void)state;
    uint8_t b[20];
    put16(b, H_QUARTER);       /* d = 0.25 */
    put16(b + 2, H_MINUS_ONE); /* m = -1 */
    fill_nibbles(b + 4);
    /* y[j] = j/4 - 1; y[16 + j] = (15 - j)/4 - 1. */
    static const float want[32] = {
        -1,   -0.75, -0.5, -0.25, 0,    0.25, 0.5,  0.75, 1,    1.25, 1.5,  1.75, 2,     2.25, 2.5,   2.75,
        2.75, 2.5,   2.25, 2,     1.75, 1.5,  1.25, 1,    0.75, 0.5,  0.25, 0,    -0.25, -0.5, -0.75, -1,
    };
    float y[32];
    assert_true(quant_dequantize(GGML_TYPE_Q4_1, b, y, 32));
    assert_block(y, want, 32);
}

/* qs[j] = j in both nibbles; qh = 0xAAAA5555: bit j (element j) set for
 * even j < 16, bit 16 + j (element 16 + j) set for odd j. */
static void fill_q5(uint8_t *qh, uint8_t *qs) {
    qh[0] = 0x55;
    qh[1] = 0x55;
    qh[2] = 0xaa;
    qh[3] = 0xaa;
    for (int j = 0; j < 16; j++) qs[j] = (uint8_t)(j | (j << 4));
}

static void q5_0_takes_fifth_bit_from_qh(void **state) {
    (void)state;
    uint8_t b[22];
    put16(b, H_ONE);
    fill_q5(b + 2, b + 6);
    /* q = j + 16 * bit, value = q - 16. */
    static const float want[32] = {
        0,   -15, 2,   -13, 4,   -11, 6,   -9, 8,  -7, 10, -5, 12, -3, 14, -1,
        -16, 1,   -14, 3,   -12, 5,   -10, 7,  -8, 9,  -6, 11, -4, 13, -2, 15,
    };
    float y[32];
    assert_true(quant_dequantize(GGML_TYPE_Q5_0, b, y, 32));
    assert_block(y, want, 32);
}

static void q5_1_scales_and_adds_minimum(void **state) {
    (void)state;
    uint8_t b[24];
    put16(b, H_HALF);    /* d = 0.5 */
    put16(b + 2, H_ONE); /* m = 1 */
    fill_q5(b + 4, b + 8);
    /* value = q/2 + 1 with q as in Q5_0 before the -16. */
    static const float want[32] = {
        9, 1.5, 10, 2.5,  11, 3.5,  12, 4.5,  13, 5.5,  14, 6.5,  15, 7.5,  16, 8.5,
        1, 9.5, 2,  10.5, 3,  11.5, 4,  12.5, 5,  13.5, 6,  14.5, 7,  15.5, 8,  16.5,
    };
    float y[32];
    assert_true(quant_dequantize(GGML_TYPE_Q5_1, b, y, 32));
    assert_block(y, want, 32);
}

static void q8_0_is_signed_bytes_times_d(void **state) {
    (void)state;
    uint8_t b[34 * 2];
    put16(b, H_HALF);
    for (int j = 0; j < 32; j++) b[2 + j] = (uint8_t)(int8_t)(4 * j - 64);
    b[2 + 30] = 0x80; /* -128 */
    b[2 + 31] = 0x7f; /* 127 */
    /* Second block: d = -1, all quants 1, to check the block stride. */
    put16(b + 34, H_MINUS_ONE);
    memset(b + 36, 1, 32);
    float y[64];
    assert_true(quant_dequantize(GGML_TYPE_Q8_0, b, y, 64));
    for (int j = 0; j < 30; j++) assert_f32(y[j], (float)(2 * j - 32));
    assert_f32(y[0], -32.0f);
    assert_f32(y[29], 26.0f);
    assert_f32(y[30], -64.0f);
    assert_f32(y[31], 63.5f);
    assert_f32(y[32], -1.0f);
    assert_f32(y[63], -1.0f);
}

static void q8_1_skips_the_sum_field(void **state) {
    (void)state;
    uint8_t b[36];
    put16(b, H_QUARTER);
    put16(b + 2, 0x7c00); /* s: ignored even when inf */
    for (int j = 0; j < 32; j++) b[4 + j] = (uint8_t)(int8_t)(j - 16);
    float y[32];
    assert_true(quant_dequantize(GGML_TYPE_Q8_1, b, y, 32));
    assert_f32(y[0], -4.0f);
    assert_f32(y[16], 0.0f);
    assert_f32(y[17], 0.25f);
    assert_f32(y[31], 3.75f);
}

/* ---- K-quants: element e of a super-block, named by its position ------------ */

static void q2_k_two_bit_groups_of_sixteen(void **state) {
    (void)state;
    uint8_t b[84];
    /* scales[i]: scale = i % 4 + 1 (low nibble), min = i % 3 (high). */
    for (int i = 0; i < 16; i++) b[i] = (uint8_t)(((i % 3) << 4) | (i % 4 + 1));
    uint8_t *qs = b + 16;
    memset(qs, 0xe4, 64); /* 2-bit fields from bit 0 up: 0, 1, 2, 3 */
    qs[1] = 0xff;
    qs[17] = 0x00;
    qs[50] = 0x1b;            /* fields 3, 2, 1, 0 */
    put16(b + 80, H_HALF);    /* d */
    put16(b + 82, H_QUARTER); /* dmin */
    float y[256];
    assert_true(quant_dequantize(GGML_TYPE_Q2_K, b, y, 256));
    /* e = 128*half + 32*shift + 16*group + l reads qs[32*half + 16*group +
     * l] at bits 2*shift, with scale index 8*half + 2*shift + group. */
    assert_f32(y[0], 0.0f);     /* q 0, sc 1, min 0 */
    assert_f32(y[1], 1.5f);     /* q 3: 0.5*1*3 */
    assert_f32(y[16], -0.25f);  /* q 0, sc 2, min 1: -0.25 */
    assert_f32(y[17], -0.25f);  /* qs[17] = 0 */
    assert_f32(y[32], 1.0f);    /* q 1, sc 3, min 2: 1.5 - 0.5 */
    assert_f32(y[33], 4.0f);    /* q 3: 4.5 - 0.5 */
    assert_f32(y[112], 5.75f);  /* qs[16] bits 6-7 = 3, sc 4, min 1: 6 - 0.25 */
    assert_f32(y[113], -0.25f); /* qs[17] = 0 */
    assert_f32(y[210], 0.75f);  /* qs[50] bits 4-5 = 1, scale 13: sc 2, min 1 */
    assert_f32(y[211], 1.75f);  /* qs[51] bits 4-5 = 2 */
    assert_f32(y[255], 6.0f);   /* q 3, scale 15: sc 4, min 0 */
}

static void q3_k_unpacks_six_bit_scales_and_hmask(void **state) {
    (void)state;
    uint8_t b[110];
    uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
    memset(hm, 0xff, 32);
    hm[5] = 0x00;
    hm[20] = 0xf0;
    memset(qs, 0xe4, 64);
    qs[5] = 0xff;
    static const uint8_t packed[12] = {0x21, 0x43, 0x65, 0x87, 0xa9, 0xcb, 0xed, 0x0f, 0xe4, 0x1b, 0x00, 0xff};
    memcpy(sc, packed, 12);
    put16(b + 108, H_HALF);
    /* Scale k = (low 4 bits | high 2 bits << 4) - 32, low from the nibbles
     * of bytes 0..7, high from bits 2*(k/4) of byte 8 + k%4:
     * k:  0   1   2   3  4   5   6   7  8   9  10  11  12  13  14  15
     *   -31  19 -27  23 -7  11 -19  31  2 -12 -26  24  26 -20 -18  16 */
    float y[256];
    assert_true(quant_dequantize(GGML_TYPE_Q3_K, b, y, 256));
    /* Clear hmask bit (bit 4*half + shift of hm[16*group + l]) subtracts 4. */
    assert_f32(y[5], 15.5f);    /* q 3-4 = -1, k0: 0.5*-31*-1 */
    assert_f32(y[36], -13.5f);  /* q 1, k2 -27 */
    assert_f32(y[37], 13.5f);   /* q 3-4, k2 */
    assert_f32(y[20], -38.0f);  /* q 0-4, k1 19 */
    assert_f32(y[52], -34.5f);  /* q 1-4, k3 23 */
    assert_f32(y[116], -15.5f); /* q 3-4, k7 31 */
    assert_f32(y[133], -4.0f);  /* half 1: hm[5] bit 4 clear, q 0-4, k8 2 */
    assert_f32(y[212], -20.0f); /* q 2, hm[20] bit 6 set, k13 -20 */
    assert_f32(y[230], -27.0f); /* q 3, k14 -18 */
    assert_f32(y[255], 24.0f);  /* q 3, k15 16 */
}

/* The Q4_K/Q5_K scale block used below; (scale, min) pairs:
 * j0 (1,5) j1 (2,6) j2 (3,7) j3 (4,63) j4 (17,2) j5 (35,20) j6 (53,38)
 * j7 (15,48). Pairs 4..7 need the top two bits of bytes 0..7. */
static const uint8_t K4_SCALES[12] = {0x41, 0x82, 0xc3, 0x04, 0x05, 0x46, 0x87, 0xff, 0x21, 0x43, 0x65, 0x0f};

static void fill_k4_qs(uint8_t *qs) {
    for (int k = 0; k < 128; k++) qs[k] = (uint8_t)((k % 16) | ((15 - k % 16) << 4));
}

static void q4_k_unpacks_scale_min_pairs(void **state) {
    (void)state;
    uint8_t b[144];
    put16(b, H_HALF);        /* d */
    put16(b + 2, H_QUARTER); /* dmin */
    memcpy(b + 4, K4_SCALES, 12);
    fill_k4_qs(b + 16);
    float y[256];
    assert_true(quant_dequantize(GGML_TYPE_Q4_K, b, y, 256));
    /* e = 64*c + 32*part + l: nibble `part` of qs[32c + l], pair 2c+part;
     * value = 0.5*sc*q - 0.25*min. */
    assert_f32(y[0], -1.25f);   /* q 0, j0 */
    assert_f32(y[3], 0.25f);    /* q 3, j0: 1.5 - 1.25 */
    assert_f32(y[32], 13.5f);   /* q 15 (high nibble), j1: 15 - 1.5 */
    assert_f32(y[45], 0.5f);    /* q 2, j1 */
    assert_f32(y[71], 8.75f);   /* q 7, j2: 10.5 - 1.75 */
    assert_f32(y[97], 12.25f);  /* q 14, j3: 28 - 15.75 */
    assert_f32(y[138], 84.5f);  /* q 10, j4: 85 - 0.5 */
    assert_f32(y[165], 170.0f); /* q 10, j5: 175 - 5 */
    assert_f32(y[207], 388.0f); /* q 15, j6: 397.5 - 9.5 */
    assert_f32(y[224], 100.5f); /* q 15, j7: 112.5 - 12 */
    assert_f32(y[255], -12.0f); /* q 0, j7 */
}

static void q5_k_adds_fifth_bit_per_run(void **state) {
    (void)state;
    uint8_t b[176];
    put16(b, H_HALF);
    put16(b + 2, H_QUARTER);
    memcpy(b + 4, K4_SCALES, 12);
    uint8_t *qh = b + 16;
    memset(qh, 0, 32);
    qh[0] = 0x01;  /* run 0, element 0 */
    qh[1] = 0x80;  /* run 7, element 1 */
    qh[7] = 0x04;  /* run 2 */
    qh[10] = 0x10; /* run 4 */
    qh[13] = 0x02; /* run 1 */
    fill_k4_qs(b + 48);
    float y[256];
    assert_true(quant_dequantize(GGML_TYPE_Q5_K, b, y, 256));
    /* As Q4_K plus 16 where bit `run` of qh[l] is set (run = e / 32). */
    assert_f32(y[0], 6.75f);    /* q 16, j0: 8 - 1.25 */
    assert_f32(y[3], 0.25f);    /* q 3 */
    assert_f32(y[32], 13.5f);   /* q 15: qh[0] bit 1 clear */
    assert_f32(y[45], 16.5f);   /* q 2+16, j1: 18 - 1.5 */
    assert_f32(y[71], 32.75f);  /* q 7+16, j2: 34.5 - 1.75 */
    assert_f32(y[138], 220.5f); /* q 10+16, j4: 221 - 0.5 */
    assert_f32(y[192], -9.5f);  /* q 0, j6 */
    assert_f32(y[225], 213.0f); /* q 14+16, j7: 225 - 12 */
    assert_f32(y[255], -12.0f); /* q 0, j7 */
}

static void q6_k_combines_low_nibbles_and_high_pairs(void **state) {
    (void)state;
    uint8_t b[210];
    uint8_t *ql = b, *qh = b + 128;
    int8_t sc[16];
    fill_k4_qs(ql); /* same nibble pattern: low k%16, high 15 - k%16 */
    memset(qh, 0, 64);
    qh[0] = 0xe4;                                                         /* bit pairs from bit 0: 0, 1, 2, 3 */
    qh[37] = 0xff;                                                        /* half 1, l 5: all 3 */
    for (int i = 0; i < 16; i++) sc[i] = (int8_t)(i < 8 ? i + 1 : 7 - i); /* 1..8, -1..-8 */
    memcpy(b + 192, sc, 16);
    put16(b + 208, H_HALF);
    float y[256];
    assert_true(quant_dequantize(GGML_TYPE_Q6_K, b, y, 256));
    /* e = 128*h + 32*r + l: low 4 bits from ql[64h + l] (r 0), ql[64h+32+l]
     * (r 1), their high nibbles (r 2, 3); high 2 bits from qh[32h + l] bits
     * 2r; q - 32 times 0.5 * sc[8h + 2r + l/16]. */
    assert_f32(y[0], -16.0f);   /* q 0-32, sc 1 */
    assert_f32(y[17], -31.0f);  /* q 1-32, sc 2 */
    assert_f32(y[32], -24.0f);  /* q 16-32, sc 3 */
    assert_f32(y[64], 37.5f);   /* q 47-32, sc 5 */
    assert_f32(y[96], 108.5f);  /* q 63-32, sc 7 */
    assert_f32(y[133], -10.5f); /* q 53-32, sc -1 */
    assert_f32(y[212], 63.0f);  /* q 11-32, sc -6 */
    assert_f32(y[229], -91.0f); /* q 58-32, sc -7 */
    assert_f32(y[255], 128.0f); /* q 0-32, sc -8 */
}

static void q8_k_uses_an_f32_scale(void **state) {
    (void)state;
    uint8_t b[292] = {0};
    float d = 0.25f;
    memcpy(b, &d, 4); /* little-endian host */
    for (int j = 0; j < 256; j++) b[4 + j] = (uint8_t)(j - 128);
    memset(b + 260, 0xff, 32); /* bsums: ignored */
    float y[256];
    assert_true(quant_dequantize(GGML_TYPE_Q8_K, b, y, 256));
    assert_f32(y[0], -32.0f);
    assert_f32(y[128], 0.0f);
    assert_f32(y[255], 31.75f);
}

/* ---- 4-bit table formats ------------------------------------------------------ */

static void iq4_nl_indexes_the_nonlinear_table(void **state) {
    (void)state;
    uint8_t b[18];
    put16(b, H_HALF);
    fill_nibbles(b + 2);
    /* y[j] = kvalues[j] / 2 from the low nibbles, y[16 + j] = kvalues[15 -
     * j] / 2 from the high nibbles. */
    static const float want[32] = {
        -63.5, -52,  -41.5, -32.5, -24.5, -17.5, -11, -5,  0.5, 6.5, 12.5,  19,    26.5,  34.5,  44.5, 56.5,
        56.5,  44.5, 34.5,  26.5,  19,    12.5,  6.5, 0.5, -5,  -11, -17.5, -24.5, -32.5, -41.5, -52,  -63.5,
    };
    float y[32];
    assert_true(quant_dequantize(GGML_TYPE_IQ4_NL, b, y, 32));
    assert_block(y, want, 32);
}

static void iq4_xs_splits_six_bit_scales(void **state) {
    (void)state;
    uint8_t b[136];
    put16(b, H_HALF); /* d */
    /* ls per run: 33 31 34 0 63 32 40 20, so d * (ls - 32) = 0.5 -0.5 1
     * -16 15.5 0 4 -6. Low nibbles in scales_l (run j: nibble j % 2 of
     * byte j / 2), high two bits in scales_h (bits 2j): 2 1 2 0 3 2 2 1. */
    put16(b + 2, 0x6b26);
    b[4] = 0xf1;
    b[5] = 0x02;
    b[6] = 0x0f;
    b[7] = 0x48;
    for (int j = 0; j < 8; j++) fill_nibbles(b + 8 + 16 * j);
    float y[256];
    assert_true(quant_dequantize(GGML_TYPE_IQ4_XS, b, y, 256));
    /* Element 32j + l is dl_j * kvalues[l], 32j + 16 + l dl_j *
     * kvalues[15 - l]. */
    assert_f32(y[0], -63.5f);            /* 0.5 * -127 */
    assert_f32(y[31], -63.5f);           /* 0.5 * kvalues[0] */
    assert_f32(y[40], -0.5f);            /* -0.5 * 1 */
    assert_f32(y[79], 113.0f);           /* 1 * 113 */
    assert_f32(y[112], -1808.0f);        /* -16 * 113 */
    assert_f32(y[128], -1968.5f);        /* 15.5 * -127 */
    assert_f32(y[163], -0.0f);           /* +0 * -65: negative zero, as in ggml */
    assert_f32(y[168], 0.0f);            /* +0 * 1 */
    assert_f32(y[201], 52.0f);           /* 4 * 13 */
    assert_f32(y[240], -678.0f);         /* -6 * 113 */
    assert_f32(y[255], 762.0f);          /* -6 * -127 */
    assert_f32(y[224 + 7], -6.0f * -10); /* 60 */
}

static void mxfp4_scales_doubled_fp4_by_a_power_of_two(void **state) {
    (void)state;
    assert_f32(quant_e8m0_to_f32_half(0), 0x1p-128f); /* f32 subnormals */
    assert_f32(quant_e8m0_to_f32_half(1), 0x1p-127f);
    assert_f32(quant_e8m0_to_f32_half(2), 0x1p-126f);
    assert_f32(quant_e8m0_to_f32_half(127), 0.5f);
    assert_f32(quant_e8m0_to_f32_half(128), 1.0f);
    assert_f32(quant_e8m0_to_f32_half(255), 0x1p127f);

    uint8_t b[4 * 17];
    b[0] = 127; /* 2^-1: the table halved, FP4's own values */
    fill_nibbles(b + 1);
    b[17] = 0; /* 2^-128 */
    memset(b + 18, 0x91, 16);
    b[34] = 1; /* 2^-127 */
    memset(b + 35, 0xf6, 16);
    b[51] = 254; /* 2^126 */
    memset(b + 52, 0x0a, 16);
    float y[128];
    assert_true(quant_dequantize(GGML_TYPE_MXFP4, b, y, 128));
    static const float want[32] = {
        0,  0.5, 1,  1.5, 2,    3,  4,    6, 0, -0.5, -1, -1.5, -2,  -3, -4,  -6,
        -6, -4,  -3, -2,  -1.5, -1, -0.5, 0, 6, 4,    3,  2,    1.5, 1,  0.5, 0,
    };
    assert_block(y, want, 32);
    assert_f32(y[8], 0.0f); /* index 8 is +0, not -0 */
    assert_f32(y[32], 0x1p-128f);
    assert_f32(y[48], -0x1p-128f);
    assert_f32(y[64], 0x1p-124f);  /* 8 * 2^-127 */
    assert_f32(y[80], -0x3p-125f); /* -12 * 2^-127 */
    assert_f32(y[96], -0x1p127f);  /* -2 * 2^126 */
    assert_f32(y[127], 0.0f);
}

/* ---- golden data from the gguf Python package -------------------------------- */

static cJSON *load_json(const char *path) {
    FILE *fp = fopen(path, "rb");
    if (!fp) fail_msg("%s: cannot open (run tools/gen_quant_golden.py)", path);
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    char *text = malloc((size_t)n + 1);
    assert_non_null(text);
    assert_int_equal(fread(text, 1, (size_t)n, fp), (size_t)n);
    text[n] = '\0';
    fclose(fp);
    cJSON *j = cJSON_Parse(text);
    free(text);
    if (!j) fail_msg("%s: not valid JSON", path);
    return j;
}

static const char *json_str(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    assert_true(cJSON_IsString(v));
    return v->valuestring;
}

static double json_num(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    assert_true(cJSON_IsNumber(v));
    return v->valuedouble;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    fail_msg("bad hex digit '%c'", c);
    return 0;
}

static ggml_type type_by_name(const char *name) {
    for (uint32_t t = 0; t < GGML_TYPE_COUNT_MAX; t++)
        if (quant_type_known(t) && strcmp(quant_type_name(t), name) == 0) return (ggml_type)t;
    fail_msg("unknown type %s in golden data", name);
    return GGML_TYPE_F32;
}

static void matches_python_on_random_blocks(void **state) {
    (void)state;
    cJSON *root = load_json("tests/golden/quant/synthetic.json");
    const cJSON *cases = cJSON_GetObjectItemCaseSensitive(root, "cases");
    assert_true(cJSON_GetArraySize(cases) >= 15);
    const cJSON *c;
    cJSON_ArrayForEach(c, cases) {
        ggml_type t = type_by_name(json_str(c, "type"));
        uint64_t n = (uint64_t)json_num(c, "n");
        const char *hex = json_str(c, "bytes_hex");
        const char *want = json_str(c, "expect_f32_bits");
        size_t nbytes = strlen(hex) / 2;
        assert_int_equal(nbytes, quant_row_bytes(t, n));
        assert_int_equal(strlen(want), 8 * n);
        uint8_t *src = malloc(nbytes);
        float *y = malloc(n * sizeof *y);
        assert_true(src && y);
        for (size_t i = 0; i < nbytes; i++) src[i] = (uint8_t)(hexval(hex[2 * i]) << 4 | hexval(hex[2 * i + 1]));
        assert_true(quant_dequantize(t, src, y, n));
        for (uint64_t i = 0; i < n; i++) {
            uint32_t w = 0;
            for (int k = 0; k < 8; k++) w = w << 4 | (uint32_t)hexval(want[8 * i + k]);
            if (bits(y[i]) != w)
                fail_msg("%s element %llu: 0x%08x, python 0x%08x", quant_type_name(t), (unsigned long long)i,
                         bits(y[i]), w);
        }
        free(src);
        free(y);
    }
    cJSON_Delete(root);
}

static void matches_python_on_the_default_model(void **state) {
    (void)state;
    if (access(MODEL_PATH, R_OK) != 0)
        fail_msg("%s is missing: run `make model` (the test runner fetches it)", MODEL_PATH);
    ae_error err = {0};
    gguf_file *f;
    if (gguf_open(&f, MODEL_PATH, &err)) fail_msg("%s", err.msg);
    cJSON *root = load_json("tests/golden/quant/smollm2.json");
    int cols = (int)json_num(root, "cols");
    const cJSON *tensors = cJSON_GetObjectItemCaseSensitive(root, "tensors");
    assert_int_equal(cJSON_GetArraySize(tensors), 5);
    const cJSON *jt;
    cJSON_ArrayForEach(jt, tensors) {
        const char *name = json_str(jt, "name");
        const gguf_tensor *t = gguf_find_tensor(f, name);
        if (!t) fail_msg("tensor %s not in the model", name);
        assert_string_equal(quant_type_name(t->type), json_str(jt, "type"));
        float *y = malloc(t->n_elements * sizeof *y);
        assert_non_null(y);
        assert_true(quant_dequantize(t->type, t->data, y, t->n_elements));
        double sum = 0, sum_abs = 0;
        for (uint64_t i = 0; i < t->n_elements; i++) {
            sum += y[i];
            sum_abs += fabs(y[i]);
        }
        double want_sum = json_num(jt, "sum"), want_abs = json_num(jt, "sum_abs");
        /* Summation order differs (numpy sums pairwise); 1e-6 of the sum
         * of magnitudes bounds that, and a wrong decoder misses by far more. */
        if (fabs(sum - want_sum) > 1e-6 * want_abs || fabs(sum_abs - want_abs) > 1e-6 * want_abs)
            fail_msg("%s: sum %.17g / %.17g, python %.17g / %.17g", name, sum, sum_abs, want_sum, want_abs);
        const cJSON *s;
        cJSON_ArrayForEach(s, cJSON_GetObjectItemCaseSensitive(jt, "samples")) {
            uint64_t row = (uint64_t)json_num(s, "row");
            const cJSON *vals = cJSON_GetObjectItemCaseSensitive(s, "values");
            assert_int_equal(cJSON_GetArraySize(vals), cols);
            int k = 0;
            const cJSON *v;
            cJSON_ArrayForEach(v, vals) {
                float want = (float)v->valuedouble; /* exact: the JSON holds an f32 */
                float got = y[row * t->ne[0] + (uint64_t)k];
                if (bits(got) != bits(want))
                    fail_msg("%s row %llu col %d: %.9g, python %.9g", name, (unsigned long long)row, k, (double)got,
                             (double)want);
                k++;
            }
        }
        free(y);
    }
    cJSON_Delete(root);
    gguf_close(f);
}

/* Tests find their data relative to the repository root: the binary lives
 * at build/asan/tests/, so the root is three levels up from it. */
static void chdir_to_repo_root(void) {
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return;
    exe[n] = '\0';
    for (int up = 0; up < 4; up++) {
        char *slash = strrchr(exe, '/');
        if (!slash) return;
        *slash = '\0';
    }
    if (chdir(exe) != 0) return;
}

/* The Q8_0 quantizer (for draft heads): d = f16(amax / 127), q rounded to
 * nearest with ties away from zero. Block 1: amax 127 gives d = 1 exactly,
 * so q = round(x). Block 2 is all zero: d = 0, q = 0. Then a round trip
 * on random values stays within d / 2 of each element. */
static void q8_0_quantizer_rounds_each_block_to_its_amax(void **state) {
    (void)state;
    float x[64] = {0};
    for (int i = 0; i < 32; i++) x[i] = (float)(i - 16) * 0.75f;
    x[31] = 127.0f;
    x[5] = 2.5f;  /* a tie: away from zero, 3 */
    x[6] = -2.5f; /* -3 */
    uint8_t blocks[2 * 34];
    quant_quantize_q8_0(x, blocks, 64);
    uint16_t d;
    memcpy(&d, blocks, 2);
    assert_int_equal(d, quant_f32_to_f16(1.0f));
    assert_int_equal((int8_t)blocks[2 + 5], 3);
    assert_int_equal((int8_t)blocks[2 + 6], -3);
    assert_int_equal((int8_t)blocks[2 + 0], -12); /* -16 * 0.75 */
    assert_int_equal((int8_t)blocks[2 + 1], -11); /* -11.25 */
    assert_int_equal((int8_t)blocks[2 + 31], 127);
    memcpy(&d, blocks + 34, 2);
    assert_int_equal(d, 0);
    for (int i = 0; i < 32; i++) assert_int_equal(blocks[34 + 2 + i], 0);

    float r[256], back[256];
    uint8_t q[8 * 34];
    uint64_t st = 42;
    for (int i = 0; i < 256; i++) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        r[i] = (float)((double)(st >> 11) / 9007199254740992.0 * 2 - 1) * (float)(1 + i / 32);
    }
    quant_quantize_q8_0(r, q, 256);
    assert_true(quant_dequantize(GGML_TYPE_Q8_0, q, back, 256));
    for (int b = 0; b < 8; b++) {
        uint16_t dh;
        memcpy(&dh, q + b * 34, 2);
        float db = quant_f16_to_f32(dh);
        for (int i = 0; i < 32; i++) assert_true(fabsf(back[b * 32 + i] - r[b * 32 + i]) <= db * 0.5f * 1.0001f);
    }
}

/* ---- quant_quantize ----------------------------------------------------------- */

/* Each quantizer's promise (services/model/quant_encode.c): the largest
 * |dequantize(quantize(x)) - x| in a block, as a fraction of the block's
 * amax (the 256-element super-block for K-quants and IQ4_XS). F16 and
 * BF16 are bounded per element instead, relative to |x|. */
static const struct {
    ggml_type t;
    double bound;
} QUANTIZERS[] = {
    {GGML_TYPE_F32, 0},       {GGML_TYPE_F16, 0x1p-11},   {GGML_TYPE_BF16, 0x1p-8},   {GGML_TYPE_Q8_0, 0.00395},
    {GGML_TYPE_Q4_0, 0.1255}, {GGML_TYPE_Q4_1, 0.0686},   {GGML_TYPE_Q5_0, 0.0630},   {GGML_TYPE_Q5_1, 0.0342},
    {GGML_TYPE_Q2_K, 0.368},  {GGML_TYPE_Q3_K, 0.2582},   {GGML_TYPE_Q4_K, 0.0688},   {GGML_TYPE_Q5_K, 0.0331},
    {GGML_TYPE_Q6_K, 0.0316}, {GGML_TYPE_IQ4_NL, 0.1107}, {GGML_TYPE_IQ4_XS, 0.1138}, {GGML_TYPE_MXFP4, 0.2001},
};
#define N_QUANTIZERS (sizeof QUANTIZERS / sizeof QUANTIZERS[0])

static uint64_t lcg(uint64_t *st) {
    *st = *st * 6364136223846793005ull + 1442695040888963407ull;
    return *st >> 11;
}

static double uniform01(uint64_t *st) { return ((double)lcg(st) + 0.5) / 9007199254740992.0; }

/* n values of one of five shapes: gaussian (std 0.02, as make-model
 * writes), uniform in [-1, 1], gaussian with rare outliers, runs of 16
 * of one sign (some all negative, for the mins), and gaussian with a
 * magnitude that changes every 32 elements by up to 1000x. */
static void fill_test_data(float *x, int n, int shape, uint64_t seed) {
    uint64_t st = seed;
    for (int i = 0; i < n; i++) {
        double g = sqrt(-2 * log(uniform01(&st))) * cos(6.283185307179586 * uniform01(&st));
        double v;
        switch (shape) {
        case 0: v = 0.02 * g; break;
        case 1: v = 2 * uniform01(&st) - 1; break;
        case 2: v = 0.02 * g + (uniform01(&st) < 0.002 ? 0.5 : 0.0); break;
        case 3: v = (0.01 + 0.3 * uniform01(&st)) * ((i / 16) % 3 == 0 ? -1 : 1); break;
        default: v = g * pow(10.0, (double)((i / 32) % 4) - 2); break;
        }
        x[i] = (float)v;
    }
}

static void quantizers_stay_within_their_bounds(void **state) {
    (void)state;
    enum { N = 256 * 64 };
    float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
    uint8_t *q = malloc(N * sizeof(float));
    assert_true(x && y && q);
    double worst_of[N_QUANTIZERS] = {0};
    for (int shape = 0; shape < 5; shape++) {
        fill_test_data(x, N, shape, 1000 + (uint64_t)shape);
        for (size_t k = 0; k < N_QUANTIZERS; k++) {
            ggml_type t = QUANTIZERS[k].t;
            assert_true(quant_quantize(t, x, q, N));
            assert_true(quant_dequantize(t, q, y, N));
            uint32_t be = quant_block_elems(t);
            double worst = 0;
            for (int b = 0; b < N / (int)be; b++) {
                const float *xb = x + b * be, *yb = y + b * be;
                double amax = 0;
                for (uint32_t i = 0; i < be; i++) amax = fmax(amax, fabs((double)xb[i]));
                for (uint32_t i = 0; i < be; i++) {
                    double err = fabs((double)yb[i] - (double)xb[i]);
                    /* f16 below 2^-14 is subnormal: a fixed step of 2^-24 */
                    double scale = be > 1 ? amax : fmax(fabs((double)xb[i]), t == GGML_TYPE_F16 ? 0x1p-14 : 0.0);
                    if (err > QUANTIZERS[k].bound * scale)
                        fail_msg("%s, data shape %d, element %d: %.9g came back as %.9g (error %.3g of %s %.9g, "
                                 "bound %.4g)",
                                 quant_type_name(t), shape, b * (int)be + (int)i, (double)xb[i], (double)yb[i],
                                 err / scale, be == 1 ? "|x|" : "amax", scale, QUANTIZERS[k].bound);
                    if (scale > 0) worst = fmax(worst, err / scale);
                }
            }
            worst_of[k] = fmax(worst_of[k], worst);
        }
    }
    /* A bound far above what the data reaches would test nothing: the
     * data comes within 10% of each. */
    for (size_t k = 0; k < N_QUANTIZERS; k++)
        if (worst_of[k] < 0.9 * QUANTIZERS[k].bound)
            fail_msg("%s: worst error %.4g, far under its bound %.4g", quant_type_name(QUANTIZERS[k].t), worst_of[k],
                     QUANTIZERS[k].bound);
    free(x);
    free(y);
    free(q);
}

/* Zeros come back as zeros: a whole block, and a zero run inside a block
 * whose other runs are not. Every byte of the output is written (two
 * differently poisoned buffers end equal), and twice the same input gives
 * the same bytes. */
static void quantizers_write_zeros_and_every_byte(void **state) {
    (void)state;
    enum { N = 512 };
    float x[N], y[N];
    uint8_t a[N * 4], b[N * 4];
    fill_test_data(x, N, 0, 7);
    for (int i = 0; i < 256; i++) x[i] = 0.0f;             /* block 0 (and super-block 0) all zero */
    for (int i = 256 + 32; i < 256 + 64; i++) x[i] = 0.0f; /* run 1 of super-block 1 */
    for (size_t k = 0; k < N_QUANTIZERS; k++) {
        ggml_type t = QUANTIZERS[k].t;
        memset(a, 0xaa, sizeof a);
        memset(b, 0x55, sizeof b);
        assert_true(quant_quantize(t, x, a, N));
        assert_true(quant_quantize(t, x, b, N));
        if (memcmp(a, b, quant_row_bytes(t, N)) != 0)
            fail_msg("%s: output depends on what dst held", quant_type_name(t));
        assert_true(quant_dequantize(t, a, y, N));
        for (int i = 0; i < N; i++)
            if ((i < 256 || (i >= 288 && i < 320)) && y[i] != 0.0f)
                fail_msg("%s: element %d is %.9g, expected 0", quant_type_name(t), i, (double)y[i]);
    }
}

/* Input past f16's range still gets finite scales (the largest half):
 * the values are off, but no inf or nan reaches a file. */
static void quantizer_scales_stay_finite(void **state) {
    (void)state;
    float x[256], y[256];
    uint8_t q[1024];
    for (int i = 0; i < 256; i++) x[i] = (float)((i % 7) - 3) * 3e6f;
    for (size_t k = 0; k < N_QUANTIZERS; k++) {
        ggml_type t = QUANTIZERS[k].t;
        if (quant_block_elems(t) == 1) continue; /* f16 of 9e6 is inf by definition */
        assert_true(quant_quantize(t, x, q, 256));
        assert_true(quant_dequantize(t, q, y, 256));
        for (int i = 0; i < 256; i++)
            if (!isfinite(y[i])) fail_msg("%s: element %d is %g", quant_type_name(t), i, (double)y[i]);
    }
}

/* Blocks whose values sit on the levels come back exactly. */
static void quantizers_hit_exact_levels(void **state) {
    (void)state;
    float x[32], y[32];
    uint8_t q[64];
    /* IQ4_NL: the table halved; m = -63.5 gives d = 0.5. */
    for (int i = 0; i < 32; i++) x[i] = 0.5f * (float)quant_kvalues_iq4nl[(i * 7) % 16];
    assert_true(quant_quantize(GGML_TYPE_IQ4_NL, x, q, 32));
    assert_int_equal(q[0] | q[1] << 8, H_HALF);
    assert_true(quant_dequantize(GGML_TYPE_IQ4_NL, q, y, 32));
    assert_block(y, x, 32);
    /* MXFP4: amax 12 is 8 to 12 units at unit 1 (e = 128). */
    for (int i = 0; i < 32; i++) x[i] = (float)quant_kvalues_mxfp4[(i * 5) % 16];
    assert_true(quant_quantize(GGML_TYPE_MXFP4, x, q, 32));
    assert_int_equal(q[0], 128);
    assert_true(quant_dequantize(GGML_TYPE_MXFP4, q, y, 32));
    assert_block(y, x, 32);
    /* amax 6.5 is over 6 units at unit 1: still e = 128, and 6.5 rounds
     * to 6. amax 12.5 needs unit 2 (e = 129). */
    x[3] = 6.5f;
    for (int i = 0; i < 32; i++) x[i] = x[i] > 6.5f ? 6.0f : x[i] < -6.5f ? -6.0f : x[i];
    assert_true(quant_quantize(GGML_TYPE_MXFP4, x, q, 32));
    assert_int_equal(q[0], 128);
    x[3] = 12.5f;
    assert_true(quant_quantize(GGML_TYPE_MXFP4, x, q, 32));
    assert_int_equal(q[0], 129);
    /* Q4_0: m = -16 gives d = 2; x = i - 16 rounds to even steps, and 15
     * clips to level 7 (14). */
    for (int i = 0; i < 32; i++) x[i] = (float)(i - 16);
    assert_true(quant_quantize(GGML_TYPE_Q4_0, x, q, 32));
    assert_int_equal(q[0] | q[1] << 8, quant_f32_to_f16(2.0f));
    assert_true(quant_dequantize(GGML_TYPE_Q4_0, q, y, 32));
    assert_f32(y[0], -16.0f);
    assert_f32(y[4], -12.0f);
    assert_f32(y[17], 2.0f);  /* 1 / 2 = 0.5 rounds away from zero */
    assert_f32(y[31], 14.0f); /* clipped */
}

static void quantize_rejects_other_types_and_bad_sizes(void **state) {
    (void)state;
    float x[256] = {0};
    uint8_t q[2048];
    assert_false(quant_quantize(GGML_TYPE_Q8_1, x, q, 32));
    assert_false(quant_quantize(GGML_TYPE_Q8_K, x, q, 256));
    assert_false(quant_quantize((ggml_type)16, x, q, 256)); /* IQ2_XXS */
    assert_false(quant_quantize(GGML_TYPE_I32, x, q, 4));
    assert_false(quant_quantize((ggml_type)4, x, q, 32));
    assert_false(quant_quantize(GGML_TYPE_Q4_K, x, q, 128));
    assert_false(quant_quantize(GGML_TYPE_MXFP4, x, q, 48));
    assert_true(quant_quantize(GGML_TYPE_Q4_K, x, q, 0));
}

int main(void) {
    chdir_to_repo_root();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(f16_to_f32_decodes_every_class),
        cmocka_unit_test(f32_to_f16_rounds_to_nearest_even),
        cmocka_unit_test(f32_to_f16_handles_subnormals_and_nan),
        cmocka_unit_test(f16_round_trips_every_pattern),
#ifdef __FLT16_MAX__
        cmocka_unit_test(f32_to_f16_matches_compiler),
#endif
        cmocka_unit_test(bf16_conversions_are_exact),
        cmocka_unit_test(type_table_has_ggml_sizes),
        cmocka_unit_test(unknown_types_are_named_by_number),
        cmocka_unit_test(row_bytes_requires_whole_blocks),
        cmocka_unit_test(dequantize_rejects_bad_requests),
        cmocka_unit_test(f32_f16_bf16_dequantize),
        cmocka_unit_test(q4_0_low_nibbles_first_then_high),
        cmocka_unit_test(q4_1_adds_the_block_minimum),
        cmocka_unit_test(q5_0_takes_fifth_bit_from_qh),
        cmocka_unit_test(q5_1_scales_and_adds_minimum),
        cmocka_unit_test(q8_0_is_signed_bytes_times_d),
        cmocka_unit_test(q8_1_skips_the_sum_field),
        cmocka_unit_test(q8_0_quantizer_rounds_each_block_to_its_amax),
        cmocka_unit_test(q2_k_two_bit_groups_of_sixteen),
        cmocka_unit_test(q3_k_unpacks_six_bit_scales_and_hmask),
        cmocka_unit_test(q4_k_unpacks_scale_min_pairs),
        cmocka_unit_test(q5_k_adds_fifth_bit_per_run),
        cmocka_unit_test(q6_k_combines_low_nibbles_and_high_pairs),
        cmocka_unit_test(q8_k_uses_an_f32_scale),
        cmocka_unit_test(iq4_nl_indexes_the_nonlinear_table),
        cmocka_unit_test(iq4_xs_splits_six_bit_scales),
        cmocka_unit_test(mxfp4_scales_doubled_fp4_by_a_power_of_two),
        cmocka_unit_test(quantizers_stay_within_their_bounds),
        cmocka_unit_test(quantizers_write_zeros_and_every_byte),
        cmocka_unit_test(quantizer_scales_stay_finite),
        cmocka_unit_test(quantizers_hit_exact_levels),
        cmocka_unit_test(quantize_rejects_other_types_and_bad_sizes),
        cmocka_unit_test(matches_python_on_random_blocks),
        cmocka_unit_test(matches_python_on_the_default_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
