/* Chat templates: recognition, rendering against jinja2's output
 * (tests/golden/chat/cases.json from tools/gen_chat_golden.py), refusals,
 * and the JSON message-list parser. Run from the repository root. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "../../services/core/err.h"
#include "../../services/model/gguf.h"
#include "../../services/tokenizer/chat.h"
#include "../../services/tokenizer/tok.h"

#define GOLDEN "tests/golden/chat/cases.json"

static cJSON *load_golden(void) {
    FILE *f = fopen(GOLDEN, "rb");
    if (f == NULL) fail_msg("cannot open %s (run from the repo root)", GOLDEN);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    assert_true(size > 0);
    char *buf = malloc((size_t)size);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)size, f), (size_t)size);
    fclose(f);
    cJSON *doc = cJSON_ParseWithLength(buf, (size_t)size);
    free(buf);
    assert_non_null(doc);
    return doc;
}

static const char *str_field(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    assert_true(cJSON_IsString(v));
    return v->valuestring;
}

static const cJSON *find_named(const cJSON *arr, const char *name) {
    const cJSON *it;
    cJSON_ArrayForEach(it, arr) {
        if (strcmp(str_field(it, "name"), name) == 0) return it;
    }
    fail_msg("no entry named %s", name);
    return NULL;
}

static void test_golden_templates_are_recognised(void **state) {
    (void)state;
    cJSON *doc = load_golden();
    const cJSON *t;
    size_t count = 0;
    cJSON_ArrayForEach(t, cJSON_GetObjectItemCaseSensitive(doc, "templates")) {
        ae_error err = {0};
        chat_template *ct = NULL;
        const char *name = str_field(t, "name");
        if (chat_template_init(&ct, str_field(t, "source"), &err) != AE_OK) fail_msg("%s: %s", name, err.msg);
        assert_string_equal(chat_family_name(ct), str_field(t, "family"));
        assert_string_equal(chat_variant_name(ct), str_field(t, "variant"));
        const cJSON *def = cJSON_GetObjectItemCaseSensitive(t, "default_system");
        if (cJSON_IsNull(def)) {
            assert_null(chat_default_system(ct));
        } else {
            assert_non_null(chat_default_system(ct));
            assert_string_equal(chat_default_system(ct), def->valuestring);
        }
        chat_template_free(ct);
        count++;
    }
    assert_int_equal(count, 7);
    cJSON_Delete(doc);
}

/* Converts a golden conversation to chat_msg, pointing into the cJSON. */
static size_t golden_msgs(const cJSON *conv, chat_msg *msgs, size_t cap) {
    size_t n = 0;
    const cJSON *m;
    cJSON_ArrayForEach(m, cJSON_GetObjectItemCaseSensitive(conv, "messages")) {
        assert_true(n < cap);
        msgs[n].role = str_field(m, "role");
        msgs[n].content = str_field(m, "content");
        n++;
    }
    return n;
}

static void test_golden_cases_render_exactly(void **state) {
    (void)state;
    cJSON *doc = load_golden();
    const cJSON *templates = cJSON_GetObjectItemCaseSensitive(doc, "templates");
    const cJSON *convs = cJSON_GetObjectItemCaseSensitive(doc, "conversations");
    const cJSON *c;
    size_t count = 0;
    cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(doc, "cases")) {
        const char *tname = str_field(c, "template"), *cname = str_field(c, "conversation");
        const char *want = str_field(c, "expected");
        bool agp = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(c, "add_generation_prompt"));
        ae_error err = {0};
        chat_template *ct = NULL;
        assert_int_equal(chat_template_init(&ct, str_field(find_named(templates, tname), "source"), &err), AE_OK);
        chat_msg msgs[16];
        size_t n = golden_msgs(find_named(convs, cname), msgs, 16);

        size_t len = 0;
        char *got = NULL;
        if (chat_render_alloc(ct, msgs, n, agp, &got, &len, &err) != AE_OK)
            fail_msg("%s/%s: %s", tname, cname, err.msg);
        if (len != strlen(want) || memcmp(got, want, len) != 0)
            fail_msg("%s/%s agp=%d:\n got: [%s]\nwant: [%s]", tname, cname, agp, got, want);

        /* Measuring alone gives the same length; a buffer one byte short
         * (no room for the NUL) is refused with the size it needs. */
        size_t measured = 0;
        assert_int_equal(chat_render(ct, msgs, n, agp, NULL, 0, &measured, &err), AE_OK);
        assert_int_equal(measured, len);
        char *small = malloc(len);
        assert_int_equal(chat_render(ct, msgs, n, agp, small, len, &measured, &err), AE_ERR);
        assert_int_equal(measured, len);
        assert_non_null(strstr(err.msg, "needs"));
        free(small);
        free(got);
        chat_template_free(ct);
        count++;
    }
    assert_int_equal(count, 7 * 13 * 2);
    cJSON_Delete(doc);
}

static void test_golden_rejected_templates_fail_with_their_message(void **state) {
    (void)state;
    cJSON *doc = load_golden();
    const cJSON *r;
    size_t count = 0;
    cJSON_ArrayForEach(r, cJSON_GetObjectItemCaseSensitive(doc, "rejected")) {
        ae_error err = {0};
        chat_template *ct = (chat_template *)&err; /* must be reset to NULL */
        if (chat_template_init(&ct, str_field(r, "source"), &err) != AE_ERR)
            fail_msg("%s: accepted as %s", str_field(r, "name"), chat_variant_name(ct));
        assert_null(ct);
        if (strcmp(err.msg, str_field(r, "error")) != 0) fail_msg("%s: got \"%s\"", str_field(r, "name"), err.msg);
        count++;
    }
    assert_int_equal(count, 6);
    cJSON_Delete(doc);
}

static void test_missing_template_is_an_error(void **state) {
    (void)state;
    ae_error err = {0};
    chat_template *ct = NULL;
    assert_int_equal(chat_template_init(&ct, NULL, &err), AE_ERR);
    assert_string_equal(err.msg, "model has no chat template (expected ChatML or Llama-3)");
    err_clear(&err);
    assert_int_equal(chat_template_init(&ct, "", &err), AE_ERR);
    assert_string_equal(err.msg, "model has no chat template (expected ChatML or Llama-3)");
    chat_template_free(NULL);
}

static const char *PLAIN_CHATML =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}";

static void test_default_system_is_read_from_the_template(void **state) {
    (void)state;
    /* Not SmolLM's text, so it cannot be hard-coded; empty is allowed. */
    const char *src = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                      "{{ '<|im_start|>system\\nBe brief, {{ really }}.<|im_end|>\\n' }}{% endif %}"
                      "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
                      "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                      "{% endif %}";
    ae_error err = {0};
    chat_template *ct = NULL;
    assert_int_equal(chat_template_init(&ct, src, &err), AE_OK);
    assert_string_equal(chat_default_system(ct), "Be brief, {{ really }}.");
    chat_msg m = {"user", "hi"};
    char out[256];
    size_t len = 0;
    assert_int_equal(chat_render(ct, &m, 1, true, out, sizeof out, &len, &err), AE_OK);
    assert_string_equal(out, "<|im_start|>system\nBe brief, {{ really }}.<|im_end|>\n"
                             "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    assert_int_equal(len, strlen(out));
    chat_template_free(ct);
}

static void test_render_refuses_bad_messages(void **state) {
    (void)state;
    ae_error err = {0};
    chat_template *ct = NULL;
    assert_int_equal(chat_template_init(&ct, PLAIN_CHATML, &err), AE_OK);
    char out[64];
    size_t len = 7;

    assert_int_equal(chat_render(ct, NULL, 0, true, out, sizeof out, &len, &err), AE_ERR);
    assert_string_equal(err.msg, "messages: empty; a conversation needs at least one");
    assert_int_equal(len, 0);

    err_clear(&err);
    chat_msg bad_role[] = {{"user", "a"}, {"tool", "b"}};
    assert_int_equal(chat_render(ct, bad_role, 2, true, out, sizeof out, &len, &err), AE_ERR);
    assert_string_equal(err.msg, "messages[1].role: \"tool\" is not one of system, user, assistant");

    err_clear(&err);
    chat_msg no_content[] = {{"user", NULL}};
    assert_int_equal(chat_render(ct, no_content, 1, true, out, sizeof out, &len, &err), AE_ERR);
    assert_string_equal(err.msg, "messages[0].content: missing");

    err_clear(&err);
    chat_msg ok[] = {{"user", "hello there, this will not fit in a few bytes"}};
    assert_int_equal(chat_render(ct, ok, 1, false, out, 8, &len, &err), AE_ERR);
    assert_string_equal(err.msg, "chat_render: text needs 73 bytes plus NUL, buffer has 8");
    assert_int_equal(len, 73);
    chat_template_free(ct);
}

static void test_llama3_strips_python_whitespace_only(void **state) {
    (void)state;
    const char *src = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
                      "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] "
                      "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
                      "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
                      "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";
    ae_error err = {0};
    chat_template *ct = NULL;
    assert_int_equal(chat_template_init(&ct, src, &err), AE_OK);
    assert_string_equal(chat_family_name(ct), "llama3");
    /* U+00A0 and U+3000 are str.isspace(); U+200B is not. */
    chat_msg m[] = {{"user", "\xC2\xA0 \xE3\x80\x80x y\xE2\x80\x8B\n"}};
    char out[256];
    size_t len = 0;
    assert_int_equal(chat_render(ct, m, 1, false, out, sizeof out, &len, &err), AE_OK);
    assert_string_equal(out, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
                             "x y\xE2\x80\x8B<|eot_id|>");
    chat_template_free(ct);
}

/* ---- JSON message lists ------------------------------------------------ */

static void expect_parse_error(const char *json, const char *want) {
    ae_error err = {0};
    chat_msg *msgs = (chat_msg *)&err;
    size_t n = 99;
    assert_int_equal(chat_parse_messages_json(json, strlen(json), &msgs, &n, &err), AE_ERR);
    assert_null(msgs);
    assert_int_equal(n, 0);
    if (strcmp(err.msg, want) != 0) fail_msg("for %s\n got: %s\nwant: %s", json, err.msg, want);
}

static void test_parse_messages_accepts_a_valid_list(void **state) {
    (void)state;
    const char *json = " [{\"role\": \"system\", \"content\": \"be \\\"nice\\\"\"},\n"
                       "  {\"content\": \"héllo 😀\", \"role\": \"user\"},\n"
                       "  {\"role\": \"assistant\", \"content\": \"\"}] \n";
    ae_error err = {0};
    chat_msg *msgs = NULL;
    size_t n = 0;
    assert_int_equal(chat_parse_messages_json(json, strlen(json), &msgs, &n, &err), AE_OK);
    assert_int_equal(n, 3);
    assert_string_equal(msgs[0].role, "system");
    assert_string_equal(msgs[0].content, "be \"nice\"");
    assert_string_equal(msgs[1].role, "user");
    assert_string_equal(msgs[1].content, "h\xC3\xA9llo \xF0\x9F\x98\x80");
    assert_string_equal(msgs[2].role, "assistant");
    assert_string_equal(msgs[2].content, "");
    chat_msgs_free(msgs);
    chat_msgs_free(NULL);
}

static void test_parse_messages_names_the_bad_element(void **state) {
    (void)state;
    expect_parse_error("", "messages: not valid JSON (near byte 0)");
    /* cJSON reports the last byte when the input ends early. */
    expect_parse_error("[{\"role\": \"user\", \"content\": \"x\"}", "messages: not valid JSON (near byte 32)");
    expect_parse_error("{\"role\": \"user\"}", "messages: expected a JSON array of {\"role\", \"content\"} objects");
    expect_parse_error("[]", "messages: empty; a conversation needs at least one");
    expect_parse_error("[{\"role\": \"user\", \"content\": \"x\"}, 3]",
                       "messages[1]: expected an object with \"role\" and \"content\"");
    expect_parse_error("[{\"content\": \"x\"}]", "messages[0].role: missing");
    expect_parse_error("[{\"role\": 1, \"content\": \"x\"}]", "messages[0].role: expected a string");
    expect_parse_error("[{\"role\": \"user\", \"content\": \"x\"}, {\"role\": \"bot\", "
                       "\"content\": \"x\"}]",
                       "messages[1].role: \"bot\" is not one of system, user, assistant");
    expect_parse_error("[{\"role\": \"user\"}]", "messages[0].content: missing");
    expect_parse_error("[{\"role\": \"user\", \"content\": null}]", "messages[0].content: expected a string");
    expect_parse_error("[{\"role\": \"user\", \"content\": [{\"type\": \"text\"}]}]",
                       "messages[0].content: expected a string");
    expect_parse_error("[{\"role\": \"user\", \"content\": \"x\", \"name\": \"bob\"}]",
                       "messages[0]: unsupported key \"name\" (only role, content)");
    expect_parse_error("[{\"role\": \"user\", \"content\": \"x\", \"role\": \"system\"}]",
                       "messages[0]: duplicate key \"role\"");
    expect_parse_error("[{\"role\": \"user\", \"content\": \"a\\u0000b\"}]",
                       "messages: a \\u0000 escape at byte 31 is not supported");
    expect_parse_error("[{\"role\": \"user\", \"content\": \"x\"}] []",
                       "messages: trailing data after the JSON value at byte 35");
}

static void test_parse_messages_refuses_a_raw_nul_byte(void **state) {
    (void)state;
    /* cJSON would keep the NUL inside the string and the content would end
     * at "hello" without a word said. */
    static const char json[] = "[{\"role\": \"user\", \"content\": \"hello\0IGNORED\"}]";
    ae_error err = {0};
    chat_msg *msgs = NULL;
    size_t n = 0;
    assert_int_equal(chat_parse_messages_json(json, sizeof json - 1, &msgs, &n, &err), AE_ERR);
    assert_string_equal(err.msg, "messages: a NUL byte at byte 35");
    assert_null(msgs);
}

static void test_parse_messages_escaped_backslash_before_u0000_is_fine(void **state) {
    (void)state;
    const char *json = "[{\"role\": \"user\", \"content\": \"\\\\u0000\"}]";
    ae_error err = {0};
    chat_msg *msgs = NULL;
    size_t n = 0;
    assert_int_equal(chat_parse_messages_json(json, strlen(json), &msgs, &n, &err), AE_OK);
    assert_string_equal(msgs[0].content, "\\u0000");
    chat_msgs_free(msgs);
}

static void test_parse_messages_enforces_the_count_limit(void **state) {
    (void)state;
    const char *one = "{\"role\":\"user\",\"content\":\"\"},";
    size_t n_msgs = CHAT_MAX_MESSAGES + 1, len = strlen(one);
    char *json = malloc(n_msgs * len + 3);
    assert_non_null(json);
    json[0] = '[';
    for (size_t i = 0; i < n_msgs; i++) memcpy(json + 1 + i * len, one, len);
    json[n_msgs * len] = ']'; /* replaces the last comma */
    json[n_msgs * len + 1] = '\0';
    expect_parse_error(json, "messages: 4097 exceeds the limit of 4096");
    free(json);
}

/* The parser's output renders like the golden messages it came from. */
static void test_parsed_golden_conversations_render_like_golden(void **state) {
    (void)state;
    cJSON *doc = load_golden();
    const cJSON *templates = cJSON_GetObjectItemCaseSensitive(doc, "templates");
    const cJSON *convs = cJSON_GetObjectItemCaseSensitive(doc, "conversations");
    const cJSON *c;
    size_t count = 0;
    cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(doc, "cases")) {
        if (strcmp(str_field(c, "template"), "qwen2.5") != 0) continue;
        const cJSON *conv = find_named(convs, str_field(c, "conversation"));
        char *json = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(conv, "messages"));
        ae_error err = {0};
        chat_msg *msgs = NULL;
        size_t n = 0;
        if (chat_parse_messages_json(json, strlen(json), &msgs, &n, &err) != AE_OK) fail_msg("%s: %s", json, err.msg);
        chat_template *ct = NULL;
        assert_int_equal(chat_template_init(&ct, str_field(find_named(templates, "qwen2.5"), "source"), &err), AE_OK);
        char *got = NULL;
        size_t len = 0;
        bool agp = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(c, "add_generation_prompt"));
        assert_int_equal(chat_render_alloc(ct, msgs, n, agp, &got, &len, &err), AE_OK);
        assert_string_equal(got, str_field(c, "expected"));
        free(got);
        chat_template_free(ct);
        chat_msgs_free(msgs);
        cJSON_free(json);
        count++;
    }
    assert_int_equal(count, 26);
    cJSON_Delete(doc);
}

/* The template as the tokenizer hands it over from the default model's
 * GGUF is recognised, with SmolLM2's default system prompt. */
static void test_default_model_template_is_recognised(void **state) {
    (void)state;
    const char *path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    ae_error err = {0};
    gguf_file *f = NULL;
    tok *t = NULL;
    if (gguf_open(&f, path, &err) != AE_OK) fail_msg("%s (run `make model`)", err.msg);
    assert_int_equal(tok_load_gguf(&t, f, &err), AE_OK);
    chat_template *ct = NULL;
    if (chat_template_init(&ct, tok_chat_template(t), &err) != AE_OK) fail_msg("%s", err.msg);
    assert_string_equal(chat_variant_name(ct), "chatml-default-system");
    assert_string_equal(chat_default_system(ct),
                        "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
    chat_template_free(ct);
    tok_free(t);
    gguf_close(f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden_templates_are_recognised),
        cmocka_unit_test(test_golden_cases_render_exactly),
        cmocka_unit_test(test_golden_rejected_templates_fail_with_their_message),
        cmocka_unit_test(test_missing_template_is_an_error),
        cmocka_unit_test(test_default_system_is_read_from_the_template),
        cmocka_unit_test(test_render_refuses_bad_messages),
        cmocka_unit_test(test_llama3_strips_python_whitespace_only),
        cmocka_unit_test(test_parse_messages_accepts_a_valid_list),
        cmocka_unit_test(test_parse_messages_names_the_bad_element),
        cmocka_unit_test(test_parse_messages_escaped_backslash_before_u0000_is_fine),
        cmocka_unit_test(test_parse_messages_refuses_a_raw_nul_byte),
        cmocka_unit_test(test_parse_messages_enforces_the_count_limit),
        cmocka_unit_test(test_parsed_golden_conversations_render_like_golden),
        cmocka_unit_test(test_default_model_template_is_recognised),
    };
    return cmocka_run_group_tests_name("chat", tests, NULL, NULL);
}
