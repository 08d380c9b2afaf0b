/* tests/fuzz/fuzz_tcp_replies.c — the tcp pipe's replies as a hostile peer sends them: the input is
 * the byte stream that comes back on the connection a pipe dialled (where only the acks of its
 * writes and the responses to its reads may travel), read by the pipe's own progress
 * (read_replies) as a caller's does. Per input, a fresh peer (a raw listener accepts the pipe's
 * connection and takes its HELLO) is sent one page write (op 1) and a read of three pages, one of
 * them empty (op 2); then the input, then a close. Nothing may crash, write outside the read's
 * pages, complete an operation twice or never, or leak, whatever the replies say. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>

#include "fuzz.h"
#include "pipe/tcp_internal.h"

static const uint8_t SESSION[PD_PIPE_SESSION_BYTES] = {2, 7, 1, 8, 2, 8};
static pd_pipe_t *g_a;
static pd_pipe_region_t *g_ra;
static int g_l = -1, g_port;
static uint64_t g_next_id = 0x100;

#define REGION (1u << 20)
#define CANARY 0xa5

static void setup(void)
{
    pd_log_set_level(PD_LOG_OFF);
    pd_pipe_config_t c;
    memset(&c, 0, sizeof(c));
    c.kind = "tcp";
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    g_l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (pd_pipe_create(&c, &g_a) != PD_OK || g_a->ops->alloc_region(g_a, REGION, &g_ra) != PD_OK || g_l < 0 ||
        bind(g_l, (struct sockaddr *)&sa, sizeof(sa)) != 0 || listen(g_l, 4) != 0 ||
        getsockname(g_l, (struct sockaddr *)&sa, &sl) != 0) {
        abort();
    }
    g_port = ntohs(sa.sin_port);
}

typedef struct ended {
    int n;
} ended_t;

static void on_end(void *arg, pd_status_t st)
{
    (void)st;
    ((ended_t *)arg)->n++;
}

/* n bytes from fd within 5 s (the pipe's own frames: they always come) */
static bool take(int fd, void *buf, size_t n)
{
    for (size_t got = 0; got < n;) {
        struct pollfd pf = {fd, POLLIN, 0};
        if (poll(&pf, 1, 5000) != 1) {
            return false;
        }
        ssize_t k = recv(fd, (char *)buf + got, n - got, 0);
        if (k <= 0) {
            return false;
        }
        got += (size_t)k;
    }
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (g_a == NULL) {
        setup();
    }
    if (size > 60000) {
        return 0; /* the socket buffers hold it whole */
    }
    char addr[96];
    int alen =
        snprintf(addr, sizeof(addr), "tcp:127.0.0.1:%d:%016llx", g_port, (unsigned long long)g_next_id++);
    pd_pipe_peer_t *peer = NULL;
    if (g_a->ops->connect(g_a, (const uint8_t *)addr, (size_t)alen, SESSION, &peer) != PD_OK) {
        abort();
    }
    uint8_t rkey[12] = {0};
    uint64_t rlen = REGION;
    memcpy(rkey + 4, &rlen, 8);
    pd_pipe_remote_t *rr = NULL;
    if (g_a->ops->import_region(g_a, peer, rkey, sizeof(rkey), &rr) != PD_OK) {
        abort();
    }
    tcp_pipe_t *t = (tcp_pipe_t *)g_a;
    pthread_mutex_lock(&t->mu);
    t->next_op = 0; /* op ids 1 and 2, as the input names them */
    pthread_mutex_unlock(&t->mu);
    memset(g_ra->base, CANARY, REGION);
    ended_t ended = {0};
    pd_page_xfer_t wp = {0, 0, 4096};
    pd_page_xfer_t rp[3] = {{8192, 0, 4096}, {20000, 4096, 0}, {65536 + 7, 12288, 4096}};
    if (g_a->ops->write_pages(g_a, peer, g_ra, rr, &wp, 1, on_end, &ended) != PD_OK ||
        g_a->ops->read_pages(g_a, peer, g_ra, rr, rp, 3, on_end, &ended) != PD_OK) {
        abort();
    }
    int fd = accept4(g_l, NULL, NULL, SOCK_CLOEXEC);
    /* the HELLO, the write (header, 1 descriptor, 4 KiB), the read request (header, 3 descriptors) */
    static uint8_t sink[sizeof(hdr_t) + TCP_HELLO_AUTH + sizeof(hdr_t) + sizeof(desc_t) + 4096 +
                        sizeof(hdr_t) + 3 * sizeof(desc_t)];
    if (fd < 0 || !take(fd, sink, sizeof(sink))) {
        abort();
    }
    for (size_t off = 0; off < size;) {
        ssize_t w = send(fd, data + off, size - off, MSG_NOSIGNAL);
        if (w <= 0) {
            break;
        }
        off += (size_t)w;
    }
    shutdown(fd, SHUT_WR); /* then the end of the stream: the pipe drops the peer */
    for (double t0 = pd_time_now_s(); ended.n < 2 && pd_time_now_s() - t0 < 10;) {
        pd_pipe_progress(g_a);
    }
    if (ended.n != 2) {
        abort(); /* an operation that never ended */
    }
    const uint8_t *b = g_ra->base; /* nothing written outside the read's two real pages */
    for (size_t i = 0; i < REGION; i++) {
        bool in_read = (i >= 8192 && i < 8192 + 4096) || (i >= 65536 + 7 && i < 65536 + 7 + 4096);
        if (!in_read && b[i] != CANARY) {
            abort();
        }
    }
    g_a->ops->release_remote(g_a, rr);
    g_a->ops->fail_peer(g_a, peer, PD_ERR_PEER_GONE);
    g_a->ops->release_peer(g_a, peer);
    pd_pipe_progress(g_a);
    if (ended.n != 2) {
        abort(); /* an operation that ended twice */
    }
    close(fd);
    return 0;
}
