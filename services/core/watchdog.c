#include "watchdog.h"

#include <errno.h>
#include <limits.h>
#include <event2/event.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "log.h"
#include "svc.h"

typedef struct watchdog_slot {
    _Atomic int64_t beat_ns; /* last beat, CLOCK_MONOTONIC */
    _Atomic bool used;
    bool dropped; /* $AERIE_TEST_WATCHDOG_STALL names it */
    char name[WATCHDOG_NAME_MAX];
} watchdog_slot;

typedef struct watchdog_timer {
    struct event *ev;
    int slot;
    watchdog *w;
} watchdog_timer;

struct watchdog {
    int64_t interval_ns;
    watchdog_slot slots[WATCHDOG_MAX_LOOPS];
    pthread_mutex_t mu; /* slot registration, timers, the thread's state */
    pthread_cond_t cv;  /* wakes the thread to stop */
    watchdog_timer timers[WATCHDOG_MAX_LOOPS];
    int n_timers;
    pthread_t thread;
    bool running, stopping;
};

static _Atomic(watchdog *) process_wd;

int64_t watchdog_env_interval_us(void) {
    const char *pid = getenv("WATCHDOG_PID");
    if (pid && *pid) {
        char *end;
        errno = 0;
        long long p = strtoll(pid, &end, 10);
        if (errno || *end || p != (long long)getpid()) return 0;
    }
    const char *usec = getenv("WATCHDOG_USEC");
    if (!usec || !*usec) return 0;
    char *end;
    errno = 0;
    long long us = strtoll(usec, &end, 10);
    /* Past LLONG_MAX is still a number of microseconds (systemd's field is
     * a uint64), only far above the ceiling. */
    bool huge = errno == ERANGE && us == LLONG_MAX;
    if ((errno && !huge) || *end || us <= 0) {
        LOG_WARNF(
            "watchdog_usec_ignored value=\"%.40s\" reason=\"not a positive whole number of microseconds: no watchdog\"",
            usec);
        return 0;
    }
    if (us < WATCHDOG_MIN_USEC) {
        LOG_WARNF(
            "watchdog_interval_clamped watchdog_usec=%lld interval_us=%lld reason=\"below %lld us: a ping every %lld ms, "
            "late for a systemd that wants one sooner\"",
            us, (long long)WATCHDOG_MIN_USEC, (long long)WATCHDOG_MIN_USEC, (long long)WATCHDOG_MIN_USEC / 4000);
        return WATCHDOG_MIN_USEC;
    }
    if (huge || us > WATCHDOG_MAX_USEC) {
        LOG_WARNF(
            "watchdog_interval_clamped watchdog_usec=%.40s interval_us=%lld reason=\"above %lld us: pinging more often "
            "than asked is always in time\"",
            usec, (long long)WATCHDOG_MAX_USEC, (long long)WATCHDOG_MAX_USEC);
        return WATCHDOG_MAX_USEC;
    }
    return us;
}

int64_t watchdog_interval_ns(const watchdog *w) { return w ? w->interval_ns : 0; }

int watchdog_init(watchdog **out, int64_t interval_us, ae_error *err) {
    *out = NULL;
    if (interval_us <= 0) return AE_OK;
    AE_ASSERT(interval_us <= WATCHDOG_MAX_USEC); /* interval_ns and the wake-up times must not overflow */
    watchdog *w = calloc(1, sizeof *w);
    if (!w) return err_set(err, "out of memory for the watchdog");
    w->interval_ns = interval_us * 1000;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, &ca);
    pthread_condattr_destroy(&ca);
    *out = w;
    return AE_OK;
}

void watchdog_stop(watchdog *w) {
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    bool join = w->running;
    w->stopping = true;
    w->running = false;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    if (join) pthread_join(w->thread, NULL);
    pthread_mutex_lock(&w->mu);
    /* event_free waits for a callback running on the loop's thread. */
    for (int i = 0; i < w->n_timers; i++) event_free(w->timers[i].ev);
    w->n_timers = 0;
    pthread_mutex_unlock(&w->mu);
}

void watchdog_free(watchdog *w) {
    if (!w) return;
    watchdog *expected = w;
    atomic_compare_exchange_strong(&process_wd, &expected, NULL);
    watchdog_stop(w);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w);
}

int watchdog_add(watchdog *w, const char *name) {
    if (!w) return -1;
    const char *stall = getenv("AERIE_TEST_WATCHDOG_STALL");
    pthread_mutex_lock(&w->mu);
    int i = 0;
    while (i < WATCHDOG_MAX_LOOPS && atomic_load(&w->slots[i].used)) i++;
    AE_ASSERT(i < WATCHDOG_MAX_LOOPS);
    watchdog_slot *s = &w->slots[i];
    snprintf(s->name, sizeof s->name, "%s", name);
    s->dropped = stall && !strcmp(stall, s->name);
    atomic_store(&s->beat_ns, clock_mono_ns());
    atomic_store(&s->used, true);
    pthread_mutex_unlock(&w->mu);
    if (s->dropped)
        LOG_WARNF("watchdog_test_stall loop=%s reason=\"AERIE_TEST_WATCHDOG_STALL: its beats are dropped\"", s->name);
    return i;
}

void watchdog_remove(watchdog *w, int slot) {
    if (!w || slot < 0) return;
    AE_ASSERT(slot < WATCHDOG_MAX_LOOPS);
    atomic_store(&w->slots[slot].used, false);
}

void watchdog_beat(watchdog *w, int slot) {
    if (!w || slot < 0) return;
    AE_ASSERT(slot < WATCHDOG_MAX_LOOPS);
    watchdog_slot *s = &w->slots[slot];
    if (!s->dropped) atomic_store_explicit(&s->beat_ns, clock_mono_ns(), memory_order_relaxed);
}

const char *watchdog_stale(watchdog *w, int64_t now_ns) {
    if (!w) return NULL;
    for (int i = 0; i < WATCHDOG_MAX_LOOPS; i++) {
        watchdog_slot *s = &w->slots[i];
        if (!atomic_load(&s->used)) continue;
        if (now_ns - atomic_load_explicit(&s->beat_ns, memory_order_relaxed) > w->interval_ns / 2) return s->name;
    }
    return NULL;
}

static void on_timer(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    watchdog_timer *t = arg;
    watchdog_beat(t->w, t->slot);
}

int watchdog_watch_base(watchdog *w, struct event_base *base, const char *name, ae_error *err) {
    if (!w) return AE_OK;
    int slot = watchdog_add(w, name);
    pthread_mutex_lock(&w->mu);
    AE_ASSERT(w->n_timers < WATCHDOG_MAX_LOOPS);
    watchdog_timer *t = &w->timers[w->n_timers];
    t->w = w;
    t->slot = slot;
    t->ev = event_new(base, -1, EV_PERSIST, on_timer, t);
    int64_t every_us = w->interval_ns / 4000;
    struct timeval tv = {(time_t)(every_us / 1000000), (suseconds_t)(every_us % 1000000)};
    if (!t->ev || event_add(t->ev, &tv) != 0) {
        if (t->ev) event_free(t->ev);
        watchdog_remove(w, t->slot);
        pthread_mutex_unlock(&w->mu);
        return err_set(err, "cannot add the watchdog's timer to the %s loop", name);
    }
    w->n_timers++;
    pthread_mutex_unlock(&w->mu);
    return AE_OK;
}

static void *ping_main(void *arg) {
    watchdog *w = arg;
    const char *was_stale = NULL;
    pthread_mutex_lock(&w->mu);
    while (!w->stopping) {
        int64_t now = clock_mono_ns();
        const char *stale = watchdog_stale(w, now);
        if (!stale)
            svc_notify("WATCHDOG=1");
        else if (stale != was_stale)
            LOG_ERRORF(
                "watchdog_withheld loop=%s reason=\"no beat in the last %lld ms: it looks hung, so systemd is not told we are alive\"",
                stale, (long long)(w->interval_ns / 2000000));
        was_stale = stale;
        int64_t wake = now + w->interval_ns / 4;
        struct timespec until = {(time_t)(wake / 1000000000), (long)(wake % 1000000000)};
        while (!w->stopping && pthread_cond_timedwait(&w->cv, &w->mu, &until) != ETIMEDOUT) {
        }
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

int watchdog_start(watchdog *w, ae_error *err) {
    if (!w) return AE_OK;
    pthread_mutex_lock(&w->mu);
    AE_ASSERT(!w->running && !w->stopping);
    int rc = pthread_create(&w->thread, NULL, ping_main, w);
    w->running = rc == 0;
    pthread_mutex_unlock(&w->mu);
    if (rc != 0) return err_set(err, "cannot start the watchdog thread");
    LOG_INFOF("watchdog_on interval_ms=%lld ping_every_ms=%lld", (long long)(w->interval_ns / 1000000),
              (long long)(w->interval_ns / 4000000));
    return AE_OK;
}

void watchdog_set_process(watchdog *w) { atomic_store(&process_wd, w); }

watchdog *watchdog_process(void) { return atomic_load(&process_wd); }
