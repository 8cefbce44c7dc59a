"""numpy front end: drop-ins for ``safetensors.numpy``, same signatures, arrays on the host; ``save``
writes safetensors' bytes (big-endian and non-contiguous arrays too), ``load_file`` takes any source.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from . import api
from .engine.safe_open import safe_open
from .engine.serialize import TensorSpec, deserialize, serialize, serialize_file

__all__ = ["save", "save_file", "load", "load_file", "safe_open", "TensorSpec", "serialize", "serialize_file",
           "deserialize"]


def save(tensor_dict: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    """``safetensors.numpy.save``: the bytes of a safetensors file holding ``tensor_dict``."""
    from .engine import saver   # imported by saves only
    return saver.save_bytes(tensor_dict, metadata)


def save_file(tensor_dict: Mapping[str, np.ndarray], filename: str | os.PathLike,
              metadata: Mapping[str, str] | None = None, **options: Any) -> None:
    """``safetensors.numpy.save_file``: byte-identical output, written atomically (options as for
    ``foxhunt_stream.save_file``)."""
    from .engine import saver
    saver.save_file(tensor_dict, filename, metadata=metadata, **options)


def load(data: bytes) -> dict[str, np.ndarray]:
    """``safetensors.numpy.load``: ``{name: np.ndarray}`` from a checkpoint's bytes (any buffer)."""
    with safe_open(memoryview(data), framework="numpy") as f:
        return f.get_tensors()


def load_file(filename: str | os.PathLike, *, backend: str | None = None, **options: Any) -> dict[str, np.ndarray]:
    """``safetensors.numpy.load_file``: ``{name: np.ndarray}``. ``backend``: "auto", "pread", "mmap" or
    "direct" (None: the library's choice); other options as for ``foxhunt_stream.load_file``."""
    return api.load_file(filename, device="cpu", framework="numpy", backend=backend, **options)
