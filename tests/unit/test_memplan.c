/* Memory plan: exact arithmetic, the auto fraction, infeasible plans that
 * name what would work, and provenance of every setting. The model is
 * SmolLM2-135M's shape with 100 MiB of weights: workspace 221.25 KiB and
 * KV 22.5 KiB per token (f16). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <math.h>

#include "../../services/core/log.h"
#include "../../target/memplan.h"

#define GiB (1024ull * 1024 * 1024)

static const config_option opts[] = {MEMPLAN_OPTIONS};
#define N_OPTS (sizeof opts / sizeof opts[0])

static const memplan_model smol = {
    .weight_bytes = 100ull << 20,
    .n_layers = 30,
    .hidden = 576,
    .ffn = 1536,
    .n_heads = 9,
    .n_kv_heads = 3,
    .head_dim = 64,
    .vocab = 49152,
    .kv_bytes_per_token = 2 * 30 * 3 * 64 * 2, /* Llama's: f16 K and V of 30 layers x 3 kv heads x 64 */
    /* Llama's (test_arch checks it on the model): 4 B x (7 x 576 + 2 x 12 x 64 + 2 x 1536 + 49152 + 64) */
    .workspace_per_token = 231424,
};

/* A cfg with MEMPLAN_OPTIONS and the given flags applied. */
static config *with_flags(int argc, char **argv) {
    config *c;
    ae_error err = {0};
    assert_int_equal(config_init(&c, opts, N_OPTS, &err), AE_OK);
    char *pos[8];
    int npos;
    bool print;
    assert_int_equal(config_load(c, argc, argv, NULL, pos, &npos, &print, &err), AE_OK);
    return c;
}

static int plan(config *c, uint64_t available, memplan *p, ae_error *err) {
    memplan_env env = {.mem_available = available, .block_size = 16};
    return memplan_compute(c, &smol, &env, p, err);
}

static void test_auto_fraction_leaves_the_reserve(void **state) {
    (void)state;
    assert_true(hostmem_auto_fraction(16 * GiB) == 0.9); /* 10% = 1.6 GiB > 1 GiB */
    assert_true(hostmem_auto_fraction(100 * GiB) == 0.9);
    assert_true(hostmem_auto_fraction(8 * GiB) == 0.875); /* 1 GiB > 10% */
    assert_true(hostmem_auto_fraction(3 * GiB) == 0.666); /* 2/3 rounded down */
    assert_true(hostmem_auto_fraction(GiB) == 0.0);       /* nothing left */
    assert_true(hostmem_auto_fraction(0) == 0.0);
}

static void test_feasible_plan_numbers_exact(void **state) {
    (void)state;
    config *c = with_flags(0, NULL);
    memplan p;
    ae_error err = {0};
    assert_int_equal(plan(c, 16 * GiB, &p, &err), AE_OK);
    assert_true(p.mem_fraction == 0.9);
    assert_int_equal(p.budget, 15461882265ull); /* floor(0.9 x 17179869184) */
    /* 4 B x (7 x 576 + 2 x (9 + 3) x 64 + 2 x 1536 + 49152 + 64) */
    assert_int_equal(p.workspace_per_token, 231424);
    assert_int_equal(p.workspace_bytes, 8 * 231424);
    assert_int_equal(p.kv_bytes_per_token, 23040);
    /* 41653 blocks would fit; max-batch 8 x 256 blocks per sequence is all that can be used */
    assert_int_equal(p.n_blocks, 2048);
    assert_int_equal(p.kv_tokens, 32768);
    assert_int_equal(p.max_blocks_per_seq, 256);
    assert_int_equal(p.kv_bytes, 2048ull * 16 * 23040);
    assert_int_equal(p.block_table_bytes, 8 * 256 * 4);
    assert_int_equal(p.total, (100ull << 20) + 8 * 231424 + 8 * 256 * 4 + 2048ull * 16 * 23040);
    assert_string_equal(p.text,
                        "budget = 0.9 (mem-fraction, auto) x 16 GiB available = 14.4 GiB\n"
                        "workspace = 8 tok x 226 KiB = 1.77 MiB\n"
                        "kv = 2048 blocks x 16 tok = 32768 tok x 22.5 KiB = 720 MiB (8 seq of max-seq-len 4096)\n"
                        "block tables = 8 seq x 256 blocks x 4 B = 8 KiB\n"
                        "total = weights 100 MiB + workspace 1.77 MiB + block tables 8 KiB + kv 720 MiB = "
                        "822 MiB (5.6% of budget)");
    config_free(c);
}

/* On a GPU: the plan is of the device's free memory at start, and says
 * what it would be in vLLM's and SGLang's settings (memplan.h). */
static void test_gpu_plan_states_the_peers_equivalents(void **state) {
    (void)state;
    config *c = with_flags(0, NULL);
    memplan p;
    ae_error err = {0};
    memplan_env env = {.mem_available = 139 * GiB, .block_size = 16, .device = "cuda:0", .device_total = 141 * GiB};
    assert_int_equal(memplan_compute(c, &smol, &env, &p, &err), AE_OK);
    assert_int_equal(p.total, 861691904ull);
    /* 861691904 / 141 GiB */
    assert_true(fabs(p.vllm_gpu_memory_utilization - 0.005691582) < 1e-9);
    /* 1 - (139 GiB - 100 MiB - 720 MiB) / 141 GiB */
    assert_true(fabs(p.sglang_mem_fraction_static - 0.019863697) < 1e-9);
    const char *want_first = "budget = 0.9 (mem-fraction, auto) x 139 GiB free on cuda:0 at start = 125 GiB\n";
    assert_memory_equal(p.text, want_first, strlen(want_first));
    const char *last = strrchr(p.text, '\n') + 1;
    assert_string_equal(last, "cuda:0: 141 GiB in all, 139 GiB free at start; this plan as the peers' settings: "
                              "vLLM --gpu-memory-utilization 0.006, SGLang --mem-fraction-static 0.020");
    config_free(c);
}

/* On a device with graphs: the step shapes kept cost their estimated
 * launches, a line of the plan and a term of its total. */
static const memplan_env gpu_graphs = {.mem_available = 139 * GiB,
                                       .block_size = 16,
                                       .device = "cuda:0",
                                       .device_total = 141 * GiB,
                                       .graph_nodes = 30 * 24 + 8 + 3,
                                       .graph_node_bytes = 4096};

static void test_gpu_plan_counts_its_graphs(void **state) {
    (void)state;
    config *c = with_flags(0, NULL);
    memplan p;
    ae_error err = {0};
    assert_int_equal(memplan_compute(c, &smol, &gpu_graphs, &p, &err), AE_OK);
    assert_int_equal(p.graphs, MEMPLAN_AUTO_GRAPHS);
    assert_int_equal(config_get_source(c, "cuda-graphs"), CONFIG_SRC_AUTO);
    /* 32 x 731 x 4096 */
    assert_int_equal(p.graph_bytes, 95813632ull);
    assert_int_equal(p.total, 861691904ull + 95813632ull);
    assert_non_null(strstr(p.text, "block tables = 8 seq x 256 blocks x 4 B = 8 KiB\n"
                                   "graphs = 32 step shapes (cuda-graphs, auto) x 731 nodes x 4 KiB = 91.4 MiB (an "
                                   "estimate; each capture logs what it took)\n"
                                   "total = weights 100 MiB + workspace 1.77 MiB + block tables 8 KiB + graphs "
                                   "91.4 MiB + kv 720 MiB = 913 MiB"));
    config_free(c);

    /* Off: no term. */
    char *off[] = {"--cuda-graphs", "0"};
    c = with_flags(2, off);
    assert_int_equal(memplan_compute(c, &smol, &gpu_graphs, &p, &err), AE_OK);
    assert_int_equal(p.graphs, 0);
    assert_int_equal(p.total, 861691904ull);
    assert_null(strstr(p.text, "graphs"));
    config_free(c);

    /* On the CPU a given value changes nothing, and the plan says so. */
    char *given[] = {"--cuda-graphs", "16"};
    c = with_flags(2, given);
    assert_int_equal(plan(c, 16 * GiB, &p, NULL), AE_OK);
    assert_int_equal(p.graphs, 0);
    assert_int_equal(p.total, 861691904ull);
    assert_non_null(strstr(p.text, "\ngraphs = none: cuda-graphs 16 (flag) has no effect without a GPU\n"));
    config_free(c);
}

/* Too many graphs for the device: the error counts them, and names the
 * most that fit, which does fit (and one more does not). */
static void test_too_many_graphs_fail_with_the_count_that_fits(void **state) {
    (void)state;
    memplan_env env = gpu_graphs;
    env.mem_available = 3 * GiB;
    char *argv[] = {"--mem-fraction", "0.5", "--cuda-graphs", "1000"};
    config *c = with_flags(4, argv);
    memplan p;
    ae_error err = {0};
    assert_int_equal(memplan_compute(c, &smol, &env, &p, &err), AE_ERR);
    assert_non_null(strstr(err.msg, "memory plan: one sequence of max-seq-len 4096 does not fit: weights 100 MiB + "
                                    "workspace 1.77 MiB + block tables 8 KiB + graphs 2.79 GiB + kv 4096 tok"));
    const char *k = strstr(err.msg, "--cuda-graphs ");
    assert_non_null(k);
    long fit = atol(k + strlen("--cuda-graphs "));
    /* budget 1.5 GiB, minus weights, workspace, tables and one
     * sequence's 90 MiB of KV, over 2994176 B a graph */
    assert_int_equal(fit, (long)((3 * GiB / 2 - (100ull << 20) - 1851392 - 8192 - 256ull * 16 * 23040) / 2994176));
    config_free(c);
    for (long more = 0; more <= 1; more++) {
        char n[16];
        snprintf(n, sizeof n, "%ld", fit + more);
        char *again[] = {"--mem-fraction", "0.5", "--cuda-graphs", n};
        c = with_flags(4, again);
        err = (ae_error){0};
        assert_int_equal(memplan_compute(c, &smol, &env, &p, &err), more ? AE_ERR : AE_OK);
        config_free(c);
    }
}

static void test_given_kv_tokens_round_up_to_blocks(void **state) {
    (void)state;
    char *argv[] = {"--mem-fraction", "0.5", "--max-kv-tokens", "5000"};
    config *c = with_flags(4, argv);
    memplan p;
    assert_int_equal(plan(c, 16 * GiB, &p, NULL), AE_OK);
    assert_int_equal(p.n_blocks, 313);
    assert_int_equal(p.budget, 8 * GiB);
    assert_string_equal(p.text, "budget = 0.5 (mem-fraction, flag) x 16 GiB available = 8 GiB\n"
                                "workspace = 8 tok x 226 KiB = 1.77 MiB\n"
                                "kv = 313 blocks x 16 tok = 5008 tok x 22.5 KiB = 110 MiB (1 seq of max-seq-len 4096)\n"
                                "block tables = 8 seq x 256 blocks x 4 B = 8 KiB\n"
                                "total = weights 100 MiB + workspace 1.77 MiB + block tables 8 KiB + kv 110 MiB = "
                                "212 MiB (2.6% of budget)");
    config_free(c);
}

static void test_infeasible_plan_shows_arithmetic_and_what_works(void **state) {
    (void)state;
    char *argv[] = {"--mem-fraction", "0.09"};
    config *c = with_flags(2, argv);
    memplan p;
    ae_error err = {0};
    assert_int_equal(plan(c, 2 * GiB, &p, &err), AE_ERR);
    assert_string_equal(err.msg,
                        "memory plan: one sequence of max-seq-len 4096 does not fit: weights 100 MiB + "
                        "workspace 1.77 MiB + block tables 8 KiB + kv 4096 tok x 22.5 KiB = 192 MiB > budget "
                        "0.09 x 2 GiB available = 184 MiB; would work: --mem-fraction 0.094, --max-seq-len 3744");
    config_free(c);
}

/* The values the error names do work, and one step past them does not. */
static void test_values_named_by_the_error_work(void **state) {
    (void)state;
    memplan p;
    char *f_ok[] = {"--mem-fraction", "0.094"}, *f_bad[] = {"--mem-fraction", "0.093"};
    char *l_ok[] = {"--mem-fraction", "0.09", "--max-seq-len", "3744"};
    char *l_bad[] = {"--mem-fraction", "0.09", "--max-seq-len", "3745"};
    config *c = with_flags(2, f_ok);
    assert_int_equal(plan(c, 2 * GiB, &p, NULL), AE_OK);
    assert_int_equal(p.n_blocks, 258); /* one 4096-token sequence and two blocks to spare */
    config_free(c);
    c = with_flags(2, f_bad);
    assert_int_equal(plan(c, 2 * GiB, &p, NULL), AE_ERR);
    config_free(c);
    c = with_flags(4, l_ok);
    assert_int_equal(plan(c, 2 * GiB, &p, NULL), AE_OK);
    assert_int_equal(p.n_blocks, 234);
    config_free(c);
    c = with_flags(4, l_bad);
    assert_int_equal(plan(c, 2 * GiB, &p, NULL), AE_ERR);
    config_free(c);
}

static void test_infeasible_when_max_batch_is_what_breaks_it(void **state) {
    (void)state;
    /* budget 0.1 x 4 GiB = 410 MiB; 4096 tokens of KV take 90 MiB and the
     * weights 100 MiB, leaving room for the workspace and the block table
     * row (226 KiB + 1 KiB) of 990 sequences. */
    char *argv[] = {"--mem-fraction", "0.1", "--max-batch", "1000"};
    config *c = with_flags(4, argv);
    memplan p;
    ae_error err = {0};
    assert_int_equal(plan(c, 4 * GiB, &p, &err), AE_ERR);
    assert_string_equal(err.msg,
                        "memory plan: one sequence of max-seq-len 4096 does not fit: weights 100 MiB + "
                        "workspace 221 MiB + block tables 1000 KiB + kv 4096 tok x 22.5 KiB = 412 MiB > budget "
                        "0.1 x 4 GiB available = 410 MiB; would work: --mem-fraction 0.101, --max-seq-len 4000, "
                        "--max-batch 990");
    config_free(c);
    char *b_ok[] = {"--mem-fraction", "0.1", "--max-batch", "990"};
    char *b_bad[] = {"--mem-fraction", "0.1", "--max-batch", "991"};
    c = with_flags(4, b_ok);
    assert_int_equal(plan(c, 4 * GiB, &p, NULL), AE_OK);
    assert_int_equal(p.n_blocks, 256);
    config_free(c);
    c = with_flags(4, b_bad);
    assert_int_equal(plan(c, 4 * GiB, &p, NULL), AE_ERR);
    config_free(c);
}

static void test_infeasible_when_kv_tokens_hold_less_than_one_sequence(void **state) {
    (void)state;
    char *argv[] = {"--max-kv-tokens", "1000"};
    config *c = with_flags(2, argv);
    memplan p;
    ae_error err = {0};
    assert_int_equal(plan(c, 16 * GiB, &p, &err), AE_ERR);
    assert_string_equal(err.msg, "memory plan: max-kv-tokens 1000 (63 blocks of 16) cannot hold one sequence of "
                                 "max-seq-len 4096 (256 blocks); would work: --max-kv-tokens 4096, --max-seq-len 1008");
    config_free(c);
}

static void test_infeasible_when_kv_tokens_exceed_budget(void **state) {
    (void)state;
    char *argv[] = {"--max-kv-tokens", "10000000"};
    config *c = with_flags(2, argv);
    memplan p;
    ae_error err = {0};
    assert_int_equal(plan(c, 16 * GiB, &p, &err), AE_ERR);
    assert_string_equal(err.msg, "memory plan: max-kv-tokens 10000000 does not fit: weights 100 MiB + workspace "
                                 "1.77 MiB + block tables 8 KiB + kv 10000000 tok x 22.5 KiB = 215 GiB > budget 0.9 x "
                                 "16 GiB available = 14.4 GiB; would work: --max-kv-tokens 666448");
    config_free(c);
}

static void test_provenance_default_flag_auto_in_json(void **state) {
    (void)state;
    char *argv[] = {"--max-seq-len", "2048"};
    config *c = with_flags(2, argv);
    memplan p;
    assert_int_equal(plan(c, 8 * GiB, &p, NULL), AE_OK);
    char *json = config_to_json(c);
    /* budget 7 GiB holds far more than 8 x 2048 tokens: auto = 16384 */
    assert_string_equal(json, "{\"mem-fraction\":{\"value\":0.875,\"source\":\"auto\"},"
                              "\"max-kv-tokens\":{\"value\":16384,\"source\":\"auto\"},"
                              "\"max-batch\":{\"value\":8,\"source\":\"default\"},"
                              "\"max-seq-len\":{\"value\":2048,\"source\":\"flag\"},"
                              "\"cuda-graphs\":{\"value\":0,\"source\":\"auto\"},"
                              "\"deterministic\":{\"value\":true,\"source\":\"default\"}}");
    free(json);
    config_free(c);
}

static void test_log_writes_each_line(void **state) {
    (void)state;
    config *c = with_flags(0, NULL);
    memplan p;
    assert_int_equal(plan(c, 16 * GiB, &p, NULL), AE_OK);
    char path[] = "/tmp/aerie-memplan-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    log_set_fd(fd);
    memplan_log(&p);
    log_set_fd(2);
    char buf[2048] = {0};
    assert_true(pread(fd, buf, sizeof buf - 1, 0) > 0);
    close(fd);
    unlink(path);
    /* Each line: timestamp, level, event "memplan", the arithmetic. */
    const char *want[] = {
        " info memplan budget = 0.9 (mem-fraction, auto) x 16 GiB available = 14.4 GiB\n",
        " info memplan workspace = 8 tok x 226 KiB = 1.77 MiB\n",
        " info memplan kv = 2048 blocks x 16 tok = 32768 tok",
        " info memplan block tables = 8 seq x 256 blocks x 4 B = 8 KiB\n",
        " info memplan total = weights 100 MiB",
        (" info memplan_bytes available=17179869184 budget=15461882265 weights=104857600 "
         "workspace=1851392 block_tables=8192 graphs=0 kv=754974720 total=861691904 kv_blocks=2048 block_size=16 "
         "cuda_graphs=0\n"),
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) assert_non_null(strstr(buf, want[i]));
    int lines = 0;
    for (char *q = buf; *q; q++) lines += *q == '\n';
    assert_int_equal(lines, 6);
    config_free(c);
}

/* The engine's KV block tables are int32 [max-batch][ceil(max-seq-len /
 * block_size)]: 4096 x 12500 x 4 B = 204800000 B here, counted in the
 * total and shown in the arithmetic. */
static void test_block_tables_are_counted(void **state) {
    (void)state;
    char *argv[] = {"--max-batch", "4096", "--max-seq-len", "200000"};
    config *c = with_flags(4, argv);
    memplan p;
    ae_error err = {0};
    assert_int_equal(plan(c, 64 * GiB, &p, &err), AE_OK);
    assert_int_equal(p.max_blocks_per_seq, 12500);
    assert_int_equal(p.block_table_bytes, 204800000ull);
    assert_int_equal(p.total - p.weight_bytes - p.workspace_bytes - p.kv_bytes, 204800000ull);
    assert_non_null(strstr(p.text, "\nblock tables = 4096 seq x 12500 blocks x 4 B = 195 MiB\n"));
    assert_true(p.total <= p.budget);
    config_free(c);
}

static void test_parse_meminfo(void **state) {
    (void)state;
    uint64_t b;
    ae_error err = {0};
    assert_int_equal(hostmem_parse_meminfo("MemTotal:       32768000 kB\nMemFree:  1 kB\n"
                                           "MemAvailable:   24536192 kB\nBuffers: 2 kB\n",
                                           &b, &err),
                     AE_OK);
    assert_int_equal(b, 24536192ull * 1024);
    assert_int_equal(hostmem_parse_meminfo("MemTotal: 5 kB\n", &b, &err), AE_ERR);
    assert_string_equal(err.msg, "meminfo: no MemAvailable line");
    err_clear(&err);
    assert_int_equal(hostmem_parse_meminfo("MemAvailable: lots\n", &b, &err), AE_ERR);
    assert_string_equal(err.msg, "meminfo: cannot read the MemAvailable line");
    /* This machine's own file reads. */
    assert_int_equal(hostmem_available(&b, NULL), AE_OK);
    assert_true(b > 0);
}

static void test_fmt_bytes_three_digits(void **state) {
    (void)state;
    char s[24];
    const struct {
        uint64_t b;
        const char *want;
    } cases[] = {
        {0, "0 B"},
        {1023, "1023 B"},
        {1024, "1 KiB"},
        {23040, "22.5 KiB"},
        {46080, "45 KiB"},
        {226560, "221 KiB"},
        {1812480, "1.73 MiB"},
        {96600000, "92.1 MiB"},
        {25125558681ull, "23.4 GiB"},
        {3ull << 40, "3 TiB"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        hostmem_fmt_bytes(cases[i].b, s, sizeof s);
        assert_string_equal(s, cases[i].want);
    }
}

static void test_bad_model_sizes_rejected(void **state) {
    (void)state;
    config *c = with_flags(0, NULL);
    memplan_model m = smol;
    m.vocab = 0;
    memplan_env env = {.mem_available = 16 * GiB, .block_size = 16};
    memplan p;
    ae_error err = {0};
    assert_int_equal(memplan_compute(c, &m, &env, &p, &err), AE_ERR);
    assert_string_equal(err.msg, "memory plan: model sizes must be positive (layers=30 hidden=576 "
                                 "ffn=1536 heads=9 kv_heads=3 head_dim=64 vocab=0)");
    config_free(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_auto_fraction_leaves_the_reserve),
        cmocka_unit_test(test_feasible_plan_numbers_exact),
        cmocka_unit_test(test_gpu_plan_states_the_peers_equivalents),
        cmocka_unit_test(test_gpu_plan_counts_its_graphs),
        cmocka_unit_test(test_too_many_graphs_fail_with_the_count_that_fits),
        cmocka_unit_test(test_given_kv_tokens_round_up_to_blocks),
        cmocka_unit_test(test_infeasible_plan_shows_arithmetic_and_what_works),
        cmocka_unit_test(test_values_named_by_the_error_work),
        cmocka_unit_test(test_infeasible_when_max_batch_is_what_breaks_it),
        cmocka_unit_test(test_infeasible_when_kv_tokens_hold_less_than_one_sequence),
        cmocka_unit_test(test_infeasible_when_kv_tokens_exceed_budget),
        cmocka_unit_test(test_provenance_default_flag_auto_in_json),
        cmocka_unit_test(test_log_writes_each_line),
        cmocka_unit_test(test_block_tables_are_counted),
        cmocka_unit_test(test_parse_meminfo),
        cmocka_unit_test(test_fmt_bytes_three_digits),
        cmocka_unit_test(test_bad_model_sizes_rejected),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
