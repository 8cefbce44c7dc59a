#!/usr/bin/env python
"""What pinning the staging pool does to the thread beside it: a TP=8 rank's tensors made while
the pool is pinned, by each way of pinning it.

    python3 benchmarks/pin_beside.py CKPT [--variants none,reg32,reg16,fault16,regonly32] [--rounds 2]

Each variant runs in a new process (torch imported and its CUDA context made first, the
checkpoint's headers read, untimed). Then the pinning starts on its threads, and the main thread
grows torch's cache by one block and makes the 291 tensors of rank 0 of TP=8 (every 2-D tensor
split by rows), as a load makes its destinations (``alloc``, ms); ``pinned`` is when the last
pinning thread finished (ms from the start). 256 MiB, one anonymous mapping with huge pages:

- ``none``: no pinning;
- ``reg32``: 16 threads, each faulting in (``memset``) and registering (``cudaHostRegister``) two
  8 MiB slots one after the other (the pool's way before it pinned a thread's share at once);
- ``reg16``: 16 threads, each faulting in and registering its 16 MiB in one call;
- ``fault16``: 16 threads, each faulting in its 16 MiB, no registration;
- ``regonly32``: the mapping faulted in before the start, then ``reg32``'s registrations;
- ``reg8`` / ``reg4``: 8 threads of 32 MiB, 4 of 64 MiB; ``reg1``: one thread, one call;
- ``pool``: the library's pool (``start_pinning``).

Medians over interleaved rounds, printed per variant.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time

MiB = 1 << 20
VARIANTS = ("none", "pool", "reg32", "reg16", "fault16", "regonly32", "reg8", "reg4", "reg1")


def child(variant: str, ckpt: str) -> dict:
    import torch
    torch.empty(1, device="cuda:0")
    torch.cuda.synchronize()
    import foxhunt_stream as fs
    from foxhunt_stream import settings
    from foxhunt_stream.cuda import runtime
    from foxhunt_stream.cuda.devices import Device
    from foxhunt_stream.cuda.runtime import HOST_REGISTER_PORTABLE, HUGE_PAGE, MADV_HUGEPAGE
    from foxhunt_stream.engine.frameworks import TorchFramework
    from foxhunt_stream.engine.staging import start_pinning
    from foxhunt_stream.io.libc import libc
    files = sorted(os.path.join(ckpt, f) for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    shapes = []
    for p in files:
        for t in fs.read_header(p).tensors:
            s = list(t.shape)
            if len(s) >= 2:
                s[0] = -(-s[0] // 8)
            shapes.append(tuple(s))
    n = [2 * math.prod(s) for s in shapes]   # bf16
    dev = Device("cuda", 0)
    fw = TorchFramework()
    rt = runtime.runtime()
    total = 32 * 8 * MiB
    size = total + HUGE_PAGE
    addr = libc().mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    base = addr + (-addr) % HUGE_PAGE
    libc().madvise(base, total, MADV_HUGEPAGE)
    if variant == "regonly32":
        libc().memset(base, 0, total)
    ends = []
    start = [0.0]

    def work(ranges, do_memset, do_reg):
        for off, ln in ranges:
            if do_memset:
                libc().memset(base + off, 0, ln)
            if do_reg:
                rt.hostRegister(base + off, ln, HOST_REGISTER_PORTABLE)
        ends.append(time.perf_counter() - start[0])

    pairs = [[(2 * t * 8 * MiB, 8 * MiB), ((2 * t + 1) * 8 * MiB, 8 * MiB)] for t in range(16)]
    plans = {
        "reg32": [(r, True, True) for r in pairs],
        "reg16": [([(t * 16 * MiB, 16 * MiB)], True, True) for t in range(16)],
        "fault16": [([(t * 16 * MiB, 16 * MiB)], True, False) for t in range(16)],
        "regonly32": [(r, False, True) for r in pairs],
        "reg8": [([(t * 32 * MiB, 32 * MiB)], True, True) for t in range(8)],
        "reg4": [([(t * 64 * MiB, 64 * MiB)], True, True) for t in range(4)],
        "reg1": [([(0, total)], True, True)],
    }
    threads = []
    start[0] = time.perf_counter()
    if variant == "pool":
        start_pinning(dev, settings.merge())
    elif variant in plans:
        for ranges, m, r in plans[variant]:
            th = threading.Thread(target=work, args=(ranges, m, r))
            th.start()
            threads.append(th)
    t1 = time.perf_counter()
    fw.reserve(dev, n)
    out = [torch.empty(s, dtype=torch.bfloat16, device="cuda:0") for s in shapes]
    t2 = time.perf_counter()
    for th in threads:
        th.join()
    t3 = time.perf_counter()
    del out
    return {"alloc": (t2 - t1) * 1e3, "pinned": (max(ends) if ends else (t3 - start[0])) * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", help="a checkpoint directory (the Llama-3-8B-shaped one of the suite)")
    ap.add_argument("--variants", default="none,reg32,reg16,fault16,regonly32", help=f"a comma list of {VARIANTS}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.child, a.ckpt)), flush=True)
        return 0
    variants = a.variants.split(",")
    res: dict[str, list] = {v: [] for v in variants}
    for r in range(a.rounds):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            out = subprocess.run([sys.executable, __file__, a.ckpt, "--child", v], capture_output=True, text=True,
                                 timeout=120)
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                print(v, "failed", out.stderr[-800:])
                continue
            res[v].append(json.loads(line[0][7:]))
    for v, rs in res.items():
        if rs:
            print(v, {k: round(statistics.median([x[k] for x in rs]), 2) for k in rs[0]},
                  "alloc each:", [round(x["alloc"], 1) for x in rs])
    return 0


if __name__ == "__main__":
    sys.exit(main())
