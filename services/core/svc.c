#include "svc.h"

#include <errno.h>
#include <pthread.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "log.h"

extern char **environ;

void svc_signals_init(void) {
    /* Large buffers (RPC payloads of about 0.5 MB per call) stay in the
     * heap: glibc would otherwise map and unmap each one, and the page
     * faults of a fresh mapping cost more than the data's copy. */
    mallopt(M_MMAP_THRESHOLD, 64 << 20);
    mallopt(M_TRIM_THRESHOLD, 256 << 20);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);
}

int svc_wait_signal(void) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    int sig = 0;
    while (sigwait(&set, &sig) != 0) {
    }
    return sig;
}

int svc_config_load(config **out, const char *service, const config_option *opts, size_t n, int argc, char **argv,
                    bool *print_config, bool *help, ae_error *err) {
    *out = NULL;
    *help = *print_config = false;
    config *c = NULL;
    char **pos = calloc((size_t)argc + 1, sizeof *pos);
    int npos = 0;
    if (!pos) return err_set(err, "out of memory");
    if (config_init(&c, opts, n, err) != AE_OK) goto fail;
    for (int i = 1; i < argc && strcmp(argv[i], "--"); i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            char *u = config_usage(c);
            printf("usage: %s [options]\n\noptions:\n%s", service, u ? u : "");
            printf("  --%-16s %s\n  --%-16s %s\n", "config FILE", "JSON file of settings", "print-config",
                   "print the resolved settings with their sources, then exit");
            free(u);
            *help = true;
            free(pos);
            *out = c;
            return AE_OK;
        }
    if (config_load(c, argc - 1, argv + 1, environ, pos, &npos, print_config, err) != AE_OK) goto fail;
    if (npos > 0) {
        err_set(err, "unexpected argument \"%s\"", pos[0]);
        goto fail;
    }
    const char *level = config_str(c, "log-level");
    log_level lv;
    if (!level || !log_level_parse(level, &lv)) {
        err_set(err, "log-level: expected debug, info, warn, error or off, got \"%s\"", level ? level : "");
        goto fail;
    }
    log_set_level(lv);
    free(pos);
    *out = c;
    return AE_OK;
fail:
    free(pos);
    config_free(c);
    return AE_ERR;
}

void svc_print_config(const config *c) {
    char *json = config_to_json(c);
    if (json) puts(json);
    free(json);
}

void svc_notify(const char *state) {
    const char *path = getenv("NOTIFY_SOCKET");
    if (!path || (path[0] != '/' && path[0] != '@')) return;
    struct sockaddr_un un = {.sun_family = AF_UNIX};
    size_t n = strlen(path);
    if (n >= sizeof un.sun_path) return;
    memcpy(un.sun_path, path, n);
    if (un.sun_path[0] == '@') un.sun_path[0] = '\0'; /* abstract namespace */
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return;
    if (sendto(fd, state, strlen(state), 0, (struct sockaddr *)&un,
               (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n)) < 0)
        LOG_WARNF("sd_notify_failed state=%s", state);
    close(fd);
}

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    bool running, done;
} loading = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, false, false};

static void *extend_main(void *arg) {
    (void)arg;
    char msg[64];
    snprintf(msg, sizeof msg, "EXTEND_TIMEOUT_USEC=%llu", (unsigned long long)SVC_EXTEND_BY_S * 1000000);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    pthread_mutex_lock(&loading.mu);
    for (int waited = 0; !loading.done && waited <= SVC_LOAD_MAX_S; waited += SVC_EXTEND_EVERY_S) {
        svc_notify(msg);
        until.tv_sec += SVC_EXTEND_EVERY_S;
        while (!loading.done && pthread_cond_timedwait(&loading.cv, &loading.mu, &until) != ETIMEDOUT) {
        }
    }
    pthread_mutex_unlock(&loading.mu);
    return NULL;
}

void svc_loading_begin(void) {
    if (!getenv("NOTIFY_SOCKET") || loading.running) return;
    loading.done = false;
    loading.running = pthread_create(&loading.thread, NULL, extend_main, NULL) == 0;
}

void svc_loading_end(void) {
    if (!loading.running) return;
    pthread_mutex_lock(&loading.mu);
    loading.done = true;
    pthread_cond_broadcast(&loading.cv);
    pthread_mutex_unlock(&loading.mu);
    pthread_join(loading.thread, NULL);
    loading.running = false;
}

int svc_act_bits(const config *c, int32_t *bits, ae_error *err) {
    int64_t v = config_int(c, "act-bits");
    if (v != 8 && v != 15) return err_set(err, "act-bits must be 8 or 15, got %lld", (long long)v);
    *bits = (int32_t)v;
    return AE_OK;
}
