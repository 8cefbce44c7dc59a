"""numpy basic indexing reduced to byte runs: which bytes of a tensor ``tensor[index]`` reads.
Pure functions, no I/O. ``slice_runs`` gives the result's shape and the ``Run`` s (2-D copies)
that read exactly the selected bytes.
"""

from __future__ import annotations

import operator
from typing import NamedTuple, Sequence

from ..errors import SliceError, UnsupportedTypeError
from .header import TensorInfo


class Run(NamedTuple):   # a tuple, not a frozen dataclass: a plan makes hundreds
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


_new = tuple.__new__   # Run(...) without its Python-level __new__


def normalize_index(index, shape: Sequence[int]) -> list[int | tuple[int, int, int]]:
    """numpy basic indexing, reduced to one item per dimension: an int (negative allowed) selects
    one element and drops the dimension; a positive-step slice becomes ``(start, count, step)``;
    ``...`` expands; missing trailing dims are full; the empty list selects nothing (as in
    safetensors). Anything else is refused: SliceError for a value, UnsupportedTypeError for a type.
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
        raise SliceError("an index can only have a single ellipsis ('...')")
    explicit = len(index) - n_ell
    if explicit > len(shape):
        raise SliceError(f"too many indices: tensor is {len(shape)}-dimensional, but {explicit} were indexed")
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
                raise SliceError(f"dimension {dim}: only positive slice steps are supported, got {i.step}")
            start, stop, step = i.indices(n)
            count = max(0, (stop - start + step - 1) // step)
            out.append((start if count else 0, count, step))
        elif isinstance(i, list):   # safetensors takes one list, the empty one: nothing along this dim
            if i:
                raise SliceError("Non empty lists are not implemented")
            out.append((0, 0, 1))
        elif isinstance(i, bool) or i is None:
            raise UnsupportedTypeError(f"dimension {dim}: unsupported index {i!r}; use ints, slices and '...'")
        else:
            try:
                k = operator.index(i)
            except TypeError:
                raise UnsupportedTypeError(f"dimension {dim}: unsupported index {i!r} of type {type(i).__name__}; "
                                "use ints, slices and '...'") from None
            if not -n <= k < n:
                raise out_of_bounds(index, shape, dim, k)
            out.append(k % n)
    return out


def out_of_bounds(index: tuple, shape: Sequence[int], dim: int, k: int) -> SliceError:
    """safetensors' words for an int index ``k`` outside dimension ``dim``."""
    n = shape[dim]
    if k < 0:
        return SliceError(f"Invalid index {k} for dimension {dim} of size {n}")

    def show(i) -> str:
        if isinstance(i, slice):
            text = f"{'' if i.start is None else i.start}:{'' if i.stop is None else i.stop}"
            return text if i.step is None else f"{text}:{i.step}"
        return "..." if i is Ellipsis else str(i)
    return SliceError(f"Error during slicing [{', '.join(show(i) for i in index)}] with shape {list(shape)}: "
                      f"index {k} out of bounds for tensor dimension #{dim} of size {n}")


def slice_runs(info: TensorInfo, data_start: int, index=None) -> tuple[tuple[int, ...], list[Run]]:
    """The result shape and the 2-D runs that read ``tensor[index]`` into a packed array."""
    if index is None:   # a whole tensor: one run (a load of a million tiny tensors makes one each)
        n = info.end - info.start
        return info.shape, ([_new(Run, (data_start + info.start, n, n, 1, 0))] if n else [])
    if type(index) is tuple and 0 < len(index) <= 2:
        fast = shard_run(info, data_start, index)
        if fast is not None:
            return fast
    return general_slice_runs(info, data_start, index)


def shard_run(info: TensorInfo, data_start: int, index: tuple) -> tuple[tuple[int, ...], list[Run]] | None:
    """``x[a:b]`` or ``x[:, a:b]`` (a tensor-parallel slice) as one run; None for any other index."""
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


def _strides(shape: Sequence[int], itemsize: int) -> list[int]:
    """Bytes between consecutive indices of each dim of a C-contiguous tensor."""
    strides = [0] * len(shape)
    acc = itemsize
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = acc
        acc *= shape[d]
    return strides


def _last_partial_dim(dims: Sequence[tuple[int, int, int]], shape: Sequence[int]) -> int:
    """The last dim that is not taken whole (-1 if none): everything after it is one block."""
    k = len(dims) - 1
    while k >= 0 and dims[k][0] == 0 and dims[k][1] == shape[k] and (dims[k][2] == 1 or dims[k][1] <= 1):
        k -= 1
    return k


def _outer_runs(base: int, first: int, width: int, pitch: int, height: int,
                outer: list[tuple[int, int, int]], outer_strides: list[int]) -> list[Run]:
    """One run (``height`` rows of ``width`` bytes) per combination of the outer dims' indices, packed."""
    runs: list[Run] = []
    dst = 0
    counters = [0] * len(outer)
    while True:
        off = first
        for (s, _, st), stride, i in zip(outer, outer_strides, counters):
            off += (s + i * st) * stride
        runs.append(Run(base + off, pitch if height > 1 else width, width, height, dst))
        dst += width * height
        d = len(outer) - 1
        while d >= 0:
            counters[d] += 1
            if counters[d] < outer[d][1]:
                break
            counters[d] = 0
            d -= 1
        if d < 0:
            return runs


def general_slice_runs(info: TensorInfo, data_start: int, index=None) -> tuple[tuple[int, ...], list[Run]]:
    """``slice_runs`` for any basic index: the block after the last partial dim is a row, the
    dim before it (if any) gives the rows of one 2-D run, and the dims further out one run each."""
    if index is None:
        return slice_runs(info, data_start)
    base = data_start + info.start
    sel = normalize_index(index, info.shape)
    out_shape = tuple(s[1] for s in sel if isinstance(s, tuple))
    if info.dtype.sub_byte:
        if all(isinstance(s, tuple) and s[0] == 0 and s[1] == n and (s[2] == 1 or n <= 1)
               for s, n in zip(sel, info.shape)):
            return slice_runs(info, data_start)
        raise SliceError(f"tensor {info.name!r}: slicing sub-byte dtype {info.dtype.name} is not supported; "
                         "load it whole")
    dims = [(s, 1, 1) if isinstance(s, int) else s for s in sel]   # per dim: (start, count, step)
    if any(c == 0 for _, c, _ in dims):
        return out_shape, []
    strides = _strides(info.shape, info.dtype.itemsize)
    k = _last_partial_dim(dims, info.shape)
    if k < 0:
        return out_shape, [Run(base, info.nbytes, info.nbytes, 1, 0)]
    inner = strides[k]  # bytes of one index step at dim k
    start_k, count_k, step_k = dims[k]
    first = start_k * inner
    if step_k == 1 or count_k == 1:   # dim k's selection is one contiguous row
        width, pitch, height, outer_dims = count_k * inner, 0, 1, range(0)
        if k >= 1:                     # fold dim k-1 into the rows of a 2-D run
            s, c, st = dims[k - 1]
            pitch, height = st * strides[k - 1], c
            first += s * strides[k - 1]
            outer_dims = range(k - 1)
    else:                              # a stepped dim k: its elements are the rows
        width, pitch, height, outer_dims = inner, step_k * inner, count_k, range(k)
    return out_shape, _outer_runs(base, first, width, pitch, height, [dims[d] for d in outer_dims],
                                  [strides[d] for d in outer_dims])
