/* The gateway's pure parts: stop strings on a stream of text pieces, the
 * OpenAI request parser and error shape, the size of a whole reply as it
 * is built, and the Prometheus exposition. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "../../gateway/metrics.h"
#include "../../gateway/oai.h"
#include "../../gateway/render.h"
#include "../../gateway/schema.h"
#include "../../gateway/toolcall.h"
#include "../../gateway/stop.h"

/* ---- stop strings ---- */

/* Pushes text in pieces of the given sizes (the last takes the rest),
 * returns everything released (NUL-terminated) and whether it matched. */
static bool run_stops(const char *const *stops, int n_stops, const char *text, const size_t *sizes, int n_sizes,
                      char *out, size_t cap) {
    size_t lens[STOP_MAX_STRINGS];
    for (int i = 0; i < n_stops; i++) lens[i] = strlen(stops[i]);
    stop_matcher *m;
    assert_int_equal(stop_init(&m, stops, lens, n_stops, 64, NULL), AE_OK);
    char buf[512];
    size_t used = 0, pos = 0, len = strlen(text);
    bool matched = false;
    for (int i = 0; pos < len; i++) {
        size_t k = i < n_sizes ? sizes[i] : len - pos;
        if (k > len - pos) k = len - pos;
        size_t got;
        matched = stop_push(m, text + pos, k, buf, sizeof buf, &got);
        assert_true(used + got < cap);
        memcpy(out + used, buf, got);
        used += got;
        pos += k;
    }
    if (!matched) {
        size_t got = stop_flush(m, buf, sizeof buf);
        memcpy(out + used, buf, got);
        used += got;
        matched = stop_matched(m); /* the end may settle a match that waited on a longer stop */
    }
    out[used] = '\0';
    stop_free(m);
    return matched;
}

static void test_stop_string_split_across_pieces_is_found_and_cut(void **state) {
    (void)state;
    const char *stops[] = {"</answer>"};
    size_t sizes[] = {3, 4, 2, 1, 5};
    char out[256];
    assert_true(run_stops(stops, 1, "The sum is 42</answer> and more", sizes, 5, out, sizeof out));
    assert_string_equal(out, "The sum is 42");
}

static void test_text_that_might_begin_a_stop_is_held_until_decided(void **state) {
    (void)state;
    const char *s[] = {"STOP"};
    size_t lens[] = {4};
    stop_matcher *m;
    assert_int_equal(stop_init(&m, s, lens, 1, 16, NULL), AE_OK);
    char out[64];
    size_t n;
    assert_false(stop_push(m, "abc ST", 6, out, sizeof out, &n));
    assert_int_equal(n, 4); /* "abc " out, "ST" held */
    assert_memory_equal(out, "abc ", 4);
    assert_false(stop_push(m, "AX", 2, out, sizeof out, &n));
    assert_int_equal(n, 4); /* "STAX" cannot begin "STOP" */
    assert_memory_equal(out, "STAX", 4);
    assert_false(stop_push(m, "S", 1, out, sizeof out, &n));
    assert_int_equal(n, 0);
    assert_int_equal(stop_flush(m, out, sizeof out), 1); /* the end releases the held "S" */
    assert_memory_equal(out, "S", 1);
    stop_free(m);
}

static void test_earliest_of_several_stops_wins(void **state) {
    (void)state;
    const char *stops[] = {"world", "lo w", "xyz"};
    size_t sizes[] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    char out[256];
    assert_true(run_stops(stops, 3, "hello world", sizes, 11, out, sizeof out));
    assert_string_equal(out, "hel");
}

static void test_no_stops_passes_text_through_unchanged(void **state) {
    (void)state;
    size_t sizes[] = {2, 5};
    char out[256];
    assert_false(run_stops(NULL, 0, "plain text, nothing held", sizes, 2, out, sizeof out));
    assert_string_equal(out, "plain text, nothing held");
}

static void test_multibyte_stop_never_releases_half_a_character(void **state) {
    (void)state;
    /* "é" is C3 A9; the stop is "éé". The first é must be held whole. */
    const char *stops[] = {"\xC3\xA9\xC3\xA9"};
    size_t lens[] = {4};
    stop_matcher *m;
    assert_int_equal(stop_init(&m, stops, lens, 1, 16, NULL), AE_OK);
    char out[64];
    size_t n;
    assert_false(stop_push(m, "caf\xC3\xA9", 5, out, sizeof out, &n));
    assert_int_equal(n, 3);
    assert_memory_equal(out, "caf", 3);
    assert_false(stop_push(m, "!", 1, out, sizeof out, &n));
    assert_int_equal(n, 3);
    assert_memory_equal(out, "\xC3\xA9!", 3);
    stop_free(m);
}

/* Every way of cutting a text releases the same text as pushing it whole. */
static void test_every_split_releases_the_same_text(void **state) {
    (void)state;
    const char *stops[] = {"ab", "bab", "cc"};
    const char *text = "xabab cbcac bacc";
    char whole[256], cut[256];
    size_t one[] = {64};
    bool wm = run_stops(stops, 3, text, one, 1, whole, sizeof whole);
    assert_true(wm);
    assert_string_equal(whole, "x");
    const char *text2 = "bcbcbxbxcbaxc"; /* no stop in it */
    char whole2[256];
    assert_false(run_stops(stops, 3, text2, one, 1, whole2, sizeof whole2));
    for (unsigned mask = 0; mask < (1u << 12); mask += 7) {
        size_t sizes[16];
        int n = 0;
        size_t run = 1;
        for (int b = 0; b < 12; b++, run++)
            if (mask >> b & 1) sizes[n++] = run, run = 0;
        assert_int_equal(run_stops(stops, 3, text2, sizes, n, cut, sizeof cut), false);
        assert_string_equal(cut, whole2);
        assert_int_equal(run_stops(stops, 3, text, sizes, n, cut, sizeof cut), true);
        assert_string_equal(cut, "x");
    }
}

/* A shorter stop inside a longer one's prefix: the longer one starts
 * earlier, so it wins once the text completes it, however it was cut. */
static void test_a_match_waits_for_an_earlier_starting_stop(void **state) {
    (void)state;
    const char *stops[] = {"abcd", "bc"};
    char out[64];
    size_t whole[] = {6}, split[] = {4, 2};
    assert_true(run_stops(stops, 2, "xabcdy", whole, 1, out, sizeof out));
    assert_string_equal(out, "x");
    assert_true(run_stops(stops, 2, "xabcdy", split, 2, out, sizeof out));
    assert_string_equal(out, "x");
    /* The longer one does not come: the shorter, later one matches. */
    assert_true(run_stops(stops, 2, "xabczy", split, 2, out, sizeof out));
    assert_string_equal(out, "xa");
    /* The stream ends while the longer one is still possible. */
    assert_true(run_stops(stops, 2, "xabc", split, 1, out, sizeof out));
    assert_string_equal(out, "xa");
}

static uint32_t xorshift(uint32_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 17;
    *s ^= *s << 5;
    return *s;
}

/* The reference: the earliest-starting occurrence of any stop in the
 * whole text decides (at one start, which stop it is does not change the
 * released text). Returns the released length, or len without a match. */
static size_t reference_release(const char *const *stops, int n, const char *text, size_t len) {
    for (size_t at = 0; at < len; at++)
        for (int i = 0; i < n; i++) {
            size_t k = strlen(stops[i]);
            if (k <= len - at && memcmp(text + at, stops[i], k) == 0) return at;
        }
    return len;
}

/* Random texts over a three-letter alphabet with random overlapping stop
 * sets, pushed under every cut: each cut releases what the reference
 * does and matches exactly when it does. */
static void test_every_cut_of_random_texts_matches_the_reference(void **state) {
    (void)state;
    uint32_t seed = 0x5eed1234u;
    int mismatches = 0;
    for (int trial = 0; trial < 300; trial++) {
        char stop_text[4][8];
        const char *stops[4];
        int n_stops = 1 + (int)(xorshift(&seed) % 4);
        for (int i = 0; i < n_stops; i++) {
            size_t k = 1 + xorshift(&seed) % 4;
            for (size_t j = 0; j < k; j++) stop_text[i][j] = (char)('a' + xorshift(&seed) % 3);
            stop_text[i][k] = '\0';
            stops[i] = stop_text[i];
        }
        char text[16];
        size_t len = 1 + xorshift(&seed) % 10;
        for (size_t j = 0; j < len; j++) text[j] = (char)('a' + xorshift(&seed) % 3);
        text[len] = '\0';
        size_t want = reference_release(stops, n_stops, text, len);
        /* Bit b of mask: a cut after byte b + 1. */
        for (unsigned mask = 0; mask < (1u << (len - 1)); mask++) {
            size_t sizes[16];
            int n = 0;
            size_t run = 0;
            for (size_t b = 0; b < len; b++) {
                run++;
                if (b + 1 < len && (mask >> b & 1)) sizes[n++] = run, run = 0;
            }
            sizes[n++] = run;
            char out[64];
            bool matched = run_stops(stops, n_stops, text, sizes, n, out, sizeof out);
            if (matched != (want < len) || strlen(out) != want || memcmp(out, text, want) != 0) {
                if (mismatches++ < 3)
                    print_message("text \"%s\" stops %d (first \"%s\") mask %#x: released \"%s\" matched %d, "
                                  "want %zu bytes matched %d\n",
                                  text, n_stops, stops[0], mask, out, matched, want, want < len);
            }
        }
    }
    assert_int_equal(mismatches, 0);
}

static void test_bad_stop_strings_are_refused(void **state) {
    (void)state;
    const char *s[] = {""};
    size_t lens[] = {0};
    stop_matcher *m;
    ae_error err = {{0}};
    assert_int_equal(stop_init(&m, s, lens, 1, 16, &err), AE_ERR);
    assert_string_equal(err.msg, "stop string 0 has 0 bytes (1 to 256)");
    assert_null(m);
}

/* ---- the request parser ---- */

static int parse(oai_request *r, oai_kind k, const char *body, oai_error *e) {
    return oai_parse(r, k, body, strlen(body), e);
}

static void expect_bad(oai_kind k, const char *body, int status, const char *param, const char *code,
                       const char *message) {
    oai_request r;
    oai_error e;
    assert_int_equal(parse(&r, k, body, &e), AE_ERR);
    assert_int_equal(e.status, status);
    assert_string_equal(e.param, param);
    if (code) assert_string_equal(e.code, code);
    if (message) assert_string_equal(e.message, message);
    oai_request_free(&r);
}

static void test_chat_request_with_defaults(void **state) {
    (void)state;
    oai_request r;
    oai_error e;
    assert_int_equal(
        parse(&r, OAI_CHAT, "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}", &e),
        AE_OK);
    assert_string_equal(r.model, "m");
    assert_int_equal(r.n_msgs, 1);
    assert_string_equal(r.msgs[0].role, "user");
    assert_string_equal(r.msgs[0].content, "hi");
    assert_int_equal(r.max_tokens, -1);
    assert_true(r.temperature == 1.0 && r.top_p == 1.0 && r.min_p == 0.0);
    assert_int_equal(r.top_k, 0);
    assert_false(r.has_seed || r.stream || r.include_usage || r.ignore_eos);
    assert_int_equal(r.n_stops, 0);
    oai_request_free(&r);
}

static void test_chat_request_with_every_field(void **state) {
    (void)state;
    oai_request r;
    oai_error e;
    const char *body =
        "{\"model\": \"m\", \"messages\": [{\"role\": \"developer\", \"content\": \"be brief\"},"
        " {\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"a\"}, {\"type\": \"text\", \"text\": \"b\"}]}],"
        " \"max_completion_tokens\": 7, \"temperature\": 0.5, \"top_p\": 0.9, \"seed\": -3, \"stop\": [\"x\", \"yy\"],"
        " \"stream\": true, \"stream_options\": {\"include_usage\": true}, \"n\": 1, \"top_k\": 40, \"min_p\": 0.1,"
        " \"ignore_eos\": true, \"user\": \"u1\", \"frequency_penalty\": 0, \"logprobs\": false, \"tools\": null}";
    assert_int_equal(parse(&r, OAI_CHAT, body, &e), AE_OK);
    assert_string_equal(r.msgs[0].role, "system");
    assert_string_equal(r.msgs[1].content, "ab");
    assert_int_equal(r.max_tokens, 7);
    assert_true(r.temperature == 0.5 && r.top_p == 0.9 && r.min_p == 0.1);
    assert_int_equal(r.top_k, 40);
    assert_true(r.has_seed);
    assert_true(r.seed == (uint64_t)-3);
    assert_int_equal(r.n_stops, 2);
    assert_memory_equal(r.stops[1], "yy", 2);
    assert_int_equal(r.stop_lens[1], 2);
    assert_true(r.stream && r.include_usage && r.ignore_eos);
    oai_request_free(&r);
}

static void test_penalties_biases_and_logprobs_are_parsed(void **state) {
    (void)state;
    oai_request r;
    oai_error e;
    const char *body = "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}],"
                       " \"presence_penalty\": -0.5, \"frequency_penalty\": 1.25, \"repetition_penalty\": 1.1,"
                       " \"min_tokens\": 3, \"logit_bias\": {\"17\": -100, \"0\": 2.5}, \"stop_token_ids\": [4, 9],"
                       " \"logprobs\": true, \"top_logprobs\": 20}";
    assert_int_equal(parse(&r, OAI_CHAT, body, &e), AE_OK);
    assert_true(r.presence_penalty == -0.5 && r.frequency_penalty == 1.25 && r.repetition_penalty == 1.1);
    assert_int_equal(r.min_tokens, 3);
    assert_int_equal(r.n_bias, 2);
    assert_true(r.bias_id[0] == 17 && r.bias[0] == -100.0f && r.bias_id[1] == 0 && r.bias[1] == 2.5f);
    assert_int_equal(r.n_stop_ids, 2);
    assert_true(r.stop_ids[0] == 4 && r.stop_ids[1] == 9);
    assert_true(r.logprobs);
    assert_int_equal(r.top_logprobs, 20);
    assert_int_equal(oai_check_vocab(&r, 18, &e), AE_OK);
    assert_int_equal(oai_check_vocab(&r, 17, &e), AE_ERR);
    assert_string_equal(e.param, "logit_bias");
    assert_string_equal(e.message, "'logit_bias' names token 17; the vocabulary has 17");
    oai_request_free(&r);
    /* Defaults: every rule off. */
    assert_int_equal(parse(&r, OAI_COMPLETION, "{\"model\": \"m\", \"prompt\": \"x\"}", &e), AE_OK);
    assert_true(r.presence_penalty == 0 && r.frequency_penalty == 0 && r.repetition_penalty == 1);
    assert_true(r.min_tokens == 0 && r.n_bias == 0 && r.n_stop_ids == 0 && !r.logprobs);
    oai_request_free(&r);
    /* Completions: logprobs is the number of top tokens. */
    assert_int_equal(parse(&r, OAI_COMPLETION,
                           "{\"model\": \"m\", \"prompt\": \"x\", \"logprobs\": 0, \"stop_token_ids\": [30]}", &e),
                     AE_OK);
    assert_true(r.logprobs);
    assert_int_equal(r.top_logprobs, 0);
    assert_int_equal(oai_check_vocab(&r, 30, &e), AE_ERR);
    assert_string_equal(e.message, "stop_token_ids[0] is 30; the vocabulary has 30");
    oai_request_free(&r);
}

static void test_response_format_and_the_schema_subset(void **state) {
    (void)state;
    oai_request r;
    oai_error e;
#define RF(x) "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"response_format\": " x "}"
#define JS(s) RF("{\"type\": \"json_schema\", \"json_schema\": {\"name\": \"t\", \"strict\": true, \"schema\": " s "}}")
    assert_int_equal(parse(&r, OAI_CHAT, RF("{\"type\": \"text\"}"), &e), AE_OK);
    assert_int_equal(r.format, OAI_TEXT);
    oai_request_free(&r);
    assert_int_equal(parse(&r, OAI_CHAT, RF("{\"type\": \"json_object\"}"), &e), AE_OK);
    assert_int_equal(r.format, OAI_JSON_OBJECT);
    assert_null(r.schema);
    oai_request_free(&r);
    /* Every keyword of the subset; the schema goes on as compact JSON. */
    assert_int_equal(parse(&r, OAI_CHAT,
                           JS("{\"$defs\": {\"p\": {\"type\": \"integer\", \"minimum\": 0, \"maximum\": 9, "
                              "\"exclusiveMinimum\": -1, \"exclusiveMaximum\": 10}}, \"title\": \"t\", "
                              "\"type\": \"object\", \"properties\": {\"a\": {\"$ref\": \"#/$defs/p\"}, "
                              "\"b\": {\"type\": [\"string\", \"null\"], \"minLength\": 1, \"maxLength\": 3}, "
                              "\"c\": {\"type\": \"array\", \"items\": {\"enum\": [1, \"x\"]}, \"minItems\": 0, "
                              "\"maxItems\": 2}, \"d\": {\"anyOf\": [{\"const\": 1}, {\"type\": \"boolean\"}]}}, "
                              "\"required\": [\"a\"], \"additionalProperties\": false}"),
                           &e),
                     AE_OK);
    assert_int_equal(r.format, OAI_JSON_SCHEMA);
    assert_int_equal(r.schema_len, strlen(r.schema));
    assert_string_equal(r.schema,
                        "{\"$defs\":{\"p\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":9,"
                        "\"exclusiveMinimum\":-1,\"exclusiveMaximum\":10}},\"title\":\"t\",\"type\":\"object\","
                        "\"properties\":{\"a\":{\"$ref\":\"#/$defs/p\"},\"b\":{\"type\":[\"string\",\"null\"],"
                        "\"minLength\":1,\"maxLength\":3},\"c\":{\"type\":\"array\",\"items\":{\"enum\":[1,"
                        "\"x\"]},\"minItems\":0,\"maxItems\":2},\"d\":{\"anyOf\":[{\"const\":1},{\"type\":"
                        "\"boolean\"}]}},\"required\":[\"a\"],\"additionalProperties\":false}");
    oai_request_free(&r);
    struct {
        const char *body, *msg;
    } bad[] = {
        {JS("{\"type\": \"string\", \"pattern\": \"a\"}"), "'pattern' at # is not supported"},
        {JS("{\"properties\": {\"a\": {\"items\": {\"format\": \"date\"}}}}"),
         "'format' at #/properties/a/items is not supported"},
        {JS("{\"anyOf\": [{}, {\"not\": {}}]}"), "'not' at #/anyOf/1 is not supported"},
        {JS("{\"$ref\": \"#/$defs/missing\"}"), "'$ref' at # must point into this document (\"#/$defs/name\")"},
        {JS("{\"additionalProperties\": {}}"),
         "'additionalProperties' at # is supported only as false (no properties besides the listed ones)"},
        {JS("{\"maxLength\": -1}"), "'maxLength' at # must be an integer >= 0"},
        {JS("{\"type\": \"date\"}"), "'type' at # must be a JSON type or a list of them"},
        {JS("[]"), "'response_format.json_schema.schema' must be an object"},
        {RF("{\"type\": \"xml\"}"), "'response_format.type' is 'xml'; it must be text, json_object or json_schema"},
        {RF("{\"type\": \"json_schema\"}"), "'response_format.json_schema' must be an object"},
        {RF("{\"type\": \"json_object\", \"extra\": 1}"), "'response_format.extra' is not supported"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(parse(&r, OAI_CHAT, bad[i].body, &e), AE_ERR);
        assert_string_equal(e.param, "response_format");
        assert_string_equal(e.message, bad[i].msg);
    }
    /* Nesting past the limit. */
    char deep[4096] = "", *w = deep;
    for (int i = 0; i < 40; i++) w += sprintf(w, "{\"items\": ");
    w += sprintf(w, "{}");
    for (int i = 0; i < 40; i++) *w++ = '}';
    *w = '\0';
    char body[8192];
    snprintf(body, sizeof body, JS("%s"), deep);
    assert_int_equal(parse(&r, OAI_CHAT, body, &e), AE_ERR);
    assert_string_equal(e.message,
                        "schemas nest deeper than 32 levels at #/items/items/items/items/items/items/items/"
                        "items/items/items/items/items/items/items/items/items/items/items/items/items/items/"
                        "items/items/items/items/items/items/items/items/items/items/items/items");
#undef JS
#undef RF
}

/* A growing text buffer for the schemas below. */
typedef struct sbuf {
    char *p;
    size_t n, cap;
} sbuf;

static void sb_add(sbuf *b, const char *fmt, ...) {
    va_list ap;
    for (;;) {
        va_start(ap, fmt);
        int k = vsnprintf(b->p ? b->p + b->n : NULL, b->p ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (b->p && (size_t)k < b->cap - b->n) {
            b->n += (size_t)k;
            return;
        }
        b->cap = b->cap * 2 + (size_t)k + 4096;
        b->p = realloc(b->p, b->cap);
    }
}

/* schema_check's words for text, "" when it passes. */
static char *check_text(const char *text) {
    static char why[512];
    ae_error err = {{0}};
    cJSON *j = cJSON_Parse(text);
    assert_non_null(j);
    why[0] = '\0';
    if (schema_check(j, why, sizeof why) != AE_OK) assert_true(why[0] != '\0');
    cJSON_Delete(j);
    (void)err;
    return why;
}

/* An enum of n strings of len characters ("v" and digits, padded), at
 * #/properties/NAME. */
static void sb_enum(sbuf *b, const char *name, int n, int len) {
    sb_add(b, "\"%s\":{\"enum\":[", name);
    for (int i = 0; i < n; i++) sb_add(b, "%s\"v%0*d\"", i ? "," : "", len - 1, i);
    sb_add(b, "]}");
}

/* The limits that bound a schema's compile and masks (schema.h): each is
 * refused with the limit and the value found; schemas at the limits
 * pass. */
static void test_schema_limits_name_the_limit_and_value(void **state) {
    (void)state;
    /* Lengths, counts and numbers. */
    struct {
        const char *schema, *why;
    } cases[] = {
        {"{\"type\":\"string\",\"maxLength\":10000}", ""},
        {"{\"type\":\"string\",\"maxLength\":10001}", "'maxLength' at # is 10001; at most 10000"},
        {"{\"type\":\"string\",\"minLength\":20000}", "'minLength' at # is 20000; at most 10000"},
        {"{\"type\":\"array\",\"maxItems\":1000000}", "'maxItems' at # is 1000000; at most 10000"},
        {"{\"type\":\"array\",\"minItems\":10001}", "'minItems' at # is 10001; at most 10000"},
        {"{\"type\":\"integer\",\"minimum\":-9007199254740992,\"maximum\":9007199254740992}", ""},
        {"{\"type\":\"integer\",\"minimum\":1e16}",
         "'minimum' at # is 10000000000000000; it must be between -2^53 and 2^53"},
        {"{\"type\":\"number\",\"minimum\":1,\"maximum\":1e309}",
         "'maximum' at # is inf; it must be between -2^53 and 2^53"},
        {"{\"type\":\"integer\",\"exclusiveMaximum\":-1e20}",
         "'exclusiveMaximum' at # is -1e+20; it must be between -2^53 and 2^53"},
        /* Small ones: bounds that leave nothing, a pointer to "". */
        {"{\"type\":\"number\",\"exclusiveMinimum\":5,\"exclusiveMaximum\":2}",
         "'exclusiveMinimum' 5 at # leaves no number below 'exclusiveMaximum' 2"},
        {"{\"type\":\"number\",\"exclusiveMinimum\":2,\"exclusiveMaximum\":2}",
         "'exclusiveMinimum' 2 at # leaves no number below 'exclusiveMaximum' 2"},
        {"{\"type\":\"number\",\"minimum\":3,\"exclusiveMaximum\":3}",
         "'minimum' 3 at # leaves no number below 'exclusiveMaximum' 3"},
        {"{\"type\":\"number\",\"exclusiveMinimum\":4,\"maximum\":1.5}",
         "'exclusiveMinimum' 4 at # leaves no number below 'maximum' 1.5"},
        {"{\"type\":\"number\",\"minimum\":2,\"maximum\":2}", ""},
        {"{\"type\":\"integer\",\"exclusiveMinimum\":1,\"exclusiveMaximum\":2}",
         "the bounds at # leave no integer between them"},
        {"{\"type\":\"integer\",\"minimum\":1.2,\"maximum\":1.8}", "the bounds at # leave no integer between them"},
        {"{\"type\":\"integer\",\"exclusiveMinimum\":1,\"exclusiveMaximum\":3}", ""},
        {"{\"type\":[\"integer\",\"null\"],\"exclusiveMinimum\":1,\"exclusiveMaximum\":2}", ""},
        {"{\"$ref\":\"#/\"}", "'$ref' at # must point into this document (\"#/$defs/name\")"},
        /* A pattern's counted repetitions are bounded before the keyword
         * itself is refused (patterns are not in the subset yet). */
        {"{\"type\":\"string\",\"pattern\":\"^a{2,1000}b{3}c{4,}$\"}", "'pattern' at # is not supported"},
        {"{\"type\":\"string\",\"pattern\":\"a{1001}\"}",
         "'pattern' at # repeats up to 1001 times in one {m,n}; at most 1000"},
        {"{\"type\":\"string\",\"pattern\":\"x{2,5000}\"}",
         "'pattern' at # repeats up to 5000 times in one {m,n}; at most 1000"},
        {"{\"type\":\"string\",\"pattern\":\"x{99999999999999999999,}\"}",
         "'pattern' at # repeats up to 9223372036854775807 times in one {m,n}; at most 1000"},
        {"{\"type\":\"string\",\"pattern\":\"[{]{2000}\"}",
         "'pattern' at # repeats up to 2000 times in one {m,n}; at most 1000"},
        {"{\"type\":\"string\",\"pattern\":\"\\\\{5000}[x{5000}]{1e5}\"}", "'pattern' at # is not supported"},
        {"{\"type\":\"string\",\"pattern\":\"a{1}a{1}a{1}a{1}a{1}a{1}a{1}a{1}a{1}a{1}a{1}a{1}a{1}a{1}a{1}a{1}a{1}\"}",
         "'pattern' at # has more than 16 counted repetitions ({m,n})"},
        /* Optional properties: the required ones do not count. */
        {"{\"type\":\"object\",\"properties\":{\"a\":{},\"b\":{}},\"required\":[\"a\"]}", ""},
        {"{\"type\":[\"string\",\"string\",\"string\",\"string\",\"string\",\"string\",\"string\",\"null\"]}",
         "'type' at # must be a JSON type or a list of them"},
    };
    int wrong = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *got = check_text(cases[i].schema);
        if (strcmp(got, cases[i].why) != 0) {
            printf("%s: got \"%s\", want \"%s\"\n", cases[i].schema, got, cases[i].why);
            wrong++;
        }
    }
    assert_int_equal(wrong, 0);
    sbuf b = {0};
    /* Values in one enum: 1,024 pass, 1,025 do not; the 12,000-entry enum
     * that compiled for 10-16 s. */
    int sizes[3] = {1024, 1025, 12000};
    const char *want[3] = {"", "'enum' at #/properties/v has 1025 values; at most 1024",
                           "'enum' at #/properties/v has 12000 values; at most 1024"};
    for (int k = 0; k < 3; k++) {
        b.n = 0;
        sb_add(&b, "{\"type\":\"object\",\"properties\":{");
        sb_enum(&b, "v", sizes[k], 14);
        sb_add(&b, "}}");
        assert_string_equal(check_text(b.p), want[k]);
    }
    /* Enum values in the document, and their bytes. */
    b.n = 0;
    sb_add(&b, "{\"type\":\"object\",\"properties\":{");
    for (int i = 0; i < 5; i++) {
        char name[8];
        snprintf(name, sizeof name, "e%d", i);
        if (i) sb_add(&b, ",");
        sb_enum(&b, name, 1000, 4);
    }
    sb_add(&b, "}}");
    assert_string_equal(check_text(b.p),
                        "the document has more than 4096 enum values and consts (limit reached at #/properties/e4)");
    b.n = 0;
    sb_add(&b, "{\"type\":\"object\",\"properties\":{");
    sb_enum(&b, "long", 1000, 70);
    sb_add(&b, "}}");
    assert_string_equal(check_text(b.p),
                        "the document's enum values and consts take more than 65536 bytes of JSON (limit "
                        "reached at #/properties/long)");
    /* Alternatives: in one anyOf, and in the document. The issue's
     * schema: 1,500 strings of different length ranges (30-64 ms a mask). */
    int alts[3] = {64, 65, 1500};
    const char *want_alt[3] = {"", "'anyOf' at #/items has 65 alternatives; at most 64",
                               "'anyOf' at #/items has 1500 alternatives; at most 64"};
    for (int k = 0; k < 3; k++) {
        b.n = 0;
        sb_add(&b, "{\"type\":\"array\",\"items\":{\"anyOf\":[");
        for (int i = 0; i < alts[k]; i++)
            sb_add(&b, "%s{\"type\":\"string\",\"minLength\":%d,\"maxLength\":%d}", i ? "," : "", i, i + 3 + i % 5);
        sb_add(&b, "]}}");
        assert_string_equal(check_text(b.p), want_alt[k]);
    }
    b.n = 0;
    sb_add(&b, "{\"type\":\"object\",\"properties\":{");
    for (int p = 0; p < 5; p++) {
        sb_add(&b, "%s\"a%d\":{\"anyOf\":[", p ? "," : "", p);
        for (int i = 0; i < 60; i++) sb_add(&b, "%s{\"const\":%d}", i ? "," : "", i);
        sb_add(&b, "]}");
    }
    sb_add(&b, "}}");
    assert_string_equal(check_text(b.p), "the document has more than 256 anyOf alternatives (limit reached at "
                                         "#/properties/a4)");
    /* An object's optional properties: 256 pass, 257 do not, required
     * ones do not count. */
    int optional[3] = {256, 257, 1500};
    const char *want_opt[3] = {"", "'properties' at # has 257 properties that are not required; at most 256",
                               "'properties' at # has 1500 properties that are not required; at most 256"};
    for (int k = 0; k < 3; k++) {
        for (int req = 0; req < 2; req++) {
            b.n = 0;
            sb_add(&b, "{\"type\":\"object\",\"properties\":{");
            for (int i = 0; i < optional[k]; i++) sb_add(&b, "%s\"p%d\":{\"type\":\"string\"}", i ? "," : "", i);
            sb_add(&b, "}");
            if (req) {
                sb_add(&b, ",\"required\":[");
                for (int i = 0; i < optional[k]; i++) sb_add(&b, "%s\"p%d\"", i ? "," : "", i);
                sb_add(&b, "]");
            }
            sb_add(&b, "}");
            assert_string_equal(check_text(b.p), req ? "" : want_opt[k]);
        }
    }
    /* The document's text. */
    b.n = 0;
    sb_add(&b, "{\"type\":\"object\",\"properties\":{");
    for (int i = 0; i < 1500; i++) sb_add(&b, "%s\"p%099d\":{\"type\":\"string\"}", i ? "," : "", i);
    sb_add(&b, "},\"required\":[");
    for (int i = 0; i < 1500; i++) sb_add(&b, "%s\"p%099d\"", i ? "," : "", i);
    sb_add(&b, "]}");
    assert_string_equal(check_text(b.p), "the schema is 336045 bytes of compact JSON; at most 131072");
    free(b.p);
}

/* The schema of a tool call is all the tools' parameters at once: each
 * passes alone, the whole is checked too. */
static void test_the_combined_tool_schema_is_checked(void **state) {
    (void)state;
    sbuf b = {0};
    sb_add(&b, "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tool_choice\": "
               "\"required\", \"tools\": [");
    for (int t = 0; t < 64; t++) {
        sb_add(&b,
               "%s{\"type\": \"function\", \"function\": {\"name\": \"f%d\", \"parameters\": {\"type\": \"object\", "
               "\"properties\": {",
               t ? "," : "", t);
        for (int p = 0; p < 40; p++) sb_add(&b, "%s\"p%d\": {\"type\": \"integer\"}", p ? "," : "", p);
        sb_add(&b, "}}}}");
    }
    sb_add(&b, "]}");
    oai_request r;
    oai_error e;
    assert_int_equal(parse(&r, OAI_CHAT, b.p, &e), AE_ERR);
    assert_string_equal(e.param, "tools");
    assert_string_equal(e.message, "the schema of a call to any of the tools, all together: the document has more than "
                                   "2048 schemas (at #/anyOf/47/properties/arguments/properties/p23)");
    /* The same tools with tool_choice auto: no schema is compiled. */
    char *autoc = strstr(b.p, "\"required\"");
    memcpy(autoc, "\"auto\"    ", 10);
    assert_int_equal(parse(&r, OAI_CHAT, b.p, &e), AE_OK);
    oai_request_free(&r);
    free(b.p);
}

static void test_tool_calls_are_found_in_replies(void **state) {
    (void)state;
    const char *names[2] = {"get_weather", "add"};
    char *rest;
    /* A constrained reply is one call. */
    const char *one = "{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}";
    char *c = toolcall_find(one, strlen(one), true, names, 2, "xyz", false, &rest);
    assert_string_equal(c, "[{\"id\":\"call_xyz_0\",\"type\":\"function\",\"function\":{\"name\":\"add\","
                           "\"arguments\":\"{\\\"a\\\":1,\\\"b\\\":2}\"}}]");
    assert_null(rest);
    free(c);
    /* auto: blocks in tags, text around them kept, a cut closing tag. */
    const char *text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
                       "</tool_call>\n<tool_call>{\"name\": \"add\", \"arguments\": {}}";
    c = toolcall_find(text, strlen(text), false, names, 2, "q", true, &rest);
    assert_string_equal(c, "[{\"index\":0,\"id\":\"call_q_0\",\"type\":\"function\",\"function\":{\"name\":"
                           "\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Paris\\\"}\"}},{\"index\":1,\"id\":"
                           "\"call_q_1\",\"type\":\"function\",\"function\":{\"name\":\"add\",\"arguments\":\"{}\"}}]");
    assert_string_equal(rest, "Let me check.");
    free(c), free(rest);
    /* Not calls: an unknown name, arguments that are not an object, no
     * tags, or bad JSON. */
    const char *nots[] = {"<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>",
                          "<tool_call>{\"name\": \"add\", \"arguments\": \"1, 2\"}</tool_call>",
                          "{\"name\": \"add\", \"arguments\": {}}", "<tool_call>{\"name\": \"add\", </tool_call>"};
    for (size_t i = 0; i < sizeof nots / sizeof nots[0]; i++) {
        assert_null(toolcall_find(nots[i], strlen(nots[i]), false, names, 2, "q", false, &rest));
        assert_null(rest);
    }
}

static void test_tools_and_tool_messages_are_parsed(void **state) {
    (void)state;
    oai_request r;
    oai_error e;
#define TOOLS \
    "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"description\": \"d\", " \
    "\"parameters\": {\"type\": \"object\", \"properties\": {\"x\": {\"type\": \"integer\"}}}}}, " \
    "{\"type\": \"function\", \"function\": {\"name\": \"g\"}}]"
#define MSGS \
    "\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}, {\"role\": \"assistant\", " \
    "\"content\": null, \"tool_calls\": [{\"id\": \"c1\", \"type\": \"function\", \"function\": {\"name\": " \
    "\"f\", \"arguments\": \"{\\\"x\\\": 1}\"}}]}, {\"role\": \"tool\", \"tool_call_id\": \"c1\", " \
    "\"content\": \"2\"}]"
    assert_int_equal(parse(&r, OAI_CHAT, "{" MSGS ", " TOOLS "}", &e), AE_OK);
    assert_int_equal(r.n_tools, 2);
    assert_int_equal(r.tool_choice, OAI_TOOLS_AUTO);
    assert_int_equal(r.format, OAI_TEXT);
    assert_string_equal(r.msgs[1].role, "assistant");
    assert_string_equal(r.msgs[1].content, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>");
    assert_string_equal(r.msgs[2].role, "user");
    assert_string_equal(r.msgs[2].content, "<tool_response>\n2\n</tool_response>");
    oai_request_free(&r);
    /* A named function: the output is its call, by a schema. */
    assert_int_equal(parse(&r, OAI_CHAT,
                           "{" MSGS ", " TOOLS ", \"tool_choice\": {\"type\": \"function\", "
                           "\"function\": {\"name\": \"g\"}}}",
                           &e),
                     AE_OK);
    assert_int_equal(r.tool_choice, OAI_TOOLS_NAMED);
    assert_int_equal(r.tool_named, 1);
    assert_int_equal(r.format, OAI_JSON_SCHEMA);
    assert_string_equal(r.schema, "{\"properties\":{\"name\":{\"const\":\"g\"},\"arguments\":{}},\"required\":"
                                  "[\"name\",\"arguments\"],\"type\":\"object\",\"additionalProperties\":false}");
    oai_request_free(&r);
    assert_int_equal(parse(&r, OAI_CHAT, "{" MSGS ", " TOOLS ", \"tool_choice\": \"required\"}", &e), AE_OK);
    assert_int_equal(r.tool_choice, OAI_TOOLS_REQUIRED);
    assert_non_null(strstr(r.schema, "{\"anyOf\":[{\"properties\":{\"name\":{\"const\":\"f\"}"));
    oai_request_free(&r);
    assert_int_equal(parse(&r, OAI_CHAT, "{" MSGS ", " TOOLS ", \"tool_choice\": \"none\"}", &e), AE_OK);
    assert_int_equal(r.n_tools, 0); /* not told to the model */
    oai_request_free(&r);
    struct {
        const char *body, *param, *msg;
    } bad[] = {
        {"{" MSGS ", \"tool_choice\": \"required\"}", "tool_choice", "'tool_choice' other than none needs 'tools'"},
        {"{" MSGS ", " TOOLS ", \"tool_choice\": \"always\"}", "tool_choice",
         "'tool_choice' is 'always'; it must be none, auto, required or a function"},
        {"{" MSGS ", " TOOLS ", \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"h\"}}}",
         "tool_choice", "'tool_choice' names 'h', which is not in tools"},
        {"{" MSGS ", \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"a b\"}}]}", "tools",
         "tools[0].function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -"},
        {"{" MSGS ", \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"a\", \"parameters\": "
         "{\"type\": \"string\", \"pattern\": \"x\"}}}]}",
         "tools", "tools[0].function.parameters: 'pattern' at # is not supported"},
        {"{" MSGS ", \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"a\"}}, {\"type\": "
         "\"function\", \"function\": {\"name\": \"a\"}}]}",
         "tools", "two tools are named 'a'"},
        {"{" MSGS ", \"tools\": [{\"type\": \"retrieval\"}]}", "tools",
         "tools[0] must be {\"type\": \"function\", \"function\": {...}}"},
        {"{" MSGS ", " TOOLS ", \"tool_choice\": \"required\", \"response_format\": {\"type\": \"json_object\"}}",
         "response_format", "'response_format' cannot go with tool_choice required or a named function"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(parse(&r, OAI_CHAT, bad[i].body, &e), AE_ERR);
        assert_string_equal(e.param, bad[i].param);
        assert_string_equal(e.message, bad[i].msg);
    }
#undef MSGS
#undef TOOLS
}

static void test_completion_prompts_text_ids_and_batches_of_one(void **state) {
    (void)state;
    oai_request r;
    oai_error e;
    assert_int_equal(parse(&r, OAI_COMPLETION, "{\"model\": \"m\", \"prompt\": [\"once\"], \"max_tokens\": 3}", &e),
                     AE_OK);
    assert_string_equal(r.prompt, "once");
    assert_int_equal(r.prompt_len, 4);
    oai_request_free(&r);
    assert_int_equal(parse(&r, OAI_COMPLETION, "{\"model\": \"m\", \"prompt\": [[5, 6, 7]]}", &e), AE_OK);
    assert_int_equal(r.n_prompt_ids, 3);
    assert_int_equal(r.prompt_ids[2], 7);
    oai_request_free(&r);
    expect_bad(OAI_COMPLETION, "{\"model\": \"m\", \"prompt\": [\"a\", \"b\"]}", 400, "prompt", "invalid_value",
               "one prompt per request (a batch of 2 was sent)");
}

static void test_bad_requests_name_their_field(void **state) {
    (void)state;
    expect_bad(OAI_CHAT, "{\"model\": \"m\", \"messages\": [", 400, "", "invalid_json", NULL);
    expect_bad(OAI_CHAT, "[1, 2]", 400, "", "invalid_type", "the body must be a JSON object");
    expect_bad(OAI_CHAT,
               "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"max_tokens\": \"9\"}",
               400, "max_tokens", "invalid_type", "'max_tokens' must be an integer");
    expect_bad(OAI_CHAT,
               "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"max_tokens\": -5}", 400,
               "max_tokens", "invalid_value", "'max_tokens' is -5; it must be between 1 and 2147483647");
    expect_bad(OAI_CHAT,
               "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"max_tokens\": 1e12}",
               400, "max_tokens", "invalid_value", NULL);
    expect_bad(OAI_CHAT,
               "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"temperature\": 3}", 400,
               "temperature", "invalid_value", "'temperature' is 3; it must be >= 0 and <= 2");
    expect_bad(OAI_CHAT, "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": []}",
               400, "tools", "invalid_type", "'tools' must be a non-empty list of functions");
    expect_bad(OAI_COMPLETION, "{\"model\": \"m\", \"prompt\": \"x\", \"tools\": []}", 400, "tools",
               "unsupported_parameter", "'tools' is not supported");
    expect_bad(OAI_CHAT, "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"n\": 17}", 400,
               "n", "invalid_value", "'n' is 17; it must be between 1 and 16");
    expect_bad(OAI_COMPLETION, "{\"model\": \"m\", \"prompt\": \"x\", \"best_of\": 2}", 400, "best_of",
               "unsupported_value", "'best_of' is supported only at its default (off)");
#define MSG "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
    expect_bad(OAI_CHAT, MSG "\"presence_penalty\": 2.5}", 400, "presence_penalty", "invalid_value",
               "'presence_penalty' is 2.5; it must be >= -2 and <= 2");
    expect_bad(OAI_CHAT, MSG "\"frequency_penalty\": \"1\"}", 400, "frequency_penalty", "invalid_type",
               "'frequency_penalty' must be a number");
    expect_bad(OAI_CHAT, MSG "\"repetition_penalty\": 0}", 400, "repetition_penalty", "invalid_value",
               "'repetition_penalty' is 0; it must be > 0 and <= 100");
    expect_bad(OAI_CHAT, MSG "\"logit_bias\": {\"abc\": 1}}", 400, "logit_bias", "invalid_value",
               "'logit_bias' key 'abc' is not a token id");
    expect_bad(OAI_CHAT, MSG "\"logit_bias\": {\"007\": 1}}", 400, "logit_bias", "invalid_value",
               "'logit_bias' key '007' is not a token id");
    expect_bad(OAI_CHAT, MSG "\"logit_bias\": {\"5\": 101}}", 400, "logit_bias", "invalid_value",
               "'logit_bias' is 101; it must be >= -100 and <= 100");
    expect_bad(OAI_CHAT, MSG "\"logit_bias\": [1]}", 400, "logit_bias", "invalid_type",
               "'logit_bias' must be an object of token ids to numbers");
    expect_bad(OAI_CHAT, MSG "\"min_tokens\": 5, \"max_tokens\": 4}", 400, "min_tokens", "invalid_value",
               "min_tokens (5) is more than max_tokens (4)");
    expect_bad(OAI_CHAT, MSG "\"stop_token_ids\": [1, -2]}", 400, "stop_token_ids", "invalid_value",
               "'stop_token_ids' is -2; it must be between 0 and 2147483647");
    expect_bad(OAI_CHAT, MSG "\"top_logprobs\": 3}", 400, "top_logprobs", "invalid_value",
               "'top_logprobs' needs 'logprobs': true");
    expect_bad(OAI_CHAT, MSG "\"logprobs\": true, \"top_logprobs\": 21}", 400, "top_logprobs", "invalid_value",
               "'top_logprobs' is 21; it must be between 0 and 20");
    expect_bad(OAI_CHAT, MSG "\"logprobs\": 2}", 400, "logprobs", "invalid_type", "'logprobs' must be true or false");
    expect_bad(OAI_COMPLETION, "{\"model\": \"m\", \"prompt\": \"x\", \"logprobs\": true}", 400, "logprobs",
               "invalid_type", "'logprobs' must be an integer");
    expect_bad(OAI_COMPLETION, "{\"model\": \"m\", \"prompt\": \"x\", \"top_logprobs\": 2}", 400, "top_logprobs",
               "unsupported_parameter", "'top_logprobs' is not supported");
#undef MSG
    expect_bad(OAI_CHAT, "{\"model\": \"m\", \"messages\": [{\"role\": \"function\", \"content\": \"x\"}]}", 400,
               "messages[0]", "invalid_value",
               "'messages[0].role' is 'function'; it must be system, developer, user, assistant or tool");
    expect_bad(OAI_CHAT, "{\"model\": \"m\", \"messages\": []}", 400, "messages", "invalid_type", NULL);
    expect_bad(OAI_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}", 400, "model",
               "missing_required_parameter", "'model' is required");
    expect_bad(
        OAI_CHAT,
        "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"stream_options\": {\"include_usage\": true}}",
        400, "stream_options", "invalid_value", "'stream_options' is allowed only with stream: true");
    expect_bad(OAI_CHAT,
               "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"stop\": [\"\"]}", 400,
               "stop", "invalid_value", "a stop string has 0 bytes; it must have 1 to 256");
    expect_bad(OAI_CHAT,
               "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}",
               400, "messages[0].content", "unsupported_content", NULL);
    expect_bad(OAI_COMPLETION, "{\"model\": \"m\", \"prompt\": \"x\", \"max_tokens\": 3, \"max_completion_tokens\": 4}",
               400, "max_completion_tokens", "unsupported_parameter", NULL);
    /* A repeated key is refused: which one counts would be a guess (and
     * two "stop" lists once overflowed the stop table). */
    expect_bad(OAI_COMPLETION, "{\"model\": \"m\", \"prompt\": \"x\", \"stop\": \"a\", \"stop\": \"b\"}", 400, "stop",
               "duplicate_field", "'stop' appears more than once");
    expect_bad(OAI_CHAT,
               "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"role\": \"system\", \"content\": \"x\"}]}",
               400, "role", "duplicate_field", "'role' appears more than once in a message");
    /* NUL cannot hide in a string and cut it short. */
    expect_bad(OAI_COMPLETION, "{\"model\": \"m\", \"prompt\": \"ab\\u0000cd\"}", 400, "", "invalid_json", NULL);
}

static void test_invalid_utf8_and_lone_surrogates_are_refused(void **state) {
    (void)state;
    expect_bad(OAI_COMPLETION, "{\"model\": \"m\", \"prompt\": \"\xC3\x28\"}", 400, "", "invalid_encoding",
               "the body is not valid UTF-8");
    /* cJSON refuses a lone surrogate escape as invalid JSON. */
    expect_bad(OAI_COMPLETION, "{\"model\": \"m\", \"prompt\": \"\\ud800\"}", 400, "", "invalid_json", NULL);
}

static void test_error_json_has_openai_shape(void **state) {
    (void)state;
    oai_error e;
    oai_bad(&e, "max_tokens", "invalid_value", "too big: %d", 9);
    char *s = oai_error_json(&e);
    assert_string_equal(s, "{\"error\":{\"message\":\"too big: 9\",\"type\":\"invalid_request_error\","
                           "\"param\":\"max_tokens\",\"code\":\"invalid_value\"}}");
    free(s);
    oai_fail(&e, 401, "invalid_request_error", NULL, NULL, "no key");
    s = oai_error_json(&e);
    assert_string_equal(s, "{\"error\":{\"message\":\"no key\",\"type\":\"invalid_request_error\",\"param\":null,"
                           "\"code\":null}}");
    free(s);
    /* A quote of client text cut mid-character still goes out as UTF-8. */
    oai_bad(&e, "caf\xC3", NULL, "no route: caf\xC3\xA9 \xFF");
    s = oai_error_json(&e);
    assert_string_equal(
        s, "{\"error\":{\"message\":\"no route: caf\xC3\xA9 \xEF\xBF\xBD\",\"type\":\"invalid_request_error\","
           "\"param\":\"caf\xEF\xBF\xBD\",\"code\":null}}");
    free(s);
}

/* ---- a whole reply's size, counted by the code that writes it ---- */

/* Every byte a JSON string escapes, a multi-byte character and invalid
 * UTF-8 (a token may end mid-character). */
static const uint8_t ODD[] = {'a', '"', '\\', '\n', '\t', 0x01, 0x1f, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xFF, 0xC3};

static void add_entries(render_lp *l, int n) {
    render_top top[3] = {{ODD, sizeof ODD, -0.25f}, {(const uint8_t *)"x", 1, -INFINITY}, {ODD, 9, -3.5e-7f}};
    for (int i = 0; i < n; i++)
        render_lp_add(l, ODD, (size_t)(i % (int)sizeof ODD), -1.5f * (float)i, top, i % 4, 7 * i);
}

/* What the counter says and what is written agree to the byte, for the
 * whole reply and for each choice (they add up to it), and an entry or a
 * piece of text grows the reply by its own bytes only: what generate.c
 * keeps its count under max-reply-bytes with. */
static void test_a_counter_sizes_a_whole_reply_as_it_is_written(void **state) {
    (void)state;
    for (int chat = 0; chat < 2; chat++) {
        render_lp lp[12];
        memset(lp, 0, sizeof lp);
        render_choice c[12];
        const char *text = "He said \"hi\"\n\tthen\x01 caf\xC3\xA9 \xE2\x82\xAC";
        const char *calls = "[{\"id\":\"call_q_0\",\"type\":\"function\",\"function\":{\"name\":\"add\","
                            "\"arguments\":\"{\\\"a\\\":1}\"}}]";
        for (int i = 0; i < 12; i++) {
            lp[i].chat = chat;
            add_entries(&lp[i], i);
            c[i] = (render_choice){i % 3 ? text : NULL, i % 3 ? strlen(text) - (size_t)i : 0, i % 2 ? &lp[i] : NULL,
                                   render_finish_name(i % 3), chat && i % 4 == 0 ? calls : NULL};
        }
        c[5].text = "", c[5].n = 0;
        render_meta m = {"chatcmpl-0123456789abcdef01234567", chat, 1733500000, "SmolLM2 \"135M\""};
        for (int n = 0; n <= 12; n++) {
            jbuf b = {0}, all = JBUF_COUNTER, frame = JBUF_COUNTER;
            render_completion(&b, &m, c, n, 123, 9876);
            render_completion(&all, &m, c, n, 123, 9876);
            render_completion(&frame, &m, c, 0, 123, 9876);
            assert_false(b.oom || all.oom);
            assert_non_null(b.p);
            assert_int_equal(strlen(b.p), b.len);
            assert_int_equal(all.len, b.len);
            assert_null(all.p);
            size_t sum = frame.len;
            for (int i = 0; i < n; i++) {
                jbuf one = {0}, counted = JBUF_COUNTER;
                render_completion_choice(&one, chat, i, &c[i]);
                render_completion_choice(&counted, chat, i, &c[i]);
                assert_int_equal(counted.len, one.len);
                /* Where the reply writes it. */
                assert_non_null(strstr(b.p, one.p));
                sum += counted.len;
                jbuf_free(&one);
            }
            assert_int_equal(sum, b.len);
            jbuf_free(&b);
        }
        /* Growing a choice: an entry adds what render_lp_bytes says, text
         * what its quoting adds inside the quotes. */
        render_lp grow = {.chat = chat};
        render_choice g = {"", 0, &grow, "stop", NULL};
        jbuf before = JBUF_COUNTER, after = JBUF_COUNTER;
        render_completion_choice(&before, chat, 3, &g);
        add_entries(&grow, 5);
        g.text = text, g.n = strlen(text);
        render_completion_choice(&after, chat, 3, &g);
        assert_int_equal(after.len - before.len, render_lp_bytes(&grow) + jbuf_quoted_len(text, strlen(text)) - 2);
        render_lp_free(&grow);
        for (int i = 0; i < 12; i++) render_lp_free(&lp[i]);
    }
    /* A counter holds nothing and has no room; cleared, it counts anew. */
    jbuf k = JBUF_COUNTER;
    jbuf_printf(&k, "%d:%s", 12345, "ab");
    jbuf_quote(&k, "\"\x02", 2);
    jbuf_str(&k, "xyz");
    assert_int_equal(k.len, 8 + 10 + 3);
    assert_false(jbuf_reserve(&k, 1));
    assert_null(k.p);
    assert_false(k.oom);
    jbuf_clear(&k);
    jbuf_add(&k, "abc", 3);
    assert_int_equal(k.len, 3);
    jbuf_free(&k);
}

/* ---- the parser's cost on hostile bodies ---- */

#define SHAPE_BYTES (1u << 20) /* the gateway's default --max-body-bytes */

typedef struct text {
    char *p;
    size_t len;
} text;

static void put(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(text *t, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(t->p + t->len, SHAPE_BYTES + 256 - t->len, fmt, ap);
    va_end(ap);
    assert_true(n >= 0 && t->len + (size_t)n < SHAPE_BYTES + 256);
    t->len += (size_t)n;
}

static double parse_ms(oai_kind k, const text *t, int *status) {
    oai_request r;
    oai_error e;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    int rc = oai_parse(&r, k, t->p, t->len, &e);
    clock_gettime(CLOCK_MONOTONIC, &b);
    *status = rc == AE_OK ? 200 : e.status;
    oai_request_free(&r);
    return (double)(b.tv_sec - a.tv_sec) * 1e3 + (double)(b.tv_nsec - a.tv_nsec) * 1e-6;
}

/* Each worst shape of a 1 MiB body found so far is parsed in time linear
 * in its size: a body of ~80k distinct keys once took 74 s here (every
 * key was compared with every later one). The bound is loose: under ASan
 * on a loaded machine half a million tiny array elements (a malloc each)
 * take ~0.5 s; a release build parses each shape in well under 50 ms. */
static void test_a_1mib_body_of_any_shape_parses_in_linear_time(void **state) {
    (void)state;
    enum { KEYS_TOP, KEYS_IN_MESSAGE, MESSAGES, CONTENT_PARTS, TINY_IDS, LONG_STRING, DEEP, N_SHAPES };
    static const char *const names[] = {"keys_top", "keys_in_message", "messages", "content_parts",
                                        "tiny_ids", "long_string",     "deep"};
    static const int want[] = {400, 400, 200, 200, 200, 200, 400};
    text t = {malloc(SHAPE_BYTES + 256), 0};
    assert_non_null(t.p);
    for (int shape = 0; shape < N_SHAPES; shape++) {
        t.len = 0;
        oai_kind k = OAI_CHAT;
        switch (shape) {
        case KEYS_TOP: /* distinct unknown keys: refused, but only after the duplicate check */
            put(&t, "{\"model\":\"m\"");
            for (int i = 0; t.len < SHAPE_BYTES - 32; i++) put(&t, ",\"k%d\":0", i);
            put(&t, "}");
            break;
        case KEYS_IN_MESSAGE:
            put(&t, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\"");
            for (int i = 0; t.len < SHAPE_BYTES - 32; i++) put(&t, ",\"k%d\":0", i);
            put(&t, "}]}");
            break;
        case MESSAGES: /* as many as a conversation may have, filling the body */
            put(&t, "{\"model\":\"m\",\"messages\":[");
            for (unsigned i = 0; i < CHAT_MAX_MESSAGES; i++)
                put(&t, "%s{\"role\":\"user\",\"content\":\"%0*d\"}", i ? "," : "",
                    (int)(SHAPE_BYTES / CHAT_MAX_MESSAGES) - 40, 0);
            put(&t, "]}");
            break;
        case CONTENT_PARTS:
            put(&t,
                "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"}");
            while (t.len < SHAPE_BYTES - 64) put(&t, ",{\"type\":\"text\",\"text\":\"a\"}");
            put(&t, "]}]}");
            break;
        case TINY_IDS:
            k = OAI_COMPLETION;
            put(&t, "{\"model\":\"m\",\"prompt\":[1");
            while (t.len < SHAPE_BYTES - 32) put(&t, ",1");
            put(&t, "]}");
            break;
        case LONG_STRING:
            k = OAI_COMPLETION;
            put(&t, "{\"model\":\"m\",\"prompt\":\"");
            memset(t.p + t.len, ' ', SHAPE_BYTES - 32 - t.len);
            t.len = SHAPE_BYTES - 32;
            put(&t, "\"}");
            break;
        default: /* nesting: refused by the JSON parser's depth limit */
            put(&t, "{\"model\":\"m\",\"messages\":");
            while (t.len < SHAPE_BYTES - 32) put(&t, "[");
            break;
        }
        int status;
        double ms = parse_ms(k, &t, &status);
        print_message("shape=%s bytes=%zu status=%d parse_ms=%.1f\n", names[shape], t.len, status, ms);
        assert_int_equal(status, want[shape]);
        assert_true(ms < 2000.0);
    }
    free(t.p);
}

/* The duplicate check still names the key that repeats first. */
static void test_first_repeated_key_is_named_among_many(void **state) {
    (void)state;
    text t = {malloc(SHAPE_BYTES + 256), 0};
    put(&t, "{\"model\":\"m\",\"prompt\":\"x\"");
    for (int i = 0; i < 1000; i++) put(&t, ",\"k%d\":null", i);
    put(&t, ",\"k700\":null,\"k5\":null}");
    oai_request r;
    oai_error e;
    assert_int_equal(oai_parse(&r, OAI_COMPLETION, t.p, t.len, &e), AE_ERR);
    assert_string_equal(e.param, "k5");
    assert_string_equal(e.message, "'k5' appears more than once");
    free(t.p);
}

/* ---- metrics ---- */

static void test_histogram_renders_cumulative_buckets(void **state) {
    (void)state;
    metrics m;
    metrics_init(&m);
    metrics_hist_observe(&m.ttft, 0.004);
    metrics_hist_observe(&m.ttft, 0.004);
    metrics_hist_observe(&m.ttft, 0.3);
    metrics_hist_observe(&m.ttft, 1000);
    metrics_request(&m, METRICS_CHAT, 200);
    metrics_request(&m, METRICS_CHAT, 200);
    metrics_request(&m, METRICS_COMPLETIONS, 400);
    m.spec_accepted_at[1] = 5;
    metrics_hist_observe(&m.generation_hist, 64);
    metrics_hist_observe(&m.generation_hist, 65);
    metrics_target t = {"unix:/tmp/t.sock", true, 2, 3, 1, 25, 100, 120, 0.0015, 2, 60, 6000, 0.125};
    m.constrained = 7;
    metrics_gauges g = {&t, 1, 2, 4};
    size_t len;
    char *s = metrics_render(&m, &g, &len);
    assert_int_equal(strlen(s), len);
    assert_non_null(strstr(s, "aerie_time_to_first_token_seconds_bucket{le=\"0.0025\"} 0\n"
                              "aerie_time_to_first_token_seconds_bucket{le=\"0.005\"} 2\n"));
    assert_non_null(strstr(s, "aerie_time_to_first_token_seconds_bucket{le=\"0.3\"} 3\n"));
    assert_non_null(strstr(s, "aerie_time_to_first_token_seconds_bucket{le=\"320\"} 3\n"
                              "aerie_time_to_first_token_seconds_bucket{le=\"+Inf\"} 4\n"
                              "aerie_time_to_first_token_seconds_sum 1000.308000\n"
                              "aerie_time_to_first_token_seconds_count 4\n"));
    assert_non_null(strstr(s, "aerie_requests_total{route=\"chat_completions\",code=\"200\"} 2\n"
                              "aerie_requests_total{route=\"completions\",code=\"400\"} 1\n"));
    assert_non_null(strstr(s, "aerie_spec_accepted_at_position_total{position=\"2\"} 5\n"));
    assert_non_null(strstr(s, "aerie_kv_cache_usage_ratio{target=\"unix:/tmp/t.sock\"} 0.25\n"));
    assert_non_null(strstr(s, "# TYPE aerie_grammar_masks_total counter\n"));
    assert_non_null(strstr(s, "aerie_grammar_masks_total{target=\"unix:/tmp/t.sock\"} 120\n"));
    assert_non_null(strstr(s, "aerie_grammar_mask_seconds_total{target=\"unix:/tmp/t.sock\"} 0.0015\n"));
    assert_non_null(strstr(s, "aerie_constrained_requests_total 7\n"));
    assert_non_null(strstr(s, "aerie_target_tp_ranks{target=\"unix:/tmp/t.sock\"} 2\n"));
    assert_non_null(strstr(s, "aerie_allreduces_per_step{target=\"unix:/tmp/t.sock\"} 60\n"));
    assert_non_null(strstr(s, "# TYPE aerie_allreduces_total counter\n"
                              "aerie_allreduces_total{target=\"unix:/tmp/t.sock\"} 6000\n"));
    assert_non_null(strstr(s, "aerie_allreduce_seconds_total{target=\"unix:/tmp/t.sock\"} 0.125\n"));
    assert_non_null(strstr(s, "# TYPE aerie_e2e_request_latency_seconds histogram\n"));
    assert_non_null(strstr(s, "aerie_request_generation_tokens_bucket{le=\"32\"} 0\n"
                              "aerie_request_generation_tokens_bucket{le=\"64\"} 1\n"
                              "aerie_request_generation_tokens_bucket{le=\"128\"} 2\n"));
    free(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stop_string_split_across_pieces_is_found_and_cut),
        cmocka_unit_test(test_text_that_might_begin_a_stop_is_held_until_decided),
        cmocka_unit_test(test_earliest_of_several_stops_wins),
        cmocka_unit_test(test_no_stops_passes_text_through_unchanged),
        cmocka_unit_test(test_multibyte_stop_never_releases_half_a_character),
        cmocka_unit_test(test_every_split_releases_the_same_text),
        cmocka_unit_test(test_a_match_waits_for_an_earlier_starting_stop),
        cmocka_unit_test(test_every_cut_of_random_texts_matches_the_reference),
        cmocka_unit_test(test_bad_stop_strings_are_refused),
        cmocka_unit_test(test_chat_request_with_defaults),
        cmocka_unit_test(test_chat_request_with_every_field),
        cmocka_unit_test(test_completion_prompts_text_ids_and_batches_of_one),
        cmocka_unit_test(test_penalties_biases_and_logprobs_are_parsed),
        cmocka_unit_test(test_response_format_and_the_schema_subset),
        cmocka_unit_test(test_schema_limits_name_the_limit_and_value),
        cmocka_unit_test(test_the_combined_tool_schema_is_checked),
        cmocka_unit_test(test_tool_calls_are_found_in_replies),
        cmocka_unit_test(test_tools_and_tool_messages_are_parsed),
        cmocka_unit_test(test_bad_requests_name_their_field),
        cmocka_unit_test(test_invalid_utf8_and_lone_surrogates_are_refused),
        cmocka_unit_test(test_error_json_has_openai_shape),
        cmocka_unit_test(test_a_counter_sizes_a_whole_reply_as_it_is_written),
        cmocka_unit_test(test_a_1mib_body_of_any_shape_parses_in_linear_time),
        cmocka_unit_test(test_first_repeated_key_is_named_among_many),
        cmocka_unit_test(test_histogram_renders_cumulative_buckets),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
