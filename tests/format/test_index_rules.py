"""The index (model.safetensors.index.json) is checked before any shard is opened: every problem
is a FormatError naming the index, its rule and, where one is involved, the tensor. The shards
here are valid; only the index is wrong."""

from __future__ import annotations

import json

import numpy as np
import pytest

import foxhunt_stream as fs
from foxhunt_stream import FormatError
from foxhunt_stream.cli import main as cli

INDEX = "model.safetensors.index.json"


@pytest.fixture
def shards(tmp_path):
    fs.save_file({"a": np.arange(4, dtype=np.float32)}, tmp_path / "model-1.safetensors", fsync=False)
    fs.save_file({"b": np.arange(3, dtype=np.int16)}, tmp_path / "model-2.safetensors", fsync=False)
    return tmp_path


def _index(directory, weight_map) -> str:
    path = directory / INDEX
    path.write_text(json.dumps({"metadata": {"total_size": 22}, "weight_map": weight_map}))
    return str(path)


def _refused(source, rule: str, path: str, tensor: str | None):
    for call in (fs.load_file, fs.verify, lambda s: fs.safe_open(s, "numpy")):
        with pytest.raises(FormatError) as e:
            call(source)
        assert (e.value.rule, e.value.path, e.value.tensor) == (rule, path, tensor), str(e.value)
        assert path in str(e.value)
        if tensor is not None:
            assert repr(tensor) in str(e.value)


@pytest.mark.parametrize("bad", ["model-1.safetensors\x00", "model-1.safetensors\x00.txt", "\x00",
                                 "model-\ud800.safetensors"], ids=["nul-at-end", "nul-inside", "nul", "lone-surrogate"])
def test_a_file_name_no_path_can_hold_names_the_index_and_tensor(shards, bad):
    index = _index(shards, {"a": "model-1.safetensors", "b": bad})
    _refused(shards, "index-weight-map", index, "b")
    _refused(index, "index-weight-map", index, "b")


@pytest.mark.parametrize("bad", [None, 3, "", ["model-2.safetensors"]])
def test_a_file_name_that_is_not_a_string_names_the_tensor(shards, bad):
    index = _index(shards, {"a": "model-1.safetensors", "b": bad})
    _refused(shards, "index-weight-map", index, "b")


def test_an_index_that_maps_no_tensor_is_not_a_checkpoint(shards, capsys):
    index = _index(shards, {})
    _refused(shards, "index-weight-map", index, None)
    for args in (["verify", str(shards)], ["verify", "--headers-only", index], ["inspect", index]):
        assert cli.main(args) == 1
        assert "[index-weight-map]" in capsys.readouterr().err


def test_a_good_index_still_loads(shards):
    _index(shards, {"a": "model-1.safetensors", "b": "model-2.safetensors"})
    out = fs.load_file(shards)
    assert sorted(out) == ["a", "b"] and out["b"].tolist() == [0, 1, 2]
