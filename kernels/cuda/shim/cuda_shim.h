/* A small CPU stand-in for the part of CUDA that kernels/cuda/ uses, so
 * that the same sources, compiled by g++ instead of nvcc, run on a
 * machine without a GPU and can be compared op by op with the CPU
 * backend (make test-cuda-cpu), under ASan and TSan.
 *
 * Kernels: a launch runs the grid's blocks one after another; the threads
 * of a block are real threads (one pthread per CUDA thread), so a missing
 * __syncthreads is a data race TSan reports, and out-of-bounds accesses
 * are ASan's. __shared__ variables are function statics: one block runs
 * at a time, so they are the block's. Warp shuffles go through a per-warp
 * exchange with a barrier per warp. Every thread of a block must reach
 * each __syncthreads (as CUDA requires); the shim counts them and aborts
 * a block whose threads disagree.
 *
 * Runtime: memory is host memory, copies are memcpy, and every call is
 * synchronous, so streams and events are only handles. AERIE_SHIM_DEVICES
 * devices (default 1), each reported with the memory given by
 * AERIE_SHIM_GPU_MIB (default 4096; or a list, one a device) and counted
 * apart; each reads every
 * other's memory (peer access) unless AERIE_SHIM_NO_PEER=1.
 *
 * Not here, and so not used by the portable kernels: dynamic shared
 * memory, atomics, cooperative groups, tensor-core instructions, cp.async
 * and TMA, inline PTX (tests/gpu/UNRUN.md lists the paths that wait for a
 * GPU). */
#ifndef AERIE_CUDA_SHIM_H
#define AERIE_CUDA_SHIM_H

#include <functional>
#include <tuple>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

extern thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

void __syncthreads(void);
void __syncwarp(unsigned mask = 0xffffffffu);
float __shfl_xor_sync(unsigned mask, float v, int lane_mask, int width = 32);
double __shfl_xor_sync(unsigned mask, double v, int lane_mask, int width = 32);
int __shfl_xor_sync(unsigned mask, int v, int lane_mask, int width = 32);

/* ---- runtime ---------------------------------------------------------- */

typedef int cudaError_t;
enum {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInsufficientDriver = 35,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorPeerAccessAlreadyEnabled = 704,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
};
typedef enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
} cudaMemcpyKind;
typedef struct shim_stream *cudaStream_t;
typedef struct shim_event *cudaEvent_t;
typedef struct shim_graph *cudaGraph_t;
typedef struct shim_graph *cudaGraphExec_t;
typedef struct shim_graph_node *cudaGraphNode_t;
typedef enum cudaStreamCaptureMode {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2,
} cudaStreamCaptureMode;
typedef enum cudaStreamCaptureStatus {
    cudaStreamCaptureStatusNone = 0,
    cudaStreamCaptureStatusActive = 1,
    cudaStreamCaptureStatusInvalidated = 2,
} cudaStreamCaptureStatus;
#define cudaStreamNonBlocking 1u
#define cudaEventDisableTiming 2u

struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    int major, minor;
    int multiProcessorCount;
};

const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError(void);
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaGetDevice(int *d);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int d);
cudaError_t cudaDeviceCanAccessPeer(int *can, int d, int peer);
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags);
cudaError_t cudaDriverGetVersion(int *v);
cudaError_t cudaRuntimeGetVersion(int *v);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);
cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaFree(void *p);
cudaError_t cudaMemset(void *p, int v, size_t n);
cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind k);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind k, cudaStream_t s);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventCreate(cudaEvent_t *e);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);

/* Graphs: while a stream captures, its launches and device-to-device
 * copies are recorded, not run, and the calls CUDA refuses to a capturing
 * thread (a synchronous copy or memset, cudaMalloc, any synchronize, a
 * copy to or from the host on the capturing stream) fail with
 * cudaErrorStreamCaptureUnsupported and invalidate the capture, as they
 * do there. An instantiated graph replays its nodes in order, with the
 * arguments they were captured with; it takes SHIM_GRAPH_NODE_BYTES of
 * the device's memory per node (a stand-in for the parameter blocks a GPU
 * keeps, so that cudaMemGetInfo shows a graph's memory). */
#define SHIM_GRAPH_NODE_BYTES 4096
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g);
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus *status);
cudaError_t cudaGraphGetNodes(cudaGraph_t g, cudaGraphNode_t *nodes, size_t *n);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t g, unsigned long long flags);
cudaError_t cudaGraphUpload(cudaGraphExec_t exec, cudaStream_t s);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
cudaError_t cudaGraphDestroy(cudaGraph_t g);

/* Runs fn once per thread of each block of grid, blocks in order. */
void shim_launch(dim3 grid, dim3 block, const std::function<void()> &fn);
/* The same on stream s: recorded instead while s captures. The lambda
 * holds the kernel's arguments as they were evaluated at the launch (a
 * tuple made there), as a launch's parameters are: a replay passes those
 * values, whatever the variables they came from hold by then. */
void shim_launch_on(cudaStream_t s, dim3 grid, dim3 block, const std::function<void()> &fn);

#define KN_LAUNCH(kernel, grid, block, stream, ...) \
    shim_launch_on((stream), (grid), (block), \
                   [shim_args_ = std::make_tuple(__VA_ARGS__)]() { std::apply(kernel, shim_args_); })

#endif
