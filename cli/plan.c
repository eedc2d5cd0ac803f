/* What the commands that run the engine share. */
#include "plan.h"

#include "../services/core/log.h"

/* Bytes the head and its drafter add to the plan (0 without --draft):
 * its weights, and its KV, workspace and trees. */
static int draft_bytes(const config *c, const model *m, int32_t max_seq_len, uint64_t *weights, uint64_t *work,
                       ae_error *err) {
    *weights = *work = 0;
    const char *dir = eagle_dir(c);
    if (!dir) return AE_OK;
    eagle_head *h;
    eagle_target t = model_embedding(m);
    eagle_weights held_as;
    if (eagle_weights_parse(config_str(c, "draft-weights"), &held_as, err) != AE_OK ||
        eagle_load(&h, dir, &t, held_as, err) != AE_OK)
        return AE_ERR;
    int32_t max_batch = (int32_t)config_int(c, "max-batch");
    drafter_config dc = {max_batch, max_seq_len, SETUP_PREFILL_CHUNK, 1, NULL, 0};
    spec_config sc = spec_config_default((spec_shape){0, 0, 0}, max_batch, SETUP_PREFILL_CHUNK);
    *weights = h->weight_bytes;
    *work = drafter_bytes(h, &dc) + spec_bytes(m, &sc);
    LOG_INFOF("draft head=%s weights=%zu drafter_and_trees=%llu (counted in the memory plan as weights and "
              "fixed workspace)",
              dir, h->weight_bytes, (unsigned long long)*work);
    eagle_free(h);
    return AE_OK;
}

int cli_plan(config *c, const model *m, bool draft, memplan *plan, ae_error *err) {
    uint64_t dw = 0, dx = 0;
    if (config_is_auto(c, "max-seq-len")) config_set_auto_int(c, "max-seq-len", m->cfg.context_length);
    if (draft && draft_bytes(c, m, (int32_t)config_int(c, "max-seq-len"), &dw, &dx, err) != AE_OK) return AE_ERR;
    return setup_plan(c, m, dw, dx, plan, err);
}

int cli_resolve_engine(config *c, bool draft, ae_error *err) {
    if (config_is_auto(c, "threads")) config_set_auto_int(c, "threads", pool_cpu_count());
    if (draft) eagle_resolve_dir(c);
    const char *path = config_str(c, "model");
    if (!path) return err_set(err, "no model given (use --model FILE)");
    model *m;
    if (model_load(&m, path, &kn_backend_cpu, err) != AE_OK) return AE_ERR;
    memplan plan;
    int rc = cli_plan(c, m, draft, &plan, err);
    model_free(m);
    return rc;
}

static double round4(double x) { return (double)(int64_t)(x * 1e4 + (x < 0 ? -0.5 : 0.5)) / 1e4; }

void cli_spec_stats_json(cJSON *o, const spec_stats *st, const spec_shape *shape) {
    cJSON_AddNumberToObject(o, "spec_steps", shape->steps);
    cJSON_AddNumberToObject(o, "spec_topk", shape->topk);
    cJSON_AddNumberToObject(o, "spec_tokens", shape->tokens);
    cJSON_AddNumberToObject(o, "verify_steps", (double)st->steps);
    cJSON_AddNumberToObject(o, "plain_steps", (double)st->plain_steps);
    cJSON_AddNumberToObject(o, "drafted_tokens", (double)st->drafted);
    cJSON_AddNumberToObject(o, "accepted_tokens", (double)st->accepted);
    cJSON_AddNumberToObject(o, "emitted_tokens", (double)st->emitted);
    cJSON_AddNumberToObject(o, "draft_failures", (double)st->draft_failures);
    cJSON_AddNumberToObject(o, "bad_trees", (double)st->bad_trees);
    cJSON_AddNumberToObject(o, "mean_accept_len", round4(spec_stats_accept_len(st)));
    cJSON_AddNumberToObject(o, "adaptive_plain_steps", (double)st->adapt_plain_steps);
    cJSON_AddNumberToObject(o, "adaptive_switched_off", (double)st->adapt_off);
    cJSON_AddNumberToObject(o, "policy_explore_steps", (double)st->explore_steps);
    cJSON *depth = cJSON_AddArrayToObject(o, "accept_per_depth");
    for (int32_t d = 0; depth && d < shape->steps && d < SPEC_MAX_DEPTH; d++)
        cJSON_AddItemToArray(
            depth, cJSON_CreateNumber(st->steps ? round4((double)st->accepted_at[d] / (double)st->steps) : 0));
    double total = (double)(st->draft_ns + st->verify_ns);
    cJSON_AddNumberToObject(o, "draft_time_share", total > 0 ? round4((double)st->draft_ns / total) : 0);
    cJSON_AddNumberToObject(o, "explore_time_share", total > 0 ? round4((double)st->explore_ns / total) : 0);
    double all = total + (double)st->feed_ns;
    cJSON_AddNumberToObject(o, "feed_time_share", all > 0 ? round4((double)st->feed_ns / all) : 0);
}
