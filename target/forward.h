/* The Llama-family forward pass over a batch of tokens from any number of
 * sequences, written against the op interface (kernels/kernels.h).
 *
 * One call advances every token of the batch through all layers: a token
 * may be part of a prefill chunk, a single decode token, or a node of a
 * verification tree; where it reads and writes the KV cache is given by the
 * kn_kv_map. Every buffer is in the workspace, sized at init for the
 * largest batch, so the forward pass allocates nothing and its buffers keep
 * their addresses from step to step.
 *
 * Tensor parallelism: the allreduce hooks sit after the attention output
 * projection and after the MLP down projection (kn_allreduce_sum, a no-op
 * with one rank): FORWARD_ALLREDUCES_PER_LAYER per layer, each of the
 * pass's tokens x hidden floats. */
#define FORWARD_ALLREDUCES_PER_LAYER 2
#ifndef AERIE_TARGET_FORWARD_H
#define AERIE_TARGET_FORWARD_H

#include <stdint.h>

#include "../kernels/kernels.h"
#include "../services/model/capture.h"
#include "model.h"

#define FORWARD_MAX_CAPTURE CAPTURE_LAYERS

/* EAGLE-3 feature capture: the residual stream entering chosen layers, for
 * chosen tokens of the batch, concatenated per token. */
typedef struct forward_capture {
    int32_t n_layers;                    /* 0..FORWARD_MAX_CAPTURE */
    int32_t layers[FORWARD_MAX_CAPTURE]; /* input of layer i (0 = the embeddings) */
    int32_t n_rows;
    const int32_t *rows; /* [n_rows] batch rows to capture */
    float *out;          /* [n_rows][n_layers * H] */
} forward_capture;

/* Every array is the stream's backend's memory (the engine's input and
 * output buffers; on a host-memory backend, any host array). */
typedef struct forward_batch {
    int32_t m;             /* tokens in the batch */
    const int32_t *tokens; /* [m] */
    const int32_t *pos;    /* [m] positions, for RoPE */
    const kn_kv_map *map;  /* where each token reads and writes KV */
    int32_t n_logits;
    const int32_t *logit_rows;      /* [n_logits] rows whose logits are wanted */
    float *logits;                  /* [n_logits][V] */
    const forward_capture *capture; /* NULL: capture nothing */
} forward_batch;

typedef struct forward_ws forward_ws;

/* Workspace for batches of up to max_tokens tokens and max_logits logit
 * rows, in a buffer of the model's backend. */
int forward_ws_init(forward_ws **out, const model *m, int32_t max_tokens, int32_t max_logits, ae_error *err);
void forward_ws_free(forward_ws *ws); /* NULL is a no-op */
/* The [max_tokens][hidden] buffer the allreduces add (the row-parallel
 * projections' output), in the model's backend's memory: a message to
 * time them with between passes. */
float *forward_ws_proj(forward_ws *ws);
size_t forward_ws_bytes(const model *m, int32_t max_tokens, int32_t max_logits);
/* Bytes the stream needs for kn_matmul at this batch size and for
 * attention over up to max_keys keys (0: attention goes without). */
size_t forward_stream_workspace(const model *m, int32_t max_tokens, int32_t max_keys);
size_t forward_stream_workspace_cfg(const model_config *c, int32_t max_tokens, int32_t max_keys);

/* Launches one forward pass queues on the CUDA backend, at most (a graph's
 * nodes, for the memory plan). Per layer: the 7 matmuls (q, k, v, o,
 * gate, up, down) and 4 quantizations of x (one for q, k and v, one for
 * gate and up), 2 norms, 3 biases, 2 ropes, the KV write, attention and
 * its merge, 2 adds and the SwiGLU: 24. Then the embedding, rope's
 * table, the logit rows' gather, the final norm, the output matmul (2)
 * and an argmax (2), and a capture's gathers. In fast mode
 * (kn_stream_set_fast) each float matmul may be 3: x rounded for cuBLAS,
 * whose GEMM may be two kernels (34 a layer, and one more at the head). */
#define FORWARD_GRAPH_NODES(n_layers, fast) \
    ((uint64_t)(n_layers) * ((fast) ? 34u : 24u) + ((fast) ? 9u : 8u) + FORWARD_MAX_CAPTURE)

/* Runs the batch. kv[l] is layer l's KV pool. Shapes and ids are the
 * engine's to check (asserted here). */
void forward_pass(const model *m, kn_stream *s, kn_comm *comm, const kn_kv_pool *kv, forward_ws *ws,
                  const forward_batch *b);

#endif
