"""fs.numpy, the drop-in for safetensors.numpy: the reference's four functions with its
arguments, bytes equal to the reference's, and what it loads."""

from __future__ import annotations

import inspect

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as stn

import foxhunt_stream as fs
import foxhunt_stream.numpy as fsn

ARRAYS = {
    "f64": np.linspace(0, 1, 6).reshape(2, 3),
    "u8": np.arange(5, dtype=np.uint8),
    "b": np.array([True, False]),
    "big": np.arange(4, dtype=">i4"),                          # written little-endian
    "strided": np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2],
}


@pytest.mark.parametrize("name", ["save", "save_file", "load", "load_file"])
def test_the_references_functions_take_its_arguments(name):
    theirs = inspect.signature(getattr(stn, name)).parameters
    mine = inspect.signature(getattr(fsn, name)).parameters
    assert list(mine)[:len(theirs)] == list(theirs)
    assert [p.kind for p in list(mine.values())[:len(theirs)]] == [p.kind for p in theirs.values()]


def test_save_gives_the_references_bytes():
    for meta in (None, {"a": "1"}):   # (with two keys the reference writes them in hash order)
        contiguous = {k: v for k, v in ARRAYS.items() if v.flags.c_contiguous}
        assert fsn.save(contiguous, metadata=meta) == stn.save(contiguous, metadata=meta)
    assert fsn.save({}) == stn.save({})


def test_load_reads_the_references_bytes_and_load_file_its_files(tmp_path):
    data = fsn.save(ARRAYS)
    for got in (fsn.load(data), fsn.load(bytearray(data))):
        for k, v in ARRAYS.items():
            np.testing.assert_array_equal(got[k], v)
            assert got[k].dtype == v.dtype.newbyteorder("=")
    fsn.save_file(ARRAYS, tmp_path / "a.safetensors", metadata={"k": "v"})
    assert (tmp_path / "a.safetensors").read_bytes() == fsn.save(ARRAYS, metadata={"k": "v"})
    for backend in (None, "pread", "mmap"):
        got = fsn.load_file(tmp_path / "a.safetensors", backend=backend)
        assert sorted(got) == sorted(ARRAYS)
        np.testing.assert_array_equal(got["strided"], ARRAYS["strided"])


def test_load_gives_writable_arrays_of_its_own():
    data = fsn.save({"x": np.zeros(3, np.float32)})
    x = fsn.load(data)["x"]
    x[0] = 1
    assert fsn.load(data)["x"][0] == 0


def test_load_reads_bfloat16_which_numpy_lacks():
    data = fsn.save({"h": np.array([1.5, -2], dtype=ml_dtypes.bfloat16)})
    assert fsn.load(data)["h"].dtype == ml_dtypes.bfloat16


def test_load_of_garbage_is_a_safetensor_error():
    with pytest.raises(fs.SafetensorError):
        fsn.load(b"not a checkpoint")


def test_the_module_is_foxhunt_stream_numpy():
    assert fs.numpy is fsn
