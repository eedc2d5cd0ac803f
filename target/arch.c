#include "arch.h"

#include <math.h>
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

int arch_gguf_num(const gguf_file *f, const char *name, const char *suffix, double def, double *out, ae_error *err) {
    char key[192];
    snprintf(key, sizeof key, "%s.%s", name, suffix);
    *out = def;
    return gguf_find_key(f, key) < 0 ? AE_OK : gguf_get_f64(f, key, out, err);
}

int arch_gguf_int_key(const gguf_file *f, const char *name, const char *suffix, int64_t def, int64_t *out,
                      ae_error *err) {
    char key[192];
    snprintf(key, sizeof key, "%s.%s", name, suffix);
    *out = def;
    return gguf_find_key(f, key) < 0 ? AE_OK : gguf_get_i64(f, key, out, err);
}

/* Bounds as config.json's reader has them (hfconfig.c: rope_theta, the
 * scaling numbers, POS_MAX). */
#define ROPE_THETA_MAX 1e12
#define ROPE_SCALE_MAX 1e6
#define ROPE_CONTEXT_MAX (1 << 30)

int arch_check_rope(const kn_rope_config *r, const arch_rope_keys *k, ae_error *err) {
    if (!(isfinite(r->theta) && r->theta > 0.0 && r->theta <= ROPE_THETA_MAX))
        return err_set(err, "%s%s: %g is outside (0, %g]", k->where, k->theta, r->theta, ROPE_THETA_MAX);
    if (k->dims && (r->head_dim < 2 || r->head_dim % 2 || r->head_dim > KN_MAX_HEAD_DIM))
        return err_set(err, "%s%s: %d is not an even number in 2..%d", k->where, k->dims, r->head_dim, KN_MAX_HEAD_DIM);
    if (!r->yarn) return AE_OK;
    if (!(r->theta > 1.0))
        return err_set(err, "%s%s: %g is not above 1, as yarn needs (its band divides by its log)", k->where, k->theta,
                       r->theta);
    if (!(isfinite(r->factor) && r->factor >= 1.0 && r->factor <= ROPE_SCALE_MAX))
        return err_set(err, "%s%s%s: %g is outside [1, %g]", k->where, k->scaling, k->factor, r->factor, ROPE_SCALE_MAX);
    if (!(r->original_max_pos >= 1.0 && r->original_max_pos <= ROPE_CONTEXT_MAX))
        return err_set(err, "%s%s%s: %.0f is outside 1..%d", k->where, k->scaling, k->original, r->original_max_pos,
                       ROPE_CONTEXT_MAX);
    const double betas[2] = {r->beta_fast, r->beta_slow};
    const char *names[2] = {k->beta_fast, k->beta_slow};
    for (int i = 0; i < 2; i++)
        if (!(isfinite(betas[i]) && betas[i] > 0.0 && betas[i] <= ROPE_SCALE_MAX))
            return err_set(err, "%s%s%s: %g is outside (0, %g]", k->where, k->scaling, names[i], betas[i],
                           ROPE_SCALE_MAX);
    if (r->beta_fast < r->beta_slow)
        return err_set(err, "%s%s%s: %g is below %s%s's %g", k->where, k->scaling, k->beta_fast, r->beta_fast, k->scaling,
                       k->beta_slow, r->beta_slow);
    return AE_OK;
}

int arch_check_rope_hf(const model_config *c, const hfconfig *hc, const char *dims, const char *path, ae_error *err) {
    bool tf5 = hc->rope_scaling.key && !strcmp(hc->rope_scaling.key, "rope_parameters");
    arch_rope_keys k = {hc->text_config ? "text_config." : "",
                        hc->rope_theta_key ? hc->rope_theta_key : "rope_theta",
                        dims,
                        tf5 ? "rope_parameters." : "rope_scaling.",
                        "factor",
                        "original_max_position_embeddings",
                        "beta_fast",
                        "beta_slow"};
    if (arch_check_rope(&c->rope, &k, err) != AE_OK) return err_prefix(err, "%s: ", path), AE_ERR;
    return AE_OK;
}
