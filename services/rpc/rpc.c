#include "rpc.h"

#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/bufferevent_ssl.h>
#include <event2/event.h>
#include <event2/listener.h>
#include <event2/thread.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include "../core/clock.h"
#include "../core/log.h"

/* Bytes one read or write callback moves at most: a Propose of 8
 * sequences x 8 pairs carries about 450 KB of features. */
#define RPC_IO_CHUNK (1 << 20)
#define RPC_RX_STEP (1 << 20)      /* receive buffer reserved ahead of the bytes that came */
#define RPC_MAX_CALLS 1024          /* calls open at once on one server connection */
/* rpc_server_close: how long open calls get to finish on their own (a
 * stream whose last event is on its way), then how long peers get to take
 * what is queued, before the rest is cancelled and cut. */
#define RPC_CLOSE_GRACE_MS 1000

static struct timespec abs_after_ns(int64_t ns);

/* ---- loop ---- */

struct rpc_loop {
    struct event_base *base;
    struct event *keep; /* keeps the loop alive with nothing else to do */
    pthread_t thread;
};

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

/* ---- addresses and TLS ---- */

typedef struct addr {
    struct sockaddr_storage sa;
    socklen_t len;
    bool is_unix;
    char host[256]; /* for the TLS peer check */
} addr;

static int addr_parse(const char *text, addr *a, ae_error *err) {
    memset(a, 0, sizeof *a);
    if (!text || !*text) return err_set(err, "no address given");
    if (strncmp(text, "unix:", 5) == 0) {
        struct sockaddr_un *un = (struct sockaddr_un *)&a->sa;
        const char *path = text + 5;
        if (!*path || strlen(path) >= sizeof un->sun_path)
            return err_set(err, "Unix socket path \"%s\" is empty or too long (max %zu bytes)", path,
                           sizeof un->sun_path - 1);
        un->sun_family = AF_UNIX;
        memcpy(un->sun_path, path, strlen(path) + 1);
        a->len = (socklen_t)sizeof *un;
        a->is_unix = true;
        return AE_OK;
    }
    const char *colon = strrchr(text, ':');
    if (!colon || colon == text || !colon[1])
        return err_set(err, "address \"%s\" is neither unix:PATH nor HOST:PORT", text);
    size_t hl = (size_t)(colon - text);
    if (text[0] == '[' && hl >= 2 && text[hl - 1] == ']') text++, hl -= 2;
    if (hl >= sizeof a->host) return err_set(err, "host name in \"%s\" is too long", text);
    memcpy(a->host, text, hl);
    a->host[hl] = '\0';
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int rc = getaddrinfo(a->host, colon + 1, &hints, &res);
    if (rc != 0) return err_set(err, "cannot resolve \"%s\": %s", text, gai_strerror(rc));
    memcpy(&a->sa, res->ai_addr, res->ai_addrlen);
    a->len = res->ai_addrlen;
    freeaddrinfo(res);
    return AE_OK;
}

int rpc_default_addr(char *out, size_t cap, const char *name, bool create, ae_error *err) {
    char dir[200];
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    int n;
    if (xdg && xdg[0] == '/') n = snprintf(dir, sizeof dir, "%s/aerie", xdg);
    else if (getuid() == 0) n = snprintf(dir, sizeof dir, "/run/aerie");
    else n = snprintf(dir, sizeof dir, "/tmp/aerie-%u", (unsigned)getuid());
    if (n < 0 || (size_t)n >= sizeof dir) return err_set(err, "runtime directory under \"%s\" is too long", xdg);
    if (create && mkdir(dir, 0700) != 0 && errno != EEXIST)
        return err_set(err, "cannot make the runtime directory %s: %s", dir, strerror(errno));
    struct stat st;
    if (lstat(dir, &st) == 0) {
        if (!S_ISDIR(st.st_mode)) return err_set(err, "runtime directory %s is not a directory", dir);
        if (st.st_uid != getuid())
            return err_set(err, "runtime directory %s belongs to uid %u, not to this user (uid %u)", dir,
                           (unsigned)st.st_uid, (unsigned)getuid());
        if (st.st_mode & 077)
            return err_set(err, "runtime directory %s is open to other users (mode %03o, want 700)", dir,
                           (unsigned)(st.st_mode & 0777));
    } else if (create || errno != ENOENT) {
        return err_set(err, "runtime directory %s: %s", dir, strerror(errno));
    }
    n = snprintf(out, cap, "unix:%s/%s", dir, name);
    if (n < 0 || (size_t)n >= cap || (size_t)n - 5 >= sizeof ((struct sockaddr_un *)0)->sun_path)
        return err_set(err, "socket path %s/%s is too long", dir, name);
    return AE_OK;
}

static void ssl_error_text(char *buf, size_t cap) {
    unsigned long e = ERR_get_error();
    if (e) ERR_error_string_n(e, buf, cap);
    else snprintf(buf, cap, "unknown TLS error");
    ERR_clear_error();
}

static SSL_CTX *tls_ctx(const rpc_tls *t, bool server, ae_error *err) {
    char why[256];
    SSL_CTX *ctx = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
    if (!ctx) {
        ssl_error_text(why, sizeof why);
        err_set(err, "TLS: %s", why);
        return NULL;
    }
    SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION);
    if (t->cert && SSL_CTX_use_certificate_chain_file(ctx, t->cert) != 1) {
        ssl_error_text(why, sizeof why);
        err_set(err, "TLS certificate %s: %s", t->cert, why);
        goto fail;
    }
    if (t->key && (SSL_CTX_use_PrivateKey_file(ctx, t->key, SSL_FILETYPE_PEM) != 1 ||
                   SSL_CTX_check_private_key(ctx) != 1)) {
        ssl_error_text(why, sizeof why);
        err_set(err, "TLS key %s: %s", t->key, why);
        goto fail;
    }
    if (t->ca) {
        if (SSL_CTX_load_verify_locations(ctx, t->ca, NULL) != 1) {
            ssl_error_text(why, sizeof why);
            err_set(err, "TLS CA %s: %s", t->ca, why);
            goto fail;
        }
        SSL_CTX_set_verify(ctx, server ? SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT : SSL_VERIFY_PEER,
                           NULL);
    }
    return ctx;
fail:
    SSL_CTX_free(ctx);
    return NULL;
}

/* ---- connections (both sides) ---- */

typedef struct conn conn;

struct rpc_call {
    conn *c;
    rpc_server *srv; /* counts the call until it is finished */
    uint32_t id;
    atomic_bool cancelled;
    bool streamed;
    bool finished; /* a REPLY or END went out (the deadline may send one first) */
    int64_t deadline_ns; /* 0: none */
    rpc_request req; /* msg and payload point into buf */
    uint8_t *buf;
    size_t buf_cap;
    rpc_call *prev, *next; /* the connection's open calls */
};

struct conn {
    pthread_mutex_t mu; /* refs, closed, calls */
    int refs;           /* the loop's while open, one per open call */
    bool closed;
    struct bufferevent *bev;
    rpc_server *srv;
    rpc_client *cli;
    uint64_t id;
    uint32_t max_frame;
    frame_header hdr; /* of the frame being read */
    bool have_hdr;
    bool direct;      /* a plain socket: bodies are read straight into rx */
    /* The body being read: rx + pad holds the message, then the payload,
     * which pad puts on a 16-byte boundary. Grow-only; a server request
     * takes the buffer with it. */
    uint8_t *rx;
    size_t rx_cap, body_got;
    uint32_t pad;
    uint8_t *spare; /* a finished call's buffer, for the next request */
    size_t spare_cap;
    bool close_after_flush;
    rpc_call *calls;
    int64_t last_rx_ns;
    int64_t calls_end_ns; /* when the last open call ended (under mu): idle counts from there too */
    bool ping_out;
    struct event *keepalive;
    /* Server side. timer: the handshake/first-frame limit, then the idle
     * limit, and the drop of a peer that leaves too much unsent. */
    struct event *timer;
    int64_t accept_ns;
    uint32_t handshake_ms, idle_ms;
    bool got_frame;
    size_t max_out;   /* 0: no limit (a client's connection) */
    bool read_paused; /* under the bufferevent's lock: too much unsent */
    bool reads_off;   /* the server is closing: no more requests */
    bool drop;        /* under the bufferevent's lock: past max_out */
    size_t drop_queued;
    /* Client side, Unix socket: the loop's reads handed to blocking
     * callers (reads_hand_over), under the bufferevent's lock; hup
     * watches for the server's hang-up meanwhile. */
    bool reads_handed;
    struct event *hup;
    conn *next; /* the server's connections */
};

static void conn_unref(conn *c) {
    pthread_mutex_lock(&c->mu);
    bool last = --c->refs == 0;
    pthread_mutex_unlock(&c->mu);
    if (!last) return;
    if (c->keepalive) event_free(c->keepalive);
    if (c->timer) event_free(c->timer);
    if (c->hup) event_free(c->hup);
    bufferevent_free(c->bev);
    free(c->rx);
    free(c->spare);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

/* Writes one frame; dropped when the connection is closed. */
static int conn_sendv(conn *c, const frame_header *h, const void *msg, uint32_t len, const rpc_iov *parts,
                      int n_parts) {
    pthread_mutex_lock(&c->mu);
    if (c->closed) {
        pthread_mutex_unlock(&c->mu);
        return AE_ERR;
    }
    c->refs++;
    pthread_mutex_unlock(&c->mu);
    uint8_t raw[FRAME_HEADER];
    frame_encode_header(h, raw);
    bufferevent_lock(c->bev);
    struct evbuffer *out = bufferevent_get_output(c->bev);
    if (c->max_out && (c->drop || evbuffer_get_length(out) > c->max_out)) {
        /* The peer leaves more than max_out unsent beyond the frame before:
         * it is dropped as gone (on the loop thread) instead of queueing
         * without end. */
        if (!c->drop) {
            c->drop = true;
            c->drop_queued = evbuffer_get_length(out);
            event_active(c->timer, EV_TIMEOUT, 1);
        }
        bufferevent_unlock(c->bev);
        conn_unref(c);
        return AE_ERR;
    }
    /* On a plain socket with nothing queued, the caller's thread writes
     * the frame itself: no copy into the queue and no hand-off to the
     * loop thread (together most of a Propose's link cost). What the
     * kernel does not take is queued for the loop, in order. */
    size_t skip = 0;
    if (c->direct && evbuffer_get_length(out) == 0) {
        struct iovec iov[2 + 130];
        int n = 0;
        iov[n++] = (struct iovec){raw, FRAME_HEADER};
        if (len) iov[n++] = (struct iovec){(void *)msg, len};
        for (int i = 0; i < n_parts && n < (int)(sizeof iov / sizeof iov[0]); i++)
            if (parts[i].len) iov[n++] = (struct iovec){(void *)parts[i].base, parts[i].len};
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t k = sendmsg(bufferevent_getfd(c->bev), &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) skip = (size_t)k;
    }
    int rc = 0;
    const void *pieces[2] = {raw, msg};
    size_t sizes[2] = {FRAME_HEADER, len};
    for (int i = 0; rc == 0 && i < 2 + n_parts; i++) {
        const uint8_t *base = i < 2 ? pieces[i] : parts[i - 2].base;
        size_t n = i < 2 ? sizes[i] : parts[i - 2].len;
        size_t drop = skip < n ? skip : n;
        skip -= drop;
        if (n > drop) rc = evbuffer_add(out, base + drop, n - drop);
    }
    if (c->max_out && !c->read_paused && evbuffer_get_length(out) > RPC_OUT_PAUSE_BYTES) {
        /* No more requests from a peer that does not take its replies:
         * on_write resumes once it has read half of them. */
        c->read_paused = true;
        bufferevent_disable(c->bev, EV_READ);
    }
    bufferevent_unlock(c->bev);
    conn_unref(c);
    return rc == 0 ? AE_OK : AE_ERR;
}

static int conn_send(conn *c, const frame_header *h, const void *msg, uint32_t len, const void *payload,
                     uint32_t plen) {
    rpc_iov part = {payload, plen};
    return conn_sendv(c, h, msg, len, &part, 1);
}

static void send_error(conn *c, uint8_t kind, uint32_t call_id, uint32_t status, const char *text) {
    frame_header h = {FRAME_VERSION, kind, 0, call_id, status, 0, (uint32_t)strnlen(text, FRAME_MAX_ERROR), 0};
    conn_send(c, &h, text, h.msg_len, NULL, 0);
}

static void server_conn_closed(conn *c);
static void client_conn_closed(conn *c);

/* Closes a connection (loop thread): its calls are cancelled and the
 * socket shut; memory goes when the last open call is finished. */
static void conn_close(conn *c) {
    pthread_mutex_lock(&c->mu);
    if (c->closed) {
        pthread_mutex_unlock(&c->mu);
        return;
    }
    c->closed = true;
    for (rpc_call *k = c->calls; k; k = k->next) atomic_store(&k->cancelled, true);
    pthread_mutex_unlock(&c->mu);
    if (c->keepalive) event_del(c->keepalive);
    if (c->timer) event_del(c->timer);
    if (c->hup) event_del(c->hup);
    bufferevent_disable(c->bev, EV_READ | EV_WRITE);
    evutil_socket_t fd = bufferevent_getfd(c->bev);
    if (fd >= 0) shutdown(fd, SHUT_RDWR);
    if (c->srv) server_conn_closed(c);
    if (c->cli) client_conn_closed(c);
    conn_unref(c);
}

/* Sends what is queued, then closes: for an error the peer should read. */
static void conn_close_after_flush(conn *c) {
    c->close_after_flush = true;
    bufferevent_disable(c->bev, EV_READ);
    if (evbuffer_get_length(bufferevent_get_output(c->bev)) == 0) conn_close(c);
}

static void on_read(struct bufferevent *bev, void *arg);

static void on_write(struct bufferevent *bev, void *arg) {
    conn *c = arg;
    size_t queued = evbuffer_get_length(bufferevent_get_output(bev));
    if (c->close_after_flush && queued == 0) {
        conn_close(c);
        return;
    }
    if (c->read_paused && queued <= RPC_OUT_PAUSE_BYTES / 2 && !c->closed && !c->close_after_flush && !c->reads_off) {
        c->read_paused = false;
        bufferevent_enable(bev, EV_READ);
        /* Frames that came before the pause wait in the input buffer. */
        if (evbuffer_get_length(bufferevent_get_input(bev))) on_read(bev, c);
    }
}

static void server_frame(conn *c, const uint8_t *msg, const uint8_t *payload);
static void client_frame(conn *c, const uint8_t *msg, const uint8_t *payload);

/* Makes rx hold a body of n bytes after a pad that aligns the payload. */
/* Makes rx hold the first `upto` bytes of the body (after the pad that
 * aligns the payload), keeping what was read. A header alone reserves at
 * most RPC_RX_STEP: the rest grows as bytes arrive, so a peer that only
 * claims a large frame ties up little memory. */
static bool rx_reserve(conn *c, size_t upto) {
    size_t need = (size_t)c->pad + upto;
    if (c->rx && need <= c->rx_cap) return true;
    if (!c->rx) {
        pthread_mutex_lock(&c->mu);
        if (c->spare && c->spare_cap >= need) {
            c->rx = c->spare, c->rx_cap = c->spare_cap;
            c->spare = NULL, c->spare_cap = 0;
        }
        pthread_mutex_unlock(&c->mu);
        if (c->rx) return true;
    }
    size_t cap = need < 4096 ? 4096 : (need + 15) / 16 * 16;
    if (c->rx && cap < 2 * c->rx_cap) cap = 2 * c->rx_cap; /* amortized growth */
    size_t full = (size_t)c->pad + c->hdr.msg_len + c->hdr.payload_len;
    if (cap > full) cap = (full + 15) / 16 * 16;
    if (cap < 4096) cap = 4096;
    uint8_t *p = aligned_alloc(16, cap);
    if (!p) return false;
    if (c->rx && c->body_got) memcpy(p + c->pad, c->rx + c->pad, c->body_got);
    free(c->rx);
    c->rx = p;
    c->rx_cap = cap;
    return true;
}

/* Reads the rest of the current frame's body straight from a plain
 * socket into rx, as far as the kernel has it now. Returns 1 once the body
 * is whole, 0 when more is to come, -1 when the peer hung up mid-frame (or
 * rx cannot grow): nothing of that frame is dispatched. Under the
 * bufferevent's lock. */
static int read_body(conn *c, evutil_socket_t fd, size_t need) {
    while (c->body_got < need) {
        size_t room = c->rx_cap - c->pad - c->body_got;
        if (room == 0) {
            if (!rx_reserve(c, c->body_got + RPC_RX_STEP < need ? c->body_got + RPC_RX_STEP : need)) return -1;
            room = c->rx_cap - c->pad - c->body_got;
        }
        size_t want = need - c->body_got < room ? need - c->body_got : room;
        ssize_t k = recv(fd, c->rx + c->pad + c->body_got, want, MSG_DONTWAIT);
        if (k > 0) c->body_got += (size_t)k;
        else if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return -1;
        else if (errno != EINTR) return 0;
    }
    return 1;
}

/* Reads frames while whole ones are there. libevent reads a socket 4 KiB
 * per wakeup, so on a plain socket the rest of a large body is read here
 * directly, in as few calls as the kernel allows. */
static void on_read(struct bufferevent *bev, void *arg) {
    conn *c = arg;
    struct evbuffer *in = bufferevent_get_input(bev);
    /* A frame may close the connection, and the close may drop the last
     * reference: hold one until this callback is done with c. */
    pthread_mutex_lock(&c->mu);
    c->refs++;
    pthread_mutex_unlock(&c->mu);
    c->last_rx_ns = clock_mono_ns();
    c->ping_out = false;
    while (!c->closed && !c->close_after_flush && !c->read_paused) {
        if (!c->have_hdr) {
            if (evbuffer_get_length(in) < FRAME_HEADER) break;
            uint8_t raw[FRAME_HEADER];
            evbuffer_remove(in, raw, FRAME_HEADER);
            ae_error why = {{0}};
            frame_check chk = frame_decode_header(raw, c->max_frame, &c->hdr, &why);
            if (chk != FRAME_OK) {
                LOG_WARNF("rpc_bad_frame conn=%llu reason=\"%s\"", (unsigned long long)c->id, why.msg);
                if (c->srv && (chk == FRAME_BAD_VERSION || chk == FRAME_TOO_BIG)) {
                    uint32_t status = chk == FRAME_TOO_BIG ? RPC_RESOURCE_EXHAUSTED : RPC_FAILED_PRECONDITION;
                    /* The version byte is ours so that the peer can read why. */
                    send_error(c, FRAME_REPLY, c->hdr.call_id, status, why.msg);
                    conn_close_after_flush(c);
                } else {
                    conn_close(c); /* a server's bad frame: its calls end UNAVAILABLE */
                }
                break;
            }
            c->pad = (16 - c->hdr.msg_len % 16) % 16;
            c->have_hdr = true;
            c->body_got = 0;
        }
        size_t need = (size_t)c->hdr.msg_len + c->hdr.payload_len;
        size_t avail = evbuffer_get_length(in), take = avail < need - c->body_got ? avail : need - c->body_got;
        size_t ahead = c->body_got + take + (c->direct ? RPC_RX_STEP : 0);
        if (!rx_reserve(c, ahead < need ? ahead : need)) {
            LOG_ERRORF("rpc_out_of_memory conn=%llu frame_bytes=%zu", (unsigned long long)c->id, need);
            conn_close(c);
            break;
        }
        uint8_t *body = c->rx + c->pad;
        if (take) evbuffer_remove(in, body + c->body_got, take);
        c->body_got += take;
        bool hung_up = c->body_got < need && c->direct && read_body(c, bufferevent_getfd(bev), need) < 0;
        if (hung_up) {
            conn_close(c);
            break;
        }
        if (c->body_got < need) break;
        c->have_hdr = false;
        body = c->rx + c->pad; /* read_body may have moved rx */
        if (c->srv) server_frame(c, body, body + c->hdr.msg_len);
        else client_frame(c, body, body + c->hdr.msg_len);
    }
    conn_unref(c);
}

static void tune_bev(struct bufferevent *bev, bool tcp) {
    bufferevent_set_max_single_read(bev, RPC_IO_CHUNK);
    bufferevent_set_max_single_write(bev, RPC_IO_CHUNK);
    evutil_socket_t fd = bufferevent_getfd(bev);
    if (fd < 0) return;
    if (tcp) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    /* A Propose (about 450 KB) in one write and one read where the kernel
     * allows (it caps this at net.core.wmem_max / rmem_max): the default
     * 208 KiB takes three rounds through the event loop. */
    int buf = RPC_IO_CHUNK;
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
}

/* ---- server ---- */

struct rpc_server {
    rpc_loop *loop;
    rpc_server_config cfg;
    char addr_text[256];
    addr a;
    SSL_CTX *ssl;
    struct evconnlistener *listener;
    pthread_mutex_t mu; /* conns, n_conns, n_calls */
    pthread_cond_t cv; /* n_calls or n_conns fell (CLOCK_MONOTONIC) */
    conn *conns;
    int n_conns;
    int n_calls; /* handed to the handler and not yet finished */
    uint64_t next_conn_id;
};

static void server_conn_closed(conn *c) {
    rpc_server *s = c->srv;
    pthread_mutex_lock(&s->mu);
    for (conn **p = &s->conns; *p; p = &(*p)->next)
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

static void on_event(struct bufferevent *bev, short what, void *arg);

/* Unix sockets: the peer must run as this user or as root; another local
 * user must not be able to talk to (or pose as) a service. */
static bool peer_uid_ok(evutil_socket_t fd, unsigned *peer_uid) {
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return false;
    *peer_uid = (unsigned)cred.uid;
    return cred.uid == getuid() || cred.uid == 0;
}

/* A server connection's clock (loop thread): closes one that sent no whole
 * frame within handshake_ms of accept, then one silent for idle_ms with no
 * call open, and drops one conn_sendv found past max_out. */
static void server_timer_cb(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    conn *c = arg;
    if (c->closed) return;
    bufferevent_lock(c->bev);
    bool drop = c->drop;
    size_t queued = c->drop_queued;
    bufferevent_unlock(c->bev);
    if (drop) {
        LOG_WARNF("rpc_dropped conn=%llu reason=\"the peer does not read its replies: %zu bytes unsent, limit %zu\"",
                  (unsigned long long)c->id, queued, c->max_out);
        conn_close(c);
        return;
    }
    int64_t now = clock_mono_ns(), left_ms;
    if (!c->got_frame) {
        left_ms = c->handshake_ms - (now - c->accept_ns) / 1000000;
        if (left_ms <= 0) {
            LOG_INFOF("rpc_closed conn=%llu reason=\"no frame within %u ms of accept\"", (unsigned long long)c->id,
                      c->handshake_ms);
            conn_close(c);
            return;
        }
    } else {
        pthread_mutex_lock(&c->mu);
        bool busy = c->calls != NULL;
        int64_t ended = c->calls_end_ns;
        pthread_mutex_unlock(&c->mu);
        /* An open call (a long stream) is activity, and so is its end: a
         * peer that only streamed is silent from the last call's end. */
        if (busy) c->last_rx_ns = now;
        else if (ended > c->last_rx_ns) c->last_rx_ns = ended;
        left_ms = c->idle_ms - (now - c->last_rx_ns) / 1000000;
        if (left_ms <= 0) {
            LOG_INFOF("rpc_closed conn=%llu reason=\"silent for %lld ms (the limit is %u)\"", (unsigned long long)c->id,
                      (long long)((now - c->last_rx_ns) / 1000000), c->idle_ms);
            conn_close(c);
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
    if (s->a.is_unix && !peer_uid_ok(fd, &peer_uid)) {
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
    conn *c = bev ? calloc(1, sizeof *c) : NULL;
    struct event *timer = c ? event_new(s->loop->base, -1, 0, server_timer_cb, c) : NULL;
    if (!timer) {
        free(c);
        if (bev) bufferevent_free(bev);
        else evutil_closesocket(fd);
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
    tune_bev(bev, !s->a.is_unix);
    bufferevent_setcb(bev, on_read, on_write, on_event, c);
    /* on_write runs once the queue is down to half the pause mark. */
    bufferevent_setwatermark(bev, EV_WRITE, RPC_OUT_PAUSE_BYTES / 2, 0);
    bufferevent_enable(bev, EV_READ | EV_WRITE);
    struct timeval tv = {c->handshake_ms / 1000, c->handshake_ms % 1000 * 1000};
    event_add(c->timer, &tv);
}

/* Unlinks the call; its buffer goes back to the connection for the next
 * request (a Propose's payload is about 450 KB: allocating it fresh each
 * time costs more in page faults than the socket does). */
static void call_unlink(rpc_call *k) {
    conn *c = k->c;
    pthread_mutex_lock(&c->mu);
    if (!c->spare && !c->closed) {
        c->spare = k->buf, c->spare_cap = k->buf_cap;
        k->buf = NULL;
    }
    if (k->prev) k->prev->next = k->next;
    else if (c->calls == k) c->calls = k->next;
    if (k->next) k->next->prev = k->prev;
    k->prev = k->next = NULL;
    if (!c->calls) c->calls_end_ns = clock_mono_ns();
    pthread_mutex_unlock(&c->mu);
}

static void call_free(rpc_call *k) {
    conn *c = k->c;
    rpc_server *s = k->srv;
    call_unlink(k);
    free(k->buf);
    free(k);
    conn_unref(c);
    if (s) { /* the last touch of s: rpc_server_close may free it next */
        pthread_mutex_lock(&s->mu);
        if (--s->n_calls == 0) pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
    }
}

static void server_frame(conn *c, const uint8_t *msg, const uint8_t *payload) {
    frame_header h = c->hdr;
    if (!c->got_frame) { /* from now on the idle limit */
        c->got_frame = true;
        struct timeval tv = {c->idle_ms / 1000, c->idle_ms % 1000 * 1000};
        event_add(c->timer, &tv);
    }
    if (h.kind == FRAME_PING) {
        frame_header p = {FRAME_VERSION, FRAME_PONG, 0, h.call_id, 0, 0, 0, 0};
        conn_send(c, &p, NULL, 0, NULL, 0);
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
        send_error(c, FRAME_REPLY, h.call_id, RPC_INVALID_ARGUMENT, "a client may send requests, cancels and pings only");
        conn_close_after_flush(c);
        return;
    }
    bool dup = false;
    int open = 0;
    pthread_mutex_lock(&c->mu);
    for (rpc_call *k = c->calls; k; k = k->next) dup |= k->id == h.call_id, open++;
    pthread_mutex_unlock(&c->mu);
    if (dup) {
        send_error(c, FRAME_REPLY, h.call_id, RPC_ALREADY_EXISTS, "call id already in use on this connection");
        return;
    }
    if (open >= RPC_MAX_CALLS) {
        send_error(c, FRAME_REPLY, h.call_id, RPC_RESOURCE_EXHAUSTED, "too many calls open on this connection");
        return;
    }
    rpc_call *k = calloc(1, sizeof *k);
    if (!k) {
        send_error(c, FRAME_REPLY, h.call_id, RPC_RESOURCE_EXHAUSTED, "out of memory");
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
    if (conn_send(k->c, &h, msg, len, NULL, 0) != AE_OK) return err_set(err, "the connection is closed");
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
    if (!k->finished) conn_send(k->c, &h, msg, len, payload, payload_len);
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
    if (status == RPC_CANCELLED && k->deadline_ns && clock_mono_ns() > k->deadline_ns) {
        /* Cancelled because its time ran out: say so. */
        status = RPC_DEADLINE_EXCEEDED;
        snprintf(text, sizeof text, "deadline of %u us exceeded", k->req.timeout_us);
    }
    frame_header h = {FRAME_VERSION, k->streamed ? FRAME_END : FRAME_REPLY, k->req.method, k->id, status, 0,
                      (uint32_t)strlen(text), 0};
    if (!k->finished) conn_send(k->c, &h, text, h.msg_len, NULL, 0);
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
    if (addr_parse(cfg->addr, &s->a, err) != AE_OK) goto fail;
    if ((cfg->tls.cert != NULL) != (cfg->tls.key != NULL)) {
        err_set(err, "TLS needs both a certificate and a key");
        goto fail;
    }
    if (cfg->tls.ca && !cfg->tls.cert) {
        err_set(err, "client certificates (a CA) need TLS: set a certificate and key too");
        goto fail;
    }
    if (cfg->tls.cert && !(s->ssl = tls_ctx(&cfg->tls, true, err))) goto fail;
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
    conn *c = s->conns;
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
    conn *c = s->conns;
    pthread_mutex_unlock(&s->mu);
    for (conn *next; c; c = next) {
        next = c->next;
        pthread_mutex_lock(&c->mu);
        for (rpc_call *k = c->calls; k; k = k->next) atomic_store(&k->cancelled, true);
        pthread_mutex_unlock(&c->mu);
        conn_close_after_flush(c);
    }
}

/* Closes what is left: peers that did not take their replies in time. */
static void server_close_rest_job(void *arg) {
    rpc_server *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        conn *c = s->conns;
        pthread_mutex_unlock(&s->mu);
        if (!c) break;
        conn_close(c);
    }
}

void rpc_server_close(rpc_server *s) {
    if (!s) return;
    AE_ASSERT(!pthread_equal(pthread_self(), s->loop->thread)); /* handlers may finish calls on the loop */
    rpc_loop_run(s->loop, server_stop_job, s);
    /* Calls that are about to end (a drained scheduler's last events may
     * still be on their way) end as they would have. */
    struct timespec until = abs_after_ns((int64_t)RPC_CLOSE_GRACE_MS * 1000000);
    pthread_mutex_lock(&s->mu);
    while (s->n_calls > 0 && pthread_cond_timedwait(&s->cv, &s->mu, &until) == 0) {
    }
    pthread_mutex_unlock(&s->mu);
    rpc_loop_run(s->loop, server_close_job, s);
    until = abs_after_ns((int64_t)RPC_CLOSE_GRACE_MS * 1000000);
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

/* ---- client ---- */

typedef struct pending {
    uint32_t id;
    conn *c;
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
    addr a;
    SSL_CTX *ssl;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* a call ended, or the connection came or went */
    conn *cur;         /* connecting or connected */
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
    conn_unref(p->c);
    free(p);
}

/* Claims one finished, unclaimed asynchronous call of connection c. */
static pending *claim_finished(rpc_client *cl, conn *c) {
    pthread_mutex_lock(&cl->mu);
    pending *p = cl->pend;
    while (p && !(p->on_end && p->c == c && p->done && !p->claimed)) p = p->next;
    if (p) p->claimed = true;
    pthread_mutex_unlock(&cl->mu);
    return p;
}

static void client_conn_closed(conn *c) {
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

static void client_frame(conn *c, const uint8_t *msg, const uint8_t *payload) {
    rpc_client *cl = c->cli;
    frame_header h = c->hdr;
    if (h.kind == FRAME_PONG) return;
    if (h.kind == FRAME_PING) {
        frame_header p = {FRAME_VERSION, FRAME_PONG, 0, h.call_id, 0, 0, 0, 0};
        conn_send(c, &p, NULL, 0, NULL, 0);
        return;
    }
    if (h.kind != FRAME_REPLY && h.kind != FRAME_ITEM && h.kind != FRAME_END) {
        LOG_WARNF("rpc_bad_frame addr=%s reason=\"a server sent a frame of kind %u\"", cl->addr_text, h.kind);
        conn_close(c);
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
            LOG_WARNF("rpc_call_refused addr=%s status=%s reason=\"%.*s\"", cl->addr_text, rpc_status_name(h.status),
                      (int)n_err, (const char *)msg);
        return;
    }
    rpc_reply *r = p->out;
    if (h.kind == FRAME_ITEM) {
        if (p->on_item && !p->on_item(p->item_ctx, msg, h.msg_len)) {
            frame_header x = {FRAME_VERSION, FRAME_CANCEL, 0, h.call_id, 0, 0, 0, 0};
            conn_send(c, &x, NULL, 0, NULL, 0);
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
static void reads_take_back(conn *c) {
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

static void reads_hand_over(conn *c) {
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
    conn *c = arg;
    bufferevent_lock(c->bev);
    reads_take_back(c);
    bufferevent_unlock(c->bev);
}

/* Takes the reads back before a call whose frames only the loop may
 * take (a started call, a stream) goes out. Its pending entry is in
 * place first, so a caller that hands the reads over after this sees it
 * and leaves them (caller_read). */
static void reads_for_loop(conn *c) {
    bufferevent_lock(c->bev);
    reads_take_back(c);
    bufferevent_unlock(c->bev);
}

static void keepalive_cb(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    conn *c = arg;
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
        conn_close(c);
        return;
    }
    if (ping) {
        frame_header p = {FRAME_VERSION, FRAME_PING, 0, 0, 0, 0, 0, 0};
        conn_send(c, &p, NULL, 0, NULL, 0);
    }
}

static void on_event(struct bufferevent *bev, short what, void *arg) {
    (void)bev;
    conn *c = arg;
    if (what & BEV_EVENT_CONNECTED) {
        rpc_client *cl = c->cli;
        if (!cl) return;
        unsigned peer_uid = 0;
        if (cl->a.is_unix && !peer_uid_ok(bufferevent_getfd(c->bev), &peer_uid)) {
            /* Someone else's socket at our path: it must not see a prompt. */
            LOG_ERRORF("rpc_peer_refused addr=%s peer_uid=%u uid=%u reason=\"the socket belongs to another user "
                       "(only this user and root are trusted)\"",
                       cl->addr_text, peer_uid, (unsigned)getuid());
            conn_close(c);
            return;
        }
        tune_bev(c->bev, !cl->a.is_unix);
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
        conn_send(c, &ping, NULL, 0, NULL, 0);
        LOG_INFOF("rpc_connected addr=%s", cl->addr_text);
        return;
    }
    if (what & (BEV_EVENT_EOF | BEV_EVENT_ERROR | BEV_EVENT_TIMEOUT)) {
        if (what & BEV_EVENT_ERROR) {
            unsigned long e = bufferevent_get_openssl_error(c->bev);
            if (e) {
                char why[256];
                ERR_error_string_n(e, why, sizeof why);
                LOG_WARNF("rpc_tls_error conn=%llu reason=\"%s\"", (unsigned long long)c->id, why);
            }
        }
        conn_close(c);
    }
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
    conn *c = bev ? calloc(1, sizeof *c) : NULL;
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
    bufferevent_setcb(bev, on_read, on_write, on_event, c);
    bufferevent_enable(bev, EV_READ | EV_WRITE);
    if (bufferevent_socket_connect(bev, (struct sockaddr *)&cl->a.sa, (int)cl->a.len) != 0) conn_close(c);
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
    if (addr_parse(cfg->addr, &cl->a, err) != AE_OK) goto fail;
    if ((cfg->tls.cert != NULL) != (cfg->tls.key != NULL)) {
        err_set(err, "a TLS client certificate needs both a certificate and a key");
        goto fail;
    }
    if (cfg->tls.cert && !cfg->tls.ca) {
        err_set(err, "TLS needs the CA that signed the server's certificate");
        goto fail;
    }
    if (cfg->tls.ca && !(cl->ssl = tls_ctx(&cfg->tls, false, err))) goto fail;
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
    conn *c = cl->cur;
    pthread_mutex_unlock(&cl->mu);
    if (c) conn_close(c);
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

static struct timespec abs_after_ns(int64_t ns) {
    int64_t t = clock_mono_ns() + ns;
    return (struct timespec){t / 1000000000, t % 1000000000};
}

bool rpc_client_wait_connected(rpc_client *cl, int64_t timeout_ms) {
    struct timespec until = abs_after_ns(timeout_ms * 1000000);
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
static bool caller_may_take(rpc_client *cl, conn *c, const frame_header *h) {
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
static bool caller_take(rpc_client *cl, conn *c, evutil_socket_t fd) {
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
    if (!rx_reserve(c, need < RPC_RX_STEP ? need : RPC_RX_STEP)) return false;
    int got = read_body(c, fd, need);
    if (got < 0) return false;
    if (got == 0) return true;
    c->have_hdr = false;
    client_frame(c, c->rx + c->pad, c->rx + c->pad + c->hdr.msg_len);
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
static void caller_read(rpc_client *cl, conn *c, pending *p, int64_t deadline_ns) {
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
    conn *c = cl->cur;
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
    bool sent = conn_sendv(c, &h, msg, len, parts, n_parts) == AE_OK;
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
        conn_send(c, &x, NULL, 0, NULL, 0);
    }
    conn_unref(c);
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
    conn_send(p->c, &x, NULL, 0, NULL, 0);
    async_finish(cl, p);
}

int rpc_client_start(rpc_client *cl, uint16_t method, const void *msg, uint32_t len, const rpc_iov *parts,
                     int n_parts, uint32_t timeout_us, rpc_item_fn on_item, rpc_end_fn on_end, void *ctx,
                     uint32_t *call_id, ae_error *err) {
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
    conn *c = cl->cur;
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
    if (conn_sendv(c, &h, msg, len, parts, n_parts) != AE_OK) {
        /* The connection closed meanwhile: its close ends the call. */
    }
    conn_unref(c);
    return AE_OK;
}

void rpc_client_cancel(rpc_client *cl, uint32_t call_id) {
    pthread_mutex_lock(&cl->mu);
    conn *c = NULL;
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
    conn_send(c, &x, NULL, 0, NULL, 0);
    conn_unref(c);
}
