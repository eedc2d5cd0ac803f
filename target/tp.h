/* Tensor parallelism: R ranks, each a thread of this process with its own
 * stream, each running the whole forward_pass over its shard of the
 * weights (kernels/kernels.h, "Tensor parallelism"). On the CPU backend
 * the ranks reduce on the host; on CUDA they are on one GPU or a GPU each
 * (tp_config.rank_be) and reduce by NCCL or the custom kernel (kernels.h
 * kn_allreduce).
 *
 * A shard is a `model` whose cfg holds the rank's local n_heads, n_kv_heads
 * and ffn (MoE: shared_ffn and expert_ffn), and whose kn_weight views point
 * into the full model's data; no weight is copied. tp_shard_init walks the
 * architecture's table of a layer's tensors (arch.h arch_tensor), whose
 * entries say which of them are whole, split by rows or split by columns,
 * and along which dimension:
 *   - column-parallel wq/wk/wv (+ biases), w_gate/w_up: a contiguous range
 *     of output rows. Attention is split by whole kv-head groups: a rank
 *     owns kv heads [a, b) and the q heads that read them, so grouped-query
 *     attention stays local.
 *   - row-parallel wo, w_down: a range of input columns, as a view whose
 *     data starts at the range's first block and whose row_bytes stays the
 *     full row's stride. The range must be whole quant blocks.
 *   - MLA: the query heads' rows of q_b (nope and rope parts), W_UK and
 *     W_UV, and o_proj's matching columns; q_a and kv_a (the latent) are
 *     whole, so every rank writes the same latent into its own cache.
 *   - MoE: each expert's (and the shared experts') gate and up rows and
 *     down columns of the rank's range; the router whole, so every rank
 *     picks the same experts. The shared and routed outputs are summed
 *     before the FFN's one allreduce.
 *   - tok_embd, norms, output: shared. Every rank holds the full residual
 *     stream; the two allreduce hooks in forward_pass add the partial
 *     o_proj and down outputs, and every rank gets the same bits.
 *
 * Head counts need not divide evenly: 3 kv heads over 2 ranks give rank 0
 * two kv heads and rank 1 one. */
#ifndef AERIE_TARGET_TP_H
#define AERIE_TARGET_TP_H

#include <stdint.h>

#include "../kernels/kernels.h"
#include "../services/core/err.h"
#include "forward.h"
#include "model.h"

#define TP_MAX_RANKS 64

/* Granule of an ffn split: boundaries fall on multiples of this, so a
 * quantized w_down's column shard is whole blocks. */
#define TP_FFN_ALIGN 32

typedef struct tp_range {
    int32_t begin, end; /* [begin, end) */
} tp_range;

/* Which part of each split dimension every rank owns (plain data). */
typedef struct tp_split {
    int32_t n_ranks;
    tp_range kv_heads[TP_MAX_RANKS]; /* kv heads */
    tp_range heads[TP_MAX_RANKS];    /* q heads: kv_heads x (n_heads / n_kv_heads) */
    tp_range ffn[TP_MAX_RANKS];      /* ffn features (dense layers) */
    tp_range shared[TP_MAX_RANKS];   /* the shared experts' features (MoE layers) */
    tp_range expert[TP_MAX_RANKS];   /* each routed expert's features (MoE layers) */
    /* MLA: every rank computes and holds the whole latent (kv_heads [0, 1)
     * on every rank), and the query heads are cut evenly. */
    bool latent;
} tp_split;

/* The split for n_ranks ranks: kv heads as even as possible (the first
 * n_kv_heads % R ranks take one more), ffn cut at multiples of
 * TP_FFN_ALIGN as evenly as possible (the remainder below the granule goes
 * to the last rank). Fails when a rank would get no kv head or no ffn
 * feature. */
int tp_split_plan(tp_split *out, const model_config *c, int32_t n_ranks, ae_error *err);

/* The split of an MLA model (DeepSeek-V3): the latent on every rank, the
 * query heads as even as possible, and each FFN width (dense, shared
 * experts, every routed expert) cut as tp_split_plan cuts ffn. Expert
 * parallelism (whole experts a rank, two all-to-alls per MoE layer
 * instead of the allreduce) is not built. */
int tp_split_latent(tp_split *out, const model_config *c, int32_t n_ranks, ae_error *err);

/* Rank `rank`'s shard of `full` under split sp, as views into full's
 * weights (full must outlive it). Fails when a row-parallel column range
 * is not whole quant blocks of its weight type. Free with tp_shard_free,
 * never model_free. */
int tp_shard_init(model **out, const model *full, const tp_split *sp, int32_t rank, ae_error *err);
/* The hyperparameters of rank `rank`'s shard (its heads, kv heads and FFN
 * widths), from the model's config alone: what the rank's buffers are
 * sized by (aerie plan). */
void tp_shard_config(model_config *out, const model_config *c, const tp_split *sp, int32_t rank);
void tp_shard_free(model *shard); /* NULL is a no-op */

typedef struct tp_config {
    int32_t n_ranks;          /* 1..TP_MAX_RANKS */
    int32_t threads_per_rank; /* each rank's own pool, the rank's thread included */
    int32_t max_tokens;       /* tokens in one forward pass */
    int32_t max_logits;       /* logit rows in one forward pass (rank 0) */
    int32_t kv_blocks;        /* KV blocks per layer; block ids of the maps index these */
    int32_t block_size;       /* tokens per KV block */
    int32_t act_bits;         /* every rank's activation precision, 15 or 8 (0: 15; kernels.h) */
    int32_t max_seq_len;      /* keys one token may see, for the streams' workspace (0: unbounded) */
    /* The ranks' KV pools, rank r's layer l at kv[r * n_layers + l], with
     * the rank's kv heads and kv_blocks x block_size slots (an engine's
     * sharded KV cache, services/kv); NULL: the group makes its own. */
    const kn_kv_pool *kv;
    /* How the ranks add partials (kernels.h kn_allreduce); AUTO: CPU on a
     * host-memory backend, custom on others (the engine measures before
     * it chooses: engine.h engine_set_tp). */
    kn_allreduce allreduce;
    /* Rank r's backend (a device's table: backend.h), rank_be[r]; NULL:
     * every rank on the model's. A rank on another backend than the
     * model's gets its shard's matrices and the embedding table copied
     * into that backend's memory; it reads the rest (norms, biases, the
     * step's inputs) where they are, so its backend must reach the
     * model's memory and the model's reach its (kn_backend_reads). */
    const kn_backend *const *rank_be;
} tp_config;

typedef struct tp_group tp_group;

/* R ranks over model m (m must outlive the group): shards, one stream and
 * llama workspace per rank, KV pools per rank sized for its local kv heads
 * (f32 [kv_blocks][block_size][local kv heads][head_dim] per layer, K and
 * V), one kn_comm per rank, and R - 1 persistent threads (rank 0 runs on
 * the caller of tp_forward). */
int tp_group_init(tp_group **out, const model *m, const tp_config *cfg, ae_error *err);
void tp_group_free(tp_group *g); /* NULL is a no-op */

/* Runs b on every rank at once and returns when every rank has queued
 * its part (on a host-memory backend: finished it). The map's block ids
 * address every rank's pools alike. b's logits and capture are filled by
 * rank 0 only (every rank holds the same residual stream). Stream
 * `after`, when not NULL, orders the ranks: they start after what was
 * queued on it, and what is queued on it next waits for all of them.
 * Shapes are asserted, as in forward_pass. Allocates nothing. */
void tp_forward(tp_group *g, kn_stream *after, const forward_batch *b);

/* Times `reps` allreduces of `count` floats (count <= max_tokens x hidden)
 * on every rank at once, after one untimed: rank 0's nanoseconds a call,
 * by its comm's clock (events on a GPU). For choosing a kind. */
double tp_group_time_allreduce(tp_group *g, size_t count, int reps);

/* Replaces the ranks' communicator with one of `kind` (not AUTO); on
 * failure the old one stays. */
int tp_group_set_allreduce(tp_group *g, kn_allreduce kind, ae_error *err);
kn_allreduce tp_group_allreduce(const tp_group *g);

/* Every rank's stream in fast mode, or not (kernels.h kn_stream_set_fast). */
int tp_group_set_fast(tp_group *g, bool fast, ae_error *err);

int32_t tp_group_ranks(const tp_group *g);
const tp_split *tp_group_split(const tp_group *g);
const model *tp_group_shard(const tp_group *g, int32_t rank);
/* Rank r's KV pools: [n_layers]. */
const kn_kv_pool *tp_group_kv(const tp_group *g, int32_t rank);
/* The bytes a rank on another backend than the model's copies of its
 * shard (tp_config.rank_be): its matrices, the embedding table, and for
 * rank 0 an untied output projection. */
uint64_t tp_rank_copy_bytes(const model *shard, int32_t rank);

/* Rank r's backend, and the bytes of weights copied into its memory (0
 * for a rank on the model's backend: views). */
const kn_backend *tp_group_backend(const tp_group *g, int32_t rank);
uint64_t tp_group_copied_bytes(const tp_group *g, int32_t rank);
/* Rank 0's allreduces so far (every rank makes the same calls). */
kn_comm_stats tp_group_comm_stats(tp_group *g);

#endif
