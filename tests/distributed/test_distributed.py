"""Distributed loads (load_file(process_group=...)) on CPU over gloo, and the pure planning.

The collective tests start WORLD processes running tests/dist_harness.py (a file:// rendezvous, a
30 s collective timeout, a hard join timeout: a deadlock fails the test, never hangs it)
and check their reports together: every rank got exactly what a single-process load gives, the
bytes read from disk across the group add up to the selection read exactly once, and with
tensor-parallel slices each rank read its own slices plus its share of the replicated tensors.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from foxhunt_stream.distributed.ownership import (CheckpointMismatch, TensorDesc, assign_owners, exchange_windows,
                                                  plan_exchange)


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
    # owners take turns: (turn, owner) of each window is increasing, turn = how many it sent before
    seen: dict[int, int] = {}
    turns = []
    for w in windows:
        turns.append((seen.get(w.owner, 0), w.owner))
        seen[w.owner] = seen.get(w.owner, 0) + 1
    assert turns == sorted(turns) and len(set(turns)) == len(turns)


def test_plan_exchange_broadcasts_only_what_another_rank_wants():
    def desc(nbytes, file, offset):
        return TensorDesc(nbytes, file, "U8", (nbytes,), offset)
    everything = {"a": desc(300, "x.safetensors", 8), "b": desc(200, "x.safetensors", 308),
                  "c": desc(100, "y.safetensors", 8), "d": desc(50, "y.safetensors", 108)}
    only_b = {"b": everything["b"]}
    plans = [plan_exchange([everything, only_b], 128, rank) for rank in (0, 1)]
    assert plans[0].owners == plans[1].owners == {"a": 0, "b": 1, "c": 1, "d": 0}   # by bytes
    assert plans[0].order == ["a", "b", "c", "d"]                      # file order
    assert plans[0].owned == ["a", "d"] and plans[1].owned == ["b", "c"]
    # "a" and "d" are wanted by their owner only: no broadcast; what rank 1 owns, rank 0 wants
    sent = {n for w in plans[0].windows for n, _, _ in w.segments}
    assert sent == {"b", "c"} and plans[0].windows == plans[1].windows
    assert all(w.owner == 1 and w.nbytes <= 128 for w in plans[0].windows)
    assert plans[0].nbytes(plans[1].owned) == 300
    other = {"b": TensorDesc(200, "x.safetensors", "F16", (100,), 308)}
    with pytest.raises(CheckpointMismatch) as e:
        plan_exchange([everything, other], 128, 0)
    assert list(e.value.failures) == [1] and "not the same checkpoint" in e.value.failures[1]


def test_plan_exchange_leaves_slices_to_their_rank():
    """Tensor parallel: a tensor every rank wants as its own slice is nobody's to broadcast; each
    rank reads its slice. A tensor one rank wants whole gets an owner, which reads it whole."""
    descs = {n: TensorDesc(100 * (i + 1), "m.safetensors", "U8", (100 * (i + 1),), 8 + 1000 * i)
             for i, n in enumerate(["col", "norm", "row"])}     # 100, 200, 300 bytes
    sliced = [{"col", "row"}, {"col", "row"}]
    plans = [plan_exchange([descs, descs], 64, rank, sliced=sliced) for rank in (0, 1)]
    for rank, plan in enumerate(plans):
        assert plan.owners == {"norm": 0} and plan.local == ["col", "row"]
        assert plan.owned == (["norm"] if rank == 0 else [])
        assert {n for w in plan.windows for n, _, _ in w.segments} == {"norm"}
    # rank 1 wants "row" whole: its owner (rank 0, the biggest tensor first) reads it whole,
    # broadcasts it and takes its own slice out of it instead of reading the slice again
    mixed = [plan_exchange([descs, descs], 64, rank, sliced=[{"col", "row"}, {"col"}]) for rank in (0, 1)]
    assert mixed[0].owners == mixed[1].owners == {"row": 0, "norm": 1}
    assert mixed[0].owned == ["row"] and mixed[0].local == ["col"]
    assert mixed[1].owned == ["norm"] and mixed[1].local == ["col"]
    sent = [(w.owner, n) for w in mixed[0].windows for n, _, _ in w.segments]
    assert set(sent) == {(0, "row"), (1, "norm")} and mixed[0].windows == mixed[1].windows


# -- collectives over gloo -----------------------------------------------------------------------

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import foxhunt_stream as fs  # noqa: E402

from dist_harness import check_reports, collect, make_checkpoint, start_world  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def test_distributed_load_matches_single_process(tmp_path):
    """World sizes 1, 2 and 3, run side by side (the time is mostly importing torch)."""
    for world, reports, total in collect([start_world(tmp_path, w) for w in (1, 2, 3)]):
        try:
            check_reports(reports, world, total, ckpt=str(tmp_path / f"world{world}" / "ckpt"))
        except AssertionError as e:
            raise AssertionError(f"world size {world}: {e}") from None


def test_process_group_needs_torch_framework(tmp_path):
    make_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="framework must be 'pt'"):
        fs.load_file(str(tmp_path), framework="numpy", process_group=object())
    with pytest.raises(ValueError, match="background"):
        fs.load_file(str(tmp_path), framework="pt", process_group=object(), background=True)
