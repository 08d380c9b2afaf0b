/* model/config.h — the parts of an HF config.json that pdserve runs. */
#ifndef PD_MODEL_CONFIG_H
#define PD_MODEL_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

#include "common/limits.h"
#include "common/status.h"

typedef enum pd_arch {
    PD_ARCH_GPT2 = 0,  /* GPT2LMHeadModel: LayerNorm, absolute positions, fused c_attn, GELU */
    PD_ARCH_LLAMA = 1, /* Llama / Mistral / Qwen2 / Qwen3 / Gemma3: RMSNorm, RoPE, GQA, gated MLP */
} pd_arch_t;

#define PD_MAX_EOS 8

/* rope_scaling (transformers' ROPE_INIT_FUNCTIONS names). */
typedef enum pd_rope_type {
    PD_ROPE_DEFAULT = 0,
    PD_ROPE_LINEAR,  /* inv_freq / factor */
    PD_ROPE_DYNAMIC, /* NTK-aware base, fixed for max_position × factor (vLLM's static table) */
    PD_ROPE_LLAMA3,  /* Llama-3.1: low frequencies / factor, a smooth band between */
    PD_ROPE_YARN,    /* YaRN: interpolation ramp between beta_fast and beta_slow, attention factor */
} pd_rope_type_t;

typedef struct pd_rope_scaling {
    pd_rope_type_t type;
    double factor;
    int32_t original_max_position_embeddings;
    double low_freq_factor, high_freq_factor; /* llama3 */
    double beta_fast, beta_slow;              /* yarn */
    double mscale, mscale_all_dim;            /* yarn: 0 = absent */
    double attention_factor;                  /* yarn: < 0 = derived from factor */
    bool truncate;                            /* yarn: correction range rounded outwards */
} pd_rope_scaling_t;

typedef struct pd_model_config {
    char arch_name[64]; /* architectures[0] as written */
    char torch_dtype
        [16]; /* config.json's "torch_dtype" (or "dtype"): "bfloat16", "float16", ...; "" unknown */
    pd_arch_t arch;
    int32_t hidden_size;
    int32_t num_layers;
    int32_t num_heads;
    int32_t num_kv_heads;
    int32_t head_size;
    int32_t intermediate_size;
    int32_t vocab_size;
    int32_t max_position_embeddings;
    float norm_eps;
    float rope_theta;
    pd_rope_scaling_t rope_scaling;
    bool tie_word_embeddings;
    bool qkv_bias; /* Llama attention_bias, always on for Qwen2 */
    bool o_bias;   /* Llama attention_bias also biases o_proj */
    bool mlp_bias;
    bool qk_norm;           /* Qwen3: RMSNorm of every q and k head (weights [head_size]) before RoPE */
    int32_t sliding_window; /* 0 = none */
    /* layers that attend within sliding_window (the others see everything): every layer for
     * Mistral / Qwen2 with use_sliding_window, Gemma3's local layers */
    bool sliding_layer[PD_MAX_LAYERS];
    /* Gemma3 (text): (1 + w) RMSNorms, folded at load; a norm after attention and around the MLP
     * (four per layer); embeddings × √hidden; GELU-tanh gated MLP; local layers rotate with
     * rope_local_theta (no scaling), global ones with rope_theta and rope_scaling */
    bool gemma;
    float rope_local_theta; /* 0 = the local layers use the global table */
    float attn_scale;       /* query_pre_attn_scalar^-½; 0 = head_size^-½ */
    int32_t bos_token_id;   /* -1 = none */
    int32_t eos_token_ids[PD_MAX_EOS];
    int32_t num_eos;
} pd_model_config_t;

/* Reads dir/config.json. Unknown architectures, missing required fields, inconsistent sizes
 * (heads not dividing hidden, kv heads not dividing heads) and unsupported features (a
 * rope_scaling type other than linear, dynamic, llama3, yarn; a partial rotary factor) are
 * PD_ERR_PARSE / PD_ERR_UNSUPPORTED with a message naming the field. */
pd_status_t pd_model_config_load(const char *dir, pd_model_config_t *cfg_out);

/* Fills cfg from an already parsed config.json object (doc names it in messages). */
pd_status_t pd_model_config_parse(const void *json_root, const char *doc, pd_model_config_t *cfg_out);

#endif
