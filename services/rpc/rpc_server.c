/* The RPC server: accepts connections and hands each request to the handler. */
#include "rpc_conn.h"

#define RPC_MAX_CALLS 1024 /* calls open at once on one server connection */
/* rpc_server_close: how long open calls get to finish on their own (a
 * stream whose last event is on its way), then how long peers get to take
 * what is queued, before the rest is cancelled and cut. */
#define RPC_CLOSE_GRACE_MS 1000

struct rpc_server {
    rpc_loop *loop;
    rpc_server_config cfg;
    char addr_text[256];
    rpc_addr a;
    SSL_CTX *ssl;
    struct evconnlistener *listener;
    pthread_mutex_t mu; /* conns, n_conns, n_calls */
    pthread_cond_t cv;  /* n_calls or n_conns fell (CLOCK_MONOTONIC) */
    rpc_conn *conns;
    int n_conns;
    int n_calls; /* handed to the handler and not yet finished */
    uint64_t next_conn_id;
};

void rpc_server_conn_closed(rpc_conn *c) {
    rpc_server *s = c->srv;
    pthread_mutex_lock(&s->mu);
    for (rpc_conn **p = &s->conns; *p; p = &(*p)->next)
        if (*p == c) {
            *p = c->next;
            s->n_conns--;
            pthread_cond_broadcast(&s->cv);
            break;
        }
    pthread_mutex_unlock(&s->mu);
    if (s->cfg.on_close) s->cfg.on_close(s->cfg.ctx, c->id);
    c->srv = NULL;
}

int rpc_server_conns(rpc_server *s) {
    pthread_mutex_lock(&s->mu);
    int n = s->n_conns;
    pthread_mutex_unlock(&s->mu);
    return n;
}

int rpc_server_port(rpc_server *s) {
    if (s->a.is_unix) return 0;
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (getsockname(evconnlistener_get_fd(s->listener), (struct sockaddr *)&ss, &len) != 0) return 0;
    return ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                    : ntohs(((struct sockaddr_in *)&ss)->sin_port);
}

/* A server connection's clock (loop thread): closes one that sent no whole
 * frame within handshake_ms of accept, then one silent for idle_ms with no
 * call open, and drops one rpc_conn_sendv found past max_out. */
static void server_timer_cb(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    rpc_conn *c = arg;
    if (c->closed) return;
    bufferevent_lock(c->bev);
    bool drop = c->drop;
    size_t queued = c->drop_queued;
    bufferevent_unlock(c->bev);
    if (drop) {
        LOG_WARNF("rpc_dropped conn=%llu reason=\"the peer does not read its replies: %zu bytes unsent, limit %zu\"",
                  (unsigned long long)c->id, queued, c->max_out);
        rpc_conn_close(c);
        return;
    }
    int64_t now = clock_mono_ns(), left_ms;
    if (!c->got_frame) {
        left_ms = c->handshake_ms - (now - c->accept_ns) / 1000000;
        if (left_ms <= 0) {
            LOG_INFOF("rpc_closed conn=%llu reason=\"no frame within %u ms of accept\"", (unsigned long long)c->id,
                      c->handshake_ms);
            rpc_conn_close(c);
            return;
        }
    } else {
        pthread_mutex_lock(&c->mu);
        bool busy = c->calls != NULL;
        int64_t ended = c->calls_end_ns;
        pthread_mutex_unlock(&c->mu);
        /* An open call (a long stream) is activity, and so is its end: a
         * peer that only streamed is silent from the last call's end. */
        if (busy)
            c->last_rx_ns = now;
        else if (ended > c->last_rx_ns)
            c->last_rx_ns = ended;
        left_ms = c->idle_ms - (now - c->last_rx_ns) / 1000000;
        if (left_ms <= 0) {
            LOG_INFOF("rpc_closed conn=%llu reason=\"silent for %lld ms (the limit is %u)\"", (unsigned long long)c->id,
                      (long long)((now - c->last_rx_ns) / 1000000), c->idle_ms);
            rpc_conn_close(c);
            return;
        }
    }
    struct timeval tv = {left_ms / 1000, left_ms % 1000 * 1000};
    event_add(c->timer, &tv);
}

static void accept_cb(struct evconnlistener *lis, evutil_socket_t fd, struct sockaddr *sa, int salen, void *arg) {
    (void)lis, (void)sa, (void)salen;
    rpc_server *s = arg;
    pthread_mutex_lock(&s->mu);
    bool full = (uint32_t)s->n_conns >= s->cfg.max_conns;
    pthread_mutex_unlock(&s->mu);
    if (full) {
        LOG_WARNF("rpc_refused addr=%s reason=\"%u connections open (the limit)\"", s->addr_text, s->cfg.max_conns);
        evutil_closesocket(fd);
        return;
    }
    unsigned peer_uid = 0;
    if (s->a.is_unix && !rpc_peer_uid_ok(fd, &peer_uid)) {
        LOG_WARNF("rpc_refused addr=%s peer_uid=%u uid=%u reason=\"the peer runs as another user (only this user "
                  "and root may connect)\"",
                  s->addr_text, peer_uid, (unsigned)getuid());
        evutil_closesocket(fd);
        return;
    }
    int opts = BEV_OPT_CLOSE_ON_FREE | BEV_OPT_THREADSAFE;
    struct bufferevent *bev = NULL;
    if (s->ssl) {
        SSL *ssl = SSL_new(s->ssl);
        if (ssl) bev = bufferevent_openssl_socket_new(s->loop->base, fd, ssl, BUFFEREVENT_SSL_ACCEPTING, opts);
        if (!bev && ssl) SSL_free(ssl);
    } else {
        bev = bufferevent_socket_new(s->loop->base, fd, opts);
    }
    rpc_conn *c = bev ? calloc(1, sizeof *c) : NULL;
    struct event *timer = c ? event_new(s->loop->base, -1, 0, server_timer_cb, c) : NULL;
    if (!timer) {
        free(c);
        if (bev)
            bufferevent_free(bev);
        else
            evutil_closesocket(fd);
        return;
    }
    pthread_mutex_init(&c->mu, NULL);
    c->refs = 1;
    c->bev = bev;
    c->srv = s;
    c->direct = !s->ssl;
    c->max_frame = s->cfg.max_frame;
    c->last_rx_ns = c->accept_ns = clock_mono_ns();
    c->timer = timer;
    c->handshake_ms = s->cfg.handshake_ms;
    c->idle_ms = s->cfg.idle_ms;
    c->max_out = s->cfg.max_out_bytes;
    pthread_mutex_lock(&s->mu);
    c->id = ++s->next_conn_id;
    c->next = s->conns;
    s->conns = c;
    s->n_conns++;
    pthread_mutex_unlock(&s->mu);
    rpc_tune_bev(bev, !s->a.is_unix);
    bufferevent_setcb(bev, rpc_conn_on_read, rpc_conn_on_write, rpc_conn_on_event, c);
    /* rpc_conn_on_write runs once the queue is down to half the pause mark. */
    bufferevent_setwatermark(bev, EV_WRITE, RPC_OUT_PAUSE_BYTES / 2, 0);
    bufferevent_enable(bev, EV_READ | EV_WRITE);
    struct timeval tv = {c->handshake_ms / 1000, c->handshake_ms % 1000 * 1000};
    event_add(c->timer, &tv);
}

/* Unlinks the call; its buffer goes back to the connection for the next
 * request (a Propose's payload is about 450 KB: allocating it fresh each
 * time costs more in page faults than the socket does). */
static void call_unlink(rpc_call *k) {
    rpc_conn *c = k->c;
    pthread_mutex_lock(&c->mu);
    if (!c->spare && !c->closed) {
        c->spare = k->buf, c->spare_cap = k->buf_cap;
        k->buf = NULL;
    }
    if (k->prev)
        k->prev->next = k->next;
    else if (c->calls == k)
        c->calls = k->next;
    if (k->next) k->next->prev = k->prev;
    k->prev = k->next = NULL;
    if (!c->calls) c->calls_end_ns = clock_mono_ns();
    pthread_mutex_unlock(&c->mu);
}

static void call_free(rpc_call *k) {
    rpc_conn *c = k->c;
    rpc_server *s = k->srv;
    call_unlink(k);
    free(k->buf);
    free(k);
    rpc_conn_unref(c);
    if (s) { /* the last touch of s: rpc_server_close may free it next */
        pthread_mutex_lock(&s->mu);
        if (--s->n_calls == 0) pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
    }
}

void rpc_server_frame(rpc_conn *c, const uint8_t *msg, const uint8_t *payload) {
    frame_header h = c->hdr;
    if (!c->got_frame) { /* from now on the idle limit */
        c->got_frame = true;
        struct timeval tv = {c->idle_ms / 1000, c->idle_ms % 1000 * 1000};
        event_add(c->timer, &tv);
    }
    if (h.kind == FRAME_PING) {
        frame_header p = {FRAME_VERSION, FRAME_PONG, 0, h.call_id, 0, 0, 0, 0};
        rpc_conn_send(c, &p, NULL, 0, NULL, 0);
        return;
    }
    if (h.kind == FRAME_CANCEL) {
        pthread_mutex_lock(&c->mu);
        for (rpc_call *k = c->calls; k; k = k->next)
            if (k->id == h.call_id) atomic_store(&k->cancelled, true);
        pthread_mutex_unlock(&c->mu);
        return;
    }
    if (h.kind == FRAME_PONG) return;
    if (h.kind != FRAME_REQUEST) {
        /* A client sends requests, cancels and pings only. */
        LOG_WARNF("rpc_bad_frame conn=%llu reason=\"a client sent a frame of kind %u\"", (unsigned long long)c->id,
                  h.kind);
        rpc_send_error(c, FRAME_REPLY, h.call_id, RPC_INVALID_ARGUMENT,
                       "a client may send requests, cancels and pings only");
        rpc_conn_close_after_flush(c);
        return;
    }
    bool dup = false;
    int open = 0;
    pthread_mutex_lock(&c->mu);
    for (rpc_call *k = c->calls; k; k = k->next) dup |= k->id == h.call_id, open++;
    pthread_mutex_unlock(&c->mu);
    if (dup) {
        rpc_send_error(c, FRAME_REPLY, h.call_id, RPC_ALREADY_EXISTS, "call id already in use on this connection");
        return;
    }
    if (open >= RPC_MAX_CALLS) {
        rpc_send_error(c, FRAME_REPLY, h.call_id, RPC_RESOURCE_EXHAUSTED, "too many calls open on this connection");
        return;
    }
    rpc_call *k = calloc(1, sizeof *k);
    if (!k) {
        rpc_send_error(c, FRAME_REPLY, h.call_id, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    /* The call takes the receive buffer: no copy of the payload. */
    k->buf = c->rx;
    k->buf_cap = c->rx_cap;
    c->rx = NULL;
    c->rx_cap = 0;
    k->c = c;
    k->id = h.call_id;
    k->deadline_ns = h.timeout_us ? clock_mono_ns() + (int64_t)h.timeout_us * 1000 : 0;
    k->req = (rpc_request){h.method, h.timeout_us, msg, h.msg_len, payload, h.payload_len, c->id};
    k->srv = c->srv;
    pthread_mutex_lock(&k->srv->mu);
    k->srv->n_calls++;
    pthread_mutex_unlock(&k->srv->mu);
    pthread_mutex_lock(&c->mu);
    c->refs++;
    k->next = c->calls;
    if (c->calls) c->calls->prev = k;
    c->calls = k;
    pthread_mutex_unlock(&c->mu);
    c->srv->cfg.handler(c->srv->cfg.ctx, k, &k->req);
}

bool rpc_call_cancelled(const rpc_call *k) {
    return atomic_load(&k->cancelled) || (k->deadline_ns && clock_mono_ns() > k->deadline_ns);
}

bool rpc_call_expired(const rpc_call *k) { return k->deadline_ns && clock_mono_ns() > k->deadline_ns; }

const rpc_request *rpc_call_request(const rpc_call *k) { return &k->req; }

int rpc_call_item(rpc_call *k, const void *msg, uint32_t len, ae_error *err) {
    if (rpc_call_cancelled(k)) return err_set(err, "the call was cancelled");
    k->streamed = true;
    frame_header h = {FRAME_VERSION, FRAME_ITEM, k->req.method, k->id, 0, 0, len, 0};
    if (rpc_conn_send(k->c, &h, msg, len, NULL, 0) != AE_OK) return err_set(err, "the connection is closed");
    return AE_OK;
}

void rpc_call_finish(rpc_call *k, uint32_t status, const void *msg, uint32_t len, const void *payload,
                     uint32_t payload_len) {
    if (status == RPC_OK && k->deadline_ns && clock_mono_ns() > k->deadline_ns) {
        rpc_call_fail(k, RPC_DEADLINE_EXCEEDED, "deadline of %u us exceeded", k->req.timeout_us);
        return;
    }
    frame_header h = {FRAME_VERSION, k->streamed ? FRAME_END : FRAME_REPLY, k->req.method, k->id, status, 0, len,
                      payload_len};
    if (!k->finished) rpc_conn_send(k->c, &h, msg, len, payload, payload_len);
    k->finished = true;
    call_free(k);
}

void rpc_call_fail(rpc_call *k, uint32_t status, const char *fmt, ...) {
    char text[FRAME_MAX_ERROR + 1];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    if (status == RPC_OK) status = RPC_UNKNOWN;
    if (status == RPC_CANCELLED && atomic_load(&k->server_closing)) {
        /* The peer did not cancel it: this server is going away, and the
         * call may be tried again elsewhere. */
        status = RPC_UNAVAILABLE;
        snprintf(text, sizeof text, "the server is shutting down");
    } else if (status == RPC_CANCELLED && k->deadline_ns && clock_mono_ns() > k->deadline_ns) {
        /* Cancelled because its time ran out: say so. */
        status = RPC_DEADLINE_EXCEEDED;
        snprintf(text, sizeof text, "deadline of %u us exceeded", k->req.timeout_us);
    }
    frame_header h = {FRAME_VERSION,
                      k->streamed ? FRAME_END : FRAME_REPLY,
                      k->req.method,
                      k->id,
                      status,
                      0,
                      (uint32_t)strlen(text),
                      0};
    if (!k->finished) rpc_conn_send(k->c, &h, text, h.msg_len, NULL, 0);
    k->finished = true;
    call_free(k);
}

static int listen_socket(rpc_server *s, ae_error *err) {
    if (s->a.is_unix) {
        const char *path = ((struct sockaddr_un *)&s->a.sa)->sun_path;
        struct stat st;
        if (lstat(path, &st) == 0) {
            if (!S_ISSOCK(st.st_mode)) return err_set(err, "%s exists and is not a socket", path);
            unlink(path); /* a stale socket of an earlier run */
        }
    }
    evutil_socket_t fd = socket(s->a.sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return err_set(err, "socket: %s", strerror(errno));
    int one = 1;
    if (!s->a.is_unix) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&s->a.sa, s->a.len) != 0 || listen(fd, 128) != 0) {
        err_set(err, "cannot listen on %s: %s", s->addr_text, strerror(errno));
        close(fd);
        return AE_ERR;
    }
    s->listener = evconnlistener_new(s->loop->base, accept_cb, s, LEV_OPT_CLOSE_ON_FREE | LEV_OPT_THREADSAFE, -1, fd);
    if (!s->listener) {
        close(fd);
        return err_set(err, "libevent: cannot listen on %s", s->addr_text);
    }
    return AE_OK;
}

typedef struct open_job {
    rpc_server *s;
    int rc;
    ae_error *err;
} open_job;

static void server_open_job(void *arg) {
    open_job *j = arg;
    j->rc = listen_socket(j->s, j->err);
}

int rpc_server_open(rpc_server **out, rpc_loop *l, const rpc_server_config *cfg, ae_error *err) {
    *out = NULL;
    rpc_server *s = calloc(1, sizeof *s);
    if (!s) return err_set(err, "out of memory");
    pthread_mutex_init(&s->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->cv, &ca);
    pthread_condattr_destroy(&ca);
    s->loop = l;
    s->cfg = *cfg;
    if (!s->cfg.max_frame) s->cfg.max_frame = RPC_DEFAULT_MAX_FRAME;
    if (!s->cfg.max_conns) s->cfg.max_conns = 1024;
    if (!s->cfg.handshake_ms) s->cfg.handshake_ms = RPC_HANDSHAKE_MS;
    if (!s->cfg.idle_ms) s->cfg.idle_ms = RPC_IDLE_MS;
    if (!s->cfg.max_out_bytes) s->cfg.max_out_bytes = RPC_DEFAULT_MAX_OUT;
    snprintf(s->addr_text, sizeof s->addr_text, "%s", cfg->addr ? cfg->addr : "");
    s->cfg.addr = s->addr_text;
    s->cfg.tls = (rpc_tls){0};
    if (rpc_addr_parse(cfg->addr, &s->a, err) != AE_OK) goto fail;
    if ((cfg->tls.cert != NULL) != (cfg->tls.key != NULL)) {
        err_set(err, "TLS needs both a certificate and a key");
        goto fail;
    }
    if (cfg->tls.ca && !cfg->tls.cert) {
        err_set(err, "client certificates (a CA) need TLS: set a certificate and key too");
        goto fail;
    }
    if (cfg->tls.cert && !(s->ssl = rpc_tls_ctx(&cfg->tls, true, err))) goto fail;
    open_job j = {s, AE_OK, err};
    rpc_loop_run(l, server_open_job, &j);
    if (j.rc != AE_OK) goto fail;
    *out = s;
    return AE_OK;
fail:
    if (s->ssl) SSL_CTX_free(s->ssl);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
    return AE_ERR;
}

/* Stops accepting, and reading requests. Connections come and go only on
 * the loop thread, which this is. */
static void server_stop_job(void *arg) {
    rpc_server *s = arg;
    evconnlistener_free(s->listener);
    if (s->a.is_unix) unlink(((struct sockaddr_un *)&s->a.sa)->sun_path);
    pthread_mutex_lock(&s->mu);
    rpc_conn *c = s->conns;
    pthread_mutex_unlock(&s->mu);
    for (; c; c = c->next) {
        bufferevent_lock(c->bev);
        c->reads_off = true;
        bufferevent_disable(c->bev, EV_READ);
        bufferevent_unlock(c->bev);
    }
}

/* Cancels every call. A connection with replies still queued closes once
 * they are sent; the others close now. */
static void server_close_job(void *arg) {
    rpc_server *s = arg;
    pthread_mutex_lock(&s->mu);
    rpc_conn *c = s->conns;
    pthread_mutex_unlock(&s->mu);
    for (rpc_conn *next; c; c = next) {
        next = c->next;
        pthread_mutex_lock(&c->mu);
        for (rpc_call *k = c->calls; k; k = k->next) {
            atomic_store(&k->server_closing, true);
            atomic_store(&k->cancelled, true);
        }
        pthread_mutex_unlock(&c->mu);
        rpc_conn_close_after_flush(c);
    }
}

/* Closes what is left: peers that did not take their replies in time. */
static void server_close_rest_job(void *arg) {
    rpc_server *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        rpc_conn *c = s->conns;
        pthread_mutex_unlock(&s->mu);
        if (!c) break;
        rpc_conn_close(c);
    }
}

void rpc_server_close(rpc_server *s) {
    if (!s) return;
    AE_ASSERT(!pthread_equal(pthread_self(), s->loop->thread)); /* handlers may finish calls on the loop */
    rpc_loop_run(s->loop, server_stop_job, s);
    /* Calls that are about to end (a drained scheduler's last events may
     * still be on their way) end as they would have. */
    struct timespec until = rpc_abs_after_ns((int64_t)RPC_CLOSE_GRACE_MS * 1000000);
    pthread_mutex_lock(&s->mu);
    while (s->n_calls > 0 && pthread_cond_timedwait(&s->cv, &s->mu, &until) == 0) {
    }
    pthread_mutex_unlock(&s->mu);
    rpc_loop_run(s->loop, server_close_job, s);
    until = rpc_abs_after_ns((int64_t)RPC_CLOSE_GRACE_MS * 1000000);
    pthread_mutex_lock(&s->mu);
    while (s->n_conns > 0 && pthread_cond_timedwait(&s->cv, &s->mu, &until) == 0) {
    }
    pthread_mutex_unlock(&s->mu);
    rpc_loop_run(s->loop, server_close_rest_job, s);
    /* The handlers finish the cancelled calls from their own threads; until
     * then they may use what the caller frees after this returns. */
    pthread_mutex_lock(&s->mu);
    while (s->n_calls > 0) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    if (s->ssl) SSL_CTX_free(s->ssl);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

void rpc_call_release_request(rpc_call *k) {
    /* Freed, not given back to the connection as its spare: the frame may
     * be as large as the frame limit. */
    free(k->buf);
    k->buf = NULL;
    k->buf_cap = 0;
    k->req.msg = NULL;
    k->req.msg_len = 0;
    k->req.payload = NULL;
    k->req.payload_len = 0;
}
