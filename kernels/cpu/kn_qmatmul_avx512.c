/* AVX-512 VNNI kernel of the integer matmul (kn_qmatmul.c) on packed
 * weights. Lane r of every vector is weight row 16g + r: vpdpbusd
 * multiplies 4 unsigned weight bytes of that row by 4 signed bytes of x
 * broadcast to all lanes, so no horizontal sums are needed. Per block and
 * token the exact integer sum is
 *   isum = 128 * sum(w * hi) + sum(w * lo)  at 15 bits,
 *   isum = sum(w * xi)                      at 8 bits,
 * minus 8 * sum xi for Q4_0 and 128 * sum xi for Q8_0 (whose bytes are
 * stored + 128),
 * then acc = fma((float)isum, d * sx, acc) and, for Q4_1,
 * acc = fma(m, xs, acc): the portable kernel's steps, so the bits match.
 *
 * Each function carries its own target attribute; kn_cpu_use_avx512vnni
 * checks the CPU before any of it runs. */
#include "kn_cpu_impl.h"

#if defined(__x86_64__)

#include <float.h>
#include <immintrin.h>
#include <string.h>

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

#ifndef KN_PF_DIST
#define KN_PF_DIST 2048
#endif

INL __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* The 8 weight vectors of one packed block: q[v] pairs with x bytes
 * 4v..4v+3. */
INL void load_q(ggml_type t, const uint8_t *p, __m512i q[8]) {
    if (t == GGML_TYPE_Q8_0) {
#pragma GCC unroll 8
        for (int v = 0; v < 8; v++) q[v] = _mm512_loadu_si512((const void *)(p + 64 * v));
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0f);
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++) {
        __m512i b = _mm512_loadu_si512((const void *)(p + 64 * v));
        q[v] = _mm512_and_si512(b, low);
        q[v + 4] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
    }
}

/* One packed group against TM tokens at BITS; TM and BITS are constants
 * in each instance so the accumulators stay in registers. */
INL void qgroup(ggml_type t, int TM, int BITS, const kn_weight *w, int64_t g, const kn_qx *qx, float *y, size_t ldy) {
    int64_t nb = w->cols / KN_QK;
    size_t pb = kn_pack_block_bytes(t);
    size_t doff = t == GGML_TYPE_Q8_0 ? 512 : 256;
    const uint8_t *p = (const uint8_t *)w->packed + (size_t)g * w->pack_stride;
    __m512 acc[KN_TILE_M];
#pragma GCC unroll 8
    for (int r = 0; r < TM; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, p += pb) {
        /* Several tokens make a block slow enough to be worth fetching
         * ahead (prefill 1044 vs 872 tok/s); one token streams faster on
         * the hardware prefetcher alone (576x1536: 19.3 vs 21.5 us). */
        if (TM > 1)
            for (size_t i = 0; i < pb; i += 64) /* an address, maybe past the end: never dereferenced */
                _mm_prefetch((const char *)((uintptr_t)p + KN_PF_DIST + i), _MM_HINT_T0);
        __m512i q[8];
        load_q(t, p, q);
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p + doff)));
        __m512 mm = t == GGML_TYPE_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p + 288)))
                                        : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < TM; r++) {
            __m512i isum;
            if (BITS == 8) {
                const int8_t *xi = qx[r].planes + b * KN_QX8_BYTES;
                /* Two chains: with several tokens in flight, their
                 * chains already overlap. */
                __m512i s0 = _mm512_setzero_si512(), s1 = s0;
#pragma GCC unroll 4
                for (int v = 0; v < 8; v += 2) {
                    s0 = _mm512_dpbusd_epi32(s0, q[v], bcast4(xi + 4 * v));
                    s1 = _mm512_dpbusd_epi32(s1, q[v + 1], bcast4(xi + 4 * v + 4));
                }
                isum = _mm512_add_epi32(s0, s1);
            } else {
                const int8_t *hi = qx[r].planes + b * KN_QX_PLANES, *lo = hi + KN_QK;
                /* Four independent chains hide vpdpbusd's latency. */
                __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
#pragma GCC unroll 4
                for (int v = 0; v < 8; v += 2) {
                    h0 = _mm512_dpbusd_epi32(h0, q[v], bcast4(hi + 4 * v));
                    h1 = _mm512_dpbusd_epi32(h1, q[v + 1], bcast4(hi + 4 * v + 4));
                    l0 = _mm512_dpbusd_epi32(l0, q[v], bcast4(lo + 4 * v));
                    l1 = _mm512_dpbusd_epi32(l1, q[v + 1], bcast4(lo + 4 * v + 4));
                }
                isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 7), _mm512_add_epi32(l0, l1));
            }
            if (t == GGML_TYPE_Q4_0) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(8 * qx[r].isx[b]));
            if (t == GGML_TYPE_Q8_0) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * qx[r].isx[b]));
            __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(qx[r].sx[b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[r]);
            if (t == GGML_TYPE_Q4_1) acc[r] = _mm512_fmadd_ps(mm, _mm512_set1_ps(qx[r].xs[b]), acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < TM; r++) _mm512_storeu_ps(y + (size_t)r * ldy + (size_t)g * KN_PACK_ROWS, acc[r]);
}

KN_QG_KERNELS(kn_qgroup_avx512, TGT)

/* kn_qx_quantize's steps on 16 lanes: the products x * inv, the
 * round-to-even by adding and subtracting 1.5 * 2^23, the clamp and the
 * split are the same IEEE and integer operations, so the bytes are the
 * portable code's. */
TGT void kn_qx_quantize_avx512(const float *x, int64_t k, int bits, uint8_t *row) {
    int64_t nb = k / KN_QK;
    size_t bpb = kn_qx_block_bytes(bits);
    const int32_t lim = bits == 8 ? KN_QX8_MAX : KN_QX_MAX;
    float *sx = (float *)(void *)(row + (size_t)nb * bpb);
    float *xs = sx + nb;
    int32_t *isx = (int32_t *)(void *)(xs + nb);
    const __m512 magic = _mm512_set1_ps(12582912.0f), big = _mm512_set1_ps(FLT_MAX);
    const __m512i vlim = _mm512_set1_epi32(lim), nlim = _mm512_set1_epi32(-lim), half = _mm512_set1_epi32(64);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * KN_QK;
        int8_t *hi = (int8_t *)row + (size_t)b * bpb, *lo = hi + KN_QK; /* at 8 bits, hi is xi */
        __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
        __m512 a0 = _mm512_abs_ps(v0), a1 = _mm512_abs_ps(v1);
        /* finite: every |x| <= FLT_MAX (false for inf and NaN) */
        bool finite = (__mmask16)(_mm512_cmp_ps_mask(a0, big, _CMP_LE_OQ) & _mm512_cmp_ps_mask(a1, big, _CMP_LE_OQ)) ==
                      (__mmask16)0xffff;
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
        if (!finite || amax < KN_QX_TINY) {
            memset(hi, 0, bpb);
            sx[b] = finite ? 0.0f : __builtin_nanf("");
            isx[b] = 0;
            xs[b] = sx[b] * 0.0f;
            continue;
        }
        float inv = (float)lim / amax;
        sx[b] = amax / (float)lim;
        __m512 vi = _mm512_set1_ps(inv);
        __m512 r0 = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v0, vi), magic), magic);
        __m512 r1 = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v1, vi), magic), magic);
        __m512i i0 = _mm512_cvttps_epi32(r0), i1 = _mm512_cvttps_epi32(r1);
        i0 = _mm512_max_epi32(_mm512_min_epi32(i0, vlim), nlim);
        i1 = _mm512_max_epi32(_mm512_min_epi32(i1, vlim), nlim);
        if (bits == 8) {
            _mm_storeu_si128((__m128i *)(void *)hi, _mm512_cvtepi32_epi8(i0));
            _mm_storeu_si128((__m128i *)(void *)(hi + 16), _mm512_cvtepi32_epi8(i1));
        } else {
            __m512i h0 = _mm512_srai_epi32(_mm512_add_epi32(i0, half), 7);
            __m512i h1 = _mm512_srai_epi32(_mm512_add_epi32(i1, half), 7);
            __m512i l0 = _mm512_sub_epi32(i0, _mm512_slli_epi32(h0, 7));
            __m512i l1 = _mm512_sub_epi32(i1, _mm512_slli_epi32(h1, 7));
            _mm_storeu_si128((__m128i *)(void *)hi, _mm512_cvtepi32_epi8(h0));
            _mm_storeu_si128((__m128i *)(void *)(hi + 16), _mm512_cvtepi32_epi8(h1));
            _mm_storeu_si128((__m128i *)(void *)lo, _mm512_cvtepi32_epi8(l0));
            _mm_storeu_si128((__m128i *)(void *)(lo + 16), _mm512_cvtepi32_epi8(l1));
        }
        int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
        isx[b] = sum;
        xs[b] = sx[b] * (float)sum;
    }
}

/* kn_exp and kn_swiglu1 (kn_cpu_impl.h) on 16 lanes, step for step. */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
#define CVT16(n) __builtin_convertvector((n), v16i)

INL v16f select16(v16i mask, v16f yes, v16f no) { return (v16f)(((v16i)yes & mask) | ((v16i)no & ~mask)); }

INL v16f exp16(v16f x) {
    const v16f lo = (v16f){0} - 87.0f, hi = (v16f){0} + 88.0f;
    v16i nan = x != x;
    v16f xc = select16(x < lo, lo, select16(x > hi, hi, x)), y;
    xc = select16(nan, lo, xc);
    KN_EXP_CORE(v16f, v16i, CVT16, xc, y);
    return select16(nan, x, y);
}

TGT void kn_swiglu_avx512(const float *g, const float *u, float *y, int64_t n) {
    for (int64_t i = 0; i + 16 <= n; i += 16) {
        v16f gv, uv;
        memcpy(&gv, g + i, sizeof gv);
        memcpy(&uv, u + i, sizeof uv);
        v16f e = exp16(-gv);
        v16f den = 1.0f + e;
        v16f sv = gv / den;
        v16f out = sv * uv;
        memcpy(y + i, &out, sizeof out);
    }
}

#else /* not x86-64: kn_cpu_use_avx512vnni is always false */

void kn_qgroup_avx512(const kn_weight *w, int64_t g, const kn_qx *qx, int tm, int bits, float *y, size_t ldy) {
    (void)w, (void)g, (void)qx, (void)tm, (void)bits, (void)y, (void)ldy;
    AE_ASSERT(!"no AVX-512 kernel on this architecture");
}

void kn_qx_quantize_avx512(const float *x, int64_t k, int bits, uint8_t *row) {
    (void)x, (void)k, (void)bits, (void)row;
    AE_ASSERT(!"no AVX-512 kernel on this architecture");
}

void kn_swiglu_avx512(const float *g, const float *u, float *y, int64_t n) {
    (void)g, (void)u, (void)y, (void)n;
    AE_ASSERT(!"no AVX-512 kernel on this architecture");
}

#endif
