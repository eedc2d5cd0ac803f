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
    int refs; /* ranks still holding the group, for kn_comm_free_cpu */
} comm_group;

struct kn_comm {
    comm_group *group;
    int rank;
    kn_comm_stats stats; /* this rank's; only its thread writes them */
};

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
        comms[r] = calloc(1, sizeof *comms[r]);
        if (!comms[r]) {
            kn_comm_free_cpu(comms, r);
            if (r == 0) { /* no rank holds the group yet */
                pthread_barrier_destroy(&g->barrier);
                free(g->slots);
                free(g);
            }
            return err_set(err, "comm: out of memory");
        }
        comms[r]->group = g;
        comms[r]->rank = r;
        g->refs++;
    }
    return AE_OK;
}

void kn_comm_free_cpu(kn_comm **comms, int n_ranks) {
    if (!comms) return;
    for (int r = 0; r < n_ranks; r++) {
        kn_comm *c = comms[r];
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

int kn_comm_rank(const kn_comm *c) { return c ? c->rank : 0; }
int kn_comm_size(const kn_comm *c) { return c ? c->group->n_ranks : 1; }

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

kn_comm_stats kn_comm_get_stats(const kn_comm *c) { return c ? c->stats : (kn_comm_stats){0, 0, 0}; }

void kn_allreduce_sum(kn_comm *c, kn_stream *s, float *buf, size_t count) {
    (void)s;
    if (!c || c->group->n_ranks == 1) return;
    uint64_t t0 = now_ns();
    c->stats.calls++;
    c->stats.bytes += (uint64_t)count * sizeof(float);
    comm_group *g = c->group;
    AE_ASSERT(count <= g->max_count);
    memcpy(g->slots + (size_t)c->rank * g->max_count, buf, count * sizeof(float));
    pthread_barrier_wait(&g->barrier);
    for (size_t i = 0; i < count; i++) {
        float sum = g->slots[i];
        for (int r = 1; r < g->n_ranks; r++) sum = sum + g->slots[(size_t)r * g->max_count + i];
        buf[i] = sum;
    }
    pthread_barrier_wait(&g->barrier);
    c->stats.ns += now_ns() - t0;
}
