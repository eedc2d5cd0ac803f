/* The gateway's figures in Prometheus' text format (version 0.0.4).
 *
 * Counters and histograms are kept here, on the gateway's one thread (no
 * locks); gauges that describe the targets (running and waiting requests,
 * KV use) come from their Info replies and are passed in when rendering.
 * Speculation counters add up the figures each request's last
 * GenerateEvent carries, so they cover every request the gateway served,
 * whichever replica served it. */
#ifndef AERIE_GATEWAY_METRICS_H
#define AERIE_GATEWAY_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define METRICS_MAX_BUCKETS 24
#define METRICS_SPEC_POSITIONS 16 /* accepted-at-depth counters kept */
#define METRICS_MAX_CODES 64      /* distinct (route, status) pairs: the gateway answers far fewer */

typedef struct metrics_hist {
    const double *le; /* upper bounds, increasing; +Inf is implied */
    int n;
    uint64_t counts[METRICS_MAX_BUCKETS + 1]; /* per bucket, not cumulative; [n] is +Inf */
    uint64_t count;
    double sum;
} metrics_hist;

void metrics_hist_init(metrics_hist *h, const double *le, int n);
void metrics_hist_observe(metrics_hist *h, double v);

typedef enum metrics_route {
    METRICS_CHAT,
    METRICS_COMPLETIONS,
    METRICS_TOKENIZE,
    METRICS_DETOKENIZE,
    METRICS_ROUTES
} metrics_route;

typedef struct metrics_finish {
    uint64_t stop, length, cancelled, error;
} metrics_finish;

typedef struct metrics {
    struct {
        metrics_route route;
        int status;
        uint64_t n;
    } requests[METRICS_MAX_CODES];
    int n_requests;
    uint64_t prompt_tokens, generation_tokens;
    metrics_finish finish;
    metrics_hist ttft, itl, e2e;               /* seconds */
    metrics_hist prompt_hist, generation_hist; /* tokens per request */
    uint64_t spec_steps, spec_plain_steps, spec_drafted, spec_accepted;
    uint64_t spec_accepted_at[METRICS_SPEC_POSITIONS]; /* [d]: steps that accepted a token at depth d + 1 */
    uint64_t retries;                                  /* requests moved to another replica after a failure */
    uint64_t constrained;                              /* requests with a response_format (json_object, json_schema) */
} metrics;

void metrics_init(metrics *m);
void metrics_request(metrics *m, metrics_route route, int status);

/* One target replica as its latest Info reported it. */
typedef struct metrics_target {
    const char *addr;
    bool healthy;
    int inflight; /* this gateway's requests on it now */
    int running, waiting, kv_blocks_used, kv_blocks;
    double grammar_masks, grammar_mask_seconds; /* structured output's masks at the target, since it started */
    /* tensor parallelism: ranks, the allreduces of its last forward pass,
     * and all of them since it started, with their time */
    double tp, allreduces_per_step, allreduces_total, allreduce_seconds;
} metrics_target;

typedef struct metrics_gauges {
    const metrics_target *targets;
    int n_targets;
    int inflight;    /* the gateway's requests in flight */
    int connections; /* open HTTP connections */
} metrics_gauges;

/* The exposition text, malloc'd and NUL-terminated; *len its length. */
char *metrics_render(const metrics *m, const metrics_gauges *g, size_t *len); /* NULL: out of memory */

#endif
