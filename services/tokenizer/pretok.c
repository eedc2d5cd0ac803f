/* Pre-tokenizer scanners; see pretok.h for the regexes they implement.
 *
 * Each scanner tries the regex's alternatives in order at `pos` and returns
 * the end of the first that matches (leftmost-first, as Oniguruma does). The
 * only backtracking any alternative needs is in the whitespace rules, worked
 * out once here:
 *   \s+(?!\S)     the whitespace run, minus its last character when a
 *                 non-space follows (and the run is longer than one)
 *   \s*[\r\n]+    the whitespace run up to and including its last \r or \n */
#include "pretok.h"

#include <stdbool.h>

#include "unicode_tables.h"

/* Returned by look() past the end of the text, and in smollm mode for a
 * number, which the Digits pre-tokenizer has already cut out: the gpt2 regex
 * sees each stretch between numbers as a whole text. */
#define CLS_END 4

int pretok_class(uint32_t cp) {
    if (cp >= 0x110000) return PRETOK_OTHER;
    return unicode_tables_stage2[(size_t)unicode_tables_stage1[cp >> UNICODE_TABLES_BLOCK_SHIFT]
                                     << UNICODE_TABLES_BLOCK_SHIFT |
                                 (cp & UNICODE_TABLES_BLOCK_MASK)];
}

const char *pretok_unicode_version(void) { return UNICODE_TABLES_VERSION; }

static inline bool is_cont(uint8_t b) { return (b & 0xC0) == 0x80; }

size_t pretok_char(const uint8_t *s, size_t len, int *cls) {
    uint8_t b = s[0];
    if (b < 0x80) {
        *cls = unicode_tables_stage2[b]; /* block 0 of stage2 is U+0000..U+007F */
        return 1;
    }
    uint32_t cp;
    size_t n;
    /* Well-formed sequences per Unicode table 3-7; the second byte's range
     * depends on the lead to rule out overlongs, surrogates and > U+10FFFF. */
    if (b >= 0xC2 && b <= 0xDF) {
        if (len < 2 || !is_cont(s[1])) goto bad;
        cp = (uint32_t)(b & 0x1F) << 6 | (s[1] & 0x3F);
        n = 2;
    } else if (b >= 0xE0 && b <= 0xEF) {
        uint8_t lo = b == 0xE0 ? 0xA0 : 0x80, hi = b == 0xED ? 0x9F : 0xBF;
        if (len < 3 || s[1] < lo || s[1] > hi || !is_cont(s[2])) goto bad;
        cp = (uint32_t)(b & 0x0F) << 12 | (uint32_t)(s[1] & 0x3F) << 6 | (s[2] & 0x3F);
        n = 3;
    } else if (b >= 0xF0 && b <= 0xF4) {
        uint8_t lo = b == 0xF0 ? 0x90 : 0x80, hi = b == 0xF4 ? 0x8F : 0xBF;
        if (len < 4 || s[1] < lo || s[1] > hi || !is_cont(s[2]) || !is_cont(s[3])) goto bad;
        cp = (uint32_t)(b & 0x07) << 18 | (uint32_t)(s[1] & 0x3F) << 12 | (uint32_t)(s[2] & 0x3F) << 6 | (s[3] & 0x3F);
        n = 4;
    } else {
        goto bad;
    }
    *cls = pretok_class(cp);
    return n;
bad:
    *cls = PRETOK_OTHER;
    return 1;
}

static inline int look(const uint8_t *s, size_t len, size_t i, bool split_digits, size_t *n) {
    if (i >= len) {
        *n = 0;
        return CLS_END;
    }
    int c;
    *n = pretok_char(s + i, len - i, &c);
    if (split_digits && c == PRETOK_NUMBER) return CLS_END;
    return c;
}

/* End of the run of characters of class `cls` starting at i. */
static inline size_t run_of(const uint8_t *s, size_t len, size_t i, int cls, bool split_digits) {
    size_t n;
    /* ASCII letters dominate most text: skip them without decoding. */
    if (cls == PRETOK_LETTER)
        while (i < len && (uint8_t)((s[i] | 0x20) - 'a') < 26) i++;
    while (look(s, len, i, split_digits, &n) == cls) i += n;
    return i;
}

/* \s+(?!\S)|\s+ from pos, which holds a space character. */
static size_t space_run(const uint8_t *s, size_t len, size_t pos, bool split_digits) {
    size_t i = pos, last = pos, n;
    int c;
    while ((c = look(s, len, i, split_digits, &n)) == PRETOK_SPACE) {
        last = i;
        i += n;
    }
    if (c == CLS_END) return i;  /* (?!\S) holds at the end */
    if (last > pos) return last; /* give back one space to the next piece */
    return i;                    /* a lone space before \S: \s+ */
}

static size_t gpt2_next(const uint8_t *s, size_t len, size_t pos, bool split_digits) {
    int c0;
    size_t n1, n0 = pretok_char(s + pos, len - pos, &c0);
    if (split_digits && c0 == PRETOK_NUMBER) return pos + n0;

    uint8_t b = s[pos];
    if (b == '\'' && pos + 1 < len) {
        uint8_t b1 = s[pos + 1];
        if (b1 == 's' || b1 == 't' || b1 == 'm' || b1 == 'd') return pos + 2;
        if (pos + 2 < len) {
            uint8_t b2 = s[pos + 2];
            if ((b1 == 'r' && b2 == 'e') || (b1 == 'v' && b2 == 'e') || (b1 == 'l' && b2 == 'l')) return pos + 3;
        }
    }
    if (b == ' ') {
        int c1 = look(s, len, pos + 1, split_digits, &n1);
        if (c1 == PRETOK_LETTER || c1 == PRETOK_NUMBER || c1 == PRETOK_OTHER)
            return run_of(s, len, pos + 1, c1, split_digits);
    }
    if (c0 != PRETOK_SPACE) return run_of(s, len, pos, c0, split_digits);
    return space_run(s, len, pos, split_digits);
}

static inline bool is_crlf(uint8_t b) { return b == '\r' || b == '\n'; }

/* (?i:'s|'t|'re|'ve|'m|'ll|'d) at pos (s[pos] == '\''): length or 0.
 * Oniguruma folds case with Unicode rules, so 's' also matches U+017F LATIN
 * SMALL LETTER LONG S; no other character folds to these letters. */
static size_t llama3_contraction(const uint8_t *s, size_t len, size_t pos) {
    if (pos + 1 >= len) return 0;
    uint8_t b1 = s[pos + 1] | 0x20;
    if (s[pos + 1] < 0x80 && (b1 == 's' || b1 == 't' || b1 == 'm' || b1 == 'd')) return 2;
    if (s[pos + 1] == 0xC5 && pos + 2 < len && s[pos + 2] == 0xBF) return 3;
    if (pos + 2 >= len || s[pos + 1] >= 0x80 || s[pos + 2] >= 0x80) return 0;
    uint8_t b2 = s[pos + 2] | 0x20;
    if ((b1 == 'r' && b2 == 'e') || (b1 == 'v' && b2 == 'e') || (b1 == 'l' && b2 == 'l')) return 3;
    return 0;
}

static size_t llama3_next(const uint8_t *s, size_t len, size_t pos) {
    uint8_t b = s[pos];
    if (b == '\'') {
        size_t k = llama3_contraction(s, len, pos);
        if (k) return pos + k;
    }
    int c0;
    size_t n1, n0 = pretok_char(s + pos, len - pos, &c0);

    /* [^\r\n\p{L}\p{N}]?\p{L}+ */
    if (c0 == PRETOK_LETTER) return run_of(s, len, pos, PRETOK_LETTER, false);
    if (c0 != PRETOK_NUMBER && !is_crlf(b) && look(s, len, pos + n0, false, &n1) == PRETOK_LETTER)
        return run_of(s, len, pos + n0, PRETOK_LETTER, false);

    /* \p{N}{1,3} */
    if (c0 == PRETOK_NUMBER) {
        size_t i = pos + n0;
        for (int k = 1; k < 3 && look(s, len, i, false, &n1) == PRETOK_NUMBER; k++) i += n1;
        return i;
    }

    /*  ?[^\s\p{L}\p{N}]+[\r\n]* */
    size_t start = len;
    if (c0 == PRETOK_OTHER)
        start = pos;
    else if (b == ' ' && look(s, len, pos + 1, false, &n1) == PRETOK_OTHER)
        start = pos + 1;
    if (start < len) {
        size_t i = run_of(s, len, start, PRETOK_OTHER, false);
        while (i < len && is_crlf(s[i])) i++;
        return i;
    }

    /* c0 is a space: \s*[\r\n]+ first, then \s+(?!\S)|\s+ */
    size_t i = pos, nl_end = 0;
    while (look(s, len, i, false, &n1) == PRETOK_SPACE) {
        if (is_crlf(s[i])) nl_end = i + 1;
        i += n1;
    }
    if (nl_end) return nl_end;
    return space_run(s, len, pos, false);
}

size_t pretok_next(tok_pre kind, const uint8_t *s, size_t len, size_t pos) {
    switch (kind) {
    case TOK_PRE_GPT2: return gpt2_next(s, len, pos, false);
    case TOK_PRE_SMOLLM: return gpt2_next(s, len, pos, true);
    case TOK_PRE_LLAMA3: return llama3_next(s, len, pos);
    }
    AE_ASSERT(!"unknown pre-tokenizer");
    return len;
}
