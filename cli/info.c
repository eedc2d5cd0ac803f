/* aerie info: what a model file holds. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "../services/tokenizer/chat.h"
#include "cli.h"

static const cfg_option opts[] = {
    {"model", CFG_STRING, NULL, 0, 0, "model file (.gguf)"},
    {"json", CFG_BOOL, "false", 0, 0, "print one JSON object instead of text"},
    {"log-level", CFG_STRING, "warn", 0, 0, "debug, info, warn, error or off"},
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

static cJSON *describe(const gguf_file *f, const tok *t, ae_error *err) {
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
    add_int(o, "head_dim", hidden > 0 && heads > 0 ? hidden / heads : -1);
    add_int(o, "vocab_size", vocab);
    add_int(o, "context_length", arch_int(f, arch, "context_length"));
    double theta = arch_float(f, arch, "rope.freq_base");
    double eps = arch_float(f, arch, "attention.layer_norm_rms_epsilon");
    if (!isnan(theta)) cJSON_AddNumberToObject(o, "rope_theta", theta);
    if (!isnan(eps)) cJSON_AddNumberToObject(o, "rms_norm_eps", eps);

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
    cJSON_AddNumberToObject(o, "tensors", (double)gguf_n_tensors(f));
    cJSON_AddNumberToObject(o, "parameters", (double)params);
    cJSON_AddNumberToObject(o, "tensor_bytes", (double)total);
    cJSON *types = cJSON_AddObjectToObject(o, "tensor_types");
    for (uint32_t ty = 0; ty < GGML_TYPE_COUNT_MAX; ty++) {
        if (!count[ty]) continue;
        cJSON *e = cJSON_AddObjectToObject(types, quant_type_name(ty));
        cJSON_AddNumberToObject(e, "count", (double)count[ty]);
        cJSON_AddNumberToObject(e, "bytes", (double)bytes[ty]);
    }

    cJSON *tk = cJSON_AddObjectToObject(o, "tokenizer");
    if (gguf_get_str(f, "tokenizer.ggml.model", &s, NULL) == AE_OK) {
        char *m = str_dup(s);
        cJSON_AddStringToObject(tk, "model", m ? m : "");
        free(m);
    }
    if (t) {
        cJSON_AddStringToObject(tk, "kind", "byte-level BPE");
        cJSON_AddStringToObject(tk, "pre", tok_pre_name(tok_pre_kind(t)));
        cJSON_AddNumberToObject(tk, "tokens", tok_vocab_size(t));
        int64_t mi = gguf_find_key(f, "tokenizer.ggml.merges");
        if (mi >= 0) cJSON_AddNumberToObject(tk, "merges", (double)gguf_arr_len(f, (uint64_t)mi));
        cJSON_AddNumberToObject(tk, "bos", tok_bos(t));
        cJSON_AddNumberToObject(tk, "eos", tok_eos(t));
        cJSON_AddBoolToObject(tk, "add_bos", tok_add_bos(t));
        /* A template we cannot render is reported, not fatal: the model
         * still tokenizes and serves plain completions. */
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
    free(arch);
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

static int run(const cfg *c, int argc, char **argv, ae_error *err) {
    if (argc > 0) return err_set(err, "unexpected argument \"%s\"", argv[0]), CLI_EXIT_USAGE;
    const char *path = cfg_str(c, "model");
    cli_model m;
    if (cli_model_open(&m, path, err) != AE_OK) return CLI_EXIT_USAGE;
    if (!m.gguf) {
        cli_model_close(&m);
        return err_set(err, "%s: info reads GGUF files", path), CLI_EXIT_USAGE;
    }
    cJSON *o = describe(m.gguf, m.tok, err);
    if (!o) {
        err_prefix(err, "%s: ", path);
        cli_model_close(&m);
        return CLI_EXIT_USAGE;
    }
    if (cfg_bool(c, "json")) {
        char *s = cJSON_PrintUnformatted(o);
        puts(s ? s : "{}");
        free(s);
    } else {
        print_text(o);
    }
    cJSON_Delete(o);
    cli_model_close(&m);
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
