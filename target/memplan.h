/* Memory plan: how the target spends the memory it may use, decided once at
 * start (ARCHITECTURE.md, Invariants).
 *
 *   budget    = mem-fraction x available
 *   weights   = the model's bytes in memory (given)
 *   workspace = step tokens x workspace per token + extra workspace
 *               per token: the architecture's (arch.h; Llama's, in f32:
 *               4 B x (7 hidden + 2 (n_heads + n_kv_heads) head_dim
 *               + 2 ffn + vocab + head_dim)). What does not scale with
 *               step tokens comes in as extra workspace bytes, "fixed"
 *               (setup.h: kernel scratch, the engine's step inputs, and
 *               speculation and draft state).
 *   kv        = kv blocks x block_size x KV bytes per token, the
 *               architecture's (arch.h; Llama's: 2 n_layers n_kv_heads
 *               head_dim x 2 B, f16)
 *   tables    = max-batch x ceil(max-seq-len / block_size) x 4 B
 *               the KV cache's block tables, one int32 row per sequence
 *   graphs    = cuda-graphs x nodes x node bytes (on a device with graphs)
 *               the step shapes the engine keeps captured (engine.h), each
 *               estimated as memplan_env.graph_nodes launches of
 *               graph_node_bytes of device memory; each capture logs what
 *               it took, measured
 *   total     = weights + workspace + tables + graphs + kv  <=  budget
 *
 * Settings (rows for the service's cfg table, MEMPLAN_OPTIONS):
 *   mem-fraction   auto = the largest fraction (in steps of 0.001) that leaves
 *                  the system max(1 GiB, 10% of available)
 *   max-kv-tokens  auto = what fits in the budget, at most
 *                  max-batch x max-seq-len (more could never be used);
 *                  a given value is rounded up to whole blocks
 *   max-batch      sequences in flight at once
 *   max-seq-len    longest sequence (prompt + generated + tree scratch)
 *   cuda-graphs    step shapes kept as graphs; auto = MEMPLAN_AUTO_GRAPHS
 *                  on a device with graphs, 0 elsewhere (a CPU run ignores
 *                  a given value, and the plan says so)
 * Auto values are recorded in the cfg with source "auto".
 *
 * A plan that cannot hold one sequence of max-seq-len fails with the
 * arithmetic and the value of each setting that would work.
 *
 * On a GPU (memplan_env.device) "available" is the memory the device had
 * free when it was opened, before the weights went in: mem-fraction means
 * the same on every device, the share of what was free at start that the
 * process may use in all. The peers define theirs otherwise, so the plan
 * states its equivalents in their terms (total: the GPU's memory):
 *   vLLM   gpu_memory_utilization = this plan's total / total
 *          (vLLM sizes KV as total x utilization minus its own weights,
 *          activations and graphs);
 *   SGLang mem_fraction_static = 1 - (free at start - weights - kv) / total
 *          (SGLang gives KV rest = available after weights - total x
 *          (1 - mem_fraction_static), and keeps the remainder for
 *          activations and graphs).
 * An operator who carries a value from one to another sees the mapping:
 * a hand-picked SGLang 0.55 on a GPU whose weights take 60% of it leaves
 * KV a negative rest, where its automatic 0.88 left room. */
#ifndef AERIE_TARGET_MEMPLAN_H
#define AERIE_TARGET_MEMPLAN_H

#include <stdint.h>

#include "../services/core/config.h"
#include "../services/core/err.h"
#include "../services/core/hostmem.h"

#define MEMPLAN_OPTIONS \
    {"mem-fraction", CONFIG_DOUBLE, "auto", \
     0.01,           1.0,           "fraction of available memory to use (auto: leave the system max(1 GiB, 10%))"}, \
        {"max-kv-tokens", \
         CONFIG_INT, \
         "auto", \
         1, \
         1e12, \
         "KV cache size in tokens (auto: what fits, at most max-batch x max-seq-len)"}, \
        {"max-batch", CONFIG_INT, "8", 1, 4096, "sequences in flight at once"}, \
        {"max-seq-len", CONFIG_INT, "4096", 1, 16777216, "longest sequence in tokens"}, MEMPLAN_GRAPHS_OPTION, \
        MEMPLAN_DETERMINISTIC_OPTION

/* Decode and verify step shapes a GPU run keeps as CUDA graphs; its own
 * row, for commands that build an engine without a plan (aerie bench). */
#define MEMPLAN_GRAPHS_OPTION \
    {"cuda-graphs", CONFIG_INT, \
     "auto",        0, \
     4096,          "step shapes kept as CUDA graphs (auto: 32 on a GPU, 0 on the CPU; 0: off)"}
#define MEMPLAN_AUTO_GRAPHS 32
/* Deterministic kernels or fast ones (kernels.h kn_stream_set_fast); on a
 * GPU fast mode's cuBLAS workspace is part of the plan's fixed workspace. */
#define MEMPLAN_DETERMINISTIC_OPTION \
    {"deterministic", \
     CONFIG_BOOL, \
     "true", \
     0, \
     0, \
     "batch-invariant kernels, greedy speculative output identical to plain (--no-deterministic: " \
     "float-weight matmuls by cuBLAS on a GPU; faster, and output may then differ at near-ties)"}

/* cuda-graphs resolved for a device that has graphs or not (auto
 * recorded in c); 0 where it has none. */
int32_t memplan_graphs(config *c, bool has_graphs);

#define MEMPLAN_TEXT_MAX 1280

typedef struct memplan_model {
    uint64_t weight_bytes;
    int32_t n_layers, hidden, ffn, n_heads, n_kv_heads, head_dim, vocab;
    uint64_t kv_bytes_per_token;  /* all layers: the architecture's (arch.h) */
    uint64_t workspace_per_token; /* the architecture's (arch.h) */
} memplan_model;

typedef struct memplan_env {
    uint64_t mem_available;   /* bytes: MemAvailable on CPU (hostmem_available) */
    int32_t block_size;       /* KV tokens per block */
    int32_t step_tokens;      /* tokens in one forward pass; 0: max-batch */
    uint64_t extra_workspace; /* bytes beyond the per-token formula ("fixed") */
    const char *device;       /* "cuda:0": available is that GPU's free memory at start; NULL: the host's */
    uint64_t device_total;    /* with device: the GPU's memory in all */
    /* A device with graphs: launches in one captured step (an upper
     * bound, the architecture's) and the device memory each is estimated
     * to take. 0: no graphs. */
    uint64_t graph_nodes, graph_node_bytes;
} memplan_env;

typedef struct memplan {
    double mem_fraction;
    uint64_t available, budget;
    uint64_t weight_bytes;
    uint64_t workspace_per_token, workspace_bytes;
    uint64_t kv_bytes_per_token, kv_bytes;
    uint64_t block_table_bytes; /* max_batch x max_blocks_per_seq x 4 */
    int32_t graphs;             /* step shapes kept as graphs (cuda-graphs) */
    uint64_t graph_bytes;       /* graphs x graph_nodes x graph_node_bytes */
    uint64_t total;
    int64_t kv_tokens; /* n_blocks x block_size */
    int32_t n_blocks, block_size;
    int32_t max_blocks_per_seq; /* ceil(max-seq-len / block_size) */
    int32_t max_batch, max_seq_len, step_tokens;
    /* On a GPU, the same plan in the peers' settings (memplan.h, top):
     * vLLM's gpu_memory_utilization and SGLang's mem_fraction_static. */
    double vllm_gpu_memory_utilization, sglang_mem_fraction_static;
    char text[MEMPLAN_TEXT_MAX]; /* the arithmetic, one line per '\n' */
} memplan;

/* Resolves the plan from c (which must hold MEMPLAN_OPTIONS), records auto
 * values in c, and fills out. Infeasible: AE_ERR with the arithmetic and
 * what would work in err. */
int memplan_compute(config *c, const memplan_model *m, const memplan_env *env, memplan *out, ae_error *err);

/* Logs the plan's lines at info level ("memplan budget = ..."), then one
 * line of exact byte counts. */
void memplan_log(const memplan *p);

#endif
