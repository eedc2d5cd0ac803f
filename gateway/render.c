#include "render.h"

#include <string.h>

#include "aerie.pb.h"

const char *render_finish_name(int finish) { return finish == aerie_FinishReason_FINISH_LENGTH ? "length" : "stop"; }

void render_chunk_head(jbuf *b, const render_meta *m) {
    jbuf_printf(b, "data: {\"id\":\"%s\",\"object\":\"%s\",\"created\":%lld,\"model\":", m->id,
                m->chat ? "chat.completion.chunk" : "text_completion", (long long)m->created);
    jbuf_quote(b, m->model, strlen(m->model));
}

static void usage(jbuf *b, int32_t prompt_tokens, int32_t completion_tokens) {
    jbuf_printf(b, "\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,\"total_tokens\":%d}", prompt_tokens,
                completion_tokens, prompt_tokens + completion_tokens);
}

void render_chunk(jbuf *b, const jbuf *head, bool chat, const char *text, size_t n, bool role, const char *finish,
                  bool include_usage) {
    jbuf_add(b, head->p, head->len);
    jbuf_str(b, ",\"choices\":[{\"index\":0,");
    if (chat) {
        jbuf_str(b, "\"delta\":{");
        if (role) jbuf_str(b, "\"role\":\"assistant\",\"content\":\"\"");
        else if (text) jbuf_str(b, "\"content\":"), jbuf_quote(b, text, n);
        jbuf_str(b, "}");
    } else {
        jbuf_str(b, "\"text\":");
        jbuf_quote(b, text ? text : "", text ? n : 0);
    }
    jbuf_str(b, ",\"logprobs\":null,\"finish_reason\":");
    if (finish) jbuf_printf(b, "\"%s\"", finish);
    else jbuf_str(b, "null");
    jbuf_str(b, "}]");
    if (include_usage) jbuf_str(b, ",\"usage\":null");
    jbuf_str(b, "}\n\n");
}

void render_usage_chunk(jbuf *b, const jbuf *head, int32_t prompt_tokens, int32_t completion_tokens) {
    jbuf_add(b, head->p, head->len);
    jbuf_str(b, ",\"choices\":[],");
    usage(b, prompt_tokens, completion_tokens);
    jbuf_str(b, "}\n\n");
}

void render_completion(jbuf *b, const render_meta *m, const char *text, size_t n, const char *finish,
                       int32_t prompt_tokens, int32_t completion_tokens) {
    jbuf_printf(b, "{\"id\":\"%s\",\"object\":\"%s\",\"created\":%lld,\"model\":", m->id,
                m->chat ? "chat.completion" : "text_completion", (long long)m->created);
    jbuf_quote(b, m->model, strlen(m->model));
    jbuf_str(b, ",\"choices\":[{\"index\":0,");
    if (m->chat) jbuf_str(b, "\"message\":{\"role\":\"assistant\",\"content\":");
    else jbuf_str(b, "\"text\":");
    jbuf_quote(b, text ? text : "", n);
    if (m->chat) jbuf_str(b, "}");
    jbuf_printf(b, ",\"logprobs\":null,\"finish_reason\":\"%s\"}],", finish);
    usage(b, prompt_tokens, completion_tokens);
    jbuf_str(b, "}");
}

void render_error_event(jbuf *b, const char *error_json) {
    jbuf_printf(b, "data: %s\n\ndata: [DONE]\n\n", error_json);
}

void render_model(jbuf *b, const char *name, int64_t created, int32_t max_model_len, bool list) {
    if (list) jbuf_str(b, "{\"object\":\"list\",\"data\":[");
    jbuf_str(b, "{\"id\":");
    jbuf_quote(b, name, strlen(name));
    jbuf_printf(b, ",\"object\":\"model\",\"created\":%lld,\"owned_by\":\"aerie\",\"max_model_len\":%d}",
                (long long)created, max_model_len);
    if (list) jbuf_str(b, "]}");
}
