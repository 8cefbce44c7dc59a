"""Tensor-parallel shards landing on the GPU (cudaMemcpy2DAsync for column shards).

Skips cleanly without cupy or a CUDA device. Same checks as the host tests: every rank's slice
equals numpy.array_split of the original, and the ranks concatenate back to the full tensor.
"""

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

import foxhunt_stream as fs  # noqa: E402
from foxhunt_stream.cuda.devices import cuda_available  # noqa: E402
from foxhunt_stream.format.dtypes import from_numpy  # noqa: E402
from foxhunt_stream.engine.frameworks import CupyFramework, expected_host_dtype  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU"),
]

from sharded_support import RULE, make_tensors, write_checkpoint  # noqa: E402


def _dim(name, rule):
    return fs.Shard(0, 1, rule).dim_for(name)


def _host(v, like: np.ndarray) -> np.ndarray:
    """The array's bytes on the host, viewed with the original's numpy dtype (bf16 included)."""
    if type(v).__module__.startswith("torch"):
        import torch
        t = v.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
        return raw.view(like.dtype).reshape(tuple(t.shape))
    h = cp.asnumpy(v)
    return h if h.dtype == like.dtype else h.view(like.dtype)   # cupy holds bf16 as uint16


def _framework_or_skip(framework):
    if framework == "pt":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch without CUDA")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    t = make_tensors()
    return write_checkpoint(str(tmp_path_factory.mktemp("gpu") / "ckpt"), t), t


@pytest.mark.parametrize("backend", ["pread", "mmap", "auto"])   # 2-D copy of spans / rows packed by the source
@pytest.mark.parametrize("framework", ["cupy", "pt"])
@pytest.mark.parametrize("world", [3, 8])
@pytest.mark.parametrize("rule", [0, 1, -1, RULE], ids=["dim0", "dim1", "dim-1", "per-name"])
def test_gpu_ranks_concatenate_back(ckpt, framework, world, rule, backend):
    _framework_or_skip(framework)
    d, t = ckpt
    names = None if isinstance(rule, dict) else [n for n, v in t.items() if v.ndim > (rule if rule >= 0 else -rule - 1)]
    parts = [fs.load_file(d, device="cuda:0", framework=framework, names=names, shard=fs.Shard(r, world, rule),
                          chunk_bytes=4096, threads=4, backend=backend, direct_io="off")
             for r in range(world)]
    for n in parts[0]:
        dim = _dim(n, rule)
        host = [_host(p[n], t[n]) for p in parts]
        if dim is None:
            for h in host:
                np.testing.assert_array_equal(h, t[n])
            continue
        want = np.array_split(t[n], world, axis=dim)
        for r, h in enumerate(host):
            np.testing.assert_array_equal(h, want[r], err_msg=f"{n} rank {r}")
        np.testing.assert_array_equal(np.concatenate(host, axis=dim), t[n])


def test_gpu_load_into_rank_shapes(ckpt):
    d, t = ckpt
    world = 4
    for r in range(world):
        want = {n: (v if _dim(n, RULE) is None else np.array_split(v, world, axis=_dim(n, RULE))[r])
                for n, v in t.items()}
        store = {n: cp.zeros(v.shape, expected_host_dtype(CupyFramework(), from_numpy(v.dtype)))
                 for n, v in want.items()}
        fs.load_into(store, d, shard=fs.Shard(r, world, RULE))
        for n in want:
            np.testing.assert_array_equal(_host(store[n], want[n]), want[n], err_msg=n)


def test_gpu_safe_open_tensors_with_a_shard(ckpt):
    d, t = ckpt
    with fs.safe_open(d, framework="cupy", device="cuda:0") as f:
        got = dict(f.tensors("*.o_proj.weight", shard=fs.Shard(1, 3, 1)))
    for n, v in got.items():
        np.testing.assert_array_equal(cp.asnumpy(v), np.array_split(t[n], 3, axis=1)[1])
