/* aerie-target's service: Target.Generate (a server stream of token
 * events), Cancel, Info and Health over the RPC link, on the scheduler
 * (sched.h). Requests are checked here like all input from the network:
 * a bad one is answered with INVALID_ARGUMENT and nothing else changes.
 * A running Generate keeps a copy of its prompt, not the frame it came in
 * (rpc_call_release_request), so a large payload is freed at submit. */
#ifndef AERIE_TARGET_SERVER_H
#define AERIE_TARGET_SERVER_H

#include "../services/rpc/rpc.h"
#include "draft_client.h"
#include "sched.h"

typedef struct tsrv tsrv;

/* The scheduler's sink: tsrv_init fills it; pass it to sched_init, then
 * tsrv_attach the scheduler. draft may be NULL (no draft service). */
int tsrv_init(tsrv **out, int32_t vocab, dcli *draft, spec *sx, sched_sink *sink, ae_error *err);
void tsrv_attach(tsrv *t, sched *s);
void tsrv_free(tsrv *t); /* NULL is a no-op */

void tsrv_set_info(tsrv *t, const char *config_json, const char *memory_plan);
/* Health answers "not serving: shutting down" from now on. */
void tsrv_set_draining(tsrv *t);

/* The RPC handler (rpc_server_config.handler, ctx = t). */
void tsrv_handle(void *ctx, rpc_call *call, const rpc_request *req);

#endif
