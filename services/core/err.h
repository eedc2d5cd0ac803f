/* Error conventions (STYLE.md 3).
 *
 * Runtime failures: a function returns AE_OK or AE_ERR and fills the
 * caller's ae_error with one line of text. The first error is kept, later
 * ones are dropped, so the message names the root cause. A NULL ae_error is
 * allowed and discards the text.
 *
 * Broken invariants: AE_ASSERT is always on (also in release builds); it
 * prints the condition, file and line, then aborts. */
#ifndef AERIE_CORE_ERR_H
#define AERIE_CORE_ERR_H

#include <stdbool.h>
#include <stddef.h>

enum { AE_OK = 0, AE_ERR = -1 };

#define AE_ERR_MAX 512

typedef struct ae_error {
    char msg[AE_ERR_MAX]; /* NUL-terminated; empty when no error is set */
} ae_error;

/* Sets the error text unless one is already set. Returns AE_ERR so callers
 * can write `return err_set(err, "...")`. */
int err_set(ae_error *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Prepends context ("file.gguf: ") to an error already set. */
void err_prefix(ae_error *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static inline bool err_is_set(const ae_error *err) { return err && err->msg[0] != '\0'; }

static inline void err_clear(ae_error *err) {
    if (err) err->msg[0] = '\0';
}

__attribute__((noreturn)) void err_assert_fail(const char *cond, const char *file, int line);

#define AE_ASSERT(cond) ((cond) ? (void)0 : err_assert_fail(#cond, __FILE__, __LINE__))

#endif
