/* What a compute backend fills in. kernels.h is what the rest of Aerie
 * calls; each of its ops checks its arguments there (kernels.c) and then
 * calls the stream's backend through this table. The CPU backend
 * (cpu/kn_cpu.c, kn_backend_cpu) is the reference, and every other
 * backend is tested op by op against it.
 *
 * A backend:
 *   - says which ops it runs on which types (supports);
 *   - makes streams: every backend's stream struct starts with a
 *     struct kn_stream (below), so that an op finds its backend, and the
 *     backend casts the stream to its own struct;
 *   - allocates buffers in its own memory and copies into and out of them
 *     (upload, download);
 *   - runs each op of kernels.h with the contract stated there, which
 *     includes the bits (kernels.h "Batch invariance");
 *   - orders work: sync waits for everything queued on a stream, and an
 *     event recorded on one stream can be waited for on another.
 *
 * A backend whose memory is not the host's (CUDA) takes only pointers
 * into its own buffers (buf_alloc), and kernels.c checks every weight
 * and KV pool for it. The CPU backend's buffers are host memory
 * (host_memory): plain host pointers are its memory too, so tools and
 * tests may hand it arrays they allocated themselves.
 *
 * A table names its members (.matmul_n = kn_cpu_matmul_n): a member
 * added anywhere in struct kn_backend then cannot shift the others. One
 * a table leaves out is NULL, which only the members whose comment says
 * "NULL: ..." allow. */
#ifndef AERIE_KERNELS_BACKEND_H
#define AERIE_KERNELS_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

/* The backend ABI: what a backend built apart from libaerie (the CUDA
 * plugin, kernels/device.h) and the libaerie that loads it must agree on.
 * It covers
 *   - this file: struct kn_backend (its members, their order and their
 *     signatures), the heads kn_stream, kn_comm and kn_graph, and
 *     kn_comm_ops;
 *   - every type of kernels.h and draw.h that crosses the table (kn_buf,
 *     kn_weight, kn_kv_pool, kn_kv_map, kn_rope, kn_draw, kn_event,
 *     kn_stream_config, kn_comm_stats, kn_route, kn_experts, ae_error)
 *     and the values of the enums it passes (kn_op, kn_allreduce,
 *     ggml_type);
 *   - device.h's entry points (their names and signatures) and
 *     kn_device_info;
 *   - the contract of each op where a backend computes it: the meaning
 *     of an argument, and the bits kernels.h promises.
 * Bump KN_BACKEND_ABI in the commit that changes any of these in a way a
 * plugin built before it would misread: a member added, removed, moved
 * or retyped, a field of a shared type changed, an enum value
 * renumbered, an argument's meaning or an op's bits changed. Changes
 * inside libaerie alone (kernels.c's checks, the CPU backend, a new
 * kernels.h function that reaches no table) leave it as it is.
 * The plugin exports the version it was built with (device.h
 * KN_CUDA_ABI), and kernels/device.c refuses a plugin of another
 * version before calling anything in it. */
#define KN_BACKEND_ABI 1

/* The head of every backend's stream. */
struct kn_stream {
    const kn_backend *be;
    int act_bits; /* 15 or 8 (kernels.h); kn_stream_set_act_bits */
    bool fast;    /* kn_stream_set_fast, where the backend has a fast mode */
};

/* The head of every communicator (kernels.h kn_comm). kernels.c checks
 * the arguments, counts calls and bytes, and calls ops; the kind adds the
 * time. */
typedef struct kn_comm_ops {
    kn_allreduce kind;
    void (*allreduce)(kn_comm *c, kn_stream *s, float *buf, size_t count);
    /* x += the sum of buf, fused; NULL: allreduce, then the stream's add */
    void (*allreduce_add)(kn_comm *c, kn_stream *s, float *buf, float *x, size_t count);
    /* and then y = rmsnorm(x) * g, fused; NULL: allreduce_add, then the stream's rmsnorm */
    void (*allreduce_add_rmsnorm)(kn_comm *c, kn_stream *s, float *buf, float *x, const float *g, float *y, int64_t m,
                                  int64_t n, float eps);
    /* brings c->stats.ns up to date (a GPU's events); NULL: it always is */
    void (*update_stats)(kn_comm *c);
    /* frees comms[0..n) of one group; entries may be NULL */
    void (*free_group)(kn_comm **comms, int n_ranks);
} kn_comm_ops;

struct kn_comm {
    const kn_comm_ops *ops;
    int rank, n_ranks;
    size_t max_count;
    kn_comm_stats stats; /* this rank's; only its thread writes them */
};

/* The head of every backend's graph (kernels.h kn_graph). */
struct kn_graph {
    const kn_backend *be;
    size_t nodes, bytes;
};

struct kn_backend {
    const char *name; /* "cpu" */
    /* Its buffers are host memory and its ops read host pointers: a
     * weight or pool with no buffer is memory it can use, a buffer made
     * from host bytes is those bytes (no copy), and the caller's output
     * arrays can be written in place. */
    bool host_memory;

    bool (*supports)(kn_op op, ggml_type type);

    /* streams */
    /* be: the table called (a backend may have one per device) */
    int (*stream_init)(const kn_backend *be, kn_stream **out, const kn_stream_config *cfg, ae_error *err);
    void (*stream_free)(kn_stream *s);
    int (*stream_threads)(const kn_stream *s);
    void (*sync)(kn_stream *s);
    /* Readies s for fast mode (kernels.h kn_stream_set_fast); NULL: the
     * backend has only the deterministic one. */
    int (*set_fast)(kn_stream *s, ae_error *err);
    void (*event_record)(kn_stream *s, kn_event *e);
    void (*event_wait)(kn_stream *s, const kn_event *e);

    /* graphs (kernels.h); NULL where there are none. graph_end fills the
     * head's nodes and bytes. */
    int (*graph_begin)(kn_stream *s, ae_error *err);
    int (*graph_end)(kn_stream *s, kn_graph **out, ae_error *err);
    void (*graph_launch)(kn_stream *s, kn_graph *g);
    void (*graph_free)(kn_graph *g);

    /* A communicator of `kind` (never AUTO) for ranks that are threads of
     * this process (kernels.h kn_comm_init), rank r's streams of table
     * rank_be[r] (never NULL here); NULL: ranks cannot run on this backend. */
    int (*comm_init)(kn_allreduce kind, kn_comm **comms, int n_ranks, const kn_backend *const *rank_be,
                     size_t max_count, ae_error *err);

    /* buffers; b->be is set before buf_alloc is called */
    int (*buf_alloc)(kn_buf *b, size_t bytes, ae_error *err); /* zero-filled */
    void (*buf_free)(kn_buf *b);
    /* Blocking copy from the host, outside any stream (loading weights). */
    void (*buf_write)(kn_buf *b, size_t off, const void *src, size_t n);
    /* In the stream's order; src may be reused as soon as upload returns. */
    void (*upload)(kn_stream *s, const kn_buf *dst, size_t off, const void *src, size_t n);
    void (*download)(kn_stream *s, void *dst, const kn_buf *src, size_t off, size_t n);

    /* ops: the arguments are checked, as kernels.h states them */
    void (*matmul_n)(kn_stream *s, int n, const kn_weight *const *w, const float *x, float *const *y, int64_t m);
    void (*matmul_swiglu)(kn_stream *s, const kn_weight *gate, const kn_weight *up, const float *x, float *y_gate,
                          float *y_up, int64_t m);
    void (*rmsnorm)(kn_stream *s, const float *x, const float *g, float *y, int64_t m, int64_t n, float eps);
    void (*add)(kn_stream *s, const float *a, const float *b, float *y, int64_t count);
    void (*bias_add)(kn_stream *s, float *x, const float *bias, int64_t m, int64_t n);
    void (*swiglu)(kn_stream *s, const float *gate, const float *up, float *y, int64_t count);
    void (*softmax)(kn_stream *s, float *x, int64_t m, int64_t n);
    void (*argmax)(kn_stream *s, const float *x, int32_t *out, int64_t m, int64_t n);
    void (*topk)(kn_stream *s, const float *x, int64_t m, int64_t n, int32_t k, int32_t *idx, float *val);
    /* NULL where the backend has none (kernels.h kn_sample) */
    void (*sample)(kn_stream *s, const float *x, int64_t m, int64_t n, const kn_draw *draws, int32_t *out);
    void (*embed)(kn_stream *s, const kn_weight *table, const int32_t *ids, float *out, int64_t m);
    void (*rope_table)(kn_stream *s, const kn_rope *r, const int32_t *pos, int64_t m, float *cs);
    void (*rope_rotate)(kn_stream *s, const kn_rope *r, float *x, int64_t m, int32_t n_heads, const float *cs);
    void (*kv_write)(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *k, const float *v);
    void (*kv_move)(kn_stream *s, const kn_kv_pool *kv, const int32_t *src_rows, const int32_t *dst_rows, int32_t n);
    void (*attention)(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *q, float *out,
                      int32_t n_heads);
    void (*gather_rows)(kn_stream *s, const float *src, const int32_t *rows, int64_t n, int64_t width, float *dst,
                        int64_t dst_stride);

    /* Whether this backend's ops may read and write buffers of `other`
     * (another device's table of the same backend, with peer access);
     * NULL: only its own. */
    bool (*reads)(const kn_backend *self, const kn_backend *other);
    /* Frees e->impl (kn_event_free); NULL: events hold nothing. */
    void (*event_free)(kn_event *e);

    /* MLA and mixture-of-experts ops; NULL where supports says no
     * (KN_OP_LATENT, KN_OP_MOE). */
    void (*matmul_heads)(kn_stream *s, const kn_weight *w, int32_t n_heads, const float *x, int64_t x_head, float *y,
                         int64_t y_head, int64_t m);
    void (*moe_route)(kn_stream *s, const float *logits, const float *bias, int64_t m, const kn_route *r, int32_t *idx,
                      float *w);
    void (*moe_ffn)(kn_stream *s, const kn_experts *e, const float *x, const int32_t *idx, const float *w, int64_t m,
                    int32_t top_k, float *scratch, float *y);
};

#endif
