#include "setup.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../services/core/hostmem.h"
#include "../services/core/pool.h"
#include "../services/core/svc.h"
#include "../services/core/log.h"
#include "../kernels/device.h"
#include "arch.h"
#include "tp.h"

/* The device --device resolved to (one per process). */
static kn_device g_device;

int setup_service(config **c, model **m, const char *service, const config_option *opts, size_t n, int argc,
                  char **argv, bool *print_config, bool *help, ae_error *err) {
    *m = NULL;
    if (svc_config_load(c, service, opts, n, argc, argv, print_config, help, err) != AE_OK) return AE_ERR;
    if (*help) return AE_OK;
    if (config_is_auto(*c, "threads")) config_set_auto_int(*c, "threads", pool_cpu_count());
    if (config_has(*c, "allreduce") && kn_allreduce_parse(config_str(*c, "allreduce")) < 0)
        return err_set(err, "--allreduce %.100s: not one of auto, cpu, nccl, custom", config_str(*c, "allreduce"));
    if (kn_device_from_cfg(*c, &g_device, err) != AE_OK) return AE_ERR;
    const char *path = config_str(*c, "model");
    if (!path) return err_set(err, "no model given (use --model FILE)");
    return model_load(m, path, g_device.be, err);
}

uint64_t setup_tp_work(const config *c, const model *m) {
    int32_t R = config_has(c, "tp") ? (int32_t)config_int(c, "tp") : 1;
    if (R <= 1) return 0;
    const model_config *mc = &m->cfg;
    const int32_t T = SETUP_PREFILL_CHUNK, keys = (int32_t)config_int(c, "max-seq-len");
    tp_split sp;
    ae_error e = {{0}};
    if (m->arch->tp_split(&sp, mc, R, &e) != AE_OK) return 0; /* setup_engine says why */
    /* what tp_group_init takes: the allreduce slots (the CPU's one a rank;
     * on a GPU the custom kind's two, one a parity: NCCL's own buffers are
     * NCCL's, outside the plan), then each rank's activations (rank 0 with
     * the logit rows) and stream scratch */
    uint64_t slots = kn_backend_host_memory(m->be) ? 1 : 2;
    uint64_t ranks = slots * (uint64_t)R * (uint64_t)T * (uint64_t)mc->hidden * sizeof(float);
    for (int32_t r = 0; r < R; r++) {
        model *sh;
        if (tp_shard_init(&sh, m, &sp, r, &e) != AE_OK) return 0;
        ranks += forward_ws_bytes(sh, T, r == 0 ? T : 1) + forward_stream_workspace(sh, T, keys);
        tp_shard_free(sh);
    }
    /* less the engine's own activations, freed while the ranks run */
    uint64_t own = forward_ws_bytes(m, T, T);
    return ranks > own ? ranks - own : 0;
}

void setup_log_allreduces(const model *m, int32_t n_ranks, const char *source) {
    if (n_ranks <= 1) return;
    const model_config *mc = &m->cfg;
    int32_t per_pass = FORWARD_ALLREDUCES_PER_LAYER * mc->n_layers;
    double tok_kib = (double)mc->hidden * sizeof(float) / 1024.0;
    LOG_INFOF("tensor parallel: tp=%d (%s); allreduces = %d per layer x %d layers = %d a pass, each tokens x %d "
              "hidden x 4 bytes: a decode pass of 1 token %d x %.2f KiB, a verify pass of 8 tokens %d x %.2f KiB",
              n_ranks, source, FORWARD_ALLREDUCES_PER_LAYER, mc->n_layers, per_pass, mc->hidden, per_pass, tok_kib,
              per_pass, 8 * tok_kib);
}

/* The ranks' devices from c's "tp-devices" (a list of N, or auto), on
 * the CUDA device dev: bes[r] for each rank, "auto" resolved and logged. */
static kn_device g_rank_dev[TP_MAX_RANKS]; /* the ranks' devices, for the log; tables live in the plugin */

static int tp_gpu_plans(const engine *e, const model *m, int32_t R, const kn_backend **bes, bool fast, ae_error *err);

/* The ranks' GPUs from c's "tp-devices" on the model's CUDA device dev:
 * bes[r] for each rank, each GPU's plan checked (tp_gpu_plans). "auto"
 * takes a GPU a rank from dev's on where they are there, reach each
 * other's memory and their plans fit, and every rank on dev otherwise;
 * it is resolved and logged with why. */
static int tp_devices(config *c, const engine *e, const model *m, const kn_device *dev, int32_t R,
                      const kn_backend **bes, bool fast, ae_error *err) {
    kn_device *opened = g_rank_dev;
    const char *spec = config_has(c, "tp-devices") ? config_str(c, "tp-devices") : "auto";
    char list[CONFIG_MAX_VALUE] = "", name[32];
    if (strcmp(spec, "auto") != 0) {
        const char *at = spec;
        for (int32_t r = 0; r < R; r++) {
            char *end;
            long v = strtol(at, &end, 10);
            if (end == at || v < 0 || v > 1023 || (r < R - 1 ? *end != ',' : *end != '\0'))
                return err_set(err, "--tp-devices %.100s: expected %d device numbers, as 0,1 (or auto)", spec, R);
            at = end + 1;
            snprintf(name, sizeof name, "cuda:%ld", v);
            if (kn_device_open(name, &opened[r], err) != AE_OK) return err_prefix(err, "--tp-devices: "), AE_ERR;
            bes[r] = opened[r].be;
        }
        return tp_gpu_plans(e, m, R, bes, fast, err);
    }
    /* auto: a GPU each from dev's on, where this machine has them */
    ae_error why = {{0}};
    int32_t r = 0;
    for (; r < R; r++) {
        snprintf(name, sizeof name, "cuda:%d", dev->info.index + r);
        if (kn_device_open(name, &opened[r], &why) != AE_OK) break;
        bes[r] = opened[r].be;
    }
    /* and they reach one another (peer access), and their plans fit */
    for (int32_t a = 0; a < R && r == R; a++)
        for (int32_t b = 0; b < R && r == R; b++)
            if (!kn_backend_reads(bes[a], bes[b])) {
                err_set(&why, "no peer access from %s to %s", opened[a].name, opened[b].name);
                r = -1;
            }
    if (r == R && tp_gpu_plans(e, m, R, bes, fast, &why) != AE_OK) r = -1;
    if (r != R) {
        for (r = 0; r < R; r++) bes[r] = dev->be, opened[r] = *dev;
        for (r = 0; r < R; r++)
            snprintf(list + strlen(list), sizeof list - strlen(list), "%s%d", r ? "," : "", dev->info.index);
        LOG_INFOF("tensor parallel: tp-devices %s (auto: every rank on %s; a GPU a rank from cuda:%d did not do: %s)",
                  list, dev->name, dev->info.index, why.msg);
    } else {
        for (r = 0; r < R; r++)
            snprintf(list + strlen(list), sizeof list - strlen(list), "%s%d", r ? "," : "", dev->info.index + r);
        LOG_INFOF("tensor parallel: tp-devices %s (auto: a GPU a rank, from %s)", list, dev->name);
    }
    config_set_auto_str(c, "tp-devices", list);
    return AE_OK;
}

/* Each GPU other than the model's holds its ranks' copies of their
 * shards, their kv heads' KV and their activations: the plan of that
 * GPU, as arithmetic, against what it had free when it was opened. The
 * model's GPU has the memory plan (setup_plan). */
static int tp_gpu_plans(const engine *e, const model *m, int32_t R, const kn_backend **bes, bool fast, ae_error *err) {
    tp_split sp;
    if (m->arch->tp_split(&sp, &m->cfg, R, err) != AE_OK) return AE_ERR;
    const engine_config *ec = engine_get_config(e);
    const int32_t T = ec->max_batch_tokens;
    for (int32_t r = 0; r < R; r++) {
        if (bes[r] == m->be) continue;
        bool first = true; /* the first rank on its GPU sums them all */
        for (int32_t q = 0; q < r; q++) first = first && bes[q] != bes[r];
        if (!first) continue;
        uint64_t w = 0, kv = 0, act = 0;
        int32_t n = 0;
        for (int32_t q = r; q < R; q++) {
            if (bes[q] != bes[r]) continue;
            model *sh;
            if (tp_shard_init(&sh, m, &sp, q, err) != AE_OK) return AE_ERR;
            w += tp_rank_copy_bytes(sh, q);
            /* whole blocks of KV, as the cache makes them */
            uint64_t slots = ((uint64_t)ec->kv_tokens + (uint64_t)ec->block_size - 1) / (uint64_t)ec->block_size *
                             (uint64_t)ec->block_size;
            kv += slots * m->arch->kv_bytes_per_token(&sh->cfg);
            act += forward_ws_bytes(sh, T, q == 0 ? T : 1) + forward_stream_workspace(sh, T, ec->max_seq_len) +
                   2 * (uint64_t)T * (uint64_t)m->cfg.hidden * sizeof(float) + /* the custom kind's slots */
                   (fast ? KN_FAST_WORKSPACE_BYTES : 0);                       /* cuBLAS's, in fast mode */
            tp_shard_free(sh);
            n++;
        }
        const kn_device *d = &g_rank_dev[r];
        uint64_t need = w + kv + act, have = d->info.free_bytes;
        double mib = 1048576.0;
        if (need > have)
            return err_set(err,
                           "memory plan of %s (%d rank%s from rank %d): weights %.2f MiB + KV %.2f MiB (%d tokens) "
                           "+ activations %.2f MiB = %.2f MiB > %.2f MiB free at start; would work: fewer KV tokens "
                           "(--max-kv-tokens), more ranks, or a GPU with more memory",
                           d->name, n, n > 1 ? "s" : "", r, (double)w / mib, (double)kv / mib, ec->kv_tokens,
                           (double)act / mib, (double)need / mib, (double)have / mib);
        LOG_INFOF("tensor parallel: memory plan of %s (%d rank%s from rank %d): weights %.2f MiB + KV %.2f MiB (%d "
                  "tokens) + activations %.2f MiB = %.2f MiB of %.2f MiB free at start (NCCL's own buffers not "
                  "counted)",
                  d->name, n, n > 1 ? "s" : "", r, (double)w / mib, (double)kv / mib, ec->kv_tokens, (double)act / mib,
                  (double)need / mib, (double)have / mib);
    }
    return AE_OK;
}

int setup_tp(config *c, engine *e, const model *m, const kn_device *dev, ae_error *err) {
    int32_t R = config_has(c, "tp") ? (int32_t)config_int(c, "tp") : 1;
    int kind = config_has(c, "allreduce") ? kn_allreduce_parse(config_str(c, "allreduce")) : KN_ALLREDUCE_AUTO;
    if (kind < 0)
        return err_set(err, "--allreduce %.100s: not one of auto, cpu, nccl, custom", config_str(c, "allreduce"));
    const kn_backend *bes[TP_MAX_RANKS];
    bool on_gpus = R > 1 && dev && dev->kind == KN_DEVICE_CUDA && m->be == dev->be;
    for (int32_t r = 0; r < R && R <= TP_MAX_RANKS; r++) snprintf(g_rank_dev[r].name, sizeof g_rank_dev[r].name, "cpu");
    const bool fast = config_has(c, "deterministic") && !config_bool(c, "deterministic");
    if (on_gpus && tp_devices(c, e, m, dev, R, bes, fast, err) != AE_OK) return err_prefix(err, "--tp %d: ", R), AE_ERR;
    if (engine_set_tp(e, R, (kn_allreduce)kind, on_gpus ? bes : NULL, err) != AE_OK)
        return err_prefix(err, "--tp %d: ", R), AE_ERR;
    if (R <= 1) return AE_OK;
    const char *name = kn_allreduce_name(engine_allreduce(e));
    if (config_has(c, "allreduce") && config_is_auto(c, "allreduce")) {
        config_set_auto_str(c, "allreduce", name);
        const char *why = engine_allreduce_why(e);
        LOG_INFOF("tensor parallel: allreduce %s (auto: %s)", name,
                  why[0]                          ? why
                  : kn_backend_host_memory(m->be) ? "the CPU's ranks reduce on the host"
                                                  : "");
    } else {
        LOG_INFOF("tensor parallel: allreduce %s (%s)", name, config_source_name(config_get_source(c, "allreduce")));
    }
    setup_log_allreduces(m, R, config_source_name(config_get_source(c, "tp")));
    return AE_OK;
}

void setup_log_weights(const config *c, const model *m) {
    uint64_t bytes[GGML_TYPE_COUNT_MAX], experts;
    model_bytes_by_type(m, bytes, &experts);
    char line[512] = "";
    size_t n = 0;
    for (int t = 0; t < GGML_TYPE_COUNT_MAX && n < sizeof line; t++)
        if (bytes[t])
            n += (size_t)snprintf(line + n, sizeof line - n, "%s%s %.2f MiB", n ? ", " : "",
                                  quant_type_name((ggml_type)t), (double)bytes[t] / 1048576.0);
    int32_t R = config_has(c, "tp") ? (int32_t)config_int(c, "tp") : 1;
    if (experts)
        LOG_INFOF("weights by type: %s (matrices; norms and biases f32); routed experts %.2f MiB, %.2f MiB a rank at "
                  "tp %d (each expert divided)",
                  line, (double)experts / 1048576.0, (double)experts / 1048576.0 / R, R);
    else
        LOG_INFOF("weights by type: %s (matrices; norms and biases f32)", line);
}

int setup_plan(config *c, const model *m, uint64_t extra_weights, uint64_t extra_work, memplan *plan, ae_error *err) {
    if (config_is_auto(c, "max-seq-len")) config_set_auto_int(c, "max-seq-len", m->cfg.context_length);
    extra_work += setup_tp_work(c, m); /* logged by setup_engine */
    /* On a GPU the plan is of the device's memory: what was free when it
     * was opened, before the weights were loaded into it. */
    uint64_t avail;
    bool on_gpu = g_device.kind == KN_DEVICE_CUDA && m->be == g_device.be;
    if (on_gpu)
        avail = g_device.info.free_bytes;
    else if (hostmem_available(&avail, err) != AE_OK)
        return AE_ERR;
    const model_config *mc = &m->cfg;
    /* A latent KV (MLA) is whole on every rank: R ranks in this memory
     * hold R copies of it (ranks on GPUs of their own: setup_tp's plans). */
    int32_t R = config_has(c, "tp") ? (int32_t)config_int(c, "tp") : 1;
    uint64_t copies = m->arch->kv_replicated && R > 1 ? (uint64_t)R : 1;
    memplan_model mm = {m->weight_bytes + extra_weights,
                        mc->n_layers,
                        mc->hidden,
                        mc->ffn,
                        mc->n_heads,
                        mc->n_kv_heads,
                        mc->head_dim,
                        mc->vocab,
                        copies * m->arch->kv_bytes_per_token(mc),
                        m->arch->workspace_per_token(mc)};
    /* Fast mode on a GPU: cuBLAS's own workspace. */
    const bool fast =
        !kn_backend_host_memory(m->be) && config_has(c, "deterministic") && !config_bool(c, "deterministic");
    memplan_env env = {avail,
                       SETUP_KV_BLOCK,
                       SETUP_PREFILL_CHUNK,
                       forward_stream_workspace(m, SETUP_PREFILL_CHUNK, (int32_t)config_int(c, "max-seq-len")) +
                           engine_input_bytes(SETUP_PREFILL_CHUNK) + extra_work + (fast ? KN_FAST_WORKSPACE_BYTES : 0),
                       on_gpu ? g_device.name : NULL,
                       on_gpu ? g_device.info.total_bytes : 0,
                       0,
                       0};
    if (!kn_backend_host_memory(m->be) && kn_backend_has_graphs(m->be)) {
        env.graph_nodes = FORWARD_GRAPH_NODES(mc->n_layers, fast);
        env.graph_node_bytes = KN_GRAPH_NODE_BYTES;
    }
    return memplan_compute(c, &mm, &env, plan, err);
}

/* The engine's stream made fast when c's "deterministic" is false. */
static int setup_fast(const config *c, engine *e, ae_error *err) {
    bool fast = config_has(c, "deterministic") && !config_bool(c, "deterministic");
    if (fast && kn_backend_host_memory(engine_model(e)->be))
        LOG_INFOF("deterministic=false has no effect on the %s backend: its kernels are batch invariant",
                  kn_backend_name(engine_model(e)->be));
    return engine_set_fast(e, fast, err);
}

int setup_engine(engine **e, config *c, const model *m, const memplan *plan, int32_t threads, int32_t act_bits,
                 ae_error *err) {
    if (plan->kv_tokens > INT32_MAX)
        return err_set(err, "memory plan: %lld KV tokens is more than one engine holds (%d); lower --max-kv-tokens",
                       (long long)plan->kv_tokens, INT32_MAX);
    engine_config ec = {SETUP_PREFILL_CHUNK, plan->max_batch, plan->max_seq_len, (int32_t)plan->kv_tokens,
                        plan->block_size,    threads,         act_bits};
    if (engine_init(e, m, &ec, err) != AE_OK) return AE_ERR;
    if (config_has(c, "tp")) {
        int32_t R = (int32_t)config_int(c, "tp");
        if (setup_tp(c, *e, m, &g_device, err) != AE_OK) return AE_ERR;
        if (R > 1)
            LOG_INFOF("tensor parallel: the %d ranks' workspaces (allreduce slots, activations of %d tokens, stream "
                      "scratch), less the engine's own activations freed while they run: %.1f MiB more in the plan's "
                      "fixed workspace",
                      R, SETUP_PREFILL_CHUNK, (double)setup_tp_work(c, m) / 1048576.0);
        /* Each rank's part of the plan: its shard of the weights (views
         * into the one loaded copy, or a copy on its own GPU) and its kv
         * heads' share of the KV. */
        const model_config *mc = &m->cfg;
        for (int32_t r = 0; r < R && R > 1; r++) {
            const model *sh = engine_tp_shard(*e, r);
            uint64_t copied = engine_tp_copied_bytes(*e, r);
            char where[96] = "views of the one loaded copy";
            if (copied) snprintf(where, sizeof where, "%.2f MiB copied to its device", (double)copied / 1048576.0);
            LOG_INFOF("tensor parallel: rank %d on %s: weights read %.2f MiB (its shard and the output projection, "
                      "which only rank 0 reads; %s), kv heads %d of %d: KV %.2f MiB = %lld tokens x %.0f bytes",
                      r, g_rank_dev[r].name, (double)sh->weight_bytes / 1048576.0, where, sh->cfg.n_kv_heads,
                      mc->n_kv_heads,
                      (double)plan->kv_tokens * (double)m->arch->kv_bytes_per_token(&sh->cfg) / 1048576.0,
                      (long long)plan->kv_tokens, (double)m->arch->kv_bytes_per_token(&sh->cfg));
        }
    }
    engine_set_graphs(*e, plan->graphs, plan->graphs ? plan->graph_bytes + KN_GRAPH_BYTES_GRAIN : 0);
    return setup_fast(c, *e, err);
}
