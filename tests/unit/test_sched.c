/* The scheduler (target/sched.h) on the default model, with structured
 * output: the schema compiles (their own queue, workers, time budget,
 * cancellation), and the paths a request takes through them. Run from the
 * repo root after tools/fetch_model.sh. */
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
    engine_config ec = {.max_batch_tokens = 64, .max_seqs = 4, .max_seq_len = 256, .kv_tokens = 1024, .block_size = 16,
                     .threads = 2};
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
    return (sched_config){.max_batch = 4, .max_queue = 8, .chunk = 32, .max_seq_len = 256, .tree_tokens = 1,
                          .eos = f->eos, .grammar = f->gv, .compile_workers = 2, .max_compiles = 8,
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

static sched_refusal submit(fixture *f, sched *s, int i, int32_t format, const char *schema, int32_t max_tokens,
                            ae_error *err) {
    sched_request r = {.prompt = PROMPT, .n_prompt = 10, .max_tokens = max_tokens, .n = 1, .format = format,
                       .schema = schema, .schema_len = schema ? strlen(schema) : 0, .ctx = &f->req[i]};
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
    assert_string_equal(f->req[0].error, "the schema did not compile within 200 ms (the target's --compile-timeout-ms); "
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
        n += (size_t)snprintf(schema + n, sizeof schema - n, "%s{\"type\":\"string\",\"minLength\":%d,\"maxLength\":%d}",
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
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json_object_request_compiles_and_runs),
        cmocka_unit_test(test_cancel_gives_up_a_running_compile),
        cmocka_unit_test(test_compile_past_its_budget_is_refused),
        cmocka_unit_test(test_compiles_have_their_own_queue),
        cmocka_unit_test(test_drain_does_not_wait_for_compiles),
        cmocka_unit_test(test_mask_budget_ends_a_costly_request),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
