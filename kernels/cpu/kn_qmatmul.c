/* Matrix product with quantized weights (Q8_0, Q4_0, Q4_1) in integers.
 *
 * x is quantized per block of 32 to integers xi with |xi| <= 16256 (15
 * bits) or |xi| <= 127 (8 bits, the stream's choice) and one f32 scale
 * per block (kernels.h gives the exact rule). Each block of
 * a weight row then contributes an exact integer dot product, scaled in
 * f32 in a fixed order. Integer sums have no order, so every kernel (the
 * portable one here on the file's layout, the AVX-512 VNNI one on the
 * packed layout) gives the same bits by construction.
 *
 * Why integers: a decode step is bound by reading the weights, but only
 * if the kernel turns 4-bit weights into products faster than memory
 * delivers them. Widening every weight to f32 and using fmas did not
 * (0.19 of the bandwidth roofline at 2 threads); VNNI multiplies 64 byte
 * pairs per instruction. xi needs about 15 bits to keep the logits within
 * 1e-3 of the f32 reference (8-bit activations gave 5% error), so xi is
 * split into two signed bytes, hi and lo, and each block costs two
 * dot products per weight byte. The 8-bit precision keeps xi in one
 * signed byte, as llama.cpp's Q8_0 activations do: one dot product per
 * weight byte, half the work of a pass of several tokens, for about 5%
 * error in the logits.
 *
 * This file: x quantization, packing, the portable kernel and the driver;
 * kn_qmatmul_avx512.c and kn_qmatmul_avx2.c hold the SIMD kernels. */
#include "kn_cpu_impl.h"

#include <float.h>
#include <math.h>
#include <string.h>

bool kn_qmatmul_type(ggml_type t) { return t == GGML_TYPE_Q8_0 || t == GGML_TYPE_Q4_0 || t == GGML_TYPE_Q4_1; }

/* ---- x ------------------------------------------------------------------ */

size_t kn_qx_row_bytes(int64_t k, int bits) {
    size_t nb = (size_t)(k / KN_QK);
    return (nb * (kn_qx_block_bytes(bits) + 3 * sizeof(float)) + 63) & ~(size_t)63;
}

kn_qx kn_qx_view(const uint8_t *row, int64_t k, int bits) {
    size_t nb = (size_t)(k / KN_QK);
    const uint8_t *a = row + nb * kn_qx_block_bytes(bits);
    kn_qx q = {
        .planes = (const int8_t *)row,
        .sx = (const float *)(const void *)a,
        .xs = (const float *)(const void *)(a + nb * sizeof(float)),
        .isx = (const int32_t *)(const void *)(a + 2 * nb * sizeof(float)),
    };
    return q;
}

/* Round to the nearest integer, ties to even, for |v| < 2^22: adding and
 * subtracting 1.5 * 2^23 leaves the integer part in the mantissa. Exact
 * under the default rounding mode, and the compiler may vectorize it
 * (lrintf is a library call). */
static float round_even(float v) { return (v + 12582912.0f) - 12582912.0f; }

void kn_qx_quantize(const float *x, int64_t k, int bits, uint8_t *row) {
    AE_ASSERT(bits == 8 || bits == 15);
    if (kn_cpu_use_avx512vnni()) {
        kn_qx_quantize_avx512(x, k, bits, row);
        return;
    }
    int64_t nb = k / KN_QK;
    size_t bpb = kn_qx_block_bytes(bits);
    const int32_t lim = bits == 8 ? KN_QX8_MAX : KN_QX_MAX;
    float *sx = (float *)(void *)(row + (size_t)nb * bpb);
    float *xs = sx + nb;
    int32_t *isx = (int32_t *)(void *)(xs + nb);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * KN_QK;
        int8_t *hi = (int8_t *)row + (size_t)b * bpb, *lo = hi + KN_QK; /* at 8 bits, hi is xi */
        float amax = 0.0f;
        bool finite = true;
        for (int i = 0; i < KN_QK; i++) {
            float a = fabsf(xb[i]);
            finite &= a <= FLT_MAX; /* false for inf and NaN */
            amax = a > amax ? a : amax;
        }
        int32_t sum = 0;
        if (!finite || amax < KN_QX_TINY) {
            /* Zero (or below KN_QX_TINY, where lim / amax would
             * overflow): every product is 0. Not finite: the scale is NaN,
             * so every output this block touches becomes NaN, as in f32. */
            memset(hi, 0, bpb);
            sx[b] = finite ? 0.0f : NAN;
        } else {
            float inv = (float)lim / amax;
            sx[b] = amax / (float)lim;
            for (int i = 0; i < KN_QK; i++) {
                int32_t v = (int32_t)round_even(xb[i] * inv);
                v = v > lim ? lim : v < -lim ? -lim : v;
                if (bits == 8) {
                    hi[i] = (int8_t)v;
                } else {
                    int32_t h = (v + 64) >> 7; /* floor: hi in [-127, 127], lo in [-64, 63] */
                    hi[i] = (int8_t)h;
                    lo[i] = (int8_t)(v - 128 * h);
                }
                sum += v;
            }
        }
        isx[b] = sum;
        xs[b] = sx[b] * (float)sum;
    }
}

/* ---- packing -------------------------------------------------------------- */

size_t kn_pack_block_bytes(ggml_type t) { return KN_PACK_ROWS * (size_t)quant_block_bytes(t); }

size_t kn_weight_packed_bytes(const kn_weight *w) {
    if (!kn_qmatmul_type(w->type)) return 0;
    return (size_t)(w->rows / KN_PACK_ROWS) * (size_t)(w->cols / KN_QK) * kn_pack_block_bytes(w->type);
}

/* Element i (0..31) of a Q4 block's nibbles: low nibbles of bytes 0..15
 * are elements 0..15, high nibbles elements 16..31. */
static uint8_t nibble(const uint8_t *qs, int i) { return i < 16 ? qs[i] & 15 : qs[i - 16] >> 4; }

/* Packed (group, block), the layout the VNNI kernel reads: 32-bit lane r
 * of a 64-byte vector holds 4 consecutive elements of row r, so one
 * vpdpbusd against 4 broadcast bytes of x advances 16 rows by 4 elements.
 *   Q8_0: 8 vectors (elements 4v..4v+3), bytes q + 128 (unsigned), then
 *         the 16 rows' f16 d.
 *   Q4_*: 4 vectors of nibble pairs: low nibble elements 4v..4v+3, high
 *         nibble elements 4(v+4)..4(v+4)+3; then 16 d, then (Q4_1) 16 m. */
static void pack_block(ggml_type t, const uint8_t *const rows[KN_PACK_ROWS], int64_t b, uint8_t *dst) {
    size_t bb = quant_block_bytes(t);
    for (int r = 0; r < KN_PACK_ROWS; r++) {
        const uint8_t *blk = rows[r] + (size_t)b * bb;
        if (t == GGML_TYPE_Q8_0) {
            for (int v = 0; v < 8; v++)
                for (int e = 0; e < 4; e++) dst[(v * 16 + r) * 4 + e] = blk[2 + 4 * v + e] ^ 0x80;
            memcpy(dst + 512 + 2 * r, blk, 2);
        } else {
            const uint8_t *qs = blk + (t == GGML_TYPE_Q4_1 ? 4 : 2);
            for (int v = 0; v < 4; v++)
                for (int e = 0; e < 4; e++)
                    dst[(v * 16 + r) * 4 + e] = (uint8_t)(nibble(qs, 4 * v + e) | nibble(qs, 4 * (v + 4) + e) << 4);
            memcpy(dst + 256 + 2 * r, blk, 2);
            if (t == GGML_TYPE_Q4_1) memcpy(dst + 288 + 2 * r, blk + 2, 2);
        }
    }
}

void kn_weight_pack(kn_weight *w, void *dst) {
    size_t total = kn_weight_packed_bytes(w);
    AE_ASSERT(total > 0 && ((uintptr_t)dst & 63) == 0);
    int64_t nb = w->cols / KN_QK, ng = w->rows / KN_PACK_ROWS;
    size_t pb = kn_pack_block_bytes(w->type);
    uint8_t *out = dst;
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *rows[KN_PACK_ROWS];
        for (int r = 0; r < KN_PACK_ROWS; r++)
            rows[r] = (const uint8_t *)w->data + (size_t)(g * KN_PACK_ROWS + r) * w->row_bytes;
        for (int64_t b = 0; b < nb; b++) pack_block(w->type, rows, b, out + ((size_t)g * (size_t)nb + (size_t)b) * pb);
    }
    w->packed = dst;
    w->pack_stride = (size_t)nb * pb;
}

/* ---- portable kernel ------------------------------------------------------ */

/* One output: weight row `row` (the file's layout) against quantized x. */
static float qdot(ggml_type t, const uint8_t *row, const kn_qx *q, int64_t nb, int bits) {
    size_t bb = quant_block_bytes(t), bpb = kn_qx_block_bytes(bits);
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)b * bb;
        const int8_t *xb = q->planes + (size_t)b * bpb;
        int32_t xi[KN_QK];
        for (int i = 0; i < KN_QK; i++) xi[i] = bits == 8 ? xb[i] : 128 * xb[i] + xb[i + KN_QK];
        uint16_t dh;
        memcpy(&dh, blk, 2);
        int32_t isum = 0;
        if (t == GGML_TYPE_Q8_0) {
            const int8_t *qs = (const int8_t *)(blk + 2);
            for (int i = 0; i < KN_QK; i++) isum += qs[i] * xi[i];
        } else {
            const uint8_t *qs = blk + (t == GGML_TYPE_Q4_1 ? 4 : 2);
            for (int i = 0; i < 16; i++) isum += (qs[i] & 15) * xi[i] + (qs[i] >> 4) * xi[i + 16];
            if (t == GGML_TYPE_Q4_0) isum -= 8 * q->isx[b];
        }
        float d = quant_f16_to_f32(dh);
        acc = fmaf((float)isum, d * q->sx[b], acc);
        if (t == GGML_TYPE_Q4_1) {
            uint16_t mh;
            memcpy(&mh, blk + 2, 2);
            acc = fmaf(quant_f16_to_f32(mh), q->xs[b], acc);
        }
    }
    return acc;
}

/* ---- driver ------------------------------------------------------------- */

#define KN_MM_MAX_W 4 /* weights per fused call */

/* Rows per unit of work: one packed group. The packed layout keeps a
 * thread's run of groups contiguous in memory, so small units cost no
 * streaming, and they split o_proj's 576 rows evenly over 2 threads
 * (64-row units left one thread 5 of 9). */
#define KN_QCHUNK KN_PACK_ROWS

typedef struct qmm_job {
    int n_w;
    const kn_weight *w[KN_MM_MAX_W];
    float *y[KN_MM_MAX_W];           /* [m][w->rows] each */
    int64_t chunks[KN_MM_MAX_W + 1]; /* prefix sums of each weight's chunks */
    const float *x;                  /* [m][k] */
    int64_t k;
    uint8_t *qx; /* [m][kn_qx_row_bytes(k)] */
    size_t qx_stride;
    int bits; /* 15 or 8: the stream's precision of x */
    int64_t m;
    bool vnni, avx2; /* packed groups: AVX-512 VNNI, else AVX2, else portable */
    bool swiglu;     /* w[0] gate, w[1] up: y[0] = swiglu(y[0], y[1]) */
} qmm_job;

static void quantize_task(void *ctx, int task, int n_tasks) {
    const qmm_job *job = ctx;
    int64_t r0 = job->m * task / n_tasks, r1 = job->m * (task + 1) / n_tasks;
    for (int64_t r = r0; r < r1; r++)
        kn_qx_quantize(job->x + r * job->k, job->k, job->bits, job->qx + (size_t)r * job->qx_stride);
}

/* Rows [j0, j1) of w for every token: packed groups through VNNI, the
 * rest (no packed copy, no VNNI, or the rows past the last whole group)
 * through qdot. Tokens go in tiles of KN_TILE_M so that each packed block
 * is decoded once per tile. */
static void qmm_rows(const qmm_job *job, const kn_weight *w, float *y_all, int64_t j0, int64_t j1) {
    int64_t k = w->cols, nb = k / KN_QK, n = w->rows;
    for (int64_t r0 = 0; r0 < job->m; r0 += KN_TILE_M) {
        int tm = job->m - r0 < KN_TILE_M ? (int)(job->m - r0) : KN_TILE_M;
        kn_qx qx[KN_TILE_M];
        for (int r = 0; r < tm; r++) qx[r] = kn_qx_view(job->qx + (size_t)(r0 + r) * job->qx_stride, k, job->bits);
        float *y = y_all + r0 * n;
        int64_t j = j0;
        if ((job->vnni || job->avx2) && w->packed)
            for (; j + KN_PACK_ROWS <= j1 && j + KN_PACK_ROWS <= n / KN_PACK_ROWS * KN_PACK_ROWS; j += KN_PACK_ROWS) {
                if (job->vnni)
                    kn_qgroup_avx512(w, j / KN_PACK_ROWS, qx, tm, job->bits, y, (size_t)n);
                else
                    kn_qgroup_avx2(w, j / KN_PACK_ROWS, qx, tm, job->bits, y, (size_t)n);
            }
        for (; j < j1; j++) {
            const uint8_t *row = (const uint8_t *)w->data + (size_t)j * w->row_bytes;
            for (int r = 0; r < tm; r++)
                y[(size_t)r * (size_t)n + (size_t)j] = qdot(w->type, row, &qx[r], nb, job->bits);
        }
    }
}

/* The weights' chunks of KN_QCHUNK rows, numbered across the weights in
 * order; task t owns one contiguous run of them, so each core's
 * prefetchers stream their own part of the weights. */
static void qmm_task(void *ctx, int task, int n_tasks) {
    const qmm_job *job = ctx;
    int64_t total = job->swiglu ? job->chunks[1] : job->chunks[job->n_w];
    int64_t c0 = total * task / n_tasks, c1 = total * (task + 1) / n_tasks;
    if (job->swiglu) {
        /* Chunk c is rows [16c, 16c + 16) of gate and of up; their
         * products are combined while still in cache. */
        const kn_weight *g = job->w[0];
        for (int64_t c = c0; c < c1; c++) {
            int64_t j0 = c * KN_QCHUNK, j1 = j0 + KN_QCHUNK < g->rows ? j0 + KN_QCHUNK : g->rows;
            qmm_rows(job, g, job->y[0], j0, j1);
            qmm_rows(job, job->w[1], job->y[1], j0, j1);
            for (int64_t r = 0; r < job->m; r++) {
                float *yg = job->y[0] + r * g->rows;
                const float *yu = job->y[1] + r * g->rows;
                kn_swiglu_span(yg + j0, yu + j0, yg + j0, j1 - j0);
            }
        }
        return;
    }
    int i = 0;
    for (int64_t c = c0; c < c1; c++) {
        while (c >= job->chunks[i + 1]) i++;
        const kn_weight *w = job->w[i];
        int64_t j0 = (c - job->chunks[i]) * KN_QCHUNK, j1 = j0 + KN_QCHUNK < w->rows ? j0 + KN_QCHUNK : w->rows;
        qmm_rows(job, w, job->y[i], j0, j1);
    }
}

static void qmm_run(kn_stream *s, int n_w, const kn_weight *const *w, const float *x, float *const *y, int64_t m,
                    bool swiglu) {
    AE_ASSERT(n_w >= 1 && n_w <= KN_MM_MAX_W);
    int64_t k = w[0]->cols;
    AE_ASSERT(k % KN_QK == 0);
    size_t stride = kn_qx_row_bytes(k, s->act_bits);
    AE_ASSERT(KN_CPU(s)->work_bytes >= (size_t)m * stride);
    qmm_job job = {.n_w = n_w,
                   .x = x,
                   .k = k,
                   .qx = KN_CPU(s)->work,
                   .qx_stride = stride,
                   .bits = s->act_bits,
                   .m = m,
                   .vnni = kn_cpu_use_avx512vnni(),
                   .avx2 = kn_cpu_use_avx2(),
                   .swiglu = swiglu};
    for (int i = 0; i < n_w; i++) {
        AE_ASSERT(w[i]->cols == k && kn_qmatmul_type(w[i]->type));
        job.w[i] = w[i];
        job.y[i] = y[i];
        job.chunks[i + 1] = job.chunks[i] + (w[i]->rows + KN_QCHUNK - 1) / KN_QCHUNK;
    }
    int threads = pool_threads(KN_CPU(s)->pool);
    /* One row is quicker to quantize here than to hand out (0.6 us for
     * 1536 elements with AVX-512; a pool pass costs ~0.25 us). */
    if (m == 1 || threads == 1)
        quantize_task(&job, 0, 1);
    else
        pool_run(KN_CPU(s)->pool, quantize_task, &job, m < threads ? (int)m : threads);
    int64_t total = swiglu ? job.chunks[1] : job.chunks[n_w];
    pool_run(KN_CPU(s)->pool, qmm_task, &job, total < threads ? (int)total : threads);
}

void kn_qmatmul_n(kn_stream *s, int n_w, const kn_weight *const *w, const float *x, float *const *y, int64_t m) {
    qmm_run(s, n_w, w, x, y, m, false);
}

void kn_qmatmul_swiglu(kn_stream *s, const kn_weight *gate, const kn_weight *up, const float *x, float *y_gate,
                       float *y_up, int64_t m) {
    AE_ASSERT(gate->rows == up->rows);
    qmm_run(s, 2, (const kn_weight *[]){gate, up}, x, (float *[]){y_gate, y_up}, m, true);
}
