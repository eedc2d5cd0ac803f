/* What the model loader relies on once an architecture's reader has taken
 * a config (model_config_gguf, model_config_read: target/model.h), for
 * fuzz_gguf and fuzz_hfconfig: the shape the memory plan and the forward
 * pass divide by, and RoPE numbers that kn_rope_init, the loader's next
 * step, takes as they are. Then the architecture's sums over the config
 * (KV and workspace bytes, parameters, a tensor-parallel split) run under
 * UBSan. */
#ifndef AERIE_TESTS_FUZZ_CONFIG_CHECK_H
#define AERIE_TESTS_FUZZ_CONFIG_CHECK_H

#include <math.h>
#include <stdlib.h>

#include "../../target/arch.h"
#include "../../target/tp.h"

static volatile uint64_t config_sink;

static void check_model_config(const model_config *c, const arch *a) {
    if (!a || c->n_layers < 1 || c->n_layers > MODEL_MAX_LAYERS || c->hidden < 1 || c->ffn < 1 || c->n_heads < 1 ||
        c->n_kv_heads < 1 || c->vocab < 1 || c->n_heads % c->n_kv_heads || c->head_dim < 8 || c->head_dim % 8)
        abort();
    ae_error err = {0};
    kn_rope rope;
    if (kn_rope_init(&rope, &c->rope, &err) != AE_OK) abort();
    for (int i = 0; i < rope.head_dim / 2; i++)
        if (!isfinite(rope.inv_freq[i])) abort();
    if (!isfinite(c->attn_scale) || c->attn_scale < 0.0f) abort();
    if (c->kv_lora_rank > 0) { /* MLA: the latent is the one kv head */
        if (c->head_dim != c->kv_lora_rank + c->qk_rope_dim || c->rope.head_dim != c->qk_rope_dim ||
            c->qk_nope_dim < 1 || c->v_head_dim < 1 || c->n_kv_heads != 1 || c->n_dense_layers > c->n_layers)
            abort();
        const kn_route *r = &c->route;
        if (r->n_experts && (r->top_k < 1 || r->top_k > r->n_experts || r->n_group < 1 || r->n_experts % r->n_group ||
                             c->expert_ffn < 1))
            abort();
    }
    config_sink += a->kv_bytes_per_token(c) + a->workspace_per_token(c);
    arch_params p;
    arch_count_params(a, c, &p);
    config_sink += p.whole + p.split + p.experts + p.embed;
    tp_split sp;
    if (a->tp_split(&sp, c, 2, &err) == AE_OK) config_sink += (uint64_t)sp.heads[1].end;
}

#endif
