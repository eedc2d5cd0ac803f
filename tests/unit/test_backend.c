/* The backend seam (kernels/backend.h) with a backend whose memory is not
 * the host's. "staged" is the CPU backend's table with host_memory false:
 * the same ops, but every weight is copied into its buffers at load, the
 * engine's step inputs and the KV block tables go through uploads, and
 * logits and features come back by download, as on a GPU. The engine on
 * it must give the CPU backend's bits, step for step; anything that still
 * hands an op a host pointer, or reads a buffer on the host, fails the
 * checks in kernels.c. Run from the repo root. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "../../kernels/backend.h"
#include "../../target/engine.h"

#define MODEL_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static kn_backend staged;
static model *on_cpu, *on_staged;

/* "The quick brown fox jumps over the lazy dog. 012" in SmolLM2 ids. */
static const int32_t PROMPT[] = {504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 216, 32, 33, 34};
#define N_PROMPT ((int32_t)(sizeof PROMPT / sizeof PROMPT[0]))

static int setup(void **state) {
    (void)state;
    staged = kn_backend_cpu;
    staged.name = "staged";
    staged.host_memory = false;
    if (access(MODEL_PATH, R_OK) != 0) {
        fprintf(stderr, "%s is missing: run `make model`\n", MODEL_PATH);
        return -1;
    }
    ae_error err = {0};
    if (model_load(&on_cpu, MODEL_PATH, &kn_backend_cpu, &err) != AE_OK ||
        model_load(&on_staged, MODEL_PATH, &staged, &err) != AE_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    model_free(on_cpu);
    model_free(on_staged);
    return 0;
}

/* A host-memory backend borrows host bytes; any other copies them. */
static void test_buffer_from_host_borrows_or_copies(void **state) {
    (void)state;
    int32_t host[5] = {1, 2, 3, 4, 5};
    kn_buf a, b;
    ae_error err = {0};
    assert_int_equal(kn_buf_from_host(&kn_backend_cpu, &a, host, sizeof host, &err), AE_OK);
    assert_ptr_equal(a.ptr, host);
    assert_true(a.borrowed);
    assert_int_equal(kn_buf_from_host(&staged, &b, host, sizeof host, &err), AE_OK);
    assert_ptr_not_equal(b.ptr, host);
    assert_false(b.borrowed);
    assert_memory_equal(b.ptr, host, sizeof host);
    kn_buf_free(&a); /* must not free the array (ASan) */
    kn_buf_free(&b);
    assert_int_equal(host[4], 5);
    assert_null(a.ptr);
}

/* On the CPU the weights are the mapped file (and the packed copy); on
 * staged each is a copy in its own buffer, byte for byte, unpacked (the
 * packed layout is the CPU kernels'). */
static void test_weights_are_in_the_backends_buffers(void **state) {
    (void)state;
    for (int32_t l = 0; l < on_cpu->cfg.n_layers; l++) {
        const kn_weight *c = &on_cpu->layers[l].wq, *s = &on_staged->layers[l].wq;
        assert_non_null(c->buf);
        assert_true(c->buf->borrowed);
        assert_ptr_equal(c->buf->be, &kn_backend_cpu);
        assert_non_null(c->packed);
        assert_ptr_equal(c->packed_buf->be, &kn_backend_cpu);
        assert_non_null(s->buf);
        assert_ptr_equal(s->buf->be, &staged);
        assert_false(s->buf->borrowed);
        assert_ptr_equal(s->data, s->buf->ptr);
        assert_null(s->packed);
        assert_ptr_not_equal(s->data, c->data);
        assert_memory_equal(s->data, c->data, (size_t)c->rows * c->row_bytes);
    }
    assert_ptr_equal(on_staged->tok_embd.buf->be, &staged);
    assert_int_equal(on_staged->weight_bytes, on_cpu->weight_bytes);
}

static eng *engine_on(const model *m) {
    eng_config cfg = {.max_batch_tokens = 64, .max_seqs = 3, .max_seq_len = 96, .kv_tokens = 288,
                      .block_size = 16, .threads = 2};
    eng *e = NULL;
    ae_error err = {0};
    if (eng_init(&e, m, &cfg, &err) != AE_OK) fail_msg("%s", err.msg);
    return e;
}

/* One script of steps on both engines: prefill, a tree with features
 * captured, its path committed, a batch of two sequences, one freed and a
 * new one taking its blocks (block tables re-sent), and decodes after.
 * Logits and features must be the same bits at every step. */
static void test_engine_on_staged_gives_the_cpu_bits(void **state) {
    (void)state;
    eng *e[2] = {engine_on(on_cpu), engine_on(on_staged)};
    const int32_t V = on_cpu->cfg.vocab, H = on_cpu->cfg.hidden;
    float *lg[2], *ft[2];
    for (int k = 0; k < 2; k++) {
        lg[k] = calloc((size_t)64 * V, sizeof(float));
        ft[k] = calloc((size_t)64 * 3 * H, sizeof(float));
        assert_non_null(lg[k]);
        assert_non_null(ft[k]);
    }
    ae_error err = {0};
    int32_t a[2], b[2], c[2];
    static const int32_t tree[] = {28, 29, 30, 31, 32, 33}, parents[] = {-1, -1, 0, 0, 2, 1};
    static const int32_t path[] = {0, 2, 4};
    int32_t rows[6] = {0, 1, 2, 3, 4, 5};
    for (int step = 0; step < 6; step++) {
        int32_t n_rows = 0, n_feat = 0;
        for (int k = 0; k < 2; k++) {
            eng_item it[2];
            int32_t n = 1;
            llama_capture cap = {.n_layers = 3, .layers = {1, 15, 29}, .n_rows = 6, .rows = rows, .out = ft[k]};
            const llama_capture *cp = NULL;
            switch (step) {
            case 0:
                assert_int_equal(eng_seq_new(e[k], &a[k], &err), AE_OK);
                it[0] = (eng_item){.seq = a[k], .kind = ENG_APPEND, .n_tokens = N_PROMPT, .tokens = PROMPT};
                break;
            case 1:
                it[0] = (eng_item){.seq = a[k], .kind = ENG_TREE, .n_tokens = 6, .tokens = tree, .parents = parents};
                cp = &cap;
                n_feat = 6;
                break;
            case 2:
                assert_int_equal(eng_commit_path(e[k], a[k], path, 3, &err), AE_OK);
                assert_int_equal(eng_seq_new(e[k], &b[k], &err), AE_OK);
                it[0] = (eng_item){.seq = a[k], .kind = ENG_APPEND, .n_tokens = 1, .tokens = &tree[5]};
                it[1] = (eng_item){.seq = b[k], .kind = ENG_APPEND, .n_tokens = 12, .tokens = PROMPT, .all_logits = true};
                n = 2;
                break;
            case 3:
                eng_seq_free(e[k], a[k]);
                assert_int_equal(eng_seq_new(e[k], &c[k], &err), AE_OK);
                it[0] = (eng_item){.seq = c[k], .kind = ENG_APPEND, .n_tokens = 5, .tokens = PROMPT + 3};
                it[1] = (eng_item){.seq = b[k], .kind = ENG_APPEND, .n_tokens = 1, .tokens = &tree[1]};
                n = 2;
                break;
            default:
                it[0] = (eng_item){.seq = c[k], .kind = ENG_APPEND, .n_tokens = 1, .tokens = &tree[step]};
                it[1] = (eng_item){.seq = b[k], .kind = ENG_APPEND, .n_tokens = 1, .tokens = &tree[step - 1]};
                n = 2;
                break;
            }
            if (eng_step(e[k], it, n, lg[k], cp, &err) != AE_OK) fail_msg("step %d: %s", step, err.msg);
            n_rows = eng_logit_rows(it, n);
        }
        assert_memory_equal(lg[0], lg[1], (size_t)n_rows * V * sizeof(float));
        if (n_feat) assert_memory_equal(ft[0], ft[1], (size_t)n_feat * 3 * H * sizeof(float));
        assert_true(n_rows > 0);
    }
    kv_stats s0 = eng_kv_stats(e[0]), s1 = eng_kv_stats(e[1]);
    assert_int_equal(s0.blocks_used, s1.blocks_used);
    assert_int_equal(s0.seqs_live, 2);
    for (int k = 0; k < 2; k++) {
        eng_free(e[k]);
        free(lg[k]);
        free(ft[k]);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_buffer_from_host_borrows_or_copies),
        cmocka_unit_test(test_weights_are_in_the_backends_buffers),
        cmocka_unit_test(test_engine_on_staged_gives_the_cpu_bits),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
