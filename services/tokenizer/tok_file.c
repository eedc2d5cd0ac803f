#include "tok_file.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

int tok_file_open(tok_file *f, const char *path, ae_error *err) {
    memset(f, 0, sizeof *f);
    if (!path || !*path) return err_set(err, "no model given (use --model FILE)");
    struct stat st;
    if (stat(path, &st) != 0) return err_set(err, "%s: %s", path, strerror(errno));
    if (S_ISDIR(st.st_mode)) {
        char json[4096];
        if ((size_t)snprintf(json, sizeof json, "%s/tokenizer.json", path) >= sizeof json)
            return err_set(err, "%s: path too long", path);
        return tok_load_json(&f->tok, json, err);
    }
    size_t n = strlen(path);
    if (n >= 5 && !strcmp(path + n - 5, ".json")) return tok_load_json(&f->tok, path, err);
    if (gguf_open(&f->gguf, path, err) != AE_OK) return AE_ERR;
    if (tok_load_gguf(&f->tok, f->gguf, err) != AE_OK) { /* err names the file */
        gguf_close(f->gguf);
        f->gguf = NULL;
        return AE_ERR;
    }
    return AE_OK;
}

void tok_file_close(tok_file *f) {
    tok_free(f->tok);
    gguf_close(f->gguf);
    memset(f, 0, sizeof *f);
}
