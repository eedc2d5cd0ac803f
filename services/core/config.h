/* Configuration with provenance.
 *
 * A program declares its settings in one table (name, type, default, bounds,
 * help). Values are then applied in order of precedence, each overriding the
 * last and recording where it came from:
 *
 *   default < config file (JSON object) < AERIE_* environment < --flag
 *
 * and a value the program computes at start (a default of "auto") is set
 * with config_set_auto, source "auto". The resolved table is what --print-config
 * prints and what the startup log shows, so every number a service runs with
 * is visible together with its source (ARCHITECTURE.md, Invariants).
 *
 * Names are lower-case words joined by '-': setting "log-level" is the flag
 * --log-level, the environment variable AERIE_LOG_LEVEL and the file key
 * "log-level". */
#ifndef AERIE_CORE_CONFIG_H
#define AERIE_CORE_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "err.h"

typedef enum config_type { CONFIG_INT, CONFIG_DOUBLE, CONFIG_BOOL, CONFIG_STRING } config_type;

typedef enum config_source {
    CONFIG_SRC_UNSET = 0, /* no default and nothing set it */
    CONFIG_SRC_DEFAULT,
    CONFIG_SRC_FILE,
    CONFIG_SRC_ENV,
    CONFIG_SRC_FLAG,
    CONFIG_SRC_AUTO,
} config_source;

typedef struct config_option {
    const char *name;
    config_type type;
    const char *def; /* default as text; NULL: unset; "auto": computed at start */
    double min, max; /* inclusive bounds for CONFIG_INT and CONFIG_DOUBLE */
    const char *help;
} config_option;

typedef struct config config;

#define CONFIG_MAX_OPTIONS 128
#define CONFIG_MAX_VALUE 4096 /* bytes in one value's text */
#define CONFIG_MAX_FILE (1 << 20)

int config_init(config **out, const config_option *opts, size_t n, ae_error *err);
void config_free(config *c); /* NULL is a no-op */

/* Sets a value from text, validating type and bounds. "auto" is accepted
 * for an option whose default is "auto". */
int config_set(config *c, const char *name, const char *text, config_source src, ae_error *err);

/* Applies every source in order. Flags are `--name value`, `--name=value`,
 * or `--name` alone for a bool (also `--no-name`). `--config FILE` (or
 * AERIE_CONFIG) names the file, except where c has an option named
 * "config": that option then takes --config (and AERIE_CONFIG is
 * ignored: it names a settings file). Arguments that are not options are
 * returned in order through positional (which must hold argc entries);
 * "--" ends option parsing. `--print-config` is reported through
 * *print_config rather than treated as an error. */
int config_load(config *c, int argc, char **argv, char *const *envp, char **positional, int *n_positional,
                bool *print_config, ae_error *err);

int config_load_file(config *c, const char *path, ae_error *err);
int config_load_env(config *c, char *const *envp, ae_error *err);

/* Replaces an "auto" value with what the program computed. */
void config_set_auto_int(config *c, const char *name, int64_t v);
void config_set_auto_double(config *c, const char *name, double v);
void config_set_auto_str(config *c, const char *name, const char *v);

/* Whether the table declares name (for code shared by commands whose
 * tables differ). */
bool config_has(const config *c, const char *name);

/* Getters. The name must be declared (always-on assert otherwise). */
int64_t config_int(const config *c, const char *name);
double config_double(const config *c, const char *name);
bool config_bool(const config *c, const char *name);
const char *config_str(const config *c, const char *name); /* NULL when unset */
bool config_is_auto(const config *c, const char *name);
config_source config_get_source(const config *c, const char *name);
const char *config_source_name(config_source s);

/* {"name": {"value": V, "source": "flag"}, ...} in declaration order, as a
 * malloc'd string the caller frees. */
char *config_to_json(const config *c);

/* Logs the resolved table at info level, one aligned line per setting. */
void config_log(const config *c, const char *title);

/* Usage text for the options, one per line, into a malloc'd string. */
char *config_usage(const config *c);

#endif
