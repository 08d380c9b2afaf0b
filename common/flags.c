/* common/flags.c — getopt_long over a flag table. */
#define _GNU_SOURCE
#include "common/flags.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

pd_status_t pd_flags_parse_size(const char *s, size_t *out)
{
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || errno != 0 || !(v >= 0) || isinf(v)) {
        return PD_ERR_INVALID_ARG;
    }
    double mul = 1;
    switch (*end) {
    case 'k':
    case 'K':
        mul = 1024.0;
        end++;
        break;
    case 'm':
    case 'M':
        mul = 1024.0 * 1024;
        end++;
        break;
    case 'g':
    case 'G':
        mul = 1024.0 * 1024 * 1024;
        end++;
        break;
    case 't':
    case 'T':
        mul = 1024.0 * 1024 * 1024 * 1024;
        end++;
        break;
    default: break;
    }
    if (mul > 1 && *end == 'i') {
        end++;
    }
    if (*end == 'B' || *end == 'b') {
        end++;
    }
    if (*end != '\0') {
        return PD_ERR_INVALID_ARG;
    }
    double bytes = v * mul;
    if (bytes >= 18446744073709551615.0) {
        return PD_ERR_INVALID_ARG;
    }
    *out = (size_t)bytes;
    return PD_OK;
}

static int flag_choice_ok(const char *choices, const char *v)
{
    size_t vl = strlen(v);
    const char *p = choices;
    while (*p != '\0') {
        const char *bar = strchr(p, '|');
        size_t n = bar != NULL ? (size_t)(bar - p) : strlen(p);
        if (n == vl && strncmp(p, v, n) == 0) {
            return 1;
        }
        if (bar == NULL) {
            break;
        }
        p = bar + 1;
    }
    return 0;
}

static pd_status_t flag_set(const pd_flag_t *f, const char *v)
{
    char *end = NULL;
    errno = 0;
    switch (f->type) {
    case PD_FLAG_BOOL: *(bool *)f->dst = true; return PD_OK;
    case PD_FLAG_INT: {
        long x = strtol(v, &end, 10);
        if (end == v || *end != '\0' || errno != 0 || x < INT32_MIN || x > INT32_MAX) {
            break;
        }
        *(int *)f->dst = (int)x;
        return PD_OK;
    }
    case PD_FLAG_INT64: {
        long long x = strtoll(v, &end, 10);
        if (end == v || *end != '\0' || errno != 0) {
            break;
        }
        *(int64_t *)f->dst = x;
        return PD_OK;
    }
    case PD_FLAG_DOUBLE: {
        double x = strtod(v, &end);
        if (end == v || *end != '\0' || errno != 0 || isnan(x)) {
            break;
        }
        *(double *)f->dst = x;
        return PD_OK;
    }
    case PD_FLAG_STR: *(const char **)f->dst = v; return PD_OK;
    case PD_FLAG_SIZE:
        if (pd_flags_parse_size(v, (size_t *)f->dst) != PD_OK) {
            break;
        }
        return PD_OK;
    case PD_FLAG_CHOICE:
        if (!flag_choice_ok(f->choices, v)) {
            pd_log_error("--%s: '%s' is not one of %s", f->name, v, f->choices);
            return PD_ERR_INVALID_ARG;
        }
        *(const char **)f->dst = v;
        return PD_OK;
    case PD_FLAG_STRS: { /* the first value; pd_flags_parse appends the ones that follow */
        pd_flag_strs_t *l = f->dst;
        l->v[0] = v;
        l->n = 1;
        return PD_OK;
    }
    case PD_FLAG_GROUP: break; /* never an option (pd_flags_parse skips it) */
    }
    pd_log_error("--%s: invalid value '%s'", f->name, v);
    return PD_ERR_INVALID_ARG;
}

static void flag_default(const pd_flag_t *f, char *buf, size_t len)
{
    switch (f->type) {
    case PD_FLAG_BOOL: snprintf(buf, len, "%s", *(bool *)f->dst ? "true" : "false"); break;
    case PD_FLAG_INT: snprintf(buf, len, "%d", *(int *)f->dst); break;
    case PD_FLAG_INT64: snprintf(buf, len, "%" PRId64, *(int64_t *)f->dst); break;
    case PD_FLAG_DOUBLE: snprintf(buf, len, "%g", *(double *)f->dst); break;
    case PD_FLAG_SIZE: snprintf(buf, len, "%zu", *(size_t *)f->dst); break;
    case PD_FLAG_STR:
    case PD_FLAG_CHOICE: {
        const char *s = *(const char **)f->dst;
        size_t nl = strlen(f->name);
        bool secret = nl >= 7 && strcmp(f->name + nl - 7, "api-key") == 0; /* from the environment */
        snprintf(buf, len, "%s", s == NULL ? "(none)" : secret ? "(set, not shown)" : s);
        break;
    }
    case PD_FLAG_STRS: {
        const pd_flag_strs_t *l = f->dst;
        size_t k = 0;
        buf[0] = '\0';
        for (int i = 0; i < l->n && k < len; i++) {
            k += (size_t)snprintf(buf + k, len - k, "%s%s", i > 0 ? " " : "", l->v[i]);
        }
        if (l->n == 0) {
            snprintf(buf, len, "(none)");
        }
        break;
    }
    case PD_FLAG_GROUP: buf[0] = '\0'; break;
    }
}

void pd_flags_print_help(const pd_flag_t *flags, size_t n, const char *usage, FILE *out)
{
    fprintf(out, "%s\n", usage);
    if (n == 0 || flags[0].type != PD_FLAG_GROUP) {
        fprintf(out, "\nOptions:\n");
    }
    for (size_t i = 0; i < n; i++) {
        const pd_flag_t *f = &flags[i];
        if (f->type == PD_FLAG_GROUP) {
            fprintf(out, "\n%s:\n", f->name);
            continue;
        }
        char def[128];
        flag_default(f, def, sizeof(def));
        char head[96];
        if (f->type == PD_FLAG_BOOL) {
            snprintf(head, sizeof(head), "--%s, --no-%s", f->name, f->name);
        } else if (f->type == PD_FLAG_CHOICE) {
            snprintf(head, sizeof(head), "--%s {%s}", f->name, f->choices);
        } else if (f->type == PD_FLAG_STRS) {
            snprintf(head, sizeof(head), "--%s VALUE [VALUE ...]", f->name);
        } else {
            snprintf(head, sizeof(head), "--%s VALUE", f->name);
        }
        fprintf(out, "  %-34s %s (default: %s)\n", head, f->help, def);
    }
    fprintf(out, "\n  %-34s %s\n", "--help", "show this help and exit");
}

pd_status_t pd_flags_parse(const pd_flag_t *flags, size_t n, int argc, char **argv, const char *usage,
                           int *first_arg_out)
{
    /* bool flags get a second entry "no-NAME"; index n*2 is --help */
    struct option *opts = calloc(2 * n + 2, sizeof(*opts));
    char **nonames = calloc(n + 1, sizeof(char *));
    pd_status_t st = PD_OK;
    if (opts == NULL || nonames == NULL) {
        st = PD_ERR_NO_MEMORY;
        goto out;
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (flags[i].type == PD_FLAG_GROUP) {
            continue;
        }
        opts[k++] =
            (struct option){flags[i].name, flags[i].type == PD_FLAG_BOOL ? no_argument : required_argument,
                            NULL, (int)(1000 + i)};
        if (flags[i].type == PD_FLAG_BOOL) {
            size_t len = strlen(flags[i].name) + 4;
            nonames[i] = malloc(len);
            if (nonames[i] == NULL) {
                st = PD_ERR_NO_MEMORY;
                goto out;
            }
            snprintf(nonames[i], len, "no-%s", flags[i].name);
            opts[k++] = (struct option){nonames[i], no_argument, NULL, (int)(100000 + i)};
        }
    }
    opts[k++] = (struct option){"help", no_argument, NULL, 'h'};
    opts[k] = (struct option){0, 0, 0, 0};
    optind = 1;
    opterr = 0;
    for (;;) {
        int c = getopt_long(argc, argv, "+h", opts, NULL);
        if (c == -1) {
            break;
        }
        if (c == 'h') {
            pd_flags_print_help(flags, n, usage, stdout);
            st = PD_ERR_CANCELLED;
            goto out;
        }
        if (c >= 100000) {
            *(bool *)flags[c - 100000].dst = false;
            continue;
        }
        if (c >= 1000 && (size_t)(c - 1000) < n) {
            const pd_flag_t *f = &flags[c - 1000];
            st = flag_set(f, optarg);
            if (st != PD_OK) {
                goto out;
            }
            for (pd_flag_strs_t *l = f->dst;
                 f->type == PD_FLAG_STRS && optind < argc && argv[optind][0] != '-';) {
                if (l->n == PD_FLAG_STRS_MAX) {
                    pd_log_error("--%s: at most %d values", f->name, PD_FLAG_STRS_MAX);
                    st = PD_ERR_INVALID_ARG;
                    goto out;
                }
                l->v[l->n++] = argv[optind++];
            }
            continue;
        }
        pd_log_error("unknown or incomplete option '%s' (see --help)", argv[optind - 1]);
        st = PD_ERR_INVALID_ARG;
        goto out;
    }
    if (first_arg_out != NULL) {
        *first_arg_out = optind;
    }
out:
    if (nonames != NULL) {
        for (size_t i = 0; i < n; i++) {
            free(nonames[i]);
        }
    }
    free(nonames);
    free(opts);
    return st;
}
