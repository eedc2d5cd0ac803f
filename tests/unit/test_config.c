/* Configuration precedence and provenance: default < file < env < flag,
 * plus auto values; bad values are rejected with the setting's name. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "../../services/core/config.h"

static const config_option opts[] = {
    {"threads", CONFIG_INT, "auto", 1, 256, "worker threads"},
    {"log-level", CONFIG_STRING, "info", 0, 0, "log level"},
    {"mem-fraction", CONFIG_DOUBLE, "0.9", 0.05, 1.0, "memory fraction"},
    {"json", CONFIG_BOOL, "false", 0, 0, "print JSON"},
    {"model", CONFIG_STRING, NULL, 0, 0, "model file"},
};
#define N_OPTS (sizeof opts / sizeof opts[0])

static char tmp_path[64];

static void write_file(const char *text) {
    strcpy(tmp_path, "/tmp/aerie-cfg-XXXXXX");
    int fd = mkstemp(tmp_path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
}

static config *load(int argc, char **argv, char **envp, ae_error *err, int expect_rc) {
    config *c;
    assert_int_equal(config_init(&c, opts, N_OPTS, err), AE_OK);
    char *pos[16];
    int npos;
    bool print;
    assert_int_equal(config_load(c, argc, argv, envp, pos, &npos, &print, err), expect_rc);
    return c;
}

static void test_defaults_have_source_default(void **state) {
    (void)state;
    ae_error err = {0};
    config *c = load(0, NULL, NULL, &err, AE_OK);
    assert_string_equal(config_str(c, "log-level"), "info");
    assert_int_equal(config_get_source(c, "log-level"), CONFIG_SRC_DEFAULT);
    assert_true(config_is_auto(c, "threads"));
    assert_int_equal(config_get_source(c, "model"), CONFIG_SRC_UNSET);
    assert_null(config_str(c, "model"));
    assert_true(config_has(c, "model"));
    assert_false(config_has(c, "cuda-graphs")); /* not in this table */
    config_free(c);
}

static void test_precedence_file_env_flag(void **state) {
    (void)state;
    write_file("{\"log-level\": \"debug\", \"mem-fraction\": 0.5, \"threads\": 3}");
    char cfgarg[80];
    snprintf(cfgarg, sizeof cfgarg, "--config=%s", tmp_path);
    char *argv[] = {cfgarg, "--threads", "7"};
    char *envp[] = {"AERIE_MEM_FRACTION=0.75", "AERIE_THREADS=5", "PATH=/bin", NULL};
    ae_error err = {0};
    config *c = load(3, argv, envp, &err, AE_OK);
    assert_string_equal(config_str(c, "log-level"), "debug");
    assert_int_equal(config_get_source(c, "log-level"), CONFIG_SRC_FILE);
    assert_true(config_double(c, "mem-fraction") == 0.75);
    assert_int_equal(config_get_source(c, "mem-fraction"), CONFIG_SRC_ENV);
    assert_int_equal(config_int(c, "threads"), 7);
    assert_int_equal(config_get_source(c, "threads"), CONFIG_SRC_FLAG);
    config_free(c);
    unlink(tmp_path);
}

static void test_auto_value_records_auto_source(void **state) {
    (void)state;
    ae_error err = {0};
    config *c = load(0, NULL, NULL, &err, AE_OK);
    config_set_auto_int(c, "threads", 2);
    assert_int_equal(config_int(c, "threads"), 2);
    assert_int_equal(config_get_source(c, "threads"), CONFIG_SRC_AUTO);
    assert_false(config_is_auto(c, "threads"));
    config_free(c);
}

static void test_print_config_json_names_sources(void **state) {
    (void)state;
    char *argv[] = {"--json", "--model=m.gguf"};
    ae_error err = {0};
    config *c = load(2, argv, NULL, &err, AE_OK);
    config_set_auto_int(c, "threads", 4);
    char *s = config_to_json(c);
    assert_string_equal(s, "{\"threads\":{\"value\":4,\"source\":\"auto\"},"
                           "\"log-level\":{\"value\":\"info\",\"source\":\"default\"},"
                           "\"mem-fraction\":{\"value\":0.9,\"source\":\"default\"},"
                           "\"json\":{\"value\":true,\"source\":\"flag\"},"
                           "\"model\":{\"value\":\"m.gguf\",\"source\":\"flag\"}}");
    free(s);
    config_free(c);
}

static void test_out_of_range_flag_is_rejected(void **state) {
    (void)state;
    char *argv[] = {"--mem-fraction", "1.5"};
    ae_error err = {0};
    config *c = load(2, argv, NULL, &err, AE_ERR);
    assert_string_equal(err.msg, "--mem-fraction: 1.5 is outside 0.05..1");
    config_free(c);
}

static void test_bad_env_names_the_variable(void **state) {
    (void)state;
    char *envp[] = {"AERIE_THREADS=many", NULL};
    ae_error err = {0};
    config *c = load(0, NULL, envp, &err, AE_ERR);
    assert_string_equal(err.msg, "environment AERIE_THREADS: threads: expected an integer, got \"many\"");
    config_free(c);
}

static void test_unknown_flag_is_rejected(void **state) {
    (void)state;
    char *argv[] = {"--treads", "2"};
    ae_error err = {0};
    config *c = load(2, argv, NULL, &err, AE_ERR);
    assert_string_equal(err.msg, "unknown option --treads");
    config_free(c);
}

static void test_unknown_file_key_is_rejected(void **state) {
    (void)state;
    write_file("{\"colour\": \"blue\"}");
    char *envp[] = {NULL, NULL};
    char envbuf[96];
    snprintf(envbuf, sizeof envbuf, "AERIE_CONFIG=%s", tmp_path);
    envp[0] = envbuf;
    ae_error err = {0};
    config *c = load(0, NULL, envp, &err, AE_ERR);
    char want[160];
    snprintf(want, sizeof want, "config file %s: unknown setting \"colour\"", tmp_path);
    assert_string_equal(err.msg, want);
    config_free(c);
    unlink(tmp_path);
}

static void test_config_file_with_trailing_data_is_rejected(void **state) {
    (void)state;
    write_file("{\"threads\": 3} {\"threads\": 4}");
    ae_error err = {0};
    config *c;
    assert_int_equal(config_init(&c, opts, N_OPTS, &err), AE_OK);
    assert_int_equal(config_load_file(c, tmp_path, &err), AE_ERR);
    char want[160];
    snprintf(want, sizeof want, "config file %s: trailing data after the JSON value at byte 15", tmp_path);
    assert_string_equal(err.msg, want);
    config_free(c);
    unlink(tmp_path);
}

static void test_positionals_and_bool_negation(void **state) {
    (void)state;
    char *argv[] = {"tokenize", "--json", "hello", "--no-json", "--", "--literal"};
    ae_error err = {0};
    config *c;
    assert_int_equal(config_init(&c, opts, N_OPTS, &err), AE_OK);
    char *pos[6];
    int npos;
    bool print;
    assert_int_equal(config_load(c, 6, argv, NULL, pos, &npos, &print, &err), AE_OK);
    assert_int_equal(npos, 3);
    assert_string_equal(pos[0], "tokenize");
    assert_string_equal(pos[1], "hello");
    assert_string_equal(pos[2], "--literal");
    assert_false(config_bool(c, "json"));
    assert_int_equal(config_get_source(c, "json"), CONFIG_SRC_FLAG);
    assert_false(print);
    config_free(c);
}

/* A command with an option named config (aerie plan's model config)
 * takes --config as that option: no settings file is read, from the flag
 * or from AERIE_CONFIG, which stays a settings file's name. */
static void test_an_option_named_config_takes_the_flag(void **state) {
    (void)state;
    static const config_option own[] = {{"config", CONFIG_STRING, NULL, 0, 0, "the model's config.json"},
                                        {"tp", CONFIG_INT, "1", 1, 64, "ranks"}};
    config *c;
    ae_error err = {0};
    assert_int_equal(config_init(&c, own, 2, &err), AE_OK);
    char *argv[] = {"--config", "/models/k/config.json", "--tp=8"};
    char *envp[] = {"AERIE_CONFIG=/nonexistent/settings.json", NULL};
    char *pos[4];
    int npos;
    assert_int_equal(config_load(c, 3, argv, envp, pos, &npos, NULL, &err), AE_OK);
    assert_string_equal(config_str(c, "config"), "/models/k/config.json");
    assert_int_equal(config_get_source(c, "config"), CONFIG_SRC_FLAG);
    assert_int_equal(config_int(c, "tp"), 8);
    assert_int_equal(npos, 0);
    config_free(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults_have_source_default),
        cmocka_unit_test(test_precedence_file_env_flag),
        cmocka_unit_test(test_auto_value_records_auto_source),
        cmocka_unit_test(test_print_config_json_names_sources),
        cmocka_unit_test(test_out_of_range_flag_is_rejected),
        cmocka_unit_test(test_bad_env_names_the_variable),
        cmocka_unit_test(test_unknown_flag_is_rejected),
        cmocka_unit_test(test_unknown_file_key_is_rejected),
        cmocka_unit_test(test_config_file_with_trailing_data_is_rejected),
        cmocka_unit_test(test_positionals_and_bool_negation),
        cmocka_unit_test(test_an_option_named_config_takes_the_flag),
    };
    return cmocka_run_group_tests_name("config", tests, NULL, NULL);
}
