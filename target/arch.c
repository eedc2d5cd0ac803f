#include "arch.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
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

/* ---- a layer's tensors ------------------------------------------------------ */

int64_t arch_size_value(const model_config *c, arch_size s) {
    switch (s) {
    case ARCH_ONE: return 1;
    case ARCH_HIDDEN: return c->hidden;
    case ARCH_FFN: return c->ffn;
    case ARCH_HEADS: return c->n_heads;
    case ARCH_KV_HEADS: return c->n_kv_heads;
    case ARCH_HEAD_DIM: return c->head_dim;
    case ARCH_Q_RANK: return c->q_lora_rank ? c->q_lora_rank : c->hidden;
    case ARCH_KV_RANK: return c->kv_lora_rank;
    case ARCH_NOPE_DIM: return c->qk_nope_dim;
    case ARCH_ROPE_DIM: return c->qk_rope_dim;
    case ARCH_V_DIM: return c->v_head_dim;
    case ARCH_LATENT_DIM: return (int64_t)c->kv_lora_rank + c->qk_rope_dim;
    case ARCH_Q_HEAD_DIM: return (int64_t)c->qk_nope_dim + c->qk_rope_dim;
    case ARCH_KV_HEAD_DIM: return (int64_t)c->qk_nope_dim + c->v_head_dim;
    case ARCH_EXPERTS: return c->route.n_experts;
    case ARCH_EXPERT_FFN: return c->expert_ffn;
    case ARCH_SHARED_FFN: return c->shared_ffn;
    }
    AE_ASSERT(!"a size arch_size_value does not have");
    return 0;
}

int64_t arch_dim_value(const model_config *c, arch_dim d) {
    return arch_size_value(c, d.n) * arch_size_value(c, d.unit);
}

model_ffn arch_layer_ffn(const model_config *c, int32_t i) {
    return c->route.n_experts > 0 && i >= c->n_dense_layers ? MODEL_FFN_MOE : MODEL_FFN_DENSE;
}

bool arch_layer_has(const model_config *c, const model_layer *l, const arch_tensor *t) {
    bool block = t->block == ARCH_EVERY || (t->block == ARCH_GQA && l->attn == MODEL_ATTN_GQA) ||
                 (t->block == ARCH_MLA && l->attn == MODEL_ATTN_MLA) ||
                 (t->block == ARCH_DENSE && l->ffn == MODEL_FFN_DENSE) ||
                 (t->block == ARCH_MOE && l->ffn == MODEL_FFN_MOE);
    return block && !((t->flags & ARCH_Q_LORA) && !c->q_lora_rank) &&
           !((t->flags & ARCH_NO_Q_LORA) && c->q_lora_rank) && !((t->flags & ARCH_SHARED) && !c->shared_ffn);
}

/* Refuses a tensor of a type the model's backend has no kernel for
 * (a GPU backend that lacks one), naming both, rather than widening it. */
static int backend_takes(const model *m, kn_op op, const kn_weight *x, const char *name, ae_error *err) {
    if (!m->be || !x->data || kn_backend_supports(m->be, op, x->type)) return AE_OK;
    return err_set(err, "tensor %s has type %s, which the %s backend has no kernel for yet: run it with --device cpu",
                   name, quant_type_name(x->type), kn_backend_name(m->be));
}

/* The model's two ends in the file's format; the embedding table where
 * it has no output projection (tied). */
static int load_ends(model *m, ae_error *err) {
    model_config *c = &m->cfg;
    weights_store *w = m->w;
    const bool gguf = w->gguf != NULL;
    const char *embd = gguf ? "token_embd.weight" : "model.embed_tokens.weight",
               *norm = gguf ? "output_norm.weight" : "model.norm.weight",
               *output = gguf ? "output.weight" : "lm_head.weight";
    const int64_t H = c->hidden;
    if (weights_table(w, embd, c->vocab, H, &m->tok_embd, err) ||
        backend_takes(m, KN_OP_EMBED, &m->tok_embd, embd, err) ||
        weights_vector(w, norm, H, false, &m->output_norm, err))
        return AE_ERR;
    c->tied_embeddings = !weights_has(w, output);
    if (!c->tied_embeddings)
        return weights_matrix(w, output, c->vocab, H, &m->output, err) ||
                       backend_takes(m, KN_OP_MATMUL, &m->output, output, err)
                   ? AE_ERR
                   : AE_OK;
    if (!kn_matmul_supports(m->tok_embd.type) || (m->be && !kn_backend_supports(m->be, KN_OP_MATMUL, m->tok_embd.type)))
        return weights_matrix(w, embd, c->vocab, H, &m->output, err) ||
                       backend_takes(m, KN_OP_MATMUL, &m->output, embd, err)
                   ? AE_ERR
                   : AE_OK;
    m->output = m->tok_embd;
    /* A GGUF table is read a row at a time and not counted; as the output
     * projection every byte of it is. */
    if (w->gguf) w->bytes += (size_t)m->tok_embd.row_bytes * (size_t)c->vocab;
    return AE_OK;
}

/* t's name in layer `layer` of a file of the format (gguf or not), with
 * an expert's index for its %d. */
static const char *tensor_name(const arch_tensor *t, bool gguf, int32_t layer, int64_t expert, char *buf, size_t cap) {
    const char *name = gguf ? t->gguf : t->hf, *at = strstr(name, "%d");
    int n = snprintf(buf, cap, gguf ? "blk.%d." : "model.layers.%d.", layer);
    AE_ASSERT(n > 0 && (size_t)n < cap);
    if (at)
        snprintf(buf + n, cap - (size_t)n, "%.*s%lld%s", (int)(at - name), name, (long long)expert, at + 2);
    else
        snprintf(buf + n, cap - (size_t)n, "%s", name);
    return buf;
}

/* A matrix in the file's type, or compressed-tensors int4 (name is
 * {prefix}.weight or {prefix}.weight_packed). */
static int read_any(weights_store *w, const char *prefix, int64_t rows, int64_t cols, kn_weight *out, ae_error *err) {
    char name[256];
    snprintf(name, sizeof name, "%s.weight", prefix);
    if (!weights_has(w, name) && weights_has_int4(w, prefix))
        return weights_int4_matrix(w, prefix, rows, cols, out, err);
    return weights_matrix(w, name, rows, cols, out, err);
}

/* The file's tensor `name` into dst (a const float * or a kn_weight), as
 * t says. */
static int read_tensor(model *m, const arch_tensor *t, const char *name, void *dst, ae_error *err) {
    const model_config *c = &m->cfg;
    weights_store *w = m->w;
    const int64_t rows = arch_dim_value(c, t->rows), cols = arch_dim_value(c, t->cols);
    switch (t->read) {
    case ARCH_READ_VECTOR: return weights_vector(w, name, rows, (t->flags & ARCH_BIAS) && !c->qkv_bias, dst, err);
    case ARCH_READ_MATRIX: return weights_matrix(w, name, rows, cols, dst, err);
    case ARCH_READ_ANY: return read_any(w, name, rows, cols, dst, err);
    case ARCH_READ_HEADS:
        return weights_matrix_3d(w, name, arch_size_value(c, t->rows.n), arch_size_value(c, t->rows.unit), cols, dst,
                                 err);
    case ARCH_MADE: break;
    }
    AE_ASSERT(!"a tensor read_tensor does not read");
    return AE_ERR;
}

/* The routed experts' run of n entries from t: in a GGUF file each one a
 * stacked 3-D tensor (expert e is rows [e rows, (e + 1) rows)), in a
 * Hugging Face one a tensor an expert, read expert by expert. */
static int read_experts(model *m, model_layer *l, int32_t layer, const arch_tensor *t, size_t n, ae_error *err) {
    const model_config *c = &m->cfg;
    weights_store *w = m->w;
    const bool gguf = w->gguf != NULL;
    const int64_t E = c->route.n_experts;
    char name[256];
    if (!l->experts && !(l->experts = calloc(3 * (size_t)E, sizeof *l->experts))) return err_set(err, "out of memory");
    if (gguf) {
        for (size_t j = 0; j < n; j++) {
            const int64_t rows = arch_dim_value(c, t[j].rows), cols = arch_dim_value(c, t[j].cols);
            kn_weight st;
            if (weights_matrix_3d(w, tensor_name(&t[j], true, layer, 0, name, sizeof name), E, rows, cols, &st, err))
                return AE_ERR;
            if (backend_takes(m, KN_OP_MOE, &st, name, err)) return AE_ERR;
            for (int64_t e = 0; e < E; e++) {
                kn_weight *x = &l->experts[(int64_t)t[j].at * E + e];
                *x = st;
                x->rows = rows;
                x->data = (const char *)st.data + (size_t)(e * rows) * st.row_bytes;
            }
        }
        return AE_OK;
    }
    for (int64_t e = 0; e < E; e++)
        for (size_t j = 0; j < n; j++)
            if (read_tensor(m, &t[j], tensor_name(&t[j], false, layer, e, name, sizeof name),
                            &l->experts[(int64_t)t[j].at * E + e], err))
                return AE_ERR;
    return AE_OK;
}

/* Layer i's tensors: those it holds that the file has, in the table's
 * order, then the made ones, then the packing. */
static int load_layer(model *m, model_layer *l, int32_t i, ae_error *err) {
    const arch *a = m->arch;
    const model_config *c = &m->cfg;
    const bool gguf = m->w->gguf != NULL;
    kn_weight src[ARCH_MAX_SOURCES] = {0};
    bool had = false;
    char name[256];
    l->attn = a->attn;
    l->ffn = arch_layer_ffn(c, i);
    for (size_t k = 0; k < a->n_tensors; k++) {
        const arch_tensor *t = &a->tensors[k];
        if (t->read == ARCH_MADE || !arch_layer_has(c, l, t)) continue;
        if (t->flags & ARCH_IF_PRESENT) {
            had = (gguf ? t->gguf : t->hf) && weights_has(m->w, tensor_name(t, gguf, i, 0, name, sizeof name));
            if (!had) continue;
        }
        if (((t->flags & ARCH_IF_HAD) && !had) || ((t->flags & ARCH_IF_NOT_HAD) && had)) continue;
        if (t->held == ARCH_EXPERT) {
            size_t n = 1;
            while (k + n < a->n_tensors && t[n].held == ARCH_EXPERT) n++;
            if (read_experts(m, l, i, t, n, err) != AE_OK) return AE_ERR;
            k += n - 1;
            continue;
        }
        AE_ASSERT(t->held != ARCH_SRC || t->at < ARCH_MAX_SOURCES);
        void *dst = t->held == ARCH_SRC ? &src[t->at] : arch_field(l, t);
        if (read_tensor(m, t, tensor_name(t, gguf, i, 0, name, sizeof name), dst, err) != AE_OK) return AE_ERR;
        const kn_weight *x = dst;
        if ((t->flags & ARCH_ROUTER) && x->type != GGML_TYPE_F32 && x->type != GGML_TYPE_BF16)
            return err_set(err, "tensor %s: type %s; the %s must be f32 or bf16", name, quant_type_name(x->type),
                           t->name);
        if (t->held == ARCH_MAT && t->read != ARCH_READ_VECTOR && backend_takes(m, KN_OP_MATMUL, x, name, err))
            return AE_ERR;
    }
    if (a->make && a->make(m, l, src, err) != AE_OK) return AE_ERR;
    for (size_t k = 0; k < a->n_tensors; k++) {
        const arch_tensor *t = &a->tensors[k];
        if (!(t->flags & ARCH_PACK) || !arch_layer_has(c, l, t)) continue;
        if (t->held == ARCH_MAT) {
            kn_weight *x = arch_field(l, t);
            if (x->data && weights_pack(m->w, x, err) != AE_OK) return AE_ERR;
        } else if (t->held == ARCH_EXPERT) {
            for (int64_t e = 0; e < c->route.n_experts; e++)
                if (weights_pack(m->w, &l->experts[(int64_t)t->at * c->route.n_experts + e], err) != AE_OK)
                    return AE_ERR;
        }
    }
    return AE_OK;
}

int arch_load_tensors(model *m, ae_error *err) {
    const model_config *c = &m->cfg;
    if (load_ends(m, err) != AE_OK) return AE_ERR;
    if (!(m->layers = calloc((size_t)c->n_layers, sizeof *m->layers))) return err_set(err, "out of memory");
    for (int32_t i = 0; i < c->n_layers; i++)
        if (load_layer(m, &m->layers[i], i, err) != AE_OK) return AE_ERR;
    return weights_pack(m->w, &m->output, err);
}

static size_t matrix_bytes(const kn_weight *w) {
    return w->data ? (size_t)w->rows * quant_row_bytes(w->type, (uint64_t)w->cols) : 0;
}

size_t arch_decode_bytes(const model *m) {
    const model_config *c = &m->cfg;
    size_t b = 0;
    for (int32_t i = 0; i < c->n_layers; i++) {
        const model_layer *l = &m->layers[i];
        for (size_t k = 0; k < m->arch->n_tensors; k++) {
            const arch_tensor *t = &m->arch->tensors[k];
            if (!arch_layer_has(c, l, t)) continue;
            if (t->held == ARCH_MAT) b += matrix_bytes(arch_field_const(l, t));
            /* an average expert: their sizes are equal */
            if (t->held == ARCH_EXPERT && l->experts)
                b += (size_t)c->route.top_k * matrix_bytes(&l->experts[(int64_t)t->at * c->route.n_experts]);
        }
        b += 2 * (size_t)c->hidden * sizeof(float);
    }
    return b + matrix_bytes(&m->output) + (size_t)c->hidden * sizeof(float);
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

void arch_count_params(const arch *a, const model_config *c, arch_params *p) {
    *p = (arch_params){0};
    for (int32_t i = 0; i < c->n_layers; i++) {
        const model_layer l = {.attn = a->attn, .ffn = arch_layer_ffn(c, i)};
        for (size_t k = 0; k < a->n_tensors; k++) {
            const arch_tensor *t = &a->tensors[k];
            if (t->held == ARCH_SRC || !arch_layer_has(c, &l, t) || ((t->flags & ARCH_BIAS) && !c->qkv_bias)) continue;
            const uint64_t n = (uint64_t)arch_dim_value(c, t->rows) * (uint64_t)arch_dim_value(c, t->cols);
            if (t->held == ARCH_VEC)
                p->whole_f32 += n;
            else if (t->held == ARCH_EXPERT)
                p->experts += n * (uint64_t)c->route.n_experts;
            else if (t->shard == ARCH_WHOLE)
                *(t->flags & ARCH_F32 ? &p->whole_f32 : &p->whole) += n;
            else
                *(t->flags & ARCH_F32 ? &p->split_f32 : &p->split) += n;
        }
    }
    p->whole_f32 += (uint64_t)c->hidden; /* the final norm */
    p->embed = (uint64_t)c->vocab * (uint64_t)c->hidden;
    p->output = c->tied_embeddings ? 0 : (uint64_t)c->vocab * (uint64_t)c->hidden;
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
        return err_set(err, "%s%s%s: %g is outside [1, %g]", k->where, k->scaling, k->factor, r->factor,
                       ROPE_SCALE_MAX);
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
        return err_set(err, "%s%s%s: %g is below %s%s's %g", k->where, k->scaling, k->beta_fast, r->beta_fast,
                       k->scaling, k->beta_slow, r->beta_slow);
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
