/* The RPC link's frames: how a call's messages are cut on the wire.
 *
 * A frame is a 32-byte header, then the message (nanopb-encoded, or UTF-8
 * error text on a failed reply or end), then the raw payload (tensors and
 * token runs that messages reference by PayloadRef, never copied through
 * protobuf). All integers are little-endian.
 *
 *   offset  size  field
 *        0     4  magic "AERF"
 *        4     1  version      contract version (aerie.proto CONTRACT_VERSION)
 *        5     1  kind         frame_kind
 *        6     2  method       aerie.proto Method (requests), else the call's
 *        8     4  call id      chosen by the caller, unique per connection
 *       12     4  status       gRPC status code (replies and ends)
 *       16     4  timeout      microseconds the caller waits (requests; 0: none)
 *       20     4  msg_len
 *       24     4  payload_len
 *       28     4  reserved     0
 *
 * This module is pure: it encodes and checks headers and resolves payload
 * references. The connection logic is in rpc.h. */
#ifndef AERIE_RPC_FRAME_H
#define AERIE_RPC_FRAME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/err.h"

#define FRAME_MAGIC 0x46524541u /* "AERF" read little-endian */
#define FRAME_HEADER 32
#define FRAME_VERSION 3      /* aerie.proto CONTRACT_VERSION */
#define FRAME_MAX_ERROR 1024 /* bytes of error text in a failed reply */

typedef enum frame_kind {
    FRAME_REQUEST = 1, /* starts a call */
    FRAME_REPLY = 2,   /* a unary call's answer (status, message or error text) */
    FRAME_ITEM = 3,    /* one item of a server stream */
    FRAME_END = 4,     /* a stream's end (status, error text when not OK) */
    FRAME_CANCEL = 5,  /* the caller gives up on a call */
    FRAME_PING = 6,    /* keepalive; answered by PONG with the same call id */
    FRAME_PONG = 7,
} frame_kind;

/* gRPC's status codes. */
typedef enum rpc_status {
    RPC_OK = 0,
    RPC_CANCELLED = 1,
    RPC_UNKNOWN = 2,
    RPC_INVALID_ARGUMENT = 3,
    RPC_DEADLINE_EXCEEDED = 4,
    RPC_NOT_FOUND = 5,
    RPC_ALREADY_EXISTS = 6,
    RPC_PERMISSION_DENIED = 7,
    RPC_RESOURCE_EXHAUSTED = 8,
    RPC_FAILED_PRECONDITION = 9,
    RPC_ABORTED = 10,
    RPC_OUT_OF_RANGE = 11,
    RPC_UNIMPLEMENTED = 12,
    RPC_INTERNAL = 13,
    RPC_UNAVAILABLE = 14,
    RPC_DATA_LOSS = 15,
    RPC_UNAUTHENTICATED = 16,
} rpc_status;

const char *frame_status_name(uint32_t status); /* "NOT_FOUND"; "?" past the set */

typedef struct frame_header {
    uint8_t version;
    uint8_t kind;
    uint16_t method;
    uint32_t call_id;
    uint32_t status;
    uint32_t timeout_us;
    uint32_t msg_len;
    uint32_t payload_len;
} frame_header;

void frame_encode_header(const frame_header *h, uint8_t out[FRAME_HEADER]);

/* What a header says about the stream. */
typedef enum frame_check {
    FRAME_OK = 0,
    FRAME_BAD_MAGIC,   /* not this protocol: close */
    FRAME_BAD_VERSION, /* another contract version: refuse, then close */
    FRAME_BAD_HEADER,  /* unknown kind, nonzero reserved: close */
    FRAME_TOO_BIG,     /* over the limit: refuse, then close */
} frame_check;

/* Decodes and checks a header against the frame-size limit (message plus
 * payload, in bytes). err says what is wrong, in words for the peer. */
frame_check frame_decode_header(const uint8_t in[FRAME_HEADER], uint32_t max_frame, frame_header *h, ae_error *err);

/* Resolves a payload reference to count elements of elem_size bytes,
 * checking that it lies inside the payload and has exactly that length.
 * Elements whose size is a multiple of 4 (int32 and float32 rows) must
 * start at an offset that is a multiple of 4; the payload itself is
 * 16-byte aligned in memory. count 0 accepts an empty reference. */
int frame_payload_slice(const uint8_t *payload, uint32_t payload_len, uint32_t offset, uint32_t length,
                        size_t elem_size, size_t count, const void **out, ae_error *err);

#endif
