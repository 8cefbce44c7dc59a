"""Where a load driving GPUs loses time: threads, chunk size, GIL switch interval, one pipeline or two.

    python benchmarks/gpu_pipeline_probe.py /dev/shm/probe --gib 8 --repeat 3          # one GPU (cuda:0), or two if present
    python benchmarks/gpu_pipeline_probe.py /tmp/probe --gib 0.3 --repeat 1 --device cpu   # CPU smoke run

Builds a Llama-shaped bf16 checkpoint in DIR (once), reads it into the page cache, then measures,
each case once untimed and ``--repeat`` times timed (best reported):
  ceiling   page cache -> host buffers with os.preadv, 8 MiB per call, 8/16/32 threads (no pipeline);
            pinned host -> device copies of 1 GiB on each GPU (torch); the preadv reads while
            pinned copies run on every GPU at once (host memory shared by reads and DMA);
  threads   load_file(device=D, threads=T), T = 8, 12, 16, 24, 32;
  chunk     16 threads, chunk_bytes 4/8/16/32 MiB (staging grown so every worker keeps 2 slots);
  switch    16 threads, sys.setswitchinterval 0.5 / 5 (default) / 50 ms;
  mixed     one pipeline over two targets: device_map halves (device_map_bench's split) on D and
            in host memory, 16 and 32 threads; and all in host memory, for comparison;
With two GPUs visible, also:
  two       the halves as two background loads at once, on cuda:0 and cuda:1, 8+8 and 16+16
            threads: one pipeline per device, every worker on one device;
  map       device_map halves on cuda:0/cuda:1 at 8/16/24/32 threads; at 16 threads with 512 MiB
            of staging per GPU, and with the chunk interleaving turned off.
Per case: seconds, GB/s, CPU seconds per wall second (how many CPUs the load kept busy) and
involuntary context switches per GB (a CPU taken away from a runnable thread: oversubscription).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import resource
import sys
import threading
import time

import numpy as np

import foxhunt_stream as fs
from foxhunt_stream.io.checkpoint import open_checkpoint

GB = 1e9


def build(directory: str, gib: float) -> str:
    from foxhunt_stream.cli.ceilings import make_synthetic
    os.makedirs(directory, exist_ok=True)
    stamp = os.path.join(directory, f".built-{gib}")
    if not os.path.exists(stamp):
        for f in os.listdir(directory):
            os.unlink(os.path.join(directory, f))
        make_synthetic(directory, int(gib * 2**30), shards=4)
        open(stamp, "w").close()
    return directory


def warm(paths: list[str]) -> None:
    buf = bytearray(64 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def halves(names: list[str]) -> tuple[list[str], list[str]]:
    """Embeddings + the first half of the layers, and the rest (device_map_bench's split)."""
    layers = sorted({int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))})
    first = {f"model.layers.{i}." for i in layers[:len(layers) // 2]}
    a = [n for n in names if n.startswith("model.embed_tokens") or any(n.startswith(p) for p in first)]
    return a, [n for n in names if n not in set(a)]


def sync(devices) -> None:
    import torch
    for d in devices:
        if d.startswith("cuda"):
            torch.cuda.synchronize(d)


def measure(label: str, run, devices, nbytes: int, repeat: int, rows: list) -> None:
    run()   # untimed: page cache, pinned pools, the allocator's cache
    sync(devices)
    best = None
    for _ in range(repeat):
        gc.collect()
        sync(devices)
        ru0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
        out = run()
        sync(devices)
        t = time.perf_counter() - t0
        cpu, ru1 = time.process_time() - c0, resource.getrusage(resource.RUSAGE_SELF)
        del out
        if best is None or t < best[0]:
            best = (t, cpu / t, (ru1.ru_nivcsw - ru0.ru_nivcsw) / (nbytes / GB))
    t, cpus, ivcsw = best
    rows.append((label, t, nbytes / t / GB, cpus, ivcsw))
    print(f"| {label} | {t:.3f} | {nbytes / t / GB:.2f} | {cpus:.1f} | {ivcsw:.0f} |", flush=True)


def preadv_ceiling(paths: list[str], threads: int):
    """Every file read once from the page cache by ``threads`` threads, 8 MiB per preadv."""
    step = 8 << 20
    items = [(p, off) for p in paths for off in range(0, os.path.getsize(p), step)]
    nxt = iter(range(len(items)))
    lock = threading.Lock()
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}

    def worker():
        buf = np.empty(step, np.uint8)
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            p, off = items[i]
            os.preadv(fds[p], [buf], off)

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for fd in fds.values():
        os.close(fd)


def h2d(src, dst, rounds: int):
    """Pinned host -> device copies, ``rounds`` times (the PCIe ceiling the loads are held to)."""
    for _ in range(rounds):
        dst.copy_(src, non_blocking=True)


def read_beside_dma(paths: list[str], nbytes: int, threads: int, devices: list[str]) -> str:
    """The page-cache reads (``threads`` x preadv) while pinned host -> device copies run on every
    GPU of ``devices``: the memory both share. Returns a table row: read GB/s, then each GPU's H2D
    GB/s during the reads."""
    import torch
    src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    stop, done = threading.Event(), {}

    def dma(dev: str) -> None:
        dst = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        n, t0 = 0, time.perf_counter()
        while not stop.is_set():
            dst.copy_(src)   # from pinned memory: returns once the copy is done
            n += 1
        done[dev] = n * (256 << 20) / (time.perf_counter() - t0) / GB

    ts = [threading.Thread(target=dma, args=(dev,)) for dev in devices]
    for t in ts:
        t.start()
    time.sleep(0.2)   # the copies run before the reads start
    t0 = time.perf_counter()
    preadv_ceiling(paths, threads)
    read = nbytes / (time.perf_counter() - t0) / GB
    stop.set()
    for t in ts:
        t.join()
    return f"| preadv {threads} threads beside H2D on {', '.join(devices)} | read {read:.2f} | " + \
        " / ".join(f"H2D {dev} {done[dev]:.2f}" for dev in devices) + " | | |"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cuda:0")
    a = ap.parse_args(argv)
    src = build(a.dir, a.gib)
    ck = open_checkpoint(src)
    names = ck.file_order()
    total = sum(info.nbytes for _, info in ck.names.values())
    warm(ck.paths)
    import torch
    gpus = torch.cuda.device_count() if a.device.startswith("cuda") else 0
    d, fw = a.device, "pt"
    print(f"{total / GB:.2f} GB in {len(ck.paths)} files, {len(names)} tensors; {os.cpu_count()} CPUs "
          f"(affinity {len(os.sched_getaffinity(0))}); {gpus} GPU(s); foxhunt_stream {fs.__file__}")
    print("| case | s | GB/s | CPUs busy | invol. ctx switches / GB |\n|---|---:|---:|---:|---:|", flush=True)
    rows: list = []
    for t in (8, 16, 32):
        measure(f"ceiling preadv, {t} threads", lambda t=t: preadv_ceiling(ck.paths, t), [], total, a.repeat, rows)
    if d.startswith("cuda"):
        pinned = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        for dev in [d] + (["cuda:1"] if gpus >= 2 else []):
            on_dev = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
            measure(f"ceiling pinned H2D {dev}, 1 GiB x 8", lambda on_dev=on_dev: h2d(pinned, on_dev, 8), [dev],
                    8 << 30, a.repeat, rows)
            del on_dev
        del pinned
        dma_devices = [d] + (["cuda:1"] if gpus >= 2 else [])
        for t in (16, 32):
            print(read_beside_dma(ck.paths, total, t, dma_devices), flush=True)
    for t in (8, 12, 16, 24, 32):
        measure(f"threads {t}", lambda t=t: fs.load_file(src, device=d, framework=fw, threads=t), [d], total,
                a.repeat, rows)
    for mib in (4, 8, 16, 32):
        staging = max(256 << 20, 2 * 16 * (mib << 20))
        measure(f"chunk {mib} MiB, staging {staging >> 20} MiB, 16 threads",
                lambda mib=mib, staging=staging: fs.load_file(src, device=d, framework=fw, threads=16,
                                                              chunk_bytes=mib << 20, staging_bytes=staging),
                [d], total, a.repeat, rows)
    default_switch = sys.getswitchinterval()
    for ms in (0.5, 5.0, 50.0):
        sys.setswitchinterval(ms / 1000)
        try:
            measure(f"switch interval {ms} ms, 16 threads",
                    lambda: fs.load_file(src, device=d, framework=fw, threads=16), [d], total, a.repeat, rows)
        finally:
            sys.setswitchinterval(default_switch)
    first, second = halves(names)
    if d.startswith("cuda"):   # one pipeline over two targets: half on the GPU, half in host memory
        mixed = {**{n: d for n in first}, "": "cpu"}
        for t in (16, 32):
            measure(f"device_map {d} + cpu, {t} threads",
                    lambda t=t: fs.load_file(src, device_map=mixed, framework=fw, threads=t), [d], total,
                    a.repeat, rows)
        measure("all on cpu, 16 threads", lambda: fs.load_file(src, device="cpu", framework=fw, threads=16), [],
                total, a.repeat, rows)
    if gpus < 2:
        return
    for t in (8, 16):   # one pipeline per device, each worker on one device
        def two(t=t):
            ha = fs.load_file(src, device="cuda:0", framework=fw, names=first, threads=t, background=True)
            hb = fs.load_file(src, device="cuda:1", framework=fw, names=second, threads=t, background=True)
            return ha.result(), hb.result()
        measure(f"two loads cuda:0 + cuda:1, {t}+{t} threads", two, ["cuda:0", "cuda:1"], total, a.repeat, rows)
    dm = {**{n: "cuda:0" for n in first}, "": "cuda:1"}
    for t in (8, 16, 24, 32):
        measure(f"device_map cuda:0/cuda:1, {t} threads",
                lambda t=t: fs.load_file(src, device_map=dm, framework=fw, threads=t),
                ["cuda:0", "cuda:1"], total, a.repeat, rows)
    measure("device_map cuda:0/cuda:1, 16 threads, staging 512 MiB per GPU",
            lambda: fs.load_file(src, device_map=dm, framework=fw, threads=16, staging_bytes=512 << 20),
            ["cuda:0", "cuda:1"], total, a.repeat, rows)
    from foxhunt_stream.format import plan as planner
    interleave = planner.interleave_by_device
    planner.interleave_by_device = lambda plan, devices: plan   # each device's chunks in one block
    try:
        measure("device_map cuda:0/cuda:1, 16 threads, no interleaving",
                lambda: fs.load_file(src, device_map=dm, framework=fw, threads=16),
                ["cuda:0", "cuda:1"], total, a.repeat, rows)
    finally:
        planner.interleave_by_device = interleave


if __name__ == "__main__":
    main()
