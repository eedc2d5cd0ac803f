#include "capture.h"

int capture_layers_from(const int32_t *ids, int32_t n, int32_t n_layers, int32_t out[CAPTURE_LAYERS], ae_error *err) {
    if (n != CAPTURE_LAYERS)
        return err_set(err, "eagle_aux_hidden_state_layer_ids: %d ids, expected %d", n, CAPTURE_LAYERS);
    for (int32_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] > n_layers)
            return err_set(err, "eagle_aux_hidden_state_layer_ids[%d] = %d is outside 0..%d", i, ids[i], n_layers);
        out[i] = ids[i];
    }
    return AE_OK;
}
