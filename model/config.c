/* model/config.c — config.json → pd_model_config_t. */
#include "model/config.h"

#include <stdio.h>
#include <string.h>

#include "common/json.h"
#include "common/log.h"

#define TRY(expr)                                                                                            \
    do {                                                                                                     \
        pd_status_t st_ = (expr);                                                                            \
        if (st_ != PD_OK) {                                                                                  \
            return st_;                                                                                      \
        }                                                                                                    \
    } while (0)

static pd_status_t get_i32(const json_t *root, const char *doc, const char *key, int64_t def, int required,
                           int32_t *out)
{
    int64_t v = def;
    TRY(required ? pd_json_get_int(root, doc, key, &v) : pd_json_opt_int(root, doc, key, def, &v));
    if (v < INT32_MIN || v > INT32_MAX) {
        pd_log_error("%s: field '%s' = %lld is out of range", doc, key, (long long)v);
        return PD_ERR_PARSE;
    }
    *out = (int32_t)v;
    return PD_OK;
}

static pd_status_t parse_eos(const json_t *root, const char *doc, pd_model_config_t *c)
{
    json_t *eos = json_object_get(root, "eos_token_id");
    c->num_eos = 0;
    if (eos == NULL || json_is_null(eos)) {
        return PD_OK;
    }
    if (json_is_integer(eos)) {
        c->eos_token_ids[c->num_eos++] = (int32_t)json_integer_value(eos);
        return PD_OK;
    }
    if (json_is_array(eos) && json_array_size(eos) <= PD_MAX_EOS) {
        size_t i;
        json_t *v;
        json_array_foreach(eos, i, v)
        {
            if (!json_is_integer(v)) {
                break;
            }
            c->eos_token_ids[c->num_eos++] = (int32_t)json_integer_value(v);
        }
        if (c->num_eos == (int)json_array_size(eos)) {
            return PD_OK;
        }
    }
    pd_log_error("%s: field 'eos_token_id' must be an integer or a list of at most %d integers", doc,
                 PD_MAX_EOS);
    return PD_ERR_PARSE;
}

static pd_status_t parse_gpt2(const json_t *root, const char *doc, pd_model_config_t *c)
{
    int64_t n_inner = 0;
    double eps = 1e-5;
    TRY(get_i32(root, doc, "n_embd", 0, 1, &c->hidden_size));
    TRY(get_i32(root, doc, "n_layer", 0, 1, &c->num_layers));
    TRY(get_i32(root, doc, "n_head", 0, 1, &c->num_heads));
    TRY(get_i32(root, doc, "vocab_size", 0, 1, &c->vocab_size));
    TRY(get_i32(root, doc, "n_positions", 1024, 0, &c->max_position_embeddings));
    TRY(pd_json_opt_int(root, doc, "n_inner", 0, &n_inner));
    TRY(pd_json_opt_double(root, doc, "layer_norm_epsilon", 1e-5, &eps));
    TRY(pd_json_opt_bool(root, doc, "tie_word_embeddings", true, &c->tie_word_embeddings));
    const char *act = NULL;
    TRY(pd_json_opt_str(root, doc, "activation_function", "gelu_new", &act));
    if (strcmp(act, "gelu_new") != 0 && strcmp(act, "gelu_pytorch_tanh") != 0) {
        pd_log_error("%s: activation_function '%s' is not supported (gelu_new)", doc, act);
        return PD_ERR_UNSUPPORTED;
    }
    c->arch = PD_ARCH_GPT2;
    c->num_kv_heads = c->num_heads;
    c->intermediate_size = n_inner > 0 ? (int32_t)n_inner : 4 * c->hidden_size;
    c->norm_eps = (float)eps;
    c->qkv_bias = c->o_bias = c->mlp_bias = true;
    c->bos_token_id = -1;
    TRY(get_i32(root, doc, "bos_token_id", c->bos_token_id, 0, &c->bos_token_id));
    return PD_OK;
}

static pd_status_t parse_llama(const json_t *root, const char *doc, pd_model_config_t *c, int qwen2)
{
    double eps = 1e-6, theta = 10000.0;
    bool attention_bias = false, mlp_bias = false, use_sw = false;
    TRY(get_i32(root, doc, "hidden_size", 0, 1, &c->hidden_size));
    TRY(get_i32(root, doc, "num_hidden_layers", 0, 1, &c->num_layers));
    TRY(get_i32(root, doc, "num_attention_heads", 0, 1, &c->num_heads));
    TRY(get_i32(root, doc, "num_key_value_heads", c->num_heads, 0, &c->num_kv_heads));
    TRY(get_i32(root, doc, "intermediate_size", 0, 1, &c->intermediate_size));
    TRY(get_i32(root, doc, "vocab_size", 0, 1, &c->vocab_size));
    TRY(get_i32(root, doc, "max_position_embeddings", 2048, 0, &c->max_position_embeddings));
    TRY(pd_json_opt_double(root, doc, "rms_norm_eps", 1e-6, &eps));
    TRY(pd_json_opt_double(root, doc, "rope_theta", 10000.0, &theta));
    TRY(pd_json_opt_bool(root, doc, "tie_word_embeddings", false, &c->tie_word_embeddings));
    TRY(pd_json_opt_bool(root, doc, "attention_bias", false, &attention_bias));
    TRY(pd_json_opt_bool(root, doc, "mlp_bias", false, &mlp_bias));
    int32_t head_dim = 0;
    if (c->num_heads > 0) {
        TRY(get_i32(root, doc, "head_dim", c->hidden_size / c->num_heads, 0, &head_dim));
    }
    json_t *scaling = json_object_get(root, "rope_scaling");
    if (scaling != NULL && !json_is_null(scaling)) {
        pd_log_error(
            "%s: rope_scaling is set; scaled RoPE (llama3, yarn, linear, dynamic) is not supported yet", doc);
        return PD_ERR_UNSUPPORTED;
    }
    if (qwen2) {
        TRY(pd_json_opt_bool(root, doc, "use_sliding_window", false, &use_sw));
        if (use_sw) {
            TRY(get_i32(root, doc, "sliding_window", 0, 1, &c->sliding_window));
        }
    }
    c->arch = PD_ARCH_LLAMA;
    c->head_size = head_dim;
    c->norm_eps = (float)eps;
    c->rope_theta = (float)theta;
    c->qkv_bias = qwen2 || attention_bias;
    c->o_bias = !qwen2 && attention_bias;
    c->mlp_bias = mlp_bias;
    c->bos_token_id = -1;
    TRY(get_i32(root, doc, "bos_token_id", -1, 0, &c->bos_token_id));
    return PD_OK;
}

pd_status_t pd_model_config_parse(const void *json_root, const char *doc, pd_model_config_t *cfg_out)
{
    const json_t *root = json_root;
    pd_model_config_t c;
    memset(&c, 0, sizeof(c));
    if (!json_is_object(root)) {
        pd_log_error("%s: top level is a %s, not an object", doc, pd_json_type_name(root));
        return PD_ERR_PARSE;
    }
    json_t *archs = json_object_get(root, "architectures");
    if (!json_is_array(archs) || json_array_size(archs) < 1 || !json_is_string(json_array_get(archs, 0))) {
        pd_log_error("%s: 'architectures' must be a list naming the model class", doc);
        return PD_ERR_PARSE;
    }
    const char *arch = json_string_value(json_array_get(archs, 0));
    snprintf(c.arch_name, sizeof(c.arch_name), "%s", arch);
    if (strcmp(arch, "GPT2LMHeadModel") == 0) {
        TRY(parse_gpt2(root, doc, &c));
    } else if (strcmp(arch, "LlamaForCausalLM") == 0 || strcmp(arch, "MistralForCausalLM") == 0) {
        TRY(parse_llama(root, doc, &c, 0));
    } else if (strcmp(arch, "Qwen2ForCausalLM") == 0) {
        TRY(parse_llama(root, doc, &c, 1));
    } else {
        pd_log_error("%s: architecture '%s' is not supported (GPT2LMHeadModel, LlamaForCausalLM, "
                     "Qwen2ForCausalLM)",
                     doc, arch);
        return PD_ERR_UNSUPPORTED;
    }
    TRY(parse_eos(root, doc, &c));
    if (c.arch == PD_ARCH_GPT2 && c.num_heads > 0) {
        c.head_size = c.hidden_size / c.num_heads;
    }
    if (c.hidden_size <= 0 || c.num_layers <= 0 || c.num_heads <= 0 || c.num_kv_heads <= 0 ||
        c.vocab_size <= 0 || c.intermediate_size <= 0 || c.max_position_embeddings <= 0 || c.head_size <= 0) {
        pd_log_error("%s: sizes must be positive (hidden %d, layers %d, heads %d, kv heads %d, vocab %d, "
                     "intermediate %d, positions %d)",
                     doc, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.vocab_size,
                     c.intermediate_size, c.max_position_embeddings);
        return PD_ERR_PARSE;
    }
    if (c.num_heads % c.num_kv_heads != 0) {
        pd_log_error("%s: %d attention heads are not a multiple of %d key/value heads", doc, c.num_heads,
                     c.num_kv_heads);
        return PD_ERR_PARSE;
    }
    if (c.arch == PD_ARCH_GPT2 && c.hidden_size % c.num_heads != 0) {
        pd_log_error("%s: n_embd %d is not divisible by n_head %d", doc, c.hidden_size, c.num_heads);
        return PD_ERR_PARSE;
    }
    if (c.head_size % 2 != 0 && c.arch == PD_ARCH_LLAMA) {
        pd_log_error("%s: head size %d must be even for RoPE", doc, c.head_size);
        return PD_ERR_PARSE;
    }
    for (int i = 0; i < c.num_eos; i++) {
        if (c.eos_token_ids[i] < 0 || c.eos_token_ids[i] >= c.vocab_size) {
            pd_log_error("%s: eos_token_id %d is outside the vocabulary", doc, c.eos_token_ids[i]);
            return PD_ERR_PARSE;
        }
    }
    *cfg_out = c;
    return PD_OK;
}

pd_status_t pd_model_config_load(const char *dir, pd_model_config_t *cfg_out)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/config.json", dir);
    json_t *root = NULL;
    pd_status_t st = pd_json_load_file(path, 1u << 20, &root);
    if (st != PD_OK) {
        return st;
    }
    st = pd_model_config_parse(root, path, cfg_out);
    json_decref(root);
    return st;
}
