/* Allreduce for ranks that are threads of this process (kernels.h
 * kn_comm), on the CUDA backend: the backend's comm_init.
 *
 * Every rank is on the plugin's device for now (kn_cuda.cu drives one):
 * that is tensor parallelism as tests/gpu/run.sh runs it on one GPU, and
 * the bits and the counts of the real thing. Ranks on a GPU each need
 * per-device backends (ARCHITECTURE.md, "Tensor parallelism").
 *
 * Two kinds:
 *   - custom: a one-shot allreduce. Rank r copies its partial into slot
 *     [p][r] (p: the call's parity), records `ready`, and meets the other
 *     ranks' threads at a host barrier, so every rank's `ready` of this call
 *     is recorded; its stream then waits for the others' `ready` and one
 *     kernel adds the R slots in rank order (the CPU communicator's bits),
 *     optionally into the residual stream (kn_allreduce_add). `done` marks
 *     its reads. The slots alternate by parity, so rank r's copy of call
 *     k + 2 waits only for the others' `done` of call k, which they recorded
 *     before they reached call k + 1's barrier, which r has passed.
 *   - nccl: ncclAllReduce in place on the rank's stream, with communicators
 *     from ncclCommInitAll. libnccl is opened with dlopen when first asked
 *     for ($AERIE_NCCL_LIB, else libnccl.so.2), so the plugin loads where
 *     NCCL is absent; the entry points and enum values are NCCL's public C
 *     ABI (nccl.h), the header is not needed to build.
 *
 * Time: each call is bracketed by two timing events on the rank's stream;
 * kn_comm_get_stats adds up the finished pairs (waiting for those in
 * flight). */
#include "kn_cuda.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#define KCU_COMM_MAX 64   /* ranks */
#define KCU_TIMED 512     /* calls whose events may be in flight at once, per rank */

/* err_set's rule (the first error is kept), without linking libaerie. */
__attribute__((format(printf, 2, 3))) static int fail(ae_error *err, const char *fmt, ...) {
    if (err && err->msg[0] == '\0') {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return AE_ERR;
}

/* ---- NCCL, by dlopen -------------------------------------------------------- */

typedef void *kcu_nccl_comm;
enum { KCU_NCCL_OK = 0, KCU_NCCL_FLOAT32 = 7, KCU_NCCL_SUM = 0 };
static struct {
    bool tried, ok;
    char why[200];
    int version;
    int (*get_version)(int *);
    int (*init_all)(kcu_nccl_comm *, int, const int *);
    int (*all_reduce)(const void *, void *, size_t, int, int, kcu_nccl_comm, cudaStream_t);
    int (*destroy)(kcu_nccl_comm);
    const char *(*error_string)(int);
} g_nccl;
static pthread_mutex_t g_nccl_mu = PTHREAD_MUTEX_INITIALIZER;

static bool nccl_open(void) {
    pthread_mutex_lock(&g_nccl_mu);
    if (!g_nccl.tried) {
        g_nccl.tried = true;
#ifdef KN_CUDA_SHIM
        snprintf(g_nccl.why, sizeof g_nccl.why, "the CPU shim has no NCCL (it needs a GPU)");
#else
        const char *env = getenv("AERIE_NCCL_LIB");
        const char *name = env && env[0] ? env : "libnccl.so.2";
        void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            const char *d = dlerror();
            snprintf(g_nccl.why, sizeof g_nccl.why, "cannot open %s: %s (set AERIE_NCCL_LIB to its path)", name,
                     d ? d : "?");
        } else {
            *(void **)&g_nccl.get_version = dlsym(h, "ncclGetVersion");
            *(void **)&g_nccl.init_all = dlsym(h, "ncclCommInitAll");
            *(void **)&g_nccl.all_reduce = dlsym(h, "ncclAllReduce");
            *(void **)&g_nccl.destroy = dlsym(h, "ncclCommDestroy");
            *(void **)&g_nccl.error_string = dlsym(h, "ncclGetErrorString");
            if (!g_nccl.get_version || !g_nccl.init_all || !g_nccl.all_reduce || !g_nccl.destroy ||
                !g_nccl.error_string || g_nccl.get_version(&g_nccl.version) != KCU_NCCL_OK) {
                snprintf(g_nccl.why, sizeof g_nccl.why, "%s lacks NCCL's entry points", name);
                dlclose(h);
            } else {
                g_nccl.ok = true;
                fprintf(stderr, "aerie cuda: NCCL %d.%d.%d from %s\n", g_nccl.version / 10000,
                        g_nccl.version / 100 % 100, g_nccl.version % 100, name);
            }
        }
#endif
    }
    bool ok = g_nccl.ok;
    pthread_mutex_unlock(&g_nccl_mu);
    return ok;
}

/* ---- the group -------------------------------------------------------------- */

struct kcu_group {
    int n;
    size_t max;
    int refs;
    /* custom */
    float *slots; /* device: [2][n][max] */
    cudaEvent_t ready[2][KCU_COMM_MAX], done[2][KCU_COMM_MAX];
    pthread_barrier_t bar;
    bool bar_ready;
};

struct kcu_comm {
    kn_comm base; /* backend.h */
    kcu_group *g;
    kcu_nccl_comm nccl;
    uint64_t seq; /* this rank's calls: the parity of the slots */
    /* timing: pairs [head, head + pending) (mod KCU_TIMED) are recorded and not yet added */
    cudaEvent_t t0[KCU_TIMED], t1[KCU_TIMED];
    int head, pending;
};
#define KCU_COMM(c) ((kcu_comm *)(c))

/* Adds the oldest recorded pair's time, waiting for it. */
static void harvest_one(kcu_comm *c) {
    cudaEvent_t a = c->t0[c->head], b = c->t1[c->head];
    KN_CK(cudaEventSynchronize(b));
    float ms = 0.0f;
    KN_CK(cudaEventElapsedTime(&ms, a, b));
    c->base.stats.ns += (uint64_t)((double)ms * 1e6 + 0.5);
    c->head = (c->head + 1) % KCU_TIMED;
    c->pending--;
}

static void time_begin(kcu_comm *c, cudaStream_t st) {
    if (c->pending == KCU_TIMED) harvest_one(c);
    int i = (c->head + c->pending) % KCU_TIMED;
    KN_CK(cudaEventRecord(c->t0[i], st));
}

static void time_end(kcu_comm *c, cudaStream_t st) {
    int i = (c->head + c->pending) % KCU_TIMED;
    KN_CK(cudaEventRecord(c->t1[i], st));
    c->pending++;
}

static void comm_update_stats(kn_comm *base) {
    kcu_bind();
    kcu_comm *c = KCU_COMM(base);
    while (c->pending > 0) harvest_one(c);
}

/* out[i] = (x[i] +) the sum of slots[r][i] over r = 0..n-1, in rank order. */
__global__ void __launch_bounds__(256) k_allreduce_slots(const float *slots, int n, size_t stride, const float *x,
                                                         float *out, size_t count) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    float sum = slots[i];
    for (int r = 1; r < n; r++) sum = sum + slots[(size_t)r * stride + i];
    out[i] = x ? x[i] + sum : sum;
}

static void custom_run(kn_comm *base, kn_stream *s, float *buf, float *x, size_t count) {
    kcu_bind();
    kcu_comm *c = KCU_COMM(base);
    kcu_group *g = c->g;
    cudaStream_t st = KN_CU(s)->st;
    const int r = base->rank, p = (int)(c->seq++ & 1);
    time_begin(c, st);
    float *mine = g->slots + ((size_t)p * (size_t)g->n + (size_t)r) * g->max;
    for (int q = 0; q < g->n; q++)
        if (q != r) KN_CK(cudaStreamWaitEvent(st, g->done[p][q], 0)); /* their reads of call seq - 2 */
    KN_CK(cudaMemcpyAsync(mine, buf, count * sizeof(float), cudaMemcpyDeviceToDevice, st));
    KN_CK(cudaEventRecord(g->ready[p][r], st));
    pthread_barrier_wait(&g->bar);
    for (int q = 0; q < g->n; q++)
        if (q != r) KN_CK(cudaStreamWaitEvent(st, g->ready[p][q], 0));
    unsigned blocks = (unsigned)((count + 255) / 256);
    if (blocks)
        KN_LAUNCH(k_allreduce_slots, dim3(blocks), dim3(256), st, g->slots + (size_t)p * (size_t)g->n * g->max, g->n,
                  g->max, x, x ? x : buf, count);
    KN_CK(cudaEventRecord(g->done[p][r], st));
    time_end(c, st);
    if (kcu_sync_launches()) KN_CK(cudaStreamSynchronize(st));
}

static void custom_allreduce(kn_comm *c, kn_stream *s, float *buf, size_t count) { custom_run(c, s, buf, NULL, count); }
static void custom_allreduce_add(kn_comm *c, kn_stream *s, float *buf, float *x, size_t count) {
    custom_run(c, s, buf, x, count);
}

static void nccl_allreduce(kn_comm *base, kn_stream *s, float *buf, size_t count) {
    kcu_bind();
    kcu_comm *c = KCU_COMM(base);
    cudaStream_t st = KN_CU(s)->st;
    time_begin(c, st);
    int rc = g_nccl.all_reduce(buf, buf, count, KCU_NCCL_FLOAT32, KCU_NCCL_SUM, c->nccl, st);
    if (rc != KCU_NCCL_OK) {
        fprintf(stderr, "aerie cuda: ncclAllReduce of %zu floats failed on rank %d: %s (%d)\n", count, base->rank,
                g_nccl.error_string(rc), rc);
        fflush(stderr);
        abort();
    }
    time_end(c, st);
    if (kcu_sync_launches()) KN_CK(cudaStreamSynchronize(st));
}

/* Frees the group's own resources (its ranks are gone). */
static void group_release(kcu_group *g) {
    KN_CK(cudaDeviceSynchronize()); /* the slots' last readers */
    for (int p = 0; p < 2; p++)
        for (int r = 0; r < g->n; r++) {
            if (g->ready[p][r]) KN_CK(cudaEventDestroy(g->ready[p][r]));
            if (g->done[p][r]) KN_CK(cudaEventDestroy(g->done[p][r]));
        }
    if (g->slots) KN_CK(cudaFree(g->slots));
    if (g->bar_ready) pthread_barrier_destroy(&g->bar);
    free(g);
}

static void group_free(kn_comm **comms, int n_ranks) {
    kcu_bind();
    kcu_group *g = NULL;
    for (int r = 0; r < n_ranks; r++) {
        kcu_comm *c = KCU_COMM(comms[r]);
        if (!c) continue;
        g = c->g;
        while (c->pending > 0) harvest_one(c); /* nothing of it is left in flight */
        for (int i = 0; i < KCU_TIMED; i++) {
            if (c->t0[i]) KN_CK(cudaEventDestroy(c->t0[i]));
            if (c->t1[i]) KN_CK(cudaEventDestroy(c->t1[i]));
        }
        if (c->nccl) g_nccl.destroy(c->nccl);
        free(c);
        comms[r] = NULL;
        g->refs--;
    }
    if (g && g->refs == 0) group_release(g);
}

static const kn_comm_ops custom_ops = {KN_ALLREDUCE_CUSTOM, custom_allreduce, custom_allreduce_add, comm_update_stats,
                                       group_free};
static const kn_comm_ops nccl_ops = {KN_ALLREDUCE_NCCL, nccl_allreduce, NULL, comm_update_stats, group_free};

/* Frees a group half made: through its ranks if any holds it. */
static int init_fail(kcu_group *g, kn_comm **comms, int n_ranks) {
    if (g->refs > 0) group_free(comms, n_ranks);
    else group_release(g);
    return AE_ERR;
}

int kcu_comm_init(kn_allreduce kind, kn_comm **comms, int n_ranks, size_t max_count, ae_error *err) {
    kcu_bind();
    for (int r = 0; r < n_ranks; r++) comms[r] = NULL;
    if (n_ranks < 1 || n_ranks > KCU_COMM_MAX)
        return fail(err, "cuda comm: ranks must be in 1..%d, got %d", KCU_COMM_MAX, n_ranks);
    if (kind != KN_ALLREDUCE_CUSTOM && kind != KN_ALLREDUCE_NCCL)
        return fail(err, "cuda comm: the cuda backend's ranks reduce with --allreduce nccl or custom, not %s",
                    kind == KN_ALLREDUCE_CPU ? "cpu" : "auto");
    if (kind == KN_ALLREDUCE_NCCL && !nccl_open()) return fail(err, "cuda comm: nccl: %s", g_nccl.why);
    if (max_count > SIZE_MAX / sizeof(float) / 2 / (size_t)n_ranks)
        return fail(err, "cuda comm: %zu floats per rank is too large", max_count);
    kcu_group *g = (kcu_group *)calloc(1, sizeof *g);
    if (!g) return fail(err, "cuda comm: out of host memory");
    g->n = n_ranks;
    g->max = max_count ? max_count : 1;
    if (kind == KN_ALLREDUCE_CUSTOM) {
        size_t bytes = 2 * (size_t)n_ranks * g->max * sizeof(float);
        cudaError_t e = cudaMalloc((void **)&g->slots, bytes);
        if (e != cudaSuccess) {
            cudaGetLastError();
            g->slots = NULL;
            fail(err, "cuda comm: cannot allocate the custom allreduce's %zu bytes of slots on cuda:%d: %s", bytes,
                 kcu_device(), cudaGetErrorString(e));
            return init_fail(g, comms, n_ranks);
        }
        for (int p = 0; p < 2; p++)
            for (int r = 0; r < n_ranks; r++) {
                KN_CK(cudaEventCreateWithFlags(&g->ready[p][r], cudaEventDisableTiming));
                KN_CK(cudaEventCreateWithFlags(&g->done[p][r], cudaEventDisableTiming));
            }
        if (pthread_barrier_init(&g->bar, NULL, (unsigned)n_ranks) != 0) {
            fail(err, "cuda comm: cannot make a barrier for %d ranks", n_ranks);
            return init_fail(g, comms, n_ranks);
        }
        g->bar_ready = true;
    }
    kcu_nccl_comm nc[KCU_COMM_MAX] = {0};
    if (kind == KN_ALLREDUCE_NCCL) {
        int dev[KCU_COMM_MAX];
        for (int r = 0; r < n_ranks; r++) dev[r] = kcu_device();
        int rc = g_nccl.init_all(nc, n_ranks, dev);
        if (rc != KCU_NCCL_OK) {
            fail(err, "cuda comm: ncclCommInitAll for %d ranks on cuda:%d: %s (%d)%s", n_ranks, kcu_device(),
                 g_nccl.error_string(rc), rc,
                 n_ranks > 1 ? "; ranks that share a GPU need NCCL 2.30 or later and NCCL_MULTI_RANK_GPU_ENABLE=1"
                             : "");
            return init_fail(g, comms, n_ranks);
        }
    }
    const kn_comm_ops *ops = kind == KN_ALLREDUCE_NCCL ? &nccl_ops : &custom_ops;
    for (int r = 0; r < n_ranks; r++) {
        kcu_comm *c = (kcu_comm *)calloc(1, sizeof *c);
        if (!c) {
            for (int q = r; q < n_ranks; q++)
                if (nc[q]) g_nccl.destroy(nc[q]);
            fail(err, "cuda comm: out of host memory");
            return init_fail(g, comms, n_ranks);
        }
        c->base.ops = ops;
        c->base.rank = r;
        c->base.n_ranks = n_ranks;
        c->base.max_count = max_count;
        c->g = g;
        c->nccl = nc[r];
        g->refs++;
        comms[r] = &c->base;
        for (int i = 0; i < KCU_TIMED; i++) {
            KN_CK(cudaEventCreate(&c->t0[i]));
            KN_CK(cudaEventCreate(&c->t1[i]));
        }
    }
    return AE_OK;
}
