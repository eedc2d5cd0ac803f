/* The host's memory as the services plan it: what /proc/meminfo says is
 * available, the share of it a service takes by default, and byte counts
 * in words. The target's plan (target/memplan.h) and the draft's
 * (draft/main.c) both start from these. */
#ifndef AERIE_CORE_HOSTMEM_H
#define AERIE_CORE_HOSTMEM_H

#include <stddef.h>
#include <stdint.h>

#include "err.h"

#define HOSTMEM_RESERVE_MIN (1ull << 30) /* bytes left to the system at least */
#define HOSTMEM_RESERVE_PCT 10           /* ... or this share of available, if larger */

/* The auto mem-fraction for this much available memory: the largest
 * multiple of 0.001 leaving max(1 GiB, 10%); 0 when nothing is left. */
double hostmem_auto_fraction(uint64_t available);

/* floor(available x ppm / 1e6), without overflow or rounding surprises. */
uint64_t hostmem_share(uint64_t available, uint64_t ppm);

/* MemAvailable from /proc/meminfo, in bytes. */
int hostmem_available(uint64_t *bytes, ae_error *err);
/* The same from a meminfo text (for tests). */
int hostmem_parse_meminfo(const char *text, uint64_t *bytes, ae_error *err);

/* "23.4 GiB", "45 KiB", "512 B": 3 significant digits, binary units. */
void hostmem_fmt_bytes(uint64_t bytes, char *buf, size_t cap);

#endif
