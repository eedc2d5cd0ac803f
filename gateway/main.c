/* aerie-gateway: the OpenAI-compatible HTTP API in front of one or more
 * aerie-target replicas (gateway/gateway.h). */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../services/tokenizer/tok_file.h"
#include "../services/core/clock.h"
#include "../services/core/file.h"
#include "../services/core/log.h"
#include "../services/core/svc.h"
#include "../services/core/watchdog.h"
#include "gateway.h"
#include "router.h"

static const config_option opts[] = {
    {"model", CONFIG_STRING, NULL, 0, 0,
     "the served model (.gguf or Hugging Face directory): its tokenizer and chat template"},
    {"model-name", CONFIG_STRING, "auto", 0, 0, "the name clients ask for (auto: the model file's name without .gguf)"},
    {"host", CONFIG_STRING, "127.0.0.1", 0, 0, "HTTP address to listen on"},
    {"port", CONFIG_INT, "8080", 0, 65535, "HTTP port (0: any free one, logged)"},
    {"targets", CONFIG_STRING, "auto", 0, 0,
     "aerie-target replicas, comma-separated (unix:PATH or HOST:PORT; auto: the target's own default socket)"},
    {"tls-ca", CONFIG_STRING, NULL, 0, 0, "speak TLS to targets and drafts; their certificates must chain to this CA"},
    {"tls-cert", CONFIG_STRING, NULL, 0, 0, "client certificate for targets and drafts (mutual TLS)"},
    {"tls-key", CONFIG_STRING, NULL, 0, 0, "client key"},
    {"api-key-file", CONFIG_STRING, NULL, 0, 0,
     "API keys, one per line: requests must send 'Authorization: Bearer KEY' (none: open)"},
    {"max-body-bytes", CONFIG_INT, "1048576", 1024, 1 << 30, "largest request body; beyond, 413"},
    {"max-conns", CONFIG_INT, "1024", 1, 65536, "open HTTP connections; beyond, 429"},
    {"max-inflight", CONFIG_INT, "512", 1, 1 << 20, "generation requests at once; beyond, 429"},
    /* 1 MiB: what the memory plan already gives every connection for one
     * whole reply (GATEWAY_MAX_REPLY_BYTES, /tokenize's), so the http buffers do
     * not grow, and max-inflight 512 x 2 x 1 MiB adds 1 GiB. It holds 512
     * tokens with 20 top log-probabilities each (1.4-1.5 KB a token), or the
     * text of every choice at n = 16 up to some 13k tokens each; more is
     * what "stream": true is for. */
    {"max-reply-bytes", CONFIG_INT, "1048576", 1024, 1 << 30,
     "largest reply that is not streamed (every choice's text, log-probabilities and tool calls), counted as it is "
     "built; beyond, the request ends with 400 reply_too_large and its generation is cancelled"},
    {"max-prompt-tokens", CONFIG_INT, "0", 0, 1 << 24, "longest prompt accepted (0: the targets' context less one)"},
    {"max-tokens-limit", CONFIG_INT, "0", 0, 1 << 24, "largest max_tokens accepted (0: the targets' context)"},
    {"default-max-tokens", CONFIG_INT, "512", 1, 1 << 24,
     "max_tokens of a request that gives none (capped by the context left)"},
    {"health-interval-ms", CONFIG_INT, "1000", 50, 600000,
     "how often each target (and its draft) is asked Health and Info"},
    {"idle-timeout-s", CONFIG_INT, "60", 1, 86400, "an HTTP connection without a complete request this long is closed"},
    {"max-frame-mib", CONFIG_INT, "64", 1, 1024, "largest RPC frame, MiB"},
    {"log-interval-s", CONFIG_INT, "5", 0, 3600, "seconds between load lines (0: none)"},
    {"drain-timeout-s", CONFIG_INT, "30", 0, 3600, "on SIGTERM, how long requests in flight may take to finish"},
    {"log-level", CONFIG_STRING, "info", 0, 0, "debug, info, warn, error or off"},
};

/* The file's name without directories and without ".gguf". */
static void default_name(const char *path, char *out, size_t cap) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    const char *base = path;
    for (size_t i = 0; i < n; i++)
        if (path[i] == '/') base = path + i + 1;
    size_t len = (size_t)(path + n - base);
    if (len > 5 && strncmp(base + len - 5, ".gguf", 5) == 0) len -= 5;
    snprintf(out, cap, "%.*s", (int)len, base);
}

/* Splits text at commas into at most max trimmed, non-empty pieces
 * (written into text itself). */
static int split_list(char *text, char sep, char **out, int max, ae_error *err) {
    int n = 0;
    for (char *s = text, *next; s; s = next) {
        next = strchr(s, sep);
        if (next) *next++ = '\0';
        while (isspace((unsigned char)*s)) s++;
        char *e = s + strlen(s);
        while (e > s && isspace((unsigned char)e[-1])) *--e = '\0';
        if (!*s) continue;
        if (n == max) return err_set(err, "more than %d entries", max);
        out[n++] = s;
    }
    return n;
}

static double mib(uint64_t b) { return (double)b / (1024.0 * 1024.0); }

/* The gateway holds no model, only buffers: each connection may hold a
 * request head, a body and unsent reply bytes (up to max_out, plus the one
 * reply that may go past it: http.c drops the client only beyond that; a
 * whole reply is at most the larger of /tokenize's GATEWAY_MAX_REPLY_BYTES and
 * max-reply-bytes), each generation request answered whole the pieces of
 * its reply (at most max-reply-bytes, generate.c) and at its end the body
 * written from them, and each tokenizer worker what one body costs it
 * (gateway.h). The worst case is stated as arithmetic and must fit in half
 * the machine's memory. */
static int plan_memory(const config *c, char *text, size_t cap, ae_error *err) {
    uint64_t conns = (uint64_t)config_int(c, "max-conns"), body = (uint64_t)config_int(c, "max-body-bytes");
    uint64_t inflight = (uint64_t)config_int(c, "max-inflight"), reply = (uint64_t)config_int(c, "max-reply-bytes");
    uint64_t whole = reply > GATEWAY_MAX_REPLY_BYTES ? reply : GATEWAY_MAX_REPLY_BYTES;
    uint64_t per = GATEWAY_MAX_HEAD_BYTES + body + GATEWAY_MAX_UNSENT_BYTES + whole, http = conns * per;
    uint64_t building = inflight * 2 * reply;
    uint64_t worker = GATEWAY_TOK_WORKER_BYTES(body), workers = GATEWAY_TOK_WORKERS * worker,
             total = http + building + workers;
    uint64_t phys = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
    snprintf(text, cap,
             "http buffers, worst case = max-conns %llu x (head %.2f MiB + body %.2f MiB + unsent %.2f MiB + "
             "reply %.2f MiB) = %.1f MiB; replies being built = max-inflight %llu x 2 x %.2f MiB = %.1f MiB; "
             "tokenizer workers = %d x %.2f MiB = %.1f MiB; total = %.1f MiB (%.1f%% of %.1f MiB of memory)",
             (unsigned long long)conns, mib(GATEWAY_MAX_HEAD_BYTES), mib(body), mib(GATEWAY_MAX_UNSENT_BYTES),
             mib(whole), mib(http), (unsigned long long)inflight, mib(reply), mib(building), GATEWAY_TOK_WORKERS,
             mib(worker), mib(workers), mib(total), phys ? 100.0 * (double)total / (double)phys : 0.0, mib(phys));
    if (phys && total > phys / 2) {
        uint64_t half = phys / 2;
        return err_set(err,
                       "memory plan: %s; it must stay under half of memory: lower --max-conns to %llu or "
                       "--max-inflight to %llu, or --max-body-bytes or --max-reply-bytes",
                       text, (unsigned long long)(half > workers + building ? (half - workers - building) / per : 0),
                       (unsigned long long)(half > workers + http ? (half - workers - http) / (2 * reply) : 0));
    }
    return AE_OK;
}

int main(int argc, char **argv) {
    svc_signals_init();
    svc_loading_begin();
    log_set_level(LOG_INFO);
    ae_error err = {{0}};
    config *c = NULL;
    tok_file cm = {0};
    chat_template *ct = NULL;
    rpc_loop *loop = NULL;
    watchdog *w = NULL;
    router *rt = NULL;
    gateway *g = NULL;
    char *targets_text = NULL, *keys_text = NULL, *config_json = NULL;
    bool print_config, help;
    int rc = 2;
    if (svc_config_load(&c, "aerie-gateway", opts, sizeof opts / sizeof opts[0], argc, argv, &print_config, &help,
                        &err) != AE_OK)
        goto out;
    if (help) {
        rc = 0;
        goto out;
    }
    const char *model_path = config_str(c, "model");
    if (!model_path) {
        err_set(&err, "no model given (use --model FILE): the gateway needs its tokenizer");
        goto out;
    }
    if (config_is_auto(c, "model-name")) {
        char name[256];
        default_name(model_path, name, sizeof name);
        config_set_auto_str(c, "model-name", name);
    }
    if (config_is_auto(c, "targets")) {
        char addr[256];
        /* The target makes the directory; the gateway only checks it. */
        if (rpc_default_addr(addr, sizeof addr, "aerie-target.sock", false, &err) != AE_OK) goto out;
        config_set_auto_str(c, "targets", addr);
    }
    if (print_config) {
        svc_print_config(c);
        rc = 0;
        goto out;
    }
    targets_text = strdup(config_str(c, "targets"));
    char *targets[ROUTER_MAX_TARGETS];
    int n_targets = targets_text ? split_list(targets_text, ',', targets, ROUTER_MAX_TARGETS, &err) : 0;
    if (n_targets <= 0) {
        err_set(&err, "no targets given (--targets unix:PATH or HOST:PORT, comma-separated)");
        err_prefix(&err, "targets: ");
        goto out;
    }
    char *keys[GATEWAY_MAX_API_KEYS];
    int n_keys = 0;
    const char *key_file = config_str(c, "api-key-file");
    if (key_file) {
        size_t len;
        if (file_read_all(key_file, 1 << 20, &keys_text, &len, NULL, &err) != AE_OK) goto out;
        n_keys = split_list(keys_text, '\n', keys, GATEWAY_MAX_API_KEYS, &err);
        if (n_keys <= 0) {
            err_set(&err, "%s: no API keys in it", key_file);
            goto out;
        }
    }
    char plan[768];
    if (plan_memory(c, plan, sizeof plan, &err) != AE_OK) goto out;
    config_log(c, "aerie-gateway");
    LOG_INFOF("memory_plan %s", plan);
    if (tok_file_open(&cm, model_path, &err) != AE_OK) goto out;
    ae_error cerr = {{0}};
    if (chat_template_init(&ct, tok_chat_template(cm.tok), &cerr) != AE_OK)
        LOG_WARNF("no_chat_template model=%s reason=\"%s\" effect=\"/v1/chat/completions answers 400; "
                  "/v1/completions works\"",
                  model_path, cerr.msg);
    if (rpc_loop_start(&loop, &err) != AE_OK) goto out;
    if (watchdog_init(&w, watchdog_env_interval_us(), &err) != AE_OK ||
        watchdog_watch_base(w, rpc_loop_base(loop), "rpc", &err) != AE_OK)
        goto out;
    router_config rc_cfg = {(const char *const *)targets,
                            n_targets,
                            {config_str(c, "tls-cert"), config_str(c, "tls-key"), config_str(c, "tls-ca")},
                            (uint32_t)config_int(c, "max-frame-mib") << 20,
                            (int)config_int(c, "health-interval-ms")};
    if (router_open(&rt, loop, &rc_cfg, &err) != AE_OK) goto out;
    config_json = config_to_json(c);
    gateway_config gc = {
        .host = config_str(c, "host"),
        .port = (int)config_int(c, "port"),
        .model_name = config_str(c, "model-name"),
        .tok = cm.tok,
        .chat = ct,
        .router = rt,
        .max_conns = (int)config_int(c, "max-conns"),
        .max_body_bytes = (size_t)config_int(c, "max-body-bytes"),
        .max_inflight = (int)config_int(c, "max-inflight"),
        .max_reply_bytes = (size_t)config_int(c, "max-reply-bytes"),
        .max_prompt_tokens = (int32_t)config_int(c, "max-prompt-tokens"),
        .max_tokens_limit = (int32_t)config_int(c, "max-tokens-limit"),
        .default_max_tokens = (int32_t)config_int(c, "default-max-tokens"),
        .idle_timeout_ms = (int)config_int(c, "idle-timeout-s") * 1000,
        .api_keys = (const char *const *)keys,
        .n_api_keys = n_keys,
        .config_json = config_json,
        .memory_plan = plan,
        .log_interval_ms = (int)config_int(c, "log-interval-s") * 1000,
    };
    if (gateway_open(&g, loop, &gc, &err) != AE_OK) goto out;
    LOG_INFOF("gateway_ready url=http://%s:%d model=%s targets=%d api_keys=%d chat_template=%s", gc.host,
              gateway_port(g), gc.model_name, n_targets, n_keys, ct ? chat_variant_name(ct) : "none");
    svc_loading_end();
    svc_notify("READY=1");
    if (watchdog_start(w, &err) != AE_OK) goto out;
    int sig = svc_wait_signal();
    svc_notify("STOPPING=1");
    watchdog_stop(w);
    LOG_INFOF("gateway_stopping signal=%d inflight=%d", sig, gateway_inflight(g));
    gateway_set_draining(g);
    int64_t t0 = clock_mono_ns();
    int64_t limit_ms = config_int(c, "drain-timeout-s") * 1000;
    for (;;) {
        int n = gateway_inflight(g);
        int64_t ms = (clock_mono_ns() - t0) / 1000000;
        if (n == 0 || ms >= limit_ms) {
            LOG_INFOF("gateway_stopped unfinished=%d drain_ms=%lld", n, (long long)ms);
            break;
        }
        nanosleep(&(struct timespec){0, 20 * 1000 * 1000}, NULL);
    }
    rc = 0;
out:
    if (rc != 0 && err_is_set(&err)) fprintf(stderr, "aerie-gateway: %s\n", err.msg);
    watchdog_free(w); /* its timer lives on the loop, freed below */
    gateway_close(g); /* clients of requests still open see their connection close */
    router_close(rt); /* calls still open end, and their requests with them */
    gateway_free(g);
    rpc_loop_free(loop);
    chat_template_free(ct);
    tok_file_close(&cm);
    free(config_json);
    free(keys_text);
    free(targets_text);
    config_free(c);
    return rc;
}
