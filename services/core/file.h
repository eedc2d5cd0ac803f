/* Whole small files (JSON configs, tokenizer.json, prompts) read into
 * memory, with a size limit so a wrong path cannot exhaust memory; and
 * whole transfers on a descriptor. */
#ifndef AERIE_CORE_FILE_H
#define AERIE_CORE_FILE_H

#include <stdbool.h>
#include <stddef.h>

#include "err.h"

/* Reads all of path (a regular file, or a pipe such as /dev/stdin) into a
 * malloc'd buffer with a NUL after the last byte. More than limit bytes is
 * an error. Errors read "<path>: <problem>". When missing is not NULL it
 * tells whether the failure was that the file does not exist, so callers
 * can treat an optional file's absence apart from a broken one. */
int file_read_all(const char *path, size_t limit, char **out, size_t *len, bool *missing, ae_error *err);

/* Writes, or reads, exactly n bytes on fd, going on after short transfers
 * and EINTR. 0 when all n moved; -1 on an error (errno says) or, reading,
 * at the end of the stream first. */
int file_write_full(int fd, const void *p, size_t n);
int file_read_full(int fd, void *p, size_t n);

#endif
