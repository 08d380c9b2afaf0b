/* model/model_impl.h — the model's private layout, shared by model.c and the per-architecture
 * files (gpt2.c, llama.c). Matrices (pd_weight_t: projections, embeddings, lm_head) are kept in
 * the model's weight dtype (--dtype; auto = the checkpoint's torch_dtype), Linear layout [out][in];
 * norms and biases are fp32 (small, and read as fp32 by the norm ops). */
#ifndef PD_MODEL_MODEL_IMPL_H
#define PD_MODEL_MODEL_IMPL_H

#include "model/model.h"
#include "model/rope.h"
#include "model/safetensors.h"

typedef struct pd_layer_weights {
    float *norm1_w, *norm1_b; /* [hidden] (b: LayerNorm only) */
    pd_weight_t wq, wk, wv;   /* [heads·hd][hidden], [kv·hd][hidden], [kv·hd][hidden] */
    float *bq, *bk, *bv;      /* optional biases */
    pd_weight_t wo;           /* [hidden][heads·hd] */
    float *bo;
    float *norm2_w, *norm2_b;
    pd_weight_t w_up; /* GPT-2 c_fc [inter][hidden]; Llama gate‖up [2·inter][hidden] */
    float *b_up;
    pd_weight_t w_down; /* [hidden][inter] */
    float *b_down;
    float *q_norm, *k_norm; /* Qwen3, Gemma3 [head_size] */
    float *post_attn_w;     /* Gemma3 [hidden]: norm of the attention output before the residual */
    float *post_mlp_w;      /* Gemma3 [hidden]: norm of the MLP output (norm2_w is its input norm) */
} pd_layer_weights_t;

/* Activations of one forward, all [num_tokens][...] fp32 in backend memory. */
typedef struct pd_activations {
    float *x;    /* [T][hidden] residual stream */
    float *h;    /* [T][hidden] normed input of a block */
    float *q;    /* [T][heads·hd] */
    float *k;    /* [T][kv·hd] */
    float *v;    /* [T][kv·hd] */
    float *attn; /* [T][heads·hd] */
    float *up;   /* [T][2·inter] */
    float *act;  /* [T][inter] */
} pd_activations_t;

struct pd_model {
    pd_model_config_t cfg;
    pd_backend_t *be;
    pd_dtype_t wdtype;     /* storage dtype of the pd_weight_t matrices */
    pd_dtype_t ldtype;     /* of the linear layers (q, k, v, o, up, down): wdtype, or int8 */
    pd_weight_t embed;     /* [vocab][hidden] */
    float embed_scale;     /* Gemma: √hidden, applied as rows are looked up; else 1 */
    pd_weight_t pos_embed; /* GPT-2 [max_pos][hidden] */
    float *final_w, *final_b;
    pd_weight_t lm_head; /* [vocab][hidden]; == embed when tied */
    pd_layer_weights_t *layers;
    pd_rope_t rope;       /* the rotary table (Llama family; Gemma3's global layers) */
    pd_rope_t rope_local; /* Gemma3's sliding layers: rope_local_theta, no scaling */
    void *work;           /* activation workspace, grown to the largest batch seen (backend memory) */
    size_t work_bytes;
    void **allocs; /* every weight allocation, for pd_model_free */
    int num_allocs, cap_allocs;
    size_t weight_bytes;
    int packed_matrices; /* how many the backend's prepare_weight laid out other than row-major */
};

/* Loads tensor name (shape must equal shape[ndim]) as fp32 onto the backend. With transpose,
 * a 2-D [a][b] tensor is stored as [b][a]. Logs and fails on a missing tensor or wrong shape. */
pd_status_t pd_model_load_tensor(pd_model_t *m, const pd_st_set_t *set, const char *name, int ndim,
                                 const int64_t *shape, int transpose, float **out);

/* pd_model_load_tensor with every element w stored as (w + add) · mul (in fp32): folds Gemma's
 * (1 + w) norms and its embedding scale into the weights. */
pd_status_t pd_model_load_affine(pd_model_t *m, const pd_st_set_t *set, const char *name, int ndim,
                                 const int64_t *shape, int transpose, float add, float mul, float **out);

/* Loads a matrix as pd_model_load_tensor does, kept in the model's weight dtype (m->wdtype):
 * copied as it is when the checkpoint stores that dtype, else converted element by element
 * (round-to-nearest-even when narrowing). */
pd_status_t pd_model_load_weight(pd_model_t *m, const pd_st_set_t *set, const char *name, int ndim,
                                 const int64_t *shape, int transpose, pd_weight_t *out);

/* Loads a linear layer's weight (2-D, shape as in the file; transposed to Linear layout with
 * transpose) in the linear dtype (m->ldtype): as pd_model_load_weight, or int8 with per-row scales
 * (--quantization int8). */
pd_status_t pd_model_load_linear(pd_model_t *m, const pd_st_set_t *set, const char *name,
                                 const int64_t *shape, int transpose, int64_t slice_rows, pd_weight_t *out);

/* Loads several same-width 2-D tensors stacked along rows into one linear weight (fused weights),
 * in the linear dtype. */
pd_status_t pd_model_load_stacked(pd_model_t *m, const pd_st_set_t *set, const char *const *names, int n,
                                  const int64_t *rows, int64_t cols, pd_weight_t *out);

/* Allocates backend memory owned by the model. */
pd_status_t pd_model_alloc(pd_model_t *m, size_t bytes, void **out);

/* Per-architecture weight loading and transformer layer. */
pd_status_t pd_gpt2_load_weights(pd_model_t *m, const pd_st_set_t *set);
pd_status_t pd_llama_load_weights(pd_model_t *m, const pd_st_set_t *set);

/* Shared attention block: h → q/k/v → (rope) → cache write + hooks → paged attention → wo → x += */
pd_status_t pd_model_attention_block(pd_model_t *m, int layer, const pd_batch_t *batch,
                                     const pd_kv_view_t *kv, const pd_attn_meta_t *meta,
                                     const pd_forward_hooks_t *hooks, pd_activations_t *a);

pd_status_t pd_gpt2_layer(pd_model_t *m, int layer, const pd_batch_t *batch, const pd_kv_view_t *kv,
                          const pd_attn_meta_t *meta, const pd_forward_hooks_t *hooks, pd_activations_t *a);
pd_status_t pd_llama_layer(pd_model_t *m, int layer, const pd_batch_t *batch, const pd_kv_view_t *kv,
                           const pd_attn_meta_t *meta, const pd_forward_hooks_t *hooks, pd_activations_t *a);

#endif
