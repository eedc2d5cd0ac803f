/* The CUDA backend's rmsnorm, one block per row, and the custom
 * allreduce's fused tail (kn_cuda_comm.cu), which ends in the same norm. */
#include "kn_cuda_kernel.h"

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
