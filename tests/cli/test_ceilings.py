"""The benchmarks' shared pieces: the synthetic checkpoint, the page-cache helpers, the threaded
measurements and the write ceilings (checked against plain file reads and numpy, not timings)."""

from __future__ import annotations

import json
import math
import os
import struct

import ml_dtypes
import numpy as np
import pytest

import foxhunt_stream as fs
from foxhunt_stream.cli import ceilings as ce
from foxhunt_stream.io.pagecache import resident_fraction


def raw_header(path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_decoder_shapes_are_a_llama_state_dict():
    shapes = dict(ce.decoder_shapes(hidden=64, intermediate=160, kv_dim=16, vocab=128, layers=2))
    assert shapes["model.embed_tokens.weight"] == (128, 64) and shapes["lm_head.weight"] == (128, 64)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (16, 64)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 160)
    assert shapes["model.layers.1.post_attention_layernorm.weight"] == (64,)
    assert len(shapes) == 2 * 9 + 3


@pytest.mark.parametrize("size", [1 << 20, 64 << 20, 1 << 30, 16 << 30])
def test_llama_shapes_come_close_to_the_size_asked(size):
    total = sum(2 * math.prod(s) for _, s in ce.llama_shapes(size))
    assert 0.8 * size < total <= size


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
def test_split_evenly_keeps_the_order_and_gives_the_parts_asked(parts):
    sizes = [(f"t{i}", 100 + i) for i in range(20)]
    groups = ce.split_evenly(sizes, parts)
    assert len(groups) == parts and [n for g in groups for n in g] == [n for n, _ in sizes]
    share = [sum(dict(sizes)[n] for n in g) for g in groups]
    assert max(share) - min(share) <= 2 * 120


def test_split_evenly_never_leaves_a_group_empty():
    groups = ce.split_evenly([("huge", 1000), ("a", 1), ("b", 1)], 4)
    assert all(groups) and [n for g in groups for n in g] == ["huge", "a", "b"]


def test_make_synthetic_writes_the_shards_asked_with_an_index(tmp_path):
    shapes = ce.decoder_shapes(hidden=64, intermediate=160, kv_dim=16, vocab=256, layers=3)
    source = ce.make_synthetic(str(tmp_path), shards=4, shapes=shapes)
    assert source == str(tmp_path)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(n for n, _ in shapes)
    assert index["metadata"]["total_size"] == sum(2 * math.prod(s) for _, s in shapes)
    for name, shape in shapes:
        entry = raw_header(tmp_path / index["weight_map"][name])[name]
        assert entry["dtype"] == "BF16" and tuple(entry["shape"]) == shape
    values = fs.load_file(source)["model.layers.2.mlp.up_proj.weight"].astype(np.float32)
    assert np.isfinite(values).all() and 0.01 < values.std() < 0.04   # plausible weights, N(0, 0.02)


def test_make_synthetic_one_file(tmp_path):
    source = ce.make_synthetic(str(tmp_path), 1 << 20)
    assert source == str(tmp_path / "model.safetensors") and os.listdir(tmp_path) == ["model.safetensors"]
    assert raw_header(source)["__metadata__"] == {"format": "pt"}
    t = fs.load_file(source)["model.embed_tokens.weight"]
    assert t.dtype == ml_dtypes.bfloat16


def test_drop_caches_evicts_the_files(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(4 << 20))
    ce.warm([str(path)])
    assert ce.resident([str(path)]) > 0.9
    method = ce.drop_caches([str(path)])
    assert method in ("fadvise DONTNEED", "drop_caches")
    if method == "fadvise DONTNEED" and resident_fraction(path) > 0.01:
        pytest.skip("this filesystem keeps pages after DONTNEED")
    assert resident_fraction(path) <= 0.01


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root may drop the whole cache")
def test_dropping_the_whole_cache_without_root_is_a_clear_error():
    with pytest.raises(PermissionError, match="needs root"):
        ce.drop_caches(whole_cache=True)


def test_parallel_runs_every_item_and_raises_the_first_error():
    seen = []
    ce.parallel(range(1, 50), lambda w, i: seen.append((w, i)), 4)
    assert sorted(i for _, i in seen) == list(range(1, 50)) and {w for w, _ in seen} <= {0, 1, 2, 3}

    def work(worker, item):
        if item == 7:
            raise ValueError("item 7")
    with pytest.raises(ValueError, match="item 7"):
        ce.parallel(range(1, 20), work, 3)


def test_measure_times_each_rep_after_the_warmups():
    calls = []
    times = ce.measure(lambda: calls.append(1), 3, before=lambda: calls.append(0), warmup=2)
    assert len(times) == 3 and calls == [0, 1] * 5


def test_read_ceiling_reads_every_byte(tmp_path):
    data = os.urandom(3 << 20)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    slots = [np.zeros(1 << 20, np.uint8) for _ in range(1)]
    times = ce.read_ceiling([str(path)], 1, 2, 1 << 20, slots)
    assert len(times) == 2 and slots[0].tobytes() == data[2 << 20:]   # the last chunk read


@pytest.mark.parametrize("method", ["pwrite", "mapped"])
@pytest.mark.parametrize("fsync", [False, True])
def test_write_ceiling_writes_a_file_of_the_size_and_cleans_up(tmp_path, method, fsync):
    times = ce.write_ceiling(str(tmp_path), (3 << 20) + 5, 2, 2, 1 << 20, method, fsync)
    assert len(times) == 2 and all(t > 0 for t in times)
    assert os.listdir(tmp_path) == []


def test_a_write_ceiling_is_the_fastest_of_several_writer_counts(tmp_path, monkeypatch):
    """More writers of one file can be slower (the kernel serializes them), so the ceiling is the
    best count, not the largest: a save once ran at 1.43x a 16-writer mapped "ceiling"."""
    assert ce.writer_counts(16, "pwrite") == [1, 16]
    assert ce.writer_counts(16, "mapped") == [4, 8, 16]
    assert ce.writer_counts(2, "mapped") == [1, 2]
    seconds = {4: [3.0, 3.0], 8: [1.0, 1.5], 16: [2.0, 2.0]}
    monkeypatch.setattr(ce, "write_ceiling", lambda d, nb, threads, *a: seconds[threads])
    assert ce.best_write_ceiling(str(tmp_path), 1 << 20, 16, 2, 1 << 20, "mapped") == \
        ([1.0, 1.5], "8 threads, the best of 4, 8, 16")


def test_write_ceiling_refuses_an_unknown_method(tmp_path):
    with pytest.raises(ValueError, match="write method"):
        ce.write_ceiling(str(tmp_path), 1 << 20, 1, 1, 1 << 20, "splice")


def test_write_method_follows_the_saver(tmp_path):
    assert ce.write_method(str(tmp_path), 1 << 20, 16) == "pwrite"   # small files are never mapped
    assert os.listdir(tmp_path) == []
    if os.path.isdir("/dev/shm"):
        assert ce.write_method("/dev/shm", 64 << 20, 2) == "pwrite"   # two writers: pwrite is faster


def test_read_ceiling_in_streams_reads_each_stretch_through_its_own_descriptor(tmp_path, monkeypatch):
    """The cold ceiling reads as a cold load does (``FileSource.read_in_streams``): each stretch
    of a file through one descriptor, the stretches' pieces taken in turn."""
    data = os.urandom(4 << 20)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    seen = []
    real = os.preadv

    def spy(fd, buffers, offset, *args):
        seen.append((fd, offset))
        return real(fd, buffers, offset, *args)
    monkeypatch.setattr(os, "preadv", spy)
    slots = [np.zeros(1 << 20, np.uint8)]
    ce.read_ceiling([str(path)], 1, 1, 1 << 20, slots, warmup=0, streams=2)
    mib = 1 << 20
    assert [off for _, off in seen] == [0, 2 * mib, mib, 3 * mib]   # the two stretches in turn
    assert seen[0][0] == seen[2][0] != seen[1][0] == seen[3][0]      # a descriptor per stretch
    assert slots[0].tobytes() == data[3 * mib:]
