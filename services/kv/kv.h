/* Paged KV cache: one pool of fixed-size blocks shared by every sequence.
 *
 * All memory is taken at kv_init from the sizes the memory plan chose; no
 * call after that allocates (ARCHITECTURE.md, Invariants). The pools, and the
 * block tables the kernels read, are buffers of the backend given to
 * kv_init; the bookkeeping is host memory.
 *
 * Layout (the attention kernel reads it directly; see kernels/kernels.h):
 *   per layer l, a K pool and a V pool, each
 *     f16 [n_blocks][block_size][n_kv_heads][head_dim]
 *   (a latent cache, MLA's: the K pool alone, one head of the latent)
 *   (IEEE half bit patterns, as kn_kv_write rounds them)
 *   per sequence a block table, int32 [max_blocks_per_seq] of block ids,
 *   stored as rows of one int32 [max_seqs][max_blocks_per_seq] array.
 * Slot s of a sequence lives in block block_table[s / block_size], row
 * s % block_size; one row is n_kv_heads * head_dim contiguous halves.
 *
 * A sequence has a committed length (slots 0 .. len-1 hold the KV of tokens
 * that are final) and a capacity (blocks held x block_size). Slots between
 * the two are scratch: a verification tree writes node i into slot
 * len + i, and kv_commit_path keeps the accepted path and drops the rest.
 *
 * Sequence ids come from the engine, not from the network: passing an id
 * that is not live is a broken invariant (always-on assert). Running out of
 * blocks or sequence slots is a runtime failure with an error text. */
#ifndef AERIE_KV_KV_H
#define AERIE_KV_KV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../../kernels/kernels.h"
#include "../core/err.h"

typedef struct kv_cache kv_cache;

typedef struct kv_params {
    int32_t n_layers;
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t block_size;         /* tokens per block, e.g. 16 */
    int32_t n_blocks;           /* blocks in the shared pool */
    int32_t max_seqs;           /* sequences live at once */
    int32_t max_blocks_per_seq; /* block table length: max slots = this x block_size */
    /* MLA's compressed latent: one pool per layer (its values are its
     * keys, kernels.h), n_kv_heads 1, and under tensor parallelism every
     * shard holds all of it (the latent is shared by all heads). */
    bool latent;
} kv_params;

typedef struct kv_stats {
    int32_t n_blocks;    /* pool size */
    int32_t blocks_used; /* held by live sequences */
    int32_t blocks_free;
    int32_t blocks_peak; /* largest blocks_used since kv_init */
    int32_t seqs_live;
} kv_stats;

/* Bytes of K and V for one token over all layers:
 * 2 * n_layers * n_kv_heads * head_dim * 2 (f16). */
uint64_t kv_bytes_per_token(int32_t n_layers, int32_t n_kv_heads, int32_t head_dim);
/* A latent cache's: n_layers * dim * 2 (f16), the keys alone. */
uint64_t kv_latent_bytes_per_token(int32_t n_layers, int32_t dim);

/* Bytes kv_init takes for these sizes (pools + block tables + bookkeeping)
 * on a host-memory backend; another also keeps a host copy of the block
 * tables. 0 when the sizes overflow. */
uint64_t kv_bytes(const kv_params *p);

int kv_init(kv_cache **out, const kn_backend *be, const kv_params *p, ae_error *err);

/* The same for tensor-parallel ranks (target/tp.h): the slots' kv heads
 * cut into n_shards shards of shard_kv_heads[s] heads each (in order,
 * adding up to p->n_kv_heads; a latent cache's shards each hold all
 * of them, replicated), each shard in pools of its own
 * (kv_shard_layer) for one rank. Block tables, and so every slot and
 * move, are shared: kv_seq_fork and kv_commit_path move the rows of every
 * shard. The bytes are kv_bytes(p), however the heads are cut (a latent
 * cache's: n_shards copies of its pools). Shard s's
 * pools are made on shard_be[s] (NULL: every shard on be; the block
 * tables and moves are be's, whose ops must reach every shard's memory:
 * backend.h reads). */
#define KV_MAX_SHARDS 64
int kv_init_sharded(kv_cache **out, const kn_backend *be, const kv_params *p, int32_t n_shards,
                    const int32_t *shard_kv_heads, const kn_backend *const *shard_be, ae_error *err);
int32_t kv_n_shards(const kv_cache *kv);
void kv_free(kv_cache *kv); /* NULL is a no-op */

const kv_params *kv_get_params(const kv_cache *kv);
kv_stats kv_get_stats(const kv_cache *kv);

/* A new empty sequence (length 0, no blocks). Fails when max_seqs are live. */
int kv_seq_alloc(kv_cache *kv, int32_t *seq_out, ae_error *err);

/* Ends a sequence; its blocks go back to the free list (a shared block
 * once no other sequence holds it). */
void kv_seq_free(kv_cache *kv, int32_t seq);

/* A new sequence holding what src has committed (OpenAI's n choices of
 * one prompt): its full blocks are shared, counted per block and given
 * back when the last holder lets go; they are never written again, since
 * writes go to slots at or past a sequence's length. The block being
 * filled is copied into a fresh one, by kn_kv_move on s. Fails (nothing
 * changed) when no sequence slot or, for that copy, no block is free. */
int kv_seq_fork(kv_cache *kv, kn_stream *s, int32_t src, int32_t *dst_out, ae_error *err);

/* Grows the sequence's block table so that slots 0 .. n_slots-1 exist.
 * Either every block needed is taken or none is: on failure (pool or
 * block table exhausted) nothing changes and err says the numbers.
 * Never shrinks; n_slots <= capacity is a no-op. */
int kv_seq_reserve(kv_cache *kv, int32_t seq, int32_t n_slots, ae_error *err);

/* Returns blocks beyond those needed for max(n_slots, committed length)
 * to the pool, e.g. the scratch of a tree after its path is committed. */
void kv_seq_trim(kv_cache *kv, int32_t seq, int32_t n_slots);

/* True when seq is a live sequence id (for callers that take ids from
 * outside and must answer with an error, not an assert). */
bool kv_seq_is_live(const kv_cache *kv, int32_t seq);

/* Committed length, and slots held (blocks x block_size). */
int32_t kv_seq_len(const kv_cache *kv, int32_t seq);
int32_t kv_seq_capacity(const kv_cache *kv, int32_t seq);

/* Makes the n slots written after the committed length final (prefill,
 * plain decode): len += n. Needs len + n <= capacity. */
int kv_seq_advance(kv_cache *kv, int32_t seq, int32_t n, ae_error *err);

/* After tree verification: node_slots[0..n-1] are the slots of the accepted
 * nodes, root first, each in [len, capacity) and strictly increasing (a
 * tree is stored parents before children, so a root-to-leaf path is). Their
 * K/V rows, in every layer, move to slots len .. len+n-1 in order and the
 * committed length becomes len + n. Slots after that are free to overwrite.
 * The rows move by kn_kv_move on s, in order. Invalid slots fail with
 * nothing moved. */
int kv_commit_path(kv_cache *kv, kn_stream *s, int32_t seq, const int32_t *node_slots, int32_t n, ae_error *err);

/* The sequence's block table: int32 [kv_seq_n_blocks(seq)] block ids
 * (the row is max_blocks_per_seq long; entries past n_blocks are -1). */
const int32_t *kv_seq_block_table(const kv_cache *kv, int32_t seq);
int32_t kv_seq_n_blocks(const kv_cache *kv, int32_t seq);

/* All block tables: int32 [max_seqs][max_blocks_per_seq], row = seq id,
 * as the cache keeps them (host memory). */
const int32_t *kv_block_tables(const kv_cache *kv);

/* The same tables in the backend's memory, at a fixed address: what a
 * kn_kv_map's block_tables is (n_seqs = max_seqs, table_len =
 * max_blocks_per_seq). kv_upload_tables on the step's stream makes them
 * current before the step's ops: it sends the rows changed since its last
 * call (none on a host-memory backend, whose kernels read the cache's own
 * tables). */
const int32_t *kv_map_tables(const kv_cache *kv);
void kv_upload_tables(kv_cache *kv, kn_stream *s);

/* Per-layer pools: f16 [n_blocks][block_size][n_kv_heads][head_dim].
 * Addresses are fixed for the life of the cache. These and the slot rows
 * below are host pointers, for a host-memory backend and one shard only
 * (tests). */
uint16_t *kv_k_pool(kv_cache *kv, int32_t layer);
uint16_t *kv_v_pool(kv_cache *kv, int32_t layer);

/* Layer `layer` as the attention kernel takes it (kn_kv_write, kn_attention),
 * in the cache's buffer; the map's block_tables are kv_map_tables. One
 * shard only (kv_init); kv_shard_layer: shard `shard`'s, its kv heads. */
kn_kv_pool kv_layer(kv_cache *kv, int32_t layer);
kn_kv_pool kv_shard_layer(kv_cache *kv, int32_t shard, int32_t layer);

/* One slot's row: f16 [n_kv_heads][head_dim]; slot < capacity. */
uint16_t *kv_slot_k(kv_cache *kv, int32_t layer, int32_t seq, int32_t slot);
uint16_t *kv_slot_v(kv_cache *kv, int32_t layer, int32_t seq, int32_t slot);

#endif
