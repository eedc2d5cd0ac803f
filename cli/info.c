/* aerie info: what a model file holds. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "../services/model/hfconfig.h"
#include "../services/model/safetensors.h"
#include "../services/tokenizer/chat.h"
#include "cli.h"

static const config_option opts[] = {
    {"model", CONFIG_STRING, NULL, 0, 0, "model: a .gguf file or a Hugging Face directory"},
    {"json", CONFIG_BOOL, "false", 0, 0, "print one JSON object instead of text"},
    {"log-level", CONFIG_STRING, "warn", 0, 0, "debug, info, warn, error or off"},
};

/* Architecture key "<arch>.<suffix>" as an integer, or -1 when absent. */
static int64_t arch_int(const gguf_file *f, const char *arch, const char *suffix) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int64_t v;
    return gguf_get_i64(f, key, &v, NULL) == AE_OK ? v : -1;
}

static double arch_float(const gguf_file *f, const char *arch, const char *suffix) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    double v;
    return gguf_get_f64(f, key, &v, NULL) == AE_OK ? v : NAN;
}

static double shortest_f32(double v) {
    char buf[32];
    for (int prec = 1; prec <= 9; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, v);
        if ((float)strtod(buf, NULL) == (float)v) break;
    }
    return strtod(buf, NULL);
}

static char *str_dup(gguf_str s) {
    char *p = malloc(s.len + 1);
    if (!p) return NULL;
    memcpy(p, s.ptr, s.len);
    p[s.len] = '\0';
    return p;
}

static void add_int(cJSON *o, const char *k, int64_t v) {
    if (v >= 0)
        cJSON_AddNumberToObject(o, k, (double)v);
    else
        cJSON_AddNullToObject(o, k);
}

/* Tensor totals and per-type {count, bytes}, shared by GGUF and Hugging
 * Face models; type t's name is name(t). */
static void add_tensor_stats(cJSON *o, uint64_t n_tensors, uint64_t params, uint64_t total, const uint64_t *count,
                             const uint64_t *bytes, uint32_t n_types, const char *(*name)(uint32_t)) {
    cJSON_AddNumberToObject(o, "tensors", (double)n_tensors);
    cJSON_AddNumberToObject(o, "parameters", (double)params);
    cJSON_AddNumberToObject(o, "tensor_bytes", (double)total);
    cJSON *types = cJSON_AddObjectToObject(o, "tensor_types");
    for (uint32_t t = 0; t < n_types; t++) {
        if (!count[t]) continue;
        cJSON *e = cJSON_AddObjectToObject(types, name(t));
        cJSON_AddNumberToObject(e, "count", (double)count[t]);
        cJSON_AddNumberToObject(e, "bytes", (double)bytes[t]);
    }
}

static const char *st_name(uint32_t d) { return safetensors_dtype_name((safetensors_dtype)d); }

/* The tokenizer's fields, shared by GGUF and Hugging Face models. */
static void add_tokenizer(cJSON *tk, const tok *t) {
    if (!t) return;
    cJSON_AddStringToObject(tk, "kind", "byte-level BPE");
    cJSON_AddStringToObject(tk, "pre", tok_pre_name(tok_pre_kind(t)));
    cJSON_AddNumberToObject(tk, "tokens", tok_vocab_size(t));
    cJSON_AddNumberToObject(tk, "bos", tok_bos(t));
    cJSON_AddNumberToObject(tk, "eos", tok_eos(t));
    cJSON_AddBoolToObject(tk, "add_bos", tok_add_bos(t));
    /* A template we cannot render is reported, not fatal: the model still
     * tokenizes and serves plain completions. */
    chat_template *ct = NULL;
    ae_error cerr = {0};
    if (!tok_chat_template(t))
        cJSON_AddNullToObject(tk, "chat_template");
    else if (chat_template_init(&ct, tok_chat_template(t), &cerr) == AE_OK)
        cJSON_AddStringToObject(tk, "chat_template", chat_variant_name(ct));
    else
        cJSON_AddStringToObject(tk, "chat_template", "unsupported");
    chat_template_free(ct);
}

/* t is NULL when the tokenizer could not be loaded; tok_err then says why.
 * That is reported, not fatal: the rest of the file is still worth seeing. */
static cJSON *describe(const gguf_file *f, const tok *t, const char *tok_err, ae_error *err) {
    gguf_str s;
    char *arch = NULL;
    if (gguf_get_str(f, "general.architecture", &s, err) != AE_OK) return NULL;
    arch = str_dup(s);
    if (!arch) {
        err_set(err, "out of memory");
        return NULL;
    }

    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "path", gguf_path(f));
    cJSON_AddStringToObject(o, "format", "gguf");
    cJSON_AddNumberToObject(o, "gguf_version", gguf_version(f));
    cJSON_AddNumberToObject(o, "file_bytes", (double)gguf_file_size(f));
    if (gguf_get_str(f, "general.name", &s, NULL) == AE_OK) {
        char *name = str_dup(s);
        cJSON_AddStringToObject(o, "name", name ? name : "");
        free(name);
    }
    cJSON_AddStringToObject(o, "architecture", arch);

    int64_t hidden = arch_int(f, arch, "embedding_length");
    int64_t heads = arch_int(f, arch, "attention.head_count");
    int64_t kv_heads = arch_int(f, arch, "attention.head_count_kv");
    if (kv_heads < 0) kv_heads = heads;
    int64_t vocab = arch_int(f, arch, "vocab_size");
    if (vocab < 0 && t) vocab = tok_vocab_size(t);
    add_int(o, "layers", arch_int(f, arch, "block_count"));
    add_int(o, "hidden_size", hidden);
    add_int(o, "ffn_size", arch_int(f, arch, "feed_forward_length"));
    add_int(o, "heads", heads);
    add_int(o, "kv_heads", kv_heads);
    /* Models whose head size is not hidden / heads say so in key_length. */
    int64_t head_dim = arch_int(f, arch, "attention.key_length");
    if (head_dim < 0 && hidden > 0 && heads > 0) head_dim = hidden / heads;
    add_int(o, "head_dim", head_dim);
    add_int(o, "vocab_size", vocab);
    add_int(o, "context_length", arch_int(f, arch, "context_length"));
    double theta = arch_float(f, arch, "rope.freq_base");
    double eps = arch_float(f, arch, "attention.layer_norm_rms_epsilon");
    if (!isnan(theta)) cJSON_AddNumberToObject(o, "rope_theta", theta);
    /* GGUF stores it as f32: print the shortest text that reads back to
     * that f32 (1e-05, not 9.99999974737875e-06). */
    if (!isnan(eps)) cJSON_AddNumberToObject(o, "rms_norm_eps", shortest_f32(eps));

    /* Tensor types: count, elements and bytes of each. */
    uint64_t count[GGML_TYPE_COUNT_MAX] = {0}, bytes[GGML_TYPE_COUNT_MAX] = {0};
    uint64_t params = 0, total = 0;
    for (uint64_t i = 0; i < gguf_n_tensors(f); i++) {
        const gguf_tensor *tt = gguf_tensor_at(f, i);
        uint32_t ty = (uint32_t)tt->type < GGML_TYPE_COUNT_MAX ? (uint32_t)tt->type : 0;
        count[ty]++;
        bytes[ty] += tt->n_bytes;
        params += tt->n_elements;
        total += tt->n_bytes;
    }
    add_tensor_stats(o, gguf_n_tensors(f), params, total, count, bytes, GGML_TYPE_COUNT_MAX, quant_type_name);

    cJSON *tk = cJSON_AddObjectToObject(o, "tokenizer");
    if (gguf_get_str(f, "tokenizer.ggml.model", &s, NULL) == AE_OK) {
        char *m = str_dup(s);
        cJSON_AddStringToObject(tk, "model", m ? m : "");
        free(m);
    }
    if (tok_err && tok_err[0]) cJSON_AddStringToObject(tk, "error", tok_err);
    add_tokenizer(tk, t);
    int64_t mi = gguf_find_key(f, "tokenizer.ggml.merges");
    if (t && mi >= 0) cJSON_AddNumberToObject(tk, "merges", (double)gguf_arr_len(f, (uint64_t)mi));
    free(arch);
    return o;
}

/* A Hugging Face directory: config.json, safetensors (sharded or not), and
 * tokenizer.json when present. */
static cJSON *describe_hf(const char *dir, ae_error *err) {
    char path[4096];
    hfconfig hc;
    safetensors_model *sm = NULL;
    tok *t = NULL;
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (hfconfig_load(&hc, path, err) != AE_OK) return NULL;
    if (safetensors_model_open(&sm, dir, err) != AE_OK) return NULL;
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    struct stat st;
    if (stat(path, &st) == 0 && tok_load_json(&t, path, err) != AE_OK) {
        safetensors_model_close(sm);
        return NULL;
    }

    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "path", dir);
    cJSON_AddStringToObject(o, "format", "safetensors");
    cJSON_AddNumberToObject(o, "files", (double)safetensors_model_n_files(sm));
    cJSON_AddStringToObject(o, "architecture", hc.model_type);
    add_int(o, "layers", hc.num_hidden_layers);
    add_int(o, "hidden_size", hc.hidden_size);
    add_int(o, "ffn_size", hc.intermediate_size);
    add_int(o, "heads", hc.num_attention_heads);
    add_int(o, "kv_heads", hc.num_key_value_heads);
    add_int(o, "head_dim", hc.head_dim);
    add_int(o, "vocab_size", hc.vocab_size);
    add_int(o, "context_length", hc.max_position_embeddings);
    cJSON_AddNumberToObject(o, "rope_theta", hc.rope_theta);
    cJSON_AddNumberToObject(o, "rms_norm_eps", hc.rms_norm_eps);
    if (hc.draft_vocab_size > 0) add_int(o, "draft_vocab_size", hc.draft_vocab_size);

    uint64_t count[SAFETENSORS_DTYPE_COUNT] = {0}, bytes[SAFETENSORS_DTYPE_COUNT] = {0}, params = 0, total = 0;
    for (size_t i = 0; i < safetensors_model_count(sm); i++) {
        const safetensors_tensor *tt = safetensors_model_tensor_at(sm, i);
        count[tt->dtype]++;
        bytes[tt->dtype] += tt->n_bytes;
        params += tt->n_elements;
        total += tt->n_bytes;
    }
    add_tensor_stats(o, safetensors_model_count(sm), params, total, count, bytes, SAFETENSORS_DTYPE_COUNT, st_name);
    add_tokenizer(cJSON_AddObjectToObject(o, "tokenizer"), t);
    tok_free(t);
    safetensors_model_close(sm);
    return o;
}

static void print_text(const cJSON *o) {
    const cJSON *it;
    cJSON_ArrayForEach(it, o) {
        if (cJSON_IsObject(it)) continue;
        char *v = cJSON_PrintUnformatted(it);
        printf("%-15s %s\n", it->string, v ? v : "?");
        free(v);
    }
    const cJSON *types = cJSON_GetObjectItem(o, "tensor_types");
    printf("%-15s", "tensor types");
    cJSON_ArrayForEach(it, types) {
        printf(" %s x%d (%.1f MiB)", it->string, cJSON_GetObjectItem(it, "count")->valueint,
               cJSON_GetObjectItem(it, "bytes")->valuedouble / (1024.0 * 1024.0));
    }
    putchar('\n');
    const cJSON *tk = cJSON_GetObjectItem(o, "tokenizer");
    printf("%-15s", "tokenizer");
    cJSON_ArrayForEach(it, tk) {
        char *v = cJSON_PrintUnformatted(it);
        printf(" %s=%s", it->string, v ? v : "?");
        free(v);
    }
    putchar('\n');
}

static int run(const config *c, int argc, char **argv, ae_error *err) {
    if (argc > 0) return err_set(err, "unexpected argument \"%s\"", argv[0]), CLI_EXIT_USAGE;
    const char *path = config_str(c, "model");
    tok_file m = {0};
    cJSON *o = NULL;
    struct stat st;
    if (!path) return err_set(err, "no model given (use --model FILE)"), CLI_EXIT_USAGE;
    if (stat(path, &st) != 0) return err_set(err, "%s: %s", path, strerror(errno)), CLI_EXIT_USAGE;
    if (S_ISDIR(st.st_mode)) {
        o = describe_hf(path, err);
        if (!o) return CLI_EXIT_USAGE;
    } else {
        if (gguf_open(&m.gguf, path, err) != AE_OK) return CLI_EXIT_USAGE;
        ae_error tok_err = {0};
        if (tok_load_gguf(&m.tok, m.gguf, &tok_err) != AE_OK) m.tok = NULL;
        o = describe(m.gguf, m.tok, tok_err.msg, err);
        if (!o) {
            err_prefix(err, "%s: ", path);
            tok_file_close(&m);
            return CLI_EXIT_USAGE;
        }
    }
    if (config_bool(c, "json")) {
        char *s = cJSON_PrintUnformatted(o);
        puts(s ? s : "{}");
        free(s);
    } else {
        print_text(o);
    }
    cJSON_Delete(o);
    tok_file_close(&m);
    return 0;
}

const cli_cmd cli_cmd_info = {
    .name = "info",
    .args = "",
    .summary = "what a model file holds: architecture, sizes, tensor types, tokenizer",
    .opts = opts,
    .n_opts = sizeof opts / sizeof opts[0],
    .run = run,
};
