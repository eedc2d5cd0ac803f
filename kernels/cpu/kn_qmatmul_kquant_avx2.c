/* AVX2 kernels of the integer matmul (kn_qmatmul.c) for the K-quants that
 * carry most published files: Q4_K, Q5_K (the K_M and K_S mixes) and Q6_K
 * (their output and down projections), Q2_K and Q3_K (large MoE models;
 * klow below), and for IQ4_XS. They run on CPUs
 * with AVX-512 VNNI too, which have AVX2; the bits are the portable
 * kernel's.
 *
 * The packed unit is 16 rows of one 256-element super-block (pack_kquant
 * in kn_qmatmul.c): for each 32-element sub-block the Q4 nibble-pair
 * vectors (a 32-bit lane holds 4 consecutive elements of one row), then
 * Q5_K's fifth bits or Q6_K's top two, then the scale bytes as planes
 * (byte k of the 16 rows together), then the f16 factors. A 32-byte half
 * of each vector is 8 rows, so lanes are rows and no sum crosses lanes.
 *
 * Per sub-block and token: vpmaddubsw multiplies the unsigned quants by
 * the signed bytes of x into 16-bit pair sums, and vpmaddwd against the
 * rows' sub-block scales (each 16-bit half of a lane holding the scale)
 * both widens and folds the scale in, exactly. 16-bit limits: a pair sum
 * is at most 2 * q_max * 127, so Q4_K adds all 8 (8 * 3810 = 30480),
 * Q5_K 4 at a time (4 * 7874 = 31496) and Q6_K 2 at a time (2 * 16002 =
 * 32004) before widening. At 15 bits xi = 128 hi + lo; the shifted hi sum
 * of Q6_K can pass 2^31 before the lo sum and offset bring it back, which
 * is exact in wrapping 32-bit arithmetic because the result is within
 * the bound kernels.h states.
 *
 * IQ4_XS (pack_iq4_xs in kn_qmatmul.c) has the IQ4_NL table's signed
 * values (-127..113) and a signed 6-bit scale per sub-block: |v| times x
 * with v's sign in vpmaddubsw (pairs up to 2 * 127 * 127 = 32258), each
 * vector widened at once by vpmaddwd against the scale. */
#include "kn_cpu_impl.h"

#if defined(__x86_64__) || defined(__i386__)

#include "kn_qmatmul_avx2.h"

#define TGT KN_AVX2_TGT
#define INL static inline __attribute__((always_inline)) TGT

/* 8 bytes (rows 8h..8h+7 of a plane) widened to 32-bit lanes. */
INL __m256i plane_u8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)p));
}
INL __m256i plane_i8(const uint8_t *p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)p));
}

/* A 32-bit lane's scale in both 16-bit halves, for vpmaddwd. */
INL __m256i pair16(__m256i s) {
    return _mm256_or_si256(_mm256_and_si256(s, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(s, 16));
}

/* Byte offsets of a packed unit's parts (kn_qmatmul.c's pack_kquant). */
#define NIB_BYTES 2048 /* 8 sub-blocks x 256 */
#define Q5_HI 64       /* fifth bits, per sub-block */
#define Q6_HI 128      /* top two bits, per sub-block */

/* Rows 16g + 8h .. 16g + 8h + 7 against TM tokens. */
INL void khalf(ggml_type t, int TM, int BITS, const kn_weight *w, int64_t g, int h, const kn_qx *qx, float *y,
               size_t ldy) {
    int64_t nu = w->cols / 256;
    size_t pb = kn_pack_block_bytes(t);
    const bool xs = t == GGML_TYPE_IQ4_XS;
    const size_t sc_at = t == GGML_TYPE_Q4_K || xs ? NIB_BYTES
                         : t == GGML_TYPE_Q5_K     ? NIB_BYTES + 8 * Q5_HI
                                                   : NIB_BYTES + 8 * Q6_HI;
    const size_t d_at = sc_at + (t == GGML_TYPE_Q6_K ? 256 : xs ? 96 : 192);
    const __m256i tab =
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)quant_kvalues_iq4nl));
    const uint8_t *p = (const uint8_t *)w->packed + (size_t)g * w->pack_stride;
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256 acc[KN_TILE_M];
#pragma GCC unroll 8
    for (int r = 0; r < TM; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t u = 0; u < nu; u++, p += pb) {
        const uint8_t *sp = p + sc_at + 8 * h;
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p + d_at + 16 * h)));
        __m256 dmin = t == GGML_TYPE_Q6_K || xs
                          ? _mm256_setzero_ps()
                          : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p + d_at + 32 + 16 * h)));
        for (int j = 0; j < 8; j++) {
            const int64_t b = 8 * u + j; /* the activation block */
            /* The first half's pass streams the unit from memory:
             * an eighth of it a sub-block (kn_qmatmul_avx2.h). */
            if (h == 0) kn_prefetch_ahead(p + pb * (size_t)j / 8, (pb * (size_t)(j + 1) / 8 - pb * (size_t)j / 8));
            __m256i q[8];
            const uint8_t *nb = p + 256 * j + 32 * h;
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) {
                __m256i bv = _mm256_loadu_si256((const __m256i *)(const void *)(nb + 64 * v));
                q[v] = _mm256_and_si256(bv, low);
                q[v + 4] = _mm256_and_si256(_mm256_srli_epi16(bv, 4), low);
            }
            __m256i s_a, s_b, mn = _mm256_setzero_si256(), a[8];
            if (xs) {
#pragma GCC unroll 8
                for (int v = 0; v < 8; v++) {
                    q[v] = _mm256_shuffle_epi8(tab, q[v]); /* signed values */
                    a[v] = _mm256_abs_epi8(q[v]);
                }
                /* Sub-block j's scale: nibble j % 2 of scales_l[j / 2]
                 * (plane 2 + j / 2), bits 2 (j % 4) of scales_h's byte
                 * j / 4 above it; less 32. */
                __m256i lo4 = _mm256_and_si256(_mm256_srli_epi32(plane_u8(sp + 16 * (2 + j / 2)), 4 * (j % 2)),
                                               _mm256_set1_epi32(15));
                __m256i hi2 =
                    _mm256_and_si256(_mm256_srli_epi32(plane_u8(sp + 16 * (j / 4)), 2 * (j % 4)), _mm256_set1_epi32(3));
                s_a = _mm256_sub_epi32(_mm256_or_si256(lo4, _mm256_slli_epi32(hi2, 4)), _mm256_set1_epi32(32));
                s_b = s_a;
            } else if (t == GGML_TYPE_Q6_K) {
                const uint8_t *hp = p + NIB_BYTES + Q6_HI * j + 32 * h;
                __m256i hv[2] = {_mm256_loadu_si256((const __m256i *)(const void *)hp),
                                 _mm256_loadu_si256((const __m256i *)(const void *)(hp + 64))};
#pragma GCC unroll 8
                for (int v = 0; v < 8; v++) {
                    __m256i top = _mm256_and_si256(_mm256_srli_epi16(hv[v % 2], 2 * (v / 2)), _mm256_set1_epi8(3));
                    q[v] = _mm256_or_si256(q[v], _mm256_slli_epi16(top, 4));
                }
                s_a = plane_i8(sp + 16 * (2 * j));
                s_b = plane_i8(sp + 16 * (2 * j + 1));
            } else {
                if (t == GGML_TYPE_Q5_K) {
                    __m256i hb =
                        _mm256_loadu_si256((const __m256i *)(const void *)(p + NIB_BYTES + Q5_HI * j + 32 * h));
#pragma GCC unroll 8
                    for (int v = 0; v < 8; v++) {
                        __m256i bit = _mm256_set1_epi8((char)(1 << v));
                        __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hb, bit), bit);
                        q[v] = _mm256_or_si256(q[v], _mm256_and_si256(set, _mm256_set1_epi8(16)));
                    }
                }
                /* (scale, min) pair j of the 12 scale bytes, 8 rows at once. */
                if (j < 4) {
                    s_a = _mm256_and_si256(plane_u8(sp + 16 * j), _mm256_set1_epi32(63));
                    mn = _mm256_and_si256(plane_u8(sp + 16 * (j + 4)), _mm256_set1_epi32(63));
                } else {
                    __m256i lo = plane_u8(sp + 16 * (j + 4));
                    __m256i top_s = _mm256_srli_epi32(plane_u8(sp + 16 * (j - 4)), 6);
                    __m256i top_m = _mm256_srli_epi32(plane_u8(sp + 16 * j), 6);
                    s_a = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(15)), _mm256_slli_epi32(top_s, 4));
                    mn = _mm256_or_si256(_mm256_srli_epi32(lo, 4), _mm256_slli_epi32(top_m, 4));
                }
                s_b = s_a;
            }
            const __m256i sa16 = pair16(s_a), sb16 = pair16(s_b);
#pragma GCC unroll 8
            for (int r = 0; r < TM; r++) {
                /* At 8 bits hi is xi and there is no lo plane. */
                const int8_t *hi = qx[r].planes + b * kn_qx_block_bytes(BITS), *lo = hi + KN_QK;
                __m256i ih, il = _mm256_setzero_si256();
                if (xs) {
                    ih = _mm256_setzero_si256();
#pragma GCC unroll 8
                    for (int v = 0; v < 8; v++) {
                        ih = _mm256_add_epi32(
                            ih, _mm256_madd_epi16(
                                    _mm256_maddubs_epi16(a[v], _mm256_sign_epi8(kn_bcast4(hi + 4 * v), q[v])), sa16));
                        if (BITS != 8)
                            il = _mm256_add_epi32(
                                il,
                                _mm256_madd_epi16(
                                    _mm256_maddubs_epi16(a[v], _mm256_sign_epi8(kn_bcast4(lo + 4 * v), q[v])), sa16));
                    }
                } else if (t == GGML_TYPE_Q4_K) {
                    __m256i sh = _mm256_setzero_si256(), sl = sh;
#pragma GCC unroll 8
                    for (int v = 0; v < 8; v++) {
                        sh = _mm256_add_epi16(sh, _mm256_maddubs_epi16(q[v], kn_bcast4(hi + 4 * v)));
                        if (BITS != 8) sl = _mm256_add_epi16(sl, _mm256_maddubs_epi16(q[v], kn_bcast4(lo + 4 * v)));
                    }
                    ih = _mm256_madd_epi16(sh, sa16);
                    if (BITS != 8) il = _mm256_madd_epi16(sl, sa16);
                } else {
                    /* Q5_K adds 4 vectors in 16 bits, Q6_K 2 (the header). */
                    const __m256i sc16[2] = {sa16, sb16};
                    ih = _mm256_setzero_si256();
                    kn_dot_runs(q, hi, lo, BITS, t == GGML_TYPE_Q5_K ? 4 : 2, sc16, &ih, &il);
                }
                __m256i isum = BITS == 8 ? ih : _mm256_add_epi32(_mm256_slli_epi32(ih, 7), il);
                if (t == GGML_TYPE_Q6_K) {
                    /* The quants were stored plus 32: take 32 sc sum xi off
                     * each half. */
                    __m256i off =
                        _mm256_add_epi32(_mm256_mullo_epi32(s_a, _mm256_set1_epi32(32 * qx[r].isx16[2 * b])),
                                         _mm256_mullo_epi32(s_b, _mm256_set1_epi32(32 * qx[r].isx16[2 * b + 1])));
                    isum = _mm256_sub_epi32(isum, off);
                }
                const __m256 sx = _mm256_set1_ps(qx[r].sx[b]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, sx), acc[r]);
                if (t != GGML_TYPE_Q6_K && !xs) {
                    __m256i imin = _mm256_mullo_epi32(mn, _mm256_set1_epi32(qx[r].isx[b]));
                    acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(dmin, sx), acc[r]);
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < TM; r++)
        _mm256_storeu_ps(y + (size_t)r * ldy + (size_t)g * KN_PACK_ROWS + 8 * (size_t)h, acc[r]);
}

/* Q2_K and Q3_K (pack_low_k in kn_qmatmul.c): rows 16g + 8h .. 16g + 8h +
 * 7 against TM tokens. Q3_K's quants are taken as stored, q + 4 in 0..7,
 * and 4 sc S_h comes off each half, as Q6_K's 32 does. Pair sums are at
 * most 2 * 7 * 127 = 1778, so a half's 4 vectors add up in 16 bits
 * before vpmaddwd folds in its scale. */
INL void klow(ggml_type t, int TM, int BITS, const kn_weight *w, int64_t g, int h, const kn_qx *qx, float *y,
              size_t ldy) {
    const int64_t nu = w->cols / 256;
    const size_t pb = kn_pack_block_bytes(t);
    const bool q3 = t == GGML_TYPE_Q3_K;
    const size_t sc_at = q3 ? 1536 : 1024, d_at = sc_at + (q3 ? 192 : 256);
    const uint8_t *p = (const uint8_t *)w->packed + (size_t)g * w->pack_stride;
    const __m256i three = _mm256_set1_epi8(3);
    __m256 acc[KN_TILE_M];
#pragma GCC unroll 8
    for (int r = 0; r < TM; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t u = 0; u < nu; u++, p += pb) {
        const uint8_t *sp = p + sc_at + 8 * h;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p + d_at + 16 * h)));
        const __m256 dmin =
            q3 ? _mm256_setzero_ps()
               : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p + d_at + 32 + 16 * h)));
        for (int j = 0; j < 8; j++) {
            const int64_t b = 8 * u + j; /* the activation block */
            if (h == 0) kn_prefetch_ahead(p + pb * (size_t)j / 8, (pb * (size_t)(j + 1) / 8 - pb * (size_t)j / 8));
            const uint8_t *cp = p + 128 * j + 32 * h;
            const __m256i cv[2] = {_mm256_loadu_si256((const __m256i *)(const void *)cp),
                                   _mm256_loadu_si256((const __m256i *)(const void *)(cp + 64))};
            __m256i q[8];
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++) q[v] = _mm256_and_si256(_mm256_srli_epi16(cv[v % 2], 2 * (v / 2)), three);
            __m256i s_a, s_b, mn_a = _mm256_setzero_si256(), mn_b = mn_a;
            if (q3) {
                const __m256i hb =
                    _mm256_loadu_si256((const __m256i *)(const void *)(p + 1024 + 64 * (size_t)j + 32 * (size_t)h));
#pragma GCC unroll 8
                for (int v = 0; v < 8; v++) {
                    const __m256i bit = _mm256_set1_epi8((char)(1 << v));
                    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hb, bit), bit);
                    q[v] = _mm256_or_si256(q[v], _mm256_and_si256(set, _mm256_set1_epi8(4)));
                }
                /* Scale k = 2j + i: the low four bits are nibble k / 8 of
                 * byte k % 8, the top two bits 2 (k / 4) of byte 8 + k % 4;
                 * less 32. */
                __m256i sc[2];
                for (int i = 0; i < 2; i++) {
                    const int k = 2 * j + i;
                    const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(plane_u8(sp + 16 * (k % 8)), 4 * (k / 8)),
                                                        _mm256_set1_epi32(15));
                    const __m256i hi2 = _mm256_and_si256(
                        _mm256_srli_epi32(plane_u8(sp + 16 * (8 + k % 4)), 2 * (k / 4)), _mm256_set1_epi32(3));
                    sc[i] = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi2, 4)), _mm256_set1_epi32(32));
                }
                s_a = sc[0], s_b = sc[1];
            } else {
                /* Byte k = 2j + i: the scale in its low nibble, the min in its high. */
                const __m256i ba = plane_u8(sp + 16 * (2 * j)), bb = plane_u8(sp + 16 * (2 * j + 1));
                s_a = _mm256_and_si256(ba, _mm256_set1_epi32(15));
                s_b = _mm256_and_si256(bb, _mm256_set1_epi32(15));
                mn_a = _mm256_srli_epi32(ba, 4);
                mn_b = _mm256_srli_epi32(bb, 4);
            }
            const __m256i sc16[2] = {pair16(s_a), pair16(s_b)};
#pragma GCC unroll 8
            for (int r = 0; r < TM; r++) {
                const int8_t *hi = qx[r].planes + b * kn_qx_block_bytes(BITS), *lo = hi + KN_QK;
                __m256i ih = _mm256_setzero_si256(), il = ih;
                kn_dot_runs(q, hi, lo, BITS, 4, sc16, &ih, &il);
                __m256i isum = BITS == 8 ? ih : _mm256_add_epi32(_mm256_slli_epi32(ih, 7), il);
                const __m256i s0 = _mm256_set1_epi32(qx[r].isx16[2 * b]),
                              s1 = _mm256_set1_epi32(qx[r].isx16[2 * b + 1]);
                if (q3)
                    isum = _mm256_sub_epi32(
                        isum, _mm256_slli_epi32(
                                  _mm256_add_epi32(_mm256_mullo_epi32(s_a, s0), _mm256_mullo_epi32(s_b, s1)), 2));
                const __m256 sx = _mm256_set1_ps(qx[r].sx[b]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, sx), acc[r]);
                if (!q3) {
                    const __m256i imin = _mm256_add_epi32(_mm256_mullo_epi32(mn_a, s0), _mm256_mullo_epi32(mn_b, s1));
                    acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(dmin, sx), acc[r]);
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < TM; r++)
        _mm256_storeu_ps(y + (size_t)r * ldy + (size_t)g * KN_PACK_ROWS + 8 * (size_t)h, acc[r]);
}

INL void qgroup(ggml_type t, int TM, int BITS, const kn_weight *w, int64_t g, const kn_qx *qx, float *y, size_t ldy) {
    if (t == GGML_TYPE_Q2_K || t == GGML_TYPE_Q3_K) {
        klow(t, TM, BITS, w, g, 0, qx, y, ldy);
        klow(t, TM, BITS, w, g, 1, qx, y, ldy);
        return;
    }
    khalf(t, TM, BITS, w, g, 0, qx, y, ldy);
    khalf(t, TM, BITS, w, g, 1, qx, y, ldy);
}

_Static_assert(KN_TILE_M == 8, "one instance per tile height");
KN_QG_TYPE(kq_q2_k, TGT, GGML_TYPE_Q2_K)
KN_QG_TYPE(kq_q3_k, TGT, GGML_TYPE_Q3_K)
KN_QG_TYPE(kq_q4_k, TGT, GGML_TYPE_Q4_K)
KN_QG_TYPE(kq_q5_k, TGT, GGML_TYPE_Q5_K)
KN_QG_TYPE(kq_q6_k, TGT, GGML_TYPE_Q6_K)
KN_QG_TYPE(kq_iq4_xs, TGT, GGML_TYPE_IQ4_XS)

void kn_kgroup_avx2(const kn_weight *w, int64_t g, const kn_qx *qx, int tm, int bits, float *y, size_t ldy) {
    AE_ASSERT(tm >= 1 && tm <= KN_TILE_M && (bits == 8 || bits == 15));
    const kn_qg_fn *set;
    switch (w->type) {
    case GGML_TYPE_Q2_K: set = KN_QG_PICK(kq_q2_k, bits); break;
    case GGML_TYPE_Q3_K: set = KN_QG_PICK(kq_q3_k, bits); break;
    case GGML_TYPE_Q4_K: set = KN_QG_PICK(kq_q4_k, bits); break;
    case GGML_TYPE_Q5_K: set = KN_QG_PICK(kq_q5_k, bits); break;
    case GGML_TYPE_Q6_K: set = KN_QG_PICK(kq_q6_k, bits); break;
    case GGML_TYPE_IQ4_XS: set = KN_QG_PICK(kq_iq4_xs, bits); break;
    default: AE_ASSERT(!"kn_kgroup_avx2: not one of its types"); return;
    }
    set[tm - 1](w, g, qx, y, ldy);
}

#else /* not x86: kn_cpu_use_avx2 is always false */

void kn_kgroup_avx2(const kn_weight *w, int64_t g, const kn_qx *qx, int tm, int bits, float *y, size_t ldy) {
    (void)w, (void)g, (void)qx, (void)tm, (void)bits, (void)y, (void)ldy;
    AE_ASSERT(!"no AVX2 kernel on this architecture");
}

#endif
