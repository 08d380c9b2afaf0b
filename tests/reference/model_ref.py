#!/usr/bin/env python3
"""Independent NumPy forward pass of GPT2LMHeadModel / LlamaForCausalLM / Qwen2ForCausalLM,
written from the Hugging Face modeling code's semantics (not from pdserve's C code).

usage: model_ref.py MODEL_DIR OUT.f32 TOKEN_ID...
Writes the logits of every position as float32 [num_tokens][vocab] to OUT.f32 (no KV cache:
one full causal forward in float64, so it is the reference for both cached and uncached runs).
"""
import json
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


def causal_attention(q, k, v, window=0):
    # q [T][H][D], k/v [T][KV][D]; GQA: head h uses kv head h // (H // KV)
    T, H, D = q.shape
    KV = k.shape[1]
    rep = H // KV
    k = np.repeat(k, rep, axis=1)
    v = np.repeat(v, rep, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(D)
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


def rope(x, pos, theta):
    # HF rotate_half convention: pairs (i, i + D/2)
    D = x.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    ang = pos[:, None] * inv_freq[None, :]
    cos = np.concatenate([np.cos(ang), np.cos(ang)], -1)[:, None, :]
    sin = np.concatenate([np.sin(ang), np.sin(ang)], -1)[:, None, :]
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


def llama_forward(cfg, w, ids, qwen2):
    T = len(ids)
    H = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", nh)
    hd = cfg.get("head_dim", H // nh)
    eps = cfg.get("rms_norm_eps", 1e-6)
    theta = cfg.get("rope_theta", 10000.0)
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
        q = rope(q.reshape(T, nh, hd), pos, theta)
        k = rope(k.reshape(T, kv, hd), pos, theta)
        a = causal_attention(q, k, v.reshape(T, kv, hd), window)
        x = x + a.reshape(T, nh * hd) @ g("self_attn.o_proj.weight").T + b("self_attn.o_proj.bias")
        h = rms_norm(x, g("post_attention_layernorm.weight"), eps)
        gate = h @ g("mlp.gate_proj.weight").T
        up = h @ g("mlp.up_proj.weight").T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ g("mlp.down_proj.weight").T
    x = rms_norm(x, w["model.norm.weight"], eps)
    lm = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings", False) else w["lm_head.weight"]
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
    elif arch in ("LlamaForCausalLM", "Qwen2ForCausalLM"):
        logits = llama_forward(cfg, w, ids, arch == "Qwen2ForCausalLM")
    else:
        raise SystemExit(f"unsupported architecture {arch}")
    logits.astype("<f4").tofile(out)


if __name__ == "__main__":
    main()
