#include "spec.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../services/core/clock.h"
#include "verify.h"

_Static_assert(ENGINE_MAX_TREE == SPEC_MAX_TREE, "a drafted tree must fit one engine step");

/* Calls to the drafter pause this many steps at most after failures. */
#define SPEC_MAX_PAUSE 64
/* A sequence running plainly while the policy keeps the drafter in step
 * sends its pairs once this many are pending: one draft pass per this many
 * steps, and never the window's ENGINE_MAX_TREE, past which it would be
 * reset. */
#define SPEC_FEED_AT 32

typedef struct seq_state {
    bool started;
    bool fed;     /* the drafter has been told of this sequence since it started */
    bool resync;  /* the drafter lost pairs of it: reset it with the pending ones */
    int32_t held; /* pairs the drafter holds for it (when fed and not resync) */
    /* A choice forked from another (spec_seq_fork): the next call to the
     * drafter starts it from fork_of's state there, `held` pairs. */
    bool fork;
    int32_t fork_of;
    int32_t root;
    /* Pairs committed since the drafter last took some: the latest
     * ENGINE_MAX_TREE (older ones dropped, which sets resync). */
    int32_t n_pending;
    int32_t pending_tokens[ENGINE_MAX_TREE];
    spec_stats stats;
} seq_state;

struct spec {
    engine *e;
    const spec_drafter *d; /* NULL: plain */
    spec_config cfg;
    int32_t H, V, fw;    /* hidden, vocabulary, feature width (n_capture * H) */
    seq_state *seqs;     /* [max_seqs] */
    float *pending_feat; /* [max_seqs][ENGINE_MAX_TREE][fw] */
    spec_stats total;
    int64_t step_no;   /* spec_step calls so far */
    int32_t last_n;    /* sequences in the last step */
    int64_t retry_at;  /* no drafter calls before this step */
    int32_t failures;  /* consecutive failed calls */
    policy *pol;       /* with a drafter: each step's tree */
    bool was_drafting; /* the policy's last choice (not a probe) drafted */
    /* one step */
    spec_feed *feeds;   /* [max_seqs] */
    int32_t *feed_of;   /* [max_seqs] index into feeds, -1: none */
    spec_tree *trees;   /* [max_seqs] */
    engine_item *items; /* [max_seqs] */
    int32_t *rows;      /* [max_batch_tokens] capture rows: every token */
    float *features;    /* [max_batch_tokens][fw] */
    float *logits;      /* [max_batch_tokens][V] */
    int32_t *ids;       /* [max_batch_tokens] each row's token, decided where the pass ran */
    kn_draw *draws;     /* [max_batch_tokens] how each row draws it (engine_step's draws) */
    float *scratch;     /* [V]: a row penalised (penalty_apply) and masked */
    uint32_t *mask;     /* [(V + 31) / 32]: a grammar's mask (grammar_fill_mask) */
    sample_state *sampler;
};

static int64_t now_ns(const spec *s) { return s->cfg.clock_ns ? s->cfg.clock_ns(s->cfg.clock_ctx) : clock_mono_ns(); }

static bool shape_ok(const spec_shape *sh) {
    return sh->steps >= 1 && sh->topk >= 1 && sh->tokens >= 2 && sh->tokens <= ENGINE_MAX_TREE;
}

double spec_stats_accept_len(const spec_stats *st) {
    return st->steps > 0 ? (double)(st->accepted + st->steps) / (double)st->steps : 0.0;
}

size_t spec_bytes(const model *m, const spec_config *c) {
    size_t fw = (size_t)c->n_capture * (size_t)m->cfg.hidden, S = (size_t)c->max_seqs, T = (size_t)c->max_batch_tokens;
    return S * (sizeof(seq_state) + sizeof(spec_feed) + sizeof(int32_t) + sizeof(spec_tree) + sizeof(engine_item)) +
           S * ENGINE_MAX_TREE * fw * sizeof(float) + 2 * T * sizeof(int32_t);
}

void spec_free(spec *s) {
    if (!s) return;
    free(s->seqs);
    free(s->pending_feat);
    free(s->feeds);
    free(s->feed_of);
    free(s->trees);
    free(s->items);
    free(s->rows);
    free(s->features);
    free(s->logits);
    free(s->ids);
    free(s->draws);
    free(s->scratch);
    free(s->mask);
    sample_free(s->sampler);
    policy_free(s->pol);
    free(s);
}

spec_config spec_config_default(spec_shape shape, int32_t max_seqs, int32_t max_batch_tokens) {
    return (spec_config){.n_capture = FORWARD_MAX_CAPTURE,
                         .shape = shape,
                         .max_seqs = max_seqs,
                         .max_batch_tokens = max_batch_tokens,
                         .adaptive = false,
                         .clock_ns = NULL,
                         .clock_ctx = NULL};
}

int spec_init(spec **out, engine *e, const spec_drafter *d, const spec_config *cfg, ae_error *err) {
    *out = NULL;
    const model *m = engine_model(e);
    const engine_config *ec = engine_get_config(e);
    if (cfg->n_capture != FORWARD_MAX_CAPTURE)
        return err_set(err, "speculation: %d capture layers, EAGLE-3 takes %d", cfg->n_capture, FORWARD_MAX_CAPTURE);
    if (cfg->max_seqs != ec->max_seqs || cfg->max_batch_tokens != ec->max_batch_tokens)
        return err_set(err, "speculation: sizes differ from the engine's");
    if (cfg->max_batch_tokens < cfg->max_seqs)
        return err_set(err, "speculation: %d batch tokens cannot hold a root for each of %d sequences",
                       cfg->max_batch_tokens, cfg->max_seqs);
    if (!shape_ok(&cfg->shape))
        return err_set(err, "speculation: tree of %d steps, top-%d, %d nodes (need >= 1, >= 1, 2..%d)",
                       cfg->shape.steps, cfg->shape.topk, cfg->shape.tokens, ENGINE_MAX_TREE);
    spec *s = calloc(1, sizeof *s);
    if (!s) return err_set(err, "out of memory");
    s->e = e;
    s->d = d;
    s->cfg = *cfg;
    s->H = m->cfg.hidden;
    s->V = m->cfg.vocab;
    s->fw = cfg->n_capture * s->H;
    size_t S = (size_t)cfg->max_seqs, T = (size_t)cfg->max_batch_tokens, fw = (size_t)s->fw, V = (size_t)s->V;
    s->seqs = calloc(S, sizeof *s->seqs);
    s->pending_feat = malloc(S * ENGINE_MAX_TREE * fw * sizeof(float));
    s->feeds = calloc(S, sizeof *s->feeds);
    s->feed_of = calloc(S, sizeof *s->feed_of);
    s->trees = calloc(S, sizeof *s->trees);
    s->items = calloc(S, sizeof *s->items);
    s->rows = malloc(T * sizeof *s->rows);
    s->features = malloc(T * fw * sizeof(float));
    s->logits = malloc(T * V * sizeof(float));
    s->ids = malloc(T * sizeof *s->ids);
    s->draws = malloc(T * sizeof *s->draws);
    s->scratch = malloc(V * sizeof(float));
    s->mask = malloc((V + 31) / 32 * sizeof(uint32_t));
    if (!s->seqs || !s->pending_feat || !s->feeds || !s->feed_of || !s->trees || !s->items || !s->rows ||
        !s->features || !s->logits || !s->ids || !s->draws || !s->scratch || !s->mask) {
        spec_free(s);
        return err_set(err, "speculation: out of memory");
    }
    if (sample_init(&s->sampler, s->V, err) != AE_OK) {
        spec_free(s);
        return AE_ERR;
    }
    for (size_t t = 0; t < T; t++) s->rows[t] = (int32_t)t;
    policy_config pc = {cfg->shape, cfg->adaptive};
    if (d && policy_init(&s->pol, &pc, err) != AE_OK) {
        spec_free(s);
        return AE_ERR;
    }
    *out = s;
    return AE_OK;
}

void spec_set_shape(spec *s, const spec_shape *shape) {
    AE_ASSERT(shape_ok(shape));
    s->cfg.shape = *shape;
    if (s->pol) policy_reset(s->pol, &(policy_config){*shape, s->cfg.adaptive});
}

void spec_policy_report(const spec *s, int32_t n, policy_report *r) {
    if (s->pol)
        policy_get_report(s->pol, n, r);
    else
        memset(r, 0, sizeof *r);
}

const spec_stats *spec_seq_stats(const spec *s, int32_t seq) {
    AE_ASSERT(seq >= 0 && seq < s->cfg.max_seqs);
    return &s->seqs[seq].stats;
}
const spec_stats *spec_total_stats(const spec *s) { return &s->total; }

static float *pending_features(spec *s, int32_t seq) {
    return s->pending_feat + (size_t)seq * ENGINE_MAX_TREE * (size_t)s->fw;
}

static forward_capture capture_all(spec *s, int32_t n_rows) {
    forward_capture c = {s->cfg.n_capture, {0}, n_rows, s->rows, s->features};
    memcpy(c.layers, s->cfg.capture, sizeof c.layers);
    return c;
}

int spec_seq_prefill(spec *s, int32_t seq, const int32_t *prompt, int32_t n, int32_t chunk, int32_t *done,
                     bool always_feed, ae_error *err) {
    if (seq < 0 || seq >= s->cfg.max_seqs) return err_set(err, "sequence %d is out of range", seq);
    if (n < 1) return err_set(err, "the prompt has no tokens");
    if (chunk < 1 || chunk > s->cfg.max_batch_tokens) chunk = s->cfg.max_batch_tokens;
    seq_state *st = &s->seqs[seq];
    if (*done == 0) {
        if (engine_seq_len(s->e, seq) != 0) return err_set(err, "sequence %d is not a fresh engine sequence", seq);
        for (int32_t i = 0; i < n; i++)
            if (prompt[i] < 0 || prompt[i] >= s->V) return err_set(err, "token %d is not in the vocabulary", prompt[i]);
        *st = (seq_state){.started = true, .root = prompt[n - 1]};
    } else if (!st->started || engine_seq_len(s->e, seq) != *done || *done > n - 1) {
        return err_set(err, "sequence %d: prefill resumed at %d, the engine holds %d", seq, *done,
                       engine_seq_len(s->e, seq));
    }
    if (*done == n - 1) return AE_OK;
    int32_t at = *done, k = n - 1 - at < chunk ? n - 1 - at : chunk;
    engine_item it = {seq, ENGINE_APPEND, k, prompt + at, NULL, false};
    forward_capture cap = capture_all(s, k);
    /* While the policy runs the batch size of the last step plainly and
     * no tree comes near paying, a prompt is not sent to the drafter: that
     * work would be wasted, and the sequence is reset from its recent
     * pairs when drafting comes back (policy_keep_drafter). */
    bool feed = s->d && !st->resync && s->step_no >= s->retry_at &&
                (always_feed || policy_keep_drafter(s->pol, s->last_n > 0 ? s->last_n : 1));
    engine_outputs eo = {.logits = s->logits, .capture = feed ? &cap : NULL};
    if (engine_step(s->e, &it, 1, &eo, err) != AE_OK) {
        if (at == 0) st->started = false;
        return AE_ERR;
    }
    if (feed) {
        /* Pair j: the feature at j with the token at j + 1. */
        spec_feed f = {seq, at == 0, st->held, k, prompt + at + 1, s->features, false, false, 0};
        ae_error derr = {{0}};
        spec_tree none;
        none.n = 0;
        int64_t t0 = now_ns(s);
        int rc = s->d->propose(s->d->ctx, &f, 1, &s->cfg.shape, &none, &derr);
        int64_t ns = now_ns(s) - t0;
        s->total.feed_ns += ns;
        if (s->pol) policy_observe_feed(s->pol, s->last_n > 0 ? s->last_n : 1, ns);
        if (rc == AE_OK && none.n != SPEC_STATE_GONE) {
            st->held += k;
            st->fed = true;
        } else {
            /* The first step resets it with what it has by then. */
            st->resync = true;
            if (none.n == SPEC_STATE_GONE)
                s->total.state_gone++; /* (none.n is set only on success) */
            else
                s->total.draft_failures++;
        }
    } else if (s->d) {
        st->resync = true; /* pairs skipped: the drafter starts over from the window */
    }
    *done = at + k;
    return AE_OK;
}

int spec_seq_start(spec *s, int32_t seq, const int32_t *prompt, int32_t n, int32_t chunk, ae_error *err) {
    int32_t done = 0;
    do {
        if (spec_seq_prefill(s, seq, prompt, n, chunk, &done, true, err) != AE_OK) return AE_ERR;
    } while (done < n - 1);
    /* A one-token prompt gives the drafter nothing to start from: the
     * first step is plain and feeds it then. */
    return AE_OK;
}

int spec_seq_fork(spec *s, int32_t src, int32_t dst, ae_error *err) {
    if (src < 0 || src >= s->cfg.max_seqs || !s->seqs[src].started)
        return err_set(err, "sequence %d was not started", src);
    if (dst < 0 || dst >= s->cfg.max_seqs || dst == src || s->seqs[dst].started)
        return err_set(err, "sequence %d cannot be a fork of %d", dst, src);
    if (engine_seq_len(s->e, dst) != engine_seq_len(s->e, src))
        return err_set(err, "sequence %d holds %d tokens, its source %d holds %d", dst, engine_seq_len(s->e, dst), src,
                       engine_seq_len(s->e, src));
    seq_state *a = &s->seqs[src], *b = &s->seqs[dst];
    *b = *a;
    b->stats = (spec_stats){0};
    memcpy(pending_features(s, dst), pending_features(s, src), (size_t)a->n_pending * (size_t)s->fw * sizeof(float));
    /* A source the drafter is in step with is copied there; else the
     * fork is reset there like its source would be. */
    if (s->d && a->fed && !a->resync && !a->fork) {
        b->fork = true;
        b->fork_of = src;
    }
    return AE_OK;
}

void spec_seq_end(spec *s, int32_t seq) {
    if (seq < 0 || seq >= s->cfg.max_seqs || !s->seqs[seq].started) return;
    if (s->d && s->d->release) s->d->release(s->d->ctx, seq);
    s->seqs[seq].started = false;
}

/* A tree from the drafter is input from outside: checked like it. */
static bool tree_ok(const spec *s, const spec_tree *t, int32_t root, int32_t max_nodes) {
    if (t->n < 1 || t->n > max_nodes || t->tokens[0] != root || t->parents[0] != -1) return false;
    for (int32_t i = 1; i < t->n; i++)
        if (t->parents[i] < 0 || t->parents[i] >= i || t->tokens[i] < 0 || t->tokens[i] >= s->V) return false;
    return true;
}

/* Asks the drafter for trees of `shape` (none when it is plain); on a
 * failure every tree is empty, the sequences are marked for a reset, and
 * calls pause (spec.h). Returns whether the call's time measures the
 * shape: it was made, it succeeded, no sequence was reset (a reset feeds
 * a window of pairs) and some tree came back. */
static bool propose(spec *s, const spec_in *in, int32_t n, const spec_shape *shape) {
    int32_t nf = 0;
    for (int32_t i = 0; i < n; i++) {
        s->trees[i].n = 0;
        s->feed_of[i] = -1;
    }
    if (!s->d || s->step_no < s->retry_at || shape->tokens < 2) return false;
    bool timed = true;
    for (int32_t i = 0; i < n; i++) {
        seq_state *st = &s->seqs[in[i].seq];
        bool reset = !st->fed || st->resync;
        timed &= !reset;
        s->feed_of[i] = nf;
        s->feeds[nf++] = (spec_feed){in[i].seq,
                                     reset,
                                     reset ? 0 : st->held,
                                     st->n_pending,
                                     st->pending_tokens,
                                     pending_features(s, in[i].seq),
                                     true,
                                     st->fork && !reset,
                                     st->fork_of};
    }
    ae_error derr = {{0}};
    /* trees is indexed by feed here, then spread to the sequences. */
    int rc = s->d->propose(s->d->ctx, s->feeds, nf, shape, s->trees, &derr);
    if (rc != AE_OK) {
        for (int32_t i = 0; i < n; i++) {
            s->trees[i].n = 0;
            s->seqs[in[i].seq].resync = true;
        }
        s->total.draft_failures++;
        if (rc == SPEC_DRAFT_DOWN) {
            s->retry_at = s->step_no + 2;
            return false;
        }
        s->failures++;
        int32_t pause = s->failures < 7 ? 1 << (s->failures - 1) : SPEC_MAX_PAUSE;
        s->retry_at = s->step_no + 1 + pause;
        return false;
    }
    s->failures = 0;
    bool any = false;
    for (int32_t i = n - 1; i >= 0; i--) {
        int32_t f = s->feed_of[i];
        seq_state *st = &s->seqs[in[i].seq];
        if (s->trees[f].n == SPEC_STATE_GONE) {
            /* Keep the pending pairs: the reset next step sends them. */
            st->resync = true;
            s->total.state_gone++;
            s->trees[i].n = 0;
            timed = false;
            continue;
        }
        st->held = s->feeds[f].start + st->n_pending;
        st->n_pending = 0;
        st->fed = true;
        st->resync = false;
        st->fork = false;
        if (f != i) s->trees[i] = s->trees[f];
        any |= s->trees[i].n > 1;
    }
    return timed && any;
}

/* Keeps pair (features of batch row `row`, token next) for the drafter's
 * next call; when the window is full the oldest pair goes, and the
 * drafter will be reset with the window. */
static void push_pending(spec *s, seq_state *st, int32_t seq, int32_t row, int32_t next) {
    float *pf = pending_features(s, seq);
    size_t fw = (size_t)s->fw;
    if (st->n_pending == ENGINE_MAX_TREE) {
        memmove(pf, pf + fw, (ENGINE_MAX_TREE - 1) * fw * sizeof(float));
        memmove(st->pending_tokens, st->pending_tokens + 1, (ENGINE_MAX_TREE - 1) * sizeof(int32_t));
        st->n_pending--;
        st->resync = true;
    }
    memcpy(pf + (size_t)st->n_pending * fw, s->features + (size_t)row * fw, fw * sizeof(float));
    st->pending_tokens[st->n_pending++] = next;
}

/* After a plain step: sends the pending pairs of sequences with
 * SPEC_FEED_AT of them to the drafter, without asking for trees, while the
 * policy keeps it in step (policy_keep_drafter), so the window never
 * overflows into a reset. Not timed as the step's: the policy compares
 * what steps of each shape cost, and this is one draft pass per
 * SPEC_FEED_AT plain steps. A failure or a drafter that lost the state
 * marks the sequence for a reset, as in propose. The policy is told what
 * feeding costs (policy_observe_feed): where it is dear against the plain
 * steps it stops keeping the drafter in step. */
static void feed_plain(spec *s, const spec_in *in, int32_t n) {
    if (!s->d || s->step_no < s->retry_at || !policy_keep_drafter(s->pol, n)) return;
    int32_t nf = 0;
    for (int32_t i = 0; i < n; i++) {
        seq_state *st = &s->seqs[in[i].seq];
        if (!st->fed || st->resync || st->n_pending < SPEC_FEED_AT) continue;
        s->feeds[nf++] = (spec_feed){
            in[i].seq, false,    st->held,   st->n_pending, st->pending_tokens, pending_features(s, in[i].seq),
            false,     st->fork, st->fork_of};
    }
    if (nf == 0) return;
    ae_error derr = {{0}};
    int64_t t0 = now_ns(s);
    int rc = s->d->propose(s->d->ctx, s->feeds, nf, &s->cfg.shape, s->trees, &derr);
    int64_t ns = now_ns(s) - t0;
    s->total.feed_ns += ns;
    policy_observe_feed(s->pol, n, ns);
    if (rc != AE_OK) {
        for (int32_t k = 0; k < nf; k++) s->seqs[s->feeds[k].seq].resync = true;
        s->total.draft_failures++;
        return;
    }
    for (int32_t k = 0; k < nf; k++) {
        seq_state *st = &s->seqs[s->feeds[k].seq];
        if (s->trees[k].n == SPEC_STATE_GONE) {
            st->resync = true;
            s->total.state_gone++;
            continue;
        }
        st->held = s->feeds[k].start + st->n_pending;
        st->n_pending = 0;
        st->fork = false;
    }
}

/* verify_proc over a sequence's rules: its penalties (penalty.h), then
 * its grammar's mask (grammar.h). */
typedef struct rules_proc {
    penalty *pen;
    grammar_matcher *gm;
    float *scratch;
    uint32_t *mask;
    int32_t V;
    bool refused;
} rules_proc;

static const float *rules_apply(void *ctx, const float *row) {
    rules_proc *rp = ctx;
    const float *r = rp->pen ? penalty_apply(rp->pen, row, rp->scratch) : row;
    /* Past the value's end (eos taken) nothing is masked: the scheduler
     * ends the choice at that eos. */
    if (!rp->gm || grammar_terminated(rp->gm)) return r;
    grammar_fill_mask(rp->gm, rp->mask);
    for (int pass = 0; pass < 2; pass++) {
        /* The second pass drops the penalties: min_tokens can hold back
         * the end of sequence when a complete value allows nothing else.
         * The grammar wins (the output must be valid). */
        const float *from = pass ? row : r;
        if (from != rp->scratch) memcpy(rp->scratch, from, (size_t)rp->V * sizeof(float));
        bool any = false;
        for (int32_t w = 0; w < (rp->V + 31) / 32; w++) {
            uint32_t m = rp->mask[w];
            for (int32_t b = 0; b < 32 && w * 32 + b < rp->V; b++) {
                float *x = &rp->scratch[w * 32 + b];
                if (!(m >> b & 1))
                    *x = -INFINITY;
                else
                    any |= *x > -INFINITY;
            }
        }
        if (any || !rp->pen) break;
    }
    return rp->scratch;
}

static void rules_push(void *ctx, int32_t token) {
    rules_proc *rp = ctx;
    if (rp->pen) penalty_push(rp->pen, token);
    if (rp->gm && !rp->refused && !grammar_terminated(rp->gm) && !grammar_accept(rp->gm, token)) rp->refused = true;
}

int spec_step(spec *s, const spec_in *in, int32_t n, spec_out *out, ae_error *err) {
    if (n < 1 || n > s->cfg.max_seqs) return err_set(err, "step of %d sequences (1..%d)", n, s->cfg.max_seqs);
    const engine_config *ec = engine_get_config(s->e);
    for (int32_t i = 0; i < n; i++) {
        int32_t seq = in[i].seq;
        if (seq < 0 || seq >= s->cfg.max_seqs || !s->seqs[seq].started)
            return err_set(err, "item %d: sequence %d was not started", i, seq);
        for (int32_t j = 0; j < i; j++)
            if (in[j].seq == seq) return err_set(err, "item %d: sequence %d appears twice", i, seq);
        if (engine_seq_len(s->e, seq) >= ec->max_seq_len)
            return err_set(err, "item %d: sequence %d is at max-seq-len %d", i, seq, ec->max_seq_len);
        if (in[i].top_logprobs < 0 || in[i].top_logprobs > SAMPLE_MAX_TOP_LOGPROBS || in[i].top_logprobs > s->V)
            return err_set(err, "item %d: %d top log-probabilities (0..%d)", i, in[i].top_logprobs,
                           SAMPLE_MAX_TOP_LOGPROBS);
    }
    /* The step's tree: the policy's, or the configured one without it. */
    spec_shape shape = s->cfg.shape;
    bool explore = false;
    if (s->pol) {
        policy_pick pk = policy_choose(s->pol, n);
        shape = pk.shape, explore = pk.explore;
    }
    int64_t t0 = now_ns(s);
    s->last_n = n;
    bool timed = propose(s, in, n, &shape);
    int64_t t1 = now_ns(s);
    s->step_no++;
    int32_t T = 0;
    for (int32_t i = 0; i < n; i++) {
        seq_state *st = &s->seqs[in[i].seq];
        spec_tree *t = &s->trees[i];
        if (t->n != 0 && !tree_ok(s, t, st->root, shape.tokens)) {
            st->stats.bad_trees++;
            s->total.bad_trees++;
            t->n = 0;
        }
        if (t->n == 0) *t = (spec_tree){.n = 1, .tokens = {st->root}, .parents = {-1}, .probs = {1.0f}};
        /* Room in the sequence and in the pass; a prefix of a tree is a
         * tree (parents come first). Every sequence keeps its root. */
        int32_t room = ec->max_seq_len - engine_seq_len(s->e, in[i].seq),
                left = s->cfg.max_batch_tokens - T - (n - 1 - i);
        if (t->n > room) t->n = room;
        if (t->n > left) t->n = left;
        s->items[i] = (engine_item){in[i].seq, ENGINE_TREE, t->n, t->tokens, t->parents, false};
        T += t->n;
    }
    forward_capture cap = capture_all(s, T);
    /* With nothing that reads a whole row (penalties, a grammar,
     * log-probabilities), each row's token is decided where the pass ran
     * and only the ids come back: its argmax when greedy throughout, or
     * on a backend that draws (a device), its keyed draw at the node's
     * position (the root's + 1 + its depth, as verify_sample walks). */
    bool ids_only = true, greedy = true;
    for (int32_t i = 0; i < n && ids_only; i++) {
        ids_only = !in[i].pen && !in[i].gm && !in[i].logprobs;
        greedy = greedy && sample_is_greedy(in[i].params);
        if (!sample_is_greedy(in[i].params))
            ids_only = ids_only && engine_can_sample(s->e) && sample_on_device(in[i].params);
    }
    bool drawn = ids_only && !greedy;
    for (int32_t i = 0, row = 0; drawn && i < n; row += s->trees[i].n, i++) {
        const spec_tree *t = &s->trees[i];
        int32_t pos = engine_seq_len(s->e, in[i].seq) + 1, depth[ENGINE_MAX_TREE];
        for (int32_t j = 0; j < t->n; j++) {
            depth[j] = t->parents[j] < 0 ? 0 : depth[t->parents[j]] + 1;
            s->draws[row + j] = sample_draw(in[i].params, in[i].rng, pos + depth[j]);
        }
    }
    engine_outputs eo = {s->logits, ids_only ? s->ids : NULL, drawn ? s->draws : NULL, s->d ? &cap : NULL};
    if (engine_step(s->e, s->items, n, &eo, err) != AE_OK) return AE_ERR;

    for (int32_t i = 0, row = 0; i < n; row += s->trees[i].n, i++) {
        int32_t seq = in[i].seq;
        seq_state *st = &s->seqs[seq];
        const spec_tree *t = &s->trees[i];
        const float *rows = s->logits + (size_t)row * (size_t)s->V;
        rules_proc rp = {in[i].pen, in[i].gm, s->scratch, s->mask, s->V, false};
        verify_proc proc = {&rp, rules_apply, rules_push};
        verify_tree vt = {t->n,
                          t->tokens,
                          t->parents,
                          rows,
                          s->V,
                          in[i].pen || in[i].gm ? &proc : NULL,
                          ids_only ? s->ids + row : NULL};
        int32_t path[ENGINE_MAX_TREE], bonus;
        /* The root's KV is not written yet: it sits at the sequence's
         * length, and the first token decided at the next position. */
        int32_t pos = engine_seq_len(s->e, seq) + 1;
        int32_t n_path = verify_sample(&vt, s->sampler, in[i].params, in[i].rng, pos, path, &bonus);
        AE_ASSERT(engine_commit_path(s->e, seq, path, n_path, NULL) == AE_OK);
        if (s->pol && t->n > 1) policy_observe_tree(s->pol, t->parents, t->n, path, n_path);
        spec_out *o = &out[i];
        o->n = 0;
        o->drafted = t->n - 1;
        o->refused = rp.refused;
        o->n_top = in[i].logprobs ? in[i].top_logprobs : 0;
        for (int32_t j = 0; j < n_path; j++) {
            int32_t next = j + 1 < n_path ? t->tokens[path[j + 1]] : bonus;
            if (in[i].logprobs)
                o->logprob[o->n] =
                    sample_logprobs(rows + (size_t)path[j] * (size_t)s->V, s->V, next, o->n_top, o->top[o->n]);
            o->tokens[o->n++] = next;
            if (s->d) push_pending(s, st, seq, row + path[j], next);
        }
        st->root = bonus;
        spec_stats *ss[2] = {&st->stats, &s->total};
        for (int k = 0; k < 2; k++) {
            if (t->n > 1) {
                ss[k]->steps++;
                ss[k]->drafted += t->n - 1;
                ss[k]->accepted += n_path - 1;
                for (int32_t dpt = 1; dpt < n_path; dpt++) ss[k]->accepted_at[dpt - 1]++;
            } else {
                ss[k]->plain_steps++;
            }
            ss[k]->emitted += n_path;
        }
    }
    int64_t t2 = now_ns(s);
    s->total.draft_ns += t1 - t0;
    s->total.verify_ns += t2 - t1;
    if (s->pol) {
        policy_observe_step(s->pol, n, &shape, T, shape.tokens < 2 ? 0 : timed ? t1 - t0 : -1, t2 - t1);
        if (explore) {
            s->total.explore_steps++;
            s->total.explore_ns += t2 - t0;
        }
        if (shape.tokens < 2 && s->cfg.adaptive) s->total.adapt_plain_steps++;
        if (!explore) {
            if (s->was_drafting && shape.tokens < 2) s->total.adapt_off++;
            s->was_drafting = shape.tokens >= 2;
        }
    }
    if (shape.tokens < 2) feed_plain(s, in, n);
    return AE_OK;
}
