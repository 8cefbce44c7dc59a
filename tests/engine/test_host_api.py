"""The host (numpy, no GPU) API contract: safe_open, load_file, load_into, save_file.

Files are written by the reference serializer (safetensors.numpy) where it can, and results are
checked against plain numpy, never against foxhunt_stream itself. "Only the needed bytes are
read" is proved with the sources' byte counter (``source.total_bytes_read``).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
import safetensors.numpy as stn
from safetensors import safe_open as ref_safe_open

import foxhunt_stream as fs
from foxhunt_stream.io import sink, source
from foxhunt_stream.io.sink import TEMP_MARK

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tensors() -> dict[str, np.ndarray]:
    """Mixed dtypes, so file order (dtype, then name) differs from sorted order."""
    rng = np.random.default_rng(0)
    return {
        "a.bias": rng.standard_normal(7).astype(np.float32),
        "b.weight": rng.standard_normal((64, 96)).astype(np.float32),
        "c.cube": rng.standard_normal((6, 5, 4)).astype(np.float64),
        "d.table": rng.integers(-30000, 30000, (8, 12)).astype(np.int16),
        "e.mask": rng.integers(0, 2, (3, 3)).astype(bool),
        "f.scalar": np.array(3.5, np.float16),
        "g.empty": np.zeros((0, 4), np.int32),
        "h.ids": np.arange(10, dtype=np.uint64),
    }


@pytest.fixture
def ckpt(tmp_path):
    t = _tensors()
    path = tmp_path / "model.safetensors"
    stn.save_file(t, str(path), metadata={"format": "np"})
    return path, t


def _read(fn, *a, **k):
    """(result, tensor bytes read by every source while fn ran)."""
    before = source.total_bytes_read()
    out = fn(*a, **k)
    return out, source.total_bytes_read() - before


def _temps(directory) -> list[str]:
    return [n for n in os.listdir(directory) if TEMP_MARK in n]


# ---------------------------------------------------------------- safe_open

def test_safe_open_header_api_matches_reference(ckpt):
    path, t = ckpt
    with fs.safe_open(path, framework="numpy", device="cpu") as f, ref_safe_open(str(path), "np") as r:
        assert f.keys() == sorted(t) == sorted(r.keys())
        assert f.offset_keys() == r.offset_keys()
        assert f.offset_keys() != f.keys()   # the fixture really tells the two orders apart
        assert f.metadata() == r.metadata() == {"format": "np"}
        for name in t:
            s = f.get_slice(name)
            assert s.get_shape() == list(t[name].shape) == r.get_slice(name).get_shape()
            assert s.get_dtype() == r.get_slice(name).get_dtype()
        assert f.get_slice("b.weight").get_dtype() == "F32"
        assert f.get_slice("e.mask").get_dtype() == "BOOL"


def test_safe_open_no_metadata_is_none(tmp_path):
    path = tmp_path / "m.safetensors"
    stn.save_file({"x": np.ones(2, np.float32)}, str(path))
    with fs.safe_open(path, framework="numpy") as f:
        assert f.metadata() is None


def test_get_tensor_equals_source_and_reads_only_that_tensor(ckpt):
    path, t = ckpt
    with fs.safe_open(path, framework="numpy", device="cpu") as f:
        for name, want in t.items():
            got, nread = _read(f.get_tensor, name)
            assert isinstance(got, np.ndarray)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
            assert nread == want.nbytes
        with pytest.raises(KeyError, match="nope"):
            f.get_tensor("nope")
        with pytest.raises(KeyError, match="nope"):
            f.get_slice("nope")


SLICES = [
    np.s_[...], np.s_[:], np.s_[2], np.s_[-1], np.s_[1:4], np.s_[1:4, 2], np.s_[:, 1:3],
    np.s_[::2], np.s_[1:5:2, ::3], np.s_[..., 1], np.s_[2, 3, 1], np.s_[0:0], np.s_[:, :, 1:3],
    np.s_[4:100], np.s_[-3:, 1:-1], np.s_[3, ..., 2:],
]


def _covered_span(shape, itemsize, index) -> int:
    """Bytes from the first selected element to the last one, computed with numpy alone."""
    flat = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)[index]
    flat = np.atleast_1d(flat)
    if flat.size == 0:
        return 0
    return int(flat.max() - flat.min() + 1) * itemsize


@pytest.mark.parametrize("chunk_bytes", [4096, None])
@pytest.mark.parametrize("index", SLICES, ids=[repr(s) for s in SLICES])
def test_get_slice_matches_numpy_and_reads_only_covered_bytes(ckpt, index, chunk_bytes):
    path, t = ckpt
    name = "c.cube"
    want = t[name][index]
    with fs.safe_open(path, framework="numpy", chunk_bytes=chunk_bytes) as f:
        got, nread = _read(f.get_slice(name).__getitem__, index)
    assert got.shape == np.shape(want)
    np.testing.assert_array_equal(got, want)
    assert np.asarray(want).nbytes <= nread <= _covered_span(t[name].shape, 8, index)


def test_row_slice_reads_exactly_its_rows(ckpt):
    path, t = ckpt
    w = t["b.weight"]                     # 64 rows of 96 float32
    with fs.safe_open(path, framework="numpy") as f:
        s = f.get_slice("b.weight")
        got, nread = _read(s.__getitem__, np.s_[10:13])
        np.testing.assert_array_equal(got, w[10:13])
        assert nread == 3 * 96 * 4
        got, nread = _read(s.__getitem__, np.s_[20:22, 5:9])   # column slice: only the covered rows' span
        np.testing.assert_array_equal(got, w[20:22, 5:9])
        assert nread == 96 * 4 + 4 * 4


def test_tensors_iterator(ckpt):
    path, t = ckpt
    with fs.safe_open(path, framework="numpy") as f:
        order = f.offset_keys()
        seen = []
        for name, arr in f.tensors():
            seen.append(name)
            np.testing.assert_array_equal(arr, t[name])
        assert seen == order
        picked, nread = _read(lambda: list(f.tensors(names=["h.ids", "a.bias"])))
        assert [n for n, _ in picked] == ["h.ids", "a.bias"]
        assert nread == t["h.ids"].nbytes + t["a.bias"].nbytes
        assert [n for n, _ in f.tensors(names="*.weight")] == ["b.weight"]
        # leaving the iterator early stops the load and leaves the handle usable
        it = f.tensors()
        next(it)
        it.close()
        np.testing.assert_array_equal(f.get_tensor("d.table"), t["d.table"])


def test_closed_handle_errors_and_arrays_outlive_it(ckpt):
    path, t = ckpt
    with fs.safe_open(path, framework="numpy") as f:
        kept = f.get_tensor("b.weight")
        part = f.get_slice("b.weight")[1:3]
        sl = f.get_slice("d.table")
    for call in (f.keys, f.offset_keys, f.metadata, lambda: f.get_tensor("a.bias"),
                 lambda: f.get_slice("a.bias"), lambda: list(f.tensors())):
        with pytest.raises(ValueError, match="closed"):
            call()
    with pytest.raises(ValueError, match="closed"):
        with f:
            pass
    np.testing.assert_array_equal(sl[0], t["d.table"][0])   # a slice outlives its handle, as in safetensors
    # the arrays own their memory: overwriting and deleting the file does not touch them
    stn.save_file({"b.weight": np.zeros((64, 96), np.float32)}, str(path))
    os.unlink(path)
    np.testing.assert_array_equal(kept, t["b.weight"])
    np.testing.assert_array_equal(part, t["b.weight"][1:3])


# ---------------------------------------------------------------- load_file

@pytest.mark.parametrize("names, want", [
    (None, sorted(_tensors())),
    (["d.table", "a.bias"], ["a.bias", "d.table"]),
    ("[ab].*", ["a.bias", "b.weight"]),
    (lambda n: n.startswith(("c.", "h.")), ["c.cube", "h.ids"]),
    ([], []),   # an empty list asks for nothing (a glob matching nothing is a KeyError: test_user_errors)
])
def test_load_file_selection_reads_only_selected_bytes(ckpt, names, want):
    path, t = ckpt
    out, nread = _read(fs.load_file, path, device="cpu", names=names)
    assert sorted(out) == want
    for n in want:
        assert out[n].dtype == t[n].dtype
        np.testing.assert_array_equal(out[n], t[n])
    assert nread == sum(t[n].nbytes for n in want)


def test_load_file_list_keeps_caller_order_and_rejects_unknown(ckpt):
    path, _ = ckpt
    assert list(fs.load_file(path, names=["h.ids", "a.bias"])) == ["h.ids", "a.bias"]
    with pytest.raises(KeyError, match="missing.one"):
        fs.load_file(path, names=["a.bias", "missing.one"])


def test_background_load_timeout_keeps_the_load_alive(ckpt, monkeypatch):
    """result(timeout) that times out must not close the files under the running workers."""
    path, t = ckpt
    monkeypatch.setattr(source, "fault_hook", lambda src, off, n: time.sleep(0.02))
    h = fs.load_file(path, names=["b.weight"], background=True, chunk_bytes=4096, threads=2)
    with pytest.raises(TimeoutError):
        h.result(timeout=0.001)
    out = h.result()
    np.testing.assert_array_equal(out["b.weight"], t["b.weight"])


# ---------------------------------------------------------------- load_into

def _addr(a) -> int:
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data_ptr()


def test_load_into_fills_existing_arrays_in_place(ckpt):
    path, t = ckpt
    store = {n: np.full_like(a, 7) for n, a in t.items()}
    arrays = dict(store)
    addrs = {n: _addr(a) for n, a in store.items()}
    meta, nread = _read(fs.load_into, store, path)
    assert meta == {"format": "np"}
    assert nread == sum(a.nbytes for a in t.values())
    for n, a in t.items():
        assert store[n] is arrays[n] and _addr(store[n]) == addrs[n]
        np.testing.assert_array_equal(store[n], a)


def test_load_into_without_metadata_returns_empty_map(tmp_path):
    path = tmp_path / "m.safetensors"
    stn.save_file({"x": np.arange(3, dtype=np.float32)}, str(path))
    store = {"x": np.zeros(3, np.float32)}
    assert fs.load_into(store, path) == {}


def _snapshot(store):
    return {n: np.array(a, copy=True) for n, a in store.items()}


def test_load_into_mismatch_lists_every_problem_and_touches_nothing(ckpt):
    path, t = ckpt
    store = {n: np.full_like(a, 7) for n, a in t.items() if n not in ("h.ids", "g.empty")}
    store["b.weight"] = np.full((96, 64), 7, np.float32)          # shape
    store["d.table"] = np.full((8, 12), 7, np.int32)              # dtype
    store["c.cube"] = np.full((6, 5, 4), 7, ">f8")                # byte order is a dtype mismatch too
    ro = np.full(7, 7, np.float32)
    ro.flags.writeable = False
    store["a.bias"] = ro                                          # read-only destination
    store["e.mask"] = np.zeros((3, 3), bool, order="F")[:, ::-1]  # non-contiguous destination
    store["extra.param"] = np.zeros(3, np.float32)                # missing from the file
    before = _snapshot(store)
    with pytest.raises(fs.StoreMismatchError) as ei:
        fs.load_into(store, path)
    err = ei.value
    text = str(err)
    for n in ("b.weight", "d.table", "c.cube", "a.bias", "e.mask", "extra.param", "h.ids", "g.empty"):
        assert n in text, n
    assert err.missing == ["extra.param"]
    assert sorted(err.unexpected) == ["g.empty", "h.ids"]
    assert len(err.problems) == 8
    assert "[96, 64]" in text and "[64, 96]" in text
    for n, a in store.items():
        np.testing.assert_array_equal(a, before[n])


def test_load_into_store_untouched_reads_nothing(ckpt):
    path, t = ckpt
    store = {n: np.full_like(a, 7) for n, a in t.items()}
    store["b.weight"] = np.full((2, 2), 7, np.float32)
    before = _snapshot(store)
    b = source.total_bytes_read()
    with pytest.raises(fs.StoreMismatchError):
        fs.load_into(store, path)
    assert source.total_bytes_read() == b
    for n, a in store.items():
        np.testing.assert_array_equal(a, before[n])


def test_load_into_non_strict_skips_and_warns(ckpt):
    path, t = ckpt
    store = {"a.bias": np.zeros(7, np.float32), "d.table": np.zeros((8, 12), np.int16),
             "not.in.file": np.full(4, 5, np.float32)}
    with pytest.warns(fs.LoadIntoWarning) as rec:
        _, nread = _read(fs.load_into, store, path, strict=False)
    w = rec[0].message
    assert w.missing == ["not.in.file"]
    assert sorted(w.unexpected) == sorted(set(t) - {"a.bias", "d.table"})
    assert nread == t["a.bias"].nbytes + t["d.table"].nbytes
    np.testing.assert_array_equal(store["a.bias"], t["a.bias"])
    np.testing.assert_array_equal(store["d.table"], t["d.table"])
    np.testing.assert_array_equal(store["not.in.file"], np.full(4, 5, np.float32))
    # a shape mismatch is an error even when not strict
    store["a.bias"] = np.zeros(8, np.float32)
    with pytest.raises(fs.StoreMismatchError, match="a.bias"):
        fs.load_into(store, path, strict=False)


def test_load_into_strict_exact_match_does_not_warn(ckpt):
    path, t = ckpt
    store = {n: np.empty_like(a) for n, a in t.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fs.load_into(store, path)


def test_load_into_torch_cpu_store(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    src = {n: torch.randn_like(p) for n, p in model.state_dict().items()}
    path = tmp_path / "t.safetensors"
    safetensors_torch = pytest.importorskip("safetensors.torch")
    safetensors_torch.save_file(src, str(path), metadata={"step": "3"})
    params = dict(model.named_parameters())
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    assert fs.load_into(model.state_dict(), path) == {"step": "3"}
    for n, p in params.items():
        assert p.data_ptr() == ptrs[n]
        assert torch.equal(p.detach(), src[n])
    assert params["0.weight"].requires_grad
    # dtype mismatch on a torch store is listed, the store untouched
    store = {n: torch.zeros_like(v) for n, v in src.items()}
    store["0.bias"] = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(fs.StoreMismatchError, match="0.bias"):
        fs.load_into(store, path)
    assert all(not v.any() for v in store.values())


# ---------------------------------------------------------------- save_file

def _ref_bytes(tmp_path, tensors, metadata=None) -> bytes:
    p = tmp_path / "ref.safetensors"
    stn.save_file(tensors, str(p), metadata=metadata)
    return p.read_bytes()


NON_CONTIGUOUS = {
    "transposed": lambda: np.arange(48, dtype=np.float32).reshape(6, 8).T,
    "strided": lambda: np.arange(64, dtype=np.int16).reshape(8, 8)[:, ::3],
    "reversed": lambda: np.arange(20, dtype=np.float64)[::-1],
    "broadcast": lambda: np.broadcast_to(np.arange(5, dtype=np.int32), (4, 5)),
    "permuted3d": lambda: np.arange(120, dtype=np.uint8).reshape(2, 3, 20).transpose(2, 0, 1),
    "empty": lambda: np.zeros((4, 6), np.float32)[:0, ::2],
    "column": lambda: np.arange(30, dtype=np.float32).reshape(10, 3)[:, 1:2],
}


@pytest.mark.parametrize("kind", sorted(NON_CONTIGUOUS))
def test_save_non_contiguous_writes_logical_content(tmp_path, kind):
    x = NON_CONTIGUOUS[kind]()
    assert not x.flags.c_contiguous or x.size == 0
    t = {"x": x, "y": np.ones(3, np.float32)}
    fs.save_file(t, tmp_path / "x.safetensors", chunk_bytes=4096)
    want = _ref_bytes(tmp_path, {k: np.ascontiguousarray(v) for k, v in t.items()})
    assert (tmp_path / "x.safetensors").read_bytes() == want


def test_save_non_contiguous_chunked_rows(tmp_path):
    """Row-wise pieces of a non-contiguous array across many chunks land in order."""
    x = np.arange(200 * 300, dtype=np.float32).reshape(200, 300)[:, ::2]   # 600 B rows, 4 KiB chunks
    fs.save_file({"x": x}, tmp_path / "x.safetensors", chunk_bytes=4096, threads=2)
    assert (tmp_path / "x.safetensors").read_bytes() == _ref_bytes(tmp_path, {"x": np.ascontiguousarray(x)})


def test_save_torch_non_contiguous(tmp_path):
    torch = pytest.importorskip("torch")
    x = torch.arange(60, dtype=torch.float32).reshape(6, 10).t()
    fs.save_file({"x": x}, tmp_path / "x.safetensors", chunk_bytes=4096)
    want = _ref_bytes(tmp_path, {"x": np.ascontiguousarray(x.numpy())})
    assert (tmp_path / "x.safetensors").read_bytes() == want


@pytest.mark.parametrize("dtype", [">f4", ">i8", ">u2", ">f8", ">c8"])
def test_save_big_endian_written_little_endian(tmp_path, dtype):
    x = (np.arange(24) - 5).astype(dtype).reshape(4, 6)
    t = {"x": x, "xt": x.T}
    fs.save_file(t, tmp_path / "x.safetensors", metadata={"k": "v"})
    want = _ref_bytes(tmp_path, {k: np.ascontiguousarray(v).astype(v.dtype.newbyteorder("<"))
                                 for k, v in t.items()}, {"k": "v"})
    assert (tmp_path / "x.safetensors").read_bytes() == want
    out = fs.load_file(tmp_path / "x.safetensors")
    np.testing.assert_array_equal(out["x"], x)
    assert out["x"].dtype.byteorder in "=<|"


def test_save_protocol_is_temp_fsync_rename_fsync_dir(tmp_path, monkeypatch):
    """The bytes go to a temp file in the same directory, which is fsynced, renamed over the
    target, and then the directory is fsynced (so the rename itself is durable)."""
    path, _, _ = _old_file(tmp_path)
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(a, b):
        events.append(("replace", os.fspath(a), os.fspath(b)))
        real_replace(a, b)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    fs.save_file(_new_tensors(), path)
    monkeypatch.undo()
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"], events
    tmp = events[0][1]
    assert os.path.dirname(tmp) == str(tmp_path) and TEMP_MARK in os.path.basename(tmp)
    assert events[1] == ("replace", tmp, str(path))
    assert events[2] == ("fsync", str(tmp_path))
    out = stn.load_file(str(path))
    assert sorted(out) == sorted(_new_tensors())


def test_save_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        fs.save_file({"x": np.ones(2, np.float32)}, tmp_path / "nope" / "x.safetensors")
    assert not (tmp_path / "nope").exists()


def _old_file(tmp_path):
    path = tmp_path / "model.safetensors"
    stn.save_file({"old": np.arange(1000, dtype=np.float32)}, str(path))
    return path, path.read_bytes(), os.stat(path).st_ino


def _new_tensors():
    return {f"w{i}": np.full((64, 256), i, np.float32) for i in range(6)}   # 6 x 64 KiB


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    OSError(errno.EFBIG, "File too large"),
    RuntimeError("boom midway"),
])
@pytest.mark.parametrize("at_write", [0, 4])
def test_save_failure_midway_leaves_old_file_and_no_temp(tmp_path, monkeypatch, error, at_write):
    path, old, ino = _old_file(tmp_path)
    count = iter(range(10**6))

    def hook(sink_, offset, length):
        if next(count) == at_write:
            raise error
    monkeypatch.setattr(sink, "fault_hook", hook)
    with pytest.raises(type(error)) as ei:
        fs.save_file(_new_tensors(), path, chunk_bytes=16 << 10, threads=2)
    if isinstance(error, OSError):   # an injected write error reads like a real one: errno kept, file named
        assert ei.value.errno == error.errno and str(path) in str(ei.value)
    else:
        assert ei.value is error
    assert path.read_bytes() == old and os.stat(path).st_ino == ino
    assert _temps(tmp_path) == []


def test_save_failure_at_commit_leaves_old_file(tmp_path, monkeypatch):
    path, old, _ = _old_file(tmp_path)

    def fail_replace(a, b):
        raise OSError(errno.EXDEV, "rename failed")
    monkeypatch.setattr(sink.os, "replace", fail_replace)
    with pytest.raises(OSError, match="rename failed"):
        fs.save_file(_new_tensors(), path)
    monkeypatch.undo()
    assert path.read_bytes() == old
    assert _temps(tmp_path) == []


def test_save_bad_input_writes_nothing(tmp_path):
    path, old, _ = _old_file(tmp_path)
    with pytest.raises(TypeError, match="bad"):
        fs.save_file({"a": np.ones(3, np.float32), "bad": [1, 2, 3]}, path)
    with pytest.raises(TypeError):
        fs.save_file({"a": np.ones(3, np.float32)}, path, metadata={"k": 1})
    assert path.read_bytes() == old
    assert _temps(tmp_path) == []


def test_save_interrupted_waiter_stops_workers_before_cleanup(tmp_path, monkeypatch):
    """An exception raised in the saving thread (Ctrl-C, a signal handler) must not remove the
    temp file and close its descriptor while worker threads are still writing to it.
    (Transposed inputs: converted piecewise, so the save runs on worker threads.)"""
    path, old, _ = _old_file(tmp_path)
    tensors = {n: a.T for n, a in _new_tensors().items()}

    class Interrupt(Exception):
        pass

    def slow(sink_, offset, length):
        if threading.current_thread().name.startswith("foxhunt-save"):
            time.sleep(0.3)
    monkeypatch.setattr(sink, "fault_hook", slow)

    def handler(signum, frame):
        raise Interrupt()
    prev = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(Interrupt):
            fs.save_file(tensors, path, chunk_bytes=16 << 10, threads=2)
        alive = [t.name for t in threading.enumerate() if t.name.startswith("foxhunt-save") and t.is_alive()]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, prev)
    assert alive == []
    assert path.read_bytes() == old
    assert _temps(tmp_path) == []


# ---------------------------------------------------------------- truncation under an open handle

_TRUNCATE_SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    import foxhunt_stream as fs
    path, backend = sys.argv[1], sys.argv[2]
    opts = {"pread": dict(backend="pread", direct_io="off"), "mmap": dict(backend="mmap", direct_io="off"),
            "auto": dict(backend="auto", direct_io="off"), "direct": dict(direct_io="on")}[backend]

    def attempt(label, fn):
        try:
            fn()
            print(label, "ok")
        except fs.FormatError as e:
            print(label, "FormatError", e.rule, e.path == path)

    if backend == "auto":   # "in the page cache" even if another process dropped the caches meanwhile
        from foxhunt_stream.io import pagecache
        pagecache.resident_fraction = lambda p, samples=64: 1.0
    with fs.safe_open(path, framework="numpy", **opts) as f:
        print("backend", f._sources[0].backend)
        order = f.offset_keys()                       # first, middle, last
        f.get_tensor(order[0])
        info = fs.read_header(path)
        mid = info.by_name[order[1]]
        os.truncate(path, info.data_start + mid.start + mid.nbytes // 2)   # cut the middle tensor in half
        attempt("before-cut", lambda: f.get_tensor(order[0]))
        attempt("first-rows", lambda: f.get_slice(order[1])[0:1])
        attempt("columns-before-cut", lambda: f.get_slice(order[0])[:, 1:3])
        attempt("columns", lambda: f.get_slice(order[1])[:, 1:3])   # rows on both sides of the cut
        attempt("cut", lambda: f.get_tensor(order[1]))
        attempt("slice-past-cut", lambda: f.get_slice(order[1])[-1])
        attempt("after-cut", lambda: f.get_tensor(order[2]))
        attempt("iterate", lambda: list(f.tensors()))
        os.truncate(path, 0)
        attempt("emptied", lambda: f.get_tensor(order[0]))
""")


@pytest.mark.parametrize("backend", ["pread", "mmap", "auto", "direct"])
def test_truncated_under_open_handle_is_format_error_not_sigbus(tmp_path, backend):
    path = tmp_path / "t.safetensors"
    # three 1 MiB tensors: the cut lands far from page and chunk boundaries of the middle one
    stn.save_file({"a": np.ones((256, 1024), np.float32), "b": np.full((256, 1024), 2, np.float32),
                   "c": np.full((256, 1024), 3, np.float32)}, str(path))
    r = subprocess.run([sys.executable, "-c", _TRUNCATE_SCRIPT, str(path), backend], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, f"rc={r.returncode} (-7 is SIGBUS)\n{r.stdout}\n{r.stderr}"
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    if backend == "direct" and lines["backend"] != "direct":
        pytest.skip("this filesystem does not support O_DIRECT")
    assert lines["backend"] == backend
    # bytes before the cut are still readable, but the file changed since its header was read:
    # refused as file-changed (the load's end check), never handed back as if nothing happened
    assert lines["before-cut"] == "FormatError file-changed True"
    assert lines["first-rows"] == "FormatError file-changed True"
    assert lines["columns-before-cut"] == "FormatError file-changed True"
    for label in ("columns", "cut", "slice-past-cut", "after-cut", "iterate", "emptied"):
        assert lines[label] == "FormatError file-truncated True", (label, r.stdout)


def test_auto_write_backend_maps_only_tmpfs_with_many_writers(tmp_path):
    """``write_backend="auto"`` maps only where mapping was measured faster: big files on tmpfs
    written by many threads. On a disk filesystem, or with few writers, it is pwrite."""
    size = sink.MAP_MIN_BYTES
    for writers, fsync in ((1, False), (sink.MAP_MIN_WRITERS, False), (sink.MAP_MIN_WRITERS, True)):
        f = sink.AtomicFile(tmp_path / "x.bin", size, fsync=fsync, writers=writers)
        f.abort()
        if not sink._in_memory_fs(str(tmp_path)):
            assert f.backend == "pwrite", (writers, fsync)
    shm = "/dev/shm"
    if not (os.path.isdir(shm) and sink._in_memory_fs(shm) and os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize
            > 4 * size):
        pytest.skip("no tmpfs at /dev/shm with room for the mapped case")
    few = sink.AtomicFile(os.path.join(shm, "foxhunt-auto-few.bin"), size, fsync=False, writers=2)
    few.abort()
    many = sink.AtomicFile(os.path.join(shm, "foxhunt-auto-many.bin"), size, fsync=False,
                           writers=sink.MAP_MIN_WRITERS)
    many.abort()
    small = sink.AtomicFile(os.path.join(shm, "foxhunt-auto-small.bin"), size - 1, fsync=False,
                            writers=sink.MAP_MIN_WRITERS)
    small.abort()
    assert (few.backend, many.backend, small.backend) == ("pwrite", "mmap", "pwrite")
