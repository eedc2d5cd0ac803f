/* aerie make-model: a Llama-shaped GGUF with random weights, for speed
 * measurements where no checkpoint can be fetched (a lent GPU machine
 * reaches no model hub). The values mean nothing; the shapes, types and
 * bytes are those of the named model, so a decode step reads what the
 * real one would.
 *
 * Weights: matrices of the chosen type (bf16, f16, f32, q8_0, q4_0,
 * q4_1): float values uniform in [-0.05, 0.05]; quantized blocks with
 * random quants and a scale of 0.005 (q4_1: offset -0.04). Norms are f32
 * ones. The bytes come from a 16 MiB random pool, repeated, so writing
 * 16 GB is bound by the disk, not the generator. Progress goes to stderr
 * every GiB. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../services/model/quant.h"
#include "cli.h"

static const config_option opts[] = {
    {"shape", CONFIG_STRING, "llama-3.1-8b", 0, 0, "llama-3.1-8b or smollm2-135m"},
    {"type", CONFIG_STRING, "q4_0", 0, 0, "weight matrices: bf16, f16, f32, q8_0, q4_0 or q4_1"},
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

#define POOL_BYTES (16u << 20)

typedef struct writer {
    FILE *f;
    const char *path;
    uint64_t written, next_report;
    uint8_t *pool;
    size_t pool_at;
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

/* `bytes` of data for t from the random pool, with the scales of each
 * quantized block (and every float) set to sane values. */
static int put_data(writer *w, const tensor *t, ae_error *err) {
    if (t->type == GGML_TYPE_F32 && t->rows == 1) { /* a norm: ones */
        float one = 1.0f;
        for (int64_t i = 0; i < t->cols; i++)
            if (put(w, &one, 4, err)) return AE_ERR;
        return AE_OK;
    }
    uint64_t left = t->bytes;
    size_t bb = quant_block_bytes(t->type);
    while (left > 0) {
        size_t n = POOL_BYTES - w->pool_at;
        n -= n % (bb * 64); /* whole blocks */
        if (n == 0) {
            w->pool_at = 0;
            continue;
        }
        if (n > left) n = (size_t)left;
        if (put(w, w->pool + w->pool_at, n, err)) return AE_ERR;
        w->pool_at += n;
        left -= n;
    }
    return AE_OK;
}

/* The pool for one type: random values, then each block's scales fixed. */
static uint8_t *make_pool(ggml_type t) {
    uint8_t *p = malloc(POOL_BYTES);
    if (!p) return NULL;
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < POOL_BYTES; i += 8) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        memcpy(p + i, &s, 8);
    }
    size_t bb = quant_block_bytes(t);
    for (size_t b = 0; b + bb <= POOL_BYTES; b += bb) {
        uint8_t *blk = p + b;
        if (quant_block_elems(t) == 1) { /* a float: uniform in [-0.05, 0.05] from its own random bits */
            uint16_t r;
            memcpy(&r, blk, 2);
            float v = ((float)r / 65535.0f - 0.5f) * 0.1f;
            uint16_t h = t == GGML_TYPE_BF16 ? quant_f32_to_bf16(v) : quant_f32_to_f16(v);
            if (t == GGML_TYPE_F32)
                memcpy(blk, &v, 4);
            else
                memcpy(blk, &h, 2);
        } else {
            uint16_t d = quant_f32_to_f16(0.005f), m = quant_f32_to_f16(-0.04f);
            memcpy(blk, &d, 2);
            if (t == GGML_TYPE_Q4_1) memcpy(blk + 2, &m, 2);
        }
    }
    return p;
}

static int parse_type(const char *s, ggml_type *t, ae_error *err) {
    static const struct {
        const char *name;
        ggml_type t;
    } types[] = {{"bf16", GGML_TYPE_BF16}, {"f16", GGML_TYPE_F16},   {"f32", GGML_TYPE_F32},
                 {"q8_0", GGML_TYPE_Q8_0}, {"q4_0", GGML_TYPE_Q4_0}, {"q4_1", GGML_TYPE_Q4_1}};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (!strcmp(s, types[i].name)) {
            *t = types[i].t;
            return AE_OK;
        }
    return err_set(err, "--type %s: expected bf16, f16, f32, q8_0, q4_0 or q4_1", s);
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
    if (parse_type(config_str(c, "type"), &type, err) != AE_OK) return CLI_EXIT_USAGE;
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
    T("output.weight", s.vocab, s.hidden, type);
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
            T(nm, dims[j][0], dims[j][1], j < 2 ? GGML_TYPE_F32 : type);
        }
    }
#undef T
    uint64_t off = 0, total = 0;
    for (int64_t i = 0; i < n_t; i++) {
        ts[i].bytes = (uint64_t)ts[i].rows * quant_row_bytes(ts[i].type, (uint64_t)ts[i].cols);
        ts[i].offset = off;
        off += (ts[i].bytes + 31) & ~(uint64_t)31;
        total += ts[i].bytes;
    }

    writer w = {.path = path, .next_report = 1ull << 30};
    uint8_t *pool = make_pool(type);
    w.f = fopen(path, "wb");
    int rc = CLI_EXIT_USAGE;
    if (!pool || !w.f) {
        err_set(err, "%s: cannot write it", path);
        goto out;
    }
    w.pool = pool;
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
        w.pool_at = 0;
        if (put_data(&w, &ts[i], err) ||
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
    free(pool);
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
