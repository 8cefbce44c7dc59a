"""File order, as promised: a sharded checkpoint's files in file-name order (model-00001-of-N
first), each file's tensors by offset; so ``tensors()`` yields a checkpoint written by
``save_file(max_shard_size=)`` in the order it was saved, whatever its index lists first."""

from __future__ import annotations

import json

import numpy as np

import foxhunt_stream as fs
from foxhunt_stream.io.checkpoint import open_checkpoint


def _saved(tmp_path):
    # the last shard holds the alphabetically first names: an index, sorted by name, lists it first
    tensors = {name: np.full(256, i, np.float32) for i, name in enumerate(
        ["model.embed.weight", "model.layers.0.w", "model.layers.1.w", "model.norm.weight", "a.head", "b.head"])}
    fs.save_file(tensors, tmp_path, max_shard_size=2100)
    return tensors


def test_tensors_of_a_sharded_save_come_in_the_order_saved(tmp_path):
    tensors = _saved(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert next(iter(index["weight_map"].values())) == "model-00003-of-00003.safetensors"   # the trap is set
    with fs.safe_open(tmp_path, "numpy") as f:
        assert [name for name, _ in f.tensors()] == list(tensors)
        assert f.offset_keys() == list(tensors)
    assert list(fs.load_file(tmp_path)) == list(tensors)
    assert [p.rsplit("/", 1)[1] for p in open_checkpoint(tmp_path / "model.safetensors.index.json").paths] == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def test_a_list_of_names_keeps_its_order(tmp_path):
    _saved(tmp_path)
    with fs.safe_open(tmp_path, "numpy") as f:
        assert [n for n, _ in f.tensors(["b.head", "model.embed.weight"])] == ["b.head", "model.embed.weight"]


def test_a_list_of_files_keeps_its_order(tmp_path):
    _saved(tmp_path)
    files = [str(tmp_path / f"model-0000{i}-of-00003.safetensors") for i in (3, 1, 2)]
    with fs.safe_open(files, "numpy") as f:
        assert f.offset_keys()[:2] == ["a.head", "b.head"]
