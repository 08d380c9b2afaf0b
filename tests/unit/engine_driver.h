/* tests/unit/engine_driver.h — the driver the engine suites share (test_engine, test_spec): one
 * request's collected output, the step loop until the engine is idle, the pool check. */
#ifndef PD_TEST_ENGINE_DRIVER_H
#define PD_TEST_ENGINE_DRIVER_H

#include <check.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"

/* One request's output so far (pd_engine_request_t.user points at it). */
typedef struct gen {
    int32_t tokens[256];
    float logprob[256]; /* of each token, when logprobs were asked */
    int32_t n;
    char text[4096];
    size_t text_len;
    const char *finish;
    int32_t cached;
    int32_t completion;
} gen_t;

/* Appends outputs to their requests' gen_t; exactly one final output per request. */
static inline void tu_engine_collect(pd_engine_output_t *outs)
{
    for (pd_engine_output_t *o = outs; o != NULL; o = o->next) {
        gen_t *g = o->user;
        if (o->token >= 0) {
            ck_assert_int_lt(g->n, 256);
            g->logprob[g->n] = o->logprob;
            g->tokens[g->n++] = o->token;
        }
        ck_assert_uint_lt(g->text_len + o->text_len, sizeof(g->text));
        memcpy(g->text + g->text_len, o->text, o->text_len);
        g->text_len += o->text_len;
        if (o->finish_reason != NULL) {
            ck_assert_ptr_null(g->finish); /* exactly one final output */
            g->finish = o->finish_reason;
            g->cached = o->cached_tokens;
            g->completion = o->completion_tokens;
        }
    }
}

/* Steps e until it has no work (at most max_steps), then once more: that step releases the last
 * finished requests. */
static inline void tu_engine_run_until_idle(pd_engine_t *e, int max_steps)
{
    for (int steps = 0; pd_engine_has_work(e); steps++) {
        pd_engine_output_t *outs = NULL;
        ck_assert_int_eq(pd_engine_step(e, &outs), PD_OK);
        if (outs == NULL) {
            usleep(200); /* waiting on another thread (a tier load): steps are not spent at full speed */
        }
        tu_engine_collect(outs);
        pd_engine_output_free(outs);
        ck_assert_int_lt(steps, max_steps);
    }
    pd_engine_output_t *outs = NULL;
    pd_engine_step(e, &outs);
    tu_engine_collect(outs);
    pd_engine_output_free(outs);
}

/* Every block free (the null block aside). */
static inline void tu_engine_assert_pool_free(pd_engine_t *e)
{
    pd_engine_stats_t st;
    pd_engine_get_stats(e, &st);
    ck_assert_uint_eq(st.blocks_used, 0);
    ck_assert_uint_eq(st.blocks_free + st.blocks_cached_free, st.num_blocks - 1);
}

#endif
