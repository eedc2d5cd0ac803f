#include "memplan.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../services/core/hostmem.h"
#include "../services/core/log.h"

/* Shorthand for formatted sizes inside one message: B(i, bytes) formats
 * into the i-th of a few local buffers. */
typedef struct sizes {
    char s[12][24];
} sizes;

static const char *B(sizes *z, int i, uint64_t bytes) {
    hostmem_fmt_bytes(bytes, z->s[i], sizeof z->s[i]);
    return z->s[i];
}

static uint64_t to_ppm(double fraction) { return (uint64_t)llround(fraction * 1e6); }

/* The smallest multiple of 0.001 whose budget holds need; > 1000 if none. */
static uint64_t milli_needed(uint64_t available, uint64_t need) {
    if (available == 0) return 1001;
    uint64_t milli = (uint64_t)ceil((double)need * 1000.0 / (double)available);
    if (milli > 0) milli--;
    while (milli <= 1000u && hostmem_share(available, milli * 1000u) < need) milli++;
    return milli;
}

/* Appends ", --name value" (or "--name value" first) to a would-work list. */
static void would(char *buf, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void would(char *buf, size_t cap, const char *fmt, ...) {
    size_t n = strlen(buf);
    if (n >= cap - 1) return;
    if (n > 0) {
        snprintf(buf + n, cap - n, ", ");
        n = strlen(buf);
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + n, cap - n, fmt, ap);
    va_end(ap);
}

static void fmt_fraction(double f, char *buf, size_t cap) { snprintf(buf, cap, "%g", f); }

static int model_ok(const memplan_model *m, const memplan_env *env, ae_error *err) {
    if (m->n_layers <= 0 || m->hidden <= 0 || m->ffn <= 0 || m->n_heads <= 0 || m->n_kv_heads <= 0 ||
        m->head_dim <= 0 || m->vocab <= 0)
        return err_set(err,
                       "memory plan: model sizes must be positive (layers=%d hidden=%d ffn=%d heads=%d "
                       "kv_heads=%d head_dim=%d vocab=%d)",
                       m->n_layers, m->hidden, m->ffn, m->n_heads, m->n_kv_heads, m->head_dim, m->vocab);
    if (m->kv_bytes_per_token == 0) return err_set(err, "memory plan: the model's KV takes 0 bytes per token");
    if (m->workspace_per_token == 0) return err_set(err, "memory plan: the model's workspace takes 0 bytes per token");
    if (env->block_size <= 0 || env->step_tokens < 0)
        return err_set(err, "memory plan: block_size %d must be positive and step_tokens %d >= 0", env->block_size,
                       env->step_tokens);
    return AE_OK;
}

int32_t memplan_graphs(config *c, bool has_graphs) {
    if (!config_has(c, "cuda-graphs")) return 0; /* a command that runs on the CPU only */
    if (config_is_auto(c, "cuda-graphs")) config_set_auto_int(c, "cuda-graphs", has_graphs ? MEMPLAN_AUTO_GRAPHS : 0);
    return has_graphs ? (int32_t)config_int(c, "cuda-graphs") : 0;
}

int memplan_compute(config *c, const memplan_model *m, const memplan_env *env, memplan *out, ae_error *err) {
    memset(out, 0, sizeof *out);
    if (model_ok(m, env, err) != AE_OK) return AE_ERR;
    sizes z;
    const int64_t max_batch = config_int(c, "max-batch");
    const int64_t max_seq_len = config_int(c, "max-seq-len");
    const uint64_t bs = (uint64_t)env->block_size;
    const uint64_t avail = env->mem_available;
    char where[64] = "available";
    if (env->device) snprintf(where, sizeof where, "free on %s at start", env->device);

    /* budget */
    const bool frac_auto = config_is_auto(c, "mem-fraction");
    double frac;
    if (frac_auto) {
        frac = hostmem_auto_fraction(avail);
        config_set_auto_double(c, "mem-fraction", frac);
    } else {
        frac = config_double(c, "mem-fraction");
    }
    const uint64_t budget = hostmem_share(avail, to_ppm(frac));
    char fs[32];
    fmt_fraction(frac, fs, sizeof fs);
    const char *fsrc = config_source_name(config_get_source(c, "mem-fraction"));

    /* workspace and per-token KV */
    const uint64_t step = env->step_tokens > 0 ? (uint64_t)env->step_tokens : (uint64_t)max_batch;
    const uint64_t ws_tok = m->workspace_per_token;
    const uint64_t ws = step * ws_tok + env->extra_workspace;
    const uint64_t kv_tok = m->kv_bytes_per_token;
    const uint64_t kv_block = bs * kv_tok;
    const uint64_t w = m->weight_bytes;

    const uint64_t per_seq_blocks = ((uint64_t)max_seq_len + bs - 1) / bs;
    const uint64_t one_seq_kv = per_seq_blocks * kv_block;
    /* The KV cache's block tables: int32 [max-batch][per_seq_blocks]. */
    const uint64_t tables = (uint64_t)max_batch * per_seq_blocks * 4ull;
    /* Graphs: each step shape kept costs its launches' device memory. */
    const bool has_graphs = env->graph_nodes > 0;
    const int32_t n_graphs = memplan_graphs(c, has_graphs);
    const uint64_t graph_each = env->graph_nodes * env->graph_node_bytes;
    const uint64_t graphs = (uint64_t)n_graphs * graph_each;
    const uint64_t fixed = w + ws + tables + graphs;
    const uint64_t kv_room = budget > fixed ? budget - fixed : 0;
    const uint64_t fit_blocks = kv_room / kv_block;

    char ok[200] = "";
    const bool kv_auto = config_is_auto(c, "max-kv-tokens");
    uint64_t n_blocks;

    if (fit_blocks < per_seq_blocks) {
        /* Not even one sequence of max-seq-len: say what would fit. */
        uint64_t need = fixed + one_seq_kv, milli = milli_needed(avail, need);
        if (milli <= 1000u) would(ok, sizeof ok, "--mem-fraction %g", (double)milli / 1000.0);
        if (fit_blocks > 0) would(ok, sizeof ok, "--max-seq-len %" PRIu64, fit_blocks * bs);
        if (graphs > 0 && budget >= fixed - graphs + one_seq_kv)
            would(ok, sizeof ok, "--cuda-graphs %" PRIu64, (budget - (fixed - graphs) - one_seq_kv) / graph_each);
        if (env->step_tokens == 0 && budget > w + env->extra_workspace + one_seq_kv) {
            /* Each sequence of the batch costs its workspace and its block table row. */
            uint64_t b =
                budget > w + env->extra_workspace + graphs + one_seq_kv
                    ? (budget - w - env->extra_workspace - graphs - one_seq_kv) / (ws_tok + per_seq_blocks * 4ull)
                    : 0;
            if (b >= 1 && b < (uint64_t)max_batch) would(ok, sizeof ok, "--max-batch %" PRIu64, b);
        }
        if (!ok[0]) snprintf(ok, sizeof ok, "no setting; more memory");
        return err_set(err,
                       "memory plan: one sequence of max-seq-len %" PRId64 " does not fit: weights %s + "
                       "workspace %s + block tables %s%s%s + kv %" PRIu64 " tok x %s = %s > budget %s x %s "
                       "%s = %s; would work: %s",
                       max_seq_len, B(&z, 1, w), B(&z, 2, ws), B(&z, 7, tables), graphs ? " + graphs " : "",
                       graphs ? B(&z, 8, graphs) : "", per_seq_blocks * bs, B(&z, 3, kv_tok), B(&z, 4, need), fs,
                       B(&z, 5, avail), where, B(&z, 6, budget), ok);
    }
    if (kv_auto) {
        uint64_t cap = (uint64_t)max_batch * per_seq_blocks;
        n_blocks = fit_blocks < cap ? fit_blocks : cap;
        if (n_blocks > INT32_MAX) n_blocks = INT32_MAX;
    } else {
        uint64_t want = (uint64_t)config_int(c, "max-kv-tokens");
        n_blocks = (want + bs - 1) / bs;
        if (n_blocks < per_seq_blocks)
            return err_set(err,
                           "memory plan: max-kv-tokens %" PRIu64 " (%" PRIu64 " blocks of %" PRIu64
                           ") cannot hold one sequence of max-seq-len %" PRId64 " (%" PRIu64
                           " blocks); would work: --max-kv-tokens %" PRIu64 ", --max-seq-len %" PRIu64,
                           want, n_blocks, bs, max_seq_len, per_seq_blocks, per_seq_blocks * bs, n_blocks * bs);
        if (n_blocks > fit_blocks || n_blocks > INT32_MAX) {
            uint64_t need = fixed + n_blocks * kv_block, milli = milli_needed(avail, need);
            uint64_t fit = fit_blocks < INT32_MAX ? fit_blocks : INT32_MAX;
            would(ok, sizeof ok, "--max-kv-tokens %" PRIu64, fit * bs);
            if (milli <= 1000u && n_blocks <= INT32_MAX)
                would(ok, sizeof ok, "--mem-fraction %g", (double)milli / 1000.0);
            return err_set(err,
                           "memory plan: max-kv-tokens %" PRIu64 " does not fit: weights %s + workspace "
                           "%s + block tables %s%s%s + kv %" PRIu64 " tok x %s = %s > budget %s x %s "
                           "%s = %s; would work: %s",
                           want, B(&z, 0, w), B(&z, 1, ws), B(&z, 6, tables), graphs ? " + graphs " : "",
                           graphs ? B(&z, 7, graphs) : "", n_blocks * bs, B(&z, 2, kv_tok), B(&z, 3, need), fs,
                           B(&z, 4, avail), where, B(&z, 5, budget), ok);
        }
    }

    out->mem_fraction = frac;
    out->available = avail;
    out->budget = budget;
    out->weight_bytes = w;
    out->workspace_per_token = ws_tok;
    out->workspace_bytes = ws;
    out->kv_bytes_per_token = kv_tok;
    out->n_blocks = (int32_t)n_blocks;
    out->block_size = (int32_t)bs;
    out->kv_tokens = (int64_t)(n_blocks * bs);
    out->kv_bytes = n_blocks * kv_block;
    out->block_table_bytes = tables;
    out->graphs = n_graphs;
    out->graph_bytes = graphs;
    out->total = w + ws + tables + graphs + out->kv_bytes;
    out->max_blocks_per_seq = (int32_t)per_seq_blocks;
    out->max_batch = (int32_t)max_batch;
    out->max_seq_len = (int32_t)max_seq_len;
    out->step_tokens = (int32_t)step;
    if (kv_auto) config_set_auto_int(c, "max-kv-tokens", out->kv_tokens);

    char peers[256] = "";
    if (env->device && env->device_total > 0) {
        double total = (double)env->device_total;
        out->vllm_gpu_memory_utilization = (double)out->total / total;
        double left = (double)avail - (double)w - (double)out->kv_bytes;
        out->sglang_mem_fraction_static = 1.0 - left / total;
        snprintf(peers, sizeof peers,
                 "\n%s: %s in all, %s free at start; this plan as the peers' settings: vLLM "
                 "--gpu-memory-utilization %.3f, SGLang --mem-fraction-static %.3f",
                 env->device, B(&z, 0, env->device_total), B(&z, 1, avail), out->vllm_gpu_memory_utilization,
                 out->sglang_mem_fraction_static);
    }
    /* The graphs line: on a device with graphs, or where a value was
     * given that this run cannot use. */
    char gline[200] = "", gterm[48] = "";
    const char *gsrc = config_has(c, "cuda-graphs") ? config_source_name(config_get_source(c, "cuda-graphs")) : "";
    if (has_graphs && n_graphs > 0) {
        snprintf(gline, sizeof gline,
                 "graphs = %d step shapes (cuda-graphs, %s) x %" PRIu64 " nodes x %s = %s (an estimate; each "
                 "capture logs what it took)\n",
                 n_graphs, gsrc, env->graph_nodes, B(&z, 0, env->graph_node_bytes), B(&z, 1, graphs));
        snprintf(gterm, sizeof gterm, " + graphs %s", B(&z, 0, graphs));
    } else if (!has_graphs && config_has(c, "cuda-graphs") && config_int(c, "cuda-graphs") > 0) {
        snprintf(gline, sizeof gline, "graphs = none: cuda-graphs %lld (%s) has no effect without a GPU\n",
                 (long long)config_int(c, "cuda-graphs"), gsrc);
    }
    char extra[64] = "";
    if (env->extra_workspace) snprintf(extra, sizeof extra, " + %s fixed", B(&z, 7, env->extra_workspace));
    snprintf(out->text, sizeof out->text,
             "budget = %s (mem-fraction, %s) x %s %s = %s\n"
             "workspace = %" PRIu64 " tok x %s%s = %s\n"
             "kv = %" PRIu64 " blocks x %" PRIu64 " tok = %" PRId64 " tok x %s = %s "
             "(%" PRIu64 " seq of max-seq-len %" PRId64 ")\n"
             "block tables = %" PRId64 " seq x %" PRIu64 " blocks x 4 B = %s\n"
             "%s"
             "total = weights %s + workspace %s + block tables %s%s + kv %s = %s (%.1f%% of budget)%s",
             fs, fsrc, B(&z, 0, avail), where, B(&z, 1, budget), step, B(&z, 2, ws_tok), extra, B(&z, 3, ws), n_blocks,
             bs, out->kv_tokens, B(&z, 4, kv_tok), B(&z, 5, out->kv_bytes), n_blocks / per_seq_blocks, max_seq_len,
             max_batch, per_seq_blocks, B(&z, 11, tables), gline, B(&z, 6, w), B(&z, 8, ws), B(&z, 11, tables), gterm,
             B(&z, 9, out->kv_bytes), B(&z, 10, out->total), budget ? 100.0 * (double)out->total / (double)budget : 0.0,
             peers);
    return AE_OK;
}

void memplan_log(const memplan *p) {
    const char *line = p->text;
    while (*line) {
        const char *end = strchr(line, '\n');
        int len = end ? (int)(end - line) : (int)strlen(line);
        LOG_INFOF("memplan %.*s", len, line);
        line += len + (end ? 1 : 0);
    }
    LOG_INFOF("memplan_bytes available=%" PRIu64 " budget=%" PRIu64 " weights=%" PRIu64 " workspace=%" PRIu64
              " block_tables=%" PRIu64 " graphs=%" PRIu64 " kv=%" PRIu64 " total=%" PRIu64
              " kv_blocks=%d block_size=%d cuda_graphs=%d",
              p->available, p->budget, p->weight_bytes, p->workspace_bytes, p->block_table_bytes, p->graph_bytes,
              p->kv_bytes, p->total, p->n_blocks, p->block_size, p->graphs);
}
