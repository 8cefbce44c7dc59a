"""Checkpoints in memory behind the loader's and saver's file interfaces: a source reading a buffer in
place, its validated header, and a sink writing into a bytearray.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import FormatError
from ..format.header import MAX_HEADER_SIZE, N_LEN, Header, parse_header, read_header_len


class MemorySource:
    """The source interface over bytes in memory: no descriptor (``fd = -1``), nothing to change."""

    backend = "memory"
    direct_reads = True   # reads land straight in any host buffer
    gathers = True        # a strided run's rows are packed in one copy (``gather``)
    identity = None
    fd = -1

    def __init__(self, data: Any, label: str = "<bytes>") -> None:
        self.path = label
        self._array = np.frombuffer(data, np.uint8)
        self.bytes_read = 0

    def size(self) -> int:
        return self._array.size

    def _span(self, offset: int, length: int) -> np.ndarray:
        if offset + length > self._array.size:
            raise FormatError("file-truncated", f"{length} bytes at offset {offset} run past the end of the "
                              f"{self._array.size}-byte buffer", path=self.path)
        self.bytes_read += length
        return self._array[offset:offset + length]

    def read_into(self, out: np.ndarray, offset: int) -> None:
        """Fill ``out`` (a contiguous uint8 array) with the bytes at ``offset``."""
        np.copyto(out.reshape(-1), self._span(offset, out.nbytes))

    def read_span(self, offset: int, length: int, scratch: np.ndarray) -> np.ndarray:
        """The bytes copied into ``scratch`` (a GPU target copies on from its pinned slot)."""
        view = scratch[:length]
        self.read_into(view, offset)
        return view

    def scratch_bytes(self, length: int) -> int:
        return length

    def gather(self, run, out: np.ndarray) -> bool:
        """The rows of a 2-D run packed into ``out`` in one strided copy."""
        span = self._span(run.src, run.span)
        rows = np.lib.stride_tricks.as_strided(span, (run.height, run.width), (run.pitch, 1), writeable=False)
        out[:run.nbytes].reshape(run.height, run.width)[...] = rows
        return True

    def check_unchanged(self, rule: str = "file-changed") -> None:
        """Bytes in memory are the ones whose header was read."""

    def close(self) -> None:
        self._array = np.empty(0, np.uint8)   # lets go of the caller's buffer


class MemorySink:
    """The sink interface of ``io.sink.AtomicFile`` over a bytearray of the planned size."""

    backend = "memory"

    def __init__(self, size: int) -> None:
        self.buffer = bytearray(size)
        self._view: np.ndarray | None = np.frombuffer(self.buffer, np.uint8)

    def write_at(self, data, offset: int) -> None:
        """Copy all of ``data`` (any contiguous buffer) to ``offset``."""
        src = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
        if offset + src.size > self._view.size:
            raise ValueError("write past the planned end of the buffer")
        self._view[offset:offset + src.size] = src

    def commit(self) -> None:
        self._view = None   # the buffer is complete; it may be handed out (and grow) now

    def abort(self) -> None:
        self._view = None


def read_header_from(src: MemorySource) -> Header:
    """Read and validate the header through a source that is not a file on disk."""
    size = src.size()
    try:
        prefix = np.empty(min(N_LEN, size), np.uint8)
        src.read_into(prefix, 0)
        n = read_header_len(prefix.tobytes(), size)
        body = np.empty(min(n, MAX_HEADER_SIZE), np.uint8)
        src.read_into(body, N_LEN)
        return parse_header(prefix.tobytes() + body.tobytes(), size)
    except FormatError as e:
        raise e.with_path(src.path) from None


def buffer_header(data: Any, label: str = "<bytes>") -> Header:
    """The validated header of a checkpoint held in a buffer."""
    return read_header_from(MemorySource(data, label))
