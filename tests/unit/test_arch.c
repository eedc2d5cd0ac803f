/* The architecture table (target/arch.h): which files each architecture
 * reads, what it refuses with, and what it states about a model: its KV
 * and workspace bytes per token, the bytes a decode step reads, its
 * tensor-parallel split, and its layers' block kinds. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

#include <cmocka.h>

#include "../../target/arch.h"
#include "../../target/tp.h"

#define MODEL_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static void llama_reads_llama_and_qwen2_from_both_formats(void **state) {
    (void)state;
    ae_error err = {0};
    assert_ptr_equal(arch_for_gguf("llama", &err), &arch_llama);
    assert_ptr_equal(arch_for_gguf("qwen2", &err), &arch_llama);
    assert_ptr_equal(arch_for_hf("llama", &err), &arch_llama);
    assert_ptr_equal(arch_for_hf("qwen2", &err), &arch_llama);
    assert_string_equal(arch_llama.name, "llama");
    assert_ptr_equal(arch_for_hf("deepseek_v3", &err), &arch_deepseek);
    assert_ptr_equal(arch_for_hf("kimi_k2", &err), &arch_deepseek);
    assert_ptr_equal(arch_for_hf("kimi_k25", &err), &arch_deepseek);
    assert_ptr_equal(arch_for_gguf("deepseek2", &err), &arch_deepseek);
}

static void an_unknown_architecture_is_refused_with_the_known_ones(void **state) {
    (void)state;
    ae_error e1 = {0}, e2 = {0}, e3 = {0}; /* an error keeps its first message */
    assert_null(arch_for_gguf("grok", &e1));
    assert_string_equal(e1.msg, "architecture \"grok\" is not supported (llama, qwen2, deepseek2)");
    assert_null(arch_for_hf("mixtral", &e2));
    assert_string_equal(e2.msg, "model_type \"mixtral\" is not supported (llama, qwen2, deepseek_v3, kimi_k2, kimi_k25)");
    assert_null(arch_for_gguf("", &e3));
    assert_string_equal(e3.msg, "architecture \"\" is not supported (llama, qwen2, deepseek2)");
}

static void the_default_model_states_its_kv_split_and_blocks(void **state) {
    (void)state;
    model *m;
    ae_error err = {0};
    if (model_load(&m, MODEL_PATH, &kn_backend_cpu, &err) != AE_OK) fail_msg("%s (run `make model`)", err.msg);
    assert_ptr_equal(m->arch, &arch_llama);
    /* SmolLM2-135M: f16 K and V of 30 layers x 3 kv heads x 64 */
    assert_int_equal(m->arch->kv_bytes_per_token(&m->cfg), 2 * 30 * 3 * 64 * 2);
    /* 4 B x (7 x 576 + 2 x (9 + 3) x 64 + 2 x 1536 + 49152 + 64) */
    assert_int_equal(m->arch->workspace_per_token(&m->cfg), 231424);
    /* A decode step reads every matrix's bytes in the file, row by row,
     * and the f32 norms. */
    size_t want = 0;
    for (int32_t i = 0; i < m->cfg.n_layers; i++) {
        const model_layer *l = &m->layers[i];
        assert_int_equal(l->attn, MODEL_ATTN_GQA);
        assert_int_equal(l->ffn, MODEL_FFN_DENSE);
        const kn_weight *w[7] = {&l->wq, &l->wk, &l->wv, &l->wo, &l->w_gate, &l->w_up, &l->w_down};
        for (int j = 0; j < 7; j++) want += (size_t)w[j]->rows * w[j]->row_bytes;
        want += 2 * 576 * sizeof(float);
    }
    want += (size_t)m->output.rows * m->output.row_bytes + 576 * sizeof(float);
    assert_int_equal(model_decode_bytes(m), want);
    tp_split sp;
    assert_int_equal(m->arch->tp_split(&sp, &m->cfg, 3, &err), AE_OK);
    for (int r = 0; r < 3; r++) {
        assert_int_equal(sp.kv_heads[r].begin, r);
        assert_int_equal(sp.kv_heads[r].end, r + 1);
        assert_int_equal(sp.heads[r].begin, 3 * r);
        assert_int_equal(sp.heads[r].end, 3 * r + 3);
    }
    assert_int_equal(sp.ffn[0].begin, 0);
    assert_int_equal(sp.ffn[2].end, 1536);
    assert_int_equal(m->arch->tp_split(&sp, &m->cfg, 4, &err), AE_ERR);
    assert_string_equal(err.msg, "tensor parallel: 4 ranks but only 3 kv heads; at most 3 ranks");
    model_free(m);
}

int main(void) {
    if (access(MODEL_PATH, R_OK) != 0) {
        fprintf(stderr, "%s is missing: run `make model`\n", MODEL_PATH);
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(llama_reads_llama_and_qwen2_from_both_formats),
        cmocka_unit_test(an_unknown_architecture_is_refused_with_the_known_ones),
        cmocka_unit_test(the_default_model_states_its_kv_split_and_blocks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
