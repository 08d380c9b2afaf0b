/* tests/fuzz/fuzz_tcp_frames.c — the tcp pipe's data frames as an authenticated but hostile peer
 * sends them: the input is the byte stream after the HELLO, read frame by frame by the receiver
 * (tcpi_rx_frame, as its rx thread does) — WRITE and READ_REQ page lists against the regions the
 * peer was granted (one writable 1 MiB region; one it may not touch), acks and read responses for
 * operations never started, tagged tensors with no receive posted. Nothing may crash, write or read
 * outside a granted region, or leak, whatever the frames say. Set up once: two linked tcp pipes on
 * loopback; b's records of a are the peer under attack. */
#define _GNU_SOURCE
#include <string.h>
#include <sys/socket.h>

#include "fuzz.h"
#include "pipe/tcp_internal.h"

static const uint8_t SESSION[PD_PIPE_SESSION_BYTES] = {3, 1, 4, 1, 5, 9, 2, 6};
static pd_pipe_t *g_a, *g_b;
static pd_pipe_peer_t *g_ba; /* b's record of a */

static pd_pipe_t *mk(void)
{
    pd_pipe_config_t c;
    memset(&c, 0, sizeof(c));
    c.kind = "tcp";
    pd_pipe_t *p = NULL;
    if (pd_pipe_create(&c, &p) != PD_OK) {
        abort();
    }
    return p;
}

static void setup(void)
{
    pd_log_set_level(PD_LOG_OFF);
    g_a = mk();
    g_b = mk();
    uint8_t aa[PD_PIPE_ADDR_MAX], ba[PD_PIPE_ADDR_MAX];
    size_t al = sizeof(aa), bl = sizeof(ba);
    pd_pipe_peer_t *ab = NULL;
    pd_pipe_region_t *rw = NULL, *ro = NULL;
    uint8_t d[PD_PIPE_RKEY_MAX];
    size_t dl = sizeof(d);
    if (g_a->ops->address(g_a, aa, &al) != PD_OK || g_b->ops->address(g_b, ba, &bl) != PD_OK ||
        g_a->ops->connect(g_a, ba, bl, SESSION, &ab) != PD_OK ||
        g_b->ops->connect(g_b, aa, al, SESSION, &g_ba) != PD_OK ||
        g_b->ops->alloc_region(g_b, 1 << 20, &rw) != PD_OK ||
        g_b->ops->alloc_region(g_b, 1 << 16, &ro) != PD_OK ||
        g_b->ops->export_region(g_b, rw, g_ba, true, d, &dl) != PD_OK) {
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (g_b == NULL) {
        setup();
    }
    if (size > 60000) {
        return 0; /* the socketpair holds it whole */
    }
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        return 0;
    }
    int big = 1 << 20;
    setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &big, sizeof(big));
    size_t off = 0;
    while (off < size) {
        ssize_t w = send(sv[0], data + off, size - off, MSG_NOSIGNAL);
        if (w <= 0) {
            break;
        }
        off += (size_t)w;
    }
    shutdown(sv[0], SHUT_WR);
    tcp_pipe_t *t = (tcp_pipe_t *)g_b;
    for (int frames = 0; frames < 1000; frames++) {
        /* as the rx thread reads: a peek first (every other frame without one, the other path) */
        uint8_t peek[TCP_PEEK_BYTES];
        ssize_t k = frames % 2 ? 0 : recv(sv[1], peek, sizeof(peek), MSG_PEEK | MSG_DONTWAIT);
        if (tcpi_rx_frame(t, g_ba, sv[1], peek, k > 0 ? (size_t)k : 0) != 0) {
            break;
        }
    }
    close(sv[0]);
    close(sv[1]);
    pd_pipe_progress(g_b); /* completions of anything the frames finished */
    pd_pipe_progress(g_a); /* the acks b sent back for the writes among them */
    return 0;
}
