"""Distributed loads (load_file(process_group=...)) on CPU over gloo, and the pure planning.

The collective tests start WORLD processes running tests/dist_worker.py (a file:// rendezvous, a
30 s collective timeout, a hard join timeout: a deadlock fails the test, never hangs it)
and check their reports together: every rank got exactly what a single-process load gives, and
the bytes read from disk across the group add up to the selection read exactly once.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from foxhunt_stream.distributed import assign_owners, exchange_windows

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_worker  # noqa: E402


# -- pure planning -------------------------------------------------------------------------------

tensor_lists = st.lists(st.tuples(st.integers(0, 1 << 20), st.sampled_from(["a", "b", "c"])),
                        min_size=0, max_size=30).map(
    lambda xs: [(f"t{i}", n, f"/some/dir/{f}.safetensors") for i, (n, f) in enumerate(xs)])


@hsettings(max_examples=60, deadline=None)
@given(tensor_lists, st.integers(1, 5), st.randoms(use_true_random=False))
def test_assign_owners_ignores_listing_order_and_directory(tensors, world, rnd):
    owners = assign_owners(tensors, world)
    shuffled = [(n, b, f.replace("/some/dir/", "/other/")) for n, b, f in tensors]
    rnd.shuffle(shuffled)
    assert assign_owners(shuffled, world) == owners
    assert set(owners) == {n for n, _, _ in tensors}
    assert all(0 <= r < world for r in owners.values())


@hsettings(max_examples=60, deadline=None)
@given(tensor_lists, st.integers(1, 5))
def test_assign_owners_balances_bytes(tensors, world):
    """Greedy largest-first: no rank exceeds the even share by more than the largest tensor."""
    owners = assign_owners(tensors, world)
    loads = [0] * world
    for n, b, _ in tensors:
        loads[owners[n]] += b
    biggest = max((b for _, b, _ in tensors), default=0)
    assert max(loads) <= sum(loads) / world + biggest


def test_assign_owners_spreads_equal_tensors_and_rejects_bad_input():
    owners = assign_owners([(f"w{i}", 100, "m.safetensors") for i in range(6)], 3)
    assert sorted(owners.values()) == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="world_size"):
        assign_owners([], 0)
    with pytest.raises(ValueError, match="twice"):
        assign_owners([("x", 1, "a"), ("x", 2, "a")], 2)


@hsettings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 3)), max_size=20), st.integers(1, 3000))
def test_exchange_windows_cover_every_byte_once_within_the_window(sizes, window):
    tensors = [(f"t{i}", n, owner) for i, (n, owner) in enumerate(sizes)]
    windows = exchange_windows(tensors, window)
    covered = {name: [] for name, _, _ in tensors}
    owner_of = {name: owner for name, _, owner in tensors}
    for w in windows:
        assert 0 < w.nbytes <= window
        for name, start, length in w.segments:
            assert owner_of[name] == w.owner and length > 0
            covered[name].append((start, length))
    for name, nbytes, _ in tensors:
        pos = 0
        for start, length in covered[name]:   # in order, back to back, nothing missing
            assert start == pos
            pos += length
        assert pos == nbytes
    assert [w.owner for w in windows] == sorted(w.owner for w in windows)


# -- collectives over gloo -----------------------------------------------------------------------

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import foxhunt_stream as fs  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def make_checkpoint(d) -> int:
    """Three files of mixed dtypes (a scalar, an empty tensor, odd sizes); returns total bytes."""
    g = torch.Generator().manual_seed(0)
    files = {
        "a.safetensors": {"w.big": torch.randn(96, 70, generator=g),
                          "w.ints": torch.randint(-9, 9, (33, 5), generator=g, dtype=torch.int64),
                          "s.scalar": torch.tensor(3.5, dtype=torch.float64)},
        "b.safetensors": {"b.half": torch.randn(10, 24, generator=g).to(torch.bfloat16),
                          "w.bool": torch.rand(17, 3, generator=g) > 0.5,
                          "w.empty": torch.empty(0, 4, dtype=torch.float16)},
        "c.safetensors": {"w.u8": torch.randint(0, 255, (300,), generator=g, dtype=torch.uint8),
                          "b.f16": torch.randn(4, 1000, generator=g).to(torch.float16),
                          "w.small": torch.arange(7, dtype=torch.int32)},
    }
    total = 0
    for f, ts in files.items():
        fs.save_file(ts, os.path.join(d, f))
        total += sum(t.numel() * t.element_size() for t in ts.values())
    return total


def _context():
    """Workers fork from a forkserver that imported torch once: importing torch is most of the cost
    of a rank here (seconds each on this box), and a fork of the test process itself is unsafe."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "foxhunt_stream", "dist_worker"])
    return ctx


def start_world(tmp_path, world: int, backend: str = "gloo", device: str = "cpu"):
    """Start the WORLD ranks of one group (its own checkpoint and rendezvous file under tmp_path)."""
    base = tmp_path / f"world{world}"
    ckpt = base / "ckpt"
    ckpt.mkdir(parents=True)
    total = make_checkpoint(str(ckpt))
    ctx = _context()
    procs = [ctx.Process(target=dist_worker.run, args=(r, world, str(base / "init"), str(ckpt),
                                                         str(base / f"r{r}.json"), backend, device))
             for r in range(world)]
    for p in procs:
        p.start()
    return world, base, procs, total


def collect(started, timeout: float = 120):
    """Wait for every rank of every started group; kill them all on a hang. -> [(world, reports, total)]"""
    out = []
    deadline = time.monotonic() + timeout
    try:
        for world, base, procs, total in started:
            for r, p in enumerate(procs):
                p.join(max(0.0, deadline - time.monotonic()))
                if p.is_alive():
                    pytest.fail(f"world {world} rank {r} still running after {timeout} s (deadlock)")
                err = base / f"r{r}.json.err"
                assert p.exitcode == 0, f"world {world} rank {r} exited {p.exitcode}:\n" + (
                    err.read_text() if err.exists() else "")
            out.append((world, [json.loads((base / f"r{r}.json").read_text()) for r in range(world)], total))
    finally:
        for _, _, procs, _ in started:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    return out


def check_reports(reports, world: int, total: int) -> None:
    for r, rep in enumerate(reports):
        for key, e in rep.items():
            assert "unexpected" not in e, f"rank {r} {key}: {e['unexpected']}"
    for key in ("full", "default_window", "subset", "shard", "after"):
        for r, rep in enumerate(reports):
            assert "error" not in rep[key], f"rank {r} {key}: {rep[key]['error']}"
            assert rep[key]["mismatch"] is None, f"rank {r} {key}: {rep[key]['mismatch']}"
    # loaded once: the group read every selected byte exactly once, not once per rank
    for key in ("full", "default_window", "shard", "after"):
        assert sum(rep[key]["read"] for rep in reports) == total, key
    assert reports[0]["full"]["n"] == 9
    # ranks asked for different names (some names by nobody): each got exactly its own
    assert sum(rep["subset"]["n"] for rep in reports) == sum(1 for i in range(9) if i % (world + 1) < world)
    assert sum(rep["subset"]["read"] for rep in reports) < total
    # an error seen by one rank is raised on every rank, naming that rank
    for key, culprit in (("missing", world - 1), ("fault", 0)):
        for r, rep in enumerate(reports):
            assert "error" in rep[key], f"rank {r} did not raise in {key}"
            assert rep[key]["failures"] == [culprit], (key, rep[key])
    assert "missing.safetensors" in reports[0]["missing"]["error"]
    assert "injected read error" in reports[0]["fault"]["error"]


def test_distributed_load_matches_single_process(tmp_path):
    """World sizes 1, 2 and 3, run side by side (the time is mostly importing torch)."""
    for world, reports, total in collect([start_world(tmp_path, w) for w in (1, 2, 3)]):
        try:
            check_reports(reports, world, total)
        except AssertionError as e:
            raise AssertionError(f"world size {world}: {e}") from None


def test_process_group_needs_torch_framework(tmp_path):
    make_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="framework must be 'pt'"):
        fs.load_file(str(tmp_path), framework="numpy", process_group=object())
    with pytest.raises(ValueError, match="background"):
        fs.load_file(str(tmp_path), framework="pt", process_group=object(), background=True)
