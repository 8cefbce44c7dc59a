"""Who reads what in a distributed load, and which broadcasts share it. Pure functions, no I/O:
every rank gets the same answer from the same gathered inputs, with no further messages.
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Collection, Iterable, Mapping, Sequence

if TYPE_CHECKING:
    from ..io.checkpoint import Checkpoint


@dataclass(frozen=True, slots=True)
class TensorDesc:
    """What a rank knows of one tensor it wants; ranks compare these to agree on the checkpoint."""
    nbytes: int
    file: str      # basename of the file holding it
    dtype: str
    shape: tuple[int, ...]
    offset: int = field(default=0, compare=False)   # in its file: orders the exchange, need not agree


def describe(ck: "Checkpoint", name: str) -> TensorDesc:
    """The description of tensor ``name`` of an opened checkpoint."""
    f, info = ck.names[name]
    return TensorDesc(info.nbytes, os.path.basename(ck.paths[f]), info.dtype.name, tuple(info.shape),
                      ck.headers[f].data_start + info.start)


class CheckpointMismatch(ValueError):
    """The ranks described one tensor differently (not the same checkpoint); ``failures``: rank -> message."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        super().__init__("; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items())))


def assign_owners(tensors: Iterable[tuple[str, int, str]], world_size: int) -> dict[str, int]:
    """``{name: rank}`` for ``(name, nbytes, file_key)`` triples, balanced by bytes: largest first onto
    the least-loaded rank (lowest on a tie), equal sizes in (file basename, name) order so every rank
    computes the same map."""
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
    """One broadcast: ``owner`` sends ``segments`` = [(name, byte start, byte length)], back to back."""
    owner: int
    segments: tuple[tuple[str, int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(s[2] for s in self.segments)


def _owner_windows(owner: int, tensors: Sequence[tuple[str, int]], window_bytes: int) -> list[Window]:
    """One owner's tensors packed into windows of at most ``window_bytes``, big ones in pieces."""
    out: list[Window] = []
    segs: list[tuple[str, int, int]] = []
    room = window_bytes
    for name, nbytes in tensors:
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


def exchange_windows(tensors: Sequence[tuple[str, int, int]], window_bytes: int) -> list[Window]:
    """The broadcasts that share ``(name, nbytes, owner)`` tensors (in the agreed order): an owner's
    consecutive tensors packed into windows of at most ``window_bytes`` (a larger one cut), owners
    taking turns in rank order. Every byte is in exactly one window (zero-byte tensors in none)."""
    if window_bytes < 1:
        raise ValueError(f"exchange window must be at least 1 byte, got {window_bytes}")
    by_owner: dict[int, list[tuple[str, int]]] = {}
    for name, nbytes, owner in tensors:
        by_owner.setdefault(owner, []).append((name, nbytes))
    per_owner = [_owner_windows(owner, by_owner[owner], window_bytes) for owner in sorted(by_owner)]
    turns = max((len(ws) for ws in per_owner), default=0)
    return [ws[i] for i in range(turns) for ws in per_owner if i < len(ws)]


def merge_selections(selections: Sequence[Mapping[str, TensorDesc]]
                     ) -> tuple[dict[str, TensorDesc], dict[str, set[int]]]:
    """The union of the ranks' selections and which ranks want each tensor (or CheckpointMismatch)."""
    union: dict[str, TensorDesc] = {}
    wanted_by: dict[str, set[int]] = {}
    conflicts = {}
    for r, descs in enumerate(selections):
        for n, desc in descs.items():
            if union.setdefault(n, desc) != desc:
                conflicts[r] = f"tensor {n!r} is {desc} here but {union[n]} on another rank: not the same checkpoint"
            wanted_by.setdefault(n, set()).add(r)
    if conflicts:
        raise CheckpointMismatch(conflicts)
    return union, wanted_by


@dataclass(frozen=True)
class ExchangePlan:
    """The agreed plan, seen from one rank."""
    union: dict[str, TensorDesc]      # every tensor some rank wants (whole, or as its slice)
    owners: dict[str, int]            # name -> the rank that reads it whole, for each tensor some rank wants whole
    order: list[str]                  # the union in file order (sequential reads)
    owned: list[str]                  # what this rank reads whole, in file order
    local: list[str]                  # the slices this rank reads for itself alone, in file order
    windows: list[Window]             # the broadcasts, in the order every rank runs them
    window_bytes: int

    def nbytes(self, names: Iterable[str]) -> int:
        return sum(self.union[n].nbytes for n in names)


def plan_exchange(selections: Sequence[Mapping[str, TensorDesc]], window_bytes: int, rank: int,
                  sliced: Sequence[Collection[str]] | None = None) -> ExchangePlan:
    """Rank ``rank``'s view of the plan for the gathered selections (one per rank). ``sliced[r]``: the
    tensors rank r wants only its TP slice of (it reads them itself unless it owns them). A tensor some
    rank wants whole gets one owner, which reads it whole and broadcasts it if another rank wants it
    whole. ``window_bytes`` must be the same on every rank."""
    union, _ = merge_selections(selections)
    sliced = [frozenset(s) for s in sliced] if sliced is not None else [frozenset()] * len(selections)
    wanted_whole: dict[str, set[int]] = {}
    for r, descs in enumerate(selections):
        for n in descs:
            if n not in sliced[r]:
                wanted_whole.setdefault(n, set()).add(r)
    owners = assign_owners([(n, union[n].nbytes, union[n].file) for n in wanted_whole], len(selections))
    order = sorted(union, key=lambda n: (union[n].file, union[n].offset, n))
    shared = [(n, union[n].nbytes, owners[n]) for n in order if n in owners and wanted_whole[n] - {owners[n]}]
    local = [n for n in order if n in sliced[rank] and n in selections[rank] and owners.get(n) != rank]
    return ExchangePlan(union, owners, order, [n for n in order if owners.get(n) == rank], local,
                        exchange_windows(shared, window_bytes), window_bytes)
