/* libFuzzer target: structured output's schema check and grammar matcher.
 *
 * The input is a JSON Schema, a NUL byte, then token ids (2 bytes each,
 * little-endian, modulo the vocabulary). The gateway's subset check
 * (gateway/schema.h) must accept or refuse the schema with a reason; an
 * accepted one is compiled the way the target's scheduler compiles it
 * (target/gcompile.h, its log line included), which must accept it or fail
 * with an error, never crash. An empty schema part is OpenAI's json_object:
 * no schema text at all, as the scheduler gets it. Then each id is
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
#include "../../services/core/log.h"
#include "../../services/tokenizer/tok_file.h"
#include "../../target/gcompile.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static tok_file tf;
static grammar_vocab *gv;
static int32_t V;
static uint32_t *mask, *again;

static void setup(void) {
    ae_error err = {{0}};
    log_set_level(LOG_OFF); /* the compile's log line is still formatted: its arguments are evaluated */
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
    char *text = NULL;
    if (slen > 0) {
        cJSON *schema = json_parse((const char *)data, slen, &err);
        if (!schema) return 0;
        char why[256] = "";
        if (schema_check(schema, why, sizeof why) != AE_OK) {
            if (!why[0]) abort(); /* a refusal always says why */
            cJSON_Delete(schema);
            return 0;
        }
        text = cJSON_PrintUnformatted(schema);
        cJSON_Delete(schema);
        if (!text) return 0;
    }
    /* Every compile logged (log_ms 0), in this thread (isolate false: the
     * fuzzer's coverage is of this process). */
    const gcompile_limits lim = {false, 0, 0, 0};
    grammar *g = NULL;
    grammar_matcher *m = NULL;
    int rc = gcompile_compile(&g, gv, text, &lim, NULL, NULL, &err);
    free(text);
    if (rc != AE_OK) {
        if (g || !err.msg[0] || (rc != GRAMMAR_REFUSED && rc != AE_ERR)) abort();
        /* The engine's refusal always has words after its prefix. */
        const char *p = "the schema cannot be compiled: ";
        if (rc == GRAMMAR_REFUSED && (strncmp(err.msg, p, strlen(p)) != 0 || !err.msg[strlen(p)])) abort();
        return 0;
    }
    if (grammar_matcher_new(&m, gv, g, &err) != AE_OK) abort();
    grammar_free(g);
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
