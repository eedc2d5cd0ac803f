/* libFuzzer target: structured output's schema check and grammar matcher.
 *
 * The input is a JSON Schema, a NUL byte, then token ids (2 bytes each,
 * little-endian, modulo the vocabulary). The gateway's subset check
 * (gateway/schema.h) must accept or refuse the schema with a reason; an
 * accepted one is compiled by the target's engine (target/grammar.h),
 * which must accept it or fail with an error, never crash. Then each id is
 * offered to the matcher: it must be taken exactly when the mask allows
 * it, and a refused id must change nothing (the next mask is the same).
 * The vocabulary is the default model's (models/, fetched by
 * tools/fetch_model.sh); run from the repo root. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "../../gateway/schema.h"
#include "../../services/core/json.h"
#include "../../services/tokenizer/tok_file.h"
#include "../../target/grammar.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static tok_file tf;
static grammar_vocab *gv;
static int32_t V;
static uint32_t *mask, *again;

static void setup(void) {
    ae_error err = {{0}};
    if (tok_file_open(&tf, "models/SmolLM2-135M-Instruct.Q4_1.gguf", &err) != AE_OK ||
        grammar_vocab_init(&gv, tf.tok, tok_vocab_size(tf.tok), tok_eos(tf.tok), &err) != AE_OK) {
        fprintf(stderr, "fuzz_schema: %s (run from the repo root after tools/fetch_model.sh)\n", err.msg);
        abort();
    }
    V = tok_vocab_size(tf.tok);
    mask = calloc((size_t)(V + 31) / 32, sizeof *mask);
    again = calloc((size_t)(V + 31) / 32, sizeof *again);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!gv) setup();
    const uint8_t *nul = memchr(data, 0, size);
    size_t slen = nul ? (size_t)(nul - data) : size;
    ae_error err = {{0}};
    cJSON *schema = json_parse((const char *)data, slen, &err);
    if (!schema) return 0;
    char why[256] = "";
    if (schema_check(schema, why, sizeof why) != AE_OK) {
        if (!why[0]) abort(); /* a refusal always says why */
        cJSON_Delete(schema);
        return 0;
    }
    char *text = cJSON_PrintUnformatted(schema);
    cJSON_Delete(schema);
    grammar_matcher *m = NULL;
    if (!text || grammar_matcher_init(&m, gv, text, &err) != AE_OK) {
        if (m || (text && !err.msg[0])) abort();
        free(text);
        return 0;
    }
    free(text);
    const uint8_t *ids = nul ? nul + 1 : data + size;
    size_t n = nul ? size - slen - 1 : 0;
    for (size_t i = 0; i + 1 < n && !grammar_terminated(m); i += 2) {
        int32_t id = (int32_t)((ids[i] | ids[i + 1] << 8) % (uint32_t)V);
        grammar_fill_mask(m, mask);
        bool ok = mask[id / 32] >> (id % 32) & 1;
        if (grammar_accept(m, id) != ok) abort();
        if (!ok) {
            grammar_fill_mask(m, again);
            if (memcmp(mask, again, (size_t)(V + 31) / 32 * sizeof *mask) != 0) abort();
        }
    }
    grammar_matcher_free(m);
    return 0;
}
