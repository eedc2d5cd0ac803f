#include "model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../services/model/hfconfig.h"

static int pack_weights(model *m, ae_error *err) {
    for (int32_t i = 0; i < m->cfg.n_layers; i++) {
        model_layer *l = &m->layers[i];
        kn_weight *w[7] = {&l->wq, &l->wk, &l->wv, &l->wo, &l->w_gate, &l->w_up, &l->w_down};
        for (int j = 0; j < 7; j++)
            if (weights_pack(m->w, w[j], err) != AE_OK) return AE_ERR;
    }
    return weights_pack(m->w, &m->output, err);
}

void model_free(model *m) {
    if (!m) return;
    free(m->layers);
    weights_close(m->w);
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

static int config_gguf(model *m, ae_error *err) {
    gguf_str s;
    if (gguf_get_str(m->w->gguf, "general.architecture", &s, err) != AE_OK) return AE_ERR;
    if (s.len >= sizeof m->cfg.arch) return err_set(err, "general.architecture is too long");
    model_config *c = &m->cfg;
    memcpy(c->arch, s.ptr, s.len);
    c->arch[s.len] = '\0';
    bool llama = !strcmp(c->arch, "llama"), qwen2 = !strcmp(c->arch, "qwen2");
    if (!llama && !qwen2)
        return err_set(err, "architecture \"%s\" is not supported (llama, qwen2)", c->arch);
    const char *a = c->arch;
    if (gguf_required(m->w->gguf, a, "block_count", &c->n_layers, err) ||
        gguf_required(m->w->gguf, a, "embedding_length", &c->hidden, err) ||
        gguf_required(m->w->gguf, a, "feed_forward_length", &c->ffn, err) ||
        gguf_required(m->w->gguf, a, "attention.head_count", &c->n_heads, err))
        return AE_ERR;
    c->n_kv_heads = (int32_t)gguf_int_or(m->w->gguf, a, "attention.head_count_kv", c->n_heads);
    c->head_dim = (int32_t)gguf_int_or(m->w->gguf, a, "attention.key_length", c->n_heads ? c->hidden / c->n_heads : 0);
    int64_t ctx = gguf_int_or(m->w->gguf, a, "context_length", 2048);
    if (ctx < 1 || ctx > INT32_MAX) return err_set(err, "key %s.context_length: %lld is outside 1..%d", a, (long long)ctx, INT32_MAX);
    c->context_length = (int32_t)ctx;
    char key[192]; /* arch (< 128) + the longest suffix */
    float f;
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", a);
    c->rms_eps = gguf_get_f32(m->w->gguf, key, &f, NULL) == AE_OK ? f : 1e-5f;
    if (!(c->rms_eps >= 0.0f && c->rms_eps <= 1.0f)) /* also NaN */
        return err_set(err, "key %s: %g is outside 0..1", key, (double)c->rms_eps);
    snprintf(key, sizeof key, "%s.rope.freq_base", a);
    c->rope = (kn_rope_config){llama ? KN_ROPE_ADJACENT : KN_ROPE_NEOX, c->head_dim,
                               gguf_get_f32(m->w->gguf, key, &f, NULL) == AE_OK ? f : 10000.0, 0, 0, 0, 0};
    if (gguf_find_tensor(m->w->gguf, "rope_freqs.weight"))
        return err_set(err, "rope_freqs.weight (Llama-3.1 rope scaling in GGUF) is not supported yet");
    const gguf_tensor *emb = gguf_find_tensor(m->w->gguf, "token_embd.weight");
    if (!emb || emb->n_dims != 2) return err_set(err, "tensor token_embd.weight is missing or not 2-D");
    if (emb->ne[1] > INT32_MAX) return err_set(err, "vocabulary too large");
    c->vocab = (int32_t)emb->ne[1];
    c->qkv_bias = gguf_find_tensor(m->w->gguf, "blk.0.attn_q.bias") != NULL;
    return AE_OK;
}

/* ---- Hugging Face -------------------------------------------------------- */

static int config_hf(model *m, const char *dir, ae_error *err) {
    char path[1200];
    hfcfg hc;
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (hfcfg_load(&hc, path, err) != AE_OK) return AE_ERR;
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
    return AE_OK;
}

/* ---- tensors ------------------------------------------------------------ */

/* A format's tensor names: the model's own, then a layer's, each named
 * layer + its index + "." + suffix. */
typedef struct tensor_names {
    const char *embd, *norm, *output, *layer;
    const char *sfx[12]; /* attn_norm, ffn_norm, q, k, v, o, gate, up, down, q bias, k bias, v bias */
} tensor_names;

static const tensor_names gguf_names = {
    "token_embd.weight", "output_norm.weight", "output.weight", "blk.",
    {"attn_norm.weight", "ffn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
     "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias"}};

static const tensor_names hf_names = {
    "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.",
    {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
     "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
     "mlp.up_proj.weight", "mlp.down_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias",
     "self_attn.v_proj.bias"}};

static int load_tensors(model *m, const tensor_names *nm, ae_error *err) {
    model_config *c = &m->cfg;
    weights_store *w = m->w;
    if (check_config(c, err) != AE_OK) return AE_ERR;
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers) return err_set(err, "out of memory");

    int64_t H = c->hidden, F = c->ffn, QD = (int64_t)c->n_heads * c->head_dim,
            KD = (int64_t)c->n_kv_heads * c->head_dim;
    if (weights_table(w, nm->embd, c->vocab, H, &m->tok_embd, err) ||
        weights_vector(w, nm->norm, H, false, &m->output_norm, err))
        return AE_ERR;
    c->tied_embeddings = !weights_has(w, nm->output);
    if (c->tied_embeddings) {
        if (!kn_matmul_supports(m->tok_embd.type)) {
            if (weights_matrix(w, nm->embd, c->vocab, H, &m->output, err)) return AE_ERR;
        } else {
            m->output = m->tok_embd;
            /* A GGUF table is read a row at a time and not counted;
             * as the output projection every byte of it is. */
            if (w->gguf) w->bytes += (size_t)m->tok_embd.row_bytes * (size_t)c->vocab;
        }
    } else if (weights_matrix(w, nm->output, c->vocab, H, &m->output, err)) {
        return AE_ERR;
    }
    for (int i = 0; i < c->n_layers; i++) {
        model_layer *l = &m->layers[i];
        char n[12][128], pre[32];
        snprintf(pre, sizeof pre, "%s%d.", nm->layer, i);
        for (int j = 0; j < 12; j++) snprintf(n[j], sizeof n[j], "%s%s", pre, nm->sfx[j]);
        if (weights_vector(w, n[0], H, false, &l->attn_norm, err) ||
            weights_vector(w, n[1], H, false, &l->ffn_norm, err) ||
            weights_matrix(w, n[2], QD, H, &l->wq, err) || weights_matrix(w, n[3], KD, H, &l->wk, err) ||
            weights_matrix(w, n[4], KD, H, &l->wv, err) || weights_matrix(w, n[5], H, QD, &l->wo, err) ||
            weights_matrix(w, n[6], F, H, &l->w_gate, err) || weights_matrix(w, n[7], F, H, &l->w_up, err) ||
            weights_matrix(w, n[8], H, F, &l->w_down, err) ||
            weights_vector(w, n[9], QD, !c->qkv_bias, &l->bq, err) ||
            weights_vector(w, n[10], KD, !c->qkv_bias, &l->bk, err) ||
            weights_vector(w, n[11], KD, !c->qkv_bias, &l->bv, err))
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
        rc = config_hf(m, path, err);
        if (rc == AE_OK) rc = weights_open(&m->w, path, err);
        if (rc == AE_OK) rc = load_tensors(m, &hf_names, err);
    } else {
        rc = weights_open(&m->w, path, err);
        if (rc == AE_OK) {
            rc = config_gguf(m, err);
            if (rc == AE_OK) rc = load_tensors(m, &gguf_names, err);
            if (rc != AE_OK && !strstr(err ? err->msg : "", path)) err_prefix(err, "%s: ", path);
        }
    }
    if (rc == AE_OK) rc = pack_weights(m, err);
    if (rc == AE_OK) {
        m->weight_bytes = m->w->bytes;
        m->converted_bytes = m->w->converted_bytes;
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

embedding_view model_embedding(const model *m) {
    return (embedding_view){m->cfg.hidden, m->cfg.vocab, m->cfg.n_layers, &m->tok_embd};
}
