/* The backend seam (kernels/backend.h) with a backend whose memory is not
 * the host's. "staged" runs the CPU backend's ops, but its buffers have
 * addresses the host cannot use: each is the real address with bit 62
 * set, which no x86-64 load or store accepts. Its ops and copies take the
 * bit off again, after checking it is there. So on staged:
 *   - every pointer an op is given (weights, norms, KV pools, block
 *     tables, every array of a step's map, positions, ids, activations)
 *     must be a staged buffer's, or the wrapper fails the test;
 *   - anything that reads or writes a staged buffer on the host instead
 *     of through an op, upload or download faults;
 *   - every weight is copied at load, the engine's inputs and the KV
 *     block tables go through uploads, and logits and features come back
 *     by download, as on a GPU.
 * The engine on it must give the CPU backend's bits, step for step, and
 * the draft head drafts the CPU's trees (tests/draft_rounds.h). Run from
 * the repo root. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "../../kernels/backend.h"
#include "../../target/engine.h"
#include "../../target/sample.h"
#include "../draft_rounds.h"

#define MODEL_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static kn_backend staged;
static model *on_cpu, *on_staged;

/* "The quick brown fox jumps over the lazy dog. 012" in SmolLM2 ids. */
static const int32_t PROMPT[] = {504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 216, 32, 33, 34};
#define N_PROMPT ((int32_t)(sizeof PROMPT / sizeof PROMPT[0]))

/* ---- the staged backend ------------------------------------------------------ */

#define TAG ((uintptr_t)1 << 62)

/* A staged address as the host can use it. */
static void *U(const void *p) {
    assert_true((uintptr_t)p & TAG); /* a host pointer given to a staged op */
    return (void *)((uintptr_t)p & ~TAG);
}
static void *U0(const void *p) { return p ? U(p) : NULL; }

static kn_buf real_buf(const kn_buf *b) {
    kn_buf r = *b;
    r.ptr = U(b->ptr);
    return r;
}

static int st_buf_alloc(kn_buf *b, size_t bytes, ae_error *err) {
    if (kn_backend_cpu.buf_alloc(b, bytes, err) != AE_OK) return AE_ERR;
    b->ptr = (void *)((uintptr_t)b->ptr | TAG);
    return AE_OK;
}
static void st_buf_free(kn_buf *b) {
    kn_buf r = real_buf(b);
    kn_backend_cpu.buf_free(&r);
}
static void st_buf_write(kn_buf *b, size_t off, const void *src, size_t n) {
    kn_buf r = real_buf(b);
    kn_backend_cpu.buf_write(&r, off, src, n);
}
static void st_upload(kn_stream *s, const kn_buf *dst, size_t off, const void *src, size_t n) {
    kn_buf r = real_buf(dst);
    kn_backend_cpu.upload(s, &r, off, src, n);
}
static void st_download(kn_stream *s, void *dst, const kn_buf *src, size_t off, size_t n) {
    kn_buf r = real_buf(src);
    kn_backend_cpu.download(s, dst, &r, off, n);
}

static kn_weight UW(const kn_weight *w) {
    kn_weight r = *w;
    r.data = U(w->data);
    r.packed = U0(w->packed);
    return r;
}
static kn_kv_pool UP(const kn_kv_pool *kv) {
    kn_kv_pool r = *kv;
    r.k = U(kv->k);
    r.v = U(kv->v);
    return r;
}
static kn_kv_map UM(const kn_kv_map *m) {
    kn_kv_map r = *m;
    r.block_tables = U(m->block_tables);
    r.seq = U(m->seq), r.slot = U(m->slot), r.n_prefix = U(m->n_prefix);
    r.extra_start = U(m->extra_start), r.n_extra = U(m->n_extra), r.extra = U(m->extra);
    return r;
}

static void st_matmul_n(kn_stream *s, int n, const kn_weight *const *w, const float *x, float *const *y, int64_t m) {
    kn_weight rw[4];
    const kn_weight *pw[4];
    float *py[4];
    assert_true(n <= 4);
    for (int i = 0; i < n; i++) rw[i] = UW(w[i]), pw[i] = &rw[i], py[i] = U(y[i]);
    kn_backend_cpu.matmul_n(s, n, pw, U(x), py, m);
}
static void st_matmul_swiglu(kn_stream *s, const kn_weight *gate, const kn_weight *up, const float *x, float *y_gate,
                             float *y_up, int64_t m) {
    kn_weight g = UW(gate), u = UW(up);
    kn_backend_cpu.matmul_swiglu(s, &g, &u, U(x), U(y_gate), U(y_up), m);
}
static void st_rmsnorm(kn_stream *s, const float *x, const float *g, float *y, int64_t m, int64_t n, float eps) {
    kn_backend_cpu.rmsnorm(s, U(x), U(g), U(y), m, n, eps);
}
static void st_add(kn_stream *s, const float *a, const float *b, float *y, int64_t count) {
    kn_backend_cpu.add(s, U(a), U(b), U(y), count);
}
static void st_bias_add(kn_stream *s, float *x, const float *bias, int64_t m, int64_t n) {
    kn_backend_cpu.bias_add(s, U(x), U(bias), m, n);
}
static void st_swiglu(kn_stream *s, const float *gate, const float *up, float *y, int64_t count) {
    kn_backend_cpu.swiglu(s, U(gate), U(up), U(y), count);
}
static void st_softmax(kn_stream *s, float *x, int64_t m, int64_t n) { kn_backend_cpu.softmax(s, U(x), m, n); }
static void st_argmax(kn_stream *s, const float *x, int32_t *out, int64_t m, int64_t n) {
    kn_backend_cpu.argmax(s, U(x), U(out), m, n);
}
static void st_topk(kn_stream *s, const float *x, int64_t m, int64_t n, int32_t k, int32_t *idx, float *val) {
    kn_backend_cpu.topk(s, U(x), m, n, k, U(idx), U(val));
}
static void st_embed(kn_stream *s, const kn_weight *table, const int32_t *ids, float *out, int64_t m) {
    kn_weight t = UW(table);
    kn_backend_cpu.embed(s, &t, U(ids), U(out), m);
}
static void st_rope_table(kn_stream *s, const kn_rope *r, const int32_t *pos, int64_t m, float *cs) {
    kn_backend_cpu.rope_table(s, r, U(pos), m, U(cs));
}
static void st_rope_rotate(kn_stream *s, const kn_rope *r, float *x, int64_t m, int32_t n_heads, const float *cs) {
    kn_backend_cpu.rope_rotate(s, r, U(x), m, n_heads, U(cs));
}
static void st_kv_write(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *k, const float *v) {
    kn_kv_pool p = UP(kv);
    kn_kv_map mp = UM(map);
    kn_backend_cpu.kv_write(s, &p, &mp, U(k), U(v));
}
static void st_kv_move(kn_stream *s, const kn_kv_pool *kv, const int32_t *src_rows, const int32_t *dst_rows,
                       int32_t n) {
    kn_kv_pool p = UP(kv);
    kn_backend_cpu.kv_move(s, &p, U(src_rows), U(dst_rows), n);
}
static void st_attention(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *q, float *out,
                         int32_t n_heads) {
    kn_kv_pool p = UP(kv);
    kn_kv_map mp = UM(map);
    kn_backend_cpu.attention(s, &p, &mp, U(q), U(out), n_heads);
}
static void st_gather_rows(kn_stream *s, const float *src, const int32_t *rows, int64_t n, int64_t width, float *dst,
                           int64_t dst_stride) {
    kn_backend_cpu.gather_rows(s, U(src), U0(rows), n, width, U(dst), dst_stride);
}

static void staged_init(void) {
    staged = kn_backend_cpu;
    staged.name = "staged";
    staged.host_memory = false;
    staged.buf_alloc = st_buf_alloc, staged.buf_free = st_buf_free, staged.buf_write = st_buf_write;
    staged.upload = st_upload, staged.download = st_download;
    staged.matmul_n = st_matmul_n, staged.matmul_swiglu = st_matmul_swiglu, staged.rmsnorm = st_rmsnorm;
    staged.add = st_add, staged.bias_add = st_bias_add, staged.swiglu = st_swiglu, staged.softmax = st_softmax;
    staged.argmax = st_argmax, staged.topk = st_topk, staged.embed = st_embed, staged.gather_rows = st_gather_rows;
    staged.rope_table = st_rope_table, staged.rope_rotate = st_rope_rotate;
    staged.kv_write = st_kv_write, staged.kv_move = st_kv_move, staged.attention = st_attention;
}

static int setup(void **state) {
    (void)state;
    staged_init();
    if (access(MODEL_PATH, R_OK) != 0) {
        fprintf(stderr, "%s is missing: run `make model`\n", MODEL_PATH);
        return -1;
    }
    ae_error err = {0};
    if (model_load(&on_cpu, MODEL_PATH, &kn_backend_cpu, &err) != AE_OK ||
        model_load(&on_staged, MODEL_PATH, &staged, &err) != AE_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    model_free(on_cpu);
    model_free(on_staged);
    return 0;
}

/* A host-memory backend borrows host bytes; any other copies them. */
static void test_buffer_from_host_borrows_or_copies(void **state) {
    (void)state;
    int32_t host[5] = {1, 2, 3, 4, 5};
    kn_buf a, b;
    ae_error err = {0};
    assert_int_equal(kn_buf_from_host(&kn_backend_cpu, &a, host, sizeof host, &err), AE_OK);
    assert_ptr_equal(a.ptr, host);
    assert_true(a.borrowed);
    assert_int_equal(kn_buf_from_host(&staged, &b, host, sizeof host, &err), AE_OK);
    assert_ptr_not_equal(U(b.ptr), host);
    assert_false(b.borrowed);
    assert_memory_equal(U(b.ptr), host, sizeof host);
    kn_buf_free(&a); /* must not free the array (ASan) */
    kn_buf_free(&b);
    assert_int_equal(host[4], 5);
    assert_null(a.ptr);
}

/* On the CPU the weights are the mapped file (and the packed copy); on
 * staged each is a copy in its own buffer, byte for byte, unpacked (the
 * packed layout is the CPU kernels'). */
static void test_weights_are_in_the_backends_buffers(void **state) {
    (void)state;
    for (int32_t l = 0; l < on_cpu->cfg.n_layers; l++) {
        const kn_weight *c = &on_cpu->layers[l].wq, *s = &on_staged->layers[l].wq;
        assert_non_null(c->buf);
        assert_true(c->buf->borrowed);
        assert_ptr_equal(c->buf->be, &kn_backend_cpu);
        assert_non_null(c->packed);
        assert_ptr_equal(c->packed_buf->be, &kn_backend_cpu);
        assert_non_null(s->buf);
        assert_ptr_equal(s->buf->be, &staged);
        assert_false(s->buf->borrowed);
        assert_ptr_equal(s->data, s->buf->ptr);
        assert_null(s->packed);
        assert_ptr_not_equal(U(s->data), c->data);
        assert_memory_equal(U(s->data), c->data, (size_t)c->rows * c->row_bytes);
    }
    assert_ptr_equal(on_staged->tok_embd.buf->be, &staged);
    assert_int_equal(on_staged->weight_bytes, on_cpu->weight_bytes);
}

/* The block tables the kernels read are sent on upload, row by row as
 * they change: a sequence's blocks, then -1s once it is freed and its id
 * taken again. */
static void test_kv_tables_reach_the_backend_as_they_change(void **state) {
    (void)state;
    kv_params p = {.n_layers = 1,
                   .n_kv_heads = 1,
                   .head_dim = 8,
                   .block_size = 4,
                   .n_blocks = 8,
                   .max_seqs = 2,
                   .max_blocks_per_seq = 4};
    kv_cache *kv;
    pool *pl;
    kn_stream *s;
    ae_error err = {0};
    assert_int_equal(kv_init(&kv, &staged, &p, &err), AE_OK);
    assert_int_equal(pool_init(&pl, 1, &err), AE_OK);
    assert_int_equal(kn_stream_init(&s, &staged, &(kn_stream_config){pl, 0}, &err), AE_OK);
    kn_buf tables = {.be = &staged, .ptr = (void *)(uintptr_t)kv_map_tables(kv), .bytes = 8 * sizeof(int32_t)};
    int32_t a, b, row[2][4];
    assert_int_equal(kv_seq_alloc(kv, &a, &err), AE_OK);
    assert_int_equal(kv_seq_reserve(kv, a, 10, &err), AE_OK);
    kv_upload_tables(kv, s);
    kn_download(s, row, &tables, 0, sizeof row);
    const int32_t *host = kv_seq_block_table(kv, a);
    const int32_t want[2][4] = {{host[0], host[1], host[2], -1}, {-1, -1, -1, -1}};
    assert_int_not_equal(host[0], -1);
    assert_memory_equal(row, want, sizeof want);
    kv_seq_free(kv, a);
    assert_int_equal(kv_seq_alloc(kv, &b, &err), AE_OK);
    assert_int_equal(b, a); /* the id comes back, its row now empty */
    kv_upload_tables(kv, s);
    kn_download(s, row, &tables, 0, sizeof row);
    const int32_t empty[2][4] = {{-1, -1, -1, -1}, {-1, -1, -1, -1}};
    assert_memory_equal(row, empty, sizeof empty);
    kn_stream_free(s);
    pool_free(pl);
    kv_free(kv);
}

static engine *engine_on(const model *m) {
    engine_config cfg = {
        .max_batch_tokens = 64, .max_seqs = 3, .max_seq_len = 96, .kv_tokens = 288, .block_size = 16, .threads = 2};
    engine *e = NULL;
    ae_error err = {0};
    if (engine_init(&e, m, &cfg, &err) != AE_OK) fail_msg("%s", err.msg);
    return e;
}

/* One script of steps on both engines: prefill, a tree with features
 * captured, its path committed, a batch of two sequences, one freed and a
 * new one taking its blocks (block tables re-sent), and decodes after.
 * Logits and features must be the same bits at every step; at odd steps
 * staged runs engine_step with ids, whose ids must be the argmax of each of
 * the CPU's rows (only the ids come back; its logits stay on staged). */
static void test_engine_on_staged_gives_the_cpu_bits(void **state) {
    (void)state;
    engine *e[2] = {engine_on(on_cpu), engine_on(on_staged)};
    const int32_t V = on_cpu->cfg.vocab, H = on_cpu->cfg.hidden;
    float *lg[2], *ft[2];
    for (int k = 0; k < 2; k++) {
        lg[k] = calloc((size_t)64 * V, sizeof(float));
        ft[k] = calloc((size_t)64 * 3 * H, sizeof(float));
        assert_non_null(lg[k]);
        assert_non_null(ft[k]);
    }
    ae_error err = {0};
    int32_t a[2], b[2], c[2];
    static const int32_t tree[] = {28, 29, 30, 31, 32, 33}, parents[] = {-1, -1, 0, 0, 2, 1};
    static const int32_t path[] = {0, 2, 4};
    int32_t rows[6] = {0, 1, 2, 3, 4, 5}, ids[64];
    for (int step = 0; step < 6; step++) {
        int32_t n_rows = 0, n_feat = 0;
        for (int k = 0; k < 2; k++) {
            engine_item it[2];
            int32_t n = 1;
            forward_capture cap = {.n_layers = 3, .layers = {1, 15, 29}, .n_rows = 6, .rows = rows, .out = ft[k]};
            const forward_capture *cp = NULL;
            switch (step) {
            case 0:
                assert_int_equal(engine_seq_new(e[k], &a[k], &err), AE_OK);
                it[0] = (engine_item){.seq = a[k], .kind = ENGINE_APPEND, .n_tokens = N_PROMPT, .tokens = PROMPT};
                break;
            case 1:
                it[0] =
                    (engine_item){.seq = a[k], .kind = ENGINE_TREE, .n_tokens = 6, .tokens = tree, .parents = parents};
                cp = &cap;
                n_feat = 6;
                break;
            case 2:
                assert_int_equal(engine_commit_path(e[k], a[k], path, 3, &err), AE_OK);
                assert_int_equal(engine_seq_new(e[k], &b[k], &err), AE_OK);
                it[0] = (engine_item){.seq = a[k], .kind = ENGINE_APPEND, .n_tokens = 1, .tokens = &tree[5]};
                it[1] = (engine_item){
                    .seq = b[k], .kind = ENGINE_APPEND, .n_tokens = 12, .tokens = PROMPT, .all_logits = true};
                n = 2;
                break;
            case 3:
                engine_seq_free(e[k], a[k]);
                assert_int_equal(engine_seq_new(e[k], &c[k], &err), AE_OK);
                it[0] = (engine_item){.seq = c[k], .kind = ENGINE_APPEND, .n_tokens = 5, .tokens = PROMPT + 3};
                it[1] = (engine_item){.seq = b[k], .kind = ENGINE_APPEND, .n_tokens = 1, .tokens = &tree[1]};
                n = 2;
                break;
            default:
                it[0] = (engine_item){.seq = c[k], .kind = ENGINE_APPEND, .n_tokens = 1, .tokens = &tree[step]};
                it[1] = (engine_item){.seq = b[k], .kind = ENGINE_APPEND, .n_tokens = 1, .tokens = &tree[step - 1]};
                n = 2;
                break;
            }
            /* Odd steps on staged: only the rows' argmaxes come back. */
            engine_outputs eo = {.logits = lg[k], .ids = k == 1 && step % 2 ? ids : NULL, .capture = cp};
            int rc = engine_step(e[k], it, n, &eo, &err);
            if (rc != AE_OK) fail_msg("step %d: %s", step, err.msg);
            n_rows = engine_logit_rows(it, n);
        }
        if (step % 2)
            for (int32_t r = 0; r < n_rows; r++) assert_int_equal(ids[r], sample_greedy(lg[0] + (size_t)r * V, V));
        else
            assert_memory_equal(lg[0], lg[1], (size_t)n_rows * V * sizeof(float));
        if (n_feat) assert_memory_equal(ft[0], ft[1], (size_t)n_feat * 3 * H * sizeof(float));
        assert_true(n_rows > 0);
    }
    kv_stats s0 = engine_kv_stats(e[0]), s1 = engine_kv_stats(e[1]);
    assert_int_equal(s0.blocks_used, s1.blocks_used);
    assert_int_equal(s0.seqs_live, 2);
    for (int k = 0; k < 2; k++) {
        engine_free(e[k]);
        free(lg[k]);
        free(ft[k]);
    }
}

/* The draft head and its drafter on staged: every weight and norm, the
 * embedding table, the KV, the features and each pass's maps in staged
 * buffers, the hidden states kept there, only probabilities downloaded;
 * the trees are the CPU's, bit for bit. */
static void test_the_head_on_staged_drafts_the_cpu_trees(void **state) {
    (void)state;
    draft_rounds_on(&staged, "staged", 0.0f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_buffer_from_host_borrows_or_copies),
        cmocka_unit_test(test_weights_are_in_the_backends_buffers),
        cmocka_unit_test(test_kv_tables_reach_the_backend_as_they_change),
        cmocka_unit_test(test_engine_on_staged_gives_the_cpu_bits),
        cmocka_unit_test(test_the_head_on_staged_drafts_the_cpu_trees),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
