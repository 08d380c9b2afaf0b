/* model/config.h — the parts of an HF config.json that pdserve runs. */
#ifndef PD_MODEL_CONFIG_H
#define PD_MODEL_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"

typedef enum pd_arch {
    PD_ARCH_GPT2 = 0,  /* GPT2LMHeadModel: LayerNorm, absolute positions, fused c_attn, GELU */
    PD_ARCH_LLAMA = 1, /* LlamaForCausalLM / Qwen2ForCausalLM: RMSNorm, RoPE, GQA, SwiGLU */
} pd_arch_t;

#define PD_MAX_EOS 8

typedef struct pd_model_config {
    char arch_name[64]; /* architectures[0] as written */
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
    bool tie_word_embeddings;
    bool qkv_bias; /* Llama attention_bias, always on for Qwen2 */
    bool o_bias;   /* Llama attention_bias also biases o_proj */
    bool mlp_bias;
    int32_t sliding_window; /* 0 = none */
    int32_t bos_token_id;   /* -1 = none */
    int32_t eos_token_ids[PD_MAX_EOS];
    int32_t num_eos;
} pd_model_config_t;

/* Reads dir/config.json. Unknown architectures, missing required fields, inconsistent sizes
 * (heads not dividing hidden, kv heads not dividing heads) and unsupported features
 * (rope_scaling) are PD_ERR_PARSE / PD_ERR_UNSUPPORTED with a message naming the field. */
pd_status_t pd_model_config_load(const char *dir, pd_model_config_t *cfg_out);

/* Fills cfg from an already parsed config.json object (doc names it in messages). */
pd_status_t pd_model_config_parse(const void *json_root, const char *doc, pd_model_config_t *cfg_out);

#endif
