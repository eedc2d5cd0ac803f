/* Stop strings on a stream of text.
 *
 * Text arrives in pieces (one per detokenized token, stop.c does not care
 * where they were cut) and a stop string may straddle any number of them.
 * The matcher releases text only once it is known not to be part of a
 * stop string: a tail that could still begin one is held back until the
 * next piece decides it. On a match everything before the stop string is
 * released and the rest of the stream is dropped, so a client never sees
 * any part of a stop string, and the streamed text equals the text of a
 * whole reply however the pieces were cut.
 *
 * Which match wins: the one that starts earliest in the whole text (at
 * one start, the stop strings give the same released text, so which of
 * them it is does not matter). A shorter stop string found inside the
 * beginning of a longer one therefore waits: with stops "abcd" and "bc",
 * "xabc" holds "abc" until the next piece says whether "abcd" comes
 * (release "x") or not (release "xa").
 *
 * Released text always ends on a character boundary when the input is
 * valid UTF-8 (the held tail starts where a stop string starts).
 *
 * Buffers are sized once at init from the largest piece; pushing never
 * allocates. */
#ifndef AERIE_GATEWAY_STOP_H
#define AERIE_GATEWAY_STOP_H

#include <stdbool.h>
#include <stddef.h>

#include "../services/core/err.h"

#define STOP_MAX_STRINGS 16
#define STOP_MAX_BYTES 256 /* per stop string */

typedef struct stop_matcher stop_matcher;

/* stops[i][0..lens[i]) for i < n (0 <= n <= STOP_MAX_STRINGS, each 1 to
 * STOP_MAX_BYTES bytes). max_piece: the most bytes one stop_push gets. */
int stop_init(stop_matcher **out, const char *const *stops, const size_t *lens, int n, size_t max_piece, ae_error *err);
void stop_free(stop_matcher *m); /* NULL is a no-op */

/* Most bytes one stop_push or stop_flush writes. */
size_t stop_max_out(const stop_matcher *m);

/* Takes in[0..n) (n <= max_piece, asserted) and writes to out the text now
 * safe to release, *out_len bytes (cap >= stop_max_out). Returns true when
 * a stop string matched: out then ends just before it, and every later push
 * releases nothing. */
bool stop_push(stop_matcher *m, const char *in, size_t n, char *out, size_t cap, size_t *out_len);

/* The stream ended without a match from stop_push: releases the held
 * tail, or the part of it before a match that was waiting on a longer
 * stop string (stop_matched is then true). */
size_t stop_flush(stop_matcher *m, char *out, size_t cap);

bool stop_matched(const stop_matcher *m);

#endif
