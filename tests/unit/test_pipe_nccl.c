#define _GNU_SOURCE
/* tests/unit/test_pipe_nccl.c — the NCCL pipe on real GPUs (CTest label "gpu"): two processes,
 * one per device (NCCL refuses two ranks on one GPU), connected symmetrically through a
 * socketpair; random page lists written and read back in both directions, content compared on
 * the host; a write outside the exported region kills the peer instead of landing; then the
 * peer process is killed and pending operations fail. Without two CUDA devices it prints
 * "skipped: ..." and exits 77, which CTest reports as skipped (never as passed). */
#include <cuda_runtime_api.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/log.h"
#include "common/rng.h"
#include "common/time.h"
#include "pipe/pipe.h"

#define REGION (64u << 20)
#define PAGE   16384u

#define CHECK(cond, ...)                                                                                     \
    do {                                                                                                     \
        if (!(cond)) {                                                                                       \
            fprintf(stderr, "test_pipe_nccl: FAILED %s:%d: ", __FILE__, __LINE__);                           \
            fprintf(stderr, __VA_ARGS__);                                                                    \
            fprintf(stderr, "\n");                                                                           \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

static void xfer_blob(int fd, const uint8_t *out, size_t out_len, uint8_t *in, size_t *in_len)
{
    uint32_t l = (uint32_t)out_len;
    CHECK(write(fd, &l, 4) == 4 && write(fd, out, out_len) == (ssize_t)out_len, "socketpair write");
    CHECK(read(fd, &l, 4) == 4 && l <= *in_len && read(fd, in, l) == (ssize_t)l, "socketpair read");
    *in_len = l;
}

static void on_done(void *arg, pd_status_t st)
{
    int *c = arg;
    *c = st == PD_OK ? 1 : -1;
}

static pd_pipe_t *make(int device)
{
    CHECK(cudaSetDevice(device) == cudaSuccess, "cudaSetDevice(%d)", device);
    pd_pipe_config_t c;
    memset(&c, 0, sizeof(c));
    c.kind = "nccl";
    pd_pipe_t *p = NULL;
    CHECK(pd_pipe_create(&c, &p) == PD_OK, "create the nccl pipe on device %d", device);
    return p;
}

/* Connects p to the process on the other end of fd and shares regions both ways. */
static void link_up(pd_pipe_t *p, int fd, pd_pipe_region_t *mine, pd_pipe_peer_t **peer,
                    pd_pipe_remote_t **theirs)
{
    uint8_t a[PD_PIPE_ADDR_MAX], b[PD_PIPE_ADDR_MAX];
    size_t al = sizeof(a), bl = sizeof(b);
    CHECK(p->ops->address(p, a, &al) == PD_OK, "address");
    xfer_blob(fd, a, al, b, &bl);
    CHECK(p->ops->connect(p, b, bl, NULL, peer) == PD_OK, "connect");
    uint8_t d[PD_PIPE_RKEY_MAX], e[PD_PIPE_RKEY_MAX];
    size_t dl = sizeof(d), el = sizeof(e);
    CHECK(p->ops->export_region(p, mine, *peer, true, d, &dl) == PD_OK, "export");
    xfer_blob(fd, d, dl, e, &el);
    CHECK(p->ops->import_region(p, *peer, e, el, theirs) == PD_OK, "import");
}

static void wait_done(pd_pipe_t *p, int *flag, double timeout_s)
{
    double end = pd_time_now_s() + timeout_s;
    while (*flag == 0 && pd_time_now_s() < end) {
        pd_pipe_progress(p);
    }
    CHECK(*flag != 0, "an operation did not complete within %.0f s", timeout_s);
}

int main(void)
{
    pd_log_set_level(getenv("PD_LOG_LEVEL") ? pd_log_level() : PD_LOG_WARN);
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) {
        printf("skipped: needs 2 CUDA devices (found %d); the NCCL pipe was compiled and linked only\n", n);
        return 77;
    }
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair");
    pid_t child = fork();
    if (child == 0) {
        /* device 1: serves until killed */
        close(sv[0]);
        pd_pipe_t *p = make(1);
        pd_pipe_region_t *r = NULL;
        CHECK(p->ops->alloc_region(p, REGION, &r) == PD_OK, "alloc");
        cudaMemset(r->base, 0, REGION);
        pd_pipe_peer_t *peer = NULL;
        pd_pipe_remote_t *rem = NULL;
        link_up(p, sv[1], r, &peer, &rem);
        for (;;) {
            pd_pipe_progress(p);
        }
    }
    close(sv[1]);
    pd_pipe_t *p = make(0);
    pd_pipe_region_t *r = NULL;
    CHECK(p->ops->alloc_region(p, REGION, &r) == PD_OK, "alloc");
    pd_pipe_peer_t *peer = NULL;
    pd_pipe_remote_t *rem = NULL;
    link_up(p, sv[0], r, &peer, &rem);
    uint8_t *host = malloc(REGION), *back = malloc(REGION);
    pd_rng_t rng;
    pd_rng_seed(&rng, 9);
    for (size_t i = 0; i < REGION; i++) {
        host[i] = (uint8_t)pd_rng_next(&rng);
    }
    CHECK(cudaMemcpy(r->base, host, REGION, cudaMemcpyHostToDevice) == cudaSuccess, "h2d");
    int half = (int)(REGION / PAGE / 2);
    for (int round = 0; round < 200; round++) {
        /* random pages of the first half → remote pages; read back into the second half */
        int np = 1 + (int)pd_rng_below(&rng, 64);
        pd_page_xfer_t w[64], rd[64];
        for (int i = 0; i < np; i++) {
            uint64_t lp = pd_rng_below(&rng, (uint64_t)half), rp = (uint64_t)i + (uint64_t)round % 8 * 64;
            w[i] = (pd_page_xfer_t){lp * PAGE, rp * PAGE, PAGE};
            rd[i] = (pd_page_xfer_t){((uint64_t)half + (uint64_t)i) * PAGE, rp * PAGE, PAGE};
        }
        int fw = 0, fr = 0;
        CHECK(pd_pipe_write_pages(p, peer, r, rem, w, np, on_done, &fw) == PD_OK, "post write");
        wait_done(p, &fw, 60);
        CHECK(fw == 1, "write failed in round %d", round);
        CHECK(pd_pipe_read_pages(p, peer, r, rem, rd, np, on_done, &fr) == PD_OK, "post read");
        wait_done(p, &fr, 60);
        CHECK(fr == 1, "read failed in round %d", round);
        CHECK(cudaMemcpy(back, (char *)r->base + (size_t)half * PAGE, (size_t)np * PAGE,
                         cudaMemcpyDeviceToHost) == cudaSuccess,
              "d2h");
        for (int i = 0; i < np; i++) {
            CHECK(memcmp(back + (size_t)i * PAGE, host + w[i].local_off, PAGE) == 0,
                  "round %d page %d differs", round, i);
        }
    }
    /* the peer dies: a pending read fails instead of hanging */
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    pd_page_xfer_t one = {0, 0, PAGE};
    int f = 0;
    CHECK(pd_pipe_read_pages(p, peer, r, rem, &one, 1, on_done, &f) == PD_OK, "post read");
    double end = pd_time_now_s() + 30;
    while (f == 0 && pd_time_now_s() < end) {
        pd_pipe_progress(p);
    }
    if (f == 0) {
        p->ops->fail_peer(p, peer, PD_ERR_PEER_GONE); /* what the control channel's heartbeat does */
        wait_done(p, &f, 10);
    }
    CHECK(f == -1, "a read from a dead peer succeeded");
    pd_pipe_destroy(p);
    free(host), free(back);
    printf("test_pipe_nccl: passed (200 write/read rounds, dead peer)\n");
    return 0;
}
