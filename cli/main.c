/* aerie: the command-line tool. See `aerie help`. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "../services/core/log.h"
#include "cli.h"

extern char **environ;

static const cli_cmd *const commands[] = {
    &cli_cmd_info,       &cli_cmd_tokenize,     &cli_cmd_detokenize,  &cli_cmd_bench_tokenizer,
    &cli_cmd_generate,   &cli_cmd_bench,        &cli_cmd_gen_prompts, &cli_cmd_dump_features,
    &cli_cmd_eval_draft, &cli_cmd_draft_logits, &cli_cmd_bench_rpc,   &cli_cmd_perplexity,
    &cli_cmd_make_model, &cli_cmd_plan,
};
#define N_COMMANDS (sizeof commands / sizeof commands[0])

static void usage(FILE *out) {
    fprintf(out, "usage: aerie <command> [options]\n\ncommands:\n");
    for (size_t i = 0; i < N_COMMANDS; i++) fprintf(out, "  %-16s %s\n", commands[i]->name, commands[i]->summary);
    fprintf(out, "\n`aerie <command> --help` lists a command's options. Every option can\n"
                 "also come from AERIE_<NAME> in the environment or a JSON file given\n"
                 "with --config; `--print-config` shows each value and its source.\n");
}

static void command_usage(const cli_cmd *cmd, const config *c) {
    printf("usage: aerie %s [options] %s\n%s\n\noptions:\n", cmd->name, cmd->args, cmd->summary);
    char *u = config_usage(c);
    if (u) fputs(u, stdout);
    free(u);
    printf("  --%-16s %s\n  --%-16s %s\n", "config FILE", "JSON file of settings", "print-config",
           "print the resolved settings with their sources, then exit");
}

double cli_round(double x, double scale) { return (double)llround(x * scale) / scale; }

int cli_put_json_line(cJSON *o, ae_error *err) {
    char *line = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!line) return err_set(err, "out of memory");
    puts(line);
    cJSON_free(line);
    return AE_OK;
}

int cli_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

void cli_print_ids(const int32_t *ids, size_t n) {
    putchar('[');
    for (size_t i = 0; i < n; i++) printf(i ? ",%d" : "%d", ids[i]);
    puts("]");
}

int main(int argc, char **argv) {
    log_set_level(LOG_WARN);
    if (argc < 2 || !strcmp(argv[1], "help") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? CLI_EXIT_USAGE : 0;
    }
    const cli_cmd *cmd = NULL;
    for (size_t i = 0; i < N_COMMANDS; i++)
        if (!strcmp(argv[1], commands[i]->name)) cmd = commands[i];
    if (!cmd) {
        fprintf(stderr, "aerie: unknown command \"%s\" (try `aerie help`)\n", argv[1]);
        return CLI_EXIT_USAGE;
    }

    ae_error err = {0};
    config *c = NULL;
    char **pos = calloc((size_t)argc, sizeof *pos);
    int npos = 0, rc = CLI_EXIT_USAGE;
    bool print_config = false;
    if (!pos || config_init(&c, cmd->opts, cmd->n_opts, &err) != AE_OK) goto out;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--")) break;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            command_usage(cmd, c);
            rc = 0;
            goto out;
        }
    }
    if (config_load(c, argc - 2, argv + 2, environ, pos, &npos, &print_config, &err) != AE_OK) goto out;
    const char *level = config_str(c, "log-level");
    log_level lv;
    if (!log_level_parse(level, &lv)) {
        err_set(&err, "log-level: expected debug, info, warn, error or off, got \"%s\"", level);
        goto out;
    }
    log_set_level(lv);
    if (cmd->resolve && cmd->resolve(c, &err) != AE_OK) goto out;
    if (print_config) {
        char *json = config_to_json(c);
        if (json) puts(json);
        free(json);
        rc = 0;
        goto out;
    }
    config_log(c, cmd->name);
    rc = cmd->run(c, npos, pos, &err);
out:
    if (rc != 0 && err_is_set(&err)) fprintf(stderr, "aerie %s: %s\n", cmd->name, err.msg);
    config_free(c);
    free(pos);
    return rc;
}
