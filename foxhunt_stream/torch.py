"""torch front end: drop-ins for ``safetensors.torch`` (same signatures), plus ``materialize``.

``load_model`` lands the weights in the module's own tensors (``load_into``); only tensors that
cannot take the bytes as they are go through ``load_state_dict``. Non-contiguous tensors are saved,
where safetensors refuses them. Imports torch; the machinery is in ``models.torch_*``.
"""

from __future__ import annotations

import os
from typing import Mapping

from .engine.frameworks import import_torch

import_torch()   # without torch: an error saying how to install it, not a bare ModuleNotFoundError

import torch  # noqa: E402

from . import api  # noqa: E402
from .engine.safe_open import safe_open  # noqa: E402
from .engine.serialize import TensorSpec, deserialize, serialize, serialize_file  # noqa: E402
from .format.dtypes import DTYPES  # noqa: E402
from .models.torch_load import LoadModelError, StreamedLoad, load_model  # noqa: E402
from .models.torch_state import (MaterializeWarning, check_savable, end_ptr, find_shared_tensors,  # noqa: E402
                                 is_complete, materialize, remove_duplicate_names, shared_aliases, storage_ptr,
                                 storage_size)

__all__ = ["load_file", "save_file", "load", "save", "load_model", "save_model", "storage_ptr", "storage_size",
           "materialize", "shared_aliases", "LoadModelError", "MaterializeWarning", "StreamedLoad", "safe_open",
           "TensorSpec", "serialize", "serialize_file", "deserialize"]

# safetensors.torch's helpers under its names: transformers, accelerate, vLLM... import them
_end_ptr = end_ptr
_find_shared_tensors = find_shared_tensors
_is_complete = is_complete
_remove_duplicate_names = remove_duplicate_names
# the format's dtype codes -> torch dtypes (callers add entries of their own), and bytes per element
_TYPES: dict[str, torch.dtype] = {d.name: getattr(torch, d.torch_name) for d in DTYPES.values()
                                  if d.torch_name and hasattr(torch, d.torch_name)}
_SIZE: dict[torch.dtype, int] = {t: t.itemsize for t in _TYPES.values()}


def _getdtype(dtype_str: str) -> torch.dtype:
    """The torch dtype of a format dtype code (``"BF16"`` -> ``torch.bfloat16``), from ``_TYPES``."""
    return _TYPES[dtype_str]


def load_file(filename: str | os.PathLike, device: str | int = "cpu", *, backend: str | None = None,
              **options) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load_file``: ``{name: torch.Tensor}`` on ``device``. Also takes a
    list of files, an index.json or a directory, and the loader's options; ``backend``: "auto"
    (None), "pread", "mmap" or "direct"."""
    return api.load_file(filename, device=device, framework="pt", backend=backend, **options)


def save_file(tensors: Mapping[str, torch.Tensor], filename: str | os.PathLike,
              metadata: Mapping[str, str] | None = None, **options) -> None:
    """``safetensors.torch.save_file``: byte-identical output, written atomically. Refuses what the
    reference refuses (``check_savable``) but non-contiguous tensors, which it saves."""
    check_savable(tensors)
    from .engine import saver as _saver  # imported by saves only
    _saver.save_file(tensors, filename, metadata=metadata, **options)


def save(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """``safetensors.torch.save``: the bytes ``save_file`` writes."""
    check_savable(tensors)
    from .engine import saver as _saver
    return _saver.save_bytes(tensors, metadata)


def load(data: bytes) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load``: ``{name: torch.Tensor}`` on the CPU from a checkpoint's bytes
    (any buffer)."""
    with safe_open(memoryview(data), framework="pt") as f:
        return f.get_tensors()


def save_model(model: torch.nn.Module, filename: str | os.PathLike, metadata: Mapping[str, str] | None = None,
               force_contiguous: bool = True, **options) -> None:
    """``safetensors.torch.save_model``: the state dict with one name per shared storage (each
    dropped name recorded in the metadata as ``{dropped: kept}``); byte-identical to the
    reference. ``force_contiguous`` is accepted: non-contiguous tensors are always saved."""
    state = model.state_dict()
    meta = dict(metadata) if metadata is not None else None
    for kept, dropped in remove_duplicate_names(state).items():
        for name in dropped:
            if meta is None:
                meta = {}
            meta.setdefault(name, kept)
            del state[name]
    check_savable(state)
    from .engine import saver as _saver
    _saver.save_file(state, filename, metadata=meta, **options)
