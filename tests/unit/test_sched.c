/* The scheduler (target/sched.h): first its plan of a turn
 * (sched_plan_turn), which is pure and needs no engine or model; then the
 * scheduler on the default model, with structured output: the schema
 * compiles (their own queue, workers, time budget, cancellation), and the
 * paths a request takes through them. Run from the repo root after
 * tools/fetch_model.sh. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>
#include <pthread.h>

#include "../../kernels/backend.h"
#include "../../services/tokenizer/tok_file.h"
#include "../../target/sched.h"

#define MODEL_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define MAX_REQ 16

/* What the sink saw of one request. */
typedef struct seen {
    int32_t tokens;
    sched_finish finish;
    bool last;
    char error[256];
    bool gone; /* the caller gave up (sink_cancelled says so) */
} seen;

typedef struct fixture {
    model *m;
    engine *e;
    spec *sx;
    tok_file tf;
    grammar_vocab *gv;
    int32_t eos;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    seen req[MAX_REQ];
} fixture;

static fixture F;

static void sink_emit(void *ctx, void *req_ctx, const sched_event *ev) {
    fixture *f = ctx;
    seen *s = req_ctx;
    pthread_mutex_lock(&f->mu);
    s->tokens += ev->n;
    if (ev->finish != SCHED_RUNNING) s->finish = ev->finish;
    if (ev->error) snprintf(s->error, sizeof s->error, "%s", ev->error);
    if (ev->last) s->last = true;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

static bool sink_cancelled(void *ctx, void *req_ctx) {
    fixture *f = ctx;
    seen *s = req_ctx;
    pthread_mutex_lock(&f->mu);
    bool gone = s->gone;
    pthread_mutex_unlock(&f->mu);
    return gone;
}

static int setup(void **state) {
    ae_error err = {{0}};
    fixture *f = &F;
    memset(f, 0, sizeof *f);
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    if (model_load(&f->m, MODEL_PATH, &kn_backend_cpu, &err) != AE_OK) fail_msg("%s", err.msg);
    engine_config ec = {
        .max_batch_tokens = 64, .max_seqs = 4, .max_seq_len = 256, .kv_tokens = 1024, .block_size = 16, .threads = 2};
    if (engine_init(&f->e, f->m, &ec, &err) != AE_OK) fail_msg("%s", err.msg);
    spec_config sc = spec_config_default((spec_shape){1, 1, 2}, 4, 64);
    if (spec_init(&f->sx, f->e, NULL, &sc, &err) != AE_OK) fail_msg("%s", err.msg);
    if (tok_file_open(&f->tf, MODEL_PATH, &err) != AE_OK) fail_msg("%s", err.msg);
    f->eos = tok_eos(f->tf.tok);
    if (grammar_vocab_init(&f->gv, f->tf.tok, f->m->cfg.vocab, f->eos, &err) != AE_OK) fail_msg("%s", err.msg);
    *state = f;
    return 0;
}

static int teardown(void **state) {
    fixture *f = *state;
    /* Compiles given up on run to their end: the process must not exit
     * under them. */
    while (gcompile_live() > 0) {
        struct timespec t = {0, 10000000};
        nanosleep(&t, NULL);
    }
    grammar_vocab_free(f->gv);
    tok_file_close(&f->tf);
    spec_free(f->sx);
    engine_free(f->e);
    model_free(f->m);
    return 0;
}

/* The tests' scheduler: 2 compile workers, every compile logged. */
static sched_config base_config(const fixture *f) {
    return (sched_config){.max_batch = 4,
                          .max_queue = 8,
                          .chunk = 32,
                          .max_seq_len = 256,
                          .tree_tokens = 1,
                          .eos = f->eos,
                          .grammar = f->gv,
                          .compile_workers = 2,
                          .max_compiles = 8,
                          .compile = {.isolate = true, .timeout_ms = 60000, .max_live = 4, .log_ms = 0}};
}

static sched *open_sched(fixture *f, const sched_config *over) {
    sched_config c = over ? *over : base_config(f);
    sched_sink sink = {f, sink_emit, sink_cancelled};
    sched *s = NULL;
    ae_error err = {{0}};
    if (sched_init(&s, f->sx, f->e, &c, &sink, &err) != AE_OK) fail_msg("%s", err.msg);
    memset(f->req, 0, sizeof f->req);
    return s;
}

static const int32_t PROMPT[] = {1, 9690, 198, 22503, 44, 1694, 279, 253, 4563, 2};

/* ---- The plan of a turn (sched_plan_turn), without an engine ---- */

#define PLAN_BATCH 8

/* A state of batch 4, 64 tokens a pass, chunks of 32, no drafter, 100
 * blocks free and nothing running. */
static sched_plan_state plan_state(const sched_plan_req *active, int32_t n_active, const sched_plan_req *waiting,
                                   int32_t n_waiting) {
    sched_plan_state st = {.active = active,
                           .n_active = n_active,
                           .waiting = waiting,
                           .n_waiting = n_waiting,
                           .max_batch = 4,
                           .blocks_free = 100,
                           .chunk = 32,
                           .max_batch_tokens = 64,
                           .tree_tokens = 1};
    for (int32_t i = 0; i < n_active; i++) st.seqs += active[i].n;
    return st;
}

static sched_plan plan_of(const sched_plan_state *st, sched_plan_seq *decode) {
    sched_plan p;
    memset(&p, 0xff, sizeof p); /* every field is the plan's to write */
    p.decode = decode;
    assert_true(st->max_batch <= PLAN_BATCH);
    sched_plan_turn(st, &p);
    return p;
}

static void assert_seq(const sched_plan_seq *q, sched_plan_kind kind, int32_t req, int32_t choice, int32_t from,
                       int32_t tokens) {
    assert_int_equal(q->kind, kind);
    assert_int_equal(q->req, req);
    assert_int_equal(q->choice, choice);
    assert_int_equal(q->from, from);
    assert_int_equal(q->tokens, tokens);
}

/* A prompt goes in a chunk a turn: chunk tokens, never more than a pass
 * holds, and never its last token (the first decode step's root); the
 * chunk that ends it says so. */
static void test_plan_prefill_takes_chunks_within_the_pass(void **state) {
    (void)state;
    sched_plan_seq d[PLAN_BATCH];
    sched_plan_req a = {.n = 1, .n_prompt = 100, .blocks = 8};
    sched_plan_state st = plan_state(&a, 1, NULL, 0);
    sched_plan p = plan_of(&st, d);
    assert_true(p.has_prefill);
    assert_false(p.prompt_in);
    assert_seq(&p.prefill, SCHED_PLAN_PREFILL, 0, 0, 0, 32);
    assert_int_equal(p.n_decode, 0);
    assert_int_equal(p.n_admit, 0);
    /* The last chunk: 96 in, 3 to go (the 100th is the root). */
    a.prefilled = 96;
    p = plan_of(&st, d);
    assert_true(p.prompt_in);
    assert_seq(&p.prefill, SCHED_PLAN_PREFILL, 0, 0, 96, 3);
    /* A chunk past the pass's tokens is cut to them; 0 is "a pass". */
    a.prefilled = 0;
    st.chunk = 128;
    p = plan_of(&st, d);
    assert_seq(&p.prefill, SCHED_PLAN_PREFILL, 0, 0, 0, 64);
    st.chunk = 0;
    p = plan_of(&st, d);
    assert_seq(&p.prefill, SCHED_PLAN_PREFILL, 0, 0, 0, 64);
    /* One token: nothing to prefill, and the prompt is in. */
    a.n_prompt = 1;
    p = plan_of(&st, d);
    assert_true(p.has_prefill);
    assert_true(p.prompt_in);
    assert_seq(&p.prefill, SCHED_PLAN_PREFILL, 0, 0, 0, 0);
}

/* The decode batch: every choice not done of every running request, in
 * admission order, one token each; a prompt still going in is not in it,
 * and gets the turn's chunk. */
static void test_plan_decodes_every_running_choice_in_order(void **state) {
    (void)state;
    sched_plan_seq d[PLAN_BATCH];
    const sched_plan_req act[3] = {
        {.n = 1, .n_prompt = 10, .prefilled = 9, .blocks = 2, .running = true},
        {.n = 1, .n_prompt = 50, .prefilled = 32, .blocks = 4},
        {.n = 3, .n_prompt = 10, .prefilled = 9, .blocks = 5, .running = true, .done = 1u << 1},
    };
    sched_plan_state st = plan_state(act, 3, NULL, 0);
    st.max_batch = 5;
    sched_plan p = plan_of(&st, d);
    assert_int_equal(p.n_admit, 0);
    assert_int_equal(p.seqs, 5);
    assert_int_equal(p.blocks_free, 100);
    assert_true(p.has_prefill);
    assert_true(p.prompt_in);
    assert_seq(&p.prefill, SCHED_PLAN_PREFILL, 1, 0, 32, 17);
    assert_int_equal(p.n_decode, 3);
    assert_seq(&d[0], SCHED_PLAN_DECODE, 0, 0, 0, 1);
    assert_seq(&d[1], SCHED_PLAN_DECODE, 2, 0, 0, 1);
    assert_seq(&d[2], SCHED_PLAN_DECODE, 2, 2, 0, 1);
    /* A state whose seqs undercounts its choices: cut at max_batch. */
    st.max_batch = 2;
    p = plan_of(&st, d);
    assert_int_equal(p.n_decode, 2);
    assert_seq(&d[1], SCHED_PLAN_DECODE, 2, 0, 0, 1);
}

/* With a drafter each decode entry speculates: a tree of at most
 * tree_tokens, and no more than the pass holds beside the other roots. */
static void test_plan_trees_fit_the_pass_beside_every_root(void **state) {
    (void)state;
    sched_plan_seq d[PLAN_BATCH];
    const sched_plan_req act[2] = {
        {.n = 2, .n_prompt = 10, .prefilled = 9, .blocks = 3, .running = true},
        {.n = 1, .n_prompt = 10, .prefilled = 9, .blocks = 2, .running = true},
    };
    sched_plan_state st = plan_state(act, 2, NULL, 0);
    st.speculating = true;
    st.tree_tokens = 8;
    sched_plan p = plan_of(&st, d);
    assert_false(p.has_prefill);
    assert_int_equal(p.n_decode, 3);
    assert_seq(&d[0], SCHED_PLAN_SPECULATE, 0, 0, 0, 8);
    assert_seq(&d[1], SCHED_PLAN_SPECULATE, 0, 1, 0, 8);
    assert_seq(&d[2], SCHED_PLAN_SPECULATE, 1, 0, 0, 8);
    st.max_batch_tokens = 9; /* 2 roots leave 7 for a tree */
    p = plan_of(&st, d);
    for (int i = 0; i < 3; i++) assert_int_equal(d[i].tokens, 7);
    /* Trees of one token are plain decoding, drafter or not. */
    st.tree_tokens = 1;
    p = plan_of(&st, d);
    assert_seq(&d[2], SCHED_PLAN_DECODE, 1, 0, 0, 1);
}

/* Admission reserves each request's worst case: a head that needs more
 * blocks than are free waits, and nothing behind it passes it. */
static void test_plan_admission_waits_for_kv_blocks(void **state) {
    (void)state;
    sched_plan_seq d[PLAN_BATCH];
    const sched_plan_req wait[2] = {{.n = 1, .n_prompt = 40, .blocks = 10}, {.n = 1, .n_prompt = 8, .blocks = 2}};
    sched_plan_state st = plan_state(NULL, 0, wait, 2);
    st.blocks_free = 9;
    sched_plan p = plan_of(&st, d);
    assert_int_equal(p.n_admit, 0);
    assert_int_equal(p.seqs, 0);
    assert_int_equal(p.blocks_free, 9);
    assert_false(p.has_prefill);
    assert_int_equal(p.n_decode, 0);
    /* Room for the head alone: it is admitted and prefills at once. */
    st.blocks_free = 11;
    p = plan_of(&st, d);
    assert_int_equal(p.n_admit, 1);
    assert_int_equal(p.seqs, 1);
    assert_int_equal(p.blocks_free, 1);
    assert_true(p.has_prefill);
    assert_seq(&p.prefill, SCHED_PLAN_PREFILL, 0, 0, 0, 32);
    /* Room for both. */
    st.blocks_free = 12;
    p = plan_of(&st, d);
    assert_int_equal(p.n_admit, 2);
    assert_int_equal(p.seqs, 2);
    assert_int_equal(p.blocks_free, 0);
    assert_seq(&p.prefill, SCHED_PLAN_PREFILL, 0, 0, 0, 32);
}

/* A request needs a sequence per choice: with 2 of 4 held, a head of 3
 * choices waits, and the one-choice request behind it waits too (first
 * come, first served: no large request is starved by small ones). */
static void test_plan_admission_waits_for_sequences_first_come_first_served(void **state) {
    (void)state;
    sched_plan_seq d[PLAN_BATCH];
    const sched_plan_req act[1] = {{.n = 2, .n_prompt = 10, .prefilled = 9, .blocks = 4, .running = true}};
    const sched_plan_req wait[2] = {{.n = 3, .n_prompt = 10, .blocks = 5}, {.n = 1, .n_prompt = 10, .blocks = 2}};
    sched_plan_state st = plan_state(act, 1, wait, 2);
    sched_plan p = plan_of(&st, d);
    assert_int_equal(p.n_admit, 0);
    assert_int_equal(p.seqs, 2);
    assert_false(p.has_prefill);
    assert_int_equal(p.n_decode, 2);
    assert_seq(&d[0], SCHED_PLAN_DECODE, 0, 0, 0, 1);
    assert_seq(&d[1], SCHED_PLAN_DECODE, 0, 1, 0, 1);
    /* With a batch of 5 the head fits exactly, and the next does not. */
    st.max_batch = 5;
    p = plan_of(&st, d);
    assert_int_equal(p.n_admit, 1);
    assert_int_equal(p.seqs, 5);
    assert_int_equal(p.blocks_free, 95);
    assert_seq(&p.prefill, SCHED_PLAN_PREFILL, 1, 0, 0, 9);
    assert_true(p.prompt_in);
    /* A choice done still holds its sequence (until its request ends). */
    sched_plan_req one_done = act[0];
    one_done.done = 1;
    st.active = &one_done;
    st.max_batch = 4;
    p = plan_of(&st, d);
    assert_int_equal(p.n_admit, 0);
    assert_int_equal(p.n_decode, 1);
    assert_seq(&d[0], SCHED_PLAN_DECODE, 0, 1, 0, 1);
}

/* Prompts are prefilled in admission order: a request admitted this turn
 * waits for the one before it, whose prompt goes on from where it was. */
static void test_plan_prefills_the_oldest_prompt_first(void **state) {
    (void)state;
    sched_plan_seq d[PLAN_BATCH];
    const sched_plan_req act[2] = {
        {.n = 1, .n_prompt = 10, .prefilled = 9, .blocks = 2, .running = true},
        {.n = 1, .n_prompt = 80, .prefilled = 64, .blocks = 6},
    };
    const sched_plan_req wait[1] = {{.n = 1, .n_prompt = 20, .blocks = 2}};
    sched_plan_state st = plan_state(act, 2, wait, 1);
    sched_plan p = plan_of(&st, d);
    assert_int_equal(p.n_admit, 1);
    assert_true(p.has_prefill);
    assert_true(p.prompt_in);
    assert_seq(&p.prefill, SCHED_PLAN_PREFILL, 1, 0, 64, 15);
    assert_int_equal(p.n_decode, 1);
    assert_seq(&d[0], SCHED_PLAN_DECODE, 0, 0, 0, 1);
    /* Next turn the older prompt is in and running: the admitted one
     * (now active[2]) gets the chunk, and decodes from the turn after. */
    const sched_plan_req act2[3] = {act[0],
                                    {.n = 1, .n_prompt = 80, .prefilled = 79, .blocks = 6, .running = true},
                                    {.n = 1, .n_prompt = 20, .blocks = 2}};
    st = plan_state(act2, 3, NULL, 0);
    p = plan_of(&st, d);
    assert_seq(&p.prefill, SCHED_PLAN_PREFILL, 2, 0, 0, 19);
    assert_int_equal(p.n_decode, 2);
    assert_seq(&d[0], SCHED_PLAN_DECODE, 0, 0, 0, 1);
    assert_seq(&d[1], SCHED_PLAN_DECODE, 1, 0, 0, 1);
}

/* The plan depends on the state alone: the same state, the same plan,
 * and the state unchanged. */
static void test_plan_is_the_same_for_the_same_state(void **state) {
    (void)state;
    sched_plan_seq d1[PLAN_BATCH], d2[PLAN_BATCH];
    sched_plan_req act[2] = {
        {.n = 2, .n_prompt = 10, .prefilled = 9, .blocks = 3, .running = true, .done = 1},
        {.n = 1, .n_prompt = 300, .prefilled = 32, .blocks = 20},
    };
    sched_plan_req wait[2] = {{.n = 1, .n_prompt = 5, .blocks = 1}, {.n = 2, .n_prompt = 5, .blocks = 2}};
    sched_plan_req act0[2], wait0[2];
    memcpy(act0, act, sizeof act), memcpy(wait0, wait, sizeof wait);
    sched_plan_state st = plan_state(act, 2, wait, 2);
    sched_plan_state st0 = st;
    sched_plan p1 = plan_of(&st, d1), p2 = plan_of(&st, d2);
    assert_int_equal(p1.n_admit, 1);
    assert_int_equal(p1.n_decode, 1);
    assert_seq(&d1[0], SCHED_PLAN_DECODE, 0, 1, 0, 1);
    assert_seq(&p1.prefill, SCHED_PLAN_PREFILL, 1, 0, 32, 32);
    assert_int_equal(p1.n_admit, p2.n_admit);
    assert_int_equal(p1.seqs, p2.seqs);
    assert_int_equal(p1.blocks_free, p2.blocks_free);
    assert_int_equal(p1.has_prefill, p2.has_prefill);
    assert_int_equal(p1.prompt_in, p2.prompt_in);
    assert_memory_equal(&p1.prefill, &p2.prefill, sizeof p1.prefill);
    assert_int_equal(p1.n_decode, p2.n_decode);
    assert_memory_equal(d1, d2, sizeof(sched_plan_seq) * (size_t)p1.n_decode);
    assert_memory_equal(&st, &st0, sizeof st);
    assert_memory_equal(act, act0, sizeof act);
    assert_memory_equal(wait, wait0, sizeof wait);
}

static sched_refusal submit(fixture *f, sched *s, int i, int32_t format, const char *schema, int32_t max_tokens,
                            ae_error *err) {
    sched_request r = {.prompt = PROMPT,
                       .n_prompt = 10,
                       .max_tokens = max_tokens,
                       .n = 1,
                       .format = format,
                       .schema = schema,
                       .schema_len = schema ? strlen(schema) : 0,
                       .ctx = &f->req[i]};
    r.params.top_p = 1;
    r.pen.repetition = 1;
    snprintf(r.id, sizeof r.id, "req-%d", i);
    return sched_submit(s, &r, err);
}

/* Waits for request i's last event. */
static void wait_last(fixture *f, int i) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 120;
    pthread_mutex_lock(&f->mu);
    while (!f->req[i].last)
        if (pthread_cond_timedwait(&f->cv, &f->mu, &until) != 0) break;
    bool last = f->req[i].last;
    pthread_mutex_unlock(&f->mu);
    if (!last) fail_msg("request %d has no last event after 120 s", i);
}

/* A json_object request has no schema text: its compile is logged (every
 * compile is, at a threshold of 0 ms) with 0 bytes, and it runs. */
static void test_json_object_request_compiles_and_runs(void **state) {
    fixture *f = *state;
    sched *s = open_sched(f, NULL);
    ae_error err = {{0}};
    sched_refusal st = submit(f, s, 0, 1, NULL, 6, &err);
    if (st != SCHED_QUEUED) fail_msg("refused %d: %s", st, err.msg);
    wait_last(f, 0);
    sched_free(s);
    printf("json_object: %d tokens, finish %d\n", f->req[0].tokens, f->req[0].finish);
    /* Greedy: "{}" and the end of the value. */
    assert_int_equal(f->req[0].finish, SCHED_STOP);
    assert_int_equal(f->req[0].tokens, 3);
}

static int64_t mono_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* An object of 1,500 short strings, all required: a compile of about a
 * second in a release build on the 2-core development machine (more under
 * ASan), within the schema limits. */
static char *slow_schema(int tag) {
    size_t cap = 1 << 17, n = 0;
    char *s = malloc(cap);
    n += (size_t)snprintf(s + n, cap - n, "{\"type\":\"object\",\"title\":\"t%d\",\"properties\":{", tag);
    for (int i = 0; i < 1500; i++)
        n += (size_t)snprintf(s + n, cap - n, "%s\"p%d\":{\"type\":\"string\",\"maxLength\":4}", i ? "," : "", i);
    n += (size_t)snprintf(s + n, cap - n, "},\"required\":[");
    for (int i = 0; i < 1500; i++) n += (size_t)snprintf(s + n, cap - n, "%s\"p%d\"", i ? "," : "", i);
    snprintf(s + n, cap - n, "]}");
    return s;
}

static void sleep_ms(int ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* A request cancelled while its schema compiles ends at once (the compile
 * is given up on), and is counted so. */
static void test_cancel_gives_up_a_running_compile(void **state) {
    fixture *f = *state;
    sched *s = open_sched(f, NULL);
    ae_error err = {{0}};
    char *big = slow_schema(1);
    assert_int_equal(submit(f, s, 0, 2, big, 4, &err), SCHED_QUEUED);
    sleep_ms(100);
    assert_true(sched_cancel_id(s, "req-0"));
    int64_t t0 = mono_ms();
    wait_last(f, 0);
    int64_t took = mono_ms() - t0;
    sched_stats st = sched_get_stats(s);
    sched_free(s);
    free(big);
    printf("cancelled 100 ms into its compile: ended %lld ms after the cancel\n", (long long)took);
    assert_int_equal(f->req[0].finish, SCHED_CANCELLED);
    assert_true(took < 1000);
    assert_int_equal(st.compiles[GCOMPILE_CANCELLED], 1);
    assert_int_equal(st.requests_cancelled, 1);
}

/* Past its time budget a compile fails the request with the limit named;
 * the next request is not held up by it. */
static void test_compile_past_its_budget_is_refused(void **state) {
    fixture *f = *state;
    sched_config c = base_config(f);
    c.compile_workers = 1;
    c.compile.timeout_ms = 200;
    sched *s = open_sched(f, &c);
    ae_error err = {{0}};
    char *big = slow_schema(2);
    int64_t t0 = mono_ms();
    assert_int_equal(submit(f, s, 0, 2, big, 4, &err), SCHED_QUEUED);
    assert_int_equal(submit(f, s, 1, 1, NULL, 6, &err), SCHED_QUEUED);
    wait_last(f, 0);
    int64_t refused_at = mono_ms() - t0;
    wait_last(f, 1);
    int64_t second_at = mono_ms() - t0;
    sched_stats st = sched_get_stats(s);
    sched_free(s);
    free(big);
    printf("refused after %lld ms: %s; the json_object request behind it done at %lld ms\n", (long long)refused_at,
           f->req[0].error, (long long)second_at);
    assert_int_equal(f->req[0].finish, SCHED_REFUSED);
    assert_string_equal(f->req[0].error,
                        "the schema did not compile within 200 ms (the target's --compile-timeout-ms); "
                        "make it smaller or simpler");
    assert_true(refused_at >= 200 && refused_at < 1000);
    assert_int_equal(f->req[1].finish, SCHED_STOP);
    assert_int_equal(f->req[1].tokens, 3);
    assert_int_equal(st.compiles[GCOMPILE_TIMEOUT], 1);
}

/* Requests with a schema have their own limit: past it they are refused,
 * and plain requests are still queued. */
static void test_compiles_have_their_own_queue(void **state) {
    fixture *f = *state;
    sched_config c = base_config(f);
    c.max_queue = 1;
    c.compile_workers = 1;
    c.max_compiles = 2;
    sched *s = open_sched(f, &c);
    ae_error err = {{0}};
    char *a = slow_schema(3), *b = slow_schema(4), *d = slow_schema(5);
    assert_int_equal(submit(f, s, 0, 2, a, 4, &err), SCHED_QUEUED);
    assert_int_equal(submit(f, s, 1, 2, b, 4, &err), SCHED_QUEUED);
    err_clear(&err);
    assert_int_equal(submit(f, s, 2, 2, d, 4, &err), SCHED_BUSY);
    assert_string_equal(err.msg, "2 requests with a response format are compiling or waiting (the target's "
                                 "--max-compiles); retry later");
    err_clear(&err);
    assert_int_equal(submit(f, s, 3, 0, NULL, 2, &err), SCHED_QUEUED);
    wait_last(f, 3);
    assert_int_equal(f->req[3].finish, SCHED_LENGTH);
    /* The plain one ran while both schemas were still compiling. */
    sched_stats st = sched_get_stats(s);
    assert_int_equal(st.compiling, 2);
    assert_true(sched_cancel_id(s, "req-0"));
    assert_true(sched_cancel_id(s, "req-1"));
    wait_last(f, 0);
    wait_last(f, 1);
    st = sched_get_stats(s);
    sched_free(s);
    free(a), free(b), free(d);
    assert_int_equal(f->req[0].finish, SCHED_CANCELLED);
    assert_int_equal(f->req[1].finish, SCHED_CANCELLED);
    /* One ran and was given up on; one never left the queue. */
    assert_int_equal(st.compiles[GCOMPILE_CANCELLED], 1);
    assert_int_equal(st.compiles_dropped, 1);
}

/* Draining (SIGTERM) does not wait for compiles. */
static void test_drain_does_not_wait_for_compiles(void **state) {
    fixture *f = *state;
    sched *s = open_sched(f, NULL);
    ae_error err = {{0}};
    char *a = slow_schema(6), *b = slow_schema(7), *d = slow_schema(8);
    assert_int_equal(submit(f, s, 0, 2, a, 4, &err), SCHED_QUEUED);
    assert_int_equal(submit(f, s, 1, 2, b, 4, &err), SCHED_QUEUED);
    assert_int_equal(submit(f, s, 2, 2, d, 4, &err), SCHED_QUEUED);
    sleep_ms(100);
    int64_t t0 = mono_ms();
    sched_drain(s, 30000);
    int64_t took = mono_ms() - t0;
    sched_free(s);
    free(a), free(b), free(d);
    printf("drained in %lld ms with 3 schemas compiling or queued\n", (long long)took);
    assert_true(took < 1000);
    for (int i = 0; i < 3; i++) assert_int_equal(f->req[i].finish, SCHED_CANCELLED);
}

/* A schema whose masks cost more than the request's budget ends it with
 * the budget named. */
static void test_mask_budget_ends_a_costly_request(void **state) {
    fixture *f = *state;
    sched_config c = base_config(f);
    c.compile_workers = 1;
    c.compile.log_ms = -1;
    c.mask_budget_ms = 1;
    c.mask_ms_per_token = 0.001;
    sched *s = open_sched(f, &c);
    ae_error err = {{0}};
    /* Strings of 64 length ranges: each mask takes milliseconds. */
    char schema[8192];
    size_t n = (size_t)snprintf(schema, sizeof schema, "{\"type\":\"array\",\"items\":{\"anyOf\":[");
    for (int i = 0; i < 64; i++)
        n +=
            (size_t)snprintf(schema + n, sizeof schema - n, "%s{\"type\":\"string\",\"minLength\":%d,\"maxLength\":%d}",
                             i ? "," : "", i, i + 3 + i % 5);
    snprintf(schema + n, sizeof schema - n, "]}}");
    assert_int_equal(submit(f, s, 0, 2, schema, 64, &err), SCHED_QUEUED);
    wait_last(f, 0);
    sched_stats st = sched_get_stats(s);
    sched_free(s);
    printf("%s\n", f->req[0].error);
    assert_int_equal(f->req[0].finish, SCHED_REFUSED);
    assert_non_null(strstr(f->req[0].error, "past their budget of 1 ms + 0.00 ms a position (the target's "
                                            "--mask-budget-ms and --mask-ms-per-token); make the schema smaller or "
                                            "simpler"));
    assert_int_equal(st.mask_budget_spent, 1);
}

int main(void) {
    const struct CMUnitTest plan_tests[] = {
        cmocka_unit_test(test_plan_prefill_takes_chunks_within_the_pass),
        cmocka_unit_test(test_plan_decodes_every_running_choice_in_order),
        cmocka_unit_test(test_plan_trees_fit_the_pass_beside_every_root),
        cmocka_unit_test(test_plan_admission_waits_for_kv_blocks),
        cmocka_unit_test(test_plan_admission_waits_for_sequences_first_come_first_served),
        cmocka_unit_test(test_plan_prefills_the_oldest_prompt_first),
        cmocka_unit_test(test_plan_is_the_same_for_the_same_state),
    };
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json_object_request_compiles_and_runs),
        cmocka_unit_test(test_cancel_gives_up_a_running_compile),
        cmocka_unit_test(test_compile_past_its_budget_is_refused),
        cmocka_unit_test(test_compiles_have_their_own_queue),
        cmocka_unit_test(test_drain_does_not_wait_for_compiles),
        cmocka_unit_test(test_mask_budget_ends_a_costly_request),
    };
    int failed = cmocka_run_group_tests_name("sched_plan_turn", plan_tests, NULL, NULL);
    return failed + cmocka_run_group_tests_name("sched", tests, setup, teardown);
}
