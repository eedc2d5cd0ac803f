/* Paged KV cache: block accounting, tree-path commit, exhaustion. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../../services/core/pool.h"
#include "../../services/kv/kv.h"

/* The stream kv_commit_path moves rows on. */
static pool *P;
static kn_stream *S;

static int group_setup(void **state) {
    (void)state;
    if (pool_init(&P, 1, NULL) != AE_OK) return -1;
    return kn_stream_init(&S, &kn_backend_cpu, &(kn_stream_config){P, 0}, NULL) == AE_OK ? 0 : -1;
}

static int group_teardown(void **state) {
    (void)state;
    kn_stream_free(S);
    pool_free(P);
    return 0;
}

/* 2 layers, 2 kv heads x 3 dims = 6 halves per row, 4 tokens per block. */
static const kv_params small = {
    .n_layers = 2,
    .n_kv_heads = 2,
    .head_dim = 3,
    .block_size = 4,
    .n_blocks = 8,
    .max_seqs = 4,
    .max_blocks_per_seq = 6,
};
#define ROW 6

static kv_cache *make(const kv_params *p) {
    kv_cache *kv;
    ae_error err = {0};
    assert_int_equal(kv_init(&kv, &kn_backend_cpu, p, &err), AE_OK);
    return kv;
}

/* A 16-bit pattern that names where it was written: K/V, layer,
 * sequence, slot (< 32), element (< 8). The cache moves the bits as they
 * are. */
static uint16_t tag(int is_v, int layer, int seq, int slot, int e) {
    return (uint16_t)((((is_v * 2 + layer) * 4 + seq) * 32 + slot) * 8 + e);
}

static void fill_slot(kv_cache *kv, int seq, int slot, int as_slot) {
    for (int l = 0; l < small.n_layers; l++) {
        uint16_t *k = kv_slot_k(kv, l, seq, slot), *v = kv_slot_v(kv, l, seq, slot);
        for (int e = 0; e < ROW; e++) {
            k[e] = tag(0, l, seq, as_slot, e);
            v[e] = tag(1, l, seq, as_slot, e);
        }
    }
}

/* Slot `slot` holds what fill_slot wrote as `as_slot`. */
static void expect_slot(kv_cache *kv, int seq, int slot, int as_slot) {
    for (int l = 0; l < small.n_layers; l++) {
        const uint16_t *k = kv_slot_k(kv, l, seq, slot), *v = kv_slot_v(kv, l, seq, slot);
        for (int e = 0; e < ROW; e++) {
            assert_true(k[e] == tag(0, l, seq, as_slot, e));
            assert_true(v[e] == tag(1, l, seq, as_slot, e));
        }
    }
}

static void test_bytes_per_token_is_two_layers_of_rows(void **state) {
    (void)state;
    assert_int_equal(kv_bytes_per_token(30, 3, 64), 2 * 30 * 3 * 64 * 2); /* SmolLM2-135M, f16: 23040 */
    assert_int_equal(kv_bytes_per_token(0, 3, 64), 0);
}

static void test_init_rejects_zero_sizes_and_free_null_is_noop(void **state) {
    (void)state;
    kv_params p = small;
    p.block_size = 0;
    kv_cache *kv = (kv_cache *)1;
    ae_error err = {0};
    assert_int_equal(kv_init(&kv, &kn_backend_cpu, &p, &err), AE_ERR);
    assert_null(kv);
    assert_string_equal(err.msg, "kv cache: sizes must be positive (layers=2 kv_heads=2 head_dim=3 block_size=0 "
                                 "blocks=8 max_seqs=4 max_blocks_per_seq=6)");
    kv_free(NULL);
}

static void test_pools_follow_the_documented_layout(void **state) {
    (void)state;
    kv_cache *kv = make(&small);
    size_t elems = (size_t)small.n_blocks * small.block_size * ROW; /* of one pool */
    assert_ptr_equal(kv_v_pool(kv, 0), kv_k_pool(kv, 0) + elems);
    assert_ptr_equal(kv_k_pool(kv, 1), kv_k_pool(kv, 0) + 2 * elems);
    assert_int_equal((uintptr_t)kv_k_pool(kv, 0) % 64, 0);
    int32_t s;
    assert_int_equal(kv_seq_alloc(kv, &s, NULL), AE_OK);
    assert_int_equal(kv_seq_reserve(kv, s, 6, NULL), AE_OK);
    const int32_t *bt = kv_seq_block_table(kv, s);
    /* slot 5 = block bt[1], row 1 */
    assert_ptr_equal(kv_slot_k(kv, 1, s, 5), kv_k_pool(kv, 1) + ((size_t)bt[1] * 4 + 1) * ROW);
    assert_ptr_equal(kv_slot_v(kv, 0, s, 2), kv_v_pool(kv, 0) + ((size_t)bt[0] * 4 + 2) * ROW);
    assert_ptr_equal(kv_block_tables(kv) + (size_t)s * small.max_blocks_per_seq, bt);
    kn_kv_pool l1 = kv_layer(kv, 1);
    assert_ptr_equal(l1.k, kv_k_pool(kv, 1));
    assert_ptr_equal(l1.v, kv_v_pool(kv, 1));
    assert_int_equal(l1.n_blocks, 8);
    assert_int_equal(l1.block_size, 4);
    assert_int_equal(l1.n_kv_heads, 2);
    assert_int_equal(l1.head_dim, 3);
    assert_int_equal(l1.type, GGML_TYPE_F16);
    kv_free(kv);
}

static void test_alloc_and_free_sequences(void **state) {
    (void)state;
    kv_cache *kv = make(&small);
    int32_t ids[4];
    for (int i = 0; i < 4; i++) {
        assert_int_equal(kv_seq_alloc(kv, &ids[i], NULL), AE_OK);
        assert_int_equal(ids[i], i);
        assert_int_equal(kv_seq_len(kv, ids[i]), 0);
        assert_int_equal(kv_seq_capacity(kv, ids[i]), 0);
    }
    assert_int_equal(kv_get_stats(kv).seqs_live, 4);
    int32_t extra;
    ae_error err = {0};
    assert_int_equal(kv_seq_alloc(kv, &extra, &err), AE_ERR);
    assert_int_equal(extra, -1);
    assert_string_equal(err.msg, "kv cache: all 4 sequence slots are in use (max_seqs=4)");
    assert_int_equal(kv_seq_reserve(kv, ids[2], 9, NULL), AE_OK); /* 3 blocks */
    assert_int_equal(kv_get_stats(kv).blocks_used, 3);
    kv_seq_free(kv, ids[2]);
    kv_stats st = kv_get_stats(kv);
    assert_int_equal(st.blocks_used, 0);
    assert_int_equal(st.blocks_free, 8);
    assert_int_equal(st.blocks_peak, 3);
    assert_int_equal(st.seqs_live, 3);
    assert_int_equal(kv_seq_alloc(kv, &extra, NULL), AE_OK);
    assert_int_equal(extra, 2);
    assert_int_equal(kv_seq_capacity(kv, extra), 0);
    assert_int_equal(kv_seq_n_blocks(kv, extra), 0);
    kv_free(kv);
}

static void test_reserve_grows_across_block_boundaries(void **state) {
    (void)state;
    kv_cache *kv = make(&small);
    int32_t s;
    assert_int_equal(kv_seq_alloc(kv, &s, NULL), AE_OK);
    const int32_t want_blocks[] = {1, 1, 1, 1, 2, 2, 2, 2, 3};
    for (int n = 1; n <= 9; n++) {
        assert_int_equal(kv_seq_reserve(kv, s, n, NULL), AE_OK);
        assert_int_equal(kv_seq_n_blocks(kv, s), want_blocks[n - 1]);
        assert_int_equal(kv_seq_capacity(kv, s), 4 * want_blocks[n - 1]);
    }
    const int32_t *bt = kv_seq_block_table(kv, s);
    assert_int_equal(bt[0], 0);
    assert_int_equal(bt[1], 1);
    assert_int_equal(bt[2], 2);
    assert_int_equal(bt[3], -1);
    /* Smaller requests never shrink. */
    assert_int_equal(kv_seq_reserve(kv, s, 2, NULL), AE_OK);
    assert_int_equal(kv_seq_n_blocks(kv, s), 3);
    /* Values written across the boundary read back from the right rows. */
    for (int slot = 0; slot < 9; slot++) fill_slot(kv, s, slot, slot);
    for (int slot = 0; slot < 9; slot++) expect_slot(kv, s, slot, slot);
    assert_int_equal(kv_seq_advance(kv, s, 9, NULL), AE_OK);
    assert_int_equal(kv_seq_len(kv, s), 9);
    ae_error err = {0};
    assert_int_equal(kv_seq_advance(kv, s, 4, &err), AE_ERR);
    assert_string_equal(err.msg, "kv cache: sequence 0: cannot advance 4 slots (length 9, capacity 12)");
    kv_free(kv);
}

static void test_reserve_beyond_block_table_fails(void **state) {
    (void)state;
    kv_cache *kv = make(&small);
    int32_t s;
    assert_int_equal(kv_seq_alloc(kv, &s, NULL), AE_OK);
    ae_error err = {0};
    assert_int_equal(kv_seq_reserve(kv, s, 25, &err), AE_ERR);
    assert_string_equal(err.msg, "kv cache: sequence 0 needs 25 slots, more than its block table holds "
                                 "(max_blocks_per_seq 6 x block_size 4 = 24)");
    assert_int_equal(kv_get_stats(kv).blocks_used, 0);
    assert_int_equal(kv_seq_reserve(kv, s, 24, NULL), AE_OK);
    kv_free(kv);
}

static void test_commit_path_moves_accepted_nodes_in_all_layers(void **state) {
    (void)state;
    kv_cache *kv = make(&small);
    int32_t a, b;
    assert_int_equal(kv_seq_alloc(kv, &a, NULL), AE_OK);
    assert_int_equal(kv_seq_alloc(kv, &b, NULL), AE_OK);
    /* b: a neighbour with 7 committed slots, interleaved blocks with a. */
    assert_int_equal(kv_seq_reserve(kv, b, 4, NULL), AE_OK);
    /* a: 3 committed slots, then a tree of 7 nodes in slots 3..9. */
    assert_int_equal(kv_seq_reserve(kv, a, 10, NULL), AE_OK);
    assert_int_equal(kv_seq_reserve(kv, b, 7, NULL), AE_OK);
    for (int slot = 0; slot < 10; slot++) fill_slot(kv, a, slot, slot);
    for (int slot = 0; slot < 7; slot++) fill_slot(kv, b, slot, slot);
    assert_int_equal(kv_seq_advance(kv, a, 3, NULL), AE_OK);
    assert_int_equal(kv_seq_advance(kv, b, 7, NULL), AE_OK);

    /* Accepted path: nodes 0, 2, 5 (slots 3, 5, 8); slot 8 sits in block 2. */
    const int32_t path[] = {3, 5, 8};
    assert_int_equal(kv_commit_path(kv, S, a, path, 3, NULL), AE_OK);
    assert_int_equal(kv_seq_len(kv, a), 6);
    for (int slot = 0; slot < 3; slot++) expect_slot(kv, a, slot, slot);
    expect_slot(kv, a, 3, 3);
    expect_slot(kv, a, 4, 5);
    expect_slot(kv, a, 5, 8);
    for (int slot = 0; slot < 7; slot++) expect_slot(kv, b, slot, slot);
    assert_int_equal(kv_seq_len(kv, b), 7);
    kv_free(kv);
}

/* Shards (tensor-parallel ranks): 3 kv heads cut 2 + 1, each shard in
 * pools of its own, one after the other, one block table. A commit and a
 * fork move the rows of every shard. */
static uint16_t *shard_row(kv_cache *kv, int sh, int layer, int is_v, int seq, int slot) {
    kn_kv_pool p = kv_shard_layer(kv, sh, layer);
    int32_t blk = kv_seq_block_table(kv, seq)[slot / p.block_size];
    size_t row = (size_t)blk * (size_t)p.block_size + (size_t)(slot % p.block_size);
    return (uint16_t *)(is_v ? p.v : p.k) + row * (size_t)p.n_kv_heads * (size_t)p.head_dim;
}

/* Slots 0 .. n-1 of seq hold, in both shards, every layer, K and V, the
 * rows written for slots want[]. */
static void expect_shard_rows(kv_cache *kv, const int32_t *heads, int seq, const int *want, int n) {
    for (int sh = 0; sh < 2; sh++)
        for (int l = 0; l < 2; l++)
            for (int v = 0; v < 2; v++)
                for (int slot = 0; slot < n; slot++) {
                    const uint16_t *r = shard_row(kv, sh, l, v, seq, slot);
                    for (int e = 0; e < heads[sh] * 3; e++) assert_int_equal(r[e], tag(v, l, sh, want[slot], e));
                }
}

static void test_shards_share_tables_and_every_commit(void **state) {
    (void)state;
    kv_params p = small;
    p.n_kv_heads = 3;
    const int32_t heads[2] = {2, 1};
    kv_cache *kv;
    ae_error err = {0};
    const kn_backend *where[2] = {&kn_backend_cpu, &kn_backend_cpu}; /* a backend a shard: its own buffer each */
    assert_int_equal(kv_init_sharded(&kv, &kn_backend_cpu, &p, 2, heads, where, &err), AE_OK);
    assert_int_equal(kv_n_shards(kv), 2);
    for (int sh = 0; sh < 2; sh++) {
        kn_kv_pool l1 = kv_shard_layer(kv, sh, 1);
        assert_int_equal(l1.n_kv_heads, heads[sh]);
        assert_int_equal(l1.n_blocks, p.n_blocks);
    }
    /* each shard in a buffer of its own, its layers' K and V one after
     * another there (blocks x 4 slots x its heads x head_dim 3) */
    for (int sh = 0; sh < 2; sh++) {
        kn_kv_pool l0 = kv_shard_layer(kv, sh, 0), l1 = kv_shard_layer(kv, sh, 1);
        size_t elems_of = (size_t)p.n_blocks * 4 * (size_t)heads[sh] * 3;
        assert_ptr_equal(l0.k, l0.buf->ptr);
        assert_ptr_equal(l0.v, (uint16_t *)l0.k + elems_of);
        assert_ptr_equal(l1.k, (uint16_t *)l0.k + 2 * elems_of);
        assert_true(l0.buf == l1.buf && l0.buf->bytes == 2 * 2 * elems_of * sizeof(uint16_t));
    }
    assert_true(kv_shard_layer(kv, 0, 0).buf != kv_shard_layer(kv, 1, 0).buf);
    int32_t a;
    assert_int_equal(kv_seq_alloc(kv, &a, NULL), AE_OK);
    assert_int_equal(kv_seq_reserve(kv, a, 9, NULL), AE_OK);
    for (int sh = 0; sh < 2; sh++)
        for (int l = 0; l < 2; l++)
            for (int v = 0; v < 2; v++)
                for (int slot = 0; slot < 9; slot++) {
                    uint16_t *r = shard_row(kv, sh, l, v, a, slot);
                    for (int e = 0; e < heads[sh] * 3; e++) r[e] = tag(v, l, sh, slot, e);
                }
    assert_int_equal(kv_seq_advance(kv, a, 2, NULL), AE_OK);
    const int32_t path[] = {3, 6}; /* tree nodes 1 and 4 of slots 2 .. 8 */
    assert_int_equal(kv_commit_path(kv, S, a, path, 2, NULL), AE_OK);
    kn_stream_sync(S);
    assert_int_equal(kv_seq_len(kv, a), 4);
    const int want[4] = {0, 1, 3, 6};
    expect_shard_rows(kv, heads, a, want, 4);
    /* a fork at 6 slots shares the full block and copies slots 4 and 5,
     * in every shard */
    assert_int_equal(kv_seq_advance(kv, a, 2, NULL), AE_OK);
    int32_t b;
    assert_int_equal(kv_seq_fork(kv, S, a, &b, &err), AE_OK);
    kn_stream_sync(S);
    assert_int_equal(kv_seq_block_table(kv, b)[0], kv_seq_block_table(kv, a)[0]);
    assert_int_not_equal(kv_seq_block_table(kv, b)[1], kv_seq_block_table(kv, a)[1]);
    const int want_b[6] = {0, 1, 3, 6, 4, 5};
    expect_shard_rows(kv, heads, b, want_b, 6);
    kv_free(kv);
    /* heads that do not add up, or an empty shard, are refused */
    const int32_t bad[2] = {2, 2}, empty[2] = {3, 0};
    assert_int_equal(kv_init_sharded(&kv, &kn_backend_cpu, &p, 2, bad, NULL, &err), AE_ERR);
    assert_string_equal(err.msg, "kv cache: 2 shards of 4 kv heads in all, for 3 kv heads (at most 64 shards)");
    err = (ae_error){0};
    assert_int_equal(kv_init_sharded(&kv, &kn_backend_cpu, &p, 2, empty, NULL, &err), AE_ERR);
    assert_string_equal(err.msg, "kv cache: shard 1 has 0 kv heads");
}

/* Slot `slot` of seq holds what fill_slot wrote into sequence `writer`. */
static void expect_written_by(kv_cache *kv, int seq, int slot, int writer, int as_slot) {
    for (int l = 0; l < small.n_layers; l++) {
        const uint16_t *k = kv_slot_k(kv, l, seq, slot), *v = kv_slot_v(kv, l, seq, slot);
        for (int e = 0; e < ROW; e++)
            assert_true(k[e] == tag(0, l, writer, as_slot, e) && v[e] == tag(1, l, writer, as_slot, e));
    }
}

/* A fork shares the full blocks, copies the one being filled, and each
 * side then writes its own; blocks go back when the last holder ends. */
static void test_fork_shares_full_blocks_and_copies_the_last(void **state) {
    (void)state;
    kv_cache *kv = make(&small);
    ae_error err = {0};
    int32_t a, b, c;
    assert_int_equal(kv_seq_alloc(kv, &a, NULL), AE_OK);
    assert_int_equal(kv_seq_reserve(kv, a, 8, NULL), AE_OK);
    for (int slot = 0; slot < 6; slot++) fill_slot(kv, a, slot, slot);
    assert_int_equal(kv_seq_advance(kv, a, 6, NULL), AE_OK);
    kv_seq_trim(kv, a, 6);
    assert_int_equal(kv_get_stats(kv).blocks_used, 2);
    assert_int_equal(kv_seq_fork(kv, S, a, &b, &err), AE_OK);
    assert_int_equal(kv_seq_len(kv, b), 6);
    assert_int_equal(kv_seq_n_blocks(kv, b), 2);
    assert_int_equal(kv_seq_block_table(kv, b)[0], kv_seq_block_table(kv, a)[0]);     /* shared */
    assert_int_not_equal(kv_seq_block_table(kv, b)[1], kv_seq_block_table(kv, a)[1]); /* copied */
    assert_int_equal(kv_get_stats(kv).blocks_used, 3);
    for (int slot = 0; slot < 6; slot++) expect_written_by(kv, b, slot, a, slot);
    /* Each writes its slot 6: neither sees the other's. */
    fill_slot(kv, a, 6, 6);
    fill_slot(kv, b, 6, 6);
    expect_written_by(kv, a, 6, a, 6);
    expect_written_by(kv, b, 6, b, 6);
    expect_written_by(kv, a, 5, a, 5);
    /* A fork of a fork on a block boundary copies nothing. */
    assert_int_equal(kv_seq_advance(kv, b, 1, NULL), AE_OK);
    assert_int_equal(kv_seq_reserve(kv, b, 8, NULL), AE_OK);
    fill_slot(kv, b, 7, 7);
    assert_int_equal(kv_seq_advance(kv, b, 1, NULL), AE_OK);
    assert_int_equal(kv_seq_fork(kv, S, b, &c, &err), AE_OK);
    assert_int_equal(kv_seq_n_blocks(kv, c), 2);
    assert_int_equal(kv_get_stats(kv).blocks_used, 3);
    expect_written_by(kv, c, 7, b, 7);
    /* The shared block outlives a and b. */
    kv_seq_free(kv, a);
    kv_seq_free(kv, b);
    assert_int_equal(kv_get_stats(kv).blocks_used, 2);
    expect_written_by(kv, c, 0, a, 0);
    expect_written_by(kv, c, 6, b, 6);
    kv_seq_free(kv, c);
    assert_int_equal(kv_get_stats(kv).blocks_used, 0);
    /* No block for the copy: refused, nothing changed. */
    assert_int_equal(kv_seq_alloc(kv, &a, NULL), AE_OK);
    assert_int_equal(kv_seq_reserve(kv, a, 6 * 4, NULL), AE_OK);
    assert_int_equal(kv_seq_alloc(kv, &b, NULL), AE_OK);
    assert_int_equal(kv_seq_reserve(kv, b, 2 * 4, NULL), AE_OK);
    assert_int_equal(kv_seq_advance(kv, a, 3, NULL), AE_OK);
    assert_int_equal(kv_seq_fork(kv, S, a, &c, &err), AE_ERR);
    assert_int_equal(c, -1);
    char want[128];
    snprintf(want, sizeof want,
             "kv cache exhausted: forking sequence %d needs a block for its last 3 slots, none is free", a);
    assert_string_equal(err.msg, want);
    assert_int_equal(kv_get_stats(kv).seqs_live, 2);
    kv_free(kv);
}

static void test_commit_path_handles_overlapping_chain(void **state) {
    (void)state;
    kv_cache *kv = make(&small);
    int32_t s;
    assert_int_equal(kv_seq_alloc(kv, &s, NULL), AE_OK);
    assert_int_equal(kv_seq_reserve(kv, s, 12, NULL), AE_OK);
    for (int slot = 0; slot < 12; slot++) fill_slot(kv, s, slot, slot);
    assert_int_equal(kv_seq_advance(kv, s, 2, NULL), AE_OK);
    /* Each destination is the previous node's source: 2<-3, 3<-4, 4<-5, 5<-7. */
    const int32_t path[] = {3, 4, 5, 7};
    assert_int_equal(kv_commit_path(kv, S, s, path, 4, NULL), AE_OK);
    assert_int_equal(kv_seq_len(kv, s), 6);
    expect_slot(kv, s, 0, 0);
    expect_slot(kv, s, 1, 1);
    expect_slot(kv, s, 2, 3);
    expect_slot(kv, s, 3, 4);
    expect_slot(kv, s, 4, 5);
    expect_slot(kv, s, 5, 7);
    /* An empty path (nothing accepted) keeps the length. */
    assert_int_equal(kv_commit_path(kv, S, s, NULL, 0, NULL), AE_OK);
    assert_int_equal(kv_seq_len(kv, s), 6);
    kv_free(kv);
}

static void test_commit_path_rejects_bad_slots_and_moves_nothing(void **state) {
    (void)state;
    kv_cache *kv = make(&small);
    int32_t s;
    assert_int_equal(kv_seq_alloc(kv, &s, NULL), AE_OK);
    assert_int_equal(kv_seq_reserve(kv, s, 8, NULL), AE_OK);
    for (int slot = 0; slot < 8; slot++) fill_slot(kv, s, slot, slot);
    assert_int_equal(kv_seq_advance(kv, s, 2, NULL), AE_OK);

    ae_error err = {0};
    const int32_t unordered[] = {3, 6, 5};
    assert_int_equal(kv_commit_path(kv, S, s, unordered, 3, &err), AE_ERR);
    assert_string_equal(err.msg, "kv cache: sequence 0: path node 2 is in slot 5; slots must be "
                                 "strictly increasing within [2, 8)");
    err_clear(&err);
    const int32_t committed[] = {1};
    assert_int_equal(kv_commit_path(kv, S, s, committed, 1, &err), AE_ERR);
    assert_string_equal(err.msg, "kv cache: sequence 0: path node 0 is in slot 1; slots must be "
                                 "strictly increasing within [2, 8)");
    err_clear(&err);
    const int32_t past[] = {4, 8};
    assert_int_equal(kv_commit_path(kv, S, s, past, 2, &err), AE_ERR);
    assert_string_equal(err.msg, "kv cache: sequence 0: path node 1 is in slot 8; slots must be "
                                 "strictly increasing within [2, 8)");
    err_clear(&err);
    const int32_t too_long[7] = {2, 3, 4, 5, 6, 7, 8};
    assert_int_equal(kv_commit_path(kv, S, s, too_long, 7, &err), AE_ERR);
    assert_string_equal(err.msg, "kv cache: sequence 0: path of 7 nodes does not fit (length 2, capacity 8)");
    assert_int_equal(kv_seq_len(kv, s), 2);
    for (int slot = 0; slot < 8; slot++) expect_slot(kv, s, slot, slot);
    kv_free(kv);
}

static void test_trim_returns_scratch_blocks(void **state) {
    (void)state;
    kv_cache *kv = make(&small);
    int32_t s;
    assert_int_equal(kv_seq_alloc(kv, &s, NULL), AE_OK);
    assert_int_equal(kv_seq_reserve(kv, s, 17, NULL), AE_OK); /* 5 blocks */
    assert_int_equal(kv_seq_advance(kv, s, 5, NULL), AE_OK);
    kv_seq_trim(kv, s, 0); /* never below the committed length: keeps 2 blocks */
    assert_int_equal(kv_seq_n_blocks(kv, s), 2);
    assert_int_equal(kv_seq_block_table(kv, s)[2], -1);
    kv_stats st = kv_get_stats(kv);
    assert_int_equal(st.blocks_used, 2);
    assert_int_equal(st.blocks_free, 6);
    assert_int_equal(st.blocks_peak, 5);
    /* Growing again gets the same blocks back, in order. */
    assert_int_equal(kv_seq_reserve(kv, s, 17, NULL), AE_OK);
    const int32_t *bt = kv_seq_block_table(kv, s);
    for (int i = 0; i < 5; i++) assert_int_equal(bt[i], i);
    kv_free(kv);
}

static void test_exhaustion_fails_cleanly_then_freeing_makes_room(void **state) {
    (void)state;
    kv_cache *kv = make(&small);
    int32_t a, b;
    assert_int_equal(kv_seq_alloc(kv, &a, NULL), AE_OK);
    assert_int_equal(kv_seq_alloc(kv, &b, NULL), AE_OK);
    assert_int_equal(kv_seq_reserve(kv, a, 20, NULL), AE_OK); /* 5 of 8 blocks */
    assert_int_equal(kv_seq_reserve(kv, b, 4, NULL), AE_OK);  /* 6 of 8 */
    for (int slot = 0; slot < 20; slot++) fill_slot(kv, a, slot, slot);
    for (int slot = 0; slot < 4; slot++) fill_slot(kv, b, slot, slot);
    assert_int_equal(kv_seq_advance(kv, b, 4, NULL), AE_OK);

    ae_error err = {0};
    assert_int_equal(kv_seq_reserve(kv, b, 16, &err), AE_ERR); /* needs 3 more, 2 free */
    assert_string_equal(err.msg, "kv cache exhausted: sequence 1 needs 3 more blocks (16 slots at 4 "
                                 "tokens per block, holds 1), 2 of 8 free (6 used by 2 sequences)");
    kv_stats st = kv_get_stats(kv);
    assert_int_equal(st.blocks_used, 6);
    assert_int_equal(st.blocks_free, 2);
    assert_int_equal(kv_seq_n_blocks(kv, b), 1);
    assert_int_equal(kv_seq_capacity(kv, b), 4);
    assert_int_equal(kv_seq_block_table(kv, b)[1], -1);
    assert_int_equal(kv_seq_len(kv, b), 4);
    for (int slot = 0; slot < 20; slot++) expect_slot(kv, a, slot, slot);
    for (int slot = 0; slot < 4; slot++) expect_slot(kv, b, slot, slot);

    kv_seq_free(kv, a);
    assert_int_equal(kv_seq_reserve(kv, b, 16, NULL), AE_OK);
    assert_int_equal(kv_seq_n_blocks(kv, b), 4);
    for (int slot = 0; slot < 4; slot++) expect_slot(kv, b, slot, slot);
    st = kv_get_stats(kv);
    assert_int_equal(st.blocks_used, 4);
    assert_int_equal(st.blocks_peak, 6);
    kv_free(kv);
}

/* Sequences grow one token at a time in turn, some finish and new ones
 * start; every live sequence keeps exactly its own values and no block is
 * held twice. */
static void test_many_sequences_interleaved(void **state) {
    (void)state;
    kv_params p = small;
    p.n_blocks = 24;
    p.max_seqs = 6;
    kv_cache *kv = make(&p);
    int32_t ids[6];
    int n_live = 0;
    for (int i = 0; i < 6; i++) {
        assert_int_equal(kv_seq_alloc(kv, &ids[i], NULL), AE_OK);
        n_live++;
    }
    int alive[6] = {1, 1, 1, 1, 1, 1};
    for (int step = 0; step < 14; step++) {
        for (int i = 0; i < 6; i++) {
            if (!alive[i]) continue;
            int32_t s = ids[i], len = kv_seq_len(kv, s);
            if (len >= 2 + 2 * i) continue; /* sequence i stops at 2 + 2i tokens */
            assert_int_equal(kv_seq_reserve(kv, s, len + 1, NULL), AE_OK);
            fill_slot(kv, s, len, len);
            assert_int_equal(kv_seq_advance(kv, s, 1, NULL), AE_OK);
        }
        if (step == 5) { /* sequence 1 finishes; a new one takes its id */
            kv_seq_free(kv, ids[1]);
            assert_int_equal(kv_seq_alloc(kv, &ids[1], NULL), AE_OK);
            assert_int_equal(ids[1], 1);
        }
    }
    int used = 0;
    char held[24] = {0};
    for (int i = 0; i < 6; i++) {
        int32_t s = ids[i], len = kv_seq_len(kv, s);
        assert_int_equal(len, 2 + 2 * i);
        for (int slot = 0; slot < len; slot++) expect_slot(kv, s, slot, slot);
        const int32_t *bt = kv_seq_block_table(kv, s);
        for (int b = 0; b < kv_seq_n_blocks(kv, s); b++) {
            assert_in_range(bt[b], 0, 23);
            assert_int_equal(held[bt[b]], 0);
            held[bt[b]] = 1;
            used++;
        }
    }
    /* lengths 2,4,6,8,10,12 -> 1,1,2,2,3,3 blocks */
    assert_int_equal(used, 12);
    assert_int_equal(kv_get_stats(kv).blocks_used, 12);
    assert_int_equal(kv_get_stats(kv).seqs_live, n_live);
    for (int i = 0; i < 6; i++) kv_seq_free(kv, ids[i]);
    assert_int_equal(kv_get_stats(kv).blocks_free, 24);
    kv_free(kv);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bytes_per_token_is_two_layers_of_rows),
        cmocka_unit_test(test_init_rejects_zero_sizes_and_free_null_is_noop),
        cmocka_unit_test(test_pools_follow_the_documented_layout),
        cmocka_unit_test(test_alloc_and_free_sequences),
        cmocka_unit_test(test_reserve_grows_across_block_boundaries),
        cmocka_unit_test(test_reserve_beyond_block_table_fails),
        cmocka_unit_test(test_commit_path_moves_accepted_nodes_in_all_layers),
        cmocka_unit_test(test_commit_path_handles_overlapping_chain),
        cmocka_unit_test(test_fork_shares_full_blocks_and_copies_the_last),
        cmocka_unit_test(test_commit_path_rejects_bad_slots_and_moves_nothing),
        cmocka_unit_test(test_trim_returns_scratch_blocks),
        cmocka_unit_test(test_exhaustion_fails_cleanly_then_freeing_makes_room),
        cmocka_unit_test(test_many_sequences_interleaved),
        cmocka_unit_test(test_shards_share_tables_and_every_commit),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
