/* The target's continuous-batching scheduler.
 *
 * Requests wait in a bounded FIFO queue; beyond it they are refused
 * (RESOURCE_EXHAUSTED). One thread runs the loop:
 *
 *   1. requests cancelled (by id, by the caller, or because the client
 *      went away) end with FINISH_CANCELLED and give their KV back;
 *   2. waiting requests are admitted in order while batch slots for all
 *      their choices are free and the KV plan can hold them: each
 *      admitted request reserves the blocks of its worst case (prompt +
 *      max_tokens + one tree per choice, the prompt's full blocks once),
 *      so a running sequence never runs out of KV;
 *   3. one chunk of one prompt is prefilled (long prompts take several
 *      turns, so running streams are never stalled for a whole prompt);
 *      once a prompt is in, its other choices fork from it;
 *   4. one speculative step (spec.h) advances every running sequence at
 *      once, and each gets an event with its new tokens.
 *
 * Steps 2 to 4 are planned by sched_plan_turn (below), a pure function
 * of the queue and the running requests, then run and applied. New
 * requests join between steps. The scheduler never touches sockets:
 * events go to a sink (the server), which also says whether a caller has
 * gone. Every few seconds it logs one line: tok/s, batch, KV use, queue,
 * acceptance length, whether speculation is on, and the policy's tree and
 * the figures behind it (policy.h). */
#ifndef AERIE_TARGET_SCHED_H
#define AERIE_TARGET_SCHED_H

#include <stdbool.h>
#include <stdint.h>

#include "gcompile.h"
#include "spec.h"

#define SCHED_MAX_STOP 16
#define SCHED_ID_MAX 65
#define SCHED_MAX_N 16 /* choices of one request (OpenAI's n) */

typedef enum sched_finish {
    SCHED_RUNNING = 0,
    SCHED_STOP = 1,   /* end of sequence or a stop token */
    SCHED_LENGTH = 2, /* max_tokens */
    SCHED_CANCELLED = 3,
    SCHED_ERROR = 4,   /* the engine failed; error says why */
    SCHED_REFUSED = 5, /* the request cannot be served (a schema that does not compile, or passed a compile or
                        * mask budget); error says why */
} sched_finish;

typedef struct sched_request {
    const int32_t *prompt; /* [n_prompt], copied at submit */
    int32_t n_prompt;
    int32_t max_tokens; /* per choice */
    /* Choices of the prompt (1..SCHED_MAX_N): the prompt is prefilled once
     * and forked; choice c draws with the key (seed, c) (sample.h). */
    int32_t n;
    sample_params params;
    uint64_t seed;
    bool ignore_eos;
    int32_t stop[SCHED_MAX_STOP];
    int32_t n_stop;
    /* Of the prompt, the last n_generated tokens are output already (a
     * gateway resending a stream after a failover): penalties and
     * min_tokens count them as generated. */
    int32_t n_generated;
    penalty_params pen; /* its stop ids are filled in at submit */
    /* Structured output: 0 none, 1 any JSON object, 2 the JSON Schema
     * schema[0..schema_len) (grammar.h); copied at submit. */
    int32_t format;
    const char *schema;
    size_t schema_len;
    bool logprobs;         /* each token's log-probability (spec.h) */
    int32_t top_logprobs;  /* and this many most likely tokens */
    char id[SCHED_ID_MAX]; /* for sched_cancel_id; may be empty */
    void *ctx;             /* the sink's handle for the request */
} sched_request;

typedef struct sched_event {
    const int32_t *tokens; /* new tokens (stop tokens are not sent) */
    int32_t n;
    /* With the request's logprobs: token i's, and n_top most likely
     * tokens at its position; else NULL. */
    const float *logprob;
    int32_t n_top;
    const sample_logprob (*top)[SAMPLE_MAX_TOP_LOGPROBS];
    int32_t index;       /* the choice */
    sched_finish finish; /* set on the choice's last event */
    bool last;           /* the request's last event (every choice done) */
    int32_t prompt_tokens, completion_tokens;
    const spec_stats *spec; /* the sequence's figures */
    const char *error;      /* with SCHED_ERROR and SCHED_REFUSED */
} sched_event;

typedef struct sched_sink {
    void *ctx;
    /* Called on the scheduler thread; the event with last set is the
     * request's last, after which req_ctx is not used again. A request
     * that ends early (cancelled, an error) gets one last event, of
     * choice 0, whatever its choices were doing. */
    void (*emit)(void *ctx, void *req_ctx, const sched_event *ev);
    /* True when the caller is gone or gave up. */
    bool (*cancelled)(void *ctx, void *req_ctx);
} sched_sink;

typedef struct sched_config {
    int32_t max_batch;       /* sequences running at once (the engine's max_seqs) */
    int32_t max_queue;       /* requests waiting at most */
    int32_t chunk;           /* prompt tokens per prefill pass */
    int32_t max_seq_len;     /* the engine's */
    int32_t tree_tokens;     /* the largest tree a step verifies (KV scratch) */
    int32_t eos;             /* end of sequence, -1: none */
    int32_t log_interval_ms; /* 0: no periodic line */
    bool speculating;        /* a drafter is configured (for the log line) */
    grammar_vocab *grammar;  /* structured output's automaton; NULL: refused */
    /* Requests with a response format: compile workers (each compile on a
     * thread of its own, gcompile.h; 0: 1), and requests queued for or in
     * a compile, or compiled and waiting for a slot, at most (0: 1; apart
     * from max_queue, so neither kind can refuse the other). */
    int32_t compile_workers;
    int32_t max_compiles;
    gcompile_limits compile;
    /* A request's grammar masks may take mask_budget_ms up front, then
     * mask_ms_per_token for each mask, over all its choices (0: no
     * budget); past that it ends, refused. */
    int64_t mask_budget_ms;
    double mask_ms_per_token;
} sched_config;

typedef struct sched_stats {
    int32_t running, prefilling, waiting;
    int32_t compiling; /* requests queued for or in a schema compile */
    /* Compiles by result, indexed by gcompile_compile's code (0 ok, 1 our error,
     * GRAMMAR_REFUSED, GCOMPILE_TIMEOUT, GCOMPILE_CANCELLED);
     * requests dropped from the compile queue before theirs ran; requests
     * ended for spending their mask budget. */
    uint64_t compiles[GCOMPILE_LAST + 1];
    uint64_t compiles_dropped;
    uint64_t mask_budget_spent;
    int32_t kv_blocks_used, kv_blocks, kv_blocks_reserved;
    uint64_t requests_done, requests_cancelled, requests_refused;
    uint64_t requests_constrained;           /* admitted with a response format */
    uint64_t grammar_masks, grammar_mask_ns; /* masks computed, and their time (grammar.h) */
    uint64_t tokens_out;
    double tok_per_s;       /* over the last log interval */
    double accept_len;      /* mean over the last log interval's speculative steps; 0: none */
    bool spec_on;           /* the last interval had speculative steps */
    spec_stats spec;        /* speculation's totals */
    policy_report policy;   /* the policy's choice for the last step's batch */
    int32_t tp;             /* tensor-parallel ranks of the engine (engine_tp) */
    engine_comm_stats comm; /* their allreduces: the last step's and all so far (engine_get_comm_stats) */
} sched_stats;

typedef struct sched sched;

/* sx and e must outlive the scheduler; sx is used only by its thread. */
int sched_init(sched **out, spec *sx, engine *e, const sched_config *cfg, const sched_sink *sink, ae_error *err);
/* Ends every request (CANCELLED), stops the thread, frees. */
void sched_free(sched *s); /* NULL is a no-op */

/* Why sched_submit refused a request; the server maps each to its wire
 * status (target/target_server.c). */
typedef enum sched_refusal {
    SCHED_QUEUED = 0,
    SCHED_INVALID = 1,  /* it can never run here: too long, bad parameters */
    SCHED_BUSY = 2,     /* the queue is full, or out of memory: retry later */
    SCHED_DRAINING = 3, /* the target is shutting down */
} sched_refusal;

/* Queues a request, or says why not (err: the words for the client). */
sched_refusal sched_submit(sched *s, const sched_request *r, ae_error *err);

/* Cancels the request with this id; false when none is waiting or running. */
bool sched_cancel_id(sched *s, const char *id);

/* Refuses new requests from now on and waits up to timeout_ms for the
 * admitted ones to finish; what is left is cancelled. */
void sched_drain(sched *s, int64_t timeout_ms);

sched_stats sched_get_stats(sched *s);

/* One turn of the scheduler's loop is planned, run and applied:
 *
 *   plan    sched_plan below: which waiting requests are admitted, which
 *           prompt gets a prefill chunk and how long it is, which choices
 *           decode; from a snapshot of the queue and the running requests;
 *   execute the prefill chunk (its own engine pass, spec_seq_prefill, and
 *           the forks once the prompt is in), then one spec_step over the
 *           decode batch;
 *   apply   tokens to each choice, events to the sink, finished and failed
 *           requests retired, the figures updated.
 *
 * The plan is the policy; it is pure, so it is tested without an engine. */

/* A request as the plan sees it. */
typedef struct sched_plan_req {
    int32_t n;         /* choices, 1..SCHED_MAX_N */
    int32_t n_prompt;  /* prompt tokens */
    int32_t prefilled; /* of them in the KV; the last is never (it is the first decode step's root) */
    int32_t blocks;    /* KV blocks it reserves while admitted: its worst case */
    bool running;      /* its prompt is in and its choices decode; else it prefills */
    uint32_t done;     /* bit c: choice c has ended (running requests) */
} sched_plan_req;

typedef struct sched_plan_state {
    const sched_plan_req *active; /* [n_active], admitted, oldest first */
    int32_t n_active;
    /* [n_waiting]: the waiting queue from its head, in order. No more than
     * max_batch - seqs of it can be admitted, so its first max_batch
     * requests (or all) are enough. */
    const sched_plan_req *waiting;
    int32_t n_waiting;
    int32_t max_batch;        /* sequences at once (sched_config) */
    int32_t seqs;             /* sequences the active requests hold: the sum of their n */
    int32_t blocks_free;      /* KV blocks no admitted request has reserved */
    int32_t chunk;            /* prompt tokens per prefill pass (sched_config) */
    int32_t max_batch_tokens; /* tokens in one forward pass (the engine's) */
    int32_t tree_tokens;      /* the largest tree a decode step verifies (sched_config) */
    bool speculating;         /* a drafter is configured (sched_config) */
} sched_plan_state;

typedef enum sched_plan_kind {
    SCHED_PLAN_PREFILL = 0,   /* a chunk of a prompt, in an engine pass of its own */
    SCHED_PLAN_DECODE = 1,    /* the choice's root verified alone: one token */
    SCHED_PLAN_SPECULATE = 2, /* the root and a drafted tree under it, as the policy sizes it (spec.h) */
} sched_plan_kind;

/* One sequence's part of the turn. */
typedef struct sched_plan_seq {
    sched_plan_kind kind;
    /* The request: active[req], or for req >= n_active the waiting request
     * waiting[req - n_active], admitted this turn. */
    int32_t req;
    int32_t choice;
    /* PREFILL: the chunk's prompt tokens, [from, from + tokens) (0 for a
     * one-token prompt, which has nothing to prefill); DECODE: 1;
     * SPECULATE: at most this many (root and drafted nodes), each other
     * sequence of the pass keeping its root. */
    int32_t from, tokens;
} sched_plan_seq;

typedef struct sched_plan {
    /* Admission: waiting[0..n_admit), in order, join the active requests
     * after the last one; then seqs sequences are held and blocks_free KV
     * blocks left unreserved. */
    int32_t n_admit;
    int32_t seqs, blocks_free;
    /* The prefill: the oldest request (admitted this turn or before) whose
     * prompt is not in; has_prefill false: none. prompt_in: this chunk
     * completes the prompt, so choices 1..n-1 fork from choice 0 and the
     * request decodes from the next turn on. */
    bool has_prefill, prompt_in;
    sched_plan_seq prefill;
    /* The decode batch: every choice not done of every running request,
     * oldest request first, choices in order; [n_decode] in the caller's
     * array of max_batch entries. A request that starts running this turn
     * decodes from the next. */
    sched_plan_seq *decode;
    int32_t n_decode;
} sched_plan;

/* Plans one turn from st, into *p; the caller points p->decode at
 * st->max_batch entries first (every other field is written). Pure: it
 * reads st and writes p, nothing else, with no engine, lock, allocation or
 * I/O, and the same st gives the same plan.
 *
 * Admission is first come, first served: the queue's head is admitted
 * while its choices fit in max_batch sequences and its blocks in
 * blocks_free; the first that does not fit stops admission, so a large
 * request is not passed over by smaller ones behind it. Prefill takes one
 * chunk of min(chunk, max_batch_tokens) tokens (chunk < 1: max_batch_tokens)
 * of the oldest prompt, so running streams never wait a whole prompt.
 * Decode entries are SCHED_PLAN_SPECULATE when speculating with trees of
 * more than one token, else SCHED_PLAN_DECODE; more than max_batch
 * of them (an st whose seqs undercounts) are cut at max_batch. */
void sched_plan_turn(const sched_plan_state *st, sched_plan *p);

#endif
