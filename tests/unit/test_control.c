/* tests/unit/test_control.c — control-plane frames and handshake: every message type round-trips;
 * truncated frames, oversized lengths, unknown types, wrong versions and random payloads are
 * refused without crashing (also under ASan); the token handshake accepts equal tokens and
 * fingerprints and refuses wrong tokens, other fingerprints and silent or garbage peers, within
 * its timeout. */
#include "test_util.h" /* first: it defines _GNU_SOURCE */

#define _GNU_SOURCE
#include <check.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/log.h"
#include "common/rng.h"
#include "common/time.h"
#include "connector/control.h"

static void roundtrip(pd_msg_type_t type, const ProtobufCMessage *msg, pd_ctl_msg_t *out)
{
    uint8_t *f = NULL;
    size_t len = 0;
    ck_assert_int_eq(pd_ctl_encode(type, msg, &f, &len), PD_OK);
    pd_ctl_reader_t r;
    pd_ctl_reader_init(&r, 0);
    /* byte by byte: every prefix is "need more" */
    for (size_t i = 0; i + 1 < len; i++) {
        ck_assert_int_eq(pd_ctl_reader_feed(&r, f + i, 1), PD_OK);
        pd_ctl_msg_t m;
        ck_assert_int_eq(pd_ctl_reader_next(&r, &m), PD_ERR_NOT_FOUND);
    }
    ck_assert_int_eq(pd_ctl_reader_feed(&r, f + len - 1, 1), PD_OK);
    ck_assert_int_eq(pd_ctl_reader_next(&r, out), PD_OK);
    ck_assert_int_eq(out->type, type);
    ck_assert_uint_eq(r.len, 0);
    pd_ctl_reader_destroy(&r);
    free(f);
}

static Pd__Fingerprint fp(const char *model)
{
    Pd__Fingerprint f = PD__FINGERPRINT__INIT;
    f.model = (char *)model;
    f.kv_dtype = "fp32";
    f.block_size = 16;
    f.layout = "NB2BSHD";
    f.num_kv_heads = 2;
    f.head_size = 64;
    f.num_layers = 8;
    f.protocol_version = PD_PROTOCOL_VERSION;
    return f;
}

START_TEST(test_every_message_roundtrips)
{
    Pd__Fingerprint f = fp("demo");
    uint32_t blocks[5] = {3, 9, 27, 81, 243};
    uint64_t offs[3] = {0, 4096, 8192};
    Pd__RegionDesc rd = PD__REGION_DESC__INIT;
    rd.region_id = 7;
    rd.base_addr = 0xdeadbeef000ull;
    rd.length = 1ull << 33;
    uint8_t rkey[5] = {1, 2, 3, 4, 5};
    rd.rkey.data = rkey;
    rd.rkey.len = 5;
    rd.layer_offsets = offs;
    rd.n_layer_offsets = 3;
    Pd__RegionDesc *regions[1] = {&rd};
    Pd__Regions rg = PD__REGIONS__INIT;
    rg.regions = regions;
    rg.n_regions = 1;
    pd_ctl_msg_t m;
    roundtrip(PD_MSG_REGIONS, &rg.base, &m);
    Pd__Regions *rr = (Pd__Regions *)m.msg;
    ck_assert_uint_eq(rr->regions[0]->length, 1ull << 33);
    ck_assert_uint_eq(rr->regions[0]->rkey.len, 5);
    ck_assert_uint_eq(rr->regions[0]->layer_offsets[2], 8192);
    pd_ctl_msg_free(&m);

    Pd__Identity id = PD__IDENTITY__INIT;
    id.engine_id = "engine-a";
    id.role = PD__ROLE__ROLE_PREFILL;
    id.fingerprint = &f;
    id.pipe_kind = PD__PIPE_KIND__PIPE_UCX;
    Pd__HelloFinish fin = PD__HELLO_FINISH__INIT;
    fin.identity = &id;
    roundtrip(PD_MSG_HELLO_FINISH, &fin.base, &m);
    ck_assert_str_eq(pd_ctl_peer_identity(&m)->engine_id, "engine-a");
    ck_assert_str_eq(pd_ctl_peer_identity(&m)->fingerprint->layout, "NB2BSHD");
    pd_ctl_msg_free(&m);
    Pd__Welcome w = PD__WELCOME__INIT;
    w.identity = &id;
    roundtrip(PD_MSG_WELCOME, &w.base, &m);
    ck_assert_int_eq(pd_ctl_peer_identity(&m)->pipe_kind, PD__PIPE_KIND__PIPE_UCX);
    pd_ctl_msg_free(&m);

    Pd__TransferGrant g = PD__TRANSFER_GRANT__INIT;
    g.request_id = "cmpl-1";
    g.lease_id = 42;
    g.expires_unix_ms = 1795314865000ull;
    g.block_ids = blocks;
    g.n_block_ids = 5;
    g.num_tokens = 70;
    roundtrip(PD_MSG_TRANSFER_GRANT, &g.base, &m);
    ck_assert_uint_eq(((Pd__TransferGrant *)m.msg)->block_ids[4], 243);
    ck_assert_uint_eq(((Pd__TransferGrant *)m.msg)->lease_id, 42);
    pd_ctl_msg_free(&m);

    Pd__Reservation rs = PD__RESERVATION__INIT;
    rs.request_id = "cmpl-2";
    rs.block_ids = blocks;
    rs.n_block_ids = 2;
    rs.skip_blocks = 1;
    roundtrip(PD_MSG_RESERVATION, &rs.base, &m);
    ck_assert_uint_eq(((Pd__Reservation *)m.msg)->skip_blocks, 1);
    pd_ctl_msg_free(&m);

    Pd__ReadDone rdn = PD__READ_DONE__INIT;
    rdn.request_id = "x";
    rdn.status = -9;
    roundtrip(PD_MSG_READ_DONE, &rdn.base, &m);
    ck_assert_int_eq(((Pd__ReadDone *)m.msg)->status, -9);
    pd_ctl_msg_free(&m);

    Pd__WriteDone wd = PD__WRITE_DONE__INIT;
    wd.layers_written = 32;
    roundtrip(PD_MSG_WRITE_DONE, &wd.base, &m);
    ck_assert_uint_eq(((Pd__WriteDone *)m.msg)->layers_written, 32);
    pd_ctl_msg_free(&m);

    Pd__TransferAck ta = PD__TRANSFER_ACK__INIT;
    ta.result = PD__TRANSFER_ACK__RESULT__STALE;
    roundtrip(PD_MSG_TRANSFER_ACK, &ta.base, &m);
    ck_assert_int_eq(((Pd__TransferAck *)m.msg)->result, PD__TRANSFER_ACK__RESULT__STALE);
    pd_ctl_msg_free(&m);

    Pd__Abort ab = PD__ABORT__INIT;
    ab.reason = "client went away";
    roundtrip(PD_MSG_ABORT, &ab.base, &m);
    ck_assert_str_eq(((Pd__Abort *)m.msg)->reason, "client went away");
    pd_ctl_msg_free(&m);

    Pd__Heartbeat hb = PD__HEARTBEAT__INIT;
    hb.seq = 99;
    roundtrip(PD_MSG_HEARTBEAT, &hb.base, &m);
    ck_assert_uint_eq(((Pd__Heartbeat *)m.msg)->seq, 99);
    pd_ctl_msg_free(&m);

    Pd__Reject rj = PD__REJECT__INIT;
    rj.reason = "nope";
    rj.code = PD_REJECT_TOKEN;
    roundtrip(PD_MSG_REJECT, &rj.base, &m);
    ck_assert_str_eq(((Pd__Reject *)m.msg)->reason, "nope");
    pd_ctl_msg_free(&m);

    Pd__Hello h = PD__HELLO__INIT;
    h.protocol_version = PD_PROTOCOL_VERSION;
    roundtrip(PD_MSG_HELLO, &h.base, &m);
    ck_assert_uint_eq(((Pd__Hello *)m.msg)->protocol_version, PD_PROTOCOL_VERSION);
    pd_ctl_msg_free(&m);
    Pd__HelloAck ha = PD__HELLO_ACK__INIT;
    roundtrip(PD_MSG_HELLO_ACK, &ha.base, &m);
    ck_assert_ptr_null(pd_ctl_peer_identity(&m));
    pd_ctl_msg_free(&m);

    /* two frames back to back come out in order */
    uint8_t *f1, *f2;
    size_t l1, l2;
    pd_ctl_encode(PD_MSG_HEARTBEAT, &hb.base, &f1, &l1);
    pd_ctl_encode(PD_MSG_ABORT, &ab.base, &f2, &l2);
    pd_ctl_reader_t r;
    pd_ctl_reader_init(&r, 0);
    pd_ctl_reader_feed(&r, f1, l1);
    pd_ctl_reader_feed(&r, f2, l2);
    ck_assert_int_eq(pd_ctl_reader_next(&r, &m), PD_OK);
    ck_assert_int_eq(m.type, PD_MSG_HEARTBEAT);
    pd_ctl_msg_free(&m);
    ck_assert_int_eq(pd_ctl_reader_next(&r, &m), PD_OK);
    ck_assert_int_eq(m.type, PD_MSG_ABORT);
    pd_ctl_msg_free(&m);
    ck_assert_int_eq(pd_ctl_reader_next(&r, &m), PD_ERR_NOT_FOUND);
    pd_ctl_reader_destroy(&r);
    free(f1), free(f2);
    /* a message under the wrong type is refused at encode time */
    uint8_t *bad;
    size_t bl;
    ck_assert_int_eq(pd_ctl_encode(PD_MSG_ABORT, &hb.base, &bad, &bl), PD_ERR_INVALID_ARG);
}
END_TEST

static pd_status_t feed_one(const uint8_t *f, size_t n, size_t max_frame)
{
    pd_ctl_reader_t r;
    pd_ctl_reader_init(&r, max_frame);
    pd_ctl_msg_t m = {0, NULL};
    pd_status_t st = pd_ctl_reader_feed(&r, f, n);
    if (st == PD_OK) {
        st = pd_ctl_reader_next(&r, &m);
    }
    pd_ctl_msg_free(&m);
    pd_ctl_reader_destroy(&r);
    return st;
}

START_TEST(test_hostile_frames)
{
    uint8_t hdr[8 + 64];
    memset(hdr, 0, sizeof(hdr));
    /* oversized length */
    hdr[0] = 0x7f;
    hdr[4] = PD_PROTOCOL_VERSION;
    hdr[5] = PD_MSG_HEARTBEAT;
    ck_assert_int_eq(feed_one(hdr, 8, 4096), PD_ERR_PARSE);
    /* wrong version */
    memset(hdr, 0, 8);
    hdr[4] = 9;
    hdr[5] = PD_MSG_HEARTBEAT;
    ck_assert_int_eq(feed_one(hdr, 8, 4096), PD_ERR_UNSUPPORTED);
    /* unknown type, reserved bits */
    hdr[4] = PD_PROTOCOL_VERSION;
    hdr[5] = 200;
    ck_assert_int_eq(feed_one(hdr, 8, 4096), PD_ERR_PARSE);
    hdr[5] = PD_MSG_HEARTBEAT;
    hdr[7] = 1;
    ck_assert_int_eq(feed_one(hdr, 8, 4096), PD_ERR_PARSE);
    hdr[7] = 0;
    /* truncated: header says 10 bytes, 3 arrive */
    hdr[3] = 10;
    ck_assert_int_eq(feed_one(hdr, 8 + 3, 4096), PD_ERR_NOT_FOUND);
    /* a payload that is not a valid message (field 1 as a length-delimited string that overruns) */
    hdr[3] = 2;
    hdr[8] = 0x0a;
    hdr[9] = 0x7f;
    hdr[5] = PD_MSG_ABORT;
    ck_assert_int_eq(feed_one(hdr, 10, 4096), PD_ERR_PARSE);
    /* the reader refuses to buffer past a frame */
    pd_ctl_reader_t r;
    pd_ctl_reader_init(&r, 1024);
    uint8_t *junk = calloc(1, 200000);
    ck_assert_int_eq(pd_ctl_reader_feed(&r, junk, 200000), PD_ERR_NO_SPACE);
    pd_ctl_reader_destroy(&r);
    free(junk);
    /* thousands of random frames with plausible headers: decoded or refused, never a crash */
    pd_rng_t rng;
    pd_rng_seed(&rng, 9);
    int ok = 0, refused = 0;
    uint8_t buf[8 + 256];
    for (int i = 0; i < 20000; i++) {
        size_t n = pd_rng_below(&rng, 256);
        buf[0] = buf[1] = buf[2] = 0;
        buf[3] = (uint8_t)n;
        buf[4] = PD_PROTOCOL_VERSION;
        buf[5] = (uint8_t)(1 + pd_rng_below(&rng, 11));
        buf[6] = buf[7] = 0;
        for (size_t k = 0; k < n; k++) {
            buf[8 + k] = (uint8_t)pd_rng_next(&rng);
        }
        pd_status_t st = feed_one(buf, 8 + n, 4096);
        ck_assert(st == PD_OK || st == PD_ERR_PARSE);
        ok += st == PD_OK;
        refused += st == PD_ERR_PARSE;
    }
    ck_assert_int_gt(refused, 1000);
}
END_TEST

/* ------------------------------------------------------------------ handshake */

typedef struct side {
    int fd;
    pd_ctl_identity_t id;
    Pd__Fingerprint fp;
    pd_status_t st;
    char reason[256];
    pd_ctl_msg_t peer;
    int timeout_ms;
    int silent;  /* do nothing (a dead peer) */
    int garbage; /* send junk instead of a Hello */
} side_t;

static void *run_server(void *arg)
{
    side_t *s = arg;
    pd_ctl_reader_t r;
    pd_ctl_reader_init(&r, 0);
    s->st = pd_ctl_handshake_server(s->fd, &r, &s->id, s->timeout_ms, &s->peer, s->reason, sizeof(s->reason));
    pd_ctl_reader_destroy(&r);
    return NULL;
}

static void *run_client(void *arg)
{
    side_t *s = arg;
    if (s->silent) {
        usleep(1500 * 1000);
        return NULL;
    }
    if (s->garbage) {
        const char junk[] = "GET / HTTP/1.1\r\n\r\n";
        ssize_t w = write(s->fd, junk, sizeof(junk));
        (void)w;
        return NULL;
    }
    pd_ctl_reader_t r;
    pd_ctl_reader_init(&r, 0);
    s->st = pd_ctl_handshake_client(s->fd, &r, &s->id, s->timeout_ms, &s->peer, s->reason, sizeof(s->reason));
    pd_ctl_reader_destroy(&r);
    return NULL;
}

static void init_side(side_t *s, int fd, const char *engine, const char *model, const char *token)
{
    memset(s, 0, sizeof(*s));
    s->fd = fd;
    s->fp = fp(model);
    s->id.engine_id = engine;
    s->id.role = PD__ROLE__ROLE_DECODE;
    s->id.fingerprint = &s->fp;
    s->id.pipe_kind = PD__PIPE_KIND__PIPE_TCP;
    s->id.pipe_address = (const uint8_t *)"127.0.0.1:1";
    s->id.pipe_address_len = 11;
    s->id.token = (const uint8_t *)token;
    s->id.token_len = strlen(token);
    s->timeout_ms = 1000;
}

static void handshake(side_t *c, side_t *s)
{
    pthread_t tc, ts;
    pthread_create(&ts, NULL, run_server, s);
    pthread_create(&tc, NULL, run_client, c);
    pthread_join(tc, NULL);
    pthread_join(ts, NULL);
}

START_TEST(test_handshake_outcomes)
{
    int sv[2];
    side_t c, s;
    /* equal tokens and fingerprints: both learn the other's identity */
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    init_side(&c, sv[0], "dec-1", "demo", "s3cret");
    init_side(&s, sv[1], "pre-1", "demo", "s3cret");
    handshake(&c, &s);
    ck_assert_int_eq(c.st, PD_OK);
    ck_assert_int_eq(s.st, PD_OK);
    ck_assert_str_eq(pd_ctl_peer_identity(&c.peer)->engine_id, "pre-1");
    ck_assert_str_eq(pd_ctl_peer_identity(&s.peer)->engine_id, "dec-1");
    ck_assert_uint_eq(pd_ctl_peer_identity(&s.peer)->pipe_address.len, 11);
    pd_ctl_msg_free(&c.peer);
    pd_ctl_msg_free(&s.peer);
    close(sv[0]), close(sv[1]);

    /* wrong token: refused on both sides, and the token never travels */
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    init_side(&c, sv[0], "dec-1", "demo", "s3cret");
    init_side(&s, sv[1], "pre-1", "demo", "other");
    handshake(&c, &s);
    ck_assert_int_eq(c.st, PD_ERR_REJECTED);
    ck_assert_ptr_nonnull(strstr(c.reason, "cluster token"));
    ck_assert_int_eq(s.st, PD_ERR_REJECTED);
    ck_assert_str_eq(s.reason, "rejected by peer: rejected"); /* nothing said to an unproven peer */
    close(sv[0]), close(sv[1]);

    /* a relay: the client dialled another address than the one the server proves it has (the bytes
     * a forwarding relay passes on are exactly these): refused on both sides */
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    init_side(&c, sv[0], "dec-1", "demo", "s3cret");
    init_side(&s, sv[1], "pre-1", "demo", "s3cret");
    c.id.server_addr = "127.0.0.1:4000"; /* the relay */
    s.id.server_addr = "127.0.0.1:5000"; /* the real server */
    handshake(&c, &s);
    ck_assert_int_eq(c.st, PD_ERR_REJECTED);
    ck_assert_ptr_nonnull(strstr(c.reason, "127.0.0.1:4000"));
    ck_assert_int_ne(s.st, PD_OK);
    close(sv[0]), close(sv[1]);

    /* a different model: refused with the field named */
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    init_side(&c, sv[0], "dec-1", "demo", "t");
    init_side(&s, sv[1], "pre-1", "llama-8b", "t");
    handshake(&c, &s);
    ck_assert_int_eq(c.st, PD_ERR_REJECTED);
    ck_assert_ptr_nonnull(strstr(c.reason, "model"));
    ck_assert_int_eq(s.st, PD_ERR_REJECTED);
    ck_assert_ptr_nonnull(strstr(s.reason, "fingerprint mismatch: model"));
    close(sv[0]), close(sv[1]);

    /* other block size */
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    init_side(&c, sv[0], "dec-1", "demo", "t");
    init_side(&s, sv[1], "pre-1", "demo", "t");
    s.fp.block_size = 32;
    handshake(&c, &s);
    ck_assert_int_eq(s.st, PD_ERR_REJECTED);
    ck_assert_ptr_nonnull(strstr(s.reason, "block_size"));
    close(sv[0]), close(sv[1]);

    /* a silent peer: the server gives up at its timeout, not later */
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    init_side(&c, sv[0], "dec-1", "demo", "t");
    init_side(&s, sv[1], "pre-1", "demo", "t");
    c.silent = 1;
    s.timeout_ms = 300;
    double t0 = pd_time_now_s();
    handshake(&c, &s);
    ck_assert_int_eq(s.st, PD_ERR_TIMEOUT);
    ck_assert(pd_time_now_s() - t0 < 2.0);
    close(sv[0]), close(sv[1]);

    /* garbage instead of a Hello: a clear parse error */
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    init_side(&c, sv[0], "dec-1", "demo", "t");
    init_side(&s, sv[1], "pre-1", "demo", "t");
    c.garbage = 1;
    handshake(&c, &s);
    ck_assert(s.st == PD_ERR_PARSE || s.st == PD_ERR_UNSUPPORTED);
    close(sv[0]), close(sv[1]);

    /* the peer closes: PEER_GONE */
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    init_side(&s, sv[1], "pre-1", "demo", "t");
    close(sv[0]);
    pd_ctl_reader_t rd;
    pd_ctl_reader_init(&rd, 0);
    s.st = pd_ctl_handshake_server(sv[1], &rd, &s.id, 500, &s.peer, s.reason, sizeof(s.reason));
    pd_ctl_reader_destroy(&rd);
    ck_assert_int_eq(s.st, PD_ERR_PEER_GONE);
    close(sv[1]);
}
END_TEST

/* Reads whatever the server sent within timeout_ms (one frame or more) into buf; returns the bytes. */
static size_t read_some(int fd, uint8_t *buf, size_t cap, int timeout_ms)
{
    size_t n = 0;
    double end = pd_time_now_s() + timeout_ms / 1000.0;
    while (n < cap && pd_time_now_s() < end) {
        ssize_t k = recv(fd, buf + n, cap - n, MSG_DONTWAIT);
        if (k > 0) {
            n += (size_t)k;
            continue;
        }
        if (k == 0) {
            break;
        }
        usleep(2000);
    }
    return n;
}

/* The one frame in buf[n], decoded (the test fails otherwise). */
static pd_ctl_msg_t decode_one(const uint8_t *buf, size_t n)
{
    pd_ctl_reader_t r;
    pd_ctl_reader_init(&r, 0);
    ck_assert_int_eq(pd_ctl_reader_feed(&r, buf, n), PD_OK);
    pd_ctl_msg_t m = {0, NULL};
    ck_assert_int_eq(pd_ctl_reader_next(&r, &m), PD_OK);
    pd_ctl_reader_destroy(&r);
    return m;
}

/* A client that does not know the token learns nothing from a server: the HelloAck carries a nonce
 * and a proof only (no engine id, fingerprint or pipe address anywhere in its bytes), a bad proof
 * is answered "rejected" with no code, and so is an old protocol version; the server's own reason
 * (for its log) says what was wrong. */
START_TEST(test_nothing_disclosed_before_the_token)
{
    for (int k = 0; k < 2; k++) {
        int sv[2];
        ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
        side_t s;
        init_side(&s, sv[1], "pre-secret-id", "secret-model", "s3cret");
        pthread_t ts;
        pthread_create(&ts, NULL, run_server, &s);
        uint8_t nonce[32] = {1, 2, 3};
        Pd__Hello h = PD__HELLO__INIT;
        h.protocol_version = k == 0 ? PD_PROTOCOL_VERSION : 1;
        h.nonce.data = nonce;
        h.nonce.len = sizeof(nonce);
        ck_assert_int_eq(pd_ctl_send(sv[0], PD_MSG_HELLO, &h.base, 500), PD_OK);
        uint8_t buf[4096];
        size_t n = read_some(sv[0], buf, sizeof(buf), 300);
        ck_assert_uint_gt(n, 0);
        ck_assert_ptr_null(memmem(buf, n, "pre-secret-id", 13));
        ck_assert_ptr_null(memmem(buf, n, "secret-model", 12));
        ck_assert_ptr_null(memmem(buf, n, "127.0.0.1", 9));
        pd_ctl_msg_t m = decode_one(buf, n);
        if (k == 0) {
            ck_assert_int_eq(m.type, PD_MSG_HELLO_ACK);
            ck_assert_uint_eq(((Pd__HelloAck *)m.msg)->nonce.len, 32);
            ck_assert_uint_eq(((Pd__HelloAck *)m.msg)->proof.len, 32);
            pd_ctl_msg_free(&m);
            /* a guessed proof, with an identity that matches the server's fingerprint */
            uint8_t guess[32] = {0};
            Pd__Fingerprint f = fp("secret-model");
            Pd__Identity id = PD__IDENTITY__INIT;
            id.engine_id = "intruder";
            id.fingerprint = &f;
            Pd__HelloFinish fin = PD__HELLO_FINISH__INIT;
            fin.proof.data = guess;
            fin.proof.len = 32;
            fin.identity = &id;
            ck_assert_int_eq(pd_ctl_send(sv[0], PD_MSG_HELLO_FINISH, &fin.base, 500), PD_OK);
            n = read_some(sv[0], buf, sizeof(buf), 300);
            ck_assert_uint_gt(n, 0);
            ck_assert_ptr_null(memmem(buf, n, "pre-secret-id", 13));
            m = decode_one(buf, n);
        }
        ck_assert_int_eq(m.type, PD_MSG_REJECT);
        ck_assert_str_eq(((Pd__Reject *)m.msg)->reason, "rejected");
        ck_assert_uint_eq(((Pd__Reject *)m.msg)->code, 0);
        pd_ctl_msg_free(&m);
        pthread_join(ts, NULL);
        ck_assert_int_eq(s.st, PD_ERR_REJECTED);
        ck_assert_ptr_nonnull(strstr(s.reason, k == 0 ? "cluster token" : "protocol version 1"));
        close(sv[0]), close(sv[1]);
    }
}
END_TEST

int main(void)
{
    pd_log_set_level(getenv("PD_LOG_LEVEL") ? pd_log_level() : PD_LOG_OFF);
    Suite *s = suite_create("control");
    TCase *tc = tcase_create("control");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_every_message_roundtrips);
    tcase_add_test(tc, test_hostile_frames);
    tcase_add_test(tc, test_handshake_outcomes);
    tcase_add_test(tc, test_nothing_disclosed_before_the_token);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
