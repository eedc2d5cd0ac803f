/* The gateway: its routes, the tokenizing workers, and its life cycle.
 * The generation routes are generate.c's. */
#include "gateway.h"

#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <event2/event.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>

#include "../services/core/json.h"
#include "../services/core/log.h"
#include "../services/tokenizer/detok.h"
#include "gateway_internal.h"
#include "generate.h"
#include "render.h"

/* ---- replies ---- */

void gateway_reply_json(gateway *g, http_req *h, metrics_route route, int status, const char *body, size_t len,
                        const char *extra) {
    if (route < METRICS_ROUTES) metrics_request(&g->met, route, status);
    http_respond(h, status, "application/json", extra, body, len);
}

void gateway_reply_error(gateway *g, http_req *h, metrics_route route, const oai_error *e) {
    char *json = oai_error_json(e);
    const char *body = json ? json : OAI_OOM_JSON;
    const char *extra = NULL;
    if (e->status == 429 || e->status == 503)
        extra = "Retry-After: 1\r\n";
    else if (e->status == 401)
        extra = "WWW-Authenticate: Bearer\r\n";
    if (e->status >= 500 || e->status == 429)
        LOG_INFOF("request_refused status=%d peer=%s reason=\"%s\"", e->status, http_req_peer(h), e->message);
    gateway_reply_json(g, h, route, e->status, body, strlen(body), extra);
    free(json);
}

void gateway_reply_jbuf(gateway *g, http_req *h, metrics_route route, jbuf *b) {
    oai_error e;
    if (b->oom)
        gateway_reply_error(g, h, route, (oai_oom(&e), &e));
    else
        gateway_reply_json(g, h, route, 200, b->p, b->len, NULL);
}

static size_t http_error_body(void *ctx, int status, const char *message, char *out, size_t cap,
                              const char **content_type) {
    (void)ctx;
    oai_error e;
    const char *type = status == 429 ? "rate_limit_error" : "invalid_request_error";
    const char *code = status == 413   ? "request_too_large"
                       : status == 429 ? "too_many_connections"
                       : status == 431 ? "headers_too_large"
                                       : "bad_request";
    oai_fail(&e, status, type, code, NULL, "%s", message);
    char *json = oai_error_json(&e);
    const char *body = json ? json : OAI_OOM_JSON;
    size_t n = strlen(body) < cap ? strlen(body) : cap;
    memcpy(out, body, n);
    free(json);
    *content_type = "application/json";
    return n;
}

/* The tool prompt (README, "Tools"): every template we know renders
 * without tools, so the functions go into the system message, after its
 * text (or the template's default system text). */
static const char TOOL_PROMPT_HEAD[] =
    "You can call functions to answer. They are listed below as JSON, between <tools> and </tools>.\n<tools>\n";
static const char TOOL_PROMPT_TAIL[] =
    "\n</tools>\nTo call a function, answer with one block per call, and nothing else:\n<tool_call>\n"
    "{\"name\": \"<the function's name>\", \"arguments\": <its arguments as a JSON object>}\n</tool_call>";

/* o's messages with the tool prompt in the system message; *msgs is
 * malloc'd (and *sys, the system text), or o's own when there are no
 * tools. */
static int with_tools(const gateway *g, const oai_request *o, chat_msg **msgs, size_t *n, char **sys, oai_error *e) {
    *msgs = o->msgs;
    *n = o->n_msgs;
    *sys = NULL;
    if (o->n_tools == 0) return AE_OK;
    bool has_sys = o->n_msgs > 0 && strcmp(o->msgs[0].role, "system") == 0;
    const char *base = has_sys ? o->msgs[0].content : chat_default_system(g->cfg.chat);
    size_t len =
        (base ? strlen(base) + 2 : 0) + sizeof TOOL_PROMPT_HEAD + strlen(o->tools_json) + sizeof TOOL_PROMPT_TAIL;
    *sys = malloc(len);
    *msgs = malloc(sizeof(chat_msg) * (o->n_msgs + 1));
    if (!*sys || !*msgs) {
        free(*sys), free(*msgs);
        *msgs = NULL, *sys = NULL;
        return oai_oom(e);
    }
    snprintf(*sys, len, "%s%s%s%s%s", base ? base : "", base ? "\n\n" : "", TOOL_PROMPT_HEAD, o->tools_json,
             TOOL_PROMPT_TAIL);
    (*msgs)[0] = (chat_msg){"system", *sys};
    size_t from = has_sys ? 1 : 0;
    for (size_t i = from; i < o->n_msgs; i++) (*msgs)[1 + i - from] = o->msgs[i];
    *n = 1 + o->n_msgs - from;
    return AE_OK;
}

/* Renders and tokenizes what the request asks about: a conversation (with
 * the generation prompt when add_gen) or a prompt's text or ids. Runs on a
 * tokenizing worker: it reads only o and the immutable tokenizer and
 * template. */
static int encode_prompt(const gateway *g, const oai_request *o, bool add_gen, int32_t **ids, int32_t *n,
                         oai_error *e) {
    *ids = NULL;
    *n = 0;
    if (o->prompt_ids || (o->kind == OAI_COMPLETION && !o->prompt)) {
        size_t k = o->n_prompt_ids;
        *ids = malloc(sizeof(int32_t) * (k ? k : 1));
        if (!*ids) return oai_oom(e);
        for (size_t i = 0; i < k; i++) {
            if (o->prompt_ids[i] >= tok_vocab_size(g->cfg.tok)) {
                free(*ids), *ids = NULL;
                return oai_bad(e, "prompt", "invalid_value", "prompt[%zu] is %d, not in the vocabulary of %d", i,
                               o->prompt_ids[i], tok_vocab_size(g->cfg.tok));
            }
            (*ids)[i] = o->prompt_ids[i];
        }
        *n = (int32_t)k;
        return AE_OK;
    }
    char *rendered = NULL;
    const char *text = o->prompt;
    size_t len = o->prompt_len;
    int flags = TOK_ADD_BOS | TOK_PARSE_SPECIAL;
    ae_error err = {{0}};
    if (o->kind == OAI_CHAT) {
        if (!g->cfg.chat)
            return oai_bad(e, "messages", "no_chat_template",
                           "the model has no chat template we know; use /v1/completions");
        chat_msg *msgs;
        size_t n_msgs;
        char *sys;
        if (with_tools(g, o, &msgs, &n_msgs, &sys, e) != AE_OK) return AE_ERR;
        int rrc = chat_render_alloc(g->cfg.chat, msgs, n_msgs, add_gen, &rendered, &len, &err);
        if (msgs != o->msgs) free(msgs);
        free(sys);
        if (rrc != AE_OK) return oai_bad(e, "messages", "invalid_value", "%s", err.msg);
        text = rendered;
        flags = TOK_PARSE_SPECIAL; /* the template writes its own BOS */
    }
    *ids = malloc(sizeof(int32_t) * (len + 2));
    if (!*ids) {
        free(rendered);
        return oai_oom(e);
    }
    size_t got = 0;
    int rc = tok_encode(g->cfg.tok, text ? text : "", len, flags, *ids, len + 2, &got, &err);
    free(rendered);
    if (rc != AE_OK) {
        free(*ids), *ids = NULL;
        return oai_bad(e, NULL, "invalid_value", "cannot tokenize: %s", err.msg);
    }
    if (got > INT32_MAX / 2) {
        free(*ids), *ids = NULL;
        return oai_bad(e, NULL, "context_length_exceeded", "the prompt has %zu tokens", got);
    }
    *n = (int32_t)got;
    return AE_OK;
}

/* ---- the tokenizing workers ----
 *
 * Tokenizing 1 MiB takes ~0.25 s and parsing half a million ids ~0.2 s:
 * on the loop they stalled every stream, /health and /metrics. Bodies of
 * generation, /tokenize and /detokenize requests are queued to a small
 * fixed pool of threads, which also build the latter two's replies;
 * each finished job goes on a list and wakes the loop, which calls its
 * done. What the workers hold at once is bounded by their number (see
 * GATEWAY_TOK_WORKER_BYTES); a queued job holds only its request, which the
 * gateway already counts. */

/* A /tokenize body: {"prompt": text} or {"messages": [...],
 * "add_generation_prompt": bool}, optional "model". The same parser as
 * generation, so a text tokenizes here exactly as it would be sent:
 * add_generation_prompt (ours alone) is taken off first. */
static int parse_tokenize(const gateway *g, gateway_job *j) {
    oai_error *e = &j->e;
    ae_error jerr = {{0}};
    cJSON *root = detok_utf8_valid(j->body, j->len) ? json_parse(j->body, j->len, &jerr) : NULL;
    int rc = AE_ERR;
    j->add_gen = true;
    if (!root) {
        oai_bad(e, NULL, "invalid_json", "the body is not valid JSON%s%s", jerr.msg[0] ? ": " : " (UTF-8)", jerr.msg);
        goto out;
    }
    if (!cJSON_IsObject(root)) {
        oai_bad(e, NULL, "invalid_type", "the body must be a JSON object");
        goto out;
    }
    cJSON *agp = cJSON_DetachItemFromObjectCaseSensitive(root, "add_generation_prompt");
    if (agp && !cJSON_IsBool(agp)) {
        cJSON_Delete(agp);
        oai_bad(e, "add_generation_prompt", "invalid_type", "'add_generation_prompt' must be true or false");
        goto out;
    }
    if (agp) j->add_gen = cJSON_IsTrue(agp);
    cJSON_Delete(agp);
    bool chat = cJSON_GetObjectItemCaseSensitive(root, "messages") != NULL;
    if (!cJSON_GetObjectItemCaseSensitive(root, "model") &&
        !cJSON_AddStringToObject(root, "model", g->cfg.model_name)) {
        oai_oom(e);
        goto out;
    }
    rc = oai_parse_tree(j->o, chat ? OAI_CHAT : OAI_COMPLETION, root, e);
out:
    cJSON_Delete(root);
    return rc;
}

static int detokenize_body(const gateway *g, gateway_job *j);
static int tokenize_list(gateway_job *j);

/* On a worker: what only reads the body, the tokenizer and the template. */
static void run_job(const gateway *g, gateway_job *j) {
    if (j->what == TJOB_DETOKENIZE) {
        j->rc = detokenize_body(g, j);
        return;
    }
    j->rc = j->what == TJOB_TOKENIZE ? parse_tokenize(g, j) : oai_parse(j->o, j->kind, j->body, j->len, &j->e);
    if (j->rc == AE_OK) j->rc = gateway_check_model(g, j->o->model, &j->e);
    if (j->rc == AE_OK) j->rc = encode_prompt(g, j->o, j->add_gen, &j->ids, &j->n, &j->e);
    if (j->rc == AE_OK && j->what == TJOB_TOKENIZE) j->rc = tokenize_list(j);
}

static void *worker_main(void *arg) {
    gateway *g = arg;
    pthread_mutex_lock(&g->tmu);
    for (;;) {
        while (!g->todo && !g->stopping) pthread_cond_wait(&g->tcv, &g->tmu);
        if (g->stopping) break;
        gateway_job *j = g->todo;
        g->todo = j->next;
        if (!g->todo) g->todo_last = NULL;
        pthread_mutex_unlock(&g->tmu);
        run_job(g, j);
        pthread_mutex_lock(&g->tmu);
        j->next = g->finished;
        g->finished = j;
        pthread_mutex_unlock(&g->tmu);
        event_active(g->finished_ev, EV_READ, 1);
        pthread_mutex_lock(&g->tmu);
    }
    pthread_mutex_unlock(&g->tmu);
    return NULL;
}

/* On the loop thread: the finished jobs' done callbacks. */
static void on_finished(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    gateway *g = arg;
    pthread_mutex_lock(&g->tmu);
    gateway_job *list = g->finished;
    g->finished = NULL;
    pthread_mutex_unlock(&g->tmu);
    while (list) {
        gateway_job *j = list;
        list = j->next;
        g->jobs--;
        j->done(j);
    }
}

void gateway_job_submit(gateway *g, gateway_job *j, http_req *h, gateway_job_what what, oai_kind kind, oai_request *o,
                        void (*done)(gateway_job *)) {
    size_t len;
    const char *body = http_req_body(h, &len);
    *j = (gateway_job){
        .body = body, .len = len, .what = what, .kind = kind, .o = o, .add_gen = true, .done = done, .rc = AE_ERR};
    g->jobs++;
    pthread_mutex_lock(&g->tmu);
    if (g->todo_last)
        g->todo_last->next = j;
    else
        g->todo = j;
    g->todo_last = j;
    pthread_cond_signal(&g->tcv);
    pthread_mutex_unlock(&g->tmu);
}

/* On failure, workers_stop undoes what was done. */
static int workers_start(gateway *g, ae_error *err) {
    g->finished_ev = event_new(rpc_loop_base(g->loop), -1, 0, on_finished, g);
    if (!g->finished_ev) return err_set(err, "out of memory");
    if (pthread_mutex_init(&g->tmu, NULL) != 0) {
        event_free(g->finished_ev), g->finished_ev = NULL;
        return err_set(err, "pthread_mutex_init failed");
    }
    if (pthread_cond_init(&g->tcv, NULL) != 0) {
        pthread_mutex_destroy(&g->tmu);
        event_free(g->finished_ev), g->finished_ev = NULL;
        return err_set(err, "pthread_cond_init failed");
    }
    for (; g->n_workers < GATEWAY_TOK_WORKERS; g->n_workers++)
        if (pthread_create(&g->workers[g->n_workers], NULL, worker_main, g) != 0)
            return err_set(err, "cannot start a tokenizing worker");
    return AE_OK;
}

/* Stops the workers (a job being tokenized is finished first); on the
 * loop thread, jobs never taken end as 503 and every done runs. */
static void workers_drain_on_loop(void *arg) {
    gateway *g = arg;
    for (gateway_job *j = g->todo, *next; j; j = next) {
        next = j->next;
        j->rc = oai_fail(&j->e, 503, "server_error", "service_unavailable", NULL, "the gateway is shutting down");
        j->next = g->finished;
        g->finished = j;
    }
    g->todo = g->todo_last = NULL;
    on_finished(-1, 0, g);
    event_free(g->finished_ev); /* here: never under its own callback */
    g->finished_ev = NULL;
}

static void workers_stop(gateway *g) {
    if (!g->finished_ev) return;
    pthread_mutex_lock(&g->tmu);
    g->stopping = true;
    pthread_cond_broadcast(&g->tcv);
    pthread_mutex_unlock(&g->tmu);
    for (int i = 0; i < g->n_workers; i++) pthread_join(g->workers[i], NULL);
    rpc_loop_run(g->loop, workers_drain_on_loop, g);
    pthread_cond_destroy(&g->tcv);
    pthread_mutex_destroy(&g->tmu);
}

int gateway_check_model(const gateway *g, const char *model, oai_error *e) {
    if (strcmp(model, g->cfg.model_name) == 0) return AE_OK;
    return oai_fail(e, 404, "invalid_request_error", "model_not_found", "model",
                    "the model '%.200s' does not exist; this server serves '%.200s'", model, g->cfg.model_name);
}

/* The context the targets have (0 when none has reported yet). */
int32_t gateway_context_len(gateway *g) { return router_context(g->cfg.router); }

/* No target has reported its context: e is the 503. */
int gateway_no_target(gateway *g, oai_error *e) {
    char why[512];
    router_healthy(g->cfg.router, why, sizeof why);
    return oai_fail(e, 503, "server_error", "service_unavailable", NULL, "no target is ready (%s)",
                    why[0] ? why : "none has reported its context length yet");
}

/* ---- the other routes ---- */

static int reply_too_large(oai_error *e, const char *what, size_t bytes) {
    return oai_fail(e, 413, "invalid_request_error", "reply_too_large", NULL,
                    "the %s would be over %zu bytes (the limit is %u); send less at once", what, bytes,
                    GATEWAY_MAX_REPLY_BYTES);
}

typedef struct tokreq {
    gateway *g;
    http_req *h;
    oai_request o;
    gateway_job job;
} tokreq;

static void on_tokenized(gateway_job *j);

/* /tokenize and /detokenize: a worker does the job (parsing the body into
 * the request's oai_request when parse), and done answers on the loop. */
static void submit_tokreq(gateway *g, http_req *h, metrics_route route, gateway_job_what what, bool parse,
                          void (*done)(gateway_job *)) {
    oai_error e;
    tokreq *t = calloc(1, sizeof *t);
    if (!t) return gateway_reply_error(g, h, route, (oai_oom(&e), &e));
    t->g = g;
    t->h = h;
    gateway_job_submit(g, &t->job, h, what, OAI_COMPLETION, parse ? &t->o : NULL, done);
}

/* POST /tokenize (see parse_tokenize); on_tokenized answers. */
static void handle_tokenize(gateway *g, http_req *h) {
    submit_tokreq(g, h, METRICS_TOKENIZE, TJOB_TOKENIZE, true, on_tokenized);
}

/* On the worker: "1,2,3]}", the ids' part of the reply, within the limit
 * (the head, written on the loop, is at most 64 bytes). */
static int tokenize_list(gateway_job *j) {
    size_t bytes = 64 + 2;
    for (int32_t i = 0; i < j->n; i++) {
        char num[16];
        bytes += (size_t)snprintf(num, sizeof num, "%d", j->ids[i]) + (i > 0);
    }
    if (bytes > GATEWAY_MAX_REPLY_BYTES) return reply_too_large(&j->e, "list of token ids", bytes);
    if (!jbuf_reserve(&j->reply, bytes)) return oai_oom(&j->e);
    for (int32_t i = 0; i < j->n; i++) jbuf_printf(&j->reply, "%s%d", i ? "," : "", j->ids[i]);
    jbuf_str(&j->reply, "]}");
    return AE_OK;
}

static void on_tokenized(gateway_job *j) {
    tokreq *t = (tokreq *)(void *)((char *)j - offsetof(tokreq, job));
    gateway *g = t->g;
    if (j->rc != AE_OK) {
        gateway_reply_error(g, t->h, METRICS_TOKENIZE, &j->e);
    } else {
        jbuf b = {0};
        jbuf_printf(&b, "{\"count\":%d,\"max_model_len\":%d,\"tokens\":[", j->n, gateway_context_len(g));
        jbuf_add(&b, j->reply.p, j->reply.len);
        gateway_reply_jbuf(g, t->h, METRICS_TOKENIZE, &b);
        jbuf_free(&b);
    }
    free(j->ids);
    jbuf_free(&j->reply);
    oai_request_free(&t->o);
    free(t);
}

/* POST /detokenize: {"tokens": [ids], optional "model"} -> {"prompt": text}.
 * On a worker: parsing half a million ids took the loop ~0.2 s. */
static int detokenize_body(const gateway *g, gateway_job *j) {
    oai_error *e = &j->e;
    ae_error jerr = {{0}};
    cJSON *root = json_parse(j->body, j->len, &jerr);
    int32_t *ids = NULL;
    char *text = NULL;
    int rc = AE_ERR;
    const cJSON *toks = cJSON_GetObjectItemCaseSensitive(root, "tokens");
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!root) {
        oai_bad(e, NULL, "invalid_json", "the body is not valid JSON: %s", jerr.msg);
        goto out;
    }
    for (const cJSON *f = cJSON_IsObject(root) ? root->child : NULL; f; f = f->next)
        if (strcmp(f->string, "tokens") != 0 && strcmp(f->string, "model") != 0) {
            oai_bad(e, f->string, "unsupported_parameter", "'%.60s' is not supported", f->string);
            goto out;
        }
    if (model && !cJSON_IsNull(model) &&
        (!cJSON_IsString(model) ? oai_bad(e, "model", "invalid_type", "'model' must be a string")
                                : gateway_check_model(g, model->valuestring, e)) != AE_OK)
        goto out;
    if (!cJSON_IsArray(toks)) {
        oai_bad(e, "tokens", "invalid_type", "'tokens' must be a list of token ids");
        goto out;
    }
    int n = cJSON_GetArraySize(toks), i = 0;
    ids = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    if (!ids) {
        oai_oom(e);
        goto out;
    }
    for (const cJSON *t = toks->child; t; t = t->next, i++) {
        int64_t v;
        if (!json_int(t, 0, tok_vocab_size(g->cfg.tok) - 1, &v)) {
            oai_bad(e, "tokens", "invalid_value", "tokens[%d] is not a token id of this model (0 to %d)", i,
                    tok_vocab_size(g->cfg.tok) - 1);
            goto out;
        }
        ids[i] = (int32_t)v;
    }
    /* Measured before anything is allocated for it: the text, then its
     * JSON form, must fit the reply's limit. */
    size_t len = 0;
    tok_decode(g->cfg.tok, ids, (size_t)n, false, NULL, 0, &len, NULL);
    if (len + 13 > GATEWAY_MAX_REPLY_BYTES) {
        reply_too_large(e, "text", len + 13);
        goto out;
    }
    text = malloc(len + 1);
    if (!text) {
        oai_oom(e);
        goto out;
    }
    tok_decode(g->cfg.tok, ids, (size_t)n, false, text, len + 1, &len, NULL);
    size_t bytes = jbuf_quoted_len(text, len) + 11;
    if (bytes > GATEWAY_MAX_REPLY_BYTES) {
        reply_too_large(e, "text as JSON", bytes);
        goto out;
    }
    jbuf *b = &j->reply;
    jbuf_str(b, "{\"prompt\":");
    jbuf_quote(b, text, len);
    jbuf_str(b, "}");
    rc = b->oom ? oai_oom(e) : AE_OK;
out:
    free(ids);
    free(text);
    cJSON_Delete(root);
    return rc;
}

static void on_detokenized(gateway_job *j) {
    tokreq *t = (tokreq *)(void *)((char *)j - offsetof(tokreq, job));
    if (j->rc != AE_OK)
        gateway_reply_error(t->g, t->h, METRICS_DETOKENIZE, &j->e);
    else
        gateway_reply_jbuf(t->g, t->h, METRICS_DETOKENIZE, &j->reply);
    jbuf_free(&j->reply);
    free(t);
}

static void handle_detokenize(gateway *g, http_req *h) {
    submit_tokreq(g, h, METRICS_DETOKENIZE, TJOB_DETOKENIZE, false, on_detokenized);
}

static void handle_models(gateway *g, http_req *h, const char *one) {
    jbuf b = {0};
    if (one && strcmp(one, g->cfg.model_name) != 0) {
        oai_error e;
        gateway_check_model(g, one, &e);
        gateway_reply_error(g, h, METRICS_ROUTES, &e);
        return;
    }
    render_model(&b, g->cfg.model_name, g->started, gateway_context_len(g), !one);
    gateway_reply_json(g, h, METRICS_ROUTES, 200, b.p, b.len, NULL);
    jbuf_free(&b);
}

static void handle_health(gateway *g, http_req *h) {
    char why[1024];
    int n = router_healthy(g->cfg.router, why, sizeof why);
    oai_error e;
    if (g->draining) {
        oai_fail(&e, 503, "server_error", "service_unavailable", NULL, "the gateway is shutting down");
    } else if (n == 0 || gateway_context_len(g) <= 0) {
        oai_fail(&e, 503, "server_error", "service_unavailable", NULL, "no target is ready: %s",
                 why[0] ? why : "waiting for the first Info");
    } else {
        char body[128];
        int len = snprintf(body, sizeof body, "{\"status\":\"ok\",\"targets_healthy\":%d,\"targets\":%d}", n,
                           router_count(g->cfg.router));
        http_respond(h, 200, "application/json", NULL, body, (size_t)len);
        return;
    }
    char *json = oai_error_json(&e);
    const char *body = json ? json : OAI_OOM_JSON;
    http_respond(h, 503, "application/json", "Retry-After: 1\r\n", body, strlen(body));
    free(json);
}

static void handle_metrics(gateway *g, http_req *h) {
    metrics_target targets[ROUTER_MAX_TARGETS];
    router_gauges(g->cfg.router, targets);
    metrics_gauges gg = {targets, router_count(g->cfg.router), g->inflight, g->http ? http_server_conns(g->http) : 0};
    size_t len;
    char *text = metrics_render(&g->met, &gg, &len);
    if (!text) {
        oai_error e;
        return gateway_reply_error(g, h, METRICS_ROUTES, (oai_oom(&e), &e));
    }
    http_respond(h, 200, "text/plain; version=0.0.4; charset=utf-8", NULL, text, len);
    free(text);
}

static void handle_server_info(gateway *g, http_req *h) {
    char *peers = router_info_json(g->cfg.router);
    if (!peers) {
        oai_error e;
        return gateway_reply_error(g, h, METRICS_ROUTES, (oai_oom(&e), &e));
    }
    jbuf b = {0};
    jbuf_str(&b, "{\"gateway\":{\"service\":\"aerie-gateway\",\"model\":");
    jbuf_quote(&b, g->cfg.model_name, strlen(g->cfg.model_name));
    jbuf_printf(&b, ",\"vocab\":%d,\"tokenizer\":\"%s\",\"chat_template\":", tok_vocab_size(g->cfg.tok),
                tok_pre_name(tok_pre_kind(g->cfg.tok)));
    if (g->cfg.chat)
        jbuf_printf(&b, "\"%s\"", chat_variant_name(g->cfg.chat));
    else
        jbuf_str(&b, "null");
    jbuf_printf(
        &b, ",\"context\":%d,\"inflight\":%d,\"connections\":%d,\"config\":%s,\"memory_plan\":", gateway_context_len(g),
        g->inflight, http_server_conns(g->http), g->cfg.config_json ? g->cfg.config_json : "{}");
    jbuf_quote(&b, g->cfg.memory_plan ? g->cfg.memory_plan : "", g->cfg.memory_plan ? strlen(g->cfg.memory_plan) : 0);
    /* What the API honours (README.md, "API"). */
    jbuf_printf(
        &b,
        ",\"features\":{\"n_max\":%d,\"logprobs\":true,\"top_logprobs_max\":%d,"
        "\"logprobs_source\":\"raw logits, before penalties, biases, masks and temperature\","
        "\"sampling\":[\"temperature\",\"top_p\",\"top_k\",\"min_p\",\"seed\"],"
        "\"penalties\":[\"presence_penalty\",\"frequency_penalty\",\"repetition_penalty\","
        "\"logit_bias\",\"min_tokens\",\"stop_token_ids\"],"
        "\"response_format\":[\"text\",\"json_object\",\"json_schema\"],"
        "\"json_schema_keywords\":[\"type\",\"properties\",\"required\",\"additionalProperties (false)\","
        "\"enum\",\"const\",\"anyOf\",\"items\",\"minItems\",\"maxItems\",\"minLength\",\"maxLength\","
        "\"minimum\",\"maximum\",\"exclusiveMinimum\",\"exclusiveMaximum\",\"$ref\",\"$defs\","
        "\"definitions\"],\"tools\":[\"none\",\"auto\",\"required\",\"function\"],\"speculative_decoding\":\"EAGLE-3, lossless\"}",
        OAI_MAX_N, OAI_MAX_TOP_LOGPROBS);
    jbuf_str(&b, "},");
    /* peers is {"targets": [...], "drafts": [...]}: its members join ours. */
    jbuf_add(&b, peers + 1, strlen(peers) - 1);
    gateway_reply_jbuf(g, h, METRICS_ROUTES, &b);
    jbuf_free(&b);
    free(peers);
}

/* Keys are compared as SHA-256 digests in constant time, so that timing
 * tells neither how much of a guess was right nor the key's length. */
static bool key_equal(const char *a, size_t na, const char *b) {
    unsigned char da[SHA256_DIGEST_LENGTH], db[SHA256_DIGEST_LENGTH];
    SHA256((const unsigned char *)a, na, da);
    SHA256((const unsigned char *)b, strlen(b), db);
    return CRYPTO_memcmp(da, db, sizeof da) == 0;
}

static int check_key(gateway *g, http_req *h, oai_error *e) {
    if (g->cfg.n_api_keys == 0) return AE_OK;
    const char *auth = http_head_get(http_req_head(h), "authorization");
    if (!auth)
        return oai_fail(e, 401, "invalid_request_error", "invalid_api_key", NULL,
                        "no API key given: send the header 'Authorization: Bearer KEY'");
    if (strncasecmp(auth, "Bearer ", 7) == 0) {
        const char *key = auth + 7;
        size_t n = strlen(key);
        bool ok = false;
        for (int i = 0; i < g->cfg.n_api_keys; i++) ok |= key_equal(key, n, g->cfg.api_keys[i]);
        if (ok) return AE_OK;
    }
    return oai_fail(e, 401, "invalid_request_error", "invalid_api_key", NULL, "the API key is not valid");
}

static void handle_chat(gateway *g, http_req *h) { generate_handle(g, h, OAI_CHAT); }
static void handle_completions(gateway *g, http_req *h) { generate_handle(g, h, OAI_COMPLETION); }
static void handle_model_list(gateway *g, http_req *h) { handle_models(g, h, NULL); }

/* The routes. /v1/models/{id} is matched by its prefix, after these. */
typedef struct gateway_route {
    const char *path;
    bool post;           /* else GET */
    bool open;           /* no API key: a load balancer's probe and Prometheus; GET only, else 404 */
    metrics_route route; /* counted under (METRICS_ROUTES: not counted) */
    void (*handle)(gateway *g, http_req *h);
} gateway_route;

static const gateway_route routes[] = {
    {"/health", false, true, METRICS_ROUTES, handle_health},
    {"/metrics", false, true, METRICS_ROUTES, handle_metrics},
    {"/v1/chat/completions", true, false, METRICS_CHAT, handle_chat},
    {"/v1/completions", true, false, METRICS_COMPLETIONS, handle_completions},
    {"/tokenize", true, false, METRICS_TOKENIZE, handle_tokenize},
    {"/detokenize", true, false, METRICS_DETOKENIZE, handle_detokenize},
    {"/v1/models", false, false, METRICS_ROUTES, handle_model_list},
    {"/server_info", false, false, METRICS_ROUTES, handle_server_info},
};

static void on_request(void *ctx, http_req *h) {
    gateway *g = ctx;
    const http_head *hd = http_req_head(h);
    const char *m = hd->method, *p = hd->path;
    bool get = strcmp(m, "GET") == 0, post = strcmp(m, "POST") == 0;
    oai_error e;
    const gateway_route *r = NULL;
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (strcmp(p, routes[i].path) == 0) r = &routes[i];
    if (r && r->open) {
        if (get) return r->handle(g, h);
        r = NULL;
    }
    bool model_path = !r && strncmp(p, "/v1/models/", 11) == 0 && p[11];
    if (!r && !model_path) {
        oai_fail(&e, 404, "invalid_request_error", "not_found", NULL, "no such route: %.100s %.200s", m, p);
        return gateway_reply_error(g, h, METRICS_ROUTES, &e);
    }
    metrics_route route = r ? r->route : METRICS_ROUTES;
    bool want_post = r && r->post;
    if ((want_post && !post) || (!want_post && !get)) {
        oai_fail(&e, 405, "invalid_request_error", "method_not_allowed", NULL, "%.200s takes %s, not %.20s", p,
                 want_post ? "POST" : "GET", m);
        return gateway_reply_error(g, h, route, &e);
    }
    if (check_key(g, h, &e) != AE_OK) return gateway_reply_error(g, h, route, &e);
    if (model_path) return handle_models(g, h, p + 11);
    r->handle(g, h);
}

/* ---- life cycle ---- */

static void on_log_timer(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    gateway *g = arg;
    double dt = g->cfg.log_interval_ms / 1e3;
    uint64_t req = g->requests_done, toks = g->met.generation_tokens;
    char why[256];
    int healthy = router_healthy(g->cfg.router, why, sizeof why);
    LOG_INFOF("gateway_load req_s=%.2f tok_s=%.1f inflight=%d tokenizing=%d conns=%d targets_healthy=%d/%d",
              (double)(req - g->log_requests) / dt, (double)(toks - g->log_tokens) / dt, g->inflight, g->jobs,
              http_server_conns(g->http), healthy, router_count(g->cfg.router));
    g->log_requests = req;
    g->log_tokens = toks;
}

typedef struct open_job {
    gateway *g;
    ae_error *err;
    int rc;
} open_job;

static void open_on_loop(void *arg) {
    open_job *j = arg;
    gateway *g = j->g;
    http_config hc = {
        .host = g->cfg.host,
        .port = g->cfg.port,
        .max_conns = g->cfg.max_conns,
        .max_head_bytes = GATEWAY_MAX_HEAD_BYTES,
        .max_body_bytes = g->cfg.max_body_bytes,
        .max_out_bytes = GATEWAY_MAX_UNSENT_BYTES,
        .idle_timeout_ms = g->cfg.idle_timeout_ms,
        .handler = on_request,
        .error_body = http_error_body,
        .ctx = g,
    };
    j->rc = http_server_open(&g->http, rpc_loop_base(g->loop), &hc, j->err);
    if (j->rc != AE_OK || g->cfg.log_interval_ms <= 0) return;
    g->log_timer = event_new(rpc_loop_base(g->loop), -1, EV_PERSIST, on_log_timer, g);
    struct timeval tv = {g->cfg.log_interval_ms / 1000, (g->cfg.log_interval_ms % 1000) * 1000};
    AE_ASSERT(g->log_timer && event_add(g->log_timer, &tv) == 0);
}

int gateway_open(gateway **out, rpc_loop *loop, const gateway_config *cfg, ae_error *err) {
    *out = NULL;
    gateway *g = calloc(1, sizeof *g);
    if (!g) return err_set(err, "out of memory");
    g->cfg = *cfg;
    g->loop = loop;
    g->started = (int64_t)time(NULL);
    metrics_init(&g->met);
    if (workers_start(g, err) != AE_OK) {
        workers_stop(g);
        free(g);
        return AE_ERR;
    }
    open_job j = {g, err, AE_ERR};
    rpc_loop_run(loop, open_on_loop, &j);
    if (j.rc != AE_OK) {
        workers_stop(g);
        free(g);
        return AE_ERR;
    }
    *out = g;
    return AE_OK;
}

static void set_draining(void *arg) { ((gateway *)arg)->draining = true; }
void gateway_set_draining(gateway *g) { rpc_loop_run(g->loop, set_draining, g); }

typedef struct int_job {
    gateway *g;
    int v;
} int_job;

static void get_inflight(void *arg) { ((int_job *)arg)->v = ((int_job *)arg)->g->inflight; }
int gateway_inflight(gateway *g) {
    int_job j = {g, 0};
    rpc_loop_run(g->loop, get_inflight, &j);
    return j.v;
}

int gateway_port(gateway *g) { return g->http ? http_server_port(g->http) : 0; }

static void close_on_loop(void *arg) {
    gateway *g = arg;
    if (g->log_timer) event_free(g->log_timer);
    g->log_timer = NULL;
    g->draining = true;
    http_server_close(g->http); /* requests in flight see their client go: they cancel their calls */
}

void gateway_close(gateway *g) {
    if (!g || !g->http) return;
    rpc_loop_run(g->loop, close_on_loop, g);
    g->http = NULL;
    /* A job a worker finishes now is answered (its client is gone) with
     * the router's figures: stop them here, while the router that main
     * closes next is still there. */
    workers_stop(g);
}

void gateway_free(gateway *g) {
    if (!g) return;
    gateway_close(g);
    workers_stop(g);
    free(g);
}
