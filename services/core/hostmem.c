#include "hostmem.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "file.h"

void hostmem_fmt_bytes(uint64_t bytes, char *buf, size_t cap) {
    static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    double v = (double)bytes;
    int u = 0;
    while (v >= 1024.0 && u < 5) {
        v /= 1024.0;
        u++;
    }
    if (u == 0 || v == floor(v))
        snprintf(buf, cap, "%.0f %s", v, unit[u]);
    else if (v < 10.0)
        snprintf(buf, cap, "%.2f %s", v, unit[u]);
    else if (v < 100.0)
        snprintf(buf, cap, "%.1f %s", v, unit[u]);
    else
        snprintf(buf, cap, "%.0f %s", v, unit[u]);
}

uint64_t hostmem_share(uint64_t available, uint64_t ppm) {
    return available / 1000000u * ppm + available % 1000000u * ppm / 1000000u;
}

double hostmem_auto_fraction(uint64_t available) {
    if (available == 0) return 0.0;
    uint64_t reserve = available / 100u * HOSTMEM_RESERVE_PCT;
    if (reserve < HOSTMEM_RESERVE_MIN) reserve = HOSTMEM_RESERVE_MIN;
    if (available <= reserve) return 0.0;
    /* An estimate in double, then settled exactly on the integer budget. */
    uint64_t left = available - reserve;
    uint64_t milli = (uint64_t)floor(1000.0 * (double)left / (double)available);
    if (milli > 1000u) milli = 1000u;
    while (milli < 1000u && hostmem_share(available, (milli + 1u) * 1000u) <= left) milli++;
    while (milli > 0 && hostmem_share(available, milli * 1000u) > left) milli--;
    return (double)milli / 1000.0;
}

int hostmem_parse_meminfo(const char *text, uint64_t *bytes, ae_error *err) {
    *bytes = 0;
    const char *p = text;
    while (p && *p) {
        if (!strncmp(p, "MemAvailable:", 13)) {
            char *end;
            errno = 0;
            unsigned long long kb = strtoull(p + 13, &end, 10);
            while (*end == ' ') end++;
            if (errno || end == p + 13 || strncmp(end, "kB", 2) != 0 || kb > UINT64_MAX / 1024u)
                return err_set(err, "meminfo: cannot read the MemAvailable line");
            *bytes = (uint64_t)kb * 1024u;
            return AE_OK;
        }
        p = strchr(p, '\n');
        if (p) p++;
    }
    return err_set(err, "meminfo: no MemAvailable line");
}

int hostmem_available(uint64_t *bytes, ae_error *err) {
    char *text;
    size_t len;
    *bytes = 0;
    if (file_read_all("/proc/meminfo", 1 << 16, &text, &len, NULL, err) != AE_OK) return AE_ERR;
    int rc = hostmem_parse_meminfo(text, bytes, err);
    free(text);
    if (rc != AE_OK) err_prefix(err, "/proc/");
    return rc;
}
