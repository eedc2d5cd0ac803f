/* The CUDA backend (backend.h): streams, buffers, events and the table,
 * and the plugin's entry point kn_cuda_open (kernels/device.h). The ops
 * are in a file per family: kn_cuda_elementwise.cu, kn_cuda_norm.cu,
 * kn_cuda_softmax.cu (and sampling), kn_cuda_matmul.cu and
 * kn_cuda_attention.cu (and the KV cache); the allreduce is in
 * kn_cuda_comm.cu.
 *
 * A process may drive several devices: each one opened has its own copy
 * of the table, and a stream or buffer's table says which device it is
 * on. The runtime's current device is per thread, so every entry that
 * touches a device makes it current first (kcu_bind). Devices opened
 * reach each other's memory where the hardware lets them (peer access). Streams are non-blocking CUDA streams with
 * their workspace in device memory; buffers are cudaMalloc'd and zeroed.
 * A failed call while serving is fatal and names the call, file and
 * line; at open a failure is an error line for the caller. */
#include "kn_cuda.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

extern "C" {
#include "../device.h"
}

/* A table per device opened (kn_cuda_open): which table an op's stream or
 * buffer has says which device it is on. */
static kn_backend g_tables[KCU_MAX_DEVICES];
static bool g_opened[KCU_MAX_DEVICES];
static int g_first = -1;                              /* the first device opened: kn_cuda_copy_gbps's */
static bool g_peer[KCU_MAX_DEVICES][KCU_MAX_DEVICES]; /* [i][j]: cuda:i's kernels reach cuda:j's memory */
static pthread_mutex_t g_open_mu = PTHREAD_MUTEX_INITIALIZER;
static thread_local int t_bound = -1;

void kcu_bind(int dev) {
    if (t_bound != dev) {
        KN_CK(cudaSetDevice(dev));
        t_bound = dev;
    }
}

bool kcu_reads(const kn_backend *self, const kn_backend *other) {
    ptrdiff_t i = self - g_tables, j = other - g_tables;
    if (i < 0 || i >= KCU_MAX_DEVICES || j < 0 || j >= KCU_MAX_DEVICES || !g_opened[j]) return false;
    return i == j || g_peer[i][j];
}

int kcu_dev_of(const kn_backend *be) {
    ptrdiff_t i = be - g_tables;
    KCU_ASSERT(i >= 0 && i < KCU_MAX_DEVICES && g_opened[i]);
    return (int)i;
}

bool kcu_sync_launches(void) {
    static const bool on = [] {
        const char *e = getenv("AERIE_CUDA_SYNC");
        return e && strcmp(e, "1") == 0;
    }();
    return on;
}

void kn_cuda_fail(const char *call, cudaError_t e, const char *file, int line) {
    fprintf(stderr, "aerie cuda: %s failed: %s (%d) at %s:%d\n", call, cudaGetErrorString(e), (int)e, file, line);
    fflush(stderr);
    abort();
}

void kn_cuda_assert_fail(const char *cond, const char *file, int line) {
    fprintf(stderr, "aerie cuda: assertion failed: %s at %s:%d\n", cond, file, line);
    fflush(stderr);
    abort();
}

/* err_set's rule (the first error is kept), without linking libaerie. */
int kcu_fail(ae_error *err, const char *fmt, ...) {
    if (err && err->msg[0] == '\0') {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return AE_ERR;
}

#define fail kcu_fail

/* ---- streams and events ---------------------------------------------------- */

static int cu_stream_init(const kn_backend *be, kn_stream **out, const kn_stream_config *cfg, ae_error *err) {
    const int dev = kcu_dev_of(be);
    kcu_bind(dev);
    kn_cuda_stream *s = (kn_cuda_stream *)calloc(1, sizeof *s);
    if (!s) return fail(err, "cuda: out of host memory for a stream");
    s->dev = dev;
    cudaError_t e = cudaStreamCreateWithFlags(&s->st, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        free(s);
        return fail(err, "cuda: cudaStreamCreateWithFlags: %s (%d)", cudaGetErrorString(e), (int)e);
    }
    size_t bytes = cfg ? cfg->workspace_bytes : 0;
    if (bytes > 0) {
        e = cudaMalloc(&s->work, bytes);
        if (e != cudaSuccess) {
            cudaStreamDestroy(s->st);
            free(s);
            return fail(err, "cuda: cannot allocate %zu bytes of stream workspace: %s", bytes, cudaGetErrorString(e));
        }
        s->work_bytes = bytes;
    }
    *out = &s->base;
    return AE_OK;
}

static void blas_free(kn_cuda_stream *c);

static void cu_stream_free(kn_stream *s) {
    kcu_bind(KN_CU(s)->dev);
    kn_cuda_stream *c = KN_CU(s);
    KN_CK(cudaStreamSynchronize(c->st));
    blas_free(c);
    if (c->work) KN_CK(cudaFree(c->work));
    KN_CK(cudaStreamDestroy(c->st));
    free(c);
}

static int cu_stream_threads(const kn_stream *s) {
    (void)s;
    return 1; /* host threads the stream keeps busy */
}

static void cu_sync(kn_stream *s) {
    kcu_bind(KN_CU(s)->dev);
    KN_CK(cudaStreamSynchronize(KN_CU(s)->st));
}

/* An event is created the first time it is recorded and kept with the
 * caller's kn_event for the process's life (a step reuses its events). */
static void cu_event_record(kn_stream *s, kn_event *e) {
    kcu_bind(KN_CU(s)->dev);
    if (!e->impl) {
        cudaEvent_t ev;
        KN_CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
        e->impl = (void *)ev;
    }
    KN_CK(cudaEventRecord((cudaEvent_t)e->impl, KN_CU(s)->st));
}

static void cu_event_free(kn_event *e) {
    kcu_bind(kcu_dev_of(e->be));
    KN_CK(cudaEventDestroy((cudaEvent_t)e->impl));
    e->impl = NULL;
}

static void cu_event_wait(kn_stream *s, const kn_event *e) {
    kcu_bind(KN_CU(s)->dev);
    if (e->impl) KN_CK(cudaStreamWaitEvent(KN_CU(s)->st, (cudaEvent_t)e->impl, 0));
}

/* ---- fast mode: cuBLAS, opened when first asked for ---------------------------- */

/* cuBLAS is not linked: the plugin opens it with dlopen the first time a
 * stream is made fast (kernels.h), so a deterministic run never loads its
 * hundreds of megabytes. AERIE_CUBLAS_LIB names the file; otherwise
 * libcublas.so.13, then .12, on the loader's path. The entry points and
 * the values of the enums below are cuBLAS's public C ABI (cublas_api.h,
 * library_types.h), the same in CUDA 12 and 13; the header is not needed
 * to build. */
enum {
    KCU_BLAS_OK = 0,
    KCU_OP_N = 0,
    KCU_OP_T = 1,
    KCU_R_32F = 0,
    KCU_R_16F = 2,
    KCU_R_16BF = 14,
    KCU_COMPUTE_32F = 68,
    KCU_GEMM_DEFAULT = -1,
};
struct kcu_blas_api {
    int (*create)(void **handle);
    int (*destroy)(void *handle);
    int (*set_stream)(void *handle, cudaStream_t st);
    int (*set_workspace)(void *handle, void *work, size_t bytes);
    int (*get_version)(void *handle, int *version);
    int (*gemm_ex)(void *handle, int transa, int transb, int m, int n, int k, const void *alpha, const void *a,
                   int atype, int lda, const void *b, int btype, int ldb, const void *beta, void *c, int ctype, int ldc,
                   int compute, int algo);
};
static kcu_blas_api g_blas;
static char g_blas_error[256]; /* why it could not be opened, once tried */
static pthread_once_t g_blas_once = PTHREAD_ONCE_INIT;

static void blas_open(void) {
#ifdef KN_CUDA_SHIM
    snprintf(g_blas_error, sizeof g_blas_error, "the CPU shim has no cuBLAS");
#else
    const char *env = getenv("AERIE_CUBLAS_LIB");
    const char *names[3] = {env && *env ? env : "libcublas.so.13", env && *env ? NULL : "libcublas.so.12", NULL};
    void *lib = NULL;
    for (int i = 0; i < 2 && names[i] && !lib; i++) lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *why = dlerror();
        snprintf(g_blas_error, sizeof g_blas_error, "cannot open cuBLAS (%s; AERIE_CUBLAS_LIB names the file): %s",
                 env && *env ? env : "libcublas.so.13 or .12", why ? why : "not found");
        return;
    }
    struct {
        const char *name;
        void **fn;
    } syms[] = {
        {"cublasCreate_v2", (void **)&g_blas.create},
        {"cublasDestroy_v2", (void **)&g_blas.destroy},
        {"cublasSetStream_v2", (void **)&g_blas.set_stream},
        {"cublasSetWorkspace_v2", (void **)&g_blas.set_workspace},
        {"cublasGetVersion_v2", (void **)&g_blas.get_version},
        {"cublasGemmEx", (void **)&g_blas.gemm_ex},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++)
        if (!(*syms[i].fn = dlsym(lib, syms[i].name))) {
            snprintf(g_blas_error, sizeof g_blas_error, "cuBLAS has no %s", syms[i].name);
            g_blas.gemm_ex = NULL;
            return;
        }
#endif
}

/* Every cuBLAS call is checked as the runtime's are. */
#define KN_CB(call) \
    do { \
        int st_ = (call); \
        if (st_ != KCU_BLAS_OK) { \
            fprintf(stderr, "aerie cuda: %s failed: cuBLAS status %d at %s:%d\n", #call, st_, __FILE__, __LINE__); \
            fflush(stderr); \
            abort(); \
        } \
    } while (0)

static int cu_set_fast(kn_stream *s, ae_error *err) {
    kcu_bind(KN_CU(s)->dev);
    kn_cuda_stream *c = KN_CU(s);
    if (c->blas) return AE_OK;
    pthread_once(&g_blas_once, blas_open);
    if (!g_blas.gemm_ex) return fail(err, "fast mode: %s", g_blas_error);
    int st = g_blas.create(&c->blas);
    if (st != KCU_BLAS_OK) {
        c->blas = NULL;
        return fail(err, "fast mode: cublasCreate failed: cuBLAS status %d", st);
    }
    cudaError_t e = cudaMalloc(&c->blas_work, KN_FAST_WORKSPACE_BYTES);
    if (e != cudaSuccess) {
        cudaGetLastError();
        g_blas.destroy(c->blas);
        c->blas = c->blas_work = NULL;
        return fail(err, "fast mode: cannot allocate cuBLAS's %u-byte workspace: %s", KN_FAST_WORKSPACE_BYTES,
                    cudaGetErrorString(e));
    }
    /* Its own workspace, so that it allocates nothing while a graph is
     * captured. */
    KN_CB(g_blas.set_stream(c->blas, c->st));
    KN_CB(g_blas.set_workspace(c->blas, c->blas_work, KN_FAST_WORKSPACE_BYTES));
    int version = 0;
    KN_CB(g_blas.get_version(c->blas, &version));
    fprintf(stderr, "aerie cuda: fast mode: cuBLAS %d on cuda:%d\n", version, c->dev);
    return AE_OK;
}

static void blas_free(kn_cuda_stream *c) {
    if (!c->blas) return;
    KN_CB(g_blas.destroy(c->blas));
    KN_CK(cudaFree(c->blas_work));
    c->blas = c->blas_work = NULL;
}

void kcu_blas_gemm(kn_stream *s, ggml_type type, const void *w, const void *xt, float *y, int64_t m, int64_t n,
                   int64_t k) {
    kn_cuda_stream *c = KN_CU(s);
    kcu_bind(c->dev);
    KCU_ASSERT(c->blas && m <= INT32_MAX && n <= INT32_MAX && k <= INT32_MAX);
    int t = type == GGML_TYPE_F32 ? KCU_R_32F : type == GGML_TYPE_F16 ? KCU_R_16F : KCU_R_16BF;
    const float one = 1.0f, zero = 0.0f;
    /* cuBLAS is column-major: row-major y [m][n] is its n x m matrix, W
     * [n][k] its k x n (so transposed) and x [m][k] its k x m. */
    KN_CB(g_blas.gemm_ex(c->blas, KCU_OP_T, KCU_OP_N, (int)n, (int)m, (int)k, &one, w, t, (int)k, xt, t, (int)k, &zero,
                         y, KCU_R_32F, (int)n, KCU_COMPUTE_32F, KCU_GEMM_DEFAULT));
}

/* ---- graphs ------------------------------------------------------------------ */

/* A captured stream: the executable graph, instantiated and uploaded. */
struct kcu_graph {
    kn_graph base; /* backend.h */
    cudaGraphExec_t exec;
};

/* Thread-local capture: this thread's calls that would break a capture
 * fail (and name themselves through KN_CK) instead of running; other
 * threads of the process (another stream's work) are not held up. */
static int cu_graph_begin(kn_stream *s, ae_error *err) {
    kcu_bind(KN_CU(s)->dev);
    kn_cuda_stream *c = KN_CU(s);
    size_t fr = 0, tot = 0;
    KN_CK(cudaMemGetInfo(&fr, &tot));
    c->free_at_capture = fr;
    cudaError_t e = cudaStreamBeginCapture(c->st, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return fail(err, "cuda: cudaStreamBeginCapture: %s (%d)", cudaGetErrorString(e), (int)e);
    }
    return AE_OK;
}

static int cu_graph_end(kn_stream *s, kn_graph **out, ae_error *err) {
    kcu_bind(KN_CU(s)->dev);
    kn_cuda_stream *c = KN_CU(s);
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(c->st, &g);
    if (e != cudaSuccess) {
        cudaGetLastError();
        if (g) cudaGraphDestroy(g);
        return fail(err, "cuda: the capture failed: cudaStreamEndCapture: %s (%d)", cudaGetErrorString(e), (int)e);
    }
    size_t nodes = 0;
    KN_CK(cudaGraphGetNodes(g, NULL, &nodes));
    kcu_graph *kg = (kcu_graph *)calloc(1, sizeof *kg);
    if (!kg) {
        KN_CK(cudaGraphDestroy(g));
        return fail(err, "cuda: out of host memory for a graph");
    }
    e = cudaGraphInstantiate(&kg->exec, g, 0);
    KN_CK(cudaGraphDestroy(g)); /* the executable graph is a copy */
    if (e != cudaSuccess) {
        cudaGetLastError();
        free(kg);
        return fail(err, "cuda: cudaGraphInstantiate of %zu nodes: %s (%d)", nodes, cudaGetErrorString(e), (int)e);
    }
    /* Uploaded now, so that its memory is counted here and its first
     * replay costs what the others do. Out of memory here is the plan's
     * estimate falling short: graphs off, not the end of the service. */
    e = cudaGraphUpload(kg->exec, c->st);
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->st);
    if (e != cudaSuccess) {
        cudaGetLastError();
        KN_CK(cudaGraphExecDestroy(kg->exec));
        free(kg);
        return fail(err, "cuda: cudaGraphUpload of %zu nodes: %s (%d)", nodes, cudaGetErrorString(e), (int)e);
    }
    size_t fr = 0, tot = 0;
    KN_CK(cudaMemGetInfo(&fr, &tot));
    kg->base.nodes = nodes;
    kg->base.bytes = c->free_at_capture > fr ? c->free_at_capture - fr : 0;
    *out = &kg->base;
    return AE_OK;
}

static void cu_graph_launch(kn_stream *s, kn_graph *g) {
    kcu_bind(KN_CU(s)->dev);
    KN_CK(cudaGraphLaunch(((kcu_graph *)g)->exec, KN_CU(s)->st));
    if (kcu_sync_launches()) KN_CK(cudaStreamSynchronize(KN_CU(s)->st));
}

static void cu_graph_free(kn_graph *g) {
    kcu_bind(kcu_dev_of(g->be));
    KN_CK(cudaGraphExecDestroy(((kcu_graph *)g)->exec));
    free(g);
}

/* ---- buffers ----------------------------------------------------------------- */

static int cu_buf_alloc(kn_buf *b, size_t bytes, ae_error *err) {
    kcu_bind(kcu_dev_of(b->be));
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* clear it: the device is still good */
        size_t fr = 0, tot = 0;
        cudaMemGetInfo(&fr, &tot);
        return fail(err, "cuda: cannot allocate %zu bytes on cuda:%d (%zu of %zu free): %s", bytes, kcu_dev_of(b->be),
                    fr, tot, cudaGetErrorString(e));
    }
    KN_CK(cudaMemset(p, 0, bytes ? bytes : 1));
    /* cudaMemset may return before it is done, on the legacy stream, which
     * the non-blocking op streams do not wait for: done before any op. */
    KN_CK(cudaDeviceSynchronize());
    b->ptr = p;
    return AE_OK;
}

static void cu_buf_free(kn_buf *b) {
    kcu_bind(kcu_dev_of(b->be));
    KN_CK(cudaFree(b->ptr));
}

static void cu_buf_write(kn_buf *b, size_t off, const void *src, size_t n) {
    kcu_bind(kcu_dev_of(b->be));
    KN_CK(cudaMemcpy((char *)b->ptr + off, src, n, cudaMemcpyHostToDevice));
    /* From pageable memory it may return before the copy lands. */
    KN_CK(cudaDeviceSynchronize());
}

static void cu_upload(kn_stream *s, const kn_buf *dst, size_t off, const void *src, size_t n) {
    kcu_bind(KN_CU(s)->dev);
    KN_CK(cudaMemcpyAsync((char *)dst->ptr + off, src, n, cudaMemcpyHostToDevice, KN_CU(s)->st));
}

static void cu_download(kn_stream *s, void *dst, const kn_buf *src, size_t off, size_t n) {
    kcu_bind(KN_CU(s)->dev);
    KN_CK(cudaMemcpyAsync(dst, (const char *)src->ptr + off, n, cudaMemcpyDeviceToHost, KN_CU(s)->st));
}

/* ---- the table ------------------------------------------------------------------ */

/* The types each op takes, by the kernels of kn_cuda_*.cu. */
static bool cu_supports(kn_op op, ggml_type type) {
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

static const kn_backend kn_backend_cuda = {
    .name = "cuda",
    .host_memory = false,
    .supports = cu_supports,
    .stream_init = cu_stream_init,
    .stream_free = cu_stream_free,
    .stream_threads = cu_stream_threads,
    .sync = cu_sync,
    .set_fast = cu_set_fast,
    .event_record = cu_event_record,
    .event_wait = cu_event_wait,
    .graph_begin = cu_graph_begin,
    .graph_end = cu_graph_end,
    .graph_launch = cu_graph_launch,
    .graph_free = cu_graph_free,
    .comm_init = kcu_comm_init,
    .buf_alloc = cu_buf_alloc,
    .buf_free = cu_buf_free,
    .buf_write = cu_buf_write,
    .upload = cu_upload,
    .download = cu_download,
    .matmul_n = kcu_matmul_n,
    .matmul_swiglu = kcu_matmul_swiglu,
    .rmsnorm = kcu_rmsnorm,
    .add = kcu_add,
    .bias_add = kcu_bias_add,
    .swiglu = kcu_swiglu,
    .softmax = kcu_softmax,
    .argmax = kcu_argmax,
    .topk = kcu_topk,
    .sample = kcu_sample,
    .embed = kcu_embed,
    .rope_table = kcu_rope_table,
    .rope_rotate = kcu_rope_rotate,
    .kv_write = kcu_kv_write,
    .kv_move = kcu_kv_move,
    .attention = kcu_attention,
    .gather_rows = kcu_gather_rows,
    .reads = kcu_reads,
    .event_free = cu_event_free,
    .matmul_heads = NULL, /* MLA (KN_OP_LATENT) is the CPU's only, so far */
    .moe_route = NULL,
    .moe_ffn = NULL,
};

/* The backend ABI this plugin was built with (kernels/backend.h): the
 * loader (kernels/device.c) reads it before calling kn_cuda_open. */
extern "C" __attribute__((visibility("default"))) const uint32_t kn_cuda_abi = KN_BACKEND_ABI;

/* The bandwidth of device-to-device copies of `bytes`, `reps` of them
 * timed after one untimed, in GB/s counting bytes read and written (the
 * bandwidth roofline of aerie bench); 0 when the buffers do not fit. */
extern "C" __attribute__((visibility("default"))) double kn_cuda_copy_gbps(size_t bytes, int reps) {
    if (g_first < 0) return 0.0; /* no device opened */
    kcu_bind(g_first);
    void *a = NULL, *b = NULL;
    if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) {
        cudaGetLastError();
        if (a) cudaFree(a);
        return 0.0;
    }
    cudaStream_t s;
    cudaEvent_t t0, t1;
    KN_CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    KN_CK(cudaEventCreate(&t0));
    KN_CK(cudaEventCreate(&t1));
    KN_CK(cudaMemsetAsync(a, 1, bytes, s));
    KN_CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s));
    KN_CK(cudaEventRecord(t0, s));
    for (int r = 0; r < reps; r++)
        KN_CK(cudaMemcpyAsync(r % 2 ? a : b, r % 2 ? b : a, bytes, cudaMemcpyDeviceToDevice, s));
    KN_CK(cudaEventRecord(t1, s));
    KN_CK(cudaEventSynchronize(t1));
    float ms = 0.0f;
    KN_CK(cudaEventElapsedTime(&ms, t0, t1));
    KN_CK(cudaEventDestroy(t0));
    KN_CK(cudaEventDestroy(t1));
    KN_CK(cudaStreamDestroy(s));
    KN_CK(cudaFree(a));
    KN_CK(cudaFree(b));
    return ms > 0.0f ? 2.0 * (double)bytes * reps / ((double)ms * 1e-3) / 1e9 : 0.0;
}

extern "C" __attribute__((visibility("default"))) int kn_cuda_open(int index, const kn_backend **be,
                                                                   kn_device_info *info, ae_error *err) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return fail(err, "no usable GPU: cudaGetDeviceCount: %s (%d)", cudaGetErrorString(e), (int)e);
    }
    if (n == 0) return fail(err, "no usable GPU: cudaGetDeviceCount found none");
    if (index < 0 || index >= n) return fail(err, "cuda:%d does not exist: this machine has %d GPU(s)", index, n);
    if (index >= KCU_MAX_DEVICES)
        return fail(err, "cuda:%d: this build drives cuda:0 to cuda:%d", index, KCU_MAX_DEVICES - 1);
    e = cudaSetDevice(index);
    if (e != cudaSuccess) return fail(err, "cuda:%d: cudaSetDevice: %s (%d)", index, cudaGetErrorString(e), (int)e);
    t_bound = index; /* whatever follows fails: the next kcu_bind knows where the thread is */
    cudaDeviceProp p;
    size_t fr = 0, tot = 0;
    e = cudaGetDeviceProperties(&p, index);
    if (e == cudaSuccess) e = cudaMemGetInfo(&fr, &tot);
    if (e != cudaSuccess)
        return fail(err, "cuda:%d: cannot read the device: %s (%d)", index, cudaGetErrorString(e), (int)e);
    e = kcu_image_check();
    if (e != cudaSuccess) {
        cudaGetLastError();
        return fail(err, "cuda:%d (%s, compute capability %d.%d): no kernel image for it in this build: %s", index,
                    p.name, p.major, p.minor, cudaGetErrorString(e));
    }
    t_bound = index;
    memset(info, 0, sizeof *info);
    snprintf(info->name, sizeof info->name, "%s", p.name);
    info->index = index;
    info->cc_major = p.major;
    info->cc_minor = p.minor;
    info->total_bytes = tot;
    info->free_bytes = fr;
    cudaDriverGetVersion(&info->driver_version);
    cudaRuntimeGetVersion(&info->runtime_version);
    /* Each device opened can read the others' memory where the hardware
     * lets it (NVLink, PCIe P2P): ranks on several GPUs need it (target/tp.h). */
    pthread_mutex_lock(&g_open_mu);
    for (int j = 0; j < KCU_MAX_DEVICES; j++) {
        int ok_ij = 0, ok_ji = 0;
        if (j == index || !g_opened[j]) continue;
        cudaError_t e2;
        g_peer[index][j] = g_peer[j][index] = false;
        if (cudaDeviceCanAccessPeer(&ok_ij, index, j) == cudaSuccess && ok_ij) {
            kcu_bind(index);
            e2 = cudaDeviceEnablePeerAccess(j, 0);
            g_peer[index][j] = e2 == cudaSuccess || e2 == cudaErrorPeerAccessAlreadyEnabled;
            cudaGetLastError();
        }
        if (cudaDeviceCanAccessPeer(&ok_ji, j, index) == cudaSuccess && ok_ji) {
            kcu_bind(j);
            e2 = cudaDeviceEnablePeerAccess(index, 0);
            g_peer[j][index] = e2 == cudaSuccess || e2 == cudaErrorPeerAccessAlreadyEnabled;
            cudaGetLastError();
        }
    }
    if (!g_opened[index]) {
        g_tables[index] = kn_backend_cuda;
        g_opened[index] = true;
    }
    if (g_first < 0) g_first = index;
    pthread_mutex_unlock(&g_open_mu);
    kcu_bind(index);
    *be = &g_tables[index];
    return AE_OK;
}
