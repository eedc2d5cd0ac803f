#include "arch.h"

#include <stdio.h>
#include <string.h>

/* Every architecture this build reads. */
static const arch *const all[] = {&arch_llama, &arch_deepseek};
#define N_ARCH (sizeof all / sizeof all[0])

/* Whether list (NULL-terminated) holds name; with names, appends the list
 * to names, comma-separated. */
static bool listed(const char *const *list, const char *name, char *names, size_t cap) {
    bool found = false;
    for (; *list; list++) {
        found |= strcmp(*list, name) == 0;
        size_t n = strlen(names);
        if (n < cap) snprintf(names + n, cap - n, "%s%s", n ? ", " : "", *list);
    }
    return found;
}

static const arch *find(const char *name, bool hf, const char *what, ae_error *err) {
    char names[256] = "";
    for (size_t i = 0; i < N_ARCH; i++)
        if (listed(hf ? all[i]->hf_types : all[i]->gguf_archs, name, names, sizeof names)) return all[i];
    err_set(err, "%s \"%s\" is not supported (%s)", what, name, names);
    return NULL;
}

const arch *arch_for_gguf(const char *name, ae_error *err) { return find(name, false, "architecture", err); }

const arch *arch_for_hf(const char *model_type, ae_error *err) { return find(model_type, true, "model_type", err); }

int arch_load_ends(model *m, const char *embd, const char *norm, const char *output, ae_error *err) {
    model_config *c = &m->cfg;
    weights_store *w = m->w;
    const int64_t H = c->hidden;
    if (weights_table(w, embd, c->vocab, H, &m->tok_embd, err) || weights_vector(w, norm, H, false, &m->output_norm, err))
        return AE_ERR;
    c->tied_embeddings = !weights_has(w, output);
    if (!c->tied_embeddings) return weights_matrix(w, output, c->vocab, H, &m->output, err);
    if (!kn_matmul_supports(m->tok_embd.type)) return weights_matrix(w, embd, c->vocab, H, &m->output, err);
    m->output = m->tok_embd;
    /* A GGUF table is read a row at a time and not counted; as the output
     * projection every byte of it is. */
    if (w->gguf) w->bytes += (size_t)m->tok_embd.row_bytes * (size_t)c->vocab;
    return AE_OK;
}

int64_t arch_gguf_int(const gguf_file *f, const char *name, const char *suffix, int64_t def) {
    char key[192];
    snprintf(key, sizeof key, "%s.%s", name, suffix);
    int64_t v;
    return gguf_get_i64(f, key, &v, NULL) == AE_OK ? v : def;
}

int arch_gguf_required(const gguf_file *f, const char *name, const char *suffix, int32_t *out, ae_error *err) {
    int64_t v = arch_gguf_int(f, name, suffix, -1);
    if (v <= 0 || v > INT32_MAX) return err_set(err, "key %s.%s: missing or not a positive integer", name, suffix);
    *out = (int32_t)v;
    return AE_OK;
}
