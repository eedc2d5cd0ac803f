/* Tiny Hugging Face checkpoints written by transformers itself, against
 * transformers' own greedy tokens and logits (tests/golden/tiny/, made by
 * tools/gen_tiny_golden.py).
 *
 * They cover what the default model cannot: Qwen2's q/k/v biases (qwen2),
 * Llama-3 rope scaling with frequencies in all three bands, an explicit
 * head_dim that differs from hidden / heads, and GQA 4:1 (llama3), an untied
 * lm_head and random RMSNorm weights (both). Each prompt is prefilled in
 * chunks of at most 32 tokens (the longest is 80, beyond the llama3 model's
 * original_max_position_embeddings of 64), then decoded greedily one token
 * at a time: the 16 tokens must equal the reference and the last prompt
 * logits must be within the bound below (relative L2) of it; for the
 * DeepSeek-V3 models so must the EAGLE-3 features captured at layers 1, 2
 * and 3. Run from the repo root. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "../test_io.h"

#include "../../target/arch.h"
#include "../../target/engine.h"

#define GOLDEN "tests/golden/tiny"
#define N_GEN 16
#define MAX_PROMPT 96
#define CHUNK 32
/* The references are f32 throughout; the engine keeps K and V in f16
 * (kernels.h), whose unit roundoff 2^-11 = 4.9e-4 bounds the relative
 * error of each stored element. The outputs move by about half that
 * (3.2e-4 at worst here, against 3e-7 with an f32 cache), so the bound
 * is one f16 unit roundoff (it was 1e-4 with the f32 cache). */
#define REL_TOL 4.9e-4
/* MLA's latent is in f16 and is both the keys and the values, under a
 * softmax scale YaRN sharpens by 1.42: rounding it alone in transformers
 * moves the last logits by 4.3e-4, 3.9e-4 and 3.5e-4 (this file's three
 * prompts; measured 4.3e-4 at worst here), near REL_TOL. The bound is the
 * Llama golden test's (tests/model/test_llama_golden.c). */
#define REL_TOL_MLA 2e-3

static cJSON *load_expected(const char *name) {
    char path[256];
    snprintf(path, sizeof path, GOLDEN "/%s/expected.json", name);
    char *text = test_read_file(path, NULL);
    cJSON *root = cJSON_Parse(text);
    free(text);
    if (!root) fail_msg("%s: not JSON", path);
    return root;
}

static int32_t json_ints(const cJSON *arr, int32_t *out, int32_t cap) {
    int32_t n = 0;
    const cJSON *v;
    cJSON_ArrayForEach(v, arr) {
        assert_true(n < cap && cJSON_IsNumber(v));
        out[n++] = (int32_t)v->valueint;
    }
    return n;
}

static int32_t argmax(const float *x, int32_t n) {
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

typedef struct result {
    int32_t tokens_equal; /* leading generated tokens equal to the reference */
    double rel_l2;        /* last prompt logits vs the reference */
    double hidden_l2;     /* the captured features vs the reference's, worst layer (0 without) */
} result;

static double rel_l2(const float *a, const float *ref, int32_t n) {
    double num = 0, den = 0;
    for (int32_t i = 0; i < n; i++) {
        double d = (double)a[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return sqrt(num / den);
}

/* EAGLE-3's capture layers of the DeepSeek references (expected.json
 * "hidden": the inputs of these layers at the last prompt token). */
#define N_CAPTURE 3
static const int32_t capture_layers[N_CAPTURE] = {1, 2, 3};

/* One prompt through a fresh engine: chunked prefill, then greedy decode. */
static result run_prompt(const model *m, const int32_t *prompt, int32_t n, const int32_t *want, const float *ref_logits,
                         const float *ref_hidden) {
    engine_config cfg = {
        .max_batch_tokens = CHUNK, .max_seqs = 1, .max_seq_len = 128, .kv_tokens = 128, .block_size = 16, .threads = 2};
    int32_t V = m->cfg.vocab;
    engine *e;
    ae_error err = {0};
    if (engine_init(&e, m, &cfg, &err) != AE_OK) fail_msg("%s", err.msg);
    int32_t s;
    if (engine_seq_new(e, &s, &err) != AE_OK) fail_msg("%s", err.msg);
    float *lg = malloc(sizeof(float) * (size_t)V);
    assert_non_null(lg);
    const int32_t H = m->cfg.hidden;
    float *feat = malloc(sizeof(float) * N_CAPTURE * (size_t)H);
    assert_non_null(feat);
    for (int32_t at = 0; at < n; at += CHUNK) {
        int32_t k = n - at < CHUNK ? n - at : CHUNK, last = k - 1;
        forward_capture cap = {N_CAPTURE, {capture_layers[0], capture_layers[1], capture_layers[2]}, 1, &last, feat};
        engine_item it = {s, ENGINE_APPEND, k, prompt + at, NULL, false};
        engine_outputs eo = {.logits = lg, .capture = at + k == n && ref_hidden ? &cap : NULL};
        if (engine_step(e, &it, 1, &eo, &err) != AE_OK) fail_msg("%s", err.msg);
    }
    assert_int_equal(engine_seq_len(e, s), n);
    result r = {0, rel_l2(lg, ref_logits, V), 0.0};
    for (int j = 0; ref_hidden && j < N_CAPTURE; j++) {
        double h = rel_l2(feat + (size_t)j * (size_t)H, ref_hidden + (size_t)j * (size_t)H, H);
        r.hidden_l2 = h > r.hidden_l2 ? h : r.hidden_l2;
    }
    free(feat);
    int32_t got[N_GEN];
    bool diverged = false;
    for (int32_t g = 0; g < N_GEN; g++) {
        got[g] = argmax(lg, V);
        if (!diverged && got[g] == want[g])
            r.tokens_equal++;
        else
            diverged = true;
        /* Feed the reference token so one near tie does not derail the
         * rest; tokens_equal counts only up to the first miss. */
        engine_item d = {s, ENGINE_APPEND, 1, &want[g], NULL, false};
        if (engine_step(e, &d, 1, &(engine_outputs){.logits = lg}, &err) != AE_OK) fail_msg("%s", err.msg);
    }
    if (diverged) {
        fprintf(stderr, "  got     ");
        for (int32_t g = 0; g < N_GEN; g++) fprintf(stderr, " %d", got[g]);
        fprintf(stderr, "\n  expected");
        for (int32_t g = 0; g < N_GEN; g++) fprintf(stderr, " %d", want[g]);
        fprintf(stderr, "\n");
    }
    free(lg);
    engine_free(e);
    return r;
}

/* Runs every prompt of one model; fails if any disagreed, after printing all. */
static void check_model_as(const char *name, const char *label, const model *m, double tol) {
    cJSON *root = load_expected(name);
    const cJSON *prompts = cJSON_GetObjectItemCaseSensitive(root, "prompts");
    assert_true(cJSON_IsArray(prompts));
    int32_t V = m->cfg.vocab, n_prompts = 0, tokens = 0, total = 0;
    double worst = 0;
    bool ok = true;
    float *ref = malloc(sizeof(float) * (size_t)V), *hid = malloc(sizeof(float) * N_CAPTURE * (size_t)m->cfg.hidden);
    assert_non_null(ref);
    assert_non_null(hid);
    double worst_hidden = 0;
    int32_t n_hidden = 0;
    const cJSON *p;
    cJSON_ArrayForEach(p, prompts) {
        int32_t ids[MAX_PROMPT], want[N_GEN];
        int32_t n = json_ints(cJSON_GetObjectItemCaseSensitive(p, "ids"), ids, MAX_PROMPT);
        assert_int_equal(json_ints(cJSON_GetObjectItemCaseSensitive(p, "generated"), want, N_GEN), N_GEN);
        const cJSON *ll = cJSON_GetObjectItemCaseSensitive(p, "last_logits"), *v;
        assert_int_equal(cJSON_GetArraySize(ll), V);
        int32_t i = 0;
        cJSON_ArrayForEach(v, ll) ref[i++] = (float)v->valuedouble;
        const cJSON *hj = cJSON_GetObjectItemCaseSensitive(p, "hidden");
        for (int j = 0; hj && j < N_CAPTURE; j++) {
            char key[8];
            snprintf(key, sizeof key, "%d", capture_layers[j]);
            const cJSON *layer = cJSON_GetObjectItemCaseSensitive(hj, key);
            assert_int_equal(cJSON_GetArraySize(layer), m->cfg.hidden);
            i = 0;
            cJSON_ArrayForEach(v, layer) hid[(size_t)j * (size_t)m->cfg.hidden + (size_t)i++] = (float)v->valuedouble;
        }
        result r = run_prompt(m, ids, n, want, ref, hj ? hid : NULL);
        if (hj) {
            n_hidden++;
            if (!(r.hidden_l2 < tol)) {
                ok = false;
                fprintf(stderr, "%s prompt %d: captured features rel L2 %.3g\n", label, n_prompts, r.hidden_l2);
            }
            worst_hidden = r.hidden_l2 > worst_hidden ? r.hidden_l2 : worst_hidden;
        }
        if (r.tokens_equal != N_GEN || !(r.rel_l2 < tol)) {
            ok = false;
            fprintf(stderr, "%s prompt %d (%d tokens): %d/%d greedy tokens equal, last logits rel L2 %.3g\n", label,
                    n_prompts, n, r.tokens_equal, N_GEN, r.rel_l2);
        }
        if (r.rel_l2 > worst || isnan(r.rel_l2)) worst = r.rel_l2;
        tokens += r.tokens_equal;
        total += N_GEN;
        n_prompts++;
    }
    assert_int_equal(n_prompts, 3);
    printf("%s: %d prompts, %d/%d greedy tokens equal, worst last-logits rel L2 %.3g", label, n_prompts, tokens, total,
           worst);
    if (n_hidden) printf("; features captured at layers 1, 2, 3 within %.3g rel L2", worst_hidden);
    printf("\n");
    free(ref);
    free(hid);
    cJSON_Delete(root);
    assert_true(ok);
}

static void check_model(const char *name, const model *m, double tol) { check_model_as(name, name, m, tol); }

static model *load(const char *name) {
    char dir[256];
    snprintf(dir, sizeof dir, GOLDEN "/%s", name);
    model *m;
    ae_error err = {0};
    if (model_load(&m, dir, &kn_backend_cpu, &err) != AE_OK) fail_msg("%s", err.msg);
    return m;
}

static void test_qwen2(void **state) {
    (void)state;
    model *m = load("qwen2");
    const model_config *c = &m->cfg;
    assert_string_equal(c->arch, "qwen2");
    assert_true(c->qkv_bias);
    assert_false(c->tied_embeddings);
    assert_true(m->output.data != m->tok_embd.data);
    assert_int_equal(c->n_layers, 2);
    assert_int_equal(c->hidden, 32);
    assert_int_equal(c->n_heads, 4);
    assert_int_equal(c->n_kv_heads, 2);
    assert_int_equal(c->head_dim, 8);
    assert_int_equal(c->vocab, 256);
    assert_int_equal(c->rope.layout, KN_ROPE_NEOX);
    assert_true(c->rope.theta == 10000.0);
    assert_true(c->rope.factor == 0.0 || c->rope.factor == 1.0);
    for (int i = 0; i < c->n_layers; i++) assert_true(m->layers[i].bq && m->layers[i].bk && m->layers[i].bv);
    check_model("qwen2", m, REL_TOL);
    model_free(m);
}

static void test_llama3(void **state) {
    (void)state;
    model *m = load("llama3");
    const model_config *c = &m->cfg;
    assert_string_equal(c->arch, "llama");
    assert_false(c->qkv_bias);
    assert_false(c->tied_embeddings);
    assert_true(m->output.data != m->tok_embd.data);
    assert_int_equal(c->hidden, 32);
    assert_int_equal(c->n_heads, 4);
    assert_int_equal(c->n_kv_heads, 1);
    assert_int_equal(c->head_dim, 16); /* explicit: hidden / heads would be 8 */
    assert_int_equal(c->rope.layout, KN_ROPE_NEOX);
    assert_true(c->rope.theta == 500000.0);
    assert_true(c->rope.factor == 8.0);
    assert_true(c->rope.low_freq_factor == 1.0);
    assert_true(c->rope.high_freq_factor == 4.0);
    assert_true(c->rope.original_max_pos == 64.0);
    assert_null(m->layers[0].bq);
    check_model("llama3", m, REL_TOL);
    model_free(m);
}

/* DeepSeek-V3's layout (arch/deepseek.c): MLA with a q low rank and a
 * latent cache, one dense layer then two of 8 sigmoid-routed experts in 4
 * groups plus a shared expert, YaRN past its original 64 positions. */
static void test_deepseek(void **state) {
    (void)state;
    model *m = load("deepseek");
    const model_config *c = &m->cfg;
    assert_string_equal(c->arch, "deepseek_v3");
    assert_int_equal(c->n_kv_heads, 1);
    assert_int_equal(c->head_dim, 32 + 16); /* the latent: kv_lora_rank + qk_rope_head_dim */
    assert_int_equal(c->q_lora_rank, 32);
    assert_int_equal(c->rope.layout, KN_ROPE_ADJACENT); /* rope_interleave */
    assert_int_equal(c->rope.head_dim, 16);
    assert_true(c->rope.yarn && c->rope.factor == 4.0 && c->rope.original_max_pos == 64.0);
    /* 32^-1/2 (nope 16 + rope 16) times mscale^2, mscale = 0.1 ln 4 + 1 */
    double ms = 0.1 * log(4.0) + 1.0;
    assert_true(c->attn_scale == (float)(ms * ms / sqrt(32.0)));
    assert_int_equal(c->route.n_experts, 8);
    assert_int_equal(c->route.n_group, 4);
    assert_int_equal(c->route.topk_group, 2);
    assert_int_equal(c->route.top_k, 2);
    assert_true(c->route.norm && c->route.scale == 2.5f);
    assert_int_equal(c->n_dense_layers, 1);
    assert_int_equal(c->shared_ffn, 64);
    assert_int_equal(m->layers[0].ffn, MODEL_FFN_DENSE);
    assert_int_equal(m->layers[1].ffn, MODEL_FFN_MOE);
    assert_int_equal(m->layers[1].experts[0].type, GGML_TYPE_F32);
    /* (32 + 16) x 3 layers x 2 bytes: no V, nothing per head */
    assert_int_equal(m->arch->kv_bytes_per_token(c), 288);
    check_model("deepseek", m, REL_TOL_MLA);
    model_free(m);
}

/* The same model with its routed experts in compressed-tensors int4 (as
 * Kimi-K2.5 ships them), against transformers on the rounded weights:
 * each group of 32 runs as Q4_0 exactly. */
static void test_deepseek_int4(void **state) {
    (void)state;
    model *m = load("deepseek_int4");
    for (int i = 1; i < 3; i++)
        for (int j = 0; j < 3 * 8; j++) assert_int_equal(m->layers[i].experts[j].type, GGML_TYPE_Q4_0);
    assert_int_equal(m->layers[1].w_gate.type, GGML_TYPE_F32); /* the shared expert stays as it was */
    /* by type: the experts' Q4_0, 2 layers x 8 experts x 3 matrices x 64
     * rows x 2 blocks of 18 B, and nothing else in Q4_0 */
    uint64_t bytes[GGML_TYPE_COUNT_MAX], experts;
    model_bytes_by_type(m, bytes, &experts);
    assert_int_equal(bytes[GGML_TYPE_Q4_0], 2 * 8 * 3 * 64 * 2 * 18);
    assert_int_equal(experts, bytes[GGML_TYPE_Q4_0]);
    check_model("deepseek_int4", m, REL_TOL_MLA);
    model_free(m);
}

/* The same model as llama.cpp's converter writes it (tools/
 * gen_deepseek_gguf.py): deepseek2 keys, W_UK and W_UV apart, the experts
 * stacked; and as older converters wrote it, kv_b whole. Both against
 * transformers' outputs of the same weights. */
static void test_deepseek_gguf(void **state) {
    (void)state;
    const char *files[2] = {"deepseek.gguf", "deepseek-kvb.gguf"};
    for (int i = 0; i < 2; i++) {
        model *m = load(files[i]);
        const model_config *c = &m->cfg;
        assert_string_equal(c->arch, "deepseek2");
        assert_int_equal(c->qk_nope_dim, 16);
        assert_int_equal(c->v_head_dim, 16);
        assert_int_equal(c->head_dim, 48);
        assert_int_equal(c->route.n_experts, 8);
        assert_int_equal(c->route.n_group, 4);
        assert_true(c->route.norm && c->route.scale == 2.5f);
        assert_true(c->rope.yarn && c->rope.factor == 4.0 && c->rope.original_max_pos == 64.0);
        assert_int_equal(m->layers[2].ffn, MODEL_FFN_MOE);
        check_model_as("deepseek", files[i], m, REL_TOL_MLA);
        model_free(m);
    }
}

/* Qwen2 always has q/k/v biases: a config that says otherwise is refused
 * by the config parser before any tensor is read. */
static void test_qwen2_without_bias_is_refused(void **state) {
    (void)state;
    char dir[] = "/tmp/aerie-tiny-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char *text = test_read_file(GOLDEN "/qwen2/config.json", NULL);
    cJSON *cfg = cJSON_Parse(text);
    free(text);
    assert_non_null(cfg);
    cJSON_AddBoolToObject(cfg, "attention_bias", false);
    char *out = cJSON_Print(cfg);
    char cfg_path[128], safetensors_path[128], cwd[512], target[700];
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", dir);
    snprintf(safetensors_path, sizeof safetensors_path, "%s/model.safetensors", dir);
    FILE *f = fopen(cfg_path, "w");
    assert_non_null(f);
    fputs(out, f);
    fclose(f);
    assert_non_null(getcwd(cwd, sizeof cwd));
    snprintf(target, sizeof target, "%s/" GOLDEN "/qwen2/model.safetensors", cwd);
    assert_int_equal(symlink(target, safetensors_path), 0);
    free(out);
    cJSON_Delete(cfg);

    model *m = (model *)1;
    ae_error err = {0};
    int rc = model_load(&m, dir, &kn_backend_cpu, &err);
    unlink(safetensors_path);
    unlink(cfg_path);
    rmdir(dir);
    assert_int_equal(rc, AE_ERR);
    assert_null(m);
    char want[300];
    snprintf(want, sizeof want, "%s: attention_bias: false contradicts model_type qwen2 (always biased)", cfg_path);
    assert_string_equal(err.msg, want);
}

int main(void) {
    if (access(GOLDEN "/qwen2/expected.json", R_OK) != 0) {
        fprintf(stderr, GOLDEN " is missing: run from the repo root\n");
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_qwen2),
        cmocka_unit_test(test_llama3),
        cmocka_unit_test(test_qwen2_without_bias_is_refused),
        cmocka_unit_test(test_deepseek),
        cmocka_unit_test(test_deepseek_int4),
        cmocka_unit_test(test_deepseek_gguf),
    };
    return cmocka_run_group_tests_name("tiny_models", tests, NULL, NULL);
}
