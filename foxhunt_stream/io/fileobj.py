"""Checkpoints given as Python objects, as ``safetensors.safe_open`` takes them: a file object with a
descriptor is read through its file (its ``name``, else ``/proc/self/fd/N``), one without by
``seek``/``read`` under a lock; a ``memoryview`` or ``bytearray`` is read in place.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from ..errors import FormatError
from .checkpoint import Checkpoint
from .memory import MemorySource, read_header_from


def is_object_source(x: Any) -> bool:
    """What this module opens: a file object, a memoryview or a bytearray."""
    if isinstance(x, (memoryview, bytearray)):
        return True
    return hasattr(x, "read") and not isinstance(x, (str, bytes, os.PathLike))


def descriptor_path(f: Any) -> str | None:
    """A path that opens the file behind ``f``'s descriptor, or None when ``f`` has none."""
    try:
        fd = f.fileno()
    except (AttributeError, OSError, ValueError):   # io.UnsupportedOperation is both of the last two
        return None
    if not isinstance(fd, int) or fd < 0:
        return None
    try:
        f.flush()   # bytes written through f but still in its buffer belong to the file we read
    except (AttributeError, OSError, ValueError):
        pass
    st = os.fstat(fd)
    name = getattr(f, "name", None)
    if isinstance(name, (str, bytes, os.PathLike)):
        try:
            if os.path.samestat(os.stat(name), st):
                return os.fsdecode(name)
        except OSError:
            pass
    for fd_dir in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(fd_dir):
            return f"{fd_dir}/{fd}"
    return None


class StreamSource(MemorySource):
    """The source interface over a file object without a descriptor: ``seek`` and ``read`` under
    a lock, only the bytes asked for. The file object stays the caller's (never closed here)."""

    backend = "stream"

    def __init__(self, f: Any, size: int, label: str) -> None:
        self.path = label
        self._f = f
        self._size = size
        self._lock = threading.Lock()
        self.bytes_read = 0

    def size(self) -> int:
        return self._size

    def read_into(self, out: np.ndarray, offset: int) -> None:
        want = out.nbytes
        view = memoryview(out.reshape(-1)).cast("B")
        got = 0
        with self._lock:
            self._f.seek(offset)
            while got < want:
                data = self._f.read(want - got)
                if not data:
                    break
                view[got:got + len(data)] = data
                got += len(data)
        if got < want:
            raise FormatError("file-truncated", f"read of {want} bytes at offset {offset} returned only {got}",
                              path=self.path)
        self.bytes_read += want

    gathers = False

    def gather(self, run, out: np.ndarray) -> bool:
        return False   # rows come one read at a time; the target reads the span instead

    def close(self) -> None:
        self._f = None


def _label(x: Any) -> str:
    name = getattr(x, "name", None)
    if isinstance(name, (str, bytes)):
        return os.fsdecode(name)
    return "<bytes>" if isinstance(x, (memoryview, bytearray)) else f"<{type(x).__name__}>"


def open_object(x: Any) -> str | tuple[Checkpoint, list[MemorySource]]:
    """A file object or a buffer as a checkpoint: the path behind its descriptor, or (checkpoint, [source])."""
    if not isinstance(x, (memoryview, bytearray)):
        path = descriptor_path(x)
        if path is not None:
            return path
    label = _label(x)
    if isinstance(x, (memoryview, bytearray)):
        src: MemorySource = MemorySource(x, label)
    elif hasattr(x, "getbuffer"):   # io.BytesIO: its own buffer, in place
        src = MemorySource(x.getbuffer(), label)
    elif hasattr(x, "seek") and getattr(x, "seekable", lambda: True)():
        src = StreamSource(x, x.seek(0, os.SEEK_END), label)
    else:   # nothing to seek in: the whole of it, once
        src = MemorySource(x.read(), label)
    header = read_header_from(src)
    return Checkpoint([label], [header], {t.name: (0, t) for t in header.tensors}), [src]
