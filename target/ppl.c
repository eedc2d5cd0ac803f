/* Perplexity windows, the reference base and the scores (ppl.h). */
#include "ppl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../services/core/file.h"

#define BASE_MAGIC "AEPPLB01"
#define BASE_HEADER 28 /* magic and five u32 */
#define BASE_MAX_BYTES ((size_t)1 << 32)

int ppl_windows_plan(int64_t n_tokens, int32_t ctx, ppl_windows *w, ae_error *err) {
    memset(w, 0, sizeof *w);
    if (ctx < PPL_MIN_CTX)
        return err_set(err, "--ctx %d is too small: a window needs at least %d tokens", ctx, PPL_MIN_CTX);
    if (n_tokens < ctx)
        return err_set(err, "the text has %lld tokens, fewer than one window of --ctx %d", (long long)n_tokens, ctx);
    if (n_tokens / ctx > INT32_MAX) return err_set(err, "the text has too many tokens (%lld)", (long long)n_tokens);
    w->ctx = ctx;
    w->n_windows = (int32_t)(n_tokens / ctx);
    w->first = ctx / 2;
    w->scored = ctx - 1 - w->first;
    return AE_OK;
}

struct ppl_base {
    char *data; /* the whole file; the sections below point into it */
    uint32_t vocab, ctx, windows, top_k, flags;
    const int32_t *tokens; /* [windows][ctx] */
    const uint8_t *records;
    size_t record_bytes;
    int64_t positions;
};

static uint32_t rd_u32(const char *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

int ppl_base_open(ppl_base **out, const char *path, ae_error *err) {
    *out = NULL;
    /* The sections are read in place, as little-endian i32 and f32. */
    const uint32_t one = 1;
    if (*(const uint8_t *)&one != 1) return err_set(err, "%s: base files are read on little-endian hosts only", path);
    ppl_base *b = calloc(1, sizeof *b);
    if (!b) return err_set(err, "out of memory");
    size_t len;
    if (file_read_all(path, BASE_MAX_BYTES, &b->data, &len, NULL, err) != AE_OK) goto fail;
    if (len < BASE_HEADER || memcmp(b->data, BASE_MAGIC, 8) != 0) {
        err_set(err, "%s: not a perplexity base (no \"%s\" header; tools/gen_ppl_base.py writes them)", path,
                BASE_MAGIC);
        goto fail;
    }
    b->vocab = rd_u32(b->data + 8);
    b->ctx = rd_u32(b->data + 12);
    b->windows = rd_u32(b->data + 16);
    b->top_k = rd_u32(b->data + 20);
    b->flags = rd_u32(b->data + 24);
    if (b->vocab == 0 || b->vocab > INT32_MAX || b->ctx < PPL_MIN_CTX || b->ctx > (1u << 24) || b->windows == 0 ||
        b->windows > (1u << 24) || b->top_k == 0 || b->top_k > PPL_MAX_TOP_K || b->top_k > b->vocab ||
        (b->flags & ~PPL_FLAG_BOS)) {
        err_set(err, "%s: bad header (vocab %u, ctx %u, windows %u, top_k %u, flags %#x)", path, b->vocab, b->ctx,
                b->windows, b->top_k, b->flags);
        goto fail;
    }
    ppl_windows w;
    if (ppl_windows_plan((int64_t)b->ctx * b->windows, (int32_t)b->ctx, &w, err) != AE_OK) goto fail;
    b->positions = (int64_t)w.n_windows * w.scored;
    b->record_bytes = 8 + 8 * (size_t)b->top_k;
    size_t want = BASE_HEADER + 4 * (size_t)b->ctx * b->windows + b->record_bytes * (size_t)b->positions;
    if (len != want) {
        err_set(err, "%s: %zu bytes, but its header (ctx %u, %u windows, top_k %u) makes it %zu", path, len, b->ctx,
                b->windows, b->top_k, want);
        goto fail;
    }
    b->tokens = (const int32_t *)(const void *)(b->data + BASE_HEADER);
    b->records = (const uint8_t *)(b->data + BASE_HEADER + 4 * (size_t)b->ctx * b->windows);
    for (int64_t i = 0; i < b->positions; i++) {
        ppl_ref r = ppl_base_ref(b, i);
        for (int32_t k = 0; k < r.top_k; k++)
            if (r.ids[k] < 0 || (uint32_t)r.ids[k] >= b->vocab) {
                err_set(err, "%s: position %lld lists token %d, outside the vocabulary of %u", path, (long long)i,
                        r.ids[k], b->vocab);
                goto fail;
            }
    }
    *out = b;
    return AE_OK;
fail:
    ppl_base_close(b);
    return AE_ERR;
}

void ppl_base_close(ppl_base *b) {
    if (!b) return;
    free(b->data);
    free(b);
}

int ppl_base_check(const ppl_base *b, const ppl_windows *w, int32_t vocab, const int32_t *tokens, ae_error *err) {
    if ((int64_t)b->vocab != vocab)
        return err_set(err, "the base is for a vocabulary of %u tokens, the model has %d", b->vocab, vocab);
    if ((int64_t)b->ctx != w->ctx) return err_set(err, "the base was made with --ctx %u, not %d", b->ctx, w->ctx);
    if ((int64_t)b->windows != w->n_windows)
        return err_set(err, "the base holds %u windows, the text makes %d (a different text?)", b->windows,
                       w->n_windows);
    size_t n = (size_t)w->n_windows * (size_t)w->ctx;
    for (size_t i = 0; i < n; i++)
        if (b->tokens[i] != tokens[i])
            return err_set(err,
                           "the base's tokens differ from the text's at window %zu position %zu (base %d, text "
                           "%d): a different text or tokenizer",
                           i / (size_t)w->ctx, i % (size_t)w->ctx, b->tokens[i], tokens[i]);
    return AE_OK;
}

int64_t ppl_base_positions(const ppl_base *b) { return b->positions; }

ppl_ref ppl_base_ref(const ppl_base *b, int64_t i) {
    const uint8_t *p = b->records + (size_t)i * b->record_bytes;
    ppl_ref r;
    memcpy(&r.logp_next, p, 4);
    memcpy(&r.log_rest, p + 4, 4);
    r.top_k = (int32_t)b->top_k;
    r.ids = (const int32_t *)(const void *)(p + 8);
    r.logp = (const float *)(const void *)(p + 8 + 4 * (size_t)b->top_k);
    return r;
}

struct ppl_scorer {
    int32_t vocab;
    int64_t max_positions;
    int64_t n;
    int64_t n_ref;
    int64_t agree;
    double nll_sum;
    double base_nll_sum;
    double kld_sum;
    double *kld;   /* [max_positions] */
    uint8_t *mark; /* [vocab] 1 for the ids of the current ref; all 0 between calls */
};

int ppl_scorer_init(ppl_scorer **out, int32_t vocab, int64_t max_positions, ae_error *err) {
    *out = NULL;
    if (vocab <= 0 || max_positions <= 0)
        return err_set(err, "ppl scorer: bad vocab %d or positions %lld", vocab, (long long)max_positions);
    ppl_scorer *s = calloc(1, sizeof *s);
    if (!s) return err_set(err, "out of memory");
    s->vocab = vocab;
    s->max_positions = max_positions;
    s->kld = malloc(sizeof *s->kld * (size_t)max_positions);
    s->mark = calloc((size_t)vocab, 1);
    if (!s->kld || !s->mark) {
        ppl_scorer_free(s);
        return err_set(err, "out of memory");
    }
    *out = s;
    return AE_OK;
}

void ppl_scorer_free(ppl_scorer *s) {
    if (!s) return;
    free(s->kld);
    free(s->mark);
    free(s);
}

int ppl_score_add(ppl_scorer *s, const float *logits, int32_t next, const ppl_ref *ref, ae_error *err) {
    if (s->n >= s->max_positions)
        return err_set(err, "ppl scorer: more than %lld positions", (long long)s->max_positions);
    if (next < 0 || next >= s->vocab) return err_set(err, "ppl scorer: token %d outside the vocabulary", next);
    /* log-softmax in double, from the max so exp never overflows. The
     * argmax is the first maximum, as greedy decoding takes it. */
    int32_t arg = 0;
    float mx = logits[0];
    for (int32_t i = 1; i < s->vocab; i++)
        if (logits[i] > mx) mx = logits[i], arg = i;
    if (ref)
        for (int32_t k = 0; k < ref->top_k; k++) s->mark[ref->ids[k]] = 1;
    double z = 0, z_rest = 0;
    for (int32_t i = 0; i < s->vocab; i++) {
        double e = exp((double)logits[i] - (double)mx);
        z += e;
        if (ref && !s->mark[i]) z_rest += e;
    }
    double log_z = log(z) + (double)mx;
    s->nll_sum += log_z - (double)logits[next];
    if (ref) {
        double kl = 0;
        for (int32_t k = 0; k < ref->top_k; k++) {
            double lp = ref->logp[k];
            kl += exp(lp) * (lp - ((double)logits[ref->ids[k]] - log_z));
            s->mark[ref->ids[k]] = 0;
        }
        if (isfinite(ref->log_rest)) {
            /* Mass the model puts outside the base's list; when it is none
             * at all while the base has some, the divergence is infinite,
             * and is reported as such. */
            double lq_rest = z_rest > 0 ? log(z_rest) - log(z) : -INFINITY;
            kl += exp((double)ref->log_rest) * ((double)ref->log_rest - lq_rest);
        }
        s->kld[s->n_ref++] = kl;
        s->kld_sum += kl;
        s->base_nll_sum -= (double)ref->logp_next;
        s->agree += ref->ids[0] == arg;
    }
    s->n++;
    return AE_OK;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

ppl_result ppl_scorer_result(ppl_scorer *s) {
    ppl_result r = {0};
    r.tokens = s->n;
    r.nll_sum = s->nll_sum;
    r.ppl = s->n ? exp(s->nll_sum / (double)s->n) : NAN;
    r.has_ref = s->n > 0 && s->n_ref == s->n;
    if (r.has_ref) {
        double *v = s->kld;
        int64_t n = s->n_ref;
        qsort(v, (size_t)n, sizeof *v, cmp_double);
        int64_t rank = (99 * n + 99) / 100; /* ceil(0.99 n), in integers */
        r.base_ppl = exp(s->base_nll_sum / (double)n);
        r.kld_mean = s->kld_sum / (double)n;
        r.kld_p99 = v[rank - 1];
        r.top1_agree = (double)s->agree / (double)n;
    }
    return r;
}
