/* aerie generate: plain (non-speculative) decoding on the CPU engine. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../services/core/log.h"
#include "../target/sample.h"
#include "../services/tokenizer/chat.h"
#include "../services/tokenizer/detok.h"
#include "../target/engine.h"
#include "../target/memplan.h"
#include "cli.h"

static const cfg_option opts[] = {
    {"model", CFG_STRING, NULL, 0, 0, "model: .gguf file or Hugging Face directory"},
    {"prompt", CFG_STRING, NULL, 0, 0, "the prompt (with --chat: a JSON list of {role, content})"},
    {"chat", CFG_BOOL, "false", 0, 0, "render the prompt with the model's chat template"},
    {"max-tokens", CFG_INT, "128", 1, 1 << 20, "tokens to generate at most"},
    {"temperature", CFG_DOUBLE, "0", 0, 100, "0 = greedy"},
    {"top-k", CFG_INT, "0", 0, 1 << 24, "keep the k most likely tokens (0 = off)"},
    {"top-p", CFG_DOUBLE, "1", 0, 1, "keep the smallest set with this much probability (1 = off)"},
    {"min-p", CFG_DOUBLE, "0", 0, 1, "drop tokens below this fraction of the top one (0 = off)"},
    {"seed", CFG_INT, "0", 0, 9007199254740991.0, "random seed of the sampler"},
    {"ids", CFG_BOOL, "false", 0, 0, "print the generated ids as JSON instead of text"},
    {"stats", CFG_BOOL, "false", 0, 0, "print one JSON line of figures on stderr"},
    {"ignore-eos", CFG_BOOL, "false", 0, 0, "keep generating past the end-of-sequence token"},
    {"threads", CFG_INT, "auto", 1, POOL_MAX_THREADS, "compute threads (auto: the CPUs this process may use)"},
    /* The memory plan's settings (target/memplan.h), with defaults for one
     * sequence. */
    {"mem-fraction", CFG_DOUBLE, "auto", 0.01, 1.0,
     "fraction of available memory to use (auto: leave the system max(1 GiB, 10%))"},
    {"max-kv-tokens", CFG_INT, "auto", 1, 1e12, "KV cache size in tokens (auto: what fits)"},
    {"max-batch", CFG_INT, "1", 1, 4096, "sequences in flight at once"},
    {"max-seq-len", CFG_INT, "auto", 1, 16777216,
     "longest sequence in tokens (auto: the model's context length)"},
    {"log-level", CFG_STRING, "warn", 0, 0, "debug, info, warn, error or off"},
};

#define PREFILL_CHUNK 256 /* tokens of prompt per forward pass */
#define KV_BLOCK 16

/* The memory plan for this model on this machine; records auto values. */
static int plan_for(cfg *c, const model *m, memplan *plan, ae_error *err) {
    if (cfg_is_auto(c, "max-seq-len")) cfg_set_auto_int(c, "max-seq-len", m->cfg.context_length);
    uint64_t avail;
    if (memplan_mem_available(&avail, err) != AE_OK) return AE_ERR;
    const model_config *mc = &m->cfg;
    memplan_model mm = {m->weight_bytes, mc->n_layers, mc->hidden, mc->ffn, mc->n_heads,
                        mc->n_kv_heads, mc->head_dim, mc->vocab};
    memplan_env env = {avail, KV_BLOCK, PREFILL_CHUNK, llama_stream_workspace(m, PREFILL_CHUNK, (int32_t)cfg_int(c, "max-seq-len"))};
    return memplan_compute(c, &mm, &env, plan, err);
}

static int resolve(cfg *c, ae_error *err) {
    if (cfg_is_auto(c, "threads")) cfg_set_auto_int(c, "threads", pool_cpu_count());
    const char *path = cfg_str(c, "model");
    if (!path) return err_set(err, "no model given (use --model FILE)");
    model *m;
    if (model_load(&m, path, err) != AE_OK) return AE_ERR;
    memplan plan;
    int rc = plan_for(c, m, &plan, err);
    model_free(m);
    return rc;
}

/* The prompt's ids, rendered with the chat template when asked. */
static int prompt_ids(const cfg *c, const tok *t, int32_t **ids, size_t *n, ae_error *err) {
    const char *text = cfg_str(c, "prompt");
    if (!text) return err_set(err, "no prompt given (use --prompt TEXT)");
    char *rendered = NULL;
    size_t len = strlen(text);
    int flags = TOK_ADD_BOS | TOK_PARSE_SPECIAL;
    if (cfg_bool(c, "chat")) {
        chat_template *ct = NULL;
        chat_msg *msgs = NULL;
        size_t nm = 0;
        int rc = chat_parse_messages_json(text, len, &msgs, &nm, err);
        if (rc == AE_OK && !tok_chat_template(t)) rc = err_set(err, "the model has no chat template");
        if (rc == AE_OK) rc = chat_template_init(&ct, tok_chat_template(t), err);
        if (rc == AE_OK) rc = chat_render_alloc(ct, msgs, nm, true, &rendered, &len, err);
        chat_template_free(ct);
        chat_msgs_free(msgs);
        if (rc != AE_OK) return AE_ERR;
        text = rendered;
        flags = TOK_PARSE_SPECIAL; /* the template writes its own BOS */
    }
    *ids = malloc((len + 2) * sizeof **ids);
    int rc = *ids ? tok_encode(t, text, len, flags, *ids, len + 2, n, err) : err_set(err, "out of memory");
    free(rendered);
    if (rc == AE_OK && *n == 0) rc = err_set(err, "the prompt has no tokens");
    return rc;
}

static int run(const cfg *cc, int argc, char **argv, ae_error *err) {
    cfg *c = (cfg *)cc; /* resolve() has replaced every auto value */
    if (argc > 0) return err_set(err, "unexpected argument \"%s\"", argv[0]), CLI_EXIT_USAGE;
    cli_model cm = {0};
    model *m = NULL;
    eng *e = NULL;
    sampler *smp = NULL;
    detok *dt = NULL;
    int32_t *ids = NULL, *out_ids = NULL;
    float *logits = NULL;
    char *chunk = NULL;
    size_t n_prompt = 0;
    int rc = CLI_EXIT_USAGE;
    const char *path = cfg_str(c, "model");
    if (cli_model_open(&cm, path, err) != AE_OK) goto out;
    if (prompt_ids(c, cm.tok, &ids, &n_prompt, err) != AE_OK) goto out;
    double t_load = cli_now_seconds();
    if (model_load(&m, path, err) != AE_OK) goto out;
    t_load = cli_now_seconds() - t_load;
    int32_t max_new = (int32_t)cfg_int(c, "max-tokens");
    if ((int64_t)n_prompt + max_new > m->cfg.context_length) {
        err_set(err, "prompt (%zu tokens) + max-tokens (%d) exceeds the model's context of %d", n_prompt,
                max_new, m->cfg.context_length);
        goto out;
    }
    memplan plan;
    if (plan_for(c, m, &plan, err) != AE_OK) goto out;
    memplan_log(&plan);
    if ((int64_t)n_prompt + max_new > plan.max_seq_len) {
        err_set(err, "prompt (%zu tokens) + max-tokens (%d) exceeds max-seq-len %d", n_prompt, max_new,
                plan.max_seq_len);
        goto out;
    }
    if (plan.kv_tokens > INT32_MAX) {
        err_set(err, "memory plan: %lld KV tokens is more than one engine holds (%d); lower --max-kv-tokens",
                (long long)plan.kv_tokens, INT32_MAX);
        goto out;
    }
    int32_t chunk_tokens = PREFILL_CHUNK;
    eng_config ec = {chunk_tokens, plan.max_batch, plan.max_seq_len, (int32_t)plan.kv_tokens, plan.block_size,
                     (int32_t)cfg_int(c, "threads")};
    if (eng_init(&e, m, &ec, err) != AE_OK || sample_init(&smp, m->cfg.vocab, err) != AE_OK ||
        detok_init(&dt, cm.tok, false, err) != AE_OK)
        goto out;
    logits = malloc(sizeof(float) * (size_t)m->cfg.vocab);
    out_ids = malloc(sizeof(int32_t) * (size_t)max_new);
    chunk = malloc(detok_max_out(dt) + 1);
    if (!logits || !out_ids || !chunk) {
        err_set(err, "out of memory");
        goto out;
    }
    LOG_INFOF("generate model=%s prompt_tokens=%zu max_tokens=%d threads=%d simd=%s", path, n_prompt,
              max_new, (int)cfg_int(c, "threads"), kn_cpu_simd());
    sample_params sp = {(float)cfg_double(c, "temperature"), (int32_t)cfg_int(c, "top-k"),
                        (float)cfg_double(c, "top-p"), (float)cfg_double(c, "min-p")};
    sample_rng rng;
    sample_rng_seed(&rng, (uint64_t)cfg_int(c, "seed"));
    int32_t seq;
    if (eng_seq_new(e, &seq, err) != AE_OK) goto out;

    double t0 = cli_now_seconds();
    for (size_t done = 0; done < n_prompt;) {
        int32_t k = (int32_t)(n_prompt - done < (size_t)chunk_tokens ? n_prompt - done : (size_t)chunk_tokens);
        eng_item it = {seq, ENG_APPEND, k, ids + done, NULL, false};
        if (eng_step(e, &it, 1, logits, NULL, err) != AE_OK) goto out;
        done += (size_t)k;
    }
    double t_prefill = cli_now_seconds() - t0;
    bool as_ids = cfg_bool(c, "ids"), ignore_eos = cfg_bool(c, "ignore-eos");
    int32_t eos = tok_eos(cm.tok), n_out = 0;
    double t1 = cli_now_seconds();
    for (;;) {
        int32_t next = sample_token(smp, logits, &sp, &rng);
        if (next == eos && !ignore_eos) break;
        out_ids[n_out++] = next;
        if (!as_ids) {
            size_t len;
            if (detok_push(dt, next, chunk, detok_max_out(dt), &len, err) != AE_OK) goto out;
            fwrite(chunk, 1, len, stdout);
            fflush(stdout);
        }
        if (n_out == max_new) break;
        eng_item it = {seq, ENG_APPEND, 1, &next, NULL, false};
        if (eng_step(e, &it, 1, logits, NULL, err) != AE_OK) goto out;
    }
    double t_decode = cli_now_seconds() - t1;
    if (as_ids) {
        cli_print_ids(out_ids, (size_t)n_out);
    } else {
        fwrite(chunk, 1, detok_flush(dt, chunk, detok_max_out(dt)), stdout);
        putchar('\n');
    }
    fflush(stdout); /* the text before the stats line on a shared terminal */
    if (cfg_bool(c, "stats"))
        fprintf(stderr,
                "{\"prompt_tokens\":%zu,\"generated_tokens\":%d,\"load_seconds\":%.3f,"
                "\"prefill_tok_per_s\":%.1f,\"decode_tok_per_s\":%.1f,\"threads\":%d,\"simd\":\"%s\","
                "\"speculation\":false}\n",
                n_prompt, n_out, t_load, (double)n_prompt / t_prefill,
                n_out > 1 ? (double)(n_out - 1) / t_decode : 0.0, (int)cfg_int(c, "threads"), kn_cpu_simd());
    rc = 0;
out:
    free(chunk);
    free(out_ids);
    free(logits);
    free(ids);
    detok_free(dt);
    sample_free(smp);
    eng_free(e);
    model_free(m);
    cli_model_close(&cm);
    return rc;
}

const cli_cmd cli_cmd_generate = {
    .name = "generate",
    .args = "--prompt TEXT",
    .summary = "generate text with the CPU engine (plain decoding)",
    .opts = opts,
    .n_opts = sizeof opts / sizeof opts[0],
    .run = run,
    .resolve = resolve,
};
