#include "metrics.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../services/core/err.h"

/* Buckets for latencies from a fast inter-token gap to a long request. */
static const double latency_le[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1,  0.15, 0.2,   0.3,
                                    0.5,   0.75,   1.0,   2.5,  5.0,   10.0, 20.0,  40.0, 80.0, 160.0, 320.0};

/* Buckets for tokens per request: powers of two up to 64k. */
static const double tokens_le[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536};

void metrics_hist_init(metrics_hist *h, const double *le, int n) {
    AE_ASSERT(n >= 1 && n <= METRICS_MAX_BUCKETS);
    memset(h, 0, sizeof *h);
    h->le = le;
    h->n = n;
}

void metrics_hist_observe(metrics_hist *h, double v) {
    int i = 0;
    while (i < h->n && v > h->le[i]) i++;
    h->counts[i]++;
    h->count++;
    h->sum += v;
}

void metrics_init(metrics *m) {
    memset(m, 0, sizeof *m);
    int n = (int)(sizeof latency_le / sizeof latency_le[0]);
    metrics_hist_init(&m->ttft, latency_le, n);
    metrics_hist_init(&m->itl, latency_le, n);
    metrics_hist_init(&m->e2e, latency_le, n);
    int nt = (int)(sizeof tokens_le / sizeof tokens_le[0]);
    metrics_hist_init(&m->prompt_hist, tokens_le, nt);
    metrics_hist_init(&m->generation_hist, tokens_le, nt);
}

void metrics_request(metrics *m, metrics_route route, int status) {
    for (int i = 0; i < m->n_requests; i++)
        if (m->requests[i].route == route && m->requests[i].status == status) {
            m->requests[i].n++;
            return;
        }
    /* The gateway answers a fixed set of statuses per route, so the table
     * cannot fill. */
    AE_ASSERT(m->n_requests < METRICS_MAX_CODES);
    m->requests[m->n_requests].route = route;
    m->requests[m->n_requests].status = status;
    m->requests[m->n_requests++].n = 1;
}

static const char *route_name(metrics_route r) {
    static const char *const names[METRICS_ROUTES] = {"chat_completions", "completions", "tokenize", "detokenize"};
    return names[r];
}

static void head(FILE *f, const char *name, const char *type, const char *help) {
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void counter(FILE *f, const char *name, const char *help, uint64_t v) {
    head(f, name, "counter", help);
    fprintf(f, "%s %llu\n", name, (unsigned long long)v);
}

static void hist(FILE *f, const char *name, const char *help, const metrics_hist *h) {
    head(f, name, "histogram", help);
    uint64_t cum = 0;
    for (int i = 0; i < h->n; i++) {
        cum += h->counts[i];
        fprintf(f, "%s_bucket{le=\"%g\"} %llu\n", name, h->le[i], (unsigned long long)cum);
    }
    cum += h->counts[h->n];
    fprintf(f, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.6f\n%s_count %llu\n", name, (unsigned long long)cum, name, h->sum,
            name, (unsigned long long)h->count);
}

static void target_series(FILE *f, const metrics_gauges *g, const char *name, const char *type, const char *help,
                          int field) {
    head(f, name, type, help);
    for (int i = 0; i < g->n_targets; i++) {
        const metrics_target *t = &g->targets[i];
        double v = field == 0    ? t->healthy
                   : field == 1  ? t->running
                   : field == 2  ? t->waiting
                   : field == 3  ? t->inflight
                   : field == 4  ? t->kv_blocks_used
                   : field == 5  ? t->kv_blocks
                   : field == 7  ? t->grammar_masks
                   : field == 8  ? t->grammar_mask_seconds
                   : field == 9  ? t->tp
                   : field == 10 ? t->allreduces_per_step
                   : field == 11 ? t->allreduces_total
                   : field == 12 ? t->allreduce_seconds
                                 : (t->kv_blocks ? (double)t->kv_blocks_used / t->kv_blocks : 0.0);
        fprintf(f, "%s{target=\"%s\"} %.15g\n", name, t->addr, v); /* counters stay exact to 1e15 */
    }
}

static void target_gauge(FILE *f, const metrics_gauges *g, const char *name, const char *help, int field) {
    target_series(f, g, name, "gauge", help, field);
}

char *metrics_render(const metrics *m, const metrics_gauges *g, size_t *len) {
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    if (!f) return NULL;
    head(f, "aerie_requests_total", "counter", "HTTP requests answered, by route and status");
    for (int i = 0; i < m->n_requests; i++)
        fprintf(f, "aerie_requests_total{route=\"%s\",code=\"%d\"} %llu\n", route_name(m->requests[i].route),
                m->requests[i].status, (unsigned long long)m->requests[i].n);
    head(f, "aerie_request_finish_total", "counter", "generation requests by how they ended");
    fprintf(f, "aerie_request_finish_total{reason=\"stop\"} %llu\n", (unsigned long long)m->finish.stop);
    fprintf(f, "aerie_request_finish_total{reason=\"length\"} %llu\n", (unsigned long long)m->finish.length);
    fprintf(f, "aerie_request_finish_total{reason=\"cancelled\"} %llu\n", (unsigned long long)m->finish.cancelled);
    fprintf(f, "aerie_request_finish_total{reason=\"error\"} %llu\n", (unsigned long long)m->finish.error);
    counter(f, "aerie_prompt_tokens_total", "prompt tokens of generation requests", m->prompt_tokens);
    counter(f, "aerie_generation_tokens_total", "tokens generated", m->generation_tokens);
    counter(f, "aerie_request_retries_total", "requests moved to another target after one failed", m->retries);
    counter(f, "aerie_constrained_requests_total", "generation requests with a response_format (JSON)", m->constrained);
    hist(f, "aerie_request_prompt_tokens", "prompt tokens per finished generation request", &m->prompt_hist);
    hist(f, "aerie_request_generation_tokens", "generated tokens per finished generation request", &m->generation_hist);
    hist(f, "aerie_time_to_first_token_seconds", "from the request's arrival to its first token", &m->ttft);
    hist(f, "aerie_inter_token_latency_seconds",
         "gap between token deliveries, divided among the tokens delivered together", &m->itl);
    hist(f, "aerie_e2e_request_latency_seconds", "from the request's arrival to its last byte", &m->e2e);
    counter(f, "aerie_spec_draft_steps_total", "verify steps that checked a drafted tree", m->spec_steps);
    counter(f, "aerie_spec_plain_steps_total", "decode steps without a draft", m->spec_plain_steps);
    counter(f, "aerie_spec_drafted_tokens_total", "drafted tokens verified", m->spec_drafted);
    counter(f, "aerie_spec_accepted_tokens_total", "drafted tokens accepted", m->spec_accepted);
    head(f, "aerie_spec_accepted_at_position_total", "counter",
         "verify steps that accepted a drafted token at this depth of the tree (1: the first drafted token)");
    for (int d = 0; d < METRICS_SPEC_POSITIONS; d++)
        fprintf(f, "aerie_spec_accepted_at_position_total{position=\"%d\"} %llu\n", d + 1,
                (unsigned long long)m->spec_accepted_at[d]);
    head(f, "aerie_gateway_requests_inflight", "gauge", "generation requests the gateway is serving now");
    fprintf(f, "aerie_gateway_requests_inflight %d\n", g->inflight);
    head(f, "aerie_http_connections", "gauge", "open HTTP connections");
    fprintf(f, "aerie_http_connections %d\n", g->connections);
    target_gauge(f, g, "aerie_target_healthy", "1 when the target passed its last health check", 0);
    target_gauge(f, g, "aerie_requests_running", "requests in the target's batch", 1);
    target_gauge(f, g, "aerie_requests_waiting", "requests queued at the target", 2);
    target_gauge(f, g, "aerie_target_requests_inflight", "this gateway's requests on the target", 3);
    target_gauge(f, g, "aerie_kv_blocks_used", "KV cache blocks in use at the target", 4);
    target_gauge(f, g, "aerie_kv_blocks", "KV cache blocks the target has", 5);
    target_gauge(f, g, "aerie_kv_cache_usage_ratio", "share of the target's KV cache in use", 6);
    target_series(f, g, "aerie_grammar_masks_total", "counter",
                  "structured output: token masks the target computed (as of its last health check)", 7);
    target_series(f, g, "aerie_grammar_mask_seconds_total", "counter",
                  "structured output: time the target spent computing token masks", 8);
    target_gauge(f, g, "aerie_target_tp_ranks", "tensor-parallel ranks of the target (1: none)", 9);
    target_gauge(f, g, "aerie_allreduces_per_step",
                 "allreduces in the target's last forward pass (2 per layer at 2 or more ranks)", 10);
    target_series(f, g, "aerie_allreduces_total", "counter", "allreduces the target's ranks made", 11);
    target_series(f, g, "aerie_allreduce_seconds_total", "counter",
                  "time rank 0 spent in allreduces, waiting for the other ranks included", 12);
    /* A failed allocation inside the stream shows at the close. */
    if (fclose(f) != 0) {
        free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}
