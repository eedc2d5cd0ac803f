/* libFuzzer target for config.json parsing: any bytes either parse into a
 * config whose invariants hold, or fail with an error text. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../services/model/hfconfig.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    hfcfg c;
    ae_error err = {0};
    if (hfcfg_parse(&c, (const char *)data, size, "config.json", &err) == AE_OK) {
        /* What the engine will rely on after a successful parse. */
        if (c.hidden_size <= 0 || c.num_hidden_layers <= 0 || c.num_attention_heads <= 0 ||
            c.num_key_value_heads <= 0 || c.head_dim <= 0 || c.vocab_size <= 0)
            abort();
        if (c.num_attention_heads % c.num_key_value_heads != 0) abort();
        if (c.n_eos > HFCFG_MAX_EOS || c.n_aux_layers > HFCFG_MAX_AUX_LAYERS) abort();
        if (memchr(c.model_type, 0, sizeof c.model_type) == NULL) abort();
    } else if (err.msg[0] == '\0') {
        abort();
    }
    return 0;
}
