/* The batched engine: advances many sequences in one forward pass.
 *
 * Each item of a step is one sequence's contribution:
 *   - ENGINE_APPEND: tokens appended after the sequence's committed length,
 *     causally (a prefill chunk, or one decode token). They are committed
 *     by the step.
 *   - ENGINE_TREE: a verification tree. Node i has parent parents[i] < i
 *     (-1: a child of the last committed token), sits at position
 *     len + depth(i), and sees the committed prefix, its ancestors and
 *     itself. Nothing is committed: engine_commit_path keeps the accepted
 *     path afterwards.
 * Logits come back for the last token of an APPEND item (or for every
 * token with all_logits) and for every node of a tree, in item order.
 *
 * This is the call the scheduler and speculative decoding build on. All
 * buffers are sized at engine_init; a step allocates nothing. A step's
 * inputs are uploaded to fixed places in a buffer of the backend, so the
 * forward pass reads the same addresses every step. */
#ifndef AERIE_TARGET_ENGINE_H
#define AERIE_TARGET_ENGINE_H

#include <stdbool.h>
#include <stdint.h>

#include "../services/core/err.h"
#include "../services/core/pool.h"
#include "../services/kv/kv.h"
#include "forward.h"
#include "model.h"

#define ENGINE_MAX_TREE 64 /* nodes in one tree (also its deepest path) */

typedef struct engine_config {
    int32_t max_batch_tokens; /* tokens in one forward pass */
    int32_t max_seqs;         /* sequences live at once */
    int32_t max_seq_len;      /* slots one sequence may use, tree scratch included */
    int32_t kv_tokens;        /* KV cache size in tokens, shared by all sequences */
    int32_t block_size;       /* KV block size in tokens */
    int32_t threads;
    /* Activation precision of the quantized matmuls, 15 or 8 (0: the
     * kernels' default, 15); every pass of the engine uses it (kernels.h,
     * "Batch invariance"). */
    int32_t act_bits;
} engine_config;

typedef enum engine_kind { ENGINE_APPEND = 0, ENGINE_TREE = 1 } engine_kind;

typedef struct engine_item {
    int32_t seq;
    engine_kind kind;
    int32_t n_tokens;
    const int32_t *tokens;  /* [n_tokens] */
    const int32_t *parents; /* [n_tokens], ENGINE_TREE only */
    bool all_logits;        /* ENGINE_APPEND: logits for every token, not just the last */
} engine_item;

typedef struct engine engine;

/* m must outlive the engine, which runs on m's backend (m->be): its
 * stream, workspace, KV cache and step inputs are that backend's. */
int engine_init(engine **out, const model *m, const engine_config *cfg, ae_error *err);

/* Bytes of a step's inputs at this many tokens: the host arrays the
 * engine fills and the backend buffer they are uploaded to (memory plan). */
size_t engine_input_bytes(int32_t max_batch_tokens);
void engine_free(engine *e); /* NULL is a no-op */

int engine_seq_new(engine *e, int32_t *seq, ae_error *err);
/* A new sequence with src's committed tokens, their KV shared
 * (kv_seq_fork): one prefill for all of a request's choices. */
int engine_seq_fork(engine *e, int32_t src, int32_t *seq, ae_error *err);
void engine_seq_free(engine *e, int32_t seq);
int32_t engine_seq_len(const engine *e, int32_t seq);

/* Logit rows a step will return for these items. */
int32_t engine_logit_rows(const engine_item *items, int32_t n_items);

/* What one step gives back, and how (engine_step). The caller's arrays;
 * the struct itself is read during the call only, so a compound literal
 * at the call does: engine_step(e, items, n, &(engine_outputs){.logits =
 * lg}, err).
 *
 *   - logits alone: the logit rows, [engine_logit_rows][vocab].
 *   - ids too, without draws: ids[engine_logit_rows] is kn_argmax of each
 *     row, which picks as sample_greedy does (greedy verification). The
 *     argmax runs where the pass ran, so on a device only the ids come
 *     back, not [rows][vocab] floats. logits is then scratch of the same
 *     size: a host-memory backend writes the rows there, any other leaves
 *     it alone.
 *   - ids and draws: each row's token is drawn where the pass ran
 *     (kernels.h kn_sample), ids[engine_logit_rows] by
 *     draws[engine_logit_rows] (host memory; a row of temperature 0 takes
 *     the argmax), logits scratch as above. Only on a backend that draws
 *     (engine_can_sample: a device's); elsewhere the step fails and the
 *     caller samples the logits. Draws need ids.
 *
 * capture: optional EAGLE-3 feature capture, rows indexing the step's
 * tokens in item order. */
typedef struct engine_outputs {
    float *logits;
    int32_t *ids;
    const kn_draw *draws;
    const forward_capture *capture;
} engine_outputs;

/* One forward pass. Bad items (unknown sequence, too many tokens, a parent
 * out of order, no KV room) or outputs fail with err and change nothing. */
int engine_step(engine *e, const engine_item *items, int32_t n_items, const engine_outputs *out, ae_error *err);
bool engine_can_sample(const engine *e);
int64_t engine_drawn_steps(const engine *e); /* steps engine_step ran with draws */

/* After a tree step: keeps nodes path[0..n) (node indices of that tree,
 * root-level first, each the parent of the next) as committed tokens. The
 * path is checked against the sequence's last tree; anything else (no
 * tree since the last APPEND, a skipped level, an unknown node) fails with
 * err and changes nothing. */
int engine_commit_path(engine *e, int32_t seq, const int32_t *path, int32_t n, ae_error *err);

/* CUDA graphs. A decode or verify step (items of one token, or trees; at
 * most ENGINE_GRAPH_MAX_TOKENS tokens in all) on a backend with graphs (kernels.h kn_graph) is captured the
 * first time its shape is seen and replayed after that. The shape is
 * what the forward pass's launches are sized by on the host: the tokens,
 * the logit and capture rows, the capture layers, whether the argmax
 * runs, and the keys a token may see, rounded up to a power of two (at
 * least ENGINE_GRAPH_MIN_KEYS, at most a sequence's capacity): the attention
 * kernels skip key chunks past a token's own count, so one graph serves
 * every step up to its bound with the same bits. Everything else a step
 * changes (token ids, positions, block tables, a tree's shape) is read
 * from device memory. Prompt chunks run op by op: they come in every
 * size, and would push out the shapes that repeat.
 *
 * At most max_graphs are kept (the memory plan's count); a new shape
 * past that replaces the one used least recently. budget (the plan's
 * bytes for them, plus KN_GRAPH_BYTES_GRAIN of measuring; 0: none)
 * holds what they take as measured
 * (kn_graph_bytes): past it the least recently used go, and fewer are
 * kept from then on, with a warning, so that an estimate that fell short
 * costs graphs, not the memory the plan gave the KV cache. max_graphs 0
 * (the default) turns graphs off; on a backend without them this does
 * nothing. A graph the
 * device cannot make or hold (its capture, instantiation or upload fails:
 * out of memory, say) turns graphs off for the engine, with a warning,
 * and the step runs op by op. */
#define ENGINE_GRAPH_MAX_TOKENS ENGINE_MAX_TREE
#define ENGINE_GRAPH_MIN_KEYS 256
void engine_set_graphs(engine *e, int32_t max_graphs, uint64_t budget);

/* The engine's stream in fast mode, or deterministic (the default):
 * kernels.h kn_stream_set_fast. Before the first step. */
int engine_set_fast(engine *e, bool fast, ae_error *err);
bool engine_fast(const engine *e); /* false on a backend with only the deterministic mode */

typedef struct engine_graph_stats {
    int32_t max_graphs; /* 0: off */
    int32_t kept_max;   /* held at most now: max_graphs, or fewer once the budget bit */
    int32_t live;       /* graphs held now */
    uint64_t budget;    /* bytes they may take (0: no bound) */
    int64_t captures, replays, evictions;
    int64_t eager_steps; /* steps run op by op (prefill, or graphs off) */
    uint64_t bytes;      /* device memory the live graphs took (kn_graph_bytes) */
    uint64_t max_nodes;  /* the most ops one graph held */
} engine_graph_stats;
engine_graph_stats engine_get_graph_stats(const engine *e);

/* Tensor parallelism (target/tp.h): n_ranks ranks run every forward pass
 * over their shards of the model, rank 0 on the calling thread and each
 * other on a thread of its own, each with a pool of its share of the
 * engine's threads (at least one; the engine's own pool stays, for what
 * runs between passes). Each rank reads and writes its own kv heads of
 * the KV cache, whose block tables, forks and commits serve all ranks at
 * once (kv_init_sharded). The cache is made anew, so this comes before
 * any sequence; 1 is one rank again. While ranks run, the engine's own
 * activations for one rank are freed. If the ranks cannot be made, the
 * engine is left at one rank and this fails. Ranks add partial sums, so
 * TP N is not bitwise TP 1 (kernels.h); at any one N every pass is batch
 * invariant as before.
 *
 * `allreduce` is how they add (kernels.h kn_allreduce). On a host-memory
 * backend only CPU; on CUDA (ranks on one GPU or a GPU each: rank_be
 * below) NCCL or custom, with CUDA graphs off while ranks run. AUTO takes CPU on a
 * host-memory backend; on CUDA it times both kinds (ENGINE_ALLREDUCE_REPS
 * calls of a decode pass's message, 1 token x hidden floats, and of a
 * verify pass's, 8 tokens) and takes the one with the smaller sum,
 * custom alone where NCCL cannot be had: engine_allreduce_why says what was
 * measured.
 *
 * rank_be[r] is rank r's backend (NULL: all on the model's): on CUDA, one
 * device's table each (kn_device_open of cuda:N), so that a GPU holds a
 * rank's shard of the weights (copied there) and its kv heads of the KV
 * cache. Ranks on other devices than the model's read the step's inputs,
 * the block tables and the norms from the model's device, and the
 * engine's stream moves their KV rows, so every device must reach the
 * model's and the model's every one (peer access; kn_backend_reads). */
#define ENGINE_ALLREDUCE_REPS 50
int engine_set_tp(engine *e, int32_t n_ranks, kn_allreduce allreduce, const kn_backend *const *rank_be, ae_error *err);
/* Rank r's backend (the model's at one rank), and the bytes of weights
 * copied to it (tp_group_copied_bytes; 0 for views). */
const kn_backend *engine_tp_backend(const engine *e, int32_t r);
uint64_t engine_tp_copied_bytes(const engine *e, int32_t r);
int32_t engine_tp(const engine *e); /* 1 without ranks */
/* The kind the ranks use (KN_ALLREDUCE_CPU at one rank), and for AUTO the
 * measurement it was chosen by ("" otherwise). */
kn_allreduce engine_allreduce(const engine *e);
const char *engine_allreduce_why(const engine *e);
/* Rank r's shard of the model (tp_group_shard); the model itself at one rank. */
const model *engine_tp_shard(const engine *e, int32_t r);

/* The allreduces of the last step, and of every step since the ranks
 * were set: rank 0's calls, bytes and time (kn_comm_get_stats); zeros at
 * one rank. */
typedef struct engine_comm_stats {
    kn_comm_stats last, total;
    int32_t last_tokens; /* tokens of the last step */
    int64_t steps;
} engine_comm_stats;
engine_comm_stats engine_get_comm_stats(const engine *e);

const model *engine_model(const engine *e);
/* KV blocks in use, free and live sequences (kv.h). */
kv_stats engine_kv_stats(const engine *e);
const engine_config *engine_get_config(const engine *e);
/* The engine's thread pool, for a drafter in the same process to share. */
pool *engine_pool(engine *e);

#endif
