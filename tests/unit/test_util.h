/* tests/unit/test_util.h — helpers shared by the unit suites: temp dirs, running tools with a
 * time bound, locating the source/build trees and a python3 with numpy. */
#ifndef PD_TEST_UTIL_H
#define PD_TEST_UTIL_H

#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static inline const char *tu_source_dir(void)
{
    const char *s = getenv("PD_SOURCE_DIR");
    return s != NULL ? s : ".";
}

static inline const char *tu_binary_dir(void)
{
    const char *s = getenv("PD_BINARY_DIR");
    return s != NULL ? s : "build";
}

/* Creates a fresh directory under /tmp; returns a static-lifetime string (strdup). */
static inline char *tu_mkdtemp(const char *tag)
{
    char tmpl[256];
    snprintf(tmpl, sizeof(tmpl), "/tmp/pd-test-%s-XXXXXX", tag);
    char *d = mkdtemp(tmpl);
    return d != NULL ? strdup(d) : NULL;
}

/* Runs a shell command (bounded by `timeout`), returns its exit status. */
static inline int tu_run(int timeout_s, const char *fmt, ...)
{
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof(cmd), fmt, ap);
    va_end(ap);
    char full[8400];
    snprintf(full, sizeof(full), "timeout -k 5 %d sh -c '%s'", timeout_s, cmd);
    int rc = system(full);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

/* A python3 that can import numpy (Debian's /usr/bin/python3 first), or NULL. */
static inline const char *tu_python_numpy(void)
{
    static const char *cands[] = {"/usr/bin/python3", "python3"};
    for (size_t i = 0; i < sizeof(cands) / sizeof(cands[0]); i++) {
        char cmd[256];
        snprintf(cmd, sizeof(cmd), "%s -c \"import numpy\" >/dev/null 2>&1", cands[i]);
        if (system(cmd) == 0) {
            return cands[i];
        }
    }
    return NULL;
}

/* Writes a pd-mkmodel model into a new temp dir and returns its path. */
static inline char *tu_make_model(const char *args)
{
    char *dir = tu_mkdtemp("model");
    if (dir == NULL) {
        return NULL;
    }
    int rc = tu_run(120, "PD_LOG_LEVEL=warn %s/bin/pd-mkmodel --out %s %s", tu_binary_dir(), dir, args);
    if (rc != 0) {
        free(dir);
        return NULL;
    }
    return dir;
}

static inline void tu_rmrf(const char *dir)
{
    if (dir != NULL && strncmp(dir, "/tmp/pd-test-", 13) == 0) {
        tu_run(60, "rm -rf %s", dir);
    }
}

/* Reads a whole file; *len_out bytes; caller frees. */
static inline void *tu_read_file(const char *path, size_t *len_out)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        return NULL;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    void *buf = malloc((size_t)n + 1);
    if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        fclose(f);
        return NULL;
    }
    ((char *)buf)[n] = 0;
    fclose(f);
    *len_out = (size_t)n;
    return buf;
}

static inline int tu_write_file(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (f == NULL) {
        return -1;
    }
    int ok = fwrite(data, 1, len, f) == len;
    return fclose(f) == 0 && ok ? 0 : -1;
}

#endif
