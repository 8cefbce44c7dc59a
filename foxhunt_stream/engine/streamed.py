"""A load whose first chunks move while its caller still reads headers, plans and allocates.

A load's setup (each file's header read and checked, the plan, the destinations allocated) is
Python, and it cannot run beside workers that take the GIL between chunks: each of them would
wait for it. Here the workers take none: each runs ``CudaTarget.land_queue``, a loop in C over a
queue of contiguous chunks (``cuda.native.Queue``), while the caller goes through the files one
by one, appending each tensor's chunks as soon as the tensor is allocated. Only the first file's
first tensor is set up before the workers start and the first read.

It serves the plain case, which is also the most common one: a sharded checkpoint with an index,
loaded whole by ``load_file`` to one GPU (every tensor, a glob or a predicate; whole tensors or
dim-0 slices of a ``TPSlice``), its files in the page cache, no checksums, no progress bar, not in
the background, the native library built. Anything else (``eligible`` says so before a file is
opened) goes the general way (``engine.loader``). The result is the same: the same checks of every
header and of the index against the headers (once all are read: a failure then stops the workers
and frees what was allocated before it is raised), the same arrays in the same order.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import settings as _settings
from ..cuda import native
from ..cuda.devices import Device, context
from ..format.plan import Selection, is_small, plan_load
from ..format.tp import TPSlice, dim_rule, indices_for
from ..io import pagecache
from ..io.checkpoint import Checkpoint, Names, Resolved, assemble, read_header_with_identity, select
from ..io.source import FileSource, open_source
from . import workers
from .frameworks import Framework
from .progress import shown
from .targets import CudaTarget

Record = tuple[int, int, int, int]   # a contiguous chunk: file descriptor, offset, bytes, device address

# the plan's worst case per file: every tensor one chunk more than its bytes need (the queue is
# sized before the headers are read, from the files' sizes and header lengths)
MIN_ENTRY_BYTES = 40   # the shortest tensor entry of a header: "":{"dtype":"U8","shape":[],"data_offsets":[0,0]}
# a file at least this much in the page cache (sampled) is hot: read with positional reads, as the
# general way reads it (``loader.GATHER_RESIDENT``); a colder one goes the general way, in streams
HOT_RESIDENT = 0.9


def eligible(resolved: Resolved, names: Names, shard: TPSlice | None, s: _settings.Settings,
             device: Device | None, *, background: bool, verify: bool, progress: bool | None,
             device_map: Any) -> bool:
    """Whether a ``load_file`` call can take the streamed way (module docstring), decided from
    its arguments, the index and the files' residency, before any header is read."""
    if (background or verify or device_map is not None or device is None or not device.is_cuda
            or resolved.weight_map is None or not native.enabled() or native.library() is None
            or s.direct_io == "on" or s.backend not in ("auto", "pread") or shown(progress)):
        return False
    if not (names is None or isinstance(names, str) or callable(names)):
        return False   # a list of names: the caller's order
    if shard is not None and not _rows_only(shard, resolved.weight_map):
        return False
    paths = resolved.paths
    if any(pagecache.prefetching(p) for p in paths):
        return False
    # a hot file is read through the page cache whatever direct_io="auto" would budget
    # (``cache_policy.MOSTLY_RESIDENT`` is below HOT_RESIDENT)
    return all(pagecache.resident_fraction(p) >= HOT_RESIDENT for p in paths)


def _rows_only(shard: TPSlice, weight_map: dict[str, str]) -> bool:
    """Every tensor of the index whole or sliced along dim 0 (contiguous runs only)."""
    if not isinstance(shard, TPSlice):
        return False
    try:
        rule = dim_rule(shard)
        return all(rule(n) in (0, None) for n in weight_map)
    except Exception:   # noqa: BLE001 - the general way reports a bad rule, naming the tensor
        return False


def _selector(names: Names) -> Callable[[str], bool]:
    if names is None:
        return lambda n: True
    if isinstance(names, str):
        return lambda n: fnmatch.fnmatchcase(n, names)
    return names


def _capacity(paths: list[str], cut: int) -> int:
    """Records a plan of these files can need: per file, its bytes in ``cut`` pieces plus one more
    per tensor, bounded by what its header's length can describe."""
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            n = int.from_bytes(f.read(8), "little")
        total += math.ceil(os.path.getsize(p) / max(1, cut // 2)) + n // MIN_ENTRY_BYTES + 1
    return total


@dataclass
class _Stream:
    """What the caller of a streamed load fills as it reads the files."""
    queue: native.Queue
    s: _settings.Settings
    cut: int                                  # the read piece
    shard: TPSlice | None
    fw: Framework
    device: Device
    start: Callable[[], None]                 # starts the workers (once)
    arrays: dict[str, Any] = field(default_factory=dict)
    small: list[Record] = field(default_factory=list)    # for the end, as small_chunks_last does
    queued: dict[int, int] = field(default_factory=dict)  # bytes per file descriptor


def load(resolved: Resolved, names: Names, shard: TPSlice | None, s: _settings.Settings, device: Device,
         fw: Framework) -> dict[str, Any] | None:
    """The streamed load (``eligible`` said yes); None when this machine cannot run it (no native
    queue for its CUDA runtime): the caller then takes the general way, nothing having been read.

    The workers start once the first tensor's chunks are queued: started earlier, their own start
    (Python, the GIL) and their waiting slow the caller's first header and plan more than they gain
    (on the H200 machine the first chunk was queued 5.4 ms into a load that way)."""
    threads = min(s.threads, s.n_slots)
    target = CudaTarget(device.index, s.chunk_bytes, s.n_slots, threads)
    if not target.lands_queues:
        return None
    cut = min(s.read_cut, s.chunk_bytes)
    queue = native.Queue(_capacity(resolved.paths, cut))
    selected = _selector(names)
    sources: list[FileSource] = []
    by_fd: dict[int, FileSource] = {}
    read: list[tuple] = []
    errors: list[BaseException] = []
    tasks: list[workers.Task] = []

    def work(w: int) -> None:
        try:
            target.land_queue(w, queue, by_fd)
        except BaseException as e:  # noqa: BLE001 - raised by the caller
            errors.append(e)
        finally:
            target.release_worker(w)

    def start() -> None:
        if not tasks:
            tasks.extend(workers.run(functools.partial(work, w), f"foxhunt-{w}") for w in range(threads))

    fw.settle(device)
    st = _Stream(queue, s, cut, shard, fw, device, start)
    try:
        for i, path in enumerate(resolved.paths):
            header, identity = read_header_with_identity(path)
            read.append((header, identity))
            src = open_source(path, "pread", header.file_size)
            sources.append(src)
            by_fd[src.fd] = src
            src.identity = identity
            src.check_unchanged("file-replaced")
            _queue_file(st, i, src, header, [t.name for t in header.tensors if selected(t.name)])
            if queue.stopped:
                break
        if not queue.stopped:
            ck = assemble(resolved, read)   # the checks across files, as open_checkpoint makes them
            select(ck, names)               # a glob or predicate that selects nothing is an error
            for record in st.small:
                queue.append(*record)
        start()
        queue.seal()
    except BaseException:
        queue.stop()
        _finish(tasks, device, sources)
        st.arrays.clear()
        raise
    try:
        _wait(tasks, device)
        if errors:
            raise errors[0]
        for src in sources:
            src.count(st.queued.get(src.fd, 0))
            src.check_unchanged()   # a file rewritten while it was read may have fed us two versions
    except BaseException:
        st.arrays.clear()
        raise
    finally:
        _finish(tasks, device, sources)
    return st.arrays


def _queue_file(st: _Stream, i: int, src: FileSource, header, chosen: list[str]) -> None:
    """Plan file ``i``'s ``chosen`` tensors, allocate each and publish its chunks at once (those
    under a quarter of a read piece go to ``st.small``). The first tensor is planned alone and the
    workers started once its chunks are queued; the rest of the file is planned while they move."""
    one = Checkpoint([src.path], [header], names={t.name: (0, t) for t in header.tensors})
    indices = indices_for(one, chosen, st.shard)
    sels = [Selection(i, header.data_start, header.by_name[n], indices.get(n) if indices else None) for n in chosen]
    quarter, queue, queued = st.cut // 4, st.queue, st.queued
    for batch in (sels[:1], sels[1:]):
        plan = plan_load(batch, st.s.chunk_bytes, read_bytes=st.cut)
        at = 0
        for dest, count in zip(plan.destinations, plan.chunks_per_dest):
            arr, buf = st.fw.new(dest.dtype, dest.shape, st.device, dest.name)
            st.arrays[dest.name] = arr
            for c in plan.chunks[at:at + count]:
                record = (src.fd, c.run.src, c.run.width, buf.ptr + c.run.dst)
                queued[src.fd] = queued.get(src.fd, 0) + c.run.width
                if is_small(c.run, quarter):
                    st.small.append(record)
                else:
                    queue.append(*record)
            at += count
            queue.publish()
        st.start()


def _wait(tasks: list[workers.Task], device: Device) -> None:
    """Wait for every worker and every copy they queued."""
    for t in tasks:
        t.join()
    context(device.index).synchronize()


def _finish(tasks: list[workers.Task], device: Device, sources: list[FileSource]) -> None:
    """``_wait``, then close the files (however the wait ends)."""
    try:
        _wait(tasks, device)
    finally:
        for src in sources:
            src.close()
