/* Reading a whole file in a test (header-only; cmocka asserts inside). */
#ifndef AERIE_TESTS_TEST_IO_H
#define AERIE_TESTS_TEST_IO_H

#include <stdio.h>
#include <stdlib.h>

/* The file's bytes plus a NUL, malloc'd; *len gets the size when len is
 * not NULL. Fails the test when the file cannot be read. */
static inline char *test_read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open %s (run from the repo root)", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = '\0';
    fclose(f);
    if (len) *len = (size_t)n;
    return buf;
}

#endif
