"""The loader: checkpoint -> plan -> sources -> staging -> target -> framework arrays.

``load_file`` and ``load_into`` select tensors; ``prepare`` decides how each file is read and
makes the plan; ``open_sources`` opens the files; a ``LoadInFlight`` runs the plan. ``safe_open``,
``LoadHandle`` and the public ``fs.load_file`` (``api``) are front ends over the same pieces.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import warnings
from typing import TYPE_CHECKING, Any, Mapping, MutableMapping, NamedTuple, Sequence

from .. import collector, settings as _settings
from ..cuda.devices import CPU, Device, check_device
from ..errors import FormatError, StoreMismatchError
from ..format.dtypes import host_shape
from ..format.plan import LoadPlan, Selection, plan_load, span_bytes
from ..io import pagecache
from ..io.checkpoint import Checkpoint, Names, open_checkpoint, select
from ..io.read_policy import ReadPolicy, read_policies
from ..io.source import FileSource
from .staging import start_pinning
from .destinations import Destinations
from .frameworks import expected_host_dtype, framework_of
from .handle import LoadHandle
from .inflight import LoadCheck, LoadInFlight
from .placement import Placement, placement
from .progress import progress_bar

if TYPE_CHECKING:
    from ..format.tp import TPSlice


class LoadIntoWarning(UserWarning):
    """load_into(strict=False) skipped names: ``missing`` (in the store only), ``unexpected`` (file only)."""

    def __init__(self, missing: list[str], unexpected: list[str]) -> None:
        self.missing, self.unexpected = missing, unexpected
        super().__init__(f"load_into: {len(missing)} missing name(s) {missing[:10]} and {len(unexpected)} "
                         f"unexpected name(s) {unexpected[:10]} were skipped")


def selections(ck: Checkpoint, names: list[str], indices: Mapping[str, Any] | None = None) -> list[Selection]:
    """One Selection per name (with its index into the tensor, for slices), in the given order."""
    starts = [h.data_start for h in ck.headers]
    entries = ck.names
    if not indices:   # Selection(...) without its Python-level __new__: one per tensor of a load
        return [_new(Selection, (f, starts[f], info, None, None)) for f, info in map(entries.__getitem__, names)]
    return [Selection(f, starts[f], info, indices.get(n)) for n in names for f, info in (entries[n],)]


_new = tuple.__new__
_INDEX = operator.itemgetter(3)   # Selection.index


def shard_indices(ck: Checkpoint, names: list[str], shard: TPSlice | None) -> dict[str, Any] | None:
    """Each name's index into its tensor for rank ``shard`` (None unsharded: only a sharded load
    imports ``format.tp``)."""
    if shard is None:
        return None
    from ..format.tp import indices_for
    return indices_for(ck, names, shard)


class Prepared(NamedTuple):
    """What a load runs: its plan, settings, files' read policies and checksum check (or None)."""
    plan: LoadPlan
    settings: _settings.Settings
    policies: list[ReadPolicy]
    verifier: Any


def prepare(ck: Checkpoint, sels: list[Selection], s: _settings.Settings, devices: Device | Sequence[Device] = CPU,
            *, verify: bool = False, order: str = "selection", verifier: LoadCheck | None = None,
            policies: Sequence[ReadPolicy] | None = None) -> Prepared:
    """How each file is read (one residency sample per file) and the plan for it, made once.

    ``devices``: where the selections land (one for all, or one each). ``verify``: every tensor is
    checked against its saved digests (``verifier``: a check made by the caller instead).
    ``order``: "whole", "selection" or "by_device" (``format.plan.plan_load``). ``policies``: the
    files' policies decided before (a ``safe_open`` handle's): not sampled again.
    """
    per = [devices] * len(sels) if isinstance(devices, Device) else list(devices)
    if verify and verifier is None:
        on: str | list[str] = s.verify_on
        if on == "auto":   # a GPU has memory bandwidth to spare; the host's goes to the reads
            from ..cuda import runtime as cudart
            gpu = cudart.has_cupy()   # the GPU's hashing kernel is cupy's: without it, hash as chunks are read
            on = ["landed" if dev.is_cuda and gpu else "read" for dev in per]
        from ..integrity.verifier import Verifier   # imported only by loads that verify
        verifier = Verifier.for_selections(ck, sels, [sel.info.nbytes for sel in sels], on=on)
    if verifier is not None:
        s = verifier.settings(s)
        if order == "whole":
            order = "selection"   # tensors are checked as they land, in plan order
    if policies is None:
        # the selections with an index, picked in C (a whole load has none)
        indexed = itertools.compress(sels, map(operator.is_not, map(_INDEX, sels), itertools.repeat(None)))
        strided = {f for f, _, _, index, _ in indexed if isinstance(index, tuple) and len(index) > 1}
        with _gone_is_replaced():
            policies = read_policies(ck.paths, lambda: span_bytes(sels, len(ck.paths)), strided,
                                     [h.file_size for h in ck.headers], s, streams=order == "whole")
    gpu = devices.is_cuda if isinstance(devices, Device) else any(dev.is_cuda for dev in per)
    plan = plan_load(sels, s.chunk_bytes, verifier.granule if verifier is not None else 1, files=policies or (),
                     read_bytes=s.read_cut if gpu else None, order=order, devices=per)
    return Prepared(plan, s, list(policies or ()), verifier)


@contextlib.contextmanager
def _gone_is_replaced():
    """A file gone since its header was read was replaced: FormatError ``file-replaced``."""
    try:
        yield
    except FileNotFoundError as e:
        raise FormatError("file-replaced", "the file was removed after its header was read (a new save "
                          "replaced the checkpoint?); load it again", path=e.filename) from None


def open_sources(ck: Checkpoint, policies: Sequence[ReadPolicy]) -> list[FileSource]:
    """One open source per file, opened as its policy says, checked to be the file whose header we hold."""
    out: list[FileSource] = []
    try:
        with _gone_is_replaced():
            for i, (path, policy) in enumerate(zip(ck.paths, policies)):
                pagecache.loading(path)   # a prefetch holding back for the imports: the load wants these bytes now
                src = policy.open(path)
                out.append(src)
                if ck.identities:   # the file opened must be the one whose header we hold
                    src.identity = ck.identities[i]
                    src.check_unchanged("file-replaced")
    except BaseException:
        close_all(out)
        raise
    return out


def close_all(sources: Sequence[FileSource]) -> None:
    for src in sources:
        src.close()


_REOPEN_ATTEMPTS = 3


def reopen_if_replaced(fn):
    """Start a load over when a file was replaced between its header read and its opening (a
    concurrent save), before anything is allocated or written."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for attempt in range(_REOPEN_ATTEMPTS):
            try:
                return fn(*args, **kwargs)
            except FormatError as e:
                if e.rule != "file-replaced" or attempt == _REOPEN_ATTEMPTS - 1:
                    raise
    return wrapper


@reopen_if_replaced
@collector.paused()   # resumed once the load's own objects are freed, only its result left
def load_file(source, device: Any = "cpu", framework: str | None = None, names: Names = None, *,
              background: bool = False, shard: TPSlice | None = None, verify: bool = False,
              progress: bool | None = None, device_map: Mapping[str, Any] | None = None,
              **options) -> dict[str, Any] | LoadHandle:
    """Load the selected tensors of a checkpoint in this process; ``{name: array}``, or with
    ``background=True`` a ``LoadHandle`` at once. The arguments are ``fs.load_file``'s (which
    adds ``process_group``); ``device`` may also be an already resolved ``Placement``."""
    where = device if isinstance(device, Placement) else placement(device, framework, device_map)
    s = _settings.merge(background=background, **options)
    if where.device is not None:
        start_pinning(where.device, s)
    ck = open_checkpoint(source)
    chosen = select(ck, names)
    devices, fw = where.for_names(chosen)
    if where.device is None:
        start_pinning(devices, s)
    order = "by_device" if where.device_map is not None else "selection" if background else "whole"
    plan, s, policies, verifier = prepare(ck, selections(ck, chosen, shard_indices(ck, chosen, shard)), s, devices,
                                          verify=verify, order=order)
    sources = open_sources(ck, policies)
    try:
        load = LoadInFlight(plan, sources, Destinations.allocate(fw, plan, devices), s, check=verifier,
                            progress=progress_bar(plan.nbytes, "load", progress), per_dest=background,
                            on_end=lambda: close_all(sources))
    except BaseException:
        close_all(sources)
        raise
    handle = LoadHandle(load, chosen)
    return handle if background else handle.result()


@reopen_if_replaced
@collector.paused()
def load_into(store: MutableMapping[str, Any], source, strict: bool = True, *, shard: TPSlice | None = None,
              verify: bool = False, names: Names = None, progress: bool | None = None,
              **options) -> dict[str, str]:
    """Fill the existing arrays of ``store`` in place from a checkpoint; returns its metadata
    (``{}`` for none). With ``shard=TPSlice(rank, world_size, dim)`` the store holds this rank's slices.

    Every name, shape and dtype is checked before any byte is written; a mismatch (and, with
    ``strict``, a missing or unexpected name) raises StoreMismatchError listing them all, with
    the store untouched. With ``strict=False`` missing/unexpected names are skipped and reported
    as a LoadIntoWarning. With ``verify=True`` each tensor is checked against its saved digest as
    it lands (ChecksumError on a mismatch, the store's contents then unspecified). ``names`` (as
    in load_file) limits which checkpoint tensors are considered at all.
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
    if shard is not None:
        from ..format.tp import shard_shape
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
    devices = [b.device for b in buffers]
    start_pinning(devices, s)
    settled = set()
    for n, b in zip(chosen, buffers):   # work queued on the store's arrays finishes before we overwrite them
        fw = framework_of(store[n])
        if b.device.is_cuda and (type(fw), b.device) not in settled:
            fw.settle(b.device)
            settled.add((type(fw), b.device))
    plan, s, policies, verifier = prepare(ck, selections(ck, chosen, shard_indices(ck, chosen, shard)), s, devices,
                                          verify=verify, order="whole")
    sources = open_sources(ck, policies)
    try:
        LoadInFlight(plan, sources, Destinations.fixed(buffers, [store[n] for n in chosen]), s, check=verifier,
                     progress=progress_bar(plan.nbytes, "load", progress)).finish()
    finally:
        close_all(sources)
    return metadata or {}
