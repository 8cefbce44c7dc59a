"""The floor moves exactly a plan's bytes: what it times is the load's data movement, all of it."""

from __future__ import annotations

import numpy as np
import pytest
from pipeline_floor import Floor

import foxhunt_stream as fs


@pytest.fixture
def ckpt(tmp_path):
    rng = np.random.default_rng(5)
    tensors = {f"layers.{i}.w": rng.standard_normal((256 + 8 * i, 24)).astype(np.float32) for i in range(6)}
    tensors["norm"] = rng.standard_normal(24).astype(np.float32)
    fs.save_file({k: v for k, v in list(tensors.items())[:4]}, tmp_path / "a.safetensors")
    fs.save_file({k: v for k, v in list(tensors.items())[4:]}, tmp_path / "b.safetensors")
    return tmp_path, tensors


@pytest.mark.parametrize("threads", [1, 3])
def test_the_floor_lands_the_rows_plan_byte_for_byte(ckpt, threads):
    path, _ = ckpt
    shard = fs.TPSlice(1, 4, lambda n: 0 if n != "norm" else None)
    want = fs.load_file(path, shard=shard)   # its destinations, in the plan's order, packed
    floor = Floor(str(path), shard, "cpu", threads=threads, chunk_bytes=4096)
    assert len(floor.chunks) > len(want)   # pieces of 4 KiB: the threads share tensors
    try:
        for _ in range(2):
            floor.dest[:] = 0
            floor()
            pos = 0
            for n, arr in want.items():
                np.testing.assert_array_equal(floor.dest[pos:pos + arr.nbytes].view(np.float32).reshape(arr.shape), arr)
                pos += arr.nbytes
            assert pos == floor.nbytes
    finally:
        floor.close()


def test_the_floor_refuses_strided_plans(ckpt):
    path, _ = ckpt
    with pytest.raises(ValueError, match="contiguous"):
        Floor(str(path), fs.TPSlice(0, 2, lambda n: 1 if n != "norm" else None), "cpu")
