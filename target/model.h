/* The served model's weights and shape, loaded from a GGUF file or a
 * Hugging Face directory (config.json + safetensors).
 *
 * Weights stay in their file format where kn_matmul has a native kernel
 * (F32, F16, BF16, Q8_0, Q4_0, Q4_1 from GGUF; BF16 from safetensors),
 * pointing into the mapped file; compressed-tensors int4 becomes Q4_0
 * (weights.h); anything else is converted to f32 at load. Norm vectors
 * and biases are f32.
 *
 * RoPE layout follows the source: GGUF llama files store q/k rows permuted
 * for adjacent-pair rotation (KN_ROPE_ADJACENT); Hugging Face weights, and
 * GGUF qwen2, use the half-split NeoX rotation. Using the layout the weights
 * were written for avoids un-permuting at load. */
#ifndef AERIE_TARGET_MODEL_H
#define AERIE_TARGET_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../kernels/kernels.h"
#include "../services/core/err.h"
#include "../services/model/embedding.h"
#include "../services/model/hfconfig.h"
#include "../services/model/weights.h"

#define MODEL_MAX_LAYERS 256

typedef struct model_config {
    char arch[128]; /* as the file names it: "llama", "qwen2" */
    int32_t n_layers;
    int32_t hidden; /* H */
    int32_t ffn;    /* F */
    int32_t n_heads;
    int32_t n_kv_heads;
    int32_t head_dim; /* D */
    int32_t vocab;    /* V */
    int32_t context_length;
    float rms_eps;
    bool tied_embeddings; /* output projection is the embedding table */
    bool qkv_bias;        /* Qwen2 */
    kn_rope_config rope;
    /* MLA (DeepSeek-V3): attention reads a latent cache, one kv head of
     * kv_lora_rank + qk_rope_dim (n_kv_heads 1, head_dim that sum), and
     * the heads' queries are absorbed into it. 0 where there is none. */
    int32_t q_lora_rank; /* 0: the query straight from the input */
    int32_t kv_lora_rank;
    int32_t qk_nope_dim, qk_rope_dim, v_head_dim;
    float attn_scale; /* the softmax scale; 0: 1 / sqrt(head_dim) */
    /* Mixture of experts: layers from n_dense_layers on (route.n_experts
     * 0: none). ffn is the dense layers' width. */
    int32_t n_dense_layers;
    int32_t expert_ffn; /* each routed expert's width */
    int32_t shared_ffn; /* the shared experts' width together (0: none) */
    kn_route route;
} model_config;

/* A layer's blocks, by kind (arch.h), each with its fields below. */
typedef enum model_attn { MODEL_ATTN_GQA, MODEL_ATTN_MLA } model_attn;
typedef enum model_ffn { MODEL_FFN_DENSE, MODEL_FFN_MOE } model_ffn;

typedef struct model_layer {
    model_attn attn;
    model_ffn ffn;
    const float *attn_norm; /* [H] */
    const float *ffn_norm;  /* [H] */
    kn_weight wq;           /* [n_heads * D][H] */
    kn_weight wk;           /* [n_kv_heads * D][H] */
    kn_weight wv;           /* [n_kv_heads * D][H] */
    kn_weight wo;           /* [H][n_heads * D] */
    const float *bq;        /* [n_heads * D] or NULL */
    const float *bk;        /* [n_kv_heads * D] or NULL */
    const float *bv;        /* [n_kv_heads * D] or NULL */
    kn_weight w_gate;       /* [F][H]; MoE: the shared experts' [shared_ffn][H] */
    kn_weight w_up;         /* [F][H]; the same */
    kn_weight w_down;       /* [H][F]; MoE: [H][shared_ffn] */
    /* MLA (R = kv_lora_rank, Q = q_lora_rank, or H without it); wo is
     * [H][n_heads * v_head_dim] */
    kn_weight wq_a;         /* [Q][H] (with a q_lora_rank) */
    const float *q_a_norm;  /* [Q] */
    kn_weight wq_nope;      /* [n_heads * qk_nope_dim][Q]: q_b's rows, head by head */
    kn_weight wq_pe;        /* [n_heads * qk_rope_dim][Q] */
    kn_weight wkv_a;        /* [R][H]: kv_a_proj_with_mqa's first rows */
    kn_weight wk_pe;        /* [qk_rope_dim][H]: its last rows */
    const float *kv_a_norm; /* [R] */
    kn_weight w_uk;         /* f32 [n_heads * R][qk_nope_dim]: each head's W_UK transposed */
    kn_weight w_uv;         /* f32 [n_heads * v_head_dim][R] */
    /* MoE */
    kn_weight router;         /* f32 or bf16 [n_experts][H]: f32 logits */
    const float *router_bias; /* [n_experts] e_score_correction_bias */
    kn_weight *experts;       /* [3][n_experts]: gate and up [expert_ffn][H], down [H][expert_ffn] */
} model_layer;

typedef struct model {
    model_config cfg;
    const struct arch *arch;  /* arch.h: what reads, plans and splits this model */
    const kn_backend *be;     /* whose memory the weights are in: engines on it run the model */
    kn_weight tok_embd;       /* [V][H] */
    kn_weight output;         /* [V][H]; the same as tok_embd when tied */
    const float *output_norm; /* [H] */
    kn_rope rope;             /* frequencies for cfg.rope, computed at load */
    model_layer *layers;      /* [n_layers] */
    size_t weight_bytes;      /* bytes of weights as used (mapped + converted) */
    size_t converted_bytes;   /* of which converted to f32 at load */
    char path[1024];
    weights_store *w; /* the file's tensors, and the buffers converted from them */
} model;

/* path: a .gguf file or a Hugging Face model directory, loaded into the
 * memory of be (weights.h). Errors name the file and the missing or
 * malformed tensor or key. */
int model_load(model **out, const char *path, const kn_backend *be, ae_error *err);
void model_free(model *m); /* NULL is a no-op */

/* A Hugging Face config.json (path) alone: its architecture (*a), the
 * parsed file (hc) and the hyperparameters, checked as model_load checks
 * them. For planning without weights (aerie plan). */
struct arch;
int model_config_read(model_config *c, const struct arch **a, hfconfig *hc, const char *path, ae_error *err);

/* The same from an open GGUF file's keys (and its embedding table's
 * shape), as model_load reads them, without its weights. */
int model_config_gguf(model_config *c, const struct arch **a, const gguf_file *f, ae_error *err);

/* Bytes read from weights by one decode step of one token, as the
 * model's architecture counts them (arch.h decode_bytes). The numerator
 * of the bandwidth roofline. */
size_t model_decode_bytes(const model *m);

/* Bytes of the model's matrices by type (bytes[t] for ggml_type t,
 * [GGML_TYPE_COUNT_MAX]), the embedding table and an untied output
 * included, each matrix once; *experts: the routed experts' of them. */
void model_bytes_by_type(const model *m, uint64_t *bytes, uint64_t *experts);

/* What an EAGLE-3 head reads of the model (services/model/embedding.h). */
embedding_view model_embedding(const model *m);

#endif
