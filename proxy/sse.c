/* proxy/sse.c — server-sent events from the nodes: splitting a node's stream into events (sending
 * one is common/http_reply.h's pd_http_send_sse). The nodes write each event as one
 * "data: <payload>\n\n". */
#define _GNU_SOURCE
#include "proxy/proxy_impl.h"

#include <event2/buffer.h>
#include <stdlib.h>
#include <string.h>

char *px_sse_next(struct evbuffer *buf)
{
    struct evbuffer_ptr end = evbuffer_search(buf, "\n\n", 2, NULL);
    if (end.pos < 0) {
        return NULL;
    }
    size_t len = (size_t)end.pos;
    char *ev = malloc(len + 1);
    if (ev == NULL) {
        return NULL;
    }
    evbuffer_remove(buf, ev, len);
    evbuffer_drain(buf, 2);
    ev[len] = '\0';
    /* the payload: the data lines' values joined by newlines (SSE's rule); other fields dropped */
    size_t out = 0;
    for (char *line = ev, *next; line != NULL; line = next) {
        next = strchr(line, '\n');
        if (next != NULL) {
            *next++ = '\0';
        }
        if (strncmp(line, "data:", 5) != 0) {
            continue;
        }
        const char *v = line + 5 + (line[5] == ' ');
        size_t n = strlen(v);
        if (out > 0) {
            ev[out++] = '\n';
        }
        memmove(ev + out, v, n);
        out += n;
    }
    ev[out] = '\0';
    return ev;
}
