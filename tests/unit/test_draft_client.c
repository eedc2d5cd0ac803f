/* The target's draft client against a fake draft on a Unix socket: a
 * finished sequence's Release is sent without waiting for the draft's
 * answer (the scheduler thread calls it between steps, so a slow draft
 * must not stall every stream), and it still arrives; and Propose sends
 * features as f16, saturated to f16's range, each run padded so that the
 * next sequence's int32 tokens stay aligned. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "../../services/model/quant.h"
#include "../../services/rpc/msg.h"
#include "../../target/draft_client.h"
#include "aerie.pb.h"

#define RELEASE_DELAY_MS 300 /* the fake draft answers Release this late */
#define N_RELEASES 4

typedef struct fake_draft {
    /* the last Propose, as the fake saw it */
    int32_t feature_type, n_props, tok_off[4], feat_len[4];
    int32_t toks[8];
    float feats[32];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int32_t seqs[16]; /* the sequences Release named, in arrival order */
    int n_seqs;
    uint64_t client;
    pthread_t workers[16];
    int n_workers;
} fake_draft;

static int64_t mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Answers one Release after RELEASE_DELAY_MS, off the loop thread. */
static void *slow_release(void *arg) {
    rpc_call *k = arg;
    usleep(RELEASE_DELAY_MS * 1000);
    rpc_call_finish(k, RPC_OK, NULL, 0, NULL, 0);
    return NULL;
}

/* Records a Propose's features (widened) and tokens, and answers every
 * sequence with a root-only tree. */
static void fake_propose(fake_draft *f, rpc_call *call, const rpc_request *req) {
    static aerie_ProposeRequest r;
    static aerie_ProposeReply rep;
    if (msg_decode(aerie_ProposeRequest_fields, &r, req->msg, req->msg_len, NULL) != AE_OK) {
        rpc_call_fail(call, RPC_INVALID_ARGUMENT, "bad Propose");
        return;
    }
    f->feature_type = (int32_t)r.feature_type;
    f->n_props = (int32_t)r.seqs_count;
    int nt = 0, nf = 0;
    memset(&rep, 0, sizeof rep);
    for (pb_size_t i = 0; i < r.seqs_count && i < 4; i++) {
        const aerie_DraftSeq *q = &r.seqs[i];
        f->tok_off[i] = (int32_t)q->tokens.offset;
        f->feat_len[i] = (int32_t)q->features.length;
        for (uint32_t j = 0; j < q->pairs && nt < 8; j++)
            memcpy(&f->toks[nt++], req->payload + q->tokens.offset + 4 * j, 4);
        for (uint32_t j = 0; j < q->features.length / 2 && nf < 32; j++) {
            uint16_t h;
            memcpy(&h, req->payload + q->features.offset + 2 * j, 2);
            f->feats[nf++] = quant_f16_to_f32(h);
        }
        rep.trees[i] = (aerie_DraftTree){aerie_SeqStatus_SEQ_OK, 1, {f->toks[nt - 1]}, 1, {-1}, 1, {1.0f}};
    }
    rep.trees_count = r.seqs_count;
    uint8_t out[aerie_ProposeReply_size];
    uint32_t len;
    if (msg_encode(aerie_ProposeReply_fields, &rep, out, sizeof out, &len, NULL) != AE_OK) {
        rpc_call_fail(call, RPC_INTERNAL, "encode");
        return;
    }
    rpc_call_finish(call, RPC_OK, out, len, NULL, 0);
}

static void fake_handle(void *ctx, rpc_call *call, const rpc_request *req) {
    fake_draft *f = ctx;
    if (req->method == aerie_Method_DRAFT_PROPOSE) {
        fake_propose(f, call, req);
        return;
    }
    if (req->method != aerie_Method_DRAFT_RELEASE) {
        rpc_call_fail(call, RPC_UNIMPLEMENTED, "the fake draft answers Release only");
        return;
    }
    aerie_ReleaseRequest r;
    if (msg_decode(aerie_ReleaseRequest_fields, &r, req->msg, req->msg_len, NULL) != AE_OK) {
        rpc_call_fail(call, RPC_INVALID_ARGUMENT, "bad Release");
        return;
    }
    pthread_mutex_lock(&f->mu);
    for (pb_size_t i = 0; i < r.seqs_count && f->n_seqs < 16; i++) f->seqs[f->n_seqs++] = (int32_t)r.seqs[i];
    f->client = r.client;
    bool spawned = f->n_workers < 16 && pthread_create(&f->workers[f->n_workers], NULL, slow_release, call) == 0;
    if (spawned) f->n_workers++;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    if (!spawned) rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "the fake draft is busy");
}

static void test_release_does_not_wait_and_propose_sends_aligned_f16(void **state) {
    (void)state;
    fake_draft f = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    char addr[128];
    snprintf(addr, sizeof addr, "unix:build/test-dcli-%d.sock", (int)getpid());
    rpc_loop *loop;
    assert_int_equal(rpc_loop_start(&loop, NULL), AE_OK);
    rpc_server_config sc = {.addr = addr, .handler = fake_handle, .ctx = &f};
    rpc_server *srv;
    assert_int_equal(rpc_server_open(&srv, loop, &sc, NULL), AE_OK);
    draft_client_config dc = {.addr = addr, .deadline_us = 500000, .feature_width = 3 * 64, .vocab = 100};
    draft_client *d;
    assert_int_equal(draft_client_open(&d, loop, &dc, NULL), AE_OK);
    for (int i = 0; i < 200 && !draft_client_connected(d); i++) usleep(10000);
    assert_true(draft_client_connected(d));

    const spec_drafter *dr = draft_client_drafter(d);
    int64_t t0 = mono_ms();
    for (int32_t s = 0; s < N_RELEASES; s++) dr->release(dr->ctx, s);
    int64_t took = mono_ms() - t0;
    print_message("%d releases against a draft answering in %d ms returned after %lld ms\n", N_RELEASES,
                  RELEASE_DELAY_MS, (long long)took);
    /* Waiting for the answers would take N_RELEASES x RELEASE_DELAY_MS. */
    assert_true(took < RELEASE_DELAY_MS / 2);

    /* They all reach the draft, in order, naming this client. */
    pthread_mutex_lock(&f.mu);
    int64_t until = mono_ms() + 2000;
    while (f.n_seqs < N_RELEASES && mono_ms() < until) {
        pthread_mutex_unlock(&f.mu);
        usleep(5000);
        pthread_mutex_lock(&f.mu);
    }
    assert_int_equal(f.n_seqs, N_RELEASES);
    for (int32_t s = 0; s < N_RELEASES; s++) assert_int_equal(f.seqs[s], s);
    assert_true(f.client != 0);
    pthread_mutex_unlock(&f.mu);

    /* Propose: a feature width of 3, odd like no real model's (3 x an
     * even hidden), so that a run of one pair is 6 bytes of f16 and needs
     * padding before the next sequence's tokens. */
    const int32_t t0s[1] = {7}, t1s[2] = {8, 9};
    const float f0[3] = {0.5f, -2.0f, 1e5f}, f1[6] = {-1e6f, 0.1f, 3.0f, INFINITY, -0.0f, 65504.0f};
    spec_feed feeds[2] = {{0, true, 0, 1, t0s, f0, true, false, 0}, {1, true, 0, 2, t1s, f1, true, false, 0}};
    spec_tree trees[2];
    spec_shape shape = {2, 1, 3};
    ae_error err = {{0}};
    draft_client_config dc3 = {.addr = addr, .deadline_us = 500000, .feature_width = 3, .vocab = 100};
    draft_client *d3;
    assert_int_equal(draft_client_open(&d3, loop, &dc3, NULL), AE_OK);
    for (int i = 0; i < 200 && !draft_client_connected(d3); i++) usleep(10000);
    const spec_drafter *dr3 = draft_client_drafter(d3);
    if (dr3->propose(dr3->ctx, feeds, 2, &shape, trees, &err) != AE_OK) fail_msg("%s", err.msg);
    draft_client_close(d3);
    assert_int_equal(f.feature_type, aerie_FeatureType_FEATURES_F16);
    assert_int_equal(f.n_props, 2);
    assert_int_equal(f.feat_len[0], 6);
    assert_int_equal(f.feat_len[1], 12);
    assert_int_equal(f.tok_off[1] % 4, 0); /* after 4 + 6 bytes, 2 of padding */
    assert_int_equal(f.tok_off[1], 12);
    const int32_t want_toks[3] = {7, 8, 9};
    assert_memory_equal(f.toks, want_toks, sizeof want_toks);
    const float want[9] = {0.5f, -2.0f,    65504.0f, -65504.0f, quant_f16_to_f32(quant_f32_to_f16(0.1f)),
                           3.0f, 65504.0f, -0.0f,    65504.0f};
    assert_memory_equal(f.feats, want, sizeof want);
    assert_int_equal(trees[0].n, 1);
    assert_int_equal(trees[1].tokens[0], 9);

    /* Closing with answers still outstanding ends them cleanly. */
    draft_client_close(d);
    for (int i = 0; i < f.n_workers; i++) pthread_join(f.workers[i], NULL);
    rpc_server_close(srv);
    rpc_loop_free(loop);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_release_does_not_wait_and_propose_sends_aligned_f16),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
