#!/usr/bin/env python
"""What the first forward pass of a fresh process spends, in one process on the GPU.

    python benchmarks/forward_probe.py /root/startup_ckpt [--warm] [--device cuda:0]

Builds the checkpoint's model on meta, gives it uninitialised storage (no load: the weights'
values do not matter here) and times, with --warm, first the one-time costs a forward pays on
its first call - the cuBLAS handle (first GEMM), the GEMMs of the other weight shapes, the
attention kernel - then forwards 1, 2 and 3 of one token. Without --warm forward 1 pays them
itself. Prints one JSON line. Answers: how much of startup's "first forward" a thread could
pay while the weights stream (issue 6, variant 2bk).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("directory")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--warm", action="store_true")
    args = ap.parse_args()
    out: dict[str, float] = {}
    t = time.perf_counter()

    def lap(key: str) -> None:
        nonlocal t
        now = time.perf_counter()
        out[key] = round(now - t, 4)
        t = now

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    lap("imports")
    dev = args.device
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    if dev.startswith("cuda"):
        torch.cuda.init()
        torch.empty(1, device=dev)
        sync()
    lap("cuda_init")
    config = AutoConfig.from_pretrained(args.directory)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    torch.set_default_dtype(torch.float32)
    model.to_empty(device=dev)
    for mod in model.modules():   # rotary tables: no checkpoint holds them
        if "inv_freq" in getattr(mod, "_buffers", {}):
            with torch.device(dev):
                fresh = type(mod)(getattr(mod, "config", config))
            mod._buffers["inv_freq"] = fresh.inv_freq
    model.eval()
    sync()
    lap("model")
    cfg = json.load(open(os.path.join(args.directory, "config.json")))
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = h // heads
    with torch.inference_mode():
        if args.warm:
            x = torch.zeros(1, 1, h, dtype=torch.bfloat16, device=dev)
            torch.nn.functional.linear(x, torch.zeros(h, h, dtype=torch.bfloat16, device=dev))
            sync()
            lap("first_gemm")
            for n, k in ((kv * d, h), (i, h), (h, i), (v, h)):
                xi = x if k == h else torch.zeros(1, 1, k, dtype=torch.bfloat16, device=dev)
                torch.nn.functional.linear(xi, torch.zeros(n, k, dtype=torch.bfloat16, device=dev))
            sync()
            lap("other_gemms")
            q = torch.zeros(1, heads, 1, d, dtype=torch.bfloat16, device=dev)
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=False)
            sync()
            lap("attention")
        for k in range(1, 4):
            model(torch.tensor([[1]], device=dev))
            sync()
            lap(f"forward_{k}")
    print("PROBE " + json.dumps({"warm": args.warm, **out}), flush=True)


if __name__ == "__main__":
    main()
