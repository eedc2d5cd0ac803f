#include "target_server.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../services/core/log.h"
#include "../services/rpc/msg.h"
#include "aerie.pb.h"

struct target_server {
    int32_t vocab;
    draft_client *draft;
    spec *sx;
    sched *sched;
    pthread_mutex_t mu; /* info strings, draining */
    char *config_json, *memory_plan;
    bool draining;
    /* the scheduler thread's */
    aerie_GenerateEvent ev;
    uint8_t ev_buf[aerie_GenerateEvent_size];
};

static bool sink_cancelled(void *ctx, void *req_ctx) {
    (void)ctx;
    return rpc_call_cancelled(req_ctx);
}

static void sink_emit(void *ctx, void *req_ctx, const sched_event *e) {
    target_server *t = ctx;
    rpc_call *call = req_ctx;
    if (e->finish == SCHED_REFUSED) {
        rpc_call_fail(call, RPC_INVALID_ARGUMENT, "%s", e->error ? e->error : "?");
        return;
    }
    if (e->finish == SCHED_ERROR) {
        rpc_call_fail(call, RPC_INTERNAL, "generation failed: %s", e->error ? e->error : "?");
        return;
    }
    aerie_GenerateEvent *ev = &t->ev;
    memset(ev, 0, sizeof *ev);
    ev->tokens_count = (pb_size_t)e->n;
    ev->index = (uint32_t)e->index;
    if (e->n > 0) memcpy(ev->tokens, e->tokens, sizeof(int32_t) * (size_t)e->n);
    if (e->logprob) {
        ev->logprobs_count = (pb_size_t)e->n;
        for (int32_t i = 0; i < e->n; i++) {
            aerie_TokenLogprobs *l = &ev->logprobs[i];
            l->logprob = e->logprob[i];
            l->top_tokens_count = l->top_logprobs_count = (pb_size_t)e->n_top;
            for (int32_t k = 0; k < e->n_top; k++) {
                l->top_tokens[k] = e->top[i][k].id;
                l->top_logprobs[k] = e->top[i][k].logprob;
            }
        }
    }
    if (e->finish != SCHED_RUNNING) {
        ev->finish = e->finish == SCHED_STOP     ? aerie_FinishReason_FINISH_STOP
                     : e->finish == SCHED_LENGTH ? aerie_FinishReason_FINISH_LENGTH
                                                 : aerie_FinishReason_FINISH_CANCELLED;
        ev->has_usage = true;
        ev->usage = (aerie_Usage){(uint32_t)e->prompt_tokens, (uint32_t)e->completion_tokens};
        ev->has_spec = true;
        const spec_stats *st = e->spec;
        ev->spec.steps = (uint64_t)st->steps;
        ev->spec.drafted = (uint64_t)st->drafted;
        ev->spec.accepted = (uint64_t)st->accepted;
        ev->spec.plain_steps = (uint64_t)st->plain_steps;
        int32_t depth = 0;
        for (int32_t d = 0; d < SPEC_MAX_DEPTH; d++)
            if (st->accepted_at[d]) depth = d + 1;
        ev->spec.accepted_at_count = (pb_size_t)depth;
        for (int32_t d = 0; d < depth; d++) ev->spec.accepted_at[d] = (uint64_t)st->accepted_at[d];
    }
    uint32_t len;
    ae_error err = {{0}};
    if (msg_encode(aerie_GenerateEvent_fields, ev, t->ev_buf, sizeof t->ev_buf, &len, &err) != AE_OK) {
        rpc_call_fail(call, RPC_INTERNAL, "%s", err.msg);
        return;
    }
    if (!e->last) {
        /* a gone caller is seen by sink_cancelled */
        if (e->n > 0 || e->finish != SCHED_RUNNING) rpc_call_item(call, t->ev_buf, len, NULL);
        return;
    }
    rpc_call_item(call, t->ev_buf, len, NULL);
    if (e->finish == SCHED_CANCELLED && rpc_call_expired(call))
        rpc_call_fail(call, RPC_DEADLINE_EXCEEDED, "deadline of %u us exceeded", rpc_call_request(call)->timeout_us);
    else if (e->finish == SCHED_CANCELLED && rpc_call_cancelled(call))
        rpc_call_fail(call, RPC_CANCELLED, "cancelled");
    else
        rpc_call_finish(call, RPC_OK, NULL, 0, NULL, 0);
}

int target_server_init(target_server **out, int32_t vocab, draft_client *draft, spec *sx, sched_sink *sink,
                       ae_error *err) {
    *out = NULL;
    target_server *t = calloc(1, sizeof *t);
    if (!t) return err_set(err, "out of memory");
    t->vocab = vocab;
    t->draft = draft;
    t->sx = sx;
    pthread_mutex_init(&t->mu, NULL);
    *sink = (sched_sink){t, sink_emit, sink_cancelled};
    *out = t;
    return AE_OK;
}

void target_server_attach(target_server *t, sched *s) { t->sched = s; }

void target_server_free(target_server *t) {
    if (!t) return;
    free(t->config_json);
    free(t->memory_plan);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

void target_server_set_info(target_server *t, const char *config_json, const char *memory_plan) {
    pthread_mutex_lock(&t->mu);
    free(t->config_json);
    free(t->memory_plan);
    t->config_json = config_json ? strdup(config_json) : NULL;
    t->memory_plan = memory_plan ? strdup(memory_plan) : NULL;
    pthread_mutex_unlock(&t->mu);
}

void target_server_set_draining(target_server *t) {
    pthread_mutex_lock(&t->mu);
    t->draining = true;
    pthread_mutex_unlock(&t->mu);
}

static void do_generate(target_server *t, rpc_call *call, const rpc_request *rq) {
    aerie_GenerateRequest g;
    ae_error err = {{0}};
    if (msg_decode(aerie_GenerateRequest_fields, &g, rq->msg, rq->msg_len, &err) != AE_OK) {
        rpc_call_fail(call, RPC_INVALID_ARGUMENT, "%s", err.msg);
        return;
    }
    const void *p;
    uint32_t n = g.has_prompt ? g.prompt.length / 4 : 0;
    if (!g.has_prompt || frame_payload_slice(rq->payload, rq->payload_len, g.prompt.offset, g.prompt.length,
                                             sizeof(int32_t), n, &p, &err) != AE_OK) {
        rpc_call_fail(call, RPC_INVALID_ARGUMENT, "prompt: %s", g.has_prompt ? err.msg : "missing");
        return;
    }
    const int32_t *prompt = p;
    for (uint32_t i = 0; i < n; i++)
        if (prompt[i] < 0 || prompt[i] >= t->vocab) {
            rpc_call_fail(call, RPC_INVALID_ARGUMENT, "prompt token %u is %d, not in the vocabulary of %d", i,
                          prompt[i], t->vocab);
            return;
        }
    sched_request r = {.prompt = prompt,
                       .n_prompt = (int32_t)n,
                       .max_tokens = g.max_tokens > INT32_MAX ? INT32_MAX : (int32_t)g.max_tokens,
                       .n = g.n == 0            ? 1
                            : g.n > SCHED_MAX_N ? SCHED_MAX_N + 1
                                                : (int32_t)g.n,
                       .params = {g.temperature, g.top_k > INT32_MAX ? INT32_MAX : (int32_t)g.top_k, g.top_p, g.min_p},
                       .seed = g.seed,
                       .ignore_eos = g.ignore_eos,
                       .n_generated = g.generated > n ? (int32_t)n : (int32_t)g.generated,
                       .pen = {.presence = g.presence_penalty,
                               .frequency = g.frequency_penalty,
                               .repetition = g.repetition_penalty,
                               .min_tokens = g.min_tokens > INT32_MAX ? INT32_MAX : (int32_t)g.min_tokens},
                       .logprobs = g.logprobs,
                       .top_logprobs = g.top_logprobs > SAMPLE_MAX_TOP_LOGPROBS + 1 ? SAMPLE_MAX_TOP_LOGPROBS + 1
                                                                                    : (int32_t)g.top_logprobs,
                       .ctx = call};
    /* proto3 leaves unset floats 0: top_p 0 and repetition_penalty 0 mean
     * "off" on the wire. */
    if (r.params.top_p == 0) r.params.top_p = 1;
    if (r.pen.repetition == 0) r.pen.repetition = 1;
    r.pen.n_bias = (int32_t)g.logit_bias_count;
    for (pb_size_t i = 0; i < g.logit_bias_count; i++) {
        r.pen.bias_id[i] = g.logit_bias[i].token;
        r.pen.bias[i] = g.logit_bias[i].bias;
    }
    for (pb_size_t i = 0; i < g.stop_tokens_count; i++) {
        if (g.stop_tokens[i] >= (uint32_t)t->vocab) {
            rpc_call_fail(call, RPC_INVALID_ARGUMENT, "stop token %u is not in the vocabulary of %d", g.stop_tokens[i],
                          t->vocab);
            return;
        }
        r.stop[r.n_stop++] = (int32_t)g.stop_tokens[i];
    }
    if (g.response_format > 2) {
        rpc_call_fail(call, RPC_INVALID_ARGUMENT, "response format %u is not 0, 1 or 2", g.response_format);
        return;
    }
    r.format = (int32_t)g.response_format;
    const void *schema = NULL;
    if (g.response_format == 2) {
        if (!g.has_schema || g.schema.length == 0 ||
            frame_payload_slice(rq->payload, rq->payload_len, g.schema.offset, g.schema.length, 1, g.schema.length,
                                &schema, &err) != AE_OK) {
            rpc_call_fail(call, RPC_INVALID_ARGUMENT, "schema: %s", g.has_schema ? err.msg : "missing");
            return;
        }
        r.schema = schema;
        r.schema_len = g.schema.length;
    }
    snprintf(r.id, sizeof r.id, "%s", g.request_id);
    /* The stream may run for minutes: it keeps its prompt, not the frame
     * it came in (whose payload may be far larger than the prompt). The
     * copy comes first because once submitted the call is the scheduler
     * thread's, which may finish it at any time. */
    int32_t *own = malloc(sizeof(int32_t) * (n ? n : 1));
    if (!own) {
        rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    /* An empty prompt has no payload slice to copy (sched_submit refuses it). */
    if (n > 0) memcpy(own, prompt, sizeof(int32_t) * n);
    r.prompt = own;
    char *own_schema = r.schema ? malloc(r.schema_len) : NULL;
    if (r.schema && !own_schema) {
        free(own);
        rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    if (own_schema) memcpy(own_schema, r.schema, r.schema_len);
    r.schema = own_schema;
    rpc_call_release_request(call);
    sched_refusal why = sched_submit(t->sched, &r, &err);
    free(own); /* sched_submit copied it */
    free(own_schema);
    static const uint32_t status[] = {[SCHED_QUEUED] = RPC_OK,
                                      [SCHED_INVALID] = RPC_INVALID_ARGUMENT,
                                      [SCHED_BUSY] = RPC_RESOURCE_EXHAUSTED,
                                      [SCHED_DRAINING] = RPC_UNAVAILABLE};
    if (why != SCHED_QUEUED) rpc_call_fail(call, status[why], "%s", err.msg);
}

static void reply_msg(rpc_call *call, const pb_msgdesc_t *fields, const void *m, uint8_t *buf, uint32_t cap) {
    uint32_t len;
    ae_error err = {{0}};
    if (msg_encode(fields, m, buf, cap, &len, &err) != AE_OK)
        rpc_call_fail(call, RPC_INTERNAL, "%s", err.msg);
    else
        rpc_call_finish(call, RPC_OK, buf, len, NULL, 0);
}

static void do_info(target_server *t, rpc_call *call) {
    static _Thread_local aerie_InfoReply r;
    static _Thread_local uint8_t buf[aerie_InfoReply_size];
    memset(&r, 0, sizeof r);
    r.contract_version = FRAME_VERSION;
    snprintf(r.service, sizeof r.service, "aerie-target");
    pthread_mutex_lock(&t->mu);
    snprintf(r.config_json, sizeof r.config_json, "%s", t->config_json ? t->config_json : "{}");
    snprintf(r.memory_plan, sizeof r.memory_plan, "%s", t->memory_plan ? t->memory_plan : "");
    pthread_mutex_unlock(&t->mu);
    sched_stats s = sched_get_stats(t->sched);
    char draft[512] = "null", pol[2048] = "null";
    if (t->draft) policy_report_json(&s.policy, pol, sizeof pol);
    if (t->draft) {
        draft_client_stats d = draft_client_get_stats(t->draft);
        snprintf(draft, sizeof draft,
                 "{\"connected\": %s, \"calls\": %llu, \"failures\": %llu, \"deadline_exceeded\": %llu, "
                 "\"unavailable\": %llu, \"bad_replies\": %llu, \"state_gone\": %llu, \"release_failures\": %llu, "
                 "\"mean_rtt_us\": %.1f, \"mean_server_us\": %.1f}",
                 draft_client_connected(t->draft) ? "true" : "false", (unsigned long long)d.calls,
                 (unsigned long long)d.failures, (unsigned long long)d.deadline_exceeded,
                 (unsigned long long)d.unavailable, (unsigned long long)d.bad_replies, (unsigned long long)d.state_gone,
                 (unsigned long long)d.release_failures, d.calls ? (double)d.rtt_ns / (double)d.calls / 1e3 : 0.0,
                 d.calls ? (double)d.server_ns / (double)d.calls / 1e3 : 0.0);
    }
    snprintf(r.stats_json, sizeof r.stats_json,
             "{\"running\": %d, \"prefilling\": %d, \"waiting\": %d, \"kv_blocks_used\": %d, \"kv_blocks\": %d, "
             "\"kv_blocks_reserved\": %d, \"requests_done\": %llu, \"requests_cancelled\": %llu, "
             "\"requests_refused\": %llu, \"tokens_out\": %llu, \"tok_per_s\": %.1f, \"accept_len\": %.3f, "
             "\"spec_on\": %s, \"spec\": {\"steps\": %lld, \"plain_steps\": %lld, \"drafted\": %lld, "
             "\"accepted\": %lld, \"bad_trees\": %lld, \"draft_failures\": %lld, \"state_gone\": %lld, "
             "\"adapt_off\": %lld, \"explore_steps\": %lld, \"draft_ms\": %.1f, \"verify_ms\": %.1f, "
             "\"explore_ms\": %.1f, \"feed_ms\": %.1f}, \"requests_constrained\": %llu, \"grammar_masks\": %llu, "
             "\"grammar_mask_ms\": %.3f, \"schemas\": {\"compiling\": %d, \"ok\": %llu, \"refused\": %llu, "
             "\"timeout\": %llu, \"cancelled\": %llu, \"errors\": %llu, \"dropped\": %llu, \"threads\": %d, "
             "\"mask_budget_spent\": %llu}, \"tp\": %d, \"allreduces\": {\"per_step\": %llu, \"bytes_per_step\": %llu, "
             "\"tokens_per_step\": %d, \"total\": %llu, \"seconds_total\": %.6f}, \"policy\": %s, \"draft\": %s}",
             s.running, s.prefilling, s.waiting, s.kv_blocks_used, s.kv_blocks, s.kv_blocks_reserved,
             (unsigned long long)s.requests_done, (unsigned long long)s.requests_cancelled,
             (unsigned long long)s.requests_refused, (unsigned long long)s.tokens_out, s.tok_per_s, s.accept_len,
             s.spec_on ? "true" : "false", (long long)s.spec.steps, (long long)s.spec.plain_steps,
             (long long)s.spec.drafted, (long long)s.spec.accepted, (long long)s.spec.bad_trees,
             (long long)s.spec.draft_failures, (long long)s.spec.state_gone, (long long)s.spec.adapt_off,
             (long long)s.spec.explore_steps, (double)s.spec.draft_ns / 1e6, (double)s.spec.verify_ns / 1e6,
             (double)s.spec.explore_ns / 1e6, (double)s.spec.feed_ns / 1e6, (unsigned long long)s.requests_constrained,
             (unsigned long long)s.grammar_masks, (double)s.grammar_mask_ns / 1e6, s.compiling,
             (unsigned long long)s.compiles[AE_OK], (unsigned long long)s.compiles[GRAMMAR_REFUSED],
             (unsigned long long)s.compiles[GCOMPILE_TIMEOUT], (unsigned long long)s.compiles[GCOMPILE_CANCELLED],
             (unsigned long long)s.compiles[1], (unsigned long long)s.compiles_dropped, gcompile_live(),
             (unsigned long long)s.mask_budget_spent, s.tp, (unsigned long long)s.comm.last.calls,
             (unsigned long long)s.comm.last.bytes, s.comm.last_tokens, (unsigned long long)s.comm.total.calls,
             (double)s.comm.total.ns / 1e9, pol, draft);
    reply_msg(call, aerie_InfoReply_fields, &r, buf, sizeof buf);
}

void target_server_handle(void *ctx, rpc_call *call, const rpc_request *req) {
    target_server *t = ctx;
    switch (req->method) {
    case aerie_Method_TARGET_GENERATE: do_generate(t, call, req); return;
    case aerie_Method_TARGET_CANCEL: {
        aerie_CancelRequest c;
        ae_error err = {{0}};
        if (msg_decode(aerie_CancelRequest_fields, &c, req->msg, req->msg_len, &err) != AE_OK) {
            rpc_call_fail(call, RPC_INVALID_ARGUMENT, "%s", err.msg);
            return;
        }
        aerie_CancelReply r = {sched_cancel_id(t->sched, c.request_id)};
        uint8_t buf[aerie_CancelReply_size];
        reply_msg(call, aerie_CancelReply_fields, &r, buf, sizeof buf);
        return;
    }
    case aerie_Method_TARGET_INFO: do_info(t, call); return;
    case aerie_Method_TARGET_HEALTH: {
        aerie_HealthReply h = {true, ""};
        pthread_mutex_lock(&t->mu);
        if (t->draining) h.serving = false, snprintf(h.reason, sizeof h.reason, "shutting down");
        pthread_mutex_unlock(&t->mu);
        uint8_t buf[aerie_HealthReply_size];
        reply_msg(call, aerie_HealthReply_fields, &h, buf, sizeof buf);
        return;
    }
    default: rpc_call_fail(call, RPC_UNIMPLEMENTED, "aerie-target has no method %u", req->method);
    }
}
