/* libFuzzer target for config.json parsing: any bytes either parse into a
 * config whose invariants hold, or fail with an error text. A config that
 * parses is then read as a model's (model_config_read, from a memfd: the
 * architectures' readers read the file again for their own keys, as
 * DeepSeek-V3's MLA and experts, text_config and quantization_config),
 * and what that takes must hold what the loader relies on
 * (config_check.h). Seeds: tests/fuzz/corpus/hfconfig. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../../services/model/hfconfig.h"
#include "../../target/model.h"
#include "config_check.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The input as a file the readers can open by path. */
static const char *as_file(const uint8_t *data, size_t size) {
    static int fd = -1;
    static char path[64];
    if (fd < 0) {
        if ((fd = memfd_create("config.json", 0)) < 0) abort();
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    }
    if (ftruncate(fd, 0) != 0 || (size && pwrite(fd, data, size, 0) != (ssize_t)size)) abort();
    return path;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    hfconfig c;
    ae_error err = {0};
    if (hfconfig_parse(&c, (const char *)data, size, "config.json", &err) == AE_OK) {
        /* What the engine will rely on after a successful parse. */
        if (c.hidden_size <= 0 || c.num_hidden_layers <= 0 || c.num_attention_heads <= 0 ||
            c.num_key_value_heads <= 0 || c.head_dim <= 0 || c.vocab_size <= 0)
            abort();
        if (c.num_attention_heads % c.num_key_value_heads != 0) abort();
        if (c.n_eos > HFCONFIG_MAX_EOS || c.n_aux_layers > HFCONFIG_MAX_AUX_LAYERS) abort();
        if (memchr(c.model_type, 0, sizeof c.model_type) == NULL) abort();
        /* The same bytes as a model's config. */
        model_config mc;
        const arch *a = NULL;
        hfconfig hc;
        err_clear(&err);
        if (model_config_read(&mc, &a, &hc, as_file(data, size), &err) == AE_OK)
            check_model_config(&mc, a);
        else if (err.msg[0] == '\0')
            abort();
    } else if (err.msg[0] == '\0') {
        abort();
    }
    return 0;
}
