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
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../services/core/json.h"
#include "../../services/kv/kv.h"
#include "../arch.h"
#include "../tp.h"

static const char *const hf_types[] = {"deepseek_v3", "kimi_k2", "kimi_k25", NULL};
static const char *const gguf_archs[] = {"deepseek2", NULL};

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

/* The softmax scale: the full query's (nope + rope dims), times YaRN's
 * mscale squared where mscale_all_dim is given (0: none). */
static float attn_scale(const model_config *c, double mscale_all_dim) {
    double scale = 1.0 / sqrt((double)(c->qk_nope_dim + c->qk_rope_dim)), f = c->rope.factor;
    if (c->rope.yarn && mscale_all_dim > 0.0 && f > 1.0) {
        double ms = 0.1 * mscale_all_dim * log(f) + 1.0;
        scale *= ms * ms;
    }
    return (float)scale;
}

static int config_hf(model_config *c, const hfconfig *hc, const char *path, ae_error *err) {
    c->n_layers = hc->num_hidden_layers;
    c->hidden = hc->hidden_size;
    c->ffn = hc->intermediate_size;
    c->n_heads = hc->num_attention_heads;
    c->vocab = hc->vocab_size;
    c->context_length = hc->max_position_embeddings;
    c->rms_eps = (float)hc->rms_norm_eps;
    c->tied_embeddings = hc->tie_word_embeddings; /* the loader then asks the file */
    if (hc->attention_bias) return err_set(err, "%s: attention_bias on a %s model is not supported", path, c->arch);
    c->rope = hfconfig_rope(hc);
    cJSON *root = json_read_file(path, HFCONFIG_MAX_FILE, err);
    if (!root) return AE_ERR;
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
    if (hc->rope_scaling.kind == HFCONFIG_ROPE_YARN && fabs(hc->rope_scaling.attention_factor - 1.0) > 1e-12)
        return err_set(err, "%s: yarn's cos/sin factor %g (from mscale %g, mscale_all_dim %g) is not supported: only 1",
                       path, hc->rope_scaling.attention_factor, hc->rope_scaling.mscale,
                       hc->rope_scaling.mscale_all_dim);
    if (arch_check_rope_hf(c, hc, "qk_rope_head_dim", path, err) != AE_OK) return AE_ERR;
    c->attn_scale = attn_scale(c, hc->rope_scaling.mscale_all_dim);
    return AE_OK;
}

/* llama.cpp's deepseek2 keys (its convert_hf_to_gguf.py's). Files from
 * before MLA's absorbed layout have no key_length_mla: their key and value
 * lengths are then the full query's and a head's values. */
/* GGUF's {a}.{suffix} in lo..hi, or def when absent. */
static int gguf_in(const gguf_file *gf, const char *a, const char *suffix, int64_t lo, int64_t hi, int64_t def,
                   int32_t *out, ae_error *err) {
    int64_t v = arch_gguf_int(gf, a, suffix, def);
    if (v < lo || v > hi)
        return err_set(err, "key %s.%s: %lld is outside %lld..%lld", a, suffix, (long long)v, (long long)lo,
                       (long long)hi);
    *out = (int32_t)v;
    return AE_OK;
}

static int config_gguf(model_config *c, const gguf_file *gf, ae_error *err) {
    const char *a = c->arch;
    const int64_t BIG = 1 << 20;
    int32_t key = 0, value = 0, key_mla = 0, value_mla = 0, shared = 0;
    if (arch_gguf_required(gf, a, "block_count", &c->n_layers, err) ||
        arch_gguf_required(gf, a, "embedding_length", &c->hidden, err) ||
        arch_gguf_required(gf, a, "feed_forward_length", &c->ffn, err) ||
        arch_gguf_required(gf, a, "attention.head_count", &c->n_heads, err) ||
        gguf_in(gf, a, "attention.kv_lora_rank", 1, KN_MAX_ATTN_DIM, -1, &c->kv_lora_rank, err) ||
        gguf_in(gf, a, "rope.dimension_count", 2, KN_MAX_HEAD_DIM, -1, &c->qk_rope_dim, err) ||
        gguf_in(gf, a, "attention.key_length", 1, BIG, -1, &key, err) ||
        gguf_in(gf, a, "attention.value_length", 1, BIG, -1, &value, err) ||
        gguf_in(gf, a, "attention.key_length_mla", 0, BIG, 0, &key_mla, err) ||
        gguf_in(gf, a, "attention.value_length_mla", 0, BIG, 0, &value_mla, err) ||
        gguf_in(gf, a, "attention.q_lora_rank", 0, BIG, 0, &c->q_lora_rank, err))
        return AE_ERR;
    c->qk_nope_dim = (key_mla > 0 ? key_mla : key) - c->qk_rope_dim;
    c->v_head_dim = value_mla > 0 ? value_mla : value;
    if (c->qk_nope_dim < 1)
        return err_set(err, "%s: key length %d leaves no nope dims beside %d rope dims", a, key_mla > 0 ? key_mla : key,
                       c->qk_rope_dim);
    int64_t ctx = arch_gguf_int(gf, a, "context_length", 4096);
    if (ctx < 1 || ctx > INT32_MAX)
        return err_set(err, "key %s.context_length: %lld is outside 1..%d", a, (long long)ctx, INT32_MAX);
    c->context_length = (int32_t)ctx;
    char k[192];
    float f;
    bool b;
    gguf_str str;
    snprintf(k, sizeof k, "%s.attention.layer_norm_rms_epsilon", a);
    c->rms_eps = gguf_get_f32(gf, k, &f, NULL) == AE_OK ? f : 1e-6f;
    /* experts */
    kn_route *r = &c->route;
    if (gguf_in(gf, a, "expert_count", 0, KN_MAX_EXPERTS, 0, &r->n_experts, err) ||
        gguf_in(gf, a, "expert_used_count", 0, KN_MAX_ACTIVE_EXPERTS, 0, &r->top_k, err) ||
        gguf_in(gf, a, "expert_group_count", 1, KN_MAX_EXPERT_GROUPS, 1, &r->n_group, err) ||
        gguf_in(gf, a, "expert_group_used_count", 1, KN_MAX_EXPERT_GROUPS, 1, &r->topk_group, err) ||
        gguf_in(gf, a, "expert_feed_forward_length", 0, BIG, 0, &c->expert_ffn, err) ||
        gguf_in(gf, a, "expert_shared_count", 0, 64, 0, &shared, err) ||
        gguf_in(gf, a, "leading_dense_block_count", 0, c->n_layers, 0, &c->n_dense_layers, err))
        return AE_ERR;
    if (r->n_experts == 0) c->n_dense_layers = c->n_layers; /* no experts: every layer dense */
    snprintf(k, sizeof k, "%s.expert_weights_scale", a);
    r->scale = gguf_get_f32(gf, k, &f, NULL) == AE_OK ? f : 1.0f;
    snprintf(k, sizeof k, "%s.expert_weights_norm", a);
    r->norm = gguf_get_bool(gf, k, &b, NULL) == AE_OK && b;
    c->shared_ffn = shared * c->expert_ffn;
    /* 2 is sigmoid; DeepSeek-V2's softmax (1, or no key and no bias) is not read */
    int64_t gating = arch_gguf_int(gf, a, "expert_gating_func", 0);
    snprintf(k, sizeof k, "blk.%d.exp_probs_b.bias", c->n_dense_layers);
    if (r->n_experts && (gating == 1 || gating > 2 || (gating == 0 && !gguf_find_tensor(gf, k))))
        return err_set(err,
                       "%s: expert_gating_func %lld: only sigmoid routing with a correction bias (DeepSeek-V3's) "
                       "is supported",
                       a, (long long)gating);
    if (r->n_experts && (r->top_k < 1 || r->n_experts % r->n_group || r->topk_group > r->n_group ||
                         (r->n_group > 1 && r->n_experts / r->n_group < 2) || c->expert_ffn < 1 ||
                         r->top_k > r->topk_group * (r->n_experts / r->n_group)))
        return err_set(err,
                       "%s: %d experts (%d used, groups %d/%d, width %d) after %d dense layers do not make a "
                       "mixture this reader runs",
                       a, r->n_experts, r->top_k, r->topk_group, r->n_group, c->expert_ffn, c->n_dense_layers);
    /* rope: interleaved pairs, as the file's rows are */
    double theta, log_mul = 0.0;
    if (arch_gguf_num(gf, a, "rope.freq_base", 10000.0, &theta, err)) return AE_ERR;
    c->rope = (kn_rope_config){KN_ROPE_ADJACENT, c->qk_rope_dim, theta, 0, 0, 0, 0, false, 0, 0};
    snprintf(k, sizeof k, "%s.rope.scaling.type", a);
    if (gguf_get_str(gf, k, &str, NULL) == AE_OK && gguf_str_eq(str, "yarn")) {
        int64_t orig;
        c->rope.yarn = true;
        if (arch_gguf_num(gf, a, "rope.scaling.factor", 1.0, &c->rope.factor, err) ||
            arch_gguf_int_key(gf, a, "rope.scaling.original_context_length", ctx, &orig, err) ||
            arch_gguf_num(gf, a, "rope.scaling.yarn_beta_fast", 32.0, &c->rope.beta_fast, err) ||
            arch_gguf_num(gf, a, "rope.scaling.yarn_beta_slow", 1.0, &c->rope.beta_slow, err) ||
            arch_gguf_num(gf, a, "rope.scaling.yarn_log_multiplier", 0.0, &log_mul, err))
            return AE_ERR;
        c->rope.original_max_pos = (double)orig;
        /* llama.cpp writes 0.1 x mscale_all_dim (and takes the cos/sin
         * factor as 1, mscale = mscale_all_dim); config.json's bound on
         * mscale_all_dim is 1e6 */
        if (!(log_mul >= 0.0 && log_mul <= 1e5))
            return err_set(err, "key %s.rope.scaling.yarn_log_multiplier: %g is outside [0, 100000]", a, log_mul);
    } else if (gguf_get_str(gf, k, &str, NULL) == AE_OK && !gguf_str_eq(str, "none")) {
        return err_set(err, "key %s: only yarn (or none) is supported", k);
    }
    snprintf(k, sizeof k, "key %s.", a);
    arch_rope_keys keys = {k,        "rope.freq_base",          "rope.dimension_count", "rope.scaling.",
                           "factor", "original_context_length", "yarn_beta_fast",       "yarn_beta_slow"};
    if (arch_check_rope(&c->rope, &keys, err) != AE_OK) return AE_ERR;
    const gguf_tensor *emb = gguf_find_tensor(gf, "token_embd.weight");
    if (!emb || emb->n_dims != 2 || emb->ne[1] > INT32_MAX)
        return err_set(err, "tensor token_embd.weight is missing or not 2-D");
    c->vocab = (int32_t)emb->ne[1];
    c->n_kv_heads = 1;
    c->head_dim = c->kv_lora_rank + c->qk_rope_dim;
    if (c->head_dim % 8 || c->head_dim > KN_MAX_ATTN_DIM)
        return err_set(err, "%s: kv_lora_rank + rope dims = %d must be a multiple of 8 and at most %d", a, c->head_dim,
                       KN_MAX_ATTN_DIM);
    c->attn_scale = attn_scale(c, log_mul / 0.1);
    return AE_OK;
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

/* What the made tensors are made from (arch_tensor.at of ARCH_SRC). */
enum { SRC_Q, SRC_KV_A, SRC_KV_B, SRC_K_B, SRC_V_B };

/* A layer's tensors, in the order they are read (arch.h); matrices by the
 * prefix of their names (ARCH_READ_ANY). The made ones sit where they are
 * packed. llama.cpp's files have W_UK and W_UV apart (attn_k_b, attn_v_b)
 * in current files, kv_b whole (attn_kv_b) in older ones, and the experts
 * stacked. */
#define F(field) offsetof(model_layer, field)
#define ONE {ARCH_ONE, ARCH_ONE}
#define D(n) {ARCH_##n, ARCH_ONE}
#define HD(unit) {ARCH_HEADS, ARCH_##unit}
static const arch_tensor tensors[] = {
    /* name, GGUF, Hugging Face, block, held, read, split, flags, field or source, rows, cols */
    {"attn_norm", "attn_norm.weight", "input_layernorm.weight", ARCH_EVERY, ARCH_VEC, ARCH_READ_VECTOR, ARCH_WHOLE, 0,
     F(attn_norm), D(HIDDEN), ONE},
    {"ffn_norm", "ffn_norm.weight", "post_attention_layernorm.weight", ARCH_EVERY, ARCH_VEC, ARCH_READ_VECTOR,
     ARCH_WHOLE, 0, F(ffn_norm), D(HIDDEN), ONE},
    /* MLA: the query, through a low rank or straight from the input */
    {"q_a", "attn_q_a", "self_attn.q_a_proj", ARCH_MLA, ARCH_MAT, ARCH_READ_ANY, ARCH_WHOLE, ARCH_PACK | ARCH_Q_LORA,
     F(wq_a), D(Q_RANK), D(HIDDEN)},
    {"q_a_norm", "attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight", ARCH_MLA, ARCH_VEC, ARCH_READ_VECTOR,
     ARCH_WHOLE, ARCH_Q_LORA, F(q_a_norm), D(Q_RANK), ONE},
    {"q_b", "attn_q_b", "self_attn.q_b_proj", ARCH_MLA, ARCH_SRC, ARCH_READ_ANY, ARCH_WHOLE, ARCH_Q_LORA, SRC_Q,
     HD(Q_HEAD_DIM), D(Q_RANK)},
    {"q", "attn_q", "self_attn.q_proj", ARCH_MLA, ARCH_SRC, ARCH_READ_ANY, ARCH_WHOLE, ARCH_NO_Q_LORA, SRC_Q,
     HD(Q_HEAD_DIM), D(Q_RANK)},
    {"q_nope", NULL, NULL, ARCH_MLA, ARCH_MAT, ARCH_MADE, ARCH_ROWS, ARCH_PACK, F(wq_nope), HD(NOPE_DIM), D(Q_RANK)},
    {"q_pe", NULL, NULL, ARCH_MLA, ARCH_MAT, ARCH_MADE, ARCH_ROWS, ARCH_PACK, F(wq_pe), HD(ROPE_DIM), D(Q_RANK)},
    /* the latent and the shared k_pe */
    {"kv_a", "attn_kv_a_mqa", "self_attn.kv_a_proj_with_mqa", ARCH_MLA, ARCH_SRC, ARCH_READ_ANY, ARCH_WHOLE, 0,
     SRC_KV_A, D(LATENT_DIM), D(HIDDEN)},
    {"kv_a latent", NULL, NULL, ARCH_MLA, ARCH_MAT, ARCH_MADE, ARCH_WHOLE, ARCH_PACK, F(wkv_a), D(KV_RANK), D(HIDDEN)},
    {"k_pe", NULL, NULL, ARCH_MLA, ARCH_MAT, ARCH_MADE, ARCH_WHOLE, ARCH_PACK, F(wk_pe), D(ROPE_DIM), D(HIDDEN)},
    {"kv_a_norm", "attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight", ARCH_MLA, ARCH_VEC, ARCH_READ_VECTOR,
     ARCH_WHOLE, 0, F(kv_a_norm), D(KV_RANK), ONE},
    {"attn_output", "attn_output", "self_attn.o_proj", ARCH_MLA, ARCH_MAT, ARCH_READ_ANY, ARCH_COLS, ARCH_PACK, F(wo),
     D(HIDDEN), HD(V_DIM)},
    /* W_UK transposed and W_UV, head by head: from the split tensors where
     * the file has them, else cut from kv_b */
    {"k_b", "attn_k_b.weight", NULL, ARCH_MLA, ARCH_SRC, ARCH_READ_HEADS, ARCH_WHOLE, ARCH_IF_PRESENT, SRC_K_B,
     HD(KV_RANK), D(NOPE_DIM)},
    {"v_b", "attn_v_b.weight", NULL, ARCH_MLA, ARCH_SRC, ARCH_READ_HEADS, ARCH_WHOLE, ARCH_IF_HAD, SRC_V_B, HD(V_DIM),
     D(KV_RANK)},
    {"kv_b", "attn_kv_b", "self_attn.kv_b_proj", ARCH_MLA, ARCH_SRC, ARCH_READ_ANY, ARCH_WHOLE, ARCH_IF_NOT_HAD,
     SRC_KV_B, HD(KV_HEAD_DIM), D(KV_RANK)},
    {"w_uk", NULL, NULL, ARCH_MLA, ARCH_MAT, ARCH_MADE, ARCH_ROWS, ARCH_F32, F(w_uk), HD(KV_RANK), D(NOPE_DIM)},
    {"w_uv", NULL, NULL, ARCH_MLA, ARCH_MAT, ARCH_MADE, ARCH_ROWS, ARCH_F32, F(w_uv), HD(V_DIM), D(KV_RANK)},
    /* the first layers' dense SwiGLU */
    {"ffn_gate", "ffn_gate", "mlp.gate_proj", ARCH_DENSE, ARCH_MAT, ARCH_READ_ANY, ARCH_ROWS, ARCH_PACK, F(w_gate),
     D(FFN), D(HIDDEN)},
    {"ffn_up", "ffn_up", "mlp.up_proj", ARCH_DENSE, ARCH_MAT, ARCH_READ_ANY, ARCH_ROWS, ARCH_PACK, F(w_up), D(FFN),
     D(HIDDEN)},
    {"ffn_down", "ffn_down", "mlp.down_proj", ARCH_DENSE, ARCH_MAT, ARCH_READ_ANY, ARCH_COLS, ARCH_PACK, F(w_down),
     D(HIDDEN), D(FFN)},
    /* the mixture: the router whole, each expert divided */
    {"router", "ffn_gate_inp.weight", "mlp.gate.weight", ARCH_MOE, ARCH_MAT, ARCH_READ_MATRIX, ARCH_WHOLE, ARCH_ROUTER,
     F(router), D(EXPERTS), D(HIDDEN)},
    {"router bias", "exp_probs_b.bias", "mlp.gate.e_score_correction_bias", ARCH_MOE, ARCH_VEC, ARCH_READ_VECTOR,
     ARCH_WHOLE, 0, F(router_bias), D(EXPERTS), ONE},
    {"expert gate_proj", "ffn_gate_exps.weight", "mlp.experts.%d.gate_proj", ARCH_MOE, ARCH_EXPERT, ARCH_READ_ANY,
     ARCH_ROWS, ARCH_PACK, 0, D(EXPERT_FFN), D(HIDDEN)},
    {"expert up_proj", "ffn_up_exps.weight", "mlp.experts.%d.up_proj", ARCH_MOE, ARCH_EXPERT, ARCH_READ_ANY, ARCH_ROWS,
     ARCH_PACK, 1, D(EXPERT_FFN), D(HIDDEN)},
    {"expert down_proj", "ffn_down_exps.weight", "mlp.experts.%d.down_proj", ARCH_MOE, ARCH_EXPERT, ARCH_READ_ANY,
     ARCH_COLS, ARCH_PACK, 2, D(HIDDEN), D(EXPERT_FFN)},
    {"shared_experts.gate_proj", "ffn_gate_shexp", "mlp.shared_experts.gate_proj", ARCH_MOE, ARCH_MAT, ARCH_READ_ANY,
     ARCH_ROWS, ARCH_PACK | ARCH_SHARED, F(w_gate), D(SHARED_FFN), D(HIDDEN)},
    {"shared_experts.up_proj", "ffn_up_shexp", "mlp.shared_experts.up_proj", ARCH_MOE, ARCH_MAT, ARCH_READ_ANY,
     ARCH_ROWS, ARCH_PACK | ARCH_SHARED, F(w_up), D(SHARED_FFN), D(HIDDEN)},
    {"shared_experts.down_proj", "ffn_down_shexp", "mlp.shared_experts.down_proj", ARCH_MOE, ARCH_MAT, ARCH_READ_ANY,
     ARCH_COLS, ARCH_PACK | ARCH_SHARED, F(w_down), D(HIDDEN), D(SHARED_FFN)},
};
#undef F
#undef ONE
#undef D
#undef HD

/* Any matrix as f32 (MLA's per-head ones, which kn_matmul_heads reads). */
static void fill_rows(void *ctx, float *dst) {
    const kn_weight *m = ctx;
    for (int64_t i = 0; i < m->rows; i++) weights_row_f32(m, i, dst + i * m->cols);
}

/* The layer's made tensors: W_UK^T and W_UV in f32 from k_b and v_b, or
 * cut from kv_b; q's rows regrouped into nope and rope; kv_a cut into the
 * latent's rows and k_pe's. */
static int make(model *m, model_layer *l, const kn_weight *src, ae_error *err) {
    const model_config *c = &m->cfg;
    weights_store *w = m->w;
    const int64_t nh = c->n_heads, R = c->kv_lora_rank, dn = c->qk_nope_dim, dr = c->qk_rope_dim, dv = c->v_head_dim;
    if (src[SRC_K_B].data) {
        kn_weight kb = src[SRC_K_B], vb = src[SRC_V_B];
        if (weights_f32(w, nh * R, dn, fill_rows, &kb, &l->w_uk, err) ||
            weights_f32(w, nh * dv, R, fill_rows, &vb, &l->w_uv, err))
            return AE_ERR;
    } else {
        kvb_ctx uk = {&src[SRC_KV_B], c->n_heads, c->qk_nope_dim, c->v_head_dim, c->kv_lora_rank, true}, uv = uk;
        uv.uk = false;
        if (weights_f32(w, nh * R, dn, fill_kvb, &uk, &l->w_uk, err) ||
            weights_f32(w, nh * dv, R, fill_kvb, &uv, &l->w_uv, err))
            return AE_ERR;
    }
    /* q_b's rows head by head: nope then rope; regrouped so that all
     * heads' nope rows, then all heads' rope rows, are one matrix each. */
    int64_t *rows = malloc((size_t)nh * (size_t)(dn + dr) * sizeof *rows);
    if (!rows) return err_set(err, "out of memory");
    for (int64_t h = 0; h < nh; h++) {
        for (int64_t d = 0; d < dn; d++) rows[h * dn + d] = h * (dn + dr) + d;
        for (int64_t d = 0; d < dr; d++) rows[nh * dn + h * dr + d] = h * (dn + dr) + dn + d;
    }
    int rc = weights_pick_rows(w, &src[SRC_Q], nh * dn, rows, &l->wq_nope, err) ||
             weights_pick_rows(w, &src[SRC_Q], nh * dr, rows + nh * dn, &l->wq_pe, err);
    free(rows);
    if (rc) return AE_ERR;
    /* kv_a's first R rows make the latent, its last dr the shared k_pe. */
    const kn_weight *kva = &src[SRC_KV_A];
    l->wkv_a = *kva;
    l->wkv_a.rows = R;
    l->wk_pe = *kva;
    l->wk_pe.rows = dr;
    l->wk_pe.data = (const char *)kva->data + (size_t)R * kva->row_bytes;
    return AE_OK;
}

static int load(model *m, ae_error *err) {
    if (!kn_backend_supports(m->be, KN_OP_LATENT, GGML_TYPE_F16))
        return err_set(err, "backend %s has no MLA attention yet (%s needs it): run it with --device cpu",
                       kn_backend_name(m->be), m->cfg.arch);
    return arch_load_tensors(m, err);
}

/* ---- the plan ----------------------------------------------------------------- */

/* The latent, keys only: (kv_lora_rank + qk_rope_head_dim) f16 a layer. */
static uint64_t kv_token_bytes(const model_config *c) { return kv_latent_bytes_per_token(c->n_layers, c->head_dim); }

/* In f32, llama.c's buffers for this layout (ws_sizes), per token: the
 * residual, the normed input, the block output, the logit row and the
 * shared experts' output (5 H); the absorbed queries and the attention
 * output (2 n_heads D, D = R + dr); the latent and k_pe (2 D, the k and
 * v buffers); RoPE's cos and sin (D); q_a (Q); q's nope and rope parts
 * and the values (n_heads (dn + dr + dv)); the latent before it is
 * placed (R); gate and up (2 max(ffn, shared)); the router's logits,
 * weights and ids (E + 2 k); the experts' scratch; then the logits
 * (vocab) and EAGLE-3's captured features (3 H). */
static uint64_t workspace_per_token(const model_config *c) {
    uint64_t H = (uint64_t)c->hidden, nh = (uint64_t)c->n_heads, D = (uint64_t)c->head_dim,
             F = (uint64_t)(c->ffn > c->shared_ffn ? c->ffn : c->shared_ffn);
    uint64_t floats = 5 * H + 2 * nh * D + 2 * D + D + (uint64_t)c->q_lora_rank +
                      nh * (uint64_t)(c->qk_nope_dim + c->qk_rope_dim + c->v_head_dim) + (uint64_t)c->kv_lora_rank +
                      2 * F + (uint64_t)c->route.n_experts + 2 * (uint64_t)c->route.top_k +
                      (c->route.n_experts ? kn_moe_scratch(1, c->hidden, c->expert_ffn) : 0) + (uint64_t)c->vocab +
                      3 * H;
    return 4 * floats;
}

const arch arch_deepseek = {
    .name = "deepseek",
    .hf_types = hf_types,
    .gguf_archs = gguf_archs,
    .config_gguf = config_gguf,
    .config_hf = config_hf,
    .load = load,
    .tensors = tensors,
    .n_tensors = sizeof tensors / sizeof tensors[0],
    .attn = MODEL_ATTN_MLA,
    .make = make,
    .kv_bytes_per_token = kv_token_bytes,
    .workspace_per_token = workspace_per_token,
    .tp_split = tp_split_latent,
    .kv_replicated = true,
};
