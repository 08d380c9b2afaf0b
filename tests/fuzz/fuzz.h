/* tests/fuzz/fuzz.h — what every fuzz target shares. A target defines
 *     int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
 * built two ways: with clang's libFuzzer (`make fuzz`: -fsanitize=fuzzer,address,undefined) to
 * search, and with replay.c's main (every build, `make check`) to run the committed corpus
 * (tests/fuzz/corpus/<target>/) as a regression test. Inputs the fuzzer found crashing join the
 * corpus once fixed. */
#ifndef PD_TESTS_FUZZ_H
#define PD_TESTS_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "common/log.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The input written to a private temporary file (for parsers that take a path); the caller
 * unlinks and frees it. NULL when the file cannot be written. */
static inline char *fuzz_to_file(const uint8_t *data, size_t size, const char *suffix)
{
    char tmpl[64];
    snprintf(tmpl, sizeof(tmpl), "/tmp/pd-fuzz-XXXXXX%s", suffix);
    int fd = mkstemps(tmpl, (int)strlen(suffix));
    if (fd < 0) {
        return NULL;
    }
    size_t off = 0;
    while (off < size) {
        ssize_t w = write(fd, data + off, size - off);
        if (w <= 0) {
            close(fd);
            unlink(tmpl);
            return NULL;
        }
        off += (size_t)w;
    }
    close(fd);
    char *p = malloc(strlen(tmpl) + 1);
    if (p != NULL) {
        memcpy(p, tmpl, strlen(tmpl) + 1);
    }
    return p;
}

#endif
