/* How good a draft head is, on prompts it was not trained on:
 *
 *   aerie eval-draft    greedy decoding of each prompt, plain and then
 *                       speculative with each tree shape, side by side in
 *                       one process (prompt by prompt, so load on the host
 *                       touches every configuration alike). Reports per
 *                       shape the mean acceptance length, the acceptance
 *                       per depth and decode tok/s against plain, and
 *                       checks that every output is the plain one.
 *   aerie draft-logits  one draft step of the head over given pairs
 *                       (features, tokens at positions 0..n-1), its logits
 *                       written to safetensors: for comparing the forward
 *                       pass with the trainer's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "../services/core/log.h"
#include "../services/kv/kv.h"
#include "../services/model/safetensors.h"
#include "../services/model/safetensors_write.h"
#include "../services/tokenizer/chat.h"
#include "cli.h"
#include "plan.h"

#define MAX_SHAPES 8

static const config_option ev_opts[] = {
    {"model", CONFIG_STRING, NULL, 0, 0, "model: .gguf file or Hugging Face directory"},
    {"draft", CONFIG_STRING, NULL, 0, 0, "EAGLE-3 head directory"},
    {"draft-weights", CONFIG_STRING, "q8_0", 0, 0,
     "the head's matrices rounded to Q8_0 (q8_0), or as the file has them (file)"},
    {"prompts", CONFIG_STRING, NULL, 0, 0, "JSON lines of {\"prompt\": TEXT} (gen-prompts' heldout.jsonl)"},
    {"limit", CONFIG_INT, "0", 0, 1 << 30, "use only the first N prompts (0: all)"},
    {"max-new-tokens", CONFIG_INT, "128", 1, 1 << 20, "tokens generated per prompt at most"},
    {"shapes", CONFIG_STRING, "5/4/8,4/1/5,6/4/16", 0, 0,
     "tree shapes steps/topk/tokens, comma separated (the first is the default of generate)"},
    {"threads", CONFIG_INT, "auto", 1, POOL_MAX_THREADS, "compute threads (auto: the CPUs this process may use)"},
    SVC_ACT_BITS_OPTION,
    {"mem-fraction", CONFIG_DOUBLE, "auto", 0.01, 1.0,
     "fraction of available memory to use (auto: leave the system max(1 GiB, 10%))"},
    {"max-kv-tokens", CONFIG_INT, "auto", 1, 1e12, "KV cache size in tokens (auto: what fits)"},
    {"max-batch", CONFIG_INT, "1", 1, 1, "sequences at once (1: this measures batch 1)"},
    {"max-seq-len", CONFIG_INT, "auto", 1, 16777216, "longest sequence (auto: 1024 + max-new-tokens)"},
    {"log-level", CONFIG_STRING, "warn", 0, 0, "debug, info, warn, error or off"},
};

typedef struct shape_run {
    spec_shape shape;
    int64_t steps, plain_steps, accepted, decided, identical;
    int64_t accepted_at[SPEC_MAX_DEPTH];
    int64_t draft_ns, verify_ns;
    double seconds;
} shape_run;

static int parse_shapes(const char *s, shape_run *out, int *n, ae_error *err) {
    *n = 0;
    for (const char *p = s; *p;) {
        int steps, topk, tokens, used = 0;
        if (*n == MAX_SHAPES) return err_set(err, "shapes: at most %d", MAX_SHAPES);
        if (sscanf(p, "%d/%d/%d%n", &steps, &topk, &tokens, &used) != 3)
            return err_set(err, "shapes: expected steps/topk/tokens[,...], got \"%s\"", s);
        tree_params tp = {steps, topk, tokens};
        if (tree_params_check(&tp, err) != AE_OK) return AE_ERR;
        memset(&out[*n], 0, sizeof out[*n]);
        out[(*n)++].shape = (spec_shape){steps, topk, tokens};
        p += used;
        if (*p == ',')
            p++;
        else if (*p)
            return err_set(err, "shapes: expected steps/topk/tokens[,...], got \"%s\"", s);
    }
    if (*n == 0) return err_set(err, "shapes: none given");
    return AE_OK;
}

/* Greedy plain decoding of prompt: out[0..*n), stopping at eos. Times the
 * decode steps (*steps of them: the first token comes from the prefill,
 * each step decides one more, the end of sequence included). */
static int run_plain(engine *e, const int32_t *prompt, int32_t n_prompt, int32_t max_new, int32_t eos, float *logits,
                     int32_t *out, int32_t *n, int32_t *steps, double *seconds, ae_error *err) {
    int32_t seq, vocab = engine_model(e)->cfg.vocab;
    if (engine_seq_new(e, &seq, err) != AE_OK) return AE_ERR;
    int rc = AE_OK;
    for (int32_t done = 0; done < n_prompt && rc == AE_OK;) {
        int32_t k = n_prompt - done < SETUP_PREFILL_CHUNK ? n_prompt - done : SETUP_PREFILL_CHUNK;
        engine_item it = {seq, ENGINE_APPEND, k, prompt + done, NULL, false};
        rc = engine_step(e, &it, 1, &(engine_outputs){.logits = logits}, err);
        done += k;
    }
    double t0 = clock_mono_seconds();
    *n = 0;
    *steps = 0;
    while (rc == AE_OK) {
        int32_t next = sample_greedy(logits, vocab);
        if (next == eos) break;
        out[(*n)++] = next;
        if (*n == max_new) break;
        engine_item it = {seq, ENGINE_APPEND, 1, &next, NULL, false};
        rc = engine_step(e, &it, 1, &(engine_outputs){.logits = logits}, err);
        ++*steps;
    }
    *seconds = clock_mono_seconds() - t0;
    engine_seq_free(e, seq);
    return rc;
}

static int run_spec(spec *sx, engine *e, const int32_t *prompt, int32_t n_prompt, int32_t max_new, int32_t eos,
                    int32_t *out, int32_t *n, shape_run *r, ae_error *err) {
    int32_t seq;
    if (engine_seq_new(e, &seq, err) != AE_OK) return AE_ERR;
    spec_set_shape(sx, &r->shape);
    /* Time is kept for whole steps, not per sequence: the totals' growth
     * over this run is this sequence's (it runs alone). */
    int64_t draft0 = spec_total_stats(sx)->draft_ns, verify0 = spec_total_stats(sx)->verify_ns;
    int rc = spec_seq_start(sx, seq, prompt, n_prompt, SETUP_PREFILL_CHUNK, err);
    double t0 = clock_mono_seconds();
    sample_params sp = {0, 0, 1, 0};
    sample_rng rng;
    sample_rng_seed(&rng, 0);
    *n = 0;
    for (bool more = rc == AE_OK; more;) {
        spec_in in = {.seq = seq, .params = &sp, .rng = &rng};
        spec_out o;
        if ((rc = spec_step(sx, &in, 1, &o, err)) != AE_OK) break;
        for (int32_t j = 0; j < o.n && more; j++) {
            r->decided++; /* the end of sequence too, as plain decoding counts it */
            if (o.tokens[j] == eos)
                more = false;
            else
                out[(*n)++] = o.tokens[j];
            if (*n == max_new) more = false;
        }
    }
    r->seconds += clock_mono_seconds() - t0;
    if (rc == AE_OK) {
        const spec_stats *st = spec_seq_stats(sx, seq);
        r->steps += st->steps;
        r->plain_steps += st->plain_steps;
        r->accepted += st->accepted;
        r->draft_ns += spec_total_stats(sx)->draft_ns - draft0;
        r->verify_ns += spec_total_stats(sx)->verify_ns - verify0;
        for (int32_t d = 0; d < r->shape.steps && d < SPEC_MAX_DEPTH; d++) r->accepted_at[d] += st->accepted_at[d];
    }
    spec_seq_end(sx, seq);
    engine_seq_free(e, seq);
    return rc;
}

static double r4(double x) { return cli_round(x, 1e4); }

static cJSON *shape_json(const shape_run *r, double plain_tps) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    char name[48];
    snprintf(name, sizeof name, "%d/%d/%d", r->shape.steps, r->shape.topk, r->shape.tokens);
    cJSON_AddStringToObject(o, "shape", name);
    cJSON_AddNumberToObject(o, "verify_steps", (double)r->steps);
    cJSON_AddNumberToObject(o, "accepted_tokens", (double)r->accepted);
    cJSON_AddNumberToObject(o, "mean_accept_len",
                            r->steps ? r4((double)(r->accepted + r->steps) / (double)r->steps) : 0);
    cJSON *d = cJSON_AddArrayToObject(o, "accept_per_depth");
    for (int32_t i = 0; d && i < r->shape.steps; i++)
        cJSON_AddItemToArray(d, cJSON_CreateNumber(r->steps ? r4((double)r->accepted_at[i] / (double)r->steps) : 0));
    double tps = r->seconds > 0 ? (double)r->decided / r->seconds : 0;
    cJSON_AddNumberToObject(o, "decode_tok_per_s", cli_round(tps, 10));
    cJSON_AddNumberToObject(o, "speedup", plain_tps > 0 ? r4(tps / plain_tps) : 0);
    double total = (double)(r->draft_ns + r->verify_ns);
    cJSON_AddNumberToObject(o, "draft_time_share", total > 0 ? r4((double)r->draft_ns / total) : 0);
    cJSON_AddNumberToObject(o, "outputs_identical", (double)r->identical);
    return o;
}

static int ev_resolve(config *c, ae_error *err) {
    if (config_is_auto(c, "max-seq-len")) config_set_auto_int(c, "max-seq-len", 1024 + config_int(c, "max-new-tokens"));
    return cli_resolve_engine(c, true, err);
}

static int ev_run(const config *cc, int argc, char **argv, ae_error *err) {
    config *c = (config *)cc;
    if (argc > 0) return err_set(err, "unexpected argument \"%s\"", argv[0]), CLI_EXIT_USAGE;
    const char *path = config_str(c, "model"), *draft = config_str(c, "draft"), *pfile = config_str(c, "prompts");
    if (!draft) return err_set(err, "no head given (use --draft DIR)"), CLI_EXIT_USAGE;
    if (!pfile) return err_set(err, "no prompts given (use --prompts FILE)"), CLI_EXIT_USAGE;
    shape_run runs[MAX_SHAPES];
    int n_shapes;
    if (parse_shapes(config_str(c, "shapes"), runs, &n_shapes, err) != AE_OK) return CLI_EXIT_USAGE;
    tok_file cm = {0};
    model *m = NULL;
    engine *e = NULL;
    spec *sx = NULL;
    chat_template *ct = NULL;
    draft_link link = {0};
    char **prompts = NULL;
    int64_t n_prompts = 0;
    float *logits = NULL;
    int32_t *plain = NULL, *got = NULL, *ids = NULL;
    int rc = CLI_EXIT_USAGE;
    if (cli_read_prompts(pfile, &prompts, &n_prompts, config_int(c, "limit"), err) != AE_OK) goto out;
    if (tok_file_open(&cm, path, err) != AE_OK) goto out;
    if (!tok_chat_template(cm.tok)) {
        err_set(err, "%s: the model has no chat template", path);
        goto out;
    }
    if (chat_template_init(&ct, tok_chat_template(cm.tok), err) != AE_OK ||
        model_load(&m, path, &kn_backend_cpu, err) != AE_OK)
        goto out;
    memplan plan;
    if (cli_plan(c, m, true, &plan, err) != AE_OK) goto out;
    memplan_log(&plan);
    int32_t threads = (int32_t)config_int(c, "threads"), max_new = (int32_t)config_int(c, "max-new-tokens");
    eagle_weights weights;
    if (eagle_weights_parse(config_str(c, "draft-weights"), &weights, err) != AE_OK) goto out;
    int32_t act_bits;
    if (svc_act_bits(c, &act_bits, err) != AE_OK || setup_engine(&e, c, m, &plan, threads, act_bits, err) != AE_OK)
        goto out;
    drafter_config dc = {1, plan.max_seq_len, SETUP_PREFILL_CHUNK, threads, engine_pool(e), act_bits};
    spec_config sc = spec_config_default(runs[0].shape, 1, SETUP_PREFILL_CHUNK);
    if (draft_link_open(&link, draft, model_embedding(m), weights, &dc, err) != AE_OK ||
        draft_link_capture(&link, sc.capture, err) != AE_OK || spec_init(&sx, e, &link.iface, &sc, err) != AE_OK)
        goto out;
    logits = malloc(sizeof(float) * (size_t)m->cfg.vocab);
    plain = malloc(sizeof(int32_t) * (size_t)max_new);
    got = malloc(sizeof(int32_t) * (size_t)max_new);
    if (!logits || !plain || !got) {
        err_set(err, "out of memory");
        goto out;
    }
    int32_t eos = tok_eos(cm.tok);
    int64_t plain_tokens = 0;
    double plain_seconds = 0, t_start = clock_mono_seconds();
    fprintf(stderr, "eval-draft: %lld prompts, up to %d new tokens each, plain and %d tree shapes\n",
            (long long)n_prompts, max_new, n_shapes);
    for (int64_t p = 0; p < n_prompts; p++) {
        int32_t n_ids, n_plain, n_got;
        free(ids);
        ids = NULL;
        if (cli_user_turn_ids(cm.tok, ct, prompts[p], &ids, &n_ids, err) != AE_OK) goto out;
        if (n_ids + max_new + ENGINE_MAX_TREE > plan.max_seq_len) {
            err_set(err, "prompt %lld is %d tokens with its template; raise --max-seq-len (%d)", (long long)p + 1,
                    n_ids, plan.max_seq_len);
            goto out;
        }
        double secs;
        int32_t steps;
        if (run_plain(e, ids, n_ids, max_new, eos, logits, plain, &n_plain, &steps, &secs, err) != AE_OK) goto out;
        plain_tokens += steps;
        plain_seconds += secs;
        for (int s = 0; s < n_shapes; s++) {
            if (run_spec(sx, e, ids, n_ids, max_new, eos, got, &n_got, &runs[s], err) != AE_OK) goto out;
            runs[s].identical += n_got == n_plain && !memcmp(got, plain, sizeof(int32_t) * (size_t)n_got);
        }
        fprintf(stderr, "eval-draft: %lld/%lld prompts, plain %.0f tok/s", (long long)p + 1, (long long)n_prompts,
                plain_seconds > 0 ? (double)plain_tokens / plain_seconds : 0.0);
        for (int s = 0; s < n_shapes; s++)
            fprintf(stderr, "; %d/%d/%d accept %.2f, %.0f tok/s", runs[s].shape.steps, runs[s].shape.topk,
                    runs[s].shape.tokens,
                    runs[s].steps ? (double)(runs[s].accepted + runs[s].steps) / (double)runs[s].steps : 0.0,
                    runs[s].seconds > 0 ? (double)runs[s].decided / runs[s].seconds : 0.0);
        fprintf(stderr, "\n");
    }
    double plain_tps = plain_seconds > 0 ? (double)plain_tokens / plain_seconds : 0;
    cJSON *o = cJSON_CreateObject();
    cJSON *arr = o ? cJSON_AddArrayToObject(o, "shapes") : NULL;
    if (!arr) {
        cJSON_Delete(o);
        err_set(err, "out of memory");
        goto out;
    }
    cJSON_AddStringToObject(o, "draft", draft);
    cJSON_AddStringToObject(o, "draft_weights", config_str(c, "draft-weights"));
    cJSON_AddNumberToObject(o, "prompts", (double)n_prompts);
    cJSON_AddNumberToObject(o, "max_new_tokens", max_new);
    cJSON_AddNumberToObject(o, "threads", threads);
    cJSON_AddNumberToObject(o, "plain_decode_tok_per_s", cli_round(plain_tps, 10));
    for (int s = 0; s < n_shapes; s++) cJSON_AddItemToArray(arr, shape_json(&runs[s], plain_tps));
    cJSON_AddNumberToObject(o, "seconds", cli_round(clock_mono_seconds() - t_start, 10));
    char *line = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (line) puts(line);
    cJSON_free(line);
    rc = 0;
out:
    for (int64_t i = 0; i < n_prompts; i++) free(prompts[i]);
    free(prompts);
    free(ids);
    free(got);
    free(plain);
    free(logits);
    spec_free(sx);
    draft_link_close(&link);
    engine_free(e);
    model_free(m);
    chat_template_free(ct);
    tok_file_close(&cm);
    return rc;
}

const cli_cmd cli_cmd_eval_draft = {
    .name = "eval-draft",
    .args = "--model FILE --draft DIR --prompts FILE",
    .summary = "acceptance and speed of a draft head on held-out prompts, against plain decoding",
    .opts = ev_opts,
    .n_opts = sizeof ev_opts / sizeof ev_opts[0],
    .run = ev_run,
    .resolve = ev_resolve,
};

/* ---- draft-logits ---------------------------------------------------- */

static const config_option dl_opts[] = {
    {"model", CONFIG_STRING, NULL, 0, 0, "the head's target: .gguf file or Hugging Face directory"},
    {"draft", CONFIG_STRING, NULL, 0, 0, "EAGLE-3 head directory"},
    {"input", CONFIG_STRING, NULL, 0, 0, "safetensors with features F32 [n, 3H] and tokens I32 [n]"},
    {"out", CONFIG_STRING, NULL, 0, 0, "safetensors to write: logits F32 [n, draft_vocab]"},
    {"threads", CONFIG_INT, "1", 1, POOL_MAX_THREADS, "compute threads"},
    SVC_ACT_BITS_OPTION,
    {"log-level", CONFIG_STRING, "warn", 0, 0, "debug, info, warn, error or off"},
};

static int dl_run(const config *c, int argc, char **argv, ae_error *err) {
    if (argc > 0) return err_set(err, "unexpected argument \"%s\"", argv[0]), CLI_EXIT_USAGE;
    const char *path = config_str(c, "model"), *dir = config_str(c, "draft"), *in = config_str(c, "input"),
               *outp = config_str(c, "out");
    if (!path || !dir || !in || !outp)
        return err_set(err, "--model, --draft, --input and --out are all needed"), CLI_EXIT_USAGE;
    model *m = NULL;
    eagle_head *h = NULL;
    safetensors_file *f = NULL;
    kv_cache *kv = NULL;
    pool *p = NULL;
    kn_stream *s = NULL;
    eagle_ws *ws = NULL;
    float *feat = NULL, *hidden = NULL, *logits = NULL;
    int32_t *tokens = NULL, *pos = NULL, *seqs = NULL, *n_prefix = NULL, *zero = NULL, *rows = NULL;
    int rc = CLI_EXIT_USAGE;
    int32_t act_bits;
    if (svc_act_bits(c, &act_bits, err) != AE_OK || model_load(&m, path, &kn_backend_cpu, err) != AE_OK) goto out;
    eagle_target t = model_embedding(m);
    if (eagle_load(&h, dir, &t, EAGLE_WEIGHTS_FILE, err) != AE_OK || safetensors_open(&f, in, err) != AE_OK) goto out;
    const safetensors_tensor *tf = safetensors_find(f, "features"), *tt = safetensors_find(f, "tokens");
    int32_t H = m->cfg.hidden, Vd = h->cfg.draft_vocab;
    if (!tf || !tt || tt->n_dims != 1 || tf->n_dims != 2 || tf->shape[1] != (uint64_t)(3 * H) ||
        tf->shape[0] != tt->shape[0] || tt->shape[0] < 1 || tt->shape[0] > 4096) {
        err_set(err, "%s: expected features [n, %d] and tokens [n], 1 <= n <= 4096", in, 3 * H);
        goto out;
    }
    int32_t n = (int32_t)tt->shape[0];
    feat = malloc(sizeof(float) * (size_t)n * (size_t)(3 * H));
    hidden = malloc(sizeof(float) * (size_t)n * (size_t)H);
    logits = malloc(sizeof(float) * (size_t)n * (size_t)Vd);
    tokens = malloc(sizeof(int32_t) * (size_t)n);
    pos = malloc(sizeof(int32_t) * (size_t)n);
    seqs = malloc(sizeof(int32_t) * (size_t)n);
    n_prefix = malloc(sizeof(int32_t) * (size_t)n);
    zero = calloc((size_t)n, sizeof(int32_t));
    rows = malloc(sizeof(int32_t) * (size_t)n);
    if (!feat || !hidden || !logits || !tokens || !pos || !seqs || !n_prefix || !zero || !rows) {
        err_set(err, "out of memory");
        goto out;
    }
    if (safetensors_tensor_to_f32(tf, feat, (uint64_t)n * (uint64_t)(3 * H), err) != AE_OK ||
        safetensors_tensor_to_i32(tt, tokens, (uint64_t)n, err) != AE_OK)
        goto out;
    for (int32_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= m->cfg.vocab) {
            err_set(err, "%s: tokens[%d] = %d is outside the vocabulary of %d", in, i, tokens[i], m->cfg.vocab);
            goto out;
        }
    kv_params kp = {1, h->cfg.n_kv_heads, h->cfg.head_dim, 16, (n + 15) / 16, 1, (n + 15) / 16, false};
    int32_t seq;
    if (kv_init(&kv, &kn_backend_cpu, &kp, err) != AE_OK ||
        pool_init(&p, (int)config_int(c, "threads"), err) != AE_OK ||
        kn_stream_init(&s, &kn_backend_cpu, &(kn_stream_config){p, eagle_stream_workspace(h, n, n)}, err) != AE_OK ||
        eagle_ws_init(&ws, h, n, err) != AE_OK || kv_seq_alloc(kv, &seq, err) != AE_OK ||
        kv_seq_reserve(kv, seq, n, err) != AE_OK)
        goto out;
    kn_stream_set_act_bits(s, act_bits);
    for (int32_t i = 0; i < n; i++) {
        pos[i] = i;
        seqs[i] = seq;
        n_prefix[i] = i + 1;
        rows[i] = i;
    }
    kn_kv_map map = {n, kv_map_tables(kv), kp.max_seqs, kp.max_blocks_per_seq, seqs, pos, n_prefix, zero, zero, zero, 0,
                     n};
    eagle_batch b = {n, tokens, feat, 3 * H, pos, &map, hidden, n, rows, logits};
    kn_kv_pool layer = kv_layer(kv, 0);
    eagle_forward(h, s, &layer, ws, &b);
    safetensors_out o = {"logits", SAFETENSORS_F32, 2, {(uint64_t)n, (uint64_t)Vd}, logits};
    if (safetensors_write(outp, &o, 1, NULL, 0, err) != AE_OK) goto out;
    rc = 0;
out:
    free(feat);
    free(hidden);
    free(logits);
    free(tokens);
    free(pos);
    free(seqs);
    free(n_prefix);
    free(zero);
    free(rows);
    eagle_ws_free(ws);
    kn_stream_free(s);
    pool_free(p);
    kv_free(kv);
    safetensors_close(f);
    eagle_free(h);
    model_free(m);
    return rc;
}

const cli_cmd cli_cmd_draft_logits = {
    .name = "draft-logits",
    .args = "--model FILE --draft DIR --input FILE --out FILE",
    .summary = "a draft head's first-step logits over given features and tokens (to check a trainer's export)",
    .opts = dl_opts,
    .n_opts = sizeof dl_opts / sizeof dl_opts[0],
    .run = dl_run,
};
