/* Pre-tokenizers for byte-level BPE: hand-written scanners that split text
 * exactly where Hugging Face tokenizers' regexes (run on Oniguruma) split it.
 *
 *   gpt2    's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *   smollm  every \p{N} character alone (Digits(individual_digits)), then gpt2
 *           on the text between them, each stretch as if it were all the text
 *   llama3  (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
 *            ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 *
 * Character classes come from unicode_tables.h (tools/gen_unicode_tables.py).
 *
 * Invalid UTF-8: the reference only ever sees valid text, so there is nothing
 * to match. Here each byte that does not start a well-formed sequence (or
 * starts a truncated one) counts as one character of its own, neither letter,
 * number nor space: it joins a ` ?[^\s\p{L}\p{N}]+` run like punctuation. No
 * input byte is ever dropped or read past `len`. */
#ifndef AERIE_TOKENIZER_PRETOK_H
#define AERIE_TOKENIZER_PRETOK_H

#include <stddef.h>
#include <stdint.h>

#include "tok.h"

enum pretok_class {
    PRETOK_OTHER = 0,
    PRETOK_LETTER = 1, /* \p{L} */
    PRETOK_NUMBER = 2, /* \p{N} */
    PRETOK_SPACE = 3,  /* \s (White_Space) */
};

/* Class of a code point (0..0x10FFFF; anything above is OTHER). */
int pretok_class(uint32_t cp);

/* Decodes one character at s[0..len), len >= 1. Returns its length in bytes
 * (1..4) and its class; an ill-formed byte is one OTHER character. */
size_t pretok_char(const uint8_t *s, size_t len, int *cls);

/* End of the piece that starts at pos (pos < len); always > pos. Pieces
 * tile the text: call again from the returned offset. */
size_t pretok_next(tok_pre kind, const uint8_t *s, size_t len, size_t pos);

/* The Unicode version the class tables were generated from. */
const char *pretok_unicode_version(void);

#endif
