/* What the commands that run the engine in this process share (generate,
 * bench, perplexity, gen-prompts, dump-features, eval-draft): the memory
 * plan of target/setup.h with, when they speculate, the in-process head
 * (draft/draft_link.h) counted in it, and the speculation figures they
 * report. The command's cfg table holds MEMPLAN_OPTIONS rows and
 * "threads", and with a head DRAFT_LINK_OPTIONS. */
#ifndef AERIE_CLI_PLAN_H
#define AERIE_CLI_PLAN_H

#include <stdbool.h>

#include <cjson/cJSON.h>

#include "../draft/draft_link.h"
#include "../services/core/config.h"
#include "../services/core/svc.h"
#include "../target/setup.h"
#include "../target/spec.h"

/* The plan for model m; records auto values in c. With draft, a set
 * "draft" adds the head and its drafter. */
int cli_plan(config *c, const model *m, bool draft, memplan *plan, ae_error *err);

/* A command's resolve step: threads, the draft head when there is a
 * "draft" setting, then the plan for c's "model". */
int cli_resolve_engine(config *c, bool draft, ae_error *err);

/* Adds the speculation figures to a JSON object: the shape, steps,
 * drafted and accepted tokens, mean acceptance length, acceptance per
 * depth (share of verify steps that accepted a token at depth d + 1), and
 * the time shares of drafting and verifying. */
void cli_spec_stats_json(cJSON *o, const spec_stats *st, const spec_shape *shape);

#endif
