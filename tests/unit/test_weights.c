/* services/model/weights.h on safetensors written by the test: BF16
 * matrices kept as the file has them, and compressed-tensors int4 read as
 * Q4_0 blocks bit for bit, or as f32 where a scale is not an f16. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "../../services/model/quant.h"
#include "../../services/model/weights.h"
#include "gguf_writer.h"

typedef struct blob {
    const char *name, *dtype;
    int64_t rows, cols; /* cols 0: a vector of rows */
    const void *data;
    size_t bytes;
} blob;

/* dir/model.safetensors holding the blobs, in order. */
static void write_st(const char *dir, const blob *b, int n) {
    char header[4096] = "{", path[256];
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        size_t len = strlen(header);
        if (b[i].cols)
            snprintf(header + len, sizeof header - len,
                     "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[%lld,%lld],"
                     "\"data_offsets\":[%zu,%zu]}",
                     i ? "," : "", b[i].name, b[i].dtype, (long long)b[i].rows, (long long)b[i].cols, at,
                     at + b[i].bytes);
        else
            snprintf(header + len, sizeof header - len,
                     "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[%lld],"
                     "\"data_offsets\":[%zu,%zu]}",
                     i ? "," : "", b[i].name, b[i].dtype, (long long)b[i].rows, at, at + b[i].bytes);
        at += b[i].bytes;
    }
    strcat(header, "}");
    while (strlen(header) % 8) strcat(header, " ");
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    uint64_t hl = strlen(header);
    fwrite(&hl, 8, 1, f);
    fwrite(header, 1, hl, f);
    for (int i = 0; i < n; i++) fwrite(b[i].data, 1, b[i].bytes, f);
    fclose(f);
}

static void remove_dir(const char *dir) {
    char path[256];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    unlink(path);
    rmdir(dir);
}

static void bf16_matrices_stay_bf16(void **state) {
    (void)state;
    char dir[] = "/tmp/aerie-weights-XXXXXX";
    assert_non_null(mkdtemp(dir));
    uint16_t m[2 * 4] = {0x3f80, 0xbf80, 0x4000, 0x0000, 0x3f00, 0x4040, 0xc000, 0x3e80}; /* 1 -1 2 0 .5 3 -2 .25 */
    blob b[] = {{"m", "BF16", 2, 4, m, sizeof m}};
    write_st(dir, b, 1);
    weights_store *w;
    ae_error err = {0};
    assert_int_equal(weights_open(&w, dir, &kn_backend_cpu, &err), AE_OK);
    kn_weight k;
    assert_int_equal(weights_matrix(w, "m", 2, 4, &k, &err), AE_OK);
    assert_int_equal(k.type, GGML_TYPE_BF16);
    assert_int_equal(k.row_bytes, 8);
    assert_memory_equal(k.data, m, sizeof m);
    assert_int_equal(w->bytes, sizeof m);
    assert_int_equal(w->converted_bytes, 0);
    float row[4];
    weights_row_f32(&k, 1, row);
    assert_true(row[0] == 0.5f && row[1] == 3.0f && row[2] == -2.0f && row[3] == 0.25f);
    weights_close(w);
    remove_dir(dir);
}

/* Nibble j of the test row: no two of a group's halves alike, so a
 * swapped half or nibble order shows. */
#define NIB(j) ((5 * (j) + 3 + (j) / 16) % 16)

/* One row of 64 columns: two groups. Value j of the row is NIB(j) - 8,
 * packed as compressed-tensors does (value + 8 at bits 4 (j % 8) of word
 * j / 8); the scales are 0.5 and 0.25 (bf16), or 65536 in the second
 * group, past f16's largest (65504). */
static void int4_groups(bool odd_scale, int32_t packed[8], uint16_t scale[2]) {
    memset(packed, 0, 8 * sizeof *packed);
    for (int j = 0; j < 64; j++) {
        uint32_t stored = (uint32_t)NIB(j); /* q + 8 */
        packed[j / 8] = (int32_t)((uint32_t)packed[j / 8] | stored << (4 * (j % 8)));
    }
    scale[0] = 0x3f00;                      /* 0.5 */
    scale[1] = odd_scale ? 0x4780 : 0x3e80; /* 65536 or 0.25 */
}

static void int4_reads_as_q4_0_or_f32(void **state) {
    (void)state;
    for (int odd = 0; odd < 2; odd++) {
        char dir[] = "/tmp/aerie-weights-XXXXXX";
        assert_non_null(mkdtemp(dir));
        int32_t packed[8];
        uint16_t scale[2];
        int64_t shape[2] = {1, 64};
        int4_groups(odd, packed, scale);
        blob b[] = {{"e.weight_packed", "I32", 1, 8, packed, sizeof packed},
                    {"e.weight_scale", "BF16", 1, 2, scale, sizeof scale},
                    {"e.weight_shape", "I64", 2, 0, shape, sizeof shape}};
        write_st(dir, b, 3);
        weights_store *w;
        ae_error err = {0};
        assert_int_equal(weights_open(&w, dir, &kn_backend_cpu, &err), AE_OK);
        assert_true(weights_has_int4(w, "e"));
        assert_false(weights_has_int4(w, "f"));
        kn_weight k;
        assert_int_equal(weights_int4_matrix(w, "e", 1, 64, &k, &err), AE_OK);
        assert_int_equal(k.type, odd ? GGML_TYPE_F32 : GGML_TYPE_Q4_0);
        if (!odd) { /* block 0: f16 0.5, then qs[j] = nibble j | nibble j + 16 << 4 */
            const uint8_t *blk = k.data;
            assert_int_equal(blk[0] | blk[1] << 8, 0x3800);
            for (int j = 0; j < 16; j++) assert_int_equal(blk[2 + j], NIB(j) | NIB(j + 16) << 4);
        }
        float row[64];
        weights_row_f32(&k, 0, row);
        for (int j = 0; j < 64; j++) {
            float s = j < 32 ? 0.5f : odd ? 65536.0f : 0.25f;
            assert_true(row[j] == s * (float)(NIB(j) - 8));
        }
        assert_int_equal(weights_int4_matrix(w, "e", 2, 64, &k, &err), AE_ERR);
        assert_string_equal(err.msg, "tensor e.weight_packed: expected int32 [2, 8]");
        weights_close(w);
        remove_dir(dir);
    }
}

/* A GGUF file of one Q8_0 matrix [256][1024] (whole pages of rows: 34 x
 * 32 = 1088 B a row) whose rows are picked, reversed, into a copy the
 * weights own; packing the copy must leave every byte of it (dropping
 * pages is for the mapped file's). Every row is the file's row. */
static void picked_rows_survive_packing(void **state) {
    (void)state;
    enum { ROWS = 256, COLS = 1024, RB = COLS / 32 * 34 };
    static uint8_t data[ROWS * RB];
    for (size_t i = 0; i < sizeof data; i++) data[i] = (uint8_t)(i * 2654435761u >> 13);
    for (int r = 0; r < ROWS; r++) /* sane f16 scales: 2^-7 */
        for (int b = 0; b < COLS / 32; b++) data[r * RB + b * 34] = 0x00, data[r * RB + b * 34 + 1] = 0x20;
    gw g = {0};
    gw_header(&g, 3, 1, 1);
    gw_kv_u32(&g, "general.alignment", 32);
    gw_tensor(&g, "m", 2, (uint64_t[]){COLS, ROWS}, GGML_TYPE_Q8_0, 0);
    gw_pad(&g, 32);
    gw_bytes(&g, data, sizeof data);
    char path[] = "/tmp/aerie-weights-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, g.p, g.len), (ssize_t)g.len);
    close(fd);
    gw_free(&g);
    weights_store *w;
    ae_error err = {0};
    if (weights_open(&w, path, &kn_backend_cpu, &err) != AE_OK) fail_msg("%s", err.msg);
    kn_weight m, picked;
    int64_t rows[ROWS];
    for (int i = 0; i < ROWS; i++) rows[i] = ROWS - 1 - i;
    assert_int_equal(weights_matrix(w, "m", ROWS, COLS, &m, &err), AE_OK);
    assert_int_equal(weights_pick_rows(w, &m, ROWS, rows, &picked, &err), AE_OK);
    assert_int_equal(weights_pack(w, &picked, &err), AE_OK);
    assert_int_equal(weights_pack(w, &m, &err), AE_OK);
    for (int i = 0; i < ROWS; i++)
        assert_memory_equal((const uint8_t *)picked.data + (size_t)i * RB, data + (size_t)(ROWS - 1 - i) * RB, RB);
    weights_close(w);
    unlink(path);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(bf16_matrices_stay_bf16),
        cmocka_unit_test(int4_reads_as_q4_0_or_f32),
        cmocka_unit_test(picked_rows_survive_packing),
    };
    return cmocka_run_group_tests_name("weights", tests, NULL, NULL);
}
