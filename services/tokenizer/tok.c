/* Byte-level BPE tokenizer: loading (GGUF, tokenizer.json), encoding,
 * decoding. See tok.h for the contract and pretok.h for the pre-tokenizers.
 *
 * Everything the encoder touches works on raw bytes: a vocabulary entry
 * keeps both its text as stored in the file (byte-level mapped, "Ġhi") and
 * the bytes it stands for (" hi"), merges are keyed by id pairs, and BPE
 * starts from a 256-entry byte->id table. The mapped text is only needed at
 * load time and by tok_find.
 *
 * Semantics follow Hugging Face tokenizers (BPE model, byte-level):
 *   - merges apply lowest rank first, leftmost first among equal ranks;
 *   - if the same pair is listed twice, the later rank wins (HF builds its
 *     merge map by inserting in order);
 *   - ignore_merges: a piece that is itself a vocabulary entry is emitted
 *     as that entry without running merges (Llama 3; llama.cpp does the same
 *     for pre "llama-bpe");
 *   - a byte with no single-byte token is emitted as unk when the model has
 *     one and dropped otherwise, as the reference does (SmolLM2 has no token
 *     for 21 of the 256 bytes, e.g. 0x04, 0xC0, 0xF5..0xFF);
 *   - added/special tokens are found leftmost-longest before pre-tokenizing. */
#include "tok.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/file.h"
#include "../core/json.h"
#include "detok.h"
#include "pretok.h"

#define TOK_MAX_VOCAB (1 << 24)   /* ids; real vocabularies are < 300k */
#define TOK_MAX_JSON (512u << 20) /* bytes of tokenizer.json */
#define TOK_MAX_BLOB 0xFFFFFFF0u  /* entry offsets are 32-bit */

/* Pieces up to this many bytes use the simple O(n^2) merge loop on stack
 * arrays; longer ones a heap (O(n log n)), so a megabyte without a space
 * cannot stall a request. */
#define BPE_SMALL 128

/* The word cache: a direct-mapped table of recent pieces and their ids,
 * shared by all threads, guarded by striped locks. Bounded by construction:
 * a new word overwrites whatever sat in its slot. */
#define CACHE_SLOTS 8192 /* power of two */
#define CACHE_LOCKS 64   /* power of two, divides CACHE_SLOTS */
#define CACHE_WORD_MAX 22
#define CACHE_IDS_MAX 8

enum {
    ENT_SPECIAL = 1, /* special token: skipped by decode(skip_special) */
    ENT_ADDED = 2,   /* added/control token: matched in text before BPE */
    ENT_MAPPED = 4,  /* text is a byte-level mapping of raw: may be looked up
                        by raw bytes (ignore_merges) */
};

typedef struct tok_entry {
    uint32_t text_off, text_len; /* text as in the file, in t->text */
    uint32_t raw_off, raw_len;   /* the bytes it stands for, in t->raw */
    uint8_t flags;               /* ENT_* */
} tok_entry;

typedef struct merge_slot {
    uint64_t key;   /* left id << 32 | right id; MERGE_EMPTY when unused */
    uint32_t rank;  /* lower merges first */
    int32_t result; /* id of the merged token */
} merge_slot;

#define MERGE_EMPTY UINT64_MAX
#define RANK_NONE UINT32_MAX

typedef struct cache_slot {
    uint64_t hash;
    uint8_t len; /* bytes of word; 0: empty */
    uint8_t n;   /* ids */
    uint8_t word[CACHE_WORD_MAX];
    int32_t ids[CACHE_IDS_MAX];
} cache_slot;

/* An open-addressing set of ids keyed by one of the entry's byte strings. */
typedef struct str_index {
    int32_t *slots; /* -1: empty */
    uint32_t mask;
    bool by_raw; /* key is the raw bytes (else the text) */
} str_index;

typedef struct blob {
    uint8_t *p;
    size_t len, cap;
} blob;

/* A node of the trie of added tokens' texts: the node for a prefix has
 * one child per byte that continues some token. A walk from a text
 * position costs at most the longest added token's length, whatever the
 * number of added tokens (a scan over all of them took 0.28 s for 1 MiB of
 * "<|" with 273 tokens starting so). */
typedef struct added_node {
    uint32_t child;   /* first child; 0: none */
    uint32_t sibling; /* the parent's next child; 0: none */
    int32_t id;       /* the lowest id whose text ends here; -1: none */
    int32_t id_plain; /* the same among non-special tokens */
    uint8_t byte;     /* the byte leading here from the parent */
} added_node;

struct tok {
    tok_pre pre;
    bool ignore_merges;
    int32_t n_vocab;
    size_t max_token_bytes; /* longest raw token */
    tok_entry *ent;         /* (n_vocab) */
    blob text, raw;
    str_index by_text, by_raw;

    merge_slot *merges; /* (merge_mask + 1) */
    uint32_t merge_mask;
    uint32_t n_merges;
    int32_t byte_id[256]; /* single-byte token of each byte; -1: none */
    int32_t unk;          /* -1: none */

    added_node *added; /* (n_added_nodes) the added tokens' trie; [0] is its root */
    uint32_t n_added_nodes;
    uint32_t n_added;         /* added tokens */
    uint32_t added_root[256]; /* the root's child for each byte; 0: none */
    int added_first;          /* the only first byte of all added tokens, or -1 */

    int32_t bos, eos;
    bool add_bos;
    char *chat_template;

    cache_slot *cache; /* (CACHE_SLOTS) */
    pthread_mutex_t locks[CACHE_LOCKS];
    int n_locks; /* initialised so far, for tok_free */
};

/* ------------------------------------------------------------------------ */
/* Byte-level map (GPT-2): printable bytes stand for themselves, the other 68
 * take U+0100.. in byte order. */

static uint16_t byte_to_cp[256];
static int16_t cp_to_byte[324]; /* -1: not a mapped character */
static pthread_once_t byte_map_once = PTHREAD_ONCE_INIT;

static void byte_map_init(void) {
    for (int i = 0; i < 324; i++) cp_to_byte[i] = -1;
    int next = 256;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
        byte_to_cp[b] = (uint16_t)(printable ? b : next++);
        cp_to_byte[byte_to_cp[b]] = (int16_t)b;
    }
}

/* Unmaps byte-level text into out (room for len bytes; mapped text is never
 * shorter than its bytes). Returns the byte count, or -1 if some character
 * is not in the map. */
static long unmap_text(const uint8_t *s, size_t len, uint8_t *out) {
    size_t i = 0, n = 0;
    while (i < len) {
        uint32_t cp;
        if (s[i] < 0x80) {
            cp = s[i++];
        } else if ((s[i] & 0xE0) == 0xC0 && i + 1 < len && (s[i + 1] & 0xC0) == 0x80) {
            cp = (uint32_t)(s[i] & 0x1F) << 6 | (s[i + 1] & 0x3F);
            i += 2;
        } else {
            return -1; /* every mapped character is below U+0800 */
        }
        if (cp >= 324 || cp_to_byte[cp] < 0) return -1;
        out[n++] = (uint8_t)cp_to_byte[cp];
    }
    return (long)n;
}

/* ------------------------------------------------------------------------ */
/* Hashing and tables */

static inline uint64_t mix64(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return h;
}

static inline uint64_t hash_bytes(const uint8_t *p, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        h = (h ^ v) * 0xbf58476d1ce4e5b9ull;
        h ^= h >> 29;
        p += 8;
        n -= 8;
    }
    uint64_t v = 0;
    memcpy(&v, p, n);
    return mix64(h ^ v);
}

static uint32_t pow2_at_least(uint64_t n) {
    uint32_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

static inline const uint8_t *ent_key(const tok *t, const tok_entry *e, bool by_raw, size_t *len) {
    if (by_raw) {
        *len = e->raw_len;
        return t->raw.p + e->raw_off;
    }
    *len = e->text_len;
    return t->text.p + e->text_off;
}

static int32_t index_find(const tok *t, const str_index *ix, const uint8_t *s, size_t n) {
    if (!ix->slots) return -1;
    uint32_t h = (uint32_t)hash_bytes(s, n) & ix->mask;
    for (;; h = (h + 1) & ix->mask) {
        int32_t id = ix->slots[h];
        if (id < 0) return -1;
        size_t kl;
        const uint8_t *k = ent_key(t, &t->ent[id], ix->by_raw, &kl);
        if (kl == n && memcmp(k, s, n) == 0) return id;
    }
}

/* Indexes every entry that has the flag `need` (0: all with a key). The
 * first id wins when two entries share a key. */
static int index_build(tok *t, str_index *ix, bool by_raw, uint8_t need, ae_error *err) {
    uint32_t cap = pow2_at_least((uint64_t)t->n_vocab * 2);
    ix->slots = malloc((size_t)cap * sizeof *ix->slots);
    if (!ix->slots) return err_set(err, "out of memory (token index)");
    memset(ix->slots, 0xFF, (size_t)cap * sizeof *ix->slots);
    ix->mask = cap - 1;
    ix->by_raw = by_raw;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        const tok_entry *e = &t->ent[id];
        if ((e->flags & need) != need) continue;
        size_t n;
        const uint8_t *k = ent_key(t, e, by_raw, &n);
        if (n == 0) continue;
        if (index_find(t, ix, k, n) >= 0) continue;
        uint32_t h = (uint32_t)hash_bytes(k, n) & ix->mask;
        while (ix->slots[h] >= 0) h = (h + 1) & ix->mask;
        ix->slots[h] = id;
    }
    return AE_OK;
}

static inline uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t)(uint32_t)a << 32 | (uint32_t)b; }

static inline const merge_slot *merge_find(const tok *t, int32_t a, int32_t b) {
    uint64_t key = pair_key(a, b);
    uint32_t h = (uint32_t)mix64(key) & t->merge_mask;
    for (;; h = (h + 1) & t->merge_mask) {
        const merge_slot *m = &t->merges[h];
        if (m->key == key) return m;
        if (m->key == MERGE_EMPTY) return NULL;
    }
}

static inline uint32_t merge_rank(const tok *t, int32_t a, int32_t b, int32_t *result) {
    const merge_slot *m = merge_find(t, a, b);
    if (!m) return RANK_NONE;
    *result = m->result;
    return m->rank;
}

static int blob_add(blob *b, const void *p, size_t n, uint32_t *off, ae_error *err) {
    if (n > TOK_MAX_BLOB - b->len) return err_set(err, "vocabulary text too large");
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 1 << 16;
        while (cap < b->len + n) cap *= 2;
        uint8_t *p2 = realloc(b->p, cap);
        if (!p2) return err_set(err, "out of memory (vocabulary)");
        b->p = p2;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->len, p, n);
    *off = (uint32_t)b->len;
    b->len += n;
    return AE_OK;
}

/* ------------------------------------------------------------------------ */
/* Building a tokenizer: both loaders fill entries, then merges, then call
 * build_finish. */

static tok *tok_alloc(int32_t n_vocab, ae_error *err) {
    pthread_once(&byte_map_once, byte_map_init);
    if (n_vocab <= 0 || n_vocab > TOK_MAX_VOCAB) {
        err_set(err, "vocabulary size %ld out of range (1..%d)", (long)n_vocab, TOK_MAX_VOCAB);
        return NULL;
    }
    tok *t = calloc(1, sizeof *t);
    if (!t) goto oom;
    t->n_vocab = n_vocab;
    t->bos = t->eos = t->unk = -1;
    t->added_first = -1;
    t->ent = calloc((size_t)n_vocab, sizeof *t->ent);
    if (!t->ent) goto oom;
    return t;
oom:
    tok_free(t);
    err_set(err, "out of memory (vocabulary of %ld)", (long)n_vocab);
    return NULL;
}

/* Sets entry id's text. Added tokens' bytes are their literal text; other
 * entries' bytes are computed in build_vocab. */
static int entry_set(tok *t, int32_t id, const char *s, size_t n, uint8_t flags, ae_error *err) {
    AE_ASSERT(id >= 0 && id < t->n_vocab);
    tok_entry *e = &t->ent[id];
    if (blob_add(&t->text, s, n, &e->text_off, err)) return AE_ERR;
    e->text_len = (uint32_t)n;
    e->flags = flags;
    return AE_OK;
}

static int build_vocab(tok *t, ae_error *err) {
    size_t max_len = 0;
    for (int32_t id = 0; id < t->n_vocab; id++)
        if (t->ent[id].text_len > max_len) max_len = t->ent[id].text_len;
    uint8_t *buf = malloc(max_len + 1);
    if (!buf) return err_set(err, "out of memory (vocabulary)");
    for (int32_t id = 0; id < t->n_vocab; id++) {
        tok_entry *e = &t->ent[id];
        const uint8_t *s = t->text.p + e->text_off;
        long n = unmap_text(s, e->text_len, buf);
        const uint8_t *raw = buf;
        size_t raw_len = (size_t)n;
        if (e->flags & ENT_ADDED) {
            /* Literal text; still reachable by ignore_merges lookup when its
             * mapping round-trips (e.g. "<|im_start|>"). */
            if (n >= 0 && (size_t)n == e->text_len && memcmp(buf, s, e->text_len) == 0) e->flags |= ENT_MAPPED;
            raw = s;
            raw_len = e->text_len;
        } else if (n < 0) {
            /* Not a byte-level string: decode gives its UTF-8 as is, like HF's
             * ByteLevel decoder. */
            raw = s;
            raw_len = e->text_len;
        } else {
            e->flags |= ENT_MAPPED;
        }
        if (blob_add(&t->raw, raw, raw_len, &e->raw_off, err)) {
            free(buf);
            return AE_ERR;
        }
        e->raw_len = (uint32_t)raw_len;
        if (raw_len > t->max_token_bytes) t->max_token_bytes = raw_len;
    }
    free(buf);
    if (index_build(t, &t->by_text, false, 0, err)) return AE_ERR;
    if (index_build(t, &t->by_raw, true, ENT_MAPPED, err)) return AE_ERR;
    for (int b = 0; b < 256; b++) {
        uint8_t m[2];
        size_t n = 0;
        if (byte_to_cp[b] < 0x80) {
            m[n++] = (uint8_t)byte_to_cp[b];
        } else {
            m[n++] = (uint8_t)(0xC0 | byte_to_cp[b] >> 6);
            m[n++] = (uint8_t)(0x80 | (byte_to_cp[b] & 0x3F));
        }
        int32_t id = index_find(t, &t->by_text, m, n);
        t->byte_id[b] = (id >= 0 && !(t->ent[id].flags & ENT_ADDED)) ? id : -1;
    }
    return AE_OK;
}

static int merges_alloc(tok *t, uint64_t n, ae_error *err) {
    if (n > (uint64_t)TOK_MAX_VOCAB * 4) return err_set(err, "%llu merges is too many", (unsigned long long)n);
    uint32_t cap = pow2_at_least(n * 2 + 1);
    t->merges = malloc((size_t)cap * sizeof *t->merges);
    if (!t->merges) return err_set(err, "out of memory (merges)");
    for (uint32_t i = 0; i < cap; i++) t->merges[i].key = MERGE_EMPTY;
    t->merge_mask = cap - 1;
    return AE_OK;
}

/* Adds merge number `rank` of left+right (both byte-level text). scratch
 * holds at least llen + rlen bytes. */
static int merge_add(tok *t, const char *l, size_t llen, const char *r, size_t rlen, uint32_t rank, char *scratch,
                     ae_error *err) {
    int32_t a = index_find(t, &t->by_text, (const uint8_t *)l, llen);
    int32_t b = index_find(t, &t->by_text, (const uint8_t *)r, rlen);
    memcpy(scratch, l, llen);
    memcpy(scratch + llen, r, rlen);
    int32_t c = index_find(t, &t->by_text, (const uint8_t *)scratch, llen + rlen);
    if (a < 0 || b < 0 || c < 0)
        return err_set(err, "merge %u \"%.*s %.*s\": %s not in the vocabulary", rank, (int)llen, l, (int)rlen, r,
                       a < 0   ? "left token"
                       : b < 0 ? "right token"
                               : "merged token");
    uint64_t key = pair_key(a, b);
    uint32_t h = (uint32_t)mix64(key) & t->merge_mask;
    while (t->merges[h].key != MERGE_EMPTY && t->merges[h].key != key) h = (h + 1) & t->merge_mask;
    if (t->merges[h].key == MERGE_EMPTY) t->n_merges++;
    t->merges[h] = (merge_slot){.key = key, .rank = rank, .result = c};
    return AE_OK;
}

/* The child of node `at` for byte b, made when `make` (the room is
 * counted beforehand); 0 when absent. */
static uint32_t added_child(tok *t, uint32_t at, uint8_t b, bool make) {
    uint32_t *link = at ? &t->added[at].child : &t->added_root[b];
    if (at)
        for (; *link; link = &t->added[*link].sibling)
            if (t->added[*link].byte == b) return *link;
    if (*link || !make) return *link;
    uint32_t k = t->n_added_nodes++;
    t->added[k] = (added_node){0, 0, -1, -1, b};
    *link = k;
    return k;
}

static int build_finish(tok *t, ae_error *err) {
    size_t bytes = 0;
    uint32_t n = 0;
    for (int32_t id = 0; id < t->n_vocab; id++)
        if ((t->ent[id].flags & ENT_ADDED) && t->ent[id].raw_len) n++, bytes += t->ent[id].raw_len;
    if (n) {
        if (bytes >= UINT32_MAX) return err_set(err, "added tokens: %zu bytes of text is too many", bytes);
        t->added = malloc((bytes + 1) * sizeof *t->added);
        if (!t->added) return err_set(err, "out of memory (added tokens)");
        t->added[0] = (added_node){0, 0, -1, -1, 0};
        t->n_added_nodes = 1;
        /* Ids ascending: the first to reach a node is its lowest. */
        for (int32_t id = 0; id < t->n_vocab; id++) {
            const tok_entry *e = &t->ent[id];
            if (!(e->flags & ENT_ADDED) || !e->raw_len) continue;
            const uint8_t *p = t->raw.p + e->raw_off;
            uint32_t at = 0;
            for (uint32_t j = 0; j < e->raw_len; j++) at = added_child(t, at, p[j], true);
            if (t->added[at].id < 0) t->added[at].id = id;
            if (!(e->flags & ENT_SPECIAL) && t->added[at].id_plain < 0) t->added[at].id_plain = id;
        }
    }
    t->n_added = n;
    int firsts = 0;
    for (int b = 0; b < 256; b++)
        if (t->added_root[b]) {
            firsts++;
            t->added_first = b;
        }
    if (firsts != 1) t->added_first = -1;

    t->cache = calloc(CACHE_SLOTS, sizeof *t->cache);
    if (!t->cache) return err_set(err, "out of memory (word cache)");
    for (; t->n_locks < CACHE_LOCKS; t->n_locks++)
        if (pthread_mutex_init(&t->locks[t->n_locks], NULL) != 0) return err_set(err, "pthread_mutex_init failed");
    return AE_OK;
}

void tok_free(tok *t) {
    if (!t) return;
    for (int i = 0; i < t->n_locks; i++) pthread_mutex_destroy(&t->locks[i]);
    free(t->cache);
    free(t->added);
    free(t->merges);
    free(t->by_text.slots);
    free(t->by_raw.slots);
    free(t->text.p);
    free(t->raw.p);
    free(t->ent);
    free(t->chat_template);
    free(t);
}

/* ------------------------------------------------------------------------ */
/* GGUF */

static int pre_from_name(gguf_str s, tok_pre *out, ae_error *err) {
    if (gguf_str_eq(s, "gpt2"))
        *out = TOK_PRE_GPT2;
    else if (gguf_str_eq(s, "smollm"))
        *out = TOK_PRE_SMOLLM;
    else if (gguf_str_eq(s, "llama-bpe") || gguf_str_eq(s, "llama3"))
        *out = TOK_PRE_LLAMA3;
    else
        return err_set(err,
                       "tokenizer.ggml.pre \"%.*s\" is not supported "
                       "(gpt2, smollm, llama-bpe)",
                       (int)(s.len > 64 ? 64 : s.len), s.ptr);
    return AE_OK;
}

/* Optional token id key: absent leaves *out alone. */
static int gguf_opt_id(const gguf_file *f, const char *key, int32_t n_vocab, int32_t *out, ae_error *err) {
    if (gguf_find_key(f, key) < 0) return AE_OK;
    uint32_t v;
    if (gguf_get_u32(f, key, &v, err)) return AE_ERR;
    if (v >= (uint32_t)n_vocab) return err_set(err, "%s %u out of range (vocabulary %ld)", key, v, (long)n_vocab);
    *out = (int32_t)v;
    return AE_OK;
}

int tok_load_gguf(tok **out, const gguf_file *f, ae_error *err) {
    tok *t = NULL;
    char *scratch = NULL;
    gguf_str s;
    *out = NULL;
    if (!f) return err_set(err, "tok_load_gguf: no file");

    if (gguf_get_str(f, "tokenizer.ggml.model", &s, err)) goto fail;
    if (!gguf_str_eq(s, "gpt2")) {
        err_set(err, "tokenizer.ggml.model \"%.*s\" is not supported (gpt2 only)", (int)(s.len > 64 ? 64 : s.len),
                s.ptr);
        goto fail;
    }
    tok_pre pre = TOK_PRE_GPT2;
    if (gguf_find_key(f, "tokenizer.ggml.pre") < 0) {
        err_set(err, "tokenizer.ggml.pre is missing (gpt2, smollm, llama-bpe)");
        goto fail;
    }
    if (gguf_get_str(f, "tokenizer.ggml.pre", &s, err) || pre_from_name(s, &pre, err)) goto fail;

    int64_t ki = gguf_find_key(f, "tokenizer.ggml.tokens");
    if (ki < 0 || gguf_kv_type(f, (uint64_t)ki) != GGUF_VT_ARRAY || gguf_arr_type(f, (uint64_t)ki) != GGUF_VT_STRING) {
        err_set(err, "tokenizer.ggml.tokens: missing or not a string array");
        goto fail;
    }
    uint64_t n_tok = gguf_arr_len(f, (uint64_t)ki);
    if (n_tok == 0 || n_tok > TOK_MAX_VOCAB) {
        err_set(err, "tokenizer.ggml.tokens: %llu tokens out of range", (unsigned long long)n_tok);
        goto fail;
    }
    int64_t ti = gguf_find_key(f, "tokenizer.ggml.token_type");
    if (ti >= 0 && (gguf_kv_type(f, (uint64_t)ti) != GGUF_VT_ARRAY || gguf_arr_len(f, (uint64_t)ti) != n_tok)) {
        err_set(err, "tokenizer.ggml.token_type: not an array of %llu", (unsigned long long)n_tok);
        goto fail;
    }
    if (!(t = tok_alloc((int32_t)n_tok, err))) goto fail;
    t->pre = pre;
    /* llama.cpp matches whole pieces against the vocabulary for llama-bpe,
     * as Llama 3's tokenizer.json does with ignore_merges. */
    t->ignore_merges = pre == TOK_PRE_LLAMA3;

    size_t max_len = 0;
    for (uint64_t j = 0; j < n_tok; j++) {
        int64_t type = 1;
        if (gguf_arr_str(f, (uint64_t)ki, j, &s) || (ti >= 0 && gguf_arr_i64(f, (uint64_t)ti, j, &type))) {
            err_set(err, "tokenizer.ggml.tokens[%llu]: unreadable", (unsigned long long)j);
            goto fail;
        }
        /* 3 control: special; 4 user-defined: added, matched in text. */
        uint8_t flags = type == 3 ? ENT_ADDED | ENT_SPECIAL : type == 4 ? ENT_ADDED : 0;
        if (entry_set(t, (int32_t)j, s.ptr, s.len, flags, err)) goto fail;
        if (s.len > max_len) max_len = s.len;
    }
    if (build_vocab(t, err)) goto fail;

    int64_t mi = gguf_find_key(f, "tokenizer.ggml.merges");
    if (mi < 0 || gguf_kv_type(f, (uint64_t)mi) != GGUF_VT_ARRAY || gguf_arr_type(f, (uint64_t)mi) != GGUF_VT_STRING) {
        err_set(err, "tokenizer.ggml.merges: missing or not a string array");
        goto fail;
    }
    uint64_t n_merges = gguf_arr_len(f, (uint64_t)mi);
    if (merges_alloc(t, n_merges, err)) goto fail;
    if (!(scratch = malloc(2 * max_len + 1))) {
        err_set(err, "out of memory");
        goto fail;
    }
    for (uint64_t j = 0; j < n_merges; j++) {
        if (gguf_arr_str(f, (uint64_t)mi, j, &s)) {
            err_set(err, "tokenizer.ggml.merges[%llu]: unreadable", (unsigned long long)j);
            goto fail;
        }
        const char *sp = memchr(s.ptr, ' ', s.len);
        size_t ll = sp ? (size_t)(sp - s.ptr) : 0;
        if (!sp || ll == 0 || ll + 1 >= s.len || s.len > 2 * max_len + 1) {
            err_set(err, "tokenizer.ggml.merges[%llu]: \"%.*s\" is not \"left right\"", (unsigned long long)j,
                    (int)(s.len > 64 ? 64 : s.len), s.ptr);
            goto fail;
        }
        if (merge_add(t, s.ptr, ll, sp + 1, s.len - ll - 1, (uint32_t)j, scratch, err)) goto fail;
    }

    if (gguf_opt_id(f, "tokenizer.ggml.bos_token_id", t->n_vocab, &t->bos, err) ||
        gguf_opt_id(f, "tokenizer.ggml.eos_token_id", t->n_vocab, &t->eos, err))
        goto fail;
    if (gguf_find_key(f, "tokenizer.ggml.add_bos_token") >= 0 &&
        gguf_get_bool(f, "tokenizer.ggml.add_bos_token", &t->add_bos, err))
        goto fail;
    if (gguf_find_key(f, "tokenizer.chat_template") >= 0) {
        if (gguf_get_str(f, "tokenizer.chat_template", &s, err)) goto fail;
        if (!(t->chat_template = strndup(s.ptr, s.len))) {
            err_set(err, "out of memory");
            goto fail;
        }
    }
    if (build_finish(t, err)) goto fail;
    free(scratch);
    *out = t;
    return AE_OK;
fail:
    free(scratch);
    tok_free(t);
    err_prefix(err, "%s: ", gguf_path(f) ? gguf_path(f) : "gguf");
    return AE_ERR;
}

/* ------------------------------------------------------------------------ */
/* tokenizer.json */

static const char *json_type_of(const cJSON *j) {
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(j, "type");
    return cJSON_IsString(ty) ? ty->valuestring : "?";
}

static bool json_is(const cJSON *j, const char *type) {
    return cJSON_IsObject(j) && strcmp(json_type_of(j), type) == 0;
}

static bool json_true(const cJSON *j, const char *key) {
    return cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(j, key));
}

static bool json_null_or_absent(const cJSON *j, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    return !v || cJSON_IsNull(v) || (cJSON_IsString(v) && v->valuestring[0] == '\0');
}

/* A ByteLevel pre-tokenizer with the given use_regex and no prefix space
 * (use_regex defaults to true, as in HF). */
static bool json_is_byte_level(const cJSON *j, bool use_regex) {
    if (!json_is(j, "ByteLevel") || json_true(j, "add_prefix_space")) return false;
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(j, "use_regex");
    bool has_regex = !r || cJSON_IsTrue(r);
    return has_regex == use_regex;
}

static const char LLAMA3_REGEX[] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}|"
                                   " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

static bool json_is_llama3_split(const cJSON *j) {
    if (!json_is(j, "Split")) return false;
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(j, "pattern");
    const cJSON *re = cJSON_GetObjectItemCaseSensitive(pat, "Regex");
    const cJSON *beh = cJSON_GetObjectItemCaseSensitive(j, "behavior");
    return cJSON_IsString(re) && strcmp(re->valuestring, LLAMA3_REGEX) == 0 && cJSON_IsString(beh) &&
           strcmp(beh->valuestring, "Isolated") == 0 && !json_true(j, "invert");
}

static int json_pre(const cJSON *pt, tok_pre *out, ae_error *err) {
    if (json_is_byte_level(pt, true)) {
        *out = TOK_PRE_GPT2;
        return AE_OK;
    }
    if (json_is(pt, "Sequence")) {
        const cJSON *seq = cJSON_GetObjectItemCaseSensitive(pt, "pretokenizers");
        if (cJSON_GetArraySize(seq) == 2) {
            const cJSON *a = cJSON_GetArrayItem(seq, 0), *b = cJSON_GetArrayItem(seq, 1);
            if (json_is(a, "Digits") && json_true(a, "individual_digits") && json_is_byte_level(b, true)) {
                *out = TOK_PRE_SMOLLM;
                return AE_OK;
            }
            if (json_is_llama3_split(a) && json_is_byte_level(b, false)) {
                *out = TOK_PRE_LLAMA3;
                return AE_OK;
            }
        }
    }
    /* Name what was found so the operator can see why it is not one of ours. */
    char found[160] = "";
    size_t n = 0;
    n += (size_t)snprintf(found + n, sizeof found - n, "%s", cJSON_IsObject(pt) ? json_type_of(pt) : "null");
    const cJSON *seq = cJSON_GetObjectItemCaseSensitive(pt, "pretokenizers");
    if (json_is(pt, "Sequence") && cJSON_IsArray(seq)) {
        const cJSON *it;
        const char *sep = "[";
        cJSON_ArrayForEach(it, seq) {
            if (n < sizeof found) n += (size_t)snprintf(found + n, sizeof found - n, "%s%s", sep, json_type_of(it));
            sep = ", ";
        }
        if (n < sizeof found) snprintf(found + n, sizeof found - n, "]");
    }
    return err_set(err,
                   "pre_tokenizer %s is not supported (ByteLevel => gpt2, "
                   "Sequence[Digits, ByteLevel] => smollm, "
                   "Sequence[Split(llama3 regex), ByteLevel(use_regex=false)] => llama3)",
                   found);
}

/* bos_token / eos_token in tokenizer_config.json: a string or {"content"}. */
static int32_t json_token_ref(const tok *t, const cJSON *cfg, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, key);
    if (cJSON_IsObject(v)) v = cJSON_GetObjectItemCaseSensitive(v, "content");
    if (!cJSON_IsString(v)) return -1;
    return tok_find(t, v->valuestring, strlen(v->valuestring));
}

static int json_config(tok *t, const char *path, ae_error *err) {
    /* tokenizer_config.json beside tokenizer.json, if there is one. */
    const char *slash = strrchr(path, '/');
    size_t dir = slash ? (size_t)(slash - path + 1) : 0;
    char *cpath = malloc(dir + sizeof "tokenizer_config.json");
    if (!cpath) return err_set(err, "out of memory");
    memcpy(cpath, path, dir);
    strcpy(cpath + dir, "tokenizer_config.json");

    size_t len;
    bool missing;
    ae_error local = {{0}};
    cJSON *cfg = NULL;
    char *text = NULL;
    file_read_all(cpath, TOK_MAX_JSON, &text, &len, &missing, &local);
    if (!text) {
        free(cpath);
        if (missing) return AE_OK;
        return err_set(err, "%s", local.msg);
    }
    int rc = AE_ERR;
    cfg = json_parse(text, len, &local);
    if (!cJSON_IsObject(cfg)) {
        err_set(err, "%s: %s", cpath, cfg ? "not a JSON object" : local.msg);
        goto done;
    }
    t->bos = json_token_ref(t, cfg, "bos_token");
    t->eos = json_token_ref(t, cfg, "eos_token");
    t->add_bos = json_true(cfg, "add_bos_token");
    const cJSON *tpl = cJSON_GetObjectItemCaseSensitive(cfg, "chat_template");
    if (cJSON_IsArray(tpl)) {
        /* [{name, template}]: the one named "default", else the first. */
        const cJSON *it, *pick = NULL;
        cJSON_ArrayForEach(it, tpl) {
            const cJSON *name = cJSON_GetObjectItemCaseSensitive(it, "name");
            if (!pick || (cJSON_IsString(name) && strcmp(name->valuestring, "default") == 0)) pick = it;
        }
        tpl = cJSON_GetObjectItemCaseSensitive(pick, "template");
    }
    if (cJSON_IsString(tpl) && !(t->chat_template = strdup(tpl->valuestring))) {
        err_set(err, "out of memory");
        goto done;
    }
    rc = AE_OK;
done:
    cJSON_Delete(cfg);
    free(text);
    free(cpath);
    return rc;
}

int tok_load_json(tok **out, const char *path, ae_error *err) {
    tok *t = NULL;
    cJSON *root = NULL;
    char *scratch = NULL;
    size_t len;
    *out = NULL;
    if (!path) return err_set(err, "tok_load_json: no path");

    char *text = NULL;
    file_read_all(path, TOK_MAX_JSON, &text, &len, NULL, err);
    if (!text) return AE_ERR;
    root = json_parse(text, len, err);
    free(text);
    if (!root) goto fail;
    if (!cJSON_IsObject(root)) {
        err_set(err, "not a JSON object");
        goto fail;
    }
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!cJSON_IsObject(model)) {
        err_set(err, "model: missing");
        goto fail;
    }
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(model, "type");
    if (type && !(cJSON_IsString(type) && strcmp(type->valuestring, "BPE") == 0)) {
        err_set(err, "model.type %s is not supported (BPE only)",
                cJSON_IsString(type) ? type->valuestring : "(not a string)");
        goto fail;
    }
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    if (!cJSON_IsObject(vocab)) {
        err_set(err, "model.vocab: missing or not an object");
        goto fail;
    }
    if (!cJSON_IsArray(merges)) {
        err_set(err, "model.merges: missing or not an array");
        goto fail;
    }
    if (!json_null_or_absent(model, "dropout") || !json_null_or_absent(model, "continuing_subword_prefix") ||
        !json_null_or_absent(model, "end_of_word_suffix") || json_true(model, "byte_fallback")) {
        err_set(err, "model: dropout, continuing_subword_prefix, end_of_word_suffix and "
                     "byte_fallback are not supported");
        goto fail;
    }
    const cJSON *norm = cJSON_GetObjectItemCaseSensitive(root, "normalizer");
    if (norm && !cJSON_IsNull(norm)) {
        err_set(err, "normalizer %s is not supported", json_type_of(norm));
        goto fail;
    }
    tok_pre pre = TOK_PRE_GPT2;
    if (json_pre(cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"), &pre, err)) goto fail;

    /* Ids: the vocabulary's and the added tokens'; the largest sets the size. */
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    if (added && !cJSON_IsArray(added) && !cJSON_IsNull(added)) {
        err_set(err, "added_tokens: not an array");
        goto fail;
    }
    int64_t max_id = -1, id = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, vocab) {
        if (!json_int(it, 0, TOK_MAX_VOCAB - 1, &id)) {
            err_set(err, "model.vocab[\"%.64s\"]: id not an integer in 0..%d", it->string, TOK_MAX_VOCAB - 1);
            goto fail;
        }
        if (id > max_id) max_id = id;
    }
    cJSON_ArrayForEach(it, added) {
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(it, "content");
        if (!json_int(cJSON_GetObjectItemCaseSensitive(it, "id"), 0, TOK_MAX_VOCAB - 1, &id) ||
            !cJSON_IsString(content) || content->valuestring[0] == '\0') {
            err_set(err, "added_tokens: an entry without an id in range or content");
            goto fail;
        }
        if (json_true(it, "lstrip") || json_true(it, "rstrip") || json_true(it, "single_word")) {
            err_set(err, "added token \"%.64s\": lstrip/rstrip/single_word are not supported", content->valuestring);
            goto fail;
        }
        if (id > max_id) max_id = id;
    }
    if (!(t = tok_alloc((int32_t)(max_id + 1), err))) goto fail;
    t->pre = pre;
    t->ignore_merges = json_true(model, "ignore_merges");

    size_t max_len = 0;
    cJSON_ArrayForEach(it, vocab) {
        AE_ASSERT(json_int(it, 0, TOK_MAX_VOCAB - 1, &id)); /* checked above */
        if (t->ent[id].text_len) {
            err_set(err, "model.vocab: id %lld used twice", (long long)id);
            goto fail;
        }
        size_t n = strlen(it->string);
        if (n == 0) {
            err_set(err, "model.vocab: empty token (id %lld)", (long long)id);
            goto fail;
        }
        if (entry_set(t, (int32_t)id, it->string, n, 0, err)) goto fail;
        if (n > max_len) max_len = n;
    }
    cJSON_ArrayForEach(it, added) {
        AE_ASSERT(json_int(cJSON_GetObjectItemCaseSensitive(it, "id"), 0, TOK_MAX_VOCAB - 1, &id));
        const char *content = cJSON_GetObjectItemCaseSensitive(it, "content")->valuestring;
        uint8_t flags = ENT_ADDED | (json_true(it, "special") ? ENT_SPECIAL : 0);
        /* The added token's content is what its id means, as in HF. */
        if (entry_set(t, (int32_t)id, content, strlen(content), flags, err)) goto fail;
    }
    if (build_vocab(t, err)) goto fail;

    const cJSON *unk = cJSON_GetObjectItemCaseSensitive(model, "unk_token");
    if (cJSON_IsString(unk)) t->unk = tok_find(t, unk->valuestring, strlen(unk->valuestring));

    if (merges_alloc(t, (uint64_t)cJSON_GetArraySize(merges), err)) goto fail;
    if (!(scratch = malloc(2 * max_len + 1))) {
        err_set(err, "out of memory");
        goto fail;
    }
    uint32_t rank = 0;
    cJSON_ArrayForEach(it, merges) {
        const char *l = NULL, *r = NULL;
        size_t ll = 0, rl = 0;
        if (cJSON_IsString(it)) { /* legacy "left right" */
            const char *sp = strchr(it->valuestring, ' ');
            if (sp) {
                l = it->valuestring;
                ll = (size_t)(sp - l);
                r = sp + 1;
                rl = strlen(r);
            }
        } else if (cJSON_GetArraySize(it) == 2 && cJSON_IsString(cJSON_GetArrayItem(it, 0)) &&
                   cJSON_IsString(cJSON_GetArrayItem(it, 1))) {
            l = cJSON_GetArrayItem(it, 0)->valuestring;
            r = cJSON_GetArrayItem(it, 1)->valuestring;
            ll = strlen(l);
            rl = strlen(r);
        }
        if (!l || ll == 0 || rl == 0 || ll > max_len || rl > max_len) {
            err_set(err,
                    "model.merges[%u]: not \"left right\" or [left, right] of "
                    "vocabulary tokens",
                    rank);
            goto fail;
        }
        if (merge_add(t, l, ll, r, rl, rank, scratch, err)) goto fail;
        rank++;
    }
    if (json_config(t, path, err) || build_finish(t, err)) goto fail;
    cJSON_Delete(root);
    free(scratch);
    *out = t;
    return AE_OK;
fail:
    free(scratch);
    cJSON_Delete(root);
    tok_free(t);
    err_prefix(err, "%s: ", path);
    return AE_ERR;
}

/* ------------------------------------------------------------------------ */
/* Accessors */

int32_t tok_vocab_size(const tok *t) { return t->n_vocab; }
tok_pre tok_pre_kind(const tok *t) { return t->pre; }
int32_t tok_bos(const tok *t) { return t->bos; }
int32_t tok_eos(const tok *t) { return t->eos; }
bool tok_add_bos(const tok *t) { return t->add_bos; }
const char *tok_chat_template(const tok *t) { return t->chat_template; }

const char *tok_pre_name(tok_pre p) {
    switch (p) {
    case TOK_PRE_GPT2: return "gpt2";
    case TOK_PRE_SMOLLM: return "smollm";
    case TOK_PRE_LLAMA3: return "llama3";
    }
    return "?";
}

const uint8_t *tok_token_bytes(const tok *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->n_vocab) {
        *len = 0;
        return NULL;
    }
    *len = t->ent[id].raw_len;
    return t->raw.p + t->ent[id].raw_off;
}

size_t tok_max_token_bytes(const tok *t) { return t->max_token_bytes; }

bool tok_is_special(const tok *t, int32_t id) { return id >= 0 && id < t->n_vocab && (t->ent[id].flags & ENT_SPECIAL); }

int32_t tok_find(const tok *t, const char *s, size_t len) {
    if (!s) return -1;
    return index_find(t, &t->by_text, (const uint8_t *)s, len);
}

/* ------------------------------------------------------------------------ */
/* BPE */

/* Per-call scratch for pieces longer than BPE_SMALL: grown, never shrunk,
 * freed when tok_encode returns. */
typedef struct bpe_scratch {
    void *p;
    size_t cap;
} bpe_scratch;

/* Merges ids[0..n) in place (n <= BPE_SMALL); returns the new count. */
static size_t bpe_small(const tok *t, int32_t *ids, size_t n) {
    uint32_t rank[BPE_SMALL];
    int32_t res[BPE_SMALL];
    for (size_t i = 0; i + 1 < n; i++) rank[i] = merge_rank(t, ids[i], ids[i + 1], &res[i]);
    while (n > 1) {
        size_t k = 0;
        for (size_t i = 1; i + 1 < n; i++)
            if (rank[i] < rank[k]) k = i;
        if (rank[k] == RANK_NONE) break;
        ids[k] = res[k];
        n--;
        memmove(ids + k + 1, ids + k + 2, (n - k - 1) * sizeof *ids);
        if (k + 1 < n) {
            memmove(rank + k + 1, rank + k + 2, (n - k - 2) * sizeof *rank);
            memmove(res + k + 1, res + k + 2, (n - k - 2) * sizeof *res);
            rank[k] = merge_rank(t, ids[k], ids[k + 1], &res[k]);
        }
        if (k > 0) rank[k - 1] = merge_rank(t, ids[k - 1], ids[k], &res[k - 1]);
    }
    return n;
}

static inline void heap_push(uint64_t *h, size_t *n, uint64_t v) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (h[p] <= v) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = v;
}

static inline uint64_t heap_pop(uint64_t *h, size_t *n) {
    uint64_t top = h[0], v = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && h[c + 1] < h[c]) c++;
        if (v <= h[c]) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = v;
    return top;
}

/* The same merges as bpe_small for any n, with a heap of (rank, position):
 * the key orders by rank, then leftmost. Entries go stale when a neighbour
 * merges; one is still valid iff its pair still has that rank. */
static int bpe_large(const tok *t, int32_t *ids, size_t *n_io, bpe_scratch *sc) {
    size_t n = *n_io;
    size_t need = n * (3 * sizeof(int32_t)) + 3 * n * sizeof(uint64_t);
    if (need > sc->cap) {
        void *p = realloc(sc->p, need);
        if (!p) return AE_ERR;
        sc->p = p;
        sc->cap = need;
    }
    uint64_t *heap = sc->p;
    int32_t *prev = (int32_t *)(heap + 3 * n), *next = prev + n, *sym = next + n;
    size_t hn = 0;
    int32_t res;
    for (size_t i = 0; i < n; i++) {
        sym[i] = ids[i];
        prev[i] = (int32_t)i - 1;
        next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    for (size_t i = 0; i + 1 < n; i++) {
        uint32_t r = merge_rank(t, sym[i], sym[i + 1], &res);
        if (r != RANK_NONE) heap_push(heap, &hn, (uint64_t)r << 32 | i);
    }
    while (hn) {
        uint64_t top = heap_pop(heap, &hn);
        uint32_t r = (uint32_t)(top >> 32), pos = (uint32_t)top;
        if (sym[pos] < 0 || next[pos] < 0) continue;
        int32_t nx = next[pos];
        if (merge_rank(t, sym[pos], sym[nx], &res) != r) continue;
        sym[pos] = res;
        sym[nx] = -1;
        next[pos] = next[nx];
        if (next[pos] >= 0) prev[next[pos]] = (int32_t)pos;
        if (prev[pos] >= 0) {
            uint32_t pr = merge_rank(t, sym[prev[pos]], sym[pos], &res);
            if (pr != RANK_NONE) heap_push(heap, &hn, (uint64_t)pr << 32 | (uint32_t)prev[pos]);
        }
        if (next[pos] >= 0) {
            uint32_t nr = merge_rank(t, sym[pos], sym[next[pos]], &res);
            if (nr != RANK_NONE) heap_push(heap, &hn, (uint64_t)nr << 32 | pos);
        }
    }
    size_t m = 0;
    for (int32_t i = 0; i >= 0; i = next[i]) ids[m++] = sym[i];
    *n_io = m;
    return AE_OK;
}

static bool cache_get(const tok *t, uint64_t h, const uint8_t *w, size_t n, int32_t *ids, size_t *n_ids) {
    uint32_t slot = (uint32_t)h & (CACHE_SLOTS - 1);
    const cache_slot *c = &t->cache[slot];
    pthread_mutex_t *lock = (pthread_mutex_t *)&t->locks[slot & (CACHE_LOCKS - 1)];
    bool hit = false;
    pthread_mutex_lock(lock);
    if (c->hash == h && c->len == n && memcmp(c->word, w, n) == 0) {
        memcpy(ids, c->ids, c->n * sizeof *ids);
        *n_ids = c->n;
        hit = true;
    }
    pthread_mutex_unlock(lock);
    return hit;
}

static void cache_put(const tok *t, uint64_t h, const uint8_t *w, size_t n, const int32_t *ids, size_t n_ids) {
    uint32_t slot = (uint32_t)h & (CACHE_SLOTS - 1);
    /* The cache is the one mutable part of a tokenizer; it is behind locks. */
    cache_slot *c = (cache_slot *)&t->cache[slot];
    pthread_mutex_t *lock = (pthread_mutex_t *)&t->locks[slot & (CACHE_LOCKS - 1)];
    pthread_mutex_lock(lock);
    c->hash = h;
    c->len = (uint8_t)n;
    c->n = (uint8_t)n_ids;
    memcpy(c->word, w, n);
    memcpy(c->ids, ids, n_ids * sizeof *ids);
    pthread_mutex_unlock(lock);
}

/* Encodes one pre-tokenized piece into out (room for n ids). Returns the
 * count, or -1 when memory for a very long piece cannot be had. */
static long bpe_piece(const tok *t, const uint8_t *w, size_t n, int32_t *out, bpe_scratch *sc) {
    if (n == 1) {
        int32_t id = t->byte_id[w[0]] >= 0 ? t->byte_id[w[0]] : t->unk;
        if (id < 0) return 0;
        out[0] = id;
        return 1;
    }
    if (t->ignore_merges) {
        int32_t id = index_find(t, &t->by_raw, w, n);
        if (id >= 0) {
            out[0] = id;
            return 1;
        }
    }
    uint64_t h = 0;
    size_t m;
    if (n <= CACHE_WORD_MAX) {
        h = hash_bytes(w, n);
        if (cache_get(t, h, w, n, out, &m)) return (long)m;
    }
    m = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->byte_id[w[i]] >= 0 ? t->byte_id[w[i]] : t->unk;
        if (id >= 0) out[m++] = id;
    }
    if (m <= BPE_SMALL) {
        m = bpe_small(t, out, m);
    } else if (bpe_large(t, out, &m, sc)) {
        return -1;
    }
    if (n <= CACHE_WORD_MAX && m <= CACHE_IDS_MAX) cache_put(t, h, w, n, out, m);
    return (long)m;
}

/* The next added token in s[from..len): its start and id, or false. Leftmost
 * first, then longest, then the lowest id, walked in the trie from each
 * position. Special tokens count only when `special` is set; other added
 * tokens are always split out, as the reference library does. */
static bool find_added(const tok *t, const uint8_t *s, size_t len, size_t from, bool special, size_t *at, int32_t *id) {
    if (t->n_added == 0) return false;
    for (size_t i = from; i < len; i++) {
        if (t->added_first >= 0) {
            const uint8_t *p = memchr(s + i, t->added_first, len - i);
            if (!p) return false;
            i = (size_t)(p - s);
        }
        int32_t best = -1;
        for (uint32_t k = t->added_root[s[i]], j = 1; k; j++) {
            const added_node *nd = &t->added[k];
            int32_t here = special ? nd->id : nd->id_plain;
            if (here >= 0) best = here;
            if (i + j >= len) break;
            for (k = nd->child; k && t->added[k].byte != s[i + j]; k = t->added[k].sibling) {
            }
        }
        if (best >= 0) {
            *at = i;
            *id = best;
            return true;
        }
    }
    return false;
}

int tok_encode(const tok *t, const char *text, size_t len, int flags, int32_t *ids, size_t cap, size_t *n_out,
               ae_error *err) {
    *n_out = 0;
    if (!t) return err_set(err, "tok_encode: no tokenizer");
    if (!text && len) return err_set(err, "tok_encode: NULL text");
    if (cap && !ids) return err_set(err, "tok_encode: NULL ids");
    const uint8_t *s = (const uint8_t *)text;
    bpe_scratch sc = {0};
    int32_t *tmp = NULL; /* pieces that may not fit the caller's room */
    size_t tmp_cap = 0, n = 0;
    int rc = AE_OK;

    if ((flags & TOK_ADD_BOS) && t->add_bos && t->bos >= 0) {
        if (cap < 1) goto small;
        ids[n++] = t->bos;
    }
    size_t pos = 0;
    while (pos < len) {
        size_t seg_end = len, sp_at = len;
        int32_t sp_id = -1;
        if (find_added(t, s, len, pos, (flags & TOK_PARSE_SPECIAL) != 0, &sp_at, &sp_id)) seg_end = sp_at;
        while (pos < seg_end) {
            size_t end = pretok_next(t->pre, s + pos, seg_end - pos, 0) + pos;
            /* A piece of k bytes never yields more than k ids; when the
             * caller's room is shorter, encode aside and copy if it fits. */
            size_t plen = end - pos;
            int32_t *dst = ids + n;
            if (cap - n < plen) {
                if (plen > tmp_cap) {
                    int32_t *p = realloc(tmp, plen * sizeof *tmp);
                    if (!p) goto oom;
                    tmp = p;
                    tmp_cap = plen;
                }
                dst = tmp;
            }
            long k = bpe_piece(t, s + pos, plen, dst, &sc);
            if (k < 0) goto oom;
            if (dst != ids + n) {
                if ((size_t)k > cap - n) goto small;
                if (k) memcpy(ids + n, dst, (size_t)k * sizeof *ids);
            }
            n += (size_t)k;
            pos = end;
        }
        if (sp_id >= 0) {
            if (n >= cap) goto small;
            ids[n++] = sp_id;
            pos = sp_at + t->ent[sp_id].raw_len;
        }
    }
    *n_out = n;
    goto done;
small:
    rc = err_set(err, "tok_encode: %zu ids is not enough room (len + 1 = %zu always is)", cap, len + 1);
    goto done;
oom:
    rc = err_set(err, "tok_encode: out of memory");
done:
    free(tmp);
    free(sc.p);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Decode */

typedef struct sink {
    char *out;
    size_t cap; /* bytes of out, NUL included */
    size_t len; /* bytes produced, written or not */
} sink;

static inline void sink_put(sink *k, const uint8_t *p, size_t n) {
    if (k->cap && k->len < k->cap - 1) {
        size_t room = k->cap - 1 - k->len;
        memcpy(k->out + k->len, p, n < room ? n : room);
    }
    k->len += n;
}

int tok_decode(const tok *t, const int32_t *ids, size_t n, bool skip_special, char *out, size_t cap, size_t *len_out,
               ae_error *err) {
    *len_out = 0;
    if (!t) return err_set(err, "tok_decode: no tokenizer");
    if (n && !ids) return err_set(err, "tok_decode: NULL ids");
    if (cap && !out) return err_set(err, "tok_decode: NULL out");
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= t->n_vocab)
            return err_set(err, "tok_decode: id %ld at %zu out of range (vocabulary %ld)", (long)ids[i], i,
                           (long)t->n_vocab);
    sink k = {out, cap, 0};
    /* Lossy UTF-8 repair is detok's byte layer, so a streamed decode and
     * this one cannot disagree. Long tokens go through in slices. */
    enum { SLICE = 256 };
    char buf[DETOK_UTF8_MAX_OUT(SLICE)];
    detok_utf8 u;
    detok_utf8_init(&u);
    for (size_t i = 0; i < n; i++) {
        const tok_entry *e = &t->ent[ids[i]];
        if (skip_special && (e->flags & ENT_SPECIAL)) continue;
        const uint8_t *p = t->raw.p + e->raw_off;
        for (size_t j = 0; j < e->raw_len; j += SLICE) {
            size_t c = e->raw_len - j < SLICE ? e->raw_len - j : SLICE;
            sink_put(&k, (const uint8_t *)buf, detok_utf8_push(&u, p + j, c, buf, sizeof buf));
        }
    }
    sink_put(&k, (const uint8_t *)buf, detok_utf8_flush(&u, buf, sizeof buf));
    if (cap) out[k.len < cap ? k.len : cap - 1] = '\0';
    *len_out = k.len;
    return AE_OK;
}
