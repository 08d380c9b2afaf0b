/* model/model.c — model loading (matrices at the weight dtype, the rest fp32, on the backend) and
 * the forward pass skeleton shared by every architecture. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/time.h"
#include "model/model_impl.h"

pd_status_t pd_model_alloc(pd_model_t *m, size_t bytes, void **out)
{
    if (m->num_allocs == m->cap_allocs) {
        int cap = m->cap_allocs ? 2 * m->cap_allocs : 64;
        void **a = realloc(m->allocs, (size_t)cap * sizeof(void *));
        if (a == NULL) {
            return PD_ERR_NO_MEMORY;
        }
        m->allocs = a;
        m->cap_allocs = cap;
    }
    void *p = NULL;
    PD_TRY(m->be->ops->alloc(m->be, bytes, &p));
    m->allocs[m->num_allocs++] = p;
    m->weight_bytes += bytes;
    *out = p;
    return PD_OK;
}

static void shape_str(char *buf, size_t len, int ndim, const int64_t *shape)
{
    int n = snprintf(buf, len, "[");
    for (int i = 0; i < ndim && n < (int)len; i++) {
        n += snprintf(buf + n, len - (size_t)n, i ? ", %lld" : "%lld", (long long)shape[i]);
    }
    if (n < (int)len) {
        snprintf(buf + n, len - (size_t)n, "]");
    }
}

static const pd_st_tensor_t *find_checked(const pd_st_set_t *set, const char *name, int ndim,
                                          const int64_t *shape)
{
    const pd_st_tensor_t *t = pd_st_set_find(set, name);
    if (t == NULL) {
        pd_log_error("model: tensor '%s' is missing from the checkpoint", name);
        return NULL;
    }
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) {
        ok = t->shape[i] == shape[i];
    }
    if (!ok) {
        char have[128], want[128];
        shape_str(have, sizeof(have), t->ndim, t->shape);
        shape_str(want, sizeof(want), ndim, shape);
        pd_log_error("model: tensor '%s' has shape %s, the config implies %s", name, have, want);
        return NULL;
    }
    return t;
}

/* Element i of a mapped tensor as fp32. The file decides the data's alignment (the header length
 * is arbitrary), so elements are read with memcpy, never through a typed pointer. */
static inline float st_load(const pd_st_tensor_t *t, int64_t i)
{
    if (t->dtype == PD_DTYPE_F32) {
        float f;
        memcpy(&f, (const char *)t->data + i * 4, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, (const char *)t->data + i * 2, 2);
    return t->dtype == PD_DTYPE_BF16 ? pd_bf16_to_f32(h) : pd_f16_to_f32(h);
}

/* Converts t's elements into dst of dtype dt (rows × cols, optionally transposed): a plain copy
 * when the file already holds dt, else element by element (round-to-nearest-even narrowing). */
static void convert_tensor(void *dst, pd_dtype_t dt, const pd_st_tensor_t *t, int transpose)
{
    if (!transpose || t->ndim != 2) {
        if (t->dtype == dt) {
            memcpy(dst, t->data, (size_t)t->numel * (size_t)pd_dtype_size(dt));
            return;
        }
        for (int64_t i = 0; i < t->numel; i++) {
            pd_dtype_store(dst, i, dt, st_load(t, i));
        }
        return;
    }
    int64_t rows = t->shape[0], cols = t->shape[1];
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < cols; c++) {
            pd_dtype_store(dst, c * rows + r, dt, st_load(t, r * cols + c));
        }
    }
}

/* Loads t converted to dt into new backend memory owned by the model (staged through host memory). */
static pd_status_t upload_tensor(pd_model_t *m, const pd_st_tensor_t *t, pd_dtype_t dt, int transpose,
                                 float add, float mul, void **out)
{
    size_t bytes = (size_t)t->numel * (size_t)pd_dtype_size(dt);
    void *host = malloc(bytes ? bytes : 1);
    if (host == NULL) {
        pd_log_error("model: cannot allocate %zu bytes to convert '%s'", bytes, t->name);
        return PD_ERR_NO_MEMORY;
    }
    convert_tensor(host, dt, t, transpose);
    if (add != 0.0f || mul != 1.0f) { /* fp32 only (norms) */
        float *f = host;
        for (int64_t i = 0; i < t->numel; i++) {
            f[i] = (f[i] + add) * mul;
        }
    }
    void *dev = NULL;
    pd_status_t st = pd_model_alloc(m, bytes, &dev);
    if (st == PD_OK) {
        st = m->be->ops->copy(m->be, dev, host, bytes, PD_COPY_H2D);
    }
    free(host);
    if (st == PD_OK) {
        *out = dev;
    }
    return st;
}

static pd_status_t find_status(const pd_st_set_t *set, const char *name)
{
    return pd_st_set_find(set, name) == NULL ? PD_ERR_NOT_FOUND : PD_ERR_PARSE;
}

pd_status_t pd_model_load_tensor(pd_model_t *m, const pd_st_set_t *set, const char *name, int ndim,
                                 const int64_t *shape, int transpose, float **out)
{
    return pd_model_load_affine(m, set, name, ndim, shape, transpose, 0.0f, 1.0f, out);
}

pd_status_t pd_model_load_affine(pd_model_t *m, const pd_st_set_t *set, const char *name, int ndim,
                                 const int64_t *shape, int transpose, float add, float mul, float **out)
{
    const pd_st_tensor_t *t = find_checked(set, name, ndim, shape);
    if (t == NULL) {
        return find_status(set, name);
    }
    void *dev = NULL;
    PD_TRY(upload_tensor(m, t, PD_DTYPE_F32, transpose, add, mul, &dev));
    *out = dev;
    return PD_OK;
}

pd_status_t pd_model_load_weight(pd_model_t *m, const pd_st_set_t *set, const char *name, int ndim,
                                 const int64_t *shape, int transpose, pd_weight_t *out)
{
    const pd_st_tensor_t *t = find_checked(set, name, ndim, shape);
    if (t == NULL) {
        return find_status(set, name);
    }
    void *dev = NULL;
    PD_TRY(upload_tensor(m, t, m->wdtype, transpose, 0.0f, 1.0f, &dev));
    *out = (pd_weight_t){dev, m->wdtype, NULL, PD_WEIGHT_ROWS, 0};
    return PD_OK;
}

/* q[rows][cols], scale[rows] = f quantized to int8 with one symmetric scale per row (output
 * channel): max |w| / 127 (1 for an all-zero row), values rounded to the nearest integer. */
static void quantize_rows(int8_t *q, float *scale, const float *f, int64_t rows, int64_t cols)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *fr = f + r * cols;
        float mx = 0.0f;
        for (int64_t c = 0; c < cols; c++) {
            mx = fabsf(fr[c]) > mx ? fabsf(fr[c]) : mx;
        }
        scale[r] = mx > 0.0f ? mx / 127.0f : 1.0f;
        float inv = 1.0f / scale[r];
        for (int64_t c = 0; c < cols; c++) {
            pd_dtype_store(q, r * cols + c, PD_DTYPE_I8, fr[c] * inv);
        }
    }
}

/* Uploads f[rows][cols] (fp32, host) as an int8 weight with per-row scales. */
static pd_status_t upload_int8(pd_model_t *m, const float *f, int64_t rows, int64_t cols, pd_weight_t *out)
{
    size_t n = (size_t)(rows * cols);
    int8_t *q = malloc(n ? n : 1);
    float *sc = malloc((size_t)rows * sizeof(float) + 1);
    void *dq = NULL, *dsc = NULL;
    pd_status_t st = q != NULL && sc != NULL ? PD_OK : PD_ERR_NO_MEMORY;
    if (st == PD_OK) {
        quantize_rows(q, sc, f, rows, cols);
        st = pd_model_alloc(m, n, &dq);
    }
    if (st == PD_OK) {
        st = pd_model_alloc(m, (size_t)rows * sizeof(float), &dsc);
    }
    if (st == PD_OK) {
        st = m->be->ops->copy(m->be, dq, q, n, PD_COPY_H2D);
    }
    if (st == PD_OK) {
        st = m->be->ops->copy(m->be, dsc, sc, (size_t)rows * sizeof(float), PD_COPY_H2D);
    }
    free(q);
    free(sc);
    if (st == PD_OK) {
        *out = (pd_weight_t){dq, PD_DTYPE_I8, dsc, PD_WEIGHT_ROWS, 0};
    }
    return st;
}

/* Lets the backend lay out a matrix the model multiplies by (pd_backend_ops_t.prepare_weight). */
static pd_status_t prepare_weight(pd_model_t *m, pd_weight_t *w, int64_t rows, int64_t cols,
                                  int64_t slice_rows)
{
    if (m->be->ops->prepare_weight == NULL) {
        return PD_OK;
    }
    PD_TRY(m->be->ops->prepare_weight(m->be, w, rows, cols, slice_rows));
    m->packed_matrices += w->layout != PD_WEIGHT_ROWS;
    return PD_OK;
}

pd_status_t pd_model_load_linear(pd_model_t *m, const pd_st_set_t *set, const char *name,
                                 const int64_t *shape, int transpose, int64_t slice_rows, pd_weight_t *out)
{
    if (m->ldtype != PD_DTYPE_I8) { /* the linear layers are at the weight dtype */
        PD_TRY(pd_model_load_weight(m, set, name, 2, shape, transpose, out));
        return prepare_weight(m, out, transpose ? shape[1] : shape[0], transpose ? shape[0] : shape[1],
                              slice_rows);
    }
    const pd_st_tensor_t *t = find_checked(set, name, 2, shape);
    if (t == NULL) {
        return find_status(set, name);
    }
    float *f = malloc((size_t)t->numel * sizeof(float) + 1);
    if (f == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    convert_tensor(f, PD_DTYPE_F32, t, transpose);
    int64_t rows = transpose ? shape[1] : shape[0], cols = transpose ? shape[0] : shape[1];
    pd_status_t st = upload_int8(m, f, rows, cols, out);
    free(f);
    return st == PD_OK ? prepare_weight(m, out, rows, cols, slice_rows) : st;
}

pd_status_t pd_model_load_stacked(pd_model_t *m, const pd_st_set_t *set, const char *const *names, int n,
                                  const int64_t *rows, int64_t cols, pd_weight_t *out)
{
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        total += rows[i];
    }
    pd_dtype_t dt = m->ldtype == PD_DTYPE_I8 ? PD_DTYPE_F32 : m->ldtype; /* int8: quantized at the end */
    size_t esize = (size_t)pd_dtype_size(dt);
    void *all = malloc((size_t)(total * cols) * esize + 1);
    if (all == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    int64_t row0 = 0;
    pd_status_t st = PD_OK;
    for (int i = 0; st == PD_OK && i < n; i++) {
        int64_t shape[2] = {rows[i], cols};
        const pd_st_tensor_t *t = find_checked(set, names[i], 2, shape);
        if (t == NULL) {
            st = find_status(set, names[i]);
            break;
        }
        convert_tensor((char *)all + (size_t)(row0 * cols) * esize, dt, t, 0);
        row0 += rows[i];
    }
    if (st == PD_OK && m->ldtype == PD_DTYPE_I8) {
        st = upload_int8(m, all, total, cols, out);
    } else if (st == PD_OK) {
        void *dev = NULL;
        st = pd_model_alloc(m, (size_t)(total * cols) * esize, &dev);
        if (st == PD_OK) {
            st = m->be->ops->copy(m->be, dev, all, (size_t)(total * cols) * esize, PD_COPY_H2D);
        }
        *out = (pd_weight_t){dev, dt, NULL, PD_WEIGHT_ROWS, 0};
    }
    free(all);
    if (st == PD_OK) {
        st = prepare_weight(m, out, total, cols, 0);
    }
    return st;
}

/* --dtype (vLLM's names) to the weight dtype; auto = config.json's torch_dtype, fp32 when it names
 * none. PD_ERR_INVALID_ARG for any other name. */
static pd_status_t resolve_weight_dtype(const char *name, const pd_model_config_t *c, pd_dtype_t *out)
{
    const char *s = name != NULL && strcmp(name, "auto") != 0 ? name : c->torch_dtype;
    if (strcmp(s, "bfloat16") == 0) {
        *out = PD_DTYPE_BF16;
    } else if (strcmp(s, "float16") == 0 || strcmp(s, "half") == 0) {
        *out = PD_DTYPE_F16;
    } else if (strcmp(s, "float32") == 0 || strcmp(s, "float") == 0 || s == c->torch_dtype) {
        *out = PD_DTYPE_F32; /* auto on an fp32 checkpoint, or one that names no dtype */
    } else {
        pd_log_error("model: --dtype %s is not one of auto, bfloat16, float16, half, float32, float", s);
        return PD_ERR_INVALID_ARG;
    }
    return PD_OK;
}

const char *pd_dtype_torch_name(pd_dtype_t dt)
{
    return dt == PD_DTYPE_BF16  ? "bfloat16"
           : dt == PD_DTYPE_F16 ? "float16"
           : dt == PD_DTYPE_I8  ? "int8"
                                : "float32";
}

pd_status_t pd_model_load(const char *dir, pd_backend_t *be, pd_model_t **model_out)
{
    return pd_model_load_dtype(dir, be, "auto", NULL, model_out);
}

pd_status_t pd_model_load_dtype(const char *dir, pd_backend_t *be, const char *dtype,
                                const char *quantization, pd_model_t **model_out)
{
    uint64_t t0 = pd_time_now_ns();
    pd_model_t *m = calloc(1, sizeof(*m));
    if (m == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    m->be = be;
    pd_status_t st = pd_model_config_load(dir, &m->cfg);
    if (st == PD_OK) {
        st = resolve_weight_dtype(dtype, &m->cfg, &m->wdtype);
    }
    m->ldtype = m->wdtype;
    if (st == PD_OK && quantization != NULL && strcmp(quantization, "none") != 0) {
        if (strcmp(quantization, "int8") != 0) {
            pd_log_error(
                "model: --quantization %s is not implemented (int8: per-channel int8 linear weights)",
                quantization);
            st = PD_ERR_UNSUPPORTED;
        } else if (!be->host_memory) {
            pd_log_error("model: --quantization int8 is implemented on the CPU backend only, not on %s",
                         be->ops->name);
            st = PD_ERR_UNSUPPORTED;
        }
        m->ldtype = PD_DTYPE_I8;
    }
    if (st != PD_OK) {
        goto err_model;
    }
    m->embed_scale = 1.0f;
    m->layers = calloc((size_t)m->cfg.num_layers, sizeof(pd_layer_weights_t));
    if (m->layers == NULL) {
        st = PD_ERR_NO_MEMORY;
        goto err_model;
    }
    pd_log_info("loading %s from %s: %d layers, hidden %d, %d heads (%d kv), head size %d, vocab %d",
                m->cfg.arch_name, dir, m->cfg.num_layers, m->cfg.hidden_size, m->cfg.num_heads,
                m->cfg.num_kv_heads, m->cfg.head_size, m->cfg.vocab_size);
    pd_st_set_t set;
    st = pd_st_set_open_dir(dir, &set);
    if (st != PD_OK) {
        goto err_model;
    }
    if (m->cfg.arch == PD_ARCH_LLAMA) {
        st = pd_rope_table(&m->cfg, &m->rope);
        m->rope_local = m->rope;
        if (st == PD_OK && m->cfg.rope_local_theta > 0) {
            pd_model_config_t local = m->cfg;
            local.rope_theta = m->cfg.rope_local_theta;
            memset(&local.rope_scaling, 0, sizeof(local.rope_scaling));
            st = pd_rope_table(&local, &m->rope_local);
        }
        if (st != PD_OK) {
            pd_st_set_close(&set);
            goto err_model;
        }
    }
    st = m->cfg.arch == PD_ARCH_GPT2 ? pd_gpt2_load_weights(m, &set) : pd_llama_load_weights(m, &set);
    pd_st_set_close(&set);
    if (st == PD_OK) { /* a tied lm_head is the embedding table: both see its layout */
        bool tied = m->lm_head.data == m->embed.data;
        st = prepare_weight(m, &m->lm_head, m->cfg.vocab_size, m->cfg.hidden_size, 0);
        m->embed = tied ? m->lm_head : m->embed;
    }
    if (st != PD_OK) {
        goto err_model;
    }
    if (m->packed_matrices > 0) {
        pd_log_info("model: %d matrices laid out in 32-row blocks for the %s backend's matmul",
                    m->packed_matrices, be->ops->name);
    }
    pd_log_info(
        "model loaded: %.1f MiB of weights on %s in %.2f s, matrices in %s (--dtype %s; the checkpoint "
        "says '%s')%s, norms and biases in float32",
        (double)m->weight_bytes / (1 << 20), be->ops->name, (double)(pd_time_now_ns() - t0) * 1e-9,
        pd_dtype_torch_name(m->wdtype), dtype != NULL ? dtype : "auto",
        m->cfg.torch_dtype[0] ? m->cfg.torch_dtype : "nothing",
        m->ldtype == PD_DTYPE_I8 ? ", linear layers in int8 with per-channel scales (--quantization int8)"
                                 : "");
    *model_out = m;
    return PD_OK;

err_model:
    pd_model_free(m);
    return st;
}

void pd_model_free(pd_model_t *m)
{
    if (m == NULL) {
        return;
    }
    m->be->ops->free(m->be, m->work);
    for (int i = m->num_allocs - 1; i >= 0; i--) {
        m->be->ops->free(m->be, m->allocs[i]);
    }
    free(m->allocs);
    free(m->layers);
    free(m);
}

size_t pd_model_workspace_bytes(const pd_model_config_t *c, size_t T, size_t L)
{
    size_t hid = (size_t)c->hidden_size, inter = (size_t)c->intermediate_size, V = (size_t)c->vocab_size;
    size_t qdim = (size_t)c->num_heads * c->head_size, kvdim = (size_t)c->num_kv_heads * c->head_size;
    size_t up_width = c->arch == PD_ARCH_LLAMA ? 2 * inter : inter;
    /* one activation block per forward; the logits rows reuse the front of it */
    size_t floats = T * (2 * hid + 2 * qdim + 2 * kvdim + up_width + inter);
    size_t tail = L * (hid + V);
    return (floats > tail ? floats : tail) * sizeof(float) + 64;
}

/* Bytes of a [rows][cols] matrix of dt (int8: plus a scale per row). */
static size_t matrix_bytes(size_t rows, size_t cols, pd_dtype_t dt)
{
    return rows * cols * (size_t)pd_dtype_size(dt) + (dt == PD_DTYPE_I8 ? rows * sizeof(float) : 0);
}

size_t pd_model_plan_weight_bytes(const pd_model_config_t *c, pd_dtype_t dt, pd_dtype_t linear_dt)
{
    size_t f = sizeof(float), H = (size_t)c->hidden_size, I = (size_t)c->intermediate_size;
    size_t V = (size_t)c->vocab_size, hd = (size_t)c->head_size;
    size_t qd = (size_t)c->num_heads * hd, kvd = (size_t)c->num_kv_heads * hd;
    pd_dtype_t ld = linear_dt;
    size_t layer, top;
    if (c->arch == PD_ARCH_GPT2) { /* gpt2.c: ln_1, c_attn, c_proj, ln_2, c_fc, c_proj (+ biases) */
        layer = 4 * H * f + matrix_bytes(3 * H, H, ld) + matrix_bytes(H, H, ld) + matrix_bytes(I, H, ld) +
                matrix_bytes(H, I, ld) + (3 * H + H + I + H) * f;
        top = matrix_bytes(V, H, dt) + matrix_bytes((size_t)c->max_position_embeddings, H, dt) + 2 * H * f;
    } else { /* llama.c */
        layer = (c->gemma ? 4 : 2) * H * f + matrix_bytes(qd, H, ld) + 2 * matrix_bytes(kvd, H, ld) +
                matrix_bytes(H, qd, ld) + matrix_bytes(H, I, ld) + matrix_bytes(2 * I, H, ld);
        layer += c->qkv_bias ? (qd + 2 * kvd) * f : 0;
        layer += c->o_bias ? H * f : 0;
        layer += c->qk_norm ? 2 * hd * f : 0;
        layer += c->mlp_bias ? (H + 4 * I) * f : 0; /* down, gate, up, and the fused gate‖up */
        top = matrix_bytes(V, H, dt) + H * f;
    }
    top += c->tie_word_embeddings ? 0 : matrix_bytes(V, H, dt);
    return top + (size_t)c->num_layers * layer;
}

const pd_model_config_t *pd_model_config(const pd_model_t *m)
{
    return &m->cfg;
}

size_t pd_model_weight_bytes(const pd_model_t *m)
{
    return m->weight_bytes;
}

pd_dtype_t pd_model_weight_dtype(const pd_model_t *m)
{
    return m->wdtype;
}

pd_dtype_t pd_model_linear_dtype(const pd_model_t *m)
{
    return m->ldtype;
}

static pd_status_t call_hook(pd_status_t (*fn)(void *, int), void *ctx, int layer, const char *what)
{
    if (fn == NULL) {
        return PD_OK;
    }
    pd_status_t st = fn(ctx, layer);
    if (st != PD_OK) {
        pd_log_warn("forward: %s hook failed at layer %d: %s", what, layer, pd_status_str(st));
    }
    return st;
}

pd_status_t pd_model_attention_block(pd_model_t *m, int layer, const pd_batch_t *batch,
                                     const pd_kv_view_t *kv, const pd_attn_meta_t *meta,
                                     const pd_forward_hooks_t *hooks, pd_activations_t *a)
{
    const pd_model_config_t *c = &m->cfg;
    const pd_layer_weights_t *w = &m->layers[layer];
    const pd_backend_ops_t *ops = m->be->ops;
    pd_backend_t *be = m->be;
    int T = batch->num_tokens, hid = c->hidden_size, hd = c->head_size;
    int qdim = c->num_heads * hd, kvdim = c->num_kv_heads * hd;
    PD_TRY(ops->matmul(be, a->q, a->h, w->wq, w->bq, T, qdim, hid));
    PD_TRY(ops->matmul(be, a->k, a->h, w->wk, w->bk, T, kvdim, hid));
    PD_TRY(ops->matmul(be, a->v, a->h, w->wv, w->bv, T, kvdim, hid));
    if (c->qk_norm) { /* Qwen3: each head of q and k RMSNormed over head_size before RoPE */
        PD_TRY(ops->rmsnorm(be, a->q, a->q, w->q_norm, T * c->num_heads, hd, c->norm_eps));
        PD_TRY(ops->rmsnorm(be, a->k, a->k, w->k_norm, T * c->num_kv_heads, hd, c->norm_eps));
    }
    bool sliding = c->sliding_layer[layer];
    if (c->arch == PD_ARCH_LLAMA) {
        const pd_rope_t *rope = sliding ? &m->rope_local : &m->rope;
        PD_TRY(ops->rope(be, a->q, batch->positions, T, c->num_heads, hd, rope));
        PD_TRY(ops->rope(be, a->k, batch->positions, T, c->num_kv_heads, hd, rope));
    }
    pd_attn_meta_t lm = *meta; /* this layer's KV cache group and window */
    if (meta->layer_group != NULL) {
        int32_t g = meta->layer_group[layer];
        lm.block_tables += (size_t)g * meta->num_seqs * meta->max_blocks_per_seq;
        lm.slot_mapping += (size_t)g * T;
        lm.layer_group = NULL;
    }
    lm.sliding_window = sliding ? c->sliding_window : 0; /* Gemma3's global layers see everything */
    PD_TRY(ops->reshape_and_cache(be, &kv[layer], a->k, a->v, lm.slot_mapping, T));
    const void *ctx = hooks != NULL ? hooks->ctx : NULL;
    if (hooks != NULL) {
        PD_TRY(call_hook(hooks->after_cache_write, (void *)ctx, layer, "after_cache_write"));
        PD_TRY(call_hook(hooks->before_attention, (void *)ctx, layer, "before_attention"));
    }
    int decode_only = meta->num_seqs == T;
    for (int s = 0; decode_only && s < meta->num_seqs; s++) {
        decode_only = meta->cu_seqlens_q[s + 1] - meta->cu_seqlens_q[s] == 1;
    }
    float scale = c->attn_scale > 0 ? c->attn_scale : 1.0f / sqrtf((float)hd);
    PD_TRY(decode_only
               ? ops->paged_attention_decode(be, a->attn, a->q, &kv[layer], &lm, c->num_heads, scale)
               : ops->paged_attention_prefill(be, a->attn, a->q, &kv[layer], &lm, c->num_heads, scale));
    /* o-projection into h (free now), then residual */
    PD_TRY(ops->matmul(be, a->h, a->attn, w->wo, w->bo, T, hid, qdim));
    if (w->post_attn_w != NULL) {
        PD_TRY(ops->rmsnorm(be, a->h, a->h, w->post_attn_w, T, hid, c->norm_eps));
    }
    return ops->add(be, a->x, a->h, (size_t)T * hid);
}

static pd_status_t check_batch(const pd_model_t *m, const pd_batch_t *batch, const pd_attn_meta_t *meta,
                               const int32_t *logits_indices, int num_logits)
{
    if (meta->num_tokens != batch->num_tokens) {
        pd_log_error("forward: batch has %d tokens, attention metadata %d", batch->num_tokens,
                     meta->num_tokens);
        return PD_ERR_INVALID_ARG;
    }
    if (meta->sliding_window != m->cfg.sliding_window) { /* the window is the model's, not the caller's */
        pd_log_error("forward: attention metadata has sliding window %d, the model %d", meta->sliding_window,
                     m->cfg.sliding_window);
        return PD_ERR_INVALID_ARG;
    }
    for (int i = 0; i < batch->num_tokens; i++) {
        int32_t p = batch->positions[i];
        if (p < 0 || (m->cfg.arch == PD_ARCH_GPT2 && p >= m->cfg.max_position_embeddings)) {
            pd_log_error("forward: position %d of token %d is outside [0, %d)", p, i,
                         m->cfg.max_position_embeddings);
            return PD_ERR_OUT_OF_RANGE;
        }
    }
    if (num_logits > batch->num_tokens) {
        pd_log_error("forward: %d logits rows requested from a batch of %d tokens", num_logits,
                     batch->num_tokens);
        return PD_ERR_INVALID_ARG;
    }
    for (int i = 0; i < num_logits; i++) {
        if (logits_indices[i] < 0 || logits_indices[i] >= batch->num_tokens) {
            pd_log_error("forward: logits index %d is outside the batch of %d tokens", logits_indices[i],
                         batch->num_tokens);
            return PD_ERR_OUT_OF_RANGE;
        }
    }
    return PD_OK;
}

pd_status_t pd_model_forward(pd_model_t *m, const pd_batch_t *batch, const pd_kv_view_t *kv,
                             const pd_attn_meta_t *meta, const int32_t *logits_indices, int num_logits,
                             const pd_forward_hooks_t *hooks, float *logits_out)
{
    const pd_model_config_t *c = &m->cfg;
    pd_backend_t *be = m->be;
    const pd_backend_ops_t *ops = be->ops;
    PD_TRY(check_batch(m, batch, meta, logits_indices, num_logits));
    size_t T = (size_t)batch->num_tokens, hid = (size_t)c->hidden_size;
    size_t qdim = (size_t)c->num_heads * c->head_size, kvdim = (size_t)c->num_kv_heads * c->head_size;
    size_t inter = (size_t)c->intermediate_size, V = (size_t)c->vocab_size, L = (size_t)num_logits;
    size_t up_width = c->arch == PD_ARCH_LLAMA ? 2 * inter : inter;
    /* the workspace persists across steps (a fresh allocation per step costs page faults on
     * every step); it only grows, and through the backend allocator so profiling sees it */
    size_t need = pd_model_workspace_bytes(c, T, L);
    if (need > m->work_bytes) {
        ops->free(be, m->work);
        m->work = NULL;
        m->work_bytes = 0;
        PD_TRY(ops->alloc(be, need, &m->work));
        m->work_bytes = need;
    }
    void *buf = m->work;
    pd_activations_t a;
    a.x = buf;
    a.h = a.x + T * hid;
    a.q = a.h + T * hid;
    a.k = a.q + T * qdim;
    a.v = a.k + T * kvdim;
    a.attn = a.v + T * kvdim;
    a.up = a.attn + T * qdim;
    a.act = a.up + T * up_width;

    pd_status_t st =
        ops->embed(be, a.x, m->embed, m->embed_scale, batch->token_ids, (int)T, (int)hid, c->vocab_size);
    if (st == PD_OK && c->arch == PD_ARCH_GPT2) {
        st = ops->embed(be, a.h, m->pos_embed, 1.0f, batch->positions, (int)T, (int)hid,
                        c->max_position_embeddings);
        if (st == PD_OK) {
            st = ops->add(be, a.x, a.h, T * hid);
        }
    }
    for (int l = 0; st == PD_OK && l < c->num_layers; l++) {
        st = c->arch == PD_ARCH_GPT2 ? pd_gpt2_layer(m, l, batch, kv, meta, hooks, &a)
                                     : pd_llama_layer(m, l, batch, kv, meta, hooks, &a);
    }
    if (st == PD_OK && L > 0) {
        /* gather the rows that need logits into h, norm them, project to the vocabulary */
        float *rows = a.h;
        for (size_t i = 0; st == PD_OK && i < L; i++) {
            st = ops->copy(be, rows + i * hid, a.x + (size_t)logits_indices[i] * hid, hid * sizeof(float),
                           PD_COPY_D2D);
        }
        float *normed = a.x; /* x is no longer needed */
        if (st == PD_OK) {
            st = c->arch == PD_ARCH_GPT2
                     ? ops->layernorm(be, normed, rows, m->final_w, m->final_b, (int)L, (int)hid, c->norm_eps)
                     : ops->rmsnorm(be, normed, rows, m->final_w, (int)L, (int)hid, c->norm_eps);
        }
        float *logits = a.x + L * hid; /* after the normed rows; the buffer holds L·(hid + V) */
        if (st == PD_OK) {
            st = ops->matmul(be, logits, normed, m->lm_head, NULL, (int)L, (int)V, (int)hid);
        }
        if (st == PD_OK) {
            st = ops->copy(be, logits_out, logits, L * V * sizeof(float), PD_COPY_D2H);
        }
    }
    return st;
}
