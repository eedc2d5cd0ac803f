/* aerie-gateway's HTTP API: OpenAI's chat and completions (streamed as
 * server-sent events or whole), models, health, metrics, server_info,
 * tokenize and detokenize, on the RPC link to the target replicas
 * (router.h).
 *
 * A generation request is parsed (oai.h), rendered with the model's chat
 * template and tokenized here, checked against the context length and the
 * limits, and sent to the least-loaded healthy target as one Generate
 * stream. Tokens coming back are detokenized a character at a time
 * (detok.h), run through the stop strings (stop.h), and written to the
 * client as they are decided. A stop string, or a client that goes away,
 * cancels the call at the target. A target that fails mid-request is taken
 * out and the request goes on at another replica from the tokens it
 * already has (greedy output is the same; sampled output stays correctly
 * distributed).
 *
 * Everything runs on the rpc_loop's one thread: HTTP, the RPC callbacks,
 * health checks and timers, except rendering and tokenizing prompts, which
 * GATEWAY_TOK_WORKERS threads do (with parsing the body) so that a big request
 * never stalls the loop. The functions below may be called from any
 * thread. */
#ifndef AERIE_GATEWAY_GATEWAY_H
#define AERIE_GATEWAY_GATEWAY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../services/rpc/rpc.h"
#include "../services/tokenizer/chat.h"
#include "../services/tokenizer/tok.h"
#include "router.h"

#define GATEWAY_MAX_API_KEYS 64
#define GATEWAY_MAX_HEAD_BYTES (64u << 10)  /* request line and headers */
#define GATEWAY_MAX_UNSENT_BYTES (1u << 20) /* a client this far behind its stream is dropped */
/* A reply built from what a request names (/tokenize's ids,
 * /detokenize's text) is at most this long, else 413: a small body can
 * name a huge text (1 MiB of one whitespace token's id decodes to 11 MB),
 * and a whole reply is queued whatever the client reads. */
#define GATEWAY_MAX_REPLY_BYTES GATEWAY_MAX_UNSENT_BYTES
#define GATEWAY_TOK_WORKERS 2 /* threads that render and tokenize prompts */
/* What one worker holds at most for a body of b bytes, summed though
 * not all at once: the JSON tree (a cJSON node and malloc's overhead, 80
 * bytes, for every 2 bytes of "1,1,..."), the parsed request's copy of the
 * text (b), the rendered text (b plus at most 64 bytes of markers for each
 * of CHAT_MAX_MESSAGES, and the default system prompt), its ids (4 bytes
 * per byte of it) and a reply (GATEWAY_MAX_REPLY_BYTES, 1 MiB). GATEWAY_TOK_WORKERS
 * of these are what the workers hold at once, for a memory plan to add. */
#define GATEWAY_TOK_WORKER_BYTES(b) \
    (40u * (uint64_t)(b) + (uint64_t)(b) + 5u * ((uint64_t)(b) + 64u * CHAT_MAX_MESSAGES + 4096u) + (1u << 20))

typedef struct gateway_config {
    const char *host;
    int port;
    const char *model_name; /* what /v1/models lists and requests must name */
    const tok *tok;
    const chat_template *chat; /* NULL: the model has none; chat requests are refused */
    router *router;
    int max_conns;
    size_t max_body_bytes;
    int max_inflight;           /* generation requests at once; beyond, 429 */
    size_t max_reply_bytes;     /* a reply that is not streamed, as it is built; beyond, 400 reply_too_large */
    int32_t max_prompt_tokens;  /* 0: the targets' context */
    int32_t max_tokens_limit;   /* largest max_tokens accepted; 0: the context */
    int32_t default_max_tokens; /* when a request gives none (capped by what the context leaves) */
    int idle_timeout_ms;
    const char *const *api_keys; /* n_api_keys == 0: no key needed */
    int n_api_keys;
    const char *config_json; /* the gateway's resolved settings, for /server_info */
    const char *memory_plan; /* its buffers' worst case as arithmetic, for /server_info */
    int log_interval_ms;     /* 0: no periodic load line */
} gateway_config;

typedef struct gateway gateway;

/* Starts serving on cfg->host:cfg->port. The config's strings, tokenizer,
 * template and router must outlive the gateway. */
int gateway_open(gateway **out, rpc_loop *loop, const gateway_config *cfg, ae_error *err);
/* From now on generation requests are answered 503 and /health is 503. */
void gateway_set_draining(gateway *g);
/* Generation requests in flight now. */
int gateway_inflight(gateway *g);
int gateway_port(gateway *g);
/* Stops serving HTTP: every connection closes, and requests in flight are
 * cancelled at their targets. Waits for the tokenizer workers' jobs to end
 * (they may read the router). Calls end later (or when the router
 * closes): free the gateway only after router_close. */
void gateway_close(gateway *g); /* NULL is a no-op */
void gateway_free(gateway *g);  /* NULL is a no-op; closes first if needed */

#endif
