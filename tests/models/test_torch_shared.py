"""fs.torch as a drop-in for safetensors.torch beyond files: bytes in and out, the helpers other
libraries import from it (storage_ptr, _find_shared_tensors, _TYPES...), the shared-tensor rules
and what save_file refuses. The installed safetensors.torch is the oracle where results are
compared."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sttorch = pytest.importorskip("safetensors.torch")

import foxhunt_stream as fs  # noqa: E402
import foxhunt_stream.torch as fst  # noqa: E402


def _mixed():
    return {
        "bf": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
        "i32": torch.tensor([[1, -2], [3, -4]], dtype=torch.int32),
        "c": torch.complex(torch.ones(3), -torch.ones(3)),
        "empty": torch.zeros(2, 0),
        "scalar": torch.tensor(2.5),
        "f8": torch.tensor([0.5, -1.0], dtype=torch.float8_e4m3fn),
    }


# ---------------------------------------------------------------- bytes

def test_save_gives_the_references_bytes_and_load_reads_them_back():
    tensors = _mixed()
    data = fst.save(tensors, metadata={"step": "7"})
    assert type(data) is bytes
    assert data == sttorch.save(tensors, metadata={"step": "7"})
    back = fst.load(data)
    assert list(back) == list(fs.safe_open(memoryview(data), "pt").offset_keys())
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and back[k].device.type == "cpu"
        assert torch.equal(back[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))


def test_load_reads_dtypes_the_reference_cannot():
    packed = torch.tensor([1.0, 2.0], dtype=torch.float8_e8m0fnu)
    assert fst.load(fst.save({"s": packed}))["s"].dtype == torch.float8_e8m0fnu


def test_save_file_and_save_write_the_same_bytes(tmp_path):
    tensors = _mixed()
    fst.save_file(tensors, tmp_path / "a.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == fst.save(tensors)


def test_loads_land_on_the_cpu_whatever_torchs_default_device():
    data = fst.save({"x": torch.ones(3)})
    torch.set_default_device("meta")
    try:
        assert fst.load(data)["x"].device.type == "cpu"
        with fs.safe_open(memoryview(data), "pt") as f:
            assert f.get_tensor("x").device.type == "cpu"
    finally:
        torch.set_default_device(None)


# ---------------------------------------------------------------- the helpers, by the reference's names

NAMES = ["storage_ptr", "storage_size", "_end_ptr", "_find_shared_tensors", "_is_complete",
         "_remove_duplicate_names", "_getdtype", "save", "load", "save_file", "load_file", "save_model",
         "load_model"]


@pytest.mark.parametrize("name", NAMES)
def test_every_reference_name_is_there_and_takes_the_references_arguments(name):
    ours, ref = getattr(fst, name), getattr(sttorch, name)
    theirs = inspect.signature(ref).parameters
    mine = inspect.signature(ours).parameters
    positional = [p for p in theirs.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert [p.name for p in mine.values()][:len(positional)] == [p.name for p in positional]
    for p in theirs.values():
        assert p.name in mine or any(q.kind == q.VAR_KEYWORD for q in mine.values()), p.name


def test_the_dtype_tables_cover_the_references():
    for code, dtype in sttorch._TYPES.items():
        assert fst._TYPES[code] == dtype and fst._getdtype(code) == dtype
    for dtype, size in sttorch._SIZE.items():
        if dtype is not None:
            assert fst._SIZE[dtype] == size
    assert fst._TYPES["F8_E8M0"] == torch.float8_e8m0fnu   # a superset: all the format has


def test_getdtype_follows_a_patched_table():
    fst._TYPES["X_TEST"] = torch.float32
    try:
        assert fst._getdtype("X_TEST") is torch.float32
    finally:
        del fst._TYPES["X_TEST"]


def test_storage_helpers_see_through_views():
    base = torch.zeros(8)
    view = base[2:5]
    assert fst.storage_ptr(view) == fst.storage_ptr(base) == base.data_ptr()
    assert fst.storage_size(view) == fst.storage_size(base) == 32
    assert fst._end_ptr(view) - view.data_ptr() == 12
    assert fst._end_ptr(base[::3]) - base.data_ptr() == 7 * 4   # last element (index 6) + 4 bytes
    assert fst._end_ptr(base[:0]) == base[:0].data_ptr()
    assert fst._is_complete(base) and not fst._is_complete(view) and not fst._is_complete(base[::2])
    meta = torch.zeros(3, device="meta")
    assert fst.storage_ptr(meta) == 0 and fst.storage_size(meta) == 12 and fst._is_complete(meta)


def _cases():
    a = torch.zeros(4, 4)
    lin = torch.nn.Linear(3, 3)
    yield {"a": a, "b": a[1:], "c": torch.ones(2)}             # overlap
    yield {"lo": a[:2], "hi": a[2:]}                            # one storage, disjoint halves
    yield {"x": a[:2], "y": a[1:3], "z": a[3:]}                 # a chain and a loner
    yield {"w": lin.weight, "tied": lin.weight, "b": lin.bias}  # the same tensor twice
    yield {"m": torch.zeros(2, device="meta"), "n": torch.zeros(2, device="meta")}
    yield {"col": a[:, 1], "row": a[0]}                         # strided views


@pytest.mark.parametrize("state", list(_cases()), ids=lambda s: "+".join(s))
def test_shared_groups_match_the_reference(state):
    assert fst._find_shared_tensors(state) == sttorch._find_shared_tensors(state)


@pytest.mark.parametrize("state", [s for s in _cases() if "col" not in s], ids=lambda s: "+".join(s))
def test_names_kept_and_dropped_match_the_reference(state):
    for kw in ({}, {"preferred_names": sorted(state)[-1:]}, {"discard_names": sorted(state)[:1]}):
        try:
            want = dict(sttorch._remove_duplicate_names(state, **kw))
        except RuntimeError:
            with pytest.raises(RuntimeError):
                fst._remove_duplicate_names(state, **kw)
            continue
        assert dict(fst._remove_duplicate_names(state, **kw)) == want


def test_a_tensor_covering_part_of_its_storage_cannot_be_deduplicated():
    part = torch.zeros(3, 3)[:1]
    with pytest.raises(RuntimeError, match="None is covering the entire storage"):
        fst._remove_duplicate_names({"part": part})
    with pytest.raises(RuntimeError):
        fst.shared_aliases({"part": part})


# ---------------------------------------------------------------- what save_file refuses

def test_tensors_sharing_memory_are_refused_and_nothing_is_written(tmp_path):
    a = torch.arange(6.0)
    for state in ({"a": a, "b": a[2:]}, {"a": a, "alias": a}, {"ok": torch.ones(2), "w": a, "w2": a[:1]}):
        for save in (lambda s: fst.save_file(s, tmp_path / "x.safetensors"), fst.save):
            with pytest.raises(RuntimeError, match="share memory"):
                save(state)
        with pytest.raises(RuntimeError):
            sttorch.save(state)
    assert not (tmp_path / "x.safetensors").exists()


def test_a_model_whose_weight_is_part_of_a_larger_tensor_is_refused_as_the_reference_does(tmp_path):
    model = torch.nn.Linear(2, 2)
    model.weight = torch.nn.Parameter(torch.zeros(4, 2)[:2])
    with pytest.raises(RuntimeError, match="None is covering the entire storage"):
        fst.save_model(model, tmp_path / "m.safetensors")
    with pytest.raises(RuntimeError):
        sttorch.save_model(model, str(tmp_path / "ref.safetensors"))


def test_disjoint_views_of_one_storage_are_saved():
    a = torch.arange(6.0)
    back = fst.load(fst.save({"lo": a[:3], "hi": a[3:]}))
    assert back["lo"].tolist() == [0, 1, 2] and back["hi"].tolist() == [3, 4, 5]


def test_a_tied_model_saves_through_save_model_only(tmp_path):
    model = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4, bias=False))
    model[1].weight = model[0].weight
    with pytest.raises(RuntimeError):
        fst.save_file(model.state_dict(), tmp_path / "m.safetensors")
    fst.save_model(model, tmp_path / "m.safetensors")
    with fs.safe_open(tmp_path / "m.safetensors", "pt") as f:
        assert f.keys() == ["0.weight"] and f.metadata() == {"1.weight": "0.weight"}


def test_sparse_tensors_are_refused_up_front_with_the_references_words(tmp_path):
    sparse = torch.eye(2).to_sparse()
    with pytest.raises(ValueError) as e:
        fst.save_file({"dense": torch.ones(1), "s": sparse}, tmp_path / "x.safetensors")
    assert str(e.value).startswith("You are trying to save a sparse tensors: `['s']` which this library does not")
    with pytest.raises(ValueError, match="sparse"):
        fs.save_file({"s": sparse}, tmp_path / "x.safetensors")   # the generic saver too, before any worker
    assert not (tmp_path / "x.safetensors").exists()


def test_meta_tensors_are_refused_up_front(tmp_path):
    for save in (fst.save_file, fs.save_file):
        with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor") as e:
            save({"m": torch.zeros(2, device="meta")}, tmp_path / "x.safetensors")
        assert isinstance(e.value, RuntimeError)
    assert not (tmp_path / "x.safetensors").exists()


def test_arguments_are_checked_with_the_references_types_and_words(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(ValueError) as e:
        fst.save_file("notadict", path)
    assert str(e.value) == "Expected a dict of [str, torch.Tensor] but received <class 'str'>"
    with pytest.raises(ValueError) as e:
        fst.save_file({"t": np.ones(2)}, path)
    assert str(e.value) == "Key `t` is invalid, expected torch.Tensor but received <class 'numpy.ndarray'>"
    with pytest.raises(TypeError, match="got 3 of type int"):
        fst.save({3: torch.ones(1)})


def test_non_contiguous_tensors_are_saved_a_deliberate_superset(tmp_path):
    t = torch.arange(6.0).reshape(2, 3).t()
    assert fst.load(fst.save({"t": t}))["t"].tolist() == t.tolist()
