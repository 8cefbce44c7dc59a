"""How each file of a load is read, decided once per load from one sample of its page-cache
residency and passed down as a ``ReadPolicy`` (docs/architecture.md, ``direct_io`` and ``backend``).

Through the page cache, which makes a restart hot, or around it with O_DIRECT for what would not
stay: with ``direct_io="auto"`` a file goes through the cache while what the load takes fits in
``KEEP_FRACTION`` of the available memory (resident files first); one a prefetch is filling, or
mostly resident, always does. A cached file with a column slice is mapped and gathered; a cold one
read in whole slots as sequential streams, each range passed through the cache once more.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, Collection, NamedTuple, Sequence

from . import pagecache
from .source import FileSource, open_source, stream_of

if TYPE_CHECKING:
    from ..settings import Settings

KEEP_FRACTION = 0.5      # of the memory available: the most a load leaves in the page cache
MOSTLY_RESIDENT = 0.5    # a file this much in the cache already is read through it, whatever the budget
UNLIMITED = 1 << 60      # cgroup v1 writes "no limit" as a number near 2**63
GATHER_RESIDENT = 0.9    # a file at least this much in the cache gathers its column slices out of a mapping
COLD_RESIDENT = 0.5      # a file read through the cache with less than this of it there comes from the disk
# Descriptors at most per load for a cold file's sequential streams (up to ``threads`` a file),
# which make the next start's reads faster than one descriptor per file (RESULTS.md).
STREAM_FDS = 256


class ReadPolicy(NamedTuple):
    """How one file of a load is read (module docstring), for the planner and ``open``."""
    size: int                 # the file's size when its header was read
    backend: str = "pread"    # "pread", "direct" (O_DIRECT) or "mmap" (every read a copy out of a mapping)
    gather: bool = False      # strided runs gathered row by row out of a mapping of the file
    from_disk: bool = False   # mostly not in the page cache: read in whole slots
    promote: bool = False     # read through the cache from the disk: each range passed through it once more
    streams: int = 1          # sequential streams, each through a descriptor of its own

    def stream(self, offset: int) -> int:
        """The stream that reads ``offset`` (as the source opened by ``open`` reads it)."""
        return stream_of(offset, self.size, self.streams)

    def open(self, path: str) -> FileSource:
        """The file's source, opened the way this policy says."""
        src = open_source(path, self.backend, self.size, gather=self.gather)
        if self.promote and src.backend == "pread":
            src.promote = True
        if self.streams > 1:
            src.read_in_streams(self.streams)
        return src


def decide(resident: Sequence[float], needs: Sequence[int], strided: Collection[int], prefetching: Sequence[bool],
           sizes: Sequence[int], s: "Settings", available: int | None = None, streams: bool = True) -> list[ReadPolicy]:
    """Pure: the policy of each file of a load, from its residency (a fraction), the bytes the
    load reads from it, whether it holds a column slice (``strided``: file indices) and whether a
    prefetch is filling it; ``available``: the memory available for the budget (None: unknown,
    everything through the cache); ``streams``: cold files may be read as several streams (a
    load awaited whole, whose workers take every stream's chunks in turn)."""
    n = len(resident)
    if s.direct_io == "on":
        through = [False] * n
    elif s.direct_io == "off":
        through = [True] * n
    elif all(r >= MOSTLY_RESIDENT for r in resident):   # a hot load: no budget to ask about
        through = [True] * n
    else:
        through = [keep or busy for keep, busy in zip(keep_in_cache(needs, resident, available), prefetching)]
    out = []
    for i in range(n):
        backend = s.backend if through[i] else "direct"
        if backend == "mmap":
            out.append(ReadPolicy(sizes[i], "mmap", gather=True))
        elif backend == "direct":
            out.append(ReadPolicy(sizes[i], "direct", from_disk=True))
        else:   # "pread", or "auto": positional reads, and gathers where that pays
            cold = resident[i] < COLD_RESIDENT
            gather = (backend == "auto" and i in strided and not prefetching[i] and resident[i] >= GATHER_RESIDENT)
            out.append(ReadPolicy(sizes[i], "pread", gather=gather, from_disk=cold, promote=cold))
    cold_files = sum(p.promote for p in out)
    per = min(s.threads, STREAM_FDS // cold_files) if streams and cold_files else 1
    if per >= 2:
        out = [ReadPolicy(p.size, p.backend, p.gather, p.from_disk, p.promote, per) if p.promote else p for p in out]
    return out


def read_policies(paths: Sequence[str], needs: Sequence[int] | Callable[[], Sequence[int]], strided: Collection[int],
                  sizes: Sequence[int], s: "Settings", streams: bool = True) -> list[ReadPolicy]:
    """``decide`` on what the system says now: each file's residency sampled once (``mincore``),
    whether a prefetch is filling it, and the memory available (asked only when a file is cold).
    ``needs`` may be a function: it is called only when the budget is (a cold file)."""
    resident = [pagecache.resident_fraction(p) for p in paths]
    busy = [pagecache.prefetching(p) for p in paths]
    cold = s.direct_io == "auto" and any(r < MOSTLY_RESIDENT for r in resident)
    if callable(needs):
        needs = needs() if cold else [0] * len(paths)
    return decide(resident, needs, strided, busy, sizes, s, available_memory() if cold else None, streams)


def keep_in_cache(needs: Sequence[int], resident: Sequence[float], available: int | None,
                  fraction: float = KEEP_FRACTION) -> list[bool]:
    """Pure: per file, whether the load reads it through the page cache.

    ``needs``: the bytes the load reads from each file, in load order. ``resident``: the fraction
    of each file in the cache now. ``available``: bytes of memory available, or None when unknown
    (then every file goes through the cache).
    """
    if available is None:
        return [True] * len(needs)
    keep = [r >= MOSTLY_RESIDENT for r in resident]
    used = sum(n for n, k in zip(needs, keep) if k)
    budget = fraction * available
    for i, n in enumerate(needs):
        if not keep[i] and used + n <= budget:
            keep[i] = True
            used += n
    return keep


def cgroup_headroom(limit: str, usage: str, stat: str) -> int | None:
    """Pure: the memory a cgroup's limit leaves its processes: the limit, minus the usage, plus the
    cgroup's own (reclaimable) page cache, from the texts of ``memory.max``, ``memory.current``,
    ``memory.stat`` (v2) or their v1 counterparts. None for no limit."""
    limit = limit.strip()
    if not limit or limit == "max" or int(limit) >= UNLIMITED:
        return None
    cache = 0
    for line in stat.splitlines():
        key, _, value = line.partition(" ")
        if key in ("file", "cache"):   # v2, v1
            cache = int(value)
    return max(0, int(limit) - int(usage) + cache)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_dirs() -> list[tuple[str, tuple[str, str, str]]]:
    """The memory cgroup directories that may hold this process's limit, with the names of their
    limit, usage and stat files (in a container, /sys/fs/cgroup may be its own cgroup)."""
    v2 = ("memory.max", "memory.current", "memory.stat")
    v1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat")
    out = []
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    out.append((os.path.join("/sys/fs/cgroup", path.lstrip("/")), v2))
                elif "memory" in controllers.split(","):
                    out.append((os.path.join("/sys/fs/cgroup/memory", path.lstrip("/")), v1))
    except (OSError, ValueError):
        pass
    return out + [("/sys/fs/cgroup", v2), ("/sys/fs/cgroup/memory", v1)]


def _cgroup_headroom() -> int | None:
    for directory, names in _cgroup_dirs():
        try:
            texts = []
            for name in names:
                with open(os.path.join(directory, name)) as f:
                    texts.append(f.read())
        except OSError:
            continue
        try:
            return cgroup_headroom(*texts)
        except ValueError:
            return None
    return None


def available_memory() -> int | None:
    """Bytes of memory the page cache could hold for a load: ``MemAvailable``, capped by the
    cgroup's headroom (None where neither can be read)."""
    avail = _mem_available()
    head = _cgroup_headroom()
    if head is None:
        return avail
    return head if avail is None else min(avail, head)


def read_through_cache(paths: Sequence[str], needs: Sequence[int]) -> list[bool]:
    """Per file (in load order), whether a load with ``direct_io="auto"`` reads it through the page
    cache: ``keep_in_cache`` on the files' residency and the memory available now (a prefetch
    asks this, to leave alone the files a load would read around the cache)."""
    resident = [pagecache.resident_fraction(p) for p in paths]
    if all(r >= MOSTLY_RESIDENT for r in resident):   # a hot load: no budget to ask the system about
        return [True] * len(resident)
    return keep_in_cache(needs, resident, available_memory())
