#include "model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "arch.h"

void model_free(model *m) {
    if (!m) return;
    for (int32_t i = 0; m->layers && i < m->cfg.n_layers; i++) free(m->layers[i].experts);
    free(m->layers);
    weights_close(m->w);
    free(m);
}

static int check_config(const model_config *c, ae_error *err) {
    if (c->n_layers <= 0 || c->n_layers > MODEL_MAX_LAYERS)
        return err_set(err, "n_layers %d is outside 1..%d", c->n_layers, MODEL_MAX_LAYERS);
    if (c->hidden <= 0 || c->ffn <= 0 || c->n_heads <= 0 || c->n_kv_heads <= 0 || c->vocab <= 0)
        return err_set(err, "a dimension is not positive (hidden %d, ffn %d, heads %d, kv heads %d, vocab %d)",
                       c->hidden, c->ffn, c->n_heads, c->n_kv_heads, c->vocab);
    if (c->n_heads % c->n_kv_heads)
        return err_set(err, "kv heads %d do not divide heads %d", c->n_kv_heads, c->n_heads);
    int32_t most = c->kv_lora_rank > 0 ? KN_MAX_ATTN_DIM : KN_MAX_HEAD_DIM; /* MLA: the latent's width */
    if (c->head_dim <= 0 || c->head_dim % 8 || c->head_dim > most)
        return err_set(err, "head_dim %d must be a multiple of 8 and at most %d", c->head_dim, most);
    return AE_OK;
}

int model_config_gguf(model_config *c, const struct arch **a, const gguf_file *f, ae_error *err) {
    memset(c, 0, sizeof *c);
    gguf_str s;
    if (gguf_get_str(f, "general.architecture", &s, err) != AE_OK) return AE_ERR;
    if (s.len >= sizeof c->arch) return err_set(err, "general.architecture is too long");
    memcpy(c->arch, s.ptr, s.len);
    c->arch[s.len] = '\0';
    if (!(*a = arch_for_gguf(c->arch, err)) || (*a)->config_gguf(c, f, err) != AE_OK) return AE_ERR;
    return check_config(c, err);
}

/* The GGUF file's architecture, its hyperparameters and tensors. */
static int load_gguf(model *m, const char *path, ae_error *err) {
    if (weights_open(&m->w, path, m->be, err) != AE_OK ||
        model_config_gguf(&m->cfg, &m->arch, m->w->gguf, err) != AE_OK)
        return AE_ERR;
    return m->arch->load(m, err);
}

int model_config_read(model_config *c, const struct arch **a, hfconfig *hc, const char *path, ae_error *err) {
    memset(c, 0, sizeof *c);
    if (hfconfig_load(hc, path, err) != AE_OK) return AE_ERR;
    snprintf(c->arch, sizeof c->arch, "%s", hc->model_type);
    if (!(*a = arch_for_hf(c->arch, err))) return err_prefix(err, "%s: ", path), AE_ERR;
    if ((*a)->config_hf(c, hc, path, err) != AE_OK) return AE_ERR;
    return check_config(c, err);
}

/* The Hugging Face directory's config.json, then its tensors. */
static int load_hf(model *m, const char *dir, ae_error *err) {
    char path[1200];
    hfconfig hc;
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (model_config_read(&m->cfg, &m->arch, &hc, path, err) != AE_OK || weights_open(&m->w, dir, m->be, err) != AE_OK)
        return AE_ERR;
    return m->arch->load(m, err);
}

int model_load(model **out, const char *path, const kn_backend *be, ae_error *err) {
    *out = NULL;
    model *m = calloc(1, sizeof *m);
    if (!m) return err_set(err, "out of memory");
    m->be = be;
    snprintf(m->path, sizeof m->path, "%s", path);
    struct stat sb;
    int rc;
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        rc = load_hf(m, path, err);
    } else {
        rc = load_gguf(m, path, err);
        if (rc != AE_OK && m->w && !strstr(err ? err->msg : "", path)) err_prefix(err, "%s: ", path);
    }
    if (rc == AE_OK) {
        m->weight_bytes = m->w->bytes;
        m->converted_bytes = m->w->converted_bytes;
        rc = kn_rope_init(&m->rope, &m->cfg.rope, err);
        if (rc != AE_OK) err_prefix(err, "%s: ", path);
    }
    if (rc != AE_OK) {
        model_free(m);
        return AE_ERR;
    }
    *out = m;
    return AE_OK;
}

size_t model_decode_bytes(const model *m) { return arch_decode_bytes(m); }

static void count(uint64_t *bytes, const kn_weight *w) {
    if (w->data && w->rows > 0) bytes[w->type] += (uint64_t)w->rows * quant_row_bytes(w->type, (uint64_t)w->cols);
}

void model_bytes_by_type(const model *m, uint64_t *bytes, uint64_t *experts) {
    memset(bytes, 0, GGML_TYPE_COUNT_MAX * sizeof *bytes);
    *experts = 0;
    count(bytes, &m->tok_embd);
    if (m->output.data != m->tok_embd.data) count(bytes, &m->output);
    for (int32_t i = 0; i < m->cfg.n_layers; i++) {
        const model_layer *l = &m->layers[i];
        for (size_t k = 0; k < m->arch->n_tensors; k++) {
            const arch_tensor *t = &m->arch->tensors[k];
            if (!arch_layer_has(&m->cfg, l, t)) continue;
            if (t->held == ARCH_MAT) count(bytes, arch_field_const(l, t));
            for (int32_t e = 0; t->held == ARCH_EXPERT && l->experts && e < m->cfg.route.n_experts; e++) {
                const kn_weight *x = &l->experts[(int64_t)t->at * m->cfg.route.n_experts + e];
                count(bytes, x);
                *experts += (uint64_t)x->rows * quant_row_bytes(x->type, (uint64_t)x->cols);
            }
        }
    }
}

embedding_view model_embedding(const model *m) {
    return (embedding_view){m->cfg.hidden, m->cfg.vocab, m->cfg.n_layers, &m->tok_embd};
}
