#include "toolcall.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "../services/core/json.h"
#include "jbuf.h"

/* One call from text[0..len), added to calls. */
static bool add_call(cJSON *calls, const char *text, size_t len, const char *const *names, int n_names, const char *id,
                     bool with_index) {
    cJSON *o = json_parse(text, len, NULL);
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(o, "name"),
                *args = cJSON_GetObjectItemCaseSensitive(o, "arguments");
    bool known = false;
    for (int k = 0; cJSON_IsString(name) && k < n_names; k++) known |= strcmp(names[k], name->valuestring) == 0;
    bool ok = false;
    if (known && cJSON_IsObject(args)) {
        char *a = cJSON_PrintUnformatted(args), cid[96];
        int k = cJSON_GetArraySize(calls);
        snprintf(cid, sizeof cid, "call_%.64s_%d", id, k);
        cJSON *c = cJSON_CreateObject(), *fn = NULL;
        ok = a && c && (!with_index || cJSON_AddNumberToObject(c, "index", k)) &&
             cJSON_AddStringToObject(c, "id", cid) && cJSON_AddStringToObject(c, "type", "function") &&
             (fn = cJSON_AddObjectToObject(c, "function")) && cJSON_AddStringToObject(fn, "name", name->valuestring) &&
             cJSON_AddStringToObject(fn, "arguments", a) && cJSON_AddItemToArray(calls, c);
        if (!ok) cJSON_Delete(c);
        cJSON_free(a);
    }
    cJSON_Delete(o);
    return ok;
}

char *toolcall_find(const char *text, size_t len, bool whole, const char *const *names, int n_names, const char *id,
                    bool with_index, char **rest) {
    *rest = NULL;
    cJSON *calls = cJSON_CreateArray();
    if (!calls) return NULL;
    jbuf other = {0};
    if (whole) {
        add_call(calls, text, len, names, n_names, id, with_index);
    } else {
        const char *p = text, *end = text + len;
        for (;;) {
            const char *open = memmem(p, (size_t)(end - p), "<tool_call>", 11);
            if (!open) break;
            const char *body = open + 11, *close = memmem(body, (size_t)(end - body), "</tool_call>", 12);
            if (!add_call(calls, body, (size_t)((close ? close : end) - body), names, n_names, id, with_index)) break;
            jbuf_add(&other, p, (size_t)(open - p));
            p = close ? close + 12 : end;
        }
        jbuf_add(&other, p, (size_t)(end - p));
    }
    char *out = NULL;
    if (cJSON_GetArraySize(calls) > 0 && !other.oom) {
        out = cJSON_PrintUnformatted(calls);
        size_t a = 0, b = other.len;
        while (a < b && (other.p[a] == ' ' || other.p[a] == '\n')) a++;
        while (b > a && (other.p[b - 1] == ' ' || other.p[b - 1] == '\n')) b--;
        if (out && b > a && (*rest = malloc(b - a + 1))) {
            memcpy(*rest, other.p + a, b - a);
            (*rest)[b - a] = '\0';
        }
    }
    jbuf_free(&other);
    cJSON_Delete(calls);
    return out;
}
