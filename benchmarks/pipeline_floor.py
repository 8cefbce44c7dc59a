"""The floor under a load: the pipeline's data movement alone, without the load around it.

``Floor(ckpt, shard, device)`` plans a load with the library's own planner (untimed), then each
call moves that plan's chunks the way the pipeline does and nothing else: ``threads`` threads take
chunks in plan order, each reads its chunk with one ``os.preadv`` into one of its two pinned slots
and queues one ``cudaMemcpyAsync`` and one event record on its own stream, waiting on the slot's
event before reusing it. The destination is one buffer allocated before the first call. No header
is parsed, nothing is planned, allocated or checked during a call; the threads are the library's
parked workers (``engine.workers``), woken per call as a load wakes them. On the CPU the copy is
a memcpy into a host buffer, on the worker.

It measures what the hardware and a Python pipeline give a plan's bytes, so that a load's figure
can be split into that floor and what the load adds (setup, allocation, bookkeeping). Only plans
of contiguous runs (the full load, a dim-0 shard) are supported: strided runs are the library's
own business (gathers or whole row spans).

``mode="read"`` does the reads alone (into the slots), ``mode="copy"`` the copies alone (of
whatever the slots hold): what each half of the pipeline costs by itself. Run as a script, it
times the floor of the full load and of a TP rank's rows plan, whole and by halves, at a few
chunk sizes, beside the library's own loads of the same plans:

    python benchmarks/pipeline_floor.py CKPT [--tp 8] [--rounds 7] [--out DIR]
    python benchmarks/pipeline_floor.py /tmp/ck --size 64MiB --device cpu --rounds 1   # a smoke run

``--ladder`` instead climbs from the floor to the library's full load one step at a time, at each
read size of ``--reads`` (MiB): the floor; the floor in slots laid out as the library's pinned
pool (``arena=True``: one registered mapping, a slot every chunk + 8 KiB); the floor's loop landing
each chunk through the library's target (``TargetFloor``: its ring of pool slots, ``read_span``,
copy and event); ``load_into`` (the library's plan, workers and bookkeeping into tensors made
before); ``load_file`` (the same, allocating its tensors); and ``load_file`` with
``--ladder-threads`` workers; the full plan's, or with ``--ladder-plan rows`` rank 0's rows plan:

    python benchmarks/pipeline_floor.py CKPT --ladder [--ladder-plan rows] --reads 4,2 --rounds 5 [--out DIR]
"""

from __future__ import annotations

import functools
import itertools
import os
import sys

import numpy as np

from foxhunt_stream import settings as _settings
from foxhunt_stream.cuda.devices import parse_device
from foxhunt_stream.engine import loader, workers
from foxhunt_stream.engine.frameworks import Buffer
from foxhunt_stream.engine.staging import slot_bytes
from foxhunt_stream.engine.targets import CudaTarget, HostTarget
from foxhunt_stream.format.indexing import Run
from foxhunt_stream.io.source import FileSource
from foxhunt_stream.format.plan import members
from foxhunt_stream.format.tp import indices_for
from foxhunt_stream.io.checkpoint import open_checkpoint, select

SLOTS_PER_THREAD = 2
MODES = ("both", "read", "copy")


class Floor:
    """One plan's chunks, ready to be moved again and again (``__call__``).

    ``dest``: a buffer of at least the plan's bytes to land in (several floors may share one),
    else one is allocated."""

    def __init__(self, ckpt: str, shard, device: str, threads: int = 16, chunk_bytes: int | None = None,
                 slots: int = SLOTS_PER_THREAD, mode: str = "both", dest=None, read_bytes: int | None = None,
                 arena: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.device = parse_device(device)
        self.threads = threads
        self.slots_per_thread = slots
        self.mode = mode
        # slots of chunk_bytes, reads of read_bytes (each by default the library's)
        s = _settings.merge(backend="pread", **{k: v for k, v in (("chunk_bytes", chunk_bytes),
                                                                   ("read_bytes", read_bytes)) if v is not None})
        chunk_bytes = s.chunk_bytes
        ck = open_checkpoint(ckpt)
        names = select(ck, None)
        plan = loader.prepare(ck, loader.selections(ck, names, indices_for(ck, names, shard)), s, self.device,
                              order="whole").plan
        if any(c.run.height != 1 for c in plan.chunks):
            raise ValueError("the floor moves contiguous runs only (a full load or a dim-0 shard)")
        starts, total = [], 0
        for d in plan.destinations:
            starts.append(total)
            total += d.nbytes
        self.nbytes = total
        # a shared chunk's tensors lie back to back here as in the file: one copy at the first one's place
        self.chunks = [(c.file, c.run.src, c.run.width, starts[members(c.dest)[0]] + c.run.dst) for c in plan.chunks]
        self.paths = list(ck.paths)
        self.fds = [os.open(p, os.O_RDONLY) for p in ck.paths]
        n = threads * slots
        if dest is not None and len(dest) < total:
            raise ValueError(f"the destination holds {len(dest)} bytes, the plan {total}")
        if self.device.is_cuda:
            import torch

            from foxhunt_stream.cuda import runtime
            self.rt = runtime.runtime()
            with runtime.on_device(self.device.index):
                if arena:   # the library pool's layout: one registered mapping, slots a chunk + 8 KiB apart
                    pool = runtime.PinnedArena(slot_bytes(chunk_bytes), n)
                    self.slots = [(pool.pin(k)[:chunk_bytes], pool) for k in range(n)]
                else:
                    self.slots = [runtime.pinned(chunk_bytes) for _ in range(n)]
                self.streams = [runtime.Stream() for _ in range(threads)]
                self.events = [runtime.Event() for _ in range(n)]
            self.dest = dest if dest is not None else torch.empty(total, dtype=torch.uint8, device=str(self.device))
            self.dest_ptr = self.dest.data_ptr()
        else:
            self.slots = [(np.empty(chunk_bytes, np.uint8), None) for _ in range(n)]
            self.dest = dest if dest is not None else np.empty(total, np.uint8)

    def __call__(self) -> None:
        counter = itertools.count()
        work = self._gpu_worker if self.device.is_cuda else self._host_worker
        errors: list[BaseException] = []

        def run(w: int) -> None:
            try:
                work(w, counter)   # the threads share the chunks through ``counter``
            except BaseException as e:  # noqa: BLE001 - raised by the caller
                errors.append(e)
        tasks = [workers.run(functools.partial(run, w), f"floor-{w}") for w in range(self.threads)]
        for t in tasks:
            t.join()
        if errors:
            raise errors[0]

    def _gpu_worker(self, w: int, counter) -> None:
        from foxhunt_stream.cuda.devices import use_device
        use_device(self.device.index)
        rt, chunks, fds, base = self.rt, self.chunks, self.fds, self.dest_ptr
        per = self.slots_per_thread
        mine = range(w * per, (w + 1) * per)
        views = [memoryview(self.slots[i][0]) for i in mine]
        ptrs = [self.slots[i][0].ctypes.data for i in mine]
        events = [self.events[i].ptr for i in mine]
        pending = [False] * per
        stream = self.streams[w]
        read, copy = self.mode != "copy", self.mode != "read"
        k = 0
        for i in counter:
            if i >= len(chunks):
                break
            f, src, n, dst = chunks[i]
            if pending[k]:
                rt.eventSynchronize(events[k])
            if read and os.preadv(fds[f], [views[k][:n]], src) != n:
                raise OSError(f"short read at {src} of file {f}")
            if copy:
                rt.memcpyAsync(base + dst, ptrs[k], n, 1, stream.ptr)
                rt.eventRecord(events[k], stream.ptr)
                pending[k] = True
            k = (k + 1) % per
        stream.synchronize()

    def _host_worker(self, w: int, counter) -> None:
        chunks, fds, dest = self.chunks, self.fds, self.dest
        slot = self.slots[w * self.slots_per_thread][0]
        view = memoryview(slot)
        read, copy = self.mode != "copy", self.mode != "read"
        for i in counter:
            if i >= len(chunks):
                break
            f, src, n, dst = chunks[i]
            if read and os.preadv(fds[f], [view[:n]], src) != n:
                raise OSError(f"short read at {src} of file {f}")
            if copy:
                dest[dst:dst + n] = slot[:n]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        self.dest = None


class TargetFloor:
    """The floor's chunks and threads, each chunk landed by the library's target (``CudaTarget.land``:
    the worker's ring of slots from the device's pinned pool, ``read_span``, one copy and one event;
    on the CPU ``HostTarget.land``) into ``floor``'s destination: the floor plus the target's own work."""

    def __init__(self, floor: Floor, read_bytes: int | None = None) -> None:
        s = _settings.merge(**({} if read_bytes is None else {"read_bytes": read_bytes})).resolved()
        self.floor, self.threads = floor, floor.threads
        dev = floor.device
        self.target = (CudaTarget(dev.index, s.chunk_bytes, s.n_slots, floor.threads) if dev.is_cuda
                       else HostTarget(s.chunk_bytes, s.n_slots))
        self.sources = [FileSource(p) for p in floor.paths]
        self.runs = [(f, Run(src, n, n, 1, dst)) for f, src, n, dst in floor.chunks]
        self.buf = (Buffer(dev, floor.nbytes, None, floor.dest_ptr) if dev.is_cuda
                    else Buffer(dev, floor.nbytes, floor.dest))

    def __call__(self) -> None:
        counter, errors = itertools.count(), []
        runs, target, sources, buf = self.runs, self.target, self.sources, self.buf

        def run(w: int) -> None:
            try:
                for i in counter:
                    if i >= len(runs):
                        break
                    f, r = runs[i]
                    target.land(w, sources[f], r, buf)
            except BaseException as e:  # noqa: BLE001 - raised by the caller
                errors.append(e)
            finally:
                if isinstance(target, CudaTarget):
                    target.release_worker(w)
        tasks = [workers.run(functools.partial(run, w), f"target-floor-{w}") for w in range(self.threads)]
        for t in tasks:
            t.join()
        if self.floor.device.is_cuda:
            from foxhunt_stream.cuda.devices import context
            context(self.floor.device.index).synchronize()
        if errors:
            raise errors[0]

    def close(self) -> None:
        for src in self.sources:
            src.close()


def rows_shard(fs, files: list[str], tp: int):
    """Rank 0 of ``tp``'s rows plan: every tensor of two or more dimensions split along dim 0, the
    1-D ones whole."""
    shapes = {t.name: tuple(t.shape) for p in files for t in fs.read_header(p).tensors}
    return fs.TPSlice(0, tp, lambda n: 0 if len(shapes[n]) >= 2 else None)


def ladder(args, files: list[str], fs, common) -> int:
    """From the floor to the library's load of the full plan (or with ``--ladder-plan rows`` of rank
    0's rows plan), a step at a time (``--ladder``; the module's docstring)."""
    from common import GB, Results, median
    res = Results("ladder", args.out)
    fw = common.framework(args.device)
    dev = parse_device(args.device)
    gpu = dev.is_cuda
    shard = rows_shard(fs, files, args.tp) if args.ladder_plan == "rows" else None
    first = fs.load_file(args.ckpt, device=args.device, framework=fw, progress=False, shard=shard)
    store = {k: (v.clone() if hasattr(v, "clone") else v.copy()) for k, v in first.items()}
    del first
    mib = 1 << 20
    cases: dict = {}
    dest = None
    for rb in (int(x) * mib for x in args.reads.split(",")):
        at = f"{rb // mib} MiB"
        floor = Floor(args.ckpt, shard, args.device, threads=args.threads, chunk_bytes=rb, read_bytes=rb, dest=dest)
        dest = floor.dest
        cases[f"floor, {at} slots and reads"] = floor
        if gpu:
            cases[f"floor, slots laid out as the pool, {at}"] = Floor(args.ckpt, shard, args.device, threads=args.threads,
                                                                     chunk_bytes=rb, read_bytes=rb, dest=dest, arena=True)
        cases[f"floor loop, chunks landed by the target, {at} reads"] = TargetFloor(floor, rb)
        cases[f"load_into (tensors made before), {at} reads"] = functools.partial(
            fs.load_into, store, args.ckpt, progress=False, read_bytes=rb, shard=shard)
        cases[f"load_file, {at} reads"] = functools.partial(
            fs.load_file, args.ckpt, device=args.device, framework=fw, progress=False, read_bytes=rb, shard=shard)
    cases[f"load_file, {args.ladder_threads} workers"] = functools.partial(
        fs.load_file, args.ckpt, device=args.device, framework=fw, progress=False, threads=args.ladder_threads,
        shard=shard)
    steps = [c for c in cases.values() if isinstance(c, (Floor, TargetFloor))]
    nbytes = floor.nbytes
    plan = "the full plan" if shard is None else f"rank 0 of TP={args.tp}, rows plan"
    res.say(f"ladder: {plan}, {nbytes / GB:.2f} GB, hot, to {args.device}; the floors on {args.threads} threads, the loads "
            f"with the library's defaults unless named; medians of {args.rounds} interleaved rounds", "")
    if gpu:
        import cupy
        ceiling = (1 << 30) / median(common.ce.copy_ceiling(cupy, dev.index, 1 << 30, 3)) / GB
        res.say(f"ceiling, one pinned host -> device copy of 1 GiB: {ceiling:.2f} GB/s")
        res.data["ceiling_GBps"] = ceiling
    common.ce.warm(files)
    times = common.interleaved(cases, args.rounds, args.device)
    full = median(times[next(k for k in cases if k.startswith("load_file"))])
    table = [("step", "median s", "GB/s", "of the first load_file")]
    for name, ts in times.items():
        m = median(ts)
        table.append((name, f"{m:.4f}", f"{nbytes / m / GB:.2f}", f"{m / full:.3f}"))
    res.table(table, right={1, 2, 3})
    res.data.update(rounds=args.rounds, threads=args.threads, seconds=times, nbytes=nbytes)
    res.save()
    for c in steps:
        c.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """The floor of the full load and of rank 0's rows plan (every 2-D tensor along dim 0), whole
    and by halves (reads alone, copies alone), at 8 and 4 MiB chunks, beside the library's loads
    of the same plans; interleaved rounds, medians, each as a fraction of the library's full load."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the suite's modules
    import common
    from common import GB, Results, median

    import foxhunt_stream as fs

    ap = common.parser(main.__doc__.split(";")[0])
    ap.add_argument("--tp", type=int, default=8, help="ranks of the rows plan (default 8); rank 0 is measured")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median; default 7)")
    ap.add_argument("--threads", type=int, default=16, help="floor threads (default 16)")
    ap.add_argument("--ladder", action="store_true", help="from the floor to the library's load, a step at a time")
    ap.add_argument("--reads", default="4,2", help="--ladder: read sizes in MiB (default 4,2)")
    ap.add_argument("--ladder-threads", type=int, default=14, help="--ladder: the last step's workers (default 14)")
    ap.add_argument("--ladder-plan", choices=("full", "rows"), default="full",
                    help="--ladder: the plan climbed to, the full load's or rank 0's rows plan (--tp)")
    args = ap.parse_args(argv)
    if args.ladder:
        return ladder(args, common.ensure_checkpoint(args.ckpt, args.size, args.shards), fs, common)
    files = common.ensure_checkpoint(args.ckpt, args.size, args.shards)
    rows = rows_shard(fs, files, args.tp)
    fw = common.framework(args.device)
    res = Results("floor", args.out)
    cases: dict = {"full load (library)": lambda: fs.load_file(args.ckpt, device=args.device, framework=fw),
                   "rows (library)": lambda: fs.load_file(args.ckpt, device=args.device, framework=fw, shard=rows)}
    floors: dict[str, Floor] = {}
    dest = None
    mib = 1 << 20
    for plan, shard in (("full load", None), ("rows", rows)):
        eight, four = {"chunk_bytes": 8 * mib, "read_bytes": 8 * mib}, {"chunk_bytes": 4 * mib, "read_bytes": 4 * mib}
        for label, kw in (("8 MiB x 2, reads and copies", eight),
                          ("8 MiB x 2, reads alone", {**eight, "mode": "read"}),
                          ("8 MiB x 2, copies alone", {**eight, "mode": "copy"}),
                          ("4 MiB x 2, reads and copies", four)):
            floor = Floor(args.ckpt, shard, args.device, threads=args.threads, dest=dest, **kw)
            dest = floor.dest   # the full load's buffer, shared by every floor
            floors[f"{plan} floor, {label}"] = floor
    cases.update(floors)
    common.ce.warm(files)
    times = common.interleaved(cases, args.rounds, args.device)   # after one untimed run each
    full = median(times["full load (library)"])
    nbytes = {k: f.nbytes for k, f in floors.items()}
    nbytes["full load (library)"] = floors["full load floor, 8 MiB x 2, reads and copies"].nbytes
    nbytes["rows (library)"] = floors["rows floor, 8 MiB x 2, reads and copies"].nbytes
    res.say(f"floor: {nbytes['full load (library)'] / GB:.2f} GB checkpoint in {len(files)} files, hot, to "
            f"{args.device}; rows: rank 0 of TP={args.tp}; {args.threads} floor threads; medians of "
            f"{args.rounds} interleaved rounds", "")
    table = [("case", "GB", "median s", "GB/s", "of the full load (library)")]
    for name, ts in times.items():
        m = median(ts)
        table.append((name, f"{nbytes[name] / GB:.3f}", f"{m:.4f}", f"{nbytes[name] / m / GB:.2f}", f"{m / full:.3f}"))
    res.table(table, right={1, 2, 3, 4})
    res.data.update(tp=args.tp, rounds=args.rounds, threads=args.threads, seconds=times, nbytes=nbytes,
                    fraction={k: median(v) / full for k, v in times.items()})
    res.save()
    for f in floors.values():
        f.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
