/* cli_model_open: a tokenizer from any model path. In the library, since
 * the services open their models the same way as the `aerie` command. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"

int cli_model_open(cli_model *m, const char *path, ae_error *err) {
    memset(m, 0, sizeof *m);
    if (!path || !*path) return err_set(err, "no model given (use --model FILE)");
    struct stat st;
    if (stat(path, &st) != 0) return err_set(err, "%s: %s", path, strerror(errno));
    if (S_ISDIR(st.st_mode)) {
        char json[4096];
        if ((size_t)snprintf(json, sizeof json, "%s/tokenizer.json", path) >= sizeof json)
            return err_set(err, "%s: path too long", path);
        return tok_load_json(&m->tok, json, err);
    }
    size_t n = strlen(path);
    if (n >= 5 && !strcmp(path + n - 5, ".json")) return tok_load_json(&m->tok, path, err);
    if (gguf_open(&m->gguf, path, err) != AE_OK) return AE_ERR;
    if (tok_load_gguf(&m->tok, m->gguf, err) != AE_OK) { /* err names the file */
        gguf_close(m->gguf);
        m->gguf = NULL;
        return AE_ERR;
    }
    return AE_OK;
}

void cli_model_close(cli_model *m) {
    tok_free(m->tok);
    gguf_close(m->gguf);
    memset(m, 0, sizeof *m);
}
