#include "weights.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../core/mem.h"

int weights_open(weights_store **out, const char *path, ae_error *err) {
    *out = NULL;
    weights_store *w = calloc(1, sizeof *w);
    if (!w) return err_set(err, "out of memory");
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
    for (size_t i = 0; i < w->n_owned; i++) free(w->owned[i]);
    free(w->owned);
    gguf_close(w->gguf);
    st_model_close(w->st);
    free(w);
}

bool weights_has(const weights_store *w, const char *name) {
    return w->gguf ? gguf_find_tensor(w->gguf, name) != NULL : st_model_find(w->st, name) != NULL;
}

/* A 64-byte aligned buffer of `bytes` that the weights own. */
static void *own_bytes(weights_store *w, size_t bytes, ae_error *err) {
    if (w->n_owned == w->cap_owned) {
        size_t cap = w->cap_owned ? w->cap_owned * 2 : 64;
        void **p = realloc(w->owned, cap * sizeof *p);
        if (!p) return err_set(err, "out of memory"), NULL;
        w->owned = p;
        w->cap_owned = cap;
    }
    void *buf = mem_alloc_large(bytes);
    if (!buf) return err_set(err, "out of memory for %zu bytes of weights", bytes), NULL;
    w->owned[w->n_owned++] = buf;
    return buf;
}

static float *own_floats(weights_store *w, uint64_t n, ae_error *err) {
    float *buf = own_bytes(w, n * sizeof(float), err);
    if (buf) w->converted_bytes += n * sizeof(float);
    return buf;
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

static int gguf_matrix(weights_store *w, const char *name, int64_t rows, int64_t cols, kn_weight *out, ae_error *err) {
    const gguf_tensor *t = gguf_2d(w, name, rows, cols, err);
    if (!t) return AE_ERR;
    out->rows = rows;
    out->cols = cols;
    if (kn_matmul_supports(t->type)) {
        out->type = t->type;
        out->data = t->data;
        out->row_bytes = (size_t)quant_row_bytes(t->type, (uint64_t)cols);
        w->bytes += t->n_bytes;
        return AE_OK;
    }
    if (!quant_can_dequantize(t->type))
        return err_set(err, "tensor %s has type %s, which cannot be read", name, quant_type_name(t->type));
    float *buf = own_floats(w, t->n_elements, err);
    if (!buf || !quant_dequantize(t->type, t->data, buf, t->n_elements))
        return err_set(err, "tensor %s: cannot convert", name);
    *out = (kn_weight){.type = GGML_TYPE_F32, .rows = rows, .cols = cols, .data = buf,
                       .row_bytes = (size_t)cols * sizeof(float)};
    w->bytes += t->n_elements * sizeof(float);
    return AE_OK;
}

static int gguf_table(weights_store *w, const char *name, int64_t rows, int64_t cols, kn_weight *out, ae_error *err) {
    const gguf_tensor *t = gguf_2d(w, name, rows, cols, err);
    if (!t) return AE_ERR;
    if (!quant_can_dequantize(t->type))
        return err_set(err, "tensor %s has type %s, which cannot be read", name, quant_type_name(t->type));
    *out = (kn_weight){.type = t->type, .rows = rows, .cols = cols, .data = t->data,
                       .row_bytes = (size_t)quant_row_bytes(t->type, (uint64_t)cols)};
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
    if (t->type == GGML_TYPE_F32) {
        *out = t->data;
        return AE_OK;
    }
    float *buf = own_floats(w, (uint64_t)n, err);
    if (!buf || !quant_dequantize(t->type, t->data, buf, (uint64_t)n))
        return err_set(err, "tensor %s: cannot convert", name);
    *out = buf;
    return AE_OK;
}

/* ---- safetensors ----------------------------------------------------------- */

/* rows 0: a vector of cols. */
static int st_floats(weights_store *w, const char *name, int64_t rows, int64_t cols, bool optional, const float **out,
                     ae_error *err) {
    *out = NULL;
    const st_tensor *t = st_model_find(w->st, name);
    if (!t) return optional ? AE_OK : err_set(err, "tensor %s is missing", name);
    bool ok = rows == 0 ? (t->n_dims == 1 && (int64_t)t->shape[0] == cols)
                        : (t->n_dims == 2 && (int64_t)t->shape[0] == rows && (int64_t)t->shape[1] == cols);
    if (!ok)
        return err_set(err, "tensor %s has an unexpected shape (expected [%lld, %lld])", name, (long long)rows,
                       (long long)cols);
    float *buf = own_floats(w, t->n_elements, err);
    if (!buf || st_tensor_to_f32(t, buf, t->n_elements, err) != AE_OK) return AE_ERR;
    w->bytes += t->n_elements * sizeof(float);
    *out = buf;
    return AE_OK;
}

static int st_matrix(weights_store *w, const char *name, int64_t rows, int64_t cols, kn_weight *out, ae_error *err) {
    const float *p;
    if (st_floats(w, name, rows, cols, false, &p, err) != AE_OK) return AE_ERR;
    *out = (kn_weight){.type = GGML_TYPE_F32, .rows = rows, .cols = cols, .data = p,
                       .row_bytes = (size_t)cols * sizeof(float)};
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
    return w->gguf ? gguf_vector(w, name, n, optional, out, err) : st_floats(w, name, 0, n, optional, out, err);
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
    if (bytes == 0) return AE_OK;
    void *buf = own_bytes(w, bytes, err);
    if (!buf) return AE_ERR;
    kn_weight_pack(m, buf);
    drop_file_pages(w, m);
    return AE_OK;
}
