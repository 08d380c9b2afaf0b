#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
/* tests/unit/http_client.h — a small blocking HTTP/1.1 client for tests (loopback only): one
 * request per connection, Content-Length or chunked bodies, a receive timeout on every read. */
#ifndef PD_TEST_HTTP_CLIENT_H
#define PD_TEST_HTTP_CLIENT_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

typedef struct http_resp {
    int status;
    char *head; /* status line + headers */
    char *body; /* de-chunked, NUL-terminated */
    size_t body_len;
} http_resp_t;

static inline void http_resp_free(http_resp_t *r)
{
    free(r->head);
    free(r->body);
    memset(r, 0, sizeof(*r));
}

/* Connects to 127.0.0.1:port with a receive/send timeout; -1 on failure. */
static inline int http_connect(int port, int timeout_ms)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) {
        return -1;
    }
    struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Sends a request; returns the connected socket or -1. */
static inline int http_send(int port, const char *method, const char *path, const char *extra_headers,
                            const char *body, size_t body_len, int timeout_ms)
{
    int fd = http_connect(port, timeout_ms);
    if (fd < 0) {
        return -1;
    }
    char head[2048];
    int n = snprintf(
        head, sizeof(head),
        "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\n"
        "Content-Length: %zu\r\n%s\r\n",
        method, path, body_len, extra_headers != NULL ? extra_headers : "");
    if (write(fd, head, (size_t)n) != n) {
        close(fd);
        return -1;
    }
    size_t off = 0;
    while (off < body_len) {
        ssize_t w = write(fd, body + off, body_len - off);
        if (w <= 0) {
            break; /* the server may refuse early (413): read its answer anyway */
        }
        off += (size_t)w;
    }
    return fd;
}

/* Reads everything until EOF (or timeout) and parses it. Returns 0 on a parsed response. */
static inline int http_read_response(int fd, http_resp_t *out)
{
    memset(out, 0, sizeof(*out));
    size_t cap = 65536, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (len + 4096 > cap) {
            cap *= 2;
            buf = realloc(buf, cap);
        }
        ssize_t r = read(fd, buf + len, cap - len - 1);
        if (r <= 0) {
            break;
        }
        len += (size_t)r;
    }
    close(fd);
    buf[len] = '\0';
    char *sep = strstr(buf, "\r\n\r\n");
    if (sep == NULL || sscanf(buf, "HTTP/1.%*d %d", &out->status) != 1) {
        free(buf);
        return -1;
    }
    out->head = strndup(buf, (size_t)(sep - buf));
    char *b = sep + 4;
    size_t blen = len - (size_t)(b - buf);
    out->body = malloc(blen + 1);
    if (strcasestr(out->head, "Transfer-Encoding: chunked") != NULL) {
        size_t k = 0;
        char *p = b;
        while (p < buf + len) {
            unsigned long sz = strtoul(p, NULL, 16);
            char *nl = strstr(p, "\r\n");
            if (nl == NULL || sz == 0) {
                break;
            }
            p = nl + 2;
            if (p + sz > buf + len) {
                sz = (unsigned long)(buf + len - p);
            }
            memcpy(out->body + k, p, sz);
            k += sz;
            p += sz + 2;
        }
        out->body_len = k;
    } else {
        memcpy(out->body, b, blen);
        out->body_len = blen;
    }
    out->body[out->body_len] = '\0';
    free(buf);
    return 0;
}

static inline int http_request(int port, const char *method, const char *path, const char *extra_headers,
                               const char *body, http_resp_t *out, int timeout_ms)
{
    int fd = http_send(port, method, path, extra_headers, body, body ? strlen(body) : 0, timeout_ms);
    if (fd < 0) {
        memset(out, 0, sizeof(*out));
        return -1;
    }
    return http_read_response(fd, out);
}

#endif
