/* proxy/handover.c — the first-token handover's side of a request (streamed, one choice,
 * --first-token-from-prefill): the prefill's events relayed as they come, the handover event that
 * carries the kv_transfer_params, the decode's events after the ones that repeat the prefill's, and
 * the end of the answer once both legs are done. The sequence itself (legs, retries, releases) is
 * route.c's. */
#define _GNU_SOURCE
#include "proxy/proxy_impl.h"

#include <event2/buffer.h>
#include <event2/http.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "common/http_reply.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/time.h"

/* Relays the decode's whole events (first-token handover: once the prefill's are all out), after
 * dropping its first d_skip (the role and first-token events the prefill's stream gave already, or a
 * resumed leg's role event). */
void px_relay_decode(preq_t *q)
{
    char *ev;
    while ((q->p_done || !q->ft) && (ev = px_sse_next(q->d_sse)) != NULL) {
        if (q->d_skip > 0 && !px_is_migration_event(ev)) {
            q->d_skip--;
        } else if (q->client != NULL) {
            px_start_client_stream(q);
            px_relay_event(q, ev);
            q->d_events++;
        }
        free(ev);
    }
}

/* First-token handover: the answer ends after both legs (the decode's status: code). */
void px_ft_end(preq_t *q)
{
    proxy_t *px = q->px;
    px_relay_decode(q);
    if (px_should_resume(q, q->d_code)) { /* the decode broke: another one goes on */
        if (q->d_code != 200) {
            px_set_health(q->d, false, q->d_code == 0 ? "connection failed" : "answered 503");
        }
        px_resume_decode(q);
        return;
    }
    if (q->client != NULL) {
        if (q->d_code == 200 || (q->reply_started && q->d_events > 0)) {
            evhttp_send_reply_end(q->client); /* the decode's last event was its [DONE] */
        } else if (q->reply_started) {
            /* the decode refused or failed after the prefill's events went out: an error event */
            size_t len = evbuffer_get_length(q->d_body);
            json_t *err =
                len > 0 ? json_loadb((const char *)evbuffer_pullup(q->d_body, (ev_ssize_t)len), len, 0, NULL)
                        : NULL;
            if (!json_is_object(err)) {
                json_decref(err);
                err = json_pack("{s:{s:s, s:s, s:i}}", "error", "message", "the decode node failed", "type",
                                "BadGatewayError", "code", 502);
            }
            char *text = json_dumps(err, JSON_COMPACT);
            pd_http_send_sse(q->client, text != NULL ? text : "{}");
            pd_http_send_sse(q->client, "[DONE]");
            free(text);
            json_decref(err);
            evhttp_send_reply_end(q->client);
        } else {
            evhttp_add_header(evhttp_request_get_output_headers(q->client), "Content-Type",
                              "application/json");
            pd_http_send_reply(q->client, q->d_code ? q->d_code : 502, "Error", q->d_body);
        }
        pd_metric_inc(q->d_code == 200 ? px->m.ok : px->m.failed, 1);
        pd_metric_observe(px->m.e2e_s, pd_time_now_s() - q->t0);
    }
    q->client = NULL;
    if (q->p_conn == NULL) {
        px_preq_free(q);
    }
}

/* First-token handover: the prefill's events go to the client as they come (its role and first-token
 * events, or the whole answer when the first token ended it), except its last one, which carries the
 * kv_transfer_params the decode continues from, and the [DONE] after that. */
void px_ft_on_p_chunk(struct evhttp_request *r, void *arg)
{
    preq_t *q = arg;
    struct evbuffer *in = evhttp_request_get_input_buffer(r);
    if (evhttp_request_get_response_code(r) != 200) {
        evbuffer_add_buffer(q->p_err, in);
        return;
    }
    evbuffer_add_buffer(q->p_sse, in);
    char *ev;
    while ((ev = px_sse_next(q->p_sse)) != NULL) {
        bool done = strcmp(ev, "[DONE]") == 0;
        json_t *j = !done && q->ktp == NULL ? json_loads(ev, 0, NULL) : NULL;
        /* the handover event: no choices, the parameters the decode continues from */
        json_t *ktp = json_array_size(json_object_get(j, "choices")) == 0
                          ? json_object_get(j, "kv_transfer_params")
                          : NULL;
        json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
        if (c0 != NULL && !q->first_sent && json_object_get(json_object_get(c0, "delta"), "role") == NULL) {
            q->first_sent = true; /* not chat's role event: the first token's */
            pd_metric_observe(q->px->m.first_token_s, pd_time_now_s() - q->t0);
        }
        if (json_is_object(ktp)) {
            q->ktp = json_incref(ktp);
        } else if (json_array_size(json_object_get(j, "choices")) == 0 &&
                   json_object_get(j, "kv_transfer_params") != NULL) {
            q->p_bad_handover = true; /* a handover nobody can continue from: not for the client */
        } else if (!(done && q->ktp != NULL) && q->client != NULL) {
            px_start_client_stream(q);
            px_relay_event(q, ev);
            q->p_events += !done;
            q->p_complete |= done; /* no handover: the prefill's stream was the whole answer */
        }
        json_decref(j);
        free(ev);
    }
}

/* First-token handover: the prefill's stream ended (code: its status). */
void px_ft_on_p_done(preq_t *q, int code)
{
    proxy_t *px = q->px;
    q->p_done = true;
    if (q->client == NULL) {
        if (q->d_conn == NULL) {
            px_preq_free(q); /* the client left (a pull lease frees its blocks at its timeout) */
        }
        return;
    }
    pd_metric_observe(px->m.prefill_s, pd_time_now_s() - q->t0);
    bool bad_handover = q->p_bad_handover && q->ktp == NULL;
    if (bad_handover || q->p_complete || (code == 200 && q->ktp == NULL && q->p_events > 0)) {
        /* nothing to continue from: the first token ended the request, or the handover carried no
         * parameters (push: the decode is dropped, and a late reservation of it must not find a
         * write waiting) */
        if (q->d_conn != NULL) {
            q->d->inflight--;
            evhttp_connection_free(q->d_conn);
            q->d_conn = NULL;
            px_release_prefill(q);
        }
        if (bad_handover) {
            px_fail_request(q, 502, "the prefill node handed over without kv_transfer_params");
            return;
        }
        if (!q->p_complete) {
            pd_log_warn("proxy: request %s: the prefill on %s ended its stream after %d events without a "
                        "handover or [DONE]; the answer ends there",
                        q->req_id, q->p->url, q->p_events);
            pd_http_send_sse(q->client, "[DONE]");
        }
        evhttp_send_reply_end(q->client);
        pd_metric_inc(px->m.ok, 1);
        pd_metric_observe(px->m.e2e_s, pd_time_now_s() - q->t0);
        q->client = NULL;
        px_preq_free(q);
        return;
    }
    if (q->push) {
        /* the decode goes on from the WRITE_DONE's token; without one (the prefill failed) it
         * samples the first token itself and none of its events repeats the prefill's */
        if (code != 200) {
            pd_log_warn("proxy: push prefill on %s answered %d", q->p->url, code);
            if (code == 0) {
                px_set_health(q->p, false, "connection failed");
            }
        }
        q->d_skip = q->ktp != NULL ? q->p_events : 0;
        pd_metric_inc(px->m.handovers, q->ktp != NULL ? 1 : 0);
        if (q->d_done) {
            px_ft_end(q);
        } else {
            px_relay_decode(q);
        }
        return;
    }
    if (q->ktp != NULL && code == 200) {
        pd_metric_inc(px->m.handovers, 1);
        px_start_decode(q);
    } else if ((code == 0 || code >= 500) && q->p_events == 0) {
        px_set_health(q->p, false, code == 0 ? "connection failed" : "server error");
        pd_metric_inc(px->m.retry_p, 1);
        evbuffer_drain(q->p_sse, evbuffer_get_length(q->p_sse));
        px_start_prefill(q); /* nothing reached the client: another prefill may do it */
    } else if (code != 200 && code != 0 && !q->reply_started) {
        evhttp_add_header(evhttp_request_get_output_headers(q->client), "Content-Type", "application/json");
        pd_http_send_reply(q->client, code, "Error", q->p_err); /* the request itself is bad (4xx) */
        pd_metric_inc(px->m.failed, 1);
        q->client = NULL;
        px_preq_free(q);
    } else {
        px_fail_request(q, 502, "the prefill node failed after the first token was sent");
    }
}
