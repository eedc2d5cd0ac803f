/* The EAGLE-3 head loader and forward pass against the fixture of
 * tools/gen_eagle_fixture.py (tests/golden/eagle/tiny/): a tiny random
 * Llama target in Hugging Face and GGUF form, and a head for it whose
 * forward pass the script computed with numpy (float64) and checked
 * against torch. Run from the repo root. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "../test_io.h"

#include "../../draft/eagle.h"
#include "../../services/kv/kv.h"
#include "../../target/engine.h"

#define FIX "tests/golden/eagle/tiny"
/* The references are f32 throughout; the engine keeps K and V in f16
 * (kernels.h), whose unit roundoff 2^-11 = 4.9e-4 bounds the relative
 * error of each stored element. The outputs move by about half that
 * (3.2e-4 at worst here, against 3e-7 with an f32 cache), so the bound
 * is one f16 unit roundoff (it was 1e-4 with the f32 cache). */
#define REL_TOL 4.9e-4

static cJSON *expected(void) {
    char *text = test_read_file(FIX "/expected.json", NULL);
    cJSON *root = cJSON_Parse(text);
    free(text);
    assert_non_null(root);
    return root;
}

static const cJSON *item(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v) fail_msg("expected.json: no \"%s\"", key);
    return v;
}

/* Numbers of a JSON array, flattening one level of nesting. */
static int32_t json_floats(const cJSON *arr, float *out, int32_t cap) {
    int32_t n = 0;
    const cJSON *v;
    cJSON_ArrayForEach(v, arr) {
        if (cJSON_IsArray(v)) {
            n += json_floats(v, out + n, cap - n);
            continue;
        }
        assert_true(n < cap && cJSON_IsNumber(v));
        out[n++] = (float)v->valuedouble;
    }
    return n;
}

static int32_t json_ints(const cJSON *arr, int32_t *out, int32_t cap) {
    float tmp[256];
    int32_t n = json_floats(arr, tmp, cap < 256 ? cap : 256);
    for (int32_t i = 0; i < n; i++) out[i] = (int32_t)tmp[i];
    return n;
}

static double rel_l2(const float *got, const float *want, int32_t n) {
    double num = 0, den = 0;
    for (int32_t i = 0; i < n; i++) {
        double d = (double)got[i] - want[i];
        num += d * d;
        den += (double)want[i] * want[i];
    }
    return sqrt(num / den);
}

static model *load_target(const char *path) {
    model *m;
    ae_error err = {0};
    if (model_load(&m, path, &kn_backend_cpu, &err) != AE_OK) fail_msg("%s", err.msg);
    return m;
}

static eagle_target target_of(const model *m) {
    return (eagle_target){m->cfg.hidden, m->cfg.vocab, m->cfg.n_layers, &m->tok_embd};
}

/* A head's forward pass over one sequence's KV, for the reference steps. */
typedef struct runner {
    kv_cache *kv;
    kn_kv_pool layer;
    pool *p;
    kn_stream *s;
    eagle_ws *ws;
    int32_t seq;
} runner;

static void runner_open(runner *r, const eagle_head *h) {
    ae_error err = {0};
    kv_params kp = {1, h->cfg.n_kv_heads, h->cfg.head_dim, 16, 1, 1, 1, false};
    if (kv_init(&r->kv, &kn_backend_cpu, &kp, &err) != AE_OK) fail_msg("%s", err.msg);
    r->layer = kv_layer(r->kv, 0);
    assert_int_equal(pool_init(&r->p, 2, &err), AE_OK);
    assert_int_equal(
        kn_stream_init(&r->s, &kn_backend_cpu, &(kn_stream_config){r->p, eagle_stream_workspace(h, 8, 16)}, &err),
        AE_OK);
    assert_int_equal(eagle_ws_init(&r->ws, h, 8, &err), AE_OK);
    assert_int_equal(kv_seq_alloc(r->kv, &r->seq, &err), AE_OK);
    assert_int_equal(kv_seq_reserve(r->kv, r->seq, 6, &err), AE_OK);
}

static void runner_close(runner *r) {
    eagle_ws_free(r->ws);
    kn_stream_free(r->s);
    pool_free(r->p);
    kv_free(r->kv);
}

/* n tokens at positions pos[n], each seeing the slots up to its own; in
 * is [n][width]. Writes hidden [n][H] and logits [n][draft_vocab]. */
static void runner_step(runner *r, const eagle_head *h, int32_t n, const int32_t *tokens, const int32_t *pos,
                        const float *in, int32_t width, float *hidden, float *logits) {
    int32_t seqs[5], n_prefix[5], zero[5] = {0}, rows[5];
    float in_copy[5 * 96];
    assert_true(n <= 5 && width <= 96);
    memcpy(in_copy, in, (size_t)n * (size_t)width * sizeof(float));
    for (int32_t i = 0; i < n; i++) {
        seqs[i] = r->seq;
        n_prefix[i] = pos[i] + 1;
        rows[i] = i;
    }
    kn_kv_map map = {n, kv_map_tables(r->kv), 1, 1, seqs, pos, n_prefix, zero, zero, zero, 0, 0};
    eagle_batch b = {n, tokens, in_copy, width, pos, &map, hidden, n, rows, logits};
    eagle_forward(h, r->s, &r->layer, r->ws, &b);
}

/* Steps A and B of the reference (gen_eagle_fixture.py) through
 * eagle_forward: five (token, feature) pairs at positions 0..4, then one
 * token at position 5 fed the last pair's pre-norm output. */
static void check_head_reference(const char *target_path) {
    model *m = load_target(target_path);
    eagle_target t = target_of(m);
    eagle_head *h;
    ae_error err = {0};
    if (eagle_load(&h, FIX "/head", &t, EAGLE_WEIGHTS_FILE, &err) != AE_OK) fail_msg("%s", err.msg);
    const int32_t H = 32, Vd = 24;
    assert_int_equal(h->cfg.draft_vocab, Vd);
    assert_int_equal(h->cfg.n_aux_layers, 3);
    assert_int_equal(h->cfg.aux_layers[0], 1);
    assert_int_equal(h->cfg.aux_layers[1], 3);
    assert_int_equal(h->cfg.aux_layers[2], 4);

    runner run;
    runner_open(&run, h);

    cJSON *root = expected();
    const cJSON *ref = item(root, "head_reference");
    const char *steps[2] = {"step_a", "step_b"};
    float feat[5 * 96], hidden[5 * 32], logits[5 * 24], want_logits[5 * 24], want_hidden[5 * 32];
    int32_t tokens[5], pos[5], target_argmax[5];
    for (int st = 0; st < 2; st++) {
        const cJSON *r = item(ref, steps[st]);
        int32_t n = json_ints(item(r, "tokens"), tokens, 5);
        assert_int_equal(json_ints(item(r, "positions"), pos, 5), n);
        assert_int_equal(json_floats(item(r, "logits"), want_logits, 5 * 24), n * Vd);
        assert_int_equal(json_floats(item(r, "hidden"), want_hidden, 5 * 32), n * H);
        assert_int_equal(json_ints(item(r, "target_argmax"), target_argmax, 5), n);
        const float *in = hidden + 4 * H; /* step B: step A's last output */
        int32_t width = H;
        if (st == 0) {
            assert_int_equal(json_floats(item(r, "features"), feat, 5 * 96), n * 3 * H);
            in = feat;
            width = 3 * H;
        }
        runner_step(&run, h, n, tokens, pos, in, width, hidden, logits);
        double el = rel_l2(logits, want_logits, n * Vd), eh = rel_l2(hidden, want_hidden, n * H);
        printf("%s (%s): logits rel L2 %.3g, hidden rel L2 %.3g\n", steps[st], target_path, el, eh);
        assert_true(el < REL_TOL);
        assert_true(eh < REL_TOL);
        for (int32_t i = 0; i < n; i++) {
            int32_t best = 0;
            for (int32_t v = 1; v < Vd; v++)
                if (logits[i * Vd + v] > logits[i * Vd + best]) best = v;
            assert_int_equal(h->draft_to_target[best], target_argmax[i]);
        }
    }
    cJSON_Delete(root);
    runner_close(&run);
    eagle_free(h);
    model_free(m);
}

static void test_head_matches_the_numpy_reference_on_the_hf_target(void **state) {
    (void)state;
    check_head_reference(FIX "/target");
}

/* The head takes the target's embedding table: the GGUF form holds the
 * same values, so the same outputs. */
static void test_head_matches_the_numpy_reference_on_the_gguf_target(void **state) {
    (void)state;
    check_head_reference(FIX "/target.gguf");
}

/* Both forms of the fixture target give transformers' greedy tokens: the
 * head's features come from a target that is right. */
static void test_fixture_target_forms_match_transformers(void **state) {
    (void)state;
    const char *paths[2] = {FIX "/target", FIX "/target.gguf"};
    cJSON *root = expected();
    for (int f = 0; f < 2; f++) {
        model *m = load_target(paths[f]);
        engine_config cfg = {64, 1, 64, 64, 16, 2, 0};
        engine *e;
        ae_error err = {0};
        if (engine_init(&e, m, &cfg, &err) != AE_OK) fail_msg("%s", err.msg);
        const cJSON *p;
        int32_t n_prompts = 0;
        cJSON_ArrayForEach(p, item(root, "target_greedy")) {
            int32_t ids[32], want[16], seq;
            int32_t n = json_ints(item(p, "ids"), ids, 32);
            assert_int_equal(json_ints(item(p, "generated"), want, 16), 16);
            assert_int_equal(engine_seq_new(e, &seq, &err), AE_OK);
            float lg[32];
            engine_item it = {seq, ENGINE_APPEND, n, ids, NULL, false};
            assert_int_equal(engine_step(e, &it, 1, &(engine_outputs){.logits = lg}, &err), AE_OK);
            for (int32_t g = 0; g < 16; g++) {
                int32_t best = 0;
                for (int32_t v = 1; v < 32; v++)
                    if (lg[v] > lg[best]) best = v;
                assert_int_equal(best, want[g]);
                engine_item d = {seq, ENGINE_APPEND, 1, &best, NULL, false};
                assert_int_equal(engine_step(e, &d, 1, &(engine_outputs){.logits = lg}, &err), AE_OK);
            }
            engine_seq_free(e, seq);
            n_prompts++;
        }
        assert_int_equal(n_prompts, 4);
        engine_free(e);
        model_free(m);
    }
    cJSON_Delete(root);
}

static void expect_refused(const char *dir, const eagle_target *t, const char *want) {
    eagle_head *h = (eagle_head *)1;
    ae_error err = {0};
    assert_int_equal(eagle_load(&h, dir, t, EAGLE_WEIGHTS_FILE, &err), AE_ERR);
    assert_null(h);
    if (!strstr(err.msg, want)) fail_msg("error \"%s\" does not say \"%s\"", err.msg, want);
    printf("refused: %s\n", err.msg);
}

/* A head for a target of another width: the first tensor that does not
 * fit is named with both shapes. */
static void test_head_for_another_target_width_is_refused(void **state) {
    (void)state;
    model *m = load_target(FIX "/target");
    eagle_target t = target_of(m);
    t.hidden = 48;
    expect_refused(FIX "/head", &t, "fc.weight is [32, 96], the target (hidden 48) needs [48, 144]");
    model_free(m);
}

/* d2t pointing past the target's vocabulary: refused, naming the entry. */
static void test_head_for_a_smaller_vocabulary_is_refused(void **state) {
    (void)state;
    model *m = load_target(FIX "/target");
    eagle_target t = target_of(m);
    t.vocab = 30; /* the draft vocabulary ends with target id 31 */
    expect_refused(FIX "/head", &t, "outside the target's vocabulary of 30");
    model_free(m);
}

/* The fixture head copied to a temporary directory with the first `from`
 * in its config.json replaced by `to`, then loaded: refused with `want`
 * in the message. */
static void expect_edited_head_refused(const char *from, const char *to, const char *want) {
    char dir[] = "/tmp/aerie-eagle-XXXXXX";
    assert_non_null(mkdtemp(dir));
    size_t len;
    char *cfg = test_read_file(FIX "/head/config.json", NULL),
         *st = test_read_file(FIX "/head/model.safetensors", &len);
    char *at = strstr(cfg, from);
    assert_non_null(at);
    char path[256];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fprintf(f, "%.*s%s%s", (int)(at - cfg), cfg, to, at + strlen(from));
    fclose(f);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(st, 1, len, f), len);
    fclose(f);
    model *m = load_target(FIX "/target");
    eagle_target t = target_of(m);
    expect_refused(dir, &t, want);
    model_free(m);
    unlink(path);
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    rmdir(dir);
    free(cfg);
    free(st);
}

/* A config.json that disagrees with the tensors: lm_head named with both
 * shapes. */
static void test_head_whose_config_disagrees_with_its_tensors_is_refused(void **state) {
    (void)state;
    expect_edited_head_refused("\"draft_vocab_size\": 24", "\"draft_vocab_size\": 20",
                               "lm_head.weight is [24, 32], config.json's draft_vocab_size needs [20, 32]");
}

/* Variants of the midlayer the forward pass does not compute are refused,
 * not run wrong. */
static void test_head_variants_we_do_not_compute_are_refused(void **state) {
    (void)state;
    expect_edited_head_refused("\"draft_vocab_size\"", "\"attention_bias\": true, \"draft_vocab_size\"",
                               "attention_bias is true; heads with q/k/v/o biases are not supported");
    expect_edited_head_refused("\"draft_vocab_size\"", "\"norm_before_residual\": true, \"draft_vocab_size\"",
                               "norm_before_residual is true; only the residual before hidden_norm is supported");
}

/* Rounded to Q8_0 for speed, the head stays close to the reference: its
 * matrices read 1.06 bytes per weight instead of 2, and the logits move
 * by the rounding of 8-bit weights. */
static void test_head_rounded_to_q8_0_stays_close_to_the_reference(void **state) {
    (void)state;
    model *m = load_target(FIX "/target");
    eagle_target t = target_of(m);
    eagle_head *h, *exact;
    ae_error err = {0};
    assert_int_equal(eagle_load(&h, FIX "/head", &t, EAGLE_WEIGHTS_Q8_0, &err), AE_OK);
    assert_int_equal(eagle_load(&exact, FIX "/head", &t, EAGLE_WEIGHTS_FILE, &err), AE_OK);
    assert_int_equal(h->fc.type, GGML_TYPE_Q8_0);
    assert_int_equal(h->lm_head.type, GGML_TYPE_Q8_0);
    assert_int_equal(exact->fc.type, GGML_TYPE_F16);
    assert_true(h->weight_bytes < exact->weight_bytes * 6 / 5); /* Q8_0 and its packed copy vs F16 */
    runner run;
    runner_open(&run, h);
    cJSON *root = expected();
    const cJSON *r = item(item(root, "head_reference"), "step_a");
    float feat[5 * 96], hidden[5 * 32], logits[5 * 24], want[5 * 24];
    int32_t tokens[5], pos[5];
    assert_int_equal(json_ints(item(r, "tokens"), tokens, 5), 5);
    assert_int_equal(json_ints(item(r, "positions"), pos, 5), 5);
    assert_int_equal(json_floats(item(r, "features"), feat, 5 * 96), 5 * 96);
    assert_int_equal(json_floats(item(r, "logits"), want, 5 * 24), 5 * 24);
    runner_step(&run, h, 5, tokens, pos, feat, 96, hidden, logits);
    double e = rel_l2(logits, want, 5 * 24);
    printf("q8_0 head, step A: logits rel L2 %.3g (weights %zu bytes, file %zu)\n", e, h->weight_bytes,
           exact->weight_bytes);
    assert_true(e > 1e-6 && e < 2e-2);
    cJSON_Delete(root);
    runner_close(&run);
    eagle_free(exact);
    eagle_free(h);
    model_free(m);
}

static void test_missing_head_directory_is_refused(void **state) {
    (void)state;
    model *m = load_target(FIX "/target");
    eagle_target t = target_of(m);
    expect_refused("/nonexistent/head", &t, "/nonexistent/head/config.json");
    model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_head_matches_the_numpy_reference_on_the_hf_target),
        cmocka_unit_test(test_head_matches_the_numpy_reference_on_the_gguf_target),
        cmocka_unit_test(test_fixture_target_forms_match_transformers),
        cmocka_unit_test(test_head_for_another_target_width_is_refused),
        cmocka_unit_test(test_head_for_a_smaller_vocabulary_is_refused),
        cmocka_unit_test(test_head_whose_config_disagrees_with_its_tensors_is_refused),
        cmocka_unit_test(test_head_variants_we_do_not_compute_are_refused),
        cmocka_unit_test(test_head_rounded_to_q8_0_stays_close_to_the_reference),
        cmocka_unit_test(test_missing_head_directory_is_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
