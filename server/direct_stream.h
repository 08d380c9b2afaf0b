/* server/direct_stream.h — a plain stream's tokens written to the client by the engine thread, as
 * its step ends, instead of by the HTTP loop after a wake-up per token (issue 53).
 *
 * A stream qualifies when its chunks are the same bytes around a token's text and id: one choice,
 * no logprobs, no tool parsing, no echo (token ids, as pd-proxy asks of a decode node, are fine). The HTTP loop starts the stream and sends its
 * first chunk; then, whenever it has handled every output the engine could not write and the
 * connection has nothing queued, it arms the writer with the chunk's template and a dup of the
 * socket. The engine thread's output sink (pd_engine_set_output_sink) then writes each middle token
 * of the stream with one sendmsg; the loop records the token later, with a batch (metrics, text).
 * Anything else — the last chunk, a replayed token, a token the socket could not take whole — goes
 * to the loop as before, and the engine writes nothing more of that stream until the loop has
 * handled it (`pending`), so the client's bytes stay in order.
 *
 * Threads: `mu` guards every field below it. The loop creates the writer before the request is
 * submitted and frees it after the request's final output (the engine calls the sink for a request
 * only before that), so the pointer itself needs no guard. The dup'd fd is closed under `mu` when
 * the stream ends or its client goes away, so the engine never writes to a reused descriptor. */
#ifndef PD_SERVER_DIRECT_STREAM_H
#define PD_SERVER_DIRECT_STREAM_H

#include <stdbool.h>
#include <stddef.h>

#include "engine/engine.h"

typedef struct pd_direct_stream pd_direct_stream_t;

/* A writer, not armed (NULL when out of memory: the stream then goes the loop's way). Loop thread. */
pd_direct_stream_t *pd_direct_new(bool chat);

/* Engine thread (the output sink): writes o to the client when the writer is armed, nothing of this
 * stream waits for the loop and o is a middle token. Returns true when o was written (o->delivered
 * set; o->rest holds what the socket did not take, and the writer is disarmed). Otherwise the loop
 * must handle o, and pd_direct_handled be called for it. */
bool pd_direct_send(pd_direct_stream_t *d, pd_engine_output_t *o);

/* Whether the loop must call pd_direct_handled once it has handled o (o was not written whole). */
bool pd_direct_counts(const pd_engine_output_t *o);

/* Loop: an output pd_direct_counts was handled (call it before writing anything of it): the writer
 * stays disarmed until pd_direct_arm. */
void pd_direct_handled(pd_direct_stream_t *d);

/* The text and the token id a template chunk is made with (see pd_direct_arm). */
#define PD_DIRECT_TEXT_MARKER "\x01pd-direct\x02"
#define PD_DIRECT_ID_MARKER   1999999999

/* Loop, after it wrote an output of the stream: when no output the engine left to it is unhandled
 * and arm is true (the stream is open, its connection has nothing queued), arms the writer. The
 * first arming takes a dup of fd, the framing (chunked: evhttp's "<hex>\r\n...\r\n") and the
 * chunk's template: `chunk` is the JSON of a middle token's chunk as the loop makes it, with
 * PD_DIRECT_TEXT_MARKER as the token's text and PD_DIRECT_ID_MARKER as its id, and for chat `empty`
 * the same for a token without text; later armings may pass NULL for them. Otherwise the writer is
 * disarmed. */
void pd_direct_arm(pd_direct_stream_t *d, bool arm, int fd, bool chunked, const char *chunk,
                   const char *empty);

/* Whether the writer has been armed before (its template is set). */
bool pd_direct_has_template(pd_direct_stream_t *d);

/* Loop: the stream ended or its client went away: disarms for good and closes the dup. */
void pd_direct_close(pd_direct_stream_t *d);

/* The most writers that may hold a dup at once, process-wide (default 1024). Each running direct
 * stream holds a second descriptor for its socket; past the cap a stream is the loop's (the HTTP
 * front sets a quarter of the open-file limit, so with --http-max-connections' half of it every
 * connection stays within the limit). */
void pd_direct_set_max_fds(int n);
/* The writers holding a dup now. */
int pd_direct_fds(void);

/* Loop, after the request's final output. */
void pd_direct_free(pd_direct_stream_t *d);

#endif
