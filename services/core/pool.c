#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

/* A forward pass hands the pool a few hundred short jobs per token; waking
 * a sleeping thread through a condition variable costs more than many of
 * them. So both sides spin on atomics before sleeping, but only this long:
 * a spinning thread holds a core, and the target and the draft share the
 * same cores (make run), taking turns within each step. The gaps between
 * the jobs of one pass are a few microseconds; between steps the waiting
 * pool should give its cores away at once. The bound was 20000 pauses,
 * which is 520 us on a Zen 4 (a pause is about 26 ns there, 10x what it
 * was on older cores): one stack of target and draft at 2 threads each
 * made 1.0 tok/s with it on the loaded 2-core development host and 24.5
 * tok/s with this bound (tools/bench_threads.py, README). Wall time, not
 * a count, so that it means the same on every core (and under TSan). */
#define POOL_SPIN_NS 50000
#define POOL_SPIN_CHECK 64 /* pauses between looks at the clock */

struct pool {
    int n_threads;          /* including the caller */
    pthread_t *threads;     /* (n_threads - 1) */
    pthread_mutex_t run_mu; /* one pool_run at a time */
    pthread_mutex_t mu;     /* guards sleeping, nothing else */
    pthread_cond_t wake;    /* a new job, or shutdown */
    pthread_cond_t done;    /* the last worker left the job */

    /* The current job; written before generation is bumped (release). */
    pool_fn fn;
    void *ctx;
    int n_tasks;
    atomic_int next_task;
    atomic_ulong generation;
    atomic_int pending;  /* workers still inside the current job */
    atomic_int sleepers; /* workers asleep on wake (changed under mu) */
    atomic_int shutdown;
};

static void run_tasks(pool *p, pool_fn fn, void *ctx, int n_tasks) {
    for (;;) {
        int t = atomic_fetch_add(&p->next_task, 1);
        if (t >= n_tasks) return;
        fn(ctx, t, n_tasks);
    }
}

/* Waits until generation moves past seen (or shutdown); returns the new
 * generation. Spins first, then sleeps. */
static unsigned long wait_for_job(pool *p, unsigned long seen) {
    int64_t until = clock_mono_ns() + POOL_SPIN_NS;
    for (int i = 1;; i++) {
        unsigned long g = atomic_load(&p->generation);
        if (g != seen || atomic_load(&p->shutdown)) return g;
        CPU_RELAX();
        if (i % POOL_SPIN_CHECK == 0 && clock_mono_ns() > until) break;
    }
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add(&p->sleepers, 1);
    /* Checked under mu: pool_run bumps generation before it takes mu to
     * wake sleepers, so either we see the new job here or we are counted
     * as a sleeper when it looks. */
    while (atomic_load(&p->generation) == seen && !atomic_load(&p->shutdown)) pthread_cond_wait(&p->wake, &p->mu);
    atomic_fetch_sub(&p->sleepers, 1);
    pthread_mutex_unlock(&p->mu);
    return atomic_load(&p->generation);
}

static void *worker_main(void *arg) {
    pool *p = arg;
    unsigned long seen = 0;
    for (;;) {
        seen = wait_for_job(p, seen);
        if (atomic_load(&p->shutdown)) break;
        run_tasks(p, p->fn, p->ctx, p->n_tasks);
        if (atomic_fetch_sub(&p->pending, 1) == 1) {
            /* The last one out tells a caller that may be asleep. */
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
    }
    return NULL;
}

int pool_cpu_count(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
    return 1;
}

int pool_init(pool **out, int n_threads, ae_error *err) {
    *out = NULL;
    if (n_threads < 1 || n_threads > POOL_MAX_THREADS)
        return err_set(err, "pool: threads must be in 1..%d, got %d", POOL_MAX_THREADS, n_threads);
    pool *p = calloc(1, sizeof *p);
    if (!p) return err_set(err, "pool: out of memory");
    pthread_mutex_init(&p->run_mu, NULL);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    p->n_threads = 1;
    if (n_threads > 1) {
        p->threads = calloc((size_t)n_threads - 1, sizeof *p->threads);
        if (!p->threads) {
            err_set(err, "pool: out of memory");
            goto fail;
        }
    }
    for (int i = 0; i < n_threads - 1; i++) {
        int rc = pthread_create(&p->threads[i], NULL, worker_main, p);
        if (rc != 0) {
            err_set(err, "pool: cannot start thread %d of %d: %s", i + 1, n_threads - 1, strerror(rc));
            goto fail;
        }
        p->n_threads++;
    }
    *out = p;
    return AE_OK;
fail:
    pool_free(p);
    return AE_ERR;
}

void pool_free(pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->shutdown, 1);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_threads - 1; i++) pthread_join(p->threads[i], NULL);
    pthread_cond_destroy(&p->done);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->run_mu);
    free(p->threads);
    free(p);
}

int pool_threads(const pool *p) { return p->n_threads; }

void pool_run(pool *p, pool_fn fn, void *ctx, int n_tasks) {
    if (n_tasks <= 0) return;
    if (p->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, n_tasks);
        return;
    }
    pthread_mutex_lock(&p->run_mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store(&p->next_task, 0);
    atomic_store(&p->pending, p->n_threads - 1);
    atomic_fetch_add(&p->generation, 1);
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->mu);
    }

    run_tasks(p, fn, ctx, n_tasks);

    int64_t until = clock_mono_ns() + POOL_SPIN_NS;
    for (int i = 1; atomic_load(&p->pending) > 0; i++) {
        CPU_RELAX();
        if (i % POOL_SPIN_CHECK == 0 && clock_mono_ns() > until) break;
    }
    if (atomic_load(&p->pending) > 0) {
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&p->pending) > 0) pthread_cond_wait(&p->done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
    pthread_mutex_unlock(&p->run_mu);
}
