/* The RPC link: calls between the services over TCP or Unix sockets,
 * optionally TLS 1.3 (OpenSSL) with client certificates, on libevent.
 *
 * One connection carries many calls at once, each named by a call id
 * (frame.h): unary calls (REQUEST -> REPLY) and server streams (REQUEST ->
 * ITEM* -> END). A caller may CANCEL a call; a request may carry a timeout
 * after which the server ends it with DEADLINE_EXCEEDED. Clients send PING
 * frames while idle and drop a connection whose PONG does not come.
 *
 * Threads: an rpc_loop runs one event loop on its own thread; the
 * sockets' reads happen there, except that a blocking unary call on a
 * plain socket reads its own reply on the calling thread (and on a Unix
 * socket the loop leaves such replies to their callers and is not woken
 * by them). Server handlers are called on the loop and must
 * not block: they hand work to other threads, which finish the call from
 * there (the finishing functions take any thread). Client calls block the
 * calling thread, never the loop's.
 *
 * Faults: a frame that cannot be trusted (bad magic or header, another
 * contract version, over the size limit) is answered with an error where
 * the peer can read one, and the connection closes; the other connections
 * carry on. A bad message inside a good frame (unknown method, invalid
 * protobuf, bad values) is the handler's to answer with an error status;
 * the connection stays. Every receive buffer is bounded by the frame
 * limit; what a server queues for a peer is bounded by RPC_OUT_PAUSE_BYTES
 * (it stops reading) and max_out_bytes (it drops the peer). */
#ifndef AERIE_RPC_RPC_H
#define AERIE_RPC_RPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/err.h"
#include "frame.h"

struct event_base;

#define RPC_DEFAULT_MAX_FRAME (64u << 20)
#define RPC_KEEPALIVE_MS 5000 /* a PING after this long without a frame from the peer */
#define RPC_BACKOFF_MIN_MS 50 /* reconnect backoff: doubles up to the max */
#define RPC_BACKOFF_MAX_MS 2000
/* A server closes a connection that has not finished its TLS handshake and
 * sent one whole frame this long after accept: a silent peer must not hold
 * one of max_conns. */
#define RPC_HANDSHAKE_MS 5000
/* Then it closes one silent this long with no call open. Clients ping
 * after RPC_KEEPALIVE_MS without a frame, so twice that plus a margin
 * never races a live client's ping. */
#define RPC_IDLE_MS (2 * RPC_KEEPALIVE_MS + 5000)
/* A server stops reading from a peer that leaves this much unsent (it
 * resumes below half), and drops one that leaves more than max_out_bytes
 * beyond the frame being sent. */
#define RPC_OUT_PAUSE_BYTES (4u << 20)
#define RPC_DEFAULT_MAX_OUT (64u << 20)

typedef struct rpc_loop rpc_loop;

int rpc_loop_start(rpc_loop **out, ae_error *err);
/* Closes every server and client on the loop, then stops and frees it. */
void rpc_loop_free(rpc_loop *l); /* NULL is a no-op */

/* Runs fn(arg) on the loop's thread and returns once it has run (at once
 * when called from that thread). */
void rpc_loop_run(rpc_loop *l, void (*fn)(void *), void *arg);
/* The loop's event_base, for other libevent users sharing the thread (the
 * gateway's HTTP server and timers). Touch it only on the loop thread. */
struct event_base *rpc_loop_base(rpc_loop *l);

/* TLS settings. A server uses TLS when cert and key are set; it then
 * demands a client certificate signed by ca when ca is set (mutual TLS).
 * A client uses TLS when ca is set (the server's certificate must chain
 * to it) and presents cert/key when they are set. TLS 1.3 only. */
typedef struct rpc_tls {
    const char *cert, *key, *ca;
} rpc_tls;

/* Addresses: "unix:/path/to.sock", or "host:port" / "[v6]:port" (TCP).
 * On a Unix socket each side checks the other's user (SO_PEERCRED): a
 * server refuses a peer that is neither its own user nor root, and a client
 * refuses a server socket that is neither, so another local user can
 * neither talk to a service nor pose as one. */

/* The default address of a service's Unix socket: "unix:DIR/NAME" in a
 * runtime directory only this user may enter: $XDG_RUNTIME_DIR/aerie, else
 * /run/aerie for root, else /tmp/aerie-UID (never a shared directory such
 * as /tmp itself, where another user could take the path first). With
 * create, DIR is made (mode 0700) when missing. A DIR that exists must be
 * a directory (not a link) of this user with no access for others. */
int rpc_default_addr(char *out, size_t cap, const char *name, bool create, ae_error *err);

/* ---- Server ---- */

typedef struct rpc_call rpc_call;

/* A request as the handler sees it. msg and payload stay valid until the
 * call is finished; the payload is 16-byte aligned. */
typedef struct rpc_request {
    uint16_t method;
    uint32_t timeout_us;
    const uint8_t *msg;
    uint32_t msg_len;
    const uint8_t *payload;
    uint32_t payload_len;
    uint64_t conn_id; /* the connection's number in this server */
} rpc_request;

/* Called on the loop thread for every request. The handler owns the call
 * and must finish it exactly once (rpc_call_finish / rpc_call_fail), from
 * any thread, also when it was cancelled. */
typedef void (*rpc_handler)(void *ctx, rpc_call *call, const rpc_request *req);

typedef struct rpc_server_config {
    const char *addr;
    rpc_tls tls;
    uint32_t max_frame; /* bytes of message plus payload; 0: RPC_DEFAULT_MAX_FRAME */
    uint32_t max_conns; /* 0: 1024 */
    rpc_handler handler;
    void *ctx;
    /* Called on the loop thread when a connection closes, after its calls
     * were marked cancelled (may be NULL). */
    void (*on_close)(void *ctx, uint64_t conn_id);
    uint32_t handshake_ms;  /* 0: RPC_HANDSHAKE_MS */
    uint32_t idle_ms;       /* 0: RPC_IDLE_MS */
    uint32_t max_out_bytes; /* 0: RPC_DEFAULT_MAX_OUT */
} rpc_server_config;

typedef struct rpc_server rpc_server;

/* Listens on cfg->addr (a stale Unix socket file is replaced). */
int rpc_server_open(rpc_server **out, rpc_loop *l, const rpc_server_config *cfg, ae_error *err);
/* Stops accepting and reading requests; gives open calls a second to end
 * as they would and peers a second to take their last replies; then
 * cancels what is left, closes every connection and frees the server once
 * handlers have finished their calls. It blocks until then: call it off
 * the loop thread, while whatever finishes the calls still runs. */
void rpc_server_close(rpc_server *s); /* NULL is a no-op */
int rpc_server_conns(rpc_server *s);  /* connections open now */
/* The TCP port listened on (the one picked for port 0); 0 for Unix. */
int rpc_server_port(rpc_server *s);

/* True once the caller cancelled, the deadline passed or the connection
 * closed: the handler should stop work and finish the call. */
bool rpc_call_cancelled(const rpc_call *c);
/* True once the request's deadline has passed (finish it
 * DEADLINE_EXCEEDED rather than CANCELLED). */
bool rpc_call_expired(const rpc_call *c);
const rpc_request *rpc_call_request(const rpc_call *c);
/* Sends one stream item (fails once the call was cancelled). */
int rpc_call_item(rpc_call *c, const void *msg, uint32_t len, ae_error *err);
/* Finishes the call: a REPLY (or an END after items) with status, message
 * and payload. The call is gone afterwards. */
void rpc_call_finish(rpc_call *c, uint32_t status, const void *msg, uint32_t len, const void *payload,
                     uint32_t payload_len);
/* Finishes the call with an error status and text. */
void rpc_call_fail(rpc_call *c, uint32_t status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Frees the request's message and payload before the call finishes, for
 * a handler that copied what it needs and keeps the call open (a long
 * stream need not hold its whole receive frame). The request's msg and
 * payload are NULL and their lengths 0 afterwards; method, timeout and
 * connection stay. Only by the call's owner, while it owns it. */
void rpc_call_release_request(rpc_call *c);

/* ---- Client ---- */

typedef struct rpc_client rpc_client;

typedef struct rpc_client_config {
    const char *addr;
    rpc_tls tls;
    uint32_t max_frame;    /* 0: RPC_DEFAULT_MAX_FRAME */
    uint32_t keepalive_ms; /* 0: RPC_KEEPALIVE_MS */
} rpc_client_config;

/* Connects in the background and reconnects with backoff whenever the
 * connection is lost. The address is resolved here, once. */
int rpc_client_open(rpc_client **out, rpc_loop *l, const rpc_client_config *cfg, ae_error *err);
void rpc_client_close(rpc_client *c); /* NULL is a no-op; pending calls end UNAVAILABLE */
bool rpc_client_connected(rpc_client *c);
/* Blocks until connected or timeout_ms passes. */
bool rpc_client_wait_connected(rpc_client *c, int64_t timeout_ms);
/* Connections made so far (reconnects included). */
uint64_t rpc_client_connects(rpc_client *c);

/* A call's outcome. The buffers grow as needed and are reused by the next
 * call with the same rpc_reply; rpc_reply_free releases them. */
typedef struct rpc_reply {
    uint32_t status;
    char error[FRAME_MAX_ERROR + 1]; /* the peer's (or the link's) text when status != OK */
    uint8_t *msg;
    uint32_t msg_len, msg_cap;
    uint8_t *payload; /* 16-byte aligned */
    uint32_t payload_len, payload_cap;
} rpc_reply;

void rpc_reply_free(rpc_reply *r);

/* Called on the loop thread with each stream item, under the client's
 * lock: it must not call into this client. Returning false cancels the
 * call. */
typedef bool (*rpc_item_fn)(void *ctx, const uint8_t *msg, uint32_t len);

/* Makes a call and waits for its end (never call from the loop thread).
 * on_item: NULL for a unary call. timeout_us 0: none; at the deadline the
 * call is cancelled and ends DEADLINE_EXCEEDED. Without a connection it
 * ends UNAVAILABLE at once. Returns out->status. */
uint32_t rpc_client_call(rpc_client *c, uint16_t method, const void *msg, uint32_t len, const void *payload,
                         uint32_t payload_len, uint32_t timeout_us, rpc_item_fn on_item, void *item_ctx,
                         rpc_reply *out);

/* The same with the payload in pieces, sent back to back (no staging copy). */
typedef struct rpc_iov {
    const void *base;
    uint32_t len;
} rpc_iov;
uint32_t rpc_client_callv(rpc_client *c, uint16_t method, const void *msg, uint32_t len, const rpc_iov *payload,
                          int n_payload, uint32_t timeout_us, rpc_item_fn on_item, void *item_ctx, rpc_reply *out);

/* The same without waiting, from any thread (the gateway's event loop,
 * the target's scheduler sending Release): on_item for each stream item
 * and on_end once with the outcome, both on the loop thread, possibly
 * before this returns; ctx goes to both. on_item runs under the client's lock
 * and must not call into this client; on_end may. Fails at once (and
 * calls nothing) when not connected. timeout_us 0: none; at the deadline
 * the call ends DEADLINE_EXCEEDED and is cancelled at the server. */
typedef void (*rpc_end_fn)(void *ctx, const rpc_reply *r);
int rpc_client_start(rpc_client *c, uint16_t method, const void *msg, uint32_t len, const rpc_iov *payload,
                     int n_payload, uint32_t timeout_us, rpc_item_fn on_item, rpc_end_fn on_end, void *ctx,
                     uint32_t *call_id, ae_error *err);
/* Asks the server to cancel a started call; its on_end still comes (with
 * the server's status, normally CANCELLED). */
void rpc_client_cancel(rpc_client *c, uint32_t call_id);

#endif
