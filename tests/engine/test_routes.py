"""Every route a load can take, checked against the file's bytes read with plain I/O.

One load pipeline serves every load; what differs between loads is how each file is read (its
``ReadPolicy``: cached or cold, positional reads, gathers out of a mapping, O_DIRECT, copies out
of a mapping), what is selected (whole tensors, slices along dim 0 and dim 1), how the result is
taken (``load_file``, a background handle tensor by tensor, ``safe_open(...).tensors()``,
``load_into``, ``verify=True``, ``device_map``) and where it lands. ``Routes`` is run for the host
(numpy) here, for a real GPU where there is one, and, in a subprocess, for a host-memory stand-in
of the CUDA runtime (tests/fakecuda), so that the GPU target's steps run on every CI machine too.
The expected values come from the file's header and bytes parsed here, not from the library.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import foxhunt_stream as fs
from foxhunt_stream.io import pagecache

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE = os.path.join(REPO, "tests", "fakecuda")
FAKE_GPU = os.environ.get("ROUTES_STAND_IN") == "1"   # set for the stand-in's run (below)

# how each file is read: the residency the loader samples, and the options
POLICIES = {
    "cached, positional reads": (1.0, dict(backend="pread")),
    "cached, column slices gathered": (1.0, dict(backend="auto")),
    "cold, streams and promotion": (0.0, dict(direct_io="off")),
    "cold, O_DIRECT": (0.0, dict(direct_io="on")),
    "every read out of a mapping": (1.0, dict(backend="mmap")),
}
SELECTIONS = {"whole": None, "dim 0": 0, "dim 1": 1}
MODES = ("load_file", "background", "tensors", "load_into", "device_map")
SMALL = dict(threads=3, chunk_bytes=8192, read_bytes=4096, staging_bytes=8 * 8192)


def expected(path: str, dim: int | None, rank: int = 1, world: int = 3) -> dict[str, np.ndarray]:
    """Every tensor of ``path`` (or rank ``rank`` of ``world`` of it along ``dim``), from the raw bytes."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        lo, hi = e["data_offsets"]
        x = np.frombuffer(data[lo:hi], {"F32": np.float32, "I16": np.int16, "U8": np.uint8}[e["dtype"]])
        x = x.reshape(e["shape"])
        if dim is not None and name != "b.m" and not name.startswith("t."):   # b.m, t.*: whole on every
            # rank, a.b by rows (the shard's rules)
            x = np.array_split(x, world, axis=0 if name == "a.b" else dim)[rank]
        out[name] = x
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Two files (an index), tensors of several shapes and types, bigger than a chunk and smaller,
    and tiny ones (``t.*``, an empty one among them) that the plan packs into shared chunks."""
    d = tmp_path_factory.mktemp("routes") / "ckpt"
    rng = np.random.default_rng(7)
    tensors = {"a.w": rng.standard_normal((96, 200)).astype(np.float32),
               "a.b": rng.standard_normal(70).astype(np.float32),
               "b.w": rng.integers(-1000, 1000, (40, 333), dtype=np.int16),
               "b.m": rng.integers(0, 255, (9, 7, 5), dtype=np.uint8),
               "c.w": rng.standard_normal((128, 64)).astype(np.float32)}
    for i in range(12):
        tensors[f"t.f{i:02}"] = rng.standard_normal(3).astype(np.float32)
        tensors[f"t.i{i:02}"] = rng.integers(-1000, 1000, (2, 2), dtype=np.int16)
    tensors["t.i05"] = np.zeros((0, 2), np.int16)   # an empty tensor: no bytes, no chunk
    fs.save_file(tensors, d, max_shard_size=60_000, checksum="xxh3-64", checksum_block=8192)
    return str(d)


class Routes:
    """The conformance checks; a subclass says where the tensors land (``device``) and how to
    read them back to the host (``host``)."""
    device = "cpu"
    framework: str | None = None

    def host(self, x) -> np.ndarray:
        return np.asarray(x)

    def new_store(self, want: dict[str, np.ndarray]) -> dict:
        return {k: np.zeros_like(v) for k, v in want.items()}

    def land(self, checkpoint, mode: str, dim, **options) -> dict[str, np.ndarray]:
        shard = None if dim is None else fs.TPSlice(1, 3, {"b.m": None, "t.*": None, "a.b": 0, "*": dim})
        kw = dict(options, shard=shard)
        if mode == "load_file":
            out = fs.load_file(checkpoint, device=self.device, framework=self.framework, **kw)
        elif mode == "background":
            h = fs.load_file(checkpoint, device=self.device, framework=self.framework, background=True, **kw)
            out = {n: h.wait(n) for n in reversed(h.names)}   # tensor by tensor, last first
            assert h.result().keys() == out.keys()
        elif mode == "tensors":
            shard = kw.pop("shard")
            with fs.safe_open(checkpoint, framework=self.framework, device=self.device, **kw) as f:
                out = dict(f.tensors(shard=shard))
        elif mode == "load_into":
            store = self.new_store({k: v for f in _files(checkpoint) for k, v in expected(f, dim).items()})
            fs.load_into(store, checkpoint, **kw)
            out = store
        else:   # device_map: every tensor mapped, the "a." ones by their prefix
            out = fs.load_file(checkpoint, device_map={"a": self.device, "": self.device}, framework=self.framework,
                               **kw)
        return {k: self.host(v) for k, v in out.items()}

    @pytest.mark.parametrize("policy", list(POLICIES))
    @pytest.mark.parametrize("selection", list(SELECTIONS))
    @pytest.mark.parametrize("mode", MODES)
    def test_a_route_lands_the_files_bytes(self, checkpoint, monkeypatch, policy, selection, mode):
        resident, options = POLICIES[policy]
        monkeypatch.setattr(pagecache, "resident_fraction", lambda p, samples=64: resident)
        dim = SELECTIONS[selection]
        got = self.land(checkpoint, mode, dim, **SMALL, **options)
        want = {k: v for f in _files(checkpoint) for k, v in expected(f, dim).items()}
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{k}, {policy}, {selection}, {mode}")

    @pytest.mark.parametrize("policy", list(POLICIES))
    @pytest.mark.parametrize("mode", ("load_file", "background", "tensors"))
    def test_a_verified_route_checks_every_tensor(self, checkpoint, monkeypatch, policy, mode):
        resident, options = POLICIES[policy]
        monkeypatch.setattr(pagecache, "resident_fraction", lambda p, samples=64: resident)
        got = self.land(checkpoint, mode, None, verify=True, verify_on="read", **SMALL, **options)
        want = {k: v for f in _files(checkpoint) for k, v in expected(f, None).items()}
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def _files(checkpoint: str) -> list[str]:
    return sorted(os.path.join(checkpoint, f) for f in os.listdir(checkpoint) if f.endswith(".safetensors"))


class TestHostRoutes(Routes):
    pass


def _gpu_framework():
    try:
        import torch
        if torch.cuda.is_available():
            return "pt"
    except ImportError:
        pass
    return "cupy"


@pytest.mark.gpu
class TestGpuRoutes(Routes):
    device = "cuda:0"

    @pytest.fixture(autouse=True)
    def _gpu(self):
        if FAKE_GPU:
            pytest.skip("the stand-in's run takes the stand-in's class")
        from gpu_util import require_gpu
        require_gpu()
        type(self).framework = _gpu_framework()

    def host(self, x):
        if hasattr(x, "element_size"):
            return x.cpu().numpy()
        import cupy
        return cupy.asnumpy(x)

    def new_store(self, want):
        if self.framework == "pt":
            import torch
            return {k: torch.zeros(v.shape, dtype=getattr(torch, str(v.dtype)), device=self.device)
                    for k, v in want.items()}
        import cupy
        return {k: cupy.zeros(v.shape, v.dtype) for k, v in want.items()}


@pytest.mark.skipif(not FAKE_GPU, reason="runs in the stand-in's subprocess (test_every_route_on_the_gpu_stand_in)")
class TestStandInGpuRoutes(Routes):
    """The GPU target on the host stand-in: its arrays live in host memory behind device pointers."""
    device = "cuda:0"
    framework = "cupy"

    @pytest.fixture(autouse=True)
    def _copies_go_through_the_gpu_target(self):
        import cupy
        assert cupy.__version__ == "fake"
        before = cupy.cuda.runtime.copies
        yield
        assert cupy.cuda.runtime.copies > before   # the bytes went host -> "device" by the runtime's copies

    def host(self, x):
        return np.asarray(x)

    def new_store(self, want):
        import cupy
        return {k: cupy.zeros(v.shape, v.dtype) for k, v in want.items()}


def test_every_route_on_the_gpu_stand_in():
    """``Routes`` against the stand-in CUDA runtime, in a subprocess so it never shadows a real cupy."""
    if FAKE_GPU:
        pytest.skip("this is the stand-in's run")
    env = {k: v for k, v in os.environ.items() if k != "FOXHUNT_CUDART"}
    env.update(PYTHONPATH=os.pathsep.join([FAKE, REPO, os.path.join(REPO, "tests")]), ROUTES_STAND_IN="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", __file__, "-k",
                        "StandIn"], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout
