#include "tp.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "../services/core/pool.h"
#include "../services/model/quant.h"
#include "arch.h"

/* ---- split ---------------------------------------------------------------- */

/* Cuts n units into R ranges as evenly as possible, the first n % R ranges
 * one longer. */
static void split_even(tp_range *out, int32_t n, int32_t R) {
    int32_t base = n / R, extra = n % R, at = 0;
    for (int32_t r = 0; r < R; r++) {
        int32_t len = base + (r < extra ? 1 : 0);
        out[r] = (tp_range){at, at + len};
        at += len;
    }
}

/* An FFN width cut into R ranges in granules of TP_FFN_ALIGN; a tail
 * below one granule (only for float weights: quantized ones have width %
 * 32 == 0) goes to the last rank. Width 0: empty ranges. */
static int split_width(tp_range *out, int32_t width, int32_t R, const char *what, ae_error *err) {
    int32_t granules = width / TP_FFN_ALIGN;
    if (width == 0) {
        for (int32_t r = 0; r < R; r++) out[r] = (tp_range){0, 0};
        return AE_OK;
    }
    if (R > 1 && granules < R)
        return err_set(err, "tensor parallel: %s %d has %d granules of %d, fewer than %d ranks; at most %d ranks", what,
                       width, granules, TP_FFN_ALIGN, R, granules > 0 ? granules : 1);
    if (R == 1) {
        out[0] = (tp_range){0, width};
        return AE_OK;
    }
    split_even(out, granules, R);
    for (int32_t r = 0; r < R; r++) {
        out[r].begin *= TP_FFN_ALIGN;
        out[r].end *= TP_FFN_ALIGN;
    }
    out[R - 1].end = width;
    return AE_OK;
}

int tp_split_latent(tp_split *out, const model_config *c, int32_t n_ranks, ae_error *err) {
    memset(out, 0, sizeof *out);
    if (n_ranks < 1 || n_ranks > TP_MAX_RANKS)
        return err_set(err, "tensor parallel: ranks must be in 1..%d, got %d", TP_MAX_RANKS, n_ranks);
    if (n_ranks > c->n_heads)
        return err_set(err, "tensor parallel: %d ranks but only %d heads; at most %d ranks", n_ranks, c->n_heads,
                       c->n_heads);
    out->n_ranks = n_ranks;
    out->latent = true;
    split_even(out->heads, c->n_heads, n_ranks);
    for (int32_t r = 0; r < n_ranks; r++) out->kv_heads[r] = (tp_range){0, c->n_kv_heads};
    return split_width(out->ffn, c->n_dense_layers > 0 ? c->ffn : 0, n_ranks, "ffn", err) ||
                   split_width(out->shared, c->shared_ffn, n_ranks, "the shared experts' width", err) ||
                   split_width(out->expert, c->route.n_experts ? c->expert_ffn : 0, n_ranks, "an expert's width", err)
               ? AE_ERR
               : AE_OK;
}

int tp_split_plan(tp_split *out, const model_config *c, int32_t n_ranks, ae_error *err) {
    memset(out, 0, sizeof *out);
    if (n_ranks < 1 || n_ranks > TP_MAX_RANKS)
        return err_set(err, "tensor parallel: ranks must be in 1..%d, got %d", TP_MAX_RANKS, n_ranks);
    if (c->n_kv_heads < 1 || c->n_heads % c->n_kv_heads || c->ffn < 1)
        return err_set(err, "tensor parallel: bad shape (heads %d, kv heads %d, ffn %d)", c->n_heads, c->n_kv_heads,
                       c->ffn);
    if (n_ranks > c->n_kv_heads)
        return err_set(err, "tensor parallel: %d ranks but only %d kv heads; at most %d ranks", n_ranks, c->n_kv_heads,
                       c->n_kv_heads);
    if (split_width(out->ffn, c->ffn, n_ranks, "ffn", err) != AE_OK) return AE_ERR;
    out->n_ranks = n_ranks;
    split_even(out->kv_heads, c->n_kv_heads, n_ranks);
    int32_t group = c->n_heads / c->n_kv_heads;
    for (int32_t r = 0; r < n_ranks; r++)
        out->heads[r] = (tp_range){out->kv_heads[r].begin * group, out->kv_heads[r].end * group};
    return AE_OK;
}

/* ---- shards --------------------------------------------------------------- */

/* Output rows [r0, r0 + n) of w: every row is whole, so any range works. */
static kn_weight rows_view(const kn_weight *w, int64_t r0, int64_t n) {
    AE_ASSERT(r0 >= 0 && n > 0 && r0 + n <= w->rows);
    kn_weight v = *w;
    v.data = (const uint8_t *)w->data + (size_t)r0 * w->row_bytes;
    v.rows = n;
    /* The packed copy goes by groups of KN_PACK_ROWS rows: a view that starts
     * mid-group reads the file's layout (same bits, slower). */
    if (w->packed && r0 % KN_PACK_ROWS == 0)
        v.packed = (const uint8_t *)w->packed + (size_t)(r0 / KN_PACK_ROWS) * w->pack_stride;
    else
        v.packed = NULL;
    return v;
}

/* Input columns [c0, c0 + n) of w: data moves to the range's first block,
 * row_bytes stays the full row's stride. The range must be whole blocks of
 * w's type, or a row of the view would start mid-block. */
static int cols_view(kn_weight *out, const kn_weight *w, int64_t c0, int64_t n, const char *name, int32_t layer,
                     ae_error *err) {
    AE_ASSERT(c0 >= 0 && n > 0 && c0 + n <= w->cols);
    int64_t be = quant_block_elems(w->type);
    if (be < 1 || c0 % be || n % be)
        return err_set(err, "tensor parallel: layer %d %s: columns [%lld, %lld) are not whole %s blocks of %lld", layer,
                       name, (long long)c0, (long long)(c0 + n), quant_type_name(w->type), (long long)be);
    *out = *w;
    out->data = (const uint8_t *)w->data + quant_row_bytes(w->type, (uint64_t)c0);
    if (w->packed) out->packed = (const uint8_t *)w->packed + (size_t)(c0 / be) * kn_pack_block_bytes(w->type);
    out->cols = n;
    return AE_OK;
}

static bool range_ok(tp_range r, int32_t n) { return r.begin >= 0 && r.begin < r.end && r.end <= n; }

/* Bytes of weights a shard reads (the full model owns them all): what
 * one decode step reads of it, plus an untied embedding table. */
static size_t shard_bytes(const model *s) {
    size_t b = arch_decode_bytes(s);
    if (!s->cfg.tied_embeddings)
        b += (size_t)s->tok_embd.rows * quant_row_bytes(s->tok_embd.type, (uint64_t)s->tok_embd.cols);
    return b;
}

void tp_shard_free(model *shard) {
    if (!shard) return;
    for (int32_t i = 0; shard->layers && i < shard->cfg.n_layers; i++) free(shard->layers[i].experts);
    free(shard->layers);
    free(shard);
}

/* Rank `rank`'s range of the split dimension n (arch.h arch_shard). */
static tp_range split_range(const tp_split *sp, arch_size n, int32_t rank) {
    switch (n) {
    case ARCH_HEADS: return sp->heads[rank];
    case ARCH_KV_HEADS: return sp->kv_heads[rank];
    case ARCH_FFN: return sp->ffn[rank];
    case ARCH_SHARED_FFN: return sp->shared[rank];
    case ARCH_EXPERT_FFN: return sp->expert[rank];
    default: break;
    }
    AE_ASSERT(!"a dimension tensor parallelism does not split");
    return (tp_range){0, 0};
}

/* A matrix's share: f whole, or its rows or columns [r.begin, r.end) of
 * the split dimension, unit rows or columns each. */
static int shard_matrix(kn_weight *out, const kn_weight *f, const arch_tensor *t, const model_config *c, tp_range r,
                        int32_t li, ae_error *err) {
    if (t->shard == ARCH_WHOLE) {
        *out = *f;
        return AE_OK;
    }
    AE_ASSERT(f->rows == arch_dim_value(c, t->rows) && f->cols == arch_dim_value(c, t->cols));
    const int64_t unit = arch_size_value(c, (t->shard == ARCH_ROWS ? t->rows : t->cols).unit);
    if (t->shard == ARCH_ROWS) {
        *out = rows_view(f, r.begin * unit, (int64_t)(r.end - r.begin) * unit);
        return AE_OK;
    }
    return cols_view(out, f, r.begin * unit, (int64_t)(r.end - r.begin) * unit, t->name, li, err);
}

/* Rank `rank`'s share of t in layer li (the arch's table: arch.h). An
 * empty range of its split dimension leaves it empty. */
static int shard_tensor(model_layer *l, const model_layer *f, const arch_tensor *t, const model_config *c,
                        const tp_split *sp, int32_t rank, int32_t li, ae_error *err) {
    tp_range r = {0, 0};
    if (t->shard != ARCH_WHOLE) {
        r = split_range(sp, (t->shard == ARCH_ROWS ? t->rows : t->cols).n, rank);
        if (r.end <= r.begin) return AE_OK;
    }
    switch (t->held) {
    case ARCH_VEC: { /* whole, or its rows */
        const float *v = *(const float *const *)arch_field_const(f, t);
        AE_ASSERT(t->shard != ARCH_COLS);
        *(const float **)arch_field(l, t) =
            v && t->shard == ARCH_ROWS ? v + r.begin * arch_size_value(c, t->rows.unit) : v;
        return AE_OK;
    }
    case ARCH_MAT: return shard_matrix(arch_field(l, t), arch_field_const(f, t), t, c, r, li, err);
    case ARCH_EXPERT:
        for (int64_t e = 0; e < c->route.n_experts; e++) {
            const int64_t i = (int64_t)t->at * c->route.n_experts + e;
            if (shard_matrix(&l->experts[i], &f->experts[i], t, c, r, li, err) != AE_OK) return AE_ERR;
        }
        return AE_OK;
    case ARCH_SRC: break;
    }
    return AE_OK;
}

static int range_len(tp_range r) { return r.end - r.begin; }

void tp_shard_config(model_config *out, const model_config *c, const tp_split *sp, int32_t rank) {
    AE_ASSERT(rank >= 0 && rank < sp->n_ranks);
    *out = *c;
    out->n_heads = range_len(sp->heads[rank]);
    out->n_kv_heads = range_len(sp->kv_heads[rank]);
    out->ffn = range_len(sp->ffn[rank]) ? range_len(sp->ffn[rank]) : c->ffn; /* no dense layers: kept */
    out->shared_ffn = range_len(sp->shared[rank]);
    out->expert_ffn = c->route.n_experts ? range_len(sp->expert[rank]) : c->expert_ffn;
}

int tp_shard_init(model **out, const model *full, const tp_split *sp, int32_t rank, ae_error *err) {
    *out = NULL;
    const model_config *c = &full->cfg;
    if (sp->n_ranks < 1 || sp->n_ranks > TP_MAX_RANKS || rank < 0 || rank >= sp->n_ranks)
        return err_set(err, "tensor parallel: rank %d of %d", rank, sp->n_ranks);
    tp_range kv = sp->kv_heads[rank], hd = sp->heads[rank], ff = sp->ffn[rank];
    bool fits;
    if (sp->latent) {
        tp_range sh = sp->shared[rank], ex = sp->expert[rank];
        fits = kv.begin == 0 && kv.end == c->n_kv_heads && range_ok(hd, c->n_heads) && c->kv_lora_rank > 0 &&
               (c->n_dense_layers > 0 ? range_ok(ff, c->ffn) : range_len(ff) == 0) &&
               (c->shared_ffn > 0 ? range_ok(sh, c->shared_ffn) : range_len(sh) == 0) &&
               (c->route.n_experts > 0 ? range_ok(ex, c->expert_ffn) : range_len(ex) == 0);
    } else {
        int32_t group = c->n_heads / c->n_kv_heads;
        fits = range_ok(kv, c->n_kv_heads) && range_ok(ff, c->ffn) && hd.begin == kv.begin * group &&
               hd.end == kv.end * group && c->kv_lora_rank == 0;
    }
    if (!fits)
        return err_set(err,
                       "tensor parallel: rank %d's split (kv heads [%d, %d), heads [%d, %d), ffn [%d, %d)%s) "
                       "does not fit the model (kv heads %d, heads %d, ffn %d%s)",
                       rank, kv.begin, kv.end, hd.begin, hd.end, ff.begin, ff.end, sp->latent ? ", latent" : "",
                       c->n_kv_heads, c->n_heads, c->ffn, c->kv_lora_rank ? ", MLA" : "");
    model *s = calloc(1, sizeof *s);
    if (!s) return err_set(err, "out of memory");
    s->cfg = *c;
    s->layers = calloc((size_t)c->n_layers, sizeof *s->layers);
    if (!s->layers) {
        free(s);
        return err_set(err, "out of memory");
    }
    /* Shared, unsplit: embeddings, norms, output, RoPE table. */
    tp_shard_config(&s->cfg, c, sp, rank);
    s->tok_embd = full->tok_embd;
    s->output = full->output;
    s->output_norm = full->output_norm;
    s->rope = full->rope;
    s->arch = full->arch;
    s->be = full->be;
    memcpy(s->path, full->path, sizeof s->path);
    for (int32_t li = 0; li < c->n_layers; li++) {
        const model_layer *f = &full->layers[li];
        model_layer *l = &s->layers[li];
        l->attn = f->attn;
        l->ffn = f->ffn;
        int rc = AE_OK;
        if (f->attn == MODEL_ATTN_GQA && sp->latent)
            rc = err_set(err, "tensor parallel: layer %d: GQA under a latent split", li);
        else if (f->attn == MODEL_ATTN_MLA && !sp->latent)
            rc = err_set(err, "tensor parallel: layer %d: MLA needs the latent split", li);
        else if (f->experts && !(l->experts = calloc(3 * (size_t)c->route.n_experts, sizeof *l->experts)))
            rc = err_set(err, "out of memory");
        for (size_t k = 0; k < full->arch->n_tensors && rc == AE_OK; k++) {
            const arch_tensor *t = &full->arch->tensors[k];
            if (t->held != ARCH_SRC && arch_layer_has(c, f, t)) rc = shard_tensor(l, f, t, c, sp, rank, li, err);
        }
        if (rc != AE_OK) {
            tp_shard_free(s);
            return AE_ERR;
        }
    }
    s->weight_bytes = shard_bytes(s);
    *out = s;
    return AE_OK;
}

/* ---- group ---------------------------------------------------------------- */

typedef struct tp_rank {
    struct tp_group *g;
    int32_t rank;
    model *shard;
    pool *pool;
    kn_stream *stream;
    forward_ws *ws;
    kn_kv_pool *kv; /* [n_layers] views into kv_mem, or the caller's pools (tp_config.kv) */
    kn_buf
        kv_mem; /* per layer: K then V, each f16 [kv_blocks][block_size][local kv heads][D]; unused with tp_config.kv */
    pthread_t thread;
    bool started;
    kn_event done;        /* recorded after its part of a step (tp_forward's `after`) */
    const kn_backend *be; /* its backend: the model's, or another device's */
    kn_buf *wbufs;        /* [n_wbufs]: its copies of the shard's matrices, on another backend than the model's */
    int32_t n_wbufs;
    uint64_t copied; /* their bytes */
} tp_rank;

/* What the rank threads run on a wakeup. */
typedef enum { TP_JOB_FORWARD, TP_JOB_TIME } tp_job;

struct tp_group {
    const model *m;
    tp_config cfg;
    tp_split split;
    kn_comm *comms[TP_MAX_RANKS];
    tp_rank ranks[TP_MAX_RANKS];
    /* wakeup: tp_forward publishes batch and bumps gen; each worker runs
     * the step it has not seen yet and counts itself into n_done. */
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    bool sync_ready;
    uint64_t gen;
    int32_t n_done;
    bool quit;
    tp_job job;
    const forward_batch *batch; /* TP_JOB_FORWARD */
    kn_stream *after;           /* and the stream it orders against, or NULL */
    kn_event start;             /* recorded on `after` before the ranks start */
    size_t time_count;          /* TP_JOB_TIME */
    int time_reps;
    double time_ns; /* rank 0's result */
};

int32_t tp_group_ranks(const tp_group *g) { return g->cfg.n_ranks; }
const tp_split *tp_group_split(const tp_group *g) { return &g->split; }

const model *tp_group_shard(const tp_group *g, int32_t rank) {
    AE_ASSERT(rank >= 0 && rank < g->cfg.n_ranks);
    return g->ranks[rank].shard;
}

const kn_kv_pool *tp_group_kv(const tp_group *g, int32_t rank) {
    AE_ASSERT(rank >= 0 && rank < g->cfg.n_ranks);
    return g->ranks[rank].kv;
}

const kn_backend *tp_group_backend(const tp_group *g, int32_t rank) {
    AE_ASSERT(rank >= 0 && rank < g->cfg.n_ranks);
    return g->ranks[rank].be;
}

uint64_t tp_group_copied_bytes(const tp_group *g, int32_t rank) {
    AE_ASSERT(rank >= 0 && rank < g->cfg.n_ranks);
    return g->ranks[rank].copied;
}

kn_comm_stats tp_group_comm_stats(tp_group *g) { return kn_comm_get_stats(g->comms[0]); }
kn_allreduce tp_group_allreduce(const tp_group *g) { return kn_comm_kind(g->comms[0]); }

/* Times the allreduce on rank r's stream, its comm's clock (rank 0's
 * result is kept). The activations' buffer is the message. */
static void time_rank(tp_group *g, tp_rank *r) {
    kn_comm *c = g->comms[r->rank];
    float *buf = forward_ws_proj(r->ws);
    kn_allreduce_sum(c, r->stream, buf, g->time_count);
    kn_stream_sync(r->stream);
    kn_comm_stats a = kn_comm_get_stats(c);
    for (int i = 0; i < g->time_reps; i++) kn_allreduce_sum(c, r->stream, buf, g->time_count);
    kn_stream_sync(r->stream);
    kn_comm_stats z = kn_comm_get_stats(c);
    if (r->rank == 0) g->time_ns = (double)(z.ns - a.ns) / (g->time_reps > 0 ? g->time_reps : 1);
}

/* One rank's share of the step. Ranks other than 0 skip the logits and the
 * capture: their residual stream is rank 0's, bit for bit. */
static void run_rank(tp_group *g, tp_rank *r) {
    if (g->job == TP_JOB_TIME) {
        time_rank(g, r);
        return;
    }
    forward_batch b = *g->batch;
    if (r->rank != 0) {
        b.n_logits = 0;
        b.logit_rows = NULL;
        b.logits = NULL;
        b.capture = NULL;
    }
    if (g->after) kn_event_wait(r->stream, &g->start);
    forward_pass(r->shard, r->stream, g->comms[r->rank], r->kv, r->ws, &b);
    if (g->after) kn_event_record(r->stream, &r->done);
}

static void *rank_main(void *arg) {
    tp_rank *r = arg;
    tp_group *g = r->g;
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&g->mu);
        while (g->gen == seen && !g->quit) pthread_cond_wait(&g->wake, &g->mu);
        bool quit = g->quit;
        seen = g->gen;
        pthread_mutex_unlock(&g->mu);
        if (quit) break;
        run_rank(g, r);
        pthread_mutex_lock(&g->mu);
        if (++g->n_done == g->cfg.n_ranks - 1) pthread_cond_signal(&g->done);
        pthread_mutex_unlock(&g->mu);
    }
    return NULL;
}

/* Runs the group's job on every rank, rank 0 here, and waits for all. */
static void run_job(tp_group *g) {
    pthread_mutex_lock(&g->mu);
    g->n_done = 0;
    g->gen++;
    pthread_cond_broadcast(&g->wake);
    pthread_mutex_unlock(&g->mu);
    run_rank(g, &g->ranks[0]);
    pthread_mutex_lock(&g->mu);
    while (g->n_done < g->cfg.n_ranks - 1) pthread_cond_wait(&g->done, &g->mu);
    pthread_mutex_unlock(&g->mu);
}

int tp_group_set_fast(tp_group *g, bool fast, ae_error *err) {
    for (int32_t i = 0; i < g->cfg.n_ranks; i++)
        if (kn_stream_set_fast(g->ranks[i].stream, fast, err) != AE_OK)
            return err_prefix(err, "tensor parallel: rank %d: ", i), AE_ERR;
    return AE_OK;
}

void tp_forward(tp_group *g, kn_stream *after, const forward_batch *b) {
    AE_ASSERT(b && b->map);
    /* On a device, the ranks' work is only queued: the caller orders
     * what follows after it through `after`. */
    AE_ASSERT(after || kn_backend_host_memory(g->m->be));
    g->job = TP_JOB_FORWARD;
    g->batch = b;
    g->after = after;
    if (after) kn_event_record(after, &g->start);
    run_job(g);
    if (after)
        for (int32_t i = 0; i < g->cfg.n_ranks; i++) kn_event_wait(after, &g->ranks[i].done);
    g->batch = NULL;
    g->after = NULL;
}

double tp_group_time_allreduce(tp_group *g, size_t count, int reps) {
    AE_ASSERT(count >= 1 && count <= (size_t)g->cfg.max_tokens * (size_t)g->m->cfg.hidden && reps >= 0);
    g->job = TP_JOB_TIME;
    g->time_count = count;
    g->time_reps = reps;
    run_job(g);
    g->job = TP_JOB_FORWARD;
    return g->time_ns;
}

int tp_group_set_allreduce(tp_group *g, kn_allreduce kind, ae_error *err) {
    kn_comm *fresh[TP_MAX_RANKS];
    const kn_backend *bes[TP_MAX_RANKS];
    for (int32_t i = 0; i < g->cfg.n_ranks; i++) bes[i] = g->ranks[i].be;
    if (kn_comm_init(g->m->be, kind, fresh, g->cfg.n_ranks, bes, (size_t)g->cfg.max_tokens * (size_t)g->m->cfg.hidden,
                     err) != AE_OK)
        return AE_ERR;
    for (int32_t i = 0; i < g->cfg.n_ranks; i++) kn_stream_sync(g->ranks[i].stream);
    kn_comm_free(g->comms, g->cfg.n_ranks);
    memcpy(g->comms, fresh, (size_t)g->cfg.n_ranks * sizeof *fresh);
    g->cfg.allreduce = kind;
    return AE_OK;
}

void tp_group_free(tp_group *g) {
    if (!g) return;
    if (g->sync_ready) {
        pthread_mutex_lock(&g->mu);
        g->quit = true;
        pthread_cond_broadcast(&g->wake);
        pthread_mutex_unlock(&g->mu);
        for (int32_t i = 0; i < g->cfg.n_ranks; i++)
            if (g->ranks[i].started) pthread_join(g->ranks[i].thread, NULL);
        pthread_cond_destroy(&g->done);
        pthread_cond_destroy(&g->wake);
        pthread_mutex_destroy(&g->mu);
    }
    kn_event_free(&g->start);
    for (int32_t i = 0; i < g->cfg.n_ranks; i++) {
        tp_rank *r = &g->ranks[i];
        kn_event_free(&r->done);
        forward_ws_free(r->ws);
        kn_stream_free(r->stream);
        pool_free(r->pool);
        free(r->kv);
        kn_buf_free(&r->kv_mem);
        tp_shard_free(r->shard);
        for (int32_t k = 0; k < r->n_wbufs; k++) kn_buf_free(&r->wbufs[k]);
        free(r->wbufs);
    }
    kn_comm_free(g->comms, g->cfg.n_ranks);
    free(g);
}

/* Rank r's KV pools: K and V of every layer in one allocation. */
static int rank_kv_init(tp_rank *r, const tp_config *cfg, ae_error *err) {
    const model_config *c = &r->shard->cfg;
    size_t per = (size_t)cfg->kv_blocks * (size_t)cfg->block_size;
    size_t row = (size_t)c->n_kv_heads * (size_t)c->head_dim;
    const bool latent = c->kv_lora_rank > 0; /* keys only */
    size_t layers2 = (latent ? 1 : 2) * (size_t)c->n_layers;
    if (per / (size_t)cfg->block_size != (size_t)cfg->kv_blocks || (row && per > SIZE_MAX / row) ||
        per * row > SIZE_MAX / sizeof(uint16_t) / layers2)
        return err_set(err, "tensor parallel: KV of %d blocks x %d tokens overflows", cfg->kv_blocks, cfg->block_size);
    size_t n = per * row; /* elements of one layer's K (or V) */
    r->kv = calloc((size_t)c->n_layers, sizeof *r->kv);
    if (!r->kv) return err_set(err, "tensor parallel: rank %d: out of memory for its KV pools", r->rank);
    if (cfg->kv) { /* the caller's: they must fit the shard */
        for (int32_t l = 0; l < c->n_layers; l++) {
            const kn_kv_pool *p = &cfg->kv[(size_t)r->rank * (size_t)c->n_layers + (size_t)l];
            if (p->n_kv_heads != c->n_kv_heads || p->head_dim != c->head_dim || p->n_blocks != cfg->kv_blocks ||
                p->block_size != cfg->block_size)
                return err_set(err,
                               "tensor parallel: rank %d layer %d: a KV pool of %d kv heads x %d, %d blocks "
                               "of %d, for a shard of %d kv heads x %d, %d blocks of %d",
                               r->rank, l, p->n_kv_heads, p->head_dim, p->n_blocks, p->block_size, c->n_kv_heads,
                               c->head_dim, cfg->kv_blocks, cfg->block_size);
            r->kv[l] = *p;
        }
        return AE_OK;
    }
    if (kn_buf_alloc(r->shard->be, &r->kv_mem, n * layers2 * sizeof(uint16_t), err) != AE_OK)
        return err_prefix(err, "tensor parallel: rank %d's KV: ", r->rank), AE_ERR;
    uint16_t *k0 = r->kv_mem.ptr;
    for (int32_t l = 0; l < c->n_layers; l++)
        r->kv[l] = (kn_kv_pool){.k = k0 + (size_t)(latent ? l : 2 * l) * n,
                                .v = latent ? NULL : k0 + (size_t)(2 * l + 1) * n,
                                .buf = &r->kv_mem,
                                .n_blocks = cfg->kv_blocks,
                                .block_size = cfg->block_size,
                                .n_kv_heads = c->n_kv_heads,
                                .head_dim = c->head_dim,
                                .type = GGML_TYPE_F16};
    return AE_OK;
}

/* *w (a view of the model's weight, in buffers of `from`'s backend) copied
 * into a buffer of be, its rows packed to the view's columns: downloaded
 * on `from`, packed on the host, written into be. */
static int weight_copy(kn_weight *w, kn_stream *from, const kn_backend *be, kn_buf *out, uint64_t *bytes,
                       ae_error *err) {
    AE_ASSERT(w->buf && w->rows > 0);
    size_t rb = quant_row_bytes(w->type, (uint64_t)w->cols), rows = (size_t)w->rows;
    size_t span = (rows - 1) * w->row_bytes + rb;
    uint8_t *tmp = malloc(span), *packed = malloc(rows * rb);
    if (!tmp || !packed) {
        free(tmp);
        free(packed);
        return err_set(err, "tensor parallel: out of host memory copying a %zu-byte weight", span);
    }
    kn_download(from, tmp, w->buf, (size_t)((const uint8_t *)w->data - (const uint8_t *)w->buf->ptr), span);
    kn_stream_sync(from);
    for (size_t i = 0; i < rows; i++) memcpy(packed + i * rb, tmp + i * w->row_bytes, rb);
    free(tmp);
    int rc = kn_buf_from_host(be, out, packed, rows * rb, err);
    free(packed);
    if (rc != AE_OK) return AE_ERR;
    w->data = out->ptr;
    w->row_bytes = rb;
    w->buf = out;
    w->packed = NULL;
    w->packed_buf = NULL;
    *bytes += rows * rb;
    return AE_OK;
}

static uint64_t weight_bytes(const kn_weight *w) {
    return (uint64_t)w->rows * quant_row_bytes(w->type, (uint64_t)w->cols);
}

/* Whether the tensor-parallel copy of a rank on another backend holds t
 * of layer l: the table's matrices the layer has. */
static bool copied(const model *sh, const model_layer *l, const arch_tensor *t) {
    return t->held == ARCH_MAT && arch_layer_has(&sh->cfg, l, t);
}

uint64_t tp_rank_copy_bytes(const model *sh, int32_t rank) {
    uint64_t b = weight_bytes(&sh->tok_embd);
    for (int32_t l = 0; l < sh->cfg.n_layers; l++)
        for (size_t k = 0; k < sh->arch->n_tensors; k++)
            if (copied(sh, &sh->layers[l], &sh->arch->tensors[k]))
                b += weight_bytes(arch_field_const(&sh->layers[l], &sh->arch->tensors[k]));
    if (rank == 0 && sh->output.data != sh->tok_embd.data) b += weight_bytes(&sh->output);
    return b;
}

/* Rank r's shard's matrices (and the embedding table, and for rank 0 the
 * output projection) copied into its backend's memory. */
static int rank_copy_weights(tp_rank *r, const model *m, ae_error *err) {
    model *sh = r->shard;
    const int32_t L = sh->cfg.n_layers;
    size_t n = 2;
    for (int32_t l = 0; l < L; l++) { /* what a GPU of its own reads: only these blocks' matrices so far */
        if (sh->layers[l].attn != MODEL_ATTN_GQA || sh->layers[l].ffn != MODEL_FFN_DENSE)
            return err_set(err, "tensor parallel: rank %d: a rank on a GPU of its own runs GQA and dense layers only",
                           r->rank);
        for (size_t k = 0; k < sh->arch->n_tensors; k++) n += copied(sh, &sh->layers[l], &sh->arch->tensors[k]);
    }
    r->wbufs = calloc(n, sizeof *r->wbufs);
    if (!r->wbufs) return err_set(err, "tensor parallel: out of memory");
    kn_stream *from = NULL;
    if (kn_stream_init(&from, m->be, &(kn_stream_config){NULL, 0}, err) != AE_OK) return AE_ERR;
    int rc = AE_OK;
    for (int32_t l = 0; l < L && rc == AE_OK; l++)
        for (size_t k = 0; k < sh->arch->n_tensors && rc == AE_OK; k++)
            if (copied(sh, &sh->layers[l], &sh->arch->tensors[k]))
                rc = weight_copy(arch_field(&sh->layers[l], &sh->arch->tensors[k]), from, r->be,
                                 &r->wbufs[r->n_wbufs++], &r->copied, err);
    bool tied = sh->output.data == sh->tok_embd.data;
    if (rc == AE_OK) rc = weight_copy(&sh->tok_embd, from, r->be, &r->wbufs[r->n_wbufs++], &r->copied, err);
    if (rc == AE_OK && r->rank == 0) {
        if (tied)
            sh->output = sh->tok_embd;
        else
            rc = weight_copy(&sh->output, from, r->be, &r->wbufs[r->n_wbufs++], &r->copied, err);
    }
    kn_stream_free(from);
    AE_ASSERT(rc != AE_OK || r->copied == tp_rank_copy_bytes(sh, r->rank));
    if (rc != AE_OK)
        err_prefix(err, "tensor parallel: rank %d's weights on backend %s: ", r->rank, kn_backend_name(r->be));
    return rc;
}

int tp_group_init(tp_group **out, const model *m, const tp_config *cfg, ae_error *err) {
    *out = NULL;
    if (cfg->n_ranks < 1 || cfg->n_ranks > TP_MAX_RANKS || cfg->threads_per_rank < 1 || cfg->max_tokens < 1 ||
        cfg->max_logits < 1 || cfg->max_logits > cfg->max_tokens || cfg->kv_blocks < 1 || cfg->block_size < 1 ||
        (cfg->act_bits != 0 && cfg->act_bits != 8 && cfg->act_bits != 15))
        return err_set(err,
                       "tensor parallel: bad sizes (ranks %d, threads per rank %d, tokens %d, logits %d, "
                       "kv blocks %d, block size %d, activation bits %d)",
                       cfg->n_ranks, cfg->threads_per_rank, cfg->max_tokens, cfg->max_logits, cfg->kv_blocks,
                       cfg->block_size, cfg->act_bits);
    tp_group *g = calloc(1, sizeof *g);
    if (!g) return err_set(err, "out of memory");
    g->m = m;
    g->cfg = *cfg;
    const int32_t R = cfg->n_ranks;
    if (g->cfg.allreduce == KN_ALLREDUCE_AUTO)
        g->cfg.allreduce = kn_backend_host_memory(m->be) ? KN_ALLREDUCE_CPU : KN_ALLREDUCE_CUSTOM;
    for (int32_t i = 0; i < R; i++) {
        const kn_backend *b = cfg->rank_be ? cfg->rank_be[i] : m->be;
        g->ranks[i].be = b;
        if (b != m->be && (!kn_backend_reads(b, m->be) || !kn_backend_reads(m->be, b))) {
            err_set(err,
                    "tensor parallel: rank %d's backend cannot reach the model's memory, or the model's its "
                    "(ranks on several GPUs need peer access between them)",
                    i);
            goto fail;
        }
    }
    g->cfg.rank_be = NULL; /* the caller's array need not outlive the call */
    if (m->arch->tp_split(&g->split, &m->cfg, R, err) != AE_OK) goto fail;
    {
        const kn_backend *bes[TP_MAX_RANKS];
        for (int32_t i = 0; i < R; i++) bes[i] = g->ranks[i].be;
        if (kn_comm_init(m->be, g->cfg.allreduce, g->comms, R, bes, (size_t)cfg->max_tokens * (size_t)m->cfg.hidden,
                         err) != AE_OK)
            goto fail;
    }
    for (int32_t i = 0; i < R; i++) {
        tp_rank *r = &g->ranks[i];
        r->g = g;
        r->rank = i;
        if (tp_shard_init(&r->shard, m, &g->split, i, err) != AE_OK) goto fail;
        r->shard->be = r->be;
        if (r->be != m->be && rank_copy_weights(r, m, err) != AE_OK) goto fail;
        if (pool_init(&r->pool, cfg->threads_per_rank, err) != AE_OK ||
            kn_stream_init(
                &r->stream, r->be,
                &(kn_stream_config){r->pool, forward_stream_workspace(r->shard, cfg->max_tokens, cfg->max_seq_len)},
                err) != AE_OK ||
            forward_ws_init(&r->ws, r->shard, cfg->max_tokens, i == 0 ? cfg->max_logits : 1, err) != AE_OK ||
            rank_kv_init(r, cfg, err) != AE_OK)
            goto fail;
        /* One precision for all ranks: their partial sums are added. */
        if (cfg->act_bits) kn_stream_set_act_bits(r->stream, cfg->act_bits);
    }
    if (pthread_mutex_init(&g->mu, NULL) != 0) {
        err_set(err, "tensor parallel: cannot create a mutex");
        goto fail;
    }
    if (pthread_cond_init(&g->wake, NULL) != 0) {
        pthread_mutex_destroy(&g->mu);
        err_set(err, "tensor parallel: cannot create a condition variable");
        goto fail;
    }
    if (pthread_cond_init(&g->done, NULL) != 0) {
        pthread_cond_destroy(&g->wake);
        pthread_mutex_destroy(&g->mu);
        err_set(err, "tensor parallel: cannot create a condition variable");
        goto fail;
    }
    g->sync_ready = true;
    for (int32_t i = 1; i < R; i++) {
        if (pthread_create(&g->ranks[i].thread, NULL, rank_main, &g->ranks[i]) != 0) {
            err_set(err, "tensor parallel: cannot start the thread of rank %d", i);
            goto fail;
        }
        g->ranks[i].started = true;
    }
    *out = g;
    return AE_OK;
fail:
    tp_group_free(g);
    return AE_ERR;
}
