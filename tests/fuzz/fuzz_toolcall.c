/* libFuzzer target for toolcall_find (gateway/toolcall.h): the tool calls
 * in a finished chat reply.
 *
 * Input: one byte of flags, then the reply's text (any bytes, NULs too).
 *   bit 0: whole (the grammar made the reply one call)
 *   bit 1: with_index (a stream's delta)
 *   bit 2: an id of 80 characters (the call ids keep its first 64)
 *   bits 3-4: k, the known tools are the first 3 - k of
 *             get_weather, add, search_web
 * Seeds: tests/fuzz/corpus/toolcall, replies as models write them.
 *
 * Beyond "no crash, leak or sanitizer report", what it checks:
 *   - the answer is the same when asked twice (no hidden state);
 *   - the calls are a JSON list, at most one when whole and at most one
 *     per <tool_call> tag otherwise, each exactly {"index"?, "id", "type",
 *     "function": {"name", "arguments"}} in that order, the index and the
 *     id's number its place in the list, the id call_<id's first 64>_<k>,
 *     the name one of the known tools, the arguments the compact text of
 *     a JSON object (parsing and printing it again gives the same text);
 *   - with_index changes nothing but the "index" keys;
 *   - rest is NULL with no calls or when whole; otherwise NULL or
 *     non-empty, trimmed of spaces and newlines, and made of the text's
 *     own bytes in their order (the calls taken out). */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "../../gateway/toolcall.h"
#include "../../services/core/json.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *const NAMES[3] = {"get_weather", "add", "search_web"};
static const char LONG_ID[] = "chatcmpl-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef01234567";

#define CHECK(cond) \
    do { \
        if (!(cond)) { \
            fprintf(stderr, "fuzz_toolcall: %s:%d: %s\n", __FILE__, __LINE__, #cond); \
            abort(); \
        } \
    } while (0)

static size_t count_tags(const char *text, size_t len) {
    size_t n = 0;
    for (const char *p = text, *end = text + len; (p = memmem(p, (size_t)(end - p), "<tool_call>", 11)); p += 11) n++;
    return n;
}

/* Whether s (n bytes) is a subsequence of text[0..len). */
static bool subsequence(const char *s, size_t n, const char *text, size_t len) {
    size_t i = 0;
    for (size_t j = 0; i < n && j < len; j++)
        if (text[j] == s[i]) i++;
    return i == n;
}

static bool str_eq(const char *a, const char *b) { return (!a && !b) || (a && b && strcmp(a, b) == 0); }

/* The checks on one answer; returns its calls' count. */
static int check_calls(const char *out, bool with_index, const char *id, int n_names) {
    cJSON *calls = cJSON_Parse(out);
    CHECK(cJSON_IsArray(calls));
    int k = 0;
    const cJSON *c;
    cJSON_ArrayForEach(c, calls) {
        CHECK(cJSON_IsObject(c));
        const cJSON *f = c->child;
        if (with_index) {
            CHECK(f && !strcmp(f->string, "index") && cJSON_IsNumber(f) && f->valuedouble == k);
            f = f->next;
        }
        char want[128];
        snprintf(want, sizeof want, "call_%.64s_%d", id, k);
        CHECK(f && !strcmp(f->string, "id") && cJSON_IsString(f) && !strcmp(f->valuestring, want));
        f = f->next;
        CHECK(f && !strcmp(f->string, "type") && cJSON_IsString(f) && !strcmp(f->valuestring, "function"));
        f = f->next;
        CHECK(f && !strcmp(f->string, "function") && cJSON_IsObject(f) && !f->next);
        const cJSON *name = f->child, *args = name ? name->next : NULL;
        CHECK(name && !strcmp(name->string, "name") && cJSON_IsString(name));
        bool known = false;
        for (int i = 0; i < n_names; i++) known |= !strcmp(name->valuestring, NAMES[i]);
        CHECK(known);
        CHECK(args && !strcmp(args->string, "arguments") && cJSON_IsString(args) && !args->next);
        cJSON *a = json_parse(args->valuestring, strlen(args->valuestring), NULL);
        CHECK(cJSON_IsObject(a));
        char *again = cJSON_PrintUnformatted(a);
        CHECK(again && !strcmp(again, args->valuestring));
        cJSON_free(again);
        cJSON_Delete(a);
        k++;
    }
    cJSON_Delete(calls);
    return k;
}

/* The calls of a with_index answer with their "index" keys taken out. */
static char *without_index(const char *out) {
    cJSON *calls = cJSON_Parse(out);
    CHECK(calls);
    cJSON *c;
    cJSON_ArrayForEach(c, calls) cJSON_DeleteItemFromObjectCaseSensitive(c, "index");
    char *s = cJSON_PrintUnformatted(calls);
    CHECK(s);
    cJSON_Delete(calls);
    return s;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const bool whole = data[0] & 1, with_index = data[0] & 2;
    const char *id = data[0] & 4 ? LONG_ID : "fz";
    const int n_names = 3 - ((data[0] >> 3) & 3);
    /* The text in a block of exactly its size, so that ASan sees a read
     * past its end. */
    size_t len = size - 1;
    char *text = malloc(len ? len : 1);
    if (!text) return 0;
    if (len) memcpy(text, data + 1, len);

    char *rest = (char *)1, *rest2 = (char *)1, *rest3 = (char *)1;
    char *out = toolcall_find(text, len, whole, NAMES, n_names, id, with_index, &rest);
    char *out2 = toolcall_find(text, len, whole, NAMES, n_names, id, with_index, &rest2);
    CHECK(str_eq(out, out2) && str_eq(rest, rest2));
    char *other = toolcall_find(text, len, whole, NAMES, n_names, id, !with_index, &rest3);
    CHECK(str_eq(rest, rest3) && !out == !other);

    if (!out) {
        CHECK(!rest);
    } else {
        int n = check_calls(out, with_index, id, n_names);
        CHECK(n >= 1 && n_names > 0);
        CHECK(whole ? n == 1 : (size_t)n <= count_tags(text, len));
        CHECK(check_calls(other, !with_index, id, n_names) == n);
        char *plain = without_index(with_index ? out : other);
        CHECK(!strcmp(plain, with_index ? other : out));
        free(plain);
        if (whole) CHECK(!rest);
        if (rest) {
            size_t r = strlen(rest); /* up to a NUL the text may hold */
            CHECK(r == 0 || (rest[0] != ' ' && rest[0] != '\n'));
            CHECK(r <= len && subsequence(rest, r, text, len));
            if (!memchr(text, 0, len)) /* then r is all of it */
                CHECK(r > 0 && rest[r - 1] != ' ' && rest[r - 1] != '\n');
        }
    }
    free(out);
    free(out2);
    free(other);
    free(rest);
    free(rest2);
    free(rest3);
    free(text);
    return 0;
}
