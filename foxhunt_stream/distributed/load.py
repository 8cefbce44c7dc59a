"""Load once, share over torch.distributed: each rank reads only its part of a checkpoint.

``load_file(..., framework="pt", process_group=pg)`` on every rank of ``pg``:

1. every rank opens the checkpoint and selects its names; the selections (and any error) are
   all-gathered, so ranks asking for different subsets agree on one plan and cannot deadlock;
2. ``assign_owners`` splits the union of the wanted tensors across the ranks by size
   (deterministic: the same answer whatever order the files were listed in);
3. each rank starts reading the tensors it owns through the ordinary pipeline
   (``loader.load_file(background=True)``) onto its own device and allocates the ones it will
   receive; allocation errors are all-gathered before any broadcast;
4. the owners broadcast their tensors as they land, taking turns (``exchange_windows``), in
   windows of at most ``exchange_bytes`` (the smallest any rank asked for): small tensors of one
   owner are packed into one window, big ones go in pieces straight into the receivers'
   tensors. A rank that does not want a tensor still takes part in its broadcast and drops the
   bytes. From the first broadcast on, a rank that fails (a read error, a checksum) keeps taking
   part, sending or dropping junk, and the outcome is all-gathered at the end: an error on one
   rank raises ``DistributedLoadError`` on every rank instead of leaving the others waiting.

Memory: an owner holds each tensor it owns from its landing until it is sent (at most about
1/world_size of the selection) plus one exchange window; a receiver's wanted tensors land in place. With ``shard=`` the owner broadcasts
the *whole* tensor and each rank slices its part out (one whole tensor at a time held as a
temporary): correct and simple, not bytes-optimal (every rank receives every byte of a sharded
tensor it wants). Ownership is per tensor, so one tensor larger than total/world_size leaves
the split uneven.

Time limits: a rank that hangs or dies (rather than raising) is bounded by the process group's
own timeout (``init_process_group(timeout=...)``), the only clock the collectives honour.
"""

from __future__ import annotations

import heapq
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ..io.checkpoint import Checkpoint, Names, open_checkpoint, select
from ..cuda.devices import check_device, parse_device
from ..format.dtypes import DTYPES, host_shape
from ..engine.frameworks import get_framework
from ..format.tp import Shard, shard_index

DEFAULT_EXCHANGE_BYTES = 64 << 20

log = logging.getLogger("foxhunt_stream")


class DistributedLoadError(RuntimeError):
    """A distributed load failed on one or more ranks; raised on every rank of the group.

    ``failures`` maps rank -> "ExceptionType: message". On a rank that failed itself the
    original exception is chained as ``__cause__``."""

    def __init__(self, failures: dict[int, str], rank: int) -> None:
        self.failures, self.rank = failures, rank
        lines = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
        super().__init__(f"distributed load failed on {len(failures)} rank(s) (this is rank {rank}): {lines}")


# -- pure planning -------------------------------------------------------------------------------

def _order_key(name: str, file_key: str) -> tuple[str, str]:
    return os.path.basename(str(file_key)), name


def assign_owners(tensors: Iterable[tuple[str, int, str]], world_size: int) -> dict[str, int]:
    """``{name: rank}`` for ``(name, nbytes, file_key)`` triples, balanced by bytes.

    Largest first onto the least-loaded rank (lowest rank on a tie); equal sizes are taken in
    (file basename, name) order, so the answer depends neither on the order the tensors (or the
    files) were listed in nor on the directory a file sits in. Deterministic: every rank computes
    the same map from the same set.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    unique: dict[str, tuple[int, str]] = {}
    for name, nbytes, file_key in tensors:
        key = (int(nbytes), os.path.basename(str(file_key)))
        if nbytes < 0:
            raise ValueError(f"tensor {name!r}: negative size {nbytes}")
        if unique.setdefault(name, key) != key:
            raise ValueError(f"tensor {name!r} listed twice with different sizes/files: {unique[name]} and {key}")
    order = sorted(unique, key=lambda n: (-unique[n][0], unique[n][1], n))
    heap = [(0, r) for r in range(world_size)]
    owners = {}
    for n in order:
        load, r = heapq.heappop(heap)
        owners[n] = r
        heapq.heappush(heap, (load + unique[n][0], r))
    return owners


@dataclass(frozen=True, slots=True)
class Window:
    """One broadcast: ``owner`` sends ``segments`` = [(name, byte start, byte length)], packed
    back to back (``nbytes`` in all)."""
    owner: int
    segments: tuple[tuple[str, int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(s[2] for s in self.segments)


def exchange_windows(tensors: Sequence[tuple[str, int, int]], window_bytes: int) -> list[Window]:
    """The broadcasts that share ``(name, nbytes, owner)`` tensors (in the agreed order given).

    Consecutive tensors of one owner (in the given order) are packed into windows of at most
    ``window_bytes``; a tensor larger than that is cut into pieces. The owners take turns, one
    window each in rank order, so every owner's reads are consumed while they go on rather than
    rank 0's first and the last rank's when it has long finished. Every byte of every tensor is
    in exactly one window; zero-byte tensors in none.
    """
    if window_bytes < 1:
        raise ValueError(f"exchange window must be at least 1 byte, got {window_bytes}")
    per_owner: dict[int, list[Window]] = {}
    by_owner: dict[int, list[tuple[str, int]]] = {}
    for name, nbytes, owner in tensors:
        by_owner.setdefault(owner, []).append((name, nbytes))
    for owner in sorted(by_owner):
        out = per_owner.setdefault(owner, [])
        segs: list[tuple[str, int, int]] = []
        room = window_bytes
        for name, nbytes in by_owner[owner]:
            start = 0
            while start < nbytes:
                take = min(room, nbytes - start)
                segs.append((name, start, take))
                start += take
                room -= take
                if room == 0:
                    out.append(Window(owner, tuple(segs)))
                    segs, room = [], window_bytes
        if segs:
            out.append(Window(owner, tuple(segs)))
    turns = max((len(ws) for ws in per_owner.values()), default=0)
    return [ws[i] for i in range(turns) for _, ws in sorted(per_owner.items()) if i < len(ws)]


# -- the collective part -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Desc:
    nbytes: int
    file: str      # basename of the file holding it
    dtype: str
    shape: tuple[int, ...]
    offset: int = field(default=0, compare=False)   # in its file: orders the exchange, need not agree


def _describe(ck: Checkpoint, name: str) -> _Desc:
    f, info = ck.names[name]
    return _Desc(info.nbytes, os.path.basename(ck.paths[f]), info.dtype.name, tuple(info.shape),
                 ck.headers[f].data_start + info.start)


def _failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class _Group:
    """The few collectives we need, on one process group."""

    def __init__(self, pg) -> None:
        import torch.distributed as dist
        self.dist, self.pg = dist, pg
        self.rank = dist.get_rank(pg)
        self.world = dist.get_world_size(pg)

    def gather(self, obj) -> list:
        out = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.pg)
        return out

    def agree(self, error: BaseException | None) -> None:
        """All ranks learn whether any failed; every rank raises if one did."""
        statuses = self.gather(None if error is None else _failure(error))
        failures = {r: m for r, m in enumerate(statuses) if m is not None}
        if failures:
            raise DistributedLoadError(failures, self.rank) from error

    def broadcast(self, buf, owner: int) -> None:
        src = self.dist.get_global_rank(self.pg, owner) if self.pg is not None else owner
        self.dist.broadcast(buf, src=src, group=self.pg)


def _bytes(t):
    """A flat uint8 view of a contiguous tensor (any dtype, any number of dims)."""
    import torch
    return t.reshape(-1).view(torch.uint8)


def load_file_distributed(source, device="cpu", framework: str | None = None, names: Names = None, *,
                          process_group, shard: Shard | None = None, exchange_bytes: int | None = None,
                          verify: bool = False, progress: bool | None = None, background: bool = False,
                          **options) -> dict[str, Any]:
    """``load_file`` over a torch.distributed group: every rank of ``process_group`` calls it
    (with its own ``device``, ``names`` and ``shard``); the checkpoint is read from disk once
    across the group and shared with broadcasts. Returns this rank's ``{name: torch.Tensor}``.

    ``framework`` must be ``"pt"``/``"torch"`` (None means "pt"): only torch tensors go through
    torch.distributed. ``exchange_bytes`` bounds the extra device memory of the exchange
    (default 64 MiB). Any error on any rank raises ``DistributedLoadError`` on all of them.
    """
    if framework not in (None, "pt", "torch"):
        raise ValueError(f"load_file(process_group=...) shares torch tensors: framework must be 'pt', "
                         f"got {framework!r}")
    if background:
        raise ValueError("load_file(process_group=...) cannot run in the background")
    window = DEFAULT_EXCHANGE_BYTES if exchange_bytes is None else int(exchange_bytes)
    if window < 1:
        raise ValueError(f"exchange_bytes must be positive, got {exchange_bytes}")
    import torch
    from ..engine import loader
    group = _Group(process_group)
    t0 = time.perf_counter()

    # 1. what each rank wants, agreed by all
    chosen: list[str] = []
    descs: dict[str, _Desc] = {}
    indices: dict[str, Any] = {}
    error: BaseException | None = None
    try:
        dev = parse_device(device)
        check_device(dev)
        fw = get_framework("pt", dev)
        if dev.is_cuda:
            torch.cuda.set_device(dev.index)   # NCCL's object collectives use the current device
        ck = open_checkpoint(source)
        chosen = select(ck, names)
        descs = {n: _describe(ck, n) for n in chosen}
        indices = {n: shard_index(descs[n].shape, shard, n) for n in chosen} if shard is not None else {}
        for n, idx in indices.items():
            if idx is not None and DTYPES[descs[n].dtype].sub_byte:
                raise NotImplementedError(f"tensor {n!r}: sharding a sub-byte dtype ({descs[n].dtype}) "
                                          "over process_group is not supported")
    except Exception as e:
        error = e
    gathered = group.gather(_failure(error) if error is not None else (descs, window))
    failures = {r: g for r, g in enumerate(gathered) if isinstance(g, str)}
    if failures:
        raise DistributedLoadError(failures, group.rank) from error
    window = min(g[1] for g in gathered)   # every rank must cut the same windows: the smallest bound
    union: dict[str, _Desc] = {}
    wanted_by: dict[str, set[int]] = {}
    conflicts = {}
    for r, (d, _) in enumerate(gathered):
        for n, desc in d.items():
            if union.setdefault(n, desc) != desc:
                conflicts[r] = f"tensor {n!r} is {desc} here but {union[n]} on another rank: not the same checkpoint"
            wanted_by.setdefault(n, set()).add(r)
    if conflicts:
        raise DistributedLoadError(conflicts, group.rank)
    owners = assign_owners([(n, d.nbytes, d.file) for n, d in union.items()], group.world)
    order = sorted(union, key=lambda n: (union[n].file, union[n].offset, n))   # file order: sequential reads
    owned = [n for n in order if owners[n] == group.rank]
    shared = [(n, union[n].nbytes, owners[n]) for n in order if wanted_by[n] - {owners[n]}]
    windows = exchange_windows(shared, window)

    # 2. start reading what this rank owns (in the background); allocate what it receives
    full: dict[str, Any] = {}    # name -> whole tensor on this rank (owned and landed, or being received)
    result: dict[str, Any] = {}
    mine = set(chosen)
    handle = None
    scratch = None
    try:
        if owned:
            handle = loader.load_file(source, device=dev, framework="pt", names=owned, verify=verify,
                                      progress=progress, background=True, **options)
        for n in chosen:
            if owners[n] != group.rank and (shard is None or indices[n] is None):
                full[n] = fw.empty(DTYPES[union[n].dtype], union[n].shape, dev, n)
        if windows:
            scratch = torch.empty(max(w.nbytes for w in windows), dtype=torch.uint8, device=str(dev))
    except Exception as e:
        error = e
    try:
        group.agree(error)   # allocation failures (the likely ones) before any broadcast
    except BaseException:
        if handle is not None:
            handle.cancel()
        full.clear()
        raise
    t_load = time.perf_counter()

    # 3. the exchange, window by window, while the owners' reads go on. From here on every rank
    # takes part in every broadcast whatever happens: a rank that failed sends or drops junk and
    # says so at the end, so no rank is left waiting in a collective.
    failed: BaseException | None = None

    def fail(e: BaseException) -> None:
        nonlocal failed
        if failed is None:
            failed = e
            if handle is not None:
                handle.cancel()
        full.clear()
        result.clear()

    def source_of(n: str):
        """Owner side: the landed tensor (waiting for its reads), or None after a failure."""
        if failed is None and n not in full:
            try:
                t = handle.wait(n)
                dt = DTYPES[union[n].dtype]
                if t.dtype != fw.torch_dtype(dt) or tuple(t.shape) != host_shape(dt, union[n].shape):
                    raise ValueError(f"tensor {n!r}: this rank read {t.dtype} {list(t.shape)}, "
                                     f"the group agreed on {union[n].dtype} {list(union[n].shape)}")
                full[n] = t
            except Exception as e:
                fail(e)
        return full.get(n)

    def dest_of(n: str):
        """Receiver side: where a wanted tensor lands whole (a sharded one: a temporary), or None."""
        if failed is None and n in mine and n not in full:
            try:
                full[n] = fw.empty(DTYPES[union[n].dtype], union[n].shape, dev, n)
            except Exception as e:
                fail(e)
        return full.get(n)

    def finish(n: str) -> None:
        if failed is None and n in mine:
            t = full[n]
            idx = indices.get(n)
            result[n] = t if idx is None else t[idx].clone(memory_format=torch.contiguous_format)
        full.pop(n, None)   # sliced, or not wanted here: the whole one goes as soon as it is sent

    remaining = {n: union[n].nbytes for n in order}
    for w in windows:
        sender = w.owner == group.rank
        if len(w.segments) == 1:
            n, start, length = w.segments[0]
            t = source_of(n) if sender else dest_of(n)
            group.broadcast(scratch[:length] if t is None else _bytes(t)[start:start + length], w.owner)
        else:
            buf = scratch[:w.nbytes]
            pos = 0
            for n, start, length in w.segments:
                t = source_of(n) if sender else None
                if t is not None:
                    buf[pos:pos + length].copy_(_bytes(t)[start:start + length])
                pos += length
            group.broadcast(buf, w.owner)
            pos = 0
            for n, start, length in w.segments:
                t = None if sender else dest_of(n)
                if t is not None:
                    _bytes(t)[start:start + length].copy_(buf[pos:pos + length])
                pos += length
        for n, _, length in w.segments:
            remaining[n] -= length
            if remaining[n] == 0:
                finish(n)
    for n in order:   # what only this rank wanted, and zero-byte tensors
        if n in mine and n not in result and failed is None:
            if owners[n] == group.rank:
                source_of(n)
            else:
                dest_of(n)
            finish(n)
    try:
        if handle is not None and failed is None:
            handle.result()   # closes the files; a file changed under the reads raises here
        if dev.is_cuda:
            torch.cuda.current_stream(dev.index).synchronize()
    except Exception as e:
        fail(e)
    try:
        group.agree(failed)
    except BaseException:
        fail(RuntimeError("failed elsewhere"))
        raise
    t_end = time.perf_counter()
    log.debug("distributed load, rank %d of %d: owns %d of %d tensors (%d bytes); plan+load %.3f s, "
              "exchange %.3f s in %d broadcasts (window %d)", group.rank, group.world, len(owned), len(order),
              sum(union[n].nbytes for n in owned), t_load - t0, t_end - t_load, len(windows), window)
    return {n: result[n] for n in chosen}
