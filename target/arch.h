/* Model architectures. Each is one file in target/arch/ that fills in an
 * arch: the model types it reads, its hyperparameters and tensors, its KV
 * bytes per token, and how it splits across tensor-parallel ranks. Model
 * loading (model.c), the memory plan (setup.c) and tensor parallelism
 * (tp.c) ask the model's arch, and have no per-architecture code.
 *
 * A layer's tensors are listed once, in the arch's table (arch_tensor):
 * each one's names in the two formats, its shape from the config, the
 * field of model_layer it fills and how tensor parallelism divides it.
 * Loading (arch_load_tensors), the shards (tp.c), the bytes a decode step
 * reads and the bytes by type (model.c) walk that table and name no
 * matrix themselves.
 *
 * A layer is made of tagged blocks (model.h): attention is GQA (or MLA),
 * the FFN dense (or MoE). The forward pass (forward.c) runs one layer loop
 * for every architecture. The loop owns the EAGLE-3 capture and the
 * allreduce hooks, and each block's kind picks the ops that run it. A new
 * architecture is a new file here, its name in arch.c's list, and, where
 * it needs them, new block kinds and ops. */
#ifndef AERIE_TARGET_ARCH_H
#define AERIE_TARGET_ARCH_H

#include <stddef.h>
#include <stdint.h>

#include "../services/core/err.h"
#include "../services/model/gguf.h"
#include "../services/model/hfconfig.h"
#include "model.h"

struct tp_split; /* tp.h */

/* A model's parameters counted from its config alone, by where tensor
 * parallelism puts them and how Aerie holds them (aerie plan). Matrices
 * are in the file's type; "f32" ones Aerie always holds as f32 (norms,
 * biases, MLA's per-head matrices). */
typedef struct arch_params {
    uint64_t whole;     /* matrices every rank holds whole */
    uint64_t whole_f32; /* f32 vectors every rank holds: norms, biases */
    uint64_t embed;     /* the embedding table: every rank */
    uint64_t output;    /* the output projection: rank 0 (0 when tied) */
    uint64_t split;     /* divided among the ranks: heads' and FFN features' matrices */
    uint64_t split_f32; /* the same, held as f32 */
    uint64_t experts;   /* routed experts, each divided among the ranks */
} arch_params;

/* ---- a layer's tensors ------------------------------------------------------ */

/* A number from the config (arch_size_value). */
typedef enum arch_size {
    ARCH_ONE,
    ARCH_HIDDEN,      /* hidden */
    ARCH_FFN,         /* ffn: a dense FFN's features */
    ARCH_HEADS,       /* n_heads */
    ARCH_KV_HEADS,    /* n_kv_heads */
    ARCH_HEAD_DIM,    /* head_dim */
    ARCH_Q_RANK,      /* MLA's query input: q_lora_rank, or hidden without one */
    ARCH_KV_RANK,     /* kv_lora_rank */
    ARCH_NOPE_DIM,    /* qk_nope_dim */
    ARCH_ROPE_DIM,    /* qk_rope_dim */
    ARCH_V_DIM,       /* v_head_dim */
    ARCH_LATENT_DIM,  /* kv_lora_rank + qk_rope_dim: kv_a's rows */
    ARCH_Q_HEAD_DIM,  /* qk_nope_dim + qk_rope_dim: a head's rows of q_b */
    ARCH_KV_HEAD_DIM, /* qk_nope_dim + v_head_dim: a head's rows of kv_b */
    ARCH_EXPERTS,     /* route.n_experts */
    ARCH_EXPERT_FFN,  /* expert_ffn: each routed expert's features */
    ARCH_SHARED_FFN,  /* shared_ffn: the shared experts' features */
} arch_size;

/* A dimension of n x unit: n things of unit each (heads of head_dim rows,
 * ffn features of one). Tensor parallelism divides n (arch_shard). */
typedef struct arch_dim {
    arch_size n, unit;
} arch_dim;

/* Which layers hold a tensor: every layer, or those with a block of this
 * kind (model.h). */
typedef enum arch_block { ARCH_EVERY, ARCH_GQA, ARCH_MLA, ARCH_DENSE, ARCH_MOE } arch_block;

/* What a tensor fills. */
typedef enum arch_held {
    ARCH_VEC,    /* a const float * field of model_layer: f32 [rows] */
    ARCH_MAT,    /* a kn_weight field of model_layer: [rows][cols] */
    ARCH_EXPERT, /* one matrix of every routed expert (at: 0 gate, 1 up, 2 down): experts[at E + e] */
    ARCH_SRC,    /* no field: a source of the arch's made tensors (at: its index, < ARCH_MAX_SOURCES) */
} arch_held;

/* How the file's tensor is read (services/model/weights.h). */
typedef enum arch_read {
    ARCH_MADE,        /* not read: the arch's make fills it from its sources */
    ARCH_READ_VECTOR, /* weights_vector */
    ARCH_READ_MATRIX, /* weights_matrix: the name as the table has it */
    ARCH_READ_ANY,    /* {name}.weight, or compressed-tensors int4 at {name} (weights_int4_matrix) */
    ARCH_READ_HEADS,  /* weights_matrix_3d: rows.n matrices of [rows.unit][cols] */
} arch_read;

/* How tensor parallelism divides a tensor (tp.h): every rank holds it
 * whole, or the range of rows (output features) or columns (input
 * features) of its share of the split dimension, rows.n or cols.n:
 * ARCH_HEADS, ARCH_KV_HEADS, ARCH_FFN, ARCH_SHARED_FFN, ARCH_EXPERT_FFN. */
typedef enum arch_shard { ARCH_WHOLE, ARCH_ROWS, ARCH_COLS } arch_shard;

/* arch_tensor.flags */
enum {
    ARCH_PACK = 1 << 0,       /* packed for the CPU kernels once its layer is read (weights_pack) */
    ARCH_BIAS = 1 << 1,       /* optional unless the config has qkv_bias */
    ARCH_ROUTER = 1 << 2,     /* f32 or bf16 only: the router's logits are f32 */
    ARCH_Q_LORA = 1 << 3,     /* held only with a q_lora_rank */
    ARCH_NO_Q_LORA = 1 << 4,  /* held only without one */
    ARCH_SHARED = 1 << 5,     /* held only with shared experts */
    ARCH_IF_PRESENT = 1 << 6, /* read only where the file has it */
    ARCH_IF_HAD = 1 << 7,     /* read only where the last ARCH_IF_PRESENT tensor was */
    ARCH_IF_NOT_HAD = 1 << 8, /* read only where it was not */
    ARCH_F32 = 1 << 9,        /* held as f32 whatever the file's type (made by weights_f32) */
};

#define ARCH_MAX_SOURCES 8

/* One tensor of a layer. Tables list them in the order they are read, so
 * that the first missing or misshapen one is the one an error names; a
 * run of ARCH_EXPERT entries is read expert by expert. */
typedef struct arch_tensor {
    const char *name; /* in messages: "attn_output", "ffn_down" */
    /* The file's name after the layer's prefix ("blk.N." in GGUF,
     * "model.layers.N." in Hugging Face files), NULL where that format
     * has none. ARCH_EXPERT: a GGUF file stacks the experts in one 3-D
     * tensor, a Hugging Face one has one each, %d its index. */
    const char *gguf, *hf;
    arch_block block;
    arch_held held;
    arch_read read;
    arch_shard shard;
    unsigned flags;
    size_t at;           /* ARCH_VEC, ARCH_MAT: offsetof(model_layer, the field) */
    arch_dim rows, cols; /* its shape; a vector's cols are ARCH_ONE */
} arch_tensor;

typedef struct arch {
    const char *name;
    const char *const *hf_types;   /* Hugging Face model_type values it reads; NULL-terminated */
    const char *const *gguf_archs; /* GGUF general.architecture values it reads; NULL-terminated */
    /* The hyperparameters, into c (c->arch is set): from a GGUF file's
     * keys, or from a Hugging Face config.json (read at path). */
    int (*config_gguf)(model_config *c, const gguf_file *f, ae_error *err);
    int (*config_hf)(model_config *c, const hfconfig *hc, const char *path, ae_error *err);
    /* Every tensor the forward pass reads, from m->w, with each layer's
     * block kinds; quantized matrices packed (weights_pack). Both
     * architectures read through arch_load_tensors. */
    int (*load)(model *m, ae_error *err);
    /* A layer's tensors, in the order they are read. */
    const arch_tensor *tensors;
    size_t n_tensors;
    /* Its attention's block kind (every layer's); the FFN is MoE from
     * layer n_dense_layers on where the config has routed experts. */
    model_attn attn;
    /* The layer's ARCH_MADE tensors, from its sources as they were read
     * (src[at] for an ARCH_SRC at; zero where none was). NULL: none. */
    int (*make)(model *m, model_layer *l, const kn_weight *src, ae_error *err);
    /* Bytes of KV one token takes, all layers together. */
    uint64_t (*kv_bytes_per_token)(const model_config *c);
    /* Bytes of f32 working memory one token of a forward pass takes: the
     * memory plan's per-token workspace (memplan.h), which is what its
     * blocks' buffers, its logits row and its captured features need. */
    uint64_t (*workspace_per_token)(const model_config *c);
    /* The split of heads and FFN features over n_ranks ranks. */
    int (*tp_split)(struct tp_split *out, const model_config *c, int32_t n_ranks, ae_error *err);
    /* Whether every rank holds all of the KV (MLA's latent, shared by all
     * heads) rather than its heads' share. */
    bool kv_replicated;
} arch;

extern const arch arch_llama;    /* arch/llama.c: Llama and Qwen2 */
extern const arch arch_deepseek; /* arch/deepseek.c: DeepSeek-V3, Kimi-K2 */

/* The architecture that reads a GGUF general.architecture or a Hugging
 * Face model_type; NULL (err says which there are) for none. */
const arch *arch_for_gguf(const char *name, ae_error *err);
const arch *arch_for_hf(const char *model_type, ae_error *err);

/* A number of the config, and a dimension's n x unit. */
int64_t arch_size_value(const model_config *c, arch_size s);
int64_t arch_dim_value(const model_config *c, arch_dim d);

/* Layer i's FFN block under config c: MoE from n_dense_layers on where
 * there are routed experts, else dense. */
model_ffn arch_layer_ffn(const model_config *c, int32_t i);

/* Whether layer l (its block kinds set) holds t under config c: its block
 * and its ARCH_Q_LORA, ARCH_NO_Q_LORA and ARCH_SHARED conditions. */
bool arch_layer_has(const model_config *c, const model_layer *l, const arch_tensor *t);

/* The field t fills in l (ARCH_VEC: a const float *; ARCH_MAT: a kn_weight). */
static inline void *arch_field(model_layer *l, const arch_tensor *t) { return (char *)l + t->at; }
static inline const void *arch_field_const(const model_layer *l, const arch_tensor *t) {
    return (const char *)l + t->at;
}

/* Every tensor of m from m->w by its arch's table: the model's two ends
 * (the embedding table, the final norm and the output projection, the
 * embedding table where the file has none: tied), then layer by layer
 * each tensor it holds, read as its entry says, the arch's made ones,
 * and the ARCH_PACK ones packed. */
int arch_load_tensors(model *m, ae_error *err);

/* Bytes of weights one decode step of one token reads (the model's or a
 * tensor-parallel shard's): every matrix of the table its layers hold,
 * top_k of the routed experts, the two norms of a layer, then the output
 * projection and its norm (the embedding row is negligible). A matrix
 * counts the bytes of its own columns, so a tensor-parallel column shard
 * counts its share, not the full rows it strides over. The numerator of
 * the bandwidth roofline (model_decode_bytes). */
size_t arch_decode_bytes(const model *m);

/* The parameters of a model of architecture a and config c (or of a
 * tensor-parallel shard's config: tp_shard_config), from its table alone:
 * every tensor its layers hold, the sources left out, by how tensor
 * parallelism places it; vectors (norms, and biases where the config has
 * them) count as f32 every rank holds. */
void arch_count_params(const arch *a, const model_config *c, arch_params *out);

/* GGUF's {name}.{suffix} integer key, or def when it is absent. */
int64_t arch_gguf_int(const gguf_file *f, const char *name, const char *suffix, int64_t def);
/* The same, required to be in 1..INT32_MAX. */
int arch_gguf_required(const gguf_file *f, const char *name, const char *suffix, int32_t *out, ae_error *err);
/* GGUF's {name}.{suffix} key into *out, an f32 or f64 (arch_gguf_num) or
 * an integer (arch_gguf_int_key), or def when it is absent; present with
 * another type is an error naming the key rather than the default. */
int arch_gguf_num(const gguf_file *f, const char *name, const char *suffix, double def, double *out, ae_error *err);
int arch_gguf_int_key(const gguf_file *f, const char *name, const char *suffix, int64_t def, int64_t *out,
                      ae_error *err);

/* The keys a config's RoPE numbers were read from, for arch_check_rope's
 * errors: `where` comes before every name, `scaling` before YaRN's. A
 * GGUF file's: "key deepseek2." + "rope.freq_base", "rope.scaling." +
 * "factor"; a config.json's: "" + "rope_theta", "rope_scaling." +
 * "factor" (the caller then puts the file's path in front). dims NULL: the
 * rotated dims are the head's, which check_config checks (model.c). */
typedef struct arch_rope_keys {
    const char *where;
    const char *theta, *dims;
    const char *scaling;
    const char *factor, *original, *beta_fast, *beta_slow;
} arch_rope_keys;

/* RoPE's numbers as a config reader built them (model_config.rope), for
 * every architecture and both formats, checked where they are read
 * rather than when the weights are loaded (kn_rope_init): the base finite
 * and in (0, 1e12], and above 1 with YaRN, whose band divides by its log;
 * the dims even, 2..KN_MAX_HEAD_DIM (RoPE turns pairs); YaRN's factor in
 * [1, 1e6] (it divides the frequencies, and ln(factor) scales the
 * softmax), its original context in 1..2^30, beta_fast and beta_slow in
 * (0, 1e6] with beta_fast >= beta_slow (the band runs from beta_fast's
 * dims to beta_slow's). The bounds are config.json's reader's
 * (services/model/hfconfig.c), so both formats refuse the same numbers.
 * Errors name the key and its value. */
int arch_check_rope(const kn_rope_config *r, const arch_rope_keys *k, ae_error *err);
/* The same for c->rope as read from the config.json at path (hc), whose
 * rotated dims are the key dims (NULL: the head's); errors start with
 * the path. */
int arch_check_rope_hf(const model_config *c, const hfconfig *hc, const char *dims, const char *path, ae_error *err);

#endif
