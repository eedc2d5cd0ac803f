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

#define MET_MAX_BUCKETS 24
#define MET_SPEC_POSITIONS 16 /* accepted-at-depth counters kept */
#define MET_MAX_CODES 64      /* distinct (route, status) pairs: the gateway answers far fewer */

typedef struct met_hist {
    const double *le; /* upper bounds, increasing; +Inf is implied */
    int n;
    uint64_t counts[MET_MAX_BUCKETS + 1]; /* per bucket, not cumulative; [n] is +Inf */
    uint64_t count;
    double sum;
} met_hist;

void met_hist_init(met_hist *h, const double *le, int n);
void met_hist_observe(met_hist *h, double v);

typedef enum met_route { MET_CHAT, MET_COMPLETIONS, MET_TOKENIZE, MET_DETOKENIZE, MET_ROUTES } met_route;

typedef struct met_finish {
    uint64_t stop, length, cancelled, error;
} met_finish;

typedef struct metrics {
    struct {
        met_route route;
        int status;
        uint64_t n;
    } requests[MET_MAX_CODES];
    int n_requests;
    uint64_t prompt_tokens, generation_tokens;
    met_finish finish;
    met_hist ttft, itl, e2e;                 /* seconds */
    met_hist prompt_hist, generation_hist;   /* tokens per request */
    uint64_t spec_steps, spec_plain_steps, spec_drafted, spec_accepted;
    uint64_t spec_accepted_at[MET_SPEC_POSITIONS]; /* [d]: steps that accepted a token at depth d + 1 */
    uint64_t retries;                              /* requests moved to another replica after a failure */
    uint64_t constrained;                          /* requests with a response_format (json_object, json_schema) */
} metrics;

void met_init(metrics *m);
void met_request(metrics *m, met_route route, int status);

/* One target replica as its latest Info reported it. */
typedef struct met_target {
    const char *addr;
    bool healthy;
    int inflight; /* this gateway's requests on it now */
    int running, waiting, kv_blocks_used, kv_blocks;
    double grammar_masks, grammar_mask_seconds; /* structured output's masks at the target, since it started */
    /* tensor parallelism: ranks, the allreduces of its last forward pass,
     * and all of them since it started, with their time */
    double tp, allreduces_per_step, allreduces_total, allreduce_seconds;
} met_target;

typedef struct met_gauges {
    const met_target *targets;
    int n_targets;
    int inflight;    /* the gateway's requests in flight */
    int connections; /* open HTTP connections */
} met_gauges;

/* The exposition text, malloc'd and NUL-terminated; *len its length. */
char *met_render(const metrics *m, const met_gauges *g, size_t *len); /* NULL: out of memory */

#endif
