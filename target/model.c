#include "model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../services/core/mem.h"
#include "../services/model/gguf.h"
#include "../services/model/hfconfig.h"
#include "../services/model/safetensors.h"

/* ---- owned (converted) buffers ------------------------------------------ */

/* A 64-byte aligned buffer of `bytes` that the model owns. */
static void *own_bytes(model *m, size_t bytes, ae_error *err) {
    if (m->n_owned == m->cap_owned) {
        size_t cap = m->cap_owned ? m->cap_owned * 2 : 64;
        void **p = realloc(m->owned, cap * sizeof *p);
        if (!p) return err_set(err, "out of memory"), NULL;
        m->owned = p;
        m->cap_owned = cap;
    }
    void *buf = mem_alloc_large(bytes);
    if (!buf) return err_set(err, "out of memory for %zu bytes of weights", bytes), NULL;
    m->owned[m->n_owned++] = buf;
    return buf;
}

static float *own_floats(model *m, uint64_t n, ae_error *err) {
    float *buf = own_bytes(m, n * sizeof(float), err);
    if (buf) m->converted_bytes += n * sizeof(float);
    return buf;
}

/* Once a matrix is packed, the forward pass reads its file bytes only for
 * rows past the last whole group of 16 (none in the default model). The
 * pages packing touched are dropped from this process (they stay in the
 * page cache, clean and reclaimable, and fault back in if read), so the
 * resident weights are the packed copy the memory plan counts, not twice
 * that. Only whole pages inside the matrix's bytes are dropped. */
static void drop_file_pages(const model *m, const kn_weight *w) {
    if (!m->gguf) return; /* safetensors weights were converted, not mapped here */
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0) return;
    uintptr_t a = (uintptr_t)w->data, b = a + (size_t)w->rows * w->row_bytes;
    uintptr_t lo = (a + (uintptr_t)page - 1) & ~((uintptr_t)page - 1), hi = b & ~((uintptr_t)page - 1);
    if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_DONTNEED); /* a hint; failure is harmless */
}

/* Every quantized matrix the forward pass multiplies gets the SIMD
 * layout (kn_weight_pack). The copy replaces the file's bytes as what a
 * step reads, and it is the same size, so weight_bytes does not change. */
static int pack_one(model *m, kn_weight *w, ae_error *err) {
    size_t bytes = kn_weight_packed_bytes(w);
    if (bytes == 0) return AE_OK;
    void *buf = own_bytes(m, bytes, err);
    if (!buf) return AE_ERR;
    kn_weight_pack(w, buf);
    drop_file_pages(m, w);
    return AE_OK;
}

static int pack_weights(model *m, ae_error *err) {
    for (int32_t i = 0; i < m->cfg.n_layers; i++) {
        model_layer *l = &m->layers[i];
        kn_weight *w[7] = {&l->wq, &l->wk, &l->wv, &l->wo, &l->w_gate, &l->w_up, &l->w_down};
        for (int j = 0; j < 7; j++)
            if (pack_one(m, w[j], err) != AE_OK) return AE_ERR;
    }
    return pack_one(m, &m->output, err);
}

void model_free(model *m) {
    if (!m) return;
    for (size_t i = 0; i < m->n_owned; i++) free(m->owned[i]);
    free(m->owned);
    free(m->layers);
    gguf_close(m->gguf);
    st_model_close(m->st);
    free(m);
}

static int check_config(const model_config *c, ae_error *err) {
    if (c->n_layers <= 0 || c->n_layers > MODEL_MAX_LAYERS)
        return err_set(err, "n_layers %d is outside 1..%d", c->n_layers, MODEL_MAX_LAYERS);
    if (c->hidden <= 0 || c->ffn <= 0 || c->n_heads <= 0 || c->n_kv_heads <= 0 || c->vocab <= 0)
        return err_set(err, "a dimension is not positive (hidden %d, ffn %d, heads %d, kv heads %d, vocab %d)",
                       c->hidden, c->ffn, c->n_heads, c->n_kv_heads, c->vocab);
    if (c->n_heads % c->n_kv_heads)
        return err_set(err, "kv heads %d do not divide heads %d", c->n_kv_heads, c->n_heads);
    if (c->head_dim <= 0 || c->head_dim % 8 || c->head_dim > KN_MAX_HEAD_DIM)
        return err_set(err, "head_dim %d must be a multiple of 8 and at most %d", c->head_dim, KN_MAX_HEAD_DIM);
    return AE_OK;
}

/* ---- GGUF ---------------------------------------------------------------- */

static int64_t gguf_int_or(const gguf_file *f, const char *arch, const char *suffix, int64_t def) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int64_t v;
    return gguf_get_i64(f, key, &v, NULL) == AE_OK ? v : def;
}

static int gguf_required(const gguf_file *f, const char *arch, const char *suffix, int32_t *out,
                         ae_error *err) {
    int64_t v = gguf_int_or(f, arch, suffix, -1);
    if (v <= 0 || v > INT32_MAX) return err_set(err, "key %s.%s: missing or not a positive integer", arch, suffix);
    *out = (int32_t)v;
    return AE_OK;
}

/* The 2-D tensor `name` of [rows][cols] (GGUF dims: ne[0] = cols, ne[1] =
 * rows), or NULL with err set. */
static const gguf_tensor *gguf_2d(model *m, const char *name, int64_t rows, int64_t cols,
                                  ae_error *err) {
    const gguf_tensor *t = gguf_find_tensor(m->gguf, name);
    if (!t) return err_set(err, "tensor %s is missing", name), NULL;
    if (t->n_dims != 2 || (int64_t)t->ne[0] != cols || (int64_t)t->ne[1] != rows)
        return err_set(err, "tensor %s has shape [%llu, %llu], expected [%lld, %lld]", name,
                       (unsigned long long)t->ne[0], (unsigned long long)t->ne[1],
                       (long long)cols, (long long)rows),
               NULL;
    return t;
}

static int gguf_matrix(model *m, const char *name, int64_t rows, int64_t cols, kn_weight *w,
                       ae_error *err) {
    const gguf_tensor *t = gguf_2d(m, name, rows, cols, err);
    if (!t) return AE_ERR;
    w->rows = rows;
    w->cols = cols;
    if (kn_matmul_supports(t->type)) {
        w->type = t->type;
        w->data = t->data;
        w->row_bytes = (size_t)quant_row_bytes(t->type, (uint64_t)cols);
        m->weight_bytes += t->n_bytes;
        return AE_OK;
    }
    if (!quant_can_dequantize(t->type))
        return err_set(err, "tensor %s has type %s, which cannot be read", name, quant_type_name(t->type));
    float *buf = own_floats(m, t->n_elements, err);
    if (!buf || !quant_dequantize(t->type, t->data, buf, t->n_elements)) return err_set(err, "tensor %s: cannot convert", name);
    *w = (kn_weight){.type = GGML_TYPE_F32, .rows = rows, .cols = cols, .data = buf, .row_bytes = (size_t)cols * sizeof(float)};
    m->weight_bytes += t->n_elements * sizeof(float);
    return AE_OK;
}

/* The embedding table stays in its file type: kn_embed reads any type. */
static int gguf_table(model *m, const char *name, int64_t rows, int64_t cols, kn_weight *w,
                      ae_error *err) {
    const gguf_tensor *t = gguf_2d(m, name, rows, cols, err);
    if (!t) return AE_ERR;
    if (!quant_can_dequantize(t->type))
        return err_set(err, "tensor %s has type %s, which cannot be read", name, quant_type_name(t->type));
    *w = (kn_weight){.type = t->type, .rows = rows, .cols = cols, .data = t->data,
                      .row_bytes = (size_t)quant_row_bytes(t->type, (uint64_t)cols)};
    return AE_OK;
}

static int gguf_vector(model *m, const char *name, int64_t n, bool optional, const float **out,
                       ae_error *err) {
    *out = NULL;
    const gguf_tensor *t = gguf_find_tensor(m->gguf, name);
    if (!t) return optional ? AE_OK : err_set(err, "tensor %s is missing", name);
    if (t->n_dims != 1 || (int64_t)t->ne[0] != n)
        return err_set(err, "tensor %s has %llu elements in %u dims, expected [%lld]", name,
                       (unsigned long long)t->n_elements, t->n_dims, (long long)n);
    m->weight_bytes += t->n_bytes;
    if (t->type == GGML_TYPE_F32) {
        *out = t->data;
        return AE_OK;
    }
    float *buf = own_floats(m, (uint64_t)n, err);
    if (!buf || !quant_dequantize(t->type, t->data, buf, (uint64_t)n)) return err_set(err, "tensor %s: cannot convert", name);
    *out = buf;
    return AE_OK;
}

static int load_gguf(model *m, ae_error *err) {
    gguf_str s;
    if (gguf_get_str(m->gguf, "general.architecture", &s, err) != AE_OK) return AE_ERR;
    if (s.len >= sizeof m->cfg.arch) return err_set(err, "general.architecture is too long");
    model_config *c = &m->cfg;
    memcpy(c->arch, s.ptr, s.len);
    c->arch[s.len] = '\0';
    bool llama = !strcmp(c->arch, "llama"), qwen2 = !strcmp(c->arch, "qwen2");
    if (!llama && !qwen2)
        return err_set(err, "architecture \"%s\" is not supported (llama, qwen2)", c->arch);
    const char *a = c->arch;
    if (gguf_required(m->gguf, a, "block_count", &c->n_layers, err) ||
        gguf_required(m->gguf, a, "embedding_length", &c->hidden, err) ||
        gguf_required(m->gguf, a, "feed_forward_length", &c->ffn, err) ||
        gguf_required(m->gguf, a, "attention.head_count", &c->n_heads, err))
        return AE_ERR;
    c->n_kv_heads = (int32_t)gguf_int_or(m->gguf, a, "attention.head_count_kv", c->n_heads);
    c->head_dim = (int32_t)gguf_int_or(m->gguf, a, "attention.key_length", c->n_heads ? c->hidden / c->n_heads : 0);
    int64_t ctx = gguf_int_or(m->gguf, a, "context_length", 2048);
    if (ctx < 1 || ctx > INT32_MAX) return err_set(err, "key %s.context_length: %lld is outside 1..%d", a, (long long)ctx, INT32_MAX);
    c->context_length = (int32_t)ctx;
    char key[160];
    float f;
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", a);
    c->rms_eps = gguf_get_f32(m->gguf, key, &f, NULL) == AE_OK ? f : 1e-5f;
    if (!(c->rms_eps >= 0.0f && c->rms_eps <= 1.0f)) /* also NaN */
        return err_set(err, "key %s: %g is outside 0..1", key, (double)c->rms_eps);
    snprintf(key, sizeof key, "%s.rope.freq_base", a);
    c->rope = (kn_rope_config){llama ? KN_ROPE_ADJACENT : KN_ROPE_NEOX, c->head_dim,
                               gguf_get_f32(m->gguf, key, &f, NULL) == AE_OK ? f : 10000.0, 0, 0, 0, 0};
    if (gguf_find_tensor(m->gguf, "rope_freqs.weight"))
        return err_set(err, "rope_freqs.weight (Llama-3.1 rope scaling in GGUF) is not supported yet");
    const gguf_tensor *emb = gguf_find_tensor(m->gguf, "token_embd.weight");
    if (!emb || emb->n_dims != 2) return err_set(err, "tensor token_embd.weight is missing or not 2-D");
    if (emb->ne[1] > INT32_MAX) return err_set(err, "vocabulary too large");
    c->vocab = (int32_t)emb->ne[1];
    c->qkv_bias = gguf_find_tensor(m->gguf, "blk.0.attn_q.bias") != NULL;
    if (check_config(c, err) != AE_OK) return AE_ERR;
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers) return err_set(err, "out of memory");

    int64_t H = c->hidden, F = c->ffn, QD = (int64_t)c->n_heads * c->head_dim,
            KD = (int64_t)c->n_kv_heads * c->head_dim;
    if (gguf_table(m, "token_embd.weight", c->vocab, H, &m->tok_embd, err) ||
        gguf_vector(m, "output_norm.weight", H, false, &m->output_norm, err))
        return AE_ERR;
    c->tied_embeddings = gguf_find_tensor(m->gguf, "output.weight") == NULL;
    if (c->tied_embeddings) {
        if (!kn_matmul_supports(m->tok_embd.type)) {
            if (gguf_matrix(m, "token_embd.weight", c->vocab, H, &m->output, err)) return AE_ERR;
        } else {
            m->output = m->tok_embd;
            m->weight_bytes += (size_t)m->tok_embd.row_bytes * (size_t)c->vocab;
        }
    } else if (gguf_matrix(m, "output.weight", c->vocab, H, &m->output, err)) {
        return AE_ERR;
    }
    for (int i = 0; i < c->n_layers; i++) {
        model_layer *l = &m->layers[i];
        char n[12][64];
        const char *sfx[12] = {"attn_norm.weight", "ffn_norm.weight", "attn_q.weight", "attn_k.weight",
                               "attn_v.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight",
                               "ffn_down.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias"};
        for (int j = 0; j < 12; j++) snprintf(n[j], sizeof n[j], "blk.%d.%s", i, sfx[j]);
        if (gguf_vector(m, n[0], H, false, &l->attn_norm, err) ||
            gguf_vector(m, n[1], H, false, &l->ffn_norm, err) ||
            gguf_matrix(m, n[2], QD, H, &l->wq, err) || gguf_matrix(m, n[3], KD, H, &l->wk, err) ||
            gguf_matrix(m, n[4], KD, H, &l->wv, err) || gguf_matrix(m, n[5], H, QD, &l->wo, err) ||
            gguf_matrix(m, n[6], F, H, &l->w_gate, err) || gguf_matrix(m, n[7], F, H, &l->w_up, err) ||
            gguf_matrix(m, n[8], H, F, &l->w_down, err) ||
            gguf_vector(m, n[9], QD, !c->qkv_bias, &l->bq, err) ||
            gguf_vector(m, n[10], KD, !c->qkv_bias, &l->bk, err) ||
            gguf_vector(m, n[11], KD, !c->qkv_bias, &l->bv, err))
            return AE_ERR;
    }
    return AE_OK;
}

/* ---- Hugging Face -------------------------------------------------------- */

/* Safetensors data may be unaligned and in BF16: every tensor is converted
 * to f32 once at load. */
static int st_floats(model *m, const char *name, int64_t rows, int64_t cols, bool optional,
                     const float **out, ae_error *err) {
    *out = NULL;
    const st_tensor *t = st_model_find(m->st, name);
    if (!t) return optional ? AE_OK : err_set(err, "tensor %s is missing", name);
    bool ok = rows == 0 ? (t->n_dims == 1 && (int64_t)t->shape[0] == cols)
                        : (t->n_dims == 2 && (int64_t)t->shape[0] == rows && (int64_t)t->shape[1] == cols);
    if (!ok)
        return err_set(err, "tensor %s has an unexpected shape (expected [%lld, %lld])", name,
                       (long long)rows, (long long)cols);
    float *buf = own_floats(m, t->n_elements, err);
    if (!buf || st_tensor_to_f32(t, buf, t->n_elements, err) != AE_OK) return AE_ERR;
    m->weight_bytes += t->n_elements * sizeof(float);
    *out = buf;
    return AE_OK;
}

static int st_matrix(model *m, const char *name, int64_t rows, int64_t cols, kn_weight *w, ae_error *err) {
    const float *p;
    if (st_floats(m, name, rows, cols, false, &p, err) != AE_OK) return AE_ERR;
    *w = (kn_weight){.type = GGML_TYPE_F32, .rows = rows, .cols = cols, .data = p, .row_bytes = (size_t)cols * sizeof(float)};
    return AE_OK;
}

static int load_hf(model *m, const char *dir, ae_error *err) {
    char path[1200];
    hfcfg hc;
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (hfcfg_load(&hc, path, err) != AE_OK) return AE_ERR;
    if (st_model_open(&m->st, dir, err) != AE_OK) return AE_ERR;
    model_config *c = &m->cfg;
    snprintf(c->arch, sizeof c->arch, "%s", hc.model_type);
    if (strcmp(c->arch, "llama") && strcmp(c->arch, "qwen2"))
        return err_set(err, "%s: model_type \"%s\" is not supported (llama, qwen2)", path, c->arch);
    c->n_layers = hc.num_hidden_layers;
    c->hidden = hc.hidden_size;
    c->ffn = hc.intermediate_size;
    c->n_heads = hc.num_attention_heads;
    c->n_kv_heads = hc.num_key_value_heads;
    c->head_dim = hc.head_dim;
    c->vocab = hc.vocab_size;
    c->context_length = hc.max_position_embeddings;
    c->rms_eps = (float)hc.rms_norm_eps;
    c->qkv_bias = hc.attention_bias;
    /* Llama's attention_bias also biases o_proj, which the forward pass
     * does not have; Qwen2 biases q/k/v only. Refuse rather than run wrong. */
    if (hc.attention_bias && strcmp(c->arch, "qwen2"))
        return err_set(err, "%s: attention_bias on a %s model (an o_proj bias) is not supported", path, c->arch);
    c->rope = hfcfg_rope(&hc);
    if (check_config(c, err) != AE_OK) return AE_ERR;
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers) return err_set(err, "out of memory");

    int64_t H = c->hidden, F = c->ffn, QD = (int64_t)c->n_heads * c->head_dim,
            KD = (int64_t)c->n_kv_heads * c->head_dim;
    if (st_matrix(m, "model.embed_tokens.weight", c->vocab, H, &m->tok_embd, err) ||
        st_floats(m, "model.norm.weight", 0, H, false, &m->output_norm, err))
        return AE_ERR;
    c->tied_embeddings = st_model_find(m->st, "lm_head.weight") == NULL;
    if (c->tied_embeddings)
        m->output = m->tok_embd;
    else if (st_matrix(m, "lm_head.weight", c->vocab, H, &m->output, err))
        return AE_ERR;
    for (int i = 0; i < c->n_layers; i++) {
        model_layer *l = &m->layers[i];
        char n[12][96];
        const char *sfx[12] = {"input_layernorm.weight", "post_attention_layernorm.weight",
                               "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                               "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                               "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                               "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"};
        for (int j = 0; j < 12; j++) snprintf(n[j], sizeof n[j], "model.layers.%d.%s", i, sfx[j]);
        if (st_floats(m, n[0], 0, H, false, &l->attn_norm, err) ||
            st_floats(m, n[1], 0, H, false, &l->ffn_norm, err) ||
            st_matrix(m, n[2], QD, H, &l->wq, err) || st_matrix(m, n[3], KD, H, &l->wk, err) ||
            st_matrix(m, n[4], KD, H, &l->wv, err) || st_matrix(m, n[5], H, QD, &l->wo, err) ||
            st_matrix(m, n[6], F, H, &l->w_gate, err) || st_matrix(m, n[7], F, H, &l->w_up, err) ||
            st_matrix(m, n[8], H, F, &l->w_down, err) ||
            st_floats(m, n[9], 0, QD, !c->qkv_bias, &l->bq, err) ||
            st_floats(m, n[10], 0, KD, !c->qkv_bias, &l->bk, err) ||
            st_floats(m, n[11], 0, KD, !c->qkv_bias, &l->bv, err))
            return AE_ERR;
    }
    return AE_OK;
}

int model_load(model **out, const char *path, ae_error *err) {
    *out = NULL;
    model *m = calloc(1, sizeof *m);
    if (!m) return err_set(err, "out of memory");
    snprintf(m->path, sizeof m->path, "%s", path);
    struct stat sb;
    int rc;
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        rc = load_hf(m, path, err);
    } else {
        rc = gguf_open(&m->gguf, path, err);
        if (rc == AE_OK) {
            rc = load_gguf(m, err);
            if (rc != AE_OK && !strstr(err ? err->msg : "", path)) err_prefix(err, "%s: ", path);
        }
    }
    if (rc == AE_OK) rc = pack_weights(m, err);
    if (rc == AE_OK) {
        rc = kn_rope_init(&m->rope, &m->cfg.rope, err);
        if (rc != AE_OK) err_prefix(err, "%s: ", path);
    }
    if (rc != AE_OK) {
        model_free(m);
        return AE_ERR;
    }
    *out = m;
    return AE_OK;
}

size_t model_decode_bytes(const model *m) {
    size_t b = 0;
    const model_config *c = &m->cfg;
    for (int i = 0; i < c->n_layers; i++) {
        const model_layer *l = &m->layers[i];
        const kn_weight *w[7] = {&l->wq, &l->wk, &l->wv, &l->wo, &l->w_gate, &l->w_up, &l->w_down};
        for (int j = 0; j < 7; j++) b += w[j]->row_bytes * (size_t)w[j]->rows;
        b += 2 * (size_t)c->hidden * sizeof(float);
    }
    b += m->output.row_bytes * (size_t)m->output.rows + (size_t)c->hidden * sizeof(float);
    return b;
}
