/* The OpenAI API's request bodies and error shape.
 *
 * oai_parse reads a /v1/chat/completions or /v1/completions body into a
 * plain request, checking every field's type and range. What we do not
 * implement is refused with 400 rather than ignored: a field that changes
 * output is either honoured or an error. Fields that cannot change output
 * are accepted: `user`, `metadata`, `store`, and a few fields when they
 * hold the value that means "off" (`echo: false`, `best_of: 1`).
 * A JSON null is the same as a missing field, as OpenAI's own clients
 * send it.
 *
 * Token ids (logit_bias keys, stop_token_ids) are checked against the
 * vocabulary by oai_check_vocab, once the tokenizer is at hand.
 *
 * Every string taken from the body is valid UTF-8 (the body is checked
 * whole, and again after JSON unescaping, which can make lone surrogates). */
#ifndef AERIE_GATEWAY_OAI_H
#define AERIE_GATEWAY_OAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "../services/tokenizer/chat.h"
#include "stop.h"

/* An error as OpenAI's API returns it:
 * {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}. */
typedef struct oai_error {
    int status;       /* HTTP status */
    const char *type; /* "invalid_request_error", "authentication_error", ... */
    const char *code; /* NULL: JSON null */
    char param[64];   /* empty: JSON null */
    char message[512];
} oai_error;

/* Sets e and returns AE_ERR. */
int oai_fail(oai_error *e, int status, const char *type, const char *code, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
/* Shorthand: 400 invalid_request_error. */
int oai_bad(oai_error *e, const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Sets e to 503 server_error "out_of_memory" and returns AE_ERR: what a
 * request gets when an allocation for it fails. */
int oai_oom(oai_error *e);
/* The JSON body of e (malloc'd, NUL-terminated); NULL when out of memory
 * (OAI_OOM_JSON is then the body to send). */
char *oai_error_json(const oai_error *e);
#define OAI_OOM_JSON \
    "{\"error\":{\"message\":\"the gateway is out of memory; retry later\",\"type\":\"server_error\"," \
    "\"param\":null,\"code\":\"out_of_memory\"}}"

typedef enum oai_kind { OAI_CHAT, OAI_COMPLETION } oai_kind;
enum { OAI_TEXT = 0, OAI_JSON_OBJECT = 1, OAI_JSON_SCHEMA = 2 }; /* the wire's response_format */

#define OAI_MAX_MODEL 256
#define OAI_MAX_BIAS 300        /* logit_bias entries (OpenAI's limit) */
#define OAI_MAX_STOP_IDS 16     /* stop_token_ids */
#define OAI_MAX_TOP_LOGPROBS 20 /* top_logprobs, and completions' logprobs */
#define OAI_MAX_N 16            /* choices */
#define OAI_MAX_TOOLS 64        /* functions in tools */
enum { OAI_TOOLS_NONE = 0, OAI_TOOLS_AUTO = 1, OAI_TOOLS_REQUIRED = 2, OAI_TOOLS_NAMED = 3 };

typedef struct oai_request {
    oai_kind kind;
    char model[OAI_MAX_MODEL];
    /* chat: the conversation (roles "system", "user", "assistant";
     * "developer" is taken as "system") */
    chat_msg *msgs;
    size_t n_msgs;
    /* completion: the prompt as text, or as token ids */
    char *prompt;
    size_t prompt_len;
    int32_t *prompt_ids;
    size_t n_prompt_ids;
    int64_t max_tokens;           /* -1: not given */
    const char *max_tokens_field; /* the field that gave it, for errors */
    double temperature;           /* default 1 (OpenAI's) */
    double top_p;                 /* default 1 */
    double min_p;                 /* default 0 */
    int32_t top_k;                /* default 0: off */
    bool has_seed;
    uint64_t seed;
    int n_stops;
    char *stops[STOP_MAX_STRINGS];
    size_t stop_lens[STOP_MAX_STRINGS];
    int32_t n; /* choices, 1..OAI_MAX_N (default 1) */
    bool stream;
    bool include_usage; /* stream_options.include_usage */
    bool ignore_eos;
    /* penalties and biases (target/penalty.h) */
    double presence_penalty, frequency_penalty; /* -2..2, default 0 */
    double repetition_penalty;                  /* > 0, default 1 */
    int32_t min_tokens;                         /* default 0 */
    int n_bias;
    int32_t *bias_id; /* [n_bias], distinct */
    float *bias;      /* [n_bias], -100..100 */
    int n_stop_ids;
    int32_t stop_ids[OAI_MAX_STOP_IDS]; /* stop_token_ids */
    /* log-probabilities: chat's logprobs and top_logprobs; completions'
     * integer logprobs sets both */
    bool logprobs;
    int32_t top_logprobs; /* 0..OAI_MAX_TOP_LOGPROBS */
    /* response_format: OAI_TEXT, OAI_JSON_OBJECT, or OAI_JSON_SCHEMA with
     * the schema (checked against gateway/schema.h's subset) as compact
     * JSON text */
    int format;
    char *schema;
    size_t schema_len;
    /* tools (chat): the functions as one JSON list for the prompt
     * (tools_json), their names, and tool_choice. With OAI_TOOLS_REQUIRED
     * or a named function, format is OAI_JSON_SCHEMA and schema is the
     * call's: {"name": one of them, "arguments": its parameters}. */
    int n_tools;
    char *tool_names[OAI_MAX_TOOLS];
    char *tools_json;
    int tool_choice; /* OAI_TOOLS_* */
    int tool_named;  /* with OAI_TOOLS_NAMED: which */
    void *mem_;      /* everything above points into this one allocation list */
} oai_request;

/* Parses body[0..len). On failure e holds a 400 with the field named in
 * param (or oai_oom's 503); the request is left empty (oai_request_free is still safe). */
int oai_parse(oai_request *r, oai_kind kind, const char *body, size_t len, oai_error *e);
/* The same from a parsed body (its strings already checked as UTF-8). */
int oai_parse_tree(oai_request *r, oai_kind kind, const cJSON *root, oai_error *e);
void oai_request_free(oai_request *r);
/* The token ids the request names (logit_bias, stop_token_ids) are in
 * [0, vocab); else e is the 400 naming the field. */
int oai_check_vocab(const oai_request *r, int32_t vocab, oai_error *e);

#endif
