"""The dtype table: every safetensors dtype, its bit size and its host/torch types.

The order of ``DTYPES`` is the reference's enum order, which its serializer sorts by, so it is
part of the format. The host types of bf16 and fp8 come from ml_dtypes, imported only when a
numpy array of one is made or met (``DType.numpy``): its import is slow, and torch and cupy
outputs never need it.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import numpy as np

from ..errors import UnsupportedTypeError

_HOST: dict[str, np.dtype] = {}   # DType.name -> its host dtype, resolved on first use


class DType(NamedTuple):
    name: str            # the safetensors spelling, e.g. "BF16"
    bits: int            # bits per element
    host: str            # host element type: a numpy type name, or "ml_dtypes.<name>"; sub-byte: uint8
    torch_name: str | None  # attribute of the ``torch`` module, if torch has the type
    rank: int            # position in the reference enum (serializer order)

    @property
    def numpy(self) -> np.dtype:
        """The host element type (sub-byte types load as raw uint8); ml_dtypes' are imported here."""
        got = _HOST.get(self.name)
        if got is None:
            got = _HOST[self.name] = _resolve(self.host)
        return got

    @property
    def ml_dtypes(self) -> bool:
        """Whether numpy holds this type only through ml_dtypes (bf16, fp8)."""
        return self.host.startswith("ml_dtypes.")

    @property
    def itemsize(self) -> int:
        """Bytes per element; 0 for sub-byte types (F4, F6)."""
        return self.bits // 8 if self.bits % 8 == 0 else 0

    @property
    def sub_byte(self) -> bool:
        return self.bits % 8 != 0


def _resolve(host: str) -> np.dtype:
    if host.startswith("ml_dtypes."):
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, host.partition(".")[2]))
    return np.dtype(host)


def _t(*rows):
    return {name: DType(name, bits, host, torch_name, rank) for rank, (name, bits, host, torch_name) in enumerate(rows)}


# Reference enum order (safetensors/src/tensor.rs, `enum Dtype`): do not reorder.
DTYPES: dict[str, DType] = _t(
    ("BOOL", 8, "bool", "bool"),
    ("F4", 4, "uint8", "float4_e2m1fn_x2"),
    ("F6_E2M3", 6, "uint8", None),
    ("F6_E3M2", 6, "uint8", None),
    ("U8", 8, "uint8", "uint8"),
    ("I8", 8, "int8", "int8"),
    ("F8_E5M2", 8, "ml_dtypes.float8_e5m2", "float8_e5m2"),
    ("F8_E4M3", 8, "ml_dtypes.float8_e4m3fn", "float8_e4m3fn"),
    ("F8_E8M0", 8, "ml_dtypes.float8_e8m0fnu", "float8_e8m0fnu"),
    ("F8_E4M3FNUZ", 8, "ml_dtypes.float8_e4m3fnuz", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", 8, "ml_dtypes.float8_e5m2fnuz", "float8_e5m2fnuz"),
    ("I16", 16, "int16", "int16"),
    ("U16", 16, "uint16", "uint16"),
    ("F16", 16, "float16", "float16"),
    ("BF16", 16, "ml_dtypes.bfloat16", "bfloat16"),
    ("I32", 32, "int32", "int32"),
    ("U32", 32, "uint32", "uint32"),
    ("F32", 32, "float32", "float32"),
    ("C64", 64, "complex64", "complex64"),
    ("F64", 64, "float64", "float64"),
    ("I64", 64, "int64", "int64"),
    ("U64", 64, "uint64", "uint64"),
)

_FROM_NUMPY: dict[np.dtype, DType] = {d.numpy: d for d in reversed(DTYPES.values()) if not d.sub_byte and not d.ml_dtypes}
_FROM_TORCH_NAME: dict[str, DType] = {d.torch_name: d for d in DTYPES.values() if d.torch_name}


def from_numpy(dtype: np.dtype) -> DType:
    """The safetensors dtype of a host array; raises TypeError for types the format lacks."""
    dtype = np.dtype(dtype)
    if dtype.byteorder == ">":
        dtype = dtype.newbyteorder("=")
    got = _FROM_NUMPY.get(dtype)
    if got is None and "ml_dtypes" in sys.modules:   # an array of bf16 or fp8 exists: ml_dtypes is imported
        for d in DTYPES.values():
            if d.ml_dtypes:
                _FROM_NUMPY.setdefault(d.numpy, d)
        got = _FROM_NUMPY.get(dtype)
    if got is None:
        raise UnsupportedTypeError(f"numpy dtype {dtype} has no safetensors equivalent; "
                                   f"supported: {sorted(str(k) for k in _FROM_NUMPY)}")
    return got


def from_torch(dtype) -> DType:
    """The safetensors dtype of a torch dtype (``torch.bfloat16`` -> BF16)."""
    name = str(dtype).removeprefix("torch.")
    try:
        return _FROM_TORCH_NAME[name]
    except KeyError:
        raise UnsupportedTypeError(f"torch dtype {dtype} has no safetensors equivalent") from None


def host_shape(dtype: DType, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the host array holding a tensor of logical ``shape``. Sub-byte types (F4, F6_*) are
    raw packed uint8: the last dimension shrinks by bits/8 when it packs into whole bytes (F4
    ``[n, 2k]`` -> ``[n, k]``, torch's ``float4_e2m1fn_x2`` layout), else a flat byte vector."""
    if not dtype.sub_byte:
        return shape
    if shape and (shape[-1] * dtype.bits) % 8 == 0:
        return shape[:-1] + (shape[-1] * dtype.bits // 8,)
    return (nbytes(dtype, shape),)


def nbytes(dtype: DType, shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.bits // 8
