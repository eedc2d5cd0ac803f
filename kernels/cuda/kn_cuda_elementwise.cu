/* The CUDA backend's element-wise ops: add, swiglu, bias_add,
 * gather_rows, RoPE's table and rotation, and the embedding's rows; a
 * grid-stride loop, one element per thread (kn_cuda_kernel.h). */
#include "kn_cuda_kernel.h"

/* ---- element-wise ------------------------------------------------------- */

__global__ void k_add(const float *a, const float *b, float *y, int64_t count) {
    for (int64_t i = flat_start(); i < count; i += flat_step()) y[i] = a[i] + b[i];
}

void kcu_add(kn_stream *s, const float *a, const float *b, float *y, int64_t count) {
    if (count == 0) return;
    KN_LAUNCH(k_add, flat_grid(count), dim3(KCU_THREADS), st(s), a, b, y, count);
    launched(s);
}

/* silu(g) * u as kn_swiglu1 computes it. */
static KN_HD float swiglu1(float g, float u) {
    float e = exp_clamped(-g);
    float den = 1.0f + e;
    float sg = g / den;
    return sg * u;
}

__global__ void k_swiglu(const float *g, const float *u, float *y, int64_t count) {
    for (int64_t i = flat_start(); i < count; i += flat_step()) y[i] = swiglu1(g[i], u[i]);
}

void kcu_swiglu(kn_stream *s, const float *gate, const float *up, float *y, int64_t count) {
    if (count == 0) return;
    KN_LAUNCH(k_swiglu, flat_grid(count), dim3(KCU_THREADS), st(s), gate, up, y, count);
    launched(s);
}

__global__ void k_bias_add(float *x, const float *bias, int64_t m, int64_t n) {
    for (int64_t i = flat_start(); i < m * n; i += flat_step()) x[i] = x[i] + bias[i % n];
}

void kcu_bias_add(kn_stream *s, float *x, const float *bias, int64_t m, int64_t n) {
    if (m == 0) return;
    KN_LAUNCH(k_bias_add, flat_grid(m * n), dim3(KCU_THREADS), st(s), x, bias, m, n);
    launched(s);
}

__global__ void k_gather(const float *src, const int32_t *rows, int64_t n, int64_t width, float *dst,
                         int64_t dst_stride) {
    for (int64_t i = flat_start(); i < n * width; i += flat_step()) {
        int64_t r = i / width, c = i % width;
        int64_t from = rows ? (int64_t)rows[r] : r;
        dst[r * dst_stride + c] = src[from * width + c];
    }
}

void kcu_gather_rows(kn_stream *s, const float *src, const int32_t *rows, int64_t n, int64_t width, float *dst,
                     int64_t dst_stride) {
    if (n == 0) return;
    KN_LAUNCH(k_gather, flat_grid(n * width), dim3(KCU_THREADS), st(s), src, rows, n, width, dst, dst_stride);
    launched(s);
}

/* ---- RoPE --------------------------------------------------------------------- */

struct rope_freqs {
    double inv_freq[KN_MAX_HEAD_DIM / 2];
};

__global__ void k_rope_table(rope_freqs f, int32_t head_dim, const int32_t *pos, int64_t m, float *cs) {
    int32_t half = head_dim / 2;
    for (int64_t i = flat_start(); i < m * half; i += flat_step()) {
        int64_t t = i / half;
        int32_t p = (int32_t)(i % half);
        double a = (double)pos[t] * f.inv_freq[p];
        cs[t * head_dim + 2 * p] = (float)cos(a);
        cs[t * head_dim + 2 * p + 1] = (float)sin(a);
    }
}

void kcu_rope_table(kn_stream *s, const kn_rope *r, const int32_t *pos, int64_t m, float *cs) {
    if (m == 0) return;
    rope_freqs f;
    memcpy(f.inv_freq, r->inv_freq, sizeof f.inv_freq);
    KN_LAUNCH(k_rope_table, flat_grid(m * (r->head_dim / 2)), dim3(KCU_THREADS), st(s), f, r->head_dim, pos, m, cs);
    launched(s);
}

__global__ void k_rope_rotate(int32_t head_dim, int adjacent, float *x, int64_t m, int32_t n_heads, const float *cs) {
    int32_t half = head_dim / 2;
    int stride = adjacent ? 2 : 1, other = adjacent ? 1 : half;
    for (int64_t i = flat_start(); i < m * n_heads * half; i += flat_step()) {
        int64_t th = i / half, t = th / n_heads;
        int32_t p = (int32_t)(i % half);
        float c = cs[t * head_dim + 2 * p], sn = cs[t * head_dim + 2 * p + 1];
        float *p0 = x + th * head_dim + p * stride, *p1 = p0 + other;
        float x0 = *p0, x1 = *p1;
        float a0 = x0 * c, b0 = x1 * sn;
        float a1 = x0 * sn, b1 = x1 * c;
        *p0 = a0 - b0;
        *p1 = a1 + b1;
    }
}

void kcu_rope_rotate(kn_stream *s, const kn_rope *r, float *x, int64_t m, int32_t n_heads, const float *cs) {
    if (m == 0) return;
    KN_LAUNCH(k_rope_rotate, flat_grid(m * n_heads * (r->head_dim / 2)), dim3(KCU_THREADS), st(s), r->head_dim,
              r->layout == KN_ROPE_ADJACENT ? 1 : 0, x, m, n_heads, cs);
    launched(s);
}

/* Element i of weight row `row`, as quant_dequantize gives it. */
static __device__ float w_elem(const kw &w, int64_t row, int64_t i) {
    const uint8_t *r = w.data + (size_t)row * w.row_bytes;
    switch (w.type) {
    case GGML_TYPE_F32: {
        float f;
        memcpy(&f, r + 4 * i, sizeof f);
        return f;
    }
    case GGML_TYPE_F16: return half_to_f32(ld16(r + 2 * i));
    case GGML_TYPE_BF16: return bf16_to_f32(ld16(r + 2 * i));
    case GGML_TYPE_Q8_0: {
        const uint8_t *b = r + (size_t)(i / KCU_QK) * 34;
        return (float)(int8_t)b[2 + i % KCU_QK] * half_to_f32(ld16(b));
    }
    case GGML_TYPE_Q4_0: {
        const uint8_t *b = r + (size_t)(i / KCU_QK) * 18;
        int j = (int)(i % KCU_QK);
        int q = j < 16 ? b[2 + j] & 15 : b[2 + j - 16] >> 4;
        return (float)(q - 8) * half_to_f32(ld16(b));
    }
    case GGML_TYPE_Q4_1: {
        const uint8_t *b = r + (size_t)(i / KCU_QK) * 20;
        int j = (int)(i % KCU_QK);
        int q = j < 16 ? b[4 + j] & 15 : b[4 + j - 16] >> 4;
        float v = (float)q * half_to_f32(ld16(b));
        return v + half_to_f32(ld16(b + 2));
    }
    default: return NAN;
    }
}

/* ---- embedding ------------------------------------------------------------ */

__global__ void k_embed(kw table, const int32_t *ids, float *out, int64_t m) {
    for (int64_t i = flat_start(); i < m * table.cols; i += flat_step()) {
        int64_t t = i / table.cols, c = i % table.cols;
        int32_t id = ids[t];
        /* the engine checked every id; a bad one would read outside */
        out[i] = id >= 0 && id < table.rows ? w_elem(table, id, c) : NAN;
    }
}

void kcu_embed(kn_stream *s, const kn_weight *table, const int32_t *ids, float *out, int64_t m) {
    if (m == 0) return;
    KN_LAUNCH(k_embed, flat_grid(m * table->cols), dim3(KCU_THREADS), st(s), kw_of(table), ids, out, m);
    launched(s);
}

/* k_add's image stands for every kernel's: each file is built for the
 * same GPUs (the Makefile's CUDA_GENCODE). */
cudaError_t kcu_image_check(void) {
#ifdef KN_CUDA_SHIM
    return cudaSuccess;
#else
    cudaFuncAttributes a;
    return cudaFuncGetAttributes(&a, k_add);
#endif
}
