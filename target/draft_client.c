#include "draft_client.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>
#include <time.h>

#include "../services/core/clock.h"
#include "../services/core/log.h"
#include "../services/model/quant.h"
#include "../services/rpc/msg.h"
#include "aerie.pb.h"

#define DRAFT_CLIENT_MAX_SEQS 64 /* per call: aerie.options ProposeRequest.seqs */

struct draft_client {
    draft_client_config cfg;
    char addr[256];
    rpc_client *rpc;
    uint64_t client_id;
    spec_drafter iface;
    /* one call (spec calls from one thread) */
    aerie_ProposeRequest req;
    aerie_ProposeReply rep;
    uint8_t msg[aerie_ProposeRequest_size];
    rpc_iov iov[3 * DRAFT_CLIENT_MAX_SEQS];
    uint16_t *half;  /* the call's features as f16, grown to the largest call */
    size_t half_cap; /* elements */
    rpc_reply reply;
    pthread_mutex_t mu; /* stats */
    draft_client_stats stats;
};

static void count(draft_client *d, uint64_t *field) {
    pthread_mutex_lock(&d->mu);
    d->stats.failures++;
    (*field)++;
    pthread_mutex_unlock(&d->mu);
}

/* f16 of x, saturated: the draft reads a feature beyond f16's range as
 * its largest rather than inf (its output changes speed, not tokens). */
static uint16_t feature_f16(float x) {
    if (x > 65504.0f)
        x = 65504.0f;
    else if (x < -65504.0f)
        x = -65504.0f;
    return quant_f32_to_f16(x);
}

/* feeds' features as f16 in d->half, one run per feed, in order. */
static int features_f16(draft_client *d, const spec_feed *feeds, int32_t n, ae_error *err) {
    size_t need = 0, fw = (size_t)d->cfg.feature_width;
    for (int32_t i = 0; i < n; i++) need += (size_t)feeds[i].n * fw;
    if (need > d->half_cap) {
        uint16_t *p = realloc(d->half, need * sizeof *p);
        if (!p) return err_set(err, "out of memory for %zu features of a Propose", need);
        d->half = p;
        d->half_cap = need;
    }
    uint16_t *o = d->half;
    for (int32_t i = 0; i < n; i++)
        for (size_t j = 0, m = (size_t)feeds[i].n * fw; j < m; j++) *o++ = feature_f16(feeds[i].features[j]);
    return AE_OK;
}

/* One call for feeds[0..n), n <= DRAFT_CLIENT_MAX_SEQS. */
static int propose_some(draft_client *d, const spec_feed *feeds, int32_t n, const spec_shape *shape, spec_tree *trees,
                        ae_error *err) {
    aerie_ProposeRequest *rq = &d->req;
    memset(rq, 0, sizeof *rq);
    rq->client = d->client_id;
    rq->has_shape = true;
    rq->shape = (aerie_TreeShape){(uint32_t)shape->steps, (uint32_t)shape->topk, (uint32_t)shape->tokens};
    rq->feature_width = (uint32_t)d->cfg.feature_width;
    rq->capture_layers_count = FORWARD_MAX_CAPTURE;
    for (int32_t i = 0; i < FORWARD_MAX_CAPTURE; i++) rq->capture_layers[i] = (uint32_t)d->cfg.capture[i];
    rq->seqs_count = (pb_size_t)n;
    rq->feature_type = aerie_FeatureType_FEATURES_F16;
    if (features_f16(d, feeds, n, err) != AE_OK) return AE_ERR;
    const uint16_t *half = d->half;
    uint64_t off = 0;
    int n_iov = 0;
    for (int32_t i = 0; i < n; i++) {
        const spec_feed *f = &feeds[i];
        size_t nf = (size_t)f->n * (size_t)d->cfg.feature_width;
        uint32_t tl = (uint32_t)f->n * 4, fl = (uint32_t)(nf * sizeof *half);
        rq->seqs[i] = (aerie_DraftSeq){(uint32_t)f->seq,
                                       f->reset,
                                       (uint32_t)f->start,
                                       (uint32_t)f->n,
                                       true,
                                       {(uint32_t)off, tl},
                                       true,
                                       {(uint32_t)(off + tl), fl},
                                       f->want_tree,
                                       f->fork,
                                       f->fork ? (uint32_t)f->fork_of : 0};
        d->iov[n_iov++] = (rpc_iov){f->tokens, tl};
        d->iov[n_iov++] = (rpc_iov){half, fl};
        half += nf;
        off += (uint64_t)tl + fl;
        if (fl % 4) { /* an odd count of f16: the next run's int32 tokens stay 4-byte aligned */
            static const uint16_t pad = 0;
            d->iov[n_iov++] = (rpc_iov){&pad, sizeof pad};
            off += sizeof pad;
        }
    }
    uint32_t len;
    if (msg_encode(aerie_ProposeRequest_fields, rq, d->msg, sizeof d->msg, &len, err) != AE_OK) return AE_ERR;
    int64_t t0 = clock_mono_ns();
    uint32_t st = rpc_client_callv(d->rpc, aerie_Method_DRAFT_PROPOSE, d->msg, len, d->iov, n_iov, d->cfg.deadline_us,
                                   NULL, NULL, &d->reply);
    int64_t rtt = clock_mono_ns() - t0;
    if (st != RPC_OK) {
        count(d, st == RPC_DEADLINE_EXCEEDED ? &d->stats.deadline_exceeded
                 : st == RPC_UNAVAILABLE     ? &d->stats.unavailable
                                             : &d->stats.bad_replies);
        err_set(err, "draft %s: %s: %s", d->addr, frame_status_name(st), d->reply.error);
        return st == RPC_UNAVAILABLE && !rpc_client_connected(d->rpc) ? SPEC_DRAFT_DOWN : AE_ERR;
    }
    aerie_ProposeReply *rp = &d->rep;
    if (msg_decode(aerie_ProposeReply_fields, rp, d->reply.msg, d->reply.msg_len, err) != AE_OK ||
        rp->trees_count != (pb_size_t)n) {
        count(d, &d->stats.bad_replies);
        return err_set(err, "draft %s: a malformed Propose reply", d->addr);
    }
    uint64_t gone = 0;
    for (int32_t i = 0; i < n; i++) {
        const aerie_DraftTree *t = &rp->trees[i];
        if (t->status == aerie_SeqStatus_SEQ_STATE_GONE) {
            trees[i].n = SPEC_STATE_GONE;
            gone++;
            continue;
        }
        if (t->status != aerie_SeqStatus_SEQ_OK || t->tokens_count != t->parents_count ||
            t->tokens_count != t->probs_count || t->tokens_count > ENGINE_MAX_TREE) {
            count(d, &d->stats.bad_replies);
            return err_set(err, "draft %s: a malformed tree in the Propose reply", d->addr);
        }
        /* The rest (root, parents in order, ids in range) is spec's check. */
        trees[i].n = (int32_t)t->tokens_count;
        memcpy(trees[i].tokens, t->tokens, t->tokens_count * sizeof(int32_t));
        memcpy(trees[i].parents, t->parents, t->parents_count * sizeof(int32_t));
        memcpy(trees[i].probs, t->probs, t->probs_count * sizeof(float));
    }
    pthread_mutex_lock(&d->mu);
    d->stats.calls++;
    d->stats.state_gone += gone;
    d->stats.rtt_ns += (uint64_t)rtt;
    d->stats.server_ns += rp->server_ns;
    pthread_mutex_unlock(&d->mu);
    return AE_OK;
}

static int draft_client_propose(void *ctx, const spec_feed *feeds, int32_t n, const spec_shape *shape, spec_tree *trees,
                                ae_error *err) {
    draft_client *d = ctx;
    for (int32_t at = 0; at < n; at += DRAFT_CLIENT_MAX_SEQS) {
        int32_t m = n - at < DRAFT_CLIENT_MAX_SEQS ? n - at : DRAFT_CLIENT_MAX_SEQS;
        int rc = propose_some(d, feeds + at, m, shape, trees + at, err);
        if (rc != AE_OK) return rc;
    }
    return AE_OK;
}

/* A Release's answer changes nothing here: a failed one leaves state the
 * draft's LRU takes back. */
static void count_release_failure(draft_client *d) {
    pthread_mutex_lock(&d->mu);
    d->stats.release_failures++;
    pthread_mutex_unlock(&d->mu);
}

static void release_done(void *ctx, const rpc_reply *r) {
    if (r->status != RPC_OK) count_release_failure(ctx);
}

/* Sent without waiting for the answer: spec calls this on the scheduler
 * thread as a sequence ends, and waiting up to the deadline there would
 * stall every running stream behind a slow draft. */
static void draft_client_release(void *ctx, int32_t seq) {
    draft_client *d = ctx;
    if (!rpc_client_connected(d->rpc)) return; /* its state went with the connection's draft anyway, or LRU takes it */
    aerie_ReleaseRequest r = {d->client_id, 1, {(uint32_t)seq}};
    uint8_t buf[aerie_ReleaseRequest_size];
    uint32_t len;
    if (msg_encode(aerie_ReleaseRequest_fields, &r, buf, sizeof buf, &len, NULL) != AE_OK) return;
    /* The frame is queued before this returns, so buf may go. */
    if (rpc_client_start(d->rpc, aerie_Method_DRAFT_RELEASE, buf, len, NULL, 0, d->cfg.deadline_us, NULL, release_done,
                         d, NULL, NULL) != AE_OK)
        count_release_failure(d);
}

int draft_client_open(draft_client **out, rpc_loop *loop, const draft_client_config *cfg, ae_error *err) {
    *out = NULL;
    draft_client *d = calloc(1, sizeof *d);
    if (!d) return err_set(err, "out of memory");
    d->cfg = *cfg;
    snprintf(d->addr, sizeof d->addr, "%s", cfg->addr);
    d->cfg.addr = d->addr;
    pthread_mutex_init(&d->mu, NULL);
    if (getrandom(&d->client_id, sizeof d->client_id, 0) != (ssize_t)sizeof d->client_id)
        d->client_id = (uint64_t)clock_mono_ns() ^ (uint64_t)getpid() << 32;
    rpc_client_config rc = {cfg->addr, cfg->tls, cfg->max_frame, 0};
    if (rpc_client_open(&d->rpc, loop, &rc, err) != AE_OK) {
        pthread_mutex_destroy(&d->mu);
        free(d);
        return AE_ERR;
    }
    d->iface = (spec_drafter){d, draft_client_propose, draft_client_release};
    *out = d;
    return AE_OK;
}

void draft_client_close(draft_client *d) {
    if (!d) return;
    rpc_client_close(d->rpc);
    rpc_reply_free(&d->reply);
    free(d->half);
    pthread_mutex_destroy(&d->mu);
    free(d);
}

const spec_drafter *draft_client_drafter(draft_client *d) { return &d->iface; }
bool draft_client_connected(draft_client *d) { return rpc_client_connected(d->rpc); }

draft_client_stats draft_client_get_stats(draft_client *d) {
    pthread_mutex_lock(&d->mu);
    draft_client_stats s = d->stats;
    pthread_mutex_unlock(&d->mu);
    return s;
}
