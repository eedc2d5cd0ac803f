/* libFuzzer target for chat templates and the --chat message list.
 *
 * The input is split at the first NUL byte: before it, a template source
 * for chat_template_init; after it, a JSON message list. Whatever both
 * accept is rendered, and the render must be exactly as long as measured. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../services/tokenizer/chat.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *nul = memchr(data, 0, size);
    size_t tlen = nul ? (size_t)(nul - data) : size;
    char *src = malloc(tlen + 1);
    if (!src) return 0;
    memcpy(src, data, tlen);
    src[tlen] = '\0';
    const char *json = nul ? (const char *)nul + 1 : "";
    size_t jlen = nul ? size - tlen - 1 : 0;

    ae_error err = {0};
    chat_template *t = NULL;
    chat_msg *msgs = NULL;
    size_t n = 0;
    int have_t = chat_template_init(&t, src, &err) == AE_OK;
    err_clear(&err);
    int have_m = chat_parse_messages_json(json, jlen, &msgs, &n, &err) == AE_OK;
    if (have_t && have_m) {
        size_t need = 0, got = 0;
        char *out = NULL;
        for (int gen = 0; gen < 2; gen++) {
            err_clear(&err);
            if (chat_render(t, msgs, n, gen, NULL, 0, &need, &err) != AE_OK) continue;
            if (chat_render_alloc(t, msgs, n, gen, &out, &got, &err) != AE_OK) abort();
            if (got != need || strlen(out) != got) abort();
            free(out);
            out = NULL;
        }
    }
    chat_msgs_free(msgs);
    chat_template_free(t);
    free(src);
    return 0;
}
