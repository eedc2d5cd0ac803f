/* libFuzzer target: a request head as it comes off a socket. The parser
 * reads only the bytes it was given (the copy is exactly that long, so
 * ASan sees any read past it) and either asks for more, refuses with one
 * of its statuses and a reason, or returns a head whose strings all lie,
 * NUL-terminated, inside the bytes it took. Each input is parsed twice:
 * with room for all of it, and with a small head limit. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../gateway/http.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* s is a string that ends before buf + end. */
static void check_inside(const char *s, const char *buf, size_t end) {
    AE_ASSERT(s && s >= buf && s < buf + end);
    AE_ASSERT(memchr(s, '\0', (size_t)(buf + end - s)) != NULL);
}

static void check(const uint8_t *data, size_t size, size_t max_head) {
    char *buf = malloc(size ? size : 1);
    AE_ASSERT(buf);
    if (size) memcpy(buf, data, size);
    static http_head h;
    const char *why = NULL;
    int rc = http_parse_head(size ? buf : NULL, size, max_head, &h, &why);
    if (rc < 0) {
        AE_ASSERT(rc == -400 || rc == -414 || rc == -431 || rc == -505);
        AE_ASSERT(why && *why);
    } else if (rc == 0) {
        AE_ASSERT(size < max_head);
    } else {
        size_t n = (size_t)rc;
        AE_ASSERT(n <= size && n <= max_head);
        AE_ASSERT(n >= 4 && memcmp(data + n - 4, "\r\n\r\n", 4) == 0);
        check_inside(h.method, buf, n);
        check_inside(h.target, buf, n);
        AE_ASSERT(h.target[0] == '/');
        AE_ASSERT(h.path == h.target ||
                  (h.path == h.path_buf && strlen(h.path) <= HTTP_MAX_PATH &&
                   strncmp(h.path, h.target, strlen(h.path)) == 0 && h.target[strlen(h.path)] == '?'));
        AE_ASSERT(h.minor == 0 || h.minor == 1);
        AE_ASSERT(h.n_headers >= 0 && h.n_headers <= HTTP_MAX_HEADERS);
        for (int i = 0; i < h.n_headers; i++) {
            check_inside(h.headers[i].name, buf, n);
            check_inside(h.headers[i].value, buf, n);
            AE_ASSERT(http_head_get(&h, h.headers[i].name) != NULL);
        }
        AE_ASSERT(h.content_length >= -1);
        AE_ASSERT(h.content_length == -1 || http_head_get(&h, "content-length") != NULL);
        AE_ASSERT(!h.expect_continue || h.minor == 1);
    }
    free(buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    check(data, size, size + 1);
    check(data, size, 64);
    return 0;
}
