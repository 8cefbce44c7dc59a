"""``foxhunt-stream bench``, driven in a subprocess as a user would (CPU paths only).

A missing package is simulated in the child with ``sys.modules[name] = None`` (its import then
fails as if it were not installed), a GPU the machine shows by replacing ``bench.gpu_present``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import foxhunt_stream as fs
from foxhunt_stream.cli import ceilings as ce

ROOT = Path(__file__).resolve().parents[2]
GPU_FIX = "pip install cupy-cuda13x (or cupy-cuda12x for a CUDA 12 driver)"


def run(*args: str, missing: tuple[str, ...] = (), gpu_shown: bool | None = None) -> subprocess.CompletedProcess:
    """``python -m foxhunt_stream ARGS`` with the ``missing`` modules made unimportable and, with
    ``gpu_shown`` True or False, a machine that shows an NVIDIA GPU or none (None: as it is)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("FOXHUNT_THREADS", None)
    code = ("import sys\n"
            f"for name in {missing!r}:\n"
            "    sys.modules[name] = None\n"
            "from foxhunt_stream.cli import bench, main\n"
            + ("" if gpu_shown is None else f"bench.gpu_present = lambda: {gpu_shown}\n")
            + "sys.exit(main.main(sys.argv[1:]))\n")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.fixture
def sharded(tmp_path):
    d = tmp_path / "sharded"
    d.mkdir()
    rng = np.random.default_rng(1)
    fs.save_file({f"layers.{i}.w": rng.standard_normal((64, 32)).astype(np.float32) for i in range(6)}, d,
                 max_shard_size="20kB")
    return d


def test_bench_runs_and_prints_the_table(tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "--device", "cpu", "--size", "16MiB", "--reps", "1", "--shards", "2", "--workdir",
            str(tmp_path), "--json", str(out)]
    try:
        import matplotlib  # noqa: F401
        args += ["--plot", str(tmp_path / "bench.png")]
    except ImportError:
        pass
    r = run(*args)
    assert r.returncode == 0, r.stderr
    for row in ("host memcpy", "page cache -> host", "foxhunt_stream load_file", "safetensors.numpy load_file",
                "foxhunt_stream save_file", "safetensors.numpy save_file", "GB/s", "x ceiling"):
        assert row in r.stdout
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["checkpoint"]["files"] == 2
    assert 0.9 * 16 * 2**20 < report["checkpoint"]["bytes"] <= 16 * 2**20
    rows = {row["name"]: row for row in report["rows"]}
    load = rows["foxhunt_stream load_file, first load in a new process"]   # the headline: a server's only load
    assert load["gbps"] > 0 and load["ratio_to_ceiling"] > 0 and len(load["seconds"]) == 1
    assert len(rows["foxhunt_stream load_file, second load in that process"]["seconds"]) == 1
    assert load["gbps"] == pytest.approx(load["nbytes"] / load["median_s"] / 1e9)
    assert rows[load["ceiling"]]["group"] == "ceiling" and "page cache" in load["ceiling"]
    if "--plot" in args:
        assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == sorted(p for p in ("bench.json", "bench.png") if (tmp_path / p).exists())


def test_bench_on_a_given_checkpoint_without_saves(sharded):
    r = run("bench", str(sharded), "--reps", "1", "--no-save", "-q")
    assert r.returncode == 0, r.stderr
    assert "foxhunt_stream load_file" in r.stdout and "save_file" not in r.stdout
    assert r.stderr == ""


def test_bench_on_a_missing_gpu_is_a_clear_error():
    from foxhunt_stream.cuda import runtime
    r = run("bench", "--device", "cuda:0", "--size", "1MiB", missing=("cupy", "cupy_backends"))
    why = "cupy" if runtime.has_driver() else "no NVIDIA driver"
    assert r.returncode == 1 and why in r.stderr and len(r.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------- the GPU it cannot use

def test_bench_says_why_the_gpu_it_sees_is_not_used(tmp_path):
    out = tmp_path / "r.json"
    r = run("bench", "--size", "2MiB", "--reps", "1", "--no-save", "-q", "--json", str(out),
            missing=("cupy", "cupy_backends"), gpu_shown=True)
    assert r.returncode == 0, r.stderr
    header = r.stdout.splitlines()[0]
    assert header.startswith("foxhunt-stream ") and " bench: cpu (GPU not used: no GPU runtime" in header
    assert GPU_FIX in header
    # on stderr too, even with --quiet: the reader must not take the CPU figures for the GPU's
    assert "GPU not used: no GPU runtime (cupy is not installed)" in r.stderr and GPU_FIX in r.stderr
    assert json.loads(out.read_text())["device_note"].startswith("GPU not used: no GPU runtime")


def test_bench_on_a_machine_without_a_gpu_says_so_quietly():
    r = run("bench", "--size", "2MiB", "--reps", "1", "--no-save", "-q", missing=("cupy", "cupy_backends"),
            gpu_shown=False)
    assert r.returncode == 0, r.stderr
    assert " bench: cpu (no GPU found), " in r.stdout.splitlines()[0]
    assert r.stderr == ""


# ---------------------------------------------------------------- save ceilings

def _ceiling_of(report: dict, name: str) -> dict:
    rows = {row["name"]: row for row in report["rows"]}
    ceiling = rows[rows[name]["ceiling"]]
    assert ceiling["group"] == "ceiling"
    return ceiling


def test_each_save_row_is_compared_with_a_write_by_its_own_method(tmp_path):
    out = tmp_path / "r.json"
    r = run("bench", "--device", "cpu", "--size", "8MiB", "--reps", "1", "--workdir", str(tmp_path),
            "--json", str(out))
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    method = ce.write_method(str(tmp_path), report["checkpoint"]["bytes"], report["threads"])
    what = "mapped copies" if method == "mapped" else "pwrite"
    assert _ceiling_of(report, "foxhunt_stream save_file")["name"].startswith(f"new file, {what} (")
    assert _ceiling_of(report, "foxhunt_stream save_file (fsync)")["name"].startswith(f"new file, {what} + fsync (")
    assert _ceiling_of(report, "safetensors.numpy save_file")["name"].startswith("new file, pwrite (")
    assert all(row["nbytes"] == report["checkpoint"]["bytes"] for row in report["rows"]
               if row["name"].startswith("new file"))


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_mapped_save_is_compared_with_mapped_copies(tmp_path):
    """Where the saver maps (tmpfs, >= 64 MiB, >= 8 writers) its ceiling is a mapped write, not
    pwrite: a mapped save once showed 1.9-2.0x a pwrite "ceiling"."""
    shm = Path("/dev/shm")
    if ce.write_method(str(shm), 80 << 20, 8) != "mapped":
        pytest.skip("the saver does not map files here (no tmpfs or no fallocate)")
    out = tmp_path / "r.json"
    r = run("bench", "--device", "cpu", "--size", "80MiB", "--reps", "1", "--threads", "8", "--workdir",
            str(shm), "--json", str(out), "-q")
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert re.fullmatch(r"new file, mapped copies \((8|4|2) threads?, the best of 2, 4, 8\)",
                        _ceiling_of(report, "foxhunt_stream save_file")["name"])
    assert re.fullmatch(r"new file, pwrite \((1 thread|8 threads), the best of 1, 8\)",
                        _ceiling_of(report, "safetensors.numpy save_file")["name"])
    assert "[c]" in r.stdout or "[d]" in r.stdout


# ---------------------------------------------------------------- safetensors missing

def test_bench_without_safetensors_says_it_left_the_comparisons_out(tmp_path):
    r = run("bench", "--device", "cpu", "--size", "4MiB", "--reps", "1", "--workdir", str(tmp_path), "-q",
            missing=("safetensors", "safetensors.numpy", "safetensors.torch"))
    assert r.returncode == 0, r.stderr
    assert "safetensors.numpy" not in r.stdout
    assert "foxhunt_stream load_file" in r.stdout and "foxhunt_stream save_file" in r.stdout
    note = "safetensors is not installed: its comparison rows are left out (pip install safetensors"
    assert f"note: {note}" in r.stdout
    assert note in r.stderr
