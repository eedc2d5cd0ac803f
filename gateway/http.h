/* A small HTTP/1.1 server on libevent bufferevents: what aerie-gateway
 * needs and nothing more.
 *
 * Why not libevent's evhttp: in libevent 2.1 it answers an oversized body
 * with its own HTML page (the API promises OpenAI's JSON error shape), it
 * has no limit on open connections, and it does not read from a connection
 * while its request is being handled, so a client that hangs up while its
 * request waits in a queue is not noticed until the first write. Here every
 * error the server answers itself has a body the caller builds, connections
 * over the limit get 429 with Retry-After, and a connection keeps being
 * watched for EOF while its request is handled (on_close).
 *
 * What it speaks: request line + headers (at most max_head_bytes), a body
 * by Content-Length (at most max_body_bytes; "Expect: 100-continue" is
 * answered), keep-alive (HTTP/1.1 by default, HTTP/1.0 with "Connection:
 * keep-alive"), pipelined requests handled one after another. Replies are
 * whole (Content-Length) or streamed with chunked transfer encoding.
 * Refused: a chunked request body (411), HTTP versions other than 1.0/1.1
 * (505), a malformed head (400), a head over the limit (431), a path over
 * HTTP_MAX_PATH before a query (414), a body over the limit (413, then the
 * connection closes without reading the body).
 *
 * Threads: everything runs on the thread of the event_base given to
 * http_server_open; every function here must be called there. The process
 * must ignore SIGPIPE (svc_signals_init does): libevent writes with
 * writev, which raises it when a client has gone. */
#ifndef AERIE_GATEWAY_HTTP_H
#define AERIE_GATEWAY_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../services/core/err.h"

struct event_base;

/* ---- the request head parser (pure; unit tests and the fuzzer use it) ---- */

#define HTTP_MAX_HEADERS 64
#define HTTP_MAX_PATH 2048 /* bytes of a path followed by a query (414 beyond) */

typedef struct http_header {
    const char *name, *value; /* NUL-terminated, inside the parsed buffer */
} http_header;

typedef struct http_head {
    const char *method; /* "GET", "POST", ... as sent */
    const char *target; /* the request target as sent ("/v1/models?x=1") */
    const char *path;   /* target without the query: target itself when there
                           is none, else a copy in path_buf (so an http_head
                           must not be copied by value) */
    int minor;          /* HTTP/1.<minor>: 0 or 1 */
    http_header headers[HTTP_MAX_HEADERS];
    int n_headers;
    int64_t content_length; /* -1 when absent */
    bool chunked;           /* Transfer-Encoding: chunked */
    bool keep_alive;        /* after the version and Connection header */
    bool expect_continue;   /* Expect: 100-continue */
    char path_buf[HTTP_MAX_PATH + 1];
} http_head;

/* Parses the head at the start of buf[0..len). The buffer is modified in
 * place (NULs written) and the strings in *h point into it.
 *   > 0: the head is complete and took that many bytes;
 *   0:   incomplete, read more;
 *   < 0: a malformed head; -status is the status to answer (400, 414,
 *        431 or 505; 411 and 413 come from the parsed head, see
 *        http_server), *why says what.
 * Empty lines before the request line are skipped (and counted). */
int http_parse_head(char *buf, size_t len, size_t max_head, http_head *h, const char **why);

/* Case-insensitive header lookup; NULL when absent. */
const char *http_head_get(const http_head *h, const char *name);

/* ---- the server ---- */

typedef struct http_server http_server;
typedef struct http_req http_req;

/* Called for every complete request. The handler owns r until it answers
 * with http_respond or ends a stream with http_stream_end (from the call
 * itself or later, on the loop thread). */
typedef void (*http_handler)(void *ctx, http_req *r);

/* Writes the body of an error the server answers by itself (400, 411, 413,
 * 414, 429, 431, 505) into out[0..cap) and returns its length; *content_type
 * is set to its type. */
typedef size_t (*http_error_body_fn)(void *ctx, int status, const char *message, char *out, size_t cap,
                                     const char **content_type);

typedef struct http_config {
    const char *host; /* "127.0.0.1", "0.0.0.0", "::1" */
    int port;         /* 0: any free port (see http_server_port) */
    int max_conns;    /* beyond: answered 429 with Retry-After: 1, then closed */
    size_t max_head_bytes;
    size_t max_body_bytes;
    size_t max_out_bytes; /* unsent reply bytes a client may leave queued; beyond, it is dropped as gone */
    int idle_timeout_ms;  /* a connection with no complete request in this long is closed */
    http_handler handler;
    http_error_body_fn error_body;
    void *ctx;
} http_config;

int http_server_open(http_server **out, struct event_base *base, const http_config *cfg, ae_error *err);
/* Closes the listener and every connection (their open requests see
 * on_close); requests still owned by a handler are freed when it answers. */
void http_server_close(http_server *s); /* NULL is a no-op */
int http_server_port(const http_server *s);
int http_server_conns(const http_server *s);

const http_head *http_req_head(const http_req *r);
const char *http_req_body(const http_req *r, size_t *len);
/* The peer's address as text ("127.0.0.1:53122"), for logs. */
const char *http_req_peer(const http_req *r);

/* Called once if the client goes away (EOF, error, too slow a reader)
 * before the request is answered. r stays valid: the handler must still
 * answer or end it, which then only frees it. If the client is already
 * gone when fn is set, fn is called at once. */
void http_req_on_close(http_req *r, void (*fn)(void *arg), void *arg);
bool http_req_gone(const http_req *r);

/* A whole reply. extra_headers: NULL or lines each ending "\r\n". */
void http_respond(http_req *r, int status, const char *content_type, const char *extra_headers, const void *body,
                  size_t len);
/* A streamed reply (chunked). Writes fail (AE_ERR) once the client is
 * gone. */
void http_stream_start(http_req *r, int status, const char *content_type, const char *extra_headers);
int http_stream_write(http_req *r, const void *data, size_t len);
void http_stream_end(http_req *r);

/* "OK", "Bad Request", ... ("Unknown" for others). */
const char *http_status_text(int status);

#endif
