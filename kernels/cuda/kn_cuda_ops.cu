/* The ops of the CUDA backend: portable kernels that keep the CPU
 * backend's bits (kn_cuda.h). Each reduction that kernels.h orders is
 * computed in that order; what it leaves free (integer sums, maxima,
 * which thread does what) is spread over the GPU's threads.
 *
 * Layout of the work:
 *   - element-wise ops: a grid-stride loop, one element per thread;
 *   - per-row ops (rmsnorm, softmax): one block per row; argmax: 32
 *     blocks per row, then the best of them;
 *   - float matmul: a block is 32 weight rows x 8 lanes; the rows and x
 *     pass through shared memory a chunk at a time, and thread (j, l)
 *     runs lane l's fma chain of row j for up to 8 rows of x; lane 0 adds
 *     the lanes in kernels.h's tree;
 *   - quantized matmul: x is first rounded to integers per block of 32
 *     (k_qx). For one row of x (decode) a warp takes one weight row, a
 *     group of 32 blocks at a time: four lanes to a block make its exact
 *     integer sum, and lane r chains row r's block terms in order. For
 *     more (verify, prefill) a warp takes 16 weight rows by up to 32 rows
 *     of x, a block at a time: the tensor cores' mma makes the integer
 *     sums (exact, so in any order), and each lane chains its outputs'
 *     terms in order;
 *   - attention: for decode and verify (up to KN_ATTN_SPLIT_M tokens) a
 *     block per (token, head, chunk) makes the chunk's partial and a
 *     second kernel merges them in order; for more tokens (prefill,
 *     large trees) a block per 8 tokens and head walks their chunks,
 *     merging as it goes, and loads a chunk that lies in all 8 tokens'
 *     prefixes once for the 8. Both are kn_attention.c's arithmetic.
 * tests/gpu/UNRUN.md says what of this has run on a GPU, and how fast. */
#include "kn_cuda.h"

extern "C" {
#include "../draw.h"
}

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

static dim3 flat_grid(int64_t count) {
    int64_t b = (count + KCU_THREADS - 1) / KCU_THREADS;
    return dim3((unsigned)(b < 1 ? 1 : b > KCU_MAX_GRID ? KCU_MAX_GRID : b));
}

static KN_HD int64_t flat_start(void) { return (int64_t)blockIdx.x * blockDim.x + threadIdx.x; }
static KN_HD int64_t flat_step(void) { return (int64_t)gridDim.x * blockDim.x; }

/* After each launch: the launch's own error, and with AERIE_CUDA_SYNC=1
 * (tests/gpu/run.sh) a wait for the kernel, so that a fault is reported
 * at the kernel that made it rather than at a later call. */
static void launched(kn_stream *s) {
    KN_CK(cudaGetLastError());
    if (kcu_sync_launches()) {
        /* Not while capturing: that would end the capture. */
        cudaStreamCaptureStatus cs;
        KN_CK(cudaStreamIsCapturing(KN_CU(s)->st, &cs));
        if (cs == cudaStreamCaptureStatusNone) KN_CK(cudaStreamSynchronize(KN_CU(s)->st));
    }
}

/* The stream to launch on, with its device made current on this thread. */
static cudaStream_t st(kn_stream *s) {
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

/* ---- element-wise ------------------------------------------------------- */

__global__ void k_add(const float *a, const float *b, float *y, int64_t count) {
    for (int64_t i = flat_start(); i < count; i += flat_step()) y[i] = a[i] + b[i];
}

void kcu_add(kn_stream *s, const float *a, const float *b, float *y, int64_t count) {
    if (count == 0) return;
    KN_LAUNCH(k_add, flat_grid(count), dim3(KCU_THREADS), st(s), a, b, y, count);
    launched(s);
}

/* silu(g) * u as kn_swiglu1 computes it. */
static KN_HD float swiglu1(float g, float u) {
    float e = exp_clamped(-g);
    float den = 1.0f + e;
    float sg = g / den;
    return sg * u;
}

__global__ void k_swiglu(const float *g, const float *u, float *y, int64_t count) {
    for (int64_t i = flat_start(); i < count; i += flat_step()) y[i] = swiglu1(g[i], u[i]);
}

void kcu_swiglu(kn_stream *s, const float *gate, const float *up, float *y, int64_t count) {
    if (count == 0) return;
    KN_LAUNCH(k_swiglu, flat_grid(count), dim3(KCU_THREADS), st(s), gate, up, y, count);
    launched(s);
}

__global__ void k_bias_add(float *x, const float *bias, int64_t m, int64_t n) {
    for (int64_t i = flat_start(); i < m * n; i += flat_step()) x[i] = x[i] + bias[i % n];
}

void kcu_bias_add(kn_stream *s, float *x, const float *bias, int64_t m, int64_t n) {
    if (m == 0) return;
    KN_LAUNCH(k_bias_add, flat_grid(m * n), dim3(KCU_THREADS), st(s), x, bias, m, n);
    launched(s);
}

__global__ void k_gather(const float *src, const int32_t *rows, int64_t n, int64_t width, float *dst,
                         int64_t dst_stride) {
    for (int64_t i = flat_start(); i < n * width; i += flat_step()) {
        int64_t r = i / width, c = i % width;
        int64_t from = rows ? (int64_t)rows[r] : r;
        dst[r * dst_stride + c] = src[from * width + c];
    }
}

void kcu_gather_rows(kn_stream *s, const float *src, const int32_t *rows, int64_t n, int64_t width, float *dst,
                     int64_t dst_stride) {
    if (n == 0) return;
    KN_LAUNCH(k_gather, flat_grid(n * width), dim3(KCU_THREADS), st(s), src, rows, n, width, dst, dst_stride);
    launched(s);
}

/* ---- per row ------------------------------------------------------------ */

/* Row blockIdx.x. The sum of squares is kernels.h's: 8 lanes of double
 * sums in element order (threads 0..7), the lane tree, the tail. The
 * squares are independent: the whole block makes them, a chunk at a time,
 * into shared memory, and the 8 lanes only add, 8 loads ahead. */
#define RN_CHUNK 2048
static __device__ void rn_row(const float *xr, const float *g, float *yr, int64_t n, float eps) {
    __shared__ double sq[RN_CHUNK];
    __shared__ double lane[8];
    __shared__ float inv_s;
    unsigned t = threadIdx.x;
    int64_t n8 = n / 8 * 8;
    double a = 0.0;
    for (int64_t c0 = 0; c0 < n8; c0 += RN_CHUNK) {
        int cl = n8 - c0 < RN_CHUNK ? (int)(n8 - c0) : RN_CHUNK; /* a multiple of 8 */
        for (int i = (int)t; i < cl; i += (int)blockDim.x) {
            double v = (double)xr[c0 + i];
            sq[i] = v * v;
        }
        __syncthreads();
        if (t < 8) {
            int i = (int)t;
            for (; i + 56 < cl; i += 64) { /* 8 of the lane's squares, then their sums in order */
                double s8[8];
                for (int u = 0; u < 8; u++) s8[u] = sq[i + 8 * u];
                for (int u = 0; u < 8; u++) a = a + s8[u];
            }
            for (; i < cl; i += 8) a = a + sq[i];
        }
        __syncthreads();
    }
    if (t < 8) lane[t] = a;
    __syncthreads();
    if (t == 0) {
        double ss = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
        for (int64_t i = n8; i < n; i++) {
            double v = (double)xr[i];
            double v2 = v * v;
            ss = ss + v2;
        }
        inv_s = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
    }
    __syncthreads();
    float inv = inv_s;
    for (int64_t i = t; i < n; i += blockDim.x) {
        float v = xr[i] * inv;
        yr[i] = v * g[i];
    }
}

__global__ void k_rmsnorm(const float *x, const float *g, float *y, int64_t n, float eps) {
    rn_row(x + (int64_t)blockIdx.x * n, g, y + (int64_t)blockIdx.x * n, n, eps);
}

/* Row blockIdx.x of x [m][n]: x += the sum of every rank's slot in rank
 * order (kn_allreduce_add's bits), then y = rmsnorm(x) * g (k_rmsnorm's):
 * the custom allreduce with the residual add and the norm after it in one
 * kernel. */
__global__ void k_allreduce_add_rmsnorm(kcu_slots slots, int n_ranks, float *x, const float *g, float *y, int64_t n,
                                        float eps) {
    int64_t r0 = (int64_t)blockIdx.x * n;
    float *xr = x + r0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        float sum = slots.p[0][r0 + i];
        for (int q = 1; q < n_ranks; q++) sum = sum + slots.p[q][r0 + i];
        xr[i] = xr[i] + sum;
    }
    __syncthreads();
    rn_row(xr, g, y + r0, n, eps);
}

void kcu_launch_add_rmsnorm(cudaStream_t st, const kcu_slots *slots, int n_ranks, float *x, const float *g, float *y,
                            int64_t m, int64_t n, float eps) {
    if (m == 0) return;
    KN_LAUNCH(k_allreduce_add_rmsnorm, dim3((unsigned)m), dim3(KCU_THREADS), st, *slots, n_ranks, x, g, y, n, eps);
    KN_CK(cudaGetLastError());
}

void kcu_rmsnorm(kn_stream *s, const float *x, const float *g, float *y, int64_t m, int64_t n, float eps) {
    if (m == 0) return;
    KN_LAUNCH(k_rmsnorm, dim3((unsigned)m), dim3(KCU_THREADS), st(s), x, g, y, n, eps);
    launched(s);
}

/* Row blockIdx.x in place. The maximum is order-free; the sum is in
 * double in element order, one chain (thread 0), as on the CPU. The
 * exponentials are independent: the whole block makes them, a chunk at a
 * time, and copies them to shared memory, from which thread 0 adds 8
 * loads ahead. */
#define SM_CHUNK 4096
__global__ void k_softmax(float *x, int64_t n) {
    __shared__ float mx_t[KCU_THREADS];
    __shared__ float ex[SM_CHUNK];
    __shared__ float inv_s;
    float *xr = x + (int64_t)blockIdx.x * n;
    unsigned t = threadIdx.x;
    float mx = -INFINITY;
    for (int64_t i = t; i < n; i += blockDim.x)
        if (xr[i] > mx) mx = xr[i];
    mx_t[t] = mx;
    __syncthreads();
    mx = -INFINITY;
    for (unsigned i = 0; i < blockDim.x; i++)
        if (mx_t[i] > mx) mx = mx_t[i];
    double sum = 0.0; /* thread 0's */
    for (int64_t c0 = 0; c0 < n; c0 += SM_CHUNK) {
        int cl = n - c0 < SM_CHUNK ? (int)(n - c0) : SM_CHUNK;
        for (int i = (int)t; i < cl; i += (int)blockDim.x) {
            float e = expf(xr[c0 + i] - mx);
            xr[c0 + i] = e;
            ex[i] = e;
        }
        __syncthreads();
        if (t == 0) {
            int i = 0;
            for (; i + 8 <= cl; i += 8) {
                float e8[8];
                for (int u = 0; u < 8; u++) e8[u] = ex[i + u];
                for (int u = 0; u < 8; u++) sum += e8[u];
            }
            for (; i < cl; i++) sum += ex[i];
        }
        __syncthreads();
    }
    if (t == 0) inv_s = (float)(1.0 / sum);
    __syncthreads();
    float inv = inv_s;
    for (int64_t i = t; i < n; i += blockDim.x) xr[i] = xr[i] * inv;
}

void kcu_softmax(kn_stream *s, float *x, int64_t m, int64_t n) {
    if (m == 0) return;
    KN_LAUNCH(k_softmax, dim3((unsigned)m), dim3(KCU_THREADS), st(s), x, n);
    launched(s);
}

/* (v, i) beats (bv, bi): NaN never wins, larger wins, then lower index. */
static KN_HD bool am_better(float v, int64_t i, float bv, int64_t bi) {
    if (v != v || i < 0) return false;
    if (bi < 0) return true;
    return v > bv || (v == bv && i < bi);
}

/* Row blockIdx.x in ns slices (blockIdx.y), each scanned by a block with
 * four loads in flight per thread, then reduced in shared memory: the
 * best (value, index) of its slice into pv/pi, or with one slice the
 * answer into out. "Better" is a total order on non-NaN values (larger,
 * then lower index), so the split changes no result; k_argmax_fin takes
 * the best of the slices. */
#define AM_SLICES 32
__global__ void __launch_bounds__(KCU_THREADS) k_argmax_part(const float *x, int64_t n, int ns, float *pv, int32_t *pi,
                                                              int32_t *out) {
    __shared__ float bv_t[KCU_THREADS];
    __shared__ int64_t bi_t[KCU_THREADS];
    const float *xr = x + (int64_t)blockIdx.x * n;
    unsigned t = threadIdx.x, B = blockDim.x;
    int64_t per = (n + ns - 1) / ns, lo = (int64_t)blockIdx.y * per;
    int64_t hi = lo + per < n ? lo + per : n;
    float bv = 0.0f;
    int64_t bi = -1;
    for (int64_t i = lo + t; i < hi; i += 4 * (int64_t)B) {
        float v[4];
        for (int u = 0; u < 4; u++) v[u] = i + u * (int64_t)B < hi ? xr[i + u * (int64_t)B] : NAN;
        for (int u = 0; u < 4; u++)
            if (am_better(v[u], i + u * (int64_t)B, bv, bi)) {
                bv = v[u];
                bi = i + u * (int64_t)B;
            }
    }
    bv_t[t] = bv;
    bi_t[t] = bi;
    __syncthreads();
    for (unsigned w = B / 2; w > 0; w /= 2) {
        if (t < w && am_better(bv_t[t + w], bi_t[t + w], bv_t[t], bi_t[t])) {
            bv_t[t] = bv_t[t + w];
            bi_t[t] = bi_t[t + w];
        }
        __syncthreads();
    }
    if (t == 0 && ns == 1) {
        out[blockIdx.x] = bi_t[0] < 0 ? 0 : (int32_t)bi_t[0]; /* a row of NaN: 0, as the CPU's */
    } else if (t == 0) {
        pv[blockIdx.x * ns + blockIdx.y] = bv_t[0];
        pi[blockIdx.x * ns + blockIdx.y] = (int32_t)bi_t[0];
    }
}

__global__ void k_argmax_fin(const float *pv, const int32_t *pi, int32_t *out) {
    float bv = 0.0f;
    int64_t bi = -1;
    for (int j = 0; j < AM_SLICES; j++) {
        int64_t at = (int64_t)blockIdx.x * AM_SLICES + j;
        if (am_better(pv[at], pi[at], bv, bi)) {
            bv = pv[at];
            bi = pi[at];
        }
    }
    out[blockIdx.x] = bi < 0 ? 0 : (int32_t)bi; /* a row of NaN: 0, as the CPU's */
}

/* The slices' partial results go in the stream's workspace; a stream with
 * too little for them scans each row with one block. */
void kcu_argmax(kn_stream *s, const float *x, int32_t *out, int64_t m, int64_t n) {
    if (m == 0) return;
    KCU_ASSERT((KCU_THREADS & (KCU_THREADS - 1)) == 0); /* the reduction tree halves */
    size_t part = (size_t)m * AM_SLICES;
    if (part * (sizeof(float) + sizeof(int32_t)) > KN_CU(s)->work_bytes) {
        KN_LAUNCH(k_argmax_part, dim3((unsigned)m, 1), dim3(KCU_THREADS), st(s), x, n, 1, (float *)NULL,
                  (int32_t *)NULL, out);
        launched(s);
        return;
    }
    float *pv = (float *)KN_CU(s)->work;
    int32_t *pi = (int32_t *)(void *)(pv + part);
    KN_LAUNCH(k_argmax_part, dim3((unsigned)m, AM_SLICES), dim3(KCU_THREADS), st(s), x, n, AM_SLICES, pv, pi,
              (int32_t *)NULL);
    launched(s);
    KN_LAUNCH(k_argmax_fin, dim3((unsigned)m), dim3(1), st(s), pv, pi, out);
    launched(s);
}

/* ---- top-k ----------------------------------------------------------------- */

/* (a, ia) before (b, ib): larger first, then the lower index. */
static __device__ __forceinline__ bool tk_before(float a, int32_t ia, float b, int32_t ib) {
    return a > b || (a == b && ia < ib);
}

/* The best k (value, index) pairs of one row, by one block: each thread
 * keeps the best k of its stride of the row, sorted; then halving rounds
 * merge pairs of lists in shared memory (sv, si: [KCU_THREADS][k]), and
 * list 0 holds the result. A selection under one total order (value,
 * then index), so any split gives the CPU's result. Unfilled places hold
 * (-inf, INT32_MAX), after every real element. V: the value of element
 * i (NaN mapped to -inf by the caller). */
template <class V>
static __device__ void tk_select(const V &value_of, int64_t n, int k, float (*sv)[KN_TOPK_MAX],
                                 int32_t (*si)[KN_TOPK_MAX]) {
    const unsigned tid = threadIdx.x;
    float *v = sv[tid];
    int32_t *id = si[tid];
    for (int j = 0; j < k; j++) v[j] = -INFINITY, id[j] = INT32_MAX;
    for (int64_t i = tid; i < n; i += KCU_THREADS) {
        float a = value_of(i);
        if (!tk_before(a, (int32_t)i, v[k - 1], id[k - 1])) continue;
        int j = k - 1;
        for (; j > 0 && tk_before(a, (int32_t)i, v[j - 1], id[j - 1]); j--) {
            v[j] = v[j - 1];
            id[j] = id[j - 1];
        }
        v[j] = a;
        id[j] = (int32_t)i;
    }
    __syncthreads();
    for (unsigned half = KCU_THREADS / 2; half > 0; half /= 2) {
        float mv[KN_TOPK_MAX];
        int32_t mi[KN_TOPK_MAX];
        if (tid < half) {
            const float *b = sv[tid + half];
            const int32_t *ib = si[tid + half];
            for (int j = 0, p = 0, q = 0; j < k; j++) {
                bool left = tk_before(v[p], id[p], b[q], ib[q]);
                mv[j] = left ? v[p] : b[q];
                mi[j] = left ? id[p] : ib[q];
                p += left, q += !left;
            }
        }
        __syncthreads();
        if (tid < half)
            for (int j = 0; j < k; j++) v[j] = mv[j], id[j] = mi[j];
        __syncthreads();
    }
}

/* A row's values as they are, NaN as -inf. */
struct tk_raw {
    const float *row;
    __device__ float operator()(int64_t i) const {
        float a = row[i];
        return a != a ? -INFINITY : a;
    }
};

__global__ void __launch_bounds__(KCU_THREADS) k_topk(const float *x, int64_t n, int32_t k, int32_t *idx,
                                                      float *val) {
    __shared__ float sv[KCU_THREADS][KN_TOPK_MAX];
    __shared__ int32_t si[KCU_THREADS][KN_TOPK_MAX];
    tk_raw raw = {x + (int64_t)blockIdx.x * n};
    tk_select(raw, n, k, sv, si);
    if (threadIdx.x < (unsigned)k) {
        idx[(int64_t)blockIdx.x * k + threadIdx.x] = si[0][threadIdx.x];
        val[(int64_t)blockIdx.x * k + threadIdx.x] = sv[0][threadIdx.x];
    }
}

/* ---- sampling ------------------------------------------------------------ */

/* Block reductions over KCU_THREADS values in shared memory, halving;
 * the same result in any order (max, integer sum, a least pair). The
 * caller's every thread reaches them. */
static __device__ float br_max(float v, float *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned h = KCU_THREADS / 2; h > 0; h /= 2) {
        if (threadIdx.x < h && sh[threadIdx.x + h] > sh[threadIdx.x]) sh[threadIdx.x] = sh[threadIdx.x + h];
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

static __device__ int64_t br_sum(int64_t v, int64_t *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned h = KCU_THREADS / 2; h > 0; h /= 2) {
        if (threadIdx.x < h) sh[threadIdx.x] += sh[threadIdx.x + h];
        __syncthreads();
    }
    int64_t r = sh[0];
    __syncthreads();
    return r;
}

/* The least (key, index), lower index first among equal keys; index -1:
 * none. */
static __device__ int32_t br_least(uint32_t key, int32_t at, uint32_t *kh, int32_t *ih) {
    kh[threadIdx.x] = key;
    ih[threadIdx.x] = at;
    __syncthreads();
    for (unsigned h = KCU_THREADS / 2; h > 0; h /= 2) {
        if (threadIdx.x < h) {
            uint32_t k2 = kh[threadIdx.x + h];
            int32_t i2 = ih[threadIdx.x + h];
            if (i2 >= 0 && (ih[threadIdx.x] < 0 || k2 < kh[threadIdx.x] || (k2 == kh[threadIdx.x] && i2 < ih[threadIdx.x]))) {
                kh[threadIdx.x] = k2;
                ih[threadIdx.x] = i2;
            }
        }
        __syncthreads();
    }
    int32_t r = ih[0];
    __syncthreads();
    return r;
}

/* A row's scores s = (x - lmax) / t, the finite ones; the others -inf
 * (not kept, and below every kept score). */
struct tk_scores {
    const float *row;
    float lmax, t;
    __device__ float operator()(int64_t i) const {
        float l = row[i];
        if (!isfinite(l)) return -INFINITY;
        float sc = (l - lmax) / t;
        return isfinite(sc) ? sc : -INFINITY;
    }
};

/* One block a row: sample.c's kept_set and race without top-p, step by
 * step in the same f32 operations. Greedy (temperature <= 0), and a row
 * with no finite logit or score, take kn_argmax's pick. */
__global__ void __launch_bounds__(KCU_THREADS) k_sample(const float *x, int64_t n, const kn_draw *draws,
                                                        int32_t *out) {
    __shared__ float sv[KCU_THREADS][KN_TOPK_MAX];
    __shared__ int32_t si[KCU_THREADS][KN_TOPK_MAX];
    __shared__ float fsh[KCU_THREADS];
    __shared__ int64_t nsh[KCU_THREADS];
    __shared__ uint32_t ksh[KCU_THREADS];
    __shared__ int32_t ish[KCU_THREADS];
    const kn_draw d = draws[blockIdx.x];
    const float *row = x + (int64_t)blockIdx.x * n;
    const unsigned tid = threadIdx.x;
    /* the largest finite logit, and the greedy pick: the largest value,
     * NaN never, the lowest index among equal ones (as keys: the bits of
     * -v order as -v does only for one sign, so compare as floats) */
    float lmax_t = -INFINITY, best = 0.0f;
    int32_t best_i = -1;
    for (int64_t i = tid; i < n; i += KCU_THREADS) {
        float l = row[i];
        if (isfinite(l) && l > lmax_t) lmax_t = l;
        if (l == l && (best_i < 0 || l > best)) best = l, best_i = (int32_t)i;
    }
    const float lmax = br_max(lmax_t, fsh);
    /* the greedy pick's reduction: among the threads' picks, the largest,
     * then the lowest index */
    fsh[tid] = best;
    ish[tid] = best_i;
    __syncthreads();
    for (unsigned h = KCU_THREADS / 2; h > 0; h /= 2) {
        if (tid < h) {
            float v2 = fsh[tid + h];
            int32_t i2 = ish[tid + h];
            if (i2 >= 0 && (ish[tid] < 0 || v2 > fsh[tid] || (v2 == fsh[tid] && i2 < ish[tid]))) {
                fsh[tid] = v2;
                ish[tid] = i2;
            }
        }
        __syncthreads();
    }
    const int32_t greedy = ish[0] < 0 ? 0 : ish[0];
    __syncthreads();
    if (!(d.temperature > 0.0f) || lmax == -INFINITY) {
        if (tid == 0) out[blockIdx.x] = greedy;
        return; /* the same in every thread */
    }
    /* 1. temperature: the kept scores, their count and their largest */
    const tk_scores sc = {row, lmax, d.temperature};
    float smax_t = -INFINITY;
    int64_t n_t = 0;
    for (int64_t i = tid; i < n; i += KCU_THREADS) {
        float v = sc(i);
        if (v == -INFINITY) continue;
        n_t++;
        if (v > smax_t) smax_t = v;
    }
    const int64_t n_fin = br_sum(n_t, nsh);
    const float smax = br_max(smax_t, fsh);
    if (n_fin == 0) {
        if (tid == 0) out[blockIdx.x] = greedy;
        return;
    }
    /* 2. top-k: everything >= the k-th largest score */
    float kth = -INFINITY;
    if (d.top_k > 0 && d.top_k < n_fin) {
        tk_select(sc, n, d.top_k, sv, si);
        kth = sv[0][d.top_k - 1];
    }
    /* (3. top-p: not on the device.) 4. min-p, and the race: the least
     * E / w over the kept tokens */
    const float min_p = d.min_p > 1.0f ? 1.0f : d.min_p > 0.0f ? d.min_p : 0.0f;
    uint32_t best_key = 0;
    int32_t at_t = -1;
    for (int64_t i = tid; i < n; i += KCU_THREADS) {
        float v = sc(i);
        if (v == -INFINITY || v < kth) continue;
        float w = expf(v - smax);
        if (w < min_p) continue;
        uint32_t key = kn_draw_f32_bits(kn_draw_exp(kn_draw_bits(d.key_lo, d.key_hi, (uint32_t)i)) / w);
        if (at_t < 0 || key < best_key) best_key = key, at_t = (int32_t)i;
    }
    int32_t won = br_least(best_key, at_t, ksh, ish);
    if (tid == 0) out[blockIdx.x] = won < 0 ? greedy : won;
}

void kcu_sample(kn_stream *s, const float *x, int64_t m, int64_t n, const kn_draw *draws, int32_t *out) {
    if (m == 0) return;
    KCU_ASSERT(m <= INT32_MAX);
    KN_LAUNCH(k_sample, dim3((unsigned)m), dim3(KCU_THREADS), st(s), x, n, draws, out);
    launched(s);
}

void kcu_topk(kn_stream *s, const float *x, int64_t m, int64_t n, int32_t k, int32_t *idx, float *val) {
    if (m == 0) return;
    KCU_ASSERT((KCU_THREADS & (KCU_THREADS - 1)) == 0 && m <= INT32_MAX); /* the merge halves */
    KN_LAUNCH(k_topk, dim3((unsigned)m), dim3(KCU_THREADS), st(s), x, n, k, idx, val);
    launched(s);
}

/* ---- weights ------------------------------------------------------------ */

/* What a kernel needs of a kn_weight. */
struct kw {
    const uint8_t *data;
    size_t row_bytes;
    int64_t rows, cols;
    int type;
};

static kw kw_of(const kn_weight *w) {
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

/* Element i of weight row `row`, as quant_dequantize gives it. */
static __device__ float w_elem(const kw &w, int64_t row, int64_t i) {
    const uint8_t *r = w.data + (size_t)row * w.row_bytes;
    switch (w.type) {
    case GGML_TYPE_F32: {
        float f;
        memcpy(&f, r + 4 * i, sizeof f);
        return f;
    }
    case GGML_TYPE_F16: return half_to_f32(ld16(r + 2 * i));
    case GGML_TYPE_BF16: return bf16_to_f32(ld16(r + 2 * i));
    case GGML_TYPE_Q8_0: {
        const uint8_t *b = r + (size_t)(i / KCU_QK) * 34;
        return (float)(int8_t)b[2 + i % KCU_QK] * half_to_f32(ld16(b));
    }
    case GGML_TYPE_Q4_0: {
        const uint8_t *b = r + (size_t)(i / KCU_QK) * 18;
        int j = (int)(i % KCU_QK);
        int q = j < 16 ? b[2 + j] & 15 : b[2 + j - 16] >> 4;
        return (float)(q - 8) * half_to_f32(ld16(b));
    }
    case GGML_TYPE_Q4_1: {
        const uint8_t *b = r + (size_t)(i / KCU_QK) * 20;
        int j = (int)(i % KCU_QK);
        int q = j < 16 ? b[4 + j] & 15 : b[4 + j - 16] >> 4;
        float v = (float)q * half_to_f32(ld16(b));
        return v + half_to_f32(ld16(b + 2));
    }
    default: return NAN;
    }
}

cudaError_t kcu_image_check(void) {
#ifdef KN_CUDA_SHIM
    return cudaSuccess;
#else
    cudaFuncAttributes a;
    return cudaFuncGetAttributes(&a, k_add);
#endif
}

bool kcu_supports(kn_op op, ggml_type type) {
    switch (op) {
    case KN_OP_MATMUL:
    case KN_OP_EMBED:
        return type == GGML_TYPE_F32 || type == GGML_TYPE_F16 || type == GGML_TYPE_BF16 || type == GGML_TYPE_Q8_0 ||
               type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q4_1;
    case KN_OP_KV: return type == GGML_TYPE_F16;
    case KN_OP_F32: return type == GGML_TYPE_F32;
    case KN_OP_LATENT: /* MLA and MoE kernels come with the DeepSeek-V3 CUDA work */
    case KN_OP_MOE: return false;
    }
    return false;
}

/* ---- embedding ------------------------------------------------------------ */

__global__ void k_embed(kw table, const int32_t *ids, float *out, int64_t m) {
    for (int64_t i = flat_start(); i < m * table.cols; i += flat_step()) {
        int64_t t = i / table.cols, c = i % table.cols;
        int32_t id = ids[t];
        /* the engine checked every id; a bad one would read outside */
        out[i] = id >= 0 && id < table.rows ? w_elem(table, id, c) : NAN;
    }
}

void kcu_embed(kn_stream *s, const kn_weight *table, const int32_t *ids, float *out, int64_t m) {
    if (m == 0) return;
    KN_LAUNCH(k_embed, flat_grid(m * table->cols), dim3(KCU_THREADS), st(s), kw_of(table), ids, out, m);
    launched(s);
}

/* ---- float matmul ----------------------------------------------------------- */

#define MM_ROWS 32 /* weight rows per block; 8 lanes each */
#define MM_TILE 8  /* rows of x per block */

#define MF_CB 512 /* bytes of a weight row per chunk: 128 f32 or 256 f16/bf16 */
#define MF_PAD 16 /* after each row in shared memory: the 4 rows a warp reads fall in other banks */

template <int T> static __device__ float mf_elem(const uint8_t *p, int64_t i) {
    if (T == GGML_TYPE_F32) {
        float f;
        memcpy(&f, p + 4 * i, sizeof f);
        return f;
    }
    uint16_t h = (uint16_t)ld16a(p + 2 * i);
    return T == GGML_TYPE_F16 ? half_to_f32(h) : bf16_to_f32(h);
}

/* y[r][j] for weight rows blockIdx.x * 32 .. and x rows blockIdx.y * 8 ..:
 * lane l of row j is the chain acc = fma(x[i], w[i], acc) over
 * i = 8j' + l, then lane 0 adds the lanes' tree and the tail, the CPU's
 * order. The rows and x pass through shared memory a chunk at a time,
 * loaded by the whole block in 16-byte pieces where the rows are aligned
 * to 16 bytes (else element by element), so that each load is wide and
 * coalesced while each lane still takes its own elements in order. */
template <int T> __global__ void __launch_bounds__(256) k_matmul_f(kw w, const float *x, float *y, int64_t m) {
    alignas(16) __shared__ uint8_t ws[MM_ROWS][MF_CB + MF_PAD];
    __shared__ float xs[MM_TILE][MF_CB / 2];
    __shared__ float red[MM_TILE][MM_ROWS][8];
    const int es = T == GGML_TYPE_F32 ? 4 : 2, ce = MF_CB / es; /* elements per chunk */
    unsigned tid = threadIdx.x, l = tid % 8, jr = tid / 8;
    int64_t j0 = (int64_t)blockIdx.x * MM_ROWS, j = j0 + jr, r0 = (int64_t)blockIdx.y * MM_TILE;
    int tm = m - r0 < MM_TILE ? (int)(m - r0) : MM_TILE;
    int nr = w.rows - j0 < MM_ROWS ? (int)(w.rows - j0) : MM_ROWS;
    int64_t k = w.cols, k8 = k / 8 * 8;
    bool live = j < w.rows;
    bool vec = (uintptr_t)w.data % 16 == 0 && w.row_bytes % 16 == 0;
    float acc[MM_TILE];
    for (int r = 0; r < MM_TILE; r++) acc[r] = 0.0f;
    for (int64_t c0 = 0; c0 < k8; c0 += ce) {
        int cl = k8 - c0 < ce ? (int)(k8 - c0) : ce; /* a multiple of 8 */
        int cb = cl * es;                             /* a multiple of 16 */
        if (vec) {
            for (int u = (int)tid; u < nr * (cb / 16); u += (int)blockDim.x) {
                int rr = u / (cb / 16), o = u % (cb / 16) * 16;
                const uint8_t *src = w.data + (size_t)(j0 + rr) * w.row_bytes + (size_t)c0 * es + o;
#ifdef KN_CUDA_SHIM
                memcpy(&ws[rr][o], src, 16);
#else
                *(uint4 *)(void *)&ws[rr][o] = *(const uint4 *)(const void *)src;
#endif
            }
        } else {
            for (int u = (int)tid; u < nr * cb; u += (int)blockDim.x) {
                int rr = u / cb, o = u % cb;
                ws[rr][o] = w.data[(size_t)(j0 + rr) * w.row_bytes + (size_t)c0 * es + o];
            }
        }
        for (int u = (int)tid; u < tm * cl; u += (int)blockDim.x) xs[u / cl][u % cl] = x[(r0 + u / cl) * k + c0 + u % cl];
        __syncthreads();
        if (live)
            for (int i = (int)l; i < cl; i += 8) {
                float wv = mf_elem<T>(ws[jr], i);
                for (int r = 0; r < tm; r++) acc[r] = fmaf(xs[r][i], wv, acc[r]);
            }
        __syncthreads();
    }
    for (int r = 0; r < MM_TILE; r++) red[r][jr][l] = acc[r];
    __syncthreads();
    if (live && l == 0)
        for (int r = 0; r < tm; r++) {
            const float *a = red[r][jr];
            float s04 = a[0] + a[4], s15 = a[1] + a[5], s26 = a[2] + a[6], s37 = a[3] + a[7];
            float lo = s04 + s26, hi = s15 + s37;
            float sum = lo + hi;
            for (int64_t i = k8; i < k; i++)
                sum = fmaf(x[(r0 + r) * k + i], mf_elem<T>(w.data + (size_t)j * w.row_bytes, i), sum);
            y[(r0 + r) * w.rows + j] = sum;
        }
}

/* ---- quantized matmul -------------------------------------------------------- */

/* x rounded per block of 32 (kernels.h, "quantized W"), in the stream's
 * workspace: for each row of x, xi as int16[k], then sx[nb], xs[nb]
 * (f32) and isx[nb] (int32): kn_matmul_workspace's bytes exactly. */
struct qxrow {
    int16_t *xi;
    float *sx, *xs;
    int32_t *isx;
};

static KN_HD size_t qx_row_bytes(int64_t k) { return (size_t)(k / KCU_QK) * (2 * KCU_QK + 12); }

static KN_HD qxrow qx_at(void *work, int64_t k, int64_t r) {
    uint8_t *b = (uint8_t *)work + (size_t)r * qx_row_bytes(k);
    int64_t nb = k / KCU_QK;
    qxrow q;
    q.xi = (int16_t *)(void *)b;
    q.sx = (float *)(void *)(b + 2 * k);
    q.xs = q.sx + nb;
    q.isx = (int32_t *)(void *)(q.xs + nb);
    return q;
}

/* Row blockIdx.x, block blockIdx.y, one element per thread (32). Rows go
 * on x: a prefill chunk may hold more tokens than grid y's 65535. */
__global__ void k_qx(const float *x, int64_t k, int lim, void *work) {
    __shared__ float ax[KCU_QK];
    __shared__ int32_t xv[KCU_QK];
    __shared__ float inv_s;
    __shared__ int state; /* 0 zero, 1 finite, 2 not finite */
    int64_t r = blockIdx.x, b = blockIdx.y;
    unsigned i = threadIdx.x;
    qxrow q = qx_at(work, k, r);
    float xv_f = x[r * k + b * KCU_QK + i];
    ax[i] = fabsf(xv_f);
    __syncthreads();
    if (i == 0) {
        float amax = 0.0f;
        bool finite = true;
        for (int j = 0; j < KCU_QK; j++) {
            float a = ax[j];
            finite = finite && a <= 3.40282347e+38f;
            amax = a > amax ? a : amax;
        }
        if (!finite || amax < 0x1p-100f) {
            state = finite ? 0 : 2;
            q.sx[b] = finite ? 0.0f : NAN;
        } else {
            state = 1;
            inv_s = (float)lim / amax;
            q.sx[b] = amax / (float)lim;
        }
    }
    __syncthreads();
    int32_t v = 0;
    if (state == 1) {
        float t = xv_f * inv_s;
        v = (int32_t)((t + 12582912.0f) - 12582912.0f);
        v = v > lim ? lim : v < -lim ? -lim : v;
    }
    q.xi[b * KCU_QK + i] = (int16_t)v;
    xv[i] = v;
    __syncthreads();
    if (i == 0) {
        int32_t sum = 0;
        for (int j = 0; j < KCU_QK; j++) sum += xv[j];
        q.isx[b] = sum;
        q.xs[b] = q.sx[b] * (float)sum;
    }
}

#define QW 4 /* weight rows (warps) per block */

/* Lane (sl, qt)'s quarter of blocks g + sl + 8u (u < 4) of a quantized
 * row, and the scales (d, and m for Q4_1) of block g + lane. */
static __device__ void qload(const kw &w, const uint8_t *row, size_t bb, bool live, bool q8, bool q41, int64_t g,
                             int64_t nb, unsigned sl, unsigned qt, unsigned lane, uint32_t *wa, uint32_t *wb,
                             unsigned *have, float *d, float *mm) {
    *have = 0;
    for (int u = 0; u < 4; u++) {
        int64_t b = g + sl + 8 * u;
        wa[u] = wb[u] = 0;
        if (!live || b >= nb) continue;
        *have |= 1u << u;
        const uint8_t *blk = row + (size_t)b * bb;
        if (q8) { /* qs[8q .. 8q+7], 2-byte aligned */
            const uint8_t *p = blk + 2 + 8 * qt;
            wa[u] = ld16a(p) | ld16a(p + 2) << 16;
            wb[u] = ld16a(p + 4) | ld16a(p + 6) << 16;
        } else if (q41) { /* qs[4q .. 4q+3], 4-byte aligned */
            wa[u] = ld32a(blk + 4 + 4 * qt);
        } else {
            const uint8_t *p = blk + 2 + 4 * qt;
            wa[u] = ld16a(p) | ld16a(p + 2) << 16;
        }
    }
    if (live && g + lane < nb) {
        const uint8_t *blk = row + (size_t)(g + lane) * bb;
        *d = half_to_f32((uint16_t)ld16a(blk));
        *mm = q41 ? half_to_f32((uint16_t)ld16a(blk + 2)) : 0.0f;
    }
}

/* Weight row blockIdx.x * 4 + warp against x rows blockIdx.y * 8 .., in
 * groups of 32 blocks. First the exact integer sums, four lanes to a
 * block: lane L takes quarter L % 4 of blocks g + L / 4 + 8u (u < 4),
 * all four blocks' weights loaded before any arithmetic, and the block's
 * first lane adds the quarters through shared memory (integers: any order
 * gives the same sum; shared memory rather than shuffles, which the CPU
 * shim can only make block-wide barriers).
 * Then lane r chains row r's terms of the group in block order:
 * acc = fma(isum, d * sx, acc) and, for Q4_1, acc = fma(m, xs, acc), the
 * CPU's order exactly. Weight rows are 2-byte aligned (4 for Q4_1), and
 * x's rows (76 bytes a block in the workspace) 4. */
__global__ void __launch_bounds__(128) k_matmul_q(kw w, void *work, float *y, int64_t m) {
    __shared__ int32_t isum[QW][MM_TILE][32], qpart[QW][4][32];
    __shared__ float dq[QW][32], mq[QW][32], sxs[QW][MM_TILE][32], xss[QW][MM_TILE][32];
    unsigned lane = threadIdx.x % 32, wp = threadIdx.x / 32, qt = lane % 4, sl = lane / 4;
    int64_t j = (int64_t)blockIdx.x * QW + wp, r0 = (int64_t)blockIdx.y * MM_TILE;
    int tm = m - r0 < MM_TILE ? (int)(m - r0) : MM_TILE;
    int64_t k = w.cols, nb = k / KCU_QK;
    bool live = j < w.rows, q8 = w.type == GGML_TYPE_Q8_0, q41 = w.type == GGML_TYPE_Q4_1;
    size_t bb = q8 ? 34 : q41 ? 20 : 18;
    const uint8_t *row = w.data + (size_t)(live ? j : 0) * w.row_bytes;
    float acc = 0.0f;
    /* group g's weights in wa/wb (have: which blocks exist) and this lane's block scale in dl/ml;
     * the next group's are loaded before this one's arithmetic */
    uint32_t wa[4], wb[4], na[4] = {0, 0, 0, 0}, nbw[4] = {0, 0, 0, 0};
    unsigned have = 0, nhave = 0; /* bit u: block g + sl + 8u exists */
    float dl = 0.0f, ml = 0.0f, ndl = 0.0f, nml = 0.0f;
    qload(w, row, bb, live, q8, q41, 0, nb, sl, qt, lane, wa, wb, &have, &dl, &ml);
    for (int64_t g = 0; g < nb; g += 32) {
        if (g + 32 < nb) qload(w, row, bb, live, q8, q41, g + 32, nb, sl, qt, lane, na, nbw, &nhave, &ndl, &nml);
        if (live && g + lane < nb) {
            dq[wp][lane] = dl;
            mq[wp][lane] = ml;
        }
        for (int r = 0; r < tm; r++) { /* tm is the same in every lane: all reach the __syncwarp */
            qxrow xr = qx_at(work, k, r0 + r);
            if (g + lane < nb) {
                sxs[wp][r][lane] = xr.sx[g + lane];
                xss[wp][r][lane] = xr.xs[g + lane];
            }
            for (int u = 0; u < 4; u++) {
                int64_t b = g + sl + 8 * u;
                int32_t part = 0;
                if (have >> u & 1) {
                    const int16_t *xi = xr.xi + b * KCU_QK;
                    if (q8) {
                        uint32_t x0 = ld32a(xi + 8 * qt), x1 = ld32a(xi + 8 * qt + 2), x2 = ld32a(xi + 8 * qt + 4),
                                 x3 = ld32a(xi + 8 * qt + 6);
                        part = (int32_t)(int8_t)(wa[u] & 255) * lo16(x0) + (int32_t)(int8_t)(wa[u] >> 8 & 255) * hi16(x0) +
                               (int32_t)(int8_t)(wa[u] >> 16 & 255) * lo16(x1) + (int32_t)(int8_t)(wa[u] >> 24) * hi16(x1) +
                               (int32_t)(int8_t)(wb[u] & 255) * lo16(x2) + (int32_t)(int8_t)(wb[u] >> 8 & 255) * hi16(x2) +
                               (int32_t)(int8_t)(wb[u] >> 16 & 255) * lo16(x3) + (int32_t)(int8_t)(wb[u] >> 24) * hi16(x3);
                    } else {
                        uint32_t l0 = ld32a(xi + 4 * qt), l1 = ld32a(xi + 4 * qt + 2), h0 = ld32a(xi + 16 + 4 * qt),
                                 h1 = ld32a(xi + 16 + 4 * qt + 2), v = wa[u];
                        part = (int32_t)(v & 15) * lo16(l0) + (int32_t)(v >> 4 & 15) * lo16(h0) +
                               (int32_t)(v >> 8 & 15) * hi16(l0) + (int32_t)(v >> 12 & 15) * hi16(h0) +
                               (int32_t)(v >> 16 & 15) * lo16(l1) + (int32_t)(v >> 20 & 15) * lo16(h1) +
                               (int32_t)(v >> 24 & 15) * hi16(l1) + (int32_t)(v >> 28) * hi16(h1);
                    }
                }
                qpart[wp][u][lane] = part;
            }
            __syncwarp();
            if (qt == 0)
                for (int u = 0; u < 4; u++)
                    if (have >> u & 1) {
                        const int32_t *pq = &qpart[wp][u][lane];
                        int32_t sum = (pq[0] + pq[1]) + (pq[2] + pq[3]);
                        if (w.type == GGML_TYPE_Q4_0) sum -= 8 * xr.isx[g + sl + 8 * u];
                        isum[wp][r][sl + 8 * u] = sum;
                    }
            __syncwarp();
        }
        __syncwarp();
        if (live && lane < (unsigned)tm) {
            int64_t cnt = nb - g < 32 ? nb - g : 32;
            for (int64_t L = 0; L < cnt; L++) {
                float dsx = dq[wp][L] * sxs[wp][lane][L];
                acc = fmaf((float)isum[wp][lane][L], dsx, acc);
                if (q41) acc = fmaf(mq[wp][L], xss[wp][lane][L], acc);
            }
        }
        __syncwarp();
        for (int u = 0; u < 4; u++) {
            wa[u] = na[u];
            wb[u] = nbw[u];
        }
        have = nhave;
        dl = ndl;
        ml = nml;
    }
    if (live && lane < (unsigned)tm) y[(r0 + lane) * w.rows + j] = acc;
}

/* ---- quantized matmul on tensor cores (verify and prefill) ------------------- */

/* D = A B + C over one warp, with A 16 x 32 and B 32 x 8 signed bytes and
 * C, D 16 x 8 int32: mma.m16n8k32 with .s8 operands, whose fragments the
 * PTX ISA lays out so (g = lane / 4, t = lane % 4; byte i of a register
 * is element i of its run of four):
 *   A, row-major: a[0] row g, columns 4t .. 4t+3; a[1] row g+8, the same
 *     columns; a[2] row g, columns 16+4t ..; a[3] row g+8, columns 16+4t ..
 *   B, column-major: b[0] rows 4t .. 4t+3 of column g; b[1] rows 16+4t ..
 *   C and D: c[0], c[1] row g, columns 2t, 2t+1; c[2], c[3] row g+8.
 * The sums are of integers, exact in any order, so the tensor cores give
 * the same bits as any other way. From sm_80 on it is the one instruction
 * (every target of the build is); elsewhere, the CPU shim included, the
 * same product through shared memory, laid out as above: the shim's run
 * checks the kernel's fragments against this layout, and a GPU's run
 * checks the layout against the hardware (tests/gpu/UNRUN.md). Every lane
 * of the warp calls it. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define KCU_MMA_S8 1
#endif
/* Warps per block of k_matmul_qmma, 16 weight rows each: one, so that a
 * verify pass's 1024-row K and V projections of an 8B model still make
 * 64 blocks, and its 4096-row ones 256 (an H200 has 132 SMs). */
#define QM_WARPS 1
#define QM_TILES 4 /* its tiles of 8 rows of x per block */
static __device__ __forceinline__ void mma_s8(const uint32_t a[4], const uint32_t b[2], int32_t c[4]) {
#ifdef KCU_MMA_S8
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __shared__ int8_t sa[QM_WARPS][16][32], sb[QM_WARPS][8][32]; /* sb: [column][row] */
    unsigned lane = threadIdx.x % 32, w = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    for (unsigned i = 0; i < 4; i++) {
        sa[w][g][4 * t + i] = (int8_t)(uint8_t)(a[0] >> 8 * i);
        sa[w][g + 8][4 * t + i] = (int8_t)(uint8_t)(a[1] >> 8 * i);
        sa[w][g][16 + 4 * t + i] = (int8_t)(uint8_t)(a[2] >> 8 * i);
        sa[w][g + 8][16 + 4 * t + i] = (int8_t)(uint8_t)(a[3] >> 8 * i);
        sb[w][g][4 * t + i] = (int8_t)(uint8_t)(b[0] >> 8 * i);
        sb[w][g][16 + 4 * t + i] = (int8_t)(uint8_t)(b[1] >> 8 * i);
    }
    __syncwarp();
    for (unsigned i = 0; i < 4; i++) {
        unsigned row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
        int32_t s = 0;
        for (int e = 0; e < 32; e++) s += (int32_t)sa[w][row][e] * (int32_t)sb[w][col][e];
        c[i] += s;
    }
    __syncwarp();
#endif
}

/* Four 16-bit integers of x (two words, low half first) as signed
 * bytes. Wide (15-bit) x is split as x = 128 hi + lo, hi = x >> 7 in
 * [-127, 127] and lo = x & 127, since |x| <= 16256 = 127 * 128; 8-bit x
 * (|x| <= 127) is its own bytes, in lo. */
static __device__ __forceinline__ void split_x(uint32_t w0, uint32_t w1, bool wide, uint32_t *hi, uint32_t *lo) {
    int32_t v[4] = {lo16(w0), hi16(w0), lo16(w1), hi16(w1)};
    uint32_t h = 0, l = 0;
    for (int i = 0; i < 4; i++) {
        h |= ((uint32_t)(v[i] >> 7) & 255u) << 8 * i;
        l |= ((uint32_t)v[i] & (wide ? 127u : 255u)) << 8 * i;
    }
    *hi = wide ? h : 0u;
    *lo = l;
}

/* Weight row `row`'s block b as this lane's two A registers (columns
 * 4t .. 4t+3 and 16+4t ..) and its scales; zeros for a row past the end.
 * Q4 nibbles are the A bytes as they are (0 .. 15), Q4_0's 8 taken off
 * afterwards through x's block sum, as the CPU does. */
static __device__ __forceinline__ void qm_load(const kw &w, const uint8_t *row, bool live, int64_t b, unsigned t,
                                               uint32_t *lo, uint32_t *hi, float *d, float *mm) {
    *lo = *hi = 0;
    *d = *mm = 0.0f;
    if (!live) return;
    if (w.type == GGML_TYPE_Q8_0) {
        const uint8_t *blk = row + (size_t)b * 34, *p = blk + 2 + 4 * t;
        *lo = ld16a(p) | ld16a(p + 2) << 16;
        *hi = ld16a(p + 16) | ld16a(p + 18) << 16;
        *d = half_to_f32((uint16_t)ld16a(blk));
    } else {
        bool q41 = w.type == GGML_TYPE_Q4_1;
        const uint8_t *blk = row + (size_t)b * (q41 ? 20 : 18);
        uint32_t v = q41 ? ld32a(blk + 4 + 4 * t) : ld16a(blk + 2 + 4 * t) | ld16a(blk + 4 + 4 * t) << 16;
        *lo = v & 0x0f0f0f0fu;
        *hi = v >> 4 & 0x0f0f0f0fu;
        *d = half_to_f32((uint16_t)ld16a(blk));
        *mm = q41 ? half_to_f32((uint16_t)ld16a(blk + 2)) : 0.0f;
    }
}

/* y for weight rows (blockIdx.x * QM_WARPS + warp) * 16 .. +15 and x rows
 * blockIdx.y * 32 .. +31, one quantized block (32 columns) at a time:
 * each block's exact integer sums for 16 weight rows by 8 x rows come
 * from mma_s8 (two for 15-bit x: hi and lo), and each lane chains its
 * four outputs' terms in block order, acc = fma(isum, d * sx, acc) and,
 * for Q4_1, acc = fma(m, xs, acc): the CPU's order, so k_matmul_q's bits,
 * with no scalar work per x row but the chain. `wide`: x has 15 bits (hi
 * and two mmas; else one). At most 85 registers a thread (24 blocks of
 * one warp an SM), where the pipelined loads would take 160. */
__global__ void __launch_bounds__(32 * QM_WARPS, 24) k_matmul_qmma(kw w, void *work, float *y, int64_t m, bool wide) {
    unsigned lane = threadIdx.x % 32, wp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    int64_t j0 = ((int64_t)blockIdx.x * QM_WARPS + wp) * 16, r0 = (int64_t)blockIdx.y * (8 * QM_TILES);
    int64_t k = w.cols, nb = k / KCU_QK, ja = j0 + g, jb = ja + 8;
    int nt = (int)((m - r0 + 7) / 8 < QM_TILES ? (m - r0 + 7) / 8 : QM_TILES); /* the same in the whole block */
    bool la = ja < w.rows, lb = jb < w.rows, q41 = w.type == GGML_TYPE_Q4_1, q40 = w.type == GGML_TYPE_Q4_0;
    const uint8_t *rowa = w.data + (size_t)(la ? ja : 0) * w.row_bytes, *rowb = w.data + (size_t)(lb ? jb : 0) * w.row_bytes;
    float acc[QM_TILES][4];
    for (int u = 0; u < QM_TILES; u++)
        for (int i = 0; i < 4; i++) acc[u][i] = 0.0f;
    /* block b's weights in a, d, mm; block b + 1's are loaded into na,
     * nd, nmm before b's arithmetic, to keep a load in flight */
    uint32_t a[4], na[4];
    float d[2], mm[2], nd[2], nmm[2];
    qm_load(w, rowa, la && nb > 0, 0, t, &na[0], &na[2], &nd[0], &nmm[0]);
    qm_load(w, rowb, lb && nb > 0, 0, t, &na[1], &na[3], &nd[1], &nmm[1]);
    for (int64_t b = 0; b < nb; b++) {
        for (int i = 0; i < 4; i++) a[i] = na[i];
        for (int i = 0; i < 2; i++) {
            d[i] = nd[i];
            mm[i] = nmm[i];
        }
        qm_load(w, rowa, la && b + 1 < nb, b + 1, t, &na[0], &na[2], &nd[0], &nmm[0]);
        qm_load(w, rowb, lb && b + 1 < nb, b + 1, t, &na[1], &na[3], &nd[1], &nmm[1]);
KCU_UNROLL
        for (int u = 0; u < QM_TILES; u++) { /* a constant count, so that acc stays in registers */
            if (u >= nt) break;
            /* B: x row r0 + 8u + g, this lane's columns of the block */
            int64_t rx = r0 + 8 * u + g;
            uint32_t bh[2] = {0, 0}, bl[2] = {0, 0};
            if (rx < m) {
                const int16_t *xi = qx_at(work, k, rx).xi + b * KCU_QK + 4 * t;
                split_x(ld32a(xi), ld32a(xi + 2), wide, &bh[0], &bl[0]);
                split_x(ld32a(xi + 16), ld32a(xi + 18), wide, &bh[1], &bl[1]);
            }
            int32_t ch[4] = {0, 0, 0, 0}, cl[4] = {0, 0, 0, 0};
            if (wide) mma_s8(a, bh, ch);
            mma_s8(a, bl, cl);
            for (int i = 0; i < 4; i++) {
                int64_t rc = r0 + 8 * u + 2 * t + (i & 1);
                if (rc >= m) continue;
                qxrow xc = qx_at(work, k, rc);
                int32_t isum = 128 * ch[i] + cl[i];
                if (q40) isum -= 8 * xc.isx[b];
                float dsx = d[i >> 1] * xc.sx[b];
                acc[u][i] = fmaf((float)isum, dsx, acc[u][i]);
                if (q41) acc[u][i] = fmaf(mm[i >> 1], xc.xs[b], acc[u][i]);
            }
        }
    }
KCU_UNROLL
    for (int u = 0; u < QM_TILES; u++)
        for (int i = 0; i < 4; i++) {
            int64_t rc = r0 + 8 * u + 2 * t + (i & 1), j = i < 2 ? ja : jb;
            if (rc < m && j < w.rows) y[rc * w.rows + j] = acc[u][i];
        }
}

static bool is_quant(ggml_type t) { return t == GGML_TYPE_Q8_0 || t == GGML_TYPE_Q4_0 || t == GGML_TYPE_Q4_1; }

static dim3 tile_grid(int64_t rows, int64_t per_block, int64_t m) {
    return dim3((unsigned)((rows + per_block - 1) / per_block), (unsigned)((m + MM_TILE - 1) / MM_TILE));
}

/* x rounded once for every quantized weight of the call. */
static void quantize_x(kn_stream *s, const float *x, int64_t k, int64_t m) {
    KCU_ASSERT((size_t)m * qx_row_bytes(k) <= KN_CU(s)->work_bytes);
    int lim = s->act_bits == 8 ? 127 : 16256;
    KN_LAUNCH(k_qx, dim3((unsigned)m, (unsigned)(k / KCU_QK)), dim3(KCU_QK), st(s), x, k, lim, KN_CU(s)->work);
    launched(s);
}

/* x rounded to the weights' 16-bit type, for cuBLAS (fast mode). */
template <ggml_type T> __global__ void k_round_x(const float *x, int64_t count, uint16_t *out) {
    for (int64_t i = flat_start(); i < count; i += flat_step())
        out[i] = T == GGML_TYPE_F16 ? f32_to_half(x[i]) : f32_to_bf16(x[i]);
}

/* Whether fast mode takes w (cuBLAS). */
static bool by_blas(const kn_stream *s, const kn_weight *w) {
    return s->fast && !is_quant(w->type) && w->row_bytes == (size_t)w->cols * (w->type == GGML_TYPE_F32 ? 4 : 2);
}

/* x_ready: the workspace holds x quantized by an earlier matmul of the
 * same x (kcu_matmul_n). */
static void matmul_one(kn_stream *s, const kn_weight *w, const float *x, float *y, int64_t m, bool x_ready) {
    if (by_blas(s, w)) {
        /* Fast mode: cuBLAS, x in the weights' type in the workspace
         * (2 bytes an element, within kn_matmul_workspace's). */
        const void *xt = x;
        if (w->type != GGML_TYPE_F32) {
            KCU_ASSERT((size_t)m * (size_t)w->cols * 2 <= KN_CU(s)->work_bytes);
            uint16_t *h = (uint16_t *)KN_CU(s)->work;
            if (w->type == GGML_TYPE_F16) KN_LAUNCH(k_round_x<GGML_TYPE_F16>, flat_grid(m * w->cols), dim3(KCU_THREADS), st(s), x, m * w->cols, h);
            else KN_LAUNCH(k_round_x<GGML_TYPE_BF16>, flat_grid(m * w->cols), dim3(KCU_THREADS), st(s), x, m * w->cols, h);
            launched(s);
            xt = h;
        }
        kcu_blas_gemm(s, w->type, w->data, xt, y, m, w->rows, w->cols);
        launched(s);
        return;
    }
    if (is_quant(w->type)) {
        size_t al = w->type == GGML_TYPE_Q4_1 ? 4 : 2; /* k_matmul_q's loads */
        KCU_ASSERT((uintptr_t)w->data % al == 0 && w->row_bytes % al == 0);
        if (!x_ready) quantize_x(s, x, w->cols, m);
        if (m == 1) {
            KN_LAUNCH(k_matmul_q, tile_grid(w->rows, QW, m), dim3(32 * QW), st(s), kw_of(w), KN_CU(s)->work, y, m);
        } else { /* verify and prefill: the tensor cores' integer sums */
            dim3 grid((unsigned)((w->rows + 16 * QM_WARPS - 1) / (16 * QM_WARPS)),
                      (unsigned)((m + 8 * QM_TILES - 1) / (8 * QM_TILES)));
            KN_LAUNCH(k_matmul_qmma, grid, dim3(32 * QM_WARPS), st(s), kw_of(w), KN_CU(s)->work, y, m,
                      s->act_bits != 8);
        }
    } else {
        dim3 grid = tile_grid(w->rows, MM_ROWS, m), block(8 * MM_ROWS);
        size_t al = w->type == GGML_TYPE_F32 ? 4 : 2; /* mf_elem's loads; the 16-byte path checks its own */
        KCU_ASSERT((uintptr_t)w->data % al == 0 && w->row_bytes % al == 0);
        if (w->type == GGML_TYPE_F32) KN_LAUNCH(k_matmul_f<GGML_TYPE_F32>, grid, block, st(s), kw_of(w), x, y, m);
        else if (w->type == GGML_TYPE_F16) KN_LAUNCH(k_matmul_f<GGML_TYPE_F16>, grid, block, st(s), kw_of(w), x, y, m);
        else KN_LAUNCH(k_matmul_f<GGML_TYPE_BF16>, grid, block, st(s), kw_of(w), x, y, m);
    }
    launched(s);
}

void kcu_matmul_n(kn_stream *s, int n, const kn_weight *const *w, const float *x, float *const *y, int64_t m) {
    if (m == 0) return;
    bool ready = false;
    for (int i = 0; i < n; i++) {
        matmul_one(s, w[i], x, y[i], m, ready);
        /* A quantized matmul leaves x quantized in the workspace; fast
         * mode's rounding of x for cuBLAS overwrites it. */
        if (is_quant(w[i]->type)) ready = true;
        else if (by_blas(s, w[i]) && w[i]->type != GGML_TYPE_F32) ready = false;
    }
}

void kcu_matmul_swiglu(kn_stream *s, const kn_weight *gate, const kn_weight *up, const float *x, float *y_gate,
                       float *y_up, int64_t m) {
    if (m == 0) return;
    const kn_weight *w[2] = {gate, up};
    float *y[2] = {y_gate, y_up};
    kcu_matmul_n(s, 2, w, x, y, m);
    kcu_swiglu(s, y_gate, y_up, y_gate, m * gate->rows);
}

/* ---- RoPE --------------------------------------------------------------------- */

struct rope_freqs {
    double inv_freq[KN_MAX_HEAD_DIM / 2];
};

__global__ void k_rope_table(rope_freqs f, int32_t head_dim, const int32_t *pos, int64_t m, float *cs) {
    int32_t half = head_dim / 2;
    for (int64_t i = flat_start(); i < m * half; i += flat_step()) {
        int64_t t = i / half;
        int32_t p = (int32_t)(i % half);
        double a = (double)pos[t] * f.inv_freq[p];
        cs[t * head_dim + 2 * p] = (float)cos(a);
        cs[t * head_dim + 2 * p + 1] = (float)sin(a);
    }
}

void kcu_rope_table(kn_stream *s, const kn_rope *r, const int32_t *pos, int64_t m, float *cs) {
    if (m == 0) return;
    rope_freqs f;
    memcpy(f.inv_freq, r->inv_freq, sizeof f.inv_freq);
    KN_LAUNCH(k_rope_table, flat_grid(m * (r->head_dim / 2)), dim3(KCU_THREADS), st(s), f, r->head_dim, pos, m, cs);
    launched(s);
}

__global__ void k_rope_rotate(int32_t head_dim, int adjacent, float *x, int64_t m, int32_t n_heads, const float *cs) {
    int32_t half = head_dim / 2;
    int stride = adjacent ? 2 : 1, other = adjacent ? 1 : half;
    for (int64_t i = flat_start(); i < m * n_heads * half; i += flat_step()) {
        int64_t th = i / half, t = th / n_heads;
        int32_t p = (int32_t)(i % half);
        float c = cs[t * head_dim + 2 * p], sn = cs[t * head_dim + 2 * p + 1];
        float *p0 = x + th * head_dim + p * stride, *p1 = p0 + other;
        float x0 = *p0, x1 = *p1;
        float a0 = x0 * c, b0 = x1 * sn;
        float a1 = x0 * sn, b1 = x1 * c;
        *p0 = a0 - b0;
        *p1 = a1 + b1;
    }
}

void kcu_rope_rotate(kn_stream *s, const kn_rope *r, float *x, int64_t m, int32_t n_heads, const float *cs) {
    if (m == 0) return;
    KN_LAUNCH(k_rope_rotate, flat_grid(m * n_heads * (r->head_dim / 2)), dim3(KCU_THREADS), st(s), r->head_dim,
              r->layout == KN_ROPE_ADJACENT ? 1 : 0, x, m, n_heads, cs);
    launched(s);
}

/* ---- KV cache ----------------------------------------------------------------- */

/* Element offset of slot `slot` of sequence row `seq` (kn_attention.c). */
static __device__ size_t slot_row(const kn_kv_pool &kv, const kn_kv_map &map, int32_t seq, int32_t slot) {
    int32_t blk = map.block_tables[(size_t)seq * (size_t)map.table_len + (size_t)(slot / kv.block_size)];
    size_t row = (size_t)blk * (size_t)kv.block_size + (size_t)(slot % kv.block_size);
    return row * (size_t)kv.n_kv_heads * (size_t)kv.head_dim;
}

__global__ void k_kv_write(kn_kv_pool kv, kn_kv_map map, const float *k, const float *v) {
    int64_t width = (int64_t)kv.n_kv_heads * kv.head_dim;
    for (int64_t i = flat_start(); i < (int64_t)map.m * width; i += flat_step()) {
        int64_t t = i / width, e = i % width;
        size_t at = slot_row(kv, map, map.seq[t], map.slot[t]) + (size_t)e;
        ((uint16_t *)kv.k)[at] = f32_to_half(k[i]);
        ((uint16_t *)kv.v)[at] = f32_to_half(v[i]);
    }
}

void kcu_kv_write(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *k, const float *v) {
    if (map->m == 0) return;
    KN_LAUNCH(k_kv_write, flat_grid((int64_t)map->m * kv->n_kv_heads * kv->head_dim), dim3(KCU_THREADS), st(s), *kv,
              *map, k, v);
    launched(s);
}

/* One block, the moves in order: a later one may read what an earlier
 * one wrote. */
__global__ void k_kv_move(kn_kv_pool kv, const int32_t *src, const int32_t *dst, int32_t n) {
    size_t row = (size_t)kv.n_kv_heads * (size_t)kv.head_dim;
    uint16_t *K = (uint16_t *)kv.k, *V = (uint16_t *)kv.v;
    for (int32_t i = 0; i < n; i++) {
        int32_t a = src[i], b = dst[i];
        if (a != b)
            for (size_t e = threadIdx.x; e < row; e += blockDim.x) {
                K[(size_t)b * row + e] = K[(size_t)a * row + e];
                V[(size_t)b * row + e] = V[(size_t)a * row + e];
            }
        __syncthreads();
    }
}

void kcu_kv_move(kn_stream *s, const kn_kv_pool *kv, const int32_t *src_rows, const int32_t *dst_rows, int32_t n) {
    KN_LAUNCH(k_kv_move, dim3(1), dim3(KCU_THREADS), st(s), *kv, src_rows, dst_rows, n);
    launched(s);
}

/* ---- attention ------------------------------------------------------------------ */

#define AT_CHUNK KN_ATTN_CHUNK
#define AT_DPT (KN_MAX_HEAD_DIM / KCU_THREADS) /* output elements per thread */

/* Chunk [c0, c0 + n) of the visible keys of a token of sequence seq, for
 * the head whose K/V columns start at off (q in sh.qs). The chunk's K and V
 * rows come into shared memory first (kv_s: [2][AT_CHUNK][head_dim + 2]
 * halves, the 2 keeping a column's reads in distinct banks), all threads
 * loading, 4 bytes each. Then thread j < n scores key j (8 lanes of
 * mul-then-add, the lane tree, times scale); thread 0 takes the chunk's
 * maximum and l = sum e^(s - mc) in key order into *mc_s, *l_s; each
 * thread sums o for its own elements in key order. Every thread of the
 * block calls it. */
#define AT_KS (KN_MAX_HEAD_DIM + 2)
struct at_shared { /* a block's shared memory for attention */
    float qs[KN_MAX_HEAD_DIM];
    float sc[AT_CHUNK];
    size_t rows[AT_CHUNK];
    uint16_t kv_s[2][AT_CHUNK][AT_KS];
    float mc_s, l_s;
};
/* The n K and V rows at sh.rows into sh.kv_s, all threads loading, 4
 * bytes each; then a barrier. Every thread of the block calls it. */
static __device__ void at_load(const kn_kv_pool &kv, at_shared &sh, int n) {
    const int hd = kv.head_dim, hs = hd + 2;
    const uint16_t *K = (const uint16_t *)kv.k, *V = (const uint16_t *)kv.v;
    for (int u = (int)threadIdx.x; u < 2 * n * (hd / 2); u += KCU_THREADS) {
        int which = u / (n * (hd / 2)), r = u % (n * (hd / 2)), j = r / (hd / 2), d = r % (hd / 2) * 2;
        uint32_t w = ld32a((which ? V : K) + sh.rows[j] + (size_t)d);
        uint16_t *dst = &((uint16_t *)sh.kv_s[which])[j * hs + d];
        dst[0] = (uint16_t)(w & 0xffffu);
        dst[1] = (uint16_t)(w >> 16);
    }
    __syncthreads();
}

/* Key j's score against the query qs: 8 lanes of mul-then-add, the lane
 * tree, times scale. */
static __device__ float at_score(const float *qs, const uint16_t *kr, int hd, float scale) {
    float a[8];
    for (int l = 0; l < 8; l++) a[l] = 0.0f;
    for (int d = 0; d < hd; d += 8)
        for (int l = 0; l < 8; l++) {
            float p = qs[d + l] * half_to_f32(kr[d + l]);
            a[l] = a[l] + p;
        }
    float tr = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    return tr * scale;
}

/* The chunk's maximum of its n scores, then each score replaced by
 * e^(s - mc) and their sum l, in key order (one thread). */
static __device__ void at_exp(float *sc, int n, float *mc_out, float *l_out) {
    float mc = -INFINITY;
    for (int j = 0; j < n; j++) mc = sc[j] > mc ? sc[j] : mc;
    float l = 0.0f;
    for (int j = 0; j < n; j++) {
        float p = exp_neg(sc[j] - mc);
        sc[j] = p;
        l = l + p;
    }
    *mc_out = mc;
    *l_out = l;
}

/* This thread's elements of o = sum_j e_j v_j, in key order. K and V
 * rows lie hd + 2 halves apart in kv_s (at_load). */
static __device__ void at_values(const uint16_t *vs, const float *sc, int n, int hd, float *o) {
    for (int e = 0; e < AT_DPT; e++) {
        int d = (int)threadIdx.x + e * KCU_THREADS;
        float oe = 0.0f;
        if (d < hd)
            for (int j = 0; j < n; j++) {
                float pv = half_to_f32(vs[j * (hd + 2) + d]) * sc[j];
                oe = oe + pv;
            }
        o[e] = oe;
    }
}

static __device__ void at_chunk(const kn_kv_pool &kv, const kn_kv_map &map, at_shared &sh, int32_t seq,
                                int32_t n_prefix, const int32_t *extra, size_t off, int64_t c0, int n, float scale,
                                float *o) {
    const int hd = kv.head_dim;
    unsigned tid = threadIdx.x;
    if ((int)tid < n) {
        int64_t vi = c0 + tid;
        int32_t slot = vi < n_prefix ? (int32_t)vi : extra[vi - n_prefix];
        sh.rows[tid] = slot_row(kv, map, seq, slot) + off;
    }
    __syncthreads();
    at_load(kv, sh, n);
    if ((int)tid < n) sh.sc[tid] = at_score(sh.qs, &sh.kv_s[0][0][0] + tid * (hd + 2), hd, scale);
    __syncthreads();
    if (tid == 0) at_exp(sh.sc, n, &sh.mc_s, &sh.l_s);
    __syncthreads();
    at_values(&sh.kv_s[1][0][0], sh.sc, n, hd, o);
}

/* The running state (M, L, O) after a chunk (mc, l, o) in order; the
 * first chunk starts it. kn_attention.c's merge. */
static __device__ void at_merge(bool first, float mc, float l, const float *o, float *M, float *L, float *O) {
    float a = 0.0f, b = 0.0f;
    if (!first) {
        float mn = mc > *M ? mc : *M;
        a = exp_neg(*M - mn);
        b = exp_neg(mc - mn);
        float la = *L * a, lb = l * b;
        *L = la + lb;
        *M = mn;
    } else {
        *M = mc;
        *L = l;
    }
    for (int e = 0; e < AT_DPT; e++) {
        if (first) {
            O[e] = o[e];
        } else {
            float x = O[e] * a, y = o[e] * b;
            O[e] = x + y;
        }
    }
}

/* Token t's query for head h into shared memory; its sequence, prefix,
 * extra slots, visible count and K/V column offset. */
struct at_tok {
    int32_t seq, n_prefix;
    const int32_t *extra;
    int64_t n_vis;
    size_t off;
};
static __device__ at_tok at_token(const kn_kv_pool &kv, const kn_kv_map &map, const float *q, int32_t n_heads,
                                  int32_t t, int32_t h, float *qs) {
    const int hd = kv.head_dim;
    const float *qh = q + ((size_t)t * (size_t)n_heads + (size_t)h) * (size_t)hd;
    for (int d = (int)threadIdx.x; d < hd; d += KCU_THREADS) qs[d] = qh[d];
    at_tok k;
    k.seq = map.seq[t];
    k.n_prefix = map.n_prefix[t];
    k.extra = map.extra + map.extra_start[t];
    k.n_vis = (int64_t)k.n_prefix + map.n_extra[t];
    k.off = (size_t)(h / (n_heads / kv.n_kv_heads)) * (size_t)hd;
    return k;
}

/* Prefill and large trees (m > KN_ATTN_SPLIT_M), flash-style: a block
 * takes AT_GROUP tokens of the batch (blockIdx.x) for one head
 * (blockIdx.y; tokens on x, as grid y stops at 65535). Where the group's
 * tokens are all of one sequence, the chunks that lie wholly in every
 * token's prefix (a prefill chunk's earlier keys, a tree's committed
 * context) are loaded once for the group and scored for each token;
 * every token's other chunks (the last part of its prefix, a tree node's
 * ancestors) follow, token by token. Each token still makes each of its
 * chunks with at_chunk's arithmetic and merges them in order, so the bits
 * are k_attn_part's and the CPU's; only the loads are shared. */
#define AT_GROUP 8
struct at_group_shared {
    at_shared one;
    float qg[AT_GROUP][KN_MAX_HEAD_DIM];
    float scg[AT_GROUP][AT_CHUNK];
    float mcg[AT_GROUP], lg[AT_GROUP];
    int32_t n_shared;
};
__global__ void __launch_bounds__(KCU_THREADS) k_attn_group(kn_kv_pool kv, kn_kv_map map, const float *q, float *out,
                                                             int32_t n_heads, float scale) {
    __shared__ at_group_shared gs;
    at_shared &sh = gs.one;
    int32_t t0 = (int32_t)blockIdx.x * AT_GROUP, h = (int32_t)blockIdx.y;
    int nq = map.m - t0 < AT_GROUP ? map.m - t0 : AT_GROUP;
    const int hd = kv.head_dim;
    unsigned tid = threadIdx.x;
    for (int u = (int)tid; u < nq * hd; u += KCU_THREADS) {
        int qi = u / hd, d = u % hd;
        gs.qg[qi][d] = q[((size_t)(t0 + qi) * (size_t)n_heads + (size_t)h) * (size_t)hd + (size_t)d];
    }
    int32_t seq = map.seq[t0];
    if (tid == 0) {
        int32_t n = INT32_MAX;
        for (int qi = 0; qi < nq; qi++) {
            int32_t w = map.seq[t0 + qi] == seq ? map.n_prefix[t0 + qi] / AT_CHUNK : 0;
            n = w < n ? w : n;
        }
        gs.n_shared = n;
    }
    __syncthreads();
    const int32_t n_shared = gs.n_shared;
    const size_t off = (size_t)(h / (n_heads / kv.n_kv_heads)) * (size_t)hd;
    float M[AT_GROUP], L[AT_GROUP], O[AT_GROUP][AT_DPT];
    for (int32_t c = 0; c < n_shared; c++) {
        if ((int)tid < AT_CHUNK) sh.rows[tid] = slot_row(kv, map, seq, c * AT_CHUNK + (int32_t)tid) + off;
        __syncthreads();
        at_load(kv, sh, AT_CHUNK);
        for (int u = (int)tid; u < nq * AT_CHUNK; u += KCU_THREADS) {
            int qi = u / AT_CHUNK, j = u % AT_CHUNK;
            gs.scg[qi][j] = at_score(gs.qg[qi], &sh.kv_s[0][0][0] + j * (hd + 2), hd, scale);
        }
        __syncthreads();
        if ((int)tid < nq) at_exp(gs.scg[tid], AT_CHUNK, &gs.mcg[tid], &gs.lg[tid]);
        __syncthreads();
        KCU_UNROLL
        for (int qi = 0; qi < AT_GROUP; qi++) { /* a constant count: M, L and O stay in registers */
            if (qi >= nq) break;
            float o[AT_DPT];
            at_values(&sh.kv_s[1][0][0], gs.scg[qi], AT_CHUNK, hd, o);
            at_merge(c == 0, gs.mcg[qi], gs.lg[qi], o, &M[qi], &L[qi], O[qi]);
        }
        __syncthreads();
    }
    KCU_UNROLL
    for (int qi = 0; qi < AT_GROUP; qi++) {
        if (qi >= nq) break;
        at_tok k = at_token(kv, map, q, n_heads, t0 + qi, h, sh.qs);
        __syncthreads();
        for (int64_t c0 = (int64_t)n_shared * AT_CHUNK; c0 < k.n_vis; c0 += AT_CHUNK) {
            int n = k.n_vis - c0 < AT_CHUNK ? (int)(k.n_vis - c0) : AT_CHUNK;
            float o[AT_DPT];
            at_chunk(kv, map, sh, k.seq, k.n_prefix, k.extra, k.off, c0, n, scale, o);
            at_merge(c0 == 0, sh.mc_s, sh.l_s, o, &M[qi], &L[qi], O[qi]);
            __syncthreads();
        }
        float *oh = out + ((size_t)(t0 + qi) * (size_t)n_heads + (size_t)h) * (size_t)hd;
        for (int e = 0; e < AT_DPT; e++) {
            int d = (int)tid + e * KCU_THREADS;
            if (d < hd) oh[d] = O[qi][e] / L[qi];
        }
    }
}

/* Decode and verify (m <= KN_ATTN_SPLIT_M): the chunks of every (token,
 * head) at once, a block each (blockIdx.z; chunks past the token's keys
 * return), their (mc, l, o) into part, [t][h][chunk][2 + head_dim]; then
 * k_attn_merge merges each token's chunks in order. The arithmetic is
 * k_attn_group's, so the bits are too. */
__global__ void __launch_bounds__(KCU_THREADS) k_attn_part(kn_kv_pool kv, kn_kv_map map, const float *q,
                                                            int32_t n_heads, float scale, int32_t n_chunks,
                                                            float *part) {
    __shared__ at_shared sh;
    int32_t t = (int32_t)blockIdx.x, h = (int32_t)blockIdx.y;
    int64_t c0 = (int64_t)blockIdx.z * AT_CHUNK;
    at_tok k = at_token(kv, map, q, n_heads, t, h, sh.qs);
    if (c0 >= k.n_vis) return; /* the same in every thread */
    int n = k.n_vis - c0 < AT_CHUNK ? (int)(k.n_vis - c0) : AT_CHUNK;
    float o[AT_DPT];
    __syncthreads();
    at_chunk(kv, map, sh, k.seq, k.n_prefix, k.extra, k.off, c0, n, scale, o);
    const int hd = kv.head_dim;
    float *p = part + (((size_t)t * (size_t)n_heads + (size_t)h) * (size_t)n_chunks + blockIdx.z) * (size_t)(hd + 2);
    if (threadIdx.x == 0) {
        p[0] = sh.mc_s;
        p[1] = sh.l_s;
    }
    for (int e = 0; e < AT_DPT; e++) {
        int d = (int)threadIdx.x + e * KCU_THREADS;
        if (d < hd) p[2 + d] = o[e];
    }
}

__global__ void __launch_bounds__(KCU_THREADS) k_attn_merge(kn_kv_pool kv, kn_kv_map map, float *out,
                                                             int32_t n_heads, int32_t n_chunks, const float *part) {
    int32_t t = (int32_t)blockIdx.x, h = (int32_t)blockIdx.y;
    const int hd = kv.head_dim;
    int64_t n_vis = (int64_t)map.n_prefix[t] + map.n_extra[t];
    const float *p0 = part + ((size_t)t * (size_t)n_heads + (size_t)h) * (size_t)n_chunks * (size_t)(hd + 2);
    float M = 0.0f, L = 0.0f, O[AT_DPT], o[AT_DPT];
    for (int64_t c = 0; c * AT_CHUNK < n_vis && c < n_chunks; c++) {
        const float *p = p0 + (size_t)c * (size_t)(hd + 2);
        for (int e = 0; e < AT_DPT; e++) {
            int d = (int)threadIdx.x + e * KCU_THREADS;
            o[e] = d < hd ? p[2 + d] : 0.0f;
        }
        at_merge(c == 0, p[0], p[1], o, &M, &L, O);
    }
    if (n_vis > (int64_t)n_chunks * AT_CHUNK) L = NAN; /* map->max_visible said too few: loud, not wrong */
    float *oh = out + ((size_t)t * (size_t)n_heads + (size_t)h) * (size_t)hd;
    for (int e = 0; e < AT_DPT; e++) {
        int d = (int)threadIdx.x + e * KCU_THREADS;
        if (d < hd) oh[d] = O[e] / L;
    }
}

/* Split where the partials fit the stream's workspace (sized by
 * kn_attention_workspace for KN_ATTN_SPLIT_M tokens); a token sees at
 * most map->max_visible slots, or its block table's. */
void kcu_attention(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *q, float *out,
                   int32_t n_heads) {
    if (map->m == 0) return;
    KCU_ASSERT((uintptr_t)kv->k % 4 == 0 && (uintptr_t)kv->v % 4 == 0 && kv->head_dim % 8 == 0); /* at_chunk's loads */
    float scale = 1.0f / sqrtf((float)kv->head_dim);
    int64_t max_keys = map->max_visible > 0 ? map->max_visible : (int64_t)map->table_len * kv->block_size;
    int32_t n_chunks = (int32_t)((max_keys + AT_CHUNK - 1) / AT_CHUNK);
    size_t part_bytes = (size_t)map->m * (size_t)n_heads * (size_t)n_chunks * (size_t)(kv->head_dim + 2) * sizeof(float);
    if (map->m <= KN_ATTN_SPLIT_M && n_chunks > 1 && n_chunks <= 65535 && part_bytes <= KN_CU(s)->work_bytes) {
        float *part = (float *)KN_CU(s)->work;
        KN_LAUNCH(k_attn_part, dim3((unsigned)map->m, (unsigned)n_heads, (unsigned)n_chunks), dim3(KCU_THREADS),
                  st(s), *kv, *map, q, n_heads, scale, n_chunks, part);
        launched(s);
        KN_LAUNCH(k_attn_merge, dim3((unsigned)map->m, (unsigned)n_heads), dim3(KCU_THREADS), st(s), *kv, *map, out,
                  n_heads, n_chunks, part);
        launched(s);
        return;
    }
    KN_LAUNCH(k_attn_group, dim3((unsigned)((map->m + AT_GROUP - 1) / AT_GROUP), (unsigned)n_heads), dim3(KCU_THREADS),
              st(s), *kv, *map, q, out, n_heads, scale);
    launched(s);
}
