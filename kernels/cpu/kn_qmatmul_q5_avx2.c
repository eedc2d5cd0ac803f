/* AVX2 kernel of the integer matmul (kn_qmatmul.c) for the 32-element
 * types that llama.cpp's quantizer falls back to when a row's width is
 * not whole super-blocks (Q5_0, Q5_1, IQ4_NL) and for MXFP4. CPUs with
 * AVX-512 VNNI run it too; the bits are the portable kernel's.
 *
 * The packed (group, block) is pack_q32's in kn_qmatmul.c: the Q4 nibble
 * pairs (a 32-bit lane holds 4 consecutive elements of one row), Q5's
 * fifth bits, then the rows' d (MXFP4: E8M0 bytes) and Q5_1's m. A
 * 32-byte half of a vector is 8 rows, so lanes are rows.
 *
 * 16-bit limits of vpmaddubsw's pair sums (2 * |q| * 127): Q5's quants
 * (0..31) reach 7874, so 4 add up before vpmaddwd widens them (31496).
 * IQ4_NL's values (-127..113) and MXFP4's doubled ones (-12..12) are
 * signed: they multiply as |v| times x with v's sign, IQ4_NL's pairs up
 * to 32258 widening one vector at a time, MXFP4's (3048) all 8 at once. */
#include "kn_cpu_impl.h"

#if defined(__x86_64__) || defined(__i386__)

#include "kn_qmatmul_avx2.h"

#define TGT KN_AVX2_TGT
#define INL static inline __attribute__((always_inline)) TGT

/* A 16-entry table of int8 values, in both 128-bit lanes for vpshufb. */
INL __m256i table16(const int8_t *t) {
    __m128i v = _mm_loadu_si128((const __m128i *)(const void *)t);
    return _mm256_broadcastsi128_si256(v);
}

/* MXFP4's E8M0 bytes of 8 rows as f32 2^(e - 128) (quant_e8m0_to_f32_half). */
INL __m256 e8m0_half(const uint8_t *p) {
    __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)p));
    __m256i big = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    __m256i is_small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(big, small, is_small));
}

/* Rows 16g + 8h .. 16g + 8h + 7 against TM tokens. */
INL void qhalf(ggml_type t, int TM, int BITS, const kn_weight *w, int64_t g, int h, const kn_qx *qx, float *y,
               size_t ldy) {
    int64_t nb = w->cols / KN_QK;
    size_t pb = kn_pack_block_bytes(t);
    const bool q5 = t == GGML_TYPE_Q5_0 || t == GGML_TYPE_Q5_1;
    const size_t d_at = q5 ? 320 : 256;
    const uint8_t *p = (const uint8_t *)w->packed + (size_t)g * w->pack_stride;
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const __m256i tab = table16(t == GGML_TYPE_MXFP4 ? quant_kvalues_mxfp4 : quant_kvalues_iq4nl);
    __m256 acc[KN_TILE_M];
#pragma GCC unroll 8
    for (int r = 0; r < TM; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, p += pb) {
        if (h == 0) kn_prefetch_ahead(p, pb); /* kn_qmatmul_avx2.h */
        __m256i q[8];
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {
            __m256i bv = _mm256_loadu_si256((const __m256i *)(const void *)(p + 64 * v + 32 * h));
            q[v] = _mm256_and_si256(bv, low);
            q[v + 4] = _mm256_and_si256(_mm256_srli_epi16(bv, 4), low);
        }
        if (q5) {
            __m256i hb = _mm256_loadu_si256((const __m256i *)(const void *)(p + 256 + 32 * h));
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++) {
                __m256i bit = _mm256_set1_epi8((char)(1 << v));
                __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hb, bit), bit);
                q[v] = _mm256_or_si256(q[v], _mm256_and_si256(set, _mm256_set1_epi8(16)));
            }
        } else {
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++) q[v] = _mm256_shuffle_epi8(tab, q[v]); /* signed values */
        }
        __m256i a[8];
        if (!q5) {
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++) a[v] = _mm256_abs_epi8(q[v]);
        }
        __m256 d = t == GGML_TYPE_MXFP4
                       ? e8m0_half(p + d_at + 8 * h)
                       : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p + d_at + 16 * h)));
        __m256 mm = t == GGML_TYPE_Q5_1
                        ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p + d_at + 32 + 16 * h)))
                        : _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < TM; r++) {
            /* At 8 bits hi is xi and there is no lo plane. */
            const int8_t *hi = qx[r].planes + b * kn_qx_block_bytes(BITS), *lo = hi + KN_QK;
            __m256i ih = _mm256_setzero_si256(), il = ih;
            if (q5) {
                const __m256i both[2] = {ones, ones};
                kn_dot_runs(q, hi, lo, BITS, 4, both, &ih, &il);
            } else if (t == GGML_TYPE_MXFP4) {
                __m256i sh = _mm256_setzero_si256(), sl = sh;
#pragma GCC unroll 8
                for (int v = 0; v < 8; v++) {
                    sh =
                        _mm256_add_epi16(sh, _mm256_maddubs_epi16(a[v], _mm256_sign_epi8(kn_bcast4(hi + 4 * v), q[v])));
                    if (BITS != 8)
                        sl = _mm256_add_epi16(
                            sl, _mm256_maddubs_epi16(a[v], _mm256_sign_epi8(kn_bcast4(lo + 4 * v), q[v])));
                }
                ih = _mm256_madd_epi16(sh, ones);
                if (BITS != 8) il = _mm256_madd_epi16(sl, ones);
            } else {
#pragma GCC unroll 8
                for (int v = 0; v < 8; v++) {
                    ih = _mm256_add_epi32(
                        ih, _mm256_madd_epi16(_mm256_maddubs_epi16(a[v], _mm256_sign_epi8(kn_bcast4(hi + 4 * v), q[v])),
                                              ones));
                    if (BITS != 8)
                        il = _mm256_add_epi32(
                            il, _mm256_madd_epi16(
                                    _mm256_maddubs_epi16(a[v], _mm256_sign_epi8(kn_bcast4(lo + 4 * v), q[v])), ones));
                }
            }
            __m256i isum = BITS == 8 ? ih : _mm256_add_epi32(_mm256_slli_epi32(ih, 7), il);
            if (t == GGML_TYPE_Q5_0) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(16 * qx[r].isx[b]));
            __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(qx[r].sx[b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[r]);
            if (t == GGML_TYPE_Q5_1) acc[r] = _mm256_fmadd_ps(mm, _mm256_set1_ps(qx[r].xs[b]), acc[r]);
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

_Static_assert(KN_TILE_M == 8, "one instance per tile height");
KN_QG_TYPE(q5_q5_0, TGT, GGML_TYPE_Q5_0)
KN_QG_TYPE(q5_q5_1, TGT, GGML_TYPE_Q5_1)
KN_QG_TYPE(q5_iq4_nl, TGT, GGML_TYPE_IQ4_NL)
KN_QG_TYPE(q5_mxfp4, TGT, GGML_TYPE_MXFP4)

void kn_q5group_avx2(const kn_weight *w, int64_t g, const kn_qx *qx, int tm, int bits, float *y, size_t ldy) {
    AE_ASSERT(tm >= 1 && tm <= KN_TILE_M && (bits == 8 || bits == 15));
    const kn_qg_fn *set;
    switch (w->type) {
    case GGML_TYPE_Q5_0: set = KN_QG_PICK(q5_q5_0, bits); break;
    case GGML_TYPE_Q5_1: set = KN_QG_PICK(q5_q5_1, bits); break;
    case GGML_TYPE_IQ4_NL: set = KN_QG_PICK(q5_iq4_nl, bits); break;
    case GGML_TYPE_MXFP4: set = KN_QG_PICK(q5_mxfp4, bits); break;
    default: AE_ASSERT(!"kn_q5group_avx2: not one of its types"); return;
    }
    set[tm - 1](w, g, qx, y, ldy);
}

#else /* not x86: kn_cpu_use_avx2 is always false */

void kn_q5group_avx2(const kn_weight *w, int64_t g, const kn_qx *qx, int tm, int bits, float *y, size_t ldy) {
    (void)w, (void)g, (void)qx, (void)tm, (void)bits, (void)y, (void)ldy;
    AE_ASSERT(!"no AVX2 kernel on this architecture");
}

#endif
