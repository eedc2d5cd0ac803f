#include "safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../core/file.h"
#include "../core/json.h"
#include "quant.h"

/* The file is little-endian; tensor data is handed out as-is. */
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors.c assumes a little-endian host"
#endif

/* Largest integer a JSON number (a double in cJSON) holds exactly. Offsets
 * and dims beyond it cannot describe a real file anyway. */
#define SAFETENSORS_JSON_INT_MAX (INT64_C(1) << 53)

/* An index.json is a few hundred KB even for the largest checkpoints. */
#define SAFETENSORS_MAX_INDEX (64u * 1024u * 1024u)
#define SAFETENSORS_MAX_SHARD_NAME 255u

static const struct {
    const char *name;
    size_t size;
} dtype_info[SAFETENSORS_DTYPE_COUNT] = {
    [SAFETENSORS_BOOL] = {"BOOL", 1}, [SAFETENSORS_U8] = {"U8", 1},   [SAFETENSORS_I8] = {"I8", 1},
    [SAFETENSORS_U16] = {"U16", 2},   [SAFETENSORS_I16] = {"I16", 2}, [SAFETENSORS_F16] = {"F16", 2},
    [SAFETENSORS_BF16] = {"BF16", 2}, [SAFETENSORS_U32] = {"U32", 4}, [SAFETENSORS_I32] = {"I32", 4},
    [SAFETENSORS_F32] = {"F32", 4},   [SAFETENSORS_U64] = {"U64", 8}, [SAFETENSORS_I64] = {"I64", 8},
    [SAFETENSORS_F64] = {"F64", 8},
};

const char *safetensors_dtype_name(safetensors_dtype d) {
    return (unsigned)d < SAFETENSORS_DTYPE_COUNT ? dtype_info[d].name : "?";
}

size_t safetensors_dtype_size(safetensors_dtype d) {
    return (unsigned)d < SAFETENSORS_DTYPE_COUNT ? dtype_info[d].size : 0;
}

typedef struct safetensors_meta {
    const char *key;   /* into json */
    const char *value; /* into json */
} safetensors_meta;

struct safetensors_file {
    char *path;                         /* owned; the name used in error text */
    const uint8_t *base;                /* whole file: mapping or caller's buffer */
    size_t size;                        /* bytes at base */
    void *map;                          /* non-NULL when safetensors_open mapped the file */
    cJSON *json;                        /* parsed header; names and metadata point in */
    safetensors_tensor *tensors;        /* (n_tensors) sorted by offset */
    const safetensors_tensor **by_name; /* (n_tensors) sorted by name */
    size_t n_tensors;
    safetensors_meta *meta; /* (n_meta) sorted by key */
    size_t n_meta;
};

/* ---- header validation ------------------------------------------------ */

/* Rejects bytes cJSON would accept but mangle: invalid UTF-8 (names must
 * mean the same thing to the Python writer) and NUL, raw or escaped as
 * \u0000, which would silently truncate a C string. Only string contents
 * can hold a backslash in valid JSON, so tracking quotes is enough. */
static int header_scan(const uint8_t *h, size_t n, ae_error *err) {
    bool in_str = false;
    size_t i = 0;
    while (i < n) {
        uint8_t c = h[i];
        if (c == 0) return err_set(err, "header has a NUL byte at %zu", i);
        if (c < 0x80) {
            if (in_str && c == '\\') {
                if (n - i >= 6 && h[i + 1] == 'u' && memcmp(h + i + 2, "0000", 4) == 0)
                    return err_set(err, "header has a \\u0000 escape at %zu", i);
                i += 2; /* the escaped byte may be a quote */
                continue;
            }
            if (c == '"') in_str = !in_str;
            i++;
            continue;
        }
        size_t len;
        uint32_t cp, min;
        if ((c & 0xE0) == 0xC0) {
            len = 2, cp = c & 0x1Fu, min = 0x80;
        } else if ((c & 0xF0) == 0xE0) {
            len = 3, cp = c & 0x0Fu, min = 0x800;
        } else if ((c & 0xF8) == 0xF0) {
            len = 4, cp = c & 0x07u, min = 0x10000;
        } else {
            return err_set(err, "header has invalid UTF-8 at %zu", i);
        }
        if (len > n - i) return err_set(err, "header has invalid UTF-8 at %zu", i);
        for (size_t k = 1; k < len; k++) {
            if ((h[i + k] & 0xC0) != 0x80) return err_set(err, "header has invalid UTF-8 at %zu", i);
            cp = (cp << 6) | (h[i + k] & 0x3Fu);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return err_set(err, "header has invalid UTF-8 at %zu", i);
        i += len;
    }
    return AE_OK;
}

/* A non-negative integral JSON number that a double holds exactly. */
static bool json_u64(const cJSON *v, uint64_t *out) {
    int64_t i;
    if (!json_int(v, 0, SAFETENSORS_JSON_INT_MAX, &i)) return false;
    *out = (uint64_t)i;
    return true;
}

static bool dtype_parse(const char *s, safetensors_dtype *out) {
    for (int d = 0; d < SAFETENSORS_DTYPE_COUNT; d++) {
        if (strcmp(s, dtype_info[d].name) == 0) {
            *out = (safetensors_dtype)d;
            return true;
        }
    }
    return false;
}

/* Fills t from one header entry; the byte range is checked against the
 * data section here, the tiling later. */
static int parse_entry(const cJSON *e, safetensors_tensor *t, uint64_t data_size, ae_error *err) {
    const char *nm = t->name;
    if (!cJSON_IsObject(e)) return err_set(err, "tensor \"%.200s\": entry is not an object", nm);
    const cJSON *dtype = NULL, *shape = NULL, *offs = NULL;
    const cJSON *c;
    cJSON_ArrayForEach(c, e) {
        const cJSON **slot = NULL;
        if (strcmp(c->string, "dtype") == 0)
            slot = &dtype;
        else if (strcmp(c->string, "shape") == 0)
            slot = &shape;
        else if (strcmp(c->string, "data_offsets") == 0)
            slot = &offs;
        else
            return err_set(err, "tensor \"%.200s\": unknown key \"%.100s\"", nm, c->string);
        if (*slot) return err_set(err, "tensor \"%.200s\": duplicate key \"%s\"", nm, c->string);
        *slot = c;
    }
    if (!dtype) return err_set(err, "tensor \"%.200s\": no dtype", nm);
    if (!shape) return err_set(err, "tensor \"%.200s\": no shape", nm);
    if (!offs) return err_set(err, "tensor \"%.200s\": no data_offsets", nm);

    if (!cJSON_IsString(dtype)) return err_set(err, "tensor \"%.200s\": dtype is not a string", nm);
    if (!dtype_parse(dtype->valuestring, &t->dtype))
        return err_set(err, "tensor \"%.200s\": unknown dtype \"%.40s\"", nm, dtype->valuestring);

    if (!cJSON_IsArray(shape)) return err_set(err, "tensor \"%.200s\": shape is not an array", nm);
    int rank = cJSON_GetArraySize(shape);
    if (rank < 0 || (unsigned)rank > SAFETENSORS_MAX_DIMS)
        return err_set(err, "tensor \"%.200s\": shape rank %d exceeds %u", nm, rank, SAFETENSORS_MAX_DIMS);
    t->n_dims = (uint32_t)rank;
    for (uint32_t i = 0; i < SAFETENSORS_MAX_DIMS; i++) t->shape[i] = 1;
    uint64_t n_el = 1;
    uint32_t i = 0;
    cJSON_ArrayForEach(c, shape) {
        uint64_t dim;
        if (!json_u64(c, &dim))
            return err_set(err,
                           "tensor \"%.200s\": shape[%u] is not a "
                           "non-negative integer",
                           nm, i);
        if (__builtin_mul_overflow(n_el, dim, &n_el)) return err_set(err, "tensor \"%.200s\": shape overflows", nm);
        t->shape[i++] = dim;
    }
    t->n_elements = n_el;
    if (__builtin_mul_overflow(n_el, (uint64_t)safetensors_dtype_size(t->dtype), &t->n_bytes))
        return err_set(err, "tensor \"%.200s\": byte size overflows", nm);

    uint64_t begin, end;
    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2 || !json_u64(cJSON_GetArrayItem(offs, 0), &begin) ||
        !json_u64(cJSON_GetArrayItem(offs, 1), &end))
        return err_set(err,
                       "tensor \"%.200s\": data_offsets is not "
                       "[begin, end] of non-negative integers",
                       nm);
    if (begin > end)
        return err_set(err,
                       "tensor \"%.200s\": data_offsets begin %llu > "
                       "end %llu",
                       nm, (unsigned long long)begin, (unsigned long long)end);
    if (end > data_size)
        return err_set(err,
                       "tensor \"%.200s\": data_offsets end %llu is past "
                       "the data section (%llu bytes)",
                       nm, (unsigned long long)end, (unsigned long long)data_size);
    if (end - begin != t->n_bytes)
        return err_set(err,
                       "tensor \"%.200s\": %llu bytes in data_offsets, "
                       "but shape and %s need %llu",
                       nm, (unsigned long long)(end - begin), safetensors_dtype_name(t->dtype),
                       (unsigned long long)t->n_bytes);
    t->offset = begin;
    return AE_OK;
}

static int parse_metadata(safetensors_file *f, const cJSON *m, ae_error *err) {
    if (!cJSON_IsObject(m)) return err_set(err, "__metadata__ is not an object");
    int n = cJSON_GetArraySize(m);
    if (n <= 0) return AE_OK;
    f->meta = calloc((size_t)n, sizeof *f->meta);
    if (!f->meta) return err_set(err, "out of memory");
    const cJSON *c;
    cJSON_ArrayForEach(c, m) {
        if (!cJSON_IsString(c)) return err_set(err, "__metadata__ \"%.200s\" is not a string", c->string);
        f->meta[f->n_meta].key = c->string;
        f->meta[f->n_meta].value = c->valuestring;
        f->n_meta++;
    }
    return AE_OK;
}

static int cmp_offset(const void *a, const void *b) {
    const safetensors_tensor *x = a, *y = b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    if (x->n_bytes != y->n_bytes) return x->n_bytes < y->n_bytes ? -1 : 1;
    return 0;
}

static int cmp_tensor_name(const void *a, const void *b) {
    const safetensors_tensor *const *x = a, *const *y = b;
    return strcmp((*x)->name, (*y)->name);
}

static int cmp_meta(const void *a, const void *b) {
    const safetensors_meta *x = a, *y = b;
    return strcmp(x->key, y->key);
}

/* Validates f->base/f->size and fills the rest of f. Error text has no
 * path; the callers prepend it. */
static int parse(safetensors_file *f, ae_error *err) {
    if (f->size < 8) return err_set(err, "%zu bytes is too small for a safetensors file", f->size);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | f->base[i];
    if (n > SAFETENSORS_MAX_HEADER)
        return err_set(err, "header length %llu exceeds the limit of %u", (unsigned long long)n,
                       SAFETENSORS_MAX_HEADER);
    if (n > f->size - 8)
        return err_set(err,
                       "header length %llu runs past the end of the file "
                       "(%zu bytes)",
                       (unsigned long long)n, f->size);
    const uint8_t *h = f->base + 8;
    if (n < 2 || h[0] != '{') return err_set(err, "header does not start with a JSON object");
    if (header_scan(h, (size_t)n, err) != AE_OK) return AE_ERR;

    /* cJSON gets a NUL-terminated copy so that no path of its parser can
     * read past the header, whatever the bytes. */
    char *buf = malloc((size_t)n + 1);
    if (!buf) return err_set(err, "out of memory for a %llu byte header", (unsigned long long)n);
    memcpy(buf, h, (size_t)n);
    buf[n] = '\0';
    f->json = json_parse(buf, (size_t)n, err);
    free(buf);
    if (!f->json) {
        err_prefix(err, "header: ");
        return AE_ERR;
    }
    if (!cJSON_IsObject(f->json)) return err_set(err, "header is not a JSON object");

    uint64_t data_size = (uint64_t)(f->size - 8) - n;
    const uint8_t *data = h + n;
    int n_keys = cJSON_GetArraySize(f->json);
    if (n_keys < 0 || (unsigned)n_keys > SAFETENSORS_MAX_TENSORS + 1)
        return err_set(err, "header has %d entries, more than %u", n_keys, SAFETENSORS_MAX_TENSORS);
    if (n_keys > 0) {
        f->tensors = calloc((size_t)n_keys, sizeof *f->tensors);
        if (!f->tensors) return err_set(err, "out of memory");
    }
    bool seen_meta = false;
    const cJSON *c;
    cJSON_ArrayForEach(c, f->json) {
        if (strcmp(c->string, "__metadata__") == 0) {
            if (seen_meta) return err_set(err, "duplicate __metadata__");
            seen_meta = true;
            if (parse_metadata(f, c, err) != AE_OK) return AE_ERR;
            continue;
        }
        size_t len = strlen(c->string);
        if (len == 0) return err_set(err, "a tensor has an empty name");
        if (len > SAFETENSORS_MAX_NAME)
            return err_set(err, "tensor name of %zu bytes exceeds %u", len, SAFETENSORS_MAX_NAME);
        if (f->n_tensors == SAFETENSORS_MAX_TENSORS)
            return err_set(err, "more than %u tensors", SAFETENSORS_MAX_TENSORS);
        safetensors_tensor *t = &f->tensors[f->n_tensors++];
        t->name = c->string;
        if (parse_entry(c, t, data_size, err) != AE_OK) return AE_ERR;
    }

    /* The tensors must tile the data section: a gap or a tail could hide
     * data no reader accounts for, and an overlap aliases two tensors. */
    if (f->n_tensors > 0) qsort(f->tensors, f->n_tensors, sizeof *f->tensors, cmp_offset);
    uint64_t covered = 0;
    for (size_t i = 0; i < f->n_tensors; i++) {
        safetensors_tensor *t = &f->tensors[i];
        if (t->offset < covered)
            return err_set(err, "tensors \"%.200s\" and \"%.200s\" overlap", f->tensors[i - 1].name, t->name);
        if (t->offset > covered)
            return err_set(err, "gap of %llu bytes before tensor \"%.200s\"", (unsigned long long)(t->offset - covered),
                           t->name);
        covered = t->offset + t->n_bytes;
        t->data = data + t->offset;
    }
    if (covered != data_size)
        return err_set(err,
                       "data section has %llu bytes, but tensors cover "
                       "%llu",
                       (unsigned long long)data_size, (unsigned long long)covered);

    if (f->n_tensors > 0) {
        f->by_name = malloc(f->n_tensors * sizeof *f->by_name);
        if (!f->by_name) return err_set(err, "out of memory");
        for (size_t i = 0; i < f->n_tensors; i++) f->by_name[i] = &f->tensors[i];
        qsort(f->by_name, f->n_tensors, sizeof *f->by_name, cmp_tensor_name);
        for (size_t i = 1; i < f->n_tensors; i++)
            if (strcmp(f->by_name[i - 1]->name, f->by_name[i]->name) == 0)
                return err_set(err, "duplicate tensor \"%.200s\"", f->by_name[i]->name);
    }
    if (f->n_meta > 0) {
        qsort(f->meta, f->n_meta, sizeof *f->meta, cmp_meta);
        for (size_t i = 1; i < f->n_meta; i++)
            if (strcmp(f->meta[i - 1].key, f->meta[i].key) == 0)
                return err_set(err, "duplicate __metadata__ key \"%.200s\"", f->meta[i].key);
    }
    return AE_OK;
}

/* ---- open / close ------------------------------------------------------ */

void safetensors_close(safetensors_file *f) {
    if (!f) return;
    if (f->map) munmap(f->map, f->size);
    cJSON_Delete(f->json);
    free(f->tensors);
    free(f->by_name);
    free(f->meta);
    free(f->path);
    free(f);
}

int safetensors_open_mem(safetensors_file **out, const void *data, size_t size, const char *name, ae_error *err) {
    *out = NULL;
    ae_error local = {{0}};
    safetensors_file *f = calloc(1, sizeof *f);
    if (!f) {
        err_set(&local, "out of memory");
        goto fail;
    }
    f->path = strdup(name ? name : "(memory)");
    if (!f->path) {
        err_set(&local, "out of memory");
        goto fail;
    }
    f->base = data;
    f->size = size;
    if (parse(f, &local) != AE_OK) goto fail;
    *out = f;
    return AE_OK;
fail:
    safetensors_close(f);
    return err_set(err, "%s: %s", name ? name : "(memory)", local.msg);
}

int safetensors_open(safetensors_file **out, const char *path, ae_error *err) {
    *out = NULL;
    ae_error local = {{0}};
    int fd = -1;
    safetensors_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        err_set(&local, "out of memory");
        goto fail;
    }
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        err_set(&local, "cannot open: %s", strerror(errno));
        goto fail;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        err_set(&local, "cannot stat: %s", strerror(errno));
        goto fail;
    }
    if (!S_ISREG(sb.st_mode)) {
        err_set(&local, "not a regular file");
        goto fail;
    }
    if ((uint64_t)sb.st_size > SIZE_MAX) {
        err_set(&local, "file too large to map");
        goto fail;
    }
    f->size = (size_t)sb.st_size;
    if (f->size > 0) { /* mmap rejects length 0; parse reports it instead */
        void *m = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            err_set(&local, "cannot map: %s", strerror(errno));
            goto fail;
        }
        f->map = m;
        f->base = m;
    }
    close(fd);
    fd = -1;
    if (parse(f, &local) != AE_OK) goto fail;
    *out = f;
    return AE_OK;
fail:
    if (fd >= 0) close(fd);
    safetensors_close(f);
    return err_set(err, "%s: %s", path, local.msg);
}

/* ---- accessors --------------------------------------------------------- */

const char *safetensors_path(const safetensors_file *f) { return f->path; }

size_t safetensors_count(const safetensors_file *f) { return f->n_tensors; }

const safetensors_tensor *safetensors_tensor_at(const safetensors_file *f, size_t i) {
    AE_ASSERT(i < f->n_tensors);
    return &f->tensors[i];
}

static const safetensors_tensor *find_in(const safetensors_tensor *const *by_name, size_t n, const char *name) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(name, by_name[mid]->name);
        if (c == 0) return by_name[mid];
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

const safetensors_tensor *safetensors_find(const safetensors_file *f, const char *name) {
    return find_in(f->by_name, f->n_tensors, name);
}

size_t safetensors_metadata_count(const safetensors_file *f) { return f->n_meta; }

void safetensors_metadata_at(const safetensors_file *f, size_t i, const char **key, const char **value) {
    AE_ASSERT(i < f->n_meta);
    if (key) *key = f->meta[i].key;
    if (value) *value = f->meta[i].value;
}

const char *safetensors_metadata_get(const safetensors_file *f, const char *key) {
    size_t lo = 0, hi = f->n_meta;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(key, f->meta[mid].key);
        if (c == 0) return f->meta[mid].value;
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

/* ---- converters -------------------------------------------------------- */

static int check_n(const safetensors_tensor *t, uint64_t n, ae_error *err) {
    if (n > t->n_elements)
        return err_set(err, "tensor \"%.200s\": %llu elements asked, %llu held", t->name, (unsigned long long)n,
                       (unsigned long long)t->n_elements);
    return AE_OK;
}

static int unsupported(const safetensors_tensor *t, const char *to, const char *supported, ae_error *err) {
    return err_set(err,
                   "tensor \"%.200s\": dtype %s cannot be converted to %s "
                   "(supported: %s)",
                   t->name, safetensors_dtype_name(t->dtype), to, supported);
}

int safetensors_tensor_to_f32(const safetensors_tensor *t, float *dst, uint64_t n, ae_error *err) {
    if (check_n(t, n, err) != AE_OK) return AE_ERR;
    const uint8_t *p = t->data;
    switch (t->dtype) {
    case SAFETENSORS_F32:
        if (n > 0) memcpy(dst, p, n * sizeof(float));
        return AE_OK;
    case SAFETENSORS_F16:
    case SAFETENSORS_BF16:
        for (uint64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, sizeof h);
            dst[i] = t->dtype == SAFETENSORS_F16 ? quant_f16_to_f32(h) : quant_bf16_to_f32(h);
        }
        return AE_OK;
    default: return unsupported(t, "f32", "F32, F16, BF16", err);
    }
}

int safetensors_tensor_to_i64(const safetensors_tensor *t, int64_t *dst, uint64_t n, ae_error *err) {
    if (check_n(t, n, err) != AE_OK) return AE_ERR;
    const uint8_t *p = t->data;
    switch (t->dtype) {
    case SAFETENSORS_I64:
        if (n > 0) memcpy(dst, p, n * sizeof(int64_t));
        return AE_OK;
    case SAFETENSORS_I32:
        for (uint64_t i = 0; i < n; i++) {
            int32_t v;
            memcpy(&v, p + 4 * i, sizeof v);
            dst[i] = v;
        }
        return AE_OK;
    default: return unsupported(t, "i64", "I64, I32", err);
    }
}

int safetensors_tensor_to_i32(const safetensors_tensor *t, int32_t *dst, uint64_t n, ae_error *err) {
    if (check_n(t, n, err) != AE_OK) return AE_ERR;
    const uint8_t *p = t->data;
    switch (t->dtype) {
    case SAFETENSORS_I32:
        if (n > 0) memcpy(dst, p, n * sizeof(int32_t));
        return AE_OK;
    case SAFETENSORS_I64:
        for (uint64_t i = 0; i < n; i++) {
            int64_t v;
            memcpy(&v, p + 8 * i, sizeof v);
            if (v < INT32_MIN || v > INT32_MAX)
                return err_set(err,
                               "tensor \"%.200s\": element %llu = %lld does "
                               "not fit in i32",
                               t->name, (unsigned long long)i, (long long)v);
            dst[i] = (int32_t)v;
        }
        return AE_OK;
    default: return unsupported(t, "i32", "I32, I64", err);
    }
}

int safetensors_tensor_to_bool(const safetensors_tensor *t, bool *dst, uint64_t n, ae_error *err) {
    if (check_n(t, n, err) != AE_OK) return AE_ERR;
    if (t->dtype != SAFETENSORS_BOOL) return unsupported(t, "bool", "BOOL", err);
    const uint8_t *p = t->data;
    for (uint64_t i = 0; i < n; i++) {
        if (p[i] > 1)
            return err_set(err,
                           "tensor \"%.200s\": element %llu is byte %u, "
                           "not a bool",
                           t->name, (unsigned long long)i, p[i]);
        dst[i] = p[i] == 1;
    }
    return AE_OK;
}

/* ---- checkpoint directories ------------------------------------------- */

struct safetensors_model {
    safetensors_file **files; /* (n_files) in order of first use */
    size_t n_files;
    const safetensors_tensor **by_name; /* (n_tensors) across files, sorted by name */
    size_t n_tensors;
};

void safetensors_model_close(safetensors_model *m) {
    if (!m) return;
    for (size_t i = 0; i < m->n_files; i++) safetensors_close(m->files[i]);
    free(m->files);
    free(m->by_name);
    free(m);
}

static char *path_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + 1 + b + 1);
    if (!p) return NULL;
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    return p;
}

/* The shard file name of a file safetensors_model opened (its path is dir/name). */
static const char *file_base(const safetensors_file *f) {
    const char *slash = strrchr(safetensors_path(f), '/');
    return slash ? slash + 1 : safetensors_path(f);
}

static const safetensors_file *shard_by_name(const safetensors_model *m, const char *name) {
    for (size_t j = 0; j < m->n_files; j++)
        if (strcmp(file_base(m->files[j]), name) == 0) return m->files[j];
    return NULL;
}

static bool shard_name_ok(const char *s) {
    size_t len = strlen(s);
    return len > 0 && len <= SAFETENSORS_MAX_SHARD_NAME && !strchr(s, '/') && !strchr(s, '\\') && !strstr(s, "..");
}

static int add_file(safetensors_model *m, const char *dir, const char *name, ae_error *err) {
    char *path = path_join(dir, name);
    if (!path) return err_set(err, "%s: out of memory", dir);
    safetensors_file *f = NULL;
    int rc = safetensors_open(&f, path, err);
    free(path);
    if (rc != AE_OK) return AE_ERR;
    safetensors_file **grown = realloc(m->files, (m->n_files + 1) * sizeof *grown);
    if (!grown) {
        safetensors_close(f);
        return err_set(err, "%s: out of memory", dir);
    }
    m->files = grown;
    m->files[m->n_files++] = f;
    return AE_OK;
}

static int cmp_json_key(const void *a, const void *b) {
    const cJSON *const *x = a, *const *y = b;
    return strcmp((*x)->string, (*y)->string);
}

/* Opens the shards an index names and checks it against them. Errors about
 * the index are prefixed with `ipath`; safetensors_open names a bad shard itself. */
static int load_index(safetensors_model *m, const char *dir, const char *ipath, ae_error *err) {
    ae_error local = {{0}};
    size_t len = 0;
    const cJSON **keys = NULL;
    cJSON *root = NULL;
    char *text = NULL;
    file_read_all(ipath, SAFETENSORS_MAX_INDEX, &text, &len, NULL, err);
    if (!text) return AE_ERR;
    root = json_parse(text, len, &local);
    free(text);
    if (!cJSON_IsObject(root)) {
        if (root) err_set(&local, "not a JSON object");
        goto fail;
    }
    const cJSON *meta = cJSON_GetObjectItemCaseSensitive(root, "metadata");
    if (meta && !cJSON_IsObject(meta) && !cJSON_IsNull(meta)) {
        err_set(&local, "metadata is not an object");
        goto fail;
    }
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm) || !wm->child) {
        err_set(&local, "weight_map is missing, not an object, or empty");
        goto fail;
    }
    int n = cJSON_GetArraySize(wm);
    if (n <= 0 || (unsigned)n > SAFETENSORS_MAX_TENSORS) {
        err_set(&local, "weight_map has %d entries", n);
        goto fail;
    }
    keys = malloc((size_t)n * sizeof *keys);
    if (!keys) {
        err_set(&local, "out of memory");
        goto fail;
    }
    size_t nk = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, wm) {
        if (!cJSON_IsString(e)) {
            err_set(&local, "weight_map: \"%.200s\" is not a string", e->string);
            goto fail;
        }
        if (!shard_name_ok(e->valuestring)) {
            err_set(&local,
                    "weight_map: \"%.200s\": shard name \"%.200s\" is not "
                    "a plain file name",
                    e->string, e->valuestring);
            goto fail;
        }
        keys[nk++] = e;
        /* Shards are few; a linear scan keeps each opened once. */
        if (!shard_by_name(m, e->valuestring) && add_file(m, dir, e->valuestring, err) != AE_OK)
            goto fail; /* err names the shard; local stays empty */
    }
    qsort(keys, nk, sizeof *keys, cmp_json_key);
    for (size_t i = 1; i < nk; i++) {
        if (strcmp(keys[i - 1]->string, keys[i]->string) == 0) {
            err_set(&local, "weight_map: duplicate tensor \"%.200s\"", keys[i]->string);
            goto fail;
        }
    }
    for (size_t i = 0; i < nk; i++) {
        const safetensors_file *f = shard_by_name(m, keys[i]->valuestring);
        AE_ASSERT(f);
        if (!safetensors_find(f, keys[i]->string)) {
            err_set(&local,
                    "weight_map: tensor \"%.200s\" is not in shard "
                    "\"%.200s\"",
                    keys[i]->string, keys[i]->valuestring);
            goto fail;
        }
    }
    /* Every listed tensor exists and names are unique, so a count mismatch
     * means a shard holds tensors the index does not list. */
    size_t total = 0;
    for (size_t j = 0; j < m->n_files; j++) total += safetensors_count(m->files[j]);
    if (total != nk) {
        for (size_t j = 0; j < m->n_files; j++) {
            for (size_t i = 0; i < safetensors_count(m->files[j]); i++) {
                const safetensors_tensor *t = safetensors_tensor_at(m->files[j], i);
                const cJSON *v = cJSON_GetObjectItemCaseSensitive(wm, t->name);
                const char *shard = file_base(m->files[j]);
                if (!v || strcmp(v->valuestring, shard) != 0) {
                    err_set(&local,
                            "shard \"%.200s\" holds tensor \"%.200s\" that "
                            "weight_map does not list for it",
                            shard, t->name);
                    goto fail;
                }
            }
        }
        /* Unreachable by the argument above; kept as a plain error. */
        err_set(&local, "shards hold %zu tensors, weight_map lists %zu", total, nk);
        goto fail;
    }
    free(keys);
    cJSON_Delete(root);
    return AE_OK;
fail:
    if (err_is_set(&local)) err_set(err, "%s: %s", ipath, local.msg);
    free(keys);
    cJSON_Delete(root);
    return AE_ERR;
}

int safetensors_model_open(safetensors_model **out, const char *dir, ae_error *err) {
    *out = NULL;
    char *ipath = NULL;
    safetensors_model *m = calloc(1, sizeof *m);
    if (!m) {
        err_set(err, "%s: out of memory", dir);
        goto fail;
    }
    ipath = path_join(dir, "model.safetensors.index.json");
    if (!ipath) {
        err_set(err, "%s: out of memory", dir);
        goto fail;
    }
    struct stat sb;
    if (stat(ipath, &sb) == 0) {
        if (load_index(m, dir, ipath, err) != AE_OK) goto fail;
    } else {
        char *single = path_join(dir, "model.safetensors");
        if (!single) {
            err_set(err, "%s: out of memory", dir);
            goto fail;
        }
        bool exists = stat(single, &sb) == 0;
        free(single);
        if (!exists) {
            err_set(err,
                    "%s: no model.safetensors or "
                    "model.safetensors.index.json",
                    dir);
            goto fail;
        }
        if (add_file(m, dir, "model.safetensors", err) != AE_OK) goto fail;
    }

    for (size_t j = 0; j < m->n_files; j++) m->n_tensors += safetensors_count(m->files[j]);
    if (m->n_tensors > 0) {
        m->by_name = malloc(m->n_tensors * sizeof *m->by_name);
        if (!m->by_name) {
            err_set(err, "%s: out of memory", dir);
            goto fail;
        }
    }
    size_t k = 0;
    for (size_t j = 0; j < m->n_files; j++)
        for (size_t i = 0; i < safetensors_count(m->files[j]); i++)
            m->by_name[k++] = safetensors_tensor_at(m->files[j], i);
    if (m->n_tensors > 0) qsort(m->by_name, m->n_tensors, sizeof *m->by_name, cmp_tensor_name);
    for (size_t i = 1; i < m->n_tensors; i++) {
        if (strcmp(m->by_name[i - 1]->name, m->by_name[i]->name) == 0) {
            err_set(err, "%s: tensor \"%.200s\" is in more than one shard", dir, m->by_name[i]->name);
            goto fail;
        }
    }
    free(ipath);
    *out = m;
    return AE_OK;
fail:
    free(ipath);
    safetensors_model_close(m);
    return AE_ERR;
}

size_t safetensors_model_n_files(const safetensors_model *m) { return m->n_files; }

const safetensors_file *safetensors_model_file(const safetensors_model *m, size_t i) {
    AE_ASSERT(i < m->n_files);
    return m->files[i];
}

size_t safetensors_model_count(const safetensors_model *m) { return m->n_tensors; }

const safetensors_tensor *safetensors_model_tensor_at(const safetensors_model *m, size_t i) {
    AE_ASSERT(i < m->n_tensors);
    return m->by_name[i];
}

const safetensors_tensor *safetensors_model_find(const safetensors_model *m, const char *name) {
    return find_in(m->by_name, m->n_tensors, name);
}
