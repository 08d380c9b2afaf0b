/* model/llama.c — LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM /
 * Gemma3ForCausalLM: weight names and the transformer layer.
 *   x += o_proj(attn(rope(q, k), v) of input_layernorm(x));  (Qwen3, Gemma3: q and k heads RMSNormed first)
 *   x += down_proj(silu(gate_proj(h)) · up_proj(h)) with h = post_attention_layernorm(x).
 * Gemma3: x += post_attention_layernorm(o_proj(...)); h = pre_feedforward_layernorm(x);
 *   x += post_feedforward_layernorm(down_proj(gelu_tanh(gate_proj(h)) · up_proj(h))).
 * gate_proj and up_proj are fused at load into one [2·inter][hidden] weight. */
#include <math.h>
#include <stdio.h>

#include "model/model_impl.h"

pd_status_t pd_llama_load_weights(pd_model_t *m, const pd_st_set_t *set)
{
    const pd_model_config_t *c = &m->cfg;
    int64_t H = c->hidden_size, I = c->intermediate_size, hd = c->head_size;
    int64_t qd = c->num_heads * hd, kvd = c->num_kv_heads * hd;
    int64_t s_vh[2] = {c->vocab_size, H}, s_h[1] = {H};
    /* Gemma: (1 + w) norms folded into the weights; embeddings × √hidden as rows are looked up
     * (the table stays as stored: it is also the tied lm_head) */
    float one = c->gemma ? 1.0f : 0.0f;
    m->embed_scale = c->gemma ? sqrtf((float)H) : 1.0f;
    PD_TRY(pd_model_load_weight(m, set, "model.embed_tokens.weight", 2, s_vh, 0, &m->embed));
    PD_TRY(pd_model_load_affine(m, set, "model.norm.weight", 1, s_h, 0, one, 1.0f, &m->final_w));
    if (c->tie_word_embeddings) {
        m->lm_head = m->embed;
    } else {
        PD_TRY(pd_model_load_weight(m, set, "lm_head.weight", 2, s_vh, 0, &m->lm_head));
    }
    for (int l = 0; l < c->num_layers; l++) {
        pd_layer_weights_t *w = &m->layers[l];
        char n[160];
        int64_t s_q[2] = {qd, H}, s_kv[2] = {kvd, H}, s_o[2] = {H, qd}, s_down[2] = {H, I};
        int64_t s_qb[1] = {qd}, s_kvb[1] = {kvd}, s_ib[1] = {I};
#define LOAD(field, suffix, nd, shape)                                                                       \
    snprintf(n, sizeof(n), "model.layers.%d.%s", l, suffix);                                                 \
    PD_TRY(pd_model_load_tensor(m, set, n, nd, shape, 0, &w->field))
#define LOAD_W(field, suffix, shape)                                                                         \
    snprintf(n, sizeof(n), "model.layers.%d.%s", l, suffix);                                                 \
    PD_TRY(pd_model_load_linear(m, set, n, shape, 0, 0, &w->field))
#define LOAD_NORM(field, suffix, dim)                                                                        \
    snprintf(n, sizeof(n), "model.layers.%d.%s", l, suffix);                                                 \
    PD_TRY(pd_model_load_affine(m, set, n, 1, dim, 0, one, 1.0f, &w->field))
        LOAD_NORM(norm1_w, "input_layernorm.weight", s_h);
        if (c->gemma) { /* Gemma3: a norm after attention, one before and one after the MLP */
            LOAD_NORM(post_attn_w, "post_attention_layernorm.weight", s_h);
            LOAD_NORM(norm2_w, "pre_feedforward_layernorm.weight", s_h);
            LOAD_NORM(post_mlp_w, "post_feedforward_layernorm.weight", s_h);
        } else {
            LOAD_NORM(norm2_w, "post_attention_layernorm.weight", s_h);
        }
        LOAD_W(wq, "self_attn.q_proj.weight", s_q);
        LOAD_W(wk, "self_attn.k_proj.weight", s_kv);
        LOAD_W(wv, "self_attn.v_proj.weight", s_kv);
        LOAD_W(wo, "self_attn.o_proj.weight", s_o);
        if (c->qkv_bias) {
            LOAD(bq, "self_attn.q_proj.bias", 1, s_qb);
            LOAD(bk, "self_attn.k_proj.bias", 1, s_kvb);
            LOAD(bv, "self_attn.v_proj.bias", 1, s_kvb);
        }
        if (c->o_bias) {
            LOAD(bo, "self_attn.o_proj.bias", 1, s_h);
        }
        if (c->qk_norm) {
            int64_t s_hd[1] = {hd};
            LOAD_NORM(q_norm, "self_attn.q_norm.weight", s_hd);
            LOAD_NORM(k_norm, "self_attn.k_norm.weight", s_hd);
        }
        LOAD_W(w_down, "mlp.down_proj.weight", s_down);
        if (c->mlp_bias) {
            LOAD(b_down, "mlp.down_proj.bias", 1, s_h);
            char gb[160], ub[160];
            snprintf(gb, sizeof(gb), "model.layers.%d.mlp.gate_proj.bias", l);
            snprintf(ub, sizeof(ub), "model.layers.%d.mlp.up_proj.bias", l);
            float *b1 = NULL, *b2 = NULL;
            PD_TRY(pd_model_load_tensor(m, set, gb, 1, s_ib, 0, &b1));
            PD_TRY(pd_model_load_tensor(m, set, ub, 1, s_ib, 0, &b2));
            /* fused bias [2·inter]: gate then up, copied into one buffer */
            void *fused = NULL;
            PD_TRY(pd_model_alloc(m, (size_t)(2 * I) * sizeof(float), &fused));
            PD_TRY(m->be->ops->copy(m->be, fused, b1, (size_t)I * sizeof(float), PD_COPY_D2D));
            PD_TRY(m->be->ops->copy(m->be, (float *)fused + I, b2, (size_t)I * sizeof(float), PD_COPY_D2D));
            w->b_up = fused;
        }
#undef LOAD
#undef LOAD_W
#undef LOAD_NORM
        char g[160], u[160];
        snprintf(g, sizeof(g), "model.layers.%d.mlp.gate_proj.weight", l);
        snprintf(u, sizeof(u), "model.layers.%d.mlp.up_proj.weight", l);
        const char *names[2] = {g, u};
        int64_t rows[2] = {I, I};
        PD_TRY(pd_model_load_stacked(m, set, names, 2, rows, H, &w->w_up));
    }
    return PD_OK;
}

pd_status_t pd_llama_layer(pd_model_t *m, int layer, const pd_batch_t *batch, const pd_kv_view_t *kv,
                           const pd_attn_meta_t *meta, const pd_forward_hooks_t *hooks, pd_activations_t *a)
{
    const pd_model_config_t *c = &m->cfg;
    const pd_layer_weights_t *w = &m->layers[layer];
    const pd_backend_ops_t *ops = m->be->ops;
    pd_backend_t *be = m->be;
    int T = batch->num_tokens, H = c->hidden_size, I = c->intermediate_size;
    PD_TRY(ops->rmsnorm(be, a->h, a->x, w->norm1_w, T, H, c->norm_eps));
    PD_TRY(pd_model_attention_block(m, layer, batch, kv, meta, hooks, a));
    PD_TRY(ops->rmsnorm(be, a->h, a->x, w->norm2_w, T, H, c->norm_eps));
    PD_TRY(ops->matmul(be, a->up, a->h, w->w_up, w->b_up, T, 2 * I, H));
    PD_TRY(c->gemma ? ops->gelu_mul(be, a->act, a->up, T, I) : ops->silu_mul(be, a->act, a->up, T, I));
    PD_TRY(ops->matmul(be, a->h, a->act, w->w_down, w->b_down, T, H, I));
    if (w->post_mlp_w != NULL) {
        PD_TRY(ops->rmsnorm(be, a->h, a->h, w->post_mlp_w, T, H, c->norm_eps));
    }
    return ops->add(be, a->x, a->h, (size_t)T * H);
}
