"""Where one load's time goes: the setup steps, the workers, the return.

    python benchmarks/load_timeline.py CKPT [--device cuda:0] [--rounds 5] [--tp 8]
    python benchmarks/load_timeline.py /tmp/ck --device cpu --rounds 1   # a smoke run

For the full load and rank 0 of TP=``--tp`` under three plans (rows, tp_bench's Llama plan,
columns), in interleaved rounds: the load's median run, and in it, in milliseconds from the
call, when each setup step of ``engine.loader`` ended (header, indices, gather choice, plan,
sources opened), when the workers started and ended (first, median, last), when their chunks
started and ended, and when the call returned. The steps are timed by wrapping the loader's
functions, so this measures the library as it runs, plus a few microseconds a chunk. A worker
running its own loop (a plain load to one GPU) is timed by its claims: a chunk starts when it
is claimed and ends when the next one is. A streamed load (``engine.streamed``: a hot sharded
checkpoint to one GPU, whole or by rows) shows when each tensor's and each file's chunks were
queued, when the queue was sealed and when the workers' loops (in C) started and ended; its
chunks are not timed one by one.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the suite's modules, wherever it runs from
import common
from tp_bench import LLAMA_PLAN

import foxhunt_stream as fs
from foxhunt_stream.cuda import native
from foxhunt_stream.engine import inflight, loader, pipeline, streamed, targets
from foxhunt_stream.io import mapping

STEPS = ["open_resolved", "indices_for", "gathering_files", "plan_selections", "open_sources"]
ORDER = STEPS + ["tensor queued", "file queued", "queue sealed", "worker start", "chunk start", "LoadInFlight()",
                 "chunk end", "worker end", "returned"]


class Marks:
    """Timestamps by label, from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.at: dict[str, list[float]] = {}

    def add(self, label: str) -> None:
        t = time.perf_counter()
        with self.lock:
            self.at.setdefault(label, []).append(t)


def instrument(marks: Marks) -> None:
    """Wrap the loader's steps, the pipeline's workers and the load's chunks to mark their ends."""
    def after(label, fn):
        def wrapped(*a, **k):
            out = fn(*a, **k)
            marks.add(label)
            return out
        return wrapped
    for name in STEPS:
        setattr(loader, name, after(name, getattr(loader, name)))
    loader.LoadInFlight = after("LoadInFlight()", loader.LoadInFlight)
    run, work = pipeline.Job._run, inflight.LoadInFlight._work

    def run_marked(self, worker):
        marks.add("worker start")
        try:
            run(self, worker)
        finally:
            marks.add("worker end")

    def work_marked(self, worker, chunk):
        marks.add("chunk start")
        try:
            return work(self, worker, chunk)
        finally:
            marks.add("chunk end")
    claims = pipeline.Job._claims

    def claims_marked(self):
        # a worker running its own loop (CudaTarget.land_all) claims each chunk here, and has
        # ended the chunk before when it asks for the next one (or stops)
        taken = False
        for item in claims(self):
            if taken:
                marks.add("chunk end")
            marks.add("chunk start")
            taken = True
            yield item
        if taken:
            marks.add("chunk end")
    pipeline.Job._run = run_marked
    pipeline.Job._claims = claims_marked
    inflight.LoadInFlight._work = work_marked
    # a streamed load (engine.streamed): each file queued, and the workers' loops in C
    streamed._queue_file = after("file queued", streamed._queue_file)
    native.Queue.publish = after("tensor queued", native.Queue.publish)
    native.Queue.seal = after("queue sealed", native.Queue.seal)
    land_queue = targets.CudaTarget.land_queue

    def land_queue_marked(self, worker, queue, by_fd):
        marks.add("worker start")
        try:
            return land_queue(self, worker, queue, by_fd)
        finally:
            marks.add("worker end")
    targets.CudaTarget.land_queue = land_queue_marked


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=8, help="ranks (default 8); rank 0 is measured")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median; default 5)")
    args = ap.parse_args(argv)
    files = common.ensure_checkpoint(args.ckpt, args.size, args.shards)
    shapes = {t.name: tuple(t.shape) for p in files for t in fs.read_header(p).tensors}
    fw = common.framework(args.device)
    plans = {"full": None,
             "rows": lambda n: 0 if len(shapes[n]) >= 2 else None,
             "Llama": LLAMA_PLAN,
             "columns": lambda n: 1 if len(shapes[n]) >= 2 else None}
    marks = Marks()
    instrument(marks)
    common.ce.warm(files)

    def once(dim):
        shard = None if dim is None else fs.TPSlice(0, args.tp, dim)
        marks.at.clear()
        t0 = time.perf_counter()
        out = fs.load_file(args.ckpt, device=args.device, framework=fw, shard=shard)
        returned = time.perf_counter()
        common.synchronize(args.device)
        seconds = time.perf_counter() - t0
        del out
        mapping.wait_unmapped()
        at = {k: [(x - t0) * 1e3 for x in v] for k, v in marks.at.items()}
        at["returned"] = [(returned - t0) * 1e3]
        return seconds, at
    for dim in plans.values():   # untimed: pools, caches
        once(dim)
    runs: dict[str, list] = {k: [] for k in plans}
    names = list(plans)
    for r in range(args.rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            runs[k].append(once(plans[k]))
    full = statistics.median(s for s, _ in runs["full"])
    print(f"TP={args.tp}, rank 0, to {args.device}; medians of {args.rounds} interleaved rounds; "
          "ms from the call in the median run")
    for k, v in runs.items():
        v.sort(key=lambda x: x[0])
        seconds, at = v[len(v) // 2]
        print(f"== {k}: {seconds * 1e3:.1f} ms ({seconds / full:.3f} of the full load); runs "
              + " ".join(f"{s * 1e3:.0f}" for s, _ in v))
        for label in ORDER:
            if label in at:
                xs = sorted(at[label])
                print(f"   {label:18} first {xs[0]:7.1f}  median {statistics.median(xs):7.1f}  "
                      f"last {xs[-1]:7.1f}  n={len(xs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
