#include "gcompile.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../services/core/clock.h"
#include "../services/core/log.h"

static atomic_int g_live;

int32_t gcompile_live(void) { return atomic_load(&g_live); }

const char *gcompile_rc_name(int rc) {
    switch (rc) {
    case AE_OK: return "ok";
    case GRAMMAR_REFUSED: return "refused";
    case GCOMPILE_TIMEOUT: return "timeout";
    case GCOMPILE_CANCELLED: return "cancelled";
    default: return "error";
    }
}

/* A compile shared by its thread and its caller; the last to let go frees
 * it. */
typedef struct gcompile_job {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    bool done;
    int rc;
    ae_error err;
    grammar *g;
    grammar_vocab *v;
    char *schema; /* NULL: json_object */
} gcompile_job;

static void job_put(gcompile_job *j) {
    pthread_mutex_lock(&j->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left > 0) return;
    grammar_free(j->g);
    grammar_vocab_free(j->v);
    free(j->schema);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j);
}

static void *job_main(void *arg) {
    gcompile_job *j = arg;
    grammar *g = NULL;
    ae_error err = {{0}};
    int rc = grammar_compile(&g, j->v, j->schema, &err);
    pthread_mutex_lock(&j->mu);
    j->rc = rc;
    j->err = err;
    j->g = g;
    j->done = true;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    atomic_fetch_sub(&g_live, 1);
    job_put(j);
    return NULL;
}

static void wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, int64_t ms) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += ms * 1000000;
    while (until.tv_nsec >= 1000000000) until.tv_sec++, until.tv_nsec -= 1000000000;
    pthread_cond_timedwait(cv, mu, &until);
}

/* Why a bounded compile stops waiting: AE_OK to go on. */
static int stop_reason(const gcompile_limits *lim, int64_t deadline, bool (*cancelled)(void *), void *ctx,
                       ae_error *err) {
    if (cancelled && cancelled(ctx))
        return err_set(err, "the request was cancelled while its schema compiled"), GCOMPILE_CANCELLED;
    if (deadline && clock_mono_ns() > deadline)
        return err_set(err,
                       "the schema did not compile within %lld ms (the target's --compile-timeout-ms); make it "
                       "smaller or simpler",
                       (long long)lim->timeout_ms),
               GCOMPILE_TIMEOUT;
    return AE_OK;
}

static int compile_bounded(grammar **out, grammar_vocab *v, const char *schema, const gcompile_limits *lim,
                           bool (*cancelled)(void *), void *ctx, ae_error *err) {
    int64_t deadline = lim->timeout_ms > 0 ? clock_mono_ns() + lim->timeout_ms * 1000000 : 0;
    /* A place among the compile threads (those given up on hold theirs
     * until they end). */
    for (;;) {
        int live = atomic_load(&g_live);
        if (lim->max_live <= 0 || live < lim->max_live) {
            if (atomic_compare_exchange_weak(&g_live, &live, live + 1)) break;
            continue;
        }
        int rc = stop_reason(lim, deadline, cancelled, ctx, err);
        if (rc != AE_OK) return rc;
        struct timespec t = {0, GCOMPILE_POLL_MS * 1000000};
        nanosleep(&t, NULL);
    }
    gcompile_job *j = calloc(1, sizeof *j);
    char *copy = schema ? strdup(schema) : NULL;
    if (!j || (schema && !copy)) {
        atomic_fetch_sub(&g_live, 1);
        free(j), free(copy);
        return err_set(err, "structured output: out of memory");
    }
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->refs = 2;
    j->v = v;
    j->schema = copy;
    grammar_vocab_ref(v);
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pthread_t th;
    if (pthread_create(&th, &at, job_main, j) != 0) {
        pthread_attr_destroy(&at);
        atomic_fetch_sub(&g_live, 1);
        j->refs = 1;
        job_put(j);
        return err_set(err, "structured output: cannot start a compile thread");
    }
    pthread_attr_destroy(&at);
    int rc = AE_OK;
    pthread_mutex_lock(&j->mu);
    while (!j->done) {
        pthread_mutex_unlock(&j->mu);
        rc = stop_reason(lim, deadline, cancelled, ctx, err);
        pthread_mutex_lock(&j->mu);
        if (rc != AE_OK || j->done) break;
        wait_until(&j->cv, &j->mu, GCOMPILE_POLL_MS);
    }
    if (j->done) {
        /* It ended in time (or just as it was given up on: then it counts). */
        rc = j->rc;
        *out = j->g;
        j->g = NULL;
        if (rc != AE_OK) {
            err_clear(err);
            err_set(err, "%s", j->err.msg);
        }
    }
    pthread_mutex_unlock(&j->mu);
    job_put(j);
    return rc;
}

int gcompile_compile(grammar **out, grammar_vocab *v, const char *schema, const gcompile_limits *lim,
                     bool (*cancelled)(void *ctx), void *ctx, ae_error *err) {
    *out = NULL;
    if (grammar_cached(out, v, schema) == AE_OK) return AE_OK;
    int64_t t0 = clock_mono_ns();
    int rc =
        lim->isolate ? compile_bounded(out, v, schema, lim, cancelled, ctx, err) : grammar_compile(out, v, schema, err);
    double ms = (double)(clock_mono_ns() - t0) / 1e6;
    /* A json_object request has no schema text: 0 bytes. */
    if (lim->log_ms >= 0 && ms >= (double)lim->log_ms)
        LOG_INFOF("schema_compiled ms=%.1f bytes=%zu kind=%s result=%s live=%d", ms,
                  schema ? strlen(schema) : (size_t)0, schema ? "json_schema" : "json_object", gcompile_rc_name(rc),
                  gcompile_live());
    return rc;
}
