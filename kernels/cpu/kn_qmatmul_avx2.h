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

/* The integer dot of 8 rows' 32 quants (q[v]: elements 4v..4v+3 of each
 * row, unsigned) with x's planes hi and, at 15 bits, lo: runs of `run`
 * vectors add their vpmaddubsw pair sums in 16 bits (the caller picks run
 * so they fit), then vpmaddwd widens each run against the 16-bit scale of
 * its 16-element half, sc16[0] for vectors 0..3 and sc16[1] for 4..7.
 * Adds to *ih and, at 15 bits, *il. */
static inline __attribute__((always_inline)) KN_AVX2_TGT void kn_dot_runs(const __m256i q[8], const int8_t *hi,
                                                                          const int8_t *lo, int bits, int run,
                                                                          const __m256i sc16[2], __m256i *ih,
                                                                          __m256i *il) {
#pragma GCC unroll 8
    for (int v0 = 0; v0 < 8; v0 += run) {
        __m256i sh = _mm256_setzero_si256(), sl = sh;
#pragma GCC unroll 4
        for (int v = v0; v < v0 + run; v++) {
            sh = _mm256_add_epi16(sh, _mm256_maddubs_epi16(q[v], kn_bcast4(hi + 4 * v)));
            if (bits != 8) sl = _mm256_add_epi16(sl, _mm256_maddubs_epi16(q[v], kn_bcast4(lo + 4 * v)));
        }
        *ih = _mm256_add_epi32(*ih, _mm256_madd_epi16(sh, sc16[v0 / 4]));
        if (bits != 8) *il = _mm256_add_epi32(*il, _mm256_madd_epi16(sl, sc16[v0 / 4]));
    }
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
