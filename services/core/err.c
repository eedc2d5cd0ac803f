#include "err.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int err_set(ae_error *err, const char *fmt, ...) {
    if (!err || err->msg[0] != '\0') return AE_ERR;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    if (err->msg[0] == '\0') snprintf(err->msg, sizeof err->msg, "error");
    return AE_ERR;
}

void err_prefix(ae_error *err, const char *fmt, ...) {
    if (!err) return;
    char prefix[AE_ERR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    /* Shift the old text right; whatever does not fit is cut at the end. */
    size_t pl = strlen(prefix), ol = strlen(err->msg);
    if (pl > AE_ERR_MAX - 1) pl = AE_ERR_MAX - 1;
    if (pl + ol > AE_ERR_MAX - 1) ol = AE_ERR_MAX - 1 - pl;
    memmove(err->msg + pl, err->msg, ol);
    memcpy(err->msg, prefix, pl);
    err->msg[pl + ol] = '\0';
}

void err_assert_fail(const char *cond, const char *file, int line) {
    fprintf(stderr, "fatal assertion failed: %s at %s:%d\n", cond, file, line);
    fflush(stderr);
    abort();
}
