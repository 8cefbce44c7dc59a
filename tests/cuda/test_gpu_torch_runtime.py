"""On a GPU, with torch and without cupy: loads and saves of torch tensors go through torch's
own CUDA runtime library (``cuda.libcudart``), byte for byte as through cupy's. Runs in a
subprocess where cupy is blocked, as on a machine where it is not installed. Skips without a
CUDA build of torch and a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import os, sys
    sys.modules["cupy"] = None; sys.modules["cupy_backends"] = None
    import numpy as np
    import torch
    import foxhunt_stream as fs
    sys.path.insert(0, os.path.join(sys.argv[2], "tests"))
    from gpu_util import ALL_DTYPE_SPECS, write_random_file
    from foxhunt_stream.cuda import libcudart, runtime

    d = sys.argv[1]
    path = os.path.join(d, "all.safetensors")
    specs = ALL_DTYPE_SPECS + [("matrix", "BF16", (64, 96))]
    write_random_file(path, specs, seed=3)
    host = fs.load_file(path)                                   # numpy, the reference bytes
    out = fs.load_file(path, device="cuda:0", framework="pt")
    rt = runtime.runtime()
    assert isinstance(rt, libcudart.LibCudart) and "libcudart" in rt.path, rt
    for name, t in out.items():
        assert t.device.type == "cuda", name
        assert t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() == host[name].tobytes(), name
    with fs.safe_open(path, framework="pt", device="cuda:0") as f:
        cols = f.get_slice("matrix")[:, 8:40]                    # a 2-D copy (cudaMemcpy2DAsync)
        streamed = dict(f.tensors())
    want = host["matrix"][:, 8:40]
    assert cols.cpu().view(torch.uint8).numpy().tobytes() == np.ascontiguousarray(want).tobytes()
    assert streamed.keys() == out.keys()

    # saves from the GPU: byte-identical to safetensors' own file of the same tensors
    import safetensors.torch
    tensors = {"a": torch.randn(300, 70, device="cuda:0").to(torch.bfloat16), "b": torch.arange(10, device="cuda:0")}
    fs.torch.save_file(tensors, os.path.join(d, "ours.safetensors"), metadata={"k": "v"})
    safetensors.torch.save_file({k: v.cpu() for k, v in tensors.items()}, os.path.join(d, "ref.safetensors"),
                                metadata={"k": "v"})
    assert open(os.path.join(d, "ours.safetensors"), "rb").read() == open(os.path.join(d, "ref.safetensors"), "rb").read()

    # checksums without cupy: hashed on the host as the chunks are read
    fs.save_file({k: v for k, v in tensors.items()}, os.path.join(d, "summed.safetensors"), checksum="xxh3-64")
    back = fs.load_file(os.path.join(d, "summed.safetensors"), device="cuda:0", framework="pt", verify=True)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)

    steps = fs.warmup("cuda:0")
    assert {"context", "pinned_pool", "streams"} <= set(steps), steps
    try:
        fs.load_file(path, device="cuda:99", framework="pt")
    except fs.DeviceError as e:
        assert "no such GPU" in str(e), e
    else:
        raise AssertionError("cuda:99 accepted")
    assert "cupy" not in {m.split(".")[0] for m, mod in sys.modules.items() if mod is not None}
    print("ok", rt.path)
""")


def test_torch_alone_loads_and_saves_on_the_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA build of torch with a GPU here")
    env = {k: v for k, v in os.environ.items() if k != "FOXHUNT_CUDART"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), REPO], capture_output=True, text=True,
                       timeout=600, env={**env, "PYTHONPATH": REPO})
    assert r.returncode == 0 and r.stdout.startswith("ok "), r.stderr[-4000:] + r.stdout
