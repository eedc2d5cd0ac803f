#include "jbuf.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../services/core/err.h"

bool jbuf_reserve(jbuf *b, size_t more) {
    if (b->oom || b->count) return false;
    if (b->len + more + 1 <= b->cap) return true;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + more + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        b->oom = true;
        return false;
    }
    b->p = p;
    b->cap = cap;
    return true;
}

void jbuf_add(jbuf *b, const char *s, size_t n) {
    if (b->count) {
        b->len += n;
        return;
    }
    if (!jbuf_reserve(b, n)) return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

void jbuf_str(jbuf *b, const char *s) { jbuf_add(b, s, strlen(s)); }

void jbuf_printf(jbuf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    AE_ASSERT(n >= 0);
    if (b->count) {
        b->len += (size_t)n;
        return;
    }
    if (!jbuf_reserve(b, (size_t)n)) return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

size_t jbuf_quoted_len(const char *s, size_t n) {
    size_t k = n + 2;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\' || c == '\n')
            k += 1;
        else if (c < 0x20)
            k += 5;
    }
    return k;
}

void jbuf_quote(jbuf *b, const char *s, size_t n) {
    if (b->count) {
        b->len += jbuf_quoted_len(s, n);
        return;
    }
    if (!jbuf_reserve(b, 6 * n + 2)) return;
    char *w = b->p + b->len;
    *w++ = '"';
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            *w++ = '\\';
            *w++ = (char)c;
        } else if (c == '\n') {
            *w++ = '\\', *w++ = 'n';
        } else if (c < 0x20) {
            w += sprintf(w, "\\u%04x", c);
        } else {
            *w++ = (char)c;
        }
    }
    *w++ = '"';
    b->len = (size_t)(w - b->p);
    b->p[b->len] = '\0';
}

void jbuf_clear(jbuf *b) {
    b->len = 0;
    b->oom = false;
}

void jbuf_free(jbuf *b) {
    free(b->p);
    *b = (jbuf){0};
}
