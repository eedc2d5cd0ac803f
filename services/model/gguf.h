/* GGUF model files (llama.cpp's format), versions 2 and 3.
 *
 * gguf_open maps the file read-only and validates everything before it
 * returns: header, every key/value, every tensor info, alignment, and that
 * each tensor's bytes lie inside the file. After a successful open, every
 * accessor below is a bounds-checked read of already-validated data.
 *
 * Strings (keys, string values, array elements) point into the mapping and
 * are NOT NUL-terminated: use gguf_str's len. Tensor names are copied and
 * NUL-terminated. */
#ifndef AERIE_MODEL_GGUF_H
#define AERIE_MODEL_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/err.h"
#include "quant.h"

/* Metadata value types, numbered as in the file. */
typedef enum gguf_vtype {
    GGUF_VT_U8 = 0,
    GGUF_VT_I8 = 1,
    GGUF_VT_U16 = 2,
    GGUF_VT_I16 = 3,
    GGUF_VT_U32 = 4,
    GGUF_VT_I32 = 5,
    GGUF_VT_F32 = 6,
    GGUF_VT_BOOL = 7,
    GGUF_VT_STRING = 8,
    GGUF_VT_ARRAY = 9,
    GGUF_VT_U64 = 10,
    GGUF_VT_I64 = 11,
    GGUF_VT_F64 = 12,
    GGUF_VT_COUNT
} gguf_vtype;

typedef struct gguf_str {
    const char *ptr; /* into the mapping; not NUL-terminated */
    uint64_t len;
} gguf_str;

typedef struct gguf_tensor {
    char *name;      /* NUL-terminated copy */
    uint32_t n_dims; /* 1..4 */
    uint64_t ne[4];  /* elements per dim, innermost first; unused dims = 1 */
    ggml_type type;
    uint64_t offset;     /* relative to the data section */
    uint64_t n_elements; /* product of ne */
    uint64_t n_bytes;    /* size of the data in the file */
    const void *data;    /* into the mapping */
} gguf_tensor;

typedef struct gguf_file gguf_file;

/* Limits against absurd counts in corrupt or hostile files. */
#define GGUF_MAX_KV 65536u
#define GGUF_MAX_TENSORS 65536u
#define GGUF_MAX_ARRAY (1ull << 26)  /* elements in one metadata array */
#define GGUF_MAX_STRING (1ull << 26) /* bytes in one string */
#define GGUF_MAX_NAME 256u           /* bytes in a key or tensor name */

/* Opens and validates `path`. On failure returns AE_ERR and err says
 * "<path>: <problem>". */
int gguf_open(gguf_file **out, const char *path, ae_error *err);

/* Same checks over a caller-owned buffer that must outlive the handle
 * (used by the fuzzer and by tests). `name` is used in error text. */
int gguf_open_mem(gguf_file **out, const void *data, size_t size, const char *name, ae_error *err);

void gguf_close(gguf_file *f); /* NULL is a no-op */

uint32_t gguf_version(const gguf_file *f);
uint32_t gguf_alignment(const gguf_file *f);
const char *gguf_path(const gguf_file *f);
uint64_t gguf_file_size(const gguf_file *f);
/* File offset of the data section (tensor offsets are relative to it). */
uint64_t gguf_data_offset(const gguf_file *f);

/* True when s holds exactly the NUL-terminated c. */
bool gguf_str_eq(gguf_str s, const char *c);

/* Key/value pairs, by index 0..gguf_n_kv()-1 (an index out of range is a
 * caller bug and hits AE_ASSERT). */
uint64_t gguf_n_kv(const gguf_file *f);
gguf_str gguf_kv_key(const gguf_file *f, uint64_t i);
gguf_vtype gguf_kv_type(const gguf_file *f, uint64_t i);
int64_t gguf_find_key(const gguf_file *f, const char *key); /* -1: absent */

/* Arrays: element type and count (ARRAY keys only; nested arrays allowed,
 * their elements are not readable through the typed getters). For a
 * non-array key these return GGUF_VT_COUNT and 0. */
gguf_vtype gguf_arr_type(const gguf_file *f, uint64_t i);
uint64_t gguf_arr_len(const gguf_file *f, uint64_t i);

/* Typed getters by key. Integers convert between integer types when the
 * value fits; anything else (absent, wrong type, out of range) returns
 * AE_ERR with "key <name>: ..." in err. */
int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out, ae_error *err);
int gguf_get_u64(const gguf_file *f, const char *key, uint64_t *out, ae_error *err);
int gguf_get_i64(const gguf_file *f, const char *key, int64_t *out, ae_error *err);
int gguf_get_f32(const gguf_file *f, const char *key, float *out, ae_error *err);
int gguf_get_f64(const gguf_file *f, const char *key, double *out, ae_error *err);
int gguf_get_bool(const gguf_file *f, const char *key, bool *out, ae_error *err);
int gguf_get_str(const gguf_file *f, const char *key, gguf_str *out, ae_error *err);

/* Array elements by key index and element index. Return AE_ERR when the
 * element type does not match or j is out of range. gguf_arr_i64 accepts
 * any integer element type; gguf_arr_f64 accepts f32/f64. */
int gguf_arr_str(const gguf_file *f, uint64_t i, uint64_t j, gguf_str *out);
int gguf_arr_i64(const gguf_file *f, uint64_t i, uint64_t j, int64_t *out);
int gguf_arr_f64(const gguf_file *f, uint64_t i, uint64_t j, double *out);

/* Any scalar (or a short array) rendered as text, for `aerie info`.
 * Writes at most n bytes including the NUL; long arrays are summarised. */
void gguf_kv_format(const gguf_file *f, uint64_t i, char *buf, size_t n);

/* Tensors. */
uint64_t gguf_n_tensors(const gguf_file *f);
const gguf_tensor *gguf_tensor_at(const gguf_file *f, uint64_t i); /* NULL: out of range */
const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name);

const char *gguf_vtype_name(gguf_vtype t);

#endif
