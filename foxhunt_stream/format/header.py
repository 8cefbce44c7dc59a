"""The safetensors header: parse, validate, serialize. Pure functions, no I/O.

Validation follows the reference implementation rule by rule (safetensors/src/tensor.rs,
``read_metadata`` and ``Metadata::validate``) and is stricter where it is lax:

* a key appearing twice in any JSON object is an error (the reference rejects a repeated
  ``dtype``/``shape``/``data_offsets``/``__metadata__`` but keeps the last of repeated tensor
  names, metadata keys and unknown fields);
* a tensor entry must be a JSON object (the reference also takes a 3-element array);
* ``dtype`` must be a JSON string (the reference's serde enum also takes ``{"F32": null}``);
* a shape must be one numpy can hold (at most 64 dimensions; see ``check_empty_shape``).

Where Python's ``json`` is laxer than the reference's serde_json, we follow serde_json, so
that every file we accept the reference accepts too: no NaN/Infinity literals, no lone
surrogate escapes anywhere, ``-0`` is a float (so not a valid shape/offset), numbers must
fit a double, and objects/arrays nest at most ``json_scan.MAX_JSON_DEPTH`` deep.

A header in the writers' form is read as columns (``header_plain``); any other, or one that
breaks a rule, member by member (``header_json``). Every rule is a ``FormatError`` whose ``rule``
attribute names it.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import struct
from typing import Iterable, Mapping, NamedTuple

from .dtypes import DTYPES, DType
from .header_plain import MAX_DIMS, read_plain
from .. import collector
from ..errors import FormatError

N_LEN = 8
MAX_HEADER_SIZE = 100_000_000
JSON_START = b"{ \t\r\n"   # what a header may begin with (JSON whitespace, then its object)
_U64_MAX = 2**64 - 1
_I64_MAX = 2**63 - 1


class TensorInfo(NamedTuple):
    """One tensor of a file: where its bytes are, relative to the start of the data region (a
    tuple: a load makes one per tensor before its first read)."""
    name: str
    dtype: DType
    shape: tuple[int, ...]
    start: int   # offset of the first byte inside the data region
    end: int     # one past the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Header(NamedTuple):
    """A validated header. ``tensors`` are in file (offset) order."""
    metadata: dict[str, str] | None
    tensors: tuple[TensorInfo, ...]
    header_len: int                     # n, the JSON length including padding
    by_name: dict[str, TensorInfo]      # the same tensors by name

    def __repr__(self) -> str:
        return f"Header({len(self.tensors)} tensors, header_len={self.header_len}, metadata={self.metadata!r})"

    @property
    def data_start(self) -> int:
        """Absolute file offset of the data region."""
        return N_LEN + self.header_len

    @property
    def data_len(self) -> int:
        return self.tensors[-1].end if self.tensors else 0

    @property
    def file_size(self) -> int:
        return self.data_start + self.data_len


def read_header_len(prefix: bytes, file_size: int) -> int:
    """Validate the 8-byte length prefix against the file size; returns n. ``prefix`` may go on
    into the header: an impossible length then not followed by JSON is ``not-safetensors``."""
    if len(prefix) < N_LEN or file_size < N_LEN:
        raise FormatError("header-too-small", f"file has {file_size} bytes, fewer than the 8-byte length prefix")
    (n,) = struct.unpack("<Q", prefix[:N_LEN])
    if (n > MAX_HEADER_SIZE or N_LEN + n > file_size) and len(prefix) > N_LEN and prefix[N_LEN] not in JSON_START:
        raise FormatError("not-safetensors",
                          f"not a safetensors file: it begins with {bytes(prefix[:N_LEN])!r}, which as a header length "
                          f"says {n:,} bytes in a file of {file_size:,} (a safetensors file begins with the length of "
                          "its JSON header, then the header, '{...}')")
    if n > MAX_HEADER_SIZE:
        raise FormatError("header-too-large", f"header length {n} exceeds the limit of {MAX_HEADER_SIZE}")
    if N_LEN + n > file_size:
        raise FormatError("header-length", f"header length {n} runs past the end of the {file_size}-byte file")
    return n


def header_text(data: bytes, start: int, stop: int) -> str:
    """The header's JSON ``data[start:stop]`` as text (FormatError if it is not UTF-8)."""
    try:
        return str(memoryview(data)[start:stop], "utf-8")
    except UnicodeDecodeError as e:
        raise FormatError("header-utf8", f"header is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def _metadata(value) -> dict[str, str] | None:
    """``__metadata__``: absent/null, or an object of string to string."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise FormatError("metadata-type", "__metadata__ must be an object of string to string, or null")
    for k, v in value.items():
        if not isinstance(v, str):
            from .header_json import kind_name
            raise FormatError("metadata-type", f"__metadata__[{k!r}] is a {kind_name(v)}, not a string")
    return value


def check_size(t: TensorInfo) -> None:
    """dtype x shape must be a whole number of bytes, within 64 bits, and span the tensor's offsets."""
    # every partial product is checked, as the reference's checked_mul fold does ([2**40, 2**40, 0] fails)
    numel = 1
    for s in t.shape:
        numel *= s
        if numel > _U64_MAX:
            break
    nbits = numel * t.dtype.bits
    if numel > _U64_MAX or nbits > _U64_MAX:
        raise FormatError("size-overflow", f"shape {list(t.shape)} overflows a 64-bit byte count", tensor=t.name)
    if nbits % 8:
        raise FormatError("misaligned-slice", f"{t.numel} x {t.dtype.bits} bits is not a whole number of bytes",
                          tensor=t.name)
    if nbits // 8 != t.end - t.start:
        raise FormatError("size-mismatch",
                          f"{t.dtype.name}{list(t.shape)} needs {nbits // 8} bytes but data_offsets span "
                          f"{t.end - t.start}", tensor=t.name)
    if not numel:
        check_empty_shape(t)


def check_empty_shape(t: TensorInfo) -> None:
    """An empty tensor (a zero in its shape) must still be an array numpy can make: each dimension,
    and the bytes of its non-zero dimensions, below 2**63 (numpy's intp)."""
    size = max(1, t.dtype.bits // 8)
    for s in t.shape:
        if s:
            size *= s
        if s > _I64_MAX or size > _I64_MAX:
            raise FormatError("shape-limits", f"empty tensor of shape {list(t.shape)}: numpy holds no dimension, "
                              "nor product of the non-zero dimensions in bytes, of 2**63 or more", tensor=t.name)


def tile_data_region(infos: list[TensorInfo]) -> int:
    """Sort ``infos`` into file order, check that they tile the data region (no gap, no overlap)
    and that each one's size fits its offsets; returns the data region's length."""
    starts, ends = list(map(_START, infos)), list(map(_END, infos))
    numels = list(map(math.prod, map(_SHAPE, infos)))
    if (starts[:1] == [0] and starts[1:] == ends[:-1] and ends[-1] * 8 <= _U64_MAX and 0 not in numels
            and list(map(operator.mul, numels, map(_BITS, map(_DTYPE, infos))))
            == list(map(operator.mul, map(operator.sub, ends, starts), itertools.repeat(8)))):
        return ends[-1]
    infos.sort(key=_BY_OFFSETS)
    pos = 0
    for t in infos:
        _, dtype, shape, start, end = t
        if start != pos or end < start:
            raise FormatError("offsets-tiling",
                              f"data_offsets [{start}, {end}] do not start where the previous tensor ends ({pos}): "
                              "tensors must tile the data region with no gap or overlap", tensor=t.name)
        pos = end
        numel = 1
        for s in shape:
            numel *= s
        nbits = numel * dtype.bits
        # with no zero dim the last partial product bounds them all; else check rule by rule
        if not numel or numel > _U64_MAX or nbits > _U64_MAX or nbits != (end - start) * 8:
            check_size(t)
    return pos


_BY_OFFSETS = operator.itemgetter(3, 4)   # (start, end) of a TensorInfo
_DTYPE, _SHAPE, _START, _END = map(operator.itemgetter, (1, 2, 3, 4))
_BITS = operator.attrgetter("bits")


def parse_header(header_bytes: bytes, file_size: int) -> Header:
    """Parse and validate a whole header (``header_bytes`` = the 8-byte prefix + JSON) of a file of
    ``file_size`` bytes, where the data region must end."""
    n = read_header_len(header_bytes, file_size)
    if len(header_bytes) < N_LEN + n:
        raise FormatError("header-length", f"header length {n} but only {len(header_bytes) - N_LEN} header bytes given")
    data = header_bytes if isinstance(header_bytes, bytes) else bytes(header_bytes)
    with collector.paused():   # a header of 1M tensors took twice as long with collections
        text = header_text(data, N_LEN, N_LEN + n)
        plain = read_plain(text)   # the writers' form, its entries checked as columns
        if plain is not None:
            metadata, names, *fields = plain
            infos = list(map(_new_tuple, itertools.repeat(TensorInfo), zip(names, *fields)))
            by_name = dict(zip(names, infos))
        if plain is None or len(by_name) != len(infos):   # (a name twice: the member-by-member reader says which)
            from .header_json import read_header_object   # imported only for a header in another form
            obj = read_header_object(text, data, N_LEN, N_LEN + n)
            metadata = _metadata(obj.pop("__metadata__", None))
            infos = list(map(tensor_info, obj, obj.values()))
            by_name = dict(zip(obj, infos))
        end = tile_data_region(infos)
    if N_LEN + n + end != file_size:
        raise FormatError("incomplete-buffer",
                          f"data region should end at byte {N_LEN + n + end} but the file has {file_size} bytes")
    return Header(metadata=metadata, tensors=tuple(infos), header_len=n, by_name=by_name)


def tensor_info(name: str, entry) -> TensorInfo:
    """The entry of tensor ``name``, validated; the first rule it breaks is the FormatError raised,
    naming the tensor. Fields other than dtype, shape and data_offsets are not looked at."""
    if type(entry) is not dict:
        from .header_json import kind_name
        raise FormatError("tensor-entry", f"entry is a {kind_name(entry)}, not an object", tensor=name)
    try:
        dt, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
    except KeyError as e:
        raise FormatError("tensor-entry", f"missing field {e.args[0]!r}", tensor=name) from None
    dtype = DTYPES.get(dt) if type(dt) is str else None
    if dtype is None:
        raise FormatError("unknown-dtype", f"dtype {dt!r} is not one of {', '.join(DTYPES)}", tensor=name)
    for s in shape if type(shape) is list else (None,):   # a loop, not all(generator): faster
        if type(s) is not int or s < 0 or s > _U64_MAX:
            raise FormatError("shape", f"shape {shape!r} must be a list of non-negative integers", tensor=name)
    if len(shape) > MAX_DIMS:
        raise FormatError("shape-limits", f"shape has {len(shape)} dimensions, more than numpy's {MAX_DIMS}",
                          tensor=name)
    start, end = offs if type(offs) is list and len(offs) == 2 else (None, None)
    if type(start) is not int or type(end) is not int or not 0 <= start <= _U64_MAX or not 0 <= end <= _U64_MAX:
        raise FormatError("data-offsets", f"data_offsets {offs!r} must be exactly two non-negative integers",
                          tensor=name)
    return _new_tuple(TensorInfo, (name, dtype, tuple(shape), start, end))


_new_tuple = tuple.__new__   # TensorInfo(...) without its Python-level __new__


# ---------------------------------------------------------------- serializer

def layout(entries: Iterable[tuple[str, DType, tuple[int, ...]]]) -> list[TensorInfo]:
    """Order and place tensors as the reference serializer does: dtype (descending enum order),
    then name bytewise, packed back to back from offset 0."""
    items = sorted(entries, key=lambda e: (-e[1].rank, e[0].encode("utf-8")))
    out, pos = [], 0
    seen = set()
    for name, dtype, shape in items:
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__}")
        if name in seen:
            raise ValueError(f"duplicate tensor name {name!r}")
        if name == "__metadata__":
            raise ValueError("'__metadata__' is reserved and cannot name a tensor")
        seen.add(name)
        nbits = 1
        for s in shape:
            nbits *= int(s)
        nbits *= dtype.bits
        if nbits % 8:
            raise ValueError(f"tensor {name!r}: {dtype.name}{list(shape)} is not a whole number of bytes")
        size = nbits // 8
        out.append(TensorInfo(name, dtype, tuple(int(s) for s in shape), pos, pos + size))
        pos += size
    return out


def serialize_header(tensors: Iterable[TensorInfo], metadata: Mapping[str, str] | None) -> bytes:
    """The 8-byte prefix plus JSON, byte-identical to the reference for the same layout: compact,
    ``__metadata__`` first (its keys sorted; the reference's are in hash order), padded to 8."""
    parts = []
    if metadata is not None:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"metadata must map str to str, got {k!r}: {type(v).__name__}")
        parts.append('"__metadata__":' + json.dumps(dict(sorted(metadata.items())), ensure_ascii=False,
                                                    separators=(",", ":")))
    for t in tensors:
        parts.append(json.dumps(t.name, ensure_ascii=False) + ':{"dtype":"' + t.dtype.name + '","shape":['
                     + ",".join(str(s) for s in t.shape) + '],"data_offsets":[' + f"{t.start},{t.end}" + "]}")
    body = ("{" + ",".join(parts) + "}").encode("utf-8")
    body += b" " * (-len(body) % N_LEN)
    if len(body) > MAX_HEADER_SIZE:
        raise ValueError(f"header of {len(body)} bytes exceeds the format's limit of {MAX_HEADER_SIZE}")
    return struct.pack("<Q", len(body)) + body
