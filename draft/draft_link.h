/* An EAGLE-3 drafter in this process, behind the spec_drafter interface
 * (services/spec/spec_drafter.h): what `aerie generate --draft` and `aerie
 * bench --draft` speculate with. The services put an RPC link there. */
#ifndef AERIE_DRAFT_DRAFT_LINK_H
#define AERIE_DRAFT_DRAFT_LINK_H

#include "../services/core/config.h"
#include "../services/spec/spec_drafter.h"
#include "drafter.h"

/* The settings of speculation, rows for a command's cfg table. The tree
 * defaults are SGLang's for EAGLE-3 (REFERENCES.md). The head is rounded
 * to Q8_0 by default: the draft changes speed, never output, and on the
 * CPU a draft pass reads every matrix of the head (the trained SmolLM2
 * head drafts at 0.14 of a step's time with Q8_0 against about 0.3 as
 * F16). */
#define DRAFT_LINK_OPTIONS \
    {"draft", CONFIG_STRING, NULL, 0, 0, "EAGLE-3 head directory: decode speculatively (unset: plain decoding)"}, \
        DRAFT_LINK_TUNING_OPTIONS

/* The same with the head found for the model (cli_resolve_draft). */
#define DRAFT_LINK_AUTO_OPTIONS \
    {"draft", CONFIG_STRING, \
     "auto",  0, \
     0,       "EAGLE-3 head directory, or none (auto: the head trained for this model file, found beside it)"}, \
        DRAFT_LINK_TUNING_OPTIONS

#define DRAFT_LINK_TUNING_OPTIONS \
    {"spec-steps", CONFIG_INT, "5", 1, TREE_MAX_STEPS, "draft tree depth"}, \
        {"spec-topk", CONFIG_INT, "4", 1, TREE_MAX_TOPK, "children per expanded node, and the frontier's width"}, \
        {"spec-tokens", CONFIG_INT, "8", 2, TREE_MAX_NODES, "tree nodes verified per step, root included"}, \
        {"draft-weights", \
         CONFIG_STRING, \
         "q8_0", \
         0, \
         0, \
         "the head's matrices rounded to Q8_0 (q8_0: half the bytes per draft pass), or as the file has them (file)"}

/* The tree shape and head weights DRAFT_LINK_OPTIONS set, checked. */
int draft_link_settings(const config *c, spec_shape *shape, eagle_weights *weights, ae_error *err);

typedef struct draft_link {
    eagle_head *head;
    drafter *drafter;
    int32_t max_seqs;
    drafter_feed *feeds; /* [max_seqs] */
    tree_out *trees;     /* [max_seqs] */
    int32_t *row_of;     /* [max_seqs]: a call's feed i went as row_of[i] (-1: gone) */
    spec_drafter iface;  /* ctx = this link */
} draft_link;

/* Loads the head in dir for target t and sizes its drafter. */
int draft_link_open(draft_link *l, const char *dir, eagle_target t, eagle_weights weights, const drafter_config *dc,
                    ae_error *err);
void draft_link_close(draft_link *l);

/* The target layers the head reads: its own choice, or EAGLE-3's default. */
int draft_link_capture(const draft_link *l, int32_t out[CAPTURE_LAYERS], ae_error *err);

/* Bytes the head's weights and drafter take. */
size_t draft_link_bytes(const draft_link *l, const drafter_config *dc);

#endif
