"""The optional packages a benchmark compares with or drives (safetensors, torch, the peer
loaders): found without failing where they are absent or broken. The loads themselves run in
new processes (``fresh``)."""

from __future__ import annotations

import importlib

from ..cuda.devices import Device

SAFETENSORS_HINT = "pip install safetensors (or the checkout's test extra: pip install -e '.[test]')"


def optional(module: str):
    """The module, or None when it is absent or its install is broken (a missing shared library)."""
    try:
        return importlib.import_module(module)
    except Exception:
        return None


def torch_cuda(device: Device):
    """torch when it can reach ``device`` (a GPU); None on the CPU, so CPU runs never import it."""
    if not device.is_cuda:
        return None
    torch = optional("torch")
    return torch if torch is not None and torch.cuda.is_available() else None
