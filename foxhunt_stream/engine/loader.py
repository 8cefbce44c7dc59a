"""The loader: checkpoint -> plan -> sources -> staging -> target -> framework arrays.

``load_file`` (in this process) and ``load_into`` open the checkpoint, select and plan what to
read, open the files with the right read backend, and run a ``LoadInFlight``; ``safe_open`` and
the background ``LoadHandle`` are front ends over the same pieces. The public ``fs.load_file``
(``api``) adds loading across a torch.distributed group.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, Collection, Mapping, MutableMapping, Sequence

from .. import settings as _settings
from ..cuda import runtime as cudart
from ..cuda.devices import CPU, Device, check_device
from ..errors import FormatError, StoreMismatchError
from ..format.dtypes import host_shape
from ..format.plan import LoadPlan, Selection, plan_load, small_chunks_last, take_in_turn
from ..format.tp import TPSlice, indices_for, shard_shape
from ..io import cache_policy, pagecache
from ..io.checkpoint import Checkpoint, Names, open_checkpoint, open_resolved, resolve, select
from ..io.source import FileSource, open_source
from . import streamed
from .destinations import Destinations
from .frameworks import expected_host_dtype, framework_of
from .handle import LoadHandle
from .inflight import LoadInFlight
from .placement import Placement, interleave_by_device, placement
from .progress import progress_bar

log = logging.getLogger("foxhunt_stream")


class LoadIntoWarning(UserWarning):
    """load_into(strict=False) skipped names: ``missing`` (in the store only), ``unexpected`` (file only)."""

    def __init__(self, missing: list[str], unexpected: list[str]) -> None:
        self.missing, self.unexpected = missing, unexpected
        super().__init__(f"load_into: {len(missing)} missing name(s) {missing[:10]} and {len(unexpected)} "
                         f"unexpected name(s) {unexpected[:10]} were skipped")


def read_backends(ck: Checkpoint, s: _settings.Settings, needs: Sequence[int] | None = None) -> list[str]:
    """The read backend of each file of ``ck``. ``direct_io="auto"`` reads around the page cache
    (O_DIRECT) only the files that would not stay in it (``io.cache_policy``), given the bytes
    ``needs`` the load reads from each file (default: whole files). A file a prefetch is filling
    is read through the cache, not around it."""
    if s.direct_io == "on":
        return ["direct"] * len(ck.paths)
    if s.direct_io == "off":
        return [s.backend] * len(ck.paths)
    needs = list(needs) if needs is not None else [h.file_size for h in ck.headers]
    through = cache_policy.read_through_cache(ck.paths, needs)
    return [s.backend if keep or pagecache.prefetching(p) else "direct" for p, keep in zip(ck.paths, through)]


def file_bytes(plan: LoadPlan, n_files: int) -> list[int]:
    """The bytes a plan reads from each of ``n_files`` files (a strided run: its whole span)."""
    out = [0] * n_files
    for f, _, (_, pitch, width, height, _) in plan.chunks:   # Run.span, written out: once per chunk
        out[f] += width if height == 1 else (height - 1) * pitch + width if height else 0
    return out


# a file at least this much in the page cache (sampled) gathers its strided runs out of a mapping
GATHER_RESIDENT = 0.9
# a file read through the cache while less than this much of it is there comes from the disk
# now: its source promotes the pages it reads (``FileSource.promote``), for the next start
COLD_RESIDENT = 0.5


def is_cold(path: str) -> bool:
    """Less than ``COLD_RESIDENT`` of the file in the page cache (sampled once per residency snapshot)."""
    return pagecache.resident_fraction(path) < COLD_RESIDENT


def gathering_files(ck: Checkpoint, s: _settings.Settings, among: Collection[int] | None = None) -> frozenset[int]:
    """The files whose strided runs (column slices) a load gathers row by row out of a mapping
    instead of reading their whole row spans; the plan cuts those runs by the bytes they land.

    With backend "auto" (the default) these are the files in the page cache, of ``among`` (the
    files holding a column slice, ``strided_files``; None: every file). A cold file, or one a
    prefetch is still filling, keeps positional reads of whole spans: through a mapping its
    missing pages would come in one fault, one small read, at a time. With "mmap": every file
    that is not read with O_DIRECT."""
    if s.backend == "mmap":
        return frozenset(i for i, b in enumerate(read_backends(ck, s)) if b == "mmap")
    if s.backend != "auto" or s.direct_io == "on":
        return frozenset()
    return frozenset(i for i, p in enumerate(ck.paths)
                     if (among is None or i in among)
                     and not pagecache.prefetching(p) and pagecache.resident_fraction(p) >= GATHER_RESIDENT)


def strided_files(ck: Checkpoint, indices: Mapping[str, Any] | None) -> frozenset[int]:
    """The files holding a selection indexed past its first dim (``x[:, a:b]``: a strided run).
    Only these are worth mapping for gathers."""
    return frozenset(ck.names[n][0] for n, index in (indices or {}).items()
                     if isinstance(index, tuple) and len(index) > 1)


def open_sources(ck: Checkpoint, s: _settings.Settings, gathered: frozenset[int] = frozenset(), *,
                 needs: Sequence[int] | None = None) -> list[FileSource]:
    """One open source per file, each checked to be the file whose header we hold. Those in
    ``gathered`` (``gathering_files``, which the plan was cut for) are opened with the mapping
    backend asked for; the others read with positional reads, through the page cache or around it
    (``read_backends``; ``needs``: the bytes the load reads from each file)."""
    out = []
    try:
        backends = read_backends(ck, s, needs)
        for i, (p, h) in enumerate(zip(ck.paths, ck.headers)):
            pagecache.loading(p)   # a prefetch holding back for the imports: the load wants these bytes now
            backend = s.backend if i in gathered else backends[i]
            if i not in gathered and backend in ("auto", "mmap"):
                backend = "pread"
            out.append(open_source(p, backend, h.file_size))
            if out[-1].backend == "pread" and is_cold(p):
                out[-1].promote = True
            if ck.identities:   # the file opened must be the one whose header we hold
                out[-1].identity = ck.identities[i]
                out[-1].check_unchanged("file-replaced")
    except BaseException:
        for src in out:
            src.close()
        raise
    return out


# A cold file read through the cache is read as up to ``threads`` sequential streams, each with a
# descriptor of its own (``FileSource.read_in_streams``); a load opens at most this many of them.
# On the H200 machine (Linux 6.18, ext4), after a cold load of a 16 GB checkpoint through one
# descriptor per file (small folios) the next start's TP=8 column shard took 0.34-0.36 of the
# full load, after one in streams (2 MiB folios) 0.22-0.24; the cold load ran 13% faster too.
STREAM_FDS = 256


def read_in_streams(plan: LoadPlan, sources: Sequence[FileSource], threads: int) -> LoadPlan:
    """The cold files read through the cache (``promote``) read as sequential streams, one per
    worker (fewer with many such files), and the plan taking their chunks from the streams in
    turn (``take_in_turn``), so that each stream's reads come one after the other."""
    cold = [src for src in sources if src.promote]
    streams = min(threads, STREAM_FDS // len(cold)) if cold else 1
    if streams < 2:
        return plan
    for src in cold:
        src.read_in_streams(streams)
    return take_in_turn(plan, lambda c: sources[c.file].stream(c.run.src) if c.run.height == 1 else None)


def close_all(sources: Sequence[FileSource]) -> None:
    for src in sources:
        src.close()


_REOPEN_ATTEMPTS = 3


def reopen_if_replaced(fn):
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


def read_cut(s: _settings.Settings, devices: Device | Sequence[Device]) -> int | None:
    """The piece a load reads a contiguous run in: ``read_bytes`` for a load staged through the
    pinned slots of a GPU (a smaller working set of slots moves the bytes faster), None (whole
    chunks) for a host load, which reads straight into its arrays (4 MiB reads were 9-13% slower
    there than 8 MiB on the 2-vCPU box)."""
    per = [devices] if isinstance(devices, Device) else devices
    return s.read_cut if any(dev.is_cuda for dev in per) else None


def cold_files(ck: Checkpoint, s: _settings.Settings, devices: Device | Sequence[Device] = CPU) -> frozenset[int]:
    """The files mostly not in the page cache (sampled): read in whole slots, not in ``read_bytes``
    pieces (on the H200 machine a cold load with 4 MiB reads kept 1.04-1.05x the raw cold read
    against 1.09-1.11x with 8 MiB). Nothing is sampled when reads are whole chunks anyway."""
    cut = read_cut(s, devices)
    if cut is None or cut >= s.chunk_bytes:
        return frozenset()
    return frozenset(i for i, p in enumerate(ck.paths) if is_cold(p))


def plan_selections(ck: Checkpoint, sels: list[Selection], s: _settings.Settings, verify: bool = False,
                    devices: Device | Sequence[Device] = CPU, gathered: frozenset[int] = frozenset(),
                    cold: frozenset[int] = frozenset()) -> tuple[LoadPlan, _settings.Settings, Any]:
    """The load plan; with ``verify``, chunks cut on checksum blocks and a Verifier to check them
    (``devices``: where each selection lands, which decides verify_on="auto"; ``gathered``: the
    files whose sources will gather strided runs, ``gathering_files``; ``cold``: files read in
    whole slots, ``cold_files``)."""
    cut = read_cut(s, devices)
    if not verify:
        return plan_load(sels, s.chunk_bytes, gathered=gathered, read_bytes=cut, cold=cold), s, None
    on: str | list[str] = s.verify_on
    if on == "auto":   # a GPU has memory bandwidth to spare; the host's goes to the reads
        per = [devices] * len(sels) if isinstance(devices, Device) else list(devices)
        gpu = cudart.has_cupy()   # the GPU's hashing kernel is cupy's: without it, hash as chunks are read
        on = ["landed" if dev.is_cuda and gpu else "read" for dev in per]
    from ..integrity.verifier import Verifier   # imported only by loads that verify
    verifier = Verifier.for_selections(ck, sels, [sel.info.nbytes for sel in sels], on=on)
    s = verifier.settings(s)
    return plan_load(sels, s.chunk_bytes, granule=verifier.granule, gathered=gathered, read_bytes=cut,
                     cold=cold), s, verifier


def selections(ck: Checkpoint, names: list[str], indices: Mapping[str, Any] | None = None) -> list[Selection]:
    """One Selection per name (with its index into the tensor, for slices), in the given order."""
    starts = [h.data_start for h in ck.headers]
    entries = ck.names
    if not indices:
        return [Selection(f, starts[f], info) for f, info in (entries[n] for n in names)]
    return [Selection(f, starts[f], info, indices.get(n)) for n in names for f, info in (entries[n],)]


def plan_and_open(ck: Checkpoint, chosen: list[str], shard: TPSlice | None, s: _settings.Settings, verify: bool,
                  devices: Device | Sequence[Device], *, whole: bool, interleave: bool = False
                  ) -> tuple[LoadPlan, _settings.Settings, Any, list[FileSource]]:
    """A load's plan and its open sources, each file's residency sampled once: the files holding
    column slices gather them where cached, cold files are read in whole slots. ``interleave``:
    chunks interleaved by device (device_map); else with ``whole`` (the load is awaited whole, not
    verified) cold files read in streams and small chunks last."""
    indices = indices_for(ck, chosen, shard)
    with pagecache.residency_snapshot():
        gathered = gathering_files(ck, s, strided_files(ck, indices))
        plan, s, verifier = plan_selections(ck, selections(ck, chosen, indices), s, verify, devices, gathered,
                                            cold_files(ck, s, devices))
        sources = open_sources(ck, s, gathered, needs=file_bytes(plan, len(ck.paths)))
    try:
        if interleave:
            plan = interleave_by_device(plan, devices)
        elif whole and verifier is None:
            plan = small_chunks_last(read_in_streams(plan, sources, s.threads), read_cut(s, devices) or s.chunk_bytes)
    except BaseException:
        close_all(sources)
        raise
    return plan, s, verifier, sources


@reopen_if_replaced
def load_file(source, device: Any = "cpu", framework: str | None = None, names: Names = None, *,
              background: bool = False, shard: TPSlice | None = None, verify: bool = False,
              progress: bool | None = None, device_map: Mapping[str, Any] | None = None,
              **options) -> dict[str, Any] | LoadHandle:
    """Load the selected tensors of a checkpoint in this process; ``{name: array}``, or with
    ``background=True`` a ``LoadHandle`` at once. The arguments are ``fs.load_file``'s (which
    adds ``process_group``); ``device`` may also be an already resolved ``Placement``."""
    where = device if isinstance(device, Placement) else placement(device, framework, device_map)
    s = _settings.merge(background=background, **options)
    if isinstance(source, Checkpoint):
        ck = source
    else:
        resolved = resolve(source)
        if streamed.eligible(resolved, names, shard, s, where.device, background=background, verify=verify,
                             progress=progress, device_map=where.device_map):
            out = streamed.load(resolved, names, shard, s, where.device, where.for_names(())[1])
            if out is not None:
                return out
        ck = open_resolved(resolved)
    chosen = select(ck, names)
    devices, fw = where.for_names(chosen)
    plan, s, verifier, sources = plan_and_open(ck, chosen, shard, s, verify, devices, whole=not background,
                                               interleave=where.device_map is not None)
    try:
        load = LoadInFlight(plan, sources, Destinations.allocate(fw, plan, devices), s, check=verifier,
                            progress=progress_bar(plan.nbytes, "load", progress), per_dest=background)
    except BaseException:
        close_all(sources)
        raise
    handle = LoadHandle(load, chosen, lambda: close_all(sources))
    return handle if background else handle.result()


@reopen_if_replaced
def load_into(store: MutableMapping[str, Any], source, strict: bool = True, *, shard: TPSlice | None = None,
              verify: bool = False, names: Names = None, progress: bool | None = None,
              **options) -> dict[str, str]:
    """Fill the existing arrays of ``store`` in place from a checkpoint; returns its metadata.

    With ``shard=TPSlice(rank, world_size, dim)`` the store holds this rank's slices (their
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
    plan, s, verifier, sources = plan_and_open(ck, chosen, shard, s, verify, [b.device for b in buffers],
                                               whole=True)
    try:
        LoadInFlight(plan, sources, Destinations.fixed(buffers, [store[n] for n in chosen]), s,
                     check=verifier, progress=progress_bar(plan.nbytes, "load", progress)).finish()
    finally:
        close_all(sources)
    return metadata or {}
