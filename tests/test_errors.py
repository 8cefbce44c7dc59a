"""Exception types: ``fs.SafetensorError`` is the base of every error raised where safetensors
raises its ``SafetensorError``, and each such error keeps the builtin type foxhunt_stream raised
before, so an existing ``except ValueError`` still catches what it caught."""

from __future__ import annotations

import importlib
import pickle

import numpy as np
import pytest
import safetensors

import foxhunt_stream as fs
from foxhunt_stream import errors


@pytest.mark.parametrize("cls, builtin", [
    (errors.FormatError, ValueError), (errors.ChecksumError, ValueError),
    (errors.HandleClosedError, ValueError), (errors.TensorNotFoundError, KeyError),
    (errors.SliceError, IndexError), (errors.UnsupportedTypeError, TypeError),
    (errors.OptionError, ValueError), (errors.DeviceError, RuntimeError),
])
def test_each_error_is_a_safetensor_error_and_keeps_its_builtin_type(cls, builtin):
    assert issubclass(cls, fs.SafetensorError) and issubclass(cls, builtin)


def test_where_safetensors_raises_builtins_so_do_we():
    assert not issubclass(errors.SparseTensorError, fs.SafetensorError)
    assert issubclass(errors.SparseTensorError, ValueError)
    assert issubclass(errors.MetaTensorError, NotImplementedError) and issubclass(errors.MetaTensorError, RuntimeError)
    assert issubclass(errors.NotATensorError, ValueError) and issubclass(errors.NotATensorError, TypeError)


def test_safetensor_error_is_importable_from_its_module_and_pickles():
    assert importlib.import_module(fs.SafetensorError.__module__).SafetensorError is fs.SafetensorError
    err = pickle.loads(pickle.dumps(fs.SafetensorError("boom")))
    assert type(err) is fs.SafetensorError and str(err) == "boom"


def test_a_malformed_file_is_a_safetensor_error(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x04\x00\x00\x00\x00\x00\x00\x00{x}}")
    for read in (fs.read_header, lambda p: fs.safe_open(p, "numpy")):
        with pytest.raises(fs.SafetensorError) as e:
            read(path)
        assert isinstance(e.value, fs.FormatError) and isinstance(e.value, ValueError)


def test_a_missing_file_is_reported_in_safetensors_words(tmp_path):
    missing = str(tmp_path / "notafile")
    with pytest.raises(FileNotFoundError) as e:
        fs.load_file(missing)
    assert str(e.value) == f"No such file or directory: {missing}"
    with pytest.raises(FileNotFoundError) as ref:
        safetensors.safe_open(missing, "np")
    assert str(ref.value) == str(e.value)


@pytest.mark.parametrize("options", [dict(framework="tf"), dict(backend="not_a_backend"), dict(threads=-1),
                                     dict(chunk_bytes="lots")])
def test_an_unknown_option_value_is_a_safetensor_error_and_a_value_error(tmp_path, options):
    path = tmp_path / "x.safetensors"
    fs.save_file({"x": np.ones(2)}, path)
    with pytest.raises(errors.OptionError) as e:
        fs.safe_open(path, **{"framework": "numpy", **options})
    assert isinstance(e.value, fs.SafetensorError) and isinstance(e.value, ValueError)


def test_an_unknown_device_is_a_safetensor_error(tmp_path):
    path = tmp_path / "x.safetensors"
    fs.save_file({"x": np.ones(2)}, path)
    with pytest.raises(fs.SafetensorError) as e:
        fs.safe_open(path, "numpy", device="abacus")
    assert isinstance(e.value, fs.DeviceError)


def test_a_dtype_the_format_lacks_is_a_safetensor_error_and_a_type_error(tmp_path):
    with pytest.raises(errors.UnsupportedTypeError) as e:
        fs.save_file({"x": np.array([None], dtype=object)}, tmp_path / "x.safetensors")
    assert isinstance(e.value, fs.SafetensorError) and isinstance(e.value, TypeError)
