/* Model architectures. Each is one file in target/arch/ that fills in an
 * arch: the model types it reads, its hyperparameters and tensors, its KV
 * bytes per token, and how it splits across tensor-parallel ranks. Model
 * loading (model.c), the memory plan (setup.c) and tensor parallelism
 * (tp.c) ask the model's arch, and have no per-architecture code.
 *
 * A layer is made of tagged blocks (model.h): attention is GQA (or MLA),
 * the FFN dense (or MoE). The forward pass (llama.c) runs one layer loop
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
    uint64_t whole;      /* matrices every rank holds whole */
    uint64_t whole_f32;  /* f32 vectors every rank holds: norms, biases */
    uint64_t embed;      /* the embedding table: every rank */
    uint64_t output;     /* the output projection: rank 0 (0 when tied) */
    uint64_t split;      /* divided among the ranks: heads' and FFN features' matrices */
    uint64_t split_f32;  /* the same, held as f32 */
    uint64_t experts;    /* routed experts, each divided among the ranks */
} arch_params;

typedef struct arch {
    const char *name;
    const char *const *hf_types;   /* Hugging Face model_type values it reads; NULL-terminated */
    const char *const *gguf_archs; /* GGUF general.architecture values it reads; NULL-terminated */
    /* The hyperparameters, into c (c->arch is set): from a GGUF file's
     * keys, or from a Hugging Face config.json (read at path). */
    int (*config_gguf)(model_config *c, const gguf_file *f, ae_error *err);
    int (*config_hf)(model_config *c, const hfconfig *hc, const char *path, ae_error *err);
    /* Every tensor the forward pass reads, from m->w, with each layer's
     * block kinds; quantized matrices packed (weights_pack). */
    int (*load)(model *m, ae_error *err);
    /* Bytes of KV one token takes, all layers together. */
    uint64_t (*kv_bytes_per_token)(const model_config *c);
    /* Bytes of f32 working memory one token of a forward pass takes: the
     * memory plan's per-token workspace (memplan.h), which is what its
     * blocks' buffers, its logits row and its captured features need. */
    uint64_t (*workspace_per_token)(const model_config *c);
    /* Bytes of weights one decode step of one token reads (the model's or
     * a tensor-parallel shard's): the numerator of the bandwidth roofline
     * (model_decode_bytes). */
    size_t (*decode_bytes)(const model *m);
    /* The split of heads and FFN features over n_ranks ranks. */
    int (*tp_split)(struct tp_split *out, const model_config *c, int32_t n_ranks, ae_error *err);
    /* Its parameters, from the config alone. */
    void (*params)(const model_config *c, arch_params *out);
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

/* The model's two ends: the embedding table, the final norm and the
 * output projection (the embedding table where the file has no output
 * tensor: tied). */
int arch_load_ends(model *m, const char *embd, const char *norm, const char *output, ae_error *err);

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
