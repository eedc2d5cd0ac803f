/* Byte-level BPE tokenizer (GPT-2 family), loaded from GGUF metadata or
 * from a Hugging Face tokenizer.json.
 *
 * Encoding: added tokens are split out first (special ones only when
 * TOK_PARSE_SPECIAL is given, as the reference library's
 * split_special_tokens does), the rest is pre-tokenized with the model's
 * pre-tokenizer (gpt2, smollm, llama3), each piece's bytes are mapped through
 * the GPT-2 byte<->unicode table, and BPE merges are applied by rank.
 *
 * A loaded tokenizer is immutable: every function here may be called from
 * many threads at once on the same handle. */
#ifndef AERIE_TOKENIZER_TOK_H
#define AERIE_TOKENIZER_TOK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/err.h"
#include "../model/gguf.h"

typedef enum tok_pre {
    TOK_PRE_GPT2 = 0,
    TOK_PRE_SMOLLM = 1, /* every digit alone, then gpt2 */
    TOK_PRE_LLAMA3 = 2,
} tok_pre;

typedef struct tok tok;

enum tok_encode_flags {
    TOK_PARSE_SPECIAL = 1 << 0, /* recognise special tokens written in the text */
    TOK_ADD_BOS = 1 << 1,       /* prepend BOS if the model asks for it (tok_add_bos) */
};

/* Reads tokenizer.ggml.{model,pre,tokens,token_type,merges,bos_token_id,
 * eos_token_id,add_bos_token} and tokenizer.chat_template. */
int tok_load_gguf(tok **out, const gguf_file *f, ae_error *err);

/* Reads a tokenizer.json (model.type BPE with byte-level pre-tokenizer).
 * If a tokenizer_config.json sits beside it, bos/eos, add_bos_token and
 * chat_template are read from it. */
int tok_load_json(tok **out, const char *path, ae_error *err);

void tok_free(tok *t); /* NULL is a no-op */

int32_t tok_vocab_size(const tok *t);
tok_pre tok_pre_kind(const tok *t);
const char *tok_pre_name(tok_pre p); /* "gpt2", "smollm", "llama3" */
int32_t tok_bos(const tok *t);       /* -1 when none */
int32_t tok_eos(const tok *t);       /* -1 when none */
bool tok_add_bos(const tok *t);

/* The model's chat template (NUL-terminated) or NULL if it has none. */
const char *tok_chat_template(const tok *t);

/* Raw bytes of a token after undoing the byte-level map ("Ġhi" -> " hi").
 * For special tokens, their literal text. NULL for an id out of range. */
const uint8_t *tok_token_bytes(const tok *t, int32_t id, size_t *len);
/* Bytes of the longest token (tok_token_bytes), known from loading. */
size_t tok_max_token_bytes(const tok *t);
bool tok_is_special(const tok *t, int32_t id);
/* Id of the vocabulary entry whose raw (mapped) text is s, or -1. */
int32_t tok_find(const tok *t, const char *s, size_t len);

/* Encodes text[0..len). Writes at most cap ids; len + 1 is always enough.
 * Returns AE_ERR (and *n_out = 0) if cap is too small.
 * Any bytes are accepted: ill-formed UTF-8 is split byte by byte as
 * punctuation (see pretok.h), and a byte the vocabulary has no token for is
 * dropped, as Hugging Face's BPE without unk_token does (SmolLM2 lacks 21,
 * e.g. 0x04, 0x1D, 0xC0, 0xFF). */
int tok_encode(const tok *t, const char *text, size_t len, int flags, int32_t *ids, size_t cap, size_t *n_out,
               ae_error *err);

/* Decodes ids to bytes, invalid UTF-8 replaced by U+FFFD the way Rust's
 * from_utf8_lossy does (which is what the reference implementation does).
 * cap is the size of out, NUL included (as snprintf): at most cap - 1 bytes
 * and a NUL are written (nothing when cap is 0, out may then be NULL).
 * *len_out is the full length without the NUL, so *len_out >= cap means the
 * text was cut; retry with *len_out + 1. Ids out of range give AE_ERR.
 * skip_special drops special tokens. */
int tok_decode(const tok *t, const int32_t *ids, size_t n, bool skip_special, char *out, size_t cap, size_t *len_out,
               ae_error *err);

#endif
