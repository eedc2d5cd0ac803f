/* The CUDA backend's softmax and sampling: softmax, one block per row;
 * argmax, 32 blocks per row, then the best of them; top-k; and kn_sample's
 * draws (kernels/draw.h), one block per row. */
#include "kn_cuda_kernel.h"

extern "C" {
#include "../draw.h"
}

/* ---- per row ------------------------------------------------------------ */

/* Row blockIdx.x in place. The maximum is order-free; the sum is in
 * double in element order, one chain (thread 0), as on the CPU. The
 * exponentials are independent: the whole block makes them, a chunk at a
 * time, and copies them to shared memory, from which thread 0 adds 8
 * loads ahead. */
#define SM_CHUNK 4096
__global__ void k_softmax(float *x, int64_t n) {
    __shared__ float mx_t[KCU_THREADS];
    __shared__ float ex[SM_CHUNK];
    __shared__ float inv_s;
    float *xr = x + (int64_t)blockIdx.x * n;
    unsigned t = threadIdx.x;
    float mx = -INFINITY;
    for (int64_t i = t; i < n; i += blockDim.x)
        if (xr[i] > mx) mx = xr[i];
    mx_t[t] = mx;
    __syncthreads();
    mx = -INFINITY;
    for (unsigned i = 0; i < blockDim.x; i++)
        if (mx_t[i] > mx) mx = mx_t[i];
    double sum = 0.0; /* thread 0's */
    for (int64_t c0 = 0; c0 < n; c0 += SM_CHUNK) {
        int cl = n - c0 < SM_CHUNK ? (int)(n - c0) : SM_CHUNK;
        for (int i = (int)t; i < cl; i += (int)blockDim.x) {
            float e = expf(xr[c0 + i] - mx);
            xr[c0 + i] = e;
            ex[i] = e;
        }
        __syncthreads();
        if (t == 0) {
            int i = 0;
            for (; i + 8 <= cl; i += 8) {
                float e8[8];
                for (int u = 0; u < 8; u++) e8[u] = ex[i + u];
                for (int u = 0; u < 8; u++) sum += e8[u];
            }
            for (; i < cl; i++) sum += ex[i];
        }
        __syncthreads();
    }
    if (t == 0) inv_s = (float)(1.0 / sum);
    __syncthreads();
    float inv = inv_s;
    for (int64_t i = t; i < n; i += blockDim.x) xr[i] = xr[i] * inv;
}

void kcu_softmax(kn_stream *s, float *x, int64_t m, int64_t n) {
    if (m == 0) return;
    KN_LAUNCH(k_softmax, dim3((unsigned)m), dim3(KCU_THREADS), st(s), x, n);
    launched(s);
}

/* (v, i) beats (bv, bi): NaN never wins, larger wins, then lower index. */
static KN_HD bool am_better(float v, int64_t i, float bv, int64_t bi) {
    if (v != v || i < 0) return false;
    if (bi < 0) return true;
    return v > bv || (v == bv && i < bi);
}

/* Row blockIdx.x in ns slices (blockIdx.y), each scanned by a block with
 * four loads in flight per thread, then reduced in shared memory: the
 * best (value, index) of its slice into pv/pi, or with one slice the
 * answer into out. "Better" is a total order on non-NaN values (larger,
 * then lower index), so the split changes no result; k_argmax_fin takes
 * the best of the slices. */
#define AM_SLICES 32
__global__ void __launch_bounds__(KCU_THREADS)
    k_argmax_part(const float *x, int64_t n, int ns, float *pv, int32_t *pi, int32_t *out) {
    __shared__ float bv_t[KCU_THREADS];
    __shared__ int64_t bi_t[KCU_THREADS];
    const float *xr = x + (int64_t)blockIdx.x * n;
    unsigned t = threadIdx.x, B = blockDim.x;
    int64_t per = (n + ns - 1) / ns, lo = (int64_t)blockIdx.y * per;
    int64_t hi = lo + per < n ? lo + per : n;
    float bv = 0.0f;
    int64_t bi = -1;
    for (int64_t i = lo + t; i < hi; i += 4 * (int64_t)B) {
        float v[4];
        for (int u = 0; u < 4; u++) v[u] = i + u * (int64_t)B < hi ? xr[i + u * (int64_t)B] : NAN;
        for (int u = 0; u < 4; u++)
            if (am_better(v[u], i + u * (int64_t)B, bv, bi)) {
                bv = v[u];
                bi = i + u * (int64_t)B;
            }
    }
    bv_t[t] = bv;
    bi_t[t] = bi;
    __syncthreads();
    for (unsigned w = B / 2; w > 0; w /= 2) {
        if (t < w && am_better(bv_t[t + w], bi_t[t + w], bv_t[t], bi_t[t])) {
            bv_t[t] = bv_t[t + w];
            bi_t[t] = bi_t[t + w];
        }
        __syncthreads();
    }
    if (t == 0 && ns == 1) {
        out[blockIdx.x] = bi_t[0] < 0 ? 0 : (int32_t)bi_t[0]; /* a row of NaN: 0, as the CPU's */
    } else if (t == 0) {
        pv[blockIdx.x * ns + blockIdx.y] = bv_t[0];
        pi[blockIdx.x * ns + blockIdx.y] = (int32_t)bi_t[0];
    }
}

__global__ void k_argmax_fin(const float *pv, const int32_t *pi, int32_t *out) {
    float bv = 0.0f;
    int64_t bi = -1;
    for (int j = 0; j < AM_SLICES; j++) {
        int64_t at = (int64_t)blockIdx.x * AM_SLICES + j;
        if (am_better(pv[at], pi[at], bv, bi)) {
            bv = pv[at];
            bi = pi[at];
        }
    }
    out[blockIdx.x] = bi < 0 ? 0 : (int32_t)bi; /* a row of NaN: 0, as the CPU's */
}

/* The slices' partial results go in the stream's workspace; a stream with
 * too little for them scans each row with one block. */
void kcu_argmax(kn_stream *s, const float *x, int32_t *out, int64_t m, int64_t n) {
    if (m == 0) return;
    KCU_ASSERT((KCU_THREADS & (KCU_THREADS - 1)) == 0); /* the reduction tree halves */
    size_t part = (size_t)m * AM_SLICES;
    if (part * (sizeof(float) + sizeof(int32_t)) > KN_CU(s)->work_bytes) {
        KN_LAUNCH(k_argmax_part, dim3((unsigned)m, 1), dim3(KCU_THREADS), st(s), x, n, 1, (float *)NULL,
                  (int32_t *)NULL, out);
        launched(s);
        return;
    }
    float *pv = (float *)KN_CU(s)->work;
    int32_t *pi = (int32_t *)(void *)(pv + part);
    KN_LAUNCH(k_argmax_part, dim3((unsigned)m, AM_SLICES), dim3(KCU_THREADS), st(s), x, n, AM_SLICES, pv, pi,
              (int32_t *)NULL);
    launched(s);
    KN_LAUNCH(k_argmax_fin, dim3((unsigned)m), dim3(1), st(s), pv, pi, out);
    launched(s);
}

/* ---- top-k ----------------------------------------------------------------- */

/* (a, ia) before (b, ib): larger first, then the lower index. */
static __device__ __forceinline__ bool tk_before(float a, int32_t ia, float b, int32_t ib) {
    return a > b || (a == b && ia < ib);
}

/* The best k (value, index) pairs of one row, by one block: each thread
 * keeps the best k of its stride of the row, sorted; then halving rounds
 * merge pairs of lists in shared memory (sv, si: [KCU_THREADS][k]), and
 * list 0 holds the result. A selection under one total order (value,
 * then index), so any split gives the CPU's result. Unfilled places hold
 * (-inf, INT32_MAX), after every real element. V: the value of element
 * i (NaN mapped to -inf by the caller). */
template <class V>
static __device__ void tk_select(const V &value_of, int64_t n, int k, float (*sv)[KN_TOPK_MAX],
                                 int32_t (*si)[KN_TOPK_MAX]) {
    const unsigned tid = threadIdx.x;
    float *v = sv[tid];
    int32_t *id = si[tid];
    for (int j = 0; j < k; j++) v[j] = -INFINITY, id[j] = INT32_MAX;
    for (int64_t i = tid; i < n; i += KCU_THREADS) {
        float a = value_of(i);
        if (!tk_before(a, (int32_t)i, v[k - 1], id[k - 1])) continue;
        int j = k - 1;
        for (; j > 0 && tk_before(a, (int32_t)i, v[j - 1], id[j - 1]); j--) {
            v[j] = v[j - 1];
            id[j] = id[j - 1];
        }
        v[j] = a;
        id[j] = (int32_t)i;
    }
    __syncthreads();
    for (unsigned half = KCU_THREADS / 2; half > 0; half /= 2) {
        float mv[KN_TOPK_MAX];
        int32_t mi[KN_TOPK_MAX];
        if (tid < half) {
            const float *b = sv[tid + half];
            const int32_t *ib = si[tid + half];
            for (int j = 0, p = 0, q = 0; j < k; j++) {
                bool left = tk_before(v[p], id[p], b[q], ib[q]);
                mv[j] = left ? v[p] : b[q];
                mi[j] = left ? id[p] : ib[q];
                p += left, q += !left;
            }
        }
        __syncthreads();
        if (tid < half)
            for (int j = 0; j < k; j++) v[j] = mv[j], id[j] = mi[j];
        __syncthreads();
    }
}

/* A row's values as they are, NaN as -inf. */
struct tk_raw {
    const float *row;
    __device__ float operator()(int64_t i) const {
        float a = row[i];
        return a != a ? -INFINITY : a;
    }
};

__global__ void __launch_bounds__(KCU_THREADS) k_topk(const float *x, int64_t n, int32_t k, int32_t *idx, float *val) {
    __shared__ float sv[KCU_THREADS][KN_TOPK_MAX];
    __shared__ int32_t si[KCU_THREADS][KN_TOPK_MAX];
    tk_raw raw = {x + (int64_t)blockIdx.x * n};
    tk_select(raw, n, k, sv, si);
    if (threadIdx.x < (unsigned)k) {
        idx[(int64_t)blockIdx.x * k + threadIdx.x] = si[0][threadIdx.x];
        val[(int64_t)blockIdx.x * k + threadIdx.x] = sv[0][threadIdx.x];
    }
}

/* ---- sampling ------------------------------------------------------------ */

/* Block reductions over KCU_THREADS values in shared memory, halving;
 * the same result in any order (max, integer sum, a least pair). The
 * caller's every thread reaches them. */
static __device__ float br_max(float v, float *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned h = KCU_THREADS / 2; h > 0; h /= 2) {
        if (threadIdx.x < h && sh[threadIdx.x + h] > sh[threadIdx.x]) sh[threadIdx.x] = sh[threadIdx.x + h];
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

static __device__ int64_t br_sum(int64_t v, int64_t *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned h = KCU_THREADS / 2; h > 0; h /= 2) {
        if (threadIdx.x < h) sh[threadIdx.x] += sh[threadIdx.x + h];
        __syncthreads();
    }
    int64_t r = sh[0];
    __syncthreads();
    return r;
}

/* The least (key, index), lower index first among equal keys; index -1:
 * none. */
static __device__ int32_t br_least(uint32_t key, int32_t at, uint32_t *kh, int32_t *ih) {
    kh[threadIdx.x] = key;
    ih[threadIdx.x] = at;
    __syncthreads();
    for (unsigned h = KCU_THREADS / 2; h > 0; h /= 2) {
        if (threadIdx.x < h) {
            uint32_t k2 = kh[threadIdx.x + h];
            int32_t i2 = ih[threadIdx.x + h];
            if (i2 >= 0 &&
                (ih[threadIdx.x] < 0 || k2 < kh[threadIdx.x] || (k2 == kh[threadIdx.x] && i2 < ih[threadIdx.x]))) {
                kh[threadIdx.x] = k2;
                ih[threadIdx.x] = i2;
            }
        }
        __syncthreads();
    }
    int32_t r = ih[0];
    __syncthreads();
    return r;
}

/* A row's scores s = (x - lmax) / t, the finite ones; the others -inf
 * (not kept, and below every kept score). */
struct tk_scores {
    const float *row;
    float lmax, t;
    __device__ float operator()(int64_t i) const {
        float l = row[i];
        if (!isfinite(l)) return -INFINITY;
        float sc = (l - lmax) / t;
        return isfinite(sc) ? sc : -INFINITY;
    }
};

/* One block a row: sample.c's kept_set and race without top-p, step by
 * step in the same f32 operations. Greedy (temperature <= 0), and a row
 * with no finite logit or score, take kn_argmax's pick. */
__global__ void __launch_bounds__(KCU_THREADS) k_sample(const float *x, int64_t n, const kn_draw *draws, int32_t *out) {
    __shared__ float sv[KCU_THREADS][KN_TOPK_MAX];
    __shared__ int32_t si[KCU_THREADS][KN_TOPK_MAX];
    __shared__ float fsh[KCU_THREADS];
    __shared__ int64_t nsh[KCU_THREADS];
    __shared__ uint32_t ksh[KCU_THREADS];
    __shared__ int32_t ish[KCU_THREADS];
    const kn_draw d = draws[blockIdx.x];
    const float *row = x + (int64_t)blockIdx.x * n;
    const unsigned tid = threadIdx.x;
    /* the largest finite logit, and the greedy pick: the largest value,
     * NaN never, the lowest index among equal ones (as keys: the bits of
     * -v order as -v does only for one sign, so compare as floats) */
    float lmax_t = -INFINITY, best = 0.0f;
    int32_t best_i = -1;
    for (int64_t i = tid; i < n; i += KCU_THREADS) {
        float l = row[i];
        if (isfinite(l) && l > lmax_t) lmax_t = l;
        if (l == l && (best_i < 0 || l > best)) best = l, best_i = (int32_t)i;
    }
    const float lmax = br_max(lmax_t, fsh);
    /* the greedy pick's reduction: among the threads' picks, the largest,
     * then the lowest index */
    fsh[tid] = best;
    ish[tid] = best_i;
    __syncthreads();
    for (unsigned h = KCU_THREADS / 2; h > 0; h /= 2) {
        if (tid < h) {
            float v2 = fsh[tid + h];
            int32_t i2 = ish[tid + h];
            if (i2 >= 0 && (ish[tid] < 0 || v2 > fsh[tid] || (v2 == fsh[tid] && i2 < ish[tid]))) {
                fsh[tid] = v2;
                ish[tid] = i2;
            }
        }
        __syncthreads();
    }
    const int32_t greedy = ish[0] < 0 ? 0 : ish[0];
    __syncthreads();
    if (!(d.temperature > 0.0f) || lmax == -INFINITY) {
        if (tid == 0) out[blockIdx.x] = greedy;
        return; /* the same in every thread */
    }
    /* 1. temperature: the kept scores, their count and their largest */
    const tk_scores sc = {row, lmax, d.temperature};
    float smax_t = -INFINITY;
    int64_t n_t = 0;
    for (int64_t i = tid; i < n; i += KCU_THREADS) {
        float v = sc(i);
        if (v == -INFINITY) continue;
        n_t++;
        if (v > smax_t) smax_t = v;
    }
    const int64_t n_fin = br_sum(n_t, nsh);
    const float smax = br_max(smax_t, fsh);
    if (n_fin == 0) {
        if (tid == 0) out[blockIdx.x] = greedy;
        return;
    }
    /* 2. top-k: everything >= the k-th largest score */
    float kth = -INFINITY;
    if (d.top_k > 0 && d.top_k < n_fin) {
        tk_select(sc, n, d.top_k, sv, si);
        kth = sv[0][d.top_k - 1];
    }
    /* (3. top-p: not on the device.) 4. min-p, and the race: the least
     * E / w over the kept tokens */
    const float min_p = d.min_p > 1.0f ? 1.0f : d.min_p > 0.0f ? d.min_p : 0.0f;
    uint32_t best_key = 0;
    int32_t at_t = -1;
    for (int64_t i = tid; i < n; i += KCU_THREADS) {
        float v = sc(i);
        if (v == -INFINITY || v < kth) continue;
        float w = expf(v - smax);
        if (w < min_p) continue;
        uint32_t key = kn_draw_f32_bits(kn_draw_exp(kn_draw_bits(d.key_lo, d.key_hi, (uint32_t)i)) / w);
        if (at_t < 0 || key < best_key) best_key = key, at_t = (int32_t)i;
    }
    int32_t won = br_least(best_key, at_t, ksh, ish);
    if (tid == 0) out[blockIdx.x] = won < 0 ? greedy : won;
}

void kcu_sample(kn_stream *s, const float *x, int64_t m, int64_t n, const kn_draw *draws, int32_t *out) {
    if (m == 0) return;
    KCU_ASSERT(m <= INT32_MAX);
    KN_LAUNCH(k_sample, dim3((unsigned)m), dim3(KCU_THREADS), st(s), x, n, draws, out);
    launched(s);
}

void kcu_topk(kn_stream *s, const float *x, int64_t m, int64_t n, int32_t k, int32_t *idx, float *val) {
    if (m == 0) return;
    KCU_ASSERT((KCU_THREADS & (KCU_THREADS - 1)) == 0 && m <= INT32_MAX); /* the merge halves */
    KN_LAUNCH(k_topk, dim3((unsigned)m), dim3(KCU_THREADS), st(s), x, n, k, idx, val);
    launched(s);
}
