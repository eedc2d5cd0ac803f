/* The RPC link's insides, shared by its four parts: the loop
 * (rpc_loop.c), addresses, TLS and connections (rpc_conn.c), the server
 * (rpc_server.c) and the client (rpc_client.c). rpc.h is the interface;
 * nothing outside services/rpc/ includes this. */
#ifndef AERIE_RPC_RPC_CONN_H
#define AERIE_RPC_RPC_CONN_H

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

#include "rpc.h"

/* Bytes one read or write callback moves at most: a Propose of 8
 * sequences x 8 pairs carries about 450 KB of features. */
#define RPC_IO_CHUNK (1 << 20)
#define RPC_RX_STEP (1 << 20) /* receive buffer reserved ahead of the bytes that came */

struct rpc_loop {
    struct event_base *base;
    struct event *keep; /* keeps the loop alive with nothing else to do */
    pthread_t thread;
};

typedef struct rpc_addr {
    struct sockaddr_storage sa;
    socklen_t len;
    bool is_unix;
    char host[256]; /* for the TLS peer check */
} rpc_addr;

typedef struct rpc_conn rpc_conn;

struct rpc_call {
    rpc_conn *c;
    rpc_server *srv; /* counts the call until it is finished */
    uint32_t id;
    atomic_bool cancelled;
    atomic_bool server_closing; /* cancelled by rpc_server_close, not by the peer */
    bool streamed;
    bool finished;       /* a REPLY or END went out (the deadline may send one first) */
    int64_t deadline_ns; /* 0: none */
    rpc_request req;     /* msg and payload point into buf */
    uint8_t *buf;
    size_t buf_cap;
    rpc_call *prev, *next; /* the connection's open calls */
};

struct rpc_conn {
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
    bool direct; /* a plain socket: bodies are read straight into rx */
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
    rpc_conn *next; /* the server's connections */
};

/* ---- rpc_conn.c ---- */

/* "unix:PATH" or "HOST:PORT" into a. */
int rpc_addr_parse(const char *text, rpc_addr *a, ae_error *err);
/* A TLS context for t (server: its certificate, and the CA client
 * certificates must chain to; client: the CA the server's must chain to,
 * and its own certificate for mutual TLS). */
SSL_CTX *rpc_tls_ctx(const rpc_tls *t, bool server, ae_error *err);
/* A connected bufferevent's reads, writes and socket buffers of up to
 * RPC_IO_CHUNK, and TCP_NODELAY on TCP. */
void rpc_tune_bev(struct bufferevent *bev, bool tcp);
/* Unix sockets: the peer must run as this user or as root. */
bool rpc_peer_uid_ok(evutil_socket_t fd, unsigned *peer_uid);
/* The monotonic clock ns from now, for the condition variables' waits. */
struct timespec rpc_abs_after_ns(int64_t ns);

void rpc_conn_unref(rpc_conn *c);
/* Sends one frame: h, then msg, then parts (any thread). */
int rpc_conn_sendv(rpc_conn *c, const frame_header *h, const void *msg, uint32_t len, const rpc_iov *parts,
                   int n_parts);
int rpc_conn_send(rpc_conn *c, const frame_header *h, const void *msg, uint32_t len, const void *payload,
                  uint32_t payload_len);
/* An error frame of kind for call_id, with status and text. */
void rpc_send_error(rpc_conn *c, uint8_t kind, uint32_t call_id, uint32_t status, const char *text);
void rpc_conn_close(rpc_conn *c);
/* rx holds the first `upto` bytes of the current frame's body (after the
 * pad that aligns its payload), keeping what was read; false: out of
 * memory. */
bool rpc_conn_rx_reserve(rpc_conn *c, size_t upto);
/* Reads the rest of the current frame's body from a plain socket: 1 whole,
 * 0 more to come, -1 the peer hung up mid-frame (under the bufferevent's
 * lock). */
int rpc_conn_read_body(rpc_conn *c, evutil_socket_t fd, size_t need);
void rpc_conn_close_after_flush(rpc_conn *c);
/* The bufferevent callbacks of every connection. */
void rpc_conn_on_read(struct bufferevent *bev, void *arg);
void rpc_conn_on_write(struct bufferevent *bev, void *arg);
void rpc_conn_on_event(struct bufferevent *bev, short what, void *arg);

/* ---- rpc_server.c and rpc_client.c: what a connection hands its side ---- */

void rpc_server_conn_closed(rpc_conn *c);
void rpc_server_frame(rpc_conn *c, const uint8_t *msg, const uint8_t *payload);
void rpc_client_conn_closed(rpc_conn *c);
void rpc_client_frame(rpc_conn *c, const uint8_t *msg, const uint8_t *payload);

#endif
