"""Host side of a TP rank's column slices: whole-span preadv against strided gathers from a mapping.

    python gather_probe.py CKPT [--threads 16] [--rounds 7] [--tp 8] [--plan llama|columns] [--device cuda:0]

No GPU needed. For the tensors the plan splits along dim 1 (llama: o_proj and down_proj; columns:
every 2-D tensor), rank 0's rows are brought into reused 8 MiB host slots by each method in turn,
interleaved rounds, medians:

  pread span      os.preadv of each chunk's whole row span (what a load does today)
  gather fresh    one mapping per file opened for the round, chunks of <= 8 MiB of slice, unmapped
                  after the timed part (the unmap is timed apart: the library does it off the load)
  gather by span  the same, but chunks cut by 8 MiB of span (what backend="mmap" did)
  gather warm     a mapping kept from an earlier round: no page faults
  per-chunk map   mmap + gather + munmap per chunk

With ``--device cuda:N`` (torch), the GPU side of a load is added, in the same rounds:

  gather + copies   gather fresh into two pinned slots per thread, each chunk then copied to its
                    place in one device buffer on the thread's own non-blocking stream, a slot
                    reused once its event has completed (the loader's ring)
  load_file pread   the load itself: fs.load_file(shard=TPSlice(0, tp, plan)) of every tensor
  load_file auto    (llama: tp_bench's whole Llama plan, rows and whole norms included;
                    columns: every 2-D tensor by columns), backend "pread" and "auto", its
                    mappings unmapped after the timing

so what a load adds to the host-side gather (pinned slots, the CUDA context, copies beside the
gathers, the rest of the plan) shows against the same rounds' figures.

CPU ms: user + system time of the process during the timed part (all threads). minflt: minor page
faults in it (the first touch of each 64 KiB of a fresh mapping maps it). unmap ms: munmap of the
round's mappings, after the timed part. The files are read once first (into the page cache).
"""
from __future__ import annotations

import argparse
import mmap
import os
import resource
import statistics
import threading
import time

import numpy as np

import foxhunt_stream as fs
from foxhunt_stream.format.plan import Run
from foxhunt_stream.format.tp import shard_index
from foxhunt_stream.io.checkpoint import open_checkpoint
try:
    from foxhunt_stream.format.indexing import slice_runs
except ImportError:
    from foxhunt_stream.format.plan import slice_runs

CHUNK = 8 << 20
LLAMA = {"*.o_proj.weight": 1, "*.down_proj.weight": 1, "*": None}


def dim1_runs(ckpt: str, tp: int, plan: str) -> tuple[list[str], list[tuple[int, Run]]]:
    ck = open_checkpoint(ckpt)
    shapes = {n: info.shape for n, (_, info) in ck.names.items()}
    shard = fs.Shard(0, tp, LLAMA if plan == "llama" else (lambda n: 1 if len(shapes[n]) == 2 else None))
    runs = []
    for n, (f, info) in ck.names.items():
        index = shard_index(info.shape, shard, n)
        if index is None or len(index) < 2:
            continue
        runs += [(f, r) for r in slice_runs(info, ck.headers[f].data_start, index)[1]]
    return list(ck.paths), runs


def cut(run: Run, by_slice: bool) -> list[Run]:
    rows = max(1, CHUNK // run.width) if by_slice else max(1, (CHUNK - run.width) // run.pitch + 1)
    return [Run(run.src + i * run.pitch, run.pitch, run.width, min(rows, run.height - i), 0)
            for i in range(0, run.height, rows)]


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_threads(items, work, threads: int, per_thread=None) -> tuple[float, int, float]:
    """``work(job, state)`` for every job, by ``threads`` threads; ``state``: ``per_thread(w)``, or a
    reused 8 MiB host slot."""
    it = iter(items)
    lock = threading.Lock()

    def loop(w: int):
        if per_thread is not None:
            slot = per_thread(w)
        else:
            slot = np.empty(CHUNK, np.uint8)
            slot[::4096] = 0
        while True:
            with lock:
                job = next(it, None)
            if job is None:
                return
            work(job, slot)
    ts = [threading.Thread(target=loop, args=(w,)) for w in range(threads)]
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c0 = cpu_seconds()
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return (time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0,
            cpu_seconds() - c0)


def gather_into(arrays, job, slot) -> None:
    f, r = job
    rows = np.lib.stride_tricks.as_strided(arrays[f][r.src:], (r.height, r.width), (r.pitch, 1), writeable=False)
    slot[:r.nbytes].reshape(r.height, r.width)[...] = rows


class DeviceRings:
    """The loader's GPU side, per thread: two pinned slots, a non-blocking stream, an event per
    slot; each packed chunk is copied to its own place in one device buffer."""

    def __init__(self, device: str, threads: int, nbytes: int) -> None:
        import torch

        from foxhunt_stream.cuda import runtime as cudart
        self.torch, self.device = torch, device
        torch.cuda.set_device(device)
        self.rt, self.h2d = cudart.runtime(), cudart.H2D
        self.dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.slots = [[cudart.pinned(CHUNK) for _ in range(2)] for _ in range(threads)]
        self.streams = [cudart.Stream() for _ in range(threads)]
        self.events = [[cudart.Event() for _ in range(2)] for _ in range(threads)]
        self.pending = [[False, False] for _ in range(threads)]
        self.turn = [0] * threads

    def ring(self, w: int) -> tuple["DeviceRings", int]:
        self.torch.cuda.set_device(self.device)
        return self, w

    def land(self, w: int, fill, nbytes: int, offset: int) -> None:
        k = self.turn[w]
        self.turn[w] = 1 - k
        if self.pending[w][k]:
            self.rt.eventSynchronize(self.events[w][k].ptr)
        array, buf = self.slots[w][k]
        fill(array)
        self.rt.memcpyAsync(self.dst.data_ptr() + offset, buf.ptr, nbytes, self.h2d, self.streams[w].ptr)
        self.rt.eventRecord(self.events[w][k].ptr, self.streams[w].ptr)
        self.pending[w][k] = True

    def finish(self) -> None:
        for stream in self.streams:
            stream.synchronize()
        self.pending = [[False, False] for _ in self.pending]


def device_methods(a, by_slice, open_maps, close_maps, nbytes: int) -> dict:
    """The GPU side (``--device``): the gather with the loader's copies, and the load itself."""
    import torch

    from foxhunt_stream.io import mapping
    rings = DeviceRings(a.device, a.threads, nbytes)
    jobs, off = [], 0
    for f, r in by_slice:
        jobs.append((f, r, off))
        off += r.nbytes

    def copies():
        maps, arrays = open_maps()

        def work(job, state):
            (f, r, o), (dev, w) = job, state
            dev.land(w, lambda slot: gather_into(arrays, (f, r), slot), r.nbytes, o)
        t0 = time.perf_counter()
        t, fl, cpu = run_threads(jobs, work, a.threads, per_thread=rings.ring)
        rings.finish()
        return time.perf_counter() - t0, fl, cpu, close_maps(maps, arrays)

    shapes = {n: info.shape for n, (_, info) in open_checkpoint(a.ckpt).names.items()}
    from tp_bench import LLAMA_PLAN   # the rank's whole plan: the dim-0 slices and whole norms too
    shard = fs.TPSlice(0, a.tp, LLAMA_PLAN if a.plan == "llama" else (lambda n: 1 if len(shapes[n]) == 2 else None))

    def load(backend: str):
        def go():
            f0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, cpu_seconds(), time.perf_counter()
            out = fs.load_file(a.ckpt, device=a.device, framework="pt", shard=shard, backend=backend)
            torch.cuda.synchronize(a.device)
            t = time.perf_counter() - t0
            fl, cpu = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0, cpu_seconds() - c0
            del out
            u0 = time.perf_counter()
            mapping.wait_unmapped()
            return t, fl, cpu, time.perf_counter() - u0
        return go
    for backend in ("pread", "auto"):   # untimed: pools pinned, allocator warm
        load(backend)()
    return {"gather + copies": copies, "load_file pread": load("pread"), "load_file auto": load("auto")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--plan", choices=["llama", "columns"], default="llama")
    ap.add_argument("--device", default=None, help="cuda:N: also the loader's GPU side and the load itself (torch)")
    a = ap.parse_args()
    paths, runs = dim1_runs(a.ckpt, a.tp, a.plan)
    for p in paths:   # into the page cache
        with open(p, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    by_slice = [(f, c) for f, r in runs for c in cut(r, True)]
    by_span = [(f, c) for f, r in runs for c in cut(r, False)]
    span = sum(r.span for _, r in runs)
    nbytes = sum(r.nbytes for _, r in runs)

    def open_maps():
        maps = [mmap.mmap(fd, 0, prot=mmap.PROT_READ) for fd in fds]
        return maps, [np.frombuffer(m, np.uint8) for m in maps]

    def close_maps(maps, arrays) -> float:
        arrays.clear()
        t0 = time.perf_counter()
        for m in maps:
            m.close()
        return time.perf_counter() - t0

    def pread_span(job, slot):
        f, r = job
        os.preadv(fds[f], [memoryview(slot)[:r.span]], r.src)

    def fresh(items):
        def go():
            maps, arrays = open_maps()
            t, fl, cpu = run_threads(items, lambda j, s: gather_into(arrays, j, s), a.threads)
            return t, fl, cpu, close_maps(maps, arrays)
        return go

    def per_chunk(job, slot):
        f, r = job
        lo = r.src // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        m = mmap.mmap(fds[f], r.src + r.span - lo, prot=mmap.PROT_READ, offset=lo)
        arr = np.frombuffer(m, np.uint8)
        rows = np.lib.stride_tricks.as_strided(arr[r.src - lo:], (r.height, r.width), (r.pitch, 1), writeable=False)
        slot[:r.nbytes].reshape(r.height, r.width)[...] = rows
        del arr, rows
        m.close()

    warm_maps, warm_arrays = open_maps()
    run_threads(by_slice, lambda j, s: gather_into(warm_arrays, j, s), a.threads)
    methods = {
        "pread span": lambda: (*run_threads(by_span, pread_span, a.threads), 0.0),
        "gather fresh": fresh(by_slice),
        "gather by span": fresh(by_span),
        "gather warm": lambda: (*run_threads(by_slice, lambda j, s: gather_into(warm_arrays, j, s), a.threads), 0.0),
        "per-chunk map": lambda: (*run_threads(by_span, per_chunk, a.threads), 0.0),
    }
    if a.device:
        methods.update(device_methods(a, by_slice, open_maps, close_maps, nbytes))
    res: dict[str, list] = {k: [] for k in methods}
    names = list(methods)
    for rnd in range(a.rounds):
        for k in names[rnd % len(names):] + names[:rnd % len(names)]:
            res[k].append(methods[k]())
    print(f"{a.plan}: {len(runs)} runs, span {span / 1e9:.2f} GB, slice {nbytes / 1e9:.3f} GB, {a.threads} threads, "
          f"chunks {len(by_slice)} by slice / {len(by_span)} by span; medians of {a.rounds} interleaved rounds")
    base = statistics.median(x[0] for x in res["pread span"])
    print(f"{'method':16} {'ms':>8} {'slice GB/s':>11} {'of pread':>9} {'CPU ms':>8} {'minflt':>8} {'unmap ms':>9}")
    for k, v in res.items():
        t = statistics.median(x[0] for x in v)
        print(f"{k:16} {t * 1e3:8.1f} {nbytes / t / 1e9:11.2f} {t / base:9.3f} "
              f"{statistics.median(x[2] for x in v) * 1e3:8.1f} {statistics.median(x[1] for x in v):8.0f} "
              f"{statistics.median(x[3] for x in v) * 1e3:9.1f}")


if __name__ == "__main__":
    main()
