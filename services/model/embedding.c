#include "embedding.h"

#include <stdio.h>
#include <string.h>

#include "hfconfig.h"

/* The GGUF shape: {general.architecture}.block_count and
 * .embedding_length, and the vocabulary as the table's rows. */
static int shape_gguf(embedding *e, const gguf_file *f, ae_error *err) {
    gguf_str s;
    if (gguf_get_str(f, "general.architecture", &s, err) != AE_OK) return AE_ERR;
    const char *sfx[2] = {"block_count", "embedding_length"};
    int32_t *out[2] = {&e->n_layers, &e->hidden};
    for (int i = 0; i < 2; i++) {
        char key[192];
        int64_t v;
        snprintf(key, sizeof key, "%.*s.%s", (int)(s.len < 128 ? s.len : 128), s.ptr, sfx[i]);
        if (gguf_get_i64(f, key, &v, NULL) != AE_OK || v <= 0 || v > INT32_MAX)
            return err_set(err, "key %s: missing or not a positive integer", key);
        *out[i] = (int32_t)v;
    }
    const gguf_tensor *t = gguf_find_tensor(f, "token_embd.weight");
    if (!t || t->n_dims != 2) return err_set(err, "tensor token_embd.weight is missing or not 2-D");
    if (t->ne[1] > INT32_MAX) return err_set(err, "vocabulary too large");
    e->vocab = (int32_t)t->ne[1];
    return AE_OK;
}

int embedding_open(embedding *e, const char *path, const kn_backend *be, ae_error *err) {
    memset(e, 0, sizeof *e);
    const char *name = "token_embd.weight";
    if (weights_open(&e->w, path, be, err) != AE_OK) return AE_ERR;
    int rc;
    if (e->w->gguf) {
        rc = shape_gguf(e, e->w->gguf, err);
    } else {
        char cfg_path[4096];
        hfconfig hc;
        snprintf(cfg_path, sizeof cfg_path, "%s/config.json", path);
        rc = hfconfig_load(&hc, cfg_path, err);
        if (rc == AE_OK) *e = (embedding){hc.num_hidden_layers, hc.hidden_size, hc.vocab_size, {0}, 0, e->w};
        name = "model.embed_tokens.weight";
    }
    if (rc == AE_OK) rc = weights_table(e->w, name, e->vocab, e->hidden, &e->table, err);
    if (rc != AE_OK) {
        if (!strstr(err ? err->msg : "", path)) err_prefix(err, "%s: ", path);
        embedding_close(e);
        return AE_ERR;
    }
    e->bytes = e->table.row_bytes * (size_t)e->table.rows;
    return AE_OK;
}

embedding_view embedding_of(const embedding *e) {
    return (embedding_view){e->hidden, e->vocab, e->n_layers, &e->table};
}

void embedding_close(embedding *e) {
    weights_close(e->w);
    memset(e, 0, sizeof *e);
}
