/* Operator logs: one line per event on stderr,
 *   2026-11-29T10:31:02.123Z info model_loaded path=models/x.gguf tensors=272
 * i.e. a UTC timestamp, the level, an event name, then key=value pairs.
 * Lines are written with one write() so concurrent threads never interleave
 * within a line. */
#ifndef AERIE_CORE_LOG_H
#define AERIE_CORE_LOG_H

#include <stdbool.h>

typedef enum log_level {
    LOG_DEBUG = 0,
    LOG_INFO = 1,
    LOG_WARN = 2,
    LOG_ERROR = 3,
    LOG_OFF = 4,
} log_level;

void log_set_level(log_level level);
log_level log_get_level(void);
bool log_enabled(log_level level);

/* Parses "debug", "info", "warn", "error", "off". Returns false otherwise. */
bool log_level_parse(const char *s, log_level *out);
const char *log_level_name(log_level level);

/* Redirects output to fd (default 2). Used by tests. */
void log_set_fd(int fd);

/* fmt is the event name followed by key=value pairs. */
void log_write(log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define LOG_DEBUGF(...) \
    do { \
        if (log_enabled(LOG_DEBUG)) log_write(LOG_DEBUG, __VA_ARGS__); \
    } while (0)
#define LOG_INFOF(...) log_write(LOG_INFO, __VA_ARGS__)
#define LOG_WARNF(...) log_write(LOG_WARN, __VA_ARGS__)
#define LOG_ERRORF(...) log_write(LOG_ERROR, __VA_ARGS__)

#endif
