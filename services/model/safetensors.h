/* Hugging Face safetensors files and checkpoint directories.
 *
 * File layout: u64 little-endian header length N, N bytes of UTF-8 JSON
 * (writers pad it with spaces), then the data section. The JSON maps each
 * tensor name to {"dtype", "shape", "data_offsets": [begin, end]} with
 * offsets relative to the data section, plus an optional "__metadata__"
 * object of string -> string.
 *
 * safetensors_open maps the file read-only and validates everything before it
 * returns, as a parser of hostile input: header length, JSON, every entry's
 * keys and types, shape rank and overflow, byte size == elements * dtype
 * size, and that the tensors tile the data section exactly (sorted by begin:
 * no gap, no overlap, nothing left over). After a successful open every
 * accessor is a read of validated data.
 *
 * Tensor data lives in the mapping and may be unaligned (offsets are byte
 * granular), so read it through the safetensors_tensor_to_* converters or memcpy.
 * The host must be little-endian, as the file is. */
#ifndef AERIE_MODEL_SAFETENSORS_H
#define AERIE_MODEL_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/err.h"

/* Element types a file may name. All are accepted when reading a file (so
 * tools can list any checkpoint); conversion is supported only for:
 *   F32, F16, BF16 -> float   (safetensors_tensor_to_f32)
 *   I64, I32       -> int64_t (safetensors_tensor_to_i64), int32_t (safetensors_tensor_to_i32)
 *   BOOL           -> bool    (safetensors_tensor_to_bool)
 * Any other name (F8_E4M3, complex, ...) fails the open. */
typedef enum safetensors_dtype {
    SAFETENSORS_BOOL = 0,
    SAFETENSORS_U8,
    SAFETENSORS_I8,
    SAFETENSORS_U16,
    SAFETENSORS_I16,
    SAFETENSORS_F16,
    SAFETENSORS_BF16,
    SAFETENSORS_U32,
    SAFETENSORS_I32,
    SAFETENSORS_F32,
    SAFETENSORS_U64,
    SAFETENSORS_I64,
    SAFETENSORS_F64,
    SAFETENSORS_DTYPE_COUNT
} safetensors_dtype;

/* Limits against absurd counts in corrupt or hostile files. */
#define SAFETENSORS_MAX_HEADER (100u * 1024u * 1024u) /* bytes of JSON */
#define SAFETENSORS_MAX_DIMS 8u                       /* shape rank */
#define SAFETENSORS_MAX_NAME 1024u                    /* bytes in a tensor name */
#define SAFETENSORS_MAX_TENSORS (1u << 20)            /* tensors in one file */

const char *safetensors_dtype_name(safetensors_dtype d); /* "BF16" */
size_t safetensors_dtype_size(safetensors_dtype d);      /* bytes per element */

/* One tensor of an open file. Plain data owned by the file: valid until
 * safetensors_close of the file (or safetensors_model_close of its model). */
typedef struct safetensors_tensor {
    const char *name; /* NUL-terminated, UTF-8, non-empty */
    safetensors_dtype dtype;
    uint32_t n_dims;                      /* 0..SAFETENSORS_MAX_DIMS; 0 = scalar */
    uint64_t shape[SAFETENSORS_MAX_DIMS]; /* row-major, outermost first as in the
                                    file (PyTorch order); unused dims = 1 */
    uint64_t n_elements;                  /* product of shape (1 for a scalar) */
    uint64_t n_bytes;                     /* n_elements * safetensors_dtype_size(dtype) */
    uint64_t offset;                      /* begin, relative to the data section */
    const void *data;                     /* into the mapping; maybe unaligned */
} safetensors_tensor;

typedef struct safetensors_file safetensors_file;

/* Opens and validates `path`. On failure returns AE_ERR and err says
 * "<path>: <problem>". */
int safetensors_open(safetensors_file **out, const char *path, ae_error *err);

/* Same checks over a caller-owned buffer that must outlive the handle (the
 * fuzzer and tests use it). `name` is used in error text. */
int safetensors_open_mem(safetensors_file **out, const void *data, size_t size, const char *name, ae_error *err);

void safetensors_close(safetensors_file *f); /* NULL is a no-op */

const char *safetensors_path(const safetensors_file *f);
size_t safetensors_count(const safetensors_file *f);
/* Tensors in file order (sorted by data offset). i < safetensors_count(f). */
const safetensors_tensor *safetensors_tensor_at(const safetensors_file *f, size_t i);
/* NULL when no tensor has that name. O(log n). */
const safetensors_tensor *safetensors_find(const safetensors_file *f, const char *name);

/* "__metadata__" pairs, sorted by key. */
size_t safetensors_metadata_count(const safetensors_file *f);
void safetensors_metadata_at(const safetensors_file *f, size_t i, const char **key, const char **value);
const char *safetensors_metadata_get(const safetensors_file *f, const char *key); /* or NULL */

/* Converters read the first n elements of t (n <= t->n_elements) into dst,
 * whose storage need not be aligned like the file's. They fail, naming the
 * tensor, for an unsupported dtype or a too-large n. */

/* F32, F16, BF16; exact (every f16/bf16 value is a float). */
int safetensors_tensor_to_f32(const safetensors_tensor *t, float *dst, uint64_t n, ae_error *err);
/* I64, or I32 widened. */
int safetensors_tensor_to_i64(const safetensors_tensor *t, int64_t *dst, uint64_t n, ae_error *err);
/* I32, or I64 when every value fits in int32 (e.g. EAGLE's d2t). */
int safetensors_tensor_to_i32(const safetensors_tensor *t, int32_t *dst, uint64_t n, ae_error *err);
/* BOOL; a byte other than 0 or 1 is an error. */
int safetensors_tensor_to_bool(const safetensors_tensor *t, bool *dst, uint64_t n, ae_error *err);

/* A Hugging Face checkpoint directory: either `model.safetensors`, or the
 * shards named by `model.safetensors.index.json`
 * ({"metadata": {...}, "weight_map": {tensor: shard_file}}), which wins when
 * both exist. Every shard is opened once. The index must agree with the
 * shards exactly: each weight_map entry exists in its shard, each shard
 * tensor is listed for that shard, and no name appears twice. Shard names
 * are plain file names (no '/', no ".."). */
typedef struct safetensors_model safetensors_model;

int safetensors_model_open(safetensors_model **out, const char *dir, ae_error *err);
void safetensors_model_close(safetensors_model *m); /* NULL is a no-op */

size_t safetensors_model_n_files(const safetensors_model *m);
const safetensors_file *safetensors_model_file(const safetensors_model *m, size_t i); /* index order */
/* All tensors across shards, sorted by name. */
size_t safetensors_model_count(const safetensors_model *m);
const safetensors_tensor *safetensors_model_tensor_at(const safetensors_model *m, size_t i);
/* NULL when absent. O(log n). */
const safetensors_tensor *safetensors_model_find(const safetensors_model *m, const char *name);

#endif
