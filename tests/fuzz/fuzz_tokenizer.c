/* libFuzzer target for the tokenizer: arbitrary bytes through all three
 * pre-tokenizers (tokenizer.json files of tests/golden/tokenizer/, loaded
 * once; run from the repository root), then decode. Checks:
 *   - encode never fails with len + 1 room, and never yields more ids;
 *   - decode(encode(x)) == x for valid UTF-8 whose bytes all have tokens
 *     (special tokens come back as their text), with and without
 *     special-token parsing;
 *   - decode of any ids is valid UTF-8 and respects the buffer it is given. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../services/tokenizer/tok.h"

#define N_TOK 3

static tok *toks[N_TOK];
static bool missing[N_TOK][256]; /* bytes without a token: dropped by encode */

static void init(void) {
    static const char *const paths[N_TOK] = {
        "tests/golden/tokenizer/smollm/tokenizer.json",
        "tests/golden/tokenizer/gpt2/tokenizer.json",
        "tests/golden/tokenizer/llama3/tokenizer.json",
    };
    for (int k = 0; k < N_TOK; k++) {
        ae_error err = {{0}};
        if (tok_load_json(&toks[k], paths[k], &err)) {
            fprintf(stderr, "fuzz_tokenizer: %s (run from the repo root)\n", err.msg);
            abort();
        }
        for (int b = 0; b < 256; b++) {
            char c = (char)b;
            int32_t id[2];
            size_t n;
            if (tok_encode(toks[k], &c, 1, 0, id, 2, &n, NULL)) abort();
            missing[k][b] = n == 0;
        }
    }
}

static bool valid_utf8(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint8_t b = s[i];
        size_t k;
        uint8_t lo = 0x80, hi = 0xBF;
        if (b < 0x80)
            k = 0;
        else if (b >= 0xC2 && b <= 0xDF)
            k = 1;
        else if (b >= 0xE0 && b <= 0xEF) {
            k = 2;
            if (b == 0xE0) lo = 0xA0;
            if (b == 0xED) hi = 0x9F;
        } else if (b >= 0xF0 && b <= 0xF4) {
            k = 3;
            if (b == 0xF0) lo = 0x90;
            if (b == 0xF4) hi = 0x8F;
        } else
            return false;
        if (k && i + k >= n) return false;
        for (size_t j = 1; j <= k; j++) {
            if (s[i + j] < lo || s[i + j] > hi) return false;
            lo = 0x80;
            hi = 0xBF;
        }
        i += k + 1;
    }
    return true;
}

static void check_round_trip(const tok *t, const bool *miss, const uint8_t *data, size_t size, int flags, bool valid) {
    int32_t *ids = malloc((size + 1) * sizeof *ids);
    size_t n;
    ae_error err = {{0}};
    if (!ids) return;
    if (tok_encode(t, (const char *)data, size, flags, ids, size + 1, &n, &err) || n > size) {
        fprintf(stderr, "encode failed: %s\n", err.msg);
        abort();
    }
    /* Lossy decode grows at most 3x (one U+FFFD per byte). */
    size_t cap = 3 * size + 1, len;
    char *out = malloc(cap);
    if (!out || tok_decode(t, ids, n, false, out, cap, &len, NULL) || len >= cap) abort();
    if (!valid_utf8((const uint8_t *)out, len)) abort();
    /* A dropped byte can leave a broken sequence behind (SmolLM2 has no
     * token for 0xF1, a valid lead byte), so only texts without such bytes
     * must come back unchanged. */
    bool exact = valid;
    for (size_t i = 0; i < size && exact; i++) exact = !miss[data[i]];
    if (exact) {
        if (len != size || memcmp(out, data, size) != 0) {
            fprintf(stderr, "decode(encode(x)) != x (flags %d)\n", flags);
            abort();
        }
    }
    /* A short buffer gets a NUL-terminated prefix and the full length. */
    size_t short_cap = len / 2 + 1, len2;
    char *part = malloc(short_cap);
    if (!part || tok_decode(t, ids, n, false, part, short_cap, &len2, NULL) || len2 != len ||
        memcmp(part, out, short_cap - 1) != 0 || part[short_cap - 1] != '\0')
        abort();
    free(part);
    free(out);
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!toks[0]) init();
    bool valid = valid_utf8(data, size);
    for (int k = 0; k < N_TOK; k++) {
        check_round_trip(toks[k], missing[k], data, size, 0, valid);
        check_round_trip(toks[k], missing[k], data, size, TOK_PARSE_SPECIAL, valid);
    }
    /* The same bytes read as ids. */
    size_t n = size / 4;
    int32_t *ids = malloc((n + 1) * sizeof *ids);
    if (!ids) return 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t v;
        memcpy(&v, data + 4 * i, 4);
        ids[i] = (int32_t)(v % (uint32_t)tok_vocab_size(toks[0]));
    }
    size_t len;
    if (tok_decode(toks[0], ids, n, (size & 1) != 0, NULL, 0, &len, NULL)) abort();
    char *out = malloc(len + 1);
    size_t len2;
    if (!out || tok_decode(toks[0], ids, n, (size & 1) != 0, out, len + 1, &len2, NULL) || len2 != len ||
        !valid_utf8((const uint8_t *)out, len))
        abort();
    free(out);
    free(ids);
    return 0;
}
