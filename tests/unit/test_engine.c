/* The batched engine on the default model: batch invariance, bit for bit
 * (ARCHITECTURE.md, Invariants). A token's logits must not depend on whether it
 * was prefilled or decoded, on what else shares the forward pass, or on
 * whether it is a node of a verification tree. Run from the repo root. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "../../target/engine.h"

#define MODEL_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static model *mdl;
static int32_t V;

/* "The quick brown fox jumps over the lazy dog. 012" in SmolLM2 ids. */
static const int32_t PROMPT[] = {504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 216, 32, 33, 34};
#define N_PROMPT ((int32_t)(sizeof PROMPT / sizeof PROMPT[0]))

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

/* act_bits 0: the default (15). */
static engine *new_engine_bits(int threads, int32_t act_bits) {
    engine_config cfg = {.max_batch_tokens = 64,
                         .max_seqs = 4,
                         .max_seq_len = 128,
                         .kv_tokens = 512,
                         .block_size = 16,
                         .threads = threads,
                         .act_bits = act_bits};
    engine *e = NULL;
    ae_error err = {0};
    if (engine_init(&e, mdl, &cfg, &err) != AE_OK) fail_msg("%s", err.msg);
    return e;
}

static engine *new_engine(int threads) { return new_engine_bits(threads, 0); }

static int32_t new_seq(engine *e) {
    int32_t s;
    ae_error err = {0};
    if (engine_seq_new(e, &s, &err) != AE_OK) fail_msg("%s", err.msg);
    return s;
}

static void step(engine *e, const engine_item *items, int32_t n, float *logits) {
    ae_error err = {0};
    if (engine_step(e, items, n, &(engine_outputs){.logits = logits}, &err) != AE_OK) fail_msg("%s", err.msg);
}

static int32_t argmax(const float *x) {
    int32_t b = 0;
    for (int32_t i = 1; i < V; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

static void test_prefill_equals_token_by_token_decode(void **state) {
    (void)state;
    engine *e = new_engine(2);
    float *pre = malloc(sizeof(float) * (size_t)V * N_PROMPT), *dec = malloc(sizeof(float) * (size_t)V);
    int32_t a = new_seq(e), b = new_seq(e);
    engine_item it = {a, ENGINE_APPEND, N_PROMPT, PROMPT, NULL, true};
    step(e, &it, 1, pre);
    for (int32_t t = 0; t < N_PROMPT; t++) {
        engine_item d = {b, ENGINE_APPEND, 1, &PROMPT[t], NULL, false};
        step(e, &d, 1, dec);
        assert_memory_equal(dec, pre + (size_t)t * (size_t)V, sizeof(float) * (size_t)V);
    }
    assert_int_equal(engine_seq_len(e, a), N_PROMPT);
    /* The model continues the count: " 012" -> "3". */
    assert_int_equal(argmax(pre + (size_t)(N_PROMPT - 1) * (size_t)V), 35);
    free(pre);
    free(dec);
    engine_free(e);
}

static void test_logits_do_not_depend_on_batch_mates_or_threads(void **state) {
    (void)state;
    float *alone = malloc(sizeof(float) * (size_t)V), *mixed = malloc(sizeof(float) * (size_t)V * 3);
    /* Alone, one thread. */
    engine *e1 = new_engine(1);
    int32_t s1 = new_seq(e1);
    engine_item p1 = {s1, ENGINE_APPEND, 9, PROMPT, NULL, false};
    step(e1, &p1, 1, alone);
    engine_item d1 = {s1, ENGINE_APPEND, 1, &PROMPT[9], NULL, false};
    step(e1, &d1, 1, alone);
    /* In a batch with two other sequences of other lengths, three threads,
     * and in the middle of the batch. */
    engine *e3 = new_engine(3);
    int32_t x = new_seq(e3), s3 = new_seq(e3), y = new_seq(e3);
    engine_item p3[2] = {{s3, ENGINE_APPEND, 9, PROMPT, NULL, false}, {x, ENGINE_APPEND, 3, PROMPT + 5, NULL, false}};
    step(e3, p3, 2, mixed);
    engine_item d3[3] = {{x, ENGINE_APPEND, 1, PROMPT, NULL, false},
                         {s3, ENGINE_APPEND, 1, &PROMPT[9], NULL, false},
                         {y, ENGINE_APPEND, 11, PROMPT + 2, NULL, false}};
    step(e3, d3, 3, mixed);
    assert_memory_equal(alone, mixed + (size_t)V, sizeof(float) * (size_t)V);
    free(alone);
    free(mixed);
    engine_free(e1);
    engine_free(e3);
}

static void check_tree_node_equals_decoding_its_path(int32_t act_bits) {
    engine *e = new_engine_bits(2, act_bits);
    float *tree = malloc(sizeof(float) * (size_t)V * 6), *seqd = malloc(sizeof(float) * (size_t)V * 3);
    float *scratch = malloc(sizeof(float) * (size_t)V);
    int32_t t = new_seq(e), s = new_seq(e);
    engine_item pre[2] = {{t, ENGINE_APPEND, 8, PROMPT, NULL, false}, {s, ENGINE_APPEND, 8, PROMPT, NULL, false}};
    step(e, pre, 2, tree);
    /* Tree after the prefix: nodes 0,1 at depth 0; node 2 child of 0; node 3
     * child of 1; node 4 child of 2; node 5 child of 2. Path 0 -> 2 -> 4 is
     * PROMPT[8], PROMPT[9], PROMPT[10]. */
    const int32_t toks[6] = {PROMPT[8], 17, PROMPT[9], 905, PROMPT[10], 28};
    const int32_t parents[6] = {-1, -1, 0, 1, 2, 2};
    engine_item tr = {t, ENGINE_TREE, 6, toks, parents, false};
    step(e, &tr, 1, tree);
    assert_int_equal(engine_seq_len(e, t), 8); /* nothing committed yet */
    for (int32_t k = 0; k < 3; k++) {
        engine_item d = {s, ENGINE_APPEND, 1, &PROMPT[8 + k], NULL, false};
        step(e, &d, 1, seqd + (size_t)k * (size_t)V);
    }
    assert_memory_equal(tree + 0 * (size_t)V, seqd + 0 * (size_t)V, sizeof(float) * (size_t)V);
    assert_memory_equal(tree + 2 * (size_t)V, seqd + 1 * (size_t)V, sizeof(float) * (size_t)V);
    assert_memory_equal(tree + 4 * (size_t)V, seqd + 2 * (size_t)V, sizeof(float) * (size_t)V);
    /* Commit the path; the next decode matches the plain sequence's. */
    const int32_t path[3] = {0, 2, 4};
    ae_error err = {0};
    if (engine_commit_path(e, t, path, 3, &err) != AE_OK) fail_msg("%s", err.msg);
    assert_int_equal(engine_seq_len(e, t), 11);
    engine_item nt = {t, ENGINE_APPEND, 1, &PROMPT[11], NULL, false};
    engine_item ns = {s, ENGINE_APPEND, 1, &PROMPT[11], NULL, false};
    step(e, &nt, 1, scratch);
    step(e, &ns, 1, seqd);
    assert_memory_equal(scratch, seqd, sizeof(float) * (size_t)V);
    free(tree);
    free(seqd);
    free(scratch);
    engine_free(e);
}

static void test_tree_node_equals_decoding_its_path(void **state) {
    (void)state;
    check_tree_node_equals_decoding_its_path(0);
}

static void test_tree_node_equals_decoding_its_path_at_8bit_activations(void **state) {
    (void)state;
    check_tree_node_equals_decoding_its_path(8);
}

/* act_bits is the engine's: 15 by default, 8 when asked (and then the
 * logits are another rounding's), anything else refused. */
static void test_activation_bits_are_an_engine_setting(void **state) {
    (void)state;
    engine *e15 = new_engine(1), *e8 = new_engine_bits(1, 8);
    assert_int_equal(engine_get_config(e15)->act_bits, 15);
    assert_int_equal(engine_get_config(e8)->act_bits, 8);
    float *a = malloc(sizeof(float) * (size_t)V), *b = malloc(sizeof(float) * (size_t)V);
    engine_item i15 = {new_seq(e15), ENGINE_APPEND, N_PROMPT, PROMPT, NULL, false};
    engine_item i8 = {new_seq(e8), ENGINE_APPEND, N_PROMPT, PROMPT, NULL, false};
    step(e15, &i15, 1, a);
    step(e8, &i8, 1, b);
    int32_t differ = 0;
    for (int32_t v = 0; v < V; v++) differ += a[v] != b[v];
    assert_true(differ > V / 2);
    free(a);
    free(b);
    engine_free(e15);
    engine_free(e8);
    engine_config cfg = {.max_batch_tokens = 64,
                         .max_seqs = 4,
                         .max_seq_len = 128,
                         .kv_tokens = 512,
                         .block_size = 16,
                         .threads = 1,
                         .act_bits = 9};
    engine *bad = NULL;
    ae_error err = {0};
    assert_int_equal(engine_init(&bad, mdl, &cfg, &err), AE_ERR);
    assert_null(bad);
    assert_string_equal(err.msg, "engine: activation bits must be 8 or 15, got 9");
}

static void test_bad_items_fail_and_change_nothing(void **state) {
    (void)state;
    engine *e = new_engine(1);
    float *logits = malloc(sizeof(float) * (size_t)V * 4);
    int32_t s = new_seq(e);
    ae_error err = {0};
    const int32_t bad_tok[1] = {49152};
    engine_item it = {s, ENGINE_APPEND, 1, bad_tok, NULL, false};
    assert_int_equal(engine_step(e, &it, 1, &(engine_outputs){.logits = logits}, &err), AE_ERR);
    assert_string_equal(err.msg, "item 0: token 49152 is not in the vocabulary");
    err_clear(&err);
    const int32_t toks[2] = {1, 2}, parents[2] = {-1, 1};
    engine_item tr = {s, ENGINE_TREE, 2, toks, parents, false};
    assert_int_equal(engine_step(e, &tr, 1, &(engine_outputs){.logits = logits}, &err), AE_ERR);
    assert_string_equal(err.msg, "item 0: node 1 has parent 1 (must be -1 or an earlier node)");
    assert_int_equal(engine_seq_len(e, s), 0);
    free(logits);
    engine_free(e);
}

/* One engine_step, its outputs chosen by engine_outputs: the logit rows;
 * with ids each row's argmax as well (a host-memory backend writes the
 * rows into logits too, bit for bit the plain step's); draws on a backend
 * that draws none fail with the reason and change nothing. */
static void test_step_outputs_are_rows_ids_or_draws(void **state) {
    (void)state;
    engine *e = new_engine(1);
    float *plain = malloc(sizeof(float) * (size_t)V * 2), *with_ids = malloc(sizeof(float) * (size_t)V * 2);
    int32_t a = new_seq(e), b = new_seq(e);
    engine_item ia[2] = {{a, ENGINE_APPEND, 4, PROMPT, NULL, false}, {b, ENGINE_APPEND, 6, PROMPT, NULL, false}};
    ae_error err = {0};
    assert_int_equal(engine_step(e, ia, 2, &(engine_outputs){.logits = plain}, &err), AE_OK);
    const int32_t next[2] = {PROMPT[4], PROMPT[6]};
    engine_item da[2] = {{a, ENGINE_APPEND, 1, &next[0], NULL, false}, {b, ENGINE_APPEND, 1, &next[1], NULL, false}};
    int32_t ids[2] = {-1, -1};
    assert_int_equal(engine_step(e, da, 2, &(engine_outputs){.logits = with_ids, .ids = ids}, &err), AE_OK);
    /* The same tokens again on fresh sequences, plainly. */
    int32_t c = new_seq(e), d = new_seq(e);
    engine_item ic[2] = {{c, ENGINE_APPEND, 5, PROMPT, NULL, false}, {d, ENGINE_APPEND, 7, PROMPT, NULL, false}};
    step(e, ic, 2, plain);
    assert_memory_equal(plain, with_ids, sizeof(float) * (size_t)V * 2);
    assert_int_equal(ids[0], argmax(plain));
    assert_int_equal(ids[1], argmax(plain + V));
    assert_false(engine_can_sample(e));
    kn_draw draws[2];
    memset(draws, 0, sizeof draws);
    assert_int_equal(engine_step(e, da, 2, &(engine_outputs){.logits = plain, .ids = ids, .draws = draws}, &err),
                     AE_ERR);
    assert_string_equal(err.msg, "the cpu backend draws no tokens (kn_sample): sample the logits");
    assert_int_equal(engine_seq_len(e, a), 5);
    assert_int_equal(engine_drawn_steps(e), 0);
    free(plain), free(with_ids);
    engine_free(e);
}

static void test_capture_is_three_layer_inputs_and_batch_invariant(void **state) {
    (void)state;
    const int32_t H = mdl->cfg.hidden;
    int32_t layers[FORWARD_MAX_CAPTURE];
    capture_default_layers(mdl->cfg.n_layers, layers);
    assert_int_equal(layers[0], 2);
    assert_int_equal(layers[1], 15);
    assert_int_equal(layers[2], 27);
    engine *e = new_engine(2);
    float *logits = malloc(sizeof(float) * (size_t)V * 16);
    float *pre = calloc((size_t)N_PROMPT * 3 * (size_t)H, sizeof(float));
    float *one = calloc(3 * (size_t)H, sizeof(float));
    int32_t a = new_seq(e), b = new_seq(e);
    int32_t rows[N_PROMPT];
    for (int32_t i = 0; i < N_PROMPT; i++) rows[i] = i;
    forward_capture cap = {3, {layers[0], layers[1], layers[2]}, N_PROMPT, rows, pre};
    engine_item it = {a, ENGINE_APPEND, N_PROMPT, PROMPT, NULL, false};
    ae_error err = {0};
    if (engine_step(e, &it, 1, &(engine_outputs){.logits = logits, .capture = &cap}, &err) != AE_OK)
        fail_msg("%s", err.msg);
    /* Token by token on another sequence, capturing the last token only:
     * the same [3 * H] features, bit for bit. */
    for (int32_t t = 0; t < N_PROMPT; t++) {
        int32_t row0 = 0;
        forward_capture c1 = {3, {layers[0], layers[1], layers[2]}, 1, &row0, one};
        engine_item d = {b, ENGINE_APPEND, 1, &PROMPT[t], NULL, false};
        if (engine_step(e, &d, 1, &(engine_outputs){.logits = logits, .capture = &c1}, &err) != AE_OK)
            fail_msg("%s", err.msg);
        assert_memory_equal(one, pre + (size_t)t * 3 * (size_t)H, 3 * (size_t)H * sizeof(float));
    }
    /* Layer inputs differ from one another (the capture is not one copy). */
    assert_memory_not_equal(pre, pre + H, (size_t)H * sizeof(float));
    int32_t bad[3] = {2, 15, 31}, out[3];
    assert_int_equal(capture_layers_from(bad, 3, 30, out, &err), AE_ERR);
    assert_string_equal(err.msg, "eagle_aux_hidden_state_layer_ids[2] = 31 is outside 0..30");
    free(logits);
    free(pre);
    free(one);
    engine_free(e);
}

static void test_refused_step_gives_back_the_blocks_it_reserved(void **state) {
    (void)state;
    /* 4 blocks of 16: A wants 3, B wants 2. The step fails on B, and A's
     * 3 blocks must go back, so B alone then fits. */
    engine_config cfg = {
        .max_batch_tokens = 96, .max_seqs = 2, .max_seq_len = 64, .kv_tokens = 64, .block_size = 16, .threads = 1};
    engine *e;
    ae_error err = {0};
    if (engine_init(&e, mdl, &cfg, &err) != AE_OK) fail_msg("%s", err.msg);
    int32_t a = new_seq(e), b = new_seq(e);
    int32_t toks[48];
    for (int i = 0; i < 48; i++) toks[i] = PROMPT[i % N_PROMPT];
    float *logits = malloc(sizeof(float) * (size_t)V * 2);
    engine_item both[2] = {{a, ENGINE_APPEND, 48, toks, NULL, false}, {b, ENGINE_APPEND, 32, toks, NULL, false}};
    assert_int_equal(engine_step(e, both, 2, &(engine_outputs){.logits = logits}, &err), AE_ERR);
    assert_non_null(strstr(err.msg, "kv cache exhausted"));
    err_clear(&err);
    engine_item only_b = {b, ENGINE_APPEND, 32, toks, NULL, false};
    if (engine_step(e, &only_b, 1, &(engine_outputs){.logits = logits}, &err) != AE_OK) fail_msg("%s", err.msg);
    assert_int_equal(engine_seq_len(e, a), 0);
    assert_int_equal(engine_seq_len(e, b), 32);
    /* An id that is not a live sequence is an error, not an abort. */
    engine_item ghost = {7, ENGINE_APPEND, 1, toks, NULL, false};
    assert_int_equal(engine_step(e, &ghost, 1, &(engine_outputs){.logits = logits}, &err), AE_ERR);
    assert_string_equal(err.msg, "item 0: sequence 7 is not live");
    free(logits);
    engine_free(e);
}

static void test_commit_path_must_be_a_chain_of_the_last_tree(void **state) {
    (void)state;
    engine *e = new_engine(1);
    float *logits = malloc(sizeof(float) * (size_t)V * 4);
    int32_t s = new_seq(e);
    ae_error err = {0};
    const int32_t one[1] = {PROMPT[0]};
    engine_item pre = {s, ENGINE_APPEND, 1, one, NULL, false};
    step(e, &pre, 1, logits);
    const int32_t path0[1] = {0};
    assert_int_equal(engine_commit_path(e, s, path0, 1, &err), AE_ERR);
    assert_string_equal(err.msg, "sequence 0 has no tree to commit from");
    err_clear(&err);
    /* nodes: 0 and 1 at depth 0, 2 child of 1, 3 child of 2 */
    const int32_t toks[4] = {PROMPT[1], PROMPT[2], PROMPT[3], PROMPT[4]}, parents[4] = {-1, -1, 1, 2};
    engine_item tr = {s, ENGINE_TREE, 4, toks, parents, false};
    step(e, &tr, 1, logits);
    const int32_t skip[2] = {1, 3}; /* 3's parent is 2, not 1 */
    assert_int_equal(engine_commit_path(e, s, skip, 2, &err), AE_ERR);
    assert_string_equal(err.msg, "path[1] = 3 is not a child of the previous node");
    err_clear(&err);
    const int32_t not_root[1] = {2};
    assert_int_equal(engine_commit_path(e, s, not_root, 1, &err), AE_ERR);
    assert_string_equal(err.msg, "path[0] = 2 is not a child of the root");
    assert_int_equal(engine_seq_len(e, s), 1);
    const int32_t good[3] = {1, 2, 3};
    if (engine_commit_path(e, s, good, 3, &err) != AE_OK) fail_msg("%s", err.msg);
    assert_int_equal(engine_seq_len(e, s), 4);
    free(logits);
    engine_free(e);
}

/* kB of this process's file-backed resident pages (/proc/self/status). */
static long rss_file_kb(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long kb = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "RssFile: %ld kB", &kb) == 1) break;
    fclose(f);
    return kb;
}

/* Loading packs every quantized matrix and drops the file pages packing
 * read, so the process holds the weights once (the packed copy the memory
 * plan counts), not twice. Loading the model again here would add ~94 MiB
 * of file pages without that. */
static void test_load_keeps_the_weights_resident_once(void **state) {
    (void)state;
    long before = rss_file_kb();
    if (before < 0) skip();
    model *m2;
    ae_error err = {0};
    if (model_load(&m2, MODEL_PATH, &kn_backend_cpu, &err) != AE_OK) fail_msg("%s", err.msg);
    long after = rss_file_kb();
    size_t weights_kb = mdl->weight_bytes / 1024;
    print_message("file pages: %ld kB before load, %ld kB after; weights %zu kB\n", before, after, weights_kb);
    assert_true(after - before < (long)(weights_kb / 10));
    model_free(m2);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prefill_equals_token_by_token_decode),
        cmocka_unit_test(test_logits_do_not_depend_on_batch_mates_or_threads),
        cmocka_unit_test(test_tree_node_equals_decoding_its_path),
        cmocka_unit_test(test_tree_node_equals_decoding_its_path_at_8bit_activations),
        cmocka_unit_test(test_activation_bits_are_an_engine_setting),
        cmocka_unit_test(test_bad_items_fail_and_change_nothing),
        cmocka_unit_test(test_step_outputs_are_rows_ids_or_draws),
        cmocka_unit_test(test_capture_is_three_layer_inputs_and_batch_invariant),
        cmocka_unit_test(test_refused_step_gives_back_the_blocks_it_reserved),
        cmocka_unit_test(test_commit_path_must_be_a_chain_of_the_last_tree),
        cmocka_unit_test(test_load_keeps_the_weights_resident_once),
    };
    return cmocka_run_group_tests_name("engine", tests, setup, teardown);
}
