/* A model's tensors as the kernels read them, from a GGUF file or a Hugging
 * Face directory (safetensors), by name and checked shape. What every
 * architecture's loader (target/) and the draft's view of its target
 * (embedding.h) share; which tensors a model has is theirs to say.
 *
 * Matrices stay in their file type where kn_matmul has a native kernel
 * (F32, F16, BF16, Q8_0, Q4_0, Q4_1 from GGUF): on a host-memory backend
 * they point into the mapped file, as do safetensors BF16 matrices (the
 * type real checkpoints ship) where 2-byte aligned. Anything else, and
 * every other safetensors tensor (which may be unaligned), is converted
 * to f32 once, into memory the weights own. Vectors (norms, biases) are
 * f32. */
#ifndef AERIE_MODEL_WEIGHTS_H
#define AERIE_MODEL_WEIGHTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../../kernels/kernels.h"
#include "../core/err.h"
#include "gguf.h"
#include "safetensors.h"

/* A buffer the weights hand out, and the host memory behind it that they
 * wrote and keep (a conversion or a packed copy on a host-memory backend;
 * NULL for the mapped file's bytes, and on any other backend, where the
 * buffer is a copy and the host memory was freed). */
typedef struct weights_buf {
    kn_buf buf;
    void *host;
} weights_buf;

typedef struct weights_store {
    gguf_file *gguf; /* exactly one of gguf and st is set */
    safetensors_model *st;
    const kn_backend *be;   /* whose memory the tensors are given in */
    size_t bytes;           /* bytes of weights as used (mapped + converted) */
    size_t converted_bytes; /* of which converted to f32 at load */
    weights_buf **bufs;     /* one per tensor handed out, and per converted or packed copy */
    size_t n_bufs, cap_bufs;
} weights_store;

/* path: a .gguf file or a Hugging Face model directory (its safetensors;
 * config.json is the caller's). Errors name the path.
 *
 * Every matrix, table and vector is handed out in a buffer of be
 * (kn_weight.buf): on a host-memory backend (the CPU) a mapped tensor is
 * the file's own bytes and nothing is copied; on any other each tensor is
 * copied into the backend's memory as it is asked for. */
int weights_open(weights_store **out, const char *path, const kn_backend *be, ae_error *err);
void weights_close(weights_store *w); /* NULL is a no-op */

bool weights_has(const weights_store *w, const char *name);

/* The matrix `name` of [rows][cols], for kn_matmul. */
int weights_matrix(weights_store *w, const char *name, int64_t rows, int64_t cols, kn_weight *out, ae_error *err);

/* A GGUF 3-D tensor [n][rows][cols] (ne = {cols, rows, n}) as one matrix
 * of [n x rows][cols]: llama.cpp's stacked experts. In the file's type
 * where kn_matmul has a kernel, else converted to f32. */
int weights_matrix_3d(weights_store *w, const char *name, int64_t n, int64_t rows, int64_t cols, kn_weight *out,
                      ae_error *err);

/* An embedding table of [rows][cols]: kn_embed reads any GGUF type, so a
 * GGUF table stays as the file has it (and, read a row at a time, is not
 * counted in bytes); a safetensors one is converted like a matrix. */
int weights_table(weights_store *w, const char *name, int64_t rows, int64_t cols, kn_weight *out, ae_error *err);

/* The vector `name` of n floats; a missing optional one is NULL. */
int weights_vector(weights_store *w, const char *name, int64_t n, bool optional, const float **out, ae_error *err);

/* Gives a quantized matrix the CPU kernels' SIMD layout (kn_weight_pack)
 * in a buffer the weights own, and drops the file pages that packing
 * read: the resident weights are then the packed copy (the same size),
 * not twice it. A matrix with no packed layout, on a backend whose
 * memory is not the host's (the layout is the CPU kernels'), or whose
 * bytes the weights wrote themselves (weights_int4_matrix,
 * weights_pick_rows: those cannot be dropped) is left as it is. */
int weights_pack(weights_store *w, kn_weight *m, ae_error *err);

/* A matrix of f32 the caller computes from other tensors (MLA's per-head
 * matrices): fill writes [rows][cols] into dst. Counted as converted. */
typedef void (*weights_fill_fn)(void *ctx, float *dst);
int weights_f32(weights_store *w, int64_t rows, int64_t cols, weights_fill_fn fill, void *ctx, kn_weight *out,
                ae_error *err);

/* Row rows[i] of src as row i of a new matrix of src's type (its bytes
 * copied): heads' rows regrouped. src must be host memory. */
int weights_pick_rows(weights_store *w, const kn_weight *src, int64_t n, const int64_t *rows, kn_weight *out,
                      ae_error *err);

/* Row i of m, as f32 (any type quant_dequantize reads; host memory). */
void weights_row_f32(const kn_weight *m, int64_t i, float *dst);

/* compressed-tensors' int4 (pack-quantized, symmetric, groups of 32), as
 * Kimi-K2.5 ships its experts: {prefix}.weight_packed int32
 * [rows][cols / 8] (value j of a word at bits 4 (j % 8), stored as q + 8)
 * and {prefix}.weight_scale [rows][cols / 32] (f32, f16 or bf16), with
 * {prefix}.weight_shape [2] when present. Each group of 32 is Q4_0's
 * block exactly (scale * (nibble - 8)) when its scale is an f16 without
 * rounding, as bf16 scales of real weights are; otherwise the matrix is
 * converted to f32. Whether prefix names such a matrix: */
bool weights_has_int4(const weights_store *w, const char *prefix);
int weights_int4_matrix(weights_store *w, const char *prefix, int64_t rows, int64_t cols, kn_weight *out,
                        ae_error *err);

#endif
