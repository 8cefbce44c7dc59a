"""torch front end (fs.torch), streaming iteration, background loads, import hygiene.

Readiness and "blocks only on what it needs" are proven with a gate: the fault hook holds back
the reads of a later tensor until the test has received an earlier one. Were the code waiting
for everything, the gate would time out and the test would see it was never opened by the
consumer. No timing is asserted.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import safetensors.torch as sttorch  # noqa: E402

import foxhunt_stream as fs  # noqa: E402
from foxhunt_stream.engine import pipeline
from foxhunt_stream.io import mapping, source  # noqa: E402
from read_gates import range_of, gate_hook  # noqa: E402
from thread_support import foxhunt_threads_at_work  # noqa: E402

fst = fs.torch


class Net(torch.nn.Module):
    def __init__(self, tied: bool = True, extra: bool = False) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.register_buffer("steps", torch.tensor([7], dtype=torch.int64))
        self.register_buffer("scratch", torch.ones(3), persistent=False)
        if extra:
            self.more = torch.nn.Linear(8, 2)


def _filled(seed: int = 0, **kw) -> Net:
    torch.manual_seed(seed)
    m = Net(**kw)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    return m


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.fixture(autouse=True)
def _no_hook():
    yield
    source.fault_hook = None


def _foxhunt_threads() -> set[threading.Thread]:
    mapping.wait_unmapped(30)   # a used mapping's unmapping outlives its load by design
    return set(foxhunt_threads_at_work())


# ---------------------------------------------------------------- save_model / load_model

def test_save_model_is_byte_identical_to_reference_with_tied_weights(tmp_path):
    m = _filled()
    fst.save_model(m, tmp_path / "ours.safetensors")
    sttorch.save_model(m, str(tmp_path / "ref.safetensors"))
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    with fs.safe_open(tmp_path / "ours.safetensors") as f:
        assert "head.weight" not in f.keys()                        # the alias is dropped...
        assert f.metadata() == {"head.weight": "emb.weight"}        # ...and recorded


def test_save_model_keeps_user_metadata(tmp_path):
    # (with several metadata keys the reference writes them in hash order: compare parsed)
    m = _filled()
    fst.save_model(m, tmp_path / "ours.safetensors", metadata={"k": "v", "head.weight": "mine"})
    sttorch.save_model(m, str(tmp_path / "ref.safetensors"), metadata={"k": "v", "head.weight": "mine"})
    ours, ref = fs.read_header(tmp_path / "ours.safetensors"), fs.read_header(tmp_path / "ref.safetensors")
    assert ours.metadata == ref.metadata == {"k": "v", "head.weight": "mine"}   # user data wins
    assert ours.tensors == ref.tensors
    assert ((tmp_path / "ours.safetensors").read_bytes()[ours.data_start:]
            == (tmp_path / "ref.safetensors").read_bytes()[ref.data_start:])


def test_save_model_does_not_mutate_callers_metadata(tmp_path):
    meta = {"k": "v"}
    fst.save_model(_filled(), tmp_path / "m.safetensors", metadata=meta)
    assert meta == {"k": "v"}


def test_load_model_fills_in_place_and_returns_reference_result(tmp_path):
    src = _filled(1)
    path = tmp_path / "m.safetensors"
    fst.save_model(src, path)
    dst = _filled(2)
    ptrs = {n: t.data_ptr() for n, t in dst.state_dict().items()}
    result = fst.load_model(dst, path)
    assert result == sttorch.load_model(_filled(3), str(path)) == (set(), [])
    _same_state(dst, src)
    assert {n: t.data_ptr() for n, t in dst.state_dict().items()} == ptrs   # no second allocation
    assert dst.head.weight is dst.emb.weight


def test_files_cross_load_with_safetensors(tmp_path):
    src = _filled(4)
    fst.save_model(src, tmp_path / "ours.safetensors")
    ref_side = _filled(5)
    sttorch.load_model(ref_side, str(tmp_path / "ours.safetensors"))
    _same_state(ref_side, src)
    sttorch.save_model(src, str(tmp_path / "ref.safetensors"))
    our_side = _filled(6)
    fst.load_model(our_side, tmp_path / "ref.safetensors")
    _same_state(our_side, src)


def test_tied_weights_load_from_the_other_name(tmp_path):
    """A file keeping ``head.weight`` (another tool's choice) fills the tied pair too."""
    src = _filled(7)
    state = {k: v for k, v in src.state_dict().items() if k != "emb.weight"}
    fs.save_file(state, tmp_path / "m.safetensors")
    dst = _filled(8)
    assert fst.load_model(dst, tmp_path / "m.safetensors") == (set(), [])
    assert torch.equal(dst.emb.weight, src.emb.weight) and dst.head.weight is dst.emb.weight


def test_non_strict_reports_like_reference(tmp_path):
    src = _filled(9, extra=True)
    path = tmp_path / "m.safetensors"
    fst.save_model(src, path)
    dst = _filled(10, tied=False)       # lacks `more.*`, has an untied head the file lacks
    ours = fst.load_model(dst, path, strict=False)
    ref = sttorch.load_model(_filled(11, tied=False), str(path), strict=False)
    assert ours[0] == set(ref[0]) == {"head.weight"}
    assert sorted(ours[1]) == sorted(ref[1]) == ["more.bias", "more.weight"]
    assert torch.equal(dst.lin.weight, src.lin.weight)


def test_strict_error_is_raised_before_any_byte_is_read(tmp_path):
    path = tmp_path / "m.safetensors"
    fst.save_model(_filled(12, extra=True), path)
    dst = _filled(13)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    reads = []
    source.fault_hook = lambda src, off, n: reads.append(off)
    with pytest.raises(RuntimeError) as ei:
        fst.load_model(dst, path)
    assert isinstance(ei.value, fs.StoreMismatchError)
    assert "more.weight" in str(ei.value) and "Unexpected key(s)" in str(ei.value)
    assert ei.value.unexpected == ["more.bias", "more.weight"] or sorted(ei.value.unexpected) == [
        "more.bias", "more.weight"]
    assert reads == []
    for k, v in dst.state_dict().items():
        assert torch.equal(v, before[k])


def test_shape_mismatch_is_an_error_even_when_not_strict(tmp_path):
    path = tmp_path / "m.safetensors"
    fs.save_file({"lin.weight": torch.zeros(4, 8)}, path)
    with pytest.raises(fst.LoadModelError, match="lin.weight: shape"):
        fst.load_model(_filled(), path, strict=False)


def test_other_dtype_is_cast_like_load_state_dict(tmp_path):
    src = _filled(14)
    path = tmp_path / "m.safetensors"
    fst.save_model(src, path)                  # float32 file
    dst = _filled(15).to(torch.bfloat16)
    assert fst.load_model(dst, path) == (set(), [])
    assert dst.lin.weight.dtype == torch.bfloat16
    assert torch.equal(dst.lin.weight, src.lin.weight.to(torch.bfloat16))
    assert dst.steps.dtype == torch.bfloat16 or torch.equal(dst.steps, src.steps)


def test_meta_module_needs_materialisation(tmp_path):
    path = tmp_path / "m.safetensors"
    fst.save_model(_filled(), path)
    with torch.device("meta"):
        m = Net()
    with pytest.raises(ValueError, match="meta device"):
        fst.load_model(m, path)


def test_meta_module_after_to_empty(tmp_path):
    src = _filled(16, tied=False)
    path = tmp_path / "m.safetensors"
    fst.save_model(src, path)
    with torch.device("meta"):
        m = Net(tied=False)
    m.to_empty(device="cpu")
    assert fst.load_model(m, path) == (set(), [])
    _same_state(m, src)


def test_materialize_keeps_ties_and_names_unfilled_buffers(tmp_path):
    src = _filled(17)
    path = tmp_path / "m.safetensors"
    fst.save_model(src, path)
    with torch.device("meta"):
        m = Net()
    with pytest.warns(fst.MaterializeWarning, match="scratch"):
        assert fst.load_model(m, path, materialize=True, device="cpu") == (set(), [])
    assert m.head.weight is m.emb.weight and isinstance(m.head.weight, torch.nn.Parameter)
    assert m.lin.weight.device.type == "cpu" and not m.scratch.is_meta
    _same_state(m, src)


def test_load_model_from_a_background_load_started_before_the_model(tmp_path):
    """The cold-start order: the restore runs while the model is built on meta; the meta
    tensors then take the loaded tensors themselves, tied ones still tied."""
    src = _filled(30)
    path = tmp_path / "m.safetensors"
    fst.save_model(src, path)
    handle = fst.load_file(path, background=True)
    with torch.device("meta"):
        m = Net()
    assert fst.load_model(m, handle) == (set(), [])
    loaded = handle.result()
    assert m.lin.weight.data_ptr() == loaded["lin.weight"].data_ptr()   # assigned, not copied
    assert isinstance(m.lin.weight, torch.nn.Parameter) and m.lin.weight.requires_grad
    assert m.head.weight is m.emb.weight and isinstance(m.steps, torch.Tensor) and not m.steps.is_meta
    _same_state(m, src)
    assert m.scratch.is_meta   # non-persistent: no file holds it, as with load_state_dict(assign=True)


def test_load_model_from_a_handle_reports_and_refuses_like_the_path_form(tmp_path):
    path = tmp_path / "m.safetensors"
    fst.save_model(_filled(31, extra=True), path)
    with torch.device("meta"):
        m = Net(tied=False)
    with pytest.raises(fst.LoadModelError, match="Unexpected key") as ei:
        fst.load_model(m, fst.load_file(path, background=True))
    assert sorted(ei.value.unexpected) == ["more.bias", "more.weight"] and ei.value.missing == ["head.weight"]
    assert m.lin.weight.is_meta                      # nothing half-assigned
    missing, unexpected = fst.load_model(m, fst.load_file(path, background=True), strict=False)
    assert missing == {"head.weight"} and sorted(unexpected) == ["more.bias", "more.weight"]
    assert not m.lin.weight.is_meta and m.head.weight.is_meta
    bad = tmp_path / "bad.safetensors"
    fs.save_file({"lin.weight": torch.zeros(4, 8)}, bad)
    with torch.device("meta"):
        m2 = Net()
    with pytest.raises(fst.LoadModelError, match="lin.weight: shape"):
        fst.load_model(m2, fst.load_file(bad, background=True), strict=False)
    assert m2.lin.weight.is_meta
    with pytest.raises(TypeError, match="background=True"):
        fst.load_model(m2, fst.load_file(path, background=True), threads=2)


def test_load_model_from_a_handle_fills_real_tensors_in_place_and_casts(tmp_path):
    src = _filled(32)
    path = tmp_path / "m.safetensors"
    fst.save_model(src, path)                       # float32 file
    dst = _filled(33).to(torch.bfloat16)            # real storage, another dtype
    ptrs = {n: t.data_ptr() for n, t in dst.state_dict().items()}
    assert fst.load_model(dst, fst.load_file(path, background=True)) == (set(), [])
    assert {n: t.data_ptr() for n, t in dst.state_dict().items()} == ptrs
    assert torch.equal(dst.lin.weight, src.lin.weight.to(torch.bfloat16)) and dst.head.weight is dst.emb.weight
    with torch.device("meta"):
        m = Net().to(torch.bfloat16)                # meta, another dtype: the loaded tensor is cast
    fst.load_model(m, fst.load_file(path, background=True))
    assert m.lin.weight.dtype == torch.bfloat16 and torch.equal(m.lin.weight, src.lin.weight.to(torch.bfloat16))


def test_load_model_from_a_failed_background_load_raises_its_error(tmp_path):
    src = _filled(34)
    path = tmp_path / "m.safetensors"
    fst.save_model(src, path)
    lo, hi = range_of(str(path), "lin.weight")

    def hook(s, offset, length):
        if lo <= offset < hi:
            raise OSError(errno.EIO, "injected")
    source.fault_hook = hook
    handle = fst.load_file(path, background=True, chunk_bytes=4096)
    with torch.device("meta"):
        m = Net()
    with pytest.raises(OSError, match="injected"):
        fst.load_model(m, handle)
    assert m.lin.weight.is_meta and m.emb.weight.is_meta and not _foxhunt_threads()


class Stack(torch.nn.Module):
    """A model with a forward: embedding, three layers, a norm and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(self.norm(x))


def _stack_file(tmp_path, seed: int) -> tuple[Stack, str]:
    torch.manual_seed(seed)
    src = Stack()
    with torch.no_grad():
        for p in src.parameters():
            p.normal_()
    path = str(tmp_path / "stack.safetensors")
    fst.save_model(src, path)
    return src, path


def test_streamed_load_runs_the_first_modules_before_the_last_tensor_lands(tmp_path):
    src, path = _stack_file(tmp_path, 40)
    ids = torch.tensor([[1, 5, 9]])
    gate, log = threading.Event(), []
    source.fault_hook = gate_hook(path, "layers.2.weight", gate, log)
    with torch.device("meta"):
        m = Stack()
    sl = fst.load_model(m, fst.load_file(path, background=True, threads=2, chunk_bytes=4096), wait=False)
    assert isinstance(sl, fst.StreamedLoad) and (sl.missing, sl.unexpected) == (set(), [])
    with torch.inference_mode():
        x = torch.tanh(m.layers[0](m.emb(ids)))           # needs emb and layer 0 only: no wait on layer 2
    assert torch.equal(x, torch.tanh(src.layers[0](src.emb(ids))))
    assert not log and not sl.done() and m.layers[2].weight.is_meta and m.norm.weight.is_meta
    assert not m.layers[0]._forward_pre_hooks and m.layers[2]._forward_pre_hooks   # filled: hook gone
    assert m.emb.weight is m.head.weight and not m.head.weight.is_meta   # the tie was filled with its owner
    gate.set()
    with torch.inference_mode():
        out = m(ids)                                      # the rest waits for its own tensors
    assert log and all(log) and sl.done()
    assert torch.equal(out, src(ids).detach())
    assert not any(mod._forward_pre_hooks for mod in m.modules())   # the hooks removed themselves
    assert sl.wait() == (set(), [])
    _same_state(m, src)
    for p in m.parameters():   # parameters again, made outside the forward's inference_mode
        assert isinstance(p, torch.nn.Parameter) and p.requires_grad and not p.is_inference()
    assert not _foxhunt_threads()


def test_streamed_load_wait_fills_what_no_forward_asked_for(tmp_path):
    src, path = _stack_file(tmp_path, 41)
    with torch.device("meta"):
        m = Stack()
    sl = fst.load_model(m, fst.load_file(path, background=True), wait=False)
    assert sl.wait() == (set(), []) and sl.done()
    _same_state(m, src)
    assert m.head.weight is m.emb.weight and not any(mod._forward_pre_hooks for mod in m.modules())
    dst = Stack().to(torch.bfloat16)                      # real storage, another dtype: filled in place
    ptr = dst.layers[1].weight.data_ptr()
    sl = fst.load_model(dst, fst.load_file(path, background=True), wait=False)
    dst(torch.tensor([[2]]))
    assert sl.done() and dst.layers[1].weight.data_ptr() == ptr
    assert torch.equal(dst.layers[1].weight, src.layers[1].weight.to(torch.bfloat16))
    with pytest.raises(TypeError, match="wait=False"):
        fst.load_model(m, path, wait=False)


def test_streamed_load_error_surfaces_in_the_forward_and_at_wait(tmp_path):
    _, path = _stack_file(tmp_path, 42)
    lo, hi = range_of(path, "layers.1.weight")

    def hook(s, offset, length):
        if lo <= offset < hi:
            raise OSError(errno.EIO, "injected")
    source.fault_hook = hook
    with torch.device("meta"):
        m = Stack()
    sl = fst.load_model(m, fst.load_file(path, background=True, threads=2, chunk_bytes=4096), wait=False)
    with pytest.raises(OSError, match="injected"):
        m(torch.tensor([[3]]))
    with pytest.raises(OSError, match="injected"):
        sl.wait()
    assert m.layers[1].weight.is_meta and not sl.done() and not _foxhunt_threads()


def test_load_file_and_save_file_are_drop_ins(tmp_path):
    t = {"a": torch.randn(5, 3).to(torch.bfloat16), "b": torch.arange(6, dtype=torch.int32),
         "c": torch.randn(4, 4)[:, 1:3]}   # non-contiguous is saved as its values
    fst.save_file(t, tmp_path / "ours.safetensors", metadata={"m": "1"})
    ref = sttorch.load_file(str(tmp_path / "ours.safetensors"))
    ours = fst.load_file(tmp_path / "ours.safetensors")
    assert ref.keys() == ours.keys() == t.keys()
    for k in t:
        assert ours[k].dtype == t[k].dtype and torch.equal(ours[k], t[k]) and torch.equal(ref[k], t[k])


# ---------------------------------------------------------------- streaming

def _checkpoint(tmp_path, n: int = 6, numel: int = 4096) -> tuple[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    t = {f"t{i}": rng.standard_normal(numel).astype(np.float32) for i in range(n)}
    path = str(tmp_path / "s.safetensors")
    fs.save_file(t, path)
    return path, t


def test_tensors_follow_the_callers_order(tmp_path):
    path, t = _checkpoint(tmp_path)
    order = ["t4", "t0", "t5", "t2"]
    with fs.safe_open(path, framework="pt") as f:
        got = [(n, a.clone()) for n, a in f.tensors(order)]
        assert [n for n, _ in got] == order
        assert [n for n, _ in f.tensors()] == f.offset_keys()
    for n, a in got:
        np.testing.assert_array_equal(a.numpy(), t[n])


def test_tensors_yield_before_the_rest_has_landed(tmp_path):
    path, t = _checkpoint(tmp_path)
    gate, log = threading.Event(), []
    source.fault_hook = gate_hook(path, "t5", gate, log)
    with fs.safe_open(path, threads=2, chunk_bytes=4096) as f:
        it = f.tensors()
        name, first = next(it)
        np.testing.assert_array_equal(first, t["t0"])   # complete when yielded
        gate.set()
        rest = dict(it)
    assert name == "t0" and log and all(log)   # the gate was opened by the consumer, not the timeout
    np.testing.assert_array_equal(rest["t5"], t["t5"])


def test_tensors_yield_earlier_ones_then_raise(tmp_path):
    path, t = _checkpoint(tmp_path)
    lo, hi = range_of(path, "t3")

    def hook(src, offset, length):
        if lo <= offset < hi:
            raise OSError(errno.EIO, "injected")
    source.fault_hook = hook
    got = []
    with fs.safe_open(path, threads=2, chunk_bytes=4096) as f:
        with pytest.raises(OSError, match="injected"):
            for name, arr in f.tensors():
                got.append(name)
                np.testing.assert_array_equal(arr, t[name])
    assert got == ["t0", "t1", "t2"]
    assert not _foxhunt_threads()


def test_abandoning_the_iterator_cancels_the_rest(tmp_path, monkeypatch):
    path, t = _checkpoint(tmp_path, n=12)
    gate, log, reads, arrived = threading.Event(), [], [], threading.Event()
    held = gate_hook(path, "t2", gate, log, arrived)

    def hook(src, offset, length):
        reads.append(offset)
        return held(src, offset, length)
    source.fault_hook = hook
    real_cancel = pipeline.Job.cancel

    def cancel(self):
        real_cancel(self)
        gate.set()       # release the held read only once cancellation is requested
    monkeypatch.setattr(pipeline.Job, "cancel", cancel)
    before = _foxhunt_threads()
    with fs.safe_open(path, threads=1, chunk_bytes=4096) as f:
        it = f.tensors()
        assert next(it)[0] == "t0"
        assert arrived.wait(20)     # the worker is held at t2
        it.close()
    assert log == [True]
    lo_last, _ = range_of(path, "t3")
    assert all(off < lo_last for off in reads)        # nothing after the held tensor was read
    assert _foxhunt_threads() <= before


# ---------------------------------------------------------------- background loads

def test_background_wait_blocks_only_on_its_tensor(tmp_path):
    path, t = _checkpoint(tmp_path)
    gate, log = threading.Event(), []
    source.fault_hook = gate_hook(path, "t5", gate, log)
    h = fs.load_file(path, background=True, threads=2, chunk_bytes=4096)
    np.testing.assert_array_equal(h.wait("t1"), t["t1"])
    assert not h.done()
    gate.set()
    out = h.result()
    assert log and all(log) and h.done()
    for k in t:
        np.testing.assert_array_equal(out[k], t[k])


def test_background_error_surfaces_at_result(tmp_path):
    path, t = _checkpoint(tmp_path)
    lo, hi = range_of(path, "t4")

    def hook(src, offset, length):
        if lo <= offset < hi:
            raise OSError(errno.EIO, "injected")
    source.fault_hook = hook
    h = fs.load_file(path, background=True, threads=2, chunk_bytes=4096)
    np.testing.assert_array_equal(h.wait("t0"), t["t0"])
    with pytest.raises(OSError, match="injected"):
        h.wait("t4")
    with pytest.raises(OSError, match="injected"):
        h.result()
    with pytest.raises(OSError, match="injected"):   # again, not a hang or a half result
        h.result()
    assert h.done() and not _foxhunt_threads()


def test_background_cancel(tmp_path, monkeypatch):
    path, _ = _checkpoint(tmp_path)
    gate, log, arrived, reads = threading.Event(), [], threading.Event(), []
    held = gate_hook(path, "t1", gate, log, arrived)
    source.fault_hook = lambda src, off, n: (reads.append(off), held(src, off, n))[1]
    real_cancel = pipeline.Job.cancel
    monkeypatch.setattr(pipeline.Job, "cancel", lambda self: (real_cancel(self), gate.set()))
    h = fs.load_file(path, background=True, threads=1, chunk_bytes=4096)
    assert arrived.wait(20)
    h.cancel()
    assert h.done() and log == [True] and not _foxhunt_threads()
    assert all(off < range_of(path, "t2")[0] for off in reads)
    with pytest.raises(fs.CancelledError):
        h.result()


# ---------------------------------------------------------------- import hygiene

def test_import_is_light_and_prefetch_needs_no_torch(tmp_path):
    path, _ = _checkpoint(tmp_path)
    code = (
        "import sys, foxhunt_stream as fs\n"
        "heavy = [m for m in ('torch', 'cupy', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        f"fs.prefetch({path!r}, skip_resident=False).wait()\n"
        "assert 'torch' not in sys.modules and 'cupy' not in sys.modules\n"
        "fs.torch.load_file\n"
        "assert 'torch' in sys.modules\n"
    )
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = []
    for line in r.stderr.splitlines():
        if line.startswith("import time:") and "|" in line and "foxhunt_stream" in line:
            parts = line.split("|")
            rows.append((int(parts[1]), parts[2].rstrip()))
    total = max(us for us, name in rows if name.strip() == "foxhunt_stream")
    print(f"\nimport foxhunt_stream: {total / 1000:.1f} ms cumulative (python -X importtime); largest parts:")
    for us, name in sorted(rows, reverse=True)[:6]:
        print(f"  {us / 1000:7.1f} ms {name}")


def test_tensors_releases_the_load_when_a_check_fails_after_the_reads(tmp_path, monkeypatch):
    """A GPU digest is checked when its tensor is waited for, possibly after every read is done:
    tensors() must still drain and release the whole load (no chunk still landing, nothing kept)."""
    from foxhunt_stream.engine.destinations import Destinations
    from foxhunt_stream.engine.inflight import LoadInFlight
    path, _ = _checkpoint(tmp_path)
    released = []
    real_release = Destinations.release
    monkeypatch.setattr(Destinations, "release", lambda self: (released.append(True), real_release(self)))
    real_wait = LoadInFlight.wait_dest

    def wait_dest(self, d):
        real_wait(self, d)
        if d == 2:
            self.job.wait()   # every read done, as when a digest fails at settle
            raise fs.ChecksumError("checksum", "injected", path=path, tensor="t2")
    monkeypatch.setattr(LoadInFlight, "wait_dest", wait_dest)
    with fs.safe_open(path) as f:
        it = f.tensors()
        assert [next(it)[0] for _ in range(2)] == ["t0", "t1"]
        with pytest.raises(fs.ChecksumError, match="injected"):
            next(it)
    assert released and not _foxhunt_threads()
