/* kernels/cpu: every op against a naive double-precision reference within
 * a stated error bound, the AVX2 and portable paths bit for bit, and the
 * batch-invariance contract of kernels.h bit for bit: a row's result does
 * not depend on m, its place in the batch or the thread count, and a tree
 * node's attention equals the same token's decode-time attention. */
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

#include "../../kernels/kernels.h"
#include "../../services/core/pool.h"

/* ---- fixtures ----------------------------------------------------------- */

#define MAX_THREADS 3
#define WORK_BYTES (1u << 20)

typedef struct fixture {
    pool *pools[MAX_THREADS + 1];         /* [t]: t threads */
    kn_stream *streams[MAX_THREADS + 1];  /* on pools[t], 15-bit activations (the default) */
    kn_stream *streams8[MAX_THREADS + 1]; /* on pools[t], 8-bit activations */
} fixture;

static fixture F;

static int setup(void **state) {
    (void)state;
    for (int t = 1; t <= MAX_THREADS; t++) {
        if (pool_init(&F.pools[t], t, NULL) != AE_OK) return -1;
        if (kn_stream_init(&F.streams[t], &kn_backend_cpu, &(kn_stream_config){F.pools[t], WORK_BYTES}, NULL) != AE_OK)
            return -1;
        if (kn_stream_init(&F.streams8[t], &kn_backend_cpu, &(kn_stream_config){F.pools[t], WORK_BYTES}, NULL) != AE_OK)
            return -1;
        kn_stream_set_act_bits(F.streams8[t], 8);
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    for (int t = 1; t <= MAX_THREADS; t++) {
        kn_stream_free(F.streams[t]);
        kn_stream_free(F.streams8[t]);
        pool_free(F.pools[t]);
    }
    kn_cpu_force_scalar(false);
    return 0;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint32_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 32);
}

/* Uniform in [-1, 1). */
static float rndf(void) { return (float)((double)rnd() / 2147483648.0 - 1.0); }

static void fill(float *x, size_t n, float scale) {
    for (size_t i = 0; i < n; i++) x[i] = rndf() * scale;
}

static void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, sizeof v); }

/* A weight [n][k] of `type` filled with random values (random blocks for
 * the quantized types: scales in a realistic range, all quant values
 * reachable, Q8_0's -128 included). */
typedef struct test_weight {
    kn_weight w;
    uint8_t *bytes;
    float *deq;   /* [n][k] dequantized, the reference's view */
    void *packed; /* kn_weight_pack's copy, once pack_weight ran */
} test_weight;

/* Where a block's f16 scale d and its min or offset (-1: none) sit. */
static void half_fields(ggml_type t, int *d_at, int *m_at) {
    *d_at = 0;
    *m_at = -1;
    switch (t) {
    case GGML_TYPE_Q4_1:
    case GGML_TYPE_Q5_1:
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q5_K: *m_at = 2; break;
    case GGML_TYPE_Q2_K: *d_at = 80, *m_at = 82; break;
    case GGML_TYPE_Q3_K: *d_at = 108; break;
    case GGML_TYPE_Q6_K: *d_at = 208; break;
    default: break;
    }
}

static test_weight make_weight(ggml_type type, int64_t n, int64_t k) {
    test_weight t = {0};
    size_t rb = (size_t)quant_row_bytes(type, (uint64_t)k);
    assert_true(rb > 0);
    t.bytes = malloc(rb * (size_t)n);
    t.deq = malloc(sizeof(float) * (size_t)(n * k));
    assert_non_null(t.bytes);
    assert_non_null(t.deq);
    for (int64_t j = 0; j < n; j++) {
        uint8_t *row = t.bytes + (size_t)j * rb;
        if (type == GGML_TYPE_F32) {
            for (int64_t i = 0; i < k; i++) {
                float f = rndf() * 0.5f;
                memcpy(row + 4 * i, &f, 4);
            }
        } else if (type == GGML_TYPE_F16 || type == GGML_TYPE_BF16) {
            for (int64_t i = 0; i < k; i++) {
                float f = rndf() * 0.5f;
                put16(row + 2 * i, type == GGML_TYPE_F16 ? quant_f32_to_f16(f) : quant_f32_to_bf16(f));
            }
        } else {
            uint32_t bb = quant_block_bytes(type);
            int d_at, m_at;
            half_fields(type, &d_at, &m_at);
            for (int64_t b = 0; b < k / (int64_t)quant_block_elems(type); b++) {
                uint8_t *blk = row + (size_t)b * bb;
                for (uint32_t i = 0; i < bb; i++) blk[i] = (uint8_t)rnd();
                float scale = 0.002f + 0.02f * (float)(rnd() % 1000) / 1000.0f;
                if (quant_block_elems(type) == 256) scale /= 16.0f; /* times a sub-block scale */
                if (type == GGML_TYPE_MXFP4)
                    blk[0] = (uint8_t)(119 + rnd() % 4); /* 2^-9 .. 2^-6, halved */
                else
                    put16(blk + d_at, quant_f32_to_f16(scale));
                if (m_at >= 0) put16(blk + m_at, quant_f32_to_f16(-0.15f * (float)(rnd() % 1000) / 1000.0f));
            }
        }
        assert_true(quant_dequantize(type, row, t.deq + j * k, (uint64_t)k));
    }
    t.w = (kn_weight){.type = type, .rows = n, .cols = k, .data = t.bytes, .row_bytes = rb};
    return t;
}

static void free_weight(test_weight *t) {
    free(t->bytes);
    free(t->deq);
    free(t->packed);
}

/* Gives a quantized weight its packed copy (the layout the engine uses). */
static void pack_weight(test_weight *t) {
    size_t bytes = kn_weight_packed_bytes(&t->w);
    assert_true(bytes > 0);
    t->packed = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    assert_non_null(t->packed);
    kn_weight_pack(&t->w, t->packed);
    assert_ptr_equal(t->w.packed, t->packed);
}

static uint32_t fbits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* Bitwise equality of two float arrays, naming the first difference. */
static void assert_same_bits(const float *got, const float *want, size_t n, const char *what) {
    for (size_t i = 0; i < n; i++)
        if (fbits(got[i]) != fbits(want[i]))
            fail_msg("%s: element %zu is %.9g (0x%08x), expected %.9g (0x%08x)", what, i, (double)got[i], fbits(got[i]),
                     (double)want[i], fbits(want[i]));
}

/* The fixture's stream with t threads at `bits` of activation precision. */
static kn_stream *stream(int t, int bits) { return bits == 8 ? F.streams8[t] : F.streams[t]; }

/* L of kernels.h: the largest |xi| at `bits`. */
static float act_limit(int bits) { return bits == 8 ? 127.0f : 16256.0f; }

static bool is_quant(ggml_type t) { return quant_block_elems(t) >= 32; }

/* A width of whole blocks of t with k_small elements or more. */
static int64_t width_for(ggml_type t, int64_t k_small) {
    int64_t be = quant_block_elems(t);
    return be >= 32 ? (k_small + be - 1) / be * be : k_small;
}

/* ---- matmul against the reference -------------------------------------- */

/* y[r][j] vs sum_i x[r][i] * deq[j][i] in double. Float types: within
 * the f32 accumulation bound (k * 2^-23 relative to sum |x w|). Quantized
 * types multiply x rounded to 1/16256 of its block's largest magnitude
 * (kernels.h), so the bound adds sum |w| * half a step per block. */
static void check_matmul_reference_bits(ggml_type type, int64_t m, int64_t n, int64_t k, int bits) {
    test_weight tw = make_weight(type, n, k);
    if (kn_weight_packed_bytes(&tw.w) > 0) pack_weight(&tw);
    float *x = malloc(sizeof(float) * (size_t)(m * k));
    float *y = malloc(sizeof(float) * (size_t)(m * n));
    fill(x, (size_t)(m * k), 2.0f);
    kn_matmul(stream(2, bits), &tw.w, x, y, m);
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < n; j++) {
            double ref = 0, mag = 0, qerr = 0;
            for (int64_t b = 0; b < k; b += 32) {
                double amax = 0, wabs = 0;
                for (int64_t i = b; i < b + 32 && i < k; i++) {
                    double w = tw.deq[j * k + i], xv = x[r * k + i];
                    ref += w * xv;
                    mag += fabs(w * xv);
                    wabs += fabs(w);
                    if (fabs(xv) > amax) amax = fabs(xv);
                }
                if (is_quant(type)) qerr += wabs * amax * (0.5 / act_limit(bits) + 1e-7);
            }
            double bound = (double)k * 1.2e-7 * mag + qerr + 1e-30;
            double err = fabs((double)y[r * n + j] - ref);
            if (err > bound)
                fail_msg("%s %d-bit m=%lld: y[%lld][%lld] = %.9g, reference %.9g, error %.3g > bound %.3g",
                         quant_type_name(type), bits, (long long)m, (long long)r, (long long)j, (double)y[r * n + j],
                         ref, err, bound);
        }
    free(x);
    free(y);
    free_weight(&tw);
}

static void check_matmul_reference(ggml_type type, int64_t m, int64_t n, int64_t k) {
    check_matmul_reference_bits(type, m, n, k, 15);
}

static const ggml_type ALL_TYPES[] = {GGML_TYPE_F32,  GGML_TYPE_F16,    GGML_TYPE_BF16,   GGML_TYPE_Q8_0,
                                      GGML_TYPE_Q4_0, GGML_TYPE_Q4_1,   GGML_TYPE_Q5_0,   GGML_TYPE_Q5_1,
                                      GGML_TYPE_Q2_K, GGML_TYPE_Q3_K,   GGML_TYPE_Q4_K,   GGML_TYPE_Q5_K,
                                      GGML_TYPE_Q6_K, GGML_TYPE_IQ4_NL, GGML_TYPE_IQ4_XS, GGML_TYPE_MXFP4};
#define N_TYPES (sizeof ALL_TYPES / sizeof ALL_TYPES[0])

static void matmul_matches_double_reference_for_every_type(void **state) {
    (void)state;
    for (size_t t = 0; t < N_TYPES; t++) {
        int64_t k = is_quant(ALL_TYPES[t]) ? width_for(ALL_TYPES[t], 160) : 75; /* 75: a tail after the 8-lane body */
        check_matmul_reference(ALL_TYPES[t], 6, 37, k);
        check_matmul_reference_bits(ALL_TYPES[t], 6, 37, k, 8);
    }
}

static void matmul_portable_path_matches_double_reference(void **state) {
    (void)state;
    kn_cpu_force_scalar(true);
    for (size_t t = 0; t < N_TYPES; t++)
        check_matmul_reference(ALL_TYPES[t], 5, 19, is_quant(ALL_TYPES[t]) ? width_for(ALL_TYPES[t], 96) : 43);
    kn_cpu_force_scalar(false);
}

static void matmul_simd_and_portable_paths_agree_bitwise(void **state) {
    (void)state;
    kn_cpu_force_scalar(false);
    if (strcmp(kn_cpu_simd(), "scalar") == 0) {
        print_message("no SIMD on this CPU: nothing to compare\n");
        skip();
    }
    for (size_t t = 0; t < N_TYPES; t++) {
        int64_t n = 41, k = is_quant(ALL_TYPES[t]) ? width_for(ALL_TYPES[t], 224) : 83, m = 9;
        test_weight tw = make_weight(ALL_TYPES[t], n, k);
        if (kn_weight_packed_bytes(&tw.w) > 0) pack_weight(&tw);
        float *x = malloc(sizeof(float) * (size_t)(m * k));
        float *fast = malloc(sizeof(float) * (size_t)(m * n));
        float *slow = malloc(sizeof(float) * (size_t)(m * n));
        fill(x, (size_t)(m * k), 3.0f);
        x[5] = 0.0f;                              /* zero block edge cases ride along */
        for (int bits = 15; bits >= 8; bits -= 7) /* both activation precisions */
            for (int64_t mm = 1; mm <= m; mm++) {
                kn_matmul(stream(1, bits), &tw.w, x, fast, mm);
                kn_cpu_force_scalar(true);
                kn_matmul(stream(1, bits), &tw.w, x, slow, mm);
                kn_cpu_force_scalar(false);
                char what[64];
                snprintf(what, sizeof what, "%s %d-bit m=%lld", quant_type_name(ALL_TYPES[t]), bits, (long long)mm);
                assert_same_bits(fast, slow, (size_t)(mm * n), what);
            }
        free(x);
        free(fast);
        free(slow);
        free_weight(&tw);
    }
}

/* The quantized contract of kernels.h, written out again here from its
 * text: x rounded per block to xi = round(x * (L / amax)) (L = 16256 at
 * 15 bits, 127 at 8), exact integer dot products per block, then
 * acc = fma(isum, d * sx, acc) and for Q4_1 acc = fma(m, sx * sum xi,
 * acc), block by block. */
static float contract_row_bits(ggml_type type, const uint8_t *row, const float *x, int64_t k, int bits) {
    const float L = act_limit(bits);
    size_t bb = quant_block_bytes(type);
    float acc = 0.0f;
    for (int64_t b = 0; b < k / 32; b++) {
        const float *xb = x + b * 32;
        const uint8_t *blk = row + (size_t)b * bb;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++)
            if (fabsf(xb[i]) > amax) amax = fabsf(xb[i]);
        bool zero = amax < 0x1p-100f; /* counts as a zero block */
        float sx = zero ? 0.0f : amax / L, inv = zero ? 0.0f : L / amax;
        int32_t xi[32], sum = 0;
        for (int i = 0; i < 32; i++) {
            xi[i] = (int32_t)nearbyintf(xb[i] * inv);
            sum += xi[i];
        }
        uint16_t dh, mh = 0;
        memcpy(&dh, blk, 2);
        int32_t isum = 0;
        for (int i = 0; i < 32; i++) {
            int32_t q;
            if (type == GGML_TYPE_Q8_0)
                q = (int8_t)blk[2 + i];
            else {
                const uint8_t *qs = blk + (type == GGML_TYPE_Q4_1 ? 4 : 2);
                q = i < 16 ? qs[i] & 15 : qs[i - 16] >> 4;
                if (type == GGML_TYPE_Q4_0) q -= 8;
            }
            isum += q * xi[i];
        }
        acc = fmaf((float)isum, quant_f16_to_f32(dh) * sx, acc);
        if (type == GGML_TYPE_Q4_1) {
            memcpy(&mh, blk + 2, 2);
            acc = fmaf(quant_f16_to_f32(mh), sx * (float)sum, acc);
        }
    }
    return acc;
}

/* Every path gives the contract's bits: packed (the VNNI or the AVX2
 * kernel, each where the CPU has it) and the file's layout, SIMD and
 * portable, every tile height. n = 37 is two packed groups and 5 rows
 * read from the file's layout. Row 0 carries extreme scales: a subnormal f16 d, the largest d
 * with the most negative offset, d = 1 with an offset that rounds. x
 * holds a zero block, a block with one huge outlier and tiny values. */
static void check_integer_contract(int bits) {
    const ggml_type types[] = {GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1};
    const uint16_t d_edge[3] = {0x0001, 0x7bff, 0x3c00};
    const uint16_t m_edge[3] = {0x8001, 0xfbff, 0x3555};
    int64_t n = 37, k = 1056, M = 11;
    float *x = malloc(sizeof(float) * (size_t)(M * k));
    float *got = malloc(sizeof(float) * (size_t)(M * n));
    float *want = malloc(sizeof(float) * (size_t)(M * n));
    fill(x, (size_t)(M * k), 2.0f);
    memset(x + 64, 0, 32 * sizeof(float));
    x[k + 100] = 3.0e4f;
    for (int i = 0; i < 32; i++) x[2 * k + 160 + i] = 1e-30f * (float)(i - 16);
    for (int i = 0; i < 32; i++) x[3 * k + 192 + i] = i % 3 ? 1e-36f * (float)(i - 16) : 0.0f; /* below 2^-100 */
    for (size_t t = 0; t < 3; t++) {
        test_weight tw = make_weight(types[t], n, k);
        for (int e = 0; e < 3; e++) {
            uint8_t *blk = tw.bytes + (size_t)e * quant_block_bytes(types[t]);
            put16(blk, d_edge[e]);
            if (types[t] == GGML_TYPE_Q4_1) put16(blk + 2, m_edge[e]);
        }
        for (int64_t r = 0; r < M; r++)
            for (int64_t j = 0; j < n; j++)
                want[r * n + j] =
                    contract_row_bits(types[t], tw.bytes + (size_t)j * tw.w.row_bytes, x + r * k, k, bits);
        for (int packed = 0; packed <= 1; packed++) {
            if (packed) pack_weight(&tw);
            for (int level = 0; level <= 2; level++) { /* portable, AVX2, AVX-512: what the CPU has */
                kn_cpu_limit_simd(level);
                for (int64_t m = 1; m <= M; m++) {
                    kn_matmul(stream(2, bits), &tw.w, x, got, m);
                    char what[96];
                    snprintf(what, sizeof what, "%s %d-bit %s %s m=%lld", quant_type_name(types[t]), bits,
                             packed ? "packed" : "file layout", kn_cpu_simd(), (long long)m);
                    assert_same_bits(got, want, (size_t)(m * n), what);
                }
            }
        }
        kn_cpu_limit_simd(2);
        free_weight(&tw);
    }
    free(x);
    free(got);
    free(want);
}

static void quantized_matmul_follows_the_integer_contract_bitwise(void **state) {
    (void)state;
    check_integer_contract(15);
}

static void quantized_matmul_8bit_follows_the_integer_contract_bitwise(void **state) {
    (void)state;
    check_integer_contract(8);
}

/* A non-finite x makes every output it touches NaN (as f32 would); a zero
 * row of x gives exact zeros. */
static void check_nan_and_zeros(int bits) {
    int64_t n = 32, k = 64;
    test_weight tw = make_weight(GGML_TYPE_Q4_1, n, k);
    pack_weight(&tw);
    float x[3 * 64] = {0}, y[3 * 32];
    fill(x + 64, 64, 1.0f);
    x[64 + 3] = NAN;
    fill(x + 128, 64, 1.0f);
    x[128 + 40] = INFINITY;
    for (int level = 0; level <= 2; level++) {
        kn_cpu_limit_simd(level);
        kn_matmul(stream(2, bits), &tw.w, x, y, 3);
        for (int64_t j = 0; j < n; j++) {
            assert_true(y[j] == 0.0f && !signbit(y[j]));
            assert_true(isnan(y[32 + j]));
            assert_true(isnan(y[64 + j]));
        }
    }
    kn_cpu_limit_simd(2);
    free_weight(&tw);
}

static void quantized_matmul_propagates_nan_and_keeps_zeros(void **state) {
    (void)state;
    check_nan_and_zeros(15);
}

static void quantized_matmul_8bit_propagates_nan_and_keeps_zeros(void **state) {
    (void)state;
    check_nan_and_zeros(8);
}

/* Hand-made blocks with known xi, at both precisions. Block 0 of x is
 * 127, -64, 2.5, 3.5, -2.5, 0.3, 0...: amax = 127, so at 8 bits
 * L / amax = 1 and xi = 127, -64, 2, 4, -2, 0 (ties to even, 0.3 lost),
 * sx = 1; at 15 bits L / amax = 128 and xi = 16256, -8192, 320, 448,
 * -320, 38 (0.3 * 128 = 38.4), sx = 1/128. Block 1 is zero. Weights with
 * d = 1 (f16 0x3c00), Q4_1's m = 0.5 (0x3800). */
static void quantized_matmul_exact_on_hand_made_blocks(void **state) {
    (void)state;
    int64_t k = 64;
    float x[64] = {127.0f, -64.0f, 2.5f, 3.5f, -2.5f, 0.3f};
    /* Q8_0, 16 rows (one packed group), row j: q[i] = (i + j) % 7 - 3. */
    uint8_t q8[16][2 * 34] = {{0}}, q40[16][2 * 18] = {{0}}, q41[16][2 * 20] = {{0}};
    for (int j = 0; j < 16; j++)
        for (int b = 0; b < 2; b++) {
            put16(q8[j] + 34 * b, 0x3c00);
            for (int i = 0; i < 32; i++) q8[j][34 * b + 2 + i] = (uint8_t)(int8_t)((i + j) % 7 - 3);
            put16(q40[j] + 18 * b, 0x3c00);
            put16(q41[j] + 20 * b, 0x3c00);
            put16(q41[j] + 20 * b + 2, 0x3800);
            for (int i = 0; i < 16; i++) {
                uint8_t lo = (uint8_t)((i + j) % 16), hi = (uint8_t)((i + 16 + 2 * j) % 16);
                q40[j][18 * b + 2 + i] = (uint8_t)(lo | hi << 4);
                q41[j][20 * b + 4 + i] = (uint8_t)(lo | hi << 4);
            }
        }
    const int32_t xi8[6] = {127, -64, 2, 4, -2, 0}, xi15[6] = {16256, -8192, 320, 448, -320, 38};
    const ggml_type types[3] = {GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1};
    const uint8_t *data[3] = {&q8[0][0], &q40[0][0], &q41[0][0]};
    for (int t = 0; t < 3; t++)
        for (int bits = 8; bits <= 15; bits += 7) {
            const int32_t *xi = bits == 8 ? xi8 : xi15;
            float sx = bits == 8 ? 1.0f : 1.0f / 128.0f;
            float want[16];
            for (int j = 0; j < 16; j++) {
                int32_t isum = 0, sum = 0;
                for (int i = 0; i < 6; i++) {
                    int32_t q = types[t] == GGML_TYPE_Q8_0 ? (i + j) % 7 - 3 : (i + j) % 16;
                    if (types[t] == GGML_TYPE_Q4_0) q -= 8;
                    isum += q * xi[i];
                    sum += xi[i];
                }
                /* Exact in f32: |isum| < 2^24 and sx a power of two. */
                want[j] = (float)isum * sx + (types[t] == GGML_TYPE_Q4_1 ? 0.5f * sx * (float)sum : 0.0f);
            }
            test_weight tw = {.w = {.type = types[t],
                                    .rows = 16,
                                    .cols = k,
                                    .data = data[t],
                                    .row_bytes = quant_row_bytes(types[t], (uint64_t)k)}};
            for (int packed = 0; packed <= 1; packed++) {
                if (packed) pack_weight(&tw);
                for (int level = 0; level <= 2; level++) {
                    kn_cpu_limit_simd(level);
                    float y[16];
                    kn_matmul(stream(1, bits), &tw.w, x, y, 1);
                    char what[80];
                    snprintf(what, sizeof what, "%s %d-bit %s %s", quant_type_name(types[t]), bits,
                             packed ? "packed" : "file layout", kn_cpu_simd());
                    assert_same_bits(y, want, 16, what);
                }
            }
            kn_cpu_limit_simd(2);
            free(tw.packed);
        }
}

/* At 8 bits every quantized type stays within the bound of x rounded to
 * 1/127 of its block's largest magnitude, against the f32 product of the
 * dequantized weights (computed in double), on every path. */
static void quantized_matmul_8bit_stays_within_its_rounding_bound(void **state) {
    (void)state;
    for (int level = 0; level <= 2; level++) {
        kn_cpu_limit_simd(level);
        for (size_t t = 3; t < N_TYPES; t++)
            check_matmul_reference_bits(ALL_TYPES[t], 6, 37, width_for(ALL_TYPES[t], 160), 8);
    }
    kn_cpu_limit_simd(2);
}

/* Row r of an m-row batch equals row r computed alone, for m = 1..33 and
 * 1, 2, 3 threads: tiles of 4 rows, partial tiles and thread splits all
 * give the same bits. */
static void check_batch_invariance(int bits) {
    const ggml_type *types = ALL_TYPES;
    const int64_t M = 33;
    for (size_t t = 0; t < N_TYPES; t++) {
        if (!is_quant(types[t]) && (bits == 8 || types[t] != GGML_TYPE_F32))
            continue; /* float W has no activation precision; F32 stands for the float types */
        int64_t n = 37, k = types[t] == GGML_TYPE_F32 ? 69 : width_for(types[t], 96);
        test_weight tw = make_weight(types[t], n, k);
        if (kn_weight_packed_bytes(&tw.w) > 0) pack_weight(&tw);
        float *x = malloc(sizeof(float) * (size_t)(M * k));
        float *alone = malloc(sizeof(float) * (size_t)(M * n));
        float *batch = malloc(sizeof(float) * (size_t)(M * n));
        fill(x, (size_t)(M * k), 1.0f);
        for (int64_t r = 0; r < M; r++) kn_matmul(stream(1, bits), &tw.w, x + r * k, alone + r * n, 1);
        for (int threads = 1; threads <= MAX_THREADS; threads++)
            for (int64_t m = 1; m <= M; m++) {
                /* The batch starts at row M - m so each row sits at a
                 * different place (and tile) than when computed alone. */
                const float *xb = x + (M - m) * k;
                kn_matmul(stream(threads, bits), &tw.w, xb, batch, m);
                char what[64];
                snprintf(what, sizeof what, "%s %d-bit m=%lld threads=%d", quant_type_name(types[t]), bits,
                         (long long)m, threads);
                assert_same_bits(batch, alone + (M - m) * n, (size_t)(m * n), what);
            }
        free(x);
        free(alone);
        free(batch);
        free_weight(&tw);
    }
}

static void matmul_row_is_batch_invariant(void **state) {
    (void)state;
    check_batch_invariance(15);
}

static void matmul_8bit_row_is_batch_invariant(void **state) {
    (void)state;
    check_batch_invariance(8);
}

/* A column shard (row_bytes = full stride, data and packed at the
 * shard's first block) computes exactly what a matrix holding only those
 * columns computes, packed or not. */
static void matmul_column_shard_reads_only_its_blocks(void **state) {
    (void)state;
    int64_t n = 40, k = 128, m = 3;
    size_t rb = quant_row_bytes(GGML_TYPE_Q4_1, (uint64_t)k), half = quant_row_bytes(GGML_TYPE_Q4_1, 64);
    test_weight full = make_weight(GGML_TYPE_Q4_1, n, k);
    test_weight own = make_weight(GGML_TYPE_Q4_1, n, 64);
    for (int64_t j = 0; j < n; j++) memcpy(own.bytes + (size_t)j * half, full.bytes + (size_t)j * rb + half, half);
    pack_weight(&full);
    pack_weight(&own);
    kn_weight shard = full.w;
    shard.cols = 64;
    shard.data = full.bytes + half;
    shard.packed = (const uint8_t *)full.packed + 2 * kn_pack_block_bytes(GGML_TYPE_Q4_1);
    float x[3 * 64], y[3 * 40], want[3 * 40];
    fill(x, sizeof x / sizeof x[0], 1.0f);
    kn_matmul(F.streams[1], &own.w, x, want, m);
    kn_matmul(F.streams[1], &shard, x, y, m);
    assert_same_bits(y, want, (size_t)(m * n), "packed column shard");
    shard.packed = NULL;
    kn_matmul(F.streams[1], &shard, x, y, m);
    assert_same_bits(y, want, (size_t)(m * n), "file-layout column shard");
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < n; j++) {
            double ref = 0;
            for (int64_t i = 0; i < 64; i++) ref += (double)full.deq[j * k + 64 + i] * x[r * 64 + i];
            assert_true(fabs(y[r * n + j] - ref) < 0.05);
        }
    free_weight(&full);
    free_weight(&own);
}

/* kn_matmul_n gives the bits of one kn_matmul per weight. */
static void fused_matmul_equals_separate_calls(void **state) {
    (void)state;
    int64_t k = 96, m = 5;
    test_weight a = make_weight(GGML_TYPE_Q4_1, 48, k), b = make_weight(GGML_TYPE_Q8_0, 21, k),
                c = make_weight(GGML_TYPE_Q4_0, 16, k);
    pack_weight(&a);
    pack_weight(&c);
    float x[5 * 96], ya[5 * 48], yb[5 * 21], yc[5 * 16], wa[5 * 48], wb[5 * 21], wc[5 * 16];
    fill(x, sizeof x / sizeof x[0], 1.5f);
    kn_matmul(F.streams[2], &a.w, x, wa, m);
    kn_matmul(F.streams[2], &b.w, x, wb, m);
    kn_matmul(F.streams[2], &c.w, x, wc, m);
    kn_matmul_n(F.streams[2], 3, (const kn_weight *[]){&a.w, &b.w, &c.w}, x, (float *[]){ya, yb, yc}, m);
    assert_same_bits(ya, wa, sizeof ya / sizeof ya[0], "fused q4_1");
    assert_same_bits(yb, wb, sizeof yb / sizeof yb[0], "fused q8_0");
    assert_same_bits(yc, wc, sizeof yc / sizeof yc[0], "fused q4_0");
    free_weight(&a);
    free_weight(&b);
    free_weight(&c);
}

/* ---- per-row ops -------------------------------------------------------- */

static void rmsnorm_matches_reference(void **state) {
    (void)state;
    enum { M = 3, N = 50 };
    float x[M * N], g[N], y[M * N];
    fill(x, M * N, 4.0f);
    fill(g, N, 1.0f);
    kn_rmsnorm(F.streams[1], x, g, y, M, N, 1e-5f);
    for (int r = 0; r < M; r++) {
        double ss = 0;
        for (int i = 0; i < N; i++) ss += (double)x[r * N + i] * x[r * N + i];
        double inv = 1.0 / sqrt(ss / N + 1e-5);
        for (int i = 0; i < N; i++) {
            double ref = x[r * N + i] * inv * g[i];
            assert_true(fabs(y[r * N + i] - ref) <= 1e-6 * (1 + fabs(ref)));
        }
    }
    kn_rmsnorm(F.streams[1], x, g, x, M, N, 1e-5f); /* in place gives the same */
    assert_same_bits(x, y, M * N, "in-place rmsnorm");
}

static void add_swiglu_and_bias_match_reference(void **state) {
    (void)state;
    enum { N = 70000 }; /* above the parallel threshold: pool path too */
    float *a = malloc(N * sizeof(float)), *b = malloc(N * sizeof(float));
    float *y = malloc(N * sizeof(float));
    fill(a, N, 8.0f);
    fill(b, N, 2.0f);
    kn_add(F.streams[3], a, b, y, N);
    for (int i = 0; i < N; i++) assert_true(y[i] == a[i] + b[i]);
    kn_swiglu(F.streams[3], a, b, y, N);
    for (int i = 0; i < N; i++) {
        double ref = a[i] / (1.0 + exp(-(double)a[i])) * b[i];
        assert_true(fabs(y[i] - ref) <= 1e-6 * (1 + fabs(ref)));
    }
    float x[2 * 3] = {1, 2, 3, 4, 5, 6}, bias[3] = {0.5f, -1, 2};
    kn_bias_add(F.streams[1], x, bias, 2, 3);
    const float want[6] = {1.5f, 1, 5, 4.5f, 4, 8};
    assert_same_bits(x, want, 6, "bias_add");
    free(a);
    free(b);
    free(y);
}

/* SwiGLU's exponential is the same polynomial on every path: the SIMD and
 * portable builds agree bit for bit, over a sweep of values and the edges
 * (zeros, tiny and huge magnitudes, infinities, NaN). kn_matmul_swiglu
 * gives the bits of its three separate calls. */
static void swiglu_paths_agree_bitwise(void **state) {
    (void)state;
    enum { N = 4099 };
    static float g[N], u[N], fast[N], slow[N];
    for (int i = 0; i < N; i++) {
        g[i] = (float)(i - N / 2) * 0.047f;
        u[i] = rndf() * 3.0f;
    }
    const float edge[] = {0.0f,   -0.0f,  1e-30f,  -1e-30f,  87.5f,     -87.5f, 88.7f,
                          -88.7f, 200.0f, -200.0f, INFINITY, -INFINITY, NAN};
    for (size_t i = 0; i < sizeof edge / sizeof edge[0]; i++) g[100 + i] = edge[i];
    kn_swiglu(F.streams[2], g, u, fast, N);
    kn_cpu_force_scalar(true);
    kn_swiglu(F.streams[2], g, u, slow, N);
    kn_cpu_force_scalar(false);
    assert_same_bits(fast, slow, N, "swiglu simd vs portable");
    for (int i = 0; i < N; i++) {
        if (isnan(g[i])) continue;
        double want = (double)g[i] / (1.0 + exp(-(double)g[i])) * u[i];
        /* e^-g is clamped at e^88, so silu(g < -88) is ~1e-36, not ~0. */
        if (fabs(fast[i] - want) > 4e-7 * fabs(want) + 1e-34)
            fail_msg("swiglu(%.9g, %.9g) = %.9g, reference %.9g", (double)g[i], (double)u[i], (double)fast[i], want);
    }
    assert_true(isnan(fast[112]));

    int64_t k = 96, m = 5;
    test_weight wg = make_weight(GGML_TYPE_Q4_1, 48, k), wu = make_weight(GGML_TYPE_Q4_1, 48, k);
    pack_weight(&wg);
    pack_weight(&wu);
    float x[5 * 96], yg[5 * 48], yu[5 * 48], sg[5 * 48], su[5 * 48];
    fill(x, sizeof x / sizeof x[0], 1.5f);
    kn_matmul_swiglu(F.streams[2], &wg.w, &wu.w, x, yg, yu, m);
    kn_matmul(F.streams[2], &wg.w, x, sg, m);
    kn_matmul(F.streams[2], &wu.w, x, su, m);
    kn_swiglu(F.streams[2], sg, su, sg, m * 48);
    assert_same_bits(yg, sg, sizeof yg / sizeof yg[0], "fused swiglu");
    free_weight(&wg);
    free_weight(&wu);
}

static void softmax_rows_sum_to_one_and_match_reference(void **state) {
    (void)state;
    enum { M = 2, N = 300 };
    float x[M * N], orig[M * N];
    fill(x, M * N, 20.0f);
    memcpy(orig, x, sizeof x);
    kn_softmax(F.streams[1], x, M, N);
    for (int r = 0; r < M; r++) {
        double mx = -INFINITY, sum = 0;
        for (int i = 0; i < N; i++) mx = fmax(mx, orig[r * N + i]);
        for (int i = 0; i < N; i++) sum += exp(orig[r * N + i] - mx);
        for (int i = 0; i < N; i++) {
            double ref = exp(orig[r * N + i] - mx) / sum;
            assert_true(fabs(x[r * N + i] - ref) <= 1e-6 * ref + 1e-12);
        }
    }
}

static void argmax_takes_lowest_index_of_ties_and_skips_nan(void **state) {
    (void)state;
    float x[3 * 4] = {1, 5, 5, 2, /**/ NAN, -3, -1, -2, /**/ NAN, NAN, NAN, NAN};
    int32_t out[3];
    kn_argmax(F.streams[1], x, out, 3, 4);
    assert_int_equal(out[0], 1);
    assert_int_equal(out[1], 2);
    assert_int_equal(out[2], 0);
}

static void embed_dequantizes_the_rows_of_the_ids(void **state) {
    (void)state;
    test_weight tw = make_weight(GGML_TYPE_Q8_0, 10, 64);
    int32_t ids[3] = {7, 0, 7};
    float out[3 * 64];
    kn_embed(F.streams[1], &tw.w, ids, out, 3);
    for (int t = 0; t < 3; t++) assert_same_bits(out + t * 64, tw.deq + ids[t] * 64, 64, "embed row");
    free_weight(&tw);
}

/* ---- RoPE --------------------------------------------------------------- */

static void rope_rotates_pairs_by_position_times_frequency(void **state) {
    (void)state;
    enum { M = 2, H = 3, D = 16 };
    for (int layout = 0; layout < 2; layout++) {
        kn_rope_config cfg = {.layout = (kn_rope_layout)layout, .head_dim = D, .theta = 10000.0};
        kn_rope r;
        assert_int_equal(kn_rope_init(&r, &cfg, NULL), AE_OK);
        float x[M * H * D], orig[M * H * D];
        fill(x, M * H * D, 1.0f);
        memcpy(orig, x, sizeof x);
        int32_t pos[M] = {0, 1234};
        kn_rope_apply(F.streams[1], &r, x, M, H, pos);
        for (int t = 0; t < M; t++)
            for (int h = 0; h < H; h++)
                for (int i = 0; i < D / 2; i++) {
                    int i0 = layout == KN_ROPE_ADJACENT ? 2 * i : i;
                    int i1 = layout == KN_ROPE_ADJACENT ? 2 * i + 1 : i + D / 2;
                    double a = pos[t] * pow(10000.0, -2.0 * i / D);
                    const float *o = orig + (t * H + h) * D;
                    const float *y = x + (t * H + h) * D;
                    double y0 = o[i0] * cos(a) - o[i1] * sin(a);
                    double y1 = o[i0] * sin(a) + o[i1] * cos(a);
                    assert_true(fabs(y[i0] - y0) < 1e-6 && fabs(y[i1] - y1) < 1e-6);
                }
    }
}

/* Llama 3 scaling keeps short wavelengths, divides long ones by factor,
 * and blends the band between. */
static void rope_llama3_scaling_bands(void **state) {
    (void)state;
    kn_rope_config cfg = {.layout = KN_ROPE_NEOX,
                          .head_dim = 128,
                          .theta = 500000.0,
                          .factor = 8.0,
                          .low_freq_factor = 1.0,
                          .high_freq_factor = 4.0,
                          .original_max_pos = 8192.0};
    kn_rope r;
    assert_int_equal(kn_rope_init(&r, &cfg, NULL), AE_OK);
    int blended = 0;
    for (int i = 0; i < 64; i++) {
        double f = 1.0 / pow(500000.0, 2.0 * i / 128), wl = 2 * M_PI / f;
        if (wl < 8192.0 / 4.0)
            assert_true(r.inv_freq[i] == f);
        else if (wl > 8192.0)
            assert_true(fabs(r.inv_freq[i] - f / 8.0) <= 1e-15 * f);
        else {
            assert_true(r.inv_freq[i] < f && r.inv_freq[i] > f / 8.0);
            blended++;
        }
    }
    assert_true(blended > 0);
    cfg.low_freq_factor = 4.0; /* no band: rejected */
    ae_error err = {{0}};
    assert_int_equal(kn_rope_init(&r, &cfg, &err), AE_ERR);
    assert_non_null(strstr(err.msg, "high_freq_factor"));
}

/* ---- attention ---------------------------------------------------------- */

enum { BS = 16, NB = 40, KVH = 2, HD = 24, NH = 6, TBL = 8 };

typedef struct kv_fixture {
    uint16_t k[NB * BS * KVH * HD], v[NB * BS * KVH * HD]; /* f16 */
    kn_kv_pool pool;
    int32_t tables[4 * TBL]; /* 4 sequences */
} kv_fixture;

/* n random values in [-scale, scale), rounded to f16. */
static void fill_f16(uint16_t *h, size_t n, float scale) {
    for (size_t i = 0; i < n; i++) h[i] = quant_f32_to_f16(rndf() * scale);
}

static void kv_setup(kv_fixture *f) {
    fill_f16(f->k, sizeof f->k / sizeof f->k[0], 1.0f);
    fill_f16(f->v, sizeof f->v / sizeof f->v[0], 1.0f);
    /* Through void * so that this file also builds against an f32 pool
     * (the regression run of the f16 change). */
    f->pool = (kn_kv_pool){.k = (void *)f->k,
                           .v = (void *)f->v,
                           .n_blocks = NB,
                           .block_size = BS,
                           .n_kv_heads = KVH,
                           .head_dim = HD,
                           .type = GGML_TYPE_F16};
    /* Scrambled block ids: sequence s, entry e -> a distinct block. */
    for (int s = 0; s < 4; s++)
        for (int e = 0; e < TBL; e++) f->tables[s * TBL + e] = (e * 4 + s) * 7 % 32 + (s == 3 ? 8 : 0);
}

static const uint16_t *kv_row(const kv_fixture *f, const uint16_t *base, int seq, int slot, int g) {
    int blk = f->tables[seq * TBL + slot / BS];
    return base + (((size_t)blk * BS + (size_t)(slot % BS)) * KVH + (size_t)g) * HD;
}

/* out vs softmax(q k / sqrt(hd)) v in double over the token's visible slots. */
static void attention_reference(const kv_fixture *f, const kn_kv_map *map, const float *q, const float *out) {
    for (int t = 0; t < map->m; t++) {
        int nvis = map->n_prefix[t] + map->n_extra[t];
        for (int h = 0; h < NH; h++) {
            int g = h / (NH / KVH);
            const float *qh = q + ((size_t)t * NH + (size_t)h) * HD;
            double s[256], mx = -INFINITY, sum = 0, o[HD] = {0};
            for (int i = 0; i < nvis; i++) {
                int slot = i < map->n_prefix[t] ? i : map->extra[map->extra_start[t] + i - map->n_prefix[t]];
                const uint16_t *kr = kv_row(f, f->k, map->seq[t], slot, g);
                s[i] = 0;
                for (int d = 0; d < HD; d++) s[i] += (double)qh[d] * quant_f16_to_f32(kr[d]);
                s[i] /= sqrt((double)HD);
                mx = fmax(mx, s[i]);
            }
            for (int i = 0; i < nvis; i++) {
                int slot = i < map->n_prefix[t] ? i : map->extra[map->extra_start[t] + i - map->n_prefix[t]];
                const uint16_t *vr = kv_row(f, f->v, map->seq[t], slot, g);
                double p = exp(s[i] - mx);
                sum += p;
                for (int d = 0; d < HD; d++) o[d] += p * quant_f16_to_f32(vr[d]);
            }
            for (int d = 0; d < HD; d++) {
                double ref = o[d] / sum;
                float got = out[((size_t)t * NH + (size_t)h) * HD + (size_t)d];
                if (fabs(got - ref) > 2e-6)
                    fail_msg("token %d head %d dim %d: %.9g, reference %.9g", t, h, d, (double)got, ref);
            }
        }
    }
}

static void attention_matches_reference_with_gqa_and_paged_blocks(void **state) {
    (void)state;
    static kv_fixture f;
    kv_setup(&f);
    /* Four tokens: a long prefix crossing chunk and block edges, a short
     * one, a tree node with extras, another sequence. */
    int32_t seq[4] = {0, 1, 2, 3}, slot[4] = {0}, n_prefix[4] = {100, 3, 70, 128};
    int32_t extra_start[4] = {0, 0, 0, 3}, n_extra[4] = {0, 0, 3, 0}, extra[3] = {90, 95, 101};
    kn_kv_map map = {.m = 4,
                     .block_tables = f.tables,
                     .n_seqs = 4,
                     .table_len = TBL,
                     .seq = seq,
                     .slot = slot,
                     .n_prefix = n_prefix,
                     .extra_start = extra_start,
                     .n_extra = n_extra,
                     .extra = extra,
                     .n_extra_total = 3};
    float q[4 * NH * HD], out[4 * NH * HD];
    fill(q, sizeof q / sizeof q[0], 2.0f);
    kn_attention(F.streams[2], &f.pool, &map, q, out, NH);
    attention_reference(&f, &map, q, out);
}

/* Few tokens split their chunks over the threads and keep the partials in
 * the workspace; without room for them the same tokens take the other
 * way. Both give the same bits (kernels.h fixes the chunk merge), with 1
 * to 3 threads, and so does the portable build. */
static void attention_split_and_walk_agree_bitwise(void **state) {
    (void)state;
    static kv_fixture f;
    kv_setup(&f);
    int32_t seq[2] = {0, 2}, slot[2] = {0}, n_prefix[2] = {100, 70};
    int32_t extra_start[2] = {0, 0}, n_extra[2] = {0, 3}, extra[3] = {90, 95, 101};
    kn_kv_map map = {.m = 2,
                     .block_tables = f.tables,
                     .n_seqs = 4,
                     .table_len = TBL,
                     .seq = seq,
                     .slot = slot,
                     .n_prefix = n_prefix,
                     .extra_start = extra_start,
                     .n_extra = n_extra,
                     .extra = extra,
                     .n_extra_total = 3};
    float q[2 * NH * HD], split[2 * NH * HD], walk[2 * NH * HD];
    fill(q, sizeof q / sizeof q[0], 2.0f);
    kn_stream *bare;
    assert_int_equal(kn_stream_init(&bare, &kn_backend_cpu, &(kn_stream_config){F.pools[2], 0}, NULL), AE_OK);
    kn_attention(bare, &f.pool, &map, q, walk, NH);
    for (int m = 1; m <= 2; m++) {
        map.m = m;
        for (int threads = 1; threads <= MAX_THREADS; threads++) {
            kn_attention(F.streams[threads], &f.pool, &map, q, split, NH);
            char what[64];
            snprintf(what, sizeof what, "m=%d, %d threads", m, threads);
            assert_same_bits(split, walk, (size_t)m * NH * HD, what);
        }
    }
    /* The portable build of the same code gives the same bits. */
    map.m = 2;
    kn_cpu_force_scalar(true);
    kn_attention(F.streams[2], &f.pool, &map, q, split, NH);
    kn_cpu_force_scalar(false);
    assert_same_bits(split, walk, (size_t)2 * NH * HD, "portable");
    kn_stream_free(bare);
}

/* Each element lands at its slot rounded to f16 exactly as
 * quant_f32_to_f16 rounds it (nearest, ties to even). */
static void kv_write_stores_rows_at_their_slots_rounded_to_f16(void **state) {
    (void)state;
    static kv_fixture f;
    kv_setup(&f);
    int32_t seq[2] = {1, 3}, slot[2] = {17, 127}, zero[2] = {0};
    kn_kv_map map = {.m = 2,
                     .block_tables = f.tables,
                     .n_seqs = 4,
                     .table_len = TBL,
                     .seq = seq,
                     .slot = slot,
                     .n_prefix = zero,
                     .extra_start = zero,
                     .n_extra = zero};
    float k[2 * KVH * HD], v[2 * KVH * HD];
    fill(k, sizeof k / sizeof k[0], 1.0f);
    fill(v, sizeof v / sizeof v[0], 1.0f);
    kn_kv_write(F.streams[1], &f.pool, &map, k, v);
    for (int t = 0; t < 2; t++)
        for (int g = 0; g < KVH; g++)
            for (int d = 0; d < HD; d++) {
                size_t i = (size_t)(t * KVH + g) * HD + (size_t)d;
                uint16_t gk = kv_row(&f, f.k, seq[t], slot[t], g)[d], gv = kv_row(&f, f.v, seq[t], slot[t], g)[d];
                if (gk != quant_f32_to_f16(k[i]) || gv != quant_f32_to_f16(v[i]))
                    fail_msg("token %d kv head %d dim %d: stored k 0x%04x v 0x%04x, expected 0x%04x 0x%04x", t, g, d,
                             gk, gv, quant_f32_to_f16(k[i]), quant_f32_to_f16(v[i]));
            }
}

/* Every f32 that matters for rounding to f16: each half's exact value,
 * one f32 ulp either side, the midpoints to the next half (ties) and one
 * ulp either side of them, for every sign and class (subnormal halves,
 * the overflow edge at 65520, infinities, quiet and signalling NaNs) and
 * f32 subnormals. The F16C path of kn_kv_write and the portable one store
 * quant_f32_to_f16's bits for all of them. */
static void kv_write_rounds_like_quant_on_every_boundary_and_path(void **state) {
    (void)state;
    enum { PER = 6, ROWS = 65536 * PER / (KVH * HD) + 1 };
    static float x[ROWS * KVH * HD];
    size_t n = 0;
    for (uint32_t h = 0; h <= 0xffff; h++) {
        float a = quant_f16_to_f32((uint16_t)h);
        if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) { /* NaN: a quiet one and a signalling one */
            uint32_t sign = fbits(a) & 0x80000000u, pay = (uint32_t)(h & 0x1ff) << 13;
            uint32_t cand[PER] = {sign | 0x7fc00000u | pay, sign | 0x7f800000u | pay | 1u,
                                  sign | 0x7f800001u,       sign | 0x7fffffffu,
                                  sign | 0x7fa00000u,       sign | 0x7fc00001u};
            for (int i = 0; i < PER; i++) memcpy(&x[n++], &cand[i], sizeof(float));
            continue;
        }
        uint16_t up = (uint16_t)(h + 1); /* the next half away from zero */
        float b = (h & 0x7fff) < 0x7c00 ? quant_f16_to_f32(up) : a;
        float mid = (h & 0x7fff) == 0x7bff ? copysignf(65520.0f, a) : (float)(((double)a + (double)b) / 2);
        float cand[PER] = {a,   nextafterf(a, 0.0f),   nextafterf(a, copysignf(INFINITY, a)),
                           mid, nextafterf(mid, 0.0f), nextafterf(mid, copysignf(INFINITY, a))};
        for (int i = 0; i < PER; i++) x[n++] = cand[i];
    }
    x[n++] = 0x1p-149f; /* f32 subnormals */
    x[n++] = -0x1p-130f;
    while (n < sizeof x / sizeof x[0]) x[n++] = 0x1p-25f;
    static uint16_t pool_k[ROWS * KVH * HD], pool_v[ROWS * KVH * HD];
    static int32_t slots[ROWS], table[ROWS / BS + 1], zero[ROWS];
    for (int i = 0; i < ROWS / BS + 1; i++) table[i] = i;
    for (int i = 0; i < ROWS; i++) slots[i] = i;
    kn_kv_pool kvp = {.k = (void *)pool_k,
                      .v = (void *)pool_v,
                      .n_blocks = ROWS / BS + 1,
                      .block_size = BS,
                      .n_kv_heads = KVH,
                      .head_dim = HD,
                      .type = GGML_TYPE_F16};
    kn_kv_map map = {.m = ROWS,
                     .block_tables = table,
                     .n_seqs = 1,
                     .table_len = ROWS / BS + 1,
                     .seq = zero,
                     .slot = slots,
                     .n_prefix = zero,
                     .extra_start = zero,
                     .n_extra = zero};
    for (int level = 0; level <= 2; level++) {
        kn_cpu_limit_simd(level);
        memset(pool_k, 0xff, sizeof pool_k);
        memset(pool_v, 0xff, sizeof pool_v);
        kn_kv_write(F.streams[1], &kvp, &map, x, x);
        for (size_t i = 0; i < sizeof x / sizeof x[0]; i++) {
            uint16_t want = quant_f32_to_f16(x[i]);
            if (pool_k[i] != want || pool_v[i] != want)
                fail_msg("simd level %d: 0x%08x stored as k 0x%04x v 0x%04x, expected 0x%04x", level, fbits(x[i]),
                         pool_k[i], pool_v[i], want);
        }
    }
    kn_cpu_limit_simd(2);
}

/* The tree-vs-decode case. Sequence 0 has 70 committed slots (past the
 * first two chunks of 32). A tree node at depth 3 has its ancestors and itself
 * in scratch slots 100, 104, 110; after acceptance the same rows sit at
 * slots 70, 71, 72 and the token decodes with n_prefix = 73. Both see the
 * same keys in the same order: bitwise equal, whatever else is in the
 * batch and wherever the token sits in it, with 1, 2 or 3 threads. */
static void attention_tree_node_equals_decode_after_commit_bitwise(void **state) {
    (void)state;
    static kv_fixture f;
    kv_setup(&f);
    const int scratch[3] = {100, 104, 110};
    for (int i = 0; i < 3; i++)
        for (int g = 0; g < KVH; g++) {
            memcpy((uint16_t *)kv_row(&f, f.k, 0, 70 + i, g), kv_row(&f, f.k, 0, scratch[i], g), HD * sizeof(uint16_t));
            memcpy((uint16_t *)kv_row(&f, f.v, 0, 70 + i, g), kv_row(&f, f.v, 0, scratch[i], g), HD * sizeof(uint16_t));
        }
    float qtok[NH * HD];
    fill(qtok, NH * HD, 2.0f);

    /* Decode: the token alone. */
    int32_t d_seq[1] = {0}, d_pre[1] = {73}, zero[1] = {0};
    kn_kv_map dec = {.m = 1,
                     .block_tables = f.tables,
                     .n_seqs = 4,
                     .table_len = TBL,
                     .seq = d_seq,
                     .slot = zero,
                     .n_prefix = d_pre,
                     .extra_start = zero,
                     .n_extra = zero};
    float want[NH * HD];
    kn_attention(F.streams[1], &f.pool, &dec, qtok, want, NH);

    /* Tree: the token at batch position p among 5 others (siblings of other
     * depths, another sequence's prefill rows). */
    enum { M = 6 };
    int32_t extra[] = {100, 104, 110, /* the node */ 100, 104, /* a sibling */ 100};
    for (int threads = 1; threads <= MAX_THREADS; threads++)
        for (int p = 0; p < M; p++) {
            int32_t seq[M], n_prefix[M], extra_start[M], n_extra[M];
            float q[M * NH * HD], out[M * NH * HD];
            fill(q, sizeof q / sizeof q[0], 2.0f);
            for (int t = 0, other = 0; t < M; t++) {
                if (t == p) {
                    seq[t] = 0, n_prefix[t] = 70, extra_start[t] = 0, n_extra[t] = 3;
                    memcpy(q + t * NH * HD, qtok, sizeof qtok);
                    continue;
                }
                switch (other++) {
                case 0: seq[t] = 0, n_prefix[t] = 70, extra_start[t] = 3, n_extra[t] = 2; break;
                case 1: seq[t] = 0, n_prefix[t] = 70, extra_start[t] = 5, n_extra[t] = 1; break;
                default: seq[t] = 2, n_prefix[t] = 5 + 20 * other, extra_start[t] = 0, n_extra[t] = 0; break;
                }
            }
            kn_kv_map tree = {.m = M,
                              .block_tables = f.tables,
                              .n_seqs = 4,
                              .table_len = TBL,
                              .seq = seq,
                              .slot = seq,
                              .n_prefix = n_prefix,
                              .extra_start = extra_start,
                              .n_extra = n_extra,
                              .extra = extra,
                              .n_extra_total = 6};
            kn_attention(F.streams[threads], &f.pool, &tree, q, out, NH);
            char what[64];
            snprintf(what, sizeof what, "tree node at batch position %d, %d threads", p, threads);
            assert_same_bits(out + p * NH * HD, want, NH * HD, what);
        }
}

/* Token t of `map` alone in a pass of its own, on stream s. */
static void attend_alone(kn_stream *s, const kv_fixture *f, const kn_kv_map *map, int t, const float *q, float *out) {
    int32_t zero[1] = {0};
    kn_kv_map one = {.m = 1,
                     .block_tables = f->tables,
                     .n_seqs = 4,
                     .table_len = TBL,
                     .seq = map->seq + t,
                     .slot = map->seq + t,
                     .n_prefix = map->n_prefix + t,
                     .extra_start = zero,
                     .n_extra = map->n_extra + t,
                     .extra = map->extra + map->extra_start[t],
                     .n_extra_total = map->n_extra[t]};
    kn_attention(s, &f->pool, &one, q + (size_t)t * NH * HD, out, NH);
}

/* Tokens of one sequence side by side share each chunk that lies wholly
 * in their prefixes (loaded and widened once for all of them). Whatever
 * shares a chunk, every token gets the bits it gets alone: a tree of 8
 * nodes over a prefix of 100 slots (3 shared chunks, then each node's own
 * end of prefix and ancestors) and over one of 64 (a chunk edge), next to
 * another sequence's decode token, and a prefill run of 20 positions;
 * with 1 to 3 threads, with and without the workspace (the split and the
 * walk ways), at every SIMD level. */
static void attention_shared_chunks_give_each_token_its_alone_bits(void **state) {
    (void)state;
    static kv_fixture f;
    kv_setup(&f);
    /* Tree nodes in scratch slots 100 + i; parent of node i. */
    const int parent[8] = {-1, 0, 0, 1, 1, 2, 3, 3};
    enum { TREE = 8, PRE = 20, M = TREE + 1 + PRE };
    int32_t seq[M], n_prefix[M], extra_start[M], n_extra[M], extra[TREE * TREE];
    int n_ex = 0;
    for (int i = 0; i < TREE; i++) {
        int path[TREE], d = 0;
        for (int j = i; j >= 0; j = parent[j]) path[d++] = 100 + j;
        seq[i] = 0, extra_start[i] = n_ex, n_extra[i] = d;
        while (d > 0) extra[n_ex++] = path[--d]; /* root first: increasing slots */
    }
    seq[TREE] = 3, n_prefix[TREE] = 77, extra_start[TREE] = 0, n_extra[TREE] = 0;
    for (int i = 0; i < PRE; i++) {
        int t = TREE + 1 + i;
        seq[t] = 1, n_prefix[t] = 50 + i, extra_start[t] = 0, n_extra[t] = 0;
    }
    static float q[M * NH * HD], got[M * NH * HD], alone[M * NH * HD], ref[M * NH * HD];
    fill(q, sizeof q / sizeof q[0], 2.0f);
    kn_stream *bare;
    assert_int_equal(kn_stream_init(&bare, &kn_backend_cpu, &(kn_stream_config){F.pools[2], 0}, NULL), AE_OK);
    const int prefixes[2] = {100, 64};
    for (int pi = 0; pi < 2; pi++) {
        for (int i = 0; i < TREE; i++) n_prefix[i] = prefixes[pi];
        kn_kv_map map = {.m = M,
                         .block_tables = f.tables,
                         .n_seqs = 4,
                         .table_len = TBL,
                         .seq = seq,
                         .slot = seq,
                         .n_prefix = n_prefix,
                         .extra_start = extra_start,
                         .n_extra = n_extra,
                         .extra = extra,
                         .n_extra_total = n_ex};
        kn_cpu_limit_simd(0);
        for (int t = 0; t < M; t++) attend_alone(F.streams[1], &f, &map, t, q, ref + (size_t)t * NH * HD);
        for (int level = 0; level <= 2; level++) {
            kn_cpu_limit_simd(level);
            for (int t = 0; t < M; t++) attend_alone(F.streams[1], &f, &map, t, q, alone + (size_t)t * NH * HD);
            char what[96];
            snprintf(what, sizeof what, "prefix %d, each token alone, simd level %d vs portable", prefixes[pi], level);
            assert_same_bits(alone, ref, (size_t)M * NH * HD, what);
            /* The tree alone (8 tokens: the split way), the whole batch
             * (the walk way), and both on a stream without workspace. */
            const int ms[2] = {TREE, M};
            for (int mi = 0; mi < 2; mi++)
                for (int threads = 0; threads <= MAX_THREADS; threads++) {
                    map.m = ms[mi];
                    memset(got, 0, sizeof got);
                    kn_attention(threads == 0 ? bare : F.streams[threads], &f.pool, &map, q, got, NH);
                    snprintf(what, sizeof what, "prefix %d, %d tokens together, %d threads%s, simd level %d",
                             prefixes[pi], ms[mi], threads == 0 ? 2 : threads, threads == 0 ? " (no workspace)" : "",
                             level);
                    assert_same_bits(got, ref, (size_t)ms[mi] * NH * HD, what);
                }
        }
        kn_cpu_limit_simd(2);
        attention_reference(&f,
                            &(kn_kv_map){.m = M,
                                         .block_tables = f.tables,
                                         .n_seqs = 4,
                                         .table_len = TBL,
                                         .seq = seq,
                                         .slot = seq,
                                         .n_prefix = n_prefix,
                                         .extra_start = extra_start,
                                         .n_extra = n_extra,
                                         .extra = extra,
                                         .n_extra_total = n_ex},
                            q, ref);
    }
    kn_stream_free(bare);
}

/* ---- tensor parallelism ------------------------------------------------- */

enum { TP_M = 3, TP_N = 24, TP_K = 256 };

typedef struct tp_rank {
    kn_comm *comm;
    kn_stream *stream;
    const test_weight *w;
    const float *x; /* [TP_M][TP_K], the full activations */
    float y[TP_M * TP_N];
    float xs[TP_M * TP_K];
    float part[TP_M * TP_N];  /* the rank's partial, kept */
    float resid[TP_M * TP_N]; /* a residual stream, after kn_allreduce_add */
} tp_rank;

/* Row-parallel: rank r takes input columns [r*K/R, (r+1)*K/R) of W and
 * of x, multiplies, and allreduces the partial outputs. */
static void *tp_rank_main(void *arg) {
    tp_rank *rk = arg;
    int r = kn_comm_rank(rk->comm), R = kn_comm_size(rk->comm);
    int64_t kc = TP_K / R;
    kn_weight shard = rk->w->w;
    shard.cols = kc;
    shard.data = rk->w->bytes + quant_row_bytes(shard.type, (uint64_t)(kc * r));
    for (int t = 0; t < TP_M; t++) memcpy(rk->xs + t * kc, rk->x + t * TP_K + kc * r, (size_t)kc * sizeof(float));
    kn_matmul(rk->stream, &shard, rk->xs, rk->y, TP_M);
    memcpy(rk->part, rk->y, sizeof rk->part);
    kn_allreduce_sum(rk->comm, rk->stream, rk->y, TP_M * TP_N);
    /* the fused form: the residual plus the same sum */
    for (int i = 0; i < TP_M * TP_N; i++) rk->resid[i] = 0.25f * (float)(i % 7) - 0.5f;
    kn_allreduce_add(rk->comm, rk->stream, rk->part, rk->resid, TP_M * TP_N);
    return NULL;
}

static void run_tp(int R, const test_weight *w, const float *x, tp_rank *ranks) {
    kn_comm *comms[2];
    assert_int_equal(kn_comm_init_cpu(comms, R, TP_M * TP_N, NULL), AE_OK);
    pthread_t th[2];
    for (int r = 0; r < R; r++) {
        ranks[r].comm = comms[r];
        ranks[r].stream = F.streams[1 + r]; /* a stream per rank */
        ranks[r].w = w;
        ranks[r].x = x;
        assert_int_equal(pthread_create(&th[r], NULL, tp_rank_main, &ranks[r]), 0);
    }
    for (int r = 0; r < R; r++) pthread_join(th[r], NULL);
    kn_comm_free(comms, R);
}

static void allreduce_two_ranks_matches_one_rank_and_repeats_bitwise(void **state) {
    (void)state;
    test_weight w = make_weight(GGML_TYPE_Q4_1, TP_N, TP_K);
    float x[TP_M * TP_K];
    fill(x, TP_M * TP_K, 1.0f);
    static tp_rank one[1], two[2], again[2];
    run_tp(1, &w, x, one);
    run_tp(2, &w, x, two);
    run_tp(2, &w, x, again);
    assert_same_bits(two[0].y, two[1].y, TP_M * TP_N, "rank 0 vs rank 1");
    assert_same_bits(two[0].y, again[0].y, TP_M * TP_N, "run 1 vs run 2");
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < TP_M * TP_N; i++) {
            float want = (0.25f * (float)(i % 7) - 0.5f) + two[0].y[i];
            assert_memory_equal(&two[r].resid[i], &want, sizeof want);
        }
    for (int i = 0; i < TP_M * TP_N; i++)
        assert_true(fabsf(two[0].y[i] - one[0].y[i]) <= 1e-5f * (1 + fabsf(one[0].y[i])));
    free_weight(&w);
}

static void allreduce_sums_in_rank_order_and_one_rank_is_a_noop(void **state) {
    (void)state;
    float buf[2] = {1.5f, -2.0f};
    kn_allreduce_sum(NULL, F.streams[1], buf, 2);
    assert_true(buf[0] == 1.5f && buf[1] == -2.0f);
    kn_comm *c[1];
    assert_int_equal(kn_comm_init_cpu(c, 1, 2, NULL), AE_OK);
    assert_int_equal(kn_comm_size(c[0]), 1);
    kn_allreduce_sum(c[0], F.streams[1], buf, 2);
    assert_true(buf[0] == 1.5f && buf[1] == -2.0f);
    assert_int_equal(kn_comm_kind(c[0]), KN_ALLREDUCE_CPU);
    float x[2] = {0.25f, 1.0f};
    kn_allreduce_add(c[0], F.streams[1], buf, x, 2); /* one rank: the add alone */
    assert_true(x[0] == 1.75f && x[1] == -1.0f);
    kn_allreduce_add(NULL, F.streams[1], buf, x, 2);
    assert_true(x[0] == 3.25f && x[1] == -3.0f);
    kn_comm_free(c, 1);
    kn_comm_free(NULL, 0);
    /* the kinds by name, and the ones the CPU backend does not have */
    assert_int_equal(kn_allreduce_parse("custom"), KN_ALLREDUCE_CUSTOM);
    assert_int_equal(kn_allreduce_parse("nccl"), KN_ALLREDUCE_NCCL);
    assert_int_equal(kn_allreduce_parse("ring"), -1);
    assert_string_equal(kn_allreduce_name(KN_ALLREDUCE_AUTO), "auto");
    ae_error err = {{0}};
    kn_comm *two[2] = {c[0], c[0]};
    assert_int_equal(kn_comm_init(&kn_backend_cpu, KN_ALLREDUCE_NCCL, two, 2, NULL, 4, &err), AE_ERR);
    assert_string_equal(err.msg, "comm: the cpu backend's ranks reduce with --allreduce cpu, not nccl (nccl and "
                                 "custom are the cuda backend's)");
    assert_null(two[0]);
    err.msg[0] = '\0';
    assert_int_equal(kn_comm_init(&kn_backend_cpu, KN_ALLREDUCE_AUTO, two, 2, NULL, 4, &err), AE_ERR);
    assert_string_equal(err.msg, "comm: allreduce auto is chosen before a comm is made");
}

/* ---- the backend table ---------------------------------------------------- */

static void cpu_backend_says_what_it_supports(void **state) {
    (void)state;
    const kn_backend *be = kn_stream_backend(F.streams[1]);
    assert_ptr_equal(be, &kn_backend_cpu);
    assert_string_equal(kn_backend_name(be), "cpu");
    for (size_t i = 0; i < N_TYPES; i++) assert_true(kn_backend_supports(be, KN_OP_MATMUL, ALL_TYPES[i]));
    assert_false(kn_backend_supports(be, KN_OP_MATMUL, GGML_TYPE_Q8_K)); /* no kernel: refused at load */
    assert_false(kn_backend_supports(be, KN_OP_MATMUL, (ggml_type)16));  /* IQ2_XXS, likewise */
    assert_true(kn_backend_supports(be, KN_OP_EMBED, GGML_TYPE_Q6_K));   /* kn_embed reads any type */
    assert_true(kn_backend_supports(be, KN_OP_KV, GGML_TYPE_F16));
    assert_false(kn_backend_supports(be, KN_OP_KV, GGML_TYPE_F32));
    assert_true(kn_backend_supports(be, KN_OP_F32, GGML_TYPE_F32));
    assert_false(kn_backend_supports(be, KN_OP_F32, GGML_TYPE_F16));
}

static void buffers_round_trip_and_events_order_nothing_on_the_cpu(void **state) {
    (void)state;
    kn_stream *s = F.streams[2];
    kn_buf b;
    ae_error err = {0};
    assert_int_equal(kn_buf_alloc(&kn_backend_cpu, &b, 1000, &err), AE_OK);
    assert_int_equal(b.bytes, 1000);
    assert_int_equal((uintptr_t)b.ptr % 64, 0);
    uint8_t in[1000], out[1000] = {0};
    for (int i = 0; i < 1000; i++) in[i] = (uint8_t)(i * 7 + 3);
    kn_upload(s, &b, 0, in, 600);
    kn_upload(s, &b, 600, in + 600, 400);
    kn_event e = {0};
    kn_event_record(s, &e);
    kn_event_wait(F.streams[1], &e);
    kn_stream_sync(s);
    kn_download(s, out, &b, 0, 1000);
    assert_memory_equal(in, out, 1000);
    memset(out, 0, sizeof out);
    kn_download(s, out + 10, &b, 250, 5);
    assert_int_equal(out[10], (uint8_t)(250 * 7 + 3));
    assert_int_equal(out[14], (uint8_t)(254 * 7 + 3));
    assert_int_equal(out[15], 0);
    kn_buf_free(&b);
    assert_null(b.ptr);
    kn_buf_free(&b); /* a zeroed buffer is a no-op */
}

static void gather_rows_copies_the_named_rows_to_a_stride(void **state) {
    (void)state;
    float src[5][3], dst[3][4];
    for (int r = 0; r < 5; r++)
        for (int c = 0; c < 3; c++) src[r][c] = (float)(10 * r + c);
    for (int r = 0; r < 3; r++)
        for (int c = 0; c < 4; c++) dst[r][c] = -1.0f;
    int32_t rows[3] = {4, 0, 4};
    kn_gather_rows(F.streams[1], &src[0][0], rows, 3, 3, &dst[0][0], 4);
    const float want[3][4] = {{40, 41, 42, -1}, {0, 1, 2, -1}, {40, 41, 42, -1}};
    assert_memory_equal(dst, want, sizeof want);
    /* No rows: 0, 1, 2 in order. */
    kn_gather_rows(F.streams[1], &src[0][0], NULL, 3, 3, &dst[0][0], 4);
    const float first[3][4] = {{0, 1, 2, -1}, {10, 11, 12, -1}, {20, 21, 22, -1}};
    assert_memory_equal(dst, first, sizeof first);
}

static void test_topk_largest_first_lower_index_on_ties(void **state) {
    (void)state;
    const float x[] = {0.1f, 0.7f, NAN, 0.7f, 0.3f, -1.0f};
    int32_t idx[6];
    float val[6];
    kn_topk(stream(1, 15), x, 1, 6, 3, idx, val);
    const int32_t want[] = {1, 3, 4};
    const float wv[] = {0.7f, 0.7f, 0.3f};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(idx[i], want[i]);
        assert_true(val[i] == wv[i]);
    }
}

static void test_topk_of_all_puts_nan_last_as_minus_infinity(void **state) {
    (void)state;
    const float x[] = {0.1f, 0.7f, NAN, 0.7f, 0.3f, -INFINITY};
    int32_t idx[6];
    float val[6];
    kn_topk(stream(1, 15), x, 1, 6, 6, idx, val);
    /* -inf at 5 and NaN (as -inf) at 2 tie: the lower index first. */
    const int32_t want[] = {1, 3, 4, 0, 2, 5};
    const float wv[] = {0.7f, 0.7f, 0.3f, 0.1f, -INFINITY, -INFINITY};
    for (int i = 0; i < 6; i++) {
        assert_int_equal(idx[i], want[i]);
        assert_true(val[i] == wv[i]);
    }
    const float nans[] = {NAN, NAN, NAN};
    kn_topk(stream(1, 15), nans, 1, 3, 2, idx, val);
    assert_int_equal(idx[0], 0);
    assert_int_equal(idx[1], 1);
    assert_true(val[0] == -INFINITY && val[1] == -INFINITY);
}

/* Rows apart, and more than 16 candidates of equal value: each row's k
 * best, the lower indices first. */
static void test_topk_of_several_rows(void **state) {
    (void)state;
    enum { M = 3, N = 40, K = KN_TOPK_MAX };
    float x[M * N];
    for (int r = 0; r < M; r++)
        for (int i = 0; i < N; i++) x[r * N + i] = r == 2 ? 1.0f : (float)((i * 7 + r) % 13);
    int32_t idx[M * K];
    float val[M * K];
    kn_topk(stream(1, 15), x, M, N, K, idx, val);
    for (int r = 0; r < 2; r++) {
        /* the values 12 down, each at increasing index */
        for (int j = 0; j < K; j++) {
            int32_t i = idx[r * K + j];
            assert_true(val[r * K + j] == x[r * N + i]);
            if (j > 0) {
                float a = val[r * K + j - 1], b = val[r * K + j];
                assert_true(a > b || (a == b && idx[r * K + j - 1] < i));
            }
        }
        assert_true(val[r * K] == 12.0f);
    }
    for (int j = 0; j < K; j++) assert_int_equal(idx[2 * K + j], j); /* all equal: the first K */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_topk_largest_first_lower_index_on_ties),
        cmocka_unit_test(test_topk_of_all_puts_nan_last_as_minus_infinity),
        cmocka_unit_test(test_topk_of_several_rows),
        cmocka_unit_test(cpu_backend_says_what_it_supports),
        cmocka_unit_test(buffers_round_trip_and_events_order_nothing_on_the_cpu),
        cmocka_unit_test(gather_rows_copies_the_named_rows_to_a_stride),
        cmocka_unit_test(matmul_matches_double_reference_for_every_type),
        cmocka_unit_test(matmul_portable_path_matches_double_reference),
        cmocka_unit_test(matmul_simd_and_portable_paths_agree_bitwise),
        cmocka_unit_test(quantized_matmul_follows_the_integer_contract_bitwise),
        cmocka_unit_test(quantized_matmul_propagates_nan_and_keeps_zeros),
        cmocka_unit_test(quantized_matmul_8bit_follows_the_integer_contract_bitwise),
        cmocka_unit_test(quantized_matmul_8bit_propagates_nan_and_keeps_zeros),
        cmocka_unit_test(quantized_matmul_exact_on_hand_made_blocks),
        cmocka_unit_test(quantized_matmul_8bit_stays_within_its_rounding_bound),
        cmocka_unit_test(matmul_8bit_row_is_batch_invariant),
        cmocka_unit_test(fused_matmul_equals_separate_calls),
        cmocka_unit_test(matmul_row_is_batch_invariant),
        cmocka_unit_test(matmul_column_shard_reads_only_its_blocks),
        cmocka_unit_test(rmsnorm_matches_reference),
        cmocka_unit_test(add_swiglu_and_bias_match_reference),
        cmocka_unit_test(swiglu_paths_agree_bitwise),
        cmocka_unit_test(softmax_rows_sum_to_one_and_match_reference),
        cmocka_unit_test(argmax_takes_lowest_index_of_ties_and_skips_nan),
        cmocka_unit_test(embed_dequantizes_the_rows_of_the_ids),
        cmocka_unit_test(rope_rotates_pairs_by_position_times_frequency),
        cmocka_unit_test(rope_llama3_scaling_bands),
        cmocka_unit_test(attention_matches_reference_with_gqa_and_paged_blocks),
        cmocka_unit_test(attention_split_and_walk_agree_bitwise),
        cmocka_unit_test(kv_write_stores_rows_at_their_slots_rounded_to_f16),
        cmocka_unit_test(kv_write_rounds_like_quant_on_every_boundary_and_path),
        cmocka_unit_test(attention_tree_node_equals_decode_after_commit_bitwise),
        cmocka_unit_test(attention_shared_chunks_give_each_token_its_alone_bits),
        cmocka_unit_test(allreduce_two_ranks_matches_one_rank_and_repeats_bitwise),
        cmocka_unit_test(allreduce_sums_in_rank_order_and_one_rank_is_a_noop),
    };
    return cmocka_run_group_tests_name("kernels", tests, setup, teardown);
}
