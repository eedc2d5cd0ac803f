/* DeepSeek-V3 and Kimi-K2 (DeepseekV3ForCausalLM): MLA attention over a
 * compressed latent, the first layers' dense SwiGLU FFN, then a mixture
 * of sigmoid-routed experts with shared experts, and YaRN RoPE. Read from
 * Hugging Face files (the experts also in compressed-tensors int4, as
 * Kimi-K2.5 ships them).
 *
 * MLA runs absorbed (llama.c attn_mla): the cache holds, per token and
 * layer, the normed latent c_kv (kv_lora_rank) and the roped k_pe
 * (qk_rope_head_dim), shared by every head. kv_b_proj's rows are, head by
 * head, W_UK (qk_nope_head_dim rows) and W_UV (v_head_dim rows): a head's
 * query is folded through W_UK into the latent's space, and its output
 * leaves through W_UV, so nothing per head is stored. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../services/core/file.h"
#include "../../services/core/json.h"
#include "../../services/kv/kv_cache.h"
#include "../arch.h"
#include "../tp.h"

static const char *const hf_types[] = {"deepseek_v3", "kimi_k2", "kimi_k25", NULL};
static const char *const gguf_archs[] = {NULL};

/* The low-rank norms' epsilon: DeepSeek-V3's q_a_layernorm and
 * kv_a_layernorm are built with RMSNorm's default, not rms_norm_eps. */
#define MLA_NORM_EPS 1e-6f

/* ---- config.json ------------------------------------------------------------ */

typedef struct ds_keys {
    const cJSON *obj;
    const char *path;
    ae_error *err;
    bool failed;
} ds_keys;

/* An integer key in lo..hi; absent or null: def (def < 0: required). */
static int32_t key_int(ds_keys *k, const char *name, int64_t lo, int64_t hi, int64_t def) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(k->obj, name);
    int64_t x;
    if (k->failed) return 0;
    if (!v || cJSON_IsNull(v)) {
        if (def >= 0) return (int32_t)def;
        k->failed = true;
        return err_set(k->err, "%s: %s: required key is missing", k->path, name), 0;
    }
    if (!json_int(v, lo, hi, &x)) {
        k->failed = true;
        return err_set(k->err, "%s: %s: expected an integer in %lld..%lld", k->path, name, (long long)lo,
                       (long long)hi),
               0;
    }
    return (int32_t)x;
}

static double key_num(ds_keys *k, const char *name, double def) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(k->obj, name);
    if (k->failed || !v || cJSON_IsNull(v)) return def;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble <= 0.0) {
        k->failed = true;
        return err_set(k->err, "%s: %s: expected a positive number", k->path, name), def;
    }
    return v->valuedouble;
}

static bool key_bool(ds_keys *k, const char *name, bool def) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(k->obj, name);
    if (k->failed || !v || cJSON_IsNull(v)) return def;
    if (!cJSON_IsBool(v)) {
        k->failed = true;
        return err_set(k->err, "%s: %s: expected true or false", k->path, name), def;
    }
    return cJSON_IsTrue(v);
}

/* A string key that must be `want` where present. */
static void key_is(ds_keys *k, const char *name, const char *want) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(k->obj, name);
    if (k->failed || !v || cJSON_IsNull(v)) return;
    if (!cJSON_IsString(v) || strcmp(v->valuestring, want)) {
        k->failed = true;
        err_set(k->err, "%s: %s: only \"%s\" is supported", k->path, name, want);
    }
}

/* The quantization a config declares: none, or compressed-tensors (read
 * tensor by tensor); anything else (DeepSeek-V3's own fp8 blocks) is
 * refused here rather than misread later. */
static void check_quantization(ds_keys *k) {
    const cJSON *q = cJSON_GetObjectItemCaseSensitive(k->obj, "quantization_config");
    if (k->failed || !q || cJSON_IsNull(q)) return;
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(q, "quant_method");
    if (!cJSON_IsString(m) || strcmp(m->valuestring, "compressed-tensors")) {
        k->failed = true;
        err_set(k->err, "%s: quantization_config.quant_method \"%s\" is not supported (compressed-tensors int4 is)",
                k->path, cJSON_IsString(m) ? m->valuestring : "?");
    }
}

/* The MLA and MoE keys, into c. */
static int read_keys(model_config *c, const cJSON *root, const char *path, ae_error *err) {
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(root, "text_config");
    ds_keys k = {cJSON_IsObject(text) ? text : root, path, err, false};
    const int64_t BIG = 1 << 20;
    c->q_lora_rank = key_int(&k, "q_lora_rank", 1, BIG, 0);
    c->kv_lora_rank = key_int(&k, "kv_lora_rank", 1, BIG, -1);
    c->qk_nope_dim = key_int(&k, "qk_nope_head_dim", 1, BIG, -1);
    c->qk_rope_dim = key_int(&k, "qk_rope_head_dim", 2, KN_MAX_HEAD_DIM, -1);
    c->v_head_dim = key_int(&k, "v_head_dim", 1, BIG, -1);
    c->route.n_experts = key_int(&k, "n_routed_experts", 1, KN_MAX_EXPERTS, 0);
    c->route.top_k = key_int(&k, "num_experts_per_tok", 1, KN_MAX_ACTIVE_EXPERTS, c->route.n_experts ? -1 : 0);
    c->route.n_group = key_int(&k, "n_group", 1, KN_MAX_EXPERT_GROUPS, 1);
    c->route.topk_group = key_int(&k, "topk_group", 1, KN_MAX_EXPERT_GROUPS, 1);
    c->route.norm = key_bool(&k, "norm_topk_prob", false);
    c->route.scale = (float)key_num(&k, "routed_scaling_factor", 1.0);
    c->expert_ffn = key_int(&k, "moe_intermediate_size", 1, BIG, c->route.n_experts ? -1 : 0);
    c->shared_ffn = key_int(&k, "n_shared_experts", 0, 64, 0) * c->expert_ffn;
    c->n_dense_layers = key_int(&k, "first_k_dense_replace", 0, c->n_layers, 0);
    if (key_int(&k, "moe_layer_freq", 1, 1, 1) != 1 && !k.failed) k.failed = true;
    bool interleave = key_bool(&k, "rope_interleave", true);
    key_is(&k, "topk_method", "noaux_tc");
    key_is(&k, "scoring_func", "sigmoid");
    key_is(&k, "hidden_act", "silu");
    check_quantization(&k);
    if (k.failed) return AE_ERR;
    if (c->route.n_experts == 0) c->n_dense_layers = c->n_layers;
    const kn_route *r = &c->route;
    if (r->n_experts) {
        int32_t per = r->n_experts / r->n_group;
        if (r->n_experts % r->n_group || r->topk_group > r->n_group || (r->n_group > 1 && per < 2) ||
            r->top_k > r->topk_group * per)
            return err_set(err,
                           "%s: %d experts in n_group %d, topk_group %d, num_experts_per_tok %d: groups must divide "
                           "the experts (2 or more each), and the kept groups hold the experts chosen",
                           path, r->n_experts, r->n_group, r->topk_group, r->top_k);
    }
    c->rope.layout = interleave ? KN_ROPE_ADJACENT : KN_ROPE_NEOX; /* interleaved pairs: (2i, 2i+1) */
    c->rope.head_dim = c->qk_rope_dim;
    return AE_OK;
}

static int config_hf(model_config *c, const hfcfg *hc, const char *path, ae_error *err) {
    c->n_layers = hc->num_hidden_layers;
    c->hidden = hc->hidden_size;
    c->ffn = hc->intermediate_size;
    c->n_heads = hc->num_attention_heads;
    c->vocab = hc->vocab_size;
    c->context_length = hc->max_position_embeddings;
    c->rms_eps = (float)hc->rms_norm_eps;
    c->tied_embeddings = hc->tie_word_embeddings; /* the loader then asks the file */
    if (hc->attention_bias) return err_set(err, "%s: attention_bias on a %s model is not supported", path, c->arch);
    c->rope = hfcfg_rope(hc);
    char *buf;
    size_t size;
    if (file_read_all(path, HFCFG_MAX_FILE, &buf, &size, NULL, err) != AE_OK) return AE_ERR;
    cJSON *root = json_parse(buf, size, err);
    free(buf);
    if (!root) return err_prefix(err, "%s: ", path), AE_ERR;
    int rc = read_keys(c, root, path, err);
    cJSON_Delete(root);
    if (rc != AE_OK) return AE_ERR;
    /* The attention sees one kv head of the latent (kernels.h). */
    c->n_kv_heads = 1;
    c->head_dim = c->kv_lora_rank + c->qk_rope_dim;
    if (c->head_dim % 8 || c->head_dim > KN_MAX_ATTN_DIM)
        return err_set(err, "%s: kv_lora_rank + qk_rope_head_dim = %d must be a multiple of 8 and at most %d", path,
                       c->head_dim, KN_MAX_ATTN_DIM);
    /* YaRN's factor on cos and sin is not applied by the rope kernels;
     * DeepSeek-V3 and Kimi-K2 make it 1 (mscale = mscale_all_dim). */
    if (hc->rope_scaling.kind == HFCFG_ROPE_YARN && fabs(hc->rope_scaling.attention_factor - 1.0) > 1e-12)
        return err_set(err, "%s: yarn's cos/sin factor %g (from mscale %g, mscale_all_dim %g) is not supported: only 1",
                       path, hc->rope_scaling.attention_factor, hc->rope_scaling.mscale,
                       hc->rope_scaling.mscale_all_dim);
    /* The softmax scale of the full query (nope + rope dims), times
     * YaRN's mscale squared where mscale_all_dim is given. */
    double scale = 1.0 / sqrt((double)(c->qk_nope_dim + c->qk_rope_dim));
    double f = hc->rope_scaling.factor, all = hc->rope_scaling.mscale_all_dim;
    if (hc->rope_scaling.kind == HFCFG_ROPE_YARN && all > 0.0 && f > 1.0) {
        double ms = 0.1 * all * log(f) + 1.0;
        scale *= ms * ms;
    }
    c->attn_scale = (float)scale;
    return AE_OK;
}

static int config_gguf(model_config *c, const gguf_file *gf, ae_error *err) {
    (void)gf;
    return err_set(err, "%s: GGUF files of this architecture are not read yet", c->arch);
}

/* ---- tensors ------------------------------------------------------------------ */

/* kv_b_proj's rows regrouped by head into W_UK^T or W_UV (model.h). */
typedef struct kvb_ctx {
    const kn_weight *kvb;
    int32_t n_heads, nope, v, rank;
    bool uk;
} kvb_ctx;

static void fill_kvb(void *ctx, float *dst) {
    const kvb_ctx *k = ctx;
    const int64_t per = k->nope + k->v, R = k->rank;
    float *row = malloc((size_t)R * sizeof *row);
    AE_ASSERT(row);
    for (int32_t h = 0; h < k->n_heads; h++) {
        if (k->uk) { /* dst [h][R][nope] = kv_b[h per + d][c] transposed */
            for (int64_t d = 0; d < k->nope; d++) {
                weights_row_f32(k->kvb, h * per + d, row);
                for (int64_t c = 0; c < R; c++) dst[((int64_t)h * R + c) * k->nope + d] = row[c];
            }
        } else { /* dst [h][v][R] = kv_b[h per + nope + e] */
            for (int64_t e = 0; e < k->v; e++)
                weights_row_f32(k->kvb, h * per + k->nope + e, dst + ((int64_t)h * k->v + e) * R);
        }
    }
    free(row);
}

/* A matrix in the file's type, or compressed-tensors int4 (name is
 * {prefix}.weight or {prefix}.weight_packed). */
static int any_matrix(weights_store *w, const char *prefix, int64_t rows, int64_t cols, kn_weight *out, ae_error *err) {
    char name[256];
    snprintf(name, sizeof name, "%s.weight", prefix);
    if (!weights_has(w, name) && weights_has_int4(w, prefix)) return weights_int4_matrix(w, prefix, rows, cols, out, err);
    return weights_matrix(w, name, rows, cols, out, err);
}

static int load_mla(model *m, model_layer *l, const char *pre, ae_error *err) {
    const model_config *c = &m->cfg;
    weights_store *w = m->w;
    const int64_t H = c->hidden, nh = c->n_heads, R = c->kv_lora_rank, dn = c->qk_nope_dim, dr = c->qk_rope_dim,
                  dv = c->v_head_dim, Q = c->q_lora_rank ? c->q_lora_rank : H;
    char n[256];
#define NAME(s) (snprintf(n, sizeof n, "%sself_attn.%s", pre, s), n)
    kn_weight qb, kva, kvb;
    if (c->q_lora_rank) {
        if (any_matrix(w, NAME("q_a_proj"), Q, H, &l->wq_a, err) ||
            weights_vector(w, NAME("q_a_layernorm.weight"), Q, false, &l->q_a_norm, err) ||
            any_matrix(w, NAME("q_b_proj"), nh * (dn + dr), Q, &qb, err))
            return AE_ERR;
    } else if (any_matrix(w, NAME("q_proj"), nh * (dn + dr), H, &qb, err)) {
        return AE_ERR;
    }
    if (any_matrix(w, NAME("kv_a_proj_with_mqa"), R + dr, H, &kva, err) ||
        weights_vector(w, NAME("kv_a_layernorm.weight"), R, false, &l->kv_a_norm, err) ||
        any_matrix(w, NAME("kv_b_proj"), nh * (dn + dv), R, &kvb, err) ||
        any_matrix(w, NAME("o_proj"), H, nh * dv, &l->wo, err))
        return AE_ERR;
#undef NAME
    /* q_b's rows head by head: nope then rope; regrouped so that all
     * heads' nope rows, then all heads' rope rows, are one matrix each. */
    int64_t *rows = malloc((size_t)nh * (size_t)(dn + dr) * sizeof *rows);
    if (!rows) return err_set(err, "out of memory");
    for (int64_t h = 0; h < nh; h++) {
        for (int64_t d = 0; d < dn; d++) rows[h * dn + d] = h * (dn + dr) + d;
        for (int64_t d = 0; d < dr; d++) rows[nh * dn + h * dr + d] = h * (dn + dr) + dn + d;
    }
    int rc = weights_pick_rows(w, &qb, nh * dn, rows, &l->wq_nope, err) ||
             weights_pick_rows(w, &qb, nh * dr, rows + nh * dn, &l->wq_pe, err);
    free(rows);
    if (rc) return AE_ERR;
    /* kv_a's first R rows make the latent, its last dr the shared k_pe. */
    l->wkv_a = kva;
    l->wkv_a.rows = R;
    l->wk_pe = kva;
    l->wk_pe.rows = dr;
    l->wk_pe.data = (const char *)kva.data + (size_t)R * kva.row_bytes;
    kvb_ctx uk = {&kvb, c->n_heads, c->qk_nope_dim, c->v_head_dim, c->kv_lora_rank, true}, uv = uk;
    uv.uk = false;
    return weights_f32(w, nh * R, dn, fill_kvb, &uk, &l->w_uk, err) ||
           weights_f32(w, nh * dv, R, fill_kvb, &uv, &l->w_uv, err);
}

static int load_ffn(model *m, model_layer *l, int32_t i, const char *pre, ae_error *err) {
    const model_config *c = &m->cfg;
    weights_store *w = m->w;
    const int64_t H = c->hidden, E = c->route.n_experts;
    char n[256];
    if (i < c->n_dense_layers) {
        l->ffn = MODEL_FFN_DENSE;
        const char *names[3] = {"gate_proj", "up_proj", "down_proj"};
        kn_weight *dst[3] = {&l->w_gate, &l->w_up, &l->w_down};
        for (int j = 0; j < 3; j++) {
            snprintf(n, sizeof n, "%smlp.%s", pre, names[j]);
            if (any_matrix(w, n, j == 2 ? H : c->ffn, j == 2 ? c->ffn : H, dst[j], err)) return AE_ERR;
        }
        return AE_OK;
    }
    l->ffn = MODEL_FFN_MOE;
    snprintf(n, sizeof n, "%smlp.gate.weight", pre);
    if (weights_matrix(w, n, E, H, &l->router, err)) return AE_ERR;
    if (l->router.type != GGML_TYPE_F32 && l->router.type != GGML_TYPE_BF16) /* its logits are f32 */
        return err_set(err, "tensor %s: type %s; the router must be f32 or bf16", n, quant_type_name(l->router.type));
    snprintf(n, sizeof n, "%smlp.gate.e_score_correction_bias", pre);
    if (weights_vector(w, n, E, false, &l->router_bias, err)) return AE_ERR;
    if (!(l->experts = calloc(3 * (size_t)E, sizeof *l->experts))) return err_set(err, "out of memory");
    const char *names[3] = {"gate_proj", "up_proj", "down_proj"};
    for (int64_t e = 0; e < E; e++)
        for (int j = 0; j < 3; j++) {
            snprintf(n, sizeof n, "%smlp.experts.%lld.%s", pre, (long long)e, names[j]);
            if (any_matrix(w, n, j == 2 ? H : c->expert_ffn, j == 2 ? c->expert_ffn : H, &l->experts[j * E + e], err))
                return AE_ERR;
            if (l->experts[j * E + e].type != l->experts[0].type)
                return err_set(err, "tensor %s: type %s, but expert 0's is %s (one type per layer)", n,
                               quant_type_name(l->experts[j * E + e].type), quant_type_name(l->experts[0].type));
        }
    if (!c->shared_ffn) return AE_OK;
    kn_weight *dst[3] = {&l->w_gate, &l->w_up, &l->w_down};
    for (int j = 0; j < 3; j++) {
        snprintf(n, sizeof n, "%smlp.shared_experts.%s", pre, names[j]);
        if (any_matrix(w, n, j == 2 ? H : c->shared_ffn, j == 2 ? c->shared_ffn : H, dst[j], err)) return AE_ERR;
    }
    return AE_OK;
}

static int pack_layer(model *m, model_layer *l, ae_error *err) {
    kn_weight *ws[] = {&l->wq_a, &l->wq_nope, &l->wq_pe, &l->wkv_a, &l->wk_pe, &l->wo, &l->w_gate, &l->w_up, &l->w_down};
    for (size_t j = 0; j < sizeof ws / sizeof ws[0]; j++)
        if (ws[j]->data && weights_pack(m->w, ws[j], err) != AE_OK) return AE_ERR;
    for (int64_t e = 0; l->experts && e < 3 * (int64_t)m->cfg.route.n_experts; e++)
        if (weights_pack(m->w, &l->experts[e], err) != AE_OK) return AE_ERR;
    return AE_OK;
}

static int load(model *m, ae_error *err) {
    model_config *c = &m->cfg;
    if (m->w->gguf) return err_set(err, "GGUF files of this architecture are not read yet");
    if (!kn_backend_supports(m->be, KN_OP_LATENT, GGML_TYPE_F16))
        return err_set(err, "backend %s has no MLA attention yet (%s needs it): run it with --device cpu",
                       kn_backend_name(m->be), c->arch);
    if (arch_load_ends(m, "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", err) != AE_OK)
        return AE_ERR;
    if (!(m->layers = calloc((size_t)c->n_layers, sizeof *m->layers))) return err_set(err, "out of memory");
    for (int32_t i = 0; i < c->n_layers; i++) {
        model_layer *l = &m->layers[i];
        char pre[64];
        snprintf(pre, sizeof pre, "model.layers.%d.", i);
        char n[128];
        l->attn = MODEL_ATTN_MLA;
        snprintf(n, sizeof n, "%sinput_layernorm.weight", pre);
        if (weights_vector(m->w, n, c->hidden, false, &l->attn_norm, err)) return AE_ERR;
        snprintf(n, sizeof n, "%spost_attention_layernorm.weight", pre);
        if (weights_vector(m->w, n, c->hidden, false, &l->ffn_norm, err) || load_mla(m, l, pre, err) ||
            load_ffn(m, l, i, pre, err))
            return AE_ERR;
        if (pack_layer(m, l, err) != AE_OK) return AE_ERR;
    }
    return weights_pack(m->w, &m->output, err);
}

/* ---- the plan ----------------------------------------------------------------- */

/* The latent, keys only: (kv_lora_rank + qk_rope_head_dim) f16 a layer. */
static uint64_t kv_token_bytes(const model_config *c) { return kv_latent_bytes_per_token(c->n_layers, c->head_dim); }

/* In f32, llama.c's buffers for this layout: the residual, the normed
 * input, the block output, the logit row and the shared experts' output
 * (5 H); the absorbed queries and the attention output (2 n_heads
 * (R + dr)); the latent and k_pe (R + 2 dr); q_a (Q); q's nope and rope
 * parts (n_heads (dn + dr)); the values (n_heads dv); gate and up (2
 * max(ffn, shared)); the router's logits and weights and ids (E + 2 k);
 * the experts' scratch; the logits (vocab); RoPE's cos and sin; EAGLE-3's
 * captured features (3 H). */
static uint64_t workspace_per_token(const model_config *c) {
    uint64_t H = (uint64_t)c->hidden, nh = (uint64_t)c->n_heads, D = (uint64_t)c->head_dim,
             dr = (uint64_t)c->qk_rope_dim, F = (uint64_t)(c->ffn > c->shared_ffn ? c->ffn : c->shared_ffn);
    uint64_t floats = 8 * H + 2 * nh * D + D + dr + (uint64_t)c->q_lora_rank +
                      nh * (uint64_t)(c->qk_nope_dim + c->qk_rope_dim + c->v_head_dim) + 2 * F +
                      (uint64_t)c->route.n_experts + 2 * (uint64_t)c->route.top_k +
                      (c->route.n_experts ? kn_moe_scratch(1, c->hidden, c->expert_ffn) : 0) + (uint64_t)c->vocab +
                      (uint64_t)c->head_dim;
    return 4 * floats;
}

static size_t matrix_bytes(const kn_weight *w) {
    return w->data ? (size_t)w->rows * quant_row_bytes(w->type, (uint64_t)w->cols) : 0;
}

/* What one token's decode reads: every attention matrix, the dense or
 * shared FFN, the router, and top_k of the routed experts (an average
 * expert: their sizes are equal), the norms, then the output. */
static size_t decode_bytes(const model *m) {
    const model_config *c = &m->cfg;
    size_t b = 0;
    for (int32_t i = 0; i < c->n_layers; i++) {
        const model_layer *l = &m->layers[i];
        const kn_weight *w[] = {&l->wq_a, &l->wq_nope, &l->wq_pe, &l->wkv_a, &l->wk_pe, &l->w_uk,
                                &l->w_uv, &l->wo,      &l->w_gate, &l->w_up, &l->w_down, &l->router};
        for (size_t j = 0; j < sizeof w / sizeof w[0]; j++) b += matrix_bytes(w[j]);
        if (l->experts)
            for (int j = 0; j < 3; j++) b += (size_t)c->route.top_k * matrix_bytes(&l->experts[j * c->route.n_experts]);
        b += 2 * (size_t)c->hidden * sizeof(float);
    }
    return b + matrix_bytes(&m->output) + (size_t)c->hidden * sizeof(float);
}


/* Each rank computes the latent itself (q_a and kv_a are whole) and its
 * heads' share of the rest; the routers are whole, each expert divided. */
static void params(const model_config *c, arch_params *p) {
    const uint64_t L = (uint64_t)c->n_layers, H = (uint64_t)c->hidden, nh = (uint64_t)c->n_heads,
                   R = (uint64_t)c->kv_lora_rank, Q = (uint64_t)c->q_lora_rank, dn = (uint64_t)c->qk_nope_dim,
                   dr = (uint64_t)c->qk_rope_dim, dv = (uint64_t)c->v_head_dim, E = (uint64_t)c->route.n_experts,
                   moe = L - (uint64_t)c->n_dense_layers;
    *p = (arch_params){0};
    p->whole = L * (Q * H + (R + dr) * H) + moe * E * H;
    p->whole_f32 = L * (2 * H + Q + R) + H + moe * E;
    p->split = L * ((Q ? Q : H) * nh * (dn + dr) + nh * dv * H) +
               3 * H * ((uint64_t)c->n_dense_layers * (uint64_t)c->ffn + moe * (uint64_t)c->shared_ffn);
    p->split_f32 = L * nh * R * (dn + dv); /* W_UK and W_UV, from kv_b_proj */
    p->experts = moe * E * 3 * H * (uint64_t)c->expert_ffn;
    p->embed = (uint64_t)c->vocab * H;
    p->output = c->tied_embeddings ? 0 : (uint64_t)c->vocab * H;
}

const arch arch_deepseek = {
    .name = "deepseek",
    .hf_types = hf_types,
    .gguf_archs = gguf_archs,
    .config_gguf = config_gguf,
    .config_hf = config_hf,
    .load = load,
    .kv_bytes_per_token = kv_token_bytes,
    .workspace_per_token = workspace_per_token,
    .decode_bytes = decode_bytes,
    .tp_split = tp_split_latent,
    .params = params,
    .kv_replicated = true,
};
