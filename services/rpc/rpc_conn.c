/* Addresses, TLS, and the connections both sides share. */
#include "rpc_conn.h"

int rpc_addr_parse(const char *text, rpc_addr *a, ae_error *err) {
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
    if (xdg && xdg[0] == '/')
        n = snprintf(dir, sizeof dir, "%s/aerie", xdg);
    else if (getuid() == 0)
        n = snprintf(dir, sizeof dir, "/run/aerie");
    else
        n = snprintf(dir, sizeof dir, "/tmp/aerie-%u", (unsigned)getuid());
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
    if (n < 0 || (size_t)n >= cap || (size_t)n - 5 >= sizeof((struct sockaddr_un *)0)->sun_path)
        return err_set(err, "socket path %s/%s is too long", dir, name);
    return AE_OK;
}

static void ssl_error_text(char *buf, size_t cap) {
    unsigned long e = ERR_get_error();
    if (e)
        ERR_error_string_n(e, buf, cap);
    else
        snprintf(buf, cap, "unknown TLS error");
    ERR_clear_error();
}

SSL_CTX *rpc_tls_ctx(const rpc_tls *t, bool server, ae_error *err) {
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
    if (t->key &&
        (SSL_CTX_use_PrivateKey_file(ctx, t->key, SSL_FILETYPE_PEM) != 1 || SSL_CTX_check_private_key(ctx) != 1)) {
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
        SSL_CTX_set_verify(ctx, server ? SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT : SSL_VERIFY_PEER, NULL);
    }
    return ctx;
fail:
    SSL_CTX_free(ctx);
    return NULL;
}

/* ---- connections (both sides) ---- */

void rpc_conn_unref(rpc_conn *c) {
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
int rpc_conn_sendv(rpc_conn *c, const frame_header *h, const void *msg, uint32_t len, const rpc_iov *parts,
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
        rpc_conn_unref(c);
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
         * rpc_conn_on_write resumes once it has read half of them. */
        c->read_paused = true;
        bufferevent_disable(c->bev, EV_READ);
    }
    bufferevent_unlock(c->bev);
    rpc_conn_unref(c);
    return rc == 0 ? AE_OK : AE_ERR;
}

int rpc_conn_send(rpc_conn *c, const frame_header *h, const void *msg, uint32_t len, const void *payload,
                  uint32_t plen) {
    rpc_iov part = {payload, plen};
    return rpc_conn_sendv(c, h, msg, len, &part, 1);
}

void rpc_send_error(rpc_conn *c, uint8_t kind, uint32_t call_id, uint32_t status, const char *text) {
    frame_header h = {FRAME_VERSION, kind, 0, call_id, status, 0, (uint32_t)strnlen(text, FRAME_MAX_ERROR), 0};
    rpc_conn_send(c, &h, text, h.msg_len, NULL, 0);
}

/* Closes a connection (loop thread): its calls are cancelled and the
 * socket shut; memory goes when the last open call is finished. */
void rpc_conn_close(rpc_conn *c) {
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
    if (c->srv) rpc_server_conn_closed(c);
    if (c->cli) rpc_client_conn_closed(c);
    rpc_conn_unref(c);
}

/* Sends what is queued, then closes: for an error the peer should read. */
void rpc_conn_close_after_flush(rpc_conn *c) {
    c->close_after_flush = true;
    bufferevent_disable(c->bev, EV_READ);
    if (evbuffer_get_length(bufferevent_get_output(c->bev)) == 0) rpc_conn_close(c);
}

void rpc_conn_on_write(struct bufferevent *bev, void *arg) {
    rpc_conn *c = arg;
    size_t queued = evbuffer_get_length(bufferevent_get_output(bev));
    if (c->close_after_flush && queued == 0) {
        rpc_conn_close(c);
        return;
    }
    if (c->read_paused && queued <= RPC_OUT_PAUSE_BYTES / 2 && !c->closed && !c->close_after_flush && !c->reads_off) {
        c->read_paused = false;
        bufferevent_enable(bev, EV_READ);
        /* Frames that came before the pause wait in the input buffer. */
        if (evbuffer_get_length(bufferevent_get_input(bev))) rpc_conn_on_read(bev, c);
    }
}

/* Makes rx hold the first `upto` bytes of the body (after the pad that
 * aligns the payload), keeping what was read. A header alone reserves at
 * most RPC_RX_STEP: the rest grows as bytes arrive, so a peer that only
 * claims a large frame ties up little memory. */
bool rpc_conn_rx_reserve(rpc_conn *c, size_t upto) {
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
int rpc_conn_read_body(rpc_conn *c, evutil_socket_t fd, size_t need) {
    while (c->body_got < need) {
        size_t room = c->rx_cap - c->pad - c->body_got;
        if (room == 0) {
            if (!rpc_conn_rx_reserve(c, c->body_got + RPC_RX_STEP < need ? c->body_got + RPC_RX_STEP : need)) return -1;
            room = c->rx_cap - c->pad - c->body_got;
        }
        size_t want = need - c->body_got < room ? need - c->body_got : room;
        ssize_t k = recv(fd, c->rx + c->pad + c->body_got, want, MSG_DONTWAIT);
        if (k > 0)
            c->body_got += (size_t)k;
        else if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
            return -1;
        else if (errno != EINTR)
            return 0;
    }
    return 1;
}

/* Reads frames while whole ones are there. libevent reads a socket 4 KiB
 * per wakeup, so on a plain socket the rest of a large body is read here
 * directly, in as few calls as the kernel allows. */
void rpc_conn_on_read(struct bufferevent *bev, void *arg) {
    rpc_conn *c = arg;
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
                    rpc_send_error(c, FRAME_REPLY, c->hdr.call_id, status, why.msg);
                    rpc_conn_close_after_flush(c);
                } else {
                    rpc_conn_close(c); /* a server's bad frame: its calls end UNAVAILABLE */
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
        if (!rpc_conn_rx_reserve(c, ahead < need ? ahead : need)) {
            LOG_ERRORF("rpc_out_of_memory conn=%llu frame_bytes=%zu", (unsigned long long)c->id, need);
            rpc_conn_close(c);
            break;
        }
        uint8_t *body = c->rx + c->pad;
        if (take) evbuffer_remove(in, body + c->body_got, take);
        c->body_got += take;
        bool hung_up = c->body_got < need && c->direct && rpc_conn_read_body(c, bufferevent_getfd(bev), need) < 0;
        if (hung_up) {
            rpc_conn_close(c);
            break;
        }
        if (c->body_got < need) break;
        c->have_hdr = false;
        body = c->rx + c->pad; /* read_body may have moved rx */
        if (c->srv)
            rpc_server_frame(c, body, body + c->hdr.msg_len);
        else
            rpc_client_frame(c, body, body + c->hdr.msg_len);
    }
    rpc_conn_unref(c);
}

void rpc_tune_bev(struct bufferevent *bev, bool tcp) {
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

/* Unix sockets: the peer must run as this user or as root; another local
 * user must not be able to talk to (or pose as) a service. */
bool rpc_peer_uid_ok(evutil_socket_t fd, unsigned *peer_uid) {
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return false;
    *peer_uid = (unsigned)cred.uid;
    return cred.uid == getuid() || cred.uid == 0;
}

struct timespec rpc_abs_after_ns(int64_t ns) {
    int64_t t = clock_mono_ns() + ns;
    return (struct timespec){t / 1000000000, t % 1000000000};
}

/* Any connection's end: the peer hung up, or an error (TLS's is logged). */
void rpc_conn_on_event(struct bufferevent *bev, short what, void *arg) {
    (void)bev;
    rpc_conn *c = arg;
    if (what & (BEV_EVENT_EOF | BEV_EVENT_ERROR | BEV_EVENT_TIMEOUT)) {
        if (what & BEV_EVENT_ERROR) {
            unsigned long e = bufferevent_get_openssl_error(c->bev);
            if (e) {
                char why[256];
                ERR_error_string_n(e, why, sizeof why);
                LOG_WARNF("rpc_tls_error conn=%llu reason=\"%s\"", (unsigned long long)c->id, why);
            }
        }
        rpc_conn_close(c);
    }
}
