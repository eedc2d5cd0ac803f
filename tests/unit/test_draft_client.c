/* The target's draft client against a fake draft on a Unix socket: a
 * finished sequence's Release is sent without waiting for the draft's
 * answer (the scheduler thread calls it between steps, so a slow draft
 * must not stall every stream), and it still arrives. */
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

#include "../../services/rpc/msg.h"
#include "../../target/draft_client.h"
#include "aerie.pb.h"

#define RELEASE_DELAY_MS 300 /* the fake draft answers Release this late */
#define N_RELEASES 4

typedef struct fake_draft {
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

static void fake_handle(void *ctx, rpc_call *call, const rpc_request *req) {
    fake_draft *f = ctx;
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

static void test_release_does_not_wait_for_a_slow_draft(void **state) {
    (void)state;
    fake_draft f = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    char addr[128];
    snprintf(addr, sizeof addr, "unix:build/test-dcli-%d.sock", (int)getpid());
    rpc_loop *loop;
    assert_int_equal(rpc_loop_start(&loop, NULL), AE_OK);
    rpc_server_config sc = {.addr = addr, .handler = fake_handle, .ctx = &f};
    rpc_server *srv;
    assert_int_equal(rpc_server_open(&srv, loop, &sc, NULL), AE_OK);
    dcli_config dc = {.addr = addr, .deadline_us = 500000, .feature_width = 3 * 64, .vocab = 100};
    dcli *d;
    assert_int_equal(dcli_open(&d, loop, &dc, NULL), AE_OK);
    for (int i = 0; i < 200 && !dcli_connected(d); i++) usleep(10000);
    assert_true(dcli_connected(d));

    const spec_drafter *dr = dcli_drafter(d);
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

    /* Closing with answers still outstanding ends them cleanly. */
    dcli_close(d);
    for (int i = 0; i < f.n_workers; i++) pthread_join(f.workers[i], NULL);
    rpc_server_close(srv);
    rpc_loop_free(loop);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_release_does_not_wait_for_a_slow_draft),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
