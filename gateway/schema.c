#include "schema.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../services/core/err.h"

typedef struct walk {
    const cJSON *root;
    int nodes;
    int literals;         /* enum values and consts */
    size_t literal_bytes; /* their JSON text */
    int alternatives;     /* anyOf entries */
    char *why;
    size_t cap;
} walk;

/* The JSON text of a literal, counted against SCHEMA_MAX_LITERAL_BYTES. */
static size_t literal_bytes(const cJSON *v) {
    if (cJSON_IsString(v)) return strlen(v->valuestring) + 2;
    char *t = cJSON_PrintUnformatted(v);
    size_t n = t ? strlen(t) : SCHEMA_MAX_LITERAL_BYTES + 1;
    cJSON_free(t);
    return n;
}

/* Counts n literals starting at v (a list's first, or one const). */
static int count_literals(walk *w, const cJSON *v, bool list, const char *key, const char *at) {
    for (; v; v = list ? v->next : NULL) {
        w->literals++;
        w->literal_bytes += literal_bytes(v);
        if (w->literals > SCHEMA_MAX_ENUM_TOTAL)
            return snprintf(w->why, w->cap,
                            "the document has more than %d enum values and consts (limit reached at %s)",
                            SCHEMA_MAX_ENUM_TOTAL, at),
                   AE_ERR;
        if (w->literal_bytes > SCHEMA_MAX_LITERAL_BYTES)
            return snprintf(w->why, w->cap,
                            "the document's enum values and consts take more than %d bytes of JSON (limit reached "
                            "at %s)",
                            SCHEMA_MAX_LITERAL_BYTES, at),
                   AE_ERR;
        if (!list) break;
    }
    (void)key;
    return AE_OK;
}

/* "'key' at place what" */
static int refuse(walk *w, const char *key, const char *at, const char *what) {
    snprintf(w->why, w->cap, "'%.60s' at %s %s", key, at, what);
    return AE_ERR;
}

static const char *const annotations[] = {"title", "description", "$schema", "$id", "$comment", "examples"};
static const char *const types[] = {"object", "array", "string", "integer", "number", "boolean", "null"};

static bool one_of(const char *s, const char *const *list, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (strcmp(s, list[i]) == 0) return true;
    return false;
}

/* A JSON pointer ("#/a/b") to a schema in the document. */
static const cJSON *resolve(const cJSON *root, const char *ref) {
    if (strncmp(ref, "#/", 2) != 0) return NULL;
    const cJSON *at = root;
    const char *p = ref + 2;
    if (!*p) return NULL; /* "#/": a key that is the empty string */
    while (*p) {
        char key[256];
        size_t n = strcspn(p, "/");
        if (n == 0 || n >= sizeof key) return NULL;
        memcpy(key, p, n);
        key[n] = '\0';
        if (strchr(key, '~')) return NULL; /* escaped pointers: not in the subset */
        at = cJSON_IsObject(at) ? cJSON_GetObjectItemCaseSensitive(at, key) : NULL;
        if (!at) return NULL;
        p += n + (p[n] == '/');
    }
    return cJSON_IsObject(at) ? at : NULL;
}

static int check(walk *w, const cJSON *s, const char *at, int depth);

static int check_child(walk *w, const cJSON *s, const char *at, const char *key, const char *sub, int depth) {
    char where[512];
    snprintf(where, sizeof where, "%s/%s%s%s", at, key, sub ? "/" : "", sub ? sub : "");
    return check(w, s, where, depth + 1);
}

static bool is_count(const cJSON *v) {
    return cJSON_IsNumber(v) && v->valuedouble >= 0 && v->valuedouble <= 1e9 &&
           v->valuedouble == (double)(long)v->valuedouble;
}

static const cJSON *num(const cJSON *s, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(s, key);
    return cJSON_IsNumber(v) ? v : NULL;
}

/* Whether s says its type is integer (alone or in a list). */
static bool says_integer(const cJSON *s) {
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(s, "type");
    if (cJSON_IsString(t)) return strcmp(t->valuestring, "integer") == 0;
    for (const cJSON *e = cJSON_IsArray(t) ? t->child : NULL; e; e = e->next)
        if (cJSON_IsString(e) && strcmp(e->valuestring, "integer") != 0) return false;
    return cJSON_IsArray(t) && t->child;
}

/* A pattern's counted repetitions ({m}, {m,}, {m,n}): outside a character
 * class and not escaped. Each grows the grammar by its bound. */
static int check_pattern(walk *w, const char *p, const char *at) {
    int quantifiers = 0;
    bool in_class = false;
    for (const char *c = p; *c; c++) {
        if (*c == '\\') {
            if (!*++c) break;
        } else if (in_class) {
            in_class = *c != ']';
        } else if (*c == '[') {
            in_class = true;
            if (c[1] == ']') c++; /* "[]...]": the first ] is a member */
        } else if (*c == '{' && c[1] >= '0' && c[1] <= '9') {
            char *end;
            long lo = strtol(c + 1, &end, 10), hi = lo;
            if (*end == ',') {
                if (end[1] >= '0' && end[1] <= '9')
                    hi = strtol(end + 1, &end, 10);
                else
                    end++; /* {m,}: m counts */
            }
            if (*end != '}') continue; /* not a quantifier: a literal brace */
            if (++quantifiers > SCHEMA_MAX_PATTERN_QUANTIFIERS)
                return snprintf(w->why, w->cap, "'pattern' at %s has more than %d counted repetitions ({m,n})", at,
                                SCHEMA_MAX_PATTERN_QUANTIFIERS),
                       AE_ERR;
            long most = hi > lo ? hi : lo;
            if (most > SCHEMA_MAX_PATTERN_REPEAT)
                return snprintf(w->why, w->cap, "'pattern' at %s repeats up to %ld times in one {m,n}; at most %d", at,
                                most, SCHEMA_MAX_PATTERN_REPEAT),
                       AE_ERR;
            c = end;
        }
    }
    return AE_OK;
}

/* An object's properties that are not required: at each of them any may
 * come next, and a mask weighs them all. */
static int check_optional(walk *w, const cJSON *s, const cJSON *props, const char *at) {
    const cJSON *req = cJSON_GetObjectItemCaseSensitive(s, "required");
    int optional = 0;
    for (const cJSON *p = props->child; p; p = p->next) {
        bool required = false;
        for (const cJSON *r = cJSON_IsArray(req) ? req->child : NULL; r && !required; r = r->next)
            required = cJSON_IsString(r) && strcmp(r->valuestring, p->string) == 0;
        optional += !required;
    }
    if (optional > SCHEMA_MAX_OPTIONAL)
        return snprintf(w->why, w->cap, "'properties' at %s has %d properties that are not required; at most %d", at,
                        optional, SCHEMA_MAX_OPTIONAL),
               AE_ERR;
    return AE_OK;
}

/* Numeric bounds that leave nothing between them. */
static int check_range(walk *w, const cJSON *s, const char *at) {
    const cJSON *lo = num(s, "minimum"), *hi = num(s, "maximum"), *xlo = num(s, "exclusiveMinimum"),
                *xhi = num(s, "exclusiveMaximum");
    const cJSON *los[2] = {lo, xlo}, *his[2] = {hi, xhi};
    static const char *const lon[2] = {"minimum", "exclusiveMinimum"}, *const hin[2] = {"maximum", "exclusiveMaximum"};
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) {
            if (!los[i] || !his[j]) continue;
            double a = los[i]->valuedouble, b = his[j]->valuedouble;
            if (i == 0 && j == 0 ? a > b : a >= b)
                return snprintf(w->why, w->cap, "'%s' %.17g at %s leaves no number below '%s' %.17g", lon[i], a, at,
                                hin[j], b),
                       AE_ERR;
        }
    if (says_integer(s) && (lo || xlo) && (hi || xhi)) {
        double a = -INFINITY, b = INFINITY;
        if (lo) a = ceil(lo->valuedouble);
        if (xlo && floor(xlo->valuedouble) + 1 > a) a = floor(xlo->valuedouble) + 1;
        if (hi) b = floor(hi->valuedouble);
        if (xhi && ceil(xhi->valuedouble) - 1 < b) b = ceil(xhi->valuedouble) - 1;
        if (a > b) return snprintf(w->why, w->cap, "the bounds at %s leave no integer between them", at), AE_ERR;
    }
    return AE_OK;
}

static int check(walk *w, const cJSON *s, const char *at, int depth) {
    if (!cJSON_IsObject(s)) return snprintf(w->why, w->cap, "the schema at %s is not an object", at), AE_ERR;
    if (depth > SCHEMA_MAX_DEPTH)
        return snprintf(w->why, w->cap, "schemas nest deeper than %d levels at %s", SCHEMA_MAX_DEPTH, at), AE_ERR;
    if (++w->nodes > SCHEMA_MAX_NODES)
        return snprintf(w->why, w->cap, "the document has more than %d schemas (at %s)", SCHEMA_MAX_NODES, at), AE_ERR;
    for (const cJSON *f = s->child; f; f = f->next) {
        const char *k = f->string;
        if (one_of(k, annotations, sizeof annotations / sizeof *annotations)) continue;
        if (strcmp(k, "type") == 0) {
            bool ok = cJSON_IsString(f) && one_of(f->valuestring, types, 7);
            if (cJSON_IsArray(f)) {
                ok = cJSON_GetArraySize(f) > 0 && cJSON_GetArraySize(f) <= 7;
                for (const cJSON *t = f->child; t && ok; t = t->next)
                    ok = cJSON_IsString(t) && one_of(t->valuestring, types, 7);
            }
            if (!ok) return refuse(w, k, at, "must be a JSON type or a list of them");
        } else if (strcmp(k, "properties") == 0 || strcmp(k, "$defs") == 0 || strcmp(k, "definitions") == 0) {
            if (!cJSON_IsObject(f)) return refuse(w, k, at, "must be an object of schemas");
            if (strcmp(k, "properties") == 0 && check_optional(w, s, f, at) != AE_OK) return AE_ERR;
            for (const cJSON *p = f->child; p; p = p->next)
                if (check_child(w, p, at, k, p->string, depth) != AE_OK) return AE_ERR;
        } else if (strcmp(k, "required") == 0) {
            bool ok = cJSON_IsArray(f);
            for (const cJSON *r = ok ? f->child : NULL; r && ok; r = r->next) ok = cJSON_IsString(r);
            if (!ok) return refuse(w, k, at, "must be a list of property names");
        } else if (strcmp(k, "additionalProperties") == 0) {
            if (!cJSON_IsFalse(f))
                return refuse(w, k, at, "is supported only as false (no properties besides the listed ones)");
        } else if (strcmp(k, "enum") == 0) {
            if (!cJSON_IsArray(f) || cJSON_GetArraySize(f) < 1) return refuse(w, k, at, "must be a non-empty list");
            int n = cJSON_GetArraySize(f);
            if (n > SCHEMA_MAX_ENUM)
                return snprintf(w->why, w->cap, "'enum' at %s has %d values; at most %d", at, n, SCHEMA_MAX_ENUM),
                       AE_ERR;
            if (count_literals(w, f->child, true, k, at) != AE_OK) return AE_ERR;
        } else if (strcmp(k, "const") == 0) {
            /* any JSON value */
            if (count_literals(w, f, false, k, at) != AE_OK) return AE_ERR;
        } else if (strcmp(k, "anyOf") == 0) {
            if (!cJSON_IsArray(f) || cJSON_GetArraySize(f) < 1)
                return refuse(w, k, at, "must be a non-empty list of schemas");
            int n = cJSON_GetArraySize(f);
            if (n > SCHEMA_MAX_ANYOF)
                return snprintf(w->why, w->cap, "'anyOf' at %s has %d alternatives; at most %d", at, n,
                                SCHEMA_MAX_ANYOF),
                       AE_ERR;
            if ((w->alternatives += n) > SCHEMA_MAX_ALTERNATIVES)
                return snprintf(w->why, w->cap,
                                "the document has more than %d anyOf alternatives (limit reached at %s)",
                                SCHEMA_MAX_ALTERNATIVES, at),
                       AE_ERR;
            int i = 0;
            for (const cJSON *a = f->child; a; a = a->next, i++) {
                char idx[16];
                snprintf(idx, sizeof idx, "%d", i);
                if (check_child(w, a, at, k, idx, depth) != AE_OK) return AE_ERR;
            }
        } else if (strcmp(k, "items") == 0) {
            if (check_child(w, f, at, k, NULL, depth) != AE_OK) return AE_ERR;
        } else if (strcmp(k, "minItems") == 0 || strcmp(k, "maxItems") == 0 || strcmp(k, "minLength") == 0 ||
                   strcmp(k, "maxLength") == 0) {
            if (!is_count(f)) return refuse(w, k, at, "must be an integer >= 0");
            if (f->valuedouble > SCHEMA_MAX_REPEAT)
                return snprintf(w->why, w->cap, "'%s' at %s is %.0f; at most %d", k, at, f->valuedouble,
                                SCHEMA_MAX_REPEAT),
                       AE_ERR;
        } else if (strcmp(k, "minimum") == 0 || strcmp(k, "maximum") == 0 || strcmp(k, "exclusiveMinimum") == 0 ||
                   strcmp(k, "exclusiveMaximum") == 0) {
            if (!cJSON_IsNumber(f)) return refuse(w, k, at, "must be a number");
            if (!(fabs(f->valuedouble) <= SCHEMA_MAX_NUMBER))
                return snprintf(w->why, w->cap, "'%s' at %s is %.17g; it must be between -2^53 and 2^53", k, at,
                                f->valuedouble),
                       AE_ERR;
        } else if (strcmp(k, "pattern") == 0) {
            /* Not in the subset; its limits are checked first, so that they
             * hold the day it is. */
            if (cJSON_IsString(f) && check_pattern(w, f->valuestring, at) != AE_OK) return AE_ERR;
            return refuse(w, k, at, "is not supported");
        } else if (strcmp(k, "$ref") == 0) {
            if (!cJSON_IsString(f) || !resolve(w->root, f->valuestring))
                return refuse(w, k, at, "must point into this document (\"#/$defs/name\")");
        } else {
            return refuse(w, k, at, "is not supported");
        }
    }
    /* Bounds that allow nothing cannot be compiled into a grammar. */
    static const char *const pairs[][2] = {{"minLength", "maxLength"}, {"minItems", "maxItems"}};
    if (check_range(w, s, at) != AE_OK) return AE_ERR;
    for (size_t i = 0; i < 2; i++) {
        const cJSON *lo = cJSON_GetObjectItemCaseSensitive(s, pairs[i][0]),
                    *hi = cJSON_GetObjectItemCaseSensitive(s, pairs[i][1]);
        if (cJSON_IsNumber(lo) && cJSON_IsNumber(hi) && lo->valuedouble > hi->valuedouble)
            return snprintf(w->why, w->cap, "'%s' at %s is more than '%s'", pairs[i][0], at, pairs[i][1]), AE_ERR;
    }
    return AE_OK;
}

int schema_check(const cJSON *schema, char *why, size_t cap) {
    walk w = {schema, 0, 0, 0, 0, why, cap};
    if (check(&w, schema, "#", 0) != AE_OK) return AE_ERR;
    char *text = cJSON_PrintUnformatted(schema);
    size_t n = text ? strlen(text) : 0;
    cJSON_free(text);
    if (!text) return snprintf(why, cap, "out of memory"), AE_ERR;
    if (n > SCHEMA_MAX_BYTES)
        return snprintf(why, cap, "the schema is %zu bytes of compact JSON; at most %d", n, SCHEMA_MAX_BYTES), AE_ERR;
    return AE_OK;
}
