"""Where the time of a GPU load goes: per-chunk timelines of full / TP-row / TP-column / verify loads.

    python3 benchmarks/probe_gpu.py /dev/shm/tpb [--json OUT.json]

A diagnostic, not a benchmark table: it wraps the pipeline's functions (read, land, allocation)
with timestamps and prints, for each case, the wall time split into: before the first chunk
starts, the chunks (summed read time, summed time outside reads, per-chunk medians), and after the
last chunk ends. Variations (threads, chunk size, preallocated destinations, GIL switch interval)
show which fixed cost dominates a small (TP rank) load.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import foxhunt_stream as fs  # noqa: E402
from foxhunt_stream.engine import loader, targets as ftarget
from foxhunt_stream.io import pagecache, source as fsource  # noqa: E402

EVENTS: list[tuple] = []


def instrument():
    """Wrap read_into / land / destination allocation / inspect with timestamps (global EVENTS)."""
    pc = time.perf_counter
    orig_read = fsource.FileSource.read_into

    def read_into(self, out, offset):
        t = pc()
        orig_read(self, out, offset)
        EVENTS.append(("read", threading.get_ident(), t, pc(), out.nbytes))
    fsource.FileSource.read_into = read_into

    orig_land = ftarget.CudaTarget.land

    def land(self, worker, source, run, buf, inspect=None, track=False):
        if inspect is not None:
            inner = inspect

            class Timed:   # a ChunkHasher, timed
                def update(self, data):
                    t = pc()
                    inner.update(data)
                    EVENTS.append(("hash", threading.get_ident(), t, pc(), data.nbytes))

                def done(self):
                    inner.done()
            inspect = Timed()
        t = pc()
        ev = orig_land(self, worker, source, run, buf, inspect, track)
        EVENTS.append(("land", threading.get_ident(), t, pc(), run.nbytes))
        return ev
    ftarget.CudaTarget.land = land

    orig_buffer = loader.Destinations.buffer

    def buffer(self, d):
        if self.buffers[d] is not None:
            return self.buffers[d]
        t = pc()
        b = orig_buffer(self, d)
        EVENTS.append(("alloc", threading.get_ident(), t, pc(), 0))
        return b
    loader.Destinations.buffer = buffer


def summarize(label, t0, t1, events):
    def of(kind):
        return [e for e in events if e[0] == kind]
    lands, reads, allocs, hashes = of("land"), of("read"), of("alloc"), of("hash")
    out = {"case": label, "wall_s": t1 - t0, "chunks": len(lands)}
    if lands:
        first = min(e[2] for e in lands)
        last = max(e[3] for e in lands)
        land_t = [e[3] - e[2] for e in lands]
        read_t = [e[3] - e[2] for e in reads]
        out.update(
            before_first_chunk_ms=1e3 * (first - t0), after_last_chunk_ms=1e3 * (t1 - last),
            chunk_span_ms=1e3 * (last - first), threads=len({e[1] for e in lands}),
            land_sum_ms=1e3 * sum(land_t), read_sum_ms=1e3 * sum(read_t),
            outside_read_sum_ms=1e3 * (sum(land_t) - sum(read_t)),
            land_median_us=1e6 * statistics.median(land_t),
            outside_read_median_us=1e6 * statistics.median(
                [a - b for a, b in zip(sorted(land_t), sorted(read_t))]) if len(read_t) == len(land_t) else None,
            read_GBps_per_thread=(sum(e[4] for e in reads) / sum(read_t) / 1e9) if read_t else None,
            alloc_n=len(allocs), alloc_sum_ms=1e3 * sum(e[3] - e[2] for e in allocs),
            alloc_max_ms=1e3 * max((e[3] - e[2] for e in allocs), default=0),
            hash_sum_ms=1e3 * sum(e[3] - e[2] for e in hashes),
            bytes=sum(e[4] for e in lands))
        out["GBps"] = out["bytes"] / out["wall_s"] / 1e9
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}), flush=True)
    return out


def run_case(label, fn, sync, repeat=3):
    fn()   # warm: pools, streams, caching allocator
    sync()
    best = None
    for _ in range(repeat):
        gc.collect()
        sync()
        EVENTS.clear()
        t0 = time.perf_counter()
        r = fn()
        sync()
        t1 = time.perf_counter()
        del r
        s = summarize(label, t0, t1, list(EVENTS))
        if best is None or s["wall_s"] < best["wall_s"]:
            best = s
    return best


def populate_probe(path, threads=16, parts=8):
    """Column gather out of a mapping: page-table population (MADV_POPULATE_READ) vs faulting."""
    import mmap
    import numpy as np
    size = os.path.getsize(path)
    pc = time.perf_counter
    res = {}
    for mode in ("fault", "populate"):
        m = mmap.mmap(os.open(path, os.O_RDONLY), size, prot=mmap.PROT_READ)
        arr = np.frombuffer(m, np.uint8)
        width, pitch = 28672 // parts, 28672          # a 14336-wide bf16 row, 1/8 of it
        rows = (size - 4096) // pitch
        out = np.empty(rows * width, np.uint8)
        bounds = np.linspace(0, rows, threads + 1).astype(int)
        tpop = [0.0]

        def work(i):
            a, b = bounds[i], bounds[i + 1]
            if mode == "populate":
                t = pc()
                lo, hi = (4096 + a * pitch) // 4096 * 4096, 4096 + b * pitch
                m.madvise(22, lo, hi - lo)   # MADV_POPULATE_READ (Linux 5.14)
                tpop[0] += pc() - t
            src = np.lib.stride_tricks.as_strided(arr[4096 + a * pitch:], (b - a, width), (pitch, 1))
            out[a * width:b * width].reshape(b - a, width)[...] = src
        t = pc()
        ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        [x.start() for x in ts]
        [x.join() for x in ts]
        t_gather = pc() - t
        t = pc()
        del arr
        m.close()
        res[mode] = {"gather_s": t_gather, "populate_thread_s": tpop[0], "unmap_s": pc() - t,
                     "landed_GB": out.nbytes / 1e9, "span_GB": size / 1e9}
    print("populate probe:", json.dumps(res), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--json", default=None)
    ap.add_argument("--verify-file", default="/dev/shm/probe-verify.safetensors")
    args = ap.parse_args()
    import cupy as cp
    import torch
    results = []

    def sync():
        torch.cuda.synchronize()
    instrument()
    src = args.ckpt
    full = lambda **o: fs.load_file(src, device="cuda:0", framework="pt", **o)  # noqa: E731
    rows = lambda **o: fs.load_file(src, device="cuda:0", framework="pt", shard=fs.Shard(0, 8, 0), **o)  # noqa: E731
    cols = lambda **o: fs.load_file(src, device="cuda:0", framework="pt", shard=fs.Shard(0, 8, -1), **o)  # noqa: E731
    results.append(run_case("full", full, sync))
    results.append(run_case("rows", rows, sync))
    results.append(run_case("cols", cols, sync))
    results.append(run_case("rows threads=8", lambda: rows(threads=8), sync))
    pre = {k: v.clone() for k, v in rows().items()}
    results.append(run_case("rows load_into (preallocated)",
                            lambda: fs.load_into(pre, src, shard=fs.Shard(0, 8, 0)), sync))
    del pre
    # the fixed costs outside the pipeline
    pc = time.perf_counter
    from foxhunt_stream.io.checkpoint import open_checkpoint
    t = pc()
    ck = open_checkpoint(src)
    t_open = pc() - t
    t = pc()
    fracs = [pagecache.resident_fraction(p) for p in ck.paths]
    t_res = pc() - t
    print(json.dumps({"open_checkpoint_ms": 1e3 * t_open, "resident_fraction_all_ms": 1e3 * t_res,
                      "fractions": fracs}), flush=True)
    # verify: one shard (about 4 GB), saved with checksums into /dev/shm
    try:
        one = ck.paths[1]
        fs.save_file(fs.load_file(one, device="cuda:0", framework="pt"), args.verify_file, checksum="xxh3-64",
                     fsync=False)
        results.append(run_case("verify=False (one shard)", lambda: fs.load_file(args.verify_file, device="cuda:0",
                                                                                framework="pt"), sync))
        for piece in (1 << 20, 4 << 20, 64 << 20):
            ftarget.PIECE_BYTES = piece
            results.append(run_case(f"verify=True (one shard), pieces of {piece >> 20} MiB",
                                    lambda: fs.load_file(args.verify_file, device="cuda:0", framework="pt", verify=True),
                                    sync))
        ftarget.PIECE_BYTES = 1 << 20
        os.unlink(args.verify_file)
    except Exception as e:  # noqa: BLE001
        print("verify probe failed:", repr(e), flush=True)
    try:
        populate_probe(ck.paths[1])
    except Exception as e:  # noqa: BLE001
        print("populate probe failed:", repr(e), flush=True)
    # first-use costs in a fresh process: cupy import, context, streams, pinned staging
    code = r"""
import time; t0=time.perf_counter()
import cupy as cp; t1=time.perf_counter()
cp.cuda.Device(0).use(); cp.cuda.runtime.free(cp.cuda.runtime.malloc(1)); t2=time.perf_counter()
import numpy as np, threading
from foxhunt_stream.cuda.devices import context
ctx=context(0); p=ctx.pool(8<<20|8192, 64); t3=time.perf_counter()
bufs=[]
def a():
    for _ in range(4): bufs.append(cp.cuda.PinnedMemory(8<<20, cp.cuda.runtime.hostAllocPortable))
ts=[threading.Thread(target=a) for _ in range(16)]; t4=time.perf_counter(); [x.start() for x in ts]; [x.join() for x in ts]; t5=time.perf_counter()
big=cp.cuda.PinnedMemory(512<<20, cp.cuda.runtime.hostAllocPortable); t6=time.perf_counter()
print({'import_cupy_ms':1e3*(t1-t0),'context_ms':1e3*(t2-t1),'pool_64x8MiB_serial_ms':1e3*(t3-t2),'pool_64x8MiB_16threads_ms':1e3*(t5-t4),'one_512MiB_ms':1e3*(t6-t5)})
"""
    import subprocess
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    print("first-use:", r.stdout.strip(), r.stderr[-2000:], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
