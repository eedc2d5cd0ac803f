/* What every service's main does around its work: settings with
 * provenance (and --print-config), signals, and systemd's readiness
 * protocol. */
#ifndef AERIE_CORE_SVC_H
#define AERIE_CORE_SVC_H

#include <stdbool.h>
#include <stddef.h>

#include "config.h"
#include "err.h"

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
int svc_config_load(cfg **out, const char *service, const cfg_option *opts, size_t n, int argc, char **argv,
                    bool *print_config, bool *help, ae_error *err);

/* Prints the resolved settings as JSON on stdout (--print-config). */
void svc_print_config(const cfg *c);

/* Tells systemd (Type=notify) the service's state, e.g. "READY=1" or
 * "STOPPING=1"; a no-op without $NOTIFY_SOCKET. */
void svc_notify(const char *state);

#endif
