/* One schema compile for structured output, bounded: a time budget, and
 * an end as soon as its request is cancelled, its client leaves, or the
 * service stops.
 *
 * XGrammar cannot stop a compile once it runs, and a compile's time and
 * memory grow with what the schema holds (a 55,000-entry enum took 261 s
 * and 0.6 GB). So each compile runs on a detached thread of its own: the
 * caller waits for it, polling every GCOMPILE_POLL_MS, and gives up on it at
 * the budget or a cancel. A thread given up on runs to its end and its
 * result is thrown away (a success still lands in the vocabulary's
 * cache); nothing waits for it, not even the service's exit (it holds its
 * own reference on the vocabulary, and gcompile_live says how many run, for a
 * service that leaves with _exit). What one such thread can cost is
 * bounded by the schema limits the gateway enforces (gateway/schema.h),
 * and how many run at once by max_live: a new compile waits for a place.
 *
 * A child process was tried first, since a kill frees its core and its
 * memory at once; but the compiled grammar must come back to the service,
 * and XGrammar's only form for that is its JSON serialisation, which took
 * 3 times the compile's own time for a 1,024-entry enum and, for a
 * 1,500-property object, 20 s and 7.7 GB. */
#ifndef AERIE_TARGET_GCOMPILE_H
#define AERIE_TARGET_GCOMPILE_H

#include <stdbool.h>
#include <stdint.h>

#include "grammar.h"

typedef struct gcompile_limits {
    bool isolate;       /* on a thread of its own, bounded (the service); false: in this thread, unbounded */
    int64_t timeout_ms; /* the budget, waiting for a place included (isolate only); 0: none */
    int32_t max_live;   /* compile threads running at once, those given up on included; 0: no limit */
    int64_t log_ms;     /* compiles that took at least this long are logged; < 0: none */
} gcompile_limits;

/* Why a compile gave no grammar, beside AE_OK, AE_ERR (ours: no thread,
 * out of memory) and GRAMMAR_REFUSED (the engine's reason, in err). */
#define GCOMPILE_TIMEOUT 3   /* past timeout_ms; err names it and its value */
#define GCOMPILE_CANCELLED 4 /* cancelled() said so */
#define GCOMPILE_LAST GCOMPILE_CANCELLED

/* Compiles schema (NULL: json_object) into *out, from the cache when it is
 * there. cancelled(ctx), when given, is polled every GCOMPILE_POLL_MS while the
 * compile runs or waits for a place. Safe from several threads at once. */
#define GCOMPILE_POLL_MS 10
int gcompile_compile(grammar **out, grammar_vocab *v, const char *schema, const gcompile_limits *lim,
                     bool (*cancelled)(void *ctx), void *ctx, ae_error *err);

/* Compile threads running now (given up on or not). */
int32_t gcompile_live(void);

/* What a return code is called in logs and metrics: "ok", "refused",
 * "timeout", "cancelled", "error". */
const char *gcompile_rc_name(int rc);

#endif
