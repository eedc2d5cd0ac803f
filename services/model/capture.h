/* The target layers whose hidden states an EAGLE-3 head reads: a contract
 * between the target, which captures them, and the draft, which checks
 * that a request's features come from the layers its head was trained on.
 * Both include this, so that neither includes the other. */
#ifndef AERIE_MODEL_CAPTURE_H
#define AERIE_MODEL_CAPTURE_H

#include <stdint.h>

#include "../core/err.h"

#define CAPTURE_LAYERS 3 /* EAGLE-3 concatenates three target layers */

/* EAGLE-3's default capture layers for an n_layers model: the inputs of
 * layers 2, n/2 and n-3 (for 32 layers: 2, 16, 29). "Input of layer i" is
 * the residual stream before layer i runs, i.e. transformers'
 * output_hidden_states[i]. */
static inline void capture_default_layers(int32_t n_layers, int32_t out[CAPTURE_LAYERS]) {
    out[0] = 2;
    out[1] = n_layers / 2;
    out[2] = n_layers - 3;
}

/* A head's own choice (eagle_config.eagle_aux_hidden_state_layer_ids, in
 * the same input-of-layer convention), checked against an n_layers
 * model: exactly CAPTURE_LAYERS ids in 0..n_layers. */
int capture_layers_from(const int32_t *ids, int32_t n, int32_t n_layers, int32_t out[CAPTURE_LAYERS], ae_error *err);

#endif
