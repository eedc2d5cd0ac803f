#include "hfconfig.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../core/file.h"
#include "../core/json.h"

/* Upper bounds: far above any real model, low enough that products of two
 * of them (hidden * vocab, heads * head_dim) cannot overflow int64. */
#define DIM_MAX (1 << 20)
#define FFN_MAX (1 << 22)
#define LAYERS_MAX 4096
#define HEADS_MAX 4096
#define VOCAB_MAX (1 << 24)
#define POS_MAX (1 << 30)
#define LAYER_ID_MAX 65535

/* Absent and JSON null read the same: many configs write "head_dim": null
 * or "rope_scaling": null to mean "use the default". */
static const cJSON *get(const cJSON *obj, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

static const char *kind(const cJSON *v) {
    if (cJSON_IsString(v)) return "a string";
    if (cJSON_IsNumber(v)) return "a number";
    if (cJSON_IsBool(v)) return "a bool";
    if (cJSON_IsArray(v)) return "an array";
    if (cJSON_IsObject(v)) return "an object";
    return "null";
}

/* An integral number in [lo, hi]; `label` names the key in errors. */
static int as_int(const cJSON *v, const char *label, int64_t lo, int64_t hi, int32_t *out, ae_error *err) {
    int64_t i;
    if (json_int(v, lo, hi, &i)) {
        *out = (int32_t)i;
        return AE_OK;
    }
    if (!cJSON_IsNumber(v)) return err_set(err, "%s: expected an integer, got %s", label, kind(v));
    double d = v->valuedouble;
    if (!isfinite(d) || d != trunc(d)) return err_set(err, "%s: expected an integer, got %.17g", label, d);
    return err_set(err,
                   fabs(d) < 1e15 ? "%s: %.0f is out of range [%lld, %lld]" : "%s: %g is out of range [%lld, %lld]",
                   label, d, (long long)lo, (long long)hi);
}

/* Optional integer key: leaves *out (the default) when absent. */
static int opt_int(const cJSON *obj, const char *key, const char *label, int64_t lo, int64_t hi, int32_t *out,
                   ae_error *err) {
    const cJSON *v = get(obj, key);
    return v ? as_int(v, label, lo, hi, out, err) : AE_OK;
}

static int req_int(const cJSON *obj, const char *key, const char *label, int64_t lo, int64_t hi, int32_t *out,
                   ae_error *err) {
    const cJSON *v = get(obj, key);
    if (!v) return err_set(err, "%s: required key is missing", label);
    return as_int(v, label, lo, hi, out, err);
}

/* A finite number with lo < x <= hi. */
static int as_double(const cJSON *v, const char *label, double lo, double hi, double *out, ae_error *err) {
    if (!cJSON_IsNumber(v)) return err_set(err, "%s: expected a number, got %s", label, kind(v));
    double d = v->valuedouble;
    if (!isfinite(d) || !(d > lo && d <= hi)) return err_set(err, "%s: %g is out of range (%g, %g]", label, d, lo, hi);
    *out = d;
    return AE_OK;
}

static int opt_bool(const cJSON *obj, const char *key, bool *out, ae_error *err) {
    const cJSON *v = get(obj, key);
    if (!v) return AE_OK;
    if (!cJSON_IsBool(v)) return err_set(err, "%s: expected true or false, got %s", key, kind(v));
    *out = cJSON_IsTrue(v);
    return AE_OK;
}

static int as_text(const cJSON *v, const char *label, char *dst, ae_error *err) {
    if (!cJSON_IsString(v)) return err_set(err, "%s: expected a string, got %s", label, kind(v));
    size_t len = strlen(v->valuestring);
    if (len >= HFCONFIG_MAX_TEXT) return err_set(err, "%s: %zu bytes exceeds %d", label, len, HFCONFIG_MAX_TEXT - 1);
    memcpy(dst, v->valuestring, len + 1);
    return AE_OK;
}

static int opt_text(const cJSON *obj, const char *key, char *dst, ae_error *err) {
    const cJSON *v = get(obj, key);
    return v ? as_text(v, key, dst, err) : AE_OK;
}

/* An int or a list of ints, each in [lo, hi], at most `max` of them. */
static int int_list(const cJSON *v, const char *label, int64_t lo, int64_t hi, int32_t *dst, uint32_t max, uint32_t *n,
                    ae_error *err) {
    if (cJSON_IsNumber(v)) {
        *n = 1;
        return as_int(v, label, lo, hi, &dst[0], err);
    }
    if (!cJSON_IsArray(v)) return err_set(err, "%s: expected an integer or a list, got %s", label, kind(v));
    int count = cJSON_GetArraySize(v);
    if (count < 1 || (uint32_t)count > max) return err_set(err, "%s: %d entries, expected 1 to %u", label, count, max);
    const cJSON *c;
    uint32_t i = 0;
    cJSON_ArrayForEach(c, v) {
        char item[96];
        snprintf(item, sizeof item, "%s[%u]", label, i);
        if (as_int(c, item, lo, hi, &dst[i], err) != AE_OK) return AE_ERR;
        i++;
    }
    *n = i;
    return AE_OK;
}

/* YaRN's numbers; original_max_position_embeddings 0 when absent (then
 * max_position_embeddings, as transformers reads it). */
static int parse_yarn(hfconfig *cfg, const cJSON *rs, const char *key, ae_error *err) {
    char label[96];
    cfg->rope_scaling.kind = HFCONFIG_ROPE_YARN;
    cfg->rope_scaling.beta_fast = 32.0;
    cfg->rope_scaling.beta_slow = 1.0;
    static const char *const names[5] = {"factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"};
    double *dst[5] = {&cfg->rope_scaling.factor, &cfg->rope_scaling.beta_fast, &cfg->rope_scaling.beta_slow,
                      &cfg->rope_scaling.mscale, &cfg->rope_scaling.mscale_all_dim};
    for (int i = 0; i < 5; i++) {
        const cJSON *v = get(rs, names[i]);
        snprintf(label, sizeof label, "%s.%s", key, names[i]);
        if (!v && i == 0) return err_set(err, "%s: required key is missing", label);
        if (v && as_double(v, label, 0.0, 1e6, dst[i], err) != AE_OK) return AE_ERR;
    }
    if (cfg->rope_scaling.factor < 1.0) return err_set(err, "%s.factor: %g is below 1", key, cfg->rope_scaling.factor);
    if (!(cfg->rope_scaling.beta_fast > 0.0 && cfg->rope_scaling.beta_slow > 0.0))
        return err_set(err, "%s: beta_fast and beta_slow must be > 0", key);
    /* The factor YaRN puts on cos and sin: given, or the ratio of the two
     * mscales, or 0.1 ln(factor) + 1 (transformers' rule). */
    double f = cfg->rope_scaling.factor, ms = cfg->rope_scaling.mscale, ma = cfg->rope_scaling.mscale_all_dim;
#define MSCALE(m) (f <= 1.0 ? 1.0 : 0.1 * (m) * log(f) + 1.0)
    cfg->rope_scaling.attention_factor = ms > 0.0 && ma > 0.0 ? MSCALE(ms) / MSCALE(ma) : MSCALE(1.0);
#undef MSCALE
    const cJSON *v = get(rs, "attention_factor");
    snprintf(label, sizeof label, "%s.attention_factor", key);
    if (v && as_double(v, label, 0.0, 1e6, &cfg->rope_scaling.attention_factor, err) != AE_OK) return AE_ERR;
    snprintf(label, sizeof label, "%s.original_max_position_embeddings", key);
    return opt_int(rs, "original_max_position_embeddings", label, 1, POS_MAX,
                   &cfg->rope_scaling.original_max_position_embeddings, err);
}

/* `key` is "rope_scaling" (transformers 4) or "rope_parameters"
 * (transformers 5, which writes the same fields there, rope_theta and
 * rope_type "default" included, and no longer writes the other two keys),
 * a literal: cfg keeps it. */
static int parse_rope_scaling(hfconfig *cfg, const cJSON *rs, const char *key, ae_error *err) {
    char label[80];
    if (!cJSON_IsObject(rs)) return err_set(err, "%s: expected an object, got %s", key, kind(rs));
    cfg->rope_scaling.key = key;
    /* transformers renamed "type" to "rope_type"; older files have only the
     * former. */
    snprintf(label, sizeof label, "%s.rope_type", key);
    const cJSON *t = get(rs, "rope_type");
    if (!t && (t = get(rs, "type"))) snprintf(label, sizeof label, "%s.type", key);
    if (!t) return err_set(err, "%s.rope_type: required key is missing", key);
    char type[HFCONFIG_MAX_TEXT];
    if (as_text(t, label, type, err) != AE_OK) return AE_ERR;
    if (strcmp(type, "default") == 0) {
        cfg->rope_scaling.kind = HFCONFIG_ROPE_DEFAULT;
        return AE_OK;
    }
    /* Other schemes (linear, dynamic, yarn, ...) change the numbers; serving
     * them as plain RoPE would be silently wrong, so refuse. */
    if (strcmp(type, "yarn") == 0) return parse_yarn(cfg, rs, key, err);
    if (strcmp(type, "llama3") != 0)
        return err_set(err,
                       "%s: \"%s\" is not supported (supported: default, "
                       "llama3, yarn)",
                       label, type);
    cfg->rope_scaling.kind = HFCONFIG_ROPE_LLAMA3;
    static const char *const names[3] = {"factor", "low_freq_factor", "high_freq_factor"};
    double *dst[3] = {&cfg->rope_scaling.factor, &cfg->rope_scaling.low_freq_factor,
                      &cfg->rope_scaling.high_freq_factor};
    for (int i = 0; i < 3; i++) {
        const cJSON *v = get(rs, names[i]);
        snprintf(label, sizeof label, "%s.%s", key, names[i]);
        if (!v) return err_set(err, "%s: required key is missing", label);
        if (as_double(v, label, 0.0, 1e6, dst[i], err) != AE_OK) return AE_ERR;
    }
    /* The llama3 rule interpolates between the two wavelength bounds,
     * dividing by (high - low). */
    if (!(cfg->rope_scaling.high_freq_factor > cfg->rope_scaling.low_freq_factor))
        return err_set(err,
                       "%s.high_freq_factor: %g is not above "
                       "low_freq_factor %g",
                       key, cfg->rope_scaling.high_freq_factor, cfg->rope_scaling.low_freq_factor);
    snprintf(label, sizeof label, "%s.original_max_position_embeddings", key);
    return req_int(rs, "original_max_position_embeddings", label, 1, POS_MAX,
                   &cfg->rope_scaling.original_max_position_embeddings, err);
}

static int parse_root(hfconfig *c, const cJSON *root, ae_error *err) {
    if (!cJSON_IsObject(root)) return err_set(err, "expected a JSON object, got %s", kind(root));

    const cJSON *v = get(root, "architectures");
    if (v) {
        if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) < 1)
            return err_set(err, "architectures: expected a non-empty list");
        if (as_text(v->child, "architectures[0]", c->architecture, err) != AE_OK) return AE_ERR;
    }
    if (opt_text(root, "model_type", c->model_type, err) != AE_OK) return AE_ERR;
    /* Newer transformers write "dtype" instead of "torch_dtype". */
    if (opt_text(root, "torch_dtype", c->torch_dtype, err) != AE_OK) return AE_ERR;
    if (!c->torch_dtype[0] && opt_text(root, "dtype", c->torch_dtype, err)) return AE_ERR;

    if (req_int(root, "hidden_size", "hidden_size", 1, DIM_MAX, &c->hidden_size, err) ||
        req_int(root, "intermediate_size", "intermediate_size", 1, FFN_MAX, &c->intermediate_size, err) ||
        req_int(root, "num_hidden_layers", "num_hidden_layers", 1, LAYERS_MAX, &c->num_hidden_layers, err) ||
        req_int(root, "num_attention_heads", "num_attention_heads", 1, HEADS_MAX, &c->num_attention_heads, err) ||
        req_int(root, "vocab_size", "vocab_size", 1, VOCAB_MAX, &c->vocab_size, err))
        return AE_ERR;
    if (!(v = get(root, "rms_norm_eps"))) return err_set(err, "rms_norm_eps: required key is missing");
    if (as_double(v, "rms_norm_eps", 0.0, 1.0, &c->rms_norm_eps, err)) return AE_ERR;

    c->num_key_value_heads = c->num_attention_heads;
    if (opt_int(root, "num_key_value_heads", "num_key_value_heads", 1, HEADS_MAX, &c->num_key_value_heads, err))
        return AE_ERR;
    if (c->num_attention_heads % c->num_key_value_heads != 0)
        return err_set(err,
                       "num_key_value_heads: %d does not divide "
                       "num_attention_heads %d",
                       c->num_key_value_heads, c->num_attention_heads);

    /* An explicit head_dim may differ from hidden / heads (the output
     * projection maps heads * head_dim back to hidden); without one the
     * split must be exact. */
    if (get(root, "head_dim")) {
        if (opt_int(root, "head_dim", "head_dim", 1, DIM_MAX, &c->head_dim, err)) return AE_ERR;
    } else {
        if (c->hidden_size % c->num_attention_heads != 0)
            return err_set(err,
                           "num_attention_heads: %d does not divide "
                           "hidden_size %d",
                           c->num_attention_heads, c->hidden_size);
        c->head_dim = c->hidden_size / c->num_attention_heads;
    }
    if (c->head_dim % 2 != 0) return err_set(err, "head_dim: %d is odd; RoPE rotates pairs", c->head_dim);

    c->rope_theta = 10000.0;
    c->rope_theta_key = "rope_theta";
    if ((v = get(root, "rope_theta")) && as_double(v, "rope_theta", 0.0, 1e12, &c->rope_theta, err)) return AE_ERR;
    c->max_position_embeddings = 2048;
    if (opt_int(root, "max_position_embeddings", "max_position_embeddings", 1, POS_MAX, &c->max_position_embeddings,
                err))
        return AE_ERR;
    if (opt_bool(root, "tie_word_embeddings", &c->tie_word_embeddings, err)) return AE_ERR;

    /* Qwen2 always has q/k/v biases; its config has no key saying so. */
    bool qwen2 = strcmp(c->model_type, "qwen2") == 0;
    c->attention_bias = qwen2;
    if (opt_bool(root, "attention_bias", &c->attention_bias, err)) return AE_ERR;
    if (qwen2 && !c->attention_bias)
        return err_set(err, "attention_bias: false contradicts model_type qwen2 "
                            "(always biased)");

    c->bos_token_id = -1;
    if (opt_int(root, "bos_token_id", "bos_token_id", 0, c->vocab_size - 1, &c->bos_token_id, err)) return AE_ERR;
    if ((v = get(root, "eos_token_id")) &&
        int_list(v, "eos_token_id", 0, c->vocab_size - 1, c->eos_token_ids, HFCONFIG_MAX_EOS, &c->n_eos, err))
        return AE_ERR;

    /* transformers 5 writes rope_parameters instead of rope_theta and
     * rope_scaling; where both forms are present, rope_parameters wins, as
     * in transformers 5. */
    const cJSON *rp = get(root, "rope_parameters");
    if (rp) {
        if (parse_rope_scaling(c, rp, "rope_parameters", err)) return AE_ERR;
        if ((v = get(rp, "rope_theta")) && as_double(v, "rope_parameters.rope_theta", 0.0, 1e12, &c->rope_theta, err))
            return AE_ERR;
        if (v) c->rope_theta_key = "rope_parameters.rope_theta";
    } else if ((v = get(root, "rope_scaling")) && parse_rope_scaling(c, v, "rope_scaling", err)) {
        return AE_ERR;
    }

    if (opt_int(root, "draft_vocab_size", "draft_vocab_size", 1, c->vocab_size, &c->draft_vocab_size, err))
        return AE_ERR;
    if (opt_bool(root, "norm_before_residual", &c->norm_before_residual, err)) return AE_ERR;
    /* The capture layers: at the top level (as vLLM reads them first) or
     * in eagle_config; both present must agree. */
    const char *label = "eagle_aux_hidden_state_layer_ids";
    if ((v = get(root, "eagle_aux_hidden_state_layer_ids"))) {
        if (!cJSON_IsArray(v)) return err_set(err, "%s: expected a list, got %s", label, kind(v));
        if (int_list(v, label, 0, LAYER_ID_MAX, c->aux_layer_ids, HFCONFIG_MAX_AUX_LAYERS, &c->n_aux_layers, err))
            return AE_ERR;
    }
    const cJSON *eagle = get(root, "eagle_config");
    if (eagle) {
        if (!cJSON_IsObject(eagle)) return err_set(err, "eagle_config: expected an object, got %s", kind(eagle));
        const char *nested = "eagle_config.eagle_aux_hidden_state_layer_ids";
        v = get(eagle, "eagle_aux_hidden_state_layer_ids");
        if (v && !cJSON_IsArray(v)) return err_set(err, "%s: expected a list, got %s", nested, kind(v));
        int32_t ids[HFCONFIG_MAX_AUX_LAYERS];
        uint32_t n = 0;
        if (v && int_list(v, nested, 0, LAYER_ID_MAX, ids, HFCONFIG_MAX_AUX_LAYERS, &n, err)) return AE_ERR;
        if (v && c->n_aux_layers > 0 && (n != c->n_aux_layers || memcmp(ids, c->aux_layer_ids, n * sizeof ids[0]) != 0))
            return err_set(err, "%s and %s differ", label, nested);
        if (v) {
            memcpy(c->aux_layer_ids, ids, n * sizeof ids[0]);
            c->n_aux_layers = n;
        }
    }
    return AE_OK;
}

int hfconfig_parse(hfconfig *cfg, const char *json, size_t len, const char *name, ae_error *err) {
    memset(cfg, 0, sizeof *cfg);
    ae_error local = {{0}};
    cJSON *root = NULL;
    /* cJSON reads a NUL-terminated copy, so no input can lead it past the
     * caller's bytes. */
    char *buf = malloc(len + 1);
    if (!buf) {
        err_set(&local, "out of memory");
        goto fail;
    }
    if (len > 0) memcpy(buf, json, len);
    buf[len] = '\0';
    root = json_parse(buf, len, &local);
    free(buf);
    if (!root) goto fail;
    const cJSON *text = get(root, "text_config");
    if (text && !cJSON_IsObject(text)) {
        err_set(&local, "text_config: expected an object, got %s", kind(text));
        goto fail;
    }
    if (parse_root(cfg, text ? text : root, &local) != AE_OK) {
        if (text) err_prefix(&local, "text_config.");
        goto fail;
    }
    if (text && !cfg->model_type[0] && opt_text(root, "model_type", cfg->model_type, &local) != AE_OK) goto fail;
    cfg->text_config = text != NULL;
    cJSON_Delete(root);
    return AE_OK;
fail:
    cJSON_Delete(root);
    memset(cfg, 0, sizeof *cfg);
    return err_set(err, "%s: %s", name, local.msg);
}

int hfconfig_load(hfconfig *cfg, const char *path, ae_error *err) {
    memset(cfg, 0, sizeof *cfg);
    char *buf;
    size_t size;
    if (file_read_all(path, HFCONFIG_MAX_FILE, &buf, &size, NULL, err) != AE_OK) return AE_ERR;
    int rc = hfconfig_parse(cfg, buf, size, path, err);
    free(buf);
    return rc;
}

kn_rope_config hfconfig_rope(const hfconfig *c) {
    kn_rope_config r = {KN_ROPE_NEOX, c->head_dim, c->rope_theta, 0, 0, 0, 0, false, 0, 0};
    if (c->rope_scaling.kind == HFCONFIG_ROPE_LLAMA3) {
        r.factor = c->rope_scaling.factor;
        r.low_freq_factor = c->rope_scaling.low_freq_factor;
        r.high_freq_factor = c->rope_scaling.high_freq_factor;
        r.original_max_pos = c->rope_scaling.original_max_position_embeddings;
    } else if (c->rope_scaling.kind == HFCONFIG_ROPE_YARN) {
        r.yarn = true;
        r.factor = c->rope_scaling.factor;
        r.beta_fast = c->rope_scaling.beta_fast;
        r.beta_slow = c->rope_scaling.beta_slow;
        int32_t orig = c->rope_scaling.original_max_position_embeddings;
        r.original_max_pos = orig > 0 ? orig : c->max_position_embeddings;
    }
    return r;
}
