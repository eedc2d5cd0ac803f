/* nanopb messages in and out of frames, with the first error in words. */
#ifndef AERIE_RPC_MSG_H
#define AERIE_RPC_MSG_H

#include <stdint.h>

#include <pb.h>

#include "../core/err.h"

/* Decodes exactly len bytes into dst (zeroed first). Anything that is not
 * a valid message of this type fails; dst is then not to be trusted. */
int msg_decode(const pb_msgdesc_t *fields, void *dst, const uint8_t *buf, uint32_t len, ae_error *err);

/* Encodes src into buf[cap]; *len is the encoded size. */
int msg_encode(const pb_msgdesc_t *fields, const void *src, uint8_t *buf, uint32_t cap, uint32_t *len, ae_error *err);

#endif
