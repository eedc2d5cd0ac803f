/* aerie-target: the model as a service (target/target_server.h, sched.h), with
 * speculation against an aerie-draft service when one is configured. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../services/core/log.h"
#include "../services/core/pool.h"
#include "../services/core/svc.h"
#include "../services/core/watchdog.h"
#include "../services/core/clock.h"
#include "../services/tokenizer/tok_file.h"
#include "draft_client.h"
#include "memplan.h"
#include "sched.h"
#include "target_server.h"
#include "setup.h"

static const config_option opts[] = {
    {"model", CONFIG_STRING, NULL, 0, 0, "model: .gguf file or Hugging Face directory"},
    {"device", CONFIG_STRING, "auto", 0, 0,
     "where the model runs: auto (cuda:0 when build/libaerie-cuda.so loads and a GPU is usable, else cpu), cpu, "
     "cuda or cuda:N"},
    {"listen", CONFIG_STRING, "auto", 0, 0,
     "address: unix:PATH or HOST:PORT (auto: aerie-target.sock in a private runtime directory, rpc.h)"},
    {"tls-cert", CONFIG_STRING, NULL, 0, 0, "TLS 1.3 certificate chain (PEM); with tls-key, the link is TLS"},
    {"tls-key", CONFIG_STRING, NULL, 0, 0, "TLS private key (PEM)"},
    {"tls-client-ca", CONFIG_STRING, NULL, 0, 0, "demand client certificates signed by this CA (mutual TLS)"},
    {"draft-addr", CONFIG_STRING, "none", 0, 0,
     "the aerie-draft service (unix:PATH or HOST:PORT), or none: plain decoding"},
    {"draft-tls-ca", CONFIG_STRING, NULL, 0, 0, "speak TLS to the draft; its certificate must chain to this CA"},
    {"draft-tls-cert", CONFIG_STRING, NULL, 0, 0, "client certificate for the draft (mutual TLS)"},
    {"draft-tls-key", CONFIG_STRING, NULL, 0, 0, "client key for the draft"},
    {"draft-deadline-ms", CONFIG_INT, "500", 1, 60000,
     "a step waits this long for the draft's trees, then goes on without"},
    {"spec-steps", CONFIG_INT, "5", 1, 16, "draft tree depth (adaptive: the deepest the policy may pick)"},
    {"spec-topk", CONFIG_INT, "4", 1, 8, "children per expanded node, and the frontier's width (adaptive: the widest)"},
    {"spec-tokens", CONFIG_INT, "8", 2, 64, "tree nodes verified per step, root included (adaptive: the most)"},
    {"spec-adaptive", CONFIG_BOOL, "true", 0, 0,
     "each step's tree (or none) picked within the spec-* bounds by measured cost and acceptance (target/policy.h); "
     "off: always the spec-* tree"},
    MEMPLAN_OPTIONS,
    SETUP_TP_OPTION,
    SETUP_ALLREDUCE_OPTION,
    SETUP_TP_DEVICES_OPTION,
    {"max-queue", CONFIG_INT, "256", 0, 1 << 20,
     "requests waiting for a batch slot; beyond, refused RESOURCE_EXHAUSTED"},
    {"compile-workers", CONFIG_INT, "2", 1, 64,
     "schemas (response_format) compiled at once, each on a thread of its own (target/gcompile.h); compiles given "
     "up on (timed out, cancelled) run to their end beside at most as many more"},
    {"max-compiles", CONFIG_INT, "64", 1, 1 << 20,
     "requests with a response format compiling or waiting, apart from max-queue; beyond, refused RESOURCE_EXHAUSTED"},
    {"compile-timeout-ms", CONFIG_INT, "10000", 100, 600000,
     "a schema's compile may take this long; past it the child is killed and the request refused"},
    {"mask-budget-ms", CONFIG_INT, "500", 0, 3600000,
     "a request's grammar masks may take this long up front (0: no budget), then mask-ms-per-token for each token "
     "position; past it the request is refused"},
    {"mask-ms-per-token", CONFIG_DOUBLE, "2", 0, 1000,
     "a request's grammar masks' time per token position beyond mask-budget-ms, its choices' masks together (a "
     "typical mask takes tens of microseconds)"},
    {"threads", CONFIG_INT, "auto", 1, POOL_MAX_THREADS,
     "compute threads (auto: the CPUs this process may use; beside a draft or target on the same cores too, "
     "since the two take turns within each step: README, Threads)"},
    SVC_ACT_BITS_OPTION,
    {"max-frame-mib", CONFIG_INT, "64", 1, 1024, "largest RPC frame, MiB"},
    {"max-conns", CONFIG_INT, "1024", 1, 65536, "connections open at once"},
    {"log-interval-s", CONFIG_INT, "5", 0, 3600, "seconds between load lines (0: none)"},
    {"drain-timeout-s", CONFIG_INT, "30", 0, 3600, "on SIGTERM, how long running requests may take to finish"},
    {"log-level", CONFIG_STRING, "info", 0, 0, "debug, info, warn, error or off"},
};

int main(int argc, char **argv) {
    svc_signals_init();
    svc_loading_begin();
    log_set_level(LOG_INFO);
    ae_error err = {{0}};
    config *c = NULL;
    model *m = NULL;
    engine *e = NULL;
    spec *sx = NULL;
    draft_client *dc = NULL;
    sched *sc = NULL;
    target_server *ts = NULL;
    rpc_loop *loop = NULL;
    watchdog *w = NULL;
    rpc_server *srv = NULL;
    tok_file tf = {0};
    grammar_vocab *gv = NULL;
    bool print_config, help;
    int rc = 2;
    if (setup_service(&c, &m, "aerie-target", opts, sizeof opts / sizeof opts[0], argc, argv, &print_config, &help,
                      &err) != AE_OK)
        goto out;
    if (help) {
        rc = 0;
        goto out;
    }
    if (config_is_auto(c, "listen")) {
        char addr[256];
        if (rpc_default_addr(addr, sizeof addr, "aerie-target.sock", !print_config, &err) != AE_OK) goto out;
        config_set_auto_str(c, "listen", addr);
    }
    int32_t act_bits;
    if (svc_act_bits(c, &act_bits, &err) != AE_OK) goto out;
    const char *model_path = config_str(c, "model");
    const char *draft_addr = config_str(c, "draft-addr");
    bool drafting = draft_addr && strcmp(draft_addr, "none") != 0;
    int32_t max_batch = (int32_t)config_int(c, "max-batch");
    spec_shape shape = {(int32_t)config_int(c, "spec-steps"), (int32_t)config_int(c, "spec-topk"),
                        (int32_t)config_int(c, "spec-tokens")};
    spec_config spc = spec_config_default(shape, max_batch, SETUP_PREFILL_CHUNK);
    spc.adaptive = drafting && config_bool(c, "spec-adaptive");
    capture_default_layers(m->cfg.n_layers, spc.capture);
    memplan plan;
    /* weights + a prefill chunk's workspace + speculation's per-sequence
     * state + KV (memplan.h) */
    if (setup_plan(c, m, 0, spec_bytes(m, &spc), &plan, &err) != AE_OK) goto out;
    if (print_config) {
        svc_print_config(c);
        rc = 0;
        goto out;
    }
    config_log(c, "aerie-target");
    memplan_log(&plan);
    setup_log_weights(c, m);
    int32_t threads = (int32_t)config_int(c, "threads");
    if (setup_engine(&e, c, m, &plan, threads, act_bits, &err) != AE_OK) goto out;
    /* The end-of-sequence token comes from the model's tokenizer. */
    int32_t eos = -1;
    if (tok_file_open(&tf, model_path, NULL) == AE_OK) {
        eos = tok_eos(tf.tok);
        /* Structured output's automaton over the vocabulary, built once. */
        int64_t t0 = clock_mono_ns();
        if (grammar_vocab_init(&gv, tf.tok, m->cfg.vocab, eos, &err) != AE_OK) goto out;
        LOG_INFOF("grammar_ready vocab=%d ms=%.1f", m->cfg.vocab, (double)(clock_mono_ns() - t0) / 1e6);
    } else
        LOG_WARNF(
            "no_tokenizer model=%s reason=\"no end-of-sequence token known: only max_tokens and stop tokens end a request\"",
            model_path);
    if (rpc_loop_start(&loop, &err) != AE_OK) goto out;
    /* Watched: the RPC loop and the scheduler thread (it beats watchdog_process()). */
    if (watchdog_init(&w, watchdog_env_interval_us(), &err) != AE_OK ||
        watchdog_watch_base(w, rpc_loop_base(loop), "rpc", &err) != AE_OK)
        goto out;
    watchdog_set_process(w);
    if (drafting) {
        draft_client_config dcc = {
            draft_addr,
            {config_str(c, "draft-tls-cert"), config_str(c, "draft-tls-key"), config_str(c, "draft-tls-ca")},
            (uint32_t)config_int(c, "draft-deadline-ms") * 1000,
            (uint32_t)config_int(c, "max-frame-mib") << 20,
            FORWARD_MAX_CAPTURE * m->cfg.hidden,
            {spc.capture[0], spc.capture[1], spc.capture[2]},
            m->cfg.vocab};
        if (draft_client_open(&dc, loop, &dcc, &err) != AE_OK) goto out;
    }
    if (spec_init(&sx, e, dc ? draft_client_drafter(dc) : NULL, &spc, &err) != AE_OK) goto out;
    sched_sink sink;
    if (target_server_init(&ts, m->cfg.vocab, dc, sx, &sink, &err) != AE_OK) goto out;
    sched_config scc = {max_batch,
                        (int32_t)config_int(c, "max-queue"),
                        SETUP_PREFILL_CHUNK,
                        plan.max_seq_len,
                        drafting ? spc.shape.tokens : 1,
                        eos,
                        (int32_t)config_int(c, "log-interval-s") * 1000,
                        drafting,
                        gv,
                        (int32_t)config_int(c, "compile-workers"),
                        (int32_t)config_int(c, "max-compiles"),
                        {true, config_int(c, "compile-timeout-ms"), 2 * (int32_t)config_int(c, "compile-workers"), 100},
                        config_int(c, "mask-budget-ms"),
                        config_double(c, "mask-ms-per-token")};
    if (sched_init(&sc, sx, e, &scc, &sink, &err) != AE_OK) goto out;
    target_server_attach(ts, sc);
    char *json = config_to_json(c);
    target_server_set_info(ts, json, plan.text);
    free(json);
    rpc_server_config rsc = {
        .addr = config_str(c, "listen"),
        .tls = {config_str(c, "tls-cert"), config_str(c, "tls-key"), config_str(c, "tls-client-ca")},
        .max_frame = (uint32_t)config_int(c, "max-frame-mib") << 20,
        .max_conns = (uint32_t)config_int(c, "max-conns"),
        .handler = target_server_handle,
        .ctx = ts,
    };
    if (rpc_server_open(&srv, loop, &rsc, &err) != AE_OK) goto out;
    LOG_INFOF("target_ready listen=%s model=%s draft=%s max_batch=%d kv_tokens=%lld tls=%s client_certs=%s", rsc.addr,
              model_path, drafting ? draft_addr : "none", max_batch, (long long)plan.kv_tokens,
              rsc.tls.cert ? "on" : "off", rsc.tls.ca ? "required" : "off");
    svc_loading_end();
    svc_notify("READY=1");
    if (watchdog_start(w, &err) != AE_OK) goto out;
    int sig = svc_wait_signal();
    svc_notify("STOPPING=1");
    watchdog_stop(w);
    LOG_INFOF("target_stopping signal=%d", sig);
    target_server_set_draining(ts);
    sched_drain(sc, config_int(c, "drain-timeout-s") * 1000);
    sched_stats st = sched_get_stats(sc);
    LOG_INFOF("target_stopped requests=%llu cancelled=%llu refused=%llu tokens=%llu",
              (unsigned long long)st.requests_done, (unsigned long long)st.requests_cancelled,
              (unsigned long long)st.requests_refused, (unsigned long long)st.tokens_out);
    rc = 0;
out:
    if (rc != 0 && err_is_set(&err)) fprintf(stderr, "aerie-target: %s\n", err.msg);
    /* The server first: it cancels the calls still open and returns once
     * the scheduler (still running) has finished them, so no handler can
     * reach the scheduler after it is freed. */
    rpc_server_close(srv);
    sched_free(sc);   /* ends what is left */
    watchdog_free(w); /* after the scheduler that beats it, before the loop it times */
    draft_client_close(dc);
    rpc_loop_free(loop);
    target_server_free(ts);
    spec_free(sx);
    engine_free(e);
    grammar_vocab_free(gv);
    tok_file_close(&tf);
    model_free(m);
    config_free(c);
    /* A compile given up on may still run (gcompile.h): nothing waits for
     * it, and the C++ runtime's exit handlers must not run under it. */
    if (gcompile_live() > 0) {
        fflush(NULL);
        _exit(rc);
    }
    return rc;
}
