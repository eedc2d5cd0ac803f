#include "router.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <event2/event.h>

#include "../services/core/json.h"
#include "../services/core/log.h"
#include "../services/rpc/msg.h"
#include "aerie.pb.h"

typedef struct peer {
    router *r;
    bool is_draft;
    char addr[256];
    rpc_client *cl;
    bool healthy;
    bool checking; /* a Health or Info call is in flight */
    char reason[512];
    int inflight;
    int running, waiting, kv_blocks_used, kv_blocks;
    double grammar_masks, grammar_mask_seconds;
    double tp, allreduces_per_step, allreduces_total, allreduce_seconds; /* its Info's "tp" and "allreduces" */
    int32_t max_seq_len;
    char *config_json, *memory_plan, *stats_json; /* the latest Info */
} peer;

struct router {
    rpc_loop *loop;
    struct event *timer;
    int interval_ms;
    rpc_tls tls;
    uint32_t max_frame;
    peer targets[ROUTER_MAX_TARGETS];
    int n_targets;
    peer drafts[ROUTER_MAX_TARGETS];
    int n_drafts;
    unsigned rr;
    bool closing; /* no more picks: calls ending now must not start new ones */
};

static int peer_open(router *r, peer *p, const char *addr, bool is_draft, ae_error *err) {
    memset(p, 0, sizeof *p);
    p->r = r;
    p->is_draft = is_draft;
    snprintf(p->addr, sizeof p->addr, "%s", addr);
    snprintf(p->reason, sizeof p->reason, "not checked yet");
    rpc_client_config cc = {addr, r->tls, r->max_frame, 0};
    if (rpc_client_open(&p->cl, r->loop, &cc, err) != AE_OK) {
        err_prefix(err, "%s: ", addr);
        return AE_ERR;
    }
    return AE_OK;
}

static void peer_down(peer *p, const char *why) {
    /* Logged when it goes down and when the reason changes, not every check. */
    if (p->healthy || strncmp(p->reason, why, sizeof p->reason - 1) != 0)
        LOG_WARNF("%s_unhealthy addr=%s reason=\"%s\"", p->is_draft ? "draft" : "target", p->addr, why);
    p->healthy = false;
    snprintf(p->reason, sizeof p->reason, "%.500s", why);
}

static void replace(char **dst, const char *src) {
    free(*dst);
    *dst = strdup(src);
}

static int json_field_int(const cJSON *o, const char *name) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    int64_t x;
    return json_int(v, 0, INT32_MAX, &x) ? (int)x : 0;
}

static void add_draft(router *r, const char *addr) {
    for (int i = 0; i < r->n_drafts; i++)
        if (strcmp(r->drafts[i].addr, addr) == 0) return;
    if (r->n_drafts == ROUTER_MAX_TARGETS) return;
    ae_error err = {{0}};
    if (peer_open(r, &r->drafts[r->n_drafts], addr, true, &err) != AE_OK) {
        LOG_WARNF("draft_info_unreachable addr=%s reason=\"%s\"", addr, err.msg);
        return;
    }
    r->n_drafts++;
}

/* Settings a target's Info tells the gateway: its context length and
 * its draft. */
static void read_target_config(peer *p, const char *config_json) {
    cJSON *c = json_parse(config_json, strlen(config_json), NULL);
    if (!c) return;
    const cJSON *msl = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(c, "max-seq-len"), "value");
    int64_t v;
    /* Bounded: the gateway sizes a request's token buffer from it. */
    if (json_int(msl, 1, 1 << 24, &v)) p->max_seq_len = (int32_t)v;
    const cJSON *da = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(c, "draft-addr"), "value");
    if (cJSON_IsString(da) && strcmp(da->valuestring, "none") != 0) add_draft(p->r, da->valuestring);
    cJSON_Delete(c);
}

static void info_done(void *ctx, const rpc_reply *rep) {
    peer *p = ctx;
    p->checking = false;
    if (rep->status != RPC_OK) return;
    aerie_InfoReply *info = malloc(sizeof *info);
    if (!info) return;
    if (msg_decode(aerie_InfoReply_fields, info, rep->msg, rep->msg_len, NULL) == AE_OK) {
        replace(&p->memory_plan, info->memory_plan);
        replace(&p->stats_json, info->stats_json);
        if (!p->config_json || strcmp(p->config_json, info->config_json) != 0) {
            replace(&p->config_json, info->config_json);
            if (!p->is_draft) read_target_config(p, info->config_json);
        }
        cJSON *s = json_parse(info->stats_json, strlen(info->stats_json), NULL);
        if (s && !p->is_draft) {
            p->running = json_field_int(s, "running") + json_field_int(s, "prefilling");
            p->waiting = json_field_int(s, "waiting");
            p->kv_blocks_used = json_field_int(s, "kv_blocks_used");
            p->kv_blocks = json_field_int(s, "kv_blocks");
            const cJSON *gm = cJSON_GetObjectItemCaseSensitive(s, "grammar_masks"),
                        *gt = cJSON_GetObjectItemCaseSensitive(s, "grammar_mask_ms");
            p->grammar_masks = cJSON_IsNumber(gm) ? gm->valuedouble : 0;
            p->grammar_mask_seconds = cJSON_IsNumber(gt) ? gt->valuedouble / 1e3 : 0;
            const cJSON *tp = cJSON_GetObjectItemCaseSensitive(s, "tp"),
                        *ar = cJSON_GetObjectItemCaseSensitive(s, "allreduces");
            const cJSON *aps = cJSON_GetObjectItemCaseSensitive(ar, "per_step"),
                        *at = cJSON_GetObjectItemCaseSensitive(ar, "total"),
                        *as = cJSON_GetObjectItemCaseSensitive(ar, "seconds_total");
            p->tp = cJSON_IsNumber(tp) ? tp->valuedouble : 1;
            p->allreduces_per_step = cJSON_IsNumber(aps) ? aps->valuedouble : 0;
            p->allreduces_total = cJSON_IsNumber(at) ? at->valuedouble : 0;
            p->allreduce_seconds = cJSON_IsNumber(as) ? as->valuedouble : 0;
        }
        cJSON_Delete(s);
    }
    free(info);
}

static void health_done(void *ctx, const rpc_reply *rep) {
    peer *p = ctx;
    aerie_HealthReply h = aerie_HealthReply_init_zero;
    char why[512];
    if (rep->status != RPC_OK) {
        snprintf(why, sizeof why, "health check failed: %.400s", rep->error);
    } else if (msg_decode(aerie_HealthReply_fields, &h, rep->msg, rep->msg_len, NULL) != AE_OK) {
        snprintf(why, sizeof why, "health check: an invalid reply");
    } else if (!h.serving) {
        snprintf(why, sizeof why, "not serving: %.300s", h.reason);
    } else {
        if (!p->healthy) LOG_INFOF("%s_healthy addr=%s", p->is_draft ? "draft" : "target", p->addr);
        p->healthy = true;
        p->reason[0] = '\0';
        uint32_t id;
        uint16_t m = p->is_draft ? aerie_Method_DRAFT_INFO : aerie_Method_TARGET_INFO;
        if (rpc_client_start(p->cl, m, NULL, 0, NULL, 0, (uint32_t)p->r->interval_ms * 1000, NULL, info_done, p, &id,
                             NULL) != AE_OK)
            p->checking = false;
        return;
    }
    p->checking = false;
    peer_down(p, why);
}

static void check(peer *p) {
    if (p->checking) return; /* the last check is still out; its deadline ends it */
    if (!rpc_client_connected(p->cl)) {
        char why[512];
        snprintf(why, sizeof why, "not connected to %.256s", p->addr);
        peer_down(p, why);
        return;
    }
    uint16_t m = p->is_draft ? aerie_Method_DRAFT_HEALTH : aerie_Method_TARGET_HEALTH;
    uint32_t id;
    p->checking = true;
    if (rpc_client_start(p->cl, m, NULL, 0, NULL, 0, (uint32_t)p->r->interval_ms * 1000, NULL, health_done, p, &id,
                         NULL) != AE_OK) {
        p->checking = false;
        peer_down(p, "the connection was lost");
    }
}

static void on_timer(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    router *r = arg;
    for (int i = 0; i < r->n_targets; i++) check(&r->targets[i]);
    for (int i = 0; i < r->n_drafts; i++) check(&r->drafts[i]);
    struct timeval tv = {r->interval_ms / 1000, (r->interval_ms % 1000) * 1000};
    event_add(r->timer, &tv);
}

typedef struct open_job {
    router *r;
    const router_config *cfg;
    ae_error *err;
    int rc;
} open_job;

static void open_on_loop(void *arg) {
    open_job *j = arg;
    router *r = j->r;
    j->rc = AE_ERR;
    for (int i = 0; i < j->cfg->n_addrs; i++) {
        if (peer_open(r, &r->targets[i], j->cfg->addrs[i], false, j->err) != AE_OK) return;
        r->n_targets++;
    }
    /* The first check comes soon after the connections are made, so that
     * a gateway started after its targets is ready at once; the next ones
     * every interval. */
    r->timer = event_new(rpc_loop_base(r->loop), -1, 0, on_timer, r);
    struct timeval tv = {0, 20000};
    if (!r->timer || event_add(r->timer, &tv) != 0) {
        err_set(j->err, "cannot start the health-check timer");
        return;
    }
    j->rc = AE_OK;
}

static void close_on_loop(void *arg) {
    router *r = arg;
    r->closing = true;
    if (r->timer) event_free(r->timer);
    for (int i = 0; i < r->n_targets; i++) rpc_client_close(r->targets[i].cl);
    for (int i = 0; i < r->n_drafts; i++) rpc_client_close(r->drafts[i].cl);
}

int router_open(router **out, rpc_loop *l, const router_config *cfg, ae_error *err) {
    *out = NULL;
    if (cfg->n_addrs < 1 || cfg->n_addrs > ROUTER_MAX_TARGETS)
        return err_set(err, "%d targets given (1 to %d)", cfg->n_addrs, ROUTER_MAX_TARGETS);
    router *r = calloc(1, sizeof *r);
    if (!r) return err_set(err, "out of memory");
    r->loop = l;
    r->tls = cfg->tls;
    r->max_frame = cfg->max_frame;
    r->interval_ms = cfg->health_interval_ms > 0 ? cfg->health_interval_ms : 1000;
    open_job j = {r, cfg, err, AE_ERR};
    rpc_loop_run(l, open_on_loop, &j);
    if (j.rc != AE_OK) {
        router_close(r);
        return AE_ERR;
    }
    *out = r;
    return AE_OK;
}

void router_close(router *r) {
    if (!r) return;
    rpc_loop_run(r->loop, close_on_loop, r);
    for (int i = 0; i < ROUTER_MAX_TARGETS; i++) {
        peer *ps[2] = {&r->targets[i], &r->drafts[i]};
        for (int k = 0; k < 2; k++) free(ps[k]->config_json), free(ps[k]->memory_plan), free(ps[k]->stats_json);
    }
    free(r);
}

int router_count(const router *r) { return r->n_targets; }
rpc_client *router_client(router *r, int i) { return r->targets[i].cl; }
const char *router_addr(const router *r, int i) { return r->targets[i].addr; }
void router_begin(router *r, int i) { r->targets[i].inflight++; }
void router_end(router *r, int i) { r->targets[i].inflight--; }

void router_fail(router *r, int i, const char *why) { peer_down(&r->targets[i], why); }

int router_pick(router *r, uint64_t exclude) {
    int best = -1;
    if (r->closing) return -1;
    unsigned start = r->rr++;
    for (int k = 0; k < r->n_targets; k++) {
        int i = (int)((start + (unsigned)k) % (unsigned)r->n_targets);
        const peer *p = &r->targets[i];
        /* A replica is used once its Info told its context length. */
        if (!p->healthy || p->max_seq_len <= 0 || (exclude >> i & 1) || !rpc_client_connected(p->cl)) continue;
        if (best < 0 || p->inflight < r->targets[best].inflight ||
            (p->inflight == r->targets[best].inflight && p->waiting < r->targets[best].waiting))
            best = i;
    }
    return best;
}

int router_healthy(const router *r, char *why, size_t cap) {
    int n = 0;
    size_t used = 0;
    if (cap) why[0] = '\0';
    for (int i = 0; i < r->n_targets; i++) {
        const peer *p = &r->targets[i];
        if (p->healthy) {
            n++;
            continue;
        }
        int w = snprintf(why + used, cap - used, "%s%s: %s", used ? "; " : "", p->addr, p->reason);
        if (w > 0) used = used + (size_t)w < cap ? used + (size_t)w : cap - 1;
    }
    return n;
}

int32_t router_context(const router *r) {
    int32_t ctx = 0;
    for (int i = 0; i < r->n_targets; i++) {
        int32_t c = r->targets[i].max_seq_len;
        if (c > 0 && (ctx == 0 || c < ctx)) ctx = c;
    }
    return ctx;
}

void router_gauges(const router *r, metrics_target *t) {
    for (int i = 0; i < r->n_targets; i++) {
        const peer *p = &r->targets[i];
        t[i] = (metrics_target){p->addr,
                                p->healthy,
                                p->inflight,
                                p->running,
                                p->waiting,
                                p->kv_blocks_used,
                                p->kv_blocks,
                                p->grammar_masks,
                                p->grammar_mask_seconds,
                                p->tp,
                                p->allreduces_per_step,
                                p->allreduces_total,
                                p->allreduce_seconds};
    }
}

/* A JSON text from a peer as an object, or as a string when it is not JSON. */
static void add_json(cJSON *o, const char *name, const char *text) {
    if (!text) {
        cJSON_AddNullToObject(o, name);
        return;
    }
    cJSON *v = json_parse(text, strlen(text), NULL);
    if (v)
        cJSON_AddItemToObject(o, name, v);
    else
        cJSON_AddStringToObject(o, name, text);
}

static cJSON *peer_json(const peer *p) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "addr", p->addr);
    cJSON_AddBoolToObject(o, "healthy", p->healthy);
    if (p->healthy)
        cJSON_AddNullToObject(o, "reason");
    else
        cJSON_AddStringToObject(o, "reason", p->reason);
    if (!p->is_draft) cJSON_AddNumberToObject(o, "gateway_inflight", p->inflight);
    add_json(o, "config", p->config_json);
    if (p->memory_plan)
        cJSON_AddStringToObject(o, "memory_plan", p->memory_plan);
    else
        cJSON_AddNullToObject(o, "memory_plan");
    add_json(o, "stats", p->stats_json);
    return o;
}

char *router_info_json(const router *r) {
    cJSON *root = cJSON_CreateObject();
    cJSON *ts = cJSON_AddArrayToObject(root, "targets"), *ds = cJSON_AddArrayToObject(root, "drafts");
    for (int i = 0; i < r->n_targets; i++) cJSON_AddItemToArray(ts, peer_json(&r->targets[i]));
    for (int i = 0; i < r->n_drafts; i++) cJSON_AddItemToArray(ds, peer_json(&r->drafts[i]));
    /* cJSON takes NULL everywhere, so a failed allocation anywhere above
     * ends here as NULL. */
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return s;
}
