/* prompt_logprobs through P/D: the prompt is scored where it is computed, so the prefill leg asks for
 * the scores and the proxy puts them into the decode's answer (vLLM's field, non-streamed only:
 * the nodes refuse it with stream, as vLLM does).
 *
 * The client's prompt_logprobs is taken out of its body (q->plp_req) and set again on the leg that
 * computes the prompt: the prefill, or the decode itself when it prefills locally (kv_route.c). No
 * lent prefix (kv_fetch.c) either: the prefill must compute every prompt token to score it. The
 * prefill's answer has one choice per prompt (its n is 1), or chat's top-level field; the decode's
 * choice k of prompt i (index i * n + k) gets prompt i's, chat's top level the prefill's. In push mode the decode may answer before
 * the prefill does: its answer waits (q->d_held) until the prefill's arrives. Event-loop thread. */
#include "proxy/proxy_impl.h"

#include <event2/buffer.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

/* Takes prompt_logprobs out of q->body; the message of a 400 when the request cannot have it. */
const char *px_plp_prepare(preq_t *q)
{
    json_t *plp = json_object_get(q->body, "prompt_logprobs");
    if (plp == NULL || json_is_null(plp)) {
        return NULL;
    }
    if (q->stream) { /* vLLM's words; the nodes say the same */
        return "`prompt_logprobs` are not available when `stream=True`.";
    }
    q->plp_req = json_incref(plp);
    json_object_del(q->body, "prompt_logprobs");
    q->fetch_asked = true; /* the prefill computes every prompt token: none is lent */
    return NULL;
}

/* Sets the client's prompt_logprobs on a leg's body that computes the prompt. */
void px_plp_add(const preq_t *q, json_t *body)
{
    if (q->plp_req != NULL) {
        json_object_set(body, "prompt_logprobs", q->plp_req);
    }
}

/* Keeps the prefill's scores from its answer (one choice per prompt, by index). */
void px_plp_take(preq_t *q, const json_t *resp)
{
    if (q->plp_req == NULL || q->plp_got != NULL) {
        return;
    }
    json_t *got = json_object(), *per = json_array();
    json_t *choices = json_object_get(resp, "choices");
    size_t i;
    json_t *c;
    json_array_foreach(choices, i, c)
    {
        json_int_t idx = json_integer_value(json_object_get(c, "index"));
        while (idx >= 0 && idx < 1024 && json_array_size(per) <= (size_t)idx) {
            json_array_append_new(per, json_null());
        }
        json_t *plp = json_object_get(c, "prompt_logprobs");
        if (idx >= 0 && idx < 1024 && json_is_array(plp)) {
            json_array_set(per, (size_t)idx, plp);
        }
    }
    json_object_set_new(got, "choices", per);
    json_t *top = json_object_get(resp, "prompt_logprobs");
    if (json_is_array(top)) {
        json_object_set(got, "top", top);
    }
    q->plp_got = got;
}

/* The decode's answer (q->d_body, a 200) with the prefill's scores in it; false (the body left as
 * it was) when the answer is not the JSON expected or a choice's prompt has no scores. */
bool px_plp_merge(preq_t *q)
{
    if (q->plp_req == NULL || q->local) {
        return true; /* the decode scored the prompt itself */
    }
    size_t len = evbuffer_get_length(q->d_body);
    json_t *resp =
        json_loadb((const char *)evbuffer_pullup(q->d_body, (ev_ssize_t)len), len, JSON_ALLOW_NUL, NULL);
    json_t *choices = json_object_get(resp, "choices");
    json_t *per = json_object_get(q->plp_got, "choices");
    json_t *nj = json_object_get(q->body, "n");
    json_int_t n = json_is_integer(nj) && json_integer_value(nj) > 0 ? json_integer_value(nj) : 1;
    bool ok = json_is_array(choices) && json_is_array(per);
    size_t i;
    json_t *c;
    json_array_foreach(choices, i, c)
    {
        if (!ok) {
            break;
        }
        if (json_object_get(c, "prompt_logprobs") == NULL) {
            continue; /* chat: the scores are at the top level only */
        }
        json_int_t idx = json_integer_value(json_object_get(c, "index"));
        json_t *plp = idx >= 0 ? json_array_get(per, (size_t)(idx / n)) : NULL;
        ok = json_is_array(plp) && json_object_set(c, "prompt_logprobs", plp) == 0;
    }
    if (ok && json_object_get(resp, "prompt_logprobs") != NULL) { /* chat: the top-level copy */
        json_t *top = json_object_get(q->plp_got, "top");
        ok = json_is_array(top) && json_object_set(resp, "prompt_logprobs", top) == 0;
    }
    char *out = ok ? json_dumps(resp, JSON_COMPACT) : NULL;
    if (out != NULL) {
        evbuffer_drain(q->d_body, len);
        evbuffer_add(q->d_body, out, strlen(out));
        free(out);
    } else {
        pd_log_warn("proxy: request %s: the prefill's prompt_logprobs do not fit the decode's answer",
                    q->req_id);
    }
    json_decref(resp);
    return out != NULL;
}
