/* The one clock of the services: CLOCK_MONOTONIC, which no change of the
 * wall clock moves. Inline, so that a spin that reads it stays a read. */
#ifndef AERIE_CORE_CLOCK_H
#define AERIE_CORE_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline int64_t clock_mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline double clock_mono_seconds(void) { return (double)clock_mono_ns() * 1e-9; }

#endif
