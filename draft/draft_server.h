/* aerie-draft's service: Draft.Propose, Release, Info and Health over the
 * RPC link, on one drafter shared by every target that connects.
 *
 * State is kept per (client, sequence id): a client is a target's random
 * 64-bit id, so a target that reconnects finds its sequences again. The
 * drafter has max_keys slots (each holds up to max_seq_len pairs of head
 * KV, reserved at start: the memory bound); a new sequence takes a free
 * slot or evicts the least recently used one. A sequence whose state is
 * gone (evicted, never seen, longer than max_seq_len, or holding another
 * count than the client believes) is answered SEQ_STATE_GONE without a
 * tree; the client re-primes it with reset and recent pairs. The other
 * sequences of the call are served.
 *
 * Propose and Release run one at a time, in arrival order: on the event
 * loop itself when nothing else is pending (a hand-off to another thread
 * costs about as much as the rest of the link: 445 -> 301 us p50 per
 * Propose over a Unix socket in aerie bench-rpc), else queued for a worker
 * thread. Info and Health wait at most one Propose. The worker waits on
 * a condition variable of its own, so a call served on the loop wakes
 * nothing; idle, it sleeps until work comes (or beats systemd's watchdog
 * every interval/4, draft_server_watch). */
#ifndef AERIE_DRAFT_DRAFT_SERVER_H
#define AERIE_DRAFT_DRAFT_SERVER_H

#include <stdint.h>

#include "../services/core/watchdog.h"
#include "../services/rpc/rpc.h"
#include "drafter.h"
#include "eagle.h"

/* Pairs one head pass takes: the target's prefill chunk
 * (target/setup.h), so that a chunk's pairs go in one pass. */
#define DRAFT_SERVER_PASS_PAIRS 256

typedef struct draft_server_config {
    int32_t max_keys;    /* sequences held at once (LRU beyond) */
    int32_t max_seq_len; /* pairs one sequence may hold */
    int32_t max_tokens;  /* pairs in one head pass */
    int32_t threads;
    int32_t act_bits; /* the head's activation precision, 15 or 8 (0: 15; drafter.h) */
} draft_server_config;

typedef struct draft_server_stats {
    uint64_t calls;      /* Propose calls answered OK */
    uint64_t seqs;       /* sequences in them */
    uint64_t trees;      /* trees drafted */
    uint64_t pairs;      /* pairs fed */
    uint64_t state_gone; /* sequences answered SEQ_STATE_GONE */
    uint64_t evictions;  /* slots taken from the least recently used sequence */
    uint64_t errors;     /* calls answered with an error status */
    uint64_t busy_ns;    /* time in the drafter */
    int32_t keys_used;
} draft_server_stats;

typedef struct draft_server draft_server;

/* h must outlive the service. */
int draft_server_init(draft_server **out, const eagle_head *h, const draft_server_config *cfg, ae_error *err);
/* Finishes queued calls with UNAVAILABLE, stops the worker, frees. */
void draft_server_free(draft_server *d); /* NULL is a no-op */

/* Puts the worker under systemd's watchdog w (it beats every interval/4
 * while idle); without it the idle worker sleeps until work comes. w
 * must outlive the service; draft_server_free joins the worker first. */
void draft_server_watch(draft_server *d, watchdog *w);

/* What Info serves: the resolved config (JSON) and the memory plan. */
void draft_server_set_info(draft_server *d, const char *config_json, const char *memory_plan);

/* The RPC handler (rpc_server_config.handler, ctx = d). */
void draft_server_handle(void *ctx, rpc_call *call, const rpc_request *req);

/* Stops admitting work: new calls end UNAVAILABLE; waits until the
 * queued ones are done. */
void draft_server_drain(draft_server *d);

draft_server_stats draft_server_get_stats(draft_server *d);

/* Bytes the service takes beyond the head's weights, in the memory of the
 * head's backend: the drafter, and on a host-memory backend its message
 * buffers too. */
size_t draft_server_bytes(const eagle_head *h, const draft_server_config *cfg);
/* What it takes in host memory besides, when the head is on a device (0
 * on a host-memory backend, where draft_server_bytes counts it). Features sent as
 * f16 are widened into a buffer that grows to the largest call, up to
 * twice --max-frame-mib, not counted here. */
size_t draft_server_host_bytes(const eagle_head *h, const draft_server_config *cfg);

/* One Propose, without the link: decodes msg/payload, runs the drafter,
 * encodes the reply into out[cap]. Returns the status; on an error, errtext
 * says why and nothing changed. (The worker's body; tests call it.) */
uint32_t draft_server_propose(draft_server *d, const uint8_t *msg, uint32_t len, const uint8_t *payload,
                              uint32_t payload_len, uint8_t *out, uint32_t cap, uint32_t *out_len, ae_error *errtext);

#endif
