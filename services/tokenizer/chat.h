/* Chat templates without a Jinja engine.
 *
 * A model ships its prompt format as a Jinja template (GGUF
 * tokenizer.chat_template, tokenizer_config.json chat_template). We do not
 * run Jinja: we recognise the template as one of a few known ones and
 * render that family in C. Recognition is exact, not by markers: the
 * template is lexed the way Jinja lexes it (with transformers' settings,
 * trim_blocks and lstrip_blocks) and its token stream must equal a known
 * template's, up to whitespace inside tags, quote style, whitespace control
 * that changes nothing, and `a.b` versus `a['b']`. The one free part is the
 * default system prompt, which is read from the template itself. So
 * anything we accept renders byte-for-byte what transformers renders, and
 * anything else is refused with an error naming what was expected.
 *
 * Families and the templates recognised:
 *
 *   chatml  <|im_start|>{role}\n{content}<|im_end|>\n per message,
 *           <|im_start|>assistant\n as the generation prompt.
 *           - plain ChatML (no default system prompt);
 *           - "default system" ChatML (SmolLM2, Qwen2, Qwen1.5): when the
 *             first message is not a system message, a system message with
 *             the template's own default text comes first;
 *           - Qwen2.5's template, rendered without tools (same as above).
 *
 *   llama3  <|begin_of_text|> then <|start_header_id|>{role}<|end_header_id|>
 *           \n\n{content, whitespace stripped}<|eot_id|> per message,
 *           <|start_header_id|>assistant<|end_header_id|>\n\n as the
 *           generation prompt. Only the Llama-3 (3.0) Instruct template:
 *           Llama-3.1+ templates (tool and "Cutting Knowledge Date"
 *           preamble) are refused, not approximated. The rendered text
 *           starts with the BOS token's text, as transformers renders it:
 *           encode it with TOK_PARSE_SPECIAL and without TOK_ADD_BOS.
 *
 * Roles are system, user and assistant. A conversation has at least one
 * message. A handle is immutable once made: many threads may render with
 * it at once. */
#ifndef AERIE_TOKENIZER_CHAT_H
#define AERIE_TOKENIZER_CHAT_H

#include <stdbool.h>
#include <stddef.h>

#include "../core/err.h"

/* Limits, so that hostile input cannot make us allocate without bound. */
#define CHAT_MAX_TEMPLATE (1u << 20) /* bytes of template source */
#define CHAT_MAX_MESSAGES 4096u      /* messages in one conversation */
#define CHAT_MAX_CONTENT (1u << 24)  /* bytes in one message's content */
#define CHAT_MAX_JSON (1u << 26)     /* bytes of a JSON message list */

typedef struct chat_template chat_template;

/* One message. Plain data: strings are NUL-terminated UTF-8, borrowed. */
typedef struct chat_msg {
    const char *role; /* "system", "user" or "assistant" */
    const char *content;
} chat_msg;

/* Recognises src (NUL-terminated Jinja source). NULL or empty src means the
 * model has no template: an error. */
int chat_template_init(chat_template **out, const char *src, ae_error *err);

void chat_template_free(chat_template *t); /* NULL is a no-op */

/* "chatml" or "llama3". */
const char *chat_family_name(const chat_template *t);

/* The known template it matched: "chatml", "chatml-default-system",
 * "qwen2.5" or "llama3". For logs and `aerie info`. */
const char *chat_variant_name(const chat_template *t);

/* The default system prompt read from the template, or NULL if it has
 * none. */
const char *chat_default_system(const chat_template *t);

/* Renders msgs[0..n). *len_out is always set to the text's length (NUL not
 * counted) when the messages are valid. With out == NULL and cap == 0 this
 * only measures; otherwise a cap below *len_out + 1 is AE_ERR and nothing
 * useful is in out. On success out holds the NUL-terminated text. */
int chat_render(const chat_template *t, const chat_msg *msgs, size_t n, bool add_generation_prompt, char *out,
                size_t cap, size_t *len_out, ae_error *err);

/* chat_render into a new malloc'd buffer (free() it). */
int chat_render_alloc(const chat_template *t, const chat_msg *msgs, size_t n, bool add_generation_prompt, char **out,
                      size_t *len_out, ae_error *err);

/* Parses json[0..len), a JSON array of {"role": ..., "content": ...}
 * objects (no other keys), into *msgs (one allocation holding the array
 * and its strings; free with chat_msgs_free) and *n. Errors name the
 * element: "messages[2].role: ...". */
int chat_parse_messages_json(const char *json, size_t len, chat_msg **msgs, size_t *n, ae_error *err);

void chat_msgs_free(chat_msg *msgs); /* NULL is a no-op */

#endif
