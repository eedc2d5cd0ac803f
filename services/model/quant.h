/* ggml tensor types: block layouts and dequantization to f32.
 *
 * Numbering follows ggml's enum so file values map directly. A type is
 * "known" when its block layout is implemented here; files may name other
 * types, which the readers report by number. */
#ifndef AERIE_MODEL_QUANT_H
#define AERIE_MODEL_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum ggml_type {
    GGML_TYPE_F32 = 0,
    GGML_TYPE_F16 = 1,
    GGML_TYPE_Q4_0 = 2,
    GGML_TYPE_Q4_1 = 3,
    GGML_TYPE_Q5_0 = 6,
    GGML_TYPE_Q5_1 = 7,
    GGML_TYPE_Q8_0 = 8,
    GGML_TYPE_Q8_1 = 9,
    GGML_TYPE_Q2_K = 10,
    GGML_TYPE_Q3_K = 11,
    GGML_TYPE_Q4_K = 12,
    GGML_TYPE_Q5_K = 13,
    GGML_TYPE_Q6_K = 14,
    GGML_TYPE_Q8_K = 15,
    GGML_TYPE_IQ4_NL = 20,
    GGML_TYPE_IQ4_XS = 23,
    GGML_TYPE_I8 = 24,
    GGML_TYPE_I16 = 25,
    GGML_TYPE_I32 = 26,
    GGML_TYPE_I64 = 27,
    GGML_TYPE_F64 = 28,
    GGML_TYPE_BF16 = 30,
    GGML_TYPE_MXFP4 = 39,
    GGML_TYPE_COUNT_MAX = 64
} ggml_type;

/* True when the block layout of t is known (sizes below are valid). */
bool quant_type_known(uint32_t t);
/* True when quant_dequantize supports t. */
bool quant_can_dequantize(uint32_t t);
const char *quant_type_name(uint32_t t); /* "Q4_1"; "type42" style for unknown */
uint32_t quant_block_elems(ggml_type t); /* elements per block (1 for plain types) */
uint32_t quant_block_bytes(ggml_type t); /* bytes per block */

/* Bytes for n elements; n must be a multiple of the block size, else
 * returns 0 (callers treat that as a malformed tensor). */
uint64_t quant_row_bytes(ggml_type t, uint64_t n);

/* Dequantizes n elements (a multiple of the block size) from src to dst.
 * Returns false for unsupported types or a bad n. */
bool quant_dequantize(ggml_type t, const void *src, float *dst, uint64_t n);

/* The type llama.cpp's quantizer writes for t in a matrix of rows `cols`
 * wide: t where its block divides cols, else Q4_K -> Q5_0, Q5_K -> Q5_1,
 * Q6_K -> Q8_0 and Q2_K, Q3_K, IQ4_XS -> IQ4_NL (cols a multiple of 32). */
ggml_type quant_fit_type(ggml_type t, int64_t cols);

/* Quantizes n floats (a multiple of t's block size) from src to dst
 * (quant_row_bytes(t, n) bytes). Supports F32, F16, BF16, Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS and
 * MXFP4; returns false for other types or a bad n. Plain round-to-nearest
 * per block (services/model/quant_encode.c states each type's rule and error
 * bound): made for test files of random weights, not for production
 * quality. Deterministic, every f16 scale finite, all-zero blocks give
 * zeros. Input must be finite. */
bool quant_quantize(ggml_type t, const float *src, void *dst, uint64_t n);

/* The 4-bit value tables of IQ4_NL/IQ4_XS and of MXFP4 (FP4 E2M1 values
 * doubled), and MXFP4's E8M0 scale as ggml decodes it, halved to match
 * the doubled table: 2^(e - 128). */
extern const int8_t quant_kvalues_iq4nl[16];
extern const int8_t quant_kvalues_mxfp4[16];
float quant_e8m0_to_f32_half(uint8_t e);

/* Quantizes n floats (a multiple of 32) to Q8_0 blocks at dst
 * (n / 32 * 34 bytes): per block d = f16(amax / 127) and q = x / d rounded
 * to nearest, ties away from zero, clamped to [-127, 127]; an all-zero
 * block gets d = 0, and a d past f16's range the largest finite half.
 * Non-finite input is the caller's to refuse. */
void quant_quantize_q8_0(const float *src, void *dst, uint64_t n);

/* Half and bfloat16 conversions, exact (round-to-nearest-even on the way
 * down). */
float quant_f16_to_f32(uint16_t h);
uint16_t quant_f32_to_f16(float f);
float quant_bf16_to_f32(uint16_t h);
uint16_t quant_f32_to_bf16(float f);

#endif
