/* The RPC client: one connection, reconnected with backoff, shared by
 * blocking, started and streamed calls. */
#include "rpc_conn.h"

typedef struct pending {
    uint32_t id;
    rpc_conn *c;
    rpc_reply *out;
    rpc_item_fn on_item;
    void *item_ctx;
    bool done;
    bool polling; /* its caller reads the socket itself (caller_read) */
    /* rpc_client_start's calls: on_end runs once, on the loop thread, by
     * whoever claims the finished call; the pending and its reply are the
     * client's to free. */
    rpc_end_fn on_end;
    bool claimed;
    struct event *timer; /* the deadline */
    rpc_client *cl;
    rpc_reply own;
    struct pending *next;
} pending;

struct rpc_client {
    rpc_loop *loop;
    rpc_client_config cfg;
    char addr_text[256];
    rpc_addr a;
    SSL_CTX *ssl;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* a call ended, or the connection came or went */
    rpc_conn *cur;     /* connecting or connected */
    bool connected;
    bool closing;
    uint32_t next_id;
    pending *pend;
    int32_t backoff_ms;
    struct event *retry;
    uint64_t connects;
    int wake_fd; /* an eventfd: the loop ended a call whose caller polls the socket */
};

static void client_connect(rpc_client *cl);

static void retry_cb(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    client_connect(arg);
}

static void reply_set_error(rpc_reply *r, uint32_t status, const char *text) {
    r->status = status;
    snprintf(r->error, sizeof r->error, "%s", text);
    r->msg_len = r->payload_len = 0;
}

/* Ends an asynchronous call that this thread claimed (loop thread, cl->mu
 * not held): unlinks it, runs on_end, frees it. */
static void async_finish(rpc_client *cl, pending *p) {
    pthread_mutex_lock(&cl->mu);
    for (pending **q = &cl->pend; *q; q = &(*q)->next)
        if (*q == p) {
            *q = p->next;
            break;
        }
    pthread_cond_broadcast(&cl->cv); /* rpc_client_close may wait for the last call */
    pthread_mutex_unlock(&cl->mu);
    if (p->timer) event_free(p->timer);
    p->on_end(p->item_ctx, &p->own);
    rpc_reply_free(&p->own);
    rpc_conn_unref(p->c);
    free(p);
}

/* Claims one finished, unclaimed asynchronous call of connection c. */
static pending *claim_finished(rpc_client *cl, rpc_conn *c) {
    pthread_mutex_lock(&cl->mu);
    pending *p = cl->pend;
    while (p && !(p->on_end && p->c == c && p->done && !p->claimed)) p = p->next;
    if (p) p->claimed = true;
    pthread_mutex_unlock(&cl->mu);
    return p;
}

void rpc_client_conn_closed(rpc_conn *c) {
    rpc_client *cl = c->cli;
    pthread_mutex_lock(&cl->mu);
    for (pending *p = cl->pend; p; p = p->next)
        if (p->c == c && !p->done) {
            reply_set_error(p->out, RPC_UNAVAILABLE, "the connection was lost");
            p->done = true;
        }
    bool was_connected = cl->cur == c && cl->connected;
    if (cl->cur == c) {
        cl->cur = NULL;
        cl->connected = false;
    }
    bool closing = cl->closing;
    pthread_cond_broadcast(&cl->cv);
    pthread_mutex_unlock(&cl->mu);
    if (was_connected && !closing) LOG_WARNF("rpc_disconnected addr=%s", cl->addr_text);
    for (pending *p; (p = claim_finished(cl, c));) async_finish(cl, p);
    if (!closing) {
        struct timeval tv = {cl->backoff_ms / 1000, (cl->backoff_ms % 1000) * 1000};
        event_add(cl->retry, &tv);
        cl->backoff_ms = cl->backoff_ms * 2 < RPC_BACKOFF_MAX_MS ? cl->backoff_ms * 2 : RPC_BACKOFF_MAX_MS;
    }
    c->cli = NULL;
}

static bool grow(uint8_t **buf, uint32_t *cap, uint32_t need, bool aligned) {
    if (need <= *cap) return true;
    uint32_t n = need < 4096 ? 4096 : need;
    uint8_t *p = aligned ? aligned_alloc(16, ((size_t)n + 15) / 16 * 16) : malloc(n);
    if (!p) return false;
    free(*buf);
    *buf = p;
    *cap = n;
    return true;
}

/* The call whose caller reads the socket on this thread (caller_read). */
static _Thread_local const pending *reading_for;

void rpc_client_frame(rpc_conn *c, const uint8_t *msg, const uint8_t *payload) {
    rpc_client *cl = c->cli;
    frame_header h = c->hdr;
    if (h.kind == FRAME_PONG) return;
    if (h.kind == FRAME_PING) {
        frame_header p = {FRAME_VERSION, FRAME_PONG, 0, h.call_id, 0, 0, 0, 0};
        rpc_conn_send(c, &p, NULL, 0, NULL, 0);
        return;
    }
    if (h.kind != FRAME_REPLY && h.kind != FRAME_ITEM && h.kind != FRAME_END) {
        LOG_WARNF("rpc_bad_frame addr=%s reason=\"a server sent a frame of kind %u\"", cl->addr_text, h.kind);
        rpc_conn_close(c);
        return;
    }
    uint32_t n_err = h.msg_len < FRAME_MAX_ERROR ? h.msg_len : FRAME_MAX_ERROR;
    pthread_mutex_lock(&cl->mu);
    pending *p = cl->pend;
    while (p && !(p->id == h.call_id && p->c == c)) p = p->next;
    if (!p || p->done) {
        /* A call the caller gave up on (deadline), or a refusal of the
         * whole connection (call id 0). */
        pthread_mutex_unlock(&cl->mu);
        if (h.status != RPC_OK && h.kind != FRAME_ITEM && h.call_id == 0)
            LOG_WARNF("rpc_call_refused addr=%s status=%s reason=\"%.*s\"", cl->addr_text, frame_status_name(h.status),
                      (int)n_err, (const char *)msg);
        return;
    }
    rpc_reply *r = p->out;
    if (h.kind == FRAME_ITEM) {
        if (p->on_item && !p->on_item(p->item_ctx, msg, h.msg_len)) {
            frame_header x = {FRAME_VERSION, FRAME_CANCEL, 0, h.call_id, 0, 0, 0, 0};
            rpc_conn_send(c, &x, NULL, 0, NULL, 0);
        }
        pthread_mutex_unlock(&cl->mu);
        return;
    }
    r->status = h.status;
    r->error[0] = '\0';
    r->msg_len = r->payload_len = 0;
    if (h.status != RPC_OK) {
        memcpy(r->error, msg, n_err);
        r->error[n_err] = '\0';
    } else if (!grow(&r->msg, &r->msg_cap, h.msg_len, false) ||
               !grow(&r->payload, &r->payload_cap, h.payload_len, true)) {
        reply_set_error(r, RPC_RESOURCE_EXHAUSTED, "out of memory for the reply");
    } else {
        if (h.msg_len) memcpy(r->msg, msg, h.msg_len);
        if (h.payload_len) memcpy(r->payload, payload, h.payload_len);
        r->msg_len = h.msg_len;
        r->payload_len = h.payload_len;
    }
    p->done = true;
    /* A caller that took its own reply needs no poke: one would only end
     * its next call's first wait at once. */
    bool mine = p->on_end && !p->claimed, poke = p->polling && p != reading_for;
    if (mine) p->claimed = true;
    pthread_cond_broadcast(&cl->cv);
    pthread_mutex_unlock(&cl->mu);
    if (poke) { /* the loop (or another caller) read the reply before its caller could */
        uint64_t one = 1;
        if (write(cl->wake_fd, &one, sizeof one) < 0) {
            /* the counter is full: the caller is woken anyway */
        }
    }
    if (mine) async_finish(cl, p);
}

/* ---- who reads a client's socket ---- */

/* On a Unix socket, blocking callers read their own replies
 * (caller_read). Were the loop to watch the socket as well, every reply
 * would wake two threads, the loop for nothing: on a busy host that
 * thread waits for a core, and the two then contend for the
 * bufferevent's lock. So the first blocking call hands the socket's
 * reads over to the callers, and the loop watches only for the server's
 * hang-up (EV_CLOSED: bytes arriving do not wake it). The reads come
 * back to the loop (reads_take_back) for whatever only it may take: a
 * started call or a stream is opened, a caller finds a frame that is not
 * its to take or the peer's hang-up, the peer hangs up, or the keepalive
 * pings. Handing over and taking back from another thread wakes the loop
 * once each, so they stay in place between calls: back to back blocking
 * calls wake only the server and the caller. Unix sockets only: on TCP an
 * error can come without a hang-up, which the EV_CLOSED watch would not
 * take, and libevent would spin on it. All under the bufferevent's lock. */
static void reads_take_back(rpc_conn *c) {
    if (!c->reads_handed) return;
    c->reads_handed = false;
    /* Not waiting for a running hup_cb: it waits for the bufferevent's
     * lock, which this thread holds. */
    event_del_noblock(c->hup);
    pthread_mutex_lock(&c->mu);
    bool closed = c->closed;
    pthread_mutex_unlock(&c->mu);
    if (!closed) bufferevent_enable(c->bev, EV_READ);
}

static void reads_hand_over(rpc_conn *c) {
    if (c->reads_handed || !c->hup) return;
    /* Bytes the loop took into its buffer come first: it keeps them. */
    if (evbuffer_get_length(bufferevent_get_input(c->bev))) return;
    pthread_mutex_lock(&c->mu);
    bool closed = c->closed;
    pthread_mutex_unlock(&c->mu);
    if (closed || event_add(c->hup, NULL) != 0) return;
    c->reads_handed = true;
    bufferevent_disable(c->bev, EV_READ);
}

/* The server hung up while the callers held the reads: the loop reads
 * what is left and then the end, and closes the connection as ever. */
static void hup_cb(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    rpc_conn *c = arg;
    bufferevent_lock(c->bev);
    reads_take_back(c);
    bufferevent_unlock(c->bev);
}

/* Takes the reads back before a call whose frames only the loop may
 * take (a started call, a stream) goes out. Its pending entry is in
 * place first, so a caller that hands the reads over after this sees it
 * and leaves them (caller_read). */
static void reads_for_loop(rpc_conn *c) {
    bufferevent_lock(c->bev);
    reads_take_back(c);
    bufferevent_unlock(c->bev);
}

static void keepalive_cb(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    rpc_conn *c = arg;
    rpc_client *cl = c->cli;
    if (!cl || c->closed) return;
    /* A caller reading its own reply updates these (caller_read). */
    bufferevent_lock(c->bev);
    int64_t idle_ms = (clock_mono_ns() - c->last_rx_ns) / 1000000;
    bool ping_out = c->ping_out, ping = idle_ms >= (int64_t)cl->cfg.keepalive_ms && !ping_out;
    if (ping) {
        c->ping_out = true;
        c->last_rx_ns = clock_mono_ns();
    }
    /* The PONG is the loop's to read when no caller is there to take it
     * (a caller that hands the reads over again takes it itself). */
    if (ping || ping_out) reads_take_back(c);
    bufferevent_unlock(c->bev);
    if (ping_out && idle_ms >= (int64_t)cl->cfg.keepalive_ms) {
        LOG_WARNF("rpc_keepalive_timeout addr=%s idle_ms=%lld", cl->addr_text, (long long)idle_ms);
        rpc_conn_close(c);
        return;
    }
    if (ping) {
        frame_header p = {FRAME_VERSION, FRAME_PING, 0, 0, 0, 0, 0, 0};
        rpc_conn_send(c, &p, NULL, 0, NULL, 0);
    }
}

/* A client connection's events: connected, then as any connection's. */
static void client_on_event(struct bufferevent *bev, short what, void *arg) {
    rpc_conn *c = arg;
    if (what & BEV_EVENT_CONNECTED) {
        rpc_client *cl = c->cli;
        if (!cl) return;
        unsigned peer_uid = 0;
        if (cl->a.is_unix && !rpc_peer_uid_ok(bufferevent_getfd(c->bev), &peer_uid)) {
            /* Someone else's socket at our path: it must not see a prompt. */
            LOG_ERRORF("rpc_peer_refused addr=%s peer_uid=%u uid=%u reason=\"the socket belongs to another user "
                       "(only this user and root are trusted)\"",
                       cl->addr_text, peer_uid, (unsigned)getuid());
            rpc_conn_close(c);
            return;
        }
        rpc_tune_bev(c->bev, !cl->a.is_unix);
        if (c->direct && cl->a.is_unix) /* NULL (out of memory): the loop keeps reading */
            c->hup = event_new(cl->loop->base, bufferevent_getfd(c->bev), EV_CLOSED, hup_cb, c);
        pthread_mutex_lock(&cl->mu);
        cl->connected = true;
        cl->connects++;
        cl->backoff_ms = RPC_BACKOFF_MIN_MS;
        pthread_cond_broadcast(&cl->cv);
        pthread_mutex_unlock(&cl->mu);
        c->last_rx_ns = clock_mono_ns();
        struct timeval tv = {cl->cfg.keepalive_ms / 2000, (cl->cfg.keepalive_ms / 2 % 1000) * 1000};
        c->keepalive = event_new(cl->loop->base, -1, EV_PERSIST, keepalive_cb, c);
        if (c->keepalive) event_add(c->keepalive, &tv);
        /* A first frame at once: a server closes a connection that sends
         * none within its handshake time (5 s), which an idle client's
         * first keepalive ping (after 5 s) would only race. Its PONG also
         * shows the link works end to end. */
        c->ping_out = true;
        frame_header ping = {FRAME_VERSION, FRAME_PING, 0, 0, 0, 0, 0, 0};
        rpc_conn_send(c, &ping, NULL, 0, NULL, 0);
        LOG_INFOF("rpc_connected addr=%s", cl->addr_text);
        return;
    }
    rpc_conn_on_event(bev, what, arg);
}

static void client_connect(rpc_client *cl) {
    pthread_mutex_lock(&cl->mu);
    bool closing = cl->closing;
    pthread_mutex_unlock(&cl->mu);
    if (closing) return;
    int opts = BEV_OPT_CLOSE_ON_FREE | BEV_OPT_THREADSAFE;
    struct bufferevent *bev = NULL;
    if (cl->ssl) {
        SSL *ssl = SSL_new(cl->ssl);
        if (ssl && !cl->a.is_unix) {
            struct in6_addr tmp;
            if (inet_pton(AF_INET, cl->a.host, &tmp) == 1 || inet_pton(AF_INET6, cl->a.host, &tmp) == 1)
                X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), cl->a.host);
            else {
                SSL_set1_host(ssl, cl->a.host);
                SSL_set_tlsext_host_name(ssl, cl->a.host);
            }
        }
        if (ssl) bev = bufferevent_openssl_socket_new(cl->loop->base, -1, ssl, BUFFEREVENT_SSL_CONNECTING, opts);
        if (!bev && ssl) SSL_free(ssl);
    } else {
        bev = bufferevent_socket_new(cl->loop->base, -1, opts);
    }
    rpc_conn *c = bev ? calloc(1, sizeof *c) : NULL;
    if (!c) {
        if (bev) bufferevent_free(bev);
        struct timeval tv = {cl->backoff_ms / 1000, (cl->backoff_ms % 1000) * 1000};
        event_add(cl->retry, &tv);
        return;
    }
    pthread_mutex_init(&c->mu, NULL);
    c->refs = 1;
    c->bev = bev;
    c->cli = cl;
    c->direct = !cl->ssl;
    c->max_frame = cl->cfg.max_frame;
    pthread_mutex_lock(&cl->mu);
    cl->cur = c;
    cl->connected = false;
    pthread_mutex_unlock(&cl->mu);
    bufferevent_setcb(bev, rpc_conn_on_read, rpc_conn_on_write, client_on_event, c);
    bufferevent_enable(bev, EV_READ | EV_WRITE);
    if (bufferevent_socket_connect(bev, (struct sockaddr *)&cl->a.sa, (int)cl->a.len) != 0) rpc_conn_close(c);
}

static void client_start_job(void *arg) { client_connect(arg); }

int rpc_client_open(rpc_client **out, rpc_loop *l, const rpc_client_config *cfg, ae_error *err) {
    *out = NULL;
    rpc_client *cl = calloc(1, sizeof *cl);
    if (!cl) return err_set(err, "out of memory");
    pthread_mutex_init(&cl->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&cl->cv, &ca);
    pthread_condattr_destroy(&ca);
    cl->loop = l;
    cl->cfg = *cfg;
    cl->cfg.tls = (rpc_tls){0};
    if (!cl->cfg.max_frame) cl->cfg.max_frame = RPC_DEFAULT_MAX_FRAME;
    if (!cl->cfg.keepalive_ms) cl->cfg.keepalive_ms = RPC_KEEPALIVE_MS;
    snprintf(cl->addr_text, sizeof cl->addr_text, "%s", cfg->addr ? cfg->addr : "");
    cl->cfg.addr = cl->addr_text;
    cl->backoff_ms = RPC_BACKOFF_MIN_MS;
    cl->next_id = 1;
    cl->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (cl->wake_fd < 0) {
        err_set(err, "eventfd: %s", strerror(errno));
        goto fail;
    }
    if (rpc_addr_parse(cfg->addr, &cl->a, err) != AE_OK) goto fail;
    if ((cfg->tls.cert != NULL) != (cfg->tls.key != NULL)) {
        err_set(err, "a TLS client certificate needs both a certificate and a key");
        goto fail;
    }
    if (cfg->tls.cert && !cfg->tls.ca) {
        err_set(err, "TLS needs the CA that signed the server's certificate");
        goto fail;
    }
    if (cfg->tls.ca && !(cl->ssl = rpc_tls_ctx(&cfg->tls, false, err))) goto fail;
    cl->retry = event_new(l->base, -1, 0, retry_cb, cl);
    if (!cl->retry) {
        err_set(err, "libevent: out of memory");
        goto fail;
    }
    rpc_loop_run(l, client_start_job, cl);
    *out = cl;
    return AE_OK;
fail:
    if (cl->ssl) SSL_CTX_free(cl->ssl);
    if (cl->wake_fd >= 0) close(cl->wake_fd);
    pthread_cond_destroy(&cl->cv);
    pthread_mutex_destroy(&cl->mu);
    free(cl);
    return AE_ERR;
}

static void client_close_job(void *arg) {
    rpc_client *cl = arg;
    event_del(cl->retry);
    pthread_mutex_lock(&cl->mu);
    rpc_conn *c = cl->cur;
    pthread_mutex_unlock(&cl->mu);
    if (c) rpc_conn_close(c);
}

void rpc_client_close(rpc_client *cl) {
    if (!cl) return;
    pthread_mutex_lock(&cl->mu);
    cl->closing = true;
    pthread_mutex_unlock(&cl->mu);
    rpc_loop_run(cl->loop, client_close_job, cl);
    /* Callers still waiting were woken with UNAVAILABLE by the close; let
     * them leave before the client goes. */
    pthread_mutex_lock(&cl->mu);
    while (cl->pend) pthread_cond_wait(&cl->cv, &cl->mu);
    pthread_mutex_unlock(&cl->mu);
    event_free(cl->retry);
    if (cl->ssl) SSL_CTX_free(cl->ssl);
    close(cl->wake_fd);
    pthread_cond_destroy(&cl->cv);
    pthread_mutex_destroy(&cl->mu);
    free(cl);
}

bool rpc_client_connected(rpc_client *cl) {
    pthread_mutex_lock(&cl->mu);
    bool ok = cl->connected;
    pthread_mutex_unlock(&cl->mu);
    return ok;
}

uint64_t rpc_client_connects(rpc_client *cl) {
    pthread_mutex_lock(&cl->mu);
    uint64_t n = cl->connects;
    pthread_mutex_unlock(&cl->mu);
    return n;
}

bool rpc_client_wait_connected(rpc_client *cl, int64_t timeout_ms) {
    struct timespec until = rpc_abs_after_ns(timeout_ms * 1000000);
    pthread_mutex_lock(&cl->mu);
    while (!cl->connected && pthread_cond_timedwait(&cl->cv, &cl->mu, &until) == 0) {
    }
    bool ok = cl->connected;
    pthread_mutex_unlock(&cl->mu);
    return ok;
}

void rpc_reply_free(rpc_reply *r) {
    free(r->msg);
    free(r->payload);
    memset(r, 0, sizeof *r);
}

/* ---- a caller reads its own reply ---- */

/* Whether a caller may take this frame off the socket itself: a REPLY to
 * a blocking unary call (its waiter is woken as the loop would), or a
 * PING or PONG. Anything else (stream items, asynchronous calls, whose
 * callbacks run on the loop thread; refusals; frames that fail their
 * checks) stays in the socket for the loop. */
static bool caller_may_take(rpc_client *cl, rpc_conn *c, const frame_header *h) {
    if (h->kind == FRAME_PING || h->kind == FRAME_PONG) return true;
    if (h->kind != FRAME_REPLY) return false;
    pthread_mutex_lock(&cl->mu);
    pending *p = cl->pend;
    while (p && !(p->id == h->call_id && p->c == c)) p = p->next;
    bool ok = p && !p->done && !p->on_end && !p->on_item;
    pthread_mutex_unlock(&cl->mu);
    return ok;
}

/* Takes what the socket has of the next frame, and dispatches it once
 * whole (under the bufferevent's lock). Returns false to leave the socket
 * to the loop: a frame the caller may not take, the peer's hang-up or an
 * error, which the loop then reads and handles as ever, or bytes the loop
 * already took into its input buffer (they come first). */
static bool caller_take(rpc_client *cl, rpc_conn *c, evutil_socket_t fd) {
    if (evbuffer_get_length(bufferevent_get_input(c->bev))) return false;
    if (!c->have_hdr) {
        uint8_t raw[FRAME_HEADER];
        ssize_t k = recv(fd, raw, FRAME_HEADER, MSG_PEEK | MSG_DONTWAIT);
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
        if (k != FRAME_HEADER) return false; /* hung up, an error, or a header cut short */
        frame_header h;
        ae_error why = {{0}};
        if (frame_decode_header(raw, c->max_frame, &h, &why) != FRAME_OK || !caller_may_take(cl, c, &h)) return false;
        if (recv(fd, raw, FRAME_HEADER, MSG_DONTWAIT) != FRAME_HEADER) return false; /* cannot be short: peeked */
        c->hdr = h;
        c->pad = (16 - h.msg_len % 16) % 16;
        c->have_hdr = true;
        c->body_got = 0;
        c->last_rx_ns = clock_mono_ns();
        c->ping_out = false;
    }
    size_t need = (size_t)c->hdr.msg_len + c->hdr.payload_len;
    if (!rpc_conn_rx_reserve(c, need < RPC_RX_STEP ? need : RPC_RX_STEP)) return false;
    int got = rpc_conn_read_body(c, fd, need);
    if (got < 0) return false;
    if (got == 0) return true;
    c->have_hdr = false;
    rpc_client_frame(c, c->rx + c->pad, c->rx + c->pad + c->hdr.msg_len);
    return true;
}

/* Waits for p's reply by reading the socket on the calling thread: the
 * caller wakes when the reply comes, where it would wait for the loop
 * thread to wake, read the reply and wake it in turn (on a busy host each
 * wake-up may wait for a core). Plain sockets only: TLS keeps its state in
 * the loop's bufferevent. On a Unix socket the loop hands its reads over
 * (reads_hand_over) unless a call only it may read is open; elsewhere,
 * or until then, it reads too: whichever thread holds the bufferevent's
 * lock takes the bytes, both through the same frame state, and the loop
 * pokes wake_fd when it ended this call. Returns
 * once p is done, the deadline has passed, or the socket holds a frame
 * only the loop may take; the caller's wait then goes on as without this. */
static void caller_read(rpc_client *cl, rpc_conn *c, pending *p, int64_t deadline_ns) {
    evutil_socket_t fd = bufferevent_getfd(c->bev);
    bufferevent_lock(c->bev);
    pthread_mutex_lock(&cl->mu);
    p->polling = true;
    bool loop_calls = false; /* open calls whose frames only the loop may take */
    for (pending *q = cl->pend; q; q = q->next) loop_calls |= q->c == c && !q->done && (q->on_end || q->on_item);
    pthread_mutex_unlock(&cl->mu);
    if (!loop_calls) reads_hand_over(c);
    bufferevent_unlock(c->bev);
    reading_for = p;
    for (;;) {
        pthread_mutex_lock(&cl->mu);
        bool done = p->done;
        pthread_mutex_unlock(&cl->mu);
        if (done) break;
        int wait_ms = -1;
        if (deadline_ns) {
            int64_t left = deadline_ns - clock_mono_ns();
            if (left <= 0) break;
            wait_ms = (int)((left + 999999) / 1000000);
        }
        /* A close on the loop thread shuts the socket down, which ends
         * this poll too. */
        struct pollfd pf[2] = {{fd, POLLIN, 0}, {cl->wake_fd, POLLIN, 0}};
        int k = poll(pf, 2, wait_ms);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) break;
        if (pf[1].revents) {
            uint64_t n;
            if (read(cl->wake_fd, &n, sizeof n) < 0) {
                /* EAGAIN: another caller drained it; p->done says */
            }
        }
        if (!pf[0].revents) continue; /* p->done and the deadline are checked above */
        bufferevent_lock(c->bev);
        pthread_mutex_lock(&c->mu);
        bool closed = c->closed;
        pthread_mutex_unlock(&c->mu);
        bool go_on = !closed && caller_take(cl, c, fd);
        if (!go_on) reads_take_back(c); /* the loop reads that frame (or the end) */
        bufferevent_unlock(c->bev);
        if (!go_on) break;
    }
    reading_for = NULL;
    pthread_mutex_lock(&cl->mu);
    p->polling = false;
    pthread_mutex_unlock(&cl->mu);
}

uint32_t rpc_client_call(rpc_client *cl, uint16_t method, const void *msg, uint32_t len, const void *payload,
                         uint32_t payload_len, uint32_t timeout_us, rpc_item_fn on_item, void *item_ctx,
                         rpc_reply *out) {
    rpc_iov part = {payload, payload_len};
    return rpc_client_callv(cl, method, msg, len, &part, 1, timeout_us, on_item, item_ctx, out);
}

uint32_t rpc_client_callv(rpc_client *cl, uint16_t method, const void *msg, uint32_t len, const rpc_iov *parts,
                          int n_parts, uint32_t timeout_us, rpc_item_fn on_item, void *item_ctx, rpc_reply *out) {
    uint64_t payload_len = 0;
    for (int i = 0; i < n_parts; i++) payload_len += parts[i].len;
    out->msg_len = out->payload_len = 0;
    out->error[0] = '\0';
    if (len + payload_len > cl->cfg.max_frame) {
        char text[128];
        snprintf(text, sizeof text, "request of %llu bytes is over the frame limit of %u bytes",
                 (unsigned long long)(len + payload_len), cl->cfg.max_frame);
        reply_set_error(out, RPC_RESOURCE_EXHAUSTED, text);
        return out->status;
    }
    pending p = {.out = out, .on_item = on_item, .item_ctx = item_ctx};
    pthread_mutex_lock(&cl->mu);
    if (!cl->connected || !cl->cur || cl->closing) {
        pthread_mutex_unlock(&cl->mu);
        reply_set_error(out, RPC_UNAVAILABLE, "not connected");
        return out->status;
    }
    rpc_conn *c = cl->cur;
    p.id = cl->next_id++;
    if (cl->next_id == 0) cl->next_id = 1;
    p.c = c;
    p.next = cl->pend;
    cl->pend = &p;
    pthread_mutex_lock(&c->mu);
    c->refs++;
    pthread_mutex_unlock(&c->mu);
    pthread_mutex_unlock(&cl->mu);

    if (on_item) reads_for_loop(c);
    frame_header h = {FRAME_VERSION, FRAME_REQUEST, method, p.id, 0, timeout_us, len, (uint32_t)payload_len};
    bool sent = rpc_conn_sendv(c, &h, msg, len, parts, n_parts) == AE_OK;
    int64_t deadline_ns = timeout_us ? clock_mono_ns() + (int64_t)timeout_us * 1000 : 0;
    if (sent && c->direct && !on_item) caller_read(cl, c, &p, deadline_ns);
    struct timespec until = {deadline_ns / 1000000000, deadline_ns % 1000000000};
    bool timed_out = false;
    pthread_mutex_lock(&cl->mu);
    if (!sent && !p.done) {
        reply_set_error(out, RPC_UNAVAILABLE, "the connection was lost");
        p.done = true;
    }
    while (!p.done) {
        if (!timeout_us) {
            pthread_cond_wait(&cl->cv, &cl->mu);
        } else if (pthread_cond_timedwait(&cl->cv, &cl->mu, &until) == ETIMEDOUT && !p.done) {
            char text[96];
            snprintf(text, sizeof text, "no reply within the deadline of %u us", timeout_us);
            reply_set_error(out, RPC_DEADLINE_EXCEEDED, text);
            p.done = timed_out = true;
        }
    }
    for (pending **q = &cl->pend; *q; q = &(*q)->next)
        if (*q == &p) {
            *q = p.next;
            break;
        }
    pthread_cond_broadcast(&cl->cv); /* rpc_client_close may wait for the last caller */
    pthread_mutex_unlock(&cl->mu);
    if (timed_out) {
        /* Outside cl->mu: the loop thread takes it under the socket's lock. */
        frame_header x = {FRAME_VERSION, FRAME_CANCEL, 0, p.id, 0, 0, 0, 0};
        rpc_conn_send(c, &x, NULL, 0, NULL, 0);
    }
    rpc_conn_unref(c);
    return out->status;
}

static void async_deadline_cb(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    pending *p = arg;
    rpc_client *cl = p->cl;
    pthread_mutex_lock(&cl->mu);
    bool mine = !p->done;
    if (mine) {
        char text[96];
        snprintf(text, sizeof text, "no reply within the deadline");
        reply_set_error(p->out, RPC_DEADLINE_EXCEEDED, text);
        p->done = p->claimed = true;
    }
    pthread_mutex_unlock(&cl->mu);
    if (!mine) return;
    frame_header x = {FRAME_VERSION, FRAME_CANCEL, 0, p->id, 0, 0, 0, 0};
    rpc_conn_send(p->c, &x, NULL, 0, NULL, 0);
    async_finish(cl, p);
}

int rpc_client_start(rpc_client *cl, uint16_t method, const void *msg, uint32_t len, const rpc_iov *parts, int n_parts,
                     uint32_t timeout_us, rpc_item_fn on_item, rpc_end_fn on_end, void *ctx, uint32_t *call_id,
                     ae_error *err) {
    uint64_t payload_len = 0;
    for (int i = 0; i < n_parts; i++) payload_len += parts[i].len;
    if (len + payload_len > cl->cfg.max_frame)
        return err_set(err, "request of %llu bytes is over the frame limit of %u bytes",
                       (unsigned long long)(len + payload_len), cl->cfg.max_frame);
    pending *p = calloc(1, sizeof *p);
    if (!p) return err_set(err, "out of memory");
    p->on_item = on_item;
    p->item_ctx = ctx;
    p->on_end = on_end;
    p->cl = cl;
    p->out = &p->own;
    if (timeout_us && !(p->timer = evtimer_new(cl->loop->base, async_deadline_cb, p))) {
        free(p);
        return err_set(err, "out of memory");
    }
    pthread_mutex_lock(&cl->mu);
    if (!cl->connected || !cl->cur || cl->closing) {
        pthread_mutex_unlock(&cl->mu);
        if (p->timer) event_free(p->timer);
        free(p);
        return err_set(err, "%s: not connected", cl->addr_text);
    }
    rpc_conn *c = cl->cur;
    p->id = cl->next_id++;
    if (cl->next_id == 0) cl->next_id = 1;
    p->c = c;
    p->next = cl->pend;
    cl->pend = p;
    /* One reference for the call, one for the send below: called off the
     * loop thread (the target's Release), the connection may close and
     * end the call before this thread has sent it. */
    pthread_mutex_lock(&c->mu);
    c->refs += 2;
    pthread_mutex_unlock(&c->mu);
    uint32_t id = p->id;
    if (p->timer) {
        /* Armed under cl->mu: its callback takes cl->mu first, so it sees
         * the call registered. */
        struct timeval tv = {(time_t)(timeout_us / 1000000), (suseconds_t)(timeout_us % 1000000)};
        event_add(p->timer, &tv);
    }
    pthread_mutex_unlock(&cl->mu);
    if (call_id) *call_id = id;
    reads_for_loop(c);
    frame_header h = {FRAME_VERSION, FRAME_REQUEST, method, id, 0, timeout_us, len, (uint32_t)payload_len};
    if (rpc_conn_sendv(c, &h, msg, len, parts, n_parts) != AE_OK) {
        /* The connection closed meanwhile: its close ends the call. */
    }
    rpc_conn_unref(c);
    return AE_OK;
}

void rpc_client_cancel(rpc_client *cl, uint32_t call_id) {
    pthread_mutex_lock(&cl->mu);
    rpc_conn *c = NULL;
    for (pending *p = cl->pend; p; p = p->next)
        if (p->id == call_id && !p->done) c = p->c;
    if (c) {
        pthread_mutex_lock(&c->mu);
        c->refs++;
        pthread_mutex_unlock(&c->mu);
    }
    pthread_mutex_unlock(&cl->mu);
    if (!c) return;
    frame_header x = {FRAME_VERSION, FRAME_CANCEL, 0, call_id, 0, 0, 0, 0};
    rpc_conn_send(c, &x, NULL, 0, NULL, 0);
    rpc_conn_unref(c);
}
