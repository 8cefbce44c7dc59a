"""Tensor-parallel slices: which part of each tensor one rank loads. Pure functions, no I/O.

``TPSlice(rank, world_size, dim)`` turns into one basic index per tensor (``x[:, a:b]``), so a
rank's load is an ordinary sliced load. Sizes that do not divide evenly are split like
``numpy.array_split``: the first ``size % world_size`` ranks get one element more.
"""

from __future__ import annotations

import fnmatch
import functools
import operator
import re
from collections import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence, Union

if TYPE_CHECKING:
    from ..io.checkpoint import Checkpoint

# TPSlice.dim: an int, None, a mapping of glob -> dim|None, or a callable name -> dim|None
DimRule = Union[int, None, Mapping[str, Union[int, None]], Callable[[str], Union[int, None]]]

Index = tuple[slice, ...]


def _dim_value(value, where: str | Callable[[], str]) -> int | None:
    """``value`` as a dim (an int or None); ``where`` (or what it returns) names it in the error."""
    if value is None or type(value) is int:   # the common case, before any message is built
        return value
    where = where if isinstance(where, str) else where()
    if isinstance(value, bool):
        raise TypeError(f"{where}: a shard dim must be an int or None, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{where}: a shard dim must be an int or None, got {value!r}") from None


@dataclass(frozen=True, slots=True)
class TPSlice:
    """Rank ``rank`` of ``world_size`` loads its slice of every tensor along ``dim``.

    ``dim`` is an int (every tensor along that dim; negative counts from the end), ``None``
    (replicate: every rank loads the whole tensor), a mapping of glob patterns to a dim or
    ``None`` (the first pattern that matches the name wins, so put ``"*"`` last), or a
    callable ``name -> dim | None``. Column-parallel and row-parallel layers differ, hence
    the per-name forms, e.g. ``{"*.o_proj.weight": 1, "*.q_proj.weight": 0, "*": None}``.
    """
    rank: int
    world_size: int
    dim: DimRule = 0

    def __post_init__(self) -> None:
        for field_name in ("rank", "world_size"):
            v = getattr(self, field_name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"TPSlice.{field_name} must be an int, got {v!r}")
        if self.world_size < 1:
            raise ValueError(f"TPSlice.world_size must be at least 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"TPSlice.rank must be in [0, {self.world_size}), got {self.rank}")
        d = self.dim
        if isinstance(d, Mapping):
            for pattern, v in d.items():
                if not isinstance(pattern, str):
                    raise TypeError(f"TPSlice.dim: patterns must be strings, got {pattern!r}")
                _dim_value(v, f"TPSlice.dim[{pattern!r}]")
        elif not callable(d):
            _dim_value(d, "TPSlice.dim")

    def dim_for(self, name: str) -> int | None:
        """The dim tensor ``name`` is split along, or None to load it whole."""
        return dim_rule(self)(name)


@functools.lru_cache(maxsize=64)
def glob_matcher(patterns: tuple[str, ...]) -> Callable[[str], int | None]:
    """A function giving the index of the first of ``patterns`` (``fnmatch.fnmatchcase`` globs)
    that matches a name, or None: one regex of alternatives, one match per name."""
    if not patterns:
        return lambda name: None
    rx = re.compile("|".join(f"({fnmatch.translate(p)})" for p in patterns))
    if rx.groups != len(patterns):   # a translation with groups of its own: match one by one
        each = [re.compile(fnmatch.translate(p)).match for p in patterns]
        return lambda name: next((i for i, m in enumerate(each) if m(name)), None)
    match = rx.match

    def first(name: str) -> int | None:
        m = match(name)
        return None if m is None else m.lastindex - 1
    return first


def dim_rule(shard: TPSlice) -> Callable[[str], int | None]:
    """``shard.dim`` as one function of a tensor's name, resolved once for a whole load."""
    d = shard.dim
    if isinstance(d, abc.Mapping):
        patterns, values = tuple(d), list(d.values())
        first = glob_matcher(patterns)

        def by_pattern(name: str) -> int | None:
            i = first(name)
            if i is None:
                raise ValueError(f"tensor {name!r}: no pattern of TPSlice.dim matches it "
                                 f"({list(patterns[:8])}); add '*': None to replicate the rest")
            return _dim_value(values[i], lambda: f"TPSlice.dim[{patterns[i]!r}]")
        return by_pattern
    if callable(d):
        return lambda name: _dim_value(d(name), lambda: f"tensor {name!r}: TPSlice.dim({name!r})")
    fixed = _dim_value(d, "TPSlice.dim")
    return lambda name: fixed


Shard = TPSlice   # the earlier name, kept: "shard" also means a file of a sharded checkpoint


def split_bounds(size: int, parts: int, part: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``part`` of ``parts`` over ``size`` elements (numpy.array_split)."""
    base, extra = divmod(size, parts)
    start = part * base + min(part, extra)
    return start, start + base + (1 if part < extra else 0)


def shard_index(shape: Sequence[int], shard: TPSlice, name: str = "") -> Index | None:
    """The basic index selecting this rank's part of a tensor, ``(slice(None),) * d + (slice(a, b),)``
    (what ``x[:, a:b]`` gives); None when it is replicated."""
    _require_tpslice(shard)
    return index_along(shape, shard.dim_for(name), shard, name)


def _require_tpslice(shard) -> None:
    if not isinstance(shard, TPSlice):
        raise TypeError(f"shard must be a foxhunt_stream.TPSlice, got {type(shard).__name__}")


def index_along(shape: Sequence[int], d: int | None, shard: TPSlice, name: str = "") -> Index | None:
    """``shard_index`` with the tensor's dim ``d`` already known (``dim_rule``)."""
    if d is None:
        return None
    ndim = len(shape)
    if not -ndim <= d < ndim:
        raise ValueError(f"tensor {name!r} has shape {list(shape)} ({ndim} dims): cannot shard it along dim {d}; "
                         "map it to None in TPSlice.dim to replicate it")
    d %= ndim
    a, b = split_bounds(shape[d], shard.world_size, shard.rank)
    return (slice(None),) * d + (slice(a, b),)


def shard_shape(shape: Sequence[int], shard: TPSlice, name: str = "") -> tuple[int, ...]:
    """The shape of this rank's part of a tensor of ``shape``."""
    index = shard_index(shape, shard, name)
    if index is None:
        return tuple(shape)
    d = len(index) - 1
    a, b = index[d].start, index[d].stop
    return tuple(shape[:d]) + (b - a,) + tuple(shape[d + 1:])


def indices_for(ck: "Checkpoint", names: Iterable[str], shard: TPSlice | None) -> dict[str, Index | None] | None:
    """``{name: index}`` for a load's selections (None when not sharding)."""
    if shard is None:
        return None
    _require_tpslice(shard)
    rule, entries = dim_rule(shard), ck.names
    known: dict[tuple, Index | None] = {}   # a model repeats a few shapes: one index per (shape, dim)
    out = {}
    for n in names:
        shape, d = entries[n][1].shape, rule(n)
        index = known.get((shape, d), known)
        if index is known:
            index = known[(shape, d)] = index_along(shape, d, shard, n)
        out[n] = index
    return out
