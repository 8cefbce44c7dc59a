"""Indexing where it meets safetensors': the empty list, and the errors safetensors raises for an
index it refuses (SafetensorErrors, in its words; ours keep IndexError/TypeError as well)."""

from __future__ import annotations

import numpy as np
import pytest
import safetensors
import safetensors.numpy as stn

import foxhunt_stream as fs
from foxhunt_stream.errors import SliceError, UnsupportedTypeError
from foxhunt_stream.format.indexing import normalize_index

SHAPE = (5, 3)


def test_the_empty_list_selects_nothing_along_its_dimension():
    assert normalize_index([], SHAPE) == [(0, 0, 1), (0, 3, 1)]
    assert normalize_index((slice(1, 4), []), SHAPE) == [(1, 3, 1), (0, 0, 1)]


@pytest.fixture
def both(tmp_path):
    """The same 2-D tensor opened by safetensors and by us."""
    path = str(tmp_path / "t.safetensors")
    arr = np.arange(15, dtype=np.float32).reshape(SHAPE)
    stn.save_file({"t": arr}, path)
    with safetensors.safe_open(path, "np") as ref, fs.safe_open(path, "numpy") as ours:
        yield arr, ref.get_slice("t"), ours.get_slice("t")


def test_an_empty_list_reads_like_numpy_and_safetensors(both):
    arr, ref, ours = both
    for got in (ours[[]], ref[[]]):
        assert got.shape == arr[[]].shape == (0, 3)


@pytest.mark.parametrize("index", [(slice(1, None), -4), [[0, 1]], (slice(2, None), 7), (9,), -6])
def test_a_refused_index_raises_safetensors_error_in_its_words(both, index):
    _, ref, ours = both
    with pytest.raises(safetensors.SafetensorError) as want:
        ref[index]
    with pytest.raises(SliceError) as got:
        ours[index]
    assert str(got.value) == str(want.value)
    assert isinstance(got.value, fs.SafetensorError) and isinstance(got.value, IndexError)


@pytest.mark.parametrize("index", [1.5, "a", None, (0, None), np.array([0, 1])])
def test_an_index_of_another_type_is_a_safetensor_error_and_a_type_error(both, index):
    _, _, ours = both
    with pytest.raises(UnsupportedTypeError) as e:
        ours[index]
    assert isinstance(e.value, fs.SafetensorError) and isinstance(e.value, TypeError)


@pytest.mark.parametrize("index", [(0, 0, 0), slice(None, None, -1), (Ellipsis, Ellipsis)])
def test_other_refusals_are_slice_errors(index):
    with pytest.raises(SliceError):
        normalize_index(index, SHAPE)


def test_a_stop_past_the_end_is_clamped_a_deliberate_superset(both):
    arr, ref, ours = both
    np.testing.assert_array_equal(ours[1:99], arr[1:99])
    with pytest.raises(safetensors.SafetensorError):
        ref[1:99]
