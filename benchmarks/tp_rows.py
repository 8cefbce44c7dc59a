"""Where a tensor-parallel row shard's time goes, by variants run in interleaved rounds (issue 5).

    python3 benchmarks/tp_rows.py /dev/shm/tpb [--rounds 7] [--json OUT.json]

Every round runs each variant once, in turn, so the machine's drift touches all of them alike;
best and median per variant, and each as a ratio to the full load of the same round set. The
issue's target: a TP=8 rank's shard in at most 1/8 x 1.2 = 0.15 of the full load. Also measured,
for the column shard: the host pass alone (every covered byte page cache -> host memory, 16
threads, no GPU), which a column shard read with positional reads cannot beat.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import foxhunt_stream as fs  # noqa: E402
from foxhunt_stream.engine import loader  # noqa: E402
from foxhunt_stream.io.checkpoint import open_checkpoint  # noqa: E402
from foxhunt_stream.format.tp import indices_for  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import run_jobs  # noqa: E402


def host_pass(paths: list[str], threads: int = 16, chunk: int = 8 << 20, part: tuple[int, int] = (0, 1)
              ) -> tuple[float, int]:
    """Seconds to preadv every byte of ``paths`` into per-thread buffers (the page cache -> host
    copy a positional-read load makes), and the bytes; ``part=(i, n)``: only every n-th chunk."""
    jobs = [(p, off) for p in paths for off in range(0, os.path.getsize(p), chunk)][part[0]::part[1]]
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}
    try:
        dt = run_jobs(jobs, threads, lambda job, mv: os.preadv(fds[job[0]], [mv], job[1]),
                      setup=lambda: memoryview(np.empty(chunk, np.uint8)))
    finally:
        for fd in fds.values():
            os.close(fd)
    return dt, sum(min(chunk, os.path.getsize(p) - off) for p, off in jobs)


def allocate_upfront():
    """Patch: allocate every destination on the calling thread before the workers start."""
    orig = loader.Destinations.allocate_ahead

    def ahead(self, order, stop):
        for d in order:
            self.buffer(d)
        return None
    loader.Destinations.allocate_ahead = ahead
    return lambda: setattr(loader.Destinations, "allocate_ahead", orig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda:0", help="cuda:N, or cpu to check the script on a box without a GPU")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        fw, sync = "numpy", (lambda: None)
    else:
        import torch
        fw, sync = "pt", torch.cuda.synchronize

    src = args.ckpt
    ck = open_checkpoint(src)
    row = fs.Shard(0, args.tp, 0)

    def load(shard=None, source=src, **o):
        return lambda: fs.load_file(source, device=args.device, framework=fw, shard=shard, **o)

    pre = {k: v.copy() if fw == "numpy" else v.clone() for k, v in load(row)().items()}

    def upfront():
        undo = allocate_upfront()
        try:
            return load(row)()
        finally:
            undo()

    def no_hold(fn):
        """``fn`` with every worker started at once, beside the allocating thread (before 5c8)."""
        def run():
            real = loader.held_workers
            loader.held_workers = lambda threads: 0
            try:
                return fn()
            finally:
                loader.held_workers = real
        return run

    # no variant may change chunk_bytes or staging_bytes: the process-wide pinned pool would be
    # replaced (hundreds of ms of pinned allocation) each time the next variant swapped it back
    variants = {
        "full": load(),
        "full, no workers held back": no_hold(load()),
        "rows": load(row),
        "rows, no workers held back": no_hold(load(row)),
        "rows, threads=14": load(row, threads=14),
        "rows, headers parsed before (Checkpoint passed)": load(row, source=ck),
        "rows, load_into preallocated": lambda: fs.load_into(pre, src, shard=row),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():   # warm: staging, streams, caching allocator
        r = fn()
        sync()
        del r
    for _ in range(args.rounds):
        for name, fn in variants.items():
            gc.collect()
            sync()
            t0 = time.perf_counter()
            r = fn()
            sync()
            times[name].append(time.perf_counter() - t0)
            del r
    full_best, full_med = min(times["full"]), statistics.median(times["full"])
    rows_bytes = sum(int(v.nbytes) if fw == "numpy" else v.numel() * v.element_size() for v in pre.values())
    print(f"{'variant':50} {'best s':>8} {'median s':>9} {'best/full':>10} {'med/full':>9} {'GB/s best':>10}")
    out = {}
    for name, ts in times.items():
        best, med = min(ts), statistics.median(ts)
        nbytes = ck_bytes(ck) if name.startswith("full") else rows_bytes
        out[name] = {"best_s": best, "median_s": med, "best_ratio": best / full_best, "median_ratio": med / full_med,
                     "runs": ts}
        print(f"{name:50} {best:8.4f} {med:9.4f} {best / full_best:10.3f} {med / full_med:9.3f} "
              f"{nbytes / best / 1e9:10.2f}", flush=True)
    print(f"target: <= {1.2 / args.tp:.3f} of the full load, i.e. <= {full_best * 1.2 / args.tp:.4f} s against the best full")
    hp = [host_pass(ck.paths) for _ in range(3)]
    dt, nb = min(hp)
    out["host_pass"] = {"best_s": dt, "GBps": nb / dt / 1e9, "ratio_to_full": dt / full_best}
    print(f"host pass (preadv of every byte, 16 threads, no GPU): {dt:.4f} s = {nb / dt / 1e9:.1f} GB/s = "
          f"{dt / full_best:.3f} of the full load (a column shard read with positional reads cannot beat this)")
    # the fixed costs before any chunk, on this machine
    pc = time.perf_counter
    fixed = {}
    for _ in range(5):
        t = pc()
        c = open_checkpoint(src)
        t1 = pc()
        names = list(c.file_order())
        sels = loader._selections(c, names, indices_for(c, names, row))
        t2 = pc()
        loader.plan_load(sels, 8 << 20)
        t3 = pc()
        for k, v in (("open_checkpoint_ms", t1 - t), ("selections_ms", t2 - t1), ("plan_ms", t3 - t2)):
            fixed[k] = min(fixed.get(k, 1e9), 1e3 * v)
    out["fixed"] = fixed
    print("fixed costs (best of 5):", json.dumps({k: round(v, 2) for k, v in fixed.items()}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def ck_bytes(ck) -> int:
    return sum(info.nbytes for _, info in ck.names.values())


if __name__ == "__main__":
    sys.exit(main())
