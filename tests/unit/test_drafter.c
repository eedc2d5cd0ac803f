/* The drafter's batched trees against a reference that runs the head one
 * token at a time: every node's probability must be what the head gives
 * after the sequence's pairs and the node's ancestors, fed back one by one
 * at their positions. This pins positions, scratch KV slots, and the
 * parent rows whose hidden states the next depth reads, for several keys
 * at once, feeds split into chunks, and a second call. Also: what the
 * drafter refuses. Run from the repo root. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../../draft/drafter.h"
#include "../../services/kv/kv.h"
#include "../../target/engine.h"

#define FIX "tests/golden/eagle/tiny"

typedef struct ref {
    const eagle_head *h;
    kv_cache *kv;
    kn_kv_pool layer;
    pool *p;
    kn_stream *s;
    eagle_ws *ws;
} ref;

static void ref_close(ref *r) {
    eagle_ws_free(r->ws);
    kn_stream_free(r->s);
    pool_free(r->p);
    kv_free(r->kv);
}

static void ref_open(ref *r, const eagle_head *h) {
    ae_error err = {0};
    r->h = h;
    kv_params kp = {1, h->cfg.n_kv_heads, h->cfg.head_dim, 16, 16, 1, 16, false};
    assert_int_equal(kv_init(&r->kv, &kn_backend_cpu, &kp, &err), AE_OK);
    r->layer = kv_layer(r->kv, 0);
    assert_int_equal(pool_init(&r->p, 1, &err), AE_OK);
    assert_int_equal(
        kn_stream_init(&r->s, &kn_backend_cpu, &(kn_stream_config){r->p, eagle_stream_workspace(h, 1, 256)}, &err),
        AE_OK);
    assert_int_equal(eagle_ws_init(&r->ws, h, 1, &err), AE_OK);
}

/* Distribution (draft vocab) after pairs[0..L) then path tokens[0..d). */
static void ref_dist(ref *r, int32_t L, const int32_t *toks, const float *feats, int32_t d, const int32_t *path,
                     float *probs) {
    const eagle_head *h = r->h;
    int32_t H = h->cfg.hidden, Vd = h->cfg.draft_vocab;
    ae_error err = {0};
    int32_t seq;
    assert_int_equal(kv_seq_alloc(r->kv, &seq, &err), AE_OK);
    assert_int_equal(kv_seq_reserve(r->kv, seq, L + d, &err), AE_OK);
    float in[96], hid[32];
    int32_t zero = 0, row = 0;
    for (int32_t t = 0; t < L + d; t++) {
        int32_t tok = t < L ? toks[t] : path[t - L], pos = t, slot = t, np = t + 1;
        int32_t width = t < L ? 3 * H : H;
        if (t < L)
            memcpy(in, feats + (size_t)t * 3 * H, sizeof(float) * 3 * (size_t)H);
        else
            memcpy(in, hid, sizeof(float) * (size_t)H);
        kn_kv_map map = {1, kv_map_tables(r->kv), 1, 16, &seq, &slot, &np, &zero, &zero, &zero, 0, np};
        eagle_batch b = {1, &tok, in, width, &pos, &map, hid, 1, &row, probs};
        eagle_forward(h, r->s, &r->layer, r->ws, &b);
    }
    kn_softmax(r->s, probs, 1, Vd);
    kv_seq_free(r->kv, seq);
}

static int32_t draft_id(const eagle_head *h, int32_t target) {
    for (int32_t i = 0; i < h->cfg.draft_vocab; i++)
        if (h->draft_to_target[i] == target) return i;
    return -1;
}

#define NK 3
#define MAXL 64

static void check_tree(ref *r, const tree_out *t, int32_t L, const int32_t *toks, const float *feats, const char *what,
                       double *worst) {
    const eagle_head *h = r->h;
    assert_true(t->n >= 2);
    assert_int_equal(t->tokens[0], toks[L - 1]);
    float probs[64];
    for (int32_t i = 1; i < t->n; i++) {
        int32_t path[32], d = 0;
        for (int32_t a = t->parents[i]; a > 0; a = t->parents[a]) path[d++] = t->tokens[a];
        for (int32_t x = 0; x < d / 2; x++) {
            int32_t tmp = path[x];
            path[x] = path[d - 1 - x];
            path[d - 1 - x] = tmp;
        }
        ref_dist(r, L, toks, feats, d, path, probs);
        int32_t id = draft_id(h, t->tokens[i]);
        assert_true(id >= 0);
        double diff = fabs((double)probs[id] - t->probs[i]);
        if (diff > *worst) *worst = diff;
        if (diff > 1e-5) fail_msg("%s: node %d (depth %d) p %g, reference %g", what, i, d + 1, t->probs[i], probs[id]);
    }
}

/* The fixture's target and its head. */
static void load_fixture(model **m, eagle_head **h) {
    ae_error err = {0};
    if (model_load(m, FIX "/target", &kn_backend_cpu, &err) != AE_OK) fail_msg("%s", err.msg);
    eagle_target tg = {(*m)->cfg.hidden, (*m)->cfg.vocab, (*m)->cfg.n_layers, &(*m)->tok_embd};
    if (eagle_load(h, FIX "/head", &tg, EAGLE_WEIGHTS_FILE, &err) != AE_OK) fail_msg("%s", err.msg);
}

static void test_trees_match_sequential_reference(void **state) {
    (void)state;
    ae_error err = {0};
    model *m;
    eagle_head *h;
    load_fixture(&m, &h);
    drafter *d;
    drafter_config dc = {NK, MAXL, 5, 2, NULL, 0};
    assert_int_equal(drafter_init(&d, h, &dc, &err), AE_OK);
    ref r;
    ref_open(&r, h);
    int32_t H = h->cfg.hidden;
    static int32_t toks[NK][MAXL];
    static float feats[NK][MAXL * 96];
    uint64_t x = 12345;
    for (int k = 0; k < NK; k++)
        for (int j = 0; j < MAXL; j++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            toks[k][j] = (int32_t)(x % 32);
            for (int c = 0; c < 3 * H; c++) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                feats[k][j * 3 * H + c] = (float)((double)(x % 20000) / 10000.0 - 1.0);
            }
        }
    int32_t lens[NK] = {1, 12, 7};
    tree_params shapes[4] = {{4, 3, 20}, {1, 8, 9}, {6, 2, 12}, {16, 8, 64}};
    double worst = 0;
    for (int sh = 0; sh < 4; sh++) {
        int32_t have[NK] = {0};
        /* call 1: reset all, feed lens */
        drafter_feed f[NK];
        tree_out trees[NK];
        for (int k = 0; k < NK; k++) f[k] = (drafter_feed){k, true, 0, lens[k], toks[k], feats[k], true, -1};
        if (drafter_propose(d, f, NK, &shapes[sh], trees, &err) != AE_OK) fail_msg("%s", err.msg);
        for (int k = 0; k < NK; k++) {
            have[k] = lens[k];
            char what[64];
            snprintf(what, sizeof what, "shape %d call 1 key %d", sh, k);
            check_tree(&r, &trees[k], have[k], toks[k], feats[k], what, &worst);
        }
        /* call 2: more pairs for some, none for others; one key twice */
        int32_t add[NK] = {0, 9, 3};
        for (int k = 0; k < NK; k++)
            f[k] = (drafter_feed){k,    false, have[k], add[k], toks[k] + have[k], feats[k] + (size_t)have[k] * 3 * H,
                                  true, -1};
        if (drafter_propose(d, f, NK, &shapes[sh], trees, &err) != AE_OK) fail_msg("%s", err.msg);
        for (int k = 0; k < NK; k++) {
            have[k] += add[k];
            char what[64];
            snprintf(what, sizeof what, "shape %d call 2 key %d", sh, k);
            check_tree(&r, &trees[k], have[k], toks[k], feats[k], what, &worst);
            assert_int_equal(drafter_len(d, k), have[k]);
        }
    }
    printf("worst |p - reference| %.3g\n", worst);
    ref_close(&r);
    drafter_free(d);
    eagle_free(h);
    model_free(m);
}

/* Feeds that cannot be right fail the call, naming the feed, and change
 * nothing: a key out of range, a start that is not what the key holds (a
 * restarted drafter), a token outside the target's vocabulary. */
static void test_bad_feeds_are_refused_and_change_nothing(void **state) {
    (void)state;
    ae_error err = {0};
    model *m;
    eagle_head *h;
    load_fixture(&m, &h);
    drafter *d;
    drafter_config dc = {2, MAXL, 8, 1, NULL, 0};
    assert_int_equal(drafter_init(&d, h, &dc, &err), AE_OK);
    static float feats[4 * 96];
    int32_t toks[4] = {1, 2, 3, 4}, bad[4] = {1, 2, 32, 4};
    tree_params p = {2, 2, 4};
    tree_out trees[2];
    drafter_feed ok = {0, true, 0, 4, toks, feats, true, -1};
    assert_int_equal(drafter_propose(d, &ok, 1, &p, trees, &err), AE_OK);
    assert_int_equal(drafter_len(d, 0), 4);
    assert_int_equal(trees[0].n, 4);
    const struct {
        drafter_feed f;
        const char *msg;
    } cases[] = {
        {{2, true, 0, 4, toks, feats, true, -1}, "feed 1: key 2 is outside 0..1"},
        {{1, false, 3, 4, toks, feats, true, -1}, "feed 1: key 1 holds 0 pairs, the caller assumes 3"},
        {{1, true, 0, 4, bad, feats, true, -1}, "feed 1: token 32 is not in the target's vocabulary"},
        {{0, false, 4, 4, toks, feats, true, -1}, "feed 1: key 0 appears twice"},
        {{1, false, 3, 0, toks, feats, true, 0},
         "feed 1: key 1 forks key 0, which holds 4 pairs, the caller assumes 3"},
        {{1, true, 0, 0, toks, feats, true, 0}, "feed 1: key 1 forks key 0 and resets"},
        {{1, false, 4, 0, toks, feats, true, 1}, "feed 1: key 1 forks key 1"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        drafter_feed two[2] = {{0, false, 4, 4, toks, feats, true, -1}, cases[i].f};
        err = (ae_error){{0}};
        assert_int_equal(drafter_propose(d, two, 2, &p, trees, &err), AE_ERR);
        assert_string_equal(err.msg, cases[i].msg);
        assert_int_equal(drafter_len(d, 0), 4); /* the good feed was not taken either */
        assert_int_equal(drafter_len(d, 1), 0);
    }
    drafter_free(d);
    eagle_free(h);
    model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_trees_match_sequential_reference),
        cmocka_unit_test(test_bad_feeds_are_refused_and_change_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
