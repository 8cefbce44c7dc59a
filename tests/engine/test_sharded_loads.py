"""Sharded checkpoints (directory / index / list) and tensor-parallel slices, on the host.

Checkpoints are written with the reference serializer (safetensors.numpy) and a hand-written
index; results are checked against the original numpy arrays and numpy.array_split, and read
accounting goes through ``source.fault_hook``, which sees every read before it happens.
"""

import json
import os
import threading

import numpy as np
import pytest
import safetensors.numpy as stn
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

import foxhunt_stream as fs
from foxhunt_stream.format.indexing import Run
from foxhunt_stream.io import pagecache, source as fsource
from foxhunt_stream.io.checkpoint import INDEX_NAME, read_header
from foxhunt_stream.io.mapping import PAGE, touched_bytes
from sharded_support import RULE, SHARDS, make_tensors, write_checkpoint

@pytest.fixture
def ckpt(tmp_path):
    t = make_tensors()
    d = write_checkpoint(str(tmp_path / "ckpt"), t, metadata={"format": "np"})
    return d, t


def assert_same(out, want):
    assert set(out) == set(want)
    for k in want:
        assert out[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(out[k], want[k], err_msg=k)


class ReadLog:
    """A fault_hook that records (path, offset, length) of every read and can run a callback."""

    def __init__(self, on_read=None):
        self.reads = []
        self.lock = threading.Lock()
        self.on_read = on_read

    def __call__(self, src, offset, length):
        with self.lock:
            self.reads.append((src.path, offset, length))
        if self.on_read is not None:
            self.on_read(src, offset, length)
        return None

    def total(self, path=None):
        return sum(n for p, _, n in self.reads if path is None or p == path)


@pytest.fixture
def read_log(monkeypatch):
    log = ReadLog()
    monkeypatch.setattr(fsource, "fault_hook", log)
    return log


def tensor_span(path, name):
    h = read_header(path)
    info = h.by_name[name] if h.by_name else next(t for t in h.tensors if t.name == name)
    return h.data_start + info.start, info


# ---------------------------------------------------------------- sources


def test_directory_index_list_and_plain_directory_agree(ckpt, tmp_path):
    d, t = ckpt
    files = [os.path.join(d, f) for f in SHARDS]
    results = [fs.load_file(d), fs.load_file(os.path.join(d, INDEX_NAME)), fs.load_file(files),
               fs.load_file(list(reversed(files)))]
    os.remove(os.path.join(d, INDEX_NAME))
    results.append(fs.load_file(d))
    for out in results:
        assert_same(out, t)


def test_safe_open_over_a_sharded_directory(ckpt):
    d, t = ckpt
    with fs.safe_open(d, framework="numpy") as f:
        assert f.keys() == sorted(t)
        assert f.offset_keys() == [x.name for fname in SHARDS for x in read_header(os.path.join(d, fname)).tensors]
        for n in t:
            np.testing.assert_array_equal(f.get_tensor(n), t[n])
        np.testing.assert_array_equal(f.get_slice("lm_head.weight")[2:5, 1::2], t["lm_head.weight"][2:5, 1::2])
        assert_same(dict(f.tensors()), t)


@pytest.mark.parametrize("names", [
    ["lm_head.weight", "embed.weight", "layers.0.norm"],
    "*.q_proj.weight",
    lambda n: n.startswith("layers.1.") or n == "scale",
])
def test_selection_across_shards_reads_only_selected_bytes(ckpt, read_log, names):
    d, t = ckpt
    out = fs.load_file(d, names=names)
    chosen = set(out)
    if isinstance(names, list):
        assert list(out) == names
    assert len({f for f, ns in SHARDS.items() if chosen & set(ns)}) >= 2   # the selection spans shards
    assert_same(out, {n: t[n] for n in chosen})
    want = {}
    for n in chosen:
        fname = next(f for f, ns in SHARDS.items() if n in ns)
        start, info = tensor_span(os.path.join(d, fname), n)
        want.setdefault(os.path.join(d, fname), []).append((start, start + info.nbytes))
    for path, off, length in read_log.reads:
        assert any(lo <= off and off + length <= hi for lo, hi in want[path]), (path, off, length)
    assert read_log.total() == sum(t[n].nbytes for n in chosen)


def test_one_plan_keeps_reads_of_different_files_in_flight_together(tmp_path, monkeypatch):
    """The last chunk of the first file is held until a read of the second file starts. With one
    job over every chunk of every file, an idle worker starts the second file meanwhile; with a
    drain at each file's end, the second file would never start and the hook would time out."""
    a = np.arange(8 * 4096, dtype=np.uint8)
    b = np.arange(8 * 4096, dtype=np.uint8)[::-1].copy()
    d = write_checkpoint(str(tmp_path / "c"), {"a": a, "b": b},
                         shards={"x.safetensors": ["a"], "y.safetensors": ["b"]})
    pa = os.path.join(d, "x.safetensors")
    start_a, _ = tensor_span(pa, "a")
    last_chunk_a = start_a + 7 * 4096
    second_file_started = threading.Event()
    overlapped = []

    def on_read(src, offset, length):
        if src.path.endswith("y.safetensors"):
            second_file_started.set()
        elif offset == last_chunk_a:
            overlapped.append(second_file_started.wait(timeout=20))

    monkeypatch.setattr(fsource, "fault_hook", ReadLog(on_read))
    out = fs.load_file(d, threads=2, chunk_bytes=4096, staging_bytes=4 * 4096)
    assert overlapped == [True]
    np.testing.assert_array_equal(out["a"], a)
    np.testing.assert_array_equal(out["b"], b)


# ---------------------------------------------------------------- index validation


def _rewrite_index(d, mutate):
    p = os.path.join(d, INDEX_NAME)
    with open(p) as f:
        obj = json.load(f)
    mutate(obj["weight_map"])
    with open(p, "w") as f:
        json.dump(obj, f)


def test_weight_map_with_dotdot_is_rejected(ckpt, tmp_path):
    d, t = ckpt
    stn.save_file({"evil": np.ones(3, np.float32)}, str(tmp_path / "outside.safetensors"))
    _rewrite_index(d, lambda wm: wm.update({"evil": "../outside.safetensors"}))
    with pytest.raises(fs.FormatError, match="leaves the checkpoint directory") as e:
        fs.load_file(d)
    assert e.value.rule == "index-path-escape" and e.value.tensor == "evil"
    assert e.value.path.endswith(INDEX_NAME)


def test_weight_map_with_an_absolute_path_is_rejected(ckpt, tmp_path):
    d, t = ckpt
    _rewrite_index(d, lambda wm: wm.update({"embed.weight": os.path.join(d, "model-00001-of-00003.safetensors")}))
    with pytest.raises(fs.FormatError, match="leaves the checkpoint directory") as e:
        fs.load_file(os.path.join(d, INDEX_NAME))
    assert e.value.rule == "index-path-escape" and e.value.tensor == "embed.weight"


def test_weight_map_through_a_symlink_pointing_outside_is_rejected(ckpt, tmp_path):
    d, t = ckpt
    stn.save_file({"evil": np.ones(3, np.float32)}, str(tmp_path / "outside.safetensors"))
    os.symlink(tmp_path / "outside.safetensors", os.path.join(d, "link.safetensors"))
    _rewrite_index(d, lambda wm: wm.update({"evil": "link.safetensors"}))
    with pytest.raises(fs.FormatError, match="resolves outside the checkpoint directory") as e:
        fs.load_file(d)
    assert e.value.rule == "index-path-escape" and e.value.tensor == "evil"


def test_symlinks_inside_the_directory_are_fine(ckpt):
    d, t = ckpt
    os.rename(os.path.join(d, "model-00003-of-00003.safetensors"), os.path.join(d, "real3.safetensors"))
    os.symlink("real3.safetensors", os.path.join(d, "model-00003-of-00003.safetensors"))
    assert_same(fs.load_file(os.path.join(d, INDEX_NAME)), t)


def test_hugging_face_cache_snapshot_symlinks_into_blobs_are_fine(tmp_path):
    """The hub cache keeps files in <repo>/blobs and symlinks them from <repo>/snapshots/<rev>/."""
    t = make_tensors()
    repo = tmp_path / "models--org--name"
    src = write_checkpoint(str(tmp_path / "build"), t)
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for i, fname in enumerate([*SHARDS, INDEX_NAME]):
        os.rename(os.path.join(src, fname), repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snap / fname)
    assert_same(fs.load_file(str(snap)), t)
    # ... but not anywhere else
    stn.save_file({"evil": np.ones(3, np.float32)}, str(tmp_path / "elsewhere.safetensors"))
    os.symlink(tmp_path / "elsewhere.safetensors", snap / "evil.safetensors")
    idx = json.loads((snap / INDEX_NAME).read_text())
    idx["weight_map"]["evil"] = "evil.safetensors"
    os.remove(snap / INDEX_NAME)
    (snap / INDEX_NAME).write_text(json.dumps(idx))
    with pytest.raises(fs.FormatError) as e:
        fs.load_file(str(snap))
    assert e.value.rule == "index-path-escape"


def test_weight_map_naming_a_missing_file_is_rejected(ckpt):
    d, t = ckpt
    _rewrite_index(d, lambda wm: wm.update({"embed.weight": "model-00009-of-00009.safetensors"}))
    with pytest.raises(fs.FormatError, match="does not exist") as e:
        fs.load_file(d)
    assert e.value.rule == "index-missing-file" and e.value.tensor == "embed.weight"


def test_weight_map_naming_the_wrong_shard_is_rejected(ckpt):
    d, t = ckpt
    _rewrite_index(d, lambda wm: wm.update({"embed.weight": "model-00002-of-00003.safetensors"}))
    with pytest.raises(fs.FormatError, match="model-00001-of-00003.safetensors") as e:
        fs.load_file(d)
    assert e.value.rule == "index-mismatch" and e.value.tensor == "embed.weight"
    assert e.value.path.endswith("model-00002-of-00003.safetensors")


def test_weight_map_naming_a_tensor_no_shard_holds_is_rejected(ckpt):
    d, t = ckpt
    _rewrite_index(d, lambda wm: wm.update({"ghost": "model-00002-of-00003.safetensors"}))
    with pytest.raises(fs.FormatError, match="no shard holds it") as e:
        fs.load_file(d)
    assert e.value.rule == "index-mismatch" and e.value.tensor == "ghost"


def test_shard_tensor_missing_from_the_index_is_rejected(ckpt):
    d, t = ckpt
    _rewrite_index(d, lambda wm: wm.pop("layers.0.norm"))
    with pytest.raises(fs.FormatError, match="layers.0.norm") as e:
        fs.load_file(d)
    assert e.value.rule == "index-mismatch"
    assert e.value.path.endswith("model-00002-of-00003.safetensors")


@pytest.mark.parametrize("how", ["list", "dir", "index"])
def test_duplicate_across_shards_names_both_files(tmp_path, how):
    t = make_tensors()
    d = write_checkpoint(str(tmp_path / "c"), t)
    stn.save_file({"layers.0.norm": t["layers.0.norm"], "extra": np.ones(2, np.float32)},
                  os.path.join(d, "model-00004-of-00003.safetensors"))
    files = [os.path.join(d, f) for f in [*SHARDS, "model-00004-of-00003.safetensors"]]
    if how == "index":
        _rewrite_index(d, lambda wm: wm.update({"extra": "model-00004-of-00003.safetensors"}))
    elif how == "dir":
        os.remove(os.path.join(d, INDEX_NAME))
    with pytest.raises(fs.FormatError) as e:
        fs.load_file(files if how == "list" else d)
    assert e.value.rule == "duplicate-across-shards" and e.value.tensor == "layers.0.norm"
    assert "model-00002-of-00003.safetensors" in str(e.value)
    assert "model-00004-of-00003.safetensors" in str(e.value)


def test_same_shard_spelled_two_ways_is_one_file(ckpt):
    d, t = ckpt
    _rewrite_index(d, lambda wm: wm.update({"embed.weight": "./model-00001-of-00003.safetensors"}))
    assert_same(fs.load_file(d), t)


# ---------------------------------------------------------------- metadata


def test_sharded_metadata_merges_shards_and_index(ckpt):
    d, t = ckpt
    with fs.safe_open(d) as f:
        assert f.metadata() == {"format": "np", "total_size": "1234"}
    files = [os.path.join(d, f) for f in SHARDS]
    with fs.safe_open(files) as f:
        assert f.metadata() == {"format": "np"}
    store = {n: np.zeros_like(v) for n, v in t.items()}
    assert fs.load_into(store, d) == {"format": "np", "total_size": "1234"}
    assert_same(store, t)


def test_conflicting_metadata_is_an_error_naming_both_files(tmp_path):
    t = make_tensors()
    d = write_checkpoint(str(tmp_path / "c"), t, metadata={"format": "np"})
    stn.save_file({n: t[n] for n in SHARDS["model-00002-of-00003.safetensors"]},
                  os.path.join(d, "model-00002-of-00003.safetensors"), metadata={"format": "pt"})
    with fs.safe_open(d) as f, pytest.raises(fs.FormatError, match="'format'") as e:
        f.metadata()
    assert e.value.rule == "metadata-conflict"
    assert "model-00001-of-00003" in str(e.value) and "model-00002-of-00003" in str(e.value)
    store = {n: np.zeros_like(v) for n, v in t.items()}
    with pytest.raises(fs.FormatError, match="metadata-conflict"):
        fs.load_into(store, d)
    assert all(not v.any() for v in store.values())   # nothing landed
    assert_same(fs.load_file(d), t)                    # tensors themselves still load


def test_index_metadata_conflicting_with_a_shard_names_the_index(tmp_path):
    t = make_tensors()
    d = write_checkpoint(str(tmp_path / "c"), t, metadata={"format": "np"}, index_metadata={"format": "pt"})
    with fs.safe_open(d) as f, pytest.raises(fs.FormatError, match=INDEX_NAME.replace(".", r"\.")):
        f.metadata()


# ---------------------------------------------------------------- tensor-parallel slices

def _dims(name, rule):
    return fs.Shard(0, 1, rule).dim_for(name)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("rule", [0, 1, -1, RULE], ids=["dim0", "dim1", "dim-1", "per-name"])
def test_every_rank_concatenates_back_to_the_full_tensor(ckpt, world, rule):
    d, t = ckpt
    if isinstance(rule, dict):
        names = None
    else:   # a single dim applies to every tensor with enough dims; scalars are replicated by name
        names = [n for n, v in t.items() if v.ndim > (rule if rule >= 0 else -rule - 1)]
    parts = [fs.load_file(d, names=names, shard=fs.Shard(r, world, rule)) for r in range(world)]
    for n in parts[0]:
        dim = _dims(n, rule)
        if dim is None:
            for p in parts:
                np.testing.assert_array_equal(p[n], t[n])
            continue
        want = np.array_split(t[n], world, axis=dim)
        for r, p in enumerate(parts):
            assert p[n].dtype == t[n].dtype
            np.testing.assert_array_equal(p[n], want[r], err_msg=f"{n} rank {r}")
        np.testing.assert_array_equal(np.concatenate([p[n] for p in parts], axis=dim), t[n])


@pytest.mark.parametrize("backend", ["pread", "mmap", "direct"])
def test_shards_through_every_backend_and_small_chunks(ckpt, backend):
    d, t = ckpt
    for r in range(3):
        out = fs.load_file(d, shard=fs.Shard(r, 3, RULE), backend=backend, direct_io="off", chunk_bytes=4096,
                           threads=2)
        for n, v in out.items():
            dim = _dims(n, RULE)
            np.testing.assert_array_equal(v, t[n] if dim is None else np.array_split(t[n], 3, axis=dim)[r])


def test_shard_with_a_callable_rule_and_torch_frameworks(ckpt):
    torch = pytest.importorskip("torch")
    d, t = ckpt
    rule = lambda n: 1 if n.endswith("o_proj.weight") else None  # noqa: E731
    out = fs.load_file(d, framework="pt", names="*.o_proj.weight", shard=fs.Shard(1, 2, rule))
    for n, v in out.items():
        assert isinstance(v, torch.Tensor)
        np.testing.assert_array_equal(v.numpy(), np.array_split(t[n], 2, axis=1)[1])


def test_load_into_a_store_of_rank_shapes(ckpt):
    d, t = ckpt
    world = 3
    for r in range(world):
        want = {n: (v if _dims(n, RULE) is None else np.array_split(v, world, axis=_dims(n, RULE))[r])
                for n, v in t.items()}
        store = {n: np.zeros_like(v) for n, v in want.items()}
        fs.load_into(store, d, shard=fs.Shard(r, world, RULE))
        assert_same(store, want)


def test_load_into_with_full_shapes_but_a_shard_is_a_mismatch_naming_the_rank(ckpt):
    d, t = ckpt
    store = {n: np.zeros_like(v) for n, v in t.items()}
    with pytest.raises(fs.StoreMismatchError, match=r"embed.weight: shape \[11, 6\] in the store, \[6, 6\] "
                                                    r"in the file \(rank 0 of 2\)"):
        fs.load_into(store, d, shard=fs.Shard(0, 2, RULE))
    assert all(not v.any() for v in store.values())


def test_safe_open_tensors_with_a_shard(ckpt):
    d, t = ckpt
    with fs.safe_open(d) as f:
        got = dict(f.tensors(["layers.0.o_proj.weight", "scale"], shard=fs.Shard(2, 3, RULE)))
    np.testing.assert_array_equal(got["layers.0.o_proj.weight"],
                                  np.array_split(t["layers.0.o_proj.weight"], 3, axis=1)[2])
    np.testing.assert_array_equal(got["scale"], t["scale"])


def test_background_load_with_a_shard(ckpt):
    d, t = ckpt
    h = fs.load_file(d, names="*.q_proj.weight", shard=fs.Shard(1, 2, 0), background=True)
    for n, v in h.result().items():
        np.testing.assert_array_equal(v, np.array_split(t[n], 2, axis=0)[1])


def test_shard_errors_name_the_tensor(ckpt):
    d, t = ckpt
    with pytest.raises(ValueError, match="'scale'"):
        fs.load_file(d, shard=fs.Shard(0, 2, 0))
    with pytest.raises(ValueError, match="'scale'.*'\\*': None"):
        fs.load_file(d, shard=fs.Shard(0, 2, {"*.weight": 0, "layers.*": 0, "empty": 0}))
    with pytest.raises(TypeError, match="foxhunt_stream.TPSlice"):
        fs.load_file(d, shard=(0, 2))
    with pytest.raises(TypeError, match="foxhunt_stream.TPSlice"):
        fs.load_into({n: np.zeros_like(v) for n, v in t.items()}, d, shard=(0, 2))


# ---------------------------------------------------------------- bytes read


def _one_tensor_ckpt(tmp_path, x):
    d = write_checkpoint(str(tmp_path / "one"), {"w": x, "pad": np.ones(1000, np.float32)},
                         shards={"a.safetensors": ["pad", "w"], "b.safetensors": []})
    return d, os.path.join(d, "a.safetensors")


@pytest.mark.parametrize("rank", [0, 2, 4])
def test_dim0_shard_reads_only_its_rows(tmp_path, read_log, rank):
    x = np.arange(23 * 64, dtype=np.float32).reshape(23, 64)   # 23 rows over 5 ranks: 5,5,5,4,4
    d, path = _one_tensor_ckpt(tmp_path, x)
    read_log.reads.clear()
    out = fs.load_file(d, names=["w"], shard=fs.Shard(rank, 5, 0), chunk_bytes=4096)
    a, b = np.cumsum([0] + [len(p) for p in np.array_split(np.arange(23), 5)])[[rank, rank + 1]]
    np.testing.assert_array_equal(out["w"], x[a:b])
    start, _ = tensor_span(path, "w")
    row = 64 * 4
    lo, hi = start + a * row, start + b * row
    assert all(p == path and lo <= off and off + n <= hi for p, off, n in read_log.reads), read_log.reads
    assert read_log.total() == (b - a) * row


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_last_dim_shard_by_positional_reads_reads_the_covered_row_span_in_chunks(tmp_path, read_log, rank):
    """backend="pread" (and a file not in the page cache) reads a column slice as whole row spans."""
    x = np.arange(40 * 250, dtype=np.float32).reshape(40, 250)   # 40 kB; 250 cols over 4 ranks: 63,63,62,62
    d, path = _one_tensor_ckpt(tmp_path, x)
    read_log.reads.clear()
    chunk = 8192
    out = fs.load_file(d, names=["w"], shard=fs.Shard(rank, 4, -1), chunk_bytes=chunk, backend="pread")
    want = np.array_split(x, 4, axis=1)[rank]
    np.testing.assert_array_equal(out["w"], want)
    bounds = np.cumsum([0] + [p.shape[1] for p in np.array_split(x, 4, axis=1)])
    a, b = bounds[rank], bounds[rank + 1]
    start, _ = tensor_span(path, "w")
    row, item = 250 * 4, 4
    lo, hi = start + a * item, start + 39 * row + b * item       # first covered byte .. last covered byte
    assert all(p == path and lo <= off and off + n <= hi for p, off, n in read_log.reads), read_log.reads
    assert max(n for _, _, n in read_log.reads) <= chunk         # never the whole tensor into one temporary
    assert want.nbytes <= read_log.total() <= hi - lo < x.nbytes


def test_plan_for_a_column_shard_is_2d_runs(ckpt):
    """The shard goes through indexing.slice_runs: x[:, a:b] is one 2-D run per chunk."""
    from foxhunt_stream.io.checkpoint import open_checkpoint
    from foxhunt_stream.engine.loader import selections
    from foxhunt_stream.format.plan import plan_load
    from foxhunt_stream.format.tp import indices_for
    d, t = ckpt
    ck = open_checkpoint(d)
    names = ["layers.0.o_proj.weight"]
    plan = plan_load(selections(ck, names, indices_for(ck, names, fs.Shard(1, 2, 1))), 1 << 20)
    (c,) = plan.chunks
    assert (c.run.width, c.run.height, c.run.pitch) == (3 * 4, 10, 7 * 4)


@pytest.mark.parametrize("backend", ["mmap", "auto"])
def test_mapped_sources_touch_only_the_pages_of_the_selected_columns(tmp_path, monkeypatch, backend):
    monkeypatch.setattr(pagecache, "resident_fraction", lambda p, samples=64: 1.0)   # "auto": in the page cache
    x = np.arange(16 * 8192, dtype=np.float32).reshape(16, 8192)   # rows of 32 KiB
    d, path = _one_tensor_ckpt(tmp_path, x)
    start, _ = tensor_span(path, "w")
    run = Run(start + 1024 * 4, 8192 * 4, 512 * 4, 16, 0)          # [:, 1024:1536]: 2 KiB of each row
    with fs.safe_open(path, backend=backend, direct_io="off") as f:
        got = f.get_slice("w")[:, 1024:1536]
        (src,) = f._sources
        assert src.backend == backend
        assert src.bytes_read == touched_bytes(run)                # the pages of the rows, not the gaps
    np.testing.assert_array_equal(got, x[:, 1024:1536])
    if PAGE == 4096:
        assert touched_bytes(run) <= 2 * 4096 * 16 < run.span // 3
    with fs.safe_open(path, backend="pread", direct_io="off") as f:
        f.get_slice("w")[:, 1024:1536]
        assert f._sources[0].bytes_read == run.span                # positional reads copy the whole row span


def test_mapped_gather_reports_a_truncated_file(tmp_path, monkeypatch):
    x = np.arange(40 * 250, dtype=np.float32).reshape(40, 250)
    d, path = _one_tensor_ckpt(tmp_path, x)
    monkeypatch.setattr(fsource, "fault_hook", lambda src, off, n: n - 1)
    with pytest.raises(fs.FormatError, match="file-truncated"):
        fs.load_file(path, names=["w"], shard=fs.Shard(1, 4, 1), backend="mmap", direct_io="off")


@st.composite
def basic_index(draw, shape):
    items = []
    for n in shape:
        kind = draw(st.sampled_from(["int", "slice", "full"]))
        if kind == "int" and n:
            items.append(draw(st.integers(-n, n - 1)))
        elif kind == "slice":
            items.append(slice(draw(st.none() | st.integers(-n - 2, n + 2)), draw(st.none() | st.integers(-n - 2, n + 2)),
                               draw(st.none() | st.integers(1, 3))))
        else:
            items.append(slice(None))
    cut = draw(st.integers(0, len(items)))
    items = items[:cut]
    if draw(st.booleans()) and len(items) < len(shape):
        items = [Ellipsis, *items[len(items) // 2:]] if draw(st.booleans()) else [*items, Ellipsis]
    return tuple(items)


@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_get_slice_basic_indices_match_numpy_across_shards_and_backends(ckpt, data):
    d, t = ckpt
    name = data.draw(st.sampled_from(["layers.0.mlp.w", "layers.0.o_proj.weight", "lm_head.weight",
                                      "layers.0.norm"]))
    index = data.draw(basic_index(t[name].shape))
    backend = data.draw(st.sampled_from(["pread", "mmap"]))
    try:
        want = t[name][index]
    except IndexError:   # the strategy can shift an int onto a shorter dim: numpy refuses, so must we
        with fs.safe_open(d, backend=backend, direct_io="off") as f, pytest.raises(IndexError):
            f.get_slice(name)[index]
        return
    with fs.safe_open(d, backend=backend, direct_io="off", chunk_bytes=4096, threads=2) as f:
        got = f.get_slice(name)[index]
    np.testing.assert_array_equal(got, want)
    assert got.shape == t[name][index].shape


def test_a_list_naming_one_file_twice_is_refused(ckpt):
    d, t = ckpt
    p = os.path.join(d, "model-00001-of-00003.safetensors")
    with pytest.raises(ValueError, match="more than once"):
        fs.load_file([p, os.path.join(d, ".", "model-00001-of-00003.safetensors")])


# ---------------------------------------------------------------- which files a directory load takes

def test_every_entry_point_prefers_model_safetensors_over_an_index(ckpt):
    """transformers' order, for every entry point: model.safetensors, else the index, else every
    *.safetensors file."""
    from foxhunt_stream.io.checkpoint import open_checkpoint
    from foxhunt_stream.models import hf_source
    d, t = ckpt
    single = {"only": np.arange(5, dtype=np.float32)}
    stn.save_file(single, os.path.join(d, "model.safetensors"))
    assert_same(fs.load_file(d), single)
    with fs.safe_open(d, framework="numpy") as f:
        assert f.keys() == ["only"]
    store = {"only": np.zeros(5, np.float32)}
    fs.load_into(store, d)
    assert_same(store, single)
    assert open_checkpoint(d).paths == [os.path.join(d, "model.safetensors")]
    assert hf_source.resolve(d).weights == os.path.join(d, "model.safetensors")
    os.remove(os.path.join(d, "model.safetensors"))
    assert_same(fs.load_file(d), t)
    assert hf_source.resolve(d).weights == os.path.join(d, INDEX_NAME)


def test_a_directory_entry_that_is_not_a_regular_file_is_refused_unopened(tmp_path):
    """A FIFO named *.safetensors would block a reader forever: it is named, never opened."""
    import subprocess
    import sys
    d = tmp_path / "d"
    d.mkdir()
    stn.save_file({"a": np.ones(3, np.float32)}, str(d / "a.safetensors"))
    os.mkfifo(d / "b.safetensors")
    program = ("import sys, foxhunt_stream as fs\n"
               "try:\n    fs.load_file(sys.argv[1])\n"
               "except fs.FormatError as e:\n    print(e.rule, e.path)\n")
    r = subprocess.run([sys.executable, "-c", program, str(d)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(fs.__file__))})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["not-a-regular-file", str(d / "b.safetensors")]
    os.remove(d / "b.safetensors")
    os.mkdir(d / "c.safetensors")
    with pytest.raises(fs.FormatError, match="a directory") as e:
        fs.load_file(d)
    assert e.value.rule == "not-a-regular-file" and e.value.path == str(d / "c.safetensors")


@pytest.mark.parametrize("name", ["link.safetensors", "model.safetensors", INDEX_NAME])
def test_a_directory_listing_is_confined_as_an_index_is(tmp_path, name):
    t = make_tensors()
    outside = write_checkpoint(str(tmp_path / "outside"), t)
    d = tmp_path / "d"
    d.mkdir()
    stn.save_file({"a": np.ones(3, np.float32)}, str(d / "a.safetensors"))
    target = INDEX_NAME if name == INDEX_NAME else "model-00001-of-00003.safetensors"
    os.symlink(os.path.join(outside, target), d / name)
    with pytest.raises(fs.FormatError, match="resolves outside the checkpoint directory") as e:
        fs.load_file(d)
    assert e.value.rule == "path-escape" and e.value.path == str(d / name)
    os.remove(d / name)
    os.rename(d / "a.safetensors", d / "a.data")   # a link within the directory is fine
    os.symlink("a.data", d / "a.safetensors")
    assert_same(fs.load_file(d), {"a": np.ones(3, np.float32)})


def test_a_hub_snapshot_without_an_index_may_link_into_its_blobs(tmp_path):
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    stn.save_file({"a": np.ones(3, np.float32)}, str(repo / "blobs" / "blob0"))
    os.symlink("../../blobs/blob0", snap / "model.safetensors")
    assert_same(fs.load_file(str(snap)), {"a": np.ones(3, np.float32)})
    os.remove(snap / "model.safetensors")
    os.symlink("../../blobs/blob0", snap / "weights.safetensors")
    assert_same(fs.load_file(str(snap)), {"a": np.ones(3, np.float32)})
