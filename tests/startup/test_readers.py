"""The page-cache reader every prefetch read goes through (``startup.readers``): ``read_range``
in steps, paced, cancellable, hinted, strict or best effort; ``PieceReaders``' slow and fast
modes; ``Pacer``; and what it stands on: ``FileSource.fill_cache`` and ``sendfile_to_null``."""

from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest

import foxhunt_stream as fs
from foxhunt_stream import errors
from foxhunt_stream.errors import CancelledError as Cancelled
from foxhunt_stream.io import pagecache, source
from foxhunt_stream.startup import readers
from foxhunt_stream.startup.readers import Pacer, Piece, PieceReaders, read_range, scratch_buffer


def _blob(tmp_path, size: int = 10_000) -> str:
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(size))
    return str(f)


def _record_fills(monkeypatch) -> list[tuple[int, int]]:
    """(offset, length) of every fill_cache call, through the sources' fault hook."""
    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(source, "fault_hook", lambda src, off, n: seen.append((off, n)))
    return seen


# ---------------------------------------------------------------- read_range

def test_read_range_fills_in_steps_each_cleared_by_the_pacer(tmp_path, monkeypatch):
    seen = _record_fills(monkeypatch)
    paced = []
    pacer = Pacer(None)
    monkeypatch.setattr(pacer, "take", paced.append)
    with source.FileSource(_blob(tmp_path)) as src:
        assert read_range(src, 100, 9_000, scratch_buffer(4096), step=lambda: 4096, pacer=pacer)
        assert src.bytes_read == 9_000
    assert seen == [(100, 4096), (4196, 4096), (8292, 808)] and paced == [4096, 4096, 808]


def test_read_range_asks_for_the_step_again_before_each_call(tmp_path, monkeypatch):
    seen = _record_fills(monkeypatch)
    steps = iter([1000, 4000, 100_000])
    with source.FileSource(_blob(tmp_path)) as src:
        assert read_range(src, 0, 10_000, scratch_buffer(4096), step=lambda: next(steps))
    assert seen == [(0, 1000), (1000, 4000), (5000, 5000)]


def test_read_range_stops_between_steps_once_cancelled(tmp_path, monkeypatch):
    seen = _record_fills(monkeypatch)
    with source.FileSource(_blob(tmp_path)) as src:
        assert not read_range(src, 0, 10_000, scratch_buffer(4096), step=lambda: 4096,
                              cancelled=lambda: len(seen) >= 1)
        assert not read_range(src, 0, 10_000, scratch_buffer(4096), cancelled=lambda: True)
    assert seen == [(0, 4096)]


def test_a_cancelled_range_is_not_even_hinted(tmp_path, monkeypatch):
    hints = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, a: (hints.append((off, n, a)), real(fd, off, n, a))[1])
    with source.FileSource(_blob(tmp_path)) as src:
        assert not read_range(src, 0, 10_000, scratch_buffer(), hint=True, cancelled=lambda: True)
        assert hints == []
        assert read_range(src, 10, 500, scratch_buffer(), hint_only=True)
        assert hints == [(10, 500, os.POSIX_FADV_WILLNEED)] and src.bytes_read == 0


def test_read_range_is_strict_unless_best_effort(tmp_path, monkeypatch):
    path = _blob(tmp_path, 10_000)
    with source.FileSource(path) as src:
        with pytest.raises(errors.FormatError, match="file-truncated"):
            read_range(src, 8_000, 4_000, scratch_buffer())
        assert read_range(src, 8_000, 4_000, scratch_buffer(), best_effort=True)   # shorter than listed: ends quietly

        def eio(src, off, n):
            raise OSError(errno.EIO, "injected")
        monkeypatch.setattr(source, "fault_hook", eio)
        with pytest.raises(OSError, match="injected"):
            read_range(src, 0, 4_000, scratch_buffer())
        assert read_range(src, 0, 4_000, scratch_buffer(), best_effort=True)


def test_bytes_that_are_not_a_checkpoints_are_not_counted_as_read(tmp_path):
    with source.FileSource(_blob(tmp_path)) as src:
        before = source.total_bytes_read()
        assert read_range(src, 0, 10_000, scratch_buffer(), count=False)
        assert src.bytes_read == 0 and source.total_bytes_read() == before
        assert read_range(src, 0, 10_000, scratch_buffer())
        assert src.bytes_read == 10_000


def test_a_copy_step_reads_through_the_buffer_not_sendfile(tmp_path, monkeypatch):
    sent = []
    real = os.sendfile
    monkeypatch.setattr(os, "sendfile", lambda *a: (sent.append(a), real(*a))[1])
    with source.FileSource(_blob(tmp_path)) as src:
        assert read_range(src, 0, 10_000, scratch_buffer(4096), copy=lambda: True)
        assert sent == [] and src.bytes_read == 10_000


# ---------------------------------------------------------------- PieceReaders

def test_piece_readers_go_fast_once_a_load_begins(tmp_path, monkeypatch):
    advised = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, a: (advised.append(a), real(fd, off, n, a))[1])
    seen = _record_fills(monkeypatch)
    with source.FileSource(_blob(tmp_path)) as src:
        r = PieceReaders({0: src}, lambda: False, step=1000, fast_step=4000, idle=False, hint=False,
                         no_readahead=True, copy=True, max_rate=1e12)
        r.start()
        assert advised == [os.POSIX_FADV_RANDOM] and r.step() == 1000 and r.copying() and not r.pacer.released
        r.setup(0)
        r.work(0, Piece(0, 0, 2000))
        r.go_fast()
        assert advised[-1] == os.POSIX_FADV_NORMAL and r.step() == 4000 and not r.copying() and r.pacer.released
        r.work(0, Piece(0, 2000, 8000))
    assert seen == [(0, 1000), (1000, 1000), (2000, 4000), (6000, 4000)]


def test_a_piece_of_a_cancelled_job_is_cancelled_not_landed(tmp_path):
    with source.FileSource(_blob(tmp_path)) as src:
        r = PieceReaders({0: src}, lambda: True, step=1000, fast_step=1000, idle=False, hint=True)
        r.setup(0)
        with pytest.raises(Cancelled):
            r.work(0, Piece(0, 0, 1000))


def _io_priority_class(tid: int) -> int | None:
    import ctypes
    import platform
    nr = {"x86_64": 252, "aarch64": 31}.get(platform.machine())   # ioprio_get
    if nr is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    got = libc.syscall(nr, 1, tid)
    return None if got < 0 else got >> 13


def test_prefetch_readers_run_in_the_idle_io_class_by_default(checkpoint, monkeypatch):
    """priority="idle" (the default): each reader thread puts its I/O in the idle class, so the
    imports a prefetch overlaps are served first; "normal" leaves the class alone."""
    seen = []
    real = source.FileSource.fill_cache

    def fill(self, *a, **k):
        seen.append(_io_priority_class(threading.get_native_id()))
        return real(self, *a, **k)
    monkeypatch.setattr(source.FileSource, "fill_cache", fill)
    fs.prefetch(checkpoint, skip_resident=False, chunk_bytes=8192, helper_process=False).wait()
    idle, seen[:] = list(seen), []
    fs.prefetch(checkpoint, skip_resident=False, chunk_bytes=8192, priority="normal", helper_process=False).wait()
    normal = list(seen)
    assert idle and normal
    if readers.set_idle_io_priority():   # where the kernel takes it, every idle reader is idle class
        assert set(idle) == {3} and 3 not in normal
    with pytest.raises(ValueError, match="priority"):
        fs.prefetch(checkpoint, priority="low", helper_process=False)


# ---------------------------------------------------------------- Pacer

def test_pacer_spaces_reads_at_the_rate_until_released():
    now = [100.0]
    p = Pacer(1000.0, clock=lambda: now[0])
    waits = []
    p._released.wait = lambda t: waits.append(round(t, 6)) or False   # the pacer's own sleep, not slept
    p.take(500)            # due at once
    p.take(500)            # due 0.5 s later
    now[0] += 0.2
    p.take(1000)           # due at 101.0
    assert waits == [0.5, 0.8]
    now[0] += 5.0          # idle for a while: no burst credit beyond "now"
    p.take(100)
    assert waits == [0.5, 0.8]
    p.release()
    p.take(10 ** 9)
    assert waits == [0.5, 0.8] and p.released
    assert Pacer(None).released
    for bad in (0, -5, float("nan"), True):
        with pytest.raises(ValueError, match="max_rate"):
            Pacer(bad)


def test_a_released_pacer_wakes_a_waiting_reader():
    p = Pacer(1.0)
    p.take(1)   # the next byte is due in a second
    t = threading.Thread(target=p.take, args=(10,))
    t.start()
    time.sleep(0.05)
    p.release()
    t.join(5)
    assert not t.is_alive()


# ---------------------------------------------------------------- FileSource.fill_cache and sendfile_to_null

def test_sendfile_to_null_fills_the_range_and_stops_at_end_of_file(tmp_path):
    from foxhunt_stream.io.pagecache import resident_fraction, sendfile_to_null
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(3 << 20))
    fd = os.open(f, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)   # evict, where the filesystem allows it
        evicted = resident_fraction(str(f), samples=1 << 20) < 1.0
        assert sendfile_to_null(fd, 0, 3 << 20, step=1 << 20) == 3 << 20
        if evicted:
            assert resident_fraction(str(f), samples=1 << 20) == 1.0
        assert sendfile_to_null(fd, (3 << 20) - 100, 4096) == 100   # past the end: what there is
    finally:
        os.close(fd)


def test_fill_cache_falls_back_to_reads_and_reports_truncation(tmp_path, monkeypatch):
    f = tmp_path / "blob"
    f.write_bytes(b"z" * 10_000)
    calls = []

    def no_sendfile(*a):
        calls.append(a)
        raise OSError(errno.EINVAL, "not here")
    monkeypatch.setattr(os, "sendfile", no_sendfile)
    monkeypatch.setattr(pagecache, "_devnull", -2)   # forget the descriptor: sendfile is tried again
    preads = []
    real_preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: (preads.append(off), real_preadv(fd, bufs, off))[1])
    with source.FileSource(f) as src:
        src.fill_cache(0, 10_000, np.empty(4096, np.uint8))
        assert calls and preads == [0, 4096, 8192] and src.bytes_read == 10_000
        with pytest.raises(errors.FormatError, match="file-truncated"):
            src.fill_cache(8000, 4000, scratch_buffer(4096))


def test_sendfile_that_stops_part_way_is_finished_with_reads(tmp_path, monkeypatch):
    """A filesystem where sendfile fails after some bytes (EINVAL part way): the rest is read
    with pread, not reported as a failed prefetch."""
    f = tmp_path / "blob"
    f.write_bytes(b"z" * 10_000)
    real_sendfile, calls = os.sendfile, []

    def flaky(out, fd, off, n):
        calls.append(off)
        if len(calls) == 1:
            return real_sendfile(out, fd, off, 4096)
        raise OSError(errno.EINVAL, "not any more")
    monkeypatch.setattr(os, "sendfile", flaky)
    preads = []
    real_preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: (preads.append(off), real_preadv(fd, bufs, off))[1])
    with source.FileSource(f) as src:
        src.fill_cache(0, 10_000, scratch_buffer(4096))
        assert calls[:2] == [0, 4096] and preads == [4096, 8192] and src.bytes_read == 10_000
        assert calls[2:] == [0]   # the range once more through the cache, best effort (FileSource.promote)


def test_reader_threads_starting_together_open_dev_null_once(tmp_path, monkeypatch):
    f = tmp_path / "blob"
    f.write_bytes(b"z" * 1000)
    monkeypatch.setattr(pagecache, "_devnull", -2)
    real_open, opened = os.open, []

    def slow_open(path, *a, **k):
        fd = real_open(path, *a, **k)
        if path == os.devnull:
            opened.append(fd)
            time.sleep(0.05)
        return fd
    monkeypatch.setattr(os, "open", slow_open)
    fd = real_open(f, os.O_RDONLY)
    start = threading.Barrier(8)
    threads = [threading.Thread(target=lambda: (start.wait(), pagecache.sendfile_to_null(fd, 0, 1000)))
               for _ in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(opened) == 1   # not one per thread, all but the last leaked
    finally:
        os.close(fd)
        for d in opened:
            os.close(d)


def test_sendfile_never_writes_into_a_descriptor_that_is_no_longer_dev_null(tmp_path):
    """Something closed our /dev/null descriptor and the number now names a file: the next call
    must notice (fstat) and open /dev/null again instead of sending checkpoint bytes there."""
    src = tmp_path / "src.bin"
    src.write_bytes(b"s" * 100_000)
    victim = tmp_path / "victim.txt"
    fd = os.open(src, os.O_RDONLY)
    try:
        assert pagecache.sendfile_to_null(fd, 0, 100_000) == 100_000
        null = pagecache._devnull
        other = os.open(victim, os.O_WRONLY | os.O_CREAT, 0o600)
        os.dup2(other, null)   # the number now names victim.txt, as after a close and a reuse
        os.close(other)
        try:
            assert pagecache.sendfile_to_null(fd, 0, 100_000) == 100_000
            assert victim.stat().st_size == 0 and pagecache._devnull != null
        finally:
            os.close(null)
    finally:
        os.close(fd)


def test_readers_waiting_on_the_pacer_stop_when_a_cancel_releases_it(tmp_path):
    """A cancel releases the pacer (so nobody sleeps out its wait); the readers it held must then
    stop, not read the step they were waiting for."""
    pacer = Pacer(1.0)                      # one byte a second: every reader but the first waits
    stop = threading.Event()
    with source.FileSource(_blob(tmp_path)) as src:
        results = []
        readers = [threading.Thread(target=lambda: results.append(
            read_range(src, 0, 4096, scratch_buffer(4096), step=lambda: 4096, pacer=pacer, cancelled=stop.is_set)))
            for _ in range(3)]
        for t in readers:
            t.start()
        time.sleep(0.2)
        stop.set()
        pacer.release()
        for t in readers:
            t.join(5)
        assert sorted(results) == [False, False, True] and src.bytes_read == 4096


def test_an_idle_reader_hands_its_thread_back_at_the_io_priority_it_came_with(tmp_path):
    """Worker threads are reused between jobs (engine.workers): a prefetch reader's idle I/O class
    must not stay on the thread for the load that runs on it next."""
    before = readers.io_priority()
    if before is None:
        pytest.skip("no ioprio_get on this platform")
    from foxhunt_stream.engine import workers
    from foxhunt_stream.engine.pipeline import Job
    path = _blob(tmp_path, 20_000)
    seen = []
    with source.FileSource(path) as src:
        r = PieceReaders({0: src}, lambda: False, step=4096, fast_step=4096, idle=True, hint=False)

        def work(w, piece):
            seen.append((threading.current_thread(), readers.io_priority()))
            r.work(w, piece)
        Job([Piece(0, 0, 20_000)], work, 1, name="foxhunt-test-reader", setup=r.setup, teardown=r.teardown
            ).start().wait(30)
    thread, during = seen[0]
    if during == before:
        pytest.skip("the idle I/O class cannot be set here")
    after = []
    workers.run(lambda: after.append((threading.current_thread(), readers.io_priority())), "foxhunt-test-next").join(30)
    assert during == 3 << 13 and after == [(thread, before)]
