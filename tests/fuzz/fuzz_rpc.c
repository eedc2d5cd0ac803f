/* libFuzzer target: a frame as it comes off a socket. The header must
 * decode or be refused with a reason; the body must decode as every
 * message of the contract or fail (nanopb never reads past the bytes it
 * was given); payload references that resolve must lie inside the payload
 * and be aligned; and an accepted message encodes again. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "../../services/core/err.h"
#include "../../services/rpc/frame.h"
#include "../../services/rpc/msg.h"
#include "aerie.pb.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_slice(const uint8_t *payload, uint32_t plen, aerie_PayloadRef ref, size_t elem) {
    const void *p;
    size_t count = elem ? ref.length / elem : 0;
    if (frame_payload_slice(payload, plen, ref.offset, ref.length, elem, count, &p, NULL) != AE_OK) return;
    AE_ASSERT(count * elem == ref.length);
    if (ref.length) {
        const uint8_t *b = p;
        AE_ASSERT(b >= payload && (size_t)(b - payload) + ref.length <= plen);
        AE_ASSERT(elem % 4 != 0 || (size_t)(b - payload) % 4 == 0);
        volatile uint8_t x = b[0] ^ b[ref.length - 1];
        (void)x;
    }
}

static uint8_t out[aerie_ProposeReply_size + aerie_InfoReply_size];

#define ROUNDTRIP(type, var) \
    do { \
        static type var; \
        if (msg_decode(type##_fields, &var, msg, mlen, NULL) == AE_OK) { \
            uint32_t n; \
            AE_ASSERT(msg_encode(type##_fields, &var, out, sizeof out, &n, NULL) == AE_OK); \
        } \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < FRAME_HEADER) return 0;
    frame_header h;
    ae_error err = {{0}};
    frame_check c = frame_decode_header(data, 1 << 20, &h, &err);
    AE_ASSERT((c == FRAME_OK) == !err_is_set(&err));
    /* The body is what follows, whatever the header claims. */
    const uint8_t *msg = data + FRAME_HEADER;
    size_t rest = size - FRAME_HEADER;
    uint32_t mlen = (uint32_t)(rest < h.msg_len ? rest : h.msg_len);
    const uint8_t *payload = msg + mlen;
    uint32_t plen = (uint32_t)(rest - mlen);

    static aerie_ProposeRequest pr;
    if (msg_decode(aerie_ProposeRequest_fields, &pr, msg, mlen, NULL) == AE_OK) {
        AE_ASSERT(pr.seqs_count <= 64 && pr.capture_layers_count <= 3);
        for (pb_size_t i = 0; i < pr.seqs_count; i++) {
            check_slice(payload, plen, pr.seqs[i].tokens, sizeof(int32_t));
            check_slice(payload, plen, pr.seqs[i].features, sizeof(float) * 1728);
        }
    }
    static aerie_GenerateRequest gr;
    if (msg_decode(aerie_GenerateRequest_fields, &gr, msg, mlen, NULL) == AE_OK) {
        AE_ASSERT(gr.stop_tokens_count <= 16 && strlen(gr.request_id) < sizeof gr.request_id);
        check_slice(payload, plen, gr.prompt, sizeof(int32_t));
    }
    ROUNDTRIP(aerie_ProposeReply, prp);
    ROUNDTRIP(aerie_ReleaseRequest, rr);
    ROUNDTRIP(aerie_GenerateEvent, ge);
    ROUNDTRIP(aerie_CancelRequest, cr);
    ROUNDTRIP(aerie_InfoReply, ir);
    ROUNDTRIP(aerie_HealthReply, hr);
    return 0;
}
