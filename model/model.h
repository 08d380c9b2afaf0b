/* model/model.h — a loaded model and its forward pass over a paged KV cache.
 *
 * Forward (one engine step, any mix of prefill chunks and decode tokens):
 *   x = embed(tokens) [+ wpe(positions) for GPT-2]
 *   per layer l: attention block — q,k,v projections (RoPE for Llama) → reshape_and_cache (new
 *     K/V into their slots) → hooks.after_cache_write(l) → hooks.before_attention(l) → paged
 *     attention over the block tables → output projection + residual; then the MLP block
 *   final norm on the rows in logits_indices → lm_head → logits (host memory). */
#ifndef PD_MODEL_MODEL_H
#define PD_MODEL_MODEL_H

#include <stdint.h>

#include "common/status.h"
#include "kernels/backend.h"
#include "model/config.h"

typedef struct pd_model pd_model_t;

/* New tokens of one step. */
typedef struct pd_batch {
    int32_t num_tokens;
    const int32_t *token_ids; /* [num_tokens] host */
    const int32_t *positions; /* [num_tokens] host: absolute positions (offset by computed tokens) */
} pd_batch_t;

/* Per-layer callbacks for the KV connector (DESIGN.md §3). A non-PD_OK return aborts the forward
 * with that status. Either pointer may be NULL. */
typedef struct pd_forward_hooks {
    void *ctx;
    pd_status_t (*after_cache_write)(void *ctx, int layer); /* save_kv_layer */
    pd_status_t (*before_attention)(void *ctx, int layer);  /* wait_for_layer_load */
} pd_forward_hooks_t;

/* Loads config.json and the safetensors weights of dir onto be (converted to fp32; GPT-2 Conv1D
 * weights transposed to Linear layout; Llama gate/up fused). Each tensor's shape is checked
 * against the config; a missing tensor is PD_ERR_NOT_FOUND naming it. The model keeps be. */
pd_status_t pd_model_load(const char *dir, pd_backend_t *be, pd_model_t **model_out);

/* Frees weights and the model. */
void pd_model_free(pd_model_t *model);

const pd_model_config_t *pd_model_config(const pd_model_t *model);

/* Bytes of weights held on the backend. */
size_t pd_model_weight_bytes(const pd_model_t *model);

/* Runs one forward. kv[num_layers] are the per-layer cache views; meta describes the batch's
 * sequences (meta->num_tokens == batch->num_tokens, meta->sliding_window == the model's).
 * logits_out[num_logits][vocab] receives the logits of the rows logits_indices[num_logits].
 * Activations live in a workspace allocated from the backend that grows to the largest batch seen
 * and is kept (a profile run at the largest batch sees it in bytes_in_use / bytes_peak). Not
 * thread-safe: one forward at a time. Fails on out-of-range token ids, positions beyond
 * max_position_embeddings (GPT-2), a window other than the model's, bad block ids or hook errors. */
pd_status_t pd_model_forward(pd_model_t *model, const pd_batch_t *batch, const pd_kv_view_t *kv,
                             const pd_attn_meta_t *meta, const int32_t *logits_indices, int num_logits,
                             const pd_forward_hooks_t *hooks, float *logits_out);

/* What identifies the model in model_dir: "<model_type>:<xxh3 of config.json, every tensor's name,
 * dtype, shape and its first and last 4 KiB>" into buf. PD_ERR_IO when the files cannot be read. */
pd_status_t pd_model_fingerprint(const char *model_dir, char *buf, size_t cap);

#endif
