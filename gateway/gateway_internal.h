/* The gateway's insides, shared by gateway.c (routes, tokenizing workers,
 * life cycle) and generate.c (the generation routes). gateway.h is the
 * interface; nothing outside gateway/ includes this. */
#ifndef AERIE_GATEWAY_GATEWAY_INTERNAL_H
#define AERIE_GATEWAY_GATEWAY_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include <event2/event.h>

#include "gateway.h"
#include "http.h"
#include "jbuf.h"
#include "metrics.h"
#include "oai.h"

typedef struct gateway_job gateway_job;

/* A request body to parse and render, tokenize or detokenize on a worker
 * (what is linear in the body's size, off the loop). The loop
 * thread fills the input, hands it over (gateway_job_submit) and touches nothing
 * of it (nor *o) until done runs, on the loop thread again. */
typedef enum gateway_job_what { TJOB_GENERATE, TJOB_TOKENIZE, TJOB_DETOKENIZE } gateway_job_what;

struct gateway_job {
    gateway_job *next;
    const char *body; /* [len]: the HTTP request's, alive until it is answered */
    size_t len;
    gateway_job_what what;
    oai_kind kind; /* TJOB_GENERATE: of this kind */
    void (*done)(gateway_job *j);
    /* the result */
    int rc; /* AE_ERR: e says why */
    oai_error e;
    oai_request *o; /* the parsed request; owned by whoever embeds the job */
    bool add_gen;   /* the generation prompt is rendered */
    int32_t *ids;   /* [n], malloc'd; the done callback takes it */
    int32_t n;
    jbuf reply; /* TJOB_TOKENIZE: the ids' JSON list; TJOB_DETOKENIZE: the whole body */
};

struct gateway {
    gateway_config cfg;
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
     * wakes the loop for it (libevent is set up for threads by rpc_loop.c). */
    pthread_t workers[GATEWAY_TOK_WORKERS];
    int n_workers;
    pthread_mutex_t tmu;
    pthread_cond_t tcv;
    gateway_job *todo, *todo_last, *finished;
    bool stopping; /* the workers exit */
    struct event *finished_ev;
    int jobs; /* submitted and not yet done: for the load line */
};

/* ---- gateway.c ---- */

/* Answers h with body[0..len) as JSON, counted under route (METRICS_ROUTES:
 * not counted); extra: more header lines, or NULL. */
void gateway_reply_json(gateway *g, http_req *h, metrics_route route, int status, const char *body, size_t len,
                        const char *extra);
/* Answers h with e as an OpenAI error object (and Retry-After or
 * WWW-Authenticate where e's status calls for one). */
void gateway_reply_error(gateway *g, http_req *h, metrics_route route, const oai_error *e);
/* A reply built in b, or the 503 its allocation failure calls for. */
void gateway_reply_jbuf(gateway *g, http_req *h, metrics_route route, jbuf *b);
/* model is the one this gateway serves; else e is the 404. */
int gateway_check_model(const gateway *g, const char *model, oai_error *e);
/* The context the targets have (0 when none has reported yet). */
int32_t gateway_context_len(gateway *g);
/* No target has reported its context: e is the 503. */
int gateway_no_target(gateway *g, oai_error *e);
/* Hands j (its body h's) to a tokenizing worker; done runs on the loop
 * thread once it is finished. */
void gateway_job_submit(gateway *g, gateway_job *j, http_req *h, gateway_job_what what, oai_kind kind, oai_request *o,
                        void (*done)(gateway_job *j));

#endif
