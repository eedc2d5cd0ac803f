/* Pearson chi-square tests for the sampling tests: goodness of fit of
 * counts to exact probabilities, and homogeneity of two count tables of
 * the same size. Cells are formed from the exact probabilities alone
 * (never from the data): each cell whose expected count is at least 5
 * stands alone, the others are pooled into one. The p-value is the
 * regularised upper incomplete gamma Q(df / 2, stat / 2). Header-only,
 * for tests. */
#ifndef AERIE_TESTS_CHISQ_H
#define AERIE_TESTS_CHISQ_H

#include <math.h>
#include <stdint.h>

typedef struct chisq_result {
    double stat;
    int df;
    double p;
} chisq_result;

/* Q(a, x) = Gamma(a, x) / Gamma(a): a series below x = a + 1, a continued
 * fraction (modified Lentz) above. */
static inline double chisq_gamma_q(double a, double x) {
    if (x <= 0) return 1.0;
    if (isinf(x)) return 0.0;
    double front = exp(-x + a * log(x) - lgamma(a));
    if (x < a + 1) {
        double ap = a, del = 1.0 / a, sum = del;
        for (int i = 0; i < 100000 && fabs(del) > fabs(sum) * 1e-15; i++) {
            ap += 1;
            del *= x / ap;
            sum += del;
        }
        return 1.0 - sum * front;
    }
    const double tiny = 1e-300;
    double b = x + 1 - a, c = 1 / tiny, d = 1 / b, h = d;
    for (int i = 1; i < 100000; i++) {
        double an = -i * (i - a);
        b += 2;
        d = an * d + b;
        if (fabs(d) < tiny) d = tiny;
        c = b + an / c;
        if (fabs(c) < tiny) c = tiny;
        d = 1 / d;
        double del = d * c;
        h *= del;
        if (fabs(del - 1) < 1e-15) break;
    }
    return front * h;
}

/* The cell of each of the k categories: its own, or the pooled one (last). */
static inline int chisq_cells(const double *probs, int k, int64_t n, int *cell) {
    int cells = 0;
    for (int i = 0; i < k; i++) cell[i] = probs[i] * (double)n >= 5 ? cells++ : -1;
    for (int i = 0; i < k; i++)
        if (cell[i] < 0) cell[i] = cells;
    return cells + 1; /* the pooled cell may be empty: then it adds 0 */
}

/* counts[k] of n draws against probs[k]. A count in a category of
 * probability 0 makes the statistic infinite. */
static inline chisq_result chisq_fit(const int64_t *counts, const double *probs, int k, int64_t n) {
    int cell[4096], cells = chisq_cells(probs, k, n, cell), used = 0;
    double obs[4097] = {0}, exp_[4097] = {0}, stat = 0;
    for (int i = 0; i < k; i++) {
        obs[cell[i]] += (double)counts[i];
        exp_[cell[i]] += probs[i] * (double)n;
    }
    for (int c = 0; c < cells; c++) {
        if (exp_[c] > 0) {
            stat += (obs[c] - exp_[c]) * (obs[c] - exp_[c]) / exp_[c];
            used++;
        } else if (obs[c] > 0) {
            stat = INFINITY;
        }
    }
    chisq_result r = {stat, used - 1, 0};
    r.p = chisq_gamma_q(r.df / 2.0, stat / 2.0);
    return r;
}

/* Two tables of n draws each, a[k] and b[k], on the cells probs gives. */
static inline chisq_result chisq_homogeneity(const int64_t *a, const int64_t *b, const double *probs, int k,
                                             int64_t n) {
    int cell[4096], cells = chisq_cells(probs, k, n, cell), used = 0;
    double oa[4097] = {0}, ob[4097] = {0}, stat = 0;
    for (int i = 0; i < k; i++) {
        oa[cell[i]] += (double)a[i];
        ob[cell[i]] += (double)b[i];
    }
    for (int c = 0; c < cells; c++) {
        double e = (oa[c] + ob[c]) / 2;
        if (e == 0) continue;
        stat += (oa[c] - e) * (oa[c] - e) / e + (ob[c] - e) * (ob[c] - e) / e;
        used++;
    }
    chisq_result r = {stat, used - 1, 0};
    r.p = chisq_gamma_q(r.df / 2.0, stat / 2.0);
    return r;
}

#endif
