/* The architecture table (target/arch.h): which files each architecture
 * reads, what it refuses with, and what it states about a model: its KV
 * and workspace bytes per token, the bytes a decode step reads, its
 * tensor-parallel split, and its layers' block kinds. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "../../services/core/json.h"
#include "../../services/model/quant.h"
#include "../../target/arch.h"
#include "../../target/tp.h"
#include "gguf_writer.h"

#define MODEL_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static void llama_reads_llama_and_qwen2_from_both_formats(void **state) {
    (void)state;
    ae_error err = {0};
    assert_ptr_equal(arch_for_gguf("llama", &err), &arch_llama);
    assert_ptr_equal(arch_for_gguf("qwen2", &err), &arch_llama);
    assert_ptr_equal(arch_for_hf("llama", &err), &arch_llama);
    assert_ptr_equal(arch_for_hf("qwen2", &err), &arch_llama);
    assert_string_equal(arch_llama.name, "llama");
    assert_ptr_equal(arch_for_hf("deepseek_v3", &err), &arch_deepseek);
    assert_ptr_equal(arch_for_hf("kimi_k2", &err), &arch_deepseek);
    assert_ptr_equal(arch_for_hf("kimi_k25", &err), &arch_deepseek);
    assert_ptr_equal(arch_for_gguf("deepseek2", &err), &arch_deepseek);
}

static void an_unknown_architecture_is_refused_with_the_known_ones(void **state) {
    (void)state;
    ae_error e1 = {0}, e2 = {0}, e3 = {0}; /* an error keeps its first message */
    assert_null(arch_for_gguf("grok", &e1));
    assert_string_equal(e1.msg, "architecture \"grok\" is not supported (llama, qwen2, deepseek2)");
    assert_null(arch_for_hf("mixtral", &e2));
    assert_string_equal(e2.msg,
                        "model_type \"mixtral\" is not supported (llama, qwen2, deepseek_v3, kimi_k2, kimi_k25)");
    assert_null(arch_for_gguf("", &e3));
    assert_string_equal(e3.msg, "architecture \"\" is not supported (llama, qwen2, deepseek2)");
}

static void the_default_model_states_its_kv_split_and_blocks(void **state) {
    (void)state;
    model *m;
    ae_error err = {0};
    if (model_load(&m, MODEL_PATH, &kn_backend_cpu, &err) != AE_OK) fail_msg("%s (run `make model`)", err.msg);
    assert_ptr_equal(m->arch, &arch_llama);
    /* SmolLM2-135M: f16 K and V of 30 layers x 3 kv heads x 64 */
    assert_int_equal(m->arch->kv_bytes_per_token(&m->cfg), 2 * 30 * 3 * 64 * 2);
    /* 4 B x (7 x 576 + 2 x (9 + 3) x 64 + 2 x 1536 + 49152 + 64) */
    assert_int_equal(m->arch->workspace_per_token(&m->cfg), 231424);
    /* A decode step reads every matrix's bytes in the file, row by row,
     * and the f32 norms. */
    size_t want = 0;
    for (int32_t i = 0; i < m->cfg.n_layers; i++) {
        const model_layer *l = &m->layers[i];
        assert_int_equal(l->attn, MODEL_ATTN_GQA);
        assert_int_equal(l->ffn, MODEL_FFN_DENSE);
        const kn_weight *w[7] = {&l->wq, &l->wk, &l->wv, &l->wo, &l->w_gate, &l->w_up, &l->w_down};
        for (int j = 0; j < 7; j++) want += (size_t)w[j]->rows * w[j]->row_bytes;
        want += 2 * 576 * sizeof(float);
    }
    want += (size_t)m->output.rows * m->output.row_bytes + 576 * sizeof(float);
    assert_int_equal(model_decode_bytes(m), want);
    tp_split sp;
    assert_int_equal(m->arch->tp_split(&sp, &m->cfg, 3, &err), AE_OK);
    for (int r = 0; r < 3; r++) {
        assert_int_equal(sp.kv_heads[r].begin, r);
        assert_int_equal(sp.kv_heads[r].end, r + 1);
        assert_int_equal(sp.heads[r].begin, 3 * r);
        assert_int_equal(sp.heads[r].end, 3 * r + 3);
    }
    assert_int_equal(sp.ffn[0].begin, 0);
    assert_int_equal(sp.ffn[2].end, 1536);
    assert_int_equal(m->arch->tp_split(&sp, &m->cfg, 4, &err), AE_ERR);
    assert_string_equal(err.msg, "tensor parallel: 4 ranks but only 3 kv heads; at most 3 ranks");
    model_free(m);
}

/* ---- a layer's tensors: one table that loading and tensor parallelism walk ---- */

/* A table entry as a model holds it: its shape, and how rank `rank` of a
 * split holds it (whole, or rows or columns [begin, begin + n)). */
typedef struct held {
    const char *name;
    int64_t rows, cols;
    arch_shard shard;
    int64_t begin, n;
} held;

/* SmolLM2-135M (hidden 576, 9 heads and 3 kv heads of 64, ffn 1536, no
 * biases), rank 1 of 3: kv head 1 and q heads 3..5, ffn [512, 1024). */
static const held LLAMA_HELD[] = {
    {"attn_norm", 576, 1, ARCH_WHOLE, 0, 0},      {"ffn_norm", 576, 1, ARCH_WHOLE, 0, 0},
    {"attn_q", 576, 576, ARCH_ROWS, 192, 192},    {"attn_k", 192, 576, ARCH_ROWS, 64, 64},
    {"attn_v", 192, 576, ARCH_ROWS, 64, 64},      {"attn_output", 576, 576, ARCH_COLS, 192, 192},
    {"ffn_gate", 1536, 576, ARCH_ROWS, 512, 512}, {"ffn_up", 1536, 576, ARCH_ROWS, 512, 512},
    {"ffn_down", 576, 1536, ARCH_COLS, 512, 512}, {"attn_q.bias", 576, 1, ARCH_ROWS, 192, 192},
    {"attn_k.bias", 192, 1, ARCH_ROWS, 64, 64},   {"attn_v.bias", 192, 1, ARCH_ROWS, 64, 64},
};

/* The tiny DeepSeek-V3 (hidden 64, 4 heads, q_lora_rank 32, kv_lora_rank
 * 32, nope, rope and v dims 16, ffn 128, 8 experts and a shared one of
 * 64), rank 1 of 2: heads 2..3, half of each FFN. Its sources (q_b, kv_a,
 * kv_b) are read, not held. */
static const held DEEPSEEK_HELD[] = {
    {"attn_norm", 64, 1, ARCH_WHOLE, 0, 0},
    {"ffn_norm", 64, 1, ARCH_WHOLE, 0, 0},
    {"q_a", 32, 64, ARCH_WHOLE, 0, 0},
    {"q_a_norm", 32, 1, ARCH_WHOLE, 0, 0},
    {"q_nope", 64, 32, ARCH_ROWS, 32, 32},
    {"q_pe", 64, 32, ARCH_ROWS, 32, 32},
    {"kv_a latent", 32, 64, ARCH_WHOLE, 0, 0},
    {"k_pe", 16, 64, ARCH_WHOLE, 0, 0},
    {"kv_a_norm", 32, 1, ARCH_WHOLE, 0, 0},
    {"attn_output", 64, 64, ARCH_COLS, 32, 32},
    {"w_uk", 128, 16, ARCH_ROWS, 64, 64},
    {"w_uv", 64, 32, ARCH_ROWS, 32, 32},
    {"ffn_gate", 128, 64, ARCH_ROWS, 64, 64},
    {"ffn_up", 128, 64, ARCH_ROWS, 64, 64},
    {"ffn_down", 64, 128, ARCH_COLS, 64, 64},
    {"router", 8, 64, ARCH_WHOLE, 0, 0},
    {"router bias", 8, 1, ARCH_WHOLE, 0, 0},
    {"expert gate_proj", 64, 64, ARCH_ROWS, 32, 32},
    {"expert up_proj", 64, 64, ARCH_ROWS, 32, 32},
    {"expert down_proj", 64, 64, ARCH_COLS, 32, 32},
    {"shared_experts.gate_proj", 64, 64, ARCH_ROWS, 32, 32},
    {"shared_experts.up_proj", 64, 64, ARCH_ROWS, 32, 32},
    {"shared_experts.down_proj", 64, 64, ARCH_COLS, 32, 32},
};

/* A loaded matrix f of h's shape, and s its share as h says. */
static void assert_matrix_share(const kn_weight *s, const kn_weight *f, const held *h) {
    assert_non_null(f->data);
    assert_int_equal(f->rows, h->rows);
    assert_int_equal(f->cols, h->cols);
    assert_int_equal(s->type, f->type);
    assert_int_equal(s->row_bytes, f->row_bytes);
    const char *fd = f->data, *sd = s->data;
    switch (h->shard) {
    case ARCH_WHOLE: assert_true(sd == fd && s->rows == f->rows && s->cols == f->cols); break;
    case ARCH_ROWS:
        assert_true(sd == fd + h->begin * (int64_t)f->row_bytes && s->rows == h->n && s->cols == f->cols);
        break;
    case ARCH_COLS:
        assert_true(sd == fd + quant_row_bytes(f->type, (uint64_t)h->begin) && s->rows == f->rows && s->cols == h->n);
        break;
    }
}

/* Every entry of m's table that a layer holds, in m and in its shard s:
 * the table says its shape and split (as want lists them, sources left
 * out), the model holds it with that shape, the shard as its split says.
 * Returns the tensors checked, each routed expert one. */
static int check_table(const model *m, const model *s, const held *want, size_t n_want) {
    const arch *a = m->arch;
    const model_config *c = &m->cfg;
    int checked = 0;
    for (int32_t li = 0; li < c->n_layers; li++) {
        size_t j = 0;
        for (size_t k = 0; k < a->n_tensors; k++) {
            const arch_tensor *t = &a->tensors[k];
            if (t->held == ARCH_SRC) continue;
            assert_true(j < n_want);
            const held *h = &want[j++];
            assert_string_equal(t->name, h->name);
            assert_int_equal(arch_dim_value(c, t->rows), h->rows);
            assert_int_equal(arch_dim_value(c, t->cols), h->cols);
            assert_int_equal(t->shard, h->shard);
            if (!arch_layer_has(c, &m->layers[li], t)) continue;
            const model_layer *fl = &m->layers[li], *sl = &s->layers[li];
            if (t->held == ARCH_VEC) {
                const float *fv = *(const float *const *)arch_field_const(fl, t),
                            *sv = *(const float *const *)arch_field_const(sl, t);
                assert_ptr_equal(sv, fv && h->shard == ARCH_ROWS ? fv + h->begin : fv);
            } else if (t->held == ARCH_MAT) {
                assert_matrix_share(arch_field_const(sl, t), arch_field_const(fl, t), h);
            } else {
                for (int32_t e = 0; e < c->route.n_experts; e++, checked++) {
                    int64_t i = (int64_t)t->at * c->route.n_experts + e;
                    assert_matrix_share(&sl->experts[i], &fl->experts[i], h);
                }
                continue;
            }
            checked++;
        }
        assert_int_equal(j, n_want);
    }
    return checked;
}

static model *shard_of(const model *m, int32_t R, int32_t rank) {
    tp_split sp;
    model *s;
    ae_error err = {0};
    if (m->arch->tp_split(&sp, &m->cfg, R, &err) != AE_OK || tp_shard_init(&s, m, &sp, rank, &err) != AE_OK)
        fail_msg("%s", err.msg);
    return s;
}

static void every_entry_of_the_tables_is_loaded_and_sharded(void **state) {
    (void)state;
    model *m;
    ae_error err = {0};
    if (model_load(&m, MODEL_PATH, &kn_backend_cpu, &err) != AE_OK) fail_msg("%s", err.msg);
    assert_int_equal(arch_llama.n_tensors, 12);
    model *s = shard_of(m, 3, 1);
    /* 30 layers x 12: SmolLM2 has no biases, NULL in the model and its shard */
    assert_int_equal(check_table(m, s, LLAMA_HELD, sizeof LLAMA_HELD / sizeof LLAMA_HELD[0]), 30 * 12);
    for (int32_t li = 0; li < 30; li++) assert_null(m->layers[li].bq);
    tp_shard_free(s);
    model_free(m);

    if (model_load(&m, "tests/golden/tiny/deepseek", &kn_backend_cpu, &err) != AE_OK) fail_msg("%s", err.msg);
    assert_int_equal(arch_deepseek.n_tensors, 29); /* 23 held, 6 sources */
    s = shard_of(m, 2, 1);
    /* the dense layer: 15 (12 of MLA and the norms, 3 of the FFN); the
     * two MoE layers: 12 and the router, its bias, 3 x 8 experts' and 3
     * shared ones' */
    assert_int_equal(check_table(m, s, DEEPSEEK_HELD, sizeof DEEPSEEK_HELD / sizeof DEEPSEEK_HELD[0]),
                     15 + 2 * (12 + 2 + 24 + 3));
    tp_shard_free(s);
    model_free(m);
}

/* The parameters by where tensor parallelism puts them, counted from the
 * tables: SmolLM2's 2 norms a layer and the final one, its 7 matrices a
 * layer divided, its tied embeddings; the tiny DeepSeek-V3's q_a and kv_a
 * (the latent) and the routers whole, W_UK and W_UV divided in f32. */
static void the_tables_count_the_parameters(void **state) {
    (void)state;
    model *m;
    ae_error err = {0};
    arch_params p;
    if (model_load(&m, MODEL_PATH, &kn_backend_cpu, &err) != AE_OK) fail_msg("%s", err.msg);
    arch_count_params(m->arch, &m->cfg, &p);
    assert_int_equal(p.whole, 0);
    assert_int_equal(p.whole_f32, 30 * 2 * 576 + 576);
    assert_int_equal(p.split, 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536));
    assert_int_equal(p.split_f32, 0);
    assert_int_equal(p.experts, 0);
    assert_int_equal(p.embed, 49152 * 576);
    assert_int_equal(p.output, 0);
    model_free(m);
    if (model_load(&m, "tests/golden/tiny/deepseek", &kn_backend_cpu, &err) != AE_OK) fail_msg("%s", err.msg);
    arch_count_params(m->arch, &m->cfg, &p);
    assert_int_equal(p.whole, 3 * (32 * 64 + 48 * 64) + 2 * 8 * 64);
    assert_int_equal(p.whole_f32, 3 * (2 * 64 + 32 + 32) + 64 + 2 * 8);
    assert_int_equal(p.split, 3 * (32 * 4 * 32 + 64 * 4 * 16) + 3 * 64 * (128 + 2 * 64));
    assert_int_equal(p.split_f32, 3 * 4 * 32 * (16 + 16));
    assert_int_equal(p.experts, 2 * 8 * 3 * 64 * 64);
    assert_int_equal(p.embed, 256 * 64);
    assert_int_equal(p.output, 256 * 64);
    model_free(m);
}

/* The default model read with arch a's table (model_load reads it with
 * llama's); NULL with err set where it fails. */
static model *load_as(const arch *a, ae_error *err) {
    model *m = calloc(1, sizeof *m);
    const arch *file;
    assert_non_null(m);
    m->be = &kn_backend_cpu;
    if (weights_open(&m->w, MODEL_PATH, m->be, err) != AE_OK ||
        model_config_gguf(&m->cfg, &file, m->w->gguf, err) != AE_OK)
        fail_msg("%s", err->msg);
    assert_ptr_equal(file, &arch_llama);
    m->arch = a;
    if (a->load(m, err) != AE_OK) {
        model_free(m);
        return NULL;
    }
    return m;
}

/* Llama's table with attn_v left out and one entry added: ffn_up's tensor
 * again, into the field wq_a, split as ffn_up is. Loading reads the new
 * one and not attn_v; the shard, the bytes a decode step reads and the
 * bytes by type follow. An entry whose tensor the file lacks is the
 * error, in the table's order. */
static void a_tensor_added_to_the_table_is_read_and_sharded(void **state) {
    (void)state;
    arch_tensor edited[16];
    size_t n = 0;
    for (size_t k = 0; k < arch_llama.n_tensors; k++)
        if (strcmp(arch_llama.tensors[k].name, "attn_v")) edited[n++] = arch_llama.tensors[k];
    assert_int_equal(n, 11);
    edited[n++] = (arch_tensor){"again",
                                "ffn_up.weight",
                                "mlp.up_proj.weight",
                                ARCH_GQA,
                                ARCH_MAT,
                                ARCH_READ_MATRIX,
                                ARCH_ROWS,
                                0,
                                offsetof(model_layer, wq_a),
                                {ARCH_FFN, ARCH_ONE},
                                {ARCH_HIDDEN, ARCH_ONE}};
    arch a = arch_llama;
    a.tensors = edited;
    a.n_tensors = n;
    ae_error err = {0};
    model *m = load_as(&a, &err);
    if (!m) fail_msg("%s", err.msg);
    for (int32_t li = 0; li < 30; li++) {
        const model_layer *l = &m->layers[li];
        assert_null(l->wv.data);
        assert_int_equal(l->wv.rows, 0);
        assert_ptr_equal(l->wq_a.data, l->w_up.data);
        assert_int_equal(l->wq_a.type, GGML_TYPE_Q4_1);
        assert_int_equal(l->wq_a.rows, 1536);
        assert_int_equal(l->wq_a.cols, 576);
    }
    /* Q4_1 rows of 576 are 360 bytes: 30 layers' 1536 rows in, 192 out */
    assert_int_equal(model_decode_bytes(m), 96576768 + 30 * (1536 - 192) * 360);
    uint64_t bytes[GGML_TYPE_COUNT_MAX], experts;
    model_bytes_by_type(m, bytes, &experts);
    assert_int_equal(bytes[GGML_TYPE_Q4_1], 66355200 + 30 * (1536 - 192) * 360);
    assert_int_equal(bytes[GGML_TYPE_Q8_0], 30081024);
    model *s = shard_of(m, 3, 1);
    for (int32_t li = 0; li < 30; li++) {
        const model_layer *l = &s->layers[li], *f = &m->layers[li];
        assert_null(l->wv.data);
        assert_int_equal(l->wq_a.rows, 512);
        assert_int_equal(l->wq_a.cols, 576);
        assert_ptr_equal(l->wq_a.data, (const char *)f->wq_a.data + 512 * 360);
    }
    /* a plain rank 1 of 3 reads 52339968 bytes: a third of each layer's
     * matrices, its norms, the whole output projection and its norm */
    assert_int_equal(s->weight_bytes, 52339968 + 30 * (512 - 64) * 360);
    /* and the plan's count of divided parameters (106168320 plain) */
    arch_params p;
    arch_count_params(&a, &m->cfg, &p);
    assert_int_equal(p.split, 106168320 + 30 * (1536 - 192) * 576);
    tp_shard_free(s);
    model_free(m);

    /* one it lacks, read after the norms */
    arch_tensor lacking[16] = {arch_llama.tensors[0],
                               arch_llama.tensors[1],
                               {"attn_gate",
                                "attn_gate.weight",
                                "self_attn.gate_proj.weight",
                                ARCH_GQA,
                                ARCH_MAT,
                                ARCH_READ_MATRIX,
                                ARCH_ROWS,
                                0,
                                offsetof(model_layer, wq_a),
                                {ARCH_FFN, ARCH_ONE},
                                {ARCH_HIDDEN, ARCH_ONE}}};
    for (size_t k = 2; k < arch_llama.n_tensors; k++) lacking[k + 1] = arch_llama.tensors[k];
    a.tensors = lacking;
    a.n_tensors = arch_llama.n_tensors + 1;
    assert_null(load_as(&a, &err));
    assert_string_equal(err.msg, "tensor blk.0.attn_gate.weight is missing");
}

/* ---- RoPE and YaRN numbers: refused where they are read ---------------------- */

/* A GGUF key and its value; type UINT32_MAX: leave the key out. */
typedef struct kv {
    const char *key;
    uint32_t type; /* GGUF's: 4 u32, 5 i32, 6 f32, 8 string, 10 u64, 12 f64 */
    double num;
    const char *str;
} kv;

#define OMIT UINT32_MAX

/* The keys llama.cpp's converter writes for the tiny DeepSeek-V3
 * (tests/golden/tiny/deepseek.gguf), less the experts and the tokenizer. */
static const kv DS_KEYS[] = {
    {"general.architecture", 8, 0, "deepseek2"},
    {"deepseek2.block_count", 4, 3, NULL},
    {"deepseek2.context_length", 4, 256, NULL},
    {"deepseek2.embedding_length", 4, 64, NULL},
    {"deepseek2.feed_forward_length", 4, 128, NULL},
    {"deepseek2.attention.head_count", 4, 4, NULL},
    {"deepseek2.attention.q_lora_rank", 4, 32, NULL},
    {"deepseek2.attention.kv_lora_rank", 4, 32, NULL},
    {"deepseek2.attention.key_length", 4, 48, NULL},
    {"deepseek2.attention.value_length", 4, 32, NULL},
    {"deepseek2.attention.key_length_mla", 4, 32, NULL},
    {"deepseek2.attention.value_length_mla", 4, 16, NULL},
    {"deepseek2.rope.dimension_count", 4, 16, NULL},
    {"deepseek2.rope.freq_base", 6, 10000, NULL},
    {"deepseek2.rope.scaling.type", 8, 0, "yarn"},
    {"deepseek2.rope.scaling.factor", 6, 4, NULL},
    {"deepseek2.rope.scaling.original_context_length", 4, 64, NULL},
    {"deepseek2.rope.scaling.yarn_beta_fast", 6, 32, NULL},
    {"deepseek2.rope.scaling.yarn_beta_slow", 6, 1, NULL},
    {"deepseek2.rope.scaling.yarn_log_multiplier", 6, 0.1, NULL},
};

/* SmolLM2's shape, as a llama GGUF. */
static const kv LLAMA_KEYS[] = {
    {"general.architecture", 8, 0, "llama"},    {"llama.block_count", 4, 2, NULL},
    {"llama.embedding_length", 4, 64, NULL},    {"llama.feed_forward_length", 4, 128, NULL},
    {"llama.attention.head_count", 4, 4, NULL}, {"llama.attention.head_count_kv", 4, 2, NULL},
    {"llama.rope.freq_base", 6, 100000, NULL},
};

static void put_kv(gw *w, const kv *e) {
    gw_key(w, e->key, e->type);
    switch (e->type) {
    case 4: gw_u32(w, (uint32_t)e->num); break;
    case 5: gw_u32(w, (uint32_t)(int32_t)e->num); break;
    case 6: gw_f32(w, (float)e->num); break;
    case 8: gw_str(w, e->str); break;
    case 10: gw_u64(w, (uint64_t)e->num); break;
    case 12: gw_f64(w, e->num); break;
    default: fail_msg("put_kv: type %u", e->type);
    }
}

/* The architecture's config from a GGUF of keys (each of over replacing
 * the key of its name, or added), and a token_embd.weight of [64][8] f32. */
static int gguf_config(const kv *keys, size_t n_keys, const kv *over, size_t n_over, model_config *c, ae_error *err) {
    gw w = {0};
    uint64_t n_kv = 0;
    bool used[8] = {0};
    assert_true(n_over <= 8);
    for (int pass = 0; pass < 2; pass++) { /* count, then write */
        if (pass) gw_header(&w, 3, 1, n_kv);
        for (size_t i = 0; i < n_keys; i++) {
            const kv *e = &keys[i];
            for (size_t j = 0; j < n_over; j++)
                if (!strcmp(over[j].key, e->key)) e = &over[j], used[j] = true;
            if (e->type == OMIT) continue;
            if (pass)
                put_kv(&w, e);
            else
                n_kv++;
        }
        for (size_t j = 0; j < n_over; j++)
            if (!used[j] && over[j].type != OMIT) {
                if (pass)
                    put_kv(&w, &over[j]);
                else
                    n_kv++;
            }
    }
    gw_tensor(&w, "token_embd.weight", 2, (uint64_t[]){64, 8}, 0, 0);
    gw_pad(&w, 32);
    for (int i = 0; i < 64 * 8; i++) gw_f32(&w, 0.25f);
    gguf_file *f = NULL;
    ae_error open_err = {0};
    if (gguf_open_mem(&f, w.p, w.len, "t.gguf", &open_err) != AE_OK) fail_msg("%s", open_err.msg);
    memset(c, 0, sizeof *c);
    snprintf(c->arch, sizeof c->arch, "%s", keys[0].str);
    const arch *a = arch_for_gguf(c->arch, err);
    assert_non_null(a);
    int rc = a->config_gguf(c, f, err);
    gguf_close(f);
    gw_free(&w);
    return rc;
}

/* One refused value: the config must fail with exactly want. Each value
 * that does not is printed and counted in misses, so that a test shows
 * all of them; it fails at its end if there were any. */
static int misses;

static void refused(const kv *keys, size_t n_keys, kv over, const char *want) {
    model_config c;
    ae_error err = {0};
    int rc = gguf_config(keys, n_keys, &over, 1, &c, &err);
    char value[64];
    const char *type = over.type == 4    ? "u32"
                       : over.type == 5  ? "i32"
                       : over.type == 6  ? "f32"
                       : over.type == 10 ? "u64"
                       : over.type == 12 ? "f64"
                                         : "string";
    if (over.str)
        snprintf(value, sizeof value, "\"%s\" (%s)", over.str, type);
    else
        snprintf(value, sizeof value, "%g (%s)", over.num, type);
    if (rc == AE_OK) {
        print_message("taken: %s = %s\n", over.key, value);
        misses++;
    } else if (strcmp(err.msg, want)) {
        print_message("%s = %s: \"%s\", expected \"%s\"\n", over.key, value, err.msg, want);
        misses++;
    }
}

#define DS(over, want) refused(DS_KEYS, sizeof DS_KEYS / sizeof DS_KEYS[0], over, want)

static void deepseek2_gguf_rope_and_yarn_are_read(void **state) {
    (void)state;
    model_config c;
    ae_error err = {0};
    assert_int_equal(gguf_config(DS_KEYS, sizeof DS_KEYS / sizeof DS_KEYS[0], NULL, 0, &c, &err), AE_OK);
    assert_true(c.rope.yarn && c.rope.theta == 10000.0 && c.rope.factor == 4.0 && c.rope.original_max_pos == 64.0);
    assert_true(c.rope.beta_fast == 32.0 && c.rope.beta_slow == 1.0);
    assert_int_equal(c.rope.head_dim, 16);
    assert_int_equal(c.head_dim, 48);
    /* 1 / sqrt(32) x (0.1 x 1 x ln 4 + 1)^2: mscale_all_dim 1 */
    double ms = 0.1 * log(4.0) + 1.0;
    assert_float_equal(c.attn_scale, (float)(1.0 / sqrt(32.0) * ms * ms), 1e-7);
    /* No yarn: the factor and the rest are not read. */
    kv plain[2] = {{"deepseek2.rope.scaling.type", OMIT, 0, NULL}, {"deepseek2.rope.scaling.factor", 6, 0.5, NULL}};
    assert_int_equal(gguf_config(DS_KEYS, sizeof DS_KEYS / sizeof DS_KEYS[0], plain, 2, &c, &err), AE_OK);
    assert_false(c.rope.yarn);
}

static void deepseek2_gguf_refuses_rope_numbers_out_of_range(void **state) {
    (void)state;
    misses = 0;
    const char *theta = "key deepseek2.rope.freq_base: ";
    char want[256];
#define WANT(prefix, rest) (snprintf(want, sizeof want, "%s%s", prefix, rest), want)
    DS(((kv){"deepseek2.rope.freq_base", 6, NAN, NULL}), WANT(theta, "nan is outside (0, 1e+12]"));
    DS(((kv){"deepseek2.rope.freq_base", 6, -1, NULL}), WANT(theta, "-1 is outside (0, 1e+12]"));
    DS(((kv){"deepseek2.rope.freq_base", 6, 0, NULL}), WANT(theta, "0 is outside (0, 1e+12]"));
    DS(((kv){"deepseek2.rope.freq_base", 6, INFINITY, NULL}), WANT(theta, "inf is outside (0, 1e+12]"));
    DS(((kv){"deepseek2.rope.freq_base", 6, 1e13, NULL}), WANT(theta, "1e+13 is outside (0, 1e+12]"));
    /* YaRN's band divides by ln(base). */
    DS(((kv){"deepseek2.rope.freq_base", 6, 1, NULL}),
       WANT(theta, "1 is not above 1, as yarn needs (its band divides by its log)"));
    DS(((kv){"deepseek2.rope.freq_base", 8, 0, "10000"}),
       "key deepseek2.rope.freq_base: has type string, expected f32 or f64");
    /* RoPE turns pairs of dims: 33 + 15 = 48 passes the latent's width check. */
    kv odd[3] = {{"deepseek2.rope.dimension_count", 4, 15, NULL},
                 {"deepseek2.attention.kv_lora_rank", 4, 33, NULL},
                 {"deepseek2.attention.key_length_mla", 4, 31, NULL}};
    model_config c;
    ae_error err = {0};
    if (gguf_config(DS_KEYS, sizeof DS_KEYS / sizeof DS_KEYS[0], odd, 3, &c, &err) == AE_OK) {
        print_message("taken: deepseek2.rope.dimension_count = 15\n");
        misses++;
    } else {
        assert_string_equal(err.msg, "key deepseek2.rope.dimension_count: 15 is not an even number in 2..256");
    }
    assert_int_equal(misses, 0);
}

static void deepseek2_gguf_refuses_yarn_numbers_out_of_range(void **state) {
    (void)state;
    misses = 0;
    DS(((kv){"deepseek2.rope.scaling.factor", 6, 0.5, NULL}),
       "key deepseek2.rope.scaling.factor: 0.5 is outside [1, 1e+06]");
    DS(((kv){"deepseek2.rope.scaling.factor", 6, NAN, NULL}),
       "key deepseek2.rope.scaling.factor: nan is outside [1, 1e+06]");
    DS(((kv){"deepseek2.rope.scaling.factor", 6, INFINITY, NULL}),
       "key deepseek2.rope.scaling.factor: inf is outside [1, 1e+06]");
    DS(((kv){"deepseek2.rope.scaling.factor", 6, 0, NULL}),
       "key deepseek2.rope.scaling.factor: 0 is outside [1, 1e+06]");
    DS(((kv){"deepseek2.rope.scaling.original_context_length", 4, 0, NULL}),
       "key deepseek2.rope.scaling.original_context_length: 0 is outside 1..1073741824");
    DS(((kv){"deepseek2.rope.scaling.original_context_length", 5, -64, NULL}),
       "key deepseek2.rope.scaling.original_context_length: -64 is outside 1..1073741824");
    DS(((kv){"deepseek2.rope.scaling.original_context_length", 10, 4294967296.0, NULL}),
       "key deepseek2.rope.scaling.original_context_length: 4294967296 is outside 1..1073741824");
    DS(((kv){"deepseek2.rope.scaling.original_context_length", 6, 64, NULL}),
       "key deepseek2.rope.scaling.original_context_length: has type f32, expected an integer");
    DS(((kv){"deepseek2.rope.scaling.yarn_beta_fast", 6, 0, NULL}),
       "key deepseek2.rope.scaling.yarn_beta_fast: 0 is outside (0, 1e+06]");
    DS(((kv){"deepseek2.rope.scaling.yarn_beta_fast", 6, NAN, NULL}),
       "key deepseek2.rope.scaling.yarn_beta_fast: nan is outside (0, 1e+06]");
    DS(((kv){"deepseek2.rope.scaling.yarn_beta_slow", 6, -1, NULL}),
       "key deepseek2.rope.scaling.yarn_beta_slow: -1 is outside (0, 1e+06]");
    DS(((kv){"deepseek2.rope.scaling.yarn_beta_slow", 6, INFINITY, NULL}),
       "key deepseek2.rope.scaling.yarn_beta_slow: inf is outside (0, 1e+06]");
    /* The band runs from beta_fast's dims to beta_slow's: reversed, the
     * kept and the interpolated dims would swap. */
    DS(((kv){"deepseek2.rope.scaling.yarn_beta_slow", 6, 64, NULL}),
       "key deepseek2.rope.scaling.yarn_beta_fast: 32 is below rope.scaling.yarn_beta_slow's 64");
    /* 0.1 x mscale_all_dim */
    DS(((kv){"deepseek2.rope.scaling.yarn_log_multiplier", 6, -0.1, NULL}),
       "key deepseek2.rope.scaling.yarn_log_multiplier: -0.1 is outside [0, 100000]");
    DS(((kv){"deepseek2.rope.scaling.yarn_log_multiplier", 6, NAN, NULL}),
       "key deepseek2.rope.scaling.yarn_log_multiplier: nan is outside [0, 100000]");
    DS(((kv){"deepseek2.rope.scaling.yarn_log_multiplier", 6, INFINITY, NULL}),
       "key deepseek2.rope.scaling.yarn_log_multiplier: inf is outside [0, 100000]");
    assert_int_equal(misses, 0);
}

static void llama_gguf_refuses_a_bad_rope_base_too(void **state) {
    (void)state;
    misses = 0;
    model_config c;
    ae_error err = {0};
    assert_int_equal(gguf_config(LLAMA_KEYS, sizeof LLAMA_KEYS / sizeof LLAMA_KEYS[0], NULL, 0, &c, &err), AE_OK);
    assert_true(c.rope.theta == 100000.0 && !c.rope.yarn);
    assert_int_equal(c.rope.head_dim, 16);
    refused(LLAMA_KEYS, sizeof LLAMA_KEYS / sizeof LLAMA_KEYS[0], (kv){"llama.rope.freq_base", 6, 0, NULL},
            "key llama.rope.freq_base: 0 is outside (0, 1e+12]");
    refused(LLAMA_KEYS, sizeof LLAMA_KEYS / sizeof LLAMA_KEYS[0], (kv){"llama.rope.freq_base", 6, NAN, NULL},
            "key llama.rope.freq_base: nan is outside (0, 1e+12]");
    refused(LLAMA_KEYS, sizeof LLAMA_KEYS / sizeof LLAMA_KEYS[0], (kv){"llama.rope.freq_base", 12, INFINITY, NULL},
            "key llama.rope.freq_base: inf is outside (0, 1e+12]");
    refused(LLAMA_KEYS, sizeof LLAMA_KEYS / sizeof LLAMA_KEYS[0], (kv){"llama.rope.freq_base", 4, 10000, NULL},
            "key llama.rope.freq_base: has type u32, expected f32 or f64");
    assert_int_equal(misses, 0);
}

/* The tiny DeepSeek-V3's config.json with one change, read as a model's
 * config; the error's text after the path. */
static int hf_config(void (*edit)(cJSON *root), char *msg, size_t cap) {
    ae_error err = {0};
    cJSON *root = json_read_file("tests/golden/tiny/deepseek/config.json", 1 << 20, &err);
    if (!root) fail_msg("%s", err.msg);
    edit(root);
    char dir[] = "/tmp/aerie-arch-XXXXXX", path[64];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/config.json", dir);
    char *text = cJSON_Print(root);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    free(text);
    cJSON_Delete(root);
    model_config c;
    const arch *a;
    hfconfig hc;
    int rc = model_config_read(&c, &a, &hc, path, &err);
    size_t n = strlen(path);
    snprintf(msg, cap, "%s", rc == AE_OK ? "" : strncmp(err.msg, path, n) == 0 ? err.msg + n : err.msg);
    unlink(path);
    rmdir(dir);
    return rc;
}

static void keep(cJSON *root) { (void)root; }
static void theta_1(cJSON *root) {
    cJSON_ReplaceItemInObject(cJSON_GetObjectItem(root, "rope_parameters"), "rope_theta", cJSON_CreateNumber(1));
}
static void betas_swapped(cJSON *root) {
    cJSON *rp = cJSON_GetObjectItem(root, "rope_parameters");
    cJSON_ReplaceItemInObject(rp, "beta_fast", cJSON_CreateNumber(1));
    cJSON_ReplaceItemInObject(rp, "beta_slow", cJSON_CreateNumber(32));
}
static void odd_rope_dims(cJSON *root) { /* 33 + 15 = 48: the latent's width passes */
    cJSON_ReplaceItemInObject(root, "qk_rope_head_dim", cJSON_CreateNumber(15));
    cJSON_ReplaceItemInObject(root, "kv_lora_rank", cJSON_CreateNumber(33));
}

static void deepseek_config_json_refuses_the_same_rope_numbers(void **state) {
    (void)state;
    char msg[512];
    assert_int_equal(hf_config(keep, msg, sizeof msg), AE_OK);
    static const struct {
        const char *what;
        void (*edit)(cJSON *root);
        const char *want;
    } cases[] = {
        {"rope_theta 1", theta_1,
         ": rope_parameters.rope_theta: 1 is not above 1, as yarn needs (its band divides by its log)"},
        {"beta_fast 1, beta_slow 32", betas_swapped,
         ": rope_parameters.beta_fast: 1 is below rope_parameters.beta_slow's 32"},
        {"qk_rope_head_dim 15", odd_rope_dims, ": qk_rope_head_dim: 15 is not an even number in 2..256"},
    };
    misses = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (hf_config(cases[i].edit, msg, sizeof msg) == AE_OK) {
            print_message("taken: %s\n", cases[i].what);
            misses++;
        } else if (strcmp(msg, cases[i].want)) {
            print_message("%s: \"%s\", expected \"%s\"\n", cases[i].what, msg, cases[i].want);
            misses++;
        }
    }
    assert_int_equal(misses, 0);
}

int main(void) {
    if (access(MODEL_PATH, R_OK) != 0) {
        fprintf(stderr, "%s is missing: run `make model`\n", MODEL_PATH);
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(llama_reads_llama_and_qwen2_from_both_formats),
        cmocka_unit_test(an_unknown_architecture_is_refused_with_the_known_ones),
        cmocka_unit_test(the_default_model_states_its_kv_split_and_blocks),
        cmocka_unit_test(every_entry_of_the_tables_is_loaded_and_sharded),
        cmocka_unit_test(the_tables_count_the_parameters),
        cmocka_unit_test(a_tensor_added_to_the_table_is_read_and_sharded),
        cmocka_unit_test(deepseek2_gguf_rope_and_yarn_are_read),
        cmocka_unit_test(deepseek2_gguf_refuses_rope_numbers_out_of_range),
        cmocka_unit_test(deepseek2_gguf_refuses_yarn_numbers_out_of_range),
        cmocka_unit_test(llama_gguf_refuses_a_bad_rope_base_too),
        cmocka_unit_test(deepseek_config_json_refuses_the_same_rope_numbers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
