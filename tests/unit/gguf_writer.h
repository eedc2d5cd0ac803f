/* A minimal GGUF writer for tests: appends raw little-endian fields to a
 * growable buffer, so a test can build valid files and then break exactly
 * one field. It checks nothing; that is the reader's job. */
#ifndef AERIE_TESTS_GGUF_WRITER_H
#define AERIE_TESTS_GGUF_WRITER_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct gw {
    uint8_t *p;
    size_t len, cap;
} gw;

static inline void gw_bytes(gw *w, const void *b, size_t n) {
    if (w->len + n > w->cap) {
        size_t cap = w->cap ? w->cap : 256;
        while (cap < w->len + n) cap *= 2;
        uint8_t *p = realloc(w->p, cap);
        if (!p) abort(); /* test helper: no recovery */
        w->p = p;
        w->cap = cap;
    }
    if (n) memcpy(w->p + w->len, b, n);
    w->len += n;
}

static inline void gw_free(gw *w) {
    free(w->p);
    memset(w, 0, sizeof *w);
}

static inline void gw_le(gw *w, uint64_t v, int n) {
    uint8_t b[8];
    for (int i = 0; i < n; i++) b[i] = (uint8_t)(v >> (8 * i));
    gw_bytes(w, b, (size_t)n);
}

static inline void gw_u8(gw *w, uint8_t v) { gw_le(w, v, 1); }
static inline void gw_u16(gw *w, uint16_t v) { gw_le(w, v, 2); }
static inline void gw_u32(gw *w, uint32_t v) { gw_le(w, v, 4); }
static inline void gw_u64(gw *w, uint64_t v) { gw_le(w, v, 8); }

static inline void gw_f32(gw *w, float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    gw_u32(w, u);
}

static inline void gw_f64(gw *w, double f) {
    uint64_t u;
    memcpy(&u, &f, 8);
    gw_u64(w, u);
}

static inline void gw_strn(gw *w, const char *s, size_t n) {
    gw_u64(w, n);
    gw_bytes(w, s, n);
}

static inline void gw_str(gw *w, const char *s) { gw_strn(w, s, strlen(s)); }

/* "GGUF", version, tensor count, kv count. */
static inline void gw_header(gw *w, uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
    gw_bytes(w, "GGUF", 4);
    gw_u32(w, version);
    gw_u64(w, n_tensors);
    gw_u64(w, n_kv);
}

/* Key and value type; the caller writes the value. */
static inline void gw_key(gw *w, const char *key, uint32_t vtype) {
    gw_str(w, key);
    gw_u32(w, vtype);
}

static inline void gw_kv_u32(gw *w, const char *key, uint32_t v) {
    gw_key(w, key, 4);
    gw_u32(w, v);
}

static inline void gw_kv_str(gw *w, const char *key, const char *v) {
    gw_key(w, key, 8);
    gw_str(w, v);
}

/* Array header: element type and count; the caller writes the elements. */
static inline void gw_arr(gw *w, const char *key, uint32_t elem_type, uint64_t count) {
    gw_key(w, key, 9);
    gw_u32(w, elem_type);
    gw_u64(w, count);
}

static inline void gw_tensor(gw *w, const char *name, uint32_t n_dims, const uint64_t *ne, uint32_t type,
                             uint64_t offset) {
    gw_str(w, name);
    gw_u32(w, n_dims);
    for (uint32_t d = 0; d < n_dims; d++) gw_u64(w, ne[d]);
    gw_u32(w, type);
    gw_u64(w, offset);
}

/* Zero bytes up to the next multiple of align (measured from the start). */
static inline void gw_pad(gw *w, size_t align) {
    static const uint8_t zero[1];
    while (w->len % align) gw_bytes(w, zero, 1);
}

/* Overwrites n little-endian bytes at `at` (to corrupt a written field). */
static inline void gw_patch(gw *w, size_t at, uint64_t v, int n) {
    for (int i = 0; i < n; i++) w->p[at + (size_t)i] = (uint8_t)(v >> (8 * i));
}

#endif
