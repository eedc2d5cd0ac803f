/* Internals shared by the CPU kernel files (not part of the op interface). */
#ifndef AERIE_KERNELS_CPU_IMPL_H
#define AERIE_KERNELS_CPU_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../../services/core/pool.h"
#include "../backend.h"

/* A CPU stream: ops run on the pool's threads and are done when they
 * return. */
typedef struct kn_cpu_stream {
    kn_stream base; /* backend.h; base.act_bits: how quantized matmuls round x */
    pool *pool;     /* not owned */
    void *work;     /* (work_bytes) scratch, 64-byte aligned */
    size_t work_bytes;
} kn_cpu_stream;

#define KN_CPU(s) ((kn_cpu_stream *)(s))

/* kn_backend_cpu's comm_init (kn_comm.c): the CPU kind only. */
int kn_cpu_comm_init(kn_allreduce kind, kn_comm **comms, int n_ranks, const kn_backend *const *rank_be,
                     size_t max_count, ae_error *err);

/* The ops of kn_backend_cpu (backend.h), their arguments checked by
 * kernels.c. kn_cpu_matmul is one matrix (kn_cpu_matmul_n's loop). */
void kn_cpu_matmul(kn_stream *s, const kn_weight *w, const float *x, float *y, int64_t m);
void kn_cpu_matmul_n(kn_stream *s, int n, const kn_weight *const *w, const float *x, float *const *y, int64_t m);
void kn_cpu_matmul_swiglu(kn_stream *s, const kn_weight *gate, const kn_weight *up, const float *x, float *y_gate,
                          float *y_up, int64_t m);
void kn_cpu_rmsnorm(kn_stream *s, const float *x, const float *g, float *y, int64_t m, int64_t n, float eps);
void kn_cpu_add(kn_stream *s, const float *a, const float *b, float *y, int64_t count);
void kn_cpu_bias_add(kn_stream *s, float *x, const float *bias, int64_t m, int64_t n);
void kn_cpu_swiglu(kn_stream *s, const float *gate, const float *up, float *y, int64_t count);
void kn_cpu_softmax(kn_stream *s, float *x, int64_t m, int64_t n);
void kn_cpu_argmax(kn_stream *s, const float *x, int32_t *out, int64_t m, int64_t n);
void kn_cpu_embed(kn_stream *s, const kn_weight *table, const int32_t *ids, float *out, int64_t m);
void kn_cpu_rope_rotate(kn_stream *s, const kn_rope *r, float *x, int64_t m, int32_t n_heads, const float *cs);
void kn_cpu_kv_write(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *k, const float *v);
void kn_cpu_kv_move(kn_stream *s, const kn_kv_pool *kv, const int32_t *src_rows, const int32_t *dst_rows, int32_t n);
void kn_cpu_attention(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *q, float *out,
                      int32_t n_heads);
/* kn_topk's selection (any k <= n: the router's groups too); s unused. */
void kn_cpu_topk(kn_stream *s, const float *x, int64_t m, int64_t n, int32_t k, int32_t *idx, float *val);
void kn_cpu_matmul_heads(kn_stream *s, const kn_weight *w, int32_t n_heads, const float *x, int64_t x_head, float *y,
                         int64_t y_head, int64_t m);
void kn_cpu_moe_route(kn_stream *s, const float *logits, const float *bias, int64_t m, const kn_route *r, int32_t *idx,
                      float *w);
void kn_cpu_moe_ffn(kn_stream *s, const kn_experts *e, const float *x, const int32_t *idx, const float *w, int64_t m,
                    int32_t top_k, float *scratch, float *y);

/* The core of every exponential in the kernels, for xc in [-87, 88]:
 * xc = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7
 * (error < 6e-9), times 2^n built in the exponent field; within 2 ulp of
 * expf. F is float or a GCC vector of floats, I the int type of the same
 * shape, CVT converts an integral F to I. Written once so that the scalar
 * and vector callers take the same IEEE steps lane by lane (libm's expf
 * is a call per element and cannot vectorize). */
#define KN_EXP_CORE(F, I, CVT, xc, out) \
    do { \
        F t_ = (xc) * 1.44269504f; \
        F n_ = (t_ + 12582912.0f) - 12582912.0f; /* round to nearest */ \
        F nh_ = n_ * 0.693145752f;               /* ln2's high part: exact, |n| <= 127 */ \
        F r_ = (xc) - nh_; \
        F nl_ = n_ * 1.42860677e-06f; /* ln2's low part */ \
        r_ = r_ - nl_; \
        F p_ = r_ * (1.0f / 5040.0f); \
        p_ = p_ + 1.0f / 720.0f; \
        p_ = p_ * r_; \
        p_ = p_ + 1.0f / 120.0f; \
        p_ = p_ * r_; \
        p_ = p_ + 1.0f / 24.0f; \
        p_ = p_ * r_; \
        p_ = p_ + 1.0f / 6.0f; \
        p_ = p_ * r_; \
        p_ = p_ + 0.5f; \
        p_ = p_ * r_; \
        p_ = p_ + 1.0f; \
        p_ = p_ * r_; \
        p_ = p_ + 1.0f; \
        I e_ = (CVT(n_) + 127) << 23; /* n + 127 in [1, 254] */ \
        F s_; \
        memcpy(&s_, &e_, sizeof s_); \
        (out) = p_ * s_; \
    } while (0)

#define KN_CVT_SCALAR(n) ((int32_t)(n))

/* e^x, x clamped to [-87, 88]; NaN stays NaN. */
static inline float kn_exp(float x) {
    if (x != x) return x;
    float xc = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x, y;
    KN_EXP_CORE(float, int32_t, KN_CVT_SCALAR, xc, y);
    return y;
}

/* One element of kn_swiglu: silu(g) * u, silu(g) = g / (1 + e^-g). The
 * portable code and kn_swiglu_avx512 take the same steps. */
static inline float kn_swiglu1(float g, float u) {
    float e = kn_exp(-g);
    float den = 1.0f + e;
    float s = g / den;
    return s * u;
}

/* y[i] = kn_swiglu1(g[i], u[i]) for i < n, with AVX-512 where the CPU has
 * it (kn_cpu.c). */
void kn_swiglu_span(const float *g, const float *u, float *y, int64_t n);
void kn_swiglu_avx512(const float *g, const float *u, float *y, int64_t n);

/* true when the AVX2 kernels run (CPU support and not forced off). */
bool kn_cpu_use_avx2(void);
/* true when the AVX-512 VNNI kernels run (CPU support and not forced off). */
bool kn_cpu_use_avx512vnni(void);

/* Elements per block of the quantized weight formats matmul reads. */
#define KN_QK 32

/* Block layouts of the weight formats (ggml's, packed, little-endian). */
typedef struct kn_blk_q8_0 {
    uint16_t d; /* f16 scale */
    int8_t q[KN_QK];
} kn_blk_q8_0;
typedef struct kn_blk_q4_0 {
    uint16_t d;           /* f16 scale; x = (nibble - 8) * d */
    uint8_t q[KN_QK / 2]; /* element i: low nibble of q[i], i+16: high */
} kn_blk_q4_0;
typedef struct kn_blk_q4_1 {
    uint16_t d;           /* f16 scale; x = nibble * d + m */
    uint16_t m;           /* f16 offset */
    uint8_t q[KN_QK / 2]; /* element i: low nibble of q[i], i+16: high */
} kn_blk_q4_1;

_Static_assert(sizeof(kn_blk_q8_0) == 34, "Q8_0 block layout");
_Static_assert(sizeof(kn_blk_q4_0) == 18, "Q4_0 block layout");
_Static_assert(sizeof(kn_blk_q4_1) == 20, "Q4_1 block layout");

/* A tile of the product: rows [0, tm) of the activations, row r at
 * x + r * x_stride, against weight rows [j0, j1), written to
 * y[r * ldy + j]. tm <= KN_TILE_M. Every output element follows the order
 * fixed in kernels.h, so any tiling gives the same bits. */
#define KN_TILE_M 8

/* Rows of W per chunk (a tile's j1 - j0 is at most this). Each thread
 * takes a contiguous run of chunks (kn_matmul.c); 64 rows of a 1536-wide
 * Q4_1 matrix are 60 KiB, which the m-tiles revisit from L2
 * (docs/performance.md: why 64). */
#define KN_CHUNK_N 64
typedef struct kn_tile {
    const kn_weight *w;
    const float *x;
    size_t x_stride;
    int tm;
    int64_t j0, j1;
    float *y;
    size_t ldy;
} kn_tile;

void kn_tile_scalar(const kn_tile *t);
void kn_tile_avx2(const kn_tile *t);

/* ---- integer matmul of the quantized types (kn_qmatmul.c) ---------------
 *
 * A quantized row of x (kernels.h, "quantized W") as the kernels read it:
 * for each block b of 32 elements its bytes of x, then after all blocks
 * the per-block arrays sx[nb] (f32 scale), xs[nb] (f32, sx * sum xi),
 * isx[nb] (int32, sum xi) and isx16[2 nb] (int32, the sums of each half
 * of 16, for the types with 16-element sub-blocks). The bytes of a block are, at 15 bits, 64 bytes
 * of planes (hi[32] then lo[32], xi = 128 * hi + lo); at 8 bits, xi[32]
 * itself. */
bool kn_qmatmul_type(ggml_type t);
void kn_qmatmul_n(kn_stream *s, int n_w, const kn_weight *const *w, const float *x, float *const *y, int64_t m);
void kn_qmatmul_swiglu(kn_stream *s, const kn_weight *gate, const kn_weight *up, const float *x, float *y_gate,
                       float *y_up, int64_t m);

#define KN_QX_MAX 16256      /* 15 bits: |xi| <= 127 * 128 */
#define KN_QX8_MAX 127       /* 8 bits: |xi| <= 127 */
#define KN_QX_TINY 0x1p-100f /* a block whose largest |x| is below this counts as zero */
#define KN_QX_PLANES 64      /* bytes of x per block at 15 bits (two planes) */
#define KN_QX8_BYTES 32      /* bytes of x per block at 8 bits (one) */
/* Bytes of x per block at `bits` (15 or 8). */
static inline size_t kn_qx_block_bytes(int bits) { return bits == 8 ? KN_QX8_BYTES : KN_QX_PLANES; }
size_t kn_qx_row_bytes(int64_t k, int bits);
void kn_qx_quantize(const float *x, int64_t k, int bits, uint8_t *row);
/* The same with AVX-512, the same bytes (kn_qmatmul_avx512.c). */
void kn_qx_quantize_avx512(const float *x, int64_t k, int bits, uint8_t *row);

typedef struct kn_qx {
    const int8_t *planes; /* [nb][kn_qx_block_bytes(bits)] */
    const float *sx, *xs;
    const int32_t *isx;
    const int32_t *isx16; /* [2 nb]: sum xi over elements 0..15, then 16..31 */
} kn_qx;
kn_qx kn_qx_view(const uint8_t *row, int64_t k, int bits);

/* Tokens [0, tm) (tm <= KN_TILE_M) of quantized x at `bits` (15 or 8),
 * row r at qx[r], times packed group g of w (rows 16g .. 16g+15), written
 * to y[r * ldy + 16g + i]. */
void kn_qgroup_avx512(const kn_weight *w, int64_t g, const kn_qx *qx, int tm, int bits, float *y, size_t ldy);
/* The same with AVX2 (kn_qmatmul_avx2.c), for CPUs without VNNI. */
void kn_qgroup_avx2(const kn_weight *w, int64_t g, const kn_qx *qx, int tm, int bits, float *y, size_t ldy);
/* The same for Q4_K, Q5_K and Q6_K (kn_qmatmul_kquant_avx2.c), on any
 * CPU with AVX2; a packed group's unit is one 256-element super-block. */
void kn_kgroup_avx2(const kn_weight *w, int64_t g, const kn_qx *qx, int tm, int bits, float *y, size_t ldy);
/* The same for Q5_0, Q5_1, IQ4_NL and MXFP4 (kn_qmatmul_q5_avx2.c). */
void kn_q5group_avx2(const kn_weight *w, int64_t g, const kn_qx *qx, int tm, int bits, float *y, size_t ldy);

/* Defines `name` (one of the two above) in a kernel file that has
 * qgroup(type, TM, BITS, w, g, qx, y, ldy) for a target attribute `attr`:
 * one instance per (type, tile height, bits), so that a tile's
 * accumulators live in registers and the loops have no branches on the
 * precision, and a table to pick the instance at run time. */
typedef void (*kn_qg_fn)(const kn_weight *, int64_t, const kn_qx *, float *, size_t);
/* The instance lists read as a table, which clang-format would reflow
 * differently on each run. */
// clang-format off
#define KN_QG_INSTANCE(fn, attr, type, TM, BITS)                                                \
    static attr void fn(const kn_weight *w, int64_t g, const kn_qx *qx, float *y, size_t ldy) { \
        qgroup(type, TM, BITS, w, g, qx, y, ldy);                                               \
    }
#define KN_QG_BITS(pfx, attr, type, BITS)                                                                       \
    KN_QG_INSTANCE(pfx##_1, attr, type, 1, BITS) KN_QG_INSTANCE(pfx##_2, attr, type, 2, BITS)                  \
    KN_QG_INSTANCE(pfx##_3, attr, type, 3, BITS) KN_QG_INSTANCE(pfx##_4, attr, type, 4, BITS)                  \
    KN_QG_INSTANCE(pfx##_5, attr, type, 5, BITS) KN_QG_INSTANCE(pfx##_6, attr, type, 6, BITS)                  \
    KN_QG_INSTANCE(pfx##_7, attr, type, 7, BITS) KN_QG_INSTANCE(pfx##_8, attr, type, 8, BITS)                  \
    static const kn_qg_fn pfx[KN_TILE_M] = {pfx##_1, pfx##_2, pfx##_3, pfx##_4, pfx##_5, pfx##_6, pfx##_7, pfx##_8};
#define KN_QG_TYPE(pfx, attr, type) KN_QG_BITS(pfx##_b15, attr, type, 15) KN_QG_BITS(pfx##_b8, attr, type, 8)
// clang-format on
#define KN_QG_PICK(name, bits) ((bits) == 8 ? name##_b8 : name##_b15)
#define KN_QG_KERNELS(name, attr) \
    _Static_assert(KN_TILE_M == 8, "one instance per tile height"); \
    KN_QG_TYPE(name##_q8_0, attr, GGML_TYPE_Q8_0) \
    KN_QG_TYPE(name##_q4_0, attr, GGML_TYPE_Q4_0) \
    KN_QG_TYPE(name##_q4_1, attr, GGML_TYPE_Q4_1) \
    void name(const kn_weight *w, int64_t g, const kn_qx *qx, int tm, int bits, float *y, size_t ldy) { \
        AE_ASSERT(tm >= 1 && tm <= KN_TILE_M && (bits == 8 || bits == 15)); \
        const kn_qg_fn *set = w->type == GGML_TYPE_Q8_0   ? KN_QG_PICK(name##_q8_0, bits) \
                              : w->type == GGML_TYPE_Q4_0 ? KN_QG_PICK(name##_q4_0, bits) \
                                                          : KN_QG_PICK(name##_q4_1, bits); \
        set[tm - 1](w, g, qx, y, ldy); \
    }

#endif
