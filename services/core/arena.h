/* A bump allocator over one block sized up front: per-request scratch that
 * is released all at once with arena_reset. Never grows, so a request that
 * needs more than planned fails cleanly instead of allocating on a hot path. */
#ifndef AERIE_CORE_ARENA_H
#define AERIE_CORE_ARENA_H

#include <stddef.h>
#include <stdint.h>

#include "err.h"

typedef struct arena {
    uint8_t *base; /* (cap) bytes, 64-byte aligned */
    size_t cap;
    size_t used;
    size_t high_water; /* largest `used` seen, for sizing plans */
} arena;

int arena_init(arena *a, size_t cap, ae_error *err);
void arena_free(arena *a); /* zeroed or freed arena: no-op */

/* align must be a power of two <= 64. Returns NULL when the arena is full. */
void *arena_alloc(arena *a, size_t size, size_t align);
void arena_reset(arena *a);

/* A position to rewind to, for scratch nested inside a request. */
static inline size_t arena_mark(const arena *a) { return a->used; }
void arena_rewind(arena *a, size_t mark);

#endif
