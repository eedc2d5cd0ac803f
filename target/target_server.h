/* aerie-target's service: Target.Generate (a server stream of token
 * events), Cancel, Info and Health over the RPC link, on the scheduler
 * (sched.h). Requests are checked here like all input from the network:
 * a bad one is answered with INVALID_ARGUMENT and nothing else changes.
 * A running Generate keeps a copy of its prompt, not the frame it came in
 * (rpc_call_release_request), so a large payload is freed at submit. */
#ifndef AERIE_TARGET_TARGET_SERVER_H
#define AERIE_TARGET_TARGET_SERVER_H

#include "../services/rpc/rpc.h"
#include "draft_client.h"
#include "sched.h"

typedef struct target_server target_server;

/* The scheduler's sink: target_server_init fills it; pass it to sched_init, then
 * target_server_attach the scheduler. draft may be NULL (no draft service). */
int target_server_init(target_server **out, int32_t vocab, draft_client *draft, spec *sx, sched_sink *sink,
                       ae_error *err);
void target_server_attach(target_server *t, sched *s);
void target_server_free(target_server *t); /* NULL is a no-op */

void target_server_set_info(target_server *t, const char *config_json, const char *memory_plan);
/* Health answers "not serving: shutting down" from now on. */
void target_server_set_draining(target_server *t);

/* The RPC handler (rpc_server_config.handler, ctx = t). */
void target_server_handle(void *ctx, rpc_call *call, const rpc_request *req);

#endif
