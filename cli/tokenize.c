/* aerie tokenize / detokenize / bench-tokenizer. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../services/core/file.h"
#include "../services/tokenizer/chat.h"
#include "cli.h"

#define MAX_TEXT_BYTES (64u << 20)

static const config_option tokenize_opts[] = {
    {"model", CONFIG_STRING, NULL, 0, 0, "model: .gguf file, tokenizer.json, or a directory holding it"},
    {"file", CONFIG_STRING, NULL, 0, 0, "read the text from this file instead of the argument"},
    {"special", CONFIG_BOOL, "true", 0, 0, "recognise special tokens written in the text"},
    {"chat", CONFIG_BOOL, "false", 0, 0, "TEXT is a JSON list of {role, content}: tokenize the templated prompt"},
    {"log-level", CONFIG_STRING, "warn", 0, 0, "debug, info, warn, error or off"},
};

/* Renders a JSON message list with the model's chat template, followed by
 * the generation prompt, as the server will. */
static int render_chat(const tok *t, const char *json, size_t len, char **prompt, size_t *prompt_len, ae_error *err) {
    chat_template *ct = NULL;
    chat_msg *msgs = NULL;
    size_t n = 0;
    int rc = AE_ERR;
    if (chat_parse_messages_json(json, len, &msgs, &n, err) != AE_OK) goto out;
    const char *src = tok_chat_template(t);
    if (!src) {
        err_set(err, "the model has no chat template");
        goto out;
    }
    if (chat_template_init(&ct, src, err) != AE_OK) goto out;
    rc = chat_render_alloc(ct, msgs, n, true, prompt, prompt_len, err);
out:
    chat_template_free(ct);
    chat_msgs_free(msgs);
    return rc;
}

/* The text to encode: the one positional argument, or --file. */
static int input_text(const config *c, int argc, char **argv, char **text, size_t *len, ae_error *err) {
    const char *file = config_str(c, "file");
    if (file) {
        if (argc > 0) return err_set(err, "give either TEXT or --file, not both");
        return file_read_all(file, MAX_TEXT_BYTES, text, len, NULL, err);
    }
    if (argc != 1)
        return err_set(err, argc ? "expected one TEXT argument, got %d" : "no TEXT given (or use --file F)", argc);
    *len = strlen(argv[0]);
    *text = strdup(argv[0]);
    return *text ? AE_OK : err_set(err, "out of memory");
}

static int encode_all(const tok *t, const char *text, size_t len, int flags, int32_t **ids, size_t *n, ae_error *err) {
    *ids = malloc((len + 2) * sizeof **ids);
    if (!*ids) return err_set(err, "out of memory for %zu tokens", len + 2);
    if (tok_encode(t, text, len, flags, *ids, len + 2, n, err) != AE_OK) {
        free(*ids);
        *ids = NULL;
        return AE_ERR;
    }
    return AE_OK;
}

static int run_tokenize(const config *c, int argc, char **argv, ae_error *err) {
    char *text = NULL;
    size_t len = 0, n = 0;
    int32_t *ids = NULL;
    tok_file m = {0};
    int rc = CLI_EXIT_USAGE;
    if (input_text(c, argc, argv, &text, &len, err) != AE_OK) goto out;
    if (tok_file_open(&m, config_str(c, "model"), err) != AE_OK) goto out;
    int flags = TOK_ADD_BOS | (config_bool(c, "special") ? TOK_PARSE_SPECIAL : 0);
    if (config_bool(c, "chat")) {
        char *prompt;
        size_t plen;
        if (render_chat(m.tok, text, len, &prompt, &plen, err) != AE_OK) goto out;
        free(text);
        text = prompt;
        len = plen;
        /* The template writes its own BOS and special tokens (chat.h). */
        flags = TOK_PARSE_SPECIAL;
    }
    if (encode_all(m.tok, text, len, flags, &ids, &n, err) != AE_OK) goto out;
    cli_print_ids(ids, n);
    rc = 0;
out:
    free(ids);
    free(text);
    tok_file_close(&m);
    return rc;
}

const cli_cmd cli_cmd_tokenize = {
    .name = "tokenize",
    .args = "TEXT | --file F   (with --chat, TEXT is JSON)",
    .summary = "token ids of a text, as a JSON array on one line",
    .opts = tokenize_opts,
    .n_opts = sizeof tokenize_opts / sizeof tokenize_opts[0],
    .run = run_tokenize,
};

static const config_option detokenize_opts[] = {
    {"model", CONFIG_STRING, NULL, 0, 0, "model: .gguf file, tokenizer.json, or a directory holding it"},
    {"skip-special", CONFIG_BOOL, "false", 0, 0, "leave special tokens out of the text"},
    {"log-level", CONFIG_STRING, "warn", 0, 0, "debug, info, warn, error or off"},
};

static int run_detokenize(const config *c, int argc, char **argv, ae_error *err) {
    tok_file m = {0};
    int32_t *ids = NULL;
    char *text = NULL;
    int rc = CLI_EXIT_USAGE;
    if (argc == 0) {
        err_set(err, "no token ids given");
        goto out;
    }
    ids = malloc((size_t)argc * sizeof *ids);
    if (!ids) {
        err_set(err, "out of memory");
        goto out;
    }
    for (int i = 0; i < argc; i++) {
        char *end;
        errno = 0;
        long v = strtol(argv[i], &end, 10);
        if (errno || end == argv[i] || *end || v < 0 || v > INT32_MAX) {
            err_set(err, "\"%s\" is not a token id", argv[i]);
            goto out;
        }
        ids[i] = (int32_t)v;
    }
    if (tok_file_open(&m, config_str(c, "model"), err) != AE_OK) goto out;
    for (int i = 0; i < argc; i++) {
        if (ids[i] >= tok_vocab_size(m.tok)) {
            err_set(err, "token id %d is out of range (vocabulary has %d)", ids[i], tok_vocab_size(m.tok));
            goto out;
        }
    }
    bool skip = config_bool(c, "skip-special");
    size_t need = 0;
    if (tok_decode(m.tok, ids, (size_t)argc, skip, NULL, 0, &need, err) != AE_OK) goto out;
    text = malloc(need + 1);
    if (!text) {
        err_set(err, "out of memory");
        goto out;
    }
    if (tok_decode(m.tok, ids, (size_t)argc, skip, text, need + 1, &need, err) != AE_OK) goto out;
    fwrite(text, 1, need, stdout);
    putchar('\n');
    rc = 0;
out:
    free(text);
    free(ids);
    tok_file_close(&m);
    return rc;
}

const cli_cmd cli_cmd_detokenize = {
    .name = "detokenize",
    .args = "ID...",
    .summary = "the text of token ids",
    .opts = detokenize_opts,
    .n_opts = sizeof detokenize_opts / sizeof detokenize_opts[0],
    .run = run_detokenize,
};

static const config_option bench_opts[] = {
    {"model", CONFIG_STRING, NULL, 0, 0, "model: .gguf file, tokenizer.json, or a directory holding it"},
    {"file", CONFIG_STRING, NULL, 0, 0, "text to encode (the whole file as one string)"},
    {"repeat", CONFIG_INT, "5", 1, 1000, "encode the file this many times; the best time counts"},
    {"log-level", CONFIG_STRING, "warn", 0, 0, "debug, info, warn, error or off"},
};

static int run_bench(const config *c, int argc, char **argv, ae_error *err) {
    char *text = NULL;
    size_t len = 0, n = 0;
    int32_t *ids = NULL;
    double *times = NULL;
    tok_file m = {0};
    int rc = CLI_EXIT_USAGE;
    if (argc > 0) {
        err_set(err, "unexpected argument \"%s\"", argv[0]);
        goto out;
    }
    if (!config_str(c, "file")) {
        err_set(err, "no text given (use --file F)");
        goto out;
    }
    if (file_read_all(config_str(c, "file"), MAX_TEXT_BYTES, &text, &len, NULL, err) != AE_OK) goto out;
    if (tok_file_open(&m, config_str(c, "model"), err) != AE_OK) goto out;
    int reps = (int)config_int(c, "repeat");
    times = malloc((size_t)reps * sizeof *times);
    ids = malloc((len + 2) * sizeof *ids);
    if (!times || !ids) {
        err_set(err, "out of memory");
        goto out;
    }
    int flags = TOK_ADD_BOS | TOK_PARSE_SPECIAL;
    for (int r = 0; r < reps; r++) {
        double t0 = clock_mono_seconds();
        if (tok_encode(m.tok, text, len, flags, ids, len + 2, &n, err) != AE_OK) goto out;
        times[r] = clock_mono_seconds() - t0;
    }
    qsort(times, (size_t)reps, sizeof *times, cli_cmp_double);
    double best = times[0], median = times[reps / 2];
    printf("{\"bytes\":%zu,\"tokens\":%zu,\"repeat\":%d,\"threads\":1,\"best_seconds\":%.6f,"
           "\"median_seconds\":%.6f,\"mb_per_s\":%.3f,\"tokens_per_s\":%.0f}\n",
           len, n, reps, best, median, (double)len / best / 1e6, (double)n / best);
    rc = 0;
out:
    free(times);
    free(ids);
    free(text);
    tok_file_close(&m);
    return rc;
}

const cli_cmd cli_cmd_bench_tokenizer = {
    .name = "bench-tokenizer",
    .args = "--file F",
    .summary = "encode throughput on one thread, as one JSON line",
    .opts = bench_opts,
    .n_opts = sizeof bench_opts / sizeof bench_opts[0],
    .run = run_bench,
};
