#include "arena.h"

#include <stdlib.h>
#include <string.h>

int arena_init(arena *a, size_t cap, ae_error *err) {
    memset(a, 0, sizeof *a);
    if (cap == 0) return err_set(err, "arena: capacity must be > 0");
    size_t rounded = (cap + 63) & ~(size_t)63;
    if (rounded < cap) return err_set(err, "arena: capacity %zu too large", cap);
    a->base = aligned_alloc(64, rounded);
    if (!a->base) return err_set(err, "arena: out of memory allocating %zu bytes", rounded);
    a->cap = rounded;
    return AE_OK;
}

void arena_free(arena *a) {
    if (!a) return;
    free(a->base);
    memset(a, 0, sizeof *a);
}

void *arena_alloc(arena *a, size_t size, size_t align) {
    AE_ASSERT(align != 0 && (align & (align - 1)) == 0 && align <= 64);
    size_t start = (a->used + align - 1) & ~(align - 1);
    if (start > a->cap || size > a->cap - start) return NULL;
    a->used = start + size;
    if (a->used > a->high_water) a->high_water = a->used;
    return a->base + start;
}

void arena_reset(arena *a) { a->used = 0; }

void arena_rewind(arena *a, size_t mark) {
    AE_ASSERT(mark <= a->used);
    a->used = mark;
}
