/* common/log.c — leveled logging. */
#define _GNU_SOURCE
#include "common/log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

static atomic_int g_level = -1;

int pd_log_level_parse(const char *s)
{
    static const char *names[] = {"debug", "info", "warn", "error", "off"};
    for (int i = 0; i < 5; i++) {
        if (strcasecmp(s, names[i]) == 0) {
            return i;
        }
    }
    return -1;
}

pd_log_level_t pd_log_level(void)
{
    int lvl = atomic_load_explicit(&g_level, memory_order_relaxed);
    if (lvl < 0) {
        const char *env = getenv("PD_LOG_LEVEL");
        lvl = env != NULL ? pd_log_level_parse(env) : PD_LOG_INFO;
        if (lvl < 0) {
            lvl = PD_LOG_INFO;
        }
        atomic_store(&g_level, lvl);
    }
    return (pd_log_level_t)lvl;
}

void pd_log_set_level(pd_log_level_t level)
{
    atomic_store(&g_level, (int)level);
}

void pd_log_write(pd_log_level_t level, const char *file, int line, const char *fmt, ...)
{
    if (level < pd_log_level()) {
        return;
    }
    static const char tag[] = {'D', 'I', 'W', 'E'};
    char buf[2048];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    int n = (int)strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &tm);
    n += snprintf(buf + n, sizeof(buf) - (size_t)n, ".%03ldZ %c ", ts.tv_nsec / 1000000, tag[level]);
    if (level >= PD_LOG_WARN) {
        const char *base = strrchr(file, '/');
        /* keep "module/file.c" so a reader can find the line */
        if (base != NULL) {
            const char *p = base;
            while (p > file && p[-1] != '/') {
                p--;
            }
            base = p;
        } else {
            base = file;
        }
        n += snprintf(buf + n, sizeof(buf) - (size_t)n, "[%s:%d] ", base, line);
    }
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf + n, sizeof(buf) - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (m < 0) {
        m = 0;
    }
    n += m;
    if (n > (int)sizeof(buf) - 2) {
        n = (int)sizeof(buf) - 2;
    }
    buf[n++] = '\n';
    ssize_t w = write(STDERR_FILENO, buf, (size_t)n);
    (void)w;
}
