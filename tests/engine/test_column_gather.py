"""Column slices of files in the page cache are gathered out of a mapping (backend "auto", the
default).

A dim-1 (or later-dim) shard reads only the pages holding its rows, counted by
``total_bytes_read`` and seen by the fault hook; slices still equal numpy for every dtype and
dim; a file that is not in the page cache, or that a prefetch is still filling, keeps positional
reads of whole row spans, exactly as ``backend="pread"`` reads them; the mappings are gone after
the load.
"""

from __future__ import annotations

import os
import threading

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as stn

import foxhunt_stream as fs
from foxhunt_stream.cuda.devices import Device
from foxhunt_stream.engine import loader
from foxhunt_stream.format.tp import indices_for, split_bounds
from foxhunt_stream.io import mapping, pagecache, read_policy, source
from foxhunt_stream.io.read_policy import ReadPolicy
from foxhunt_stream.io.checkpoint import open_checkpoint, read_header
from foxhunt_stream.io.source import FileSource, total_bytes_read
from page_cache_support import evict
from thread_support import foxhunt_threads_at_work

PAGE = mapping.PAGE


class ReadLog:
    """A fault hook recording (path, offset, length) of every read (a gather: every page extent)."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, src, offset, length):
        with self.lock:
            self.reads.append((src.path, offset, length))

    def total(self) -> int:
        return sum(n for _, _, n in self.reads)


@pytest.fixture
def read_log(monkeypatch):
    log = ReadLog()
    monkeypatch.setattr(source, "fault_hook", log)
    return log


@pytest.fixture
def in_cache(monkeypatch):
    """Every file counts as in the page cache (as a freshly written one is, unless another process
    drops the caches meanwhile): for the tests of what a gather does, not of when it is chosen."""
    monkeypatch.setattr(pagecache, "resident_fraction", lambda p, samples=64: 1.0)


@pytest.fixture
def gathers(monkeypatch):
    """Counts the runs FileSource.gather packed (True) and declined (False)."""
    seen = {True: 0, False: 0}
    lock = threading.Lock()
    real = FileSource.gather

    def counting(self, run, out):
        done = real(self, run, out)
        with lock:
            seen[done] += 1
        return done
    monkeypatch.setattr(FileSource, "gather", counting)
    return seen


def save(path, tensors: dict[str, np.ndarray]) -> str:
    stn.save_file(tensors, str(path))
    return str(path)


def rows_pages(start: int, pitch: int, width: int, height: int) -> int:
    """Bytes of the pages holding at least one byte of each row, within the rows' span (a brute
    force over rows, independent of io.mapping)."""
    end = start + (height - 1) * pitch + width
    pages = {p for r in range(height)
             for p in range((start + r * pitch) // PAGE, (start + r * pitch + width - 1) // PAGE + 1)}
    return len(pages) * PAGE - start % PAGE - (-end) % PAGE


def column_geometry(path: str, name: str, world: int, rank: int):
    """(first byte, pitch, width, height) of rank's dim-1 slice of a 2-D tensor."""
    h = read_header(path)
    info = h.by_name[name]
    a, b = split_bounds(info.shape[1], world, rank)
    item = info.dtype.itemsize
    return h.data_start + info.start + a * item, info.shape[1] * item, (b - a) * item, info.shape[0]


@pytest.mark.parametrize("rank", [0, 3, 7])
def test_a_dim1_shard_reads_only_the_pages_of_its_rows(in_cache, tmp_path, read_log, gathers, rank):
    """TP=8 of a [48, 16384] float32 tensor: 8 KiB of each 64 KiB row. What is read (the pages the
    rows touch) is at most 1.1x the slice rounded out to pages, and far from the covered span."""
    x = np.random.default_rng(rank).standard_normal((48, 16384)).astype(np.float32)
    path = save(tmp_path / "w.safetensors", {"pad": np.ones(77, np.float32), "w": x})
    read_log.reads.clear()
    before = total_bytes_read()
    out = fs.load_file(path, names=["w"], shard=fs.TPSlice(rank, 8, 1))
    read = total_bytes_read() - before
    np.testing.assert_array_equal(out["w"], np.array_split(x, 8, axis=1)[rank])
    start, pitch, width, height = column_geometry(path, "w", 8, rank)
    rounded = sum(((start + r * pitch + width - 1) // PAGE - (start + r * pitch) // PAGE + 1) * PAGE
                  for r in range(height))                 # each row's slice rounded out to whole pages
    assert gathers[True] >= 1 and gathers[False] == 0
    assert read == read_log.total() == rows_pages(start, pitch, width, height)
    assert width * height <= read <= 1.1 * rounded
    assert read < ((height - 1) * pitch + width) / 4
    assert all(start <= off and off + n <= start + (height - 1) * pitch + width for _, off, n in read_log.reads)


def test_a_wide_dim1_slice_reads_about_its_own_bytes(in_cache, tmp_path):
    """Slices of ten pages a row: the page rounding costs at most one page a row, 1.1x."""
    x = np.arange(16 * 8 * 10240, dtype=np.float32).reshape(16, 8 * 10240)
    path = save(tmp_path / "w.safetensors", {"pad": np.ones(5, np.float32), "w": x})
    before = total_bytes_read()
    out = fs.load_file(path, names=["w"], shard=fs.TPSlice(2, 8, 1))
    read = total_bytes_read() - before
    np.testing.assert_array_equal(out["w"], x[:, 2 * 10240:3 * 10240])
    assert out["w"].nbytes <= read <= 1.1 * out["w"].nbytes


# numpy/ml_dtypes types of every safetensors dtype a slice can take (the sub-byte F4/F6 cannot be sliced)
DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.uint16, np.float16, ml_dtypes.bfloat16, np.int32, np.uint32,
          np.float32, np.float64, np.int64, np.uint64, np.complex64, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
          ml_dtypes.float8_e8m0fnu, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz]


def assert_same_bytes(got, want) -> None:
    """Equal shapes and bytes: NaN payloads of every float type compare as what they are."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_gathered_slices_equal_numpy_for_every_dtype_and_dim(in_cache, tmp_path, gathers, dtype):
    raw = np.random.default_rng(1).integers(0, 256, 6 * 10 * 12 * np.dtype(dtype).itemsize, dtype=np.uint8)
    x = raw.view(dtype).reshape(6, 10, 12) if dtype is not np.bool_ else (raw[:720] & 1).astype(bool).reshape(6, 10, 12)
    y = x[:, :, 0].copy()
    path = save(tmp_path / "t.safetensors", {"x": x, "y": y})
    for dim in (0, 1, 2, -1):
        for rank in range(3):
            got = fs.load_file(path, shard=fs.TPSlice(rank, 3, {"x": dim, "y": 1 if dim else 0}),
                               chunk_bytes=4096, threads=2)
            assert_same_bytes(got["x"], np.array_split(x, 3, axis=dim)[rank])
            assert_same_bytes(got["y"], np.array_split(y, 3, axis=1 if dim else 0)[rank])
    with fs.safe_open(path, chunk_bytes=4096, threads=2) as f:
        assert f._sources[0].gathers
        for index in (np.s_[:, 2:7], np.s_[1:5, ::3], np.s_[:, :, 5:11], np.s_[..., ::2], np.s_[2, :, 1:4]):
            assert_same_bytes(f.get_slice("x")[index], x[index])
    assert gathers[True] > 0


def test_a_slice_wider_than_a_chunk_and_rows_wider_than_a_chunk(in_cache, tmp_path, gathers):
    """Chunks hold at most chunk_bytes of the slice: many rows each, or pieces of one row."""
    x = np.random.default_rng(2).standard_normal((300, 3000)).astype(np.float32)
    path = save(tmp_path / "t.safetensors", {"x": x})
    for chunk in (4096, 16384):
        for index in (np.s_[:, 100:1900], np.s_[:, 7:19]):
            with fs.safe_open(path, chunk_bytes=chunk, threads=2) as f:
                np.testing.assert_array_equal(f.get_slice("x")[index], x[index])
    ck = open_checkpoint(path)
    sels = loader.selections(ck, ["x"], {"x": np.s_[:, 7:19]})
    plan = loader.prepare(ck, sels, fs.settings.merge(chunk_bytes=4096),
                          policies=[ReadPolicy(ck.headers[0].file_size, gather=True)]).plan
    assert all(c.run.nbytes <= 4096 for c in plan.chunks) and len(plan.chunks) == -(-300 // (4096 // 48))


@pytest.fixture
def column_ckpt(tmp_path):
    x = np.random.default_rng(3).standard_normal((64, 4096)).astype(np.float32)
    return save(tmp_path / "c.safetensors", {"x": x, "b": np.ones(3, np.float32)}), x


def _reads_of(path, read_log, **options):
    read_log.reads.clear()
    out = fs.load_file(path, names=["x"], shard=fs.TPSlice(1, 4, 1), chunk_bytes=65536, **options)
    return out["x"], sorted(read_log.reads)


def test_a_cold_file_keeps_positional_reads_of_whole_spans(column_ckpt, read_log, gathers, monkeypatch):
    path, x = column_ckpt
    want, pread_reads = _reads_of(path, read_log, backend="pread", direct_io="off")
    monkeypatch.setattr(pagecache, "resident_fraction", lambda p: 0.0)   # "not in the page cache"
    got, reads = _reads_of(path, read_log, direct_io="off")
    np.testing.assert_array_equal(got, want)
    assert reads == pread_reads and max(n for _, _, n in reads) > 4 * 4096   # row spans, as before
    assert gathers[True] == 0
    monkeypatch.setattr(pagecache, "resident_fraction", lambda p: 0.85)  # mostly, but not enough
    assert _reads_of(path, read_log, direct_io="off")[1] == pread_reads


def test_an_evicted_file_is_read_as_before(column_ckpt, read_log, gathers):
    path, x = column_ckpt
    evict(path)
    if pagecache.resident_fraction(path) >= read_policy.GATHER_RESIDENT:
        pytest.skip("this filesystem keeps the file in memory (tmpfs)")
    got, reads = _reads_of(path, read_log, direct_io="off")     # cold: whole spans, filling the cache
    assert gathers[True] == 0
    np.testing.assert_array_equal(got, np.array_split(x, 4, axis=1)[1])
    assert reads == _reads_of(path, read_log, backend="pread", direct_io="off")[1]


def test_a_file_a_prefetch_is_filling_keeps_positional_reads(column_ckpt, read_log, gathers, monkeypatch):
    path, _ = column_ckpt
    monkeypatch.setattr(pagecache, "prefetching", lambda p: True)
    _reads_of(path, read_log)
    assert gathers[True] == 0


def test_the_default_gathers_column_slices_of_cached_files():
    assert fs.settings.merge().backend == "auto"


def test_only_files_holding_a_column_slice_are_mapped(in_cache, tmp_path, monkeypatch, gathers):
    """A row shard or a whole load has no strided run: nothing is mapped, no residency sampled
    for gathers; a column slice maps only the file that holds it."""
    x = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)
    a = save(tmp_path / "a.safetensors", {"a": x})
    b = save(tmp_path / "b.safetensors", {"b": x + 1})
    opened = []
    real = read_policy.open_source

    def recording(path, backend="pread", expected_size=None, gather=False):
        opened.append((os.path.basename(path), "auto" if gather else backend))
        return real(path, backend, expected_size, gather=gather)
    monkeypatch.setattr(read_policy, "open_source", recording)
    for shard in (None, fs.TPSlice(1, 4, 0)):
        opened.clear()
        fs.load_file([a, b], shard=shard)
        assert sorted(opened) == [("a.safetensors", "pread"), ("b.safetensors", "pread")]
    opened.clear()
    out = fs.load_file([a, b], shard=fs.TPSlice(1, 4, {"b": 1, "*": 0}))
    np.testing.assert_array_equal(out["b"], (x + 1)[:, 64:128])
    np.testing.assert_array_equal(out["a"], x[16:32])
    assert sorted(opened) == [("a.safetensors", "pread"), ("b.safetensors", "auto")]
    assert gathers[True] >= 1


@pytest.mark.parametrize("options", [dict(backend="pread"), dict(direct_io="on"), dict(backend="direct")])
def test_only_auto_and_mmap_gather(in_cache, column_ckpt, options):
    path, _ = column_ckpt
    ck = open_checkpoint(path)

    def gathers(s):
        return [p.gather for p in read_policy.read_policies(ck.paths, [1], {0}, [ck.headers[0].file_size], s)]
    assert gathers(fs.settings.merge(**options)) == [False]
    assert gathers(fs.settings.merge()) == [True]


def mapped(path: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip("\n").endswith(" " + path) for line in f)


def test_the_mappings_are_gone_after_the_load(in_cache, column_ckpt):
    path, x = column_ckpt
    out = fs.load_file(path, shard=fs.TPSlice(0, 4, {"x": 1, "*": None}))
    np.testing.assert_array_equal(out["x"], x[:, :1024])
    assert mapping.wait_unmapped(30)
    assert not mapped(path)
    assert not [t for t in threading.enumerate() if t.name == "foxhunt-unmap"]


def test_a_safe_open_handle_maps_each_file_once(in_cache, column_ckpt):
    path, x = column_ckpt
    with fs.safe_open(path) as f:
        (src,) = f._sources
        first = src.map
        for a in range(0, 4096, 1024):
            np.testing.assert_array_equal(f.get_slice("x")[:, a:a + 1024], x[:, a:a + 1024])
        assert src.map is first and mapped(path)
    assert mapping.wait_unmapped(30) and not mapped(path)


def _fail_on_call(n: int, action):
    calls = [0]
    lock = threading.Lock()

    def hook(src, offset, length):
        with lock:
            k = calls[0]
            calls[0] += 1
        return action(offset, length) if k == n else None
    return hook


def _eio(offset, length):
    import errno
    raise OSError(errno.EIO, os.strerror(errno.EIO))


@pytest.mark.parametrize("action, error", [(_eio, OSError), (lambda off, n: n // 2, fs.FormatError)],
                         ids=["eio", "short"])
def test_a_failing_gather_fails_the_load_cleanly_and_the_next_one_works(in_cache, column_ckpt, monkeypatch,
                                                                     action, error):
    path, x = column_ckpt
    fds = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(source, "fault_hook", _fail_on_call(5, action))
    with pytest.raises(error) as ei:
        fs.load_file(path, shard=fs.TPSlice(1, 4, {"x": 1, "*": None}), chunk_bytes=4096, threads=2)
    assert path in str(ei.value) or getattr(ei.value, "path", None) == path
    assert mapping.wait_unmapped(30) and not mapped(path)
    assert not foxhunt_threads_at_work()
    assert {fd for fd in set(os.listdir("/proc/self/fd")) - fds if os.path.exists(f"/proc/self/fd/{fd}")} == set()
    monkeypatch.setattr(source, "fault_hook", None)
    out = fs.load_file(path, shard=fs.TPSlice(1, 4, {"x": 1, "*": None}), chunk_bytes=4096, threads=2)
    np.testing.assert_array_equal(out["x"], x[:, 1024:2048])


GPU0 = Device("cuda", 0)


def planned(path: str, shard, device: Device, **options):
    """The chunks the loader plans for a load of ``path`` to ``device`` (no GPU is touched)."""
    ck = open_checkpoint(path)
    names = list(ck.names)
    sels = loader.selections(ck, names, indices_for(ck, names, shard))
    return loader.prepare(ck, sels, fs.settings.merge(**options), device, order="whole").plan.chunks


SIZES = dict(chunk_bytes="64KiB", staging_bytes="256KiB", read_bytes="16KiB", threads=2)


def test_a_gpu_load_reads_in_read_bytes_and_gathers_whole_slots(in_cache, tmp_path, recorded_order):
    """To a GPU (through pinned slots) contiguous runs are read in read_bytes pieces and gathered
    column slices fill whole slots (chunk_bytes); a host load reads whole chunks into its arrays."""
    x = np.random.default_rng(5).standard_normal((256, 512)).astype(np.float32)   # 2 KiB rows
    path = save(tmp_path / "t.safetensors", {"a": x, "b": x + 1})
    shard = fs.TPSlice(0, 2, {"a": 0, "b": 1})
    chunks = planned(path, shard, GPU0, **SIZES)
    assert [c.run.span for c in chunks if c.dest == 0] == [16 << 10] * 16    # 256 KiB of rows in 16 KiB reads
    assert [c.run.nbytes for c in chunks if c.dest == 1] == [64 << 10] * 4   # 256 KiB of columns in 4 slots
    out = fs.load_file(path, shard=shard, **SIZES)
    np.testing.assert_array_equal(out["a"], x[:128])
    np.testing.assert_array_equal(out["b"], (x + 1)[:, :256])
    (host,) = recorded_order
    assert [c.run.span for c in host if c.dest == 0] == [64 << 10] * 4
    assert [c.run.nbytes for c in host if c.dest == 1] == [64 << 10] * 4


@pytest.mark.parametrize("resident, piece", [(1.0, 16 << 10), (0.2, 64 << 10)])
def test_a_cold_file_is_read_in_whole_slots(tmp_path, monkeypatch, resident, piece):
    """To a GPU, contiguous runs of a cached file are read in read_bytes pieces, of a cold one in
    whole slots (chunk_bytes); a safe_open handle plans with the files that were cold when opened."""
    monkeypatch.setattr(pagecache, "resident_fraction", lambda p, samples=64: resident)
    x = np.random.default_rng(6).standard_normal((128, 512)).astype(np.float32)   # 256 KiB
    path = save(tmp_path / "t.safetensors", {"x": x})
    assert [c.run.span for c in planned(path, None, GPU0, **SIZES)] == [piece] * ((256 << 10) // piece)
    with fs.safe_open(path, **SIZES) as f:
        np.testing.assert_array_equal(f.get_tensor("x"), x)
        assert [p.from_disk for p in f._policies] == [resident < read_policy.COLD_RESIDENT]
