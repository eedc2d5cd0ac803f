/* CPU backend: streams, SIMD dispatch, and the element-wise and per-row
 * ops. Per-row reductions (rmsnorm, softmax) sum in double in an order
 * fixed by the row's length alone (kernels.h), never by the batch. */
#include "kn_cpu_impl.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "../../services/core/mem.h"

/* ---- streams, buffers and SIMD dispatch ------------------------------------ */

static int cpu_stream_init(const kn_backend *be, kn_stream **out, const kn_stream_config *cfg, ae_error *err) {
    (void)be;
    if (!cfg || !cfg->pool) return err_set(err, "kernels: a CPU stream needs a thread pool");
    kn_cpu_stream *s = calloc(1, sizeof *s);
    if (!s) return err_set(err, "kernels: out of memory for a stream");
    s->pool = cfg->pool;
    if (cfg->workspace_bytes > 0) {
        size_t bytes = (cfg->workspace_bytes + 63) & ~(size_t)63;
        s->work = aligned_alloc(64, bytes);
        if (!s->work) {
            free(s);
            return err_set(err, "kernels: cannot allocate %zu bytes of stream workspace", cfg->workspace_bytes);
        }
        s->work_bytes = bytes;
    }
    *out = &s->base;
    return AE_OK;
}

static void cpu_stream_free(kn_stream *s) {
    free(KN_CPU(s)->work);
    free(KN_CPU(s));
}

static int cpu_stream_threads(const kn_stream *s) { return pool_threads(KN_CPU(s)->pool); }

/* Every op is done when it returns: there is nothing to wait for. */
static void cpu_sync(kn_stream *s) { (void)s; }
static void cpu_event_record(kn_stream *s, kn_event *e) { (void)s, (void)e; }
static void cpu_event_wait(kn_stream *s, const kn_event *e) { (void)s, (void)e; }

/* Buffers are host memory, 64-byte aligned, on huge pages when large
 * (mem.h). Zeroed here, which also commits the pages the memory plan
 * counted. */
static int cpu_buf_alloc(kn_buf *b, size_t bytes, ae_error *err) {
    b->ptr = mem_alloc_large(bytes ? bytes : 1);
    if (!b->ptr) return err_set(err, "kernels: out of memory for a %zu-byte buffer", bytes);
    memset(b->ptr, 0, bytes);
    return AE_OK;
}

static void cpu_buf_write(kn_buf *b, size_t off, const void *src, size_t n) { memcpy((char *)b->ptr + off, src, n); }

static void cpu_buf_free(kn_buf *b) { free(b->ptr); }

static void cpu_upload(kn_stream *s, const kn_buf *dst, size_t off, const void *src, size_t n) {
    (void)s;
    memcpy((char *)dst->ptr + off, src, n);
}

static void cpu_download(kn_stream *s, void *dst, const kn_buf *src, size_t off, size_t n) {
    (void)s;
    memcpy(dst, (const char *)src->ptr + off, n);
}

static atomic_int g_simd_limit = 2; /* 0 portable, 1 AVX2, 2 AVX-512 */

void kn_cpu_limit_simd(int level) { atomic_store(&g_simd_limit, level < 0 ? 0 : level > 2 ? 2 : level); }

void kn_cpu_force_scalar(bool on) { kn_cpu_limit_simd(on ? 0 : 2); }

/* What the CPU offers never changes, and CPUID is slow (in a VM it traps
 * to the hypervisor), so it is asked once. */
static bool cpu_has_avx2(void) {
#if defined(__x86_64__) || defined(__i386__)
    /* F16C is CPUID leaf 1, ECX bit 29; asked directly because older
     * compilers (clang 14) do not know "f16c" in __builtin_cpu_supports. */
    unsigned a, b, c, d;
    bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
    return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return false;
#endif
}

static bool cpu_has_avx512vnni(void) {
#if defined(__x86_64__)
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
    return false;
#endif
}

/* probe() the first time, its cached answer after; false while the
 * limit is below `level`. */
static bool use_simd(atomic_int *has, bool (*probe)(void), int level) {
    if (atomic_load(&g_simd_limit) < level) return false;
    int h = atomic_load_explicit(has, memory_order_relaxed);
    if (h < 0) {
        h = probe();
        atomic_store_explicit(has, h, memory_order_relaxed);
    }
    return h != 0;
}

static atomic_int g_has_avx2 = -1, g_has_vnni = -1; /* -1: not asked yet */

bool kn_cpu_use_avx2(void) { return use_simd(&g_has_avx2, cpu_has_avx2, 1); }

bool kn_cpu_use_avx512vnni(void) { return use_simd(&g_has_vnni, cpu_has_avx512vnni, 2); }

const char *kn_cpu_simd(void) {
    return kn_cpu_use_avx512vnni() ? "avx512vnni+avx2" : kn_cpu_use_avx2() ? "avx2" : "scalar";
}

int kn_cpu_simd_level(void) { return kn_cpu_use_avx512vnni() ? 2 : kn_cpu_use_avx2() ? 1 : 0; }

/* ---- per-row ops -------------------------------------------------------- */

/* Element-wise work below this many elements runs on the caller: waking the
 * pool costs more than the work at decode sizes. */
#define KN_PAR_MIN 65536

typedef struct rows_job {
    int64_t m;
    void (*row)(const struct rows_job *job, int64_t r);
    const float *a, *b;
    float *y;
    int64_t n;
    float eps;
} rows_job;

static void rows_task(void *ctx, int task, int n_tasks) {
    const rows_job *job = ctx;
    int64_t lo = job->m * task / n_tasks, hi = job->m * (task + 1) / n_tasks;
    for (int64_t r = lo; r < hi; r++) job->row(job, r);
}

/* Runs job->row for every row, on the pool when the work is large. */
static void run_rows(kn_stream *s, rows_job *job) {
    int threads = pool_threads(KN_CPU(s)->pool);
    if (threads == 1 || job->m < 2 || job->m * job->n < KN_PAR_MIN) {
        for (int64_t r = 0; r < job->m; r++) job->row(job, r);
        return;
    }
    int n_tasks = job->m < threads ? (int)job->m : threads;
    pool_run(KN_CPU(s)->pool, rows_task, job, n_tasks);
}

static void rmsnorm_row(const rows_job *job, int64_t r) {
    const float *x = job->a + r * job->n;
    float *y = job->y + r * job->n;
    /* 8 lanes of double sums (lane l takes elements 8j + l in order), then
     * ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), then the tail in order: the
     * lanes vectorize, where one chain of dependent adds took ~0.6 us per
     * row of 576. */
    double lane[8] = {0};
    int64_t n8 = job->n / 8 * 8;
    for (int64_t i = 0; i < n8; i += 8)
        for (int l = 0; l < 8; l++) {
            double v = (double)x[i + l];
            double sq = v * v;
            lane[l] = lane[l] + sq;
        }
    double ss = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
    for (int64_t i = n8; i < job->n; i++) {
        double v = (double)x[i];
        double sq = v * v;
        ss = ss + sq;
    }
    float inv = (float)(1.0 / sqrt(ss / (double)job->n + (double)job->eps));
    for (int64_t i = 0; i < job->n; i++) {
        float t = x[i] * inv;
        y[i] = t * job->b[i];
    }
}

void kn_cpu_rmsnorm(kn_stream *s, const float *x, const float *g, float *y, int64_t m, int64_t n, float eps) {
    rows_job job = {.m = m, .row = rmsnorm_row, .a = x, .b = g, .y = y, .n = n, .eps = eps};
    run_rows(s, &job);
}

static void add_row(const rows_job *job, int64_t r) {
    int64_t lo = r * job->n, hi = lo + job->n;
    for (int64_t i = lo; i < hi; i++) job->y[i] = job->a[i] + job->b[i];
}

/* Element-wise ops split a flat range into rows of KN_PAR_MIN / 4 so the
 * same row machinery spreads them over threads. */
#define KN_FLAT_ROW 16384

static void flat_job(kn_stream *s, rows_job *job, int64_t count) {
    AE_ASSERT(count >= 0);
    int64_t rows = count / KN_FLAT_ROW, tail = count - rows * KN_FLAT_ROW;
    job->n = KN_FLAT_ROW;
    job->m = rows;
    run_rows(s, job);
    if (tail > 0) {
        /* The tail as one short row; its offset is rows * KN_FLAT_ROW. */
        rows_job t = *job;
        t.a = job->a ? job->a + rows * KN_FLAT_ROW : NULL;
        t.b = job->b ? job->b + rows * KN_FLAT_ROW : NULL;
        t.y = job->y + rows * KN_FLAT_ROW;
        t.n = tail;
        t.m = 1;
        t.row(&t, 0);
    }
}

void kn_cpu_add(kn_stream *s, const float *a, const float *b, float *y, int64_t count) {
    rows_job job = {.row = add_row, .a = a, .b = b, .y = y};
    flat_job(s, &job, count);
}

static void swiglu_row(const rows_job *job, int64_t r) {
    int64_t lo = r * job->n, hi = lo + job->n;
    kn_swiglu_span(job->a + lo, job->b + lo, job->y + lo, hi - lo);
}

void kn_swiglu_span(const float *g, const float *u, float *y, int64_t n) {
    int64_t i = 0;
    if (kn_cpu_use_avx512vnni()) {
        i = n / 16 * 16;
        kn_swiglu_avx512(g, u, y, i);
    }
    for (; i < n; i++) y[i] = kn_swiglu1(g[i], u[i]);
}

void kn_cpu_swiglu(kn_stream *s, const float *gate, const float *up, float *y, int64_t count) {
    rows_job job = {.row = swiglu_row, .a = gate, .b = up, .y = y};
    flat_job(s, &job, count);
}

void kn_cpu_bias_add(kn_stream *s, float *x, const float *bias, int64_t m, int64_t n) {
    (void)s;
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < n; i++) x[r * n + i] += bias[i];
}

static void softmax_row(const rows_job *job, int64_t r) {
    float *x = job->y + r * job->n;
    float mx = -INFINITY;
    for (int64_t i = 0; i < job->n; i++)
        if (x[i] > mx) mx = x[i];
    double sum = 0.0;
    for (int64_t i = 0; i < job->n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    float inv = (float)(1.0 / sum);
    for (int64_t i = 0; i < job->n; i++) x[i] *= inv;
}

void kn_cpu_softmax(kn_stream *s, float *x, int64_t m, int64_t n) {
    rows_job job = {.m = m, .row = softmax_row, .y = x, .n = n};
    run_rows(s, &job);
}

void kn_cpu_argmax(kn_stream *s, const float *x, int32_t *out, int64_t m, int64_t n) {
    (void)s;
    for (int64_t r = 0; r < m; r++) {
        const float *row = x + r * n;
        int64_t best = -1;
        for (int64_t i = 0; i < n; i++)
            if (row[i] == row[i] && (best < 0 || row[i] > row[best])) best = i;
        out[r] = best < 0 ? 0 : (int32_t)best;
    }
}

/* Insertion into the sorted first k: one pass over the row. */
void kn_cpu_topk(kn_stream *s, const float *x, int64_t m, int64_t n, int32_t k, int32_t *idx, float *val) {
    (void)s;
    for (int64_t r = 0; r < m; r++) {
        const float *row = x + r * n;
        int32_t *id = idx + r * k;
        float *v = val + r * k;
        int32_t have = 0;
        for (int64_t i = 0; i < n; i++) {
            float a = isnan(row[i]) ? -INFINITY : row[i];
            if (have == k && !(a > v[k - 1])) continue; /* an equal value keeps the lower index */
            int32_t j = have < k ? have++ : k - 1;
            for (; j > 0 && a > v[j - 1]; j--) {
                id[j] = id[j - 1];
                v[j] = v[j - 1];
            }
            id[j] = (int32_t)i;
            v[j] = a;
        }
    }
}

void kn_cpu_embed(kn_stream *s, const kn_weight *table, const int32_t *ids, float *out, int64_t m) {
    (void)s;
    for (int64_t t = 0; t < m; t++) {
        AE_ASSERT(ids[t] >= 0 && ids[t] < table->rows);
        const uint8_t *row = (const uint8_t *)table->data + (size_t)ids[t] * table->row_bytes;
        bool ok = quant_dequantize(table->type, row, out + t * table->cols, (uint64_t)table->cols);
        AE_ASSERT(ok);
    }
}

/* ---- RoPE --------------------------------------------------------------- */

int kn_rope_init(kn_rope *r, const kn_rope_config *cfg, ae_error *err) {
    memset(r, 0, sizeof *r);
    int d = cfg->head_dim;
    if (d <= 0 || d % 2 != 0 || d > KN_MAX_HEAD_DIM)
        return err_set(err, "rope: head_dim must be even and in 2..%d, got %d", KN_MAX_HEAD_DIM, d);
    if (!(cfg->theta > 0.0)) return err_set(err, "rope: rope_theta must be > 0, got %g", cfg->theta);
    if (cfg->layout != KN_ROPE_ADJACENT && cfg->layout != KN_ROPE_NEOX)
        return err_set(err, "rope: unknown layout %d", (int)cfg->layout);
    bool scaled = cfg->factor > 0.0 && cfg->factor != 1.0 && !cfg->yarn;
    if (cfg->yarn &&
        !(cfg->factor >= 1.0 && cfg->original_max_pos > 0.0 && cfg->beta_fast > 0.0 && cfg->beta_slow > 0.0))
        return err_set(err,
                       "rope: yarn needs factor >= 1, original_max_position_embeddings > 0 and betas > 0 "
                       "(got %g, %g, %g, %g)",
                       cfg->factor, cfg->original_max_pos, cfg->beta_fast, cfg->beta_slow);
    /* YaRN's band: the dims whose pair turns between beta_fast and
     * beta_slow times over the original context, whole dims outward. */
    double lo = 0.0, hi = 0.0;
    if (cfg->yarn) {
        double k = (double)d / (2.0 * log(cfg->theta));
        lo = floor(k * log(cfg->original_max_pos / (cfg->beta_fast * 2.0 * M_PI)));
        hi = ceil(k * log(cfg->original_max_pos / (cfg->beta_slow * 2.0 * M_PI)));
        lo = lo < 0.0 ? 0.0 : lo;
        hi = hi > d - 1 ? d - 1 : hi;
        if (lo == hi) hi += 0.001;
    }
    if (scaled &&
        !(cfg->original_max_pos > 0.0 && cfg->high_freq_factor > cfg->low_freq_factor && cfg->low_freq_factor > 0.0))
        return err_set(err,
                       "rope: llama3 scaling needs original_max_position_embeddings > 0 and "
                       "high_freq_factor > low_freq_factor > 0 (got %g, %g, %g)",
                       cfg->original_max_pos, cfg->high_freq_factor, cfg->low_freq_factor);
    r->layout = cfg->layout;
    r->head_dim = d;
    for (int i = 0; i < d / 2; i++) {
        double f = 1.0 / pow(cfg->theta, (double)(2 * i) / (double)d);
        if (scaled) {
            /* Llama 3: long wavelengths are slowed by `factor`, short ones
             * kept, and the band between blended linearly in 1/wavelength. */
            double wavelen = 2.0 * M_PI / f;
            double low_wavelen = cfg->original_max_pos / cfg->low_freq_factor;
            double high_wavelen = cfg->original_max_pos / cfg->high_freq_factor;
            if (wavelen > low_wavelen) {
                f = f / cfg->factor;
            } else if (wavelen >= high_wavelen) {
                double smooth = (cfg->original_max_pos / wavelen - cfg->low_freq_factor) /
                                (cfg->high_freq_factor - cfg->low_freq_factor);
                f = (1.0 - smooth) * f / cfg->factor + smooth * f;
            }
        } else if (cfg->yarn) {
            /* extrapolate (keep f) below the band, interpolate (f / factor) above */
            double ramp = ((double)i - lo) / (hi - lo);
            double keep = 1.0 - (ramp < 0.0 ? 0.0 : ramp > 1.0 ? 1.0 : ramp);
            f = f / cfg->factor * (1.0 - keep) + f * keep;
        }
        r->inv_freq[i] = f;
    }
    return AE_OK;
}

static void cpu_rope_table(kn_stream *s, const kn_rope *r, const int32_t *pos, int64_t m, float *cs) {
    (void)s;
    int half = r->head_dim / 2;
    for (int64_t t = 0; t < m; t++) {
        AE_ASSERT(pos[t] >= 0);
        float *row = cs + t * r->head_dim;
        for (int i = 0; i < half; i++) {
            double a = (double)pos[t] * r->inv_freq[i];
            row[2 * i] = (float)cos(a);
            row[2 * i + 1] = (float)sin(a);
        }
    }
}

void kn_cpu_rope_rotate(kn_stream *s, const kn_rope *r, float *x, int64_t m, int32_t n_heads, const float *cs) {
    (void)s;
    int half = r->head_dim / 2;
    /* Pair i of the adjacent layout is (2i, 2i+1); of NeoX (i, i+half). */
    int stride = r->layout == KN_ROPE_ADJACENT ? 2 : 1;
    int other = r->layout == KN_ROPE_ADJACENT ? 1 : half;
    for (int64_t t = 0; t < m; t++) {
        const float *row = cs + t * r->head_dim;
        for (int32_t h = 0; h < n_heads; h++) {
            float *v = x + (t * n_heads + h) * r->head_dim;
            for (int i = 0; i < half; i++) {
                float c = row[2 * i], sn = row[2 * i + 1];
                float *p0 = v + i * stride, *p1 = p0 + other;
                float x0 = *p0, x1 = *p1;
                float a0 = x0 * c, b0 = x1 * sn;
                float a1 = x0 * sn, b1 = x1 * c;
                *p0 = a0 - b0;
                *p1 = a1 + b1;
            }
        }
    }
}

static void cpu_gather_rows(kn_stream *s, const float *src, const int32_t *rows, int64_t n, int64_t width, float *dst,
                            int64_t dst_stride) {
    (void)s;
    for (int64_t r = 0; r < n; r++)
        memcpy(dst + r * dst_stride, src + (rows ? (int64_t)rows[r] : r) * width, (size_t)width * sizeof(float));
}

static bool cpu_supports(kn_op op, ggml_type type) {
    switch (op) {
    case KN_OP_MATMUL: return kn_matmul_supports(type);
    case KN_OP_EMBED: return quant_can_dequantize(type);
    case KN_OP_KV: return type == GGML_TYPE_F16;
    case KN_OP_F32: return type == GGML_TYPE_F32;
    case KN_OP_LATENT: return type == GGML_TYPE_F16 || type == GGML_TYPE_F32; /* the pool's, the heads' weights */
    case KN_OP_MOE: return kn_matmul_supports(type);
    }
    return false;
}

const kn_backend kn_backend_cpu = {
    .name = "cpu",
    .host_memory = true,
    .supports = cpu_supports,
    .stream_init = cpu_stream_init,
    .stream_free = cpu_stream_free,
    .stream_threads = cpu_stream_threads,
    .sync = cpu_sync,
    .event_record = cpu_event_record,
    .event_wait = cpu_event_wait,
    .comm_init = kn_cpu_comm_init,
    .buf_alloc = cpu_buf_alloc,
    .buf_free = cpu_buf_free,
    .buf_write = cpu_buf_write,
    .upload = cpu_upload,
    .download = cpu_download,
    .matmul_n = kn_cpu_matmul_n,
    .matmul_swiglu = kn_cpu_matmul_swiglu,
    .rmsnorm = kn_cpu_rmsnorm,
    .add = kn_cpu_add,
    .bias_add = kn_cpu_bias_add,
    .swiglu = kn_cpu_swiglu,
    .softmax = kn_cpu_softmax,
    .argmax = kn_cpu_argmax,
    .topk = kn_cpu_topk,
    .embed = kn_cpu_embed,
    .gather_rows = cpu_gather_rows,
    .rope_table = cpu_rope_table,
    .rope_rotate = kn_cpu_rope_rotate,
    .kv_write = kn_cpu_kv_write,
    .kv_move = kn_cpu_kv_move,
    .attention = kn_cpu_attention,
    .matmul_heads = kn_cpu_matmul_heads,
    .moe_route = kn_cpu_moe_route,
    .moe_ffn = kn_cpu_moe_ffn,
};
