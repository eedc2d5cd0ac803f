/* OpenAI's response_format, checked against the JSON Schema subset the
 * target's grammar engine honours exactly (target/grammar.h):
 *
 *   type (object, array, string, integer, number, boolean, null, or a
 *   list of them), properties, required, additionalProperties: false,
 *   enum, const, anyOf, items, minItems, maxItems, minLength, maxLength,
 *   minimum, maximum, exclusiveMinimum, exclusiveMaximum, $ref to
 *   "#/$defs/..." or "#/definitions/..." in the same document, and the
 *   annotations title, description, $schema, $id, $comment, examples.
 *
 * Any other keyword would be ignored by some engines and honoured by
 * others; here it is a 400 that names it and where it is. */
#ifndef AERIE_GATEWAY_SCHEMA_H
#define AERIE_GATEWAY_SCHEMA_H

#include <cjson/cJSON.h>

#define SCHEMA_MAX_DEPTH 32  /* nesting of schemas */
#define SCHEMA_MAX_NODES 2048 /* schemas in one document */

/* Checks schema (a JSON object) against the subset. On failure, why[cap]
 * names the keyword and its place (e.g. "'pattern' at
 * #/properties/zip is not supported") and AE_ERR is returned. */
int schema_check(const cJSON *schema, char *why, size_t cap);

#endif
