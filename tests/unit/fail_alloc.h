/* tests/unit/fail_alloc.h — drives a suite through every allocation failure point (issue 46).
 *
 * A scenario is a function that runs one piece of the system from nothing back to nothing
 * (create, use, destroy) and copes with any step failing: it returns 0 when what it saw is
 * right — every step either worked or failed with a clean error, and what worked gave the right
 * answer — and nonzero (after saying why on stderr) otherwise. tu_fail_alloc_loop runs it in a
 * fresh process of this binary for n = 1, 2, ... with allocation n failing (fail_alloc.c), until a
 * run allocates fewer than n times. Each run must exit cleanly: no crash, no sanitizer report
 * (ASan's leak check runs at the child's exit), no completion lost ("BUG:" in its log), the fd
 * count back where it was. A suite links fail_alloc.c with the --wrap flags (CMake:
 * pd_add_fail_alloc) and calls tu_fail_alloc_child first thing in main. */
#ifndef PD_TEST_FAIL_ALLOC_H
#define PD_TEST_FAIL_ALLOC_H

#include <stdbool.h>

/* fail_alloc.c: arms allocation n to fail (0: none); what happened since. */
void tu_fail_alloc_arm(long n);
bool tu_fail_alloc_hit(void);
long tu_fail_alloc_count(void);

#ifdef PD_TEST_UTIL_H /* the driver, for suites (test_util.h first) */
#include <fcntl.h>
#include <sys/wait.h>

typedef struct tu_fa_scenario {
    const char *name;
    int (*run)(void);
    int (*prepare)(void); /* optional: run before arming (a reference to compare with), 0 when fine */
} tu_fa_scenario_t;

enum { TU_FA_HIT = 0, TU_FA_WRONG = 1, TU_FA_FDS = 2, TU_FA_DONE = 3, TU_FA_UNKNOWN = 4 };

/* In a child of tu_fail_alloc_loop (PD_FAIL_ALLOC_SCENARIO and PD_FAIL_ALLOC_AT set): runs that
 * scenario armed and exits (TU_FA_*). Otherwise returns at once. */
static inline void tu_fail_alloc_child(const tu_fa_scenario_t *s, int num)
{
    const char *name = getenv("PD_FAIL_ALLOC_SCENARIO"), *at = getenv("PD_FAIL_ALLOC_AT");
    if (name == NULL || at == NULL) {
        return;
    }
    for (int i = 0; i < num; i++) {
        if (strcmp(s[i].name, name) != 0) {
            continue;
        }
        if (s[i].prepare != NULL && s[i].prepare() != 0) {
            fprintf(stderr, "FAIL-ALLOC %s: its preparation failed\n", name);
            exit(TU_FA_WRONG);
        }
        int fds = tu_count_fds();
        tu_fail_alloc_arm(atol(at));
        int rc = s[i].run();
        bool hit = tu_fail_alloc_hit();
        long count = tu_fail_alloc_count();
        tu_fail_alloc_arm(0);
        int fds_after = tu_count_fds();
        if (rc != 0) {
            fprintf(stderr, "FAIL-ALLOC %s@%s: the scenario saw something wrong (above)\n", name, at);
            exit(TU_FA_WRONG);
        }
        if (fds_after != fds) {
            fprintf(stderr, "FAIL-ALLOC %s@%s: fds %d -> %d\n", name, at, fds, fds_after);
            exit(TU_FA_FDS);
        }
        fprintf(stderr, "FAIL-ALLOC %s@%s: clean (%ld allocations)\n", name, at, count);
        exit(hit ? TU_FA_HIT : TU_FA_DONE); /* exit(): the sanitizers' leak check runs */
    }
    exit(TU_FA_UNKNOWN);
}

/* Adds the suite's loop test tf (looped over its n scenarios) as Check case "fail_alloc" when
 * PD_FAIL_ALLOC_LOOP is set: to a scenario's index (CTest's NAME:fail_alloc:I entries, label
 * failalloc, outside the quick tier), or "all". The suite's plain entry leaves it out. */
static inline void tu_fail_alloc_add(Suite *s, const TTest *tf, int n)
{
    const char *which = getenv("PD_FAIL_ALLOC_LOOP");
    if (which == NULL) {
        return;
    }
    int first = strcmp(which, "all") == 0 ? 0 : atoi(which);
    TCase *tc = tcase_create("fail_alloc");
    tcase_set_timeout(tc, 1500);
    tcase_add_loop_test(tc, tf, first, strcmp(which, "all") == 0 ? n : first + 1);
    suite_add_tcase(s, tc);
}

/* Whether a child's log shows a defect its exit status may not: a lost completion, a sanitizer
 * report (UBSan keeps going by default). */
static inline const char *tu_fa_log_defect(const char *log)
{
    static const char *const marks[] = {"BUG:", "runtime error:", "ERROR: AddressSanitizer",
                                        "ERROR: LeakSanitizer", "WARNING: ThreadSanitizer"};
    for (size_t i = 0; i < sizeof(marks) / sizeof(marks[0]); i++) {
        if (log != NULL && strstr(log, marks[i]) != NULL) {
            return marks[i];
        }
    }
    return NULL;
}

/* Runs scenario name with allocation n failing, n = 1, 2, ... (each in a fresh process, bounded
 * by run_timeout_s) until a run allocates fewer than n times; fails the calling test at the first
 * run that does not end cleanly (its log printed) or past max_points. by_site: each run fails the
 * first allocation from n on at a call site no earlier run failed (fail_alloc.c), and n goes on
 * past it: one run per site. Returns the runs. */
static inline int tu_fail_alloc_loop_(const char *name, int max_points, double run_timeout_s, bool by_site)
{
    char exe[4096];
    ssize_t el = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    ck_assert_int_gt(el, 0);
    exe[el] = 0;
    char log_path[] = "/tmp/pd-test-failalloc-XXXXXX";
    int log_fd = mkstemp(log_path);
    ck_assert_int_ge(log_fd, 0);
    double t0 = tu_now();
    size_t sites_cap = 1 << 16;
    char *sites = by_site ? calloc(1, sites_cap) : NULL; /* "hex,hex,..." */
    long at = 1;
    for (int n = 1; n <= max_points; n++, at++) {
        ck_assert_int_eq(ftruncate(log_fd, 0), 0);
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
            char at_s[32];
            snprintf(at_s, sizeof(at_s), "%ld", at);
            setenv("PD_FAIL_ALLOC_SCENARIO", name, 1);
            setenv("PD_FAIL_ALLOC_AT", at_s, 1);
            if (sites != NULL) {
                setenv("PD_FAIL_ALLOC_SITES", sites, 1);
            }
            lseek(log_fd, 0, SEEK_SET);
            dup2(log_fd, 1);
            dup2(log_fd, 2);
            execl(exe, exe, (char *)NULL);
            _exit(127);
        }
        int status = 0;
        double end = tu_now() + run_timeout_s;
        pid_t w;
        while ((w = waitpid(pid, &status, WNOHANG)) == 0 && tu_now() < end) {
            usleep(2000);
        }
        bool hung = w == 0;
        if (hung) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
        }
        size_t len = 0;
        char *log = tu_read_file(log_path, &len);
        const char *defect = tu_fa_log_defect(log);
        int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        const char *hit = log != NULL && sites != NULL ? strstr(log, "FAIL-ALLOC-SITE ") : NULL;
        long hit_n = 0;
        unsigned long hit_site = 0;
        if (hit != NULL && sscanf(hit, "FAIL-ALLOC-SITE %ld %lx", &hit_n, &hit_site) == 2) {
            at = hit_n; /* the next run starts after it */
            size_t used = strlen(sites);
            ck_assert_uint_lt(used + 20, sites_cap);
            snprintf(sites + used, sites_cap - used, "%s%lx", used > 0 ? "," : "", hit_site);
        }
        bool ok = !hung && defect == NULL && (code == TU_FA_HIT || code == TU_FA_DONE);
        if (!ok) {
            const char *tail = log != NULL && len > 6000 ? log + len - 6000 : log;
            fprintf(stderr, "---- %s, allocation %ld failing: log tail\n%s\n----\n", name, at,
                    tail != NULL ? tail : "");
        }
        free(log);
        ck_assert_msg(ok, "%s with allocation %ld failing: %s", name, at,
                      hung                    ? "hung (killed)"
                      : defect != NULL        ? defect
                      : WIFSIGNALED(status)   ? strsignal(WTERMSIG(status))
                      : code == TU_FA_WRONG   ? "a wrong result"
                      : code == TU_FA_FDS     ? "fds leaked"
                      : code == TU_FA_UNKNOWN ? "no such scenario"
                                              : "a sanitizer's exit status");
        if (code == TU_FA_DONE) {
            close(log_fd);
            unlink(log_path);
            free(sites);
            fprintf(stderr, "fail-alloc %s: %d allocation failure %s, each clean (%.1f s)\n", name, n - 1,
                    by_site ? "sites" : "points", tu_now() - t0);
            return n - 1;
        }
    }
    close(log_fd);
    unlink(log_path);
    free(sites);
    ck_assert_msg(false, "%s: more than %d allocation %s", name, max_points, by_site ? "sites" : "points");
    return max_points;
}

/* Every allocation failure point, one run each. */
static inline int tu_fail_alloc_loop(const char *name, int max_points, double run_timeout_s)
{
    return tu_fail_alloc_loop_(name, max_points, run_timeout_s, false);
}

/* Every allocation call site (two frames deep), one run each. */
static inline int tu_fail_alloc_sites(const char *name, int max_sites, double run_timeout_s)
{
    return tu_fail_alloc_loop_(name, max_sites, run_timeout_s, true);
}
#endif

#endif
