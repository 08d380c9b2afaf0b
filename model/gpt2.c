/* model/gpt2.c — GPT2LMHeadModel: weight names and the transformer layer.
 *   x += attn(ln_1(x)); x += c_proj(gelu(c_fc(ln_2(x)))); Conv1D weights are [in][out] in the
 *   checkpoint and are transposed at load; c_attn [hidden][3·hidden] is split into q, k, v. */
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "model/model_impl.h"

/* Checkpoints name tensors with or without the "transformer." prefix. */
static void gpt2_name(const pd_st_set_t *set, char *buf, size_t len, const char *suffix)
{
    snprintf(buf, len, "transformer.%s", suffix);
    if (pd_st_set_find(set, buf) == NULL) {
        snprintf(buf, len, "%s", suffix);
    }
}

static pd_status_t gpt2_load(pd_model_t *m, const pd_st_set_t *set, const char *suffix, int ndim,
                             const int64_t *shape, int transpose, float **out)
{
    char name[256];
    gpt2_name(set, name, sizeof(name), suffix);
    return pd_model_load_tensor(m, set, name, ndim, shape, transpose, out);
}

/* A matrix: an embedding in the weight dtype, or a linear layer's (transposed from Conv1D) in the
 * linear dtype, of which the model takes slices of slice_rows rows (0: none). */
static pd_status_t gpt2_load_w(pd_model_t *m, const pd_st_set_t *set, const char *suffix,
                               const int64_t *shape, int linear, int64_t slice_rows, pd_weight_t *out)
{
    char name[256];
    gpt2_name(set, name, sizeof(name), suffix);
    return linear ? pd_model_load_linear(m, set, name, shape, 1, slice_rows, out)
                  : pd_model_load_weight(m, set, name, 2, shape, 0, out);
}

pd_status_t pd_gpt2_load_weights(pd_model_t *m, const pd_st_set_t *set)
{
    const pd_model_config_t *c = &m->cfg;
    int64_t H = c->hidden_size, I = c->intermediate_size;
    int64_t s_vh[2] = {c->vocab_size, H}, s_ph[2] = {c->max_position_embeddings, H}, s_h[1] = {H};
    PD_TRY(gpt2_load_w(m, set, "wte.weight", s_vh, 0, 0, &m->embed));
    PD_TRY(gpt2_load_w(m, set, "wpe.weight", s_ph, 0, 0, &m->pos_embed));
    PD_TRY(gpt2_load(m, set, "ln_f.weight", 1, s_h, 0, &m->final_w));
    PD_TRY(gpt2_load(m, set, "ln_f.bias", 1, s_h, 0, &m->final_b));
    if (c->tie_word_embeddings || pd_st_set_find(set, "lm_head.weight") == NULL) {
        m->lm_head = m->embed;
    } else {
        PD_TRY(pd_model_load_weight(m, set, "lm_head.weight", 2, s_vh, 0, &m->lm_head));
    }
    for (int l = 0; l < c->num_layers; l++) {
        pd_layer_weights_t *w = &m->layers[l];
        char n[128];
        int64_t s_attn[2] = {H, 3 * H}, s_3h[1] = {3 * H}, s_hh[2] = {H, H}, s_fc[2] = {H, I}, s_i[1] = {I},
                s_proj[2] = {I, H};
#define LOAD(field, suffix, nd, shape, tr)                                                                   \
    snprintf(n, sizeof(n), "h.%d.%s", l, suffix);                                                            \
    PD_TRY(gpt2_load(m, set, n, nd, shape, tr, &w->field))
#define LOAD_W(field, suffix, shape, slice_rows)                                                             \
    snprintf(n, sizeof(n), "h.%d.%s", l, suffix);                                                            \
    PD_TRY(gpt2_load_w(m, set, n, shape, 1, slice_rows, &w->field))
        LOAD(norm1_w, "ln_1.weight", 1, s_h, 0);
        LOAD(norm1_b, "ln_1.bias", 1, s_h, 0);
        LOAD_W(wq, "attn.c_attn.weight", s_attn, H); /* → [3H][H]: rows 0..H-1 are q */
        LOAD(bq, "attn.c_attn.bias", 1, s_3h, 0);
        w->wk = pd_weight_rows(w->wq, H, H);
        w->wv = pd_weight_rows(w->wq, 2 * H, H);
        w->bk = w->bq + H;
        w->bv = w->bq + 2 * H;
        LOAD_W(wo, "attn.c_proj.weight", s_hh, 0);
        LOAD(bo, "attn.c_proj.bias", 1, s_h, 0);
        LOAD(norm2_w, "ln_2.weight", 1, s_h, 0);
        LOAD(norm2_b, "ln_2.bias", 1, s_h, 0);
        LOAD_W(w_up, "mlp.c_fc.weight", s_fc, 0);
        LOAD(b_up, "mlp.c_fc.bias", 1, s_i, 0);
        LOAD_W(w_down, "mlp.c_proj.weight", s_proj, 0);
        LOAD(b_down, "mlp.c_proj.bias", 1, s_h, 0);
#undef LOAD
#undef LOAD_W
    }
    return PD_OK;
}

pd_status_t pd_gpt2_layer(pd_model_t *m, int layer, const pd_batch_t *batch, const pd_kv_view_t *kv,
                          const pd_attn_meta_t *meta, const pd_forward_hooks_t *hooks, pd_activations_t *a)
{
    const pd_model_config_t *c = &m->cfg;
    const pd_layer_weights_t *w = &m->layers[layer];
    const pd_backend_ops_t *ops = m->be->ops;
    pd_backend_t *be = m->be;
    int T = batch->num_tokens, H = c->hidden_size, I = c->intermediate_size;
    PD_TRY(ops->layernorm(be, a->h, a->x, w->norm1_w, w->norm1_b, T, H, c->norm_eps));
    PD_TRY(pd_model_attention_block(m, layer, batch, kv, meta, hooks, a));
    PD_TRY(ops->layernorm(be, a->h, a->x, w->norm2_w, w->norm2_b, T, H, c->norm_eps));
    PD_TRY(ops->matmul(be, a->up, a->h, w->w_up, w->b_up, T, I, H));
    PD_TRY(ops->gelu(be, a->up, (size_t)T * I));
    PD_TRY(ops->matmul(be, a->h, a->up, w->w_down, w->b_down, T, H, I));
    return ops->add(be, a->x, a->h, (size_t)T * H);
}
