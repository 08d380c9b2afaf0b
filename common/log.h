/* common/log.h — leveled logging to stderr with timestamps; file:line on warnings and errors.
 * The level comes from PD_LOG_LEVEL (debug|info|warn|error|off, default info), read once. */
#ifndef PD_COMMON_LOG_H
#define PD_COMMON_LOG_H

typedef enum pd_log_level {
    PD_LOG_DEBUG = 0,
    PD_LOG_INFO = 1,
    PD_LOG_WARN = 2,
    PD_LOG_ERROR = 3,
    PD_LOG_OFF = 4,
} pd_log_level_t;

/* Writes one line "2026-11-22T01:02:03.456Z I [file.c:12] message" to stderr when level is
 * enabled. Thread-safe (one write(2) per line). Use the macros below, not this. */
void pd_log_write(pd_log_level_t level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Returns the active level (PD_LOG_LEVEL, parsed on first use). */
pd_log_level_t pd_log_level(void);

/* Overrides the level for this process (tests, --log-level). */
void pd_log_set_level(pd_log_level_t level);

/* Parses "debug|info|warn|error|off"; returns -1 for anything else. */
int pd_log_level_parse(const char *s);

#define pd_log_debug(...) pd_log_write(PD_LOG_DEBUG, __FILE__, __LINE__, __VA_ARGS__)
#define pd_log_info(...)  pd_log_write(PD_LOG_INFO, __FILE__, __LINE__, __VA_ARGS__)
#define pd_log_warn(...)  pd_log_write(PD_LOG_WARN, __FILE__, __LINE__, __VA_ARGS__)
#define pd_log_error(...) pd_log_write(PD_LOG_ERROR, __FILE__, __LINE__, __VA_ARGS__)

#endif
