"""Small whole tensors back to back in a file share chunks (``plan.plan_load``): pure plans here;
loads of such files are in tests/engine/test_shared_chunks.py and tests/engine/test_routes.py."""

from __future__ import annotations

from foxhunt_stream.cuda.devices import CPU, Device
from foxhunt_stream.format.dtypes import DTYPES
from foxhunt_stream.format.header import TensorInfo
from foxhunt_stream.format.plan import (PACK_FRACTION, Run, Selection, interleave_by_device, members, plan_load,
                                        small_chunks_last)

CHUNK = 64 << 10   # a piece; tensors under CHUNK // PACK_FRACTION share chunks
SMALL = CHUNK // PACK_FRACTION


def _sels(sizes, file=0, data_start=8, **index):
    """Tensors t0, t1... of ``sizes`` bytes back to back in ``file`` (``index``: name -> index)."""
    out, pos = [], 0
    for i, n in enumerate(sizes):
        info = TensorInfo(f"t{i}", DTYPES["U8"], (n,), pos, pos + n)
        out.append(Selection(file, data_start, info, index.get(f"t{i}")))
        pos += n
    return out


def test_many_small_tensors_share_one_chunk_per_piece():
    sizes = [16] * 10_000 + [SMALL - 1] * 3
    plan = plan_load(_sels(sizes), CHUNK)
    total = sum(sizes)
    assert len(plan.chunks) == -(-total // CHUNK) and len(plan.chunks) < 5
    # in file order, each the range of its tensors, one read of their span
    assert [d for c in plan.chunks for d in members(c.dest)] == list(range(len(sizes)))
    assert all(type(c.dest) is range and c.run.height == 1 and c.run.span <= CHUNK for c in plan.chunks)
    assert plan.chunks[0].run == Run(8, plan.chunks[0].run.width, plan.chunks[0].run.width, 1, 0)
    assert sum(c.run.nbytes for c in plan.chunks) == total
    for a, b in zip(plan.chunks, plan.chunks[1:]):   # back to back
        assert a.run.src + a.run.width == b.run.src and a.dest.stop == b.dest.start
    assert plan.chunks_per_dest == (1,) * len(sizes)     # each tensor: in one chunk
    assert [d.nbytes for d in plan.destinations] == sizes
    assert plan.dest_order() == []   # the worker landing a shared chunk makes its tensors


def test_what_keeps_a_tensor_out_of_a_shared_chunk():
    # t2 is not small, t4 is empty, t6 is read through an index, t8 and t9 stand alone between them
    sizes = [16, 16, SMALL, 16, 0, 16, 16, 16, 16, 16, 16]
    plan = plan_load(_sels(sizes, t6=slice(0, 8)), CHUNK)
    assert [c.dest for c in plan.chunks] == [range(0, 2), 2, 3, 5, 6, range(7, 11)]
    assert plan.chunks_per_dest == (1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1)
    assert plan.chunks[2].run == Run(8 + 32 + SMALL, 16, 16, 1, 0)   # a single small one: a plain chunk


def test_only_neighbours_in_one_file_for_one_device_share():
    a, b = _sels([16] * 4), _sels([16] * 4, file=1)
    # another file; then the same file out of its order (not back to back)
    plan = plan_load(a[:2] + b + [a[3], a[2]], CHUNK)
    assert [c.dest for c in plan.chunks] == [range(0, 2), range(2, 6), 6, 7]
    gpu = Device("cuda", 0)
    plan = plan_load(a, CHUNK, devices=[CPU, CPU, gpu, gpu])
    assert [c.dest for c in plan.chunks] == [range(0, 2), range(2, 4)]
    out = interleave_by_device(plan, [CPU, CPU, gpu, gpu])   # a range goes by its tensors' device
    assert out.chunks == plan.chunks


def test_checksum_blocks_keep_every_tensor_in_chunks_of_its_own():
    plan = plan_load(_sels([16] * 8), CHUNK, granule=4096)
    assert [c.dest for c in plan.chunks] == list(range(8))


def test_a_load_awaited_whole_keeps_shared_chunks_whole():
    sizes = [CHUNK, 16, 16, CHUNK]
    plan = plan_load(_sels(sizes), CHUNK, order="whole")
    assert [c.dest for c in plan.chunks] == [0, 3, range(1, 3)]   # the shared one, small: last
    assert small_chunks_last(plan, CHUNK) == plan
