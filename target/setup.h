/* The start of anything that runs the target engine: aerie-target's main,
 * and the `aerie` commands that run it in-process (generate, bench,
 * perplexity, gen-prompts, dump-features, eval-draft). Its settings and
 * model, its memory plan (memplan.h) checked against this machine, and the
 * engine the plan sizes. */
#ifndef AERIE_TARGET_SETUP_H
#define AERIE_TARGET_SETUP_H

#include <stdint.h>

#include "../services/core/config.h"
#include "engine.h"
#include "memplan.h"
#include "model.h"

#define SETUP_PREFILL_CHUNK 256 /* tokens of prompt per forward pass */

/* Tensor-parallel ranks of the engine (engine.h engine_set_tp). */
#define SETUP_TP_OPTION \
    {"tp", \
     CONFIG_INT, \
     "1", \
     1, \
     64, \
     "tensor-parallel ranks: threads of this process, each over a shard of the model's heads and FFN and its " \
     "kv heads of the KV cache, adding partial sums by allreduce, 2 per layer (on CUDA: --tp-devices)"}
/* Each rank's GPU. */
#define SETUP_TP_DEVICES_OPTION \
    {"tp-devices", \
     CONFIG_STRING, \
     "auto", \
     0, \
     0, \
     "the GPU of each tensor-parallel rank, as 0,1: auto gives each rank its own GPU from --device's on where " \
     "this machine has them, and puts every rank on --device's otherwise (logged); not used on the CPU"}
/* How the ranks add their partial sums (kernels.h kn_allreduce). */
#define SETUP_ALLREDUCE_OPTION \
    {"allreduce", \
     CONFIG_STRING, \
     "auto", \
     0, \
     0, \
     "how tensor-parallel ranks add partial sums: cpu (CPU ranks), nccl or custom (CUDA ranks: NCCL, or a " \
     "one-shot kernel that adds in rank order), auto (cpu on the CPU; on CUDA the faster of the two, measured " \
     "at start and logged)"}
#define SETUP_KV_BLOCK 16

/* A service's settings (svc_config_load), threads "auto" resolved, and its
 * --model loaded. *help: --help printed the usage; exit 0. */
int setup_service(config **c, model **m, const char *service, const config_option *opts, size_t n, int argc,
                  char **argv, bool *print_config, bool *help, ae_error *err);

/* The memory plan for model m, against the memory this machine has, from
 * c's MEMPLAN_OPTIONS rows: the model's weights plus extra_weights, and a
 * prefill chunk's workspace plus what is fixed: the stream's scratch, the
 * engine's step inputs, and extra_work (a speculation's state, an
 * in-process head's). Records auto values in c (max-seq-len auto: the
 * model's context length). */
/* Logs the model's weights by type, and its routed experts' bytes a rank
 * holds at c's tp. */
void setup_log_weights(const config *c, const model *m);

int setup_plan(config *c, const model *m, uint64_t extra_weights, uint64_t extra_work, memplan *plan, ae_error *err);

/* An engine sized by the plan, prefill chunks of SETUP_PREFILL_CHUNK, at
 * c's "tp" ranks where it has the row (logged with the allreduces a pass
 * will make, as arithmetic), at act_bits (8 or 15) of activation
 * precision, keeping the plan's count of
 * step shapes as graphs (engine_set_graphs), in fast mode when c's
 * "deterministic" is false (kernels.h kn_stream_set_fast; where the
 * backend cannot, the error says why). */
int setup_engine(engine **e, config *c, const model *m, const memplan *plan, int32_t threads, int32_t act_bits,
                 ae_error *err);

/* Bytes the ranks of c's "tp" add to the plan's workspace (0 at one
 * rank): what tp_group_init takes (each rank's activations for a prefill
 * chunk, rank 0's with the logit rows, its stream scratch and its
 * allreduce slot), less the engine's own activations, which are freed
 * while the ranks run. */
uint64_t setup_tp_work(const config *c, const model *m);

/* e's ranks from c's "tp" and "allreduce" (engine.h engine_set_tp): "auto"
 * is replaced by the kind chosen, and the choice, its measurement and
 * the allreduces of a pass are logged. On CUDA (dev, where the model is)
 * the ranks' GPUs come from c's "tp-devices". */
struct kn_device; /* kernels/device.h */
int setup_tp(config *c, engine *e, const model *m, const struct kn_device *dev, ae_error *err);

/* Logs, for n_ranks > 1, the allreduces a pass makes: "2 per layer x L
 * layers = N a pass, each tokens x hidden x 4 bytes: ...". */
void setup_log_allreduces(const model *m, int32_t n_ranks, const char *source);

#endif
