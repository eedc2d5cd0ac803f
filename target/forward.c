#include "forward.h"

#include <stdlib.h>
#include <string.h>

struct forward_ws {
    int32_t max_tokens, max_logits;
    float *x;     /* [max_tokens][H] residual stream */
    float *xn;    /* [max_tokens][H] normed input of a block */
    float *q;     /* [max_tokens][n_heads * D] */
    float *k;     /* [max_tokens][n_kv_heads * D] */
    float *v;     /* [max_tokens][n_kv_heads * D] */
    float *attn;  /* [max_tokens][n_heads * D] */
    float *proj;  /* [max_tokens][H] output of o_proj / down_proj */
    float *gate;  /* [max_tokens][F] */
    float *up;    /* [max_tokens][F] */
    float *out_x; /* [max_logits][H] rows whose logits are wanted */
    float *rope;  /* [max_tokens][D] each token's cos and sin, for all layers */
    /* MLA (0 bytes without): with n_kv_heads 1 and D = R + dr, q above
     * holds the absorbed queries, k the latent and v k_pe */
    float *qa;  /* [max_tokens][q_lora_rank] */
    float *qn;  /* [max_tokens][n_heads * qk_nope_dim] */
    float *qpe; /* [max_tokens][n_heads * qk_rope_dim] */
    float *ckv; /* [max_tokens][kv_lora_rank] */
    float *vh;  /* [max_tokens][n_heads * v_head_dim] the heads' values */
    /* MoE (0 bytes without) */
    float *logits; /* [max_tokens][n_experts] the router's */
    float *rw;     /* [max_tokens][top_k] the chosen experts' weights */
    float *ridx;   /* [max_tokens][top_k] their ids, int32 */
    float *shared; /* [max_tokens][H] the shared experts' output */
    float *moe;    /* kn_moe_scratch(max_tokens, H, expert_ffn) */
    kn_buf block;  /* one buffer of the model's backend holding all of the above */
};

static size_t round64(size_t n) { return (n + 63) & ~(size_t)63; }

/* Sizes of the workspace buffers, in floats, in declaration order. */
#define WS_BUFS 21

static void ws_sizes(const model *m, int32_t T, int32_t L, size_t sz[WS_BUFS]) {
    const model_config *c = &m->cfg;
    size_t H = (size_t)c->hidden, F = (size_t)(c->ffn > c->shared_ffn ? c->ffn : c->shared_ffn),
           QD = (size_t)c->n_heads * (size_t)c->head_dim, KD = (size_t)c->n_kv_heads * (size_t)c->head_dim,
           nh = (size_t)c->n_heads, E = (size_t)c->route.n_experts, K = (size_t)c->route.top_k;
    size_t t = (size_t)T;
    size_t v[WS_BUFS] = {t * H,
                         t * H,
                         t * QD,
                         t * KD,
                         t * KD,
                         t * QD,
                         t * H,
                         t * F,
                         t * F,
                         (size_t)L * H,
                         t * (size_t)c->head_dim,
                         t * (size_t)c->q_lora_rank,
                         t * nh * (size_t)c->qk_nope_dim,
                         t * nh * (size_t)c->qk_rope_dim,
                         t * (size_t)c->kv_lora_rank,
                         t * nh * (size_t)c->v_head_dim,
                         t * E,
                         t * K,
                         t * K,
                         E ? t * H : 0,
                         E ? kn_moe_scratch(T, c->hidden, c->expert_ffn) : 0};
    memcpy(sz, v, sizeof v);
}

float *forward_ws_proj(forward_ws *ws) { return ws->proj; }

size_t forward_ws_bytes(const model *m, int32_t max_tokens, int32_t max_logits) {
    size_t sz[WS_BUFS], total = 0;
    ws_sizes(m, max_tokens, max_logits, sz);
    for (int i = 0; i < WS_BUFS; i++) total += round64(sz[i] * sizeof(float));
    return total;
}

size_t forward_stream_workspace(const model *m, int32_t max_tokens, int32_t max_keys) {
    return forward_stream_workspace_cfg(&m->cfg, max_tokens, max_keys);
}

size_t forward_stream_workspace_cfg(const model_config *c, int32_t max_tokens, int32_t max_keys) {
    /* the widest input a matmul reads */
    int64_t widths[] = {c->ffn,        c->hidden,      (int64_t)c->n_heads * c->head_dim,  c->shared_ffn,
                        c->expert_ffn, c->q_lora_rank, (int64_t)c->n_heads * c->v_head_dim};
    int64_t k = 0;
    for (size_t i = 0; i < sizeof widths / sizeof widths[0]; i++) k = widths[i] > k ? widths[i] : k;
    size_t mm = kn_matmul_workspace(max_tokens, k);
    size_t at = max_keys > 0 ? kn_attention_workspace(c->n_heads, c->head_dim, max_keys) : 0;
    return mm > at ? mm : at;
}

int forward_ws_init(forward_ws **out, const model *m, int32_t max_tokens, int32_t max_logits, ae_error *err) {
    *out = NULL;
    if (max_tokens < 1 || max_logits < 1 || max_logits > max_tokens)
        return err_set(err, "workspace: need 1 <= max_logits (%d) <= max_tokens (%d)", max_logits, max_tokens);
    forward_ws *ws = calloc(1, sizeof *ws);
    if (!ws) return err_set(err, "out of memory");
    size_t bytes = forward_ws_bytes(m, max_tokens, max_logits);
    if (kn_buf_alloc(m->be, &ws->block, bytes, err) != AE_OK) {
        free(ws);
        return err_prefix(err, "a %zu-byte workspace: ", bytes), AE_ERR;
    }
    size_t sz[WS_BUFS];
    ws_sizes(m, max_tokens, max_logits, sz);
    float **slots[WS_BUFS] = {&ws->x,    &ws->xn, &ws->q,      &ws->k,    &ws->v,    &ws->attn,   &ws->proj,
                              &ws->gate, &ws->up, &ws->out_x,  &ws->rope, &ws->qa,   &ws->qn,     &ws->qpe,
                              &ws->ckv,  &ws->vh, &ws->logits, &ws->rw,   &ws->ridx, &ws->shared, &ws->moe};
    char *p = ws->block.ptr;
    for (int i = 0; i < WS_BUFS; i++) {
        *slots[i] = (float *)(void *)p;
        p += round64(sz[i] * sizeof(float));
    }
    ws->max_tokens = max_tokens;
    ws->max_logits = max_logits;
    *out = ws;
    return AE_OK;
}

void forward_ws_free(forward_ws *ws) {
    if (!ws) return;
    kn_buf_free(&ws->block);
    free(ws);
}

static void capture_layer(kn_stream *s, const forward_capture *cap, int32_t layer, const float *x, int32_t H) {
    if (!cap) return;
    for (int32_t j = 0; j < cap->n_layers; j++)
        if (cap->layers[j] == layer)
            kn_gather_rows(s, x, cap->rows, cap->n_rows, H, cap->out + (size_t)j * (size_t)H,
                           (int64_t)cap->n_layers * H);
}

/* GQA attention: ws->x in, the output projection in ws->proj (a partial
 * sum over this rank's heads under tensor parallelism). */
static void attn_gqa(const model *m, const model_layer *l, kn_stream *s, const kn_kv_pool *kv, forward_ws *ws,
                     const forward_batch *b, bool normed) {
    const model_config *c = &m->cfg;
    const int32_t T = b->m, H = c->hidden;
    const int64_t QD = (int64_t)c->n_heads * c->head_dim, KD = (int64_t)c->n_kv_heads * c->head_dim;
    if (!normed) kn_rmsnorm(s, ws->x, l->attn_norm, ws->xn, T, H, c->rms_eps);
    kn_matmul_n(s, 3, (const kn_weight *[]){&l->wq, &l->wk, &l->wv}, ws->xn, (float *[]){ws->q, ws->k, ws->v}, T);
    if (l->bq) kn_bias_add(s, ws->q, l->bq, T, QD);
    if (l->bk) kn_bias_add(s, ws->k, l->bk, T, KD);
    if (l->bv) kn_bias_add(s, ws->v, l->bv, T, KD);
    kn_rope_rotate(s, &m->rope, ws->q, T, c->n_heads, ws->rope);
    kn_rope_rotate(s, &m->rope, ws->k, T, c->n_kv_heads, ws->rope);
    kn_kv_write(s, kv, b->map, ws->k, ws->v);
    kn_attention(s, kv, b->map, ws->q, ws->attn, c->n_heads);
    kn_matmul(s, &l->wo, ws->attn, ws->proj, T);
}

/* MLA, absorbed (arch/deepseek.c): ws->x in, the output projection in
 * ws->proj. The cache gets the latent [normed c_kv | roped k_pe]; each
 * head's query is [W_UK^T q_nope | roped q_pe], so its scores against
 * the latent are those of the full keys; its output, the weighted latent,
 * leaves through W_UV. */
static void attn_mla(const model *m, const model_layer *l, kn_stream *s, const kn_kv_pool *pool, forward_ws *ws,
                     const forward_batch *b, bool normed) {
    const model_config *c = &m->cfg;
    const int32_t T = b->m, nh = c->n_heads, R = c->kv_lora_rank, dr = c->qk_rope_dim, D = c->head_dim;
    kn_kv_pool kv = *pool;
    kv.scale = c->attn_scale;
    if (!normed) kn_rmsnorm(s, ws->x, l->attn_norm, ws->xn, T, c->hidden, c->rms_eps);
    if (c->q_lora_rank) {
        kn_matmul_n(s, 3, (const kn_weight *[]){&l->wq_a, &l->wkv_a, &l->wk_pe}, ws->xn,
                    (float *[]){ws->qa, ws->ckv, ws->v}, T);
        kn_rmsnorm(s, ws->qa, l->q_a_norm, ws->qa, T, c->q_lora_rank, 1e-6f);
        kn_matmul_n(s, 2, (const kn_weight *[]){&l->wq_nope, &l->wq_pe}, ws->qa, (float *[]){ws->qn, ws->qpe}, T);
    } else {
        kn_matmul_n(s, 4, (const kn_weight *[]){&l->wq_nope, &l->wq_pe, &l->wkv_a, &l->wk_pe}, ws->xn,
                    (float *[]){ws->qn, ws->qpe, ws->ckv, ws->v}, T);
    }
    kn_rmsnorm(s, ws->ckv, l->kv_a_norm, ws->ckv, T, R, 1e-6f);
    kn_rope_rotate(s, &m->rope, ws->qpe, T, nh, ws->rope);
    kn_rope_rotate(s, &m->rope, ws->v, T, 1, ws->rope);
    kn_gather_rows(s, ws->ckv, NULL, T, R, ws->k, D);
    kn_gather_rows(s, ws->v, NULL, T, dr, ws->k + R, D);
    kn_kv_write(s, &kv, b->map, ws->k, NULL);
    kn_matmul_heads(s, &l->w_uk, nh, ws->qn, c->qk_nope_dim, ws->q, D, T);
    kn_gather_rows(s, ws->qpe, NULL, (int64_t)T * nh, dr, ws->q + R, D);
    kn_attention(s, &kv, b->map, ws->q, ws->attn, nh);
    kn_matmul_heads(s, &l->w_uv, nh, ws->attn, D, ws->vh, c->v_head_dim, T);
    kn_matmul(s, &l->wo, ws->vh, ws->proj, T);
}

/* The routed experts, then the shared ones added (one allreduce takes
 * both under tensor parallelism): ws->xn in (normed), ws->proj out. */
static void ffn_moe(const model *m, const model_layer *l, kn_stream *s, forward_ws *ws, int32_t T) {
    const model_config *c = &m->cfg;
    const int32_t H = c->hidden, E = c->route.n_experts;
    int32_t *idx = (int32_t *)(void *)ws->ridx;
    kn_matmul(s, &l->router, ws->xn, ws->logits, T);
    kn_moe_route(s, ws->logits, l->router_bias, T, &c->route, idx, ws->rw);
    kn_experts ex = {E, l->experts, l->experts + E, l->experts + 2 * E};
    kn_moe_ffn(s, &ex, ws->xn, idx, ws->rw, T, c->route.top_k, ws->moe, ws->proj);
    if (!c->shared_ffn) return;
    kn_matmul_swiglu(s, &l->w_gate, &l->w_up, ws->xn, ws->gate, ws->up, T);
    kn_matmul(s, &l->w_down, ws->gate, ws->shared, T);
    kn_add(s, ws->proj, ws->shared, ws->proj, (int64_t)T * H);
}

/* The dense SwiGLU FFN: ws->x in, the down projection in ws->proj. */
static void ffn_dense(const model *m, const model_layer *l, kn_stream *s, forward_ws *ws, int32_t T, bool normed) {
    const model_config *c = &m->cfg;
    if (!normed) kn_rmsnorm(s, ws->x, l->ffn_norm, ws->xn, T, c->hidden, c->rms_eps);
    kn_matmul_swiglu(s, &l->w_gate, &l->w_up, ws->xn, ws->gate, ws->up, T);
    kn_matmul(s, &l->w_down, ws->gate, ws->proj, T);
}

void forward_pass(const model *m, kn_stream *s, kn_comm *comm, const kn_kv_pool *kv, forward_ws *ws,
                  const forward_batch *b) {
    const model_config *c = &m->cfg;
    const int32_t T = b->m, H = c->hidden;
    AE_ASSERT(T >= 1 && T <= ws->max_tokens);
    AE_ASSERT(b->n_logits >= 0 && b->n_logits <= ws->max_logits);
    AE_ASSERT(b->map && b->map->m == T);
    /* Row indices are read here only where they are host memory; on other
     * backends they are the engine's, checked before it uploaded them. */
    const bool host = kn_backend_host_memory(kn_stream_backend(s));
    const forward_capture *cap = b->capture;
    if (cap) {
        AE_ASSERT(cap->n_layers >= 0 && cap->n_layers <= FORWARD_MAX_CAPTURE);
        for (int32_t r = 0; r < cap->n_rows && host; r++) AE_ASSERT(cap->rows[r] >= 0 && cap->rows[r] < T);
        for (int32_t j = 0; j < cap->n_layers; j++) AE_ASSERT(cap->layers[j] >= 0 && cap->layers[j] <= c->n_layers);
    }

    kn_embed(s, &m->tok_embd, b->tokens, ws->x, T);
    kn_rope_table(s, &m->rope, b->pos, T, ws->rope);
    /* The layer loop every architecture shares: the capture and the
     * allreduce hooks are here, each block's kind picks its ops. Each
     * allreduce adds into the residual stream and makes the next block's
     * norm in the same call (kn_allreduce_add_rmsnorm: one kernel with
     * the custom allreduce, the same three ops otherwise), so a block
     * starts from ws->xn already made. */
    bool normed = false;
    for (int32_t li = 0; li < c->n_layers; li++) {
        const model_layer *l = &m->layers[li];
        capture_layer(s, cap, li, ws->x, H);
        switch (l->attn) {
        case MODEL_ATTN_GQA: attn_gqa(m, l, s, &kv[li], ws, b, normed); break;
        case MODEL_ATTN_MLA: attn_mla(m, l, s, &kv[li], ws, b, normed); break;
        default: AE_ASSERT(!"an attention kind the forward pass does not have");
        }
        kn_allreduce_add_rmsnorm(comm, s, ws->proj, ws->x, l->ffn_norm, ws->xn, T, H, c->rms_eps);
        switch (l->ffn) {
        case MODEL_FFN_DENSE: ffn_dense(m, l, s, ws, T, true); break;
        case MODEL_FFN_MOE: ffn_moe(m, l, s, ws, T); break;
        default: AE_ASSERT(!"an FFN kind the forward pass does not have");
        }
        if (li + 1 < c->n_layers) {
            kn_allreduce_add_rmsnorm(comm, s, ws->proj, ws->x, m->layers[li + 1].attn_norm, ws->xn, T, H, c->rms_eps);
            normed = true;
        } else {
            kn_allreduce_add(comm, s, ws->proj, ws->x, (size_t)T * (size_t)H);
        }
    }
    capture_layer(s, cap, c->n_layers, ws->x, H);
    if (b->n_logits == 0) return;
    for (int32_t r = 0; r < b->n_logits && host; r++) AE_ASSERT(b->logit_rows[r] >= 0 && b->logit_rows[r] < T);
    kn_gather_rows(s, ws->x, b->logit_rows, b->n_logits, H, ws->out_x, H);
    kn_rmsnorm(s, ws->out_x, m->output_norm, ws->out_x, b->n_logits, H, c->rms_eps);
    kn_matmul(s, &m->output, ws->out_x, b->logits, b->n_logits);
}
