/* Tensor parallelism on the CPU backend, on the default model (9 heads, 3
 * kv heads, ffn 1536, Q4_1 layers): shard views land on the exact rows,
 * columns and bytes of the full weights, and R ranks as threads generate
 * the same greedy tokens as one plain forward pass. Run from the repo
 * root. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "../../services/core/pool.h"
#include "../../target/engine.h"
#include "../../target/tp.h"

#define MODEL_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static model *mdl;
static int32_t V;

/* The first 12 ids of test_engine's prompt, "The quick brown fox jumps over
 * the lazy dog. 012", in SmolLM2 ids. */
static const int32_t PROMPT[] = {504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 216, 32};
#define N_PROMPT ((int32_t)(sizeof PROMPT / sizeof PROMPT[0]))
/* Generated tokens: one prefill pass, then N_GEN - 1 decode passes. Under
 * ThreadSanitizer every pass costs about 20 times as much, and what it
 * checks (the ranks' threads and their allreduce) is the same in every
 * pass, so that build takes 6: a prefill and the five decode passes the
 * repeat test compares (24 took 8 of CI's 90 minutes, 10 nearly 3). */
#if defined(__SANITIZE_THREAD__)
#define N_GEN 6
#else
#define N_GEN 24
#endif
#define BLOCK 16
#define N_BLOCKS 4 /* 64 slots >= N_PROMPT + N_GEN */

static int setup(void **state) {
    (void)state;
    if (access(MODEL_PATH, R_OK) != 0) {
        fprintf(stderr, "%s is missing: run `make model`\n", MODEL_PATH);
        return -1;
    }
    ae_error err = {0};
    if (model_load(&mdl, MODEL_PATH, &kn_backend_cpu, &err) != AE_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    V = mdl->cfg.vocab;
    return 0;
}

static int teardown(void **state) {
    (void)state;
    model_free(mdl);
    return 0;
}

/* ---- split and shard views ------------------------------------------------ */

static tp_split plan(int32_t R) {
    tp_split sp;
    ae_error err = {0};
    if (tp_split_plan(&sp, &mdl->cfg, R, &err) != AE_OK) fail_msg("%s", err.msg);
    return sp;
}

static void assert_range(tp_range r, int32_t begin, int32_t end) {
    assert_int_equal(r.begin, begin);
    assert_int_equal(r.end, end);
}

static void test_split_gives_uneven_heads_and_even_ffn(void **state) {
    (void)state;
    tp_split s1 = plan(1), s2 = plan(2), s3 = plan(3);
    assert_int_equal(s1.n_ranks, 1);
    assert_range(s1.kv_heads[0], 0, 3);
    assert_range(s1.heads[0], 0, 9);
    assert_range(s1.ffn[0], 0, 1536);

    assert_int_equal(s2.n_ranks, 2);
    assert_range(s2.kv_heads[0], 0, 2);
    assert_range(s2.kv_heads[1], 2, 3);
    assert_range(s2.heads[0], 0, 6);
    assert_range(s2.heads[1], 6, 9);
    assert_range(s2.ffn[0], 0, 768);
    assert_range(s2.ffn[1], 768, 1536);

    assert_int_equal(s3.n_ranks, 3);
    for (int32_t r = 0; r < 3; r++) {
        assert_range(s3.kv_heads[r], r, r + 1);
        assert_range(s3.heads[r], 3 * r, 3 * r + 3);
        assert_range(s3.ffn[r], 512 * r, 512 * r + 512);
    }
}

static void test_split_refuses_more_ranks_than_kv_heads(void **state) {
    (void)state;
    tp_split sp;
    ae_error err = {0};
    assert_int_equal(tp_split_plan(&sp, &mdl->cfg, 4, &err), AE_ERR);
    assert_string_equal(err.msg, "tensor parallel: 4 ranks but only 3 kv heads; at most 3 ranks");
}

/* Byte offset of a view's data from the full weight's. */
static ptrdiff_t off(const kn_weight *view, const kn_weight *full) {
    return (const uint8_t *)view->data - (const uint8_t *)full->data;
}

/* Expects view = full's rows [r0, r0 + n), every column. */
static void assert_rows_view(const kn_weight *v, const kn_weight *f, int64_t r0, int64_t n) {
    assert_int_equal(v->type, f->type);
    assert_int_equal(v->rows, n);
    assert_int_equal(v->cols, f->cols);
    assert_int_equal(v->row_bytes, f->row_bytes);
    assert_int_equal(off(v, f), r0 * (int64_t)f->row_bytes);
}

/* Expects view = full's columns starting at byte col_off of each row, n
 * wide, every row, the full row stride. */
static void assert_cols_view(const kn_weight *v, const kn_weight *f, int64_t col_off, int64_t n) {
    assert_int_equal(v->type, f->type);
    assert_int_equal(v->rows, f->rows);
    assert_int_equal(v->cols, n);
    assert_int_equal(v->row_bytes, f->row_bytes);
    assert_int_equal(off(v, f), col_off);
}

static model *shard(const tp_split *sp, int32_t rank) {
    model *s = NULL;
    ae_error err = {0};
    if (tp_shard_init(&s, mdl, sp, rank, &err) != AE_OK) fail_msg("%s", err.msg);
    return s;
}

/* Q4_1: 32 weights in 20 bytes. A row of 576 inputs is 360 bytes, of 1536
 * inputs 960 bytes. */
static void test_shard_views_are_exact_slices_of_the_full_weights(void **state) {
    (void)state;
    const model_layer *f = &mdl->layers[7];
    assert_int_equal(f->wq.type, GGML_TYPE_Q4_1);
    assert_int_equal(f->wq.row_bytes, 360);
    assert_int_equal(f->w_down.row_bytes, 960);
    /* per rank: q rows, kv rows, ffn rows, and the byte offsets of the
     * o_proj and down column ranges inside a row */
    struct {
        int32_t R, rank, q0, nq, k0, nk, f0, nf, o_off, d_off;
    } cases[] = {
        {1, 0, 0, 576, 0, 192, 0, 1536, 0, 0},         {2, 0, 0, 384, 0, 128, 0, 768, 0, 0},
        {2, 1, 384, 192, 128, 64, 768, 768, 240, 480}, {3, 0, 0, 192, 0, 64, 0, 512, 0, 0},
        {3, 1, 192, 192, 64, 64, 512, 512, 120, 320},  {3, 2, 384, 192, 128, 64, 1024, 512, 240, 640},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tp_split sp = plan(cases[i].R);
        model *s = shard(&sp, cases[i].rank);
        assert_int_equal(s->cfg.n_heads, cases[i].nq / 64);
        assert_int_equal(s->cfg.n_kv_heads, cases[i].nk / 64);
        assert_int_equal(s->cfg.ffn, cases[i].nf);
        assert_int_equal(s->cfg.hidden, 576);
        assert_int_equal(s->cfg.n_layers, 30);
        assert_ptr_equal(s->tok_embd.data, mdl->tok_embd.data);
        assert_ptr_equal(s->output.data, mdl->output.data);
        assert_ptr_equal(s->output_norm, mdl->output_norm);
        for (int32_t li = 0; li < 30; li += 29) {
            const model_layer *fl = &mdl->layers[li], *l = &s->layers[li];
            assert_ptr_equal(l->attn_norm, fl->attn_norm);
            assert_ptr_equal(l->ffn_norm, fl->ffn_norm);
            assert_rows_view(&l->wq, &fl->wq, cases[i].q0, cases[i].nq);
            assert_rows_view(&l->wk, &fl->wk, cases[i].k0, cases[i].nk);
            assert_rows_view(&l->wv, &fl->wv, cases[i].k0, cases[i].nk);
            assert_rows_view(&l->w_gate, &fl->w_gate, cases[i].f0, cases[i].nf);
            assert_rows_view(&l->w_up, &fl->w_up, cases[i].f0, cases[i].nf);
            assert_cols_view(&l->wo, &fl->wo, cases[i].o_off, cases[i].nq);
            assert_cols_view(&l->w_down, &fl->w_down, cases[i].d_off, cases[i].nf);
        }
        tp_shard_free(s);
    }
}

static void test_shard_refuses_a_column_range_that_splits_a_block(void **state) {
    (void)state;
    tp_split sp = plan(2);
    sp.ffn[0].end = 100;
    sp.ffn[1].begin = 100;
    model *s = NULL;
    ae_error err = {0};
    assert_int_equal(tp_shard_init(&s, mdl, &sp, 1, &err), AE_ERR);
    assert_null(s);
    assert_string_equal(err.msg,
                        "tensor parallel: layer 0 ffn_down: columns [100, 1536) are not whole Q4_1 blocks of 32");
}

/* ---- generation ----------------------------------------------------------- */

typedef struct run_result {
    int32_t tokens[N_GEN];
    float *logits; /* [N_GEN][V]: the logits each generated token came from */
} run_result;

static void run_result_free(run_result *r) {
    if (!r) return;
    free(r->logits);
    free(r);
}

static int32_t argmax(const float *x) {
    int32_t b = 0;
    for (int32_t i = 1; i < V; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* The reference: forward_pass on the full model, one rank, no comm. */
typedef struct plain {
    pool *pool;
    kn_stream *stream;
    forward_ws *ws;
    kn_kv_pool *kv;   /* [n_layers] */
    uint16_t *kv_mem; /* f16 */
} plain;

static void plain_init(plain *p) {
    const model_config *c = &mdl->cfg;
    ae_error err = {0};
    memset(p, 0, sizeof *p);
    if (pool_init(&p->pool, 2, &err) != AE_OK ||
        kn_stream_init(&p->stream, &kn_backend_cpu,
                       &(kn_stream_config){p->pool, forward_stream_workspace(mdl, N_PROMPT, N_PROMPT + N_GEN)},
                       &err) != AE_OK ||
        forward_ws_init(&p->ws, mdl, N_PROMPT, 1, &err) != AE_OK)
        fail_msg("%s", err.msg);
    size_t n = (size_t)N_BLOCKS * BLOCK * (size_t)c->n_kv_heads * (size_t)c->head_dim;
    p->kv_mem = calloc(2 * n * (size_t)c->n_layers, sizeof(uint16_t));
    p->kv = calloc((size_t)c->n_layers, sizeof *p->kv);
    assert_non_null(p->kv_mem);
    assert_non_null(p->kv);
    for (int32_t l = 0; l < c->n_layers; l++)
        p->kv[l] = (kn_kv_pool){p->kv_mem + (size_t)(2 * l) * n,
                                p->kv_mem + (size_t)(2 * l + 1) * n,
                                NULL,
                                N_BLOCKS,
                                BLOCK,
                                c->n_kv_heads,
                                c->head_dim,
                                GGML_TYPE_F16,
                                0.0f};
}

static void plain_free(plain *p) {
    forward_ws_free(p->ws);
    kn_stream_free(p->stream);
    pool_free(p->pool);
    free(p->kv);
    free(p->kv_mem);
}

static tp_group *group_new(int32_t R) {
    tp_config cfg = {.n_ranks = R,
                     .threads_per_rank = 1,
                     .max_tokens = N_PROMPT,
                     .max_logits = 1,
                     .kv_blocks = N_BLOCKS,
                     .block_size = BLOCK};
    tp_group *g = NULL;
    ae_error err = {0};
    if (tp_group_init(&g, mdl, &cfg, &err) != AE_OK) fail_msg("%s", err.msg);
    return g;
}

/* Greedy generation of one sequence: the prompt in one prefill pass, then
 * one token per pass, n_gen tokens (<= N_GEN; the rest of the result stays
 * unset). R = 0 runs the plain reference, R >= 1 a tp_group. */
static run_result *generate(int32_t R, int32_t n_gen) {
    run_result *res = calloc(1, sizeof *res);
    assert_non_null(res);
    res->logits = calloc((size_t)V * N_GEN, sizeof(float));
    assert_non_null(res->logits);
    plain p = {0};
    tp_group *g = NULL;
    if (R == 0)
        plain_init(&p);
    else
        g = group_new(R);

    const int32_t table[N_BLOCKS] = {0, 1, 2, 3};
    int32_t cur[N_PROMPT], pos[N_PROMPT], seq[N_PROMPT], slot[N_PROMPT], n_prefix[N_PROMPT], zero[N_PROMPT];
    memcpy(cur, PROMPT, sizeof PROMPT);
    memset(zero, 0, sizeof zero);
    int32_t len = 0, m = N_PROMPT;
    for (int32_t step = 0; step < n_gen; step++) {
        for (int32_t i = 0; i < m; i++) {
            pos[i] = slot[i] = len + i;
            seq[i] = 0;
            n_prefix[i] = len + i + 1;
        }
        kn_kv_map map = {m, table, 1, N_BLOCKS, seq, slot, n_prefix, zero, zero, NULL, 0, len + m};
        int32_t last = m - 1;
        float *logits = res->logits + (size_t)step * (size_t)V;
        forward_batch b = {m, cur, pos, &map, 1, &last, logits, NULL};
        if (g)
            tp_forward(g, NULL, &b);
        else
            forward_pass(mdl, p.stream, NULL, p.kv, p.ws, &b);
        len += m;
        res->tokens[step] = argmax(logits);
        cur[0] = res->tokens[step];
        m = 1;
    }
    if (g)
        tp_group_free(g);
    else
        plain_free(&p);
    return res;
}

static run_result *reference; /* R = 0, computed once */

static const run_result *get_reference(void) {
    if (!reference) reference = generate(0, N_GEN);
    return reference;
}

/* ||a - b|| / ||b|| over V floats, in double. */
static double rel_l2(const float *a, const float *b) {
    double d = 0, n = 0;
    for (int32_t i = 0; i < V; i++) {
        double e = (double)a[i] - (double)b[i];
        d += e * e;
        n += (double)b[i] * (double)b[i];
    }
    return sqrt(d / n);
}

static void assert_matches_reference(const run_result *got, int32_t R) {
    const run_result *ref = get_reference();
    double worst = 0;
    for (int32_t t = 0; t < N_GEN; t++) {
        double e = rel_l2(got->logits + (size_t)t * (size_t)V, ref->logits + (size_t)t * (size_t)V);
        if (e > worst) worst = e;
    }
    double final = rel_l2(got->logits + (size_t)(N_GEN - 1) * (size_t)V, ref->logits + (size_t)(N_GEN - 1) * (size_t)V);
    print_message("%d ranks vs 1: %d greedy tokens %s, final logits rel L2 %.3g, worst step %.3g\n", R, N_GEN,
                  memcmp(got->tokens, ref->tokens, sizeof ref->tokens) ? "DIFFER" : "identical", final, worst);
    assert_memory_equal(got->tokens, ref->tokens, sizeof ref->tokens);
    /* Ranks add their partial sums in another order than one rank's
     * chain. With f32 activations that moved logits by ~1e-6; rounding x
     * to 15 bits per block for the quantized matmul (kernels.h) turns such
     * last-bit differences into whole rounding steps now and then, which
     * moves logits by a few 1e-4. The tokens must still agree. */
    assert_true(final < 1e-3);
}

/* One rank's shard is the whole model: the prefill pass is bit for bit
 * the plain forward pass. */
static void test_one_rank_group_is_bitwise_the_plain_forward(void **state) {
    (void)state;
    run_result *got = generate(1, 1);
    const run_result *ref = get_reference();
    assert_int_equal(got->tokens[0], ref->tokens[0]);
    assert_memory_equal(got->logits, ref->logits, sizeof(float) * (size_t)V);
    run_result_free(got);
}

static run_result *two_ranks; /* kept for the determinism test */

static void test_two_ranks_generate_the_tokens_of_one_rank(void **state) {
    (void)state;
    run_result_free(two_ranks);
    two_ranks = generate(2, N_GEN);
    assert_matches_reference(two_ranks, 2);
}

static void test_three_ranks_generate_the_tokens_of_one_rank(void **state) {
    (void)state;
    run_result *got = generate(3, N_GEN);
    assert_matches_reference(got, 3);
    run_result_free(got);
}

/* The allreduce adds in rank order, so a repeat gives the same bits (the
 * prefill and the first decode passes; the full run is compared above). */
#define N_REPEAT 6
_Static_assert(N_REPEAT <= N_GEN, "the repeat compares passes the first run made");

static void test_two_ranks_repeat_bit_for_bit(void **state) {
    (void)state;
    if (!two_ranks) two_ranks = generate(2, N_GEN);
    run_result *again = generate(2, N_REPEAT);
    assert_memory_equal(again->tokens, two_ranks->tokens, sizeof(int32_t) * N_REPEAT);
    assert_memory_equal(again->logits, two_ranks->logits, sizeof(float) * (size_t)V * N_REPEAT);
    run_result_free(again);
}

/* ---- ranks inside the engine ---------------------------------------------- */

/* generate() through the engine at R ranks (engine_set_tp; R = 1: none),
 * the prompt in one prefill step, and each step's allreduces against the
 * architecture: two per layer (after the attention output projection and
 * after the MLP down projection), each of the step's tokens x hidden
 * floats; none at one rank. */
static run_result *engine_run(engine *e, int32_t R) {
    const model_config *c = &mdl->cfg;
    ae_error err = {0};
    if (engine_set_tp(e, R, KN_ALLREDUCE_AUTO, NULL, &err) != AE_OK) fail_msg("%s", err.msg);
    assert_int_equal(engine_tp(e), R);
    run_result *res = calloc(1, sizeof *res);
    assert_non_null(res);
    res->logits = calloc((size_t)V * N_GEN, sizeof(float));
    assert_non_null(res->logits);
    int32_t s, cur[N_PROMPT], m = N_PROMPT;
    memcpy(cur, PROMPT, sizeof PROMPT);
    if (engine_seq_new(e, &s, &err) != AE_OK) fail_msg("%s", err.msg);
    for (int32_t step = 0; step < N_GEN; step++) {
        float *logits = res->logits + (size_t)step * (size_t)V;
        engine_item it = {s, ENGINE_APPEND, m, cur, NULL, false};
        if (engine_step(e, &it, 1, &(engine_outputs){.logits = logits}, &err) != AE_OK) fail_msg("%s", err.msg);
        engine_comm_stats cs = engine_get_comm_stats(e);
        uint64_t want = R > 1 ? 2 * (uint64_t)c->n_layers : 0;
        assert_int_equal(cs.last.calls, want);
        assert_int_equal(cs.last.bytes, want * (uint64_t)m * (uint64_t)c->hidden * sizeof(float));
        assert_int_equal(cs.total.calls, want * (uint64_t)(step + 1));
        if (R > 1 && step < 2)
            print_message("%d ranks, a pass of %d tokens: %llu allreduces x %.2f KiB, %.3f ms in them\n", R, m,
                          (unsigned long long)cs.last.calls, (double)cs.last.bytes / (double)cs.last.calls / 1024.0,
                          (double)cs.last.ns / 1e6);
        res->tokens[step] = argmax(logits);
        cur[0] = res->tokens[step];
        m = 1;
    }
    engine_seq_free(e, s);
    return res;
}

static const engine_config engine_cfg = {.max_batch_tokens = N_PROMPT,
                                         .max_seqs = 2,
                                         .max_seq_len = N_BLOCKS * BLOCK,
                                         .kv_tokens = 2 * N_BLOCKS * BLOCK,
                                         .block_size = BLOCK,
                                         .threads = 2};

static run_result *engine_generate(int32_t R) {
    engine *e;
    ae_error err = {0};
    if (engine_init(&e, mdl, &engine_cfg, &err) != AE_OK) fail_msg("%s", err.msg);
    run_result *res = engine_run(e, R);
    engine_free(e);
    return res;
}

/* One rank is the plain forward pass, and R ranks in the engine are the
 * tp_group's R ranks, bit for bit (the thread counts differ: batch
 * invariance); both give the reference's greedy tokens. */
static void test_the_engine_at_one_two_and_three_ranks(void **state) {
    (void)state;
    run_result *one = engine_generate(1);
    assert_memory_equal(one->tokens, get_reference()->tokens, sizeof one->tokens);
    assert_memory_equal(one->logits, get_reference()->logits, sizeof(float) * (size_t)V * N_GEN);
    run_result_free(one);
    if (!two_ranks) two_ranks = generate(2, N_GEN);
    run_result *two = engine_generate(2);
    assert_memory_equal(two->tokens, two_ranks->tokens, sizeof two->tokens);
    assert_memory_equal(two->logits, two_ranks->logits, sizeof(float) * (size_t)V * N_GEN);
    assert_matches_reference(two, 2);
    run_result_free(two);
    run_result *three = engine_generate(3);
    assert_matches_reference(three, 3);
    run_result_free(three);
}

/* One engine set to 2 ranks, back to 1, then 3 (between sequences): each
 * run is what a fresh engine at that many ranks gives, bit for bit, and
 * each setting counts its allreduces from zero (engine_run checks the
 * totals step by step). */
static void test_the_engine_changes_ranks_between_sequences(void **state) {
    (void)state;
    engine *e;
    ae_error err = {0};
    if (engine_init(&e, mdl, &engine_cfg, &err) != AE_OK) fail_msg("%s", err.msg);
    if (!two_ranks) two_ranks = generate(2, N_GEN);
    const run_result *want[3] = {two_ranks, get_reference(), NULL};
    run_result *three = engine_generate(3);
    want[2] = three;
    const int32_t ranks[3] = {2, 1, 3};
    for (int i = 0; i < 3; i++) {
        run_result *got = engine_run(e, ranks[i]);
        assert_memory_equal(got->tokens, want[i]->tokens, sizeof got->tokens);
        assert_memory_equal(got->logits, want[i]->logits, sizeof(float) * (size_t)V * N_GEN);
        run_result_free(got);
    }
    assert_int_equal(engine_set_tp(e, 1, KN_ALLREDUCE_AUTO, NULL, &err), AE_OK);
    engine_comm_stats cs = engine_get_comm_stats(e);
    assert_true(cs.last.calls == 0 && cs.total.calls == 0 && cs.steps == 0);
    run_result_free(three);
    engine_free(e);
}

/* Ranks the model cannot be cut into are refused with the reason, and the
 * engine goes on at one rank; ranks are set before any sequence. */
static void test_the_engine_refuses_ranks_it_cannot_have(void **state) {
    (void)state;
    engine *e;
    ae_error err = {0};
    if (engine_init(&e, mdl, &engine_cfg, &err) != AE_OK) fail_msg("%s", err.msg);
    assert_int_equal(engine_set_tp(e, 4, KN_ALLREDUCE_AUTO, NULL, &err), AE_ERR);
    print_message("4 ranks: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "3 kv heads"));
    assert_int_equal(engine_tp(e), 1);
    err = (ae_error){0};
    assert_int_equal(engine_set_tp(e, 0, KN_ALLREDUCE_AUTO, NULL, &err), AE_ERR);
    assert_string_equal(err.msg, "tensor parallel: 0 ranks (1 to 64)");
    /* the kinds of allreduce: a GPU's are refused on the CPU, the CPU's is taken */
    err = (ae_error){0};
    assert_int_equal(engine_set_tp(e, 2, KN_ALLREDUCE_NCCL, NULL, &err), AE_ERR);
    assert_string_equal(err.msg, "tensor parallel: --allreduce nccl is for ranks on a GPU; the cpu backend's ranks "
                                 "reduce with cpu");
    assert_int_equal(engine_tp(e), 1);
    assert_int_equal(engine_set_tp(e, 2, KN_ALLREDUCE_CPU, NULL, &err), AE_OK);
    assert_int_equal(engine_tp(e), 2);
    assert_int_equal(engine_allreduce(e), KN_ALLREDUCE_CPU);
    assert_string_equal(engine_allreduce_why(e), "");
    assert_int_equal(engine_set_tp(e, 1, KN_ALLREDUCE_AUTO, NULL, &err), AE_OK);
    assert_int_equal(engine_tp(e), 1);
    int32_t s, tok = PROMPT[0];
    float *lg = malloc(sizeof(float) * (size_t)V);
    assert_non_null(lg);
    if (engine_seq_new(e, &s, &err) != AE_OK) fail_msg("%s", err.msg);
    engine_item it = {s, ENGINE_APPEND, 1, &tok, NULL, false};
    assert_int_equal(engine_step(e, &it, 1, &(engine_outputs){.logits = lg}, &err), AE_OK);
    err = (ae_error){0};
    assert_int_equal(engine_set_tp(e, 2, KN_ALLREDUCE_AUTO, NULL, &err), AE_ERR);
    assert_string_equal(err.msg, "tensor parallel: ranks are set before any sequence");
    assert_int_equal(engine_set_tp(e, 1, KN_ALLREDUCE_AUTO, NULL, &err), AE_OK); /* what it has: nothing to do */
    free(lg);
    engine_free(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_split_gives_uneven_heads_and_even_ffn),
        cmocka_unit_test(test_split_refuses_more_ranks_than_kv_heads),
        cmocka_unit_test(test_shard_views_are_exact_slices_of_the_full_weights),
        cmocka_unit_test(test_shard_refuses_a_column_range_that_splits_a_block),
        cmocka_unit_test(test_one_rank_group_is_bitwise_the_plain_forward),
        cmocka_unit_test(test_two_ranks_generate_the_tokens_of_one_rank),
        cmocka_unit_test(test_three_ranks_generate_the_tokens_of_one_rank),
        cmocka_unit_test(test_two_ranks_repeat_bit_for_bit),
        cmocka_unit_test(test_the_engine_at_one_two_and_three_ranks),
        cmocka_unit_test(test_the_engine_changes_ranks_between_sequences),
        cmocka_unit_test(test_the_engine_refuses_ranks_it_cannot_have),
    };
    int rc = cmocka_run_group_tests(tests, setup, teardown);
    run_result_free(reference);
    run_result_free(two_ranks);
    return rc;
}
