"""The two write backends of the sink (pwrite, mmap after fallocate) give the same files and the
same failure guarantees."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import safetensors.numpy as stn

import foxhunt_stream as fs
from foxhunt_stream.io import sink

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tensors():
    rng = np.random.default_rng(3)
    return {"a": rng.standard_normal((300, 257)).astype(np.float32),
            "b": rng.integers(0, 100, (1000,), dtype=np.int64),
            "c": np.asfortranarray(rng.standard_normal((64, 33))),        # non-contiguous
            "z": np.zeros((0, 4), np.float16)}


@pytest.mark.parametrize("backend", ["pwrite", "mmap", "auto"])
def test_backends_write_reference_bytes(tmp_path, backend):
    t = _tensors()
    fs.save_file(t, tmp_path / "x.safetensors", metadata={"k": "v"}, write_backend=backend, chunk_bytes=8192)
    stn.save_file({k: np.ascontiguousarray(v) for k, v in t.items()}, str(tmp_path / "ref.safetensors"),
                  metadata={"k": "v"})
    assert (tmp_path / "x.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_mmap_backend_is_really_used(tmp_path):
    f = sink.AtomicFile(tmp_path / "m.bin", 1 << 20, backend="mmap")
    try:
        assert f.backend == "mmap"     # tmp_path's filesystem supports fallocate here
        f.write_at(b"x" * 10, 5)
        f.commit()
    except BaseException:
        f.abort()
        raise
    data = (tmp_path / "m.bin").read_bytes()
    assert len(data) == 1 << 20 and data[5:15] == b"x" * 10 and data[:5] == b"\0" * 5
    f2 = sink.AtomicFile(tmp_path / "p.bin", 1 << 20, backend="pwrite")
    assert f2.backend == "pwrite"
    f2.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.bin"]


@pytest.mark.parametrize("at_write", [0, 1, 3])
def test_mmap_backend_failure_midway_leaves_old_file(tmp_path, monkeypatch, at_write):
    path = tmp_path / "ckpt.safetensors"
    path.write_bytes(b"old checkpoint")
    calls = []

    def hook(f, offset, length):
        calls.append(offset)
        if len(calls) == at_write + 1:
            raise OSError(28, "No space left on device")
    monkeypatch.setattr(sink, "fault_hook", hook)
    with pytest.raises(OSError, match="ckpt.safetensors"):
        fs.save_file(_tensors(), path, write_backend="mmap", chunk_bytes=8192, threads=2)
    assert path.read_bytes() == b"old checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]


def test_mmap_backend_size_limit_fails_before_writing(tmp_path):
    """RLIMIT_FSIZE below the file size: fallocate refuses (EFBIG) up front, old file kept, no debris."""
    script = textwrap.dedent("""
        import resource, sys, numpy as np
        import foxhunt_stream as fs
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            fs.save_file({"w": np.ones((1024, 1024), np.float32)}, sys.argv[1], write_backend="mmap")
        except OSError as e:
            print("errno", e.errno)
    """)
    path = tmp_path / "ckpt.safetensors"
    path.write_bytes(b"old")
    r = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "errno 27"     # EFBIG
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]


def test_unknown_write_backend_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="write_backend"):
        fs.save_file({"a": np.ones(3)}, tmp_path / "x.safetensors", write_backend="fast")


def test_mmap_backend_keeps_rss_flat(tmp_path):
    """Mapped writes unmap each window at once: saving 256 MiB grows peak RSS by far less (each
    writer maps one chunk-sized window at a time; threads fixed so the bound holds on any box)."""
    script = textwrap.dedent("""
        import sys, numpy as np
        import foxhunt_stream as fs
        def status(key):
            for line in open('/proc/self/status'):
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        t = {f"w{i}": np.full((1024, 8192), i, np.float32) for i in range(8)}   # 256 MiB, resident
        fs.save_file({"warm": np.ones(4, np.float32)}, sys.argv[1] + ".warm", write_backend="mmap")
        base = status("VmRSS")
        open('/proc/self/clear_refs', 'w').write('5')
        fs.save_file(t, sys.argv[1], write_backend="mmap", fsync=False, threads=4)   # <= 4 windows mapped at once
        print(status("VmHWM") - base)
    """)
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path / "x.safetensors")], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.strip()) < 64 << 20
    back = fs.load_file(tmp_path / "x.safetensors", names=["w7"])
    assert float(back["w7"][5, 5]) == 7.0
