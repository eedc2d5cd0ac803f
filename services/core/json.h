/* Strict JSON on top of cJSON, for everything read from files and the
 * network.
 *
 * cJSON alone accepts two things we must not: bytes after the first value
 * ("{} garbage" parses as {}), and NUL inside a string (a raw NUL byte or a
 * \u0000 escape), which it stores in a C string that then silently ends
 * early. json_parse refuses both. */
#ifndef AERIE_CORE_JSON_H
#define AERIE_CORE_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "err.h"

/* Parses text[0..len) as exactly one JSON value with nothing but
 * whitespace after it (one NUL terminator at the very end is allowed).
 * Returns NULL with err set to one of:
 *   "not valid JSON (near byte N)"
 *   "a NUL byte at byte N"
 *   "a \u0000 escape at byte N is not supported"
 *   "trailing data after the JSON value at byte N"
 * Free the result with cJSON_Delete. */
cJSON *json_parse(const char *text, size_t len, ae_error *err);

/* The JSON file at path (at most max_bytes), parsed as json_parse does;
 * errors are prefixed with the path. */
cJSON *json_read_file(const char *path, size_t max_bytes, ae_error *err);

/* True when v is a number with an integral value in [lo, hi] (bounds
 * within +-2^53, where doubles are exact). */
bool json_int(const cJSON *v, int64_t lo, int64_t hi, int64_t *out);

#endif
