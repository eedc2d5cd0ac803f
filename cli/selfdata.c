/* Training data for an EAGLE-3 head, made by the target itself:
 *
 *   aerie gen-prompts    samples user turns from the model's chat template
 *                        (the template up to the user's content, then the
 *                        model writes the content) at a temperature,
 *                        deduplicated; writes train.jsonl and heldout.jsonl.
 *                        With --seeds, attempt i starts its user turn with
 *                        opening i mod n of that file (a task and a topic),
 *                        so the turns are as varied as the openings; with
 *                        --exclude, a turn that contains one of that
 *                        file's prompts is dropped (the committed held-out
 *                        set is never trained on).
 *   aerie dump-features  answers each prompt with the target (greedy by
 *                        default: self-distillation) and writes, for every
 *                        token, the captured features and the target's
 *                        top-K next-token probabilities to safetensors
 *                        shards. It shows progress and resumes where it
 *                        stopped.
 *
 * Both run many sequences through one engine (batchgen.h). Sequence i is
 * sampled from its own random stream (seed, i), so the output does not
 * depend on the batch size or on how often a run was resumed.
 *
 * Shard layout (format "aerie-features-1"), S sequences, N tokens in all:
 *   input_ids      I32 [N]          prompt and response tokens, sequence after sequence
 *   hidden         F16 [N, 3 H]     features of token t (input of the capture layers);
 *                                   the last token of each sequence has none (zeros)
 *   topk_ids       I32 [N, K]       the target's K most likely tokens after token t,
 *   topk_p         F16 [N, K]       and their probabilities; zeros before the last
 *                                   prompt token and at the last token
 *   lengths        I32 [S]          tokens of each sequence
 *   prompt_lengths I32 [S]          of which prompt (chat template included)
 *   prompt_index   I32 [S]          line of the prompts file, from 0
 * Metadata: format, capture_layers ("2,15,27"), hidden, topk.
 *
 * A trainer that streams (tools/train_eagle3.py train --stream) replaces
 * each shard it has used by an empty shard-NNNNN.consumed, so the data on
 * disk stay a few shards however long the run. Either file counts as
 * written when a run resumes, and with --max-pending N the dump waits
 * while N shards are written and not yet consumed. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "../services/core/file.h"
#include "../services/core/log.h"
#include "../services/model/quant.h"
#include "../services/model/safetensors_write.h"
#include "../services/tokenizer/chat.h"
#include "batchgen.h"
#include "cli.h"
#include "plan.h"

#define PROGRESS_SECONDS 2.0
#define PROMPTS_FILE_MAX (256u << 20)

/* ---- shared ---------------------------------------------------------- */

typedef struct selfdata {
    tok_file cm;
    model *m;
    engine *e;
    chat_template *ct;
    int32_t threads;
} selfdata;

static void selfdata_close(selfdata *s) {
    engine_free(s->e);
    model_free(s->m);
    chat_template_free(s->ct);
    tok_file_close(&s->cm);
}

static int selfdata_open(selfdata *s, config *c, ae_error *err) {
    memset(s, 0, sizeof *s);
    const char *path = config_str(c, "model");
    if (tok_file_open(&s->cm, path, err) != AE_OK) return AE_ERR;
    if (!tok_chat_template(s->cm.tok)) return err_set(err, "%s: the model has no chat template", path);
    if (chat_template_init(&s->ct, tok_chat_template(s->cm.tok), err) != AE_OK) return AE_ERR;
    if (model_load(&s->m, path, &kn_backend_cpu, err) != AE_OK) return AE_ERR;
    memplan plan;
    if (cli_plan(c, s->m, false, &plan, err) != AE_OK) return AE_ERR;
    memplan_log(&plan);
    s->threads = (int32_t)config_int(c, "threads");
    int32_t act_bits;
    if (svc_act_bits(c, &act_bits, err) != AE_OK) return AE_ERR;
    return setup_engine(&s->e, c, s->m, &plan, s->threads, act_bits, err);
}

int cli_user_turn_ids(const tok *t, const chat_template *ct, const char *content, int32_t **ids, int32_t *n,
                      ae_error *err) {
    static const char marker[] = "\x01\x02\x03";
    chat_msg msg = {"user", content ? content : marker};
    char *text = NULL;
    size_t len;
    if (chat_render_alloc(ct, &msg, 1, content != NULL, &text, &len, err) != AE_OK) return AE_ERR;
    if (!content) {
        char *at = strstr(text, marker);
        if (!at) {
            free(text);
            return err_set(err, "the chat template does not write the user's content as given");
        }
        len = (size_t)(at - text);
    }
    size_t got = 0;
    *ids = malloc((len + 1) * sizeof **ids);
    int rc =
        *ids ? tok_encode(t, text, len, TOK_PARSE_SPECIAL, *ids, len + 1, &got, err) : err_set(err, "out of memory");
    free(text);
    *n = (int32_t)got;
    return rc;
}

static uint64_t seq_seed(uint64_t seed, int64_t i) { return seed * 0x9e3779b97f4a7c15ULL + (uint64_t)i; }

static void fmt_duration(char *buf, size_t cap, double s) {
    if (!(s >= 0) || s > 1e7)
        snprintf(buf, cap, "?");
    else if (s < 90)
        snprintf(buf, cap, "%.0f s", s);
    else if (s < 5400)
        snprintf(buf, cap, "%.0f min", s / 60);
    else
        snprintf(buf, cap, "%.1f h", s / 3600);
}

static int make_dir(const char *dir, ae_error *err) {
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) return err_set(err, "%s: %s", dir, strerror(errno));
    return AE_OK;
}

/* Writes text to path whole or not at all. */
static int write_text_file(const char *path, const char *text, size_t len, ae_error *err) {
    char tmp[4200];
    if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp", path) >= sizeof tmp) return err_set(err, "%s: path too long", path);
    FILE *f = fopen(tmp, "wb");
    if (!f) return err_set(err, "%s: %s", tmp, strerror(errno));
    bool ok = fwrite(text, 1, len, f) == len;
    ok = fflush(f) == 0 && ok && fsync(fileno(f)) == 0;
    if (fclose(f) != 0) ok = false;
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return err_set(err, "%s: %s", path, strerror(errno ? errno : EIO));
    }
    return AE_OK;
}

#define COMMON_OPTIONS \
    {"model", CONFIG_STRING, NULL, 0, 0, "model: .gguf file or Hugging Face directory"}, \
        {"out", CONFIG_STRING, NULL, 0, 0, "output directory (created if missing)"}, \
        {"seed", CONFIG_INT, "1", 0, 9007199254740991.0, "random seed; sequence i draws from stream (seed, i)"}, \
        {"threads", CONFIG_INT, "auto", 1, POOL_MAX_THREADS, "compute threads (auto: the CPUs this process may use)"}, \
        {"max-batch", CONFIG_INT, "16", 1, 4096, "sequences generated together"}, \
        SVC_ACT_BITS_OPTION, {"mem-fraction", \
                              CONFIG_DOUBLE, \
                              "auto", \
                              0.01, \
                              1.0, \
                              "fraction of available memory to use (auto: leave the system max(1 GiB, 10%))"}, \
        {"max-kv-tokens", CONFIG_INT, "auto", 1, 1e12, "KV cache size in tokens (auto: what fits)"}, \
        {"log-level", CONFIG_STRING, "warn", 0, 0, "debug, info, warn, error or off"}

/* ---- gen-prompts ----------------------------------------------------- */

static const config_option gp_opts[] = {
    COMMON_OPTIONS,
    {"count", CONFIG_INT, "2000", 1, 1 << 24, "distinct prompts to make, held-out ones included"},
    {"heldout", CONFIG_INT, "100", 0, 1 << 24, "of which the first ones go to heldout.jsonl, never trained on"},
    {"temperature", CONFIG_DOUBLE, "0.9", 0.8, 100, "sampling temperature of the user turn (at least 0.8)"},
    {"top-p", CONFIG_DOUBLE, "1", 0, 1, "nucleus sampling of the user turn (1 = off)"},
    {"max-tokens", CONFIG_INT, "64", 2, 1 << 16, "longest user turn; longer samples are dropped"},
    {"min-tokens", CONFIG_INT, "4", 1, 1 << 16, "shortest user turn kept"},
    {"keep-cut", CONFIG_BOOL, "false", 0, 0,
     "keep user turns that reach max-tokens (cut short) instead of dropping them"},
    {"max-seq-len", CONFIG_INT, "auto", 1, 16777216, "longest sequence (auto: 256 + max-tokens)"},
    {"seeds", CONFIG_STRING, NULL, 0, 0,
     "JSON lines of {\"prompt\": OPENING}: attempt i starts its user turn with opening i mod n"},
    {"exclude", CONFIG_STRING, NULL, 0, 0,
     "JSON lines of {\"prompt\": TEXT}: turns containing one of them (case and spacing aside) are dropped"},
};

typedef struct gp_state {
    selfdata *sd;
    int32_t *opener;
    int32_t n_opener, cap; /* cap: opener + max-tokens, without a seed */
    int32_t **seed_ids;    /* [n_seeds][seed_len[i]]: openings of the user's content */
    int32_t *seed_len;
    int64_t n_seeds;
    char **exclude; /* [n_exclude] normalised texts (norm_text) */
    int64_t n_exclude;
    sample_params sp;
    uint64_t seed;
    int64_t count, attempts, max_attempts;
    int32_t min_tokens;
    bool keep_cut;
    batchgen_seq **slots; /* by attempt index, until its turn to be judged */
    int64_t judged;       /* attempts judged, in index order */
    char **kept;          /* [count] */
    int64_t n_kept;
    uint64_t *seen; /* open-addressing set of normalised-text hashes, 0 = empty */
    size_t seen_cap;
    int64_t sampled, duplicates, cut, short_, special, excluded;
    int64_t tokens;
    double t0, last_progress;
} gp_state;

static bool gp_next(void *ctx, batchgen_seq **out) {
    gp_state *g = ctx;
    if (g->n_kept >= g->count || g->attempts >= g->max_attempts) return false;
    int64_t i = g->attempts;
    int32_t n_seed = g->n_seeds ? g->seed_len[i % g->n_seeds] : 0;
    batchgen_seq *s = calloc(1, sizeof *s);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(g->cap + n_seed));
    if (!s || !ids) {
        free(s);
        free(ids);
        return false; /* the run ends short, and says so */
    }
    memcpy(ids, g->opener, sizeof(int32_t) * (size_t)g->n_opener);
    if (n_seed) memcpy(ids + g->n_opener, g->seed_ids[i % g->n_seeds], sizeof(int32_t) * (size_t)n_seed);
    s->index = g->attempts++;
    s->ids = ids;
    s->n_prompt = g->n_opener + n_seed;
    s->cap = g->cap + n_seed;
    s->sp = g->sp;
    sample_rng_seed(&s->rng, seq_seed(g->seed, s->index));
    g->slots[s->index] = s;
    *out = s;
    return true;
}

/* FNV-1a over the text lowercased (ASCII) with runs of whitespace as one
 * space, so "Hello  world" and "hello world" are one prompt. */
static uint64_t norm_hash(const char *t) {
    uint64_t h = 0xcbf29ce484222325ULL;
    bool space = false;
    for (; *t; t++) {
        unsigned char ch = (unsigned char)*t;
        if (ch == ' ' || ch == '\n' || ch == '\t' || ch == '\r') {
            space = true;
            continue;
        }
        if (space) h = (h ^ ' ') * 0x100000001b3ULL;
        space = false;
        if (ch >= 'A' && ch <= 'Z') ch = (unsigned char)(ch - 'A' + 'a');
        h = (h ^ ch) * 0x100000001b3ULL;
    }
    return h ? h : 1;
}

/* The text lowercased (ASCII), runs of whitespace as one space, the ends
 * trimmed: the form in which --exclude compares turns. */
static char *norm_text(const char *t) {
    char *o = malloc(strlen(t) + 1), *w = o;
    if (!o) return NULL;
    bool space = false;
    for (; *t; t++) {
        unsigned char ch = (unsigned char)*t;
        if (ch == ' ' || ch == '\n' || ch == '\t' || ch == '\r') {
            space = w != o;
            continue;
        }
        if (space) *w++ = ' ';
        space = false;
        *w++ = (char)(ch >= 'A' && ch <= 'Z' ? ch - 'A' + 'a' : ch);
    }
    *w = 0;
    return o;
}

static bool seen_insert(gp_state *g, uint64_t h) {
    size_t i = (size_t)h & (g->seen_cap - 1);
    while (g->seen[i]) {
        if (g->seen[i] == h) return false;
        i = (i + 1) & (g->seen_cap - 1);
    }
    g->seen[i] = h;
    return true;
}

/* Text of a user turn with surrounding whitespace removed, or NULL. */
static char *turn_text(const tok *t, const int32_t *ids, int32_t n, ae_error *err) {
    size_t len;
    if (tok_decode(t, ids, (size_t)n, false, NULL, 0, &len, err) != AE_OK) return NULL;
    char *text = malloc(len + 1);
    if (!text) return err_set(err, "out of memory"), NULL;
    if (tok_decode(t, ids, (size_t)n, false, text, len + 1, &len, err) != AE_OK) {
        free(text);
        return NULL;
    }
    size_t a = 0;
    while (a < len && strchr(" \t\r\n", text[a])) a++;
    while (len > a && strchr(" \t\r\n", text[len - 1])) len--;
    memmove(text, text + a, len - a);
    text[len - a] = 0;
    return text;
}

static int gp_judge(gp_state *g, batchgen_seq *s, ae_error *err) {
    const tok *t = g->sd->cm.tok;
    /* The turn is the seed's opening and what the model wrote after it. */
    int32_t n = s->n - g->n_opener - (s->stopped ? 1 : 0);
    const int32_t *body = s->ids + g->n_opener;
    g->tokens += s->n - s->n_prompt;
    g->sampled++;
    if (!s->stopped) {
        g->cut++;
        if (!g->keep_cut) return AE_OK;
    }
    for (int32_t i = 0; i < n; i++)
        if (tok_is_special(t, body[i])) {
            g->special++;
            return AE_OK;
        }
    char *text = turn_text(t, body, n, err);
    if (!text) return AE_ERR;
    if (n < g->min_tokens || !*text) {
        g->short_++;
        free(text);
        return AE_OK;
    }
    if (g->n_exclude) {
        char *nt = norm_text(text);
        if (!nt) {
            free(text);
            return err_set(err, "out of memory");
        }
        bool hit = false;
        for (int64_t i = 0; i < g->n_exclude && !hit; i++) hit = g->exclude[i][0] && strstr(nt, g->exclude[i]);
        free(nt);
        if (hit) {
            g->excluded++;
            free(text);
            return AE_OK;
        }
    }
    if (!seen_insert(g, norm_hash(text))) {
        g->duplicates++;
        free(text);
        return AE_OK;
    }
    if (g->n_kept < g->count)
        g->kept[g->n_kept++] = text;
    else
        free(text);
    return AE_OK;
}

static void gp_progress(gp_state *g, bool force) {
    double now = clock_mono_seconds();
    if (!force && now - g->last_progress < PROGRESS_SECONDS) return;
    g->last_progress = now;
    double el = now - g->t0, rate = g->n_kept > 0 ? el / (double)g->n_kept : -1;
    char eta[32];
    fmt_duration(eta, sizeof eta, rate * (double)(g->count - g->n_kept));
    fprintf(
        stderr,
        "gen-prompts: %lld/%lld prompts from %lld samples (%lld duplicates, %lld cut at max-tokens%s, %lld too short, "
        "%lld with special tokens, %lld excluded), %.0f tok/s, %s left\n",
        (long long)g->n_kept, (long long)g->count, (long long)g->sampled, (long long)g->duplicates, (long long)g->cut,
        g->keep_cut ? " and kept" : "", (long long)g->short_, (long long)g->special, (long long)g->excluded,
        el > 0 ? (double)g->tokens / el : 0.0, g->n_kept >= g->count ? "nothing" : eta);
}

static int gp_done(void *ctx, batchgen_seq *s, ae_error *err) {
    gp_state *g = ctx;
    (void)s; /* judged in index order below, so the result does not depend on timing */
    while (g->judged < g->attempts && g->slots[g->judged]->done) {
        batchgen_seq *j = g->slots[g->judged];
        int rc = g->n_kept < g->count ? gp_judge(g, j, err) : AE_OK;
        free(j->ids);
        free(j);
        g->slots[g->judged++] = NULL;
        if (rc != AE_OK) return rc;
    }
    gp_progress(g, false);
    return AE_OK;
}

static int write_jsonl(const char *dir, const char *name, char **texts, int64_t n, ae_error *err) {
    char path[4096];
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, name) >= sizeof path) return err_set(err, "path too long");
    size_t cap = 1, len = 0;
    char *buf = NULL;
    int rc = AE_OK;
    for (int64_t i = 0; i < n && rc == AE_OK; i++) {
        cJSON *o = cJSON_CreateObject();
        char *line = NULL;
        if (o && cJSON_AddStringToObject(o, "prompt", texts[i])) line = cJSON_PrintUnformatted(o);
        cJSON_Delete(o);
        size_t ll = line ? strlen(line) : 0;
        if (line && len + ll + 2 > cap) {
            while (len + ll + 2 > cap) cap *= 2;
            char *nb = realloc(buf, cap);
            if (!nb) {
                cJSON_free(line);
                line = NULL;
            } else {
                buf = nb;
            }
        }
        if (!line) {
            rc = err_set(err, "out of memory");
            break;
        }
        memcpy(buf + len, line, ll);
        len += ll;
        buf[len++] = '\n';
        cJSON_free(line);
    }
    if (rc == AE_OK) rc = write_text_file(path, buf ? buf : "", len, err);
    free(buf);
    return rc;
}

/* The seeds' token ids, each encoded alone (no special tokens: an opening
 * is the user's text, never markup). */
static int gp_load_seeds(gp_state *g, const char *path, ae_error *err) {
    if (!path) return AE_OK;
    char **texts = NULL;
    int64_t n = 0;
    if (cli_read_prompts(path, &texts, &n, 0, err) != AE_OK) return AE_ERR;
    int rc = AE_OK;
    g->seed_ids = calloc((size_t)n, sizeof *g->seed_ids);
    g->seed_len = calloc((size_t)n, sizeof *g->seed_len);
    if (!g->seed_ids || !g->seed_len) rc = err_set(err, "out of memory");
    for (int64_t i = 0; rc == AE_OK && i < n; i++) {
        size_t len = strlen(texts[i]), got = 0;
        g->seed_ids[i] = malloc((len + 1) * sizeof(int32_t));
        g->n_seeds = i + 1;
        if (!g->seed_ids[i])
            rc = err_set(err, "out of memory");
        else
            rc = tok_encode(g->sd->cm.tok, texts[i], len, 0, g->seed_ids[i], len + 1, &got, err);
        g->seed_len[i] = (int32_t)got;
    }
    for (int64_t i = 0; i < n; i++) free(texts[i]);
    free(texts);
    return rc;
}

static int gp_load_exclude(gp_state *g, const char *path, ae_error *err) {
    if (!path) return AE_OK;
    if (cli_read_prompts(path, &g->exclude, &g->n_exclude, 0, err) != AE_OK) return AE_ERR;
    for (int64_t i = 0; i < g->n_exclude; i++) {
        char *nt = norm_text(g->exclude[i]);
        if (!nt) return err_set(err, "out of memory");
        free(g->exclude[i]);
        g->exclude[i] = nt;
    }
    return AE_OK;
}

static int gp_resolve(config *c, ae_error *err) {
    if (config_is_auto(c, "max-seq-len")) config_set_auto_int(c, "max-seq-len", 256 + config_int(c, "max-tokens"));
    return cli_resolve_engine(c, false, err);
}

static int gp_run(const config *cc, int argc, char **argv, ae_error *err) {
    config *c = (config *)cc;
    if (argc > 0) return err_set(err, "unexpected argument \"%s\"", argv[0]), CLI_EXIT_USAGE;
    const char *out = config_str(c, "out");
    if (!out) return err_set(err, "no output directory given (use --out DIR)"), CLI_EXIT_USAGE;
    int64_t count = config_int(c, "count"), heldout = config_int(c, "heldout");
    if (heldout >= count)
        return err_set(err, "--heldout %lld leaves nothing to train on out of --count %lld", (long long)heldout,
                       (long long)count),
               CLI_EXIT_USAGE;
    selfdata sd;
    gp_state g = {.sd = &sd};
    int rc = CLI_EXIT_USAGE;
    if (selfdata_open(&sd, c, err) != AE_OK || make_dir(out, err) != AE_OK) goto out;
    if (cli_user_turn_ids(sd.cm.tok, sd.ct, NULL, &g.opener, &g.n_opener, err) != AE_OK) goto out;
    g.cap = g.n_opener + (int32_t)config_int(c, "max-tokens");
    if (gp_load_seeds(&g, config_str(c, "seeds"), err) != AE_OK ||
        gp_load_exclude(&g, config_str(c, "exclude"), err) != AE_OK)
        goto out;
    int32_t longest_seed = 0;
    for (int64_t i = 0; i < g.n_seeds; i++)
        if (g.seed_len[i] > longest_seed) longest_seed = g.seed_len[i];
    if (g.cap + longest_seed > config_int(c, "max-seq-len")) {
        err_set(err,
                "the template's opening (%d tokens) + the longest seed (%d) + max-tokens (%lld) exceeds "
                "max-seq-len %lld",
                g.n_opener, longest_seed, (long long)config_int(c, "max-tokens"),
                (long long)config_int(c, "max-seq-len"));
        goto out;
    }
    g.sp = (sample_params){(float)config_double(c, "temperature"), 0, (float)config_double(c, "top-p"), 0};
    g.seed = (uint64_t)config_int(c, "seed");
    g.count = count;
    g.max_attempts = 8 * count + 64;
    g.min_tokens = (int32_t)config_int(c, "min-tokens");
    g.keep_cut = config_bool(c, "keep-cut");
    g.seen_cap = 1;
    while (g.seen_cap < (size_t)g.max_attempts * 2) g.seen_cap <<= 1;
    g.slots = calloc((size_t)g.max_attempts, sizeof *g.slots);
    g.kept = calloc((size_t)count, sizeof *g.kept);
    g.seen = calloc(g.seen_cap, sizeof *g.seen);
    if (!g.slots || !g.kept || !g.seen) {
        err_set(err, "out of memory");
        goto out;
    }
    fprintf(stderr,
            "gen-prompts: sampling %lld user turns (temperature %g) after the template's opening of %d tokens\n",
            (long long)count, config_double(c, "temperature"), g.n_opener);
    g.t0 = g.last_progress = clock_mono_seconds();
    int32_t stop = tok_eos(sd.cm.tok);
    batchgen_config bc = {(int32_t)config_int(c, "max-batch"), SETUP_PREFILL_CHUNK, stop, 0, {0}, 0};
    if (batchgen_run(sd.e, &bc, gp_next, gp_done, &g, err) != AE_OK) goto out;
    gp_progress(&g, true);
    if (g.n_kept < count) {
        err_set(err,
                "only %lld distinct prompts from %lld samples; raise --temperature or --max-tokens, or lower --count",
                (long long)g.n_kept, (long long)g.sampled);
        goto out;
    }
    if (write_jsonl(out, "heldout.jsonl", g.kept, heldout, err) != AE_OK ||
        write_jsonl(out, "train.jsonl", g.kept + heldout, count - heldout, err) != AE_OK)
        goto out;
    printf("{\"train\":%lld,\"heldout\":%lld,\"samples\":%lld,\"duplicates\":%lld,\"cut\":%lld,\"too_short\":%lld,"
           "\"special\":%lld,\"excluded\":%lld,\"seeds\":%lld,\"generated_tokens\":%lld,\"seconds\":%.1f}\n",
           (long long)(count - heldout), (long long)heldout, (long long)g.sampled, (long long)g.duplicates,
           (long long)g.cut, (long long)g.short_, (long long)g.special, (long long)g.excluded, (long long)g.n_seeds,
           (long long)g.tokens, clock_mono_seconds() - g.t0);
    rc = 0;
out:
    for (int64_t i = 0; g.slots && i < g.attempts; i++)
        if (g.slots[i]) {
            free(g.slots[i]->ids);
            free(g.slots[i]);
        }
    for (int64_t i = 0; g.kept && i < g.n_kept; i++) free(g.kept[i]);
    free(g.slots);
    free(g.kept);
    free(g.seen);
    free(g.opener);
    for (int64_t i = 0; g.seed_ids && i < g.n_seeds; i++) free(g.seed_ids[i]);
    free(g.seed_ids);
    free(g.seed_len);
    for (int64_t i = 0; g.exclude && i < g.n_exclude; i++) free(g.exclude[i]);
    free(g.exclude);
    selfdata_close(&sd);
    return rc;
}

const cli_cmd cli_cmd_gen_prompts = {
    .name = "gen-prompts",
    .args = "--model FILE --out DIR",
    .summary = "sample distinct user prompts from the model itself (EAGLE-3 training data)",
    .opts = gp_opts,
    .n_opts = sizeof gp_opts / sizeof gp_opts[0],
    .run = gp_run,
    .resolve = gp_resolve,
};

/* ---- dump-features --------------------------------------------------- */

static const config_option df_opts[] = {
    COMMON_OPTIONS,
    {"prompts", CONFIG_STRING, NULL, 0, 0, "JSON lines of {\"prompt\": TEXT} (gen-prompts' train.jsonl)"},
    {"limit", CONFIG_INT, "0", 0, 1 << 30, "use only the first N prompts (0: all)"},
    {"max-new-tokens", CONFIG_INT, "256", 1, 1 << 20, "longest response"},
    {"temperature", CONFIG_DOUBLE, "0", 0, 100, "of the responses (0 = greedy: what greedy decoding will verify)"},
    {"topk", CONFIG_INT, "8", 1, 64, "target probabilities kept per token"},
    {"capture", CONFIG_STRING, "auto", 0, 0,
     "target layers whose input is captured, \"a,b,c\" (auto: EAGLE-3's 2, n/2, n-3)"},
    {"shard-size", CONFIG_INT, "64", 1, 1 << 20, "sequences per shard"},
    {"max-pending", CONFIG_INT, "0", 0, 1 << 20,
     "pause while this many shards wait for a streaming trainer to consume them (0: never pause)"},
    {"max-prompt-tokens", CONFIG_INT, "512", 1, 1 << 20, "longest prompt with its template; longer ones are an error"},
    {"max-seq-len", CONFIG_INT, "auto", 1, 16777216, "longest sequence (auto: max-prompt-tokens + max-new-tokens)"},
};

typedef struct df_state {
    selfdata *sd;
    char **prompts;
    int64_t n_prompts, next, first;
    int32_t max_prompt, max_new, topk, width;
    sample_params sp;
    uint64_t seed;
    int64_t shard_size, n_shards, shard; /* shard: the next to write */
    int64_t max_pending, oldest;         /* oldest: no shard before it is waiting for the trainer */
    batchgen_seq **slots;                /* [n_prompts], filled by next, emptied by writing */
    int32_t capture[FORWARD_MAX_CAPTURE];
    const char *out;
    int64_t seqs_done, tokens, generated, stopped;
    double t0, last_progress;
    ae_error prompt_err;
} df_state;

static void free_seq(batchgen_seq *s) {
    if (!s) return;
    free(s->ids);
    free(s->hidden);
    free(s->topk_ids);
    free(s->topk_p);
    free(s);
}

static bool df_next(void *ctx, batchgen_seq **out) {
    df_state *d = ctx;
    if (d->next >= d->n_prompts || err_is_set(&d->prompt_err)) return false;
    int64_t i = d->next;
    *out = NULL;
    /* At most the shard being finished and the next one are held, which
     * bounds the memory beside the engine's plan. */
    if (i >= (d->shard + 2) * d->shard_size) return true;
    int32_t *ids = NULL, n = 0;
    if (cli_user_turn_ids(d->sd->cm.tok, d->sd->ct, d->prompts[i], &ids, &n, &d->prompt_err) != AE_OK) {
        free(ids);
        return false;
    }
    if (n > d->max_prompt) {
        err_set(&d->prompt_err, "prompt %lld is %d tokens with its template, more than --max-prompt-tokens %d",
                (long long)i + 1, n, d->max_prompt);
        free(ids);
        return false;
    }
    batchgen_seq *s = calloc(1, sizeof *s);
    int32_t cap = n + d->max_new;
    int32_t *grown = realloc(ids, sizeof(int32_t) * (size_t)cap);
    if (s && grown) {
        ids = grown;
        s->hidden = calloc((size_t)cap * (size_t)d->width, sizeof(uint16_t));
        s->topk_ids = calloc((size_t)cap * (size_t)d->topk, sizeof(int32_t));
        s->topk_p = calloc((size_t)cap * (size_t)d->topk, sizeof(uint16_t));
    }
    if (!s || !grown || !s->hidden || !s->topk_ids || !s->topk_p) {
        if (s) s->ids = NULL;
        free_seq(s);
        free(ids);
        err_set(&d->prompt_err, "out of memory");
        return false;
    }
    s->index = i;
    s->ids = ids;
    s->n_prompt = n;
    s->cap = cap;
    s->sp = d->sp;
    sample_rng_seed(&s->rng, seq_seed(d->seed, i));
    d->slots[i] = s;
    d->next++;
    *out = s;
    return true;
}

static void shard_path(const df_state *d, int64_t shard, char *buf, size_t cap) {
    snprintf(buf, cap, "%s/shard-%05lld.safetensors", d->out, (long long)shard);
}

/* Written by a streaming trainer in place of a shard it has used. */
static bool shard_consumed(const df_state *d, int64_t shard) {
    char path[4200];
    struct stat st;
    snprintf(path, sizeof path, "%s/shard-%05lld.consumed", d->out, (long long)shard);
    return stat(path, &st) == 0;
}

/* With --max-pending, holds the dump (the engine idle) while that many
 * shards wait for the trainer: the disk holds at most that many. */
static void df_wait_for_trainer(df_state *d) {
    if (d->max_pending <= 0) return;
    bool said = false;
    for (;;) {
        while (d->oldest < d->shard && shard_consumed(d, d->oldest)) d->oldest++;
        if (d->shard - d->oldest < d->max_pending || d->shard >= d->n_shards) return;
        if (!said)
            fprintf(stderr,
                    "dump-features: %lld shards wait for the trainer (--max-pending %lld); pausing until it "
                    "consumes one\n",
                    (long long)(d->shard - d->oldest), (long long)d->max_pending);
        said = true;
        struct timespec ts = {0, 200 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

static int df_write_shard(df_state *d, int64_t shard, ae_error *err) {
    int64_t lo = shard * d->shard_size, hi = lo + d->shard_size < d->n_prompts ? lo + d->shard_size : d->n_prompts;
    int32_t S = (int32_t)(hi - lo);
    int64_t N = 0;
    for (int64_t i = lo; i < hi; i++) N += d->slots[i]->n;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)N), *lens = malloc(sizeof(int32_t) * (size_t)S);
    int32_t *plens = malloc(sizeof(int32_t) * (size_t)S), *pidx = malloc(sizeof(int32_t) * (size_t)S);
    uint16_t *hid = malloc(sizeof(uint16_t) * (size_t)N * (size_t)d->width);
    int32_t *tki = malloc(sizeof(int32_t) * (size_t)N * (size_t)d->topk);
    uint16_t *tkp = malloc(sizeof(uint16_t) * (size_t)N * (size_t)d->topk);
    int rc = AE_OK;
    if (!ids || !lens || !plens || !pidx || !hid || !tki || !tkp) {
        rc = err_set(err, "out of memory");
        goto out;
    }
    int64_t at = 0;
    for (int64_t i = lo; i < hi; i++) {
        const batchgen_seq *s = d->slots[i];
        size_t n = (size_t)s->n;
        memcpy(ids + at, s->ids, n * sizeof *ids);
        memcpy(hid + at * d->width, s->hidden, n * (size_t)d->width * sizeof *hid);
        memcpy(tki + at * d->topk, s->topk_ids, n * (size_t)d->topk * sizeof *tki);
        memcpy(tkp + at * d->topk, s->topk_p, n * (size_t)d->topk * sizeof *tkp);
        lens[i - lo] = s->n;
        plens[i - lo] = s->n_prompt;
        pidx[i - lo] = (int32_t)i;
        at += (int64_t)n;
    }
    char layers[64], hidden[16], topk[16], path[4200];
    snprintf(layers, sizeof layers, "%d,%d,%d", d->capture[0], d->capture[1], d->capture[2]);
    snprintf(hidden, sizeof hidden, "%d", d->width / FORWARD_MAX_CAPTURE);
    snprintf(topk, sizeof topk, "%d", d->topk);
    const char *meta[] = {"format", "aerie-features-1", "capture_layers", layers, "hidden", hidden, "topk", topk};
    uint64_t n64 = (uint64_t)N;
    safetensors_out t[] = {
        {"input_ids", SAFETENSORS_I32, 1, {n64}, ids},
        {"hidden", SAFETENSORS_F16, 2, {n64, (uint64_t)d->width}, hid},
        {"topk_ids", SAFETENSORS_I32, 2, {n64, (uint64_t)d->topk}, tki},
        {"topk_p", SAFETENSORS_F16, 2, {n64, (uint64_t)d->topk}, tkp},
        {"lengths", SAFETENSORS_I32, 1, {(uint64_t)S}, lens},
        {"prompt_lengths", SAFETENSORS_I32, 1, {(uint64_t)S}, plens},
        {"prompt_index", SAFETENSORS_I32, 1, {(uint64_t)S}, pidx},
    };
    shard_path(d, shard, path, sizeof path);
    rc = safetensors_write(path, t, sizeof t / sizeof t[0], meta, 4, err);
out:
    free(ids);
    free(lens);
    free(plens);
    free(pidx);
    free(hid);
    free(tki);
    free(tkp);
    return rc;
}

static void df_progress(df_state *d, bool force) {
    double now = clock_mono_seconds();
    if (!force && now - d->last_progress < PROGRESS_SECONDS) return;
    d->last_progress = now;
    double el = now - d->t0;
    int64_t done = d->first + d->seqs_done;
    char eta[32];
    fmt_duration(eta, sizeof eta, d->seqs_done ? el / (double)d->seqs_done * (double)(d->n_prompts - done) : -1);
    fprintf(stderr,
            "dump-features: %lld/%lld prompts, %lld/%lld shards written, %lld tokens this run (%lld generated, "
            "%lld responses ended by the model), %.0f generated tok/s, %s left\n",
            (long long)done, (long long)d->n_prompts, (long long)d->shard, (long long)d->n_shards, (long long)d->tokens,
            (long long)d->generated, (long long)d->stopped, el > 0 ? (double)d->generated / el : 0.0,
            done >= d->n_prompts ? "nothing" : eta);
}

static int df_done(void *ctx, batchgen_seq *s, ae_error *err) {
    df_state *d = ctx;
    d->seqs_done++;
    d->tokens += s->n;
    d->generated += s->n - s->n_prompt;
    d->stopped += s->stopped;
    /* Shards are written in order, so the files on disk are always a
     * prefix of the whole and a resumed run starts after the last one. */
    for (;;) {
        int64_t lo = d->shard * d->shard_size;
        if (lo >= d->n_prompts) break;
        int64_t hi = lo + d->shard_size < d->n_prompts ? lo + d->shard_size : d->n_prompts;
        bool ready = true;
        for (int64_t i = lo; i < hi && ready; i++) ready = d->slots[i] && d->slots[i]->done;
        if (!ready) break;
        if (df_write_shard(d, d->shard, err) != AE_OK) return AE_ERR;
        for (int64_t i = lo; i < hi; i++) {
            free_seq(d->slots[i]);
            d->slots[i] = NULL;
        }
        d->shard++;
        df_progress(d, true);
        df_wait_for_trainer(d);
    }
    df_progress(d, false);
    return AE_OK;
}

int cli_read_prompts(const char *path, char ***out, int64_t *n_out, int64_t limit, ae_error *err) {
    char *buf;
    size_t len;
    if (file_read_all(path, PROMPTS_FILE_MAX, &buf, &len, NULL, err) != AE_OK) return AE_ERR;
    int64_t cap = 0, n = 0, line = 0;
    char **v = NULL;
    int rc = AE_OK;
    for (char *p = buf, *end; p < buf + len && (limit == 0 || n < limit); p = end + 1) {
        end = memchr(p, '\n', (size_t)(buf + len - p));
        if (!end) end = buf + len;
        *end = 0;
        line++;
        if (p == end) continue;
        cJSON *o = cJSON_Parse(p);
        const cJSON *t = o ? cJSON_GetObjectItemCaseSensitive(o, "prompt") : NULL;
        if (!cJSON_IsString(t) || !*t->valuestring) {
            cJSON_Delete(o);
            rc = err_set(err, "%s:%lld: expected {\"prompt\": TEXT}", path, (long long)line);
            break;
        }
        if (n == cap) {
            cap = cap ? 2 * cap : 256;
            char **nv = realloc(v, sizeof *v * (size_t)cap);
            if (!nv) {
                cJSON_Delete(o);
                rc = err_set(err, "out of memory");
                break;
            }
            v = nv;
        }
        v[n] = strdup(t->valuestring);
        cJSON_Delete(o);
        if (!v[n++]) {
            rc = err_set(err, "out of memory");
            break;
        }
    }
    free(buf);
    if (rc == AE_OK && n == 0) rc = err_set(err, "%s: no prompts", path);
    if (rc != AE_OK) {
        for (int64_t i = 0; i < n; i++) free(v[i]);
        free(v);
        return AE_ERR;
    }
    *out = v;
    *n_out = n;
    return AE_OK;
}

/* The settings a dump depends on. A resumed run must match them. */
static char *df_settings_json(const config *c, const df_state *d, const model *m) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    cJSON_AddStringToObject(o, "format", "aerie-features-1");
    const char *path = config_str(c, "model"), *slash = strrchr(path, '/');
    cJSON_AddStringToObject(o, "model", slash && slash[1] ? slash + 1 : path);
    /* The prompts by content, not by path: the same file reached another
     * way resumes, a regenerated one with the same name does not. */
    uint64_t h = 0xcbf29ce484222325ULL;
    for (int64_t i = 0; i < d->n_prompts; i++)
        for (const char *p = d->prompts[i];; p++) {
            h = (h ^ (unsigned char)*p) * 0x100000001b3ULL;
            if (!*p) break;
        }
    char hex[17];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)h);
    cJSON_AddStringToObject(o, "prompts_fnv1a64", hex);
    cJSON_AddNumberToObject(o, "prompt_count", (double)d->n_prompts);
    cJSON_AddNumberToObject(o, "target_vocab", m->cfg.vocab);
    cJSON_AddNumberToObject(o, "target_hidden", m->cfg.hidden);
    cJSON_AddNumberToObject(o, "target_layers", m->cfg.n_layers);
    cJSON_AddNumberToObject(o, "target_heads", m->cfg.n_heads);
    cJSON_AddNumberToObject(o, "target_kv_heads", m->cfg.n_kv_heads);
    cJSON_AddNumberToObject(o, "target_head_dim", m->cfg.head_dim);
    cJSON_AddNumberToObject(o, "target_ffn", m->cfg.ffn);
    cJSON_AddNumberToObject(o, "target_rms_eps", m->cfg.rms_eps);
    cJSON_AddNumberToObject(o, "target_rope_theta", m->cfg.rope.theta);
    cJSON_AddNumberToObject(o, "target_context_length", m->cfg.context_length);
    double layers[FORWARD_MAX_CAPTURE] = {d->capture[0], d->capture[1], d->capture[2]};
    cJSON_AddItemToObject(o, "capture_layers", cJSON_CreateDoubleArray(layers, FORWARD_MAX_CAPTURE));
    cJSON_AddNumberToObject(o, "max_new_tokens", d->max_new);
    cJSON_AddNumberToObject(o, "temperature", config_double(c, "temperature"));
    cJSON_AddNumberToObject(o, "seed", (double)d->seed);
    cJSON_AddNumberToObject(o, "topk", d->topk);
    cJSON_AddNumberToObject(o, "shard_size", (double)d->shard_size);
    cJSON_AddNumberToObject(o, "shards", (double)d->n_shards);
    char *s = cJSON_Print(o);
    cJSON_Delete(o);
    return s;
}

static int parse_capture(const char *s, const model *m, int32_t out[FORWARD_MAX_CAPTURE], ae_error *err) {
    if (!strcmp(s, "auto")) {
        capture_default_layers(m->cfg.n_layers, out);
        return AE_OK;
    }
    int32_t ids[FORWARD_MAX_CAPTURE + 1];
    int n = 0;
    for (const char *p = s; *p && n <= FORWARD_MAX_CAPTURE;) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || (*end && *end != ',')) return err_set(err, "capture: expected \"a,b,c\", got \"%s\"", s);
        ids[n++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    return capture_layers_from(ids, n, m->cfg.n_layers, out, err);
}

/* The target's embedding table as the engine holds it (dequantized, f32):
 * the head embeds tokens with it, so the trainer must see the same one. */
static int write_embed(const char *out, const model *m, ae_error *err) {
    char path[4200];
    snprintf(path, sizeof path, "%s/target_embed.safetensors", out);
    struct stat st;
    if (stat(path, &st) == 0) return AE_OK;
    const kn_weight *w = &m->tok_embd;
    size_t V = (size_t)w->rows, H = (size_t)w->cols;
    float *row = malloc(sizeof(float) * H);
    float *t = malloc(sizeof(float) * V * H);
    int rc = AE_OK;
    if (!row || !t) rc = err_set(err, "out of memory");
    for (size_t r = 0; rc == AE_OK && r < V; r++) {
        if (!quant_dequantize(w->type, (const char *)w->data + r * w->row_bytes, row, H)) {
            rc = err_set(err, "the embedding table's type cannot be dequantized");
            break;
        }
        memcpy(t + r * H, row, H * sizeof(float));
    }
    safetensors_out o = {"embed", SAFETENSORS_F32, 2, {V, H}, t};
    if (rc == AE_OK) rc = safetensors_write(path, &o, 1, NULL, 0, err);
    free(row);
    free(t);
    return rc;
}

static int df_resolve(config *c, ae_error *err) {
    if (config_is_auto(c, "max-seq-len"))
        config_set_auto_int(c, "max-seq-len", config_int(c, "max-prompt-tokens") + config_int(c, "max-new-tokens"));
    return cli_resolve_engine(c, false, err);
}

static int df_run(const config *cc, int argc, char **argv, ae_error *err) {
    config *c = (config *)cc;
    if (argc > 0) return err_set(err, "unexpected argument \"%s\"", argv[0]), CLI_EXIT_USAGE;
    const char *out = config_str(c, "out"), *prompts = config_str(c, "prompts");
    if (!out) return err_set(err, "no output directory given (use --out DIR)"), CLI_EXIT_USAGE;
    if (!prompts) return err_set(err, "no prompts given (use --prompts FILE)"), CLI_EXIT_USAGE;
    selfdata sd;
    df_state d = {.sd = &sd, .out = out};
    char *settings = NULL, *old = NULL;
    int rc = CLI_EXIT_USAGE;
    memset(&sd, 0, sizeof sd);
    if (cli_read_prompts(prompts, &d.prompts, &d.n_prompts, config_int(c, "limit"), err) != AE_OK) goto out;
    if (selfdata_open(&sd, c, err) != AE_OK || make_dir(out, err) != AE_OK) goto out;
    if (parse_capture(config_str(c, "capture"), sd.m, d.capture, err) != AE_OK) goto out;
    d.max_prompt = (int32_t)config_int(c, "max-prompt-tokens");
    d.max_new = (int32_t)config_int(c, "max-new-tokens");
    if ((int64_t)d.max_prompt + d.max_new > config_int(c, "max-seq-len")) {
        err_set(err, "max-prompt-tokens (%d) + max-new-tokens (%d) exceeds max-seq-len %lld", d.max_prompt, d.max_new,
                (long long)config_int(c, "max-seq-len"));
        goto out;
    }
    d.topk = (int32_t)config_int(c, "topk");
    d.width = FORWARD_MAX_CAPTURE * sd.m->cfg.hidden;
    d.sp = (sample_params){(float)config_double(c, "temperature"), 0, 1, 0};
    d.seed = (uint64_t)config_int(c, "seed");
    d.shard_size = config_int(c, "shard-size");
    d.max_pending = config_int(c, "max-pending");
    d.n_shards = (d.n_prompts + d.shard_size - 1) / d.shard_size;
    d.slots = calloc((size_t)d.n_prompts, sizeof *d.slots);
    settings = df_settings_json(c, &d, sd.m);
    if (!d.slots || !settings) {
        err_set(err, "out of memory");
        goto out;
    }
    if (write_embed(out, sd.m, err) != AE_OK) goto out;
    /* Resume: the settings must be the ones the shards were made with. */
    char path[4200];
    snprintf(path, sizeof path, "%s/features.json", out);
    bool missing = false;
    size_t old_len;
    if (file_read_all(path, 1 << 20, &old, &old_len, &missing, err) != AE_OK) {
        if (!missing) goto out;
        err_clear(err);
        if (write_text_file(path, settings, strlen(settings), err) != AE_OK) goto out;
    } else if (strcmp(old, settings) != 0) {
        err_set(err,
                "%s was written with other settings than this run's; use the same settings to resume, or "
                "another --out. It has:\n%s\nthis run has:\n%s",
                path, old, settings);
        goto out;
    }
    for (struct stat st; d.shard < d.n_shards; d.shard++) {
        shard_path(&d, d.shard, path, sizeof path);
        if (stat(path, &st) != 0 && !shard_consumed(&d, d.shard)) break;
    }
    d.first = d.next = d.shard * d.shard_size < d.n_prompts ? d.shard * d.shard_size : d.n_prompts;
    fprintf(stderr,
            "dump-features: %lld prompts in %lld shards of %lld; %s; capture layers %d,%d,%d, top-%d, responses up "
            "to %d tokens at temperature %g\n",
            (long long)d.n_prompts, (long long)d.n_shards, (long long)d.shard_size,
            d.shard ? "resuming after the shards already written" : "starting", d.capture[0], d.capture[1],
            d.capture[2], d.topk, d.max_new, config_double(c, "temperature"));
    /* Beside the engine's plan: the sequences of the shard being finished
     * and of the next (nothing further is started), and a copy of one
     * shard while it is written. */
    double row = (double)d.width * 2 + (double)d.topk * 6 + 4, cap = (double)(d.max_prompt + d.max_new);
    double held = 3.0 * (double)d.shard_size * cap * row;
    fprintf(stderr,
            "dump-features: memory beside the engine's plan: at most 3 x shard-size %lld sequences x %.0f tokens "
            "x %.0f bytes = %.0f MiB\n",
            (long long)d.shard_size, cap, row, held / 1048576.0);
    df_wait_for_trainer(&d); /* a resumed run may find its limit already reached */
    d.t0 = d.last_progress = clock_mono_seconds();
    df_progress(&d, true);
    batchgen_config bc = {(int32_t)config_int(c, "max-batch"),
                          SETUP_PREFILL_CHUNK,
                          tok_eos(sd.cm.tok),
                          FORWARD_MAX_CAPTURE,
                          {d.capture[0], d.capture[1], d.capture[2]},
                          d.topk};
    if (batchgen_run(sd.e, &bc, df_next, df_done, &d, err) != AE_OK) goto out;
    if (err_is_set(&d.prompt_err)) {
        *err = d.prompt_err;
        goto out;
    }
    df_progress(&d, true);
    printf("{\"prompts\":%lld,\"shards\":%lld,\"tokens_this_run\":%lld,\"generated_this_run\":%lld,\"seconds\":%.1f}\n",
           (long long)d.n_prompts, (long long)d.n_shards, (long long)d.tokens, (long long)d.generated,
           clock_mono_seconds() - d.t0);
    rc = 0;
out:
    for (int64_t i = 0; d.slots && i < d.n_prompts; i++) free_seq(d.slots[i]);
    for (int64_t i = 0; d.prompts && i < d.n_prompts; i++) free(d.prompts[i]);
    free(d.prompts);
    free(d.slots);
    free(settings);
    free(old);
    selfdata_close(&sd);
    return rc;
}

const cli_cmd cli_cmd_dump_features = {
    .name = "dump-features",
    .args = "--model FILE --prompts FILE --out DIR",
    .summary = "answer prompts with the target and write EAGLE-3 training features (resumable)",
    .opts = df_opts,
    .n_opts = sizeof df_opts / sizeof df_opts[0],
    .run = df_run,
    .resolve = df_resolve,
};
