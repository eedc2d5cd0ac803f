/* The small runtime pieces: errors, arena, thread pool, log lines. */
#include <pthread.h>
#include <setjmp.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "../../services/core/arena.h"
#include "../../services/core/clock.h"
#include "../../services/core/err.h"
#include "../../services/core/file.h"
#include "../../services/core/log.h"
#include "../../services/core/pool.h"
#include "../../services/core/watchdog.h"

static void test_err_keeps_first_error(void **state) {
    (void)state;
    ae_error err = {0};
    assert_int_equal(err_set(&err, "first %d", 1), AE_ERR);
    err_set(&err, "second");
    assert_string_equal(err.msg, "first 1");
    err_prefix(&err, "%s: ", "model.gguf");
    assert_string_equal(err.msg, "model.gguf: first 1");
    assert_int_equal(err_set(NULL, "discarded"), AE_ERR);
}

static void test_err_prefix_truncates_instead_of_overflowing(void **state) {
    (void)state;
    ae_error err = {0};
    char longtext[AE_ERR_MAX * 2];
    memset(longtext, 'x', sizeof longtext - 1);
    longtext[sizeof longtext - 1] = '\0';
    err_set(&err, "%s", longtext);
    assert_int_equal(strlen(err.msg), AE_ERR_MAX - 1);
    err_prefix(&err, "prefix: ");
    assert_int_equal(strlen(err.msg), AE_ERR_MAX - 1);
    assert_memory_equal(err.msg, "prefix: xxx", 11);
}

static void test_arena_aligns_and_refuses_overflow(void **state) {
    (void)state;
    arena a;
    ae_error err = {0};
    assert_int_equal(arena_init(&a, 100, &err), AE_OK);
    assert_int_equal(a.cap, 128); /* rounded to 64 */
    uint8_t *p = arena_alloc(&a, 3, 1);
    uint8_t *q = arena_alloc(&a, 8, 8);
    assert_ptr_equal(q, p + 8);
    size_t mark = arena_mark(&a);
    assert_non_null(arena_alloc(&a, 100, 4));
    assert_null(arena_alloc(&a, 100, 4)); /* 16 + 100 + 100 > 128 */
    arena_rewind(&a, mark);
    assert_int_equal(a.used, 16);
    assert_int_equal(a.high_water, 116);
    assert_null(arena_alloc(&a, SIZE_MAX, 1));
    arena_reset(&a);
    assert_int_equal(a.used, 0);
    arena_free(&a);
    arena_free(&a); /* freed arena: no-op */
}

typedef struct count_ctx {
    atomic_int runs[97]; /* times each task ran */
    atomic_int seen_n_tasks_wrong;
} count_ctx;

static void count_task(void *ctx, int task, int n_tasks) {
    count_ctx *c = ctx;
    if (n_tasks != 97) atomic_fetch_add(&c->seen_n_tasks_wrong, 1);
    atomic_fetch_add(&c->runs[task], 1);
}

/* Rounds in which some task did not run exactly once. Counts instead of
 * asserting, so it can run on a thread other than the test's. */
static int bad_rounds(pool *p, int rounds) {
    int bad = 0;
    for (int round = 0; round < rounds; round++) {
        count_ctx c;
        memset(&c, 0, sizeof c);
        pool_run(p, count_task, &c, 97);
        bool ok = atomic_load(&c.seen_n_tasks_wrong) == 0;
        for (int t = 0; t < 97; t++) ok = ok && atomic_load(&c.runs[t]) == 1;
        bad += !ok;
    }
    return bad;
}

static void test_pool_runs_every_task_exactly_once(void **state) {
    (void)state;
    ae_error err = {0};
    for (int threads = 1; threads <= 4; threads++) {
        pool *p;
        assert_int_equal(pool_init(&p, threads, &err), AE_OK);
        assert_int_equal(pool_threads(p), threads);
        assert_int_equal(bad_rounds(p, 100), 0);
        pool_free(p);
    }
    pool_free(NULL);
}

static void *caller_thread(void *arg) {
    static int bad;
    bad = bad_rounds(arg, 50);
    return &bad;
}

static void test_pool_callers_on_two_threads_take_turns(void **state) {
    (void)state;
    ae_error err = {0};
    pool *p;
    assert_int_equal(pool_init(&p, 3, &err), AE_OK);
    pthread_t other;
    assert_int_equal(pthread_create(&other, NULL, caller_thread, p), 0);
    int mine = bad_rounds(p, 50);
    void *theirs;
    pthread_join(other, &theirs);
    pool_free(p);
    assert_int_equal(mine, 0);
    assert_int_equal(*(int *)theirs, 0);
}

static int64_t cpu_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void nothing_task(void *ctx, int task, int n_tasks) { (void)ctx, (void)task, (void)n_tasks; }

/* A worker with no job spins for a while before it sleeps, and while it
 * spins it holds a core that another process sharing the machine (the
 * draft beside the target) could use. The spin is bounded to 50 us of
 * wall time (pool.c): so each of 2 workers burns at most about that after
 * a job, plus its wake-up; 200 us of CPU per worker per job is the bound
 * (a spin of 20000 pauses took 520 us on this Zen 4 host). The jobs are
 * 5 ms apart, so every worker finishes its spin and sleeps in between. */
static void test_pool_workers_stop_spinning_soon_after_a_job(void **state) {
    (void)state;
    ae_error err = {0};
    pool *p;
    assert_int_equal(pool_init(&p, 3, &err), AE_OK);
    enum { JOBS = 20 };
    int64_t proc0 = cpu_ns(CLOCK_PROCESS_CPUTIME_ID), mine0 = cpu_ns(CLOCK_THREAD_CPUTIME_ID);
    for (int j = 0; j < JOBS; j++) {
        pool_run(p, nothing_task, NULL, 8);
        struct timespec gap = {0, 5000000};
        nanosleep(&gap, NULL);
    }
    int64_t workers_ns = (cpu_ns(CLOCK_PROCESS_CPUTIME_ID) - proc0) - (cpu_ns(CLOCK_THREAD_CPUTIME_ID) - mine0);
    pool_free(p);
    int64_t per_job_per_worker = workers_ns / JOBS / 2;
    print_message("each worker burned %lld us of CPU per job\n", (long long)(per_job_per_worker / 1000));
    if (per_job_per_worker >= 200000)
        fail_msg("each worker burned %lld us of CPU per job (bound 200 us)", (long long)(per_job_per_worker / 1000));
}

static void test_pool_rejects_bad_thread_count(void **state) {
    (void)state;
    pool *p;
    ae_error err = {0};
    assert_int_equal(pool_init(&p, 0, &err), AE_ERR);
    assert_null(p);
    assert_string_equal(err.msg, "pool: threads must be in 1..256, got 0");
}

static void test_log_line_format_and_level_filter(void **state) {
    (void)state;
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    log_set_fd(fds[1]);
    log_set_level(LOG_WARN);
    LOG_INFOF("hidden key=1");
    LOG_WARNF("shown key=%d", 2);
    log_set_fd(2);
    log_set_level(LOG_INFO);
    close(fds[1]);
    char buf[256] = {0};
    ssize_t n = read(fds[0], buf, sizeof buf - 1);
    close(fds[0]);
    assert_true(n > 0);
    /* 2026-11-29T10:31:02.123Z warn shown key=2\n */
    assert_int_equal(n, 24 + 18);
    assert_int_equal(buf[10], 'T');
    assert_int_equal(buf[23], 'Z');
    assert_string_equal(buf + 24, " warn shown key=2\n");
    log_level lv;
    assert_true(log_level_parse("error", &lv));
    assert_int_equal(lv, LOG_ERROR);
    assert_false(log_level_parse("loud", &lv));
}

static void test_file_read_all_reads_limits_and_reports_missing(void **state) {
    (void)state;
    char path[] = "/tmp/aerie-file-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "hello\0world", 11), 11);
    close(fd);
    char *buf;
    size_t len;
    bool missing = true;
    ae_error err = {0};
    assert_int_equal(file_read_all(path, 11, &buf, &len, &missing, &err), AE_OK);
    assert_int_equal(len, 11);
    assert_memory_equal(buf, "hello\0world", 12); /* NUL after the last byte */
    assert_false(missing);
    free(buf);

    char want[128];
    assert_int_equal(file_read_all(path, 10, &buf, &len, NULL, &err), AE_ERR);
    snprintf(want, sizeof want, "%s: 11 bytes exceeds the limit of 10", path);
    assert_string_equal(err.msg, want);
    assert_null(buf);
    unlink(path);

    err_clear(&err);
    assert_int_equal(file_read_all(path, 10, &buf, &len, &missing, &err), AE_ERR);
    assert_true(missing);
    snprintf(want, sizeof want, "%s: cannot open: No such file or directory", path);
    assert_string_equal(err.msg, want);

    err_clear(&err);
    assert_int_equal(file_read_all("/tmp", 10, &buf, &len, &missing, &err), AE_ERR);
    assert_false(missing);
    assert_string_equal(err.msg, "/tmp: not a regular file");
}

static void test_file_read_all_reads_a_pipe_up_to_the_limit(void **state) {
    (void)state;
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    static char big[20000];
    memset(big, 'z', sizeof big);
    assert_int_equal(write(fds[1], big, sizeof big), (ssize_t)sizeof big);
    close(fds[1]);
    char path[64];
    snprintf(path, sizeof path, "/dev/fd/%d", fds[0]);
    char *buf;
    size_t len;
    ae_error err = {0};
    assert_int_equal(file_read_all(path, 19999, &buf, &len, NULL, &err), AE_ERR);
    char want[96];
    snprintf(want, sizeof want, "%s: more than 19999 bytes", path);
    assert_string_equal(err.msg, want);
    close(fds[0]);

    assert_int_equal(pipe(fds), 0);
    assert_int_equal(write(fds[1], big, sizeof big), (ssize_t)sizeof big);
    close(fds[1]);
    snprintf(path, sizeof path, "/dev/fd/%d", fds[0]);
    assert_int_equal(file_read_all(path, 20000, &buf, &len, NULL, &err), AE_OK);
    assert_int_equal(len, 20000);
    assert_int_equal(buf[19999], 'z');
    assert_int_equal(buf[20000], '\0');
    free(buf);
    close(fds[0]);
}

/* ---- watchdog ---- */

static void sleep_ms(int ms) { nanosleep(&(struct timespec){ms / 1000, (long)(ms % 1000) * 1000000}, NULL); }

static void test_watchdog_interval_comes_from_env_and_honours_watchdog_pid(void **state) {
    (void)state;
    char pid[32];
    unsetenv("WATCHDOG_PID");
    unsetenv("WATCHDOG_USEC");
    assert_int_equal(watchdog_env_interval_us(), 0);
    setenv("WATCHDOG_USEC", "500000", 1);
    assert_int_equal(watchdog_env_interval_us(), 500000);
    snprintf(pid, sizeof pid, "%d", (int)getpid());
    setenv("WATCHDOG_PID", pid, 1);
    assert_int_equal(watchdog_env_interval_us(), 500000);
    snprintf(pid, sizeof pid, "%d", (int)getpid() + 1); /* meant for another process */
    setenv("WATCHDOG_PID", pid, 1);
    assert_int_equal(watchdog_env_interval_us(), 0);
    unsetenv("WATCHDOG_PID");
    setenv("WATCHDOG_USEC", "20s", 1);
    assert_int_equal(watchdog_env_interval_us(), 0);
    unsetenv("WATCHDOG_USEC");
}

static void test_watchdog_off_is_a_null_handle_and_every_call_a_noop(void **state) {
    (void)state;
    watchdog *w = (watchdog *)1;
    assert_int_equal(watchdog_init(&w, 0, NULL), AE_OK);
    assert_null(w);
    assert_int_equal(watchdog_add(w, "rpc"), -1);
    watchdog_beat(w, -1);
    assert_null(watchdog_stale(w, clock_mono_ns()));
    assert_int_equal(watchdog_start(w, NULL), AE_OK);
    watchdog_free(w);
}

static void test_watchdog_stale_names_the_loop_that_stopped_beating(void **state) {
    (void)state;
    watchdog *w;
    assert_int_equal(watchdog_init(&w, 400000, NULL), AE_OK); /* stale after 200 ms */
    int a = watchdog_add(w, "event-loop"), b = watchdog_add(w, "scheduler");
    assert_null(watchdog_stale(w, clock_mono_ns()));
    for (int i = 0; i < 6; i++) {
        sleep_ms(50);
        watchdog_beat(w, a);
    }
    assert_string_equal(watchdog_stale(w, clock_mono_ns()), "scheduler");
    watchdog_beat(w, b);
    assert_null(watchdog_stale(w, clock_mono_ns()));
    /* A loop that ends on purpose leaves the checks. */
    watchdog_remove(w, b);
    for (int i = 0; i < 6; i++) {
        sleep_ms(50);
        watchdog_beat(w, a);
    }
    assert_null(watchdog_stale(w, clock_mono_ns()));
    watchdog_free(w);
}

static void test_watchdog_test_stall_hook_drops_only_the_named_loop(void **state) {
    (void)state;
    setenv("AERIE_TEST_WATCHDOG_STALL", "scheduler", 1);
    watchdog *w;
    assert_int_equal(watchdog_init(&w, 200000, NULL), AE_OK); /* stale after 100 ms */
    int a = watchdog_add(w, "rpc"), b = watchdog_add(w, "scheduler");
    unsetenv("AERIE_TEST_WATCHDOG_STALL");
    sleep_ms(150);
    watchdog_beat(w, a);
    watchdog_beat(w, b);
    assert_string_equal(watchdog_stale(w, clock_mono_ns()), "scheduler");
    watchdog_free(w);
}

typedef struct beater {
    watchdog *w;
    int slot;
    atomic_bool stop;
} beater;

static void *beater_main(void *arg) {
    beater *b = arg;
    for (int i = 0; i < 1000 && !atomic_load(&b->stop); i++) {
        watchdog_beat(b->w, b->slot);
        sleep_ms(10);
    }
    return NULL;
}

/* WATCHDOG=1 datagrams that arrive on fd within ms. */
static int count_pings(int fd, int ms) {
    int n = 0;
    int64_t end = clock_mono_ns() + (int64_t)ms * 1000000;
    for (;;) {
        int64_t left_us = (end - clock_mono_ns()) / 1000;
        if (left_us <= 0) return n;
        struct timeval tv = {(time_t)(left_us / 1000000), (suseconds_t)(left_us % 1000000)};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        char buf[64];
        ssize_t got = recv(fd, buf, sizeof buf - 1, 0);
        if (got < 0) continue; /* timed out: the loop ends on the clock */
        buf[got] = '\0';
        assert_string_equal(buf, "WATCHDOG=1");
        n++;
    }
}

static void test_watchdog_pings_every_quarter_interval_only_while_every_loop_beats(void **state) {
    (void)state;
    char path[64];
    snprintf(path, sizeof path, "/tmp/aerie-wd-test-%d.sock", (int)getpid());
    unlink(path);
    int fd = socket(AF_UNIX, SOCK_DGRAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_un un = {.sun_family = AF_UNIX};
    snprintf(un.sun_path, sizeof un.sun_path, "%s", path);
    assert_int_equal(bind(fd, (struct sockaddr *)&un, sizeof un), 0);
    setenv("NOTIFY_SOCKET", path, 1);

    watchdog *w;
    assert_int_equal(watchdog_init(&w, 200000, NULL), AE_OK); /* a ping every 50 ms; stale after 100 ms */
    beater loops[2] = {{w, watchdog_add(w, "event-loop"), false}, {w, watchdog_add(w, "scheduler"), false}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++) assert_int_equal(pthread_create(&th[i], NULL, beater_main, &loops[i]), 0);
    assert_int_equal(watchdog_start(w, NULL), AE_OK);
    int healthy = count_pings(fd, 1000);
    assert_in_range(healthy, 16, 21); /* 20 at 50 ms, give or take the edges */

    /* The scheduler hangs; the event loop keeps beating. */
    atomic_store(&loops[1].stop, true);
    pthread_join(th[1], NULL);
    sleep_ms(150);
    while (recv(fd, (char[64]){0}, 64, MSG_DONTWAIT) > 0) {
    }
    assert_int_equal(count_pings(fd, 500), 0);

    atomic_store(&loops[0].stop, true);
    pthread_join(th[0], NULL);
    watchdog_free(w); /* no loop beats after it */
    unsetenv("NOTIFY_SOCKET");
    close(fd);
    unlink(path);
}

/* watchdog_env_interval_us with WATCHDOG_USEC=value and WATCHDOG_PID unset; the
 * log lines it wrote (timestamps cut off, one per line) into logged. */
static int64_t env_interval_logged(const char *value, char *logged, size_t cap) {
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    log_set_fd(fds[1]);
    unsetenv("WATCHDOG_PID");
    setenv("WATCHDOG_USEC", value, 1);
    int64_t us = watchdog_env_interval_us();
    unsetenv("WATCHDOG_USEC");
    log_set_fd(2);
    close(fds[1]);
    char buf[1024] = {0};
    ssize_t n = read(fds[0], buf, sizeof buf - 1);
    close(fds[0]);
    logged[0] = '\0';
    size_t used = 0;
    for (char *line = buf; n > 0 && *line;) {
        char *nl = strchr(line, '\n');
        assert_non_null(nl);
        assert_true(nl - line > 24 && line[23] == 'Z'); /* 2026-11-29T10:31:02.123Z */
        int k = snprintf(logged + used, cap - used, "%.*s", (int)(nl + 1 - line - 25), line + 25);
        assert_true(k >= 0 && (size_t)k < cap - used);
        used += (size_t)k;
        line = nl + 1;
    }
    return us;
}

static void test_watchdog_usec_is_clamped_to_its_range_and_the_change_logged(void **state) {
    (void)state;
    char logged[1024];
    /* In range: taken as it is, nothing logged. */
    assert_int_equal(env_interval_logged("400000", logged, sizeof logged), 400000);
    assert_string_equal(logged, "");
    assert_int_equal(env_interval_logged("3600000000", logged, sizeof logged), 3600000000LL);
    assert_string_equal(logged, "");
    /* 1 us would have the ping thread spin: the floor pings every 100 ms. */
    assert_int_equal(env_interval_logged("1", logged, sizeof logged), 400000);
    assert_string_equal(logged, "warn watchdog_interval_clamped watchdog_usec=1 interval_us=400000 reason=\"below "
                                "400000 us: a ping every 100 ms, late for a systemd that wants one sooner\"\n");
    assert_int_equal(env_interval_logged("399999", logged, sizeof logged), 400000);
    /* 1e16 us made interval_ns overflow, and no ping was ever sent. */
    assert_int_equal(env_interval_logged("10000000000000000", logged, sizeof logged), 3600000000LL);
    assert_string_equal(logged, "warn watchdog_interval_clamped watchdog_usec=10000000000000000 interval_us=3600000000 "
                                "reason=\"above 3600000000 us: pinging more often than asked is always in time\"\n");
    assert_int_equal(env_interval_logged("3600000001", logged, sizeof logged), 3600000000LL);
    /* Past int64 (systemd's field is a uint64): the ceiling too. */
    assert_int_equal(env_interval_logged("18446744073709551615", logged, sizeof logged), 3600000000LL);
    assert_string_equal(logged, "warn watchdog_interval_clamped watchdog_usec=18446744073709551615 "
                                "interval_us=3600000000 reason=\"above 3600000000 us: pinging more often than asked "
                                "is always in time\"\n");
}

static void test_watchdog_usec_that_is_not_a_positive_integer_is_ignored_and_logged(void **state) {
    (void)state;
    char logged[1024];
    const char *bad[] = {"20s", "0", "-5", "1e16", "0x10"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(env_interval_logged(bad[i], logged, sizeof logged), 0);
        char want[256];
        snprintf(want, sizeof want,
                 "warn watchdog_usec_ignored value=\"%s\" reason=\"not a positive whole number of microseconds: no "
                 "watchdog\"\n",
                 bad[i]);
        assert_string_equal(logged, want);
    }
    /* An empty value is systemd's "none": nothing to say. */
    assert_int_equal(env_interval_logged("", logged, sizeof logged), 0);
    assert_string_equal(logged, "");
}

/* A watchdog from the environment's WATCHDOG_USEC, one loop beating every
 * 10 ms, pinging into a fresh NOTIFY_SOCKET; returns the WATCHDOG=1
 * datagrams in ms. */
static int pings_for_env(const char *usec, int ms, int64_t *interval_ns) {
    char path[64];
    snprintf(path, sizeof path, "/tmp/aerie-wd-env-%d.sock", (int)getpid());
    unlink(path);
    int fd = socket(AF_UNIX, SOCK_DGRAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_un un = {.sun_family = AF_UNIX};
    snprintf(un.sun_path, sizeof un.sun_path, "%s", path);
    assert_int_equal(bind(fd, (struct sockaddr *)&un, sizeof un), 0);
    setenv("NOTIFY_SOCKET", path, 1);
    unsetenv("WATCHDOG_PID");
    setenv("WATCHDOG_USEC", usec, 1);
    watchdog *w;
    assert_int_equal(watchdog_init(&w, watchdog_env_interval_us(), NULL), AE_OK);
    unsetenv("WATCHDOG_USEC");
    assert_non_null(w);
    *interval_ns = watchdog_interval_ns(w);
    beater loop = {w, watchdog_add(w, "event-loop"), false}; /* beats every 10 ms */
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, beater_main, &loop), 0);
    assert_int_equal(watchdog_start(w, NULL), AE_OK);
    int n = count_pings(fd, ms);
    atomic_store(&loop.stop, true);
    pthread_join(th, NULL);
    watchdog_free(w);
    unsetenv("NOTIFY_SOCKET");
    close(fd);
    unlink(path);
    return n;
}

static void test_watchdog_usec_1_pings_every_100_ms_not_in_a_spin(void **state) {
    (void)state;
    int64_t interval_ns;
    int n = pings_for_env("1", 1000, &interval_ns);
    assert_int_equal(interval_ns, 400000000); /* the floor: 400 ms, a ping every 100 ms */
    assert_in_range(n, 8, 11);                /* 10, give or take the edges */
}

static void test_watchdog_usec_1e16_pings_at_the_ceilings_rate_rather_than_never(void **state) {
    (void)state;
    int64_t interval_ns;
    /* The first ping goes at once; the next would be in 15 minutes. */
    int n = pings_for_env("10000000000000000", 300, &interval_ns);
    assert_int_equal(interval_ns, 3600000000000LL);
    assert_int_equal(n, 1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_err_keeps_first_error),
        cmocka_unit_test(test_err_prefix_truncates_instead_of_overflowing),
        cmocka_unit_test(test_arena_aligns_and_refuses_overflow),
        cmocka_unit_test(test_pool_runs_every_task_exactly_once),
        cmocka_unit_test(test_pool_callers_on_two_threads_take_turns),
        cmocka_unit_test(test_pool_workers_stop_spinning_soon_after_a_job),
        cmocka_unit_test(test_pool_rejects_bad_thread_count),
        cmocka_unit_test(test_log_line_format_and_level_filter),
        cmocka_unit_test(test_file_read_all_reads_limits_and_reports_missing),
        cmocka_unit_test(test_file_read_all_reads_a_pipe_up_to_the_limit),
        cmocka_unit_test(test_watchdog_interval_comes_from_env_and_honours_watchdog_pid),
        cmocka_unit_test(test_watchdog_off_is_a_null_handle_and_every_call_a_noop),
        cmocka_unit_test(test_watchdog_stale_names_the_loop_that_stopped_beating),
        cmocka_unit_test(test_watchdog_test_stall_hook_drops_only_the_named_loop),
        cmocka_unit_test(test_watchdog_pings_every_quarter_interval_only_while_every_loop_beats),
        cmocka_unit_test(test_watchdog_usec_is_clamped_to_its_range_and_the_change_logged),
        cmocka_unit_test(test_watchdog_usec_that_is_not_a_positive_integer_is_ignored_and_logged),
        cmocka_unit_test(test_watchdog_usec_1_pings_every_100_ms_not_in_a_spin),
        cmocka_unit_test(test_watchdog_usec_1e16_pings_at_the_ceilings_rate_rather_than_never),
    };
    return cmocka_run_group_tests_name("core", tests, NULL, NULL);
}
