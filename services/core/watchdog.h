/* systemd's watchdog (WatchdogSec=) for a service with several loops.
 *
 * Every loop that must keep turning (the RPC event loop, the target's
 * scheduler, ...) registers a slot and beats it each time round. A thread
 * of this module sends WATCHDOG=1 every interval/4, and only while every
 * slot has beaten within the last interval/2: one healthy loop pinging for
 * the whole process would hide a hung one, and systemd then kills and
 * restarts the service (Restart=on-failure).
 *
 * The interval comes from $WATCHDOG_USEC, honoured only when
 * $WATCHDOG_PID is unset or names this process (watchdog_env_interval_us).
 * Without a watchdog the handle is NULL and every call is a no-op, so code
 * may beat unconditionally.
 *
 * Test-only hook, off unless set: $AERIE_TEST_WATCHDOG_STALL=NAME makes
 * the loop registered as NAME count as hung (its beats are dropped), so
 * that a test can see a service stop pinging without hanging it for real.
 * Nothing in production sets it. */
#ifndef AERIE_CORE_WATCHDOG_H
#define AERIE_CORE_WATCHDOG_H

#include <stdint.h>

#include "err.h"

struct event_base;

#define WATCHDOG_MAX_LOOPS 32
#define WATCHDOG_NAME_MAX 32

typedef struct watchdog watchdog;

/* The range of intervals taken from $WATCHDOG_USEC (watchdog_env_interval_us).
 * Floor: 400 ms, i.e. a ping every 100 ms. WATCHDOG_USEC=1 would
 * otherwise make the ping thread wake every 250 ns, a spin that burns a
 * quarter of a core while the service idles; a systemd that wants pings
 * more often than every 100 ms gets them late (the clamp is logged).
 * Ceiling: 1 hour, a ping every 15 minutes. Pinging more often than
 * asked is always in time, a watchdog of more than an hour no longer
 * catches a hang usefully, and the nanoseconds (interval x 1000, plus the
 * monotonic clock) stay far inside int64: at 9.2e15 us and above the
 * product overflowed and no WATCHDOG=1 was ever sent. */
#define WATCHDOG_MIN_USEC 400000LL
#define WATCHDOG_MAX_USEC 3600000000LL

/* The watchdog interval systemd asked for, in microseconds, clamped to
 * WATCHDOG_MIN_USEC..WATCHDOG_MAX_USEC (a warning says so); 0 when none: unset, meant
 * for another process, or not a positive whole number (a warning says
 * so). */
int64_t watchdog_env_interval_us(void);

/* A watchdog with this interval; *out = NULL when interval_us <= 0. Above
 * WATCHDOG_MAX_USEC is a broken invariant; below WATCHDOG_MIN_USEC is for tests. */
int watchdog_init(watchdog **out, int64_t interval_us, ae_error *err);

/* The interval in nanoseconds; 0 for NULL. A loop that sleeps until work
 * comes beats at least every interval/4 (as watchdog_watch_base's timers do),
 * and need not wake at all without a watchdog. */
int64_t watchdog_interval_ns(const watchdog *w);

/* Stops pinging and removes the loop timers (watchdog_watch_base); safe to call
 * while other loops still beat. Call it after STOPPING=1 (systemd does not
 * watch a stopping service) and before the event bases are freed. */
void watchdog_stop(watchdog *w);

/* watchdog_stop, then frees; NULL is a no-op. No loop may beat after it. */
void watchdog_free(watchdog *w);

/* Registers a loop (the name is copied, cut to WATCHDOG_NAME_MAX - 1) as just
 * beaten; returns its slot, or -1 when w is NULL. A full table is a broken
 * invariant (WATCHDOG_MAX_LOOPS). Any thread. */
int watchdog_add(watchdog *w, const char *name);

/* Takes the loop's slot out of the checks (the loop is ending on purpose). */
void watchdog_remove(watchdog *w, int slot);

/* The loop in this slot is alive now. Lock-free; no-op for NULL or -1. */
void watchdog_beat(watchdog *w, int slot);

/* The name of a registered loop that has not beaten within interval/2 of
 * now_ns (clock_mono_ns, services/core/clock.h), or NULL when all have. */
const char *watchdog_stale(watchdog *w, int64_t now_ns);

/* Registers a loop for a libevent base and beats it from a timer on that
 * base every interval/4, i.e. from the loop's own thread: the beat stops
 * when the loop stops turning. The base must use libevent's pthreads
 * locking (the RPC loops do) when this is called from another thread. */
int watchdog_watch_base(watchdog *w, struct event_base *base, const char *name, ae_error *err);

/* Starts the pinging thread. Call when the service is ready, right after
 * READY=1 (systemd arms the watchdog only then). */
int watchdog_start(watchdog *w, ae_error *err);

/* The process's watchdog, for loops deep inside libraries (the target's
 * scheduler) that have no other way to reach it. Set by main; NULL until
 * then, which makes their beats no-ops (unit tests, the CLI). */
void watchdog_set_process(watchdog *w);
watchdog *watchdog_process(void);

#endif
