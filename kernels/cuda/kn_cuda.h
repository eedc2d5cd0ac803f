/* Internals of the CUDA backend (kn_cuda.cu: streams, buffers, the
 * table; kn_cuda_comm.cu: the allreduce; the kernels by family in
 * kn_cuda_elementwise.cu, kn_cuda_norm.cu, kn_cuda_softmax.cu,
 * kn_cuda_matmul.cu and kn_cuda_attention.cu, sharing
 * kn_cuda_kernel.h). Every file here is written in the
 * portable subset of CUDA C++ that shim/cuda_shim.h also provides, so
 * that g++ builds the same sources for the CPU (KN_CUDA_SHIM) and the
 * op tests compare them with the CPU backend.
 *
 * The kernels keep the bits of kernels.h ("Batch invariance") exactly:
 * every reduction runs in the order the CPU backend's does, with no
 * contraction of a multiply and an add the code wrote apart (nvcc
 * --fmad=false, as -ffp-contract=off on the CPU), so a CUDA run is batch
 * invariant by construction and its greedy speculative output is
 * token-identical to plain decoding. Two ops call the device's libm and
 * so may differ from the CPU in the last bit, never with the batch:
 * kn_softmax's expf (within 2 ulp; the draft's proposal probabilities
 * only) and kn_rope_table's cos and sin in double (within 2 ulp of
 * double, so the f32 result differs only where the double lands within
 * that of an f32 rounding boundary: rare, but not never).
 *
 * The plugin (build/libaerie-cuda.so) exports three names, all in
 * kn_cuda.cu and declared by device.h: kn_cuda_abi, the backend ABI it
 * was built with (backend.h KN_BACKEND_ABI); kn_cuda_open, which hands
 * out the table; and kn_cuda_copy_gbps. Everything else is hidden
 * (-fvisibility=hidden), so the kcu_ names here are the plugin's own and
 * may change freely. What the ABI covers is backend.h's list: the table
 * and the types it passes, device.h's entry points, and each op's
 * contract. A change in these files never needs a bump by itself; one to
 * backend.h, kernels.h, draw.h or device.h that an older plugin would
 * misread does, in the same commit. The tables here (kn_backend_cuda,
 * the comms' kn_comm_ops) name their members, in backend.h's order. */
#ifndef AERIE_KERNELS_CUDA_H
#define AERIE_KERNELS_CUDA_H

#ifdef KN_CUDA_SHIM
#include "shim/cuda_shim.h"
#else
#include <cuda_runtime.h>
#define KN_LAUNCH(kernel, grid, block, stream, ...) kernel<<<(grid), (block), 0, (stream)>>>(__VA_ARGS__)
#endif

#include <stdint.h>
#include <string.h>

extern "C" {
#include "../backend.h"
}

#define KN_HD __host__ __device__ __forceinline__

/* A CUDA stream: its queue and its scratch in device memory. */
struct kn_cuda_stream {
    kn_stream base; /* backend.h */
    int dev;        /* its device, cuda:dev */
    cudaStream_t st;
    void *work;
    size_t work_bytes;
    size_t free_at_capture; /* the device's free bytes when the capture began */
    void *blas;             /* fast mode: the stream's cuBLAS handle */
    void *blas_work;        /* and its workspace, KN_FAST_WORKSPACE_BYTES */
};
#define KN_CU(s) ((kn_cuda_stream *)(s))

/* Every CUDA call is checked: a failure during an op is fatal (the
 * device is lost or an invariant broke), reported with the call, the
 * file and the line. */
__attribute__((noreturn)) void kn_cuda_fail(const char *call, cudaError_t e, const char *file, int line);
#define KN_CK(call) \
    do { \
        cudaError_t e_ = (call); \
        if (e_ != cudaSuccess) kn_cuda_fail(#call, e_, __FILE__, __LINE__); \
    } while (0)

/* err_set's rule (the first error is kept), without linking libaerie. */
__attribute__((format(printf, 2, 3))) int kcu_fail(ae_error *err, const char *fmt, ...);

/* AE_ASSERT's twin: the plugin links nothing of libaerie. */
__attribute__((noreturn)) void kn_cuda_assert_fail(const char *cond, const char *file, int line);
#define KCU_ASSERT(cond) ((cond) ? (void)0 : kn_cuda_assert_fail(#cond, __FILE__, __LINE__))

/* The plugin drives any of a process's devices, up to this many: each
 * opened has a backend table of its own (kn_cuda_open). */
#define KCU_MAX_DEVICES 64
/* Makes device `dev` current on the calling thread (cached per thread:
 * the runtime's current device is per thread). */
void kcu_bind(int dev);
/* The device of a table kn_cuda_open returned. */
int kcu_dev_of(const kn_backend *be);
/* The table's reads (backend.h): the same device, or one it has peer
 * access to. */
bool kcu_reads(const kn_backend *self, const kn_backend *other);
/* Every rank's slot of one parity, as a kernel argument (kn_cuda_comm.cu). */
struct kcu_slots {
    const float *p[64]; /* KN_COMM_MAX_RANKS */
};
/* The custom allreduce's fused tail (kn_cuda_norm.cu): x [m][n] += the
 * slots' sum in rank order, then y = rmsnorm(x) * g, a block a row. */
void kcu_launch_add_rmsnorm(cudaStream_t st, const kcu_slots *slots, int n_ranks, float *x, const float *g, float *y,
                            int64_t m, int64_t n, float eps);
/* The backend's comm_init (kn_cuda_comm.cu): the custom and nccl kinds. */
int kcu_comm_init(kn_allreduce kind, kn_comm **comms, int n_ranks, const kn_backend *const *rank_be, size_t max_count,
                  ae_error *err);
/* AERIE_CUDA_SYNC=1: wait for every kernel as it is launched (debugging,
 * tests/gpu/run.sh). Read once. */
bool kcu_sync_launches(void);
/* Whether this build has a kernel image the device can run (opening
 * fails cleanly otherwise, rather than at the first op;
 * kn_cuda_elementwise.cu). */
cudaError_t kcu_image_check(void);

/* Fast mode (kernels.h kn_stream_set_fast): y[m][n] = x[m][k] . W[n][k]^T
 * by cuBLAS, W row-major of type (GGML_TYPE_F32, F16 or BF16) and xt x
 * already in that type, y f32; accumulation in f32. */
void kcu_blas_gemm(kn_stream *s, ggml_type type, const void *w, const void *xt, float *y, int64_t m, int64_t n,
                   int64_t k);

/* ---- the ops (kn_cuda_<family>.cu), as backend.h declares them -------- */
void kcu_matmul_n(kn_stream *s, int n, const kn_weight *const *w, const float *x, float *const *y, int64_t m);
void kcu_matmul_swiglu(kn_stream *s, const kn_weight *gate, const kn_weight *up, const float *x, float *y_gate,
                       float *y_up, int64_t m);
void kcu_rmsnorm(kn_stream *s, const float *x, const float *g, float *y, int64_t m, int64_t n, float eps);
void kcu_add(kn_stream *s, const float *a, const float *b, float *y, int64_t count);
void kcu_bias_add(kn_stream *s, float *x, const float *bias, int64_t m, int64_t n);
void kcu_swiglu(kn_stream *s, const float *gate, const float *up, float *y, int64_t count);
void kcu_softmax(kn_stream *s, float *x, int64_t m, int64_t n);
void kcu_argmax(kn_stream *s, const float *x, int32_t *out, int64_t m, int64_t n);
void kcu_topk(kn_stream *s, const float *x, int64_t m, int64_t n, int32_t k, int32_t *idx, float *val);
void kcu_sample(kn_stream *s, const float *x, int64_t m, int64_t n, const kn_draw *draws, int32_t *out);
void kcu_embed(kn_stream *s, const kn_weight *table, const int32_t *ids, float *out, int64_t m);
void kcu_rope_table(kn_stream *s, const kn_rope *r, const int32_t *pos, int64_t m, float *cs);
void kcu_rope_rotate(kn_stream *s, const kn_rope *r, float *x, int64_t m, int32_t n_heads, const float *cs);
void kcu_kv_write(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *k, const float *v);
void kcu_kv_move(kn_stream *s, const kn_kv_pool *kv, const int32_t *src_rows, const int32_t *dst_rows, int32_t n);
void kcu_attention(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *q, float *out,
                   int32_t n_heads);
void kcu_gather_rows(kn_stream *s, const float *src, const int32_t *rows, int64_t n, int64_t width, float *dst,
                     int64_t dst_stride);

#endif
