/* gguf.c: parsing, accessors, formatting, and rejection of corrupt files.
 *
 * Most tests build one small valid file with gguf_writer.h, remembering
 * where each interesting field was written, then overwrite exactly one
 * field and check the error names it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "../../services/model/gguf.h"
#include "gguf_writer.h"

#define MODEL_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define NAME "small.gguf"

/* ---- the small file ------------------------------------------------------ */

typedef struct small_opts {
    uint32_t version;      /* 0: 3 */
    uint32_t alignment;    /* 0: no general.alignment key */
    bool alignment_as_u64; /* write general.alignment with the wrong type */
    bool duplicate_key;    /* write test.u8 twice */
} small_opts;

/* Where fields of the small file were written, for patching. */
typedef struct marks {
    size_t n_kv_at, arch_len_at, u8_type_at, bool_at, arr_type_at, arr_count_at;
    size_t key0_len_at, tensor_a_name_at, tensor_b_name_at, tensor_b_dims_at;
    size_t tensor_c_ndims_at, tensor_c_dim0_at, tensor_c_type_at, tensor_c_offset_at;
    size_t data_at;
    uint64_t off_a, off_b, off_c;
} marks;

static const char LONG_STR[] = "0123456789abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ-0123456789";

enum { N_KV_BASE = 19 };

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

static void build_small(gw *w, small_opts o, marks *m) {
    uint32_t align = o.alignment && !o.alignment_as_u64 ? o.alignment : 32;
    if (align == 0 || (align & (align - 1))) align = 32; /* for laying out only */
    uint64_t n_kv = N_KV_BASE + (o.alignment ? 1 : 0) + (o.duplicate_key ? 1 : 0);
    memset(m, 0, sizeof *m);
    gw_header(w, o.version ? o.version : 3, 3, n_kv);
    m->n_kv_at = 16;

    m->key0_len_at = w->len;
    gw_key(w, "general.architecture", 8);
    m->arch_len_at = w->len;
    gw_str(w, "llama");
    gw_key(w, "test.u8", 0);
    m->u8_type_at = w->len - 4;
    gw_u8(w, 200);
    gw_key(w, "test.i8", 1);
    gw_u8(w, (uint8_t)(int8_t)-100);
    gw_key(w, "test.u16", 2);
    gw_u16(w, 60000);
    gw_key(w, "test.i16", 3);
    gw_u16(w, (uint16_t)(int16_t)-30000);
    gw_kv_u32(w, "test.u32", 4000000000u);
    gw_key(w, "test.i32", 5);
    gw_u32(w, (uint32_t)(int32_t)-2000000000);
    gw_key(w, "test.f32", 6);
    gw_f32(w, 1.5f);
    gw_key(w, "test.bool", 7);
    m->bool_at = w->len;
    gw_u8(w, 1);
    gw_key(w, "test.u64", 10);
    gw_u64(w, (1ull << 40) + 7);
    gw_key(w, "test.i64", 11);
    gw_u64(w, (uint64_t)-(int64_t)(1ll << 40));
    gw_key(w, "test.f64", 12);
    gw_f64(w, 0.1);
    gw_arr(w, "test.arr_u32", 4, 3);
    m->arr_type_at = w->len - 12;
    m->arr_count_at = w->len - 8;
    for (uint32_t i = 1; i <= 3; i++) gw_u32(w, i);
    gw_arr(w, "test.arr_str", 8, 3);
    gw_str(w, "a");
    gw_str(w, "");
    gw_str(w, "h\xc3\xa9llo");
    gw_arr(w, "test.arr_f32", 6, 2);
    gw_f32(w, 0.5f);
    gw_f32(w, -2.0f);
    gw_arr(w, "test.nested", 9, 2); /* [[7, 8], ["x"]] */
    gw_u32(w, 0);
    gw_u64(w, 2);
    gw_u8(w, 7);
    gw_u8(w, 8);
    gw_u32(w, 8);
    gw_u64(w, 1);
    gw_str(w, "x");
    gw_arr(w, "test.long_arr", 5, 10);
    for (int i = 0; i < 10; i++) gw_u32(w, (uint32_t)(i * 10));
    gw_kv_str(w, "test.quote", "say \"hi\"\n\tand\\ \x01");
    gw_kv_str(w, "test.long_str", LONG_STR);
    if (o.duplicate_key) {
        gw_key(w, "test.u8", 0);
        gw_u8(w, 1);
    }
    if (o.alignment) {
        if (o.alignment_as_u64) {
            gw_key(w, "general.alignment", 10);
            gw_u64(w, o.alignment);
        } else {
            gw_kv_u32(w, "general.alignment", o.alignment);
        }
    }

    /* Tensors: a F32 [4], b F16 [2, 3], c Q8_0 [32, 2]. */
    m->off_a = 0;
    m->off_b = align_up(16, align);
    m->off_c = align_up(m->off_b + 12, align);
    m->tensor_a_name_at = w->len;
    gw_tensor(w, "a", 1, (uint64_t[]){4}, 0, m->off_a);
    m->tensor_b_name_at = w->len;
    m->tensor_b_dims_at = w->len + 8 + 1 + 4;
    gw_tensor(w, "b", 2, (uint64_t[]){2, 3}, 1, m->off_b);
    m->tensor_c_ndims_at = w->len + 8 + 1;
    m->tensor_c_dim0_at = m->tensor_c_ndims_at + 4;
    m->tensor_c_type_at = m->tensor_c_dim0_at + 16;
    m->tensor_c_offset_at = m->tensor_c_type_at + 4;
    gw_tensor(w, "c", 2, (uint64_t[]){32, 2}, 8, m->off_c);

    gw_pad(w, align);
    m->data_at = w->len;
    for (int i = 1; i <= 4; i++) gw_f32(w, (float)i);
    gw_pad(w, align);
    static const uint16_t halves[6] = {0x3c00, 0x4000, 0x4200, 0x4400, 0x4500, 0x4600};
    for (int i = 0; i < 6; i++) gw_u16(w, halves[i]); /* 1 .. 6 */
    gw_pad(w, align);
    for (int blk = 0; blk < 2; blk++) {
        gw_u16(w, blk ? 0xbc00 : 0x3800); /* d = 0.5, then -1 */
        for (int j = 0; j < 32; j++) gw_u8(w, (uint8_t)(j - 16));
    }
    /* No padding after the last tensor: every shorter prefix is truncated. */
}

static gguf_file *open_ok(const gw *w) {
    ae_error err = {0};
    gguf_file *f = NULL;
    if (gguf_open_mem(&f, w->p, w->len, NAME, &err) != AE_OK) fail_msg("open failed: %s", err.msg);
    assert_non_null(f);
    assert_false(err_is_set(&err));
    return f;
}

/* Opens a copy of exactly the file's bytes (so ASan sees any overread),
 * expects failure and a message "small.gguf: ...<want>...". */
static void expect_error_n(const gw *w, size_t len, const char *want) {
    uint8_t *copy = malloc(len ? len : 1);
    assert_non_null(copy);
    memcpy(copy, w->p, len);
    ae_error err = {0};
    static int sentinel;
    gguf_file *f = (gguf_file *)(void *)&sentinel; /* must be overwritten with NULL */
    int rc = gguf_open_mem(&f, copy, len, NAME, &err);
    if (rc != AE_ERR) fail_msg("opened %zu bytes, expected an error with \"%s\"", len, want);
    assert_null(f);
    if (strncmp(err.msg, NAME ": ", strlen(NAME) + 2) != 0) fail_msg("message lacks the file name: \"%s\"", err.msg);
    if (!strstr(err.msg, want)) fail_msg("message \"%s\" lacks \"%s\"", err.msg, want);
    free(copy);
}

static void expect_error(const gw *w, const char *want) { expect_error_n(w, w->len, want); }

/* Builds the default small file, patches one field, expects `want`. */
static void expect_patched(size_t marks_offset, size_t delta, uint64_t v, int n, const char *want) {
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){0}, &m);
    size_t at;
    memcpy(&at, (const char *)&m + marks_offset, sizeof at);
    at += delta;
    gw_patch(&w, at, v, n);
    expect_error(&w, want);
    gw_free(&w);
}

#define PATCH(field, v, n, want) expect_patched(offsetof(marks, field), 0, (v), (n), (want))
#define PATCH_AT(field, delta, v, n, want) expect_patched(offsetof(marks, field), (delta), (v), (n), (want))

/* ---- parsing valid files ------------------------------------------------- */

static void v3_header_and_counts(void **state) {
    (void)state;
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){0}, &m);
    gguf_file *f = open_ok(&w);
    assert_int_equal(gguf_version(f), 3);
    assert_int_equal(gguf_n_kv(f), N_KV_BASE);
    assert_int_equal(gguf_n_tensors(f), 3);
    assert_int_equal(gguf_alignment(f), 32); /* default */
    assert_int_equal(gguf_file_size(f), w.len);
    assert_int_equal(gguf_data_offset(f), m.data_at);
    assert_string_equal(gguf_path(f), NAME);
    gguf_close(f);
    gw_free(&w);
}

static void v2_parses_like_v3(void **state) {
    (void)state;
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){.version = 2}, &m);
    gguf_file *f = open_ok(&w);
    assert_int_equal(gguf_version(f), 2);
    assert_int_equal(gguf_n_kv(f), N_KV_BASE);
    assert_int_equal(gguf_n_tensors(f), 3);
    gguf_close(f);
    gw_free(&w);
}

static void every_scalar_type_round_trips(void **state) {
    (void)state;
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){0}, &m);
    gguf_file *f = open_ok(&w);
    ae_error err = {0};
    uint32_t u32;
    uint64_t u64;
    int64_t i64;
    float f32;
    double f64;
    bool b;
    gguf_str s;
    assert_int_equal(gguf_get_u32(f, "test.u8", &u32, &err), AE_OK);
    assert_int_equal(u32, 200);
    assert_int_equal(gguf_get_i64(f, "test.i8", &i64, &err), AE_OK);
    assert_int_equal(i64, -100);
    assert_int_equal(gguf_get_u32(f, "test.u16", &u32, &err), AE_OK);
    assert_int_equal(u32, 60000);
    assert_int_equal(gguf_get_i64(f, "test.i16", &i64, &err), AE_OK);
    assert_int_equal(i64, -30000);
    assert_int_equal(gguf_get_u32(f, "test.u32", &u32, &err), AE_OK);
    assert_int_equal(u32, 4000000000u);
    assert_int_equal(gguf_get_i64(f, "test.i32", &i64, &err), AE_OK);
    assert_int_equal(i64, -2000000000);
    assert_int_equal(gguf_get_f32(f, "test.f32", &f32, &err), AE_OK);
    assert_true(f32 == 1.5f);
    assert_int_equal(gguf_get_bool(f, "test.bool", &b, &err), AE_OK);
    assert_true(b);
    assert_int_equal(gguf_get_u64(f, "test.u64", &u64, &err), AE_OK);
    assert_int_equal(u64, (1ull << 40) + 7);
    assert_int_equal(gguf_get_i64(f, "test.i64", &i64, &err), AE_OK);
    assert_int_equal(i64, -(1ll << 40));
    assert_int_equal(gguf_get_f64(f, "test.f64", &f64, &err), AE_OK);
    assert_true(f64 == 0.1);
    assert_int_equal(gguf_get_str(f, "general.architecture", &s, &err), AE_OK);
    assert_int_equal(s.len, 5);
    assert_memory_equal(s.ptr, "llama", 5);
    assert_true(gguf_str_eq(s, "llama"));
    assert_false(gguf_str_eq(s, "llam"));
    assert_false(err_is_set(&err));

    static const gguf_vtype types[] = {GGUF_VT_STRING, GGUF_VT_U8,  GGUF_VT_I8,  GGUF_VT_U16,
                                       GGUF_VT_I16,    GGUF_VT_U32, GGUF_VT_I32, GGUF_VT_F32,
                                       GGUF_VT_BOOL,   GGUF_VT_U64, GGUF_VT_I64, GGUF_VT_F64};
    for (uint64_t i = 0; i < sizeof types / sizeof types[0]; i++) assert_int_equal(gguf_kv_type(f, i), types[i]);
    gguf_str k = gguf_kv_key(f, 1);
    assert_true(gguf_str_eq(k, "test.u8"));
    gguf_close(f);
    gw_free(&w);
}

static void integer_getters_convert_only_when_the_value_fits(void **state) {
    (void)state;
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){0}, &m);
    gguf_file *f = open_ok(&w);
    ae_error err = {0};
    uint32_t u32 = 77;
    uint64_t u64;
    int64_t i64;
    assert_int_equal(gguf_get_u32(f, "test.i8", &u32, &err), AE_ERR);
    assert_string_equal(err.msg, "key test.i8: value -100 out of range");
    assert_int_equal(u32, 77); /* untouched on failure */
    err_clear(&err);
    assert_int_equal(gguf_get_u32(f, "test.u64", &u32, &err), AE_ERR);
    assert_string_equal(err.msg, "key test.u64: value 1099511627783 out of range");
    err_clear(&err);
    assert_int_equal(gguf_get_u64(f, "test.i64", &u64, &err), AE_ERR);
    err_clear(&err);
    assert_int_equal(gguf_get_i64(f, "test.u32", &i64, &err), AE_OK);
    assert_int_equal(i64, 4000000000ll);
    assert_int_equal(gguf_get_u64(f, "test.u8", &u64, &err), AE_OK);
    assert_int_equal(u64, 200);
    assert_int_equal(gguf_get_u32(f, "general.architecture", &u32, &err), AE_ERR);
    assert_string_equal(err.msg, "key general.architecture: has type string, expected an integer");
    err_clear(&err);
    assert_int_equal(gguf_get_u32(f, "no.such.key", &u32, &err), AE_ERR);
    assert_string_equal(err.msg, "key no.such.key: absent");
    err_clear(&err);
    assert_int_equal(gguf_get_u32(f, "test.f32", &u32, &err), AE_ERR); /* no float -> int */
    assert_int_equal(gguf_get_i64(f, "test.bool", &i64, &err), AE_ERR);
    gguf_close(f);
    gw_free(&w);
}

static void float_bool_and_string_getters_check_type(void **state) {
    (void)state;
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){0}, &m);
    gguf_file *f = open_ok(&w);
    ae_error err = {0};
    float f32;
    double f64;
    bool b;
    gguf_str s;
    assert_int_equal(gguf_get_f64(f, "test.f32", &f64, &err), AE_OK);
    assert_true(f64 == 1.5);
    assert_int_equal(gguf_get_f32(f, "test.f64", &f32, &err), AE_OK);
    assert_true(f32 == 0.1f);
    assert_int_equal(gguf_get_f32(f, "test.u32", &f32, &err), AE_ERR);
    assert_string_equal(err.msg, "key test.u32: has type u32, expected f32 or f64");
    err_clear(&err);
    assert_int_equal(gguf_get_bool(f, "test.u8", &b, &err), AE_ERR);
    assert_string_equal(err.msg, "key test.u8: has type u8, expected bool");
    err_clear(&err);
    assert_int_equal(gguf_get_str(f, "test.arr_str", &s, &err), AE_ERR);
    assert_string_equal(err.msg, "key test.arr_str: has type array, expected string");
    /* A NULL error sink is allowed. */
    assert_int_equal(gguf_get_str(f, "absent", &s, NULL), AE_ERR);
    gguf_close(f);
    gw_free(&w);
}

static void arrays_read_by_element(void **state) {
    (void)state;
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){0}, &m);
    gguf_file *f = open_ok(&w);
    int64_t iu = gguf_find_key(f, "test.arr_u32");
    int64_t is = gguf_find_key(f, "test.arr_str");
    int64_t ifl = gguf_find_key(f, "test.arr_f32");
    assert_true(iu >= 0 && is >= 0 && ifl >= 0);
    assert_int_equal(gguf_kv_type(f, (uint64_t)iu), GGUF_VT_ARRAY);
    assert_int_equal(gguf_arr_type(f, (uint64_t)iu), GGUF_VT_U32);
    assert_int_equal(gguf_arr_len(f, (uint64_t)iu), 3);
    int64_t v;
    for (uint64_t j = 0; j < 3; j++) {
        assert_int_equal(gguf_arr_i64(f, (uint64_t)iu, j, &v), AE_OK);
        assert_int_equal(v, (int64_t)j + 1);
    }
    assert_int_equal(gguf_arr_i64(f, (uint64_t)iu, 3, &v), AE_ERR); /* past the end */
    double d;
    assert_int_equal(gguf_arr_f64(f, (uint64_t)iu, 0, &d), AE_ERR); /* wrong type */
    gguf_str s;
    assert_int_equal(gguf_arr_str(f, (uint64_t)iu, 0, &s), AE_ERR);

    assert_int_equal(gguf_arr_type(f, (uint64_t)is), GGUF_VT_STRING);
    assert_int_equal(gguf_arr_len(f, (uint64_t)is), 3);
    assert_int_equal(gguf_arr_str(f, (uint64_t)is, 0, &s), AE_OK);
    assert_true(gguf_str_eq(s, "a"));
    assert_int_equal(gguf_arr_str(f, (uint64_t)is, 1, &s), AE_OK);
    assert_int_equal(s.len, 0);
    assert_int_equal(gguf_arr_str(f, (uint64_t)is, 2, &s), AE_OK);
    assert_true(gguf_str_eq(s, "h\xc3\xa9llo"));
    assert_int_equal(gguf_arr_str(f, (uint64_t)is, 3, &s), AE_ERR);
    assert_int_equal(gguf_arr_i64(f, (uint64_t)is, 0, &v), AE_ERR);

    assert_int_equal(gguf_arr_f64(f, (uint64_t)ifl, 0, &d), AE_OK);
    assert_true(d == 0.5);
    assert_int_equal(gguf_arr_f64(f, (uint64_t)ifl, 1, &d), AE_OK);
    assert_true(d == -2.0);

    /* Scalars are not arrays; out-of-range key indexes are refused. */
    int64_t iscalar = gguf_find_key(f, "test.u8");
    assert_int_equal(gguf_arr_type(f, (uint64_t)iscalar), GGUF_VT_COUNT);
    assert_int_equal(gguf_arr_len(f, (uint64_t)iscalar), 0);
    assert_int_equal(gguf_arr_i64(f, (uint64_t)iscalar, 0, &v), AE_ERR);
    assert_int_equal(gguf_arr_i64(f, 1000, 0, &v), AE_ERR);
    assert_int_equal(gguf_arr_str(f, 1000, 0, &s), AE_ERR);
    gguf_close(f);
    gw_free(&w);
}

static void nested_arrays_are_validated_and_skipped(void **state) {
    (void)state;
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){0}, &m);
    gguf_file *f = open_ok(&w);
    int64_t i = gguf_find_key(f, "test.nested");
    assert_true(i >= 0);
    assert_int_equal(gguf_arr_type(f, (uint64_t)i), GGUF_VT_ARRAY);
    assert_int_equal(gguf_arr_len(f, (uint64_t)i), 2);
    int64_t v;
    gguf_str s;
    assert_int_equal(gguf_arr_i64(f, (uint64_t)i, 0, &v), AE_ERR);
    assert_int_equal(gguf_arr_str(f, (uint64_t)i, 0, &s), AE_ERR);
    /* The key after the nested array was found where it should be. */
    assert_true(gguf_find_key(f, "test.long_arr") == i + 1);
    gguf_close(f);
    gw_free(&w);
}

static void tensor_infos_and_data(void **state) {
    (void)state;
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){0}, &m);
    gguf_file *f = open_ok(&w);
    const gguf_tensor *a = gguf_tensor_at(f, 0);
    const gguf_tensor *b = gguf_tensor_at(f, 1);
    const gguf_tensor *c = gguf_tensor_at(f, 2);
    assert_null(gguf_tensor_at(f, 3));
    assert_string_equal(a->name, "a");
    assert_int_equal(a->n_dims, 1);
    assert_int_equal(a->ne[0], 4);
    assert_int_equal(a->ne[1], 1);
    assert_int_equal(a->ne[3], 1);
    assert_int_equal(a->type, GGML_TYPE_F32);
    assert_int_equal(a->n_elements, 4);
    assert_int_equal(a->n_bytes, 16);
    assert_ptr_equal(a->data, w.p + m.data_at);
    float x[4];
    memcpy(x, a->data, sizeof x);
    for (int i = 0; i < 4; i++) assert_true(x[i] == (float)(i + 1));

    assert_int_equal(b->n_dims, 2);
    assert_int_equal(b->ne[0], 2);
    assert_int_equal(b->ne[1], 3);
    assert_int_equal(b->type, GGML_TYPE_F16);
    assert_int_equal(b->n_bytes, 12);
    assert_int_equal(b->offset, 32);
    assert_ptr_equal(b->data, w.p + m.data_at + 32);
    float y[64];
    assert_true(quant_dequantize(b->type, b->data, y, b->n_elements));
    for (int i = 0; i < 6; i++) assert_true(y[i] == (float)(i + 1));

    assert_int_equal(c->type, GGML_TYPE_Q8_0);
    assert_int_equal(c->n_elements, 64);
    assert_int_equal(c->n_bytes, 68);
    assert_int_equal(c->offset, 64);
    assert_true(quant_dequantize(c->type, c->data, y, 64));
    assert_true(y[0] == -8.0f);  /* 0.5 * -16 */
    assert_true(y[31] == 7.5f);  /* 0.5 * 15 */
    assert_true(y[32] == 16.0f); /* -1 * -16 */

    assert_ptr_equal(gguf_find_tensor(f, "c"), c);
    assert_ptr_equal(gguf_find_tensor(f, "a"), a);
    assert_null(gguf_find_tensor(f, "d"));
    assert_null(gguf_find_tensor(f, ""));
    assert_int_equal(gguf_find_key(f, "general.architecture"), 0);
    assert_int_equal(gguf_find_key(f, "general"), -1);
    gguf_close(f);
    gw_free(&w);
}

static void alignment_64_is_honoured(void **state) {
    (void)state;
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){.alignment = 64}, &m);
    gguf_file *f = open_ok(&w);
    assert_int_equal(gguf_alignment(f), 64);
    assert_int_equal(gguf_data_offset(f) % 64, 0);
    assert_int_equal(gguf_data_offset(f), m.data_at);
    assert_int_equal(gguf_tensor_at(f, 1)->offset, 64);
    assert_int_equal(gguf_tensor_at(f, 2)->offset, 128);
    assert_ptr_equal(gguf_tensor_at(f, 2)->data, w.p + m.data_at + 128);
    float y[64];
    assert_true(quant_dequantize(GGML_TYPE_Q8_0, gguf_tensor_at(f, 2)->data, y, 64));
    assert_true(y[63] == -15.0f);
    gguf_close(f);
    gw_free(&w);

    /* With alignment 64, an offset of 32 is misaligned. */
    build_small(&w, (small_opts){.alignment = 64}, &m);
    gw_patch(&w, m.tensor_c_offset_at, 32, 8);
    expect_error(&w, "tensor 2 'c' offset 32 is not a multiple of the alignment 64");
    gw_free(&w);
}

static void many_keys_are_all_found(void **state) {
    (void)state;
    enum { N = 1000 };
    gw w = {0};
    gw_header(&w, 3, 0, N);
    char key[32];
    for (uint32_t i = 0; i < N; i++) {
        snprintf(key, sizeof key, "k.%u", i);
        gw_kv_u32(&w, key, i * 3);
    }
    gguf_file *f = open_ok(&w);
    for (uint32_t i = 0; i < N; i++) {
        snprintf(key, sizeof key, "k.%u", i);
        uint32_t v;
        assert_int_equal(gguf_find_key(f, key), i);
        assert_int_equal(gguf_get_u32(f, key, &v, NULL), AE_OK);
        assert_int_equal(v, i * 3);
    }
    assert_int_equal(gguf_find_key(f, "k.1000"), -1);
    assert_int_equal(gguf_n_tensors(f), 0);
    gguf_close(f);
    gw_free(&w);
}

static void empty_file_sections_are_valid(void **state) {
    (void)state;
    gw w = {0};
    gw_header(&w, 3, 0, 0);
    gguf_file *f = open_ok(&w);
    assert_int_equal(gguf_n_kv(f), 0);
    assert_int_equal(gguf_n_tensors(f), 0);
    assert_int_equal(gguf_find_key(f, "x"), -1);
    assert_null(gguf_find_tensor(f, "x"));
    gguf_close(f);
    gw_free(&w);
}

/* ---- formatting ---------------------------------------------------------- */

static void format_kv(gguf_file *f, const char *key, char *buf, size_t n) {
    int64_t i = gguf_find_key(f, key);
    if (i < 0) fail_msg("no key %s", key);
    gguf_kv_format(f, (uint64_t)i, buf, n);
}

static void kv_format_renders_each_kind(void **state) {
    (void)state;
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){0}, &m);
    gguf_file *f = open_ok(&w);
    char buf[256];
    static const struct {
        const char *key, *want;
    } cases[] = {
        {"general.architecture", "\"llama\""},
        {"test.u8", "200"},
        {"test.i8", "-100"},
        {"test.u16", "60000"},
        {"test.i16", "-30000"},
        {"test.u32", "4000000000"},
        {"test.i32", "-2000000000"},
        {"test.f32", "1.5"},
        {"test.bool", "true"},
        {"test.u64", "1099511627783"},
        {"test.i64", "-1099511627776"},
        {"test.f64", "0.1"},
        {"test.arr_u32", "[1, 2, 3]"},
        {"test.arr_str", "[\"a\", \"\", \"h\xc3\xa9llo\"]"},
        {"test.arr_f32", "[0.5, -2]"},
        {"test.nested", "[array x 2]"},
        {"test.long_arr", "[i32 x 10]"},
        {"test.quote", "\"say \\\"hi\\\"\\n\\tand\\\\ \\x01\""},
        {"test.long_str", "\"0123456789abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQR\"... (83 bytes)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        format_kv(f, cases[i].key, buf, sizeof buf);
        if (strcmp(buf, cases[i].want) != 0) fail_msg("%s: got [%s], want [%s]", cases[i].key, buf, cases[i].want);
    }
    gguf_close(f);
    gw_free(&w);
}

static void kv_format_truncates_to_the_buffer(void **state) {
    (void)state;
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){0}, &m);
    gguf_file *f = open_ok(&w);
    char buf[16];
    memset(buf, 'X', sizeof buf);
    format_kv(f, "general.architecture", buf, 8);
    assert_string_equal(buf, "\"llama\"");
    memset(buf, 'X', sizeof buf);
    format_kv(f, "general.architecture", buf, 5);
    assert_string_equal(buf, "\"lla");
    assert_int_equal(buf[5], 'X'); /* nothing written past n */
    format_kv(f, "test.arr_u32", buf, 4);
    assert_string_equal(buf, "[1,");
    format_kv(f, "test.u32", buf, 1);
    assert_string_equal(buf, "");
    buf[0] = 'X';
    format_kv(f, "test.u32", buf, 0);
    assert_int_equal(buf[0], 'X');
    gguf_close(f);
    gw_free(&w);
}

/* ---- corrupt files --------------------------------------------------------- */

static void every_truncation_fails_cleanly(void **state) {
    (void)state;
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){.alignment = 64}, &m);
    for (size_t len = 0; len < w.len; len++) expect_error_n(&w, len, "truncated");
    gguf_close(open_ok(&w)); /* and the whole file still opens */
    gw_free(&w);
}

static void truncation_messages_name_the_field(void **state) {
    (void)state;
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){0}, &m);
    expect_error_n(&w, 2, "truncated: 2 bytes is too short for a GGUF header");
    expect_error_n(&w, 6, "truncated: header version runs past end of file");
    expect_error_n(&w, 20, "truncated: header kv count runs past end of file");
    expect_error_n(&w, 100, "truncated: 19 kvs and 3 tensor infos cannot fit in the 76 bytes left");
    expect_error_n(&w, m.tensor_c_offset_at + 3, "truncated: tensor info 2 'c' offset runs past end of file");
    expect_error_n(&w, m.data_at + 20, "truncated: tensor 1 'b' data (offset 32, 12 bytes, data section at");
    gw_free(&w);
}

static void bad_magic_is_rejected(void **state) {
    (void)state;
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){0}, &m);
    w.p[3] = 'X';
    expect_error(&w, "not a GGUF file (magic 47 47 55 58, expected 'GGUF')");
    gw_free(&w);
}

static void unsupported_versions_are_rejected(void **state) {
    (void)state;
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){.version = 1}, &m);
    expect_error(&w, "GGUF version 1 is not supported (only versions 2 and 3)");
    gw_free(&w);
    build_small(&w, (small_opts){.version = 4}, &m);
    expect_error(&w, "unsupported GGUF version 4 (only versions 2 and 3)");
    gw_free(&w);
    build_small(&w, (small_opts){.version = 0x03000000}, &m);
    expect_error(&w, "big-endian GGUF (version 3) is not supported");
    gw_free(&w);
}

static void absurd_counts_are_rejected_before_allocation(void **state) {
    (void)state;
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){0}, &m);
    gw_patch(&w, 8, 1ull << 40, 8);
    expect_error(&w, "tensor count 1099511627776 exceeds the limit 65536");
    gw_patch(&w, 8, 60000, 8); /* under the limit, but cannot fit */
    expect_error(&w, "truncated: 19 kvs and 60000 tensor infos cannot fit");
    gw_patch(&w, 8, 3, 8);
    gw_patch(&w, m.n_kv_at, UINT64_MAX, 8);
    expect_error(&w, "kv count 18446744073709551615 exceeds the limit 65536");
    gw_free(&w);

    PATCH(arr_count_at, 1ull << 40, 8, "kv 12 'test.arr_u32' array count 1099511627776 exceeds the limit 67108864");
    PATCH(arr_count_at, 1000000, 8, "truncated: kv 12 'test.arr_u32' array count 1000000 of u32 runs past end of file");
}

static void string_lengths_are_checked(void **state) {
    (void)state;
    PATCH(arch_len_at, 9999999, 8,
          "truncated: kv 0 'general.architecture' string length 9999999 runs past end of file");
    PATCH(arch_len_at, UINT64_MAX, 8, "string length 18446744073709551615 runs past end of file");
    PATCH(key0_len_at, 9999999, 8, "truncated: kv 0 key length 9999999 runs past end of file");
    PATCH(tensor_a_name_at, 9999999, 8, "truncated: tensor info 0 name length 9999999 runs past end of file (size ");
    PATCH(key0_len_at, 0, 8, "kv 0 has an empty key");

    /* Over the name limit while still inside the file. */
    gw w = {0};
    char key[300];
    memset(key, 'k', sizeof key - 1);
    key[sizeof key - 1] = '\0';
    gw_header(&w, 3, 0, 1);
    gw_kv_u32(&w, key, 1);
    expect_error(&w, "kv 0 key length 299 exceeds the limit 256");
    gw_free(&w);

    /* A key with a NUL byte could not be looked up by name. */
    gw_header(&w, 3, 0, 1);
    gw_strn(&w, "a\0b", 3);
    gw_u32(&w, 4);
    gw_u32(&w, 1);
    expect_error(&w, "kv 0 key contains a NUL byte");
    gw_free(&w);

    /* Control bytes in a name never reach the one-line error text. */
    gw_header(&w, 3, 0, 1);
    gw_str(&w, "evil\n\x1b[2J");
    gw_u32(&w, 99);
    expect_error(&w, "kv 0 'evil??[2J' has unknown value type 99");
    gw_free(&w);
}

static void unknown_value_types_are_rejected(void **state) {
    (void)state;
    PATCH(u8_type_at, 13, 4, "kv 1 'test.u8' has unknown value type 13");
    PATCH(u8_type_at, 0xffffffffu, 4, "kv 1 'test.u8' has unknown value type 4294967295");
    PATCH(arr_type_at, 13, 4, "kv 12 'test.arr_u32' has unknown array element type 13");
    PATCH(bool_at, 2, 1, "kv 8 'test.bool' has bool value 2 (must be 0 or 1)");
}

static void bad_tensor_infos_are_rejected(void **state) {
    (void)state;
    PATCH(tensor_c_ndims_at, 5, 4, "tensor info 2 'c' has n_dims 5 (must be 1..4)");
    PATCH(tensor_c_ndims_at, 0, 4, "tensor info 2 'c' has n_dims 0 (must be 1..4)");
    PATCH(tensor_c_dim0_at, 0, 8, "tensor info 2 'c' dimension 0 is 0");
    PATCH(tensor_c_dim0_at, 33, 8, "tensor info 2 'c' dimension 0 (33) is not a multiple of the Q8_0 block size 32");
    PATCH(tensor_c_type_at, 99, 4, "tensor info 2 'c' has unknown tensor type 99");
    PATCH(tensor_c_type_at, 4, 4, "tensor info 2 'c' has unknown tensor type 4");
    PATCH(tensor_c_offset_at, 65, 8, "tensor 2 'c' offset 65 is not a multiple of the alignment 32");
    PATCH(tensor_c_offset_at, 1ull << 20, 8, "tensor 2 'c' data (offset 1048576, 68 bytes, data section at");
    PATCH(tensor_c_offset_at, UINT64_MAX - 31, 8, "runs past end of file");
    PATCH_AT(tensor_b_name_at, 8, 'a', 1, "tensor info 1 'a': duplicate tensor name (also tensor info 0)");

    /* Element count overflow: 2^40 * 2^30 elements. */
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){0}, &m);
    gw_patch(&w, m.tensor_b_dims_at, 1ull << 40, 8);
    gw_patch(&w, m.tensor_b_dims_at + 8, 1ull << 30, 8);
    expect_error(&w, "tensor info 1 'b' element count overflows (dimension 1 is 1073741824)");
    /* 2^62 elements of F16 fit in the counters but not in the file. */
    gw_patch(&w, m.tensor_b_dims_at, 1ull << 31, 8);
    gw_patch(&w, m.tensor_b_dims_at + 8, 1ull << 31, 8);
    expect_error(&w, "tensor 1 'b' data (offset 32, 9223372036854775808 bytes");
    gw_free(&w);
}

static void bad_alignment_is_rejected(void **state) {
    (void)state;
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){.alignment = 48}, &m);
    expect_error(&w, "general.alignment 48 is not a power of two");
    gw_free(&w);
    build_small(&w, (small_opts){.alignment = 64, .alignment_as_u64 = true}, &m);
    expect_error(&w, "general.alignment has type u64 (must be u32)");
    gw_free(&w);
}

static void duplicate_keys_are_rejected(void **state) {
    (void)state;
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){.duplicate_key = true}, &m);
    expect_error(&w, "kv 19 'test.u8': duplicate key (also kv 1)");
    gw_free(&w);
}

static void deeply_nested_arrays_are_rejected(void **state) {
    (void)state;
    gw w = {0};
    gw_header(&w, 3, 0, 1);
    gw_arr(&w, "deep", 9, 1);
    for (int d = 0; d < 20; d++) {
        gw_u32(&w, 9);
        gw_u64(&w, 1);
    }
    gw_u32(&w, 0);
    gw_u64(&w, 0);
    expect_error(&w, "kv 0 'deep' element 0 nests arrays deeper than 8");
    gw_free(&w);
}

static void string_array_element_errors_name_the_element(void **state) {
    (void)state;
    gw w = {0};
    gw_header(&w, 3, 0, 1);
    gw_arr(&w, "tokens", 8, 3);
    gw_str(&w, "ok");
    gw_str(&w, "fine");
    gw_u64(&w, 1000); /* element 2 claims 1000 bytes */
    gw_bytes(&w, "short", 5);
    expect_error(&w, "truncated: kv 0 'tokens' element 2 string length 1000 runs past end of file");
    gw_free(&w);
}

/* ---- files on disk --------------------------------------------------------- */

static void opens_a_file_on_disk(void **state) {
    (void)state;
    gw w = {0};
    marks m;
    build_small(&w, (small_opts){.alignment = 64}, &m);
    char path[] = "/tmp/aerie_test_gguf_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, w.p, w.len), (ssize_t)w.len);
    close(fd);
    ae_error err = {0};
    gguf_file *f;
    assert_int_equal(gguf_open(&f, path, &err), AE_OK);
    assert_string_equal(gguf_path(f), path);
    assert_int_equal(gguf_alignment(f), 64);
    const gguf_tensor *a = gguf_find_tensor(f, "a");
    assert_non_null(a);
    float x;
    memcpy(&x, (const uint8_t *)a->data + 12, 4);
    assert_true(x == 4.0f);
    gguf_close(f);

    /* Corrupt on disk: the message starts with the path. */
    assert_int_equal(truncate(path, (off_t)(w.len - 1)), 0);
    assert_int_equal(gguf_open(&f, path, &err), AE_ERR);
    assert_null(f);
    assert_int_equal(strncmp(err.msg, path, strlen(path)), 0);
    assert_non_null(strstr(err.msg, ": truncated: tensor 2 'c' data"));
    err_clear(&err);
    assert_int_equal(truncate(path, 0), 0);
    assert_int_equal(gguf_open(&f, path, &err), AE_ERR);
    assert_non_null(strstr(err.msg, "truncated: 0 bytes is too short"));
    unlink(path);
    gw_free(&w);
}

static void missing_files_and_directories_fail(void **state) {
    (void)state;
    ae_error err = {0};
    gguf_file *f;
    assert_int_equal(gguf_open(&f, "/nonexistent/x.gguf", &err), AE_ERR);
    assert_null(f);
    assert_string_equal(err.msg, "/nonexistent/x.gguf: cannot open: No such file or directory");
    err_clear(&err);
    assert_int_equal(gguf_open(&f, "/tmp", &err), AE_ERR);
    assert_string_equal(err.msg, "/tmp: not a regular file");
    gguf_close(NULL); /* no-op */
}

/* The fuzz seeds are written by the gguf Python package's GGUFWriter, an
 * independent writer (tools/gen_fuzz_seeds.py). */
static gguf_file *open_seed(const char *name) {
    char path[256];
    snprintf(path, sizeof path, "tests/fuzz/corpus/gguf/%s", name);
    ae_error err = {0};
    gguf_file *f;
    if (gguf_open(&f, path, &err)) fail_msg("%s", err.msg);
    return f;
}

static void files_from_the_python_writer_parse(void **state) {
    (void)state;
    gguf_file *f = open_seed("values_v3.gguf");
    assert_int_equal(gguf_version(f), 3);
    assert_int_equal(gguf_n_tensors(f), 2);
    char buf[128];
    static const struct {
        const char *key, *want;
    } cases[] = {
        {"general.architecture", "\"llama\""},
        {"t.i16", "-300"},
        {"t.f64", "0.1"},
        {"t.str", "\"hello \\\"gguf\\\"\\n\""},
        {"t.arr_i32", "[1, -2, 3]"},
        {"t.arr_str", "[\"a\", \"\", \"bc\"]"},
        {"t.nested", "[array x 2]"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        format_kv(f, cases[i].key, buf, sizeof buf);
        if (strcmp(buf, cases[i].want) != 0) fail_msg("%s: got [%s], want [%s]", cases[i].key, buf, cases[i].want);
    }
    const gguf_tensor *b = gguf_find_tensor(f, "b");
    assert_non_null(b);
    assert_int_equal(b->type, GGML_TYPE_F16);
    assert_int_equal(b->ne[0], 3); /* numpy shape (2, 3): innermost first */
    assert_int_equal(b->ne[1], 2);
    float y[6];
    assert_true(quant_dequantize(b->type, b->data, y, 6));
    assert_true(y[5] == 5.0f);
    gguf_close(f);

    f = open_seed("values_v2.gguf");
    assert_int_equal(gguf_version(f), 2);
    gguf_close(f);

    f = open_seed("quants_align64.gguf");
    assert_int_equal(gguf_alignment(f), 64);
    assert_int_equal(gguf_n_tensors(f), 11);
    const gguf_tensor *q = gguf_find_tensor(f, "w.Q6_K");
    assert_non_null(q);
    assert_int_equal(q->ne[0], 256);
    assert_int_equal(q->n_bytes, 210);
    assert_int_equal(q->offset % 64, 0);
    gguf_close(f);
}

/* ---- the default model ------------------------------------------------------ */

static void reads_the_default_model(void **state) {
    (void)state;
    if (access(MODEL_PATH, R_OK) != 0)
        fail_msg("%s is missing: run `make model` (the test runner fetches it)", MODEL_PATH);
    ae_error err = {0};
    gguf_file *f;
    if (gguf_open(&f, MODEL_PATH, &err)) fail_msg("%s", err.msg);
    assert_int_equal(gguf_version(f), 3);
    assert_int_equal(gguf_n_kv(f), 33);
    assert_int_equal(gguf_n_tensors(f), 272);
    assert_int_equal(gguf_alignment(f), 32);
    assert_int_equal(gguf_data_offset(f) % 32, 0);

    int n_q4_1 = 0, n_f32 = 0, n_q8_0 = 0;
    for (uint64_t i = 0; i < gguf_n_tensors(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        n_q4_1 += t->type == GGML_TYPE_Q4_1;
        n_f32 += t->type == GGML_TYPE_F32;
        n_q8_0 += t->type == GGML_TYPE_Q8_0;
        assert_ptr_equal(gguf_find_tensor(f, t->name), t);
    }
    assert_int_equal(n_q4_1, 210);
    assert_int_equal(n_f32, 61);
    assert_int_equal(n_q8_0, 1);

    const gguf_tensor *emb = gguf_find_tensor(f, "token_embd.weight");
    assert_non_null(emb);
    assert_int_equal(emb->type, GGML_TYPE_Q8_0);
    assert_int_equal(emb->n_dims, 2);
    assert_int_equal(emb->ne[0], 576);
    assert_int_equal(emb->ne[1], 49152);
    assert_int_equal(emb->n_bytes, 49152ull * 612);

    gguf_str s;
    assert_int_equal(gguf_get_str(f, "general.architecture", &s, &err), AE_OK);
    assert_true(gguf_str_eq(s, "llama"));
    uint32_t u;
    assert_int_equal(gguf_get_u32(f, "llama.embedding_length", &u, &err), AE_OK);
    assert_int_equal(u, 576);
    assert_int_equal(gguf_get_u32(f, "llama.block_count", &u, &err), AE_OK);
    assert_int_equal(u, 30);
    float fb;
    assert_int_equal(gguf_get_f32(f, "llama.rope.freq_base", &fb, &err), AE_OK);
    assert_true(fb == 100000.0f);

    int64_t ie = gguf_find_key(f, "llama.attention.layer_norm_rms_epsilon");
    assert_true(ie >= 0);
    char eps[32];
    gguf_kv_format(f, (uint64_t)ie, eps, sizeof eps);
    assert_string_equal(eps, "1e-05");

    int64_t it = gguf_find_key(f, "tokenizer.ggml.tokens");
    assert_true(it >= 0);
    assert_int_equal(gguf_arr_len(f, (uint64_t)it), 49152);
    assert_int_equal(gguf_arr_str(f, (uint64_t)it, 0, &s), AE_OK);
    assert_true(gguf_str_eq(s, "<|endoftext|>"));
    assert_int_equal(gguf_arr_str(f, (uint64_t)it, 49151, &s), AE_OK);
    assert_true(gguf_str_eq(s, "ectable"));
    char buf[128];
    gguf_kv_format(f, (uint64_t)it, buf, sizeof buf);
    assert_string_equal(buf, "[string x 49152]");
    int64_t im = gguf_find_key(f, "tokenizer.ggml.merges");
    assert_int_equal(gguf_arr_len(f, (uint64_t)im), 48900);
    assert_int_equal(gguf_arr_str(f, (uint64_t)im, 0, &s), AE_OK);
    assert_true(gguf_str_eq(s, "\xc4\xa0 t"));
    assert_false(err_is_set(&err));
    gguf_close(f);
}

static void chdir_to_repo_root(void) {
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return;
    exe[n] = '\0';
    for (int up = 0; up < 4; up++) { /* build/asan/tests/test_gguf */
        char *slash = strrchr(exe, '/');
        if (!slash) return;
        *slash = '\0';
    }
    if (chdir(exe) != 0) return;
}

int main(void) {
    chdir_to_repo_root();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(v3_header_and_counts),
        cmocka_unit_test(v2_parses_like_v3),
        cmocka_unit_test(every_scalar_type_round_trips),
        cmocka_unit_test(integer_getters_convert_only_when_the_value_fits),
        cmocka_unit_test(float_bool_and_string_getters_check_type),
        cmocka_unit_test(arrays_read_by_element),
        cmocka_unit_test(nested_arrays_are_validated_and_skipped),
        cmocka_unit_test(tensor_infos_and_data),
        cmocka_unit_test(alignment_64_is_honoured),
        cmocka_unit_test(many_keys_are_all_found),
        cmocka_unit_test(empty_file_sections_are_valid),
        cmocka_unit_test(kv_format_renders_each_kind),
        cmocka_unit_test(kv_format_truncates_to_the_buffer),
        cmocka_unit_test(every_truncation_fails_cleanly),
        cmocka_unit_test(truncation_messages_name_the_field),
        cmocka_unit_test(bad_magic_is_rejected),
        cmocka_unit_test(unsupported_versions_are_rejected),
        cmocka_unit_test(absurd_counts_are_rejected_before_allocation),
        cmocka_unit_test(string_lengths_are_checked),
        cmocka_unit_test(unknown_value_types_are_rejected),
        cmocka_unit_test(bad_tensor_infos_are_rejected),
        cmocka_unit_test(bad_alignment_is_rejected),
        cmocka_unit_test(duplicate_keys_are_rejected),
        cmocka_unit_test(deeply_nested_arrays_are_rejected),
        cmocka_unit_test(string_array_element_errors_name_the_element),
        cmocka_unit_test(opens_a_file_on_disk),
        cmocka_unit_test(missing_files_and_directories_fail),
        cmocka_unit_test(files_from_the_python_writer_parse),
        cmocka_unit_test(reads_the_default_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
