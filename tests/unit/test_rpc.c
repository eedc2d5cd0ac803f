/* The RPC link end to end on loopback: unary calls and streams over Unix
 * and TCP sockets, many callers at once, deadlines and cancellation,
 * untrusted frames (another version, oversized, garbage) refused while the
 * server keeps serving, a client that reconnects after its server
 * comes back, silent and non-reading peers (closed, paused, dropped), Unix
 * peers of another user (as uid 65534 when run as root), and a server
 * close that waits for its handlers. TLS is covered by the integration
 * tests, which make their own certificates. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "../../services/rpc/rpc.h"

enum { M_ECHO = 1, M_STREAM = 2, M_HANG = 3, M_SLOW_CANCEL = 4, M_FLOOD = 5 };

typedef struct server_state {
    pthread_mutex_t mu;
    int cancelled_seen; /* M_HANG calls that saw their cancellation */
    int closes;
    int slow_finished; /* M_SLOW_CANCEL calls finished */
    int flood_items;   /* items an M_FLOOD call got out before the link failed */
} server_state;

static server_state S = {PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, -1};

static void *stream_worker(void *arg) {
    rpc_call *k = arg;
    uint32_t n = rpc_call_request(k)->msg_len ? rpc_call_request(k)->msg[0] : 0;
    for (uint32_t i = 0; i < n; i++) {
        uint8_t item[2] = {(uint8_t)i, 0xAB};
        if (rpc_call_item(k, item, 2, NULL) != AE_OK) break;
    }
    rpc_call_finish(k, RPC_OK, "done", 4, NULL, 0);
    return NULL;
}

static void *hang_worker(void *arg) {
    rpc_call *k = arg;
    while (!rpc_call_cancelled(k)) usleep(1000);
    pthread_mutex_lock(&S.mu);
    S.cancelled_seen++;
    pthread_mutex_unlock(&S.mu);
    rpc_call_fail(k, RPC_CANCELLED, "cancelled");
    return NULL;
}

/* Takes its time over the cancellation, as a scheduler between steps does. */
static void *slow_cancel_worker(void *arg) {
    rpc_call *k = arg;
    while (!rpc_call_cancelled(k)) usleep(1000);
    usleep(100000);
    pthread_mutex_lock(&S.mu);
    S.slow_finished++;
    pthread_mutex_unlock(&S.mu);
    rpc_call_fail(k, RPC_CANCELLED, "cancelled");
    return NULL;
}

/* Streams 64 KiB items (at most FLOOD_ITEMS) until the link refuses one. */
#define FLOOD_ITEMS 1024
static void *flood_worker(void *arg) {
    rpc_call *k = arg;
    static uint8_t item[64 << 10];
    int i = 0;
    while (i < FLOOD_ITEMS && rpc_call_item(k, item, sizeof item, NULL) == AE_OK) i++;
    pthread_mutex_lock(&S.mu);
    S.flood_items = i;
    pthread_mutex_unlock(&S.mu);
    rpc_call_finish(k, RPC_OK, NULL, 0, NULL, 0);
    return NULL;
}

static void spawn(void *(*fn)(void *), rpc_call *k) {
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, fn, k), 0);
    pthread_detach(t);
}

/* M_ECHO replies at once, on the loop thread: the message reversed and
 * the payload doubled byte by byte. */
static void handler(void *ctx, rpc_call *k, const rpc_request *req) {
    (void)ctx;
    if (req->method == M_ECHO) {
        uint8_t msg[64], *pay = malloc(req->payload_len + 1);
        uint32_t n = req->msg_len < sizeof msg ? req->msg_len : sizeof msg;
        for (uint32_t i = 0; i < n; i++) msg[i] = req->msg[n - 1 - i];
        for (uint32_t i = 0; i < req->payload_len; i++) pay[i] = (uint8_t)(req->payload[i] * 2);
        rpc_call_finish(k, RPC_OK, msg, n, pay, req->payload_len);
        free(pay);
    } else if (req->method == M_STREAM) {
        spawn(stream_worker, k);
    } else if (req->method == M_HANG) {
        spawn(hang_worker, k);
    } else if (req->method == M_SLOW_CANCEL) {
        spawn(slow_cancel_worker, k);
    } else if (req->method == M_FLOOD) {
        spawn(flood_worker, k);
    } else {
        rpc_call_fail(k, RPC_UNIMPLEMENTED, "no method %u", req->method);
    }
}

static void on_close(void *ctx, uint64_t conn_id) {
    (void)ctx, (void)conn_id;
    pthread_mutex_lock(&S.mu);
    S.closes++;
    pthread_mutex_unlock(&S.mu);
}

typedef struct fixture {
    rpc_loop *loop;
    rpc_server *srv;
    rpc_client *cli;
    char addr[128];
} fixture;

static void open_server(fixture *f, const char *addr) {
    ae_error err = {{0}};
    rpc_server_config sc = {.addr = addr, .max_frame = 1 << 20, .handler = handler, .on_close = on_close};
    if (rpc_server_open(&f->srv, f->loop, &sc, &err) != AE_OK) fail_msg("%s", err.msg);
}

static void open_client(fixture *f, const char *addr) {
    ae_error err = {{0}};
    rpc_client_config cc = {.addr = addr, .max_frame = 1 << 20};
    if (rpc_client_open(&f->cli, f->loop, &cc, &err) != AE_OK) fail_msg("%s", err.msg);
    assert_true(rpc_client_wait_connected(f->cli, 5000));
}

static int setup_unix(void **state) {
    fixture *f = calloc(1, sizeof *f);
    snprintf(f->addr, sizeof f->addr, "unix:build/test-rpc-%d.sock", (int)getpid());
    ae_error err = {{0}};
    if (rpc_loop_start(&f->loop, &err) != AE_OK) fail_msg("%s", err.msg);
    open_server(f, f->addr);
    open_client(f, f->addr);
    *state = f;
    return 0;
}

static int setup_tcp(void **state) {
    fixture *f = calloc(1, sizeof *f);
    ae_error err = {{0}};
    if (rpc_loop_start(&f->loop, &err) != AE_OK) fail_msg("%s", err.msg);
    open_server(f, "127.0.0.1:0");
    snprintf(f->addr, sizeof f->addr, "127.0.0.1:%d", rpc_server_port(f->srv));
    open_client(f, f->addr);
    *state = f;
    return 0;
}

static int teardown(void **state) {
    fixture *f = *state;
    rpc_client_close(f->cli);
    rpc_server_close(f->srv);
    rpc_loop_free(f->loop);
    free(f);
    return 0;
}

static void echo_roundtrip(fixture *f, uint32_t payload_len) {
    uint8_t *pay = malloc(payload_len + 1);
    for (uint32_t i = 0; i < payload_len; i++) pay[i] = (uint8_t)(i * 7);
    rpc_reply r = {0};
    assert_int_equal(rpc_client_call(f->cli, M_ECHO, "abc", 3, pay, payload_len, 0, NULL, NULL, &r), RPC_OK);
    assert_int_equal(r.msg_len, 3);
    assert_memory_equal(r.msg, "cba", 3);
    assert_int_equal(r.payload_len, payload_len);
    for (uint32_t i = 0; i < payload_len; i++) assert_int_equal(r.payload[i], (uint8_t)(i * 14));
    assert_int_equal((uintptr_t)r.payload % 16, 0);
    rpc_reply_free(&r);
    free(pay);
}

static void test_unary_call_carries_message_and_payload(void **state) {
    fixture *f = *state;
    echo_roundtrip(f, 0);
    echo_roundtrip(f, 5);
    echo_roundtrip(f, 450000); /* a Propose's worth of features */
}

static void test_unknown_method_is_an_error_and_the_link_stays(void **state) {
    fixture *f = *state;
    rpc_reply r = {0};
    assert_int_equal(rpc_client_call(f->cli, 99, NULL, 0, NULL, 0, 0, NULL, NULL, &r), RPC_UNIMPLEMENTED);
    assert_string_equal(r.error, "no method 99");
    rpc_reply_free(&r);
    echo_roundtrip(f, 16);
}

typedef struct items {
    int n;
    uint8_t first[16];
} items;

static bool collect(void *ctx, const uint8_t *msg, uint32_t len) {
    items *it = ctx;
    assert_int_equal(len, 2);
    assert_int_equal(msg[1], 0xAB);
    if (it->n < 16) it->first[it->n] = msg[0];
    it->n++;
    return true;
}

static void test_stream_delivers_items_in_order_then_end(void **state) {
    fixture *f = *state;
    uint8_t n = 12;
    items it = {0};
    rpc_reply r = {0};
    assert_int_equal(rpc_client_call(f->cli, M_STREAM, &n, 1, NULL, 0, 0, collect, &it, &r), RPC_OK);
    assert_int_equal(it.n, 12);
    for (int i = 0; i < 12; i++) assert_int_equal(it.first[i], i);
    assert_int_equal(r.msg_len, 4);
    assert_memory_equal(r.msg, "done", 4);
    rpc_reply_free(&r);
}

static void test_deadline_ends_the_call_and_cancels_it_at_the_server(void **state) {
    fixture *f = *state;
    pthread_mutex_lock(&S.mu);
    int before = S.cancelled_seen;
    pthread_mutex_unlock(&S.mu);
    rpc_reply r = {0};
    assert_int_equal(rpc_client_call(f->cli, M_HANG, NULL, 0, NULL, 0, 20000, NULL, NULL, &r), RPC_DEADLINE_EXCEEDED);
    /* This client's wait, or the server's answer to the expired call. */
    assert_true(!strcmp(r.error, "no reply within the deadline of 20000 us") ||
                !strcmp(r.error, "deadline of 20000 us exceeded"));
    for (int i = 0; i < 2000; i++) {
        pthread_mutex_lock(&S.mu);
        int now = S.cancelled_seen;
        pthread_mutex_unlock(&S.mu);
        if (now == before + 1) break;
        usleep(1000);
    }
    pthread_mutex_lock(&S.mu);
    assert_int_equal(S.cancelled_seen, before + 1);
    pthread_mutex_unlock(&S.mu);
    rpc_reply_free(&r);
    echo_roundtrip(f, 8); /* the late CANCELLED reply is dropped, the link stays */
}

typedef struct caller {
    fixture *f;
    int ok;
} caller;

static void *call_many(void *arg) {
    caller *c = arg;
    rpc_reply r = {0};
    for (int i = 0; i < 200; i++) {
        uint8_t msg[4] = {(uint8_t)i, 1, 2, 3}, pay[64];
        memset(pay, i, sizeof pay);
        if (rpc_client_call(c->f->cli, M_ECHO, msg, 4, pay, sizeof pay, 0, NULL, NULL, &r) == RPC_OK &&
            r.msg_len == 4 && r.msg[3] == (uint8_t)i && r.payload_len == 64 && r.payload[63] == (uint8_t)(2 * i))
            c->ok++;
    }
    rpc_reply_free(&r);
    return NULL;
}

static void test_concurrent_callers_share_one_connection(void **state) {
    fixture *f = *state;
    pthread_t t[8];
    caller c[8];
    for (int i = 0; i < 8; i++) {
        c[i] = (caller){f, 0};
        pthread_create(&t[i], NULL, call_many, &c[i]);
    }
    for (int i = 0; i < 8; i++) pthread_join(t[i], NULL);
    for (int i = 0; i < 8; i++) assert_int_equal(c[i].ok, 200);
    assert_int_equal(rpc_server_conns(f->srv), 1);
    assert_int_equal(rpc_client_connects(f->cli), 1);
}

/* A raw connection for frames the client library would never send. */
static int raw_connect(const fixture *f) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un un = {.sun_family = AF_UNIX};
    snprintf(un.sun_path, sizeof un.sun_path, "%s", f->addr + 5);
    assert_int_equal(connect(fd, (struct sockaddr *)&un, sizeof un), 0);
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

/* Reads until EOF; returns the bytes read. */
static size_t read_all(int fd, uint8_t *buf, size_t cap) {
    size_t n = 0;
    for (ssize_t k; n < cap && (k = read(fd, buf + n, cap - n)) > 0;) n += (size_t)k;
    return n;
}

static void refused_with(const fixture *f, const uint8_t *frame, size_t len, uint32_t status, const char *text) {
    int fd = raw_connect(f);
    assert_int_equal(write(fd, frame, len), (ssize_t)len);
    uint8_t buf[2048];
    size_t n = read_all(fd, buf, sizeof buf);
    close(fd);
    if (!text) {
        assert_int_equal(n, 0);
        return;
    }
    assert_true(n >= FRAME_HEADER);
    frame_header h;
    assert_int_equal(frame_decode_header(buf, 1 << 20, &h, NULL), FRAME_OK);
    assert_int_equal(h.kind, FRAME_REPLY);
    assert_int_equal(h.status, status);
    assert_int_equal(n, FRAME_HEADER + h.msg_len); /* then the server closed */
    assert_int_equal(h.msg_len, strlen(text));
    assert_memory_equal(buf + FRAME_HEADER, text, h.msg_len);
}

static void test_untrusted_frames_close_only_their_connection(void **state) {
    fixture *f = *state;
    uint8_t fr[FRAME_HEADER];
    frame_header h = {FRAME_VERSION + 1, FRAME_REQUEST, M_ECHO, 7, 0, 0, 0, 0};
    frame_encode_header(&h, fr);
    fr[4] = FRAME_VERSION + 1;
    refused_with(f, fr, sizeof fr, RPC_FAILED_PRECONDITION,
                 "the peer speaks contract version 4, this service speaks version 3");
    h = (frame_header){FRAME_VERSION, FRAME_REQUEST, M_ECHO, 8, 0, 0, 1 << 19, (1 << 19) + 1};
    frame_encode_header(&h, fr);
    refused_with(f, fr, sizeof fr, RPC_RESOURCE_EXHAUSTED, "frame of 1048577 bytes is over the limit of 1048576 bytes");
    /* A frame only a server sends: refused, and closing that connection
     * inside its own read callback must not touch freed memory. */
    h = (frame_header){FRAME_VERSION, FRAME_ITEM, M_ECHO, 11, 0, 0, 0, 0};
    frame_encode_header(&h, fr);
    refused_with(f, fr, sizeof fr, RPC_INVALID_ARGUMENT, "a client may send requests, cancels and pings only");
    uint8_t junk[40];
    memset(junk, 'x', sizeof junk);
    refused_with(f, junk, sizeof junk, 0, NULL);
    h = (frame_header){FRAME_VERSION, 9, M_ECHO, 9, 0, 0, 0, 0};
    frame_encode_header(&h, fr);
    refused_with(f, fr, sizeof fr, 0, NULL);
    /* A truncated frame: the peer hangs up halfway; nothing is dispatched. */
    int fd = raw_connect(f);
    h = (frame_header){FRAME_VERSION, FRAME_REQUEST, M_ECHO, 10, 0, 0, 100, 0};
    frame_encode_header(&h, fr);
    assert_int_equal(write(fd, fr, sizeof fr), (ssize_t)sizeof fr);
    assert_int_equal(write(fd, "abc", 3), 3);
    close(fd);
    echo_roundtrip(f, 100);
    assert_int_equal(rpc_client_connects(f->cli), 1);
}

static void test_client_reconnects_when_the_server_comes_back(void **state) {
    fixture *f = *state;
    rpc_server_close(f->srv);
    f->srv = NULL;
    for (int i = 0; i < 500 && rpc_client_connected(f->cli); i++) usleep(2000);
    assert_false(rpc_client_connected(f->cli));
    rpc_reply r = {0};
    assert_int_equal(rpc_client_call(f->cli, M_ECHO, "x", 1, NULL, 0, 0, NULL, NULL, &r), RPC_UNAVAILABLE);
    rpc_reply_free(&r);
    open_server(f, f->addr);
    assert_true(rpc_client_wait_connected(f->cli, 10000));
    assert_int_equal(rpc_client_connects(f->cli), 2);
    echo_roundtrip(f, 32);
}

/* ---- calls that do not wait (rpc_client_start) ---- */

typedef struct ended {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int ends, items;
    uint32_t status;
    char text[128];
    uint8_t msg[16];
    uint32_t msg_len;
} ended;

static bool count_item(void *ctx, const uint8_t *msg, uint32_t len) {
    (void)msg, (void)len;
    ended *e = ctx;
    e->items++; /* under the client's lock, on the loop thread */
    return true;
}

static void on_end(void *ctx, const rpc_reply *r) {
    ended *e = ctx;
    pthread_mutex_lock(&e->mu);
    e->ends++;
    e->status = r->status;
    snprintf(e->text, sizeof e->text, "%.127s", r->error);
    e->msg_len = r->msg_len < sizeof e->msg ? r->msg_len : sizeof e->msg;
    if (e->msg_len) memcpy(e->msg, r->msg, e->msg_len);
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

static void wait_end(ended *e) {
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < 500 && e->ends == 0; i++) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += 10000000;
        if (until.tv_nsec >= 1000000000) until.tv_sec++, until.tv_nsec -= 1000000000;
        pthread_cond_timedwait(&e->cv, &e->mu, &until);
    }
    pthread_mutex_unlock(&e->mu);
    usleep(20000); /* a second on_end would come now */
    assert_int_equal(e->ends, 1);
}

static void test_started_calls_end_once_with_their_outcome(void **state) {
    fixture *f = *state;
    ae_error err = {{0}};
    ended a = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, "", {0}, 0};
    rpc_iov pay = {"xy", 2};
    assert_int_equal(rpc_client_start(f->cli, M_ECHO, "abc", 3, &pay, 1, 0, NULL, on_end, &a, NULL, &err), AE_OK);
    wait_end(&a);
    assert_int_equal(a.status, RPC_OK);
    assert_int_equal(a.msg_len, 3);
    assert_memory_equal(a.msg, "cba", 3);

    ended b = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, "", {0}, 0};
    uint8_t n = 7;
    assert_int_equal(rpc_client_start(f->cli, M_STREAM, &n, 1, NULL, 0, 0, count_item, on_end, &b, NULL, &err), AE_OK);
    wait_end(&b);
    assert_int_equal(b.status, RPC_OK);
    assert_int_equal(b.items, 7);

    /* A deadline ends it and cancels it at the server. */
    ended c = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, "", {0}, 0};
    assert_int_equal(rpc_client_start(f->cli, M_HANG, NULL, 0, NULL, 0, 20000, NULL, on_end, &c, NULL, &err), AE_OK);
    wait_end(&c);
    /* Whichever side sees the deadline first says so: this client's timer,
     * or the server, which ends the expired call DEADLINE_EXCEEDED. */
    assert_int_equal(c.status, RPC_DEADLINE_EXCEEDED);
    assert_true(!strcmp(c.text, "no reply within the deadline") || !strcmp(c.text, "deadline of 20000 us exceeded"));

    /* Cancelled by the caller: the server's answer ends it. */
    ended d = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, "", {0}, 0};
    uint32_t id = 0;
    assert_int_equal(rpc_client_start(f->cli, M_HANG, NULL, 0, NULL, 0, 0, NULL, on_end, &d, &id, &err), AE_OK);
    assert_true(id != 0);
    usleep(20000);
    rpc_client_cancel(f->cli, id);
    wait_end(&d);
    assert_int_equal(d.status, RPC_CANCELLED);
    assert_string_equal(d.text, "cancelled");

    /* A lost connection ends what is open: UNAVAILABLE. */
    ended e = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, "", {0}, 0};
    assert_int_equal(rpc_client_start(f->cli, M_HANG, NULL, 0, NULL, 0, 0, NULL, on_end, &e, NULL, &err), AE_OK);
    usleep(20000);
    rpc_server_close(f->srv);
    f->srv = NULL;
    wait_end(&e);
    /* Whichever comes first: the handler's end, which the closing server
     * turns from CANCELLED into UNAVAILABLE, or the cut connection. */
    assert_int_equal(e.status, RPC_UNAVAILABLE);
    assert_true(!strcmp(e.text, "the server is shutting down") || !strcmp(e.text, "the connection was lost"));
    /* And nothing starts without a connection. */
    for (int i = 0; i < 500 && rpc_client_connected(f->cli); i++) usleep(2000);
    err_clear(&err);
    assert_int_equal(rpc_client_start(f->cli, M_ECHO, "a", 1, NULL, 0, 0, NULL, on_end, &e, NULL, &err), AE_ERR);
    assert_true(strstr(err.msg, "not connected") != NULL);
    open_server(f, f->addr); /* for teardown */
}

/* A peer that accepts but never answers (a hung process): the client's
 * pings go unanswered, it drops the connection and connects again. */
static void test_keepalive_drops_a_silent_peer(void **state) {
    (void)state;
    char path[64];
    snprintf(path, sizeof path, "build/test-rpc-silent-%d.sock", (int)getpid());
    unlink(path);
    int lfd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un un = {.sun_family = AF_UNIX};
    snprintf(un.sun_path, sizeof un.sun_path, "%s", path);
    assert_int_equal(bind(lfd, (struct sockaddr *)&un, sizeof un), 0);
    assert_int_equal(listen(lfd, 8), 0);
    rpc_loop *loop;
    rpc_client *cli;
    ae_error err = {{0}};
    assert_int_equal(rpc_loop_start(&loop, &err), AE_OK);
    char addr[160];
    snprintf(addr, sizeof addr, "unix:%s", path);
    rpc_client_config cc = {.addr = addr, .keepalive_ms = 100};
    if (rpc_client_open(&cli, loop, &cc, &err) != AE_OK) fail_msg("%s", err.msg);
    assert_true(rpc_client_wait_connected(cli, 5000));
    /* Accepted by the kernel's backlog and never read: pings go unanswered. */
    for (int i = 0; i < 300 && rpc_client_connects(cli) < 2; i++) usleep(10000);
    assert_true(rpc_client_connects(cli) >= 2);
    rpc_client_close(cli);
    rpc_loop_free(loop);
    close(lfd);
    unlink(path);
}

/* ---- what a server owes to its other clients ---- */

static int state_int(int *p) {
    pthread_mutex_lock(&S.mu);
    int v = *p;
    pthread_mutex_unlock(&S.mu);
    return v;
}

/* Polls for up to ms until the server has n connections; returns how
 * long that took (ms), or -1. */
static int wait_conns(rpc_server *s, int n, int ms) {
    for (int i = 0; i <= ms; i += 5) {
        if (rpc_server_conns(s) == n) return i;
        usleep(5000);
    }
    return -1;
}

static void open_limited(fixture *f, uint32_t handshake_ms, uint32_t idle_ms, uint32_t max_out) {
    ae_error err = {{0}};
    snprintf(f->addr, sizeof f->addr, "unix:build/test-rpc-lim-%d.sock", (int)getpid());
    if (rpc_loop_start(&f->loop, &err) != AE_OK) fail_msg("%s", err.msg);
    rpc_server_config sc = {.addr = f->addr,
                            .max_frame = 1 << 20,
                            .handler = handler,
                            .on_close = on_close,
                            .handshake_ms = handshake_ms,
                            .idle_ms = idle_ms,
                            .max_out_bytes = max_out};
    if (rpc_server_open(&f->srv, f->loop, &sc, &err) != AE_OK) fail_msg("%s", err.msg);
}

static void close_limited(fixture *f) {
    rpc_client_close(f->cli);
    rpc_server_close(f->srv);
    rpc_loop_free(f->loop);
}

static void send_frame(int fd, uint8_t kind, uint16_t method, uint32_t id, const void *msg, uint32_t len) {
    uint8_t fr[FRAME_HEADER];
    frame_header h = {FRAME_VERSION, kind, method, id, 0, 0, len, 0};
    frame_encode_header(&h, fr);
    assert_int_equal(write(fd, fr, sizeof fr), (ssize_t)sizeof fr);
    if (len) assert_int_equal(write(fd, msg, len), (ssize_t)len);
}

/* Connections that never send a frame are closed after the handshake
 * time, and a new client is served. */
static void test_silent_connections_are_closed_after_the_handshake_time(void **state) {
    (void)state;
    fixture f = {0};
    open_limited(&f, 200, 60000, 0);
    int fds[6];
    for (int i = 0; i < 6; i++) fds[i] = raw_connect(&f);
    assert_int_equal(wait_conns(f.srv, 6, 1000) >= 0, 1);
    usleep(100000);
    assert_int_equal(rpc_server_conns(f.srv), 6); /* not before its time */
    int took = wait_conns(f.srv, 0, 2000);
    printf("silent connections closed %d ms after the check began\n", took);
    assert_true(took >= 0);
    uint8_t b;
    for (int i = 0; i < 6; i++) {
        assert_int_equal(read(fds[i], &b, 1), 0); /* EOF: the server hung up */
        close(fds[i]);
    }
    open_client(&f, f.addr);
    echo_roundtrip(&f, 8);
    close_limited(&f);
}

/* After its first frame a connection may be silent for idle_ms, and
 * longer while a call is open on it. */
static void test_idle_connections_are_closed_but_open_calls_keep_them(void **state) {
    (void)state;
    fixture f = {0};
    open_limited(&f, 200, 400, 0);
    int quiet = raw_connect(&f), busy = raw_connect(&f);
    send_frame(quiet, FRAME_PING, 0, 0, NULL, 0);
    send_frame(busy, FRAME_REQUEST, M_HANG, 1, NULL, 0);
    uint8_t buf[FRAME_HEADER];
    assert_int_equal(read(quiet, buf, sizeof buf), FRAME_HEADER); /* the PONG */
    usleep(250000);                                               /* past the handshake time */
    assert_int_equal(rpc_server_conns(f.srv), 2);
    assert_true(wait_conns(f.srv, 1, 2000) >= 0); /* the quiet one */
    assert_int_equal(read(quiet, buf, 1), 0);
    usleep(800000); /* twice the idle time with its call open */
    assert_int_equal(rpc_server_conns(f.srv), 1);
    send_frame(busy, FRAME_CANCEL, 0, 1, NULL, 0);
    assert_true(read(busy, buf, sizeof buf) == FRAME_HEADER); /* the call's end */
    assert_true(wait_conns(f.srv, 0, 2000) >= 0);             /* then idle like any other */
    close(quiet);
    close(busy);
    close_limited(&f);
}

/* An idle client's first keepalive ping comes only after its keepalive
 * interval (5 s, like the server's handshake time): so a client says
 * something at once, and is not cut while it has nothing to ask. */
static void test_an_idle_client_is_not_cut_for_sending_no_first_frame(void **state) {
    (void)state;
    fixture f = {0};
    open_limited(&f, 300, 60000, 0);
    open_client(&f, f.addr);
    usleep(1000000); /* over three handshake times, with nothing to call */
    assert_int_equal(rpc_server_conns(f.srv), 1);
    assert_int_equal(rpc_client_connects(f.cli), 1);
    assert_true(rpc_client_connected(f.cli));
    close_limited(&f);
}

/* Silence counts from the end of the last call: a peer whose only traffic
 * was a call that ended on its own (here at its deadline) gets the whole
 * idle time after it, whatever the phase of the server's timer. */
static void test_idle_time_counts_from_the_end_of_the_last_call(void **state) {
    (void)state;
    fixture f = {0};
    open_limited(&f, 200, 1000, 0);
    int fd = raw_connect(&f);
    uint8_t fr[FRAME_HEADER];
    /* From the first frame the timer looks every 1000 ms while the call
     * is open (1000, 2000, ...); the call ends at its deadline, 2500 ms. */
    frame_header h = {FRAME_VERSION, FRAME_REQUEST, M_HANG, 1, 0, 2500000, 0, 0};
    frame_encode_header(&h, fr);
    assert_int_equal(write(fd, fr, sizeof fr), (ssize_t)sizeof fr);
    assert_int_equal(read(fd, fr, sizeof fr), FRAME_HEADER); /* the call's end */
    frame_header end;
    ae_error why = {{0}};
    assert_int_equal(frame_decode_header(fr, 1 << 20, &end, &why), FRAME_OK);
    assert_int_equal(end.status, RPC_DEADLINE_EXCEEDED);
    uint8_t text[FRAME_MAX_ERROR];
    if (end.msg_len) assert_int_equal(read(fd, text, end.msg_len), (ssize_t)end.msg_len);
    usleep(750000); /* the look at 3000 ms would see 1000 ms since the one at 2000 */
    assert_int_equal(rpc_server_conns(f.srv), 1);
    int took = wait_conns(f.srv, 0, 2000);
    printf("closed %d ms after 750 ms of silence since the call ended\n", took);
    assert_true(took >= 0);
    close(fd);
    close_limited(&f);
}

/* A peer that pipelines requests and never reads the replies: the server
 * stops reading from it rather than queueing replies without end. */
static void test_a_peer_that_does_not_read_is_paused_then_closed(void **state) {
    (void)state;
    fixture f = {0};
    open_limited(&f, 5000, 500, 0);
    int fd = raw_connect(&f);
    int fl = 1 << 16;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &fl, sizeof fl);
    static uint8_t req[FRAME_HEADER + (16 << 10)];
    frame_header h = {FRAME_VERSION, FRAME_REQUEST, M_ECHO, 0, 0, 0, 0, 16 << 10};
    size_t sent = 0, limit = (size_t)128 << 20;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (uint32_t id = 1; sent < limit; id++) {
        h.call_id = id;
        frame_encode_header(&h, req);
        size_t off = 0;
        while (off < sizeof req) {
            ssize_t k = send(fd, req + off, sizeof req - off, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (k > 0) {
                off += (size_t)k;
                continue;
            }
            clock_gettime(CLOCK_MONOTONIC, &t);
            if (t.tv_sec - t0.tv_sec >= 2) break;
            usleep(1000);
        }
        sent += off;
        if (off < sizeof req) break;
    }
    printf("the peer got %zu MiB of requests in before the server stopped reading\n", sent >> 20);
    assert_true(sent < (size_t)32 << 20);
    /* Silent since: closed by the idle rule, replies unread. */
    assert_true(wait_conns(f.srv, 0, 3000) >= 0);
    close(fd);
    open_client(&f, f.addr);
    echo_roundtrip(&f, 8);
    close_limited(&f);
}

/* A stream to a peer that does not read fails once max_out_bytes are
 * queued, and the connection is dropped. */
static void test_a_stream_to_a_peer_that_does_not_read_is_dropped(void **state) {
    (void)state;
    fixture f = {0};
    open_limited(&f, 5000, 60000, 1 << 20);
    pthread_mutex_lock(&S.mu);
    S.flood_items = -1;
    pthread_mutex_unlock(&S.mu);
    int fd = raw_connect(&f);
    send_frame(fd, FRAME_REQUEST, M_FLOOD, 1, NULL, 0);
    for (int i = 0; i < 500 && state_int(&S.flood_items) < 0; i++) usleep(10000);
    int got = state_int(&S.flood_items);
    printf("the stream got %d of %d items of 64 KiB out before the link refused\n", got, FLOOD_ITEMS);
    assert_true(got >= 0 && got < FLOOD_ITEMS / 4);
    assert_true(wait_conns(f.srv, 0, 2000) >= 0);
    close(fd);
    close_limited(&f);
}

/* rpc_server_close returns once the handlers have finished their calls:
 * the caller may then free what the handlers use. */
static void test_server_close_waits_for_handlers_to_finish(void **state) {
    fixture *f = *state;
    int before = state_int(&S.slow_finished);
    uint32_t id;
    ae_error err = {{0}};
    ended e = {0};
    pthread_mutex_init(&e.mu, NULL);
    pthread_cond_init(&e.cv, NULL);
    assert_int_equal(rpc_client_start(f->cli, M_SLOW_CANCEL, NULL, 0, NULL, 0, 0, NULL, on_end, &e, &id, &err), AE_OK);
    for (int i = 0; i < 200 && rpc_server_conns(f->srv) != 1; i++) usleep(1000);
    usleep(50000); /* the request is in the handler's hands */
    rpc_server_close(f->srv);
    f->srv = NULL;
    assert_int_equal(state_int(&S.slow_finished), before + 1);
    wait_end(&e);
    open_server(f, f->addr); /* for teardown */
}

/* ---- Unix sockets and other local users ---- */

#define NOBODY 65534

/* Runs fn in a child process as uid NOBODY; returns its exit code. */
static int as_nobody(int (*fn)(const char *), const char *arg) {
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (setgid(NOBODY) != 0 || setuid(NOBODY) != 0) _exit(9);
        _exit(fn(arg));
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 100;
}

/* 0: the server hung up without a PONG; 1: it answered; 2: no connection. */
static int ping_once(const char *path) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un un = {.sun_family = AF_UNIX};
    snprintf(un.sun_path, sizeof un.sun_path, "%s", path);
    if (connect(fd, (struct sockaddr *)&un, sizeof un) != 0) return 2;
    struct timeval tv = {3, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    uint8_t fr[FRAME_HEADER];
    frame_header h = {FRAME_VERSION, FRAME_PING, 0, 0, 0, 0, 0, 0};
    frame_encode_header(&h, fr);
    if (send(fd, fr, sizeof fr, MSG_NOSIGNAL) != (ssize_t)sizeof fr) return 0; /* already shut */
    ssize_t k = read(fd, fr, sizeof fr);
    close(fd);
    return k > 0 ? 1 : 0;
}

static void test_a_server_refuses_a_peer_of_another_user(void **state) {
    fixture *f = *state;
    if (getuid() != 0) skip(); /* needs root to become another user */
    const char *path = f->addr + 5;
    assert_int_equal(chmod(path, 0777), 0); /* so that only the peer check stands in the way */
    assert_int_equal(as_nobody(ping_once, path), 0);
    assert_int_equal(ping_once(path), 1); /* root may */
    echo_roundtrip(f, 8);
}

/* Listens as another user at path for 2 s, accepting what comes. */
static int listen_briefly(const char *path) {
    int lfd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un un = {.sun_family = AF_UNIX};
    snprintf(un.sun_path, sizeof un.sun_path, "%s", path);
    if (bind(lfd, (struct sockaddr *)&un, sizeof un) != 0 || listen(lfd, 8) != 0) return 2;
    usleep(2000000);
    return 0;
}

static void test_a_client_refuses_a_socket_of_another_user(void **state) {
    (void)state;
    if (getuid() != 0) skip();
    char dir[] = "/tmp/aerie-test-rpc-XXXXXX", path[96], addr[128];
    assert_non_null(mkdtemp(dir));
    assert_int_equal(chmod(dir, 0777), 0);
    snprintf(path, sizeof path, "%s/impostor.sock", dir);
    snprintf(addr, sizeof addr, "unix:%s", path);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (setgid(NOBODY) != 0 || setuid(NOBODY) != 0) _exit(9);
        _exit(listen_briefly(path));
    }
    struct stat st;
    for (int i = 0; i < 200 && stat(path, &st) != 0; i++) usleep(5000);
    rpc_loop *loop;
    rpc_client *cli;
    ae_error err = {{0}};
    assert_int_equal(rpc_loop_start(&loop, &err), AE_OK);
    rpc_client_config cc = {.addr = addr};
    if (rpc_client_open(&cli, loop, &cc, &err) != AE_OK) fail_msg("%s", err.msg);
    assert_false(rpc_client_wait_connected(cli, 500));
    assert_int_equal(rpc_client_connects(cli), 0);
    rpc_client_close(cli);
    rpc_loop_free(loop);
    int code = 0;
    assert_int_equal(waitpid(pid, &code, 0), pid);
    assert_int_equal(WEXITSTATUS(code), 0);
    unlink(path);
    rmdir(dir);
}

/* The default socket lives in a directory of this user that no one else
 * may enter, and a directory that is not private is refused. */
static void test_the_default_socket_is_in_a_private_directory(void **state) {
    (void)state;
    char cwd[256], xdg[320], want[400], got[400];
    assert_non_null(getcwd(cwd, sizeof cwd));
    snprintf(xdg, sizeof xdg, "%s/build/test-rpc-xdg-%d", cwd, (int)getpid());
    assert_int_equal(mkdir(xdg, 0700), 0);
    char *old = getenv("XDG_RUNTIME_DIR") ? strdup(getenv("XDG_RUNTIME_DIR")) : NULL;
    setenv("XDG_RUNTIME_DIR", xdg, 1);
    ae_error err = {{0}};
    char dir[340];
    snprintf(dir, sizeof dir, "%s/aerie", xdg);
    /* Without create a missing directory is fine (the gateway's view). */
    assert_int_equal(rpc_default_addr(got, sizeof got, "aerie-target.sock", false, &err), AE_OK);
    struct stat st;
    assert_int_equal(stat(dir, &st), -1);
    assert_int_equal(rpc_default_addr(got, sizeof got, "aerie-target.sock", true, &err), AE_OK);
    snprintf(want, sizeof want, "unix:%s/aerie-target.sock", dir);
    assert_string_equal(got, want);
    assert_int_equal(stat(dir, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0700);
    assert_int_equal(chmod(dir, 0755), 0);
    assert_int_equal(rpc_default_addr(got, sizeof got, "aerie-target.sock", false, &err), AE_ERR);
    char text[512];
    snprintf(text, sizeof text, "runtime directory %s is open to other users (mode 755, want 700)", dir);
    assert_string_equal(err.msg, text);
    if (getuid() == 0) {
        assert_int_equal(chmod(dir, 0700), 0);
        assert_int_equal(chown(dir, NOBODY, NOBODY), 0);
        err = (ae_error){{0}};
        assert_int_equal(rpc_default_addr(got, sizeof got, "aerie-target.sock", true, &err), AE_ERR);
        snprintf(text, sizeof text, "runtime directory %s belongs to uid 65534, not to this user (uid 0)", dir);
        assert_string_equal(err.msg, text);
    }
    rmdir(dir);
    rmdir(xdg);
    if (old)
        setenv("XDG_RUNTIME_DIR", old, 1);
    else
        unsetenv("XDG_RUNTIME_DIR");
    free(old);
}

/* Holds a loop's thread until released. */
typedef struct held {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool holding, release;
    rpc_loop *loop;
} held;

static void hold_job(void *arg) {
    held *h = arg;
    pthread_mutex_lock(&h->mu);
    h->holding = true;
    pthread_cond_broadcast(&h->cv);
    while (!h->release) pthread_cond_wait(&h->cv, &h->mu);
    pthread_mutex_unlock(&h->mu);
}

static void *hold_thread(void *arg) {
    held *h = arg;
    rpc_loop_run(h->loop, hold_job, h);
    return NULL;
}

/* On a plain socket the caller of a blocking call reads its own reply:
 * the client's loop thread takes no part, so a call ends OK while that
 * thread is held (a reply that had to pass through it would end the
 * call DEADLINE_EXCEEDED). The server runs on a loop of its own, as in
 * two processes. */
static void caller_reads_its_reply(const char *addr_or_null) {
    ae_error err = {{0}};
    fixture f = {0};
    rpc_loop *cloop = NULL;
    if (rpc_loop_start(&f.loop, &err) != AE_OK || rpc_loop_start(&cloop, &err) != AE_OK) fail_msg("%s", err.msg);
    if (addr_or_null) snprintf(f.addr, sizeof f.addr, "%s", addr_or_null);
    open_server(&f, addr_or_null ? f.addr : "127.0.0.1:0");
    if (!addr_or_null) snprintf(f.addr, sizeof f.addr, "127.0.0.1:%d", rpc_server_port(f.srv));
    rpc_client_config cc = {.addr = f.addr, .max_frame = 1 << 20};
    if (rpc_client_open(&f.cli, cloop, &cc, &err) != AE_OK) fail_msg("%s", err.msg);
    assert_true(rpc_client_wait_connected(f.cli, 5000));
    held h = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, false, false, cloop};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, hold_thread, &h), 0);
    pthread_mutex_lock(&h.mu);
    while (!h.holding) pthread_cond_wait(&h.cv, &h.mu);
    pthread_mutex_unlock(&h.mu);
    enum { N = 20000 }; /* a Propose of one sequence: fits the socket's buffer */
    static uint8_t pay[N];
    for (uint32_t i = 0; i < N; i++) pay[i] = (uint8_t)(i * 7);
    rpc_reply r = {0};
    for (int call = 0; call < 3; call++) {
        uint32_t st = rpc_client_call(f.cli, M_ECHO, "abc", 3, pay, N, 2000000, NULL, NULL, &r);
        if (st != RPC_OK) fail_msg("call %d: %s: %s", call, frame_status_name(st), r.error);
        assert_int_equal(r.msg_len, 3);
        assert_memory_equal(r.msg, "cba", 3);
        assert_int_equal(r.payload_len, N);
        for (uint32_t i = 0; i < N; i++) assert_int_equal(r.payload[i], (uint8_t)(i * 14));
    }
    pthread_mutex_lock(&h.mu);
    h.release = true;
    pthread_cond_broadcast(&h.cv);
    pthread_mutex_unlock(&h.mu);
    pthread_join(t, NULL);
    /* The loop goes on reading where the caller stopped. */
    echo_roundtrip(&f, 5);
    rpc_reply_free(&r);
    rpc_client_close(f.cli);
    rpc_server_close(f.srv);
    rpc_loop_free(cloop);
    rpc_loop_free(f.loop);
}

static void test_a_blocking_caller_reads_its_own_reply_over_unix(void **state) {
    (void)state;
    char addr[128];
    snprintf(addr, sizeof addr, "unix:build/test-rpc-own-%d.sock", (int)getpid());
    caller_reads_its_reply(addr);
}

static void test_a_blocking_caller_reads_its_own_reply_over_tcp(void **state) {
    (void)state;
    caller_reads_its_reply(NULL);
}

/* The voluntary context switches of thread tid so far: each one is a
 * time the thread slept and was woken. */
static long thread_sleeps(pid_t tid) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/self/task/%d/status", (int)tid);
    FILE *fp = fopen(path, "r");
    assert_non_null(fp);
    long n = -1;
    while (fgets(line, sizeof line, fp))
        if (sscanf(line, "voluntary_ctxt_switches: %ld", &n) == 1) break;
    fclose(fp);
    assert_true(n >= 0);
    return n;
}

static void tid_job(void *arg) { *(pid_t *)arg = (pid_t)gettid(); }

/* Blocking calls in a row on a Unix socket wake only the server's loop
 * and the caller: the client's loop thread sleeps through them (a
 * thread woken for nothing waits for a core on a busy host). With its
 * reads handed to the callers, the client still takes started calls and
 * streams, which the loop reads, and still sees its server go at once.
 * (On TCP the loop keeps reading too: rpc_client.c, reads_hand_over.) */
static void test_blocking_calls_leave_the_client_loop_asleep(void **state) {
    (void)state;
    ae_error err = {{0}};
    fixture f = {0};
    rpc_loop *cloop = NULL;
    if (rpc_loop_start(&f.loop, &err) != AE_OK || rpc_loop_start(&cloop, &err) != AE_OK) fail_msg("%s", err.msg);
    snprintf(f.addr, sizeof f.addr, "unix:build/test-rpc-asleep-%d.sock", (int)getpid());
    open_server(&f, f.addr);
    /* No keepalive ping within the test: its timer would wake the loop. */
    rpc_client_config cc = {.addr = f.addr, .max_frame = 1 << 20, .keepalive_ms = 600000};
    if (rpc_client_open(&f.cli, cloop, &cc, &err) != AE_OK) fail_msg("%s", err.msg);
    assert_true(rpc_client_wait_connected(f.cli, 5000));
    pid_t loop_tid = 0;
    rpc_loop_run(cloop, tid_job, &loop_tid);
    enum { N = 20000, CALLS = 50 };
    static uint8_t pay[N];
    for (uint32_t i = 0; i < N; i++) pay[i] = (uint8_t)(i * 7);
    rpc_reply r = {0};
    for (int call = -2; call < CALLS; call++) {
        static long before;
        if (call == 0) before = thread_sleeps(loop_tid); /* after two calls: the first may hand the reads over */
        uint32_t st = rpc_client_call(f.cli, M_ECHO, "abc", 3, pay, N, 0, NULL, NULL, &r);
        if (st != RPC_OK) fail_msg("call %d: %s: %s", call, frame_status_name(st), r.error);
        assert_int_equal(r.payload_len, N);
        assert_int_equal(r.payload[N - 1], (uint8_t)((N - 1) * 14));
        if (call == CALLS - 1) {
            long woken = thread_sleeps(loop_tid) - before;
            if (woken != 0) fail_msg("the client's loop thread was woken %ld times in %d calls", woken, CALLS);
        }
    }
    rpc_reply_free(&r);
    /* The loop reads again for what only it may take. */
    ended a = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, "", {0}, 0};
    rpc_iov two = {"xy", 2};
    assert_int_equal(rpc_client_start(f.cli, M_ECHO, "abc", 3, &two, 1, 0, NULL, on_end, &a, NULL, &err), AE_OK);
    wait_end(&a);
    assert_int_equal(a.status, RPC_OK);
    assert_memory_equal(a.msg, "cba", 3);
    echo_roundtrip(&f, 5);
    uint8_t n = 9;
    items it = {0};
    assert_int_equal(rpc_client_call(f.cli, M_STREAM, &n, 1, NULL, 0, 0, collect, &it, &r), RPC_OK);
    assert_int_equal(it.n, 9);
    rpc_reply_free(&r);
    /* A server that goes is seen at once, not at the next ping. */
    echo_roundtrip(&f, 5);
    echo_roundtrip(&f, 5);
    rpc_server_close(f.srv);
    for (int i = 0; i < 500 && rpc_client_connected(f.cli); i++) usleep(2000);
    assert_false(rpc_client_connected(f.cli));
    rpc_client_close(f.cli);
    rpc_loop_free(cloop);
    rpc_loop_free(f.loop);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_unary_call_carries_message_and_payload, setup_unix, teardown),
        cmocka_unit_test_setup_teardown(test_unary_call_carries_message_and_payload, setup_tcp, teardown),
        cmocka_unit_test(test_a_blocking_caller_reads_its_own_reply_over_unix),
        cmocka_unit_test(test_a_blocking_caller_reads_its_own_reply_over_tcp),
        cmocka_unit_test(test_blocking_calls_leave_the_client_loop_asleep),
        cmocka_unit_test_setup_teardown(test_unknown_method_is_an_error_and_the_link_stays, setup_unix, teardown),
        cmocka_unit_test_setup_teardown(test_stream_delivers_items_in_order_then_end, setup_tcp, teardown),
        cmocka_unit_test_setup_teardown(test_deadline_ends_the_call_and_cancels_it_at_the_server, setup_unix, teardown),
        cmocka_unit_test_setup_teardown(test_concurrent_callers_share_one_connection, setup_unix, teardown),
        cmocka_unit_test_setup_teardown(test_untrusted_frames_close_only_their_connection, setup_unix, teardown),
        cmocka_unit_test_setup_teardown(test_client_reconnects_when_the_server_comes_back, setup_unix, teardown),
        cmocka_unit_test(test_keepalive_drops_a_silent_peer),
        cmocka_unit_test(test_silent_connections_are_closed_after_the_handshake_time),
        cmocka_unit_test(test_idle_connections_are_closed_but_open_calls_keep_them),
        cmocka_unit_test(test_an_idle_client_is_not_cut_for_sending_no_first_frame),
        cmocka_unit_test(test_idle_time_counts_from_the_end_of_the_last_call),
        cmocka_unit_test(test_a_peer_that_does_not_read_is_paused_then_closed),
        cmocka_unit_test(test_a_stream_to_a_peer_that_does_not_read_is_dropped),
        cmocka_unit_test_setup_teardown(test_server_close_waits_for_handlers_to_finish, setup_unix, teardown),
        cmocka_unit_test_setup_teardown(test_a_server_refuses_a_peer_of_another_user, setup_unix, teardown),
        cmocka_unit_test(test_a_client_refuses_a_socket_of_another_user),
        cmocka_unit_test(test_the_default_socket_is_in_a_private_directory),
        cmocka_unit_test_setup_teardown(test_started_calls_end_once_with_their_outcome, setup_unix, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
