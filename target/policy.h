/* The speculation policy: which draft tree each step asks for, sized by
 * what trees cost and gain here, measured as the target runs.
 *
 * A step of n sequences either verifies every root alone (plain) or asks
 * the drafter for trees of one shape (EAGLE-2 parameters: depth `steps`,
 * width `topk`, `tokens` nodes with the root) and verifies them all in one
 * pass. Per sequence, a shape s gives
 *
 *     rate(s) = (1 + E[accepted | s]) / (V(tokens) + D(steps, topk))
 *
 * tokens per unit of time, against 1 / V(1) for a plain step, where
 *
 *   - V(t) is the verify pass's time per sequence when each sequence
 *     verifies t nodes: a table by t (1..POLICY_MAX_NODES) for each range
 *     of batch sizes (1, 2-3, 4-7, ...; a pass's cost depends on its batch
 *     far more than on anything else), each entry the median of the last 5
 *     steps at that size (a few slow steps on shared cores do not move
 *     it), for a tree capped by a larger size measured as recently,
 *     raised by a smaller one measured since, and never under plain's
 *     V(1), the size measured most (more nodes never cost less: a dearer
 *     small size caught a slow step; the newer reading bounds the older);
 *     sizes not measured are interpolated between the nearest measured
 *     ones (the curve is flat while the pass is bound by reading the
 *     weights, then rises);
 *   - D(steps, topk) is the drafter's time per sequence (the propose call:
 *     the link and the head's sequential passes), an EWMA for each shape
 *     measured, and for the others a least-squares fit of
 *     c0 + c1 * steps + c2 * (nodes the head runs: 1 + (steps - 1) * topk)
 *     over the shapes measured;
 *   - E[accepted | s] comes from the head's acceptance in this workload:
 *     p[d][r], how often the r-th child (in the drafter's order, best
 *     first) of a node reached at depth d is the token accepted there,
 *     counted from every verified tree (a node's children are distinct, so
 *     at most one is accepted). The expected tree of a shape is built the
 *     way the drafter builds its own (draft/tree.h), with p in place of
 *     the head's probabilities: depth by depth, the best `topk` nodes
 *     expand, each child scoring its parent's score times p; the best
 *     tokens - 1 nodes make the tree, and the sum of their scores (each the
 *     chance that the path to it is accepted) is E[accepted]. A chain is
 *     the product sum p0 + p0 p1 + ...
 *
 * Both costs are stored divided by the range's drift factor: the median
 * over its last 5 plain steps of their cost against its first plain
 * step's (it follows a change of speed within 3 of them, before the
 * stored medians take it in, and a lone slow step moves nothing), so
 * when the host slows down or speeds up (a shared machine, the other
 * service on the same cores), a size last measured in a probe long ago
 * is compared at today's speed, not at the speed of then.
 *   - Plain steps only. A factor that every step moved took in the
 *     choice's own cost, so a tree stored too cheap stayed chosen: its
 *     dearer steps read as a slower host, and plain's estimate rose with
 *     them (docs/performance.md: the policy's measured reasons).
 *   - While a range drafts, a slowdown is first charged to the tree,
 *     which errs towards plain. When the plain steps that follow (a
 *     probe, or a choice) move the factor, the tree's samples since the
 *     plain steps before them are restated at the new factor.
 *   - A tree pass measured under 0.8 of plain's estimate means that
 *     estimate is stale (a burst of slow plain steps, then none to move
 *     the factor back): the range runs 3 plain steps at once.
 *   - Each range its own: contention is not the same at every batch
 *     size, and a shared factor stored one range's probes over another's
 *     speed.
 * Reports show costs and rates times the factor: today's.
 *
 * The policy picks the best rate over the shapes within the bounds (the
 * configured tree: --spec-steps, --spec-topk, --spec-tokens), plain
 * included; a batch runs plainly when no tree pays. It decides again every
 * POLICY_DECIDE_EVERY steps, and leaves the shape it runs only for one
 * estimated at least POLICY_SWITCH_GAIN times better.
 *
 * Each range of batch sizes settles on its own: a schedule of a few
 * shapes (plain, the bounding tree, the deepest chain, a one-token chain:
 * 32 steps at batch 1; the two that learn acceptance are sized in trees,
 * so a batch of 8 runs them in 2 steps each, 16 in all) measures the ends
 * of both cost curves and the acceptance at every depth and rank; then it
 * picks. The acceptance is the head's, shared
 * by all ranges, so a range that settles after another runs only plain
 * and the one-token chain (12 steps), starts from the nearest settled
 * range's draft-cost fit, and extends its verify curve from its two sizes
 * until probes measure more. Once settled, it explores at most
 * POLICY_EXPLORE_SHARE of its steps and of its time (each probe waits
 * until both budgets cover it: a tree at a large batch costs several
 * plain steps), in probes of POLICY_PROBE_STEPS steps that refresh what
 * the choice does not measure by running: plain when it drafts, the best
 * tree when it runs plainly, the runner-up, and the bounding tree
 * (acceptance at every rank), in turn. A probe's first
 * step may carry a drafter reset (after plain steps its state is stale):
 * the caller does not time such a draft (draft_ns < 0). A range whose
 * best tree is far from paying (under POLICY_KEEP_DRAFTER of plain's
 * rate: the drafter is left stale) earns its probes at
 * POLICY_EXPLORE_FAR instead: there every probe pays that reset too, and
 * what a probe could find must gain 25% to change anything.
 *
 * Not adaptive (a fixed shape): every step asks for the bounding tree.
 *
 * Plain data, no I/O, no clock: the caller measures (spec.c times its
 * steps with its own clock, tests feed synthetic figures). */
#ifndef AERIE_TARGET_POLICY_H
#define AERIE_TARGET_POLICY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../services/core/err.h"
#include "../services/spec/spec_drafter.h"

#define POLICY_BUCKETS 8    /* batch sizes 1, 2-3, 4-7, ..., 128+ */
#define POLICY_MAX_DEPTH 16 /* draft/tree.h's TREE_MAX_STEPS */
#define POLICY_MAX_RANK 8   /* draft/tree.h's TREE_MAX_TOPK */
#define POLICY_MAX_NODES 64 /* draft/tree.h's TREE_MAX_NODES */
#define POLICY_EXPLORE_SHARE 0.02
#define POLICY_EXPLORE_FAR 0.005 /* where no tree comes near paying */
#define POLICY_PROBE_STEPS 2
#define POLICY_DECIDE_EVERY 8
#define POLICY_SWITCH_GAIN 1.02
#define POLICY_EWMA 0.125         /* weight of a new measurement of a draft cost */
#define POLICY_ACCEPT_WINDOW 2048 /* acceptance counts halve past this many first-depth chances */
#define POLICY_KEEP_DRAFTER 0.8   /* policy_keep_drafter: the best tree at 80% of plain's rate or more, */
#define POLICY_KEEP_COST 0.02     /* and feeding the drafter at most 2% of the range's plain time */

/* A tree's shape: the speculation contract's (tokens 1: plain). */
typedef spec_shape policy_shape;

typedef struct policy_config {
    policy_shape max; /* the bounds: steps 1..16, topk 1..8, tokens 2..64 */
    bool adaptive;    /* false: always the bounding tree */
} policy_config;

/* The shape for the next step, and whether it is there to explore. */
typedef struct policy_pick {
    policy_shape shape;
    bool explore;
} policy_pick;

/* The figures behind the choice for one range of batch sizes (for Info,
 * /server_info and the periodic log line). Costs are per sequence, rates
 * (tokens per second) for the whole batch; 0: not known yet. */
typedef struct policy_report {
    int32_t batch; /* the last step's batch size */
    bool adaptive, settled;
    policy_shape shape;              /* the choice */
    double accept[POLICY_MAX_DEPTH]; /* p[d][0]: the best child accepted at depth d + 1, given the path got there */
    int32_t n_accept;                /* entries of accept: the bound's steps */
    double expected_accepted;        /* E[accepted] of the choice */
    int32_t n_verify;
    int32_t verify_tokens[POLICY_MAX_NODES]; /* node counts reported: 1 .. the bound's tokens */
    double verify_us[POLICY_MAX_NODES];      /* V at each, measured or interpolated */
    double draft_us;                         /* D of the choice (0 for plain) */
    double tok_s, plain_tok_s;               /* expected rate of the choice, and of plain */
    int64_t settled_steps, explore_steps;    /* since this range settled, and of them exploring */
    double drift;                            /* the range's speed factor: today's costs / those stored (policy.h) */
    double feed_share;                       /* feeding the drafter through plain steps: its time over theirs */
    bool keep_drafter;                       /* policy_keep_drafter for this range */
} policy_report;

typedef struct policy policy;

int policy_init(policy **out, const policy_config *cfg, ae_error *err);
void policy_free(policy *p); /* NULL is a no-op */
/* Starts over with new bounds (valid ones: policy_init checks them). */
void policy_reset(policy *p, const policy_config *cfg);

/* The shape for the next step of a batch of n sequences (n >= 1). */
policy_pick policy_choose(policy *p, int32_t n);

/* Whether the shape now running for batches of n drafts (a caller feeding
 * the drafter a new prompt asks first). */
bool policy_drafting(const policy *p, int32_t n);
/* Whether the drafter should be kept in step with batches of n while they
 * run plainly (fed each prompt and, now and then, the pairs of the plain
 * steps): the shape running drafts, the range is still settling, or its
 * best tree came within POLICY_KEEP_DRAFTER of plain at the last decision
 * and keeping it in step costs at most POLICY_KEEP_COST of the plain
 * steps' time (policy_observe_feed). Then a probe, or a switch back to
 * drafting, finds a drafter that holds the whole sequence; one reset from the last ENGINE_MAX_TREE pairs proposes
 * worse trees, and probes that always follow a reset would measure the
 * head's acceptance low and keep a tree that pays from being chosen. Far
 * from paying, or where the feeding costs more than the exploring budget
 * (large batches on a compute-bound target, where the draft's passes over
 * every token compete with it), the drafter's work would be wasted and it
 * is left stale. */
bool policy_keep_drafter(const policy *p, int32_t n);

/* Time spent feeding the drafter (a prompt, or the pending pairs of plain
 * steps) while batches of n run plainly by choice and it is kept in step.
 * The share is that time over the plain steps' own, both decayed per
 * plain step, judged once 64 plain steps are in it; it is frozen while
 * the drafter is not kept (nothing measures it then) and while the range
 * drafts (the drafter needs its prompts then, and plain steps are only
 * probes: a share of those would count every prompt against a few
 * steps). */
void policy_observe_feed(policy *p, int32_t n, int64_t ns);

/* What a step cost: n sequences ran `shape` (as asked; some may have got
 * no tree, or a cut one: then tokens is not n * shape->tokens and the
 * step measures nothing), `tokens` nodes verified in all, draft_ns in the
 * drafter (< 0: not a measure of the shape, e.g. a reset or a failed
 * call; plain steps pass 0) and verify_ns in the pass. */
void policy_observe_step(policy *p, int32_t n, const policy_shape *shape, int32_t tokens, int64_t draft_ns,
                         int64_t verify_ns);

/* One verified tree of n nodes (parents[0] = -1, parents[i] < i; children
 * of a node in the drafter's order) and the accepted path (path[0] = 0,
 * then each accepted node, a child of the one before). */
void policy_observe_tree(policy *p, const int32_t *parents, int32_t n, const int32_t *path, int32_t n_path);

/* Estimated p[depth][rank] (0-based depth: children of the root are 0). */
double policy_accept(const policy *p, int32_t depth, int32_t rank);

/* E[accepted] of a shape under the current estimates. */
double policy_expected_accepted(const policy *p, const policy_shape *shape);

/* Expected tokens per second per sequence of a shape for batches of n
 * (0: a cost not known yet). */
double policy_rate(const policy *p, int32_t n, const policy_shape *shape);

/* Explores spent since settling, over all ranges (probes only). */
int64_t policy_explore_steps(const policy *p);

/* The figures for batches of n (n <= 0: of the last step's batch). */
void policy_get_report(const policy *p, int32_t n, policy_report *r);

/* The report as a JSON object; returns the length written (truncated to
 * cap - 1 like snprintf, whose return it mirrors). */
int policy_report_json(const policy_report *r, char *buf, size_t cap);

/* The report as key=value pairs for a log line. */
int policy_report_log(const policy_report *r, char *buf, size_t cap);

#endif
