"""safetensors' low-level API (``TensorSpec``, ``serialize``, ``serialize_file``, ``deserialize``),
same names, arguments and results as ``safetensors`` 0.8.0; specs are read from their host address.
"""

from __future__ import annotations

import ctypes
import operator
import os
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import SafetensorError, UnsupportedTypeError
from ..format.dtypes import DType, from_torch, nbytes
from ..io.memory import buffer_header

# safetensors' dtype names (torch's spelling, which numpy's ``dtype.name`` shares), in its order
_NAMES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32",
          "float64", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
          "float8_e8m0fnu", "float4_e2m1fn_x2", "complex64")
_BY_NAME: dict[str, DType] = {name: from_torch(name) for name in _NAMES}


def _dims(shape: Any) -> list[int] | None:
    """``shape`` as a list of non-negative ints, or None when it is not one."""
    if isinstance(shape, (str, bytes)):
        return None
    try:
        dims = [operator.index(n) for n in shape]
    except TypeError:
        return None
    return dims if all(n >= 0 for n in dims) else None


class TensorSpec:
    """One tensor for ``serialize``: its dtype by name (``"float32"``, ``"bfloat16"``...), its
    shape, and ``data_len`` bytes at address ``data_ptr``, which must stay valid while it is
    serialized. An unknown dtype is refused here. For ``float4_e2m1fn_x2`` the shape may be the
    storage shape torch reports (two values per byte): the last dimension is doubled."""

    __slots__ = ("_dtype", "_shape", "_data_ptr", "_data_len")

    def __init__(self, *, dtype: str, shape: Sequence[int], data_ptr: int, data_len: int) -> None:
        d = _BY_NAME.get(dtype) if isinstance(dtype, str) else None
        if d is None:
            raise UnsupportedTypeError(f'Unknown dtype "{dtype}". Supported dtypes: ' + ", ".join(_NAMES))
        dims = _dims(shape)
        if dims is None:
            raise TypeError(f"shape must be a sequence of non-negative ints, got {shape!r}")
        shape = dims
        if d.sub_byte and shape:
            shape[-1] *= 8 // d.bits
        self._dtype, self._shape = d, shape
        self._data_ptr, self._data_len = int(data_ptr), int(data_len)

    @property
    def dtype(self) -> str:
        """The format's name for the dtype (``"F32"``), as written in the header."""
        return self._dtype.name

    @property
    def shape(self) -> list[int]:
        """The logical shape, as written in the header."""
        return list(self._shape)

    @property
    def data_ptr(self) -> int:
        return self._data_ptr

    @property
    def data_len(self) -> int:
        return self._data_len

    def __repr__(self) -> str:
        return (f"TensorSpec(dtype={self.dtype!r}, shape={self._shape}, data_ptr={self._data_ptr}, "
                f"data_len={self._data_len})")

    def raw(self, name: str):
        """The bytes it points at, as the saver's RawTensor (no copy)."""
        from .saver import RawTensor   # imported by saves only
        if nbytes(self._dtype, tuple(self._shape)) != self._data_len:
            raise SafetensorError(f"Error while serializing: invalid shape, data type, or offset for tensor {name!r}: "
                                  f"{self.dtype}{self._shape} is not {self._data_len} bytes")
        if not self._data_len:
            return RawTensor(self._dtype, tuple(self._shape), np.empty(0, np.uint8))
        if not self._data_ptr:
            raise SafetensorError(f"Error while serializing: tensor {name!r} has a null data_ptr")
        data = np.ctypeslib.as_array((ctypes.c_ubyte * self._data_len).from_address(self._data_ptr))
        return RawTensor(self._dtype, tuple(self._shape), data)


def _raw_tensors(tensor_dict: Any, metadata: Any) -> dict[str, Any]:
    if not isinstance(tensor_dict, Mapping):
        raise TypeError(f"tensor_dict must be a dict of str to TensorSpec, got {type(tensor_dict).__name__}")
    for name, spec in tensor_dict.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r} of type {type(name).__name__}")
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"tensor {name!r}: expected a TensorSpec, got {type(spec).__name__}")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict of str to str, got {type(metadata).__name__}")
    return {name: spec.raw(name) for name, spec in tensor_dict.items()}


def serialize(tensor_dict: Mapping[str, TensorSpec], metadata: Mapping[str, str] | None = None) -> bytes:
    """The bytes of a safetensors file holding ``tensor_dict`` (and ``metadata``)."""
    from . import saver
    return saver.save_bytes(_raw_tensors(tensor_dict, metadata), metadata)


def serialize_file(tensor_dict: Mapping[str, TensorSpec], filename: str | os.PathLike,
                   metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensor_dict`` (and ``metadata``) as a safetensors file at ``filename``, atomically."""
    from . import saver
    saver.save_file(_raw_tensors(tensor_dict, metadata), filename, metadata)


def deserialize(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    """``[(name, {"shape": [...], "dtype": "F32", "data": bytearray}), ...]`` in file order."""
    header = buffer_header(data)
    view = memoryview(data).cast("B")
    start = header.data_start
    return [(t.name, {"shape": list(t.shape), "dtype": t.dtype.name,
                      "data": bytearray(view[start + t.start:start + t.end])}) for t in header.tensors]
