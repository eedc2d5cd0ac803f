/* What the AVX2 kernels of the integer matmul share
 * (kn_qmatmul_avx2.c, kn_qmatmul_q5_avx2.c, kn_qmatmul_kquant_avx2.c):
 * their target attribute, the broadcast of 4 bytes of x, and how far
 * ahead they prefetch the weights. x86 only. */
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

/* Each kernel walks a packed group as two passes of 8 rows. The first
 * brings the group's bytes in from memory, and at batch 1 it waits on
 * them: the hardware prefetchers fall behind (measured on this 2-core
 * EPYC, an 8B-shaped model's decode went 11.4 -> 18.5 tok/s on Q4_K_M
 * and 7.4 -> 13.9 on Q6_K with a prefetch 2 units ahead; 4 units, about
 * 9 KiB for Q4_K, gave 19.0 and 14-16). So the first pass fetches the
 * bytes KN_PREFETCH_AHEAD ahead of the unit it reads, n bytes at a time;
 * past a group's end these are the next group's, which the same thread
 * takes next (qmm_task), and past the buffer's end a prefetch is dropped,
 * never a fault. The second pass finds the group in cache. */
#define KN_PREFETCH_AHEAD 9216
static inline __attribute__((always_inline)) KN_AVX2_TGT void kn_prefetch_ahead(const uint8_t *p, size_t n) {
    const uintptr_t at = (uintptr_t)p + KN_PREFETCH_AHEAD;
    for (size_t o = 0; o < n; o += 64) _mm_prefetch((const char *)(at + o), _MM_HINT_T0);
}

#endif
