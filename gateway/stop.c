#include "stop.h"

#include <stdlib.h>
#include <string.h>

struct stop_matcher {
    int n;
    char *str[STOP_MAX_STRINGS];
    size_t len[STOP_MAX_STRINGS];
    size_t longest;
    size_t max_piece;
    char *work; /* held tail + the piece being looked at: [longest - 1 + max_piece] */
    size_t held;
    bool matched;
};

int stop_init(stop_matcher **out, const char *const *stops, const size_t *lens, int n, size_t max_piece,
              ae_error *err) {
    *out = NULL;
    if (n < 0 || n > STOP_MAX_STRINGS) return err_set(err, "%d stop strings (at most %d)", n, STOP_MAX_STRINGS);
    stop_matcher *m = calloc(1, sizeof *m);
    if (!m) return err_set(err, "out of memory");
    m->max_piece = max_piece;
    for (int i = 0; i < n; i++) {
        if (lens[i] < 1 || lens[i] > STOP_MAX_BYTES) {
            err_set(err, "stop string %d has %zu bytes (1 to %d)", i, lens[i], STOP_MAX_BYTES);
            goto fail;
        }
        m->str[i] = malloc(lens[i]);
        if (!m->str[i]) {
            err_set(err, "out of memory");
            goto fail;
        }
        memcpy(m->str[i], stops[i], lens[i]);
        m->len[i] = lens[i];
        m->n = i + 1;
        if (lens[i] > m->longest) m->longest = lens[i];
    }
    m->work = malloc(stop_max_out(m) + 1);
    if (!m->work) {
        err_set(err, "out of memory");
        goto fail;
    }
    *out = m;
    return AE_OK;
fail:
    stop_free(m);
    return AE_ERR;
}

void stop_free(stop_matcher *m) {
    if (!m) return;
    for (int i = 0; i < m->n; i++) free(m->str[i]);
    free(m->work);
    free(m);
}

size_t stop_max_out(const stop_matcher *m) { return (m->longest ? m->longest - 1 : 0) + m->max_piece; }

bool stop_matched(const stop_matcher *m) { return m->matched; }

/* Length of the longest tail of s[0..n) that is a proper prefix of a stop
 * string: the bytes that must wait for the next piece. */
static size_t tail_to_hold(const stop_matcher *m, const char *s, size_t n) {
    size_t best = 0;
    for (int i = 0; i < m->n; i++) {
        size_t k = m->len[i] - 1 < n ? m->len[i] - 1 : n;
        for (; k > best; k--)
            if (memcmp(s + n - k, m->str[i], k) == 0) {
                best = k;
                break;
            }
    }
    return best;
}

/* Start of the earliest match in s[0..n), or n when there is none. */
static size_t first_match(const stop_matcher *m, const char *s, size_t n) {
    size_t first = n;
    for (int i = 0; i < m->n; i++) {
        if (m->len[i] > n) continue;
        const char *hit = memmem(s, n, m->str[i], m->len[i]);
        if (hit && (size_t)(hit - s) < first) first = (size_t)(hit - s);
    }
    return first;
}

bool stop_push(stop_matcher *m, const char *in, size_t n, char *out, size_t cap, size_t *out_len) {
    AE_ASSERT(n <= m->max_piece && cap >= stop_max_out(m));
    *out_len = 0;
    if (m->matched) return true;
    if (m->n == 0) {
        memcpy(out, in, n);
        *out_len = n;
        return false;
    }
    memcpy(m->work + m->held, in, n);
    size_t len = m->held + n;
    /* The match that starts earliest wins. A whole match is final only
     * when no stop string that starts before it could still be completed
     * by later text; otherwise everything from that earlier start is held
     * (a proper prefix of a stop string, so it fits), the match with it,
     * and the next piece or the flush decides. */
    size_t first = first_match(m, m->work, len);
    size_t hold_from = len - tail_to_hold(m, m->work, len);
    if (first < len && first <= hold_from) {
        memcpy(out, m->work, first);
        *out_len = first;
        m->held = 0;
        m->matched = true;
        return true;
    }
    memcpy(out, m->work, hold_from);
    *out_len = hold_from;
    memmove(m->work, m->work + hold_from, len - hold_from);
    m->held = len - hold_from;
    return false;
}

size_t stop_flush(stop_matcher *m, char *out, size_t cap) {
    AE_ASSERT(cap >= m->held);
    if (m->matched) return 0;
    /* No more text: a match held while a longer stop was still possible
     * is now final. */
    size_t n = first_match(m, m->work, m->held);
    if (n < m->held) m->matched = true;
    memcpy(out, m->work, n);
    m->held = 0;
    return n;
}
