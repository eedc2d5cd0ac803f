#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "file.h"
#include "json.h"
#include "log.h"

typedef struct cfg_value {
    const cfg_option *opt;
    cfg_source src;
    bool is_auto;
    char *text; /* resolved value as text; NULL when unset */
    int64_t i;
    double d;
    bool b;
} cfg_value;

struct cfg {
    size_t n;
    cfg_value *v; /* (n) */
};

static const char *const source_names[] = {"unset", "default", "file", "env", "flag", "auto"};

const char *cfg_source_name(cfg_source s) {
    return (unsigned)s <= CFG_SRC_AUTO ? source_names[s] : "?";
}

static cfg_value *find(const cfg *c, const char *name) {
    for (size_t i = 0; i < c->n; i++)
        if (strcmp(c->v[i].opt->name, name) == 0) return &c->v[i];
    return NULL;
}

bool cfg_has(const cfg *c, const char *name) { return find(c, name) != NULL; }

static cfg_value *must_find(const cfg *c, const char *name) {
    cfg_value *v = find(c, name);
    AE_ASSERT(v != NULL && "undeclared config option");
    return v;
}

/* Parses text into v's typed slot without committing it. */
static int parse_value(const cfg_option *o, const char *text, cfg_value *v, ae_error *err) {
    if (strlen(text) > CFG_MAX_VALUE)
        return err_set(err, "%s: value longer than %d bytes", o->name, CFG_MAX_VALUE);
    switch (o->type) {
    case CFG_INT: {
        char *end;
        errno = 0;
        long long x = strtoll(text, &end, 10);
        if (errno || end == text || *end != '\0')
            return err_set(err, "%s: expected an integer, got \"%s\"", o->name, text);
        if ((double)x < o->min || (double)x > o->max)
            return err_set(err, "%s: %lld is outside %.0f..%.0f", o->name, x, o->min, o->max);
        v->i = x;
        v->d = (double)x;
        return AE_OK;
    }
    case CFG_DOUBLE: {
        char *end;
        errno = 0;
        double x = strtod(text, &end);
        if (errno || end == text || *end != '\0' || !isfinite(x))
            return err_set(err, "%s: expected a number, got \"%s\"", o->name, text);
        if (x < o->min || x > o->max)
            return err_set(err, "%s: %g is outside %g..%g", o->name, x, o->min, o->max);
        v->d = x;
        return AE_OK;
    }
    case CFG_BOOL:
        if (!strcmp(text, "true") || !strcmp(text, "1") || !strcmp(text, "yes") || !strcmp(text, "on"))
            v->b = true;
        else if (!strcmp(text, "false") || !strcmp(text, "0") || !strcmp(text, "no") || !strcmp(text, "off"))
            v->b = false;
        else
            return err_set(err, "%s: expected true or false, got \"%s\"", o->name, text);
        return AE_OK;
    case CFG_STRING:
        return AE_OK;
    }
    return err_set(err, "%s: bad option type", o->name);
}

int cfg_set(cfg *c, const char *name, const char *text, cfg_source src, ae_error *err) {
    cfg_value *v = find(c, name);
    if (!v) return err_set(err, "unknown setting \"%s\"", name);
    cfg_value parsed = *v;
    bool is_auto = v->opt->def && !strcmp(v->opt->def, "auto") && !strcmp(text, "auto");
    if (!is_auto && parse_value(v->opt, text, &parsed, err) != AE_OK) return AE_ERR;
    char *copy = strdup(text);
    if (!copy) return err_set(err, "%s: out of memory", name);
    free(v->text);
    *v = parsed;
    v->text = copy;
    v->src = src;
    v->is_auto = is_auto;
    return AE_OK;
}

int cfg_init(cfg **out, const cfg_option *opts, size_t n, ae_error *err) {
    *out = NULL;
    if (n > CFG_MAX_OPTIONS) return err_set(err, "config: %zu options, limit %d", n, CFG_MAX_OPTIONS);
    cfg *c = calloc(1, sizeof *c);
    if (!c) return err_set(err, "config: out of memory");
    c->v = calloc(n ? n : 1, sizeof *c->v);
    if (!c->v) {
        err_set(err, "config: out of memory");
        goto fail;
    }
    c->n = n;
    for (size_t i = 0; i < n; i++) {
        c->v[i].opt = &opts[i];
        for (size_t j = 0; j < i; j++)
            AE_ASSERT(strcmp(opts[i].name, opts[j].name) != 0 && "duplicate config option");
        if (opts[i].def && cfg_set(c, opts[i].name, opts[i].def, CFG_SRC_DEFAULT, err) != AE_OK) {
            err_prefix(err, "config: bad default: ");
            goto fail;
        }
    }
    *out = c;
    return AE_OK;
fail:
    cfg_free(c);
    return AE_ERR;
}

void cfg_free(cfg *c) {
    if (!c) return;
    for (size_t i = 0; i < c->n; i++) free(c->v[i].text);
    free(c->v);
    free(c);
}

/* "log-level" -> "AERIE_LOG_LEVEL" */
static void env_name(const char *name, char *out, size_t cap) {
    size_t k = (size_t)snprintf(out, cap, "AERIE_");
    for (const char *p = name; *p && k + 1 < cap; p++)
        out[k++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
    out[k] = '\0';
}

int cfg_load_env(cfg *c, char *const *envp, ae_error *err) {
    if (!envp) return AE_OK;
    for (size_t i = 0; i < c->n; i++) {
        char want[160];
        /* AERIE_CONFIG always names a settings file, even where a command
         * has an option named config (aerie plan's model config). */
        if (!strcmp(c->v[i].opt->name, "config")) continue;
        env_name(c->v[i].opt->name, want, sizeof want);
        size_t wl = strlen(want);
        for (char *const *e = envp; *e; e++) {
            if (strncmp(*e, want, wl) == 0 && (*e)[wl] == '=') {
                if (cfg_set(c, c->v[i].opt->name, *e + wl + 1, CFG_SRC_ENV, err) != AE_OK) {
                    err_prefix(err, "environment %s: ", want);
                    return AE_ERR;
                }
            }
        }
    }
    return AE_OK;
}

static int set_from_json(cfg *c, const cJSON *item, ae_error *err) {
    char buf[64];
    const char *text;
    if (cJSON_IsString(item)) {
        text = item->valuestring;
    } else if (cJSON_IsBool(item)) {
        text = cJSON_IsTrue(item) ? "true" : "false";
    } else if (cJSON_IsNumber(item)) {
        double d = item->valuedouble;
        if (d == floor(d) && fabs(d) < 9e15)
            snprintf(buf, sizeof buf, "%.0f", d);
        else
            snprintf(buf, sizeof buf, "%.17g", d);
        text = buf;
    } else {
        return err_set(err, "%s: expected a string, number or bool", item->string);
    }
    return cfg_set(c, item->string, text, CFG_SRC_FILE, err);
}

int cfg_load_file(cfg *c, const char *path, ae_error *err) {
    char *buf;
    size_t n;
    if (file_read_all(path, CFG_MAX_FILE, &buf, &n, NULL, err) != AE_OK) {
        err_prefix(err, "config file ");
        return AE_ERR;
    }
    int rc = AE_ERR;
    cJSON *root = json_parse(buf, n, err);
    if (!cJSON_IsObject(root)) {
        if (root) err_set(err, "not a JSON object");
        err_prefix(err, "config file %s: ", path);
        goto out;
    }
    for (const cJSON *item = root->child; item; item = item->next) {
        if (set_from_json(c, item, err) != AE_OK) {
            err_prefix(err, "config file %s: ", path);
            goto out;
        }
    }
    rc = AE_OK;
out:
    cJSON_Delete(root);
    free(buf);
    return rc;
}

int cfg_load(cfg *c, int argc, char **argv, char *const *envp,
             char **positional, int *n_positional, bool *print_config,
             ae_error *err) {
    *n_positional = 0;
    if (print_config) *print_config = false;

    /* The file comes before env and flags, so find --config first. A
     * command with an option of that name (aerie plan's model config)
     * takes --config as that option and has no settings file. */
    const bool own = find(c, "config") != NULL;
    const char *file = NULL;
    for (char *const *e = envp; e && *e && !own; e++)
        if (!strncmp(*e, "AERIE_CONFIG=", 13)) file = *e + 13;
    for (int i = 0; i < argc && !own; i++) {
        if (!strcmp(argv[i], "--")) break;
        if (!strcmp(argv[i], "--config")) {
            if (i + 1 >= argc) return err_set(err, "--config needs a file");
            file = argv[i + 1];
        } else if (!strncmp(argv[i], "--config=", 9)) {
            file = argv[i] + 9;
        }
    }
    if (file && *file && cfg_load_file(c, file, err) != AE_OK) return AE_ERR;
    if (cfg_load_env(c, envp, err) != AE_OK) return AE_ERR;

    bool options_done = false;
    for (int i = 0; i < argc; i++) {
        char *a = argv[i];
        if (options_done || a[0] != '-' || a[1] != '-' || a[2] == '\0') {
            if (!options_done && !strcmp(a, "--")) {
                options_done = true;
                continue;
            }
            positional[(*n_positional)++] = a;
            continue;
        }
        char name[128];
        const char *val = NULL;
        const char *eq = strchr(a + 2, '=');
        size_t nl = eq ? (size_t)(eq - (a + 2)) : strlen(a + 2);
        if (nl >= sizeof name) return err_set(err, "unknown option %.40s...", a);
        memcpy(name, a + 2, nl);
        name[nl] = '\0';
        if (eq) val = eq + 1;

        if (!strcmp(name, "config") && !own) {
            if (!eq) i++; /* already loaded above */
            continue;
        }
        if (!strcmp(name, "print-config") && !eq) {
            if (print_config) *print_config = true;
            continue;
        }
        cfg_value *v = find(c, name);
        if (!v && !eq && !strncmp(name, "no-", 3)) {
            cfg_value *neg = find(c, name + 3);
            if (neg && neg->opt->type == CFG_BOOL) {
                if (cfg_set(c, name + 3, "false", CFG_SRC_FLAG, err) != AE_OK) return AE_ERR;
                continue;
            }
        }
        if (!v) return err_set(err, "unknown option --%s", name);
        if (!val) {
            if (v->opt->type == CFG_BOOL) {
                val = "true";
            } else {
                if (i + 1 >= argc) return err_set(err, "--%s needs a value", name);
                val = argv[++i];
            }
        }
        if (cfg_set(c, name, val, CFG_SRC_FLAG, err) != AE_OK) {
            err_prefix(err, "--");
            return AE_ERR;
        }
    }
    return AE_OK;
}

static void set_auto_text(cfg_value *v, const char *text) {
    char *copy = strdup(text);
    AE_ASSERT(copy != NULL);
    free(v->text);
    v->text = copy;
    v->src = CFG_SRC_AUTO;
    v->is_auto = false;
}

void cfg_set_auto_int(cfg *c, const char *name, int64_t x) {
    cfg_value *v = must_find(c, name);
    AE_ASSERT(v->opt->type == CFG_INT);
    char buf[32];
    snprintf(buf, sizeof buf, "%lld", (long long)x);
    v->i = x;
    v->d = (double)x;
    set_auto_text(v, buf);
}

void cfg_set_auto_double(cfg *c, const char *name, double x) {
    cfg_value *v = must_find(c, name);
    AE_ASSERT(v->opt->type == CFG_DOUBLE);
    /* The shortest text that reads back as x: 0.9, not 0.90000000000000002. */
    char buf[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, x);
        if (strtod(buf, NULL) == x) break;
    }
    v->d = x;
    set_auto_text(v, buf);
}

void cfg_set_auto_str(cfg *c, const char *name, const char *s) {
    cfg_value *v = must_find(c, name);
    AE_ASSERT(v->opt->type == CFG_STRING);
    set_auto_text(v, s);
}

int64_t cfg_int(const cfg *c, const char *name) {
    const cfg_value *v = must_find(c, name);
    AE_ASSERT(v->opt->type == CFG_INT && !v->is_auto);
    return v->i;
}

double cfg_double(const cfg *c, const char *name) {
    const cfg_value *v = must_find(c, name);
    AE_ASSERT((v->opt->type == CFG_DOUBLE || v->opt->type == CFG_INT) && !v->is_auto);
    return v->d;
}

bool cfg_bool(const cfg *c, const char *name) {
    const cfg_value *v = must_find(c, name);
    AE_ASSERT(v->opt->type == CFG_BOOL && !v->is_auto);
    return v->b;
}

const char *cfg_str(const cfg *c, const char *name) {
    const cfg_value *v = must_find(c, name);
    return v->text;
}

bool cfg_is_auto(const cfg *c, const char *name) { return must_find(c, name)->is_auto; }

cfg_source cfg_get_source(const cfg *c, const char *name) { return must_find(c, name)->src; }

static cJSON *value_json(const cfg_value *v) {
    if (!v->text) return cJSON_CreateNull();
    if (v->is_auto) return cJSON_CreateString("auto");
    switch (v->opt->type) {
    case CFG_INT: return cJSON_CreateNumber((double)v->i);
    case CFG_DOUBLE: return cJSON_CreateNumber(v->d);
    case CFG_BOOL: return cJSON_CreateBool(v->b);
    case CFG_STRING: return cJSON_CreateString(v->text);
    }
    return cJSON_CreateNull();
}

char *cfg_to_json(const cfg *c) {
    cJSON *root = cJSON_CreateObject();
    if (!root) return NULL;
    for (size_t i = 0; i < c->n; i++) {
        cJSON *entry = cJSON_CreateObject();
        if (!entry) break;
        cJSON_AddItemToObject(entry, "value", value_json(&c->v[i]));
        cJSON_AddStringToObject(entry, "source", cfg_source_name(c->v[i].src));
        cJSON_AddItemToObject(root, c->v[i].opt->name, entry);
    }
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return s;
}

void cfg_log(const cfg *c, const char *title) {
    size_t w = 4;
    for (size_t i = 0; i < c->n; i++)
        if (strlen(c->v[i].opt->name) > w) w = strlen(c->v[i].opt->name);
    LOG_INFOF("config_begin for=%s settings=%zu", title, c->n);
    for (size_t i = 0; i < c->n; i++) {
        const cfg_value *v = &c->v[i];
        LOG_INFOF("config %-*s = %-24s source=%s", (int)w, v->opt->name,
                  v->text ? v->text : "(unset)", cfg_source_name(v->src));
    }
}

char *cfg_usage(const cfg *c) {
    size_t cap = 256;
    for (size_t i = 0; i < c->n; i++)
        cap += 64 + strlen(c->v[i].opt->name) + strlen(c->v[i].opt->help ? c->v[i].opt->help : "") +
               (c->v[i].opt->def ? strlen(c->v[i].opt->def) : 0);
    char *s = malloc(cap);
    if (!s) return NULL;
    size_t k = 0;
    for (size_t i = 0; i < c->n; i++) {
        const cfg_option *o = c->v[i].opt;
        k += (size_t)snprintf(s + k, cap - k, "  --%-16s %s%s%s%s\n", o->name, o->help ? o->help : "",
                              o->def ? " (default: " : "", o->def ? o->def : "", o->def ? ")" : "");
    }
    s[k] = '\0';
    return s;
}
