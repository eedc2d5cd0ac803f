/* aerie bench: engine throughput against the memory-bandwidth roofline,
 * all measured in one run (README.md: figures are ratios against a reference measured in the same run).
 *
 * One JSON line on stdout:
 *   - prefill and decode tok/s of `batch` independent sequences. Prompts
 *     are synthetic: token ids drawn by splitmix64 (seed 1 + sequence
 *     index) uniformly over the vocabulary, so every run feeds the same
 *     tokens. Prefill packs the prompts into passes of at most
 *     max-batch-tokens tokens; each decode step is one pass with one token
 *     of every sequence, the greedy choice of the step before.
 *   - the read bandwidth of a buffer far larger than the last-level cache,
 *     summed by the same number of threads. Decode runs in 8 windows, each
 *     followed by one pass over the buffer, because this host's bandwidth
 *     moves with its neighbours' load (35 to 56 GB/s within minutes). With
 *     the weight bytes one decode step reads (model_decode_bytes), each
 *     window gives its step rate as a fraction of the roofline step rate
 *     of its own reading; roofline_fraction is the median of those
 *     (roofline_fraction_windows), bandwidth_gb_per_s the median reading
 *     and roofline_tok_per_s its roofline. roofline_fraction_vs_best
 *     divides by the best reading of the run (`repeat` passes before the
 *     engine starts, and the windows' passes): the stricter figure. A step
 *     reads the weights once whatever the batch, so at batch 1 this is
 *     decode tok/s against the most batch-1 decoding can reach.
 *   - the verify cost curve: one pass of a chain of n tokens (an ENGINE_TREE
 *     whose node i is the parent of node i+1) after a fixed prefix of
 *     prompt-tokens tokens, for n = 1, 2, 4, 8, 16, 32, median of `repeat` passes each,
 *     relative to n = 1. Nothing is committed, so every pass sees the same
 *     context. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "../kernels/device.h"
#include "../services/core/log.h"
#include "../target/engine.h"
#include "../target/sample.h"
#include "cli.h"
#include "plan.h"

static const config_option opts[] = {
    {"model", CONFIG_STRING, NULL, 0, 0, "model: .gguf file or Hugging Face directory"},
    {"device", CONFIG_STRING, "auto", 0, 0,
     "where the model runs: auto (cuda:0 when a GPU is usable, else cpu), cpu, cuda or cuda:N (on CUDA the "
     "roofline is the device's copy bandwidth)"},
    {"prompt-tokens", CONFIG_INT, "128", 1, 1 << 20, "synthetic prompt tokens of each sequence"},
    {"gen-tokens", CONFIG_INT, "128", 1, 1 << 20, "decode steps after the prompt"},
    {"batch", CONFIG_INT, "1", 1, 256, "sequences prefilled and decoded together"},
    {"max-batch-tokens", CONFIG_INT, "256", 32, 1 << 16, "tokens in one forward pass (prefill chunk)"},
    {"repeat", CONFIG_INT, "5", 1, 1000,
     "bandwidth passes before decoding (best counts) and verify passes (median counts)"},
    {"bandwidth-mib", CONFIG_INT, "auto", 16, 1 << 16,
     "buffer read to measure bandwidth (auto: 8x the last-level cache, 256..1024 MiB)"},
    {"threads", CONFIG_INT, "auto", 1, POOL_MAX_THREADS, "compute threads (auto: the CPUs this process may use)"},
    SVC_ACT_BITS_OPTION,
    SETUP_TP_OPTION,
    SETUP_ALLREDUCE_OPTION,
    SETUP_TP_DEVICES_OPTION,
    MEMPLAN_GRAPHS_OPTION,
    MEMPLAN_DETERMINISTIC_OPTION,
    {"log-level", CONFIG_STRING, "warn", 0, 0, "debug, info, warn, error or off"},
    {"oracle-accept", CONFIG_INT, "0", 0, 62,
     "speculate with an oracle draft instead of --draft: the target's own greedy tokens, this many right then one "
     "wrong, so every step's acceptance length is this + 1 (0: off)"},
    DRAFT_LINK_OPTIONS,
};

#define VERIFY_SIZES 6
static const int32_t verify_sizes[VERIFY_SIZES] = {1, 2, 4, 8, 16, 32};
#define VERIFY_MAX 32
#define BENCH_WINDOWS 8 /* decode windows, each followed by a bandwidth reading */

static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* ---- memory bandwidth ------------------------------------------------ */

typedef struct bw_job {
    uint64_t *buf; /* [n] */
    size_t n;
    uint64_t sums[POOL_MAX_THREADS]; /* one per task, so the reads cannot be elided */
} bw_job;

static void bw_slice(const bw_job *j, int task, int n_tasks, size_t *lo, size_t *hi) {
    size_t per = (j->n / (size_t)n_tasks + 7) & ~(size_t)7;
    *lo = per * (size_t)task;
    *hi = *lo + per;
    if (*lo > j->n) *lo = j->n;
    if (*hi > j->n) *hi = j->n;
}

/* Each thread first touches its own slice, so its pages are local. */
static void bw_fill(void *ctx, int task, int n_tasks) {
    bw_job *j = ctx;
    size_t lo, hi;
    bw_slice(j, task, n_tasks, &lo, &hi);
    for (size_t i = lo; i < hi; i++) j->buf[i] = i;
}

/* Eight independent sums keep the loop bound by loads, not by the latency
 * of one chain of additions. */
static void bw_sum(void *ctx, int task, int n_tasks) {
    bw_job *j = ctx;
    size_t lo, hi;
    bw_slice(j, task, n_tasks, &lo, &hi);
    const uint64_t *p = j->buf;
    /* Named variables, not an array: gcc keeps an array of sums on the
     * stack, and the store-to-load chain then caps the rate below DRAM's. */
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
    size_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        s0 += p[i];
        s1 += p[i + 1];
        s2 += p[i + 2];
        s3 += p[i + 3];
        s4 += p[i + 4];
        s5 += p[i + 5];
        s6 += p[i + 6];
        s7 += p[i + 7];
    }
    for (; i < hi; i++) s0 += p[i];
    j->sums[task] = s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7;
}

/* A buffer larger than the caches, filled, and a pool to read it; or,
 * on a GPU, the device's copy bandwidth over a buffer of that size. */
typedef struct bw_probe {
    pool *pool;
    bw_job *job;
    int threads;
    kn_cuda_copy_gbps_fn gpu; /* set: measure the device instead */
    size_t gpu_bytes;
} bw_probe;

static void bw_probe_free(bw_probe *b) {
    pool_free(b->pool);
    if (b->job) free(b->job->buf);
    free(b->job);
    memset(b, 0, sizeof *b);
}

static int bw_probe_init(bw_probe *b, size_t bytes, int threads, const kn_device *dev, ae_error *err) {
    memset(b, 0, sizeof *b);
    if (dev->kind == KN_DEVICE_CUDA) {
        if (!dev->copy_gbps) return err_set(err, "the CUDA plugin has no %s", KN_CUDA_COPY_GBPS);
        b->gpu = dev->copy_gbps;
        b->gpu_bytes = bytes;
        return AE_OK;
    }
    b->threads = threads;
    b->job = calloc(1, sizeof *b->job);
    if (!b->job) return err_set(err, "out of memory");
    b->job->n = bytes / sizeof(uint64_t);
    b->job->buf = malloc(b->job->n * sizeof(uint64_t));
    if (!b->job->buf) {
        bw_probe_free(b);
        return err_set(err, "out of memory for a %zu MiB bandwidth buffer", bytes >> 20);
    }
    if (pool_init(&b->pool, threads, err) != AE_OK) {
        bw_probe_free(b);
        return AE_ERR;
    }
    pool_run(b->pool, bw_fill, b->job, threads);
    return AE_OK;
}

/* Read bandwidth of one pass over the buffer, in bytes per second; on a
 * GPU, bytes read and written per second of 10 device copies. */
static double bw_probe_pass(bw_probe *b) {
    if (b->gpu) return b->gpu(b->gpu_bytes, 10) * 1e9;
    double t0 = clock_mono_seconds();
    pool_run(b->pool, bw_sum, b->job, b->threads);
    double t = clock_mono_seconds() - t0;
    uint64_t check = 0;
    for (int i = 0; i < b->threads; i++) check += b->job->sums[i];
    LOG_DEBUGF("bench bandwidth_checksum=%llu", (unsigned long long)check);
    return t > 0 ? (double)(b->job->n * sizeof(uint64_t)) / t : 0;
}

static double median_of(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cli_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static int64_t auto_bandwidth_mib(void) {
    long llc = 0;
#ifdef _SC_LEVEL3_CACHE_SIZE
    llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
    int64_t mib = llc > 0 ? 8 * (((int64_t)llc + (1 << 20) - 1) >> 20) : 256;
    return mib < 256 ? 256 : mib > 1024 ? 1024 : mib;
}

/* ---- the engine passes ------------------------------------------------ */

typedef struct bench {
    engine *e;
    int32_t vocab;
    int32_t batch;
    int32_t max_batch_tokens;
    int32_t *seqs;      /* [batch] */
    int32_t *prompts;   /* [batch][prompt_tokens] */
    int32_t *next;      /* [batch] the token each sequence decodes next */
    engine_item *items; /* [batch] */
    float *logits;      /* [max(batch, VERIFY_MAX)][vocab] */
    int32_t *ids;       /* [batch] each row's argmax: the greedy passes bring back only these, as the target does */
    kn_comm_stats verify_ar[VERIFY_SIZES]; /* the allreduces of the last verify pass of each size */
} bench;

/* Prefills seqs[0..n) with prompts of `len` tokens, packing chunks of
 * several sequences into one pass; next[i] gets each one's greedy token. */
static int prefill(bench *b, const int32_t *seqs, int32_t n, const int32_t *prompts, int32_t len, int32_t *next,
                   ae_error *err) {
    int32_t first = 0, done = 0; /* first sequence not yet filled, and its tokens already in */
    while (first < n) {
        int32_t n_items = 0, budget = b->max_batch_tokens, end = 0;
        for (int32_t s = first; s < n && budget > 0; s++) {
            int32_t from = s == first ? done : 0, k = len - from < budget ? len - from : budget;
            b->items[n_items++] =
                (engine_item){seqs[s], ENGINE_APPEND, k, prompts + (size_t)s * (size_t)len + (size_t)from, NULL, false};
            budget -= k;
            end = from + k;
        }
        engine_outputs eo = {.logits = b->logits, .ids = b->ids};
        if (engine_step(b->e, b->items, n_items, &eo, err) != AE_OK) return AE_ERR;
        /* Every item but the last completes its sequence; the last may stop
         * short when the pass is full. */
        int32_t n_complete = end == len ? n_items : n_items - 1;
        for (int32_t i = 0; i < n_complete; i++) next[first + i] = b->ids[i];
        done = end == len ? 0 : end;
        first += n_complete;
    }
    return AE_OK;
}

/* One decode step: every sequence appends its next token. */
static int decode_step(bench *b, ae_error *err) {
    for (int32_t i = 0; i < b->batch; i++)
        b->items[i] = (engine_item){b->seqs[i], ENGINE_APPEND, 1, &b->next[i], NULL, false};
    engine_outputs eo = {.logits = b->logits, .ids = b->ids};
    if (engine_step(b->e, b->items, b->batch, &eo, err) != AE_OK) return AE_ERR;
    memcpy(b->next, b->ids, (size_t)b->batch * sizeof(int32_t));
    return AE_OK;
}

/* Seconds of one verify pass of a chain of n tokens; commits nothing. */
static int verify_pass(bench *b, int32_t seq, int32_t n, double *seconds, ae_error *err) {
    static const int32_t none[1] = {0};
    int32_t tokens[VERIFY_MAX], parents[VERIFY_MAX];
    for (int32_t i = 0; i < n; i++) {
        tokens[i] = (int32_t)((uint32_t)(i * 7919 + 13) % (uint32_t)b->vocab);
        parents[i] = i - 1;
    }
    engine_item it = {seq, ENGINE_TREE, n, tokens, parents, false};
    double t0 = clock_mono_seconds();
    if (engine_step(b->e, &it, 1, &(engine_outputs){.logits = b->logits}, err) != AE_OK) return AE_ERR;
    *seconds = clock_mono_seconds() - t0;
    for (int k = 0; k < VERIFY_SIZES; k++)
        if (verify_sizes[k] == n) b->verify_ar[k] = engine_get_comm_stats(b->e).last;
    return engine_commit_path(b->e, seq, none, 0, err);
}

/* ---- speculative against plain decoding ---------------------------------- */

#define SPEC_ROUNDS 3 /* alternating rounds of each; the medians count */

/* New, empty sequences for the batch (the previous ones are freed). */
static int fresh_seqs(bench *b, ae_error *err) {
    for (int32_t i = 0; i < b->batch; i++) {
        engine_seq_free(b->e, b->seqs[i]);
        if (engine_seq_new(b->e, &b->seqs[i], err) != AE_OK) return AE_ERR;
    }
    return AE_OK;
}

/* Plain greedy decoding of n_gen tokens per sequence into out[batch][n_gen];
 * *secs: the decode steps only. */
static int plain_round(bench *b, int32_t n_prompt, int32_t n_gen, int32_t *out, double *secs, ae_error *err) {
    if (fresh_seqs(b, err) != AE_OK || prefill(b, b->seqs, b->batch, b->prompts, n_prompt, b->next, err) != AE_OK)
        return AE_ERR;
    double t0 = clock_mono_seconds();
    for (int32_t g = 0; g < n_gen; g++) {
        for (int32_t i = 0; i < b->batch; i++) out[(size_t)i * (size_t)n_gen + (size_t)g] = b->next[i];
        if (decode_step(b, err) != AE_OK) return AE_ERR;
    }
    *secs = clock_mono_seconds() - t0;
    return AE_OK;
}

/* The same with speculation: all sequences step together until each has
 * n_gen tokens. */
static int spec_round(bench *b, spec *sx, int32_t n_prompt, int32_t n_gen, int32_t *out, double *secs, ae_error *err) {
    static const sample_params greedy = {0, 0, 1, 0};
    int rc = fresh_seqs(b, err);
    spec_in *in = malloc(sizeof *in * (size_t)b->batch);
    spec_out *o = malloc(sizeof *o * (size_t)b->batch);
    int32_t *got = calloc((size_t)b->batch, sizeof *got);
    sample_rng rng; /* greedy draws nothing */
    sample_rng_seed(&rng, 0);
    if (!in || !o || !got) rc = err_set(err, "out of memory");
    for (int32_t i = 0; rc == AE_OK && i < b->batch; i++)
        rc = spec_seq_start(sx, b->seqs[i], b->prompts + (size_t)i * (size_t)n_prompt, n_prompt, b->max_batch_tokens,
                            err);
    double t0 = clock_mono_seconds();
    while (rc == AE_OK) {
        int32_t n = 0;
        for (int32_t i = 0; i < b->batch; i++)
            if (got[i] < n_gen) in[n++] = (spec_in){.seq = b->seqs[i], .params = &greedy, .rng = &rng};
        if (n == 0) break;
        if ((rc = spec_step(sx, in, n, o, err)) != AE_OK) break;
        for (int32_t j = 0, i = 0; j < n; j++, i++) {
            while (b->seqs[i] != in[j].seq) i++;
            for (int32_t k = 0; k < o[j].n && got[i] < n_gen; k++)
                out[(size_t)i * (size_t)n_gen + (size_t)got[i]++] = o[j].tokens[k];
        }
    }
    *secs = clock_mono_seconds() - t0;
    for (int32_t i = 0; i < b->batch; i++) spec_seq_end(sx, b->seqs[i]);
    free(in);
    free(o);
    free(got);
    return rc;
}

/* Plain and speculative decoding of the same prompts, in alternating
 * rounds, with drafter d; adds both rates, their ratio, whether the tokens
 * were the same, and the acceptance figures to o. *ref, when given, is
 * pointed at each round's plain output before its speculative round (the
 * oracle reads it). */
static int spec_rounds(bench *b, const spec_drafter *d, const int32_t capture[CAPTURE_LAYERS], const spec_shape *shape,
                       int32_t n_prompt, int32_t n_gen, const int32_t **ref, cJSON *o, ae_error *err) {
    const engine_config *ec = engine_get_config(b->e);
    spec_config sc = spec_config_default(*shape, ec->max_seqs, ec->max_batch_tokens);
    memcpy(sc.capture, capture, sizeof sc.capture);
    spec *sx = NULL;
    size_t n_out = (size_t)b->batch * (size_t)n_gen;
    int32_t *plain_out = malloc(sizeof(int32_t) * n_out), *spec_out_ids = malloc(sizeof(int32_t) * n_out);
    double plain_rate[SPEC_ROUNDS], spec_rate[SPEC_ROUNDS];
    bool identical = true;
    int rc = plain_out && spec_out_ids ? AE_OK : err_set(err, "out of memory");
    if (rc == AE_OK) rc = spec_init(&sx, b->e, d, &sc, err);
    for (int r = 0; rc == AE_OK && r < SPEC_ROUNDS; r++) {
        double tp, ts;
        if ((rc = plain_round(b, n_prompt, n_gen, plain_out, &tp, err)) != AE_OK) break;
        if (ref) *ref = plain_out;
        if ((rc = spec_round(b, sx, n_prompt, n_gen, spec_out_ids, &ts, err)) != AE_OK) break;
        plain_rate[r] = (double)n_out / tp;
        spec_rate[r] = (double)n_out / ts;
        identical &= memcmp(plain_out, spec_out_ids, n_out * sizeof(int32_t)) == 0;
    }
    if (rc == AE_OK) {
        double pr = median_of(plain_rate, SPEC_ROUNDS), sr = median_of(spec_rate, SPEC_ROUNDS);
        cJSON_AddNumberToObject(o, "plain_decode_tok_per_s", cli_round(pr, 1e2));
        cJSON_AddNumberToObject(o, "spec_decode_tok_per_s", cli_round(sr, 1e2));
        cJSON_AddNumberToObject(o, "spec_speedup", cli_round(sr / pr, 1e3));
        cJSON_AddBoolToObject(o, "spec_output_identical", identical);
        cli_spec_stats_json(o, spec_total_stats(sx), shape);
    }
    spec_free(sx);
    free(plain_out);
    free(spec_out_ids);
    return rc;
}

/* The same with the EAGLE-3 head of --draft, in this process. */
static int compare_spec(bench *b, const config *c, const model *m, int32_t n_prompt, int32_t n_gen, int threads,
                        cJSON *o, ae_error *err) {
    spec_shape shape;
    eagle_weights weights;
    if (draft_link_settings(c, &shape, &weights, err) != AE_OK) return AE_ERR;
    if (b->batch * shape.tokens > b->max_batch_tokens)
        return err_set(err, "--batch %d x --spec-tokens %d exceeds --max-batch-tokens %d", b->batch, shape.tokens,
                       b->max_batch_tokens);
    const engine_config *ec = engine_get_config(b->e);
    drafter_config dc = {ec->max_seqs, ec->max_seq_len, b->max_batch_tokens, threads, engine_pool(b->e), ec->act_bits};
    draft_link link;
    int32_t capture[CAPTURE_LAYERS];
    if (draft_link_open(&link, config_str(c, "draft"), model_embedding(m), weights, &dc, err) != AE_OK) return AE_ERR;
    int rc = draft_link_capture(&link, capture, err);
    if (rc == AE_OK) {
        cJSON_AddStringToObject(o, "draft", config_str(c, "draft"));
        cJSON_AddStringToObject(o, "draft_weights", config_str(c, "draft-weights"));
        rc = spec_rounds(b, &link.iface, capture, &shape, n_prompt, n_gen, NULL, o, err);
    }
    draft_link_close(&link);
    return rc;
}

/* ---- the oracle draft ------------------------------------------------------ */

/* A drafter that knows the target's greedy continuation (the plain round's
 * output for the same prompts) and proposes a chain of `accept` right
 * tokens, then a wrong one: every verify pass accepts exactly `accept`
 * drafts and adds the target's own token, so the acceptance length is
 * accept + 1 whatever a head would have learned. What speculation then
 * gains or loses is the system's cost alone (verify passes, features,
 * bookkeeping).
 *
 * A feed's last pair carries the next tree's root, the token at position
 * `held` (start + n pairs) of prompt ++ output (EAGLE-3 pairs position
 * i's feature with token i + 1); the chain continues from there. A root
 * that is not that token (an assumption broken) gets no tree, and is
 * counted. */
typedef struct oracle {
    const bench *b;
    int32_t n_prompt, n_gen, accept;
    const int32_t *ref; /* [batch][n_gen]: plain decoding's output */
    int64_t misaligned;
} oracle;

/* Token p of prompt ++ output of bench sequence i; -1 past the end. */
static int32_t oracle_token(const oracle *o, int32_t i, int64_t p) {
    if (p < o->n_prompt) return o->b->prompts[(size_t)i * (size_t)o->n_prompt + (size_t)p];
    p -= o->n_prompt;
    return p < o->n_gen ? o->ref[(size_t)i * (size_t)o->n_gen + (size_t)p] : -1;
}

static int oracle_propose(void *ctx, const spec_feed *feeds, int32_t n, const spec_shape *shape, spec_tree *trees,
                          ae_error *err) {
    (void)err;
    oracle *o = ctx;
    for (int32_t f = 0; f < n; f++) {
        const spec_feed *fd = &feeds[f];
        spec_tree *t = &trees[f];
        t->n = 0;
        int32_t i = 0;
        while (i < o->b->batch && o->b->seqs[i] != fd->seq) i++;
        if (!fd->want_tree || fd->n == 0 || i == o->b->batch) continue;
        int64_t held = (int64_t)fd->start + fd->n;
        int32_t root = fd->tokens[fd->n - 1];
        if (oracle_token(o, i, held) != root) {
            o->misaligned++;
            continue;
        }
        t->tokens[0] = root;
        t->parents[0] = -1;
        t->probs[0] = 1.0f;
        t->n = 1;
        for (int32_t k = 1; k <= o->accept + 1 && t->n < shape->tokens && t->n < SPEC_MAX_TREE; k++) {
            int32_t next = oracle_token(o, i, held + k);
            if (next < 0) break;
            if (k == o->accept + 1) next = (next + 1) % o->b->vocab; /* the wrong one */
            t->tokens[t->n] = next;
            t->parents[t->n] = t->n - 1;
            t->probs[t->n] = 1.0f;
            t->n++;
        }
    }
    return AE_OK;
}

static void oracle_release(void *ctx, int32_t seq) { (void)ctx, (void)seq; }

static int compare_oracle(bench *b, const model *m, int32_t n_prompt, int32_t n_gen, int32_t accept, cJSON *o,
                          ae_error *err) {
    spec_shape shape = {accept + 1, 1, accept + 2}; /* a chain: root, accept right, one wrong */
    if (b->batch * shape.tokens > b->max_batch_tokens)
        return err_set(err, "--batch %d x %d tree nodes exceeds --max-batch-tokens %d", b->batch, shape.tokens,
                       b->max_batch_tokens);
    oracle orc = {.b = b, .n_prompt = n_prompt, .n_gen = n_gen, .accept = accept};
    spec_drafter d = {.ctx = &orc, .propose = oracle_propose, .release = oracle_release};
    int32_t capture[CAPTURE_LAYERS];
    capture_default_layers(m->cfg.n_layers, capture);
    cJSON_AddStringToObject(o, "draft", "oracle");
    cJSON_AddNumberToObject(o, "oracle_accept", accept);
    int rc = spec_rounds(b, &d, capture, &shape, n_prompt, n_gen, &orc.ref, o, err);
    if (rc == AE_OK) cJSON_AddNumberToObject(o, "oracle_misaligned", (double)orc.misaligned);
    return rc;
}

static int run(const config *cc, int argc, char **argv, ae_error *err) {
    config *c = (config *)cc; /* auto values are resolved here */
    if (argc > 0) return err_set(err, "unexpected argument \"%s\"", argv[0]), CLI_EXIT_USAGE;
    if (config_is_auto(c, "threads")) config_set_auto_int(c, "threads", pool_cpu_count());
    kn_device dev;
    if (kn_device_open(config_str(c, "device"), &dev, err) != AE_OK) return CLI_EXIT_USAGE;
    if (config_is_auto(c, "device")) config_set_auto_str(c, "device", dev.name);
    /* A GPU's last-level cache is tens of MiB; 1 GiB is far past it. */
    if (config_is_auto(c, "bandwidth-mib"))
        config_set_auto_int(c, "bandwidth-mib", dev.kind == KN_DEVICE_CUDA ? 1024 : auto_bandwidth_mib());
    double t_start = clock_mono_seconds();
    const char *path = config_str(c, "model");
    int32_t n_prompt = (int32_t)config_int(c, "prompt-tokens"), n_gen = (int32_t)config_int(c, "gen-tokens");
    int32_t batch = (int32_t)config_int(c, "batch"), max_batch_tokens = (int32_t)config_int(c, "max-batch-tokens");
    int threads = (int)config_int(c, "threads"), reps = (int)config_int(c, "repeat");
    model *m = NULL;
    bench b = {0};
    bw_probe probe = {0};
    double *times = NULL;
    int rc = CLI_EXIT_USAGE;
    if (!path) return err_set(err, "no model given (use --model FILE)"), CLI_EXIT_USAGE;
    if (batch > max_batch_tokens)
        return err_set(err, "--batch %d exceeds --max-batch-tokens %d", batch, max_batch_tokens), CLI_EXIT_USAGE;
    int32_t act_bits;
    if (svc_act_bits(c, &act_bits, err) != AE_OK) return CLI_EXIT_USAGE;

    if (model_load(&m, path, dev.be, err) != AE_OK) goto out;
    /* Speculation verifies trees of up to ENGINE_MAX_TREE nodes past the
     * generated tokens. */
    int32_t seq_len =
        n_prompt + (n_gen > VERIFY_MAX ? n_gen : VERIFY_MAX) + (config_str(c, "draft") ? ENGINE_MAX_TREE : 0);
    if (seq_len > m->cfg.context_length) {
        err_set(err, "prompt-tokens (%d) + max(gen-tokens, %d) exceeds the model's context of %d", n_prompt, VERIFY_MAX,
                m->cfg.context_length);
        goto out;
    }
    /* Before the engine exists, so its KV cache does not share the memory. */
    if (bw_probe_init(&probe, (size_t)config_int(c, "bandwidth-mib") << 20, threads, &dev, err) != AE_OK) goto out;
    double bw_best = 0;
    for (int r = 0; r < reps; r++) {
        double bw = bw_probe_pass(&probe);
        if (bw > bw_best) bw_best = bw;
    }
    int32_t block = 16, blocks_per_seq = (seq_len + block - 1) / block;
    /* The batch's sequences, and one more for warm-up and verification. */
    engine_config ec = {max_batch_tokens, batch + 1, seq_len, (batch + 1) * blocks_per_seq * block, block,
                        threads,          act_bits};
    b.vocab = m->cfg.vocab;
    b.batch = batch;
    b.max_batch_tokens = max_batch_tokens;
    int32_t rows = batch > VERIFY_MAX ? batch : VERIFY_MAX;
    b.seqs = malloc(sizeof(int32_t) * (size_t)(batch + 1));
    b.prompts = malloc(sizeof(int32_t) * (size_t)(batch + 1) * (size_t)n_prompt);
    b.next = malloc(sizeof(int32_t) * (size_t)(batch + 1));
    b.ids = malloc(sizeof(int32_t) * (size_t)(batch + 1));
    b.items = malloc(sizeof(engine_item) * (size_t)(batch + 1));
    b.logits = malloc(sizeof(float) * (size_t)rows * (size_t)b.vocab);
    times = malloc(sizeof(double) * (size_t)reps * VERIFY_SIZES);
    if (!b.seqs || !b.prompts || !b.next || !b.ids || !b.items || !b.logits || !times) {
        err_set(err, "out of memory");
        goto out;
    }
    for (int32_t s = 0; s <= batch; s++) {
        uint64_t st = 1 + (uint64_t)s;
        for (int32_t t = 0; t < n_prompt; t++)
            b.prompts[(size_t)s * (size_t)n_prompt + (size_t)t] = (int32_t)(splitmix64(&st) % (uint64_t)b.vocab);
    }
    if (engine_init(&b.e, m, &ec, err) != AE_OK) goto out;
    const int32_t tp = (int32_t)config_int(c, "tp");
    if (setup_tp(c, b.e, m, &dev, err) != AE_OK) goto out;
    if (engine_set_fast(b.e, !config_bool(c, "deterministic"), err) != AE_OK) goto out;
    { /* The graphs held to the bytes a memory plan would give them. */
        int32_t n_graphs = memplan_graphs(c, !kn_backend_host_memory(m->be) && kn_backend_has_graphs(m->be));
        engine_set_graphs(b.e, n_graphs,
                          (uint64_t)n_graphs * FORWARD_GRAPH_NODES(m->cfg.n_layers, engine_fast(b.e)) *
                                  KN_GRAPH_NODE_BYTES +
                              KN_GRAPH_BYTES_GRAIN);
    }
    for (int32_t s = 0; s <= batch; s++)
        if (engine_seq_new(b.e, &b.seqs[s], err) != AE_OK) goto out;
    LOG_INFOF("bench model=%s batch=%d prompt_tokens=%d gen_tokens=%d threads=%d simd=%s", path, batch, n_prompt, n_gen,
              threads, dev.kind == KN_DEVICE_CUDA ? dev.info.name : kn_cpu_simd());

    /* Warm-up: the verify sequence's prefix pages the weights in. */
    int32_t vseq = b.seqs[batch], vnext;
    if (prefill(&b, &vseq, 1, b.prompts + (size_t)batch * (size_t)n_prompt, n_prompt, &vnext, err) != AE_OK) goto out;

    double t0 = clock_mono_seconds();
    if (prefill(&b, b.seqs, batch, b.prompts, n_prompt, b.next, err) != AE_OK) goto out;
    double t_prefill = clock_mono_seconds() - t0;
    /* Decode runs in windows, each followed by one pass of the bandwidth
     * probe. This host's bandwidth jumps between ~35 and ~56 GB/s as its
     * neighbours' load changes, every few seconds; a window's decode rate
     * is compared with the bandwidth read right after it, and the fraction
     * reported is the median over windows. The fraction against the best
     * reading of the whole run is reported too. */
    int n_win = n_gen < BENCH_WINDOWS ? n_gen : BENCH_WINDOWS;
    double win_frac[BENCH_WINDOWS], win_bw[BENCH_WINDOWS], t_decode = 0;
    size_t weight_bytes = model_decode_bytes(m);
    for (int w = 0; w < n_win; w++) {
        int32_t steps = n_gen * (w + 1) / n_win - n_gen * w / n_win;
        t0 = clock_mono_seconds();
        for (int32_t i = 0; i < steps; i++)
            if (decode_step(&b, err) != AE_OK) goto out;
        double t = clock_mono_seconds() - t0;
        t_decode += t;
        win_bw[w] = bw_probe_pass(&probe);
        if (win_bw[w] > bw_best) bw_best = win_bw[w];
        win_frac[w] = (double)steps / t / (win_bw[w] / (double)weight_bytes);
    }
    const kn_comm_stats decode_ar = engine_get_comm_stats(b.e).last; /* a decode pass's */
    double win_in_order[BENCH_WINDOWS];
    memcpy(win_in_order, win_frac, sizeof win_frac);
    double frac = median_of(win_frac, n_win), bandwidth = median_of(win_bw, n_win);

    /* Sizes interleaved, so drift in the machine's speed hits them alike. */
    for (int r = 0; r < reps; r++)
        for (int k = 0; k < VERIFY_SIZES; k++)
            if (verify_pass(&b, vseq, verify_sizes[k], &times[k * reps + r], err) != AE_OK) goto out;
    double median[VERIFY_SIZES];
    for (int k = 0; k < VERIFY_SIZES; k++) {
        qsort(times + k * reps, (size_t)reps, sizeof(double), cli_cmp_double);
        median[k] =
            reps % 2 ? times[k * reps + reps / 2] : 0.5 * (times[k * reps + reps / 2 - 1] + times[k * reps + reps / 2]);
    }

    double step_rate = cli_round((double)n_gen / t_decode, 1e3);
    double roofline = cli_round(bandwidth / (double)weight_bytes, 1e3);
    cJSON *o = cJSON_CreateObject(), *vc = NULL;
    if (!o) {
        err_set(err, "out of memory");
        goto out;
    }
    cJSON_AddStringToObject(o, "model", path);
    cJSON_AddStringToObject(o, "device", dev.kind == KN_DEVICE_CUDA ? dev.info.name : "cpu");
    cJSON_AddStringToObject(o, "simd", kn_cpu_simd());
    cJSON_AddNumberToObject(o, "threads", threads);
    cJSON_AddNumberToObject(o, "act_bits", act_bits);
    cJSON_AddBoolToObject(o, "deterministic", !engine_fast(b.e)); /* the CPU backend has only that mode */
    cJSON_AddNumberToObject(o, "batch", batch);
    cJSON_AddNumberToObject(o, "prompt_tokens", n_prompt);
    cJSON_AddNumberToObject(o, "gen_tokens", n_gen);
    cJSON_AddNumberToObject(o, "prefill_tok_per_s", cli_round((double)batch * n_prompt / t_prefill, 1e2));
    cJSON_AddNumberToObject(o, "decode_tok_per_s", cli_round((double)batch * n_gen / t_decode, 1e2));
    cJSON_AddNumberToObject(o, "decode_step_per_s", step_rate);
    cJSON_AddNumberToObject(o, "weight_bytes_per_step", (double)weight_bytes);
    cJSON_AddNumberToObject(o, "bandwidth_gb_per_s", cli_round(bandwidth / 1e9, 1e3));
    cJSON_AddNumberToObject(o, "bandwidth_best_gb_per_s", cli_round(bw_best / 1e9, 1e3));
    cJSON_AddNumberToObject(o, "bandwidth_mib", (double)config_int(c, "bandwidth-mib"));
    cJSON_AddNumberToObject(o, "roofline_tok_per_s", roofline);
    cJSON_AddNumberToObject(o, "roofline_fraction", cli_round(frac, 1e4));
    cJSON *windows = cJSON_AddArrayToObject(o, "roofline_fraction_windows");
    for (int w = 0; windows && w < n_win; w++)
        cJSON_AddItemToArray(windows, cJSON_CreateNumber(cli_round(win_in_order[w], 1e4)));
    cJSON_AddNumberToObject(o, "roofline_fraction_vs_best",
                            cli_round(step_rate / (bw_best / (double)weight_bytes), 1e4));
    cJSON_AddNumberToObject(o, "verify_context", n_prompt);
    cJSON_AddNumberToObject(o, "verify_1_ms", cli_round(median[0] * 1e3, 1e3));
    cJSON_AddItemToObject(o, "verify_cost", vc = cJSON_CreateObject());
    for (int k = 0; vc && k < VERIFY_SIZES; k++) {
        char key[8];
        snprintf(key, sizeof key, "%d", verify_sizes[k]);
        cJSON_AddNumberToObject(vc, key, k == 0 ? 1.0 : cli_round(median[k] / median[0], 1e3));
    }
    int32_t accept = (int32_t)config_int(c, "oracle-accept");
    if (accept > 0 ? compare_oracle(&b, m, n_prompt, n_gen, accept, o, err) != AE_OK
                   : config_str(c, "draft") && compare_spec(&b, c, m, n_prompt, n_gen, threads, o, err) != AE_OK) {
        cJSON_Delete(o);
        goto out;
    }
    engine_graph_stats gs = engine_get_graph_stats(b.e);
    /* Every allreduce of a pass (issue: count them): rank 0's calls,
     * bytes and wall time, for a decode pass of `batch` tokens and each
     * verify size. */
    cJSON_AddNumberToObject(o, "tp", tp);
    cJSON_AddStringToObject(o, "allreduce", tp > 1 ? kn_allreduce_name(engine_allreduce(b.e)) : "none");
    cJSON_AddNumberToObject(o, "allreduces_per_step", (double)decode_ar.calls);
    cJSON_AddNumberToObject(o, "allreduce_bytes_per_step", (double)decode_ar.bytes);
    cJSON_AddNumberToObject(o, "allreduce_ms_per_step", cli_round((double)decode_ar.ns / 1e6, 1e3));
    cJSON *var = cJSON_AddObjectToObject(o, "verify_allreduces");
    for (int k = 0; var && k < VERIFY_SIZES; k++) {
        char key[16];
        snprintf(key, sizeof key, "%d", verify_sizes[k]);
        cJSON *one = cJSON_AddObjectToObject(var, key);
        if (!one) break;
        cJSON_AddNumberToObject(one, "calls", (double)b.verify_ar[k].calls);
        cJSON_AddNumberToObject(one, "bytes", (double)b.verify_ar[k].bytes);
        cJSON_AddNumberToObject(one, "ms", cli_round((double)b.verify_ar[k].ns / 1e6, 1e3));
    }
    cJSON_AddNumberToObject(o, "cuda_graphs", gs.max_graphs);
    cJSON_AddNumberToObject(o, "graph_captures", (double)gs.captures);
    cJSON_AddNumberToObject(o, "graph_replays", (double)gs.replays);
    cJSON_AddNumberToObject(o, "graph_bytes", (double)gs.bytes);
    cJSON_AddNumberToObject(o, "graph_max_nodes", (double)gs.max_nodes);
    cJSON_AddNumberToObject(o, "wall_seconds", cli_round(clock_mono_seconds() - t_start, 1e2));
    if (cli_put_json_line(o, err) != AE_OK) goto out;
    rc = 0;
out:
    bw_probe_free(&probe);
    free(times);
    free(b.logits);
    free(b.items);
    free(b.next);
    free(b.ids);
    free(b.prompts);
    free(b.seqs);
    engine_free(b.e);
    model_free(m);
    return rc;
}

const cli_cmd cli_cmd_bench = {
    .name = "bench",
    .args = "--model M",
    .summary = "prefill, decode and verify speed against the bandwidth roofline (--draft: speculative "
               "against plain decoding), as one JSON line",
    .opts = opts,
    .n_opts = sizeof opts / sizeof opts[0],
    .run = run,
};
