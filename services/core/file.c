#include "file.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int file_read_all(const char *path, size_t limit, char **out, size_t *len, bool *missing, ae_error *err) {
    *out = NULL;
    *len = 0;
    if (missing) *missing = false;
    FILE *fp = fopen(path, "rb");
    if (!fp) {
        if (missing) *missing = errno == ENOENT;
        return err_set(err, "%s: cannot open: %s", path, strerror(errno));
    }
    char *buf = NULL;
    size_t n = 0, cap = 0;
    struct stat sb;
    if (fstat(fileno(fp), &sb) != 0 || S_ISDIR(sb.st_mode)) {
        err_set(err, "%s: not a regular file", path);
        goto fail;
    }
    /* A regular file's size is known: one allocation (one byte spare, so
     * EOF is seen without growing). A pipe grows by doubling. */
    cap = 4096;
    if (S_ISREG(sb.st_mode)) {
        if ((unsigned long long)sb.st_size > limit) {
            err_set(err, "%s: %lld bytes exceeds the limit of %zu", path, (long long)sb.st_size, limit);
            goto fail;
        }
        cap = (size_t)sb.st_size + 1;
    }
    if (cap > limit + 1) cap = limit + 1;
    if (!(buf = malloc(cap + 1))) {
        err_set(err, "%s: out of memory", path);
        goto fail;
    }
    for (;;) {
        if (n == cap) {
            if (n > limit) break;
            size_t ncap = cap * 2 > limit + 1 ? limit + 1 : cap * 2;
            char *nb = realloc(buf, ncap + 1);
            if (!nb) {
                err_set(err, "%s: out of memory", path);
                goto fail;
            }
            buf = nb;
            cap = ncap;
        }
        size_t got = fread(buf + n, 1, cap - n, fp);
        n += got;
        if (got == 0) break;
    }
    if (ferror(fp)) {
        err_set(err, "%s: read error", path);
        goto fail;
    }
    if (n > limit) {
        err_set(err, "%s: more than %zu bytes", path, limit);
        goto fail;
    }
    buf[n] = '\0';
    fclose(fp);
    *out = buf;
    *len = n;
    return AE_OK;
fail:
    free(buf);
    fclose(fp);
    return AE_ERR;
}

int file_write_full(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n > 0) {
        ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

int file_read_full(int fd, void *p, size_t n) {
    char *c = p;
    while (n > 0) {
        ssize_t r = read(fd, c, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        c += r;
        n -= (size_t)r;
    }
    return 0;
}
