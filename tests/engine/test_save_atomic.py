"""save_file under real process-level failures, each in a subprocess: kill -9 at random moments,
a file-size limit (RLIMIT_FSIZE), and the peak memory of a save.

The file at the target path is always a complete checkpoint, old or new; never a partial one.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import safetensors.numpy as stn
from safetensors import safe_open as ref_safe_open

import foxhunt_stream as fs
from foxhunt_stream.io.sink import TEMP_MARK

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}

N_TENSORS = 16
ROWS = 4096          # 16 x 4096 x 1024 float32 = 256 MiB per checkpoint

_SAVER = textwrap.dedent(f"""
    import sys, time
    import numpy as np
    import foxhunt_stream as fs
    from foxhunt_stream.io import sink
    path, value = sys.argv[1], int(sys.argv[2])
    block = np.full(({ROWS}, 1024), value, np.float32)      # one block under every name: quick to build
    tensors = {{f"w{{i:02d}}": block for i in range({N_TENSORS})}}
    def progress(s, offset, n):     # one write() per line: worker threads must not interleave
        sys.stdout.write(f"write {{offset}}\\n")
        sys.stdout.flush()
    sink.fault_hook = progress
    print("go", flush=True)
    t0 = time.perf_counter()
    fs.save_file(tensors, path, metadata={{"value": str(value)}})
    print("done", time.perf_counter() - t0, flush=True)
""")


def _start(path, value) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _SAVER, str(path), str(value)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=ENV)
    assert p.stdout.readline().strip() == "go", p.stderr.read()
    return p


def _checkpoint_value(path) -> int:
    """The fill value of a complete checkpoint at ``path``: header read by the reference, data
    by plain reads, so neither depends on foxhunt_stream."""
    with ref_safe_open(str(path), "np") as r:
        assert r.offset_keys() == [f"w{i:02d}" for i in range(N_TENSORS)]
        assert all(r.get_slice(k).get_shape() == [ROWS, 1024] for k in r.keys())
        meta = r.metadata()
    buf = np.empty(ROWS * 1024, "<f4")          # one tensor at a time into a reused buffer: quick
    values = set()
    with open(path, "rb", buffering=0) as f:
        f.seek(8 + int.from_bytes(f.read(8), "little"))
        for _ in range(N_TENSORS):
            assert f.readinto(buf) == buf.nbytes, "file shorter than its header says"
            assert (buf == buf[0]).all(), "a tensor mixes two saves"
            values.add(int(buf[0]))
        assert f.read(1) == b"", "file longer than its header says"
    assert len(values) == 1, f"tensors from different saves: {values}"
    value = values.pop()
    assert meta == {"value": str(value)}
    return value


def _temps(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if TEMP_MARK in n)


def test_kill_9_leaves_old_or_new_file_complete(tmp_path):
    path = tmp_path / "model.safetensors"
    first = _start(path, 1)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    duration = float(out.strip().splitlines()[-1].split()[1])
    assert _checkpoint_value(path) == 1

    seed = random.randrange(2**32)
    rng = random.Random(seed)
    current, debris = 1, []
    # round 1 is killed at a known point (half the data written); the others at random moments
    # spread over the save's measured duration and a little past it (fsync, rename, exit)
    for value in range(2, 6):
        child = _start(path, value)
        if value == 2:
            for line in child.stdout:
                if line.startswith("write") and int(line.split()[1]) > 128 << 20:
                    break
            delay = None
        else:
            delay = rng.uniform(0, 1.3 * duration)
            time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
        new_debris = [n for n in _temps(tmp_path) if n not in debris]
        assert all(f".{child.pid}." in n for n in new_debris)
        debris += new_debris
        got = _checkpoint_value(path)
        assert got in (current, value), f"seed {seed}, round {value}, delay {delay}: file holds {got}"
        if value == 2:
            assert got == current and new_debris, "the deterministic kill did not land mid-save"
        current = got
        # nothing else appears next to the checkpoint: no partial file under another name
        assert sorted(os.listdir(tmp_path)) == sorted(["model.safetensors"] + debris)
    # temp files of dead savers are recognised and removed; the checkpoint stays
    removed = fs.clean_stale_temps(tmp_path)
    assert sorted(os.path.basename(r) for r in removed) == sorted(debris)
    assert os.listdir(tmp_path) == ["model.safetensors"]
    assert _checkpoint_value(path) == current


_LIMITED = textwrap.dedent("""
    import errno, resource, sys
    import numpy as np
    import foxhunt_stream as fs
    path, limit = sys.argv[1], int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    tensors = {f"w{i}": np.full((256, 1024), i, np.float32) for i in range(8)}      # 8 MiB
    try:
        fs.save_file(tensors, path, chunk_bytes=1 << 20)
        print("saved")
    except OSError as e:
        print("OSError", errno.errorcode.get(e.errno))
""")


def test_write_limit_leaves_old_file_and_no_debris(tmp_path):
    """RLIMIT_FSIZE below the new file's size: EFBIG (Python ignores SIGXFSZ), the old file intact,
    no temp file. The temp file is sized up front (ftruncate), so the limit trips before any data
    is written; failures after data was written are covered in-process by sink.fault_hook."""
    path = tmp_path / "model.safetensors"
    stn.save_file({"old": np.arange(1 << 18, dtype=np.float32)}, str(path))    # 1 MiB, under the limit
    old = path.read_bytes()
    r = subprocess.run([sys.executable, "-c", _LIMITED, str(path), str(4 << 20)], capture_output=True,
                       text=True, timeout=60, env=ENV)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "OSError EFBIG"
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["model.safetensors"]


_RSS = textwrap.dedent("""
    import sys
    import numpy as np
    import foxhunt_stream as fs

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    path, kind = sys.argv[1], sys.argv[2]
    if kind == "strided":      # rows of 16 KiB, 32 KiB apart: converted piecewise
        x = np.arange(64 << 20, dtype=np.float32).reshape(8192, 8192)[:, :4096]
    else:
        x = np.arange(32 << 20, dtype=np.float32).reshape(8192, 4096)
        if kind == "big-endian":
            x = x.astype(">f4")
    fs.save_file({"warm": np.ones((64, 64), np.float32)}, path, threads=2)      # threads, imports
    rss = status("VmRSS")
    try:
        open("/proc/self/clear_refs", "w").write("5")                          # reset VmHWM
    except OSError:
        pass
    fs.save_file({"x": x, "y": np.ones(10, np.float32)}, path, threads=2, fsync=False)
    print(status("VmHWM") - rss)
""")


@pytest.mark.parametrize("kind", ["contiguous", "strided", "big-endian"])
def test_save_peak_memory_is_a_few_chunks(tmp_path, kind):
    """A save streams: saving 128 MiB grows peak RSS by a few chunks (2 threads x 16 MiB for
    inputs converted piecewise), never by the size of the input."""
    path = tmp_path / "x.safetensors"
    r = subprocess.run([sys.executable, "-c", _RSS, str(path), kind], capture_output=True, text=True,
                       timeout=120, env=ENV)
    assert r.returncode == 0, r.stderr
    growth = int(r.stdout.strip())
    assert growth <= 64 << 20, f"peak RSS grew by {growth / 2**20:.1f} MiB saving 128 MiB ({kind})"
    with fs.safe_open(path, framework="numpy") as f:
        assert f.get_slice("x").get_shape() == [8192, 4096]
        np.testing.assert_array_equal(f.get_slice("x")[-3:], (np.arange(8189, 8192)[:, None] * (
            8192 if kind == "strided" else 4096) + np.arange(4096)).astype(np.float32))
