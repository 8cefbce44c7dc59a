"""Where a cold start's import time goes, and whether an import trace covers it (issue 6). Root.

    python3 benchmarks/cold_imports.py [--trace /tmp/cold_imports_trace.txt]

Records a trace of ``import torch, transformers`` (``fs.record_imports``) in a hot process, then
times that import in a fresh process, after ``drop_caches`` each time:
  cold          nothing warmed;
  trace+meta    the trace replayed first (``fs.prefetch(imports=)``: bytecode, touched library
                ranges, opened files) *and* its metadata pass (directory listings, source stats),
                both finished before the import starts;
  trace only    the same without the metadata pass;
  hot           everything cached.
If "trace+meta" is as fast as "hot", the trace holds all an import waits for, and a cold start's
import is slow only because the replay overlaps it (or the weights' reads delay it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import drop_caches  # noqa: E402
from import_interference import IMPORT  # noqa: E402

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RECORD = ("import sys; sys.path.insert(0, {repo!r}); from foxhunt_stream.startup import importtrace as it; it.watch_opens(); "
          "import torch, transformers; from transformers import LlamaForCausalLM; "
          "print(it.record_imports({trace!r}))")
REPLAY = ("import sys, time; sys.path.insert(0, {repo!r}); import foxhunt_stream as fs; "
          "from foxhunt_stream.startup import importtrace as it, prefetch as warm; {patch}"
          "t=time.perf_counter(); h=fs.prefetch({tiny!r}, imports={trace!r}); h.wait(); a=time.perf_counter(); "
          "m=h._metadata_thread; m.join() if m else None; b=time.perf_counter(); "
          "print(f'{{a-t:.3f}} {{b-t:.3f}} {{h.module_bytes}}')")


def py(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return r.stdout.strip().splitlines()[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="/tmp/cold_imports_trace.txt")
    args = ap.parse_args(argv)
    import numpy as np

    import foxhunt_stream as fs
    tiny = os.path.join(tempfile.mkdtemp(), "tiny.safetensors")
    fs.save_file({"x": np.zeros(4, np.float32)}, tiny)
    py(IMPORT)
    print(f"trace: {py(RECORD.format(repo=REPO, trace=args.trace))} files", flush=True)
    no_meta = "it.warm_metadata = lambda *a, **k: None; warm.warm_metadata = it.warm_metadata; "
    for mode in ("cold", "trace+meta", "trace only", "hot", "cold", "trace+meta"):
        replay = ""
        if mode != "hot":
            drop_caches()
        if mode.startswith("trace"):
            patch = "" if mode == "trace+meta" else no_meta
            data_s, meta_s, nbytes = py(REPLAY.format(repo=REPO, tiny=tiny, trace=args.trace, patch=patch)).split()
            replay = f"   (replay: code {float(data_s):.2f} s, metadata done at {float(meta_s):.2f} s, " \
                     f"{int(nbytes) / 1e9:.2f} GB)"
        t = time.perf_counter()
        torch_s, tf_s = py(IMPORT).split()
        print(f"{mode:11} import torch {float(torch_s):6.2f} s   transformers {float(tf_s):6.2f} s   "
              f"process {time.perf_counter() - t:6.2f} s{replay}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
