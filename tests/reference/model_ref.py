#!/usr/bin/env python3
"""Independent NumPy forward pass of GPT2LMHeadModel / LlamaForCausalLM / MistralForCausalLM /
Qwen2ForCausalLM / Qwen3ForCausalLM / Gemma3ForCausalLM,
written from the Hugging Face modeling code's semantics (not from pdserve's C code).

usage: model_ref.py MODEL_DIR OUT.f32 TOKEN_ID...
Writes the logits of every position as float32 [num_tokens][vocab] to OUT.f32 (no KV cache:
one full causal forward in float64, so it is the reference for both cached and uncached runs).
"""
import json
import math
import struct
import sys

import numpy as np


def load_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen])
    data = raw[8 + hlen :]
    out = {}
    for name, d in header.items():
        if name == "__metadata__":
            continue
        b, e = d["data_offsets"]
        buf = data[b:e]
        if d["dtype"] == "F32":
            a = np.frombuffer(buf, dtype="<f4")
        elif d["dtype"] == "F16":
            a = np.frombuffer(buf, dtype="<f2").astype(np.float32)
        elif d["dtype"] == "BF16":
            a = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError(d["dtype"])
        out[name] = a.reshape(d["shape"]).astype(np.float64)
    return out


def load_weights(model_dir):
    import os

    idx = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        w = {}
        for fn in files:
            w.update(load_safetensors(os.path.join(model_dir, fn)))
        return w
    return load_safetensors(os.path.join(model_dir, "model.safetensors"))


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def gelu_new(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def causal_attention(q, k, v, window=0, scale=None):
    # q [T][H][D], k/v [T][KV][D]; GQA: head h uses kv head h // (H // KV)
    T, H, D = q.shape
    KV = k.shape[1]
    rep = H // KV
    k = np.repeat(k, rep, axis=1)
    v = np.repeat(v, rep, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) * (scale if scale is not None else 1.0 / np.sqrt(D))
    i = np.arange(T)[:, None]
    j = np.arange(T)[None, :]
    mask = j > i
    if window > 0:
        mask |= j <= i - window
    scores = np.where(mask[None], -np.inf, scores)
    scores -= scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, v)


def rope_table(cfg, D):
    """Inverse frequencies and cos/sin scale for cfg's rope_theta and rope_scaling, written after
    transformers' ROPE_INIT_FUNCTIONS (default, linear, llama3, yarn) and vLLM's static dynamic-NTK
    table (the base for max_position_embeddings * factor)."""
    base = cfg.get("rope_theta", 10000.0)
    rs = cfg.get("rope_scaling") or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    factor = rs.get("factor", 1.0)
    maxpos = cfg.get("max_position_embeddings", 2048)
    omax = rs.get("original_max_position_embeddings", maxpos)
    expo = np.arange(0, D, 2, dtype=np.float64) / D
    if kind == "dynamic":
        max_len = maxpos * factor
        base = base * (factor * max_len / maxpos - (factor - 1)) ** (D / (D - 2))
    inv = 1.0 / base**expo
    scale = 1.0
    if kind == "linear":
        inv = inv / factor
    elif kind == "llama3":
        lo, hi = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        wavelen = 2 * math.pi / inv
        smooth = (omax / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv / factor + smooth * inv
        inv = np.where(wavelen < omax / hi, inv, np.where(wavelen > omax / lo, inv / factor, smoothed))
    elif kind == "yarn":
        def mscale(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        def correction_dim(rot):
            return (D * math.log(omax / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(rs.get("beta_fast", 32)), correction_dim(rs.get("beta_slow", 1))
        if rs.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, D - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(D // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        keep = 1 - ramp
        inv = (1.0 / (factor * base**expo)) * (1 - keep) + (1.0 / base**expo) * keep
        if rs.get("attention_factor") is not None:
            scale = rs["attention_factor"]
        elif rs.get("mscale") and rs.get("mscale_all_dim"):
            scale = mscale(factor, rs["mscale"]) / mscale(factor, rs["mscale_all_dim"])
        else:
            scale = mscale(factor)
    elif kind not in ("default", "dynamic"):
        raise SystemExit(f"unsupported rope_scaling {kind}")
    return inv, scale


def rope(x, pos, table):
    # HF rotate_half convention: pairs (i, i + D/2)
    inv_freq, scale = table
    D = x.shape[-1]
    ang = pos[:, None] * inv_freq[None, :]
    cos = np.concatenate([np.cos(ang), np.cos(ang)], -1)[:, None, :] * scale
    sin = np.concatenate([np.sin(ang), np.sin(ang)], -1)[:, None, :] * scale
    half = D // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def gpt2_forward(cfg, w, ids):
    p = "transformer." if "transformer.wte.weight" in w else ""
    T = len(ids)
    H = cfg["n_embd"]
    nh = cfg["n_head"]
    hd = H // nh
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    x = w[p + "wte.weight"][ids] + w[p + "wpe.weight"][np.arange(T)]
    for l in range(cfg["n_layer"]):
        g = lambda s: w[f"{p}h.{l}.{s}"]
        h = layer_norm(x, g("ln_1.weight"), g("ln_1.bias"), eps)
        qkv = h @ g("attn.c_attn.weight") + g("attn.c_attn.bias")  # Conv1D: x @ W[in][out]
        q, k, v = np.split(qkv, 3, axis=-1)
        a = causal_attention(q.reshape(T, nh, hd), k.reshape(T, nh, hd), v.reshape(T, nh, hd))
        x = x + a.reshape(T, H) @ g("attn.c_proj.weight") + g("attn.c_proj.bias")
        h = layer_norm(x, g("ln_2.weight"), g("ln_2.bias"), eps)
        m = gelu_new(h @ g("mlp.c_fc.weight") + g("mlp.c_fc.bias"))
        x = x + m @ g("mlp.c_proj.weight") + g("mlp.c_proj.bias")
    x = layer_norm(x, w[p + "ln_f.weight"], w[p + "ln_f.bias"], eps)
    lm = w.get("lm_head.weight", w[p + "wte.weight"]) if not cfg.get("tie_word_embeddings", True) else w[p + "wte.weight"]
    return x @ lm.T


def llama_forward(cfg, w, ids, arch):
    T = len(ids)
    H = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", nh)
    hd = cfg.get("head_dim", H // nh)
    eps = cfg.get("rms_norm_eps", 1e-6)
    table = rope_table(cfg, hd)
    if arch == "MistralForCausalLM":
        window = cfg.get("sliding_window") or 0
    else:
        window = cfg.get("sliding_window", 0) if cfg.get("use_sliding_window", False) else 0
    pos = np.arange(T, dtype=np.float64)
    x = w["model.embed_tokens.weight"][ids]
    for l in range(cfg["num_hidden_layers"]):
        g = lambda s: w[f"model.layers.{l}.{s}"]
        b = lambda s: w.get(f"model.layers.{l}.{s}", 0.0)
        h = rms_norm(x, g("input_layernorm.weight"), eps)
        q = h @ g("self_attn.q_proj.weight").T + b("self_attn.q_proj.bias")
        k = h @ g("self_attn.k_proj.weight").T + b("self_attn.k_proj.bias")
        v = h @ g("self_attn.v_proj.weight").T + b("self_attn.v_proj.bias")
        q, k = q.reshape(T, nh, hd), k.reshape(T, kv, hd)
        if arch == "Qwen3ForCausalLM":  # Qwen3Attention: q_norm / k_norm over head_dim before RoPE
            q = rms_norm(q, g("self_attn.q_norm.weight"), eps)
            k = rms_norm(k, g("self_attn.k_norm.weight"), eps)
        q = rope(q, pos, table)
        k = rope(k, pos, table)
        a = causal_attention(q, k, v.reshape(T, kv, hd), window)
        x = x + a.reshape(T, nh * hd) @ g("self_attn.o_proj.weight").T + b("self_attn.o_proj.bias")
        h = rms_norm(x, g("post_attention_layernorm.weight"), eps)
        gate = h @ g("mlp.gate_proj.weight").T
        up = h @ g("mlp.up_proj.weight").T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ g("mlp.down_proj.weight").T
    x = rms_norm(x, w["model.norm.weight"], eps)
    lm = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings", False) else w["lm_head.weight"]
    return x @ lm.T


def gemma3_forward(cfg, w, ids):
    """Gemma3ForCausalLM (text): Gemma3RMSNorm scales by (1 + w); embeddings × sqrt(hidden); q/k norms;
    local (sliding) layers rotate with rope_local_base_freq and no scaling, global ones with rope_theta
    and rope_scaling; attention scaled by query_pre_attn_scalar^-0.5; norms after attention and around
    the GELU-tanh gated MLP."""
    T = len(ids)
    H = cfg["hidden_size"]
    L = cfg["num_hidden_layers"]
    nh = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", nh)
    hd = cfg.get("head_dim", 256)
    eps = cfg.get("rms_norm_eps", 1e-6)
    norm = lambda x, wt: rms_norm(x, 1.0 + wt, eps)
    glob = rope_table(cfg, hd)
    loc = rope_table(dict(cfg, rope_theta=cfg.get("rope_local_base_freq", 10000.0), rope_scaling=None), hd)
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("sliding_window_pattern", 6) == 0 else "sliding_attention"
        for i in range(L)
    ]
    scale = cfg.get("query_pre_attn_scalar", hd) ** -0.5
    window = cfg.get("sliding_window", 4096)
    pos = np.arange(T, dtype=np.float64)
    x = w["model.embed_tokens.weight"][ids] * np.sqrt(H)
    for l in range(L):
        g = lambda s: w[f"model.layers.{l}.{s}"]
        sliding = types[l] == "sliding_attention"
        table = loc if sliding else glob
        h = norm(x, g("input_layernorm.weight"))
        q = norm((h @ g("self_attn.q_proj.weight").T).reshape(T, nh, hd), g("self_attn.q_norm.weight"))
        k = norm((h @ g("self_attn.k_proj.weight").T).reshape(T, kv, hd), g("self_attn.k_norm.weight"))
        v = (h @ g("self_attn.v_proj.weight").T).reshape(T, kv, hd)
        a = causal_attention(rope(q, pos, table), rope(k, pos, table), v, window if sliding else 0, scale)
        x = x + norm(a.reshape(T, nh * hd) @ g("self_attn.o_proj.weight").T, g("post_attention_layernorm.weight"))
        h = norm(x, g("pre_feedforward_layernorm.weight"))
        m = (gelu_new(h @ g("mlp.gate_proj.weight").T) * (h @ g("mlp.up_proj.weight").T)) @ g("mlp.down_proj.weight").T
        x = x + norm(m, g("post_feedforward_layernorm.weight"))
    x = norm(x, w["model.norm.weight"])
    lm = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings", True) else w["lm_head.weight"]
    return x @ lm.T


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    ids = np.array([int(t) for t in sys.argv[3:]], dtype=np.int64)
    with open(f"{model_dir}/config.json") as f:
        cfg = json.load(f)
    w = load_weights(model_dir)
    arch = cfg["architectures"][0]
    if arch == "GPT2LMHeadModel":
        logits = gpt2_forward(cfg, w, ids)
    elif arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        logits = llama_forward(cfg, w, ids, arch)
    elif arch == "Gemma3ForCausalLM":
        logits = gemma3_forward(cfg, w, ids)
    else:
        raise SystemExit(f"unsupported architecture {arch}")
    logits.astype("<f4").tofile(out)


if __name__ == "__main__":
    main()
