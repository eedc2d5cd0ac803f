#include "batchgen.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../services/model/quant.h"

void batchgen_topk(const float *logits, int32_t vocab, int32_t k, int32_t *ids, float *probs) {
    float mx = -INFINITY;
    for (int32_t v = 0; v < vocab; v++)
        if (logits[v] > mx) mx = logits[v];
    double sum = 0;
    for (int32_t v = 0; v < vocab; v++) sum += exp((double)(logits[v] - mx));
    int32_t have = 0;
    for (int32_t v = 0; v < vocab; v++) {
        float x = logits[v];
        if (have == k && !(x > logits[ids[k - 1]])) continue;
        int32_t j = have < k ? have++ : k - 1; /* insertion: strictly greater moves up, ties keep lower id first */
        while (j > 0 && x > logits[ids[j - 1]]) {
            ids[j] = ids[j - 1];
            j--;
        }
        ids[j] = v;
    }
    for (int32_t j = 0; j < k; j++) probs[j] = j < have ? (float)(exp((double)(logits[ids[j]] - mx)) / sum) : 0.0f;
    for (int32_t j = have; j < k; j++) ids[j] = 0;
}

typedef struct batchgen_state {
    engine *e;
    const batchgen_config *cfg;
    batchgen_seq **active; /* [max_seqs], admission order */
    int32_t n_active;
    engine_item *items; /* [max_seqs] */
    batchgen_seq **item_seq;
    int32_t *rows;   /* [step_tokens] */
    float *features; /* [step_tokens][n_capture * hidden] */
    float *logits;   /* [max_seqs][vocab] */
    float *topk_p;   /* [topk] */
    sample_state *smp;
} batchgen_state;

/* A step's items: one decode token per generating sequence, then prompt
 * chunks in admission order while the pass has room. */
static int32_t plan_step(batchgen_state *st, int32_t *n_tokens) {
    int32_t n = 0, budget = st->cfg->step_tokens;
    for (int pass = 0; pass < 2; pass++)
        for (int32_t i = 0; i < st->n_active && budget > 0; i++) {
            batchgen_seq *s = st->active[i];
            bool prefill = s->fed < s->n_prompt;
            if (prefill != (pass == 1)) continue;
            int32_t k = prefill ? s->n_prompt - s->fed : 1;
            if (k > budget) k = budget;
            st->items[n] = (engine_item){s->eng_seq, ENGINE_APPEND, k, s->ids + s->fed, NULL, false};
            st->item_seq[n++] = s;
            budget -= k;
        }
    *n_tokens = st->cfg->step_tokens - budget;
    return n;
}

/* After a step: keep the features, and for sequences whose whole input
 * has now run, record the top-K and take their next token. */
static void take_step(batchgen_state *st, int32_t n_items) {
    const batchgen_config *cfg = st->cfg;
    int32_t vocab = engine_model(st->e)->cfg.vocab, width = cfg->n_capture * engine_model(st->e)->cfg.hidden;
    int32_t row = 0;
    for (int32_t i = 0; i < n_items; i++) {
        batchgen_seq *s = st->item_seq[i];
        int32_t k = st->items[i].n_tokens;
        if (cfg->n_capture && s->hidden)
            for (int32_t r = 0; r < k; r++) {
                const float *src = st->features + (size_t)(row + r) * (size_t)width;
                uint16_t *dst = s->hidden + (size_t)(s->fed + r) * (size_t)width;
                for (int32_t c = 0; c < width; c++) dst[c] = quant_f32_to_f16(src[c]);
            }
        row += k;
        s->fed += k;
        if (s->fed < s->n) continue; /* a prompt chunk with more to come */
        const float *lg = st->logits + (size_t)i * (size_t)vocab;
        if (cfg->topk && s->topk_ids) {
            size_t at = (size_t)(s->n - 1) * (size_t)cfg->topk;
            batchgen_topk(lg, vocab, cfg->topk, s->topk_ids + at, st->topk_p);
            for (int32_t j = 0; j < cfg->topk; j++) s->topk_p[at + (size_t)j] = quant_f32_to_f16(st->topk_p[j]);
        }
        int32_t next = sample_token(st->smp, lg, &s->sp, &s->rng, s->n); /* at position n */
        s->ids[s->n++] = next;
        s->stopped = next == cfg->stop;
    }
}

static bool finished(const batchgen_seq *s) { return s->stopped || s->n == s->cap; }

/* KV blocks a sequence may take: every token but the last is run. */
static int64_t seq_blocks(const batchgen_seq *s, int32_t block) { return (s->cap - 1 + block - 1) / block; }

int batchgen_run(engine *e, const batchgen_config *cfg, batchgen_next_fn next, batchgen_done_fn done, void *ctx,
                 ae_error *err) {
    const model *m = engine_model(e);
    int32_t width = cfg->n_capture * m->cfg.hidden;
    batchgen_state st = {.e = e, .cfg = cfg};
    st.active = calloc((size_t)cfg->max_seqs, sizeof *st.active);
    st.items = calloc((size_t)cfg->max_seqs, sizeof *st.items);
    st.item_seq = calloc((size_t)cfg->max_seqs, sizeof *st.item_seq);
    st.rows = malloc(sizeof(int32_t) * (size_t)cfg->step_tokens);
    st.features = width ? malloc(sizeof(float) * (size_t)cfg->step_tokens * (size_t)width) : NULL;
    st.logits = malloc(sizeof(float) * (size_t)cfg->max_seqs * (size_t)m->cfg.vocab);
    st.topk_p = malloc(sizeof(float) * (size_t)(cfg->topk + 1));
    int rc = AE_OK;
    if (!st.active || !st.items || !st.item_seq || !st.rows || (width && !st.features) || !st.logits || !st.topk_p) {
        rc = err_set(err, "out of memory");
        goto out;
    }
    if ((rc = sample_init(&st.smp, m->cfg.vocab, err)) != AE_OK) goto out;
    for (int32_t r = 0; r < cfg->step_tokens; r++) st.rows[r] = r;
    /* Admission keeps the KV cache from running out: a sequence comes in
     * only when the blocks it may grow to are free. */
    const engine_config *ec = engine_get_config(e);
    int64_t kv_blocks = ec->kv_tokens / ec->block_size, reserved = 0;
    bool more = true;
    batchgen_seq *pending = NULL;
    for (;;) {
        while (st.n_active < cfg->max_seqs) {
            batchgen_seq *s = pending;
            if (!s && (!more || !(more = next(ctx, &s)) || !s)) break;
            pending = NULL;
            if (s->n_prompt < 1 || s->n_prompt >= s->cap) {
                rc = err_set(err, "sequence %lld: prompt of %d tokens with room for %d", (long long)s->index,
                             s->n_prompt, s->cap);
                goto out;
            }
            int64_t need = seq_blocks(s, ec->block_size);
            if (need > kv_blocks) {
                rc = err_set(err, "sequence %lld needs %lld KV tokens, the cache holds %lld; raise --max-kv-tokens",
                             (long long)s->index, (long long)(need * ec->block_size), (long long)ec->kv_tokens);
                goto out;
            }
            if (reserved + need > kv_blocks) {
                pending = s; /* waits for a sequence to finish */
                break;
            }
            reserved += need;
            s->n = s->n_prompt;
            s->fed = 0;
            s->stopped = s->done = false;
            if ((rc = engine_seq_new(e, &s->eng_seq, err)) != AE_OK) goto out;
            st.active[st.n_active++] = s;
        }
        if (st.n_active == 0) {
            /* next() may hold a sequence back only while others run. */
            if (more) rc = err_set(err, "the data source held a sequence back with none running");
            break;
        }
        int32_t n_tokens, n_items = plan_step(&st, &n_tokens);
        forward_capture cap = {cfg->n_capture, {0}, n_tokens, st.rows, st.features};
        memcpy(cap.layers, cfg->capture, sizeof cap.layers);
        engine_outputs eo = {.logits = st.logits, .capture = width ? &cap : NULL};
        if ((rc = engine_step(e, st.items, n_items, &eo, err)) != AE_OK) goto out;
        take_step(&st, n_items);
        int32_t kept = 0;
        for (int32_t i = 0; i < st.n_active; i++) {
            batchgen_seq *s = st.active[i];
            if (!finished(s)) {
                st.active[kept++] = s;
                continue;
            }
            engine_seq_free(e, s->eng_seq);
            reserved -= seq_blocks(s, ec->block_size);
            s->done = true;
            if ((rc = done(ctx, s, err)) != AE_OK) {
                st.active[i] = NULL;
                for (int32_t j = i + 1; j < st.n_active; j++) st.active[kept++] = st.active[j];
                st.n_active = kept;
                goto out;
            }
        }
        st.n_active = kept;
    }
out:
    for (int32_t i = 0; i < st.n_active; i++) engine_seq_free(e, st.active[i]->eng_seq);
    sample_free(st.smp);
    free(st.topk_p);
    free(st.logits);
    free(st.features);
    free(st.rows);
    free(st.item_seq);
    free(st.items);
    free(st.active);
    return rc;
}
