// The C face of XGrammar (grammar.h). C++ stays in this file: no exception
// crosses into C, each becomes an ae_error.
#include <xgrammar/xgrammar.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <list>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

// The C headers say _Noreturn (C11); C++ spells it [[noreturn]].
#define _Noreturn [[noreturn]]
extern "C" {
#include "grammar.h"
}
#undef _Noreturn

// Compiled schemas by text (the empty key: json_object), the most recently
// used first, at most GRAMMAR_CACHE_BYTES of them. The cache is this
// file's and not XGrammar's own: compiles run on threads of their own, each
// with a compiler of its own (target/gcompile.h), and share it.
typedef std::list<std::pair<std::string, xgrammar::CompiledGrammar>> lru_list;

struct grammar_vocab {
    std::optional<xgrammar::TokenizerInfo> info;
    std::mutex cache_mu; // lru, index, cache_bytes
    lru_list lru;
    std::unordered_map<std::string, lru_list::iterator> index;
    size_t cache_bytes = 0;
    int32_t vocab;
    std::atomic<uint64_t> masks{0}, ns{0};
    std::atomic<int> refs{1}; // grammar_vocab_ref
};

struct grammar_matcher {
    grammar_vocab *v;
    std::optional<xgrammar::GrammarMatcher> m;
    uint64_t mask_ns = 0; // this matcher's masks' time
    uint64_t masks = 0;
};

static int fail(ae_error *err, const char *what, const std::exception &e) {
    return err_set(err, "%s: %s", what, e.what());
}

extern "C" int grammar_vocab_init(grammar_vocab **out, const tok *t, int32_t vocab, int32_t eos, ae_error *err) {
    *out = nullptr;
    int32_t n_tok = tok_vocab_size(t);
    if (vocab < n_tok)
        return err_set(err, "structured output: the model has %d logits, the tokenizer %d ids", vocab, n_tok);
    try {
        std::vector<std::string> words((size_t)n_tok);
        for (int32_t i = 0; i < n_tok; i++) {
            size_t len = 0;
            const uint8_t *b = tok_token_bytes(t, i, &len);
            // Special tokens are empty words: never allowed (eos is a stop token).
            if (b && !tok_is_special(t, i)) words[(size_t)i].assign((const char *)b, len);
        }
        std::vector<int32_t> stops;
        if (eos >= 0) stops.push_back(eos);
        auto *v = new grammar_vocab();
        v->vocab = vocab;
        v->info.emplace(words, xgrammar::VocabType::RAW, vocab, stops);
        *out = v;
        return AE_OK;
    } catch (const std::bad_alloc &) {
        return err_set(err, "structured output: out of memory for the vocabulary's automaton");
    } catch (const std::exception &e) {
        return fail(err, "structured output: the vocabulary", e);
    }
}

extern "C" void grammar_vocab_ref(grammar_vocab *v) { v->refs++; }

extern "C" void grammar_vocab_free(grammar_vocab *v) {
    if (v && --v->refs == 0) delete v;
}

struct grammar {
    std::optional<xgrammar::CompiledGrammar> g;
};

/* The engine's reason without its source location: "[time] file.cc:line:
 * reason", or "... Check failed: (...) is false: reason". */
static int refused(ae_error *err, const std::exception &e) {
    const char *w = e.what(), *r = strstr(w, "is false: "), *at = strstr(w, ".cc:");
    if (r) {
        r += 10;
    } else if (at) {
        for (r = at + 4; *r >= '0' && *r <= '9'; r++) {
        }
        while (*r == ':' || *r == ' ') r++;
    } else {
        r = w;
    }
    while (*r == ' ' || *r == '\n') r++;
    // Some of the engine's checks carry no words (an infinite bound was
    // one): the reason is then said in ours.
    if (!*r) r = "the grammar engine refused it without a reason (check the schema's numbers and bounds)";
    return err_set(err, "the schema cannot be compiled: %.300s", r), GRAMMAR_REFUSED;
}

static std::string key_of(const char *schema) { return schema ? std::string(schema) : std::string(); }

static bool cache_get(grammar_vocab *v, const std::string &key, grammar *g) {
    std::lock_guard<std::mutex> lock(v->cache_mu);
    auto it = v->index.find(key);
    if (it == v->index.end()) return false;
    v->lru.splice(v->lru.begin(), v->lru, it->second);
    g->g.emplace(it->second->second);
    return true;
}

static size_t entry_bytes(const std::string &key, const xgrammar::CompiledGrammar &cg) {
    return key.size() + cg.MemorySizeBytes();
}

static void cache_put(grammar_vocab *v, const std::string &key, const xgrammar::CompiledGrammar &cg) {
    size_t bytes = entry_bytes(key, cg);
    if (bytes > (size_t)GRAMMAR_CACHE_BYTES) return;
    std::lock_guard<std::mutex> lock(v->cache_mu);
    if (v->index.count(key)) return;
    v->lru.emplace_front(key, cg);
    v->index[key] = v->lru.begin();
    v->cache_bytes += bytes;
    while (v->cache_bytes > (size_t)GRAMMAR_CACHE_BYTES) {
        auto &last = v->lru.back();
        v->cache_bytes -= entry_bytes(last.first, last.second);
        v->index.erase(last.first);
        v->lru.pop_back();
    }
}

// OpenAI's json_object is any JSON object; a schema of type object alone
// says the same. A compiler of its own for each compile (it holds only a
// handle on the vocabulary's automaton): one thread, so XGrammar starts
// none, and nothing shared with another compile running beside it.
static xgrammar::CompiledGrammar compile_now(grammar_vocab *v, const char *schema) {
    std::string s = schema ? schema : "{\"type\": \"object\"}";
    xgrammar::GrammarCompiler compiler(*v->info, 1, false, -1);
    return compiler.CompileJSONSchema(s, true, std::nullopt, std::nullopt, true, GRAMMAR_MAX_WS);
}

extern "C" int grammar_cached(grammar **out, grammar_vocab *v, const char *schema) {
    *out = nullptr;
    try {
        auto *g = new grammar();
        if (cache_get(v, key_of(schema), g)) {
            *out = g;
            return AE_OK;
        }
        delete g;
    } catch (const std::exception &) {
    }
    return AE_ERR;
}

extern "C" int grammar_compile(grammar **out, grammar_vocab *v, const char *schema, ae_error *err) {
    *out = nullptr;
    try {
        auto *g = new grammar();
        if (cache_get(v, key_of(schema), g)) {
            *out = g;
            return AE_OK;
        }
        try {
            g->g.emplace(compile_now(v, schema));
        } catch (const std::bad_alloc &) {
            delete g;
            throw;
        } catch (const std::exception &e) {
            delete g;
            return refused(err, e);
        }
        cache_put(v, key_of(schema), *g->g);
        *out = g;
        return AE_OK;
    } catch (const std::bad_alloc &) {
        return err_set(err, "structured output: out of memory compiling the schema");
    }
}

extern "C" void grammar_free(grammar *g) { delete g; }

extern "C" int grammar_matcher_new(grammar_matcher **out, grammar_vocab *v, const grammar *g, ae_error *err) {
    *out = nullptr;
    try {
        auto *m = new grammar_matcher();
        m->v = v;
        m->m.emplace(*g->g);
        *out = m;
        return AE_OK;
    } catch (const std::exception &e) {
        return fail(err, "structured output: a matcher", e);
    }
}

extern "C" int grammar_matcher_init(grammar_matcher **out, grammar_vocab *v, const char *schema, ae_error *err) {
    *out = nullptr;
    grammar *g;
    int rc = grammar_compile(&g, v, schema, err);
    if (rc != AE_OK) return rc;
    rc = grammar_matcher_new(out, v, g, err);
    grammar_free(g);
    return rc;
}

extern "C" void grammar_matcher_free(grammar_matcher *m) { delete m; }

extern "C" void grammar_fill_mask(grammar_matcher *m, uint32_t *mask) {
    auto t0 = std::chrono::steady_clock::now();
    int64_t words = (m->v->vocab + 31) / 32;
    DLTensor d{};
    d.data = mask;
    d.device = DLDevice{kDLCPU, 0};
    d.ndim = 1;
    d.dtype = DLDataType{kDLInt, 32, 1};
    d.shape = &words;
    d.strides = nullptr;
    d.byte_offset = 0;
    try {
        m->m->FillNextTokenBitmask(&d);
    } catch (const std::exception &) {
        // Nothing allowed: the step refuses the token it decides (spec.c).
        memset(mask, 0, (size_t)words * sizeof *mask);
    }
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    m->v->masks++;
    m->v->ns += (uint64_t)ns;
    m->masks++;
    m->mask_ns += (uint64_t)ns;
}

extern "C" uint64_t grammar_matcher_mask_ns(const grammar_matcher *m, uint64_t *masks) {
    if (masks) *masks = m->masks;
    return m->mask_ns;
}

extern "C" bool grammar_accept(grammar_matcher *m, int32_t token) {
    if (token < 0 || token >= m->v->vocab) return false;
    try {
        return m->m->AcceptToken(token);
    } catch (const std::exception &) {
        return false;
    }
}

extern "C" bool grammar_terminated(const grammar_matcher *m) { return m->m->IsTerminated(); }

extern "C" void grammar_vocab_mask_stats(const grammar_vocab *v, uint64_t *masks, uint64_t *ns) {
    *masks = v->masks.load();
    *ns = v->ns.load();
}
