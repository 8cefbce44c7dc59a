"""Load once, share over torch.distributed: each rank reads only its part of a checkpoint.

``load_file(..., framework="pt", process_group=pg)`` on every rank of ``pg``:

1. every rank opens the checkpoint and selects its names; the selections (and any error) are
   all-gathered, so ranks asking for different subsets agree on one plan and cannot deadlock;
2. ``assign_owners`` splits the union of the wanted tensors across the ranks by size
   (deterministic: the same answer whatever order the files were listed in);
3. each rank loads the tensors it owns through the ordinary pipeline (``loader.load_file``)
   onto its own device; success or failure is all-gathered again, so an error on one rank
   raises ``DistributedLoadError`` on every rank instead of leaving the others waiting;
4. the owners broadcast their tensors in a globally agreed order (``exchange_windows``), in
   windows of at most ``exchange_bytes``: small tensors of one owner are packed into one
   window, big ones go in pieces straight into the receivers' tensors. A rank that does not
   want a tensor still takes part in its broadcast and drops the bytes.

Memory: an owner holds the whole tensors it owns (about 1/world_size of the selection) plus one
exchange window; a receiver's wanted tensors land in place. With ``shard=`` the owner broadcasts
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
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from .checkpoint import Checkpoint, Names, open_checkpoint, select
from .device import check_device, parse_device
from .dtypes import DTYPES, host_shape
from .frameworks import get_framework
from .shard import Shard, shard_index

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

    Grouped by owner (rank order, the given order within a rank); consecutive tensors of one owner
    are packed into windows of at most ``window_bytes``; a tensor larger than that is cut into
    pieces. Every byte of every tensor is in exactly one window; zero-byte tensors in none.
    """
    if window_bytes < 1:
        raise ValueError(f"exchange window must be at least 1 byte, got {window_bytes}")
    out: list[Window] = []
    by_owner: dict[int, list[tuple[str, int]]] = {}
    for name, nbytes, owner in tensors:
        by_owner.setdefault(owner, []).append((name, nbytes))
    for owner in sorted(by_owner):
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
    return out


# -- the collective part -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Desc:
    nbytes: int
    file: str      # basename of the file holding it
    dtype: str
    shape: tuple[int, ...]


def _describe(ck: Checkpoint, name: str) -> _Desc:
    f, info = ck.names[name]
    return _Desc(info.nbytes, os.path.basename(ck.paths[f]), info.dtype.name, tuple(info.shape))


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
    from . import loader
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
    gathered = group.gather(_failure(error) if error is not None else descs)
    failures = {r: g for r, g in enumerate(gathered) if isinstance(g, str)}
    if failures:
        raise DistributedLoadError(failures, group.rank) from error
    union: dict[str, _Desc] = {}
    wanted_by: dict[str, set[int]] = {}
    conflicts = {}
    for r, d in enumerate(gathered):
        for n, desc in d.items():
            if union.setdefault(n, desc) != desc:
                conflicts[r] = f"tensor {n!r} is {desc} here but {union[n]} on another rank: not the same checkpoint"
            wanted_by.setdefault(n, set()).add(r)
    if conflicts:
        raise DistributedLoadError(conflicts, group.rank)
    owners = assign_owners([(n, d.nbytes, d.file) for n, d in union.items()], group.world)
    order = sorted(union, key=lambda n: _order_key(n, union[n].file))
    owned = [n for n in order if owners[n] == group.rank]

    # 2. each rank loads what it owns; receivers allocate what they want whole
    full: dict[str, Any] = {}    # name -> whole tensor on this rank (owned, or received in place)
    mine = set(chosen)
    try:
        if owned:
            full = loader.load_file(source, device=dev, framework="pt", names=owned, verify=verify,
                                    progress=progress, **options)
            for n in owned:
                dt = DTYPES[union[n].dtype]
                if full[n].dtype != fw.torch_dtype(dt) or tuple(full[n].shape) != host_shape(dt, union[n].shape):
                    raise ValueError(f"tensor {n!r}: this rank read {full[n].dtype} {list(full[n].shape)}, "
                                     f"the group agreed on {union[n].dtype} {list(union[n].shape)}")
        for n in chosen:
            if n not in full and (shard is None or indices[n] is None):
                full[n] = fw.empty(DTYPES[union[n].dtype], union[n].shape, dev, n)
    except Exception as e:
        error = e
    try:
        group.agree(error)
    except BaseException:
        full.clear()
        raise

    t_load = time.perf_counter()

    # 3. the exchange, window by window
    result: dict[str, Any] = {}
    remaining = {n: union[n].nbytes for n in order}
    scratch = None

    def finish(n: str) -> None:
        if n in mine:
            t = full[n]
            idx = indices.get(n)
            result[n] = t if idx is None else t[idx].clone(memory_format=torch.contiguous_format)
        full.pop(n, None)   # sliced, or not wanted here: the whole one goes as soon as it is sent

    shared = [(n, union[n].nbytes, owners[n]) for n in order if wanted_by[n] - {owners[n]}]
    windows = exchange_windows(shared, window)
    for w in windows:
        sender = w.owner == group.rank
        for n, _, _ in w.segments:   # a sharded tensor this rank wants lands whole first
            if not sender and n in mine and n not in full:
                full[n] = fw.empty(DTYPES[union[n].dtype], union[n].shape, dev, n)
        if len(w.segments) == 1 and w.segments[0][0] in full:
            n, start, length = w.segments[0]
            group.broadcast(_bytes(full[n])[start:start + length], w.owner)
        else:
            if scratch is None:
                scratch = torch.empty(max(x.nbytes for x in windows),
                                      dtype=torch.uint8, device=str(dev))
            buf = scratch[:w.nbytes]
            pos = 0
            if sender:
                for n, start, length in w.segments:
                    buf[pos:pos + length].copy_(_bytes(full[n])[start:start + length])
                    pos += length
            group.broadcast(buf, w.owner)
            pos = 0
            if not sender:
                for n, start, length in w.segments:
                    if n in full:
                        _bytes(full[n])[start:start + length].copy_(buf[pos:pos + length])
                    pos += length
        for n, _, length in w.segments:
            remaining[n] -= length
            if remaining[n] == 0:
                finish(n)
    for n in order:   # the ones nobody else wanted, and zero-byte ones
        if n in mine and n not in result:
            if n not in full:   # a zero-byte tensor this rank wants sharded
                full[n] = fw.empty(DTYPES[union[n].dtype], union[n].shape, dev, n)
            finish(n)
    full.clear()
    if dev.is_cuda:
        torch.cuda.current_stream(dev.index).synchronize()
    t_end = time.perf_counter()
    log.debug("distributed load, rank %d of %d: owns %d of %d tensors (%d bytes); plan+load %.3f s, "
              "exchange %.3f s in %d broadcasts (window %d)", group.rank, group.world, len(owned), len(order),
              sum(union[n].nbytes for n in owned), t_load - t0, t_end - t_load, len(windows), window)
    return {n: result[n] for n in chosen}
