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

/* Loads config.json and the safetensors weights of dir onto be. Matrices (projections, embeddings,
 * lm_head) are kept in the weight dtype that dtype names with vLLM's --dtype spellings: "auto"
 * (or NULL) = config.json's torch_dtype (float32 when it names none), "bfloat16", "float16" /
 * "half", "float32" / "float"; norms and biases are fp32. GPT-2 Conv1D weights are transposed to
 * Linear layout; Llama gate/up fused. quantization "int8" (CPU backends) stores the linear layers
 * (q, k, v, o, gate‖up, down) as int8 with a symmetric scale per output channel, quantized at load
 * (embeddings and lm_head stay in the weight dtype); NULL or "none" keeps them in the weight dtype.
 * Each tensor's shape is checked against the config; a missing tensor is PD_ERR_NOT_FOUND naming
 * it, an unknown dtype PD_ERR_INVALID_ARG, another quantization or int8 on a device
 * PD_ERR_UNSUPPORTED. The model keeps be. */
pd_status_t pd_model_load_dtype(const char *dir, pd_backend_t *be, const char *dtype,
                                const char *quantization, pd_model_t **model_out);

/* pd_model_load_dtype with "auto" and no quantization. */
pd_status_t pd_model_load(const char *dir, pd_backend_t *be, pd_model_t **model_out);

/* The storage dtype of the model's matrices, and of its linear layers (int8 when quantized). */
pd_dtype_t pd_model_weight_dtype(const pd_model_t *model);
pd_dtype_t pd_model_linear_dtype(const pd_model_t *model);

/* vLLM's (torch's) name of a dtype: "bfloat16", "float16", "float32" ("int8"). */
const char *pd_dtype_torch_name(pd_dtype_t dt);

/* Frees weights and the model. */
void pd_model_free(pd_model_t *model);

const pd_model_config_t *pd_model_config(const pd_model_t *model);

/* Bytes of weights held on the backend. */
size_t pd_model_weight_bytes(const pd_model_t *model);

/* The memory plan without loading anything: the bytes pd_model_load_dtype would allocate for the
 * weights of config c with matrices in dt and linear layers in linear_dt (what
 * pd_model_weight_bytes then reports; GPT-2's lm_head counted as tied unless the config unties
 * it), and the activation workspace of a forward of T tokens with L logits rows. */
size_t pd_model_plan_weight_bytes(const pd_model_config_t *c, pd_dtype_t dt, pd_dtype_t linear_dt);
size_t pd_model_workspace_bytes(const pd_model_config_t *c, size_t T, size_t L);

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
