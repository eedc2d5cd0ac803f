/* aerie generate: decoding on the CPU engine, plain or speculative
 * (--draft: an EAGLE-3 head proposes trees, the target verifies them; the
 * output is the target's own either way). */
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
#include "plan.h"

static const config_option opts[] = {
    {"model", CONFIG_STRING, NULL, 0, 0, "model: .gguf file or Hugging Face directory"},
    {"prompt", CONFIG_STRING, NULL, 0, 0, "the prompt (with --chat: a JSON list of {role, content})"},
    {"chat", CONFIG_BOOL, "false", 0, 0, "render the prompt with the model's chat template"},
    {"max-tokens", CONFIG_INT, "128", 1, 1 << 20, "tokens to generate at most"},
    {"temperature", CONFIG_DOUBLE, "0", 0, 100, "0 = greedy"},
    {"top-k", CONFIG_INT, "0", 0, 1 << 24, "keep the k most likely tokens (0 = off)"},
    {"top-p", CONFIG_DOUBLE, "1", 0, 1, "keep the smallest set with this much probability (1 = off)"},
    {"min-p", CONFIG_DOUBLE, "0", 0, 1, "drop tokens below this fraction of the top one (0 = off)"},
    {"seed", CONFIG_INT, "0", 0, 9007199254740991.0, "random seed of the sampler"},
    {"ids", CONFIG_BOOL, "false", 0, 0, "print the generated ids as JSON instead of text"},
    {"stats", CONFIG_BOOL, "false", 0, 0, "print one JSON line of figures on stderr"},
    {"ignore-eos", CONFIG_BOOL, "false", 0, 0, "keep generating past the end-of-sequence token"},
    {"threads", CONFIG_INT, "auto", 1, POOL_MAX_THREADS, "compute threads (auto: the CPUs this process may use)"},
    SVC_ACT_BITS_OPTION,
    SETUP_TP_OPTION,
    SETUP_ALLREDUCE_OPTION,
    SETUP_TP_DEVICES_OPTION,
    DRAFT_LINK_AUTO_OPTIONS,
    {"spec-adaptive", CONFIG_BOOL, "true", 0, 0,
     "greedy decoding picks each step's tree (or none) within the spec-* bounds by measured cost and acceptance "
     "(target/policy.h); off or sampling: always the spec-* tree"},
    /* The memory plan's settings (target/memplan.h), with defaults for one
     * sequence. */
    {"mem-fraction", CONFIG_DOUBLE, "auto", 0.01, 1.0,
     "fraction of available memory to use (auto: leave the system max(1 GiB, 10%))"},
    {"max-kv-tokens", CONFIG_INT, "auto", 1, 1e12, "KV cache size in tokens (auto: what fits)"},
    {"max-batch", CONFIG_INT, "1", 1, 4096, "sequences in flight at once"},
    {"max-seq-len", CONFIG_INT, "auto", 1, 16777216, "longest sequence in tokens (auto: the model's context length)"},
    {"log-level", CONFIG_STRING, "warn", 0, 0, "debug, info, warn, error or off"},
};

static int resolve(config *c, ae_error *err) { return cli_resolve_engine(c, true, err); }

/* The prompt's ids, rendered with the chat template when asked. */
static int prompt_ids(const config *c, const tok *t, int32_t **ids, size_t *n, ae_error *err) {
    const char *text = config_str(c, "prompt");
    if (!text) return err_set(err, "no prompt given (use --prompt TEXT)");
    char *rendered = NULL;
    size_t len = strlen(text);
    int flags = TOK_ADD_BOS | TOK_PARSE_SPECIAL;
    if (config_bool(c, "chat")) {
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

/* Where generated tokens go: text (or ids at the end) on stdout. */
typedef struct emitter {
    detok *dt;
    char *chunk;  /* detok_max_out + 1 */
    int32_t *ids; /* [max] */
    int32_t n, max;
    int32_t eos;
    bool as_ids, ignore_eos;
} emitter;

/* Takes one token; false once generation is over (end of sequence or
 * max-tokens reached), *rc AE_ERR on a detokenizer failure. */
static bool emit(emitter *em, int32_t token, int *rc, ae_error *err) {
    if (token == em->eos && !em->ignore_eos) return false;
    em->ids[em->n++] = token;
    if (!em->as_ids) {
        size_t len;
        if (detok_push(em->dt, token, em->chunk, detok_max_out(em->dt), &len, err) != AE_OK) {
            *rc = AE_ERR;
            return false;
        }
        fwrite(em->chunk, 1, len, stdout);
        fflush(stdout);
    }
    return em->n < em->max;
}

/* Plain decoding: prefill the whole prompt, then one token per pass. */
static int decode_plain(engine *e, int32_t seq, const int32_t *ids, int32_t n_prompt, sample_state *smp,
                        const sample_params *sp, const sample_rng *rng, emitter *em, double *t_prefill,
                        double *t_decode, ae_error *err) {
    float *logits = malloc(sizeof(float) * (size_t)engine_model(e)->cfg.vocab);
    if (!logits) return err_set(err, "out of memory");
    int rc = AE_OK;
    double t0 = clock_mono_seconds();
    for (int32_t done = 0; done < n_prompt && rc == AE_OK;) {
        int32_t k = n_prompt - done < SETUP_PREFILL_CHUNK ? n_prompt - done : SETUP_PREFILL_CHUNK;
        engine_item it = {seq, ENGINE_APPEND, k, ids + done, NULL, false};
        rc = engine_step(e, &it, 1, &(engine_outputs){.logits = logits}, err);
        done += k;
    }
    *t_prefill = clock_mono_seconds() - t0;
    t0 = clock_mono_seconds();
    while (rc == AE_OK) {
        int32_t next = sample_token(smp, logits, sp, rng, engine_seq_len(e, seq)); /* its position */
        if (!emit(em, next, &rc, err)) break;
        engine_item it = {seq, ENGINE_APPEND, 1, &next, NULL, false};
        rc = engine_step(e, &it, 1, &(engine_outputs){.logits = logits}, err);
    }
    *t_decode = clock_mono_seconds() - t0;
    free(logits);
    return rc;
}

/* Speculative decoding: the prompt but its last token is prefilled; every
 * step verifies a draft tree under the last decided token. */
static int decode_spec(spec *sx, int32_t seq, const int32_t *ids, int32_t n_prompt, const sample_params *sp,
                       const sample_rng *rng, emitter *em, double *t_prefill, double *t_decode, ae_error *err) {
    double t0 = clock_mono_seconds();
    int rc = spec_seq_start(sx, seq, ids, n_prompt, SETUP_PREFILL_CHUNK, err);
    *t_prefill = clock_mono_seconds() - t0;
    t0 = clock_mono_seconds();
    for (bool more = rc == AE_OK; more;) {
        spec_in in = {.seq = seq, .params = sp, .rng = rng};
        spec_out o;
        if ((rc = spec_step(sx, &in, 1, &o, err)) != AE_OK) break;
        for (int32_t j = 0; j < o.n && more; j++) more = emit(em, o.tokens[j], &rc, err);
    }
    *t_decode = clock_mono_seconds() - t0;
    spec_seq_end(sx, seq);
    return rc;
}

static int run(const config *cc, int argc, char **argv, ae_error *err) {
    config *c = (config *)cc; /* resolve() has replaced every auto value */
    if (argc > 0) return err_set(err, "unexpected argument \"%s\"", argv[0]), CLI_EXIT_USAGE;
    tok_file cm = {0};
    model *m = NULL;
    engine *e = NULL;
    sample_state *smp = NULL;
    spec *sx = NULL;
    draft_link link = {0};
    emitter em = {0};
    int32_t *ids = NULL;
    size_t n_prompt = 0;
    int rc = CLI_EXIT_USAGE;
    const char *path = config_str(c, "model"), *draft = eagle_dir(c);
    if (tok_file_open(&cm, path, err) != AE_OK) goto out;
    if (prompt_ids(c, cm.tok, &ids, &n_prompt, err) != AE_OK) goto out;
    double t_load = clock_mono_seconds();
    if (model_load(&m, path, &kn_backend_cpu, err) != AE_OK) goto out;
    t_load = clock_mono_seconds() - t_load;
    int32_t max_new = (int32_t)config_int(c, "max-tokens");
    if ((int64_t)n_prompt + max_new > m->cfg.context_length) {
        err_set(err, "prompt (%zu tokens) + max-tokens (%d) exceeds the model's context of %d", n_prompt, max_new,
                m->cfg.context_length);
        goto out;
    }
    memplan plan;
    if (cli_plan(c, m, true, &plan, err) != AE_OK) goto out;
    memplan_log(&plan);
    setup_log_weights(c, m);
    if ((int64_t)n_prompt + max_new > plan.max_seq_len) {
        err_set(err, "prompt (%zu tokens) + max-tokens (%d) exceeds max-seq-len %d", n_prompt, max_new,
                plan.max_seq_len);
        goto out;
    }
    int32_t threads = (int32_t)config_int(c, "threads"), act_bits;
    if (svc_act_bits(c, &act_bits, err) != AE_OK || setup_engine(&e, c, m, &plan, threads, act_bits, err) != AE_OK ||
        sample_init(&smp, m->cfg.vocab, err) != AE_OK || detok_init(&em.dt, cm.tok, false, err) != AE_OK)
        goto out;
    spec_shape shape;
    eagle_weights weights;
    if (draft_link_settings(c, &shape, &weights, err) != AE_OK) goto out;
    if (draft) {
        drafter_config dc = {plan.max_batch, plan.max_seq_len, SETUP_PREFILL_CHUNK, threads, engine_pool(e), act_bits};
        /* Greedy and sampled output alike are the same whatever tree a
         * step drafts (sampled draws are keyed by seed and position), so
         * the policy may choose freely. */
        bool adaptive = config_bool(c, "spec-adaptive");
        spec_config sc = spec_config_default(shape, plan.max_batch, SETUP_PREFILL_CHUNK);
        sc.adaptive = adaptive;
        if (draft_link_open(&link, draft, model_embedding(m), weights, &dc, err) != AE_OK ||
            draft_link_capture(&link, sc.capture, err) != AE_OK || spec_init(&sx, e, &link.iface, &sc, err) != AE_OK)
            goto out;
    }
    em.ids = malloc(sizeof(int32_t) * (size_t)max_new);
    em.chunk = malloc(detok_max_out(em.dt) + 1);
    if (!em.ids || !em.chunk) {
        err_set(err, "out of memory");
        goto out;
    }
    em.max = max_new;
    em.eos = tok_eos(cm.tok);
    em.as_ids = config_bool(c, "ids");
    em.ignore_eos = config_bool(c, "ignore-eos");
    LOG_INFOF("generate model=%s draft=%s prompt_tokens=%zu max_tokens=%d threads=%d simd=%s", path,
              draft ? draft : "none", n_prompt, max_new, threads, kn_cpu_simd());
    sample_params sp = {(float)config_double(c, "temperature"), (int32_t)config_int(c, "top-k"),
                        (float)config_double(c, "top-p"), (float)config_double(c, "min-p")};
    sample_rng rng;
    sample_rng_seed(&rng, (uint64_t)config_int(c, "seed"));
    int32_t seq;
    if (engine_seq_new(e, &seq, err) != AE_OK) goto out;
    double t_prefill = 0, t_decode = 0;
    int drc = sx ? decode_spec(sx, seq, ids, (int32_t)n_prompt, &sp, &rng, &em, &t_prefill, &t_decode, err)
                 : decode_plain(e, seq, ids, (int32_t)n_prompt, smp, &sp, &rng, &em, &t_prefill, &t_decode, err);
    if (drc != AE_OK) goto out;
    if (em.as_ids) {
        cli_print_ids(em.ids, (size_t)em.n);
    } else {
        fwrite(em.chunk, 1, detok_flush(em.dt, em.chunk, detok_max_out(em.dt)), stdout);
        putchar('\n');
    }
    fflush(stdout); /* the text before the stats line on a shared terminal */
    if (config_bool(c, "stats")) {
        /* Decode tok/s counts the tokens the decode loop produced: plain
         * decoding's first token comes from the prefill pass, speculative
         * decoding's from its first verify step. */
        int32_t decoded = sx ? em.n : em.n - 1;
        cJSON *o = cJSON_CreateObject();
        if (!o) {
            err_set(err, "out of memory");
            goto out;
        }
        cJSON_AddNumberToObject(o, "prompt_tokens", (double)n_prompt);
        cJSON_AddNumberToObject(o, "generated_tokens", em.n);
        cJSON_AddNumberToObject(o, "load_seconds", cli_round(t_load, 1e3));
        cJSON_AddNumberToObject(o, "prefill_tok_per_s",
                                t_prefill > 0 ? cli_round((double)n_prompt / t_prefill, 10) : 0);
        cJSON_AddNumberToObject(o, "decode_tok_per_s",
                                decoded > 0 && t_decode > 0 ? cli_round((double)decoded / t_decode, 10) : 0);
        cJSON_AddNumberToObject(o, "threads", threads);
        cJSON_AddStringToObject(o, "simd", kn_cpu_simd());
        cJSON_AddBoolToObject(o, "speculation", sx != NULL);
        /* The allreduces of the last pass (a decode pass, or the last
         * verify pass), and over the run: rank 0's, 0 at one rank. */
        engine_comm_stats cs = engine_get_comm_stats(e);
        cJSON_AddNumberToObject(o, "tp", engine_tp(e));
        cJSON_AddStringToObject(o, "allreduce", engine_tp(e) > 1 ? kn_allreduce_name(engine_allreduce(e)) : "none");
        cJSON_AddNumberToObject(o, "allreduces_per_step", (double)cs.last.calls);
        cJSON_AddNumberToObject(o, "allreduce_bytes_per_step", (double)cs.last.bytes);
        cJSON_AddNumberToObject(o, "allreduce_tokens_per_step", cs.last_tokens);
        cJSON_AddNumberToObject(o, "allreduces", (double)cs.total.calls);
        cJSON_AddNumberToObject(o, "allreduce_ms", cli_round((double)cs.total.ns / 1e6, 1e3));
        if (sx) {
            cli_spec_stats_json(o, spec_total_stats(sx), &shape);
            /* The policy's choice at batch 1 and the figures behind it. */
            policy_report pr;
            char pj[2048];
            spec_policy_report(sx, 1, &pr);
            if (policy_report_json(&pr, pj, sizeof pj) < (int)sizeof pj) {
                cJSON *pol = cJSON_Parse(pj);
                if (pol) cJSON_AddItemToObject(o, "policy", pol);
            }
        }
        char *line = cJSON_PrintUnformatted(o);
        cJSON_Delete(o);
        if (line) fprintf(stderr, "%s\n", line);
        cJSON_free(line);
    }
    rc = 0;
out:
    free(em.chunk);
    free(em.ids);
    free(ids);
    detok_free(em.dt);
    spec_free(sx);
    draft_link_close(&link);
    sample_free(smp);
    engine_free(e);
    model_free(m);
    tok_file_close(&cm);
    return rc;
}

const cli_cmd cli_cmd_generate = {
    .name = "generate",
    .args = "--prompt TEXT",
    .summary = "generate text with the CPU engine (speculative with --draft)",
    .opts = opts,
    .n_opts = sizeof opts / sizeof opts[0],
    .run = run,
    .resolve = resolve,
};
