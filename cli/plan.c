/* The engine's memory plan, shared by the commands that run the engine. */
#include "plan.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "../services/core/file.h"
#include "../services/core/log.h"
#include "../services/core/svc.h"
#include "draft_link.h"

/* Bytes the head and its drafter add to the plan (0 without --draft):
 * its weights, and its KV, workspace and trees. */
static int draft_bytes(const cfg *c, const model *m, int32_t max_seq_len, uint64_t *weights, uint64_t *work,
                       ae_error *err) {
    *weights = *work = 0;
    const char *dir = cli_draft_dir(c);
    if (!dir) return AE_OK;
    eagle_head *h;
    eagle_target t = {m->cfg.hidden, m->cfg.vocab, m->cfg.n_layers, &m->tok_embd};
    eagle_weights held_as;
    if (eagle_weights_parse(cfg_str(c, "draft-weights"), &held_as, err) != AE_OK ||
        eagle_load(&h, dir, &t, held_as, err) != AE_OK)
        return AE_ERR;
    int32_t max_batch = (int32_t)cfg_int(c, "max-batch");
    drafter_config dc = {max_batch, max_seq_len, CLI_PREFILL_CHUNK, 1, NULL, 0};
    spec_config sc = {LLAMA_MAX_CAPTURE, {0}, {0, 0, 0}, max_batch, CLI_PREFILL_CHUNK, false, NULL, NULL};
    *weights = h->weight_bytes;
    *work = drafter_bytes(h, &dc) + spec_bytes(m, &sc);
    LOG_INFOF("draft head=%s weights=%zu drafter_and_trees=%llu (counted in the memory plan as weights and "
              "kernel scratch)", dir, h->weight_bytes, (unsigned long long)*work);
    eagle_free(h);
    return AE_OK;
}

/* The memory plan for this model on this machine; records auto values. */
int cli_plan(cfg *c, const model *m, bool draft, memplan *plan, ae_error *err) {
    if (cfg_is_auto(c, "max-seq-len")) cfg_set_auto_int(c, "max-seq-len", m->cfg.context_length);
    uint64_t avail;
    if (hostmem_available(&avail, err) != AE_OK) return AE_ERR;
    const model_config *mc = &m->cfg;
    uint64_t dw = 0, dx = 0;
    if (draft && draft_bytes(c, m, (int32_t)cfg_int(c, "max-seq-len"), &dw, &dx, err) != AE_OK) return AE_ERR;
    memplan_model mm = {m->weight_bytes + dw, mc->n_layers, mc->hidden, mc->ffn, mc->n_heads,
                        mc->n_kv_heads, mc->head_dim, mc->vocab};
    memplan_env env = {avail, CLI_KV_BLOCK, CLI_PREFILL_CHUNK,
                       llama_stream_workspace(m, CLI_PREFILL_CHUNK, (int32_t)cfg_int(c, "max-seq-len")) + dx};
    return memplan_compute(c, &mm, &env, plan, err);
}

const char *cli_draft_dir(const cfg *c) {
    const char *d = cfg_str(c, "draft");
    return d && strcmp(d, "none") ? d : NULL;
}

/* The "target_model" of dir/training.json, or NULL. */
static char *head_target(const char *dir) {
    char path[4096], *text = NULL, *out = NULL;
    size_t len;
    ae_error err = {0};
    if ((size_t)snprintf(path, sizeof path, "%s/training.json", dir) >= sizeof path) return NULL;
    if (file_read_all(path, 1 << 20, &text, &len, NULL, &err) != AE_OK) return NULL;
    cJSON *o = cJSON_Parse(text);
    const cJSON *t = o ? cJSON_GetObjectItemCaseSensitive(o, "target_model") : NULL;
    if (cJSON_IsString(t)) out = strdup(t->valuestring);
    cJSON_Delete(o);
    free(text);
    return out;
}

void cli_resolve_draft(cfg *c) {
    if (!cfg_is_auto(c, "draft")) return;
    const char *model_path = cfg_str(c, "model");
    char found[4096] = "none";
    if (model_path) {
        char dir[4096];
        snprintf(dir, sizeof dir, "%s", model_path);
        size_t n = strlen(dir);
        while (n > 1 && dir[n - 1] == '/') dir[--n] = 0; /* a model directory given as "dir/" */
        char *slash = strrchr(dir, '/');
        const char *name = slash ? slash + 1 : dir;
        char parent[4096];
        snprintf(parent, sizeof parent, "%.*s", slash ? (int)(slash - dir) : 1, slash ? dir : ".");
        struct dirent **list = NULL;
        int k = scandir(parent, &list, NULL, alphasort);
        for (int i = 0; i < k; i++) {
            char sub[4096];
            if (list[i]->d_name[0] != '.' && !strcmp(found, "none") &&
                (size_t)snprintf(sub, sizeof sub, "%s/%s", parent, list[i]->d_name) < sizeof sub) {
                char *target = head_target(sub);
                if (target && !strcmp(target, name)) snprintf(found, sizeof found, "%s", sub);
                free(target);
            }
            free(list[i]);
        }
        free(list);
    }
    cfg_set_auto_str(c, "draft", found);
}

int cli_resolve_engine(cfg *c, bool draft, ae_error *err) {
    if (cfg_is_auto(c, "threads")) cfg_set_auto_int(c, "threads", pool_cpu_count());
    if (draft) cli_resolve_draft(c);
    const char *path = cfg_str(c, "model");
    if (!path) return err_set(err, "no model given (use --model FILE)");
    model *m;
    if (model_load(&m, path, err) != AE_OK) return AE_ERR;
    memplan plan;
    int rc = cli_plan(c, m, draft, &plan, err);
    model_free(m);
    return rc;
}

int cli_service_open(cfg **c, model **m, const char *service, const cfg_option *opts, size_t n, int argc, char **argv,
                     bool *print_config, bool *help, ae_error *err) {
    *m = NULL;
    if (svc_config_load(c, service, opts, n, argc, argv, print_config, help, err) != AE_OK) return AE_ERR;
    if (*help) return AE_OK;
    if (cfg_is_auto(*c, "threads")) cfg_set_auto_int(*c, "threads", pool_cpu_count());
    const char *path = cfg_str(*c, "model");
    if (!path) return err_set(err, "no model given (use --model FILE)");
    return model_load(m, path, err);
}

int cli_act_bits(const cfg *c, int32_t *bits, ae_error *err) {
    int64_t v = cfg_int(c, "act-bits");
    if (v != 8 && v != 15) return err_set(err, "act-bits must be 8 or 15, got %lld", (long long)v);
    *bits = (int32_t)v;
    return AE_OK;
}

int cli_engine_open(eng **e, const model *m, const memplan *plan, int32_t threads, int32_t act_bits, ae_error *err) {
    if (plan->kv_tokens > INT32_MAX)
        return err_set(err, "memory plan: %lld KV tokens is more than one engine holds (%d); lower --max-kv-tokens",
                       (long long)plan->kv_tokens, INT32_MAX);
    eng_config ec = {CLI_PREFILL_CHUNK, plan->max_batch, plan->max_seq_len, (int32_t)plan->kv_tokens,
                     plan->block_size, threads, act_bits};
    return eng_init(e, m, &ec, err);
}
