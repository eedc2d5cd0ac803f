/* Chat templates: recognise a known Jinja template, render its family in C.
 * See chat.h for what is recognised and why recognition is exact. */
#include "chat.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "../core/json.h"

/* ---- a Jinja lexer, just enough to compare templates -------------------
 *
 * It turns a template into the token stream Jinja's own lexer would make,
 * under transformers' environment (trim_blocks, lstrip_blocks, newlines
 * normalised to \n, one trailing newline dropped), then normalises what
 * cannot change the output: quote style and escapes (a string token holds
 * its decoded value), whitespace inside tags, whitespace-control signs
 * (their effect is applied to the text tokens), comments, and `a.b`, which
 * becomes `a['b']` (Jinja's getattr and getitem fall back to each other).
 * Two templates with equal streams render the same for every input. */

typedef enum jkind {
    JT_TEXT,        /* literal output text, after whitespace control */
    JT_VAR_BEGIN,   /* {{ */
    JT_VAR_END,     /* }} */
    JT_BLOCK_BEGIN, /* {% */
    JT_BLOCK_END,   /* %} */
    JT_NAME,
    JT_STRING, /* decoded value */
    JT_NUMBER,
    JT_OP,
} jkind;

typedef struct jtok {
    jkind kind;
    const char *s; /* into jlex.src or jlex.strs; not NUL-terminated */
    size_t len;
} jtok;

typedef struct jlex {
    char *src; /* normalised copy of the source */
    size_t n_src;
    char *strs; /* decoded string literals; never longer than src */
    size_t n_strs;
    jtok *toks;
    size_t n, cap;
} jlex;

static void jlex_free(jlex *lx) {
    free(lx->src);
    free(lx->strs);
    free(lx->toks);
    memset(lx, 0, sizeof *lx);
}

static int jpush(jlex *lx, jkind kind, const char *s, size_t len) {
    /* Attribute access `.name` is item access `['name']` (see above). */
    if (kind == JT_NAME && lx->n > 0 && lx->toks[lx->n - 1].kind == JT_OP && lx->toks[lx->n - 1].len == 1 &&
        lx->toks[lx->n - 1].s[0] == '.') {
        lx->n--;
        if (jpush(lx, JT_OP, "[", 1) != AE_OK) return AE_ERR;
        if (jpush(lx, JT_STRING, s, len) != AE_OK) return AE_ERR;
        return jpush(lx, JT_OP, "]", 1);
    }
    if (lx->n == lx->cap) {
        size_t cap = lx->cap ? lx->cap * 2 : 256;
        jtok *t = realloc(lx->toks, cap * sizeof *t);
        if (t == NULL) return AE_ERR;
        lx->toks = t;
        lx->cap = cap;
    }
    lx->toks[lx->n++] = (jtok){kind, s, len};
    return AE_OK;
}

static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

static bool is_alpha_(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }

static bool is_digit(char c) { return c >= '0' && c <= '9'; }

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static size_t utf8_put(char *out, uint32_t cp) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Decodes the body of a string literal, src[0..n), the way Jinja does
 * (Python's unicode-escape). Every escape is at least as long as what it
 * decodes to, so lx->strs (sized like the source) cannot overflow. Escapes
 * we do not model (\N{...}, surrogates, a backslash before a non-ASCII
 * byte) fail, which makes the template unrecognised rather than misread. */
static int jstring(jlex *lx, const char *p, size_t n) {
    char *out = lx->strs + lx->n_strs;
    size_t w = 0;
    for (size_t i = 0; i < n;) {
        if (p[i] != '\\') {
            out[w++] = p[i++];
            continue;
        }
        if (i + 1 >= n) return AE_ERR;
        char c = p[i + 1];
        i += 2;
        switch (c) {
        case '\n': break; /* line continuation */
        case '\\': out[w++] = '\\'; break;
        case '\'': out[w++] = '\''; break;
        case '"': out[w++] = '"'; break;
        case 'a': out[w++] = '\a'; break;
        case 'b': out[w++] = '\b'; break;
        case 'f': out[w++] = '\f'; break;
        case 'n': out[w++] = '\n'; break;
        case 'r': out[w++] = '\r'; break;
        case 't': out[w++] = '\t'; break;
        case 'v': out[w++] = '\v'; break;
        case 'x':
        case 'u':
        case 'U': {
            size_t digits = c == 'x' ? 2 : c == 'u' ? 4 : 8;
            if (i + digits > n) return AE_ERR;
            uint32_t cp = 0;
            for (size_t k = 0; k < digits; k++) {
                int h = hexval(p[i + k]);
                if (h < 0) return AE_ERR;
                cp = cp * 16 + (uint32_t)h;
            }
            i += digits;
            /* NUL would cut a C string short; surrogates are not UTF-8. */
            if (cp == 0 || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return AE_ERR;
            w += utf8_put(out + w, cp);
            break;
        }
        default:
            if (c >= '0' && c <= '7') {
                uint32_t cp = (uint32_t)(c - '0');
                for (int k = 0; k < 2 && i < n && p[i] >= '0' && p[i] <= '7'; k++)
                    cp = cp * 8 + (uint32_t)(p[i++] - '0');
                if (cp == 0) return AE_ERR;
                w += utf8_put(out + w, cp);
            } else if ((unsigned char)c >= 0x80 || c == 'N') {
                return AE_ERR;
            } else {
                /* Python keeps an unknown escape as written. */
                out[w++] = '\\';
                out[w++] = c;
            }
        }
    }
    if (jpush(lx, JT_STRING, out, w) != AE_OK) return AE_ERR;
    lx->n_strs += w;
    return AE_OK;
}

/* Emits text src[b..e) as a token unless whitespace control left it empty.
 * strip_left: the previous tag ended with '-'. The next tag's sign decides
 * the right side (tag == 0 at the end of the template). */
static int jtext(jlex *lx, size_t b, size_t e, char tag, char sign) {
    const char *s = lx->src;
    if (sign == '-') {
        while (e > b && is_space(s[e - 1])) e--;
    } else if (tag != 0 && tag != '{' && sign != '+') {
        /* lstrip_blocks: spaces between the start of the line and a block or
         * comment tag go, if that is all there is on the line so far. */
        size_t l = e;
        while (l > b && s[l - 1] != '\n') l--;
        bool line_start = l > b || b == 0 || s[b - 1] == '\n';
        if (line_start && l < e) {
            size_t k = l;
            while (k < e && is_space(s[k])) k++;
            if (k == e) e = l;
        }
    }
    if (e > b) return jpush(lx, JT_TEXT, s + b, e - b);
    return AE_OK;
}

/* Lexes the inside of a {{ }} or {% %} tag starting at *pos; on return *pos
 * is past the closing delimiter and any whitespace control it implies. */
static int jtag(jlex *lx, size_t *pos, char tag) {
    const char *s = lx->src;
    size_t n = lx->n_src, i = *pos;
    int depth = 0;
    for (;;) {
        while (i < n && is_space(s[i])) i++;
        if (i >= n) return AE_ERR;
        char close = tag == '{' ? '}' : '%';
        if (depth == 0) {
            bool dash = s[i] == '-' && i + 2 < n && s[i + 1] == close && s[i + 2] == '}';
            bool plain = s[i] == close && i + 1 < n && s[i + 1] == '}';
            if (dash || plain) {
                if (jpush(lx, tag == '{' ? JT_VAR_END : JT_BLOCK_END, "", 0) != AE_OK) return AE_ERR;
                i += dash ? 3 : 2;
                if (dash) {
                    while (i < n && is_space(s[i])) i++;
                } else if (tag == '%' && i < n && s[i] == '\n') {
                    i++; /* trim_blocks */
                }
                *pos = i;
                return AE_OK;
            }
        }
        char c = s[i];
        if (c == '\'' || c == '"') {
            size_t j = i + 1;
            while (j < n && s[j] != c) j += s[j] == '\\' ? 2 : 1;
            if (j >= n) return AE_ERR;
            if (jstring(lx, s + i + 1, j - i - 1) != AE_OK) return AE_ERR;
            i = j + 1;
        } else if (is_alpha_(c)) {
            size_t j = i;
            while (j < n && (is_alpha_(s[j]) || is_digit(s[j]))) j++;
            if (jpush(lx, JT_NAME, s + i, j - i) != AE_OK) return AE_ERR;
            i = j;
        } else if (is_digit(c)) {
            size_t j = i;
            while (j < n && (is_digit(s[j]) || s[j] == '_')) j++;
            if (j + 1 < n && s[j] == '.' && is_digit(s[j + 1])) {
                j++;
                while (j < n && (is_digit(s[j]) || s[j] == '_')) j++;
            }
            if (jpush(lx, JT_NUMBER, s + i, j - i) != AE_OK) return AE_ERR;
            i = j;
        } else {
            static const char *const two[] = {"//", "**", "==", "!=", ">=", "<="};
            size_t len = 0;
            for (size_t k = 0; k < sizeof two / sizeof two[0]; k++)
                if (i + 1 < n && s[i] == two[k][0] && s[i + 1] == two[k][1]) len = 2;
            if (len == 0) {
                if (strchr("+-/*%~[](){}.,:|=<>;", c) == NULL || c == '\0') return AE_ERR;
                len = 1;
                /* Jinja only looks for the closing delimiter outside
                 * brackets, so `{{ {'a': 1} }}` is one expression. */
                if (c == '(' || c == '[' || c == '{') depth++;
                if (c == ')' || c == ']' || c == '}') {
                    if (depth == 0) return AE_ERR;
                    depth--;
                }
            }
            if (jpush(lx, JT_OP, s + i, len) != AE_OK) return AE_ERR;
            i += len;
        }
    }
}

/* Lexes a whole template. AE_ERR means "not something we can compare":
 * out of memory, or syntax we do not model. */
static int jlex_run(jlex *lx, const char *src, size_t n) {
    memset(lx, 0, sizeof *lx);
    lx->src = malloc(n + 1);
    lx->strs = malloc(n + 1);
    if (lx->src == NULL || lx->strs == NULL) goto fail;
    /* Jinja reads \r\n and \r as \n and drops one trailing newline. */
    size_t w = 0;
    for (size_t i = 0; i < n; i++) {
        if (src[i] == '\r') {
            lx->src[w++] = '\n';
            if (i + 1 < n && src[i + 1] == '\n') i++;
        } else {
            lx->src[w++] = src[i];
        }
    }
    if (w > 0 && lx->src[w - 1] == '\n') w--;
    lx->src[w] = '\0';
    lx->n_src = w;

    const char *s = lx->src;
    size_t pos = 0;
    for (;;) {
        size_t t = pos;
        while (t + 1 < w && !(s[t] == '{' && (s[t + 1] == '{' || s[t + 1] == '%' || s[t + 1] == '#'))) t++;
        if (t + 1 >= w) {
            if (jtext(lx, pos, w, 0, 0) != AE_OK) goto fail;
            return AE_OK;
        }
        char tag = s[t + 1];
        /* '+' (keep the line's indentation) only exists for blocks. */
        char sign = 0;
        if (t + 2 < w && (s[t + 2] == '-' || (s[t + 2] == '+' && tag != '{'))) sign = s[t + 2];
        if (jtext(lx, pos, t, tag, sign) != AE_OK) goto fail;
        pos = t + 2 + (sign ? 1 : 0);
        if (tag == '#') {
            const char *end = strstr(s + pos, "#}");
            if (end == NULL) goto fail;
            bool dash = end > s + pos && end[-1] == '-';
            pos = (size_t)(end - s) + 2;
            if (dash) {
                while (pos < w && is_space(s[pos])) pos++;
            } else if (pos < w && s[pos] == '\n') {
                pos++; /* trim_blocks applies to comments too */
            }
            continue;
        }
        if (jpush(lx, tag == '{' ? JT_VAR_BEGIN : JT_BLOCK_BEGIN, "", 0) != AE_OK) goto fail;
        if (jtag(lx, &pos, tag) != AE_OK) goto fail;
    }
fail:
    jlex_free(lx);
    return AE_ERR;
}

/* A byte that never occurs in a real template marks, inside a string
 * literal of a known template, where the default system prompt goes. */
#define HOLE '\x01'

/* Compares a template's tokens with a known template's. The text at every
 * hole must be the same; it is returned in *cap_s and *cap_len. */
static bool jmatch(const jlex *known, const jlex *got, const char **cap_s, size_t *cap_len) {
    *cap_s = NULL;
    *cap_len = 0;
    if (known->n != got->n) return false;
    for (size_t i = 0; i < known->n; i++) {
        const jtok *k = &known->toks[i], *g = &got->toks[i];
        if (k->kind != g->kind) return false;
        const char *hole = k->kind == JT_STRING ? memchr(k->s, HOLE, k->len) : NULL;
        if (hole == NULL) {
            if (k->len != g->len || memcmp(k->s, g->s, k->len) != 0) return false;
            continue;
        }
        size_t pre = (size_t)(hole - k->s), post = k->len - pre - 1;
        if (g->len < pre + post || memcmp(g->s, k->s, pre) != 0 || memcmp(g->s + g->len - post, hole + 1, post) != 0)
            return false;
        const char *c = g->s + pre;
        size_t clen = g->len - pre - post;
        if (*cap_s != NULL && (clen != *cap_len || memcmp(c, *cap_s, clen) != 0)) return false;
        *cap_s = c;
        *cap_len = clen;
    }
    return true;
}

/* ---- the known templates ----------------------------------------------- */

typedef enum chat_family { CHAT_CHATML, CHAT_LLAMA3 } chat_family;

typedef struct known_template {
    chat_family family;
    const char *variant;
    const char *src; /* Jinja source; HOLE = default system prompt */
} known_template;

static const known_template KNOWN[] = {
    {CHAT_CHATML, "chatml",
     "{% for message in messages %}"
     "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
     "{% endfor %}"
     "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"},

    /* SmolLM2, Qwen2, Qwen1.5. */
    {CHAT_CHATML, "chatml-default-system",
     "{% for message in messages %}"
     "{% if loop.first and messages[0]['role'] != 'system' %}"
     "{{ '<|im_start|>system\\n\x01<|im_end|>\\n' }}"
     "{% endif %}"
     "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
     "{% endfor %}"
     "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"},

    /* Qwen2.5 Instruct. We never pass tools, so its tools branch and its
     * tool_calls/tool-role branches are never taken; what remains renders
     * as default-system ChatML. */
    {CHAT_CHATML, "qwen2.5",
     "{%- if tools %}"
     "{{- '<|im_start|>system\\n' }}"
     "{%- if messages[0]['role'] == 'system' %}"
     "{{- messages[0]['content'] }}"
     "{%- else %}"
     "{{- '\x01' }}"
     "{%- endif %}"
     "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
     "query.\\n\\nYou are provided with function signatures within <tools></tools> XML "
     "tags:\\n<tools>\" }}"
     "{%- for tool in tools %}"
     "{{- \"\\n\" }}"
     "{{- tool | tojson }}"
     "{%- endfor %}"
     "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name "
     "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
     "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
     "{%- else %}"
     "{%- if messages[0]['role'] == 'system' %}"
     "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
     "{%- else %}"
     "{{- '<|im_start|>system\\n\x01<|im_end|>\\n' }}"
     "{%- endif %}"
     "{%- endif %}"
     "{%- for message in messages %}"
     "{%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
     "(message.role == \"assistant\" and not message.tool_calls) %}"
     "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
     "{%- elif message.role == \"assistant\" %}"
     "{{- '<|im_start|>' + message.role }}"
     "{%- if message.content %}"
     "{{- '\\n' + message.content }}"
     "{%- endif %}"
     "{%- for tool_call in message.tool_calls %}"
     "{%- if tool_call.function is defined %}"
     "{%- set tool_call = tool_call.function %}"
     "{%- endif %}"
     "{{- '\\n<tool_call>\\n{\"name\": \"' }}"
     "{{- tool_call.name }}"
     "{{- '\", \"arguments\": ' }}"
     "{{- tool_call.arguments | tojson }}"
     "{{- '}\\n</tool_call>' }}"
     "{%- endfor %}"
     "{{- '<|im_end|>\\n' }}"
     "{%- elif message.role == \"tool\" %}"
     "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}"
     "{{- '<|im_start|>user' }}"
     "{%- endif %}"
     "{{- '\\n<tool_response>\\n' }}"
     "{{- message.content }}"
     "{{- '\\n</tool_response>' }}"
     "{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}"
     "{{- '<|im_end|>\\n' }}"
     "{%- endif %}"
     "{%- endif %}"
     "{%- endfor %}"
     "{%- if add_generation_prompt %}"
     "{{- '<|im_start|>assistant\\n' }}"
     "{%- endif %}"},

    /* Meta-Llama-3-8B-Instruct (3.0). */
    {CHAT_LLAMA3, "llama3",
     "{% set loop_messages = messages %}"
     "{% for message in loop_messages %}"
     "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
     "+ message['content'] | trim + '<|eot_id|>' %}"
     "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
     "{{ content }}"
     "{% endfor %}"
     "{% if add_generation_prompt %}"
     "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
     "{% endif %}"},
};

#define N_KNOWN (sizeof KNOWN / sizeof KNOWN[0])

struct chat_template {
    const known_template *known;
    char *default_system; /* NUL-terminated; NULL when the template has none */
};

/* Explains a template that matched nothing, by the markers it uses. */
static int unrecognised(const char *src, ae_error *err) {
    if (strstr(src, "<|im_start|>"))
        return err_set(err, "chat template not recognised: it uses ChatML markers "
                            "(<|im_start|>) but is not one of the supported ChatML templates "
                            "(plain; default system prompt as in SmolLM2/Qwen2; Qwen2.5)");
    if (strstr(src, "<|start_header_id|>")) {
        if (strstr(src, "Cutting Knowledge Date") || strstr(src, "<|eom_id|>") || strstr(src, "Environment: ipython"))
            return err_set(err, "chat template not supported: Llama-3.1+ template (tools and "
                                "date preamble); only the Llama-3 (3.0) Instruct template is");
        return err_set(err, "chat template not recognised: it uses Llama-3 markers "
                            "(<|start_header_id|>) but is not the Llama-3 Instruct template");
    }
    return err_set(err, "chat template not supported: expected a ChatML (<|im_start|>) or "
                        "Llama-3 (<|start_header_id|>) template");
}

int chat_template_init(chat_template **out, const char *src, ae_error *err) {
    AE_ASSERT(out != NULL);
    *out = NULL;
    if (src == NULL || src[0] == '\0') return err_set(err, "model has no chat template (expected ChatML or Llama-3)");
    size_t n = strnlen(src, (size_t)CHAT_MAX_TEMPLATE + 1);
    if (n > CHAT_MAX_TEMPLATE) return err_set(err, "chat template longer than %u bytes", CHAT_MAX_TEMPLATE);

    jlex got;
    if (jlex_run(&got, src, n) != AE_OK) return unrecognised(src, err);
    int rc = AE_ERR;
    chat_template *t = NULL;
    for (size_t i = 0; i < N_KNOWN && t == NULL; i++) {
        jlex known;
        if (jlex_run(&known, KNOWN[i].src, strlen(KNOWN[i].src)) != AE_OK) {
            err_set(err, "chat_template_init: out of memory");
            goto done;
        }
        const char *cap = NULL;
        size_t cap_len = 0;
        if (jmatch(&known, &got, &cap, &cap_len)) {
            t = calloc(1, sizeof *t);
            if (t != NULL) {
                t->known = &KNOWN[i];
                if (cap != NULL) {
                    t->default_system = malloc(cap_len + 1);
                    if (t->default_system != NULL) {
                        memcpy(t->default_system, cap, cap_len);
                        t->default_system[cap_len] = '\0';
                    }
                }
            }
            if (t == NULL || (cap != NULL && t->default_system == NULL)) {
                free(t);
                jlex_free(&known);
                err_set(err, "chat_template_init: out of memory");
                goto done;
            }
        }
        jlex_free(&known);
    }
    if (t == NULL) {
        unrecognised(src, err);
        goto done;
    }
    *out = t;
    rc = AE_OK;
done:
    jlex_free(&got);
    return rc;
}

void chat_template_free(chat_template *t) {
    if (t == NULL) return;
    free(t->default_system);
    free(t);
}

const char *chat_family_name(const chat_template *t) {
    AE_ASSERT(t != NULL);
    return t->known->family == CHAT_LLAMA3 ? "llama3" : "chatml";
}

const char *chat_variant_name(const chat_template *t) {
    AE_ASSERT(t != NULL);
    return t->known->variant;
}

const char *chat_default_system(const chat_template *t) {
    AE_ASSERT(t != NULL);
    return t->default_system;
}

/* ---- rendering --------------------------------------------------------- */

/* Writes what fits and counts everything, so one pass both measures and
 * renders. */
typedef struct sink {
    char *out;
    size_t cap;
    size_t len;
} sink;

/* The limits keep the rendered length far from SIZE_MAX (each message adds
 * at most its content and ~40 bytes of markers). */
_Static_assert(SIZE_MAX / CHAT_MAX_MESSAGES > (size_t)CHAT_MAX_CONTENT + 4096, "chat limits could overflow size_t");

static void put(sink *s, const char *p, size_t n) {
    if (s->out != NULL && s->len <= s->cap && n <= s->cap - s->len) memcpy(s->out + s->len, p, n);
    s->len += n; /* cannot overflow: bounded by the CHAT_MAX_* limits */
}

static void puts_(sink *s, const char *p) { put(s, p, strlen(p)); }

/* Python's str.isspace() characters, which is what Jinja's trim filter
 * (str.strip) removes, as UTF-8. In valid UTF-8 each of these encodings can
 * only be a whole character, so matching bytes at either end is exact. */
static size_t space_len(const char *s, size_t n, bool at_end) {
    static const char *const multi[] = {
        "\xC2\x85",     "\xC2\xA0",     "\xE1\x9A\x80", "\xE2\x80\x80", "\xE2\x80\x81", "\xE2\x80\x82", "\xE2\x80\x83",
        "\xE2\x80\x84", "\xE2\x80\x85", "\xE2\x80\x86", "\xE2\x80\x87", "\xE2\x80\x88", "\xE2\x80\x89", "\xE2\x80\x8A",
        "\xE2\x80\xA8", "\xE2\x80\xA9", "\xE2\x80\xAF", "\xE2\x81\x9F", "\xE3\x80\x80",
    };
    if (n == 0) return 0;
    unsigned char c = (unsigned char)(at_end ? s[n - 1] : s[0]);
    if ((c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20)) return 1;
    for (size_t k = 0; k < sizeof multi / sizeof multi[0]; k++) {
        size_t len = strlen(multi[k]);
        if (len <= n && memcmp(at_end ? s + n - len : s, multi[k], len) == 0) return len;
    }
    return 0;
}

static bool role_ok(const char *role) {
    return strcmp(role, "system") == 0 || strcmp(role, "user") == 0 || strcmp(role, "assistant") == 0;
}

int chat_render(const chat_template *t, const chat_msg *msgs, size_t n, bool add_generation_prompt, char *out,
                size_t cap, size_t *len_out, ae_error *err) {
    AE_ASSERT(t != NULL && len_out != NULL);
    *len_out = 0;
    if (n == 0) return err_set(err, "messages: empty; a conversation needs at least one");
    if (n > CHAT_MAX_MESSAGES) return err_set(err, "messages: %zu exceeds the limit of %u", n, CHAT_MAX_MESSAGES);
    AE_ASSERT(msgs != NULL);
    for (size_t i = 0; i < n; i++) {
        if (msgs[i].role == NULL || !role_ok(msgs[i].role))
            return err_set(err,
                           "messages[%zu].role: \"%.32s\" is not one of system, user, "
                           "assistant",
                           i, msgs[i].role ? msgs[i].role : "(null)");
        if (msgs[i].content == NULL) return err_set(err, "messages[%zu].content: missing", i);
        if (strnlen(msgs[i].content, (size_t)CHAT_MAX_CONTENT + 1) > CHAT_MAX_CONTENT)
            return err_set(err, "messages[%zu].content: longer than %u bytes", i, CHAT_MAX_CONTENT);
    }
    if (out == NULL && cap != 0) return err_set(err, "chat_render: NULL buffer with capacity %zu", cap);

    sink s = {out, cap, 0};
    if (t->known->family == CHAT_CHATML) {
        if (t->default_system != NULL && strcmp(msgs[0].role, "system") != 0) {
            puts_(&s, "<|im_start|>system\n");
            puts_(&s, t->default_system);
            puts_(&s, "<|im_end|>\n");
        }
        for (size_t i = 0; i < n; i++) {
            puts_(&s, "<|im_start|>");
            puts_(&s, msgs[i].role);
            puts_(&s, "\n");
            puts_(&s, msgs[i].content);
            puts_(&s, "<|im_end|>\n");
        }
        if (add_generation_prompt) puts_(&s, "<|im_start|>assistant\n");
    } else {
        puts_(&s, "<|begin_of_text|>");
        for (size_t i = 0; i < n; i++) {
            const char *c = msgs[i].content;
            size_t len = strlen(c), k;
            while ((k = space_len(c, len, false)) > 0) {
                c += k;
                len -= k;
            }
            while ((k = space_len(c, len, true)) > 0) len -= k;
            puts_(&s, "<|start_header_id|>");
            puts_(&s, msgs[i].role);
            puts_(&s, "<|end_header_id|>\n\n");
            put(&s, c, len);
            puts_(&s, "<|eot_id|>");
        }
        if (add_generation_prompt) puts_(&s, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    }
    *len_out = s.len;
    if (out == NULL) return AE_OK; /* measuring only */
    if (s.len >= cap) return err_set(err, "chat_render: text needs %zu bytes plus NUL, buffer has %zu", s.len, cap);
    out[s.len] = '\0';
    return AE_OK;
}

int chat_render_alloc(const chat_template *t, const chat_msg *msgs, size_t n, bool add_generation_prompt, char **out,
                      size_t *len_out, ae_error *err) {
    AE_ASSERT(out != NULL && len_out != NULL);
    *out = NULL;
    size_t len = 0;
    if (chat_render(t, msgs, n, add_generation_prompt, NULL, 0, &len, err) != AE_OK) return AE_ERR;
    char *buf = malloc(len + 1);
    if (buf == NULL) return err_set(err, "chat_render: out of memory for %zu bytes", len + 1);
    if (chat_render(t, msgs, n, add_generation_prompt, buf, len + 1, len_out, err) != AE_OK) {
        free(buf);
        return AE_ERR;
    }
    *out = buf;
    return AE_OK;
}

/* ---- JSON message lists ------------------------------------------------ */

int chat_parse_messages_json(const char *json, size_t len, chat_msg **msgs, size_t *n, ae_error *err) {
    AE_ASSERT(msgs != NULL && n != NULL);
    *msgs = NULL;
    *n = 0;
    if (json == NULL) return err_set(err, "messages: no input");
    if (len > CHAT_MAX_JSON)
        return err_set(err, "messages: %zu bytes of JSON exceeds the limit of %u", len, CHAT_MAX_JSON);
    cJSON *root = json_parse(json, len, err);
    if (!root) {
        err_prefix(err, "messages: ");
        return AE_ERR;
    }

    int rc = AE_ERR;
    chat_msg *out = NULL;
    if (!cJSON_IsArray(root)) {
        err_set(err, "messages: expected a JSON array of {\"role\", \"content\"} objects");
        goto done;
    }
    size_t count = (size_t)cJSON_GetArraySize(root);
    if (count == 0) {
        err_set(err, "messages: empty; a conversation needs at least one");
        goto done;
    }
    if (count > CHAT_MAX_MESSAGES) {
        err_set(err, "messages: %zu exceeds the limit of %u", count, CHAT_MAX_MESSAGES);
        goto done;
    }

    /* Validate and measure, then copy everything into one block so the
     * caller frees once and the cJSON tree can go now. */
    size_t bytes = count * sizeof(chat_msg), i = 0;
    const cJSON *m;
    cJSON_ArrayForEach(m, root) {
        if (!cJSON_IsObject(m)) {
            err_set(err, "messages[%zu]: expected an object with \"role\" and \"content\"", i);
            goto done;
        }
        const cJSON *role = NULL, *content = NULL, *kv;
        cJSON_ArrayForEach(kv, m) {
            const cJSON **slot = strcmp(kv->string, "role") == 0      ? &role
                                 : strcmp(kv->string, "content") == 0 ? &content
                                                                      : NULL;
            if (slot == NULL) {
                err_set(err, "messages[%zu]: unsupported key \"%.64s\" (only role, content)", i, kv->string);
                goto done;
            }
            if (*slot != NULL) {
                err_set(err, "messages[%zu]: duplicate key \"%s\"", i, kv->string);
                goto done;
            }
            *slot = kv;
        }
        if (role == NULL || !cJSON_IsString(role)) {
            err_set(err, "messages[%zu].role: %s", i, role == NULL ? "missing" : "expected a string");
            goto done;
        }
        if (!role_ok(role->valuestring)) {
            err_set(err, "messages[%zu].role: \"%.32s\" is not one of system, user, assistant", i, role->valuestring);
            goto done;
        }
        if (content == NULL || !cJSON_IsString(content)) {
            err_set(err, "messages[%zu].content: %s", i, content == NULL ? "missing" : "expected a string");
            goto done;
        }
        size_t clen = strlen(content->valuestring);
        if (clen > CHAT_MAX_CONTENT) {
            err_set(err, "messages[%zu].content: %zu bytes exceeds the limit of %u", i, clen, CHAT_MAX_CONTENT);
            goto done;
        }
        bytes += strlen(role->valuestring) + 1 + clen + 1;
        i++;
    }

    out = malloc(bytes);
    if (out == NULL) {
        err_set(err, "messages: out of memory for %zu bytes", bytes);
        goto done;
    }
    char *strs = (char *)(out + count);
    i = 0;
    cJSON_ArrayForEach(m, root) {
        const char *fields[2] = {cJSON_GetObjectItemCaseSensitive(m, "role")->valuestring,
                                 cJSON_GetObjectItemCaseSensitive(m, "content")->valuestring};
        const char *copies[2];
        for (int f = 0; f < 2; f++) {
            size_t l = strlen(fields[f]) + 1;
            memcpy(strs, fields[f], l);
            copies[f] = strs;
            strs += l;
        }
        out[i++] = (chat_msg){copies[0], copies[1]};
    }
    *msgs = out;
    *n = count;
    out = NULL;
    rc = AE_OK;
done:
    free(out);
    cJSON_Delete(root);
    return rc;
}

void chat_msgs_free(chat_msg *msgs) { free(msgs); }
