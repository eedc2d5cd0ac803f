/* A persistent thread pool for data-parallel loops.
 *
 * Threads are created once at start (pool_init) and sleep between jobs.
 * pool_run splits a job into n_tasks tasks handed out through an atomic
 * counter; the calling thread works too, and pool_run returns when every
 * task has finished. Callers on several threads take turns (one job runs
 * at a time). Jobs must not call pool_run on the same pool. */
#ifndef AERIE_CORE_POOL_H
#define AERIE_CORE_POOL_H

#include "err.h"

typedef struct pool pool;

/* fn(ctx, task, n_tasks) is called once for each task in [0, n_tasks). */
typedef void (*pool_fn)(void *ctx, int task, int n_tasks);

#define POOL_MAX_THREADS 256

/* n_threads counts the caller: 1 means no extra threads. */
int pool_init(pool **out, int n_threads, ae_error *err);
void pool_free(pool *p); /* NULL is a no-op */

int pool_threads(const pool *p);
void pool_run(pool *p, pool_fn fn, void *ctx, int n_tasks);

/* Number of CPUs this process may run on (sched_getaffinity). */
int pool_cpu_count(void);

#endif
