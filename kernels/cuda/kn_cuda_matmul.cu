/* The CUDA backend's matmuls: matmul_n and matmul_swiglu.
 *   - float weights: a block is 32 weight rows x 8 lanes; the rows and x
 *     pass through shared memory a chunk at a time, and thread (j, l)
 *     runs lane l's fma chain of row j for up to 8 rows of x; lane 0 adds
 *     the lanes in kernels.h's tree;
 *   - quantized weights: x is first rounded to integers per block of 32
 *     (k_qx). For one row of x (decode) a warp takes one weight row, a
 *     group of 32 blocks at a time: four lanes to a block make its exact
 *     integer sum, and lane r chains row r's block terms in order. For
 *     more (verify, prefill) a warp takes 16 weight rows by up to 32 rows
 *     of x, a block at a time: the tensor cores' mma makes the integer
 *     sums (exact, so in any order), and each lane chains its outputs'
 *     terms in order;
 *   - fast mode (kn_stream_set_fast): float weights by cuBLAS. */
#include "kn_cuda_kernel.h"

/* ---- float matmul ----------------------------------------------------------- */

#define MM_ROWS 32 /* weight rows per block; 8 lanes each */
#define MM_TILE 8  /* rows of x per block */

#define MF_CB 512 /* bytes of a weight row per chunk: 128 f32 or 256 f16/bf16 */
#define MF_PAD 16 /* after each row in shared memory: the 4 rows a warp reads fall in other banks */

template <int T> static __device__ float mf_elem(const uint8_t *p, int64_t i) {
    if (T == GGML_TYPE_F32) {
        float f;
        memcpy(&f, p + 4 * i, sizeof f);
        return f;
    }
    uint16_t h = (uint16_t)ld16a(p + 2 * i);
    return T == GGML_TYPE_F16 ? half_to_f32(h) : bf16_to_f32(h);
}

/* y[r][j] for weight rows blockIdx.x * 32 .. and x rows blockIdx.y * 8 ..:
 * lane l of row j is the chain acc = fma(x[i], w[i], acc) over
 * i = 8j' + l, then lane 0 adds the lanes' tree and the tail, the CPU's
 * order. The rows and x pass through shared memory a chunk at a time,
 * loaded by the whole block in 16-byte pieces where the rows are aligned
 * to 16 bytes (else element by element), so that each load is wide and
 * coalesced while each lane still takes its own elements in order. */
template <int T> __global__ void __launch_bounds__(256) k_matmul_f(kw w, const float *x, float *y, int64_t m) {
    alignas(16) __shared__ uint8_t ws[MM_ROWS][MF_CB + MF_PAD];
    __shared__ float xs[MM_TILE][MF_CB / 2];
    __shared__ float red[MM_TILE][MM_ROWS][8];
    const int es = T == GGML_TYPE_F32 ? 4 : 2, ce = MF_CB / es; /* elements per chunk */
    unsigned tid = threadIdx.x, l = tid % 8, jr = tid / 8;
    int64_t j0 = (int64_t)blockIdx.x * MM_ROWS, j = j0 + jr, r0 = (int64_t)blockIdx.y * MM_TILE;
    int tm = m - r0 < MM_TILE ? (int)(m - r0) : MM_TILE;
    int nr = w.rows - j0 < MM_ROWS ? (int)(w.rows - j0) : MM_ROWS;
    int64_t k = w.cols, k8 = k / 8 * 8;
    bool live = j < w.rows;
    bool vec = (uintptr_t)w.data % 16 == 0 && w.row_bytes % 16 == 0;
    float acc[MM_TILE];
    for (int r = 0; r < MM_TILE; r++) acc[r] = 0.0f;
    for (int64_t c0 = 0; c0 < k8; c0 += ce) {
        int cl = k8 - c0 < ce ? (int)(k8 - c0) : ce; /* a multiple of 8 */
        int cb = cl * es;                            /* a multiple of 16 */
        if (vec) {
            for (int u = (int)tid; u < nr * (cb / 16); u += (int)blockDim.x) {
                int rr = u / (cb / 16), o = u % (cb / 16) * 16;
                const uint8_t *src = w.data + (size_t)(j0 + rr) * w.row_bytes + (size_t)c0 * es + o;
#ifdef KN_CUDA_SHIM
                memcpy(&ws[rr][o], src, 16);
#else
                *(uint4 *)(void *)&ws[rr][o] = *(const uint4 *)(const void *)src;
#endif
            }
        } else {
            for (int u = (int)tid; u < nr * cb; u += (int)blockDim.x) {
                int rr = u / cb, o = u % cb;
                ws[rr][o] = w.data[(size_t)(j0 + rr) * w.row_bytes + (size_t)c0 * es + o];
            }
        }
        for (int u = (int)tid; u < tm * cl; u += (int)blockDim.x)
            xs[u / cl][u % cl] = x[(r0 + u / cl) * k + c0 + u % cl];
        __syncthreads();
        if (live)
            for (int i = (int)l; i < cl; i += 8) {
                float wv = mf_elem<T>(ws[jr], i);
                for (int r = 0; r < tm; r++) acc[r] = fmaf(xs[r][i], wv, acc[r]);
            }
        __syncthreads();
    }
    for (int r = 0; r < MM_TILE; r++) red[r][jr][l] = acc[r];
    __syncthreads();
    if (live && l == 0)
        for (int r = 0; r < tm; r++) {
            const float *a = red[r][jr];
            float s04 = a[0] + a[4], s15 = a[1] + a[5], s26 = a[2] + a[6], s37 = a[3] + a[7];
            float lo = s04 + s26, hi = s15 + s37;
            float sum = lo + hi;
            for (int64_t i = k8; i < k; i++)
                sum = fmaf(x[(r0 + r) * k + i], mf_elem<T>(w.data + (size_t)j * w.row_bytes, i), sum);
            y[(r0 + r) * w.rows + j] = sum;
        }
}

/* ---- quantized matmul -------------------------------------------------------- */

/* x rounded per block of 32 (kernels.h, "quantized W"), in the stream's
 * workspace: for each row of x, xi as int16[k], then sx[nb], xs[nb]
 * (f32) and isx[nb] (int32): kn_matmul_workspace's bytes exactly. */
struct qxrow {
    int16_t *xi;
    float *sx, *xs;
    int32_t *isx;
};

static KN_HD size_t qx_row_bytes(int64_t k) { return (size_t)(k / KCU_QK) * (2 * KCU_QK + 12); }

static KN_HD qxrow qx_at(void *work, int64_t k, int64_t r) {
    uint8_t *b = (uint8_t *)work + (size_t)r * qx_row_bytes(k);
    int64_t nb = k / KCU_QK;
    qxrow q;
    q.xi = (int16_t *)(void *)b;
    q.sx = (float *)(void *)(b + 2 * k);
    q.xs = q.sx + nb;
    q.isx = (int32_t *)(void *)(q.xs + nb);
    return q;
}

/* Row blockIdx.x, block blockIdx.y, one element per thread (32). Rows go
 * on x: a prefill chunk may hold more tokens than grid y's 65535. */
__global__ void k_qx(const float *x, int64_t k, int lim, void *work) {
    __shared__ float ax[KCU_QK];
    __shared__ int32_t xv[KCU_QK];
    __shared__ float inv_s;
    __shared__ int state; /* 0 zero, 1 finite, 2 not finite */
    int64_t r = blockIdx.x, b = blockIdx.y;
    unsigned i = threadIdx.x;
    qxrow q = qx_at(work, k, r);
    float xv_f = x[r * k + b * KCU_QK + i];
    ax[i] = fabsf(xv_f);
    __syncthreads();
    if (i == 0) {
        float amax = 0.0f;
        bool finite = true;
        for (int j = 0; j < KCU_QK; j++) {
            float a = ax[j];
            finite = finite && a <= 3.40282347e+38f;
            amax = a > amax ? a : amax;
        }
        if (!finite || amax < 0x1p-100f) {
            state = finite ? 0 : 2;
            q.sx[b] = finite ? 0.0f : NAN;
        } else {
            state = 1;
            inv_s = (float)lim / amax;
            q.sx[b] = amax / (float)lim;
        }
    }
    __syncthreads();
    int32_t v = 0;
    if (state == 1) {
        float t = xv_f * inv_s;
        v = (int32_t)((t + 12582912.0f) - 12582912.0f);
        v = v > lim ? lim : v < -lim ? -lim : v;
    }
    q.xi[b * KCU_QK + i] = (int16_t)v;
    xv[i] = v;
    __syncthreads();
    if (i == 0) {
        int32_t sum = 0;
        for (int j = 0; j < KCU_QK; j++) sum += xv[j];
        q.isx[b] = sum;
        q.xs[b] = q.sx[b] * (float)sum;
    }
}

#define QW 4 /* weight rows (warps) per block */

/* Lane (sl, qt)'s quarter of blocks g + sl + 8u (u < 4) of a quantized
 * row, and the scales (d, and m for Q4_1) of block g + lane. */
static __device__ void qload(const kw &w, const uint8_t *row, size_t bb, bool live, bool q8, bool q41, int64_t g,
                             int64_t nb, unsigned sl, unsigned qt, unsigned lane, uint32_t *wa, uint32_t *wb,
                             unsigned *have, float *d, float *mm) {
    *have = 0;
    for (int u = 0; u < 4; u++) {
        int64_t b = g + sl + 8 * u;
        wa[u] = wb[u] = 0;
        if (!live || b >= nb) continue;
        *have |= 1u << u;
        const uint8_t *blk = row + (size_t)b * bb;
        if (q8) { /* qs[8q .. 8q+7], 2-byte aligned */
            const uint8_t *p = blk + 2 + 8 * qt;
            wa[u] = ld16a(p) | ld16a(p + 2) << 16;
            wb[u] = ld16a(p + 4) | ld16a(p + 6) << 16;
        } else if (q41) { /* qs[4q .. 4q+3], 4-byte aligned */
            wa[u] = ld32a(blk + 4 + 4 * qt);
        } else {
            const uint8_t *p = blk + 2 + 4 * qt;
            wa[u] = ld16a(p) | ld16a(p + 2) << 16;
        }
    }
    if (live && g + lane < nb) {
        const uint8_t *blk = row + (size_t)(g + lane) * bb;
        *d = half_to_f32((uint16_t)ld16a(blk));
        *mm = q41 ? half_to_f32((uint16_t)ld16a(blk + 2)) : 0.0f;
    }
}

/* Weight row blockIdx.x * 4 + warp against x rows blockIdx.y * 8 .., in
 * groups of 32 blocks. First the exact integer sums, four lanes to a
 * block: lane L takes quarter L % 4 of blocks g + L / 4 + 8u (u < 4),
 * all four blocks' weights loaded before any arithmetic, and the block's
 * first lane adds the quarters through shared memory (integers: any order
 * gives the same sum; shared memory rather than shuffles, which the CPU
 * shim can only make block-wide barriers).
 * Then lane r chains row r's terms of the group in block order:
 * acc = fma(isum, d * sx, acc) and, for Q4_1, acc = fma(m, xs, acc), the
 * CPU's order exactly. Weight rows are 2-byte aligned (4 for Q4_1), and
 * x's rows (76 bytes a block in the workspace) 4. */
__global__ void __launch_bounds__(128) k_matmul_q(kw w, void *work, float *y, int64_t m) {
    __shared__ int32_t isum[QW][MM_TILE][32], qpart[QW][4][32];
    __shared__ float dq[QW][32], mq[QW][32], sxs[QW][MM_TILE][32], xss[QW][MM_TILE][32];
    unsigned lane = threadIdx.x % 32, wp = threadIdx.x / 32, qt = lane % 4, sl = lane / 4;
    int64_t j = (int64_t)blockIdx.x * QW + wp, r0 = (int64_t)blockIdx.y * MM_TILE;
    int tm = m - r0 < MM_TILE ? (int)(m - r0) : MM_TILE;
    int64_t k = w.cols, nb = k / KCU_QK;
    bool live = j < w.rows, q8 = w.type == GGML_TYPE_Q8_0, q41 = w.type == GGML_TYPE_Q4_1;
    size_t bb = q8 ? 34 : q41 ? 20 : 18;
    const uint8_t *row = w.data + (size_t)(live ? j : 0) * w.row_bytes;
    float acc = 0.0f;
    /* group g's weights in wa/wb (have: which blocks exist) and this lane's block scale in dl/ml;
     * the next group's are loaded before this one's arithmetic */
    uint32_t wa[4], wb[4], na[4] = {0, 0, 0, 0}, nbw[4] = {0, 0, 0, 0};
    unsigned have = 0, nhave = 0; /* bit u: block g + sl + 8u exists */
    float dl = 0.0f, ml = 0.0f, ndl = 0.0f, nml = 0.0f;
    qload(w, row, bb, live, q8, q41, 0, nb, sl, qt, lane, wa, wb, &have, &dl, &ml);
    for (int64_t g = 0; g < nb; g += 32) {
        if (g + 32 < nb) qload(w, row, bb, live, q8, q41, g + 32, nb, sl, qt, lane, na, nbw, &nhave, &ndl, &nml);
        if (live && g + lane < nb) {
            dq[wp][lane] = dl;
            mq[wp][lane] = ml;
        }
        for (int r = 0; r < tm; r++) { /* tm is the same in every lane: all reach the __syncwarp */
            qxrow xr = qx_at(work, k, r0 + r);
            if (g + lane < nb) {
                sxs[wp][r][lane] = xr.sx[g + lane];
                xss[wp][r][lane] = xr.xs[g + lane];
            }
            for (int u = 0; u < 4; u++) {
                int64_t b = g + sl + 8 * u;
                int32_t part = 0;
                if (have >> u & 1) {
                    const int16_t *xi = xr.xi + b * KCU_QK;
                    if (q8) {
                        uint32_t x0 = ld32a(xi + 8 * qt), x1 = ld32a(xi + 8 * qt + 2), x2 = ld32a(xi + 8 * qt + 4),
                                 x3 = ld32a(xi + 8 * qt + 6);
                        part =
                            (int32_t)(int8_t)(wa[u] & 255) * lo16(x0) + (int32_t)(int8_t)(wa[u] >> 8 & 255) * hi16(x0) +
                            (int32_t)(int8_t)(wa[u] >> 16 & 255) * lo16(x1) +
                            (int32_t)(int8_t)(wa[u] >> 24) * hi16(x1) + (int32_t)(int8_t)(wb[u] & 255) * lo16(x2) +
                            (int32_t)(int8_t)(wb[u] >> 8 & 255) * hi16(x2) +
                            (int32_t)(int8_t)(wb[u] >> 16 & 255) * lo16(x3) + (int32_t)(int8_t)(wb[u] >> 24) * hi16(x3);
                    } else {
                        uint32_t l0 = ld32a(xi + 4 * qt), l1 = ld32a(xi + 4 * qt + 2), h0 = ld32a(xi + 16 + 4 * qt),
                                 h1 = ld32a(xi + 16 + 4 * qt + 2), v = wa[u];
                        part = (int32_t)(v & 15) * lo16(l0) + (int32_t)(v >> 4 & 15) * lo16(h0) +
                               (int32_t)(v >> 8 & 15) * hi16(l0) + (int32_t)(v >> 12 & 15) * hi16(h0) +
                               (int32_t)(v >> 16 & 15) * lo16(l1) + (int32_t)(v >> 20 & 15) * lo16(h1) +
                               (int32_t)(v >> 24 & 15) * hi16(l1) + (int32_t)(v >> 28) * hi16(h1);
                    }
                }
                qpart[wp][u][lane] = part;
            }
            __syncwarp();
            if (qt == 0)
                for (int u = 0; u < 4; u++)
                    if (have >> u & 1) {
                        const int32_t *pq = &qpart[wp][u][lane];
                        int32_t sum = (pq[0] + pq[1]) + (pq[2] + pq[3]);
                        if (w.type == GGML_TYPE_Q4_0) sum -= 8 * xr.isx[g + sl + 8 * u];
                        isum[wp][r][sl + 8 * u] = sum;
                    }
            __syncwarp();
        }
        __syncwarp();
        if (live && lane < (unsigned)tm) {
            int64_t cnt = nb - g < 32 ? nb - g : 32;
            for (int64_t L = 0; L < cnt; L++) {
                float dsx = dq[wp][L] * sxs[wp][lane][L];
                acc = fmaf((float)isum[wp][lane][L], dsx, acc);
                if (q41) acc = fmaf(mq[wp][L], xss[wp][lane][L], acc);
            }
        }
        __syncwarp();
        for (int u = 0; u < 4; u++) {
            wa[u] = na[u];
            wb[u] = nbw[u];
        }
        have = nhave;
        dl = ndl;
        ml = nml;
    }
    if (live && lane < (unsigned)tm) y[(r0 + lane) * w.rows + j] = acc;
}

/* ---- quantized matmul on tensor cores (verify and prefill) ------------------- */

/* D = A B + C over one warp, with A 16 x 32 and B 32 x 8 signed bytes and
 * C, D 16 x 8 int32: mma.m16n8k32 with .s8 operands, whose fragments the
 * PTX ISA lays out so (g = lane / 4, t = lane % 4; byte i of a register
 * is element i of its run of four):
 *   A, row-major: a[0] row g, columns 4t .. 4t+3; a[1] row g+8, the same
 *     columns; a[2] row g, columns 16+4t ..; a[3] row g+8, columns 16+4t ..
 *   B, column-major: b[0] rows 4t .. 4t+3 of column g; b[1] rows 16+4t ..
 *   C and D: c[0], c[1] row g, columns 2t, 2t+1; c[2], c[3] row g+8.
 * The sums are of integers, exact in any order, so the tensor cores give
 * the same bits as any other way. From sm_80 on it is the one instruction
 * (every target of the build is); elsewhere, the CPU shim included, the
 * same product through shared memory, laid out as above: the shim's run
 * checks the kernel's fragments against this layout, and a GPU's run
 * checks the layout against the hardware (tests/gpu/UNRUN.md). Every lane
 * of the warp calls it. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define KCU_MMA_S8 1
#endif
/* Warps per block of k_matmul_qmma, 16 weight rows each: one, so that a
 * verify pass's 1024-row K and V projections of an 8B model still make
 * 64 blocks, and its 4096-row ones 256 (an H200 has 132 SMs). */
#define QM_WARPS 1
#define QM_TILES 4 /* its tiles of 8 rows of x per block */
static __device__ __forceinline__ void mma_s8(const uint32_t a[4], const uint32_t b[2], int32_t c[4]) {
#ifdef KCU_MMA_S8
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __shared__ int8_t sa[QM_WARPS][16][32], sb[QM_WARPS][8][32]; /* sb: [column][row] */
    unsigned lane = threadIdx.x % 32, w = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    for (unsigned i = 0; i < 4; i++) {
        sa[w][g][4 * t + i] = (int8_t)(uint8_t)(a[0] >> 8 * i);
        sa[w][g + 8][4 * t + i] = (int8_t)(uint8_t)(a[1] >> 8 * i);
        sa[w][g][16 + 4 * t + i] = (int8_t)(uint8_t)(a[2] >> 8 * i);
        sa[w][g + 8][16 + 4 * t + i] = (int8_t)(uint8_t)(a[3] >> 8 * i);
        sb[w][g][4 * t + i] = (int8_t)(uint8_t)(b[0] >> 8 * i);
        sb[w][g][16 + 4 * t + i] = (int8_t)(uint8_t)(b[1] >> 8 * i);
    }
    __syncwarp();
    for (unsigned i = 0; i < 4; i++) {
        unsigned row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
        int32_t s = 0;
        for (int e = 0; e < 32; e++) s += (int32_t)sa[w][row][e] * (int32_t)sb[w][col][e];
        c[i] += s;
    }
    __syncwarp();
#endif
}

/* Four 16-bit integers of x (two words, low half first) as signed
 * bytes. Wide (15-bit) x is split as x = 128 hi + lo, hi = x >> 7 in
 * [-127, 127] and lo = x & 127, since |x| <= 16256 = 127 * 128; 8-bit x
 * (|x| <= 127) is its own bytes, in lo. */
static __device__ __forceinline__ void split_x(uint32_t w0, uint32_t w1, bool wide, uint32_t *hi, uint32_t *lo) {
    int32_t v[4] = {lo16(w0), hi16(w0), lo16(w1), hi16(w1)};
    uint32_t h = 0, l = 0;
    for (int i = 0; i < 4; i++) {
        h |= ((uint32_t)(v[i] >> 7) & 255u) << 8 * i;
        l |= ((uint32_t)v[i] & (wide ? 127u : 255u)) << 8 * i;
    }
    *hi = wide ? h : 0u;
    *lo = l;
}

/* Weight row `row`'s block b as this lane's two A registers (columns
 * 4t .. 4t+3 and 16+4t ..) and its scales; zeros for a row past the end.
 * Q4 nibbles are the A bytes as they are (0 .. 15), Q4_0's 8 taken off
 * afterwards through x's block sum, as the CPU does. */
static __device__ __forceinline__ void qm_load(const kw &w, const uint8_t *row, bool live, int64_t b, unsigned t,
                                               uint32_t *lo, uint32_t *hi, float *d, float *mm) {
    *lo = *hi = 0;
    *d = *mm = 0.0f;
    if (!live) return;
    if (w.type == GGML_TYPE_Q8_0) {
        const uint8_t *blk = row + (size_t)b * 34, *p = blk + 2 + 4 * t;
        *lo = ld16a(p) | ld16a(p + 2) << 16;
        *hi = ld16a(p + 16) | ld16a(p + 18) << 16;
        *d = half_to_f32((uint16_t)ld16a(blk));
    } else {
        bool q41 = w.type == GGML_TYPE_Q4_1;
        const uint8_t *blk = row + (size_t)b * (q41 ? 20 : 18);
        uint32_t v = q41 ? ld32a(blk + 4 + 4 * t) : ld16a(blk + 2 + 4 * t) | ld16a(blk + 4 + 4 * t) << 16;
        *lo = v & 0x0f0f0f0fu;
        *hi = v >> 4 & 0x0f0f0f0fu;
        *d = half_to_f32((uint16_t)ld16a(blk));
        *mm = q41 ? half_to_f32((uint16_t)ld16a(blk + 2)) : 0.0f;
    }
}

/* y for weight rows (blockIdx.x * QM_WARPS + warp) * 16 .. +15 and x rows
 * blockIdx.y * 32 .. +31, one quantized block (32 columns) at a time:
 * each block's exact integer sums for 16 weight rows by 8 x rows come
 * from mma_s8 (two for 15-bit x: hi and lo), and each lane chains its
 * four outputs' terms in block order, acc = fma(isum, d * sx, acc) and,
 * for Q4_1, acc = fma(m, xs, acc): the CPU's order, so k_matmul_q's bits,
 * with no scalar work per x row but the chain. `wide`: x has 15 bits (hi
 * and two mmas; else one). At most 85 registers a thread (24 blocks of
 * one warp an SM), where the pipelined loads would take 160. */
__global__ void __launch_bounds__(32 * QM_WARPS, 24) k_matmul_qmma(kw w, void *work, float *y, int64_t m, bool wide) {
    unsigned lane = threadIdx.x % 32, wp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    int64_t j0 = ((int64_t)blockIdx.x * QM_WARPS + wp) * 16, r0 = (int64_t)blockIdx.y * (8 * QM_TILES);
    int64_t k = w.cols, nb = k / KCU_QK, ja = j0 + g, jb = ja + 8;
    int nt = (int)((m - r0 + 7) / 8 < QM_TILES ? (m - r0 + 7) / 8 : QM_TILES); /* the same in the whole block */
    bool la = ja < w.rows, lb = jb < w.rows, q41 = w.type == GGML_TYPE_Q4_1, q40 = w.type == GGML_TYPE_Q4_0;
    const uint8_t *rowa = w.data + (size_t)(la ? ja : 0) * w.row_bytes,
                  *rowb = w.data + (size_t)(lb ? jb : 0) * w.row_bytes;
    float acc[QM_TILES][4];
    for (int u = 0; u < QM_TILES; u++)
        for (int i = 0; i < 4; i++) acc[u][i] = 0.0f;
    /* block b's weights in a, d, mm; block b + 1's are loaded into na,
     * nd, nmm before b's arithmetic, to keep a load in flight */
    uint32_t a[4], na[4];
    float d[2], mm[2], nd[2], nmm[2];
    qm_load(w, rowa, la && nb > 0, 0, t, &na[0], &na[2], &nd[0], &nmm[0]);
    qm_load(w, rowb, lb && nb > 0, 0, t, &na[1], &na[3], &nd[1], &nmm[1]);
    for (int64_t b = 0; b < nb; b++) {
        for (int i = 0; i < 4; i++) a[i] = na[i];
        for (int i = 0; i < 2; i++) {
            d[i] = nd[i];
            mm[i] = nmm[i];
        }
        qm_load(w, rowa, la && b + 1 < nb, b + 1, t, &na[0], &na[2], &nd[0], &nmm[0]);
        qm_load(w, rowb, lb && b + 1 < nb, b + 1, t, &na[1], &na[3], &nd[1], &nmm[1]);
        KCU_UNROLL
        for (int u = 0; u < QM_TILES; u++) { /* a constant count, so that acc stays in registers */
            if (u >= nt) break;
            /* B: x row r0 + 8u + g, this lane's columns of the block */
            int64_t rx = r0 + 8 * u + g;
            uint32_t bh[2] = {0, 0}, bl[2] = {0, 0};
            if (rx < m) {
                const int16_t *xi = qx_at(work, k, rx).xi + b * KCU_QK + 4 * t;
                split_x(ld32a(xi), ld32a(xi + 2), wide, &bh[0], &bl[0]);
                split_x(ld32a(xi + 16), ld32a(xi + 18), wide, &bh[1], &bl[1]);
            }
            int32_t ch[4] = {0, 0, 0, 0}, cl[4] = {0, 0, 0, 0};
            if (wide) mma_s8(a, bh, ch);
            mma_s8(a, bl, cl);
            for (int i = 0; i < 4; i++) {
                int64_t rc = r0 + 8 * u + 2 * t + (i & 1);
                if (rc >= m) continue;
                qxrow xc = qx_at(work, k, rc);
                int32_t isum = 128 * ch[i] + cl[i];
                if (q40) isum -= 8 * xc.isx[b];
                float dsx = d[i >> 1] * xc.sx[b];
                acc[u][i] = fmaf((float)isum, dsx, acc[u][i]);
                if (q41) acc[u][i] = fmaf(mm[i >> 1], xc.xs[b], acc[u][i]);
            }
        }
    }
    KCU_UNROLL
    for (int u = 0; u < QM_TILES; u++)
        for (int i = 0; i < 4; i++) {
            int64_t rc = r0 + 8 * u + 2 * t + (i & 1), j = i < 2 ? ja : jb;
            if (rc < m && j < w.rows) y[rc * w.rows + j] = acc[u][i];
        }
}

static bool is_quant(ggml_type t) { return t == GGML_TYPE_Q8_0 || t == GGML_TYPE_Q4_0 || t == GGML_TYPE_Q4_1; }

static dim3 tile_grid(int64_t rows, int64_t per_block, int64_t m) {
    return dim3((unsigned)((rows + per_block - 1) / per_block), (unsigned)((m + MM_TILE - 1) / MM_TILE));
}

/* x rounded once for every quantized weight of the call. */
static void quantize_x(kn_stream *s, const float *x, int64_t k, int64_t m) {
    KCU_ASSERT((size_t)m * qx_row_bytes(k) <= KN_CU(s)->work_bytes);
    int lim = s->act_bits == 8 ? 127 : 16256;
    KN_LAUNCH(k_qx, dim3((unsigned)m, (unsigned)(k / KCU_QK)), dim3(KCU_QK), st(s), x, k, lim, KN_CU(s)->work);
    launched(s);
}

/* x rounded to the weights' 16-bit type, for cuBLAS (fast mode). */
template <ggml_type T> __global__ void k_round_x(const float *x, int64_t count, uint16_t *out) {
    for (int64_t i = flat_start(); i < count; i += flat_step())
        out[i] = T == GGML_TYPE_F16 ? f32_to_half(x[i]) : f32_to_bf16(x[i]);
}

/* Whether fast mode takes w (cuBLAS). */
static bool by_blas(const kn_stream *s, const kn_weight *w) {
    return s->fast && !is_quant(w->type) && w->row_bytes == (size_t)w->cols * (w->type == GGML_TYPE_F32 ? 4 : 2);
}

/* x_ready: the workspace holds x quantized by an earlier matmul of the
 * same x (kcu_matmul_n). */
static void matmul_one(kn_stream *s, const kn_weight *w, const float *x, float *y, int64_t m, bool x_ready) {
    if (by_blas(s, w)) {
        /* Fast mode: cuBLAS, x in the weights' type in the workspace
         * (2 bytes an element, within kn_matmul_workspace's). */
        const void *xt = x;
        if (w->type != GGML_TYPE_F32) {
            KCU_ASSERT((size_t)m * (size_t)w->cols * 2 <= KN_CU(s)->work_bytes);
            uint16_t *h = (uint16_t *)KN_CU(s)->work;
            if (w->type == GGML_TYPE_F16)
                KN_LAUNCH(k_round_x<GGML_TYPE_F16>, flat_grid(m * w->cols), dim3(KCU_THREADS), st(s), x, m * w->cols,
                          h);
            else
                KN_LAUNCH(k_round_x<GGML_TYPE_BF16>, flat_grid(m * w->cols), dim3(KCU_THREADS), st(s), x, m * w->cols,
                          h);
            launched(s);
            xt = h;
        }
        kcu_blas_gemm(s, w->type, w->data, xt, y, m, w->rows, w->cols);
        launched(s);
        return;
    }
    if (is_quant(w->type)) {
        size_t al = w->type == GGML_TYPE_Q4_1 ? 4 : 2; /* k_matmul_q's loads */
        KCU_ASSERT((uintptr_t)w->data % al == 0 && w->row_bytes % al == 0);
        if (!x_ready) quantize_x(s, x, w->cols, m);
        if (m == 1) {
            KN_LAUNCH(k_matmul_q, tile_grid(w->rows, QW, m), dim3(32 * QW), st(s), kw_of(w), KN_CU(s)->work, y, m);
        } else { /* verify and prefill: the tensor cores' integer sums */
            dim3 grid((unsigned)((w->rows + 16 * QM_WARPS - 1) / (16 * QM_WARPS)),
                      (unsigned)((m + 8 * QM_TILES - 1) / (8 * QM_TILES)));
            KN_LAUNCH(k_matmul_qmma, grid, dim3(32 * QM_WARPS), st(s), kw_of(w), KN_CU(s)->work, y, m,
                      s->act_bits != 8);
        }
    } else {
        dim3 grid = tile_grid(w->rows, MM_ROWS, m), block(8 * MM_ROWS);
        size_t al = w->type == GGML_TYPE_F32 ? 4 : 2; /* mf_elem's loads; the 16-byte path checks its own */
        KCU_ASSERT((uintptr_t)w->data % al == 0 && w->row_bytes % al == 0);
        if (w->type == GGML_TYPE_F32)
            KN_LAUNCH(k_matmul_f<GGML_TYPE_F32>, grid, block, st(s), kw_of(w), x, y, m);
        else if (w->type == GGML_TYPE_F16)
            KN_LAUNCH(k_matmul_f<GGML_TYPE_F16>, grid, block, st(s), kw_of(w), x, y, m);
        else
            KN_LAUNCH(k_matmul_f<GGML_TYPE_BF16>, grid, block, st(s), kw_of(w), x, y, m);
    }
    launched(s);
}

void kcu_matmul_n(kn_stream *s, int n, const kn_weight *const *w, const float *x, float *const *y, int64_t m) {
    if (m == 0) return;
    bool ready = false;
    for (int i = 0; i < n; i++) {
        matmul_one(s, w[i], x, y[i], m, ready);
        /* A quantized matmul leaves x quantized in the workspace; fast
         * mode's rounding of x for cuBLAS overwrites it. */
        if (is_quant(w[i]->type))
            ready = true;
        else if (by_blas(s, w[i]) && w[i]->type != GGML_TYPE_F32)
            ready = false;
    }
}

void kcu_matmul_swiglu(kn_stream *s, const kn_weight *gate, const kn_weight *up, const float *x, float *y_gate,
                       float *y_up, int64_t m) {
    if (m == 0) return;
    const kn_weight *w[2] = {gate, up};
    float *y[2] = {y_gate, y_up};
    kcu_matmul_n(s, 2, w, x, y, m);
    kcu_swiglu(s, y_gate, y_up, y_gate, m * gate->rows);
}
