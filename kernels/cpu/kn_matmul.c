/* Matrix product y[m][n] = x[m][k] . W[n][k]^T on the CPU.
 *
 * Float W (F32, F16, BF16) is multiplied in f32: each output is the
 * 8-lane fma reduction kernels.h fixes. Quantized W goes to the integer
 * kernels of kn_qmatmul.c. The work is split over the pool by chunks of
 * W's rows; inside a chunk, tiles of up to KN_TILE_M rows of x share each
 * loaded piece of W, so a pass of m tokens streams W once per tile, not
 * once per token.
 *
 * This file holds the driver and the portable float kernel;
 * kn_matmul_avx2.c the AVX2 one, which gives the same bits. */
#include "kn_cpu_impl.h"

#include <math.h>

/* Elements of a weight row the portable kernel dequantizes at a time: a
 * multiple of the block size and of the 8 lanes. */
#define KN_PIECE 256

bool kn_matmul_supports(ggml_type t) {
    switch (t) {
    case GGML_TYPE_F32:
    case GGML_TYPE_F16:
    case GGML_TYPE_BF16: return true;
    default: return kn_qmatmul_type(t);
    }
}

/* Quantized W needs x quantized (kn_qmatmul.c): one row of bytes and
 * scales per row of x, at most the 15-bit row (8 bits takes less). Float
 * W needs nothing. */
size_t kn_matmul_workspace(int64_t m, int64_t k) { return (size_t)m * kn_qx_row_bytes(k, 15); }

/* ---- portable kernel ---------------------------------------------------- */

/* The lane tree of kernels.h (AVX2 reproduces it with shuffles). */
static float lane_sum(const float a[8]) {
    float s04 = a[0] + a[4], s15 = a[1] + a[5], s26 = a[2] + a[6], s37 = a[3] + a[7];
    float lo = s04 + s26, hi = s15 + s37;
    return lo + hi;
}

/* Each weight row is dequantized KN_PIECE elements at a time by
 * quant_dequantize itself (the values are the reference's by
 * construction) and applied to every row of the tile while it is in L1. */
void kn_tile_scalar(const kn_tile *t) {
    const kn_weight *w = t->w;
    int64_t k = w->cols, k8 = k / 8 * 8;
    float wf[KN_PIECE];
    for (int64_t j = t->j0; j < t->j1; j++) {
        const uint8_t *wrow = (const uint8_t *)w->data + (size_t)j * w->row_bytes;
        float acc[KN_TILE_M][8] = {{0}};
        int64_t i0 = 0;
        for (; i0 < k; i0 += KN_PIECE) {
            int64_t len = k - i0 < KN_PIECE ? k - i0 : KN_PIECE;
            bool ok = quant_dequantize(w->type, wrow + quant_row_bytes(w->type, (uint64_t)i0), wf, (uint64_t)len);
            AE_ASSERT(ok);
            int64_t body = i0 + len < k8 ? len : k8 - i0;
            for (int r = 0; r < t->tm; r++) {
                const float *x = t->x + (size_t)r * t->x_stride + i0;
                for (int64_t i = 0; i < body; i += 8)
                    for (int l = 0; l < 8; l++) acc[r][l] = fmaf(x[i + l], wf[i + l], acc[r][l]);
            }
            if (i0 + len == k) break; /* wf keeps the last piece for the tail */
        }
        for (int r = 0; r < t->tm; r++) {
            const float *x = t->x + (size_t)r * t->x_stride;
            float s = lane_sum(acc[r]);
            for (int64_t i = k8; i < k; i++) s = fmaf(x[i], wf[i - i0], s);
            t->y[(size_t)r * t->ldy + (size_t)j] = s;
        }
    }
}

/* ---- driver ------------------------------------------------------------- */

typedef struct mm_job {
    const kn_weight *w;
    const float *x; /* [m][k] */
    float *y;       /* [m][n] */
    int64_t m;
    bool avx2;
} mm_job;

/* Task t of n_tasks owns one contiguous range of whole chunks of W's rows.
 * Contiguous ranges let each core's prefetchers stream its own part of W;
 * handing out small chunks round-robin made two threads barely faster than
 * one. Which task computes a row never changes its bits. */
static void mm_task(void *ctx, int task, int n_tasks) {
    const mm_job *job = ctx;
    const kn_weight *w = job->w;
    int64_t n_chunks = (w->rows + KN_CHUNK_N - 1) / KN_CHUNK_N;
    int64_t c0 = n_chunks * task / n_tasks, c1 = n_chunks * (task + 1) / n_tasks;
    for (int64_t c = c0; c < c1; c++) {
        int64_t j0 = c * KN_CHUNK_N;
        int64_t j1 = j0 + KN_CHUNK_N < w->rows ? j0 + KN_CHUNK_N : w->rows;
        for (int64_t r = 0; r < job->m; r += KN_TILE_M) {
            kn_tile t = {
                .w = w,
                .x = job->x + r * w->cols,
                .x_stride = (size_t)w->cols,
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
}

void kn_cpu_matmul(kn_stream *s, const kn_weight *w, const float *x, float *y, int64_t m) {
    if (m == 0) return;
    if (kn_qmatmul_type(w->type)) {
        kn_qmatmul_n(s, 1, &w, x, &y, m);
        return;
    }
    mm_job job = {.w = w, .x = x, .y = y, .m = m, .avx2 = kn_cpu_use_avx2()};
    int64_t n_chunks = (w->rows + KN_CHUNK_N - 1) / KN_CHUNK_N;
    int threads = pool_threads(KN_CPU(s)->pool);
    pool_run(KN_CPU(s)->pool, mm_task, &job, n_chunks < threads ? (int)n_chunks : threads);
}

void kn_cpu_matmul_n(kn_stream *s, int n, const kn_weight *const *w, const float *x, float *const *y, int64_t m) {
    bool quant = true;
    for (int i = 0; i < n; i++) quant = quant && kn_qmatmul_type(w[i]->type);
    if (!quant || n > 4 || m == 0) {
        for (int i = 0; i < n; i++) kn_cpu_matmul(s, w[i], x, y[i], m);
        return;
    }
    kn_qmatmul_n(s, n, w, x, y, m);
}

void kn_cpu_matmul_swiglu(kn_stream *s, const kn_weight *gate, const kn_weight *up, const float *x, float *y_gate,
                          float *y_up, int64_t m) {
    if (m > 0 && kn_qmatmul_type(gate->type) && kn_qmatmul_type(up->type)) {
        kn_qmatmul_swiglu(s, gate, up, x, y_gate, y_up, m);
        return;
    }
    kn_cpu_matmul(s, gate, x, y_gate, m);
    kn_cpu_matmul(s, up, x, y_up, m);
    kn_cpu_swiglu(s, y_gate, y_up, y_gate, m * gate->rows);
}
