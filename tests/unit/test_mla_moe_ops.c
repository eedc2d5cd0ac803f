/* The MLA and mixture-of-experts ops of kernels.h on the CPU backend,
 * against plain loops: kn_matmul_heads, attention over a latent pool
 * (values are the keys, a scale of the caller's), kn_moe_route and
 * kn_moe_ffn, each also batch invariant. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../../kernels/kernels.h"
#include "../../services/core/pool.h"

static pool *g_pool;
static kn_stream *g_s;

static int setup(void **state) {
    (void)state;
    if (pool_init(&g_pool, 2, NULL) != AE_OK) return -1;
    return kn_stream_init(&g_s, &kn_backend_cpu, &(kn_stream_config){g_pool, 1u << 22}, NULL) == AE_OK ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    kn_stream_free(g_s);
    pool_free(g_pool);
    return 0;
}

static uint64_t rng = 0x2545f4914f6cdd1dull;
static float rndf(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((double)(rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}
static void fill(float *x, size_t n, float scale) {
    for (size_t i = 0; i < n; i++) x[i] = rndf() * scale;
}

static kn_weight f32_weight(const float *w, int64_t rows, int64_t cols) {
    return (kn_weight){
        .type = GGML_TYPE_F32, .rows = rows, .cols = cols, .data = w, .row_bytes = (size_t)cols * sizeof(float)};
}

/* 3 tokens, 4 heads, each head's 5 outputs from its 7 inputs; x's heads
 * are 9 floats apart, y's 6: the floats between are left alone. */
static void matmul_heads_is_each_heads_product(void **state) {
    (void)state;
    enum { M = 3, NH = 4, N = 5, K = 7, XH = 9, YH = 6 };
    static float w[NH * N * K], x[M * NH * XH], y[M * NH * YH], one[NH * YH];
    fill(w, sizeof w / sizeof w[0], 1.0f);
    fill(x, sizeof x / sizeof x[0], 1.0f);
    for (size_t i = 0; i < sizeof y / sizeof y[0]; i++) y[i] = 42.0f;
    kn_weight kw = f32_weight(w, NH * N, K);
    kn_matmul_heads(g_s, &kw, NH, x, XH, y, YH, M);
    for (int t = 0; t < M; t++)
        for (int h = 0; h < NH; h++) {
            for (int o = 0; o < N; o++) {
                double ref = 0;
                for (int k = 0; k < K; k++) ref += (double)w[(h * N + o) * K + k] * x[(t * NH + h) * XH + k];
                assert_true(fabs(y[(t * NH + h) * YH + o] - ref) < 1e-5);
            }
            assert_true(y[(t * NH + h) * YH + N] == 42.0f);
        }
    /* token 2 alone: the same bits */
    for (size_t i = 0; i < sizeof one / sizeof one[0]; i++) one[i] = 42.0f;
    kn_matmul_heads(g_s, &kw, NH, x + 2 * NH * XH, XH, one, YH, 1);
    assert_memory_equal(one, y + 2 * NH * YH, sizeof one);
}

/* A latent pool: one kv head of D (24, and DeepSeek-V3's 512 + 64), v
 * NULL, scale 0.3. Token t sees slots 0..t; its output is the
 * softmax-weighted sum of the f16-rounded keys themselves; the portable
 * kernels give the SIMD ones' bits. */
static void latent_attention_weighs_the_keys(void **state) {
    (void)state;
    enum { T = 5, NH = 3, BS = 4, NB = 4, DMAX = KN_MAX_ATTN_DIM };
    static uint16_t pool_k[NB * BS * DMAX];
    static float k[T * DMAX], q[T * NH * DMAX], out[T * NH * DMAX], portable[T * NH * DMAX];
    const int dims[2] = {24, DMAX};
    for (int di = 0; di < 2; di++) {
        const int D = dims[di];
        fill(k, (size_t)T * D, 1.0f);
        fill(q, (size_t)T * NH * D, 1.0f);
        int32_t tables[2] = {1, 3}, seq[T] = {0}, slot[T], n_prefix[T], zero[T] = {0};
        for (int t = 0; t < T; t++) slot[t] = t, n_prefix[t] = t + 1;
        kn_kv_pool kv = {pool_k, NULL, NULL, NB, BS, 1, D, GGML_TYPE_F16, 0.3f};
        kn_kv_map map = {T, tables, 1, 2, seq, slot, n_prefix, zero, zero, zero, 0, 0};
        kn_kv_write(g_s, &kv, &map, k, NULL);
        kn_attention(g_s, &kv, &map, q, out, NH);
        kn_cpu_limit_simd(0);
        kn_attention(g_s, &kv, &map, q, portable, NH);
        kn_cpu_limit_simd(2);
        assert_memory_equal(out, portable, sizeof(float) * (size_t)T * NH * (size_t)D);
        for (int t = 0; t < T; t++)
            for (int h = 0; h < NH; h++) {
                double s[T], mx = -1e30, sum = 0;
                for (int j = 0; j <= t; j++) {
                    s[j] = 0;
                    for (int i = 0; i < D; i++)
                        s[j] += (double)q[(t * NH + h) * D + i] * quant_f16_to_f32(quant_f32_to_f16(k[j * D + i]));
                    s[j] *= 0.3;
                    mx = s[j] > mx ? s[j] : mx;
                }
                for (int j = 0; j <= t; j++) sum += exp(s[j] - mx);
                for (int i = 0; i < D; i++) {
                    double ref = 0;
                    for (int j = 0; j <= t; j++)
                        ref += exp(s[j] - mx) / sum * quant_f16_to_f32(quant_f32_to_f16(k[j * D + i]));
                    assert_true(fabs(out[(t * NH + h) * D + i] - ref) < 1e-5);
                }
            }
    }
}

static float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* 8 experts in 4 groups of 2, 2 groups kept, 2 experts a token. Token 0:
 * expert 6 has the best score, but its group (6, 7) has the worst sum, so
 * it is dropped; the kept groups are (0, 1) and (4, 5), and the two best
 * of those are 4 and 0. The bias only chooses: the weights are the
 * unbiased sigmoids, normalised and scaled. Token 1: no groups kept but
 * by the sums too. */
static void route_keeps_groups_and_weighs_unbiased(void **state) {
    (void)state;
    const float logits[2][8] = {{1.0f, 0.9f, -2.0f, -2.0f, 1.2f, 0.8f, 2.0f, -3.0f},
                                {-1.0f, -1.0f, 0.5f, 0.4f, -1.0f, -1.0f, 0.1f, 0.3f}};
    const float bias[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.5f};
    kn_route r = {8, 2, 4, 2, true, 2.5f};
    int32_t idx[4];
    float w[4];
    kn_moe_route(g_s, &logits[0][0], bias, 2, &r, idx, w);
    /* token 0: groups (0,1) 1.42, (2,3) .24, (4,5) 1.44, (6,7) 1.35: keep 2 and 0 */
    assert_int_equal(idx[0], 4);
    assert_int_equal(idx[1], 0);
    float a = sigmoid(1.2f), b = sigmoid(1.0f);
    assert_true(fabsf(w[0] - a / (a + b + 1e-20f) * 2.5f) < 1e-6f && fabsf(w[1] - b / (a + b + 1e-20f) * 2.5f) < 1e-6f);
    /* token 1: groups (2,3) and (6,7) (7 with its bias); experts 7 (biased) and 2 */
    assert_int_equal(idx[2], 7);
    assert_int_equal(idx[3], 2);
    a = sigmoid(0.3f), b = sigmoid(0.5f);
    assert_true(fabsf(w[2] - a / (a + b) * 2.5f) < 1e-6f && fabsf(w[3] - b / (a + b) * 2.5f) < 1e-6f);
    /* without norm: the sigmoids times the scale */
    r.norm = false;
    kn_moe_route(g_s, &logits[0][0], bias, 1, &r, idx, w);
    assert_true(w[0] == sigmoid(1.2f) * 2.5f && w[1] == sigmoid(1.0f) * 2.5f);
}

/* 4 experts [16][32], 5 tokens of 2 experts each: every token's output
 * is the weighted sum of its experts' SwiGLU FFNs, and token 3's bits are
 * the same alone. Expert 1 is BF16 and the others f32: each matrix may
 * have its own type (an int4 matrix whose scale no f16 holds is f32
 * beside Q4_0 ones). */
static void experts_sum_each_tokens_ffns(void **state) {
    (void)state;
    enum { E = 4, H = 32, F = 16, M = 5, K = 2 };
    static float g[E][F * H], u[E][F * H], d[E][H * F], x[M * H], y[M * H], y1[H], scratch[4096];
    static uint16_t b16[3][F * H];
    kn_weight gw[E], uw[E], dw[E];
    for (int e = 0; e < E; e++) {
        fill(g[e], F * H, 0.3f);
        fill(u[e], F * H, 0.3f);
        fill(d[e], H * F, 0.3f);
        gw[e] = f32_weight(g[e], F, H);
        uw[e] = f32_weight(u[e], F, H);
        dw[e] = f32_weight(d[e], H, F);
    }
    float *m1[3] = {g[1], u[1], d[1]};
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < F * H; i++) { /* bf16 values, held by f32 too for the reference */
            uint32_t bits;
            memcpy(&bits, &m1[k][i], 4);
            b16[k][i] = (uint16_t)(bits >> 16);
            bits &= 0xffff0000u;
            memcpy(&m1[k][i], &bits, 4);
        }
    gw[1] = (kn_weight){.type = GGML_TYPE_BF16, .rows = F, .cols = H, .data = b16[0], .row_bytes = H * 2};
    uw[1] = (kn_weight){.type = GGML_TYPE_BF16, .rows = F, .cols = H, .data = b16[1], .row_bytes = H * 2};
    dw[1] = (kn_weight){.type = GGML_TYPE_BF16, .rows = H, .cols = F, .data = b16[2], .row_bytes = F * 2};
    fill(x, M * H, 1.0f);
    const int32_t idx[M * K] = {3, 0, 1, 2, 2, 1, 0, 3, 3, 1};
    const float w[M * K] = {0.7f, 0.3f, 1.5f, 0.5f, 0.25f, 0.75f, 2.0f, 0.1f, 1.0f, 1.0f};
    assert_true(kn_moe_scratch(M, H, F) <= sizeof scratch / sizeof scratch[0]);
    kn_experts ex = {E, gw, uw, dw};
    kn_moe_ffn(g_s, &ex, x, idx, w, M, K, scratch, y);
    for (int t = 0; t < M; t++)
        for (int c = 0; c < H; c++) {
            double ref = 0;
            for (int j = 0; j < K; j++) {
                int e = idx[t * K + j];
                for (int f = 0; f < F; f++) {
                    double gg = 0, uu = 0;
                    for (int i = 0; i < H; i++) {
                        gg += (double)g[e][f * H + i] * x[t * H + i];
                        uu += (double)u[e][f * H + i] * x[t * H + i];
                    }
                    ref += w[t * K + j] * d[e][c * F + f] * (gg / (1 + exp(-gg)) * uu);
                }
            }
            assert_true(fabs(y[t * H + c] - ref) < 1e-4);
        }
    kn_moe_ffn(g_s, &ex, x + 3 * H, idx + 3 * K, w + 3 * K, 1, K, scratch, y1);
    assert_memory_equal(y1, y + 3 * H, sizeof y1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(matmul_heads_is_each_heads_product),
        cmocka_unit_test(latent_attention_weighs_the_keys),
        cmocka_unit_test(route_keeps_groups_and_weighs_unbiased),
        cmocka_unit_test(experts_sum_each_tokens_ffns),
    };
    return cmocka_run_group_tests_name("mla_moe_ops", tests, setup, teardown);
}
