/* Streaming detokenizer: token ids in, text out, never a partial UTF-8
 * character out.
 *
 * Two layers:
 *
 * 1. detok_utf8_*: a byte-level streaming UTF-8 repairer that needs no
 *    tokenizer. Bytes of an incomplete character are held back until the
 *    character completes. Invalid input becomes U+FFFD exactly as Rust's
 *    String::from_utf8_lossy (and Python's bytes.decode("utf-8", "replace"))
 *    does it: one U+FFFD per "maximal subpart" (Unicode ch. 3, "U+FFFD
 *    Substitution of Maximal Subparts"). So for any split of a byte string
 *    into pushes, the concatenated output plus the final flush equals the
 *    lossy decoding of the whole string.
 *
 * 2. detok_*: feeds tok_token_bytes() of each id through layer 1. The
 *    concatenation of every chunk pushed plus detok_flush() equals
 *    tok_decode() of the whole id list with the same skip_special.
 *
 * Neither layer allocates per token: layer 1 is 6 bytes of state, layer 2
 * allocates once in detok_init and writes into caller buffers sized once
 * from detok_max_out(). Output chunks are not NUL-terminated. */
#ifndef AERIE_TOKENIZER_DETOK_H
#define AERIE_TOKENIZER_DETOK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/err.h"
#include "tok.h"

/* ---- layer 1: streaming UTF-8 ------------------------------------------ */

/* Plain data on purpose (like mbstate_t): callers embed it. Treat the fields
 * as private; start from detok_utf8_init. */
typedef struct detok_utf8 {
    uint8_t pend[4]; /* bytes of the character being completed */
    uint8_t n_pend;  /* 0..3 bytes held back */
    uint8_t need;    /* length of that character, 2..4 (0 when none) */
} detok_utf8;

/* Most bytes detok_utf8_push can write for n input bytes: every byte may
 * become a 3-byte U+FFFD, plus one U+FFFD for bytes held from earlier. */
#define DETOK_UTF8_MAX_OUT(n) (3 * (size_t)(n) + 3)

void detok_utf8_init(detok_utf8 *u);

/* Consumes in[0..n) and writes to out every character completed, or
 * U+FFFD for every maximal invalid subpart. Returns the bytes written.
 * cap must be at least DETOK_UTF8_MAX_OUT(n) (asserted: the caller sizes
 * the buffer, input cannot make it overflow). */
size_t detok_utf8_push(detok_utf8 *u, const void *in, size_t n, char *out, size_t cap);

/* Ends the stream: a held-back incomplete character becomes one U+FFFD
 * (that is what from_utf8_lossy does with a truncated tail). Returns the
 * bytes written (0 or 3); cap must be at least 3. The state is reset. */
size_t detok_utf8_flush(detok_utf8 *u, char *out, size_t cap);

/* True while bytes are held back. */
bool detok_utf8_pending(const detok_utf8 *u);

/* True if s[0..n) is entirely valid UTF-8 (no surrogates, no overlongs,
 * nothing above U+10FFFF, no truncated character at the end). */
bool detok_utf8_valid(const void *s, size_t n);

/* ---- layer 2: token ids ------------------------------------------------ */

typedef struct detok detok;

/* The tokenizer must outlive the detokenizer. skip_special drops special
 * tokens exactly as tok_decode(skip_special) does. */
int detok_init(detok **out, const tok *t, bool skip_special, ae_error *err);

void detok_free(detok *d); /* NULL is a no-op */

/* Starts a new stream (drops held-back bytes). */
void detok_reset(detok *d);

/* Most bytes one detok_push or detok_flush writes, computed once from the
 * longest token in the vocabulary. Size the chunk buffer with it. */
size_t detok_max_out(const detok *d);

/* Appends token id to the stream and writes the text that is now complete
 * to out[0..*len_out). An id out of range or a cap below what this token
 * may need is AE_ERR and leaves the stream as it was. */
int detok_push(detok *d, int32_t id, char *out, size_t cap, size_t *len_out, ae_error *err);

/* Ends the stream (see detok_utf8_flush) and resets it. Returns the bytes
 * written (0 or 3); cap must be at least 3 (asserted). */
size_t detok_flush(detok *d, char *out, size_t cap);

/* True while bytes of an incomplete character are held back. */
bool detok_pending(const detok *d);

#endif
