"""Gathers of strided runs out of a file's mapping (io/mapping.py, FileSource with backend "auto").

What a gather counts as read is checked against a brute-force set of pages; the fault hook sees
exactly those bytes, as extents inside the run's span; a truncated file is a FormatError before
any copy; a used mapping is unmapped on a thread of its own after its source closes.
"""

from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from foxhunt_stream.errors import FormatError
from foxhunt_stream.format.indexing import Run
from foxhunt_stream.io import mapping, source
from foxhunt_stream.io.mapping import FileMap, page_extents, touched_bytes
from foxhunt_stream.io.source import open_source, total_bytes_read


def pages_of(run: Run, page: int) -> set[int]:
    """Every byte offset of every page a row touches, inside the run's span, one row at a time."""
    end = run.src + run.span
    out: set[int] = set()
    for r in range(run.height if run.width else 0):
        start = run.src + r * run.pitch
        for p in range(start // page, (start + run.width - 1) // page + 1):
            out.update(range(max(p * page, run.src), min((p + 1) * page, end)))
    return out


@st.composite
def strided_runs(draw):
    width = draw(st.integers(0, 200))
    height = draw(st.integers(0, 40))
    pitch = width + draw(st.integers(0, 300)) if height > 1 else width
    return Run(draw(st.integers(0, 5000)), pitch, width, height, 0)


@settings(max_examples=400, deadline=None)
@given(run=strided_runs(), page=st.sampled_from([1, 2, 8, 16, 64, 256]))
def test_touched_bytes_and_extents_are_the_pages_of_the_rows_inside_the_span(run, page):
    want = pages_of(run, page)
    assert touched_bytes(run, page) == len(want)
    extents = list(page_extents(run, page))
    covered = set()
    for off, n in extents:
        assert n > 0 and run.src <= off and off + n <= run.src + run.span
        covered.update(range(off, off + n))
    assert covered == want and sum(n for _, n in extents) == len(want)   # disjoint
    assert all(a + n < b for (a, n), (b, _) in zip(extents, extents[1:]))  # sorted, neighbours merged


@pytest.mark.parametrize("pitch", [28672, 28673, 28674, 8192 + 6])
def test_touched_bytes_of_long_runs_counts_periods_not_rows(pitch):
    run = Run(1000, pitch, 3584, 3000, 0)   # a TP=8 column slice of a down_proj-like tensor
    pages = {p for r in range(run.height)
             for p in range((run.src + r * pitch) // 4096, (run.src + r * pitch + run.width - 1) // 4096 + 1)}
    end = run.src + run.span
    assert touched_bytes(run, 4096) == len(pages) * 4096 - run.src % 4096 - (-end) % 4096
    assert touched_bytes(run, 4096) <= 2 * 4096 * run.height < run.span


@pytest.fixture
def wide(tmp_path):
    """A file holding a float32 [48, 8192] tensor after an unaligned 1000-byte prefix."""
    x = np.random.default_rng(0).standard_normal((48, 8192)).astype(np.float32)
    path = tmp_path / "wide.bin"
    path.write_bytes(b"h" * 1000 + x.tobytes())
    return path, x


def column_run(x: np.ndarray, a: int, b: int, base: int = 1000) -> Run:
    item = x.itemsize
    return Run(base + a * item, x.shape[1] * item, (b - a) * item, x.shape[0], 0)


def mapped_paths() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}


def test_gather_packs_the_rows_and_counts_the_pages_it_touches(wide):
    path, x = wide
    run = column_run(x, 1024, 2048)                     # 4 KiB of each 32 KiB row
    out = np.zeros(run.nbytes, np.uint8)
    before = total_bytes_read()
    with open_source(path, "auto") as src:
        assert src.gathers and src.backend == "auto"
        assert src.gather(run, out)
        counted = src.bytes_read
    np.testing.assert_array_equal(out.view(np.float32).reshape(48, 1024), x[:, 1024:2048])
    assert counted == touched_bytes(run) == len(pages_of(run, mapping.PAGE))
    assert total_bytes_read() - before == counted
    if mapping.PAGE == 4096:
        assert counted <= 2 * 4096 * 48 < run.span // 3     # one or two pages a row, of eight


def test_the_fault_hook_sees_the_touched_extents(wide, monkeypatch):
    path, x = wide
    run = column_run(x, 100, 300)
    seen = []
    lock = threading.Lock()

    def hook(src, off, n):
        with lock:
            seen.append((off, n))
    monkeypatch.setattr(source, "fault_hook", hook)
    with open_source(path, "auto") as src:
        src.gather(run, np.zeros(run.nbytes, np.uint8))
    assert seen == list(page_extents(run))
    assert sum(n for _, n in seen) == touched_bytes(run)


def test_a_short_or_failed_gather_is_an_error_naming_the_file(wide, monkeypatch):
    path, x = wide
    run = column_run(x, 0, 2000)
    monkeypatch.setattr(source, "fault_hook", lambda src, off, n: n - 1)
    with open_source(path, "auto") as src, pytest.raises(FormatError) as ei:
        src.gather(run, np.zeros(run.nbytes, np.uint8))
    assert ei.value.rule == "file-truncated" and ei.value.path == os.fspath(path)

    def eio(src, off, n):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(source, "fault_hook", eio)
    with open_source(path, "auto") as src, pytest.raises(OSError) as ei:
        src.gather(run, np.zeros(run.nbytes, np.uint8))
    assert ei.value.errno == errno.EIO and os.fspath(path) in str(ei.value)


def test_a_file_truncated_before_the_gather_is_a_format_error_not_a_sigbus(wide):
    path, x = wide
    run = column_run(x, 0, 100)
    with open_source(path, "auto") as src:
        os.truncate(path, 1000 + 20 * x.shape[1] * 4)   # rows 20.. gone, within the mapping's length
        with pytest.raises(FormatError) as ei:
            src.gather(run, np.zeros(run.nbytes, np.uint8))
        assert ei.value.rule == "file-truncated"
        ok = Run(run.src, run.pitch, run.width, 10, 0)  # the rows still there read fine
        out = np.zeros(ok.nbytes, np.uint8)
        assert src.gather(ok, out)
    np.testing.assert_array_equal(out.view(np.float32).reshape(10, 100), x[:10, :100])


def test_positional_sources_do_not_gather_or_map(wide):
    path, x = wide
    run = column_run(x, 0, 100)
    for backend in ("pread", "direct"):
        with open_source(path, backend) as src:
            assert not src.gathers and not src.gather(run, np.zeros(run.nbytes, np.uint8))
            assert os.fspath(path) not in mapped_paths()


def test_a_used_mapping_is_unmapped_on_a_thread_after_close(wide):
    path, x = wide
    run = column_run(x, 0, 100)
    src = open_source(path, "auto")
    assert os.fspath(path) in mapped_paths()
    src.gather(run, np.zeros(run.nbytes, np.uint8))
    src.close()
    assert mapping.wait_unmapped(30)
    assert os.fspath(path) not in mapped_paths()
    assert not [t for t in threading.enumerate() if t.name == "foxhunt-unmap"]


def test_an_unused_mapping_is_unmapped_at_once(wide):
    path, _ = wide
    fd = os.open(path, os.O_RDONLY)
    try:
        m = FileMap(fd, os.fstat(fd).st_size)
        m.close()
        assert os.fspath(path) not in mapped_paths()
        assert not [t for t in threading.enumerate() if t.name == "foxhunt-unmap"]
    finally:
        os.close(fd)


def test_a_view_alive_after_close_keeps_the_mapping_until_it_goes(wide):
    path, x = wide
    fd = os.open(path, os.O_RDONLY)
    try:
        m = FileMap(fd, os.fstat(fd).st_size)
        run = column_run(x, 8, 16)
        view = m.rows(run)
        assert not view.flags.writeable
        m.close()
        assert os.fspath(path) in mapped_paths()                    # a reader still holds a view
        np.testing.assert_array_equal(np.ascontiguousarray(view).view(np.float32), x[:, 8:16])
        del view
        assert mapping.wait_unmapped(30)
        assert os.fspath(path) not in mapped_paths()
        with pytest.raises(ValueError, match="closed"):
            m.rows(run)
    finally:
        os.close(fd)


def test_close_returns_while_a_used_mapping_is_unmapped(wide, monkeypatch):
    """The caller goes on while a used mapping is unmapped (on the H200 machine the munmap of a
    TP shard's mappings took 20-200 ms)."""
    path, x = wide
    fd = os.open(path, os.O_RDONLY)
    release = threading.Event()
    ticks = []
    real = mapping._lib()

    def slow_munmap(addr, size):   # libc's munmap of a big mapping, slowed down
        release.wait(10)
        return real.munmap(addr, size)

    class Lib:
        munmap = staticmethod(slow_munmap)
        madvise = staticmethod(real.madvise)
    try:
        m = FileMap(fd, os.fstat(fd).st_size)
        m.rows(column_run(x, 0, 4))
        monkeypatch.setattr(mapping, "_lib", lambda: Lib)
        m.close()
        for _ in range(5):                                          # the caller runs meanwhile
            ticks.append(time.perf_counter())
            time.sleep(0.01)
        assert len(ticks) == 5 and not mapping.wait_unmapped(0.05)  # the unmap is still under way
        release.set()
        assert mapping.wait_unmapped(30)
        assert os.fspath(path) not in mapped_paths()
    finally:
        release.set()
        os.close(fd)


def test_one_thread_drops_the_pages_then_unmaps_each_used_mapping(wide, monkeypatch):
    """Several used mappings closed together: one unmapping thread takes them in turn; each has
    its pages dropped (MADV_DONTNEED, piece by piece: the map lock taken for reading) before its
    munmap, so the munmap holds the lock for writing only briefly."""
    path, x = wide
    real = mapping._lib()
    calls, gate = [], threading.Event()

    class Lib:
        @staticmethod
        def madvise(addr, size, advice):
            gate.wait(10)
            calls.append(("madvise", addr, size, advice))
            return real.madvise(addr, size, advice)

        @staticmethod
        def munmap(addr, size):
            calls.append(("munmap", addr, size))
            return real.munmap(addr, size)
    fds = [os.open(path, os.O_RDONLY) for _ in range(3)]
    try:
        size = os.fstat(fds[0]).st_size
        maps = [FileMap(fd, size) for fd in fds]
        for m in maps:
            m.rows(column_run(x, 0, 4))
        monkeypatch.setattr(mapping, "_lib", lambda: Lib)
        monkeypatch.setattr(mapping, "DROP_BYTES", 64 << 10)
        for m in maps:
            m.close()
        assert len([t for t in threading.enumerate() if t.name == "foxhunt-unmap"]) == 1
        gate.set()
        assert mapping.wait_unmapped(30)
    finally:
        gate.set()
        for fd in fds:
            os.close(fd)
    unmapped = [c for c in calls if c[0] == "munmap"]
    assert len(unmapped) == 3 and all(n == size for _, _, n in unmapped)
    for _, addr, _ in unmapped:
        mine = [c for c in calls if c[1] >= addr and c[1] < addr + size]
        assert mine[-1][0] == "munmap"
        drops = [(a - addr, n) for kind, a, n, *_ in mine if kind == "madvise"]
        assert drops == [(off, min(64 << 10, size - off)) for off in range(0, size, 64 << 10)]
        assert all(c[3] == mapping.DONTNEED for c in mine if c[0] == "madvise")
    assert os.fspath(path) not in mapped_paths()


def test_a_span_larger_than_its_scratch_is_refused(wide):
    path, _ = wide
    with open_source(path, "pread") as src, pytest.raises(ValueError, match="does not fit"):
        src.read_span(1000, 8192, np.zeros(4096, np.uint8))
