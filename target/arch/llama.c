/* Llama and Qwen2: GQA attention (Qwen2 with q/k/v biases), a dense
 * SwiGLU FFN, RMSNorm, RoPE; the same forward pass, read from GGUF or
 * Hugging Face files. */
#include <stddef.h>
#include <stdio.h>
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
    if (ctx < 1 || ctx > INT32_MAX)
        return err_set(err, "key %s.context_length: %lld is outside 1..%d", a, (long long)ctx, INT32_MAX);
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

/* A layer's tensors, in the order they are read (arch.h). */
#define F(field) offsetof(model_layer, field)
#define ONE {ARCH_ONE, ARCH_ONE}
#define H {ARCH_HIDDEN, ARCH_ONE}
#define QD {ARCH_HEADS, ARCH_HEAD_DIM}
#define KD {ARCH_KV_HEADS, ARCH_HEAD_DIM}
#define FF {ARCH_FFN, ARCH_ONE}
static const arch_tensor tensors[] = {
    /* name, GGUF, Hugging Face, block, held, read, split, flags, field, rows, cols */
    {"attn_norm", "attn_norm.weight", "input_layernorm.weight", ARCH_EVERY, ARCH_VEC, ARCH_READ_VECTOR, ARCH_WHOLE, 0,
     F(attn_norm), H, ONE},
    {"ffn_norm", "ffn_norm.weight", "post_attention_layernorm.weight", ARCH_EVERY, ARCH_VEC, ARCH_READ_VECTOR,
     ARCH_WHOLE, 0, F(ffn_norm), H, ONE},
    {"attn_q", "attn_q.weight", "self_attn.q_proj.weight", ARCH_GQA, ARCH_MAT, ARCH_READ_MATRIX, ARCH_ROWS, ARCH_PACK,
     F(wq), QD, H},
    {"attn_k", "attn_k.weight", "self_attn.k_proj.weight", ARCH_GQA, ARCH_MAT, ARCH_READ_MATRIX, ARCH_ROWS, ARCH_PACK,
     F(wk), KD, H},
    {"attn_v", "attn_v.weight", "self_attn.v_proj.weight", ARCH_GQA, ARCH_MAT, ARCH_READ_MATRIX, ARCH_ROWS, ARCH_PACK,
     F(wv), KD, H},
    {"attn_output", "attn_output.weight", "self_attn.o_proj.weight", ARCH_GQA, ARCH_MAT, ARCH_READ_MATRIX, ARCH_COLS,
     ARCH_PACK, F(wo), H, QD},
    {"ffn_gate", "ffn_gate.weight", "mlp.gate_proj.weight", ARCH_DENSE, ARCH_MAT, ARCH_READ_MATRIX, ARCH_ROWS,
     ARCH_PACK, F(w_gate), FF, H},
    {"ffn_up", "ffn_up.weight", "mlp.up_proj.weight", ARCH_DENSE, ARCH_MAT, ARCH_READ_MATRIX, ARCH_ROWS, ARCH_PACK,
     F(w_up), FF, H},
    {"ffn_down", "ffn_down.weight", "mlp.down_proj.weight", ARCH_DENSE, ARCH_MAT, ARCH_READ_MATRIX, ARCH_COLS,
     ARCH_PACK, F(w_down), H, FF},
    /* Qwen2's */
    {"attn_q.bias", "attn_q.bias", "self_attn.q_proj.bias", ARCH_GQA, ARCH_VEC, ARCH_READ_VECTOR, ARCH_ROWS, ARCH_BIAS,
     F(bq), QD, ONE},
    {"attn_k.bias", "attn_k.bias", "self_attn.k_proj.bias", ARCH_GQA, ARCH_VEC, ARCH_READ_VECTOR, ARCH_ROWS, ARCH_BIAS,
     F(bk), KD, ONE},
    {"attn_v.bias", "attn_v.bias", "self_attn.v_proj.bias", ARCH_GQA, ARCH_VEC, ARCH_READ_VECTOR, ARCH_ROWS, ARCH_BIAS,
     F(bv), KD, ONE},
};
#undef F
#undef ONE
#undef H
#undef QD
#undef KD
#undef FF

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
    return 4ull * (7ull * (uint64_t)c->hidden +
                   2ull * ((uint64_t)c->n_heads + (uint64_t)c->n_kv_heads) * (uint64_t)c->head_dim +
                   2ull * (uint64_t)c->ffn + (uint64_t)c->vocab + (uint64_t)c->head_dim);
}

const arch arch_llama = {
    .name = "llama",
    .hf_types = hf_types,
    .gguf_archs = gguf_archs,
    .config_gguf = config_gguf,
    .config_hf = config_hf,
    .load = arch_load_tensors,
    .tensors = tensors,
    .n_tensors = sizeof tensors / sizeof tensors[0],
    .attn = MODEL_ATTN_GQA,
    .kv_bytes_per_token = kv_token_bytes,
    .workspace_per_token = workspace_per_token,
    .tp_split = tp_split_plan,
};
