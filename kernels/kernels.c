/* The entry points of kernels.h: each checks its arguments, then calls
 * the stream's backend (backend.h). What an op computes, and its bits,
 * are the backend's to keep; what it may be given is checked here once
 * for every backend. */
#include "backend.h"

#include <stdlib.h>
#include <string.h>

/* ---- streams, events, buffers --------------------------------------------- */

int kn_stream_init(kn_stream **out, const kn_backend *be, const kn_stream_config *cfg, ae_error *err) {
    *out = NULL;
    if (!be) return err_set(err, "kernels: no backend");
    if (be->stream_init(be, out, cfg, err) != AE_OK) return AE_ERR;
    (*out)->be = be;
    (*out)->act_bits = KN_ACT_BITS_DEFAULT;
    (*out)->fast = false;
    return AE_OK;
}

void kn_stream_free(kn_stream *s) {
    if (s) s->be->stream_free(s);
}

const kn_backend *kn_stream_backend(const kn_stream *s) { return s->be; }

const char *kn_backend_name(const kn_backend *be) { return be->name; }

bool kn_backend_supports(const kn_backend *be, kn_op op, ggml_type type) { return be->supports(op, type); }

void kn_stream_set_act_bits(kn_stream *s, int bits) {
    AE_ASSERT(bits == 8 || bits == 15);
    s->act_bits = bits;
}

int kn_stream_act_bits(const kn_stream *s) { return s->act_bits; }

int kn_stream_set_fast(kn_stream *s, bool fast, ae_error *err) {
    if (!fast || !s->be->set_fast || s->fast) {
        s->fast = fast && s->be->set_fast;
        return AE_OK;
    }
    if (s->be->set_fast(s, err) != AE_OK) return AE_ERR;
    s->fast = true;
    return AE_OK;
}

bool kn_stream_fast(const kn_stream *s) { return s->fast; }

void kn_stream_sync(kn_stream *s) { s->be->sync(s); }

int kn_stream_threads(const kn_stream *s) { return s->be->stream_threads(s); }

void kn_event_record(kn_stream *s, kn_event *e) {
    AE_ASSERT(!e->impl || e->be == s->be); /* an event stays with one backend (one device) */
    e->be = s->be;
    s->be->event_record(s, e);
}

void kn_event_free(kn_event *e) {
    if (e->impl && e->be && e->be->event_free) e->be->event_free(e);
    *e = (kn_event){NULL, NULL};
}

void kn_event_wait(kn_stream *s, const kn_event *e) { s->be->event_wait(s, e); }

bool kn_backend_has_graphs(const kn_backend *be) { return be->graph_begin != NULL; }

int kn_graph_begin(kn_stream *s, ae_error *err) {
    if (!s->be->graph_begin) return err_set(err, "the %s backend has no graphs", s->be->name);
    return s->be->graph_begin(s, err);
}

int kn_graph_end(kn_stream *s, kn_graph **out, ae_error *err) {
    *out = NULL;
    AE_ASSERT(s->be->graph_end);
    if (s->be->graph_end(s, out, err) != AE_OK) return AE_ERR;
    (*out)->be = s->be;
    return AE_OK;
}

void kn_graph_launch(kn_stream *s, kn_graph *g) {
    AE_ASSERT(g->be == s->be);
    s->be->graph_launch(s, g);
}

void kn_graph_free(kn_graph *g) {
    if (g) g->be->graph_free(g);
}

size_t kn_graph_nodes(const kn_graph *g) { return g->nodes; }
size_t kn_graph_bytes(const kn_graph *g) { return g->bytes; }

int kn_buf_alloc(const kn_backend *be, kn_buf *b, size_t bytes, ae_error *err) {
    *b = (kn_buf){.be = be};
    if (be->buf_alloc(b, bytes, err) != AE_OK) {
        *b = (kn_buf){0};
        return AE_ERR;
    }
    b->bytes = bytes;
    return AE_OK;
}

void kn_buf_free(kn_buf *b) {
    if (b->be && !b->borrowed) b->be->buf_free(b);
    *b = (kn_buf){0};
}

bool kn_backend_host_memory(const kn_backend *be) { return be->host_memory; }
bool kn_backend_reads(const kn_backend *self, const kn_backend *other) {
    return self == other || (self->reads && self->reads(self, other));
}

int kn_buf_from_host(const kn_backend *be, kn_buf *b, const void *host, size_t bytes, ae_error *err) {
    if (be->host_memory) {
        *b = (kn_buf){.be = be, .ptr = (void *)(uintptr_t)host, .bytes = bytes, .borrowed = true};
        return AE_OK;
    }
    if (kn_buf_alloc(be, b, bytes, err) != AE_OK) return AE_ERR;
    if (bytes) be->buf_write(b, 0, host, bytes);
    return AE_OK;
}

void kn_upload(kn_stream *s, const kn_buf *dst, size_t off, const void *src, size_t n) {
    AE_ASSERT(dst->be == s->be && off <= dst->bytes && n <= dst->bytes - off);
    if (n) s->be->upload(s, dst, off, src, n);
}

void kn_download(kn_stream *s, void *dst, const kn_buf *src, size_t off, size_t n) {
    AE_ASSERT(src->be == s->be && off <= src->bytes && n <= src->bytes - off);
    if (n) s->be->download(s, dst, src, off, n);
}

/* ---- ops -------------------------------------------------------------------- */

/* [p, p + n), read by an op of s, lies in b, a buffer of s's backend (or
 * of one it reads: another device's, by peer access);
 * with no buffer it is host memory, which only a host-memory backend
 * reads. */
static void check_mem(const kn_stream *s, const kn_buf *b, const void *p, size_t n) {
    if (!b) {
        AE_ASSERT(s->be->host_memory && "host memory given to a backend that has its own");
        return;
    }
    AE_ASSERT(kn_backend_reads(s->be, b->be) && "a buffer of another backend");
    uintptr_t lo = (uintptr_t)b->ptr, at = (uintptr_t)p;
    AE_ASSERT(at >= lo && at - lo <= b->bytes && n <= b->bytes - (at - lo));
}

/* The bytes of w's rows from data: the last row needs only its own
 * columns (a column shard strides over the full rows). */
static size_t weight_span(const kn_weight *w) {
    return (size_t)(w->rows - 1) * w->row_bytes + (size_t)quant_row_bytes(w->type, (uint64_t)w->cols);
}

static void check_weight(const kn_stream *s, const kn_weight *w) {
    AE_ASSERT(w && w->rows > 0 && w->cols > 0);
    AE_ASSERT(s->be->supports(KN_OP_MATMUL, w->type));
    AE_ASSERT(w->row_bytes >= quant_row_bytes(w->type, (uint64_t)w->cols) &&
              quant_row_bytes(w->type, (uint64_t)w->cols) > 0);
    check_mem(s, w->buf, w->data, weight_span(w));
    if (w->packed) check_mem(s, w->packed_buf, w->packed, 1); /* its start: a shard's packed rows stride too */
}

void kn_matmul(kn_stream *s, const kn_weight *w, const float *x, float *y, int64_t m) {
    check_weight(s, w);
    AE_ASSERT(m >= 0);
    s->be->matmul_n(s, 1, &w, x, &y, m);
}

void kn_matmul_n(kn_stream *s, int n, const kn_weight *const *w, const float *x, float *const *y, int64_t m) {
    AE_ASSERT(n >= 1 && m >= 0);
    for (int i = 0; i < n; i++) {
        check_weight(s, w[i]);
        AE_ASSERT(w[i]->cols == w[0]->cols);
    }
    s->be->matmul_n(s, n, w, x, y, m);
}

void kn_matmul_swiglu(kn_stream *s, const kn_weight *gate, const kn_weight *up, const float *x, float *y_gate,
                      float *y_up, int64_t m) {
    check_weight(s, gate);
    check_weight(s, up);
    AE_ASSERT(gate->rows == up->rows && gate->cols == up->cols && m >= 0);
    s->be->matmul_swiglu(s, gate, up, x, y_gate, y_up, m);
}

void kn_rmsnorm(kn_stream *s, const float *x, const float *g, float *y, int64_t m, int64_t n, float eps) {
    AE_ASSERT(m >= 0 && n > 0 && eps >= 0.0f);
    s->be->rmsnorm(s, x, g, y, m, n, eps);
}

void kn_add(kn_stream *s, const float *a, const float *b, float *y, int64_t count) {
    AE_ASSERT(count >= 0);
    s->be->add(s, a, b, y, count);
}

/* ---- tensor-parallel communication ---- */

static const char *const allreduce_names[] = {"auto", "cpu", "nccl", "custom"};

const char *kn_allreduce_name(kn_allreduce k) {
    return (unsigned)k < sizeof allreduce_names / sizeof *allreduce_names ? allreduce_names[k] : "?";
}

int kn_allreduce_parse(const char *s) {
    for (int i = 0; i < (int)(sizeof allreduce_names / sizeof *allreduce_names); i++)
        if (s && strcmp(s, allreduce_names[i]) == 0) return i;
    return -1;
}

int kn_comm_init(const kn_backend *be, kn_allreduce kind, kn_comm **comms, int n_ranks,
                 const kn_backend *const *rank_be, size_t max_count, ae_error *err) {
    for (int r = 0; r < n_ranks; r++) comms[r] = NULL;
    if (kind == KN_ALLREDUCE_AUTO) return err_set(err, "comm: allreduce auto is chosen before a comm is made");
    if (!be->comm_init) return err_set(err, "comm: the %s backend cannot run ranks", be->name);
    if (n_ranks < 1 || n_ranks > KN_COMM_MAX_RANKS)
        return err_set(err, "comm: ranks must be in 1..%d, got %d", KN_COMM_MAX_RANKS, n_ranks);
    const kn_backend *all[KN_COMM_MAX_RANKS];
    for (int r = 0; r < n_ranks; r++) {
        all[r] = rank_be ? rank_be[r] : be;
        if (!all[r] || all[r]->comm_init != be->comm_init)
            return err_set(err, "comm: rank %d is on backend %s, not one of %s's", r, all[r] ? all[r]->name : "(none)",
                           be->name);
    }
    return be->comm_init(kind, comms, n_ranks, all, max_count, err);
}

void kn_comm_free(kn_comm **comms, int n_ranks) {
    if (!comms) return;
    for (int r = 0; r < n_ranks; r++)
        if (comms[r]) {
            comms[r]->ops->free_group(comms, n_ranks);
            return;
        }
}

int kn_comm_rank(const kn_comm *c) { return c ? c->rank : 0; }
int kn_comm_size(const kn_comm *c) { return c ? c->n_ranks : 1; }
kn_allreduce kn_comm_kind(const kn_comm *c) { return c ? c->ops->kind : KN_ALLREDUCE_CPU; }

kn_comm_stats kn_comm_get_stats(kn_comm *c) {
    if (!c) return (kn_comm_stats){0, 0, 0};
    if (c->ops->update_stats) c->ops->update_stats(c);
    return c->stats;
}

void kn_allreduce_sum(kn_comm *c, kn_stream *s, float *buf, size_t count) {
    if (!c || c->n_ranks == 1) return;
    AE_ASSERT(count <= c->max_count);
    c->stats.calls++;
    c->stats.bytes += (uint64_t)count * sizeof(float);
    c->ops->allreduce(c, s, buf, count);
}

void kn_allreduce_add(kn_comm *c, kn_stream *s, float *buf, float *x, size_t count) {
    AE_ASSERT(count <= (size_t)INT64_MAX);
    if (c && c->n_ranks > 1 && c->ops->allreduce_add) {
        AE_ASSERT(count <= c->max_count);
        c->stats.calls++;
        c->stats.bytes += (uint64_t)count * sizeof(float);
        c->ops->allreduce_add(c, s, buf, x, count);
        return;
    }
    kn_allreduce_sum(c, s, buf, count);
    kn_add(s, x, buf, x, (int64_t)count);
}

void kn_allreduce_add_rmsnorm(kn_comm *c, kn_stream *s, float *buf, float *x, const float *g, float *y, int64_t m,
                              int64_t n, float eps) {
    AE_ASSERT(m >= 0 && n > 0 && eps >= 0.0f && y != x);
    const size_t count = (size_t)m * (size_t)n;
    if (c && c->n_ranks > 1 && c->ops->allreduce_add_rmsnorm) {
        AE_ASSERT(count <= c->max_count);
        c->stats.calls++;
        c->stats.bytes += (uint64_t)count * sizeof(float);
        c->ops->allreduce_add_rmsnorm(c, s, buf, x, g, y, m, n, eps);
        return;
    }
    kn_allreduce_add(c, s, buf, x, count);
    kn_rmsnorm(s, x, g, y, m, n, eps);
}

void kn_bias_add(kn_stream *s, float *x, const float *bias, int64_t m, int64_t n) {
    AE_ASSERT(m >= 0 && n > 0);
    s->be->bias_add(s, x, bias, m, n);
}

void kn_swiglu(kn_stream *s, const float *gate, const float *up, float *y, int64_t count) {
    AE_ASSERT(count >= 0);
    s->be->swiglu(s, gate, up, y, count);
}

void kn_softmax(kn_stream *s, float *x, int64_t m, int64_t n) {
    AE_ASSERT(m >= 0 && n > 0);
    s->be->softmax(s, x, m, n);
}

void kn_argmax(kn_stream *s, const float *x, int32_t *out, int64_t m, int64_t n) {
    AE_ASSERT(m >= 0 && n > 0 && n <= INT32_MAX);
    s->be->argmax(s, x, out, m, n);
}

void kn_topk(kn_stream *s, const float *x, int64_t m, int64_t n, int32_t k, int32_t *idx, float *val) {
    AE_ASSERT(m >= 0 && n > 0 && n <= INT32_MAX && k >= 1 && k <= KN_TOPK_MAX && k <= n);
    s->be->topk(s, x, m, n, k, idx, val);
}

bool kn_backend_has_sample(const kn_backend *be) { return be->sample != NULL; }

void kn_sample(kn_stream *s, const float *x, int64_t m, int64_t n, const kn_draw *draws, int32_t *out) {
    AE_ASSERT(m >= 0 && n > 0 && n <= INT32_MAX && s->be->sample);
    s->be->sample(s, x, m, n, draws, out);
}

void kn_embed(kn_stream *s, const kn_weight *table, const int32_t *ids, float *out, int64_t m) {
    AE_ASSERT(m >= 0 && table->rows > 0 && table->cols > 0 && s->be->supports(KN_OP_EMBED, table->type));
    check_mem(s, table->buf, table->data, weight_span(table));
    s->be->embed(s, table, ids, out, m);
}

void kn_gather_rows(kn_stream *s, const float *src, const int32_t *rows, int64_t n, int64_t width, float *dst,
                    int64_t dst_stride) {
    AE_ASSERT(n >= 0 && width > 0 && dst_stride >= width);
    s->be->gather_rows(s, src, rows, n, width, dst, dst_stride);
}

void kn_rope_rotate(kn_stream *s, const kn_rope *r, float *x, int64_t m, int32_t n_heads, const float *cs) {
    AE_ASSERT(r->head_dim / 2 > 0 && m >= 0 && n_heads > 0);
    s->be->rope_rotate(s, r, x, m, n_heads, cs);
}

void kn_rope_table(kn_stream *s, const kn_rope *r, const int32_t *pos, int64_t m, float *cs) {
    AE_ASSERT(r->head_dim / 2 > 0 && m >= 0);
    s->be->rope_table(s, r, pos, m, cs);
}

void kn_rope_apply(kn_stream *s, const kn_rope *r, float *x, int64_t m, int32_t n_heads, const int32_t *pos) {
    AE_ASSERT(s->be->host_memory);
    float cs[KN_MAX_HEAD_DIM];
    for (int64_t t = 0; t < m; t++) {
        kn_rope_table(s, r, pos + t, 1, cs);
        kn_rope_rotate(s, r, x + t * n_heads * r->head_dim, 1, n_heads, cs);
    }
}

/* A latent pool (v NULL), a head wider than a plain pool's, or a scale
 * of the caller's own is MLA's attention, which a backend may not have. */
static bool latent_pool(const kn_kv_pool *kv) { return !kv->v || kv->head_dim > KN_MAX_HEAD_DIM || kv->scale != 0.0f; }

static void check_pool(const kn_stream *s, const kn_kv_pool *kv) {
    AE_ASSERT(kv->k && s->be->supports(KN_OP_KV, kv->type));
    AE_ASSERT(!latent_pool(kv) || s->be->supports(KN_OP_LATENT, kv->type));
    AE_ASSERT(kv->v || kv->n_kv_heads == 1);
    AE_ASSERT(kv->n_blocks > 0 && kv->block_size > 0 && kv->n_kv_heads > 0 && kv->head_dim > 0);
    AE_ASSERT(kv->scale >= 0.0f);
    size_t bytes = (size_t)kv->n_blocks * (size_t)kv->block_size * (size_t)kv->n_kv_heads *
                   (size_t)quant_row_bytes(kv->type, (uint64_t)kv->head_dim);
    check_mem(s, kv->buf, kv->k, bytes);
    if (kv->v) check_mem(s, kv->buf, kv->v, bytes);
}

static void check_kv(const kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map) {
    check_pool(s, kv);
    AE_ASSERT(kv->block_size > 0 && kv->n_blocks > 0 && kv->n_kv_heads > 0);
    AE_ASSERT(kv->head_dim > 0 && kv->head_dim <= (latent_pool(kv) ? KN_MAX_ATTN_DIM : KN_MAX_HEAD_DIM));
    AE_ASSERT(map->m >= 0 && map->n_seqs >= 0 && map->table_len >= 0 && map->n_extra_total >= 0);
    if (!s->be->host_memory) return; /* the map is the backend's memory: the engine checked it */
    for (int32_t t = 0; t < map->m; t++) {
        AE_ASSERT(map->seq[t] >= 0 && map->seq[t] < map->n_seqs);
        AE_ASSERT(map->n_prefix[t] >= 0 && map->n_extra[t] >= 0);
        AE_ASSERT(map->extra_start[t] >= 0 && map->extra_start[t] <= map->n_extra_total - map->n_extra[t]);
    }
}

void kn_kv_write(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *k, const float *v) {
    check_kv(s, kv, map);
    AE_ASSERT(k && (v != NULL) == (kv->v != NULL));
    s->be->kv_write(s, kv, map, k, v);
}

void kn_kv_move(kn_stream *s, const kn_kv_pool *kv, const int32_t *src_rows, const int32_t *dst_rows, int32_t n) {
    check_pool(s, kv);
    AE_ASSERT(n >= 0);
    const int64_t rows = (int64_t)kv->n_blocks * kv->block_size;
    for (int32_t i = 0; i < n && s->be->host_memory; i++)
        AE_ASSERT(src_rows[i] >= 0 && src_rows[i] < rows && dst_rows[i] >= 0 && dst_rows[i] < rows);
    if (n) s->be->kv_move(s, kv, src_rows, dst_rows, n);
}

void kn_attention(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *q, float *out,
                  int32_t n_heads) {
    check_kv(s, kv, map);
    AE_ASSERT(n_heads > 0 && n_heads % kv->n_kv_heads == 0 && kv->head_dim % 8 == 0);
    AE_ASSERT((int64_t)map->m * n_heads <= INT32_MAX);
    size_t all = (size_t)map->m * (size_t)n_heads * (size_t)kv->head_dim;
    AE_ASSERT(out + all <= q || q + all <= out);
    s->be->attention(s, kv, map, q, out, n_heads);
}

void kn_matmul_heads(kn_stream *s, const kn_weight *w, int32_t n_heads, const float *x, int64_t x_head, float *y,
                     int64_t y_head, int64_t m) {
    check_weight(s, w);
    AE_ASSERT(w->type == GGML_TYPE_F32 && s->be->supports(KN_OP_LATENT, w->type) && s->be->matmul_heads);
    AE_ASSERT(n_heads > 0 && w->rows % n_heads == 0 && m >= 0);
    AE_ASSERT(x_head >= w->cols && y_head >= w->rows / n_heads);
    size_t xs = (size_t)m * (size_t)n_heads * (size_t)x_head, ys = (size_t)m * (size_t)n_heads * (size_t)y_head;
    AE_ASSERT(y + ys <= x || x + xs <= y);
    if (m) s->be->matmul_heads(s, w, n_heads, x, x_head, y, y_head, m);
}

static void check_route(const kn_route *r) {
    AE_ASSERT(r->n_experts >= 1 && r->n_experts <= KN_MAX_EXPERTS);
    AE_ASSERT(r->top_k >= 1 && r->top_k <= KN_MAX_ACTIVE_EXPERTS && r->top_k <= r->n_experts);
    AE_ASSERT(r->n_group >= 1 && r->n_group <= KN_MAX_EXPERT_GROUPS && r->n_experts % r->n_group == 0);
    AE_ASSERT(r->topk_group >= 1 && r->topk_group <= r->n_group);
    AE_ASSERT(r->n_group == 1 || r->n_experts / r->n_group >= 2); /* a group's score is its best two */
    AE_ASSERT((int64_t)r->topk_group * (r->n_experts / r->n_group) >= r->top_k);
}

void kn_moe_route(kn_stream *s, const float *logits, const float *bias, int64_t m, const kn_route *r, int32_t *idx,
                  float *w) {
    AE_ASSERT(s->be->supports(KN_OP_MOE, GGML_TYPE_F32) && s->be->moe_route);
    check_route(r);
    AE_ASSERT(m >= 0 && logits && bias && idx && w);
    if (m) s->be->moe_route(s, logits, bias, m, r, idx, w);
}

size_t kn_moe_scratch(int64_t m, int64_t hidden, int64_t ffn) {
    /* each expert's rows of x and of its output, its gate and up, and
     * its tokens and their weights */
    return (size_t)m * (2 * (size_t)hidden + 2 * (size_t)ffn + 2);
}

void kn_moe_ffn(kn_stream *s, const kn_experts *e, const float *x, const int32_t *idx, const float *w, int64_t m,
                int32_t top_k, float *scratch, float *y) {
    AE_ASSERT(e->n_experts >= 1 && e->n_experts <= KN_MAX_EXPERTS && s->be->moe_ffn);
    AE_ASSERT(top_k >= 1 && top_k <= KN_MAX_ACTIVE_EXPERTS && top_k <= e->n_experts && m >= 0);
    const kn_weight *g0 = &e->gate[0];
    for (int32_t i = 0; i < e->n_experts; i++) { /* one shape; each matrix its own type */
        const kn_weight *g = &e->gate[i], *u = &e->up[i], *d = &e->down[i];
        check_weight(s, g);
        check_weight(s, u);
        check_weight(s, d);
        AE_ASSERT(s->be->supports(KN_OP_MOE, g->type) && s->be->supports(KN_OP_MOE, u->type) &&
                  s->be->supports(KN_OP_MOE, d->type));
        AE_ASSERT(g->rows == g0->rows && g->cols == g0->cols && u->rows == g->rows && u->cols == g->cols &&
                  d->rows == g->cols && d->cols == g->rows);
    }
    /* each token's experts distinct: an expert runs a token once */
    for (int64_t t = 0; t < m && s->be->host_memory; t++)
        for (int32_t j = 0; j < top_k; j++) {
            int32_t ex = idx[t * top_k + j];
            AE_ASSERT(ex >= 0 && ex < e->n_experts);
            for (int32_t q = 0; q < j; q++) AE_ASSERT(idx[t * top_k + q] != ex);
        }
    size_t xs = (size_t)m * (size_t)g0->cols;
    AE_ASSERT(y + xs <= x || x + xs <= y);
    if (m) s->be->moe_ffn(s, e, x, idx, w, m, top_k, scratch, y);
}
