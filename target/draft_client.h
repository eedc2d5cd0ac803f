/* The target's side of the draft link: spec's drafter interface
 * (spec.h) over RPC to an aerie-draft service.
 *
 * Each step's Propose carries, per sequence, the pairs committed since the
 * last call: tokens and captured features ride in the frame's payload,
 * referenced from the message. The call has a deadline; a draft that is
 * down, slow, or answers with anything but a well-formed reply fails the
 * call, and spec decodes without a tree (the output is the same, only
 * slower) and pauses its calls. The RPC client reconnects in the
 * background, and speculation resumes once the draft answers again
 * (its state for our sequences is then gone: SEQ_STATE_GONE makes spec
 * re-prime them). */
#ifndef AERIE_TARGET_DRAFT_CLIENT_H
#define AERIE_TARGET_DRAFT_CLIENT_H

#include <stdint.h>

#include "../services/rpc/rpc.h"
#include "spec.h"

typedef struct draft_client_config {
    const char *addr;
    rpc_tls tls;
    uint32_t deadline_us; /* per Propose */
    uint32_t max_frame;
    int32_t feature_width; /* 3H */
    int32_t capture[FORWARD_MAX_CAPTURE];
    int32_t vocab;
} draft_client_config;

typedef struct draft_client_stats {
    uint64_t calls, failures, deadline_exceeded, unavailable, bad_replies, state_gone;
    uint64_t rtt_ns, server_ns; /* summed over successful calls */
    uint64_t release_failures;  /* Releases (sent without waiting) that failed or were not sent */
} draft_client_stats;

typedef struct draft_client draft_client;

int draft_client_open(draft_client **out, rpc_loop *loop, const draft_client_config *cfg, ae_error *err);
void draft_client_close(draft_client *d); /* NULL is a no-op */
const spec_drafter *draft_client_drafter(draft_client *d);
bool draft_client_connected(draft_client *d);
draft_client_stats draft_client_get_stats(draft_client *d);

#endif
