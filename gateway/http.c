#include "http.h"

#include <errno.h>
#include <limits.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/listener.h>
#include <netinet/in.h>
#include <netinet/tcp.h>

#include "../services/core/log.h"

#define HTTP_REQS_PER_WAKEUP 16     /* pipelined requests answered in one callback before others get a turn */
#define HTTP_FLUSH_TIMEOUT_MS 10000 /* a closing connection's last reply may stall this long */
#define HTTP_LINGER_MS 2000         /* after the last reply, input is read and dropped this long (see conn_flushed) */
#define HTTP_ERROR_BODY_MAX 2048    /* bytes of a body built by cfg->error_body */
#define HTTP_ACCEPT_PAUSE_MS 100    /* accept() failed (out of fds): wait this long before trying again */
#define HTTP_PEER_MAX 64            /* "[ipv6]:port" */
#define HTTP_HOST_MAX 256

/* ---- the request head parser ---- */

static int head_error(const char **why, int status, const char *text) {
    *why = text;
    return -status;
}

/* RFC 9110 5.6.2: the characters of a method or a header name. */
static bool is_tchar(unsigned char ch) {
    if ((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9')) return true;
    return ch && strchr("!#$%&'*+-.^_`|~", ch) != NULL;
}

static bool is_ows(char ch) { return ch == ' ' || ch == '\t'; }

/* Whether the comma-separated list s has token (case-insensitive). last:
 * only its last element counts. */
static bool list_has(const char *s, const char *token, bool last) {
    size_t tl = strlen(token);
    bool found = false;
    for (;;) {
        while (is_ows(*s) || *s == ',') s++;
        if (!*s) return found;
        const char *e = s;
        while (*e && *e != ',') e++;
        const char *t = e;
        while (t > s && is_ows(t[-1])) t--;
        bool match = (size_t)(t - s) == tl && strncasecmp(s, token, tl) == 0;
        if (last)
            found = match;
        else if (match)
            return true;
        s = e;
    }
}

/* Content-Length: digits only, no overflow (RFC 9110 8.6). */
static bool parse_length(const char *s, int64_t *out) {
    int64_t v = 0;
    if (!*s) return false;
    for (; *s; s++) {
        if (*s < '0' || *s > '9') return false;
        int d = *s - '0';
        if (v > (INT64_MAX - d) / 10) return false;
        v = v * 10 + d;
    }
    *out = v;
    return true;
}

/* The request line "METHOD SP TARGET SP HTTP/1.x", line[0..n) with the
 * CRLF cut off. */
static int parse_request_line(char *line, size_t n, http_head *h, const char **why) {
    char *sp1 = memchr(line, ' ', n);
    if (!sp1 || sp1 == line) return head_error(why, 400, "malformed request line");
    char *target = sp1 + 1;
    char *sp2 = memchr(target, ' ', n - (size_t)(target - line));
    if (!sp2 || sp2 == target) return head_error(why, 400, "malformed request line");
    char *version = sp2 + 1;
    size_t vl = n - (size_t)(version - line);
    for (char *p = line; p < sp1; p++)
        if (!is_tchar((unsigned char)*p)) return head_error(why, 400, "malformed method");
    for (char *p = target; p < sp2; p++)
        if ((unsigned char)*p <= 0x20 || (unsigned char)*p >= 0x7f)
            return head_error(why, 400, "malformed request target");
    if (vl != 8 || memcmp(version, "HTTP/", 5) != 0 || version[5] < '0' || version[5] > '9' || version[6] != '.' ||
        version[7] < '0' || version[7] > '9')
        return head_error(why, 400, "malformed HTTP version");
    if (version[5] != '1' || (version[7] != '0' && version[7] != '1'))
        return head_error(why, 505, "only HTTP/1.0 and HTTP/1.1 are served");
    if (*target != '/') return head_error(why, 400, "the request target is not an absolute path");
    *sp1 = *sp2 = '\0';
    h->method = line;
    h->target = target;
    h->minor = version[7] - '0';
    char *q = memchr(target, '?', (size_t)(sp2 - target));
    if (!q) {
        h->path = target;
    } else {
        size_t pl = (size_t)(q - target);
        if (pl > HTTP_MAX_PATH) return head_error(why, 414, "the path is too long");
        memcpy(h->path_buf, target, pl);
        h->path_buf[pl] = '\0';
        h->path = h->path_buf;
    }
    return 0;
}

/* One header line[0..n) (CRLF cut off): stores it and applies the ones
 * that frame the message. */
static int parse_header(char *line, size_t n, http_head *h, bool *conn_close, bool *conn_keep, const char **why) {
    if (is_ows(line[0])) return head_error(why, 400, "obsolete line folding in a header");
    char *colon = memchr(line, ':', n);
    if (!colon) return head_error(why, 400, "a header line without a colon");
    if (colon == line) return head_error(why, 400, "a header without a name");
    for (char *p = line; p < colon; p++)
        if (!is_tchar((unsigned char)*p)) return head_error(why, 400, "malformed header name");
    char *v = colon + 1, *e = line + n;
    while (v < e && is_ows(*v)) v++;
    while (e > v && is_ows(e[-1])) e--;
    if (h->n_headers == HTTP_MAX_HEADERS) return head_error(why, 431, "too many headers");
    *colon = '\0';
    *e = '\0';
    h->headers[h->n_headers++] = (http_header){line, v};
    if (strcasecmp(line, "content-length") == 0) {
        int64_t len;
        if (!parse_length(v, &len)) return head_error(why, 400, "malformed Content-Length");
        if (h->content_length >= 0 && h->content_length != len)
            return head_error(why, 400, "two different Content-Length values");
        h->content_length = len;
    } else if (strcasecmp(line, "transfer-encoding") == 0) {
        /* A length this server cannot find (RFC 9112 6.3). */
        if (!list_has(v, "chunked", true)) return head_error(why, 400, "unsupported transfer coding");
        h->chunked = true;
    } else if (strcasecmp(line, "connection") == 0) {
        *conn_close |= list_has(v, "close", false);
        *conn_keep |= list_has(v, "keep-alive", false);
    } else if (strcasecmp(line, "expect") == 0) {
        h->expect_continue |= strcasecmp(v, "100-continue") == 0;
    }
    return 0;
}

/* First the bytes are checked and the end of the head found, so the line
 * parsing after it may rely on: every CR is followed by LF, every LF
 * follows a CR, and no control characters but HTAB. Host is not required
 * of HTTP/1.1 (RFC 9112 3.2 says 400): a gateway serves one site. */
int http_parse_head(char *buf, size_t len, size_t max_head, http_head *h, const char **why) {
    const char *ignored;
    if (!why) why = &ignored;
    *why = NULL;
    h->method = h->target = h->path = NULL;
    h->minor = 0;
    h->n_headers = 0;
    h->content_length = -1;
    h->chunked = h->keep_alive = h->expect_continue = false;
    h->path_buf[0] = '\0';
    if (!buf) return len ? head_error(why, 400, "no buffer") : 0;
    if (max_head > INT_MAX) max_head = INT_MAX; /* the length is returned as an int */
    size_t lim = len < max_head ? len : max_head;
    size_t start = 0;
    while (start + 1 < lim && buf[start] == '\r' && buf[start + 1] == '\n') start += 2;
    size_t end = 0;
    for (size_t i = start; i < lim; i++) {
        unsigned char ch = (unsigned char)buf[i];
        if (ch == '\n') {
            if (i == start || buf[i - 1] != '\r') return head_error(why, 400, "a bare LF in the head");
            if (i >= start + 3 && buf[i - 2] == '\n') {
                end = i + 1;
                break;
            }
        } else if (ch == '\r') {
            if (i + 1 < lim && buf[i + 1] != '\n') return head_error(why, 400, "a bare CR in the head");
        } else if ((ch < 0x20 && ch != '\t') || ch == 0x7f) {
            return head_error(why, 400, "a control character in the head");
        }
    }
    if (!end) return lim >= max_head ? head_error(why, 431, "the head is too large") : 0;

    char *p = buf + start, *stop = buf + end;
    char *cr = memchr(p, '\r', (size_t)(stop - p));
    int rc = parse_request_line(p, (size_t)(cr - p), h, why);
    if (rc < 0) return rc;
    *cr = '\0';
    p = cr + 2;
    bool conn_close = false, conn_keep = false;
    while ((cr = memchr(p, '\r', (size_t)(stop - p))) != p) {
        rc = parse_header(p, (size_t)(cr - p), h, &conn_close, &conn_keep, why);
        if (rc < 0) return rc;
        *cr = '\0';
        p = cr + 2;
    }
    h->keep_alive = !conn_close && (h->minor == 1 || conn_keep);
    /* An HTTP/1.0 client does not wait for 100 (RFC 9110 10.1.1). */
    h->expect_continue &= h->minor == 1;
    return (int)end;
}

const char *http_head_get(const http_head *h, const char *name) {
    for (int i = 0; i < h->n_headers; i++)
        if (strcasecmp(h->headers[i].name, name) == 0) return h->headers[i].value;
    return NULL;
}

const char *http_status_text(int status) {
    switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 201: return "Created";
    case 202: return "Accepted";
    case 204: return "No Content";
    case 301: return "Moved Permanently";
    case 302: return "Found";
    case 304: return "Not Modified";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 414: return "URI Too Long";
    case 415: return "Unsupported Media Type";
    case 422: return "Unprocessable Content";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 502: return "Bad Gateway";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    case 505: return "HTTP Version Not Supported";
    default: return "Unknown";
    }
}

/* ---- the server ---- */

typedef enum conn_state {
    CONN_HEAD,     /* reading a request head */
    CONN_BODY,     /* reading the body of c->pending */
    CONN_HANDLING, /* c->req is with the handler; later input waits */
    CONN_CLOSING,  /* the last reply is being sent; input is dropped */
    CONN_LINGER,   /* sent and shut for writing; input dropped until EOF */
} conn_state;

typedef struct rpc_conn rpc_conn;

struct http_req {
    rpc_conn *c; /* while the handler owns r and the connection is open */
    http_head head;
    char *head_buf; /* the head's bytes; head's strings point here */
    char *body;     /* body_len bytes + NUL; NULL when empty */
    size_t body_len;
    char peer[HTTP_PEER_MAX];
    void (*on_close)(void *arg);
    void *on_close_arg;
    bool started; /* http_stream_start was called */
    bool chunked; /* the stream is chunked (else HTTP/1.0: ends with the connection) */
    bool no_body; /* HEAD, 1xx, 204, 304: the reply has no body */
};

struct rpc_conn {
    http_server *srv; /* NULL once closed */
    struct bufferevent *bev;
    struct event *timer;  /* idle timeout, then the linger */
    struct event *resume; /* made active for deferred work: pipelined requests, a drop */
    conn_state state;
    bool counted; /* in srv->n_conns (else in srv->n_closing) */
    bool closed;
    bool drop;          /* to be closed from resume: its reader is too slow */
    bool eof;           /* the client shut its side */
    size_t drop_queued; /* unsent bytes when it was dropped, for the log */
    int depth;          /* conn_process calls on the stack: c is freed after the last */
    size_t scanned;     /* input bytes already searched for the end of the head */
    http_req *pending;  /* head read, body coming */
    http_req *req;      /* owned by the handler */
    char peer[HTTP_PEER_MAX];
    rpc_conn *prev, *next; /* srv->conns */
};

struct http_server {
    struct event_base *base;
    http_config cfg;
    char host[HTTP_HOST_MAX];
    struct evconnlistener *listener;
    struct event *accept_pause;
    rpc_conn *conns;
    int n_conns;   /* serving */
    int n_closing; /* refused or sending their last reply */
};

static void req_free(http_req *r) {
    if (!r) return;
    free(r->head_buf);
    free(r->body);
    free(r);
}

static void timer_arm(rpc_conn *c, int ms) {
    if (ms <= 0) {
        event_del(c->timer);
        return;
    }
    struct timeval tv = {ms / 1000, (ms % 1000) * 1000};
    evtimer_add(c->timer, &tv);
}

static void conn_free(rpc_conn *c) {
    event_free(c->timer);
    event_free(c->resume);
    bufferevent_free(c->bev);
    free(c);
}

static void conn_unlink(rpc_conn *c) {
    http_server *s = c->srv;
    if (!s) return;
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    c->prev = c->next = NULL;
    if (c->counted)
        s->n_conns--;
    else
        s->n_closing--;
    c->srv = NULL;
}

/* Closes the socket now. A request the handler owns is told (on_close)
 * and lives on until answered; c itself goes after the innermost
 * conn_process returns. why: NULL for an ordinary end. One log line: info
 * when a request is cut short, else debug. */
static void conn_close(rpc_conn *c, const char *why) {
    if (c->closed) return;
    c->closed = true;
    if (why && !c->req) LOG_DEBUGF("http_closed peer=%s reason=\"%s\"", c->peer, why);
    conn_unlink(c);
    event_del(c->timer);
    bufferevent_disable(c->bev, EV_READ | EV_WRITE);
    req_free(c->pending);
    c->pending = NULL;
    http_req *r = c->req;
    c->req = NULL;
    if (r) {
        LOG_INFOF("http_client_gone peer=%s method=%s path=%s reason=\"%s\"", c->peer, r->head.method, r->head.path,
                  why ? why : "closed");
        r->c = NULL;
        if (r->on_close) r->on_close(r->on_close_arg); /* may answer r, which frees it */
    }
    if (c->depth == 0) conn_free(c);
}

/* Closed from resume_cb, not here: a slow reader is noticed inside a
 * handler's write, which must not see its own on_close run under it. */
static void conn_drop(rpc_conn *c) {
    if (c->drop || c->closed) return;
    c->drop_queued = evbuffer_get_length(bufferevent_get_output(c->bev));
    c->drop = true;
    bufferevent_disable(c->bev, EV_READ | EV_WRITE);
    event_active(c->resume, EV_TIMEOUT, 1);
}

/* Drops the client when more than max_out_bytes + allowance are unsent. */
static bool conn_check_out(rpc_conn *c, size_t allowance) {
    size_t queued = evbuffer_get_length(bufferevent_get_output(c->bev));
    if (queued <= allowance || queued - allowance <= c->srv->cfg.max_out_bytes) return true;
    conn_drop(c);
    return false;
}

/* The last reply is out: the write side is shut, and what the client
 * still sends (the rest of a refused body) is read and dropped until it
 * closes, because closing a socket with unread input sends a reset that
 * can destroy the reply before the client reads it. */
static void conn_flushed(rpc_conn *c) {
    if (c->eof) {
        conn_close(c, NULL);
        return;
    }
    bufferevent_set_timeouts(c->bev, NULL, NULL);
    shutdown(bufferevent_getfd(c->bev), SHUT_WR);
    c->state = CONN_LINGER;
    timer_arm(c, HTTP_LINGER_MS);
}

/* Stops serving requests: sends what is queued, then closes. c may be
 * gone on return when called outside conn_process. */
static void conn_close_after_flush(rpc_conn *c) {
    http_server *s = c->srv;
    if (c->counted) {
        c->counted = false;
        s->n_conns--;
        s->n_closing++;
    }
    c->state = CONN_CLOSING;
    event_del(c->timer);
    req_free(c->pending);
    c->pending = NULL;
    struct evbuffer *in = bufferevent_get_input(c->bev);
    evbuffer_drain(in, evbuffer_get_length(in));
    struct timeval tv = {HTTP_FLUSH_TIMEOUT_MS / 1000, (HTTP_FLUSH_TIMEOUT_MS % 1000) * 1000};
    bufferevent_set_timeouts(c->bev, NULL, &tv);
    if (evbuffer_get_length(bufferevent_get_output(c->bev)) == 0) conn_flushed(c);
}

typedef enum framing { FRAMING_LENGTH, FRAMING_CHUNKED, FRAMING_NONE } framing;

static void put_str(struct evbuffer *out, const char *s) { evbuffer_add(out, s, strlen(s)); }

static void put_head(struct evbuffer *out, int status, const char *content_type, const char *extra_headers, framing f,
                     size_t len, bool keep_alive) {
    evbuffer_add_printf(out, "HTTP/1.1 %d %s\r\n", status, http_status_text(status));
    if (content_type) evbuffer_add_printf(out, "Content-Type: %s\r\n", content_type);
    if (f == FRAMING_LENGTH) evbuffer_add_printf(out, "Content-Length: %zu\r\n", len);
    if (f == FRAMING_CHUNKED) put_str(out, "Transfer-Encoding: chunked\r\n");
    put_str(out, keep_alive ? "Connection: keep-alive\r\n" : "Connection: close\r\n");
    if (extra_headers) put_str(out, extra_headers);
    put_str(out, "\r\n");
}

/* Answers an error with the caller's body and closes the connection. */
static void conn_refuse(rpc_conn *c, int status, const char *why) {
    http_server *s = c->srv;
    LOG_INFOF("http_refused status=%d peer=%s reason=\"%s\"", status, c->peer, why);
    char body[HTTP_ERROR_BODY_MAX];
    const char *content_type = "text/plain; charset=utf-8";
    size_t n;
    if (s->cfg.error_body) {
        n = s->cfg.error_body(s->cfg.ctx, status, why, body, sizeof body, &content_type);
    } else {
        int k = snprintf(body, sizeof body, "%s\n", why);
        n = k < 0 ? 0 : (size_t)k;
    }
    if (n > sizeof body) n = sizeof body;
    struct evbuffer *out = bufferevent_get_output(c->bev);
    put_head(out, status, content_type, status == 429 ? "Retry-After: 1\r\n" : NULL, FRAMING_LENGTH, n, false);
    evbuffer_add(out, body, n);
    conn_close_after_flush(c);
}

/* Reads a head if a whole one is there. False: wait for more bytes. */
static bool read_head(rpc_conn *c, struct evbuffer *in) {
    const http_config *cfg = &c->srv->cfg;
    /* Empty lines before a request (RFC 9112 2.2) are dropped whenever
     * they are whole, however they were split across reads: a lone "\r"
     * left from the last read is completed by this one's "\n". */
    while (evbuffer_get_length(in) >= 2) {
        const unsigned char *b = evbuffer_pullup(in, 2);
        if (b[0] != '\r' || b[1] != '\n') break;
        evbuffer_drain(in, 2);
        c->scanned = c->scanned > 2 ? c->scanned - 2 : 0;
    }
    size_t n = evbuffer_get_length(in);
    if (n == 0) return false;
    if (c->scanned > n) c->scanned = 0;
    struct evbuffer_ptr from;
    evbuffer_ptr_set(in, &from, c->scanned > 3 ? c->scanned - 3 : 0, EVBUFFER_PTR_SET);
    struct evbuffer_ptr at = evbuffer_search(in, "\r\n\r\n", 4, &from);
    size_t head_len;
    if (at.pos >= 0 && (size_t)at.pos + 4 <= cfg->max_head_bytes) {
        head_len = (size_t)at.pos + 4;
    } else if (n >= cfg->max_head_bytes) {
        head_len = cfg->max_head_bytes; /* the parser says why: 431 or a bad byte */
    } else {
        c->scanned = n;
        return false;
    }
    c->scanned = 0;
    http_req *r = calloc(1, sizeof *r);
    char *buf = r ? malloc(head_len) : NULL;
    if (!buf) {
        free(r);
        LOG_ERRORF("http_out_of_memory peer=%s head_bytes=%zu", c->peer, head_len);
        conn_close(c, NULL);
        return false;
    }
    r->head_buf = buf;
    memcpy(r->peer, c->peer, sizeof r->peer);
    evbuffer_copyout(in, buf, head_len);
    const char *why = NULL;
    int rc = http_parse_head(buf, head_len, cfg->max_head_bytes, &r->head, &why);
    if (rc <= 0 || (size_t)rc != head_len) {
        req_free(r);
        conn_refuse(c, rc < 0 ? -rc : 400, rc < 0 ? why : "malformed head");
        return true;
    }
    evbuffer_drain(in, head_len);
    c->pending = r;
    if (r->head.chunked) {
        conn_refuse(c, 411, "a chunked request body is not supported: send Content-Length");
        return true;
    }
    if (r->head.content_length > 0 && (uint64_t)r->head.content_length > cfg->max_body_bytes) {
        char text[160];
        snprintf(text, sizeof text, "the request body of %lld bytes is over the limit of %zu bytes",
                 (long long)r->head.content_length, cfg->max_body_bytes);
        conn_refuse(c, 413, text);
        return true;
    }
    r->body_len = r->head.content_length > 0 ? (size_t)r->head.content_length : 0;
    /* A client that sent body bytes already is not waiting for it. */
    if (r->head.expect_continue && r->body_len > 0 && evbuffer_get_length(in) == 0)
        put_str(bufferevent_get_output(c->bev), "HTTP/1.1 100 Continue\r\n\r\n");
    c->state = CONN_BODY;
    return true;
}

/* Reads the body if all of it is there, then hands the request over. */
static bool read_body(rpc_conn *c, struct evbuffer *in) {
    http_req *r = c->pending;
    if (evbuffer_get_length(in) < r->body_len) return false;
    if (r->body_len) {
        r->body = malloc(r->body_len + 1);
        if (!r->body) {
            LOG_ERRORF("http_out_of_memory peer=%s body_bytes=%zu", c->peer, r->body_len);
            conn_close(c, NULL);
            return false;
        }
        evbuffer_remove(in, r->body, r->body_len);
        r->body[r->body_len] = '\0';
    }
    c->pending = NULL;
    c->req = r;
    r->c = c;
    c->state = CONN_HANDLING;
    event_del(c->timer);
    http_server *s = c->srv;
    s->cfg.handler(s->cfg.ctx, r);
    return true;
}

/* The connection's state machine: reads requests while whole ones are
 * there and the handler has answered the one before. */
static void conn_process(rpc_conn *c) {
    struct evbuffer *in = bufferevent_get_input(c->bev);
    c->depth++;
    for (int served = 0; !c->closed && !c->drop;) {
        if (c->state == CONN_CLOSING || c->state == CONN_LINGER) {
            evbuffer_drain(in, evbuffer_get_length(in));
            break;
        }
        if (c->state == CONN_HANDLING) break;
        if (served == HTTP_REQS_PER_WAKEUP) {
            event_active(c->resume, EV_TIMEOUT, 1);
            break;
        }
        if (c->state == CONN_HEAD && !read_head(c, in)) break;
        if (c->state == CONN_BODY) {
            if (!read_body(c, in)) break;
            served++;
        }
    }
    c->depth--;
    if (c->closed && c->depth == 0) conn_free(c);
}

static void on_read(struct bufferevent *bev, void *arg) {
    (void)bev;
    conn_process(arg);
}

static void on_write(struct bufferevent *bev, void *arg) {
    (void)bev;
    rpc_conn *c = arg;
    if (c->state == CONN_CLOSING) conn_flushed(c);
}

static void on_event(struct bufferevent *bev, short what, void *arg) {
    rpc_conn *c = arg;
    if (what & BEV_EVENT_TIMEOUT) {
        conn_close(c, "the last reply did not drain");
    } else if (what & BEV_EVENT_ERROR) {
        conn_close(c, evutil_socket_error_to_string(EVUTIL_SOCKET_ERROR()));
    } else if (what & BEV_EVENT_EOF) {
        c->eof = true;
        if (c->req || c->state == CONN_LINGER)
            conn_close(c, c->req ? "the client closed the connection" : NULL);
        else if (evbuffer_get_length(bufferevent_get_output(bev)) == 0)
            conn_close(c, NULL);
        else if (c->state != CONN_CLOSING)
            conn_close_after_flush(c); /* it may still read */
    }
}

static void timer_cb(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    rpc_conn *c = arg;
    conn_close(c, c->state == CONN_LINGER ? NULL : "idle timeout");
}

static void resume_cb(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    rpc_conn *c = arg;
    if (c->closed) return;
    if (!c->drop) {
        conn_process(c);
        return;
    }
    char why[128];
    snprintf(why, sizeof why, "the client does not read its replies: %zu bytes unsent, limit %zu", c->drop_queued,
             c->srv->cfg.max_out_bytes);
    if (c->req) {
        conn_close(c, why); /* logs it as the request's end */
        return;
    }
    LOG_INFOF("http_dropped peer=%s reason=\"%s\"", c->peer, why);
    conn_close(c, NULL);
}

/* The listener's address arrives as a plain sockaddr: copied into storage
 * of the right alignment before reading the family's fields. */
static void peer_text(const struct sockaddr *sa, int salen, char *out, size_t cap) {
    char ip[INET6_ADDRSTRLEN] = "?";
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    memcpy(&ss, sa, salen > 0 && (size_t)salen <= sizeof ss ? (size_t)salen : 0);
    if (ss.ss_family == AF_INET) {
        struct sockaddr_in in;
        memcpy(&in, &ss, sizeof in);
        inet_ntop(AF_INET, &in.sin_addr, ip, sizeof ip);
        snprintf(out, cap, "%s:%d", ip, ntohs(in.sin_port));
    } else if (ss.ss_family == AF_INET6) {
        struct sockaddr_in6 in6;
        memcpy(&in6, &ss, sizeof in6);
        inet_ntop(AF_INET6, &in6.sin6_addr, ip, sizeof ip);
        snprintf(out, cap, "[%s]:%d", ip, ntohs(in6.sin6_port));
    } else {
        snprintf(out, cap, "?");
    }
}

static void accept_cb(struct evconnlistener *lis, evutil_socket_t fd, struct sockaddr *sa, int salen, void *arg) {
    (void)lis, (void)salen;
    http_server *s = arg;
    char peer[HTTP_PEER_MAX];
    peer_text(sa, salen, peer, sizeof peer);
    bool full = s->n_conns >= s->cfg.max_conns;
    if (full && s->n_closing >= s->cfg.max_conns) {
        /* Refusals are bounded too: past this, not even a 429. */
        LOG_INFOF("http_refused status=none peer=%s reason=\"%d connections open and %d closing\"", peer, s->n_conns,
                  s->n_closing);
        evutil_closesocket(fd);
        return;
    }
    rpc_conn *c = calloc(1, sizeof *c);
    if (c) {
        c->bev = bufferevent_socket_new(s->base, fd, BEV_OPT_CLOSE_ON_FREE);
        c->timer = evtimer_new(s->base, timer_cb, c);
        c->resume = event_new(s->base, -1, 0, resume_cb, c);
    }
    if (!c || !c->bev || !c->timer || !c->resume) {
        LOG_ERRORF("http_out_of_memory peer=%s", peer);
        if (c && c->timer) event_free(c->timer);
        if (c && c->resume) event_free(c->resume);
        if (c && c->bev)
            bufferevent_free(c->bev);
        else
            evutil_closesocket(fd);
        free(c);
        return;
    }
    memcpy(c->peer, peer, sizeof c->peer);
    c->srv = s;
    c->state = CONN_HEAD;
    c->next = s->conns;
    if (s->conns) s->conns->prev = c;
    s->conns = c;
    c->counted = !full;
    if (full)
        s->n_closing++;
    else
        s->n_conns++;
    if (sa->sa_family == AF_INET || sa->sa_family == AF_INET6) {
        int one = 1; /* SSE events go out as they are written */
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    /* Input waiting while a request is handled (pipelining) is bounded by
     * one whole request; past it, reading pauses until it is served. */
    size_t high = s->cfg.max_head_bytes + s->cfg.max_body_bytes;
    if (high < s->cfg.max_body_bytes) high = SIZE_MAX;
    bufferevent_setwatermark(c->bev, EV_READ, 0, high);
    bufferevent_setcb(c->bev, on_read, on_write, on_event, c);
    bufferevent_enable(c->bev, EV_READ | EV_WRITE);
    if (full) {
        char why[96];
        snprintf(why, sizeof why, "%d connections open (the limit)", s->cfg.max_conns);
        conn_refuse(c, 429, why);
        return;
    }
    timer_arm(c, s->cfg.idle_timeout_ms);
}

static void accept_pause_cb(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    http_server *s = arg;
    evconnlistener_enable(s->listener);
}

static void accept_error_cb(struct evconnlistener *lis, void *arg) {
    http_server *s = arg;
    int e = EVUTIL_SOCKET_ERROR();
    LOG_WARNF("http_accept_error port=%d reason=\"%s\"", http_server_port(s), evutil_socket_error_to_string(e));
    /* Out of descriptors: the listener stays readable, so without a pause
     * the loop would spin on it. */
    evconnlistener_disable(lis);
    struct timeval tv = {0, HTTP_ACCEPT_PAUSE_MS * 1000};
    evtimer_add(s->accept_pause, &tv);
}

static int check_config(const http_config *cfg, ae_error *err) {
    if (!cfg->handler) return err_set(err, "http: no handler");
    if (cfg->port < 0 || cfg->port > 65535) return err_set(err, "http: port %d is out of range", cfg->port);
    if (cfg->max_conns <= 0) return err_set(err, "http: max_conns must be positive (is %d)", cfg->max_conns);
    if (cfg->max_head_bytes < 64)
        return err_set(err, "http: max_head_bytes must be at least 64 (is %zu)", cfg->max_head_bytes);
    if (cfg->max_out_bytes == 0) return err_set(err, "http: max_out_bytes must be positive");
    if (cfg->idle_timeout_ms < 0)
        return err_set(err, "http: idle_timeout_ms must be 0 (none) or positive (is %d)", cfg->idle_timeout_ms);
    return AE_OK;
}

/* Binds host:port (host NULL or "": 127.0.0.1). idle_timeout_ms 0: no
 * idle timeout; max_body_bytes 0: no request bodies; the other limits
 * must be positive. */
int http_server_open(http_server **out, struct event_base *base, const http_config *cfg, ae_error *err) {
    *out = NULL;
    if (check_config(cfg, err) != AE_OK) return AE_ERR;
    const char *host = cfg->host && *cfg->host ? cfg->host : "127.0.0.1";
    if (strlen(host) >= HTTP_HOST_MAX) return err_set(err, "http: host name is too long");
    evutil_socket_t fd = -1;
    struct addrinfo *res = NULL;
    http_server *s = calloc(1, sizeof *s);
    if (!s) return err_set(err, "out of memory");
    s->base = base;
    s->cfg = *cfg;
    snprintf(s->host, sizeof s->host, "%s", host);
    s->cfg.host = s->host;
    char port[16];
    snprintf(port, sizeof port, "%d", cfg->port);
    struct addrinfo hints = {
        .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    int rc = getaddrinfo(host, port, &hints, &res);
    if (rc != 0) {
        err_set(err, "http: cannot resolve \"%s\": %s", host, gai_strerror(rc));
        goto fail;
    }
    fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        err_set(err, "http: socket: %s", strerror(errno));
        goto fail;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, res->ai_addr, res->ai_addrlen) != 0 || listen(fd, 511) != 0) {
        err_set(err, "http: cannot listen on %s:%d: %s", host, cfg->port, strerror(errno));
        goto fail;
    }
    s->accept_pause = evtimer_new(base, accept_pause_cb, s);
    s->listener = s->accept_pause
                      ? evconnlistener_new(base, accept_cb, s, LEV_OPT_CLOSE_ON_FREE | LEV_OPT_CLOSE_ON_EXEC, -1, fd)
                      : NULL;
    if (!s->listener) {
        err_set(err, "http: libevent cannot listen on %s:%d", host, cfg->port);
        goto fail;
    }
    evconnlistener_set_error_cb(s->listener, accept_error_cb);
    freeaddrinfo(res);
    LOG_INFOF("http_listening host=%s port=%d max_conns=%d max_head_bytes=%zu max_body_bytes=%zu "
              "max_out_bytes=%zu idle_timeout_ms=%d",
              host, http_server_port(s), cfg->max_conns, cfg->max_head_bytes, cfg->max_body_bytes, cfg->max_out_bytes,
              cfg->idle_timeout_ms);
    *out = s;
    return AE_OK;
fail:
    if (fd >= 0) evutil_closesocket(fd);
    if (s->accept_pause) event_free(s->accept_pause);
    if (res) freeaddrinfo(res);
    free(s);
    return AE_ERR;
}

void http_server_close(http_server *s) {
    if (!s) return;
    evconnlistener_free(s->listener);
    event_free(s->accept_pause);
    while (s->conns) conn_close(s->conns, "the server is closing");
    free(s);
}

int http_server_port(const http_server *s) {
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (getsockname(evconnlistener_get_fd(s->listener), (struct sockaddr *)&ss, &len) != 0) return 0;
    return ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                    : ntohs(((struct sockaddr_in *)&ss)->sin_port);
}

int http_server_conns(const http_server *s) { return s->n_conns; }

const http_head *http_req_head(const http_req *r) { return &r->head; }

const char *http_req_body(const http_req *r, size_t *len) {
    if (len) *len = r->body_len;
    return r->body ? r->body : "";
}

const char *http_req_peer(const http_req *r) { return r->peer; }

void http_req_on_close(http_req *r, void (*fn)(void *arg), void *arg) {
    r->on_close = fn;
    r->on_close_arg = arg;
    if (!r->c && fn) fn(arg);
}

bool http_req_gone(const http_req *r) { return !r->c || r->c->drop; }

/* The handler is done with r: the connection goes on with its next
 * request (keep_alive) or closes once the reply is sent. */
static void req_finish(http_req *r, bool keep_alive) {
    rpc_conn *c = r->c;
    AE_ASSERT(!c || c->req == r);
    req_free(r);
    if (!c) return;
    c->req = NULL;
    if (c->drop) return;
    if (!keep_alive) {
        conn_close_after_flush(c);
        return;
    }
    c->state = CONN_HEAD;
    timer_arm(c, c->srv->cfg.idle_timeout_ms);
    /* Pipelined requests already read: served from the loop, not from
     * under this call (unless conn_process is below us and goes on). */
    if (c->depth == 0 && evbuffer_get_length(bufferevent_get_input(c->bev)) > 0) event_active(c->resume, EV_TIMEOUT, 1);
}

static bool status_has_body(int status) { return status >= 200 && status != 204 && status != 304; }

void http_respond(http_req *r, int status, const char *content_type, const char *extra_headers, const void *body,
                  size_t len) {
    AE_ASSERT(r && !r->started);
    AE_ASSERT(body || len == 0);
    rpc_conn *c = r->c;
    bool keep_alive = false;
    if (c && !c->drop) {
        struct evbuffer *out = bufferevent_get_output(c->bev);
        size_t before = evbuffer_get_length(out);
        bool has_body = status_has_body(status);
        keep_alive = r->head.keep_alive;
        put_head(out, status, content_type, extra_headers, has_body ? FRAMING_LENGTH : FRAMING_NONE, len, keep_alive);
        if (has_body && len && strcmp(r->head.method, "HEAD") != 0) evbuffer_add(out, body, len);
        /* A whole reply may be large; what counts is what the client left
         * unread before it. */
        conn_check_out(c, evbuffer_get_length(out) - before);
    }
    req_finish(r, keep_alive);
}

void http_stream_start(http_req *r, int status, const char *content_type, const char *extra_headers) {
    AE_ASSERT(r && !r->started);
    r->started = true;
    r->no_body = !status_has_body(status) || strcmp(r->head.method, "HEAD") == 0;
    /* HTTP/1.0 has no chunked encoding: the end of the connection ends the reply. */
    r->chunked = r->head.minor >= 1;
    rpc_conn *c = r->c;
    if (!c || c->drop) return;
    struct evbuffer *out = bufferevent_get_output(c->bev);
    size_t before = evbuffer_get_length(out);
    framing f = r->no_body ? FRAMING_NONE : r->chunked ? FRAMING_CHUNKED : FRAMING_NONE;
    bool keep_alive = r->head.keep_alive && (r->chunked || r->no_body);
    put_head(out, status, content_type, extra_headers, f, 0, keep_alive);
    conn_check_out(c, evbuffer_get_length(out) - before);
}

/* Writes iov straight to the socket when nothing is queued before it and
 * queues what the socket did not take. A queued write costs a loop wakeup
 * and two epoll changes, for every streamed token; most chunks fit the
 * socket's buffer at once. */
static void send_or_queue(rpc_conn *c, struct iovec *iov, int n) {
    struct evbuffer *out = bufferevent_get_output(c->bev);
    size_t sent = 0;
    if (evbuffer_get_length(out) == 0) {
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t k = sendmsg(bufferevent_getfd(c->bev), &m, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (k > 0) sent = (size_t)k; /* an error is met again, and reported, by the queued write */
    }
    for (int i = 0; i < n; i++) {
        size_t skip = sent < iov[i].iov_len ? sent : iov[i].iov_len;
        sent -= skip;
        if (iov[i].iov_len > skip) evbuffer_add(out, (const char *)iov[i].iov_base + skip, iov[i].iov_len - skip);
    }
}

int http_stream_write(http_req *r, const void *data, size_t len) {
    AE_ASSERT(r && r->started);
    AE_ASSERT(data || len == 0);
    rpc_conn *c = r->c;
    if (!c || c->drop) return AE_ERR;
    if (len == 0 || r->no_body) return AE_OK; /* an empty chunk would end the stream */
    char size[24];
    int sn = snprintf(size, sizeof size, "%zx\r\n", len);
    struct iovec iov[3] = {{size, (size_t)sn}, {(void *)(uintptr_t)data, len}, {(void *)(uintptr_t)"\r\n", 2}};
    if (r->chunked)
        send_or_queue(c, iov, 3);
    else
        send_or_queue(c, iov + 1, 1);
    return conn_check_out(c, 0) ? AE_OK : AE_ERR;
}

void http_stream_end(http_req *r) {
    AE_ASSERT(r && r->started);
    rpc_conn *c = r->c;
    bool keep_alive = false;
    if (c && !c->drop) {
        if (r->chunked && !r->no_body) put_str(bufferevent_get_output(c->bev), "0\r\n\r\n");
        keep_alive = r->head.keep_alive && (r->chunked || r->no_body);
    }
    req_finish(r, keep_alive);
}
