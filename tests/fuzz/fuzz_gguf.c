/* libFuzzer target for the GGUF reader: gguf_open_mem must reject or accept
 * any input without a crash, leak or sanitizer report, and everything it
 * accepts must be readable through every accessor. A file it accepts then
 * goes through its architecture's reader of the hyperparameters
 * (model_config_gguf: llama, qwen2, deepseek2), whose result must hold
 * what the loader relies on (config_check.h). Seeds:
 * tests/fuzz/corpus/gguf (tools/gen_fuzz_seeds.py). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "../../services/model/gguf.h"
#include "../../target/model.h"
#include "config_check.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Volatile sink so the reads below are not optimised away. */
static volatile uint64_t sink;

static void touch_kv(const gguf_file *f, uint64_t i) {
    gguf_str key = gguf_kv_key(f, i);
    if (key.len) sink += (uint8_t)key.ptr[key.len - 1];

    /* Look the key up by name: keys hold no NUL, so it must be found at i
     * (duplicates are rejected). */
    char name[GGUF_MAX_NAME + 1];
    memcpy(name, key.ptr, key.len);
    name[key.len] = '\0';
    if (gguf_find_key(f, name) != (int64_t)i) __builtin_trap();

    ae_error err = {0};
    uint64_t u;
    int64_t s;
    double d;
    float x;
    bool b;
    gguf_str str;
    if (gguf_get_u64(f, name, &u, &err) == AE_OK) sink += u;
    if (gguf_get_i64(f, name, &s, &err) == AE_OK) sink += (uint64_t)s;
    if (gguf_get_f64(f, name, &d, &err) == AE_OK) sink += d == d;
    if (gguf_get_f32(f, name, &x, &err) == AE_OK) sink += x == x;
    if (gguf_get_bool(f, name, &b, &err) == AE_OK) sink += b;
    if (gguf_get_str(f, name, &str, &err) == AE_OK && str.len) sink += (uint8_t)str.ptr[str.len - 1];

    char buf[160];
    gguf_kv_format(f, i, buf, sizeof buf);
    if (strlen(buf) >= sizeof buf) __builtin_trap();
    gguf_kv_format(f, i, buf, 3);

    if (gguf_kv_type(f, i) != GGUF_VT_ARRAY) return;
    uint64_t n = gguf_arr_len(f, i);
    /* First and last few elements: enough to hit every offset path. */
    for (uint64_t j = 0; j < n; j = (j < 4 || j + 4 >= n) ? j + 1 : n - 4) {
        if (gguf_arr_str(f, i, j, &str) == AE_OK && str.len) sink += (uint8_t)str.ptr[0];
        if (gguf_arr_i64(f, i, j, &s) == AE_OK) sink += (uint64_t)s;
        if (gguf_arr_f64(f, i, j, &d) == AE_OK) sink += d == d;
    }
    if (gguf_arr_str(f, i, n, &str) == AE_OK) __builtin_trap();
}

static void touch_tensor(const gguf_file *f, const gguf_tensor *t) {
    if (gguf_find_tensor(f, t->name) != t) __builtin_trap();
    const uint8_t *p = t->data;
    if (t->n_bytes) sink += p[0] + p[t->n_bytes - 1];
    if (!quant_can_dequantize(t->type)) return;
    /* One block (or up to 256 plain elements) through the dequantizer. */
    uint64_t n = quant_block_elems(t->type);
    if (n == 1) n = t->n_elements < 256 ? t->n_elements : 256;
    float out[256];
    if (n > t->n_elements || !quant_dequantize(t->type, t->data, out, n)) __builtin_trap();
    sink += out[0] == out[0];
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    gguf_file *f = NULL;
    ae_error err = {0};
    if (gguf_open_mem(&f, data, size, "fuzz.gguf", &err) != AE_OK) {
        if (f || !err_is_set(&err)) __builtin_trap();
        return 0;
    }
    sink += gguf_version(f) + gguf_alignment(f) + gguf_file_size(f) + gguf_data_offset(f);
    for (uint64_t i = 0; i < gguf_n_kv(f); i++) touch_kv(f, i);
    for (uint64_t i = 0; i < gguf_n_tensors(f); i++) touch_tensor(f, gguf_tensor_at(f, i));
    model_config c;
    const arch *a = NULL;
    err_clear(&err);
    if (model_config_gguf(&c, &a, f, &err) == AE_OK)
        check_model_config(&c, a);
    else if (!err_is_set(&err))
        __builtin_trap();
    gguf_close(f);
    return 0;
}
