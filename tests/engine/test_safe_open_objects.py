"""safe_open as safetensors' safe_open and _safe_open_handle: file objects (with a descriptor or
without), buffers, get_tensors, slices that outlive their handle, and the errors of a closed
handle and of a missing tensor."""

from __future__ import annotations

import gc
import io
import os

import numpy as np
import pytest
import safetensors.numpy as stn

import foxhunt_stream as fs
from foxhunt_stream.errors import HandleClosedError, TensorNotFoundError

ARRAYS = {
    "w": np.arange(24, dtype=np.float32).reshape(4, 6),
    "ids": np.array([3, 1, 4, 1, 5], dtype=np.int64),
    "flag": np.array(True),
    "empty": np.zeros((0, 3), dtype=np.int8),
}


@pytest.fixture
def data() -> bytes:
    return stn.save(ARRAYS, metadata={"origin": "test"})


@pytest.fixture
def path(tmp_path, data):
    p = tmp_path / "f.safetensors"
    p.write_bytes(data)
    return p


def _same(got: dict, want: dict = ARRAYS) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        np.testing.assert_array_equal(got[k], v)


def _open_fds() -> int:
    """Descriptors open now, counted after a collection: another test's garbage closing its file
    during this test's ``gc.collect()`` would otherwise pass for this test's file let go."""
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def test_get_tensors_lands_every_tensor_in_file_order(path):
    with fs.safe_open(path, "numpy") as f:
        got = f.get_tensors()
        assert list(got) == f.offset_keys()
    _same(got)


@pytest.mark.parametrize("mode", ["rb", "r"])
def test_a_file_object_binary_or_text_is_read_through_its_file(path, mode):
    with open(path, mode) as f, fs.safe_open(f, framework="numpy") as g:
        assert g.metadata() == {"origin": "test"}
        _same(g.get_tensors())


def test_a_renamed_then_deleted_file_is_still_read_through_its_descriptor(path):
    with open(path, "rb") as f:
        os.rename(path, path.with_suffix(".moved"))
        os.unlink(path.with_suffix(".moved"))
        with fs.safe_open(f, "numpy") as g:
            np.testing.assert_array_equal(g.get_tensor("w"), ARRAYS["w"])


def test_bytes_written_through_the_file_object_are_seen(tmp_path, data):
    with open(tmp_path / "w.safetensors", "wb+") as f:
        f.write(data)   # still in f's buffer
        with fs.safe_open(f, "numpy") as g:
            _same(g.get_tensors())


def test_safe_open_handle_takes_an_fsspec_file_under_safetensors_name(path):
    fsspec = pytest.importorskip("fsspec")
    with fsspec.filesystem("file").open(str(path), "rb") as f, fs._safe_open_handle(f, "np", "cpu") as g:
        _same({k: g.get_tensor(k) for k in g.keys()})
    with open(path, "rb") as f, fs._safe_open_handle(f=f, framework="np") as g:
        assert g.keys() == sorted(ARRAYS)


class Remote:
    """A file object without a descriptor (a remote file, say) that counts the bytes it serves."""

    def __init__(self, data: bytes, seekable: bool = True) -> None:
        self._b = io.BytesIO(data)
        self._seekable = seekable
        self.served = 0

    def read(self, n: int = -1) -> bytes:
        out = self._b.read(n)
        self.served += len(out)
        return out

    def seek(self, offset: int, whence: int = 0) -> int:
        if not self._seekable:
            raise io.UnsupportedOperation("seek")
        return self._b.seek(offset, whence)

    def seekable(self) -> bool:
        return self._seekable


def test_a_file_object_without_a_descriptor_is_read_only_where_asked(data):
    f = Remote(data)
    with fs.safe_open(f, "numpy") as g:
        after_header = f.served
        np.testing.assert_array_equal(g.get_slice("w")[1:3, 2], ARRAYS["w"][1:3, 2])
    assert 0 < f.served - after_header <= 2 * 6 * 4   # at most two rows of "w"


def test_a_stream_that_cannot_seek_is_read_whole_once(data):
    with fs.safe_open(Remote(data, seekable=False), "numpy") as g:
        _same(g.get_tensors())


def test_buffers_and_bytes_io_are_read_in_place(data):
    for src in (memoryview(data), bytearray(data), io.BytesIO(data)):
        with fs.safe_open(src, "numpy") as g:
            _same(g.get_tensors())
            np.testing.assert_array_equal(g.get_slice("w")[:, 1:3], ARRAYS["w"][:, 1:3])


def test_a_malformed_stream_is_a_format_error_naming_it():
    with pytest.raises(fs.FormatError, match="Remote"):
        fs.safe_open(Remote(b"\xff" * 8 + b"{}"), "numpy")


def test_a_truncated_buffer_is_a_format_error(data):
    with pytest.raises(fs.FormatError, match="<bytes>"):
        fs.safe_open(memoryview(data[:-8]), "numpy")


def test_a_closed_handle_raises_safetensors_error_which_is_still_a_value_error(path):
    g = fs.safe_open(path, "numpy")
    with g:
        pass
    for call in (g.keys, g.offset_keys, g.metadata, g.get_tensors, lambda: g.get_tensor("w"),
                 lambda: g.get_slice("w"), lambda: list(g.tensors())):
        with pytest.raises(HandleClosedError, match="File is closed") as e:
            call()
        assert isinstance(e.value, fs.SafetensorError) and isinstance(e.value, ValueError)


def test_a_missing_tensor_is_a_safetensor_error_and_a_key_error(path):
    with fs.safe_open(path, "numpy") as g:
        for call in (g.get_tensor, g.get_slice):
            with pytest.raises(TensorNotFoundError, match="File does not contain tensor nope") as e:
                call("nope")
            assert isinstance(e.value, fs.SafetensorError) and isinstance(e.value, KeyError)


def test_a_slice_outlives_its_handle_and_then_lets_the_file_go(path):
    before = _open_fds()
    with fs.safe_open(path, "numpy") as g:
        rows = g.get_slice("w")
    np.testing.assert_array_equal(rows[2:], ARRAYS["w"][2:])   # after close, as in safetensors
    assert _open_fds() > before
    del rows
    gc.collect()
    assert _open_fds() == before


def test_a_handle_dropped_without_close_lets_the_file_go(path):
    before = _open_fds()
    g = fs.safe_open(path, "numpy")
    assert _open_fds() > before
    del g
    gc.collect()
    assert _open_fds() == before
