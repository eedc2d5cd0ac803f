/* Tool calls in a finished chat reply (README, "Tools").
 *
 * With tool_choice required or a named function the grammar made the
 * whole reply one call, {"name": ..., "arguments": {...}}. With auto the
 * model may write calls in the tags the tool prompt asks for:
 * <tool_call> JSON </tool_call> (the closing tag may be cut by the end of
 * the reply); blocks are read in order until one is not a call, and the
 * text around the calls is kept beside them. A call counts when its JSON
 * is an object whose "name" is one of the tools and whose "arguments" is
 * an object. */
#ifndef AERIE_GATEWAY_TOOLCALL_H
#define AERIE_GATEWAY_TOOLCALL_H

#include <stdbool.h>
#include <stddef.h>

/* The calls in text[0..len) as OpenAI's tool_calls (a JSON list of
 * {"id": "call_<id>_<k>", "type": "function", "function": {"name",
 * "arguments": compact JSON text}}, each with its "index" first when
 * with_index: a stream's delta), malloc'd; NULL when there is none (or out
 * of memory). whole: the text is one call. *rest: the text besides the
 * calls, spaces and newlines trimmed, malloc'd, or NULL when empty. */
char *toolcall_find(const char *text, size_t len, bool whole, const char *const *names, int n_names, const char *id,
                    bool with_index, char **rest);

#endif
