#include "frame.h"

#include <string.h>

static void put32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static uint32_t get32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

const char *frame_status_name(uint32_t status) {
    static const char *const names[] = {
        "OK",        "CANCELLED",       "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
        "NOT_FOUND", "ALREADY_EXISTS",  "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
        "ABORTED",   "OUT_OF_RANGE",    "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
        "DATA_LOSS", "UNAUTHENTICATED",
    };
    return status < sizeof names / sizeof names[0] ? names[status] : "?";
}

void frame_encode_header(const frame_header *h, uint8_t out[FRAME_HEADER]) {
    put32(out, FRAME_MAGIC);
    out[4] = h->version;
    out[5] = h->kind;
    out[6] = (uint8_t)h->method;
    out[7] = (uint8_t)(h->method >> 8);
    put32(out + 8, h->call_id);
    put32(out + 12, h->status);
    put32(out + 16, h->timeout_us);
    put32(out + 20, h->msg_len);
    put32(out + 24, h->payload_len);
    put32(out + 28, 0);
}

frame_check frame_decode_header(const uint8_t in[FRAME_HEADER], uint32_t max_frame, frame_header *h, ae_error *err) {
    memset(h, 0, sizeof *h);
    if (get32(in) != FRAME_MAGIC) {
        err_set(err, "not an Aerie RPC frame (bad magic)");
        return FRAME_BAD_MAGIC;
    }
    h->version = in[4];
    h->kind = in[5];
    h->method = (uint16_t)(in[6] | in[7] << 8);
    h->call_id = get32(in + 8);
    h->status = get32(in + 12);
    h->timeout_us = get32(in + 16);
    h->msg_len = get32(in + 20);
    h->payload_len = get32(in + 24);
    if (h->version != FRAME_VERSION) {
        err_set(err, "the peer speaks contract version %u, this service speaks version %u", h->version, FRAME_VERSION);
        return FRAME_BAD_VERSION;
    }
    if (h->kind < FRAME_REQUEST || h->kind > FRAME_PONG || get32(in + 28) != 0) {
        err_set(err, "malformed frame header (kind %u)", h->kind);
        return FRAME_BAD_HEADER;
    }
    if ((uint64_t)h->msg_len + h->payload_len > max_frame) {
        err_set(err, "frame of %llu bytes is over the limit of %u bytes",
                (unsigned long long)h->msg_len + h->payload_len, max_frame);
        return FRAME_TOO_BIG;
    }
    return FRAME_OK;
}

int frame_payload_slice(const uint8_t *payload, uint32_t payload_len, uint32_t offset, uint32_t length,
                        size_t elem_size, size_t count, const void **out, ae_error *err) {
    *out = NULL;
    if ((uint64_t)elem_size * count != length)
        return err_set(err, "payload reference of %u bytes, expected %zu x %zu", length, count, elem_size);
    if ((uint64_t)offset + length > payload_len)
        return err_set(err, "payload reference [%u, +%u) outside a payload of %u bytes", offset, length, payload_len);
    if (elem_size % 4 == 0 && offset % 4 != 0)
        return err_set(err, "payload reference at offset %u is not aligned to 4 bytes", offset);
    *out = length ? payload + offset : NULL;
    return AE_OK;
}
