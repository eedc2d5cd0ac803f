/* Lossless greedy speculation on the default model (SmolLM2-135M Q4_1)
 * with a random EAGLE-3 head shaped for it (written by
 * tools/gen_eagle_fixture.py --default-head; `make test` makes it): 12
 * prompts (lengths 1 to 80), three tree shapes, 16 tokens each,
 * token-identical to plain greedy decoding (48 prompts took 9 of CI's 90
 * minutes, 24 prompts 4.4). A random head is almost never right, so this pins the
 * verification of real-size trees (wide and deep, 8 and 32 nodes) and the
 * commit of the root; the tiny fixture's tests cover accepted paths. Both
 * activation precisions (kernels.h) are run: each is lossless on its own.
 * Run from the repo root. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../../draft/draft_link.h"
#include "../spec_run.h"

#define MODEL_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define HEAD_DIR "build/heads/smollm2-random"
#define N_PROMPTS 12
#define MAX_PROMPT 80
#define N_GEN 16
#define SEQ_LEN 256
#define CHUNK 64

/* Prompt i: 1..MAX_PROMPT random ids. */
static int32_t prompt(int i, int32_t vocab, int32_t *ids) { return spec_test_prompt(i, vocab, MAX_PROMPT, 13, ids); }

static void check_lossless(int32_t act_bits) {
    ae_error err = {0};
    model *m;
    engine *e;
    draft_link link;
    if (model_load(&m, MODEL_PATH, &kn_backend_cpu, &err) != AE_OK) fail_msg("%s (run `make model`)", err.msg);
    engine_config ec = {CHUNK, 1, SEQ_LEN, SEQ_LEN, 16, 2, act_bits};
    assert_int_equal(engine_init(&e, m, &ec, &err), AE_OK);
    drafter_config dc = {1, SEQ_LEN, CHUNK, 2, engine_pool(e), act_bits};
    if (draft_link_open(&link, HEAD_DIR, model_embedding(m), EAGLE_WEIGHTS_FILE, &dc, &err) != AE_OK)
        fail_msg("%s (run `make test`)", err.msg);
    int32_t V = m->cfg.vocab, ids[MAX_PROMPT], got[N_GEN];
    static int32_t want[N_PROMPTS][N_GEN];
    for (int i = 0; i < N_PROMPTS; i++) run_plain_greedy(e, ids, prompt(i, V, ids), CHUNK, N_GEN, want[i]);
    const spec_shape shapes[3] = {{4, 1, 5}, {4, 3, 8}, {8, 4, 32}};
    const char *names[3] = {"chain 4x1/5", "wide 4x3/8", "deep 8x4/32"};
    const sample_params greedy = {0, 0, 1, 0};
    for (int k = 0; k < 3; k++) {
        spec_config sc = spec_config_default(shapes[k], 1, CHUNK);
        spec *s;
        assert_int_equal(draft_link_capture(&link, sc.capture, &err), AE_OK);
        assert_int_equal(spec_init(&s, e, &link.iface, &sc, &err), AE_OK);
        int identical = 0;
        for (int i = 0; i < N_PROMPTS; i++) {
            run_spec(s, e, ids, prompt(i, V, ids), CHUNK, &greedy, 0, N_GEN, got);
            if (memcmp(got, want[i], sizeof got) == 0)
                identical++;
            else
                fprintf(stderr, "%s: prompt %d differs\n", names[k], i);
        }
        const spec_stats *st = spec_total_stats(s);
        printf("%d-bit %s: %d/%d prompts identical; %lld verify steps, %lld drafted, %lld accepted\n", act_bits,
               names[k], identical, N_PROMPTS, (long long)st->steps, (long long)st->drafted, (long long)st->accepted);
        assert_int_equal(identical, N_PROMPTS);
        assert_int_equal(st->bad_trees, 0);
        assert_true(st->steps >= N_PROMPTS * N_GEN / 2);
        spec_free(s);
    }
    draft_link_close(&link);
    engine_free(e);
    model_free(m);
}

static void test_greedy_speculation_is_lossless_on_the_default_model(void **state) {
    (void)state;
    check_lossless(15);
}

static void test_greedy_speculation_is_lossless_at_8bit_activations(void **state) {
    (void)state;
    check_lossless(8);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_speculation_is_lossless_on_the_default_model),
        cmocka_unit_test(test_greedy_speculation_is_lossless_at_8bit_activations),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
