"""The page cache: what is resident (``resident_fraction``), filling it without a copy
(``sendfile_to_null``), ``posix_fadvise`` hints, and a registry through which a prefetch and a load
learn of each other without importing each other (``prefetching(path)``, ``loading(path)``).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import errno
import mmap
import os
import stat
import threading
import weakref
from typing import Protocol

from .libc import MAP_FAILED, libc

_devnull = -2   # not opened yet; -1: sendfile to /dev/null does not work here
_devnull_rdev = -1
_devnull_lock = threading.Lock()


def _null_fd() -> int:
    """Our descriptor of /dev/null, opened once, checked on each use (its number may be reused)."""
    global _devnull, _devnull_rdev
    fd = _devnull
    if fd >= 0:
        try:
            st = os.fstat(fd)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == _devnull_rdev:
                return fd
        except OSError:
            pass
    with _devnull_lock:   # reader threads arrive together: one descriptor, not one each
        if _devnull == fd:
            if not hasattr(os, "sendfile"):
                _devnull = -1
            else:
                try:
                    new = os.open(os.devnull, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
                    st = os.fstat(new)
                    _devnull, _devnull_rdev = (new, st.st_rdev) if stat.S_ISCHR(st.st_mode) else (-1, -1)
                    if _devnull < 0:
                        os.close(new)
                except OSError:
                    _devnull = -1
        return _devnull


def sendfile_to_null(fd: int, offset: int, length: int, step: int = 64 << 20) -> int | None:
    """Pull ``[offset, offset+length)`` of ``fd`` into the page cache with ``sendfile`` into
    ``/dev/null``, one call per ``step`` bytes, each releasing the GIL for all of it (per-MiB ``pread``s
    slowed ``stat``-heavy imports). Returns the bytes warmed (fewer at end of file or where ``sendfile``
    stopped), or None where ``sendfile`` cannot do this: read through a buffer then."""
    null = _null_fd() if _devnull != -1 else -1
    if null < 0:
        return None
    done = 0
    while done < length:
        try:
            n = os.sendfile(null, fd, offset + done, min(step, length - done))
        except OSError as e:
            if done:
                return done
            if e.errno in (errno.EINVAL, errno.ENOSYS, errno.ENOTSOCK, errno.EOPNOTSUPP):
                return None
            raise
        if n == 0:
            break
        done += n
    return done


def advise(fd: int, advice: str, offset: int = 0, length: int = 0) -> None:
    """``posix_fadvise(fd, offset, length, os.<advice>)``; a hint only (refused: nothing changes)."""
    try:
        os.posix_fadvise(fd, offset, length, getattr(os, advice))
    except (AttributeError, OSError, ValueError):
        pass


# ---------------------------------------------------------------- residency

SAMPLE_RUN = 4    # pages per mincore call when sampling
COUNT_RUN = 64    # pages per cachestat call when sampling (a call costs ~2 us, a page ~30 ns)
_RESIDENT_BITS = int.from_bytes(b"\x01" * SAMPLE_RUN, "little")   # bit 0 of each page's byte: resident

_snapshot: contextvars.ContextVar[dict | None] = contextvars.ContextVar("foxhunt_residency", default=None)


@contextlib.contextmanager
def residency_snapshot():
    """Within the block, each file is sampled once (a load's setup asks several times, 0.2-0.3 ms each)."""
    token = _snapshot.set({})
    try:
        yield
    finally:
        _snapshot.reset(token)


def resident_fraction(path: str | os.PathLike, samples: int = 64) -> float:
    """Fraction of the file's pages in the page cache, from runs of pages spread evenly over it:
    counted by the kernel (``cachestat``, ``COUNT_RUN`` pages a run), or where it lacks that, looked
    up through a mapping (``mincore``, ``SAMPLE_RUN`` pages a run); ``samples`` / ``SAMPLE_RUN`` runs,
    every page when they would cover the file. Inside ``residency_snapshot`` the first answer for
    a file is kept."""
    memo = _snapshot.get()
    if memo is None:
        return _sample_residency(path, samples)
    key = (os.fspath(path), samples)
    if key not in memo:
        memo[key] = _sample_residency(path, samples)
    return memo[key]


def _sample_residency(path: str | os.PathLike, samples: int) -> float:
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
        try:
            counted = _counted_fraction(fd, size, samples)
            return counted if counted is not None else _mincore_sample(fd, size, samples)
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        return 1.0


_CACHESTAT = 451        # the syscall's number (Linux >= 6.5, the same on every architecture)
_cachestat_works = True


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


def _counted_fraction(fd: int, size: int, samples: int) -> float | None:
    """The fraction of the sampled pages in the page cache, counted by the kernel (``cachestat``: no
    mapping, so no wait on the memory map's lock while staging is pinned beside the load); a run
    at a time, as the count walks every page of its range (15 ms for a whole 2 GB file); None
    where the kernel cannot count."""
    global _cachestat_works
    if not _cachestat_works:
        return None
    lib = libc()
    if not hasattr(lib, "syscall"):
        _cachestat_works = False
        return None
    page = mmap.PAGESIZE
    pages = -(-size // page)
    runs = -(-samples // SAMPLE_RUN)
    whole = runs * COUNT_RUN >= pages
    starts = [0] if whole else _run_starts(pages, runs, COUNT_RUN)
    length = 0 if whole else COUNT_RUN * page   # 0: to the end of the file
    span, stat_ = _CachestatRange(), (ctypes.c_uint64 * 5)()   # nr_cache, dirty, writeback, evicted, recent
    ref_span, ref_stat, cached = ctypes.byref(span), ctypes.byref(stat_), 0
    for p in starts:
        span.off, span.len = p * page, length
        if lib.syscall(_CACHESTAT, fd, ref_span, ref_stat, 0) != 0:
            if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):   # an older kernel, or a filter refusing it
                _cachestat_works = False
            return None
        cached += stat_[0]
    return min(1.0, cached / (pages if whole else len(starts) * COUNT_RUN))


def _run_starts(pages: int, runs: int, run: int) -> list[int]:
    """The first pages of ``runs`` runs of ``run`` pages spread evenly over ``pages`` (fewer where
    they meet)."""
    return sorted({min((i * pages) // runs, pages - run) for i in range(runs)})


def _mincore_sample(fd: int, size: int, samples: int) -> float:
    """``samples`` pages in runs of SAMPLE_RUN spread evenly, through a mapping (one mincore call a run)."""
    lib = libc()
    addr = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, MAP_FAILED):
        return 1.0
    try:
        page = mmap.PAGESIZE
        pages = -(-size // page)
        if samples >= pages or pages <= 2 * SAMPLE_RUN:   # every page: one call over the whole mapping
            vec = (ctypes.c_ubyte * pages)()
            if lib.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                return 1.0
            import numpy as np
            return float((np.frombuffer(vec, np.uint8) & 1).mean())
        # a call costs ~2 us of ctypes, the page lookups next to nothing
        runs = -(-samples // SAMPLE_RUN)
        starts = _run_starts(pages, runs, SAMPLE_RUN)
        vec = (ctypes.c_ubyte * SAMPLE_RUN)()
        ref, span, hits = ctypes.byref(vec), SAMPLE_RUN * page, 0
        for p in starts:
            if lib.mincore(addr + p * page, span, ref) != 0:
                return 1.0
            hits += (int.from_bytes(vec, "little") & _RESIDENT_BITS).bit_count()
        return hits / (len(starts) * SAMPLE_RUN)
    finally:
        lib.munmap(ctypes.c_void_p(addr), size)


# ---------------------------------------------------------------- prefetches in flight

class Prefetcher(Protocol):
    """What the registry needs of a running prefetch."""

    def covers(self, real_path: str) -> bool: ...
    def done(self) -> bool: ...
    def unthrottle(self) -> None: ...


_prefetchers: "weakref.WeakSet[Prefetcher]" = weakref.WeakSet()
_prefetchers_lock = threading.Lock()


def register_prefetch(prefetcher: Prefetcher) -> None:
    """A prefetch announces itself (held weakly: a forgotten handle drops out by itself)."""
    with _prefetchers_lock:
        _prefetchers.add(prefetcher)


def _prefetchers_of(path: str | os.PathLike) -> list[Prefetcher]:
    with _prefetchers_lock:
        live = list(_prefetchers)
    if not live:   # the usual case: no path to resolve
        return []
    real = os.path.realpath(path)
    return [w for w in live if w.covers(real)]


def prefetching(path: str | os.PathLike) -> bool:
    """Whether a prefetch of ``path`` is still running in this process."""
    return any(not w.done() for w in _prefetchers_of(path))


def loading(path: str | os.PathLike) -> None:
    """A load of ``path`` starts: the prefetches reading it drop their pacing."""
    for w in _prefetchers_of(path):
        w.unthrottle()
