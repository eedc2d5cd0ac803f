/* The CUDA backend's kernels, built by g++ against the CPU stand-in of
 * kernels/cuda/shim (make test-cuda-cpu), against the CPU backend: every
 * op of kernels.h on small shapes, every output compared bit for bit
 * (kernels/cuda/kn_cuda.h: the CUDA kernels keep the CPU's reduction
 * orders; NaN counts as equal to NaN, since a GPU's NaN payloads differ).
 * The CUDA side runs as a backend whose memory is not the host's: inputs
 * are uploaded into its buffers and outputs downloaded, as the engine
 * does. Built under ASan+UBSan and under TSan: one pthread per CUDA
 * thread, so a missing __syncthreads is a race TSan reports. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <math.h>
#include <pthread.h>

#include "cuda_open.h"
#include "../../kernels/backend.h" /* a comm's op, called past kn_allreduce_sum */
#include "../../target/sample.h"
#include "../../services/core/pool.h"

#define WORK (1u << 20)

static const kn_backend *CU;
static pool *P;
static kn_stream *cpu15, *cpu8, *cu15, *cu8;

static int setup(void **state) {
    (void)state;
    ae_error err = {{0}};
    if (cuda_open_or_say(&CU) != 0) return -1;
    if (pool_init(&P, 2, &err) != AE_OK) return -1;
    if (kn_stream_init(&cpu15, &kn_backend_cpu, &(kn_stream_config){P, WORK}, &err) != AE_OK ||
        kn_stream_init(&cpu8, &kn_backend_cpu, &(kn_stream_config){P, WORK}, &err) != AE_OK ||
        kn_stream_init(&cu15, CU, &(kn_stream_config){NULL, WORK}, &err) != AE_OK ||
        kn_stream_init(&cu8, CU, &(kn_stream_config){NULL, WORK}, &err) != AE_OK)
        return -1;
    kn_stream_set_act_bits(cpu8, 8);
    kn_stream_set_act_bits(cu8, 8);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    kn_stream_free(cpu15);
    kn_stream_free(cpu8);
    kn_stream_free(cu15);
    kn_stream_free(cu8);
    pool_free(P);
    return 0;
}

/* ---- helpers --------------------------------------------------------------- */

static uint64_t rng = 0x2545f4914f6cdd1dull;
static uint32_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)rng;
}
static float frand(float lo, float hi) { return lo + (hi - lo) * (float)(rnd() >> 8) / 16777216.0f; }
static void fill(float *x, size_t n, float lo, float hi) {
    for (size_t i = 0; i < n; i++) x[i] = frand(lo, hi);
}

/* Device buffers made for a test, freed at its end. */
#define MAX_BUFS 256
static kn_buf bufs[MAX_BUFS];
static int n_bufs;

static void *dev(const void *host, size_t bytes) {
    assert_true(n_bufs < MAX_BUFS);
    kn_buf *b = &bufs[n_bufs++];
    assert_int_equal(kn_buf_from_host(CU, b, host, bytes, NULL), AE_OK);
    return b->ptr;
}
static kn_buf *last_buf(void) { return &bufs[n_bufs - 1]; }
static void *dev_zero(size_t bytes) {
    assert_true(n_bufs < MAX_BUFS);
    kn_buf *b = &bufs[n_bufs++];
    assert_int_equal(kn_buf_alloc(CU, b, bytes, NULL), AE_OK);
    return b->ptr;
}
static void get(kn_stream *s, void *host, const void *dptr, size_t bytes) {
    for (int i = 0; i < n_bufs; i++) {
        uintptr_t lo = (uintptr_t)bufs[i].ptr, p = (uintptr_t)dptr;
        if (p >= lo && p - lo + bytes <= bufs[i].bytes) {
            kn_download(s, host, &bufs[i], p - lo, bytes);
            kn_stream_sync(s);
            return;
        }
    }
    fail_msg("no buffer holds that pointer");
}
/* A CUDA stream with no workspace: ops that would keep partials there
 * take their other way. */
static kn_stream *bare_stream(void) {
    kn_stream *s;
    ae_error err = {{0}};
    assert_int_equal(kn_stream_init(&s, CU, &(kn_stream_config){NULL, 0}, &err), AE_OK);
    return s;
}
static void free_bufs(void) {
    for (int i = 0; i < n_bufs; i++) kn_buf_free(&bufs[i]);
    n_bufs = 0;
}

/* Bit-equal floats, any NaN equal to any NaN. Returns the first index
 * that differs, or -1. */
static long first_diff(const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (a[i] != a[i] && b[i] != b[i]) continue;
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0) return (long)i;
    }
    return -1;
}

static int compared;
static void same(const char *what, const float *cpu, const float *cuda, size_t n) {
    long d = first_diff(cpu, cuda, n);
    if (d >= 0) fail_msg("%s: element %ld: cpu %.9g, cuda %.9g", what, d, (double)cpu[d], (double)cuda[d]);
    compared += (int)n;
}

/* The two ops whose CUDA build calls the device's libm (softmax's expf,
 * rope_table's cos and sin in double): bit-equal on the shim, whose libm
 * is the CPU's; on a GPU within rel of the CPU's value (expf is within 2
 * ulp), and the count of bit-equal values is printed. */
static void libm_near(const char *what, const float *cpu, const float *cuda, size_t n, double rel) {
#ifdef KN_TEST_GPU
    size_t equal = 0;
    for (size_t i = 0; i < n; i++) {
        double a = cpu[i], b = cuda[i];
        if (fabs(a - b) > rel * fabs(a) + 1e-30)
            fail_msg("%s: element %zu: cpu %.9g, cuda %.9g (beyond %g)", what, i, a, b, rel);
        equal += memcmp(&cpu[i], &cuda[i], sizeof(float)) == 0;
    }
    printf("%s: %zu of %zu values bit-equal, all within %g\n", what, equal, n, rel);
    compared += (int)n;
#else
    (void)rel;
    same(what, cpu, cuda, n);
#endif
}

/* ---- weights ---------------------------------------------------------------- */

static const ggml_type TYPES[] = {GGML_TYPE_F32,  GGML_TYPE_F16,  GGML_TYPE_BF16,
                                  GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1};

/* Random rows of type t with sane scales: f16 d in [-0.05, 0.05], Q4_1's
 * m in [-0.1, 0.1]; floats in [-1, 1]. */
static uint8_t *make_rows(ggml_type t, int64_t rows, int64_t cols, size_t *row_bytes) {
    size_t rb = quant_row_bytes(t, (uint64_t)cols);
    uint8_t *d = malloc((size_t)rows * rb);
    assert_non_null(d);
    for (size_t i = 0; i < (size_t)rows * rb; i++) d[i] = (uint8_t)rnd();
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *row = d + (size_t)r * rb;
        for (int64_t i = 0; i < cols; i++) {
            uint16_t h;
            switch (t) {
            case GGML_TYPE_F32: {
                float f = frand(-1, 1);
                memcpy(row + 4 * i, &f, 4);
                break;
            }
            case GGML_TYPE_F16:
                h = quant_f32_to_f16(frand(-1, 1));
                memcpy(row + 2 * i, &h, 2);
                break;
            case GGML_TYPE_BF16:
                h = quant_f32_to_bf16(frand(-1, 1));
                memcpy(row + 2 * i, &h, 2);
                break;
            default: break;
            }
        }
        if (t == GGML_TYPE_Q8_0 || t == GGML_TYPE_Q4_0 || t == GGML_TYPE_Q4_1) {
            size_t bb = quant_block_bytes(t);
            for (int64_t b = 0; b < cols / 32; b++) {
                uint16_t h = quant_f32_to_f16(frand(-0.05f, 0.05f));
                memcpy(row + (size_t)b * bb, &h, 2);
                if (t == GGML_TYPE_Q4_1) {
                    h = quant_f32_to_f16(frand(-0.1f, 0.1f));
                    memcpy(row + (size_t)b * bb + 2, &h, 2);
                }
            }
        }
    }
    *row_bytes = rb;
    return d;
}

/* The same weight for both backends: host memory for the CPU, a buffer
 * for CUDA. */
typedef struct wpair {
    kn_weight cpu, cu;
    uint8_t *host;
} wpair;

static void make_weight(wpair *w, ggml_type t, int64_t rows, int64_t cols) {
    size_t rb;
    w->host = make_rows(t, rows, cols, &rb);
    w->cpu = (kn_weight){.type = t, .rows = rows, .cols = cols, .data = w->host, .row_bytes = rb};
    w->cu = w->cpu;
    w->cu.data = dev(w->host, (size_t)rows * rb);
    w->cu.buf = last_buf();
}

/* ---- tests ------------------------------------------------------------------- */

static void matmul_every_type_both_precisions(void **state) {
    (void)state;
    const int64_t ms[] = {1, 2, 3, 9, 33}, n = 40;
    for (size_t tk = 0; tk < 2 * sizeof TYPES / sizeof TYPES[0]; tk++) {
        ggml_type t = TYPES[tk / 2];
        bool q = t == GGML_TYPE_Q8_0 || t == GGML_TYPE_Q4_0 || t == GGML_TYPE_Q4_1;
        /* float rows of 100 get a tail after the 8 lanes (and f16/bf16
         * rows that are not 16-byte aligned); of 1184, several chunks of
         * aligned rows. Quantized rows of 37 blocks take one whole group
         * of 32 and a part of the next. */
        int64_t k = tk % 2 ? (q ? 37 * 32 : 1184) : (q ? 96 : 100);
        wpair w;
        make_weight(&w, t, n, k);
        for (size_t mi = 0; mi < sizeof ms / sizeof ms[0]; mi++) {
            int64_t m = ms[mi];
            float *x = malloc((size_t)(m * k) * sizeof(float)), *yc = malloc((size_t)(m * n) * sizeof(float)),
                  *yg = malloc((size_t)(m * n) * sizeof(float));
            fill(x, (size_t)(m * k), -2, 2);
            if (m > 1)
                for (int i = 0; i < 32; i++) x[k + i] = 0.0f; /* a zero block */
            if (m > 2) x[2 * k + 5] = INFINITY;               /* a block that makes NaN */
            float *dx = dev(x, (size_t)(m * k) * sizeof(float)), *dy = dev_zero((size_t)(m * n) * sizeof(float));
            for (int bits = 0; bits < (q ? 2 : 1); bits++) {
                kn_matmul(bits ? cpu8 : cpu15, &w.cpu, x, yc, m);
                kn_stream *cu = bits ? cu8 : cu15;
                kn_matmul(cu, &w.cu, dx, dy, m);
                get(cu, yg, dy, (size_t)(m * n) * sizeof(float)); /* on the stream that wrote dy */
                char what[64];
                snprintf(what, sizeof what, "matmul %s k=%lld m=%lld bits=%d", quant_type_name(t), (long long)k,
                         (long long)m, bits ? 8 : 15);
                same(what, yc, yg, (size_t)(m * n));
            }
            free(x), free(yc), free(yg);
        }
        free(w.host);
    }
    free_bufs();
    printf("matmul: %d outputs identical over 6 types, 2 widths each, m = 1, 2, 3, 9, 33\n", compared);
}

/* Column shards, as tensor parallelism cuts a row-parallel weight
 * (target/tp.c): data starts at the shard's first block and row_bytes
 * stays the full row's, so rows are strided; widths of 16 (a float shard
 * of a tiny model's o_proj) to 96. */
static void matmul_of_column_shards(void **state) {
    (void)state;
    const int64_t K = 128, n = 24;
    const int64_t shards[][2] = {{0, 16}, {16, 16}, {32, 32}, {64, 64}, {32, 96}};
    int before = compared;
    for (size_t ti = 0; ti < sizeof TYPES / sizeof TYPES[0]; ti++) {
        ggml_type t = TYPES[ti];
        bool q = t == GGML_TYPE_Q8_0 || t == GGML_TYPE_Q4_0 || t == GGML_TYPE_Q4_1;
        wpair w;
        make_weight(&w, t, n, K);
        for (size_t si = 0; si < sizeof shards / sizeof shards[0]; si++) {
            int64_t c0 = shards[si][0], kk = shards[si][1];
            if (q && (c0 % 32 || kk % 32)) continue;
            kn_weight vc = w.cpu, vg = w.cu;
            size_t off = quant_row_bytes(t, (uint64_t)c0);
            vc.data = (const uint8_t *)vc.data + off, vg.data = (const uint8_t *)vg.data + off;
            vc.cols = vg.cols = kk;
            for (int64_t m = 1; m <= 20; m += 19) {
                float *x = malloc((size_t)(m * kk) * sizeof(float)), *yc = malloc((size_t)(m * n) * sizeof(float)),
                      *yg = malloc((size_t)(m * n) * sizeof(float));
                fill(x, (size_t)(m * kk), -2, 2);
                float *dx = dev(x, (size_t)(m * kk) * sizeof(float)), *dy = dev_zero((size_t)(m * n) * sizeof(float));
                kn_matmul(cpu15, &vc, x, yc, m);
                kn_matmul(cu15, &vg, dx, dy, m);
                get(cu15, yg, dy, (size_t)(m * n) * sizeof(float));
                char what[80];
                snprintf(what, sizeof what, "shard matmul %s cols [%lld, %lld) m=%lld", quant_type_name(t),
                         (long long)c0, (long long)(c0 + kk), (long long)m);
                same(what, yc, yg, (size_t)(m * n));
                free(x), free(yc), free(yg);
            }
        }
        free(w.host);
    }
    free_bufs();
    printf("column shards: %d outputs identical over 6 types\n", compared - before);
}

/* ---- the allreduce of ranks on the CUDA backend (kn_cuda_comm.cu) ---- */

enum { AR_RANKS = 3, AR_CALLS = 6, AR_MAX = 700, AR_NORM_ROWS = 7, AR_NORM_N = 100 };
/* odd, one, the max; the last is the fused norm's 7 rows of 100 */
static const size_t AR_COUNT[AR_CALLS] = {576, 1, 700, 257, 576, AR_NORM_ROWS *AR_NORM_N};

typedef struct ar_rank {
    kn_comm *comm;
    kn_stream *s;
    float *part[AR_CALLS], *x[AR_CALLS]; /* the backend's: every call's partial and residual */
    const float *g;                      /* the norm's weights */
} ar_rank;

/* Rank r's partial of call i, and the residual every rank holds. */
static float ar_part(int r, int i, size_t j) {
    return (float)((int)(j * 7 + (size_t)r * 13 + (size_t)i) % 97) * 0.173f - 8.1f;
}
static float ar_resid(int i, size_t j) { return (float)((int)(j * 3 + (size_t)i) % 31) * 0.5f - 7.0f; }

/* The calls alternate: even ones kn_allreduce_sum, odd ones
 * kn_allreduce_add, the last kn_allreduce_add_rmsnorm (its norm written
 * over the partial), with no sync between them, so the slots of both
 * parities are reused while other ranks may still be behind. */
static void *ar_rank_main(void *arg) {
    ar_rank *rk = arg;
    for (int i = 0; i < AR_CALLS; i++) {
        if (i == AR_CALLS - 1)
            kn_allreduce_add_rmsnorm(rk->comm, rk->s, rk->part[i], rk->x[i], rk->g, rk->part[i], AR_NORM_ROWS,
                                     AR_NORM_N, 1e-5f);
        else if (i % 2 == 0)
            kn_allreduce_sum(rk->comm, rk->s, rk->part[i], AR_COUNT[i]);
        else
            kn_allreduce_add(rk->comm, rk->s, rk->part[i], rk->x[i], AR_COUNT[i]);
    }
    kn_stream_sync(rk->s);
    return NULL;
}

static void run_ranks(const kn_backend *be, kn_allreduce kind, int R, float out[AR_CALLS][AR_RANKS][AR_MAX],
                      kn_comm_stats *st) {
    kn_comm *comms[AR_RANKS];
    ae_error err = {{0}};
    if (kn_comm_init(be, kind, comms, R, NULL, AR_MAX, &err) != AE_OK) fail_msg("%s", err.msg);
    ar_rank rk[AR_RANKS];
    kn_buf held[AR_RANKS][AR_CALLS][2], gbuf;
    float host[AR_MAX], g[AR_NORM_N];
    for (int j = 0; j < AR_NORM_N; j++) g[j] = 0.5f + 0.01f * (float)j;
    assert_int_equal(kn_buf_from_host(be, &gbuf, g, sizeof g, &err), AE_OK);
    for (int r = 0; r < R; r++) {
        rk[r].comm = comms[r];
        rk[r].g = gbuf.ptr;
        assert_int_equal(kn_stream_init(&rk[r].s, be, &(kn_stream_config){be == CU ? NULL : P, 0}, &err), AE_OK);
        for (int i = 0; i < AR_CALLS; i++) {
            for (size_t j = 0; j < AR_MAX; j++) host[j] = ar_part(r, i, j);
            assert_int_equal(kn_buf_alloc(be, &held[r][i][0], sizeof host, &err), AE_OK);
            kn_upload(rk[r].s, &held[r][i][0], 0, host, sizeof host);
            for (size_t j = 0; j < AR_MAX; j++) host[j] = ar_resid(i, j);
            assert_int_equal(kn_buf_alloc(be, &held[r][i][1], sizeof host, &err), AE_OK);
            kn_upload(rk[r].s, &held[r][i][1], 0, host, sizeof host);
            rk[r].part[i] = held[r][i][0].ptr;
            rk[r].x[i] = held[r][i][1].ptr;
        }
        kn_stream_sync(rk[r].s);
    }
    pthread_t th[AR_RANKS];
    for (int r = 1; r < R; r++) assert_int_equal(pthread_create(&th[r], NULL, ar_rank_main, &rk[r]), 0);
    ar_rank_main(&rk[0]);
    for (int r = 1; r < R; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < R; r++) {
        for (int i = 0; i < AR_CALLS; i++) {
            /* a sum: the partial's buffer; an add: the residual's; the norm: the partial's */
            kn_download(rk[r].s, out[i][r], &held[r][i][i == AR_CALLS - 1 ? 0 : i % 2], 0, AR_COUNT[i] * sizeof(float));
            kn_stream_sync(rk[r].s);
            kn_buf_free(&held[r][i][0]);
            kn_buf_free(&held[r][i][1]);
        }
        st[r] = kn_comm_get_stats(comms[r]);
        assert_int_equal(kn_comm_kind(comms[r]), kind);
        kn_stream_free(rk[r].s);
    }
    kn_comm_free(comms, R);
    kn_buf_free(&gbuf);
}

/* Three ranks' custom allreduce gives the CPU communicator's bits on
 * every rank, alone and fused with the residual add, through both
 * parities of its slots; NCCL is refused on the shim with the reason. */
static void custom_allreduce_is_the_cpus_in_rank_order(void **state) {
    (void)state;
    static float cpu[AR_CALLS][AR_RANKS][AR_MAX], cu[AR_CALLS][AR_RANKS][AR_MAX];
    kn_comm_stats sc[AR_RANKS], sg[AR_RANKS];
    run_ranks(&kn_backend_cpu, KN_ALLREDUCE_CPU, AR_RANKS, cpu, sc);
    run_ranks(CU, KN_ALLREDUCE_CUSTOM, AR_RANKS, cu, sg);
    uint64_t bytes = 0;
    for (int i = 0; i < AR_CALLS; i++) {
        bytes += AR_COUNT[i] * sizeof(float);
        for (int r = 0; r < AR_RANKS; r++) {
            char what[64];
            snprintf(what, sizeof what, "allreduce call %d (%s) rank %d", i,
                     i == AR_CALLS - 1 ? "add and rmsnorm"
                     : i % 2           ? "add"
                                       : "sum",
                     r);
            same(what, cpu[i][r], cu[i][r], AR_COUNT[i]);
            same(what, cpu[i][0], cu[i][r], AR_COUNT[i]); /* every rank the same */
        }
        /* and the sum is the rank-order one, written out */
        for (size_t j = 0; j < AR_COUNT[i] && i < AR_CALLS - 1; j++) {
            float want = (ar_part(0, i, j) + ar_part(1, i, j)) + ar_part(2, i, j);
            if (i % 2) want = ar_resid(i, j) + want;
            assert_memory_equal(&cu[i][1][j], &want, sizeof want);
        }
    }
    for (int r = 0; r < AR_RANKS; r++) {
        assert_int_equal(sg[r].calls, AR_CALLS);
        assert_int_equal(sg[r].bytes, bytes);
        assert_int_equal(sc[r].calls, sg[r].calls);
        assert_int_equal(sc[r].bytes, sg[r].bytes);
    }
    kn_comm *c[2] = {NULL, NULL};
    ae_error err = {{0}};
    assert_int_equal(kn_comm_init(CU, KN_ALLREDUCE_NCCL, c, 2, NULL, 16, &err), AE_ERR);
#ifndef KN_TEST_GPU
    assert_string_equal(err.msg, "cuda comm: nccl: the CPU shim has no NCCL (it needs a GPU)");
#endif
    assert_null(c[0]);
    err.msg[0] = '\0';
    assert_int_equal(kn_comm_init(CU, KN_ALLREDUCE_CPU, c, 2, NULL, 16, &err), AE_ERR);
    assert_string_equal(err.msg, "cuda comm: the cuda backend's ranks reduce with --allreduce nccl or custom, not cpu");
    printf("custom allreduce: %d ranks x %d calls (sum, fused add, fused add and rmsnorm; %llu bytes a rank) bit-equal "
           "to the cpu's\n",
           AR_RANKS, AR_CALLS, (unsigned long long)bytes);
}

#ifdef KN_TEST_GPU
/* NCCL on a GPU, when tests/gpu/run.sh asks (AERIE_TEST_NCCL_RANKS; a
 * shim build has no NCCL). One rank: NCCL's op, called directly
 * (kn_allreduce_sum skips one rank), leaves the buffer's bits. Two ranks
 * on this one GPU (NCCL 2.30 or later, NCCL_MULTI_RANK_GPU_ENABLE=1): a
 * sum of two has one order, so the CPU's bits, alone and fused. */
static void nccl_allreduce_when_asked(void **state) {
    (void)state;
    const char *env = getenv("AERIE_TEST_NCCL_RANKS");
    if (!env || !env[0]) {
        printf("nccl: not asked (AERIE_TEST_NCCL_RANKS=1 or 2, on a GPU)\n");
        skip(); /* reported as skipped, not passed */
    }
    int R = atoi(env);
    assert_true(R == 1 || R == 2);
    ae_error err = {{0}};
    if (R == 1) {
        kn_comm *c[1];
        if (kn_comm_init(CU, KN_ALLREDUCE_NCCL, c, 1, NULL, 1024, &err) != AE_OK) fail_msg("%s", err.msg);
        float x[1024], y[1024];
        fill(x, 1024, -3, 3);
        float *dx = dev(x, sizeof x);
        for (int i = 0; i < 3; i++) c[0]->ops->allreduce(c[0], cu15, dx, 1024);
        get(cu15, y, dx, sizeof y);
        same("nccl, one rank", x, y, 1024);
        kn_comm_stats st = kn_comm_get_stats(c[0]);
        assert_true(st.ns > 0);
        printf("nccl, one rank: 3 allreduces of 1024 floats, the buffer unchanged, %.1f us each\n",
               (double)st.ns / 3e3);
        kn_comm_free(c, 1);
        free_bufs();
        return;
    }
    static float cpu[AR_CALLS][AR_RANKS][AR_MAX], cu[AR_CALLS][AR_RANKS][AR_MAX];
    kn_comm_stats sc[AR_RANKS], sg[AR_RANKS];
    run_ranks(&kn_backend_cpu, KN_ALLREDUCE_CPU, 2, cpu, sc);
    run_ranks(CU, KN_ALLREDUCE_NCCL, 2, cu, sg);
    for (int i = 0; i < AR_CALLS; i++)
        for (int r = 0; r < 2; r++) same("nccl, two ranks", cpu[i][r], cu[i][r], AR_COUNT[i]);
    printf("nccl, two ranks on one GPU: %d calls bit-equal to the cpu's, %.1f us a call on rank 0\n", AR_CALLS,
           (double)sg[0].ns / AR_CALLS / 1e3);
}
#endif

static void matmul_n_and_swiglu(void **state) {
    (void)state;
    const int64_t m = 5, k = 64, n = 48;
    for (int qi = 0; qi < 2; qi++) {
        ggml_type t = qi ? GGML_TYPE_Q4_1 : GGML_TYPE_F16;
        wpair a, b, c;
        make_weight(&a, t, n, k);
        make_weight(&b, t, n, k);
        make_weight(&c, t, n, k);
        float x[5 * 64], yc[3][5 * 48], yg[3][5 * 48];
        fill(x, sizeof x / sizeof x[0], -1, 1);
        float *dx = dev(x, sizeof x);
        float *dy[3] = {dev_zero(sizeof yc[0]), dev_zero(sizeof yc[0]), dev_zero(sizeof yc[0])};
        const kn_weight *wc[3] = {&a.cpu, &b.cpu, &c.cpu}, *wg[3] = {&a.cu, &b.cu, &c.cu};
        float *yc_p[3] = {yc[0], yc[1], yc[2]};
        kn_matmul_n(cpu15, 3, wc, x, yc_p, m);
        kn_matmul_n(cu15, 3, wg, dx, dy, m);
        for (int i = 0; i < 3; i++) {
            get(cu15, yg[i], dy[i], sizeof yg[i]);
            same("matmul_n", yc[i], yg[i], (size_t)(m * n));
        }
        kn_matmul_swiglu(cpu15, &a.cpu, &b.cpu, x, yc[0], yc[1], m);
        kn_matmul_swiglu(cu15, &a.cu, &b.cu, dx, dy[0], dy[1], m);
        get(cu15, yg[0], dy[0], sizeof yg[0]);
        get(cu15, yg[1], dy[1], sizeof yg[1]);
        same("matmul_swiglu gate", yc[0], yg[0], (size_t)(m * n));
        same("matmul_swiglu up", yc[1], yg[1], (size_t)(m * n));
        free(a.host), free(b.host), free(c.host);
        free_bufs();
    }
}

static void row_and_elementwise_ops(void **state) {
    (void)state;
    enum { M = 3, N = 100 };
    float x[M * N], g[N], b[N], yc[M * N], yg[M * N];
    fill(x, M * N, -3, 3);
    fill(g, N, 0.5f, 1.5f);
    fill(b, N, -1, 1);
    float *dx = dev(x, sizeof x), *dg = dev(g, sizeof g), *db = dev(b, sizeof b), *dy = dev_zero(sizeof yc);

    kn_rmsnorm(cpu15, x, g, yc, M, N, 1e-5f);
    kn_rmsnorm(cu15, dx, dg, dy, M, N, 1e-5f);
    get(cu15, yg, dy, sizeof yg);
    same("rmsnorm", yc, yg, M * N);

    kn_add(cpu15, x, yc, yc, M * N);
    kn_add(cu15, dx, dy, dy, M * N);
    get(cu15, yg, dy, sizeof yg);
    same("add", yc, yg, M * N);

    kn_swiglu(cpu15, x, yc, yc, M * N);
    kn_swiglu(cu15, dx, dy, dy, M * N);
    get(cu15, yg, dy, sizeof yg);
    same("swiglu", yc, yg, M * N);

    kn_bias_add(cpu15, yc, b, M, N);
    kn_bias_add(cu15, dy, db, M, N);
    get(cu15, yg, dy, sizeof yg);
    same("bias_add", yc, yg, M * N);

    memcpy(yc, x, sizeof x);
    kn_upload(cu15, last_buf(), 0, x, sizeof x);
    kn_softmax(cpu15, yc, M, N);
    kn_softmax(cu15, dy, M, N);
    get(cu15, yg, dy, sizeof yg);
    libm_near("softmax", yc, yg, M * N, 1e-6);

    /* argmax: a tie (lowest index wins) and a NaN (never chosen) */
    x[7] = 9.0f, x[40] = 9.0f, x[N + 3] = NAN, x[N + 50] = 8.0f, x[N + 51] = NAN;
    for (int i = 0; i < N; i++) x[2 * N + i] = NAN; /* all NaN: 0 */
    kn_upload(cu15, &bufs[0], 0, x, sizeof x);
    int32_t ac[M], ag[M];
    int32_t *da = dev_zero(sizeof ag);
    kn_argmax(cpu15, x, ac, M, N);
    kn_argmax(cu15, dx, da, M, N);
    get(cu15, ag, da, sizeof ag);
    assert_memory_equal(ac, ag, sizeof ac);
    assert_int_equal(ac[0], 7);
    { /* rows of a vocabulary's width, cut into slices on the GPU: a tie
       * across slices, the maximum at the last index, a NaN slice */
        enum { V = 4099 };
        float *big = malloc(3 * V * sizeof(float));
        fill(big, 3 * V, -1, 1);
        big[1000] = big[3000] = 2.0f;
        big[2 * V - 1] = 2.0f;
        for (int i = 0; i < 200; i++) big[2 * V + i] = NAN;
        big[2 * V + 4000] = 3.0f;
        int32_t bc[3], bg[3];
        float *dbig = dev(big, 3 * V * sizeof(float));
        int32_t *dbi = dev_zero(sizeof bg);
        kn_argmax(cpu15, big, bc, 3, V);
        kn_argmax(cu15, dbig, dbi, 3, V);
        get(cu15, bg, dbi, sizeof bg);
        assert_memory_equal(bc, bg, sizeof bc);
        assert_true(bc[0] == 1000 && bc[1] == V - 1 && bc[2] == 4000);
        /* a stream with no workspace for the slices: a block per row */
        kn_stream *bare = bare_stream();
        kn_upload(bare, last_buf(), 0, (int32_t[3]){-1, -1, -1}, sizeof bg);
        kn_argmax(bare, dbig, dbi, 3, V);
        get(bare, bg, dbi, sizeof bg);
        assert_memory_equal(bc, bg, sizeof bc);
        kn_stream_free(bare);
        /* top-k of the same rows: ties across the threads' strides, NaN
         * as -inf, a row where NaN makes up most of the best 16 */
        for (int i = 0; i < 40; i++) big[V + 5 * i] = 1.5f;
        dbig = dev(big, 3 * V * sizeof(float));
        int32_t ic[3 * KN_TOPK_MAX], ig[3 * KN_TOPK_MAX];
        float vc[3 * KN_TOPK_MAX], vg[3 * KN_TOPK_MAX];
        int32_t *dti = dev_zero(sizeof ig);
        float *dtv = dev_zero(sizeof vg);
        for (int k = 1; k <= KN_TOPK_MAX; k = k < 8 ? 8 : k == 8 ? KN_TOPK_MAX : KN_TOPK_MAX + 1) {
            kn_topk(cpu15, big, 3, V, k, ic, vc);
            kn_topk(cu15, dbig, 3, V, k, dti, dtv);
            get(cu15, ig, dti, (size_t)(3 * k) * sizeof(int32_t));
            get(cu15, vg, dtv, (size_t)(3 * k) * sizeof(float));
            assert_memory_equal(ic, ig, (size_t)(3 * k) * sizeof(int32_t));
            assert_memory_equal(vc, vg, (size_t)(3 * k) * sizeof(float));
            compared += 3 * k;
        }
        /* (k = 16 last) row 0: the tie at 1000 and 3000; row 1: V - 1, then the 1.5s from 0 on */
        assert_true(ic[0] == 1000 && ic[1] == 3000 && ic[KN_TOPK_MAX] == V - 1 && ic[KN_TOPK_MAX + 1] == 0);
        free(big);
    }
    { /* every value equal, NaN rows, and rows shorter than the threads */
        float eq[3 * 20];
        for (int i = 0; i < 20; i++) eq[i] = 0.25f, eq[20 + i] = NAN, eq[40 + i] = (float)(i % 3);
        int32_t ic[3 * KN_TOPK_MAX], ig[3 * KN_TOPK_MAX];
        float vc[3 * KN_TOPK_MAX], vg[3 * KN_TOPK_MAX];
        float *deq = dev(eq, sizeof eq);
        int32_t *dti = dev_zero(sizeof ig);
        float *dtv = dev_zero(sizeof vg);
        kn_topk(cpu15, eq, 3, 20, KN_TOPK_MAX, ic, vc);
        kn_topk(cu15, deq, 3, 20, KN_TOPK_MAX, dti, dtv);
        get(cu15, ig, dti, sizeof ig);
        get(cu15, vg, dtv, sizeof vg);
        assert_memory_equal(ic, ig, sizeof ic);
        assert_memory_equal(vc, vg, sizeof vc);
        compared += 3 * KN_TOPK_MAX;
        assert_true(ic[0] == 0 && ic[KN_TOPK_MAX - 1] == KN_TOPK_MAX - 1 && vc[KN_TOPK_MAX] == -INFINITY);
    }

    /* gather_rows, named rows and a plain strided copy */
    int32_t rows[2] = {2, 0};
    int32_t *drows = dev(rows, sizeof rows);
    float gc[2 * 2 * N], gg[2 * 2 * N];
    memset(gc, 0, sizeof gc);
    float *dgat = dev_zero(sizeof gg);
    kn_gather_rows(cpu15, x, rows, 2, N, gc, 2 * N);
    kn_gather_rows(cu15, dx, drows, 2, N, dgat, 2 * N);
    kn_gather_rows(cpu15, x, NULL, 2, N, gc + N, 2 * N);
    kn_gather_rows(cu15, dx, NULL, 2, N, dgat + N, 2 * N);
    get(cu15, gg, dgat, sizeof gg);
    same("gather_rows", gc, gg, 4 * N);
    { /* rows wider than the kernels' chunks (2048, 4096), with a tail */
        enum { W = 4100 };
        float *xw = malloc(2 * W * sizeof(float)), *gw = malloc(W * sizeof(float)), *yw = malloc(2 * W * sizeof(float)),
              *yv = malloc(2 * W * sizeof(float));
        fill(xw, 2 * W, -3, 3);
        fill(gw, W, -1, 1);
        float *dxw = dev(xw, 2 * W * sizeof(float)), *dgw = dev(gw, W * sizeof(float));
        float *dyw = dev_zero(2 * W * sizeof(float));
        kn_rmsnorm(cpu15, xw, gw, yw, 2, W, 1e-5f);
        kn_rmsnorm(cu15, dxw, dgw, dyw, 2, W, 1e-5f);
        get(cu15, yv, dyw, 2 * W * sizeof(float));
        same("rmsnorm, wide rows", yw, yv, 2 * W);
        /* softmax over rows wider than its chunk of 4096 */
        kn_upload(cu15, last_buf(), 0, xw, 2 * W * sizeof(float));
        kn_softmax(cpu15, xw, 2, W);
        kn_softmax(cu15, dyw, 2, W);
        get(cu15, yv, dyw, 2 * W * sizeof(float));
        libm_near("softmax, wide rows", xw, yv, 2 * W, 1e-6);
        free(xw), free(gw), free(yw), free(yv);
    }
    free_bufs();
}

static void embed_every_type(void **state) {
    (void)state;
    const int64_t rows = 20, cols = 64, m = 6;
    int32_t ids[6] = {3, 0, 19, 3, 7, 11};
    for (size_t ti = 0; ti < sizeof TYPES / sizeof TYPES[0]; ti++) {
        wpair w;
        make_weight(&w, TYPES[ti], rows, cols);
        float oc[6 * 64], og[6 * 64];
        int32_t *dids = dev(ids, sizeof ids);
        float *dout = dev_zero(sizeof og);
        kn_embed(cpu15, &w.cpu, ids, oc, m);
        kn_embed(cu15, &w.cu, dids, dout, m);
        get(cu15, og, dout, sizeof og);
        same(quant_type_name(TYPES[ti]), oc, og, (size_t)(m * cols));
        free(w.host);
        free_bufs();
    }
}

static void rope_both_layouts(void **state) {
    (void)state;
    enum { M = 4, H = 3, D = 64 };
    int32_t pos[M] = {0, 1, 17, 4000};
    for (int layout = 0; layout < 2; layout++) {
        kn_rope r;
        kn_rope_config rc = {.layout = (kn_rope_layout)layout,
                             .head_dim = D,
                             .theta = 10000.0,
                             .factor = layout ? 8.0 : 0.0,
                             .low_freq_factor = 1.0,
                             .high_freq_factor = 4.0,
                             .original_max_pos = 8192.0};
        assert_int_equal(kn_rope_init(&r, &rc, NULL), AE_OK);
        float x[M * H * D], csc[M * D], csg[M * D], xg[M * H * D];
        fill(x, M * H * D, -1, 1);
        int32_t *dpos = dev(pos, sizeof pos);
        float *dcs = dev_zero(sizeof csg), *dx = dev(x, sizeof x);
        kn_rope_table(cpu15, &r, pos, M, csc);
        kn_rope_table(cu15, &r, dpos, M, dcs);
        get(cu15, csg, dcs, sizeof csg);
        libm_near("rope_table", csc, csg, M * D, 1e-7);
        kn_rope_rotate(cpu15, &r, x, M, H, csc);
        kn_rope_rotate(cu15, &r, dx, M, H, dcs);
        get(cu15, xg, dx, sizeof xg);
        same(layout ? "rope_rotate neox" : "rope_rotate adjacent", x, xg, M * H * D);
        free_bufs();
    }
}

/* Random K and V for n tokens of two sequences (seq[i], slot[i]; tables:
 * [2][table_len] block ids) written by kn_kv_write into the CPU pool pc
 * and the CUDA pool pg alike. zeros: n zeros. */
static void write_random_kv(const kn_kv_pool *pc, const kn_kv_pool *pg, const int32_t *tables, int32_t table_len,
                            int32_t n, const int32_t *seq, const int32_t *slot, const int32_t *zeros) {
    size_t count = (size_t)n * (size_t)pc->n_kv_heads * (size_t)pc->head_dim;
    float *k = malloc(count * 4), *v = malloc(count * 4);
    assert_true(k && v);
    fill(k, count, -2, 2);
    fill(v, count, -2, 2);
    kn_kv_map wm = {.m = n,
                    .block_tables = tables,
                    .n_seqs = 2,
                    .table_len = table_len,
                    .seq = seq,
                    .slot = slot,
                    .n_prefix = zeros,
                    .extra_start = zeros,
                    .n_extra = zeros,
                    .extra = zeros,
                    .n_extra_total = 0};
    kn_kv_map wg = wm;
    wg.block_tables = dev(tables, sizeof(int32_t) * 2 * (size_t)table_len);
    wg.seq = dev(seq, sizeof(int32_t) * (size_t)n), wg.slot = dev(slot, sizeof(int32_t) * (size_t)n);
    wg.n_prefix = wg.extra_start = wg.n_extra = wg.extra = dev(zeros, sizeof(int32_t) * (size_t)n);
    kn_kv_write(cpu15, pc, &wm, k, v);
    kn_kv_write(cu15, pg, &wg, dev(k, count * 4), dev(v, count * 4));
    free(k), free(v);
}

/* KV: two sequences in a pool of 8 blocks of 16 rows, 2 kv heads of 64,
 * 4 query heads. Sequence 0 holds 45 slots (two chunks and a part);
 * sequence 1 holds 20 committed slots and a tree of 3 nodes in scratch
 * slots 40, 41, 42 (node 2's ancestors: node 0). Attention runs over a
 * batch of prefill-like tokens of sequence 0 and the tree, and over a
 * larger one. */
enum { NB = 8, BS = 16, KVH = 2, HD = 64, QH = 4, TL = 4 };

static void kv_write_attention_and_move(void **state) {
    (void)state;
    size_t pool_elems = (size_t)NB * BS * KVH * HD;
    uint16_t *kc = calloc(pool_elems, 2), *vc = calloc(pool_elems, 2), *kg = malloc(pool_elems * 2),
             *vg = malloc(pool_elems * 2);
    /* K and V in one buffer: a pool names one buffer (kernels.c checks both) */
    uint16_t *dkv = dev_zero(2 * pool_elems * 2);
    kn_buf *kvbuf = last_buf();
    uint16_t *dk = dkv, *dv = dkv + pool_elems;
    kn_kv_pool pc = {
        .k = kc, .v = vc, .n_blocks = NB, .block_size = BS, .n_kv_heads = KVH, .head_dim = HD, .type = GGML_TYPE_F16};
    kn_kv_pool pg = pc;
    pg.k = dk, pg.v = dv, pg.buf = kvbuf;
    int32_t tables[2 * TL] = {5, 1, 7, -1, 2, 0, 6, -1};

    /* writes: all 45 slots of seq 0, 20 of seq 1, and its 3 scratch slots */
    enum { NW = 45 + 20 + 3 };
    int32_t wseq[NW], wslot[NW], zeros[NW];
    for (int i = 0; i < NW; i++) {
        wseq[i] = i < 45 ? 0 : 1;
        wslot[i] = i < 45 ? i : i < 65 ? i - 45 : 40 + (i - 65);
        zeros[i] = 0;
    }
    write_random_kv(&pc, &pg, tables, TL, NW, wseq, wslot, zeros);
    get(cu15, kg, dk, pool_elems * 2);
    get(cu15, vg, dv, pool_elems * 2);
    assert_memory_equal(kc, kg, pool_elems * 2);
    assert_memory_equal(vc, vg, pool_elems * 2);

    /* attention: seq 0 tokens at positions 0, 31, 32, 44 (1, 32, 33, 45
     * keys), then the tree: node 0 sees 20 + [40], node 1 20 + [41],
     * node 2 20 + [40, 42] */
    enum { NT = 7 };
    int32_t aseq[NT] = {0, 0, 0, 0, 1, 1, 1}, aslot[NT] = {0, 31, 32, 44, 40, 41, 42};
    int32_t npre[NT] = {1, 32, 33, 45, 20, 20, 20}, xst[NT] = {0, 0, 0, 0, 0, 1, 2}, nex[NT] = {0, 0, 0, 0, 1, 1, 2};
    int32_t extra[4] = {40, 41, 40, 42};
    kn_kv_map am = {.m = NT,
                    .block_tables = tables,
                    .n_seqs = 2,
                    .table_len = TL,
                    .seq = aseq,
                    .slot = aslot,
                    .n_prefix = npre,
                    .extra_start = xst,
                    .n_extra = nex,
                    .extra = extra,
                    .n_extra_total = 4};
    kn_kv_map ag = am;
    ag.block_tables = dev(tables, sizeof tables), ag.seq = dev(aseq, sizeof aseq), ag.slot = dev(aslot, sizeof aslot);
    ag.n_prefix = dev(npre, sizeof npre), ag.extra_start = dev(xst, sizeof xst), ag.n_extra = dev(nex, sizeof nex);
    ag.extra = dev(extra, sizeof extra);
    float q[NT * QH * HD], oc[NT * QH * HD], og[NT * QH * HD];
    fill(q, NT * QH * HD, -1, 1);
    float *dq = dev(q, sizeof q), *dout = dev_zero(sizeof og);
    kn_attention(cpu15, &pc, &am, q, oc, QH);
    kn_attention(cu15, &pg, &ag, dq, dout, QH);
    get(cu15, og, dout, sizeof og);
    same("attention, chunks apart then merged", oc, og, NT * QH * HD);
    /* with no workspace for the chunks' partials: one block per (token,
     * head) walks its chunks, the same bits */
    kn_stream *bare = bare_stream();
    kn_upload(bare, last_buf(), 0, (float[NT * QH * HD]){0}, sizeof og);
    kn_attention(bare, &pg, &ag, dq, dout, QH);
    get(bare, og, dout, sizeof og);
    same("attention, chunks in one block", oc, og, NT * QH * HD);
    kn_stream_free(bare);

    /* more tokens than KN_ATTN_SPLIT_M, 8 to a block: seq 0 at positions
     * 28 .. 44, then the tree. The first 8 (29 .. 36 keys) share no whole
     * chunk; the next 8 (37 .. 44 keys) load chunk 0 once for all; the
     * last block mixes sequences and shares none. */
    enum { NL = 17 + 3 };
    int32_t lseq[NL], lslot[NL], lpre[NL], lxst[NL], lnex[NL];
    for (int i = 0; i < NL; i++) {
        bool tree = i >= 17;
        lseq[i] = tree ? 1 : 0;
        lslot[i] = tree ? aslot[4 + i - 17] : 28 + i;
        lpre[i] = tree ? 20 : 29 + i;
        lxst[i] = tree ? xst[4 + i - 17] : 0;
        lnex[i] = tree ? nex[4 + i - 17] : 0;
    }
    kn_kv_map lm = am;
    lm.m = NL, lm.seq = lseq, lm.slot = lslot, lm.n_prefix = lpre, lm.extra_start = lxst, lm.n_extra = lnex;
    kn_kv_map lg = ag;
    lg.m = NL, lg.seq = dev(lseq, sizeof lseq), lg.slot = dev(lslot, sizeof lslot),
    lg.n_prefix = dev(lpre, sizeof lpre);
    lg.extra_start = dev(lxst, sizeof lxst), lg.n_extra = dev(lnex, sizeof lnex);
    float *ql = malloc(sizeof(float) * NL * QH * HD), *olc = malloc(sizeof(float) * NL * QH * HD),
          *olg = malloc(sizeof(float) * NL * QH * HD);
    fill(ql, (size_t)NL * QH * HD, -1, 1);
    float *dql = dev(ql, sizeof(float) * NL * QH * HD), *dol = dev_zero(sizeof(float) * NL * QH * HD);
    kn_attention(cpu15, &pc, &lm, ql, olc, QH);
    kn_attention(cu15, &pg, &lg, dql, dol, QH);
    get(cu15, olg, dol, sizeof(float) * NL * QH * HD);
    same("attention, 8 tokens to a block", olc, olg, NL * QH * HD);
    free(ql), free(olc), free(olg);

    /* moves that chain: row 40 -> 12, then 12 -> 13, and one in place */
    int32_t src[3] = {2 * BS + 8, 5 * BS + 12, 3}, dst[3] = {5 * BS + 12, 5 * BS + 13, 3};
    int32_t *dsrc = dev(src, sizeof src), *ddst = dev(dst, sizeof dst);
    kn_kv_move(cpu15, &pc, src, dst, 3);
    kn_kv_move(cu15, &pg, dsrc, ddst, 3);
    get(cu15, kg, dk, pool_elems * 2);
    get(cu15, vg, dv, pool_elems * 2);
    assert_memory_equal(kc, kg, pool_elems * 2);
    assert_memory_equal(vc, vg, pool_elems * 2);
    assert_memory_equal(kc + (size_t)(5 * BS + 13) * KVH * HD, kc + (size_t)(2 * BS + 8) * KVH * HD, KVH * HD * 2);
    free(kc), free(vc), free(kg), free(vg);
    free_bufs();
}

/* k_attn_group's cases, at head_dim 64, 128 and 256 (two sequences of 64
 * written slots, 27 tokens, 8 to a block): a block sharing two whole
 * chunks with nothing after them; one whose prefixes end on and beside
 * chunk boundaries (32 .. 64 keys: one shared chunk); a block of tree
 * nodes with 1 to 8 ancestors past a 32-key prefix (one shared chunk,
 * every tail an extra); and a last block of 3 tokens (fewer than 8) that
 * shares one chunk, one of them with extras. Bit for bit the CPU's. */
static void attention_group_cases_at(int hd) {
    enum { XNB = 8, XBS = 16, XKVH = 2, XQH = 4, XTL = 4 };
    size_t pool_elems = (size_t)XNB * XBS * XKVH * hd;
    uint16_t *kc = calloc(pool_elems, 2), *vc = calloc(pool_elems, 2);
    uint16_t *dkv = dev_zero(2 * pool_elems * 2);
    kn_buf *kvbuf = last_buf();
    kn_kv_pool pc = {.k = kc,
                     .v = vc,
                     .n_blocks = XNB,
                     .block_size = XBS,
                     .n_kv_heads = XKVH,
                     .head_dim = hd,
                     .type = GGML_TYPE_F16};
    kn_kv_pool pg = pc;
    pg.k = dkv, pg.v = dkv + pool_elems, pg.buf = kvbuf;
    int32_t tables[2 * XTL] = {5, 1, 7, 3, 2, 0, 6, 4};
    enum { NW = 128 };
    int32_t wseq[NW], wslot[NW], zeros[NW];
    for (int i = 0; i < NW; i++) wseq[i] = i < 64 ? 0 : 1, wslot[i] = i % 64, zeros[i] = 0;
    write_random_kv(&pc, &pg, tables, XTL, NW, wseq, wslot, zeros);

    enum { NT = 27 };
    int32_t seq[NT], slot[NT], npre[NT], xst[NT], nex[NT], extra[64];
    int32_t b1[8] = {32, 40, 50, 64, 33, 63, 48, 32};
    int ne = 0;
    for (int i = 0; i < NT; i++) {
        xst[i] = ne, nex[i] = 0;
        if (i < 8)
            seq[i] = 0, npre[i] = 64, slot[i] = 63;
        else if (i < 16)
            seq[i] = 0, npre[i] = b1[i - 8], slot[i] = npre[i] - 1;
        else if (i < 24) {
            int n = i - 16;
            seq[i] = 1, npre[i] = 32, slot[i] = 40 + n;
            for (int a = 0; a <= n; a++) extra[ne++] = 40 + a;
            nex[i] = n + 1;
        } else {
            seq[i] = 1, npre[i] = 35 + (i - 24) * 14, slot[i] = 60;
            if (i == 25) extra[ne++] = 50, extra[ne++] = 51, nex[i] = 2;
        }
    }
    kn_kv_map am = {.m = NT,
                    .block_tables = tables,
                    .n_seqs = 2,
                    .table_len = XTL,
                    .seq = seq,
                    .slot = slot,
                    .n_prefix = npre,
                    .extra_start = xst,
                    .n_extra = nex,
                    .extra = extra,
                    .n_extra_total = ne};
    kn_kv_map ag = am;
    ag.block_tables = dev(tables, sizeof tables), ag.seq = dev(seq, sizeof seq), ag.slot = dev(slot, sizeof slot);
    ag.n_prefix = dev(npre, sizeof npre), ag.extra_start = dev(xst, sizeof xst), ag.n_extra = dev(nex, sizeof nex);
    ag.extra = dev(extra, sizeof extra);
    size_t nq = (size_t)NT * XQH * hd;
    float *q = malloc(nq * 4), *oc = malloc(nq * 4), *og = malloc(nq * 4);
    fill(q, nq, -1, 1);
    float *dq = dev(q, nq * 4), *dout = dev_zero(nq * 4);
    kn_attention(cpu15, &pc, &am, q, oc, XQH);
    kn_attention(cu15, &pg, &ag, dq, dout, XQH);
    get(cu15, og, dout, nq * 4);
    char what[64];
    snprintf(what, sizeof what, "attention, 8 tokens to a block, head_dim %d", hd);
    same(what, oc, og, nq);
    free(q), free(oc), free(og), free(kc), free(vc);
    free_bufs();
}
static void attention_group_cases(void **state) {
    (void)state;
    for (int hd = 64; hd <= 256; hd *= 2) attention_group_cases_at(hd);
}

/* kn_sample against the host's sampler (target/sample.c), row by row:
 * greedy, temperatures, top-k, min-p, and rows with masked (-inf), NaN
 * and +inf logits, each at many positions' keys. On the shim the device
 * code calls the host's expf, so every id must be the host's; on a GPU
 * its expf may move a token across a min-p bound or a race's tie in the
 * last bit, so nearly every one must. */
static void sample_draws_as_the_host_does(void **state) {
    (void)state;
    enum { V = 1500, ROWS = 6, POS = 24, CASES = 7 };
    static const sample_params cases[CASES] = {
        {0.0f, 0, 1.0f, 0.0f}, {1.0f, 0, 1.0f, 0.0f},           {0.7f, 0, 1.0f, 0.05f}, {1.3f, 5, 1.0f, 0.0f},
        {0.8f, 1, 1.0f, 0.0f}, {1.0f, KN_TOPK_MAX, 1.0f, 0.1f}, {1e-6f, 3, 1.0f, 0.0f},
    };
    float *x = malloc((size_t)ROWS * V * sizeof(float));
    fill(x, (size_t)ROWS * V, -4, 4);
    for (int i = 0; i < V; i += 3) x[V + i] = -INFINITY;    /* a grammar's mask */
    for (int i = 0; i < V; i++) x[2 * V + i] = -INFINITY;   /* all masked: greedy's pick, 0 */
    x[3 * V + 7] = NAN, x[3 * V + 8] = INFINITY;            /* +inf is no finite logit */
    for (int i = 0; i < 40; i++) x[4 * V + 100 + i] = 6.0f; /* ties at the top */
    sample_state *smp;
    ae_error err = {{0}};
    assert_int_equal(sample_init(&smp, V, &err), AE_OK);
    kn_draw *draws = malloc(sizeof(kn_draw) * ROWS * POS);
    int32_t *got = malloc(sizeof(int32_t) * ROWS * POS), *want = malloc(sizeof(int32_t) * ROWS * POS);
    float *big = malloc((size_t)ROWS * POS * V * sizeof(float)); /* each row repeated at each position */
    for (int r = 0; r < ROWS; r++)
        for (int p = 0; p < POS; p++) memcpy(big + ((size_t)r * POS + p) * V, x + (size_t)r * V, V * sizeof(float));
    float *dbig = dev(big, (size_t)ROWS * POS * V * sizeof(float));
    int32_t *dout = dev_zero(sizeof(int32_t) * ROWS * POS);
    int equal = 0, total = 0;
    for (int c = 0; c < CASES; c++) {
        sample_rng key;
        sample_rng_seed(&key, 1234 + (uint64_t)c);
        for (int r = 0; r < ROWS; r++)
            for (int p = 0; p < POS; p++) {
                draws[r * POS + p] = sample_draw(&cases[c], &key, 100 + p);
                want[r * POS + p] = sample_token(smp, x + (size_t)r * V, &cases[c], &key, 100 + p);
            }
        kn_draw *dd = dev(draws, sizeof(kn_draw) * ROWS * POS);
        kn_sample(cu15, dbig, ROWS * POS, V, dd, dout);
        get(cu15, got, dout, sizeof(int32_t) * ROWS * POS);
        for (int i = 0; i < ROWS * POS; i++) equal += got[i] == want[i];
        total += ROWS * POS;
        if (cases[c].temperature >= 0.5f && cases[c].top_k != 1) {
            int distinct = 0; /* the draws do vary with the position */
            for (int p = 1; p < POS; p++) distinct += want[p] != want[0];
            assert_true(distinct > 0);
        }
        assert_int_equal(want[2 * POS], 0);
    }
    printf("sample: %d of %d draws the host's (%d parameter sets x %d rows x %d positions)\n", equal, total, CASES,
           ROWS, POS);
#ifdef KN_TEST_GPU
    assert_true(equal * 100 >= total * 99);
#else
    assert_int_equal(equal, total);
#endif
    compared += total;
    free(x), free(big), free(draws), free(got), free(want);
    sample_free(smp);
    free_bufs();
}

/* Fast mode (kernels.h kn_stream_set_fast): float-weight matmuls by
 * cuBLAS on a GPU, x rounded to the weights' type, within that rounding
 * of the CPU's result (relative L2 error); the shim has no cuBLAS and
 * says so, and the CPU backend has only its one mode. */
static void fast_mode_matmul(void **state) {
    (void)state;
    ae_error err = {{0}};
    assert_int_equal(kn_stream_set_fast(cpu15, true, &err), AE_OK);
    assert_false(kn_stream_fast(cpu15)); /* nothing to change on the CPU */
    kn_stream *fast;
    assert_int_equal(kn_stream_init(&fast, CU, &(kn_stream_config){NULL, WORK}, &err), AE_OK);
#ifndef KN_TEST_GPU
    assert_int_equal(kn_stream_set_fast(fast, true, &err), AE_ERR);
    assert_string_equal(err.msg, "fast mode: the CPU shim has no cuBLAS");
    assert_false(kn_stream_fast(fast));
#else
    if (kn_stream_set_fast(fast, true, &err) != AE_OK) fail_msg("%s", err.msg);
    assert_true(kn_stream_fast(fast));
    const ggml_type types[3] = {GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16};
    const double bound[3] = {1e-5, 1e-3, 8e-3}; /* f32 sums; x rounded to f16 (2^-11) or bf16 (2^-8) */
    const int64_t ms[] = {1, 3, 9}, n = 40, k = 1184;
    for (int ti = 0; ti < 3; ti++) {
        wpair w;
        make_weight(&w, types[ti], n, k);
        for (size_t mi = 0; mi < sizeof ms / sizeof ms[0]; mi++) {
            int64_t m = ms[mi];
            float *x = malloc((size_t)(m * k) * sizeof(float)), *yc = malloc((size_t)(m * n) * sizeof(float)),
                  *yg = malloc((size_t)(m * n) * sizeof(float));
            fill(x, (size_t)(m * k), -2, 2);
            float *dx = dev(x, (size_t)(m * k) * sizeof(float)), *dy = dev_zero((size_t)(m * n) * sizeof(float));
            kn_matmul(cpu15, &w.cpu, x, yc, m);
            kn_matmul(fast, &w.cu, dx, dy, m);
            get(fast, yg, dy, (size_t)(m * n) * sizeof(float));
            double num = 0, den = 0;
            for (int64_t i = 0; i < m * n; i++) {
                double d = (double)yc[i] - yg[i];
                num += d * d;
                den += (double)yc[i] * yc[i];
            }
            double rel = sqrt(num / den);
            printf("fast matmul %s m=%lld: relative L2 error %.2e (bound %.0e)\n", quant_type_name(types[ti]),
                   (long long)m, rel, bound[ti]);
            assert_true(rel <= bound[ti]);
            compared += (int)(m * n);
            free(x), free(yc), free(yg);
        }
        free(w.host);
    }
    free_bufs();
#endif
    kn_stream_free(fast);
}

static void device_open_reports_the_shim(void **state) {
    (void)state;
    const kn_backend *be;
    kn_device_info info;
    ae_error err = {{0}};
    assert_int_equal(kn_cuda_open(0, &be, &info, &err), AE_OK);
    assert_ptr_equal(be, CU);
    assert_string_equal(kn_backend_name(be), "cuda");
    assert_false(kn_backend_host_memory(be));
#ifndef KN_TEST_GPU
    assert_int_equal(kn_cuda_open(1, &be, &info, &err), AE_ERR);
    assert_string_equal(err.msg, "cuda:1 does not exist: this machine has 1 GPU(s)");
#else
    printf("%s, compute capability %d.%d, %llu MiB free of %llu, driver %d, runtime %d\n", info.name, info.cc_major,
           info.cc_minor, (unsigned long long)(info.free_bytes >> 20), (unsigned long long)(info.total_bytes >> 20),
           info.driver_version, info.runtime_version);
#endif
    assert_true(kn_backend_supports(be, KN_OP_MATMUL, GGML_TYPE_Q4_1));
    assert_false(kn_backend_supports(be, KN_OP_MATMUL, GGML_TYPE_Q6_K));
    assert_true(kn_backend_supports(be, KN_OP_KV, GGML_TYPE_F16));
    assert_false(kn_backend_supports(be, KN_OP_KV, GGML_TYPE_BF16));
}

int main(int argc, char **argv) {
    if (argc > 1) cmocka_set_test_filter(argv[1]); /* one test, by name (tests/gpu/run.sh) */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(device_open_reports_the_shim),
        cmocka_unit_test(matmul_every_type_both_precisions),
        cmocka_unit_test(matmul_of_column_shards),
        cmocka_unit_test(custom_allreduce_is_the_cpus_in_rank_order),
#ifdef KN_TEST_GPU /* the shim has no NCCL: run.sh asks for it on a GPU */
        cmocka_unit_test(nccl_allreduce_when_asked),
#endif
        cmocka_unit_test(matmul_n_and_swiglu),
        cmocka_unit_test(row_and_elementwise_ops),
        cmocka_unit_test(embed_every_type),
        cmocka_unit_test(rope_both_layouts),
        cmocka_unit_test(kv_write_attention_and_move),
        cmocka_unit_test(attention_group_cases),
        cmocka_unit_test(fast_mode_matmul),
        cmocka_unit_test(sample_draws_as_the_host_does),
    };
    int rc = cmocka_run_group_tests(tests, setup, teardown);
#ifdef KN_TEST_GPU
    printf("cuda ops on the GPU: %d values compared with the CPU backend\n", compared);
#else
    printf("cuda ops on the CPU shim: %d values compared bit for bit with the CPU backend\n", compared);
#endif
    return rc;
}
