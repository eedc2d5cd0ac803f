#include "draft_link.h"

#include <stdlib.h>
#include <string.h>

static int link_propose(void *ctx, const spec_feed *feeds, int32_t n, const spec_shape *shape, spec_tree *trees,
                        ae_error *err) {
    draft_link *l = ctx;
    if (n > l->max_seqs) return err_set(err, "drafter: %d sequences, at most %d", n, l->max_seqs);
    /* A fork whose source no longer holds `start` pairs is gone, as the
     * draft service answers it; the others are served. */
    int32_t m = 0;
    for (int32_t i = 0; i < n; i++) {
        const spec_feed *f = &feeds[i];
        l->row_of[i] = -1;
        if (f->fork && (f->fork_of < 0 || f->fork_of >= l->max_seqs || drafter_len(l->drafter, f->fork_of) != f->start))
            continue;
        l->row_of[i] = m;
        l->feeds[m++] = (drafter_feed){f->seq,    f->reset,    f->start,     f->n,
                                       f->tokens, f->features, f->want_tree, f->fork ? f->fork_of : -1};
    }
    tree_params p = {shape->steps, shape->topk, shape->tokens};
    if (m > 0 && drafter_propose(l->drafter, l->feeds, m, &p, l->trees, err) != AE_OK) return AE_ERR;
    for (int32_t i = n - 1; i >= 0; i--) {
        if (l->row_of[i] < 0) {
            trees[i].n = SPEC_STATE_GONE;
            continue;
        }
        const tree_out *t = &l->trees[l->row_of[i]];
        trees[i].n = t->n;
        memcpy(trees[i].tokens, t->tokens, (size_t)t->n * sizeof(int32_t));
        memcpy(trees[i].parents, t->parents, (size_t)t->n * sizeof(int32_t));
        memcpy(trees[i].probs, t->probs, (size_t)t->n * sizeof(float));
    }
    return AE_OK;
}

static void link_release(void *ctx, int32_t seq) { drafter_release(((draft_link *)ctx)->drafter, seq); }

int draft_link_open(draft_link *l, const char *dir, eagle_target t, eagle_weights weights, const drafter_config *dc,
                    ae_error *err) {
    memset(l, 0, sizeof *l);
    if (eagle_load(&l->head, dir, &t, weights, err) != AE_OK) return AE_ERR;
    l->max_seqs = dc->max_seqs;
    l->feeds = calloc((size_t)dc->max_seqs, sizeof *l->feeds);
    l->trees = calloc((size_t)dc->max_seqs, sizeof *l->trees);
    l->row_of = calloc((size_t)dc->max_seqs, sizeof *l->row_of);
    if (!l->feeds || !l->trees || !l->row_of) {
        draft_link_close(l);
        return err_set(err, "out of memory");
    }
    if (drafter_init(&l->drafter, l->head, dc, err) != AE_OK) {
        draft_link_close(l);
        return AE_ERR;
    }
    l->iface = (spec_drafter){l, link_propose, link_release};
    return AE_OK;
}

void draft_link_close(draft_link *l) {
    drafter_free(l->drafter);
    eagle_free(l->head);
    free(l->feeds);
    free(l->trees);
    free(l->row_of);
    memset(l, 0, sizeof *l);
}

int draft_link_capture(const draft_link *l, int32_t out[CAPTURE_LAYERS], ae_error *err) {
    int32_t n_layers = l->head->target.n_layers;
    if (l->head->cfg.n_aux_layers == 0) {
        capture_default_layers(n_layers, out);
        return AE_OK;
    }
    return capture_layers_from(l->head->cfg.aux_layers, l->head->cfg.n_aux_layers, n_layers, out, err);
}

size_t draft_link_bytes(const draft_link *l, const drafter_config *dc) {
    return l->head->weight_bytes + drafter_bytes(l->head, dc);
}

int draft_link_settings(const config *c, spec_shape *shape, eagle_weights *weights, ae_error *err) {
    *shape = (spec_shape){(int32_t)config_int(c, "spec-steps"), (int32_t)config_int(c, "spec-topk"),
                          (int32_t)config_int(c, "spec-tokens")};
    tree_params p = {shape->steps, shape->topk, shape->tokens};
    if (tree_params_check(&p, err) != AE_OK) return AE_ERR;
    return eagle_weights_parse(config_str(c, "draft-weights"), weights, err);
}
