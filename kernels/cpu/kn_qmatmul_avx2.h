/* What the AVX2 kernels of the integer matmul share
 * (kn_qmatmul_avx2.c, kn_qmatmul_q5_avx2.c, kn_qmatmul_kquant_avx2.c):
 * their target attribute and the broadcast of 4 bytes of x. x86 only. */
#ifndef AERIE_KN_QMATMUL_AVX2_H
#define AERIE_KN_QMATMUL_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define KN_AVX2_TGT __attribute__((target("avx2,fma,f16c")))

/* Bytes p[0..3] in every 32-bit lane: 4 consecutive elements of x
 * against a lane's 4 elements of one weight row. */
static inline __attribute__((always_inline)) KN_AVX2_TGT __m256i kn_bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

#endif
