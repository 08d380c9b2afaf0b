#!/usr/bin/env python3
"""Held-out perplexity of a served model, through its OpenAI API's prompt_logprobs.

    tools/eval-ppl.py --url http://127.0.0.1:8000 --text models/sotu-demo/heldout-sample.txt
    tools/eval-ppl.py --url ... --text ... --torch models/sotu-demo    # and PyTorch's, on the same ids

The text is tokenized by the server (/tokenize, no special tokens) and cut into windows of
--ctx - 1 tokens; each window is sent as [<bos>] + window with max_tokens 1 and prompt_logprobs 0,
and every window token's logprob counts (and its rank: top-1 accuracy is the share ranked first). Works against pd-serve, pd-proxy (P/D) and vLLM.

With --torch DIR the same windows are scored by tools/train-demo-model.py's Llama on DIR's bf16
weights (fp32 compute), and the run fails when the two mean NLLs differ by more than --tol
(perplexities equal within a relative --tol). Prints one JSON line; stdlib only without --torch."""

import argparse
import importlib.util
import json
import math
import os
import sys
import time
import urllib.request


def post(url, path, body, key, timeout):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        sys.exit(f"eval-ppl: {path}: HTTP {e.code}: {e.read().decode(errors='replace')[:400]}")


def torch_nll(model_dir, windows):
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("train_demo_model", os.path.join(here, "train-demo-model.py"))
    tdm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tdm)
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(2)
    model = tdm.load_model(model_dir)
    total = 0.0
    with torch.no_grad():
        for w in windows:
            t = torch.tensor([w])
            total += F.cross_entropy(model(t)[0, :-1].double(), t[0, 1:], reduction="sum").item()
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="the server's base URL (http://127.0.0.1:PORT)")
    ap.add_argument("--text", required=True, help="a UTF-8 text file")
    ap.add_argument("--model", help="the model name to send (default: the server's first)")
    ap.add_argument("--ctx", type=int, default=256, help="tokens per request, <bos> included")
    ap.add_argument("--max-tokens", type=int, default=0, help="score at most this many text tokens (0: all)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--torch", metavar="DIR", help="also score with PyTorch on DIR's weights and compare")
    ap.add_argument("--tol", type=float, default=1e-3, help="largest |mean NLL difference| with --torch")
    ap.add_argument("--label", default="", help="a name for this run in the JSON line")
    args = ap.parse_args()
    if args.ctx < 2:
        ap.error("--ctx must be at least 2")
    url = args.url.rstrip("/")
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    model = args.model
    if not model:
        req = urllib.request.Request(url + "/v1/models")
        if args.api_key:
            req.add_header("Authorization", f"Bearer {args.api_key}")
        with urllib.request.urlopen(req, timeout=args.timeout) as r:
            model = json.load(r)["data"][0]["id"]
    ids = post(url, "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False}, args.api_key,
               args.timeout)["tokens"]
    bos = post(url, "/tokenize", {"model": model, "prompt": "", "add_special_tokens": True}, args.api_key,
               args.timeout)["tokens"]
    if len(bos) != 1:
        sys.exit(f"eval-ppl: the tokenizer adds {len(bos)} special tokens to an empty prompt, expected one <bos>")
    if args.max_tokens:
        ids = ids[: args.max_tokens]
    step = args.ctx - 1
    windows = [bos + ids[s : s + step] for s in range(0, len(ids), step)]
    total, n, top1, t0 = 0.0, 0, 0, time.time()
    for w in windows:
        r = post(url, "/v1/completions",
                 {"model": model, "prompt": w, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0},
                 args.api_key, args.timeout)
        plp = r["choices"][0].get("prompt_logprobs")
        if not plp or len(plp) != len(w) or plp[0] is not None:
            sys.exit(f"eval-ppl: prompt_logprobs has {len(plp or [])} entries for a {len(w)}-token prompt")
        for tok, entry in zip(w[1:], plp[1:]):
            lp = entry.get(str(tok))
            if lp is None:
                sys.exit(f"eval-ppl: prompt_logprobs lacks the prompt's own token {tok}")
            total -= lp["logprob"]
            top1 += lp.get("rank") == 1
            n += 1
    out = {"label": args.label, "model": model, "tokens": n, "windows": len(windows), "ctx": args.ctx,
           "nll": total / n, "ppl": math.exp(total / n), "top1": top1 / n, "seconds": round(time.time() - t0, 2)}
    rc = 0
    if args.torch:
        ref = torch_nll(args.torch, windows) / n
        out.update({"torch_nll": ref, "torch_ppl": math.exp(ref), "nll_diff": total / n - ref})
        if abs(total / n - ref) > args.tol:
            rc = 1
    print(json.dumps(out), flush=True)
    if rc:
        print(f"eval-ppl: mean NLL {total / n:.6f} differs from PyTorch's {out['torch_nll']:.6f} by more than "
              f"{args.tol}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
