#!/usr/bin/env python
"""A checkpoint of very many tiny tensors, loaded in a fresh process: ours against safetensors.

    python3 benchmarks/tiny_tensors.py DIR --tensors 100000 --rounds 5 [--device cpu] [--out OUT]

Writes ``DIR/tiny-<N>.safetensors`` once (``safetensors.numpy.save_file`` of N float32[4]
tensors, tensor i holding i), then times, in a new Python process each and in alternated order,
``foxhunt_stream.load_file`` against ``safetensors.numpy.load_file`` (``--device cuda:0``: torch
tensors on that GPU, ``safetensors.torch.load_file(device=...)``; torch imported and the CUDA
context made before the clock). The clock starts before the loader's import (numpy's included,
on the host) and stops when the tensors are loaded; every child checks a tensor's value.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys, time
path, case, device = sys.argv[1:4]
gpu = device != "cpu"
if gpu:
    import torch
    torch.empty(1, device=device)
    torch.cuda.synchronize(device)
t0 = time.perf_counter()
if case == "foxhunt":
    import foxhunt_stream as fs
    out = fs.load_file(path, device=device, framework="pt" if gpu else "numpy")
elif gpu:
    from safetensors.torch import load_file
    out = load_file(path, device=device)
else:
    from safetensors.numpy import load_file
    out = load_file(path)
if gpu:
    torch.cuda.synchronize(device)
s = time.perf_counter() - t0
last = len(out) - 1
ok = float(out[f"t{last:07d}"][3]) == float(last)
print("RESULT " + json.dumps({"seconds": s, "tensors": len(out), "ok": ok}))
"""


def ensure_file(directory: str, n: int) -> str:
    path = os.path.join(directory, f"tiny-{n}.safetensors")
    if not os.path.exists(path):
        import numpy as np
        from safetensors.numpy import save_file
        os.makedirs(directory, exist_ok=True)
        save_file({f"t{i:07d}": np.full(4, i, np.float32) for i in range(n)}, path + ".tmp")
        os.replace(path + ".tmp", path)
    return path


def run(path: str, case: str, device: str) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    r = subprocess.run([sys.executable, "-c", CHILD, path, case, device], capture_output=True, text=True, env=env,
                       timeout=600)
    found = [x[len("RESULT "):] for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(found[-1]) if found else {"error": r.stderr.strip()[-1500:]}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    path = ensure_file(a.dir, a.tensors)
    cases = ["foxhunt", "safetensors"]
    runs: dict[str, list[dict]] = {c: [] for c in cases}
    for r in range(a.rounds):
        for case in cases[r % 2:] + cases[:r % 2]:
            res = run(path, case, a.device)
            runs[case].append(res)
            print(f"round {r + 1} {case}: {res.get('seconds', res.get('error'))}", flush=True)
    lines = [f"{a.tensors:,} float32[4] tensors to {a.device}, a new process per load, {a.rounds} alternated rounds:"]
    for case, rs in runs.items():
        s = [x["seconds"] for x in rs if "seconds" in x and x["ok"]]
        if s:
            lines.append(f"  {case:12s} {min(s):.3f}-{max(s):.3f} s (median {statistics.median(s):.3f}), "
                         f"{len(s)} of {len(rs)} runs checked")
    print("\n".join(lines))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"tiny_tensors_{a.tensors}.json"), "w") as f:
            json.dump({"command": sys.argv, "runs": runs}, f)
    return 0 if all("seconds" in x and x["ok"] for rs in runs.values() for x in rs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
