/* The CPU stand-in for CUDA (cuda_shim.h). */
/* Fibers switch stacks with _setjmp/_longjmp, which fortify's longjmp
 * check would take for a corrupt stack. */
#undef _FORTIFY_SOURCE
#include "cuda_shim.h"

#include <dlfcn.h>
#include <pthread.h>
#include <setjmp.h>
#include <semaphore.h>
#include <ucontext.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <vector>

thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

/* ---- kernels ------------------------------------------------------------ */

#define SHIM_MAX_THREADS 1024
#define SHIM_WARP 32

/* One launch: its threads, the block's barrier and each warp's. */
struct launch {
    dim3 grid, block;
    const std::function<void()> *fn;
    unsigned n_threads;
    pthread_barrier_t block_bar;
    pthread_barrier_t warp_bar[SHIM_MAX_THREADS / SHIM_WARP];
    double xch[SHIM_MAX_THREADS];     /* a shuffle's values, by thread */
    unsigned syncs[SHIM_MAX_THREADS]; /* __syncthreads reached in this block, by thread */
};

/* One launch at a time: __shared__ variables are statics. */
static pthread_mutex_t g_launch_mu = PTHREAD_MUTEX_INITIALIZER;

static void shim_fail(const char *what) {
    fprintf(stderr, "cuda shim: %s\n", what);
    abort();
}

#ifdef SHIM_FIBERS
/* Fibers (SHIM_FIBERS, the release plugin build/shim/libaerie-cuda.so):
 * a block's threads are fibers on the launching thread, each run until it
 * reaches a barrier or ends, round robin. Tens of times faster than one OS
 * thread per CUDA thread on a machine with few cores, which is what lets a
 * whole service run on it; the sanitizer builds keep real threads, which
 * TSan and ASan understand. A shuffle is a barrier of the whole block
 * here, so every warp must shuffle in step.
 *
 * A fiber is made once (makecontext, on its own stack) and lives across
 * blocks and launches: it parks between blocks, and every switch is a
 * _setjmp/_longjmp pair, which makes no system call (swapcontext saves
 * and restores the signal mask with one each time, and a barrier costs a
 * switch per thread). In a process with a sanitizer runtime (the ASan
 * services load this plugin in the integration tests) the switches are
 * swapcontext, which the runtime follows; its longjmp would take a jump
 * between stacks for a stack it cannot trust. (A process with the CET
 * shadow stack switched on would need swapcontext too: glibc's longjmp
 * does not switch shadow stacks. Debian's toolchain does not switch it
 * on.) */
struct fiber {
    jmp_buf jb;
    ucontext_t uc;
    dim3 tid;
    bool done;
    unsigned syncs;
};

#define FIBER_STACK (256u << 10)
static fiber g_fibers[SHIM_MAX_THREADS];
static char *g_stacks;        /* SHIM_MAX_THREADS x FIBER_STACK, made on first use */
static jmp_buf g_sched;       /* where the scheduler waits for the fiber it resumed */
static ucontext_t g_sched_uc; /* the same, for swapcontext */
static int g_jumps = -1;      /* _setjmp/_longjmp (1) or swapcontext (0); -1: not decided yet */
static unsigned g_cur, g_n;   /* the fiber running, and fibers in the block */
static unsigned g_made;       /* fibers made so far */
static launch *g_launch;
static double g_xch[SHIM_MAX_THREADS];

static void yield_to_sched(void) {
    fiber *f = &g_fibers[g_cur];
    if (!g_jumps) {
        swapcontext(&f->uc, &g_sched_uc);
    } else if (!_setjmp(f->jb)) {
        _longjmp(g_sched, 1);
    }
}

void __syncthreads(void) {
    g_fibers[g_cur].syncs++;
    yield_to_sched();
}

void __syncwarp(unsigned mask) {
    if (mask != 0xffffffffu) shim_fail("__syncwarp with a partial mask");
    __syncthreads();
}

static double shfl_xor(unsigned mask, double v, int lane_mask, int width) {
    if (mask != 0xffffffffu || width != SHIM_WARP) shim_fail("a shuffle with a partial mask or width");
    if (g_n % SHIM_WARP != 0) shim_fail("a shuffle in a block that is not whole warps");
    unsigned me = g_cur, lane = me % SHIM_WARP, base = me - lane;
    g_xch[me] = v;
    __syncthreads();
    double r = g_xch[base + (lane ^ (unsigned)lane_mask)];
    __syncthreads();
    return r;
}

/* A fiber's life: park, run a block's thread when resumed, say so, park. */
static void fiber_main(void) {
    for (;;) {
        yield_to_sched();
        (*g_launch->fn)();
        g_fibers[g_cur].done = true;
    }
}

/* Runs fiber i until it parks or reaches a barrier. */
static void resume(unsigned i) {
    g_cur = i;
    threadIdx = g_fibers[i].tid;
    if (!g_jumps) {
        swapcontext(&g_sched_uc, &g_fibers[i].uc);
    } else if (!_setjmp(g_sched)) {
        _longjmp(g_fibers[i].jb, 1);
    }
}

/* Makes fiber i on its stack and runs it to its first park. */
static void make_fiber(unsigned i) {
    if (g_jumps < 0) g_jumps = !dlsym(RTLD_DEFAULT, "__asan_init") && !dlsym(RTLD_DEFAULT, "__tsan_init");
    ucontext_t *uc = &g_fibers[i].uc;
    if (getcontext(uc) != 0) shim_fail("getcontext failed");
    uc->uc_stack.ss_sp = g_stacks + (size_t)i * FIBER_STACK;
    uc->uc_stack.ss_size = FIBER_STACK;
    uc->uc_link = NULL; /* fiber_main never returns */
    makecontext(uc, fiber_main, 0);
    g_cur = i;
    if (!g_jumps || !_setjmp(g_sched)) swapcontext(&g_sched_uc, uc);
}

void shim_launch(dim3 grid, dim3 block, const std::function<void()> &fn) {
    unsigned n = block.x * block.y * block.z;
    if (n == 0 || n > SHIM_MAX_THREADS) shim_fail("a block of 0 or more than 1024 threads");
    if (grid.x == 0 || grid.y == 0 || grid.z == 0) shim_fail("an empty grid");
    pthread_mutex_lock(&g_launch_mu);
    if (!g_stacks) {
        g_stacks = (char *)malloc((size_t)SHIM_MAX_THREADS * FIBER_STACK);
        if (!g_stacks) shim_fail("out of memory for fiber stacks");
    }
    launch l;
    l.grid = grid;
    l.block = block;
    l.fn = &fn;
    l.n_threads = n;
    g_launch = &l;
    g_n = n;
    blockDim = block;
    gridDim = grid;
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                blockIdx = dim3(bx, by, bz);
                for (; g_made < n; g_made++) make_fiber(g_made);
                for (unsigned i = 0; i < n; i++) {
                    fiber *f = &g_fibers[i];
                    f->tid = dim3(i % block.x, i / block.x % block.y, i / (block.x * block.y));
                    f->done = false;
                    f->syncs = 0;
                }
                /* Rounds: each fiber runs to its next barrier or its end;
                 * after a round every fiber still running must be at the
                 * same barrier, and none may have ended before it. */
                for (;;) {
                    unsigned running = 0;
                    for (unsigned i = 0; i < n; i++) {
                        if (g_fibers[i].done) continue;
                        resume(i);
                        running += !g_fibers[i].done;
                    }
                    for (unsigned i = 1; i < n; i++)
                        if (g_fibers[i].syncs != g_fibers[0].syncs)
                            shim_fail("threads of a block reached different numbers of __syncthreads");
                    if (running == 0) break;
                    if (running != n) shim_fail("threads of a block reached different numbers of __syncthreads");
                }
            }
    pthread_mutex_unlock(&g_launch_mu);
}

#else
static thread_local launch *t_launch;
static thread_local unsigned t_tid, t_syncs;

void __syncthreads(void) {
    t_syncs++;
    pthread_barrier_wait(&t_launch->block_bar);
}

static pthread_barrier_t *warp_barrier(void) { return &t_launch->warp_bar[t_tid / SHIM_WARP]; }

void __syncwarp(unsigned mask) {
    if (mask != 0xffffffffu) shim_fail("__syncwarp with a partial mask");
    pthread_barrier_wait(warp_barrier());
}

static double shfl_xor(unsigned mask, double v, int lane_mask, int width) {
    if (mask != 0xffffffffu || width != SHIM_WARP) shim_fail("a shuffle with a partial mask or width");
    if (t_launch->n_threads % SHIM_WARP != 0) shim_fail("a shuffle in a block that is not whole warps");
    unsigned lane = t_tid % SHIM_WARP, base = t_tid - lane;
    t_launch->xch[t_tid] = v;
    pthread_barrier_wait(warp_barrier());
    double r = t_launch->xch[base + (lane ^ (unsigned)lane_mask)];
    pthread_barrier_wait(warp_barrier());
    return r;
}

/* The threads that play CUDA threads: made on first need and kept (a
 * launch only wakes them), since making 128 threads per launch cost more
 * than the kernels. Worker i plays thread i of every block. */
struct worker {
    pthread_t th;
    sem_t start;
};
static worker g_workers[SHIM_MAX_THREADS];
static unsigned g_n_workers;
static launch *g_current; /* the launch being run; set before the workers are woken */
static sem_t g_done;

static void run_blocks(launch *l, unsigned tid) {
    t_launch = l;
    t_tid = tid;
    blockDim = l->block;
    gridDim = l->grid;
    threadIdx = dim3(tid % l->block.x, tid / l->block.x % l->block.y, tid / (l->block.x * l->block.y));
    for (unsigned bz = 0; bz < l->grid.z; bz++)
        for (unsigned by = 0; by < l->grid.y; by++)
            for (unsigned bx = 0; bx < l->grid.x; bx++) {
                blockIdx = dim3(bx, by, bz);
                t_syncs = 0;
                (*l->fn)();
                l->syncs[tid] = t_syncs;
                pthread_barrier_wait(&l->block_bar);
                if (tid == 0)
                    for (unsigned i = 1; i < l->n_threads; i++)
                        if (l->syncs[i] != l->syncs[0])
                            shim_fail("threads of a block reached different numbers of __syncthreads");
                pthread_barrier_wait(&l->block_bar);
            }
}

static void *worker_main(void *p) {
    unsigned tid = (unsigned)(uintptr_t)p;
    for (;;) {
        sem_wait(&g_workers[tid].start);
        run_blocks(g_current, tid);
        sem_post(&g_done);
    }
    return NULL;
}

static void ensure_workers(unsigned n) {
    if (g_n_workers == 0) sem_init(&g_done, 0, 0);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 1u << 20);
    for (; g_n_workers < n; g_n_workers++) {
        sem_init(&g_workers[g_n_workers].start, 0, 0);
        if (pthread_create(&g_workers[g_n_workers].th, &attr, worker_main, (void *)(uintptr_t)g_n_workers) != 0)
            shim_fail("pthread_create failed");
        pthread_detach(g_workers[g_n_workers].th);
    }
    pthread_attr_destroy(&attr);
}

void shim_launch(dim3 grid, dim3 block, const std::function<void()> &fn) {
    unsigned n = block.x * block.y * block.z;
    if (n == 0 || n > SHIM_MAX_THREADS) shim_fail("a block of 0 or more than 1024 threads");
    if (grid.x == 0 || grid.y == 0 || grid.z == 0) shim_fail("an empty grid");
    pthread_mutex_lock(&g_launch_mu);
    ensure_workers(n);
    launch *l = new launch();
    l->grid = grid;
    l->block = block;
    l->fn = &fn;
    l->n_threads = n;
    pthread_barrier_init(&l->block_bar, NULL, n);
    for (unsigned w = 0; w < (n + SHIM_WARP - 1) / SHIM_WARP; w++) {
        unsigned in_warp = n - w * SHIM_WARP < SHIM_WARP ? n - w * SHIM_WARP : SHIM_WARP;
        pthread_barrier_init(&l->warp_bar[w], NULL, in_warp);
    }
    g_current = l;
    for (unsigned i = 0; i < n; i++) sem_post(&g_workers[i].start);
    for (unsigned i = 0; i < n; i++) sem_wait(&g_done);
    pthread_barrier_destroy(&l->block_bar);
    for (unsigned w = 0; w < (n + SHIM_WARP - 1) / SHIM_WARP; w++) pthread_barrier_destroy(&l->warp_bar[w]);
    delete l;
    pthread_mutex_unlock(&g_launch_mu);
}

#endif

/* The shuffles of both ways, through shfl_xor. */
float __shfl_xor_sync(unsigned mask, float v, int lane_mask, int width) {
    return (float)shfl_xor(mask, v, lane_mask, width);
}
double __shfl_xor_sync(unsigned mask, double v, int lane_mask, int width) {
    return shfl_xor(mask, v, lane_mask, width);
}
int __shfl_xor_sync(unsigned mask, int v, int lane_mask, int width) {
    return (int)shfl_xor(mask, (double)v, lane_mask, width);
}

/* ---- runtime ------------------------------------------------------------ */

/* A graph's node: a launch, or a device-to-device copy. */
struct shim_graph_node {
    dim3 grid, block;
    std::function<void()> fn; /* empty: the copy */
    void *dst;
    const void *src;
    size_t n;
};
struct shim_graph {
    std::vector<shim_graph_node> nodes;
    size_t charged; /* device bytes it takes, once instantiated */
    int dev;        /* on this device */
};
struct shim_stream {
    bool capturing;
    bool invalidated;  /* a refused call while capturing */
    shim_graph *graph; /* what is being recorded */
};
struct shim_event {
    double at; /* seconds, when it was recorded: every call is synchronous */
};

static thread_local int t_dev; /* cudaSetDevice's, per thread as CUDA's */

/* Device d's memory: AERIE_SHIM_GPU_MIB, one figure for every device or
 * a list, one a device (the last for the rest). */
static size_t gpu_bytes_of(int d) {
    const char *s = getenv("AERIE_SHIM_GPU_MIB");
    long mib = 4096;
    for (int i = 0; s && *s; i++) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s) break;
        mib = v;
        if (i == d || *end != ',') break;
        s = end + 1;
    }
    return (size_t)(mib > 0 ? mib : 4096) << 20;
}
static size_t gpu_bytes(void) { return gpu_bytes_of(t_dev); }

/* AERIE_SHIM_DEVICES (default 1, at most SHIM_MAX_DEVICES) devices, each
 * with gpu_bytes() of its own; all of them host memory, so every device
 * reads every other's (peer access), unless AERIE_SHIM_NO_PEER=1. */
#define SHIM_MAX_DEVICES 8
static int n_devices(void) {
    const char *s = getenv("AERIE_SHIM_DEVICES");
    long n = s ? atol(s) : 1;
    return n >= 1 && n <= SHIM_MAX_DEVICES ? (int)n : 1;
}

static pthread_mutex_t g_mem_mu = PTHREAD_MUTEX_INITIALIZER;
static size_t g_used[SHIM_MAX_DEVICES]; /* bytes cudaMalloc handed out on each device and not freed */

/* The stream this thread captures, if any (capture mode thread-local or
 * global: either refuses this thread's unsafe calls). */
static thread_local shim_stream *t_capturing;

/* A call CUDA refuses while this thread captures: it fails, and the
 * capture is invalidated. */
static bool refused(void) {
    if (!t_capturing) return false;
    t_capturing->invalidated = true;
    return true;
}

const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    default: return "unknown error";
    }
}
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
cudaError_t cudaGetDeviceCount(int *n) {
    *n = n_devices();
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
    if (d < 0 || d >= n_devices()) return cudaErrorInvalidDevice;
    t_dev = d;
    return cudaSuccess;
}
cudaError_t cudaGetDevice(int *d) {
    *d = t_dev;
    return cudaSuccess;
}
cudaError_t cudaDeviceCanAccessPeer(int *can, int d, int peer) {
    if (d < 0 || d >= n_devices() || peer < 0 || peer >= n_devices()) return cudaErrorInvalidDevice;
    const char *no = getenv("AERIE_SHIM_NO_PEER");
    *can = d != peer && !(no && strcmp(no, "1") == 0);
    return cudaSuccess;
}
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags) {
    (void)flags;
    int can = 0;
    if (cudaDeviceCanAccessPeer(&can, t_dev, peer) != cudaSuccess || !can) return cudaErrorInvalidDevice;
    return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int d) {
    if (d < 0 || d >= n_devices()) return cudaErrorInvalidDevice;
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "cuda shim (CPU)");
    p->totalGlobalMem = gpu_bytes_of(d);
    p->major = 0;
    p->minor = 0;
    p->multiProcessorCount = 1;
    return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int *v) {
    *v = 0;
    return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int *v) {
    *v = 0;
    return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    pthread_mutex_lock(&g_mem_mu);
    size_t total = gpu_bytes();
    *total_bytes = total;
    *free_bytes = g_used[t_dev] < total ? total - g_used[t_dev] : 0;
    pthread_mutex_unlock(&g_mem_mu);
    return cudaSuccess;
}

/* Each allocation carries its size in front, for cudaMemGetInfo. */
#define SHIM_HDR 64
cudaError_t cudaMalloc(void **p, size_t n) {
    if (refused()) return cudaErrorStreamCaptureUnsupported;
    const int dev = t_dev;
    pthread_mutex_lock(&g_mem_mu);
    bool fits = n <= gpu_bytes() - g_used[dev] && g_used[dev] <= gpu_bytes();
    if (fits) g_used[dev] += n;
    pthread_mutex_unlock(&g_mem_mu);
    char *b = fits ? (char *)aligned_alloc(SHIM_HDR, (SHIM_HDR + n + SHIM_HDR - 1) / SHIM_HDR * SHIM_HDR) : NULL;
    if (!b) {
        if (fits) {
            pthread_mutex_lock(&g_mem_mu);
            g_used[dev] -= n;
            pthread_mutex_unlock(&g_mem_mu);
        }
        *p = NULL;
        return cudaErrorMemoryAllocation;
    }
    memcpy(b, &n, sizeof n);
    memcpy(b + sizeof n, &dev, sizeof dev);
    *p = b + SHIM_HDR;
    return cudaSuccess;
}
cudaError_t cudaFree(void *p) {
    if (refused()) return cudaErrorStreamCaptureUnsupported;
    if (!p) return cudaSuccess;
    char *b = (char *)p - SHIM_HDR;
    size_t n;
    int dev;
    memcpy(&n, b, sizeof n);
    memcpy(&dev, b + sizeof n, sizeof dev);
    pthread_mutex_lock(&g_mem_mu);
    g_used[dev] -= n;
    pthread_mutex_unlock(&g_mem_mu);
    free(b);
    return cudaSuccess;
}
cudaError_t cudaMemset(void *p, int v, size_t n) {
    if (refused()) return cudaErrorStreamCaptureUnsupported;
    memset(p, v, n);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s) {
    if (s->capturing) return refused(), cudaErrorStreamCaptureUnsupported; /* no memset nodes here */
    memset(p, v, n);
    return cudaSuccess;
}
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind k) {
    if (refused()) return cudaErrorStreamCaptureUnsupported;
    (void)k;
    if (n) memmove(dst, src, n);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind k, cudaStream_t s) {
    if (s->capturing) {
        /* Only copies within the device are recorded: a host array's
         * contents at replay are not what the caller may assume. */
        if (k != cudaMemcpyDeviceToDevice) return refused(), cudaErrorStreamCaptureUnsupported;
        shim_graph_node nd = {dim3(), dim3(), std::function<void()>(), dst, src, n};
        s->graph->nodes.push_back(nd);
        return cudaSuccess;
    }
    if (n) memmove(dst, src, n);
    return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
    if (refused()) return cudaErrorStreamCaptureUnsupported;
    return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags) {
    (void)flags;
    *s = new shim_stream();
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    if (s->capturing) return cudaErrorStreamCaptureUnsupported;
    delete s;
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    if (refused()) return cudaErrorStreamCaptureUnsupported;
    (void)s;
    return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
    (void)flags;
    *e = new shim_event();
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete e;
    return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t *e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    if (s->capturing) return refused(), cudaErrorStreamCaptureUnsupported; /* no event nodes here */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    e->at = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    if (refused()) return cudaErrorStreamCaptureUnsupported;
    (void)e;
    return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    *ms = (float)((end->at - start->at) * 1e3);
    return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags) {
    (void)s, (void)e, (void)flags;
    return cudaSuccess;
}

/* ---- graphs -------------------------------------------------------------- */

void shim_launch_on(cudaStream_t s, dim3 grid, dim3 block, const std::function<void()> &fn) {
    if (s && s->capturing) {
        shim_graph_node nd = {grid, block, fn, NULL, NULL, 0};
        s->graph->nodes.push_back(nd);
        return;
    }
    shim_launch(grid, block, fn);
}

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
    (void)mode;
    if (s->capturing || t_capturing) return cudaErrorInvalidValue; /* one capture per thread here */
    s->capturing = true;
    s->invalidated = false;
    s->graph = new shim_graph();
    s->graph->charged = 0;
    t_capturing = s;
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g) {
    if (!s->capturing) return cudaErrorInvalidValue;
    s->capturing = false;
    t_capturing = NULL;
    shim_graph *graph = s->graph;
    s->graph = NULL;
    if (s->invalidated) {
        delete graph;
        *g = NULL;
        return cudaErrorStreamCaptureInvalidated;
    }
    *g = graph;
    return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus *status) {
    *status = !s->capturing    ? cudaStreamCaptureStatusNone
              : s->invalidated ? cudaStreamCaptureStatusInvalidated
                               : cudaStreamCaptureStatusActive;
    return cudaSuccess;
}

cudaError_t cudaGraphGetNodes(cudaGraph_t g, cudaGraphNode_t *nodes, size_t *n) {
    if (nodes) return cudaErrorInvalidValue; /* only the count, here */
    *n = g->nodes.size();
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t g, unsigned long long flags) {
    (void)flags;
    if (refused()) return cudaErrorStreamCaptureUnsupported;
    size_t bytes = g->nodes.size() * SHIM_GRAPH_NODE_BYTES;
    pthread_mutex_lock(&g_mem_mu);
    bool fits = bytes <= gpu_bytes() - g_used[t_dev] && g_used[t_dev] <= gpu_bytes();
    if (fits) g_used[t_dev] += bytes;
    pthread_mutex_unlock(&g_mem_mu);
    if (!fits) return cudaErrorMemoryAllocation;
    shim_graph *e = new shim_graph(*g);
    e->charged = bytes;
    e->dev = t_dev;
    *exec = e;
    return cudaSuccess;
}

cudaError_t cudaGraphUpload(cudaGraphExec_t exec, cudaStream_t s) {
    (void)exec;
    if (s->capturing) return refused(), cudaErrorStreamCaptureUnsupported;
    return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
    if (s->capturing) return refused(), cudaErrorStreamCaptureUnsupported; /* no child graphs here */
    for (const shim_graph_node &nd : exec->nodes) {
        if (nd.fn)
            shim_launch(nd.grid, nd.block, nd.fn);
        else if (nd.n)
            memmove(nd.dst, nd.src, nd.n);
    }
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
    if (!exec) return cudaSuccess;
    pthread_mutex_lock(&g_mem_mu);
    g_used[exec->dev] -= exec->charged;
    pthread_mutex_unlock(&g_mem_mu);
    delete exec;
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t g) {
    delete g;
    return cudaSuccess;
}
