/* aerie plan: the memory plan of a deployment from a model's config.json
 * alone, loading no weights: the weights each GPU holds by where tensor
 * parallelism puts them, the workspace, the CUDA graphs, the KV cache and
 * the tokens that fit, and the allreduces of a verify pass. The plan is
 * the target's own (target/memplan.h), on the first GPU: the one that also
 * holds the output projection. */
#include <cjson/cJSON.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../services/core/json.h"
#include "../target/arch.h"
#include "../target/engine.h"
#include "../target/forward.h"
#include "../target/memplan.h"
#include "../target/setup.h"
#include "../target/tp.h"
#include "cli.h"

static const config_option opts[] = {
    {"config", CONFIG_STRING, NULL, 0, 0,
     "the model's config.json, or its directory (here --config is the model's, not a settings file)"},
    {"devices", CONFIG_STRING, NULL, 0, 0, "the GPUs: COUNTxSIZE, e.g. 8x96GiB (GiB, GB or MiB)"},
    {"tp", CONFIG_INT, "auto", 1, 64, "tensor-parallel ranks, one a GPU (auto: every GPU)"},
    {"verify-tokens", CONFIG_INT, "32", 1, 4096, "tokens of the verify pass whose allreduces are counted"},
    {"json", CONFIG_BOOL, "false", 0, 0, "print one JSON object of the exact figures instead of text"},
    MEMPLAN_OPTIONS,
    {"log-level", CONFIG_STRING, "warn", 0, 0, "debug, info, warn, error or off"},
};

/* "8x96GiB" into a count and bytes. */
static int parse_devices(const char *s, int32_t *n, uint64_t *bytes, ae_error *err) {
    char *end;
    long count = strtol(s, &end, 10);
    if (count < 1 || count > 64 || (*end != 'x' && *end != 'X'))
        return err_set(err, "--devices %.60s: expected COUNTxSIZE with COUNT in 1..64, e.g. 8x96GiB", s);
    double size = strtod(end + 1, &end);
    double unit = !strcmp(end, "GiB") ? 1073741824.0 : !strcmp(end, "GB") ? 1e9 : !strcmp(end, "MiB") ? 1048576.0 : 0;
    if (!(size > 0) || unit == 0 || size * unit > 1e15)
        return err_set(err, "--devices %.60s: expected a size such as 96GiB, 141GB or 40960MiB", s);
    *n = (int32_t)count;
    *bytes = (uint64_t)(size * unit);
    return AE_OK;
}

/* How the file's weights are held: its float type as Aerie keeps it
 * (bf16 stays; f16 and f32 are f32), and the routed experts' int4 where
 * the config says compressed-tensors (Q4_0's 18 bytes per 32). */
typedef struct held {
    double float_bytes, expert_bytes;
    char float_name[16], expert_name[64];
} held;

static int read_held(const char *path, const hfconfig *hc, held *h, ae_error *err) {
    bool bf16 = !strcmp(hc->torch_dtype, "bfloat16");
    h->float_bytes = bf16 ? 2.0 : 4.0;
    snprintf(h->float_name, sizeof h->float_name, "%s", bf16 ? "bf16" : "f32");
    h->expert_bytes = h->float_bytes;
    snprintf(h->expert_name, sizeof h->expert_name, "%s", h->float_name);
    cJSON *root = json_read_file(path, HFCONFIG_MAX_FILE, err);
    if (!root) return AE_ERR;
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(root, "text_config");
    const cJSON *q = cJSON_GetObjectItemCaseSensitive(cJSON_IsObject(text) ? text : root, "quantization_config");
    const cJSON *groups = cJSON_GetObjectItemCaseSensitive(q, "config_groups"), *g;
    int rc = AE_OK;
    cJSON_ArrayForEach(g, groups) {
        const cJSON *w = cJSON_GetObjectItemCaseSensitive(g, "weights");
        const cJSON *bits = cJSON_GetObjectItemCaseSensitive(w, "num_bits"),
                    *gs = cJSON_GetObjectItemCaseSensitive(w, "group_size");
        if (!cJSON_IsNumber(bits) || bits->valueint != 4 || !cJSON_IsNumber(gs) || gs->valueint != 32) {
            rc = err_set(err, "%s: quantization_config: only int4 in groups of 32 is read (compressed-tensors)", path);
            break;
        }
        h->expert_bytes = 18.0 / 32.0;
        snprintf(h->expert_name, sizeof h->expert_name, "int4 in groups of 32, held as Q4_0: 18 B per 32");
    }
    cJSON_Delete(root);
    return rc;
}

typedef struct dry {
    model_config mc, r0; /* the model's, and rank 0's shard's */
    const arch *a;
    held h;
    int32_t n_gpus, tp, verify_tokens;
    uint64_t gpu_bytes;
    arch_params p;
    double w_whole, w_embed, w_output, w_split, w_experts, w_rank0, w_model;
    uint64_t kv_per_token;
    memplan plan;
} dry;

static int compute(config *c, dry *d, ae_error *err) {
    memset(d, 0, sizeof *d);
    const char *path = config_str(c, "config"), *devices = config_str(c, "devices");
    if (!path) return err_set(err, "no model config given (use --config config.json)");
    if (!devices) return err_set(err, "no GPUs given (use --devices COUNTxSIZE, e.g. 8x96GiB)");
    if (parse_devices(devices, &d->n_gpus, &d->gpu_bytes, err) != AE_OK) return AE_ERR;
    char file[1200];
    struct stat sb;
    snprintf(file, sizeof file, stat(path, &sb) == 0 && S_ISDIR(sb.st_mode) ? "%s/config.json" : "%s", path);
    hfconfig hc;
    if (model_config_read(&d->mc, &d->a, &hc, file, err) != AE_OK || read_held(file, &hc, &d->h, err) != AE_OK)
        return AE_ERR;
    if (config_is_auto(c, "tp")) config_set_auto_int(c, "tp", d->n_gpus);
    d->tp = (int32_t)config_int(c, "tp");
    if (d->tp > d->n_gpus) return err_set(err, "--tp %d: more ranks than the %d GPUs given", d->tp, d->n_gpus);
    d->verify_tokens = (int32_t)config_int(c, "verify-tokens");
    if (config_is_auto(c, "max-seq-len")) config_set_auto_int(c, "max-seq-len", d->mc.context_length);

    /* Rank 0's shard: its heads and widths (the first of an uneven cut,
     * so the largest share), which its buffers and its KV are sized by. */
    const model_config *mc = &d->mc;
    tp_split sp;
    if (d->a->tp_split(&sp, mc, d->tp, err) != AE_OK) return err_prefix(err, "--tp %d: ", d->tp), AE_ERR;
    tp_shard_config(&d->r0, mc, &sp, 0);
    /* Weights on the first GPU: what every rank holds whole, the output
     * projection (rank 0's alone), and rank 0's part of the divided ones. */
    arch_params p0;
    arch_count_params(d->a, mc, &d->p);
    arch_count_params(d->a, &d->r0, &p0);
    const double fb = d->h.float_bytes;
    d->w_whole = (double)d->p.whole * fb + (double)d->p.whole_f32 * 4.0;
    d->w_embed = (double)d->p.embed * fb;
    d->w_output = (double)d->p.output * fb;
    d->w_split = (double)p0.split * fb + (double)p0.split_f32 * 4.0;
    d->w_experts = (double)p0.experts * d->h.expert_bytes;
    d->w_rank0 = d->w_whole + d->w_embed + d->w_output + d->w_split + d->w_experts;
    d->w_model = d->w_whole + d->w_embed + d->w_output + (double)d->p.split * fb + (double)d->p.split_f32 * 4.0 +
                 (double)d->p.experts * d->h.expert_bytes;
    /* KV per token on rank 0: the latent whole, or its kv heads' share. */
    d->kv_per_token = d->a->kv_bytes_per_token(&d->r0);

    const bool fast = config_has(c, "deterministic") && !config_bool(c, "deterministic");
    const int32_t T = SETUP_PREFILL_CHUNK;
    uint64_t fixed = forward_stream_workspace_cfg(&d->r0, T, (int32_t)config_int(c, "max-seq-len")) +
                     engine_input_bytes(T) + (fast ? KN_FAST_WORKSPACE_BYTES : 0);
    if (d->tp > 1) fixed += 2ull * (uint64_t)T * (uint64_t)mc->hidden * sizeof(float); /* the custom kind's slots */
    memplan_model mm = {(uint64_t)ceil(d->w_rank0),
                        mc->n_layers,
                        mc->hidden,
                        mc->ffn,
                        mc->n_heads,
                        mc->n_kv_heads,
                        mc->head_dim,
                        mc->vocab,
                        d->kv_per_token,
                        d->a->workspace_per_token(&d->r0)};
    memplan_env env = {
        d->gpu_bytes,       SETUP_KV_BLOCK, T, fixed, "GPU 0", d->gpu_bytes, FORWARD_GRAPH_NODES(mc->n_layers, fast),
        KN_GRAPH_NODE_BYTES};
    return memplan_compute(c, &mm, &env, &d->plan, err);
}

static int resolve(config *c, ae_error *err) {
    dry d;
    return compute(c, &d, err);
}

#define GB(x) ((double)(x) / 1e9)
#define GIB(x) ((double)(x) / 1073741824.0)

static int run(const config *cc, int argc, char **argv, ae_error *err) {
    (void)argv;
    config *c = (config *)cc; /* resolve() has replaced every auto value */
    if (argc > 0) return err_set(err, "unexpected argument (plan takes options only)");
    dry d;
    if (compute(c, &d, err) != AE_OK) return CLI_EXIT_USAGE;
    const model_config *mc = &d.mc;
    const arch_params *p = &d.p;
    const memplan *pl = &d.plan;
    const int32_t per = FORWARD_ALLREDUCES_PER_LAYER;
    const double each = (double)d.verify_tokens * mc->hidden * sizeof(float);
    if (config_bool(c, "json")) {
        cJSON *o = cJSON_CreateObject();
        if (!o) return err_set(err, "out of memory"), CLI_EXIT_USAGE;
        const char *k[] = {"params_experts",   "params_split", "params_split_f32", "params_whole",
                           "params_whole_f32", "params_embed", "params_output"};
        const uint64_t v[] = {p->experts, p->split, p->split_f32, p->whole, p->whole_f32, p->embed, p->output};
        for (int i = 0; i < 7; i++) cJSON_AddNumberToObject(o, k[i], (double)v[i]);
        cJSON_AddNumberToObject(o, "tp", d.tp);
        cJSON_AddNumberToObject(o, "gpu_bytes", (double)d.gpu_bytes);
        cJSON_AddNumberToObject(o, "weights_model", floor(d.w_model));
        cJSON_AddNumberToObject(o, "weights_gpu0", (double)pl->weight_bytes);
        cJSON_AddNumberToObject(o, "kv_bytes_per_token", (double)d.kv_per_token);
        cJSON_AddNumberToObject(o, "mem_fraction", pl->mem_fraction);
        cJSON_AddNumberToObject(o, "budget", (double)pl->budget);
        cJSON_AddNumberToObject(o, "workspace", (double)pl->workspace_bytes);
        cJSON_AddNumberToObject(o, "workspace_per_token", (double)pl->workspace_per_token);
        cJSON_AddNumberToObject(o, "step_tokens", pl->step_tokens);
        cJSON_AddNumberToObject(o, "block_tables", (double)pl->block_table_bytes);
        cJSON_AddNumberToObject(o, "graphs", (double)pl->graph_bytes);
        cJSON_AddNumberToObject(o, "kv_tokens", (double)pl->kv_tokens);
        cJSON_AddNumberToObject(o, "kv_bytes", (double)pl->kv_bytes);
        cJSON_AddNumberToObject(o, "total", (double)pl->total);
        cJSON_AddNumberToObject(o, "allreduces_per_verify", per * mc->n_layers);
        cJSON_AddNumberToObject(o, "allreduce_bytes", each);
        cJSON_AddNumberToObject(o, "sglang_mem_fraction_static", pl->sglang_mem_fraction_static);
        return cli_put_json_line(o, err) == AE_OK ? 0 : CLI_EXIT_USAGE;
    }
    printf("aerie plan: %s (%s architecture), %d x %.0f GiB, tensor parallel %d\n", mc->arch, d.a->name, d.n_gpus,
           GIB(d.gpu_bytes), d.tp);
    printf("model: %d layers, hidden %d, %d heads, vocabulary %d", mc->n_layers, mc->hidden, mc->n_heads, mc->vocab);
    if (mc->kv_lora_rank) printf("; MLA: latent %d + rope %d", mc->kv_lora_rank, mc->qk_rope_dim);
    if (mc->route.n_experts)
        printf("; %d dense layer%s, then %d routed experts of %d + %d shared, %d active", mc->n_dense_layers,
               mc->n_dense_layers == 1 ? "" : "s", mc->route.n_experts, mc->expert_ffn,
               mc->expert_ffn ? mc->shared_ffn / mc->expert_ffn : 0, mc->route.top_k);
    printf("\n\nweights, the whole model (%s; %s held as f32 by Aerie: norms, biases%s):\n", d.h.float_name, "vectors",
           mc->kv_lora_rank ? ", MLA's per-head W_UK and W_UV" : "");
    printf("  routed experts  %16" PRIu64 " params x %.4g B = %8.2f GB  (%s)\n", p->experts, d.h.expert_bytes,
           GB((double)p->experts * d.h.expert_bytes), d.h.expert_name);
    printf("  divided         %16" PRIu64 " params x %.4g B + %" PRIu64 " f32 = %8.2f GB\n", p->split, d.h.float_bytes,
           p->split_f32, GB((double)p->split * d.h.float_bytes + (double)p->split_f32 * 4.0));
    printf("  whole           %16" PRIu64 " params x %.4g B + %" PRIu64 " f32 = %8.2f GB\n", p->whole, d.h.float_bytes,
           p->whole_f32, GB(d.w_whole));
    printf("  embedding       %16" PRIu64 " params x %.4g B = %8.2f GB\n", p->embed, d.h.float_bytes, GB(d.w_embed));
    printf("  output          %16" PRIu64 " params x %.4g B = %8.2f GB\n", p->output, d.h.float_bytes, GB(d.w_output));
    printf("  total                                              %8.2f GB\n", GB(d.w_model));
    printf("\nweights on GPU 0 (rank 0: %d of %d heads, %d of each expert's %d features) = whole %.2f GB + embedding "
           "%.2f GB + output %.2f GB (rank 0 alone) + its divided %.2f GB + its experts %.2f GB = %.2f GB (%.2f GiB)\n",
           d.r0.n_heads, mc->n_heads, mc->route.n_experts ? d.r0.expert_ffn : d.r0.ffn,
           mc->route.n_experts ? mc->expert_ffn : mc->ffn, GB(d.w_whole), GB(d.w_embed), GB(d.w_output), GB(d.w_split),
           GB(d.w_experts), GB(d.w_rank0), GIB(d.w_rank0));
    if (mc->kv_lora_rank)
        printf("KV per token on every rank = (%d + %d) x %d layers x 2 B = %" PRIu64
               " B: the latent is shared by all heads, so each rank holds all of it (not divided by %d)\n",
               mc->kv_lora_rank, mc->qk_rope_dim, mc->n_layers, d.kv_per_token, d.tp);
    else
        printf("KV per token on rank 0 = %" PRIu64 " B (its kv heads' share)\n", d.kv_per_token);
    printf("\nthe plan of GPU 0 (target/memplan.h; free at start taken as the whole GPU; its workspace is rank 0's "
           "shard's, and its graphs an estimate from the launches of a GQA layer):\n");
    for (const char *line = pl->text; *line;) {
        const char *end = strchr(line, '\n');
        int len = end ? (int)(end - line) : (int)strlen(line);
        printf("  %.*s\n", len, line);
        line += len + (end ? 1 : 0);
    }
    int64_t whole = pl->kv_tokens / pl->max_seq_len;
    printf("tokens that fit: %" PRId64 " KV tokens = %" PRId64 " whole sequence%s of max-seq-len %d (max-batch %d)\n",
           pl->kv_tokens, whole, whole == 1 ? "" : "s", pl->max_seq_len, pl->max_batch);
    printf("\nallreduces per verify pass: %d per layer x %d layers = %d (attention's output; the FFN's, where the "
           "shared and the routed experts' outputs are summed before one), each %d tokens x %d x 4 B = %.0f KiB: "
           "%.1f MiB a pass%s\n",
           per, mc->n_layers, per * mc->n_layers, d.verify_tokens, mc->hidden, each / 1024.0,
           each * per * mc->n_layers / 1048576.0, d.tp > 1 ? "" : " (none run at tp 1)");
    if (mc->route.n_experts)
        printf("expert parallelism (not built): each rank would hold %d whole experts, and each MoE layer would "
               "trade its allreduce for two all-to-alls (tokens to their experts' ranks and back)\n",
               mc->route.n_experts / d.tp);
    printf("\nwhat the memory settings mean:\n"
           "  Aerie --mem-fraction %.3f: the share of each GPU's free memory at start that the process may use in\n"
           "    all: weights + workspace + block tables + graphs + KV <= mem-fraction x free at start.\n"
           "  SGLang --mem-fraction-static: the share of the GPU's total memory for the weights and the KV pool\n"
           "    together; KV pool = total x mem-fraction-static - weights, and activations and graphs take the rest.\n"
           "    This plan in those terms: --mem-fraction-static %.3f (vLLM --gpu-memory-utilization %.3f).\n",
           pl->mem_fraction, pl->sglang_mem_fraction_static, pl->vllm_gpu_memory_utilization);
    return 0;
}

const cli_cmd cli_cmd_plan = {
    .name = "plan",
    .args = "",
    .summary = "a deployment's memory plan from a model's config.json alone (a dry run: no weights loaded)",
    .opts = opts,
    .n_opts = sizeof opts / sizeof opts[0],
    .run = run,
    .resolve = resolve,
};
