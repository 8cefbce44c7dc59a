"""GPU loads without cupy: ``cuda.libcudart`` calls the CUDA runtime library that torch has loaded,
under cupy's names, and ``cuda.runtime`` picks it when cupy is not installed.

No GPU is needed. The calls are checked against a stand-in library of C callbacks with the
runtime's own signatures (``tests/fakecuda/cudart_standin.py``). The pipeline runs through it in
a subprocess with cupy blocked. Where the CUDA toolkit is installed (its real libcudart, no
driver), the choice, the versions and the messages are checked against that library."""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from foxhunt_stream.cuda import diagnose
from foxhunt_stream.cuda.libcudart import CudaRuntimeError, LibCudart, loaded_paths, pick

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE = os.path.join(REPO, "tests", "fakecuda")

def _standin_module():
    """tests/fakecuda/cudart_standin.py, loaded by path: that folder on sys.path would shadow cupy."""
    spec = importlib.util.spec_from_file_location("cudart_standin", os.path.join(FAKE, "cudart_standin.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


StandIn = _standin_module().StandIn

TOOLKIT_CUDART = sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so.[0-9]*"))


def _run(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": REPO, **(env or {})})


# ---------------------------------------------------------------- finding the library torch loaded

MAPS = """\
7f0000000000-7f0000001000 r--p 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000001000-7f0000002000 r-xp 00001000 08:01 2 /venv/lib/python3.11/site-packages/nvidia/cu13/lib/libcudart.so.13
7f0000002000-7f0000003000 r--p 00002000 08:01 2 /venv/lib/python3.11/site-packages/nvidia/cu13/lib/libcudart.so.13
7f0000003000-7f0000004000 r-xp 00000000 08:01 3 /venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12
7f0000004000-7f0000005000 r-xp 00000000 08:01 4 /old/site-packages/torch/lib/libcudart-9335f6a2.so.11.0
7f0000005000-7f0000006000 r-xp 00000000 08:01 5 /opt/lib/libcudart_static_helper.so
7f0000006000-7f0000007000 rw-p 00000000 00:00 0 [heap]
7f0000007000-7f0000008000 r-xp 00000000 08:01 6 /usr/local/cuda-13.0/lib64/libcudart.so.13.0.96
"""


def test_loaded_paths_finds_every_wheel_layout_once():
    assert loaded_paths(MAPS) == [
        "/venv/lib/python3.11/site-packages/nvidia/cu13/lib/libcudart.so.13",
        "/venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12",
        "/old/site-packages/torch/lib/libcudart-9335f6a2.so.11.0",
        "/usr/local/cuda-13.0/lib64/libcudart.so.13.0.96",
    ]
    assert loaded_paths("") == []


def test_pick_takes_torchs_cuda_major_version():
    paths = loaded_paths(MAPS)
    assert pick(paths, "12.8").endswith("cuda_runtime/lib/libcudart.so.12")
    assert pick(paths, "13.0").endswith("cu13/lib/libcudart.so.13")
    assert pick(paths, "11.8").endswith("libcudart-9335f6a2.so.11.0")
    assert pick(paths, None) == paths[0] and pick(paths, "10.2") == paths[0]
    assert pick([], "13.0") is None


# ---------------------------------------------------------------- the calls, on the stand-in

def test_every_call_reaches_the_library_with_its_arguments():
    lib = StandIn(devices=2)
    rt = LibCudart(lib, "standin")
    assert (rt.getDeviceCount(), rt.getDevice(), rt.runtimeGetVersion(), rt.driverGetVersion()) == (2, 0, 13000, 13000)
    rt.setDevice(1)
    assert rt.getDevice() == 1
    stream, event = rt.streamCreateWithFlags(1), rt.eventCreateWithFlags(2)
    assert stream and event and stream != event
    rt.eventRecord(event, stream)
    rt.streamWaitEvent(stream, event)          # cupy's default flags=0
    rt.streamWaitEvent(stream, event, 0)
    rt.eventSynchronize(event)
    rt.streamSynchronize(stream)
    ptr = rt.hostAlloc(1 << 20, 1)
    src = np.arange(256, dtype=np.uint8)
    rt.memcpyAsync(ptr, src.ctypes.data, 256, rt.memcpyHostToDevice, stream)
    assert bytes((ctypes.c_ubyte * 256).from_address(ptr)) == src.tobytes()
    dst = np.zeros(64, np.uint8)
    rt.memcpy2DAsync(dst.ctypes.data, 8, src.ctypes.data, 32, 8, 8, rt.memcpyHostToDevice, 0)   # NULL stream
    assert np.array_equal(dst.reshape(8, 8), src.reshape(8, 32)[:, :8])
    rt.free(0)
    rt.freeHost(ptr)
    rt.eventDestroy(event)
    rt.streamDestroy(stream)
    calls = dict((name, args) for name, args in lib.calls)
    assert calls["cudaHostAlloc"][1:] == (1 << 20, 1)
    assert calls["cudaStreamCreateWithFlags"][1] == 1 and calls["cudaEventCreateWithFlags"][1] == 2
    assert calls["cudaEventRecord"] == (event, stream) and calls["cudaStreamWaitEvent"] == (stream, event, 0)
    assert calls["cudaMemcpy2DAsync"] == (dst.ctypes.data, 8, src.ctypes.data, 32, 8, 8, 1, None)   # NULL stream
    assert calls["cudaFreeHost"] == (ptr,) and calls["cudaFree"] == (None,)


def test_sizes_and_addresses_past_32_bits_arrive_whole():
    lib = StandIn()
    rt = LibCudart(lib)
    big, addr = (5 << 32) + 3, 0x7F12_3456_7000
    lib.fail["cudaMemcpyAsync"] = 1   # no copy: only the arguments matter here
    with pytest.raises(CudaRuntimeError):
        rt.memcpyAsync(addr, addr + 4096, big, rt.memcpyDeviceToHost, addr + 8)
    assert lib.calls[0] == ("cudaMemcpyAsync", (addr, addr + 4096, big, 2, addr + 8))


def test_a_failed_call_raises_with_the_runtimes_name_for_the_error():
    lib = StandIn()
    rt = LibCudart(lib)
    with pytest.raises(CudaRuntimeError) as e:
        rt.setDevice(7)
    assert e.value.status == 101 and e.value.name == "cudaErrorInvalidDevice" and e.value.call == "cudaSetDevice"
    assert str(e.value).startswith("cudaErrorInvalidDevice")
    assert lib.last_error_calls == 1   # the error is cleared: the next call does not report it again
    lib.fail["cudaGetDeviceCount"] = 35
    with pytest.raises(CudaRuntimeError, match="cudaErrorInsufficientDriver"):
        rt.getDeviceCount()


# ---------------------------------------------------------------- the pipeline on it, without cupy

PIPELINE = """
    import sys
    sys.modules["cupy"] = None; sys.modules["cupy_backends"] = None   # as where cupy is not installed
    import numpy as np
    import foxhunt_stream as fs
    import importlib.util
    spec = importlib.util.spec_from_file_location("cudart_standin", sys.argv[2])
    standin = importlib.util.module_from_spec(spec); spec.loader.exec_module(standin)
    StandIn = standin.StandIn
    from foxhunt_stream import settings
    from foxhunt_stream.cuda import devices, libcudart, runtime
    from foxhunt_stream.engine import destinations, inflight, loader, targets
    from foxhunt_stream.engine.frameworks import Buffer
    from foxhunt_stream.io.checkpoint import open_checkpoint

    lib = StandIn(devices=2)
    libcudart.open_loaded = lambda: libcudart.LibCudart(lib, "/site-packages/nvidia/cu13/lib/libcudart.so.13")
    rt = runtime.runtime()
    assert isinstance(rt, libcudart.LibCudart), type(rt)
    assert runtime.describe() == "torch's CUDA runtime (/site-packages/nvidia/cu13/lib/libcudart.so.13)"
    devices.check_device(devices.Device("cuda", 1))
    try:
        devices.check_device(devices.Device("cuda", 2))
    except fs.DeviceError as e:
        assert "no such GPU; this machine has 2" in str(e)
    else:
        raise AssertionError("cuda:2 accepted")

    # a whole load onto the stand-in "GPU" (device memory is host memory), checksums verified
    rng = np.random.default_rng(1)
    tensors = {f"t{i}": rng.standard_normal(3000 + 977 * i).astype(np.float32) for i in range(6)}
    tensors["m"] = rng.standard_normal((64, 48)).astype(np.float32)
    fs.save_file(tensors, sys.argv[1], checksum="xxh3-64", checksum_block=4096)
    ck = open_checkpoint(sys.argv[1])
    names = sorted(tensors)
    gpu = devices.Device("cuda", 0)
    s = settings.merge(chunk_bytes=4096, staging_bytes=4 * 4096, threads=2, backend="pread")   # no gathers
    for verify, index in ((True, {}), (False, {"m": (slice(None), slice(8, 40))})):   # a 2-D copy: a column slice
        plan, s2, policies, verifier = loader.prepare(ck, loader.selections(ck, names, index), s, gpu, verify=verify)
        want = {n: tensors[n][index[n]] if n in index else tensors[n] for n in names}
        arrays = [np.zeros(want[n].shape, np.float32) for n in names]
        bufs = [Buffer(gpu, a.nbytes, None, a.ctypes.data) for a in arrays]
        sources = loader.open_sources(ck, policies)
        inflight.LoadInFlight(plan, sources, destinations.Destinations.fixed(bufs, arrays), s2, check=verifier).finish()
        loader.close_all(sources)
        for a, n in zip(arrays, names):
            assert np.array_equal(a, want[n]), n
    used = {name for name, _ in lib.calls}
    # the staging slots: one anonymous mapping, each slot registered (no cudaHostAlloc)
    assert {"cudaHostRegister", "cudaMemcpyAsync", "cudaMemcpy2DAsync", "cudaEventRecord",
            "cudaStreamCreateWithFlags"} <= used and "cudaHostAlloc" not in used

    # the saver's direction: device bytes -> a pinned slot
    t = targets.CudaTarget(0, 4096, 2)
    src = np.arange(1000, dtype=np.uint8)
    pool, slot, view = t.fetch(0, src.ctypes.data, 1000)
    assert np.array_equal(view, src)
    pool.release(slot)
    assert "cupy" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
    print("ok")
"""


def test_the_pipeline_runs_on_the_ctypes_runtime_without_cupy(tmp_path):
    r = _run(PIPELINE, str(tmp_path / "c.safetensors"), os.path.join(FAKE, "cudart_standin.py"))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:] + r.stdout


# ---------------------------------------------------------------- the choice, and what it says

CHOICE = """
    import ctypes, sys
    sys.modules["cupy"] = None; sys.modules["cupy_backends"] = None
    if len(sys.argv) > 1:
        ctypes.CDLL(sys.argv[1])        # as `import torch` maps it
    import foxhunt_stream as fs
    from foxhunt_stream.cuda import devices, libcudart, runtime
    try:
        rt = runtime.runtime()
        print("runtime", type(rt).__name__, getattr(rt, "path", ""), rt.runtimeGetVersion())
        devices.check_device(devices.Device("cuda", 0))
        print("usable")
    except fs.DeviceError as e:
        print("DeviceError:", e)
"""


@pytest.mark.skipif(not TOOLKIT_CUDART, reason="no CUDA toolkit here (its libcudart stands for torch's)")
def test_a_loaded_runtime_is_found_and_says_what_the_gpu_lacks():
    """The runtime a process has loaded is found and called; on a machine without a driver the
    error says so and what fixes it."""
    r = _run(CHOICE, TOOLKIT_CUDART[0])
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and len(lines) == 2, r.stderr[-3000:] + r.stdout
    kind, name, path, version = lines[0].split()
    assert (kind, name) == ("runtime", "LibCudart") and os.path.realpath(path) == os.path.realpath(TOOLKIT_CUDART[0])
    assert int(version) >= 11000
    if lines[1] != "usable":   # this machine has no NVIDIA driver
        assert lines[1].startswith("DeviceError: cuda:0 cannot be used: ")
        assert "driver" in lines[1] and "To fix" in lines[1] and path in lines[1]


def test_foxhunt_cudart_torch_without_a_loaded_runtime_says_so():
    r = _run(CHOICE, env={"FOXHUNT_CUDART": "torch"})
    assert "DeviceError: FOXHUNT_CUDART=torch, but no CUDA runtime library is loaded" in r.stdout, r.stderr + r.stdout


def test_a_misspelled_foxhunt_cudart_lists_the_choices():
    r = _run(CHOICE, env={"FOXHUNT_CUDART": "pytorch"})
    assert "FOXHUNT_CUDART must be one of auto, cupy, torch (or unset), got 'pytorch'" in r.stdout, r.stderr + r.stdout


# ---------------------------------------------------------------- the words (pure)

@pytest.mark.parametrize("facts, says, fix", [
    (diagnose.TorchFacts(installed=False), "torch is not installed", "install a CUDA build of torch"),
    (diagnose.TorchFacts(installed=True), "torch is installed but not imported yet", "import torch first"),
    (diagnose.TorchFacts(True, True, "2.13.0+cpu", None), "torch 2.13.0+cpu is a CPU-only build",
     "install a CUDA build of torch"),
    (diagnose.TorchFacts(True, True, "2.9.0+rocm6.4", None, "6.4"), "is a ROCm build", "cupy-cuda13x"),
])
def test_no_runtime_says_why_and_what_to_install(facts, says, fix):
    msg = diagnose.no_runtime(facts, cupy_installed=False)
    assert "cupy is not installed" in msg and says in msg and fix in msg
    assert "pip install cupy-cuda13x" in msg   # a package the index has (the project installs from a checkout)


def test_without_a_driver_no_runtime_says_that_first():
    msg = diagnose.no_runtime(diagnose.TorchFacts(installed=False), cupy_installed=False, driver=False)
    assert "no NVIDIA driver" in msg and "device='cpu'" in msg and "cupy" not in msg


def test_a_runtime_failure_says_whether_the_driver_or_the_gpu_is_missing():
    rt = "torch's CUDA runtime (/x/libcudart.so.13)"
    old = diagnose.runtime_failure("cudaErrorInsufficientDriver: CUDA driver version is insufficient", rt, 13000,
                                   12040, None)
    assert "supports CUDA up to 12.4, and torch's CUDA runtime (/x/libcudart.so.13) is CUDA 13.0" in old
    assert "update the NVIDIA driver" in old
    none = diagnose.runtime_failure("cudaErrorInsufficientDriver: ...", rt, 13000, 0, None)
    assert "no NVIDIA driver is loaded" in none
    hidden = diagnose.runtime_failure("cudaErrorNoDevice: no CUDA-capable device is detected", rt, 13000, 13000, "")
    assert "sees no GPU with CUDA_VISIBLE_DEVICES=''" in hidden
    assert diagnose.version(12080) == "12.8" and diagnose.version(0) == "none"
