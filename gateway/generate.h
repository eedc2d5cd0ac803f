/* The generation endpoints: a request's path from its parsed body through
 * the tokenizing worker, the target's stream and the rendered reply. */
#ifndef AERIE_GATEWAY_GENERATE_H
#define AERIE_GATEWAY_GENERATE_H

#include "gateway_internal.h"

/* POST /v1/chat/completions (OAI_CHAT) and /v1/completions
 * (OAI_COMPLETION), on the loop thread. */
void generate_handle(gateway *g, http_req *h, oai_kind kind);

#endif
