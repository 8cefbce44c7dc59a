"""Planning: which bytes of which file land where. Pure functions, no I/O, no device.

A load is a list of ``Chunk`` s, each one 2-D copy (``Run``, from ``indexing``): a whole tensor,
``x[a:b]`` or a column slice ``x[:, a:b]`` is one run. ``plan_load`` cuts the selections' runs
into chunks by how each file is read and orders them for the workers, once per load; small whole
tensors back to back in a file share one chunk (a chunk costs a worker's dispatch, whatever its
size). ``plan_save`` cuts the tensors of a save the same way.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Any, Callable, Iterable, NamedTuple, Protocol, Sequence, TypeVar

from .dtypes import DType
from .header import TensorInfo
from .indexing import Run, slice_runs

__all__ = ["Run", "Chunk", "members", "Destination", "LoadPlan", "Selection", "FileRead", "split_run", "plan_load",
           "plan_save", "small_chunks_last", "is_small", "in_turn", "take_in_turn",
           "interleave_by_device", "span_bytes", "ORDERS"]

T = TypeVar("T")
# whole tensors under 1/PACK_FRACTION of the read piece share chunks (plan_load): above it, a
# shared chunk's copy out of the slot cost more than the chunks it saved
PACK_FRACTION = 64
_new = tuple.__new__   # Run(...), Chunk(...), Destination(...) without their Python-level __new__


class Chunk(NamedTuple):
    file: int    # index into the plan's files
    # index into the plan's destinations; a range: whole tensors lying back to back in ``run``
    dest: int | range
    run: Run


def members(dest: int | range) -> range | tuple[int]:
    """The destinations a chunk's ``dest`` fills."""
    return dest if type(dest) is range else (dest,)


class Destination(NamedTuple):
    """One array the load produces (a tensor or a slice of one). A tuple: a plan makes hundreds."""
    name: str
    dtype: DType
    shape: tuple[int, ...]     # logical shape of the result
    nbytes: int


_NBYTES = operator.itemgetter(3)   # Destination.nbytes


class LoadPlan(NamedTuple):
    destinations: tuple[Destination, ...]
    chunks: tuple[Chunk, ...]
    chunks_per_dest: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(map(_NBYTES, self.destinations))

    def dest_order(self) -> list[int]:
        """Destinations with chunks of their own (not shared), in the order of their first chunks."""
        return list(dict.fromkeys(c.dest for c in self.chunks if type(c.dest) is int))


def split_run(run: Run, max_bytes: int, granule: int = 1, packed: bool = False) -> list[Run]:
    """Cut a run into pieces of at most ``max_bytes`` of source span (``packed``, the rows
    gathered: of the bytes they land); whole rows stay together when a row fits, a wider row is
    cut into multiples of ``granule`` bytes (except the last)."""
    if max_bytes <= 0:
        raise ValueError("chunk size must be positive")
    if (run.nbytes if packed else run.span) <= max_bytes:
        return [run]
    src, pitch, width, height, dst = run
    if width <= max_bytes and height > 1:
        if packed:
            rows = max_bytes // width
        else:
            rows = max(1, (max_bytes - width) // pitch + 1) if pitch else height
        out = []
        for r in range(0, height, rows):
            h = min(rows, height - r)
            out.append(Run(src + r * pitch, pitch if h > 1 else width, width, h, dst + r * width))
        return out
    piece = max(granule, (max_bytes // granule) * granule)
    if height == 1:   # a whole tensor or a dim-0 slice, the common case: whole pieces, then the rest
        whole = width - width % piece
        out = [_new(Run, (src + off, piece, piece, 1, dst + off)) for off in range(0, whole, piece)]
        if whole < width:
            out.append(Run(src + whole, width - whole, width - whole, 1, dst + whole))
        return out
    out = []
    for r in range(height):
        for off in range(0, width, piece):
            w = min(piece, width - off)
            out.append(Run(src + r * pitch + off, w, w, 1, dst + r * width + off))
    return out


class Selection(NamedTuple):
    """One thing to load: a tensor of a file, optionally an index into it."""
    file: int
    data_start: int
    info: TensorInfo
    index: object = None
    name: str | None = None  # result name; defaults to the tensor's


class FileRead(Protocol):
    """What the planner needs to know of how a file is read (``io.read_policy.ReadPolicy``)."""
    gather: bool      # its strided runs are gathered row by row (cut by the bytes they land)
    from_disk: bool   # read from the disk: whole slots
    streams: int      # read as this many sequential streams

    def stream(self, offset: int) -> int: ...   # the stream that reads ``offset``


# how a plan orders its chunks (plan_load's ``order``)
ORDERS = ("selection", "whole", "by_device")


def plan_load(selections: Sequence[Selection], chunk_bytes: int, granule: int = 1, *,
              files: Sequence[FileRead] = (), read_bytes: int | None = None, order: str = "selection",
              devices: Sequence[Any] = ()) -> LoadPlan:
    """Destinations and chunks for the selections, in the order the workers take them.

    A tensor cut into pieces is cut at multiples of ``granule`` (and of its itemsize) from its
    start: with checksum blocks as the granule, every chunk holds whole blocks (see integrity).
    ``files[f]`` says how file ``f`` is read (none given: positional reads of a cached file). The
    strided runs of a file that gathers are cut by the bytes that land (``chunk_bytes`` of them);
    every other run by the span it reads, into pieces of ``read_bytes`` (default and at most
    ``chunk_bytes``; never below the granule), or of a whole slot for a file read from the disk.
    Whole tensors (no index) under 1/PACK_FRACTION of that piece, back to back in a file and for
    one device (``devices[d]``), share chunks of at most a piece, whose ``dest`` is then their
    range (not with a ``granule`` above 1: checksummed tensors keep chunks of their own).

    ``order``: "selection" keeps selection order; "whole" (a load awaited whole) takes a file's
    streams in turn (``take_in_turn``) and ends on the smallest chunks (``small_chunks_last``);
    "by_device" interleaves the devices ``devices[d]`` (``interleave_by_device``).
    """
    if granule > chunk_bytes:
        raise ValueError(f"granule ({granule}) larger than the chunk size ({chunk_bytes})")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    cut = chunk_bytes if read_bytes is None else max(granule, min(read_bytes, chunk_bytes))
    # whole tensors under this share chunks; not with checksum blocks (a hasher's unit is a chunk)
    small = cut // PACK_FRACTION if granule == 1 else 0
    dests, chunks, counts = [], [], []
    add = chunks.append
    granules: dict[int, int] = {}
    gathers = {f for f, r in enumerate(files) if r.gather}
    whole_slots = {f for f, r in enumerate(files) if r.from_disk}
    # the shared chunk being filled: its file (-1: none), first destination, span, limit
    pf, p_first, p_src, p_end, p_most = -1, 0, 0, 0, 0
    for i, (f, data_start, info, index, name) in enumerate(selections):
        if index is None and 0 < info[4] - info[3] < small:   # info[3:5]: its offsets
            tname, dtype, shape, start, end = info
            start += data_start
            end += data_start
            if f == pf and start == p_end and end - p_src <= p_most and (
                    not devices or devices[i] is devices[p_first] or devices[i] == devices[p_first]):
                p_end = end
            else:
                if pf >= 0:
                    add(_shared(pf, p_first, i, p_src, p_end))
                pf, p_first, p_src, p_end = f, i, start, end
                p_most = chunk_bytes if f in whole_slots else cut
            dests.append(_new(Destination, (name or tname, dtype, shape, end - start)))
            counts.append(1)
            continue
        if pf >= 0:
            add(_shared(pf, p_first, i, p_src, p_end))
            pf = -1
        shape, runs = slice_runs(info, data_start, index)
        n = len(chunks)
        packed = f in gathers
        nbytes = 0
        for r in runs:
            _, pitch, width, height, _ = r
            nbytes += width * height
            # a strided run of a gathering file is cut by the bytes it lands, any other by its span
            gather = packed and height > 1
            size = width if height == 1 else width * height if gather else (height - 1) * pitch + width
            most = chunk_bytes if gather or f in whole_slots else cut
            if size <= most:   # most runs: no cutting
                add(_new(Chunk, (f, i, r)))
                continue
            itemsize = info.dtype.itemsize
            g = granules.get(itemsize) or granules.setdefault(itemsize, math.lcm(granule, max(1, itemsize)))
            chunks.extend([_new(Chunk, (f, i, piece)) for piece in split_run(r, most, granule=g, packed=gather)])
        dests.append(_new(Destination, (name or info.name, info.dtype, shape, nbytes)))
        counts.append(len(chunks) - n)
    if pf >= 0:
        add(_shared(pf, p_first, len(dests), p_src, p_end))
    return _in_order(LoadPlan(tuple(dests), tuple(chunks), tuple(counts)), order, files, cut, devices)


def _in_order(plan: LoadPlan, order: str, files: Sequence[FileRead], cut: int, devices: Sequence[Any]) -> LoadPlan:
    """``plan_load``'s plan in its ``order``."""
    if order == "whole":
        streamed = {f: r for f, r in enumerate(files) if r.streams > 1}
        if streamed:
            plan = take_in_turn(plan, lambda c: streamed[c.file].stream(c.run.src)
                                if c.file in streamed and c.run.height == 1 else None)
        return small_chunks_last(plan, cut)
    return interleave_by_device(plan, devices) if order == "by_device" else plan


def _shared(f: int, first: int, stop: int, src: int, end: int) -> Chunk:
    """The chunk of destinations ``first`` to ``stop`` (whole tensors back to back at ``src``)."""
    run = _new(Run, (src, end - src, end - src, 1, 0))
    return _new(Chunk, (f, first if stop - first == 1 else range(first, stop), run))


def span_bytes(selections: Sequence[Selection], n_files: int) -> list[int]:
    """The bytes positional reads take from each of ``n_files`` files for ``selections`` (a strided
    run: its whole row span), before it is known how each file is read (``io.read_policy``)."""
    out = [0] * n_files
    for f, data_start, info, index, _ in selections:
        for _, pitch, width, height, _ in slice_runs(info, data_start, index)[1]:
            out[f] += width if height == 1 else (height - 1) * pitch + width if height else 0
    return out


def interleave_by_device(plan: LoadPlan, dest_devices: Sequence[Any]) -> LoadPlan:
    """The plan with its chunks ordered so every device's share advances at the same pace (each
    device's chunks kept in order): with a checkpoint split over GPUs, every copy link runs throughout."""
    if len(set(dest_devices)) < 2:
        return plan
    total: dict[Any, int] = {}
    for c in plan.chunks:
        dev = dest_devices[members(c.dest)[0]]
        total[dev] = total.get(dev, 0) + c.run.nbytes
    done: dict[Any, int] = dict.fromkeys(total, 0)
    keyed = []
    for i, c in enumerate(plan.chunks):
        dev = dest_devices[members(c.dest)[0]]
        keyed.append((done[dev] / total[dev] if total[dev] else 0.0, i, c))
        done[dev] += c.run.nbytes
    keyed.sort(key=lambda k: (k[0], k[1]))
    return LoadPlan(plan.destinations, tuple(c for _, _, c in keyed), plan.chunks_per_dest)


def is_small(run: Run, under: int) -> bool:
    """Whether ``run`` spans fewer than ``under`` bytes (``small_chunks_last``'s test)."""
    _, pitch, width, height, _ = run   # Run.span, written out: once per chunk of a load
    return (width if height == 1 else (height - 1) * pitch + width if height else 0) < under


def small_chunks_last(plan: LoadPlan, chunk_bytes: int) -> LoadPlan:
    """The plan with its chunks of less than a quarter of ``chunk_bytes`` (of span) moved to the
    end, both groups kept in their order, for loads awaited whole: ending on the smallest (norms,
    biases) lets the workers finish together; mid-sized slices keep their places."""
    quarter = chunk_bytes // 4
    big, small = [], []
    for c in plan.chunks:
        (small if is_small(c.run, quarter) else big).append(c)
    if not small or not big:
        return plan
    return LoadPlan(plan.destinations, tuple(big + small), plan.chunks_per_dest)


_NONE = object()   # in_turn's filler: no item of a group is ever it


def in_turn(groups: Iterable[Sequence[T]]) -> list[T]:
    """Every group's first item, then every group's second, and so on."""
    return [x for turn in itertools.zip_longest(*groups, fillvalue=_NONE) for x in turn if x is not _NONE]


def take_in_turn(plan: LoadPlan, group_of: Callable[[Chunk], object]) -> LoadPlan:
    """The plan with, in each file, the chunks that ``group_of`` puts in a group (not None) taken
    from the groups in turn (``in_turn``), in the places those chunks held; the others stay put.
    For a cold file read as sequential streams (a group each): every stream then moves forward."""
    places: dict[int, list[int]] = {}
    groups: dict[int, dict[object, list[Chunk]]] = {}
    for i, c in enumerate(plan.chunks):
        g = group_of(c)
        if g is not None:
            places.setdefault(c.file, []).append(i)
            groups.setdefault(c.file, {}).setdefault(g, []).append(c)
    if all(len(g) < 2 for g in groups.values()):
        return plan
    chunks = list(plan.chunks)
    for f, where in places.items():
        for i, c in zip(where, in_turn(groups[f].values())):
            chunks[i] = c
    return LoadPlan(plan.destinations, tuple(chunks), plan.chunks_per_dest)


def plan_save(sizes: Sequence[int], offsets: Sequence[int], chunk_bytes: int,
              granules: Sequence[int]) -> list[tuple[int, Run]]:
    """Chunks of a save: (tensor index, Run with src = offset in the tensor, dst = file offset);
    tensor i is cut at multiples of ``granules[i]`` bytes (a row, for arrays made contiguous piecewise)."""
    out = []
    for i, (size, off, g) in enumerate(zip(sizes, offsets, granules)):
        if size == 0:
            continue
        step = max(g, (chunk_bytes // g) * g)
        for pos in range(0, size, step):
            w = min(step, size - pos)
            out.append((i, Run(pos, w, w, 1, off + pos)))
    return out
