"""A read-only mapping of a whole file, out of which strided runs are gathered.

A column slice ``x[:, a:b]`` of a row-major tensor is thousands of short rows, ``pitch`` apart.
Positional reads cannot skip the gaps between them, so they copy every covered byte out of the
page cache; a strided numpy copy out of a mapping touches only the rows (and releases the GIL).

A load maps each file once, when its source opens, and its workers share the mapping. Never
per chunk: every ``munmap`` in a process with many threads interrupts each CPU running one of
them (a TLB shootdown). The first touch of each 64 KiB of a fresh mapping is a minor fault that
maps those pages (the kernel's fault-around), and unmapping undoes every page so mapped: about
75 ms per 3.9 GB on one CPU of the H200 machine. So a mapping that was used is unmapped on a
thread of its own once its source closes, off the load's path (``wait_unmapped`` waits for them).

What a gather counts as read is ``touched_bytes``: the bytes of the pages holding its rows.
"""

from __future__ import annotations

import math
import mmap
import threading
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:   # numpy is imported where it is used: a prefetch starts its code readers first
    import numpy as np

    from ..format.indexing import Run

PAGE = mmap.PAGESIZE

_unmapping: set[threading.Thread] = set()
_unmapping_lock = threading.Lock()


def touched_bytes(run: "Run", page: int = PAGE) -> int:
    """The bytes of the ``page``-sized file pages that hold at least one byte of the run's rows,
    clipped to the run's span (never more than a read of the whole span).

    The pages a row adds to those of the rows before it depend only on where it starts within a
    page, which repeats every ``page / gcd(pitch, page)`` rows: one period is counted, not every
    row (a TP shard's run has thousands).
    """
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
    """What ``touched_bytes`` counts, as ``(offset, length)`` extents in file order: whole pages
    clipped to the span, neighbours merged. One step per row: for the fault hook and tests."""
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
    """``size`` bytes of ``fd`` mapped shared and read-only."""

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        self.used = False

    def rows(self, run: "Run") -> "np.ndarray":
        """The run's rows as a read-only (height, width) view into the mapping; no byte is touched
        yet. numpy refuses a view that would reach past the mapping."""
        import numpy as np
        self.used = True
        return np.ndarray((run.height, run.width), np.uint8, buffer=self._map, offset=run.src,
                          strides=(run.pitch, 1))

    def bytes(self, offset: int, length: int) -> "np.ndarray":
        """``[offset, offset+length)`` as a read-only view into the mapping."""
        import numpy as np
        self.used = True
        return np.ndarray((length,), np.uint8, buffer=self._map, offset=offset)

    def close(self) -> None:
        """Unmap: at once when nothing was touched, else on a thread of its own (module doc)."""
        m, self._map = self._map, None
        if m is None:
            return
        if not self.used:
            _unmap(m)
            return
        t = threading.Thread(target=_unmap, args=(m,), name="foxhunt-unmap", daemon=True)
        with _unmapping_lock:
            _unmapping.add(t)
        t.start()


def _unmap(m: mmap.mmap) -> None:
    try:
        m.close()   # the munmap runs without the GIL
    except BufferError:   # a view of it is still alive somewhere: unmapped with the last one
        pass
    finally:
        with _unmapping_lock:
            _unmapping.discard(threading.current_thread())


def wait_unmapped(timeout: float | None = None) -> bool:
    """Wait until the mappings handed to background threads are gone; False if some are left
    after ``timeout`` seconds. For tests and benchmarks: a timed round must not pay for the
    unmapping of the round before."""
    with _unmapping_lock:
        threads = list(_unmapping)
    for t in threads:
        t.join(timeout)
    return not any(t.is_alive() for t in threads)
