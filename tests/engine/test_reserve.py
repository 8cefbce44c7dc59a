"""A load's torch tensors on a GPU are carved out of one block of torch's cache
(``TorchFramework.reserve``, called by ``Destinations.allocate`` per device): on the host with a
stand-in for torch's allocator; on a GPU, in a fresh process, by counting torch's ``cudaMalloc`` s."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from foxhunt_stream.cuda.devices import Device
from foxhunt_stream.engine import frameworks
from foxhunt_stream.engine.destinations import Destinations
from foxhunt_stream.engine.frameworks import TorchFramework
from foxhunt_stream.format.dtypes import DTYPES
from foxhunt_stream.format.plan import Selection, plan_load
from foxhunt_stream.format.header import TensorInfo

GPU0, GPU1 = Device("cuda", 0), Device("cuda", 1)
MiB = 1 << 20


class StandInTorch:
    """What ``reserve`` asks of torch: its cache's large-pool bytes (reserved, allocated), and ``empty``;
    the small pool holds 2 MiB, nearly all free, of no use to the tensors reserved for."""

    uint8 = "uint8"

    class OutOfMemoryError(RuntimeError):
        pass

    def __init__(self, reserved: int = 0, allocated: int = 0, fail: bool = False) -> None:
        self.made: list[tuple[int, str]] = []
        self.fail = fail

        class cuda:
            OutOfMemoryError = StandInTorch.OutOfMemoryError

            @staticmethod
            def memory_stats(index):
                return {"reserved_bytes.large_pool.current": reserved, "allocated_bytes.large_pool.current": allocated,
                        "reserved_bytes.small_pool.current": 2 * MiB, "allocated_bytes.small_pool.current": 512,
                        "reserved_bytes.all.current": reserved + 2 * MiB}
        self.cuda = cuda

    def empty(self, n, dtype, device):
        if self.fail:
            raise self.OutOfMemoryError("out of memory")
        self.made.append((n, device))


@pytest.fixture
def torch_standin(monkeypatch):
    def make(**kw):
        t = StandInTorch(**kw)
        monkeypatch.setattr(frameworks, "import_torch", lambda: t)
        return t
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    return make


def test_one_block_for_the_large_pool_tensors(torch_standin):
    t = torch_standin()
    TorchFramework().reserve(GPU1, [8 * MiB + 1, 4096, MiB, 2 * MiB])
    # 512-byte blocks; tensors of at most 1 MiB come from the small pool, not from this block
    assert t.made == [(8 * MiB + 512 + 2 * MiB, "cuda:1")]


def test_only_the_shortfall_of_the_free_cache(torch_standin):
    t = torch_standin(reserved=10 * MiB, allocated=4 * MiB)   # 6 MiB free in the large pool
    TorchFramework().reserve(GPU0, [8 * MiB, 8 * MiB])
    assert t.made == [(10 * MiB, "cuda:0")]


def test_nothing_when_the_cache_holds_enough(torch_standin):
    t = torch_standin(reserved=40 * MiB, allocated=8 * MiB)
    TorchFramework().reserve(GPU0, [16 * MiB, 16 * MiB])
    assert t.made == []
    TorchFramework().reserve(GPU0, [4096] * 100)   # small tensors only
    assert t.made == []


@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
@pytest.mark.parametrize("conf", ["expandable_segments:False,max_split_size_mb:512", "backend:cudaMallocAsync"])
def test_nothing_where_blocks_are_not_split(torch_standin, monkeypatch, var, conf):
    t = torch_standin()
    monkeypatch.setenv(var, conf)
    TorchFramework().reserve(GPU0, [64 * MiB, 64 * MiB])
    assert t.made == []


def test_nothing_for_one_tensor(torch_standin):
    t = torch_standin()
    TorchFramework().reserve(GPU0, [64 * MiB, 4096])   # one cudaMalloc either way
    assert t.made == []
    TorchFramework().reserve(GPU0, [64 * MiB, 2 * MiB])
    assert t.made == [(66 * MiB, "cuda:0")]


def test_stats_refused_leaves_the_tensors_to_their_own_allocations(torch_standin):
    t = torch_standin()

    def refused(index):
        raise RuntimeError("not supported by this allocator")
    t.cuda.memory_stats = staticmethod(refused)
    TorchFramework().reserve(GPU0, [64 * MiB, 64 * MiB])
    assert t.made == []


def test_out_of_memory_leaves_the_tensors_to_their_own_allocations(torch_standin):
    torch_standin(fail=True)
    TorchFramework().reserve(GPU0, [64 * MiB, 64 * MiB])   # no error: each tensor is then allocated alone


class RecordingFramework(frameworks.NumpyFramework):
    """Records what ``Destinations.allocate`` asks of a framework for GPU destinations."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Device, object]] = []

    def settle(self, device):
        self.calls.append(("settle", device, None))

    def reserve(self, device, sizes):
        self.calls.append(("reserve", device, sorted(sizes)))


def test_allocate_reserves_each_devices_own_tensors():
    dt = DTYPES["F32"]
    sels, offset = [], 0
    for i, n in enumerate((10, 20, 30, 40)):
        sels.append(Selection(0, 8, TensorInfo(f"t{i}", dt, (n,), offset, offset + 4 * n)))
        offset += 4 * n
    devices = [GPU0, GPU1, GPU0, Device("cpu")]
    plan = plan_load(sels, 1 << 20, devices=devices)
    fw = RecordingFramework()
    Destinations.allocate(fw, plan, devices)
    # settle first (blocks still read by queued work), then one reservation per GPU of its own sizes
    assert fw.calls == [("settle", GPU0, None), ("reserve", GPU0, [40, 120]),
                        ("settle", GPU1, None), ("reserve", GPU1, [80])]


SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import torch
    import foxhunt_stream as fs
    torch.empty(1, device="cuda:0")
    before = torch.cuda.memory_stats(0).get("segment.large_pool.allocated", 0)
    out = fs.load_file(sys.argv[1], device="cuda:0", framework="pt")
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats(0)
    host = fs.load_file(sys.argv[1])
    for k, v in host.items():
        assert np.array_equal(out[k].cpu().numpy(), v), k
    print(stats["segment.large_pool.allocated"] - before)
""")


def test_gpu_load_takes_one_cudamalloc_for_its_large_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with a GPU")
    import foxhunt_stream as fs
    rng = np.random.default_rng(5)
    # over 10 MiB each: without the reservation, torch gives each a cudaMalloc of its own
    tensors = {f"w{i}": rng.standard_normal((2600 + i, 1024)).astype(np.float32) for i in range(6)}
    tensors["small"] = np.arange(10, dtype=np.float32)
    p = tmp_path / "m.safetensors"
    fs.save_file(tensors, p)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(p)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    # six tensors, carved out of one reserved block
    assert int(r.stdout.split()[-1]) == 1
