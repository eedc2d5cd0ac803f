/* AVX2 kernel of the integer matmul (kn_qmatmul.c) on packed weights, for
 * CPUs without AVX-512 VNNI. The packed layout is the VNNI kernel's (lane
 * r of a 64-byte vector holds 4 consecutive elements of row r); a 32-byte
 * half is 8 rows, done as two passes. vpmaddubsw multiplies the unsigned
 * weight bytes by the signed activation bytes into 16-bit pair sums and
 * vpmaddwd adds pairs into 32-bit lanes, so a lane again sums 4 products
 * of its own row. The integer sums are exact and the float steps are the
 * portable kernel's, so the bits are the same.
 *
 * 16-bit limits: a Q4 pair sum is at most 2 * 15 * 127 = 3810 and eight of
 * them 30480 < 32767, so a block's eight groups add up in 16 bits before
 * one vpmaddwd. Q8_0 bytes would overflow a pair (255 * 127 * 2), so they
 * go back to signed (the packed byte is q + 128), multiply as |q| times
 * x with q's sign (at most 2 * 128 * 127 = 32512), and widen each group.
 * At 8 bits xi is one signed byte in [-127, 127], the same range as hi,
 * so it takes hi's steps alone. */
#include "kn_cpu_impl.h"

#if defined(__x86_64__) || defined(__i386__)

#include "kn_qmatmul_avx2.h"

#define TGT KN_AVX2_TGT
#define INL static inline __attribute__((always_inline)) TGT

/* Rows 16g + 8h .. 16g + 8h + 7 of a packed group against TM tokens. */
INL void qhalf(ggml_type t, int TM, int BITS, const kn_weight *w, int64_t g, int h, const kn_qx *qx, float *y,
               size_t ldy) {
    int64_t nb = w->cols / KN_QK;
    size_t pb = kn_pack_block_bytes(t);
    size_t doff = t == GGML_TYPE_Q8_0 ? 512 : 256;
    const uint8_t *p = (const uint8_t *)w->packed + (size_t)g * w->pack_stride;
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[KN_TILE_M];
#pragma GCC unroll 8
    for (int r = 0; r < TM; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, p += pb) {
        if (h == 0) kn_prefetch_ahead(p, pb); /* kn_qmatmul_avx2.h */
        __m256i q[8];
        if (t == GGML_TYPE_Q8_0) {
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++)
                q[v] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(const void *)(p + 64 * v + 32 * h)), flip);
        } else {
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) {
                __m256i bv = _mm256_loadu_si256((const __m256i *)(const void *)(p + 64 * v + 32 * h));
                q[v] = _mm256_and_si256(bv, low);
                q[v + 4] = _mm256_and_si256(_mm256_srli_epi16(bv, 4), low);
            }
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p + doff + 16 * h)));
        __m256 mm = t == GGML_TYPE_Q4_1
                        ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p + 288 + 16 * h)))
                        : _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < TM; r++) {
            /* At 8 bits hi is xi and there is no lo plane. */
            const int8_t *hi = qx[r].planes + b * kn_qx_block_bytes(BITS), *lo = hi + KN_QK;
            __m256i ih, il = _mm256_setzero_si256();
            if (t == GGML_TYPE_Q8_0) {
                ih = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int v = 0; v < 8; v++) {
                    __m256i a = _mm256_abs_epi8(q[v]);
                    ih = _mm256_add_epi32(
                        ih, _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(kn_bcast4(hi + 4 * v), q[v])),
                                              ones));
                    if (BITS != 8)
                        il = _mm256_add_epi32(
                            il, _mm256_madd_epi16(
                                    _mm256_maddubs_epi16(a, _mm256_sign_epi8(kn_bcast4(lo + 4 * v), q[v])), ones));
                }
            } else {
                __m256i sh = _mm256_setzero_si256(), sl = sh;
#pragma GCC unroll 8
                for (int v = 0; v < 8; v++) {
                    sh = _mm256_add_epi16(sh, _mm256_maddubs_epi16(q[v], kn_bcast4(hi + 4 * v)));
                    if (BITS != 8) sl = _mm256_add_epi16(sl, _mm256_maddubs_epi16(q[v], kn_bcast4(lo + 4 * v)));
                }
                ih = _mm256_madd_epi16(sh, ones);
                if (BITS != 8) il = _mm256_madd_epi16(sl, ones);
            }
            __m256i isum = BITS == 8 ? ih : _mm256_add_epi32(_mm256_slli_epi32(ih, 7), il);
            if (t == GGML_TYPE_Q4_0) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(8 * qx[r].isx[b]));
            __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(qx[r].sx[b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[r]);
            if (t == GGML_TYPE_Q4_1) acc[r] = _mm256_fmadd_ps(mm, _mm256_set1_ps(qx[r].xs[b]), acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < TM; r++)
        _mm256_storeu_ps(y + (size_t)r * ldy + (size_t)g * KN_PACK_ROWS + 8 * (size_t)h, acc[r]);
}

INL void qgroup(ggml_type t, int TM, int BITS, const kn_weight *w, int64_t g, const kn_qx *qx, float *y, size_t ldy) {
    qhalf(t, TM, BITS, w, g, 0, qx, y, ldy);
    qhalf(t, TM, BITS, w, g, 1, qx, y, ldy);
}

KN_QG_KERNELS(kn_qgroup_avx2, TGT)

#else /* not x86: kn_cpu_use_avx2 is always false */

void kn_qgroup_avx2(const kn_weight *w, int64_t g, const kn_qx *qx, int tm, int bits, float *y, size_t ldy) {
    (void)w, (void)g, (void)qx, (void)tm, (void)bits, (void)y, (void)ldy;
    AE_ASSERT(!"no AVX2 kernel on this architecture");
}

#endif
