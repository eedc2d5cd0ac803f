/* GGUF reader: one validating pass over the file, then plain accessors.
 *
 * Layout (little-endian): "GGUF", u32 version, u64 n_tensors, u64 n_kv;
 * n_kv times {string key, u32 vtype, value}; n_tensors times {string name,
 * u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset}; padding to
 * general.alignment; the data section. A string is u64 length + bytes; an
 * array value is u32 element vtype + u64 count + elements.
 *
 * Every read goes through the parser's bounds check, and every count is
 * compared with the bytes left BEFORE anything is allocated for it, so a
 * hostile header cannot make us allocate more than a small multiple of the
 * file size. */
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_DEFAULT_ALIGNMENT 32u
#define GGUF_MAX_DEPTH 8 /* nesting of arrays inside arrays */
#define HEADER_BYTES 24u

typedef struct gguf_kv {
    gguf_str key;
    gguf_vtype type;
    gguf_vtype arr_type; /* ARRAY only */
    uint64_t arr_len;    /* ARRAY only */
    uint64_t val;        /* file offset of the value; arrays: of element 0 */
    uint64_t *str_at;    /* (arr_len) file offset of each element; string arrays only */
} gguf_kv;

/* Open-addressing hash from name to index; slots hold index + 1, 0 = empty. */
typedef struct name_index {
    uint32_t *slots; /* (mask + 1) */
    uint64_t mask;
} name_index;

struct gguf_file {
    char *path; /* for error text */
    const uint8_t *base;
    uint64_t size;
    bool mapped; /* base is our mmap */
    uint32_t version;
    uint32_t alignment;
    uint64_t data_offset; /* file offset of the data section */
    uint64_t n_kv;
    gguf_kv *kv; /* (n_kv) */
    uint64_t n_tensors;
    gguf_tensor *tensors; /* (n_tensors) */
    name_index kv_index;
    name_index tensor_index;
};

static const char *const VTYPE_NAMES[GGUF_VT_COUNT] = {
    "u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64",
};

/* Bytes of a fixed-size value; 0 for string and array. */
static const uint8_t VTYPE_SIZE[GGUF_VT_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};

/* Smallest encoding of one value of the type: the bound that lets us reject
 * an absurd array count before walking it. */
static uint64_t vtype_min_bytes(gguf_vtype t) {
    if (t == GGUF_VT_STRING) return 8;
    if (t == GGUF_VT_ARRAY) return 12;
    return VTYPE_SIZE[t];
}

const char *gguf_vtype_name(gguf_vtype t) {
    if ((unsigned)t >= GGUF_VT_COUNT) return "invalid";
    return VTYPE_NAMES[t];
}

/* ---- little-endian loads ------------------------------------------------- */

static uint16_t ld16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static uint32_t ld32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static uint64_t ld64(const uint8_t *p) { return ld32(p) | ((uint64_t)ld32(p + 4) << 32); }

/* ---- parser -------------------------------------------------------------- */

typedef struct parser {
    const uint8_t *base;
    uint64_t size;
    uint64_t pos;
    const char *name;
    ae_error *err;
    char where[GGUF_MAX_NAME + 64]; /* "kv 3 'general.name'", for messages */
    int64_t elem;                   /* element of a top-level array being read; -1: none */
    char loc[GGUF_MAX_NAME + 96];   /* where + element, built only for an error */
} parser;

/* The position for an error message: "kv 3 'x'" or "kv 3 'x' element 7". */
static const char *loc(parser *ps) {
    if (ps->elem < 0) return ps->where;
    snprintf(ps->loc, sizeof ps->loc, "%s element %" PRId64, ps->where, ps->elem);
    return ps->loc;
}

static int perr(parser *ps, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int perr(parser *ps, const char *fmt, ...) {
    char msg[AE_ERR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return err_set(ps->err, "%s: %s", ps->name, msg);
}

static uint64_t left(const parser *ps) { return ps->size - ps->pos; }

/* Advances over n bytes, returning where they start. */
static int take(parser *ps, uint64_t n, const char *what, const uint8_t **out) {
    if (n > left(ps))
        return perr(ps, "truncated: %s %s runs past end of file (offset %" PRIu64 ", size %" PRIu64 ")", loc(ps), what,
                    ps->pos, ps->size);
    if (out) *out = ps->base + ps->pos;
    ps->pos += n;
    return AE_OK;
}

static int rd_u32(parser *ps, const char *what, uint32_t *v) {
    const uint8_t *p = NULL;
    if (take(ps, 4, what, &p)) return AE_ERR;
    *v = ld32(p);
    return AE_OK;
}

static int rd_u64(parser *ps, const char *what, uint64_t *v) {
    const uint8_t *p = NULL;
    if (take(ps, 8, what, &p)) return AE_ERR;
    *v = ld64(p);
    return AE_OK;
}

static int rd_str(parser *ps, const char *what, uint64_t max, gguf_str *out) {
    if (left(ps) < 8)
        return perr(ps, "truncated: %s %s length runs past end of file (offset %" PRIu64 ", size %" PRIu64 ")", loc(ps),
                    what, ps->pos, ps->size);
    uint64_t len = ld64(ps->base + ps->pos);
    ps->pos += 8;
    if (len > left(ps))
        return perr(ps, "truncated: %s %s length %" PRIu64 " runs past end of file (size %" PRIu64 ")", loc(ps), what,
                    len, ps->size);
    if (len > max) return perr(ps, "%s %s length %" PRIu64 " exceeds the limit %" PRIu64, loc(ps), what, len, max);
    out->ptr = (const char *)(ps->base + ps->pos);
    out->len = len;
    ps->pos += len;
    return AE_OK;
}

static int rd_vtype(parser *ps, const char *what, gguf_vtype *t) {
    uint32_t v;
    if (rd_u32(ps, what, &v)) return AE_ERR;
    if (v >= GGUF_VT_COUNT) return perr(ps, "%s has unknown %s %" PRIu32, loc(ps), what, v);
    *t = (gguf_vtype)v;
    return AE_OK;
}

/* Array header: element type and count, the count checked against both the
 * limit and the bytes left. */
static int rd_array_head(parser *ps, gguf_vtype *type, uint64_t *count) {
    if (rd_vtype(ps, "array element type", type)) return AE_ERR;
    if (rd_u64(ps, "array count", count)) return AE_ERR;
    if (*count > GGUF_MAX_ARRAY)
        return perr(ps, "%s array count %" PRIu64 " exceeds the limit %llu", loc(ps), *count,
                    (unsigned long long)GGUF_MAX_ARRAY);
    uint64_t min = vtype_min_bytes(*type);
    if (*count > left(ps) / min)
        return perr(ps,
                    "truncated: %s array count %" PRIu64 " of %s runs past end of file "
                    "(needs at least %" PRIu64 " bytes, %" PRIu64 " left, size %" PRIu64 ")",
                    loc(ps), *count, gguf_vtype_name(*type), *count * min, left(ps), ps->size);
    return AE_OK;
}

static int skip_value(parser *ps, gguf_vtype t, int depth);

/* Validates count elements of type t at the cursor. `str_at`, when given,
 * receives each string element's file offset. */
static int skip_elements(parser *ps, gguf_vtype t, uint64_t count, int depth, uint64_t *str_at) {
    if (t == GGUF_VT_STRING || t == GGUF_VT_ARRAY || t == GGUF_VT_BOOL) {
        for (uint64_t j = 0; j < count; j++) {
            if (depth == 1) ps->elem = (int64_t)j;
            if (str_at) str_at[j] = ps->pos;
            if (skip_value(ps, t, depth)) return AE_ERR;
        }
        if (depth == 1) ps->elem = -1;
        return AE_OK;
    }
    /* Fixed-size elements: rd_array_head already proved they fit. */
    return take(ps, count * VTYPE_SIZE[t], "array elements", NULL);
}

static int skip_value(parser *ps, gguf_vtype t, int depth) {
    switch (t) {
    case GGUF_VT_STRING: {
        gguf_str s;
        return rd_str(ps, "string", GGUF_MAX_STRING, &s);
    }
    case GGUF_VT_BOOL: {
        const uint8_t *p = NULL;
        if (take(ps, 1, "bool", &p)) return AE_ERR;
        if (*p > 1) return perr(ps, "%s has bool value %u (must be 0 or 1)", loc(ps), *p);
        return AE_OK;
    }
    case GGUF_VT_ARRAY: {
        if (depth >= GGUF_MAX_DEPTH) return perr(ps, "%s nests arrays deeper than %d", loc(ps), GGUF_MAX_DEPTH);
        gguf_vtype et;
        uint64_t count;
        if (rd_array_head(ps, &et, &count)) return AE_ERR;
        return skip_elements(ps, et, count, depth + 1, NULL);
    }
    default: return take(ps, VTYPE_SIZE[t], gguf_vtype_name(t), NULL);
    }
}

/* ---- name index ---------------------------------------------------------- */

static uint64_t hash_name(const char *p, uint64_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (uint64_t i = 0; i < n; i++) {
        h ^= (uint8_t)p[i];
        h *= 1099511628211ull;
    }
    return h;
}

static int index_init(name_index *ix, uint64_t n) {
    uint64_t cap = 8;
    while (cap < 2 * n) cap *= 2; /* load <= 1/2; n <= 65536 so no overflow */
    ix->slots = calloc(cap, sizeof *ix->slots);
    if (!ix->slots) return AE_ERR;
    ix->mask = cap - 1;
    return AE_OK;
}

static gguf_str kv_name(const gguf_file *f, uint64_t i) { return f->kv[i].key; }

static gguf_str tensor_name(const gguf_file *f, uint64_t i) {
    gguf_str s = {f->tensors[i].name, strlen(f->tensors[i].name)};
    return s;
}

/* Finds `name` or the empty slot where it would go. Returns the index + 1
 * stored there (0: absent) and the slot. */
static uint32_t index_probe(const gguf_file *f, const name_index *ix, gguf_str (*name_of)(const gguf_file *, uint64_t),
                            const char *name, uint64_t len, uint64_t *slot) {
    uint64_t s = hash_name(name, len) & ix->mask;
    for (;;) {
        uint32_t v = ix->slots[s];
        if (v == 0) break;
        gguf_str cand = name_of(f, v - 1);
        if (cand.len == len && memcmp(cand.ptr, name, len) == 0) break;
        s = (s + 1) & ix->mask;
    }
    *slot = s;
    return ix->slots[s];
}

/* ---- open ---------------------------------------------------------------- */

/* Names the item being parsed ("kv 3 'general.name'") for error messages.
 * Bytes outside printable ASCII become '?' so a hostile name cannot put a
 * newline or terminal escape into the one-line error. */
static void set_where(parser *ps, const char *kind, uint64_t i, const char *name, uint64_t len) {
    char clean[GGUF_MAX_NAME + 1];
    if (len > GGUF_MAX_NAME) len = GGUF_MAX_NAME;
    for (uint64_t k = 0; k < len; k++) clean[k] = (name[k] >= 0x20 && name[k] < 0x7f) ? name[k] : '?';
    clean[len] = '\0';
    snprintf(ps->where, sizeof ps->where, "%s %" PRIu64 " '%s'", kind, i, clean);
}

static int parse_kv(parser *ps, gguf_file *f, uint64_t i) {
    gguf_kv *kv = &f->kv[i];
    snprintf(ps->where, sizeof ps->where, "kv %" PRIu64, i);
    if (rd_str(ps, "key", GGUF_MAX_NAME, &kv->key)) return AE_ERR;
    if (kv->key.len == 0) return perr(ps, "%s has an empty key", loc(ps));
    if (memchr(kv->key.ptr, 0, kv->key.len)) return perr(ps, "%s key contains a NUL byte", loc(ps));
    set_where(ps, "kv", i, kv->key.ptr, kv->key.len);

    uint64_t slot;
    uint32_t prev = index_probe(f, &f->kv_index, kv_name, kv->key.ptr, kv->key.len, &slot);
    if (prev) return perr(ps, "%s: duplicate key (also kv %u)", ps->where, prev - 1);
    f->kv_index.slots[slot] = (uint32_t)(i + 1);

    if (rd_vtype(ps, "value type", &kv->type)) return AE_ERR;
    if (kv->type != GGUF_VT_ARRAY) {
        kv->val = ps->pos;
        return skip_value(ps, kv->type, 0);
    }
    if (rd_array_head(ps, &kv->arr_type, &kv->arr_len)) return AE_ERR;
    kv->val = ps->pos;
    if (kv->arr_type == GGUF_VT_STRING && kv->arr_len > 0) {
        /* Bounded by rd_array_head: arr_len <= bytes left / 8. */
        kv->str_at = malloc(kv->arr_len * sizeof *kv->str_at);
        if (!kv->str_at) return perr(ps, "%s: out of memory for %" PRIu64 " strings", loc(ps), kv->arr_len);
    }
    return skip_elements(ps, kv->arr_type, kv->arr_len, 1, kv->str_at);
}

static int parse_tensor_info(parser *ps, gguf_file *f, uint64_t i) {
    gguf_tensor *t = &f->tensors[i];
    snprintf(ps->where, sizeof ps->where, "tensor info %" PRIu64, i);
    gguf_str name;
    if (rd_str(ps, "name", GGUF_MAX_NAME, &name)) return AE_ERR;
    if (name.len == 0) return perr(ps, "%s has an empty name", loc(ps));
    if (memchr(name.ptr, 0, name.len)) return perr(ps, "%s name contains a NUL byte", loc(ps));
    t->name = malloc(name.len + 1);
    if (!t->name) return perr(ps, "out of memory");
    memcpy(t->name, name.ptr, name.len);
    t->name[name.len] = '\0';
    set_where(ps, "tensor info", i, name.ptr, name.len);

    uint64_t slot;
    uint32_t prev = index_probe(f, &f->tensor_index, tensor_name, name.ptr, name.len, &slot);
    if (prev) return perr(ps, "%s: duplicate tensor name (also tensor info %u)", ps->where, prev - 1);
    f->tensor_index.slots[slot] = (uint32_t)(i + 1);

    if (rd_u32(ps, "n_dims", &t->n_dims)) return AE_ERR;
    if (t->n_dims < 1 || t->n_dims > 4) return perr(ps, "%s has n_dims %" PRIu32 " (must be 1..4)", loc(ps), t->n_dims);
    t->n_elements = 1;
    for (uint32_t d = 0; d < 4; d++) {
        t->ne[d] = 1;
        if (d >= t->n_dims) continue;
        if (rd_u64(ps, "dimension", &t->ne[d])) return AE_ERR;
        if (t->ne[d] == 0) return perr(ps, "%s dimension %u is 0", loc(ps), d);
        /* ggml counts elements in int64_t. */
        if (t->ne[d] > INT64_MAX / t->n_elements)
            return perr(ps, "%s element count overflows (dimension %u is %" PRIu64 ")", loc(ps), d, t->ne[d]);
        t->n_elements *= t->ne[d];
    }
    uint32_t type;
    if (rd_u32(ps, "type", &type)) return AE_ERR;
    if (!quant_type_known(type)) return perr(ps, "%s has unknown tensor type %" PRIu32, loc(ps), type);
    t->type = (ggml_type)type;
    uint32_t blk = quant_block_elems(t->type);
    if (t->ne[0] % blk)
        return perr(ps, "%s dimension 0 (%" PRIu64 ") is not a multiple of the %s block size %u", loc(ps), t->ne[0],
                    quant_type_name(type), blk);
    /* row bytes <= ne0 * 8 and n_elements < 2^63, so only the final product
     * can overflow; check it anyway in one place. */
    uint64_t rows = t->n_elements / t->ne[0];
    uint64_t row_bytes = quant_row_bytes(t->type, t->ne[0]);
    if (row_bytes == 0 || rows > UINT64_MAX / row_bytes) return perr(ps, "%s byte size overflows", loc(ps));
    t->n_bytes = rows * row_bytes;
    if (rd_u64(ps, "offset", &t->offset)) return AE_ERR;
    return AE_OK;
}

/* Tensor data placement, once the data section's start is known. */
static int place_tensor(parser *ps, gguf_file *f, uint64_t i) {
    gguf_tensor *t = &f->tensors[i];
    set_where(ps, "tensor", i, t->name, strlen(t->name));
    if (t->offset % f->alignment)
        return perr(ps, "%s offset %" PRIu64 " is not a multiple of the alignment %" PRIu32, ps->where, t->offset,
                    f->alignment);
    uint64_t room = f->size - f->data_offset; /* caller made data_offset <= size */
    if (t->offset > room || t->n_bytes > room - t->offset)
        return perr(ps,
                    "truncated: %s data (offset %" PRIu64 ", %" PRIu64 " bytes, data section at %" PRIu64
                    ") runs past end of file (size %" PRIu64 ")",
                    ps->where, t->offset, t->n_bytes, f->data_offset, f->size);
    t->data = f->base + f->data_offset + t->offset;
    return AE_OK;
}

static int parse_alignment(parser *ps, gguf_file *f) {
    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    int64_t i = gguf_find_key(f, "general.alignment");
    if (i < 0) return AE_OK;
    const gguf_kv *kv = &f->kv[i];
    if (kv->type != GGUF_VT_U32)
        return perr(ps, "general.alignment has type %s (must be u32)", gguf_vtype_name(kv->type));
    uint32_t a = ld32(f->base + kv->val);
    if (a == 0 || (a & (a - 1))) return perr(ps, "general.alignment %" PRIu32 " is not a power of two", a);
    f->alignment = a;
    return AE_OK;
}

static int parse(gguf_file *f, ae_error *err) {
    parser ps = {.base = f->base, .size = f->size, .name = f->path, .err = err, .elem = -1};
    snprintf(ps.where, sizeof ps.where, "header");
    if (f->size < 4) return perr(&ps, "truncated: %" PRIu64 " bytes is too short for a GGUF header", f->size);
    if (memcmp(f->base, "GGUF", 4) != 0)
        return perr(&ps, "not a GGUF file (magic %02x %02x %02x %02x, expected 'GGUF')", f->base[0], f->base[1],
                    f->base[2], f->base[3]);
    ps.pos = 4;
    if (rd_u32(&ps, "version", &f->version)) return AE_ERR;
    if (f->version == 1) return perr(&ps, "GGUF version 1 is not supported (only versions 2 and 3)");
    if (f->version != 2 && f->version != 3) {
        uint32_t sw = __builtin_bswap32(f->version);
        if (sw == 2 || sw == 3) return perr(&ps, "big-endian GGUF (version %" PRIu32 ") is not supported", sw);
        return perr(&ps, "unsupported GGUF version %" PRIu32 " (only versions 2 and 3)", f->version);
    }
    if (rd_u64(&ps, "tensor count", &f->n_tensors)) return AE_ERR;
    if (rd_u64(&ps, "kv count", &f->n_kv)) return AE_ERR;

    /* Absurd counts are rejected before anything is sized by them. A kv
     * takes at least 8 (key length) + 1 + 4 (type) + 1 bytes; a tensor
     * info at least 8 + 1 + 4 + 8 + 4 + 8. */
    if (f->n_kv > GGUF_MAX_KV) return perr(&ps, "kv count %" PRIu64 " exceeds the limit %u", f->n_kv, GGUF_MAX_KV);
    if (f->n_tensors > GGUF_MAX_TENSORS)
        return perr(&ps, "tensor count %" PRIu64 " exceeds the limit %u", f->n_tensors, GGUF_MAX_TENSORS);
    if (f->n_kv * 14 + f->n_tensors * 33 > left(&ps))
        return perr(&ps,
                    "truncated: %" PRIu64 " kvs and %" PRIu64 " tensor infos cannot fit in "
                    "the %" PRIu64 " bytes left (size %" PRIu64 ")",
                    f->n_kv, f->n_tensors, left(&ps), f->size);

    f->kv = calloc(f->n_kv ? f->n_kv : 1, sizeof *f->kv);
    f->tensors = calloc(f->n_tensors ? f->n_tensors : 1, sizeof *f->tensors);
    if (!f->kv || !f->tensors || index_init(&f->kv_index, f->n_kv) || index_init(&f->tensor_index, f->n_tensors))
        return perr(&ps, "out of memory");

    for (uint64_t i = 0; i < f->n_kv; i++)
        if (parse_kv(&ps, f, i)) return AE_ERR;
    if (parse_alignment(&ps, f)) return AE_ERR;
    for (uint64_t i = 0; i < f->n_tensors; i++)
        if (parse_tensor_info(&ps, f, i)) return AE_ERR;

    /* pos <= size < 2^64 - alignment, so rounding up cannot wrap. */
    f->data_offset = (ps.pos + f->alignment - 1) / f->alignment * f->alignment;
    if (f->n_tensors == 0) return AE_OK; /* the padding may be absent */
    if (f->data_offset > f->size)
        return perr(&ps, "truncated: data section at %" PRIu64 " starts past end of file (size %" PRIu64 ")",
                    f->data_offset, f->size);
    for (uint64_t i = 0; i < f->n_tensors; i++)
        if (place_tensor(&ps, f, i)) return AE_ERR;
    return AE_OK;
}

static int open_common(gguf_file **out, gguf_file *f, ae_error *err) {
    if (parse(f, err)) {
        gguf_close(f);
        return AE_ERR;
    }
    *out = f;
    return AE_OK;
}

int gguf_open_mem(gguf_file **out, const void *data, size_t size, const char *name, ae_error *err) {
    *out = NULL;
    if (!name) name = "<memory>";
    gguf_file *f = calloc(1, sizeof *f);
    if (!f) return err_set(err, "%s: out of memory", name);
    f->path = strdup(name);
    if (!f->path) {
        free(f);
        return err_set(err, "%s: out of memory", name);
    }
    static const uint8_t empty[1];
    f->base = data ? data : empty;
    f->size = data ? size : 0;
    return open_common(out, f, err);
}

int gguf_open(gguf_file **out, const char *path, ae_error *err) {
    *out = NULL;
    int fd = -1;
    gguf_file *f = calloc(1, sizeof *f);
    if (!f) return err_set(err, "%s: out of memory", path);
    f->path = strdup(path);
    if (!f->path) {
        err_set(err, "%s: out of memory", path);
        goto fail;
    }
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        err_set(err, "%s: cannot open: %s", path, strerror(errno));
        goto fail;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        err_set(err, "%s: cannot stat: %s", path, strerror(errno));
        goto fail;
    }
    if (!S_ISREG(st.st_mode)) {
        err_set(err, "%s: not a regular file", path);
        goto fail;
    }
    f->size = (uint64_t)st.st_size;
    if (f->size > 0) {
        void *m = mmap(NULL, (size_t)f->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            err_set(err, "%s: cannot map %" PRIu64 " bytes: %s", path, f->size, strerror(errno));
            goto fail;
        }
        f->base = m;
        f->mapped = true;
    } else {
        static const uint8_t empty[1];
        f->base = empty;
    }
    close(fd); /* the mapping keeps the file */
    return open_common(out, f, err);

fail:
    if (fd >= 0) close(fd);
    gguf_close(f);
    return AE_ERR;
}

void gguf_close(gguf_file *f) {
    if (!f) return;
    if (f->kv)
        for (uint64_t i = 0; i < f->n_kv; i++) free(f->kv[i].str_at);
    if (f->tensors)
        for (uint64_t i = 0; i < f->n_tensors; i++) free(f->tensors[i].name);
    free(f->kv);
    free(f->tensors);
    free(f->kv_index.slots);
    free(f->tensor_index.slots);
    if (f->mapped) munmap((void *)f->base, (size_t)f->size);
    free(f->path);
    free(f);
}

/* ---- accessors ----------------------------------------------------------- */

uint32_t gguf_version(const gguf_file *f) { return f->version; }
uint32_t gguf_alignment(const gguf_file *f) { return f->alignment; }
const char *gguf_path(const gguf_file *f) { return f->path; }
uint64_t gguf_file_size(const gguf_file *f) { return f->size; }
uint64_t gguf_data_offset(const gguf_file *f) { return f->data_offset; }
uint64_t gguf_n_kv(const gguf_file *f) { return f->n_kv; }
uint64_t gguf_n_tensors(const gguf_file *f) { return f->n_tensors; }

static const gguf_kv *kv_at(const gguf_file *f, uint64_t i) {
    AE_ASSERT(i < f->n_kv);
    return &f->kv[i];
}

gguf_str gguf_kv_key(const gguf_file *f, uint64_t i) { return kv_at(f, i)->key; }
gguf_vtype gguf_kv_type(const gguf_file *f, uint64_t i) { return kv_at(f, i)->type; }

gguf_vtype gguf_arr_type(const gguf_file *f, uint64_t i) {
    const gguf_kv *kv = kv_at(f, i);
    return kv->type == GGUF_VT_ARRAY ? kv->arr_type : GGUF_VT_COUNT;
}

uint64_t gguf_arr_len(const gguf_file *f, uint64_t i) {
    const gguf_kv *kv = kv_at(f, i);
    return kv->type == GGUF_VT_ARRAY ? kv->arr_len : 0;
}

int64_t gguf_find_key(const gguf_file *f, const char *key) {
    if (!f->kv_index.slots || !key) return -1;
    uint64_t slot;
    uint32_t v = index_probe(f, &f->kv_index, kv_name, key, strlen(key), &slot);
    return v ? (int64_t)v - 1 : -1;
}

const gguf_tensor *gguf_tensor_at(const gguf_file *f, uint64_t i) { return i < f->n_tensors ? &f->tensors[i] : NULL; }

const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name) {
    if (!f->tensor_index.slots || !name) return NULL;
    uint64_t slot;
    uint32_t v = index_probe(f, &f->tensor_index, tensor_name, name, strlen(name), &slot);
    return v ? &f->tensors[v - 1] : NULL;
}

bool gguf_str_eq(gguf_str s, const char *c) {
    size_t n = strlen(c);
    return s.len == n && memcmp(s.ptr, c, n) == 0;
}

/* ---- typed values -------------------------------------------------------- */

/* A number read from the file, wide enough for every scalar type. */
typedef struct number {
    enum { NUM_UNSIGNED, NUM_SIGNED, NUM_FLOAT, NUM_NONE } kind;
    uint64_t u;
    int64_t i;
    double f;
} number;

static number load_number(gguf_vtype t, const uint8_t *p) {
    number n = {.kind = NUM_NONE};
    switch (t) {
    case GGUF_VT_U8:
        n.kind = NUM_UNSIGNED;
        n.u = p[0];
        break;
    case GGUF_VT_U16:
        n.kind = NUM_UNSIGNED;
        n.u = ld16(p);
        break;
    case GGUF_VT_U32:
        n.kind = NUM_UNSIGNED;
        n.u = ld32(p);
        break;
    case GGUF_VT_U64:
        n.kind = NUM_UNSIGNED;
        n.u = ld64(p);
        break;
    case GGUF_VT_I8:
        n.kind = NUM_SIGNED;
        n.i = (int8_t)p[0];
        break;
    case GGUF_VT_I16:
        n.kind = NUM_SIGNED;
        n.i = (int16_t)ld16(p);
        break;
    case GGUF_VT_I32:
        n.kind = NUM_SIGNED;
        n.i = (int32_t)ld32(p);
        break;
    case GGUF_VT_I64:
        n.kind = NUM_SIGNED;
        n.i = (int64_t)ld64(p);
        break;
    case GGUF_VT_F32: {
        uint32_t b = ld32(p);
        float v;
        memcpy(&v, &b, sizeof v);
        n.kind = NUM_FLOAT;
        n.f = v;
        break;
    }
    case GGUF_VT_F64: {
        uint64_t b = ld64(p);
        memcpy(&n.f, &b, sizeof n.f);
        n.kind = NUM_FLOAT;
        break;
    }
    default: break;
    }
    return n;
}

/* Looks up a scalar key; fills kv or sets "key <name>: absent". */
static int find_scalar(const gguf_file *f, const char *key, const gguf_kv **kv, ae_error *err) {
    int64_t i = gguf_find_key(f, key);
    if (i < 0) return err_set(err, "key %s: absent", key);
    *kv = &f->kv[i];
    return AE_OK;
}

static int wrong_type(const gguf_kv *kv, const char *key, const char *want, ae_error *err) {
    return err_set(err, "key %s: has type %s, expected %s", key, gguf_vtype_name(kv->type), want);
}

/* Any integer key as a range-checked value in [min, max] (signed view) or
 * [0, umax] (unsigned view). */
static int get_int(const gguf_file *f, const char *key, bool want_signed, int64_t min, int64_t max, uint64_t umax,
                   uint64_t *u, int64_t *s, ae_error *err) {
    const gguf_kv *kv = NULL;
    if (find_scalar(f, key, &kv, err)) return AE_ERR;
    number n = load_number(kv->type, f->base + kv->val);
    if (n.kind != NUM_UNSIGNED && n.kind != NUM_SIGNED) return wrong_type(kv, key, "an integer", err);
    if (want_signed) {
        if (n.kind == NUM_UNSIGNED ? n.u > (uint64_t)max : (n.i < min || n.i > max)) goto range;
        *s = n.kind == NUM_UNSIGNED ? (int64_t)n.u : n.i;
    } else {
        if (n.kind == NUM_SIGNED ? (n.i < 0 || (uint64_t)n.i > umax) : n.u > umax) goto range;
        *u = n.kind == NUM_SIGNED ? (uint64_t)n.i : n.u;
    }
    return AE_OK;
range:
    if (n.kind == NUM_SIGNED) return err_set(err, "key %s: value %" PRId64 " out of range", key, n.i);
    return err_set(err, "key %s: value %" PRIu64 " out of range", key, n.u);
}

int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out, ae_error *err) {
    uint64_t v = 0;
    if (get_int(f, key, false, 0, 0, UINT32_MAX, &v, NULL, err)) return AE_ERR;
    *out = (uint32_t)v;
    return AE_OK;
}

int gguf_get_u64(const gguf_file *f, const char *key, uint64_t *out, ae_error *err) {
    return get_int(f, key, false, 0, 0, UINT64_MAX, out, NULL, err);
}

int gguf_get_i64(const gguf_file *f, const char *key, int64_t *out, ae_error *err) {
    return get_int(f, key, true, INT64_MIN, INT64_MAX, 0, NULL, out, err);
}

int gguf_get_f64(const gguf_file *f, const char *key, double *out, ae_error *err) {
    const gguf_kv *kv = NULL;
    if (find_scalar(f, key, &kv, err)) return AE_ERR;
    number n = load_number(kv->type, f->base + kv->val);
    if (n.kind != NUM_FLOAT) return wrong_type(kv, key, "f32 or f64", err);
    *out = n.f;
    return AE_OK;
}

int gguf_get_f32(const gguf_file *f, const char *key, float *out, ae_error *err) {
    double v = 0;
    if (gguf_get_f64(f, key, &v, err)) return AE_ERR;
    /* f64 values must fit; rounding to the nearest f32 is fine. */
    if (isfinite(v) && fabs(v) > FLT_MAX) return err_set(err, "key %s: value %g out of f32 range", key, v);
    *out = (float)v;
    return AE_OK;
}

int gguf_get_bool(const gguf_file *f, const char *key, bool *out, ae_error *err) {
    const gguf_kv *kv = NULL;
    if (find_scalar(f, key, &kv, err)) return AE_ERR;
    if (kv->type != GGUF_VT_BOOL) return wrong_type(kv, key, "bool", err);
    *out = f->base[kv->val] != 0;
    return AE_OK;
}

static gguf_str load_str(const gguf_file *f, uint64_t at) {
    gguf_str s = {(const char *)(f->base + at + 8), ld64(f->base + at)};
    return s;
}

int gguf_get_str(const gguf_file *f, const char *key, gguf_str *out, ae_error *err) {
    const gguf_kv *kv = NULL;
    if (find_scalar(f, key, &kv, err)) return AE_ERR;
    if (kv->type != GGUF_VT_STRING) return wrong_type(kv, key, "string", err);
    *out = load_str(f, kv->val);
    return AE_OK;
}

/* Element j of array key i when its type is scalar; NULL otherwise. */
static const uint8_t *arr_elem(const gguf_file *f, uint64_t i, uint64_t j, const gguf_kv **kv) {
    if (i >= f->n_kv) return NULL;
    *kv = &f->kv[i];
    if ((*kv)->type != GGUF_VT_ARRAY || j >= (*kv)->arr_len) return NULL;
    uint8_t size = VTYPE_SIZE[(*kv)->arr_type];
    if (size == 0) return NULL;
    return f->base + (*kv)->val + j * size;
}

int gguf_arr_str(const gguf_file *f, uint64_t i, uint64_t j, gguf_str *out) {
    if (i >= f->n_kv) return AE_ERR;
    const gguf_kv *kv = &f->kv[i];
    if (kv->type != GGUF_VT_ARRAY || kv->arr_type != GGUF_VT_STRING || j >= kv->arr_len) return AE_ERR;
    *out = load_str(f, kv->str_at[j]);
    return AE_OK;
}

int gguf_arr_i64(const gguf_file *f, uint64_t i, uint64_t j, int64_t *out) {
    const gguf_kv *kv = NULL;
    const uint8_t *p = arr_elem(f, i, j, &kv);
    if (!p) return AE_ERR;
    number n = load_number(kv->arr_type, p);
    if (n.kind == NUM_SIGNED) {
        *out = n.i;
    } else if (n.kind == NUM_UNSIGNED && n.u <= INT64_MAX) {
        *out = (int64_t)n.u;
    } else {
        return AE_ERR;
    }
    return AE_OK;
}

int gguf_arr_f64(const gguf_file *f, uint64_t i, uint64_t j, double *out) {
    const gguf_kv *kv = NULL;
    const uint8_t *p = arr_elem(f, i, j, &kv);
    if (!p) return AE_ERR;
    number n = load_number(kv->arr_type, p);
    if (n.kind != NUM_FLOAT) return AE_ERR;
    *out = n.f;
    return AE_OK;
}

/* ---- formatting ---------------------------------------------------------- */

/* Appends to a fixed buffer, always NUL-terminated, silently truncating. */
typedef struct sbuf {
    char *p;
    size_t n;   /* capacity including the NUL */
    size_t len; /* bytes written, < n */
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t len) {
    if (b->n == 0) return;
    size_t room = b->n - 1 - b->len;
    if (len > room) len = room;
    memcpy(b->p + b->len, s, len);
    b->len += len;
    b->p[b->len] = '\0';
}

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void sb_printf(sbuf *b, const char *fmt, ...) {
    char tmp[64];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0) sb_put(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

/* A quoted string with control bytes escaped, cut after `max` source bytes
 * (at a UTF-8 boundary) with "..." and the full length. */
static void sb_quoted(sbuf *b, gguf_str s, uint64_t max) {
    uint64_t len = s.len;
    bool cut = len > max;
    if (cut) {
        len = max;
        while (len > 0 && ((uint8_t)s.ptr[len] & 0xc0) == 0x80) len--;
    }
    sb_put(b, "\"", 1);
    for (uint64_t k = 0; k < len; k++) {
        uint8_t c = (uint8_t)s.ptr[k];
        switch (c) {
        case '"': sb_put(b, "\\\"", 2); break;
        case '\\': sb_put(b, "\\\\", 2); break;
        case '\n': sb_put(b, "\\n", 2); break;
        case '\r': sb_put(b, "\\r", 2); break;
        case '\t': sb_put(b, "\\t", 2); break;
        default:
            if (c < 0x20 || c == 0x7f)
                sb_printf(b, "\\x%02x", c);
            else
                sb_put(b, (const char *)&c, 1);
        }
    }
    sb_put(b, "\"", 1);
    if (cut) sb_printf(b, "... (%" PRIu64 " bytes)", s.len);
}

/* The shortest %g text that reads back as the same value, so an epsilon
 * of 1e-5f prints as "1e-05", not "9.99999975e-06". 9 and 17 digits
 * always round-trip f32 and f64. */
static void sb_float(sbuf *b, double v, bool single) {
    char tmp[40];
    int lo = single ? 6 : 15, hi = single ? 9 : 17;
    for (int prec = lo; prec <= hi; prec++) {
        snprintf(tmp, sizeof tmp, "%.*g", prec, v);
        if (single ? strtof(tmp, NULL) == (float)v : strtod(tmp, NULL) == v) break;
    }
    sb_put(b, tmp, strlen(tmp));
}

static void sb_scalar(sbuf *b, gguf_vtype t, const uint8_t *p) {
    if (t == GGUF_VT_BOOL) {
        sb_printf(b, "%s", p[0] ? "true" : "false");
        return;
    }
    number n = load_number(t, p);
    switch (n.kind) {
    case NUM_UNSIGNED: sb_printf(b, "%" PRIu64, n.u); break;
    case NUM_SIGNED: sb_printf(b, "%" PRId64, n.i); break;
    case NUM_FLOAT: sb_float(b, n.f, t == GGUF_VT_F32); break;
    default: break;
    }
}

#define FORMAT_STR_MAX 64     /* bytes of a string value shown */
#define FORMAT_ARR_MAX 8      /* arrays up to this long are shown in full */
#define FORMAT_ARR_STR_MAX 24 /* bytes of each string element shown */

void gguf_kv_format(const gguf_file *f, uint64_t i, char *buf, size_t n) {
    sbuf b = {buf, n, 0};
    if (n == 0) return;
    buf[0] = '\0';
    const gguf_kv *kv = kv_at(f, i);
    if (kv->type == GGUF_VT_STRING) {
        sb_quoted(&b, load_str(f, kv->val), FORMAT_STR_MAX);
        return;
    }
    if (kv->type != GGUF_VT_ARRAY) {
        sb_scalar(&b, kv->type, f->base + kv->val);
        return;
    }
    if (kv->arr_len > FORMAT_ARR_MAX || kv->arr_type == GGUF_VT_ARRAY) {
        sb_printf(&b, "[%s x %" PRIu64 "]", gguf_vtype_name(kv->arr_type), kv->arr_len);
        return;
    }
    sb_put(&b, "[", 1);
    for (uint64_t j = 0; j < kv->arr_len; j++) {
        if (j) sb_put(&b, ", ", 2);
        if (kv->arr_type == GGUF_VT_STRING)
            sb_quoted(&b, load_str(f, kv->str_at[j]), FORMAT_ARR_STR_MAX);
        else
            sb_scalar(&b, kv->arr_type, f->base + kv->val + j * VTYPE_SIZE[kv->arr_type]);
    }
    sb_put(&b, "]", 1);
}
