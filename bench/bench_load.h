/* bench/bench_load.h — pd-bench's workloads: datasets (random, prefix-repetition, ShareGPT) and
 * the request arrival process, both as vLLM's serving benchmark defines them. */
#ifndef PD_BENCH_BENCH_LOAD_H
#define PD_BENCH_BENCH_LOAD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/rng.h"
#include "common/status.h"

/* One request of a workload: a prompt as token ids or text, and the output length asked for. */
typedef struct pd_bench_prompt {
    int32_t *ids; /* token ids, or NULL when text is set */
    int32_t num_ids;
    char *text;
    int32_t input_len; /* tokens (ids: exact; text: the dataset's estimate) */
    int32_t output_len;
    bool follows; /* multi-turn: the next turn of the previous prompt's conversation: it is sent after
                   * that turn's answer, as that turn's prompt + its answer's ids + these ids */
} pd_bench_prompt_t;

typedef struct pd_bench_dataset {
    pd_bench_prompt_t *prompts;
    size_t n;
} pd_bench_dataset_t;

void pd_bench_dataset_free(pd_bench_dataset_t *d);

/* random: n prompts of input_len·U[1−r, 1+r] random token ids in [0, vocab) after a shared
 * random prefix of prefix_len ids; output_len·U[1−r, 1+r] tokens each (vLLM's RandomDataset). */
pd_status_t pd_bench_dataset_random(uint64_t seed, size_t n, int32_t input_len, int32_t output_len,
                                    double range_ratio, int32_t prefix_len, int32_t vocab,
                                    pd_bench_dataset_t *out);

/* prefix-repetition: num_prefixes random prefixes of prefix_len ids, each followed by a random
 * suffix of suffix_len ids, n prompts cycled over the prefixes and shuffled. */
pd_status_t pd_bench_dataset_prefix_repetition(uint64_t seed, size_t n, int32_t prefix_len,
                                               int32_t suffix_len, int32_t num_prefixes, int32_t output_len,
                                               int32_t vocab, pd_bench_dataset_t *out);

/* mixed: each of a's prompts replaced by b's at the same place with probability b_share (seeded);
 * a and b hold the same number of prompts and are emptied (what out did not take is freed). */
pd_status_t pd_bench_dataset_mix(uint64_t seed, pd_bench_dataset_t *a, pd_bench_dataset_t *b, double b_share,
                                 pd_bench_dataset_t *out);

/* repeat: n prompts of input_len ids, each a random phrase of phrase_len ids repeated (lists,
 * tables, code: text whose continuation repeats what came before, where n-gram speculation finds
 * its drafts); output_len tokens each. */
pd_status_t pd_bench_dataset_repeat(uint64_t seed, size_t n, int32_t input_len, int32_t phrase_len,
                                    int32_t output_len, int32_t vocab, pd_bench_dataset_t *out);

/* multi-turn: n conversations of turns turns each (n × turns prompts, a conversation's turns in
 * order): every conversation opens with one system prompt of system_len ids shared by all, each
 * turn adds a user message of user_len random ids (its ids; follows set from the second turn on)
 * and asks for output_len tokens. The history grows with the answers the server gives. */
pd_status_t pd_bench_dataset_multi_turn(uint64_t seed, size_t n, int32_t turns, int32_t system_len,
                                        int32_t user_len, int32_t output_len, int32_t vocab,
                                        pd_bench_dataset_t *out);

/* Counts the tokens of text as the server will (the model's tokenizer, special tokens added as
 * for a completion prompt); -1 when it cannot. */
typedef int32_t (*pd_bench_count_fn)(void *ctx, const char *text);

/* ShareGPT JSON (a list of {conversations: [{from, value}, ...]}): the first human turn is the
 * prompt, the next turn's length is the output length; pairs are filtered as vLLM does
 * (prompt ≥ 4 and output ≥ 4 tokens, prompt ≤ 1024, prompt + output ≤ 2048) on token counts from
 * count (the model's tokenizer, as vLLM's benchmark), or, count NULL, an estimate of one token per
 * 4 bytes; output_len > 0 overrides. Shuffled with seed, then the first n kept. PD_ERR_PARSE
 * (logged) on a malformed file; PD_ERR_IO (logged) when count fails. */
pd_status_t pd_bench_dataset_sharegpt(const char *path, uint64_t seed, size_t n, int32_t output_len,
                                      pd_bench_count_fn count, void *count_ctx, pd_bench_dataset_t *out);

/* multi-turn over ShareGPT conversations: n conversations (shuffled with seed) with at least one
 * human turn followed by an answer; up to turns of their human turns each, in order (text; follows
 * set from the second on: sent after the previous answer, as the previous prompt + the server's
 * answer + "\n" + this turn). A turn asks for its answer's length in the file (count, or 4 bytes a
 * token; clipped to 4 .. 1024), or output_len > 0. PD_ERR_PARSE (logged) for a malformed file or
 * no usable conversation. */
pd_status_t pd_bench_dataset_sharegpt_multi_turn(const char *path, uint64_t seed, size_t n, int32_t turns,
                                                 int32_t output_len, pd_bench_count_fn count, void *count_ctx,
                                                 pd_bench_dataset_t *out);

/* Filters one ShareGPT pair (token counts): whether vLLM's sample_sharegpt_requests keeps it. */
bool pd_bench_sharegpt_keep(int32_t prompt_len, int32_t output_len);

/* Gaps between arrivals for rate requests/s: gamma(shape = burstiness, scale = 1/(rate·burstiness)),
 * mean 1/rate, coefficient of variation 1/√burstiness (1 = Poisson). rate ≤ 0 or inf → 0. */
double pd_bench_next_gap(pd_rng_t *rng, double rate, double burstiness);

/* A gamma(shape, 1) sample (Marsaglia–Tsang). */
double pd_bench_gamma(pd_rng_t *rng, double shape);

#endif
