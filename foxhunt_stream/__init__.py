"""foxhunt_stream: restore safetensors checkpoints into GPU memory at the speed of the hardware,
and write them back just as fast.

    import foxhunt_stream as fs
    tensors = fs.load_file("model.safetensors", device="cuda:0", framework="pt")
    fs.save_file(tensors, "copy.safetensors")
"""

from . import settings
from .checkpoint import read_header
from .device import DeviceError
from .distributed import DistributedLoadError
from .errors import ChecksumError, DeviceOutOfMemoryError, FormatError, StoreMismatchError
from .integrity import VerifyReport, verify
from .loader import LoadHandle, LoadIntoWarning, load_file, load_into, safe_open
from .prefetch import PrefetchHandle, prefetch, warmup
from .saver import save_file
from .shard import Shard
from .sink import clean_stale_temps

__version__ = "0.1.0"

__all__ = [
    "FormatError", "DeviceError", "DeviceOutOfMemoryError", "StoreMismatchError", "LoadIntoWarning",
    "safe_open", "load_file", "load_into", "save_file", "Shard", "LoadHandle", "read_header", "clean_stale_temps",
    "settings", "__version__", "prefetch", "PrefetchHandle", "warmup", "ChecksumError", "verify", "VerifyReport",
    "DistributedLoadError",
]


def __getattr__(name: str):
    # ``fs.torch`` (the safetensors.torch drop-ins) imports torch, so only on first use:
    # ``import foxhunt_stream`` itself stays light (no torch, no cupy).
    if name == "torch":
        import importlib
        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
