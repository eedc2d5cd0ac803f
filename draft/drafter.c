#include "drafter.h"

#include <stdlib.h>
#include <string.h>

#include "../services/core/pool.h"
#include "../services/kv/kv_cache.h"

#define KV_BLOCK 16
/* Scratch slots one tree may use: every depth after the first runs its
 * frontier through the head. */
#define TREE_SCRATCH ((TREE_MAX_STEPS - 1) * TREE_MAX_TOPK)

typedef struct key_state {
    int32_t kv_seq;     /* -1: no state */
    int32_t last_token; /* token of the last pair fed: the next tree's root */
    int32_t n_top;      /* children of the root ready (0: nothing fed yet) */
    int32_t top_tokens[TREE_MAX_TOPK];
    float top_probs[TREE_MAX_TOPK];
} key_state;

/* One tree in the making. */
typedef struct tree_job {
    int32_t key;
    int32_t out; /* index into the caller's trees */
    int32_t len; /* the sequence's pairs: slots and positions of the tree start here */
    int32_t n_expanded;
    int32_t first_row; /* this tree's first row in the current pass */
    tree_build b;
    int32_t slot_of[TREE_MAX_POOL]; /* scratch KV slot of each expanded candidate */
    int32_t row_of[TREE_MAX_POOL];  /* its row in the last pass (whose hidden states are kept) */
} tree_job;

struct drafter {
    const eagle_head *head;
    drafter_config cfg;
    int32_t max_rows; /* rows of one head pass */
    pool *pool;     /* the shared pool, or own_pool */
    pool *own_pool;
    kn_stream *stream;
    eagle_ws *ws;
    kv_cache *kv;
    kn_kv_pool layer;
    key_state *keys;    /* [max_seqs] */
    float *last_hidden; /* [max_seqs][H] pre-norm output of each key's last pair */
    tree_job *jobs;     /* [max_seqs] */
    /* one pass, [max_rows] unless noted */
    int32_t *tokens, *pos, *seq, *slot, *n_prefix, *extra_start, *n_extra, *logit_rows;
    int32_t *extra;  /* [max_rows * TREE_MAX_STEPS] */
    float *in;       /* [max_rows][H] fed-back hidden states */
    float *hidden;   /* [max_rows][H] */
    float *logits;   /* [max_rows][draft_vocab] */
};

static int32_t rows_for(const drafter_config *c) {
    int32_t tree_rows = c->max_seqs * TREE_MAX_TOPK;
    return c->max_tokens > tree_rows ? c->max_tokens : tree_rows;
}

static kv_params kv_params_for(const eagle_head *h, const drafter_config *c) {
    int32_t per_seq = (c->max_seq_len + TREE_SCRATCH + KV_BLOCK - 1) / KV_BLOCK;
    return (kv_params){1, h->cfg.n_kv_heads, h->cfg.head_dim, KV_BLOCK, per_seq * c->max_seqs, c->max_seqs, per_seq};
}

size_t drafter_bytes(const eagle_head *h, const drafter_config *c) {
    kv_params kp = kv_params_for(h, c);
    size_t rows = (size_t)rows_for(c), H = (size_t)h->cfg.hidden;
    return (size_t)kv_bytes(&kp) + eagle_ws_bytes(h, (int32_t)rows) +
           eagle_stream_workspace(h, (int32_t)rows, c->max_seq_len + TREE_SCRATCH) +
           (size_t)c->max_seqs * (sizeof(key_state) + sizeof(tree_job) + H * sizeof(float)) +
           rows * (8 + TREE_MAX_STEPS) * sizeof(int32_t) +
           rows * (2 * H + (size_t)h->cfg.draft_vocab) * sizeof(float);
}

void drafter_free(drafter *d) {
    if (!d) return;
    eagle_ws_free(d->ws);
    kn_stream_free(d->stream);
    pool_free(d->own_pool);
    kv_free(d->kv);
    free(d->keys);
    free(d->last_hidden);
    free(d->jobs);
    int32_t *ints[] = {d->tokens, d->pos, d->seq, d->slot, d->n_prefix, d->extra_start, d->n_extra, d->logit_rows,
                       d->extra};
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) free(ints[i]);
    free(d->in);
    free(d->hidden);
    free(d->logits);
    free(d);
}

int drafter_init(drafter **out, const eagle_head *h, const drafter_config *cfg, ae_error *err) {
    *out = NULL;
    if (cfg->max_seqs < 1 || cfg->max_seq_len < 1 || cfg->max_seq_len > INT32_MAX / 2 || cfg->max_tokens < 1 ||
        (!cfg->pool && cfg->threads < 1))
        return err_set(err, "drafter: bad sizes (seqs %d, seq len %d, tokens %d, threads %d)", cfg->max_seqs,
                       cfg->max_seq_len, cfg->max_tokens, cfg->threads);
    if (cfg->act_bits != 0 && cfg->act_bits != 8 && cfg->act_bits != 15)
        return err_set(err, "drafter: activation bits must be 8 or 15, got %d", cfg->act_bits);
    drafter *d = calloc(1, sizeof *d);
    if (!d) return err_set(err, "out of memory");
    d->head = h;
    d->cfg = *cfg;
    d->max_rows = rows_for(cfg);
    size_t R = (size_t)d->max_rows, H = (size_t)h->cfg.hidden;
    kv_params kp = kv_params_for(h, cfg);
    d->pool = cfg->pool;
    if ((!d->pool && pool_init(&d->own_pool, cfg->threads, err) != AE_OK) ||
        kn_stream_init(&d->stream, &kn_backend_cpu, &(kn_stream_config){d->pool ? d->pool : d->own_pool, eagle_stream_workspace(h, d->max_rows, cfg->max_seq_len + TREE_SCRATCH)}, err) != AE_OK ||
        eagle_ws_init(&d->ws, h, d->max_rows, err) != AE_OK || kv_init(&d->kv, &kn_backend_cpu, &kp, err) != AE_OK)
        goto fail;
    if (cfg->act_bits) kn_stream_set_act_bits(d->stream, cfg->act_bits);
    d->layer = kv_layer(d->kv, 0);
    d->keys = calloc((size_t)cfg->max_seqs, sizeof *d->keys);
    d->last_hidden = calloc((size_t)cfg->max_seqs * H, sizeof(float));
    d->jobs = calloc((size_t)cfg->max_seqs, sizeof *d->jobs);
    int32_t **ints[] = {&d->tokens, &d->pos, &d->seq, &d->slot, &d->n_prefix, &d->extra_start, &d->n_extra,
                        &d->logit_rows};
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
        if (!(*ints[i] = calloc(R, sizeof(int32_t)))) goto oom;
    d->extra = calloc(R * TREE_MAX_STEPS, sizeof(int32_t));
    d->in = calloc(R * H, sizeof(float));
    d->hidden = calloc(R * H, sizeof(float));
    d->logits = calloc(R * (size_t)h->cfg.draft_vocab, sizeof(float));
    if (!d->keys || !d->last_hidden || !d->jobs || !d->extra || !d->in || !d->hidden || !d->logits) goto oom;
    for (int32_t k = 0; k < cfg->max_seqs; k++) d->keys[k].kv_seq = -1;
    *out = d;
    return AE_OK;
oom:
    err_set(err, "drafter: out of memory");
fail:
    drafter_free(d);
    return AE_ERR;
}

void drafter_release(drafter *d, int32_t key) {
    if (key < 0 || key >= d->cfg.max_seqs || d->keys[key].kv_seq < 0) return;
    kv_seq_free(d->kv, d->keys[key].kv_seq);
    d->keys[key] = (key_state){.kv_seq = -1};
}

int32_t drafter_len(const drafter *d, int32_t key) {
    if (key < 0 || key >= d->cfg.max_seqs || d->keys[key].kv_seq < 0) return 0;
    return kv_seq_len(d->kv, d->keys[key].kv_seq);
}

static int validate(const drafter *d, const drafter_feed *feeds, int32_t n, ae_error *err) {
    int32_t V = d->head->target.vocab;
    for (int32_t i = 0; i < n; i++) {
        const drafter_feed *f = &feeds[i];
        if (f->key < 0 || f->key >= d->cfg.max_seqs)
            return err_set(err, "feed %d: key %d is outside 0..%d", i, f->key, d->cfg.max_seqs - 1);
        for (int32_t j = 0; j < i; j++)
            if (feeds[j].key == f->key) return err_set(err, "feed %d: key %d appears twice", i, f->key);
        if (f->n < 0 || (f->n > 0 && (!f->tokens || !f->features)))
            return err_set(err, "feed %d: %d pairs without their tokens or features", i, f->n);
        if (f->fork_of >= 0) {
            if (f->reset || f->fork_of >= d->cfg.max_seqs || f->fork_of == f->key)
                return err_set(err, "feed %d: key %d forks key %d%s", i, f->key, f->fork_of,
                               f->reset ? " and resets" : "");
            for (int32_t j = 0; j < n; j++)
                if (feeds[j].key == f->fork_of && feeds[j].fork_of >= 0)
                    return err_set(err, "feed %d: key %d forks key %d, itself forked in this call", i, f->key,
                                   f->fork_of);
        }
        int32_t have = f->reset ? 0 : drafter_len(d, f->fork_of >= 0 ? f->fork_of : f->key);
        if (!f->reset && f->start != have)
            return f->fork_of >= 0 ? err_set(err, "feed %d: key %d forks key %d, which holds %d pairs, the caller assumes %d",
                                             i, f->key, f->fork_of, have, f->start)
                                   : err_set(err, "feed %d: key %d holds %d pairs, the caller assumes %d", i, f->key,
                                             have, f->start);
        if (f->n > d->cfg.max_seq_len - have)
            return err_set(err, "feed %d: key %d would hold %lld pairs, the drafter's limit is %d", i, f->key,
                           (long long)have + f->n, d->cfg.max_seq_len);
        for (int32_t t = 0; t < f->n; t++)
            if (f->tokens[t] < 0 || f->tokens[t] >= V)
                return err_set(err, "feed %d: token %d is not in the target's vocabulary", i, f->tokens[t]);
    }
    return AE_OK;
}

/* Softmax over the draft vocabulary, then the row's best k children as
 * target ids. */
static void children_of(const drafter *d, float *row, int32_t k, int32_t *tokens, float *probs) {
    int32_t Vd = d->head->cfg.draft_vocab, idx[TREE_MAX_TOPK];
    kn_softmax(d->stream, row, 1, Vd);
    tree_topk(row, Vd, k, idx, probs);
    for (int32_t j = 0; j < k; j++) tokens[j] = d->head->draft_to_target[idx[j]];
}

/* Runs one feed's pairs through the head, chunk by chunk, into its KV. */
static void feed_pairs(drafter *d, const drafter_feed *f) {
    key_state *ks = &d->keys[f->key];
    const int32_t H = d->head->cfg.hidden;
    for (int32_t done = 0; done < f->n;) {
        int32_t m = f->n - done < d->max_rows ? f->n - done : d->max_rows, len = kv_seq_len(d->kv, ks->kv_seq);
        AE_ASSERT(kv_seq_reserve(d->kv, ks->kv_seq, len + m, NULL) == AE_OK);
        for (int32_t t = 0; t < m; t++) {
            d->tokens[t] = f->tokens[done + t];
            d->pos[t] = d->slot[t] = len + t;
            d->seq[t] = ks->kv_seq;
            d->n_prefix[t] = len + t + 1;
            d->extra_start[t] = d->n_extra[t] = 0;
        }
        bool last = done + m == f->n;
        d->logit_rows[0] = m - 1;
        kn_kv_map map = {m, kv_map_tables(d->kv), d->cfg.max_seqs, kv_get_params(d->kv)->max_blocks_per_seq,
                         d->seq, d->slot, d->n_prefix, d->extra_start, d->n_extra, d->extra, 0};
        eagle_batch b = {m, d->tokens, f->features + (size_t)done * 3 * (size_t)H, 3 * H, d->pos, &map,
                         d->hidden, last ? 1 : 0, d->logit_rows, d->logits};
        eagle_forward(d->head, d->stream, &d->layer, d->ws, &b);
        AE_ASSERT(kv_seq_advance(d->kv, ks->kv_seq, m, NULL) == AE_OK);
        memcpy(d->last_hidden + (size_t)f->key * (size_t)H, d->hidden + (size_t)(m - 1) * (size_t)H,
               (size_t)H * sizeof(float));
        if (last) {
            int32_t k = d->head->cfg.draft_vocab < TREE_MAX_TOPK ? d->head->cfg.draft_vocab : TREE_MAX_TOPK;
            children_of(d, d->logits, k, ks->top_tokens, ks->top_probs);
            ks->n_top = k;
            ks->last_token = f->tokens[f->n - 1];
        }
        done += m;
    }
}

/* One head pass over the frontier of every job; then each job takes its
 * nodes' children. */
static void expand_all(drafter *d, tree_job *jobs, int32_t n_jobs, int32_t k) {
    const size_t H = (size_t)d->head->cfg.hidden;
    int32_t m = 0, n_extra = 0;
    for (int32_t j = 0; j < n_jobs; j++) {
        tree_job *job = &jobs[j];
        const tree_build *b = &job->b;
        job->first_row = m;
        for (int32_t i = 0; i < b->n_frontier; i++, m++) {
            int32_t node = b->frontier[i];
            const tree_cand *c = &b->pool[node];
            const float *parent_h = c->parent < 0 ? d->last_hidden + (size_t)job->key * H
                                                  : d->hidden + (size_t)job->row_of[c->parent] * H;
            memcpy(d->in + (size_t)m * H, parent_h, H * sizeof(float));
            job->slot_of[node] = job->len + job->n_expanded++;
            d->tokens[m] = c->token;
            d->pos[m] = job->len + c->depth - 1;
            d->seq[m] = d->keys[job->key].kv_seq;
            d->slot[m] = job->slot_of[node];
            d->n_prefix[m] = job->len;
            d->extra_start[m] = n_extra;
            d->n_extra[m] = c->depth;
            for (int32_t a = node, t = c->depth - 1; a >= 0; a = b->pool[a].parent, t--)
                d->extra[n_extra + t] = job->slot_of[a];
            n_extra += c->depth;
            d->logit_rows[m] = m;
        }
    }
    kn_kv_map map = {m, kv_map_tables(d->kv), d->cfg.max_seqs, kv_get_params(d->kv)->max_blocks_per_seq,
                     d->seq, d->slot, d->n_prefix, d->extra_start, d->n_extra, d->extra, n_extra};
    eagle_batch eb = {m, d->tokens, d->in, (int32_t)H, d->pos, &map, d->hidden, m, d->logit_rows, d->logits};
    eagle_forward(d->head, d->stream, &d->layer, d->ws, &eb);
    for (int32_t j = 0; j < n_jobs; j++) {
        tree_job *job = &jobs[j];
        tree_build *b = &job->b;
        int32_t toks[TREE_MAX_TOPK * TREE_MAX_TOPK];
        float probs[TREE_MAX_TOPK * TREE_MAX_TOPK];
        int32_t nf = b->n_frontier, frontier[TREE_MAX_TOPK];
        memcpy(frontier, b->frontier, sizeof frontier);
        for (int32_t i = 0; i < nf; i++)
            children_of(d, d->logits + (size_t)(job->first_row + i) * (size_t)d->head->cfg.draft_vocab, k,
                        toks + i * k, probs + i * k);
        tree_expand(b, k, toks, probs);
        /* The nodes just run are the parents of the next frontier, whose
         * pass reads their hidden states from these rows. */
        for (int32_t i = 0; i < nf; i++) job->row_of[frontier[i]] = job->first_row + i;
    }
}

int drafter_propose(drafter *d, const drafter_feed *feeds, int32_t n, const tree_params *p, tree_out *trees,
                    ae_error *err) {
    if (tree_params_check(p, err) != AE_OK || validate(d, feeds, n, err) != AE_OK) return AE_ERR;
    /* Forks first: each copies its source as it was before this call. */
    for (int32_t i = 0; i < n; i++) {
        const drafter_feed *f = &feeds[i];
        if (f->fork_of < 0) continue;
        drafter_release(d, f->key);
        key_state *ks = &d->keys[f->key], *src = &d->keys[f->fork_of];
        if (src->kv_seq < 0) continue; /* start was 0: nothing to copy */
        int32_t kseq;
        /* One sequence slot per key, and the pool holds every key's whole
         * length: sharing never runs it out. */
        AE_ASSERT(kv_seq_fork(d->kv, d->stream, src->kv_seq, &kseq, NULL) == AE_OK);
        *ks = *src;
        ks->kv_seq = kseq;
        memcpy(d->last_hidden + (size_t)f->key * (size_t)d->head->cfg.hidden,
               d->last_hidden + (size_t)f->fork_of * (size_t)d->head->cfg.hidden,
               (size_t)d->head->cfg.hidden * sizeof(float));
    }
    for (int32_t i = 0; i < n; i++) {
        const drafter_feed *f = &feeds[i];
        key_state *ks = &d->keys[f->key];
        if (f->reset) drafter_release(d, f->key);
        if (ks->kv_seq < 0) {
            AE_ASSERT(kv_seq_alloc(d->kv, &ks->kv_seq, NULL) == AE_OK); /* one slot per key */
            ks->n_top = 0;
        }
        feed_pairs(d, f);
    }
    int32_t n_jobs = 0, k = p->topk < d->head->cfg.draft_vocab ? p->topk : d->head->cfg.draft_vocab;
    for (int32_t i = 0; i < n; i++) {
        const drafter_feed *f = &feeds[i];
        key_state *ks = &d->keys[f->key];
        trees[i].n = 0;
        if (!f->want_tree || ks->n_top == 0) continue;
        tree_job *job = &d->jobs[n_jobs++];
        job->key = f->key;
        job->out = i;
        job->len = kv_seq_len(d->kv, ks->kv_seq);
        job->n_expanded = 0;
        AE_ASSERT(kv_seq_reserve(d->kv, ks->kv_seq, job->len + TREE_SCRATCH, NULL) == AE_OK);
        tree_begin(&job->b, p, ks->last_token);
        tree_expand(&job->b, k, ks->top_tokens, ks->top_probs);
    }
    while (n_jobs > 0 && !tree_done(&d->jobs[0].b)) expand_all(d, d->jobs, n_jobs, k);
    for (int32_t j = 0; j < n_jobs; j++) {
        tree_job *job = &d->jobs[j];
        tree_finish(&job->b, &trees[job->out]);
        kv_seq_trim(d->kv, d->keys[job->key].kv_seq, job->len);
    }
    return AE_OK;
}
