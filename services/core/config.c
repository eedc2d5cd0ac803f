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

typedef struct config_value {
    const config_option *opt;
    config_source src;
    bool is_auto;
    char *text; /* resolved value as text; NULL when unset */
    int64_t i;
    double d;
    bool b;
} config_value;

struct config {
    size_t n;
    config_value *v; /* (n) */
};

static const char *const source_names[] = {"unset", "default", "file", "env", "flag", "auto"};

const char *config_source_name(config_source s) { return (unsigned)s <= CONFIG_SRC_AUTO ? source_names[s] : "?"; }

static config_value *find(const config *c, const char *name) {
    for (size_t i = 0; i < c->n; i++)
        if (strcmp(c->v[i].opt->name, name) == 0) return &c->v[i];
    return NULL;
}

bool config_has(const config *c, const char *name) { return find(c, name) != NULL; }

static config_value *must_find(const config *c, const char *name) {
    config_value *v = find(c, name);
    AE_ASSERT(v != NULL && "undeclared config option");
    return v;
}

/* Parses text into v's typed slot without committing it. */
static int parse_value(const config_option *o, const char *text, config_value *v, ae_error *err) {
    if (strlen(text) > CONFIG_MAX_VALUE)
        return err_set(err, "%s: value longer than %d bytes", o->name, CONFIG_MAX_VALUE);
    switch (o->type) {
    case CONFIG_INT: {
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
    case CONFIG_DOUBLE: {
        char *end;
        errno = 0;
        double x = strtod(text, &end);
        if (errno || end == text || *end != '\0' || !isfinite(x))
            return err_set(err, "%s: expected a number, got \"%s\"", o->name, text);
        if (x < o->min || x > o->max) return err_set(err, "%s: %g is outside %g..%g", o->name, x, o->min, o->max);
        v->d = x;
        return AE_OK;
    }
    case CONFIG_BOOL:
        if (!strcmp(text, "true") || !strcmp(text, "1") || !strcmp(text, "yes") || !strcmp(text, "on"))
            v->b = true;
        else if (!strcmp(text, "false") || !strcmp(text, "0") || !strcmp(text, "no") || !strcmp(text, "off"))
            v->b = false;
        else
            return err_set(err, "%s: expected true or false, got \"%s\"", o->name, text);
        return AE_OK;
    case CONFIG_STRING: return AE_OK;
    }
    return err_set(err, "%s: bad option type", o->name);
}

int config_set(config *c, const char *name, const char *text, config_source src, ae_error *err) {
    config_value *v = find(c, name);
    if (!v) return err_set(err, "unknown setting \"%s\"", name);
    config_value parsed = *v;
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

int config_init(config **out, const config_option *opts, size_t n, ae_error *err) {
    *out = NULL;
    if (n > CONFIG_MAX_OPTIONS) return err_set(err, "config: %zu options, limit %d", n, CONFIG_MAX_OPTIONS);
    config *c = calloc(1, sizeof *c);
    if (!c) return err_set(err, "config: out of memory");
    c->v = calloc(n ? n : 1, sizeof *c->v);
    if (!c->v) {
        err_set(err, "config: out of memory");
        goto fail;
    }
    c->n = n;
    for (size_t i = 0; i < n; i++) {
        c->v[i].opt = &opts[i];
        for (size_t j = 0; j < i; j++) AE_ASSERT(strcmp(opts[i].name, opts[j].name) != 0 && "duplicate config option");
        if (opts[i].def && config_set(c, opts[i].name, opts[i].def, CONFIG_SRC_DEFAULT, err) != AE_OK) {
            err_prefix(err, "config: bad default: ");
            goto fail;
        }
    }
    *out = c;
    return AE_OK;
fail:
    config_free(c);
    return AE_ERR;
}

void config_free(config *c) {
    if (!c) return;
    for (size_t i = 0; i < c->n; i++) free(c->v[i].text);
    free(c->v);
    free(c);
}

/* "log-level" -> "AERIE_LOG_LEVEL" */
static void env_name(const char *name, char *out, size_t cap) {
    size_t k = (size_t)snprintf(out, cap, "AERIE_");
    for (const char *p = name; *p && k + 1 < cap; p++) out[k++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
    out[k] = '\0';
}

int config_load_env(config *c, char *const *envp, ae_error *err) {
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
                if (config_set(c, c->v[i].opt->name, *e + wl + 1, CONFIG_SRC_ENV, err) != AE_OK) {
                    err_prefix(err, "environment %s: ", want);
                    return AE_ERR;
                }
            }
        }
    }
    return AE_OK;
}

static int set_from_json(config *c, const cJSON *item, ae_error *err) {
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
    return config_set(c, item->string, text, CONFIG_SRC_FILE, err);
}

int config_load_file(config *c, const char *path, ae_error *err) {
    char *buf;
    size_t n;
    if (file_read_all(path, CONFIG_MAX_FILE, &buf, &n, NULL, err) != AE_OK) {
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

int config_load(config *c, int argc, char **argv, char *const *envp, char **positional, int *n_positional,
                bool *print_config, ae_error *err) {
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
    if (file && *file && config_load_file(c, file, err) != AE_OK) return AE_ERR;
    if (config_load_env(c, envp, err) != AE_OK) return AE_ERR;

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
        config_value *v = find(c, name);
        if (!v && !eq && !strncmp(name, "no-", 3)) {
            config_value *neg = find(c, name + 3);
            if (neg && neg->opt->type == CONFIG_BOOL) {
                if (config_set(c, name + 3, "false", CONFIG_SRC_FLAG, err) != AE_OK) return AE_ERR;
                continue;
            }
        }
        if (!v) return err_set(err, "unknown option --%s", name);
        if (!val) {
            if (v->opt->type == CONFIG_BOOL) {
                val = "true";
            } else {
                if (i + 1 >= argc) return err_set(err, "--%s needs a value", name);
                val = argv[++i];
            }
        }
        if (config_set(c, name, val, CONFIG_SRC_FLAG, err) != AE_OK) {
            err_prefix(err, "--");
            return AE_ERR;
        }
    }
    return AE_OK;
}

static void set_auto_text(config_value *v, const char *text) {
    char *copy = strdup(text);
    AE_ASSERT(copy != NULL);
    free(v->text);
    v->text = copy;
    v->src = CONFIG_SRC_AUTO;
    v->is_auto = false;
}

void config_set_auto_int(config *c, const char *name, int64_t x) {
    config_value *v = must_find(c, name);
    AE_ASSERT(v->opt->type == CONFIG_INT);
    char buf[32];
    snprintf(buf, sizeof buf, "%lld", (long long)x);
    v->i = x;
    v->d = (double)x;
    set_auto_text(v, buf);
}

void config_set_auto_double(config *c, const char *name, double x) {
    config_value *v = must_find(c, name);
    AE_ASSERT(v->opt->type == CONFIG_DOUBLE);
    /* The shortest text that reads back as x: 0.9, not 0.90000000000000002. */
    char buf[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, x);
        if (strtod(buf, NULL) == x) break;
    }
    v->d = x;
    set_auto_text(v, buf);
}

void config_set_auto_str(config *c, const char *name, const char *s) {
    config_value *v = must_find(c, name);
    AE_ASSERT(v->opt->type == CONFIG_STRING);
    set_auto_text(v, s);
}

int64_t config_int(const config *c, const char *name) {
    const config_value *v = must_find(c, name);
    AE_ASSERT(v->opt->type == CONFIG_INT && !v->is_auto);
    return v->i;
}

double config_double(const config *c, const char *name) {
    const config_value *v = must_find(c, name);
    AE_ASSERT((v->opt->type == CONFIG_DOUBLE || v->opt->type == CONFIG_INT) && !v->is_auto);
    return v->d;
}

bool config_bool(const config *c, const char *name) {
    const config_value *v = must_find(c, name);
    AE_ASSERT(v->opt->type == CONFIG_BOOL && !v->is_auto);
    return v->b;
}

const char *config_str(const config *c, const char *name) {
    const config_value *v = must_find(c, name);
    return v->text;
}

bool config_is_auto(const config *c, const char *name) { return must_find(c, name)->is_auto; }

config_source config_get_source(const config *c, const char *name) { return must_find(c, name)->src; }

static cJSON *value_json(const config_value *v) {
    if (!v->text) return cJSON_CreateNull();
    if (v->is_auto) return cJSON_CreateString("auto");
    switch (v->opt->type) {
    case CONFIG_INT: return cJSON_CreateNumber((double)v->i);
    case CONFIG_DOUBLE: return cJSON_CreateNumber(v->d);
    case CONFIG_BOOL: return cJSON_CreateBool(v->b);
    case CONFIG_STRING: return cJSON_CreateString(v->text);
    }
    return cJSON_CreateNull();
}

char *config_to_json(const config *c) {
    cJSON *root = cJSON_CreateObject();
    if (!root) return NULL;
    for (size_t i = 0; i < c->n; i++) {
        cJSON *entry = cJSON_CreateObject();
        if (!entry) break;
        cJSON_AddItemToObject(entry, "value", value_json(&c->v[i]));
        cJSON_AddStringToObject(entry, "source", config_source_name(c->v[i].src));
        cJSON_AddItemToObject(root, c->v[i].opt->name, entry);
    }
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return s;
}

void config_log(const config *c, const char *title) {
    size_t w = 4;
    for (size_t i = 0; i < c->n; i++)
        if (strlen(c->v[i].opt->name) > w) w = strlen(c->v[i].opt->name);
    LOG_INFOF("config_begin for=%s settings=%zu", title, c->n);
    for (size_t i = 0; i < c->n; i++) {
        const config_value *v = &c->v[i];
        LOG_INFOF("config %-*s = %-24s source=%s", (int)w, v->opt->name, v->text ? v->text : "(unset)",
                  config_source_name(v->src));
    }
}

char *config_usage(const config *c) {
    size_t cap = 256;
    for (size_t i = 0; i < c->n; i++)
        cap += 64 + strlen(c->v[i].opt->name) + strlen(c->v[i].opt->help ? c->v[i].opt->help : "") +
               (c->v[i].opt->def ? strlen(c->v[i].opt->def) : 0);
    char *s = malloc(cap);
    if (!s) return NULL;
    size_t k = 0;
    for (size_t i = 0; i < c->n; i++) {
        const config_option *o = c->v[i].opt;
        k += (size_t)snprintf(s + k, cap - k, "  --%-16s %s%s%s%s\n", o->name, o->help ? o->help : "",
                              o->def ? " (default: " : "", o->def ? o->def : "", o->def ? ")" : "");
    }
    s[k] = '\0';
    return s;
}
