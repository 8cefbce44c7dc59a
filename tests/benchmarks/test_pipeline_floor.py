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


def assert_landed_in_order(dest, want, nbytes):
    """``dest`` holds ``want``'s float32 arrays back to back, in order, and nothing past them."""
    pos = 0
    for arr in want.values():
        np.testing.assert_array_equal(dest[pos:pos + arr.nbytes].view(np.float32).reshape(arr.shape), arr)
        pos += arr.nbytes
    assert pos == nbytes


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
            assert_landed_in_order(floor.dest, want, floor.nbytes)
    finally:
        floor.close()


def test_the_floor_refuses_strided_plans(ckpt):
    path, _ = ckpt
    with pytest.raises(ValueError, match="contiguous"):
        Floor(str(path), fs.TPSlice(0, 2, lambda n: 1 if n != "norm" else None), "cpu")


def test_reads_alone_fill_the_slots_and_leave_the_destination(ckpt):
    path, _ = ckpt
    shard = fs.TPSlice(0, 2, lambda n: 0 if n != "norm" else None)
    floor = Floor(str(path), shard, "cpu", threads=1, chunk_bytes=4096, mode="read")
    try:
        floor.dest[:] = 0
        floor()
        assert not floor.dest.any()   # nothing copied
        f, src, n, _ = floor.chunks[-1]   # the one thread read every chunk, the last one last
        with open(floor.paths[f], "rb") as fh:
            fh.seek(src)
            want = np.frombuffer(fh.read(n), np.uint8)
        np.testing.assert_array_equal(floor.slots[0][0][:n], want)
    finally:
        floor.close()


def test_copies_alone_land_the_slots_bytes_without_reading(ckpt):
    path, _ = ckpt
    floor = Floor(str(path), None, "cpu", threads=1, chunk_bytes=4096, mode="copy")
    try:
        floor.slots[0][0][:] = 7
        floor.dest[:] = 0
        floor()
        assert (floor.dest == 7).all()   # every chunk's place got the slot's bytes, none the file's
    finally:
        floor.close()


def test_floors_share_a_destination_big_enough(ckpt):
    path, _ = ckpt
    first = Floor(str(path), None, "cpu")
    shard = fs.TPSlice(0, 2, lambda n: 0 if n != "norm" else None)
    second = Floor(str(path), shard, "cpu", dest=first.dest)
    try:
        assert second.dest is first.dest
        with pytest.raises(ValueError, match="holds"):
            Floor(str(path), None, "cpu", dest=second.dest[:second.nbytes])
        with pytest.raises(ValueError, match="mode"):
            Floor(str(path), None, "cpu", mode="write")
    finally:
        first.close()
        second.close()


def test_the_script_times_each_floor_beside_the_library(ckpt, tmp_path):
    import json

    from pipeline_floor import main
    path, _ = ckpt
    out = tmp_path / "out"
    assert main([str(path), "--device", "cpu", "--rounds", "1", "--tp", "2", "--threads", "2", "--out", str(out)]) == 0
    data = json.loads((out / "floor.json").read_text())
    assert set(data["fraction"]) == set(data["seconds"]) and len(data["seconds"]) == 10
    assert data["fraction"]["full load (library)"] == 1
    full, rows = data["nbytes"]["full load (library)"], data["nbytes"]["rows (library)"]
    assert rows < full and all(v in (full, rows) for v in data["nbytes"].values())
    assert all(len(ts) == 1 and ts[0] > 0 for ts in data["seconds"].values())


@pytest.mark.parametrize("threads", [1, 3])
def test_the_target_floor_lands_the_plan_byte_for_byte(ckpt, threads):
    """The ladder's step between the floor and the load: the same chunks, landed by the library's target."""
    from pipeline_floor import TargetFloor
    path, _ = ckpt
    want = fs.load_file(path)
    floor = Floor(str(path), None, "cpu", threads=threads, chunk_bytes=4096)
    step = TargetFloor(floor, 4096)
    try:
        for _ in range(2):
            floor.dest[:] = 0
            step()
            assert_landed_in_order(floor.dest, want, floor.nbytes)
    finally:
        step.close()
        floor.close()


def test_the_ladder_runs_every_step(ckpt, tmp_path):
    import json

    import pipeline_floor
    path, _ = ckpt
    out = tmp_path / "out"
    assert pipeline_floor.main([str(path), "--ladder", "--device", "cpu", "--rounds", "1", "--reads", "1",
                                "--ladder-threads", "2", "--out", str(out)]) == 0
    seconds = json.loads((out / "ladder.json").read_text())["seconds"]
    assert list(seconds) == ["floor, 1 MiB slots and reads", "floor loop, chunks landed by the target, 1 MiB reads",
                             "load_into (tensors made before), 1 MiB reads", "load_file, 1 MiB reads",
                             "load_file, 2 workers"]
    assert all(len(v) == 1 and v[0] > 0 for v in seconds.values())
