/* Allreduce for ranks that are threads of one process.
 *
 * Each rank publishes its buffer in its own slot, waits for all, then sums
 * every slot itself in rank order, so all ranks compute the same bits; a
 * second barrier keeps a fast rank from overwriting its slot for the next
 * call while a slow one is still reading. */
#include "kn_cpu_impl.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct comm_group {
    int n_ranks;
    size_t max_count;
    float *slots; /* [n_ranks][max_count] */
    pthread_barrier_t barrier;
    int refs; /* ranks still holding the group, for kn_comm_free */
} comm_group;

typedef struct cpu_comm {
    kn_comm base; /* backend.h */
    comm_group *group;
} cpu_comm;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void cpu_allreduce(kn_comm *base, kn_stream *s, float *buf, size_t count) {
    (void)s;
    uint64_t t0 = now_ns();
    cpu_comm *c = (cpu_comm *)base;
    comm_group *g = c->group;
    memcpy(g->slots + (size_t)base->rank * g->max_count, buf, count * sizeof(float));
    pthread_barrier_wait(&g->barrier);
    for (size_t i = 0; i < count; i++) {
        float sum = g->slots[i];
        for (int r = 1; r < g->n_ranks; r++) sum = sum + g->slots[(size_t)r * g->max_count + i];
        buf[i] = sum;
    }
    pthread_barrier_wait(&g->barrier);
    base->stats.ns += now_ns() - t0;
}

static void cpu_free_group(kn_comm **comms, int n_ranks) {
    for (int r = 0; r < n_ranks; r++) {
        cpu_comm *c = (cpu_comm *)comms[r];
        if (!c) continue;
        comm_group *g = c->group;
        if (--g->refs == 0) {
            pthread_barrier_destroy(&g->barrier);
            free(g->slots);
            free(g);
        }
        free(c);
        comms[r] = NULL;
    }
}

static const kn_comm_ops cpu_comm_ops = {.kind = KN_ALLREDUCE_CPU,
                                         .allreduce = cpu_allreduce,
                                         .allreduce_add = NULL,
                                         .allreduce_add_rmsnorm = NULL,
                                         .update_stats = NULL,
                                         .free_group = cpu_free_group};

int kn_comm_init_cpu(kn_comm **comms, int n_ranks, size_t max_count, ae_error *err) {
    if (n_ranks < 1 || n_ranks > POOL_MAX_THREADS)
        return err_set(err, "comm: ranks must be in 1..%d, got %d", POOL_MAX_THREADS, n_ranks);
    for (int r = 0; r < n_ranks; r++) comms[r] = NULL;
    if (max_count > SIZE_MAX / sizeof(float) / (size_t)n_ranks)
        return err_set(err, "comm: %zu floats per rank is too large", max_count);
    comm_group *g = calloc(1, sizeof *g);
    if (!g) return err_set(err, "comm: out of memory");
    g->n_ranks = n_ranks;
    g->max_count = max_count;
    g->slots = calloc((size_t)n_ranks * (max_count ? max_count : 1), sizeof(float));
    if (!g->slots || pthread_barrier_init(&g->barrier, NULL, (unsigned)n_ranks) != 0) {
        free(g->slots);
        free(g);
        return err_set(err, "comm: cannot allocate %d x %zu floats", n_ranks, max_count);
    }
    for (int r = 0; r < n_ranks; r++) {
        cpu_comm *c = calloc(1, sizeof *c);
        if (!c) {
            cpu_free_group(comms, r);
            if (r == 0) { /* no rank holds the group yet */
                pthread_barrier_destroy(&g->barrier);
                free(g->slots);
                free(g);
            }
            return err_set(err, "comm: out of memory");
        }
        c->base = (kn_comm){.ops = &cpu_comm_ops, .rank = r, .n_ranks = n_ranks, .max_count = max_count};
        c->group = g;
        comms[r] = &c->base;
        g->refs++;
    }
    return AE_OK;
}

int kn_cpu_comm_init(kn_allreduce kind, kn_comm **comms, int n_ranks, const kn_backend *const *rank_be,
                     size_t max_count, ae_error *err) {
    (void)rank_be; /* one host: every rank's memory is the same */
    if (kind != KN_ALLREDUCE_CPU)
        return err_set(err,
                       "comm: the cpu backend's ranks reduce with --allreduce cpu, not %s (nccl and custom are "
                       "the cuda backend's)",
                       kn_allreduce_name(kind));
    return kn_comm_init_cpu(comms, n_ranks, max_count, err);
}
