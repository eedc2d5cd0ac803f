/* Streaming detokenizer. See detok.h for the contract. */
#include "detok.h"

#include <stdlib.h>
#include <string.h>

/* U+FFFD REPLACEMENT CHARACTER in UTF-8. */
static const uint8_t REPLACEMENT[3] = {0xEF, 0xBF, 0xBD};

/* ---- layer 1 ----------------------------------------------------------- */

/* Length of the character a lead byte starts, or 0 if the byte can never
 * start one (continuation bytes, C0/C1 which could only be overlong, and
 * F5..FF which would exceed U+10FFFF). Table 3-7 of the Unicode standard. */
static unsigned seq_len(uint8_t b) {
    if (b >= 0xC2 && b <= 0xDF) return 2;
    if (b >= 0xE0 && b <= 0xEF) return 3;
    if (b >= 0xF0 && b <= 0xF4) return 4;
    return 0;
}

/* Range allowed for the byte after a lead. The narrowed ranges are what
 * excludes overlongs (E0, F0), surrogates (ED) and > U+10FFFF (F4) at the
 * earliest byte, which is what makes the maximal subpart end there. */
static void second_range(uint8_t lead, uint8_t *lo, uint8_t *hi) {
    *lo = 0x80;
    *hi = 0xBF;
    switch (lead) {
    case 0xE0: *lo = 0xA0; break;
    case 0xED: *hi = 0x9F; break;
    case 0xF0: *lo = 0x90; break;
    case 0xF4: *hi = 0x8F; break;
    default: break;
    }
}

void detok_utf8_init(detok_utf8 *u) {
    AE_ASSERT(u != NULL);
    memset(u, 0, sizeof *u);
}

bool detok_utf8_pending(const detok_utf8 *u) {
    AE_ASSERT(u != NULL);
    return u->n_pend > 0;
}

/* One input byte. Writes at most 6 bytes to out (a U+FFFD for a broken
 * subpart, then a U+FFFD for b itself) and returns how many; *bad is set
 * when a replacement was written. */
static size_t step(detok_utf8 *u, uint8_t b, uint8_t *out, bool *bad) {
    size_t w = 0;
    if (u->n_pend > 0) {
        uint8_t lo = 0x80, hi = 0xBF;
        if (u->n_pend == 1) second_range(u->pend[0], &lo, &hi);
        if (b >= lo && b <= hi) {
            u->pend[u->n_pend++] = b;
            if (u->n_pend < u->need) return 0;
            memcpy(out, u->pend, u->need);
            w = u->need;
            u->n_pend = 0;
            u->need = 0;
            return w;
        }
        /* The held bytes are a maximal subpart: one U+FFFD for all of them,
         * and b starts afresh (it is not part of that subpart). */
        memcpy(out, REPLACEMENT, 3);
        w = 3;
        *bad = true;
        u->n_pend = 0;
        u->need = 0;
    }
    if (b < 0x80) {
        out[w++] = b;
        return w;
    }
    unsigned len = seq_len(b);
    if (len == 0) {
        memcpy(out + w, REPLACEMENT, 3);
        *bad = true;
        return w + 3;
    }
    u->pend[0] = b;
    u->n_pend = 1;
    u->need = (uint8_t)len;
    return w;
}

size_t detok_utf8_push(detok_utf8 *u, const void *in, size_t n, char *out, size_t cap) {
    AE_ASSERT(u != NULL);
    AE_ASSERT(n == 0 || in != NULL);
    AE_ASSERT(n <= (SIZE_MAX - 3) / 3);
    AE_ASSERT(out != NULL && cap >= DETOK_UTF8_MAX_OUT(n));
    const uint8_t *p = in;
    size_t w = 0;
    bool bad = false;
    for (size_t i = 0; i < n; i++) {
        uint8_t tmp[6];
        size_t k = step(u, p[i], tmp, &bad);
        /* The bound in DETOK_UTF8_MAX_OUT is a proof, not a hope: check it
         * anyway so a mistake in it is an abort, not an overflow. */
        AE_ASSERT(w + k <= cap);
        memcpy(out + w, tmp, k);
        w += k;
    }
    return w;
}

size_t detok_utf8_flush(detok_utf8 *u, char *out, size_t cap) {
    AE_ASSERT(u != NULL && out != NULL && cap >= 3);
    if (u->n_pend == 0) return 0;
    detok_utf8_init(u);
    memcpy(out, REPLACEMENT, 3);
    return 3;
}

bool detok_utf8_valid(const void *s, size_t n) {
    AE_ASSERT(n == 0 || s != NULL);
    const uint8_t *p = s;
    detok_utf8 u;
    detok_utf8_init(&u);
    bool bad = false;
    for (size_t i = 0; i < n && !bad; i++) {
        uint8_t tmp[6];
        (void)step(&u, p[i], tmp, &bad);
    }
    return !bad && u.n_pend == 0;
}

/* ---- layer 2 ----------------------------------------------------------- */

struct detok {
    const tok *t;
    bool skip_special;
    size_t max_token_len; /* longest tok_token_bytes() in the vocabulary */
    detok_utf8 u;
};

int detok_init(detok **out, const tok *t, bool skip_special, ae_error *err) {
    AE_ASSERT(out != NULL);
    *out = NULL;
    if (t == NULL) return err_set(err, "detok_init: no tokenizer");
    int32_t n_vocab = tok_vocab_size(t);
    if (n_vocab <= 0) return err_set(err, "detok_init: tokenizer has an empty vocabulary");

    /* The longest token bounds one chunk, so detok_max_out is a constant
     * the caller can size its buffer with before the first token. The
     * tokenizer knows it from loading: a gateway makes a detokenizer per
     * request, and a pass over the vocabulary each time cost more than the
     * request's tokens. */
    size_t max_len = tok_max_token_bytes(t);
    if (max_len > (SIZE_MAX - 3) / 3) return err_set(err, "detok_init: token of %zu bytes is too long", max_len);

    detok *d = calloc(1, sizeof *d);
    if (d == NULL) return err_set(err, "detok_init: out of memory");
    d->t = t;
    d->skip_special = skip_special;
    d->max_token_len = max_len;
    detok_utf8_init(&d->u);
    *out = d;
    return AE_OK;
}

void detok_free(detok *d) { free(d); }

void detok_reset(detok *d) {
    AE_ASSERT(d != NULL);
    detok_utf8_init(&d->u);
}

size_t detok_max_out(const detok *d) {
    AE_ASSERT(d != NULL);
    return DETOK_UTF8_MAX_OUT(d->max_token_len);
}

int detok_push(detok *d, int32_t id, char *out, size_t cap, size_t *len_out, ae_error *err) {
    AE_ASSERT(d != NULL && len_out != NULL);
    *len_out = 0;
    size_t len = 0;
    const uint8_t *bytes = tok_token_bytes(d->t, id, &len);
    if (bytes == NULL)
        return err_set(err, "detok_push: token id %d out of range [0, %d)", (int)id, (int)tok_vocab_size(d->t));
    if (d->skip_special && tok_is_special(d->t, id)) return AE_OK;
    if (out == NULL || cap < DETOK_UTF8_MAX_OUT(len))
        return err_set(err, "detok_push: buffer of %zu bytes, token %d may need %zu", cap, (int)id,
                       DETOK_UTF8_MAX_OUT(len));
    *len_out = detok_utf8_push(&d->u, bytes, len, out, cap);
    return AE_OK;
}

size_t detok_flush(detok *d, char *out, size_t cap) {
    AE_ASSERT(d != NULL);
    return detok_utf8_flush(&d->u, out, cap);
}

bool detok_pending(const detok *d) {
    AE_ASSERT(d != NULL);
    return detok_utf8_pending(&d->u);
}
