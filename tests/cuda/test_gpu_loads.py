"""GPU loader and saver. Skip cleanly without cupy or a CUDA device;
run on a GPU machine with `python -m pytest -q tests/cuda/test_gpu_loads.py`."""

import threading

import numpy as np
import pytest
import safetensors.numpy as stn

import foxhunt_stream as fs
from foxhunt_stream.engine.staging import current_pinned_pool  # noqa: E402
from foxhunt_stream.cuda import devices as fdev
from gpu_util import ALL_DTYPE_SPECS, require_gpu, write_random_file

pytestmark = pytest.mark.gpu


@pytest.fixture
def cp():
    return require_gpu()


def _bytes_of(arr, cp):
    if type(arr).__module__.startswith("torch"):
        import torch
        return arr.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes() if arr.numel() else b""
    return cp.asnumpy(arr).reshape(-1).view(np.uint8).tobytes()


@pytest.mark.parametrize("framework", ["cupy", "pt"])
def test_every_dtype_lands_byte_identical(tmp_path, cp, framework):
    if framework == "pt":
        pytest.importorskip("torch")
    raw = write_random_file(tmp_path / "all.safetensors", ALL_DTYPE_SPECS)
    out = fs.load_file(tmp_path / "all.safetensors", device="cuda:0", framework=framework)
    assert set(out) == set(raw)
    for name, arr in out.items():
        assert _bytes_of(arr, cp) == raw[name], name
        if framework == "cupy":
            assert arr.device.id == 0
            assert arr.data.ptr % 256 == 0
        else:
            assert arr.device.type == "cuda"
            assert arr.data_ptr() % 256 == 0


def test_torch_dtypes_and_shapes(tmp_path, cp):
    torch = pytest.importorskip("torch")
    write_random_file(tmp_path / "all.safetensors", ALL_DTYPE_SPECS)
    out = fs.load_file(tmp_path / "all.safetensors", device="cuda:0", framework="pt")
    assert out["t_bf16"].dtype == torch.bfloat16 and out["t_bf16"].shape == (3, 8)
    assert out["t_f8_e4m3"].dtype == torch.float8_e4m3fn
    assert out["t_f8_e5m2"].dtype == torch.float8_e5m2
    assert out["t_f32"].dtype == torch.float32
    assert out["t_c64"].dtype == torch.complex64
    assert out["t_bool"].dtype == torch.bool
    if hasattr(torch, "float8_e8m0fnu"):
        assert out["t_f8_e8m0"].dtype == torch.float8_e8m0fnu
    # F4 lands packed two per byte: logical [3, 8] -> [3, 4]
    assert tuple(out["t_f4"].shape) == (3, 4)


def test_cupy_values_match_numpy(tmp_path, cp):
    a = np.random.default_rng(1).standard_normal((64, 33)).astype(np.float32)
    stn.save_file({"a": a}, str(tmp_path / "a.safetensors"))
    out = fs.load_file(tmp_path / "a.safetensors", device="cuda:0")
    np.testing.assert_array_equal(cp.asnumpy(out["a"]), a)


@pytest.mark.parametrize("index", [
    np.s_[:], np.s_[3:17], np.s_[:, 5:9], np.s_[..., 2], np.s_[-1], np.s_[1:40:3, ::2], np.s_[:, :, 1:3],
    np.s_[2, 1:4, :], np.s_[5:5],
])
def test_get_slice_on_gpu_equals_numpy(tmp_path, cp, index):
    a = np.arange(48 * 10 * 6, dtype=np.int32).reshape(48, 10, 6)
    stn.save_file({"a": a}, str(tmp_path / "a.safetensors"))
    with fs.safe_open(tmp_path / "a.safetensors", framework="cupy", device="cuda:0") as f:
        got = f.get_slice("a")[index]
    np.testing.assert_array_equal(cp.asnumpy(got), a[index])


def test_column_slice_uses_small_chunks(tmp_path, cp):
    a = np.random.default_rng(2).integers(0, 1 << 30, (1000, 512), dtype=np.int32)
    stn.save_file({"a": a}, str(tmp_path / "a.safetensors"))
    with fs.safe_open(tmp_path / "a.safetensors", framework="pt", device="cuda:0", chunk_bytes=64 << 10) as f:
        got = f.get_slice("a")[:, 128:256]
    np.testing.assert_array_equal(got.cpu().numpy(), a[:, 128:256])


def test_tensors_valid_after_close_and_streaming(tmp_path, cp):
    raw = write_random_file(tmp_path / "m.safetensors", [(f"w{i}", "BF16", (256, 128)) for i in range(10)])
    with fs.safe_open(tmp_path / "m.safetensors", framework="cupy", device="cuda:0", chunk_bytes=16 << 10) as f:
        streamed = list(f.tensors())
        one = f.get_tensor("w3")
    assert [n for n, _ in streamed] == sorted(raw)   # one dtype: file order is name order
    for name, arr in streamed:
        assert _bytes_of(arr, cp) == raw[name]
    assert _bytes_of(one, cp) == raw["w3"]


def test_two_threads_load_same_gpu(tmp_path, cp):
    raw = write_random_file(tmp_path / "m.safetensors", [(f"w{i}", "F32", (300, 257)) for i in range(8)])
    results, errors = {}, []

    def run(k):
        try:
            results[k] = fs.load_file(tmp_path / "m.safetensors", device="cuda:0", chunk_bytes=64 << 10,
                                      staging_bytes=256 << 10, threads=3)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    assert not errors
    for k in range(2):
        for name, arr in results[k].items():
            assert _bytes_of(arr, cp) == raw[name]


def test_load_into_cupy_store_fills_existing_buffers(tmp_path, cp):
    raw = write_random_file(tmp_path / "m.safetensors", [("a", "F32", (64, 64)), ("b", "I64", (7,))],
                            metadata={"step": "3"})
    store = {"a": cp.zeros((64, 64), cp.float32), "b": cp.zeros(7, cp.int64)}
    ptrs = {k: v.data.ptr for k, v in store.items()}
    meta = fs.load_into(store, tmp_path / "m.safetensors")
    assert meta == {"step": "3"}
    for k, v in store.items():
        assert v.data.ptr == ptrs[k]
        assert _bytes_of(v, cp) == raw[k]


def test_load_into_torch_cuda_store(tmp_path, cp):
    torch = pytest.importorskip("torch")
    raw = write_random_file(tmp_path / "m.safetensors", [("a", "BF16", (128, 64)), ("b", "F8_E4M3", (9, 3))])
    store = {"a": torch.zeros(128, 64, dtype=torch.bfloat16, device="cuda:0"),
             "b": torch.zeros(9, 3, dtype=torch.float8_e4m3fn, device="cuda:0")}
    ptrs = {k: v.data_ptr() for k, v in store.items()}
    fs.load_into(store, tmp_path / "m.safetensors")
    for k, v in store.items():
        assert v.data_ptr() == ptrs[k]
        assert _bytes_of(v, cp) == raw[k]


def test_load_into_gpu_mismatch_leaves_store_untouched(tmp_path, cp):
    write_random_file(tmp_path / "m.safetensors", [("a", "F32", (4, 4)), ("b", "F32", (2,))])
    store = {"a": cp.full((4, 4), 7, cp.float32), "b": cp.full((3,), 7, cp.float32)}
    with pytest.raises(fs.StoreMismatchError, match="b"):
        fs.load_into(store, tmp_path / "m.safetensors")
    assert bool((store["a"] == 7).all())


def test_bad_device_errors(tmp_path, cp):
    write_random_file(tmp_path / "m.safetensors", [("a", "F32", (4,))])
    n = cp.cuda.runtime.getDeviceCount()
    with pytest.raises(fs.DeviceError, match=f"cuda:{n}"):
        fs.load_file(tmp_path / "m.safetensors", device=f"cuda:{n}")
    with pytest.raises(fs.DeviceError):
        fs.load_file(tmp_path / "m.safetensors", device="gpu0")


def test_device_oom_names_tensor_and_frees(tmp_path, cp):
    write_random_file(tmp_path / "m.safetensors", [("small", "F32", (16,)), ("big", "F32", (1024, 1024))])
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.used_bytes()
    pool.set_limit(size=pool.total_bytes() + (1 << 20))
    try:
        with pytest.raises(fs.DeviceOutOfMemoryError, match="big") as ei:
            fs.load_file(tmp_path / "m.safetensors", device="cuda:0")
        assert "cuda:0" in str(ei.value)
    finally:
        pool.set_limit(size=0)
    assert pool.used_bytes() == before


def test_no_memory_growth_over_repeated_loads(tmp_path, cp):
    write_random_file(tmp_path / "m.safetensors", [(f"w{i}", "BF16", (512, 256)) for i in range(6)])
    pool = cp.get_default_memory_pool()
    out = fs.load_file(tmp_path / "m.safetensors", device="cuda:0", chunk_bytes=64 << 10, staging_bytes=1 << 20)
    del out
    base = pool.used_bytes()
    staging = current_pinned_pool(0)
    for _ in range(5):
        out = fs.load_file(tmp_path / "m.safetensors", device="cuda:0", chunk_bytes=64 << 10, staging_bytes=1 << 20)
        del out
    assert pool.used_bytes() == base
    assert current_pinned_pool(0) is staging          # pinned staging reused, not reallocated
    assert staging.free_count() == staging.n_slots    # every slot returned


def test_read_error_releases_everything(tmp_path, cp):
    from foxhunt_stream.io import source
    write_random_file(tmp_path / "m.safetensors", [(f"w{i}", "F32", (256, 256)) for i in range(4)])
    pool = cp.get_default_memory_pool()
    fs.load_file(tmp_path / "m.safetensors", device="cuda:0", chunk_bytes=64 << 10, staging_bytes=1 << 20)
    base = pool.used_bytes()
    calls = []

    def hook(src, offset, length):
        calls.append(offset)
        if len(calls) == 5:
            raise OSError(5, "injected EIO")

    source.fault_hook = hook
    try:
        with pytest.raises(OSError, match="m.safetensors"):
            fs.load_file(tmp_path / "m.safetensors", device="cuda:0", chunk_bytes=64 << 10, staging_bytes=1 << 20)
    finally:
        source.fault_hook = None
    assert pool.used_bytes() == base
    staging = current_pinned_pool(0)
    assert staging.free_count() == staging.n_slots


# ------------------------------------------------------------------ saver

@pytest.mark.parametrize("framework", ["cupy", "pt"])
def test_gpu_save_every_dtype_byte_identical(tmp_path, cp, framework):
    if framework == "pt":
        pytest.importorskip("torch")
        import safetensors.torch as stt
    raw = write_random_file(tmp_path / "src.safetensors", ALL_DTYPE_SPECS, metadata={"format": "pt"})
    on_gpu = fs.load_file(tmp_path / "src.safetensors", device="cuda:0", framework=framework)
    fs.save_file(on_gpu, tmp_path / "out.safetensors", metadata={"format": "pt"}, chunk_bytes=4096,
                 staging_bytes=16384)
    # the reference serializer on host copies of the same arrays writes the same bytes
    if framework == "pt":
        stt.save_file({k: v.cpu() for k, v in on_gpu.items()}, str(tmp_path / "ref.safetensors"),
                      metadata={"format": "pt"})
    else:
        stn.save_file({k: cp.asnumpy(v) for k, v in on_gpu.items()}, str(tmp_path / "ref.safetensors"),
                      metadata={"format": "pt"})
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    with fs.safe_open(tmp_path / "out.safetensors") as f:
        for k in f.keys():
            assert f.get_tensor(k).reshape(-1).view(np.uint8).tobytes() == raw[k]


def test_gpu_save_sees_pending_producer_work(tmp_path, cp):
    torch = pytest.importorskip("torch")
    x = torch.zeros(4096, 1024, device="cuda:0")
    x.add_(3.0)                      # enqueued on torch's current stream
    y = (x * 2).contiguous()
    fs.save_file({"y": y}, tmp_path / "y.safetensors")
    assert float(fs.load_file(tmp_path / "y.safetensors")["y"].min()) == 6.0


def test_gpu_save_mixed_and_noncontiguous(tmp_path, cp):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    a = rng.standard_normal((64, 48)).astype(np.float32)
    tensors = {
        "host_np": a,
        "cupy": cp.asarray(a) * 2,
        "torch_gpu_t": torch.from_numpy(a).cuda().t(),          # non-contiguous on GPU
        "torch_cpu": torch.from_numpy(a[:, ::2].copy()),
        "cupy_strided": cp.asarray(a)[::2, 1::3],
    }
    fs.save_file(tensors, tmp_path / "m.safetensors", chunk_bytes=4096, staging_bytes=8192)
    ref = {"host_np": a, "cupy": a * 2, "torch_gpu_t": np.ascontiguousarray(a.T),
           "torch_cpu": np.ascontiguousarray(a[:, ::2]), "cupy_strided": np.ascontiguousarray(a[::2, 1::3])}
    stn.save_file(ref, str(tmp_path / "ref.safetensors"))
    assert (tmp_path / "m.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_gpu_sharded_save_reloads_through_index(tmp_path, cp):
    raw = write_random_file(tmp_path / "src.safetensors", [(f"w{i}", "BF16", (128, 64)) for i in range(7)])
    on_gpu = fs.load_file(tmp_path / "src.safetensors", device="cuda:0")
    out = tmp_path / "sharded"
    out.mkdir()
    fs.save_file(on_gpu, out, max_shard_size=40_000)
    assert (out / "model.safetensors.index.json").exists()
    back = fs.load_file(out / "model.safetensors.index.json", device="cuda:0")
    for k, v in back.items():
        assert _bytes_of(v, cp) == raw[k]


def test_gpu_save_failure_leaves_old_file(tmp_path, cp):
    from foxhunt_stream.io import sink
    write_random_file(tmp_path / "src.safetensors", [(f"w{i}", "F32", (256, 64)) for i in range(4)])
    on_gpu = fs.load_file(tmp_path / "src.safetensors", device="cuda:0")
    target = tmp_path / "ckpt.safetensors"
    target.write_bytes(b"old")
    n = []

    def hook(f, offset, length):
        n.append(offset)
        if len(n) == 6:
            raise OSError(28, "injected ENOSPC")

    sink.fault_hook = hook
    try:
        with pytest.raises(OSError):
            fs.save_file(on_gpu, target, chunk_bytes=8192, staging_bytes=32768)
    finally:
        sink.fault_hook = None
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors", "src.safetensors"]
    staging = current_pinned_pool(0)
    assert staging.free_count() == staging.n_slots


def test_load_to_second_gpu_if_present(tmp_path, cp):
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    raw = write_random_file(tmp_path / "m.safetensors", [("a", "F32", (64, 64))])
    out = fs.load_file(tmp_path / "m.safetensors", device="cuda:1")
    assert out["a"].device.id == 1
    assert _bytes_of(out["a"], cp) == raw["a"]


def test_a_first_load_pins_its_staging_by_registering_one_mapping(tmp_path, cp):
    """The pinned pool is one anonymous mapping whose slots are registered one by one (not one
    cudaHostAlloc each), and a load lands the same bytes from it."""
    from foxhunt_stream.cuda import runtime
    from foxhunt_stream.engine.staging import pinned_pool, slot_bytes
    specs = [(f"w{i}", "BF16", (257 + 31 * i, 1000)) for i in range(6)] + [("norm", "F32", (1000,))]
    raw = write_random_file(tmp_path / "m.safetensors", specs)
    opts = dict(chunk_bytes=96 << 10, staging_bytes=96 << 14, threads=4)   # 16 slots: a pool of its own size
    out = fs.load_file(tmp_path / "m.safetensors", device="cuda:0", framework="cupy", **opts)
    assert {n: _bytes_of(a, cp) for n, a in out.items()} == raw
    pool = pinned_pool(0, slot_bytes(96 << 10), 16)
    slots = [pool.acquire() for _ in range(pool.n_slots)]
    try:
        assert all(isinstance(s.owner, runtime.PinnedArena) for s in slots)
        assert len({s.owner for s in slots}) == 1
    finally:
        for s in slots:
            pool.release(s)
