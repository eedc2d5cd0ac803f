/* An EAGLE-3 draft head: its loader and its forward pass.
 *
 * The published layout (REFERENCES.md, EAGLE-3): a directory with
 * config.json (llama-like keys plus draft_vocab_size and optionally
 * eagle_config.eagle_aux_hidden_state_layer_ids) and safetensors holding
 *   fc.weight                                   [H][3H]
 *   midlayer.self_attn.{q,k,v}_proj.weight      [heads*D or kv_heads*D][2H]
 *   midlayer.self_attn.o_proj.weight            [H][heads*D]
 *   midlayer.mlp.{gate,up}_proj.weight          [F][H]
 *   midlayer.mlp.down_proj.weight               [H][F]
 *   midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H]
 *   norm.weight                                 [H]
 *   lm_head.weight                              [draft_vocab][H]
 *   d2t (int)                                   [draft_vocab]
 *   t2d (bool, optional)                        [target vocab]
 * H is the target's hidden size: the head reads the target's features and
 * its embedding table. Matrices keep their file type (F16 and BF16 are
 * kn_matmul types); norm vectors are converted to f32.
 *
 * One forward step over m tokens (kernels/kernels.h ops; KV in a one-layer
 * paged pool):
 *   h  = fc(in) when the input is a captured feature (3H wide), else the
 *        fed-back hidden state as it is (H wide)
 *   x  = [input_layernorm(embed(token)), hidden_norm(h)]     2H wide
 *   h1 = h + o_proj(attention(q(x), k(x), v(x)))             RoPE on q, k
 *   h2 = h1 + down(swiglu(gate(n), up(n))), n = post_attention_layernorm(h1)
 *   hidden = h2 (pre-norm: what the next draft step takes as h)
 *   logits = lm_head(norm(h2)) over the draft vocabulary; draft id i is
 *            target id i + d2t[i].
 * Positions: the pair (feature of position j, token j + 1) sits at
 * position j, as the head was trained.
 *
 * Captured layers: eagle_aux_hidden_state_layer_ids (at the top level of
 * config.json or in eagle_config) names target layers by their input:
 * id i is the residual stream entering layer i (0: the embeddings, N: the
 * last layer's output before the final norm), as vLLM reads it. SGLang
 * reads an id as the output of layer i (one more). Without ids the
 * target's default is used: 2, N/2 and N-3, which all engines share.
 *
 * Refused rather than run wrong: attention_bias and norm_before_residual
 * heads, which this forward pass does not compute. */
#ifndef AERIE_DRAFT_EAGLE_H
#define AERIE_DRAFT_EAGLE_H

#include <stdint.h>

#include "../kernels/kernels.h"
#include "../services/core/err.h"
#include "../services/model/capture.h"
#include "../services/model/embedding.h"

#define EAGLE_N_AUX CAPTURE_LAYERS /* captured target layers */

/* What the head needs of its target. */
typedef embedding_view eagle_target;

/* How the head's matrices are held. The draft only changes speed, never
 * output, so it may trade exactness for bytes: a draft pass reads every
 * matrix of the head, and Q8_0 reads about half the bytes of F16 through
 * the integer kernel. */
typedef enum eagle_weights {
    EAGLE_WEIGHTS_FILE = 0, /* as the file has them (F16, BF16, F32): exact */
    EAGLE_WEIGHTS_Q8_0 = 1, /* rounded to Q8_0 at load (matrices whose width is a multiple of 32) */
} eagle_weights;

typedef struct eagle_config {
    int32_t hidden; /* H */
    int32_t n_heads;
    int32_t n_kv_heads;
    int32_t head_dim; /* D */
    int32_t ffn;      /* F */
    int32_t draft_vocab;
    float rms_eps;
    kn_rope_config rope;
    /* eagle_aux_hidden_state_layer_ids; 0 = the target's default layers */
    int32_t n_aux_layers;
    int32_t aux_layers[EAGLE_N_AUX];
} eagle_config;

typedef struct eagle_head {
    eagle_config cfg;
    eagle_target target;
    kn_weight fc;            /* [H][3H] */
    const float *input_norm; /* [H] */
    const float *hidden_norm;
    const float *post_norm;
    const float *out_norm;
    kn_weight wq, wk, wv;     /* [heads*D][2H], [kv_heads*D][2H] x2 */
    kn_weight wo;             /* [H][heads*D] */
    kn_weight gate, up;       /* [F][H] */
    kn_weight down;           /* [H][F] */
    kn_weight lm_head;        /* [draft_vocab][H] */
    int32_t *draft_to_target; /* [draft_vocab] target id of each draft id */
    kn_rope rope;
    eagle_weights weights;
    size_t weight_bytes; /* bytes of the matrices and vectors as held */
    char dir[1024];
    /* Where it runs: the backend of the target's embedding table, which
     * the head reads. On one whose memory is not the host's (CUDA), the
     * matrices and vectors are copied into bufs and the host copies
     * freed. */
    const kn_backend *be;
    kn_buf *bufs;
    int32_t n_bufs;
    float **owned; /* converted buffers (host) */
    int32_t n_owned;
} eagle_head;

/* Parses "file" or "q8_0". */
int eagle_weights_parse(const char *text, eagle_weights *out, ae_error *err);

/* dir: a head directory. A tensor whose shape does not fit the target is
 * refused with one line naming it and both shapes. The head is placed on
 * the backend of t->embed (h->be); everything that runs it (eagle_ws,
 * its KV, the drafter) takes that backend's memory. */
int eagle_load(eagle_head **out, const char *dir, const eagle_target *t, eagle_weights weights, ae_error *err);
void eagle_free(eagle_head *h); /* NULL is a no-op */

/* The head directory c's "draft" names, or NULL for none (unset or
 * "none"). */
struct config; /* services/core/config.h */
const char *eagle_dir(const struct config *c);

/* Replaces c's draft "auto" with the head trained for c's "model": a
 * directory beside the model file whose training.json (written by
 * tools/train_eagle3.py) has "target_model" equal to the model's file
 * name. None found: "none". */
void eagle_resolve_dir(struct config *c);

typedef struct eagle_batch {
    int32_t m;
    const int32_t *tokens; /* [m] target ids */
    const float *in;       /* [m][in_width] features (3H) or fed-back hidden states (H) */
    int32_t in_width;
    const int32_t *pos;   /* [m] */
    const kn_kv_map *map; /* where each token reads and writes the head's KV */
    float *hidden;        /* [m][H] pre-norm outputs */
    int32_t n_logits;
    const int32_t *logit_rows; /* [n_logits] */
    float *logits;             /* [n_logits][draft_vocab] */
} eagle_batch;

typedef struct eagle_ws eagle_ws;

int eagle_ws_init(eagle_ws **out, const eagle_head *h, int32_t max_tokens, ae_error *err);
void eagle_ws_free(eagle_ws *ws); /* NULL is a no-op */
size_t eagle_ws_bytes(const eagle_head *h, int32_t max_tokens);
/* Stream scratch for batches of max_tokens over up to max_keys keys. */
size_t eagle_stream_workspace(const eagle_head *h, int32_t max_tokens, int32_t max_keys);

/* Every array of b is in the memory of h->be, like ws and kv, and is not
 * read on the host unless that memory is the host's: its contents (ids,
 * positions, rows in range) are the caller's to check; sizes are asserted
 * here, and logit rows too on a host-memory backend. */
void eagle_forward(const eagle_head *h, kn_stream *s, const kn_kv_pool *kv, eagle_ws *ws, const eagle_batch *b);

#endif
