#include "mem.h"

#include <stdlib.h>
#include <sys/mman.h>

#define MEM_HUGE ((size_t)2 << 20)

void *mem_alloc_large(size_t bytes) {
    if (bytes < MEM_HUGE / 2) return aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    size_t size = (bytes + MEM_HUGE - 1) & ~(MEM_HUGE - 1);
    void *p = aligned_alloc(MEM_HUGE, size);
    if (p) (void)madvise(p, size, MADV_HUGEPAGE); /* a hint; failure is harmless */
    return p;
}
