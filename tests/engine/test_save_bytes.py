"""The saver into memory (``save_bytes``: what ``save`` of safetensors.numpy/torch returns) and
the argument checks every save makes before any work."""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.numpy as stn

import foxhunt_stream as fs
from foxhunt_stream.engine.saver import save_bytes
from foxhunt_stream.errors import NotATensorError


def _tensors():
    return {
        "a": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.arange(6, dtype=">i8").reshape(2, 3),            # big-endian: written little-endian
        "c": np.arange(20, dtype=np.int16).reshape(4, 5)[:, 1:4],   # not contiguous: row by row
        "d": np.array(7, dtype=np.uint8),
        "e": np.zeros((0, 2), dtype=np.float16),
    }


def test_save_bytes_returns_what_save_file_writes(tmp_path):
    tensors = _tensors()
    fs.save_file(tensors, tmp_path / "x.safetensors", metadata={"k": "v"})
    data = save_bytes(tensors, metadata={"k": "v"})
    assert type(data) is bytes and data == (tmp_path / "x.safetensors").read_bytes()
    # the reference is given contiguous copies: it would write the memory behind a strided array
    # as if it were contiguous (the wrong values)
    ref = {k: v.copy(order="C") for k, v in tensors.items()}
    assert data == stn.save(ref, metadata={"k": "v"})


def test_save_bytes_of_nothing_is_an_empty_checkpoint():
    assert save_bytes({}) == stn.save({})


def test_every_save_checks_its_arguments_before_any_work(tmp_path):
    path = tmp_path / "x.safetensors"
    for save in (lambda t: fs.save_file(t, path), save_bytes):
        with pytest.raises(ValueError, match=r"Expected a dict of \[str, array\] but received <class 'str'>"):
            save("notadict")
        with pytest.raises(TypeError, match="got 1 of type int"):
            save({"ok": np.ones(1), 1: np.ones(1)})
        with pytest.raises(NotATensorError, match="Key `a` is invalid") as e:
            save({"a": [1, 2]})
        assert isinstance(e.value, ValueError) and isinstance(e.value, TypeError)
    assert not path.exists()
