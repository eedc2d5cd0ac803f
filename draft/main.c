/* aerie-draft: the EAGLE-3 head as a service (draft/draft_server.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kernels/device.h"
#include "../services/core/hostmem.h"
#include "../services/core/log.h"
#include "../services/core/pool.h"
#include "../services/core/svc.h"
#include "../services/core/watchdog.h"
#include "../services/model/embedding.h"
#include "draft_server.h"

static const config_option opts[] = {
    {"model", CONFIG_STRING, NULL, 0, 0,
     "the target model (.gguf or Hugging Face directory): the head reads its embedding table"},
    {"device", CONFIG_STRING, "auto", 0, 0,
     "where the head runs: auto (cuda:0 when build/libaerie-cuda.so loads and a GPU is usable, else cpu), cpu, "
     "cuda or cuda:N (its own GPU, beside the target's)"},
    {"draft", CONFIG_STRING, "auto", 0, 0,
     "EAGLE-3 head directory (auto: the head trained for this model file, found beside it)"},
    {"draft-weights", CONFIG_STRING, "q8_0", 0, 0,
     "the head's matrices rounded to Q8_0 (q8_0: half the bytes per draft pass), or as the file has them (file)"},
    {"listen", CONFIG_STRING, "auto", 0, 0,
     "address: unix:PATH or HOST:PORT (auto: aerie-draft.sock in a private runtime directory, rpc.h)"},
    {"tls-cert", CONFIG_STRING, NULL, 0, 0, "TLS 1.3 certificate chain (PEM); with tls-key, the link is TLS"},
    {"tls-key", CONFIG_STRING, NULL, 0, 0, "TLS private key (PEM)"},
    {"tls-client-ca", CONFIG_STRING, NULL, 0, 0, "demand client certificates signed by this CA (mutual TLS)"},
    {"max-seqs", CONFIG_INT, "256", 64, 4096,
     "sequences whose draft state is kept at once (least recently used evicted)"},
    {"max-seq-len", CONFIG_INT, "4096", 64, 1 << 24, "pairs of draft state one sequence keeps"},
    {"max-frame-mib", CONFIG_INT, "64", 1, 1024, "largest RPC frame accepted, MiB"},
    {"max-conns", CONFIG_INT, "256", 1, 65536, "connections open at once"},
    {"threads", CONFIG_INT, "auto", 1, POOL_MAX_THREADS,
     "compute threads (auto: the CPUs this process may use; beside a draft or target on the same cores too, "
     "since the two take turns within each step: README, Threads)"},
    SVC_ACT_BITS_OPTION,
    {"mem-fraction", CONFIG_DOUBLE, "auto", 0.01, 1.0,
     "fraction of available memory to use (auto: leave the system max(1 GiB, 10%))"},
    {"log-level", CONFIG_STRING, "info", 0, 0, "debug, info, warn, error or off"},
};

/* The plan: the target's embedding table + head + drafter state, against
 * mem-fraction x available: the host's memory, or on a GPU what was free
 * on it when it was opened. */
static int plan_memory(config *c, const kn_device *dev, const embedding *m, const eagle_head *h,
                       const draft_server_config *dc, char *text, size_t cap, ae_error *err) {
    uint64_t avail;
    char where[64] = "available";
    if (dev->kind == KN_DEVICE_CUDA) {
        avail = dev->info.free_bytes;
        snprintf(where, sizeof where, "free on %s at start", dev->name);
    } else if (hostmem_available(&avail, err) != AE_OK) {
        return AE_ERR;
    }
    if (config_is_auto(c, "mem-fraction")) config_set_auto_double(c, "mem-fraction", hostmem_auto_fraction(avail));
    double frac = config_double(c, "mem-fraction");
    uint64_t budget = (uint64_t)(frac * (double)avail), state = draft_server_bytes(h, dc);
    uint64_t total = m->bytes + h->weight_bytes + state;
    char b[5][32];
    hostmem_fmt_bytes(avail, b[0], 32);
    hostmem_fmt_bytes(budget, b[1], 32);
    hostmem_fmt_bytes(m->bytes, b[2], 32);
    hostmem_fmt_bytes(h->weight_bytes, b[3], 32);
    hostmem_fmt_bytes(state, b[4], 32);
    char tot[32];
    hostmem_fmt_bytes(total, tot, sizeof tot);
    snprintf(text, cap,
             "budget = mem-fraction %.3f x %s %s = %s\n"
             "target model (embedding table) = %s\n"
             "head weights = %s\n"
             "draft state = max-seqs %d x max-seq-len %d pairs of head KV, plus scratch = %s\n"
             "total = %s %s budget",
             frac, where, b[0], b[1], b[2], b[3], dc->max_keys, dc->max_seq_len, b[4], tot,
             total <= budget ? "<=" : ">");
    uint64_t host = draft_server_host_bytes(h, dc);
    if (host && strlen(text) + 96 < cap) {
        char hb[32];
        hostmem_fmt_bytes(host, hb, sizeof hb);
        snprintf(text + strlen(text), cap - strlen(text),
                 "\nhost memory besides = %s (draft probabilities, pass arrays)", hb);
    }
    if (total > budget) {
        uint64_t per_seq = state / (uint64_t)dc->max_keys;
        int64_t fit =
            per_seq
                ? (int64_t)((budget > m->bytes + h->weight_bytes ? budget - m->bytes - h->weight_bytes : 0) / per_seq)
                : 0;
        for (char *p = text; *p; p++)
            if (*p == '\n') *p = ';';
        return err_set(
            err,
            "memory plan does not fit: %s. Lower --max-seqs (about %lld fit) or --max-seq-len, or raise --mem-fraction",
            text, (long long)fit);
    }
    return AE_OK;
}

int main(int argc, char **argv) {
    svc_signals_init();
    svc_loading_begin();
    log_set_level(LOG_INFO);
    ae_error err = {{0}};
    config *c = NULL;
    embedding m = {0};
    kn_device dev;
    eagle_head *h = NULL;
    draft_server *d = NULL;
    rpc_loop *loop = NULL;
    watchdog *w = NULL;
    rpc_server *srv = NULL;
    bool print_config, help;
    int rc = 2;
    if (svc_config_load(&c, "aerie-draft", opts, sizeof opts / sizeof opts[0], argc, argv, &print_config, &help,
                        &err) != AE_OK)
        goto out;
    if (help) {
        rc = 0;
        goto out;
    }
    if (config_is_auto(c, "threads")) config_set_auto_int(c, "threads", pool_cpu_count());
    const char *model_path = config_str(c, "model");
    if (!model_path) {
        err_set(&err, "no model given (use --model FILE)");
        goto out;
    }
    /* The head runs where its copy of the target's embedding table is. */
    if (kn_device_from_cfg(c, &dev, &err) != AE_OK || embedding_open(&m, model_path, dev.be, &err) != AE_OK) goto out;
    if (config_is_auto(c, "listen")) {
        char addr[256];
        if (rpc_default_addr(addr, sizeof addr, "aerie-draft.sock", !print_config, &err) != AE_OK) goto out;
        config_set_auto_str(c, "listen", addr);
    }
    eagle_resolve_dir(c);
    const char *dir = eagle_dir(c);
    if (!dir) {
        err_set(&err, "no EAGLE-3 head: none found beside %s (use --draft DIR)", model_path);
        goto out;
    }
    eagle_weights held_as;
    int32_t act_bits;
    if (eagle_weights_parse(config_str(c, "draft-weights"), &held_as, &err) != AE_OK ||
        svc_act_bits(c, &act_bits, &err) != AE_OK)
        goto out;
    eagle_target t = embedding_of(&m);
    if (eagle_load(&h, dir, &t, held_as, &err) != AE_OK) goto out;
    draft_server_config dc = {(int32_t)config_int(c, "max-seqs"), (int32_t)config_int(c, "max-seq-len"),
                              DRAFT_SERVER_PASS_PAIRS, (int32_t)config_int(c, "threads"), act_bits};
    char plan[2048];
    if (plan_memory(c, &dev, &m, h, &dc, plan, sizeof plan, &err) != AE_OK) goto out;
    if (print_config) {
        svc_print_config(c);
        rc = 0;
        goto out;
    }
    config_log(c, "aerie-draft");
    for (char *line = plan, *nl; line && *line; line = nl ? nl + 1 : NULL) {
        nl = strchr(line, '\n');
        LOG_INFOF("memplan %.*s", nl ? (int)(nl - line) : (int)strlen(line), line);
    }
    if (draft_server_init(&d, h, &dc, &err) != AE_OK) goto out;
    char *json = config_to_json(c);
    draft_server_set_info(d, json, plan);
    free(json);
    rpc_server_config sc = {
        .addr = config_str(c, "listen"),
        .tls = {config_str(c, "tls-cert"), config_str(c, "tls-key"), config_str(c, "tls-client-ca")},
        .max_frame = (uint32_t)config_int(c, "max-frame-mib") << 20,
        .max_conns = (uint32_t)config_int(c, "max-conns"),
        .handler = draft_server_handle,
        .ctx = d,
    };
    if (rpc_loop_start(&loop, &err) != AE_OK || rpc_server_open(&srv, loop, &sc, &err) != AE_OK) goto out;
    /* Watched: the RPC loop and the draft worker. */
    if (watchdog_init(&w, watchdog_env_interval_us(), &err) != AE_OK ||
        watchdog_watch_base(w, rpc_loop_base(loop), "rpc", &err) != AE_OK)
        goto out;
    watchdog_set_process(w);
    draft_server_watch(d, w);
    LOG_INFOF("draft_ready listen=%s head=%s tls=%s client_certs=%s", sc.addr, dir, sc.tls.cert ? "on" : "off",
              sc.tls.ca ? "required" : "off");
    svc_loading_end();
    svc_notify("READY=1");
    if (watchdog_start(w, &err) != AE_OK) goto out;
    int sig = svc_wait_signal();
    svc_notify("STOPPING=1");
    watchdog_stop(w);
    LOG_INFOF("draft_stopping signal=%d", sig);
    draft_server_drain(d);
    draft_server_stats st = draft_server_get_stats(d);
    LOG_INFOF("draft_stopped calls=%llu seqs=%llu trees=%llu state_gone=%llu evictions=%llu errors=%llu",
              (unsigned long long)st.calls, (unsigned long long)st.seqs, (unsigned long long)st.trees,
              (unsigned long long)st.state_gone, (unsigned long long)st.evictions, (unsigned long long)st.errors);
    rc = 0;
out:
    if (rc != 0 && err_is_set(&err)) fprintf(stderr, "aerie-draft: %s\n", err.msg);
    rpc_server_close(srv);
    draft_server_free(d); /* joins the worker, which beats w */
    watchdog_free(w);     /* its timer lives on the loop, freed below */
    rpc_loop_free(loop);
    eagle_free(h);
    embedding_close(&m);
    config_free(c);
    return rc;
}
