"""torch front end: drop-ins for ``safetensors.torch`` (``load_file``, ``save_file``,
``load_model``, ``save_model``), same signatures, plus ``materialize`` for meta-built modules.

``load_model`` differs from the reference in where the bytes go: instead of loading a second
copy of every tensor and handing it to ``load_state_dict``, it passes the module's own
parameters and buffers to ``load_into`` as the destination, so the weights land in place (on
whatever device each tensor lives) with no second allocation. Only tensors that cannot take the
bytes as they are - another dtype (cast, as ``load_state_dict`` does), non-contiguous, a device
the pipeline does not write to, or a state-dict entry that is not a parameter or buffer of the
module - go through a temporary and ``load_state_dict``.

Shared (tied) tensors follow the reference rules exactly: ``save_model`` keeps one name per
shared storage and records the dropped ones in the metadata; ``load_model`` fills the kept name
and reports the others neither missing nor (unless the file has them) unexpected.

Importing this module imports torch. The machinery is in ``models.torch_load`` and
``models.torch_state``; this module is the drop-in surface.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

from . import api
from .models.torch_load import LoadModelError, StreamedLoad, load_model
from .models.torch_state import MaterializeWarning, materialize, shared_aliases

__all__ = ["load_file", "save_file", "load_model", "save_model", "materialize", "shared_aliases", "LoadModelError",
           "MaterializeWarning", "StreamedLoad"]


def load_file(filename: str | os.PathLike, device: str | int = "cpu", **options) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load_file``: ``{name: torch.Tensor}`` on ``device``.

    Also takes a list of files, an index.json or a directory, and the loader's options
    (``names``, ``background``, ``threads``, ``backend``, ``device_map`` for several GPUs...).
    """
    return api.load_file(filename, device=device, framework="pt", **options)


def save_file(tensors: Mapping[str, torch.Tensor], filename: str | os.PathLike,
              metadata: Mapping[str, str] | None = None, **options) -> None:
    """``safetensors.torch.save_file``: byte-identical output, written atomically."""
    from .engine import saver as _saver  # imported by saves only
    _saver.save_file(tensors, filename, metadata=metadata, **options)


def save_model(model: torch.nn.Module, filename: str | os.PathLike, metadata: Mapping[str, str] | None = None,
               force_contiguous: bool = True, **options) -> None:
    """``safetensors.torch.save_model``: the state dict with one name per shared storage (each
    dropped name recorded in the metadata as ``{dropped: kept}``); byte-identical to the reference.

    ``force_contiguous`` is accepted for compatibility: non-contiguous tensors are always saved
    (row by row), never copied whole.
    """
    state = model.state_dict()
    meta = dict(metadata) if metadata is not None else None
    for kept, dropped in shared_aliases(state).items():
        for name in dropped:
            if meta is None:
                meta = {}
            meta.setdefault(name, kept)
            del state[name]
    from .engine import saver as _saver
    _saver.save_file(state, filename, metadata=meta, **options)
