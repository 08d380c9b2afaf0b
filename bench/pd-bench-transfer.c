/* bench/pd-bench-transfer.c — pipe throughput and latency between two processes on this host,
 * with page lists shaped like KV transfers, against baselines measured in the same run:
 *   memcpy of the same page pattern, `ucx_perftest -t ucp_put_bw` at the same message size
 *   (ucx-utils), and a plain TCP socket stream.
 * Goals (issue #5): ucx ≥ 0.9× ucx_perftest and ≥ 0.8× memcpy at ≥ 1 MiB per request; tcp ≥ 0.8×
 * the plain socket; one 16 KiB page write round trip < 50 µs. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/copy.h"
#include "common/flags.h"
#include "common/log.h"
#include "common/rng.h"
#include "common/time.h"
#include "pipe/pipe.h"

/* bytes of each side's pipe region (--region-mib); the KV-shaped one-shot rows want node-sized
 * regions (a demo-model node registers ~2.6 GiB) */
static size_t REGION = 256u << 20;

static char g_rows[64][200];
static int g_nrows;

static void row(const char *name, double v, const char *unit, const char *base_name, double base,
                bool ratio_inv)
{
    char b[64] = "", r[16] = "-";
    if (base > 0) {
        snprintf(b, sizeof(b), "%s %.2f %s", base_name, base, unit);
        snprintf(r, sizeof(r), "%.2fx", ratio_inv ? base / v : v / base);
    }
    snprintf(g_rows[g_nrows++], sizeof(g_rows[0]), "| %s | %.2f %s | %s | %s |", name, v, unit, b, r);
    printf("%-52s %10.2f %-5s %-34s %8s\n", name, v, unit, b, r);
    fflush(stdout);
}

static int xfer_all(int fd, void *buf, size_t n, bool wr)
{
    char *p = buf;
    while (n > 0) {
        ssize_t k = wr ? write(fd, p, n) : read(fd, p, n);
        if (k <= 0) {
            return -1;
        }
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Target process: a pipe with one region, exported read+write; serves until the control socket
 * closes. */
static void target_main(const char *kind, int busy_us, int ctl)
{
    pd_pipe_config_t c = {kind, "127.0.0.1", 0, "none", 0, busy_us};
    pd_pipe_t *p = NULL;
    if (pd_pipe_create(&c, &p) != PD_OK) {
        _exit(1);
    }
    uint8_t a[PD_PIPE_ADDR_MAX], pa[PD_PIPE_ADDR_MAX], d[PD_PIPE_RKEY_MAX];
    size_t al = sizeof(a), dl = sizeof(d);
    p->ops->address(p, a, &al);
    uint32_t l = (uint32_t)al;
    xfer_all(ctl, &l, 4, true);
    xfer_all(ctl, a, al, true);
    xfer_all(ctl, &l, 4, false);
    xfer_all(ctl, pa, l, false);
    pd_pipe_peer_t *peer = NULL;
    p->ops->connect(p, pa, l, NULL, &peer);
    pd_pipe_region_t *r = NULL;
    p->ops->alloc_region(p, REGION, &r);
    memset(r->base, 1, REGION);
    p->ops->export_region(p, r, peer, true, d, &dl);
    l = (uint32_t)dl;
    xfer_all(ctl, &l, 4, true);
    xfer_all(ctl, d, dl, true);
    char x;
    while (read(ctl, &x, 1) > 0) {
    }
    pd_pipe_destroy(p);
    _exit(0);
}

typedef struct link {
    pid_t child;
    int ctl;
    pd_pipe_t *p;
    pd_pipe_peer_t *peer;
    pd_pipe_region_t *local;
    pd_pipe_remote_t *remote;
    int wait_fd; /* >= 0: bytes move on the pipe's own threads; wait on this, do not spin */
} link_t;

/* A pipe of `kind` to a target process; tcp receivers on both sides busy-poll busy_us. */
static int link_open(const char *kind, int busy_us, link_t *L)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
        return -1;
    }
    L->child = fork();
    if (L->child == 0) {
        close(sv[0]);
        target_main(kind, busy_us, sv[1]);
    }
    close(sv[1]);
    L->ctl = sv[0];
    pd_pipe_config_t c = {kind, "127.0.0.1", 0, "none", 0, busy_us};
    if (pd_pipe_create(&c, &L->p) != PD_OK) {
        return -1;
    }
    L->wait_fd = pd_pipe_wait_fd(L->p);
    uint8_t a[PD_PIPE_ADDR_MAX], ta[PD_PIPE_ADDR_MAX], d[PD_PIPE_RKEY_MAX];
    uint32_t l;
    xfer_all(L->ctl, &l, 4, false);
    xfer_all(L->ctl, ta, l, false);
    if (L->p->ops->connect(L->p, ta, l, NULL, &L->peer) != PD_OK) {
        return -1;
    }
    size_t al = sizeof(a);
    L->p->ops->address(L->p, a, &al);
    l = (uint32_t)al;
    xfer_all(L->ctl, &l, 4, true);
    xfer_all(L->ctl, a, al, true);
    xfer_all(L->ctl, &l, 4, false);
    xfer_all(L->ctl, d, l, false);
    if (L->p->ops->import_region(L->p, L->peer, d, l, &L->remote) != PD_OK) {
        return -1;
    }
    L->p->ops->alloc_region(L->p, REGION, &L->local);
    memset(L->local->base, 2, REGION);
    return 0;
}

static void link_close(link_t *L)
{
    L->p->ops->release_remote(L->p, L->remote);
    close(L->ctl);
    waitpid(L->child, NULL, 0);
    pd_pipe_destroy(L->p);
}

static void on_done(void *arg, pd_status_t st)
{
    int *n = arg;
    (*n)++;
    if (st != PD_OK) {
        pd_log_error("transfer failed: %s", pd_status_str(st));
    }
}

/* Page list: n pages of size psz, contiguous or at random block slots of the region. */
static void make_pages(pd_page_xfer_t *pg, int n, size_t psz, bool random_ids, pd_rng_t *r)
{
    int slots = (int)(REGION / psz);
    for (int i = 0; i < n; i++) {
        uint64_t s = random_ids ? pd_rng_below(r, (uint64_t)slots) : (uint64_t)i;
        uint64_t d = random_ids ? pd_rng_below(r, (uint64_t)slots) : (uint64_t)i;
        pg[i] = (pd_page_xfer_t){s * psz, d * psz, psz};
    }
}

/* Waits a little for completions. UCX moves bytes inside progress: spin. The TCP pipe moves them on
 * its own threads: a spinning caller would take a core from them (2 cores here), so call progress
 * (which also takes acks off the sockets) yielding the core in between for up to spin_s, then
 * sleep on the wait fd, as the connector's control thread does (spin_s 0). The spin matters on
 * this VM only for round trips: a sleeping vCPU's wake-up costs 50-150 µs here (guest halt
 * polling is off), more than the round trip itself. */
static void link_wait(link_t *L, double spin_s)
{
    if (pd_pipe_progress(L->p) == 0 && L->wait_fd >= 0) {
        struct pollfd pf = {L->wait_fd, POLLIN, 0};
        double t0 = spin_s > 0 ? pd_time_now_s() : 0;
        while (spin_s > 0 && pd_time_now_s() - t0 < spin_s) {
            if (pd_pipe_progress(L->p) > 0) { /* what a UCX caller does with its worker */
                return;
            }
            sched_yield();
        }
        poll(&pf, 1, 10);
    }
}

/* GB/s of repeated transfers of pg[n] (4 in flight), for about 0.4 s. */
static double pipe_gbps(link_t *L, bool write, const pd_page_xfer_t *pg, int n)
{
    size_t bytes = 0;
    for (int i = 0; i < n; i++) {
        bytes += pg[i].len;
    }
    int done = 0, posted = 0;
    double t0 = pd_time_now_s(), end = t0 + 0.4;
    while (pd_time_now_s() < end || done < posted) {
        while (posted - done < 4 && pd_time_now_s() < end) {
            pd_status_t st =
                write ? pd_pipe_write_pages(L->p, L->peer, L->local, L->remote, pg, n, on_done, &done)
                      : pd_pipe_read_pages(L->p, L->peer, L->local, L->remote, pg, n, on_done, &done);
            if (st != PD_OK) {
                return -1;
            }
            posted++;
        }
        link_wait(L, 0);
    }
    return (double)bytes * posted / (pd_time_now_s() - t0) / 1e9;
}

static double memcpy_gbps(const pd_page_xfer_t *pg, int n, uint8_t *src, uint8_t *dst)
{
    size_t bytes = 0;
    for (int i = 0; i < n; i++) {
        bytes += pg[i].len;
    }
    /* one untimed pass: the pipe's rate is of repeated transfers too, and memory idle since
     * start-up is many times slower on its first touch on this VM (see RESULTS 10:12) */
    for (int i = 0; i < n; i++) {
        memcpy(dst + pg[i].remote_off, src + pg[i].local_off, pg[i].len);
    }
    int iters = 0;
    double t0 = pd_time_now_s();
    while (pd_time_now_s() - t0 < 0.3) {
        for (int i = 0; i < n; i++) {
            memcpy(dst + pg[i].remote_off, src + pg[i].local_off, pg[i].len);
        }
        iters++;
    }
    return (double)bytes * iters / (pd_time_now_s() - t0) / 1e9;
}

/* KV-shaped page list as a decode's read builds it: `layers` layer arrays of `per_layer` pages of
 * psz bytes each, blocks [b0, b0 + nb) of every layer, the same block ids on both sides. */
static int kv_pages(pd_page_xfer_t *pg, int layers, size_t per_layer, size_t psz, size_t b0, int nb)
{
    int n = 0;
    for (int l = 0; l < layers; l++) {
        for (int b = 0; b < nb; b++) {
            uint64_t off = ((uint64_t)l * per_layer + b0 + (uint64_t)b) * psz;
            pg[n++] = (pd_page_xfer_t){off, off, psz};
        }
    }
    return n;
}

/* A handover's transfer as the nodes see it: one read of a KV-shaped page list (8 layers x nb
 * blocks of 16 KiB) from blocks never moved before, waited for alone; GB/s over `trials` fresh
 * ranges. *memcpy_out: the same pattern copied once per fresh range between two region-sized
 * host buffers (src, dst). */
static double kv_once_gbps(link_t *L, int nb, int trials, uint8_t *src, uint8_t *dst, double *memcpy_out)
{
    const int layers = 8;
    const size_t psz = 16384, per_layer = REGION / psz / layers;
    pd_page_xfer_t *pg = malloc((size_t)layers * nb * sizeof(*pg));
    double t_pipe = 0, t_mem = 0;
    size_t bytes = 0;
    int t = 0;
    for (; t < trials && (size_t)(t + 1) * nb <= per_layer; t++) {
        int n = kv_pages(pg, layers, per_layer, psz, (size_t)t * nb, nb);
        int done = 0;
        double t0 = pd_time_now_s();
        if (pd_pipe_read_pages(L->p, L->peer, L->local, L->remote, pg, n, on_done, &done) != PD_OK) {
            break;
        }
        while (done < 1) {
            link_wait(L, 0);
        }
        t_pipe += pd_time_now_s() - t0;
        t0 = pd_time_now_s();
        for (int i = 0; i < n; i++) {
            memcpy(dst + pg[i].local_off, src + pg[i].remote_off, pg[i].len);
        }
        t_mem += pd_time_now_s() - t0;
        bytes += (size_t)n * psz;
    }
    free(pg);
    *memcpy_out = t > 0 ? (double)bytes / t_mem / 1e9 : 0;
    return t > 0 ? (double)bytes / t_pipe / 1e9 : -1;
}

/* Round trip of one 16 KiB page write, µs (mean of 2000). */
static double latency_us(link_t *L, double spin_s)
{
    pd_page_xfer_t pg = {0, 0, 16384};
    int done = 0;
    for (int i = 0; i < 100; i++) {
        pd_pipe_write_pages(L->p, L->peer, L->local, L->remote, &pg, 1, on_done, &done);
        while (done < i + 1) {
            link_wait(L, spin_s);
        }
    }
    done = 0;
    double t0 = pd_time_now_s();
    for (int i = 0; i < 2000; i++) {
        pd_pipe_write_pages(L->p, L->peer, L->local, L->remote, &pg, 1, on_done, &done);
        while (done < i + 1) {
            link_wait(L, spin_s);
        }
    }
    return (pd_time_now_s() - t0) / 2000 * 1e6;
}

/* ucx_perftest ucp_put_bw at message size sz: GB/s, or 0 when the tool is missing. */
static double perftest_gbps(size_t sz)
{
    static int port = 13400;
    port++;
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "timeout 60 ucx_perftest -p %d >/dev/null 2>&1 &", port);
    if (system(cmd) != 0) {
        return 0;
    }
    usleep(300000);
    int iters = sz >= (64u << 20) ? 100 : sz >= (16u << 20) ? 200 : sz >= (1u << 20) ? 2000 : 20000;
    snprintf(cmd, sizeof(cmd),
             "timeout 60 ucx_perftest 127.0.0.1 -p %d -t ucp_put_bw -s %zu -n %d 2>/dev/null", port, sz,
             iters);
    FILE *f = popen(cmd, "r");
    if (f == NULL) {
        return 0;
    }
    char line[512];
    double mbs = 0;
    while (fgets(line, sizeof(line), f) != NULL) {
        double v[8];
        if (strncmp(line, "Final:", 6) == 0 && sscanf(line + 6, "%lf %lf %lf %lf %lf %lf %lf %lf", &v[0],
                                                      &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7]) >= 5) {
            mbs = v[4]; /* average bandwidth, MB/s (2^20 bytes) */
        }
    }
    pclose(f);
    return mbs * 1048576.0 / 1e9;
}

/* A listening socket on 127.0.0.1 and a free port (its address in *a); -1 on failure. */
static int loopback_listener(struct sockaddr_in *a)
{
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    memset(a, 0, sizeof(*a));
    a->sin_family = AF_INET;
    a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t sl = sizeof(*a);
    if (ls < 0 || bind(ls, (struct sockaddr *)a, sizeof(*a)) != 0 || listen(ls, 1) != 0 ||
        getsockname(ls, (struct sockaddr *)a, &sl) != 0) {
        if (ls >= 0) {
            close(ls);
        }
        return -1;
    }
    return ls;
}

/* A plain TCP stream over loopback: GB/s of 1 MiB writes for about 0.5 s, walking through
 * 256 MiB buffers on both sides (as the pipe walks its region), so neither end is cache-resident.
 * Measured beside every tcp row, so the buffers stay at 256 MiB whatever --region-mib says. */
static double socket_gbps(void)
{
    const size_t SOCK_BUF = 256u << 20;
    struct sockaddr_in a;
    int ls = loopback_listener(&a);
    if (ls < 0) {
        return 0;
    }
    pid_t child = fork();
    if (child == 0) {
        int c = accept(ls, NULL, NULL);
        char *big = malloc(SOCK_BUF);
        memset(big, 5, SOCK_BUF); /* first touch: up to 1 s on this VM, so the clock waits for it */
        char ready = 1;
        if (xfer_all(c, &ready, 1, true) != 0) {
            _exit(1);
        }
        size_t off = 0;
        ssize_t r;
        while ((r = read(c, big + off, 1 << 20)) > 0) {
            off = (off + (size_t)r) % (SOCK_BUF - (1 << 20));
        }
        _exit(0);
    }
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    int bufsz = 8 << 20;
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bufsz, sizeof(bufsz));
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd), close(ls);
        kill(child, SIGKILL); /* still in accept */
        waitpid(child, NULL, 0);
        return 0;
    }
    char *buf = malloc(SOCK_BUF);
    memset(buf, 6, SOCK_BUF);
    char ready = 0;
    if (xfer_all(fd, &ready, 1, false) != 0) { /* the reader's buffer is touched */
        close(fd), close(ls);
        waitpid(child, NULL, 0);
        free(buf);
        return 0;
    }
    size_t total = 0, off = 0;
    double t0 = pd_time_now_s();
    while (pd_time_now_s() - t0 < 0.5) {
        if (xfer_all(fd, buf + off, 1 << 20, true) != 0) {
            break;
        }
        total += 1 << 20;
        off = (off + (1 << 20)) % SOCK_BUF;
    }
    double gbps = (double)total / (pd_time_now_s() - t0) / 1e9;
    close(fd);
    close(ls);
    waitpid(child, NULL, 0);
    free(buf);
    return gbps;
}

/* Reads n bytes, polling the socket without blocking (yielding the core between tries). */
static int read_polling(int fd, void *buf, size_t n)
{
    char *p = buf;
    while (n > 0) {
        ssize_t k = recv(fd, p, n, MSG_DONTWAIT);
        if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
            return -1;
        }
        if (k < 0) {
            sched_yield();
            continue;
        }
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Round trip of a plain TCP ping-pong over loopback: 16 KiB one way, 8 bytes back (what one page
 * write and its ack carry), TCP_NODELAY; each end either blocks in read or polls its socket
 * without sleeping (client_polls: the caller's end; server_polls: the echoing end); µs, mean of
 * 2000. */
static double socket_rtt_us(bool client_polls, bool server_polls)
{
    struct sockaddr_in a;
    int ls = loopback_listener(&a);
    if (ls < 0) {
        return 0;
    }
    static char page[16384], ack[8];
    int one = 1;
    pid_t child = fork();
    if (child == 0) {
        int c = accept(ls, NULL, NULL);
        setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        while ((server_polls ? read_polling(c, page, sizeof(page))
                             : xfer_all(c, page, sizeof(page), false)) == 0 &&
               xfer_all(c, ack, sizeof(ack), true) == 0) {
        }
        _exit(0);
    }
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    double us = 0;
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        kill(child, SIGKILL); /* still in accept */
    } else {
        double t0 = 0;
        for (int i = 0; i < 2100; i++) {
            if (i == 100) {
                t0 = pd_time_now_s();
            }
            if (xfer_all(fd, page, sizeof(page), true) != 0 ||
                (client_polls ? read_polling(fd, ack, sizeof(ack)) : xfer_all(fd, ack, sizeof(ack), false)) !=
                    0) {
                break;
            }
        }
        us = (pd_time_now_s() - t0) / 2000 * 1e6;
    }
    close(fd);
    close(ls);
    waitpid(child, NULL, 0);
    return us;
}

/* The plain-socket twin of the pipe's request rows: requests of `up` bytes, each answered with
 * `down` bytes (a write: 16 KiB up, an 8-byte ack down; a read: a 56-byte request up, 16 KiB down),
 * 4 in flight as pipe_gbps keeps them, the caller blocking for answers as the pipe's caller sleeps
 * on its wait fd; GB/s of the larger side, about 0.4 s. */
static double socket_requests_gbps(size_t up, size_t down)
{
    struct sockaddr_in a;
    int ls = loopback_listener(&a);
    if (ls < 0) {
        return 0;
    }
    size_t big = up > down ? up : down;
    char *buf = calloc(1, big);
    if (buf == NULL) {
        close(ls);
        return 0;
    }
    int one = 1;
    pid_t child = fork();
    if (child == 0) {
        int c = accept(ls, NULL, NULL);
        setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        while (xfer_all(c, buf, up, false) == 0 && xfer_all(c, buf, down, true) == 0) {
        }
        _exit(0);
    }
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    double gbps = 0;
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        kill(child, SIGKILL); /* still in accept */
    } else {
        int posted = 0, done = 0;
        double t0 = pd_time_now_s(), end = t0 + 0.4;
        while (pd_time_now_s() < end || done < posted) {
            while (posted - done < 4 && pd_time_now_s() < end) {
                if (xfer_all(fd, buf, up, true) != 0) {
                    goto out;
                }
                posted++;
            }
            if (xfer_all(fd, buf, down, false) != 0) {
                goto out;
            }
            done++;
        }
        gbps = (double)big * posted / (pd_time_now_s() - t0) / 1e9;
    }
out:
    close(fd);
    close(ls);
    waitpid(child, NULL, 0);
    free(buf);
    return gbps;
}

int main(int argc, char **argv)
{
    const char *results = NULL;
    int region_mib = 256;
    bool latency_only = false;
    const char *only = NULL;
    const char *copy = NULL;
    int busy_us = 100;
    pd_flag_t flags[] = {
        {"results", PD_FLAG_STR, &results, "append the table to this markdown file", NULL},
        {"region-mib", PD_FLAG_INT, &region_mib, "MiB of each side's pipe region (a demo-model node: 2616)",
         NULL},
        {"latency-only", PD_FLAG_BOOL, &latency_only, "only the round-trip rows (and their socket baseline)",
         NULL},
        {"only", PD_FLAG_STR, &only,
         "only the page-list rows whose name contains this (e.g. \"tcp write 4096\")", NULL},
        {"tcp-busy-poll-us", PD_FLAG_INT, &busy_us,
         "the third link (tcp, round trips only): its receivers poll this long after serving a request "
         "(pd_pipe_config_t.tcp_busy_poll_us)",
         NULL},
        {"copy", PD_FLAG_STR, &copy,
         "how the ucx pipe copies requests of >= 4 MiB through shared memory: avx2 | sse2 | memcpy "
         "(default: the best the CPU has)",
         NULL},
    };
    pd_status_t st =
        pd_flags_parse(flags, sizeof(flags) / sizeof(flags[0]), argc, argv,
                       "usage: pd-bench-transfer [--results bench/RESULTS.md] [--region-mib N] "
                       "[--latency-only] [--only TEXT] [--copy avx2|sse2|memcpy] [--tcp-busy-poll-us N]",
                       NULL);
    if (st == PD_ERR_CANCELLED) {
        return 0;
    }
    if (st != PD_OK) {
        return 2;
    }
    if (region_mib < 256 || region_mib > (1 << 20)) {
        fprintf(stderr, "pd-bench-transfer: --region-mib must be in [256, 1048576]\n");
        return 2;
    }
    REGION = (size_t)region_mib << 20;
    if (copy != NULL && pd_copy_stream_select(copy) != 0) {
        fprintf(stderr, "pd-bench-transfer: --copy %s is unknown or this CPU cannot run it\n", copy);
        return 2;
    }
    pd_log_set_level(PD_LOG_WARN);
    signal(SIGPIPE, SIG_IGN);
    uint8_t *src = malloc(REGION), *dst = malloc(REGION);
    memset(src, 3, REGION);
    memset(dst, 4, REGION);
    /* dst is only ever written: without this the compiler may drop its memset, and the memcpy
     * baselines would then pay first-touch page faults (~10 µs per 4 KiB page on this VM) */
    __asm__ volatile("" : : "r"(src), "r"(dst) : "memory");
    pd_rng_t rng;
    pd_rng_seed(&rng, 1);
    pd_page_xfer_t *pg = malloc(4096 * sizeof(*pg));
    struct {
        size_t psz;
        int n;
        bool random_ids;
    } cases[] = {{16384, 1, false},    {16384, 64, true},     {16384, 4096, true},
                 {16384, 4096, false}, {262144, 64, true},    {1u << 20, 1, false},
                 {1u << 20, 16, true}, {1u << 20, 16, false}, {1u << 20, 64, false}};
    /* the third link: tcp with busy-polling receivers, for the round trips only */
    const char *kinds[] = {"ucx", "tcp", "tcp"};
    printf("%-52s %10s %-5s %-34s %8s\n", "benchmark", "result", "", "baseline (same run)", "ratio");
    double sock = latency_only || only != NULL ? 0 : socket_gbps();
    for (int k = 0; k < 3; k++) {
        link_t L;
        memset(&L, 0, sizeof(L));
        bool busy = k == 2;
        if (busy && (busy_us <= 0 || only != NULL)) {
            continue; /* round trips only; not asked for */
        }
        if (link_open(kinds[k], busy ? busy_us : 0, &L) != 0) {
            pd_log_error("cannot set up the %s link", kinds[k]);
            continue;
        }
        for (size_t c = 0; !latency_only && !busy && c < sizeof(cases) / sizeof(cases[0]); c++) {
            make_pages(pg, cases[c].n, cases[c].psz, cases[c].random_ids, &rng);
            /* ucx_perftest moves one message of the request's size, again and again from one buffer:
             * a 1 MiB message stays in cache while a request's pages walk the region (see RESULTS) */
            size_t msg = cases[c].psz * (size_t)cases[c].n;
            for (int w = 1; w >= 0; w--) {
                char name[128];
                snprintf(name, sizeof(name), "%s %s %d x %zu KiB %s", kinds[k], w ? "write" : "read",
                         cases[c].n, cases[c].psz / 1024, cases[c].random_ids ? "random" : "contiguous");
                if (only != NULL && strstr(name, only) == NULL) {
                    continue;
                }
                double g = pipe_gbps(&L, w, pg, cases[c].n);
                if (k == 0) {
                    double m = memcpy_gbps(pg, cases[c].n, src, dst);
                    row(name, g, "GB/s", "memcpy", m, false);
                    if (w && msg <= (64u << 20)) {
                        double pt = perftest_gbps(msg);
                        char n2[128];
                        snprintf(n2, sizeof(n2), "  vs ucx_perftest put_bw at %zu KiB", msg / 1024);
                        row(n2, g, "GB/s", "ucx_perftest", pt, false);
                    }
                } else {
                    /* the socket baseline next to each row: this VM's loopback varies ±30% over
                     * a minute, more than the differences being measured */
                    row(name, g, "GB/s", "plain socket", socket_gbps(), false);
                    if (cases[c].n == 1 && msg <= (1u << 20)) {
                        /* one request at a time: the socket's twin is requests and answers too */
                        char n2[128];
                        snprintf(n2, sizeof(n2), "  vs plain socket %zu KiB %s, 4 in flight", msg / 1024,
                                 w ? "writes, each acked" : "requests, each answered");
                        row(n2, g, "GB/s", "socket requests", socket_requests_gbps(w ? msg : 56, w ? 8 : msg),
                            false); /* 56: a read request */
                    }
                }
            }
        }
        /* last, so the pipe's background warm-up of the peer mapping has long finished */
        for (int nb = 127; !latency_only && !busy && only == NULL && nb <= 511; nb += 384) {
            double m = 0, g = kv_once_gbps(&L, nb, 4, src, dst, &m);
            char name[128];
            snprintf(name, sizeof(name), "%s read once, 8 layers x %d x 16 KiB (%.0f MiB), fresh blocks",
                     kinds[k], nb, nb * 8 * 16384.0 / 1048576);
            row(name, g, "GB/s", "memcpy once", m, false);
        }
        /* tcp twice per link: the caller polling progress (yielding) as a UCX caller polls its
         * worker, and sleeping on the wait fd as the connector's control thread does. Beside each,
         * the plain socket ping-pong whose ends wait the same way: the caller's end as the caller,
         * the echoing end as the pipe's receiver thread (asleep in epoll, or busy-polling) */
        for (int sleeping = 0; only == NULL && sleeping <= (k >= 1); sleeping++) {
            char lname[128];
            char bp[48] = "";
            if (busy) {
                snprintf(bp, sizeof(bp), ", receivers poll %d us", busy_us);
            }
            snprintf(lname, sizeof(lname), "%s 1 x 16 KiB write round trip%s%s", kinds[k],
                     k == 0     ? ""
                     : sleeping ? ", caller sleeps"
                                : ", caller polls",
                     bp);
            double rt = latency_us(&L, sleeping ? 0 : 0.001);
            row(lname, rt, "us", "goal", 50.0, true);
            if (k >= 1) {
                char bname[128];
                snprintf(bname, sizeof(bname), "  vs a plain socket 16 KiB ping-pong, caller %s, echo %s",
                         sleeping ? "blocks" : "polls", busy ? "polls" : "blocks");
                row(bname, rt, "us", "socket", socket_rtt_us(!sleeping, busy), true);
            }
        }
        link_close(&L);
    }
    if (results != NULL) {
        FILE *f = fopen(results, "a");
        if (f != NULL) {
            time_t now = time(NULL);
            char date[64];
            strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", gmtime(&now));
            struct utsname u;
            uname(&u);
            char sockline[64] = "";
            if (sock > 0) { /* measured unless the run was narrowed */
                snprintf(sockline, sizeof(sockline), " Plain socket stream %.2f GB/s.", sock);
            }
            fprintf(f, "\n## pd-bench-transfer — %s\n\nCommand: `", date);
            for (int i = 0; i < argc; i++) {
                fprintf(f, "%s%s", i ? " " : "", argv[i]);
            }
            fprintf(f,
                    "`  \nMachine: %s %s, %ld cores; two processes on this host; ucx error mode none; ucx "
                    "copies of >= 4 MiB: %s.%s\n\n"
                    "| benchmark | result | baseline (same run) | ratio |\n|---|---|---|---|\n",
                    u.sysname, u.machine, sysconf(_SC_NPROCESSORS_ONLN), pd_copy_stream_kind(), sockline);
            for (int i = 0; i < g_nrows; i++) {
                fprintf(f, "%s\n", g_rows[i]);
            }
            fclose(f);
        }
    }
    free(src), free(dst), free(pg);
    return 0;
}
