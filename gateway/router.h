/* The target replicas behind a gateway, and their health.
 *
 * Every health interval each replica is asked Health, then Info; a
 * replica is healthy while it is connected and its last Health said
 * serving. Info gives its load (running and waiting requests, KV blocks)
 * and its settings, among them its context length (max-seq-len) and its
 * draft service (draft-addr), whose Info the router then polls too, for
 * /server_info.
 *
 * A request goes to the healthy replica with the fewest of this gateway's
 * requests in flight; ties go to the one that reported the shorter queue,
 * then round robin. A replica whose call fails as unavailable is taken out
 * at once (router_fail) and comes back when a health check passes.
 *
 * Everything here runs on the rpc_loop's thread. */
#ifndef AERIE_GATEWAY_ROUTER_H
#define AERIE_GATEWAY_ROUTER_H

#include <stdbool.h>
#include <stdint.h>

#include "../services/rpc/rpc.h"
#include "metrics.h"

#define ROUTER_MAX_TARGETS 32

typedef struct router router;

typedef struct router_config {
    const char *const *addrs; /* target addresses */
    int n_addrs;
    rpc_tls tls; /* for targets and drafts alike */
    uint32_t max_frame;
    int health_interval_ms;
} router_config;

int router_open(router **out, rpc_loop *l, const router_config *cfg, ae_error *err);
void router_close(router *r); /* NULL is a no-op; on the loop thread */

int router_count(const router *r);
/* The least-loaded healthy replica not in `exclude` (bit i: replica i), or
 * -1 when there is none. */
int router_pick(router *r, uint64_t exclude);
rpc_client *router_client(router *r, int i);
const char *router_addr(const router *r, int i);
void router_begin(router *r, int i); /* a request starts on replica i */
void router_end(router *r, int i);   /* ... and ends */
/* Takes replica i out until a health check passes. */
void router_fail(router *r, int i, const char *why);

/* Healthy replicas now. When none, why: the reason of each, joined. */
int router_healthy(const router *r, char *why, size_t cap);
/* The smallest context length (max-seq-len) among replicas that reported
 * one; 0 before any did. */
int32_t router_context(const router *r);

/* Gauges for /metrics, one per replica (targets must hold router_count). */
void router_gauges(const router *r, metrics_target *targets);

/* {"targets": [...], "drafts": [...]} with each one's address, health and
 * latest Info (settings, memory plan, live figures), malloc'd. */
char *router_info_json(const router *r); /* NULL: out of memory */

#endif
