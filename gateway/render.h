/* The OpenAI response bodies the gateway sends, written into a jbuf:
 * streamed chunks (server-sent events), whole completions, usage, error
 * events and model entries. What the request asked for and what came
 * back are the caller's; only the shape of the JSON is here. */
#ifndef AERIE_GATEWAY_RENDER_H
#define AERIE_GATEWAY_RENDER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "jbuf.h"

/* What every body of one response names. */
typedef struct render_meta {
    const char *id;  /* "chatcmpl-..." or "cmpl-..." */
    bool chat;       /* chat.completion(.chunk), else text_completion */
    int64_t created; /* unix seconds */
    const char *model;
} render_meta;

/* Log-probabilities of the tokens of a chunk or of a whole completion, in
 * OpenAI's shape: chat's {"content": [{token, logprob, bytes,
 * top_logprobs}]}, or completions' {tokens, token_logprobs,
 * top_logprobs, text_offset}. A token is named by its text (invalid UTF-8
 * replaced by U+FFFD) and, for chat, its exact bytes. -inf, which JSON
 * cannot hold, is written -9999.0 as OpenAI does. */
typedef struct render_top {
    const uint8_t *bytes;
    size_t len;
    float logprob;
} render_top;

typedef struct render_lp {
    bool chat;
    int n;                           /* tokens held */
    jbuf content;                    /* chat: the entries */
    jbuf tokens, lps, tops, offsets; /* completions: the four lists */
} render_lp;

void render_lp_add(render_lp *l, const uint8_t *bytes, size_t len, float logprob, const render_top *top, int n_top,
                   int64_t text_offset);
/* The object of what l holds. */
void render_lp_json(jbuf *b, const render_lp *l);
/* The bytes l's entries take in render_lp_json (which writes them and a
 * fixed frame): it grows by as much as they do. */
size_t render_lp_bytes(const render_lp *l);
void render_lp_clear(render_lp *l); /* empty, for the next chunk */
void render_lp_free(render_lp *l);

/* "stop", "length" or "tool_calls" for an aerie_FinishReason or
 * RENDER_FINISH_TOOL_CALLS (a gateway-side reason: the reply is calls). */
#define RENDER_FINISH_TOOL_CALLS 100
const char *render_finish_name(int finish);

/* The start every streamed chunk of the response shares: "data: {" up to
 * and including the model. */
void render_chunk_head(jbuf *b, const render_meta *m);

/* One streamed chunk of choice `index` after head: text (or, for chat with role, the opening
 * assistant role), its tokens' log-probabilities (NULL: null), and the
 * finish reason or null. include_usage: the client asked for usage, so
 * every chunk carries "usage": null. */
void render_chunk(jbuf *b, const jbuf *head, bool chat, int32_t index, const char *text, size_t n, bool role,
                  const render_lp *lp, const char *finish, bool include_usage);

/* The last chunk of a stream that asked for usage: no choices, the usage. */
void render_usage_chunk(jbuf *b, const jbuf *head, int32_t prompt_tokens, int32_t completion_tokens);

/* One choice of a whole completion: text[0..n), its tokens'
 * log-probabilities (NULL: null) and finish reason. */
typedef struct render_choice {
    const char *text; /* NULL with tool_calls: content null */
    size_t n;
    const render_lp *lp;
    const char *finish;
    const char *tool_calls; /* chat: the message's tool_calls (a JSON list), or NULL */
} render_choice;

/* A streamed chunk of choice index whose delta is tool_calls (a JSON
 * list whose entries carry their "index"). */
void render_tool_chunk(jbuf *b, const jbuf *head, int32_t index, const char *tool_calls, bool include_usage);

/* A whole (non-streamed) completion of choices c[0..n_choices), indexed
 * in order; completion_tokens is their sum. */
void render_completion(jbuf *b, const render_meta *m, const render_choice *c, int32_t n_choices, int32_t prompt_tokens,
                       int32_t completion_tokens);
/* What render_completion writes for its choice c at index (a comma before
 * every choice but the first): into a counter (JBUF_COUNTER), its size,
 * which with the rest of the reply's adds up to render_completion's. */
void render_completion_choice(jbuf *b, bool chat, int32_t index, const render_choice *c);

/* A stream's end on an error: the error object as an event, then [DONE]. */
void render_error_event(jbuf *b, const char *error_json);

/* One /v1/models entry, or (list) the list holding it. */
void render_model(jbuf *b, const char *name, int64_t created, int32_t max_model_len, bool list);

#endif
