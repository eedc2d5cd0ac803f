/* The CUDA backend's KV cache and attention: kv_write and kv_move, and
 * attention. For decode and verify (up to KN_ATTN_SPLIT_M tokens) a block
 * per (token, head, chunk) makes the chunk's partial and a second kernel
 * merges them in order; for more tokens (prefill, large trees) a block
 * per 8 tokens and head walks their chunks, merging as it goes, and loads
 * a chunk that lies in all 8 tokens' prefixes once for the 8. Both are
 * kn_attention.c's arithmetic. */
#include "kn_cuda_kernel.h"

/* ---- KV cache ----------------------------------------------------------------- */

/* Element offset of slot `slot` of sequence row `seq` (kn_attention.c). */
static __device__ size_t slot_row(const kn_kv_pool &kv, const kn_kv_map &map, int32_t seq, int32_t slot) {
    int32_t blk = map.block_tables[(size_t)seq * (size_t)map.table_len + (size_t)(slot / kv.block_size)];
    size_t row = (size_t)blk * (size_t)kv.block_size + (size_t)(slot % kv.block_size);
    return row * (size_t)kv.n_kv_heads * (size_t)kv.head_dim;
}

__global__ void k_kv_write(kn_kv_pool kv, kn_kv_map map, const float *k, const float *v) {
    int64_t width = (int64_t)kv.n_kv_heads * kv.head_dim;
    for (int64_t i = flat_start(); i < (int64_t)map.m * width; i += flat_step()) {
        int64_t t = i / width, e = i % width;
        size_t at = slot_row(kv, map, map.seq[t], map.slot[t]) + (size_t)e;
        ((uint16_t *)kv.k)[at] = f32_to_half(k[i]);
        ((uint16_t *)kv.v)[at] = f32_to_half(v[i]);
    }
}

void kcu_kv_write(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *k, const float *v) {
    if (map->m == 0) return;
    KN_LAUNCH(k_kv_write, flat_grid((int64_t)map->m * kv->n_kv_heads * kv->head_dim), dim3(KCU_THREADS), st(s), *kv,
              *map, k, v);
    launched(s);
}

/* One block, the moves in order: a later one may read what an earlier
 * one wrote. */
__global__ void k_kv_move(kn_kv_pool kv, const int32_t *src, const int32_t *dst, int32_t n) {
    size_t row = (size_t)kv.n_kv_heads * (size_t)kv.head_dim;
    uint16_t *K = (uint16_t *)kv.k, *V = (uint16_t *)kv.v;
    for (int32_t i = 0; i < n; i++) {
        int32_t a = src[i], b = dst[i];
        if (a != b)
            for (size_t e = threadIdx.x; e < row; e += blockDim.x) {
                K[(size_t)b * row + e] = K[(size_t)a * row + e];
                V[(size_t)b * row + e] = V[(size_t)a * row + e];
            }
        __syncthreads();
    }
}

void kcu_kv_move(kn_stream *s, const kn_kv_pool *kv, const int32_t *src_rows, const int32_t *dst_rows, int32_t n) {
    KN_LAUNCH(k_kv_move, dim3(1), dim3(KCU_THREADS), st(s), *kv, src_rows, dst_rows, n);
    launched(s);
}

/* ---- attention ------------------------------------------------------------------ */

#define AT_CHUNK KN_ATTN_CHUNK
#define AT_DPT (KN_MAX_HEAD_DIM / KCU_THREADS) /* output elements per thread */

/* Chunk [c0, c0 + n) of the visible keys of a token of sequence seq, for
 * the head whose K/V columns start at off (q in sh.qs). The chunk's K and V
 * rows come into shared memory first (kv_s: [2][AT_CHUNK][head_dim + 2]
 * halves, the 2 keeping a column's reads in distinct banks), all threads
 * loading, 4 bytes each. Then thread j < n scores key j (8 lanes of
 * mul-then-add, the lane tree, times scale); thread 0 takes the chunk's
 * maximum and l = sum e^(s - mc) in key order into *mc_s, *l_s; each
 * thread sums o for its own elements in key order. Every thread of the
 * block calls it. */
#define AT_KS (KN_MAX_HEAD_DIM + 2)
struct at_shared { /* a block's shared memory for attention */
    float qs[KN_MAX_HEAD_DIM];
    float sc[AT_CHUNK];
    size_t rows[AT_CHUNK];
    uint16_t kv_s[2][AT_CHUNK][AT_KS];
    float mc_s, l_s;
};
/* The n K and V rows at sh.rows into sh.kv_s, all threads loading, 4
 * bytes each; then a barrier. Every thread of the block calls it. */
static __device__ void at_load(const kn_kv_pool &kv, at_shared &sh, int n) {
    const int hd = kv.head_dim, hs = hd + 2;
    const uint16_t *K = (const uint16_t *)kv.k, *V = (const uint16_t *)kv.v;
    for (int u = (int)threadIdx.x; u < 2 * n * (hd / 2); u += KCU_THREADS) {
        int which = u / (n * (hd / 2)), r = u % (n * (hd / 2)), j = r / (hd / 2), d = r % (hd / 2) * 2;
        uint32_t w = ld32a((which ? V : K) + sh.rows[j] + (size_t)d);
        uint16_t *dst = &((uint16_t *)sh.kv_s[which])[j * hs + d];
        dst[0] = (uint16_t)(w & 0xffffu);
        dst[1] = (uint16_t)(w >> 16);
    }
    __syncthreads();
}

/* Key j's score against the query qs: 8 lanes of mul-then-add, the lane
 * tree, times scale. */
static __device__ float at_score(const float *qs, const uint16_t *kr, int hd, float scale) {
    float a[8];
    for (int l = 0; l < 8; l++) a[l] = 0.0f;
    for (int d = 0; d < hd; d += 8)
        for (int l = 0; l < 8; l++) {
            float p = qs[d + l] * half_to_f32(kr[d + l]);
            a[l] = a[l] + p;
        }
    float tr = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    return tr * scale;
}

/* The chunk's maximum of its n scores, then each score replaced by
 * e^(s - mc) and their sum l, in key order (one thread). */
static __device__ void at_exp(float *sc, int n, float *mc_out, float *l_out) {
    float mc = -INFINITY;
    for (int j = 0; j < n; j++) mc = sc[j] > mc ? sc[j] : mc;
    float l = 0.0f;
    for (int j = 0; j < n; j++) {
        float p = exp_neg(sc[j] - mc);
        sc[j] = p;
        l = l + p;
    }
    *mc_out = mc;
    *l_out = l;
}

/* This thread's elements of o = sum_j e_j v_j, in key order. K and V
 * rows lie hd + 2 halves apart in kv_s (at_load). */
static __device__ void at_values(const uint16_t *vs, const float *sc, int n, int hd, float *o) {
    for (int e = 0; e < AT_DPT; e++) {
        int d = (int)threadIdx.x + e * KCU_THREADS;
        float oe = 0.0f;
        if (d < hd)
            for (int j = 0; j < n; j++) {
                float pv = half_to_f32(vs[j * (hd + 2) + d]) * sc[j];
                oe = oe + pv;
            }
        o[e] = oe;
    }
}

static __device__ void at_chunk(const kn_kv_pool &kv, const kn_kv_map &map, at_shared &sh, int32_t seq,
                                int32_t n_prefix, const int32_t *extra, size_t off, int64_t c0, int n, float scale,
                                float *o) {
    const int hd = kv.head_dim;
    unsigned tid = threadIdx.x;
    if ((int)tid < n) {
        int64_t vi = c0 + tid;
        int32_t slot = vi < n_prefix ? (int32_t)vi : extra[vi - n_prefix];
        sh.rows[tid] = slot_row(kv, map, seq, slot) + off;
    }
    __syncthreads();
    at_load(kv, sh, n);
    if ((int)tid < n) sh.sc[tid] = at_score(sh.qs, &sh.kv_s[0][0][0] + tid * (hd + 2), hd, scale);
    __syncthreads();
    if (tid == 0) at_exp(sh.sc, n, &sh.mc_s, &sh.l_s);
    __syncthreads();
    at_values(&sh.kv_s[1][0][0], sh.sc, n, hd, o);
}

/* The running state (M, L, O) after a chunk (mc, l, o) in order; the
 * first chunk starts it. kn_attention.c's merge. */
static __device__ void at_merge(bool first, float mc, float l, const float *o, float *M, float *L, float *O) {
    float a = 0.0f, b = 0.0f;
    if (!first) {
        float mn = mc > *M ? mc : *M;
        a = exp_neg(*M - mn);
        b = exp_neg(mc - mn);
        float la = *L * a, lb = l * b;
        *L = la + lb;
        *M = mn;
    } else {
        *M = mc;
        *L = l;
    }
    for (int e = 0; e < AT_DPT; e++) {
        if (first) {
            O[e] = o[e];
        } else {
            float x = O[e] * a, y = o[e] * b;
            O[e] = x + y;
        }
    }
}

/* Token t's query for head h into shared memory; its sequence, prefix,
 * extra slots, visible count and K/V column offset. */
struct at_tok {
    int32_t seq, n_prefix;
    const int32_t *extra;
    int64_t n_vis;
    size_t off;
};
static __device__ at_tok at_token(const kn_kv_pool &kv, const kn_kv_map &map, const float *q, int32_t n_heads,
                                  int32_t t, int32_t h, float *qs) {
    const int hd = kv.head_dim;
    const float *qh = q + ((size_t)t * (size_t)n_heads + (size_t)h) * (size_t)hd;
    for (int d = (int)threadIdx.x; d < hd; d += KCU_THREADS) qs[d] = qh[d];
    at_tok k;
    k.seq = map.seq[t];
    k.n_prefix = map.n_prefix[t];
    k.extra = map.extra + map.extra_start[t];
    k.n_vis = (int64_t)k.n_prefix + map.n_extra[t];
    k.off = (size_t)(h / (n_heads / kv.n_kv_heads)) * (size_t)hd;
    return k;
}

/* Prefill and large trees (m > KN_ATTN_SPLIT_M), flash-style: a block
 * takes AT_GROUP tokens of the batch (blockIdx.x) for one head
 * (blockIdx.y; tokens on x, as grid y stops at 65535). Where the group's
 * tokens are all of one sequence, the chunks that lie wholly in every
 * token's prefix (a prefill chunk's earlier keys, a tree's committed
 * context) are loaded once for the group and scored for each token;
 * every token's other chunks (the last part of its prefix, a tree node's
 * ancestors) follow, token by token. Each token still makes each of its
 * chunks with at_chunk's arithmetic and merges them in order, so the bits
 * are k_attn_part's and the CPU's; only the loads are shared. */
#define AT_GROUP 8
struct at_group_shared {
    at_shared one;
    float qg[AT_GROUP][KN_MAX_HEAD_DIM];
    float scg[AT_GROUP][AT_CHUNK];
    float mcg[AT_GROUP], lg[AT_GROUP];
    int32_t n_shared;
};
__global__ void __launch_bounds__(KCU_THREADS)
    k_attn_group(kn_kv_pool kv, kn_kv_map map, const float *q, float *out, int32_t n_heads, float scale) {
    __shared__ at_group_shared gs;
    at_shared &sh = gs.one;
    int32_t t0 = (int32_t)blockIdx.x * AT_GROUP, h = (int32_t)blockIdx.y;
    int nq = map.m - t0 < AT_GROUP ? map.m - t0 : AT_GROUP;
    const int hd = kv.head_dim;
    unsigned tid = threadIdx.x;
    for (int u = (int)tid; u < nq * hd; u += KCU_THREADS) {
        int qi = u / hd, d = u % hd;
        gs.qg[qi][d] = q[((size_t)(t0 + qi) * (size_t)n_heads + (size_t)h) * (size_t)hd + (size_t)d];
    }
    int32_t seq = map.seq[t0];
    if (tid == 0) {
        int32_t n = INT32_MAX;
        for (int qi = 0; qi < nq; qi++) {
            int32_t w = map.seq[t0 + qi] == seq ? map.n_prefix[t0 + qi] / AT_CHUNK : 0;
            n = w < n ? w : n;
        }
        gs.n_shared = n;
    }
    __syncthreads();
    const int32_t n_shared = gs.n_shared;
    const size_t off = (size_t)(h / (n_heads / kv.n_kv_heads)) * (size_t)hd;
    float M[AT_GROUP], L[AT_GROUP], O[AT_GROUP][AT_DPT];
    for (int32_t c = 0; c < n_shared; c++) {
        if ((int)tid < AT_CHUNK) sh.rows[tid] = slot_row(kv, map, seq, c * AT_CHUNK + (int32_t)tid) + off;
        __syncthreads();
        at_load(kv, sh, AT_CHUNK);
        for (int u = (int)tid; u < nq * AT_CHUNK; u += KCU_THREADS) {
            int qi = u / AT_CHUNK, j = u % AT_CHUNK;
            gs.scg[qi][j] = at_score(gs.qg[qi], &sh.kv_s[0][0][0] + j * (hd + 2), hd, scale);
        }
        __syncthreads();
        if ((int)tid < nq) at_exp(gs.scg[tid], AT_CHUNK, &gs.mcg[tid], &gs.lg[tid]);
        __syncthreads();
        KCU_UNROLL
        for (int qi = 0; qi < AT_GROUP; qi++) { /* a constant count: M, L and O stay in registers */
            if (qi >= nq) break;
            float o[AT_DPT];
            at_values(&sh.kv_s[1][0][0], gs.scg[qi], AT_CHUNK, hd, o);
            at_merge(c == 0, gs.mcg[qi], gs.lg[qi], o, &M[qi], &L[qi], O[qi]);
        }
        __syncthreads();
    }
    KCU_UNROLL
    for (int qi = 0; qi < AT_GROUP; qi++) {
        if (qi >= nq) break;
        at_tok k = at_token(kv, map, q, n_heads, t0 + qi, h, sh.qs);
        __syncthreads();
        for (int64_t c0 = (int64_t)n_shared * AT_CHUNK; c0 < k.n_vis; c0 += AT_CHUNK) {
            int n = k.n_vis - c0 < AT_CHUNK ? (int)(k.n_vis - c0) : AT_CHUNK;
            float o[AT_DPT];
            at_chunk(kv, map, sh, k.seq, k.n_prefix, k.extra, k.off, c0, n, scale, o);
            at_merge(c0 == 0, sh.mc_s, sh.l_s, o, &M[qi], &L[qi], O[qi]);
            __syncthreads();
        }
        float *oh = out + ((size_t)(t0 + qi) * (size_t)n_heads + (size_t)h) * (size_t)hd;
        for (int e = 0; e < AT_DPT; e++) {
            int d = (int)tid + e * KCU_THREADS;
            if (d < hd) oh[d] = O[qi][e] / L[qi];
        }
    }
}

/* Decode and verify (m <= KN_ATTN_SPLIT_M): the chunks of every (token,
 * head) at once, a block each (blockIdx.z; chunks past the token's keys
 * return), their (mc, l, o) into part, [t][h][chunk][2 + head_dim]; then
 * k_attn_merge merges each token's chunks in order. The arithmetic is
 * k_attn_group's, so the bits are too. */
__global__ void __launch_bounds__(KCU_THREADS)
    k_attn_part(kn_kv_pool kv, kn_kv_map map, const float *q, int32_t n_heads, float scale, int32_t n_chunks,
                float *part) {
    __shared__ at_shared sh;
    int32_t t = (int32_t)blockIdx.x, h = (int32_t)blockIdx.y;
    int64_t c0 = (int64_t)blockIdx.z * AT_CHUNK;
    at_tok k = at_token(kv, map, q, n_heads, t, h, sh.qs);
    if (c0 >= k.n_vis) return; /* the same in every thread */
    int n = k.n_vis - c0 < AT_CHUNK ? (int)(k.n_vis - c0) : AT_CHUNK;
    float o[AT_DPT];
    __syncthreads();
    at_chunk(kv, map, sh, k.seq, k.n_prefix, k.extra, k.off, c0, n, scale, o);
    const int hd = kv.head_dim;
    float *p = part + (((size_t)t * (size_t)n_heads + (size_t)h) * (size_t)n_chunks + blockIdx.z) * (size_t)(hd + 2);
    if (threadIdx.x == 0) {
        p[0] = sh.mc_s;
        p[1] = sh.l_s;
    }
    for (int e = 0; e < AT_DPT; e++) {
        int d = (int)threadIdx.x + e * KCU_THREADS;
        if (d < hd) p[2 + d] = o[e];
    }
}

__global__ void __launch_bounds__(KCU_THREADS)
    k_attn_merge(kn_kv_pool kv, kn_kv_map map, float *out, int32_t n_heads, int32_t n_chunks, const float *part) {
    int32_t t = (int32_t)blockIdx.x, h = (int32_t)blockIdx.y;
    const int hd = kv.head_dim;
    int64_t n_vis = (int64_t)map.n_prefix[t] + map.n_extra[t];
    const float *p0 = part + ((size_t)t * (size_t)n_heads + (size_t)h) * (size_t)n_chunks * (size_t)(hd + 2);
    float M = 0.0f, L = 0.0f, O[AT_DPT], o[AT_DPT];
    for (int64_t c = 0; c * AT_CHUNK < n_vis && c < n_chunks; c++) {
        const float *p = p0 + (size_t)c * (size_t)(hd + 2);
        for (int e = 0; e < AT_DPT; e++) {
            int d = (int)threadIdx.x + e * KCU_THREADS;
            o[e] = d < hd ? p[2 + d] : 0.0f;
        }
        at_merge(c == 0, p[0], p[1], o, &M, &L, O);
    }
    if (n_vis > (int64_t)n_chunks * AT_CHUNK) L = NAN; /* map->max_visible said too few: loud, not wrong */
    float *oh = out + ((size_t)t * (size_t)n_heads + (size_t)h) * (size_t)hd;
    for (int e = 0; e < AT_DPT; e++) {
        int d = (int)threadIdx.x + e * KCU_THREADS;
        if (d < hd) oh[d] = O[e] / L;
    }
}

/* Split where the partials fit the stream's workspace (sized by
 * kn_attention_workspace for KN_ATTN_SPLIT_M tokens); a token sees at
 * most map->max_visible slots, or its block table's. */
void kcu_attention(kn_stream *s, const kn_kv_pool *kv, const kn_kv_map *map, const float *q, float *out,
                   int32_t n_heads) {
    if (map->m == 0) return;
    KCU_ASSERT((uintptr_t)kv->k % 4 == 0 && (uintptr_t)kv->v % 4 == 0 && kv->head_dim % 8 == 0); /* at_chunk's loads */
    float scale = 1.0f / sqrtf((float)kv->head_dim);
    int64_t max_keys = map->max_visible > 0 ? map->max_visible : (int64_t)map->table_len * kv->block_size;
    int32_t n_chunks = (int32_t)((max_keys + AT_CHUNK - 1) / AT_CHUNK);
    size_t part_bytes =
        (size_t)map->m * (size_t)n_heads * (size_t)n_chunks * (size_t)(kv->head_dim + 2) * sizeof(float);
    if (map->m <= KN_ATTN_SPLIT_M && n_chunks > 1 && n_chunks <= 65535 && part_bytes <= KN_CU(s)->work_bytes) {
        float *part = (float *)KN_CU(s)->work;
        KN_LAUNCH(k_attn_part, dim3((unsigned)map->m, (unsigned)n_heads, (unsigned)n_chunks), dim3(KCU_THREADS), st(s),
                  *kv, *map, q, n_heads, scale, n_chunks, part);
        launched(s);
        KN_LAUNCH(k_attn_merge, dim3((unsigned)map->m, (unsigned)n_heads), dim3(KCU_THREADS), st(s), *kv, *map, out,
                  n_heads, n_chunks, part);
        launched(s);
        return;
    }
    KN_LAUNCH(k_attn_group, dim3((unsigned)((map->m + AT_GROUP - 1) / AT_GROUP), (unsigned)n_heads), dim3(KCU_THREADS),
              st(s), *kv, *map, q, out, n_heads, scale);
    launched(s);
}
