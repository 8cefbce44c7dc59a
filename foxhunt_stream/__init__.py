"""foxhunt_stream: restore safetensors checkpoints into GPU memory at the speed of the hardware,
and write them back just as fast.

    import foxhunt_stream as fs
    tensors = fs.load_file("model.safetensors", device="cuda:0", framework="pt")
    fs.save_file(tensors, "copy.safetensors")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import (CancelledError, ChecksumError, DeviceError, DeviceOutOfMemoryError, FormatError,
                     SafetensorError, StoreMismatchError)

__version__ = "0.1.0"

# Everything else loads on first use (PEP 562): ``import foxhunt_stream`` imports neither numpy,
# torch nor cupy. Name -> the module that defines it.
_LAZY = {
    "read_header": "io.checkpoint", "DistributedLoadError": "distributed.load", "VerifyReport": "integrity.verify",
    "verify": "integrity.verify", "LoadHandle": "engine.handle", "LoadIntoWarning": "engine.loader",
    "load_file": "api", "load_into": "engine.loader", "safe_open": "engine.safe_open",
    "PrefetchHandle": "startup.prefetch", "prefetch": "startup.prefetch", "warmup": "startup.warmup",
    "WarmupHandle": "startup.warmup", "record_imports": "startup.importtrace", "save_file": "engine.saver",
    "Shard": "format.tp", "TPSlice": "format.tp", "clean_stale_temps": "io.sink", "TensorSpec": "engine.serialize",
    "serialize": "engine.serialize", "serialize_file": "engine.serialize", "deserialize": "engine.serialize",
    # safetensors exports this one under a private-looking name: public API there, and here
    "_safe_open_handle": "engine.safe_open:safe_open_handle",
}

__all__ = [
    "SafetensorError", "FormatError", "DeviceError", "CancelledError", "DeviceOutOfMemoryError", "StoreMismatchError", "LoadIntoWarning",
    "TensorSpec", "serialize", "serialize_file", "deserialize",
    "safe_open", "load_file", "load_into", "save_file", "TPSlice", "Shard", "LoadHandle", "read_header", "clean_stale_temps",
    "settings", "__version__", "prefetch", "PrefetchHandle", "warmup", "ChecksumError", "verify", "VerifyReport",
    "DistributedLoadError", "WarmupHandle", "record_imports",
]

if TYPE_CHECKING:   # what static tools see; at run time these load lazily
    from . import settings
    from .io.checkpoint import read_header
    from .distributed.load import DistributedLoadError
    from .api import load_file
    from .engine.handle import LoadHandle
    from .engine.loader import LoadIntoWarning, load_into
    from .engine.safe_open import safe_open
    from .integrity.verify import VerifyReport, verify
    from .startup.importtrace import record_imports
    from .startup.prefetch import PrefetchHandle, prefetch
    from .startup.warmup import WarmupHandle, warmup
    from .engine.saver import save_file
    from .engine.serialize import TensorSpec, deserialize, serialize, serialize_file
    from .format.tp import Shard, TPSlice
    from .io.sink import clean_stale_temps


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is not None:
        module, _, attr = module.partition(":")   # "module:attr" where the names differ
        from .collector import paused   # a first load's imports: no collection (see collector)
        with paused():
            value = getattr(importlib.import_module(f".{module}", __name__), attr or name)
        globals()[name] = value   # next time: a plain attribute
        return value
    if not name.startswith("_"):
        # submodules (``fs.settings``...); ``fs.torch`` imports torch, so it too loads only when asked for
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
