#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

struct pool {
    int n_threads; /* including the caller */
    pthread_t *threads; /* (n_threads - 1) */
    pthread_mutex_t run_mu; /* one pool_run at a time */
    pthread_mutex_t mu;
    pthread_cond_t wake; /* a new job, or shutdown */
    pthread_cond_t done; /* the last worker left the job */

    /* The current job; written under mu before generation is bumped. */
    pool_fn fn;
    void *ctx;
    int n_tasks;
    atomic_int next_task;
    unsigned long generation;
    int busy_workers; /* workers still inside the current job */
    int shutdown;
};

static void run_tasks(pool *p, pool_fn fn, void *ctx, int n_tasks) {
    for (;;) {
        int t = atomic_fetch_add(&p->next_task, 1);
        if (t >= n_tasks) return;
        fn(ctx, t, n_tasks);
    }
}

static void *worker_main(void *arg) {
    pool *p = arg;
    unsigned long seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->shutdown && p->generation == seen)
            pthread_cond_wait(&p->wake, &p->mu);
        if (p->shutdown) break;
        seen = p->generation;
        pool_fn fn = p->fn;
        void *ctx = p->ctx;
        int n = p->n_tasks;
        pthread_mutex_unlock(&p->mu);
        run_tasks(p, fn, ctx, n);
        pthread_mutex_lock(&p->mu);
        if (--p->busy_workers == 0) pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
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
    p->shutdown = 1;
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
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store(&p->next_task, 0);
    p->busy_workers = p->n_threads - 1;
    p->generation++;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);

    run_tasks(p, fn, ctx, n_tasks);

    pthread_mutex_lock(&p->mu);
    while (p->busy_workers > 0) pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
    pthread_mutex_unlock(&p->run_mu);
}
