/* model/config.c — config.json → pd_model_config_t. */
#include "model/config.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/json.h"
#include "common/log.h"

static pd_status_t get_i32(const json_t *root, const char *doc, const char *key, int64_t def, int required,
                           int32_t *out)
{
    int64_t v = def;
    PD_TRY(required ? pd_json_get_int(root, doc, key, &v) : pd_json_opt_int(root, doc, key, def, &v));
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
    PD_TRY(get_i32(root, doc, "n_embd", 0, 1, &c->hidden_size));
    PD_TRY(get_i32(root, doc, "n_layer", 0, 1, &c->num_layers));
    PD_TRY(get_i32(root, doc, "n_head", 0, 1, &c->num_heads));
    PD_TRY(get_i32(root, doc, "vocab_size", 0, 1, &c->vocab_size));
    PD_TRY(get_i32(root, doc, "n_positions", 1024, 0, &c->max_position_embeddings));
    PD_TRY(pd_json_opt_int(root, doc, "n_inner", 0, &n_inner));
    PD_TRY(pd_json_opt_double(root, doc, "layer_norm_epsilon", 1e-5, &eps));
    PD_TRY(pd_json_opt_bool(root, doc, "tie_word_embeddings", true, &c->tie_word_embeddings));
    const char *act = NULL;
    PD_TRY(pd_json_opt_str(root, doc, "activation_function", "gelu_new", &act));
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
    PD_TRY(get_i32(root, doc, "bos_token_id", c->bos_token_id, 0, &c->bos_token_id));
    return PD_OK;
}

/* rope_scaling as transformers reads it: "rope_type" (or the older "type"), its factor and the
 * fields of that type; the original context length defaults to max_position_embeddings. */
static pd_status_t parse_rope_scaling(const json_t *root, const char *doc, pd_model_config_t *c)
{
    pd_rope_scaling_t *r = &c->rope_scaling;
    memset(r, 0, sizeof(*r));
    r->factor = 1.0;
    r->attention_factor = -1.0;
    double prf = 1.0;
    PD_TRY(pd_json_opt_double(root, doc, "partial_rotary_factor", 1.0, &prf));
    if (prf != 1.0) {
        pd_log_error("%s: partial_rotary_factor %g is not supported (RoPE over the whole head)", doc, prf);
        return PD_ERR_UNSUPPORTED;
    }
    json_t *s = json_object_get(root, "rope_scaling");
    if (s == NULL || json_is_null(s)) {
        return PD_OK;
    }
    if (!json_is_object(s)) {
        pd_log_error("%s: rope_scaling must be an object", doc);
        return PD_ERR_PARSE;
    }
    const char *type = json_string_value(json_object_get(s, "rope_type"));
    if (type == NULL) {
        type = json_string_value(json_object_get(s, "type"));
    }
    static const struct {
        const char *name;
        pd_rope_type_t t;
    } types[] = {{"default", PD_ROPE_DEFAULT},
                 {"linear", PD_ROPE_LINEAR},
                 {"dynamic", PD_ROPE_DYNAMIC},
                 {"llama3", PD_ROPE_LLAMA3},
                 {"yarn", PD_ROPE_YARN}};
    int found = -1;
    for (int i = 0; type != NULL && i < 5; i++) {
        if (strcmp(type, types[i].name) == 0) {
            found = i;
        }
    }
    if (found < 0) {
        pd_log_error("%s: rope_scaling type '%s' is not supported (default, linear, dynamic, llama3, yarn)",
                     doc, type != NULL ? type : "(none)");
        return PD_ERR_UNSUPPORTED;
    }
    r->type = types[found].t;
    const char *sdoc = "config.json rope_scaling";
    double omax = 0;
    PD_TRY(pd_json_opt_double(s, sdoc, "factor", 1.0, &r->factor));
    PD_TRY(pd_json_opt_double(s, sdoc, "original_max_position_embeddings", (double)c->max_position_embeddings,
                              &omax));
    PD_TRY(pd_json_opt_double(s, sdoc, "low_freq_factor", 1.0, &r->low_freq_factor));
    PD_TRY(pd_json_opt_double(s, sdoc, "high_freq_factor", 4.0, &r->high_freq_factor));
    PD_TRY(pd_json_opt_double(s, sdoc, "beta_fast", 32.0, &r->beta_fast));
    PD_TRY(pd_json_opt_double(s, sdoc, "beta_slow", 1.0, &r->beta_slow));
    PD_TRY(pd_json_opt_double(s, sdoc, "mscale", 0.0, &r->mscale));
    PD_TRY(pd_json_opt_double(s, sdoc, "mscale_all_dim", 0.0, &r->mscale_all_dim));
    PD_TRY(pd_json_opt_double(s, sdoc, "attention_factor", -1.0, &r->attention_factor));
    PD_TRY(pd_json_opt_bool(s, sdoc, "truncate", true, &r->truncate));
    r->original_max_position_embeddings = (int32_t)omax;
    if (!(r->factor >= 1.0) && r->type != PD_ROPE_DEFAULT) {
        pd_log_error("%s: rope_scaling.factor must be >= 1, got %g", doc, r->factor);
        return PD_ERR_PARSE;
    }
    if (r->original_max_position_embeddings < 1 ||
        (r->type == PD_ROPE_LLAMA3 &&
         !(r->high_freq_factor > r->low_freq_factor && r->low_freq_factor > 0))) {
        pd_log_error(
            "%s: rope_scaling has an inconsistent original_max_position_embeddings or frequency factors",
            doc);
        return PD_ERR_PARSE;
    }
    return PD_OK;
}

enum { FAMILY_LLAMA, FAMILY_QWEN2, FAMILY_QWEN3, FAMILY_MISTRAL };

static pd_status_t parse_llama(const json_t *root, const char *doc, pd_model_config_t *c, int family)
{
    int qwen2 = family == FAMILY_QWEN2;
    double eps = 1e-6, theta = 10000.0;
    bool attention_bias = false, mlp_bias = false, use_sw = false;
    PD_TRY(get_i32(root, doc, "hidden_size", 0, 1, &c->hidden_size));
    PD_TRY(get_i32(root, doc, "num_hidden_layers", 0, 1, &c->num_layers));
    PD_TRY(get_i32(root, doc, "num_attention_heads", 0, 1, &c->num_heads));
    PD_TRY(get_i32(root, doc, "num_key_value_heads", c->num_heads, 0, &c->num_kv_heads));
    PD_TRY(get_i32(root, doc, "intermediate_size", 0, 1, &c->intermediate_size));
    PD_TRY(get_i32(root, doc, "vocab_size", 0, 1, &c->vocab_size));
    PD_TRY(get_i32(root, doc, "max_position_embeddings", 2048, 0, &c->max_position_embeddings));
    PD_TRY(pd_json_opt_double(root, doc, "rms_norm_eps", 1e-6, &eps));
    PD_TRY(pd_json_opt_double(root, doc, "rope_theta", 10000.0, &theta));
    PD_TRY(pd_json_opt_bool(root, doc, "tie_word_embeddings", false, &c->tie_word_embeddings));
    PD_TRY(pd_json_opt_bool(root, doc, "attention_bias", false, &attention_bias));
    PD_TRY(pd_json_opt_bool(root, doc, "mlp_bias", false, &mlp_bias));
    int32_t head_dim = 0;
    if (c->num_heads > 0) {
        PD_TRY(get_i32(root, doc, "head_dim", c->hidden_size / c->num_heads, 0, &head_dim));
    }
    PD_TRY(parse_rope_scaling(root, doc, c));
    if (qwen2 || family == FAMILY_QWEN3) {
        PD_TRY(pd_json_opt_bool(root, doc, "use_sliding_window", false, &use_sw));
        if (use_sw) {
            PD_TRY(get_i32(root, doc, "sliding_window", 0, 1, &c->sliding_window));
        }
    }
    if (family == FAMILY_MISTRAL) { /* Mistral: a window on every layer when sliding_window is set */
        json_t *sw = json_object_get(root, "sliding_window");
        if (sw != NULL && !json_is_null(sw)) {
            PD_TRY(get_i32(root, doc, "sliding_window", 0, 1, &c->sliding_window));
        }
    }
    c->qk_norm = family == FAMILY_QWEN3;
    for (int l = 0; c->sliding_window > 0 && l < c->num_layers && l < PD_MAX_LAYERS; l++) {
        c->sliding_layer[l] = true;
    }
    c->arch = PD_ARCH_LLAMA;
    c->head_size = head_dim;
    c->norm_eps = (float)eps;
    c->rope_theta = (float)theta;
    c->qkv_bias = qwen2 || attention_bias;
    c->o_bias = !qwen2 && attention_bias;
    c->mlp_bias = mlp_bias;
    c->bos_token_id = -1;
    PD_TRY(get_i32(root, doc, "bos_token_id", -1, 0, &c->bos_token_id));
    return PD_OK;
}

/* A key that must be absent, null or false: pdserve does not run that option, so it is refused. */
static pd_status_t refuse_set(const json_t *root, const char *doc, const char *key, const char *arch)
{
    json_t *v = json_object_get(root, key);
    if (v != NULL && !json_is_null(v) && !json_is_false(v)) {
        pd_log_error("%s: '%s' is not supported for %s", doc, key, arch);
        return PD_ERR_UNSUPPORTED;
    }
    return PD_OK;
}

/* Gemma3ForCausalLM (Gemma3TextConfig): the Llama fields, plus the local/global layer pattern. */
static pd_status_t parse_gemma3(const json_t *root, const char *doc, pd_model_config_t *c)
{
    PD_TRY(refuse_set(root, doc, "attn_logit_softcapping", "Gemma3ForCausalLM"));
    PD_TRY(refuse_set(root, doc, "final_logit_softcapping", "Gemma3ForCausalLM"));
    PD_TRY(refuse_set(root, doc, "use_bidirectional_attention", "Gemma3ForCausalLM"));
    const char *act = "gelu_pytorch_tanh";
    PD_TRY(pd_json_opt_str(root, doc, "hidden_activation", act, &act));
    if (strcmp(act, "gelu_pytorch_tanh") != 0) {
        pd_log_error("%s: hidden_activation '%s' is not supported for Gemma3ForCausalLM (gelu_pytorch_tanh)",
                     doc, act);
        return PD_ERR_UNSUPPORTED;
    }
    json_t *tie = json_object_get(root, "tie_word_embeddings");
    PD_TRY(parse_llama(root, doc, c, FAMILY_LLAMA));
    c->tie_word_embeddings = tie == NULL || json_is_true(tie); /* Gemma3TextConfig defaults to tied */
    c->gemma = true;
    c->qk_norm = true;
    double local = 10000.0, scalar = 0;
    PD_TRY(pd_json_opt_double(root, doc, "rope_local_base_freq", 10000.0, &local));
    PD_TRY(pd_json_opt_double(root, doc, "query_pre_attn_scalar", c->head_size, &scalar));
    if (scalar <= 0) {
        pd_log_error("%s: query_pre_attn_scalar must be positive", doc);
        return PD_ERR_PARSE;
    }
    c->rope_local_theta = (float)local;
    c->attn_scale = (float)(1.0 / sqrt(scalar));
    c->sliding_window = 0;
    PD_TRY(get_i32(root, doc, "sliding_window", 4096, 0, &c->sliding_window));
    if (c->num_layers > PD_MAX_LAYERS || c->sliding_window <= 0) {
        pd_log_error("%s: %d layers (at most %d) with sliding_window %d (positive) are not supported", doc,
                     c->num_layers, PD_MAX_LAYERS, c->sliding_window);
        return PD_ERR_UNSUPPORTED;
    }
    json_t *types = json_object_get(root, "layer_types");
    if (types != NULL && !json_is_null(types)) { /* newer configs: one entry per layer */
        if (!json_is_array(types) || (int)json_array_size(types) != c->num_layers) {
            pd_log_error("%s: layer_types must list one type per layer (%d)", doc, c->num_layers);
            return PD_ERR_PARSE;
        }
        for (int l = 0; l < c->num_layers; l++) {
            const char *t = json_string_value(json_array_get(types, (size_t)l));
            if (t == NULL || (strcmp(t, "sliding_attention") != 0 && strcmp(t, "full_attention") != 0)) {
                pd_log_error("%s: layer_types[%d] is not sliding_attention or full_attention", doc, l);
                return PD_ERR_PARSE;
            }
            c->sliding_layer[l] = strcmp(t, "sliding_attention") == 0;
        }
    } else { /* older configs: every sliding_window_pattern-th layer is global */
        int32_t pattern = 6;
        PD_TRY(get_i32(root, doc, "sliding_window_pattern", 6, 0, &pattern));
        if (pattern < 1) {
            pd_log_error("%s: sliding_window_pattern must be positive", doc);
            return PD_ERR_PARSE;
        }
        for (int l = 0; l < c->num_layers; l++) {
            c->sliding_layer[l] = (l + 1) % pattern != 0;
        }
    }
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
        PD_TRY(parse_gpt2(root, doc, &c));
    } else if (strcmp(arch, "LlamaForCausalLM") == 0) {
        PD_TRY(parse_llama(root, doc, &c, FAMILY_LLAMA));
    } else if (strcmp(arch, "MistralForCausalLM") == 0) {
        PD_TRY(parse_llama(root, doc, &c, FAMILY_MISTRAL));
    } else if (strcmp(arch, "Qwen2ForCausalLM") == 0) {
        PD_TRY(parse_llama(root, doc, &c, FAMILY_QWEN2));
    } else if (strcmp(arch, "Qwen3ForCausalLM") == 0) {
        PD_TRY(parse_llama(root, doc, &c, FAMILY_QWEN3));
    } else if (strcmp(arch, "Gemma3ForCausalLM") == 0) {
        PD_TRY(parse_gemma3(root, doc, &c));
    } else {
        pd_log_error("%s: architecture '%s' is not supported (GPT2LMHeadModel, LlamaForCausalLM, "
                     "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM)",
                     doc, arch);
        return PD_ERR_UNSUPPORTED;
    }
    PD_TRY(parse_eos(root, doc, &c));
    json_t *dt = json_object_get(root, "torch_dtype"); /* transformers >= 4.56 writes "dtype" */
    dt = json_is_string(dt) ? dt : json_object_get(root, "dtype");
    if (json_is_string(dt)) {
        snprintf(c.torch_dtype, sizeof(c.torch_dtype), "%s", json_string_value(dt));
    }
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
