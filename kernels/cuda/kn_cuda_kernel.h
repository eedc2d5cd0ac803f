/* What the kernel files of the CUDA backend share (kn_cuda_elementwise.cu,
 * kn_cuda_norm.cu, kn_cuda_softmax.cu, kn_cuda_matmul.cu,
 * kn_cuda_attention.cu): the launch helpers, the number conversions and
 * exponentials the kernels compute with (each the CPU backend's bits),
 * and a weight as a kernel reads it. Everything here is inline, so each
 * file takes only what it uses. kn_cuda.h says which bits the kernels
 * keep, and tests/gpu/UNRUN.md what of them has run on a GPU, and how
 * fast. */
#ifndef AERIE_KERNELS_CUDA_KERNEL_H
#define AERIE_KERNELS_CUDA_KERNEL_H

#include "kn_cuda.h"

#include <math.h>

/* A loop nvcc unrolls whole (gcc, for the shim, has no such pragma). */
#ifdef KN_CUDA_SHIM
#define KCU_UNROLL
#else
#define KCU_UNROLL _Pragma("unroll")
#endif

#define KCU_THREADS 128
#define KCU_MAX_GRID 4096
#define KCU_QK 32

static inline dim3 flat_grid(int64_t count) {
    int64_t b = (count + KCU_THREADS - 1) / KCU_THREADS;
    return dim3((unsigned)(b < 1 ? 1 : b > KCU_MAX_GRID ? KCU_MAX_GRID : b));
}

static KN_HD int64_t flat_start(void) { return (int64_t)blockIdx.x * blockDim.x + threadIdx.x; }
static KN_HD int64_t flat_step(void) { return (int64_t)gridDim.x * blockDim.x; }

/* After each launch: the launch's own error, and with AERIE_CUDA_SYNC=1
 * (tests/gpu/run.sh) a wait for the kernel, so that a fault is reported
 * at the kernel that made it rather than at a later call. */
static inline void launched(kn_stream *s) {
    KN_CK(cudaGetLastError());
    if (kcu_sync_launches()) {
        /* Not while capturing: that would end the capture. */
        cudaStreamCaptureStatus cs;
        KN_CK(cudaStreamIsCapturing(KN_CU(s)->st, &cs));
        if (cs == cudaStreamCaptureStatusNone) KN_CK(cudaStreamSynchronize(KN_CU(s)->st));
    }
}

/* The stream to launch on, with its device made current on this thread. */
static inline cudaStream_t st(kn_stream *s) {
    kcu_bind(KN_CU(s)->dev);
    return KN_CU(s)->st;
}

/* ---- numbers ------------------------------------------------------------ */

static KN_HD float f32_of(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static KN_HD uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* IEEE half to float, exact (subnormal halves are normal floats). */
static KN_HD float half_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, man = h & 0x3ffu;
    if (e == 31u) return f32_of(sign | 0x7f800000u | (man << 13));
    if (e == 0u) {
        float v = (float)man * 0x1p-24f; /* exact: man < 2^10 */
        return sign ? -v : v;
    }
    return f32_of(sign | ((e + 112u) << 23) | (man << 13));
}

/* Float to IEEE half, to nearest, ties to even; NaN stays NaN with its
 * top payload bits, overflow goes to inf: quant_f32_to_f16's bits. */
static KN_HD uint16_t f32_to_half(float f) {
    uint32_t x = bits_of(f), ax = x & 0x7fffffffu;
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    if (ax >= 0x38800000u) {
        uint32_t h = (ax - 0x38000000u) >> 13, rest = ax & 0x1fffu;
        if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
        return (uint16_t)(sign | h);
    }
    if (ax <= 0x33000000u) return sign;
    uint32_t man = (ax & 0x7fffffu) | 0x800000u, shift = 126u - (ax >> 23);
    uint32_t q = man >> shift, rest = man & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

static KN_HD float bf16_to_f32(uint16_t h) { return f32_of((uint32_t)h << 16); }

/* Float to bfloat16, to nearest, ties to even; NaN stays a quiet NaN. */
static KN_HD uint16_t f32_to_bf16(float f) {
    uint32_t x = bits_of(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* e^xc for xc in [-87, 88], the IEEE steps of KN_EXP_CORE
 * (kn_cpu_impl.h) one by one. */
static KN_HD float exp_core(float xc) {
    float t = xc * 1.44269504f;
    float n = (t + 12582912.0f) - 12582912.0f;
    float nh = n * 0.693145752f;
    float r = xc - nh;
    float nl = n * 1.42860677e-06f;
    r = r - nl;
    float p = r * (1.0f / 5040.0f);
    p = p + 1.0f / 720.0f;
    p = p * r;
    p = p + 1.0f / 120.0f;
    p = p * r;
    p = p + 1.0f / 24.0f;
    p = p * r;
    p = p + 1.0f / 6.0f;
    p = p * r;
    p = p + 0.5f;
    p = p * r;
    p = p + 1.0f;
    p = p * r;
    p = p + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    return p * f32_of((uint32_t)e);
}

/* kn_exp: x clamped to [-87, 88], NaN kept. */
static KN_HD float exp_clamped(float x) {
    if (x != x) return x;
    return exp_core(x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x);
}

/* The attention's e^x for x <= 0: 0 below -87, NaN kept. */
static KN_HD float exp_neg(float x) {
    if (x != x) return x;
    if (x < -87.0f) return 0.0f;
    return exp_core(x);
}

/* ---- weights ------------------------------------------------------------ */

/* What a kernel needs of a kn_weight. */
struct kw {
    const uint8_t *data;
    size_t row_bytes;
    int64_t rows, cols;
    int type;
};

static inline kw kw_of(const kn_weight *w) {
    kw k;
    k.data = (const uint8_t *)w->data;
    k.row_bytes = w->row_bytes;
    k.rows = w->rows;
    k.cols = w->cols;
    k.type = (int)w->type;
    return k;
}

static KN_HD uint16_t ld16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* Aligned loads (the caller knows the alignment); the shim's through
 * memcpy, which is what C allows. */
template <typename T> static KN_HD T load_aligned(const void *p) {
#ifdef KN_CUDA_SHIM
    T v;
    memcpy(&v, p, sizeof v);
    return v;
#else
    return *(const T *)p;
#endif
}
static KN_HD uint32_t ld32a(const void *p) { return load_aligned<uint32_t>(p); }
static KN_HD uint32_t ld16a(const void *p) { return load_aligned<uint16_t>(p); }
static KN_HD int32_t lo16(uint32_t v) { return (int32_t)(int16_t)(uint16_t)(v & 0xffffu); }
static KN_HD int32_t hi16(uint32_t v) { return (int32_t)(int16_t)(uint16_t)(v >> 16); }

#endif
