/* common/flags.h — command-line flags from one table: getopt_long parsing and a generated --help.
 * Defaults are whatever the destination variables hold before parsing; --help prints them. */
#ifndef PD_COMMON_FLAGS_H
#define PD_COMMON_FLAGS_H

#include <stddef.h>
#include <stdio.h>

#include "common/status.h"

typedef enum pd_flag_type {
    PD_FLAG_BOOL,   /* bool *; "--x" sets true, "--no-x" sets false */
    PD_FLAG_INT,    /* int * */
    PD_FLAG_INT64,  /* int64_t * */
    PD_FLAG_DOUBLE, /* double * */
    PD_FLAG_STR,    /* const char ** (points into argv) */
    PD_FLAG_SIZE,   /* size_t *; accepts 123, 64K, 1.5G, 2GiB (binary units) */
    PD_FLAG_CHOICE, /* const char **; value must be one of choices ("a|b|c") */
    PD_FLAG_GROUP,  /* not a flag: --help starts a section titled name with the entries after it */
    PD_FLAG_STRS,   /* pd_flag_strs_t *; one or more values, as argparse's nargs="+": "--x a b c" takes
                     * the arguments up to the next one that starts with '-' (end a list before
                     * positional arguments with "--"); a later --x replaces the list */
} pd_flag_type_t;

#define PD_FLAG_STRS_MAX 8
typedef struct pd_flag_strs {
    const char *v[PD_FLAG_STRS_MAX]; /* point into argv */
    int n;
} pd_flag_strs_t;

typedef struct pd_flag {
    const char *name; /* long name without dashes: "block-size" (PD_FLAG_GROUP: the section title) */
    pd_flag_type_t type;
    void *dst;
    const char *help;
    const char *choices; /* PD_FLAG_CHOICE only */
} pd_flag_t;

/* Parses argv against flags[n]. On "--help" prints usage + the table to stdout and returns
 * PD_ERR_CANCELLED (callers exit 0). Unknown flags and bad values are logged and give
 * PD_ERR_INVALID_ARG. *first_arg_out (may be NULL) receives the index of the first positional. */
pd_status_t pd_flags_parse(const pd_flag_t *flags, size_t n, int argc, char **argv, const char *usage,
                           int *first_arg_out);

/* Prints the help text for flags[n] to out. */
void pd_flags_print_help(const pd_flag_t *flags, size_t n, const char *usage, FILE *out);

/* Parses a byte size with optional K/M/G/T suffix (binary multiples, "iB"/"B" allowed).
 * PD_ERR_INVALID_ARG on junk or overflow. */
pd_status_t pd_flags_parse_size(const char *s, size_t *out);

#endif
