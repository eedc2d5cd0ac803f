/* Structured output: token masks from a JSON Schema (OpenAI's
 * response_format), step by step.
 *
 * The engine is XGrammar (Apache-2.0, C++; built from its PyPI source by
 * tools/build_xgrammar.sh): it turns a schema into a grammar, builds the
 * token-level automaton for the vocabulary once, and caches compiled
 * schemas. This file is the C face of it (grammar.cc).
 *
 * A schema comes already checked by the gateway (gateway/schema.h: the
 * subset the README lists); here it is compiled as given. JSON's
 * whitespace between tokens is bounded (GRAMMAR_MAX_WS), or small models
 * loop in it. Once the value is complete the only token allowed is the
 * end of sequence.
 *
 * A grammar_vocab is shared by every request and thread (compiles run
 * side by side, its cache is locked); a matcher is one sequence's and is
 * used by one thread. The service compiles through target/gcompile.h
 * (time budget, cancellation, a thread that can be abandoned). */
#ifndef AERIE_TARGET_GRAMMAR_H
#define AERIE_TARGET_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../services/core/err.h"
#include "../services/tokenizer/tok.h"

#define GRAMMAR_MAX_WS 2 /* whitespace characters allowed between JSON tokens */
/* Compiled schemas kept for reuse, at most this many bytes (the least
 * recently used go first): clients cannot grow the target without bound
 * by sending new schemas. */
#define GRAMMAR_CACHE_BYTES (64ll << 20)

typedef struct grammar_vocab grammar_vocab;
typedef struct grammar grammar; /* a compiled schema */
typedef struct grammar_matcher grammar_matcher;

/* The automaton's vocabulary: each id's bytes (tok_token_bytes), special
 * tokens never allowed but eos, which ends a complete value. vocab is the
 * model's (rows of its logits), at least the tokenizer's. */
int grammar_vocab_init(grammar_vocab **out, const tok *t, int32_t vocab, int32_t eos, ae_error *err);
/* One more owner: grammar_vocab_free frees it when the last one lets go
 * (a compile thread that outlives its caller holds one, gcompile.c). */
void grammar_vocab_ref(grammar_vocab *v);
void grammar_vocab_free(grammar_vocab *v); /* NULL is a no-op */

/* Compiles schema (JSON text; NULL: any JSON object, OpenAI's
 * json_object); compiled schemas are cached by text. A schema the engine
 * cannot make a grammar of is GRAMMAR_REFUSED, with the engine's reason
 * in err (a client's error); anything else (memory) is AE_ERR. A compile
 * can take seconds for a large schema, and cannot be stopped once it
 * runs: the service compiles through gcompile.h. */
#define GRAMMAR_REFUSED 2
int grammar_compile(grammar **out, grammar_vocab *v, const char *schema, ae_error *err);
/* The compiled schema from the cache (AE_OK), or AE_ERR when it is not
 * there; compiles nothing. */
int grammar_cached(grammar **out, grammar_vocab *v, const char *schema);
void grammar_free(grammar *g); /* NULL is a no-op */

/* A matcher at the start of a value of g (g may be freed after). */
int grammar_matcher_new(grammar_matcher **out, grammar_vocab *v, const grammar *g, ae_error *err);
/* Both at once. */
int grammar_matcher_init(grammar_matcher **out, grammar_vocab *v, const char *schema, ae_error *err);
void grammar_matcher_free(grammar_matcher *m); /* NULL is a no-op */

/* Bit i of mask (uint32 [(vocab + 31) / 32]) is set when token i may come
 * next. */
void grammar_fill_mask(grammar_matcher *m, uint32_t *mask);
/* Takes token; false (nothing changed) when the grammar refuses it. */
bool grammar_accept(grammar_matcher *m, int32_t token);
/* The value is complete and eos was taken. */
bool grammar_terminated(const grammar_matcher *m);

/* This matcher's time filling masks, ns, and (masks) how many it filled. */
uint64_t grammar_matcher_mask_ns(const grammar_matcher *m, uint64_t *masks);

/* Time spent filling masks, and masks filled, since init (all matchers). */
void grammar_vocab_mask_stats(const grammar_vocab *v, uint64_t *masks, uint64_t *ns);

#endif
