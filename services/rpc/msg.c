#include "msg.h"

#include <string.h>

#include <pb_decode.h>
#include <pb_encode.h>

int msg_decode(const pb_msgdesc_t *fields, void *dst, const uint8_t *buf, uint32_t len, ae_error *err) {
    pb_istream_t in = pb_istream_from_buffer(buf, len);
    if (!pb_decode(&in, fields, dst)) return err_set(err, "invalid message: %s", PB_GET_ERROR(&in));
    return AE_OK;
}

int msg_encode(const pb_msgdesc_t *fields, const void *src, uint8_t *buf, uint32_t cap, uint32_t *len, ae_error *err) {
    pb_ostream_t out = pb_ostream_from_buffer(buf, cap);
    if (!pb_encode(&out, fields, src)) return err_set(err, "cannot encode a reply: %s", PB_GET_ERROR(&out));
    *len = (uint32_t)out.bytes_written;
    return AE_OK;
}
