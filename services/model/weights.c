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
    int rc = stat(path, &sb) == 0 && S_ISDIR(sb.st_mode) ? st_model_open(&w->st, path, err)
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
    st_model_close(w->st);
    free(w);
}

bool weights_has(const weights_store *w, const char *name) {
    return w->gguf ? gguf_find_tensor(w->gguf, name) != NULL : st_model_find(w->st, name) != NULL;
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

static int gguf_matrix(weights_store *w, const char *name, int64_t rows, int64_t cols, kn_weight *out, ae_error *err) {
    const gguf_tensor *t = gguf_2d(w, name, rows, cols, err);
    if (!t) return AE_ERR;
    out->rows = rows;
    out->cols = cols;
    if (kn_matmul_supports(t->type)) {
        const kn_buf *b = from_host(w, t->data, t->n_bytes, err);
        if (!b) return err_prefix(err, "tensor %s: ", name), AE_ERR;
        *out = (kn_weight){.type = t->type, .rows = rows, .cols = cols, .data = b->ptr,
                           .row_bytes = (size_t)quant_row_bytes(t->type, (uint64_t)cols), .buf = b};
        w->bytes += t->n_bytes;
        return AE_OK;
    }
    if (!quant_can_dequantize(t->type))
        return err_set(err, "tensor %s has type %s, which cannot be read", name, quant_type_name(t->type));
    const kn_buf *b = own_floats(w, t->n_elements, dequantize, t->data, t, err);
    if (!b) return err_set(err, "tensor %s: cannot convert", name);
    *out = (kn_weight){.type = GGML_TYPE_F32, .rows = rows, .cols = cols, .data = b->ptr,
                       .row_bytes = (size_t)cols * sizeof(float), .buf = b};
    w->bytes += t->n_elements * sizeof(float);
    return AE_OK;
}

static int gguf_table(weights_store *w, const char *name, int64_t rows, int64_t cols, kn_weight *out, ae_error *err) {
    const gguf_tensor *t = gguf_2d(w, name, rows, cols, err);
    if (!t) return AE_ERR;
    if (!quant_can_dequantize(t->type))
        return err_set(err, "tensor %s has type %s, which cannot be read", name, quant_type_name(t->type));
    const kn_buf *b = from_host(w, t->data, t->n_bytes, err);
    if (!b) return err_prefix(err, "tensor %s: ", name), AE_ERR;
    *out = (kn_weight){.type = t->type, .rows = rows, .cols = cols, .data = b->ptr,
                       .row_bytes = (size_t)quant_row_bytes(t->type, (uint64_t)cols), .buf = b};
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
    return st_tensor_to_f32(src, dst, n, err) == AE_OK;
}

/* rows 0: a vector of cols. buf_out, if not NULL, gets its buffer. */
static int st_floats(weights_store *w, const char *name, int64_t rows, int64_t cols, bool optional, const float **out,
                     const kn_buf **buf_out, ae_error *err) {
    *out = NULL;
    const st_tensor *t = st_model_find(w->st, name);
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
    if (st_floats(w, name, rows, cols, false, &p, &b, err) != AE_OK) return AE_ERR;
    *out = (kn_weight){.type = GGML_TYPE_F32, .rows = rows, .cols = cols, .data = p,
                       .row_bytes = (size_t)cols * sizeof(float), .buf = b};
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

/* Once a matrix is packed, the forward pass reads its file bytes only for
 * rows past the last whole group of 16 (none in the default model). The
 * pages packing touched are dropped from this process (they stay in the
 * page cache, clean and reclaimable, and fault back in if read). Only
 * whole pages inside the matrix's bytes are dropped. */
static void drop_file_pages(const weights_store *w, const kn_weight *m) {
    if (!w->gguf) return; /* safetensors weights were converted, not mapped here */
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0) return;
    uintptr_t a = (uintptr_t)m->data, b = a + (size_t)m->rows * m->row_bytes;
    uintptr_t lo = (a + (uintptr_t)page - 1) & ~((uintptr_t)page - 1), hi = b & ~((uintptr_t)page - 1);
    if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_DONTNEED); /* a hint; failure is harmless */
}

int weights_pack(weights_store *w, kn_weight *m, ae_error *err) {
    size_t bytes = kn_weight_packed_bytes(m);
    if (bytes == 0 || !kn_backend_host_memory(w->be)) return AE_OK;
    void *host = own_begin(bytes, err);
    if (!host) return AE_ERR;
    kn_weight_pack(m, host);
    if (!(m->packed_buf = own_done(w, host, bytes, err))) return AE_ERR;
    m->packed = m->packed_buf->ptr;
    drop_file_pages(w, m);
    return AE_OK;
}
