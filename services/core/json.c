#include "json.h"

#include <stdlib.h>
#include <string.h>

#include "file.h"

static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* A NUL byte anywhere, or a \u0000 escape inside a string. Only string
 * contents hold backslashes in valid JSON, so skipping each escaped
 * character is enough to tell "\\u0000" (text) from "\u0000". */
static int scan_nul(const char *s, size_t len, ae_error *err) {
    for (size_t i = 0; i < len; i++) {
        if (s[i] == '\0') return err_set(err, "a NUL byte at byte %zu", i);
        if (s[i] != '\\' || i + 1 >= len) continue;
        if (s[i + 1] == 'u' && len - i >= 6 && memcmp(s + i + 2, "0000", 4) == 0)
            return err_set(err, "a \\u0000 escape at byte %zu is not supported", i);
        i++;
    }
    return AE_OK;
}

cJSON *json_parse(const char *text, size_t len, ae_error *err) {
    if (len > 0 && text[len - 1] == '\0') len--;
    if (scan_nul(text, len, err) != AE_OK) return NULL;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, false);
    if (!root) {
        size_t at = end && end >= text && end <= text + len ? (size_t)(end - text) : 0;
        err_set(err, "not valid JSON (near byte %zu)", at);
        return NULL;
    }
    for (const char *p = end; p < text + len; p++) {
        if (!is_space(*p)) {
            cJSON_Delete(root);
            err_set(err, "trailing data after the JSON value at byte %zu", (size_t)(p - text));
            return NULL;
        }
    }
    return root;
}

bool json_int(const cJSON *v, int64_t lo, int64_t hi, int64_t *out) {
    if (!cJSON_IsNumber(v)) return false;
    double d = v->valuedouble;
    if (!(d >= (double)lo && d <= (double)hi)) return false; /* also NaN */
    int64_t i = (int64_t)d;
    if ((double)i != d) return false;
    *out = i;
    return true;
}

cJSON *json_read_file(const char *path, size_t max_bytes, ae_error *err) {
    char *buf;
    size_t size;
    if (file_read_all(path, max_bytes, &buf, &size, NULL, err) != AE_OK) return NULL;
    cJSON *root = json_parse(buf, size, err);
    free(buf);
    if (!root) err_prefix(err, "%s: ", path);
    return root;
}
