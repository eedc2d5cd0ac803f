/* Speculative decoding with the target on the CUDA backend (kernels on
 * the CPU shim here, on a GPU in tests/gpu/run.sh): the tiny fixture of
 * tests/golden/eagle/tiny, its EAGLE-3 head drafting on the CPU (with its
 * own copy of the embedding table, as the draft service has) and on
 * CUDA, the target verifying on CUDA; and a drafter that knows the
 * answer, so that most of each tree is accepted and the verify path is
 * the one taken. Because the CUDA kernels are batch invariant, greedy
 * speculative output must equal plain greedy output on CUDA token for
 * token, for a chain and for wide trees; and plain output on CUDA must
 * equal the CPU backend's.
 *
 * The head on CUDA drafts the trees the CPU drafts, bit for bit, through
 * chunked feeds, forks and several rounds (tests/draft_rounds.h). On a
 * GPU the softmax's expf is the device's (kn_cuda.h), so there the
 * probabilities are held to 1e-5 of the CPU's instead; on the shim it is
 * the host's, as the CPU's.
 *
 * At two tensor-parallel ranks (engine.h engine_set_tp) the CUDA engine's
 * ranks reduce with the custom allreduce (or $AERIE_TEST_ALLREDUCE: nccl
 * on a GPU) and the CPU engine's with its own, both in rank order: every
 * logit of a prefill and of a decode is the CPU's bits, plain output is
 * the CPU's at two ranks, speculative output equals it, and both count
 * the same allreduces, 2 a layer a pass. Run from the repo root. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include <cmocka.h>

#include "../../draft/draft_link.h"
#include "../../target/spec.h"
#include "../draft_rounds.h"
#include "../spec_run.h"
#include "cuda_open.h"

#define FIX "tests/golden/eagle/tiny"
#define N_PROMPTS 8
#define MAX_PROMPT 40
#define N_GEN 16
#define SEQ_LEN 160
#define CHUNK 16
#define MAX_SEQS 2

static const kn_backend *CU;

static int setup(void **state) {
    (void)state;
    return cuda_open_or_say(&CU);
}

/* The drafter that knows: the sequence's whole greedy stream (prompt ++
 * plain output), and under each root the next 4 tokens of it, each with a
 * wrong sibling (the true token + 1) before it. The root is the token at
 * position start + n of the stream (EAGLE-3 pairs feature i with token
 * i + 1). */
typedef struct knows {
    int32_t stream[MAX_PROMPT + N_GEN];
    int32_t len, vocab;
    int64_t trees;
} knows;

static int knows_propose(void *ctx, const spec_feed *feeds, int32_t n, const spec_shape *shape, spec_tree *trees,
                         ae_error *err) {
    (void)err, (void)shape;
    knows *k = ctx;
    for (int32_t f = 0; f < n; f++) {
        spec_tree *t = &trees[f];
        t->n = 0;
        int32_t at = feeds[f].start + feeds[f].n;
        if (!feeds[f].want_tree || feeds[f].n == 0) continue;
        assert_int_equal(feeds[f].tokens[feeds[f].n - 1], k->stream[at]);
        *t = (spec_tree){.n = 1, .tokens = {k->stream[at]}, .parents = {-1}, .probs = {1.0f}};
        int32_t parent = 0;
        for (int32_t d = 1; d <= 4 && at + d < k->len; d++) {
            int32_t right = k->stream[at + d];
            t->tokens[t->n] = (right + 1) % k->vocab, t->parents[t->n] = parent, t->probs[t->n++] = 0.5f;
            t->tokens[t->n] = right, t->parents[t->n] = parent, t->probs[t->n++] = 0.5f;
            parent = t->n - 1;
        }
        k->trees++;
    }
    return AE_OK;
}

static void knows_release(void *ctx, int32_t seq) { (void)ctx, (void)seq; }

static void the_head_drafts_the_same_trees_on_cuda(void **state) {
    (void)state;
#ifdef KN_TEST_GPU
    draft_rounds_on(CU, "cuda", 1e-5f); /* the device's expf in the softmax */
#else
    draft_rounds_on(CU, "cuda", 0.0f);
#endif
}

static engine *new_engine(const model *m) {
    engine_config ec = {128, MAX_SEQS, SEQ_LEN, MAX_SEQS * SEQ_LEN, 16, 2, 0};
    engine *e;
    ae_error err = {{0}};
    if (engine_init(&e, m, &ec, &err) != AE_OK) fail_msg("%s", err.msg);
    return e;
}

/* The fixture's target on the CPU backend and on CUDA. */
static void load_target(model **m_cpu, model **m_cu) {
    ae_error err = {{0}};
    if (model_load(m_cpu, FIX "/target", &kn_backend_cpu, &err) != AE_OK ||
        model_load(m_cu, FIX "/target", CU, &err) != AE_OK)
        fail_msg("%s", err.msg);
}

static void greedy_speculation_on_cuda_is_plain_decoding(void **state) {
    (void)state;
    ae_error err = {{0}};
    model *m_cpu, *m_cu;
    load_target(&m_cpu, &m_cu);
    engine *e_cpu = new_engine(m_cpu), *e_cu = new_engine(m_cu);
    draft_link link, link_cu;
    drafter_config dc = {MAX_SEQS, SEQ_LEN, CHUNK, 2, NULL, 0};
    if (draft_link_open(&link, FIX "/head", model_embedding(m_cpu), EAGLE_WEIGHTS_FILE, &dc, &err) != AE_OK ||
        draft_link_open(&link_cu, FIX "/head", model_embedding(m_cu), EAGLE_WEIGHTS_FILE, &dc, &err) != AE_OK)
        fail_msg("%s", err.msg);
    static const sample_params greedy = {0, 0, 1, 0};
    const spec_shape shapes[2] = {{4, 1, 5}, {4, 3, 8}};
    int32_t ids[MAX_PROMPT], want[N_PROMPTS][N_GEN], got[N_GEN];
    for (int i = 0; i < N_PROMPTS; i++) {
        int32_t n = spec_test_prompt(i, 32, MAX_PROMPT, 7, ids);
        run_plain_greedy(e_cpu, ids, n, CHUNK, N_GEN, want[i]);
        run_plain_greedy(e_cu, ids, n, CHUNK, N_GEN, got);
        assert_memory_equal(got, want[i], sizeof got);
    }
    knows kn = {.vocab = m_cpu->cfg.vocab};
    spec_drafter knower = {.ctx = &kn, .propose = knows_propose, .release = knows_release};
    const spec_drafter *drafters[4] = {&link.iface, &link.iface, &link_cu.iface, &knower};
    const char *names[4] = {"the head, chain 4/1/5", "the head, tree 4/3/8", "the head on cuda, tree 4/3/8",
                            "a drafter that knows, tree 4/2/9"};
    const spec_shape shape_of[4] = {shapes[0], shapes[1], shapes[1], {4, 2, 9}};
    spec_stats on_cpu = {0};
    (void)on_cpu; /* read only off a GPU */
    /* Then again with the CUDA engine's steps as graphs (engine.h): the
     * verify trees of each shape replayed with new tokens and new tree
     * masks, and the plain decode beside them. */
    for (int k = 0; k < 6; k++) {
        bool graphs = k >= 4;
        if (k == 4) engine_set_graphs(e_cu, 16, 0);
        int d = graphs ? (k == 4 ? 1 : 3) : k;
        spec_config sc = spec_config_default(shape_of[d], MAX_SEQS, 128);
        spec *s;
        if (draft_link_capture(&link, sc.capture, &err) != AE_OK ||
            spec_init(&s, e_cu, drafters[d], &sc, &err) != AE_OK)
            fail_msg("%s", err.msg);
        int identical = 0;
        int64_t chunks = 0; /* prompt chunks: run op by op */
        engine_graph_stats g0 = engine_get_graph_stats(e_cu);
        for (int i = 0; i < N_PROMPTS; i++) {
            int32_t n = spec_test_prompt(i, 32, MAX_PROMPT, 7, ids);
            memcpy(kn.stream, ids, sizeof(int32_t) * (size_t)n);
            memcpy(kn.stream + n, want[i], sizeof want[i]);
            kn.len = n + N_GEN;
            run_spec(s, e_cu, ids, n, CHUNK, &greedy, 0, N_GEN, got);
            identical += memcmp(got, want[i], sizeof got) == 0;
            for (int32_t at = 0; at < n; at += CHUNK) chunks += 2 * (n - at > 1); /* a chunk of 1 is a decode step */
            if (graphs) {
                run_plain_greedy(e_cu, ids, n, CHUNK, N_GEN, got);
                identical += memcmp(got, want[i], sizeof got) == 0;
            }
        }
        const spec_stats *st = spec_total_stats(s);
        engine_graph_stats g1 = engine_get_graph_stats(e_cu);
        printf("%s on cuda%s: %d/%d prompts identical to plain; %lld verify steps, %lld drafted, %lld accepted\n",
               names[d], graphs ? " with graphs" : "", identical, graphs ? 2 * N_PROMPTS : N_PROMPTS,
               (long long)st->steps, (long long)st->drafted, (long long)st->accepted);
        assert_int_equal(identical, graphs ? 2 * N_PROMPTS : N_PROMPTS);
        assert_true(st->steps > 0 && st->accepted > 0);
        if (graphs) {
            printf("  graphs: %lld captured, %lld replayed, %lld steps op by op\n",
                   (long long)(g1.captures - g0.captures), (long long)(g1.replays - g0.replays),
                   (long long)(g1.eager_steps - g0.eager_steps));
            /* Each prompt's chunks of more than one token (in the
             * speculative run and the plain one) run op by op, and every
             * other step is a graph. */
            assert_int_equal(g1.eager_steps - g0.eager_steps, chunks);
            assert_true(g1.replays - g0.replays > st->steps);
        }
        if (k == 1) on_cpu = *st;
#ifndef KN_TEST_GPU /* there the probabilities may differ in the last bit, and a near-tie with them */
        if (k == 2) /* the same trees, so the same steps */
            assert_true(st->steps == on_cpu.steps && st->drafted == on_cpu.drafted && st->accepted == on_cpu.accepted);
        if (k == 4) /* graphs change no bit, so no step */
            assert_true(st->steps == on_cpu.steps && st->drafted == on_cpu.drafted && st->accepted == on_cpu.accepted);
#endif
        if (d == 3) assert_true(st->accepted * 2 > st->steps * 3); /* most of each chain of 4 */
        spec_free(s);
    }
    /* Sampled, with graphs: the target draws each node's token on the
     * device (kn_sample) and only the ids come back; the speculative
     * output must be the host sampler's plain output on the CPU backend,
     * for the same seed, token for token. */
    static const sample_params sampled[2] = {{0.8f, 0, 1.0f, 0.0f}, {1.0f, 5, 1.0f, 0.05f}};
    assert_true(engine_can_sample(e_cu));
    {
        /* Draws need ids to write the tokens to: without, the step fails
         * before it runs, and is not counted as drawn. */
        int32_t sq, one = 1;
        if (engine_seq_new(e_cu, &sq, &err) != AE_OK) fail_msg("%s", err.msg);
        kn_draw dr;
        memset(&dr, 0, sizeof dr);
        int64_t before = engine_drawn_steps(e_cu);
        engine_item it = {sq, ENGINE_APPEND, 1, &one, NULL, false};
        assert_int_equal(engine_step(e_cu, &it, 1, &(engine_outputs){.draws = &dr}, &err), AE_ERR);
        assert_string_equal(err.msg, "a step with draws needs ids for the tokens drawn");
        assert_int_equal(engine_drawn_steps(e_cu), before);
        assert_int_equal(engine_seq_len(e_cu, sq), 0);
        engine_seq_free(e_cu, sq);
        err_clear(&err);
    }
    for (int c = 0; c < 2; c++) {
        spec_config sc = spec_config_default(shapes[1], MAX_SEQS, 128);
        spec *s;
        if (draft_link_capture(&link, sc.capture, &err) != AE_OK ||
            spec_init(&s, e_cu, &link_cu.iface, &sc, &err) != AE_OK)
            fail_msg("%s", err.msg);
        int64_t drawn0 = engine_drawn_steps(e_cu);
        int identical = 0;
        for (int i = 0; i < N_PROMPTS; i++) {
            int32_t n = spec_test_prompt(i, 32, MAX_PROMPT, 7, ids), plain[N_GEN];
            run_plain_sampled(e_cpu, ids, n, CHUNK, &sampled[c], 77 + (uint64_t)i, N_GEN, plain);
            run_spec(s, e_cu, ids, n, CHUNK, &sampled[c], 77 + (uint64_t)i, N_GEN, got);
            identical += memcmp(got, plain, sizeof got) == 0;
        }
        const spec_stats *st = spec_total_stats(s);
        int64_t drawn = engine_drawn_steps(e_cu) - drawn0;
        printf("sampled (temperature %.1f, top-k %d, min-p %.2f), the head on cuda, tree 4/3/8, drawn on cuda: "
               "%d/%d prompts identical to the cpu's plain sampling; %lld verify steps, %lld drawn on the device, "
               "%lld accepted\n",
               (double)sampled[c].temperature, sampled[c].top_k, (double)sampled[c].min_p, identical, N_PROMPTS,
               (long long)st->steps, (long long)drawn, (long long)st->accepted);
        assert_int_equal(drawn, st->steps + st->plain_steps); /* every step, drafted or not */
#ifdef KN_TEST_GPU /* the device's expf: a draw within its last bit of a bound may differ, and the text after it */
        assert_true(identical >= N_PROMPTS - 1);
#else
        assert_int_equal(identical, N_PROMPTS);
#endif
        spec_free(s);
    }
    draft_link_close(&link_cu);
    draft_link_close(&link);
    engine_free(e_cu);
    engine_free(e_cpu);
    model_free(m_cu);
    model_free(m_cpu);
}

/* The kind the CUDA engine's ranks use. */
static kn_allreduce cuda_allreduce(void) {
    const char *env = getenv("AERIE_TEST_ALLREDUCE");
    int k = env && env[0] ? kn_allreduce_parse(env) : KN_ALLREDUCE_CUSTOM;
    if (k < 0) fail_msg("AERIE_TEST_ALLREDUCE=%s: not a kind", env);
    return (kn_allreduce)k;
}

/* n logits of the CPU's ranks and the CUDA ranks': the same bits on the
 * shim; on a GPU (rope's cos and sin from the device's libm, kn_cuda.h)
 * within 1e-5 relative L2, as test_cuda_model holds them. */
static void same_logits(const float *cpu, const float *cu, size_t n) {
#ifdef KN_TEST_GPU
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)cpu[i] - cu[i];
        num += d * d;
        den += (double)cpu[i] * cpu[i];
    }
    if (!(num <= 1e-10 * den)) fail_msg("logits differ from the cpu ranks': rel L2 %.3g", sqrt(num / den));
#else
    assert_memory_equal(cpu, cu, n * sizeof(float));
#endif
}

/* A prefill of 20 tokens with every row's logits, then a decode step, on
 * both engines: the same logits (same_logits). */
static void prefill_and_decode_match(engine *e_cpu, engine *e_cu) {
    ae_error err = {{0}};
    const int32_t V = engine_model(e_cpu)->cfg.vocab;
    int32_t ids[MAX_PROMPT], n = 0;
    for (int i = 0; i < N_PROMPTS && n < 21; i++) n = spec_test_prompt(i, 32, MAX_PROMPT, 7, ids);
    assert_true(n >= 21);
    float *lg[2] = {malloc(sizeof(float) * 20 * (size_t)V), malloc(sizeof(float) * 20 * (size_t)V)};
    engine *e[2] = {e_cpu, e_cu};
    int32_t seq[2];
    for (int k = 0; k < 2; k++) {
        assert_int_equal(engine_seq_new(e[k], &seq[k], &err), AE_OK);
        engine_item it = {seq[k], ENGINE_APPEND, 20, ids, NULL, true};
        assert_int_equal(engine_step(e[k], &it, 1, &(engine_outputs){.logits = lg[k]}, &err), AE_OK);
    }
    same_logits(lg[0], lg[1], 20 * (size_t)V);
    for (int k = 0; k < 2; k++) {
        engine_item it = {seq[k], ENGINE_APPEND, 1, &ids[20], NULL, false};
        assert_int_equal(engine_step(e[k], &it, 1, &(engine_outputs){.logits = lg[k]}, &err), AE_OK);
        engine_seq_free(e[k], seq[k]);
    }
    same_logits(lg[0], lg[1], (size_t)V);
    free(lg[0]);
    free(lg[1]);
}

/* Plain greedy output of each test prompt on e_cpu and on e_cu, which must
 * be the same (into want), then speculative output on e_cu with the
 * fixture's head drafting on the CPU, tree 4/3/8: the prompts whose
 * output is identical to plain, and the speculation's figures in *st. */
static int plain_then_speculative(engine *e_cpu, engine *e_cu, const model *m_cpu, int32_t want[N_PROMPTS][N_GEN],
                                  spec_stats *st) {
    ae_error err = {{0}};
    int32_t ids[MAX_PROMPT], got[N_GEN];
    for (int i = 0; i < N_PROMPTS; i++) {
        int32_t n = spec_test_prompt(i, 32, MAX_PROMPT, 7, ids);
        run_plain_greedy(e_cpu, ids, n, CHUNK, N_GEN, want[i]);
        run_plain_greedy(e_cu, ids, n, CHUNK, N_GEN, got);
        assert_memory_equal(got, want[i], sizeof got);
    }
    draft_link link;
    drafter_config dc = {MAX_SEQS, SEQ_LEN, CHUNK, 2, NULL, 0};
    if (draft_link_open(&link, FIX "/head", model_embedding(m_cpu), EAGLE_WEIGHTS_FILE, &dc, &err) != AE_OK)
        fail_msg("%s", err.msg);
    static const sample_params greedy = {0, 0, 1, 0};
    spec_config sc = spec_config_default((spec_shape){4, 3, 8}, MAX_SEQS, 128);
    spec *s;
    if (draft_link_capture(&link, sc.capture, &err) != AE_OK || spec_init(&s, e_cu, &link.iface, &sc, &err) != AE_OK)
        fail_msg("%s", err.msg);
    int identical = 0;
    for (int i = 0; i < N_PROMPTS; i++) {
        int32_t n = spec_test_prompt(i, 32, MAX_PROMPT, 7, ids);
        run_spec(s, e_cu, ids, n, CHUNK, &greedy, 0, N_GEN, got);
        identical += memcmp(got, want[i], sizeof got) == 0;
    }
    *st = *spec_total_stats(s);
    spec_free(s);
    draft_link_close(&link);
    return identical;
}

static void ranks_on_cuda_give_the_cpu_ranks_bits(void **state) {
    (void)state;
    ae_error err = {{0}};
    model *m_cpu, *m_cu;
    load_target(&m_cpu, &m_cu);
    engine *e_cpu = new_engine(m_cpu), *e_cu = new_engine(m_cu);
    const kn_allreduce kind = cuda_allreduce();
    if (engine_set_tp(e_cpu, 2, KN_ALLREDUCE_CPU, NULL, &err) != AE_OK ||
        engine_set_tp(e_cu, 2, kind, NULL, &err) != AE_OK)
        fail_msg("--tp 2: %s", err.msg);
    assert_int_equal(engine_allreduce(e_cu), kind);
    engine_set_graphs(e_cu, 16, 0); /* asked for, and off while ranks run */
    const int32_t L = m_cpu->cfg.n_layers;
    /* one prefill of 20 tokens with every row's logits, then a decode
     * step: the bits of both */
    int32_t want[N_PROMPTS][N_GEN];
    prefill_and_decode_match(e_cpu, e_cu);
    spec_stats stats;
    const spec_stats *st = &stats;
    int identical = plain_then_speculative(e_cpu, e_cu, m_cpu, want, &stats);
    engine_comm_stats c0 = engine_get_comm_stats(e_cpu), c1 = engine_get_comm_stats(e_cu);
    engine_graph_stats gs = engine_get_graph_stats(e_cu);
    printf("two ranks on cuda, allreduce %s: prefill and decode logits bit-equal to two cpu ranks; plain output "
           "identical on %d/%d prompts; speculative (the head, tree 4/3/8) identical to plain on %d/%d, %lld verify "
           "steps, %lld accepted; %llu allreduces in %lld passes (cpu ranks: %llu in %lld), %llu bytes; graphs "
           "captured %lld\n",
           kn_allreduce_name(kind), N_PROMPTS, N_PROMPTS, identical, N_PROMPTS, (long long)st->steps,
           (long long)st->accepted, (unsigned long long)c1.total.calls, (long long)c1.steps,
           (unsigned long long)c0.total.calls, (long long)c0.steps, (unsigned long long)c1.total.bytes,
           (long long)gs.captures);
    assert_int_equal(identical, N_PROMPTS);
    assert_true(st->steps > 0 && st->accepted > 0);
    assert_int_equal(c0.total.calls, (uint64_t)2 * (uint64_t)L * (uint64_t)c0.steps);
    assert_int_equal(c1.total.calls, (uint64_t)2 * (uint64_t)L * (uint64_t)c1.steps);
    assert_true(c1.total.ns > 0);
    assert_int_equal(gs.captures + gs.replays, 0);
    /* back at one rank, the graphs asked for are on again */
    assert_int_equal(engine_set_tp(e_cu, 1, KN_ALLREDUCE_AUTO, NULL, &err), AE_OK);
    assert_int_equal(engine_get_graph_stats(e_cu).max_graphs, 16);
    /* auto: custom measured; NCCL is not in the shim, and the log says so */
    engine_free(e_cu);
    e_cu = new_engine(m_cu);
    if (engine_set_tp(e_cu, 2, KN_ALLREDUCE_AUTO, NULL, &err) != AE_OK) fail_msg("--tp 2: %s", err.msg);
    printf("auto: %s\n", engine_allreduce_why(e_cu));
#ifndef KN_TEST_GPU
    assert_int_equal(engine_allreduce(e_cu), KN_ALLREDUCE_CUSTOM);
    assert_non_null(strstr(engine_allreduce_why(e_cu), "nccl not measured (cuda comm: nccl: the CPU shim has no NCCL"));
#endif
    /* the CPU's kind is refused on CUDA */
    engine_free(e_cu);
    e_cu = new_engine(m_cu);
    err.msg[0] = '\0';
    assert_int_equal(engine_set_tp(e_cu, 2, KN_ALLREDUCE_CPU, NULL, &err), AE_ERR);
    assert_string_equal(err.msg, "tensor parallel: --allreduce cpu is for ranks on the CPU; the cuda backend's ranks "
                                 "reduce with nccl or custom");
    engine_free(e_cu);
    engine_free(e_cpu);
    model_free(m_cu);
    model_free(m_cpu);
}

/* Two ranks on two devices (the shim's AERIE_SHIM_DEVICES=2; on a GPU
 * machine cuda:0 and cuda:1 where it has them): rank 1's shard copied to
 * cuda:1 with its kv heads' KV, reading the step's inputs from cuda:0 by
 * peer access. The bits are the CPU ranks' again, and speculation is
 * still plain output. Without peer access, the ranks are refused with
 * the reason. */
static void ranks_on_two_devices_give_the_cpu_ranks_bits(void **state) {
    (void)state;
#ifndef KN_TEST_GPU
    setenv("AERIE_SHIM_DEVICES", "2", 1);
#endif
    const kn_backend *cu1;
    kn_device_info info;
    ae_error err = {{0}};
    if (kn_cuda_open(1, &cu1, &info, &err) != AE_OK) {
        printf("two devices: skipped (%s)\n", err.msg); /* one GPU on the lent machine */
        skip();                                         /* reported as skipped, not passed */
    }
    assert_true(cu1 != CU);
    model *m_cpu, *m_cu;
    load_target(&m_cpu, &m_cu);
    engine *e_cpu = new_engine(m_cpu), *e_cu = new_engine(m_cu);
    const kn_backend *bes[2] = {CU, cu1};
    const kn_allreduce kind = cuda_allreduce();
    if (engine_set_tp(e_cpu, 2, KN_ALLREDUCE_CPU, NULL, &err) != AE_OK ||
        engine_set_tp(e_cu, 2, kind, bes, &err) != AE_OK)
        fail_msg("--tp 2: %s", err.msg);
    assert_true(engine_tp_backend(e_cu, 0) == CU && engine_tp_backend(e_cu, 1) == cu1);
    assert_int_equal(engine_tp_copied_bytes(e_cu, 0), 0);
    /* rank 1's matrices (q, k, v, o, gate, up, down of each layer, its
     * part) and the embedding table, f32 */
    const model_config *c = &m_cpu->cfg;
    assert_true(c->n_heads == 4 && c->n_kv_heads == 2 && m_cpu->layers[0].wq.type == GGML_TYPE_F32);
    uint64_t D = (uint64_t)c->head_dim, H = (uint64_t)c->hidden, F = (uint64_t)c->ffn / 2;
    /* wq and wo: 2 heads x D by H; wk and wv: 1 kv head; gate, up, down: F by H; 4 bytes each */
    uint64_t per_layer = (2 * (2 * D * H) + 2 * (D * H) + 3 * F * H) * 4;
    uint64_t want = (uint64_t)c->n_layers * per_layer + (uint64_t)c->vocab * H * 4;
    printf("two devices: rank 1 copied %llu bytes to cuda:1 (computed %llu)\n",
           (unsigned long long)engine_tp_copied_bytes(e_cu, 1), (unsigned long long)want);
    assert_int_equal(engine_tp_copied_bytes(e_cu, 1), want);
    int32_t want_ids[N_PROMPTS][N_GEN];
    prefill_and_decode_match(e_cpu, e_cu);
    /* speculation: verify trees, forks and commits move both devices' KV rows */
    spec_stats st;
    int identical = plain_then_speculative(e_cpu, e_cu, m_cpu, want_ids, &st);
    printf("two devices, allreduce %s: prefill logits bit-equal to two cpu ranks, plain output identical on %d/%d, "
           "speculative identical to plain on %d/%d (%lld verify steps)\n",
           kn_allreduce_name(kind), N_PROMPTS, N_PROMPTS, identical, N_PROMPTS, (long long)st.steps);
    assert_int_equal(identical, N_PROMPTS);
    engine_free(e_cu);
#ifndef KN_TEST_GPU
    /* no peer access between the devices: refused, and the engine stays at one rank */
    e_cu = new_engine(m_cu);
    setenv("AERIE_SHIM_NO_PEER", "1", 1);
    const kn_backend *cu1_again;
    assert_int_equal(kn_cuda_open(1, &cu1_again, &info, &err), AE_OK);
    err.msg[0] = '\0';
    assert_int_equal(engine_set_tp(e_cu, 2, KN_ALLREDUCE_CUSTOM, bes, &err), AE_ERR);
    printf("no peer access: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "need peer access between them"));
    assert_int_equal(engine_tp(e_cu), 1);
    unsetenv("AERIE_SHIM_NO_PEER");
    engine_free(e_cu);
#endif
    engine_free(e_cpu);
    model_free(m_cu);
    model_free(m_cpu);
}

int main(int argc, char **argv) {
    if (argc > 1) cmocka_set_test_filter(argv[1]); /* one test, by name (tests/gpu/run.sh) */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(the_head_drafts_the_same_trees_on_cuda),
        cmocka_unit_test(greedy_speculation_on_cuda_is_plain_decoding),
        cmocka_unit_test(ranks_on_cuda_give_the_cpu_ranks_bits),
        cmocka_unit_test(ranks_on_two_devices_give_the_cpu_ranks_bits),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
