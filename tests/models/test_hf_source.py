"""Where fs.transformers.from_pretrained finds a checkpoint and what it leaves to transformers
(pure: no torch, no transformers)."""

from __future__ import annotations

import json
import os

import pytest

from foxhunt_stream.models import hf_source
from foxhunt_stream.models.hf_source import SAFETENSORS_FILE, SAFETENSORS_INDEX, Unservable


def make_dir(tmp_path, *files, config=None):
    for name in files:
        (tmp_path / name).write_bytes(b"{}")
    (tmp_path / "config.json").write_text(json.dumps(config if config is not None else {"model_type": "llama"}))
    return str(tmp_path)


def test_directory_prefers_the_single_file_as_transformers_does(tmp_path):
    d = make_dir(tmp_path, SAFETENSORS_FILE, SAFETENSORS_INDEX, "consolidated.safetensors")
    src = hf_source.resolve(d)
    assert (src.directory, src.weights, src.shown) == (d, os.path.join(d, SAFETENSORS_FILE), d)
    assert src.is_whole_directory()


def test_directory_with_an_index(tmp_path):
    d = make_dir(tmp_path, SAFETENSORS_INDEX, "model-00001-of-00002.safetensors")
    assert hf_source.resolve(d).weights == os.path.join(d, SAFETENSORS_INDEX)


def test_file_and_index_take_the_config_beside_them(tmp_path):
    d = make_dir(tmp_path, SAFETENSORS_FILE, "other.safetensors", SAFETENSORS_INDEX)
    for name, whole in ((SAFETENSORS_FILE, True), ("other.safetensors", False), (SAFETENSORS_INDEX, False)):
        src = hf_source.resolve(os.path.join(d, name))
        assert (src.directory, src.shown, src.is_whole_directory()) == (d, d, whole)


@pytest.mark.parametrize("path", ["org/model", "missing-dir"])
def test_not_local_is_unservable(tmp_path, path):
    with pytest.raises(Unservable, match="not a local"):
        hf_source.resolve(str(tmp_path / path) if path == "missing-dir" else path)


def test_bin_only_directory_is_unservable(tmp_path):
    d = make_dir(tmp_path, "pytorch_model.bin")
    with pytest.raises(Unservable, match="neither"):
        hf_source.resolve(d)


def test_plan_names_the_first_obstacle(tmp_path):
    d = make_dir(tmp_path, SAFETENSORS_FILE)
    assert hf_source.plan(d, "cuda:0", "AutoModelForCausalLM", {"attn_implementation": "sdpa"})[1] is None
    assert hf_source.plan(d, 1, None, {})[1] is None
    assert "variant" in hf_source.plan(d, "cpu", None, {"variant": "fp16"})[1]
    assert "device_map, tp_plan are" in hf_source.plan(d, "cpu", None, {"tp_plan": "auto", "device_map": "auto"})[1]
    assert "mps" in hf_source.plan(d, "mps", None, {})[1]
    assert "use_safetensors" in hf_source.plan(d, "cpu", None, {"use_safetensors": False})[1]
    assert hf_source.plan("org/model", "cpu", None, {}) [0] is None
    (tmp_path / "adapter_config.json").write_text("{}")
    assert "adapter" in hf_source.plan(d, "cpu", None, {})[1]


@pytest.mark.parametrize("config, auto, reason", [
    ({"quantization_config": {"quant_method": "fp8"}}, None, "quantized"),
    ({"quantization_config": None}, None, None),
    ({"transformers_weights": "w.safetensors"}, None, "transformers_weights"),
    ({"auto_map": {"AutoModelForCausalLM": "m.M"}}, "AutoModelForCausalLM", "own code"),
    ({"auto_map": {"AutoConfig": "c.C"}}, "AutoModel", "own code"),
    ({"auto_map": {"AutoModelForCausalLM": "m.M"}}, None, None),   # a concrete class was asked for
])
def test_config_obstacles(tmp_path, config, auto, reason):
    d = make_dir(tmp_path, SAFETENSORS_FILE, config=config)
    got = hf_source.plan(d, "cpu", auto, {})[1]
    assert (got is None) if reason is None else (reason in got)


def test_unreadable_config_is_an_obstacle(tmp_path):
    d = make_dir(tmp_path, SAFETENSORS_FILE)
    (tmp_path / "config.json").write_text("[1, 2")
    assert "cannot be read" in hf_source.plan(d, "cpu", None, {})[1]
    os.remove(tmp_path / "config.json")
    assert "does not exist" in hf_source.plan(d, "cpu", None, {})[1]
