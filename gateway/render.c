#include "render.h"

#include <stdlib.h>
#include <string.h>

#include "../services/tokenizer/detok.h"
#include "aerie.pb.h"

/* bytes as a JSON string, invalid UTF-8 replaced by U+FFFD. */
static void quote_lossy(jbuf *b, const uint8_t *bytes, size_t len) {
    char small[256], *t = DETOK_UTF8_MAX_OUT(len) + 3 <= sizeof small ? small : malloc(DETOK_UTF8_MAX_OUT(len) + 3);
    if (!t) {
        b->oom = true;
        return;
    }
    detok_utf8 u;
    detok_utf8_init(&u);
    size_t n = detok_utf8_push(&u, bytes, len, t, DETOK_UTF8_MAX_OUT(len));
    n += detok_utf8_flush(&u, t + n, 3);
    jbuf_quote(b, t, n);
    if (t != small) free(t);
}

static void logprob(jbuf *b, float x) {
    if (x > -9999.0f)
        jbuf_printf(b, "%.9g", (double)x);
    else
        jbuf_str(b, "-9999.0");
}

static void byte_list(jbuf *b, const uint8_t *bytes, size_t len) {
    jbuf_str(b, "[");
    for (size_t i = 0; i < len; i++) jbuf_printf(b, i ? ",%u" : "%u", bytes[i]);
    jbuf_str(b, "]");
}

void render_lp_add(render_lp *l, const uint8_t *bytes, size_t len, float lp, const render_top *top, int n_top,
                   int64_t text_offset) {
    const char *sep = l->n ? "," : "";
    if (l->chat) {
        jbuf *b = &l->content;
        jbuf_printf(b, "%s{\"token\":", sep);
        quote_lossy(b, bytes, len);
        jbuf_str(b, ",\"logprob\":");
        logprob(b, lp);
        jbuf_str(b, ",\"bytes\":");
        byte_list(b, bytes, len);
        jbuf_str(b, ",\"top_logprobs\":[");
        for (int k = 0; k < n_top; k++) {
            jbuf_str(b, k ? ",{\"token\":" : "{\"token\":");
            quote_lossy(b, top[k].bytes, top[k].len);
            jbuf_str(b, ",\"logprob\":");
            logprob(b, top[k].logprob);
            jbuf_str(b, ",\"bytes\":");
            byte_list(b, top[k].bytes, top[k].len);
            jbuf_str(b, "}");
        }
        jbuf_str(b, "]}");
    } else {
        jbuf_str(&l->tokens, sep);
        quote_lossy(&l->tokens, bytes, len);
        jbuf_str(&l->lps, sep);
        logprob(&l->lps, lp);
        jbuf_printf(&l->offsets, "%s%lld", sep, (long long)text_offset);
        /* A dict of token text to logprob; two tokens with one text keep
         * the first (the more likely). */
        jbuf *b = &l->tops;
        jbuf_printf(b, "%s{", sep);
        for (int k = 0; k < n_top; k++) {
            bool dup = false;
            for (int j = 0; j < k && !dup; j++)
                dup = top[j].len == top[k].len && memcmp(top[j].bytes, top[k].bytes, top[k].len) == 0;
            if (dup) continue;
            if (b->len && b->p[b->len - 1] != '{') jbuf_str(b, ",");
            quote_lossy(b, top[k].bytes, top[k].len);
            jbuf_str(b, ":");
            logprob(b, top[k].logprob);
        }
        jbuf_str(b, "}");
    }
    l->n++;
}

static void list(jbuf *b, const char *name, const jbuf *items, bool first) {
    jbuf_printf(b, "%s\"%s\":[", first ? "" : ",", name);
    if (items->len) jbuf_add(b, items->p, items->len);
    jbuf_str(b, "]");
}

void render_lp_json(jbuf *b, const render_lp *l) {
    jbuf_str(b, "{");
    if (l->chat) {
        list(b, "content", &l->content, true);
    } else {
        list(b, "tokens", &l->tokens, true);
        list(b, "token_logprobs", &l->lps, false);
        list(b, "top_logprobs", &l->tops, false);
        list(b, "text_offset", &l->offsets, false);
    }
    jbuf_str(b, "}");
    b->oom |= l->content.oom || l->tokens.oom || l->lps.oom || l->tops.oom || l->offsets.oom;
}

size_t render_lp_bytes(const render_lp *l) {
    return l->content.len + l->tokens.len + l->lps.len + l->tops.len + l->offsets.len;
}

void render_lp_clear(render_lp *l) {
    jbuf_clear(&l->content);
    jbuf_clear(&l->tokens);
    jbuf_clear(&l->lps);
    jbuf_clear(&l->tops);
    jbuf_clear(&l->offsets);
    l->n = 0;
}

void render_lp_free(render_lp *l) {
    jbuf_free(&l->content);
    jbuf_free(&l->tokens);
    jbuf_free(&l->lps);
    jbuf_free(&l->tops);
    jbuf_free(&l->offsets);
    l->n = 0;
}

const char *render_finish_name(int finish) {
    return finish == aerie_FinishReason_FINISH_LENGTH ? "length"
           : finish == RENDER_FINISH_TOOL_CALLS       ? "tool_calls"
                                                      : "stop";
}

void render_chunk_head(jbuf *b, const render_meta *m) {
    jbuf_printf(b, "data: {\"id\":\"%s\",\"object\":\"%s\",\"created\":%lld,\"model\":", m->id,
                m->chat ? "chat.completion.chunk" : "text_completion", (long long)m->created);
    jbuf_quote(b, m->model, strlen(m->model));
}

static void usage(jbuf *b, int32_t prompt_tokens, int32_t completion_tokens) {
    jbuf_printf(b, "\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,\"total_tokens\":%d}", prompt_tokens,
                completion_tokens, prompt_tokens + completion_tokens);
}

void render_chunk(jbuf *b, const jbuf *head, bool chat, int32_t index, const char *text, size_t n, bool role,
                  const render_lp *lp, const char *finish, bool include_usage) {
    jbuf_add(b, head->p, head->len);
    jbuf_printf(b, ",\"choices\":[{\"index\":%d,", index);
    if (chat) {
        jbuf_str(b, "\"delta\":{");
        if (role)
            jbuf_str(b, "\"role\":\"assistant\",\"content\":\"\"");
        else if (text)
            jbuf_str(b, "\"content\":"), jbuf_quote(b, text, n);
        jbuf_str(b, "}");
    } else {
        jbuf_str(b, "\"text\":");
        jbuf_quote(b, text ? text : "", text ? n : 0);
    }
    jbuf_str(b, ",\"logprobs\":");
    if (lp)
        render_lp_json(b, lp);
    else
        jbuf_str(b, "null");
    jbuf_str(b, ",\"finish_reason\":");
    if (finish)
        jbuf_printf(b, "\"%s\"", finish);
    else
        jbuf_str(b, "null");
    jbuf_str(b, "}]");
    if (include_usage) jbuf_str(b, ",\"usage\":null");
    jbuf_str(b, "}\n\n");
}

void render_tool_chunk(jbuf *b, const jbuf *head, int32_t index, const char *tool_calls, bool include_usage) {
    jbuf_add(b, head->p, head->len);
    jbuf_printf(b,
                ",\"choices\":[{\"index\":%d,\"delta\":{\"tool_calls\":%s},\"logprobs\":null,"
                "\"finish_reason\":null}]",
                index, tool_calls);
    if (include_usage) jbuf_str(b, ",\"usage\":null");
    jbuf_str(b, "}\n\n");
}

void render_usage_chunk(jbuf *b, const jbuf *head, int32_t prompt_tokens, int32_t completion_tokens) {
    jbuf_add(b, head->p, head->len);
    jbuf_str(b, ",\"choices\":[],");
    usage(b, prompt_tokens, completion_tokens);
    jbuf_str(b, "}\n\n");
}

void render_completion(jbuf *b, const render_meta *m, const render_choice *c, int32_t n_choices, int32_t prompt_tokens,
                       int32_t completion_tokens) {
    jbuf_printf(b, "{\"id\":\"%s\",\"object\":\"%s\",\"created\":%lld,\"model\":", m->id,
                m->chat ? "chat.completion" : "text_completion", (long long)m->created);
    jbuf_quote(b, m->model, strlen(m->model));
    jbuf_str(b, ",\"choices\":[");
    for (int32_t i = 0; i < n_choices; i++) render_completion_choice(b, m->chat, i, &c[i]);
    jbuf_str(b, "],");
    usage(b, prompt_tokens, completion_tokens);
    jbuf_str(b, "}");
}

void render_completion_choice(jbuf *b, bool chat, int32_t index, const render_choice *c) {
    jbuf_printf(b, "%s{\"index\":%d,", index ? "," : "", index);
    if (chat)
        jbuf_str(b, "\"message\":{\"role\":\"assistant\",\"content\":");
    else
        jbuf_str(b, "\"text\":");
    if (c->tool_calls && !c->text)
        jbuf_str(b, "null");
    else
        jbuf_quote(b, c->text ? c->text : "", c->text ? c->n : 0);
    if (chat && c->tool_calls) jbuf_printf(b, ",\"tool_calls\":%s", c->tool_calls);
    if (chat) jbuf_str(b, "}");
    jbuf_str(b, ",\"logprobs\":");
    if (c->lp)
        render_lp_json(b, c->lp);
    else
        jbuf_str(b, "null");
    jbuf_printf(b, ",\"finish_reason\":\"%s\"}", c->finish);
}

void render_error_event(jbuf *b, const char *error_json) { jbuf_printf(b, "data: %s\n\ndata: [DONE]\n\n", error_json); }

void render_model(jbuf *b, const char *name, int64_t created, int32_t max_model_len, bool list) {
    if (list) jbuf_str(b, "{\"object\":\"list\",\"data\":[");
    jbuf_str(b, "{\"id\":");
    jbuf_quote(b, name, strlen(name));
    jbuf_printf(b, ",\"object\":\"model\",\"created\":%lld,\"owned_by\":\"aerie\",\"max_model_len\":%d}",
                (long long)created, max_model_len);
    if (list) jbuf_str(b, "]}");
}
