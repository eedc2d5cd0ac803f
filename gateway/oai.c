#include "oai.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../services/core/json.h"
#include "schema.h"
#include "../services/tokenizer/detok.h"

static int vfail(oai_error *e, int status, const char *type, const char *code, const char *param, const char *fmt,
                 va_list ap) __attribute__((format(printf, 6, 0)));
static int vfail(oai_error *e, int status, const char *type, const char *code, const char *param, const char *fmt,
                 va_list ap) {
    e->status = status;
    e->type = type;
    e->code = code;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    return AE_ERR;
}

int oai_fail(oai_error *e, int status, const char *type, const char *code, const char *param, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfail(e, status, type, code, param, fmt, ap);
    va_end(ap);
    return AE_ERR;
}

int oai_oom(oai_error *e) {
    return oai_fail(e, 503, "server_error", "out_of_memory", NULL, "the gateway is out of memory; retry later");
}

int oai_bad(oai_error *e, const char *param, const char *code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfail(e, 400, "invalid_request_error", code, param, fmt, ap);
    va_end(ap);
    return AE_ERR;
}

/* Messages quote what clients sent and may have been cut mid-character:
 * what goes out is made valid UTF-8 (bad bytes become U+FFFD). */
static char *valid_utf8(const char *s) {
    size_t n = strlen(s);
    char *out = malloc(DETOK_UTF8_MAX_OUT(n) + 4);
    if (!out) return NULL;
    detok_utf8 u;
    detok_utf8_init(&u);
    size_t len = detok_utf8_push(&u, s, n, out, DETOK_UTF8_MAX_OUT(n));
    len += detok_utf8_flush(&u, out + len, 3);
    out[len] = '\0';
    return out;
}

char *oai_error_json(const oai_error *e) {
    cJSON *root = cJSON_CreateObject(), *o = cJSON_AddObjectToObject(root, "error");
    char *msg = valid_utf8(e->message), *param = valid_utf8(e->param), *s = NULL;
    /* Every add below fails alone (NULL object, NULL string) when memory
     * is short; a missing member is caught by the checks. */
    if (o && msg && param && cJSON_AddStringToObject(o, "message", msg) &&
        cJSON_AddStringToObject(o, "type", e->type ? e->type : "server_error") &&
        (param[0] ? cJSON_AddStringToObject(o, "param", param) : cJSON_AddNullToObject(o, "param")) &&
        (e->code ? cJSON_AddStringToObject(o, "code", e->code) : cJSON_AddNullToObject(o, "code")))
        s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    free(msg);
    free(param);
    return s;
}

/* ---- the request's memory: a list of blocks freed together ---- */

typedef struct block {
    struct block *next;
    max_align_t data[];
} block;

/* NULL when out of memory: the caller answers with oai_oom. */
static void *r_alloc(oai_request *r, size_t n) {
    block *b = malloc(sizeof *b + n);
    if (!b) return NULL;
    b->next = r->mem_;
    r->mem_ = b;
    return b->data;
}

static char *r_strdup(oai_request *r, const char *s, size_t n) {
    char *d = r_alloc(r, n + 1);
    if (!d) return NULL;
    memcpy(d, s, n);
    d[n] = '\0';
    return d;
}

void oai_request_free(oai_request *r) {
    if (!r) return;
    for (block *b = r->mem_, *next; b; b = next) {
        next = b->next;
        free(b);
    }
    memset(r, 0, sizeof *r);
}

/* ---- fields ---- */

static bool is_null(const cJSON *v) { return !v || cJSON_IsNull(v); }

static int get_number(const cJSON *v, const char *name, double lo, double hi, bool lo_open, double *out, oai_error *e) {
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return oai_bad(e, name, "invalid_type", "'%s' must be a number", name);
    double x = v->valuedouble;
    if (x > hi || (lo_open ? x <= lo : x < lo))
        return oai_bad(e, name, "invalid_value", "'%s' is %g; it must be %s %g and <= %g", name, x,
                       lo_open ? ">" : ">=", lo, hi);
    *out = x;
    return AE_OK;
}

static int get_int(const cJSON *v, const char *name, int64_t lo, int64_t hi, int64_t *out, oai_error *e) {
    if (!cJSON_IsNumber(v) || !json_int(v, INT64_C(-9007199254740992), INT64_C(9007199254740992), out))
        return oai_bad(e, name, "invalid_type", "'%s' must be an integer", name);
    if (*out < lo || *out > hi)
        return oai_bad(e, name, "invalid_value", "'%s' is %lld; it must be between %lld and %lld", name,
                       (long long)*out, (long long)lo, (long long)hi);
    return AE_OK;
}

static int get_bool(const cJSON *v, const char *name, bool *out, oai_error *e) {
    if (!cJSON_IsBool(v)) return oai_bad(e, name, "invalid_type", "'%s' must be true or false", name);
    *out = cJSON_IsTrue(v);
    return AE_OK;
}

static int checked_string(const cJSON *v, const char *name, oai_error *e) {
    if (!cJSON_IsString(v)) return oai_bad(e, name, "invalid_type", "'%s' must be a string", name);
    if (!detok_utf8_valid(v->valuestring, strlen(v->valuestring)))
        return oai_bad(e, name, "invalid_value", "'%s' is not valid UTF-8 (a lone surrogate escape?)", name);
    return AE_OK;
}

typedef struct key_at {
    const char *key;
    int at; /* its place in the object */
} key_at;

static int key_cmp(const void *pa, const void *pb) {
    const key_at *a = pa, *b = pb;
    int c = strcmp(a->key, b->key);
    return c ? c : (a->at > b->at) - (a->at < b->at);
}

/* JSON lets a key repeat; which one counts differs between parsers, so a
 * repeated key is refused rather than guessed. The keys are sorted, not
 * compared pairwise: a body of 90k distinct keys once held the loop for
 * seconds. The key named is the repeated one that appears first. */
static int no_duplicates(const cJSON *obj, const char *where, oai_error *e) {
    int n = 0;
    for (const cJSON *f = obj->child; f; f = f->next) n++;
    if (n < 2) return AE_OK;
    key_at small[16], *k = (size_t)n <= sizeof small / sizeof small[0] ? small : malloc(sizeof *k * (size_t)n);
    if (!k) return oai_oom(e);
    int i = 0;
    for (const cJSON *f = obj->child; f; f = f->next, i++) k[i] = (key_at){f->string, i};
    qsort(k, (size_t)n, sizeof *k, key_cmp);
    const key_at *first = NULL;
    for (int run = 0, j = 1; j <= n; j++) {
        if (j < n && strcmp(k[j].key, k[run].key) == 0) continue;
        if (j - run > 1 && (!first || k[run].at < first->at)) first = &k[run]; /* k[run]: the run's first place */
        run = j;
    }
    int rc = first ? oai_bad(e, first->key, "duplicate_field", "'%.60s' appears more than once%s", first->key, where)
                   : AE_OK;
    if (k != small) free(k);
    return rc;
}

static int parse_stop(oai_request *r, const cJSON *v, oai_error *e) {
    const cJSON *one[1] = {v};
    int n = 1;
    if (cJSON_IsArray(v)) {
        n = cJSON_GetArraySize(v);
        if (n > STOP_MAX_STRINGS)
            return oai_bad(e, "stop", "invalid_value", "at most %d stop strings", STOP_MAX_STRINGS);
    } else if (!cJSON_IsString(v)) {
        return oai_bad(e, "stop", "invalid_type", "'stop' must be a string or a list of strings");
    }
    AE_ASSERT(r->n_stops == 0); /* one "stop" per body: parse_fields refuses repeated keys */
    const cJSON *it = cJSON_IsArray(v) ? v->child : one[0];
    for (int i = 0; i < n; i++, it = it->next) {
        if (checked_string(it, "stop", e) != AE_OK) return AE_ERR;
        size_t len = strlen(it->valuestring);
        if (len < 1 || len > STOP_MAX_BYTES)
            return oai_bad(e, "stop", "invalid_value", "a stop string has %zu bytes; it must have 1 to %d", len,
                           STOP_MAX_BYTES);
        if (!(r->stops[r->n_stops] = r_strdup(r, it->valuestring, len))) return oai_oom(e);
        r->stop_lens[r->n_stops++] = len;
    }
    return AE_OK;
}

/* Content: a string, or a list of {"type": "text", "text": ...} parts,
 * which are joined. */
static int parse_content(oai_request *r, const cJSON *v, const char *param, const char **out, oai_error *e) {
    if (cJSON_IsString(v)) {
        if (checked_string(v, param, e) != AE_OK) return AE_ERR;
        *out = r_strdup(r, v->valuestring, strlen(v->valuestring));
        return *out ? AE_OK : oai_oom(e);
    }
    if (!cJSON_IsArray(v))
        return oai_bad(e, param, "invalid_type", "'%s' must be a string or a list of text parts", param);
    size_t total = 0;
    for (const cJSON *p = v->child; p; p = p->next) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(p, "type");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(p, "text");
        if (!cJSON_IsObject(p) || !cJSON_IsString(type))
            return oai_bad(e, param, "invalid_type", "each part of '%s' must be an object with a type", param);
        if (strcmp(type->valuestring, "text") != 0)
            return oai_bad(e, param, "unsupported_content",
                           "content parts of type '%.64s' are not supported (text only)", type->valuestring);
        if (cJSON_GetArraySize(p) != 2 || checked_string(text, param, e) != AE_OK)
            return oai_bad(e, param, "invalid_type", "a text part is {\"type\": \"text\", \"text\": string}");
        total += strlen(text->valuestring);
    }
    char *s = r_alloc(r, total + 1), *w = s;
    if (!s) return oai_oom(e);
    for (const cJSON *p = v->child; p; p = p->next) {
        const char *t = cJSON_GetObjectItemCaseSensitive(p, "text")->valuestring;
        size_t n = strlen(t);
        memcpy(w, t, n);
        w += n;
    }
    *w = '\0';
    *out = s;
    return AE_OK;
}

static int parse_messages(oai_request *r, const cJSON *v, oai_error *e) {
    int n = cJSON_IsArray(v) ? cJSON_GetArraySize(v) : -1;
    if (n < 1) return oai_bad(e, "messages", "invalid_type", "'messages' must be a non-empty list");
    if ((size_t)n > CHAT_MAX_MESSAGES)
        return oai_bad(e, "messages", "invalid_value", "at most %u messages", CHAT_MAX_MESSAGES);
    r->msgs = r_alloc(r, sizeof(chat_msg) * (size_t)n);
    if (!r->msgs) return oai_oom(e);
    r->n_msgs = (size_t)n;
    int i = 0;
    for (const cJSON *m = v->child; m; m = m->next, i++) {
        char param[64];
        snprintf(param, sizeof param, "messages[%d]", i);
        if (!cJSON_IsObject(m)) return oai_bad(e, param, "invalid_type", "'%s' must be an object", param);
        if (no_duplicates(m, " in a message", e) != AE_OK) return AE_ERR;
        const cJSON *role = NULL, *content = NULL, *calls = NULL;
        for (const cJSON *f = m->child; f; f = f->next) {
            if (strcmp(f->string, "role") == 0)
                role = f;
            else if (strcmp(f->string, "content") == 0)
                content = f;
            else if (strcmp(f->string, "name") == 0 && (is_null(f) || cJSON_IsString(f)))
                continue;
            else if (strcmp(f->string, "tool_call_id") == 0 && (is_null(f) || cJSON_IsString(f)))
                continue;
            else if (strcmp(f->string, "tool_calls") == 0)
                calls = f;
            else
                return oai_bad(e, param, "unsupported_parameter", "'%s.%.40s' is not supported", param, f->string);
        }
        if (cJSON_IsString(role) && strcmp(role->valuestring, "tool") == 0) {
            /* A function's result: the user's turn, in the tags the tool
             * prompt names (README, "Tools"). */
            char cparam[80];
            snprintf(cparam, sizeof cparam, "%s.content", param);
            const char *text;
            if (is_null(content)) return oai_bad(e, cparam, "invalid_type", "'%s' is missing", cparam);
            if (parse_content(r, content, cparam, &text, e) != AE_OK) return AE_ERR;
            size_t len = strlen(text);
            if (len > CHAT_MAX_CONTENT)
                return oai_bad(e, cparam, "invalid_value", "'%s' is over %u bytes", cparam, CHAT_MAX_CONTENT);
            char *w = r_alloc(r, len + 64);
            if (!w) return oai_oom(e);
            snprintf(w, len + 64, "<tool_response>\n%s\n</tool_response>", text);
            r->msgs[i] = (chat_msg){"user", w};
            continue;
        }
        if (calls && !is_null(calls)) {
            /* An assistant's calls, written as the tool prompt asks for
             * them, after its text. */
            if (!cJSON_IsString(role) || strcmp(role->valuestring, "assistant") != 0 || !cJSON_IsArray(calls))
                return oai_bad(e, param, "invalid_value", "'%s.tool_calls' must be a list, in an assistant message",
                               param);
            size_t cap = 1, used = 0;
            const char *text = "";
            if (!is_null(content) && parse_content(r, content, param, &text, e) != AE_OK) return AE_ERR;
            cap += strlen(text);
            for (const cJSON *c = calls->child; c; c = c->next) {
                const cJSON *fn = cJSON_GetObjectItemCaseSensitive(c, "function");
                const cJSON *nm = cJSON_GetObjectItemCaseSensitive(fn, "name");
                const cJSON *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
                if (!cJSON_IsString(nm) || !cJSON_IsString(args))
                    return oai_bad(e, param, "invalid_value",
                                   "'%s.tool_calls' entries need function.name and function.arguments strings", param);
                cap += strlen(nm->valuestring) + strlen(args->valuestring) + 64;
            }
            if (cap > CHAT_MAX_CONTENT)
                return oai_bad(e, param, "invalid_value", "'%s' is over %u bytes", param, CHAT_MAX_CONTENT);
            char *w = r_alloc(r, cap);
            if (!w) return oai_oom(e);
            used += (size_t)snprintf(w, cap, "%s", text);
            for (const cJSON *c = calls->child; c; c = c->next) {
                const cJSON *fn = cJSON_GetObjectItemCaseSensitive(c, "function");
                used += (size_t)snprintf(w + used, cap - used,
                                         "%s<tool_call>\n{\"name\": \"%s\", \"arguments\": %s}\n</tool_call>",
                                         used ? "\n" : "", cJSON_GetObjectItemCaseSensitive(fn, "name")->valuestring,
                                         cJSON_GetObjectItemCaseSensitive(fn, "arguments")->valuestring);
            }
            if (!detok_utf8_valid(w, used))
                return oai_bad(e, param, "invalid_value", "'%s.tool_calls' is not valid UTF-8", param);
            r->msgs[i] = (chat_msg){"assistant", w};
            continue;
        }
        if (!cJSON_IsString(role)) return oai_bad(e, param, "invalid_type", "'%s.role' must be a string", param);
        /* The tree is freed after parsing: roles point at literals. */
        static const char *const roles[][2] = {
            {"system", "system"}, {"developer", "system"}, {"user", "user"}, {"assistant", "assistant"}};
        r->msgs[i].role = NULL;
        for (size_t k = 0; k < sizeof roles / sizeof roles[0]; k++)
            if (strcmp(role->valuestring, roles[k][0]) == 0) r->msgs[i].role = roles[k][1];
        if (!r->msgs[i].role)
            return oai_bad(e, param, "invalid_value",
                           "'%s.role' is '%.40s'; it must be system, developer, user, assistant or tool", param,
                           role->valuestring);
        char cparam[80];
        snprintf(cparam, sizeof cparam, "%s.content", param);
        if (is_null(content)) return oai_bad(e, cparam, "invalid_type", "'%s' is missing", cparam);
        if (parse_content(r, content, cparam, &r->msgs[i].content, e) != AE_OK) return AE_ERR;
        if (strlen(r->msgs[i].content) > CHAT_MAX_CONTENT)
            return oai_bad(e, cparam, "invalid_value", "'%s' is over %u bytes", cparam, CHAT_MAX_CONTENT);
    }
    return AE_OK;
}

static int parse_ids(oai_request *r, const cJSON *v, oai_error *e) {
    int n = cJSON_GetArraySize(v);
    r->prompt_ids = r_alloc(r, sizeof(int32_t) * (size_t)(n ? n : 1));
    if (!r->prompt_ids) return oai_oom(e);
    r->n_prompt_ids = (size_t)n;
    int i = 0;
    for (const cJSON *t = v->child; t; t = t->next, i++) {
        int64_t id;
        if (get_int(t, "prompt", 0, INT32_MAX, &id, e) != AE_OK)
            return oai_bad(e, "prompt", "invalid_value", "prompt[%d] is not a token id (an integer >= 0)", i);
        r->prompt_ids[i] = (int32_t)id;
    }
    return AE_OK;
}

/* A prompt: a string, a list of token ids, or a list holding one of
 * those (a batch of one). */
static int parse_prompt(oai_request *r, const cJSON *v, oai_error *e) {
    if (cJSON_IsArray(v) && cJSON_GetArraySize(v) == 1 && (cJSON_IsString(v->child) || cJSON_IsArray(v->child)))
        v = v->child;
    else if (cJSON_IsArray(v) && v->child && !cJSON_IsNumber(v->child))
        return oai_bad(e, "prompt", "invalid_value", "one prompt per request (a batch of %d was sent)",
                       cJSON_GetArraySize(v));
    if (cJSON_IsString(v)) {
        if (checked_string(v, "prompt", e) != AE_OK) return AE_ERR;
        r->prompt_len = strlen(v->valuestring);
        r->prompt = r_strdup(r, v->valuestring, r->prompt_len);
        return r->prompt ? AE_OK : oai_oom(e);
    }
    if (cJSON_IsArray(v)) return parse_ids(r, v, e);
    return oai_bad(e, "prompt", "invalid_type", "'prompt' must be a string or a list of token ids");
}

/* logit_bias: {"<token id>": bias, ...}, ids in decimal. */
static int parse_bias(oai_request *r, const cJSON *v, oai_error *e) {
    if (!cJSON_IsObject(v))
        return oai_bad(e, "logit_bias", "invalid_type", "'logit_bias' must be an object of token ids to numbers");
    if (no_duplicates(v, " in logit_bias", e) != AE_OK) return AE_ERR;
    int n = cJSON_GetArraySize(v);
    if (n > OAI_MAX_BIAS)
        return oai_bad(e, "logit_bias", "invalid_value", "'logit_bias' has %d entries; at most %d", n, OAI_MAX_BIAS);
    r->bias_id = r_alloc(r, sizeof(int32_t) * (size_t)(n ? n : 1));
    r->bias = r_alloc(r, sizeof(float) * (size_t)(n ? n : 1));
    if (!r->bias_id || !r->bias) return oai_oom(e);
    for (const cJSON *f = v->child; f; f = f->next) {
        const char *k = f->string;
        size_t len = strlen(k);
        bool digits = len >= 1 && len <= 10 && (len == 1 || k[0] != '0');
        for (size_t i = 0; i < len && digits; i++) digits = k[i] >= '0' && k[i] <= '9';
        long long id = digits ? strtoll(k, NULL, 10) : -1;
        if (!digits || id > INT32_MAX)
            return oai_bad(e, "logit_bias", "invalid_value", "'logit_bias' key '%.40s' is not a token id", k);
        double b;
        if (get_number(f, "logit_bias", -100, 100, false, &b, e) != AE_OK) return AE_ERR;
        /* Keys are distinct strings without leading zeros: distinct ids. */
        r->bias_id[r->n_bias] = (int32_t)id;
        r->bias[r->n_bias++] = (float)b;
    }
    return AE_OK;
}

static int parse_stop_ids(oai_request *r, const cJSON *v, oai_error *e) {
    if (!cJSON_IsArray(v))
        return oai_bad(e, "stop_token_ids", "invalid_type", "'stop_token_ids' must be a list of ids");
    int n = cJSON_GetArraySize(v);
    if (n > OAI_MAX_STOP_IDS)
        return oai_bad(e, "stop_token_ids", "invalid_value", "at most %d stop_token_ids", OAI_MAX_STOP_IDS);
    for (const cJSON *t = v->child; t; t = t->next) {
        int64_t id;
        if (get_int(t, "stop_token_ids", 0, INT32_MAX, &id, e) != AE_OK) return AE_ERR;
        r->stop_ids[r->n_stop_ids++] = (int32_t)id;
    }
    return AE_OK;
}

/* The output is constrained to schema, sent on as compact JSON text. */
static int set_schema(oai_request *r, const cJSON *schema, oai_error *e) {
    char *text = schema ? cJSON_PrintUnformatted(schema) : NULL;
    if (!text) return oai_oom(e);
    r->schema_len = strlen(text);
    r->schema = r_strdup(r, text, r->schema_len);
    cJSON_free(text);
    if (!r->schema) return oai_oom(e);
    r->format = OAI_JSON_SCHEMA;
    return AE_OK;
}

/* response_format: {"type": "text" | "json_object" | "json_schema",
 * "json_schema": {"name", "schema", "strict", "description"}}. */
static int parse_format(oai_request *r, const cJSON *v, oai_error *e) {
    const char *P = "response_format";
    if (!cJSON_IsObject(v)) return oai_bad(e, P, "invalid_type", "'response_format' must be an object");
    if (no_duplicates(v, " in response_format", e) != AE_OK) return AE_ERR;
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(v, "type"), *js = NULL;
    if (!cJSON_IsString(type))
        return oai_bad(e, P, "invalid_type", "'response_format.type' must be text, json_object or json_schema");
    for (const cJSON *f = v->child; f; f = f->next)
        if (strcmp(f->string, "type") != 0 && !(strcmp(f->string, "json_schema") == 0 && (js = f)))
            return oai_bad(e, P, "unsupported_parameter", "'response_format.%.40s' is not supported", f->string);
    if (strcmp(type->valuestring, "text") == 0 || strcmp(type->valuestring, "json_object") == 0) {
        if (js) return oai_bad(e, P, "invalid_value", "'response_format.json_schema' goes with type json_schema");
        r->format = type->valuestring[0] == 't' ? OAI_TEXT : OAI_JSON_OBJECT;
        return AE_OK;
    }
    if (strcmp(type->valuestring, "json_schema") != 0)
        return oai_bad(e, P, "invalid_value",
                       "'response_format.type' is '%.40s'; it must be text, json_object or json_schema",
                       type->valuestring);
    if (!cJSON_IsObject(js))
        return oai_bad(e, P, "missing_required_parameter", "'response_format.json_schema' must be an object");
    if (no_duplicates(js, " in response_format.json_schema", e) != AE_OK) return AE_ERR;
    const cJSON *schema = NULL;
    for (const cJSON *f = js->child; f; f = f->next) {
        if (strcmp(f->string, "schema") == 0)
            schema = f;
        else if (strcmp(f->string, "strict") == 0 && (cJSON_IsBool(f) || cJSON_IsNull(f)))
            continue;
        else if ((strcmp(f->string, "name") == 0 || strcmp(f->string, "description") == 0) && cJSON_IsString(f))
            continue;
        else
            return oai_bad(e, P, "invalid_value", "'response_format.json_schema.%.40s' is not supported here",
                           f->string);
    }
    if (!cJSON_IsObject(schema))
        return oai_bad(e, P, "missing_required_parameter", "'response_format.json_schema.schema' must be an object");
    char why[256];
    if (schema_check(schema, why, sizeof why) != AE_OK) return oai_bad(e, P, "unsupported_schema", "%s", why);
    return set_schema(r, schema, e);
}

/* A "$ref", "$defs" or "definitions" key anywhere in v. */
static bool has_ref(const cJSON *v) {
    for (const cJSON *f = v->child; f; f = f->next) {
        if (f->string &&
            (!strcmp(f->string, "$ref") || !strcmp(f->string, "$defs") || !strcmp(f->string, "definitions")))
            return true;
        if ((cJSON_IsObject(f) || cJSON_IsArray(f)) && has_ref(f)) return true;
    }
    return false;
}

/* tools: [{"type": "function", "function": {"name", "description",
 * "parameters", "strict"}}], each name distinct, each parameters schema in
 * the subset (schema.h). */
static int parse_tools(oai_request *r, const cJSON *v, oai_error *e) {
    const char *P = "tools";
    int n = cJSON_IsArray(v) ? cJSON_GetArraySize(v) : -1;
    if (n < 1) return oai_bad(e, P, "invalid_type", "'tools' must be a non-empty list of functions");
    if (n > OAI_MAX_TOOLS)
        return oai_bad(e, P, "invalid_value", "'tools' has %d functions; at most %d", n, OAI_MAX_TOOLS);
    cJSON *list = cJSON_CreateArray();
    if (!list) return oai_oom(e);
    int i = 0, rc = AE_OK;
    for (const cJSON *t = v->child; t && rc == AE_OK; t = t->next, i++) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(t, "type"),
                    *fn = cJSON_GetObjectItemCaseSensitive(t, "function");
        if (!cJSON_IsObject(t) || !cJSON_IsString(type) || strcmp(type->valuestring, "function") != 0 ||
            !cJSON_IsObject(fn)) {
            rc = oai_bad(e, P, "invalid_value", "tools[%d] must be {\"type\": \"function\", \"function\": {...}}", i);
            break;
        }
        const cJSON *name = NULL, *params = NULL;
        for (const cJSON *f = fn->child; f && rc == AE_OK; f = f->next) {
            if (strcmp(f->string, "name") == 0)
                name = f;
            else if (strcmp(f->string, "parameters") == 0)
                params = f;
            else if (strcmp(f->string, "description") == 0 && cJSON_IsString(f))
                continue;
            else if (strcmp(f->string, "strict") == 0 && (cJSON_IsBool(f) || cJSON_IsNull(f)))
                continue;
            else
                rc = oai_bad(e, P, "unsupported_parameter", "tools[%d].function.%.40s is not supported", i, f->string);
        }
        if (rc != AE_OK) break;
        size_t len = cJSON_IsString(name) ? strlen(name->valuestring) : 0;
        bool ok = len >= 1 && len <= 64;
        for (size_t k = 0; k < len && ok; k++) {
            char c = name->valuestring[k];
            ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
        }
        if (!ok) {
            rc = oai_bad(e, P, "invalid_value", "tools[%d].function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -", i);
            break;
        }
        for (int k = 0; k < r->n_tools && rc == AE_OK; k++)
            if (strcmp(r->tool_names[k], name->valuestring) == 0)
                rc = oai_bad(e, P, "invalid_value", "two tools are named '%s'", name->valuestring);
        char why[256];
        /* A call's schema nests the parameters under "arguments", where
         * their "#/..." references would no longer resolve. */
        if (rc == AE_OK && params && cJSON_IsObject(params) && has_ref(params))
            rc = oai_bad(e, P, "unsupported_schema",
                         "tools[%d].function.parameters: '$defs' and '$ref' are not supported "
                         "in tool parameters",
                         i);
        if (rc == AE_OK && params && (!cJSON_IsObject(params) || schema_check(params, why, sizeof why) != AE_OK))
            rc = oai_bad(e, P, "unsupported_schema", "tools[%d].function.parameters: %s", i,
                         cJSON_IsObject(params) ? why : "must be a JSON Schema object");
        if (rc != AE_OK) break;
        if (!(r->tool_names[r->n_tools++] = r_strdup(r, name->valuestring, len))) rc = oai_oom(e);
        cJSON *copy = cJSON_Duplicate(t, true);
        if (!copy || !cJSON_AddItemToArray(list, copy)) rc = oai_oom(e);
    }
    if (rc == AE_OK) {
        char *text = cJSON_PrintUnformatted(list);
        if (!text || !(r->tools_json = r_strdup(r, text, strlen(text)))) rc = oai_oom(e);
        cJSON_free(text);
    }
    cJSON_Delete(list);
    return rc;
}

/* The schema of a call: {"name": ..., "arguments": parameters}, one
 * function (named) or any of them (required). */
static int call_schema(oai_request *r, const cJSON *tools, oai_error *e) {
    cJSON *any = cJSON_CreateArray();
    int i = 0;
    for (const cJSON *t = tools->child; t && any; t = t->next, i++) {
        if (r->tool_choice == OAI_TOOLS_NAMED && i != r->tool_named) continue;
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(t, "function");
        const cJSON *params = cJSON_GetObjectItemCaseSensitive(fn, "parameters");
        cJSON *o = cJSON_CreateObject(), *props = o ? cJSON_AddObjectToObject(o, "properties") : NULL;
        cJSON *nm = props ? cJSON_AddObjectToObject(props, "name") : NULL;
        cJSON *req = o ? cJSON_AddArrayToObject(o, "required") : NULL;
        bool ok =
            nm && req && cJSON_AddStringToObject(o, "type", "object") &&
            cJSON_AddStringToObject(nm, "const", cJSON_GetObjectItemCaseSensitive(fn, "name")->valuestring) &&
            cJSON_AddItemToObject(props, "arguments", params ? cJSON_Duplicate(params, true) : cJSON_CreateObject()) &&
            cJSON_AddItemToArray(req, cJSON_CreateString("name")) &&
            cJSON_AddItemToArray(req, cJSON_CreateString("arguments")) &&
            cJSON_AddFalseToObject(o, "additionalProperties") && cJSON_AddItemToArray(any, o);
        if (!ok) {
            cJSON_Delete(o);
            cJSON_Delete(any);
            return oai_oom(e);
        }
    }
    cJSON *root = cJSON_GetArraySize(any) == 1 ? cJSON_DetachItemFromArray(any, 0) : cJSON_CreateObject();
    if (root && cJSON_GetArraySize(any) > 0) cJSON_AddItemToObject(root, "anyOf", any), any = NULL;
    cJSON_Delete(any);
    if (!root) return oai_oom(e);
    /* Each tool's parameters passed alone; the schema that is compiled is
     * all of them together, and the limits are the document's. */
    char why[256];
    if (schema_check(root, why, sizeof why) != AE_OK) {
        cJSON_Delete(root);
        return oai_bad(e, "tools", "unsupported_schema", "the schema of a call to %s: %s",
                       r->tool_choice == OAI_TOOLS_NAMED ? "the named tool" : "any of the tools, all together", why);
    }
    int rc = set_schema(r, root, e);
    cJSON_Delete(root);
    return rc;
}

/* tool_choice: "none", "auto", "required" or {"type": "function",
 * "function": {"name": ...}}; without tools only "none". */
static int parse_tool_choice(oai_request *r, const cJSON *v, const cJSON *tools, oai_error *e) {
    const char *P = "tool_choice";
    r->tool_choice = tools ? OAI_TOOLS_AUTO : OAI_TOOLS_NONE;
    if (!v) return AE_OK;
    if (cJSON_IsString(v)) {
        static const char *const names[] = {"none", "auto", "required"};
        int k = 0;
        while (k < 3 && strcmp(v->valuestring, names[k]) != 0) k++;
        if (k == 3)
            return oai_bad(e, P, "invalid_value",
                           "'tool_choice' is '%.40s'; it must be none, auto, required or a function", v->valuestring);
        r->tool_choice = k;
    } else {
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(v, "function");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(fn, "name");
        if (!cJSON_IsObject(v) || !cJSON_IsString(name))
            return oai_bad(e, P, "invalid_type",
                           "'tool_choice' must be a string or {\"type\": \"function\", "
                           "\"function\": {\"name\": ...}}");
        r->tool_choice = OAI_TOOLS_NAMED;
        r->tool_named = -1;
        for (int k = 0; k < r->n_tools; k++)
            if (strcmp(r->tool_names[k], name->valuestring) == 0) r->tool_named = k;
        if (r->tool_named < 0)
            return oai_bad(e, P, "invalid_value", "'tool_choice' names '%.64s', which is not in tools",
                           name->valuestring);
    }
    if (r->tool_choice != OAI_TOOLS_NONE && !tools)
        return oai_bad(e, P, "invalid_value", "'tool_choice' other than none needs 'tools'");
    return AE_OK;
}

int oai_check_vocab(const oai_request *r, int32_t vocab, oai_error *e) {
    for (int i = 0; i < r->n_bias; i++)
        if (r->bias_id[i] >= vocab)
            return oai_bad(e, "logit_bias", "invalid_value", "'logit_bias' names token %d; the vocabulary has %d",
                           r->bias_id[i], vocab);
    for (int i = 0; i < r->n_stop_ids; i++)
        if (r->stop_ids[i] >= vocab)
            return oai_bad(e, "stop_token_ids", "invalid_value", "stop_token_ids[%d] is %d; the vocabulary has %d", i,
                           r->stop_ids[i], vocab);
    return AE_OK;
}

/* Fields accepted only at the value that leaves output as it is. */
static int neutral(const cJSON *f, oai_error *e) {
    const char *k = f->string;
    bool ok = false;
    if (strcmp(k, "echo") == 0)
        ok = cJSON_IsFalse(f);
    else if (strcmp(k, "best_of") == 0)
        ok = cJSON_IsNumber(f) && f->valuedouble == 1;
    else
        return oai_bad(e, k, "unsupported_parameter", "'%.60s' is not supported", k);
    if (!ok) return oai_bad(e, k, "unsupported_value", "'%.60s' is supported only at its default (off)", k);
    return AE_OK;
}

static int parse_fields(oai_request *r, oai_kind kind, const cJSON *root, oai_error *e) {
    const cJSON *messages = NULL, *prompt = NULL, *max_tokens = NULL, *max_completion = NULL, *stream_options = NULL;
    const cJSON *logprobs = NULL, *top_logprobs = NULL, *tools = NULL, *tool_choice = NULL;
    if (no_duplicates(root, "", e) != AE_OK) return AE_ERR;
    for (const cJSON *f = root->child; f; f = f->next) {
        const char *k = f->string;
        if (is_null(f) || strcmp(k, "user") == 0 || strcmp(k, "metadata") == 0 || strcmp(k, "store") == 0) continue;
        int64_t i64;
        if (strcmp(k, "model") == 0) {
            if (checked_string(f, k, e) != AE_OK) return AE_ERR;
            if (strlen(f->valuestring) >= OAI_MAX_MODEL)
                return oai_bad(e, k, "invalid_value", "'model' is over %d bytes", OAI_MAX_MODEL - 1);
            snprintf(r->model, sizeof r->model, "%s", f->valuestring);
        } else if (kind == OAI_CHAT && strcmp(k, "messages") == 0) {
            messages = f;
        } else if (kind == OAI_COMPLETION && strcmp(k, "prompt") == 0) {
            prompt = f;
        } else if (strcmp(k, "max_tokens") == 0) {
            max_tokens = f;
        } else if (kind == OAI_CHAT && strcmp(k, "max_completion_tokens") == 0) {
            max_completion = f;
        } else if (strcmp(k, "temperature") == 0) {
            if (get_number(f, k, 0, 2, false, &r->temperature, e) != AE_OK) return AE_ERR;
        } else if (strcmp(k, "top_p") == 0) {
            if (get_number(f, k, 0, 1, true, &r->top_p, e) != AE_OK) return AE_ERR;
        } else if (strcmp(k, "min_p") == 0) {
            if (get_number(f, k, 0, 1, false, &r->min_p, e) != AE_OK) return AE_ERR;
        } else if (strcmp(k, "top_k") == 0) {
            /* -1 is how other servers spell "off"; we take it too. */
            if (get_int(f, k, -1, INT32_MAX, &i64, e) != AE_OK) return AE_ERR;
            r->top_k = i64 < 0 ? 0 : (int32_t)i64;
        } else if (strcmp(k, "seed") == 0) {
            if (get_int(f, k, INT64_MIN, INT64_MAX, &i64, e) != AE_OK) return AE_ERR;
            r->has_seed = true;
            r->seed = (uint64_t)i64;
        } else if (strcmp(k, "stop") == 0) {
            if (parse_stop(r, f, e) != AE_OK) return AE_ERR;
        } else if (strcmp(k, "stream") == 0) {
            if (get_bool(f, k, &r->stream, e) != AE_OK) return AE_ERR;
        } else if (strcmp(k, "stream_options") == 0) {
            stream_options = f;
        } else if (strcmp(k, "ignore_eos") == 0) {
            if (get_bool(f, k, &r->ignore_eos, e) != AE_OK) return AE_ERR;
        } else if (strcmp(k, "n") == 0) {
            if (get_int(f, k, 1, OAI_MAX_N, &i64, e) != AE_OK) return AE_ERR;
            r->n = (int32_t)i64;
        } else if (strcmp(k, "presence_penalty") == 0) {
            if (get_number(f, k, -2, 2, false, &r->presence_penalty, e) != AE_OK) return AE_ERR;
        } else if (strcmp(k, "frequency_penalty") == 0) {
            if (get_number(f, k, -2, 2, false, &r->frequency_penalty, e) != AE_OK) return AE_ERR;
        } else if (strcmp(k, "repetition_penalty") == 0) {
            if (get_number(f, k, 0, 100, true, &r->repetition_penalty, e) != AE_OK) return AE_ERR;
        } else if (strcmp(k, "min_tokens") == 0) {
            if (get_int(f, k, 0, INT32_MAX, &i64, e) != AE_OK) return AE_ERR;
            r->min_tokens = (int32_t)i64;
        } else if (strcmp(k, "logit_bias") == 0) {
            if (parse_bias(r, f, e) != AE_OK) return AE_ERR;
        } else if (strcmp(k, "stop_token_ids") == 0) {
            if (parse_stop_ids(r, f, e) != AE_OK) return AE_ERR;
        } else if (kind == OAI_CHAT && strcmp(k, "tools") == 0) {
            tools = f;
        } else if (kind == OAI_CHAT && strcmp(k, "tool_choice") == 0) {
            tool_choice = f;
        } else if (kind == OAI_CHAT && strcmp(k, "parallel_tool_calls") == 0) {
            bool b;
            if (get_bool(f, k, &b, e) != AE_OK) return AE_ERR;
        } else if (strcmp(k, "response_format") == 0) {
            if (parse_format(r, f, e) != AE_OK) return AE_ERR;
        } else if (strcmp(k, "logprobs") == 0) {
            logprobs = f;
        } else if (kind == OAI_CHAT && strcmp(k, "top_logprobs") == 0) {
            top_logprobs = f;
        } else if (neutral(f, e) != AE_OK) {
            return AE_ERR;
        }
    }
    if (kind == OAI_CHAT) {
        if (!messages) return oai_bad(e, "messages", "missing_required_parameter", "'messages' is required");
        if (parse_messages(r, messages, e) != AE_OK) return AE_ERR;
    } else {
        if (!prompt) return oai_bad(e, "prompt", "missing_required_parameter", "'prompt' is required");
        if (parse_prompt(r, prompt, e) != AE_OK) return AE_ERR;
    }
    if (!r->model[0]) return oai_bad(e, "model", "missing_required_parameter", "'model' is required");
    int64_t a = -1, b = -1;
    if (max_tokens && get_int(max_tokens, "max_tokens", 1, INT32_MAX, &a, e) != AE_OK) return AE_ERR;
    if (max_completion && get_int(max_completion, "max_completion_tokens", 1, INT32_MAX, &b, e) != AE_OK) return AE_ERR;
    if (a > 0 && b > 0 && a != b)
        return oai_bad(e, "max_completion_tokens", "invalid_value",
                       "max_tokens (%lld) and max_completion_tokens (%lld) disagree", (long long)a, (long long)b);
    r->max_tokens = b > 0 ? b : a;
    r->max_tokens_field = b > 0 ? "max_completion_tokens" : "max_tokens";
    if (tools && parse_tools(r, tools, e) != AE_OK) return AE_ERR;
    if (parse_tool_choice(r, tool_choice, tools, e) != AE_OK) return AE_ERR;
    if (r->tool_choice >= OAI_TOOLS_REQUIRED) {
        if (r->format != OAI_TEXT)
            return oai_bad(e, "response_format", "invalid_value",
                           "'response_format' cannot go with tool_choice required or a named function");
        if (call_schema(r, tools, e) != AE_OK) return AE_ERR;
    }
    if (r->tool_choice == OAI_TOOLS_NONE) r->n_tools = 0; /* the model is not told of them */
    if (r->max_tokens > 0 && r->min_tokens > r->max_tokens)
        return oai_bad(e, "min_tokens", "invalid_value", "min_tokens (%d) is more than %s (%lld)", r->min_tokens,
                       r->max_tokens_field, (long long)r->max_tokens);
    /* Chat: logprobs true or false, and top_logprobs 0..20 with it.
     * Completions: logprobs is how many top tokens (0..20). */
    if (kind == OAI_CHAT) {
        if (logprobs && get_bool(logprobs, "logprobs", &r->logprobs, e) != AE_OK) return AE_ERR;
        if (top_logprobs) {
            if (get_int(top_logprobs, "top_logprobs", 0, OAI_MAX_TOP_LOGPROBS, &a, e) != AE_OK) return AE_ERR;
            if (!r->logprobs)
                return oai_bad(e, "top_logprobs", "invalid_value", "'top_logprobs' needs 'logprobs': true");
            r->top_logprobs = (int32_t)a;
        }
    } else if (logprobs) {
        if (get_int(logprobs, "logprobs", 0, OAI_MAX_TOP_LOGPROBS, &a, e) != AE_OK) return AE_ERR;
        r->logprobs = true;
        r->top_logprobs = (int32_t)a;
    }
    if (stream_options) {
        if (!r->stream)
            return oai_bad(e, "stream_options", "invalid_value", "'stream_options' is allowed only with stream: true");
        if (!cJSON_IsObject(stream_options))
            return oai_bad(e, "stream_options", "invalid_type", "'stream_options' must be an object");
        if (no_duplicates(stream_options, " in stream_options", e) != AE_OK) return AE_ERR;
        for (const cJSON *f = stream_options->child; f; f = f->next) {
            if (strcmp(f->string, "include_usage") != 0)
                return oai_bad(e, "stream_options", "unsupported_parameter", "'stream_options.%.40s' is not supported",
                               f->string);
            if (!is_null(f) && get_bool(f, "stream_options.include_usage", &r->include_usage, e) != AE_OK)
                return AE_ERR;
        }
    }
    return AE_OK;
}

static void request_init(oai_request *r, oai_kind kind) {
    memset(r, 0, sizeof *r);
    r->kind = kind;
    r->max_tokens = -1;
    r->temperature = 1;
    r->top_p = 1;
    r->repetition_penalty = 1;
    r->n = 1;
}

int oai_parse_tree(oai_request *r, oai_kind kind, const cJSON *root, oai_error *e) {
    request_init(r, kind);
    int rc = cJSON_IsObject(root) ? parse_fields(r, kind, root, e)
                                  : oai_bad(e, NULL, "invalid_type", "the body must be a JSON object");
    if (rc != AE_OK) {
        oai_request_free(r);
        r->kind = kind;
    }
    return rc;
}

int oai_parse(oai_request *r, oai_kind kind, const char *body, size_t len, oai_error *e) {
    request_init(r, kind);
    if (!detok_utf8_valid(body, len)) return oai_bad(e, NULL, "invalid_encoding", "the body is not valid UTF-8");
    ae_error jerr = {{0}};
    cJSON *root = json_parse(body, len, &jerr);
    if (!root) return oai_bad(e, NULL, "invalid_json", "the body is not valid JSON: %s", jerr.msg);
    int rc = oai_parse_tree(r, kind, root, e);
    cJSON_Delete(root);
    return rc;
}
