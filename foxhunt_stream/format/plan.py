"""Planning: which bytes of which file land where. Pure functions, no I/O, no device.

A load is a list of ``Chunk`` s. Each chunk is one 2-D copy (``Run``): ``height`` rows of
``width`` bytes, the rows ``pitch`` bytes apart in the file and packed in the destination.
A whole tensor is one run of height 1; ``x[a:b]`` is one run; a column slice ``x[:, a:b]`` is a
run whose rows are the tensor's rows, so only the covered row span is read and only the
selected bytes land (``cudaMemcpy2DAsync`` on the GPU, a strided copy on the host).
The saver uses the same runs with height 1 to cut tensors into chunks.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from .dtypes import DType
from .header import TensorInfo


class Run(NamedTuple):   # a tuple, not a frozen dataclass: a plan makes hundreds, and a
    # frozen dataclass's __init__ costs ~5x a tuple's (a TP shard's plan: 3 ms -> 1 ms on the H200)
    src: int     # absolute offset of the first byte in the file (load) or in the tensor (save)
    pitch: int   # distance between row starts at the source
    width: int   # bytes per row
    height: int  # rows
    dst: int     # byte offset of the first row in the destination (rows packed)

    @property
    def span(self) -> int:
        """Source bytes covered, first row start to last row end."""
        return (self.height - 1) * self.pitch + self.width if self.height else 0

    @property
    def nbytes(self) -> int:
        return self.width * self.height


class Chunk(NamedTuple):
    file: int    # index into the plan's files
    dest: int    # index into the plan's destinations
    run: Run


@dataclass(frozen=True, slots=True)
class Destination:
    """One array the load produces (a tensor or a slice of one)."""
    name: str
    dtype: DType
    shape: tuple[int, ...]     # logical shape of the result
    nbytes: int


@dataclass(frozen=True, slots=True)
class LoadPlan:
    destinations: tuple[Destination, ...]
    chunks: tuple[Chunk, ...]
    chunks_per_dest: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.destinations)

    @property
    def max_span(self) -> int:
        return max((c.run.span for c in self.chunks), default=0)

    def dest_order(self) -> list[int]:
        """Destinations in the order the pipeline first reaches them (their first chunk's place)."""
        return list(dict.fromkeys(c.dest for c in self.chunks))


# ---------------------------------------------------------------- basic indexing

def normalize_index(index, shape: Sequence[int]) -> list[int | tuple[int, int, int]]:
    """numpy basic indexing, reduced to one item per dimension.

    An int (negative allowed) selects one element and drops the dimension; a slice with a
    positive step becomes ``(start, count, step)``; ``...`` expands; missing trailing dims are
    full. Anything else (arrays, None, negative steps, bools) is refused.
    """
    if not isinstance(index, tuple):
        index = (index,)
    elif len(index) <= len(shape):
        # the common case, fast (a tensor-parallel shard plans hundreds of these): unit-step slices
        out_fast: list[int | tuple[int, int, int]] = []
        for i, n in zip(index, shape):
            if type(i) is not slice or i.step not in (None, 1):
                break
            start, stop, _ = i.indices(n)
            out_fast.append((start, stop - start, 1) if stop > start else (0, 0, 1))
        else:
            out_fast.extend((0, n, 1) for n in shape[len(index):])
            return out_fast
    n_ell = sum(1 for i in index if i is Ellipsis)
    if n_ell > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    explicit = len(index) - n_ell
    if explicit > len(shape):
        raise IndexError(f"too many indices: tensor is {len(shape)}-dimensional, but {explicit} were indexed")
    items = []
    for i in index:
        if i is Ellipsis:
            items.extend([slice(None)] * (len(shape) - explicit))
        else:
            items.append(i)
    items.extend([slice(None)] * (len(shape) - len(items)))
    out: list[int | tuple[int, int, int]] = []
    for dim, (i, n) in enumerate(zip(items, shape)):
        if isinstance(i, slice):
            if i.step is not None and operator.index(i.step) <= 0:
                raise IndexError(f"dimension {dim}: only positive slice steps are supported, got {i.step}")
            start, stop, step = i.indices(n)
            count = max(0, (stop - start + step - 1) // step)
            out.append((start if count else 0, count, step))
        elif isinstance(i, bool) or i is None:
            raise TypeError(f"dimension {dim}: unsupported index {i!r}; use ints, slices and '...'")
        else:
            try:
                k = operator.index(i)
            except TypeError:
                raise TypeError(f"dimension {dim}: unsupported index {i!r} of type {type(i).__name__}; "
                                "use ints, slices and '...'") from None
            if not -n <= k < n:
                raise IndexError(f"index {k} is out of bounds for dimension {dim} with size {n}")
            out.append(k % n)
    return out


def slice_runs(info: TensorInfo, data_start: int, index=None) -> tuple[tuple[int, ...], list[Run]]:
    """The result shape and the 2-D runs that read ``tensor[index]`` into a packed array."""
    if type(index) is tuple and 0 < len(index) <= 2:
        fast = _shard_runs(info, data_start, index)
        if fast is not None:
            return fast
    return _slice_runs(info, data_start, index)


def _shard_runs(info: TensorInfo, data_start: int, index: tuple):
    """``x[a:b]`` or ``x[:, a:b]`` (what a tensor-parallel shard asks for), without the general
    machinery: one run. None when the index is anything else (the general path decides)."""
    shape = info.shape
    k = len(index) - 1
    if k >= len(shape) or info.dtype.sub_byte:
        return None
    last = index[k]
    if type(last) is not slice or last.step is not None or (k == 1 and index[0] != slice(None)):
        return None
    start, stop, _ = last.indices(shape[k])
    count = stop - start
    if count <= 0 or (k == 1 and count == shape[1]):
        return None
    inner = info.dtype.itemsize
    for n in shape[k + 1:]:
        inner *= n
    width = count * inner
    if width == 0:
        return None
    out_shape = shape[:k] + (count,) + shape[k + 1:]
    if k == 0:
        return out_shape, [Run(data_start + info.start + start * inner, width, width, 1, 0)]
    height = shape[0]
    if height == 0:
        return None
    return out_shape, [Run(data_start + info.start + start * inner, shape[1] * inner if height > 1 else width,
                           width, height, 0)]


def _slice_runs(info: TensorInfo, data_start: int, index=None) -> tuple[tuple[int, ...], list[Run]]:
    base = data_start + info.start
    if index is None:
        return info.shape, ([Run(base, info.nbytes, info.nbytes, 1, 0)] if info.nbytes else [])
    sel = normalize_index(index, info.shape)
    out_shape = tuple(s[1] for s in sel if isinstance(s, tuple))
    if info.dtype.sub_byte:
        if all(isinstance(s, tuple) and s[0] == 0 and s[1] == n and (s[2] == 1 or n <= 1)
               for s, n in zip(sel, info.shape)):
            return slice_runs(info, data_start, None)
        raise IndexError(f"tensor {info.name!r}: slicing sub-byte dtype {info.dtype.name} is not supported; "
                         "load it whole")
    item = info.dtype.itemsize
    # per dim: (start, count, step) ; ints become count 1
    dims = [(s, 1, 1) if isinstance(s, int) else s for s in sel]
    if any(c == 0 for _, c, _ in dims):
        return out_shape, []
    strides = [0] * len(info.shape)
    acc = item
    for d in range(len(info.shape) - 1, -1, -1):
        strides[d] = acc
        acc *= info.shape[d]
    # k = last dim that is not full; everything after it is one contiguous block
    k = len(dims) - 1
    while k >= 0 and dims[k][0] == 0 and dims[k][1] == info.shape[k] and (dims[k][2] == 1 or dims[k][1] <= 1):
        k -= 1
    if k < 0:
        return out_shape, [Run(base, info.nbytes, info.nbytes, 1, 0)]
    inner = strides[k]  # bytes of one index step at dim k
    start_k, count_k, step_k = dims[k]
    if step_k == 1 or count_k == 1:
        width, pitch, height, row_dim = count_k * inner, 0, 1, k - 1
        first = start_k * inner
        # fold dim k-1 into rows of a 2-D run when it exists
        if row_dim >= 0:
            s, c, st = dims[row_dim]
            pitch, height = st * strides[row_dim], c
            first += s * strides[row_dim]
            outer_dims = range(row_dim)
        else:
            outer_dims = range(0)
    else:
        width, pitch, height = inner, step_k * inner, count_k
        first = start_k * inner
        outer_dims = range(k)
    runs: list[Run] = []
    dst = 0
    run_bytes = width * height
    # enumerate the remaining outer dims (row-major)
    outer = [dims[d] for d in outer_dims]
    outer_strides = [strides[d] for d in outer_dims]
    counters = [0] * len(outer)
    while True:
        off = first
        for (s, _, st), stride, i in zip(outer, outer_strides, counters):
            off += (s + i * st) * stride
        runs.append(Run(base + off, pitch if height > 1 else width, width, height, dst))
        dst += run_bytes
        d = len(outer) - 1
        while d >= 0:
            counters[d] += 1
            if counters[d] < outer[d][1]:
                break
            counters[d] = 0
            d -= 1
        if d < 0:
            break
    return out_shape, runs


def split_run(run: Run, max_bytes: int, granule: int = 1) -> list[Run]:
    """Cut a run into pieces whose source span is at most ``max_bytes``.

    Whole rows are kept together when a row fits; a row wider than ``max_bytes`` is cut into
    pieces that are multiples of ``granule`` bytes (except the last).
    """
    if max_bytes <= 0:
        raise ValueError("chunk size must be positive")
    if run.span <= max_bytes:
        return [run]
    out = []
    if run.width <= max_bytes and run.height > 1:
        rows = max(1, (max_bytes - run.width) // run.pitch + 1) if run.pitch else run.height
        for r in range(0, run.height, rows):
            h = min(rows, run.height - r)
            out.append(Run(run.src + r * run.pitch, run.pitch if h > 1 else run.width, run.width, h,
                           run.dst + r * run.width))
        return out
    piece = max(granule, (max_bytes // granule) * granule)
    for r in range(run.height):
        for off in range(0, run.width, piece):
            w = min(piece, run.width - off)
            out.append(Run(run.src + r * run.pitch + off, w, w, 1, run.dst + r * run.width + off))
    return out


@dataclass(frozen=True, slots=True)
class Selection:
    """One thing to load: a tensor of a file, optionally an index into it."""
    file: int
    data_start: int
    info: TensorInfo
    index: object = None
    name: str | None = None  # result name; defaults to the tensor's


def plan_load(selections: Sequence[Selection], chunk_bytes: int, granule: int = 1) -> LoadPlan:
    """Destinations and chunks for the selections, chunks in selection order.

    A tensor cut into pieces is cut at multiples of ``granule`` (and of its itemsize) from its
    start: with checksum blocks as the granule, every chunk holds whole blocks (see integrity).
    """
    if granule > chunk_bytes:
        raise ValueError(f"granule ({granule}) larger than the chunk size ({chunk_bytes})")
    dests, chunks, counts = [], [], []
    granules: dict[int, int] = {}
    for i, s in enumerate(selections):
        shape, runs = slice_runs(s.info, s.data_start, s.index)
        dests.append(Destination(s.name or s.info.name, s.info.dtype, shape, sum(r.width * r.height for r in runs)))
        n = len(chunks)
        for r in runs:
            if r.span <= chunk_bytes:   # most runs of a plan: no cutting
                chunks.append(Chunk(s.file, i, r))
                continue
            itemsize = s.info.dtype.itemsize
            g = granules.get(itemsize) or granules.setdefault(itemsize, math.lcm(granule, max(1, itemsize)))
            chunks.extend(Chunk(s.file, i, piece) for piece in split_run(r, chunk_bytes, granule=g))
        counts.append(len(chunks) - n)
    return LoadPlan(tuple(dests), tuple(chunks), tuple(counts))


def plan_save(sizes: Sequence[int], offsets: Sequence[int], chunk_bytes: int,
              granules: Sequence[int]) -> list[tuple[int, Run]]:
    """Chunks of a save: (tensor index, Run with src = offset in the tensor, dst = file offset).

    ``granules[i]`` is the byte multiple chunk boundaries of tensor i must respect (a row, for
    arrays that must be made contiguous piecewise).
    """
    out = []
    for i, (size, off, g) in enumerate(zip(sizes, offsets, granules)):
        if size == 0:
            continue
        step = max(g, (chunk_bytes // g) * g)
        for pos in range(0, size, step):
            w = min(step, size - pos)
            out.append((i, Run(pos, w, w, 1, off + pos)))
    return out
