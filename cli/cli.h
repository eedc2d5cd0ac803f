/* The `aerie` command: shared pieces of the subcommands.
 *
 * Every subcommand declares its settings as a config_option table, so each value
 * it runs with has a source and `--print-config` shows them. Failures print
 * one line "aerie <cmd>: <problem>" on stderr and exit 2. */
#ifndef AERIE_CLI_H
#define AERIE_CLI_H

#include <stddef.h>

#include "../services/core/clock.h"
#include "../services/core/config.h"
#include "../services/core/err.h"
#include "../services/model/gguf.h"
#include "../services/tokenizer/tok.h"
#include "../services/tokenizer/tok_file.h"

#define CLI_EXIT_USAGE 2

typedef struct cli_cmd {
    const char *name;
    const char *args; /* usage after the options */
    const char *summary;
    const config_option *opts;
    size_t n_opts;
    /* Runs with resolved settings and the positional arguments (after the
     * subcommand name). Returns the process exit status. */
    int (*run)(const config *c, int argc, char **argv, ae_error *err);
    /* Optional: replaces "auto" settings with the values computed for this
     * machine and model, before --print-config and the startup log show
     * them. A failure (an impossible memory plan) exits 2. */
    int (*resolve)(config *c, ae_error *err);
} cli_cmd;

/* x rounded to the nearest multiple of 1 / scale (for JSON output). */
double cli_round(double x, double scale);
/* Prints o as one JSON line on stdout and frees it (struct cJSON from
 * <cjson/cJSON.h>); fails only when out of memory. */
struct cJSON;
int cli_put_json_line(struct cJSON *o, ae_error *err);
/* qsort comparator for doubles, ascending. */
int cli_cmp_double(const void *a, const void *b);

/* The ids of the chat template rendered around one user turn: the whole
 * turn and the assistant's opening (content != NULL), or only what comes
 * before the user's content (content == NULL). */
struct chat_template;
int cli_user_turn_ids(const tok *t, const struct chat_template *ct, const char *content, int32_t **ids, int32_t *n,
                      ae_error *err);

/* Prompts from a file of JSON lines {"prompt": TEXT} (gen-prompts' output),
 * the first `limit` of them (0: all). Errors name the line. */
int cli_read_prompts(const char *path, char ***out, int64_t *n_out, int64_t limit, ae_error *err);

/* Writes a JSON array of ids on one line to stdout. */
void cli_print_ids(const int32_t *ids, size_t n);

extern const cli_cmd cli_cmd_info;
extern const cli_cmd cli_cmd_tokenize;
extern const cli_cmd cli_cmd_detokenize;
extern const cli_cmd cli_cmd_bench_tokenizer;
extern const cli_cmd cli_cmd_plan;
extern const cli_cmd cli_cmd_generate;
extern const cli_cmd cli_cmd_bench;
extern const cli_cmd cli_cmd_gen_prompts;
extern const cli_cmd cli_cmd_dump_features;
extern const cli_cmd cli_cmd_eval_draft;
extern const cli_cmd cli_cmd_draft_logits;
extern const cli_cmd cli_cmd_bench_rpc;
extern const cli_cmd cli_cmd_perplexity;
extern const cli_cmd cli_cmd_make_model;

#endif
