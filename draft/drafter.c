#include "drafter.h"

#include <stdlib.h>
#include <string.h>

#include "../services/core/pool.h"
#include "../services/kv/kv.h"

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

/* A pass's integer inputs: filled on the host, uploaded to the same
 * places of d->ibuf. [max_rows] each, but I_EXTRA: [max_rows *
 * TREE_MAX_STEPS]. I_GATHER: the rows of d->states a tree pass takes
 * its inputs from. */
enum { I_TOKENS, I_POS, I_SEQ, I_SLOT, I_N_PREFIX, I_EXTRA_START, I_N_EXTRA, I_LOGIT_ROWS, I_GATHER, I_EXTRA, I_N };

struct drafter {
    const eagle_head *head;
    drafter_config cfg;
    int32_t max_rows; /* rows of one head pass */
    pool *pool;       /* the shared pool, or own_pool */
    pool *own_pool;
    kn_stream *stream; /* on the head's backend */
    bool host_memory;  /* that backend's memory is the host's: no copies in or out */
    eagle_ws *ws;
    kv_cache *kv;
    kn_kv_pool layer;
    key_state *keys;    /* [max_seqs] */
    tree_job *jobs;     /* [max_seqs] */
    int32_t *host[I_N]; /* one allocation (host[0]) */
    int32_t *dev[I_N];  /* the same in ibuf */
    kn_buf ibuf;
    /* In the backend's memory, one buffer (fbuf):
     *   states [max_seqs + max_rows][H]: the pre-norm output of each
     *          key's last pair, then the hidden states of the last pass
     *          (hidden), so that a tree pass gathers its inputs from both
     *          in one op;
     *   in     [max_rows][H] a tree pass's inputs (parents' states);
     *   logits [max_rows][draft_vocab], made probabilities in place;
     *   feat   [max_rows][3H] features uploaded (none on a host-memory
     *          backend, which reads the caller's). */
    kn_buf fbuf;
    float *states, *hidden, *in, *logits, *feat;
    /* Each row's best children (kn_topk of its probabilities), on the
     * backend: top_idx [max_rows][TREE_MAX_TOPK] int32 then top_val
     * [max_rows][TREE_MAX_TOPK] f32, k a row; and where the host reads
     * them (the same arrays on a host-memory backend). */
    kn_buf tbuf;
    int32_t *top_idx, *host_idx;
    float *top_val, *host_val;
};

static int32_t rows_for(const drafter_config *c) {
    int32_t tree_rows = c->max_seqs * TREE_MAX_TOPK;
    return c->max_tokens > tree_rows ? c->max_tokens : tree_rows;
}

static kv_params kv_params_for(const eagle_head *h, const drafter_config *c) {
    int32_t per_seq = (c->max_seq_len + TREE_SCRATCH + KV_BLOCK - 1) / KV_BLOCK;
    return (kv_params){1,    h->cfg.n_kv_heads, h->cfg.head_dim, KV_BLOCK, per_seq * c->max_seqs, c->max_seqs, per_seq,
                       false};
}

/* Floats of each part of fbuf, in order: states, in, logits, feat. */
static void fbuf_sizes(const eagle_head *h, const drafter_config *c, size_t n[4]) {
    size_t R = (size_t)rows_for(c), H = (size_t)h->cfg.hidden;
    n[0] = ((size_t)c->max_seqs + R) * H;
    n[1] = R * H;
    n[2] = R * (size_t)h->cfg.draft_vocab;
    n[3] = kn_backend_host_memory(h->be) ? 0 : R * 3 * H;
}

static size_t ints_len(int i, size_t R) { return i == I_EXTRA ? R * TREE_MAX_STEPS : R; }

_Static_assert(TREE_MAX_TOPK <= KN_TOPK_MAX, "a node's children are one kn_topk");

/* Bytes of tbuf: each row's top-k ids and values. */
static size_t top_bytes(size_t rows) { return rows * TREE_MAX_TOPK * (sizeof(int32_t) + sizeof(float)); }

size_t drafter_bytes(const eagle_head *h, const drafter_config *c) {
    kv_params kp = kv_params_for(h, c);
    size_t rows = (size_t)rows_for(c), f[4], ints = 0;
    fbuf_sizes(h, c, f);
    for (int i = 0; i < I_N; i++) ints += ints_len(i, rows);
    return (size_t)kv_bytes(&kp) + eagle_ws_bytes(h, (int32_t)rows) +
           eagle_stream_workspace(h, (int32_t)rows, c->max_seq_len + TREE_SCRATCH) +
           (f[0] + f[1] + f[2] + f[3]) * sizeof(float) + ints * sizeof(int32_t) + top_bytes(rows) +
           (kn_backend_host_memory(h->be) ? drafter_host_bytes(h, c) : 0);
}

size_t drafter_host_bytes(const eagle_head *h, const drafter_config *c) {
    size_t rows = (size_t)rows_for(c), ints = 0;
    for (int i = 0; i < I_N; i++) ints += ints_len(i, rows);
    size_t tops = kn_backend_host_memory(h->be) ? 0 : top_bytes(rows);
    return (size_t)c->max_seqs * (sizeof(key_state) + sizeof(tree_job)) + ints * sizeof(int32_t) + tops;
}

void drafter_free(drafter *d) {
    if (!d) return;
    eagle_ws_free(d->ws);
    kn_stream_free(d->stream);
    pool_free(d->own_pool);
    kv_free(d->kv);
    free(d->keys);
    free(d->jobs);
    free(d->host[0]);
    kn_buf_free(&d->ibuf);
    kn_buf_free(&d->fbuf);
    kn_buf_free(&d->tbuf);
    if (!d->host_memory) free(d->host_idx);
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
    d->host_memory = kn_backend_host_memory(h->be);
    size_t R = (size_t)d->max_rows, H = (size_t)h->cfg.hidden;
    kv_params kp = kv_params_for(h, cfg);
    d->pool = cfg->pool;
    if ((!d->pool && pool_init(&d->own_pool, cfg->threads, err) != AE_OK) ||
        kn_stream_init(&d->stream, h->be,
                       &(kn_stream_config){d->pool ? d->pool : d->own_pool,
                                           eagle_stream_workspace(h, d->max_rows, cfg->max_seq_len + TREE_SCRATCH)},
                       err) != AE_OK ||
        eagle_ws_init(&d->ws, h, d->max_rows, err) != AE_OK || kv_init(&d->kv, h->be, &kp, err) != AE_OK)
        goto fail;
    if (cfg->act_bits) kn_stream_set_act_bits(d->stream, cfg->act_bits);
    d->layer = kv_layer(d->kv, 0);
    size_t n_ints = 0, f[4];
    for (int i = 0; i < I_N; i++) n_ints += ints_len(i, R);
    fbuf_sizes(h, cfg, f);
    if (kn_buf_alloc(h->be, &d->ibuf, n_ints * sizeof(int32_t), err) != AE_OK ||
        kn_buf_alloc(h->be, &d->fbuf, (f[0] + f[1] + f[2] + f[3]) * sizeof(float), err) != AE_OK ||
        kn_buf_alloc(h->be, &d->tbuf, top_bytes(R), err) != AE_OK)
        goto fail;
    d->keys = calloc((size_t)cfg->max_seqs, sizeof *d->keys);
    d->jobs = calloc((size_t)cfg->max_seqs, sizeof *d->jobs);
    d->host[0] = calloc(n_ints, sizeof(int32_t));
    if (!d->keys || !d->jobs || !d->host[0]) goto oom;
    d->dev[0] = d->ibuf.ptr;
    for (int i = 1; i < I_N; i++) {
        d->host[i] = d->host[i - 1] + ints_len(i - 1, R);
        d->dev[i] = d->dev[i - 1] + ints_len(i - 1, R);
    }
    d->states = d->fbuf.ptr;
    d->hidden = d->states + (size_t)cfg->max_seqs * H;
    d->in = d->states + f[0];
    d->logits = d->in + f[1];
    d->feat = f[3] ? d->logits + f[2] : NULL;
    d->top_idx = d->tbuf.ptr;
    d->top_val = (float *)(void *)(d->top_idx + R * TREE_MAX_TOPK);
    d->host_idx = d->host_memory ? d->top_idx : malloc(top_bytes(R));
    if (!d->host_idx) goto oom;
    d->host_val = (float *)(void *)(d->host_idx + R * TREE_MAX_TOPK);
    for (int32_t k = 0; k < cfg->max_seqs; k++) d->keys[k].kv_seq = -1;
    *out = d;
    return AE_OK;
oom:
    err_set(err, "drafter: out of memory");
fail:
    drafter_free(d);
    return AE_ERR;
}

/* Sends the first n of input i to the backend; returns its address there. */
static const int32_t *put(drafter *d, int i, int32_t n) {
    kn_upload(d->stream, &d->ibuf, (size_t)((char *)d->dev[i] - (char *)d->ibuf.ptr), d->host[i],
              (size_t)n * sizeof(int32_t));
    return d->dev[i];
}

/* Copies H floats from row src to row dst of d->states, on the stream. */
static void copy_state(drafter *d, int32_t src, int32_t dst) {
    const int64_t H = d->head->cfg.hidden;
    kn_gather_rows(d->stream, d->states + (size_t)src * (size_t)H, NULL, 1, H, d->states + (size_t)dst * (size_t)H, H);
}

/* Softmax over the draft vocabulary of the first m rows of logits, then
 * each row's k most likely, on the backend; waits for those on the host
 * (d->host_idx, d->host_val: [m][k]). Only they cross from a device, not
 * the rows. */
static void top_of(drafter *d, int32_t m, int32_t k) {
    kn_softmax(d->stream, d->logits, m, (int64_t)d->head->cfg.draft_vocab);
    kn_topk(d->stream, d->logits, m, (int64_t)d->head->cfg.draft_vocab, k, d->top_idx, d->top_val);
    if (!d->host_memory) {
        size_t n = (size_t)m * (size_t)k;
        kn_download(d->stream, d->host_idx, &d->tbuf, 0, n * sizeof(int32_t));
        kn_download(d->stream, d->host_val, &d->tbuf, (size_t)((char *)d->top_val - (char *)d->tbuf.ptr),
                    n * sizeof(float));
    }
    kn_stream_sync(d->stream);
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
            return f->fork_of >= 0
                       ? err_set(err, "feed %d: key %d forks key %d, which holds %d pairs, the caller assumes %d", i,
                                 f->key, f->fork_of, have, f->start)
                       : err_set(err, "feed %d: key %d holds %d pairs, the caller assumes %d", i, f->key, have,
                                 f->start);
        if (f->n > d->cfg.max_seq_len - have)
            return err_set(err, "feed %d: key %d would hold %lld pairs, the drafter's limit is %d", i, f->key,
                           (long long)have + f->n, d->cfg.max_seq_len);
        for (int32_t t = 0; t < f->n; t++)
            if (f->tokens[t] < 0 || f->tokens[t] >= V)
                return err_set(err, "feed %d: token %d is not in the target's vocabulary", i, f->tokens[t]);
    }
    return AE_OK;
}

/* The best k children of row r of the last top_of, as target ids. */
static void children_of(const drafter *d, int32_t r, int32_t k, int32_t *tokens, float *probs) {
    const int32_t *idx = d->host_idx + (size_t)r * (size_t)k;
    memcpy(probs, d->host_val + (size_t)r * (size_t)k, (size_t)k * sizeof(float));
    for (int32_t j = 0; j < k; j++) tokens[j] = d->head->draft_to_target[idx[j]];
}

/* The map of a pass of m rows with n_extra tree slots, its inputs sent. */
static kn_kv_map send_map(drafter *d, int32_t m, int32_t n_extra) {
    const int32_t *seq = put(d, I_SEQ, m), *slot = put(d, I_SLOT, m), *n_prefix = put(d, I_N_PREFIX, m),
                  *extra_start = put(d, I_EXTRA_START, m), *n_ex = put(d, I_N_EXTRA, m),
                  *extra = put(d, I_EXTRA, n_extra);
    kv_upload_tables(d->kv, d->stream);
    int32_t max_vis = 0;
    for (int32_t t = 0; t < m; t++) {
        int32_t vis = d->host[I_N_PREFIX][t] + d->host[I_N_EXTRA][t];
        if (vis > max_vis) max_vis = vis;
    }
    return (kn_kv_map){m,
                       kv_map_tables(d->kv),
                       d->cfg.max_seqs,
                       kv_get_params(d->kv)->max_blocks_per_seq,
                       seq,
                       slot,
                       n_prefix,
                       extra_start,
                       n_ex,
                       extra,
                       n_extra,
                       max_vis};
}

/* Runs one feed's pairs through the head, chunk by chunk, into its KV. */
static void feed_pairs(drafter *d, const drafter_feed *f) {
    key_state *ks = &d->keys[f->key];
    const int32_t H = d->head->cfg.hidden;
    int32_t *tokens = d->host[I_TOKENS], *pos = d->host[I_POS], *seq = d->host[I_SEQ], *slot = d->host[I_SLOT],
            *n_prefix = d->host[I_N_PREFIX], *extra_start = d->host[I_EXTRA_START], *n_extra = d->host[I_N_EXTRA];
    for (int32_t done = 0; done < f->n;) {
        int32_t m = f->n - done < d->max_rows ? f->n - done : d->max_rows, len = kv_seq_len(d->kv, ks->kv_seq);
        AE_ASSERT(kv_seq_reserve(d->kv, ks->kv_seq, len + m, NULL) == AE_OK);
        for (int32_t t = 0; t < m; t++) {
            tokens[t] = f->tokens[done + t];
            pos[t] = slot[t] = len + t;
            seq[t] = ks->kv_seq;
            n_prefix[t] = len + t + 1;
            extra_start[t] = n_extra[t] = 0;
        }
        bool last = done + m == f->n;
        d->host[I_LOGIT_ROWS][0] = m - 1;
        const float *feat = f->features + (size_t)done * 3 * (size_t)H;
        if (!d->host_memory) {
            kn_upload(d->stream, &d->fbuf, (size_t)((char *)d->feat - (char *)d->fbuf.ptr), feat,
                      (size_t)m * 3 * (size_t)H * sizeof(float));
            feat = d->feat;
        }
        kn_kv_map map = send_map(d, m, 0);
        eagle_batch b = {m,         put(d, I_TOKENS, m), feat,
                         3 * H,     put(d, I_POS, m),    &map,
                         d->hidden, last ? 1 : 0,        put(d, I_LOGIT_ROWS, 1),
                         d->logits};
        eagle_forward(d->head, d->stream, &d->layer, d->ws, &b);
        AE_ASSERT(kv_seq_advance(d->kv, ks->kv_seq, m, NULL) == AE_OK);
        copy_state(d, d->cfg.max_seqs + m - 1, f->key);
        if (last) {
            int32_t k = d->head->cfg.draft_vocab < TREE_MAX_TOPK ? d->head->cfg.draft_vocab : TREE_MAX_TOPK;
            top_of(d, 1, k);
            children_of(d, 0, k, ks->top_tokens, ks->top_probs);
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
    int32_t *tokens = d->host[I_TOKENS], *pos = d->host[I_POS], *seq = d->host[I_SEQ], *slot = d->host[I_SLOT],
            *n_prefix = d->host[I_N_PREFIX], *extra_start = d->host[I_EXTRA_START], *n_ex = d->host[I_N_EXTRA],
            *extra = d->host[I_EXTRA], *gather = d->host[I_GATHER], *logit_rows = d->host[I_LOGIT_ROWS];
    for (int32_t j = 0; j < n_jobs; j++) {
        tree_job *job = &jobs[j];
        const tree_build *b = &job->b;
        job->first_row = m;
        for (int32_t i = 0; i < b->n_frontier; i++, m++) {
            int32_t node = b->frontier[i];
            const tree_cand *c = &b->pool[node];
            /* The parent's state: the key's last pair, or a row of the
             * last pass (states rows max_seqs + r). */
            gather[m] = c->parent < 0 ? job->key : d->cfg.max_seqs + job->row_of[c->parent];
            job->slot_of[node] = job->len + job->n_expanded++;
            tokens[m] = c->token;
            pos[m] = job->len + c->depth - 1;
            seq[m] = d->keys[job->key].kv_seq;
            slot[m] = job->slot_of[node];
            n_prefix[m] = job->len;
            extra_start[m] = n_extra;
            n_ex[m] = c->depth;
            for (int32_t a = node, t = c->depth - 1; a >= 0; a = b->pool[a].parent, t--)
                extra[n_extra + t] = job->slot_of[a];
            n_extra += c->depth;
            logit_rows[m] = m;
        }
    }
    kn_gather_rows(d->stream, d->states, put(d, I_GATHER, m), m, (int64_t)H, d->in, (int64_t)H);
    kn_kv_map map = send_map(d, m, n_extra);
    eagle_batch eb = {m, put(d, I_TOKENS, m),     d->in,    (int32_t)H, put(d, I_POS, m), &map, d->hidden,
                      m, put(d, I_LOGIT_ROWS, m), d->logits};
    eagle_forward(d->head, d->stream, &d->layer, d->ws, &eb);
    top_of(d, m, k);
    for (int32_t j = 0; j < n_jobs; j++) {
        tree_job *job = &jobs[j];
        tree_build *b = &job->b;
        int32_t toks[TREE_MAX_TOPK * TREE_MAX_TOPK];
        float probs[TREE_MAX_TOPK * TREE_MAX_TOPK];
        int32_t nf = b->n_frontier, frontier[TREE_MAX_TOPK];
        memcpy(frontier, b->frontier, sizeof frontier);
        for (int32_t i = 0; i < nf; i++) children_of(d, job->first_row + i, k, toks + i * k, probs + i * k);
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
        copy_state(d, f->fork_of, f->key);
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
