#include "engine.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../services/core/log.h"
#include "../services/kv/kv.h"
#include "arch.h"
#include "tp.h"

/* A step's inputs: arrays the engine fills on the host, then uploads to
 * fixed places in one buffer of the backend (e->in), which is all the
 * forward pass reads. Their addresses never change, so a step captured
 * once (a CUDA graph) replays with new contents. [max_batch_tokens]
 * each, but IN_EXTRA: [max_batch_tokens * ENGINE_MAX_TREE]. */
enum {
    IN_TOKENS,
    IN_POS,
    IN_SEQ,
    IN_SLOT,
    IN_N_PREFIX,
    IN_EXTRA_START,
    IN_N_EXTRA,
    IN_LOGIT_ROWS,
    IN_CAP_ROWS,
    IN_EXTRA,
    IN_N
};

/* A captured step, by its shape (engine.h, CUDA graphs). */
typedef struct engine_graph {
    int32_t T, n_logits, n_cap, n_cap_layers, keys;
    int32_t cap_layers[FORWARD_MAX_CAPTURE];
    int ids_by;  /* 0: logits only, 1: each row's argmax, 2: each row's draw (kn_sample) */
    kn_graph *g; /* NULL: a free entry */
    uint64_t last_use;
} engine_graph;

struct engine {
    const model *m;
    engine_config cfg;
    pool *pool;
    kn_stream *stream;
    forward_ws *ws;
    kv_cache *kv;
    kn_kv_pool *layers;  /* [n_layers] */
    int32_t *host[IN_N]; /* the step's inputs as filled, in one allocation (host[0]) */
    int32_t *dev[IN_N];  /* the same in e->in, at the backend's addresses */
    size_t in_len[IN_N]; /* elements of each */
    kn_buf in;
    /* Where the forward pass writes logits and captured features on a
     * backend whose memory is not the host's: [max_batch_tokens][vocab],
     * then [max_batch_tokens][FORWARD_MAX_CAPTURE * hidden]; downloaded
     * into the caller's arrays. A host-memory backend writes those arrays
     * directly (no buffer). */
    kn_buf out;
    kn_buf ids;   /* [max_batch_tokens] int32: engine_step's ids, on such a backend */
    kn_buf draws; /* [max_batch_tokens] kn_draw: engine_step's draws, on a backend with kn_sample */
    /* the host arrays above by name */
    int32_t *pos, *seq, *slot, *n_prefix, *extra_start, *n_extra, *tokens, *logit_rows, *cap_rows, *extra;
    int32_t *old_cap; /* per item: KV capacity before this step reserved */
    int32_t *depth;   /* [ENGINE_MAX_TREE] */
    /* The last tree of each sequence, to check a committed path against:
     * parents [max_seqs][ENGINE_MAX_TREE], node count [max_seqs] (0: none). */
    int32_t *tree_parents;
    int32_t *tree_n;
    tp_group *tp;            /* engine_set_tp's ranks, or NULL: one rank */
    char allreduce_why[256]; /* engine_allreduce_why */
    engine_comm_stats comm;
    bool comm_pending;     /* a ranks' pass queued: its counts are read after the step's sync */
    kn_comm_stats comm_at; /* the counts before it */
    int32_t graphs_wanted; /* engine_set_graphs' max_graphs and budget, kept while ranks hold graphs off */
    uint64_t graphs_budget;
    engine_graph *graphs; /* [graph_stats.max_graphs] */
    engine_graph_stats graph_stats;
    uint64_t graph_clock; /* steps replayed or captured, for least-recently-used */
    int64_t drawn_steps;  /* engine_step's with draws */
};

/* Elements of each input for T tokens. */
static size_t input_len(int i, size_t T) { return i == IN_EXTRA ? T * ENGINE_MAX_TREE : T; }

size_t engine_input_bytes(int32_t max_batch_tokens) {
    size_t n = 0;
    for (int i = 0; i < IN_N; i++) n += input_len(i, (size_t)max_batch_tokens);
    return 2 * n * sizeof(int32_t) + (size_t)max_batch_tokens * sizeof(kn_draw); /* and a device's draws */
}

const model *engine_model(const engine *e) { return e->m; }
const engine_config *engine_get_config(const engine *e) { return &e->cfg; }
pool *engine_pool(engine *e) { return e->pool; }
kv_stats engine_kv_stats(const engine *e) { return kv_get_stats(e->kv); }

static void graphs_drop(engine *e) {
    for (int32_t i = 0; i < e->graph_stats.max_graphs; i++) kn_graph_free(e->graphs[i].g);
    free(e->graphs);
    e->graphs = NULL;
    e->graph_stats.max_graphs = e->graph_stats.kept_max = e->graph_stats.live = 0;
    e->graph_stats.bytes = 0;
}

void engine_set_graphs(engine *e, int32_t max_graphs, uint64_t budget) {
    graphs_drop(e);
    e->graphs_wanted = max_graphs;
    e->graphs_budget = budget;
    if (max_graphs <= 0 || kn_backend_host_memory(e->m->be) || !kn_backend_has_graphs(e->m->be)) return;
    if (!(e->graphs = calloc((size_t)max_graphs, sizeof *e->graphs))) {
        LOG_WARNF("graphs off: out of host memory for %d of them", max_graphs);
        return;
    }
    e->graph_stats.max_graphs = e->graph_stats.kept_max = max_graphs;
    e->graph_stats.budget = budget;
}

/* Frees graph g (a live one). */
static void graph_evict(engine *e, engine_graph *g) {
    engine_graph_stats *gs = &e->graph_stats;
    gs->bytes -= kn_graph_bytes(g->g);
    gs->live--;
    gs->evictions++;
    kn_graph_free(g->g);
    g->g = NULL;
}

/* The live graph used least recently, other than keep; NULL if none. */
static engine_graph *graph_lru(engine *e, const engine_graph *keep) {
    engine_graph *lru = NULL;
    for (int32_t i = 0; i < e->graph_stats.max_graphs; i++) {
        engine_graph *g = &e->graphs[i];
        if (g->g && g != keep && (!lru || g->last_use < lru->last_use)) lru = g;
    }
    return lru;
}

engine_graph_stats engine_get_graph_stats(const engine *e) { return e->graph_stats; }

int engine_set_fast(engine *e, bool fast, ae_error *err) {
    if (kn_stream_set_fast(e->stream, fast, err) != AE_OK) return AE_ERR;
    return e->tp ? tp_group_set_fast(e->tp, fast, err) : AE_OK;
}
bool engine_fast(const engine *e) { return kn_stream_fast(e->stream); }

void engine_free(engine *e) {
    if (!e) return;
    graphs_drop(e);
    tp_group_free(e->tp);
    forward_ws_free(e->ws);
    kn_stream_free(e->stream);
    pool_free(e->pool);
    kv_free(e->kv);
    kn_buf_free(&e->in);
    kn_buf_free(&e->out);
    kn_buf_free(&e->ids);
    kn_buf_free(&e->draws);
    free(e->layers);
    free(e->host[0]);
    free(e->old_cap);
    free(e->depth);
    free(e->tree_parents);
    free(e->tree_n);
    free(e);
}

int engine_init(engine **out, const model *m, const engine_config *cfg, ae_error *err) {
    *out = NULL;
    const model_config *c = &m->cfg;
    if (cfg->max_batch_tokens < 1 || cfg->max_seqs < 1 || cfg->max_seq_len < 1 || cfg->block_size < 1 ||
        cfg->kv_tokens < cfg->max_seq_len)
        return err_set(err, "engine: bad sizes (batch %d, seqs %d, seq len %d, kv tokens %d, block %d)",
                       cfg->max_batch_tokens, cfg->max_seqs, cfg->max_seq_len, cfg->kv_tokens, cfg->block_size);
    if (cfg->act_bits != 0 && cfg->act_bits != 8 && cfg->act_bits != 15)
        return err_set(err, "engine: activation bits must be 8 or 15, got %d", cfg->act_bits);
    engine *e = calloc(1, sizeof *e);
    if (!e) return err_set(err, "out of memory");
    e->m = m;
    e->cfg = *cfg;
    size_t T = (size_t)cfg->max_batch_tokens;
    kv_params kp = {c->n_layers,
                    c->n_kv_heads,
                    c->head_dim,
                    cfg->block_size,
                    (cfg->kv_tokens + cfg->block_size - 1) / cfg->block_size,
                    cfg->max_seqs,
                    (cfg->max_seq_len + cfg->block_size - 1) / cfg->block_size,
                    c->kv_lora_rank > 0};
    if (pool_init(&e->pool, cfg->threads, err) != AE_OK ||
        kn_stream_init(
            &e->stream, m->be,
            &(kn_stream_config){e->pool, forward_stream_workspace(m, cfg->max_batch_tokens, cfg->max_seq_len)},
            err) != AE_OK ||
        forward_ws_init(&e->ws, m, cfg->max_batch_tokens, cfg->max_batch_tokens, err) != AE_OK ||
        kv_init(&e->kv, m->be, &kp, err) != AE_OK)
        goto fail;
    if (cfg->act_bits) kn_stream_set_act_bits(e->stream, cfg->act_bits);
    e->cfg.act_bits = kn_stream_act_bits(e->stream);
    size_t in_total = 0;
    for (int i = 0; i < IN_N; i++) in_total += e->in_len[i] = input_len(i, T);
    if (kn_buf_alloc(m->be, &e->in, in_total * sizeof(int32_t), err) != AE_OK) goto fail;
    if (!kn_backend_host_memory(m->be) &&
        (kn_buf_alloc(m->be, &e->out, T * ((size_t)c->vocab + FORWARD_MAX_CAPTURE * (size_t)c->hidden) * sizeof(float),
                      err) != AE_OK ||
         kn_buf_alloc(m->be, &e->ids, T * sizeof(int32_t), err) != AE_OK ||
         (kn_backend_has_sample(m->be) && kn_buf_alloc(m->be, &e->draws, T * sizeof(kn_draw), err) != AE_OK)))
        goto fail;
    if (!(e->host[0] = calloc(in_total, sizeof(int32_t)))) goto oom;
    e->dev[0] = e->in.ptr;
    for (int i = 1; i < IN_N; i++) {
        e->host[i] = e->host[i - 1] + e->in_len[i - 1];
        e->dev[i] = e->dev[i - 1] + e->in_len[i - 1];
    }
    e->tokens = e->host[IN_TOKENS], e->pos = e->host[IN_POS], e->seq = e->host[IN_SEQ];
    e->slot = e->host[IN_SLOT], e->n_prefix = e->host[IN_N_PREFIX], e->extra_start = e->host[IN_EXTRA_START];
    e->n_extra = e->host[IN_N_EXTRA], e->logit_rows = e->host[IN_LOGIT_ROWS], e->cap_rows = e->host[IN_CAP_ROWS];
    e->extra = e->host[IN_EXTRA];
    e->layers = calloc((size_t)c->n_layers, sizeof *e->layers);
    e->old_cap = calloc(T, sizeof(int32_t));
    e->depth = calloc(ENGINE_MAX_TREE, sizeof(int32_t));
    e->tree_parents = calloc((size_t)cfg->max_seqs * ENGINE_MAX_TREE, sizeof(int32_t));
    e->tree_n = calloc((size_t)cfg->max_seqs, sizeof(int32_t));
    if (!e->layers || !e->old_cap || !e->depth || !e->tree_parents || !e->tree_n) goto oom;
    for (int32_t l = 0; l < c->n_layers; l++) e->layers[l] = kv_layer(e->kv, l);
    *out = e;
    return AE_OK;
oom:
    err_set(err, "engine: out of memory");
fail:
    engine_free(e);
    return AE_ERR;
}

int32_t engine_tp(const engine *e) { return e->tp ? tp_group_ranks(e->tp) : 1; }
const model *engine_tp_shard(const engine *e, int32_t r) { return e->tp ? tp_group_shard(e->tp, r) : e->m; }
engine_comm_stats engine_get_comm_stats(const engine *e) { return e->comm; }
const kn_backend *engine_tp_backend(const engine *e, int32_t r) {
    return e->tp ? tp_group_backend(e->tp, r) : e->m->be;
}
uint64_t engine_tp_copied_bytes(const engine *e, int32_t r) { return e->tp ? tp_group_copied_bytes(e->tp, r) : 0; }
kn_allreduce engine_allreduce(const engine *e) { return e->tp ? tp_group_allreduce(e->tp) : KN_ALLREDUCE_CPU; }
const char *engine_allreduce_why(const engine *e) { return e->allreduce_why; }

/* AUTO on a backend with a device of its own: each kind's time for a
 * decode and a verify pass's message, the faster sum kept. The group
 * starts as custom. */
static void allreduce_choose(engine *e) {
    const size_t H = (size_t)e->m->cfg.hidden,
                 V = (e->cfg.max_batch_tokens < 8 ? (size_t)e->cfg.max_batch_tokens : 8) * H;
    double custom[2] = {tp_group_time_allreduce(e->tp, H, ENGINE_ALLREDUCE_REPS),
                        tp_group_time_allreduce(e->tp, V, ENGINE_ALLREDUCE_REPS)};
    ae_error why = {{0}};
    if (tp_group_set_allreduce(e->tp, KN_ALLREDUCE_NCCL, &why) != AE_OK) {
        snprintf(e->allreduce_why, sizeof e->allreduce_why,
                 "custom: %.1f + %.1f us for 1 + 8 tokens; nccl not measured (%.150s)", custom[0] / 1e3,
                 custom[1] / 1e3, why.msg);
        return;
    }
    double nccl[2] = {tp_group_time_allreduce(e->tp, H, ENGINE_ALLREDUCE_REPS),
                      tp_group_time_allreduce(e->tp, V, ENGINE_ALLREDUCE_REPS)};
    bool keep_nccl = nccl[0] + nccl[1] <= custom[0] + custom[1];
    if (!keep_nccl && tp_group_set_allreduce(e->tp, KN_ALLREDUCE_CUSTOM, &why) != AE_OK) keep_nccl = true;
    snprintf(e->allreduce_why, sizeof e->allreduce_why,
             "%s: us a call for 1 + 8 tokens, custom %.1f + %.1f, nccl %.1f + %.1f (%d calls each)",
             keep_nccl ? "nccl" : "custom", custom[0] / 1e3, custom[1] / 1e3, nccl[0] / 1e3, nccl[1] / 1e3,
             ENGINE_ALLREDUCE_REPS);
}

/* e->kv made anew with the sizes kp, in n shards of heads[] kv heads, and
 * e->layers from it (one shard); false with err set and e->kv NULL (and
 * e->layers zeroed) if it cannot be. */
static bool kv_remake(engine *e, const kv_params *kp, int32_t n, const int32_t *heads,
                      const kn_backend *const *shard_be, ae_error *err) {
    kv_free(e->kv);
    e->kv = NULL;
    memset(e->layers, 0, (size_t)e->m->cfg.n_layers * sizeof *e->layers);
    if (kv_init_sharded(&e->kv, e->m->be, kp, n, heads, shard_be, err) != AE_OK) return false;
    if (n == 1)
        for (int32_t l = 0; l < e->m->cfg.n_layers; l++) e->layers[l] = kv_layer(e->kv, l);
    return true;
}

/* The ranks, for n_ranks > 1, over a KV cache already sharded for them. */
static int tp_make(engine *e, int32_t n_ranks, kn_allreduce allreduce, const kn_backend *const *rank_be,
                   ae_error *err) {
    const model_config *c = &e->m->cfg;
    kn_kv_pool *pools = calloc((size_t)n_ranks * (size_t)c->n_layers, sizeof *pools);
    if (!pools) return err_set(err, "tensor parallel: out of memory");
    for (int32_t r = 0; r < n_ranks; r++)
        for (int32_t l = 0; l < c->n_layers; l++)
            pools[(size_t)r * (size_t)c->n_layers + (size_t)l] = kv_shard_layer(e->kv, r, l);
    const kv_params *kp = kv_get_params(e->kv);
    tp_config tc = {.n_ranks = n_ranks,
                    .threads_per_rank = e->cfg.threads / n_ranks > 1 ? e->cfg.threads / n_ranks : 1,
                    .max_tokens = e->cfg.max_batch_tokens,
                    .max_logits = e->cfg.max_batch_tokens,
                    .kv_blocks = kp->n_blocks,
                    .block_size = kp->block_size,
                    .act_bits = e->cfg.act_bits,
                    .max_seq_len = e->cfg.max_seq_len,
                    .kv = pools,
                    .allreduce = allreduce,
                    .rank_be = rank_be};
    int rc = tp_group_init(&e->tp, e->m, &tc, err);
    free(pools);
    if (rc == AE_OK && kn_stream_fast(e->stream)) rc = tp_group_set_fast(e->tp, true, err);
    if (rc == AE_OK && allreduce == KN_ALLREDUCE_AUTO && !kn_backend_host_memory(e->m->be)) allreduce_choose(e);
    return rc;
}

int engine_set_tp(engine *e, int32_t n_ranks, kn_allreduce allreduce, const kn_backend *const *rank_be, ae_error *err) {
    const model_config *c = &e->m->cfg;
    if (n_ranks < 1 || n_ranks > TP_MAX_RANKS)
        return err_set(err, "tensor parallel: %d ranks (1 to %d)", n_ranks, TP_MAX_RANKS);
    const bool host = kn_backend_host_memory(e->m->be);
    if (allreduce != KN_ALLREDUCE_AUTO && allreduce != KN_ALLREDUCE_CPU && host)
        return err_set(err,
                       "tensor parallel: --allreduce %s is for ranks on a GPU; the %s backend's ranks reduce "
                       "with cpu",
                       kn_allreduce_name(allreduce), kn_backend_name(e->m->be));
    if (allreduce == KN_ALLREDUCE_CPU && !host)
        return err_set(err,
                       "tensor parallel: --allreduce cpu is for ranks on the CPU; the %s backend's ranks "
                       "reduce with nccl or custom",
                       kn_backend_name(e->m->be));
    bool same_be = true;
    for (int32_t r = 0; r < n_ranks && r < engine_tp(e); r++)
        same_be = same_be && (rank_be ? rank_be[r] : e->m->be) == engine_tp_backend(e, r);
    if (n_ranks == engine_tp(e) && same_be &&
        (n_ranks == 1 || allreduce == KN_ALLREDUCE_AUTO || allreduce == engine_allreduce(e)))
        return AE_OK;
    for (int32_t r = 0; r < n_ranks && rank_be; r++)
        if (rank_be[r] != e->m->be &&
            (!kn_backend_reads(rank_be[r], e->m->be) || !kn_backend_reads(e->m->be, rank_be[r])))
            return err_set(err,
                           "tensor parallel: rank %d's device cannot reach the engine's memory, or the engine's "
                           "its (ranks on several GPUs need peer access between them)",
                           r);
    if (!e->kv || kv_get_stats(e->kv).seqs_live > 0)
        return err_set(err, "tensor parallel: ranks are set before any sequence");
    tp_split sp;
    int32_t heads[TP_MAX_RANKS] = {c->n_kv_heads};
    if (n_ranks > 1) {
        if (e->m->arch->tp_split(&sp, c, n_ranks, err) != AE_OK) return AE_ERR;
        for (int32_t r = 0; r < n_ranks; r++) heads[r] = sp.kv_heads[r].end - sp.kv_heads[r].begin;
    }
    const kv_params kp = *kv_get_params(e->kv);
    tp_group_free(e->tp);
    e->tp = NULL;
    e->allreduce_why[0] = '\0';
    e->comm = (engine_comm_stats){{0, 0, 0}, {0, 0, 0}, 0, 0}; /* the new ranks' counts from zero */
    e->comm_pending = false;
    /* Graphs hold one rank's passes: made again, for one rank, as steps come. */
    const int32_t max_graphs = e->graphs_wanted;
    const uint64_t budget = e->graphs_budget;
    graphs_drop(e);
    bool ok = kv_remake(e, &kp, n_ranks, heads, n_ranks > 1 ? rank_be : NULL, err) &&
              (n_ranks == 1 || tp_make(e, n_ranks, allreduce, rank_be, err) == AE_OK);
    if (!e->tp) engine_set_graphs(e, max_graphs, budget);
    if (!ok) { /* one rank, whatever there was before: it needs no more than engine_init had */
        tp_group_free(e->tp);
        e->tp = NULL;
        ae_error again = {{0}};
        int32_t one = c->n_kv_heads;
        if (!kv_remake(e, &kp, 1, &one, NULL, &again)) LOG_ERRORF("engine: the KV cache is lost: %s", again.msg);
    }
    /* The engine's own activations serve one rank only: freed while the
     * ranks (each with its own) run, made again for one. */
    if (e->tp) {
        forward_ws_free(e->ws);
        e->ws = NULL;
    } else if (!e->ws) {
        ae_error again = {{0}};
        if (forward_ws_init(&e->ws, e->m, e->cfg.max_batch_tokens, e->cfg.max_batch_tokens, &again) != AE_OK) {
            if (ok)
                *err = again;
            else
                LOG_ERRORF("engine: one rank's activations are lost: %s", again.msg);
            return AE_ERR;
        }
    }
    return ok ? AE_OK : AE_ERR;
}

int engine_seq_new(engine *e, int32_t *seq, ae_error *err) {
    if (kv_seq_alloc(e->kv, seq, err) != AE_OK) return AE_ERR;
    e->tree_n[*seq] = 0;
    return AE_OK;
}
int engine_seq_fork(engine *e, int32_t src, int32_t *seq, ae_error *err) {
    if (!kv_seq_is_live(e->kv, src)) return err_set(err, "sequence %d is not live", src);
    if (kv_seq_fork(e->kv, e->stream, src, seq, err) != AE_OK) return AE_ERR;
    e->tree_n[*seq] = 0;
    return AE_OK;
}

void engine_seq_free(engine *e, int32_t seq) { kv_seq_free(e->kv, seq); }
int32_t engine_seq_len(const engine *e, int32_t seq) { return kv_seq_len(e->kv, seq); }

int32_t engine_logit_rows(const engine_item *items, int32_t n_items) {
    int32_t n = 0;
    for (int32_t i = 0; i < n_items; i++)
        n += items[i].kind == ENGINE_TREE || items[i].all_logits ? items[i].n_tokens : 1;
    return n;
}

/* Checks every item before anything is written, so a bad one changes
 * nothing. */
static int validate(engine *e, const engine_item *items, int32_t n_items, const forward_capture *cap, ae_error *err) {
    int32_t total = 0;
    for (int32_t i = 0; i < n_items; i++) {
        const engine_item *it = &items[i];
        if (!kv_seq_is_live(e->kv, it->seq)) return err_set(err, "item %d: sequence %d is not live", i, it->seq);
        if (it->n_tokens < 1) return err_set(err, "item %d: no tokens", i);
        if (it->n_tokens > e->cfg.max_batch_tokens - total)
            return err_set(err, "step has more than %d tokens", e->cfg.max_batch_tokens);
        total += it->n_tokens;
        for (int32_t j = 0; j < i; j++)
            if (items[j].seq == it->seq) return err_set(err, "item %d: sequence %d appears twice", i, it->seq);
        int32_t len = kv_seq_len(e->kv, it->seq);
        if (it->n_tokens > e->cfg.max_seq_len - len)
            return err_set(err, "item %d: sequence %d would reach %lld tokens, max-seq-len is %d", i, it->seq,
                           (long long)len + it->n_tokens, e->cfg.max_seq_len);
        for (int32_t t = 0; t < it->n_tokens; t++)
            if (it->tokens[t] < 0 || it->tokens[t] >= e->m->cfg.vocab)
                return err_set(err, "item %d: token %d is not in the vocabulary", i, it->tokens[t]);
        if (it->kind == ENGINE_TREE) {
            if (it->n_tokens > ENGINE_MAX_TREE)
                return err_set(err, "item %d: tree of %d nodes, max %d", i, it->n_tokens, ENGINE_MAX_TREE);
            for (int32_t t = 0; t < it->n_tokens; t++)
                if (it->parents[t] < -1 || it->parents[t] >= t)
                    return err_set(err, "item %d: node %d has parent %d (must be -1 or an earlier node)", i, t,
                                   it->parents[t]);
        }
    }
    if (cap) {
        if (cap->n_layers < 0 || cap->n_layers > FORWARD_MAX_CAPTURE || cap->n_rows < 0 ||
            cap->n_rows > e->cfg.max_batch_tokens)
            return err_set(err, "capture: %d layers of %d rows (at most %d and %d)", cap->n_layers, cap->n_rows,
                           FORWARD_MAX_CAPTURE, e->cfg.max_batch_tokens);
        for (int32_t r = 0; r < cap->n_rows; r++)
            if (cap->rows[r] < 0 || cap->rows[r] >= total)
                return err_set(err, "capture: row %d is %d, the step has %d tokens", r, cap->rows[r], total);
        for (int32_t j = 0; j < cap->n_layers; j++)
            if (cap->layers[j] < 0 || cap->layers[j] > e->m->cfg.n_layers)
                return err_set(err, "capture: layer %d is not in [0, %d]", cap->layers[j], e->m->cfg.n_layers);
    }
    /* Reserve KV room for every item; if one cannot have it, give back
     * what the earlier ones took, so a refused step leaves the pool as it
     * was (len <= capacity, so trimming to the old capacity restores it). */
    for (int32_t i = 0; i < n_items; i++) {
        e->old_cap[i] = kv_seq_capacity(e->kv, items[i].seq);
        if (kv_seq_reserve(e->kv, items[i].seq, kv_seq_len(e->kv, items[i].seq) + items[i].n_tokens, err) != AE_OK) {
            for (int32_t j = 0; j < i; j++) kv_seq_trim(e->kv, items[j].seq, e->old_cap[j]);
            return AE_ERR;
        }
    }
    return AE_OK;
}

/* The ops of a step after its inputs are uploaded, which a graph holds:
 * the forward pass, then, with ids, each logit row's token into ids: its
 * draw by draws (the backend's memory), or else its argmax. */
static void forward(engine *e, const forward_batch *b, int32_t *ids, const kn_draw *draws) {
    if (e->tp) {
        /* The counts before (the last pass is done: its step synced) and,
         * after this step's sync, after (comm_read): reading them now
         * would wait for the ranks' last allreduce. */
        e->comm_at = tp_group_comm_stats(e->tp);
        tp_forward(e->tp, e->stream, b);
        e->comm_pending = true;
        e->comm.last_tokens = b->m;
    } else {
        forward_pass(e->m, e->stream, NULL, e->layers, e->ws, b);
    }
    if (ids && draws)
        kn_sample(e->stream, b->logits, b->n_logits, (int64_t)e->m->cfg.vocab, draws, ids);
    else if (ids)
        kn_argmax(e->stream, b->logits, ids, b->n_logits, (int64_t)e->m->cfg.vocab);
}

/* A ranks' pass's allreduces into e->comm, once its step has synced. */
static void comm_read(engine *e) {
    if (!e->comm_pending) return;
    e->comm_pending = false;
    kn_comm_stats a = e->comm_at, z = tp_group_comm_stats(e->tp);
    e->comm.last = (kn_comm_stats){z.calls - a.calls, z.bytes - a.bytes, z.ns - a.ns};
    e->comm.total = z;
    e->comm.steps++;
}

/* The graph for this step's shape, made room for if new (its g still
 * NULL), or NULL when the step runs op by op. Sets map->max_visible to
 * the graph's bound of keys, and map->n_extra_total to the capacity of
 * the extra slots, so that the graph's values hold for every step it
 * serves. */
static engine_graph *graph_for(engine *e, const engine_item *items, int32_t n_items, kn_kv_map *map, int32_t n_logits,
                               const forward_capture *cap, int ids_by) {
    engine_graph_stats *gs = &e->graph_stats;
    if (gs->max_graphs == 0 || map->m > ENGINE_GRAPH_MAX_TOKENS || e->tp) return NULL;
    /* Decode tokens and trees only: a prompt's chunks come in every size,
     * and would push out the shapes that repeat. */
    for (int32_t i = 0; i < n_items; i++)
        if (items[i].kind == ENGINE_APPEND && items[i].n_tokens > 1) return NULL;
    int32_t capacity = e->cfg.max_seq_len, keys = ENGINE_GRAPH_MIN_KEYS;
    while (keys < map->max_visible && keys < capacity) keys *= 2;
    if (keys > capacity) keys = capacity;
    /* Past KN_ATTN_SPLIT_M tokens attention does not split by keys: one
     * graph for every length (the bound is then the capacity). */
    if (map->m > KN_ATTN_SPLIT_M) keys = capacity;
    engine_graph want = {map->m, n_logits, cap ? cap->n_rows : 0, cap ? cap->n_layers : 0, keys, {0}, ids_by, NULL, 0};
    if (cap) memcpy(want.cap_layers, cap->layers, (size_t)cap->n_layers * sizeof(int32_t));
    map->max_visible = keys;
    map->n_extra_total = (int32_t)e->in_len[IN_EXTRA];
    engine_graph *free_slot = NULL;
    for (int32_t i = 0; i < gs->max_graphs; i++) {
        engine_graph *g = &e->graphs[i];
        if (g->g && g->T == want.T && g->n_logits == want.n_logits && g->n_cap == want.n_cap &&
            g->n_cap_layers == want.n_cap_layers && g->keys == want.keys && g->ids_by == want.ids_by &&
            !memcmp(g->cap_layers, want.cap_layers, sizeof want.cap_layers))
            return g;
        if (!g->g && !free_slot) free_slot = g;
    }
    /* A new shape: a free place while fewer than kept_max are held, else
     * the place of the one used least recently. */
    engine_graph *slot = gs->live < gs->kept_max ? free_slot : NULL;
    if (!slot) {
        slot = graph_lru(e, NULL);
        AE_ASSERT(slot); /* live >= kept_max >= 1 */
        graph_evict(e, slot);
    }
    *slot = want;
    return slot;
}

/* Holds the graphs to the plan's bytes, as measured: while they take
 * more, the least recently used other than gr goes, and fewer are kept
 * from then on (said each time the count falls). false: gr alone takes
 * more (graphs off). */
static bool graphs_within_budget(engine *e, engine_graph *gr) {
    engine_graph_stats *gs = &e->graph_stats;
    if (gs->budget == 0 || gs->bytes <= gs->budget) return true;
    uint64_t took = gs->bytes;
    int32_t had = gs->live;
    engine_graph *g;
    while (gs->bytes > gs->budget && (g = graph_lru(e, gr))) graph_evict(e, g);
    if (gs->bytes > gs->budget) {
        LOG_WARNF("graphs off: one graph took %" PRIu64 " bytes, more than the memory plan's %" PRIu64
                  " for all of them (its estimate per launch is short); steps run op by op",
                  gs->bytes, gs->budget);
        return false;
    }
    if (gs->live < gs->kept_max) {
        LOG_WARNF("graphs: %d took %" PRIu64 " bytes, more than the memory plan's %" PRIu64
                  " (its estimate per launch is short); keeping at most %d",
                  had, took, gs->budget, gs->live);
        gs->kept_max = gs->live;
    }
    return true;
}

/* Replays gr, capturing it first if new; false if the capture failed
 * (graphs are then off, and nothing ran). */
static bool graph_run(engine *e, engine_graph *gr, const forward_batch *b, int32_t *ids, const kn_draw *draws) {
    engine_graph_stats *gs = &e->graph_stats;
    if (!gr->g) {
        ae_error err = {{0}};
        if (kn_graph_begin(e->stream, &err) == AE_OK) {
            forward(e, b, ids, draws);
            if (kn_graph_end(e->stream, &gr->g, &err) != AE_OK) gr->g = NULL;
        }
        if (!gr->g) {
            LOG_WARNF("graphs off: capturing a step of %d tokens failed: %s", b->m, err.msg);
            graphs_drop(e);
            return false;
        }
        gs->captures++;
        gs->live++;
        gs->bytes += kn_graph_bytes(gr->g);
        if (kn_graph_nodes(gr->g) > gs->max_nodes) gs->max_nodes = kn_graph_nodes(gr->g);
        LOG_INFOF("graph captured tokens=%d logit_rows=%d capture_rows=%d keys=%d ids_by=%d nodes=%zu bytes=%zu "
                  "live=%d of %d",
                  gr->T, gr->n_logits, gr->n_cap, gr->keys, gr->ids_by, kn_graph_nodes(gr->g), kn_graph_bytes(gr->g),
                  gs->live, gs->kept_max);
        if (!graphs_within_budget(e, gr)) {
            graphs_drop(e);
            return false;
        }
    } else {
        gs->replays++;
    }
    gr->last_use = ++e->graph_clock;
    kn_graph_launch(e->stream, gr->g);
    return true;
}

/* engine_step: the logit rows; with argmax non-NULL each row's argmax
 * instead, and with draws too each row's draw (engine_outputs). */
static int step(engine *e, const engine_item *items, int32_t n_items, float *logits, int32_t *argmax,
                const kn_draw *draws, const forward_capture *capture, ae_error *err) {
    if (n_items < 1) return err_set(err, "empty step");
    if (draws && !e->draws.ptr)
        return err_set(err, "the %s backend draws no tokens (kn_sample): sample the logits", kn_backend_name(e->m->be));
    if (draws && !argmax) return err_set(err, "a step with draws needs ids for the tokens drawn");
    if (validate(e, items, n_items, capture, err) != AE_OK) return AE_ERR;
    int32_t T = 0, n_logits = 0, n_extra_total = 0;
    for (int32_t i = 0; i < n_items; i++) {
        const engine_item *it = &items[i];
        int32_t len = kv_seq_len(e->kv, it->seq);
        for (int32_t t = 0; t < it->n_tokens; t++, T++) {
            e->tokens[T] = it->tokens[t];
            e->seq[T] = it->seq;
            e->slot[T] = len + t;
            e->extra_start[T] = n_extra_total;
            if (it->kind == ENGINE_APPEND) {
                e->pos[T] = len + t;
                e->n_prefix[T] = len + t + 1;
                e->n_extra[T] = 0;
                if (it->all_logits || t == it->n_tokens - 1) e->logit_rows[n_logits++] = T;
                continue;
            }
            /* Tree node: the committed prefix, then its ancestors root
             * first, then itself, in position order. */
            int32_t p = it->parents[t];
            e->depth[t] = p < 0 ? 0 : e->depth[p] + 1;
            e->pos[T] = len + e->depth[t];
            e->n_prefix[T] = len;
            int32_t d = e->depth[t];
            e->n_extra[T] = d + 1;
            for (int32_t a = t, k = d; a >= 0; a = it->parents[a], k--) e->extra[n_extra_total + k] = len + a;
            n_extra_total += d + 1;
            e->logit_rows[n_logits++] = T;
        }
    }
    /* Upload what this step filled; the forward pass reads only e->in. */
    int32_t n_cap = capture ? capture->n_rows : 0;
    if (n_cap) memcpy(e->cap_rows, capture->rows, (size_t)n_cap * sizeof(int32_t));
    size_t used[IN_N] = {T, T, T, T, T, T, T, n_logits, n_cap, n_extra_total};
    for (int i = 0; i < IN_N; i++)
        kn_upload(e->stream, &e->in, (size_t)((char *)e->dev[i] - (char *)e->in.ptr), e->host[i],
                  used[i] * sizeof(int32_t));
    kv_upload_tables(e->kv, e->stream);
    const int32_t *const *d = (const int32_t *const *)e->dev;
    int32_t max_vis = 0;
    for (int32_t t = 0; t < T; t++)
        if (e->n_prefix[t] + e->n_extra[t] > max_vis) max_vis = e->n_prefix[t] + e->n_extra[t];
    kn_kv_map map = {T,
                     kv_map_tables(e->kv),
                     e->cfg.max_seqs,
                     kv_get_params(e->kv)->max_blocks_per_seq,
                     d[IN_SEQ],
                     d[IN_SLOT],
                     d[IN_N_PREFIX],
                     d[IN_EXTRA_START],
                     d[IN_N_EXTRA],
                     d[IN_EXTRA],
                     n_extra_total,
                     max_vis};
    /* Outputs: the caller's arrays on a host-memory backend, else e->out. */
    const size_t V = (size_t)e->m->cfg.vocab, W = capture ? (size_t)capture->n_layers * (size_t)e->m->cfg.hidden : 0;
    float *out_logits = e->out.ptr ? e->out.ptr : logits;
    forward_capture cap;
    if (capture) {
        cap = *capture;
        cap.rows = d[IN_CAP_ROWS];
        if (e->out.ptr) cap.out = (float *)e->out.ptr + (size_t)e->cfg.max_batch_tokens * V;
    }
    forward_batch b = {T, d[IN_TOKENS], d[IN_POS], &map, n_logits, d[IN_LOGIT_ROWS], out_logits, capture ? &cap : NULL};
    int32_t *ids = argmax ? (e->ids.ptr ? e->ids.ptr : argmax) : NULL;
    const kn_draw *dd = NULL;
    if (draws) { /* at a fixed place, as the other inputs: a graph reads them anew */
        kn_upload(e->stream, &e->draws, 0, draws, (size_t)n_logits * sizeof(kn_draw));
        dd = e->draws.ptr;
        e->drawn_steps++;
    }
    engine_graph *gr = graph_for(e, items, n_items, &map, n_logits, capture, !ids ? 0 : dd ? 2 : 1);
    if (!gr || !graph_run(e, gr, &b, ids, dd)) {
        e->graph_stats.eager_steps++;
        forward(e, &b, ids, dd);
    }
    if (argmax && e->ids.ptr) kn_download(e->stream, argmax, &e->ids, 0, (size_t)n_logits * sizeof(int32_t));
    if (e->out.ptr) {
        if (!argmax) kn_download(e->stream, logits, &e->out, 0, (size_t)n_logits * V * sizeof(float));
        if (capture)
            kn_download(e->stream, capture->out, &e->out, (size_t)e->cfg.max_batch_tokens * V * sizeof(float),
                        (size_t)n_cap * W * sizeof(float));
    }
    kn_stream_sync(e->stream);
    comm_read(e);
    for (int32_t i = 0; i < n_items; i++) {
        const engine_item *it = &items[i];
        if (it->kind == ENGINE_APPEND) {
            AE_ASSERT(kv_seq_advance(e->kv, it->seq, it->n_tokens, NULL) == AE_OK);
            e->tree_n[it->seq] = 0;
        } else {
            memcpy(e->tree_parents + (size_t)it->seq * ENGINE_MAX_TREE, it->parents,
                   (size_t)it->n_tokens * sizeof(int32_t));
            e->tree_n[it->seq] = it->n_tokens;
        }
    }
    return AE_OK;
}

int engine_step(engine *e, const engine_item *items, int32_t n_items, const engine_outputs *out, ae_error *err) {
    return step(e, items, n_items, out->logits, out->ids, out->draws, out->capture, err);
}

bool engine_can_sample(const engine *e) { return e->draws.ptr != NULL; }
int64_t engine_drawn_steps(const engine *e) { return e->drawn_steps; }

int engine_commit_path(engine *e, int32_t seq, const int32_t *path, int32_t n, ae_error *err) {
    if (!kv_seq_is_live(e->kv, seq)) return err_set(err, "sequence %d is not live", seq);
    int32_t tn = e->tree_n[seq];
    if (tn == 0) return err_set(err, "sequence %d has no tree to commit from", seq);
    if (n < 0 || n > tn) return err_set(err, "path of %d nodes, the tree has %d", n, tn);
    /* A root-to-node chain of the last tree, nothing else: a skipped level
     * would put K rotated for one position into another's slot. */
    const int32_t *parents = e->tree_parents + (size_t)seq * ENGINE_MAX_TREE;
    for (int32_t i = 0; i < n; i++) {
        if (path[i] < 0 || path[i] >= tn) return err_set(err, "path[%d] = %d is not a node of the tree", i, path[i]);
        if (parents[path[i]] != (i ? path[i - 1] : -1))
            return err_set(err, "path[%d] = %d is not a child of %s", i, path[i], i ? "the previous node" : "the root");
    }
    int32_t len = kv_seq_len(e->kv, seq);
    int32_t slots[ENGINE_MAX_TREE];
    for (int32_t i = 0; i < n; i++) slots[i] = len + path[i];
    if (kv_commit_path(e->kv, e->stream, seq, slots, n, err) != AE_OK) return AE_ERR;
    kv_seq_trim(e->kv, seq, kv_seq_len(e->kv, seq));
    e->tree_n[seq] = 0;
    return AE_OK;
}
