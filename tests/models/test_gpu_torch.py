"""GPU variants of the torch front end, streaming, background loads and warmup (device="cuda:0").

Skips cleanly without torch, cupy or a CUDA GPU. Checks against CPU copies made by torch
itself, never against foxhunt_stream.
"""

from __future__ import annotations

import copy
import errno
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
cp = pytest.importorskip("cupy")

import foxhunt_stream as fs  # noqa: E402
from foxhunt_stream.engine.staging import current_pinned_pool  # noqa: E402
from foxhunt_stream.cuda import devices as fs_device
from foxhunt_stream.io import source  # noqa: E402
from read_gates import range_of  # noqa: E402

if not (torch.cuda.is_available() and fs_device.cuda_available()):
    pytest.skip("needs a CUDA GPU visible to both torch and cupy", allow_module_level=True)

pytestmark = pytest.mark.gpu
DEV = "cuda:0"
fst = fs.torch


class Net(torch.nn.Module):
    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.lin = torch.nn.Linear(32, 48)
        self.head = torch.nn.Linear(32, 64, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.register_buffer("steps", torch.tensor([7], dtype=torch.int64))


def _filled(seed: int, dtype=torch.float32) -> Net:
    torch.manual_seed(seed)
    m = Net().to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    return m


def _same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k].cpu(), sb[k].cpu()), k


@pytest.fixture(autouse=True)
def _no_hook():
    yield
    source.fault_hook = None


def test_load_model_lands_in_place_on_the_gpu(tmp_path):
    src = _filled(0, torch.bfloat16)
    path = tmp_path / "m.safetensors"
    fst.save_model(src, path)
    dst = _filled(1, torch.bfloat16).to(DEV)
    ptrs = {n: t.data_ptr() for n, t in dst.state_dict().items()}
    assert fst.load_model(dst, path) == (set(), [])
    _same(dst, src)
    assert {n: t.data_ptr() for n, t in dst.state_dict().items()} == ptrs
    assert dst.head.weight is dst.emb.weight


def test_load_model_waits_for_work_queued_on_the_destination(tmp_path):
    """A kernel torch queued on the destination must not overwrite the loaded bytes."""
    src = _filled(2)
    path = tmp_path / "m.safetensors"
    fst.save_model(src, path)
    dst = _filled(3).to(DEV)
    big = torch.randn(4096, 4096, device=DEV)
    for _ in range(20):            # keep torch's stream busy, then queue a late write to the destination
        big = torch.tanh(big @ big)
    dst.lin.weight.data.fill_(3.0)
    assert fst.load_model(dst, path) == (set(), [])
    torch.cuda.synchronize()
    _same(dst, src)


def test_meta_materialize_on_the_gpu_keeps_ties(tmp_path):
    src = _filled(4, torch.bfloat16)
    path = tmp_path / "m.safetensors"
    fst.save_model(src, path)
    with torch.device("meta"):
        m = Net().to(torch.bfloat16)
    fst.load_model(m, path, materialize=True, device=DEV)
    assert m.lin.weight.device == torch.device(DEV) and m.head.weight is m.emb.weight
    _same(m, src)


def test_meta_to_empty_then_load(tmp_path):
    src = _filled(5)
    src.head.weight = torch.nn.Parameter(src.emb.weight.detach().clone())   # untied
    path = tmp_path / "m.safetensors"
    fst.save_model(src, path)
    with torch.device("meta"):
        m = Net(tied=False)
    m.to_empty(device=DEV)
    assert fst.load_model(m, path) == (set(), [])
    _same(m, src)


def test_load_model_from_a_background_load_on_the_gpu(tmp_path):
    """Started before the model exists; the meta model takes the GPU tensors themselves."""
    src = _filled(9, torch.bfloat16)
    path = tmp_path / "m.safetensors"
    fst.save_model(src, path)
    handle = fst.load_file(path, device=DEV, background=True)
    with torch.device("meta"):
        m = Net().to(torch.bfloat16)
    assert fst.load_model(m, handle) == (set(), [])
    assert m.lin.weight.device == torch.device(DEV) and m.head.weight is m.emb.weight
    assert m.lin.weight.data_ptr() == handle.result()["lin.weight"].data_ptr()
    row = m.emb(torch.tensor([3], device=DEV))   # usable at once on torch's stream
    assert torch.equal(row.cpu(), src.emb.weight[3:4].detach())
    _same(m, src)


class Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def test_streamed_load_model_forward_on_the_gpu(tmp_path):
    """wait=False: the first forward runs on torch's stream while the loader's streams write;
    each module waits for its own tensors, and the result equals the CPU model's."""
    torch.manual_seed(10)
    src = Chain().to(torch.bfloat16)
    path = tmp_path / "chain.safetensors"
    fst.save_model(src, path)
    ids = torch.tensor([[1, 7, 33]])
    with torch.device("meta"):
        m = Chain().to(torch.bfloat16)
    h = fst.load_file(path, device=DEV, background=True, threads=2, chunk_bytes=1 << 12, staging_bytes=1 << 14)
    sl = fst.load_model(m, h, wait=False)
    with torch.inference_mode():
        out = m(ids.to(DEV))
        want = copy.deepcopy(src).to(DEV)(ids.to(DEV))   # the same kernels on weights torch moved
    assert sl.done() and sl.wait() == (set(), [])
    assert torch.equal(out, want)
    assert m.layers[3].weight.device == torch.device(DEV) and m.head.weight is m.emb.weight
    _same(m, src)


def test_cast_on_the_gpu(tmp_path):
    src = _filled(6)
    path = tmp_path / "m.safetensors"
    fst.save_model(src, path)
    dst = _filled(7).to(DEV, torch.float16)
    fst.load_model(dst, path)
    assert dst.lin.weight.dtype == torch.float16
    assert torch.equal(dst.lin.weight.cpu(), src.lin.weight.to(torch.float16))


def test_save_model_from_the_gpu_matches_the_reference(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    m = _filled(8, torch.bfloat16).to(DEV)
    fst.save_model(m, tmp_path / "ours.safetensors")
    st.save_model(m, str(tmp_path / "ref.safetensors"))
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def _checkpoint(tmp_path, n=6, numel=1 << 16):
    rng = np.random.default_rng(0)
    t = {f"t{i}": rng.standard_normal(numel).astype(np.float32) for i in range(n)}
    path = str(tmp_path / "s.safetensors")
    fs.save_file(t, path)
    return path, t


def test_streaming_to_the_gpu_in_order_and_ready(tmp_path):
    path, t = _checkpoint(tmp_path)
    lo, hi = range_of(path, "t5")
    gate, log = threading.Event(), []

    def hook(src, off, n):
        if lo <= off < hi:
            log.append(gate.wait(20))
    source.fault_hook = hook
    order = ["t2", "t0", "t5"]
    with fs.safe_open(path, framework="pt", device=DEV, threads=2, chunk_bytes=1 << 16,
                      staging_bytes=1 << 20) as f:
        it = f.tensors(order)
        name, first = next(it)
        # consumed on torch's current stream right away: must already hold the file's bytes
        assert name == "t2" and np.array_equal((first * 1).cpu().numpy(), t["t2"])
        gate.set()
        rest = list(it)
    assert [n for n, _ in rest] == ["t0", "t5"] and log and all(log)
    for n, a in rest:
        assert a.device == torch.device(DEV) and np.array_equal(a.cpu().numpy(), t[n])


def test_background_on_the_gpu_error_and_wait(tmp_path):
    path, t = _checkpoint(tmp_path)
    lo, hi = range_of(path, "t4")

    def hook(src, off, n):
        if lo <= off < hi:
            raise OSError(errno.EIO, "injected")
    source.fault_hook = hook
    h = fs.load_file(path, device=DEV, framework="pt", background=True, threads=2, chunk_bytes=1 << 16,
                     staging_bytes=1 << 20)
    assert np.array_equal(h.wait("t0").cpu().numpy(), t["t0"])
    with pytest.raises(OSError, match="injected"):
        h.result()


def test_torch_load_file_on_the_gpu(tmp_path):
    path, t = _checkpoint(tmp_path)
    out = fst.load_file(path, device=DEV)
    for k in t:
        assert out[k].device == torch.device(DEV) and np.array_equal(out[k].cpu().numpy(), t[k])


def test_background_warmup_then_load_shares_the_pool(tmp_path):
    h = fs.warmup(DEV, background=True, threads=3)
    times = h.result(timeout=120)
    assert set(times) == {"import_runtime", "context", "pinned_pool", "streams"}
    pool = current_pinned_pool(0)
    x = np.arange(100_000, dtype=np.float32)
    fs.save_file({"x": x}, tmp_path / "w.safetensors")
    out = fs.load_file(tmp_path / "w.safetensors", device=DEV, framework="pt", threads=3)
    assert np.array_equal(out["x"].cpu().numpy(), x)
    assert current_pinned_pool(0) is pool   # the warmed pool was used, not a second one


def test_warmup_creates_pool_and_streams():
    times = fs.warmup(DEV, threads=3)
    assert set(times) == {"import_runtime", "context", "pinned_pool", "streams"}
    ctx = fs_device.context(0)
    assert current_pinned_pool(0) is not None and ctx.streams_made >= 3
