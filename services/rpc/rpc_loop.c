/* The RPC link's event loop: one libevent base on its own thread. */
#include "rpc_conn.h"

static pthread_once_t threads_once = PTHREAD_ONCE_INIT;
static int threads_rc;
static void threads_init(void) { threads_rc = evthread_use_pthreads(); }

static void *loop_main(void *arg) {
    rpc_loop *l = arg;
    event_base_loop(l->base, EVLOOP_NO_EXIT_ON_EMPTY);
    return NULL;
}

static void keep_cb(evutil_socket_t fd, short what, void *arg) { (void)fd, (void)what, (void)arg; }

int rpc_loop_start(rpc_loop **out, ae_error *err) {
    *out = NULL;
    pthread_once(&threads_once, threads_init);
    if (threads_rc != 0) return err_set(err, "libevent: no pthreads support");
    rpc_loop *l = calloc(1, sizeof *l);
    if (!l) return err_set(err, "out of memory");
    l->base = event_base_new();
    struct timeval hour = {3600, 0};
    if (l->base) l->keep = event_new(l->base, -1, EV_PERSIST, keep_cb, NULL);
    if (!l->base || !l->keep || event_add(l->keep, &hour) != 0) {
        if (l->keep) event_free(l->keep);
        if (l->base) event_base_free(l->base);
        free(l);
        return err_set(err, "libevent: cannot create an event loop");
    }
    if (pthread_create(&l->thread, NULL, loop_main, l) != 0) {
        event_free(l->keep);
        event_base_free(l->base);
        free(l);
        return err_set(err, "cannot start the RPC thread");
    }
    *out = l;
    return AE_OK;
}

/* Runs fn(arg) on the loop thread and waits for it. */
typedef struct loop_job {
    void (*fn)(void *);
    void *arg;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
} loop_job;

static void job_cb(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    loop_job *j = arg;
    j->fn(j->arg);
    pthread_mutex_lock(&j->mu);
    j->done = true;
    pthread_cond_signal(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

void rpc_loop_run(rpc_loop *l, void (*fn)(void *), void *arg) {
    if (pthread_equal(pthread_self(), l->thread)) {
        fn(arg);
        return;
    }
    loop_job j = {fn, arg, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, false};
    struct timeval now = {0, 0};
    AE_ASSERT(event_base_once(l->base, -1, EV_TIMEOUT, job_cb, &j, &now) == 0);
    pthread_mutex_lock(&j.mu);
    while (!j.done) pthread_cond_wait(&j.cv, &j.mu);
    pthread_mutex_unlock(&j.mu);
}

struct event_base *rpc_loop_base(rpc_loop *l) { return l->base; }

void rpc_loop_free(rpc_loop *l) {
    if (!l) return;
    event_base_loopbreak(l->base);
    pthread_join(l->thread, NULL);
    event_free(l->keep);
    event_base_free(l->base);
    free(l);
}
