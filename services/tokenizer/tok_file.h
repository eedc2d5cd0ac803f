/* A tokenizer from any model path the services and the `aerie` command
 * take: a .gguf file (its embedded tokenizer), a Hugging Face directory
 * (its tokenizer.json), or a tokenizer.json itself. */
#ifndef AERIE_TOKENIZER_TOK_FILE_H
#define AERIE_TOKENIZER_TOK_FILE_H

#include "../core/err.h"
#include "../model/gguf.h"
#include "tok.h"

typedef struct tok_file {
    gguf_file *gguf; /* the file it came from; NULL for a Hugging Face directory or tokenizer.json */
    tok *tok;
} tok_file;

int tok_file_open(tok_file *f, const char *path, ae_error *err);
void tok_file_close(tok_file *f); /* a zeroed one is a no-op */

#endif
