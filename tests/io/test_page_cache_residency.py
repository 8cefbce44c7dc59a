"""Page-cache residency (direct_io="auto" and prefetch decide with it)."""

import ctypes
import errno
import os

import numpy as np
import pytest

from foxhunt_stream.io import pagecache
from foxhunt_stream.io.libc import libc
from page_cache_support import evict


def test_resident_fraction_sampled_and_exhaustive(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8).tobytes())
    p.read_bytes()
    assert pagecache.resident_fraction(p) == 1.0
    assert pagecache.resident_fraction(p, samples=1 << 62) == 1.0     # "every page": one call, not 2**62
    evict(p)
    assert pagecache.resident_fraction(p) < 0.5
    assert pagecache.resident_fraction(p, samples=1 << 62) < 0.5


def _half_cached(tmp_path):
    """A 4 MiB file with its first half in the page cache and the second half not."""
    p = tmp_path / "half.bin"
    p.write_bytes(np.random.default_rng(1).integers(0, 255, 4 << 20, dtype=np.uint8).tobytes())
    evict(p)
    with open(p, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)   # no readahead past what is read
        f.read(2 << 20)
    return p


def _every_page(p) -> float:
    fd = os.open(p, os.O_RDONLY)
    try:
        return pagecache._mincore_sample(fd, os.path.getsize(p), 1 << 62)
    finally:
        os.close(fd)


def test_residency_is_counted_by_the_kernel_without_mapping_the_file(tmp_path, monkeypatch):
    # a mapping (and its unmapping) waits on the memory map's lock, which pinning staging
    # memory beside a load holds: the count takes none
    p = _half_cached(tmp_path)
    exact = _every_page(p)
    assert 0.3 < exact < 0.7
    lib = libc()
    monkeypatch.setattr(lib, "mmap", lambda *a: pytest.fail("resident_fraction mapped the file"))
    assert pagecache._cachestat_works
    assert pagecache.resident_fraction(p) == pytest.approx(exact, abs=1 / 1024)


def test_where_the_kernel_refuses_the_count_a_sample_says_the_same(tmp_path, monkeypatch):
    p = _half_cached(tmp_path)
    exact = _every_page(p)
    lib = libc()
    calls = []

    def refused(*args):
        calls.append(args[0])
        ctypes.set_errno(errno.ENOSYS)
        return -1
    monkeypatch.setattr(lib, "syscall", refused)
    monkeypatch.setattr(pagecache, "_cachestat_works", True)
    assert pagecache.resident_fraction(p, samples=1 << 62) == pytest.approx(exact)
    assert abs(pagecache.resident_fraction(p) - exact) < 0.2   # 64 pages sampled
    assert calls == [pagecache._CACHESTAT]   # asked once: then the sample only
    assert not pagecache._cachestat_works


def test_a_big_file_is_counted_in_runs_not_page_by_page(tmp_path, monkeypatch):
    # the kernel's count walks every page of its range: a whole 2 GB file took 15 ms, so a
    # default sample counts runs of pages spread over the file, and only a sample asked to see
    # every page counts them all
    p = tmp_path / "big.bin"
    p.write_bytes(np.random.default_rng(2).integers(0, 255, 16 << 20, dtype=np.uint8).tobytes())
    evict(p)
    with open(p, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        f.read(8 << 20)   # the first half
    exact = _every_page(p)
    assert 0.4 < exact < 0.6
    lib, real = libc(), libc().syscall
    lengths = []

    def counting(nr, fd, span, stat, flags):
        lengths.append(ctypes.cast(span, ctypes.POINTER(pagecache._CachestatRange)).contents.len)
        return real(nr, fd, span, stat, flags)
    monkeypatch.setattr(lib, "syscall", counting)
    assert abs(pagecache.resident_fraction(p) - exact) < 0.1
    page = os.sysconf("SC_PAGE_SIZE")
    assert len(lengths) == 64 // pagecache.SAMPLE_RUN
    assert set(lengths) == {pagecache.COUNT_RUN * page}   # 1024 of the 4096 pages counted
    lengths.clear()
    assert pagecache.resident_fraction(p, samples=1 << 62) == pytest.approx(exact)
    assert lengths == [0]   # every page: one call over the whole file
