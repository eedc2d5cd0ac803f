/* Speculative decoding end to end on the tiny fixture
 * (tests/golden/eagle/tiny/, tools/gen_eagle_fixture.py): the target
 * verifies trees drafted by a real EAGLE-3 head, or by test drafters that
 * know the answer, fail, or send garbage. Greedy output must equal plain
 * greedy output token for token in every case. Run from the repo root. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../../draft/draft_link.h"
#include "../../target/spec.h"
#include "../spec_run.h"

#define FIX "tests/golden/eagle/tiny"
#define N_PROMPTS 50
#define MAX_PROMPT 40
#define N_GEN 24
#define SEQ_LEN 160
#define CHUNK 16

typedef struct fixture {
    model *m;
    engine *e;
    draft_link link;
} fixture;

#define MAX_SEQS 4

static void fixture_open(fixture *f) {
    ae_error err = {0};
    memset(f, 0, sizeof *f);
    if (model_load(&f->m, FIX "/target", &kn_backend_cpu, &err) != AE_OK) fail_msg("%s", err.msg);
    engine_config ec = {128, MAX_SEQS, SEQ_LEN, MAX_SEQS * SEQ_LEN, 16, 2, 0};
    if (engine_init(&f->e, f->m, &ec, &err) != AE_OK) fail_msg("%s", err.msg);
    drafter_config dc = {MAX_SEQS, SEQ_LEN, CHUNK, 2, engine_pool(f->e), 0};
    if (draft_link_open(&f->link, FIX "/head", model_embedding(f->m), EAGLE_WEIGHTS_FILE, &dc, &err) != AE_OK)
        fail_msg("%s", err.msg);
}

static void fixture_close(fixture *f) {
    draft_link_close(&f->link);
    engine_free(f->e);
    model_free(f->m);
}

static spec *spec_open(fixture *f, const spec_drafter *d, spec_shape shape) {
    spec_config sc = spec_config_default(shape, MAX_SEQS, 128);
    ae_error err = {0};
    if (draft_link_capture(&f->link, sc.capture, &err) != AE_OK) fail_msg("%s", err.msg);
    spec *s;
    if (spec_init(&s, f->e, d, &sc, &err) != AE_OK) fail_msg("%s", err.msg);
    return s;
}

/* Prompt i: 1..MAX_PROMPT random ids. */
static int32_t prompt(int i, int32_t *ids) { return spec_test_prompt(i, 32, MAX_PROMPT, 7, ids); }

static void plain_greedy(engine *e, const int32_t *ids, int32_t n, int32_t n_gen, int32_t *out) {
    run_plain_greedy(e, ids, n, CHUNK, n_gen, out);
}

static void spec_generate(spec *s, engine *e, const int32_t *ids, int32_t n, const sample_params *sp, uint64_t seed,
                          int32_t n_gen, int32_t *out) {
    run_spec(s, e, ids, n, CHUNK, sp, seed, n_gen, out);
}

static const sample_params greedy = {0, 0, 1, 0};

/* Every prompt and tree shape through the real head: token-identical to
 * plain greedy decoding. */
static void test_greedy_speculation_is_lossless_with_the_fixture_head(void **state) {
    (void)state;
    fixture f;
    fixture_open(&f);
    const spec_shape shapes[4] = {{4, 1, 5}, {4, 3, 8}, {8, 4, 32}, {4, 3, 8}};
    const char *names[4] = {"chain 4x1/5", "wide 4x3/8", "deep 8x4/32", "wide 4x3/8, q8_0 head"};
    int32_t ids[MAX_PROMPT], want[N_PROMPTS][N_GEN], got[N_GEN];
    for (int i = 0; i < N_PROMPTS; i++) {
        int32_t n = prompt(i, ids);
        plain_greedy(f.e, ids, n, N_GEN, want[i]);
    }
    for (int k = 0; k < 4; k++) {
        if (k == 3) { /* the same head rounded to Q8_0: other trees, the same output */
            ae_error err = {0};
            drafter_config dc = {MAX_SEQS, SEQ_LEN, CHUNK, 2, engine_pool(f.e), 0};
            draft_link_close(&f.link);
            if (draft_link_open(&f.link, FIX "/head", model_embedding(f.m), EAGLE_WEIGHTS_Q8_0, &dc, &err) != AE_OK)
                fail_msg("%s", err.msg);
        }
        spec *s = spec_open(&f, &f.link.iface, shapes[k]);
        int identical = 0;
        for (int i = 0; i < N_PROMPTS; i++) {
            int32_t n = prompt(i, ids);
            spec_generate(s, f.e, ids, n, &greedy, 0, N_GEN, got);
            if (memcmp(got, want[i], sizeof got) == 0)
                identical++;
            else
                fprintf(stderr, "%s: prompt %d differs\n", names[k], i);
        }
        const spec_stats *st = spec_total_stats(s);
        printf("%s: %d/%d prompts identical; %lld verify steps, %lld plain, %lld drafted, %lld accepted, "
               "mean acceptance length %.3f\n",
               names[k], identical, N_PROMPTS, (long long)st->steps, (long long)st->plain_steps, (long long)st->drafted,
               (long long)st->accepted, spec_stats_accept_len(st));
        assert_int_equal(identical, N_PROMPTS);
        assert_true(st->steps > 0);
        assert_int_equal(st->bad_trees, 0);
        spec_free(s);
    }
    fixture_close(&f);
}

/* ---- a drafter that knows the answer ----------------------------------- */

/* Proposes, under each root, the true continuation to a depth that cycles
 * 0..5, with a wrong sibling before or after each true node and a wrong
 * child under the last one: every step must accept exactly that depth.
 * It keeps every pair it is fed, to check them against a plain prefill. */
typedef struct oracle {
    const int32_t *truth; /* prompt then plain greedy continuation */
    int32_t n_truth;
    int32_t V, fw;
    int32_t fed; /* pairs fed so far */
    int32_t calls;
    int64_t promised; /* sum of the depths proposed */
    int32_t promised_at[8];
    float *features; /* [n_truth][fw] */
    bool pairs_ok;
} oracle;

static int oracle_propose(void *ctx, const spec_feed *feeds, int32_t n, const spec_shape *shape, spec_tree *trees,
                          ae_error *err) {
    oracle *o = ctx;
    (void)err;
    assert_int_equal(n, 1);
    const spec_feed *f = &feeds[0];
    if (f->reset) o->fed = 0;
    for (int32_t j = 0; j < f->n; j++) {
        if (f->tokens[j] != o->truth[o->fed + 1]) o->pairs_ok = false;
        memcpy(o->features + (size_t)o->fed * (size_t)o->fw, f->features + (size_t)j * (size_t)o->fw,
               (size_t)o->fw * sizeof(float));
        o->fed++;
    }
    trees[0].n = 0;
    if (!f->want_tree) return AE_OK;
    int32_t r = o->fed, depth = o->calls++ % 6;
    if (r + depth + 1 >= o->n_truth) depth = 0;
    spec_tree *t = &trees[0];
    t->n = 1;
    t->tokens[0] = o->truth[r];
    t->parents[0] = -1;
    int32_t prev = 0;
    for (int32_t d = 1; d <= depth + 1; d++) {
        bool wrong_first = (o->calls + d) % 2 == 0, last = d == depth + 1;
        int32_t right = o->truth[r + d], wrong = (right + 1 + d) % o->V;
        for (int pass = 0; pass < 2; pass++) {
            bool put_wrong = (pass == 0) == wrong_first;
            if (!put_wrong && last) continue; /* below the promised depth: only a wrong child */
            t->tokens[t->n] = put_wrong ? wrong : right;
            t->parents[t->n] = prev;
            t->probs[t->n] = 0.5f;
            t->n++;
        }
        if (!last) prev = t->n - (wrong_first ? 1 : 2);
    }
    AE_ASSERT(t->n <= shape->tokens);
    o->promised += depth;
    if (depth > 0) o->promised_at[depth - 1]++;
    return AE_OK;
}

static void test_accepted_paths_are_committed_exactly(void **state) {
    (void)state;
    fixture f;
    fixture_open(&f);
    int32_t ids[MAX_PROMPT], truth[MAX_PROMPT + N_GEN + 8], got[N_GEN];
    int64_t total_promised = 0, total_accepted = 0;
    for (int i = 0; i < N_PROMPTS; i += 7) {
        int32_t n = prompt(i, ids);
        memcpy(truth, ids, (size_t)n * sizeof(int32_t));
        plain_greedy(f.e, ids, n, N_GEN + 8, truth + n);
        oracle o = {truth, n + N_GEN + 8, 32, 3 * 32, 0, 0, 0, {0}, NULL, true};
        o.features = calloc((size_t)o.n_truth * (size_t)o.fw, sizeof(float));
        spec_drafter d = {&o, oracle_propose, NULL};
        spec *s = spec_open(&f, &d, (spec_shape){8, 8, 32});
        spec_generate(s, f.e, ids, n, &greedy, 0, N_GEN, got);
        assert_memory_equal(got, truth + n, sizeof got);
        assert_true(o.pairs_ok);
        const spec_stats *st = spec_total_stats(s);
        /* Every promised depth is accepted, nothing more. */
        assert_int_equal(st->accepted, o.promised);
        for (int dp = 0; dp < 5; dp++) {
            int64_t reached = 0;
            for (int e = dp; e < 8; e++) reached += o.promised_at[e];
            assert_int_equal(st->accepted_at[dp], reached);
        }
        assert_int_equal(st->emitted, st->accepted + st->steps + st->plain_steps);
        total_promised += o.promised;
        total_accepted += st->accepted;
        /* The features the drafter was fed equal a plain prefill's of the
         * committed tokens, bit for bit (batch invariance). */
        int32_t committed = o.fed, seq;
        float *ref = calloc((size_t)committed * (size_t)o.fw, sizeof(float)), lg[32];
        int32_t rows[MAX_PROMPT + N_GEN + 8];
        for (int32_t r = 0; r < committed; r++) rows[r] = r;
        forward_capture cap = {FORWARD_MAX_CAPTURE, {1, 3, 4}, committed, rows, ref};
        ae_error err = {0};
        assert_int_equal(engine_seq_new(f.e, &seq, &err), AE_OK);
        engine_item it = {seq, ENGINE_APPEND, committed, truth, NULL, false};
        assert_int_equal(engine_step(f.e, &it, 1, &(engine_outputs){.logits = lg, .capture = &cap}, &err), AE_OK);
        assert_memory_equal(ref, o.features, (size_t)committed * (size_t)o.fw * sizeof(float));
        engine_seq_free(f.e, seq);
        free(ref);
        free(o.features);
        spec_free(s);
    }
    printf("oracle drafter: %lld tokens promised, %lld accepted\n", (long long)total_promised,
           (long long)total_accepted);
    fixture_close(&f);
}

/* ---- drafters that fail -------------------------------------------------- */

static int failing_propose(void *ctx, const spec_feed *feeds, int32_t n, const spec_shape *shape, spec_tree *trees,
                           ae_error *err) {
    (void)ctx, (void)feeds, (void)n, (void)shape, (void)trees;
    return err_set(err, "drafter unavailable");
}

/* Each call sends a different malformed tree. */
static int garbage_propose(void *ctx, const spec_feed *feeds, int32_t n, const spec_shape *shape, spec_tree *trees,
                           ae_error *err) {
    (void)err;
    int *calls = ctx;
    for (int32_t i = 0; i < n; i++) {
        spec_tree *t = &trees[i];
        if (!feeds[i].want_tree) {
            t->n = 0;
            continue;
        }
        t->n = 3;
        t->tokens[0] = 5, t->tokens[1] = 6, t->tokens[2] = 7;
        t->parents[0] = -1, t->parents[1] = 0, t->parents[2] = 1;
        switch ((*calls)++ % 6) {
        case 0: t->tokens[0] = -1; break;         /* not the root */
        case 1: t->parents[2] = 2; break;         /* its own parent */
        case 2: t->tokens[1] = 32; break;         /* outside the vocabulary */
        case 3: t->parents[0] = 1; break;         /* a root with a parent */
        case 4: t->n = -2; break;                 /* a negative size (-1 is SPEC_STATE_GONE) */
        default: t->n = shape->tokens + 1; break; /* bigger than asked */
        }
    }
    return AE_OK;
}

static void test_a_failing_or_lying_drafter_changes_nothing(void **state) {
    (void)state;
    fixture f;
    fixture_open(&f);
    int calls = 0;
    spec_drafter drafters[2] = {{NULL, failing_propose, NULL}, {&calls, garbage_propose, NULL}};
    int32_t ids[MAX_PROMPT], want[N_GEN], got[N_GEN];
    for (int k = 0; k < 2; k++) {
        spec *s = spec_open(&f, &drafters[k], (spec_shape){4, 3, 8});
        for (int i = 0; i < N_PROMPTS; i += 5) {
            int32_t n = prompt(i, ids);
            plain_greedy(f.e, ids, n, N_GEN, want);
            spec_generate(s, f.e, ids, n, &greedy, 0, N_GEN, got);
            assert_memory_equal(got, want, sizeof got);
        }
        const spec_stats *st = spec_total_stats(s);
        assert_int_equal(st->steps, 0);
        assert_int_equal(st->emitted, st->plain_steps);
        /* The failing drafter is dropped for the sequence at once; the
         * lying one is asked every step and refused every time. */
        if (k == 1)
            assert_int_equal(st->bad_trees, calls);
        else
            assert_int_equal(st->bad_trees, 0);
        spec_free(s);
    }
    assert_true(calls > 40);
    fixture_close(&f);
}

/* The real drafter behind a wrapper that fails one chosen call, or
 * forgets one sequence's state before it (a restarted draft service). */
typedef struct flaky {
    const spec_drafter *real;
    int32_t calls, fail_at, forget_at;
    draft_link *link;
    int32_t gone_at, down_at; /* answers SPEC_STATE_GONE for the sequence, or SPEC_DRAFT_DOWN */
} flaky;

static int flaky_propose(void *ctx, const spec_feed *feeds, int32_t n, const spec_shape *shape, spec_tree *trees,
                         ae_error *err) {
    flaky *fl = ctx;
    int32_t call = fl->calls++;
    if (call == fl->fail_at) return err_set(err, "deadline exceeded");
    if (call == fl->forget_at) drafter_release(fl->link->drafter, feeds[0].seq);
    if (call == fl->down_at) return SPEC_DRAFT_DOWN;
    int rc = fl->real->propose(fl->real->ctx, feeds, n, shape, trees, err);
    if (call == fl->gone_at) trees[0].n = SPEC_STATE_GONE;
    return rc;
}

/* One failed call, or a drafter that lost a sequence's state: decoding
 * goes on plainly for a moment, the sequence is reset at the drafter with
 * its recent pairs, and speculation resumes. Output never changes. */
static void test_speculation_resumes_after_a_drafter_failure(void **state) {
    (void)state;
    fixture f;
    fixture_open(&f);
    int32_t ids[MAX_PROMPT], want[N_GEN], got[N_GEN];
    int32_t n = prompt(20, ids);
    plain_greedy(f.e, ids, n, N_GEN, want);
    for (int k = 0; k < 4; k++) {
        flaky fl = {&f.link.iface, 0, k == 0 ? 4 : -1, k == 1 ? 4 : -1, &f.link, k == 2 ? 4 : -1, k == 3 ? 4 : -1};
        spec_drafter d = {&fl, flaky_propose, NULL};
        spec *s = spec_open(&f, &d, (spec_shape){4, 3, 8});
        spec_generate(s, f.e, ids, n, &greedy, 0, N_GEN, got);
        assert_memory_equal(got, want, sizeof got);
        const spec_stats *st = spec_total_stats(s);
        /* Calls 0 and 1 feed the prompt's 20 pairs (chunks of 16), calls
         * 2 and 3 are steps; call 4 fails (or finds the state gone), so
         * that step and the next (the pause) are plain, and then every
         * step speculates again from a reset. A drafter that answers the
         * sequence is gone (k = 2) costs that one step: the next call
         * resets it, no pause. A link that is down (k = 3) pauses one step
         * without backing off. */
        assert_int_equal(st->draft_failures, k == 2 ? 0 : 1);
        assert_int_equal(st->state_gone, k == 2 ? 1 : 0);
        assert_int_equal(st->plain_steps, k == 2 ? 1 : 2);
        assert_int_equal(st->steps + st->plain_steps + st->accepted, st->emitted);
        assert_true(st->steps >= 10);
        spec_free(s);
    }
    fixture_close(&f);
}

static void test_speculation_needs_a_batch_token_for_every_root(void **state) {
    (void)state;
    fixture f;
    fixture_open(&f);
    spec_config sc = spec_config_default((spec_shape){4, 3, 8}, MAX_SEQS, 128);
    sc.capture[0] = 1;
    sc.capture[1] = 3;
    sc.capture[2] = 4;
    engine_config ec = {MAX_SEQS - 1, MAX_SEQS, SEQ_LEN, MAX_SEQS * SEQ_LEN, 16, 1, 0};
    engine *small;
    spec *s = (spec *)1;
    ae_error err = {0};
    assert_int_equal(engine_init(&small, f.m, &ec, &err), AE_OK);
    sc.max_batch_tokens = MAX_SEQS - 1;
    assert_int_equal(spec_init(&s, small, &f.link.iface, &sc, &err), AE_ERR);
    assert_null(s);
    assert_string_equal(err.msg, "speculation: 3 batch tokens cannot hold a root for each of 4 sequences");
    engine_free(small);
    fixture_close(&f);
}

/* Sampling with a seed: the same tokens run to run, other seeds other
 * tokens. */
static void test_sampled_speculation_is_reproducible_by_seed(void **state) {
    (void)state;
    fixture f;
    fixture_open(&f);
    spec *s = spec_open(&f, &f.link.iface, (spec_shape){4, 3, 8});
    sample_params sp = {0.9f, 20, 0.95f, 0};
    int32_t ids[MAX_PROMPT], a[N_GEN], b[N_GEN], c[N_GEN];
    int32_t n = prompt(3, ids);
    spec_generate(s, f.e, ids, n, &sp, 7, N_GEN, a);
    spec_generate(s, f.e, ids, n, &sp, 7, N_GEN, b);
    assert_memory_equal(a, b, sizeof a);
    int differ = 0;
    for (uint64_t seed = 8; seed < 12; seed++) {
        spec_generate(s, f.e, ids, n, &sp, seed, N_GEN, c);
        differ += memcmp(a, c, sizeof a) != 0;
    }
    assert_int_equal(differ, 4);
    assert_true(spec_total_stats(s)->accepted > 0);
    spec_free(s);
    fixture_close(&f);
}

/* Sampling parameters the sampled tests cycle through: filters on and
 * off, cool and hot. */
static const sample_params sampled[3] = {{0.9f, 20, 0.95f, 0}, {0.7f, 0, 1, 0}, {1.3f, 0, 1, 0.05f}};

/* A seeded sampled sequence is its plain output, token for token, with
 * the real head at every tree shape and with no drafter at all: the draw
 * at a position does not depend on the tree. */
static void test_sampled_speculation_is_the_plain_output_for_any_tree(void **state) {
    (void)state;
    fixture f;
    fixture_open(&f);
    const spec_shape shapes[3] = {{4, 1, 5}, {4, 3, 8}, {8, 4, 32}};
    int32_t ids[MAX_PROMPT], want[N_GEN], got[N_GEN];
    int64_t accepted = 0;
    for (int k = 0; k < 4; k++) {
        spec *s = spec_open(&f, k < 3 ? &f.link.iface : NULL, shapes[k < 3 ? k : 0]);
        int identical = 0, runs = 0;
        for (int i = 0; i < N_PROMPTS; i += 5) {
            int32_t n = prompt(i, ids);
            const sample_params *sp = &sampled[i % 3];
            run_plain_sampled(f.e, ids, n, CHUNK, sp, 100 + (uint64_t)i, N_GEN, want);
            spec_generate(s, f.e, ids, n, sp, 100 + (uint64_t)i, N_GEN, got);
            runs++;
            if (memcmp(got, want, sizeof got) == 0) identical++;
        }
        printf("tree %d: %d/%d sampled runs identical to plain, %lld accepted\n", k, identical, runs,
               (long long)spec_total_stats(s)->accepted);
        assert_int_equal(identical, runs);
        accepted += spec_total_stats(s)->accepted;
        spec_free(s);
    }
    assert_true(accepted > 0);
    fixture_close(&f);
}

/* At two tensor-parallel ranks (engine_set_tp) the target's output moves
 * from one rank's (partial sums are added in another order), but at that
 * degree speculation is still lossless: greedy and seeded sampled output
 * equal plain output at two ranks, token for token, through trees whose
 * rows are committed in both ranks' KV shards. */
static void test_speculation_at_two_ranks_is_plain_at_two_ranks(void **state) {
    (void)state;
    fixture f;
    fixture_open(&f);
    ae_error err = {0};
    if (engine_set_tp(f.e, 2, KN_ALLREDUCE_AUTO, NULL, &err) != AE_OK) fail_msg("%s", err.msg);
    const spec_shape shapes[2] = {{4, 1, 5}, {8, 4, 32}};
    int32_t ids[MAX_PROMPT], want[N_GEN], got[N_GEN];
    for (int k = 0; k < 2; k++) {
        spec *s = spec_open(&f, &f.link.iface, shapes[k]);
        int identical = 0, runs = 0;
        for (int i = 0; i < N_PROMPTS; i += 5) {
            int32_t n = prompt(i, ids);
            const sample_params *sp = i % 2 ? &sampled[i % 3] : &greedy;
            run_plain_sampled(f.e, ids, n, CHUNK, sp, 300 + (uint64_t)i, N_GEN, want);
            spec_generate(s, f.e, ids, n, sp, 300 + (uint64_t)i, N_GEN, got);
            runs++;
            if (memcmp(got, want, sizeof got) == 0) identical++;
        }
        const spec_stats *st = spec_total_stats(s);
        engine_comm_stats cs = engine_get_comm_stats(f.e);
        printf("2 ranks, tree %d: %d/%d runs identical to plain; %lld accepted; the last pass, of %d tokens: "
               "%llu allreduces x %llu bytes\n",
               k, identical, runs, (long long)st->accepted, cs.last_tokens, (unsigned long long)cs.last.calls,
               (unsigned long long)(cs.last.calls ? cs.last.bytes / cs.last.calls : 0));
        assert_int_equal(identical, runs);
        assert_true(st->accepted > 0);
        assert_int_equal(cs.last.calls, 2 * engine_model(f.e)->cfg.n_layers);
        spec_free(s);
    }
    fixture_close(&f);
}

/* The oracle above, proposing the plain sampled continuation: every
 * promised depth is accepted and nothing more, so a child is accepted
 * exactly when it is the target's own draw. */
static void test_an_oracle_of_the_sampled_continuation_is_accepted_exactly(void **state) {
    (void)state;
    fixture f;
    fixture_open(&f);
    int32_t ids[MAX_PROMPT], truth[MAX_PROMPT + N_GEN + 8], got[N_GEN];
    for (int i = 0; i < N_PROMPTS; i += 7) {
        int32_t n = prompt(i, ids);
        const sample_params *sp = &sampled[i % 3];
        memcpy(truth, ids, (size_t)n * sizeof(int32_t));
        run_plain_sampled(f.e, ids, n, CHUNK, sp, 7 + (uint64_t)i, N_GEN + 8, truth + n);
        oracle o = {truth, n + N_GEN + 8, 32, 3 * 32, 0, 0, 0, {0}, NULL, true};
        o.features = calloc((size_t)o.n_truth * (size_t)o.fw, sizeof(float));
        spec_drafter d = {&o, oracle_propose, NULL};
        spec *s = spec_open(&f, &d, (spec_shape){8, 8, 32});
        spec_generate(s, f.e, ids, n, sp, 7 + (uint64_t)i, N_GEN, got);
        assert_memory_equal(got, truth + n, sizeof got);
        assert_int_equal(spec_total_stats(s)->accepted, o.promised);
        assert_true(o.promised > 0);
        free(o.features);
        spec_free(s);
    }
    fixture_close(&f);
}

/* Sequences with different parameters in one step (greedy and sampled,
 * each sampled one with its own seed), leaving the batch at different
 * lengths: every one gets its plain output. */
static void test_sampled_sequences_batched_together_each_get_their_plain_output(void **state) {
    (void)state;
    fixture f;
    fixture_open(&f);
    spec *s = spec_open(&f, &f.link.iface, (spec_shape){4, 3, 8});
    ae_error err = {0};
    const sample_params *params[MAX_SEQS] = {&sampled[0], &greedy, &sampled[1], &sampled[2]};
    int32_t ids[MAX_SEQS][MAX_PROMPT], n[MAX_SEQS], want[MAX_SEQS][N_GEN], got[MAX_SEQS][N_GEN], seq[MAX_SEQS];
    int32_t n_got[MAX_SEQS] = {0}, limit[MAX_SEQS];
    sample_rng rng[MAX_SEQS];
    for (int i = 0; i < MAX_SEQS; i++) {
        n[i] = prompt(13 * i + 2, ids[i]);
        limit[i] = N_GEN - 4 * ((i + 1) % MAX_SEQS);
        run_plain_sampled(f.e, ids[i], n[i], CHUNK, params[i], 40 + (uint64_t)i, N_GEN, want[i]);
        sample_rng_seed(&rng[i], 40 + (uint64_t)i);
        assert_int_equal(engine_seq_new(f.e, &seq[i], &err), AE_OK);
        assert_int_equal(spec_seq_start(s, seq[i], ids[i], n[i], CHUNK, &err), AE_OK);
    }
    for (;;) {
        spec_in in[MAX_SEQS];
        spec_out o[MAX_SEQS];
        int32_t who[MAX_SEQS], m = 0;
        for (int i = 0; i < MAX_SEQS; i++)
            if (n_got[i] < limit[i]) {
                who[m] = i;
                in[m++] = (spec_in){.seq = seq[i], .params = params[i], .rng = &rng[i]};
            }
        if (m == 0) break;
        if (spec_step(s, in, m, o, &err) != AE_OK) fail_msg("%s", err.msg);
        for (int32_t j = 0; j < m; j++)
            for (int32_t k = 0; k < o[j].n && n_got[who[j]] < limit[who[j]]; k++)
                got[who[j]][n_got[who[j]]++] = o[j].tokens[k];
    }
    for (int i = 0; i < MAX_SEQS; i++) {
        assert_memory_equal(got[i], want[i], (size_t)limit[i] * sizeof(int32_t));
        spec_seq_end(s, seq[i]);
        engine_seq_free(f.e, seq[i]);
    }
    assert_true(spec_total_stats(s)->accepted > 0);
    spec_free(s);
    fixture_close(&f);
}

/* One prompt prefilled once and forked into MAX_SEQS choices (OpenAI's
 * n), each with its own key (seed, choice): every choice gets the plain
 * output of its key, the forks draft from their first step on (the
 * drafter's state was forked too), and the KV blocks of the prompt are
 * shared. */
static void test_forked_choices_each_get_their_plain_output(void **state) {
    (void)state;
    fixture f;
    fixture_open(&f);
    spec *s = spec_open(&f, &f.link.iface, (spec_shape){4, 3, 8});
    ae_error err = {0};
    int32_t ids[MAX_PROMPT], n = prompt(31, ids), want[MAX_SEQS][N_GEN], got[MAX_SEQS][N_GEN], seq[MAX_SEQS];
    int32_t n_got[MAX_SEQS] = {0};
    sample_rng rng[MAX_SEQS];
    sample_state *smp;
    assert_int_equal(sample_init(&smp, 32, &err), AE_OK);
    for (int c = 0; c < MAX_SEQS; c++) {
        /* plain decoding of choice c */
        rng[c] = (sample_rng){.seed = 77, .choice = (uint32_t)c};
        float lg[32];
        int32_t q;
        assert_int_equal(engine_seq_new(f.e, &q, &err), AE_OK);
        engine_item it = {q, ENGINE_APPEND, n, ids, NULL, false};
        assert_int_equal(engine_step(f.e, &it, 1, &(engine_outputs){.logits = lg}, &err), AE_OK);
        for (int32_t g = 0; g < N_GEN; g++) {
            want[c][g] = sample_token(smp, lg, &sampled[1], &rng[c], n + g);
            engine_item d = {q, ENGINE_APPEND, 1, &want[c][g], NULL, false};
            assert_int_equal(engine_step(f.e, &d, 1, &(engine_outputs){.logits = lg}, &err), AE_OK);
        }
        engine_seq_free(f.e, q);
    }
    assert_true(memcmp(want[0], want[1], sizeof want[0]) != 0); /* the keys differ */
    assert_int_equal(engine_seq_new(f.e, &seq[0], &err), AE_OK);
    assert_int_equal(spec_seq_start(s, seq[0], ids, n, CHUNK, &err), AE_OK);
    int32_t used = engine_kv_stats(f.e).blocks_used;
    for (int c = 1; c < MAX_SEQS; c++) {
        assert_int_equal(engine_seq_fork(f.e, seq[0], &seq[c], &err), AE_OK);
        assert_int_equal(spec_seq_fork(s, seq[0], seq[c], &err), AE_OK);
    }
    /* Only the block being filled is copied. */
    int32_t per_fork = (n - 1) % 16 ? 1 : 0;
    assert_int_equal(engine_kv_stats(f.e).blocks_used, used + (MAX_SEQS - 1) * per_fork);
    for (int step = 0;; step++) {
        spec_in in[MAX_SEQS];
        spec_out o[MAX_SEQS];
        int32_t m = 0;
        for (int c = 0; c < MAX_SEQS; c++)
            if (n_got[c] < N_GEN) in[m++] = (spec_in){.seq = seq[c], .params = &sampled[1], .rng = &rng[c]};
        if (m == 0) break;
        if (spec_step(s, in, m, o, &err) != AE_OK) fail_msg("%s", err.msg);
        for (int32_t j = 0; j < m; j++) {
            int c = 0;
            while (seq[c] != in[j].seq) c++;
            if (step == 0) assert_true(o[j].drafted > 0); /* every choice drafted at once */
            for (int32_t k = 0; k < o[j].n && n_got[c] < N_GEN; k++) got[c][n_got[c]++] = o[j].tokens[k];
        }
    }
    for (int c = 0; c < MAX_SEQS; c++) {
        assert_memory_equal(got[c], want[c], sizeof got[c]);
        assert_true(spec_seq_stats(s, seq[c])->steps > 0);
        assert_int_equal(spec_seq_stats(s, seq[c])->bad_trees, 0);
        spec_seq_end(s, seq[c]);
        engine_seq_free(f.e, seq[c]);
    }
    assert_int_equal(spec_total_stats(s)->state_gone, 0);
    assert_int_equal(spec_total_stats(s)->draft_failures, 0);
    assert_int_equal(engine_kv_stats(f.e).blocks_used, 0);
    sample_free(smp);
    spec_free(s);
    fixture_close(&f);
}

/* Several sequences in one step, each with its own tree: every one gets
 * its plain output; sequences leave the batch as they finish, at
 * different lengths. Per-sequence statistics add up to the total. */
static void test_sequences_batched_together_each_get_their_plain_output(void **state) {
    (void)state;
    fixture f;
    fixture_open(&f);
    spec *s = spec_open(&f, &f.link.iface, (spec_shape){4, 3, 8});
    ae_error err = {0};
    int32_t ids[MAX_SEQS][MAX_PROMPT], n[MAX_SEQS], want[MAX_SEQS][N_GEN], got[MAX_SEQS][N_GEN], seq[MAX_SEQS];
    int32_t n_got[MAX_SEQS] = {0}, limit[MAX_SEQS];
    sample_rng rng[MAX_SEQS];
    for (int i = 0; i < MAX_SEQS; i++) {
        n[i] = prompt(11 * i + 1, ids[i]);
        limit[i] = N_GEN - 5 * i;
        plain_greedy(f.e, ids[i], n[i], N_GEN, want[i]);
    }
    for (int i = 0; i < MAX_SEQS; i++) {
        sample_rng_seed(&rng[i], (uint64_t)i);
        assert_int_equal(engine_seq_new(f.e, &seq[i], &err), AE_OK);
        assert_int_equal(spec_seq_start(s, seq[i], ids[i], n[i], CHUNK, &err), AE_OK);
    }
    int steps = 0;
    for (;;) {
        spec_in in[MAX_SEQS];
        spec_out o[MAX_SEQS];
        int32_t who[MAX_SEQS], m = 0;
        for (int i = 0; i < MAX_SEQS; i++)
            if (n_got[i] < limit[i]) {
                who[m] = i;
                in[m++] = (spec_in){.seq = seq[i], .params = &greedy, .rng = &rng[i]};
            }
        if (m == 0) break;
        if (spec_step(s, in, m, o, &err) != AE_OK) fail_msg("%s", err.msg);
        steps++;
        for (int32_t j = 0; j < m; j++)
            for (int32_t k = 0; k < o[j].n && n_got[who[j]] < limit[who[j]]; k++)
                got[who[j]][n_got[who[j]]++] = o[j].tokens[k];
    }
    spec_stats sum = {0};
    for (int i = 0; i < MAX_SEQS; i++) {
        assert_memory_equal(got[i], want[i], (size_t)limit[i] * sizeof(int32_t));
        const spec_stats *st = spec_seq_stats(s, seq[i]);
        sum.steps += st->steps;
        sum.accepted += st->accepted;
        sum.emitted += st->emitted;
        spec_seq_end(s, seq[i]);
        engine_seq_free(f.e, seq[i]);
    }
    const spec_stats *total = spec_total_stats(s);
    assert_int_equal(sum.steps, total->steps);
    assert_int_equal(sum.accepted, total->accepted);
    assert_int_equal(sum.emitted, total->emitted);
    assert_true(steps < N_GEN); /* one step served all sequences at once */
    printf("%d sequences, %d steps, %lld accepted\n", MAX_SEQS, steps, (long long)total->accepted);
    spec_free(s);
    fixture_close(&f);
}

/* ---- adaptive speculation ------------------------------------------------ */

/* A drafter that costs `cost` units of the test's clock per call, around
 * the real fixture head. The clock moves one unit per reading besides,
 * and `verify` more at the reading that ends a step's pass (the third
 * of the step: before the drafter, after it, after the verify pass;
 * readings that time feeding the drafter come after those, and the count
 * starts again at each step), so a step's pass costs 1 + verify units
 * whatever its size. */
typedef struct costly {
    const spec_drafter *real;
    int64_t clock, cost, verify, reads;
    int64_t resets, feed_calls; /* feeds that reset a sequence; calls that asked for no tree */
} costly;

static costly last_costly; /* the drafter of the last adaptive_run_with, for its counts */

static int costly_propose(void *ctx, const spec_feed *feeds, int32_t n, const spec_shape *shape, spec_tree *trees,
                          ae_error *err) {
    costly *c = ctx;
    c->clock += c->cost;
    bool any_tree = false;
    for (int32_t i = 0; i < n; i++) {
        c->resets += feeds[i].reset;
        any_tree |= feeds[i].want_tree;
    }
    c->feed_calls += !any_tree;
    return c->real->propose(c->real->ctx, feeds, n, shape, trees, err);
}

static void costly_release(void *ctx, int32_t seq) {
    costly *c = ctx;
    c->real->release(c->real->ctx, seq);
}

static int64_t test_clock(void *ctx) {
    costly *c = ctx;
    c->clock += 1 + (c->reads++ % 3 == 2 ? c->verify : 0);
    return c->clock;
}

/* `steps` adaptive steps of one sequence with a drafter costing `cost`,
 * decoding with sp (seed 0); greedy tokens must be plain greedy's. The
 * tokens go to out[*n_out] when out is given. Returns the totals. */
static spec_stats adaptive_run_with(int64_t cost, int64_t verify, int32_t steps, const sample_params *sp, int32_t *out,
                                    int32_t *n_out) {
    enum { LEN = 256 };
    fixture f;
    fixture_open(&f);
    ae_error err = {0};
    engine *e;
    engine_config ec = {128, 1, LEN, LEN, 16, 2, 0};
    if (engine_init(&e, f.m, &ec, &err) != AE_OK) fail_msg("%s", err.msg);
    draft_link link;
    drafter_config dc = {1, LEN, CHUNK, 2, engine_pool(e), 0};
    if (draft_link_open(&link, FIX "/head", model_embedding(f.m), EAGLE_WEIGHTS_FILE, &dc, &err) != AE_OK)
        fail_msg("%s", err.msg);
    costly c = {&link.iface, 0, cost, verify, 0, 0, 0};
    spec_drafter d = {&c, costly_propose, costly_release};
    /* A chain of one drafted token: at most 2 tokens a step, so the
     * sequence stays inside the fixture's 256 positions. */
    spec_config sc = spec_config_default((spec_shape){1, 1, 2}, 1, 128);
    sc.adaptive = true;
    sc.clock_ns = test_clock;
    sc.clock_ctx = &c;
    if (draft_link_capture(&link, sc.capture, &err) != AE_OK) fail_msg("%s", err.msg);
    spec *s;
    if (spec_init(&s, e, &d, &sc, &err) != AE_OK) fail_msg("%s", err.msg);
    int32_t ids[] = {3, 17, 5, 28, 9}, n = 5, got[LEN], want[LEN], n_got = 0, seq;
    assert_int_equal(engine_seq_new(e, &seq, &err), AE_OK);
    assert_int_equal(spec_seq_start(s, seq, ids, n, CHUNK, &err), AE_OK);
    sample_rng rng;
    sample_rng_seed(&rng, 0);
    for (int32_t k = 0; k < steps; k++) {
        spec_in in = {.seq = seq, .params = sp, .rng = &rng};
        spec_out o;
        c.reads = 0;
        if (spec_step(s, &in, 1, &o, &err) != AE_OK) fail_msg("%s", err.msg);
        for (int32_t j = 0; j < o.n; j++) got[n_got++] = o.tokens[j];
    }
    spec_seq_end(s, seq);
    engine_seq_free(e, seq);
    if (sample_is_greedy(sp)) {
        plain_greedy(e, ids, n, n_got, want);
        assert_memory_equal(got, want, (size_t)n_got * sizeof(int32_t));
    }
    if (out) {
        memcpy(out, got, (size_t)n_got * sizeof(int32_t));
        *n_out = n_got;
    }
    spec_stats st = *spec_total_stats(s);
    last_costly = c;
    spec_free(s);
    draft_link_close(&link);
    engine_free(e);
    fixture_close(&f);
    return st;
}

static spec_stats adaptive_run(int64_t cost, int64_t verify, int32_t steps) {
    return adaptive_run_with(cost, verify, steps, &greedy, NULL, NULL);
}

/* With the shape bounded by a chain of one token, the policy settles in
 * SETTLE steps (6 plain, 12 drafting: target/policy.c's schedule, which
 * drops the stages that repeat that chain). A drafter that costs 1000
 * units against a 11-unit pass can never pay: from then on the steps are
 * plain. Probes are paid from 2% of the steps and 2% of the time, and a
 * probe of 2 steps of that drafter (about 2 x 1012 units) takes 2% of
 * plain's 11 units some 9,000 steps to earn: none in these 200. Nor can a
 * drafter that costs nothing pay when its tokens are never accepted (the
 * fixture's head on these prompts): a drafted step gives one token and
 * costs a unit more; its probes, about 2 x 13 units, are paid for by the
 * step budget's 100 steps, so one comes in 200. (Which trees do pay:
 * tests/unit/test_policy.c.) The output is plain greedy's either way
 * (adaptive_run_with). */
static void test_the_policy_runs_plainly_while_drafting_loses(void **state) {
    (void)state;
    enum { SETTLE = 18, STEPS = SETTLE + 200 };
    spec_stats lose = adaptive_run(1000, 10, STEPS);
    printf("losing drafter: %lld speculative steps of %d, %lld plain, %lld exploring, switched off %lld times\n",
           (long long)lose.steps, STEPS, (long long)lose.plain_steps, (long long)lose.explore_steps,
           (long long)lose.adapt_off);
    assert_int_equal(lose.steps, 12);
    assert_int_equal(lose.plain_steps, STEPS - lose.steps);
    assert_int_equal(lose.adapt_plain_steps, lose.plain_steps);
    assert_int_equal(lose.explore_steps, SETTLE);
    /* What exploring cost, by the test's clock: each settling step's
     * three readings (2 units) and its pass (10), and for the 12 drafting
     * ones the drafter's 1000 too. Feeding outside steps: the prompt's
     * one call, 1000 units and the reading after it. */
    assert_int_equal(lose.explore_ns, 6 * 12 + 12 * 1012);
    assert_int_equal(lose.feed_ns, 1001);
    assert_int_equal(lose.adapt_off, 0); /* it never chose to draft */
    /* Far from paying, the drafter is left stale: after the prompt, no
     * call feeds it without asking for a tree. */
    assert_int_equal(last_costly.feed_calls, 1);
    spec_stats useless = adaptive_run(0, 100, STEPS);
    printf("useless drafter: %lld speculative steps of %d, %lld exploring; %lld feeding calls, %lld resets\n",
           (long long)useless.steps, STEPS, (long long)useless.explore_steps, (long long)last_costly.feed_calls,
           (long long)last_costly.resets);
    /* Near paying (a tree at 99% of plain's rate: policy_keep_drafter),
     * the drafter is kept in step through the plain steps: fed every
     * SPEC_FEED_AT (32) of them, so it is reset only once, by the prompt,
     * and the probes find it holding the whole sequence. */
    assert_int_equal(last_costly.resets, 1);
    assert_true(last_costly.feed_calls >= 1 + 5);
    assert_int_equal(useless.accepted, 0);
    assert_int_equal(useless.steps, 12 + 2 * (200 / 102));
    assert_int_equal(useless.explore_steps, SETTLE + 2 * (200 / 102));
}

/* Sampled sequences follow the policy too: the losing drafter that greedy
 * decoding drops is dropped for them the same way, and a seed gives the
 * same tokens whatever the clock made the policy choose (draws keyed by
 * seed and position, sample.h). 100 steps after settling: at most 2
 * tokens a step stays inside the fixture's 256 positions. */
static void test_sampled_sequences_follow_the_policy(void **state) {
    (void)state;
    enum { SETTLE = 18, STEPS = SETTLE + 100 };
    const sample_params warm = {0.8f, 0, 1, 0};
    int32_t a[2 * STEPS], b[2 * STEPS], na = 0, nb = 0;
    spec_stats lose = adaptive_run_with(1000, 10, STEPS, &warm, a, &na);
    printf("sampled, losing drafter: %lld speculative steps of %d, %lld exploring\n", (long long)lose.steps, STEPS,
           (long long)lose.explore_steps);
    spec_stats greedy_lose = adaptive_run(1000, 10, STEPS); /* the same choices, step for step */
    assert_int_equal(lose.steps, greedy_lose.steps);
    assert_int_equal(lose.explore_steps, greedy_lose.explore_steps);
    assert_int_equal(lose.steps, 12); /* settling only: no probe is paid for yet (above) */
    spec_stats free_ = adaptive_run_with(0, 100, STEPS, &warm, b, &nb); /* drafting costs nothing */
    printf("sampled, free drafter: %lld speculative steps, %lld accepted\n", (long long)free_.steps,
           (long long)free_.accepted);
    assert_true(free_.steps > lose.steps);
    /* The same number of steps; accepted tokens make one run longer. */
    assert_int_equal(nb - na, free_.accepted - lose.accepted);
    assert_memory_equal(a, b, (size_t)na * sizeof(int32_t));
}

static void test_a_step_on_an_unstarted_sequence_fails(void **state) {
    (void)state;
    fixture f;
    fixture_open(&f);
    spec *s = spec_open(&f, &f.link.iface, (spec_shape){4, 3, 8});
    sample_rng rng;
    sample_rng_seed(&rng, 1);
    spec_in in = {.seq = 0, .params = &greedy, .rng = &rng};
    spec_out o;
    ae_error err = {0};
    assert_int_equal(spec_step(s, &in, 1, &o, &err), AE_ERR);
    assert_string_equal(err.msg, "item 0: sequence 0 was not started");
    spec_free(s);
    fixture_close(&f);
}

/* spec_config_default is the one place the defaults live: the shape and
 * limits given, three capture layers left for the caller, no adaptation,
 * the monotonic clock. */
static void test_spec_config_default_names_every_field(void **state) {
    (void)state;
    spec_config sc = spec_config_default((spec_shape){4, 3, 8}, 6, 96);
    assert_int_equal(sc.n_capture, 3);
    for (int i = 0; i < FORWARD_MAX_CAPTURE; i++) assert_int_equal(sc.capture[i], 0);
    assert_int_equal(sc.shape.steps, 4);
    assert_int_equal(sc.shape.topk, 3);
    assert_int_equal(sc.shape.tokens, 8);
    assert_int_equal(sc.max_seqs, 6);
    assert_int_equal(sc.max_batch_tokens, 96);
    assert_false(sc.adaptive);
    assert_null(sc.clock_ns);
    assert_null(sc.clock_ctx);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_spec_config_default_names_every_field),
        cmocka_unit_test(test_greedy_speculation_is_lossless_with_the_fixture_head),
        cmocka_unit_test(test_accepted_paths_are_committed_exactly),
        cmocka_unit_test(test_a_failing_or_lying_drafter_changes_nothing),
        cmocka_unit_test(test_sampled_speculation_is_reproducible_by_seed),
        cmocka_unit_test(test_sequences_batched_together_each_get_their_plain_output),
        cmocka_unit_test(test_sampled_speculation_is_the_plain_output_for_any_tree),
        cmocka_unit_test(test_speculation_at_two_ranks_is_plain_at_two_ranks),
        cmocka_unit_test(test_an_oracle_of_the_sampled_continuation_is_accepted_exactly),
        cmocka_unit_test(test_sampled_sequences_batched_together_each_get_their_plain_output),
        cmocka_unit_test(test_forked_choices_each_get_their_plain_output),
        cmocka_unit_test(test_speculation_resumes_after_a_drafter_failure),
        cmocka_unit_test(test_speculation_needs_a_batch_token_for_every_root),
        cmocka_unit_test(test_a_step_on_an_unstarted_sequence_fails),
        cmocka_unit_test(test_the_policy_runs_plainly_while_drafting_loses),
        cmocka_unit_test(test_sampled_sequences_follow_the_policy),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
