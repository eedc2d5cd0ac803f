/* aerie make-model: a Llama-shaped GGUF with random weights, for speed
 * measurements and tests where no checkpoint can be fetched (a lent GPU
 * machine reaches no model hub, and has no llama.cpp to quantize with).
 * The values mean nothing; the shapes, types and bytes are those of the
 * named model, so a decode step reads what the real one would.
 *
 * Weights: every matrix is gaussian, std 0.02, from a generator seeded by
 * the tensor's place in the file and the row, so the file is the same
 * bytes on every machine and with any number of threads (it uses every
 * CPU); then quantized to its type by quant_quantize
 * (services/model/quant_encode.c), so each block holds what a quantizer
 * writes. Norms are f32 ones.
 *
 * Types: one for every matrix (bf16, f16, f32, q8_0, q4_0, q4_1, q5_0,
 * q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs, mxfp4), or one of
 * llama.cpp's mixes, q4_k_m and q5_k_m: Q4_K (Q5_K) but for output.weight
 * in Q6_K, and attn_v and ffn_down in Q6_K in the layers llama.cpp's
 * use_more_bits picks (the first and last eighth, and every third layer
 * between). As llama.cpp does, a matrix whose rows do not fill whole
 * 256-element super-blocks falls back: Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to
 * Q8_0, and Q2_K, Q3_K and IQ4_XS to IQ4_NL (the 135M shape's 576-wide
 * rows). Progress goes to stderr every GiB. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../services/core/pool.h"
#include "../services/model/quant.h"
#include "cli.h"

static const config_option opts[] = {
    {"shape", CONFIG_STRING, "llama-3.1-8b", 0, 0, "llama-3.1-8b or smollm2-135m"},
    {"type", CONFIG_STRING, "q4_0", 0, 0,
     "weight matrices: bf16, f16, f32, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs, "
     "mxfp4, or the mixes q4_k_m and q5_k_m"},
    {"layers", CONFIG_INT, "0", 0, 1024, "blocks (0: the shape's)"},
    {"vocab", CONFIG_INT, "0", 0, 1 << 24, "vocabulary (0: the shape's)"},
    {"out", CONFIG_STRING, NULL, 0, 0, "the .gguf file to write"},
    {"log-level", CONFIG_STRING, "warn", 0, 0, "debug, info, warn, error or off"},
};

typedef struct shape {
    const char *name;
    int64_t layers, hidden, ffn, heads, kv_heads, vocab, context;
    double rope_theta, eps;
} shape;

static const shape SHAPES[] = {
    {"llama-3.1-8b", 32, 4096, 14336, 32, 8, 128256, 8192, 500000.0, 1e-5},
    {"smollm2-135m", 30, 576, 1536, 9, 3, 49152, 8192, 100000.0, 1e-5},
};

typedef struct writer {
    FILE *f;
    const char *path;
    uint64_t written, next_report;
} writer;

static int put(writer *w, const void *p, size_t n, ae_error *err) {
    if (fwrite(p, 1, n, w->f) != n)
        return err_set(err, "%s: write failed after %" PRIu64 " bytes", w->path, w->written);
    w->written += n;
    if (w->written >= w->next_report) {
        fprintf(stderr, "make-model: %" PRIu64 " MiB written\n", w->written >> 20);
        w->next_report += 1ull << 30;
    }
    return AE_OK;
}
static int put_u32(writer *w, uint32_t v, ae_error *err) { return put(w, &v, 4, err); }
static int put_u64(writer *w, uint64_t v, ae_error *err) { return put(w, &v, 8, err); }
static int put_str(writer *w, const char *s, ae_error *err) {
    return put_u64(w, strlen(s), err) || put(w, s, strlen(s), err);
}

/* GGUF value types used here. */
enum { GV_UINT32 = 4, GV_FLOAT32 = 6, GV_STRING = 8 };

static int kv_u32(writer *w, const char *k, uint32_t v, ae_error *err) {
    return put_str(w, k, err) || put_u32(w, GV_UINT32, err) || put_u32(w, v, err);
}
static int kv_f32(writer *w, const char *k, float v, ae_error *err) {
    return put_str(w, k, err) || put_u32(w, GV_FLOAT32, err) || put(w, &v, 4, err);
}
static int kv_str(writer *w, const char *k, const char *v, ae_error *err) {
    return put_str(w, k, err) || put_u32(w, GV_STRING, err) || put_str(w, v, err);
}

typedef struct tensor {
    char name[64];
    int64_t rows, cols;
    ggml_type type;
    uint64_t bytes, offset;
} tensor;

/* ---- random weights ---------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* ln(q) for q in (0, 1), from + - * / alone, so that every machine gets
 * the same bits (libm's logf may differ in the last bit between builds):
 * q = m * 2^e with m in [sqrt(1/2), sqrt(2)) (q is normal: at least
 * 2^-46), ln m = 2 atanh(t) with t = (m - 1) / (m + 1), |t| < 0.172, by
 * its series to t^11. */
static float ln_unit(float q) {
    uint32_t b;
    memcpy(&b, &q, 4);
    int e = (int)((b >> 23) & 0xffu) - 126;
    b = (b & 0x007fffffu) | 0x3f000000u; /* m in [0.5, 1) */
    float m;
    memcpy(&m, &b, 4);
    if (m < 0.70710678f) {
        m *= 2.0f;
        e--;
    }
    float t = (m - 1.0f) / (m + 1.0f), t2 = t * t;
    float p = 1.0f / 11.0f;
    p = p * t2 + 1.0f / 9.0f;
    p = p * t2 + 1.0f / 7.0f;
    p = p * t2 + 1.0f / 5.0f;
    p = p * t2 + 1.0f / 3.0f;
    p = p * t2 + 1.0f;
    return 2.0f * t * p + (float)e * 0.693147181f;
}

/* n (even) gaussian values of standard deviation sd, by Marsaglia's polar
 * method: a point uniform in the square, kept when inside the unit
 * circle, gives two. Points are drawn and kept without branches a batch
 * at a time, then turned into values. */
static void gaussian_row(uint64_t seed, float sd, float *x, int64_t n) {
    enum { BATCH = 64 };
    float u[BATCH + 1], v[BATCH + 1], q[BATCH + 1];
    uint64_t s = seed;
    for (int64_t i = 0; i + 1 < n;) {
        int want = (int)((n - i) / 2 < BATCH ? (n - i) / 2 : BATCH), k = 0;
        while (k < want) {
            uint64_t r = splitmix64(&s);
            u[k] = (float)(r >> 40) * 0x1p-23f - 1.0f;
            v[k] = (float)((r >> 16) & 0xffffffu) * 0x1p-23f - 1.0f;
            q[k] = u[k] * u[k] + v[k] * v[k];
            k += q[k] > 0.0f && q[k] < 1.0f; /* a rejected point is overwritten */
        }
        for (int j = 0; j < want; j++) {
            float f = sqrtf(-2.0f * ln_unit(q[j]) / q[j]) * sd;
            x[i + 2 * j] = u[j] * f;
            x[i + 2 * j + 1] = v[j] * f;
        }
        i += 2 * want;
    }
}

/* One slab of rows of a tensor, made by the pool's threads: each task
 * takes a share of the rows, fills its scratch row and quantizes it into
 * its place in out. */
typedef struct slab {
    const tensor *t;
    uint64_t seed; /* the tensor's */
    int64_t row0, rows;
    size_t row_bytes;
    float *scratch; /* cols floats per task */
    uint8_t *out;
} slab;

static void slab_task(void *ctx, int task, int n_tasks) {
    slab *s = ctx;
    int64_t cols = s->t->cols;
    float *x = s->scratch + (size_t)task * (size_t)cols;
    for (int64_t r = s->rows * task / n_tasks; r < s->rows * (task + 1) / n_tasks; r++) {
        uint64_t row = (uint64_t)(s->row0 + r);
        gaussian_row(s->seed ^ (row * 0xd1342543de82ef95ull), 0.02f, x, cols);
        quant_quantize(s->t->type, x, s->out + (size_t)r * s->row_bytes, (uint64_t)cols);
    }
}

#define SLAB_BYTES (32u << 20)

/* t's data: a norm is ones, a matrix random weights in its type. */
static int put_data(writer *w, pool *p, const tensor *t, int64_t index, uint8_t *buf, float *scratch, ae_error *err) {
    if (t->type == GGML_TYPE_F32 && t->rows == 1) { /* a norm: ones */
        float *ones = (float *)(void *)buf;
        for (int64_t i = 0; i < t->cols; i++) ones[i] = 1.0f;
        return put(w, ones, (size_t)t->cols * sizeof(float), err);
    }
    size_t row_bytes = (size_t)quant_row_bytes(t->type, (uint64_t)t->cols);
    int64_t per_slab = (int64_t)(SLAB_BYTES / row_bytes);
    if (per_slab < 1) per_slab = 1;
    slab s = {.t = t, .row_bytes = row_bytes, .scratch = scratch, .out = buf};
    uint64_t seed = 0x6d616b652d6d6f64ull + (uint64_t)index;
    s.seed = splitmix64(&seed);
    for (int64_t r = 0; r < t->rows; r += per_slab) {
        s.row0 = r;
        s.rows = t->rows - r < per_slab ? t->rows - r : per_slab;
        pool_run(p, slab_task, &s, pool_threads(p));
        if (put(w, buf, (size_t)s.rows * row_bytes, err)) return AE_ERR;
    }
    return AE_OK;
}

/* ---- types --------------------------------------------------------------------- */

static const struct {
    const char *name;
    ggml_type t;
    bool mix; /* llama.cpp's _M mix around t */
} TYPE_NAMES[] = {
    {"bf16", GGML_TYPE_BF16, false},   {"f16", GGML_TYPE_F16, false},       {"f32", GGML_TYPE_F32, false},
    {"q8_0", GGML_TYPE_Q8_0, false},   {"q4_0", GGML_TYPE_Q4_0, false},     {"q4_1", GGML_TYPE_Q4_1, false},
    {"q5_0", GGML_TYPE_Q5_0, false},   {"q5_1", GGML_TYPE_Q5_1, false},     {"q2_k", GGML_TYPE_Q2_K, false},
    {"q3_k", GGML_TYPE_Q3_K, false},   {"q4_k", GGML_TYPE_Q4_K, false},     {"q5_k", GGML_TYPE_Q5_K, false},
    {"q6_k", GGML_TYPE_Q6_K, false},   {"iq4_nl", GGML_TYPE_IQ4_NL, false}, {"iq4_xs", GGML_TYPE_IQ4_XS, false},
    {"mxfp4", GGML_TYPE_MXFP4, false}, {"q4_k_m", GGML_TYPE_Q4_K, true},    {"q5_k_m", GGML_TYPE_Q5_K, true},
};

static int parse_type(const char *s, ggml_type *t, bool *mix, ae_error *err) {
    for (size_t i = 0; i < sizeof TYPE_NAMES / sizeof TYPE_NAMES[0]; i++)
        if (!strcmp(s, TYPE_NAMES[i].name)) {
            *t = TYPE_NAMES[i].t;
            *mix = TYPE_NAMES[i].mix;
            return AE_OK;
        }
    char names[256] = "";
    for (size_t i = 0; i < sizeof TYPE_NAMES / sizeof TYPE_NAMES[0]; i++) {
        size_t at = strlen(names);
        snprintf(names + at, sizeof names - at, "%s%s", i ? ", " : "", TYPE_NAMES[i].name);
    }
    return err_set(err, "--type %s: expected one of %s", s, names);
}

/* llama.cpp's use_more_bits: which layers of a _M mix get Q6_K for
 * attn_v and ffn_down. */
static bool more_bits(int64_t layer, int64_t layers) {
    return layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2;
}

static int run(const config *c, int argc, char **argv, ae_error *err) {
    (void)argc, (void)argv;
    const char *path = config_str(c, "out"), *sname = config_str(c, "shape");
    if (!path) return err_set(err, "no output given (use --out FILE)"), CLI_EXIT_USAGE;
    const shape *sh = NULL;
    for (size_t i = 0; i < sizeof SHAPES / sizeof SHAPES[0]; i++)
        if (!strcmp(sname, SHAPES[i].name)) sh = &SHAPES[i];
    if (!sh) return err_set(err, "--shape %s: expected llama-3.1-8b or smollm2-135m", sname), CLI_EXIT_USAGE;
    ggml_type type = GGML_TYPE_Q4_0;
    bool mix = false;
    if (parse_type(config_str(c, "type"), &type, &mix, err) != AE_OK) return CLI_EXIT_USAGE;
    shape s = *sh;
    if (config_int(c, "layers") > 0) s.layers = config_int(c, "layers");
    if (config_int(c, "vocab") > 0) s.vocab = config_int(c, "vocab");
    int64_t hd = s.hidden / s.heads;

    /* the tensors, in file order */
    int64_t n_t = 3 + 9 * s.layers;
    tensor *ts = calloc((size_t)n_t, sizeof *ts);
    if (!ts) return err_set(err, "out of memory"), CLI_EXIT_USAGE;
    int64_t k = 0;
#define T(nm, r, cl, ty) \
    (snprintf(ts[k].name, sizeof ts[k].name, "%s", nm), ts[k].rows = (r), ts[k].cols = (cl), ts[k].type = (ty), k++)
    T("token_embd.weight", s.vocab, s.hidden, type);
    T("output_norm.weight", 1, s.hidden, GGML_TYPE_F32);
    T("output.weight", s.vocab, s.hidden, mix ? GGML_TYPE_Q6_K : type);
    for (int64_t l = 0; l < s.layers; l++) {
        char nm[64];
        static const char *sfx[9] = {"attn_norm",   "ffn_norm", "attn_q", "attn_k",  "attn_v",
                                     "attn_output", "ffn_gate", "ffn_up", "ffn_down"};
        int64_t dims[9][2] = {{1, s.hidden},
                              {1, s.hidden},
                              {s.heads * hd, s.hidden},
                              {s.kv_heads * hd, s.hidden},
                              {s.kv_heads * hd, s.hidden},
                              {s.hidden, s.heads * hd},
                              {s.ffn, s.hidden},
                              {s.ffn, s.hidden},
                              {s.hidden, s.ffn}};
        for (int j = 0; j < 9; j++) {
            snprintf(nm, sizeof nm, "blk.%" PRId64 ".%s.weight", l, sfx[j]);
            ggml_type tt = j < 2 ? GGML_TYPE_F32 : type;
            if (mix && (j == 4 || j == 8) && more_bits(l, s.layers)) tt = GGML_TYPE_Q6_K; /* attn_v, ffn_down */
            T(nm, dims[j][0], dims[j][1], tt);
        }
    }
#undef T
    uint64_t off = 0, total = 0;
    int64_t max_cols = 0;
    for (int64_t i = 0; i < n_t; i++) {
        ts[i].type = quant_fit_type(ts[i].type, ts[i].cols);
        max_cols = ts[i].cols > max_cols ? ts[i].cols : max_cols;
        ts[i].bytes = (uint64_t)ts[i].rows * quant_row_bytes(ts[i].type, (uint64_t)ts[i].cols);
        ts[i].offset = off;
        off += (ts[i].bytes + 31) & ~(uint64_t)31;
        total += ts[i].bytes;
    }

    writer w = {.path = path, .next_report = 1ull << 30};
    int rc = CLI_EXIT_USAGE;
    int n_threads = pool_cpu_count(); /* the bytes do not depend on it */
    pool *workers = NULL;
    /* a slab, or one row if a row is larger; scratch rows for each thread */
    size_t buf_bytes = SLAB_BYTES > (size_t)max_cols * sizeof(float) ? SLAB_BYTES : (size_t)max_cols * sizeof(float);
    uint8_t *buf = malloc(buf_bytes);
    float *scratch = NULL;
    if (pool_init(&workers, n_threads, err) != AE_OK) goto out;
    scratch = malloc((size_t)pool_threads(workers) * (size_t)max_cols * sizeof(float));
    if (!buf || !scratch) {
        err_set(err, "out of memory");
        goto out;
    }
    w.f = fopen(path, "wb");
    if (!w.f) {
        err_set(err, "%s: cannot write it", path);
        goto out;
    }
    char name[96];
    snprintf(name, sizeof name, "random %s (%s)", s.name, config_str(c, "type"));
    if (put(&w, "GGUF", 4, err) || put_u32(&w, 3, err) || put_u64(&w, (uint64_t)n_t, err) || put_u64(&w, 11, err) ||
        kv_str(&w, "general.architecture", "llama", err) || kv_str(&w, "general.name", name, err) ||
        kv_u32(&w, "llama.block_count", (uint32_t)s.layers, err) ||
        kv_u32(&w, "llama.context_length", (uint32_t)s.context, err) ||
        kv_u32(&w, "llama.embedding_length", (uint32_t)s.hidden, err) ||
        kv_u32(&w, "llama.feed_forward_length", (uint32_t)s.ffn, err) ||
        kv_u32(&w, "llama.attention.head_count", (uint32_t)s.heads, err) ||
        kv_u32(&w, "llama.attention.head_count_kv", (uint32_t)s.kv_heads, err) ||
        kv_f32(&w, "llama.attention.layer_norm_rms_epsilon", (float)s.eps, err) ||
        kv_f32(&w, "llama.rope.freq_base", (float)s.rope_theta, err) || kv_u32(&w, "general.alignment", 32, err))
        goto out;
    for (int64_t i = 0; i < n_t; i++) {
        /* GGUF lists dimensions innermost first */
        if (put_str(&w, ts[i].name, err) || put_u32(&w, ts[i].rows == 1 ? 1 : 2, err) ||
            put_u64(&w, (uint64_t)ts[i].cols, err) || (ts[i].rows != 1 && put_u64(&w, (uint64_t)ts[i].rows, err)) ||
            put_u32(&w, (uint32_t)ts[i].type, err) || put_u64(&w, ts[i].offset, err))
            goto out;
    }
    static const uint8_t zeros[32];
    if (put(&w, zeros, (32 - w.written % 32) % 32, err)) goto out;
    for (int64_t i = 0; i < n_t; i++) {
        if (put_data(&w, workers, &ts[i], i, buf, scratch, err) ||
            put(&w, zeros, (size_t)(((ts[i].bytes + 31) & ~(uint64_t)31) - ts[i].bytes), err))
            goto out;
    }
    if (fclose(w.f) != 0) {
        w.f = NULL;
        err_set(err, "%s: close failed", path);
        goto out;
    }
    w.f = NULL;
    printf("{\"out\":\"%s\",\"shape\":\"%s\",\"type\":\"%s\",\"layers\":%" PRId64 ",\"vocab\":%" PRId64
           ",\"weight_bytes\":%" PRIu64 ",\"file_bytes\":%" PRIu64 "}\n",
           path, s.name, config_str(c, "type"), s.layers, s.vocab, total, w.written);
    rc = 0;
out:
    if (w.f) fclose(w.f);
    pool_free(workers);
    free(buf);
    free(scratch);
    free(ts);
    return rc;
}

const cli_cmd cli_cmd_make_model = {
    .name = "make-model",
    .args = "--out FILE",
    .summary = "writes a Llama-shaped GGUF with random weights (speed measurements with no checkpoint at hand)",
    .opts = opts,
    .n_opts = sizeof opts / sizeof opts[0],
    .run = run,
};
