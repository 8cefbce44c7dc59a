"""device_map: a checkpoint all on one GPU vs split by layer halves across two, in one process.

    python benchmarks/device_map_bench.py /dev/shm/dm --make 15            # 2 GPUs: build 15 GiB, then measure
    python benchmarks/device_map_bench.py CKPT [--framework pt|cupy] [--repeat 3]
    python benchmarks/device_map_bench.py CKPT --device-a cpu --device-b cpu --repeat 1   # CPU smoke run

CKPT is a Llama-named checkpoint (file, directory or index.json). ``--make GIB`` builds one there
first with ``gpu_bench.build_checkpoint`` (bf16, Llama-3-8B shapes: at least ~2.3 GiB).
Cases, each run once untimed (page cache warm, device pools and allocator caches filled), then
``--repeat`` timed runs, the best reported:
  (a) ``device=A``: every tensor on device A;
  (b) ``device_map``: embeddings + the first half of the layers on A, the rest (+ norm, lm_head) on B.
Also measured in the same run, per GPU: the pinned host -> device copy ceiling
(``gpu_bench.ceiling_h2d_d2h``). One landed tensor per device is compared with the file's bytes.
Prints a markdown table row: GB/s = bytes / seconds / 1e9.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import gpu_bench  # noqa: E402

import foxhunt_stream as fs  # noqa: E402
from foxhunt_stream.io.checkpoint import open_checkpoint  # noqa: E402
from foxhunt_stream.cuda.devices import Device, parse_device  # noqa: E402
from foxhunt_stream.engine.placement import resolve_device_map  # noqa: E402

GB = 1e9
HEADER = ("| checkpoint GB | all on A GB/s | split A+B GB/s | split / all | H2D ceiling A / B GB/s "
          "| GB on A / B (split) | A, B |\n|---|---|---|---|---|---|---|")


def split_map(names: list[str], a: str, b: str) -> dict[str, str]:
    """Embeddings and the first half of the layers on ``a``, everything else on ``b``."""
    layers = sorted({int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))})
    first = layers[:len(layers) // 2]
    return {"model.embed_tokens": a, **{f"model.layers.{i}": a for i in first}, "": b}


def sync(devices) -> None:
    cuda = sorted({d.index for d in devices if d.is_cuda})
    if cuda:
        import cupy as cp
        for i in cuda:
            cp.cuda.Device(i).synchronize()


def check_bytes(out: dict, ck, placed: dict[str, Device]) -> None:
    """The middle tensor landed on each device equals the file's bytes (read with plain I/O)."""
    import numpy as np
    for dev in sorted(set(placed.values()), key=str):
        mine = [n for n in out if placed[n] == dev and ck.names[n][1].nbytes]
        name = mine[len(mine) // 2]
        f, info = ck.names[name]
        with open(ck.paths[f], "rb") as fh:
            fh.seek(ck.headers[f].data_start + info.start)
            want = fh.read(info.nbytes)
        v = out[name]
        if type(v).__module__.startswith("torch"):
            import torch
            assert str(v.device) == ("cpu" if not dev.is_cuda else str(dev)), (name, v.device, dev)
            got = v.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        elif isinstance(v, np.ndarray):
            got = v.tobytes()
        else:
            import cupy as cp
            assert v.device.id == dev.index, (name, v.device, dev)
            got = cp.asnumpy(v).tobytes()
        assert got == want, f"landed bytes of {name} on {dev} differ from the file"


def timed(load, devices, repeat: int) -> float:
    """Best seconds over ``repeat`` runs, after one untimed run."""
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        sync(devices)
        t0 = time.perf_counter()
        out = load()
        sync(devices)
        best = min(best, time.perf_counter() - t0)
        del out
    return best


def h2d_ceiling(dev: Device) -> float | None:
    """gpu_bench's pinned host -> device ceiling, run on ``dev`` (None on the host or on failure)."""
    if not dev.is_cuda:
        return None
    import cupy as cp
    gpu_bench.RESULTS.pop("h2d", None)
    with cp.cuda.Device(dev.index):
        gpu_bench.ceiling_h2d_d2h(cp, nbytes=2 << 30)
    return gpu_bench.RESULTS.get("h2d")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt")
    ap.add_argument("--make", type=float, default=None, metavar="GIB", help="build a checkpoint of this size first")
    ap.add_argument("--shards", type=int, default=4, help="files of the --make checkpoint")
    ap.add_argument("--device-a", default="cuda:0")
    ap.add_argument("--device-b", default="cuda:1")
    ap.add_argument("--framework", default="pt", choices=["pt", "cupy", "numpy"])
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args(argv)
    if a.make:
        gpu_bench.build_checkpoint(a.ckpt, a.make, a.shards)
    dev_a, dev_b = parse_device(a.device_a), parse_device(a.device_b)
    ck = open_checkpoint(a.ckpt)
    names = list(ck.names)
    total = sum(info.nbytes for _, info in ck.names.values())
    dm = split_map(names, a.device_a, a.device_b)
    placed = dict(zip(names, resolve_device_map(names, dm)))
    halves = resolve_device_map(names, split_map(names, "cuda:0", "cuda:1"))   # which half, even if A == B
    on_a = sum(ck.names[n][1].nbytes for n, h in zip(names, halves) if h.index == 0)
    gpu_bench.warm(ck.paths)

    ceilings = [h2d_ceiling(dev_a), h2d_ceiling(dev_b) if dev_b != dev_a else None]
    cases = {"all": (lambda: fs.load_file(a.ckpt, device=a.device_a, framework=a.framework), {dev_a},
                     dict.fromkeys(names, dev_a)),
             "split": (lambda: fs.load_file(a.ckpt, device_map=dm, framework=a.framework), {dev_a, dev_b}, placed)}
    seconds = {}
    for case, (load, devices, where) in cases.items():
        out = load()   # untimed: fills the allocator caches and pinned pools; checked against the file
        sync(devices)
        check_bytes(out, ck, where)
        del out
        seconds[case] = timed(load, devices, a.repeat)
        print(f"{case:6s} best of {a.repeat}: {seconds[case]:.3f} s, {total / seconds[case] / GB:.2f} GB/s", flush=True)

    rates = {c: total / s / GB for c, s in seconds.items()}
    ceil = " / ".join("-" if c is None else f"{c:.2f}" for c in ceilings)
    print(HEADER)
    print(f"| {total / GB:.2f} | {rates['all']:.2f} | {rates['split']:.2f} | {rates['split'] / rates['all']:.2f}x "
          f"| {ceil} | {on_a / GB:.2f} / {(total - on_a) / GB:.2f} | {dev_a}, {dev_b} |", flush=True)
    return {"bytes": total, "GB/s": rates, "h2d": ceilings, "on_a": on_a}


if __name__ == "__main__":
    main()
