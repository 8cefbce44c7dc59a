"""clean_stale_temps: a temp file is stale when no writer holds its lock, whatever pid its name
carries (a pid means nothing across PID namespaces: another container on a shared volume)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
import time

import foxhunt_stream as fs
from foxhunt_stream.io import sink

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _temp(directory, pid: int, data: bytes = b"partial", age: float = 10.0):
    p = directory / f".model.safetensors{sink.TEMP_MARK}{pid}.{os.urandom(4).hex()}"
    p.write_bytes(data)
    then = time.time() - age
    os.utime(p, (then, then))
    return p


def test_an_unlocked_temp_is_removed_even_if_its_pid_is_alive(tmp_path):
    mine = _temp(tmp_path, os.getpid())
    parent = _temp(tmp_path, os.getppid())
    assert sorted(fs.clean_stale_temps(tmp_path)) == sorted([os.fspath(mine), os.fspath(parent)])
    assert os.listdir(tmp_path) == []


def test_a_locked_temp_is_kept_even_if_its_pid_is_dead(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    locked_here = _temp(tmp_path, int(dead.stdout))
    locked_there = _temp(tmp_path, 999_999)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import fcntl, sys
        f = open(sys.argv[1], "rb+")
        fcntl.flock(f, fcntl.LOCK_EX)
        print("locked", flush=True)
        sys.stdin.read()
    """), os.fspath(locked_there)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    fd = os.open(locked_here, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert holder.stdout.readline().strip() == "locked"
        assert fs.clean_stale_temps(tmp_path) == []
        assert sorted(os.listdir(tmp_path)) == sorted([locked_here.name, locked_there.name])
    finally:
        os.close(fd)
        holder.communicate("")
    assert sorted(fs.clean_stale_temps(tmp_path)) == sorted([os.fspath(locked_here), os.fspath(locked_there)])


def test_a_fresh_empty_temp_is_kept_an_old_one_removed(tmp_path):
    """A writer locks its temp right after creating it, before giving it a size: an empty,
    unlocked temp of the last seconds may be in that window."""
    fresh = _temp(tmp_path, 1, b"", age=0)
    old = _temp(tmp_path, 1, b"", age=sink.FRESH_SECONDS + 5)
    assert fs.clean_stale_temps(tmp_path) == [os.fspath(old)]
    assert os.listdir(tmp_path) == [fresh.name]


def test_what_is_not_a_regular_file_is_never_opened_or_removed(tmp_path):
    fifo = tmp_path / f".a.safetensors{sink.TEMP_MARK}1.abcd"
    os.mkfifo(fifo)
    link = tmp_path / f".b.safetensors{sink.TEMP_MARK}1.abcd"
    target = tmp_path / "target"
    target.write_bytes(b"kept")
    os.symlink(target, link)
    assert fs.clean_stale_temps(tmp_path) == []
    assert sorted(os.listdir(tmp_path)) == sorted([fifo.name, link.name, "target"])


_PAUSED_SAVE = textwrap.dedent("""
    import os, sys
    import numpy as np
    os.getpid = lambda: 999999          # as a writer in another PID namespace looks from here
    import foxhunt_stream as fs
    from foxhunt_stream.io import sink
    target, sharded = sys.argv[1], sys.argv[2] == "sharded"
    seen = set()
    def pause(f, offset, n):             # once, in the last file: earlier shards are written and sealed
        seen.add(f.path)
        if len(seen) == (3 if sharded else 1) and "paused" not in seen:
            seen.add("paused")
            print("paused", flush=True)
            sys.stdin.readline()
    sink.fault_hook = pause
    tensors = {f"w{i}": np.full(1000, i, np.float32) for i in range(5)}
    fs.save_file(tensors, target, **({"max_shard_size": 8000} if sharded else {}), fsync=False)
    print("saved", flush=True)
""")


def test_a_live_save_in_another_pid_namespace_keeps_its_temps(tmp_path):
    """A save whose temp names carry a pid that is dead here (another PID namespace) is running:
    its temps (every shard's, the ones already sealed too) stay, and it commits."""
    for kind, target in (("single", tmp_path / "model.safetensors"), ("sharded", tmp_path / "ckpt")):
        child = subprocess.Popen([sys.executable, "-c", _PAUSED_SAVE, os.fspath(target), kind], env=ENV,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "paused", child.stderr.read()
        directory = target.parent if kind == "single" else target
        temps = [n for n in os.listdir(directory) if sink.TEMP_MARK in n]
        assert len(temps) == (1 if kind == "single" else 3) and all(".999999." in n for n in temps)
        assert fs.clean_stale_temps(directory) == []
        out, err = child.communicate("go\n", timeout=60)
        assert child.returncode == 0 and out.strip() == "saved", err
        got = fs.load_file(target)
        assert all((got[f"w{i}"] == i).all() for i in range(5))
        assert not [n for n in os.listdir(directory) if sink.TEMP_MARK in n]


def test_a_save_in_this_process_keeps_its_temp_until_it_commits(tmp_path):
    f = sink.AtomicFile(tmp_path / "x.bin", 4, fsync=False)
    f.write_at(b"data", 0)
    f.seal()
    assert fs.clean_stale_temps(tmp_path) == []
    f.commit()
    assert os.listdir(tmp_path) == ["x.bin"] and (tmp_path / "x.bin").read_bytes() == b"data"
