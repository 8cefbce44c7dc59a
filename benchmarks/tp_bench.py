"""Tensor-parallel and multi-shard loading: full load vs one rank's row / column shard vs one file.

    python benchmarks/tp_bench.py CKPT [--device cuda:0] [--framework cupy|pt|numpy] [--tp 8]
    python benchmarks/tp_bench.py /dev/shm/tp --make 16GiB --device cuda:0    # build a Llama-shaped one first
    python benchmarks/tp_bench.py /tmp/tp --make 256MiB --repeat 3            # small, runs on a CPU box

CKPT is a multi-shard checkpoint (directory, index.json or one file). The single-file copy of
the same tensors (``--single``, default ``<CKPT>.single.safetensors``) is written once if missing.
Every case runs once untimed (page cache warm, device pools allocated), then ``--repeat`` timed
runs; the best is reported. Bytes read are counted in a separate untimed pass (source.fault_hook).

Targets from the issue, printed as PASS/MISS (timings, never test assertions):
  each TP load <= (1/TP) * full load time * 1.2;   multi-shard full load <= single-file load.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import foxhunt_stream as fs  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import h2d_rate, memcpy_rate  # noqa: E402
from foxhunt_stream.io import source as fsource  # noqa: E402
from foxhunt_stream.io.checkpoint import open_checkpoint  # noqa: E402
from foxhunt_stream.settings import parse_size  # noqa: E402
from foxhunt_stream.io.pagecache import resident_fraction  # noqa: E402


# ---------------------------------------------------------------- building checkpoints

def llama_shapes(total_bytes: int, itemsize: int = 2) -> dict[str, tuple[int, ...]]:
    """Llama-like tensor names and shapes adding up to about ``total_bytes``."""
    hidden = 4096 if total_bytes >= 4 << 30 else 1024 if total_bytes >= 64 << 20 else 256
    inter, vocab = hidden * 7 // 2, 32000 if hidden >= 4096 else 8 * hidden
    layer = (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) * itemsize
    edges = (2 * vocab * hidden + hidden) * itemsize
    n_layers = max(1, (total_bytes - edges) // layer)
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        for k in "qkvo":
            shapes[p + f"self_attn.{k}_proj.weight"] = (hidden, hidden)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def make_checkpoint(directory: str, total_bytes: int, shards: int) -> None:
    import ml_dtypes
    os.makedirs(directory, exist_ok=True)
    shapes = llama_shapes(total_bytes)
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 2**16, 1 << 24, dtype=np.uint16)   # random bits, cheap to tile
    tensors = {}
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        reps = -(-n // pool.size)
        tensors[name] = np.tile(pool, reps)[:n].view(ml_dtypes.bfloat16).reshape(shape)
    size = sum(t.nbytes for t in tensors.values())
    fs.save_file(tensors, directory, max_shard_size=int(size / shards * 1.1) + 1, fsync=False)
    print(f"built {directory}: {len(tensors)} tensors, {size / 1e9:.2f} GB in {shards} shards", flush=True)


def make_single(ckpt: str, path: str) -> None:
    tensors = fs.load_file(ckpt, device="cpu")
    fs.save_file(tensors, path, fsync=False)
    print(f"built {path}: one file of {os.path.getsize(path) / 1e9:.2f} GB", flush=True)


# ---------------------------------------------------------------- measuring

def warm_page_cache(paths: list[str]) -> None:
    """Buffered reads of every file, so each case starts from the page cache (with direct_io=auto
    a file that fell out of the cache would otherwise be read with O_DIRECT and stay out)."""
    buf = bytearray(64 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass



def _sync(device: str) -> None:
    if device != "cpu":
        import cupy as cp
        cp.cuda.Device(int(device.split(":")[1]) if ":" in device else 0).synchronize()


def timed(fn, device: str, repeat: int) -> tuple[float, float, int]:
    """(best seconds, median seconds, bytes landed) over ``repeat`` runs after one warm-up."""
    out = fn()
    nbytes = sum(_nbytes(v) for v in out.values())
    del out
    times = []
    for _ in range(repeat):
        gc.collect()
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
        del out
    return min(times), statistics.median(times), nbytes


def _nbytes(v) -> int:
    if hasattr(v, "nbytes"):
        return int(v.nbytes)
    return v.numel() * v.element_size()   # torch


def bytes_read(fn) -> int:
    total = [0]
    lock = threading.Lock()

    def hook(src, offset, length):
        with lock:
            total[0] += length

    old, fsource.fault_hook = fsource.fault_hook, hook
    try:
        del_me = fn()
        del del_me
    finally:
        fsource.fault_hook = old
    return total[0]


def ceiling(device: str, threads: int) -> tuple[str, float]:
    """The copy the landed bytes cannot beat, measured now: pinned H2D on a GPU, a threaded
    host memcpy on the CPU (page cache -> destination is at least one such copy)."""
    n = 1 << 30
    if device != "cpu":
        return "pinned H2D (16 MiB copies)", h2d_rate(int(device.split(":")[1]) if ":" in device else 0, n)
    return f"host memcpy, {threads} threads", memcpy_rate(threads, n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", help="multi-shard checkpoint: directory, index.json or list root")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--framework", default=None, help="numpy (cpu), cupy or pt")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--single", default=None, help="single-file copy (default: <ckpt>.single.safetensors)")
    ap.add_argument("--make", default=None, help="build a Llama-shaped checkpoint of this size at CKPT first")
    ap.add_argument("--shards", type=int, default=4, help="shards for --make")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--backend", default=None, help="pread | mmap | direct")
    ap.add_argument("--direct-io", default=None, help="auto | on | off (library default: auto)")
    ap.add_argument("--cold", action="store_true", help="skip warming the page cache")
    args = ap.parse_args(argv)

    if args.make and not os.path.exists(args.ckpt):
        make_checkpoint(args.ckpt, parse_size(args.make), args.shards)
    single = args.single or args.ckpt.rstrip("/") + ".single.safetensors"
    if not os.path.exists(single):
        make_single(args.ckpt, single)

    ck = open_checkpoint(args.ckpt)
    shapes = {n: info.shape for n, (_, info) in ck.names.items()}
    opts = {k: v for k, v in (("threads", args.threads), ("backend", args.backend), ("direct_io", args.direct_io))
            if v is not None}
    files = [*ck.paths, single]
    if not args.cold:
        warm_page_cache(files)
    resident = min(resident_fraction(p) for p in files)

    def load(src, shard=None, **extra):
        return lambda: fs.load_file(src, device=args.device, framework=args.framework, shard=shard,
                                    **{**opts, **extra})

    row = fs.Shard(0, args.tp, 0)
    col = fs.Shard(0, args.tp, lambda n: 1 if len(shapes[n]) >= 2 else None)
    cases = [
        ("full load, multi-shard", load(args.ckpt)),
        (f"TP={args.tp} rank 0, rows (dim 0)", load(args.ckpt, row)),
        (f"TP={args.tp} rank 0, columns (dim 1)", load(args.ckpt, col)),
        ("full load, single file", load(single)),
    ]
    s = fs.settings.merge(**opts)
    if s.backend != "mmap":   # the mapped source packs a column shard's rows itself
        cases.append((f"TP={args.tp} rank 0, columns, mmap", load(args.ckpt, col, backend="mmap")))
    threads = fs.settings.merge(**opts).threads
    what, ceil = ceiling(args.device, threads)
    print(f"device {args.device}, framework {args.framework or 'default'}, backend {s.backend}, direct_io "
          f"{s.direct_io}, {len(ck.paths)} shard(s), {len(ck.names)} tensors, threads {threads}, least page-cache "
          f"residency {resident:.0%}; ceiling: {what} {ceil:.1f} GB/s")
    print("'span GB': file bytes inside the extents of the reads (a column shard's rows are read whole by "
          "pread; the mmap backend copies only the columns)")
    print(f"{'case':36} {'landed GB':>10} {'span GB':>9} {'best s':>8} {'median s':>9} {'GB/s':>7} {'% ceil':>7}")
    res = {}
    for label, fn in cases:
        best, med, landed = timed(fn, args.device, args.repeat)
        read = bytes_read(fn)
        res[label] = best
        print(f"{label:36} {landed / 1e9:10.3f} {read / 1e9:9.3f} {best:8.3f} {med:9.3f} "
              f"{landed / best / 1e9:7.2f} {100 * landed / best / 1e9 / ceil:6.1f}%", flush=True)

    full, single_t = res[cases[0][0]], res[cases[3][0]]
    limit = full / args.tp * 1.2
    print()
    for label, _ in [*cases[1:3], *cases[4:]]:
        r = res[label] / full
        print(f"{label}: {r:.3f} of the full load (target <= {1.2 / args.tp:.3f}) "
              f"{'PASS' if res[label] <= limit else 'MISS'}")
    r = full / single_t
    print(f"multi-shard full / single file: {r:.3f} (target <= 1.000) {'PASS' if r <= 1.0 else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
