"""A cold file read through the page cache is read as sequential streams: each stretch of the file
through a descriptor of its own (``FileSource.read_in_streams``), the plan taking the stretches'
chunks in turn (``format.plan.take_in_turn``), so that the kernel reads ahead per stretch."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import foxhunt_stream as fs

from foxhunt_stream.format.plan import Chunk, LoadPlan, Run, take_in_turn
from foxhunt_stream.io import pagecache, read_policy
from foxhunt_stream.io.source import FileSource, stream_of
from page_cache_support import evict

EVERY_PAGE = 1 << 62


@given(st.integers(1, 1 << 40), st.integers(1, 64), st.data())
def test_streams_are_equal_stretches_in_file_order(size, streams, data):
    a = data.draw(st.integers(0, size - 1))
    b = data.draw(st.integers(a, size - 1))
    sa, sb = stream_of(a, size, streams), stream_of(b, size, streams)
    assert 0 <= sa <= sb < streams   # in range, never backwards along the file
    assert stream_of(0, size, streams) == 0 and stream_of(size - 1, size, streams) == min(streams, size) - 1 \
        or size < streams
    # each stretch is ``size / streams`` bytes, give or take one
    assert sa * size // streams <= a < (sa + 1) * size // streams + 1


def test_one_stream_or_no_size_is_stream_zero():
    assert stream_of(12345, 100_000, 1) == 0
    assert stream_of(12345, 0, 8) == 0


def _chunk(file: int, src: int, n: int = 10) -> Chunk:
    return Chunk(file, 0, Run(src, n, n, 1, 0))


def test_take_in_turn_takes_each_group_in_turn_in_the_places_its_chunks_held():
    a = [_chunk(0, 10 * i) for i in range(6)]      # file 0: groups by offset, 0-2 and 3-5
    b = [_chunk(1, 10 * i) for i in range(2)]      # file 1: no groups
    order = a[:3] + [b[0]] + a[3:] + [b[1]]
    plan = LoadPlan((), tuple(order), ())
    out = take_in_turn(plan, lambda c: c.run.src // 30 if c.file == 0 else None)
    assert out.chunks == (a[0], a[3], a[1], b[0], a[4], a[2], a[5], b[1])
    assert sorted(out.chunks) == sorted(plan.chunks)


def test_take_in_turn_with_uneven_groups_and_two_files():
    a = [_chunk(0, i) for i in range(5)]           # groups 0 (3 chunks), 1 (2 chunks)
    b = [_chunk(1, i) for i in range(4)]           # groups 0, 1, 2, 3
    plan = LoadPlan((), tuple(a + b), ())
    out = take_in_turn(plan, lambda c: (c.run.src >= 3) if c.file == 0 else c.run.src)
    assert out.chunks[:5] == (a[0], a[3], a[1], a[4], a[2])
    assert out.chunks[5:] == tuple(b)              # one chunk per group: already in turn


def test_take_in_turn_without_groups_is_the_same_plan():
    plan = LoadPlan((), tuple(_chunk(0, i) for i in range(4)), ())
    assert take_in_turn(plan, lambda c: None) is plan
    assert take_in_turn(plan, lambda c: 0) is plan   # one group: nothing to take in turn


def _open_fds() -> set[str]:
    """This process's descriptors, but the one of /dev/null a cold load opens once and keeps."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != "/dev/null":
                out.add(fd)
        except OSError:   # the listing's own descriptor, gone by now
            pass
    return out


def _read_spy(monkeypatch, start: int = 0) -> list[tuple[int, int]]:
    """Every (fd, offset) of a positional read at ``start`` or beyond (for a checkpoint: its
    tensors, not its header)."""
    seen: list[tuple[int, int]] = []
    real = os.preadv

    def spy(fd, buffers, offset, *args):
        if offset >= start:
            seen.append((fd, offset))
        return real(fd, buffers, offset, *args)
    monkeypatch.setattr(os, "preadv", spy)
    return seen


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "blob.bin"
    data = np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    return str(path), data


def test_a_source_read_in_streams_reads_each_stretch_through_its_own_descriptor(data_file, monkeypatch):
    path, data = data_file
    before = _open_fds()
    seen = _read_spy(monkeypatch)
    src = FileSource(path, data.nbytes)
    src.read_in_streams(4)
    assert src.streams == 4 and [src.stream(o) for o in (0, 262144, 524288, (1 << 20) - 1)] == [0, 1, 2, 3]
    for off in range(0, data.nbytes, 65536):
        out = np.empty(65536, np.uint8)
        src.read_into(out, off)
        assert np.array_equal(out, data[off:off + 65536])
    fds_of = {}
    for fd, off in seen:
        fds_of.setdefault(stream_of(off, data.nbytes, 4), set()).add(fd)
    assert all(len(fds) == 1 for fds in fds_of.values())                  # one descriptor per stretch
    assert len(set().union(*fds_of.values())) == 4 and src.fd not in set().union(*fds_of.values())
    for fd in set().union(*fds_of.values()):                              # the same file, reopened
        assert os.fstat(fd).st_ino == os.fstat(src.fd).st_ino
    src.close()
    assert _open_fds() == before


def test_a_source_that_cannot_reopen_its_file_reads_through_its_own_descriptor(data_file, monkeypatch):
    path, data = data_file
    src = FileSource(path, data.nbytes)
    real_open = os.open

    def no_proc(p, *args, **kwargs):
        if str(p).startswith("/proc/self/fd/"):
            raise FileNotFoundError(p)
        return real_open(p, *args, **kwargs)
    monkeypatch.setattr(os, "open", no_proc)
    src.read_in_streams(4)
    out = np.empty(data.nbytes, np.uint8)
    src.read_into(out, 0)
    assert np.array_equal(out, data)
    assert src._fd_at((1 << 20) - 1) == src.fd
    src.close()


@pytest.fixture
def cold_checkpoint(tmp_path):
    """Two 8 MiB tensors in one file, evicted from the page cache (skip where eviction does nothing)."""
    rng = np.random.default_rng(1)
    tensors = {f"w{i}": rng.integers(0, 255, 8 << 20, dtype=np.uint8) for i in range(2)}
    path = str(tmp_path / "model.safetensors")
    fs.save_file(tensors, path)
    evict(path)
    left = pagecache.resident_fraction(path, samples=EVERY_PAGE)
    if left > 0.05:
        pytest.skip(f"POSIX_FADV_DONTNEED does not evict on this filesystem ({left} still resident)")
    return path, tensors




def test_a_cold_load_reads_its_file_as_one_stream_per_worker(cold_checkpoint, monkeypatch):
    path, tensors = cold_checkpoint
    before = _open_fds()
    seen = _read_spy(monkeypatch, fs.read_header(path).data_start)
    out = fs.load_file(path, threads=4, chunk_bytes=1 << 20)
    assert all(np.array_equal(out[k], v) for k, v in tensors.items())
    size = os.path.getsize(path)
    fds_of: dict[int, set[int]] = {}
    for fd, off in seen:
        fds_of.setdefault(stream_of(off, size, 4), set()).add(fd)
    assert sorted(fds_of) == [0, 1, 2, 3]
    assert all(len(fds) == 1 for fds in fds_of.values())
    assert len(set().union(*fds_of.values())) == 4
    assert _open_fds() == before   # the streams' descriptors are closed with the load


@pytest.mark.parametrize("case, descriptors", [
    ("hot", 1),          # in the page cache: no streams
    ("capped", 2),       # at most STREAM_FDS descriptors a load
    ("background", 1),   # a caller waiting tensor by tensor wants the plan's order: no streams
])
def test_the_descriptors_a_load_reads_through(cold_checkpoint, monkeypatch, case, descriptors):
    path, tensors = cold_checkpoint
    if case == "hot":
        fs.load_file(path)
    if case == "capped":
        monkeypatch.setattr(read_policy, "STREAM_FDS", 2)
    seen = _read_spy(monkeypatch, fs.read_header(path).data_start)
    out = fs.load_file(path, threads=4, chunk_bytes=1 << 20, background=case == "background")
    out = out.result() if case == "background" else out
    assert all(np.array_equal(out[k], v) for k, v in tensors.items())
    assert len({fd for fd, _ in seen}) == descriptors
