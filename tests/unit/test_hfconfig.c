/* config.json parsing: real configs read to exact values, and each kind of
 * bad config fails with an error that names the key. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "../../services/core/err.h"
#include "../../services/model/hfconfig.h"

/* SmolLM2-135M-Instruct's config, as published. */
static const char SMOLLM2[] = "{\n"
                              "  \"architectures\": [\"LlamaForCausalLM\"],\n"
                              "  \"attention_bias\": false,\n"
                              "  \"attention_dropout\": 0.0,\n"
                              "  \"bos_token_id\": 1,\n"
                              "  \"eos_token_id\": 2,\n"
                              "  \"hidden_act\": \"silu\",\n"
                              "  \"hidden_size\": 576,\n"
                              "  \"initializer_range\": 0.041666666666666664,\n"
                              "  \"intermediate_size\": 1536,\n"
                              "  \"is_llama_config\": true,\n"
                              "  \"max_position_embeddings\": 8192,\n"
                              "  \"model_type\": \"llama\",\n"
                              "  \"num_attention_heads\": 9,\n"
                              "  \"num_hidden_layers\": 30,\n"
                              "  \"num_key_value_heads\": 3,\n"
                              "  \"pad_token_id\": 2,\n"
                              "  \"pretraining_tp\": 1,\n"
                              "  \"rms_norm_eps\": 1e-05,\n"
                              "  \"rope_interleaved\": false,\n"
                              "  \"rope_scaling\": null,\n"
                              "  \"rope_theta\": 100000,\n"
                              "  \"tie_word_embeddings\": true,\n"
                              "  \"torch_dtype\": \"bfloat16\",\n"
                              "  \"transformers_version\": \"4.42.3\",\n"
                              "  \"use_cache\": true,\n"
                              "  \"vocab_size\": 49152\n"
                              "}\n";

static const char LLAMA31_8B[] = "{\"architectures\": [\"LlamaForCausalLM\"], \"attention_bias\": false,"
                                 " \"attention_dropout\": 0.0, \"bos_token_id\": 128000,"
                                 " \"eos_token_id\": [128001, 128008, 128009], \"hidden_act\": \"silu\","
                                 " \"hidden_size\": 4096, \"initializer_range\": 0.02,"
                                 " \"intermediate_size\": 14336, \"max_position_embeddings\": 131072,"
                                 " \"mlp_bias\": false, \"model_type\": \"llama\","
                                 " \"num_attention_heads\": 32, \"num_hidden_layers\": 32,"
                                 " \"num_key_value_heads\": 8, \"pretraining_tp\": 1,"
                                 " \"rms_norm_eps\": 1e-05,"
                                 " \"rope_scaling\": {\"factor\": 8.0, \"low_freq_factor\": 1.0,"
                                 "   \"high_freq_factor\": 4.0,"
                                 "   \"original_max_position_embeddings\": 8192,"
                                 "   \"rope_type\": \"llama3\"},"
                                 " \"rope_theta\": 500000.0, \"tie_word_embeddings\": false,"
                                 " \"torch_dtype\": \"bfloat16\", \"transformers_version\": \"4.43.0\","
                                 " \"use_cache\": true, \"vocab_size\": 128256}";

static const char QWEN25_05B[] = "{\"architectures\": [\"Qwen2ForCausalLM\"], \"attention_dropout\": 0.0,"
                                 " \"bos_token_id\": 151643, \"eos_token_id\": 151645,"
                                 " \"hidden_act\": \"silu\", \"hidden_size\": 896,"
                                 " \"initializer_range\": 0.02, \"intermediate_size\": 4864,"
                                 " \"max_position_embeddings\": 32768, \"max_window_layers\": 21,"
                                 " \"model_type\": \"qwen2\", \"num_attention_heads\": 14,"
                                 " \"num_hidden_layers\": 24, \"num_key_value_heads\": 2,"
                                 " \"rms_norm_eps\": 1e-06, \"rope_theta\": 1000000.0,"
                                 " \"sliding_window\": 32768, \"tie_word_embeddings\": true,"
                                 " \"torch_dtype\": \"bfloat16\", \"transformers_version\": \"4.43.1\","
                                 " \"use_cache\": true, \"use_sliding_window\": false,"
                                 " \"vocab_size\": 151936}";

/* An EAGLE-3 head for SmolLM2-135M in the published layout. */
static const char EAGLE3_HEAD[] = "{\"architectures\": [\"LlamaForCausalLMEagle3\"],"
                                  " \"bos_token_id\": 1, \"eos_token_id\": 2, \"hidden_act\": \"silu\","
                                  " \"hidden_size\": 576, \"intermediate_size\": 1536,"
                                  " \"max_position_embeddings\": 2048, \"model_type\": \"llama\","
                                  " \"num_attention_heads\": 9, \"num_key_value_heads\": 3,"
                                  " \"num_hidden_layers\": 1, \"pad_token_id\": 0, \"rms_norm_eps\": 1e-05,"
                                  " \"tie_word_embeddings\": false, \"torch_dtype\": \"float16\","
                                  " \"vocab_size\": 49152, \"draft_vocab_size\": 8192,"
                                  " \"eagle_config\": {\"eagle_aux_hidden_state_layer_ids\": [2, 14, 27],"
                                  "   \"use_aux_hidden_state\": true}}";

static int parse(hfconfig *c, const char *json, ae_error *err) {
    return hfconfig_parse(c, json, strlen(json), "config.json", err);
}

static void test_smollm2_config(void **state) {
    (void)state;
    hfconfig c;
    ae_error err = {0};
    assert_int_equal(parse(&c, SMOLLM2, &err), AE_OK);
    assert_string_equal(err.msg, "");
    assert_string_equal(c.architecture, "LlamaForCausalLM");
    assert_string_equal(c.model_type, "llama");
    assert_string_equal(c.torch_dtype, "bfloat16");
    assert_int_equal(c.hidden_size, 576);
    assert_int_equal(c.intermediate_size, 1536);
    assert_int_equal(c.num_hidden_layers, 30);
    assert_int_equal(c.num_attention_heads, 9);
    assert_int_equal(c.num_key_value_heads, 3);
    assert_int_equal(c.head_dim, 64);
    assert_int_equal(c.vocab_size, 49152);
    assert_true(c.rms_norm_eps == 1e-05);
    assert_true(c.rope_theta == 100000.0);
    assert_int_equal(c.max_position_embeddings, 8192);
    assert_true(c.tie_word_embeddings);
    assert_false(c.attention_bias);
    assert_int_equal(c.bos_token_id, 1);
    assert_int_equal(c.n_eos, 1);
    assert_int_equal(c.eos_token_ids[0], 2);
    assert_int_equal(c.rope_scaling.kind, HFCONFIG_ROPE_DEFAULT);
    assert_int_equal(c.draft_vocab_size, 0);
    assert_int_equal(c.n_aux_layers, 0);
}

/* transformers 5 writes rope_theta and the scaling together under
 * rope_parameters, and neither old key. */
static void test_transformers5_rope_parameters(void **state) {
    (void)state;
    hfconfig c;
    ae_error err = {0};
    const char *json = "{\"model_type\": \"llama\", \"hidden_size\": 64, \"intermediate_size\": 128,"
                       " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"vocab_size\": 256,"
                       " \"rms_norm_eps\": 1e-05, \"rope_parameters\": {\"rope_theta\": 500000.0,"
                       " \"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0,"
                       " \"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 64}}";
    if (parse(&c, json, &err) != AE_OK) fail_msg("%s", err.msg);
    assert_true(c.rope_theta == 500000.0);
    assert_int_equal(c.rope_scaling.kind, HFCONFIG_ROPE_LLAMA3);
    assert_true(c.rope_scaling.factor == 8.0);
    assert_int_equal(c.rope_scaling.original_max_position_embeddings, 64);
}

static void test_llama31_config_with_llama3_rope_scaling(void **state) {
    (void)state;
    hfconfig c;
    ae_error err = {0};
    assert_int_equal(parse(&c, LLAMA31_8B, &err), AE_OK);
    assert_int_equal(c.hidden_size, 4096);
    assert_int_equal(c.num_key_value_heads, 8);
    assert_int_equal(c.head_dim, 128);
    assert_int_equal(c.vocab_size, 128256);
    assert_true(c.rope_theta == 500000.0);
    assert_int_equal(c.max_position_embeddings, 131072);
    assert_false(c.tie_word_embeddings);
    assert_int_equal(c.bos_token_id, 128000);
    assert_int_equal(c.n_eos, 3);
    assert_int_equal(c.eos_token_ids[0], 128001);
    assert_int_equal(c.eos_token_ids[1], 128008);
    assert_int_equal(c.eos_token_ids[2], 128009);
    assert_int_equal(c.rope_scaling.kind, HFCONFIG_ROPE_LLAMA3);
    assert_true(c.rope_scaling.factor == 8.0);
    assert_true(c.rope_scaling.low_freq_factor == 1.0);
    assert_true(c.rope_scaling.high_freq_factor == 4.0);
    assert_int_equal(c.rope_scaling.original_max_position_embeddings, 8192);
}

static void test_qwen2_config_implies_attention_bias(void **state) {
    (void)state;
    hfconfig c;
    ae_error err = {0};
    assert_int_equal(parse(&c, QWEN25_05B, &err), AE_OK);
    assert_string_equal(c.architecture, "Qwen2ForCausalLM");
    assert_string_equal(c.model_type, "qwen2");
    assert_true(c.attention_bias);
    assert_int_equal(c.hidden_size, 896);
    assert_int_equal(c.num_attention_heads, 14);
    assert_int_equal(c.num_key_value_heads, 2);
    assert_int_equal(c.head_dim, 64);
    assert_true(c.rms_norm_eps == 1e-06);
    assert_true(c.rope_theta == 1000000.0);
    assert_int_equal(c.eos_token_ids[0], 151645);
    assert_true(c.tie_word_embeddings);
}

static void test_eagle3_head_config(void **state) {
    (void)state;
    hfconfig c;
    ae_error err = {0};
    assert_int_equal(parse(&c, EAGLE3_HEAD, &err), AE_OK);
    assert_string_equal(c.architecture, "LlamaForCausalLMEagle3");
    assert_string_equal(c.torch_dtype, "float16");
    assert_int_equal(c.num_hidden_layers, 1);
    assert_int_equal(c.draft_vocab_size, 8192);
    assert_int_equal(c.n_aux_layers, 3);
    assert_int_equal(c.aux_layer_ids[0], 2);
    assert_int_equal(c.aux_layer_ids[1], 14);
    assert_int_equal(c.aux_layer_ids[2], 27);
}

static void test_defaults_for_optional_keys(void **state) {
    (void)state;
    hfconfig c;
    ae_error err = {0};
    assert_int_equal(parse(&c,
                           "{\"hidden_size\": 64, \"intermediate_size\": 128,"
                           " \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
                           " \"vocab_size\": 100, \"rms_norm_eps\": 1e-6,"
                           " \"head_dim\": null, \"eos_token_id\": null,"
                           " \"dtype\": \"float32\"}",
                           &err),
                     AE_OK);
    assert_string_equal(c.architecture, "");
    assert_string_equal(c.model_type, "");
    assert_string_equal(c.torch_dtype, "float32");
    assert_int_equal(c.num_key_value_heads, 4);
    assert_int_equal(c.head_dim, 16);
    assert_true(c.rope_theta == 10000.0);
    assert_int_equal(c.max_position_embeddings, 2048);
    assert_false(c.tie_word_embeddings);
    assert_false(c.attention_bias);
    assert_int_equal(c.bos_token_id, -1);
    assert_int_equal(c.n_eos, 0);
}

static void test_explicit_head_dim_need_not_split_hidden(void **state) {
    (void)state;
    hfconfig c;
    assert_int_equal(parse(&c,
                           "{\"hidden_size\": 1024, \"intermediate_size\": 3072,"
                           " \"num_hidden_layers\": 2, \"num_attention_heads\": 16,"
                           " \"num_key_value_heads\": 8, \"head_dim\": 128,"
                           " \"vocab_size\": 1000, \"rms_norm_eps\": 1e-6}",
                           NULL),
                     AE_OK);
    assert_int_equal(c.head_dim, 128);
}

/* SmolLM2's config with one key replaced by raw JSON (NULL deletes it);
 * returns the parse error. */
static const char *bad(const char *key, const char *value) {
    static ae_error err;
    err_clear(&err);
    cJSON *root = cJSON_Parse(SMOLLM2);
    assert_non_null(root);
    cJSON_DeleteItemFromObjectCaseSensitive(root, key);
    if (value) {
        cJSON *v = cJSON_Parse(value);
        assert_non_null(v);
        cJSON_AddItemToObject(root, key, v);
    }
    char *text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    hfconfig c;
    memset(&c, 0xAB, sizeof c);
    assert_int_equal(parse(&c, text, &err), AE_ERR);
    assert_int_equal(c.hidden_size, 0); /* zeroed on failure */
    free(text);
    return err.msg;
}

static void test_missing_required_key(void **state) {
    (void)state;
    assert_string_equal(bad("hidden_size", NULL), "config.json: hidden_size: required key is missing");
    assert_string_equal(bad("vocab_size", NULL), "config.json: vocab_size: required key is missing");
    assert_string_equal(bad("rms_norm_eps", "null"), "config.json: rms_norm_eps: required key is missing");
}

static void test_wrong_types(void **state) {
    (void)state;
    assert_string_equal(bad("hidden_size", "\"576\""), "config.json: hidden_size: expected an integer, got a string");
    assert_string_equal(bad("num_hidden_layers", "30.5"), "config.json: num_hidden_layers: expected an "
                                                          "integer, got 30.5");
    assert_string_equal(bad("tie_word_embeddings", "\"true\""), "config.json: tie_word_embeddings: expected true or "
                                                                "false, got a string");
    assert_string_equal(bad("rms_norm_eps", "[1e-5]"), "config.json: rms_norm_eps: expected a number, got "
                                                       "an array");
    assert_string_equal(bad("model_type", "1"), "config.json: model_type: expected a string, got a "
                                                "number");
    assert_string_equal(bad("architectures", "\"LlamaForCausalLM\""),
                        "config.json: architectures: expected a non-empty "
                        "list");
    assert_string_equal(bad("architectures", "[]"), "config.json: architectures: expected a non-empty "
                                                    "list");
    assert_string_equal(bad("architectures", "[1]"), "config.json: architectures[0]: expected a string, "
                                                     "got a number");
    assert_string_equal(bad("eos_token_id", "\"2\""), "config.json: eos_token_id: expected an integer or a "
                                                      "list, got a string");
    assert_string_equal(bad("eos_token_id", "[2, \"x\"]"), "config.json: eos_token_id[1]: expected an integer, "
                                                           "got a string");
    assert_string_equal(bad("rope_scaling", "\"llama3\""), "config.json: rope_scaling: expected an object, got "
                                                           "a string");
}

static void test_heads_must_divide(void **state) {
    (void)state;
    assert_string_equal(bad("num_key_value_heads", "5"), "config.json: num_key_value_heads: 5 does not divide "
                                                         "num_attention_heads 9");
    assert_string_equal(bad("num_attention_heads", "7"), "config.json: num_key_value_heads: 3 does not divide "
                                                         "num_attention_heads 7");
    assert_string_equal(bad("num_attention_heads", "5"), "config.json: num_key_value_heads: 3 does not divide "
                                                         "num_attention_heads 5");
    assert_string_equal(bad("num_attention_heads", "15"), "config.json: num_attention_heads: 15 does not divide "
                                                          "hidden_size 576");
}

static void test_ranges(void **state) {
    (void)state;
    assert_string_equal(bad("hidden_size", "0"), "config.json: hidden_size: 0 is out of range "
                                                 "[1, 1048576]");
    assert_string_equal(bad("num_hidden_layers", "-1"), "config.json: num_hidden_layers: -1 is out of range "
                                                        "[1, 4096]");
    assert_string_equal(bad("vocab_size", "1e300"), "config.json: vocab_size: 1e+300 is out of range "
                                                    "[1, 16777216]");
    assert_string_equal(bad("rms_norm_eps", "0"), "config.json: rms_norm_eps: 0 is out of range (0, 1]");
    assert_string_equal(bad("rope_theta", "-5"), "config.json: rope_theta: -5 is out of range "
                                                 "(0, 1e+12]");
    assert_string_equal(bad("head_dim", "63"), "config.json: head_dim: 63 is odd; RoPE rotates pairs");
    assert_string_equal(bad("bos_token_id", "49152"), "config.json: bos_token_id: 49152 is out of range "
                                                      "[0, 49151]");
    assert_string_equal(bad("eos_token_id", "[1,2,3,4,5,6,7,8,9]"),
                        "config.json: eos_token_id: 9 entries, expected 1 to "
                        "8");
    assert_string_equal(bad("eos_token_id", "[2, -1]"), "config.json: eos_token_id[1]: -1 is out of range "
                                                        "[0, 49151]");
    assert_string_equal(bad("draft_vocab_size", "49153"), "config.json: draft_vocab_size: 49153 is out of "
                                                          "range [1, 49152]");
}

static void test_attention_bias_rules(void **state) {
    (void)state;
    assert_string_equal(bad("attention_bias", "1"), "config.json: attention_bias: expected true or "
                                                    "false, got a number");
    hfconfig c;
    ae_error err = {0};
    char text[2048];
    snprintf(text, sizeof text, "%.*s, \"attention_bias\": false}", (int)(strlen(QWEN25_05B) - 1), QWEN25_05B);
    assert_int_equal(parse(&c, text, &err), AE_ERR);
    assert_string_equal(err.msg, "config.json: attention_bias: false contradicts "
                                 "model_type qwen2 (always biased)");
    /* A llama with biases says so explicitly. */
    assert_int_equal(parse(&c,
                           "{\"hidden_size\": 64, \"intermediate_size\":"
                           " 128, \"num_hidden_layers\": 1,"
                           " \"num_attention_heads\": 4,"
                           " \"vocab_size\": 10, \"rms_norm_eps\": 1e-6,"
                           " \"attention_bias\": true}",
                           NULL),
                     AE_OK);
    assert_true(c.attention_bias);
}

/* DeepSeek-V3's YaRN, in transformers 5's spelling: the betas, both
 * mscales, and the cos/sin factor they make (1 when they are equal, else
 * their ratio, else 0.1 ln(factor) + 1). */
static void test_yarn(void **state) {
    (void)state;
    hfconfig c;
    cJSON *root = cJSON_Parse(SMOLLM2);
    cJSON_DeleteItemFromObjectCaseSensitive(root, "rope_scaling");
    cJSON_AddItemToObject(root, "rope_parameters",
                          cJSON_Parse("{\"rope_type\": \"yarn\", \"factor\": 40, \"beta_fast\": 32, \"beta_slow\": 1,"
                                      " \"mscale\": 1.0, \"mscale_all_dim\": 1.0, \"rope_theta\": 10000,"
                                      " \"original_max_position_embeddings\": 4096}"));
    char *text = cJSON_PrintUnformatted(root);
    assert_int_equal(parse(&c, text, NULL), AE_OK);
    free(text);
    assert_int_equal(c.rope_scaling.kind, HFCONFIG_ROPE_YARN);
    assert_true(c.rope_scaling.factor == 40.0 && c.rope_scaling.beta_fast == 32.0 && c.rope_scaling.beta_slow == 1.0);
    assert_int_equal(c.rope_scaling.original_max_position_embeddings, 4096);
    assert_true(c.rope_scaling.attention_factor == 1.0);
    kn_rope_config r = hfconfig_rope(&c);
    assert_true(r.yarn && r.factor == 40.0 && r.original_max_pos == 4096.0);
    /* no mscales: 0.1 ln 40 + 1 */
    cJSON_DeleteItemFromObjectCaseSensitive(root, "rope_parameters");
    cJSON_AddItemToObject(root, "rope_scaling", cJSON_Parse("{\"type\": \"yarn\", \"factor\": 40}"));
    text = cJSON_PrintUnformatted(root);
    assert_int_equal(parse(&c, text, NULL), AE_OK);
    free(text);
    assert_true(c.rope_scaling.attention_factor == 0.1 * log(40.0) + 1.0);
    assert_true(c.rope_scaling.beta_fast == 32.0 && c.rope_scaling.beta_slow == 1.0); /* the defaults */
    assert_int_equal(c.rope_scaling.original_max_position_embeddings, 0);             /* then max_position_embeddings */
    assert_true(hfconfig_rope(&c).original_max_pos == (double)c.max_position_embeddings);
    cJSON_Delete(root);
}

/* A multimodal config (Kimi-K2.5's) is read from its text_config, and its
 * errors say so. */
static void test_text_config(void **state) {
    (void)state;
    hfconfig c;
    ae_error err = {0};
    cJSON *outer = cJSON_CreateObject();
    cJSON_AddStringToObject(outer, "model_type", "kimi_k25");
    cJSON *text = cJSON_Parse(SMOLLM2);
    cJSON_DeleteItemFromObjectCaseSensitive(text, "model_type");
    cJSON_AddItemToObject(outer, "text_config", text);
    char *s = cJSON_PrintUnformatted(outer);
    assert_int_equal(parse(&c, s, NULL), AE_OK);
    free(s);
    assert_string_equal(c.model_type, "kimi_k25"); /* the outer one where the text model has none */
    assert_int_equal(c.hidden_size, 576);
    cJSON_AddStringToObject(text, "model_type", "kimi_k2");
    cJSON_DeleteItemFromObjectCaseSensitive(text, "hidden_size");
    s = cJSON_PrintUnformatted(outer);
    assert_int_equal(parse(&c, s, &err), AE_ERR);
    assert_string_equal(err.msg, "config.json: text_config.hidden_size: required key is missing");
    free(s);
    cJSON_Delete(outer);
}

static void test_rope_scaling_rules(void **state) {
    (void)state;
    assert_string_equal(bad("rope_scaling", "{\"rope_type\": \"dynamic\", \"factor\": 4.0}"),
                        "config.json: rope_scaling.rope_type: \"dynamic\" is not "
                        "supported (supported: default, llama3, yarn)");
    assert_string_equal(bad("rope_scaling", "{\"type\": \"linear\"}"),
                        "config.json: rope_scaling.type: \"linear\" is not "
                        "supported (supported: default, llama3, yarn)");
    assert_string_equal(bad("rope_scaling", "{\"type\": \"yarn\"}"),
                        "config.json: rope_scaling.factor: required key is missing");
    assert_string_equal(bad("rope_scaling", "{\"type\": \"yarn\", \"factor\": 0.5}"),
                        "config.json: rope_scaling.factor: 0.5 is below 1");
    assert_string_equal(bad("rope_scaling", "{\"factor\": 4.0}"),
                        "config.json: rope_scaling.rope_type: required key is "
                        "missing");
    assert_string_equal(bad("rope_scaling", "{\"rope_type\": \"llama3\", \"low_freq_factor\": 1.0,"
                                            " \"high_freq_factor\": 4.0,"
                                            " \"original_max_position_embeddings\": 8192}"),
                        "config.json: rope_scaling.factor: required key is missing");
    assert_string_equal(bad("rope_scaling", "{\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 4,"
                                            " \"high_freq_factor\": 4,"
                                            " \"original_max_position_embeddings\": 8192}"),
                        "config.json: rope_scaling.high_freq_factor: 4 is not above "
                        "low_freq_factor 4");
    assert_string_equal(bad("rope_scaling", "{\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 1,"
                                            " \"high_freq_factor\": 4}"),
                        "config.json: rope_scaling.original_max_position_embeddings: "
                        "required key is missing");
    /* The old key name still works, and "default" means none. */
    hfconfig c;
    cJSON *root = cJSON_Parse(SMOLLM2);
    cJSON_DeleteItemFromObjectCaseSensitive(root, "rope_scaling");
    cJSON_AddItemToObject(root, "rope_scaling", cJSON_Parse("{\"type\": \"default\"}"));
    char *text = cJSON_PrintUnformatted(root);
    assert_int_equal(parse(&c, text, NULL), AE_OK);
    assert_int_equal(c.rope_scaling.kind, HFCONFIG_ROPE_DEFAULT);
    free(text);
    cJSON_Delete(root);
}

static void test_eagle_config_rules(void **state) {
    (void)state;
    assert_string_equal(bad("eagle_config", "[1]"), "config.json: eagle_config: expected an object, got "
                                                    "an array");
    assert_string_equal(bad("eagle_config", "{\"eagle_aux_hidden_state_layer_ids\": 3}"),
                        "config.json: eagle_config.eagle_aux_hidden_state_layer_ids: "
                        "expected a list, got a number");
    assert_string_equal(bad("eagle_config", "{\"eagle_aux_hidden_state_layer_ids\": [1, -2]}"),
                        "config.json: eagle_config.eagle_aux_hidden_state_layer_ids[1]: -2 "
                        "is out of range [0, 65535]");
    assert_string_equal(bad("eagle_config", "{\"eagle_aux_hidden_state_layer_ids\": []}"),
                        "config.json: eagle_config.eagle_aux_hidden_state_layer_ids: 0 "
                        "entries, expected 1 to 8");
    assert_string_equal(bad("norm_before_residual", "1"),
                        "config.json: norm_before_residual: expected true or false, got a number");
}

/* vLLM reads the capture layers at the top level first; both places are
 * read here, and two different lists are refused. */
static void test_capture_layers_at_the_top_level(void **state) {
    (void)state;
    hfconfig c;
    ae_error err = {0};
    cJSON *root = cJSON_Parse(SMOLLM2);
    cJSON_AddItemToObject(root, "eagle_aux_hidden_state_layer_ids", cJSON_Parse("[1, 15, 26]"));
    cJSON_AddItemToObject(root, "norm_before_residual", cJSON_CreateFalse());
    char *text = cJSON_PrintUnformatted(root);
    assert_int_equal(parse(&c, text, &err), AE_OK);
    assert_int_equal(c.n_aux_layers, 3);
    assert_int_equal(c.aux_layer_ids[0], 1);
    assert_int_equal(c.aux_layer_ids[2], 26);
    assert_false(c.norm_before_residual);
    free(text);
    cJSON_AddItemToObject(root, "eagle_config", cJSON_Parse("{\"eagle_aux_hidden_state_layer_ids\": [1, 15, 26]}"));
    text = cJSON_PrintUnformatted(root);
    assert_int_equal(parse(&c, text, &err), AE_OK);
    assert_int_equal(c.n_aux_layers, 3);
    free(text);
    cJSON_DeleteItemFromObjectCaseSensitive(root, "eagle_config");
    cJSON_AddItemToObject(root, "eagle_config", cJSON_Parse("{\"eagle_aux_hidden_state_layer_ids\": [2, 15, 26]}"));
    text = cJSON_PrintUnformatted(root);
    assert_int_equal(parse(&c, text, &err), AE_ERR);
    assert_string_equal(err.msg, "config.json: eagle_aux_hidden_state_layer_ids and "
                                 "eagle_config.eagle_aux_hidden_state_layer_ids differ");
    free(text);
    cJSON_Delete(root);
}

static void test_not_json(void **state) {
    (void)state;
    hfconfig c;
    ae_error err = {0};
    assert_int_equal(parse(&c, "{\"hidden_size\": ", &err), AE_ERR);
    assert_string_equal(err.msg, "config.json: not valid JSON (near byte 15)");
    err_clear(&err);
    /* A second value after the first is not silently ignored. */
    assert_int_equal(parse(&c, "{\"hidden_size\": 8} {\"hidden_size\": 9}", &err), AE_ERR);
    assert_string_equal(err.msg, "config.json: trailing data after the JSON value at byte 19");
    err_clear(&err);
    assert_int_equal(parse(&c, "[]", &err), AE_ERR);
    assert_string_equal(err.msg, "config.json: expected a JSON object, got an array");
    err_clear(&err);
    assert_int_equal(hfconfig_parse(&c, "", 0, "x/config.json", &err), AE_ERR);
    assert_string_equal(err.msg, "x/config.json: not valid JSON (near byte 0)");
}

static void test_load_reads_a_file(void **state) {
    (void)state;
    char path[] = "/tmp/aerie-hfcfg-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, SMOLLM2, strlen(SMOLLM2)), (ssize_t)strlen(SMOLLM2));
    close(fd);
    hfconfig c;
    ae_error err = {0};
    assert_int_equal(hfconfig_load(&c, path, &err), AE_OK);
    assert_int_equal(c.num_hidden_layers, 30);
    unlink(path);
    assert_int_equal(hfconfig_load(&c, path, &err), AE_ERR);
    char want[128];
    snprintf(want, sizeof want, "%s: cannot open: No such file or directory", path);
    assert_string_equal(err.msg, want);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_smollm2_config),
        cmocka_unit_test(test_llama31_config_with_llama3_rope_scaling),
        cmocka_unit_test(test_transformers5_rope_parameters),
        cmocka_unit_test(test_qwen2_config_implies_attention_bias),
        cmocka_unit_test(test_eagle3_head_config),
        cmocka_unit_test(test_defaults_for_optional_keys),
        cmocka_unit_test(test_explicit_head_dim_need_not_split_hidden),
        cmocka_unit_test(test_missing_required_key),
        cmocka_unit_test(test_wrong_types),
        cmocka_unit_test(test_heads_must_divide),
        cmocka_unit_test(test_ranges),
        cmocka_unit_test(test_attention_bias_rules),
        cmocka_unit_test(test_rope_scaling_rules),
        cmocka_unit_test(test_yarn),
        cmocka_unit_test(test_text_config),
        cmocka_unit_test(test_eagle_config_rules),
        cmocka_unit_test(test_capture_layers_at_the_top_level),
        cmocka_unit_test(test_not_json),
        cmocka_unit_test(test_load_reads_a_file),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
