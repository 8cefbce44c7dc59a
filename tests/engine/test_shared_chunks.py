"""Loads of files of many small tensors, which the plan packs into shared chunks: every route that
takes a load's result lands each tensor whole in an array of its own, a tensor waited for alone
is there once its shared chunk is, and checksummed loads still check every tensor. (The GPU
target's side runs in tests/engine/test_routes.py, on the CUDA stand-in too.)"""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.numpy as stn

import foxhunt_stream as fs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """300 tensors of a few bytes (three dtypes, an empty one among them) and one of 1 MiB."""
    rng = np.random.default_rng(3)
    tensors = {}
    for i in range(100):
        tensors[f"f.{i:03}"] = rng.standard_normal(4).astype(np.float32)
        tensors[f"h.{i:03}"] = rng.integers(-999, 999, (2, 3), dtype=np.int16)
        tensors[f"u.{i:03}"] = rng.integers(0, 255, 5, dtype=np.uint8)
    tensors["h.050"] = np.zeros((0, 3), np.int16)
    tensors["big"] = rng.standard_normal(1 << 18).astype(np.float32)
    path = str(tmp_path_factory.mktemp("tiny") / "tiny.safetensors")
    stn.save_file(tensors, path)
    return path, stn.load_file(path)


def _same(got: dict, want: dict) -> None:
    assert list(got) == list(want) or sorted(got) == sorted(want)
    for n, x in want.items():
        assert got[n].dtype == x.dtype and got[n].shape == x.shape, n
        np.testing.assert_array_equal(got[n], x, err_msg=n)


def test_a_load_packs_the_small_tensors_and_gives_each_its_own_array(tiny, recorded_order):
    path, want = tiny
    got = fs.load_file(path, threads=2)
    _same(got, want)
    (chunks,) = recorded_order
    shared = [c for c in chunks if type(c.dest) is range]
    assert shared and len(chunks) < 10   # 300 tensors in a few reads
    arrays = [got[n] for n in sorted(got)]
    for a, b in zip(arrays, arrays[1:]):   # none a view into a buffer another one shares
        assert a.flags.writeable and not np.shares_memory(a, b)


@pytest.mark.parametrize("shape", [(3,), (2, 3), ()])
def test_a_chunk_of_equal_tensors_gives_each_its_own_array(shape, tmp_path):
    """A shared chunk whose tensors all have one dtype and shape is landed as the rows of one array,
    each copied: every array is still its own, of its shape, writable."""
    want = {f"t{i:04}": np.full(shape, i, np.float32) for i in range(1000)}
    path = str(tmp_path / "equal.safetensors")
    stn.save_file(want, path)
    got = fs.load_file(path, threads=2)
    _same(got, want)
    arrays = list(got.values())
    assert all(a.flags.writeable and a.flags.owndata and a.flags.c_contiguous for a in arrays)
    assert not any(np.shares_memory(a, b) for a, b in zip(arrays, arrays[1:]))


def test_a_tensor_waited_for_alone_lands_with_its_shared_chunk(tiny):
    path, want = tiny
    h = fs.load_file(path, background=True, threads=2)
    got = {n: h.wait(n) for n in reversed(h.names)}   # last first
    _same(got, want)
    assert h.result().keys() == want.keys()
    with fs.safe_open(path, framework="numpy") as f:
        np.testing.assert_array_equal(f.get_tensor("h.007"), want["h.007"])
        _same(dict(f.tensors()), want)


def test_load_into_fills_the_store_from_shared_chunks(tiny):
    path, want = tiny
    store = {n: np.zeros_like(x) for n, x in want.items()}
    fs.load_into(store, path, threads=2)
    _same(store, want)


def test_checksummed_files_are_checked_tensor_by_tensor(tiny, tmp_path, recorded_order):
    _, want = tiny
    path = str(tmp_path / "sums.safetensors")
    fs.save_file(want, path, checksum="xxh3-64")
    _same(fs.load_file(path, verify=True, threads=2), want)
    assert not any(type(c.dest) is range for c in recorded_order[-1])   # whole blocks: no shared chunk
    assert fs.verify(path).checked == len(want)


def test_verify_reads_the_shared_chunks_of_a_file_without_checksums(tiny):
    path, want = tiny
    report = fs.verify(path, threads=2)
    assert report.tensors == len(want) and report.bytes_read == sum(x.nbytes for x in want.values())


def test_torch_tensors_of_a_shared_chunk_share_no_storage(tiny, tmp_path):
    torch = pytest.importorskip("torch")
    import safetensors.torch as stt
    path, want = tiny
    got = fs.load_file(path, framework="pt", threads=2)
    stt.save_file(got, str(tmp_path / "again.safetensors"))   # refuses tensors that share storage
    again = stt.load_file(str(tmp_path / "again.safetensors"))
    for n, x in want.items():
        assert torch.equal(again[n], torch.from_numpy(x)), n
