/* Llama and Qwen2: GQA attention (Qwen2 with q/k/v biases), a dense
 * SwiGLU FFN, RMSNorm, RoPE; the same forward pass, read from GGUF or
 * Hugging Face files. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../services/kv/kv.h"
#include "../arch.h"
#include "../tp.h"

static const char *const hf_types[] = {"llama", "qwen2", NULL};
static const char *const gguf_archs[] = {"llama", "qwen2", NULL};

static int config_gguf(model_config *c, const gguf_file *gf, ae_error *err) {
    bool llama = !strcmp(c->arch, "llama");
    const char *a = c->arch;
    if (arch_gguf_required(gf, a, "block_count", &c->n_layers, err) ||
        arch_gguf_required(gf, a, "embedding_length", &c->hidden, err) ||
        arch_gguf_required(gf, a, "feed_forward_length", &c->ffn, err) ||
        arch_gguf_required(gf, a, "attention.head_count", &c->n_heads, err))
        return AE_ERR;
    c->n_kv_heads = (int32_t)arch_gguf_int(gf, a, "attention.head_count_kv", c->n_heads);
    c->head_dim = (int32_t)arch_gguf_int(gf, a, "attention.key_length", c->n_heads ? c->hidden / c->n_heads : 0);
    int64_t ctx = arch_gguf_int(gf, a, "context_length", 2048);
    if (ctx < 1 || ctx > INT32_MAX) return err_set(err, "key %s.context_length: %lld is outside 1..%d", a, (long long)ctx, INT32_MAX);
    c->context_length = (int32_t)ctx;
    char key[192]; /* arch (< 128) + the longest suffix */
    float f;
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", a);
    c->rms_eps = gguf_get_f32(gf, key, &f, NULL) == AE_OK ? f : 1e-5f;
    if (!(c->rms_eps >= 0.0f && c->rms_eps <= 1.0f)) /* also NaN */
        return err_set(err, "key %s: %g is outside 0..1", key, (double)c->rms_eps);
    double theta;
    if (arch_gguf_num(gf, a, "rope.freq_base", 10000.0, &theta, err)) return AE_ERR;
    c->rope = (kn_rope_config){llama ? KN_ROPE_ADJACENT : KN_ROPE_NEOX, c->head_dim, theta, 0, 0, 0, 0, false, 0, 0};
    snprintf(key, sizeof key, "key %s.", a);
    if (arch_check_rope(&c->rope, &(arch_rope_keys){key, "rope.freq_base", NULL, "", NULL, NULL, NULL, NULL}, err))
        return AE_ERR;
    if (gguf_find_tensor(gf, "rope_freqs.weight"))
        return err_set(err, "rope_freqs.weight (Llama-3.1 rope scaling in GGUF) is not supported yet");
    const gguf_tensor *emb = gguf_find_tensor(gf, "token_embd.weight");
    if (!emb || emb->n_dims != 2) return err_set(err, "tensor token_embd.weight is missing or not 2-D");
    if (emb->ne[1] > INT32_MAX) return err_set(err, "vocabulary too large");
    c->vocab = (int32_t)emb->ne[1];
    c->qkv_bias = gguf_find_tensor(gf, "blk.0.attn_q.bias") != NULL;
    return AE_OK;
}

static int config_hf(model_config *c, const hfconfig *hc, const char *path, ae_error *err) {
    c->n_layers = hc->num_hidden_layers;
    c->hidden = hc->hidden_size;
    c->ffn = hc->intermediate_size;
    c->n_heads = hc->num_attention_heads;
    c->n_kv_heads = hc->num_key_value_heads;
    c->head_dim = hc->head_dim;
    c->vocab = hc->vocab_size;
    c->context_length = hc->max_position_embeddings;
    c->rms_eps = (float)hc->rms_norm_eps;
    c->tied_embeddings = hc->tie_word_embeddings; /* the loader then asks the file */
    c->qkv_bias = hc->attention_bias;
    /* Llama's attention_bias also biases o_proj, which the forward pass
     * does not have; Qwen2 biases q/k/v only. Refuse rather than run wrong. */
    if (hc->attention_bias && strcmp(c->arch, "qwen2"))
        return err_set(err, "%s: attention_bias on a %s model (an o_proj bias) is not supported", path, c->arch);
    c->rope = hfconfig_rope(hc);
    return arch_check_rope_hf(c, hc, NULL, path, err);
}

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
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers) return err_set(err, "out of memory");

    const int64_t H = c->hidden, F = c->ffn, QD = (int64_t)c->n_heads * c->head_dim,
            KD = (int64_t)c->n_kv_heads * c->head_dim;
    if (arch_load_ends(m, nm->embd, nm->norm, nm->output, err) != AE_OK) return AE_ERR;
    for (int i = 0; i < c->n_layers; i++) {
        model_layer *l = &m->layers[i];
        l->attn = MODEL_ATTN_GQA;
        l->ffn = MODEL_FFN_DENSE;
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

static int pack_weights(model *m, ae_error *err) {
    for (int32_t i = 0; i < m->cfg.n_layers; i++) {
        model_layer *l = &m->layers[i];
        kn_weight *w[7] = {&l->wq, &l->wk, &l->wv, &l->wo, &l->w_gate, &l->w_up, &l->w_down};
        for (int j = 0; j < 7; j++)
            if (weights_pack(m->w, w[j], err) != AE_OK) return AE_ERR;
    }
    return weights_pack(m->w, &m->output, err);
}

static int load(model *m, ae_error *err) {
    const tensor_names *nm = m->w->gguf ? &gguf_names : &hf_names;
    if (load_tensors(m, nm, err) != AE_OK) return AE_ERR;
    return pack_weights(m, err);
}

/* f16 K and V of every layer's kv heads (kv.h). */
static uint64_t kv_token_bytes(const model_config *c) {
    return kv_bytes_per_token(c->n_layers, c->n_kv_heads, c->head_dim);
}

/* In f32: the residual, the normed input, the projection output and the
 * row kept for logits (4 hidden); q and the attention output (2 n_heads
 * head_dim); k and v (2 n_kv_heads head_dim); gate and up (2 ffn); the
 * logits (vocab); RoPE cos and sin (head_dim); EAGLE-3's captured
 * features (3 hidden). */
static uint64_t workspace_per_token(const model_config *c) {
    return 4ull * (7ull * (uint64_t)c->hidden + 2ull * ((uint64_t)c->n_heads + (uint64_t)c->n_kv_heads) *
                                                    (uint64_t)c->head_dim +
                   2ull * (uint64_t)c->ffn + (uint64_t)c->vocab + (uint64_t)c->head_dim);
}

/* Every layer's seven matrices and two norms, then the output projection
 * and its norm (the embedding row is negligible). A matrix counts the
 * bytes of its own columns, so a tensor-parallel column shard counts its
 * share, not the full rows it strides over. */
static size_t decode_bytes(const model *m) {
    const model_config *c = &m->cfg;
    size_t b = 0;
    for (int32_t i = 0; i < c->n_layers; i++) {
        const model_layer *l = &m->layers[i];
        const kn_weight *w[7] = {&l->wq, &l->wk, &l->wv, &l->wo, &l->w_gate, &l->w_up, &l->w_down};
        for (int j = 0; j < 7; j++) b += (size_t)w[j]->rows * quant_row_bytes(w[j]->type, (uint64_t)w[j]->cols);
        b += 2 * (size_t)c->hidden * sizeof(float);
    }
    return b + (size_t)m->output.rows * quant_row_bytes(m->output.type, (uint64_t)m->output.cols) +
           (size_t)c->hidden * sizeof(float);
}

static void params(const model_config *c, arch_params *p) {
    const uint64_t L = (uint64_t)c->n_layers, H = (uint64_t)c->hidden, F = (uint64_t)c->ffn,
                   QD = (uint64_t)c->n_heads * (uint64_t)c->head_dim, KD = (uint64_t)c->n_kv_heads * (uint64_t)c->head_dim;
    *p = (arch_params){0};
    p->whole_f32 = L * 2 * H + H + (c->qkv_bias ? L * (QD + 2 * KD) : 0);
    p->split = L * (2 * H * QD + 2 * H * KD + 3 * H * F);
    p->embed = (uint64_t)c->vocab * H;
    p->output = c->tied_embeddings ? 0 : (uint64_t)c->vocab * H;
}

const arch arch_llama = {
    .name = "llama",
    .hf_types = hf_types,
    .gguf_archs = gguf_archs,
    .config_gguf = config_gguf,
    .config_hf = config_hf,
    .load = load,
    .kv_bytes_per_token = kv_token_bytes,
    .workspace_per_token = workspace_per_token,
    .decode_bytes = decode_bytes,
    .tp_split = tp_split_plan,
    .params = params,
};
