#include "sample.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../kernels/draw.h"
#include "../kernels/kernels.h"

typedef struct cand {
    float w; /* exp(s - s_max): unnormalised probability */
    float s; /* logit / temperature */
    int32_t id;
} cand;

struct sample_state {
    int32_t vocab;
    cand *c;      /* (vocab) candidates still kept */
    float *tmp;   /* (vocab) top-k selection scratch, then the kept weights */
    double total; /* sum of the kept weights of the last sample_dist */
    int32_t *ids; /* (vocab) output of sample_dist */
    float *probs; /* (vocab) output of sample_dist */
};

/* ---- the keyed random numbers (kernels/draw.h) ---- */

static uint64_t pos_key(const sample_rng *rng, int32_t pos) { return kn_draw_key(rng->seed, rng->choice, pos); }

void sample_rng_seed(sample_rng *rng, uint64_t seed) { *rng = (sample_rng){.seed = seed, .choice = 0}; }

double sample_rng_uniform(const sample_rng *rng, int32_t pos, int32_t id) {
    uint64_t k = pos_key(rng, pos);
    uint32_t bits = kn_draw_bits((uint32_t)k, (uint32_t)(k >> 32), (uint32_t)id);
    return 1.0 - ((double)(bits >> 1) + 0.5) * 0x1p-31;
}

float sample_rng_exp(const sample_rng *rng, int32_t pos, int32_t id) {
    uint64_t k = pos_key(rng, pos);
    return kn_draw_exp(kn_draw_bits((uint32_t)k, (uint32_t)(k >> 32), (uint32_t)id));
}

/* The race: the index of the least E_i / w_i over ids[n] with weights
 * w[n] (>= 0, at least one > 0), as f32 bit patterns (the ratios are
 * positive or +inf, so they order as integers); the first of equal ones.
 * Blocks of RACE_BLOCK are computed apart from the comparison so that
 * the compiler can vectorise them; the result does not depend on the
 * block size or the SIMD path. */
#define RACE_BLOCK 16

static inline uint32_t race_key(uint32_t klo, uint32_t khi, int32_t id, float w) {
    return kn_draw_f32_bits(kn_draw_exp(kn_draw_bits(klo, khi, (uint32_t)id)) / w);
}

#define RACE_FN(sfx, attr) \
    attr static int32_t race_##sfx(const int32_t *ids, const float *w, int32_t n, uint32_t klo, uint32_t khi) { \
        uint32_t best = UINT32_MAX; \
        int32_t at = 0, i = 0; \
        for (; i + RACE_BLOCK <= n; i += RACE_BLOCK) { \
            uint32_t r[RACE_BLOCK], least = UINT32_MAX; \
            for (int j = 0; j < RACE_BLOCK; j++) r[j] = race_key(klo, khi, ids[i + j], w[i + j]); \
            for (int j = 0; j < RACE_BLOCK; j++) least = r[j] < least ? r[j] : least; \
            if (least < best) { \
                best = least; \
                for (int j = 0; j < RACE_BLOCK; j++) \
                    if (r[j] == least) { \
                        at = i + j; \
                        break; \
                    } \
            } \
        } \
        for (; i < n; i++) { \
            uint32_t r = race_key(klo, khi, ids[i], w[i]); \
            if (r < best) best = r, at = i; \
        } \
        return at; \
    }

RACE_FN(scalar, )
#if defined(__x86_64__)
RACE_FN(avx2, __attribute__((target("avx2"))))
RACE_FN(avx512, __attribute__((target("avx512f"))))
#endif

static int32_t race(const int32_t *ids, const float *w, int32_t n, const sample_rng *rng, int32_t pos) {
    uint64_t k = pos_key(rng, pos);
    uint32_t klo = (uint32_t)k, khi = (uint32_t)(k >> 32);
#if defined(__x86_64__)
    int level = kn_cpu_simd_level();
    if (level == 2) return race_avx512(ids, w, n, klo, khi);
    if (level == 1) return race_avx2(ids, w, n, klo, khi);
#endif
    return race_scalar(ids, w, n, klo, khi);
}

/* ---- sampler ---- */

bool sample_is_greedy(const sample_params *p) { return !(p->temperature > 0.0f); }

bool sample_on_device(const sample_params *p) {
    return sample_is_greedy(p) || (!(p->top_p < 1.0f) && p->top_k <= KN_TOPK_MAX);
}

kn_draw sample_draw(const sample_params *p, const sample_rng *rng, int32_t pos) {
    AE_ASSERT(sample_on_device(p));                           /* kn_draw has no top-p, and top-k within KN_TOPK_MAX */
    uint64_t k = sample_is_greedy(p) ? 0 : pos_key(rng, pos); /* greedy reads no rng */
    return (kn_draw){sample_is_greedy(p) ? 0.0f : p->temperature, p->top_k > 0 ? p->top_k : 0, p->min_p, (uint32_t)k,
                     (uint32_t)(k >> 32)};
}

int32_t sample_greedy(const float *logits, int32_t vocab) {
    int32_t best = -1;
    for (int32_t i = 0; i < vocab; i++)
        if (logits[i] == logits[i] && (best < 0 || logits[i] > logits[best])) best = i;
    return best < 0 ? 0 : best;
}

float sample_logprobs(const float *logits, int32_t vocab, int32_t token, int32_t k, sample_logprob *top) {
    AE_ASSERT(vocab > 0 && token >= 0 && token < vocab && k >= 0 && k <= vocab && k <= SAMPLE_MAX_TOP_LOGPROBS);
    float m = -INFINITY;
    int32_t n = 0; /* entries of top so far, best first */
    for (int32_t i = 0; i < vocab; i++) {
        float x = logits[i];
        if (!(x > -INFINITY)) continue; /* -inf and NaN */
        if (x > m) m = x;
        if (k == 0 || (n == k && !(x > logits[top[n - 1].id]))) continue;
        int32_t at = n < k ? n++ : k - 1; /* a full list drops its last */
        while (at > 0 && x > logits[top[at - 1].id]) {
            top[at] = top[at - 1];
            at--;
        }
        top[at].id = i;
    }
    AE_ASSERT(m > -INFINITY && "logprobs of a row with no finite logit");
    double sum = 0.0;
    for (int32_t i = 0; i < vocab; i++)
        if (logits[i] > -INFINITY) sum += exp((double)logits[i] - (double)m);
    const double lse = (double)m + log(sum);
    for (int32_t j = 0; j < n; j++) top[j].logprob = (float)((double)logits[top[j].id] - lse);
    const float x = logits[token];
    return x > -INFINITY ? (float)((double)x - lse) : -INFINITY;
}

int sample_init(sample_state **out, int32_t vocab, ae_error *err) {
    *out = NULL;
    if (vocab <= 0) return err_set(err, "sampler: vocabulary size %d must be positive", vocab);
    sample_state *s = calloc(1, sizeof *s);
    if (!s) return err_set(err, "sampler: out of memory");
    s->vocab = vocab;
    s->c = malloc((size_t)vocab * sizeof *s->c);
    s->tmp = malloc((size_t)vocab * sizeof *s->tmp);
    s->ids = malloc((size_t)vocab * sizeof *s->ids);
    s->probs = malloc((size_t)vocab * sizeof *s->probs);
    if (!s->c || !s->tmp || !s->ids || !s->probs) {
        err_set(err, "sampler: out of memory for a vocabulary of %d", vocab);
        goto fail;
    }
    *out = s;
    return AE_OK;
fail:
    sample_free(s);
    return AE_ERR;
}

void sample_free(sample_state *s) {
    if (!s) return;
    free(s->c);
    free(s->tmp);
    free(s->ids);
    free(s->probs);
    free(s);
}

int32_t sample_vocab(const sample_state *s) { return s->vocab; }

/* The k-th largest (k >= 1) of a[0..n-1]; reorders a. Quickselect with a
 * median-of-three pivot; a holds no NaN. */
static float kth_largest(float *a, int32_t n, int32_t k) {
    int32_t lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        float x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi];
        float pivot = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        int32_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                float t = a[i];
                a[i++] = a[j];
                a[j--] = t;
            }
        }
        /* a[lo..j] >= pivot, a[j+1..i-1] == pivot, a[i..hi] <= pivot */
        if (want <= j)
            hi = j;
        else if (want >= i)
            lo = i;
        else
            return a[want];
    }
    return a[lo];
}

/* Descending s, then ascending id: a total order, so the sorted result is
 * unique and does not depend on the algorithm. */
static bool cand_before(const cand *a, const cand *b) { return a->s > b->s || (a->s == b->s && a->id < b->id); }

static void sift_down(cand *c, int32_t root, int32_t n) {
    for (;;) {
        int32_t child = 2 * root + 1;
        if (child >= n) return;
        /* the heap keeps the element that sorts last on top */
        if (child + 1 < n && cand_before(&c[child], &c[child + 1])) child++;
        if (!cand_before(&c[root], &c[child])) return;
        cand t = c[root];
        c[root] = c[child];
        c[child] = t;
        root = child;
    }
}

/* Heapsort: in place and O(n log n) worst case. Not qsort, which may
 * malloc a merge buffer, and the token loop allocates nothing. */
static void cand_sort(cand *c, int32_t n) {
    for (int32_t i = n / 2 - 1; i >= 0; i--) sift_down(c, i, n);
    for (int32_t end = n - 1; end > 0; end--) {
        cand t = c[0];
        c[0] = c[end];
        c[end] = t;
        sift_down(c, 0, end);
    }
}

static void cand_swap(cand *c, int32_t i, int32_t j) {
    cand t = c[i];
    c[i] = c[j];
    c[j] = t;
}

/* Top-p over c[0..n-1] (weights w, target mass `target`): keeps the
 * smallest prefix, in cand_before order, whose mass reaches target, i.e.
 * each token whose mass strictly before it is < target; at least one.
 * Returns the last kept token. Quickselect on the order, adding up the mass
 * ahead of the window as it narrows, so only the last few are sorted;
 * reorders c. */
static cand top_p_cut(cand *c, int32_t n, double target) {
    int32_t lo = 0, hi = n;
    double before = 0; /* mass of c[0..lo), all of which is kept */
    while (hi - lo > 16) {
        int32_t a = lo, b = lo + (hi - lo) / 2, z = hi - 1;
        if (cand_before(&c[b], &c[a])) cand_swap(c, a, b);
        if (cand_before(&c[z], &c[b])) cand_swap(c, b, z);
        if (cand_before(&c[b], &c[a])) cand_swap(c, a, b);
        cand_swap(c, b, hi - 1); /* median of three as pivot, parked at the end */
        const cand pivot = c[hi - 1];
        int32_t m = lo;
        double left = 0;
        for (int32_t i = lo; i < hi - 1; i++) {
            if (cand_before(&c[i], &pivot)) {
                left += c[i].w;
                cand_swap(c, i, m++);
            }
        }
        cand_swap(c, m, hi - 1);
        if (before + left >= target) {
            hi = m; /* the pivot is not kept; the cut lies in [lo, m] */
        } else {
            before += left + c[m].w; /* the pivot is kept */
            lo = m + 1;
        }
    }
    cand_sort(c + lo, hi - lo);
    int32_t j = lo;
    while (j < hi && before < target) before += c[j++].w;
    /* c[j-1] is the last kept: everything left of lo sorts before c[lo]. */
    return c[j > 0 ? j - 1 : 0];
}

/* The kept set of sample_dist: ids in s->ids, unnormalised weights (the
 * top token's is 1) in s->tmp, their sum in s->total. Returns n >= 1. */
static int32_t kept_set(sample_state *s, const float *logits, const sample_params *p) {
    const float t = p->temperature;
    if (sample_is_greedy(p)) goto one_hot;

    /* 1. temperature; non-finite logits (masked tokens) have probability 0.
     * Scores are (logit - max) / t, never logit / t: with a tiny t the
     * latter overflows to +inf for the best tokens, which would then look
     * masked. The softmax is the same. */
    float lmax = -INFINITY;
    for (int32_t i = 0; i < s->vocab; i++)
        if (isfinite(logits[i]) && logits[i] > lmax) lmax = logits[i];
    if (lmax == -INFINITY) goto one_hot;
    cand *c = s->c;
    const bool use_p = p->top_p < 1.0f, keep_c = use_p || p->top_k > 0;
    int32_t n = 0;
    float smax = -INFINITY;
    for (int32_t i = 0; i < s->vocab; i++) {
        if (!isfinite(logits[i])) continue;
        float x = (logits[i] - lmax) / t;
        if (!isfinite(x)) continue; /* underflowed to -inf: probability 0 */
        if (keep_c) c[n] = (cand){.s = x, .id = i};
        n++;
        if (x > smax) smax = x;
    }
    if (n == 0) goto one_hot;

    /* 2. top-k: everything >= the k-th largest score */
    float kth = -INFINITY;
    if (p->top_k > 0 && p->top_k < n) {
        for (int32_t i = 0; i < n; i++) s->tmp[i] = c[i].s;
        kth = kth_largest(s->tmp, n, p->top_k);
    }

    /* 3. top-p over what top-k kept: find the last token kept */
    cand cut = {.s = INFINITY, .id = -1};
    if (use_p) {
        int32_t m = 0;
        double z = 0;
        for (int32_t i = 0; i < n; i++) {
            if (c[i].s < kth) continue;
            c[m] = c[i];
            c[m].w = expf(c[i].s - smax);
            z += c[m++].w;
        }
        double top_p = p->top_p > 0.0f ? (double)p->top_p : 0.0;
        cut = top_p_cut(c, m, top_p * z);
    }

    /* 4. min-p, and the kept set written out in id order: the same tokens
     * and weights whatever order the selection above left c[] in. */
    /* min_p above 1 would drop even the top token (w = 1). */
    const float min_p = p->min_p > 1.0f ? 1.0f : p->min_p > 0.0f ? p->min_p : 0.0f;
    double total = 0;
    int32_t k = 0;
    for (int32_t i = 0; i < s->vocab; i++) {
        if (!isfinite(logits[i])) continue;
        float x = (logits[i] - lmax) / t;
        if (!isfinite(x) || x < kth) continue;
        if (use_p && !(x > cut.s || (x == cut.s && i <= cut.id))) continue;
        float w = expf(x - smax);
        if (w < min_p) continue; /* the top token has w = 1 and always stays */
        s->ids[k] = i;
        s->tmp[k] = w;
        total += w;
        k++;
    }
    s->total = total;
    return k;

one_hot:
    s->ids[0] = sample_greedy(logits, s->vocab);
    s->tmp[0] = 1.0f;
    s->total = 1.0;
    return 1;
}

int32_t sample_dist(sample_state *s, const float *logits, const sample_params *p, const int32_t **ids,
                    const float **probs) {
    *ids = s->ids;
    *probs = s->probs;
    int32_t k = kept_set(s, logits, p);
    for (int32_t i = 0; i < k; i++) s->probs[i] = (float)(s->tmp[i] / s->total);
    return k;
}

void sample_dist_dense(sample_state *s, const float *logits, const sample_params *p, float *probs) {
    const int32_t *ids;
    const float *q;
    int32_t n = sample_dist(s, logits, p, &ids, &q);
    memset(probs, 0, (size_t)s->vocab * sizeof *probs);
    for (int32_t i = 0; i < n; i++) probs[ids[i]] = q[i];
}

int32_t sample_token(sample_state *s, const float *logits, const sample_params *p, const sample_rng *rng, int32_t pos) {
    if (sample_is_greedy(p)) return sample_greedy(logits, s->vocab);
    int32_t n = kept_set(s, logits, p);
    if (n == 1) return s->ids[0];
    return s->ids[race(s->ids, s->tmp, n, rng, pos)];
}
