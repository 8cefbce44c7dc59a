"""Which files a load reads through the page cache, leaving them there for the next start, and
which around it, with O_DIRECT.

Reading through the cache is what makes a restart hot. On an H200 machine (16 vCPU) a load from
the page cache runs at 44-49 GB/s, against about 2 GB/s from its disk, and bypassing the cache
buys nothing cold there (buffered 1.84, O_DIRECT 1.85 GB/s).

O_DIRECT is for a checkpoint that would not stay in the cache:
- One larger than the memory the kernel can give it evicts its own first files before the load
  ends, pushing everything else out on the way, and the next start reads it all from disk again.
  On a 2-vCPU KVM guest, 28 GiB read through 22 GB of available memory left the first 12 files
  wholly evicted.
- One that only just fits is evicted in part by what the server allocates after the load. On the
  same guest, an 8 GiB allocation after the load evicted 6.4 of 15 GiB cached, against 2.4 of
  9 GiB.

So a file is read through the cache while the bytes the load takes from the cache stay within
``KEEP_FRACTION`` of the memory available, with those already resident counted first. The memory
available is ``MemAvailable``, which counts the page cache as available, capped by the headroom
under the process's cgroup limit. Half of it leaves as much again for what comes after the load.
The files beyond the budget are read with O_DIRECT. A file that is mostly resident already is
always read through the cache: there is nothing to gain by bypassing it.
"""

from __future__ import annotations

import os
from typing import Sequence

from . import pagecache

KEEP_FRACTION = 0.5      # of the memory available: the most a load leaves in the page cache
MOSTLY_RESIDENT = 0.5    # a file this much in the cache already is read through it, whatever the budget
UNLIMITED = 1 << 60      # cgroup v1 writes "no limit" as a number near 2**63


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
    """Pure: the memory a cgroup's limit leaves its processes, page cache included: the limit,
    minus the usage, plus the cgroup's own page cache. The cache is counted in the usage but
    can be reclaimed. The inputs are the texts of ``memory.max``, ``memory.current`` and
    ``memory.stat`` (v2), or ``memory.limit_in_bytes``, ``memory.usage_in_bytes`` and
    ``memory.stat`` (v1). Returns None for no limit."""
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
    """The memory cgroup directories that may hold this process's limit, with the names of
    their limit, usage and stat files. Inside a container the cgroup path in /proc/self/cgroup
    may not exist under /sys/fs/cgroup, whose root is then the container's own cgroup."""
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
    headroom under this process's memory cgroup limit; None where neither can be read."""
    avail = _mem_available()
    head = _cgroup_headroom()
    if head is None:
        return avail
    return head if avail is None else min(avail, head)


def read_through_cache(paths: Sequence[str], needs: Sequence[int]) -> list[bool]:
    """Per file of a load (in load order), whether to read it through the page cache:
    ``keep_in_cache`` on the files' residency and the memory available now."""
    resident = [pagecache.resident_fraction(p) for p in paths]
    if all(r >= MOSTLY_RESIDENT for r in resident):   # a hot load: no budget to ask the system about
        return [True] * len(resident)
    return keep_in_cache(needs, resident, available_memory())
