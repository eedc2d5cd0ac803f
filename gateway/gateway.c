#include "gateway.h"

#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include <event2/event.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>

#include "../services/core/clock.h"
#include "../services/core/json.h"
#include "../services/core/log.h"
#include "../services/rpc/msg.h"
#include "../services/tokenizer/detok.h"
#include "aerie.pb.h"
#include "http.h"
#include "metrics.h"
#include "oai.h"
#include "stop.h"

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "prompt ids travel as int32 little-endian");
_Static_assert(ROUTER_MAX_TARGETS <= 64, "a request's failed replicas are bits of a uint64_t");

typedef struct tjob tjob;

/* A growing text buffer for replies. */
typedef struct jbuf {
    char *p;
    size_t len, cap;
    bool oom; /* an allocation failed: what was added since is lost; the reply becomes a 503 */
} jbuf;

/* A request body to parse and render, tokenize or detokenize on a worker
 * (what is linear in the body's size, off the loop). The loop
 * thread fills the input, hands it over (tjob_submit) and touches nothing
 * of it (nor *o) until done runs, on the loop thread again. */
typedef enum tjob_what { TJOB_GENERATE, TJOB_TOKENIZE, TJOB_DETOKENIZE } tjob_what;

struct tjob {
    tjob *next;
    const char *body; /* [len]: the HTTP request's, alive until it is answered */
    size_t len;
    tjob_what what;
    oai_kind kind; /* TJOB_GENERATE: of this kind */
    void (*done)(tjob *j);
    /* the result */
    int rc;          /* AE_ERR: e says why */
    oai_error e;
    oai_request *o;  /* the parsed request; owned by whoever embeds the job */
    bool add_gen;    /* the generation prompt is rendered */
    int32_t *ids;    /* [n], malloc'd; the done callback takes it */
    int32_t n;
    jbuf reply;      /* TJOB_TOKENIZE: the ids' JSON list; TJOB_DETOKENIZE: the whole body */
};

struct gw {
    gw_config cfg;
    rpc_loop *loop;
    http_server *http;
    metrics met;
    int inflight;
    bool draining;
    int64_t started; /* unix seconds, for /v1/models */
    struct event *log_timer;
    uint64_t log_requests, log_tokens; /* at the last load line */
    uint64_t requests_done;
    /* The tokenizing workers: a queue in, a list out and an event that
     * wakes the loop for it (libevent is set up for threads by rpc.c). */
    pthread_t workers[GW_TOK_WORKERS];
    int n_workers;
    pthread_mutex_t tmu;
    pthread_cond_t tcv;
    tjob *todo, *todo_last, *finished;
    bool stopping; /* the workers exit */
    struct event *finished_ev;
    int jobs; /* submitted and not yet done: for the load line */
};

static int check_model(const gw *g, const char *model, oai_error *e);

/* ---- a growing text buffer for replies ---- */

static bool jb_reserve(jbuf *b, size_t more) {
    if (b->oom) return false;
    if (b->len + more + 1 <= b->cap) return true;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + more + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        b->oom = true;
        return false;
    }
    b->p = p;
    b->cap = cap;
    return true;
}

static void jb_add(jbuf *b, const char *s, size_t n) {
    if (!jb_reserve(b, n)) return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void jb_str(jbuf *b, const char *s) { jb_add(b, s, strlen(s)); }

static void jb_printf(jbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void jb_printf(jbuf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    AE_ASSERT(n >= 0);
    if (!jb_reserve(b, (size_t)n)) return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

/* s[0..n) (valid UTF-8) as a JSON string, quotes included. */
/* The bytes jb_quote adds for s[0..n). */
static size_t jb_quoted_len(const char *s, size_t n) {
    size_t k = n + 2;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\' || c == '\n') k += 1;
        else if (c < 0x20) k += 5;
    }
    return k;
}

static void jb_quote(jbuf *b, const char *s, size_t n) {
    if (!jb_reserve(b, 6 * n + 2)) return;
    char *w = b->p + b->len;
    *w++ = '"';
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            *w++ = '\\';
            *w++ = (char)c;
        } else if (c == '\n') {
            *w++ = '\\', *w++ = 'n';
        } else if (c < 0x20) {
            w += sprintf(w, "\\u%04x", c);
        } else {
            *w++ = (char)c;
        }
    }
    *w++ = '"';
    b->len = (size_t)(w - b->p);
    b->p[b->len] = '\0';
}

static void jb_clear(jbuf *b) {
    b->len = 0;
    b->oom = false;
}

static void jb_free(jbuf *b) {
    free(b->p);
    *b = (jbuf){0};
}

/* ---- replies ---- */

static void reply_json(gw *g, http_req *h, met_route route, int status, const char *body, size_t len,
                       const char *extra) {
    if (route < MET_ROUTES) met_request(&g->met, route, status);
    http_respond(h, status, "application/json", extra, body, len);
}

static void reply_error(gw *g, http_req *h, met_route route, const oai_error *e) {
    char *json = oai_error_json(e);
    const char *body = json ? json : OAI_OOM_JSON;
    const char *extra = NULL;
    if (e->status == 429 || e->status == 503) extra = "Retry-After: 1\r\n";
    else if (e->status == 401) extra = "WWW-Authenticate: Bearer\r\n";
    if (e->status >= 500 || e->status == 429)
        LOG_INFOF("request_refused status=%d peer=%s reason=\"%s\"", e->status, http_req_peer(h), e->message);
    reply_json(g, h, route, e->status, body, strlen(body), extra);
    free(json);
}

/* A reply built in b, or the 503 its allocation failure calls for. */
static void reply_jbuf(gw *g, http_req *h, met_route route, jbuf *b) {
    oai_error e;
    if (b->oom) reply_error(g, h, route, (oai_oom(&e), &e));
    else reply_json(g, h, route, 200, b->p, b->len, NULL);
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

/* ---- generation ---- */

typedef struct greq {
    gw *g;
    http_req *http;
    oai_request o;
    met_route route;
    char id[48];
    int64_t created;
    /* the prompt, then every token generated: what a retry resends */
    int32_t *ids; /* [n_prompt + max_tokens] */
    int32_t n_prompt, n_out, max_tokens;
    uint64_t seed;
    int replica;     /* -1: no call */
    uint64_t tried;  /* replicas that failed this request */
    uint32_t call_id;
    detok *dt;
    stop_matcher *sm;
    char *piece, *text;     /* [detok_max_out], [stop_max_out] */
    jbuf out;               /* non-streamed: the whole text; streamed: the next event */
    jbuf delta;             /* streamed: text not yet sent */
    jbuf head;              /* streamed: the start of every chunk */
    bool started;           /* the stream's head was sent */
    bool gone;              /* the client went away */
    bool stopped;           /* a stop string matched */
    bool target_cancelled;  /* the target cancelled it (shutting down, or a Cancel by id) */
    int finish;             /* aerie_FinishReason */
    double t_arrive, t_first, t_last;
    aerie_SpecStats spec;
    bool has_spec;
    tjob job; /* the prompt's tokenizing, before the call */
} greq;

static void greq_free(greq *q) {
    oai_request_free(&q->o);
    free(q->job.ids);
    free(q->ids);
    detok_free(q->dt);
    stop_free(q->sm);
    free(q->piece);
    free(q->text);
    jb_free(&q->out);
    jb_free(&q->delta);
    jb_free(&q->head);
    free(q);
}

static const char *finish_name(int f) { return f == aerie_FinishReason_FINISH_LENGTH ? "length" : "stop"; }

static bool is_chat(const greq *q) { return q->o.kind == OAI_CHAT; }

/* The part every streamed chunk starts with, formatted once per request. */
static void chunk_head(greq *q, jbuf *b) {
    jbuf *h = &q->head;
    if (!h->len) {
        jb_printf(h, "data: {\"id\":\"%s\",\"object\":\"%s\",\"created\":%lld,\"model\":", q->id,
                  is_chat(q) ? "chat.completion.chunk" : "text_completion", (long long)q->created);
        jb_quote(h, q->g->cfg.model_name, strlen(q->g->cfg.model_name));
    }
    jb_add(b, h->p, h->len);
}

static void add_usage(greq *q, jbuf *b) {
    jb_printf(b, "\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,\"total_tokens\":%d}", q->n_prompt,
              q->n_out, q->n_prompt + q->n_out);
}

/* One chunk with text (or, for chat, the opening role) and maybe the
 * finish reason. */
static void send_chunk(greq *q, const char *text, size_t n, bool role, const char *finish) {
    jbuf *b = &q->out;
    jb_clear(b);
    chunk_head(q, b);
    jb_str(b, ",\"choices\":[{\"index\":0,");
    if (is_chat(q)) {
        jb_str(b, "\"delta\":{");
        if (role) jb_str(b, "\"role\":\"assistant\",\"content\":\"\"");
        else if (text) jb_str(b, "\"content\":"), jb_quote(b, text, n);
        jb_str(b, "}");
    } else {
        jb_str(b, "\"text\":");
        jb_quote(b, text ? text : "", text ? n : 0);
    }
    jb_str(b, ",\"logprobs\":null,\"finish_reason\":");
    if (finish) jb_printf(b, "\"%s\"", finish);
    else jb_str(b, "null");
    jb_str(b, "}]");
    if (q->o.include_usage) jb_str(b, ",\"usage\":null");
    jb_str(b, "}\n\n");
    /* Out of memory mid-stream: the chunk is lost, not the gateway. */
    if (b->oom) LOG_WARNF("chunk_lost id=%s reason=\"out of memory\"", q->id);
    else http_stream_write(q->http, b->p, b->len);
}

static void stream_start(greq *q) {
    if (q->started) return;
    q->started = true;
    char extra[96];
    snprintf(extra, sizeof extra, "Cache-Control: no-cache\r\nX-Request-Id: %s\r\n", q->id);
    http_stream_start(q->http, 200, "text/event-stream", extra);
    if (is_chat(q)) send_chunk(q, NULL, 0, true, NULL);
}

static void flush_delta(greq *q) {
    if (!q->o.stream || q->gone || q->delta.len == 0) return;
    stream_start(q);
    send_chunk(q, q->delta.p, q->delta.len, false, NULL);
    q->delta.len = 0;
}

/* Text the stop strings released. */
static void emit(greq *q, const char *s, size_t n) {
    if (n) jb_add(q->o.stream ? &q->delta : &q->out, s, n);
}

static void take_token(greq *q, int32_t t) {
    size_t plen = 0, tlen = 0;
    q->ids[q->n_prompt + q->n_out++] = t;
    /* The target checked the id against its vocabulary, and ours is the
     * same model's: an id we cannot decode means the two were deployed
     * with different models. It adds no text, and serving goes on. */
    if (detok_push(q->dt, t, q->piece, detok_max_out(q->dt), &plen, NULL) != AE_OK) plen = 0;
    q->stopped = stop_push(q->sm, q->piece, plen, q->text, stop_max_out(q->sm), &tlen);
    emit(q, q->text, tlen);
}

/* The stream of tokens ended (finish reason known): releases what the
 * detokenizer and the stop strings still hold. */
static void take_end(greq *q) {
    size_t tlen = 0;
    if (!q->stopped) {
        size_t plen = detok_flush(q->dt, q->piece, detok_max_out(q->dt));
        q->stopped = stop_push(q->sm, q->piece, plen, q->text, stop_max_out(q->sm), &tlen);
        emit(q, q->text, tlen);
    }
    if (!q->stopped) {
        /* The flush may settle a match that waited for a longer stop
         * starting earlier (stop.h): that ends the request on a stop too. */
        emit(q, q->text, stop_flush(q->sm, q->text, stop_max_out(q->sm)));
        q->stopped = stop_matched(q->sm);
    }
    if (q->stopped) q->finish = aerie_FinishReason_FINISH_STOP;
}

/* Called by the RPC link for each GenerateEvent, on the loop thread and
 * under the client's lock: nothing here calls into the client. */
static bool on_event(void *ctx, const uint8_t *msg, uint32_t len) {
    greq *q = ctx;
    aerie_GenerateEvent ev;
    if (q->gone || q->finish || q->target_cancelled) return false;
    if (msg_decode(aerie_GenerateEvent_fields, &ev, msg, len, NULL) != AE_OK) return false;
    double now = clock_mono_seconds();
    if (ev.tokens_count > 0) {
        if (!q->t_first) {
            q->t_first = now;
            met_hist_observe(&q->g->met.ttft, now - q->t_arrive);
        } else {
            double gap = (now - q->t_last) / ev.tokens_count;
            for (pb_size_t i = 0; i < ev.tokens_count; i++) met_hist_observe(&q->g->met.itl, gap);
        }
        q->t_last = now;
    }
    for (pb_size_t i = 0; i < ev.tokens_count && !q->stopped; i++) {
        if (q->n_out >= q->max_tokens) break; /* a target never sends more; do not trust it to */
        take_token(q, ev.tokens[i]);
    }
    if (ev.finish == aerie_FinishReason_FINISH_CANCELLED && !q->stopped && q->n_out < q->max_tokens) {
        /* Not ours to end: on_end goes on at another replica. */
        q->target_cancelled = true;
        flush_delta(q);
        return false;
    }
    if (ev.finish != aerie_FinishReason_FINISH_NONE || q->stopped || q->n_out >= q->max_tokens) {
        q->finish = q->stopped                                     ? aerie_FinishReason_FINISH_STOP
                    : ev.finish == aerie_FinishReason_FINISH_NONE ? aerie_FinishReason_FINISH_LENGTH
                                                                   : ev.finish;
        if (ev.has_spec) q->spec = ev.spec, q->has_spec = true;
        take_end(q);
    }
    flush_delta(q);
    return !q->finish;
}

static void finish_ok(greq *q) {
    gw *g = q->g;
    metrics *m = &g->met;
    m->prompt_tokens += (uint64_t)q->n_prompt;
    m->generation_tokens += (uint64_t)q->n_out;
    met_hist_observe(&m->prompt_hist, q->n_prompt);
    met_hist_observe(&m->generation_hist, q->n_out);
    if (q->finish == aerie_FinishReason_FINISH_LENGTH) m->finish.length++;
    else m->finish.stop++;
    if (q->has_spec) {
        m->spec_steps += q->spec.steps;
        m->spec_plain_steps += q->spec.plain_steps;
        m->spec_drafted += q->spec.drafted;
        m->spec_accepted += q->spec.accepted;
        for (pb_size_t d = 0; d < q->spec.accepted_at_count && d < MET_SPEC_POSITIONS; d++)
            m->spec_accepted_at[d] += q->spec.accepted_at[d];
    }
    const char *fin = finish_name(q->finish);
    if (q->o.stream) {
        stream_start(q);
        send_chunk(q, NULL, 0, false, fin);
        if (q->o.include_usage) {
            jbuf *b = &q->out;
            jb_clear(b);
            chunk_head(q, b);
            jb_str(b, ",\"choices\":[],");
            add_usage(q, b);
            jb_str(b, "}\n\n");
            if (!b->oom) http_stream_write(q->http, b->p, b->len);
        }
        http_stream_write(q->http, "data: [DONE]\n\n", 14);
        met_request(m, q->route, 200);
        http_stream_end(q->http);
    } else {
        jbuf b = {0};
        jb_printf(&b, "{\"id\":\"%s\",\"object\":\"%s\",\"created\":%lld,\"model\":", q->id,
                  is_chat(q) ? "chat.completion" : "text_completion", (long long)q->created);
        jb_quote(&b, g->cfg.model_name, strlen(g->cfg.model_name));
        jb_str(&b, ",\"choices\":[{\"index\":0,");
        if (is_chat(q)) jb_str(&b, "\"message\":{\"role\":\"assistant\",\"content\":");
        else jb_str(&b, "\"text\":");
        jb_quote(&b, q->out.p ? q->out.p : "", q->out.len);
        if (is_chat(q)) jb_str(&b, "}");
        jb_printf(&b, ",\"logprobs\":null,\"finish_reason\":\"%s\"}],", fin);
        add_usage(q, &b);
        jb_str(&b, "}");
        b.oom |= q->out.oom; /* the text is incomplete */
        reply_jbuf(g, q->http, q->route, &b);
        jb_free(&b);
    }
    double now = clock_mono_seconds();
    met_hist_observe(&m->e2e, now - q->t_arrive);
    LOG_INFOF("request id=%s route=%s target=%s prompt=%d completion=%d finish=%s ttft_ms=%.1f e2e_ms=%.1f", q->id,
              is_chat(q) ? "chat" : "completions", q->replica >= 0 ? router_addr(g->cfg.router, q->replica) : "-",
              q->n_prompt, q->n_out, fin, q->t_first ? (q->t_first - q->t_arrive) * 1e3 : -1.0,
              (now - q->t_arrive) * 1e3);
}

/* The request failed: an error reply, or an error event when the stream
 * has started. */
static void finish_error(greq *q, const oai_error *e) {
    gw *g = q->g;
    g->met.finish.error++;
    if (!q->started) {
        reply_error(g, q->http, q->route, e);
        return;
    }
    char *json = oai_error_json(e);
    jbuf b = {0};
    jb_printf(&b, "data: %s\n\ndata: [DONE]\n\n", json ? json : OAI_OOM_JSON);
    if (!b.oom) http_stream_write(q->http, b.p, b.len);
    jb_free(&b);
    free(json);
    met_request(&g->met, q->route, e->status);
    http_stream_end(q->http);
    LOG_WARNF("request_failed id=%s status=%d reason=\"%s\"", q->id, e->status, e->message);
}

static void request_done(greq *q) {
    q->g->inflight--;
    q->g->requests_done++;
    greq_free(q);
}

static int start_call(greq *q, ae_error *err);

static void on_end(void *ctx, const rpc_reply *r) {
    greq *q = ctx;
    gw *g = q->g;
    router_end(g->cfg.router, q->replica);
    if (q->gone) {
        g->met.finish.cancelled++;
        met_request(&g->met, q->route, 499);
        LOG_INFOF("request_cancelled id=%s reason=\"the client went away\" completion=%d", q->id, q->n_out);
        /* Only frees the request: the client is gone. */
        if (q->started) http_stream_end(q->http);
        else http_respond(q->http, 499, "application/json", NULL, NULL, 0);
        request_done(q);
        return;
    }
    if (q->finish) {
        finish_ok(q);
        request_done(q);
        return;
    }
    oai_error e;
    if (r->status == RPC_UNAVAILABLE || q->target_cancelled) {
        /* The replica failed or is shutting down: go on elsewhere with the
         * tokens we have. */
        router_fail(g->cfg.router, q->replica, q->target_cancelled ? "it cancelled a request" : r->error);
        q->target_cancelled = false;
        q->tried |= UINT64_C(1) << q->replica;
        ae_error err = {{0}};
        if (start_call(q, &err) == AE_OK) {
            g->met.retries++;
            return;
        }
        oai_fail(&e, 503, "server_error", "service_unavailable", NULL, "the target failed (%s) and %s", r->error,
                 err.msg);
    } else if (r->status == RPC_INVALID_ARGUMENT) {
        oai_bad(&e, NULL, "invalid_value", "%s", r->error);
    } else if (r->status == RPC_RESOURCE_EXHAUSTED) {
        oai_fail(&e, 429, "rate_limit_error", "rate_limit_exceeded", NULL, "the target is full: %s", r->error);
    } else if (r->status == RPC_DEADLINE_EXCEEDED) {
        oai_fail(&e, 504, "server_error", "timeout", NULL, "the target did not answer in time: %s", r->error);
    } else {
        oai_fail(&e, 502, "server_error", "target_error", NULL, "the target failed: %s (status %u)", r->error,
                 r->status);
    }
    finish_error(q, &e);
    request_done(q);
}

/* Sends the prompt (and whatever was generated before a retry) to the
 * least-loaded healthy replica not yet tried. */
static int start_call(greq *q, ae_error *err) {
    gw *g = q->g;
    for (;;) {
        int i = router_pick(g->cfg.router, q->tried);
        if (i < 0) {
            char why[512];
            router_healthy(g->cfg.router, why, sizeof why);
            return err_set(err, "no target is ready (%s)", why[0] ? why : "every one failed this request");
        }
        aerie_GenerateRequest gr = aerie_GenerateRequest_init_zero;
        snprintf(gr.request_id, sizeof gr.request_id, "%s", q->id);
        gr.max_tokens = (uint32_t)(q->max_tokens - q->n_out);
        gr.temperature = (float)q->o.temperature;
        gr.top_k = (uint32_t)q->o.top_k;
        gr.top_p = (float)q->o.top_p;
        gr.min_p = (float)q->o.min_p;
        /* A retry draws from another point of the seed's stream; the
         * output is still distributed as the target's. */
        gr.seed = q->seed + (uint64_t)q->n_out;
        gr.ignore_eos = q->o.ignore_eos;
        uint32_t n = (uint32_t)(q->n_prompt + q->n_out);
        gr.has_prompt = true;
        gr.prompt = (aerie_PayloadRef){0, n * 4};
        uint8_t buf[aerie_GenerateRequest_size];
        uint32_t len;
        if (msg_encode(aerie_GenerateRequest_fields, &gr, buf, sizeof buf, &len, err) != AE_OK) return AE_ERR;
        rpc_iov iov = {q->ids, n * 4};
        q->replica = i;
        router_begin(g->cfg.router, i);
        rpc_client *cl = router_client(g->cfg.router, i);
        if (rpc_client_start(cl, aerie_Method_TARGET_GENERATE, buf, len, &iov, 1, 0, on_event, on_end, q,
                             &q->call_id, err) == AE_OK)
            return AE_OK;
        router_end(g->cfg.router, i);
        /* Only a lost connection says the replica is down; a request the
         * link refuses (over the frame limit) fails alone. */
        if (rpc_client_connected(cl)) return AE_ERR;
        err_clear(err);
        router_fail(g->cfg.router, i, "not connected");
        q->tried |= UINT64_C(1) << i;
    }
}

static void on_client_gone(void *arg) {
    greq *q = arg;
    q->gone = true;
    /* While its prompt is being tokenized there is no call yet. */
    if (q->replica >= 0) rpc_client_cancel(router_client(q->g->cfg.router, q->replica), q->call_id);
}

/* Renders and tokenizes what the request asks about: a conversation (with
 * the generation prompt when add_gen) or a prompt's text or ids. Runs on a
 * tokenizing worker: it reads only o and the immutable tokenizer and
 * template. */
static int encode_prompt(const gw *g, const oai_request *o, bool add_gen, int32_t **ids, int32_t *n, oai_error *e) {
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
        if (chat_render_alloc(g->cfg.chat, o->msgs, o->n_msgs, add_gen, &rendered, &len, &err) != AE_OK)
            return oai_bad(e, "messages", "invalid_value", "%s", err.msg);
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
 * GW_TOK_WORKER_BYTES); a queued job holds only its request, which the
 * gateway already counts. */

/* A /tokenize body: {"prompt": text} or {"messages": [...],
 * "add_generation_prompt": bool}, optional "model". The same parser as
 * generation, so a text tokenizes here exactly as it would be sent:
 * add_generation_prompt (ours alone) is taken off first. */
static int parse_tokenize(const gw *g, tjob *j) {
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

static int detokenize_body(const gw *g, tjob *j);
static int tokenize_list(tjob *j);

/* On a worker: what only reads the body, the tokenizer and the template. */
static void run_job(const gw *g, tjob *j) {
    if (j->what == TJOB_DETOKENIZE) {
        j->rc = detokenize_body(g, j);
        return;
    }
    j->rc = j->what == TJOB_TOKENIZE ? parse_tokenize(g, j) : oai_parse(j->o, j->kind, j->body, j->len, &j->e);
    if (j->rc == AE_OK) j->rc = check_model(g, j->o->model, &j->e);
    if (j->rc == AE_OK) j->rc = encode_prompt(g, j->o, j->add_gen, &j->ids, &j->n, &j->e);
    if (j->rc == AE_OK && j->what == TJOB_TOKENIZE) j->rc = tokenize_list(j);
}

static void *worker_main(void *arg) {
    gw *g = arg;
    pthread_mutex_lock(&g->tmu);
    for (;;) {
        while (!g->todo && !g->stopping) pthread_cond_wait(&g->tcv, &g->tmu);
        if (g->stopping) break;
        tjob *j = g->todo;
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
    gw *g = arg;
    pthread_mutex_lock(&g->tmu);
    tjob *list = g->finished;
    g->finished = NULL;
    pthread_mutex_unlock(&g->tmu);
    while (list) {
        tjob *j = list;
        list = j->next;
        g->jobs--;
        j->done(j);
    }
}

static void tjob_submit(gw *g, tjob *j, http_req *h, tjob_what what, oai_kind kind, oai_request *o,
                        void (*done)(tjob *)) {
    size_t len;
    const char *body = http_req_body(h, &len);
    *j = (tjob){.body = body, .len = len, .what = what, .kind = kind, .o = o, .add_gen = true, .done = done,
                .rc = AE_ERR};
    g->jobs++;
    pthread_mutex_lock(&g->tmu);
    if (g->todo_last) g->todo_last->next = j;
    else g->todo = j;
    g->todo_last = j;
    pthread_cond_signal(&g->tcv);
    pthread_mutex_unlock(&g->tmu);
}

/* On failure, workers_stop undoes what was done. */
static int workers_start(gw *g, ae_error *err) {
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
    for (; g->n_workers < GW_TOK_WORKERS; g->n_workers++)
        if (pthread_create(&g->workers[g->n_workers], NULL, worker_main, g) != 0)
            return err_set(err, "cannot start a tokenizing worker");
    return AE_OK;
}

/* Stops the workers (a job being tokenized is finished first); on the
 * loop thread, jobs never taken end as 503 and every done runs. */
static void workers_drain_on_loop(void *arg) {
    gw *g = arg;
    for (tjob *j = g->todo, *next; j; j = next) {
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

static void workers_stop(gw *g) {
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

static int check_model(const gw *g, const char *model, oai_error *e) {
    if (strcmp(model, g->cfg.model_name) == 0) return AE_OK;
    return oai_fail(e, 404, "invalid_request_error", "model_not_found", "model",
                    "the model '%.200s' does not exist; this server serves '%.200s'", model, g->cfg.model_name);
}

/* The context the targets have (0 when none has reported yet). */
static int32_t context_len(gw *g) { return router_context(g->cfg.router); }

/* No target has reported its context: e is the 503. */
static int no_target(gw *g, oai_error *e) {
    char why[512];
    router_healthy(g->cfg.router, why, sizeof why);
    return oai_fail(e, 503, "server_error", "service_unavailable", NULL, "no target is ready (%s)",
                    why[0] ? why : "none has reported its context length yet");
}

static void on_prompt_encoded(tjob *j);

/* A generation request: parsed and tokenized by a worker (a 1 MiB body
 * of any shape costs the loop nothing but its bytes), then checked and
 * sent to a target by on_prompt_encoded. */
static void handle_generate(gw *g, http_req *h, oai_kind kind) {
    met_route route = kind == OAI_CHAT ? MET_CHAT : MET_COMPLETIONS;
    oai_error e;
    greq *q = calloc(1, sizeof *q);
    if (!q) return reply_error(g, h, route, (oai_oom(&e), &e));
    q->g = g;
    q->http = h;
    q->route = route;
    q->replica = -1;
    q->t_arrive = clock_mono_seconds();
    http_req_on_close(h, on_client_gone, q);
    tjob_submit(g, &q->job, h, TJOB_GENERATE, kind, &q->o, on_prompt_encoded);
}

static void on_prompt_encoded(tjob *j) {
    greq *q = (greq *)(void *)((char *)j - offsetof(greq, job));
    gw *g = q->g;
    oai_kind kind = j->kind;
    oai_error e;
    if (q->gone) {
        g->met.finish.cancelled++;
        met_request(&g->met, q->route, 499);
        LOG_INFOF("request_cancelled id=- reason=\"the client went away while its prompt was tokenized\"");
        http_respond(q->http, 499, "application/json", NULL, NULL, 0); /* only frees it */
        greq_free(q);
        return;
    }
    if (j->rc != AE_OK) {
        e = j->e;
        goto refuse;
    }
    q->ids = j->ids;
    q->n_prompt = j->n;
    j->ids = NULL;
    /* The checks of the gateway's state come after the worker, in the
     * order they always had: a bad body is 400 whatever the load. */
    if (g->draining) {
        oai_fail(&e, 503, "server_error", "service_unavailable", NULL, "the gateway is shutting down");
        goto refuse;
    }
    if (g->inflight >= g->cfg.max_inflight) {
        oai_fail(&e, 429, "rate_limit_error", "rate_limit_exceeded", NULL,
                 "%d requests are in flight (the gateway's max-inflight); retry later", g->inflight);
        goto refuse;
    }
    int32_t ctx = context_len(g);
    if (ctx <= 0) {
        no_target(g, &e);
        goto refuse;
    }
    int32_t max_prompt = g->cfg.max_prompt_tokens > 0 && g->cfg.max_prompt_tokens < ctx ? g->cfg.max_prompt_tokens
                                                                                        : ctx - 1;
    if (q->n_prompt < 1) {
        oai_bad(&e, kind == OAI_CHAT ? "messages" : "prompt", "invalid_value", "the prompt has no tokens");
        goto refuse;
    }
    if (q->n_prompt > max_prompt) {
        oai_bad(&e, kind == OAI_CHAT ? "messages" : "prompt", "context_length_exceeded",
                "the prompt has %d tokens; at most %d fit (the context is %d tokens)", q->n_prompt, max_prompt, ctx);
        goto refuse;
    }
    int32_t limit = g->cfg.max_tokens_limit > 0 ? g->cfg.max_tokens_limit : ctx;
    const char *mt_param = q->o.max_tokens_field;
    if (q->o.max_tokens > limit) {
        oai_bad(&e, mt_param, "invalid_value", "%s is %lld; this server allows at most %d", mt_param,
                (long long)q->o.max_tokens, limit);
        goto refuse;
    }
    if (q->o.max_tokens > 0 && q->n_prompt + q->o.max_tokens > ctx) {
        oai_bad(&e, mt_param, "context_length_exceeded",
                "the prompt (%d tokens) and %s (%lld) are more than the context of %d tokens", q->n_prompt, mt_param,
                (long long)q->o.max_tokens, ctx);
        goto refuse;
    }
    q->max_tokens = q->o.max_tokens > 0 ? (int32_t)q->o.max_tokens : g->cfg.default_max_tokens;
    if (q->max_tokens > ctx - q->n_prompt) q->max_tokens = ctx - q->n_prompt;
    int32_t *all = realloc(q->ids, sizeof(int32_t) * (size_t)(q->n_prompt + q->max_tokens));
    if (!all) {
        oai_oom(&e);
        goto refuse;
    }
    q->ids = all;
    ae_error err = {{0}};
    if (detok_init(&q->dt, g->cfg.tok, true, &err) != AE_OK ||
        stop_init(&q->sm, (const char *const *)q->o.stops, q->o.stop_lens, q->o.n_stops, detok_max_out(q->dt) + 3,
                  &err) != AE_OK) {
        oai_fail(&e, 500, "server_error", NULL, NULL, "%s", err.msg);
        goto refuse;
    }
    q->piece = malloc(detok_max_out(q->dt) + 3);
    q->text = malloc(stop_max_out(q->sm) + 1);
    if (!q->piece || !q->text) {
        oai_oom(&e);
        goto refuse;
    }
    if (q->o.has_seed) q->seed = q->o.seed;
    else if (getrandom(&q->seed, sizeof q->seed, 0) != (ssize_t)sizeof q->seed) q->seed = (uint64_t)(clock_mono_seconds() * 1e9);
    uint8_t rnd[12];
    if (getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) memset(rnd, 0, sizeof rnd);
    int w = snprintf(q->id, sizeof q->id, "%s-", kind == OAI_CHAT ? "chatcmpl" : "cmpl");
    for (size_t i = 0; i < sizeof rnd; i++) w += snprintf(q->id + w, sizeof q->id - (size_t)w, "%02x", rnd[i]);
    q->created = (int64_t)time(NULL);
    if (start_call(q, &err) != AE_OK) {
        oai_fail(&e, 503, "server_error", "service_unavailable", NULL, "%s", err.msg);
        goto refuse;
    }
    g->inflight++;
    return;
refuse:
    reply_error(g, q->http, q->route, &e);
    greq_free(q);
}

/* ---- the other routes ---- */


static int reply_too_large(oai_error *e, const char *what, size_t bytes) {
    return oai_fail(e, 413, "invalid_request_error", "reply_too_large", NULL,
                    "the %s would be over %zu bytes (the limit is %u); send less at once", what, bytes,
                    GW_MAX_REPLY_BYTES);
}

typedef struct tokreq {
    gw *g;
    http_req *h;
    oai_request o;
    tjob job;
} tokreq;

static void on_tokenized(tjob *j);

/* /tokenize and /detokenize: a worker does the job (parsing the body into
 * the request's oai_request when parse), and done answers on the loop. */
static void submit_tokreq(gw *g, http_req *h, met_route route, tjob_what what, bool parse, void (*done)(tjob *)) {
    oai_error e;
    tokreq *t = calloc(1, sizeof *t);
    if (!t) return reply_error(g, h, route, (oai_oom(&e), &e));
    t->g = g;
    t->h = h;
    tjob_submit(g, &t->job, h, what, OAI_COMPLETION, parse ? &t->o : NULL, done);
}

/* POST /tokenize (see parse_tokenize); on_tokenized answers. */
static void handle_tokenize(gw *g, http_req *h) {
    submit_tokreq(g, h, MET_TOKENIZE, TJOB_TOKENIZE, true, on_tokenized);
}

/* On the worker: "1,2,3]}", the ids' part of the reply, within the limit
 * (the head, written on the loop, is at most 64 bytes). */
static int tokenize_list(tjob *j) {
    size_t bytes = 64 + 2;
    for (int32_t i = 0; i < j->n; i++) {
        char num[16];
        bytes += (size_t)snprintf(num, sizeof num, "%d", j->ids[i]) + (i > 0);
    }
    if (bytes > GW_MAX_REPLY_BYTES) return reply_too_large(&j->e, "list of token ids", bytes);
    if (!jb_reserve(&j->reply, bytes)) return oai_oom(&j->e);
    for (int32_t i = 0; i < j->n; i++) jb_printf(&j->reply, "%s%d", i ? "," : "", j->ids[i]);
    jb_str(&j->reply, "]}");
    return AE_OK;
}

static void on_tokenized(tjob *j) {
    tokreq *t = (tokreq *)(void *)((char *)j - offsetof(tokreq, job));
    gw *g = t->g;
    if (j->rc != AE_OK) {
        reply_error(g, t->h, MET_TOKENIZE, &j->e);
    } else {
        jbuf b = {0};
        jb_printf(&b, "{\"count\":%d,\"max_model_len\":%d,\"tokens\":[", j->n, context_len(g));
        jb_add(&b, j->reply.p, j->reply.len);
        reply_jbuf(g, t->h, MET_TOKENIZE, &b);
        jb_free(&b);
    }
    free(j->ids);
    jb_free(&j->reply);
    oai_request_free(&t->o);
    free(t);
}

/* POST /detokenize: {"tokens": [ids], optional "model"} -> {"prompt": text}.
 * On a worker: parsing half a million ids took the loop ~0.2 s. */
static int detokenize_body(const gw *g, tjob *j) {
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
                                : check_model(g, model->valuestring, e)) != AE_OK)
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
    if (len + 13 > GW_MAX_REPLY_BYTES) {
        reply_too_large(e, "text", len + 13);
        goto out;
    }
    text = malloc(len + 1);
    if (!text) {
        oai_oom(e);
        goto out;
    }
    tok_decode(g->cfg.tok, ids, (size_t)n, false, text, len + 1, &len, NULL);
    size_t bytes = jb_quoted_len(text, len) + 11;
    if (bytes > GW_MAX_REPLY_BYTES) {
        reply_too_large(e, "text as JSON", bytes);
        goto out;
    }
    jbuf *b = &j->reply;
    jb_str(b, "{\"prompt\":");
    jb_quote(b, text, len);
    jb_str(b, "}");
    rc = b->oom ? oai_oom(e) : AE_OK;
out:
    free(ids);
    free(text);
    cJSON_Delete(root);
    return rc;
}

static void on_detokenized(tjob *j) {
    tokreq *t = (tokreq *)(void *)((char *)j - offsetof(tokreq, job));
    if (j->rc != AE_OK) reply_error(t->g, t->h, MET_DETOKENIZE, &j->e);
    else reply_jbuf(t->g, t->h, MET_DETOKENIZE, &j->reply);
    jb_free(&j->reply);
    free(t);
}

static void handle_detokenize(gw *g, http_req *h) {
    submit_tokreq(g, h, MET_DETOKENIZE, TJOB_DETOKENIZE, false, on_detokenized);
}

static void handle_models(gw *g, http_req *h, const char *one) {
    jbuf b = {0};
    if (one && strcmp(one, g->cfg.model_name) != 0) {
        oai_error e;
        check_model(g, one, &e);
        reply_error(g, h, MET_ROUTES, &e);
        return;
    }
    if (!one) jb_str(&b, "{\"object\":\"list\",\"data\":[");
    jb_str(&b, "{\"id\":");
    jb_quote(&b, g->cfg.model_name, strlen(g->cfg.model_name));
    jb_printf(&b, ",\"object\":\"model\",\"created\":%lld,\"owned_by\":\"aerie\",\"max_model_len\":%d}",
              (long long)g->started, context_len(g));
    if (!one) jb_str(&b, "]}");
    reply_json(g, h, MET_ROUTES, 200, b.p, b.len, NULL);
    jb_free(&b);
}

static void handle_health(gw *g, http_req *h) {
    char why[1024];
    int n = router_healthy(g->cfg.router, why, sizeof why);
    oai_error e;
    if (g->draining) {
        oai_fail(&e, 503, "server_error", "service_unavailable", NULL, "the gateway is shutting down");
    } else if (n == 0 || context_len(g) <= 0) {
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

static void handle_metrics(gw *g, http_req *h) {
    met_target targets[ROUTER_MAX_TARGETS];
    router_gauges(g->cfg.router, targets);
    met_gauges gg = {targets, router_count(g->cfg.router), g->inflight, g->http ? http_server_conns(g->http) : 0};
    size_t len;
    char *text = met_render(&g->met, &gg, &len);
    if (!text) {
        oai_error e;
        return reply_error(g, h, MET_ROUTES, (oai_oom(&e), &e));
    }
    http_respond(h, 200, "text/plain; version=0.0.4; charset=utf-8", NULL, text, len);
    free(text);
}

static void handle_server_info(gw *g, http_req *h) {
    char *peers = router_info_json(g->cfg.router);
    if (!peers) {
        oai_error e;
        return reply_error(g, h, MET_ROUTES, (oai_oom(&e), &e));
    }
    jbuf b = {0};
    jb_str(&b, "{\"gateway\":{\"service\":\"aerie-gateway\",\"model\":");
    jb_quote(&b, g->cfg.model_name, strlen(g->cfg.model_name));
    jb_printf(&b, ",\"vocab\":%d,\"tokenizer\":\"%s\",\"chat_template\":", tok_vocab_size(g->cfg.tok),
              tok_pre_name(tok_pre_kind(g->cfg.tok)));
    if (g->cfg.chat) jb_printf(&b, "\"%s\"", chat_variant_name(g->cfg.chat));
    else jb_str(&b, "null");
    jb_printf(&b, ",\"context\":%d,\"inflight\":%d,\"connections\":%d,\"config\":%s,\"memory_plan\":", context_len(g),
              g->inflight, http_server_conns(g->http), g->cfg.config_json ? g->cfg.config_json : "{}");
    jb_quote(&b, g->cfg.memory_plan ? g->cfg.memory_plan : "", g->cfg.memory_plan ? strlen(g->cfg.memory_plan) : 0);
    jb_str(&b, "},");
    /* peers is {"targets": [...], "drafts": [...]}: its members join ours. */
    jb_add(&b, peers + 1, strlen(peers) - 1);
    reply_jbuf(g, h, MET_ROUTES, &b);
    jb_free(&b);
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

static int check_key(gw *g, http_req *h, oai_error *e) {
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

static void on_request(void *ctx, http_req *h) {
    gw *g = ctx;
    const http_head *hd = http_req_head(h);
    const char *m = hd->method, *p = hd->path;
    bool get = strcmp(m, "GET") == 0, post = strcmp(m, "POST") == 0;
    oai_error e;
    /* Open to all: a load balancer's probe and Prometheus. */
    if (strcmp(p, "/health") == 0 && get) return handle_health(g, h);
    if (strcmp(p, "/metrics") == 0 && get) return handle_metrics(g, h);
    static const struct {
        const char *path;
        bool post;
        met_route route;
    } routes[] = {{"/v1/chat/completions", true, MET_CHAT}, {"/v1/completions", true, MET_COMPLETIONS},
                  {"/tokenize", true, MET_TOKENIZE},         {"/detokenize", true, MET_DETOKENIZE},
                  {"/v1/models", false, MET_ROUTES},         {"/server_info", false, MET_ROUTES}};
    int r = -1;
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (strcmp(p, routes[i].path) == 0) r = (int)i;
    bool model_path = strncmp(p, "/v1/models/", 11) == 0 && p[11];
    if (r < 0 && !model_path) {
        oai_fail(&e, 404, "invalid_request_error", "not_found", NULL, "no such route: %.100s %.200s", m, p);
        return reply_error(g, h, MET_ROUTES, &e);
    }
    met_route route = r >= 0 ? routes[r].route : MET_ROUTES;
    bool want_post = r >= 0 && routes[r].post;
    if ((want_post && !post) || (!want_post && !get)) {
        oai_fail(&e, 405, "invalid_request_error", "method_not_allowed", NULL, "%.200s takes %s, not %.20s", p,
                 want_post ? "POST" : "GET", m);
        return reply_error(g, h, route, &e);
    }
    if (check_key(g, h, &e) != AE_OK) return reply_error(g, h, route, &e);
    if (model_path) return handle_models(g, h, p + 11);
    switch (r) {
    case 0: return handle_generate(g, h, OAI_CHAT);
    case 1: return handle_generate(g, h, OAI_COMPLETION);
    case 2: return handle_tokenize(g, h);
    case 3: return handle_detokenize(g, h);
    case 4: return handle_models(g, h, NULL);
    default: return handle_server_info(g, h);
    }
}

/* ---- life cycle ---- */

static void on_log_timer(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    gw *g = arg;
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
    gw *g;
    ae_error *err;
    int rc;
} open_job;

static void open_on_loop(void *arg) {
    open_job *j = arg;
    gw *g = j->g;
    http_config hc = {
        .host = g->cfg.host,
        .port = g->cfg.port,
        .max_conns = g->cfg.max_conns,
        .max_head_bytes = GW_MAX_HEAD_BYTES,
        .max_body_bytes = g->cfg.max_body_bytes,
        .max_out_bytes = GW_MAX_UNSENT_BYTES,
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

int gw_open(gw **out, rpc_loop *loop, const gw_config *cfg, ae_error *err) {
    *out = NULL;
    gw *g = calloc(1, sizeof *g);
    if (!g) return err_set(err, "out of memory");
    g->cfg = *cfg;
    g->loop = loop;
    g->started = (int64_t)time(NULL);
    met_init(&g->met);
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

static void set_draining(void *arg) { ((gw *)arg)->draining = true; }
void gw_set_draining(gw *g) { rpc_loop_run(g->loop, set_draining, g); }

typedef struct int_job {
    gw *g;
    int v;
} int_job;

static void get_inflight(void *arg) { ((int_job *)arg)->v = ((int_job *)arg)->g->inflight; }
int gw_inflight(gw *g) {
    int_job j = {g, 0};
    rpc_loop_run(g->loop, get_inflight, &j);
    return j.v;
}

int gw_port(gw *g) { return g->http ? http_server_port(g->http) : 0; }

static void close_on_loop(void *arg) {
    gw *g = arg;
    if (g->log_timer) event_free(g->log_timer);
    g->log_timer = NULL;
    g->draining = true;
    http_server_close(g->http); /* requests in flight see their client go: they cancel their calls */
}

void gw_close(gw *g) {
    if (!g || !g->http) return;
    rpc_loop_run(g->loop, close_on_loop, g);
    g->http = NULL;
    /* A job a worker finishes now is answered (its client is gone) with
     * the router's figures: stop them here, while the router that main
     * closes next is still there. */
    workers_stop(g);
}

void gw_free(gw *g) {
    if (!g) return;
    gw_close(g);
    workers_stop(g);
    free(g);
}
