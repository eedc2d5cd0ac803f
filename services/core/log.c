#include "log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static _Atomic int g_level = LOG_INFO;
static _Atomic int g_fd = 2;

static const char *const level_names[] = {"debug", "info", "warn", "error", "off"};

void log_set_level(log_level level) { atomic_store(&g_level, (int)level); }
log_level log_get_level(void) { return (log_level)atomic_load(&g_level); }
bool log_enabled(log_level level) { return (int)level >= atomic_load(&g_level); }
void log_set_fd(int fd) { atomic_store(&g_fd, fd); }

const char *log_level_name(log_level level) { return (unsigned)level <= LOG_OFF ? level_names[level] : "?"; }

bool log_level_parse(const char *s, log_level *out) {
    for (int i = 0; i <= LOG_OFF; i++) {
        if (strcmp(s, level_names[i]) == 0) {
            *out = (log_level)i;
            return true;
        }
    }
    return false;
}

void log_write(log_level level, const char *fmt, ...) {
    if (!log_enabled(level) || level >= LOG_OFF) return;
    char line[2048];
    struct timeval tv;
    gettimeofday(&tv, NULL);
    struct tm tm;
    gmtime_r(&tv.tv_sec, &tm);
    int n = snprintf(line, sizeof line, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ %s ", tm.tm_year + 1900, tm.tm_mon + 1,
                     tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, (int)(tv.tv_usec / 1000), level_names[level]);
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof line - 2) len = sizeof line - 2; /* truncated line */
    line[len++] = '\n';
    ssize_t w = write(atomic_load(&g_fd), line, len);
    (void)w; /* nowhere to report a failed log write */
}
