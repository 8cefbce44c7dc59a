"""device_map on GPUs: halves of a checkpoint on cuda:0 and cuda:1 (skips with fewer than two),
and a mixed cpu + cuda:0 map. Every tensor must sit on its mapped device and hold the file's
bytes, as written by the test (not read back through the library).

    python -m pytest -q tests/cuda/test_gpu_device_map.py
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

import foxhunt_stream as fs  # noqa: E402
from foxhunt_stream.cuda.devices import cuda_available  # noqa: E402
from gpu_util import write_random_file  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU"),
]

LAYERS = 6
SPECS = ([("model.embed.weight", "BF16", (64, 96))]
         + [(f"model.layers.{i}.{part}", dt, shape) for i in range(LAYERS)
            for part, dt, shape in (("attn.weight", "BF16", (96, 96)), ("mlp.weight", "F32", (96, 200)),
                                    ("norm.weight", "F16", (96,)), ("empty", "F32", (0, 4)))]
         + [("model.norm.weight", "F32", (96,)), ("lm_head.weight", "BF16", (64, 96))])


def _gpus() -> int:
    return cp.cuda.runtime.getDeviceCount()


def _framework_or_skip(framework):
    if framework == "pt":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch without CUDA")


def _where(v) -> str:
    """'cpu' or 'cuda:N' for a numpy, cupy or torch array."""
    if isinstance(v, np.ndarray):
        return "cpu"
    if type(v).__module__.startswith("torch"):
        return "cpu" if v.device.type == "cpu" else f"cuda:{v.device.index}"
    return f"cuda:{v.device.id}"


def _bytes(v) -> bytes:
    if isinstance(v, np.ndarray):
        return v.tobytes()
    if type(v).__module__.startswith("torch"):
        import torch
        t = v.detach().cpu().contiguous()
        return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return cp.asnumpy(v).tobytes()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("device_map") / "m.safetensors")
    return path, write_random_file(path, SPECS, seed=9)


def _check(out, raw, want_device, framework):
    assert out.keys() == raw.keys()
    for name, v in out.items():
        assert _where(v) == want_device(name), name
        assert _bytes(v) == raw[name], name
        if framework == "pt" and _where(v) == "cpu":
            assert type(v).__module__.startswith("torch")


def _halves(name: str) -> str:
    if name.startswith("model.layers."):
        return "cuda:0" if int(name.split(".")[2]) < LAYERS // 2 else "cuda:1"
    return "cuda:0" if name.startswith("model.embed") else "cuda:1"


@pytest.mark.parametrize("framework", ["cupy", "pt"])
@pytest.mark.parametrize("background", [False, True])
def test_halves_on_two_gpus(ckpt, framework, background):
    _framework_or_skip(framework)
    if _gpus() < 2:
        pytest.skip("needs two GPUs")
    path, raw = ckpt
    dm = {"model.embed": "cuda:0", **{f"model.layers.{i}": i * 2 // LAYERS for i in range(LAYERS)}, "": "cuda:1"}
    got = fs.load_file(path, framework=framework, device_map=dm, background=background, chunk_bytes=4096)
    _check(got.result() if background else got, raw, _halves, framework)


@pytest.mark.parametrize("framework", ["cupy", "pt"])
def test_halves_on_two_gpus_verified(ckpt, framework, tmp_path):
    _framework_or_skip(framework)
    if _gpus() < 2:
        pytest.skip("needs two GPUs")
    path, raw = ckpt
    summed = str(tmp_path / "sums.safetensors")
    fs.save_file(fs.load_file(path), summed, checksum="xxh3-64")
    dm = {"model.embed": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": 0, "": 1}
    _check(fs.load_file(summed, framework=framework, device_map=dm, verify=True, chunk_bytes=4096), raw, _halves,
           framework)


@pytest.mark.parametrize("framework", ["cupy", "pt"])
def test_mixed_cpu_and_gpu(ckpt, framework):
    _framework_or_skip(framework)
    path, raw = ckpt
    dm = {"model.layers": "cuda:0", "model.layers.5.mlp.weight": "cpu", "": "cpu"}

    def want(name):
        return "cuda:0" if name.startswith("model.layers.") and name != "model.layers.5.mlp.weight" else "cpu"
    _check(fs.load_file(path, framework=framework, device_map=dm, chunk_bytes=4096), raw, want, framework)


def test_default_framework_is_cupy_when_a_gpu_is_mapped(ckpt):
    path, raw = ckpt
    out = fs.load_file(path, device_map={"lm_head": "cuda:0", "": "cpu"}, names=["lm_head.weight", "model.norm.weight"])
    assert _where(out["lm_head.weight"]) == "cuda:0" and isinstance(out["model.norm.weight"], np.ndarray)
    assert _bytes(out["lm_head.weight"]) == raw["lm_head.weight"]


def test_gpu_beyond_the_last_fails_before_reading(ckpt, monkeypatch):
    from foxhunt_stream.io import source
    path, _ = ckpt
    before = source.total_bytes_read()
    with pytest.raises(fs.DeviceError, match="no such GPU"):
        fs.load_file(path, device_map={"model.layers": f"cuda:{_gpus()}", "": "cuda:0"})
    assert source.total_bytes_read() == before
