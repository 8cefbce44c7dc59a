"""What the host can feed GPUs with, by thread and process count (issue 9's ceiling).

    python3 benchmarks/host_bandwidth.py /dev/shm/tpb [--gpus 2]

Prints GB/s for:
* ``memcpy``: numpy copies between two anonymous 1 GiB buffers, 8 / 16 / 32 threads;
* ``page cache``: every byte of the checkpoint's files preadv'd into per-thread buffers (the
  first copy a bounce-buffer load makes), 16 and 32 threads in one process, and 16 threads in
  each of two processes at once (two ranks);
* ``H2D``: pinned -> device copies on each GPU alone and on all GPUs at once (one process per GPU).
A two-rank load that reads each byte once still makes three host-memory passes per byte (page
cache read, staging write, DMA read); if the page-cache rate does not grow with threads or
processes, the host's memory bandwidth, not the GPUs, bounds how fast two ranks can load.
"""

from __future__ import annotations

import argparse
import glob
import multiprocessing as mp
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import h2d_rate, memcpy_rate  # noqa: E402
from tp_rows import host_pass  # noqa: E402


def _pc_worker(paths, threads, part, barrier, q):
    barrier.wait()
    dt, nb = host_pass(paths, threads, part=part)
    q.put((dt, nb))


def page_cache_processes(paths: list[str], procs: int, threads: int) -> float:
    """Aggregate GB/s of ``procs`` processes each reading a 1/procs share of the files' pieces."""
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_pc_worker, args=(paths, threads, (i, procs), barrier, q)) for i in range(procs)]
    for p in ps:
        p.start()
    res = [q.get(timeout=120) for _ in ps]
    for p in ps:
        p.join()
    return sum(nb for _, nb in res) / max(dt for dt, _ in res) / 1e9


def _h2d_worker(gpu, barrier, q):
    q.put(h2d_rate(gpu, ready=barrier.wait))


def h2d(gpus: list[int]) -> list[float]:
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(len(gpus)), ctx.Queue()
    ps = [ctx.Process(target=_h2d_worker, args=(g, barrier, q)) for g in gpus]
    for p in ps:
        p.start()
    res = [q.get(timeout=120) for _ in ps]
    for p in ps:
        p.join()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--gpus", type=int, default=0)
    args = ap.parse_args(argv)
    paths = sorted(glob.glob(os.path.join(args.ckpt, "*.safetensors")))
    total = sum(os.path.getsize(p) for p in paths)
    for p in paths:   # resident first
        host_pass([p], 8)
    print(f"cpus {os.cpu_count()}, checkpoint {total / 1e9:.2f} GB in {len(paths)} files", flush=True)
    for t in (8, 16, 32):
        print(f"memcpy, 1 process, {t:2d} threads: {memcpy_rate(t):6.1f} GB/s (x2 for read+write traffic)", flush=True)
    for t in (16, 32):
        dt, nb = min(host_pass(paths, t) for _ in range(3))
        print(f"page cache -> host, 1 process, {t:2d} threads: {nb / dt / 1e9:6.1f} GB/s", flush=True)
    for procs in (2,):
        rates = [page_cache_processes(paths, procs, 16) for _ in range(2)]
        print(f"page cache -> host, {procs} processes x 16 threads: {max(rates):6.1f} GB/s together", flush=True)
    if args.gpus:
        for g in range(args.gpus):
            print(f"pinned H2D, GPU {g} alone: {h2d([g])[0]:6.1f} GB/s", flush=True)
        both = h2d(list(range(args.gpus)))
        print(f"pinned H2D, {args.gpus} GPUs at once: {' + '.join(f'{x:.1f}' for x in both)} = {sum(both):.1f} GB/s",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
