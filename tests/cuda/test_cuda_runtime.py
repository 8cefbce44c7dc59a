"""foxhunt_stream.cuda.runtime takes the CUDA runtime from cupy_backends alone, without importing cupy
(whose import sat on the critical path of a GPU load), falls back to cupy's when that is not
importable, and says why and what to install when there is no runtime at all. Subprocesses with stand-in packages:
no GPU needed, and no real cupy is shadowed in this process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from foxhunt_stream.cuda import runtime

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE_CUPY = os.path.join(REPO, "tests", "fakecuda")

RUNTIME = textwrap.dedent("""
    import ctypes
    calls = []
    _host = {}
    def getDeviceCount(): calls.append("getDeviceCount"); return 1
    def getDevice(): return 0
    def setDevice(i): calls.append(("setDevice", i))
    def streamCreateWithFlags(flags): calls.append(("streamCreateWithFlags", flags)); return 11
    def streamSynchronize(s): calls.append(("streamSynchronize", s))
    def streamWaitEvent(s, e, flags=0): calls.append(("streamWaitEvent", s, e))
    def streamDestroy(s): calls.append(("streamDestroy", s))
    def eventCreateWithFlags(flags): calls.append(("eventCreateWithFlags", flags)); return 22
    def eventRecord(e, s): calls.append(("eventRecord", e, s))
    def eventSynchronize(e): calls.append(("eventSynchronize", e))
    def eventDestroy(e): calls.append(("eventDestroy", e))
    def hostAlloc(n, flags):
        b = ctypes.create_string_buffer(n); _host[ctypes.addressof(b)] = b
        calls.append(("hostAlloc", n, flags)); return ctypes.addressof(b)
    def freeHost(p): calls.append(("freeHost", p)); _host.pop(p)
""")

SCRIPT = textwrap.dedent("""
    import gc, sys
    from foxhunt_stream.cuda import runtime as cudart
    from foxhunt_stream.cuda import devices as device
    from cupy_backends.cuda.api import runtime as rt
    device.check_device(device.Device("cuda", 0))
    s, e = cudart.Stream(), cudart.Event()
    e.record(s.ptr); s.wait_event(e); e.synchronize(); s.synchronize()
    arr, owner = cudart.pinned(4096)
    arr[:] = 7
    view = arr[10:20]
    del arr, owner
    gc.collect()
    assert view.sum() == 70 and not any(c[0] == "freeHost" for c in rt.calls if isinstance(c, tuple))  # a view keeps it
    del view, s, e
    gc.collect()
    assert "cupy" not in sys.modules, "cupy was imported"
    assert ("streamCreateWithFlags", 1) in rt.calls and ("eventCreateWithFlags", 2) in rt.calls
    assert ("hostAlloc", 4096, 1) in rt.calls and ("streamWaitEvent", 11, 22) in rt.calls
    assert {c[0] for c in rt.calls if isinstance(c, tuple)} >= {"freeHost", "streamDestroy", "eventDestroy"}
    print("ok")
""")


def _fake_backends(root) -> None:
    """A stand-in ``cupy_backends.cuda.api.runtime`` (RUNTIME) under ``root``."""
    api = root / "cupy_backends" / "cuda" / "api"
    api.mkdir(parents=True)
    for d in (root / "cupy_backends", root / "cupy_backends" / "cuda", api):
        (d / "__init__.py").write_text("")
    (api / "runtime.py").write_text(RUNTIME)


def _run(code: str, path: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FOXHUNT_CUDART"}   # the default choice is what is tested
    env["PYTHONPATH"] = os.pathsep.join(path + [REPO])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)


def test_the_runtime_comes_without_importing_cupy(tmp_path):
    _fake_backends(tmp_path)
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text("raise RuntimeError('cupy imported')\n")
    r = _run(SCRIPT, [str(tmp_path)])
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_without_cupy_backends_cupys_runtime_is_used():
    r = _run("import sys; sys.modules['cupy_backends'] = None\n"
             "import cupy; from foxhunt_stream.cuda import runtime as cudart\n"
             "assert cudart.runtime() is cupy.cuda.runtime; print('ok')", [FAKE_CUPY])
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_foxhunt_cudart_cupy_takes_cupys_runtime_even_with_cupy_backends(tmp_path):
    _fake_backends(tmp_path)
    r = subprocess.run([sys.executable, "-c", "import cupy; from foxhunt_stream.cuda import runtime as cudart\n"
                        "assert cudart.runtime() is cupy.cuda.runtime; print('ok')"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "FOXHUNT_CUDART": "cupy",
                                        "PYTHONPATH": os.pathsep.join([str(tmp_path), FAKE_CUPY, REPO])})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_without_any_runtime_a_gpu_load_says_why_and_how_to_install_one():
    r = _run("import sys; sys.modules['cupy_backends'] = None; sys.modules['cupy'] = None\n"
             "import foxhunt_stream as fs\n"
             "from foxhunt_stream.cuda import runtime\n"
             "runtime.has_driver = lambda: True   # a machine with a GPU and its driver\n"
             "try:\n"
             "    from foxhunt_stream.cuda import devices\n"
             "    devices.check_device(devices.Device('cuda', 0))\n"
             "except fs.DeviceError as e:\n"
             "    print('DeviceError:', e)\n", [])
    out = r.stdout
    assert r.returncode == 0 and "cuda:0 cannot be used: no CUDA runtime: cupy is not installed" in out, r.stderr[-3000:]
    assert "pip install cupy-cuda13x" in out and "framework='pt'" in out


@pytest.mark.skipif(runtime.has_driver(), reason="this machine has an NVIDIA driver")
def test_on_a_machine_without_a_gpu_a_load_to_cuda_says_there_is_no_driver(tmp_path):
    """The default framework for a GPU is cupy; without a GPU the error is that, not cupy's install."""
    np.save(tmp_path / "unused.npy", np.zeros(1))
    r = _run("import numpy as np, foxhunt_stream as fs\n"
             f"fs.save_file({{'x': np.zeros(4, np.float32)}}, {str(tmp_path / 'x.safetensors')!r})\n"
             "try:\n"
             f"    fs.load_file({str(tmp_path / 'x.safetensors')!r}, device='cuda:0')\n"
             "except fs.DeviceError as e:\n"
             "    print('DeviceError:', e)\n", [])
    assert "DeviceError: cuda:0 cannot be used: no NVIDIA driver on this machine" in r.stdout, r.stdout + r.stderr
    assert "cupy" not in r.stdout
