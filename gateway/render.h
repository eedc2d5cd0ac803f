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
    const char *id;      /* "chatcmpl-..." or "cmpl-..." */
    bool chat;           /* chat.completion(.chunk), else text_completion */
    int64_t created;     /* unix seconds */
    const char *model;
} render_meta;

/* "stop" or "length" for an aerie_FinishReason. */
const char *render_finish_name(int finish);

/* The start every streamed chunk of the response shares: "data: {" up to
 * and including the model. */
void render_chunk_head(jbuf *b, const render_meta *m);

/* One streamed chunk after head: text (or, for chat with role, the opening
 * assistant role), and the finish reason or null. include_usage: the
 * client asked for usage, so every chunk carries "usage": null. */
void render_chunk(jbuf *b, const jbuf *head, bool chat, const char *text, size_t n, bool role, const char *finish,
                  bool include_usage);

/* The last chunk of a stream that asked for usage: no choices, the usage. */
void render_usage_chunk(jbuf *b, const jbuf *head, int32_t prompt_tokens, int32_t completion_tokens);

/* A whole (non-streamed) completion of text[0..n). */
void render_completion(jbuf *b, const render_meta *m, const char *text, size_t n, const char *finish,
                       int32_t prompt_tokens, int32_t completion_tokens);

/* A stream's end on an error: the error object as an event, then [DONE]. */
void render_error_event(jbuf *b, const char *error_json);

/* One /v1/models entry, or (list) the list holding it. */
void render_model(jbuf *b, const char *name, int64_t created, int32_t max_model_len, bool list);

#endif
