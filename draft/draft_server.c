#include "draft_server.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "../services/core/log.h"
#include "../services/core/watchdog.h"
#include "../services/model/quant.h"
#include "../services/rpc/msg.h"
#include "aerie.pb.h"

#define DRAFT_SERVER_MAX_SEQS 64 /* per call: aerie.options ProposeRequest.seqs */
#define DRAFT_SERVER_REPLY_CAP (aerie_ProposeReply_size + 64)
#define DRAFT_SERVER_MAX_QUEUE 1024 /* calls waiting for the worker */

/* One drafter slot: which (client, seq) it holds. */
typedef struct slot {
    bool used;
    uint64_t client;
    uint32_t seq;
    uint64_t last_use; /* call number of its last use, for LRU */
} slot;

typedef struct job {
    rpc_call *call;
    struct job *next;
} job;

struct draft_server {
    const eagle_head *head;
    draft_server_config cfg;
    drafter *drafter;
    int32_t fw;                          /* feature width, 3H */
    int32_t default_layers[EAGLE_N_AUX]; /* EAGLE-3's, for a head that names none */
    slot *slots;                         /* [max_keys] */
    bool *in_call;                       /* [max_keys] slots taken by the call being served */
    uint64_t use_clock;
    /* one Propose (the worker's) */
    aerie_ProposeRequest req;
    aerie_ProposeReply rep;
    drafter_feed feeds[DRAFT_SERVER_MAX_SEQS];
    tree_out trees[DRAFT_SERVER_MAX_SEQS];
    int32_t feed_of[DRAFT_SERVER_MAX_SEQS];  /* -1: state gone */
    int32_t fork_src[DRAFT_SERVER_MAX_SEQS]; /* a fork's source slot, -1: not a fork (or its source is gone) */
    uint8_t *out;                            /* [DRAFT_SERVER_REPLY_CAP] */
    float *feat32;                           /* f16 features of the call as f32, grown to the largest call */
    size_t feat32_cap;                       /* floats */
    /* the worker */
    pthread_t worker;
    pthread_mutex_t mu;  /* queue, stopping, draining, stats, info */
    pthread_cond_t cv;   /* the worker's: a job came, or stop */
    pthread_cond_t idle; /* draft_server_drain's: a call was served (apart, so that
                          * a call served on the loop wakes no worker) */
    job *head_job, *tail_job;
    int32_t queued;
    bool busy, stopping, draining;
    watchdog *wd; /* systemd's watchdog (draft_server_watch), or NULL */
    draft_server_stats stats;
    char *config_json, *memory_plan;
};

static int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The server's own memory, always the host's. */
static size_t own_bytes(const draft_server_config *cfg) {
    return (size_t)cfg->max_keys * (sizeof(slot) + sizeof(bool)) + sizeof(draft_server) + DRAFT_SERVER_REPLY_CAP;
}

size_t draft_server_bytes(const eagle_head *h, const draft_server_config *cfg) {
    drafter_config dc = {cfg->max_keys, cfg->max_seq_len, cfg->max_tokens, cfg->threads, NULL, cfg->act_bits};
    return drafter_bytes(h, &dc) + (kn_backend_host_memory(h->be) ? own_bytes(cfg) : 0);
}

size_t draft_server_host_bytes(const eagle_head *h, const draft_server_config *cfg) {
    drafter_config dc = {cfg->max_keys, cfg->max_seq_len, cfg->max_tokens, cfg->threads, NULL, cfg->act_bits};
    return kn_backend_host_memory(h->be) ? 0 : drafter_host_bytes(h, &dc) + own_bytes(cfg);
}

/* The slot of (client, seq), or -1. */
static int32_t slot_find(const draft_server *d, uint64_t client, uint32_t seq) {
    for (int32_t k = 0; k < d->cfg.max_keys; k++)
        if (d->slots[k].used && d->slots[k].client == client && d->slots[k].seq == seq) return k;
    return -1;
}

/* A slot for a sequence that starts over: its own, a free one, or the
 * least recently used one not taken by this call (taken[k]). */
static int32_t slot_take(draft_server *d, uint64_t client, uint32_t seq, const bool *taken) {
    int32_t k = slot_find(d, client, seq);
    if (k >= 0) return k;
    int32_t lru = -1;
    for (k = 0; k < d->cfg.max_keys; k++) {
        if (!d->slots[k].used) break;
        if (!taken[k] && (lru < 0 || d->slots[k].last_use < d->slots[lru].last_use)) lru = k;
    }
    if (k == d->cfg.max_keys) {
        if (lru < 0) return -1;
        k = lru;
        drafter_release(d->drafter, k);
        d->stats.evictions++;
    }
    d->slots[k] = (slot){true, client, seq, 0};
    return k;
}

/* The f16 features of feeds[0..n) as f32 in d->feat32; each feed then
 * points there. */
static int widen_features(draft_server *d, int32_t n, ae_error *err) {
    size_t need = 0;
    for (int32_t i = 0; i < n; i++) need += (size_t)d->feeds[i].n * (size_t)d->fw;
    if (need > d->feat32_cap) {
        float *p = realloc(d->feat32, need * sizeof *p);
        if (!p) return err_set(err, "no memory for the call's %zu features as f32", need);
        d->feat32 = p;
        d->feat32_cap = need;
    }
    float *o = d->feat32;
    for (int32_t i = 0; i < n; i++) {
        const uint8_t *h = (const uint8_t *)d->feeds[i].features; /* the payload: may be unaligned */
        size_t m = (size_t)d->feeds[i].n * (size_t)d->fw;
        for (size_t j = 0; j < m; j++) o[j] = quant_f16_to_f32((uint16_t)(h[2 * j] | h[2 * j + 1] << 8));
        d->feeds[i].features = o;
        o += m;
    }
    return AE_OK;
}

uint32_t draft_server_propose(draft_server *d, const uint8_t *msg, uint32_t len, const uint8_t *payload,
                              uint32_t payload_len, uint8_t *out, uint32_t cap, uint32_t *out_len, ae_error *err) {
    aerie_ProposeRequest *rq = &d->req;
    *out_len = 0;
    if (msg_decode(aerie_ProposeRequest_fields, rq, msg, len, err) != AE_OK) return RPC_INVALID_ARGUMENT;
    tree_params tp = {(int32_t)rq->shape.steps, (int32_t)rq->shape.topk, (int32_t)rq->shape.tokens};
    if (!rq->has_shape || rq->shape.steps > TREE_MAX_STEPS || rq->shape.topk > TREE_MAX_TOPK ||
        rq->shape.tokens > TREE_MAX_NODES) {
        err_set(err, "tree shape %u steps, top-%u, %u nodes is out of range (1..%d, 1..%d, 2..%d)", rq->shape.steps,
                rq->shape.topk, rq->shape.tokens, TREE_MAX_STEPS, TREE_MAX_TOPK, TREE_MAX_NODES);
        return RPC_INVALID_ARGUMENT;
    }
    if (tree_params_check(&tp, err) != AE_OK) return RPC_INVALID_ARGUMENT;
    if (rq->feature_width != (uint32_t)d->fw) {
        err_set(err, "features of width %u, this head takes %d (3 x hidden %d): another target model?",
                rq->feature_width, d->fw, d->head->cfg.hidden);
        return RPC_FAILED_PRECONDITION;
    }
    const int32_t *want = d->head->cfg.n_aux_layers ? d->head->cfg.aux_layers : d->default_layers;
    bool layers_ok = rq->capture_layers_count == EAGLE_N_AUX;
    for (int32_t i = 0; layers_ok && i < EAGLE_N_AUX; i++) layers_ok = rq->capture_layers[i] == (uint32_t)want[i];
    if (!layers_ok) {
        err_set(err, "features captured at other target layers than this head reads (%d, %d, %d)", want[0], want[1],
                want[2]);
        return RPC_FAILED_PRECONDITION;
    }
    bool f16 = rq->feature_type == aerie_FeatureType_FEATURES_F16;
    if (!f16 && rq->feature_type != aerie_FeatureType_FEATURES_F32) {
        err_set(err, "feature type %d: expected FEATURES_F32 (0) or FEATURES_F16 (1)", (int)rq->feature_type);
        return RPC_INVALID_ARGUMENT;
    }
    const size_t feat_bytes = (f16 ? sizeof(uint16_t) : sizeof(float)) * (size_t)d->fw;
    int32_t n = (int32_t)rq->seqs_count;
    /* Validate everything before any state changes. */
    for (int32_t i = 0; i < n; i++) {
        const aerie_DraftSeq *s = &rq->seqs[i];
        for (int32_t j = 0; j < i; j++)
            if (rq->seqs[j].seq == s->seq) {
                err_set(err, "sequence %u appears twice in one call", s->seq);
                return RPC_INVALID_ARGUMENT;
            }
        if (s->reset && s->start != 0) {
            err_set(err, "sequence %u: reset with start %u (must be 0)", s->seq, s->start);
            return RPC_INVALID_ARGUMENT;
        }
        if (s->fork && (s->reset || s->fork_of == s->seq)) {
            err_set(err, "sequence %u: a fork of sequence %u%s", s->seq, s->fork_of, s->reset ? " with reset" : "");
            return RPC_INVALID_ARGUMENT;
        }
        if (s->pairs > (uint32_t)d->cfg.max_seq_len) {
            err_set(err, "sequence %u: %u pairs in one call, at most %d", s->seq, s->pairs, d->cfg.max_seq_len);
            return RPC_INVALID_ARGUMENT;
        }
        const void *tok, *feat;
        if (frame_payload_slice(payload, payload_len, s->tokens.offset, s->tokens.length, sizeof(int32_t), s->pairs,
                                &tok, err) != AE_OK ||
            frame_payload_slice(payload, payload_len, s->features.offset, s->features.length, feat_bytes, s->pairs,
                                &feat, err) != AE_OK) {
            err_prefix(err, "sequence %u: ", s->seq);
            return RPC_INVALID_ARGUMENT;
        }
        const int32_t *t = tok;
        for (uint32_t j = 0; j < s->pairs; j++)
            if (t[j] < 0 || t[j] >= d->head->target.vocab) {
                err_set(err, "sequence %u: token %d is not in the vocabulary of %d", s->seq, t[j],
                        d->head->target.vocab);
                return RPC_INVALID_ARGUMENT;
            }
        d->feeds[i] = (drafter_feed){-1, s->reset, (int32_t)s->start, (int32_t)s->pairs, t, feat, s->want_tree, -1};
    }
    if (f16 && widen_features(d, n, err) != AE_OK) return RPC_RESOURCE_EXHAUSTED;
    /* Map sequences to slots: known ones first (so that a new one never
     * evicts a sequence of this very call), then the ones starting over. */
    bool *mark = d->in_call;
    memset(mark, 0, (size_t)d->cfg.max_keys);
    d->use_clock++;
    for (int32_t i = 0; i < n; i++) {
        const aerie_DraftSeq *s = &rq->seqs[i];
        d->feed_of[i] = -1;
        d->fork_src[i] = -1;
        if (s->reset) continue;
        if (s->fork) {
            /* The source, as it is before this call's feeds, is kept from
             * eviction; the fork takes a slot below. */
            int32_t src = slot_find(d, rq->client, s->fork_of);
            if (src >= 0 && drafter_len(d->drafter, src) == (int32_t)s->start &&
                (int64_t)s->start + s->pairs <= d->cfg.max_seq_len) {
                mark[src] = true;
                d->fork_src[i] = src;
            }
            continue;
        }
        int32_t k = slot_find(d, rq->client, s->seq);
        if (k < 0) continue;
        mark[k] = true;
        if (drafter_len(d->drafter, k) != (int32_t)s->start || (int64_t)s->start + s->pairs > d->cfg.max_seq_len)
            continue; /* gone: out of step, or the window is full */
        d->feed_of[i] = k;
    }
    for (int32_t i = 0; i < n; i++) {
        const aerie_DraftSeq *s = &rq->seqs[i];
        if (!s->reset && d->fork_src[i] < 0) continue;
        int32_t k = slot_take(d, rq->client, s->seq, mark);
        if (k < 0) {
            err_set(err, "all %d draft slots are in this call", d->cfg.max_keys);
            return RPC_RESOURCE_EXHAUSTED;
        }
        mark[k] = true;
        d->feed_of[i] = k;
    }
    int32_t nf = 0;
    drafter_feed feeds[DRAFT_SERVER_MAX_SEQS];
    int32_t row_of[DRAFT_SERVER_MAX_SEQS];
    for (int32_t i = 0; i < n; i++) {
        row_of[i] = -1;
        if (d->feed_of[i] < 0) continue;
        feeds[nf] = d->feeds[i];
        feeds[nf].key = d->feed_of[i];
        feeds[nf].fork_of = d->fork_src[i];
        d->slots[d->feed_of[i]].last_use = d->use_clock;
        row_of[i] = nf++;
    }
    int64_t t0 = mono_ns();
    if (nf > 0 && drafter_propose(d->drafter, feeds, nf, &tp, d->trees, err) != AE_OK) return RPC_INVALID_ARGUMENT;
    int64_t busy = mono_ns() - t0;
    aerie_ProposeReply *rp = &d->rep;
    memset(rp, 0, sizeof *rp);
    rp->trees_count = (pb_size_t)n;
    rp->server_ns = (uint64_t)busy;
    uint64_t trees = 0, pairs = 0, gone = 0;
    for (int32_t i = 0; i < n; i++) {
        aerie_DraftTree *t = &rp->trees[i];
        if (row_of[i] < 0) {
            t->status = aerie_SeqStatus_SEQ_STATE_GONE;
            gone++;
            continue;
        }
        pairs += (uint64_t)feeds[row_of[i]].n;
        if (!feeds[row_of[i]].want_tree) continue;
        const tree_out *o = &d->trees[row_of[i]];
        if (o->n > 0) trees++;
        t->tokens_count = t->parents_count = t->probs_count = (pb_size_t)o->n;
        memcpy(t->tokens, o->tokens, (size_t)o->n * sizeof(int32_t));
        memcpy(t->parents, o->parents, (size_t)o->n * sizeof(int32_t));
        memcpy(t->probs, o->probs, (size_t)o->n * sizeof(float));
    }
    if (msg_encode(aerie_ProposeReply_fields, rp, out, cap, out_len, err) != AE_OK) return RPC_INTERNAL;
    pthread_mutex_lock(&d->mu);
    d->stats.calls++;
    d->stats.seqs += (uint64_t)n;
    d->stats.trees += trees;
    d->stats.pairs += pairs;
    d->stats.state_gone += gone;
    d->stats.busy_ns += (uint64_t)busy;
    int32_t used = 0;
    for (int32_t k = 0; k < d->cfg.max_keys; k++) used += d->slots[k].used;
    d->stats.keys_used = used;
    pthread_mutex_unlock(&d->mu);
    return RPC_OK;
}

static void do_release(draft_server *d, rpc_call *call) {
    const rpc_request *rq = rpc_call_request(call);
    aerie_ReleaseRequest r;
    ae_error err = {{0}};
    if (msg_decode(aerie_ReleaseRequest_fields, &r, rq->msg, rq->msg_len, &err) != AE_OK) {
        rpc_call_fail(call, RPC_INVALID_ARGUMENT, "%s", err.msg);
        return;
    }
    for (pb_size_t i = 0; i < r.seqs_count; i++) {
        int32_t k = slot_find(d, r.client, r.seqs[i]);
        if (k < 0) continue;
        drafter_release(d->drafter, k);
        d->slots[k].used = false;
    }
    rpc_call_finish(call, RPC_OK, NULL, 0, NULL, 0);
}

/* Answers one Propose or Release (the worker's body). */
static void serve(draft_server *d, rpc_call *call, bool stopping) {
    const rpc_request *rq = rpc_call_request(call);
    if (stopping) {
        rpc_call_fail(call, RPC_UNAVAILABLE, "the draft service is shutting down");
    } else if (rpc_call_cancelled(call)) {
        rpc_call_fail(call, RPC_CANCELLED, "cancelled before it ran");
    } else if (rq->method == aerie_Method_DRAFT_RELEASE) {
        do_release(d, call);
    } else {
        uint32_t out_len;
        ae_error err = {{0}};
        uint32_t st = draft_server_propose(d, rq->msg, rq->msg_len, rq->payload, rq->payload_len, d->out,
                                           DRAFT_SERVER_REPLY_CAP, &out_len, &err);
        if (st == RPC_OK) {
            rpc_call_finish(call, RPC_OK, d->out, out_len, NULL, 0);
        } else {
            pthread_mutex_lock(&d->mu);
            d->stats.errors++;
            pthread_mutex_unlock(&d->mu);
            LOG_WARNF("propose_refused status=%s reason=\"%s\"", frame_status_name(st), err.msg);
            rpc_call_fail(call, st, "%s", err.msg);
        }
    }
}

/* Waits (under d->mu) until a job comes or the service stops. Watched by
 * systemd (draft_server_watch), the worker beats every interval/4 meanwhile: a
 * Propose that hangs stops the beats, which the RPC loop alone would keep
 * sending. Unwatched it sleeps until woken: an idle draft wakes for
 * nothing (tests/integration/test_services.py measures it). */
static void worker_wait(draft_server *d, int *beat) {
    while (!d->head_job && !d->stopping) {
        if (!d->wd) {
            pthread_cond_wait(&d->cv, &d->mu);
            continue;
        }
        if (*beat < 0) *beat = watchdog_add(d->wd, "draft-worker");
        watchdog_beat(d->wd, *beat);
        int64_t t = mono_ns() + watchdog_interval_ns(d->wd) / 4;
        struct timespec until = {t / 1000000000, t % 1000000000};
        pthread_cond_timedwait(&d->cv, &d->mu, &until);
    }
}

static void *worker_main(void *arg) {
    draft_server *d = arg;
    int beat = -1;
    for (;;) {
        pthread_mutex_lock(&d->mu);
        worker_wait(d, &beat);
        job *j = d->head_job;
        if (!j) {
            pthread_mutex_unlock(&d->mu);
            return NULL;
        }
        d->head_job = j->next;
        if (!d->head_job) d->tail_job = NULL;
        d->queued--;
        d->busy = true;
        bool stopping = d->stopping;
        pthread_mutex_unlock(&d->mu);
        rpc_call *call = j->call;
        free(j);
        serve(d, call, stopping);
        pthread_mutex_lock(&d->mu);
        watchdog_beat(d->wd, beat);
        d->busy = false;
        pthread_cond_broadcast(&d->idle);
        pthread_mutex_unlock(&d->mu);
    }
}

int draft_server_init(draft_server **out, const eagle_head *h, const draft_server_config *cfg, ae_error *err) {
    *out = NULL;
    if (cfg->max_keys < DRAFT_SERVER_MAX_SEQS || cfg->max_keys > 4096)
        return err_set(err, "draft: %d sequence slots; need %d..4096 (a call may carry %d sequences)", cfg->max_keys,
                       DRAFT_SERVER_MAX_SEQS, DRAFT_SERVER_MAX_SEQS);
    draft_server *d = calloc(1, sizeof *d);
    if (!d) return err_set(err, "out of memory");
    d->head = h;
    d->cfg = *cfg;
    d->fw = EAGLE_N_AUX * h->cfg.hidden;
    capture_default_layers(h->target.n_layers, d->default_layers);
    pthread_mutex_init(&d->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&d->cv, &ca);
    pthread_cond_init(&d->idle, &ca);
    pthread_condattr_destroy(&ca);
    drafter_config dc = {cfg->max_keys, cfg->max_seq_len, cfg->max_tokens, cfg->threads, NULL, cfg->act_bits};
    d->slots = calloc((size_t)cfg->max_keys, sizeof *d->slots);
    d->in_call = calloc((size_t)cfg->max_keys, sizeof *d->in_call);
    d->out = malloc(DRAFT_SERVER_REPLY_CAP);
    if (!d->slots || !d->in_call || !d->out) {
        err_set(err, "out of memory");
        goto fail;
    }
    if (drafter_init(&d->drafter, h, &dc, err) != AE_OK) goto fail;
    if (pthread_create(&d->worker, NULL, worker_main, d) != 0) {
        err_set(err, "cannot start the draft worker");
        goto fail;
    }
    *out = d;
    return AE_OK;
fail:
    drafter_free(d->drafter);
    free(d->slots);
    free(d->in_call);
    free(d->out);
    free(d);
    return AE_ERR;
}

void draft_server_free(draft_server *d) {
    if (!d) return;
    pthread_mutex_lock(&d->mu);
    d->stopping = true;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    pthread_join(d->worker, NULL);
    drafter_free(d->drafter);
    free(d->slots);
    free(d->in_call);
    free(d->out);
    free(d->feat32);
    free(d->config_json);
    free(d->memory_plan);
    pthread_mutex_destroy(&d->mu);
    pthread_cond_destroy(&d->cv);
    pthread_cond_destroy(&d->idle);
    free(d);
}

void draft_server_watch(draft_server *d, watchdog *w) {
    pthread_mutex_lock(&d->mu);
    d->wd = w;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
}

void draft_server_set_info(draft_server *d, const char *config_json, const char *memory_plan) {
    pthread_mutex_lock(&d->mu);
    free(d->config_json);
    free(d->memory_plan);
    d->config_json = config_json ? strdup(config_json) : NULL;
    d->memory_plan = memory_plan ? strdup(memory_plan) : NULL;
    pthread_mutex_unlock(&d->mu);
}

draft_server_stats draft_server_get_stats(draft_server *d) {
    pthread_mutex_lock(&d->mu);
    draft_server_stats s = d->stats;
    pthread_mutex_unlock(&d->mu);
    return s;
}

void draft_server_drain(draft_server *d) {
    pthread_mutex_lock(&d->mu);
    d->draining = true;
    while (d->head_job || d->busy) pthread_cond_wait(&d->idle, &d->mu);
    pthread_mutex_unlock(&d->mu);
}

static void answer_info(draft_server *d, rpc_call *call) {
    static _Thread_local aerie_InfoReply r;
    static _Thread_local uint8_t buf[aerie_InfoReply_size];
    memset(&r, 0, sizeof r);
    r.contract_version = FRAME_VERSION;
    snprintf(r.service, sizeof r.service, "aerie-draft");
    pthread_mutex_lock(&d->mu);
    snprintf(r.config_json, sizeof r.config_json, "%s", d->config_json ? d->config_json : "{}");
    snprintf(r.memory_plan, sizeof r.memory_plan, "%s", d->memory_plan ? d->memory_plan : "");
    draft_server_stats s = d->stats;
    int32_t queued = d->queued;
    pthread_mutex_unlock(&d->mu);
    snprintf(r.stats_json, sizeof r.stats_json,
             "{\"calls\": %llu, \"seqs\": %llu, \"trees\": %llu, \"pairs\": %llu, \"state_gone\": %llu, "
             "\"evictions\": %llu, \"errors\": %llu, \"busy_seconds\": %.3f, \"keys_used\": %d, \"max_keys\": %d, "
             "\"queued\": %d}",
             (unsigned long long)s.calls, (unsigned long long)s.seqs, (unsigned long long)s.trees,
             (unsigned long long)s.pairs, (unsigned long long)s.state_gone, (unsigned long long)s.evictions,
             (unsigned long long)s.errors, (double)s.busy_ns / 1e9, s.keys_used, d->cfg.max_keys, queued);
    uint32_t len;
    ae_error err = {{0}};
    if (msg_encode(aerie_InfoReply_fields, &r, buf, sizeof buf, &len, &err) != AE_OK)
        rpc_call_fail(call, RPC_INTERNAL, "%s", err.msg);
    else
        rpc_call_finish(call, RPC_OK, buf, len, NULL, 0);
}

void draft_server_handle(void *ctx, rpc_call *call, const rpc_request *req) {
    draft_server *d = ctx;
    switch (req->method) {
    case aerie_Method_DRAFT_INFO: answer_info(d, call); return;
    case aerie_Method_DRAFT_HEALTH: {
        aerie_HealthReply h = {true, ""};
        pthread_mutex_lock(&d->mu);
        if (d->draining) h.serving = false, snprintf(h.reason, sizeof h.reason, "shutting down");
        pthread_mutex_unlock(&d->mu);
        uint8_t buf[aerie_HealthReply_size];
        uint32_t len = 0;
        msg_encode(aerie_HealthReply_fields, &h, buf, sizeof buf, &len, NULL);
        rpc_call_finish(call, RPC_OK, buf, len, NULL, 0);
        return;
    }
    case aerie_Method_DRAFT_PROPOSE:
    case aerie_Method_DRAFT_RELEASE: break;
    default: rpc_call_fail(call, RPC_UNIMPLEMENTED, "aerie-draft has no method %u", req->method); return;
    }
    /* With the worker idle and nothing queued, the call is served here on
     * the event loop: a hand-off to another thread costs about as much as
     * the rest of the link. Calls that come meanwhile wait in the socket,
     * and the loop does not read them until this one is done. */
    pthread_mutex_lock(&d->mu);
    bool inline_ok = !d->busy && !d->head_job && !d->draining && !d->stopping;
    if (inline_ok) d->busy = true;
    pthread_mutex_unlock(&d->mu);
    if (inline_ok) {
        serve(d, call, false);
        pthread_mutex_lock(&d->mu);
        d->busy = false;
        pthread_cond_broadcast(&d->idle);
        pthread_mutex_unlock(&d->mu);
        return;
    }
    job *j = malloc(sizeof *j);
    pthread_mutex_lock(&d->mu);
    if (!j || d->draining || d->stopping || d->queued >= DRAFT_SERVER_MAX_QUEUE) {
        uint32_t st = j && d->queued >= DRAFT_SERVER_MAX_QUEUE && !d->draining && !d->stopping ? RPC_RESOURCE_EXHAUSTED
                                                                                               : RPC_UNAVAILABLE;
        pthread_mutex_unlock(&d->mu);
        rpc_call_fail(call, st, "%s",
                      !j                             ? "out of memory"
                      : st == RPC_RESOURCE_EXHAUSTED ? "the draft's queue is full"
                                                     : "the draft service is shutting down");
        free(j);
        return;
    }
    *j = (job){call, NULL};
    if (d->tail_job)
        d->tail_job->next = j;
    else
        d->head_job = j;
    d->tail_job = j;
    d->queued++;
    pthread_cond_signal(&d->cv);
    pthread_mutex_unlock(&d->mu);
}
