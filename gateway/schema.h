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
 * others; here it is a 400 that names it and where it is.
 *
 * Limits. A schema's compile takes time and memory that grow with what it
 * holds, and its masks run inside every decoding step of every stream
 * (target/gcompile.h, target/sched.h): enum entries, anyOf alternatives
 * and optional properties cost the most, lengths, item counts and integer
 * ranges little, and all are bounded. Each limit below is a 400 that
 * names it and the value found; docs/performance.md gives the costs
 * measured that set them. */
#ifndef AERIE_GATEWAY_SCHEMA_H
#define AERIE_GATEWAY_SCHEMA_H

#include <cjson/cJSON.h>

#define SCHEMA_MAX_DEPTH 32                 /* nesting of schemas */
#define SCHEMA_MAX_NODES 2048               /* schemas in one document */
#define SCHEMA_MAX_BYTES (128 << 10)        /* the document as compact JSON text */
#define SCHEMA_MAX_ENUM 1024                /* values in one enum */
#define SCHEMA_MAX_ENUM_TOTAL 4096          /* enum values and consts in the document */
#define SCHEMA_MAX_LITERAL_BYTES (64 << 10) /* their JSON text, all together */
#define SCHEMA_MAX_ANYOF 64                 /* alternatives in one anyOf (OAI_MAX_TOOLS tools make one) */
#define SCHEMA_MAX_ALTERNATIVES 256         /* in the document, all together */
#define SCHEMA_MAX_REPEAT 10000             /* minLength, maxLength, minItems, maxItems */
#define SCHEMA_MAX_OPTIONAL 256             /* properties of one object that are not required */
/* A pattern's {m}, {m,} and {m,n}: each bound, and how many (patterns are
 * not in the subset yet; these hold already for when they are). */
#define SCHEMA_MAX_PATTERN_REPEAT 1000
#define SCHEMA_MAX_PATTERN_QUANTIFIERS 16
#define SCHEMA_MAX_NUMBER 9007199254740992.0 /* |minimum|, |maximum|, |exclusive*|: 2^53 */

/* Checks schema (a JSON object) against the subset. On failure, why[cap]
 * names the keyword and its place (e.g. "'pattern' at
 * #/properties/zip is not supported") and AE_ERR is returned. */
int schema_check(const cJSON *schema, char *why, size_t cap);

#endif
