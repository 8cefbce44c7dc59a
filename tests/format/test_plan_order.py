"""``plan.small_chunks_last`` (pure) and the loads that use it: a load awaited whole ends on its
small chunks; a background load and a verified one keep plan order."""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.numpy as stn

import foxhunt_stream as fs
from foxhunt_stream.format.plan import small_chunks_last
from plan_support import plan_of_sizes


def test_small_chunks_go_last_in_their_order_and_big_ones_keep_theirs():
    plan = plan_of_sizes([16, 3, 9, 1, 4, 8, 1], chunk=8)   # chunks: 8 8 | 3 | 8 1 | 1 | 4 | 8 | 1
    out = small_chunks_last(plan, 8)
    assert sorted(out.chunks, key=plan.chunks.index) == list(plan.chunks)   # a permutation
    spans = [c.run.span for c in out.chunks]
    assert spans == [8, 8, 3, 8, 4, 8, 1, 1, 1]   # under a quarter of 8 last; 3 and 4 keep their places
    assert [c for c in out.chunks if c.run.span < 2] == [c for c in plan.chunks if c.run.span < 2]
    assert out.destinations == plan.destinations and out.chunks_per_dest == plan.chunks_per_dest


@pytest.mark.parametrize("sizes", [[8, 8, 16, 2], [1, 1, 1], []])
def test_a_plan_of_one_kind_is_returned_as_is(sizes):
    plan = plan_of_sizes(sizes, chunk=8)
    assert small_chunks_last(plan, 8) is plan


def test_a_load_awaited_whole_ends_on_its_small_chunks(tmp_path, recorded_order):
    big = np.arange(64 << 10, dtype=np.uint8)
    tensors = {"a_norm": np.ones(16, np.float32), "b_big": big, "c_norm": np.zeros(16, np.float32)}
    path = str(tmp_path / "m.safetensors")
    stn.save_file(tensors, path)
    out = fs.load_file(path, chunk_bytes=16 << 10, threads=1)
    for n, x in tensors.items():
        np.testing.assert_array_equal(out[n], x)
    (chunks,) = recorded_order
    spans = [c.run.span for c in chunks]
    assert spans == [16 << 10] * 4 + [128]       # the norms (first in the file, one chunk) last

    recorded_order.clear()
    handle = fs.load_file(path, chunk_bytes=16 << 10, threads=1, background=True)
    handle.result()
    assert [c.run.span for c in recorded_order[0]] == [128] + [16 << 10] * 4   # plan (file) order
