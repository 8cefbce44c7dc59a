"""What a new user gets for the usual mistakes: an error that says what is wrong and what to do,
never a silent empty result or an error about something else."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import warnings

import numpy as np
import pytest

import foxhunt_stream as fs
from foxhunt_stream import settings
from foxhunt_stream.engine.reshard import reshard
from foxhunt_stream.format.header import read_header_len
from foxhunt_stream.io import sink as sink_module

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + bytes(range(200))


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "a.safetensors")
    fs.save_file({"model.embed.weight": np.ones((4, 4), np.float32), "lm_head.weight": np.zeros(3, np.int8)}, path)
    return path


# ---------------------------------------------------------------- not a safetensors file

@pytest.mark.parametrize("data", [PNG, np.random.default_rng(1).integers(0, 255, 4096, dtype=np.uint8).tobytes()],
                         ids=["png", "random-bytes"])
def test_a_file_that_is_not_safetensors_is_called_so(tmp_path, data):
    path = tmp_path / "picture.safetensors"
    path.write_bytes(data)
    with pytest.raises(fs.FormatError) as e:
        fs.load_file(path)
    (n,) = struct.unpack("<Q", data[:8])
    msg = str(e.value)
    assert e.value.rule == "not-safetensors" and "not a safetensors file" in msg
    assert repr(data[:8]) in msg and f"{n:,}" in msg and str(path) in msg


def test_an_impossible_length_before_a_json_header_keeps_its_own_rule():
    """A real header after an impossible length is a damaged safetensors file, not another format."""
    with pytest.raises(fs.FormatError) as e:
        read_header_len(struct.pack("<Q", 2**40) + b"{", 1000)
    assert e.value.rule == "header-too-large"
    with pytest.raises(fs.FormatError) as e:
        read_header_len(struct.pack("<Q", 900) + b" {", 100)
    assert e.value.rule == "header-length"
    assert read_header_len(struct.pack("<Q", 2) + b"{}", 10) == 2


# ---------------------------------------------------------------- frameworks and devices

def test_cupy_arrays_need_a_gpu_device(ckpt):
    for call in (lambda: fs.load_file(ckpt, device="cpu", framework="cupy"),
                 lambda: fs.safe_open(ckpt, framework="cupy", device="cpu")):
        with pytest.raises(ValueError, match="framework 'cupy' makes GPU arrays.*device='cuda:N'.*framework='numpy'"):
            call()


def test_framework_pt_without_torch_says_how_to_install_it(ckpt):
    code = ("import sys; sys.modules['torch'] = None\n"   # as if torch were not installed
            "import foxhunt_stream as fs\n"
            "for call in (lambda: fs.load_file(sys.argv[1], framework='pt'), lambda: __import__('foxhunt_stream.torch')):\n"
            "    try:\n"
            "        call()\n"
            "    except ModuleNotFoundError as e:\n"
            "        print(type(e).__name__, e.name, '|', e)\n")
    r = subprocess.run([sys.executable, "-c", code, ckpt], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": REPO})
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and len(lines) == 2, r.stderr[-2000:]
    for line in lines:
        assert line.startswith("ModuleNotFoundError torch |") and "pip install torch" in line


# ---------------------------------------------------------------- names that select nothing

@pytest.mark.parametrize("names, shown", [("zzz*", "'zzz*'"), ("model.*.bias", "'model.*.bias'")])
def test_a_glob_that_matches_nothing_is_a_key_error_naming_it(ckpt, names, shown):
    for call in (lambda: fs.load_file(ckpt, names=names), lambda: fs.prefetch(ckpt, names=names),
                 lambda: list(fs.safe_open(ckpt, "numpy").tensors(names))):
        with pytest.raises(KeyError) as e:
            call()
        assert shown in str(e.value) and "model.embed.weight" in str(e.value)   # and what is there


def test_a_predicate_that_selects_nothing_is_a_key_error(ckpt):
    with pytest.raises(KeyError, match="selects no tensor"):
        fs.load_file(ckpt, names=lambda n: n.startswith("decoder."))


def test_a_list_of_patterns_says_that_a_list_holds_exact_names(ckpt):
    with pytest.raises(KeyError) as e:
        fs.load_file(ckpt, names=["zzz*"])
    assert "'zzz*'" in str(e.value) and "exact names" in str(e.value)
    assert fs.load_file(ckpt, names=[]) == {}   # nothing asked for, nothing loaded
    assert sorted(fs.load_file(ckpt, names="*.weight")) == ["lm_head.weight", "model.embed.weight"]


# ---------------------------------------------------------------- a misspelled variable

def test_a_misspelled_foxhunt_variable_is_warned_about_once(ckpt, monkeypatch):
    monkeypatch.setenv("FOXHUNT_TREADS", "3")
    monkeypatch.setattr(settings, "_warned", set())
    token = settings._current.set(None)   # as at the first settings read of a process
    try:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            fs.load_file(ckpt)
            settings._current.set(None)
            fs.load_file(ckpt)
    finally:
        settings._current.reset(token)
    mine = [w for w in got if "FOXHUNT_TREADS" in str(w.message)]
    assert len(mine) == 1 and "did you mean FOXHUNT_THREADS?" in str(mine[0].message)


def test_the_variables_read_elsewhere_are_not_warned_about(ckpt, monkeypatch):
    for name in settings.OTHER_VARIABLES:
        monkeypatch.setenv(name, "1" if name != "FOXHUNT_CUDART" else "cupy")
    monkeypatch.setattr(settings, "_warned", set())
    token = settings._current.set(None)
    try:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            settings.current()
    finally:
        settings._current.reset(token)
    assert not [w for w in got if "FOXHUNT_" in str(w.message)]


# ---------------------------------------------------------------- saving and resharding

def test_sharded_save_into_a_missing_directory_creates_it(tmp_path):
    out = tmp_path / "new" / "model"
    tensors = {f"t{i}": np.full(1000, i, np.float32) for i in range(3)}
    fs.save_file(tensors, out, max_shard_size="5KB")
    assert sorted(os.listdir(out)) == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                       "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    got = fs.load_file(out)
    assert all(np.array_equal(got[k], v) for k, v in tensors.items())


def test_sharded_save_onto_a_file_says_it_is_not_a_directory(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"keep me")
    with pytest.raises(FileExistsError, match="not a directory"):
        fs.save_file({"t": np.zeros(3)}, path, max_shard_size="1KB")
    assert path.read_bytes() == b"keep me"


def test_a_failed_sharded_save_leaves_no_directory_it_created(tmp_path, monkeypatch):
    def fail(sink, offset, length):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(sink_module, "fault_hook", fail)
    out = tmp_path / "new"
    with pytest.raises(OSError, match="No space left"):
        fs.save_file({"a": np.zeros(300), "b": np.ones(300)}, out, max_shard_size="3KB")
    assert not out.exists()


def test_reshard_onto_its_own_source_says_they_are_the_same(ckpt):
    before = open(ckpt, "rb").read()
    with pytest.raises(ValueError, match="source and destination are the same"):
        reshard(ckpt, ckpt, "1KB")
    r = subprocess.run([sys.executable, "-m", "foxhunt_stream", "reshard", ckpt, ckpt, "--max-shard-size", "1KB"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode != 0 and "source and destination are the same" in r.stderr
    assert open(ckpt, "rb").read() == before


def test_reshard_onto_another_file_says_it_is_a_file(ckpt, tmp_path):
    other = tmp_path / "other.bin"
    other.write_bytes(b"x")
    with pytest.raises(FileExistsError, match="is a file, not a directory"):
        reshard(ckpt, other, "1KB")
