/* What every service's main does around its work: settings with
 * provenance (and --print-config), signals, and systemd's readiness
 * protocol. */
#ifndef AERIE_CORE_SVC_H
#define AERIE_CORE_SVC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "err.h"

/* The activation precision of the quantized matmuls (kernels.h, "Batch
 * invariance"), a setting of every program that runs the engine or the
 * head: 8 (one byte plane) or 15 (two). 8 is the default by measurement
 * (docs/accuracy.md): on the GGUF files measured its mean KL against the
 * float model is within 0.1% of llama.cpp's or below it, and on an
 * 8B-shaped model it decodes 1.1-1.4x and prefills 1.6-1.9x as fast as
 * 15 bits. 15 keeps the logits within
 * 2e-3 of float weights (the golden tests). kernels.h's
 * KN_ACT_BITS_DEFAULT, a stream's own default, stays 15. */
#define SVC_ACT_BITS_OPTION \
    {"act-bits", \
     CONFIG_INT, \
     "8", \
     8, \
     15, \
     "bits each activation keeps in quantized matmuls: 8 (one byte plane: as accurate as llama.cpp, " \
     "docs/accuracy.md) or 15 (two: closer to the float model, more integer work a step)"}

/* c's "act-bits" into *bits; a value other than 8 or 15 fails. */
int svc_act_bits(const config *c, int32_t *bits, ae_error *err);

/* Blocks SIGTERM and SIGINT in this thread and every thread it starts
 * later (they are taken by svc_wait_signal), and ignores SIGPIPE (a peer
 * that hangs up is an error on its socket, not a death). Also keeps large
 * allocations in the heap (see svc.c). Call first. */
void svc_signals_init(void);

/* Waits for SIGTERM or SIGINT; returns it. */
int svc_wait_signal(void);

/* Loads the settings (defaults < --config file < AERIE_* < flags), sets
 * the log level from "log-level", and refuses positional arguments.
 * *help: --help was given (the usage was printed to stdout). */
int svc_config_load(config **out, const char *service, const config_option *opts, size_t n, int argc, char **argv,
                    bool *print_config, bool *help, ae_error *err);

/* Prints the resolved settings as JSON on stdout (--print-config). */
void svc_print_config(const config *c);

/* Tells systemd (Type=notify) the service's state, e.g. "READY=1" or
 * "STOPPING=1"; a no-op without $NOTIFY_SOCKET. */
void svc_notify(const char *state);

/* While a service loads its model (before READY=1), asks systemd every
 * SVC_EXTEND_EVERY_S to extend its start timeout by SVC_EXTEND_BY_S
 * (EXTEND_TIMEOUT_USEC), so that TimeoutStartSec= bounds a stall rather
 * than a large model's load. It gives up after SVC_LOAD_MAX_S: a load
 * that long is taken as hung, and systemd's timeout then ends it. A no-op
 * without $NOTIFY_SOCKET. svc_loading_end stops it (call it before
 * READY=1); both are for main's thread. */
#define SVC_EXTEND_EVERY_S 10
#define SVC_EXTEND_BY_S 30
#define SVC_LOAD_MAX_S 1800
void svc_loading_begin(void);
void svc_loading_end(void);

#endif
