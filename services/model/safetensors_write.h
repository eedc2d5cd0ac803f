/* Writing safetensors files (the layout is described in safetensors.h).
 *
 * The file appears whole or not at all: it is written to "<path>.tmp",
 * flushed to disk, and renamed over path. A reader (or a run resumed after
 * a crash) therefore never sees half a file. The header is padded with
 * spaces to a multiple of 8 bytes, so data offsets stay aligned. */
#ifndef AERIE_MODEL_SAFETENSORS_WRITE_H
#define AERIE_MODEL_SAFETENSORS_WRITE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/err.h"
#include "safetensors.h"

typedef struct safetensors_out {
    const char *name;
    safetensors_dtype dtype;
    uint32_t n_dims; /* 0..SAFETENSORS_MAX_DIMS */
    uint64_t shape[SAFETENSORS_MAX_DIMS];
    const void *data; /* product(shape) * safetensors_dtype_size(dtype) bytes; may be NULL when that is 0 */
} safetensors_out;

/* Writes tensors t[0..n) in that order, and the metadata pairs
 * meta[0], meta[1], ... (key, value; n_meta pairs) as "__metadata__". */
int safetensors_write(const char *path, const safetensors_out *t, size_t n, const char *const *meta, size_t n_meta,
                      ae_error *err);

#endif
