/* Byte-level BPE tokenizer against Hugging Face tokenizers: the golden
 * corpus (tests/golden/tokenizer/, from tools/gen_tokenizer_golden.py) must
 * match id for id for smollm from the GGUF and from tokenizer.json, and for
 * gpt2 and llama3 from theirs. Also: round trips, BOS, lossy decode, buffer
 * limits, concurrent use, and loader errors. Run from the repository root. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>
#include <pthread.h>

#include "../../services/core/err.h"
#include "../../services/model/gguf.h"
#include "../../services/tokenizer/tok.h"
#include "gguf_writer.h"

#define MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define GOLDEN "tests/golden/tokenizer"
#define N_CONFIGS 3

static const char *const CONFIG_NAMES[N_CONFIGS] = {"smollm", "gpt2", "llama3"};

typedef struct corpus_row {
    char *text;
    size_t len;
    int32_t *ids[N_CONFIGS];
    size_t n_ids[N_CONFIGS];
} corpus_row;

static corpus_row *corpus;
static size_t corpus_n;
static tok *json_tok[N_CONFIGS];
static tok *gguf_tok;
static gguf_file *gguf;
static ae_error gguf_err;

/* ------------------------------------------------------------------------ */
/* Fixtures */

static char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)size + 1);
    if (buf && fread(buf, 1, (size_t)size, f) != (size_t)size) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) buf[size] = '\0';
    *len = (size_t)size;
    return buf;
}

static int load_corpus(void) {
    size_t len;
    char *text = slurp(GOLDEN "/corpus.jsonl", &len);
    if (!text) {
        fprintf(stderr, "cannot read %s/corpus.jsonl (run from the repo root)\n", GOLDEN);
        return -1;
    }
    size_t cap = 0;
    for (char *line = text, *nl; *line; line = nl + 1) {
        nl = strchr(line, '\n');
        if (!nl) break;
        cJSON *row = cJSON_ParseWithLength(line, (size_t)(nl - line));
        const cJSON *s = cJSON_GetObjectItemCaseSensitive(row, "text");
        if (!cJSON_IsString(s)) {
            fprintf(stderr, "corpus.jsonl: bad line %zu\n", corpus_n + 1);
            cJSON_Delete(row);
            free(text);
            return -1;
        }
        if (corpus_n == cap) {
            cap = cap ? cap * 2 : 512;
            corpus = realloc(corpus, cap * sizeof *corpus);
        }
        corpus_row *r = &corpus[corpus_n++];
        r->text = strdup(s->valuestring);
        r->len = strlen(r->text);
        for (int c = 0; c < N_CONFIGS; c++) {
            const cJSON *arr = cJSON_GetObjectItemCaseSensitive(row, CONFIG_NAMES[c]);
            r->n_ids[c] = (size_t)cJSON_GetArraySize(arr);
            r->ids[c] = malloc((r->n_ids[c] + 1) * sizeof(int32_t));
            size_t k = 0;
            const cJSON *it;
            cJSON_ArrayForEach(it, arr) r->ids[c][k++] = (int32_t)it->valuedouble;
        }
        cJSON_Delete(row);
    }
    free(text);
    return 0;
}

static int group_setup(void **state) {
    (void)state;
    if (load_corpus()) return -1;
    for (int c = 0; c < N_CONFIGS; c++) {
        char path[256];
        ae_error err = {{0}};
        snprintf(path, sizeof path, GOLDEN "/%s/tokenizer.json", CONFIG_NAMES[c]);
        if (tok_load_json(&json_tok[c], path, &err)) {
            fprintf(stderr, "%s\n", err.msg);
            return -1;
        }
    }
    /* A missing model fails the tests that need it, with the way out. */
    if (access(MODEL, R_OK) != 0)
        err_set(&gguf_err, "%s is missing: run `make model`", MODEL);
    else if (gguf_open(&gguf, MODEL, &gguf_err) == AE_OK)
        tok_load_gguf(&gguf_tok, gguf, &gguf_err);
    return 0;
}

static int group_teardown(void **state) {
    (void)state;
    for (int c = 0; c < N_CONFIGS; c++) tok_free(json_tok[c]);
    tok_free(gguf_tok);
    gguf_close(gguf);
    for (size_t i = 0; i < corpus_n; i++) {
        free(corpus[i].text);
        for (int c = 0; c < N_CONFIGS; c++) free(corpus[i].ids[c]);
    }
    free(corpus);
    return 0;
}

static tok *need_gguf(void) {
    if (!gguf_tok) fail_msg("%s", gguf_err.msg);
    return gguf_tok;
}

/* Encodes s with special tokens parsed; the caller frees. */
static int32_t *encode(const tok *t, const char *s, size_t len, int flags, size_t *n) {
    int32_t *ids = malloc((len + 1) * sizeof *ids);
    ae_error err = {{0}};
    assert_non_null(ids);
    if (tok_encode(t, s, len, flags, ids, len + 1, n, &err) != AE_OK) fail_msg("tok_encode: %s", err.msg);
    return ids;
}

/* ------------------------------------------------------------------------ */
/* The golden corpus */

static void check_corpus(const tok *t, int config, const char *source) {
    size_t ok = 0, shown = 0;
    for (size_t i = 0; i < corpus_n; i++) {
        const corpus_row *r = &corpus[i];
        size_t n;
        int32_t *ids = encode(t, r->text, r->len, TOK_PARSE_SPECIAL, &n);
        bool same = n == r->n_ids[config] && memcmp(ids, r->ids[config], n * sizeof *ids) == 0;
        if (same) {
            ok++;
        } else if (shown++ < 5) {
            size_t k = 0;
            while (k < n && k < r->n_ids[config] && ids[k] == r->ids[config][k]) k++;
            fprintf(stderr, "mismatch (%s %s) line %zu: %zu ids vs %zu, first difference at %zu\n",
                    CONFIG_NAMES[config], source, i + 1, n, r->n_ids[config], k);
        }
        free(ids);
    }
    printf("corpus: %zu/%zu match (%s %s)\n", ok, corpus_n, CONFIG_NAMES[config], source);
    assert_true(corpus_n >= 350);
    assert_int_equal(ok, corpus_n);
}

static void test_corpus_smollm_gguf(void **state) {
    (void)state;
    check_corpus(need_gguf(), 0, "gguf");
}

static void test_corpus_smollm_json(void **state) {
    (void)state;
    check_corpus(json_tok[0], 0, "tokenizer.json");
}

static void test_corpus_gpt2_json(void **state) {
    (void)state;
    check_corpus(json_tok[1], 1, "tokenizer.json");
}

static void test_corpus_llama3_json(void **state) {
    (void)state;
    check_corpus(json_tok[2], 2, "tokenizer.json");
}

/* SmolLM2's vocabulary has no token for 21 bytes (0x04, 0x1D, 0xC0, 0xFF,
 * ...; none can occur in UTF-8 text but a few control characters). Like HF
 * (a BPE without unk_token), the encoder drops them. */
static void missing_bytes(const tok *t, bool missing[256]) {
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        size_t n;
        int32_t *ids = encode(t, &c, 1, 0, &n);
        missing[b] = n == 0;
        free(ids);
    }
}

static void test_bytes_missing_from_the_vocabulary_are_dropped(void **state) {
    (void)state;
    bool missing[256];
    missing_bytes(json_tok[0], missing);
    int count = 0;
    for (int b = 0; b < 256; b++) count += missing[b];
    assert_int_equal(count, 21);
    assert_true(missing[0x1D] && missing[0xFF] && missing[0xC0]);
    size_t n;
    int32_t *ids = encode(json_tok[0],
                          "a\x1D"
                          "b",
                          3, 0, &n);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0], tok_find(json_tok[0], "a", 1));
    assert_int_equal(ids[1], tok_find(json_tok[0], "b", 1));
    free(ids);
}

static void test_decode_inverts_encode(void **state) {
    (void)state;
    bool missing[256];
    missing_bytes(json_tok[0], missing);
    size_t checked = 0;
    for (size_t k = 0; k < N_CONFIGS; k++) {
        for (size_t i = 0; i < corpus_n; i++) {
            const corpus_row *r = &corpus[i];
            char *want = malloc(r->len + 1), *out = malloc(r->len + 1);
            size_t n, len, want_len = 0;
            for (size_t j = 0; j < r->len; j++)
                if (!missing[(uint8_t)r->text[j]]) want[want_len++] = r->text[j];
            int32_t *ids = encode(json_tok[k], r->text, r->len, TOK_PARSE_SPECIAL, &n);
            assert_int_equal(tok_decode(json_tok[k], ids, n, false, out, r->len + 1, &len, NULL), AE_OK);
            assert_int_equal(len, want_len);
            assert_memory_equal(out, want, want_len);
            assert_int_equal(out[len], '\0');
            checked += want_len == r->len;
            free(want);
            free(out);
            free(ids);
        }
    }
    assert_true(checked > N_CONFIGS * (corpus_n - 10)); /* nearly all are exact */
}

/* A GGUF holding the real model's tokens, types and merges under another
 * tokenizer.ggml.model / .pre, built in memory. */
static void build_gguf(gw *w, const char *model, const char *pre) {
    const gguf_file *f = gguf;
    int64_t ki = gguf_find_key(f, "tokenizer.ggml.tokens");
    int64_t ti = gguf_find_key(f, "tokenizer.ggml.token_type");
    int64_t mi = gguf_find_key(f, "tokenizer.ggml.merges");
    assert_true(ki >= 0 && ti >= 0 && mi >= 0);
    uint64_t n_tok = gguf_arr_len(f, (uint64_t)ki), n_merges = gguf_arr_len(f, (uint64_t)mi);
    gw_header(w, 3, 0, 6);
    gw_kv_str(w, "tokenizer.ggml.model", model);
    gw_kv_str(w, "tokenizer.ggml.pre", pre);
    gw_arr(w, "tokenizer.ggml.tokens", 8, n_tok);
    for (uint64_t j = 0; j < n_tok; j++) {
        gguf_str str;
        assert_int_equal(gguf_arr_str(f, (uint64_t)ki, j, &str), AE_OK);
        gw_strn(w, str.ptr, str.len);
    }
    gw_arr(w, "tokenizer.ggml.token_type", 5, n_tok);
    for (uint64_t j = 0; j < n_tok; j++) {
        int64_t v;
        assert_int_equal(gguf_arr_i64(f, (uint64_t)ti, j, &v), AE_OK);
        gw_u32(w, (uint32_t)v);
    }
    gw_arr(w, "tokenizer.ggml.merges", 8, n_merges);
    for (uint64_t j = 0; j < n_merges; j++) {
        gguf_str str;
        assert_int_equal(gguf_arr_str(f, (uint64_t)mi, j, &str), AE_OK);
        gw_strn(w, str.ptr, str.len);
    }
    gw_kv_u32(w, "tokenizer.ggml.eos_token_id", 2);
    gw_pad(w, 32);
}

static tok *load_built_gguf(gw *w, ae_error *err) {
    gguf_file *f = NULL;
    tok *t = NULL;
    if (gguf_open_mem(&f, w->p, w->len, "built.gguf", err) == AE_OK) tok_load_gguf(&t, f, err);
    gguf_close(f);
    return t;
}

static void test_corpus_gpt2_and_llama3_from_gguf(void **state) {
    (void)state;
    need_gguf();
    static const struct {
        const char *pre;
        int config;
    } cases[] = {{"gpt2", 1}, {"llama-bpe", 2}};
    for (size_t i = 0; i < 2; i++) {
        gw w = {0};
        ae_error err = {{0}};
        build_gguf(&w, "gpt2", cases[i].pre);
        tok *t = load_built_gguf(&w, &err);
        if (!t) fail_msg("%s", err.msg);
        assert_int_equal(tok_bos(t), -1); /* absent keys stay absent */
        assert_int_equal(tok_eos(t), 2);
        assert_false(tok_add_bos(t));
        assert_null(tok_chat_template(t));
        check_corpus(t, cases[i].config, "gguf");
        tok_free(t);
        gw_free(&w);
    }
}

static void test_gguf_errors_name_the_problem(void **state) {
    (void)state;
    need_gguf();
    static const struct {
        const char *model, *pre, *needle;
    } cases[] = {
        {"gpt2", "qwen2", "tokenizer.ggml.pre \"qwen2\" is not supported"},
        {"llama", "smollm", "tokenizer.ggml.model \"llama\" is not supported"},
    };
    for (size_t i = 0; i < 2; i++) {
        gw w = {0};
        ae_error err = {{0}};
        build_gguf(&w, cases[i].model, cases[i].pre);
        tok *t = load_built_gguf(&w, &err);
        assert_null(t);
        if (!strstr(err.msg, cases[i].needle) || !strstr(err.msg, "built.gguf"))
            fail_msg("error \"%s\" lacks \"%s\"", err.msg, cases[i].needle);
        gw_free(&w);
    }
}

/* ------------------------------------------------------------------------ */
/* Metadata */

static void check_smollm_metadata(const tok *t, tok_pre pre) {
    assert_int_equal(tok_vocab_size(t), 49152);
    assert_int_equal(tok_pre_kind(t), pre);
    assert_int_equal(tok_bos(t), 1);
    assert_int_equal(tok_eos(t), 2);
    assert_false(tok_add_bos(t));
    assert_non_null(tok_chat_template(t));
    assert_int_equal(strncmp(tok_chat_template(t), "{% for message in messages %}", 29), 0);
    for (int32_t id = 0; id <= 16; id++) assert_true(tok_is_special(t, id));
    assert_false(tok_is_special(t, 17));
    assert_false(tok_is_special(t, -1));
    assert_false(tok_is_special(t, 49152));
}

static void test_metadata_gguf(void **state) {
    (void)state;
    check_smollm_metadata(need_gguf(), TOK_PRE_SMOLLM);
}

static void test_metadata_json(void **state) {
    (void)state;
    check_smollm_metadata(json_tok[0], TOK_PRE_SMOLLM);
    assert_int_equal(tok_pre_kind(json_tok[1]), TOK_PRE_GPT2);
    assert_int_equal(tok_pre_kind(json_tok[2]), TOK_PRE_LLAMA3);
    /* No tokenizer_config.json beside these two. */
    assert_int_equal(tok_bos(json_tok[1]), -1);
    assert_null(tok_chat_template(json_tok[2]));
    assert_string_equal(tok_pre_name(TOK_PRE_GPT2), "gpt2");
    assert_string_equal(tok_pre_name(TOK_PRE_SMOLLM), "smollm");
    assert_string_equal(tok_pre_name(TOK_PRE_LLAMA3), "llama3");
}

static void test_token_bytes_unmap_the_byte_level_text(void **state) {
    (void)state;
    const tok *t = json_tok[0];
    int32_t id = tok_find(t,
                          "\xC4\xA0"
                          "hello",
                          7); /* "Ġhello" */
    assert_true(id > 16);
    size_t len;
    const uint8_t *b = tok_token_bytes(t, id, &len);
    assert_int_equal(len, 6);
    assert_memory_equal(b, " hello", 6);
    b = tok_token_bytes(t, 1, &len);
    assert_int_equal(len, 12);
    assert_memory_equal(b, "<|im_start|>", 12);
    assert_null(tok_token_bytes(t, 49152, &len));
    assert_null(tok_token_bytes(t, -1, &len));
    assert_int_equal(tok_find(t, "<|im_end|>", 10), 2);
    assert_int_equal(tok_find(t, "no such token at all", 20), -1);
}

/* ------------------------------------------------------------------------ */
/* Encoding details */

static void test_specials_parsed_only_when_asked(void **state) {
    (void)state;
    const tok *t = json_tok[0];
    const char *s = "<|im_start|>user";
    size_t n;
    int32_t *ids = encode(t, s, strlen(s), TOK_PARSE_SPECIAL, &n);
    assert_true(n >= 2);
    assert_int_equal(ids[0], 1);
    free(ids);
    ids = encode(t, s, strlen(s), 0, &n);
    assert_true(n > 2);
    for (size_t i = 0; i < n; i++) assert_false(tok_is_special(t, ids[i]));
    free(ids);
}

static void test_add_bos_only_when_the_model_asks(void **state) {
    (void)state;
    size_t n;
    /* SmolLM2 says add_bos_token false: the flag changes nothing. */
    int32_t *ids = encode(json_tok[0], "hi", 2, TOK_ADD_BOS, &n);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], tok_find(json_tok[0], "hi", 2));
    free(ids);

    /* The same tokenizer with a config that asks for <|endoftext|>. */
    char dir[] = "/tmp/aerie-tok-XXXXXX", path[256], abs[4096];
    assert_non_null(mkdtemp(dir));
    assert_non_null(realpath(GOLDEN "/smollm/tokenizer.json", abs));
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    assert_int_equal(symlink(abs, path), 0);
    char cfg[256];
    snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", dir);
    FILE *f = fopen(cfg, "w");
    assert_non_null(f);
    fputs("{\"add_bos_token\": true, \"bos_token\": {\"content\": \"<|endoftext|>\"},"
          " \"eos_token\": \"<|im_end|>\"}",
          f);
    fclose(f);
    tok *t = NULL;
    ae_error err = {{0}};
    assert_int_equal(tok_load_json(&t, path, &err), AE_OK);
    assert_true(tok_add_bos(t));
    assert_int_equal(tok_bos(t), 0);
    assert_int_equal(tok_eos(t), 2);
    ids = encode(t, "hi", 2, TOK_ADD_BOS, &n);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0], 0);
    assert_int_equal(ids[1], tok_find(t, "hi", 2));
    free(ids);
    ids = encode(t, "hi", 2, 0, &n);
    assert_int_equal(n, 1);
    free(ids);
    /* Empty text still gets its BOS. */
    ids = encode(t, "", 0, TOK_ADD_BOS, &n);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], 0);
    free(ids);
    tok_free(t);
    unlink(cfg);
    unlink(path);
    rmdir(dir);
}

static void test_encode_reports_small_buffers(void **state) {
    (void)state;
    const tok *t = json_tok[0];
    const char *s = "Hello world, 123";
    size_t n;
    int32_t *want = encode(t, s, strlen(s), 0, &n);
    int32_t ids[64];
    size_t got = 99;
    ae_error err = {{0}};
    assert_int_equal(tok_encode(t, s, strlen(s), 0, ids, n - 1, &got, &err), AE_ERR);
    assert_int_equal(got, 0);
    assert_non_null(strstr(err.msg, "not enough room"));
    assert_int_equal(tok_encode(t, s, strlen(s), 0, ids, n, &got, NULL), AE_OK);
    assert_int_equal(got, n);
    assert_memory_equal(ids, want, n * sizeof *ids);
    free(want);
}

static void test_nul_and_control_bytes_are_ordinary_bytes(void **state) {
    (void)state;
    const tok *t = json_tok[0];
    size_t n;
    int32_t *ids = encode(t, "a\0b", 3, TOK_PARSE_SPECIAL, &n);
    assert_int_equal(n, 3);
    assert_int_equal(ids[0], tok_find(t, "a", 1));
    assert_int_equal(ids[1], tok_find(t, "\xC4\x80", 2)); /* byte 0 maps to U+0100 */
    assert_int_equal(ids[2], tok_find(t, "b", 1));
    free(ids);
}

static void test_invalid_utf8_encodes_and_decodes_lossily(void **state) {
    (void)state;
    static const struct {
        const char *in, *out;
    } cases[] = {
        {"\xE2\x82", "\xEF\xBF\xBD"}, /* truncated: one U+FFFD */
        {"\xE2\x82"
         "a",
         "\xEF\xBF\xBD"
         "a"},
        {"\x80", "\xEF\xBF\xBD"},                                 /* lone continuation */
        {"\xE0\x80\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"}, /* overlong */
        {"\xED\xA0\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"}, /* surrogate */
        {"\xF4\x90\x80\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},
        {"ab\x80"
         "cd",
         "ab\xEF\xBF\xBD"
         "cd"},
        {"\xF0\x9F\x98\x80", "\xF0\x9F\x98\x80"}, /* valid emoji survives */
        {" \xF0\x9F\x98", " \xEF\xBF\xBD"},
    };
    for (int k = 0; k < N_CONFIGS; k++) {
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            size_t n, len;
            int32_t *ids = encode(json_tok[k], cases[i].in, strlen(cases[i].in), 0, &n);
            /* Every input byte is kept by the encoder. */
            size_t bytes = 0, bl;
            for (size_t j = 0; j < n; j++) {
                tok_token_bytes(json_tok[k], ids[j], &bl);
                bytes += bl;
            }
            assert_int_equal(bytes, strlen(cases[i].in));
            char out[64];
            assert_int_equal(tok_decode(json_tok[k], ids, n, false, out, sizeof out, &len, NULL), AE_OK);
            assert_int_equal(len, strlen(cases[i].out));
            assert_string_equal(out, cases[i].out);
            free(ids);
        }
    }
}

static void test_decode_truncates_and_reports_full_length(void **state) {
    (void)state;
    const tok *t = json_tok[0];
    const char *s = "Hello world";
    size_t n, len;
    int32_t *ids = encode(t, s, strlen(s), 0, &n);
    char out[6];
    assert_int_equal(tok_decode(t, ids, n, false, out, sizeof out, &len, NULL), AE_OK);
    assert_int_equal(len, 11);
    assert_string_equal(out, "Hello");
    assert_int_equal(tok_decode(t, ids, n, false, NULL, 0, &len, NULL), AE_OK);
    assert_int_equal(len, 11);
    free(ids);
}

static void test_decode_skips_specials_and_rejects_bad_ids(void **state) {
    (void)state;
    const tok *t = json_tok[0];
    int32_t hi = tok_find(t, "hi", 2);
    int32_t ids[] = {1, hi, 2};
    char out[64];
    size_t len;
    assert_int_equal(tok_decode(t, ids, 3, false, out, sizeof out, &len, NULL), AE_OK);
    assert_string_equal(out, "<|im_start|>hi<|im_end|>");
    assert_int_equal(tok_decode(t, ids, 3, true, out, sizeof out, &len, NULL), AE_OK);
    assert_string_equal(out, "hi");
    int32_t bad[] = {hi, 49152};
    ae_error err = {{0}};
    assert_int_equal(tok_decode(t, bad, 2, false, out, sizeof out, &len, &err), AE_ERR);
    assert_non_null(strstr(err.msg, "49152"));
    bad[1] = -5;
    assert_int_equal(tok_decode(t, bad, 2, false, out, sizeof out, &len, NULL), AE_ERR);
}

static void test_long_words_take_the_heap_path(void **state) {
    (void)state;
    /* 100 kB without a break goes through the heap merge (the corpus pins
     * its ids for words of a few hundred bytes); here it must be quick, not
     * quadratic, and lossless. */
    size_t len = 100000;
    char *s = malloc(len);
    for (size_t i = 0; i < len; i++) s[i] = "ab"[i & 1];
    size_t n, out_len;
    int32_t *ids = encode(json_tok[0], s, len, 0, &n);
    assert_true(n > 0 && n <= len / 2);
    char *back = malloc(len + 1);
    assert_int_equal(tok_decode(json_tok[0], ids, n, false, back, len + 1, &out_len, NULL), AE_OK);
    assert_int_equal(out_len, len);
    assert_memory_equal(back, s, len);
    free(back);
    free(ids);
    free(s);
}

typedef struct thread_arg {
    const tok *t;
    int config;
    size_t mismatches;
} thread_arg;

static void *encode_corpus_thread(void *p) {
    thread_arg *a = p;
    for (int round = 0; round < 3; round++) {
        for (size_t i = 0; i < corpus_n; i++) {
            const corpus_row *r = &corpus[i];
            int32_t *ids = malloc((r->len + 1) * sizeof *ids);
            size_t n;
            if (tok_encode(a->t, r->text, r->len, TOK_PARSE_SPECIAL, ids, r->len + 1, &n, NULL) ||
                n != r->n_ids[a->config] || memcmp(ids, r->ids[a->config], n * sizeof *ids) != 0)
                a->mismatches++;
            free(ids);
        }
    }
    return NULL;
}

static void test_one_handle_serves_many_threads(void **state) {
    (void)state;
    pthread_t th[4];
    thread_arg args[4];
    for (int i = 0; i < 4; i++) {
        args[i] = (thread_arg){json_tok[i & 1 ? 0 : 2], i & 1 ? 0 : 2, 0};
        assert_int_equal(pthread_create(&th[i], NULL, encode_corpus_thread, &args[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(args[i].mismatches, 0);
    }
}

/* ------------------------------------------------------------------------ */
/* Loader errors */

static void expect_json_error(const char *json, const char *needle) {
    char dir[] = "/tmp/aerie-tok-XXXXXX", path[256];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(json, f);
    fclose(f);
    tok *t = (tok *)&t; /* must come back NULL */
    ae_error err = {{0}};
    assert_int_equal(tok_load_json(&t, path, &err), AE_ERR);
    assert_null(t);
    if (!strstr(err.msg, needle)) fail_msg("error \"%s\" lacks \"%s\"", err.msg, needle);
    assert_non_null(strstr(err.msg, path)); /* names the file */
    unlink(path);
    rmdir(dir);
}

#define BL "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":true}"
#define VOCAB "\"vocab\":{\"a\":0,\"b\":1,\"ab\":2}"

static void test_json_errors_name_the_problem(void **state) {
    (void)state;
    expect_json_error("{\"model\":{\"type\":\"BPE\"," VOCAB "},\"pre_tokenizer\":" BL "}", "model.merges: missing");
    expect_json_error("{\"model\":{\"type\":\"BPE\"," VOCAB ",\"merges\":[]},"
                      "\"pre_tokenizer\":{\"type\":\"Metaspace\"}}",
                      "pre_tokenizer Metaspace is not supported");
    expect_json_error("{\"model\":{\"type\":\"BPE\"," VOCAB ",\"merges\":[]},"
                      "\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":"
                      "[{\"type\":\"WhitespaceSplit\"}," BL "]}}",
                      "pre_tokenizer Sequence[WhitespaceSplit, ByteLevel] is not supported");
    expect_json_error("{\"model\":{\"type\":\"BPE\"," VOCAB ",\"merges\":[]},"
                      "\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"use_regex\":false}}",
                      "pre_tokenizer ByteLevel is not supported");
    expect_json_error("{\"model\":{\"type\":\"WordPiece\"," VOCAB "}}", "model.type WordPiece is not supported");
    expect_json_error("{\"model\":{\"type\":\"BPE\"," VOCAB ",\"merges\":[\"a c\"]},"
                      "\"pre_tokenizer\":" BL "}",
                      "merge 0 \"a c\": right token not in the vocabulary");
    expect_json_error("{\"model\":{\"type\":\"BPE\"," VOCAB ",\"merges\":[\"ab\"]},"
                      "\"pre_tokenizer\":" BL "}",
                      "model.merges[0]");
    expect_json_error("{\"model\":{\"type\":\"BPE\"," VOCAB ",\"merges\":[]},"
                      "\"normalizer\":{\"type\":\"NFC\"},\"pre_tokenizer\":" BL "}",
                      "normalizer NFC is not supported");
    expect_json_error("{\"model\":", "not valid JSON");

    tok *t = NULL;
    ae_error err = {{0}};
    assert_int_equal(tok_load_json(&t, "/nonexistent/tokenizer.json", &err), AE_ERR);
    assert_non_null(strstr(err.msg, "/nonexistent/tokenizer.json"));
}

static void test_tiny_json_merges_both_forms(void **state) {
    (void)state;
    /* "a b" strings and [a, b] pairs mean the same merge. */
    const char *forms[] = {"[\"a b\"]", "[[\"a\",\"b\"]]"};
    for (int k = 0; k < 2; k++) {
        char dir[] = "/tmp/aerie-tok-XXXXXX", path[256], json[512];
        assert_non_null(mkdtemp(dir));
        snprintf(path, sizeof path, "%s/tokenizer.json", dir);
        snprintf(json, sizeof json,
                 "{\"model\":{\"type\":\"BPE\"," VOCAB ",\"merges\":%s},\"pre_tokenizer\":" BL
                 ",\"added_tokens\":[{\"id\":3,\"content\":\"<x>\",\"special\":true}]}",
                 forms[k]);
        FILE *f = fopen(path, "w");
        fputs(json, f);
        fclose(f);
        tok *t = NULL;
        ae_error err = {{0}};
        if (tok_load_json(&t, path, &err)) fail_msg("%s", err.msg);
        assert_int_equal(tok_vocab_size(t), 4);
        size_t n;
        int32_t *ids = encode(t, "abba<x>", 7, TOK_PARSE_SPECIAL, &n);
        assert_int_equal(n, 4);
        assert_int_equal(ids[0], 2); /* ab */
        assert_int_equal(ids[1], 1); /* b */
        assert_int_equal(ids[2], 0); /* a */
        assert_int_equal(ids[3], 3); /* <x> */
        free(ids);
        tok_free(t);
        unlink(path);
        rmdir(dir);
    }
    tok_free(NULL);
}

static void test_plain_added_tokens_split_even_without_specials(void **state) {
    (void)state;
    /* As the reference's encode_special_tokens: special tokens become plain
     * text, other added tokens are still split out. "<", "x", ">" have no
     * token here, so as text they are dropped. */
    char dir[] = "/tmp/aerie-tok-XXXXXX", path[256];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "w");
    fputs("{\"model\":{\"type\":\"BPE\"," VOCAB ",\"merges\":[\"a b\"]},\"pre_tokenizer\":" BL
          ",\"added_tokens\":[{\"id\":3,\"content\":\"<x>\",\"special\":true},"
          "{\"id\":4,\"content\":\"<y>\",\"special\":false}]}",
          f);
    fclose(f);
    tok *t = NULL;
    ae_error err = {{0}};
    if (tok_load_json(&t, path, &err)) fail_msg("%s", err.msg);
    size_t n;
    int32_t *ids = encode(t, "ab<y>b<x>a", 10, 0, &n);
    assert_int_equal(n, 4);
    assert_int_equal(ids[0], 2);
    assert_int_equal(ids[1], 4);
    assert_int_equal(ids[2], 1);
    assert_int_equal(ids[3], 0);
    free(ids);
    ids = encode(t, "ab<y>b<x>a", 10, TOK_PARSE_SPECIAL, &n);
    assert_int_equal(n, 5);
    assert_int_equal(ids[1], 4);
    assert_int_equal(ids[3], 3);
    free(ids);
    tok_free(t);
    unlink(path);
    rmdir(dir);
}

/* Writes a tokenizer.json with VOCAB's model and the added tokens given
 * as JSON entries; loads it. */
static tok *tiny_with_added(const char *added_json) {
    char dir[] = "/tmp/aerie-tok-XXXXXX", path[256];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f,
            "{\"model\":{\"type\":\"BPE\"," VOCAB ",\"merges\":[\"a b\"]},\"pre_tokenizer\":" BL
            ",\"added_tokens\":[%s]}",
            added_json);
    fclose(f);
    tok *t = NULL;
    ae_error err = {{0}};
    if (tok_load_json(&t, path, &err)) fail_msg("%s", err.msg);
    unlink(path);
    rmdir(dir);
    return t;
}

/* The matching the added tokens are defined by, written as the plain scan
 * it once was: at the leftmost position where one matches, the longest
 * (then the lowest id); special ones only when asked. */
static int32_t *encode_by_scan(const tok *t, const int32_t *added, int n_added, const char *s, size_t len, int flags,
                               size_t *n) {
    int32_t *ids = malloc((len + 1) * sizeof *ids);
    assert_non_null(ids);
    *n = 0;
    size_t pos = 0;
    while (pos <= len) {
        size_t at = len, best_len = 0;
        int32_t best = -1;
        for (size_t i = pos; i < len && best < 0; i++)
            for (int k = 0; k < n_added; k++) {
                if (!(flags & TOK_PARSE_SPECIAL) && tok_is_special(t, added[k])) continue;
                size_t tl;
                const uint8_t *tb = tok_token_bytes(t, added[k], &tl);
                if (tl > len - i || memcmp(s + i, tb, tl) != 0) continue;
                if (tl > best_len || (tl == best_len && added[k] < best)) best = added[k], best_len = tl, at = i;
            }
        size_t got = 0;
        ae_error err = {{0}};
        if (tok_encode(t, s + pos, at - pos, flags & ~TOK_ADD_BOS, ids + *n, len + 1 - *n, &got, &err) != AE_OK)
            fail_msg("%s", err.msg);
        *n += got;
        if (best < 0) break;
        ids[(*n)++] = best;
        pos = at + best_len;
    }
    return ids;
}

/* Overlapping added tokens (prefixes of each other, one inside another,
 * the same text twice, special and not): the tokenizer's matching gives
 * exactly what the scan gives, on every text of a bounded random set. */
static void test_added_token_matching_equals_the_scan(void **state) {
    (void)state;
    tok *t = tiny_with_added("{\"id\":3,\"content\":\"<a>\",\"special\":true},{\"id\":4,\"content\":\"<a\"},"
                             "{\"id\":5,\"content\":\"<ab>\",\"special\":true},{\"id\":6,\"content\":\"a>\"},"
                             "{\"id\":7,\"content\":\"<<\",\"special\":true},{\"id\":8,\"content\":\"<a>>\"},"
                             "{\"id\":9,\"content\":\"b<a\",\"special\":true},{\"id\":10,\"content\":\"<a>\"},"
                             "{\"id\":11,\"content\":\">\",\"special\":true}");
    const int32_t added[] = {3, 4, 5, 6, 7, 8, 9, 10, 11};
    const char alphabet[] = "<ab>";
    uint32_t seed = 12345;
    char s[24];
    for (int iter = 0; iter < 3000; iter++) {
        size_t len = 0;
        seed = seed * 1664525u + 1013904223u;
        size_t want_len = (seed >> 8) % sizeof s;
        for (; len < want_len; len++) {
            seed = seed * 1664525u + 1013904223u;
            s[len] = alphabet[(seed >> 16) % 4];
        }
        for (int flags = 0; flags <= TOK_PARSE_SPECIAL; flags += TOK_PARSE_SPECIAL) {
            size_t n, m;
            int32_t *got = encode(t, s, len, flags, &n);
            int32_t *want = encode_by_scan(t, added, 9, s, len, flags, &m);
            if (n != m || memcmp(got, want, n * sizeof *got) != 0)
                fail_msg("\"%.*s\" flags=%d: %zu ids, the scan gives %zu", (int)len, s, flags, n, m);
            free(got);
            free(want);
        }
    }
    tok_free(t);
}

static double encode_ms(const tok *t, const char *text, size_t len, int32_t **ids, size_t *n) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    *ids = encode(t, text, len, TOK_PARSE_SPECIAL, n);
    clock_gettime(CLOCK_MONOTONIC, &b);
    return (double)(b.tv_sec - a.tv_sec) * 1e3 + (double)(b.tv_nsec - a.tv_nsec) * 1e-6;
}

/* 273 added tokens all starting "<|", and 1 MiB of "<|": each position
 * once tried every token (0.28 s in a release build, 2.2 s under ASan).
 * Timed against the same text with one added token, so that the
 * sanitizer's and the machine's speed cancel out: the scan was ~100 times
 * slower, a trie about as fast. */
static void test_many_added_tokens_match_in_linear_time(void **state) {
    (void)state;
    enum { N_ADDED = 273, LEN = 1 << 20 };
    char *json = malloc(N_ADDED * 64), *text = malloc(LEN);
    assert_true(json && text);
    size_t w = 0;
    for (int i = 0; i < N_ADDED; i++)
        w +=
            (size_t)sprintf(json + w, "%s{\"id\":%d,\"content\":\"<|t%d|>\",\"special\":true}", i ? "," : "", 3 + i, i);
    tok *many = tiny_with_added(json);
    tok *one = tiny_with_added("{\"id\":45,\"content\":\"<|t42|>\",\"special\":true}");
    for (size_t i = 0; i < LEN; i++) text[i] = i % 2 ? '|' : '<';
    memcpy(text + LEN - 7, "<|t42|>", 7);
    int32_t *ids;
    size_t n;
    double base = encode_ms(one, text, LEN, &ids, &n);
    free(ids);
    double ms = encode_ms(many, text, LEN, &ids, &n);
    print_message("bytes=%d encode_ms: 1 added token %.1f, %d added tokens %.1f\n", LEN, base, N_ADDED, ms);
    assert_int_equal(n, 1); /* '<' and '|' have no token here: only the added one is left */
    assert_int_equal(ids[0], 3 + 42);
    assert_true(ms < 4 * base + 20);
    free(ids);
    tok_free(many);
    tok_free(one);
    free(json);
    free(text);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_corpus_smollm_gguf),
        cmocka_unit_test(test_corpus_smollm_json),
        cmocka_unit_test(test_corpus_gpt2_json),
        cmocka_unit_test(test_corpus_llama3_json),
        cmocka_unit_test(test_corpus_gpt2_and_llama3_from_gguf),
        cmocka_unit_test(test_gguf_errors_name_the_problem),
        cmocka_unit_test(test_bytes_missing_from_the_vocabulary_are_dropped),
        cmocka_unit_test(test_decode_inverts_encode),
        cmocka_unit_test(test_metadata_gguf),
        cmocka_unit_test(test_metadata_json),
        cmocka_unit_test(test_token_bytes_unmap_the_byte_level_text),
        cmocka_unit_test(test_specials_parsed_only_when_asked),
        cmocka_unit_test(test_add_bos_only_when_the_model_asks),
        cmocka_unit_test(test_encode_reports_small_buffers),
        cmocka_unit_test(test_nul_and_control_bytes_are_ordinary_bytes),
        cmocka_unit_test(test_invalid_utf8_encodes_and_decodes_lossily),
        cmocka_unit_test(test_decode_truncates_and_reports_full_length),
        cmocka_unit_test(test_decode_skips_specials_and_rejects_bad_ids),
        cmocka_unit_test(test_long_words_take_the_heap_path),
        cmocka_unit_test(test_one_handle_serves_many_threads),
        cmocka_unit_test(test_json_errors_name_the_problem),
        cmocka_unit_test(test_tiny_json_merges_both_forms),
        cmocka_unit_test(test_plain_added_tokens_split_even_without_specials),
        cmocka_unit_test(test_added_token_matching_equals_the_scan),
        cmocka_unit_test(test_many_added_tokens_match_in_linear_time),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
