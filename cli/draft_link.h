/* An EAGLE-3 drafter in this process, behind the target's spec_drafter
 * interface (target/spec.h): what `aerie generate --draft` and `aerie
 * bench --draft` speculate with. The services put an RPC link there. */
#ifndef AERIE_CLI_DRAFT_LINK_H
#define AERIE_CLI_DRAFT_LINK_H

#include "../draft/drafter.h"
#include "../target/spec.h"

typedef struct draft_link {
    eagle_head *head;
    drafter *drafter;
    int32_t max_seqs;
    drafter_feed *feeds; /* [max_seqs] */
    tree_out *trees;     /* [max_seqs] */
    spec_drafter iface;  /* ctx = this link */
} draft_link;

/* Loads the head in dir for target m and sizes its drafter. */
int draft_link_open(draft_link *l, const char *dir, const model *m, const drafter_config *dc, ae_error *err);
void draft_link_close(draft_link *l);

/* The target layers the head reads: its own choice, or EAGLE-3's default. */
int draft_link_capture(const draft_link *l, const model *m, int32_t out[LLAMA_MAX_CAPTURE], ae_error *err);

/* Bytes the head's weights and drafter take. */
size_t draft_link_bytes(const draft_link *l, const drafter_config *dc);

#endif
