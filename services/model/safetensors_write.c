#include "safetensors_write.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "../core/file.h"

/* The header JSON, or NULL (out of memory, or a bad tensor in err). */
static char *header_json(const safetensors_out *t, size_t n, const char *const *meta, size_t n_meta,
                         uint64_t *data_bytes, ae_error *err) {
    cJSON *root = cJSON_CreateObject();
    if (!root) return err_set(err, "out of memory"), NULL;
    if (n_meta > 0) {
        cJSON *m = cJSON_AddObjectToObject(root, "__metadata__");
        for (size_t i = 0; m && i < n_meta; i++) cJSON_AddStringToObject(m, meta[2 * i], meta[2 * i + 1]);
    }
    uint64_t off = 0;
    for (size_t i = 0; i < n; i++) {
        if (t[i].n_dims > SAFETENSORS_MAX_DIMS || (unsigned)t[i].dtype >= SAFETENSORS_DTYPE_COUNT) {
            cJSON_Delete(root);
            return err_set(err, "tensor %s: bad dtype or rank", t[i].name), NULL;
        }
        uint64_t elems = 1;
        double shape[SAFETENSORS_MAX_DIMS];
        for (uint32_t d = 0; d < t[i].n_dims; d++) {
            elems *= t[i].shape[d];
            shape[d] = (double)t[i].shape[d];
        }
        uint64_t bytes = elems * safetensors_dtype_size(t[i].dtype);
        double offsets[2] = {(double)off, (double)(off + bytes)};
        cJSON *e = cJSON_AddObjectToObject(root, t[i].name);
        if (e) {
            cJSON_AddStringToObject(e, "dtype", safetensors_dtype_name(t[i].dtype));
            cJSON_AddItemToObject(e, "shape", cJSON_CreateDoubleArray(shape, (int)t[i].n_dims));
            cJSON_AddItemToObject(e, "data_offsets", cJSON_CreateDoubleArray(offsets, 2));
        }
        off += bytes;
    }
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!s) err_set(err, "out of memory");
    *data_bytes = off;
    return s;
}

int safetensors_write(const char *path, const safetensors_out *t, size_t n, const char *const *meta, size_t n_meta,
                      ae_error *err) {
    uint64_t data_bytes;
    char *json = header_json(t, n, meta, n_meta, &data_bytes, err);
    if (!json) return AE_ERR;
    size_t jl = strlen(json), padded = (jl + 7) & ~(size_t)7;
    char *tmp = malloc(strlen(path) + 5);
    if (!tmp) {
        free(json);
        return err_set(err, "out of memory");
    }
    sprintf(tmp, "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int rc = AE_OK;
    if (fd < 0) {
        rc = err_set(err, "%s: %s", tmp, strerror(errno));
        goto out;
    }
    uint8_t len_le[8];
    for (int i = 0; i < 8; i++) len_le[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    static const char spaces[8] = "        ";
    bool ok = file_write_full(fd, len_le, 8) == 0 && file_write_full(fd, json, jl) == 0 &&
              file_write_full(fd, spaces, padded - jl) == 0;
    for (size_t i = 0; ok && i < n; i++) {
        uint64_t bytes = safetensors_dtype_size(t[i].dtype);
        for (uint32_t d = 0; d < t[i].n_dims; d++) bytes *= t[i].shape[d];
        if (bytes) ok = file_write_full(fd, t[i].data, (size_t)bytes) == 0;
    }
    if (ok) ok = fsync(fd) == 0;
    if (close(fd) != 0) ok = false;
    if (!ok || rename(tmp, path) != 0) {
        rc = err_set(err, "%s: %s", path, strerror(errno ? errno : EIO));
        unlink(tmp);
    }
out:
    free(tmp);
    free(json);
    return rc;
}
