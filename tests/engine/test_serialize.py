"""safetensors' low-level API: TensorSpec (dtype, shape and a raw pointer), serialize,
serialize_file and deserialize, with the installed safetensors as the oracle."""

from __future__ import annotations

import os

import numpy as np
import pytest
import safetensors
import safetensors.numpy as stn

import foxhunt_stream as fs

ARRAYS = {
    "w": np.arange(24, dtype=np.float32).reshape(4, 6),
    "ids": np.array([3, 1, 4, 1, 5], dtype=np.int64),
    "flag": np.array(True),
    "empty": np.zeros((0, 3), dtype=np.int8),
}


def _specs(make, arrays=ARRAYS) -> dict:
    return {k: make(dtype=v.dtype.name, shape=v.shape, data_ptr=v.ctypes.data, data_len=v.nbytes)
            for k, v in arrays.items()}


def test_serialize_gives_the_references_bytes():
    for meta in (None, {"a": "1"}):
        ours = fs.serialize(_specs(fs.TensorSpec), metadata=meta)
        assert type(ours) is bytes
        assert ours == safetensors.serialize(_specs(safetensors.TensorSpec), metadata=meta)


def test_serialize_file_writes_what_serialize_returns_and_nothing_else(tmp_path):
    fs.serialize_file(_specs(fs.TensorSpec), tmp_path / "s.safetensors", metadata={"k": "v"})
    assert (tmp_path / "s.safetensors").read_bytes() == fs.serialize(_specs(fs.TensorSpec), metadata={"k": "v"})
    assert os.listdir(tmp_path) == ["s.safetensors"]


def test_deserialize_gives_each_tensors_raw_bytes_in_file_order():
    data = stn.save(ARRAYS, metadata={"k": "v"})
    ours = fs.deserialize(data)
    assert [n for n, _ in ours] == fs.safe_open(memoryview(data), "numpy").offset_keys()
    assert dict(ours) == dict(safetensors.deserialize(data))
    assert all(type(entry["data"]) is bytearray for _, entry in ours)


def test_deserialize_of_a_malformed_buffer_is_a_format_error():
    with pytest.raises(fs.FormatError) as e:
        fs.deserialize(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    assert isinstance(e.value, fs.SafetensorError)


def test_a_spec_reports_the_headers_dtype_and_logical_shape():
    spec = fs.TensorSpec(dtype="bfloat16", shape=(3, 2), data_ptr=0, data_len=0)
    assert (spec.dtype, spec.shape, spec.data_ptr, spec.data_len) == ("BF16", [3, 2], 0, 0)
    packed = fs.TensorSpec(dtype="float4_e2m1fn_x2", shape=[2, 3], data_ptr=0, data_len=0)
    ref = safetensors.TensorSpec(dtype="float4_e2m1fn_x2", shape=[2, 3], data_ptr=0, data_len=0)
    assert (packed.dtype, packed.shape) == (ref.dtype, ref.shape) == ("F4", [2, 6])   # two values a byte


@pytest.mark.parametrize("dtype", ["nonsense", "F32", "float6_e2m3fn", "object"])
def test_an_unknown_dtype_is_refused_when_the_spec_is_made(dtype):
    with pytest.raises(fs.SafetensorError, match=f'Unknown dtype "{dtype}"'):
        fs.TensorSpec(dtype=dtype, shape=[1], data_ptr=0, data_len=0)
    with pytest.raises(safetensors.SafetensorError):
        safetensors.TensorSpec(dtype=dtype, shape=[1], data_ptr=0, data_len=0)


@pytest.mark.parametrize("shape", ["ab", [-1], [1.5]])
def test_a_bad_shape_is_a_type_error(shape):
    with pytest.raises(TypeError, match="shape"):
        fs.TensorSpec(dtype="float32", shape=shape, data_ptr=0, data_len=0)


def test_a_length_that_does_not_fit_is_refused_before_the_pointer_is_read():
    lying = fs.TensorSpec(dtype="float32", shape=[1 << 20], data_ptr=8, data_len=4)   # a bogus pointer
    with pytest.raises(fs.SafetensorError, match="invalid shape"):
        fs.serialize({"x": lying})
    with pytest.raises(fs.SafetensorError, match="null data_ptr"):
        fs.serialize({"x": fs.TensorSpec(dtype="float32", shape=[1], data_ptr=0, data_len=4)})


def test_serialize_takes_specs_only():
    with pytest.raises(TypeError):
        fs.serialize({"x": {"dtype": "float32", "shape": [1], "data_ptr": 0, "data_len": 0}})
    with pytest.raises(TypeError, match="got 7"):
        fs.serialize({7: fs.TensorSpec(dtype="float32", shape=[0], data_ptr=0, data_len=0)})
    with pytest.raises(TypeError):
        fs.serialize(["x"])


def test_the_numpy_module_re_exports_them_as_safetensors_numpy_does():
    import foxhunt_stream.numpy as fsn
    for name in ("TensorSpec", "serialize", "serialize_file", "deserialize", "safe_open"):
        assert getattr(fsn, name) is getattr(fs, name) and hasattr(stn, name)
