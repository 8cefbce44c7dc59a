"""The garbage collector is held off while a load runs, and left as it was found."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import foxhunt_stream as fs


@pytest.fixture
def many_tensors(tmp_path):
    path = str(tmp_path / "many.safetensors")
    fs.save_file({f"t{i}": np.full(3, i, np.float32) for i in range(300)}, path)
    fs.load_file(path)   # the modules a load needs, imported before the test counts
    fs.load_into({"t0": np.zeros(3, np.float32)}, path, names=["t0"])
    return path


@pytest.fixture
def collections():
    """The collections that run while the test does, one due every 100 new objects: a load of 300
    tensors makes thousands. At most the two around a load's start and end may run: the
    collector's own switch makes an object or two on either side."""
    seen: list[int] = []

    def note(phase, info):
        if phase == "start":
            seen.append(info["generation"])
    threshold = gc.get_threshold()
    gc.set_threshold(100, 1, 1)
    gc.callbacks.append(note)
    yield seen
    gc.callbacks.remove(note)
    gc.set_threshold(*threshold)


@pytest.mark.parametrize("entry", ["load_file", "load_into", "background"])
def test_no_collection_runs_during_a_load(many_tensors, collections, entry):
    assert gc.isenabled()
    store = {f"t{i}": np.zeros(3, np.float32) for i in range(300)}
    collections.clear()
    if entry == "load_file":
        out = fs.load_file(many_tensors)
    elif entry == "background":
        out = fs.load_file(many_tensors, background=True).result()
    else:
        out = store
        fs.load_into(out, many_tensors)
    if entry != "background":   # result() runs outside the call that started the load
        assert len(collections) <= 2, collections
    assert gc.isenabled()
    assert all(out[f"t{i}"][0] == i for i in range(300))
    gc.collect()
    assert collections, "the collector runs again after the load"


def test_a_disabled_collector_stays_disabled(many_tensors):
    gc.disable()
    try:
        fs.load_file(many_tensors)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_collector_comes_back_after_a_failed_load(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      x")
    with pytest.raises(fs.FormatError):
        fs.load_file(str(bad))
    assert gc.isenabled()
