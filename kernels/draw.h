/* The keyed random numbers of sampling (target/sample.h), in one place for
 * the host's sampler and the device's (kn_sample): the draw for
 * vocabulary entry id at a position is a pure function of (seed, choice,
 * position, id), so the same bits come out of both. Integer hashing and
 * f32 arithmetic with no libm call and no fused operation (the CPU build
 * has -ffp-contract=off, the CUDA one --fmad=false). Header-only: the CUDA
 * plugin links nothing of libaerie. */
#ifndef AERIE_KERNELS_DRAW_H
#define AERIE_KERNELS_DRAW_H

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define KN_DRAW_FN static __host__ __device__ __forceinline__
#else
#define KN_DRAW_FN static inline
#endif

/* splitmix64's output function on x + its increment: a bijection of
 * 64-bit words that mixes every input bit into every output bit. */
KN_DRAW_FN uint64_t kn_draw_mix64(uint64_t x) {
    uint64_t z = x + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The key of one position. Each step is a bijection, so the positions of
 * one (seed, choice) never share a key. */
KN_DRAW_FN uint64_t kn_draw_key(uint64_t seed, uint32_t choice, int32_t pos) {
    return kn_draw_mix64(kn_draw_mix64(kn_draw_mix64(seed) ^ choice) ^ (uint32_t)pos);
}

/* A 32-bit integer hash with low bias (two xorshift-multiply rounds);
 * a bijection. */
KN_DRAW_FN uint32_t kn_draw_mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/* 32 random bits for vocabulary entry id under a position's key (klo,
 * khi: its low and high words): 32-bit lanes, so that 16 tokens fit one
 * AVX-512 register. */
KN_DRAW_FN uint32_t kn_draw_bits(uint32_t klo, uint32_t khi, uint32_t id) {
    return kn_draw_mix32(kn_draw_mix32(id ^ klo) ^ khi);
}

KN_DRAW_FN uint32_t kn_draw_f32_bits(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b;
}

KN_DRAW_FN float kn_draw_bits_f32(uint32_t b) {
    float x;
    memcpy(&x, &b, sizeof x);
    return x;
}

/* E = -ln U for the uniform U = 1 - V, V = (bits / 2 + 1/2) / 2^31 in
 * (0, 1]. Small E (U near 1) is what decides races among many tokens, so
 * there ln(1 - V) is taken from V itself, never from the rounded 1 - V; U
 * is kept >= 2^-25 (E <= 17.3: the exponential's tail beyond has mass
 * 3e-8). ln(1 + f) = 2 atanh(s) with s = f / (2 + f), |s| <= 0.172, to
 * s^9: relative error about 1e-8 before rounding.
 *
 * The selections are integer masks, not branches: a branch would keep
 * the compiler from vectorising the host's loop (it may not run a
 * division that the source runs conditionally). Every value here is
 * positive, so f32 order is integer order on the bits. */
KN_DRAW_FN float kn_draw_exp(uint32_t bits) {
    const float ln2 = 0.693147182f, one_minus_sqrt_half = 0.292893219f;
    float v = ((float)(int32_t)(bits >> 1) + 0.5f) * 0x1p-31f;
    uint32_t ub = kn_draw_f32_bits(1.0f - v);
    ub = ub < 0x33000000u ? 0x33000000u : ub; /* U >= 2^-25 */
    int32_t e = (int32_t)(ub >> 23) - 127;
    uint32_t mb = (ub & 0x007fffffu) | 0x3f800000u;    /* U = m 2^e, m in [1, 2) */
    uint32_t high = 0u - (uint32_t)(mb > 0x3fb504f3u); /* m > sqrt 2: halve it */
    mb -= high & 0x00800000u;
    e += (int32_t)(high & 1u);
    /* U in (sqrt 1/2, 1]: e = 0 and f = U - 1 = -V exactly */
    uint32_t near = 0u - (uint32_t)(kn_draw_f32_bits(v) < kn_draw_f32_bits(one_minus_sqrt_half));
    float f = kn_draw_bits_f32((kn_draw_f32_bits(-v) & near) | (kn_draw_f32_bits(kn_draw_bits_f32(mb) - 1.0f) & ~near));
    e &= (int32_t)~near;
    float sv = f / (2.0f + f), z = sv * sv;
    float t = z * (1.0f / 3 + z * (1.0f / 5 + z * (1.0f / 7 + z * (1.0f / 9))));
    float ln = (float)e * ln2 + 2.0f * sv * (1.0f + t);
    return -ln;
}

#endif
