#!/usr/bin/env python3
"""tools/gpu_kit_hf.py — the torch side of tools/gpu_kit_run.py, run with the host's own libraries.

  gpu_kit_hf.py QUERY.json   QUERY: {"model": DIR, "prompts": [[ids]], "device": "cuda"|"cpu"}. Loads DIR
                             (a pd-mkmodel safetensors model) with HF transformers in fp32 and prints, as the
                             last line, {"arch", "version", "device", "logprobs": [[null, log p(t_i | t_<i)...]]}
                             With "reference": "numpy" (the dry run, no torch): tests/reference/model_ref.py's
                             NumPy forward pass instead, labelled as such
  gpu_kit_hf.py --ceilings   the same-run ceilings: device-to-device copy GB/s (bytes read + written) and
                             an 8192^3 bf16 matrix product's TFLOP/s through cuBLAS (torch.matmul)
"""
import json
import sys
import time


def ceilings():
    import torch
    dev = torch.device("cuda")
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.time()
    reps = 20
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize()
    copy = 2 * n * reps / (time.time() - t) / 1e9
    del a, b
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    y = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    for _ in range(3):
        x @ y
    torch.cuda.synchronize()
    t = time.time()
    for _ in range(10):
        x @ y
    torch.cuda.synchronize()
    tflops = 2 * m ** 3 * 10 / (time.time() - t) / 1e12
    print("device-to-device copy %.0f GB/s; bf16 GEMM 8192^3 %.0f TFLOP/s (%s)" %
          (copy, tflops, torch.cuda.get_device_name(0)))


def numpy_logprobs(q):
    import os
    import numpy as np
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "reference"))
    import model_ref
    cfg = json.load(open(os.path.join(q["model"], "config.json")))
    w = model_ref.load_weights(q["model"])
    out = []
    for p in q["prompts"]:
        logits = model_ref.llama_forward(cfg, w, np.array(p, dtype=np.int64), cfg["architectures"][0]).astype(np.float64)
        m = logits.max(axis=-1, keepdims=True)
        lp = logits - m - np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))
        out.append([None] + [float(lp[i - 1, p[i]]) for i in range(1, len(p))])
    print(json.dumps({"arch": cfg["architectures"][0], "version": "NumPy " + np.__version__ + " (model_ref.py)",
                      "device": "cpu", "logprobs": out}))


def logprobs(query):
    q = json.load(open(query))
    if q.get("reference") == "numpy":
        return numpy_logprobs(q)
    import torch
    import transformers
    dev = torch.device(q["device"])
    model = transformers.AutoModelForCausalLM.from_pretrained(q["model"], dtype=torch.float32).to(dev).eval()
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 as pd-serve's default --matmul-precision
    out = []
    with torch.no_grad():
        for p in q["prompts"]:
            ids = torch.tensor([p], device=dev)
            lp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            out.append([None] + [lp[i - 1, p[i]].item() for i in range(1, len(p))])
    print(json.dumps({"arch": model.config.architectures[0], "version": "transformers " + transformers.__version__,
                      "device": str(dev), "logprobs": out}))


if __name__ == "__main__":
    if sys.argv[1:] == ["--ceilings"]:
        ceilings()
    elif len(sys.argv) == 2:
        logprobs(sys.argv[1])
    else:
        sys.exit(__doc__)
