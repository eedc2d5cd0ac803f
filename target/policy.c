#include "policy.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The settling schedule: each stage runs a shape for a few steps. Plain
 * first (V(1), and the bound for everything else), then the bounding tree
 * (acceptance at every rank, V at the largest size, D at full width), the
 * deepest chain (acceptance deep down, D at width 1), a one-token chain
 * (V(2), D's intercept). */
#define SETTLE_PLAIN_STEPS 6
#define SETTLE_TREE_STEPS 12
#define SETTLE_DEEP_STEPS 8
#define SETTLE_CHAIN_STEPS 6
/* A stage that learns acceptance runs its trees in fewer steps at a
 * larger batch (enter_stage), but never fewer than these: the first step
 * after plain ones resets the drafter and is not timed. */
#define SETTLE_MIN_STEPS 2
#define MAX_STAGES 4

/* Acceptance estimates start from a prior worth this many observations:
 * 1/2 at the first child of the root, half the rank above for a later
 * sibling, and the depth above for deeper nodes. */
#define PRIOR_WEIGHT 2.0
/* Decay of the draft-cost fit per observation, and its ridge (a share of
 * the weight), which splits a cost between the fit's two slopes while
 * only chains (whose steps equal their nodes) have been measured. */
#define FIT_DECAY 0.98
#define FIT_RIDGE 1e-3

/* The host's speed moves (a shared machine, another process on the same
 * cores: 3x within a run here), and a size measured only in a probe long
 * ago would keep the speed of then, so comparing it with the choice,
 * measured every step, compares two hosts. Costs are therefore stored as
 * measured / drift, where drift is the median over the range's last
 * DRIFT_SAMPLES plain steps of their cost against its first plain step's:
 * after a change of speed it follows within 3 plain steps, before the
 * stored costs (medians of their own last VERIFY_SAMPLES) can take it in,
 * and a lone slow step moves neither.
 *
 * Plain steps only, and each range its own (policy.h): a factor that
 * every step moved took in the choice's own cost, so a tree stored too
 * cheap stayed so (its dearer steps read as a slower host, and plain's
 * estimate rose with them), and one range's steps moved another's.
 *
 * Medians, not averages: on cores shared with the gateway and the draft a
 * few steps now and then run at half speed or less (a group of requests
 * arriving at the gateway while the first of them decode), and a size
 * measured only in probes would keep such a step in an average for a long
 * time (a one-token chain read 15.3 ms against 5.9 ms plain at batch 1,
 * where steady drafting measures 1.1-1.2x). */
#define DRIFT_SAMPLES 5
/* A tree pass under this share of plain's estimate has the drafting range
 * measure plain again at once (policy_choose): more nodes never cost
 * less, so the estimate is stale. */
#define RECHECK_BELOW 0.8
#define VERIFY_SAMPLES 5

/* Decay of the feeding and plain-step times per plain step kept in step
 * (half-life 138 steps: about 4 feeds of SPEC_FEED_AT pairs). */
#define FEED_DECAY 0.995
/* The share is judged only over this many plain steps: the prompts of a
 * new batch are fed before its first plain step. */
#define FEED_MIN_STEPS 64

/* Candidates of one expected tree: topk at the first depth, topk^2 after. */
#define POOL_MAX (POLICY_MAX_RANK + (POLICY_MAX_DEPTH - 1) * POLICY_MAX_RANK * POLICY_MAX_RANK)

typedef struct stage {
    policy_shape shape;
    int32_t steps;
    bool acceptance; /* there to learn the head's acceptance (shared by every range) */
} stage;

typedef struct bucket {
    double verify[POLICY_MAX_NODES + 1];             /* ns per sequence at t nodes per sequence: the median of vs */
    double vs[POLICY_MAX_NODES + 1][VERIFY_SAMPLES]; /* the last samples (a ring), stored as measured / drift */
    int32_t n_verify[POLICY_MAX_NODES + 1];
    int64_t seen[POLICY_MAX_NODES + 1]; /* the step (of this range's, counted by steps) that last measured t */
    int64_t steps;
    policy_shape fresh;  /* the tree of the steps since the last plain ones (tokens 0: none, or settled) */
    int32_t fresh_n;     /* its samples since then */
    int32_t fresh_plain; /* plain steps since its last step: restate_fresh until the factor has followed */
    bool recheck;        /* a tree's pass measured under plain's estimate: measure plain next */
    double draft[POLICY_MAX_DEPTH + 1][POLICY_MAX_RANK + 1]; /* ns per sequence by (steps, topk) (EWMA) */
    int32_t n_draft[POLICY_MAX_DEPTH + 1][POLICY_MAX_RANK + 1];
    double fit_a[3][3], fit_b[3]; /* decayed normal equations of the draft fit, in µs */
    int32_t stage;                /* settling stage running; n_stages once settled */
    int32_t left;                 /* steps left of the stage or probe */
    bool probing;
    policy_shape choice, running;
    policy_shape best_tree, runner_up; /* of the last decision; tokens 0: none */
    double tree_vs_plain;              /* the best tree's rate over plain's at the last decision (0: none) */
    double feed_ns, plain_ns;          /* feeding the drafter and plain steps while kept, decayed (FEED_DECAY) */
    int32_t feed_steps;                /* plain steps in those sums (up to FEED_MIN_STEPS) */
    double credit;                     /* exploring steps earned */
    double credit_ns;                  /* exploring time earned (per sequence) */
    int32_t probe_turn;
    int32_t since_decide;
    int64_t settled_steps, explore_steps;
    int32_t last_n;
    double drift;     /* the host's speed factor for this range now (policy.h): stored costs times this are today's */
    double plain_ref; /* its first plain step's cost per sequence: the factor's 1 */
    double ratios[DRIFT_SAMPLES]; /* its last plain steps' cost / plain_ref (a ring) */
    int32_t n_ratios;
} bucket;

struct policy {
    policy_config cfg;
    stage stages[MAX_STAGES];
    int32_t n_stages;
    double hits[POLICY_MAX_DEPTH][POLICY_MAX_RANK], chances[POLICY_MAX_DEPTH][POLICY_MAX_RANK];
    bucket b[POLICY_BUCKETS];
    int32_t last; /* bucket of the last step */
};

static const policy_shape PLAIN = {0, 0, 1};

static bool same(const policy_shape *a, const policy_shape *b) {
    return a->steps == b->steps && a->topk == b->topk && a->tokens == b->tokens;
}

static int32_t bucket_of(int32_t n) {
    int32_t b = 0;
    while (b + 1 < POLICY_BUCKETS && (n >> (b + 1)) > 0) b++;
    return b;
}

/* The settled range nearest to b (by batch size), or NULL. */
static const bucket *settled_neighbour(const policy *p, const bucket *b) {
    int32_t i = (int32_t)(b - p->b);
    for (int32_t k = 1; k < POLICY_BUCKETS; k++)
        for (int32_t j = i - k; j <= i + k; j += 2 * k)
            if (j >= 0 && j < POLICY_BUCKETS && p->b[j].stage >= p->n_stages) return &p->b[j];
    return NULL;
}

/* Enters stage i, or the first after it worth running. Once a range has
 * settled, the head's acceptance is known (it is shared), so a range that
 * settles later skips the stages there only to learn it (the bounding
 * tree and the deepest chain: at a large batch the dearest steps of all)
 * and takes the nearest settled range's draft-cost fit as its start; its
 * verify costs beyond two nodes are extended from its own plain and
 * one-token steps until probes measure them. */
static void enter_stage(const policy *p, bucket *b, int32_t i) {
    const bucket *nb = settled_neighbour(p, b);
    if (nb)
        while (i < p->n_stages && p->stages[i].acceptance) i++;
    if (nb && b->fit_a[0][0] <= 0 && nb->fit_a[0][0] > 0) {
        /* Costs as the neighbour stores them, times its drift, are
         * today's; over this range's drift, as this one stores them. */
        memcpy(b->fit_a, nb->fit_a, sizeof b->fit_a);
        for (int k = 0; k < 3; k++) b->fit_b[k] = nb->fit_b[k] * nb->drift / b->drift;
    }
    b->stage = i;
    if (i < p->n_stages) {
        const stage *st = &p->stages[i];
        b->running = st->shape;
        b->left = st->steps;
        /* A stage that learns acceptance is sized in trees: a step of n
         * sequences verifies n of them. At batch 8 the bounding tree's
         * 12 steps would cost some 6 plain steps each (a fresh target
         * under 32 streams settled there first: 5% of its first 20 s). */
        if (st->acceptance) {
            int32_t n = b->last_n > 1 ? b->last_n : 1, steps = (st->steps + n - 1) / n;
            b->left = steps > SETTLE_MIN_STEPS ? steps : SETTLE_MIN_STEPS < st->steps ? SETTLE_MIN_STEPS : st->steps;
        }
    }
}

static bool bounds_ok(const policy_shape *m) {
    return m->steps >= 1 && m->steps <= POLICY_MAX_DEPTH && m->topk >= 1 && m->topk <= POLICY_MAX_RANK &&
           m->tokens >= 2 && m->tokens <= POLICY_MAX_NODES;
}

void policy_reset(policy *p, const policy_config *cfg) {
    AE_ASSERT(bounds_ok(&cfg->max));
    memset(p, 0, sizeof *p);
    p->cfg = *cfg;
    const policy_shape *m = &cfg->max;
    int32_t deep = m->steps < m->tokens - 1 ? m->steps : m->tokens - 1;
    stage all[MAX_STAGES] = {{PLAIN, SETTLE_PLAIN_STEPS, false},
                             {*m, SETTLE_TREE_STEPS, true},
                             {{deep, 1, deep + 1}, SETTLE_DEEP_STEPS, true},
                             {{1, 1, 2}, SETTLE_CHAIN_STEPS, false}};
    for (int32_t i = 0; i < MAX_STAGES; i++) {
        bool dup = false;
        for (int32_t j = 0; j < p->n_stages; j++) dup |= same(&p->stages[j].shape, &all[i].shape);
        if (!dup) p->stages[p->n_stages++] = all[i];
    }
    for (int32_t i = 0; i < POLICY_BUCKETS; i++) {
        p->b[i].choice = PLAIN;
        p->b[i].drift = 1.0;
        enter_stage(p, &p->b[i], 0);
    }
}

int policy_init(policy **out, const policy_config *cfg, ae_error *err) {
    *out = NULL;
    const policy_shape *m = &cfg->max;
    if (!bounds_ok(m))
        return err_set(err, "policy: tree of %d steps, top-%d, %d nodes (need 1..%d, 1..%d, 2..%d)", m->steps, m->topk,
                       m->tokens, POLICY_MAX_DEPTH, POLICY_MAX_RANK, POLICY_MAX_NODES);
    policy *p = malloc(sizeof *p);
    if (!p) return err_set(err, "out of memory");
    policy_reset(p, cfg);
    *out = p;
    return AE_OK;
}

void policy_free(policy *p) { free(p); }

/* ---- estimates --------------------------------------------------------- */

/* Each entry's prior is its neighbour's estimate (policy.h), so the table
 * is filled in order. */
static void estimate_table(const policy *p, double pe[POLICY_MAX_DEPTH][POLICY_MAX_RANK]) {
    for (int32_t d = 0; d < POLICY_MAX_DEPTH; d++)
        for (int32_t r = 0; r < POLICY_MAX_RANK; r++) {
            double prior = d > 0 ? pe[d - 1][r] : r > 0 ? 0.5 * pe[0][r - 1] : 0.5;
            pe[d][r] = (p->hits[d][r] + PRIOR_WEIGHT * prior) / (p->chances[d][r] + PRIOR_WEIGHT);
        }
}

/* The estimates, or (cautious) each less one standard error: what
 * decisions use, so that a tree seen a few times in probes does not win
 * over plain by the luck of its samples. */
static void accept_table_z(const policy *p, double pe[POLICY_MAX_DEPTH][POLICY_MAX_RANK], bool cautious) {
    estimate_table(p, pe);
    if (!cautious) return;
    for (int32_t d = 0; d < POLICY_MAX_DEPTH; d++)
        for (int32_t r = 0; r < POLICY_MAX_RANK; r++) {
            double q = pe[d][r], se = sqrt(q * (1 - q) / (p->chances[d][r] + PRIOR_WEIGHT));
            pe[d][r] = q > se ? q - se : 0;
        }
}

static void accept_table(const policy *p, double pe[POLICY_MAX_DEPTH][POLICY_MAX_RANK]) {
    accept_table_z(p, pe, false);
}

double policy_accept(const policy *p, int32_t depth, int32_t rank) {
    AE_ASSERT(depth >= 0 && depth < POLICY_MAX_DEPTH && rank >= 0 && rank < POLICY_MAX_RANK);
    double pe[POLICY_MAX_DEPTH][POLICY_MAX_RANK];
    accept_table(p, pe);
    return pe[depth][rank];
}

static int cmp_desc(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* The expected tree of depth `steps` and width `topk` (policy.h): the
 * scores of all its candidates, best first, into cum as running sums
 * (cum[i] = E[accepted] of a tree of i + 1 drafted nodes). Returns how
 * many. */
static int32_t expected_tree(const double pe[POLICY_MAX_DEPTH][POLICY_MAX_RANK], int32_t steps, int32_t topk,
                             double *cum) {
    double frontier[POLICY_MAX_RANK] = {1.0}, next[POLICY_MAX_RANK * POLICY_MAX_RANK];
    int32_t nf = 1, m = 0;
    for (int32_t d = 0; d < steps; d++) {
        int32_t nn = 0;
        for (int32_t i = 0; i < nf; i++)
            for (int32_t r = 0; r < topk; r++) next[nn++] = frontier[i] * pe[d][r];
        memcpy(cum + m, next, (size_t)nn * sizeof(double));
        m += nn;
        qsort(next, (size_t)nn, sizeof(double), cmp_desc);
        nf = nn < topk ? nn : topk;
        memcpy(frontier, next, (size_t)nf * sizeof(double));
    }
    qsort(cum, (size_t)m, sizeof(double), cmp_desc);
    for (int32_t i = 1; i < m; i++) cum[i] += cum[i - 1];
    return m;
}

double policy_expected_accepted(const policy *p, const policy_shape *s) {
    if (s->tokens < 2) return 0;
    double pe[POLICY_MAX_DEPTH][POLICY_MAX_RANK], cum[POOL_MAX];
    accept_table(p, pe);
    int32_t m = expected_tree(pe, s->steps, s->topk, cum);
    int32_t k = s->tokens - 1 < m ? s->tokens - 1 : m;
    return cum[k - 1];
}

/* A measured V(t), kept in order: a pass of more nodes does all the
 * work of one of fewer. Among tree sizes only the newer reading bounds
 * the older: a larger size measured as recently caps it (a smaller size
 * that measured dearer caught a slow step: the host, another process),
 * and a smaller one measured since raises it (a larger size last seen
 * long ago, cheaper than the choice measures now, held a dear chain at
 * that old cost). Plain's V(1) is never capped, and floors every tree's:
 * it is measured every plain step, where a tree size is measured in a few
 * probes. Capped by a chain stored too cheap, plain cost what the chain
 * did, and a chain then always looked better than plain: at batch 4-8,
 * where its pass cost 2.5-3.5 plain steps, it ran 57 and 24 steps in one
 * 32-stream run. */
static double verify_measured(const bucket *b, int32_t t) {
    double v = b->verify[t];
    if (t == 1) return v;
    for (int32_t u = 2; u <= POLICY_MAX_NODES; u++) {
        if (!b->n_verify[u] || u == t) continue;
        if (u > t && b->seen[u] >= b->seen[t] && b->verify[u] < v) v = b->verify[u];
        if (u < t && b->seen[u] > b->seen[t] && b->verify[u] > v) v = b->verify[u];
    }
    if (b->n_verify[1] && v < b->verify[1]) v = b->verify[1];
    return v;
}

/* V(t) for a bucket: measured (capped as above), or interpolated between
 * the nearest measured sizes; past the largest, extended along the last
 * two; 0 when nothing is measured. The curve never falls. */
static double verify_cost(const bucket *b, int32_t t) {
    if (b->n_verify[t]) return verify_measured(b, t);
    int32_t lo = t - 1, hi = t + 1;
    while (lo >= 1 && !b->n_verify[lo]) lo--;
    while (hi <= POLICY_MAX_NODES && !b->n_verify[hi]) hi++;
    if (lo >= 1 && hi <= POLICY_MAX_NODES) {
        double vl = verify_measured(b, lo), vh = verify_measured(b, hi);
        return vl + (vh - vl) * (double)(t - lo) / (double)(hi - lo);
    }
    if (hi <= POLICY_MAX_NODES) return verify_measured(b, hi);
    if (lo < 1) return 0;
    int32_t lo2 = lo - 1;
    while (lo2 >= 1 && !b->n_verify[lo2]) lo2--;
    double vl = b->verify[lo], slope = lo2 >= 1 ? (vl - verify_measured(b, lo2)) / (double)(lo - lo2) : 0;
    return vl + (slope > 0 ? slope : 0) * (double)(t - lo);
}

/* Solves the 3x3 system a x = y (Gaussian elimination, partial pivoting). */
static bool solve3(double a[3][3], double y[3], double x[3]) {
    for (int c = 0; c < 3; c++) {
        int piv = c;
        for (int r = c + 1; r < 3; r++)
            if (fabs(a[r][c]) > fabs(a[piv][c])) piv = r;
        if (fabs(a[piv][c]) < 1e-12) return false;
        for (int k = 0; k < 3; k++) {
            double t = a[c][k];
            a[c][k] = a[piv][k];
            a[piv][k] = t;
        }
        double t = y[c];
        y[c] = y[piv];
        y[piv] = t;
        for (int r = c + 1; r < 3; r++) {
            double f = a[r][c] / a[c][c];
            for (int k = c; k < 3; k++) a[r][k] -= f * a[c][k];
            y[r] -= f * y[c];
        }
    }
    for (int c = 2; c >= 0; c--) {
        double s = y[c];
        for (int k = c + 1; k < 3; k++) s -= a[c][k] * x[k];
        x[c] = s / a[c][c];
    }
    return true;
}

static void draft_features(int32_t steps, int32_t topk, double f[3]) {
    f[0] = 1;
    f[1] = steps;
    f[2] = 1 + (double)(steps - 1) * topk;
}

/* D(steps, topk) for a bucket in ns: measured, or from the fit; 0 when
 * neither is known (or the fit says nothing sensible). */
static double draft_cost(const bucket *b, int32_t steps, int32_t topk) {
    if (b->n_draft[steps][topk]) return b->draft[steps][topk];
    if (b->fit_a[0][0] <= 0) return 0;
    double a[3][3], y[3], x[3], f[3];
    memcpy(a, b->fit_a, sizeof a);
    memcpy(y, b->fit_b, sizeof y);
    double ridge = FIT_RIDGE * a[0][0];
    a[1][1] += ridge;
    a[2][2] += ridge;
    if (!solve3(a, y, x)) return 0;
    draft_features(steps, topk, f);
    double us = x[0] * f[0] + x[1] * f[1] + x[2] * f[2];
    return us > 0 ? us * 1e3 : 0;
}

static double rate_of(const bucket *b, const double *cum, int32_t m, const policy_shape *s) {
    double v = verify_cost(b, s->tokens);
    if (v <= 0) return 0;
    if (s->tokens < 2) return 1e9 / v;
    double d = draft_cost(b, s->steps, s->topk);
    if (d <= 0) return 0;
    int32_t k = s->tokens - 1 < m ? s->tokens - 1 : m;
    return (1 + cum[k - 1]) * 1e9 / (v + d);
}

double policy_rate(const policy *p, int32_t n, const policy_shape *s) {
    double pe[POLICY_MAX_DEPTH][POLICY_MAX_RANK], cum[POOL_MAX];
    int32_t m = 0;
    if (s->tokens >= 2) {
        accept_table(p, pe);
        m = expected_tree(pe, s->steps, s->topk, cum);
    }
    return rate_of(&p->b[bucket_of(n)], cum, m, s);
}

/* ---- decisions ----------------------------------------------------------- */

/* Every shape within the bounds, plain first, then by width, depth and
 * nodes (so that among equals the cheaper wins: strictly better only
 * replaces). Sets the best, the best tree and the runner-up. */
static void decide(policy *p, bucket *b, bool settling) {
    double pe[POLICY_MAX_DEPTH][POLICY_MAX_RANK], cum[POOL_MAX];
    accept_table_z(p, pe, true);
    const policy_shape *mx = &p->cfg.max;
    policy_shape best = PLAIN, second = {0, 0, 0}, tree = {0, 0, 0};
    double best_r = rate_of(b, NULL, 0, &PLAIN), second_r = 0, tree_r = 0, cur_r = -1;
    if (same(&b->choice, &PLAIN)) cur_r = best_r;
    for (int32_t w = 1; w <= mx->topk; w++)
        for (int32_t d = 1; d <= mx->steps; d++) {
            int32_t m = expected_tree(pe, d, w, cum);
            int32_t tmax = w == 1 ? d + 1 : 1 + m;
            if (tmax > mx->tokens) tmax = mx->tokens;
            /* A frontier wider than the tree's nodes cannot be kept: the
             * same tree as width tokens - 1 (every kept node's ancestors
             * are kept, so no depth keeps more). */
            for (int32_t t = d + 1 > w + 1 ? d + 1 : w + 1; t <= tmax; t++) {
                policy_shape s = {d, w, t};
                double r = rate_of(b, cum, m, &s);
                if (same(&s, &b->choice)) cur_r = r;
                if (r > tree_r) tree_r = r, tree = s;
                if (r > best_r) {
                    second_r = best_r, second = best;
                    best_r = r, best = s;
                } else if (r > second_r) {
                    second_r = r, second = s;
                }
            }
        }
    b->best_tree = tree;
    b->runner_up = second;
    double plain_r = rate_of(b, NULL, 0, &PLAIN);
    b->tree_vs_plain = plain_r > 0 ? tree_r / plain_r : 0;
    b->since_decide = 0;
    /* A measured choice stays unless another is clearly better (noise
     * would otherwise flip between near equals). */
    if (settling || cur_r <= 0 || best_r > cur_r * POLICY_SWITCH_GAIN) b->choice = best;
    if (!same(&b->choice, &best)) b->runner_up = best;
}

/* The next probe's shape in turn (policy.h), and in *turns how many turns
 * taking it uses up; false when every turn would run the choice itself. */
static bool next_probe(const policy *p, const bucket *b, policy_shape *out, int32_t *turns) {
    for (int32_t k = 0; k < 3; k++) {
        int32_t turn = (b->probe_turn + k) % 3;
        policy_shape s = turn == 0   ? (b->choice.tokens >= 2 ? PLAIN : b->best_tree)
                         : turn == 1 ? b->runner_up
                                     : p->cfg.max;
        if (s.tokens >= 1 && !same(&s, &b->choice)) {
            *out = s;
            *turns = k + 1;
            return true;
        }
    }
    return false;
}

/* A step's expected time per sequence in ns (0: not known). */
static double step_cost(const bucket *b, const policy_shape *s) {
    double v = verify_cost(b, s->tokens);
    return s->tokens >= 2 ? v + draft_cost(b, s->steps, s->topk) : v;
}

policy_pick policy_choose(policy *p, int32_t n) {
    AE_ASSERT(n >= 1);
    if (!p->cfg.adaptive) return (policy_pick){p->cfg.max, false};
    p->last = bucket_of(n);
    bucket *b = &p->b[p->last];
    b->last_n = n;
    if (b->stage < p->n_stages) {
        policy_pick pick = {b->running, true};
        if (--b->left == 0) {
            enter_stage(p, b, b->stage + 1);
            if (b->stage == p->n_stages) {
                decide(p, b, true);
                b->running = b->choice;
            }
        }
        return pick;
    }
    b->settled_steps++;
    if (!b->probing) {
        /* Probes are paid from two budgets, each earned at
         * POLICY_EXPLORE_SHARE (POLICY_EXPLORE_FAR far from paying):
         * steps, and time (a probe of a tree at a large batch costs
         * several plain steps, so it waits longer). */
        double share =
            b->choice.tokens < 2 && b->tree_vs_plain < POLICY_KEEP_DRAFTER ? POLICY_EXPLORE_FAR : POLICY_EXPLORE_SHARE;
        if (b->credit < POLICY_PROBE_STEPS) b->credit += share;
        b->credit_ns += share * step_cost(b, &b->choice);
        policy_shape probe;
        int32_t turns = 0;
        if (b->recheck && b->choice.tokens >= 2) {
            /* A tree's pass came in under plain's estimate: that estimate
             * is stale (a burst of slow plain steps, then no plain step
             * to move the factor back). Plain steps now, enough to move
             * its median; they cost less than the tree's. */
            b->recheck = false;
            b->probing = true;
            b->left = DRIFT_SAMPLES / 2 + 1;
            b->running = PLAIN;
        } else if (b->credit >= POLICY_PROBE_STEPS && next_probe(p, b, &probe, &turns) &&
                   b->credit_ns >= POLICY_PROBE_STEPS * step_cost(b, &probe)) {
            b->credit -= POLICY_PROBE_STEPS;
            b->credit_ns -= POLICY_PROBE_STEPS * step_cost(b, &probe);
            b->probe_turn += turns;
            b->probing = true;
            b->left = POLICY_PROBE_STEPS;
            b->running = probe;
        } else {
            if (++b->since_decide >= POLICY_DECIDE_EVERY) decide(p, b, false);
            b->running = b->choice;
            return (policy_pick){b->choice, false};
        }
    }
    policy_pick pick = {b->running, true};
    b->explore_steps++;
    if (--b->left == 0) {
        b->probing = false;
        decide(p, b, false);
        b->running = b->choice;
    }
    return pick;
}

bool policy_drafting(const policy *p, int32_t n) { return !p->cfg.adaptive || p->b[bucket_of(n)].running.tokens >= 2; }

static double feed_share(const bucket *b) {
    return b->feed_steps >= FEED_MIN_STEPS && b->plain_ns > 0 ? b->feed_ns / b->plain_ns : 0;
}

bool policy_keep_drafter(const policy *p, int32_t n) {
    const bucket *b = &p->b[bucket_of(n)];
    return policy_drafting(p, n) || b->stage < p->n_stages ||
           (b->tree_vs_plain >= POLICY_KEEP_DRAFTER && feed_share(b) <= POLICY_KEEP_COST);
}

void policy_observe_feed(policy *p, int32_t n, int64_t ns) {
    if (n < 1 || ns <= 0) return;
    bucket *b = &p->b[bucket_of(n)];
    /* While the range drafts, the drafter needs its prompts anyway. */
    if (b->choice.tokens < 2) b->feed_ns += (double)ns;
}

int64_t policy_explore_steps(const policy *p) {
    int64_t e = 0;
    for (int32_t i = 0; i < POLICY_BUCKETS; i++) e += p->b[i].explore_steps;
    return e;
}

/* ---- measurements -------------------------------------------------------- */

/* The median of n (1..VERIFY_SAMPLES) values; of an even count, the
 * lower of the middle two (a cost, so the cheaper reading). */
static double median_of(const double *v, int32_t n) {
    double w[VERIFY_SAMPLES > DRIFT_SAMPLES ? VERIFY_SAMPLES : DRIFT_SAMPLES];
    memcpy(w, v, (size_t)n * sizeof *w);
    for (int32_t i = 1; i < n; i++)
        for (int32_t j = i; j > 0 && w[j - 1] > w[j]; j--) {
            double x = w[j];
            w[j] = w[j - 1];
            w[j - 1] = x;
        }
    return w[(n - 1) / 2];
}

/* The plain steps after trees moved the range's factor by f (old / new):
 * the trees' samples since the plain steps before them were stored over
 * a factor only plain steps move, so the slowdown (or speed-up) they met
 * was charged to the tree. Restated at the new factor, they charge it to
 * the host, as the plain steps show. A tree that grew dear while plain
 * did not keeps its cost: plain's factor did not move. */
static void restate_fresh(bucket *b, double f) {
    const policy_shape *s = &b->fresh;
    if (s->tokens < 2 || s->tokens > POLICY_MAX_NODES) return;
    int32_t t = s->tokens, have = b->n_verify[t] < VERIFY_SAMPLES ? b->n_verify[t] : VERIFY_SAMPLES;
    int32_t k = b->fresh_n < have ? b->fresh_n : have;
    for (int32_t i = 1; i <= k; i++) b->vs[t][(b->n_verify[t] - i + 2 * VERIFY_SAMPLES) % VERIFY_SAMPLES] *= f;
    if (k > 0) b->verify[t] = median_of(b->vs[t], have);
    if (s->steps >= 1 && s->steps <= POLICY_MAX_DEPTH && s->topk >= 1 && s->topk <= POLICY_MAX_RANK)
        b->draft[s->steps][s->topk] *= f;
}

static void ewma(double *v, int32_t *count, double x) { *v = (*count)++ ? *v + POLICY_EWMA * (x - *v) : x; }

void policy_observe_step(policy *p, int32_t n, const policy_shape *shape, int32_t tokens, int64_t draft_ns,
                         int64_t verify_ns) {
    if (n < 1 || tokens < n) return;
    bucket *b = &p->b[bucket_of(n)];
    if (shape->tokens < 2 && b->choice.tokens < 2 && policy_keep_drafter(p, n)) {
        b->feed_ns *= FEED_DECAY;
        b->plain_ns = FEED_DECAY * b->plain_ns + (double)verify_ns;
        if (b->feed_steps < FEED_MIN_STEPS) b->feed_steps++;
    }
    /* A step where some sequences got no tree, or a cut one, measures
     * no size (its pass is cheaper than the shape's), and its drafter
     * served fewer trees. */
    if (shape->tokens >= 2 && tokens != n * shape->tokens) return;
    int32_t t = tokens / n;
    if (t > POLICY_MAX_NODES) t = POLICY_MAX_NODES;
    double v = (double)verify_ns / n;
    /* A plain step tells how fast the host runs now against the range's
     * first (policy.h: only plain steps, and only this range's). Against
     * the first, not against the stored costs: those are stored over the
     * factor, and a factor measured against them would wander with the
     * noise of every step it took in (test_policy.c: from 6.5 to 2,325
     * over 20,000 noisy steps). */
    if (t == 1) {
        double before = b->drift;
        if (b->plain_ref <= 0) b->plain_ref = v;
        b->ratios[b->n_ratios++ % DRIFT_SAMPLES] = v / b->plain_ref;
        if (b->n_ratios >= 2 * DRIFT_SAMPLES) b->n_ratios -= DRIFT_SAMPLES;
        b->drift = median_of(b->ratios, b->n_ratios < DRIFT_SAMPLES ? b->n_ratios : DRIFT_SAMPLES);
        if (b->drift != before) restate_fresh(b, before / b->drift);
    }
    if (t == 1 && b->fresh.tokens >= 2 && ++b->fresh_plain >= DRIFT_SAMPLES / 2 + 1) b->fresh.tokens = 0;
    if (t >= 2) {
        if (!same(&b->fresh, shape)) {
            b->fresh = *shape;
            b->fresh_n = 0;
        }
        b->fresh_plain = 0;
        b->fresh_n++;
    }
    if (t >= 2 && b->n_verify[1] && v < RECHECK_BELOW * b->verify[1] * b->drift) b->recheck = true;
    if (t == 1) b->recheck = false;
    b->vs[t][b->n_verify[t]++ % VERIFY_SAMPLES] = v / b->drift;
    b->seen[t] = ++b->steps;
    if (b->n_verify[t] >= 2 * VERIFY_SAMPLES)
        b->n_verify[t] -= VERIFY_SAMPLES; /* the same slot next, never overflowing */
    b->verify[t] = median_of(b->vs[t], b->n_verify[t] < VERIFY_SAMPLES ? b->n_verify[t] : VERIFY_SAMPLES);
    int32_t s = shape->steps, k = shape->topk;
    if (shape->tokens < 2 || draft_ns < 0 || s < 1 || s > POLICY_MAX_DEPTH || k < 1 || k > POLICY_MAX_RANK) return;
    double per = (double)draft_ns / n / b->drift;
    ewma(&b->draft[s][k], &b->n_draft[s][k], per);
    double f[3], us = per / 1e3;
    draft_features(s, k, f);
    for (int i = 0; i < 3; i++) {
        for (int j = 0; j < 3; j++) b->fit_a[i][j] = FIT_DECAY * b->fit_a[i][j] + f[i] * f[j];
        b->fit_b[i] = FIT_DECAY * b->fit_b[i] + f[i] * us;
    }
}

void policy_observe_tree(policy *p, const int32_t *parents, int32_t n, const int32_t *path, int32_t n_path) {
    if (n < 2 || n > POLICY_MAX_NODES || n_path < 1 || n_path > n) return;
    int32_t kids[POLICY_MAX_NODES] = {0}, rank[POLICY_MAX_NODES] = {0};
    for (int32_t i = 1; i < n; i++) {
        if (parents[i] < 0 || parents[i] >= i) return;
        rank[i] = kids[parents[i]]++;
    }
    for (int32_t j = 0; j < n_path && j < POLICY_MAX_DEPTH; j++) {
        int32_t node = path[j], c = kids[node] < POLICY_MAX_RANK ? kids[node] : POLICY_MAX_RANK;
        for (int32_t r = 0; r < c; r++) p->chances[j][r] += 1;
        if (j + 1 < n_path && rank[path[j + 1]] < POLICY_MAX_RANK) p->hits[j][rank[path[j + 1]]] += 1;
    }
    /* A window over recent trees: the workload may change. */
    if (p->chances[0][0] >= POLICY_ACCEPT_WINDOW)
        for (int32_t d = 0; d < POLICY_MAX_DEPTH; d++)
            for (int32_t r = 0; r < POLICY_MAX_RANK; r++) p->hits[d][r] *= 0.5, p->chances[d][r] *= 0.5;
}

/* ---- reports ------------------------------------------------------------- */

void policy_get_report(const policy *p, int32_t n, policy_report *r) {
    memset(r, 0, sizeof *r);
    const bucket *b = &p->b[n > 0 ? bucket_of(n) : p->last];
    const policy_shape *mx = &p->cfg.max;
    r->batch = n > 0 ? n : b->last_n > 0 ? b->last_n : 1;
    r->adaptive = p->cfg.adaptive;
    r->settled = !p->cfg.adaptive || b->stage >= p->n_stages;
    r->shape = p->cfg.adaptive ? b->choice : *mx;
    double pe[POLICY_MAX_DEPTH][POLICY_MAX_RANK], cum[POOL_MAX];
    accept_table(p, pe);
    r->n_accept = mx->steps;
    for (int32_t d = 0; d < mx->steps; d++) r->accept[d] = pe[d][0];
    int32_t m = 0;
    if (r->shape.tokens >= 2) {
        m = expected_tree(pe, r->shape.steps, r->shape.topk, cum);
        r->expected_accepted = cum[(r->shape.tokens - 1 < m ? r->shape.tokens - 1 : m) - 1];
        r->draft_us = draft_cost(b, r->shape.steps, r->shape.topk) * b->drift / 1e3;
    }
    r->n_verify = mx->tokens;
    for (int32_t t = 1; t <= mx->tokens; t++) {
        r->verify_tokens[t - 1] = t;
        r->verify_us[t - 1] = verify_cost(b, t) * b->drift / 1e3;
    }
    r->tok_s = rate_of(b, cum, m, &r->shape) * r->batch / b->drift;
    r->plain_tok_s = rate_of(b, NULL, 0, &PLAIN) * r->batch / b->drift;
    r->drift = b->drift;
    r->feed_share = feed_share(b);
    r->keep_drafter = policy_keep_drafter(p, r->batch);
    r->settled_steps = b->settled_steps;
    r->explore_steps = b->explore_steps;
}

static void shape_name(const policy_shape *s, char *buf, size_t cap) {
    if (s->tokens < 2)
        snprintf(buf, cap, "plain");
    else
        snprintf(buf, cap, "%d/%d/%d", s->steps, s->topk, s->tokens);
}

/* Appends to buf at *at, keeping snprintf's count past the end. */
#define APPEND(...) \
    do { \
        int k_ = snprintf(buf + (*at < cap ? *at : cap), *at < cap ? cap - *at : 0, __VA_ARGS__); \
        if (k_ > 0) *at += (size_t)k_; \
    } while (0)

static void append_list(char *buf, size_t cap, size_t *at, const double *v, int32_t n, const char *sep, int decimals) {
    for (int32_t i = 0; i < n; i++) {
        if (i) APPEND("%s", sep);
        APPEND("%.*f", decimals, v[i]);
    }
}

int policy_report_json(const policy_report *r, char *buf, size_t cap) {
    size_t at0 = 0, *at = &at0;
    char name[48];
    shape_name(&r->shape, name, sizeof name);
    APPEND("{\"batch\": %d, \"adaptive\": %s, \"settled\": %s, \"shape\": \"%s\", \"accept\": [", r->batch,
           r->adaptive ? "true" : "false", r->settled ? "true" : "false", name);
    append_list(buf, cap, at, r->accept, r->n_accept, ", ", 3);
    APPEND("], \"expected_accepted\": %.3f, \"verify_us\": {", r->expected_accepted);
    for (int32_t i = 0; i < r->n_verify; i++)
        APPEND("%s\"%d\": %.1f", i ? ", " : "", r->verify_tokens[i], r->verify_us[i]);
    APPEND("}, \"draft_us\": %.1f, \"tok_s\": %.1f, \"plain_tok_s\": %.1f, \"settled_steps\": %lld, "
           "\"explore_steps\": %lld, \"drift\": %.3f, \"feed_share\": %.4f, \"keep_drafter\": %s}",
           r->draft_us, r->tok_s, r->plain_tok_s, (long long)r->settled_steps, (long long)r->explore_steps, r->drift,
           r->feed_share, r->keep_drafter ? "true" : "false");
    return (int)*at;
}

int policy_report_log(const policy_report *r, char *buf, size_t cap) {
    size_t at0 = 0, *at = &at0;
    char name[48];
    shape_name(&r->shape, name, sizeof name);
    APPEND("policy=%s%s exp_tok_s=%.1f plain_tok_s=%.1f accept=", name, r->settled ? "" : "(settling)", r->tok_s,
           r->plain_tok_s);
    append_list(buf, cap, at, r->accept, r->n_accept, "/", 2);
    APPEND(" draft_us=%.0f verify_us=", r->draft_us);
    append_list(buf, cap, at, r->verify_us, r->n_verify, "/", 0);
    APPEND(" explore=%lld/%lld drift=%.2f feed=%.1f%%%s", (long long)r->explore_steps, (long long)r->settled_steps,
           r->drift, 100 * r->feed_share, r->keep_drafter ? "" : "(stale)");
    return (int)*at;
}
