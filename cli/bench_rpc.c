/* aerie bench-rpc: what the RPC link adds to a speculative step.
 *
 * One process holds an aerie-draft service (draft/draft_server.h on the real
 * head) listening on a Unix socket, on TCP and, with certificates, on TLS
 * with client certificates; and a client for each, on an RPC loop of its
 * own as in the target (one loop serving both ends would read the reply
 * on the thread that just sent it). The same Propose (8
 * sequences x 8 pairs of features by default, every sequence reset so
 * that each call does the same work) goes round robin in-process (the
 * service's own function, no link) and over each transport.
 *
 * The draft's compute time is the same on every path and is reported by
 * the service with each reply (server_ns), so the link's cost per call is
 * measured as (round trip - server_ns) against (in-process call -
 * server_ns): message encoding and decoding, the payload's copies, the
 * socket and the thread hand-offs. Wall-clock figures on a busy host
 * mostly measure its run queue: each thread that sleeps and is woken may
 * wait for a core. So the context switches of the whole process per call
 * (both ends of the link live here) are counted too: a count of the
 * hand-offs that does not move with the load.
 *
 * The floor: the same exchange with none of the link's code, in the same
 * rounds. The caller writes a frame's bytes (header, message, pad,
 * payload) to a Unix socket pair in one writev and blocks in read(); a
 * thread of its own, woken by them, makes the in-process call on them
 * and writes back the reply. What that costs beyond the in-process call
 * is what any link between two threads pays here: the copies, and the
 * kernel's and the host's two wake-ups, which on a virtual machine grow
 * with how long the woken core slept. So the Unix path's `over_floor`
 * (its added figure less the floor's) is the link's own code. One JSON
 * line of p50, p90 and p99 figures. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "../draft/draft_server.h"
#include "../services/core/file.h"
#include "../services/core/log.h"
#include "../services/core/svc.h"
#include "../services/rpc/frame.h"
#include "../services/rpc/msg.h"
#include "aerie.pb.h"
#include "cli.h"
#include "plan.h"

static const config_option opts[] = {
    {"model", CONFIG_STRING, NULL, 0, 0, "the target model (the head reads its embeddings)"},
    {"draft", CONFIG_STRING, "auto", 0, 0, "EAGLE-3 head directory (auto: the head trained for the model)"},
    {"seqs", CONFIG_INT, "8", 1, 64, "sequences per Propose"},
    {"pairs", CONFIG_INT, "8", 1, 256, "pairs of features per sequence"},
    {"iters", CONFIG_INT, "300", 10, 1000000, "calls per path"},
    {"threads", CONFIG_INT, "1", 1, 256, "the draft's compute threads"},
    {"tls-cert", CONFIG_STRING, NULL, 0, 0, "server certificate: adds the TLS path (with tls-key and tls-ca)"},
    {"tls-key", CONFIG_STRING, NULL, 0, 0, "server key"},
    {"tls-ca", CONFIG_STRING, NULL, 0, 0, "CA of both certificates (mutual TLS)"},
    {"tls-client-cert", CONFIG_STRING, NULL, 0, 0, "client certificate"},
    {"tls-client-key", CONFIG_STRING, NULL, 0, 0, "client key"},
    {"log-level", CONFIG_STRING, "warn", 0, 0, "debug, info, warn, error or off"},
};

static double now_us(void) { return clock_mono_seconds() * 1e6; }

static double pct(double *v, int n, double p) {
    qsort(v, (size_t)n, sizeof *v, cli_cmp_double);
    int i = (int)floor(p * (n - 1) + 0.5);
    return v[i];
}

typedef struct path {
    const char *name;
    rpc_client *cli;
    double *total, *link; /* [iters] microseconds */
    long switches;        /* the process's context switches during the calls */
} path;

/* The floor's far end: reads a request frame's bytes, makes the same
 * in-process call on them, and writes back a header (the reply's length
 * and the draft's time) and the reply; ends when the caller shuts its
 * end. */
typedef struct floor_peer {
    int fd;
    draft_server *d;
    uint32_t head_len, msg_len, payload_len;
    uint8_t *req, *rep; /* head_len + payload_len; FRAME_HEADER + rep_cap */
    uint32_t rep_cap;
    ae_error err;
} floor_peer;

static void *floor_main(void *arg) {
    floor_peer *f = arg;
    while (file_read_full(f->fd, f->req, (size_t)f->head_len + f->payload_len) == 0) {
        uint32_t olen = 0;
        uint64_t t0 = (uint64_t)(now_us() * 1e3);
        uint32_t st = draft_server_propose(f->d, f->req + FRAME_HEADER, f->msg_len, f->req + f->head_len,
                                           f->payload_len, f->rep + FRAME_HEADER, f->rep_cap, &olen, &f->err);
        uint64_t busy = (uint64_t)(now_us() * 1e3) - t0;
        if (st != RPC_OK) olen = 0; /* the caller reads an empty reply as the failure */
        memcpy(f->rep, &olen, sizeof olen);
        memcpy(f->rep + 8, &busy, sizeof busy);
        if (file_write_full(f->fd, f->rep, FRAME_HEADER + (size_t)olen) != 0) break;
    }
    return NULL;
}

/* One floor exchange: the frame out in one writev, as the link sends
 * one, and the reply read back. Returns the reply's length, 0 on a
 * failure. */
static uint32_t floor_call(int fd, const uint8_t *head, size_t head_len, const uint8_t *payload, size_t plen,
                           uint8_t *rep) {
    struct iovec iov[2] = {{(void *)head, head_len}, {(void *)payload, plen}};
    ssize_t k = writev(fd, iov, 2);
    if (k < 0) return 0;
    size_t done = (size_t)k; /* a short write (the socket's buffer): the rest plainly */
    if (done < head_len && file_write_full(fd, head + done, head_len - done) != 0) return 0;
    size_t from = done > head_len ? done - head_len : 0;
    if (from < plen && file_write_full(fd, payload + from, plen - from) != 0) return 0;
    uint32_t olen;
    if (file_read_full(fd, rep, FRAME_HEADER) != 0) return 0;
    memcpy(&olen, rep, sizeof olen);
    return olen && file_read_full(fd, rep + FRAME_HEADER, olen) == 0 ? olen : 0;
}

static long switches_now(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_nvcsw + ru.ru_nivcsw;
}

static int run(const config *cc, int argc, char **argv, ae_error *err) {
    config *c = (config *)cc;
    if (argc > 0) return err_set(err, "unexpected argument \"%s\"", argv[0]), CLI_EXIT_USAGE;
    svc_signals_init(); /* as the services run: SIGPIPE ignored, large buffers kept in the heap */
    int rc = CLI_EXIT_USAGE;
    model *m = NULL;
    eagle_head *h = NULL;
    draft_server *d = NULL;
    rpc_loop *loop = NULL, *cloop = NULL; /* the servers', the clients' (two processes in a deployment) */
    rpc_server *srv[3] = {0};
    path paths[4] = {{"in_process", NULL, NULL, NULL, 0},
                     {"unix", NULL, NULL, NULL, 0},
                     {"tcp", NULL, NULL, NULL, 0},
                     {"tls", NULL, NULL, NULL, 0}};
    int n_paths = 3;
    path fl = {"floor", NULL, NULL, NULL, 0};
    int fds[2] = {-1, -1};
    floor_peer peer = {0};
    pthread_t floor_thread;
    bool floor_started = false;
    uint8_t *fl_head = NULL, *fl_rep = NULL;
    uint8_t *msg = NULL, *payload = NULL, *out = NULL;
    rpc_reply reply = {0};
    char sock[128];
    snprintf(sock, sizeof sock, "unix:/tmp/aerie-bench-rpc-%d.sock", (int)getpid());

    const char *model_path = config_str(c, "model");
    if (!model_path) {
        err_set(err, "no model given (use --model FILE)");
        goto out;
    }
    if (model_load(&m, model_path, &kn_backend_cpu, err) != AE_OK) goto out;
    eagle_resolve_dir(c);
    const char *dir = eagle_dir(c);
    if (!dir) {
        err_set(err, "no EAGLE-3 head found for %s (use --draft DIR)", model_path);
        goto out;
    }
    eagle_target t = model_embedding(m);
    if (eagle_load(&h, dir, &t, EAGLE_WEIGHTS_Q8_0, err) != AE_OK) goto out;
    int32_t S = (int32_t)config_int(c, "seqs"), P = (int32_t)config_int(c, "pairs"),
            iters = (int32_t)config_int(c, "iters");
    draft_server_config dc = {64, 512, SETUP_PREFILL_CHUNK, (int32_t)config_int(c, "threads"), 0};
    if (draft_server_init(&d, h, &dc, err) != AE_OK) goto out;

    /* The request: S sequences, each reset with P pairs. */
    int32_t fw = 3 * m->cfg.hidden, layers[3];
    capture_default_layers(m->cfg.n_layers, layers);
    if (h->cfg.n_aux_layers) memcpy(layers, h->cfg.aux_layers, sizeof layers);
    size_t per_seq = (size_t)P * 4 + (size_t)P * (size_t)fw * 4, plen = per_seq * (size_t)S;
    static aerie_ProposeRequest rq;
    rq.client = 1;
    rq.has_shape = true;
    rq.shape = (aerie_TreeShape){5, 4, 8};
    rq.feature_width = (uint32_t)fw;
    rq.capture_layers_count = 3;
    for (int i = 0; i < 3; i++) rq.capture_layers[i] = (uint32_t)layers[i];
    rq.seqs_count = (pb_size_t)S;
    payload = aligned_alloc(16, (plen + 15) / 16 * 16);
    msg = malloc(aerie_ProposeRequest_size);
    out = malloc(aerie_ProposeReply_size + 64);
    fl.total = calloc((size_t)iters, sizeof(double));
    if (!fl.total) payload = NULL;
    for (int p = 0; p < 4; p++) {
        paths[p].total = calloc((size_t)iters, sizeof(double));
        paths[p].link = calloc((size_t)iters, sizeof(double));
        if (!paths[p].total || !paths[p].link) payload = NULL;
    }
    if (!payload || !msg || !out) {
        err_set(err, "out of memory");
        goto out;
    }
    uint64_t x = 88172645463325252ull;
    for (int32_t s = 0; s < S; s++) {
        uint8_t *base = payload + per_seq * (size_t)s;
        int32_t *ids = (int32_t *)base;
        float *feat = (float *)(base + (size_t)P * 4);
        for (int32_t j = 0; j < P; j++)
            ids[j] = (int32_t)(x % (uint64_t)m->cfg.vocab), x = x * 6364136223846793005ull + 1;
        for (size_t j = 0; j < (size_t)P * (size_t)fw; j++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            feat[j] = (float)((double)(x >> 40) / (double)(1ull << 24) - 0.5);
        }
        uint32_t off = (uint32_t)(per_seq * (size_t)s);
        rq.seqs[s] = (aerie_DraftSeq){(uint32_t)s,
                                      true,
                                      0,
                                      (uint32_t)P,
                                      true,
                                      {off, (uint32_t)P * 4},
                                      true,
                                      {off + (uint32_t)P * 4, (uint32_t)((size_t)P * (size_t)fw * 4)},
                                      true,
                                      false,
                                      0};
    }
    uint32_t mlen, olen;
    if (msg_encode(aerie_ProposeRequest_fields, &rq, msg, aerie_ProposeRequest_size, &mlen, err) != AE_OK) goto out;

    /* The servers and their clients. */
    char tcp_addr[64] = "127.0.0.1:0", tls_addr[64] = "127.0.0.1:0";
    const char *cert = config_str(c, "tls-cert"), *key = config_str(c, "tls-key"), *ca = config_str(c, "tls-ca");
    bool tls = cert && key && ca;
    if (rpc_loop_start(&loop, err) != AE_OK || rpc_loop_start(&cloop, err) != AE_OK) goto out;
    rpc_server_config sc = {.addr = sock, .handler = draft_server_handle, .ctx = d};
    if (rpc_server_open(&srv[0], loop, &sc, err) != AE_OK) goto out;
    sc.addr = tcp_addr;
    if (rpc_server_open(&srv[1], loop, &sc, err) != AE_OK) goto out;
    snprintf(tcp_addr, sizeof tcp_addr, "127.0.0.1:%d", rpc_server_port(srv[1]));
    if (tls) {
        sc.addr = tls_addr;
        sc.tls = (rpc_tls){cert, key, ca};
        if (rpc_server_open(&srv[2], loop, &sc, err) != AE_OK) goto out;
        snprintf(tls_addr, sizeof tls_addr, "127.0.0.1:%d", rpc_server_port(srv[2]));
        n_paths = 4;
    }
    const char *addrs[4] = {NULL, sock, tcp_addr, tls_addr};
    for (int p = 1; p < n_paths; p++) {
        rpc_client_config cc2 = {addrs[p], {0}, 0, 0};
        if (p == 3) cc2.tls = (rpc_tls){config_str(c, "tls-client-cert"), config_str(c, "tls-client-key"), ca};
        if (rpc_client_open(&paths[p].cli, cloop, &cc2, err) != AE_OK) goto out;
        if (!rpc_client_wait_connected(paths[p].cli, 10000)) {
            err_set(err, "cannot connect to %s", addrs[p]);
            goto out;
        }
    }

    /* The floor: a frame's bytes (header, message, pad, payload) on a
     * socket pair to a thread that makes the in-process call. */
    uint32_t fl_head_len = FRAME_HEADER + mlen + (16 - mlen % 16) % 16;
    peer = (floor_peer){-1, d, fl_head_len, mlen, (uint32_t)plen, NULL, NULL, aerie_ProposeReply_size + 64, {{0}}};
    peer.req = malloc((size_t)fl_head_len + plen);
    peer.rep = malloc(FRAME_HEADER + (size_t)peer.rep_cap);
    fl_rep = malloc(FRAME_HEADER + (size_t)peer.rep_cap);
    fl_head = calloc(1, fl_head_len);
    if (!peer.req || !peer.rep || !fl_rep || !fl_head) {
        err_set(err, "out of memory");
        goto out;
    }
    memcpy(fl_head + FRAME_HEADER, msg, mlen);
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
        err_set(err, "socketpair: %s", strerror(errno));
        goto out;
    }
    peer.fd = fds[1];
    if (pthread_create(&floor_thread, NULL, floor_main, &peer) != 0) {
        err_set(err, "cannot start the floor's thread");
        goto out;
    }
    floor_started = true;

    /* Warm up every path, then round robin, the floor last in each round. */
    static aerie_ProposeReply rp;
    for (int it = -5; it < iters; it++) {
        for (int p = 0; p < n_paths; p++) {
            long sw0 = switches_now();
            double t0 = now_us();
            uint64_t server_ns;
            if (p == 0) {
                uint32_t st = draft_server_propose(d, msg, mlen, payload, (uint32_t)plen, out,
                                                   aerie_ProposeReply_size + 64, &olen, err);
                if (st != RPC_OK || msg_decode(aerie_ProposeReply_fields, &rp, out, olen, err) != AE_OK) goto out;
            } else {
                rpc_iov iov = {payload, (uint32_t)plen};
                uint32_t st = rpc_client_callv(paths[p].cli, aerie_Method_DRAFT_PROPOSE, msg, mlen, &iov, 1, 0, NULL,
                                               NULL, &reply);
                if (st != RPC_OK) {
                    err_set(err, "%s: %s: %s", paths[p].name, frame_status_name(st), reply.error);
                    goto out;
                }
                if (msg_decode(aerie_ProposeReply_fields, &rp, reply.msg, reply.msg_len, err) != AE_OK) goto out;
            }
            double total = now_us() - t0;
            if (it >= 0) paths[p].switches += switches_now() - sw0;
            server_ns = rp.server_ns;
            if (rp.trees_count != (pb_size_t)S || rp.trees[0].tokens_count < 2) {
                err_set(err, "%s: a reply without trees", paths[p].name);
                goto out;
            }
            if (it >= 0) {
                paths[p].total[it] = total;
                paths[p].link[it] = total - (double)server_ns / 1e3;
            }
        }
        long sw0 = switches_now();
        double t0 = now_us();
        uint32_t flen = floor_call(fds[0], fl_head, fl_head_len, payload, plen, fl_rep);
        if (!flen) {
            err_set(err, "floor: %s", peer.err.msg[0] ? peer.err.msg : strerror(errno));
            goto out;
        }
        if (msg_decode(aerie_ProposeReply_fields, &rp, fl_rep + FRAME_HEADER, flen, err) != AE_OK) {
            err_prefix(err, "floor: ");
            goto out;
        }
        double total = now_us() - t0;
        uint64_t busy;
        memcpy(&busy, fl_rep + 8, sizeof busy);
        if (it >= 0) fl.total[it] = total - (double)busy / 1e3, fl.switches += switches_now() - sw0;
    }
    /* As the others' added figures: beyond the in-process call's p50. */
    double floor50 = pct(fl.total, iters, 0.5) - pct(paths[0].link, iters, 0.5);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "seqs", S);
    cJSON_AddNumberToObject(o, "pairs_per_seq", P);
    cJSON_AddNumberToObject(o, "payload_bytes", (double)plen);
    cJSON_AddNumberToObject(o, "message_bytes", mlen);
    cJSON_AddNumberToObject(o, "iters", iters);
    double base = 0;
    for (int p = 0; p < n_paths; p++) {
        cJSON *q = cJSON_AddObjectToObject(o, paths[p].name);
        double t50 = pct(paths[p].total, iters, 0.5), l50 = pct(paths[p].link, iters, 0.5),
               l90 = pct(paths[p].link, iters, 0.9), l99 = pct(paths[p].link, iters, 0.99);
        if (p == 0) base = l50;
        cJSON_AddNumberToObject(q, "call_us_p50", cli_round(t50, 10));
        cJSON_AddNumberToObject(q, "outside_draft_us_p50", cli_round(l50, 10));
        cJSON_AddNumberToObject(q, "outside_draft_us_p90", cli_round(l90, 10));
        cJSON_AddNumberToObject(q, "outside_draft_us_p99", cli_round(l99, 10));
        cJSON_AddNumberToObject(q, "switches_per_call", cli_round((double)paths[p].switches / iters, 100));
        if (p > 0) {
            cJSON_AddNumberToObject(q, "added_us_p50", cli_round(l50 - base, 10));
            if (p == 1) cJSON_AddNumberToObject(q, "over_floor_us_p50", cli_round(l50 - base - floor50, 10));
        }
    }
    cJSON *q = cJSON_AddObjectToObject(o, "floor");
    cJSON_AddNumberToObject(q, "added_us_p50", cli_round(floor50, 10));
    cJSON_AddNumberToObject(q, "switches_per_call", cli_round((double)fl.switches / iters, 100));
    char *line = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (line) puts(line);
    cJSON_free(line);
    rc = 0;
out:
    if (fds[0] >= 0) shutdown(fds[0], SHUT_RDWR);
    if (floor_started) pthread_join(floor_thread, NULL);
    for (int i = 0; i < 2; i++)
        if (fds[i] >= 0) close(fds[i]);
    free(peer.req), free(peer.rep), free(fl_head), free(fl_rep), free(fl.total);
    for (int p = 1; p < 4; p++) rpc_client_close(paths[p].cli);
    for (int i = 0; i < 3; i++) rpc_server_close(srv[i]);
    rpc_loop_free(cloop);
    rpc_loop_free(loop);
    for (int p = 0; p < 4; p++) free(paths[p].total), free(paths[p].link);
    rpc_reply_free(&reply);
    free(msg), free(payload), free(out);
    draft_server_free(d);
    eagle_free(h);
    model_free(m);
    return rc;
}

const cli_cmd cli_cmd_bench_rpc = {
    .name = "bench-rpc",
    .args = "--model M",
    .summary = "what the RPC link adds to a Propose (8 seqs x 8 pairs): in-process, Unix, TCP, TLS",
    .opts = opts,
    .n_opts = sizeof opts / sizeof opts[0],
    .run = run,
};
