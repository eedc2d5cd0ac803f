/* The gateway's JSON writer: a growing text buffer that replies and
 * stream events are written into. An allocation failure marks the buffer
 * (oom) and drops what is added after it, so that writers need not check
 * each call: the reply becomes a 503 instead.
 *
 * A counter (JBUF_COUNTER) stores nothing: its len adds up what the same
 * writers would have written, so a reply's size is known, from the very
 * code that writes it, before any of it is built. */
#ifndef AERIE_GATEWAY_JBUF_H
#define AERIE_GATEWAY_JBUF_H

#include <stdbool.h>
#include <stddef.h>

typedef struct jbuf {
    char *p; /* NUL-terminated once anything was added */
    size_t len, cap;
    bool oom;   /* an allocation failed: what was added since is lost */
    bool count; /* a counter: p stays NULL, len counts */
} jbuf;

#define JBUF_COUNTER ((jbuf){.count = true})

/* Room for `more` bytes (and the NUL) past len; false (and oom) when out
 * of memory, false for a counter (it has no room). */
bool jbuf_reserve(jbuf *b, size_t more);
void jbuf_add(jbuf *b, const char *s, size_t n);
void jbuf_str(jbuf *b, const char *s);
void jbuf_printf(jbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* s[0..n) (valid UTF-8) as a JSON string, quotes included. */
void jbuf_quote(jbuf *b, const char *s, size_t n);
/* The bytes jbuf_quote adds for s[0..n). */
size_t jbuf_quoted_len(const char *s, size_t n);
void jbuf_clear(jbuf *b); /* empty, and the oom mark cleared */
void jbuf_free(jbuf *b);

#endif
