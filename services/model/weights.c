#include "weights.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../core/mem.h"

int weights_open(weights_store **out, const char *path, const kn_backend *be, ae_error *err) {
    *out = NULL;
    weights_store *w = calloc(1, sizeof *w);
    if (!w) return err_set(err, "out of memory");
    w->be = be;
    struct stat sb;
    int rc = stat(path, &sb) == 0 && S_ISDIR(sb.st_mode) ? safetensors_model_open(&w->st, path, err)
                                                         : gguf_open(&w->gguf, path, err);
    if (rc != AE_OK) {
        weights_close(w);
        return AE_ERR;
    }
    *out = w;
    return AE_OK;
}

void weights_close(weights_store *w) {
    if (!w) return;
    for (size_t i = 0; i < w->n_bufs; i++) {
        kn_buf_free(&w->bufs[i]->buf);
        free(w->bufs[i]->host);
        free(w->bufs[i]);
    }
    free(w->bufs);
    gguf_close(w->gguf);
    safetensors_model_close(w->st);
    free(w);
}

bool weights_has(const weights_store *w, const char *name) {
    return w->gguf ? gguf_find_tensor(w->gguf, name) != NULL : safetensors_model_find(w->st, name) != NULL;
}

/* A new buffer record the weights own (its address is stable). */
static weights_buf *new_buf(weights_store *w, ae_error *err) {
    if (w->n_bufs == w->cap_bufs) {
        size_t cap = w->cap_bufs ? w->cap_bufs * 2 : 64;
        weights_buf **p = realloc(w->bufs, cap * sizeof *p);
        if (!p) return err_set(err, "out of memory"), NULL;
        w->bufs = p;
        w->cap_bufs = cap;
    }
    weights_buf *b = calloc(1, sizeof *b);
    if (!b) return err_set(err, "out of memory"), NULL;
    w->bufs[w->n_bufs++] = b;
    return b;
}

/* The host bytes [p, p + bytes), which outlive the weights (the mapped
 * file), as a buffer of the backend: themselves on a host-memory one, a
 * copy on any other. */
static const kn_buf *from_host(weights_store *w, const void *p, size_t bytes, ae_error *err) {
    weights_buf *b = new_buf(w, err);
    if (!b || kn_buf_from_host(w->be, &b->buf, p, bytes, err) != AE_OK) return NULL;
    return &b->buf;
}

/* Host memory for bytes the weights write (a conversion, a packed copy),
 * uninitialized: what is written fills it. */
static void *own_begin(size_t bytes, ae_error *err) {
    void *p = mem_alloc_large(bytes ? bytes : 1);
    return p ? p : (err_set(err, "out of memory for %zu bytes of weights", bytes), NULL);
}

/* The bytes written at host (from own_begin) as a buffer of the backend:
 * on a host-memory backend that memory itself, kept until the weights
 * close; on any other a copy, and host is freed. NULL on failure. */
static const kn_buf *own_done(weights_store *w, void *host, size_t bytes, ae_error *err) {
    const kn_buf *b = from_host(w, host, bytes, err);
    if (b && kn_backend_host_memory(w->be))
        w->bufs[w->n_bufs - 1]->host = host;
    else
        free(host);
    return b;
}

/* A tensor converted to n floats by `convert` into the weights' memory. */
typedef bool (*convert_fn)(const void *src, float *dst, uint64_t n, const void *ctx, ae_error *err);

static const kn_buf *own_floats(weights_store *w, uint64_t n, convert_fn convert, const void *src, const void *ctx,
                                ae_error *err) {
    size_t bytes = (size_t)n * sizeof(float);
    float *host = own_begin(bytes, err);
    if (!host) return NULL;
    if (!convert(src, host, n, ctx, err)) {
        free(host);
        return NULL;
    }
    w->converted_bytes += bytes;
    return own_done(w, host, bytes, err);
}

/* ---- GGUF ---------------------------------------------------------------- */

/* The 2-D tensor `name` of [rows][cols] (GGUF dims: ne[0] = cols, ne[1] =
 * rows), or NULL with err set. */
static const gguf_tensor *gguf_2d(const weights_store *w, const char *name, int64_t rows, int64_t cols, ae_error *err) {
    const gguf_tensor *t = gguf_find_tensor(w->gguf, name);
    if (!t) return err_set(err, "tensor %s is missing", name), NULL;
    if (t->n_dims != 2 || (int64_t)t->ne[0] != cols || (int64_t)t->ne[1] != rows)
        return err_set(err, "tensor %s has shape [%llu, %llu], expected [%lld, %lld]", name,
                       (unsigned long long)t->ne[0], (unsigned long long)t->ne[1], (long long)cols, (long long)rows),
               NULL;
    return t;
}

static bool dequantize(const void *src, float *dst, uint64_t n, const void *ctx, ae_error *err) {
    (void)err; /* the caller names the tensor */
    return quant_dequantize(((const gguf_tensor *)ctx)->type, src, dst, n);
}

/* A matrix of a type no matmul kernel takes: refused, never widened to
 * f32 behind the operator's back (the file's bytes are the plan). */
static int unsupported(const char *name, ggml_type type, ae_error *err) {
    return err_set(err,
                   "tensor %s has type %s, which no matrix kernel of this build reads (types read: F32, F16, BF16, "
                   "Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4)",
                   name, quant_type_name(type));
}

static int gguf_matrix(weights_store *w, const char *name, int64_t rows, int64_t cols, kn_weight *out, ae_error *err) {
    const gguf_tensor *t = gguf_2d(w, name, rows, cols, err);
    if (!t) return AE_ERR;
    out->rows = rows;
    out->cols = cols;
    if (kn_matmul_supports(t->type)) {
        const kn_buf *b = from_host(w, t->data, t->n_bytes, err);
        if (!b) return err_prefix(err, "tensor %s: ", name), AE_ERR;
        *out = (kn_weight){.type = t->type,
                           .rows = rows,
                           .cols = cols,
                           .data = b->ptr,
                           .row_bytes = (size_t)quant_row_bytes(t->type, (uint64_t)cols),
                           .buf = b};
        w->bytes += t->n_bytes;
        return AE_OK;
    }
    return unsupported(name, t->type, err);
}

int weights_matrix_3d(weights_store *w, const char *name, int64_t n, int64_t rows, int64_t cols, kn_weight *out,
                      ae_error *err) {
    if (!w->gguf) return err_set(err, "tensor %s: 3-D matrices are read from GGUF files only", name);
    const gguf_tensor *t = gguf_find_tensor(w->gguf, name);
    if (!t) return err_set(err, "tensor %s is missing", name);
    if (t->n_dims != 3 || (int64_t)t->ne[0] != cols || (int64_t)t->ne[1] != rows || (int64_t)t->ne[2] != n)
        return err_set(err, "tensor %s has shape [%llu, %llu, %llu] in %u dims, expected [%lld, %lld, %lld]", name,
                       (unsigned long long)t->ne[0], (unsigned long long)t->ne[1], (unsigned long long)t->ne[2],
                       t->n_dims, (long long)cols, (long long)rows, (long long)n);
    const kn_buf *b;
    if (kn_matmul_supports(t->type)) {
        if (!(b = from_host(w, t->data, t->n_bytes, err))) return err_prefix(err, "tensor %s: ", name), AE_ERR;
        *out = (kn_weight){.type = t->type,
                           .rows = n * rows,
                           .cols = cols,
                           .data = b->ptr,
                           .row_bytes = (size_t)quant_row_bytes(t->type, (uint64_t)cols),
                           .buf = b};
        w->bytes += t->n_bytes;
        return AE_OK;
    }
    return unsupported(name, t->type, err);
}

static int gguf_table(weights_store *w, const char *name, int64_t rows, int64_t cols, kn_weight *out, ae_error *err) {
    const gguf_tensor *t = gguf_2d(w, name, rows, cols, err);
    if (!t) return AE_ERR;
    if (!quant_can_dequantize(t->type))
        return err_set(err, "tensor %s has type %s, which cannot be read", name, quant_type_name(t->type));
    const kn_buf *b = from_host(w, t->data, t->n_bytes, err);
    if (!b) return err_prefix(err, "tensor %s: ", name), AE_ERR;
    *out = (kn_weight){.type = t->type,
                       .rows = rows,
                       .cols = cols,
                       .data = b->ptr,
                       .row_bytes = (size_t)quant_row_bytes(t->type, (uint64_t)cols),
                       .buf = b};
    return AE_OK;
}

static int gguf_vector(weights_store *w, const char *name, int64_t n, bool optional, const float **out, ae_error *err) {
    *out = NULL;
    const gguf_tensor *t = gguf_find_tensor(w->gguf, name);
    if (!t) return optional ? AE_OK : err_set(err, "tensor %s is missing", name);
    if (t->n_dims != 1 || (int64_t)t->ne[0] != n)
        return err_set(err, "tensor %s has %llu elements in %u dims, expected [%lld]", name,
                       (unsigned long long)t->n_elements, t->n_dims, (long long)n);
    w->bytes += t->n_bytes;
    const kn_buf *b = t->type == GGML_TYPE_F32 ? from_host(w, t->data, t->n_bytes, err)
                                               : own_floats(w, (uint64_t)n, dequantize, t->data, t, err);
    if (!b) return err_set(err, "tensor %s: cannot convert", name);
    *out = b->ptr;
    return AE_OK;
}

/* ---- safetensors ----------------------------------------------------------- */

static bool st_convert(const void *src, float *dst, uint64_t n, const void *ctx, ae_error *err) {
    (void)ctx;
    return safetensors_tensor_to_f32(src, dst, n, err) == AE_OK;
}

/* rows 0: a vector of cols. buf_out, if not NULL, gets its buffer. */
static int st_floats(weights_store *w, const char *name, int64_t rows, int64_t cols, bool optional, const float **out,
                     const kn_buf **buf_out, ae_error *err) {
    *out = NULL;
    const safetensors_tensor *t = safetensors_model_find(w->st, name);
    if (!t) return optional ? AE_OK : err_set(err, "tensor %s is missing", name);
    bool ok = rows == 0 ? (t->n_dims == 1 && (int64_t)t->shape[0] == cols)
                        : (t->n_dims == 2 && (int64_t)t->shape[0] == rows && (int64_t)t->shape[1] == cols);
    if (!ok)
        return err_set(err, "tensor %s has an unexpected shape (expected [%lld, %lld])", name, (long long)rows,
                       (long long)cols);
    const kn_buf *b = own_floats(w, t->n_elements, st_convert, t, NULL, err);
    if (!b) return AE_ERR;
    w->bytes += t->n_elements * sizeof(float);
    *out = b->ptr;
    if (buf_out) *buf_out = b;
    return AE_OK;
}

static int st_matrix(weights_store *w, const char *name, int64_t rows, int64_t cols, kn_weight *out, ae_error *err) {
    const float *p;
    const kn_buf *b;
    /* BF16, the type real checkpoints ship, has a matmul kernel: it stays
     * as the file has it (half the bytes of f32), where it is aligned. */
    const safetensors_tensor *t = safetensors_model_find(w->st, name);
    if (t && t->dtype == SAFETENSORS_BF16 && t->n_dims == 2 && (int64_t)t->shape[0] == rows &&
        (int64_t)t->shape[1] == cols && ((uintptr_t)t->data & 1) == 0) {
        if (!(b = from_host(w, t->data, t->n_bytes, err))) return err_prefix(err, "tensor %s: ", name), AE_ERR;
        *out = (kn_weight){.type = GGML_TYPE_BF16,
                           .rows = rows,
                           .cols = cols,
                           .data = b->ptr,
                           .row_bytes = (size_t)cols * 2,
                           .buf = b};
        w->bytes += t->n_bytes;
        return AE_OK;
    }
    if (st_floats(w, name, rows, cols, false, &p, &b, err) != AE_OK) return AE_ERR;
    *out = (kn_weight){.type = GGML_TYPE_F32,
                       .rows = rows,
                       .cols = cols,
                       .data = p,
                       .row_bytes = (size_t)cols * sizeof(float),
                       .buf = b};
    return AE_OK;
}

/* ---- either ---------------------------------------------------------------- */

int weights_matrix(weights_store *w, const char *name, int64_t rows, int64_t cols, kn_weight *out, ae_error *err) {
    return w->gguf ? gguf_matrix(w, name, rows, cols, out, err) : st_matrix(w, name, rows, cols, out, err);
}

int weights_table(weights_store *w, const char *name, int64_t rows, int64_t cols, kn_weight *out, ae_error *err) {
    return w->gguf ? gguf_table(w, name, rows, cols, out, err) : st_matrix(w, name, rows, cols, out, err);
}

int weights_vector(weights_store *w, const char *name, int64_t n, bool optional, const float **out, ae_error *err) {
    return w->gguf ? gguf_vector(w, name, n, optional, out, err) : st_floats(w, name, 0, n, optional, out, NULL, err);
}

/* Whether m's bytes are memory the weights wrote themselves (a
 * conversion, a copy of picked rows), not the mapped file. A weight's buf
 * is the first member of the weights_buf that holds it. */
static bool owned(const kn_weight *m) { return m->buf && ((const weights_buf *)(const void *)m->buf)->host != NULL; }

/* Once a matrix is packed, the forward pass reads its file bytes only for
 * rows past the last whole group of 16 (none in the default model). The
 * pages packing touched are dropped from this process (they stay in the
 * page cache, clean and reclaimable, and fault back in if read). Only
 * whole pages inside the matrix's bytes, and only of the mapped file:
 * dropping pages of memory the weights wrote would zero them. */
static void drop_file_pages(const weights_store *w, const kn_weight *m) {
    if (!w->gguf || owned(m)) return;
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0) return;
    uintptr_t a = (uintptr_t)m->data, b = a + (size_t)m->rows * m->row_bytes;
    uintptr_t lo = (a + (uintptr_t)page - 1) & ~((uintptr_t)page - 1), hi = b & ~((uintptr_t)page - 1);
    if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_DONTNEED); /* a hint; failure is harmless */
}

int weights_pack(weights_store *w, kn_weight *m, ae_error *err) {
    size_t bytes = kn_weight_packed_bytes(m);
    /* A quantized matrix the weights wrote (int4 made Q4_0, rows picked
     * from another) stays unpacked: its bytes cannot be dropped as a
     * file's can, so packing would hold it twice. The kernels read it as
     * it is, with the same bits. */
    if (bytes == 0 || !kn_backend_host_memory(w->be) || owned(m)) return AE_OK;
    void *host = own_begin(bytes, err);
    if (!host) return AE_ERR;
    kn_weight_pack(m, host);
    if (!(m->packed_buf = own_done(w, host, bytes, err))) return AE_ERR;
    m->packed = m->packed_buf->ptr;
    drop_file_pages(w, m);
    return AE_OK;
}

/* ---- matrices made at load ------------------------------------------------ */

int weights_f32(weights_store *w, int64_t rows, int64_t cols, weights_fill_fn fill, void *ctx, kn_weight *out,
                ae_error *err) {
    size_t bytes = (size_t)rows * (size_t)cols * sizeof(float);
    float *host = own_begin(bytes, err);
    if (!host) return AE_ERR;
    fill(ctx, host);
    const kn_buf *b = own_done(w, host, bytes, err);
    if (!b) return AE_ERR;
    w->bytes += bytes;
    w->converted_bytes += bytes;
    *out = (kn_weight){.type = GGML_TYPE_F32,
                       .rows = rows,
                       .cols = cols,
                       .data = b->ptr,
                       .row_bytes = (size_t)cols * sizeof(float),
                       .buf = b};
    return AE_OK;
}

int weights_pick_rows(weights_store *w, const kn_weight *src, int64_t n, const int64_t *rows, kn_weight *out,
                      ae_error *err) {
    AE_ASSERT(kn_backend_host_memory(w->be) && n > 0);
    size_t rb = (size_t)quant_row_bytes(src->type, (uint64_t)src->cols), bytes = (size_t)n * rb;
    char *host = own_begin(bytes, err);
    if (!host) return AE_ERR;
    for (int64_t i = 0; i < n; i++) {
        AE_ASSERT(rows[i] >= 0 && rows[i] < src->rows);
        memcpy(host + (size_t)i * rb, (const char *)src->data + (size_t)rows[i] * src->row_bytes, rb);
    }
    const kn_buf *b = own_done(w, host, bytes, err);
    if (!b) return AE_ERR;
    *out = (kn_weight){.type = src->type, .rows = n, .cols = src->cols, .data = b->ptr, .row_bytes = rb, .buf = b};
    return AE_OK;
}

void weights_row_f32(const kn_weight *m, int64_t i, float *dst) {
    AE_ASSERT(i >= 0 && i < m->rows);
    bool ok = quant_dequantize(m->type, (const char *)m->data + (size_t)i * m->row_bytes, dst, (uint64_t)m->cols);
    AE_ASSERT(ok);
}

/* ---- compressed-tensors int4 ----------------------------------------------- */

static const safetensors_tensor *int4_part(const weights_store *w, const char *prefix, const char *part) {
    char name[512];
    snprintf(name, sizeof name, "%s.%s", prefix, part);
    return w->st ? safetensors_model_find(w->st, name) : NULL;
}

bool weights_has_int4(const weights_store *w, const char *prefix) {
    return int4_part(w, prefix, "weight_packed") != NULL;
}

/* f32 to f16 when that is exact (not past f16's range or precision). */
static bool f16_exact(float f, uint16_t *h) {
    *h = quant_f32_to_f16(f);
    return quant_f16_to_f32(*h) == f;
}

int weights_int4_matrix(weights_store *w, const char *prefix, int64_t rows, int64_t cols, kn_weight *out,
                        ae_error *err) {
    const safetensors_tensor *pk = int4_part(w, prefix, "weight_packed"), *sc = int4_part(w, prefix, "weight_scale"),
                             *shape = int4_part(w, prefix, "weight_shape");
    if (!pk || !sc) return err_set(err, "tensor %s.weight_packed or .weight_scale is missing", prefix);
    if (cols % 32)
        return err_set(err, "%s: int4 groups of 32 need columns a multiple of 32, not %lld", prefix, (long long)cols);
    if (pk->dtype != SAFETENSORS_I32 || pk->n_dims != 2 || pk->shape[0] != (uint64_t)rows ||
        pk->shape[1] != (uint64_t)cols / 8)
        return err_set(err, "tensor %s.weight_packed: expected int32 [%lld, %lld]", prefix, (long long)rows,
                       (long long)cols / 8);
    if (sc->n_dims != 2 || sc->shape[0] != (uint64_t)rows || sc->shape[1] != (uint64_t)cols / 32)
        return err_set(err, "tensor %s.weight_scale: expected [%lld, %lld] (groups of 32)", prefix, (long long)rows,
                       (long long)cols / 32);
    if (shape) {
        int64_t dims[2];
        if (shape->n_elements != 2 || safetensors_tensor_to_i64(shape, dims, 2, err) != AE_OK)
            return err_prefix(err, "tensor %s.weight_shape: ", prefix), AE_ERR;
        if (dims[0] != rows || dims[1] != cols)
            return err_set(err, "tensor %s.weight_shape: [%lld, %lld], expected [%lld, %lld]", prefix,
                           (long long)dims[0], (long long)dims[1], (long long)rows, (long long)cols);
    }
    size_t groups = (size_t)rows * (size_t)cols / 32;
    float *scale = malloc(groups * sizeof *scale);
    int32_t *q = malloc((size_t)rows * (size_t)cols / 8 * sizeof *q);
    int rc = AE_ERR;
    if (!scale || !q) {
        err_set(err, "out of memory");
        goto done;
    }
    if (safetensors_tensor_to_f32(sc, scale, groups, err) != AE_OK ||
        safetensors_tensor_to_i32(pk, q, pk->n_elements, err) != AE_OK) {
        err_prefix(err, "tensor %s: ", prefix);
        goto done;
    }
    bool exact = true;
    uint16_t h;
    for (size_t g = 0; g < groups && exact; g++) exact = f16_exact(scale[g], &h);
    /* nibble c of group g: word 4g + c / 8, bits 4 (c % 8) */
#define NIBBLE(g, c) ((uint8_t)(((uint32_t)q[(g) * 4 + (c) / 8] >> (4 * ((c) % 8))) & 15u))
    if (exact) { /* Q4_0: f16 d, then qs[j] = element j | element j + 16 << 4 */
        size_t bytes = groups * 18;
        uint8_t *host = own_begin(bytes, err);
        if (!host) goto done;
        for (size_t g = 0; g < groups; g++) {
            uint8_t *blk = host + g * 18;
            f16_exact(scale[g], &h);
            memcpy(blk, &h, 2);
            for (int j = 0; j < 16; j++) blk[2 + j] = (uint8_t)(NIBBLE(g, j) | NIBBLE(g, j + 16) << 4);
        }
        const kn_buf *b = own_done(w, host, bytes, err);
        if (!b) goto done;
        w->bytes += bytes;
        *out = (kn_weight){.type = GGML_TYPE_Q4_0,
                           .rows = rows,
                           .cols = cols,
                           .data = b->ptr,
                           .row_bytes = (size_t)cols / 32 * 18,
                           .buf = b};
    } else {
        size_t bytes = (size_t)rows * (size_t)cols * sizeof(float);
        float *host = own_begin(bytes, err);
        if (!host) goto done;
        for (size_t g = 0; g < groups; g++)
            for (int c = 0; c < 32; c++) host[g * 32 + (size_t)c] = scale[g] * (float)((int)NIBBLE(g, c) - 8);
        const kn_buf *b = own_done(w, host, bytes, err);
        if (!b) goto done;
        w->bytes += bytes;
        w->converted_bytes += bytes;
        *out = (kn_weight){.type = GGML_TYPE_F32,
                           .rows = rows,
                           .cols = cols,
                           .data = b->ptr,
                           .row_bytes = (size_t)cols * sizeof(float),
                           .buf = b};
    }
#undef NIBBLE
    rc = AE_OK;
done:
    free(scale);
    free(q);
    return rc;
}
