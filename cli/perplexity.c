/* aerie perplexity: how well the engine predicts a text, in the manner of
 * llama-perplexity, and how far its predictions are from a reference base
 * (target/ppl.h: windows, base format, KL).
 *
 * The text is tokenized with the model's tokenizer as plain text (special
 * tokens are not parsed, no BOS in front). When the model adds a BOS token,
 * the first token of every window is replaced by BOS, as llama-perplexity
 * does; SmolLM2 adds none. tools/gen_ppl_base.py and tools/bench_ppl.py cut
 * the same windows.
 *
 * One JSON line on stdout: ppl, tokens (scored), windows, ctx, seconds and,
 * with --kl-base, base_ppl (the base's own perplexity), kld_mean, kld_p99
 * and top1_agree. Progress goes to stderr every few seconds. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "../services/core/file.h"
#include "../services/core/log.h"
#include "../target/engine.h"
#include "../target/ppl.h"
#include "cli.h"
#include "plan.h"

#define PPL_TEXT_MAX ((size_t)256 << 20)
#define PROGRESS_SECONDS 5.0

static const config_option opts[] = {
    {"model", CONFIG_STRING, NULL, 0, 0, "model: .gguf file or Hugging Face directory"},
    {"file", CONFIG_STRING, NULL, 0, 0, "the text to score (UTF-8)"},
    {"ctx", CONFIG_INT, "512", PPL_MIN_CTX, 1 << 20, "tokens in a window; its second half is scored"},
    {"kl-base", CONFIG_STRING, NULL, 0, 0, "reference log-probabilities (tools/gen_ppl_base.py) to compare with"},
    {"threads", CONFIG_INT, "auto", 1, POOL_MAX_THREADS, "compute threads (auto: the CPUs this process may use)"},
    SVC_ACT_BITS_OPTION,
    {"log-level", CONFIG_STRING, "warn", 0, 0, "debug, info, warn, error or off"},
};

static int resolve(config *c, ae_error *err) {
    if (config_is_auto(c, "threads")) config_set_auto_int(c, "threads", pool_cpu_count());
    return AE_OK;
}

/* The engine for one window at a time. Every engine setting of the run is
 * decided here, from the command's settings. */
static engine_config window_engine_config(const config *c, int32_t ctx, int32_t act_bits) {
    int32_t chunk = ctx < SETUP_PREFILL_CHUNK ? ctx : SETUP_PREFILL_CHUNK;
    int32_t kv = (ctx + SETUP_KV_BLOCK - 1) / SETUP_KV_BLOCK * SETUP_KV_BLOCK;
    engine_config ec = {chunk, 1, ctx, kv, SETUP_KV_BLOCK, (int32_t)config_int(c, "threads"), act_bits};
    return ec;
}

/* The text's tokens, laid out as the windows the model sees:
 * [n_windows][ctx]. */
static int text_windows(const config *c, const tok *t, ppl_windows *w, int32_t **out, ae_error *err) {
    *out = NULL;
    const char *path = config_str(c, "file");
    if (!path) return err_set(err, "no text given (use --file FILE)");
    char *text = NULL;
    size_t len, n = 0;
    if (file_read_all(path, PPL_TEXT_MAX, &text, &len, NULL, err) != AE_OK) return AE_ERR;
    int32_t *ids = malloc(sizeof *ids * (len + 1));
    int rc = ids ? tok_encode(t, text, len, 0, ids, len + 1, &n, err) : err_set(err, "out of memory");
    free(text);
    if (rc == AE_OK && ppl_windows_plan((int64_t)n, (int32_t)config_int(c, "ctx"), w, err) != AE_OK) {
        err_prefix(err, "%s: ", path);
        rc = AE_ERR;
    }
    if (rc != AE_OK) {
        free(ids);
        return AE_ERR;
    }
    if (tok_add_bos(t) && tok_bos(t) >= 0)
        for (int32_t i = 0; i < w->n_windows; i++) ids[(size_t)i * (size_t)w->ctx] = tok_bos(t);
    *out = ids;
    return AE_OK;
}

/* Evaluates one window from an empty sequence and scores its second
 * half. logits: [chunk][vocab]. */
static int score_window(engine *e, const int32_t *win, const ppl_windows *w, int32_t window, const ppl_base *base,
                        ppl_scorer *sc, float *logits, ae_error *err) {
    int32_t seq, vocab = engine_model(e)->cfg.vocab, chunk = engine_get_config(e)->max_batch_tokens;
    if (engine_seq_new(e, &seq, err) != AE_OK) return AE_ERR;
    int rc = AE_OK;
    for (int32_t done = 0; done < w->ctx - 1 && rc == AE_OK;) {
        /* The last token is never a prediction's context: it is only
         * predicted. */
        int32_t k = w->ctx - 1 - done < chunk ? w->ctx - 1 - done : chunk;
        engine_item it = {seq, ENGINE_APPEND, k, win + done, NULL, true};
        if ((rc = engine_step(e, &it, 1, &(engine_outputs){.logits = logits}, err)) != AE_OK) break;
        for (int32_t j = 0; j < k && rc == AE_OK; j++) {
            int32_t pos = done + j;
            if (pos < w->first) continue;
            ppl_ref ref;
            if (base) ref = ppl_base_ref(base, (int64_t)window * w->scored + (pos - w->first));
            rc = ppl_score_add(sc, logits + (size_t)j * (size_t)vocab, win[pos + 1], base ? &ref : NULL, err);
        }
        done += k;
    }
    engine_seq_free(e, seq);
    return rc;
}

static int run(const config *c, int argc, char **argv, ae_error *err) {
    if (argc > 0) return err_set(err, "unexpected argument \"%s\"", argv[0]), CLI_EXIT_USAGE;
    double t_start = clock_mono_seconds();
    tok_file cm = {0};
    model *m = NULL;
    engine *e = NULL;
    ppl_base *base = NULL;
    ppl_scorer *sc = NULL;
    int32_t *tokens = NULL;
    float *logits = NULL;
    int rc = CLI_EXIT_USAGE;
    ppl_windows w;
    const char *path = config_str(c, "model"), *base_path = config_str(c, "kl-base");
    if (tok_file_open(&cm, path, err) != AE_OK || text_windows(c, cm.tok, &w, &tokens, err) != AE_OK) goto out;
    if (base_path && (ppl_base_open(&base, base_path, err) != AE_OK ||
                      ppl_base_check(base, &w, tok_vocab_size(cm.tok), tokens, err) != AE_OK)) {
        err_prefix(err, "--kl-base: ");
        goto out;
    }
    if (model_load(&m, path, &kn_backend_cpu, err) != AE_OK) goto out;
    if (w.ctx > m->cfg.context_length) {
        err_set(err, "--ctx %d exceeds the model's context of %d", w.ctx, m->cfg.context_length);
        goto out;
    }
    int32_t act_bits;
    if (svc_act_bits(c, &act_bits, err) != AE_OK) goto out;
    engine_config ec = window_engine_config(c, w.ctx, act_bits);
    if (engine_init(&e, m, &ec, err) != AE_OK ||
        ppl_scorer_init(&sc, m->cfg.vocab, (int64_t)w.n_windows * w.scored, err) != AE_OK)
        goto out;
    logits = malloc(sizeof *logits * (size_t)ec.max_batch_tokens * (size_t)m->cfg.vocab);
    if (!logits) {
        err_set(err, "out of memory");
        goto out;
    }
    LOG_INFOF("perplexity model=%s file=%s ctx=%d windows=%d scored=%lld threads=%d simd=%s", path,
              config_str(c, "file"), w.ctx, w.n_windows, (long long)w.n_windows * w.scored, ec.threads, kn_cpu_simd());
    double t_eval = clock_mono_seconds(), t_shown = t_eval;
    for (int32_t i = 0; i < w.n_windows; i++) {
        if (score_window(e, tokens + (size_t)i * (size_t)w.ctx, &w, i, base, sc, logits, err) != AE_OK) goto out;
        double now = clock_mono_seconds();
        if (now - t_shown >= PROGRESS_SECONDS && i + 1 < w.n_windows) {
            ppl_result r = ppl_scorer_result(sc);
            fprintf(stderr, "perplexity window=%d/%d tokens=%lld ppl=%.4f seconds=%.1f\n", i + 1, w.n_windows,
                    (long long)r.tokens, r.ppl, now - t_eval);
            t_shown = now;
        }
    }
    ppl_result r = ppl_scorer_result(sc);
    cJSON *o = cJSON_CreateObject();
    if (!o) {
        err_set(err, "out of memory");
        goto out;
    }
    cJSON_AddNumberToObject(o, "ppl", r.ppl);
    cJSON_AddNumberToObject(o, "tokens", (double)r.tokens);
    cJSON_AddNumberToObject(o, "windows", w.n_windows);
    cJSON_AddNumberToObject(o, "ctx", w.ctx);
    cJSON_AddNumberToObject(o, "act_bits", ec.act_bits);
    if (base) {
        cJSON_AddNumberToObject(o, "base_ppl", r.base_ppl);
        cJSON_AddNumberToObject(o, "kld_mean", r.kld_mean);
        cJSON_AddNumberToObject(o, "kld_p99", r.kld_p99);
        cJSON_AddNumberToObject(o, "top1_agree", r.top1_agree);
    }
    cJSON_AddNumberToObject(o, "threads", ec.threads);
    cJSON_AddStringToObject(o, "simd", kn_cpu_simd());
    cJSON_AddNumberToObject(o, "seconds", cli_round(clock_mono_seconds() - t_start, 1e2));
    if (cli_put_json_line(o, err) != AE_OK) goto out;
    rc = 0;
out:
    free(logits);
    free(tokens);
    ppl_scorer_free(sc);
    ppl_base_close(base);
    engine_free(e);
    model_free(m);
    tok_file_close(&cm);
    return rc;
}

const cli_cmd cli_cmd_perplexity = {
    .name = "perplexity",
    .args = "--model M --file TEXT [--ctx N] [--kl-base FILE]",
    .summary = "perplexity of a text in windows (--kl-base: KL divergence and top-1 agreement with a reference), "
               "as one JSON line",
    .opts = opts,
    .n_opts = sizeof opts / sizeof opts[0],
    .run = run,
    .resolve = resolve,
};
