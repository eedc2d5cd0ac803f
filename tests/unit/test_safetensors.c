/* safetensors files and checkpoint directories: exact values for every
 * dtype, sharded directories, and corrupt input that must fail with one
 * clear error (never a crash or a leak: this suite runs under ASan). */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "../../services/core/err.h"
#include "../../services/model/safetensors.h"

#define GOLDEN_DIR "tests/golden/safetensors"

/* ---- helpers ----------------------------------------------------------- */

typedef struct bytes {
    uint8_t *p;
    size_t n;
} bytes;

/* A file image: u64 LE header length, the header as given, then data. */
static bytes make_st(const char *header, const void *data, size_t data_len) {
    size_t h = strlen(header);
    bytes b = {malloc(8 + h + data_len + 1), 8 + h + data_len};
    assert_non_null(b.p);
    for (int i = 0; i < 8; i++) b.p[i] = (uint8_t)((uint64_t)h >> (8 * i));
    memcpy(b.p + 8, header, h);
    if (data_len) memcpy(b.p + 8 + h, data, data_len);
    return b;
}

/* Opens an image that must be rejected and returns the error text. The
 * image is copied to a buffer of exactly its size so ASan sees any read
 * past the end. */
static const char *reject(const char *header, const void *data, size_t data_len) {
    static ae_error err;
    err_clear(&err);
    bytes b = make_st(header, data, data_len);
    uint8_t *exact = malloc(b.n);
    assert_non_null(exact);
    memcpy(exact, b.p, b.n);
    safetensors_file *f = (safetensors_file *)1;
    assert_int_equal(safetensors_open_mem(&f, exact, b.n, "t.st", &err), AE_ERR);
    assert_null(f);
    free(exact);
    free(b.p);
    return err.msg;
}

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static char tmpdir[64];

static int make_tmpdir(void **state) {
    (void)state;
    strcpy(tmpdir, "/tmp/aerie-st-XXXXXX");
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int remove_tmpdir(void **state) {
    (void)state;
    DIR *d = opendir(tmpdir);
    if (!d) return -1;
    struct dirent *e;
    char path[512];
    while ((e = readdir(d))) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        snprintf(path, sizeof path, "%s/%s", tmpdir, e->d_name);
        unlink(path);
    }
    closedir(d);
    return rmdir(tmpdir);
}

static void write_file(const char *name, const void *p, size_t n) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", tmpdir, name);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(p, 1, n, fp), n);
    fclose(fp);
}

static void write_st(const char *name, const char *header, const void *data, size_t n) {
    bytes b = make_st(header, data, n);
    write_file(name, b.p, b.n);
    free(b.p);
}

static void write_text(const char *name, const char *text) { write_file(name, text, strlen(text)); }

/* ---- one file with every dtype ----------------------------------------- */

/* Data laid out so that F16 and I64 start at odd offsets: readers must not
 * assume alignment (UBSan checks the loads). */
static const char ALL_HEADER[] = "{\"__metadata__\":{\"format\":\"pt\",\"author\":\"aerie\"},"
                                 "\"mask\":{\"dtype\":\"BOOL\",\"shape\":[3],\"data_offsets\":[0,3]},"
                                 "\"half\":{\"dtype\":\"F16\",\"shape\":[2,2],\"data_offsets\":[3,11]},"
                                 "\"ids\":{\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[11,27]},"
                                 "\"brain\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[27,33]},"
                                 "\"small\":{\"dtype\":\"I32\",\"shape\":[1,1,2],\"data_offsets\":[33,41]},"
                                 "\"empty\":{\"dtype\":\"F32\",\"shape\":[0,4],\"data_offsets\":[41,41]},"
                                 "\"full\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[41,53]},"
                                 "\"scalar\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[53,57]},"
                                 "\"wide\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[57,65]}}"
                                 "     "; /* writers pad the header with spaces */

static bytes all_dtypes(void) {
    uint8_t d[65] = {0};
    /* BOOL */
    d[0] = 1, d[1] = 0, d[2] = 1;
    /* F16: 1.0, -2.0, 2^-24 (smallest subnormal), 65504 (max) */
    const uint16_t h[4] = {0x3C00, 0xC000, 0x0001, 0x7BFF};
    memcpy(d + 3, h, 8);
    /* I64 */
    const int64_t ids[2] = {INT64_MIN, 4242424242424242LL};
    memcpy(d + 11, ids, 16);
    /* BF16: 1.0, -5.0, -inf */
    const uint16_t bf[3] = {0x3F80, 0xC0A0, 0xFF80};
    memcpy(d + 27, bf, 6);
    /* I32 */
    const int32_t small[2] = {INT32_MIN, 7};
    memcpy(d + 33, small, 8);
    /* F32: 0.1f, -0.0, +inf bit patterns */
    const uint32_t full[3] = {0x3DCCCCCD, 0x80000000, 0x7F800000};
    memcpy(d + 41, full, 12);
    const float scalar = 3.25f;
    memcpy(d + 53, &scalar, 4);
    const double wide = 2.5;
    memcpy(d + 57, &wide, 8);
    return make_st(ALL_HEADER, d, sizeof d);
}

static void test_every_dtype_reads_exact_values(void **state) {
    (void)state;
    bytes b = all_dtypes();
    ae_error err = {0};
    safetensors_file *f = NULL;
    assert_int_equal(safetensors_open_mem(&f, b.p, b.n, "all.st", &err), AE_OK);
    assert_int_equal(safetensors_count(f), 9);
    assert_string_equal(safetensors_path(f), "all.st");

    /* Sorted by offset; the zero-size tensor sorts before "full". */
    const char *order[] = {"mask", "half", "ids", "brain", "small", "empty", "full", "scalar", "wide"};
    for (size_t i = 0; i < 9; i++) assert_string_equal(safetensors_tensor_at(f, i)->name, order[i]);

    const safetensors_tensor *t = safetensors_find(f, "half");
    assert_non_null(t);
    assert_int_equal(t->dtype, SAFETENSORS_F16);
    assert_int_equal(t->n_dims, 2);
    assert_int_equal(t->shape[0], 2);
    assert_int_equal(t->shape[1], 2);
    assert_int_equal(t->shape[2], 1);
    assert_int_equal(t->n_elements, 4);
    assert_int_equal(t->n_bytes, 8);
    assert_int_equal(t->offset, 3);
    assert_ptr_equal(t->data, b.p + 8 + strlen(ALL_HEADER) + 3);
    float v[4];
    assert_int_equal(safetensors_tensor_to_f32(t, v, 4, &err), AE_OK);
    assert_true(v[0] == 1.0f && v[1] == -2.0f);
    assert_true(v[2] == 0x1p-24f && v[3] == 65504.0f);

    t = safetensors_find(f, "brain");
    assert_int_equal(safetensors_tensor_to_f32(t, v, 3, &err), AE_OK);
    assert_int_equal(f32_bits(v[0]), 0x3F800000);
    assert_int_equal(f32_bits(v[1]), 0xC0A00000);
    assert_int_equal(f32_bits(v[2]), 0xFF800000);

    t = safetensors_find(f, "full");
    assert_int_equal(safetensors_tensor_to_f32(t, v, 3, &err), AE_OK);
    assert_int_equal(f32_bits(v[0]), 0x3DCCCCCD);
    assert_int_equal(f32_bits(v[1]), 0x80000000);
    assert_int_equal(f32_bits(v[2]), 0x7F800000);

    t = safetensors_find(f, "scalar");
    assert_int_equal(t->n_dims, 0);
    assert_int_equal(t->n_elements, 1);
    assert_int_equal(safetensors_tensor_to_f32(t, v, 1, &err), AE_OK);
    assert_true(v[0] == 3.25f);

    t = safetensors_find(f, "empty");
    assert_int_equal(t->n_elements, 0);
    assert_int_equal(t->n_bytes, 0);
    assert_int_equal(safetensors_tensor_to_f32(t, NULL, 0, &err), AE_OK);

    int64_t ids[2];
    t = safetensors_find(f, "ids");
    assert_int_equal(safetensors_tensor_to_i64(t, ids, 2, &err), AE_OK);
    assert_true(ids[0] == INT64_MIN);
    assert_true(ids[1] == 4242424242424242LL);

    int32_t small[2];
    t = safetensors_find(f, "small");
    assert_int_equal(t->n_dims, 3);
    assert_int_equal(safetensors_tensor_to_i32(t, small, 2, &err), AE_OK);
    assert_int_equal(small[0], INT32_MIN);
    assert_int_equal(small[1], 7);
    assert_int_equal(safetensors_tensor_to_i64(t, ids, 2, &err), AE_OK); /* widened */
    assert_true(ids[0] == INT32_MIN && ids[1] == 7);

    bool mask[3];
    t = safetensors_find(f, "mask");
    assert_int_equal(safetensors_tensor_to_bool(t, mask, 3, &err), AE_OK);
    assert_true(mask[0] && !mask[1] && mask[2]);

    t = safetensors_find(f, "wide"); /* readable metadata, no converter */
    assert_int_equal(t->dtype, SAFETENSORS_F64);
    assert_int_equal(t->n_bytes, 8);
    assert_string_equal(err.msg, "");

    assert_null(safetensors_find(f, "missing"));
    assert_null(safetensors_find(f, "__metadata__"));
    safetensors_close(f);
    free(b.p);
}

static void test_metadata_is_sorted_and_found(void **state) {
    (void)state;
    bytes b = all_dtypes();
    safetensors_file *f = NULL;
    assert_int_equal(safetensors_open_mem(&f, b.p, b.n, "all.st", NULL), AE_OK);
    assert_int_equal(safetensors_metadata_count(f), 2);
    const char *k, *v;
    safetensors_metadata_at(f, 0, &k, &v);
    assert_string_equal(k, "author");
    assert_string_equal(v, "aerie");
    safetensors_metadata_at(f, 1, &k, &v);
    assert_string_equal(k, "format");
    assert_string_equal(v, "pt");
    assert_string_equal(safetensors_metadata_get(f, "format"), "pt");
    assert_null(safetensors_metadata_get(f, "nope"));
    safetensors_close(f);
    free(b.p);
}

static void test_converters_refuse_wrong_dtype_and_size(void **state) {
    (void)state;
    bytes b = all_dtypes();
    safetensors_file *f = NULL;
    ae_error err = {0};
    assert_int_equal(safetensors_open_mem(&f, b.p, b.n, "all.st", &err), AE_OK);
    float v[8];
    int64_t i64[8];
    int32_t i32[8];
    bool bl[8];

    assert_int_equal(safetensors_tensor_to_f32(safetensors_find(f, "wide"), v, 1, &err), AE_ERR);
    assert_string_equal(err.msg, "tensor \"wide\": dtype F64 cannot be converted to "
                                 "f32 (supported: F32, F16, BF16)");
    err_clear(&err);
    assert_int_equal(safetensors_tensor_to_f32(safetensors_find(f, "ids"), v, 1, &err), AE_ERR);
    assert_string_equal(err.msg, "tensor \"ids\": dtype I64 cannot be converted to "
                                 "f32 (supported: F32, F16, BF16)");
    err_clear(&err);
    assert_int_equal(safetensors_tensor_to_i64(safetensors_find(f, "full"), i64, 1, &err), AE_ERR);
    assert_string_equal(err.msg, "tensor \"full\": dtype F32 cannot be converted to "
                                 "i64 (supported: I64, I32)");
    err_clear(&err);
    assert_int_equal(safetensors_tensor_to_bool(safetensors_find(f, "small"), bl, 1, &err), AE_ERR);
    assert_string_equal(err.msg, "tensor \"small\": dtype I32 cannot be converted to "
                                 "bool (supported: BOOL)");
    err_clear(&err);
    assert_int_equal(safetensors_tensor_to_f32(safetensors_find(f, "full"), v, 4, &err), AE_ERR);
    assert_string_equal(err.msg, "tensor \"full\": 4 elements asked, 3 held");
    err_clear(&err);
    /* INT64_MIN does not fit in i32. */
    assert_int_equal(safetensors_tensor_to_i32(safetensors_find(f, "ids"), i32, 2, &err), AE_ERR);
    assert_string_equal(err.msg, "tensor \"ids\": element 0 = -9223372036854775808 "
                                 "does not fit in i32");
    /* A prefix read converts only what was asked. */
    err_clear(&err);
    assert_int_equal(safetensors_tensor_to_f32(safetensors_find(f, "full"), v, 1, &err), AE_OK);
    assert_int_equal(f32_bits(v[0]), 0x3DCCCCCD);
    safetensors_close(f);
    free(b.p);
}

static void test_bool_byte_other_than_0_or_1_is_an_error(void **state) {
    (void)state;
    const uint8_t d[2] = {1, 2};
    bytes b = make_st("{\"m\":{\"dtype\":\"BOOL\",\"shape\":[2],\"data_offsets\":[0,2]}}", d, 2);
    safetensors_file *f = NULL;
    ae_error err = {0};
    assert_int_equal(safetensors_open_mem(&f, b.p, b.n, "b.st", &err), AE_OK);
    bool out[2];
    assert_int_equal(safetensors_tensor_to_bool(safetensors_find(f, "m"), out, 2, &err), AE_ERR);
    assert_string_equal(err.msg, "tensor \"m\": element 1 is byte 2, not a bool");
    safetensors_close(f);
    free(b.p);
}

static void test_i64_fitting_in_i32_converts(void **state) {
    (void)state;
    const int64_t d[3] = {INT32_MIN, INT32_MAX, -3};
    bytes b = make_st("{\"d2t\":{\"dtype\":\"I64\",\"shape\":[3],\"data_offsets\":[0,24]}}", d, sizeof d);
    safetensors_file *f = NULL;
    assert_int_equal(safetensors_open_mem(&f, b.p, b.n, "d.st", NULL), AE_OK);
    int32_t out[3];
    assert_int_equal(safetensors_tensor_to_i32(safetensors_find(f, "d2t"), out, 3, NULL), AE_OK);
    assert_int_equal(out[0], INT32_MIN);
    assert_int_equal(out[1], INT32_MAX);
    assert_int_equal(out[2], -3);
    safetensors_close(f);
    free(b.p);
}

static void test_empty_header_and_no_data_is_valid(void **state) {
    (void)state;
    bytes b = make_st("{}", NULL, 0);
    safetensors_file *f = NULL;
    assert_int_equal(safetensors_open_mem(&f, b.p, b.n, "e.st", NULL), AE_OK);
    assert_int_equal(safetensors_count(f), 0);
    assert_int_equal(safetensors_metadata_count(f), 0);
    assert_null(safetensors_find(f, "x"));
    safetensors_close(f);
    free(b.p);
    safetensors_close(NULL);
    safetensors_model_close(NULL);
}

/* ---- corrupt files ----------------------------------------------------- */

static void test_every_truncation_fails_cleanly(void **state) {
    (void)state;
    bytes b = all_dtypes();
    for (size_t len = 0; len < b.n; len++) {
        uint8_t *exact = malloc(len ? len : 1);
        assert_non_null(exact);
        memcpy(exact, b.p, len);
        safetensors_file *f = NULL;
        ae_error err = {0};
        assert_int_equal(safetensors_open_mem(&f, exact, len, "cut.st", &err), AE_ERR);
        assert_null(f);
        assert_memory_equal(err.msg, "cut.st: ", 8);
        free(exact);
    }
    free(b.p);
}

static void test_truncation_messages_name_the_problem(void **state) {
    (void)state;
    bytes b = all_dtypes();
    safetensors_file *f = NULL;
    ae_error err = {0};
    assert_int_equal(safetensors_open_mem(&f, b.p, 5, "cut.st", &err), AE_ERR);
    assert_string_equal(err.msg, "cut.st: 5 bytes is too small for a safetensors file");
    err_clear(&err);
    assert_int_equal(safetensors_open_mem(&f, b.p, 100, "cut.st", &err), AE_ERR);
    char want[200];
    snprintf(want, sizeof want,
             "cut.st: header length %zu runs past the end of the file "
             "(100 bytes)",
             strlen(ALL_HEADER));
    assert_string_equal(err.msg, want);
    err_clear(&err);
    assert_int_equal(safetensors_open_mem(&f, b.p, b.n - 1, "cut.st", &err), AE_ERR);
    assert_string_equal(err.msg, "cut.st: tensor \"wide\": data_offsets end 65 is past "
                                 "the data section (64 bytes)");
    free(b.p);
}

static void test_header_length_limits(void **state) {
    (void)state;
    uint8_t img[16] = {0};
    /* 100 MB + 1 */
    uint64_t n = 100ull * 1024 * 1024 + 1;
    for (int i = 0; i < 8; i++) img[i] = (uint8_t)(n >> (8 * i));
    safetensors_file *f = NULL;
    ae_error err = {0};
    assert_int_equal(safetensors_open_mem(&f, img, sizeof img, "big.st", &err), AE_ERR);
    assert_string_equal(err.msg, "big.st: header length 104857601 exceeds the limit "
                                 "of 104857600");
    memset(img, 0xFF, 8); /* 2^64 - 1 */
    err_clear(&err);
    assert_int_equal(safetensors_open_mem(&f, img, sizeof img, "big.st", &err), AE_ERR);
    assert_string_equal(err.msg, "big.st: header length 18446744073709551615 exceeds "
                                 "the limit of 104857600");
}

static void test_header_must_be_a_json_object(void **state) {
    (void)state;
    assert_string_equal(reject("[1,2]", NULL, 0), "t.st: header does not start with a JSON object");
    assert_string_equal(reject("\"x\"", NULL, 0), "t.st: header does not start with a JSON object");
    assert_string_equal(reject("{\"a\":", NULL, 0), "t.st: header: not valid JSON (near byte 4)");
    assert_string_equal(reject("{} x", NULL, 0), "t.st: header: trailing data after the JSON value at byte 3");
    assert_string_equal(reject("{\"a\":1}", NULL, 0), "t.st: tensor \"a\": entry is not an object");
}

static void test_header_bytes_must_be_clean_utf8(void **state) {
    (void)state;
    assert_string_equal(reject("{\"\xC3\x28\":1}", NULL, 0), "t.st: header has invalid UTF-8 at 2");
    assert_string_equal(reject("{\"\xC0\xAF\":1}", NULL, 0), /* overlong */
                        "t.st: header has invalid UTF-8 at 2");
    assert_string_equal(reject("{\"\xED\xA0\x80\":1}", NULL, 0), /* surrogate */
                        "t.st: header has invalid UTF-8 at 2");
    assert_string_equal(reject("{\"a\\u0000b\":{\"dtype\":\"F32\",\"shape\":[],"
                               "\"data_offsets\":[0,4]}}",
                               "abcd", 4),
                        "t.st: header has a \\u0000 escape at 3");
    /* An escaped backslash followed by "u0000" is plain text. */
    safetensors_file *f = NULL;
    bytes b = make_st("{\"a\\\\u0000\":{\"dtype\":\"BOOL\",\"shape\":[],"
                      "\"data_offsets\":[0,1]}}",
                      "\1", 1);
    assert_int_equal(safetensors_open_mem(&f, b.p, b.n, "t.st", NULL), AE_OK);
    assert_non_null(safetensors_find(f, "a\\u0000"));
    safetensors_close(f);
    free(b.p);
    /* Multi-byte names are fine. */
    b = make_st("{\"\xC3\xA9t\xC3\xA9\":{\"dtype\":\"BOOL\",\"shape\":[],"
                "\"data_offsets\":[0,1]}}",
                "\0", 1);
    assert_int_equal(safetensors_open_mem(&f, b.p, b.n, "t.st", NULL), AE_OK);
    assert_non_null(safetensors_find(f, "\xC3\xA9t\xC3\xA9"));
    safetensors_close(f);
    free(b.p);
}

static void test_entry_fields_are_checked(void **state) {
    (void)state;
    char d[16] = {0};
    assert_string_equal(reject("{\"w\":{\"dtype\":\"F8_E4M3\",\"shape\":[1],"
                               "\"data_offsets\":[0,1]}}",
                               d, 1),
                        "t.st: tensor \"w\": unknown dtype \"F8_E4M3\"");
    assert_string_equal(reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}", d, 4),
                        "t.st: tensor \"w\": no data_offsets");
    assert_string_equal(reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],"
                               "\"extra\":1}}",
                               d, 4),
                        "t.st: tensor \"w\": unknown key \"extra\"");
    assert_string_equal(reject("{\"w\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],"
                               "\"data_offsets\":[0,4]}}",
                               d, 4),
                        "t.st: tensor \"w\": duplicate key \"dtype\"");
    assert_string_equal(reject("{\"w\":{\"dtype\":5,\"shape\":[1],\"data_offsets\":[0,4]}}", d, 4),
                        "t.st: tensor \"w\": dtype is not a string");
    assert_string_equal(reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[-1],"
                               "\"data_offsets\":[0,4]}}",
                               d, 4),
                        "t.st: tensor \"w\": shape[0] is not a non-negative integer");
    assert_string_equal(reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[1.5],"
                               "\"data_offsets\":[0,4]}}",
                               d, 4),
                        "t.st: tensor \"w\": shape[0] is not a non-negative integer");
    assert_string_equal(reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],"
                               "\"data_offsets\":[0,4]}}",
                               d, 4),
                        "t.st: tensor \"w\": shape rank 9 exceeds 8");
    assert_string_equal(reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],"
                               "\"data_offsets\":[0]}}",
                               d, 4),
                        "t.st: tensor \"w\": data_offsets is not [begin, end] of "
                        "non-negative integers");
    assert_string_equal(reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],"
                               "\"data_offsets\":[4,0]}}",
                               d, 4),
                        "t.st: tensor \"w\": data_offsets begin 4 > end 0");
    assert_string_equal(reject("{\"\":{}}", d, 0), "t.st: a tensor has an empty name");
}

static void test_absurd_shapes_are_rejected(void **state) {
    (void)state;
    char d[4] = {0};
    /* 2^32 * 2^32 overflows u64. */
    assert_string_equal(reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],"
                               "\"data_offsets\":[0,4]}}",
                               d, 4),
                        "t.st: tensor \"w\": shape overflows");
    /* 2^62 elements fit, their bytes do not. */
    assert_string_equal(reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[2147483648,2147483648],"
                               "\"data_offsets\":[0,4]}}",
                               d, 4),
                        "t.st: tensor \"w\": byte size overflows");
    /* Beyond what a double holds exactly. */
    assert_string_equal(reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[1e300],"
                               "\"data_offsets\":[0,4]}}",
                               d, 4),
                        "t.st: tensor \"w\": shape[0] is not a non-negative integer");
    assert_string_equal(reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[1000000],"
                               "\"data_offsets\":[0,4]}}",
                               d, 4),
                        "t.st: tensor \"w\": 4 bytes in data_offsets, but shape and F32 "
                        "need 4000000");
}

static void test_offsets_must_tile_the_data(void **state) {
    (void)state;
    char d[16] = {0};
    assert_string_equal(reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],"
                               "\"data_offsets\":[8,16]}}",
                               d, 8),
                        "t.st: tensor \"w\": data_offsets end 16 is past the data section "
                        "(8 bytes)");
    assert_string_equal(reject("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                               "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
                               d, 12),
                        "t.st: tensors \"a\" and \"b\" overlap");
    assert_string_equal(reject("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                               "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
                               d, 12),
                        "t.st: gap of 4 bytes before tensor \"b\"");
    assert_string_equal(reject("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", d, 8),
                        "t.st: gap of 4 bytes before tensor \"a\"");
    assert_string_equal(reject("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", d, 6),
                        "t.st: data section has 6 bytes, but tensors cover 4");
    assert_string_equal(reject("{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", d, 8),
                        "t.st: tensor \"a\": 8 bytes in data_offsets, but shape and F32 need "
                        "12");
    /* The same range twice is an overlap too (aliasing). */
    assert_string_equal(reject("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                               "\"b\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
                               d, 4),
                        "t.st: tensors \"a\" and \"b\" overlap");
    /* A zero-size tensor inside another's range. */
    assert_string_equal(reject("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                               "\"z\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,4]}}",
                               d, 8),
                        "t.st: tensors \"a\" and \"z\" overlap");
}

static void test_names_and_metadata_are_checked(void **state) {
    (void)state;
    char d[8] = {0};
    assert_string_equal(reject("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                               "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
                               d, 8),
                        "t.st: duplicate tensor \"a\"");
    assert_string_equal(reject("{\"__metadata__\":{\"k\":1}}", d, 0), "t.st: __metadata__ \"k\" is not a string");
    assert_string_equal(reject("{\"__metadata__\":[]}", d, 0), "t.st: __metadata__ is not an object");
    assert_string_equal(reject("{\"__metadata__\":{},\"__metadata__\":{}}", d, 0), "t.st: duplicate __metadata__");
    assert_string_equal(reject("{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", d, 0),
                        "t.st: duplicate __metadata__ key \"k\"");

    char header[2200];
    char name[SAFETENSORS_MAX_NAME + 2];
    memset(name, 'n', sizeof name - 1);
    name[sizeof name - 1] = '\0';
    snprintf(header, sizeof header,
             "{\"%s\":{\"dtype\":\"F32\",\"shape\":[1],"
             "\"data_offsets\":[0,4]}}",
             name);
    assert_string_equal(reject(header, d, 4), "t.st: tensor name of 1025 bytes exceeds 1024");
}

/* ---- files on disk ----------------------------------------------------- */

static void test_open_reports_path_and_os_error(void **state) {
    (void)state;
    char path[512];
    safetensors_file *f = NULL;
    ae_error err = {0};
    snprintf(path, sizeof path, "%s/none.safetensors", tmpdir);
    assert_int_equal(safetensors_open(&f, path, &err), AE_ERR);
    char want[600];
    snprintf(want, sizeof want, "%s: cannot open: No such file or directory", path);
    assert_string_equal(err.msg, want);

    err_clear(&err);
    assert_int_equal(safetensors_open(&f, tmpdir, &err), AE_ERR);
    snprintf(want, sizeof want, "%s: not a regular file", tmpdir);
    assert_string_equal(err.msg, want);

    write_file("empty.safetensors", "", 0);
    snprintf(path, sizeof path, "%s/empty.safetensors", tmpdir);
    err_clear(&err);
    assert_int_equal(safetensors_open(&f, path, &err), AE_ERR);
    snprintf(want, sizeof want, "%s: 0 bytes is too small for a safetensors file", path);
    assert_string_equal(err.msg, want);
    unlink(path);
}

static void test_open_maps_a_file(void **state) {
    (void)state;
    bytes b = all_dtypes();
    write_file("all.safetensors", b.p, b.n);
    free(b.p);
    char path[512];
    snprintf(path, sizeof path, "%s/all.safetensors", tmpdir);
    safetensors_file *f = NULL;
    ae_error err = {0};
    assert_int_equal(safetensors_open(&f, path, &err), AE_OK);
    assert_int_equal(safetensors_count(f), 9);
    int64_t ids[2];
    assert_int_equal(safetensors_tensor_to_i64(safetensors_find(f, "ids"), ids, 2, &err), AE_OK);
    assert_true(ids[0] == INT64_MIN && ids[1] == 4242424242424242LL);
    safetensors_close(f);
    unlink(path);
}

/* ---- checkpoint directories -------------------------------------------- */

static const char SHARD_A[] = "{\"a.w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                              "\"a.b\":{\"dtype\":\"BF16\",\"shape\":[1],\"data_offsets\":[8,10]}}";
static const char SHARD_B[] = "{\"b.w\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[0,2]}}";

static void write_shards(void) {
    const float aw[2] = {1.5f, -4.0f};
    uint8_t a[10];
    memcpy(a, aw, 8);
    const uint16_t ab = 0x4040; /* bf16 3.0 */
    memcpy(a + 8, &ab, 2);
    write_st("s-1.safetensors", SHARD_A, a, sizeof a);
    const uint16_t bw = 0xB800; /* f16 -0.5 */
    write_st("s-2.safetensors", SHARD_B, &bw, 2);
}

static const char *model_reject(const char *index) {
    static ae_error err;
    err_clear(&err);
    write_shards();
    write_text("model.safetensors.index.json", index);
    safetensors_model *m = (safetensors_model *)1;
    assert_int_equal(safetensors_model_open(&m, tmpdir, &err), AE_ERR);
    assert_null(m);
    /* Drop the directory prefix so tests read as the message's tail. */
    size_t n = strlen(tmpdir);
    assert_memory_equal(err.msg, tmpdir, n);
    return err.msg + n;
}

static void test_model_reads_sharded_checkpoint(void **state) {
    (void)state;
    write_shards();
    write_text("model.safetensors.index.json", "{\"metadata\":{\"total_size\":12},\"weight_map\":{"
                                               "\"a.w\":\"s-1.safetensors\",\"b.w\":\"s-2.safetensors\","
                                               "\"a.b\":\"s-1.safetensors\"}}");
    safetensors_model *m = NULL;
    ae_error err = {0};
    assert_int_equal(safetensors_model_open(&m, tmpdir, &err), AE_OK);
    assert_int_equal(safetensors_model_n_files(m), 2);
    assert_non_null(strstr(safetensors_path(safetensors_model_file(m, 0)), "/s-1.safetensors"));
    assert_non_null(strstr(safetensors_path(safetensors_model_file(m, 1)), "/s-2.safetensors"));
    assert_int_equal(safetensors_model_count(m), 3);
    assert_string_equal(safetensors_model_tensor_at(m, 0)->name, "a.b");
    assert_string_equal(safetensors_model_tensor_at(m, 1)->name, "a.w");
    assert_string_equal(safetensors_model_tensor_at(m, 2)->name, "b.w");
    float v[2];
    assert_int_equal(safetensors_tensor_to_f32(safetensors_model_find(m, "a.w"), v, 2, &err), AE_OK);
    assert_true(v[0] == 1.5f && v[1] == -4.0f);
    assert_int_equal(safetensors_tensor_to_f32(safetensors_model_find(m, "a.b"), v, 1, &err), AE_OK);
    assert_true(v[0] == 3.0f);
    assert_int_equal(safetensors_tensor_to_f32(safetensors_model_find(m, "b.w"), v, 1, &err), AE_OK);
    assert_true(v[0] == -0.5f);
    assert_null(safetensors_model_find(m, "c.w"));
    safetensors_model_close(m);
}

static void test_model_reads_single_file(void **state) {
    (void)state;
    const uint16_t bw = 0x3C00;
    write_st("model.safetensors", SHARD_B, &bw, 2);
    safetensors_model *m = NULL;
    ae_error err = {0};
    assert_int_equal(safetensors_model_open(&m, tmpdir, &err), AE_OK);
    assert_int_equal(safetensors_model_n_files(m), 1);
    assert_int_equal(safetensors_model_count(m), 1);
    float v;
    assert_int_equal(safetensors_tensor_to_f32(safetensors_model_find(m, "b.w"), &v, 1, &err), AE_OK);
    assert_true(v == 1.0f);
    safetensors_model_close(m);
}

static void test_model_needs_weights(void **state) {
    (void)state;
    safetensors_model *m = NULL;
    ae_error err = {0};
    assert_int_equal(safetensors_model_open(&m, tmpdir, &err), AE_ERR);
    char want[600];
    snprintf(want, sizeof want, "%s: no model.safetensors or model.safetensors.index.json", tmpdir);
    assert_string_equal(err.msg, want);
}

static void test_index_must_match_shards(void **state) {
    (void)state;
    assert_string_equal(model_reject("{\"weight_map\":{\"a.w\":\"s-1.safetensors\","
                                     "\"a.b\":\"s-1.safetensors\",\"b.w\":\"s-2.safetensors\","
                                     "\"c.w\":\"s-2.safetensors\"}}"),
                        "/model.safetensors.index.json: weight_map: tensor \"c.w\" is not "
                        "in shard \"s-2.safetensors\"");
    assert_string_equal(model_reject("{\"weight_map\":{\"a.w\":\"s-1.safetensors\","
                                     "\"a.b\":\"s-1.safetensors\",\"b.w\":\"s-3.safetensors\"}}"),
                        "/s-3.safetensors: cannot open: No such file or directory");
    assert_string_equal(model_reject("{\"weight_map\":{\"a.w\":\"s-1.safetensors\","
                                     "\"b.w\":\"s-2.safetensors\"}}"),
                        "/model.safetensors.index.json: shard \"s-1.safetensors\" holds "
                        "tensor \"a.b\" that weight_map does not list for it");
    assert_string_equal(model_reject("{\"weight_map\":{\"a.w\":\"s-1.safetensors\","
                                     "\"a.b\":\"s-1.safetensors\",\"b.w\":\"s-2.safetensors\","
                                     "\"a.w\":\"s-1.safetensors\"}}"),
                        "/model.safetensors.index.json: weight_map: duplicate tensor \"a.w\"");
    assert_string_equal(model_reject("{\"weight_map\":{\"a.w\":\"../s-1.safetensors\"}}"),
                        "/model.safetensors.index.json: weight_map: \"a.w\": shard name "
                        "\"../s-1.safetensors\" is not a plain file name");
    assert_string_equal(model_reject("{\"weight_map\":{\"a.w\":\"sub/s-1.safetensors\"}}"),
                        "/model.safetensors.index.json: weight_map: \"a.w\": shard name "
                        "\"sub/s-1.safetensors\" is not a plain file name");
    assert_string_equal(model_reject("{\"weight_map\":{\"a.w\":\"..\"}}"),
                        "/model.safetensors.index.json: weight_map: \"a.w\": shard name "
                        "\"..\" is not a plain file name");
    assert_string_equal(model_reject("{\"weight_map\":{\"a.w\":1}}"),
                        "/model.safetensors.index.json: weight_map: \"a.w\" is not a string");
    assert_string_equal(model_reject("{\"weight_map\":{}}"),
                        "/model.safetensors.index.json: weight_map is missing, not an "
                        "object, or empty");
    assert_string_equal(model_reject("{\"metadata\":1,\"weight_map\":{}}"),
                        "/model.safetensors.index.json: metadata is not an "
                        "object");
    assert_string_equal(model_reject("[]"), "/model.safetensors.index.json: not a JSON object");
}

static void test_tensor_in_two_shards_is_rejected(void **state) {
    (void)state;
    write_shards();
    /* s-3 holds b.w again, next to c.w. */
    const uint16_t d[2] = {0x3C00, 0x4000};
    write_st("s-3.safetensors",
             "{\"b.w\":{\"dtype\":\"F16\",\"shape\":[1],"
             "\"data_offsets\":[0,2]},\"c.w\":{\"dtype\":\"F16\","
             "\"shape\":[1],\"data_offsets\":[2,4]}}",
             d, sizeof d);
    write_text("model.safetensors.index.json", "{\"weight_map\":{\"a.w\":\"s-1.safetensors\","
                                               "\"a.b\":\"s-1.safetensors\",\"b.w\":\"s-2.safetensors\","
                                               "\"c.w\":\"s-3.safetensors\"}}");
    safetensors_model *m = NULL;
    ae_error err = {0};
    assert_int_equal(safetensors_model_open(&m, tmpdir, &err), AE_ERR);
    char want[600];
    snprintf(want, sizeof want,
             "%s/model.safetensors.index.json: shard \"s-3.safetensors\" "
             "holds tensor \"b.w\" that weight_map does not list for it",
             tmpdir);
    assert_string_equal(err.msg, want);
}

static void test_corrupt_shard_names_the_shard(void **state) {
    (void)state;
    write_shards();
    write_file("s-2.safetensors", "\x02\0\0\0\0\0\0\0{}", 9); /* cut */
    write_text("model.safetensors.index.json", "{\"weight_map\":{\"a.w\":\"s-1.safetensors\","
                                               "\"a.b\":\"s-1.safetensors\",\"b.w\":\"s-2.safetensors\"}}");
    safetensors_model *m = NULL;
    ae_error err = {0};
    assert_int_equal(safetensors_model_open(&m, tmpdir, &err), AE_ERR);
    char want[600];
    snprintf(want, sizeof want,
             "%s/s-2.safetensors: header length 2 runs past the end of the "
             "file (9 bytes)",
             tmpdir);
    assert_string_equal(err.msg, want);
}

/* ---- golden checkpoint from the reference implementation --------------- */

static cJSON *read_json(const char *path) {
    FILE *fp = fopen(path, "rb");
    assert_non_null(fp);
    static char buf[65536];
    size_t n = fread(buf, 1, sizeof buf - 1, fp);
    fclose(fp);
    buf[n] = '\0';
    cJSON *j = cJSON_Parse(buf);
    assert_non_null(j);
    return j;
}

static void test_golden_matches_reference(void **state) {
    (void)state;
    safetensors_model *m = NULL;
    ae_error err = {0};
    if (safetensors_model_open(&m, GOLDEN_DIR, &err) != AE_OK) fail_msg("%s", err.msg);
    cJSON *exp = read_json(GOLDEN_DIR "/expected.json");
    const cJSON *tensors = cJSON_GetObjectItem(exp, "tensors");
    assert_int_equal(safetensors_model_count(m), cJSON_GetArraySize(tensors));
    assert_int_equal(safetensors_model_n_files(m), 2);

    const cJSON *shards = cJSON_GetObjectItem(exp, "shards");
    for (size_t i = 0; i < safetensors_model_n_files(m); i++) {
        const safetensors_file *f = safetensors_model_file(m, i);
        const char *base = strrchr(safetensors_path(f), '/') + 1;
        const cJSON *s = cJSON_GetObjectItem(shards, base);
        assert_non_null(s);
        assert_int_equal(safetensors_count(f), cJSON_GetObjectItem(s, "count")->valueint);
        const cJSON *meta = cJSON_GetObjectItem(s, "metadata");
        assert_int_equal(safetensors_metadata_count(f), cJSON_GetArraySize(meta));
        const cJSON *kv;
        cJSON_ArrayForEach(kv, meta) { assert_string_equal(safetensors_metadata_get(f, kv->string), kv->valuestring); }
    }

    int checked = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, tensors) {
        const safetensors_tensor *t = safetensors_model_find(m, e->string);
        if (!t) fail_msg("tensor %s missing", e->string);
        assert_string_equal(safetensors_dtype_name(t->dtype), cJSON_GetObjectItem(e, "dtype")->valuestring);
        const cJSON *shape = cJSON_GetObjectItem(e, "shape");
        assert_int_equal(t->n_dims, cJSON_GetArraySize(shape));
        for (uint32_t d = 0; d < t->n_dims; d++)
            assert_int_equal(t->shape[d], cJSON_GetArrayItem(shape, (int)d)->valueint);
        const cJSON *vals;
        if ((vals = cJSON_GetObjectItem(e, "f32_bits"))) {
            assert_int_equal(t->n_elements, cJSON_GetArraySize(vals));
            float *out = calloc(t->n_elements + 1, sizeof *out);
            assert_int_equal(safetensors_tensor_to_f32(t, out, t->n_elements, &err), AE_OK);
            for (uint64_t k = 0; k < t->n_elements; k++)
                assert_int_equal(f32_bits(out[k]), (uint32_t)cJSON_GetArrayItem(vals, (int)k)->valuedouble);
            free(out);
        } else if ((vals = cJSON_GetObjectItem(e, "i64"))) {
            int64_t out[16];
            assert_true(t->n_elements <= 16);
            assert_int_equal(safetensors_tensor_to_i64(t, out, t->n_elements, &err), AE_OK);
            for (uint64_t k = 0; k < t->n_elements; k++) {
                char s[32];
                snprintf(s, sizeof s, "%lld", (long long)out[k]);
                assert_string_equal(s, cJSON_GetArrayItem(vals, (int)k)->valuestring);
            }
        } else if ((vals = cJSON_GetObjectItem(e, "i32"))) {
            int32_t out[16];
            assert_true(t->n_elements <= 16);
            assert_int_equal(safetensors_tensor_to_i32(t, out, t->n_elements, &err), AE_OK);
            for (uint64_t k = 0; k < t->n_elements; k++)
                assert_int_equal(out[k], (int32_t)cJSON_GetArrayItem(vals, (int)k)->valuedouble);
        } else if ((vals = cJSON_GetObjectItem(e, "bool"))) {
            bool out[16];
            assert_true(t->n_elements <= 16);
            assert_int_equal(safetensors_tensor_to_bool(t, out, t->n_elements, &err), AE_OK);
            for (uint64_t k = 0; k < t->n_elements; k++)
                assert_int_equal(out[k], cJSON_IsTrue(cJSON_GetArrayItem(vals, (int)k)));
        } else {
            fail_msg("no expected values for %s", e->string);
        }
        checked++;
    }
    assert_int_equal(checked, 9);
    /* Spot checks written out, so a broken expected.json cannot hide. */
    float v[12];
    assert_int_equal(safetensors_tensor_to_f32(safetensors_model_find(m, "lm_head.weight"), v, 8, &err), AE_OK);
    assert_true(v[0] == -2.0f && v[7] == 1.5f);
    assert_int_equal(
        safetensors_tensor_to_f32(safetensors_model_find(m, "model.layers.0.self_attn.q_proj.weight"), v, 10, &err),
        AE_OK);
    assert_true(v[3] == 65504.0f && v[5] == 0x1p-24f);
    cJSON_Delete(exp);
    safetensors_model_close(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_dtype_reads_exact_values),
        cmocka_unit_test(test_metadata_is_sorted_and_found),
        cmocka_unit_test(test_converters_refuse_wrong_dtype_and_size),
        cmocka_unit_test(test_bool_byte_other_than_0_or_1_is_an_error),
        cmocka_unit_test(test_i64_fitting_in_i32_converts),
        cmocka_unit_test(test_empty_header_and_no_data_is_valid),
        cmocka_unit_test(test_every_truncation_fails_cleanly),
        cmocka_unit_test(test_truncation_messages_name_the_problem),
        cmocka_unit_test(test_header_length_limits),
        cmocka_unit_test(test_header_must_be_a_json_object),
        cmocka_unit_test(test_header_bytes_must_be_clean_utf8),
        cmocka_unit_test(test_entry_fields_are_checked),
        cmocka_unit_test(test_absurd_shapes_are_rejected),
        cmocka_unit_test(test_offsets_must_tile_the_data),
        cmocka_unit_test(test_names_and_metadata_are_checked),
        cmocka_unit_test_setup_teardown(test_open_reports_path_and_os_error, make_tmpdir, remove_tmpdir),
        cmocka_unit_test_setup_teardown(test_open_maps_a_file, make_tmpdir, remove_tmpdir),
        cmocka_unit_test_setup_teardown(test_model_reads_sharded_checkpoint, make_tmpdir, remove_tmpdir),
        cmocka_unit_test_setup_teardown(test_model_reads_single_file, make_tmpdir, remove_tmpdir),
        cmocka_unit_test_setup_teardown(test_model_needs_weights, make_tmpdir, remove_tmpdir),
        cmocka_unit_test_setup_teardown(test_index_must_match_shards, make_tmpdir, remove_tmpdir),
        cmocka_unit_test_setup_teardown(test_tensor_in_two_shards_is_rejected, make_tmpdir, remove_tmpdir),
        cmocka_unit_test_setup_teardown(test_corrupt_shard_names_the_shard, make_tmpdir, remove_tmpdir),
        cmocka_unit_test(test_golden_matches_reference),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
