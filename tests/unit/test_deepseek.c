/* DeepSeek-V3's layout in the engine (tests/golden/tiny/deepseek, made by
 * tools/gen_tiny_golden.py): its tokens' logits do not depend on the rest
 * of the batch (other sequences, and so other tokens' experts), and
 * speculation drafted by an EAGLE-3 head in the layout published for
 * Kimi-K2.5 (tests/golden/tiny/deepseek_head) is token-identical to plain
 * greedy decoding. Transformers' own outputs are test_tiny_models'. Run
 * from the repo root. */
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
#include "../../services/model/weights.h"
#include "../../target/spec.h"
#include "../spec_run.h"

#define TARGET "tests/golden/tiny/deepseek"
#define HEAD "tests/golden/tiny/deepseek_head"
#define V 256
#define MAX_SEQS 3
#define SEQ_LEN 160
#define CHUNK 16
#define N_PROMPTS 16
#define MAX_PROMPT 40
#define N_GEN 24

static model *load_target(void) {
    model *m;
    ae_error err = {0};
    if (model_load(&m, TARGET, &kn_backend_cpu, &err) != AE_OK) fail_msg("%s", err.msg);
    return m;
}

static engine *new_engine(const model *m) {
    engine_config ec = {128, MAX_SEQS, SEQ_LEN, MAX_SEQS * SEQ_LEN, 16, 2, 0};
    engine *e;
    ae_error err = {0};
    if (engine_init(&e, m, &ec, &err) != AE_OK) fail_msg("%s", err.msg);
    return e;
}

/* Prompt A's 23 tokens prefilled alone, then two decode steps, against
 * the same with prompt B (17 tokens, another sequence) in every pass:
 * each of A's logit rows bit for bit. B's tokens take other experts,
 * which kn_moe_ffn runs beside A's. */
static void a_tokens_logits_do_not_depend_on_the_batch(void **state) {
    (void)state;
    model *m = load_target();
    int32_t a[23], b[17], next[2] = {7, 201};
    for (int i = 0; i < 23; i++) a[i] = (i * 37 + 5) % V;
    for (int i = 0; i < 17; i++) b[i] = (i * 91 + 200) % V;
    float *alone = malloc(sizeof(float) * 25 * V), *mixed = malloc(sizeof(float) * 42 * V);
    assert_non_null(alone);
    assert_non_null(mixed);
    ae_error err = {0};
    engine *e = new_engine(m);
    int32_t sa, sb;
    assert_int_equal(engine_seq_new(e, &sa, &err), AE_OK);
    engine_item it = {sa, ENGINE_APPEND, 23, a, NULL, true};
    assert_int_equal(engine_step(e, &it, 1, &(engine_outputs){.logits = alone}, &err), AE_OK);
    for (int k = 0; k < 2; k++) {
        engine_item d = {sa, ENGINE_APPEND, 1, &next[k], NULL, false};
        assert_int_equal(engine_step(e, &d, 1, &(engine_outputs){.logits = alone + (size_t)(23 + k) * V}, &err), AE_OK);
    }
    engine_free(e);

    e = new_engine(m);
    assert_int_equal(engine_seq_new(e, &sb, &err), AE_OK);
    assert_int_equal(engine_seq_new(e, &sa, &err), AE_OK);
    engine_item two[2] = {{sb, ENGINE_APPEND, 17, b, NULL, true}, {sa, ENGINE_APPEND, 23, a, NULL, true}};
    assert_int_equal(engine_step(e, two, 2, &(engine_outputs){.logits = mixed}, &err), AE_OK);
    assert_memory_equal(mixed + (size_t)17 * V, alone, sizeof(float) * 23 * V);
    for (int k = 0; k < 2; k++) {
        int32_t other = (next[k] + 100) % V;
        engine_item d[2] = {{sb, ENGINE_APPEND, 1, &other, NULL, false}, {sa, ENGINE_APPEND, 1, &next[k], NULL, false}};
        assert_int_equal(engine_step(e, d, 2, &(engine_outputs){.logits = mixed}, &err), AE_OK);
        assert_memory_equal(mixed + V, alone + (size_t)(23 + k) * V, sizeof(float) * V);
    }
    printf("25 rows of prompt A bit-equal alone and beside prompt B (prefill and 2 decodes)\n");
    engine_free(e);
    free(alone);
    free(mixed);
    model_free(m);
}

static const sample_params greedy = {0, 0, 1, 0};

/* A drafter that knows plain greedy's continuation: under each root a
 * chain of its next tokens, 1 to 4 deep in turn, with a wrong sibling
 * beside the first: each step accepts the whole chain, so the latent rows
 * of accepted tree nodes are what later tokens attend to. */
typedef struct oracle {
    const int32_t *truth; /* prompt then continuation */
    int32_t n_truth, fed, calls;
} oracle;

static int oracle_propose(void *ctx, const spec_feed *feeds, int32_t n, const spec_shape *shape, spec_tree *trees,
                          ae_error *err) {
    oracle *o = ctx;
    (void)err;
    (void)shape;
    assert_int_equal(n, 1);
    o->fed = feeds[0].reset ? feeds[0].n : o->fed + feeds[0].n;
    spec_tree *t = &trees[0];
    t->n = 0;
    if (!feeds[0].want_tree) return AE_OK;
    int32_t r = o->fed, depth = 1 + o->calls++ % 4;
    if (r + depth >= o->n_truth) depth = o->n_truth - r - 1;
    if (depth < 1) return AE_OK;
    t->tokens[0] = o->truth[r];
    t->parents[0] = -1;
    t->tokens[1] = (o->truth[r + 1] + 1) % V; /* the wrong sibling */
    t->parents[1] = 0;
    t->n = 2;
    for (int32_t d = 1, prev = 0; d <= depth; d++) {
        t->tokens[t->n] = o->truth[r + d];
        t->parents[t->n] = prev;
        prev = t->n++;
    }
    for (int32_t i = 0; i < t->n; i++) t->probs[i] = 0.5f;
    return AE_OK;
}

static void oracle_release(void *ctx, int32_t seq) {
    (void)ctx;
    (void)seq;
}

/* The head's config names capture layers [1, 2, 3]; its trees are
 * verified by the MLA and MoE layers, and each step's accepted latent
 * rows are kept. Every prompt and tree shape: plain greedy's tokens. */
static void speculation_with_a_published_layout_head_is_plain(void **state) {
    (void)state;
    model *m = load_target();
    engine *e = new_engine(m);
    ae_error err = {0};
    draft_link link;
    drafter_config dc = {MAX_SEQS, SEQ_LEN, CHUNK, 2, engine_pool(e), 0};
    if (draft_link_open(&link, HEAD, model_embedding(m), EAGLE_WEIGHTS_FILE, &dc, &err) != AE_OK)
        fail_msg("%s", err.msg);
    int32_t want[N_PROMPTS][N_GEN], got[N_GEN], ids[MAX_PROMPT];
    for (int i = 0; i < N_PROMPTS; i++) {
        int32_t n = spec_test_prompt(i, V, MAX_PROMPT, 7, ids);
        run_plain_greedy(e, ids, n, CHUNK, N_GEN, want[i]);
    }
    const spec_shape shapes[2] = {{4, 3, 8}, {8, 4, 32}};
    for (int k = 0; k < 2; k++) {
        spec_config sc = spec_config_default(shapes[k], MAX_SEQS, 128);
        if (draft_link_capture(&link, sc.capture, &err) != AE_OK) fail_msg("%s", err.msg);
        assert_int_equal(sc.capture[0], 1);
        assert_int_equal(sc.capture[1], 2);
        assert_int_equal(sc.capture[2], 3);
        spec *s;
        if (spec_init(&s, e, &link.iface, &sc, &err) != AE_OK) fail_msg("%s", err.msg);
        int identical = 0;
        for (int i = 0; i < N_PROMPTS; i++) {
            int32_t n = spec_test_prompt(i, V, MAX_PROMPT, 7, ids);
            run_spec(s, e, ids, n, CHUNK, &greedy, 0, N_GEN, got);
            if (memcmp(got, want[i], sizeof got) == 0)
                identical++;
            else
                fprintf(stderr, "tree %d: prompt %d differs\n", k, i);
        }
        const spec_stats *st = spec_total_stats(s);
        printf("tree %d/%d/%d: %d/%d prompts identical; %lld verify steps, %lld drafted, %lld accepted\n",
               shapes[k].steps, shapes[k].topk, shapes[k].tokens, identical, N_PROMPTS, (long long)st->steps,
               (long long)st->drafted, (long long)st->accepted);
        assert_int_equal(identical, N_PROMPTS);
        assert_true(st->steps > 0 && st->drafted > 0);
        assert_int_equal(st->bad_trees, 0);
        spec_free(s);
    }
    /* The same prompts drafted by an oracle: 1 + 2 + 3 + 4 tokens accepted
     * in each 4 steps. */
    oracle o = {0};
    spec_drafter od = {&o, oracle_propose, oracle_release};
    spec_config sc = spec_config_default((spec_shape){4, 2, 8}, MAX_SEQS, 128);
    sc.capture[0] = 1;
    sc.capture[1] = 2;
    sc.capture[2] = 3;
    spec *s;
    if (spec_init(&s, e, &od, &sc, &err) != AE_OK) fail_msg("%s", err.msg);
    int identical = 0;
    for (int i = 0; i < N_PROMPTS; i++) {
        int32_t n = spec_test_prompt(i, V, MAX_PROMPT, 7, ids), truth[MAX_PROMPT + N_GEN];
        memcpy(truth, ids, sizeof(int32_t) * (size_t)n);
        memcpy(truth + n, want[i], sizeof want[i]);
        o = (oracle){truth, n + N_GEN, 0, 0};
        run_spec(s, e, ids, n, CHUNK, &greedy, 0, N_GEN, got);
        identical += memcmp(got, want[i], sizeof got) == 0;
    }
    const spec_stats *st = spec_total_stats(s);
    printf("oracle: %d/%d prompts identical; %lld verify steps, %lld accepted\n", identical, N_PROMPTS,
           (long long)st->steps, (long long)st->accepted);
    assert_int_equal(identical, N_PROMPTS);
    assert_true(st->accepted >= 2 * st->steps); /* 2.5 a step, less each sequence's last */
    spec_free(s);
    draft_link_close(&link);
    engine_free(e);
    model_free(m);
}

/* Two ranks: each holds the whole latent, 2 of the 4 query heads, and
 * half of every expert's and the shared expert's width (and of the dense
 * layer's). Every prompt gives TP 1's greedy tokens, its first logits
 * within 1e-3 relative L2 of TP 1's; speculation at TP 2 is plain at TP 2
 * bit for bit; a pass makes 2 allreduces a layer. Three ranks cannot cut
 * the shared expert (nor an expert) of 64 in granules of 32. */
static void two_ranks_split_heads_and_experts(void **state) {
    (void)state;
    model *m = load_target();
    engine *one = new_engine(m), *two = new_engine(m);
    ae_error err = {0};
    if (engine_set_tp(two, 2, KN_ALLREDUCE_AUTO, NULL, &err) != AE_OK) fail_msg("%s", err.msg);
    const model *r1 = engine_tp_shard(two, 1);
    assert_int_equal(r1->cfg.n_heads, 2);
    assert_int_equal(r1->cfg.n_kv_heads, 1);
    assert_int_equal(r1->cfg.expert_ffn, 32);
    assert_int_equal(r1->cfg.shared_ffn, 32);
    assert_int_equal(r1->cfg.ffn, 64);
    assert_true(r1->layers[1].experts[0].data == (const char *)m->layers[1].experts[0].data + 32 * 64 * 4);
    int32_t ids[MAX_PROMPT], want[N_GEN], got[N_GEN];
    float *a = malloc(sizeof(float) * V), *b = malloc(sizeof(float) * V);
    assert_non_null(a);
    assert_non_null(b);
    double worst = 0;
    for (int i = 0; i < N_PROMPTS; i++) {
        int32_t n = spec_test_prompt(i, V, MAX_PROMPT, 7, ids), sa, sb;
        run_plain_greedy(one, ids, n, CHUNK, N_GEN, want);
        run_plain_greedy(two, ids, n, CHUNK, N_GEN, got);
        assert_memory_equal(got, want, sizeof got);
        assert_int_equal(engine_seq_new(one, &sa, &err), AE_OK);
        assert_int_equal(engine_seq_new(two, &sb, &err), AE_OK);
        engine_item ia = {sa, ENGINE_APPEND, n, ids, NULL, false}, ib = {sb, ENGINE_APPEND, n, ids, NULL, false};
        assert_int_equal(engine_step(one, &ia, 1, &(engine_outputs){.logits = a}, &err), AE_OK);
        assert_int_equal(engine_step(two, &ib, 1, &(engine_outputs){.logits = b}, &err), AE_OK);
        double num = 0, den = 0;
        for (int v = 0; v < V; v++) num += ((double)a[v] - b[v]) * ((double)a[v] - b[v]), den += (double)a[v] * a[v];
        worst = sqrt(num / den) > worst ? sqrt(num / den) : worst;
        engine_seq_free(one, sa);
        engine_seq_free(two, sb);
    }
    assert_true(worst < 1e-3);
    engine_comm_stats cs = engine_get_comm_stats(two);
    assert_int_equal(cs.last.calls, 2 * 3);
    int32_t truth[MAX_PROMPT + N_GEN];
    oracle o = {0};
    spec_drafter od = {&o, oracle_propose, oracle_release};
    spec_config sc = spec_config_default((spec_shape){4, 2, 8}, MAX_SEQS, 128);
    sc.capture[0] = 1;
    sc.capture[1] = 2;
    sc.capture[2] = 3;
    spec *s;
    if (spec_init(&s, two, &od, &sc, &err) != AE_OK) fail_msg("%s", err.msg);
    for (int i = 0; i < N_PROMPTS; i++) {
        int32_t n = spec_test_prompt(i, V, MAX_PROMPT, 7, ids);
        run_plain_greedy(two, ids, n, CHUNK, N_GEN, want);
        memcpy(truth, ids, sizeof(int32_t) * (size_t)n);
        memcpy(truth + n, want, sizeof want);
        o = (oracle){truth, n + N_GEN, 0, 0};
        run_spec(s, two, ids, n, CHUNK, &greedy, 0, N_GEN, got);
        assert_memory_equal(got, want, sizeof got);
    }
    printf("2 ranks: %d/%d prompts TP 1's greedy tokens, first logits within %.3g rel L2; speculation at 2 ranks "
           "plain at 2 ranks on %d/%d, %lld accepted; %llu allreduces a pass\n",
           N_PROMPTS, N_PROMPTS, worst, N_PROMPTS, N_PROMPTS, (long long)spec_total_stats(s)->accepted,
           (unsigned long long)cs.last.calls);
    spec_free(s);
    engine *three = new_engine(m);
    assert_int_equal(engine_set_tp(three, 3, KN_ALLREDUCE_AUTO, NULL, &err), AE_ERR);
    assert_non_null(
        strstr(err.msg, "the shared experts' width 64 has 2 granules of 32, fewer than 3 ranks; at most 2 ranks"));
    engine_free(three);
    free(a);
    free(b);
    engine_free(two);
    engine_free(one);
    model_free(m);
}

/* Prompt i's last logits and greedy tokens on m at R ranks. */
static void run_model(const model *m, int32_t R, int i, float *logits, int32_t *gen) {
    engine *e = new_engine(m);
    ae_error err = {0};
    if (R > 1 && engine_set_tp(e, R, KN_ALLREDUCE_AUTO, NULL, &err) != AE_OK) fail_msg("%s", err.msg);
    int32_t ids[MAX_PROMPT], s;
    int32_t n = spec_test_prompt(i, V, MAX_PROMPT, 7, ids);
    assert_int_equal(engine_seq_new(e, &s, &err), AE_OK);
    engine_item it = {s, ENGINE_APPEND, n, ids, NULL, false};
    assert_int_equal(engine_step(e, &it, 1, &(engine_outputs){.logits = logits}, &err), AE_OK);
    engine_seq_free(e, s);
    run_plain_greedy(e, ids, n, CHUNK, N_GEN, gen);
    engine_free(e);
}

/* Relative L2 distance of a's rows from b's, dequantized. */
static double weight_distance(const kn_weight *a, const kn_weight *b) {
    assert_true(a->rows == b->rows && a->cols == b->cols);
    float *ra = malloc(sizeof(float) * (size_t)a->cols), *rb = malloc(sizeof(float) * (size_t)b->cols);
    assert_non_null(ra);
    assert_non_null(rb);
    double num = 0, den = 0;
    for (int64_t i = 0; i < a->rows; i++) {
        weights_row_f32(a, i, ra);
        weights_row_f32(b, i, rb);
        for (int64_t j = 0; j < a->cols; j++)
            num += ((double)ra[j] - rb[j]) * ((double)ra[j] - rb[j]), den += (double)rb[j] * rb[j];
    }
    free(ra);
    free(rb);
    return sqrt(num / den);
}

/* llama.cpp's converter at --outtype q8_0 (tools/gen_deepseek_gguf.py):
 * Q8_0 stacked experts, Q8_0 q_b (whose heads' rows are picked into a
 * copy the weights own), F16 attn_k_b. Every matrix as loaded is the f32
 * file's within Q8_0's rounding (1e-2 relative L2; measured 5.7e-3 at
 * worst); the portable kernels give the SIMD ones' bits, so every copy the
 * kernels may read holds the weights; and two ranks give one rank's
 * tokens. (Its outputs are not held to the f32 file's: 0.5% on every
 * weight moves this tiny random model's routers across near ties.) */
static void a_q8_0_gguf_runs_alike_on_every_path(void **state) {
    (void)state;
    model *q8, *f32;
    ae_error err = {0};
    if (model_load(&q8, "tests/golden/tiny/deepseek-q8_0.gguf", &kn_backend_cpu, &err) != AE_OK ||
        model_load(&f32, "tests/golden/tiny/deepseek.gguf", &kn_backend_cpu, &err) != AE_OK)
        fail_msg("%s", err.msg);
    assert_int_equal(q8->layers[1].experts[0].type, GGML_TYPE_Q8_0);
    assert_int_equal(q8->layers[1].wq_nope.type, GGML_TYPE_Q8_0);
    double worst_w = weight_distance(&q8->output, &f32->output);
    for (int32_t l = 0; l < q8->cfg.n_layers; l++) {
        const model_layer *a = &q8->layers[l], *b = &f32->layers[l];
        const kn_weight *wa[] = {&a->wq_a, &a->wq_nope, &a->wq_pe,  &a->wkv_a, &a->wk_pe, &a->w_uk,
                                 &a->w_uv, &a->wo,      &a->w_gate, &a->w_up,  &a->w_down};
        const kn_weight *wb[] = {&b->wq_a, &b->wq_nope, &b->wq_pe,  &b->wkv_a, &b->wk_pe, &b->w_uk,
                                 &b->w_uv, &b->wo,      &b->w_gate, &b->w_up,  &b->w_down};
        for (size_t k = 0; k < sizeof wa / sizeof wa[0]; k++) {
            double d = weight_distance(wa[k], wb[k]);
            worst_w = d > worst_w ? d : worst_w;
        }
        for (int32_t e = 0; a->experts && e < 3 * q8->cfg.route.n_experts; e++) {
            double d = weight_distance(&a->experts[e], &b->experts[e]);
            worst_w = d > worst_w ? d : worst_w;
        }
    }
    assert_true(worst_w < 1e-2);
    float *a = malloc(sizeof(float) * V), *b = malloc(sizeof(float) * V);
    assert_non_null(a);
    assert_non_null(b);
    int32_t ga[N_GEN], gb[N_GEN];
    for (int i = 0; i < N_PROMPTS; i++) {
        run_model(q8, 1, i, a, ga);
        kn_cpu_limit_simd(0);
        run_model(q8, 1, i, b, gb);
        kn_cpu_limit_simd(2);
        assert_memory_equal(a, b, sizeof(float) * V);
        assert_memory_equal(ga, gb, sizeof ga);
        run_model(q8, 2, i, b, gb);
        assert_memory_equal(ga, gb, sizeof ga);
    }
    printf("q8_0 gguf: every matrix within %.3g rel L2 of the f32 file's; portable = SIMD bits and 2 ranks = 1 "
           "rank's tokens on %d/%d prompts\n",
           worst_w, N_PROMPTS, N_PROMPTS);
    free(a);
    free(b);
    model_free(q8);
    model_free(f32);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(a_tokens_logits_do_not_depend_on_the_batch),
        cmocka_unit_test(speculation_with_a_published_layout_head_is_plain),
        cmocka_unit_test(two_ranks_split_heads_and_experts),
        cmocka_unit_test(a_q8_0_gguf_runs_alike_on_every_path),
    };
    return cmocka_run_group_tests_name("deepseek", tests, NULL, NULL);
}
