#include "sample.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct cand {
    float w;    /* exp(s - s_max): unnormalised probability */
    float s;    /* logit / temperature */
    int32_t id;
} cand;

struct sampler {
    int32_t vocab;
    cand *c;      /* (vocab) candidates still kept */
    float *tmp;   /* (vocab) top-k selection scratch, then the kept weights */
    double total; /* sum of the kept weights of the last sample_dist */
    int32_t *ids; /* (vocab) output of sample_dist */
    float *probs; /* (vocab) output of sample_dist */
};

/* ---- random numbers: splitmix64 to seed, xoshiro256** to draw ---- */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void sample_rng_seed(sample_rng *rng, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) rng->s[i] = splitmix64(&x);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t sample_rng_next(sample_rng *rng) {
    uint64_t *s = rng->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double sample_rng_uniform(sample_rng *rng) {
    return (double)(sample_rng_next(rng) >> 11) * 0x1.0p-53;
}

/* ---- sampler ---- */

bool sample_is_greedy(const sample_params *p) { return !(p->temperature > 0.0f); }

int32_t sample_greedy(const float *logits, int32_t vocab) {
    int32_t best = 0;
    float bv = -INFINITY;
    for (int32_t i = 0; i < vocab; i++) {
        if (logits[i] > bv) {
            bv = logits[i];
            best = i;
        }
    }
    return best;
}

int sample_init(sampler **out, int32_t vocab, ae_error *err) {
    *out = NULL;
    if (vocab <= 0) return err_set(err, "sampler: vocabulary size %d must be positive", vocab);
    sampler *s = calloc(1, sizeof *s);
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

void sample_free(sampler *s) {
    if (!s) return;
    free(s->c);
    free(s->tmp);
    free(s->ids);
    free(s->probs);
    free(s);
}

int32_t sample_vocab(const sampler *s) { return s->vocab; }

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
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return a[want];
    }
    return a[lo];
}

/* Descending s, then ascending id: a total order, so the sorted result is
 * unique and does not depend on the algorithm. */
static bool cand_before(const cand *a, const cand *b) {
    return a->s > b->s || (a->s == b->s && a->id < b->id);
}

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

int32_t sample_dist(sampler *s, const float *logits, const sample_params *p,
                    const int32_t **ids, const float **probs) {
    *ids = s->ids;
    *probs = s->probs;
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
    for (int32_t i = 0; i < k; i++) s->probs[i] = (float)(s->tmp[i] / total);
    s->total = total;
    return k;

one_hot:
    s->ids[0] = sample_greedy(logits, s->vocab);
    s->probs[0] = 1.0f;
    s->tmp[0] = 1.0f;
    s->total = 1.0;
    return 1;
}

void sample_dist_dense(sampler *s, const float *logits, const sample_params *p, float *probs) {
    const int32_t *ids;
    const float *q;
    int32_t n = sample_dist(s, logits, p, &ids, &q);
    memset(probs, 0, (size_t)s->vocab * sizeof *probs);
    for (int32_t i = 0; i < n; i++) probs[ids[i]] = q[i];
}

int32_t sample_token(sampler *s, const float *logits, const sample_params *p, sample_rng *rng) {
    if (sample_is_greedy(p)) return sample_greedy(logits, s->vocab);
    const int32_t *ids;
    const float *q;
    int32_t n = sample_dist(s, logits, p, &ids, &q);
    /* Walk the unnormalised weights (tmp) against their exact double total
     * rather than the rounded probabilities. One number per draw. */
    double u = sample_rng_uniform(rng) * s->total, acc = 0;
    for (int32_t i = 0; i < n; i++) {
        acc += s->tmp[i];
        if (u < acc) return ids[i];
    }
    return ids[n - 1]; /* u rounded up to the total */
}

int32_t sample_from_weights(const float *weights, int32_t n, sample_rng *rng) {
    double total = 0;
    int32_t last = 0;
    for (int32_t i = 0; i < n; i++) {
        if (weights[i] > 0.0f) {
            total += weights[i];
            last = i;
        }
    }
    double u = sample_rng_uniform(rng) * total, acc = 0;
    for (int32_t i = 0; i < n; i++) {
        if (weights[i] > 0.0f) {
            acc += weights[i];
            if (u < acc) return i;
        }
    }
    return last;
}
