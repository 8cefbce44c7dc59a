"""The loader: checkpoint -> plan -> sources -> staging -> target -> framework arrays.

``safe_open``, ``load_file``, ``load_into`` and ``prefetch``-style background loads are thin
front ends over one ``Landing``: a plan being executed by the pipeline into destination buffers.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import warnings
from dataclasses import replace
from typing import Any, Iterator, Mapping, MutableMapping, Sequence

from ..cuda import runtime as cudart
from .. import settings as _settings
from ..io.checkpoint import Checkpoint, Names, open_checkpoint, select
from ..cuda.devices import CPU, Device, check_device, context, parse_device
from ..format.dtypes import host_shape
from ..errors import FormatError, StoreMismatchError
from .frameworks import Buffer, expected_host_dtype, framework_of, get_framework
from .pipeline import Job
from .placement import interleave_by_device, parse_device_map, resolve_device_map
from ..format.plan import LoadPlan, Selection, plan_load
from .progress import NO_PROGRESS, Progress, progress_bar
from ..format.tp import Shard, indices_for, shard_shape
from ..io import pagecache
from ..io.source import FileSource, open_source
from .targets import CudaTarget, HostTarget

log = logging.getLogger("foxhunt_stream")


class LoadIntoWarning(UserWarning):
    """load_into(strict=False) skipped names: ``missing`` (in the store only), ``unexpected`` (file only)."""

    def __init__(self, missing: list[str], unexpected: list[str]) -> None:
        self.missing, self.unexpected = missing, unexpected
        super().__init__(f"load_into: {len(missing)} missing name(s) {missing[:10]} and {len(unexpected)} "
                         f"unexpected name(s) {unexpected[:10]} were skipped")


def _backend_for(path: str, s: _settings.Settings) -> str:
    if s.direct_io == "on":
        return "direct"
    # a file that a prefetch is filling into the page cache is read through it, not around it
    if s.direct_io == "auto" and not pagecache.warming(path) and pagecache.resident_fraction(path) < 0.5:
        return "direct"
    return s.backend


def open_sources(ck: Checkpoint, s: _settings.Settings) -> list[FileSource]:
    out = []
    try:
        for i, (p, h) in enumerate(zip(ck.paths, ck.headers)):
            pagecache.loading(p)   # a prefetch holding back for the imports: the load wants these bytes now
            out.append(open_source(p, _backend_for(p, s), h.file_size))
            if ck.identities:   # the file opened must be the one whose header we hold
                out[-1].identity = ck.identities[i]
                out[-1].check_unchanged("file-replaced")
    except BaseException:
        for src in out:
            src.close()
        raise
    return out


class Destinations:
    """Where each destination of a plan lands.

    ``Destinations.allocate`` makes new arrays lazily, in the worker that reaches a destination's
    first chunk: device allocation (cudaMalloc behind the framework's allocator) overlaps the
    reads instead of preceding them all, and the first tensor is not held up by the last one's
    allocation. ``Destinations.fixed`` wraps existing buffers (load_into).
    """

    def __init__(self, n: int, devices_of: list[Device], make=None, buffers: list[Buffer] | None = None,
                 arrays: list | None = None) -> None:
        self.devices_of = devices_of   # per destination, known before anything is allocated
        self.devices = set(devices_of)
        self._make = make
        self.buffers: list[Buffer | None] = buffers if buffers is not None else [None] * n
        self.arrays: list = arrays if arrays is not None else [None] * n
        self._locks = [threading.Lock() for _ in range(n)] if make is not None else []

    @classmethod
    def allocate(cls, framework, plan: LoadPlan, device: Device | Sequence[Device]) -> "Destinations":
        """``device``: one for all destinations, or one per destination (``device_map``)."""
        per_dest = [device] * len(plan.destinations) if isinstance(device, Device) else list(device)
        for dev in sorted(set(per_dest), key=str):
            if dev.is_cuda:
                # the framework's allocator may hand back blocks that work already queued on its
                # stream still reads; our copies run on other streams, so let that work finish first
                framework.settle(dev)

        def make(d: int):
            dest = plan.destinations[d]
            arr = framework.empty(dest.dtype, dest.shape, per_dest[d], dest.name)
            return arr, framework.buffer(arr)
        return cls(len(plan.destinations), per_dest, make)

    @classmethod
    def fixed(cls, buffers: list[Buffer], arrays: list) -> "Destinations":
        return cls(len(buffers), [b.device for b in buffers], buffers=buffers, arrays=arrays)

    def buffer(self, d: int) -> Buffer:
        b = self.buffers[d]
        if b is None:
            with self._locks[d]:
                b = self.buffers[d]
                if b is None:
                    arr, b = self._make(d)
                    self.arrays[d] = arr
                    self.buffers[d] = b
        return b

    def allocate_ahead(self, order, stop: threading.Event, then=None) -> threading.Thread | None:
        """Allocate destinations in ``order`` on one thread, ahead of the workers that need them.

        Sixteen workers each allocating the destination they reach contend for the GIL and the
        framework allocator's lock: on the H200, 291 allocations of a tensor-parallel shard
        cost ~40 ms of a ~110 ms load (preallocated: ~70 ms). One thread running ahead does them
        back to back; a worker that overtakes it allocates for itself, as before. A failure here
        (out of memory) is left for that worker to meet and report, naming the tensor.
        ``then`` runs when it stops, however it stops (the loader starts its held-back workers).
        """
        if self._make is None:
            return None

        def run():
            try:
                for d in order:
                    if stop.is_set():
                        return
                    if self.buffers[d] is None:
                        try:
                            self.buffer(d)
                        except BaseException:  # noqa: BLE001 - the worker raises it, with context
                            return
            finally:
                if then is not None:
                    then()
        t = threading.Thread(target=run, name="foxhunt-alloc", daemon=True)
        t.start()
        return t

    def array(self, d: int):
        self.buffer(d)   # zero-byte destinations have no chunk: allocate them here
        return self.arrays[d]

    def all_arrays(self) -> list:
        return [self.array(d) for d in range(len(self.arrays))]

    def release(self) -> None:
        """Drop every array (after a failure: nothing partial is kept alive)."""
        self.arrays = [None] * len(self.arrays)
        self.buffers = [None] * len(self.buffers)


_REOPEN_ATTEMPTS = 3


def _reopen_if_replaced(fn):
    """Start a load over when a file was replaced between its header read and its opening (a
    concurrent atomic save renamed a new version over it): the new version is read from scratch.
    Nothing has been allocated on a device or written to a store by then."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for attempt in range(_REOPEN_ATTEMPTS):
            try:
                return fn(*args, **kwargs)
            except FormatError as e:
                if e.rule != "file-replaced" or attempt == _REOPEN_ATTEMPTS - 1:
                    raise
    return wrapper


def held_workers(threads: int, cpus: int | None = None) -> int:
    """Workers to hold back while the allocating thread runs: enough to leave two CPUs free."""
    if cpus is None:
        cpus = _settings.available_cpus()
    return max(0, min(threads - 1, threads + 2 - cpus))


VERIFY_STREAMS = 16   # verify_on="landed" on a GPU: hashing kernels of up to this many tensors at once


class Landing:
    """A load plan in flight: per-destination readiness, cancellation, one wait for all."""

    def __init__(self, plan: LoadPlan, sources: list[FileSource], dests: Destinations,
                 s: _settings.Settings, keepalive: Any = None, verifier: Any = None,
                 progress: Progress = NO_PROGRESS, per_dest: bool = False) -> None:
        self.plan = plan
        # per_dest: someone waits for single destinations (tensors(), a background handle), so
        # each GPU chunk gets an event of its own; otherwise chunks share their slot's reused
        # event (a landed-verify kernel may start a little late) and finish() drains the streams
        self.per_dest = per_dest
        self.progress = progress
        self.verifier = verifier
        self.dests = dests
        self.sources = sources
        self._lock = threading.Lock()
        self._remaining = list(plan.chunks_per_dest)
        self._events: list[list] = [[] for _ in plan.destinations]
        self._ready = [threading.Event() for _ in plan.destinations]
        self._verify_streams: dict[Device, list] = {}
        self._landed_later: list[int] = []
        for d, n in enumerate(self._remaining):
            if n == 0:
                self._ready[d].set()
        # a host worker holds one scratch slot at a time: more than `threads` is waste (and
        # staging/chunk of them, e.g. 131072 with 4 KiB chunks, took seconds to allocate)
        if any(dev.is_cuda for dev in dests.devices):
            # every GPU worker holds a ring of at least one pinned slot until it runs out of work:
            # more workers than slots would leave some waiting for a slot until the others finish
            s = replace(s, threads=min(s.threads, s.n_slots))
        self._targets: dict[Device, Any] = {
            dev: (CudaTarget(dev.index, s.chunk_bytes, s.n_slots, s.threads) if dev.is_cuda
                  else HostTarget(s.chunk_bytes, min(s.n_slots, s.threads)))
            for dev in dests.devices}
        self.started = time.perf_counter()
        self.job = Job(plan.chunks, self._work, s.threads, self._on_done, keepalive=keepalive,
                       teardown=self._worker_done)
        log.debug("load: %d tensors, %d bytes, %d chunks, %d threads, chunk %d, staging %d, backends %s",
                  len(plan.destinations), plan.nbytes, len(plan.chunks), s.threads, s.chunk_bytes,
                  s.staging_bytes, sorted({src.backend for src in sources}))
        # the allocator starts first so that it leads the workers; while it runs, the workers
        # leave it a CPU (and one for the caller and the driver): on the 16-CPU H200 a row shard
        # with 16 workers beside the allocator took 0.186-0.194 of a full load, with 14 workers
        # 0.159-0.161, and 16 workers with nothing to allocate (load_into) ~0.16 as well
        self._allocator = (dests.allocate_ahead(plan.dest_order(), self.job._cancel, then=self.job.release)
                           if len(plan.destinations) > 1 else None)
        self.job.start(hold=held_workers(s.threads) if self._allocator is not None else 0)

    def _work(self, worker: int, chunk):
        d = chunk.dest
        dev = self.dests.devices_of[d]
        inspect = self.verifier.inspector(d, chunk.run) if self.verifier is not None else None
        # a GPU chunk is read into pinned staging before its destination is needed: the
        # allocation (if this worker overtook the allocating thread) overlaps the read
        buf = functools.partial(self.dests.buffer, d) if dev.is_cuda else self.dests.buffer(d)
        return self._targets[dev].land(worker, self.sources[chunk.file], chunk.run, buf, inspect=inspect,
                                       track=self.per_dest)

    def _worker_done(self, worker: int) -> None:
        for t in self._targets.values():
            if isinstance(t, CudaTarget):
                t.release_worker(worker)

    def _on_done(self, i: int, chunk, event) -> None:
        d = chunk.dest
        with self._lock:
            if event is not None:
                self._events[d].append(event)
            self._remaining[d] -= 1
            complete = self._remaining[d] == 0
        if complete and self.verifier is not None and self.verifier.hashes_landed(d):
            if self.per_dest or not self.dests.buffer(d).device.is_cuda:   # waited for, or host: hash it now
                self._verify_landed(d)
            else:               # hashed with the others in one launch once all copies are done
                with self._lock:
                    self._landed_later.append(d)
        if complete:
            self._ready[d].set()
        self.progress.update(chunk.run.nbytes)

    def _verify_landed(self, d: int) -> None:
        """verify_on="landed": hash destination ``d`` where it is, now that all of it is in."""
        buf = self.dests.buffer(d)
        if not buf.device.is_cuda:
            self.verifier.landed(d, buf)
            return
        from ..cuda.devices import cupy
        cp = cupy()
        with cp.cuda.Device(buf.device.index):
            # a kernel hashes one tensor's blocks in parallel but each block sequentially
            # (~ms): tensors go round-robin over several streams so their kernels overlap
            stream = self._verify_stream(buf.device, d)
            with self._lock:
                events = list(self._events[d])
            rt = cudart.runtime()
            for ev in events:   # the hash runs after every copy of this destination
                rt.streamWaitEvent(stream.ptr, ev.ptr)
            self.verifier.landed(d, buf, stream)

    def _verify_stream(self, dev: Device, d: int):
        from ..cuda.devices import cupy
        cp = cupy()
        with self._lock:
            streams = self._verify_streams.get(dev)
            if streams is None:
                with cp.cuda.Device(dev.index):
                    streams = self._verify_streams[dev] = [cp.cuda.Stream(non_blocking=True)
                                                           for _ in range(VERIFY_STREAMS)]
            return streams[d % VERIFY_STREAMS]

    def wait_dest(self, d: int) -> None:
        """Block until destination ``d`` has fully landed (its copies complete); without
        ``per_dest`` the wait may include later chunks of the same workers."""
        while not self._ready[d].wait(0.05):
            if self.job.done():
                break
        if not self._ready[d].is_set():
            self.finish()   # raises the job's error
            raise RuntimeError("load ended before every chunk landed")
        for ev in self._events[d]:
            ev.synchronize()
        if self.verifier is not None:
            self.verifier.settle(d)

    def finish(self) -> None:
        """Wait for everything; on error, make sure no copy is still writing before raising."""
        try:
            self.job.wait()
        except BaseException:
            self._join_allocator()
            self._drain()
            self.dests.release()
            self.progress.close()
            raise
        self._join_allocator()
        self._drain()
        self.progress.close()
        try:
            if self.verifier is not None:
                later, self._landed_later = self._landed_later, []   # once: a second finish() must not relaunch
                if later:
                    self.verifier.landed_batch([(d, self.dests.buffer(d)) for d in later],
                                               lambda dev: self._verify_stream(dev, 0))
                self.verifier.settle()   # verify_on="landed" on a GPU: the digests queued there
            self._check_unchanged()
        except BaseException:
            # hashing kernels queued since the drain above (landed_batch: other devices or block
            # sizes than the one that failed) may still be reading the destinations
            with contextlib.suppress(Exception):
                self._drain()
            self.dests.release()   # a mixed-version load hands nothing back, nor keeps it alive
            raise
        elapsed = time.perf_counter() - self.started
        if elapsed > 0:
            log.debug("load: %.3f s, %.2f GB/s", elapsed, self.plan.nbytes / elapsed / 1e9)

    def _join_allocator(self) -> None:
        if self._allocator is not None:
            self._allocator.join()   # every destination it started is allocated or failed
            self._allocator = None

    def _check_unchanged(self) -> None:
        """A file rewritten or resized while it was read may have fed us a mix of two versions."""
        for src in self.sources:
            if src.fd >= 0:
                src.check_unchanged()

    def _drain(self) -> None:
        for dev in self._targets:
            if dev.is_cuda:
                context(dev.index).synchronize()
        for streams in self._verify_streams.values():   # hashing kernels still reading destinations
            for stream in streams:
                stream.synchronize()

    def cancel(self) -> None:
        self.job.cancel()


def _close_all(sources):
    for src in sources:
        src.close()


def _plan(ck: Checkpoint, sels: list[Selection], s: _settings.Settings, verify: bool,
          devices: Device | Sequence[Device] = CPU):
    """The load plan; with ``verify``, chunks cut on checksum blocks and a Verifier to check them
    (``devices``: where each selection lands, which decides verify_on="auto")."""
    if not verify:
        return plan_load(sels, s.chunk_bytes), s, None
    on: str | list[str] = s.verify_on
    if on == "auto":   # a GPU has memory bandwidth to spare; the host's goes to the reads
        per = [devices] * len(sels) if isinstance(devices, Device) else list(devices)
        on = ["landed" if dev.is_cuda else "read" for dev in per]
    from ..integrity.verifier import Verifier  # imported only by loads that verify
    verifier = Verifier.for_selections(ck, sels, [sel.info.nbytes for sel in sels], on=on)
    s = verifier.settings(s)
    return plan_load(sels, s.chunk_bytes, granule=verifier.granule), s, verifier


def _selections(ck: Checkpoint, names: list[str], indices: Mapping[str, Any] | None = None) -> list[Selection]:
    out = []
    for n in names:
        f, info = ck.names[n]
        out.append(Selection(f, ck.headers[f].data_start, info, (indices or {}).get(n)))
    return out


class LoadHandle:
    """A background load (``load_file(..., background=True)``): ``result()`` waits for all,
    ``wait(name)`` only for one tensor, ``done()`` polls, ``cancel()`` stops it."""

    def __init__(self, landing: Landing, names: list[str], on_close) -> None:
        self._landing, self._names = landing, names
        self._pos = {n: i for i, n in enumerate(names)}
        self._on_close = on_close
        self._result: dict | None = None
        self._closed = False

    @property
    def names(self) -> list[str]:
        """The tensors this load fills, in file order."""
        return list(self._names)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of the array each tensor lands as (a slice's, with ``shard``; sub-byte types
        packed in bytes), known from the headers before any byte has landed."""
        return {n: host_shape(d.dtype, tuple(d.shape)) for n, d in zip(self._names, self._landing.plan.destinations)}

    def wait(self, name: str):
        try:
            self._landing.wait_dest(self._pos[name])
        except BaseException:
            if self._landing.job.done():   # failed or cancelled: release the files now
                self._close()
            raise
        return self._landing.dests.array(self._pos[name])

    def done(self) -> bool:
        return self._landing.job.done()

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        if self._result is None:
            # A timeout leaves the load running, so its files must stay open: only close once finished.
            if timeout is not None and not self._landing.job._done.wait(timeout):
                raise TimeoutError("background load still running")
            try:
                self._landing.finish()
            finally:
                self._close()
            self._result = dict(zip(self._names, self._landing.dests.all_arrays()))
        return self._result

    def cancel(self) -> None:
        self._landing.cancel()
        try:
            self._landing.finish()
        except BaseException:
            pass
        self._close()

    def _close(self):
        if not self._closed:
            self._closed = True
            self._on_close()


@_reopen_if_replaced
def load_file(source, device="cpu", framework: str | None = None, names: Names = None, *,
              background: bool = False, shard: Shard | None = None, verify: bool = False,
              progress: bool | None = None, process_group=None, device_map: Mapping[str, Any] | None = None,
              **options) -> dict[str, Any] | LoadHandle:
    """Load the selected tensors of a checkpoint; returns ``{name: array}``.

    ``source`` is a file, a list of files, an index.json or a directory. Unselected bytes are
    never read. With ``background=True`` returns a ``LoadHandle`` at once. With
    ``shard=Shard(rank, world_size, dim)`` each array is this rank's slice of the tensor. With
    ``verify=True`` every tensor is checked against the digests saved with it
    (``save_file(checksum=...)``) as its chunks land; a mismatch raises ChecksumError and nothing
    is returned. ``progress``: a bar on stderr (None: only on a terminal and past about a second;
    True: always; False: never). With ``process_group`` (a torch.distributed group; every rank
    calls this) the checkpoint is read once across the group and shared by broadcasts
    (``foxhunt_stream.distributed``; framework "pt" only, ``exchange_bytes=`` bounds its memory).
    With ``device_map={name or prefix: device}`` (instead of ``device``) each tensor lands on the
    device of the longest key that is its name or a prefix ending at a ``.`` (``""``: the default),
    several GPUs at once, each with its own streams and staging (``foxhunt_stream.placement``).
    """
    if device_map is not None:
        if process_group is not None:
            raise ValueError("load_file: device_map and process_group are not supported together")
        if device is not None and not (isinstance(device, str) and device.strip().lower() == "cpu"):
            raise ValueError(f"load_file: pass either device ({device!r}) or device_map, not both")
        parse_device_map(device_map)   # a bad key or device fails before any file is opened
    if process_group is not None:
        from ..distributed.load import load_file_distributed
        return load_file_distributed(source, device, framework, names, process_group=process_group,
                                     background=background, shard=shard, verify=verify, progress=progress,
                                     **options)
    s = _settings.merge(background=background, **options)
    dev = parse_device(device)
    check_device(dev)
    fw = get_framework(framework, dev)
    ck = open_checkpoint(source)
    chosen = select(ck, names)
    placed: Device | list[Device] = dev
    if device_map is not None:
        placed = resolve_device_map(chosen, device_map)
        for d in sorted(set(placed), key=str):
            check_device(d)
        fw = get_framework(framework, next((d for d in placed if d.is_cuda), CPU))   # the default: cupy on a GPU
    plan, s, verifier = _plan(ck, _selections(ck, chosen, indices_for(ck, chosen, shard)), s, verify, placed)
    if device_map is not None:
        plan = interleave_by_device(plan, placed)
    sources = open_sources(ck, s)
    try:
        landing = Landing(plan, sources, Destinations.allocate(fw, plan, placed), s, verifier=verifier,
                          progress=progress_bar(plan.nbytes, "load", progress), per_dest=background)
    except BaseException:
        _close_all(sources)
        raise
    handle = LoadHandle(landing, chosen, lambda: _close_all(sources))
    return handle if background else handle.result()


@_reopen_if_replaced
def load_into(store: MutableMapping[str, Any], source, strict: bool = True, *, shard: Shard | None = None,
              verify: bool = False, names: Names = None, progress: bool | None = None,
              **options) -> dict[str, str]:
    """Fill the existing arrays of ``store`` in place from a checkpoint; returns its metadata.

    With ``shard=Shard(rank, world_size, dim)`` the store holds this rank's slices (their
    shapes are checked against the slices, not the whole tensors).

    Every name, shape and dtype is checked before any byte is written; a mismatch (and, with
    ``strict``, a missing or unexpected name) raises StoreMismatchError listing them all, with
    the store untouched. With ``strict=False`` missing/unexpected names are skipped and reported
    as a LoadIntoWarning. A file without metadata gives ``{}`` (the seed's contract: a map).
    With ``verify=True`` each tensor is checked against its saved digest as it lands; on a
    mismatch ChecksumError is raised and the store's contents are unspecified. ``names`` (as in
    load_file) limits which checkpoint tensors are considered at all; the others are neither
    read nor reported.
    """
    s = _settings.merge(**options)
    ck = open_checkpoint(source)
    metadata = ck.metadata()   # a conflict is an error before any byte lands
    considered = select(ck, names)
    in_file = set(considered) if names is not None else ck.names
    missing = [n for n in store.keys() if n not in in_file]
    unexpected = [n for n in considered if n not in store]
    problems = []
    chosen, buffers = [], []
    for n in considered:
        if n not in store:
            continue
        arr = store[n]
        info = ck.names[n][1]
        fw = framework_of(arr)
        file_shape = info.shape if shard is None else shard_shape(info.shape, shard, n)
        want_shape = host_shape(info.dtype, file_shape)
        want_dtype = expected_host_dtype(fw, info.dtype)
        _, shape, dev = fw.describe(arr)
        got_dtype = arr.dtype
        if tuple(shape) != tuple(want_shape):
            problems.append(f"{n}: shape {list(shape)} in the store, {list(file_shape)} in the file"
                            + ("" if shard is None else f" (rank {shard.rank} of {shard.world_size})"))
        elif got_dtype != want_dtype:
            problems.append(f"{n}: dtype {got_dtype} in the store, {info.dtype.name} ({want_dtype}) in the file")
        else:
            try:
                check_device(dev)
                buffers.append(fw.buffer(arr))
                chosen.append(n)
            except ValueError as e:
                problems.append(f"{n}: {e}")
    if strict:
        problems += [f"{n}: missing from the checkpoint" for n in missing]
        problems += [f"{n}: in the checkpoint but not in the store" for n in unexpected]
    if problems:
        raise StoreMismatchError(problems, missing=missing, unexpected=unexpected)
    if missing or unexpected:
        warnings.warn(LoadIntoWarning(missing, unexpected), stacklevel=2)
    settled = set()
    for n, b in zip(chosen, buffers):   # work queued on the store's arrays finishes before we overwrite them
        fw = framework_of(store[n])
        if b.device.is_cuda and (type(fw), b.device) not in settled:
            fw.settle(b.device)
            settled.add((type(fw), b.device))
    plan, s, verifier = _plan(ck, _selections(ck, chosen, indices_for(ck, chosen, shard)), s, verify,
                              [b.device for b in buffers])
    sources = open_sources(ck, s)
    try:
        Landing(plan, sources, Destinations.fixed(buffers, [store[n] for n in chosen]), s,
                verifier=verifier, progress=progress_bar(plan.nbytes, "load", progress)).finish()
    finally:
        _close_all(sources)
    return metadata or {}


class _Closed:
    def __getattr__(self, _):
        raise ValueError("operation on a closed safe_open handle")


class SliceView:
    """``f.get_slice(name)``: shape and dtype without reading; ``[index]`` lands only those elements."""

    def __init__(self, handle: "safe_open", name: str) -> None:
        self._h, self._name = handle, name
        self._info = handle._ck.names[name][1]

    def get_shape(self) -> list[int]:
        return list(self._info.shape)

    def get_dtype(self) -> str:
        return self._info.dtype.name

    @property
    def shape(self):
        return tuple(self._info.shape)

    def __getitem__(self, index):
        if index is None:   # numpy's newaxis, not "no index" (which the planner reads as the whole tensor)
            index = (None,)
        return self._h._load([self._name], {self._name: index})[0]


class safe_open:
    """Drop-in for ``safetensors.safe_open``: lazy, random access to one checkpoint.

    ``with safe_open(path, framework="pt", device="cuda:0") as f: f.get_tensor(name)``.
    Arrays returned stay valid after the handle is closed. With ``verify=True`` whole tensors are
    checked against their saved digests (a slice cannot be, and is refused).
    """

    @_reopen_if_replaced
    def __init__(self, filename, framework: str | None = None, device="cpu", *, verify: bool = False,
                 **options) -> None:
        self._verify = verify
        self._s = _settings.merge(**options)
        self._dev = parse_device(device)
        check_device(self._dev)
        self._fw = get_framework(framework, self._dev)
        self._ck = open_checkpoint(filename)
        self._sources = open_sources(self._ck, self._s)

    # -- lifecycle
    def __enter__(self) -> "safe_open":
        self._check()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._sources is not None:
            _close_all(self._sources)
            self._sources = None

    def _check(self):
        if self._sources is None:
            raise ValueError("operation on a closed safe_open handle")

    # -- header
    def keys(self) -> list[str]:
        self._check()
        return sorted(self._ck.names)

    def offset_keys(self) -> list[str]:
        self._check()
        return self._ck.file_order()

    def metadata(self) -> dict[str, str] | None:
        self._check()
        return self._ck.metadata()

    def get_slice(self, name: str) -> SliceView:
        self._check()
        if name not in self._ck.names:
            raise KeyError(f"no tensor named {name!r}")
        return SliceView(self, name)

    def get_tensor(self, name: str):
        self._check()
        if name not in self._ck.names:
            raise KeyError(f"no tensor named {name!r}")
        return self._load([name])[0]

    def _start(self, names: list[str], indices=None, progress: bool | None = False, per_dest: bool = False):
        self._check()
        plan, s, verifier = _plan(self._ck, _selections(self._ck, names, indices), self._s, self._verify,
                                  self._dev)
        return Landing(plan, self._sources, Destinations.allocate(self._fw, plan, self._dev), s, verifier=verifier,
                       progress=progress_bar(plan.nbytes, "load", progress), per_dest=per_dest)

    def _load(self, names: list[str], indices=None) -> list:
        landing = self._start(names, indices)
        landing.finish()
        return landing.dests.all_arrays()

    def tensors(self, names: Names = None, *, shard: Shard | None = None,
                progress: bool | None = None) -> Iterator[tuple[str, Any]]:
        """Yield ``(name, array)`` as each tensor lands (file order, or the order of a list);
        with ``shard``, each array is this rank's slice; ``progress`` as in load_file."""
        chosen = select(self._ck, names)
        landing = self._start(chosen, indices_for(self._ck, chosen, shard), progress, per_dest=True)
        finished = False
        try:
            for d, name in enumerate(chosen):
                landing.wait_dest(d)
                yield name, landing.dests.array(d)
            landing.finish()
            finished = True
        finally:
            if not finished:   # stopped early, or a tensor failed its check after the reads were done:
                landing.cancel()   # the rest is dropped, the hashing streams drained, memory released
                try:
                    landing.finish()
                except BaseException:
                    pass
