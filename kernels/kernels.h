/* The op interface: every computation of a forward pass goes through here.
 *
 * Buffers and streams
 *   Every tensor argument is a device buffer (on the CPU backend: host
 *   memory) owned by the caller, sized and placed at start. Ops write into
 *   the buffers they are given and never allocate, so buffer addresses stay
 *   fixed from step to step (a CUDA graph can capture a whole step). Ops run
 *   on a kn_stream: on the CPU backend a stream wraps the thread pool and an
 *   op has finished when it returns; on CUDA an op is queued on the stream's
 *   cudaStream_t and kn_stream_sync waits for it. Activations are f32 and
 *   row-major; "[m][n]" below means m rows of n contiguous floats.
 *
 * Errors
 *   Ops check their arguments with AE_ASSERT: a bad shape, an id out of
 *   range or a workspace too small is a broken invariant of the engine (it
 *   validates everything from the network and sizes every buffer at start),
 *   never a runtime condition. Constructors return AE_OK / AE_ERR.
 *
 * Batch invariance (ARCHITECTURE.md, Invariants)
 *   Each output element of every op is a function of its own inputs only,
 *   computed by a reduction whose order is fixed by the shapes of the
 *   weights and the op's own row: never by m, by the tile or thread a row
 *   lands in, by the number of threads, by the row's place in the batch, or
 *   by the CPU's SIMD level. So a token's results are bit-identical whether
 *   it runs alone, in a prefill chunk, in a batch with other sequences, or
 *   as a node of a verification tree. The orders:
 *   - kn_matmul, float W (F32, F16, BF16): y = x . W^T in f32, each
 *     weight widened exactly. 8 lanes: lane l takes elements i = 8j + l
 *     in increasing j, acc = fma(x, w, acc); the lane tree tree(acc) =
 *     ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7)); then the k % 8 tail
 *     elements, s = fma(x, w, s) one by one.
 *   - kn_matmul, quantized W in integers, at the stream's activation
 *     precision P (kn_stream_set_act_bits: 15 or 8 bits; L = 16256 =
 *     127 * 128 at 15, L = 127 at 8): each block of 32 elements of a row
 *     of x is rounded to integers xi = round_even(x * (L / amax)), the
 *     quotient L / amax rounded to f32 first, with amax the block's
 *     largest |x|; xi is clamped to [-L, L] and the scale is sx = amax / L.
 *     All xi = 0 and sx = 0 when amax < 2^-100, where L / amax could
 *     overflow; a block with an inf or NaN gets all xi = 0 and sx = NaN.
 *     S = sum xi over the block, S0 and S1 over its halves of 16.
 *     A weight row is read as integers v (its quants less the type's
 *     offset) with integer sub-block scales sc and mins mn, per
 *     activation block b of the row:
 *       isum = sum over the two halves h of sc_h * (sum v * xi)
 *       acc  = fma((float)isum, d * sx, acc)
 *     then, for the types with a min, in that order:
 *       K-quants: imin = mn_0 * S0 + mn_1 * S1,
 *                 acc = fma(-(float)imin, dmin * sx, acc)
 *       Q4_1, Q5_1: acc = fma(m, sx * (float)S, acc)
 *     over the blocks in order, from acc = 0. d, dmin and m are the
 *     block's f16 fields widened exactly (MXFP4: its E8M0 exponent e as
 *     2^(e - 128), exact), and d * sx, dmin * sx are each one f32
 *     product. Per type (v; sc_h; mn_h; the largest |isum| at 15 bits):
 *       Q8_0    int8 q; 1; -; 127 * 16256 * 32 = 6.6e7
 *       Q4_0    nibble - 8; 1; -; 8 * 16256 * 32 = 4.2e6
 *       Q4_1    nibble; 1; m; 15 * 16256 * 32 = 7.8e6
 *       Q5_0    5-bit q - 16; 1; -; 8.3e6
 *       Q5_1    5-bit q; 1; m; 1.6e7
 *       IQ4_NL  the 16-entry table (-127..113) at the nibble; 1; -; 6.6e7
 *       MXFP4   E2M1 doubled (-12..12) at the nibble; 1; -; 6.2e6
 *       Q2_K    2-bit q; 4-bit sc per 16; 4-bit mn per 16; 2 * 15 * 3 *
 *               16256 * 16 = 2.3e7
 *       Q3_K    3-bit q - 4; 6-bit sc - 32 per 16; -; 2 * 32 * 4 * 16256
 *               * 16 = 6.7e7
 *       Q4_K    nibble; 6-bit sc per 32 (both halves); 6-bit mn per 32;
 *               63 * 15 * 16256 * 32 = 4.9e8 (imin 63 * 520192 = 3.3e7)
 *       Q5_K    5-bit q; as Q4_K; 63 * 31 * 16256 * 32 = 1.02e9
 *       Q6_K    6-bit q - 32; int8 sc per 16; -; 2 * 128 * 32 * 16256 *
 *               16 = 2.13e9, 0.8% under INT32_MAX
 *       IQ4_XS  the IQ4_NL table; 6-bit sc - 32 per 32; -; 32 * 127 *
 *               16256 * 32 = 2.11e9
 *     A 256-element super-block (the K-quants, IQ4_XS) spans 8
 *     activation blocks; its sub-blocks of 16 are two to a block.
 *     Every sum is exact in int32 (the bounds above), so integer sums
 *     have no order: the packed AVX-512 VNNI and AVX2 kernels and the
 *     portable one give the same bits at either P.
 *     At 15 bits xi keeps about 15 bits of x: the logits stay within 5e-4
 *     of an f32 product on the dequantized weights (the golden test); x
 *     takes two byte planes, so a block costs two integer dot products
 *     per weight byte. At 8 bits (llama.cpp's Q8_0 activations) it takes
 *     one, half the work of a pass of several tokens, for more error
 *     (docs/accuracy.md).
 *     One run uses one precision: every pass of the engine, the draft
 *     head and every tensor-parallel rank's stream is set to the same P
 *     before the first op and never changed while sequences live, because
 *     a token's bits are invariant only among passes of the same P.
 *   - kn_attention: for each (token, head) the visible keys are visited in
 *     position order (prefix slots 0..n_prefix-1, then the extra slots) and
 *     cut into chunks of KN_ATTN_CHUNK by their index in that visible list.
 *     K and V are the pool's f16 values widened exactly to f32. Scores
 *     are 8-lane dot products (lane l sums elements 8j + l, mul then
 *     add, then the lane tree) times 1/sqrt(head_dim). A chunk gives
 *     (mc = its largest score, l = sum e^(s - mc), o = sum e^(s - mc) v) in
 *     key order; chunks merge in order: M' = max(M, mc), a = e^(M - M'),
 *     b = e^(mc - M'), L = L a + l b, O = O a + o b; out = O / L. e^x is a
 *     fixed polynomial (kn_attention.c), not libm's. head_dim is a
 *     multiple of 8. A tree node whose ancestors sit in scratch slots and
 *     the same token decoded after the ancestors were committed see the
 *     same keys in the same order and get identical bits, and so does a
 *     token whether its chunks were shared with other tokens or not.
 *   - kn_rmsnorm: the sum of squares in double over 8 lanes (lane l takes
 *     elements 8j + l in order), the lane tree, then the tail in order.
 *   - kn_softmax: sums in double, in element order.
 *   The SIMD paths (AVX2, AVX-512 VNNI) and the portable path give the
 *   same bits; the test suite pins it (kn_cpu_limit_simd).
 *
 * Tensor parallelism
 *   With R ranks, each rank holds a shard of each projection and runs the
 *   same ops on its own stream:
 *   - column-parallel (q, k, v, gate, up): W's output rows are split; rank r
 *     owns rows [r*n/R, (r+1)*n/R) (whole heads for q/k/v) and produces that
 *     slice of y. No communication: attention and SwiGLU work per head /
 *     per element on the local slice.
 *   - row-parallel (o_proj, down): W's input columns are split to match the
 *     local slice of x; rank r computes a partial y[m][n] over its columns,
 *     then kn_allreduce_sum adds the partials of all ranks. A column shard
 *     of a quantized row is a run of whole blocks, so a shard is a
 *     kn_weight with data offset to its first block and row_bytes kept as
 *     the full row's stride: no copy.
 *   kn_allreduce_sum is a no-op with one rank (or a NULL comm), and
 *   kn_allreduce_add a plain kn_add. */
#ifndef AERIE_KERNELS_H
#define AERIE_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../services/core/err.h"
#include "../services/model/quant.h"

/* ---- streams ------------------------------------------------------------ */

/* Ops run on a stream of a backend (backend.h: what a backend fills in).
 * kn_backend_cpu is the reference backend, always there. */
typedef struct kn_backend kn_backend;
typedef struct kn_stream kn_stream;
struct pool; /* services/core/pool.h */

extern const kn_backend kn_backend_cpu;

/* What a backend is asked about (kn_backend_supports): a matmul's weight
 * type, an embedding table's type, a KV pool's element type, or the f32
 * of every other op. MLA's latent attention (a pool whose values are its
 * keys, kn_matmul_heads; its type is the pool's) and a mixture of experts
 * (kn_moe_route, kn_moe_ffn; its type is the experts') are asked apart:
 * a backend may run the rest of a forward pass without them. */
typedef enum kn_op { KN_OP_MATMUL, KN_OP_EMBED, KN_OP_KV, KN_OP_F32, KN_OP_LATENT, KN_OP_MOE } kn_op;
bool kn_backend_supports(const kn_backend *be, kn_op op, ggml_type type);
const char *kn_backend_name(const kn_backend *be); /* "cpu" */

typedef struct kn_stream_config {
    /* CPU: the threads ops run on (not owned; several streams may share
     * one pool, and then take turns). */
    struct pool *pool;
    /* Scratch the stream keeps for ops that need it: size it with
     * kn_matmul_workspace and kn_attention_workspace for the largest
     * shapes the caller will pass (0 is valid: no scratch). */
    size_t workspace_bytes;
} kn_stream_config;

int kn_stream_init(kn_stream **out, const kn_backend *be, const kn_stream_config *cfg, ae_error *err);
void kn_stream_free(kn_stream *s); /* NULL is a no-op */
const kn_backend *kn_stream_backend(const kn_stream *s);

/* The precision quantized matmuls round x to (kernels.h "Batch
 * invariance"): 15 (two byte planes, a stream's default: what the op
 * tests check against float64) or 8 (one). The programs set it from
 * their act-bits setting, whose default is 8 (services/core/svc.h). Set
 * it before the stream's first op; any other value is a broken
 * invariant. */
#define KN_ACT_BITS_DEFAULT 15
void kn_stream_set_act_bits(kn_stream *s, int bits);
int kn_stream_act_bits(const kn_stream *s);
/* Deterministic (the default) or fast. Every backend's ops are
 * deterministic and batch invariant by default ("Batch invariance"). A
 * fast stream may run float-weight matmuls (F32, F16, BF16) through the
 * vendor's BLAS (cuBLAS on CUDA, opened when this is first asked for,
 * with KN_FAST_WORKSPACE_BYTES of device memory of its own), x rounded to
 * the weight's type: its kernel and its order of additions change with
 * m, so a row's bits depend on the batch, and greedy speculative output
 * may differ from plain decoding at near-ties. Quantized matmuls and the
 * other ops keep their bits. The CPU backend has only the one mode: fast
 * changes nothing there. Set before the stream's first op; fails with err
 * where the backend cannot (no cuBLAS found). */
#define KN_FAST_WORKSPACE_BYTES (32u << 20)
int kn_stream_set_fast(kn_stream *s, bool fast, ae_error *err);
bool kn_stream_fast(const kn_stream *s);
void kn_stream_sync(kn_stream *s); /* waits for every op queued (CPU: none is) */
int kn_stream_threads(const kn_stream *s);

/* A point in a stream's work: kn_event_wait makes another stream's later
 * ops wait for what s had queued at kn_event_record (CPU: nothing to
 * wait for). */
typedef struct kn_event {
    void *impl;           /* the backend's */
    const kn_backend *be; /* whose impl it is (set by kn_event_record) */
} kn_event;
void kn_event_record(kn_stream *s, kn_event *e);
void kn_event_wait(kn_stream *s, const kn_event *e);
/* Frees what recording e made (a CUDA event); a zeroed or never recorded
 * one is a no-op. e may be recorded again after. */
void kn_event_free(kn_event *e);

/* A graph: the ops one stream queued between kn_graph_begin and
 * kn_graph_end, recorded instead of run, then replayed by kn_graph_launch
 * as one launch (a CUDA graph). A replay runs the same ops with the same
 * arguments: the same buffers and every scalar as it was at capture; only
 * the buffers' contents may differ. So everything a captured op reads
 * that changes from one replay to the next must be in device memory, and
 * between begin and end the caller queues ops only: no upload, download
 * or sync on that stream (a backend refuses them, and kn_graph_end then
 * fails). A backend without graphs (the CPU's) says so here, and its
 * callers run the ops themselves. */
typedef struct kn_graph kn_graph;
bool kn_backend_has_graphs(const kn_backend *be);
int kn_graph_begin(kn_stream *s, ae_error *err);
/* Ends the capture and readies the graph for replay on s. */
int kn_graph_end(kn_stream *s, kn_graph **out, ae_error *err);
void kn_graph_launch(kn_stream *s, kn_graph *g); /* in s's order */
void kn_graph_free(kn_graph *g);                 /* NULL is a no-op */
size_t kn_graph_nodes(const kn_graph *g);        /* ops in it */
/* Device memory the graph took, as the device's free memory fell from
 * before the capture to after the graph was ready (0 if it rose: another
 * user freed some meanwhile). */
size_t kn_graph_bytes(const kn_graph *g);
/* What one captured launch is estimated to take of device memory, for
 * memory plans made before any capture (a kernel's parameters and the
 * graph's bookkeeping). Not yet measured on a GPU: each capture logs
 * kn_graph_bytes beside it. */
#define KN_GRAPH_NODE_BYTES 4096
/* The step in which a GPU's free memory, and so kn_graph_bytes, moves
 * (and a first capture may also load kernels): what a budget checked
 * against kn_graph_bytes allows beyond its estimate. */
#define KN_GRAPH_BYTES_GRAIN (2u << 20)

/* Memory of a backend (CPU: host memory, 64-byte aligned, on huge pages
 * when large). Copies in and out are ops of a stream, in its order. */
typedef struct kn_buf {
    const kn_backend *be;
    void *ptr; /* the backend's address: pass it to that backend's ops */
    size_t bytes;
    bool borrowed; /* host memory the caller owns (kn_buf_from_host) */
} kn_buf;
/* bytes of zeros. */
int kn_buf_alloc(const kn_backend *be, kn_buf *b, size_t bytes, ae_error *err);
void kn_buf_free(kn_buf *b); /* a zeroed one is a no-op */
/* A buffer holding the host bytes [host, host + bytes), which must outlive
 * it: on a host-memory backend those bytes themselves (borrowed, no
 * copy: a mapped model file stays mapped), on any other a new buffer
 * they are copied into, before this returns. For loading, not steps. */
int kn_buf_from_host(const kn_backend *be, kn_buf *b, const void *host, size_t bytes, ae_error *err);
/* True when the backend's memory is the host's (backend.h). */
bool kn_backend_host_memory(const kn_backend *be);
/* Whether self's ops may take buffers of other: the same backend, or
 * another device's table that self reaches by peer access (backend.h). */
bool kn_backend_reads(const kn_backend *self, const kn_backend *other);
void kn_upload(kn_stream *s, const kn_buf *dst, size_t off, const void *src, size_t n);
void kn_download(kn_stream *s, void *dst, const kn_buf *src, size_t off, size_t n);

/* ---- weights ------------------------------------------------------------ */

/* A weight matrix W[rows][cols] as stored in the model file (plain data).
 * Row i starts at data + i * row_bytes; row_bytes is at least
 * quant_row_bytes(type, cols) and larger for a column shard (see above).
 * For quantized types cols is a multiple of the type's block (32, or 256
 * for the K-quants and IQ4_XS). Matmul supports F32, F16, BF16 and the
 * types of the contract above (kn_matmul_supports); kn_embed any type
 * quant_dequantize knows. */
typedef struct kn_weight {
    ggml_type type;
    int64_t rows; /* n: output features */
    int64_t cols; /* k: input features */
    const void *data;
    size_t row_bytes;
    /* The buffers data and packed lie in, of the backend that runs the
     * ops (checked); NULL: host memory, which only a host-memory backend
     * takes (a tool's or a test's own array). */
    const kn_buf *buf;
    const kn_buf *packed_buf;
    /* Optional: the same quantized values repacked by kn_weight_pack for
     * the SIMD kernels (NULL: the kernels read data). Packed group g (rows
     * 16g..16g+15), block b sits at packed + g * pack_stride +
     * b * kn_pack_block_bytes(type); a column shard moves packed to its
     * first block and keeps pack_stride, like data and row_bytes. */
    const void *packed;
    size_t pack_stride;
} kn_weight;

/* Rows per packed group, and the bytes of one (group, block) of type t. */
#define KN_PACK_ROWS 16
size_t kn_pack_block_bytes(ggml_type t);

/* Bytes kn_weight_pack needs for w, or 0 when w is not packed (a float
 * type; rows not a multiple of 16 are packed up to the last whole 16 and
 * the rest read from data). The packed copy holds exactly the bytes of
 * the rows it covers: packing moves bytes, it adds none. */
size_t kn_weight_packed_bytes(const kn_weight *w);

/* Write w's packed copy to dst (kn_weight_packed_bytes(w) bytes, 64-byte
 * aligned) and point w->packed at it. */
void kn_weight_pack(kn_weight *w, void *dst);

/* True when kn_matmul has a native kernel for t. */
bool kn_matmul_supports(ggml_type t);

/* Workspace bytes kn_matmul needs for m rows of k inputs at either
 * activation precision: quantized W reads x rounded to integers (bytes
 * and scales: about 2.4 bytes per element at 15 bits, 1.4 at 8, which
 * uses the front of the same space); float W needs none. */
size_t kn_matmul_workspace(int64_t m, int64_t k);

/* ---- ops ---------------------------------------------------------------- */

/* y[m][n] = x[m][k] . W[n][k]^T, n = w->rows, k = w->cols. x and y must not
 * overlap. Multi-threaded over n; m is processed as one matrix product
 * (each block of W is loaded and decoded once per tile of up to 8 rows
 * of x). The stream's workspace must hold kn_matmul_workspace(m, k). */
void kn_matmul(kn_stream *s, const kn_weight *w, const float *x, float *y, int64_t m);

/* y[i] = x . W[i]^T for i < n, where every W[i] has the same cols: the
 * same bits as n kn_matmul calls, in one pass over the thread pool (q, k
 * and v, or gate and up, share one wake-up and one quantization of x). */
void kn_matmul_n(kn_stream *s, int n, const kn_weight *const *w, const float *x, float *const *y, int64_t m);

/* The MLP's first half: y_gate = x . gate^T, y_up = x . up^T, then
 * y_gate = kn_swiglu(y_gate, y_up), with the bits of those three calls.
 * Quantized weights do it in one pass, each thread combining its own rows
 * while they are in cache. */
void kn_matmul_swiglu(kn_stream *s, const kn_weight *gate, const kn_weight *up, const float *x, float *y_gate,
                      float *y_up, int64_t m);

/* y[m][n] = x[m][n] / sqrt(mean(x^2) + eps) * g[n]. y may equal x. */
void kn_rmsnorm(kn_stream *s, const float *x, const float *g, float *y, int64_t m, int64_t n, float eps);

/* y[count] = a[count] + b[count] (the residual add). y may equal a or b. */
void kn_add(kn_stream *s, const float *a, const float *b, float *y, int64_t count);

/* x[m][n] += bias[n] (q/k/v bias of Qwen2). */
void kn_bias_add(kn_stream *s, float *x, const float *bias, int64_t m, int64_t n);

/* y[count] = silu(gate) * up, silu(g) = g / (1 + exp(-g)). y may equal
 * gate or up. */
void kn_swiglu(kn_stream *s, const float *gate, const float *up, float *y, int64_t count);

/* x[m][n] = softmax of each row, in place. */
void kn_softmax(kn_stream *s, float *x, int64_t m, int64_t n);

/* out[m] = index of the largest value of each row of x[m][n]; the lowest
 * index wins ties; NaN is never chosen unless the row is all NaN (then 0). */
void kn_argmax(kn_stream *s, const float *x, int32_t *out, int64_t m, int64_t n);

/* The k largest values of each row of x[m][n] (1 <= k <= KN_TOPK_MAX,
 * k <= n): idx[m][k] and val[m][k], largest first, the lower index first
 * among equal values; NaN counts as -inf (and val says -inf). A selection,
 * no arithmetic: every backend gives the same ids and bits. On a device
 * only these come back, not the row (a draft's children). */
#define KN_TOPK_MAX 16
void kn_topk(kn_stream *s, const float *x, int64_t m, int64_t n, int32_t k, int32_t *idx, float *val);

/* How kn_sample draws a row: target/sample.h's sampling at one position,
 * for the settings a device runs (no top-p). */
typedef struct kn_draw {
    float temperature;       /* <= 0: greedy, kn_argmax's pick */
    int32_t top_k;           /* 0: off, else 1..KN_TOPK_MAX */
    float min_p;             /* <= 0: off */
    uint32_t key_lo, key_hi; /* the position's key (draw.h kn_draw_key) */
} kn_draw;

/* out[m] = the token each row of logits x[m][n] draws with draws[m] (the
 * backend's memory), as target/sample.h's sample_token draws it with
 * top_p = 1: the kept set (temperature, top-k, min-p) and the race of
 * keyed exponentials, the first least key winning. On a device only the
 * ids come back, not the rows. A function of the row alone: batch
 * invariant. The device's expf may differ from the host's in the last
 * bit, so a token within that of a min-p bound or of a tie in the race
 * may differ from the host's; the distribution is the same. The CPU
 * backend has no kn_sample (its caller samples the rows it holds):
 * kn_backend_has_sample. */
bool kn_backend_has_sample(const kn_backend *be);
void kn_sample(kn_stream *s, const float *x, int64_t m, int64_t n, const kn_draw *draws, int32_t *out);

/* out[m][table->cols] = row ids[t] of the table (any dequantizable type),
 * as f32. Every id must be in [0, table->rows). */
void kn_embed(kn_stream *s, const kn_weight *table, const int32_t *ids, float *out, int64_t m);

/* dst[r * dst_stride .. + width) = src[rows[r] * width .. + width) for
 * r < n: rows of a batch gathered (the logit rows, the features a head
 * reads). rows NULL: rows 0 .. n-1, a strided copy (a head's input laid
 * side by side). dst does not overlap src. */
void kn_gather_rows(kn_stream *s, const float *src, const int32_t *rows, int64_t n, int64_t width, float *dst,
                    int64_t dst_stride);

/* Per-head products, MLA's absorbed attention: for each token t < m and
 * head h < n_heads, y[t][h][0, n) = W_h . x[t][h][0, k), where W_h is rows
 * [h n, (h + 1) n) of w (w->rows = n_heads n, w->cols = k). x's heads lie
 * x_head floats apart (>= k), y's y_head apart (>= n); the rest of y is
 * left as it is. F32 weights (KN_OP_LATENT). Each (t, h) is summed on its
 * own in a fixed order: batch invariant. */
void kn_matmul_heads(kn_stream *s, const kn_weight *w, int32_t n_heads, const float *x, int64_t x_head, float *y,
                     int64_t y_head, int64_t m);

/* ---- mixture of experts ------------------------------------------------- */

#define KN_MAX_EXPERTS 512
#define KN_MAX_EXPERT_GROUPS 64
#define KN_MAX_ACTIVE_EXPERTS 16

/* DeepSeek-V3's router (noaux_tc). */
typedef struct kn_route {
    int32_t n_experts;  /* <= KN_MAX_EXPERTS */
    int32_t top_k;      /* experts a token takes, <= KN_MAX_ACTIVE_EXPERTS */
    int32_t n_group;    /* groups of n_experts / n_group experts (1: no groups) */
    int32_t topk_group; /* groups a token's experts come from */
    bool norm;          /* norm_topk_prob: the chosen weights sum to 1 */
    float scale;        /* routed_scaling_factor */
} kn_route;

/* For each token t < m, from its router logits[t][n_experts] (f32) and
 * the correction bias[n_experts]: s = sigmoid(logits); the choice scores
 * c = s + bias; with groups, each group's score is the sum of its two
 * best c, the topk_group best groups are kept and the others' c set to
 * -inf; idx[t][top_k] = the top_k best c (best first, the lower index
 * first among equals), and w[t][top_k] their s: divided by their sum
 * (+ 1e-20) when r->norm, then times r->scale. The bias only chooses; the
 * weights are unbiased. A function of the row: batch invariant. */
void kn_moe_route(kn_stream *s, const float *logits, const float *bias, int64_t m, const kn_route *r, int32_t *idx,
                  float *w);

/* A layer's routed experts: gate[e] and up[e] [ffn][hidden], down[e]
 * [hidden][ffn], every expert of one shape, each matrix of a type
 * KN_OP_MOE takes. */
typedef struct kn_experts {
    int32_t n_experts;
    const kn_weight *gate, *up, *down; /* [n_experts] each */
} kn_experts;

/* Floats of scratch kn_moe_ffn needs for m tokens. */
size_t kn_moe_scratch(int64_t m, int64_t hidden, int64_t ffn);

/* y[m][hidden] = for each token t, the sum over j < top_k of
 * w[t][j] * down_e(swiglu(gate_e x[t], up_e x[t])), e = idx[t][j]
 * (distinct for each token, as kn_moe_route picks them), the
 * terms added in increasing expert order whatever order idx has, from 0.
 * A token's experts see its row alone (kn_matmul is batch invariant), so
 * its sum does not depend on the batch. scratch holds
 * kn_moe_scratch(m, ...) floats; y does not overlap x. */
void kn_moe_ffn(kn_stream *s, const kn_experts *e, const float *x, const int32_t *idx, const float *w, int64_t m,
                int32_t top_k, float *scratch, float *y);

/* ---- RoPE --------------------------------------------------------------- */

#define KN_MAX_HEAD_DIM 256

typedef enum kn_rope_layout {
    /* Pairs (x[2i], x[2i+1]): GGUF llama (its q/k rows were permuted for
     * this by the converter). */
    KN_ROPE_ADJACENT = 0,
    /* Pairs (x[i], x[i + d/2]): NeoX / Hugging Face rotate_half. */
    KN_ROPE_NEOX = 1,
} kn_rope_layout;

typedef struct kn_rope_config {
    kn_rope_layout layout;
    int32_t head_dim; /* even, <= KN_MAX_HEAD_DIM (attention: a multiple of 8) */
    double theta;     /* rope_theta */
    /* Llama-3 rope_scaling; factor <= 0 (or 1 with no band) means none. */
    double factor;
    double low_freq_factor;
    double high_freq_factor;
    double original_max_pos; /* original_max_position_embeddings */
    /* YaRN instead (DeepSeek-V3): frequencies blended between the
     * original and the divided-by-factor ones over the band of dims
     * rotating beta_fast .. beta_slow times in original_max_pos (the
     * attention's mscale is the caller's; the cos/sin factor must be 1). */
    bool yarn;
    double beta_fast, beta_slow;
} kn_rope_config;

/* The frequency table, computed once at load (plain data). */
typedef struct kn_rope {
    kn_rope_layout layout;
    int32_t head_dim;
    double inv_freq[KN_MAX_HEAD_DIM / 2]; /* (head_dim / 2) radians per position */
} kn_rope;

int kn_rope_init(kn_rope *r, const kn_rope_config *cfg, ae_error *err);

/* Rotates x[m][n_heads][head_dim] in place; token t is at position pos[t]
 * (>= 0). The angle is computed in double and rounded once to f32. pos
 * is host memory, so this takes a host-memory backend (tests; a forward
 * pass uses the two steps below). */
void kn_rope_apply(kn_stream *s, const kn_rope *r, float *x, int64_t m, int32_t n_heads, const int32_t *pos);

/* The same in two steps, so that a forward pass computes each token's
 * cos and sin once for all its layers: kn_rope_table writes
 * cs[m][head_dim] (cos, sin of pair i at 2i, 2i+1), kn_rope_rotate applies
 * them. The bits are kn_rope_apply's. Both are ops of the stream: pos and
 * cs are the backend's memory (a step's positions are an input buffer). */
void kn_rope_table(kn_stream *s, const kn_rope *r, const int32_t *pos, int64_t m, float *cs);
void kn_rope_rotate(kn_stream *s, const kn_rope *r, float *x, int64_t m, int32_t n_heads, const float *cs);

/* ---- paged KV cache and attention --------------------------------------- */

/* One layer's KV storage (plain data; the KV cache owns the memory). Slot s
 * of a sequence lives in block block_table[s / block_size], row
 * s % block_size. The element type is the pool's: a backend says which it
 * takes (kn_backend_supports, KN_OP_KV). The CPU's is GGML_TYPE_F16, IEEE
 * half floats: half the bytes of f32 to hold and, at decode, to read. */
typedef struct kn_kv_pool {
    void *k;           /* [n_blocks][block_size][n_kv_heads][head_dim] of type */
    void *v;           /* the same; NULL in a latent pool (MLA): the values are the keys */
    const kn_buf *buf; /* holding k and v (checked); NULL: host memory, as for kn_weight */
    int32_t n_blocks;
    int32_t block_size;
    int32_t n_kv_heads;
    int32_t head_dim; /* <= KN_MAX_HEAD_DIM; a latent pool's <= KN_MAX_ATTN_DIM */
    ggml_type type;
    float scale; /* attention's softmax scale; 0: 1 / sqrt(head_dim) */
} kn_kv_pool;

/* The widest head a latent pool (KN_OP_LATENT) holds: DeepSeek-V3's
 * kv_lora_rank 512 + qk_rope_head_dim 64. */
#define KN_MAX_ATTN_DIM 576

/* Where each token of a batch reads and writes the KV cache: flat int32
 * arrays in the backend's memory (the engine uploads them into fixed
 * buffers each step, so a captured step replays with new contents). All
 * layers share one map per step. On a host-memory backend kernels.c also
 * checks the entries; elsewhere the engine's validation is the check. */
typedef struct kn_kv_map {
    int32_t m;                   /* tokens in the batch */
    const int32_t *block_tables; /* [n_seqs][table_len] block ids (unused: -1) */
    int32_t n_seqs;
    int32_t table_len;
    const int32_t *seq;         /* [m] the token's row of block_tables */
    const int32_t *slot;        /* [m] where kn_kv_write stores its k/v */
    const int32_t *n_prefix;    /* [m] slots [0, n_prefix) are visible */
    const int32_t *extra_start; /* [m] index into extra[] of its extra slots */
    const int32_t *n_extra;     /* [m] count of extra slots (0 for prefill/decode) */
    const int32_t *extra;       /* [n_extra_total] slots, increasing position order */
    int32_t n_extra_total;
    /* The most slots a token of the batch sees (n_prefix + n_extra), as
     * the host knows it, or 0 for "up to the block table's capacity": a
     * backend that splits attention by chunks sizes its grid by it. */
    int32_t max_visible;
} kn_kv_map;

/* Visible keys are cut into chunks of this many for the online softmax. */
#define KN_ATTN_CHUNK 32

/* Stores k[m][n_kv_heads][head_dim] and v[...] of each token t at slot
 * map->slot[t] of its sequence, each element rounded to f16 to nearest,
 * ties to even, as quant_f32_to_f16 does (subnormals kept, overflow to
 * inf, NaN quiet): F16C and the portable path store the same bits. */
void kn_kv_write(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *k,
                 const float *v); /* v: NULL for a latent pool */

/* out[m][n_heads][head_dim] = softmax(q k^T * scale) v, where
 * token t attends to the slots of its sequence [0, n_prefix[t]) followed by
 * its extra slots (a tree node: its ancestors in scratch slots, then
 * itself; a prefill or decode token: n_prefix = position + 1, no extras).
 * Grouped-query: head h reads kv head h / (n_heads / n_kv_heads). Each
 * token must see at least one slot; q is already rotated; out does not
 * overlap q. scale is the pool's. In a latent pool (MLA's absorbed form:
 * one kv head, v NULL) the values are the keys, so out's head_dim floats
 * are the weighted keys; the caller reads the part it wants.
 *
 * K and V come only from the pool, widened exactly from f16, so the keys
 * of the batch's own tokens (written by kn_kv_write just before) are the
 * rounded ones too: a token sees the same values whether its keys were
 * written in this pass or read back later. Tokens of one sequence that
 * are adjacent in the batch (a tree's nodes, a prefill chunk) share each
 * chunk that lies wholly in their prefixes: it is loaded and widened once
 * for all of them. Each token's arithmetic is still the one above. */
void kn_attention(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *q, float *out,
                  int32_t n_heads);

/* Copies the K and V rows src_rows[i] to dst_rows[i] of the pool, in
 * order i = 0, 1, ...; a row is one slot, [n_kv_heads][head_dim] at
 * block * block_size + slot % block_size. A later move may read a row an
 * earlier one wrote (the KV cache's commit moves front to back). */
void kn_kv_move(kn_stream *s, const kn_kv_pool *kv, const int32_t *src_rows, const int32_t *dst_rows, int32_t n);

/* Up to this many tokens, when they form few runs of one sequence (one
 * decode, one verify tree), attention splits the runs' chunks over the
 * threads and keeps the chunks' partials in the stream's workspace; size
 * it with kn_attention_workspace (a smaller workspace only takes the other
 * way, with the same bits). */
#define KN_ATTN_SPLIT_M 8
size_t kn_attention_workspace(int32_t n_heads, int32_t head_dim, int32_t max_keys);

/* ---- tensor-parallel communication -------------------------------------- */

typedef struct kn_comm kn_comm;

/* How ranks add their partials (--allreduce):
 *   - CPU: ranks that are threads of this process, on a host-memory
 *     backend; each rank sums every rank's slot itself, in rank order.
 *   - NCCL: ncclAllReduce on the rank's stream (the CUDA plugin opens
 *     libnccl with dlopen). Every rank gets the same bits, but NCCL's
 *     order of additions is its own, not rank order.
 *   - CUSTOM: the CUDA plugin's one-shot allreduce for ranks of one
 *     process: each rank copies its partial to a slot every rank can
 *     read, and one kernel per rank adds all slots in rank order, the CPU
 *     communicator's bits. One pass over R slots: for small messages.
 *   - AUTO: the caller's choice, resolved before a comm is made (the
 *     engine's rule is in target/engine.h). */
typedef enum kn_allreduce { KN_ALLREDUCE_AUTO, KN_ALLREDUCE_CPU, KN_ALLREDUCE_NCCL, KN_ALLREDUCE_CUSTOM } kn_allreduce;
const char *kn_allreduce_name(kn_allreduce k); /* "auto", "cpu", "nccl", "custom" */
/* The kind named s; -1 if none is. */
int kn_allreduce_parse(const char *s);

/* A communicator of kind `kind` for n_ranks ranks that are threads of this
 * process, on backend be: comms[r] (r < n_ranks) is rank r's handle, used
 * by that thread only, with streams of rank_be[r] (NULL: every rank on
 * be; a backend with a table per device, as CUDA's, takes the ranks'
 * tables). max_count bounds the floats of one allreduce (buffers are
 * allocated here, never in the op). Fails, naming why, where be has no
 * such kind. Free with kn_comm_free on the same array. */
#define KN_COMM_MAX_RANKS 64
int kn_comm_init(const kn_backend *be, kn_allreduce kind, kn_comm **comms, int n_ranks,
                 const kn_backend *const *rank_be, size_t max_count, ae_error *err);
/* The CPU kind, on the CPU backend. */
int kn_comm_init_cpu(kn_comm **comms, int n_ranks, size_t max_count, ae_error *err);
void kn_comm_free(kn_comm **comms, int n_ranks); /* NULL entries ignored */

int kn_comm_rank(const kn_comm *c);          /* 0 for NULL */
int kn_comm_size(const kn_comm *c);          /* 1 for NULL */
kn_allreduce kn_comm_kind(const kn_comm *c); /* KN_ALLREDUCE_CPU for NULL */

/* buf[count] = sum over ranks of every rank's buf: in rank order
 * (((r0 + r1) + r2) + ...) for the CPU and custom kinds, so every rank
 * gets the same bits, run to run; NCCL's order for NCCL. In s's order.
 * All ranks must call it with the same count. No-op for a NULL comm or one
 * rank. */
void kn_allreduce_sum(kn_comm *c, kn_stream *s, float *buf, size_t count);

/* x[i] = x[i] + (the sum over ranks of buf[i]): the residual add after a
 * row-parallel projection, with kn_allreduce_sum's sum and kn_add's bits.
 * The custom kind does both in one kernel; buf's contents after it are
 * undefined. With a NULL comm or one rank it is kn_add. */
void kn_allreduce_add(kn_comm *c, kn_stream *s, float *buf, float *x, size_t count);

/* kn_allreduce_add over x [m][n], then y = kn_rmsnorm(x, g) (y must not
 * be x): the residual add and the norm that follows it, with their
 * bits. The custom kind does all three in one kernel a row; the others
 * call the three ops. */
void kn_allreduce_add_rmsnorm(kn_comm *c, kn_stream *s, float *buf, float *x, const float *g, float *y, int64_t m,
                              int64_t n, float eps);

/* What one rank's allreduces have cost since its comm was made: calls,
 * bytes of its buffer (count x 4 each), and the time spent in them (wall
 * time on the CPU, barrier waits included; on a GPU, the time between
 * events recorded on the stream around each, which waits for the calls
 * in flight). Zeros for a NULL comm. */
typedef struct kn_comm_stats {
    uint64_t calls, bytes, ns;
} kn_comm_stats;
kn_comm_stats kn_comm_get_stats(kn_comm *c);

/* ---- CPU backend controls ----------------------------------------------- */

/* Test hooks, process-wide; set them while no op runs.
 * kn_cpu_limit_simd caps the SIMD level the kernels use: 0 portable,
 * 1 AVX2, 2 AVX-512 (the default: the best the CPU has).
 * kn_cpu_force_scalar(true) is a limit of 0, (false) of 2. */
void kn_cpu_limit_simd(int level);
void kn_cpu_force_scalar(bool on);
/* "avx512vnni+avx2", "avx2" or "scalar": the paths ops take now (for the
 * startup log). */
const char *kn_cpu_simd(void);
/* The same as a level: 0 portable, 1 AVX2, 2 AVX-512. For code outside
 * the kernels that keeps the same promise (target/sample.c). */
int kn_cpu_simd_level(void);

#endif
