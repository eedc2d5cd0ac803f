/* Large buffers: the weights' packed copy, the KV cache.
 *
 * A decode step streams ~100 MB of weights and every layer's keys and
 * values. With 4 KiB pages that is tens of thousands of TLB misses per
 * step; these buffers are aligned to 2 MiB and marked for transparent huge
 * pages (a hint: where the kernel declines, they are plain pages). */
#ifndef AERIE_CORE_MEM_H
#define AERIE_CORE_MEM_H

#include <stddef.h>

/* At least `bytes` bytes, 64-byte aligned (2 MiB aligned when bytes is
 * 1 MiB or more), uninitialized; NULL when out of memory. Release with
 * free(). */
void *mem_alloc_large(size_t bytes);

#endif
