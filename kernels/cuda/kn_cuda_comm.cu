/* Allreduce for ranks that are threads of this process (kernels.h
 * kn_comm), on the CUDA backend: the backend's comm_init.
 *
 * Rank r is on the device of its table (kcu_dev_of): ranks may share one
 * GPU (tests/gpu/run.sh on the one lent) or have one each.
 *
 * Two kinds:
 *   - custom: a one-shot allreduce. Rank r copies its partial into its
 *     slot p (p: the call's parity; the slots are on the rank's device,
 *     read by the others by peer access, which it needs), records `ready`, and meets the other
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

#define KCU_COMM_MAX KN_COMM_MAX_RANKS
static_assert(sizeof(((kcu_slots *)0)->p) / sizeof(float *) == KCU_COMM_MAX, "kcu_slots holds every rank");
#define KCU_TIMED 512 /* calls whose events may be in flight at once, per rank */

#define fail kcu_fail

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
    int (*group_start)(void);
    int (*group_end)(void);
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
            *(void **)&g_nccl.group_start = dlsym(h, "ncclGroupStart");
            *(void **)&g_nccl.group_end = dlsym(h, "ncclGroupEnd");
            if (!g_nccl.get_version || !g_nccl.init_all || !g_nccl.all_reduce || !g_nccl.destroy ||
                !g_nccl.error_string || !g_nccl.group_start || !g_nccl.group_end ||
                g_nccl.get_version(&g_nccl.version) != KCU_NCCL_OK) {
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
    int dev[KCU_COMM_MAX]; /* rank r's device */
    /* custom */
    float *slots[KCU_COMM_MAX]; /* rank r's, on its device: [2][max] */
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

/* Rank 0's calls only (kernels.h: the time is rank 0's), so that the
 * other ranks record nothing they never read. */
static void time_begin(kcu_comm *c, cudaStream_t st) {
    if (c->base.rank != 0) return;
    if (c->pending == KCU_TIMED) harvest_one(c);
    int i = (c->head + c->pending) % KCU_TIMED;
    KN_CK(cudaEventRecord(c->t0[i], st));
}

static void time_end(kcu_comm *c, cudaStream_t st) {
    if (c->base.rank != 0) return;
    int i = (c->head + c->pending) % KCU_TIMED;
    KN_CK(cudaEventRecord(c->t1[i], st));
    c->pending++;
}

static void comm_update_stats(kn_comm *base) {
    kcu_comm *c = KCU_COMM(base);
    kcu_bind(c->g->dev[base->rank]);
    while (c->pending > 0) harvest_one(c);
}

/* out[i] = (x[i] +) the sum of slots.p[r][i] over r = 0..n-1, in rank order. */
__global__ void __launch_bounds__(256)
    k_allreduce_slots(kcu_slots slots, int n, const float *x, float *out, size_t count) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    float sum = slots.p[0][i];
    for (int r = 1; r < n; r++) sum = sum + slots.p[r][i];
    out[i] = x ? x[i] + sum : sum;
}

/* The fused norm after the add (kn_allreduce_add_rmsnorm), or none. */
struct kcu_norm {
    const float *g;
    float *y;
    int64_t m, n;
    float eps;
};

static void custom_run(kn_comm *base, kn_stream *s, float *buf, float *x, size_t count, const kcu_norm *norm) {
    kcu_comm *c = KCU_COMM(base);
    kcu_group *g = c->g;
    KCU_ASSERT(KN_CU(s)->dev == g->dev[base->rank]);
    kcu_bind(KN_CU(s)->dev);
    cudaStream_t st = KN_CU(s)->st;
    const int r = base->rank, p = (int)(c->seq++ & 1);
    time_begin(c, st);
    float *mine = g->slots[r] + (size_t)p * g->max;
    for (int q = 0; q < g->n; q++)
        if (q != r) KN_CK(cudaStreamWaitEvent(st, g->done[p][q], 0)); /* their reads of call seq - 2 */
    KN_CK(cudaMemcpyAsync(mine, buf, count * sizeof(float), cudaMemcpyDeviceToDevice, st));
    KN_CK(cudaEventRecord(g->ready[p][r], st));
    pthread_barrier_wait(&g->bar);
    for (int q = 0; q < g->n; q++)
        if (q != r) KN_CK(cudaStreamWaitEvent(st, g->ready[p][q], 0));
    kcu_slots all;
    for (int q = 0; q < g->n; q++) all.p[q] = g->slots[q] + (size_t)p * g->max;
    unsigned blocks = (unsigned)((count + 255) / 256);
    if (norm)
        kcu_launch_add_rmsnorm(st, &all, g->n, x, norm->g, norm->y, norm->m, norm->n, norm->eps);
    else if (blocks)
        KN_LAUNCH(k_allreduce_slots, dim3(blocks), dim3(256), st, all, g->n, x, x ? x : buf, count);
    KN_CK(cudaEventRecord(g->done[p][r], st));
    time_end(c, st);
    if (kcu_sync_launches()) KN_CK(cudaStreamSynchronize(st));
}

static void custom_allreduce(kn_comm *c, kn_stream *s, float *buf, size_t count) {
    custom_run(c, s, buf, NULL, count, NULL);
}
static void custom_allreduce_add(kn_comm *c, kn_stream *s, float *buf, float *x, size_t count) {
    custom_run(c, s, buf, x, count, NULL);
}
static void custom_allreduce_add_rmsnorm(kn_comm *c, kn_stream *s, float *buf, float *x, const float *g, float *y,
                                         int64_t m, int64_t n, float eps) {
    kcu_norm norm = {g, y, m, n, eps};
    custom_run(c, s, buf, x, (size_t)m * (size_t)n, &norm);
}

static void nccl_allreduce(kn_comm *base, kn_stream *s, float *buf, size_t count) {
    kcu_comm *c = KCU_COMM(base);
    KCU_ASSERT(KN_CU(s)->dev == c->g->dev[base->rank]);
    kcu_bind(KN_CU(s)->dev);
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
    for (int r = 0; r < g->n; r++) { /* the slots' last readers, on every device */
        kcu_bind(g->dev[r]);
        KN_CK(cudaDeviceSynchronize());
    }
    for (int r = 0; r < g->n; r++) {
        kcu_bind(g->dev[r]);
        for (int p = 0; p < 2; p++) {
            if (g->ready[p][r]) KN_CK(cudaEventDestroy(g->ready[p][r]));
            if (g->done[p][r]) KN_CK(cudaEventDestroy(g->done[p][r]));
        }
        if (g->slots[r]) KN_CK(cudaFree(g->slots[r]));
    }
    if (g->bar_ready) pthread_barrier_destroy(&g->bar);
    free(g);
}

static void group_free(kn_comm **comms, int n_ranks) {
    kcu_group *g = NULL;
    for (int r = 0; r < n_ranks; r++) {
        kcu_comm *c = KCU_COMM(comms[r]);
        if (!c) continue;
        g = c->g;
        kcu_bind(g->dev[r]);
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

static const kn_comm_ops custom_ops = {
    .kind = KN_ALLREDUCE_CUSTOM,
    .allreduce = custom_allreduce,
    .allreduce_add = custom_allreduce_add,
    .allreduce_add_rmsnorm = custom_allreduce_add_rmsnorm,
    .update_stats = comm_update_stats,
    .free_group = group_free,
};
static const kn_comm_ops nccl_ops = {
    .kind = KN_ALLREDUCE_NCCL,
    .allreduce = nccl_allreduce,
    .allreduce_add = NULL,
    .allreduce_add_rmsnorm = NULL,
    .update_stats = comm_update_stats,
    .free_group = group_free,
};

/* NCCL sets up its connections and their buffers at the first collective
 * (2.22 on), not at ncclCommInitAll: one allreduce of one float on every
 * rank now, so that a failure (no memory left for them) is an error
 * here rather than an abort in a pass. */
static int nccl_warm(const kcu_nccl_comm *nc, const int *dev, int n, ae_error *err) {
    cudaStream_t st[KCU_COMM_MAX];
    float *b[KCU_COMM_MAX];
    for (int r = 0; r < n; r++) {
        kcu_bind(dev[r]);
        KN_CK(cudaStreamCreateWithFlags(&st[r], cudaStreamNonBlocking));
        KN_CK(cudaMalloc((void **)&b[r], sizeof(float)));
        KN_CK(cudaMemsetAsync(b[r], 0, sizeof(float), st[r]));
    }
    int rc = g_nccl.group_start(), first = rc;
    for (int r = 0; r < n && rc == KCU_NCCL_OK; r++) {
        kcu_bind(dev[r]);
        rc = g_nccl.all_reduce(b[r], b[r], 1, KCU_NCCL_FLOAT32, KCU_NCCL_SUM, nc[r], st[r]);
        if (first == KCU_NCCL_OK) first = rc;
    }
    rc = g_nccl.group_end();
    if (first == KCU_NCCL_OK) first = rc;
    for (int r = 0; r < n; r++) {
        kcu_bind(dev[r]);
        if (first == KCU_NCCL_OK) KN_CK(cudaStreamSynchronize(st[r]));
        KN_CK(cudaFree(b[r]));
        KN_CK(cudaStreamDestroy(st[r]));
    }
    if (first != KCU_NCCL_OK)
        return fail(err, "cuda comm: nccl: the first allreduce of %d ranks failed: %s (%d)", n,
                    g_nccl.error_string(first), first);
    return AE_OK;
}

/* Frees a group half made: through its ranks if any holds it. */
static int init_fail(kcu_group *g, kn_comm **comms, int n_ranks) {
    if (g->refs > 0)
        group_free(comms, n_ranks);
    else
        group_release(g);
    return AE_ERR;
}

int kcu_comm_init(kn_allreduce kind, kn_comm **comms, int n_ranks, const kn_backend *const *rank_be, size_t max_count,
                  ae_error *err) {
    for (int r = 0; r < n_ranks; r++) comms[r] = NULL;
    if (n_ranks < 1 || n_ranks > KCU_COMM_MAX)
        return fail(err, "cuda comm: ranks must be in 1..%d, got %d", KCU_COMM_MAX, n_ranks);
    if (kind != KN_ALLREDUCE_CUSTOM && kind != KN_ALLREDUCE_NCCL)
        return fail(err, "cuda comm: the cuda backend's ranks reduce with --allreduce nccl or custom, not %s",
                    kind == KN_ALLREDUCE_CPU ? "cpu" : "auto");
    if (kind == KN_ALLREDUCE_NCCL && !nccl_open()) return fail(err, "cuda comm: nccl: %s", g_nccl.why);
    if (max_count > SIZE_MAX / sizeof(float) / 2)
        return fail(err, "cuda comm: %zu floats per rank is too large", max_count);
    int dev[KCU_COMM_MAX];
    for (int r = 0; r < n_ranks; r++) dev[r] = kcu_dev_of(rank_be[r]);
    /* The custom kind's kernel reads every rank's slot where it is. */
    for (int r = 0; r < n_ranks && kind == KN_ALLREDUCE_CUSTOM; r++)
        for (int q = 0; q < n_ranks; q++)
            if (!kcu_reads(rank_be[r], rank_be[q])) /* peer access on, not only possible */
                return fail(err,
                            "cuda comm: custom: rank %d on cuda:%d cannot read rank %d's memory on cuda:%d (no "
                            "peer access); use --allreduce nccl",
                            r, dev[r], q, dev[q]);
    kcu_group *g = (kcu_group *)calloc(1, sizeof *g);
    if (!g) return fail(err, "cuda comm: out of host memory");
    g->n = n_ranks;
    g->max = max_count ? max_count : 1;
    memcpy(g->dev, dev, (size_t)n_ranks * sizeof *dev);
    for (int r = 0; r < n_ranks && kind == KN_ALLREDUCE_CUSTOM; r++) {
        kcu_bind(dev[r]);
        size_t bytes = 2 * g->max * sizeof(float);
        cudaError_t e = cudaMalloc((void **)&g->slots[r], bytes);
        if (e != cudaSuccess) {
            cudaGetLastError();
            g->slots[r] = NULL;
            fail(err, "cuda comm: cannot allocate rank %d's %zu bytes of custom allreduce slots on cuda:%d: %s", r,
                 bytes, dev[r], cudaGetErrorString(e));
            return init_fail(g, comms, n_ranks);
        }
        for (int p = 0; p < 2; p++) {
            KN_CK(cudaEventCreateWithFlags(&g->ready[p][r], cudaEventDisableTiming));
            KN_CK(cudaEventCreateWithFlags(&g->done[p][r], cudaEventDisableTiming));
        }
    }
    if (kind == KN_ALLREDUCE_CUSTOM) {
        if (pthread_barrier_init(&g->bar, NULL, (unsigned)n_ranks) != 0) {
            fail(err, "cuda comm: cannot make a barrier for %d ranks", n_ranks);
            return init_fail(g, comms, n_ranks);
        }
        g->bar_ready = true;
    }
    kcu_nccl_comm nc[KCU_COMM_MAX] = {0};
    if (kind == KN_ALLREDUCE_NCCL) {
        int rc = g_nccl.init_all(nc, n_ranks, dev);
        if (rc != KCU_NCCL_OK) {
            bool shared = false;
            for (int r = 1; r < n_ranks; r++) shared = shared || dev[r] == dev[0];
            fail(err, "cuda comm: ncclCommInitAll for %d ranks (cuda:%d first): %s (%d)%s", n_ranks, dev[0],
                 g_nccl.error_string(rc), rc,
                 shared ? "; ranks that share a GPU need NCCL 2.30 or later and NCCL_MULTI_RANK_GPU_ENABLE=1" : "");
            return init_fail(g, comms, n_ranks);
        }
        if (nccl_warm(nc, dev, n_ranks, err) != AE_OK) {
            for (int r = 0; r < n_ranks; r++) g_nccl.destroy(nc[r]);
            return init_fail(g, comms, n_ranks);
        }
    }
    const kn_comm_ops *ops = kind == KN_ALLREDUCE_NCCL ? &nccl_ops : &custom_ops;
    for (int r = 0; r < n_ranks; r++) {
        kcu_bind(dev[r]);
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
        for (int i = 0; i < KCU_TIMED && r == 0; i++) {
            KN_CK(cudaEventCreate(&c->t0[i]));
            KN_CK(cudaEventCreate(&c->t1[i]));
        }
    }
    return AE_OK;
}
