/* The gateway's HTTP/1.1 server: the head parser on exact inputs (each
 * malformed case with the status it earns), then the server end to end on
 * a loopback socket: whole and streamed replies byte for byte, keep-alive
 * and pipelining, the errors it answers itself (400, 411, 413, 429) with
 * the caller's body, 100-continue, a client that hangs up while its
 * request is with the handler, a reader too slow for its stream, the
 * server closed under owned requests, and the idle timeout.
 *
 * The event loop runs on its own thread; the test thread is the client,
 * with blocking sockets (5 s receive timeout), and runs code on the loop
 * thread through loop_run. */
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <event2/event.h>
#include <event2/thread.h>
#include <netinet/in.h>

#include <cmocka.h>

#include "../../gateway/http.h"

/* ---- the parser ---- */

typedef struct parsed {
    char buf[4096];
    http_head h;
    const char *why;
    int rc;
} parsed;

static parsed P;

/* Parses text[0..len) (len 0: strlen) with a head limit of max_head. */
static int parse_n(const char *text, size_t len, size_t max_head) {
    if (!len) len = strlen(text);
    assert_true(len <= sizeof P.buf);
    memcpy(P.buf, text, len);
    P.why = NULL;
    P.rc = http_parse_head(P.buf, len, max_head, &P.h, &P.why);
    return P.rc;
}

static int parse(const char *text) { return parse_n(text, 0, 4096); }

static void test_parse_splits_target_into_path_and_query(void **state) {
    (void)state;
    const char *req = "GET /v1/models?limit=2&x=y HTTP/1.1\r\nHost: a.example\r\n\r\n";
    assert_int_equal(parse(req), (int)strlen(req));
    assert_string_equal(P.h.method, "GET");
    assert_string_equal(P.h.target, "/v1/models?limit=2&x=y");
    assert_string_equal(P.h.path, "/v1/models");
    assert_int_equal(P.h.minor, 1);
    assert_int_equal(P.h.n_headers, 1);
    assert_string_equal(P.h.headers[0].name, "Host");
    assert_string_equal(P.h.headers[0].value, "a.example");
    assert_int_equal(P.h.content_length, -1);
    assert_true(P.h.keep_alive);
    assert_false(P.h.chunked);
    assert_false(P.h.expect_continue);
}

static void test_parse_path_is_the_target_without_a_query(void **state) {
    (void)state;
    assert_true(parse("DELETE /v1/x HTTP/1.1\r\n\r\n") > 0);
    assert_string_equal(P.h.method, "DELETE");
    assert_ptr_equal(P.h.path, P.h.target);
    assert_string_equal(P.h.path, "/v1/x");
    assert_true(parse("GET /?q HTTP/1.1\r\n\r\n") > 0);
    assert_string_equal(P.h.path, "/");
    assert_string_equal(P.h.target, "/?q");
}

static void test_parse_returns_the_head_length_not_the_body(void **state) {
    (void)state;
    const char *head = "POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 12\r\n\r\n";
    char req[256];
    snprintf(req, sizeof req, "%s{\"a\":\"bcd\"}", head);
    assert_int_equal(parse(req), (int)strlen(head));
    assert_string_equal(P.h.method, "POST");
    assert_int_equal(P.h.content_length, 12);
}

static void test_parse_header_lookup_ignores_case_and_trims_spaces(void **state) {
    (void)state;
    assert_true(parse("POST / HTTP/1.1\r\ncontent-LENGTH: 7\r\nX-Req:  spaced value \t\r\nEmpty:\r\n\r\n") > 0);
    assert_string_equal(http_head_get(&P.h, "Content-Length"), "7");
    assert_string_equal(http_head_get(&P.h, "x-req"), "spaced value");
    assert_string_equal(http_head_get(&P.h, "EMPTY"), "");
    assert_null(http_head_get(&P.h, "absent"));
    assert_int_equal(P.h.content_length, 7);
}

static void test_parse_incomplete_head_asks_for_more(void **state) {
    (void)state;
    const char *req = "POST /a?b HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n";
    for (size_t n = 1; n < strlen(req); n++)
        if (parse_n(req, n, 4096) != 0) fail_msg("%zu bytes: rc %d", n, P.rc);
    assert_int_equal(parse(req), (int)strlen(req));
}

static void test_parse_keep_alive_follows_version_and_connection(void **state) {
    (void)state;
    struct {
        const char *req;
        bool keep;
    } cases[] = {
        {"GET / HTTP/1.1\r\n\r\n", true},
        {"GET / HTTP/1.1\r\nConnection: close\r\n\r\n", false},
        {"GET / HTTP/1.1\r\nconnection: Upgrade, CLOSE\r\n\r\n", false},
        {"GET / HTTP/1.1\r\nConnection: keep-alive\r\n\r\n", true},
        {"GET / HTTP/1.0\r\n\r\n", false},
        {"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", true},
        {"GET / HTTP/1.0\r\nCONNECTION: Keep-Alive\r\n\r\n", true},
        {"GET / HTTP/1.0\r\nConnection: keep-alive, close\r\n\r\n", false},
        {"GET / HTTP/1.0\r\nConnection: keep-alived\r\n\r\n", false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        assert_int_equal(parse(cases[i].req), (int)strlen(cases[i].req));
        if (P.h.keep_alive != cases[i].keep) fail_msg("case %zu: keep_alive %d", i, P.h.keep_alive);
    }
    assert_true(parse("GET / HTTP/1.0\r\n\r\n") > 0);
    assert_int_equal(P.h.minor, 0);
}

static void test_parse_content_length_cases(void **state) {
    (void)state;
    struct {
        const char *headers;
        int rc_sign; /* 1: parsed; -400 */
        int64_t len;
    } cases[] = {
        {"Content-Length: 0\r\n", 1, 0},
        {"Content-Length: 5 \r\n", 1, 5},
        {"Content-Length: 5\r\ncontent-length: 5\r\n", 1, 5},
        {"Content-Length: 9223372036854775807\r\n", 1, INT64_MAX},
        {"Content-Length: 5\r\nContent-Length: 6\r\n", -400, 0},
        {"Content-Length: 9223372036854775808\r\n", -400, 0},
        {"Content-Length: 99999999999999999999\r\n", -400, 0},
        {"Content-Length: -1\r\n", -400, 0},
        {"Content-Length: +5\r\n", -400, 0},
        {"Content-Length: 5, 5\r\n", -400, 0},
        {"Content-Length: 0x10\r\n", -400, 0},
        {"Content-Length:\r\n", -400, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char req[256];
        snprintf(req, sizeof req, "POST / HTTP/1.1\r\n%s\r\n", cases[i].headers);
        int rc = parse(req);
        if (cases[i].rc_sign > 0) {
            if (rc != (int)strlen(req)) fail_msg("case %zu: rc %d", i, rc);
            assert_int_equal(P.h.content_length, cases[i].len);
        } else {
            if (rc != cases[i].rc_sign) fail_msg("case %zu: rc %d", i, rc);
            assert_non_null(P.why);
        }
    }
}

static void test_parse_malformed_heads_get_their_status(void **state) {
    (void)state;
    struct {
        const char *req;
        size_t len; /* 0: strlen */
        int rc;
    } cases[] = {
        {"GET / HTTP/1.1\r\nBad Header\r\n\r\n", 0, -400},
        {"GET / HTTP/1.1\r\nA: b\r\n  folded\r\n\r\n", 0, -400},
        {"GET / HTTP/1.1\r\nA: b\r\n\tfolded\r\n\r\n", 0, -400},
        {"GET / HTTP/1.1\r\nA: b\0c\r\n\r\n", sizeof "GET / HTTP/1.1\r\nA: b\0c\r\n\r\n" - 1, -400},
        {"GET / HTTP/1.1\r\nA: b\x01\r\n\r\n", 0, -400},
        {"GET / HTTP/1.1\r\nA: b\x7f\r\n\r\n", 0, -400},
        {"GET / HTTP/1.1\nA: b\r\n\r\n", 0, -400},
        {"GET / HTTP/1.1\r\nA: b\rc\r\n\r\n", 0, -400},
        {"GET / HTTP/1.1\r\nName : v\r\n\r\n", 0, -400},
        {"GET / HTTP/1.1\r\n: v\r\n\r\n", 0, -400},
        {"GET / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 0, -400},
        {"GET / HTTX/1.1\r\n\r\n", 0, -400},
        {"GET / HTTP/1.10\r\n\r\n", 0, -400},
        {"GET / HTTP/1.1 \r\n\r\n", 0, -400},
        {"GET  / HTTP/1.1\r\n\r\n", 0, -400},
        {"GET /\r\n\r\n", 0, -400},
        {"GET http://a/ HTTP/1.1\r\n\r\n", 0, -400},
        {"G(T / HTTP/1.1\r\n\r\n", 0, -400},
        {"GET /\x80 HTTP/1.1\r\n\r\n", 0, -400},
        {" GET / HTTP/1.1\r\n\r\n", 0, -400},
        {"GET / HTTP/2.0\r\n\r\n", 0, -505},
        {"GET / HTTP/1.2\r\n\r\n", 0, -505},
        {"GET / HTTP/0.9\r\n\r\n", 0, -505},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int rc = parse_n(cases[i].req, cases[i].len, 4096);
        if (rc != cases[i].rc) fail_msg("case %zu: rc %d, want %d", i, rc, cases[i].rc);
        assert_non_null(P.why);
    }
    /* A control character is refused before the head is complete. */
    assert_int_equal(parse("GET / HTTP/1.1\r\nA: \x02"), -400);
    assert_string_equal(P.why, "a control character in the head");
}

static void test_parse_head_over_the_limit_is_431(void **state) {
    (void)state;
    const char *req = "GET / HTTP/1.1\r\nHost: example\r\n\r\n"; /* 33 bytes */
    assert_int_equal(parse_n(req, 0, 33), 33);
    assert_int_equal(parse_n(req, 0, 32), -431);
    assert_int_equal(parse_n(req, 20, 20), -431);
    assert_int_equal(parse_n(req, 19, 20), 0);
}

static void test_parse_more_than_max_headers_is_431(void **state) {
    (void)state;
    char req[4096];
    for (int n = HTTP_MAX_HEADERS; n <= HTTP_MAX_HEADERS + 1; n++) {
        size_t k = (size_t)snprintf(req, sizeof req, "GET / HTTP/1.1\r\n");
        for (int i = 0; i < n; i++) k += (size_t)snprintf(req + k, sizeof req - k, "H%d: %d\r\n", i, i);
        snprintf(req + k, sizeof req - k, "\r\n");
        int rc = parse(req);
        if (n == HTTP_MAX_HEADERS) {
            assert_int_equal(rc, (int)strlen(req));
            assert_int_equal(P.h.n_headers, HTTP_MAX_HEADERS);
            assert_string_equal(http_head_get(&P.h, "h63"), "63");
        } else {
            assert_int_equal(rc, -431);
        }
    }
}

static void test_parse_long_path_before_a_query_is_414(void **state) {
    (void)state;
    char req[HTTP_MAX_PATH + 64];
    char path[HTTP_MAX_PATH + 2];
    memset(path, 'a', sizeof path);
    path[0] = '/';
    path[HTTP_MAX_PATH] = '\0';
    snprintf(req, sizeof req, "GET %s?q HTTP/1.1\r\n\r\n", path);
    assert_int_equal(parse_n(req, 0, sizeof req), (int)strlen(req));
    assert_int_equal(strlen(P.h.path), HTTP_MAX_PATH);
    path[HTTP_MAX_PATH] = 'a';
    path[HTTP_MAX_PATH + 1] = '\0';
    snprintf(req, sizeof req, "GET %s?q HTTP/1.1\r\n\r\n", path);
    assert_int_equal(parse_n(req, 0, sizeof req), -414);
    snprintf(req, sizeof req, "GET %s HTTP/1.1\r\n\r\n", path); /* no query: no copy, no limit */
    assert_int_equal(parse_n(req, 0, sizeof req), (int)strlen(req));
}

static void test_parse_flags_chunked_and_expect(void **state) {
    (void)state;
    assert_true(parse("POST / HTTP/1.1\r\nTransfer-Encoding: gzip, Chunked\r\n\r\n") > 0);
    assert_true(P.h.chunked);
    assert_true(parse("POST / HTTP/1.1\r\nExpect: 100-Continue\r\nContent-Length: 3\r\n\r\n") > 0);
    assert_true(P.h.expect_continue);
    assert_true(parse("POST / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n") > 0);
    assert_false(P.h.expect_continue);
}

static void test_parse_skips_empty_lines_before_the_request(void **state) {
    (void)state;
    const char *req = "\r\n\r\nGET /x HTTP/1.1\r\n\r\n";
    assert_int_equal(parse(req), (int)strlen(req));
    assert_string_equal(P.h.path, "/x");
}

static void test_status_text(void **state) {
    (void)state;
    assert_string_equal(http_status_text(200), "OK");
    assert_string_equal(http_status_text(413), "Content Too Large");
    assert_string_equal(http_status_text(429), "Too Many Requests");
    assert_string_equal(http_status_text(431), "Request Header Fields Too Large");
    assert_string_equal(http_status_text(599), "Unknown");
}

/* ---- the server ---- */

typedef struct test_state {
    pthread_mutex_t mu;
    int handled;
    int closes;         /* on_close calls */
    bool gone_in_close; /* http_req_gone was true inside on_close */
    int write_errors;   /* /stream's writes that failed */
    http_req *held;     /* /hold and /hold-stream: owned until a test answers */
} test_state;

static test_state T = {PTHREAD_MUTEX_INITIALIZER, 0, 0, false, 0, NULL};

static int get_int(const int *v) {
    pthread_mutex_lock(&T.mu);
    int x = *v;
    pthread_mutex_unlock(&T.mu);
    return x;
}

static void wait_for(const int *v, int want) {
    for (int i = 0; i < 5000 && get_int(v) != want; i++) usleep(1000);
    assert_int_equal(get_int(v), want);
}

static void on_close(void *arg) {
    http_req *r = arg;
    pthread_mutex_lock(&T.mu);
    T.closes++;
    T.gone_in_close = http_req_gone(r);
    pthread_mutex_unlock(&T.mu);
}

/* An on_close that ends the stream from inside the callback. */
static void on_close_end(void *arg) {
    on_close(arg);
    http_stream_end(arg);
}

static void handler(void *ctx, http_req *r) {
    (void)ctx;
    const http_head *h = http_req_head(r);
    pthread_mutex_lock(&T.mu);
    T.handled++;
    pthread_mutex_unlock(&T.mu);
    if (strcmp(h->path, "/hello") == 0) {
        http_respond(r, 200, "text/plain", NULL, "hello", 5);
    } else if (strcmp(h->path, "/echo") == 0) {
        size_t n;
        const char *body = http_req_body(r, &n);
        http_respond(r, 200, "application/json", "X-Method: POST\r\n", body, n);
    } else if (strcmp(h->path, "/stream") == 0) {
        http_stream_start(r, 200, "text/event-stream", "Cache-Control: no-cache\r\n");
        int bad = http_stream_write(r, "data: a\n\n", 9) != AE_OK;
        bad += http_stream_write(r, "", 0) != AE_OK;
        bad += http_stream_write(r, "data: bb\n\n", 10) != AE_OK;
        http_stream_end(r);
        pthread_mutex_lock(&T.mu);
        T.write_errors += bad;
        pthread_mutex_unlock(&T.mu);
    } else if (strcmp(h->path, "/hold") == 0 || strcmp(h->path, "/hold-stream") == 0) {
        if (strcmp(h->path, "/hold-stream") == 0) http_stream_start(r, 200, "text/event-stream", NULL);
        http_req_on_close(r, on_close, r);
        pthread_mutex_lock(&T.mu);
        T.held = r;
        pthread_mutex_unlock(&T.mu);
    } else if (strcmp(h->path, "/end-on-close") == 0) {
        http_stream_start(r, 200, "text/event-stream", NULL);
        http_req_on_close(r, on_close_end, r);
    } else {
        http_respond(r, 404, "text/plain", NULL, "no", 2);
    }
}

static size_t error_body(void *ctx, int status, const char *message, char *out, size_t cap, const char **content_type) {
    (void)ctx;
    *content_type = "application/json";
    int n = snprintf(out, cap, "{\"error\":{\"message\":\"%s\",\"code\":%d}}", message, status);
    return n < 0 ? 0 : (size_t)n < cap ? (size_t)n : cap - 1;
}

typedef struct fixture {
    struct event_base *base;
    pthread_t thread;
    http_server *srv;
    int port;
} fixture;

static void *loop_main(void *arg) {
    fixture *f = arg;
    event_base_loop(f->base, EVLOOP_NO_EXIT_ON_EMPTY);
    return NULL;
}

typedef struct loop_job {
    void (*fn)(fixture *f, void *arg);
    fixture *f;
    void *arg;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
} loop_job;

static void job_cb(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    loop_job *j = arg;
    j->fn(j->f, j->arg);
    pthread_mutex_lock(&j->mu);
    j->done = true;
    pthread_cond_signal(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

/* Runs fn on the loop thread and waits for it. A timeout of zero would
 * run fn in the same pass as the job before it, before the loop polls its
 * sockets again; 1 us lets the sockets go first, as in a real server. */
static void loop_run(fixture *f, void (*fn)(fixture *f, void *arg), void *arg) {
    loop_job j = {fn, f, arg, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, false};
    struct timeval now = {0, 1};
    assert_int_equal(event_base_once(f->base, -1, EV_TIMEOUT, job_cb, &j, &now), 0);
    pthread_mutex_lock(&j.mu);
    while (!j.done) pthread_cond_wait(&j.cv, &j.mu);
    pthread_mutex_unlock(&j.mu);
}

static void job_conns(fixture *f, void *arg) { *(int *)arg = f->srv ? http_server_conns(f->srv) : 0; }

static int server_conns(fixture *f) {
    int n = -1;
    loop_run(f, job_conns, &n);
    return n;
}

static void wait_conns(fixture *f, int want) {
    for (int i = 0; i < 5000 && server_conns(f) != want; i++) usleep(1000);
    assert_int_equal(server_conns(f), want);
}

static void job_server_close(fixture *f, void *arg) {
    (void)arg;
    http_server_close(f->srv);
    f->srv = NULL;
}

static http_req *take_held(void) {
    pthread_mutex_lock(&T.mu);
    http_req *r = T.held;
    T.held = NULL;
    pthread_mutex_unlock(&T.mu);
    assert_non_null(r);
    return r;
}

static void job_respond_held(fixture *f, void *arg) {
    (void)f, (void)arg;
    http_respond(take_held(), 200, "text/plain", NULL, "late", 4);
}

static void job_stream_end_held(fixture *f, void *arg) {
    (void)f;
    http_req *r = take_held();
    *(int *)arg = http_stream_write(r, "data: x\n\n", 9);
    http_stream_end(r);
}

typedef struct write_job {
    http_req *r;
    size_t len;
    int rc;
    bool gone;
} write_job;

static void job_stream_write(fixture *f, void *arg) {
    (void)f;
    write_job *w = arg;
    static char chunk[16384];
    memset(chunk, 'x', sizeof chunk);
    w->rc = http_stream_write(w->r, chunk, w->len);
    w->gone = http_req_gone(w->r);
}

static int open_fixture(void **state, int max_conns, int idle_timeout_ms) {
    memset(&T, 0, sizeof T);
    pthread_mutex_init(&T.mu, NULL);
    fixture *f = calloc(1, sizeof *f);
    f->base = event_base_new();
    assert_non_null(f->base);
    http_config cfg = {.host = "127.0.0.1",
                       .port = 0,
                       .max_conns = max_conns,
                       .max_head_bytes = 1024,
                       .max_body_bytes = 1000,
                       .max_out_bytes = 64 * 1024,
                       .idle_timeout_ms = idle_timeout_ms,
                       .handler = handler,
                       .error_body = error_body};
    ae_error err = {{0}};
    if (http_server_open(&f->srv, f->base, &cfg, &err) != AE_OK) fail_msg("%s", err.msg);
    f->port = http_server_port(f->srv);
    assert_true(f->port > 0);
    assert_int_equal(pthread_create(&f->thread, NULL, loop_main, f), 0);
    *state = f;
    return 0;
}

static int setup(void **state) { return open_fixture(state, 8, 0); }
static int setup_one_conn(void **state) { return open_fixture(state, 1, 0); }
static int setup_idle(void **state) { return open_fixture(state, 8, 150); }

static int teardown(void **state) {
    fixture *f = *state;
    loop_run(f, job_server_close, NULL);
    event_base_loopbreak(f->base);
    pthread_join(f->thread, NULL);
    event_base_free(f->base);
    free(f);
    return 0;
}

static int client(fixture *f) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)f->port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    return fd;
}

static void send_all(int fd, const char *s) {
    size_t n = strlen(s);
    while (n) {
        ssize_t k = send(fd, s, n, MSG_NOSIGNAL);
        assert_true(k > 0);
        s += k, n -= (size_t)k;
    }
}

/* Reads exactly strlen(want) bytes and compares them. */
static void expect_bytes(int fd, const char *want) {
    size_t n = strlen(want), got = 0;
    char *buf = malloc(n + 1);
    while (got < n) {
        ssize_t k = recv(fd, buf + got, n - got, 0);
        if (k <= 0) {
            buf[got] = '\0';
            fail_msg("connection ended (%zd, %s) after %zu of %zu bytes: \"%s\"", k, strerror(errno), got, n, buf);
        }
        got += (size_t)k;
    }
    buf[n] = '\0';
    assert_string_equal(buf, want);
    free(buf);
}

/* The server closed its side: no more bytes, then EOF. */
static void expect_eof(int fd) {
    char c;
    assert_int_equal(recv(fd, &c, 1, 0), 0);
}

static char *reply(int status, const char *text, const char *type, const char *conn, const char *extra,
                   const char *body) {
    static char buf[4096];
    snprintf(buf, sizeof buf, "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\nConnection: %s\r\n%s\r\n%s",
             status, text, type, strlen(body), conn, extra, body);
    return buf;
}

static char *error_reply(int status, const char *text, const char *extra, const char *message) {
    char body[512];
    snprintf(body, sizeof body, "{\"error\":{\"message\":\"%s\",\"code\":%d}}", message, status);
    return reply(status, text, "application/json", "close", extra, body);
}

#define HELLO "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\nConnection: keep-alive\r\n\r\nhello"
#define STREAM \
    "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: " \
    "keep-alive\r\nCache-Control: no-cache\r\n\r\n9\r\ndata: a\n\n\r\na\r\ndata: bb\n\n\r\n0\r\n\r\n"

static void test_get_gets_a_whole_reply(void **state) {
    fixture *f = *state;
    int fd = client(f);
    send_all(fd, "GET /hello HTTP/1.1\r\nHost: t\r\n\r\n");
    expect_bytes(fd, HELLO);
    assert_int_equal(get_int(&T.handled), 1);
    assert_int_equal(server_conns(f), 1);
    close(fd);
    wait_conns(f, 0);
}

static void test_post_body_reaches_the_handler(void **state) {
    fixture *f = *state;
    int fd = client(f);
    send_all(fd, "POST /echo HTTP/1.1\r\nContent-Length: 13\r\n\r\n{\"x\":\"hello\"}");
    expect_bytes(fd, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 13\r\n"
                     "Connection: keep-alive\r\nX-Method: POST\r\n\r\n{\"x\":\"hello\"}");
    /* No Content-Length on a POST: an empty body. */
    send_all(fd, "POST /echo HTTP/1.1\r\n\r\n");
    expect_bytes(fd, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 0\r\n"
                     "Connection: keep-alive\r\nX-Method: POST\r\n\r\n");
    close(fd);
}

static void test_keep_alive_serves_two_requests_on_one_connection(void **state) {
    fixture *f = *state;
    int fd = client(f);
    send_all(fd, "GET /hello HTTP/1.1\r\n\r\n");
    expect_bytes(fd, HELLO);
    send_all(fd, "GET /nothing HTTP/1.1\r\n\r\n");
    expect_bytes(fd, reply(404, "Not Found", "text/plain", "keep-alive", "", "no"));
    assert_int_equal(get_int(&T.handled), 2);
    close(fd);
}

static void test_pipelined_requests_are_answered_in_order(void **state) {
    fixture *f = *state;
    int fd = client(f);
    send_all(fd, "GET /hello HTTP/1.1\r\n\r\nPOST /echo HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi\r\n"
                 "GET /stream HTTP/1.1\r\n\r\nGET /hello HTTP/1.1\r\nConnection: close\r\n\r\n");
    expect_bytes(fd, HELLO);
    expect_bytes(fd, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                     "Connection: keep-alive\r\nX-Method: POST\r\n\r\nhi");
    expect_bytes(fd, STREAM);
    expect_bytes(fd, reply(200, "OK", "text/plain", "close", "", "hello"));
    expect_eof(fd);
    assert_int_equal(get_int(&T.handled), 4);
    close(fd);
}

static void test_many_pipelined_requests_are_all_answered(void **state) {
    fixture *f = *state;
    int fd = client(f);
    char reqs[1024] = "";
    for (int i = 0; i < 40; i++) strcat(reqs, "GET /hello HTTP/1.1\r\n\r\n"); /* more than one wakeup serves */
    send_all(fd, reqs);
    for (int i = 0; i < 40; i++) expect_bytes(fd, HELLO);
    assert_int_equal(get_int(&T.handled), 40);
    close(fd);
}

/* RFC 9112 2.2: empty lines before a request are skipped, however the
 * bytes are split across reads ("\r", then "\n\r\n" and the request). */
static void test_empty_lines_split_across_reads_are_skipped(void **state) {
    fixture *f = *state;
    int fd = client(f);
    send_all(fd, "\r");
    usleep(50000); /* a read of its own */
    send_all(fd, "\n\r\nGET /hello HTTP/1.1\r\n\r\n");
    expect_bytes(fd, HELLO);
    send_all(fd, "\r\n\r");
    usleep(50000);
    send_all(fd, "\nGET /hello HTTP/1.1\r\n\r\n");
    expect_bytes(fd, HELLO);
    assert_int_equal(get_int(&T.handled), 2);
    close(fd);
}

static void test_pipelined_request_waits_for_an_owned_one(void **state) {
    fixture *f = *state;
    int fd = client(f);
    send_all(fd, "GET /hold HTTP/1.1\r\n\r\nGET /hello HTTP/1.1\r\n\r\n");
    wait_for(&T.handled, 1);
    usleep(50000);
    assert_int_equal(get_int(&T.handled), 1);
    loop_run(f, job_respond_held, NULL);
    expect_bytes(fd, reply(200, "OK", "text/plain", "keep-alive", "", "late"));
    expect_bytes(fd, HELLO);
    assert_int_equal(get_int(&T.handled), 2);
    close(fd);
}

static void test_streamed_reply_is_chunked_on_the_wire(void **state) {
    fixture *f = *state;
    int fd = client(f);
    send_all(fd, "GET /stream HTTP/1.1\r\n\r\n");
    expect_bytes(fd, STREAM);
    send_all(fd, "GET /hello HTTP/1.1\r\n\r\n"); /* the connection goes on */
    expect_bytes(fd, HELLO);
    assert_int_equal(get_int(&T.write_errors), 0);
    close(fd);
}

static void test_http10_stream_ends_with_the_connection(void **state) {
    fixture *f = *state;
    int fd = client(f);
    send_all(fd, "GET /stream HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
    expect_bytes(fd, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
                     "Cache-Control: no-cache\r\n\r\ndata: a\n\ndata: bb\n\n");
    expect_eof(fd);
    close(fd);
}

static void test_http10_closes_after_the_reply(void **state) {
    fixture *f = *state;
    int fd = client(f);
    send_all(fd, "GET /hello HTTP/1.0\r\n\r\n");
    expect_bytes(fd, reply(200, "OK", "text/plain", "close", "", "hello"));
    expect_eof(fd);
    close(fd);
    wait_conns(f, 0);
}

static void test_connection_close_is_honoured(void **state) {
    fixture *f = *state;
    int fd = client(f);
    send_all(fd, "GET /hello HTTP/1.1\r\ncOnNeCtIoN: Close\r\n\r\nGET /hello HTTP/1.1\r\n\r\n");
    expect_bytes(fd, reply(200, "OK", "text/plain", "close", "", "hello"));
    expect_eof(fd);
    assert_int_equal(get_int(&T.handled), 1);
    close(fd);
}

static void test_big_content_length_gets_413_with_the_error_body(void **state) {
    fixture *f = *state;
    int fd = client(f);
    send_all(fd, "POST /echo HTTP/1.1\r\nContent-Length: 2000\r\nExpect: 100-continue\r\n\r\n");
    expect_bytes(fd, error_reply(413, "Content Too Large", "",
                                 "the request body of 2000 bytes is over the limit of 1000 bytes"));
    expect_eof(fd);
    assert_int_equal(get_int(&T.handled), 0);
    wait_conns(f, 0);
    close(fd);
}

static void test_chunked_request_body_gets_411(void **state) {
    fixture *f = *state;
    int fd = client(f);
    send_all(fd, "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n");
    expect_bytes(
        fd, error_reply(411, "Length Required", "", "a chunked request body is not supported: send Content-Length"));
    expect_eof(fd);
    assert_int_equal(get_int(&T.handled), 0);
    close(fd);
}

static void test_malformed_head_gets_400_and_the_connection_closes(void **state) {
    fixture *f = *state;
    int fd = client(f);
    send_all(fd, "GET /hello HTTP/1.1\r\nBad Header\r\n\r\n");
    expect_bytes(fd, error_reply(400, "Bad Request", "", "a header line without a colon"));
    expect_eof(fd);
    close(fd);
    fd = client(f);
    send_all(fd, "GET /hello HTTP/3.0\r\n\r\n");
    expect_bytes(fd, error_reply(505, "HTTP Version Not Supported", "", "only HTTP/1.0 and HTTP/1.1 are served"));
    expect_eof(fd);
    close(fd);
    assert_int_equal(get_int(&T.handled), 0);
}

static void test_head_over_the_limit_gets_431(void **state) {
    fixture *f = *state;
    int fd = client(f);
    char req[2048];
    snprintf(req, sizeof req, "GET /hello HTTP/1.1\r\nX-Big: %01500d\r\n\r\n", 0);
    send_all(fd, req);
    expect_bytes(fd, error_reply(431, "Request Header Fields Too Large", "", "the head is too large"));
    expect_eof(fd);
    close(fd);
}

static void test_over_max_conns_gets_429_with_retry_after(void **state) {
    fixture *f = *state;
    int a = client(f);
    send_all(a, "GET /hello HTTP/1.1\r\n\r\n");
    expect_bytes(a, HELLO); /* a is surely accepted and counted */
    int b = client(f);
    expect_bytes(b, error_reply(429, "Too Many Requests", "Retry-After: 1\r\n", "1 connections open (the limit)"));
    expect_eof(b);
    assert_int_equal(server_conns(f), 1);
    close(b);
    send_all(a, "GET /hello HTTP/1.1\r\n\r\n"); /* a is still served */
    expect_bytes(a, HELLO);
    close(a);
    wait_conns(f, 0);
    int c = client(f); /* a's place is free again */
    send_all(c, "GET /hello HTTP/1.1\r\n\r\n");
    expect_bytes(c, HELLO);
    close(c);
}

static void test_expect_100_continue_is_answered_before_the_body(void **state) {
    fixture *f = *state;
    int fd = client(f);
    send_all(fd, "POST /echo HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n");
    expect_bytes(fd, "HTTP/1.1 100 Continue\r\n\r\n");
    assert_int_equal(get_int(&T.handled), 0);
    send_all(fd, "hello");
    expect_bytes(fd, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5\r\n"
                     "Connection: keep-alive\r\nX-Method: POST\r\n\r\nhello");
    close(fd);
}

static void test_client_gone_while_owned_sees_on_close_once_and_a_late_answer_is_safe(void **state) {
    fixture *f = *state;
    int fd = client(f);
    send_all(fd, "GET /hold HTTP/1.1\r\n\r\n");
    wait_for(&T.handled, 1);
    close(fd);
    wait_for(&T.closes, 1);
    assert_true(T.gone_in_close);
    wait_conns(f, 0);
    loop_run(f, job_respond_held, NULL);
    usleep(20000);
    assert_int_equal(get_int(&T.closes), 1);
}

static void test_client_gone_during_a_stream_fails_writes_and_end_is_safe(void **state) {
    fixture *f = *state;
    int fd = client(f);
    send_all(fd, "GET /hold-stream HTTP/1.1\r\n\r\n");
    expect_bytes(fd, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                     "Connection: keep-alive\r\n\r\n");
    close(fd);
    wait_for(&T.closes, 1);
    int rc = AE_OK;
    loop_run(f, job_stream_end_held, &rc);
    assert_int_equal(rc, AE_ERR);
    assert_int_equal(get_int(&T.closes), 1);
}

static void test_on_close_may_answer_the_request(void **state) {
    fixture *f = *state;
    int fd = client(f);
    send_all(fd, "GET /end-on-close HTTP/1.1\r\n\r\n");
    expect_bytes(fd, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                     "Connection: keep-alive\r\n\r\n");
    close(fd);
    wait_for(&T.closes, 1);
    wait_conns(f, 0);
}

static void test_answer_after_the_server_closed_is_safe(void **state) {
    fixture *f = *state;
    int fd = client(f);
    send_all(fd, "GET /hold HTTP/1.1\r\n\r\n");
    wait_for(&T.handled, 1);
    loop_run(f, job_server_close, NULL);
    assert_int_equal(get_int(&T.closes), 1);
    loop_run(f, job_respond_held, NULL);
    char c;
    assert_true(recv(fd, &c, 1, 0) <= 0); /* closed without a reply */
    close(fd);
}

static void test_reader_too_slow_for_its_stream_is_dropped(void **state) {
    fixture *f = *state;
    int fd = client(f);
    send_all(fd, "GET /hold-stream HTTP/1.1\r\n\r\n");
    wait_for(&T.handled, 1);
    pthread_mutex_lock(&T.mu);
    write_job w = {T.held, 16384, AE_OK, false};
    pthread_mutex_unlock(&T.mu);
    /* The client reads nothing: the kernel's buffers fill, then the
     * connection's output, then the server gives up on it. */
    int writes = 0;
    for (; writes < 20000 && w.rc == AE_OK; writes++) loop_run(f, job_stream_write, &w);
    assert_int_equal(w.rc, AE_ERR);
    assert_true(w.gone);
    assert_true(writes > 4); /* 64 KiB of output is allowed to wait */
    wait_for(&T.closes, 1);
    int rc = AE_OK;
    loop_run(f, job_stream_end_held, &rc);
    assert_int_equal(rc, AE_ERR);
    wait_conns(f, 0);
    close(fd);
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void test_idle_connection_is_closed(void **state) {
    fixture *f = *state;
    double t0 = now_ms();
    int fd = client(f);
    expect_eof(fd);
    assert_true(now_ms() - t0 >= 140);
    close(fd);
    /* A partial head does not keep a connection open either. */
    fd = client(f);
    send_all(fd, "GET /hello HTTP/1.1\r\n");
    expect_eof(fd);
    close(fd);
    wait_conns(f, 0);
}

static void test_idle_timer_waits_while_handled_and_restarts_after_a_reply(void **state) {
    fixture *f = *state;
    int fd = client(f);
    send_all(fd, "GET /hold HTTP/1.1\r\n\r\n");
    wait_for(&T.handled, 1);
    usleep(400000); /* over the idle timeout while the handler owns the request */
    loop_run(f, job_respond_held, NULL);
    expect_bytes(fd, reply(200, "OK", "text/plain", "keep-alive", "", "late"));
    double t0 = now_ms();
    expect_eof(fd);
    assert_true(now_ms() - t0 >= 100);
    assert_int_equal(get_int(&T.closes), 0);
    close(fd);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    if (evthread_use_pthreads() != 0) return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_splits_target_into_path_and_query),
        cmocka_unit_test(test_parse_path_is_the_target_without_a_query),
        cmocka_unit_test(test_parse_returns_the_head_length_not_the_body),
        cmocka_unit_test(test_parse_header_lookup_ignores_case_and_trims_spaces),
        cmocka_unit_test(test_parse_incomplete_head_asks_for_more),
        cmocka_unit_test(test_parse_keep_alive_follows_version_and_connection),
        cmocka_unit_test(test_parse_content_length_cases),
        cmocka_unit_test(test_parse_malformed_heads_get_their_status),
        cmocka_unit_test(test_parse_head_over_the_limit_is_431),
        cmocka_unit_test(test_parse_more_than_max_headers_is_431),
        cmocka_unit_test(test_parse_long_path_before_a_query_is_414),
        cmocka_unit_test(test_parse_flags_chunked_and_expect),
        cmocka_unit_test(test_parse_skips_empty_lines_before_the_request),
        cmocka_unit_test(test_status_text),
        cmocka_unit_test_setup_teardown(test_get_gets_a_whole_reply, setup, teardown),
        cmocka_unit_test_setup_teardown(test_post_body_reaches_the_handler, setup, teardown),
        cmocka_unit_test_setup_teardown(test_keep_alive_serves_two_requests_on_one_connection, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pipelined_requests_are_answered_in_order, setup, teardown),
        cmocka_unit_test_setup_teardown(test_many_pipelined_requests_are_all_answered, setup, teardown),
        cmocka_unit_test_setup_teardown(test_empty_lines_split_across_reads_are_skipped, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pipelined_request_waits_for_an_owned_one, setup, teardown),
        cmocka_unit_test_setup_teardown(test_streamed_reply_is_chunked_on_the_wire, setup, teardown),
        cmocka_unit_test_setup_teardown(test_http10_stream_ends_with_the_connection, setup, teardown),
        cmocka_unit_test_setup_teardown(test_http10_closes_after_the_reply, setup, teardown),
        cmocka_unit_test_setup_teardown(test_connection_close_is_honoured, setup, teardown),
        cmocka_unit_test_setup_teardown(test_big_content_length_gets_413_with_the_error_body, setup, teardown),
        cmocka_unit_test_setup_teardown(test_chunked_request_body_gets_411, setup, teardown),
        cmocka_unit_test_setup_teardown(test_malformed_head_gets_400_and_the_connection_closes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_head_over_the_limit_gets_431, setup, teardown),
        cmocka_unit_test_setup_teardown(test_over_max_conns_gets_429_with_retry_after, setup_one_conn, teardown),
        cmocka_unit_test_setup_teardown(test_expect_100_continue_is_answered_before_the_body, setup, teardown),
        cmocka_unit_test_setup_teardown(test_client_gone_while_owned_sees_on_close_once_and_a_late_answer_is_safe,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_client_gone_during_a_stream_fails_writes_and_end_is_safe, setup, teardown),
        cmocka_unit_test_setup_teardown(test_on_close_may_answer_the_request, setup, teardown),
        cmocka_unit_test_setup_teardown(test_answer_after_the_server_closed_is_safe, setup, teardown),
        cmocka_unit_test_setup_teardown(test_reader_too_slow_for_its_stream_is_dropped, setup, teardown),
        cmocka_unit_test_setup_teardown(test_idle_connection_is_closed, setup_idle, teardown),
        cmocka_unit_test_setup_teardown(test_idle_timer_waits_while_handled_and_restarts_after_a_reply, setup_idle,
                                        teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
