/* Matrix product y[m][n] = x[m][k] . W[n][k]^T on the CPU.
 *
 * Quantized W: each row of x is first quantized to int8 blocks of 32 in
 * the stream's workspace, then every output is an integer
 * dot product per block, scaled and accumulated in the order kernels.h
 * fixes. The work is split over the pool by chunks of W's rows; inside a
 * chunk, tiles of up to 4 rows of x reuse each block of W while it is in
 * L1, so a pass of m tokens streams W from memory once.
 *
 * This file holds the driver and the portable kernels; kn_matmul_avx2.c
 * the AVX2 ones, which give the same bits. */
#include "kn_cpu_impl.h"

#include <math.h>
#include <string.h>

/* Rows of W per pool task: small enough to stay in L1 (16 rows of a
 * 1536-wide Q4_1 matrix are 15 KiB) while m-tiles revisit them, large
 * enough that task hand-out is cheap. */
#define KN_CHUNK_N 16

bool kn_matmul_supports(ggml_type t) {
    switch (t) {
    case GGML_TYPE_F32:
    case GGML_TYPE_F16:
    case GGML_TYPE_BF16:
    case GGML_TYPE_Q8_0:
    case GGML_TYPE_Q4_0:
    case GGML_TYPE_Q4_1:
        return true;
    default:
        return false;
    }
}

static bool is_quantized(ggml_type t) {
    return t == GGML_TYPE_Q8_0 || t == GGML_TYPE_Q4_0 || t == GGML_TYPE_Q4_1;
}

/* Workspace layout for m rows: q [m][nb][32] int8, then d and s, each
 * [m][nbp] f32, each part 64-byte aligned. */
static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

size_t kn_matmul_workspace(int64_t m, int64_t k) {
    if (m <= 0 || k <= 0) return 0;
    int64_t nb = (k + KN_QK - 1) / KN_QK, nbp = kn_pad8(nb);
    return align64((size_t)m * (size_t)nb * KN_QK) + 2 * align64((size_t)m * (size_t)nbp * 4);
}

/* ---- activation quantization -------------------------------------------- */

/* One rounding rule for every path (round half away from zero), so the
 * int8 activations are the same whichever kernel consumes them. Writes
 * q[nb][32], d[nbp], s[nbp] (the padding zeroed). */
static void quantize_row(const float *x, int8_t *q, float *dout, float *sout, int64_t nb) {
    for (int64_t b = 0; b < nb; b++) {
        const float *v = x + b * KN_QK;
        float amax = 0.0f;
        for (int i = 0; i < KN_QK; i++) {
            float a = fabsf(v[i]);
            if (a > amax) amax = a;
        }
        float d = amax / 127.0f;
        float id = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < KN_QK; i++) {
            float r = roundf(v[i] * id);
            /* Clamp in float first: converting an out-of-range or NaN
             * float to an integer is undefined. */
            int qi = r >= 127.0f ? 127 : r <= -127.0f ? -127 : r == r ? (int)r : 0;
            q[b * KN_QK + i] = (int8_t)qi;
            sum += qi;
        }
        dout[b] = d;
        sout[b] = d * (float)sum;
    }
    for (int64_t b = nb; b < kn_pad8(nb); b++) dout[b] = sout[b] = 0.0f;
}

/* ---- portable kernels --------------------------------------------------- */

/* The lane tree of kernels.h, shared by every kernel (AVX2 reproduces it
 * with shuffles). */
static float lane_sum(const float a[8]) {
    float s04 = a[0] + a[4], s15 = a[1] + a[5], s26 = a[2] + a[6], s37 = a[3] + a[7];
    float lo = s04 + s26, hi = s15 + s37;
    return lo + hi;
}

/* Integer lane sums of one block: lane l = elements 4l..4l+3. */
static void lanes_q8_0(const kn_blk_q8_0 *w, const int8_t *a, int32_t lane[8]) {
    for (int l = 0; l < 8; l++) {
        int32_t s = 0;
        for (int i = 4 * l; i < 4 * l + 4; i++) s += (int32_t)w->q[i] * a[i];
        lane[l] = s;
    }
}

static int nibble(const uint8_t *q, int i) {
    return i < KN_QK / 2 ? (q[i] & 0x0f) : (q[i - KN_QK / 2] >> 4);
}

static void lanes_q4(const uint8_t *q, int offset, const int8_t *a, int32_t lane[8]) {
    for (int l = 0; l < 8; l++) {
        int32_t s = 0;
        for (int i = 4 * l; i < 4 * l + 4; i++) s += (int32_t)(nibble(q, i) - offset) * a[i];
        lane[l] = s;
    }
}

/* Row r of the tile's activations: q, d, s. */
static float dot_quant(ggml_type type, const uint8_t *wrow, const int8_t *xq, const float *xd,
                       const float *xs, int64_t nb) {
    float acc[8] = {0}, macc[8] = {0};
    int32_t lane[8];
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *a = xq + b * KN_QK;
        float dw, mw = 0.0f;
        if (type == GGML_TYPE_Q8_0) {
            const kn_blk_q8_0 *blk = (const kn_blk_q8_0 *)(const void *)wrow + b;
            lanes_q8_0(blk, a, lane);
            dw = quant_f16_to_f32(blk->d);
        } else if (type == GGML_TYPE_Q4_0) {
            const kn_blk_q4_0 *blk = (const kn_blk_q4_0 *)(const void *)wrow + b;
            lanes_q4(blk->q, 8, a, lane);
            dw = quant_f16_to_f32(blk->d);
        } else {
            const kn_blk_q4_1 *blk = (const kn_blk_q4_1 *)(const void *)wrow + b;
            lanes_q4(blk->q, 0, a, lane);
            dw = quant_f16_to_f32(blk->d);
            mw = quant_f16_to_f32(blk->m);
        }
        float dd = dw * xd[b];
        for (int l = 0; l < 8; l++) acc[l] = fmaf((float)lane[l], dd, acc[l]);
        if (type == GGML_TYPE_Q4_1) macc[b % 8] = fmaf(mw, xs[b], macc[b % 8]);
    }
    /* The padding blocks up to a multiple of 8 count as m_w = s_x = 0 (it
     * can turn a -0 lane into +0), so SIMD code may run whole groups. */
    if (type == GGML_TYPE_Q4_1)
        for (int64_t b = nb; b < kn_pad8(nb); b++) macc[b % 8] = fmaf(0.0f, xs[b], macc[b % 8]);
    return lane_sum(acc) + lane_sum(macc);
}

static float weight_at(ggml_type type, const uint8_t *wrow, int64_t i) {
    if (type == GGML_TYPE_F32) {
        float f;
        memcpy(&f, wrow + 4 * i, sizeof f);
        return f;
    }
    uint16_t h;
    memcpy(&h, wrow + 2 * i, sizeof h);
    return type == GGML_TYPE_F16 ? quant_f16_to_f32(h) : quant_bf16_to_f32(h);
}

static float dot_float(ggml_type type, const uint8_t *wrow, const float *x, int64_t k) {
    float acc[8] = {0};
    int64_t k8 = k / 8 * 8;
    for (int64_t i = 0; i < k8; i += 8)
        for (int l = 0; l < 8; l++) acc[l] = fmaf(x[i + l], weight_at(type, wrow, i + l), acc[l]);
    float s = lane_sum(acc);
    for (int64_t i = k8; i < k; i++) s = fmaf(x[i], weight_at(type, wrow, i), s);
    return s;
}

void kn_tile_scalar(const kn_tile *t) {
    const kn_weight *w = t->w;
    bool quant = is_quantized(w->type);
    int64_t nb = w->cols / KN_QK;
    for (int r = 0; r < t->tm; r++) {
        for (int64_t j = t->j0; j < t->j1; j++) {
            const uint8_t *wrow = (const uint8_t *)w->data + (size_t)j * w->row_bytes;
            t->y[(size_t)r * t->ldy + (size_t)j] =
                quant ? dot_quant(w->type, wrow, t->xq + (size_t)r * (size_t)nb * KN_QK,
                                  t->xd + (size_t)r * (size_t)t->nbp, t->xs + (size_t)r * (size_t)t->nbp, nb)
                      : dot_float(w->type, wrow, t->xf + (size_t)r * t->xf_stride, w->cols);
        }
    }
}

/* ---- driver ------------------------------------------------------------- */

typedef struct mm_job {
    const kn_weight *w;
    const int8_t *xq;    /* [m][nb][32], when W is quantized */
    const float *xd, *xs; /* [m][nbp] */
    const float *xf;     /* [m][k], when W is float */
    float *y;            /* [m][n] */
    int64_t m;
    bool avx2;
} mm_job;

static void mm_task(void *ctx, int task, int n_tasks) {
    const mm_job *job = ctx;
    const kn_weight *w = job->w;
    (void)n_tasks;
    int64_t j0 = (int64_t)task * KN_CHUNK_N;
    int64_t j1 = j0 + KN_CHUNK_N < w->rows ? j0 + KN_CHUNK_N : w->rows;
    int64_t nb = w->cols / KN_QK;
    for (int64_t r = 0; r < job->m; r += KN_TILE_M) {
        kn_tile t = {
            .w = w,
            .xq = job->xq ? job->xq + r * nb * KN_QK : NULL,
            .xd = job->xd ? job->xd + r * kn_pad8(nb) : NULL,
            .xs = job->xs ? job->xs + r * kn_pad8(nb) : NULL,
            .nb = nb,
            .nbp = kn_pad8(nb),
            .xf = job->xf ? job->xf + r * w->cols : NULL,
            .xf_stride = (size_t)w->cols,
            .tm = job->m - r < KN_TILE_M ? (int)(job->m - r) : KN_TILE_M,
            .j0 = j0,
            .j1 = j1,
            .y = job->y + r * w->rows,
            .ldy = (size_t)w->rows,
        };
        if (job->avx2)
            kn_tile_avx2(&t);
        else
            kn_tile_scalar(&t);
    }
}

void kn_matmul(kn_stream *s, const kn_weight *w, const float *x, float *y, int64_t m) {
    AE_ASSERT(kn_matmul_supports(w->type));
    AE_ASSERT(w->rows > 0 && w->cols > 0 && m >= 0);
    AE_ASSERT(w->row_bytes >= quant_row_bytes(w->type, (uint64_t)w->cols) &&
              quant_row_bytes(w->type, (uint64_t)w->cols) > 0);
    if (m == 0) return;
    mm_job job = {.w = w, .y = y, .m = m, .avx2 = kn_cpu_use_avx2()};
    if (is_quantized(w->type)) {
        size_t need = kn_matmul_workspace(m, w->cols);
        AE_ASSERT(need <= s->work_bytes);
        int64_t nb = w->cols / KN_QK, nbp = kn_pad8(nb);
        int8_t *xq = s->work;
        float *xd = (float *)(void *)((uint8_t *)s->work + align64((size_t)(m * nb * KN_QK)));
        float *xs = (float *)(void *)((uint8_t *)xd + align64((size_t)(m * nbp) * 4));
        for (int64_t r = 0; r < m; r++)
            quantize_row(x + r * w->cols, xq + r * nb * KN_QK, xd + r * nbp, xs + r * nbp, nb);
        job.xq = xq;
        job.xd = xd;
        job.xs = xs;
    } else {
        job.xf = x;
    }
    int64_t n_chunks = (w->rows + KN_CHUNK_N - 1) / KN_CHUNK_N;
    AE_ASSERT(n_chunks <= INT32_MAX);
    pool_run(s->pool, mm_task, &job, (int)n_chunks);
}
