/* The engine's memory plan for the commands that run the CPU engine
 * (generate, gen-prompts, dump-features, eval-draft): the model's weights,
 * the draft head's when there is one, the workspace of a prefill chunk and
 * the KV cache, checked against the memory this machine has
 * (target/memplan.h). The command's cfg table holds MEMPLAN-style rows
 * (mem-fraction, max-kv-tokens, max-batch, max-seq-len) and "threads". */
#ifndef AERIE_CLI_PLAN_H
#define AERIE_CLI_PLAN_H

#include <stdbool.h>

#include "../services/core/config.h"
#include "../target/engine.h"
#include "../target/memplan.h"

#define CLI_PREFILL_CHUNK 256 /* tokens of prompt per forward pass */
#define CLI_KV_BLOCK 16

/* The activation precision of the quantized matmuls (kernels.h, "Batch
 * invariance"), a setting of every program that runs the engine or the
 * head. The default is this one constant, to be chosen by measurement. */
#define CLI_ACT_BITS_DEFAULT "15"
#define CLI_ACT_BITS_OPTION                                                                                 \
    {"act-bits", CFG_INT, CLI_ACT_BITS_DEFAULT, 8, 15,                                                     \
     "bits each activation keeps in quantized matmuls: 15 (two byte planes) or 8 (one: a pass of several " \
     "tokens does half the integer work, with more rounding error)"}

/* c's "act-bits" into *bits; a value other than 8 or 15 fails. */
int cli_act_bits(const cfg *c, int32_t *bits, ae_error *err);

/* The plan for model m; records auto values in c. With draft, c also holds
 * "draft" and "draft-weights" (DRAFT_LINK_OPTIONS), and a set "draft" adds
 * the head and its drafter. */
int cli_plan(cfg *c, const model *m, bool draft, memplan *plan, ae_error *err);

/* The head directory c's "draft" names, or NULL for plain decoding (unset
 * or "none"). */
const char *cli_draft_dir(const cfg *c);

/* Replaces draft "auto" with the head trained for c's "model": a directory
 * beside the model file whose training.json (written by
 * tools/train_eagle3.py) has "target_model" equal to the model's file name.
 * None found: "none", plain decoding. */
void cli_resolve_draft(cfg *c);

/* A command's resolve step: threads, the draft head when there is a
 * "draft" setting, then the plan for c's "model". */
int cli_resolve_engine(cfg *c, bool draft, ae_error *err);

/* The start of a service's main (aerie-target, aerie-draft): its settings
 * (svc_config_load), threads "auto" resolved, and its --model loaded.
 * *help: --help printed the usage; exit 0. */
int cli_service_open(cfg **c, model **m, const char *service, const cfg_option *opts, size_t n, int argc, char **argv,
                     bool *print_config, bool *help, ae_error *err);

/* An engine sized by the plan, prefill chunks of CLI_PREFILL_CHUNK, at
 * act_bits (8 or 15) of activation precision. */
int cli_engine_open(eng **e, const model *m, const memplan *plan, int32_t threads, int32_t act_bits, ae_error *err);

#endif
