/* The CPU engine against Hugging Face transformers on the same dequantized
 * weights (tests/golden/llama/smollm2.json, made by
 * tools/gen_llama_golden.py): for every prompt, 64 greedy tokens must be
 * identical, and the final-position logits within 2e-3 relative L2 where
 * the reference kept the whole vector (top-20 logits elsewhere). The
 * EAGLE-3 capture is checked against transformers' hidden states too.
 *
 * The logits bound was 1e-3 with an f32 KV cache (measured 6.8e-4); the
 * cache holds f16 now (kernels.h), whose rounding of every key and value
 * (unit roundoff 4.9e-4) moved the worst prompt to 1.3e-3, with the same
 * greedy tokens on every prompt. The reference stays f32 throughout.
 *
 * All prompts run as sequences of one batched engine, so this also checks
 * that batching changes nothing a user can see. Run from the repo root.
 *
 * The same comparison at 8-bit activations (kernels.h) holds to the
 * looser bounds measured for it, stated at the test. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "../../services/core/file.h"
#include "../../target/engine.h"

#define MODEL_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define GOLDEN "tests/golden/llama/smollm2.json"
#define N_GEN 64
#define MAX_PROMPTS 32
/* BOUNDS_8BIT: measured at 8-bit activations on this file (the results
 * are bitwise deterministic): 6/26 prompts keep all 64 greedy tokens,
 * final logits rel L2 max 0.0834, top-20 max |diff|/L2 0.00102, features
 * rel L2 max 0.0274. The bounds leave 1.5x on each error. */
#define MIN_IDENTICAL_8BIT 4
#define MAX_LOGITS_8BIT 0.125
#define MAX_TOP_8BIT 0.0015
#define MAX_HIDDEN_8BIT 0.04

static model *mdl;
static cJSON *golden;

static int setup(void **state) {
    (void)state;
    ae_error err = {0};
    if (access(MODEL_PATH, R_OK) != 0) {
        fprintf(stderr, "%s is missing: run `make model`\n", MODEL_PATH);
        return -1;
    }
    char *text;
    size_t len;
    if (model_load(&mdl, MODEL_PATH, &kn_backend_cpu, &err) != AE_OK ||
        file_read_all(GOLDEN, 8u << 20, &text, &len, NULL, &err) != AE_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    golden = cJSON_ParseWithLength(text, len);
    free(text);
    return golden ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    cJSON_Delete(golden);
    model_free(mdl);
    return 0;
}

static int32_t *int_array(const cJSON *a, int32_t *n) {
    *n = cJSON_GetArraySize(a);
    int32_t *v = malloc(sizeof(int32_t) * (size_t)(*n ? *n : 1));
    const cJSON *it;
    int32_t i = 0;
    cJSON_ArrayForEach(it, a) v[i++] = (int32_t)it->valuedouble;
    return v;
}

/* base64 of little-endian f32 into out[n]; returns the count decoded. */
static size_t b64_floats(const char *s, float *out, size_t n) {
    static int8_t map[256];
    static const char *abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    memset(map, -1, sizeof map);
    for (int i = 0; i < 64; i++) map[(uint8_t)abc[i]] = (int8_t)i;
    uint8_t *bytes = (uint8_t *)out;
    size_t nb = 0, cap = n * sizeof(float);
    uint32_t acc = 0;
    int bits = 0;
    for (; *s && *s != '='; s++) {
        int8_t v = map[(uint8_t)*s];
        if (v < 0) continue;
        acc = (acc << 6) | (uint32_t)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            if (nb < cap) bytes[nb] = (uint8_t)(acc >> bits);
            nb++;
        }
    }
    return nb / sizeof(float);
}

static double rel_l2(const float *x, const float *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)x[i] - ref[i]) * ((double)x[i] - ref[i]);
        den += (double)ref[i] * ref[i];
    }
    return sqrt(num / den);
}

/* What one run against the reference found. */
typedef struct golden_result {
    int32_t prompts, identical; /* prompts, and those whose N_GEN greedy tokens all match */
    int32_t full_checked, hidden_checked;
    double worst_logits, worst_top, worst_hidden;
} golden_result;

static golden_result run_golden(int32_t act_bits) {
    const cJSON *prompts = cJSON_GetObjectItem(golden, "prompts");
    int32_t np = cJSON_GetArraySize(prompts);
    assert_true(np >= 20 && np <= MAX_PROMPTS);
    const int32_t V = mdl->cfg.vocab, H = mdl->cfg.hidden;
    engine_config cfg = {.max_batch_tokens = 512,
                         .max_seqs = MAX_PROMPTS,
                         .max_seq_len = 384,
                         .kv_tokens = MAX_PROMPTS * 384,
                         .block_size = 16,
                         .threads = 2,
                         .act_bits = act_bits};
    engine *e;
    ae_error err = {0};
    if (engine_init(&e, mdl, &cfg, &err) != AE_OK) fail_msg("%s", err.msg);
    int32_t layers[FORWARD_MAX_CAPTURE];
    capture_default_layers(mdl->cfg.n_layers, layers);

    int32_t seq[MAX_PROMPTS], *ref_gen[MAX_PROMPTS], got[MAX_PROMPTS][N_GEN];
    float *logits = malloc(sizeof(float) * (size_t)V * MAX_PROMPTS);
    float *feat = malloc(sizeof(float) * 3 * (size_t)H), *ref = malloc(sizeof(float) * (size_t)V);
    double worst_logits = 0, worst_hidden = 0, worst_top = 0;
    int32_t full_checked = 0, hidden_checked = 0;
    for (int32_t p = 0; p < np; p++) {
        const cJSON *pr = cJSON_GetArrayItem(prompts, p);
        int32_t n, ng;
        int32_t *ids = int_array(cJSON_GetObjectItem(pr, "ids"), &n);
        ref_gen[p] = int_array(cJSON_GetObjectItem(pr, "generated"), &ng);
        assert_int_equal(ng, N_GEN);
        assert_int_equal(engine_seq_new(e, &seq[p], &err), AE_OK);
        int32_t last = n - 1;
        forward_capture cap = {3, {layers[0], layers[1], layers[2]}, 1, &last, feat};
        engine_item it = {seq[p], ENGINE_APPEND, n, ids, NULL, false};
        if (engine_step(e, &it, 1, &(engine_outputs){.logits = logits, .capture = &cap}, &err) != AE_OK)
            fail_msg("%s", err.msg);
        /* Final-position logits. */
        const cJSON *full = cJSON_GetObjectItem(pr, "logits_f32");
        if (full) {
            assert_int_equal(b64_floats(full->valuestring, ref, (size_t)V), (size_t)V);
            double r = rel_l2(logits, ref, (size_t)V);
            if (r > worst_logits) worst_logits = r;
            full_checked++;
        }
        int32_t nt;
        int32_t *top = int_array(cJSON_GetObjectItem(pr, "top_ids"), &nt);
        const cJSON *tl = cJSON_GetObjectItem(pr, "top_logits");
        double l2 = cJSON_GetObjectItem(pr, "logits_l2")->valuedouble;
        for (int32_t i = 0; i < nt; i++) {
            double d = fabs((double)logits[top[i]] - cJSON_GetArrayItem(tl, i)->valuedouble) / l2;
            if (d > worst_top) worst_top = d;
        }
        free(top);
        /* EAGLE-3 features: the inputs of layers 2, 15, 27. */
        const cJSON *hid = cJSON_GetObjectItem(pr, "hidden");
        if (hid) {
            for (int j = 0; j < 3; j++) {
                char key[8];
                snprintf(key, sizeof key, "%d", layers[j]);
                const cJSON *h = cJSON_GetObjectItem(hid, key);
                assert_non_null(h);
                assert_int_equal(b64_floats(h->valuestring, ref, (size_t)H), (size_t)H);
                double r = rel_l2(feat + (size_t)j * (size_t)H, ref, (size_t)H);
                if (r > worst_hidden) worst_hidden = r;
            }
            hidden_checked++;
        }
        int32_t b = 0;
        for (int32_t v = 1; v < V; v++)
            if (logits[v] > logits[b]) b = v;
        got[p][0] = b;
        free(ids);
    }
    /* Decode all prompts together, one token each per step. */
    engine_item items[MAX_PROMPTS];
    for (int32_t g = 1; g < N_GEN; g++) {
        for (int32_t p = 0; p < np; p++)
            items[p] = (engine_item){seq[p], ENGINE_APPEND, 1, &got[p][g - 1], NULL, false};
        if (engine_step(e, items, np, &(engine_outputs){.logits = logits}, &err) != AE_OK) fail_msg("%s", err.msg);
        for (int32_t p = 0; p < np; p++) {
            const float *x = logits + (size_t)p * (size_t)V;
            int32_t b = 0;
            for (int32_t v = 1; v < V; v++)
                if (x[v] > x[b]) b = v;
            got[p][g] = b;
        }
    }
    int32_t identical = 0;
    for (int32_t p = 0; p < np; p++) {
        int32_t first = -1;
        for (int32_t g = 0; g < N_GEN && first < 0; g++)
            if (got[p][g] != ref_gen[p][g]) first = g;
        if (first < 0)
            identical++;
        else
            printf("prompt %d (%s): first differs at token %d (ours %d, reference %d)\n", p,
                   cJSON_GetObjectItem(cJSON_GetArrayItem(prompts, p), "name")->valuestring, first, got[p][first],
                   ref_gen[p][first]);
        free(ref_gen[p]);
    }
    printf("golden (%d-bit activations): %d/%d prompts give the same %d greedy tokens; final logits rel L2 max "
           "%.3g (%d full vectors); top-20 logits max |diff|/L2 %.3g; captured features rel L2 max %.3g "
           "(%d prompts x 3 layers)\n",
           act_bits, identical, np, N_GEN, worst_logits, full_checked, worst_top, worst_hidden, hidden_checked);
    free(logits);
    free(feat);
    free(ref);
    engine_free(e);
    return (golden_result){np, identical, full_checked, hidden_checked, worst_logits, worst_top, worst_hidden};
}

static void test_matches_transformers(void **state) {
    (void)state;
    golden_result r = run_golden(15);
    assert_int_equal(r.identical, r.prompts);
    assert_true(r.full_checked >= 4 && r.worst_logits < 2e-3);
    assert_true(r.worst_top < 1e-4);
    assert_true(r.hidden_checked >= 3 && r.worst_hidden < 1e-3);
}

/* 8-bit activations round x to 1/127 of each block's largest magnitude,
 * so the logits move far more than at 15 bits. The bounds are what was
 * measured on this file (BOUNDS_8BIT below, with about 1.5x margin); a
 * change that makes the 8-bit path worse than that fails here. */
static void test_8bit_activations_stay_within_measured_bounds(void **state) {
    (void)state;
    golden_result r = run_golden(8);
    assert_true(r.identical >= MIN_IDENTICAL_8BIT);
    assert_true(r.full_checked >= 4 && r.worst_logits < MAX_LOGITS_8BIT);
    assert_true(r.worst_top < MAX_TOP_8BIT);
    assert_true(r.hidden_checked >= 3 && r.worst_hidden < MAX_HIDDEN_8BIT);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matches_transformers),
        cmocka_unit_test(test_8bit_activations_stay_within_measured_bounds),
    };
    return cmocka_run_group_tests_name("llama_golden", tests, setup, teardown);
}
