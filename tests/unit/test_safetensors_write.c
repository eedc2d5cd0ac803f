/* safetensors_write: what it writes reads back exactly through safetensors_open (every
 * dtype the pipeline writes, metadata, an empty tensor), data offsets stay
 * 8-byte aligned, and a write that fails leaves neither the file nor its
 * temporary behind. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "../../services/model/quant.h"
#include "../../services/model/safetensors.h"
#include "../../services/model/safetensors_write.h"
#include "../test_io.h"

static void temp_path(char *buf, size_t cap, const char *name) {
    snprintf(buf, cap, "build/test-tmp-%d-%s", (int)getpid(), name);
}

static void test_written_tensors_read_back_exactly(void **state) {
    (void)state;
    char path[256];
    temp_path(path, sizeof path, "a.safetensors");
    int32_t ids[5] = {7, -1, 0, 49151, 2};
    uint16_t h[6];
    float f[6] = {0.5f, -2.0f, 0.125f, 65504.0f, 0.0f, -0.0f};
    for (int i = 0; i < 6; i++) h[i] = quant_f32_to_f16(f[i]);
    int64_t d2t[3] = {5, 9, -3};
    uint8_t mask[3] = {1, 0, 1};
    safetensors_out t[] = {
        {"input_ids", SAFETENSORS_I32, 1, {5}, ids}, {"hidden", SAFETENSORS_F16, 2, {2, 3}, h},
        {"logits", SAFETENSORS_F32, 2, {3, 2}, f},   {"d2t", SAFETENSORS_I64, 1, {3}, d2t},
        {"t2d", SAFETENSORS_BOOL, 1, {3}, mask},     {"empty", SAFETENSORS_F32, 2, {0, 4}, NULL},
    };
    const char *meta[] = {"format", "aerie-features-1", "capture_layers", "2,15,27"};
    ae_error err = {0};
    assert_int_equal(safetensors_write(path, t, 6, meta, 2, &err), AE_OK);
    char tmp[300];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    assert_int_not_equal(access(tmp, F_OK), 0);

    size_t len;
    char *raw = test_read_file(path, &len);
    uint64_t hl = 0;
    for (int i = 0; i < 8; i++) hl |= (uint64_t)(uint8_t)raw[i] << (8 * i);
    assert_int_equal(hl % 8, 0);
    assert_int_equal(len, 8 + hl + sizeof ids + sizeof h + sizeof f + sizeof d2t + sizeof mask);
    free(raw);

    safetensors_file *sf;
    if (safetensors_open(&sf, path, &err) != AE_OK) fail_msg("%s", err.msg);
    assert_int_equal(safetensors_count(sf), 6);
    assert_string_equal(safetensors_metadata_get(sf, "format"), "aerie-features-1");
    assert_string_equal(safetensors_metadata_get(sf, "capture_layers"), "2,15,27");
    int32_t ids_back[5];
    const safetensors_tensor *x = safetensors_find(sf, "input_ids");
    assert_non_null(x);
    assert_int_equal(safetensors_tensor_to_i32(x, ids_back, 5, &err), AE_OK);
    assert_memory_equal(ids_back, ids, sizeof ids);
    x = safetensors_find(sf, "hidden");
    assert_true(x->dtype == SAFETENSORS_F16 && x->n_dims == 2 && x->shape[0] == 2 && x->shape[1] == 3);
    float back[6];
    assert_int_equal(safetensors_tensor_to_f32(x, back, 6, &err), AE_OK);
    assert_memory_equal(back, f, sizeof f); /* each value is exact in f16 */
    x = safetensors_find(sf, "logits");
    assert_int_equal(safetensors_tensor_to_f32(x, back, 6, &err), AE_OK);
    assert_memory_equal(back, f, sizeof f);
    int64_t d2t_back[3];
    assert_int_equal(safetensors_tensor_to_i64(safetensors_find(sf, "d2t"), d2t_back, 3, &err), AE_OK);
    assert_memory_equal(d2t_back, d2t, sizeof d2t);
    bool mask_back[3];
    assert_int_equal(safetensors_tensor_to_bool(safetensors_find(sf, "t2d"), mask_back, 3, &err), AE_OK);
    assert_true(mask_back[0] && !mask_back[1] && mask_back[2]);
    x = safetensors_find(sf, "empty");
    assert_true(x->n_elements == 0 && x->shape[1] == 4);
    safetensors_close(sf);
    unlink(path);
}

static void test_a_failed_write_leaves_nothing(void **state) {
    (void)state;
    float f[2] = {1, 2};
    safetensors_out t = {"x", SAFETENSORS_F32, 1, {2}, f};
    ae_error err = {0};
    assert_int_equal(safetensors_write("build/no-such-dir/x.safetensors", &t, 1, NULL, 0, &err), AE_ERR);
    assert_non_null(strstr(err.msg, "build/no-such-dir/x.safetensors.tmp"));
    assert_non_null(strstr(err.msg, "No such file or directory"));
    assert_int_not_equal(access("build/no-such-dir", F_OK), 0);
    /* A rank the format cannot hold is refused before anything is written. */
    char path[256];
    temp_path(path, sizeof path, "b.safetensors");
    safetensors_out bad = {"y", SAFETENSORS_F32, SAFETENSORS_MAX_DIMS + 1, {2}, f};
    err = (ae_error){0};
    assert_int_equal(safetensors_write(path, &bad, 1, NULL, 0, &err), AE_ERR);
    assert_string_equal(err.msg, "tensor y: bad dtype or rank");
    assert_int_not_equal(access(path, F_OK), 0);
}

static void test_rewriting_replaces_the_whole_file(void **state) {
    (void)state;
    char path[256];
    temp_path(path, sizeof path, "c.safetensors");
    float big[64] = {0}, small[1] = {3};
    safetensors_out a = {"a", SAFETENSORS_F32, 1, {64}, big}, b = {"b", SAFETENSORS_F32, 1, {1}, small};
    ae_error err = {0};
    assert_int_equal(safetensors_write(path, &a, 1, NULL, 0, &err), AE_OK);
    assert_int_equal(safetensors_write(path, &b, 1, NULL, 0, &err), AE_OK);
    safetensors_file *sf;
    if (safetensors_open(&sf, path, &err) != AE_OK) fail_msg("%s", err.msg);
    assert_int_equal(safetensors_count(sf), 1);
    assert_null(safetensors_find(sf, "a"));
    float v;
    assert_int_equal(safetensors_tensor_to_f32(safetensors_find(sf, "b"), &v, 1, &err), AE_OK);
    assert_true(v == 3.0f);
    safetensors_close(sf);
    unlink(path);
}

int main(void) {
    mkdir("build", 0755);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_written_tensors_read_back_exactly),
        cmocka_unit_test(test_a_failed_write_leaves_nothing),
        cmocka_unit_test(test_rewriting_replaces_the_whole_file),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
