#include "kv.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

typedef struct kv_seq {
    bool live;
    bool dirty;       /* its table row changed since kv_upload_tables */
    int32_t len;      /* committed slots */
    int32_t n_blocks; /* blocks held: entries of this sequence's table row */
} kv_seq;

/* Rows kv_commit_path moves per kn_kv_move. */
#define KV_MOVE_CHUNK 64

struct kv_cache {
    kv_params p;
    const kn_backend *be;
    size_t row; /* elements per slot: n_kv_heads * head_dim */
    /* Shards (kv_init_sharded): shard s holds kv heads shard_heads[s] of
     * every slot, in pools of its own, in data[s] (of its rank's backend):
     * f16 [n_layers][2][n_blocks][block_size][shard_heads[s]][head_dim]. */
    int32_t n_shards;
    int32_t shard_heads[KV_MAX_SHARDS];
    size_t shard_pool[KV_MAX_SHARDS]; /* elements per pool of shard s: n_blocks * block_size * its heads * head_dim */
    kn_buf data[KV_MAX_SHARDS];       /* shard s's pools (one shard: f16
                                         [n_layers][2][n_blocks][block_size][n_kv_heads][head_dim]) */
    kn_buf tables_buf;                /* the block tables the kernels read: int32 [max_seqs][max_blocks_per_seq] */
    int32_t *tables;                  /* the same, as this file keeps them; -1 where unused. On a host-memory
                                         backend tables_buf itself, else a host copy kv_upload_tables sends */
    kn_buf moves;                     /* int32 [2][KV_MOVE_CHUNK]: source and destination rows of a commit */
    kv_seq *seqs;                     /* (max_seqs) */
    int32_t *refs;                    /* (n_blocks): sequences holding each block (kv_seq_fork shares them) */
    int32_t *free_blocks;             /* stack of free block ids, (n_blocks); top at n_free-1 */
    int32_t n_free;
    int32_t *free_seqs; /* stack of free sequence ids, (max_seqs) */
    int32_t n_free_seqs;
    int32_t peak;
};

uint64_t kv_bytes_per_token(int32_t n_layers, int32_t n_kv_heads, int32_t head_dim) {
    if (n_layers <= 0 || n_kv_heads <= 0 || head_dim <= 0) return 0;
    return 2ull * (uint64_t)n_layers * (uint64_t)n_kv_heads * (uint64_t)head_dim * sizeof(uint16_t);
}

uint64_t kv_latent_bytes_per_token(int32_t n_layers, int32_t dim) {
    if (n_layers <= 0 || dim <= 0) return 0;
    return (uint64_t)n_layers * (uint64_t)dim * sizeof(uint16_t);
}

/* Pools per layer: K and V, or a latent's K alone. */
static size_t pools(const kv_params *p) { return p->latent ? 1 : 2; }

/* a * b into *out; false on overflow. */
static bool mul_ok(uint64_t a, uint64_t b, uint64_t *out) {
    if (a != 0 && b > UINT64_MAX / a) return false;
    *out = a * b;
    return true;
}

static bool params_ok(const kv_params *p) {
    return p->n_layers > 0 && p->n_kv_heads > 0 && p->head_dim > 0 && p->block_size > 0 && p->n_blocks > 0 &&
           p->max_seqs > 0 && p->max_blocks_per_seq > 0;
}

/* Elements in all pools; 0 on overflow (or slot counts past INT32_MAX). */
static uint64_t pool_elems(const kv_params *p) {
    uint64_t row = (uint64_t)p->n_kv_heads * (uint64_t)p->head_dim, n;
    if ((uint64_t)p->max_blocks_per_seq * (uint64_t)p->block_size > INT32_MAX) return 0;
    if ((uint64_t)p->n_blocks * (uint64_t)p->block_size > INT32_MAX) return 0; /* rows are int32 (kn_kv_move) */
    if (!mul_ok((uint64_t)p->n_blocks, (uint64_t)p->block_size, &n)) return 0;
    if (!mul_ok(n, row, &n)) return 0;
    if (!mul_ok(n, pools(p) * (uint64_t)p->n_layers, &n)) return 0;
    if (!mul_ok(n, sizeof(uint16_t), &(uint64_t){0})) return 0;
    return n;
}

uint64_t kv_bytes(const kv_params *p) {
    if (!params_ok(p)) return 0;
    uint64_t elems = pool_elems(p), tables;
    if (elems == 0) return 0;
    if (!mul_ok((uint64_t)p->max_seqs, (uint64_t)p->max_blocks_per_seq * sizeof(int32_t), &tables)) return 0;
    return elems * sizeof(uint16_t) + tables + (uint64_t)p->n_blocks * 2 * sizeof(int32_t) +
           (uint64_t)p->max_seqs * (sizeof(kv_seq) + sizeof(int32_t)) + 2 * KV_MOVE_CHUNK * sizeof(int32_t);
}

int kv_init(kv_cache **out, const kn_backend *be, const kv_params *p, ae_error *err) {
    return kv_init_sharded(out, be, p, 1, &p->n_kv_heads, NULL, err);
}

int kv_init_sharded(kv_cache **out, const kn_backend *be, const kv_params *p, int32_t n_shards,
                    const int32_t *shard_kv_heads, const kn_backend *const *shard_be, ae_error *err) {
    *out = NULL;
    int64_t heads = 0;
    for (int32_t i = 0; i < n_shards && n_shards <= KV_MAX_SHARDS; i++) {
        if (shard_kv_heads[i] < 1) return err_set(err, "kv cache: shard %d has %d kv heads", i, shard_kv_heads[i]);
        if (p->latent && shard_kv_heads[i] != p->n_kv_heads)
            return err_set(err, "kv cache: shard %d of a latent cache has %d kv heads, not all %d", i,
                           shard_kv_heads[i], p->n_kv_heads);
        heads += shard_kv_heads[i];
    }
    if (p->latent) heads = p->n_kv_heads; /* replicated */
    if (n_shards < 1 || n_shards > KV_MAX_SHARDS || heads != p->n_kv_heads)
        return err_set(err, "kv cache: %d shards of %lld kv heads in all, for %d kv heads (at most %d shards)",
                       n_shards, (long long)heads, p->n_kv_heads, KV_MAX_SHARDS);
    if (!params_ok(p))
        return err_set(err,
                       "kv cache: sizes must be positive (layers=%d kv_heads=%d head_dim=%d "
                       "block_size=%d blocks=%d max_seqs=%d max_blocks_per_seq=%d)",
                       p->n_layers, p->n_kv_heads, p->head_dim, p->block_size, p->n_blocks, p->max_seqs,
                       p->max_blocks_per_seq);
    uint64_t elems = pool_elems(p);
    if (elems == 0 || elems * sizeof(uint16_t) > SIZE_MAX)
        return err_set(err, "kv cache: %d blocks x %d tokens x %d layers is too large", p->n_blocks, p->block_size,
                       p->n_layers);
    kv_cache *kv = calloc(1, sizeof *kv);
    if (!kv) return err_set(err, "kv cache: out of memory");
    kv->p = *p;
    kv->be = be;
    kv->row = (size_t)p->n_kv_heads * (size_t)p->head_dim;
    kv->n_shards = n_shards;
    for (int32_t i = 0; i < n_shards; i++) {
        kv->shard_heads[i] = shard_kv_heads[i];
        kv->shard_pool[i] =
            (size_t)p->n_blocks * (size_t)p->block_size * (size_t)shard_kv_heads[i] * (size_t)p->head_dim;
    }
    size_t n_table = (size_t)p->max_seqs * (size_t)p->max_blocks_per_seq;
    /* The backend's buffers come zeroed: the pages are committed now, as
     * the plan counted them, and a stray read sees 0 rather than garbage. */
    for (int32_t i = 0; i < n_shards; i++) {
        size_t bytes = pools(p) * (size_t)p->n_layers * kv->shard_pool[i] * sizeof(uint16_t);
        const kn_backend *sb = shard_be ? shard_be[i] : be;
        if (kn_buf_alloc(sb, &kv->data[i], bytes, err) != AE_OK) {
            if (n_shards > 1)
                err_prefix(err,
                           "kv cache: shard %d: %zu bytes of K/V (%d blocks x %d tokens x %d layers, %d kv heads): ", i,
                           bytes, p->n_blocks, p->block_size, p->n_layers, shard_kv_heads[i]);
            else
                err_prefix(err, "kv cache: %zu bytes of K/V (%d blocks x %d tokens x %d layers): ", bytes, p->n_blocks,
                           p->block_size, p->n_layers);
            goto fail;
        }
    }
    if (kn_buf_alloc(be, &kv->tables_buf, n_table * sizeof(int32_t), err) != AE_OK ||
        kn_buf_alloc(be, &kv->moves, 2 * KV_MOVE_CHUNK * sizeof(int32_t), err) != AE_OK)
        goto fail;
    kv->tables = kn_backend_host_memory(be) ? kv->tables_buf.ptr : malloc(n_table * sizeof(int32_t));
    kv->seqs = calloc((size_t)p->max_seqs, sizeof *kv->seqs);
    kv->free_blocks = malloc((size_t)p->n_blocks * sizeof(int32_t));
    kv->refs = calloc((size_t)p->n_blocks, sizeof(int32_t));
    kv->free_seqs = malloc((size_t)p->max_seqs * sizeof(int32_t));
    if (!kv->tables || !kv->seqs || !kv->free_blocks || !kv->refs || !kv->free_seqs) {
        err_set(err, "kv cache: out of memory for the block tables of %d sequences", p->max_seqs);
        goto fail;
    }
    for (size_t i = 0; i < n_table; i++) kv->tables[i] = -1;
    for (int32_t i = 0; i < p->max_seqs; i++) kv->seqs[i].dirty = true;
    /* Stacks pop from the top: block 0 and sequence 0 come out first. */
    for (int32_t i = 0; i < p->n_blocks; i++) kv->free_blocks[i] = p->n_blocks - 1 - i;
    kv->n_free = p->n_blocks;
    for (int32_t i = 0; i < p->max_seqs; i++) kv->free_seqs[i] = p->max_seqs - 1 - i;
    kv->n_free_seqs = p->max_seqs;
    *out = kv;
    return AE_OK;
fail:
    kv_free(kv);
    return AE_ERR;
}

void kv_free(kv_cache *kv) {
    if (!kv) return;
    if (kv->tables != kv->tables_buf.ptr) free(kv->tables);
    for (int32_t i = 0; i < kv->n_shards; i++) kn_buf_free(&kv->data[i]);
    kn_buf_free(&kv->tables_buf);
    kn_buf_free(&kv->moves);
    free(kv->seqs);
    free(kv->free_blocks);
    free(kv->refs);
    free(kv->free_seqs);
    free(kv);
}

const kv_params *kv_get_params(const kv_cache *kv) { return &kv->p; }

kv_stats kv_get_stats(const kv_cache *kv) {
    return (kv_stats){
        .n_blocks = kv->p.n_blocks,
        .blocks_used = kv->p.n_blocks - kv->n_free,
        .blocks_free = kv->n_free,
        .blocks_peak = kv->peak,
        .seqs_live = kv->p.max_seqs - kv->n_free_seqs,
    };
}

static kv_seq *live_seq(const kv_cache *kv, int32_t seq) {
    AE_ASSERT(seq >= 0 && seq < kv->p.max_seqs && "kv: sequence id out of range");
    kv_seq *s = &kv->seqs[seq];
    AE_ASSERT(s->live && "kv: sequence is not live");
    return s;
}

static int32_t *table_row(const kv_cache *kv, int32_t seq) {
    return kv->tables + (size_t)seq * (size_t)kv->p.max_blocks_per_seq;
}

int kv_seq_alloc(kv_cache *kv, int32_t *seq_out, ae_error *err) {
    *seq_out = -1;
    if (kv->n_free_seqs == 0)
        return err_set(err, "kv cache: all %d sequence slots are in use (max_seqs=%d)", kv->p.max_seqs, kv->p.max_seqs);
    int32_t id = kv->free_seqs[--kv->n_free_seqs];
    /* Dirty: a row freed since the last upload is all -1 here, not yet there. */
    kv->seqs[id] = (kv_seq){.live = true, .dirty = true, .len = 0, .n_blocks = 0};
    *seq_out = id;
    return AE_OK;
}

/* Returns the sequence's blocks from index keep on to the free list. */
static void release_blocks(kv_cache *kv, int32_t seq, int32_t keep) {
    kv_seq *s = &kv->seqs[seq];
    int32_t *row = table_row(kv, seq);
    /* Last block first, so a sequence that grows again gets its blocks back in order. */
    for (int32_t i = s->n_blocks - 1; i >= keep; i--) {
        AE_ASSERT(kv->refs[row[i]] > 0);
        if (--kv->refs[row[i]] == 0) {
            AE_ASSERT(kv->n_free < kv->p.n_blocks);
            kv->free_blocks[kv->n_free++] = row[i];
        }
        row[i] = -1;
        s->dirty = true;
    }
    if (keep < s->n_blocks) s->n_blocks = keep;
}

void kv_seq_free(kv_cache *kv, int32_t seq) {
    kv_seq *s = live_seq(kv, seq);
    release_blocks(kv, seq, 0);
    s->live = false;
    s->len = 0;
    kv->free_seqs[kv->n_free_seqs++] = seq;
}

int kv_seq_reserve(kv_cache *kv, int32_t seq, int32_t n_slots, ae_error *err) {
    kv_seq *s = live_seq(kv, seq);
    const int32_t bs = kv->p.block_size;
    if (n_slots < 0) return err_set(err, "kv cache: sequence %d: negative slot count %d", seq, n_slots);
    int64_t max_slots = (int64_t)kv->p.max_blocks_per_seq * bs;
    if (n_slots > max_slots)
        return err_set(err,
                       "kv cache: sequence %d needs %d slots, more than its block table holds "
                       "(max_blocks_per_seq %d x block_size %d = %lld)",
                       seq, n_slots, kv->p.max_blocks_per_seq, bs, (long long)max_slots);
    int32_t want = (int32_t)(((int64_t)n_slots + bs - 1) / bs);
    if (want <= s->n_blocks) return AE_OK;
    int32_t more = want - s->n_blocks;
    if (more > kv->n_free)
        return err_set(err,
                       "kv cache exhausted: sequence %d needs %d more blocks (%d slots at %d tokens "
                       "per block, holds %d), %d of %d free (%d used by %d sequences)",
                       seq, more, n_slots, bs, s->n_blocks, kv->n_free, kv->p.n_blocks, kv->p.n_blocks - kv->n_free,
                       kv->p.max_seqs - kv->n_free_seqs);
    int32_t *row = table_row(kv, seq);
    for (int32_t i = 0; i < more; i++) {
        int32_t b = kv->free_blocks[--kv->n_free];
        kv->refs[b] = 1;
        row[s->n_blocks++] = b;
    }
    s->dirty = true;
    int32_t used = kv->p.n_blocks - kv->n_free;
    if (used > kv->peak) kv->peak = used;
    return AE_OK;
}

void kv_seq_trim(kv_cache *kv, int32_t seq, int32_t n_slots) {
    kv_seq *s = live_seq(kv, seq);
    if (n_slots < s->len) n_slots = s->len;
    int32_t keep = (int32_t)(((int64_t)n_slots + kv->p.block_size - 1) / kv->p.block_size);
    release_blocks(kv, seq, keep);
}

bool kv_seq_is_live(const kv_cache *kv, int32_t seq) { return seq >= 0 && seq < kv->p.max_seqs && kv->seqs[seq].live; }

int32_t kv_seq_len(const kv_cache *kv, int32_t seq) { return live_seq(kv, seq)->len; }

int32_t kv_seq_capacity(const kv_cache *kv, int32_t seq) { return live_seq(kv, seq)->n_blocks * kv->p.block_size; }

int kv_seq_advance(kv_cache *kv, int32_t seq, int32_t n, ae_error *err) {
    kv_seq *s = live_seq(kv, seq);
    int32_t cap = s->n_blocks * kv->p.block_size;
    if (n < 0 || n > cap - s->len)
        return err_set(err, "kv cache: sequence %d: cannot advance %d slots (length %d, capacity %d)", seq, n, s->len,
                       cap);
    s->len += n;
    return AE_OK;
}

static size_t slot_offset(const kv_cache *kv, int32_t seq, int32_t slot) {
    const int32_t bs = kv->p.block_size;
    int32_t block = table_row(kv, seq)[slot / bs];
    return ((size_t)block * (size_t)bs + (size_t)(slot % bs)) * kv->row;
}

/* Copies pool rows rc[0][i] to rc[1][i], i < m, in every layer, in
 * order: the rows are uploaded to the moves buffer on the stream. */
static void move_rows(kv_cache *kv, kn_stream *stream, const int32_t rc[2][KV_MOVE_CHUNK], int32_t m) {
    const int32_t *rows = kv->moves.ptr;
    kn_upload(stream, &kv->moves, 0, rc[0], (size_t)m * sizeof(int32_t));
    kn_upload(stream, &kv->moves, KV_MOVE_CHUNK * sizeof(int32_t), rc[1], (size_t)m * sizeof(int32_t));
    for (int32_t sh = 0; sh < kv->n_shards; sh++)
        for (int32_t l = 0; l < kv->p.n_layers; l++) {
            kn_kv_pool pool = kv_shard_layer(kv, sh, l);
            kn_kv_move(stream, &pool, rows, rows + KV_MOVE_CHUNK, m);
        }
}

int kv_seq_fork(kv_cache *kv, kn_stream *stream, int32_t src, int32_t *dst_out, ae_error *err) {
    kv_seq *s = live_seq(kv, src);
    const int32_t bs = kv->p.block_size, full = s->len / bs, part = s->len % bs;
    *dst_out = -1;
    if (part > 0 && kv->n_free == 0)
        return err_set(err, "kv cache exhausted: forking sequence %d needs a block for its last %d slots, none is free",
                       src, part);
    int32_t dst;
    if (kv_seq_alloc(kv, &dst, err) != AE_OK) return AE_ERR;
    kv_seq *d = &kv->seqs[dst];
    const int32_t *from = table_row(kv, src);
    int32_t *row = table_row(kv, dst);
    for (int32_t i = 0; i < full; i++) {
        row[i] = from[i];
        kv->refs[from[i]]++;
    }
    d->n_blocks = full;
    d->len = full * bs;
    if (part > 0) {
        /* The block being filled is written by both from here on: the
         * fork gets its own copy of its committed rows. */
        AE_ASSERT(kv_seq_reserve(kv, dst, (full + 1) * bs, NULL) == AE_OK);
        int32_t rc[2][KV_MOVE_CHUNK];
        for (int32_t at = 0; at < part; at += KV_MOVE_CHUNK) {
            int32_t m = part - at < KV_MOVE_CHUNK ? part - at : KV_MOVE_CHUNK;
            for (int32_t i = 0; i < m; i++) {
                rc[0][i] = (int32_t)(slot_offset(kv, src, full * bs + at + i) / kv->row);
                rc[1][i] = (int32_t)(slot_offset(kv, dst, full * bs + at + i) / kv->row);
            }
            move_rows(kv, stream, rc, m);
        }
        d->len += part;
    }
    d->dirty = true;
    *dst_out = dst;
    return AE_OK;
}

int kv_commit_path(kv_cache *kv, kn_stream *stream, int32_t seq, const int32_t *node_slots, int32_t n, ae_error *err) {
    kv_seq *s = live_seq(kv, seq);
    int32_t cap = s->n_blocks * kv->p.block_size;
    if (n < 0 || n > cap - s->len)
        return err_set(err, "kv cache: sequence %d: path of %d nodes does not fit (length %d, capacity %d)", seq, n,
                       s->len, cap);
    /* Validate everything before moving anything. */
    for (int32_t i = 0; i < n; i++) {
        int32_t lo = i == 0 ? s->len : node_slots[i - 1] + 1;
        if (node_slots[i] < lo || node_slots[i] >= cap)
            return err_set(err,
                           "kv cache: sequence %d: path node %d is in slot %d; slots must be strictly "
                           "increasing within [%d, %d)",
                           seq, i, node_slots[i], s->len, cap);
    }
    /* Destination len+i <= source node_slots[i] < every later source, so
     * moving front to back never overwrites a row still to be read. The
     * moves go in chunks, in order, their rows uploaded to the moves
     * buffer on the same stream. */
    for (int32_t at = 0; at < n; at += KV_MOVE_CHUNK) {
        int32_t rc[2][KV_MOVE_CHUNK], m = n - at < KV_MOVE_CHUNK ? n - at : KV_MOVE_CHUNK;
        for (int32_t i = 0; i < m; i++) {
            rc[0][i] = (int32_t)(slot_offset(kv, seq, node_slots[at + i]) / kv->row);
            rc[1][i] = (int32_t)(slot_offset(kv, seq, s->len + at + i) / kv->row);
        }
        move_rows(kv, stream, rc, m);
    }
    s->len += n;
    return AE_OK;
}

const int32_t *kv_seq_block_table(const kv_cache *kv, int32_t seq) {
    (void)live_seq(kv, seq);
    return table_row(kv, seq);
}

int32_t kv_seq_n_blocks(const kv_cache *kv, int32_t seq) { return live_seq(kv, seq)->n_blocks; }

const int32_t *kv_block_tables(const kv_cache *kv) { return kv->tables; }

const int32_t *kv_map_tables(const kv_cache *kv) { return kv->tables_buf.ptr; }

void kv_upload_tables(kv_cache *kv, kn_stream *s) {
    if (kv->tables == kv->tables_buf.ptr) return;
    const size_t len = (size_t)kv->p.max_blocks_per_seq;
    for (int32_t q = 0; q < kv->p.max_seqs; q++) {
        if (!kv->seqs[q].dirty) continue;
        kv->seqs[q].dirty = false;
        kn_upload(s, &kv->tables_buf, (size_t)q * len * sizeof(int32_t), kv->tables + (size_t)q * len,
                  len * sizeof(int32_t));
    }
}

/* Shard sh's layer l K (v = 0) or V (v = 1) pool, at the backend's address. */
static uint16_t *pool_at(const kv_cache *kv, int32_t sh, int32_t layer, int v) {
    AE_ASSERT(sh >= 0 && sh < kv->n_shards && layer >= 0 && layer < kv->p.n_layers);
    AE_ASSERT(v == 0 || !kv->p.latent);
    return (uint16_t *)kv->data[sh].ptr + ((size_t)layer * pools(&kv->p) + (size_t)v) * kv->shard_pool[sh];
}

uint16_t *kv_k_pool(kv_cache *kv, int32_t layer) {
    AE_ASSERT(kn_backend_host_memory(kv->be) && kv->n_shards == 1);
    return pool_at(kv, 0, layer, 0);
}

uint16_t *kv_v_pool(kv_cache *kv, int32_t layer) {
    AE_ASSERT(kn_backend_host_memory(kv->be) && kv->n_shards == 1);
    return pool_at(kv, 0, layer, 1);
}

int32_t kv_n_shards(const kv_cache *kv) { return kv->n_shards; }

kn_kv_pool kv_shard_layer(kv_cache *kv, int32_t shard, int32_t layer) {
    return (kn_kv_pool){
        .k = pool_at(kv, shard, layer, 0),
        .v = kv->p.latent ? NULL : pool_at(kv, shard, layer, 1),
        .buf = &kv->data[shard],
        .n_blocks = kv->p.n_blocks,
        .block_size = kv->p.block_size,
        .n_kv_heads = kv->shard_heads[shard],
        .head_dim = kv->p.head_dim,
        .type = GGML_TYPE_F16,
    };
}

kn_kv_pool kv_layer(kv_cache *kv, int32_t layer) {
    AE_ASSERT(kv->n_shards == 1);
    return kv_shard_layer(kv, 0, layer);
}

static uint16_t *slot_row(kv_cache *kv, uint16_t *pool, int32_t seq, int32_t slot) {
    kv_seq *s = live_seq(kv, seq);
    AE_ASSERT(slot >= 0 && slot < s->n_blocks * kv->p.block_size && "kv: slot not reserved");
    return pool + slot_offset(kv, seq, slot);
}

uint16_t *kv_slot_k(kv_cache *kv, int32_t layer, int32_t seq, int32_t slot) {
    return slot_row(kv, kv_k_pool(kv, layer), seq, slot);
}

uint16_t *kv_slot_v(kv_cache *kv, int32_t layer, int32_t seq, int32_t slot) {
    return slot_row(kv, kv_v_pool(kv, layer), seq, slot);
}
