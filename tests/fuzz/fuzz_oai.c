/* libFuzzer target: an OpenAI request body as it comes off the network.
 * The parser must accept it or refuse it with a 400 naming a reason, never
 * read past the body, and leave every string it accepts valid UTF-8 and
 * every stop string within its bounds. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../gateway/oai.h"
#include "../../services/core/err.h"
#include "../../services/tokenizer/detok.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    /* The first byte picks the endpoint; the body is copied so that a read
     * one past its end is seen. */
    oai_kind kind = data[0] & 1 ? OAI_CHAT : OAI_COMPLETION;
    char *body = malloc(size - 1 ? size - 1 : 1);
    memcpy(body, data + 1, size - 1);
    oai_request r;
    oai_error e;
    if (oai_parse(&r, kind, body, size - 1, &e) == AE_OK) {
        AE_ASSERT(r.model[0] && detok_utf8_valid(r.model, strlen(r.model)));
        AE_ASSERT(r.n_stops >= 0 && r.n_stops <= STOP_MAX_STRINGS);
        for (int i = 0; i < r.n_stops; i++) AE_ASSERT(r.stop_lens[i] >= 1 && r.stop_lens[i] <= STOP_MAX_BYTES);
        for (size_t i = 0; i < r.n_msgs; i++)
            AE_ASSERT(r.msgs[i].role && detok_utf8_valid(r.msgs[i].content, strlen(r.msgs[i].content)));
        if (kind == OAI_COMPLETION) AE_ASSERT(r.prompt || r.prompt_ids || r.n_prompt_ids == 0);
        AE_ASSERT(r.temperature >= 0 && r.temperature <= 2 && r.top_p > 0 && r.top_p <= 1);
        AE_ASSERT(r.presence_penalty >= -2 && r.presence_penalty <= 2 && r.frequency_penalty >= -2 &&
                  r.frequency_penalty <= 2 && r.repetition_penalty > 0 && r.min_tokens >= 0);
        AE_ASSERT(r.n_bias >= 0 && r.n_bias <= OAI_MAX_BIAS && r.n_stop_ids >= 0 && r.n_stop_ids <= OAI_MAX_STOP_IDS);
        for (int i = 0; i < r.n_bias; i++) {
            AE_ASSERT(r.bias_id[i] >= 0 && r.bias[i] >= -100 && r.bias[i] <= 100);
            for (int j = 0; j < i; j++) AE_ASSERT(r.bias_id[j] != r.bias_id[i]);
        }
        for (int i = 0; i < r.n_stop_ids; i++) AE_ASSERT(r.stop_ids[i] >= 0);
        AE_ASSERT(r.top_logprobs >= 0 && r.top_logprobs <= OAI_MAX_TOP_LOGPROBS && (r.logprobs || !r.top_logprobs));
    } else {
        AE_ASSERT(e.status == 400 && e.message[0]);
    }
    oai_request_free(&r);
    free(body);
    return 0;
}
