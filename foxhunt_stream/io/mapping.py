"""A read-only mapping of a whole file, out of which strided runs are gathered.

A column slice ``x[:, a:b]`` is thousands of short rows: positional reads copy every covered byte, a
gather out of a mapping only the rows' pages (``touched_bytes``). Unmapping undoes every page a
gather faulted in (tens of ms), so used mappings are unmapped off the load's path (``_unmap_pending``).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
import weakref
from collections import deque
from typing import TYPE_CHECKING, Iterator

from .libc import MAP_FAILED, libc

if TYPE_CHECKING:   # numpy is imported where it is used: a prefetch starts its code readers first
    import numpy as np

    from ..format.indexing import Run

PAGE = mmap.PAGESIZE
DONTNEED = getattr(mmap, "MADV_DONTNEED", None)   # Linux and most Unixes

_unmapping: set[threading.Thread] = set()
_unmapping_lock = threading.Lock()


def touched_bytes(run: "Run", page: int = PAGE) -> int:
    """The bytes of the ``page``-sized file pages holding at least one byte of the run's rows, clipped
    to the run's span. A row's new pages depend only on where it starts within a page, which repeats
    every ``page / gcd(pitch, page)`` rows: one period is counted, not every row."""
    if run.width <= 0 or run.height <= 0:
        return 0
    src, pitch, width = run.src, run.pitch, run.width
    pages = (src + width - 1) // page - src // page + 1

    def added(rows: range) -> int:   # pages of these rows that no row before them touches
        total = 0
        for r in rows:
            start = src + r * pitch
            last = (start + width - 1) // page
            fresh = max(start // page, (start - pitch + width - 1) // page + 1)   # past the previous row's
            if last >= fresh:
                total += last - fresh + 1
        return total
    if run.height > 1:
        period = page // math.gcd(pitch, page)
        full, rest = divmod(run.height - 1, period)     # the rows after the first
        if full:
            pages += full * added(range(1, period + 1))
        pages += added(range(full * period + 1, full * period + rest + 1))
    return pages * page - src % page - (-(src + run.span)) % page


def page_extents(run: "Run", page: int = PAGE) -> Iterator[tuple[int, int]]:
    """What ``touched_bytes`` counts, as ``(offset, length)`` extents in file order (one step per
    row: for the fault hook and tests)."""
    lo = hi = -1
    end = run.src + run.span
    for r in range(run.height if run.width > 0 else 0):
        start = run.src + r * run.pitch
        a = max(run.src, start // page * page)
        b = min(end, -(-(start + run.width) // page) * page)
        if a <= hi:
            hi = max(hi, b)
            continue
        if hi >= 0:
            yield lo, hi - lo
        lo, hi = a, b
    if hi >= 0:
        yield lo, hi - lo


class FileMap:
    """``size`` bytes of ``fd`` mapped shared and read-only, through libc rather than Python's ``mmap``,
    whose ``close`` holds the GIL through the munmap (22 ms of the load's caller after a TP=8 shard).
    Views hold its buffer: the munmap runs when the last of them (or the map) is gone."""

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self._state = [False]   # used: the finalizer reads it after this object is gone
        self._buf = None
        if size:
            addr = _libc_map(fd, size)
            self._buf = (ctypes.c_char * size).from_address(addr)
            done = weakref.finalize(self._buf, _release, addr, size, self._state)
            done.atexit = False   # the process's exit unmaps everything anyway

    @property
    def used(self) -> bool:
        return self._state[0]

    def _view(self, shape, offset: int, strides=None) -> "np.ndarray":
        import numpy as np
        if self._buf is None:
            raise ValueError("the mapping is closed" if self.size else "nothing is mapped (an empty file)")
        self._state[0] = True
        out = np.ndarray(shape, np.uint8, buffer=self._buf, offset=offset, strides=strides)
        out.flags.writeable = False   # PROT_READ: a write would be a SIGSEGV, not an error
        return out

    def rows(self, run: "Run") -> "np.ndarray":
        """The run's rows as a read-only (height, width) view into the mapping; no byte is touched
        yet. numpy refuses a view that would reach past the mapping."""
        return self._view((run.height, run.width), run.src, (run.pitch, 1))

    def bytes(self, offset: int, length: int) -> "np.ndarray":
        """``[offset, offset+length)`` as a read-only view into the mapping."""
        return self._view((length,), offset)

    def close(self) -> None:
        """Drop the mapping: unmapped once no view of it is left (module doc)."""
        self._buf = None


_lib = libc   # the calls go through this name (tests stand in for libc here)


def _libc_map(fd: int, size: int) -> int:
    """mmap(PROT_READ, MAP_SHARED) of the whole file; OSError when the kernel refuses."""
    addr = _lib().mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == MAP_FAILED:
        e = ctypes.get_errno()
        raise OSError(e, f"mmap of {size} bytes failed: {os.strerror(e)}")
    return addr


# a used mapping's pages are dropped this many bytes at a time before the munmap (module doc)
DROP_BYTES = 64 << 20
_pending: deque[tuple[int, int]] = deque()   # (address, size) of used mappings waiting to be unmapped
_unmapper: threading.Thread | None = None    # the thread unmapping them, while there is one


def _release(addr: int, size: int, state: list) -> None:
    """The last reference to a mapping is gone: unmap it at once when nothing was touched (no
    page is mapped: cheap), else hand it to the unmapping thread, off the load's path."""
    global _unmapper
    if not state[0]:
        _lib().munmap(addr, size)
        return
    with _unmapping_lock:
        _pending.append((addr, size))
        if _unmapper is not None:
            return
        _unmapper = t = threading.Thread(target=_unmap_pending, name="foxhunt-unmap", daemon=True)
        _unmapping.difference_update([u for u in _unmapping if not u.is_alive()])   # joined by nobody
        _unmapping.add(t)
    t.start()


def _unmap_pending() -> None:
    """Unmap the used mappings handed over until none is left, their pages dropped first
    (MADV_DONTNEED) ``DROP_BYTES`` at a time, so that the munmap's hold of the memory-map lock does not
    stall every thread that maps memory."""
    global _unmapper
    lib = _lib()
    while True:
        with _unmapping_lock:
            if not _pending:
                _unmapper = None   # stays in _unmapping until seen dead: wait_unmapped joins it
                return
            addr, size = _pending.popleft()
        if DONTNEED is not None:
            for off in range(0, size, DROP_BYTES):
                lib.madvise(addr + off, min(DROP_BYTES, size - off), DONTNEED)
        lib.munmap(addr, size)


def wait_unmapped(timeout: float | None = None) -> bool:
    """Wait until the mappings handed to background threads are gone (False if some are left
    after ``timeout`` seconds): a timed round must not pay for the round before."""
    with _unmapping_lock:
        threads = list(_unmapping)
    for t in threads:
        t.join(timeout)
    with _unmapping_lock:
        _unmapping.difference_update([t for t in threads if not t.is_alive()])
    return not any(t.is_alive() for t in threads)

