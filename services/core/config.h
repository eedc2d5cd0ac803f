/* Configuration with provenance.
 *
 * A program declares its settings in one table (name, type, default, bounds,
 * help). Values are then applied in order of precedence, each overriding the
 * last and recording where it came from:
 *
 *   default < config file (JSON object) < AERIE_* environment < --flag
 *
 * and a value the program computes at start (a default of "auto") is set
 * with cfg_set_auto, source "auto". The resolved table is what --print-config
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

typedef enum cfg_type { CFG_INT, CFG_DOUBLE, CFG_BOOL, CFG_STRING } cfg_type;

typedef enum cfg_source {
    CFG_SRC_UNSET = 0, /* no default and nothing set it */
    CFG_SRC_DEFAULT,
    CFG_SRC_FILE,
    CFG_SRC_ENV,
    CFG_SRC_FLAG,
    CFG_SRC_AUTO,
} cfg_source;

typedef struct cfg_option {
    const char *name;
    cfg_type type;
    const char *def; /* default as text; NULL: unset; "auto": computed at start */
    double min, max; /* inclusive bounds for CFG_INT and CFG_DOUBLE */
    const char *help;
} cfg_option;

typedef struct cfg cfg;

#define CFG_MAX_OPTIONS 128
#define CFG_MAX_VALUE 4096 /* bytes in one value's text */
#define CFG_MAX_FILE (1 << 20)

int cfg_init(cfg **out, const cfg_option *opts, size_t n, ae_error *err);
void cfg_free(cfg *c); /* NULL is a no-op */

/* Sets a value from text, validating type and bounds. "auto" is accepted
 * for an option whose default is "auto". */
int cfg_set(cfg *c, const char *name, const char *text, cfg_source src, ae_error *err);

/* Applies every source in order. Flags are `--name value`, `--name=value`,
 * or `--name` alone for a bool (also `--no-name`). `--config FILE` (or
 * AERIE_CONFIG) names the file, except where c has an option named
 * "config": that option then takes --config (and AERIE_CONFIG is
 * ignored: it names a settings file). Arguments that are not options are
 * returned in order through positional (which must hold argc entries);
 * "--" ends option parsing. `--print-config` is reported through
 * *print_config rather than treated as an error. */
int cfg_load(cfg *c, int argc, char **argv, char *const *envp,
             char **positional, int *n_positional, bool *print_config,
             ae_error *err);

int cfg_load_file(cfg *c, const char *path, ae_error *err);
int cfg_load_env(cfg *c, char *const *envp, ae_error *err);

/* Replaces an "auto" value with what the program computed. */
void cfg_set_auto_int(cfg *c, const char *name, int64_t v);
void cfg_set_auto_double(cfg *c, const char *name, double v);
void cfg_set_auto_str(cfg *c, const char *name, const char *v);

/* Whether the table declares name (for code shared by commands whose
 * tables differ). */
bool cfg_has(const cfg *c, const char *name);

/* Getters. The name must be declared (always-on assert otherwise). */
int64_t cfg_int(const cfg *c, const char *name);
double cfg_double(const cfg *c, const char *name);
bool cfg_bool(const cfg *c, const char *name);
const char *cfg_str(const cfg *c, const char *name); /* NULL when unset */
bool cfg_is_auto(const cfg *c, const char *name);
cfg_source cfg_get_source(const cfg *c, const char *name);
const char *cfg_source_name(cfg_source s);

/* {"name": {"value": V, "source": "flag"}, ...} in declaration order, as a
 * malloc'd string the caller frees. */
char *cfg_to_json(const cfg *c);

/* Logs the resolved table at info level, one aligned line per setting. */
void cfg_log(const cfg *c, const char *title);

/* Usage text for the options, one per line, into a malloc'd string. */
char *cfg_usage(const cfg *c);

#endif
