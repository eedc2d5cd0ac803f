/* libFuzzer target: safetensors_open_mem over arbitrary bytes must either fail with
 * an error text or yield tensors whose every field holds up, and reading
 * them must stay inside the input. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "../../services/core/err.h"
#include "../../services/model/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Converts at most this many elements per tensor: enough to touch the
 * first bytes of each, cheap enough to keep the fuzzer fast. */
#define FIRST 16

static void touch(const safetensors_tensor *t, const uint8_t *data, size_t size) {
    const uint8_t *p = t->data;
    AE_ASSERT(p >= data && t->n_bytes <= size && (size_t)(p - data) <= size - t->n_bytes);
    AE_ASSERT(t->n_dims <= SAFETENSORS_MAX_DIMS);
    uint64_t n_el = 1;
    for (uint32_t d = 0; d < t->n_dims; d++) n_el *= t->shape[d];
    AE_ASSERT(n_el == t->n_elements);
    AE_ASSERT(t->n_bytes == t->n_elements * safetensors_dtype_size(t->dtype));

    uint64_t n = t->n_elements < FIRST ? t->n_elements : FIRST;
    float f[FIRST];
    int64_t i64[FIRST];
    int32_t i32[FIRST];
    bool b[FIRST];
    ae_error err = {0};
    /* Each converter either works or explains why; both are fine here. */
    if (safetensors_tensor_to_f32(t, f, n, &err) != AE_OK) AE_ASSERT(err.msg[0]);
    err_clear(&err);
    if (safetensors_tensor_to_i64(t, i64, n, &err) != AE_OK) AE_ASSERT(err.msg[0]);
    err_clear(&err);
    if (safetensors_tensor_to_i32(t, i32, n, &err) != AE_OK) AE_ASSERT(err.msg[0]);
    err_clear(&err);
    if (safetensors_tensor_to_bool(t, b, n, &err) != AE_OK) AE_ASSERT(err.msg[0]);
    /* Asking for more than the tensor holds is always refused. */
    AE_ASSERT(safetensors_tensor_to_f32(t, NULL, t->n_elements + 1, NULL) == AE_ERR);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    safetensors_file *f = NULL;
    ae_error err = {0};
    if (safetensors_open_mem(&f, data, size, "fuzz", &err) != AE_OK) {
        AE_ASSERT(f == NULL);
        AE_ASSERT(strncmp(err.msg, "fuzz: ", 6) == 0);
        return 0;
    }
    uint64_t covered = 0;
    for (size_t i = 0; i < safetensors_count(f); i++) {
        const safetensors_tensor *t = safetensors_tensor_at(f, i);
        AE_ASSERT(safetensors_find(f, t->name) == t);
        AE_ASSERT(t->offset == covered); /* tiled in offset order */
        covered += t->n_bytes;
        touch(t, data, size);
    }
    for (size_t i = 0; i < safetensors_metadata_count(f); i++) {
        const char *k, *v;
        safetensors_metadata_at(f, i, &k, &v);
        AE_ASSERT(safetensors_metadata_get(f, k) == v);
    }
    safetensors_close(f);
    return 0;
}
