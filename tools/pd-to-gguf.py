#!/usr/bin/env python3
"""tools/pd-to-gguf.py MODEL_DIR OUT.gguf — a Llama-architecture model directory (config.json,
model.safetensors, tokenizer.json; pd-mkmodel writes these) as a GGUF file for llama.cpp, so that
llama.cpp runs the same weights beside pdserve (bench/llamacpp-baseline.sh).

Written from the GGUF specification (ggml's docs/gguf.md, version 3) and the tensor and key names of
llama.cpp's LLM_ARCH_LLAMA; no gguf package, no numpy (standard library only). What it does:
  * matrices keep their dtype (bf16 stays bf16: GGML_TYPE_BF16; fp16 F16; fp32 F32), bytes as stored;
    a Linear weight [out][in] is the GGUF tensor of dims [in, out], the same row-major bytes;
  * 1-D tensors (norm weights) become F32, as llama.cpp's converter writes them;
  * q_proj and k_proj rows are permuted per head from HF's rotate-half RoPE order to the interleaved
    pairs llama.cpp's LLAMA rope reads (what convert_hf_to_gguf.py's LlamaModel.permute does):
    row h·d + 2i + j of the output is row h·d + j·d/2 + i of the input, d the head size;
  * the byte-level BPE tokenizer goes in as tokenizer.ggml.model "gpt2" with its tokens, merges
    and pre-tokenizer "llama-bpe" (the Llama-3 split regex pd-mkmodel's tokenizers use); added
    special tokens are CONTROL.
Refuses (exit 2, one line on stderr) anything else: another architecture, a tied lm_head missing
from the file is fine (llama.cpp ties when output.weight is absent), biases are not. """
import json
import struct
import sys

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGN = 32
# gguf value types
T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY = 4, 5, 6, 7, 8, 9
# ggml tensor types
GGML_F32, GGML_F16, GGML_BF16 = 0, 1, 30
FILE_TYPE = {"F32": 0, "F16": 1, "BF16": 32}  # llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_BF16
GGML_OF = {"F32": GGML_F32, "F16": GGML_F16, "BF16": GGML_BF16}
ELEM = {"F32": 4, "F16": 2, "BF16": 2}
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3


def fail(msg):
    sys.stderr.write("pd-to-gguf: %s\n" % msg)
    sys.exit(2)


def gstr(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, value):
    out = gstr(key) + struct.pack("<I", vtype)
    if vtype == T_STRING:
        return out + gstr(value)
    if vtype == T_ARRAY:
        etype, items = value
        out += struct.pack("<IQ", etype, len(items))
        if etype == T_STRING:
            return out + b"".join(gstr(x) for x in items)
        fmt = {T_INT32: "<i", T_FLOAT32: "<f", T_UINT32: "<I"}[etype]
        return out + b"".join(struct.pack(fmt, x) for x in items)
    fmt = {T_UINT32: "<I", T_INT32: "<i", T_FLOAT32: "<f", T_BOOL: "<?"}[vtype]
    return out + struct.pack(fmt, value)


def read_safetensors(path):
    f = open(path, "rb")
    head = f.read(8)
    if len(head) != 8:
        fail("%s: truncated header" % path)
    (n,) = struct.unpack("<Q", head)
    meta = json.loads(f.read(n))
    meta.pop("__metadata__", None)
    return f, 8 + n, meta


def tensor_bytes(f, base, info):
    a, b = info["data_offsets"]
    f.seek(base + a)
    data = f.read(b - a)
    if len(data) != b - a:
        fail("truncated tensor data")
    return data


def to_f32(data, dtype):
    if dtype == "F32":
        return data
    if dtype == "BF16":  # bf16 is the high half of an fp32
        out = bytearray(len(data) * 2)
        out[2::4] = data[0::2]
        out[3::4] = data[1::2]
        return bytes(out)
    if dtype == "F16":
        vals = struct.unpack("<%de" % (len(data) // 2), data)
        return struct.pack("<%df" % len(vals), *vals)
    fail("dtype %s not supported" % dtype)


def permute_rope(data, rows, cols, n_head, elem):
    """Rows of [rows][cols] from rotate-half order to interleaved pairs, per head."""
    d = rows // n_head
    rb = cols * elem
    out = bytearray(len(data))
    for h in range(n_head):
        for i in range(d // 2):
            for j in range(2):
                src = h * d + j * (d // 2) + i
                dst = h * d + 2 * i + j
                out[dst * rb:(dst + 1) * rb] = data[src * rb:(src + 1) * rb]
    return bytes(out)


def main():
    if len(sys.argv) != 3:
        fail("usage: tools/pd-to-gguf.py MODEL_DIR OUT.gguf")
    mdir, out_path = sys.argv[1], sys.argv[2]
    cfg = json.load(open(mdir + "/config.json"))
    if cfg.get("model_type") != "llama":
        fail("model_type %r: only llama is converted" % cfg.get("model_type"))
    tok = json.load(open(mdir + "/tokenizer.json"))
    if tok["model"]["type"] != "BPE":
        fail("tokenizer model %r: only byte-level BPE is converted" % tok["model"]["type"])
    f, base, meta = read_safetensors(mdir + "/model.safetensors")
    if any(k.endswith(".bias") for k in meta):
        fail("biases are not converted (a llama checkpoint has none)")

    hidden = cfg["hidden_size"]
    n_head = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads", n_head)
    vocab = cfg["vocab_size"]
    layers = cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim", hidden // n_head)

    # the tokenizer: ids 0..vocab-1, every one named
    tokens = [None] * vocab
    types = [TOKEN_NORMAL] * vocab
    for s, i in tok["model"]["vocab"].items():
        if i < vocab:
            tokens[i] = s
    for t in tok.get("added_tokens", []):
        if t["id"] < vocab:
            tokens[t["id"]] = t["content"]
            types[t["id"]] = TOKEN_CONTROL if t.get("special") else TOKEN_NORMAL
    for i in range(vocab):
        if tokens[i] is None:  # ids the tokenizer never makes (vocab padded): unused placeholders
            tokens[i] = "[PAD%d]" % i
            types[i] = TOKEN_CONTROL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]

    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for l in range(layers):
        for a, b in per_layer.items():
            names["model.layers.%d.%s" % (l, a)] = "blk.%d.%s" % (l, b)
    unknown = sorted(set(meta) - set(names))
    if unknown:
        fail("tensor %s has no llama.cpp name" % unknown[0])

    wdtype = meta["model.embed_tokens.weight"]["dtype"]
    if wdtype not in GGML_OF:
        fail("weight dtype %s not supported" % wdtype)
    keys = [
        kv("general.architecture", T_STRING, "llama"),
        kv("general.name", T_STRING, mdir.rstrip("/").split("/")[-1]),
        kv("general.alignment", T_UINT32, ALIGN),
        kv("general.file_type", T_UINT32, FILE_TYPE[wdtype]),
        kv("llama.context_length", T_UINT32, cfg.get("max_position_embeddings", 4096)),
        kv("llama.embedding_length", T_UINT32, hidden),
        kv("llama.block_count", T_UINT32, layers),
        kv("llama.feed_forward_length", T_UINT32, cfg["intermediate_size"]),
        kv("llama.attention.head_count", T_UINT32, n_head),
        kv("llama.attention.head_count_kv", T_UINT32, n_kv),
        kv("llama.attention.key_length", T_UINT32, head_dim),
        kv("llama.attention.value_length", T_UINT32, head_dim),
        kv("llama.attention.layer_norm_rms_epsilon", T_FLOAT32, cfg.get("rms_norm_eps", 1e-6)),
        kv("llama.rope.freq_base", T_FLOAT32, cfg.get("rope_theta", 10000.0)),
        kv("llama.rope.dimension_count", T_UINT32, head_dim),
        kv("llama.vocab_size", T_UINT32, vocab),
        kv("tokenizer.ggml.model", T_STRING, "gpt2"),
        kv("tokenizer.ggml.pre", T_STRING, "llama-bpe"),
        kv("tokenizer.ggml.tokens", T_ARRAY, (T_STRING, tokens)),
        kv("tokenizer.ggml.token_type", T_ARRAY, (T_INT32, types)),
        kv("tokenizer.ggml.merges", T_ARRAY, (T_STRING, merges)),
    ]
    for key, cfg_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        v = cfg.get(cfg_key)
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            keys.append(kv("tokenizer.ggml." + key, T_UINT32, v))
    keys.append(kv("tokenizer.ggml.add_bos_token", T_BOOL, True))

    # tensor infos, then data, each tensor aligned
    order = sorted(meta, key=lambda k: (0, -1, k) if not k.startswith("model.layers.")
                   else (1, int(k.split(".")[2]), k))
    infos, offset, plan = [], 0, []
    for k in order:
        info = meta[k]
        dt, shape = info["dtype"], info["shape"]
        if dt not in GGML_OF:
            fail("%s: dtype %s not supported" % (k, dt))
        one_d = len(shape) == 1
        gtype = GGML_F32 if one_d else GGML_OF[dt]
        nbytes = (4 if one_d else ELEM[dt])
        for s in shape:
            nbytes *= s
        dims = list(reversed(shape))
        infos.append(gstr(names[k]) + struct.pack("<I", len(dims)) +
                     b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", gtype, offset))
        plan.append((k, one_d, nbytes))
        offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN

    with open(out_path, "wb") as out:
        out.write(GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, len(order), len(keys)))
        out.write(b"".join(keys))
        out.write(b"".join(infos))
        pad = (-out.tell()) % ALIGN
        out.write(b"\0" * pad)
        for k, one_d, nbytes in plan:
            info = meta[k]
            data = tensor_bytes(f, base, info)
            if one_d:
                data = to_f32(data, info["dtype"])
            elif k.endswith("q_proj.weight") or k.endswith("k_proj.weight"):
                heads = n_head if k.endswith("q_proj.weight") else n_kv
                data = permute_rope(data, info["shape"][0], info["shape"][1], heads, ELEM[info["dtype"]])
            if len(data) != nbytes:
                fail("%s: %d bytes, expected %d" % (k, len(data), nbytes))
            out.write(data)
            out.write(b"\0" * ((-nbytes) % ALIGN))
    sys.stderr.write("pd-to-gguf: %s: %d tensors, %d keys, %.1f MiB\n" %
                     (out_path, len(order), len(keys), offset / 2**20))


if __name__ == "__main__":
    main()
