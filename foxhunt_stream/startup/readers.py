"""The page-cache reader: ``read_range`` serves the checkpoint's readers (``PieceReaders``, here or
in the helper process) and the code files', one ``FileSource.fill_cache`` per step. No numpy: the
code readers start before the caller has imported it.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from typing import Callable, Iterable, Mapping, NamedTuple

from ..errors import CancelledError, FormatError
from ..io.pagecache import advise
from ..io.source import FileSource
from .importtrace import unwatch_this_thread

READ_BYTES = 1 << 20   # a reader's scratch buffer, where sendfile cannot fill the cache

_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}
_SYS_IOPRIO_GET = {"x86_64": 252, "aarch64": 31}
_IOPRIO_WHO_PROCESS, _IOPRIO_CLASS_IDLE, _IOPRIO_CLASS_SHIFT = 1, 3, 13


class Piece(NamedTuple):
    """One unit of a reader's work: ``length`` bytes at ``offset`` of file number ``file``."""
    file: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


def _ioprio(table: dict[str, int], *args: int) -> int | None:
    """An ``ioprio_get``/``ioprio_set`` syscall for the calling thread; None where unsupported."""
    import ctypes
    import platform
    nr = table.get(platform.machine())
    if nr is None or not hasattr(os, "sched_getaffinity"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(nr, _IOPRIO_WHO_PROCESS, threading.get_native_id(), *args)
    except (OSError, AttributeError):
        return None


def set_idle_io_priority() -> bool:
    """Put the calling thread's disk reads in the idle I/O class (served only when nobody else's
    reads wait, so a prefetch does not slow the imports); False where unsupported."""
    return set_io_priority(_IOPRIO_CLASS_IDLE << _IOPRIO_CLASS_SHIFT)


def io_priority() -> int | None:
    """The calling thread's I/O priority (``ioprio_get``), None where unsupported."""
    got = _ioprio(_SYS_IOPRIO_GET)
    return None if got is None or got < 0 else got


def set_io_priority(value: int) -> bool:
    """Set the calling thread's I/O priority (a value ``io_priority`` returned)."""
    return _ioprio(_SYS_IOPRIO_SET, value) == 0


class Pacer:
    """Spaces reads to at most ``rate`` bytes per second until ``release()``: ``take(n)`` blocks."""

    def __init__(self, rate: float | None, clock=time.monotonic) -> None:
        if rate is not None and (isinstance(rate, bool) or not rate > 0):
            raise ValueError(f"max_rate must be a positive number of bytes per second, got {rate!r}")
        self.rate = rate
        self._clock = clock
        self._next = clock()
        self._lock = threading.Lock()
        self._released = threading.Event()
        if rate is None:
            self._released.set()

    def take(self, n: int) -> None:
        if self._released.is_set():
            return
        with self._lock:
            now = self._clock()
            start = max(now, self._next)
            self._next = start + n / self.rate
        if start > now:
            self._released.wait(start - now)

    def release(self) -> None:
        self._released.set()

    @property
    def released(self) -> bool:
        return self._released.is_set()


def scratch_buffer(nbytes: int = READ_BYTES) -> memoryview:
    """A writable buffer for the reads ``sendfile`` cannot do: an anonymous mapping (pages on use)."""
    return memoryview(mmap.mmap(-1, nbytes))


def advise_all(sources: Iterable[FileSource], advice: str) -> None:
    """``posix_fadvise(advice)`` on the whole of every source (a hint)."""
    for src in sources:
        advise(src.fd, advice)


def _never() -> bool:
    return False


def read_range(src: FileSource, offset: int, length: int, scratch: memoryview, *,
               step: Callable[[], int] | None = None, pacer: Pacer | None = None,
               cancelled: Callable[[], bool] = _never, copy: Callable[[], bool] = _never,
               hint: bool = False, hint_only: bool = False, best_effort: bool = False,
               count: bool = True) -> bool:
    """Bring ``[offset, offset + length)`` of ``src`` into the page cache, one ``fill_cache`` call
    per ``step()`` bytes (None: the whole range), each cleared by ``pacer``; ``cancelled()`` true
    at any step: stop, return False. ``copy()``: this step through ``scratch``. ``hint``: a
    ``WILLNEED`` hint first (``hint_only``: nothing more). ``best_effort``: a failed read ends the
    range quietly. ``count=False``: not counted as read. True when the range was done."""
    if cancelled():
        return False
    if hint or hint_only:
        advise(src.fd, "POSIX_FADV_WILLNEED", offset, length)
    if hint_only:
        return True
    end = offset + length
    try:
        while offset < end:
            if cancelled():
                return False
            n = end - offset if step is None else min(step(), end - offset)
            if pacer is not None:
                pacer.take(n)
                if cancelled():   # a cancel releases the pacer: the waiting readers stop, not read on
                    return False
            src.fill_cache(offset, n, scratch, copy=copy(), count=count)
            offset += n
    except (OSError, FormatError):
        if not best_effort:
            raise
    return True


class PieceReaders:
    """A prefetch's readers of its checkpoint's pieces: the ``setup`` and ``work`` of a
    ``pipeline.Job``, here or in the helper process. Until ``go_fast()`` (a load began):
    ``step``-byte steps paced at ``max_rate``, readahead off with ``no_readahead``, each step
    through a buffer with ``copy``; after it, ``fast_step``-byte steps, no pacing, readahead.
    ``idle``: the idle I/O class. ``hint``: a ``WILLNEED`` hint per piece (``hint_only``: only)."""

    def __init__(self, sources: Mapping[int, FileSource], cancelled: Callable[[], bool], *, step: int,
                 fast_step: int, idle: bool, hint: bool, hint_only: bool = False, no_readahead: bool = False,
                 copy: bool = False, max_rate: float | None = None) -> None:
        self.sources = sources
        self.pacer = Pacer(max_rate)
        self._cancelled = cancelled
        self._step, self._fast_step = step, fast_step
        self._idle, self._hint, self._hint_only = idle, hint, hint_only
        self._no_readahead, self._copy = no_readahead, copy
        self._fast = False
        self._scratch: dict[int, memoryview] = {}
        self._io_priority: dict[int, int | None] = {}

    def start(self) -> None:
        """Before the readers start: the files' readahead off (``no_readahead``)."""
        if self._no_readahead and not self._fast:
            advise_all(self.sources.values(), "POSIX_FADV_RANDOM")

    def step(self) -> int:
        """Bytes per ``fill_cache`` call now."""
        return self._fast_step if self._fast else self._step

    def copying(self) -> bool:
        return self._copy and not self._fast

    def go_fast(self) -> None:
        """A load of the files began: big steps, no pacing, readahead back on."""
        self._fast = True
        self.pacer.release()
        if self._no_readahead:
            advise_all(self.sources.values(), "POSIX_FADV_NORMAL")

    def setup(self, worker: int) -> None:
        unwatch_this_thread()   # a reader's opens are not the process's (import traces)
        if self._idle:
            self._io_priority[worker] = io_priority()
            set_idle_io_priority()
        if not self._hint_only:
            self._scratch[worker] = scratch_buffer(max(READ_BYTES, self._step) if self._copy else READ_BYTES)

    def teardown(self, worker: int) -> None:
        """The worker goes back to the pool at the I/O priority it came with (its next job may be a load)."""
        previous = self._io_priority.pop(worker, None)
        if previous is not None:
            set_io_priority(previous)

    def work(self, worker: int, piece: Piece) -> None:
        """Read one piece; Cancelled when the job was cancelled first (the piece did not land)."""
        if not read_range(self.sources[piece.file], piece.offset, piece.length, self._scratch.get(worker),
                          step=self.step, pacer=self.pacer, cancelled=self._cancelled, copy=self.copying,
                          hint=self._hint, hint_only=self._hint_only):
            raise CancelledError("cancelled")
