/* The generation routes (/v1/chat/completions, /v1/completions): a
 * request's prompt, once a tokenizing worker has encoded it, goes to a
 * target chosen by the router as a Generate call; its events come back
 * as tokens, are detokenized, matched against the stop strings and
 * rendered (render.h) as a stream or one body. A target that fails
 * before the first token is retried at another. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "../services/core/clock.h"
#include "../services/core/log.h"
#include "../services/rpc/msg.h"
#include "../services/tokenizer/detok.h"
#include "aerie.pb.h"
#include "gateway_internal.h"
#include "generate.h"
#include "render.h"
#include "stop.h"
#include "toolcall.h"

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "prompt ids travel as int32 little-endian");
_Static_assert(OAI_MAX_BIAS <= 300 && OAI_MAX_STOP_IDS <= 16 && OAI_MAX_TOP_LOGPROBS <= 20,
               "the request's lists fit GenerateRequest's and TokenLogprobs' bounds (aerie.options)");
_Static_assert(ROUTER_MAX_TARGETS <= 64, "a request's failed replicas are bits of a uint64_t");

/* One of a request's choices as the gateway turns it into text. */
typedef struct gchoice {
    int32_t n_out; /* tokens taken */
    detok *dt;
    stop_matcher *sm;
    char *piece, *text; /* [detok_max_out], [stop_max_out] */
    jbuf out;           /* non-streamed: the whole text */
    jbuf delta;         /* streamed: text not yet sent */
    render_lp lp;       /* with logprobs: the tokens' not yet sent (streamed), or all */
    int64_t text_chars; /* characters the tokens so far decoded to (completions' text_offset) */
    bool stopped;       /* a stop string matched */
    int finish;         /* aerie_FinishReason; 0 while running */
    bool role_sent;     /* streamed chat: the opening role chunk went */
    char *calls;        /* with tools: the tool_calls found (a JSON list), or NULL */
    char *rest;         /* and the text besides them (NULL: none) */
    size_t reply_bytes; /* non-streamed: what the choice takes in the reply as it stands */
} gchoice;

typedef struct greq {
    gateway *g;
    http_req *http;
    oai_request o;
    metrics_route route;
    char id[48];
    int64_t created;
    /* the prompt, then (n = 1) every token generated: what a retry resends */
    int32_t *ids; /* [n_prompt + max_tokens] */
    int32_t n_prompt, max_tokens;
    int32_t n;       /* choices */
    int32_t n_done;  /* choices finished */
    int32_t n_taken; /* tokens taken over all choices */
    gchoice *ch;     /* [n] */
    uint64_t seed;
    int replica;    /* -1: no call */
    uint64_t tried; /* replicas that failed this request */
    uint32_t call_id;
    jbuf ev;               /* streamed: the next event */
    jbuf head;             /* streamed: the start of every chunk */
    bool started;          /* the stream's head was sent */
    bool gone;             /* the client went away */
    bool target_cancelled; /* the target cancelled it (shutting down, or a Cancel by id) */
    double t_arrive, t_first, t_last;
    aerie_SpecStats spec; /* summed over the choices */
    bool has_spec;
    /* Non-streamed: the reply's size as it stands (its choices' text and
     * log-probabilities so far, the finish reasons and usage counted at
     * their shortest until known), kept under max-reply-bytes as it grows. */
    size_t reply_bytes;
    bool too_large;  /* it passed max-reply-bytes: the request ends with reply_too_large */
    gateway_job job; /* the prompt's tokenizing, before the call */
} greq;

static void greq_free(greq *q) {
    oai_request_free(&q->o);
    free(q->job.ids);
    free(q->ids);
    for (int32_t c = 0; q->ch && c < q->n; c++) {
        gchoice *ch = &q->ch[c];
        detok_free(ch->dt);
        stop_free(ch->sm);
        free(ch->piece);
        free(ch->text);
        jbuf_free(&ch->out);
        jbuf_free(&ch->delta);
        render_lp_free(&ch->lp);
        free(ch->calls);
        free(ch->rest);
    }
    free(q->ch);
    jbuf_free(&q->ev);
    jbuf_free(&q->head);
    free(q);
}

static bool is_chat(const greq *q) { return q->o.kind == OAI_CHAT; }

static render_meta meta(const greq *q) { return (render_meta){q->id, is_chat(q), q->created, q->g->cfg.model_name}; }

/* Choice ch as a whole reply shows it (its finish reason "stop", the
 * shortest, while it runs). */
static render_choice choice_render(const greq *q, const gchoice *ch) {
    return (render_choice){ch->calls ? ch->rest : ch->out.p,
                           ch->calls ? (ch->rest ? strlen(ch->rest) : 0) : ch->out.len, q->o.logprobs ? &ch->lp : NULL,
                           render_finish_name(ch->finish), ch->calls};
}

/* The whole reply, into b (a counter, JBUF_COUNTER: its size). */
static void render_reply(jbuf *b, const greq *q) {
    render_meta rm = meta(q);
    render_choice rc[OAI_MAX_N];
    for (int32_t c = 0; c < q->n; c++) rc[c] = choice_render(q, &q->ch[c]);
    render_completion(b, &rm, rc, q->n, q->n_prompt, q->n_taken);
}

/* Choice c's part of the whole reply, counted by the code that writes it. */
static size_t choice_bytes(const greq *q, int32_t c) {
    jbuf n = JBUF_COUNTER;
    render_choice rc = choice_render(q, &q->ch[c]);
    render_completion_choice(&n, is_chat(q), c, &rc);
    return n.len;
}

/* Choice ch's part of the reply is now `bytes`. */
static void choice_resized(greq *q, gchoice *ch, size_t bytes) {
    q->reply_bytes = q->reply_bytes - ch->reply_bytes + bytes;
    ch->reply_bytes = bytes;
}

/* Whether the reply, not streamed, is over max-reply-bytes. The request
 * then ends: on_event returns false, which cancels its call so that the
 * target stops generating what could not be sent, and on_end answers
 * reply_too_large. A stream holds no reply and has no such limit. */
static bool too_large(greq *q) {
    if (!q->o.stream && q->reply_bytes > q->g->cfg.max_reply_bytes) q->too_large = true;
    return q->too_large;
}

/* 400, not 413 (that names the request's body, which was fine) nor a 5xx
 * or 429 (OpenAI's clients retry those, and a retry would generate the
 * same reply to the same end): the request as sent asks for more than
 * this gateway sends whole, as a prompt over the context is a 400, and
 * OpenAI's clients raise BadRequestError with the message, which names
 * the limit and the way around it. */
static void reply_too_large(oai_error *e, size_t limit) {
    oai_fail(e, 400, "invalid_request_error", "reply_too_large", NULL,
             "the reply would be over %zu bytes, this gateway's limit for a reply that is not streamed "
             "(max-reply-bytes); ask for it with \"stream\": true, or for fewer tokens, choices or log-probabilities",
             limit);
}

/* The part every streamed chunk starts with, formatted once per request. */
static const jbuf *chunk_head(greq *q) {
    if (!q->head.len) {
        render_meta m = meta(q);
        render_chunk_head(&q->head, &m);
    }
    return &q->head;
}

/* One chunk of choice c with text (or, for chat, the opening role) and
 * maybe the finish reason. */
static void send_chunk(greq *q, int32_t c, const char *text, size_t n, bool role, const char *finish) {
    jbuf *b = &q->ev;
    gchoice *ch = &q->ch[c];
    jbuf_clear(b);
    /* The tokens' log-probabilities go with the first chunk of text
     * after them (text held back by the stop strings comes later), and
     * what is left with the last. */
    bool lp = q->o.logprobs && !role && (n > 0 || finish);
    render_chunk(b, chunk_head(q), is_chat(q), c, text, n, role, lp ? &ch->lp : NULL, finish, q->o.include_usage);
    if (lp) render_lp_clear(&ch->lp);
    /* Out of memory mid-stream: the chunk is lost, not the gateway. */
    if (b->oom)
        LOG_WARNF("chunk_lost id=%s reason=\"out of memory\"", q->id);
    else
        http_stream_write(q->http, b->p, b->len);
}

static void stream_start(greq *q) {
    if (q->started) return;
    q->started = true;
    char extra[96];
    snprintf(extra, sizeof extra, "Cache-Control: no-cache\r\nX-Request-Id: %s\r\n", q->id);
    http_stream_start(q->http, 200, "text/event-stream", extra);
}

/* Streamed chat: each choice opens with the assistant role, as OpenAI's do. */
static void open_choice(greq *q, int32_t c) {
    stream_start(q);
    if (is_chat(q) && !q->ch[c].role_sent) {
        q->ch[c].role_sent = true;
        send_chunk(q, c, NULL, 0, true, NULL);
    }
}

/* With tools, a reply is text or calls, which only its end tells: its
 * text is held until then (README, "Tools"). */
static bool holds_text(const greq *q) { return q->o.n_tools > 0; }

static void flush_delta(greq *q, int32_t c) {
    gchoice *ch = &q->ch[c];
    if (!q->o.stream || q->gone || ch->delta.len == 0 || holds_text(q)) return;
    open_choice(q, c);
    send_chunk(q, c, ch->delta.p, ch->delta.len, false, NULL);
    ch->delta.len = 0;
}

/* Text the stop strings released. */
static void emit(greq *q, gchoice *ch, const char *s, size_t n) {
    if (!n) return;
    jbuf_add(q->o.stream ? &ch->delta : &ch->out, s, n);
    /* Written as a JSON string, text takes its escaped bytes. */
    if (!q->o.stream) choice_resized(q, ch, ch->reply_bytes + jbuf_quoted_len(s, n) - 2);
}

/* Token t's log-probability entry (l: what the target sent for it). */
static void take_logprobs(greq *q, gchoice *ch, int32_t t, const aerie_TokenLogprobs *l) {
    const tok *tk = q->g->cfg.tok;
    render_top top[OAI_MAX_TOP_LOGPROBS];
    int n_top = 0;
    for (pb_size_t k = 0; k < l->top_tokens_count && k < l->top_logprobs_count && n_top < q->o.top_logprobs; k++) {
        top[n_top].bytes = tok_token_bytes(tk, l->top_tokens[k], &top[n_top].len);
        top[n_top].logprob = l->top_logprobs[k];
        if (top[n_top].bytes) n_top++;
    }
    size_t len = 0, before = render_lp_bytes(&ch->lp);
    const uint8_t *bytes = tok_token_bytes(tk, t, &len);
    render_lp_add(&ch->lp, bytes ? bytes : (const uint8_t *)"", bytes ? len : 0, l->logprob, top, n_top,
                  ch->text_chars);
    if (!q->o.stream) choice_resized(q, ch, ch->reply_bytes + render_lp_bytes(&ch->lp) - before);
}

static void take_token(greq *q, gchoice *ch, int32_t t, const aerie_TokenLogprobs *l) {
    size_t plen = 0, tlen = 0;
    if (q->n == 1) q->ids[q->n_prompt + ch->n_out] = t;
    ch->n_out++;
    q->n_taken++;
    if (q->o.logprobs && l) take_logprobs(q, ch, t, l);
    /* The target checked the id against its vocabulary, and ours is the
     * same model's: an id we cannot decode means the two were deployed
     * with different models. It adds no text, and serving goes on. */
    if (detok_push(ch->dt, t, ch->piece, detok_max_out(ch->dt), &plen, NULL) != AE_OK) plen = 0;
    for (size_t i = 0; i < plen; i++) ch->text_chars += ((unsigned char)ch->piece[i] & 0xC0) != 0x80;
    ch->stopped = stop_push(ch->sm, ch->piece, plen, ch->text, stop_max_out(ch->sm), &tlen);
    emit(q, ch, ch->text, tlen);
}

/* The choice's tokens ended (finish reason known): releases what the
 * detokenizer and the stop strings still hold. */
static void take_end(greq *q, gchoice *ch) {
    size_t tlen = 0;
    if (!ch->stopped) {
        size_t plen = detok_flush(ch->dt, ch->piece, detok_max_out(ch->dt));
        ch->stopped = stop_push(ch->sm, ch->piece, plen, ch->text, stop_max_out(ch->sm), &tlen);
        emit(q, ch, ch->text, tlen);
    }
    if (!ch->stopped) {
        /* The flush may settle a match that waited for a longer stop
         * starting earlier (stop.h): that ends the choice on a stop too. */
        emit(q, ch, ch->text, stop_flush(ch->sm, ch->text, stop_max_out(ch->sm)));
        ch->stopped = stop_matched(ch->sm);
    }
    if (ch->stopped) ch->finish = aerie_FinishReason_FINISH_STOP;
}

/* Choice c is done: its text is settled, and a stream sends its last
 * chunk now (OpenAI's streams finish each choice on its own). */
static void end_choice(greq *q, int32_t c, int finish) {
    gchoice *ch = &q->ch[c];
    ch->finish = finish;
    take_end(q, ch);
    q->n_done++;
    if (holds_text(q)) {
        jbuf *t = q->o.stream ? &ch->delta : &ch->out;
        ch->calls = toolcall_find(t->p ? t->p : "", t->len, q->o.tool_choice >= OAI_TOOLS_REQUIRED,
                                  (const char *const *)q->o.tool_names, q->o.n_tools,
                                  q->id + (strncmp(q->id, "chatcmpl-", 9) ? 0 : 9), q->o.stream, &ch->rest);
        if (ch->calls) ch->finish = RENDER_FINISH_TOOL_CALLS;
    }
    /* Its finish reason, and its text read as calls, are known: counted
     * again, whole. */
    if (!q->o.stream) choice_resized(q, ch, choice_bytes(q, c));
    if (q->o.stream && !q->gone) {
        open_choice(q, c);
        if (ch->calls) {
            if (ch->rest) send_chunk(q, c, ch->rest, strlen(ch->rest), false, NULL);
            jbuf *b = &q->ev;
            jbuf_clear(b);
            render_tool_chunk(b, chunk_head(q), c, ch->calls, q->o.include_usage);
            if (!b->oom) http_stream_write(q->http, b->p, b->len);
        } else if (ch->delta.len) {
            send_chunk(q, c, ch->delta.p, ch->delta.len, false, NULL);
        }
        ch->delta.len = 0;
        send_chunk(q, c, NULL, 0, false, render_finish_name(ch->finish));
    }
}

static void add_spec(greq *q, const aerie_GenerateEvent *ev) {
    if (!ev->has_spec) return;
    aerie_SpecStats *t = &q->spec;
    t->steps += ev->spec.steps;
    t->drafted += ev->spec.drafted;
    t->accepted += ev->spec.accepted;
    t->plain_steps += ev->spec.plain_steps;
    for (pb_size_t d = 0; d < ev->spec.accepted_at_count; d++) {
        if (d >= t->accepted_at_count) t->accepted_at[t->accepted_at_count++] = 0;
        t->accepted_at[d] += ev->spec.accepted_at[d];
    }
    q->has_spec = true;
}

/* Called by the RPC link for each GenerateEvent, on the loop thread and
 * under the client's lock: nothing here calls into the client. Returns
 * whether more events are wanted. */
static bool on_event(void *ctx, const uint8_t *msg, uint32_t len) {
    greq *q = ctx;
    aerie_GenerateEvent ev;
    if (q->gone || q->n_done == q->n || q->target_cancelled || q->too_large) return false;
    if (msg_decode(aerie_GenerateEvent_fields, &ev, msg, len, NULL) != AE_OK) return false;
    /* A target never names another choice; do not trust it to. */
    if (ev.index >= (uint32_t)q->n) return false;
    int32_t c = (int32_t)ev.index;
    gchoice *ch = &q->ch[c];
    double now = clock_mono_seconds();
    if (ev.tokens_count > 0) {
        if (!q->t_first) {
            q->t_first = now;
            metrics_hist_observe(&q->g->met.ttft, now - q->t_arrive);
        } else {
            double gap = (now - q->t_last) / ev.tokens_count;
            for (pb_size_t i = 0; i < ev.tokens_count; i++) metrics_hist_observe(&q->g->met.itl, gap);
        }
        q->t_last = now;
    }
    /* A cancel by the target (it is shutting down, or a Cancel by id)
     * ends the call whatever choice it names: every choice not done goes
     * on elsewhere or fails. */
    if (ev.finish == aerie_FinishReason_FINISH_CANCELLED && (ch->finish || q->n > 1)) {
        q->target_cancelled = true;
        for (int32_t k = 0; k < q->n; k++) flush_delta(q, k);
        return false;
    }
    if (ch->finish) return true; /* ended here by a stop string: the target runs on */
    for (pb_size_t i = 0; i < ev.tokens_count && !ch->stopped; i++) {
        if (ch->n_out >= q->max_tokens) break; /* a target never sends more; do not trust it to */
        take_token(q, ch, ev.tokens[i], i < ev.logprobs_count ? &ev.logprobs[i] : NULL);
        if (too_large(q)) return false;
    }
    if (ev.finish == aerie_FinishReason_FINISH_CANCELLED && !ch->stopped && ch->n_out < q->max_tokens) {
        /* Not ours to end: on_end goes on at another replica. */
        q->target_cancelled = true;
        for (int32_t k = 0; k < q->n; k++) flush_delta(q, k);
        return false;
    }
    if (ev.finish != aerie_FinishReason_FINISH_NONE || ch->stopped || ch->n_out >= q->max_tokens) {
        add_spec(q, &ev);
        end_choice(q, c,
                   ch->stopped                                   ? aerie_FinishReason_FINISH_STOP
                   : ev.finish == aerie_FinishReason_FINISH_NONE ? aerie_FinishReason_FINISH_LENGTH
                                                                 : ev.finish);
    } else {
        flush_delta(q, c);
    }
    if (too_large(q)) return false;
    return q->n_done < q->n;
}

static void finish_ok(greq *q) {
    gateway *g = q->g;
    metrics *m = &g->met;
    m->prompt_tokens += (uint64_t)q->n_prompt;
    m->generation_tokens += (uint64_t)q->n_taken;
    metrics_hist_observe(&m->prompt_hist, q->n_prompt);
    metrics_hist_observe(&m->generation_hist, q->n_taken);
    for (int32_t c = 0; c < q->n; c++) {
        if (q->ch[c].finish == aerie_FinishReason_FINISH_LENGTH)
            m->finish.length++;
        else
            m->finish.stop++;
    }
    if (q->has_spec) {
        m->spec_steps += q->spec.steps;
        m->spec_plain_steps += q->spec.plain_steps;
        m->spec_drafted += q->spec.drafted;
        m->spec_accepted += q->spec.accepted;
        for (pb_size_t d = 0; d < q->spec.accepted_at_count && d < METRICS_SPEC_POSITIONS; d++)
            m->spec_accepted_at[d] += q->spec.accepted_at[d];
    }
    const char *fin = render_finish_name(q->ch[0].finish);
    if (q->o.stream) {
        stream_start(q);
        if (q->o.include_usage) {
            jbuf *b = &q->ev;
            jbuf_clear(b);
            render_usage_chunk(b, chunk_head(q), q->n_prompt, q->n_taken);
            if (!b->oom) http_stream_write(q->http, b->p, b->len);
        }
        http_stream_write(q->http, "data: [DONE]\n\n", 14);
        metrics_request(m, q->route, 200);
        http_stream_end(q->http);
    } else {
        jbuf b = {0};
        /* on_end counted it: one allocation of its very size. */
        jbuf_reserve(&b, q->reply_bytes);
        for (int32_t c = 0; c < q->n; c++) b.oom |= q->ch[c].out.oom; /* the text is incomplete */
        render_reply(&b, q);
        gateway_reply_jbuf(g, q->http, q->route, &b);
        jbuf_free(&b);
    }
    double now = clock_mono_seconds();
    metrics_hist_observe(&m->e2e, now - q->t_arrive);
    LOG_INFOF("request id=%s route=%s target=%s prompt=%d completion=%d n=%d finish=%s ttft_ms=%.1f e2e_ms=%.1f", q->id,
              is_chat(q) ? "chat" : "completions", q->replica >= 0 ? router_addr(g->cfg.router, q->replica) : "-",
              q->n_prompt, q->n_taken, q->n, fin, q->t_first ? (q->t_first - q->t_arrive) * 1e3 : -1.0,
              (now - q->t_arrive) * 1e3);
}

/* The request failed: an error reply, or an error event when the stream
 * has started. */
static void finish_error(greq *q, const oai_error *e) {
    gateway *g = q->g;
    g->met.finish.error++;
    if (!q->started) {
        gateway_reply_error(g, q->http, q->route, e);
        return;
    }
    char *json = oai_error_json(e);
    jbuf b = {0};
    render_error_event(&b, json ? json : OAI_OOM_JSON);
    if (!b.oom) http_stream_write(q->http, b.p, b.len);
    jbuf_free(&b);
    free(json);
    metrics_request(&g->met, q->route, e->status);
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
    gateway *g = q->g;
    router_end(g->cfg.router, q->replica);
    if (q->gone) {
        g->met.finish.cancelled++;
        metrics_request(&g->met, q->route, 499);
        LOG_INFOF("request_cancelled id=%s reason=\"the client went away\" completion=%d", q->id, q->n_taken);
        /* Only frees the request: the client is gone. */
        if (q->started)
            http_stream_end(q->http);
        else
            http_respond(q->http, 499, "application/json", NULL, NULL, 0);
        request_done(q);
        return;
    }
    oai_error e;
    if (q->n_done == q->n && !q->o.stream) {
        /* Every choice is done: the reply's size is known to the byte. */
        jbuf n = JBUF_COUNTER;
        render_reply(&n, q);
        q->reply_bytes = n.len;
        q->too_large = n.len > g->cfg.max_reply_bytes;
    }
    if (q->too_large) {
        LOG_WARNF("reply_too_large id=%s reply_bytes=%zu max_reply_bytes=%zu completion=%d n=%d", q->id, q->reply_bytes,
                  g->cfg.max_reply_bytes, q->n_taken, q->n);
        reply_too_large(&e, g->cfg.max_reply_bytes);
        finish_error(q, &e);
        request_done(q);
        return;
    }
    if (q->n_done == q->n) {
        finish_ok(q);
        request_done(q);
        return;
    }
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
    gateway *g = q->g;
    /* Choices forked on one target go on there or nowhere: a retry can
     * resend one output, not n. */
    if (q->n > 1 && q->n_taken > 0)
        return err_set(err, "the %d choices of a request cannot move to another target once tokens came", q->n);
    int32_t n_out = q->ch[0].n_out;
    uint32_t n_ids = (uint32_t)(q->n_prompt + n_out);
    for (;;) {
        int i = router_pick(g->cfg.router, q->tried);
        if (i < 0) {
            char why[512];
            router_healthy(g->cfg.router, why, sizeof why);
            return err_set(err, "no target is ready (%s)", why[0] ? why : "every one failed this request");
        }
        aerie_GenerateRequest gr = aerie_GenerateRequest_init_zero;
        snprintf(gr.request_id, sizeof gr.request_id, "%s", q->id);
        gr.max_tokens = (uint32_t)(q->max_tokens - n_out);
        gr.n = (uint32_t)q->n;
        gr.temperature = (float)q->o.temperature;
        gr.top_k = (uint32_t)q->o.top_k;
        gr.top_p = (float)q->o.top_p;
        gr.min_p = (float)q->o.min_p;
        /* Draws are keyed by (seed, choice, position): a retry with the
         * same seed goes on as the first target would have. */
        gr.seed = q->seed;
        gr.ignore_eos = q->o.ignore_eos;
        gr.generated = (uint32_t)n_out;
        gr.presence_penalty = (float)q->o.presence_penalty;
        gr.frequency_penalty = (float)q->o.frequency_penalty;
        gr.repetition_penalty = (float)q->o.repetition_penalty;
        gr.min_tokens = (uint32_t)q->o.min_tokens;
        gr.logit_bias_count = (pb_size_t)q->o.n_bias;
        for (int k = 0; k < q->o.n_bias; k++) gr.logit_bias[k] = (aerie_LogitBias){q->o.bias_id[k], q->o.bias[k]};
        gr.stop_tokens_count = (pb_size_t)q->o.n_stop_ids;
        for (int k = 0; k < q->o.n_stop_ids; k++) gr.stop_tokens[k] = (uint32_t)q->o.stop_ids[k];
        gr.response_format = (uint32_t)q->o.format;
        if (q->o.format == OAI_JSON_SCHEMA) {
            gr.has_schema = true;
            gr.schema = (aerie_PayloadRef){n_ids * 4, (uint32_t)q->o.schema_len};
        }
        gr.logprobs = q->o.logprobs;
        gr.top_logprobs = (uint32_t)q->o.top_logprobs;
        gr.has_prompt = true;
        gr.prompt = (aerie_PayloadRef){0, n_ids * 4};
        uint8_t buf[aerie_GenerateRequest_size];
        uint32_t len;
        if (msg_encode(aerie_GenerateRequest_fields, &gr, buf, sizeof buf, &len, err) != AE_OK) return AE_ERR;
        rpc_iov iov[2] = {{q->ids, n_ids * 4}, {q->o.schema, (uint32_t)q->o.schema_len}};
        q->replica = i;
        router_begin(g->cfg.router, i);
        rpc_client *cl = router_client(g->cfg.router, i);
        if (rpc_client_start(cl, aerie_Method_TARGET_GENERATE, buf, len, iov, q->o.format == OAI_JSON_SCHEMA ? 2 : 1, 0,
                             on_event, on_end, q, &q->call_id, err) == AE_OK)
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

static void on_prompt_encoded(gateway_job *j);

/* A generation request: parsed and tokenized by a worker (a 1 MiB body
 * of any shape costs the loop nothing but its bytes), then checked and
 * sent to a target by on_prompt_encoded. */
void generate_handle(gateway *g, http_req *h, oai_kind kind) {
    metrics_route route = kind == OAI_CHAT ? METRICS_CHAT : METRICS_COMPLETIONS;
    oai_error e;
    greq *q = calloc(1, sizeof *q);
    if (!q) return gateway_reply_error(g, h, route, (oai_oom(&e), &e));
    q->g = g;
    q->http = h;
    q->route = route;
    q->replica = -1;
    q->t_arrive = clock_mono_seconds();
    http_req_on_close(h, on_client_gone, q);
    gateway_job_submit(g, &q->job, h, TJOB_GENERATE, kind, &q->o, on_prompt_encoded);
}

static void on_prompt_encoded(gateway_job *j) {
    greq *q = (greq *)(void *)((char *)j - offsetof(greq, job));
    gateway *g = q->g;
    oai_kind kind = j->kind;
    oai_error e;
    if (q->gone) {
        g->met.finish.cancelled++;
        metrics_request(&g->met, q->route, 499);
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
    if (oai_check_vocab(&q->o, tok_vocab_size(g->cfg.tok), &e) != AE_OK) goto refuse;
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
    int32_t ctx = gateway_context_len(g);
    if (ctx <= 0) {
        gateway_no_target(g, &e);
        goto refuse;
    }
    int32_t max_prompt =
        g->cfg.max_prompt_tokens > 0 && g->cfg.max_prompt_tokens < ctx ? g->cfg.max_prompt_tokens : ctx - 1;
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
    q->n = q->o.n;
    q->ch = calloc((size_t)q->n, sizeof *q->ch);
    if (!q->ch) {
        oai_oom(&e);
        goto refuse;
    }
    for (int32_t c = 0; c < q->n; c++) {
        gchoice *ch = &q->ch[c];
        ch->lp.chat = kind == OAI_CHAT;
        if (detok_init(&ch->dt, g->cfg.tok, true, &err) != AE_OK ||
            stop_init(&ch->sm, (const char *const *)q->o.stops, q->o.stop_lens, q->o.n_stops, detok_max_out(ch->dt) + 3,
                      &err) != AE_OK) {
            oai_fail(&e, 500, "server_error", NULL, NULL, "%s", err.msg);
            goto refuse;
        }
        ch->piece = malloc(detok_max_out(ch->dt) + 3);
        ch->text = malloc(stop_max_out(ch->sm) + 1);
        if (!ch->piece || !ch->text) {
            oai_oom(&e);
            goto refuse;
        }
    }
    if (q->o.has_seed)
        q->seed = q->o.seed;
    else if (getrandom(&q->seed, sizeof q->seed, 0) != (ssize_t)sizeof q->seed)
        q->seed = (uint64_t)(clock_mono_seconds() * 1e9);
    uint8_t rnd[12];
    if (getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) memset(rnd, 0, sizeof rnd);
    int w = snprintf(q->id, sizeof q->id, "%s-", kind == OAI_CHAT ? "chatcmpl" : "cmpl");
    for (size_t i = 0; i < sizeof rnd; i++) w += snprintf(q->id + w, sizeof q->id - (size_t)w, "%02x", rnd[i]);
    q->created = (int64_t)time(NULL);
    if (!q->o.stream) {
        /* What the reply takes with no token: its frame and every choice
         * empty. Over max-reply-bytes, no output can ever fit. What more
         * it will take depends on the tokens (a choice may end at its
         * first, with no text; max_tokens says nothing of how long a token
         * is), so this is all that is refused before the call. */
        jbuf n = JBUF_COUNTER;
        render_reply(&n, q);
        q->reply_bytes = n.len;
        for (int32_t c = 0; c < q->n; c++) q->ch[c].reply_bytes = choice_bytes(q, c);
        if (q->reply_bytes > g->cfg.max_reply_bytes) {
            oai_fail(&e, 400, "invalid_request_error", "reply_too_large", NULL,
                     "an empty reply of %d choice%s takes %zu bytes, over this gateway's limit of %zu bytes for a "
                     "reply that is not streamed (max-reply-bytes); ask for it with \"stream\": true",
                     q->n, q->n == 1 ? "" : "s", q->reply_bytes, g->cfg.max_reply_bytes);
            goto refuse;
        }
    }
    if (start_call(q, &err) != AE_OK) {
        oai_fail(&e, 503, "server_error", "service_unavailable", NULL, "%s", err.msg);
        goto refuse;
    }
    g->inflight++;
    if (q->o.format != OAI_TEXT) g->met.constrained++;
    return;
refuse:
    gateway_reply_error(g, q->http, q->route, &e);
    greq_free(q);
}
