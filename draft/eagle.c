#include "eagle.h"

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "../services/core/config.h"
#include "../services/core/file.h"
#include "../services/model/hfconfig.h"
#include "../services/model/safetensors.h"

/* ---- loading -------------------------------------------------------------- */

static void free_owned(eagle_head *h) {
    for (int32_t i = 0; i < h->n_owned; i++) free(h->owned[i]);
    free(h->owned);
    h->owned = NULL;
    h->n_owned = 0;
}

void eagle_free(eagle_head *h) {
    if (!h) return;
    free_owned(h);
    for (int32_t i = 0; i < h->n_bufs; i++) kn_buf_free(&h->bufs[i]);
    free(h->bufs);
    free(h->draft_to_target);
    free(h);
}

static float *own_floats(eagle_head *h, uint64_t n, ae_error *err) {
    float **p = realloc(h->owned, (size_t)(h->n_owned + 1) * sizeof *p);
    if (!p) return err_set(err, "out of memory"), NULL;
    h->owned = p;
    float *buf = aligned_alloc(64, ((size_t)n * sizeof(float) + 63) & ~(size_t)63);
    if (!buf) return err_set(err, "out of memory for %llu floats of the head", (unsigned long long)n), NULL;
    h->owned[h->n_owned++] = buf;
    h->weight_bytes += (size_t)n * sizeof(float);
    return buf;
}

static void shape_text(char *buf, size_t size, const safetensors_tensor *t) {
    int k = snprintf(buf, size, "[");
    for (uint32_t d = 0; d < t->n_dims && k < (int)size; d++)
        k += snprintf(buf + k, size - (size_t)k, "%s%llu", d ? ", " : "", (unsigned long long)t->shape[d]);
    if (k < (int)size) snprintf(buf + k, size - (size_t)k, "]");
}

/* The tensor `name`, which must have shape [rows, cols] (rows = 0: a
 * vector of cols). `why` says where the expected shape comes from. */
static const safetensors_tensor *find_shaped(const safetensors_model *st, const char *name, int64_t rows, int64_t cols,
                                             const char *why, ae_error *err) {
    const safetensors_tensor *t = safetensors_model_find(st, name);
    if (!t) return err_set(err, "tensor %s is missing", name), NULL;
    bool ok = rows == 0 ? (t->n_dims == 1 && (int64_t)t->shape[0] == cols)
                        : (t->n_dims == 2 && (int64_t)t->shape[0] == rows && (int64_t)t->shape[1] == cols);
    if (!ok) {
        char have[96];
        shape_text(have, sizeof have, t);
        if (rows == 0)
            err_set(err, "%s is %s, %s needs [%lld]", name, have, why, (long long)cols);
        else
            err_set(err, "%s is %s, %s needs [%lld, %lld]", name, have, why, (long long)rows, (long long)cols);
        return NULL;
    }
    return t;
}

static int load_floats(eagle_head *h, const safetensors_model *st, const char *name, int64_t rows, int64_t cols,
                       const char *why, const float **out, ae_error *err) {
    const safetensors_tensor *t = find_shaped(st, name, rows, cols, why, err);
    if (!t) return AE_ERR;
    float *buf = own_floats(h, t->n_elements, err);
    if (!buf || safetensors_tensor_to_f32(t, buf, t->n_elements, err) != AE_OK) return AE_ERR;
    *out = buf;
    return AE_OK;
}

/* Matrices keep the file's element type when kn_matmul reads it natively
 * (F32, F16, BF16): the same values, and a step reads half the bytes of an
 * f32 copy for a 16-bit head. The copy is aligned; the mapping may not be.
 * With EAGLE_WEIGHTS_Q8_0 they are rounded to Q8_0 and packed for the
 * integer kernel instead. */
static int load_matrix(eagle_head *h, const safetensors_model *st, const char *name, int64_t rows, int64_t cols,
                       const char *why, kn_weight *w, ae_error *err) {
    const safetensors_tensor *t = find_shaped(st, name, rows, cols, why, err);
    if (!t) return AE_ERR;
    if (h->weights == EAGLE_WEIGHTS_Q8_0 && cols % 32 == 0) {
        float *tmp = malloc((size_t)t->n_elements * sizeof(float));
        if (!tmp) return err_set(err, "out of memory");
        int rc = safetensors_tensor_to_f32(t, tmp, t->n_elements, err);
        for (uint64_t i = 0; rc == AE_OK && i < t->n_elements; i++)
            if (!isfinite(tmp[i])) rc = err_set(err, "%s[%llu] is not finite", name, (unsigned long long)i);
        size_t row_bytes = quant_row_bytes(GGML_TYPE_Q8_0, (uint64_t)cols);
        float *q = rc == AE_OK ? own_floats(h, ((size_t)rows * row_bytes + 3) / 4, err) : NULL;
        if (q) {
            quant_quantize_q8_0(tmp, q, t->n_elements);
            *w = (kn_weight){.type = GGML_TYPE_Q8_0, .rows = rows, .cols = cols, .data = q, .row_bytes = row_bytes};
            size_t packed = kn_weight_packed_bytes(w);
            float *p = packed ? own_floats(h, (packed + 3) / 4, err) : NULL;
            if (packed && !p)
                rc = AE_ERR;
            else if (packed)
                kn_weight_pack(w, p);
        } else {
            rc = AE_ERR;
        }
        free(tmp);
        return rc;
    }
    ggml_type type = t->dtype == SAFETENSORS_F16    ? GGML_TYPE_F16
                     : t->dtype == SAFETENSORS_BF16 ? GGML_TYPE_BF16
                                                    : GGML_TYPE_F32;
    size_t elem = type == GGML_TYPE_F32 ? sizeof(float) : 2;
    /* own_floats counts floats: a 16-bit matrix takes half as many. */
    float *buf = own_floats(h, (t->n_elements * elem + sizeof(float) - 1) / sizeof(float), err);
    if (!buf) return AE_ERR;
    if (type == GGML_TYPE_F32) {
        if (safetensors_tensor_to_f32(t, buf, t->n_elements, err) != AE_OK) return AE_ERR;
    } else {
        memcpy(buf, t->data, (size_t)t->n_bytes);
    }
    *w = (kn_weight){.type = type, .rows = rows, .cols = cols, .data = buf, .row_bytes = (size_t)cols * elem};
    return AE_OK;
}

int eagle_weights_parse(const char *text, eagle_weights *out, ae_error *err) {
    if (!strcmp(text, "file"))
        *out = EAGLE_WEIGHTS_FILE;
    else if (!strcmp(text, "q8_0"))
        *out = EAGLE_WEIGHTS_Q8_0;
    else
        return err_set(err, "draft weights \"%s\": expected file or q8_0", text);
    return AE_OK;
}

/* d2t (draft id -> offset to its target id), or the identity when the
 * head drafts over the whole target vocabulary and has no d2t. */
static int load_vocab_map(eagle_head *h, const safetensors_model *st, ae_error *err) {
    int32_t Vd = h->cfg.draft_vocab, V = h->target.vocab;
    h->draft_to_target = malloc((size_t)Vd * sizeof(int32_t));
    if (!h->draft_to_target) return err_set(err, "out of memory");
    const safetensors_tensor *t = safetensors_model_find(st, "d2t");
    if (!t) {
        if (Vd != V)
            return err_set(err, "tensor d2t is missing (needed: the draft vocabulary has %d ids, the target %d)", Vd,
                           V);
        for (int32_t i = 0; i < Vd; i++) h->draft_to_target[i] = i;
        return AE_OK;
    }
    if (!(t = find_shaped(st, "d2t", 0, Vd, "draft_vocab_size", err))) return AE_ERR;
    int64_t *off = malloc((size_t)Vd * sizeof *off);
    if (!off) return err_set(err, "out of memory");
    int rc = safetensors_tensor_to_i64(t, off, (uint64_t)Vd, err);
    for (int32_t i = 0; rc == AE_OK && i < Vd; i++) {
        int64_t id = off[i] >= -(int64_t)V && off[i] <= (int64_t)V ? i + off[i] : -1; /* no overflow */
        if (id < 0 || id >= V)
            rc = err_set(err, "d2t[%d] = %lld maps draft id %d outside the target's vocabulary of %d", i,
                         (long long)off[i], i, V);
        else
            h->draft_to_target[i] = (int32_t)id;
    }
    free(off);
    if (rc != AE_OK) return AE_ERR;
    /* t2d is for training only, but a present one must describe this map. */
    const safetensors_tensor *t2d = safetensors_model_find(st, "t2d");
    if (!t2d) return AE_OK;
    if (!find_shaped(st, "t2d", 0, V, "the target's vocabulary", err)) return AE_ERR;
    bool *in = malloc((size_t)V);
    if (!in) return err_set(err, "out of memory");
    rc = safetensors_tensor_to_bool(t2d, in, (uint64_t)V, err);
    int64_t marked = 0;
    for (int32_t v = 0; rc == AE_OK && v < V; v++) marked += in[v];
    for (int32_t i = 0; rc == AE_OK && i < Vd; i++)
        if (!in[h->draft_to_target[i]])
            rc = err_set(err, "t2d[%d] is false but d2t maps draft id %d to it", h->draft_to_target[i], i);
    if (rc == AE_OK && marked != Vd)
        rc = err_set(err, "t2d marks %lld target ids, the draft vocabulary has %d", (long long)marked, Vd);
    free(in);
    return rc;
}

static int load_config(eagle_head *h, const char *dir, ae_error *err) {
    char path[1200];
    hfconfig hc;
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (hfconfig_load(&hc, path, err) != AE_OK) return AE_ERR;
    eagle_config *c = &h->cfg;
    const eagle_target *t = &h->target;
    if (hc.num_hidden_layers != 1)
        return err_set(err, "%s: num_hidden_layers %d; an EAGLE-3 head has 1", path, hc.num_hidden_layers);
    /* Variants of the midlayer that this forward pass does not compute are
     * refused, not run wrong. */
    if (hc.attention_bias)
        return err_set(err, "%s: attention_bias is true; heads with q/k/v/o biases are not supported", path);
    if (hc.norm_before_residual)
        return err_set(err, "%s: norm_before_residual is true; only the residual before hidden_norm is supported",
                       path);
    /* hidden_size is checked against the target after the tensors, whose
     * error names the tensor and both shapes. */
    c->hidden = hc.hidden_size;
    c->n_heads = hc.num_attention_heads;
    c->n_kv_heads = hc.num_key_value_heads;
    c->head_dim = hc.head_dim;
    c->ffn = hc.intermediate_size;
    c->draft_vocab = hc.draft_vocab_size > 0 ? hc.draft_vocab_size : t->vocab;
    if (c->draft_vocab > t->vocab)
        return err_set(err, "%s: draft_vocab_size %d is larger than the target's vocabulary %d", path, c->draft_vocab,
                       t->vocab);
    c->rms_eps = (float)hc.rms_norm_eps;
    if (c->head_dim % 8 != 0 || c->head_dim > KN_MAX_HEAD_DIM)
        return err_set(err, "%s: head_dim %d must be a multiple of 8 up to %d", path, c->head_dim, KN_MAX_HEAD_DIM);
    c->rope = hfconfig_rope(&hc);
    c->n_aux_layers = 0;
    if (hc.n_aux_layers > 0) {
        if (hc.n_aux_layers != EAGLE_N_AUX)
            return err_set(err, "%s: eagle_aux_hidden_state_layer_ids has %u ids, expected %d", path, hc.n_aux_layers,
                           EAGLE_N_AUX);
        for (int i = 0; i < EAGLE_N_AUX; i++) {
            if (hc.aux_layer_ids[i] < 0 || hc.aux_layer_ids[i] > t->n_layers)
                return err_set(err, "%s: eagle_aux_hidden_state_layer_ids[%d] = %d is outside the target's 0..%d", path,
                               i, hc.aux_layer_ids[i], t->n_layers);
            c->aux_layers[i] = hc.aux_layer_ids[i];
        }
        c->n_aux_layers = EAGLE_N_AUX;
    }
    if (kn_rope_init(&h->rope, &c->rope, err) != AE_OK) return err_prefix(err, "%s: ", path), AE_ERR;
    return AE_OK;
}

/* Puts the head where its target's embedding table is. A host-memory
 * backend reads the host copies as they are; any other gets a copy of
 * each matrix and vector (a packed copy is the CPU's: not taken), and
 * the host copies go. */
static int place(eagle_head *h, ae_error *err) {
    const kn_buf *tb = h->target.embed ? h->target.embed->buf : NULL;
    h->be = tb ? tb->be : &kn_backend_cpu;
    if (kn_backend_host_memory(h->be)) return AE_OK;
    kn_weight *mats[] = {&h->fc, &h->wq, &h->wk, &h->wv, &h->wo, &h->gate, &h->up, &h->down, &h->lm_head};
    const float **vecs[] = {&h->input_norm, &h->hidden_norm, &h->post_norm, &h->out_norm};
    enum { N_MATS = sizeof mats / sizeof mats[0], N_VECS = sizeof vecs / sizeof vecs[0] };
    if (!(h->bufs = calloc(N_MATS + N_VECS, sizeof *h->bufs))) return err_set(err, "out of memory");
    h->weight_bytes = 0;
    for (int i = 0; i < N_MATS; i++) {
        kn_weight *w = mats[i];
        size_t bytes = (size_t)w->rows * w->row_bytes;
        if (kn_buf_from_host(h->be, &h->bufs[h->n_bufs], w->data, bytes, err) != AE_OK) return AE_ERR;
        const kn_buf *b = &h->bufs[h->n_bufs++];
        w->data = b->ptr, w->buf = b, w->packed = NULL, w->packed_buf = NULL, w->pack_stride = 0;
        h->weight_bytes += bytes;
    }
    for (int i = 0; i < N_VECS; i++) {
        size_t bytes = (size_t)h->cfg.hidden * sizeof(float);
        if (kn_buf_from_host(h->be, &h->bufs[h->n_bufs], *vecs[i], bytes, err) != AE_OK) return AE_ERR;
        *vecs[i] = h->bufs[h->n_bufs++].ptr;
        h->weight_bytes += bytes;
    }
    free_owned(h);
    return AE_OK;
}

int eagle_load(eagle_head **out, const char *dir, const eagle_target *t, eagle_weights weights, ae_error *err) {
    *out = NULL;
    eagle_head *h = calloc(1, sizeof *h);
    if (!h) return err_set(err, "out of memory");
    h->target = *t;
    h->weights = weights;
    snprintf(h->dir, sizeof h->dir, "%s", dir);
    safetensors_model *st = NULL;
    int rc = load_config(h, dir, err);
    if (rc == AE_OK) rc = safetensors_model_open(&st, dir, err);
    if (rc == AE_OK) {
        const eagle_config *c = &h->cfg;
        int64_t H = t->hidden, F = c->ffn, QD = (int64_t)c->n_heads * c->head_dim,
                KD = (int64_t)c->n_kv_heads * c->head_dim;
        char fc_why[64];
        snprintf(fc_why, sizeof fc_why, "the target (hidden %lld)", (long long)H);
        const char *hw = fc_why, *cw = "config.json";
        if (load_matrix(h, st, "fc.weight", H, 3 * H, hw, &h->fc, err) ||
            load_floats(h, st, "midlayer.input_layernorm.weight", 0, H, hw, &h->input_norm, err) ||
            load_floats(h, st, "midlayer.hidden_norm.weight", 0, H, hw, &h->hidden_norm, err) ||
            load_floats(h, st, "midlayer.post_attention_layernorm.weight", 0, H, hw, &h->post_norm, err) ||
            load_floats(h, st, "norm.weight", 0, H, hw, &h->out_norm, err) ||
            load_matrix(h, st, "midlayer.self_attn.q_proj.weight", QD, 2 * H, cw, &h->wq, err) ||
            load_matrix(h, st, "midlayer.self_attn.k_proj.weight", KD, 2 * H, cw, &h->wk, err) ||
            load_matrix(h, st, "midlayer.self_attn.v_proj.weight", KD, 2 * H, cw, &h->wv, err) ||
            load_matrix(h, st, "midlayer.self_attn.o_proj.weight", H, QD, cw, &h->wo, err) ||
            load_matrix(h, st, "midlayer.mlp.gate_proj.weight", F, H, cw, &h->gate, err) ||
            load_matrix(h, st, "midlayer.mlp.up_proj.weight", F, H, cw, &h->up, err) ||
            load_matrix(h, st, "midlayer.mlp.down_proj.weight", H, F, cw, &h->down, err) ||
            load_matrix(h, st, "lm_head.weight", c->draft_vocab, H, "config.json's draft_vocab_size", &h->lm_head,
                        err) ||
            load_vocab_map(h, st, err))
            rc = AE_ERR;
        else if (c->hidden != H)
            rc = err_set(err, "config.json hidden_size is %d, the target's is %lld", c->hidden, (long long)H);
        if (rc == AE_OK) rc = place(h, err);
        if (rc != AE_OK && !strstr(err ? err->msg : "", dir)) err_prefix(err, "head %s: ", dir);
    }
    safetensors_model_close(st); /* every tensor was converted */
    if (rc != AE_OK) {
        eagle_free(h);
        return AE_ERR;
    }
    *out = h;
    return AE_OK;
}

/* ---- forward -------------------------------------------------------------- */

struct eagle_ws {
    int32_t max_tokens;
    float *h;     /* [max_tokens][H] input state (fc output or fed back) */
    float *e;     /* [max_tokens][H] embeddings, then normed */
    float *x;     /* [max_tokens][2H] [input_layernorm(e), hidden_norm(h)] */
    float *q;     /* [max_tokens][heads*D] */
    float *k;     /* [max_tokens][kv_heads*D] */
    float *v;     /* [max_tokens][kv_heads*D] */
    float *attn;  /* [max_tokens][heads*D] */
    float *proj;  /* [max_tokens][H] */
    float *gate;  /* [max_tokens][F] */
    float *up;    /* [max_tokens][F] */
    float *out_x; /* [max_tokens][H] rows whose logits are wanted */
    float *rope;  /* [max_tokens][D] */
    kn_buf block; /* all of the above, in the head's backend's memory */
};

#define EWS_BUFS 12

static size_t round64(size_t n) { return (n + 63) & ~(size_t)63; }

static void ews_sizes(const eagle_head *hd, int32_t T, size_t sz[EWS_BUFS]) {
    const eagle_config *c = &hd->cfg;
    size_t t = (size_t)T, H = (size_t)c->hidden, F = (size_t)c->ffn, QD = (size_t)c->n_heads * (size_t)c->head_dim,
           KD = (size_t)c->n_kv_heads * (size_t)c->head_dim;
    size_t v[EWS_BUFS] = {t * H,  t * H, 2 * t * H, t * QD, t * KD, t * KD,
                          t * QD, t * H, t * F,     t * F,  t * H,  t * (size_t)c->head_dim};
    memcpy(sz, v, sizeof v);
}

size_t eagle_ws_bytes(const eagle_head *h, int32_t max_tokens) {
    size_t sz[EWS_BUFS], total = 0;
    ews_sizes(h, max_tokens, sz);
    for (int i = 0; i < EWS_BUFS; i++) total += round64(sz[i] * sizeof(float));
    return total;
}

size_t eagle_stream_workspace(const eagle_head *h, int32_t max_tokens, int32_t max_keys) {
    int64_t k = 3 * (int64_t)h->cfg.hidden;
    if (h->cfg.ffn > k) k = h->cfg.ffn;
    if ((int64_t)h->cfg.n_heads * h->cfg.head_dim > k) k = (int64_t)h->cfg.n_heads * h->cfg.head_dim;
    size_t mm = kn_matmul_workspace(max_tokens, k);
    size_t at = max_keys > 0 ? kn_attention_workspace(h->cfg.n_heads, h->cfg.head_dim, max_keys) : 0;
    return mm > at ? mm : at;
}

int eagle_ws_init(eagle_ws **out, const eagle_head *hd, int32_t max_tokens, ae_error *err) {
    *out = NULL;
    if (max_tokens < 1) return err_set(err, "head workspace: max_tokens %d", max_tokens);
    eagle_ws *ws = calloc(1, sizeof *ws);
    if (!ws) return err_set(err, "out of memory");
    size_t bytes = eagle_ws_bytes(hd, max_tokens);
    if (kn_buf_alloc(hd->be, &ws->block, bytes, err) != AE_OK) {
        free(ws);
        return err_prefix(err, "a %zu byte head workspace: ", bytes), AE_ERR;
    }
    size_t sz[EWS_BUFS];
    ews_sizes(hd, max_tokens, sz);
    float **slots[EWS_BUFS] = {&ws->h,    &ws->e,    &ws->x,    &ws->q,  &ws->k,     &ws->v,
                               &ws->attn, &ws->proj, &ws->gate, &ws->up, &ws->out_x, &ws->rope};
    char *p = ws->block.ptr;
    for (int i = 0; i < EWS_BUFS; i++) {
        *slots[i] = (float *)(void *)p;
        p += round64(sz[i] * sizeof(float));
    }
    ws->max_tokens = max_tokens;
    *out = ws;
    return AE_OK;
}

void eagle_ws_free(eagle_ws *ws) {
    if (!ws) return;
    kn_buf_free(&ws->block);
    free(ws);
}

void eagle_forward(const eagle_head *hd, kn_stream *s, const kn_kv_pool *kv, eagle_ws *ws, const eagle_batch *b) {
    const eagle_config *c = &hd->cfg;
    const int32_t T = b->m, H = c->hidden;
    const size_t Hs = (size_t)H;
    AE_ASSERT(T >= 1 && T <= ws->max_tokens && b->map && b->map->m == T);
    AE_ASSERT(b->in_width == H || b->in_width == 3 * H);
    AE_ASSERT(b->n_logits >= 0 && b->n_logits <= T);

    if (b->in_width == 3 * H)
        kn_matmul(s, &hd->fc, b->in, ws->h, T);
    else
        kn_gather_rows(s, b->in, NULL, T, H, ws->h, H);
    kn_embed(s, hd->target.embed, b->tokens, ws->e, T);
    kn_rmsnorm(s, ws->e, hd->input_norm, ws->e, T, H, c->rms_eps);
    kn_rmsnorm(s, ws->h, hd->hidden_norm, ws->proj, T, H, c->rms_eps);
    /* x[t] = [e[t], normed h[t]] */
    kn_gather_rows(s, ws->e, NULL, T, H, ws->x, 2 * (int64_t)H);
    kn_gather_rows(s, ws->proj, NULL, T, H, ws->x + Hs, 2 * (int64_t)H);
    kn_matmul_n(s, 3, (const kn_weight *[]){&hd->wq, &hd->wk, &hd->wv}, ws->x, (float *[]){ws->q, ws->k, ws->v}, T);
    kn_rope_table(s, &hd->rope, b->pos, T, ws->rope);
    kn_rope_rotate(s, &hd->rope, ws->q, T, c->n_heads, ws->rope);
    kn_rope_rotate(s, &hd->rope, ws->k, T, c->n_kv_heads, ws->rope);
    kn_kv_write(s, kv, b->map, ws->k, ws->v);
    kn_attention(s, kv, b->map, ws->q, ws->attn, c->n_heads);
    kn_matmul(s, &hd->wo, ws->attn, ws->proj, T);
    kn_add(s, ws->h, ws->proj, b->hidden, (int64_t)T * H);

    kn_rmsnorm(s, b->hidden, hd->post_norm, ws->e, T, H, c->rms_eps);
    kn_matmul_swiglu(s, &hd->gate, &hd->up, ws->e, ws->gate, ws->up, T);
    kn_matmul(s, &hd->down, ws->gate, ws->proj, T);
    kn_add(s, b->hidden, ws->proj, b->hidden, (int64_t)T * H);

    if (b->n_logits == 0) return;
    /* On a device the rows are not the host's to read: in range by the
     * caller's construction, checked here where they can be. */
    if (kn_backend_host_memory(hd->be))
        for (int32_t r = 0; r < b->n_logits; r++) AE_ASSERT(b->logit_rows[r] >= 0 && b->logit_rows[r] < T);
    kn_gather_rows(s, b->hidden, b->logit_rows, b->n_logits, H, ws->out_x, H);
    kn_rmsnorm(s, ws->out_x, hd->out_norm, ws->out_x, b->n_logits, H, c->rms_eps);
    kn_matmul(s, &hd->lm_head, ws->out_x, b->logits, b->n_logits);
}

/* ---- finding the head --------------------------------------------------- */

const char *eagle_dir(const config *c) {
    const char *d = config_str(c, "draft");
    return d && strcmp(d, "none") ? d : NULL;
}

/* The "target_model" of dir/training.json, or NULL. */
static char *head_target(const char *dir) {
    char path[4096], *text = NULL, *out = NULL;
    size_t len;
    ae_error err = {0};
    if ((size_t)snprintf(path, sizeof path, "%s/training.json", dir) >= sizeof path) return NULL;
    if (file_read_all(path, 1 << 20, &text, &len, NULL, &err) != AE_OK) return NULL;
    cJSON *o = cJSON_Parse(text);
    const cJSON *t = o ? cJSON_GetObjectItemCaseSensitive(o, "target_model") : NULL;
    if (cJSON_IsString(t)) out = strdup(t->valuestring);
    cJSON_Delete(o);
    free(text);
    return out;
}

void eagle_resolve_dir(config *c) {
    if (!config_is_auto(c, "draft")) return;
    const char *model_path = config_str(c, "model");
    char found[4096] = "none";
    if (model_path) {
        char dir[4096];
        snprintf(dir, sizeof dir, "%s", model_path);
        size_t n = strlen(dir);
        while (n > 1 && dir[n - 1] == '/') dir[--n] = 0; /* a model directory given as "dir/" */
        char *slash = strrchr(dir, '/');
        const char *name = slash ? slash + 1 : dir;
        char parent[4096];
        snprintf(parent, sizeof parent, "%.*s", slash ? (int)(slash - dir) : 1, slash ? dir : ".");
        struct dirent **list = NULL;
        int k = scandir(parent, &list, NULL, alphasort);
        for (int i = 0; i < k; i++) {
            char sub[4096];
            if (list[i]->d_name[0] != '.' && !strcmp(found, "none") &&
                (size_t)snprintf(sub, sizeof sub, "%s/%s", parent, list[i]->d_name) < sizeof sub) {
                char *target = head_target(sub);
                if (target && !strcmp(target, name)) snprintf(found, sizeof found, "%s", sub);
                free(target);
            }
            free(list[i]);
        }
        free(list);
    }
    config_set_auto_str(c, "draft", found);
}
