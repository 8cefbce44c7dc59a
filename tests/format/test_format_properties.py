"""Property tests of the format core against safetensors 0.8.0 and numpy.

* save: random tensor dicts are written byte-identical to ``safetensors.numpy.save_file`` and
  load back equal;
* slicing: ``safe_open(...).get_slice(name)[index]`` equals numpy's ``arr[index]`` for random
  basic indices; unsupported indices raise IndexError/TypeError;
* planning (pure, no files): ``indexing.slice_runs`` runs copy exactly the selected bytes, and
  ``plan.split_run`` pieces stay within the chunk size (of span, or of landed bytes for a source
  that gathers rows) and reassemble to the original run.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy as stn
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import foxhunt_stream as fs
from foxhunt_stream.format.dtypes import DTYPES
from foxhunt_stream.format.header import N_LEN, TensorInfo, parse_header
from foxhunt_stream.format.indexing import Run, general_slice_runs, slice_runs
from foxhunt_stream.format.plan import Selection, plan_load, plan_save, split_run
from foxhunt_stream.io.read_policy import ReadPolicy

GATHERS = [ReadPolicy(0, gather=True)]   # one file, whose strided runs its source gathers


def bounded(n: int) -> settings:
    return settings(max_examples=n, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# The dtypes numpy / ml_dtypes can hold (all but the sub-byte F4, F6_*).
NP_DTYPES = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16,
             "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I32": np.int32, "U32": np.uint32, "F32": np.float32,
             "F64": np.float64, "I64": np.int64, "U64": np.uint64, "C64": np.complex64,
             "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
             "F8_E8M0": ml_dtypes.float8_e8m0fnu, "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
             "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz}
SWAPPABLE = {"I16", "U16", "F16", "I32", "U32", "F32", "F64", "I64", "U64", "C64"}   # numpy has '>' variants

text = st.text(st.characters(exclude_categories=("Cs",)), max_size=8)
names = text.filter(lambda s: s != "__metadata__")
shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4)


@st.composite
def arrays(draw, dtypes=tuple(sorted(NP_DTYPES)), shape=shapes):
    """Any bit pattern of any holdable dtype (NaN payloads included); sometimes big-endian."""
    name = draw(st.sampled_from(dtypes))
    dtype = np.dtype(NP_DTYPES[name])
    shp = draw(shape)
    n = int(np.prod(shp)) * dtype.itemsize
    raw = np.frombuffer(draw(st.binary(min_size=n, max_size=n)), np.uint8)
    if name == "BOOL":
        raw = raw & 1
    arr = raw.view(dtype).reshape(shp).copy()
    if name in SWAPPABLE and draw(st.booleans()):
        arr = arr.astype(dtype.newbyteorder(">"))
    return arr


def _le_bytes(arr: np.ndarray) -> bytes:
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()


tensor_dicts = st.dictionaries(names, arrays(), max_size=5)
metadata_0_or_1 = st.none() | st.dictionaries(text, text, max_size=1)


@bounded(60)
@given(tensors=tensor_dicts, metadata=metadata_0_or_1)
def test_save_is_byte_identical_to_the_reference_and_loads_back(tensors, metadata):
    assume(tensors or metadata != {})   # the reference writes broken JSON there: see the test below
    with tempfile.TemporaryDirectory() as d:
        ours, ref = Path(d, "ours.safetensors"), Path(d, "ref.safetensors")
        fs.save_file(tensors, ours, metadata=metadata, fsync=False)
        stn.save_file(tensors, str(ref), metadata=metadata)
        assert ours.read_bytes() == ref.read_bytes()
        back = fs.load_file(ours)
        with fs.safe_open(ours, "numpy") as f:
            assert f.metadata() == metadata
    assert sorted(back) == sorted(tensors)
    for k, arr in tensors.items():
        assert back[k].shape == arr.shape
        assert back[k].dtype == arr.dtype.newbyteorder("=")
        assert back[k].tobytes() == _le_bytes(arr)


def test_empty_file_with_empty_metadata_is_valid_unlike_the_reference(tmp_path):
    """safetensors 0.8.0 writes ``{},"__metadata__":{}}`` for no tensors and ``metadata={}``
    (serde_json closes a map announced with length 0 at once), which it then cannot read back.
    We write the valid ``{"__metadata__":{}}`` instead of copying the bug."""
    assert stn.save({}, metadata={})[8:].rstrip() == b'{},"__metadata__":{}}'
    with pytest.raises(Exception):
        safetensors.deserialize(stn.save({}, metadata={}))
    path = tmp_path / "empty.safetensors"
    fs.save_file({}, path, metadata={}, fsync=False)
    assert path.read_bytes() == b"\x18" + bytes(7) + b'{"__metadata__":{}}     '
    with safetensors.safe_open(str(path), "numpy") as f:
        assert f.keys() == [] and f.metadata() == {}
    assert fs.load_file(path) == {}


@bounded(15)
@given(tensors=tensor_dicts, metadata=st.dictionaries(text, text, min_size=2, max_size=4))
def test_save_with_several_metadata_keys_matches_the_reference_header(tensors, metadata):
    """The reference writes 2+ metadata keys in hash order, so compare parsed headers and the
    data region instead of whole files."""
    with tempfile.TemporaryDirectory() as d:
        ours, ref = Path(d, "ours.safetensors"), Path(d, "ref.safetensors")
        fs.save_file(tensors, ours, metadata=metadata, fsync=False)
        stn.save_file(tensors, str(ref), metadata=metadata)
        a, b = ours.read_bytes(), ref.read_bytes()
        with safetensors.safe_open(str(ours), "numpy") as f:
            assert f.metadata() == metadata
    ha, hb = parse_header(a, len(a)), parse_header(b, len(b))
    assert ha.metadata == hb.metadata == metadata
    assert ha.tensors == hb.tensors and ha.header_len == hb.header_len
    assert a[ha.data_start:] == b[hb.data_start:]


@bounded(15)
@given(arr=arrays(shape=hnp.array_shapes(min_dims=2, max_dims=3, min_side=1, max_side=5)), data=st.data())
def test_save_of_non_contiguous_views_equals_the_contiguous_copy(arr, data):
    """Strided/transposed views are written as their C-order copy would be by the reference."""
    view = arr.T if data.draw(st.booleans()) else arr[::2]
    with tempfile.TemporaryDirectory() as d:
        ours, ref = Path(d, "ours.safetensors"), Path(d, "ref.safetensors")
        fs.save_file({"v": view}, ours, fsync=False)
        stn.save_file({"v": np.ascontiguousarray(view)}, str(ref))
        assert ours.read_bytes() == ref.read_bytes()


# ---------------------------------------------------------------- slicing

@st.composite
def basic_index(draw, shape):
    """A numpy basic index the loader supports: ints (negative too), slices with positive steps
    and any (clamped) bounds, at most one Ellipsis, possibly fewer items than dims."""
    ndim = len(shape)
    k = draw(st.integers(0, ndim))                       # explicit items
    ell = draw(st.none() | st.integers(0, k))            # Ellipsis position among them
    dims = list(range(k)) if ell is None else list(range(ell)) + list(range(ndim - (k - ell), ndim))
    items = []
    for d in dims:
        n = shape[d]
        if n and draw(st.booleans()):
            items.append(draw(st.integers(-n, n - 1)))
        else:
            bound = st.none() | st.integers(-2 * n - 2, 2 * n + 2)
            items.append(slice(draw(bound), draw(bound), draw(st.none() | st.integers(1, 4))))
    if ell is not None:
        items.insert(ell, Ellipsis)
    if len(items) == 1 and draw(st.booleans()):
        return items[0]
    return tuple(items)


@bounded(60)
@given(arr=arrays(dtypes=("U8", "I16", "F32", "C64", "BF16", "BOOL"), shape=shapes), data=st.data())
def test_get_slice_equals_numpy_basic_indexing(arr, data):
    arr = arr.astype(arr.dtype.newbyteorder("="))
    indices = data.draw(st.lists(basic_index(arr.shape), min_size=1, max_size=6))
    chunk = data.draw(st.sampled_from([4096, 1 << 20]))   # (splitting itself is tested purely below)
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d, "t.safetensors"))
        stn.save_file({"t": arr}, path)
        with fs.safe_open(path, "numpy", chunk_bytes=chunk) as f:
            sl = f.get_slice("t")
            assert sl.get_shape() == list(arr.shape)
            for idx in indices:
                want = np.asarray(arr[idx])
                got = sl[idx]
                assert got.shape == want.shape, idx
                assert got.dtype == want.dtype
                assert got.tobytes() == np.ascontiguousarray(want).tobytes(), idx


UNSUPPORTED = [
    None, (None,), (0, None), (Ellipsis, None), np.array([0, 1]), [0, 1], (np.array([0]),),
    slice(None, None, -1), (slice(None), slice(None, None, -2)), slice(None, None, 0),
    True, False, np.bool_(True), (0, True),
    1.5, "a", (Ellipsis, Ellipsis),
    (0, 0, 0), 3, -4, (0, 5), (slice(None), -6),     # too many indices / out of bounds
]


@pytest.mark.parametrize("index", UNSUPPORTED, ids=repr)
def test_unsupported_indices_raise(index, tmp_path):
    path = tmp_path / "t.safetensors"
    stn.save_file({"t": np.arange(15, dtype=np.float32).reshape(3, 5)}, str(path))
    with fs.safe_open(path, "numpy") as f:
        with pytest.raises((IndexError, TypeError)):
            f.get_slice("t")[index]


def test_sub_byte_tensors_slice_only_whole(tmp_path):
    from format_support import build, entry
    path = tmp_path / "f4.safetensors"
    path.write_bytes(build({"p": entry("F4", [2, 4], 0)}, bytes([0x12, 0x34, 0x56, 0x78])))
    with fs.safe_open(path, "numpy") as f:
        for idx in (Ellipsis, slice(None), (slice(None), slice(None)), ()):
            assert f.get_slice("p")[idx].tobytes() == bytes([0x12, 0x34, 0x56, 0x78])
        for idx in (0, slice(0, 1), (slice(None), 1)):
            with pytest.raises(IndexError):
                f.get_slice("p")[idx]


# ---------------------------------------------------------------- planning, pure

def _copy(runs, src: bytes, size: int) -> tuple[bytes, np.ndarray]:
    """Simulate the 2-D copies; also count how often each destination byte is written."""
    out = bytearray(size)
    hits = np.zeros(size, np.int64)
    for r in runs:
        for row in range(r.height):
            s = r.src + row * r.pitch
            t = r.dst + row * r.width
            out[t:t + r.width] = src[s:s + r.width]
            hits[t:t + r.width] += 1
    return bytes(out), hits


UINT = {1: "U8", 2: "U16", 4: "U32", 8: "U64"}


@bounded(300)
@given(shape=shapes, itemsize=st.sampled_from(sorted(UINT)), data=st.data())
def test_slice_runs_copy_exactly_the_selection(shape, itemsize, data):
    nbytes = int(np.prod(shape)) * itemsize
    data_start = data.draw(st.integers(0, 40))
    start = data.draw(st.integers(0, 40))
    info = TensorInfo("t", DTYPES[UINT[itemsize]], tuple(shape), start, start + nbytes)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    buf = rng.integers(0, 256, data_start + start + nbytes + 16, dtype=np.uint8).tobytes()
    base = data_start + start
    arr = np.frombuffer(buf[base:base + nbytes], f"<u{itemsize}").reshape(shape)
    idx = data.draw(basic_index(tuple(shape)))
    want = np.array(arr[idx], order="C")   # (ascontiguousarray would turn 0-d into 1-d)

    out_shape, runs = slice_runs(info, data_start, idx)
    assert out_shape == want.shape
    assert sum(r.nbytes for r in runs) == want.nbytes          # nothing unselected is copied
    for r in runs:                                              # every row lies inside the tensor
        assert r.width > 0 and r.height > 0
        assert base <= r.src and r.src + r.span <= base + nbytes
        assert r.height == 1 or r.pitch >= r.width
    got, hits = _copy(runs, buf, want.nbytes)
    assert (hits == 1).all()                                    # destinations tile the result
    assert got == want.tobytes()


@bounded(300)
@given(shape=shapes, itemsize=st.sampled_from(sorted(UINT)), data=st.data())
def test_shard_indices_take_a_short_path_with_the_same_runs(shape, itemsize, data):
    """``x[a:b]`` and ``x[:, a:b]`` (tensor-parallel shards) skip the general planner: the runs
    are exactly the ones it would make, empty and full slices included."""
    nbytes = int(np.prod(shape)) * itemsize
    info = TensorInfo("t", DTYPES[UINT[itemsize]], tuple(shape), 8, 8 + nbytes)
    dim = data.draw(st.integers(0, min(1, len(shape) - 1))) if shape else 0
    n = shape[dim] if shape else 0
    a = data.draw(st.integers(-n - 2, n + 2))
    b = data.draw(st.integers(-n - 2, n + 2) | st.none())
    idx = (slice(None),) * dim + (slice(a, b),)
    if not shape:
        return
    assert slice_runs(info, 24, idx) == general_slice_runs(info, 24, idx)


def test_slice_runs_whole_tensor_is_one_run():
    info = TensorInfo("t", DTYPES["F32"], (3, 4), 16, 64)
    assert slice_runs(info, 100) == ((3, 4), [Run(116, 48, 48, 1, 0)])
    assert slice_runs(info, 100, ...) == ((3, 4), [Run(116, 48, 48, 1, 0)])
    assert slice_runs(info, 100, (slice(None), slice(1, 3))) == ((3, 2), [Run(120, 16, 8, 3, 0)])
    empty = TensorInfo("z", DTYPES["F32"], (0, 4), 64, 64)
    assert slice_runs(empty, 100) == ((0, 4), [])


@st.composite
def runs(draw):
    granule = draw(st.sampled_from([1, 2, 4, 8]))
    width = draw(st.integers(1, 40)) * granule
    height = draw(st.integers(1, 6))
    pitch = width + draw(st.integers(0, 24)) * granule if height > 1 else width
    return Run(draw(st.integers(0, 50)), pitch, width, height, draw(st.integers(0, 50))), granule


@bounded(300)
@given(rg=runs(), packed=st.booleans(), data=st.data())
def test_split_run_pieces_fit_and_reassemble(rg, packed, data):
    run, granule = rg
    max_bytes = data.draw(st.integers(granule, run.span + 8))
    pieces = split_run(run, max_bytes, granule, packed=packed)
    size_of = (lambda p: p.nbytes) if packed else (lambda p: p.span)
    assert all(size_of(p) <= max_bytes and p.width % granule == 0 and p.height >= 1 for p in pieces)
    assert sum(p.nbytes for p in pieces) == run.nbytes
    src = bytes(np.random.default_rng(run.src).integers(0, 256, run.src + run.span, dtype=np.uint8))
    size = run.dst + run.nbytes
    want, want_hits = _copy([run], src, size)
    got, hits = _copy(pieces, src, size)
    assert got == want and (hits == want_hits).all()
    if size_of(run) <= max_bytes:
        assert pieces == [run]
    if packed and run.width <= max_bytes:   # whole rows, as many as the landed bytes allow
        assert all(p.height == min(max_bytes // run.width, run.height - (p.dst - run.dst) // run.width)
                   for p in pieces)


def test_a_packed_cut_carries_a_chunk_of_the_slice_not_of_the_span():
    """Rank 0's TP=8 slice of down_proj [4096, 14336] bf16: 4096 rows of 3584 bytes, 28672 apart."""
    run = Run(1000, 28672, 3584, 4096, 0)
    chunk = 8 << 20
    by_span, by_slice = split_run(run, chunk), split_run(run, chunk, packed=True)
    assert max(p.span for p in by_span) <= chunk and len(by_span) == 14
    assert max(p.nbytes for p in by_slice) <= chunk and [p.height for p in by_slice] == [2340, 1756]


def test_reads_are_cut_by_read_bytes_and_gathers_by_the_slot():
    """A whole tensor and a row slice are read in pieces of ``read_bytes``; a column slice of a
    gathering file fills whole slots (``chunk_bytes`` of landed bytes); one of a file read with
    positional reads is cut by its span, like any read. Llama-3-8B's down_proj, bf16."""
    info = TensorInfo("down", DTYPES["BF16"], (4096, 14336), 0, 4096 * 14336 * 2)
    slot, read = 8 << 20, 4 << 20
    whole = plan_load([Selection(0, 0, info)], slot, read_bytes=read)
    assert [c.run.span for c in whole.chunks] == [read] * 28
    rows = plan_load([Selection(0, 0, info, (slice(0, 512),))], slot, read_bytes=read)
    assert [c.run.span for c in rows.chunks] == [read] * 3 + [(512 * 28672) - 3 * read]
    cols = (slice(None), slice(0, 1792))
    gathered = plan_load([Selection(0, 0, info, cols)], slot, files=GATHERS, read_bytes=read)
    assert [c.run.height for c in gathered.chunks] == [2340, 1756]   # as with no read_bytes at all
    assert gathered.chunks == plan_load([Selection(0, 0, info, cols)], slot, files=GATHERS).chunks
    spans = plan_load([Selection(0, 0, info, cols)], slot, read_bytes=read)
    assert max(c.run.span for c in spans.chunks) <= read and len(spans.chunks) == 28
    # a cold file (mostly not in the page cache) is read in whole slots: the disk wants big requests
    cold = [ReadPolicy(0), ReadPolicy(0, from_disk=True)]
    assert plan_load([Selection(1, 0, info)], slot, read_bytes=read, files=cold).chunks == plan_load(
        [Selection(1, 0, info)], slot).chunks
    assert plan_load([Selection(0, 0, info)], slot, read_bytes=read, files=cold).chunks == whole.chunks
    # never above a slot, never below the granule (checksum blocks keep whole blocks per chunk)
    assert plan_load([Selection(0, 0, info)], slot, read_bytes=4 * slot).chunks == plan_load(
        [Selection(0, 0, info)], slot).chunks
    blocks = plan_load([Selection(0, 0, info)], slot, granule=slot, read_bytes=read)
    assert {c.run.span for c in blocks.chunks} == {slot}


def test_split_run_granule_wins_over_a_smaller_chunk():
    """A chunk smaller than one element cannot be honoured: pieces are one granule wide."""
    pieces = split_run(Run(0, 16, 16, 1, 0), 3, granule=8)
    assert [(p.src, p.width) for p in pieces] == [(0, 8), (8, 8)]
    with pytest.raises(ValueError):
        split_run(Run(0, 16, 16, 1, 0), 0)


@bounded(80)
@given(shape=shapes.filter(lambda s: len(s) >= 1), data=st.data())
def test_plan_load_chunks_reassemble_the_slice(shape, data):
    info = TensorInfo("t", DTYPES["I16"], tuple(shape), 8, 8 + int(np.prod(shape)) * 2)
    idx = data.draw(basic_index(tuple(shape)))
    chunk = data.draw(st.integers(2, 64))
    plan = plan_load([Selection(0, N_LEN + 24, info, idx)], chunk)
    shape_out, direct = slice_runs(info, N_LEN + 24, idx)
    assert plan.destinations[0].shape == shape_out
    assert plan.chunks_per_dest == (len(plan.chunks),)
    assert all(c.run.span <= chunk for c in plan.chunks)
    size = plan.destinations[0].nbytes
    src = bytes(np.random.default_rng(0).integers(0, 256, info.end + N_LEN + 24, dtype=np.uint8))
    got, hits = _copy([c.run for c in plan.chunks], src, size)
    want, _ = _copy(direct, src, size)
    assert got == want and (hits == 1).all()
    gathered = plan_load([Selection(0, N_LEN + 24, info, idx)], chunk, files=GATHERS)   # rows packed by the source
    assert gathered.destinations == plan.destinations
    assert all(c.run.nbytes <= chunk and (c.run.height > 1 or c.run.span <= chunk) for c in gathered.chunks)
    assert len(gathered.chunks) <= len(plan.chunks)
    got, hits = _copy([c.run for c in gathered.chunks], src, size)
    assert got == want and (hits == 1).all()
    read = data.draw(st.integers(2, chunk))   # contiguous runs cut smaller than a slot, gathers not
    cut = plan_load([Selection(0, N_LEN + 24, info, idx)], chunk, files=GATHERS, read_bytes=read)
    if all(r.height == 1 for r in direct):
        assert all(c.run.span <= read for c in cut.chunks)
    else:   # a gathered run's pieces (one row each, at times) carry up to a slot
        assert all(c.run.nbytes <= chunk for c in cut.chunks)
    got, hits = _copy([c.run for c in cut.chunks], src, size)
    assert got == want and (hits == 1).all()


@bounded(150)
@given(tensors=st.lists(st.tuples(st.sampled_from([1, 2, 4, 8, 12, 4096]), st.integers(0, 6)), max_size=5),
       chunk=st.integers(1, 64))
def test_plan_save_chunks_cover_each_tensor_once(tensors, chunk):
    granules = [g for g, _ in tensors]
    sizes = [g * k for g, k in tensors]
    offsets = list(np.cumsum([0] + sizes[:-1]) + 100)
    items = plan_save(sizes, offsets, chunk, granules)
    for i, (size, off, g) in enumerate(zip(sizes, offsets, granules)):
        runs = sorted((r for j, r in items if j == i), key=lambda r: r.src)
        pos = 0
        for r in runs:
            assert r.src == pos and r.dst == off + r.src and r.height == 1 and r.width > 0
            assert r.src % g == 0 and r.width <= max(chunk, g)   # cut on granule boundaries
            pos += r.width
        assert pos == size


def test_multi_chunk_save_is_byte_identical(tmp_path):
    """Tensors larger than a chunk, written by several threads, some through the strided path."""
    rng = np.random.default_rng(7)
    base = rng.standard_normal((70, 90)).astype(np.float32)
    tensors = {"big": rng.integers(0, 2**16, 30_000, dtype=np.uint16), "t": base.T, "rows": base[::3],
               "bf": base.astype(ml_dtypes.bfloat16), "be": base[:20].astype(">f8"), "s": np.array(3.5)}
    ours, ref = tmp_path / "ours.safetensors", tmp_path / "ref.safetensors"
    fs.save_file(tensors, ours, metadata={"k": "v"}, chunk_bytes=4096, threads=2, fsync=False)
    stn.save_file({k: np.array(v, order="C") for k, v in tensors.items()}, str(ref), metadata={"k": "v"})
    assert ours.read_bytes() == ref.read_bytes()


@pytest.mark.parametrize("digits", [309, 310, 400])   # 309 nines: above the largest double
def test_integers_beyond_a_double_are_still_rejected_in_unknown_fields(digits):
    """The parser skips its per-integer hook when a header has no "-0" and no 300-digit run;
    such a run must still switch it on (serde_json: "number out of range")."""
    import struct
    from foxhunt_stream.errors import FormatError
    from foxhunt_stream.format.header import parse_header
    body = ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":' + "9" * digits + "}}").encode()
    body += b" " * (-len(body) % 8)
    with pytest.raises(FormatError) as e:
        parse_header(struct.pack("<Q", len(body)) + body, 8 + len(body) + 8)
    assert e.value.rule == "header-json"
