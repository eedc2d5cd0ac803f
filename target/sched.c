#include "sched.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../services/core/clock.h"
#include "../services/core/log.h"
#include "../services/core/watchdog.h"
#include "gcompile.h"

typedef enum req_state { REQ_WAITING, REQ_PREFILL, REQ_RUNNING } req_state;

/* One of a request's n choices: its own sequence, random key and
 * penalties. Choice 0 prefills; the others fork from it once the prompt
 * is in (engine_seq_fork, spec_seq_fork). */
typedef struct choice {
    int32_t seq; /* engine sequence, -1 before it has one or once done */
    sample_rng rng;
    penalty *pen;        /* penalties and biases, made at admission; NULL: none */
    grammar_matcher *gm; /* structured output, made at admission; NULL: none */
    int32_t emitted;
    bool done;
} choice;

typedef struct req {
    sched_request r;
    int32_t *prompt; /* [n_prompt], owned */
    char *schema;    /* owned, NUL-terminated; NULL: none */
    grammar *g;      /* its compiled grammar (the compiling thread's), NULL: none */
    int compile_rc;  /* AE_OK, or why the schema did not compile (compile_err; gcompile.h) */
    char compile_err[AE_ERR_MAX];
    bool schema_wait; /* compiled, waiting for admission: counted in n_waiting_c */
    bool mask_over;   /* its masks passed their budget (why in compile_err) */
    req_state state;
    int32_t prefilled; /* prompt tokens in the KV */
    int32_t reserve;   /* KV blocks reserved */
    int32_t n_done;    /* choices finished */
    atomic_bool cancel;
    choice ch[SCHED_MAX_N];
    struct req *next;
} req;

struct sched {
    spec *sx;
    engine *e;
    sched_config cfg;
    sched_sink sink;
    int32_t block_size, n_blocks;
    int32_t vocab;
    int32_t batch_tokens; /* the engine's max_batch_tokens */
    pthread_t thread;
    pthread_mutex_t mu; /* the lists, counters and flags below */
    pthread_cond_t cv;  /* work arrived, or a request ended */
    req *waiting, *waiting_tail, *active;
    /* Requests with a response format wait here first, in their own
     * queue with its own limit (cfg.max_compiles): compile workers take
     * them in order, each compile on a thread of its own with a time
     * budget (gcompile.h), then queue them for admission. A cancelled
     * request leaves the queue, and its running compile is given up on. */
    req *compiling, *compiling_tail;
    req **compiling_now; /* [n_compilers]: the request each worker compiles, or NULL */
    pthread_t *compilers;
    int32_t n_compilers;
    atomic_bool compile_stop; /* workers end; running compiles are given up on */
    pthread_cond_t ccv;       /* a schema to compile, or stop */
    int32_t n_compiling;      /* requests queued for or in a compile */
    int32_t n_waiting_c;      /* of n_waiting, requests with a schema (compiled) */
    int32_t n_waiting, n_active, reserved;
    int32_t n_seqs; /* the active requests' choices: sequences held */
    bool draining, stopping;
    sched_stats stats;
    /* the loop's own */
    spec_in *in;       /* [max_batch] */
    spec_out *out;     /* [max_batch] */
    req **step_reqs;   /* [max_batch] */
    int32_t *step_ch;  /* [max_batch]: the choice of step_reqs[i] */
    bool *step_failed; /* [max_batch] */
    /* A turn's plan (sched_plan_turn): the snapshot it is made from, the
     * active requests then the waiting queue's head, and their reqs, in
     * the plan's index order; and its decode batch. */
    sched_plan_req *plan_reqs;   /* [2 * max_batch] */
    req **plan_of;               /* [2 * max_batch] */
    sched_plan_seq *plan_decode; /* [max_batch] */
    int32_t *emit_buf;           /* [ENGINE_MAX_TREE + 1] */
    int64_t log_at_ns, log_tokens;
    spec_stats log_spec;
    bool logged_idle;
};

/* One choice's worst case, and the choices after the first, which share
 * the prompt's full blocks (kv_seq_fork). */
static int32_t blocks_for(const sched *s, const req *q) {
    int64_t slots = (int64_t)q->r.n_prompt + q->r.max_tokens + s->cfg.tree_tokens;
    int64_t one = (slots + s->block_size - 1) / s->block_size, shared = (q->r.n_prompt - 1) / s->block_size;
    int64_t all = one + (int64_t)(q->r.n - 1) * (one - shared);
    return all > INT32_MAX ? INT32_MAX : (int32_t)all;
}

static void req_free(req *q) {
    if (!q) return;
    for (int32_t c = 0; c < q->r.n; c++) {
        penalty_free(q->ch[c].pen);
        grammar_matcher_free(q->ch[c].gm);
    }
    free(q->schema);
    grammar_free(q->g);
    free(q->prompt);
    free(q);
}

sched_refusal sched_submit(sched *s, const sched_request *r, ae_error *err) {
    if (r->n_prompt < 1) return err_set(err, "the prompt has no tokens"), SCHED_INVALID;
    if (r->max_tokens < 1) return err_set(err, "max_tokens must be at least 1"), SCHED_INVALID;
    if ((int64_t)r->n_prompt + r->max_tokens > s->cfg.max_seq_len)
        return err_set(err, "prompt (%d tokens) + max_tokens (%d) is more than max-seq-len %d", r->n_prompt,
                       r->max_tokens, s->cfg.max_seq_len),
               SCHED_INVALID;
    const sample_params *p = &r->params;
    if (!isfinite(p->temperature) || p->temperature < 0 || !isfinite(p->top_p) || p->top_p <= 0 || p->top_p > 1 ||
        !isfinite(p->min_p) || p->min_p < 0 || p->min_p > 1 || p->top_k < 0)
        return err_set(err, "sampling parameters out of range (temperature >= 0, 0 < top_p <= 1, 0 <= min_p <= 1, "
                            "top_k >= 0)"),
               SCHED_INVALID;
    if (r->n_generated < 0 || r->n_generated >= r->n_prompt)
        return err_set(err, "%d of the %d prompt tokens are said to be generated", r->n_generated, r->n_prompt),
               SCHED_INVALID;
    if (r->top_logprobs < 0 || r->top_logprobs > SAMPLE_MAX_TOP_LOGPROBS)
        return err_set(err, "top_logprobs is %d (0..%d)", r->top_logprobs, SAMPLE_MAX_TOP_LOGPROBS), SCHED_INVALID;
    if (r->n < 1 || r->n > SCHED_MAX_N) return err_set(err, "n is %d (1..%d)", r->n, SCHED_MAX_N), SCHED_INVALID;
    if (r->n > s->cfg.max_batch)
        return err_set(err, "n of %d needs %d sequences at once; this target runs at most %d", r->n, r->n,
                       s->cfg.max_batch),
               SCHED_INVALID;
    if (r->n_stop < 0 || r->n_stop > SCHED_MAX_STOP)
        return err_set(err, "%d stop tokens (at most %d)", r->n_stop, SCHED_MAX_STOP), SCHED_INVALID;
    /* min_tokens holds back the end of sequence and the stop ids. */
    penalty_params pen = r->pen;
    pen.n_stop = 0;
    if (s->cfg.eos >= 0 && !r->ignore_eos) pen.stop[pen.n_stop++] = s->cfg.eos;
    for (int32_t i = 0; i < r->n_stop; i++) pen.stop[pen.n_stop++] = r->stop[i];
    if (penalty_check(&pen, s->vocab, err) != AE_OK) return SCHED_INVALID;
    if (r->format < 0 || r->format > 2 || (r->format == 2) != (r->schema != NULL))
        return err_set(err, "response format %d%s", r->format, r->schema ? " with a schema" : " without a schema"),
               SCHED_INVALID;
    if (r->format && !s->cfg.grammar)
        return err_set(err, "structured output needs the model's tokenizer, which this target could not load"),
               SCHED_INVALID;
    req *q = calloc(1, sizeof *q);
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)r->n_prompt);
    if (!q || !prompt) {
        free(q), free(prompt);
        return err_set(err, "out of memory"), SCHED_BUSY;
    }
    memcpy(prompt, r->prompt, sizeof(int32_t) * (size_t)r->n_prompt);
    if (r->schema && !(q->schema = strndup(r->schema, r->schema_len))) {
        free(q), free(prompt);
        return err_set(err, "out of memory"), SCHED_BUSY;
    }
    q->r = *r;
    q->r.pen = pen;
    q->r.prompt = q->prompt = prompt;
    q->r.schema = q->schema;
    for (int32_t c = 0; c < r->n; c++) {
        q->ch[c].seq = -1;
        q->ch[c].rng = (sample_rng){.seed = r->seed, .choice = (uint32_t)c};
    }
    int32_t need = blocks_for(s, q);
    if (need > s->n_blocks) {
        req_free(q);
        return err_set(err, "the request needs %d KV blocks, the whole cache has %d", need, s->n_blocks), SCHED_INVALID;
    }
    pthread_mutex_lock(&s->mu);
    sched_refusal st = SCHED_QUEUED;
    if (s->draining || s->stopping) {
        st = SCHED_DRAINING;
        err_set(err, "the target is shutting down");
    } else if (r->format && s->n_compiling + s->n_waiting_c >= s->cfg.max_compiles) {
        /* Requests with a schema have their own limit: no number of them
         * can refuse a plain request, nor plain ones them. */
        st = SCHED_BUSY;
        err_set(err,
                "%d requests with a response format are compiling or waiting (the target's --max-compiles); "
                "retry later",
                s->n_compiling + s->n_waiting_c);
    } else if (!r->format && s->n_waiting - s->n_waiting_c >= s->cfg.max_queue) {
        st = SCHED_BUSY;
        err_set(err, "%d requests are waiting (the queue's limit); retry later", s->n_waiting - s->n_waiting_c);
    }
    if (st != SCHED_QUEUED) {
        s->stats.requests_refused++;
        pthread_mutex_unlock(&s->mu);
        req_free(q);
        return st;
    }
    if (r->format) {
        s->stats.requests_constrained++;
        s->n_compiling++;
        if (s->compiling_tail)
            s->compiling_tail->next = q;
        else
            s->compiling = q;
        s->compiling_tail = q;
        pthread_cond_broadcast(&s->ccv);
    } else {
        s->n_waiting++;
        if (s->waiting_tail)
            s->waiting_tail->next = q;
        else
            s->waiting = q;
        s->waiting_tail = q;
    }
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return SCHED_QUEUED;
}

bool sched_cancel_id(sched *s, const char *id) {
    if (!id || !*id) return false;
    bool found = false;
    pthread_mutex_lock(&s->mu);
    req *lists[3] = {s->waiting, s->active, s->compiling};
    for (int l = 0; l < 3; l++)
        for (req *q = lists[l]; q; q = q->next)
            if (!strcmp(q->r.id, id)) {
                atomic_store(&q->cancel, true);
                found = true;
            }
    for (int32_t k = 0; k < s->n_compilers; k++)
        if (s->compiling_now[k] && !strcmp(s->compiling_now[k]->r.id, id)) {
            atomic_store(&s->compiling_now[k]->cancel, true);
            found = true;
        }
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return found;
}

/* An event of choice c; last: the request's last. */
static void emit(sched *s, req *q, int32_t c, const int32_t *tokens, int32_t n, const spec_out *o, sched_finish finish,
                 bool last, const char *error) {
    static const spec_stats none;
    bool lp = o && q->r.logprobs;
    const choice *ch = &q->ch[c];
    sched_event ev = {tokens,
                      n,
                      lp ? o->logprob : NULL,
                      lp ? o->n_top : 0,
                      lp ? o->top : NULL,
                      c,
                      finish,
                      last,
                      q->r.n_prompt,
                      ch->emitted,
                      ch->seq >= 0 ? spec_seq_stats(s->sx, ch->seq) : &none,
                      error};
    s->sink.emit(s->sink.ctx, q->r.ctx, &ev);
}

static void end_choice(sched *s, choice *ch) {
    if (ch->seq >= 0) {
        spec_seq_end(s->sx, ch->seq);
        engine_seq_free(s->e, ch->seq);
    }
}

/* Ends an admitted request: its KV and draft state go first (so that a
 * caller who asks right after its last event sees them free), then its
 * last event. */
static void finish_active(sched *s, req *q, int32_t c, const int32_t *tokens, int32_t n, const spec_out *o,
                          sched_finish finish, const char *error) {
    for (int32_t k = 0; k < q->r.n; k++)
        if (!q->ch[k].done) end_choice(s, &q->ch[k]);
    kv_stats kv = engine_kv_stats(s->e);
    pthread_mutex_lock(&s->mu);
    s->stats.kv_blocks_used = kv.blocks_used;
    for (req **p = &s->active; *p; p = &(*p)->next)
        if (*p == q) {
            *p = q->next;
            break;
        }
    s->n_active--;
    s->n_seqs -= q->r.n;
    s->reserved -= q->reserve;
    s->stats.requests_done++;
    if (finish == SCHED_CANCELLED) s->stats.requests_cancelled++;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    /* The sequence's figures stay readable until its id is reused, which
     * only this thread does. */
    emit(s, q, c, tokens, n, o, finish, true, error);
    req_free(q);
}

/* Unlinks q from the waiting queue (the lock held). */
static void unwait(sched *s, req *q, req *prev) {
    if (prev)
        prev->next = q->next;
    else
        s->waiting = q->next;
    if (s->waiting_tail == q) s->waiting_tail = prev;
    s->n_waiting--;
    if (q->schema_wait) s->n_waiting_c--;
    q->schema_wait = false;
    q->next = NULL;
}

/* Requests queued for a compile whose caller gave up leave that queue
 * (all: every one, the target is stopping or draining): one at a time,
 * ended as cancelled. */
static bool drop_cancelled_compiling(sched *s, bool all) {
    req *gone = NULL;
    pthread_mutex_lock(&s->mu);
    req *prev = NULL;
    for (req *q = s->compiling; q; prev = q, q = q->next)
        if (all || atomic_load(&q->cancel) || s->sink.cancelled(s->sink.ctx, q->r.ctx)) {
            if (prev)
                prev->next = q->next;
            else
                s->compiling = q->next;
            if (s->compiling_tail == q) s->compiling_tail = prev;
            s->n_compiling--;
            s->stats.requests_done++;
            s->stats.requests_cancelled++;
            s->stats.compiles_dropped++;
            gone = q;
            break;
        }
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (!gone) return false;
    emit(s, gone, 0, NULL, 0, NULL, SCHED_CANCELLED, true, NULL);
    req_free(gone);
    return true;
}

/* Waiting requests whose caller gave up leave the queue. */
static void drop_cancelled_waiting(sched *s, bool all) {
    bool all_compiling = all;
    pthread_mutex_lock(&s->mu);
    all_compiling |= s->draining;
    pthread_mutex_unlock(&s->mu);
    while (drop_cancelled_compiling(s, all_compiling)) {
    }
    for (;;) {
        req *gone = NULL;
        pthread_mutex_lock(&s->mu);
        req *prev = NULL;
        for (req *q = s->waiting; q; prev = q, q = q->next)
            if (all || atomic_load(&q->cancel) || s->sink.cancelled(s->sink.ctx, q->r.ctx) || q->compile_rc != AE_OK) {
                unwait(s, q, prev);
                s->stats.requests_done++;
                if (q->compile_rc == AE_OK || q->compile_rc == GCOMPILE_CANCELLED || all)
                    s->stats.requests_cancelled++;
                else
                    s->stats.requests_refused++;
                gone = q;
                break;
            }
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        if (!gone) return;
        /* A schema that did not compile is the client's error (the
         * engine's reason, or a limit it passed), or ours (no fork, out of
         * memory). */
        bool clients = gone->compile_rc == GRAMMAR_REFUSED || gone->compile_rc == GCOMPILE_TIMEOUT;
        if (gone->compile_rc != AE_OK && gone->compile_rc != GCOMPILE_CANCELLED && !all)
            emit(s, gone, 0, NULL, 0, NULL, clients ? SCHED_REFUSED : SCHED_ERROR, true, gone->compile_err);
        else
            emit(s, gone, 0, NULL, 0, NULL, SCHED_CANCELLED, true, NULL);
        req_free(gone);
    }
}

/* Each choice's penalties (penalty.h) and grammar matcher (grammar.h,
 * from the schema the compiling thread compiled), when the request has
 * them. A resent output (n_generated) is taken by the matcher first, so a
 * stream that moved here goes on inside its value. */
static int start_rules(sched *s, req *q, ae_error *err, bool *refused) {
    *refused = false;
    for (int32_t c = 0; c < q->r.n; c++) {
        if (penalty_active(&q->r.pen) && !q->ch[c].pen &&
            penalty_init(&q->ch[c].pen, &q->r.pen, s->vocab, q->prompt, q->r.n_prompt, q->r.n_generated, err) != AE_OK)
            return AE_ERR;
        if (!q->r.format || q->ch[c].gm) continue;
        if (grammar_matcher_new(&q->ch[c].gm, s->cfg.grammar, q->g, err) != AE_OK) return AE_ERR;
        for (int32_t i = q->r.n_prompt - q->r.n_generated; i < q->r.n_prompt; i++)
            if (!grammar_accept(q->ch[c].gm, q->prompt[i])) {
                *refused = true;
                return err_set(err, "the output resent after a failover does not fit its schema (token %d of it)",
                               i - (q->r.n_prompt - q->r.n_generated));
            }
    }
    return AE_OK;
}

/* A compile stops when its request is cancelled, its caller leaves, or
 * the scheduler stops or drains (gcompile_compile polls this). */
typedef struct compile_job {
    sched *s;
    req *q;
} compile_job;

static bool compile_cancelled(void *ctx) {
    compile_job *j = ctx;
    return atomic_load(&j->s->compile_stop) || atomic_load(&j->q->cancel) ||
           j->s->sink.cancelled(j->s->sink.ctx, j->q->r.ctx);
}

typedef struct worker_arg {
    sched *s;
    int32_t k;
} worker_arg;

/* A compile worker (see struct sched): the oldest queued schema, then
 * the request joins the waiting queue, compiled or with why not. */
static void *compiler_main(void *arg) {
    worker_arg *wa = arg;
    sched *s = wa->s;
    int32_t k = wa->k;
    free(wa);
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->compiling && !atomic_load(&s->compile_stop)) pthread_cond_wait(&s->ccv, &s->mu);
        if (atomic_load(&s->compile_stop)) break;
        req *q = s->compiling;
        s->compiling = q->next;
        if (!s->compiling) s->compiling_tail = NULL;
        q->next = NULL;
        s->compiling_now[k] = q;
        pthread_mutex_unlock(&s->mu);
        ae_error err = {{0}};
        compile_job job = {s, q};
        /* One cancelled before its turn is not started. */
        bool skip = compile_cancelled(&job);
        q->compile_rc =
            skip ? GCOMPILE_CANCELLED
                 : gcompile_compile(&q->g, s->cfg.grammar, q->schema, &s->cfg.compile, compile_cancelled, &job, &err);
        if (q->compile_rc != AE_OK) snprintf(q->compile_err, sizeof q->compile_err, "%s", err.msg);
        pthread_mutex_lock(&s->mu);
        s->compiling_now[k] = NULL;
        s->n_compiling--;
        if (skip)
            s->stats.compiles_dropped++;
        else
            s->stats.compiles[q->compile_rc >= 0 && q->compile_rc <= GCOMPILE_LAST ? q->compile_rc : 1]++;
        /* Queued in order of compiling (the scheduler drops it if it was
         * cancelled meanwhile, or did not compile). */
        if (q->compile_rc == GCOMPILE_CANCELLED) atomic_store(&q->cancel, true);
        s->n_waiting++;
        s->n_waiting_c++;
        q->schema_wait = true;
        if (s->waiting_tail)
            s->waiting_tail->next = q;
        else
            s->waiting = q;
        s->waiting_tail = q;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

void sched_plan_turn(const sched_plan_state *st, sched_plan *p) {
    /* Admission: the queue's head, in order, while it fits. */
    p->n_admit = 0;
    p->seqs = st->seqs;
    p->blocks_free = st->blocks_free;
    while (p->n_admit < st->n_waiting) {
        const sched_plan_req *q = &st->waiting[p->n_admit];
        if (p->seqs + q->n > st->max_batch || q->blocks > p->blocks_free) break;
        p->seqs += q->n;
        p->blocks_free -= q->blocks;
        p->n_admit++;
    }
    /* One chunk of the oldest prompt not in (requests just admitted come
     * after the active ones, and all of them prefill). */
    p->has_prefill = p->prompt_in = false;
    p->prefill = (sched_plan_seq){SCHED_PLAN_PREFILL, -1, 0, 0, 0};
    int32_t chunk = st->chunk;
    if (st->max_batch_tokens > 0 && (chunk < 1 || chunk > st->max_batch_tokens)) chunk = st->max_batch_tokens;
    for (int32_t i = 0; i < st->n_active + p->n_admit && !p->has_prefill; i++) {
        const sched_plan_req *q = i < st->n_active ? &st->active[i] : &st->waiting[i - st->n_active];
        if (i < st->n_active && q->running) continue;
        int32_t left = q->n_prompt - 1 - q->prefilled;
        int32_t k = left < 0 ? 0 : left < chunk ? left : chunk;
        p->prefill = (sched_plan_seq){SCHED_PLAN_PREFILL, i, 0, q->prefilled, k};
        p->prompt_in = q->prefilled + k >= q->n_prompt - 1;
        p->has_prefill = true;
    }
    /* Every running choice not done, in order. */
    bool trees = st->speculating && st->tree_tokens > 1;
    p->n_decode = 0;
    for (int32_t i = 0; i < st->n_active; i++) {
        const sched_plan_req *q = &st->active[i];
        if (!q->running) continue;
        for (int32_t c = 0; c < q->n && c < 32 && p->n_decode < st->max_batch; c++)
            if (!(q->done >> c & 1u))
                p->decode[p->n_decode++] =
                    (sched_plan_seq){trees ? SCHED_PLAN_SPECULATE : SCHED_PLAN_DECODE, i, c, 0, 1};
    }
    /* A tree within its bound and the pass's, beside every other root. */
    if (trees) {
        int32_t most = st->tree_tokens;
        if (st->max_batch_tokens > 0 && most > st->max_batch_tokens - (p->n_decode - 1))
            most = st->max_batch_tokens - (p->n_decode - 1);
        for (int32_t j = 0; j < p->n_decode; j++) p->decode[j].tokens = most < 1 ? 1 : most;
    }
}

/* The plan's view of the loop's state (the lock held): the active
 * requests, then the waiting queue's head, each with its req in plan_of. */
static void plan_snapshot(sched *s, sched_plan_state *st) {
    int32_t k = 0;
    for (req *q = s->active; q; q = q->next, k++) {
        AE_ASSERT(k < s->cfg.max_batch); /* each holds a sequence at least */
        uint32_t done = 0;
        for (int32_t c = 0; c < q->r.n; c++) done |= q->ch[c].done ? 1u << c : 0;
        s->plan_reqs[k] =
            (sched_plan_req){q->r.n, q->r.n_prompt, q->prefilled, q->reserve, q->state == REQ_RUNNING, done};
        s->plan_of[k] = q;
    }
    int32_t n_active = k;
    for (req *q = s->waiting; q && k < n_active + s->cfg.max_batch; q = q->next, k++) {
        s->plan_reqs[k] = (sched_plan_req){q->r.n, q->r.n_prompt, 0, blocks_for(s, q), false, 0};
        s->plan_of[k] = q;
    }
    *st = (sched_plan_state){.active = s->plan_reqs,
                             .n_active = n_active,
                             .waiting = s->plan_reqs + n_active,
                             .n_waiting = k - n_active,
                             .max_batch = s->cfg.max_batch,
                             .seqs = s->n_seqs,
                             .blocks_free = s->n_blocks - s->reserved,
                             .chunk = s->cfg.chunk,
                             .max_batch_tokens = s->batch_tokens,
                             .tree_tokens = s->cfg.tree_tokens,
                             .speculating = s->cfg.speculating};
}

/* Applies the plan's admission (the lock held): the queue's first n_admit
 * requests join the active ones, in order, with their KV reserved. Only
 * this thread unlinks from the queue, so its head is the snapshot's. */
static void plan_admit(sched *s, const sched_plan_state *st, const sched_plan *p) {
    for (int32_t i = 0; i < p->n_admit; i++) {
        req *q = s->waiting;
        AE_ASSERT(q == s->plan_of[st->n_active + i]);
        unwait(s, q, NULL);
        /* Admission order is kept: prompts are prefilled first come,
         * first served. */
        req **tail = &s->active;
        while (*tail) tail = &(*tail)->next;
        *tail = q;
        s->n_active++;
        s->n_seqs += q->r.n;
        q->reserve = st->waiting[i].blocks;
        s->reserved += q->reserve;
        q->state = REQ_PREFILL;
    }
}

/* Takes a step's tokens for choice c of q: stops at a stop token or
 * max_tokens. */
static void deliver(sched *s, req *q, int32_t c, const spec_out *o) {
    const int32_t *tokens = o->tokens;
    int32_t n = o->n;
    choice *ch = &q->ch[c];
    int32_t k = 0;
    sched_finish fin = SCHED_RUNNING;
    for (int32_t i = 0; i < n && fin == SCHED_RUNNING; i++) {
        int32_t t = tokens[i];
        /* A grammar's value ends at eos, ignore_eos or not. */
        bool stop = t == s->cfg.eos && (!q->r.ignore_eos || ch->gm) && s->cfg.eos >= 0;
        for (int32_t j = 0; j < q->r.n_stop && !stop; j++) stop = t == q->r.stop[j];
        if (stop) {
            fin = SCHED_STOP;
            break;
        }
        s->emit_buf[k++] = t;
        ch->emitted++;
        if (ch->emitted >= q->r.max_tokens) fin = SCHED_LENGTH;
    }
    pthread_mutex_lock(&s->mu);
    s->stats.tokens_out += (uint64_t)k;
    pthread_mutex_unlock(&s->mu);
    if (fin == SCHED_RUNNING) {
        emit(s, q, c, s->emit_buf, k, o, SCHED_RUNNING, false, NULL);
    } else if (q->n_done + 1 == q->r.n) {
        finish_active(s, q, c, s->emit_buf, k, o, fin, NULL);
    } else {
        /* One choice done, others still running: its event (with its
         * speculation figures, read from its sequence), then its sequence
         * goes. */
        emit(s, q, c, s->emit_buf, k, o, fin, false, NULL);
        end_choice(s, ch);
        ch->seq = -1;
        ch->done = true;
        q->n_done++;
    }
}

/* A request whose grammar masks cost more than their budget: up front
 * cfg.mask_budget_ms, then cfg.mask_ms_per_token for each token position
 * (its choices' masks at one position count once: n choices may spend n
 * times as long, as every other stream waits for all of them). A mask is
 * computed on the scheduler thread inside every step, so a schema whose
 * masks are slow slows every stream beside it; past its budget the
 * request ends (SCHED_REFUSED, why in q->compile_err). */
static bool over_mask_budget(const sched *s, req *q) {
    if (!q->r.format || s->cfg.mask_budget_ms <= 0) return false;
    uint64_t ns = 0, masks = 0, most = 0;
    for (int32_t c = 0; c < q->r.n; c++)
        if (q->ch[c].gm) {
            uint64_t m = 0;
            ns += grammar_matcher_mask_ns(q->ch[c].gm, &m);
            masks += m;
            if (m > most) most = m;
        }
    double ms = (double)ns / 1e6, allowed = (double)s->cfg.mask_budget_ms + s->cfg.mask_ms_per_token * (double)most;
    if (ms <= allowed) return false;
    snprintf(
        q->compile_err, sizeof q->compile_err,
        "the response format's token masks took %.0f ms for %llu tokens (%llu positions), past their budget of %lld "
        "ms + %.2f ms a position (the target's --mask-budget-ms and --mask-ms-per-token); make the schema smaller "
        "or simpler",
        ms, (unsigned long long)masks, (unsigned long long)most, (long long)s->cfg.mask_budget_ms,
        s->cfg.mask_ms_per_token);
    q->mask_over = true;
    return true;
}

static void log_line(sched *s, int64_t now) {
    const spec_stats *t = spec_total_stats(s->sx);
    double dt = (double)(now - s->log_at_ns) / 1e9;
    pthread_mutex_lock(&s->mu);
    int64_t toks = (int64_t)s->stats.tokens_out - s->log_tokens;
    int64_t steps = t->steps - s->log_spec.steps, acc = t->accepted - s->log_spec.accepted;
    kv_stats kv = engine_kv_stats(s->e);
    s->stats.tok_per_s = dt > 0 ? (double)toks / dt : 0;
    s->stats.accept_len = steps > 0 ? (double)(acc + steps) / (double)steps : 0;
    s->stats.spec_on = steps > 0;
    bool idle = s->n_active == 0 && s->n_waiting == 0 && toks == 0;
    int32_t running = s->n_active, waiting = s->n_waiting;
    s->log_tokens = (int64_t)s->stats.tokens_out;
    sched_stats st = s->stats;
    pthread_mutex_unlock(&s->mu);
    s->log_spec = *t;
    s->log_at_ns = now;
    if (idle && s->logged_idle) return;
    s->logged_idle = idle;
    /* With a drafter, the policy's choice for the last batch and the
     * figures behind it (policy.h). */
    char pol[768] = "";
    if (s->cfg.speculating) {
        pol[0] = ' ';
        policy_report_log(&st.policy, pol + 1, sizeof pol - 1);
    }
    LOG_INFOF("target_load tok_s=%.1f batch=%d queue=%d kv_used=%d/%d kv_pct=%.1f accept_len=%.2f spec=%s%s",
              st.tok_per_s, running, waiting, kv.blocks_used, kv.n_blocks,
              kv.n_blocks ? 100.0 * kv.blocks_used / kv.n_blocks : 0.0, st.accept_len,
              !s->cfg.speculating ? "none"
              : st.spec_on        ? "on"
                                  : "off",
              pol);
}

/* How a turn's prefill went (exec_prefill), for apply_prefill. */
typedef enum prefill_result {
    PREFILL_MORE,     /* a chunk in, more to come */
    PREFILL_IN,       /* the prompt is in and the other choices forked */
    PREFILL_REFUSED,  /* its rules refused it (a resent output off its schema) */
    PREFILL_NO_START, /* its rules or its sequence could not be made */
    PREFILL_FAILED,   /* the chunk's pass failed */
    PREFILL_NO_FORK,  /* a fork failed */
} prefill_result;

/* Runs the plan's prefill chunk of q: first the request's rules and
 * sequence (when it has none yet), then the chunk, then, once the prompt
 * is in, the other choices fork from choice 0. */
static prefill_result exec_prefill(sched *s, req *q, const sched_plan *p, ae_error *err) {
    choice *c0 = &q->ch[0];
    bool refused = false;
    if (c0->seq < 0 && (start_rules(s, q, err, &refused) != AE_OK || engine_seq_new(s->e, &c0->seq, err) != AE_OK))
        return refused ? PREFILL_REFUSED : PREFILL_NO_START;
    /* The plan's chunk: its tokens (0 for a one-token prompt, which only
     * sets the root up). */
    if (spec_seq_prefill(s->sx, c0->seq, q->prompt, q->r.n_prompt, p->prefill.tokens, &q->prefilled, false, err) !=
        AE_OK)
        return PREFILL_FAILED;
    AE_ASSERT(q->prefilled == p->prefill.from + p->prefill.tokens);
    if (!p->prompt_in) return PREFILL_MORE;
    for (int32_t c = 1; c < q->r.n && err->msg[0] == 0; c++)
        if (engine_seq_fork(s->e, c0->seq, &q->ch[c].seq, err) == AE_OK &&
            spec_seq_fork(s->sx, c0->seq, q->ch[c].seq, err) != AE_OK) {
            engine_seq_free(s->e, q->ch[c].seq);
            q->ch[c].seq = -1;
        }
    return err->msg[0] ? PREFILL_NO_FORK : PREFILL_IN;
}

/* A prefill's result on q: the request decodes from the next turn, or it
 * ends with the error. */
static void apply_prefill(sched *s, req *q, prefill_result r, const ae_error *err) {
    switch (r) {
    case PREFILL_MORE: return;
    case PREFILL_IN:
        pthread_mutex_lock(&s->mu);
        q->state = REQ_RUNNING;
        pthread_mutex_unlock(&s->mu);
        return;
    case PREFILL_REFUSED: finish_active(s, q, 0, NULL, 0, NULL, SCHED_REFUSED, err->msg); return;
    case PREFILL_NO_START: finish_active(s, q, 0, NULL, 0, NULL, SCHED_ERROR, err->msg); return;
    case PREFILL_FAILED:
        LOG_ERRORF("prefill_failed seq=%d reason=\"%s\"", q->ch[0].seq, err->msg);
        finish_active(s, q, 0, NULL, 0, NULL, SCHED_ERROR, err->msg);
        return;
    case PREFILL_NO_FORK:
        LOG_ERRORF("fork_failed seq=%d reason=\"%s\"", q->ch[0].seq, err->msg);
        finish_active(s, q, 0, NULL, 0, NULL, SCHED_ERROR, err->msg);
        return;
    }
}

/* Runs the plan's decode batch: one speculative step (spec.h) over its n
 * choices, recorded in step_reqs and step_ch for apply_decode. */
static int exec_decode(sched *s, const sched_plan *p, ae_error *err) {
    int32_t n = p->n_decode;
    for (int32_t i = 0; i < n; i++) {
        req *q = s->plan_of[p->decode[i].req];
        choice *ch = &q->ch[p->decode[i].choice];
        s->step_reqs[i] = q;
        s->step_ch[i] = p->decode[i].choice;
        s->in[i] = (spec_in){.seq = ch->seq,
                             .params = &q->r.params,
                             .rng = &ch->rng,
                             .pen = ch->pen,
                             .gm = ch->gm,
                             .logprobs = q->r.logprobs,
                             .top_logprobs = q->r.top_logprobs};
    }
    return spec_step(s->sx, s->in, n, s->out, err);
}

/* A decode step's results: each choice's tokens delivered, finished and
 * failed requests ended, the figures updated. */
static void apply_decode(sched *s, int32_t n, int rc, const ae_error *err) {
    if (rc != AE_OK) {
        LOG_ERRORF("step_failed batch=%d reason=\"%s\"", n, err->msg);
        /* Every request of the step ends, once. */
        for (int32_t i = 0; i < n; i++) {
            bool seen = false;
            for (int32_t j = 0; j < i; j++) seen |= s->step_reqs[j] == s->step_reqs[i];
            if (!seen) finish_active(s, s->step_reqs[i], 0, NULL, 0, NULL, SCHED_ERROR, err->msg);
        }
        return;
    }
    /* A request ends with its last choice; none of its choices comes
     * after that in the step (they were done before it). */
    /* A choice whose grammar refused a token (every token was masked:
     * a schema nothing fits) ends its request with an error, once;
     * the request's other entries in the step are skipped. */
    for (int32_t i = 0; i < n; i++) s->step_failed[i] = false;
    for (int32_t i = 0; i < n; i++) {
        bool first = true; /* the request's first entry in the step */
        for (int32_t j = 0; j < i; j++) first &= s->step_reqs[j] != s->step_reqs[i];
        if (s->out[i].refused || (first && over_mask_budget(s, s->step_reqs[i])))
            for (int32_t j = 0; j < n; j++) s->step_failed[j] |= s->step_reqs[j] == s->step_reqs[i];
    }
    for (int32_t i = 0; i < n; i++) {
        if (!s->step_failed[i]) {
            deliver(s, s->step_reqs[i], s->step_ch[i], &s->out[i]);
            continue;
        }
        bool first = true;
        for (int32_t j = 0; j < i; j++) first &= s->step_reqs[j] != s->step_reqs[i];
        if (!first) continue;
        req *q = s->step_reqs[i];
        if (q->mask_over) {
            LOG_WARNF("mask_budget_spent seq=%d reason=\"%s\"", s->in[i].seq, q->compile_err);
            pthread_mutex_lock(&s->mu);
            s->stats.mask_budget_spent++;
            pthread_mutex_unlock(&s->mu);
            finish_active(s, q, s->step_ch[i], NULL, 0, NULL, SCHED_REFUSED, q->compile_err);
            continue;
        }
        LOG_ERRORF("grammar_refused seq=%d", s->in[i].seq);
        finish_active(s, q, s->step_ch[i], NULL, 0, NULL, SCHED_ERROR, "the output's grammar allowed no token");
    }
    kv_stats kv = engine_kv_stats(s->e);
    engine_comm_stats cs = engine_get_comm_stats(s->e);
    policy_report pr;
    spec_policy_report(s->sx, n, &pr);
    pthread_mutex_lock(&s->mu);
    s->stats.kv_blocks_used = kv.blocks_used;
    s->stats.comm = cs;
    s->stats.spec = *spec_total_stats(s->sx);
    s->stats.policy = pr;
    pthread_mutex_unlock(&s->mu);
}

static void *loop_main(void *arg) {
    sched *s = arg;
    ae_error err;
    s->log_at_ns = clock_mono_ns();
    /* systemd's watchdog hears from this thread each time round (at least
     * every 100 ms while idle, below); a hung step stops the pings. */
    watchdog *w = watchdog_process();
    int beat = watchdog_add(w, "scheduler");
    for (;;) {
        watchdog_beat(w, beat);
        int64_t now = clock_mono_ns();
        if (s->cfg.log_interval_ms > 0 && now - s->log_at_ns >= (int64_t)s->cfg.log_interval_ms * 1000000)
            log_line(s, now);
        pthread_mutex_lock(&s->mu);
        bool stopping = s->stopping;
        pthread_mutex_unlock(&s->mu);
        drop_cancelled_waiting(s, stopping);
        /* Cancelled, disconnected, or shutting down. */
        for (;;) {
            req *gone = NULL;
            pthread_mutex_lock(&s->mu);
            for (req *q = s->active; q && !gone; q = q->next)
                if (stopping || atomic_load(&q->cancel) || s->sink.cancelled(s->sink.ctx, q->r.ctx)) gone = q;
            pthread_mutex_unlock(&s->mu);
            if (!gone) break;
            finish_active(s, gone, 0, NULL, 0, NULL, SCHED_CANCELLED, NULL);
        }
        if (stopping) {
            watchdog_remove(w, beat);
            return NULL;
        }
        /* Plan: from the state as it is, what this turn admits, prefills
         * and decodes (sched_plan_turn); admission is applied at once.
         * Only this thread changes states and unlinks requests, so the
         * ones planned here stay valid after the lock is dropped; other
         * threads only add to the queue and set cancel flags. */
        sched_plan_state st;
        sched_plan plan = {.decode = s->plan_decode};
        pthread_mutex_lock(&s->mu);
        plan_snapshot(s, &st);
        sched_plan_turn(&st, &plan);
        plan_admit(s, &st, &plan);
        if (!s->active) {
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_nsec += 100000000;
            if (until.tv_nsec >= 1000000000) until.tv_sec++, until.tv_nsec -= 1000000000;
            if (!s->waiting && !s->stopping) pthread_cond_timedwait(&s->cv, &s->mu, &until);
            pthread_mutex_unlock(&s->mu);
            continue;
        }
        pthread_mutex_unlock(&s->mu);
        /* Execute and apply: the prefill chunk, then the decode batch. */
        if (plan.has_prefill) {
            req *q = s->plan_of[plan.prefill.req];
            err_clear(&err);
            prefill_result r = exec_prefill(s, q, &plan, &err);
            apply_prefill(s, q, r, &err);
        }
        if (plan.n_decode == 0) continue;
        err_clear(&err);
        int rc = exec_decode(s, &plan, &err);
        apply_decode(s, plan.n_decode, rc, &err);
    }
}

/* Stops the compile workers: a running compile is given up on within
 * GCOMPILE_POLL_MS, and its request joins the waiting queue as cancelled; what
 * is still queued for a compile stays there, for the loop to cancel. */
static void stop_compiler(sched *s) {
    if (!s->n_compilers) return;
    pthread_mutex_lock(&s->mu);
    atomic_store(&s->compile_stop, true);
    pthread_cond_broadcast(&s->ccv);
    pthread_mutex_unlock(&s->mu);
    for (int32_t k = 0; k < s->n_compilers; k++) pthread_join(s->compilers[k], NULL);
    s->n_compilers = 0;
}

int sched_init(sched **out, spec *sx, engine *e, const sched_config *cfg, const sched_sink *sink, ae_error *err) {
    *out = NULL;
    const engine_config *ec = engine_get_config(e);
    if (cfg->max_batch < 1 || cfg->max_batch > ec->max_seqs || cfg->max_queue < 0 || cfg->chunk < 1)
        return err_set(err, "scheduler: batch %d (engine holds %d), queue %d, chunk %d", cfg->max_batch, ec->max_seqs,
                       cfg->max_queue, cfg->chunk);
    sched *s = calloc(1, sizeof *s);
    if (!s) return err_set(err, "out of memory");
    s->sx = sx;
    s->e = e;
    s->cfg = *cfg;
    s->sink = *sink;
    s->block_size = ec->block_size;
    s->vocab = engine_model(e)->cfg.vocab;
    s->batch_tokens = ec->max_batch_tokens;
    s->n_blocks = (ec->kv_tokens + ec->block_size - 1) / ec->block_size;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_cond_init(&s->ccv, NULL);
    s->in = calloc((size_t)cfg->max_batch, sizeof *s->in);
    s->out = calloc((size_t)cfg->max_batch, sizeof *s->out);
    s->step_reqs = calloc((size_t)cfg->max_batch, sizeof *s->step_reqs);
    s->step_ch = calloc((size_t)cfg->max_batch, sizeof *s->step_ch);
    s->step_failed = calloc((size_t)cfg->max_batch, sizeof *s->step_failed);
    s->plan_reqs = calloc(2 * (size_t)cfg->max_batch, sizeof *s->plan_reqs);
    s->plan_of = calloc(2 * (size_t)cfg->max_batch, sizeof *s->plan_of);
    s->plan_decode = calloc((size_t)cfg->max_batch, sizeof *s->plan_decode);
    s->emit_buf = calloc(ENGINE_MAX_TREE + 1, sizeof *s->emit_buf);
    s->stats.kv_blocks = s->n_blocks;
    s->stats.tp = engine_tp(e);
    if (!s->in || !s->out || !s->step_reqs || !s->step_ch || !s->step_failed || !s->emit_buf || !s->plan_reqs ||
        !s->plan_of || !s->plan_decode) {
        err_set(err, "out of memory");
        goto fail;
    }
    if (s->cfg.compile_workers < 1) s->cfg.compile_workers = 1;
    if (s->cfg.max_compiles < 1) s->cfg.max_compiles = 1;
    if (s->cfg.grammar) {
        s->compilers = calloc((size_t)s->cfg.compile_workers, sizeof *s->compilers);
        s->compiling_now = calloc((size_t)s->cfg.compile_workers, sizeof *s->compiling_now);
        if (!s->compilers || !s->compiling_now) {
            err_set(err, "out of memory");
            goto fail;
        }
        for (int32_t k = 0; k < s->cfg.compile_workers; k++) {
            worker_arg *wa = malloc(sizeof *wa);
            if (wa) *wa = (worker_arg){s, k};
            if (!wa || pthread_create(&s->compilers[k], NULL, compiler_main, wa) != 0) {
                free(wa);
                err_set(err, "cannot start schema compile worker %d", k);
                stop_compiler(s);
                goto fail;
            }
            s->n_compilers++;
        }
    }
    if (pthread_create(&s->thread, NULL, loop_main, s) != 0) {
        err_set(err, "cannot start the scheduler thread");
        stop_compiler(s);
        goto fail;
    }
    *out = s;
    return AE_OK;
fail:
    free(s->in), free(s->out), free(s->step_reqs), free(s->step_ch), free(s->step_failed), free(s->emit_buf);
    free(s->plan_reqs), free(s->plan_of), free(s->plan_decode);
    free(s->compilers), free(s->compiling_now);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    pthread_cond_destroy(&s->ccv);
    free(s);
    return AE_ERR;
}

void sched_drain(sched *s, int64_t timeout_ms) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (timeout_ms % 1000) * 1000000;
    if (until.tv_nsec >= 1000000000) until.tv_sec++, until.tv_nsec -= 1000000000;
    pthread_mutex_lock(&s->mu);
    s->draining = true;
    /* Compiles are not waited for: running ones are given up on, queued
     * ones cancelled (the loop ends them); admitted requests may finish. */
    atomic_store(&s->compile_stop, true);
    pthread_cond_broadcast(&s->ccv);
    while ((s->active || s->waiting || s->compiling || s->n_compiling) &&
           pthread_cond_timedwait(&s->cv, &s->mu, &until) == 0) {
    }
    int32_t left = s->n_active + s->n_waiting;
    pthread_mutex_unlock(&s->mu);
    if (left > 0) LOG_WARNF("drain_timeout cancelling=%d", left);
}

void sched_free(sched *s) {
    if (!s) return;
    stop_compiler(s);
    pthread_mutex_lock(&s->mu);
    s->stopping = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    free(s->in), free(s->out), free(s->step_reqs), free(s->step_ch), free(s->step_failed), free(s->emit_buf);
    free(s->plan_reqs), free(s->plan_of), free(s->plan_decode);
    free(s->compilers), free(s->compiling_now);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    pthread_cond_destroy(&s->ccv);
    free(s);
}

sched_stats sched_get_stats(sched *s) {
    pthread_mutex_lock(&s->mu);
    sched_stats st = s->stats;
    st.waiting = s->n_waiting;
    st.compiling = s->n_compiling;
    st.running = st.prefilling = 0;
    for (req *q = s->active; q; q = q->next) {
        if (q->state == REQ_RUNNING)
            st.running++;
        else
            st.prefilling++;
    }
    st.kv_blocks_reserved = s->reserved;
    pthread_mutex_unlock(&s->mu);
    if (s->cfg.grammar) grammar_vocab_mask_stats(s->cfg.grammar, &st.grammar_masks, &st.grammar_mask_ns);
    return st;
}
