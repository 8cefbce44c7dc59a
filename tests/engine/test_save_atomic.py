"""Atomic saves. save_file under real process-level failures, each in a subprocess: kill -9 at
random moments, a file-size limit (RLIMIT_FSIZE), and the peak memory of a save. Sharded saves
(save_file(max_shard_size=), save_sharded, reshard) through the one shard writer: failures while
writing or publishing, and one shard's tensors in memory at a time.

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
from foxhunt_stream.io.sink import FRESH_SECONDS, TEMP_MARK

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
    # temp files of dead savers are recognised and removed; the checkpoint stays. A saver killed
    # between creating its temp and locking it leaves an empty file that is kept while it is young
    # (it may be a live writer's); once older than FRESH_SECONDS it goes too.
    removed = [os.path.basename(r) for r in fs.clean_stale_temps(tmp_path)]
    young = [n for n in debris if n not in removed]
    assert all(os.path.getsize(tmp_path / n) == 0 for n in young), young
    for n in young:
        old = time.time() - FRESH_SECONDS - 5
        os.utime(tmp_path / n, (old, old))
    removed += [os.path.basename(r) for r in fs.clean_stale_temps(tmp_path)]
    assert sorted(removed) == sorted(debris)
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


# ---------------------------------------------------------------- sharded saves: one writer

def _snapshot(directory) -> dict[str, bytes]:
    return {n: (directory / n).read_bytes() for n in sorted(os.listdir(directory))}


def _model(value: int) -> dict[str, np.ndarray]:
    return {f"w{i}": np.full(1000, value * 100 + i, np.float32) for i in range(5)}   # 4000 B each


@pytest.mark.parametrize("fail", ["fsync", "second rename", "index rename"])
def test_sharded_save_failing_at_publish_leaves_the_old_shards(tmp_path, monkeypatch, fail):
    """Every shard and the index are written to temp files first, then renamed, the index last; a
    failure while renaming puts back what the renames already replaced."""
    from foxhunt_stream.io import sink
    fs.save_file(_model(1), tmp_path, max_shard_size=8000, fsync=False)   # 3 shards + index
    old = _snapshot(tmp_path)
    assert len(old) == 4
    real_replace, renames = os.replace, []

    def replace(a, b):
        if TEMP_MARK in os.path.basename(os.fspath(a)) and TEMP_MARK not in os.path.basename(os.fspath(b)):
            renames.append(b)
            if (fail == "second rename" and len(renames) == 2) or (fail == "index rename"
                                                                  and os.fspath(b).endswith(".json")):
                raise OSError(5, "injected rename failure")
        return real_replace(a, b)

    def fsync(fd):
        raise OSError(5, "injected fsync failure")

    monkeypatch.setattr(sink.os, "replace", replace)
    if fail == "fsync":
        monkeypatch.setattr(sink.os, "fsync", fsync)
    with pytest.raises(OSError, match="injected"):
        fs.save_file(_model(2), tmp_path, max_shard_size=8000)
    monkeypatch.undo()
    assert _snapshot(tmp_path) == old, "a failed publish changed the directory"
    got = fs.load_file(tmp_path)
    assert all((got[k] == v).all() for k, v in _model(1).items())


def test_sharded_save_without_hard_links_still_publishes(tmp_path, monkeypatch):
    """Where the filesystem cannot link (no way to keep a replaced file), the save still works."""
    from foxhunt_stream.io import sink
    fs.save_file(_model(1), tmp_path, max_shard_size=8000, fsync=False)

    def link(*a, **k):
        raise OSError(1, "no hard links here")
    monkeypatch.setattr(sink.os, "link", link)
    fs.save_file(_model(2), tmp_path, max_shard_size=8000, fsync=False)
    assert len(os.listdir(tmp_path)) == 4 and not _temps(tmp_path)
    got = fs.load_file(tmp_path)
    assert all((got[k] == v).all() for k, v in _model(2).items())


def test_save_sharded_produces_one_shard_at_a_time(tmp_path):
    """The streaming writer asks for a shard's tensors only when it writes that shard, and has let
    go of the previous shard's by then: host memory holds one shard at a time."""
    import weakref
    from foxhunt_stream.engine.reshard import save_sharded
    sizes = [(f"t{i}", 4000) for i in range(7)]
    alive: list = []
    asked: list[list[str]] = []

    def fetch(names):
        import gc
        gc.collect()
        assert not [r for r in alive if r() is not None], "the previous shard's arrays are still held"
        asked.append(list(names))
        out = {n: np.full(1000, int(n[1:]), np.float32) for n in names}
        alive.extend(weakref.ref(a) for a in out.values())
        return out

    written = save_sharded(sizes, fetch, tmp_path, 8000, {"format": "pt"}, fsync=False)
    assert asked == [["t0", "t1"], ["t2", "t3"], ["t4", "t5"], ["t6"]]
    assert [os.path.basename(p) for p in written] == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)] + [
        "model.safetensors.index.json"]
    got = fs.load_file(tmp_path)
    assert sorted(got) == [n for n, _ in sizes] and all((got[n] == int(n[1:])).all() for n in got)


def test_save_sharded_failing_midway_leaves_nothing_new(tmp_path):
    from foxhunt_stream.engine.reshard import save_sharded
    (tmp_path / "notes.txt").write_text("kept")
    calls = []

    def fetch(names):
        calls.append(names)
        if len(calls) == 3:
            raise RuntimeError("source went away")
        return {n: np.ones(1000, np.float32) for n in names}

    with pytest.raises(RuntimeError, match="went away"):
        save_sharded([(f"t{i}", 4000) for i in range(7)], fetch, tmp_path, 8000, fsync=False)
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_reshard_failing_midway_leaves_no_output(tmp_path, monkeypatch):
    """A rewrite that fails leaves neither shards nor temp files, and no directory it created."""
    from foxhunt_stream.engine import reshard as reshard_mod
    from foxhunt_stream.io import sink
    src = tmp_path / "src"
    src.mkdir()
    fs.save_file(_model(3), src, max_shard_size=8000, fsync=False)
    calls = []

    def hook(f, offset, length):
        calls.append(f.path)
        if len({os.path.basename(p) for p in calls}) == 3:   # during the third output file
            raise OSError(28, "injected: no space left")

    monkeypatch.setattr(sink, "fault_hook", hook)
    with pytest.raises(OSError, match="no space"):
        reshard_mod.reshard(src, tmp_path / "out", 4000, fsync=False)
    assert not (tmp_path / "out").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    calls.clear()
    with pytest.raises(OSError, match="no space"):
        reshard_mod.reshard(src, existing, 4000, fsync=False)
    assert os.listdir(existing) == []     # kept (it was there before), and empty
    monkeypatch.setattr(sink, "fault_hook", None)
    written = reshard_mod.reshard(src, existing, 4000, fsync=False)
    assert len(written) == 6 and written[-1].endswith("model.safetensors.index.json")
    got = fs.load_file(existing)
    assert all((got[k] == v).all() for k, v in _model(3).items())


# ---------------------------------------------------------------- a re-save replaces what a load would take

def _big(value: int) -> dict[str, np.ndarray]:
    return {f"w{i}": np.full(100_000, value * 100 + i, np.float32) for i in range(8)}   # 400 kB each, 3.2 MB


def _holds(got, value) -> None:
    assert sorted(got) == sorted(_big(value)) and all((np.asarray(got[k]) == v).all() for k, v in _big(value).items())


def test_resaving_a_sharded_directory_as_one_file_removes_the_old_index_and_shards(tmp_path):
    from foxhunt_stream.io.checkpoint import open_checkpoint
    d = tmp_path / "ckpt"
    fs.save_file(_big(1), d, max_shard_size="1MB", fsync=False)
    assert len(os.listdir(d)) == 5   # 4 shards and the index
    unrelated = {"config.json": b"{}", "adapter_model.safetensors": b"a",
                 "model-extra.safetensors": b"b", "model-1-of-2.safetensors": b"c", "notes.txt": b"d"}
    for name, data in unrelated.items():
        (d / name).write_bytes(data)
    fs.save_file(_big(2), d, max_shard_size="5GB", fsync=False)
    assert sorted(os.listdir(d)) == sorted(["model.safetensors", *unrelated])
    assert all((d / n).read_bytes() == data for n, data in unrelated.items())
    _holds(fs.load_file(d), 2)
    with fs.safe_open(d, framework="numpy") as f:
        _holds({k: f.get_tensor(k) for k in f.keys()}, 2)
    store = {k: np.zeros_like(v) for k, v in _big(2).items()}
    fs.load_into(store, d)
    _holds(store, 2)
    assert open_checkpoint(d).paths == [os.path.join(d, "model.safetensors")]   # what inspect reads


@pytest.mark.parametrize("second", ["one file", "fewer shards", "more shards"])
def test_resaving_a_directory_leaves_only_the_new_checkpoint(tmp_path, second):
    d = tmp_path / "ckpt"
    first_limit = "5GB" if second != "one file" else "1MB"
    fs.save_file(_big(1), d, max_shard_size="1MB" if second == "fewer shards" else first_limit, fsync=False)
    from foxhunt_stream.engine.saver import save_sharded
    limit = {"one file": "5GB", "fewer shards": "2MB", "more shards": "1MB"}[second]
    written = save_sharded([(k, v.nbytes) for k, v in _big(2).items()],
                           lambda names: {n: _big(2)[n] for n in names}, d, limit, fsync=False)
    assert sorted(os.listdir(d)) == sorted(os.path.basename(p) for p in written)
    _holds(fs.load_file(d), 2)


def test_a_sharded_save_removes_the_files_an_earlier_index_named(tmp_path):
    """An index written by someone else, with shard names of its own: they are part of the
    checkpoint a load would take, so they go; a file no index names stays."""
    import json
    d = tmp_path / "ckpt"
    d.mkdir()
    stn.save_file({"a": np.ones(3, np.float32)}, str(d / "weights-a.safetensors"))
    stn.save_file({"b": np.ones(3, np.float32)}, str(d / "weights-b.safetensors"))
    stn.save_file({"c": np.ones(3, np.float32)}, str(d / "other.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "weights-a.safetensors", "b": "./weights-b.safetensors",
                                        "x": "../outside.safetensors"}}))
    (tmp_path / "outside.safetensors").write_bytes(b"kept")
    fs.save_file(_big(3), d, max_shard_size="1MB", fsync=False)
    names = sorted(os.listdir(d))
    assert "weights-a.safetensors" not in names and "weights-b.safetensors" not in names
    assert "other.safetensors" in names and (tmp_path / "outside.safetensors").read_bytes() == b"kept"
    _holds(fs.load_file(d), 3)


def test_a_failed_resave_keeps_the_old_files(tmp_path, monkeypatch):
    """Moving an earlier save's file aside is part of the commit: if it fails, the renames
    already done are undone and the directory is as it was."""
    from foxhunt_stream.io import sink
    d = tmp_path / "ckpt"
    fs.save_file(_big(1), d, max_shard_size="1MB", fsync=False)
    old = _snapshot(d)
    real = os.rename

    def rename(a, b):
        if os.path.basename(os.fspath(a)) == "model-00004-of-00004.safetensors":
            raise OSError(13, "injected: cannot move")
        return real(a, b)
    monkeypatch.setattr(sink.os, "rename", rename)
    with pytest.raises(OSError, match="injected"):
        fs.save_file(_big(2), d, max_shard_size="5GB", fsync=False)
    monkeypatch.undo()
    assert _snapshot(d) == old
    _holds(fs.load_file(d), 1)


# ---------------------------------------------------------------- what a replaced file keeps

def test_a_save_keeps_the_mode_of_the_file_it_replaces(tmp_path):
    path = tmp_path / "model.safetensors"
    fs.save_file(_model(1), path)
    os.chmod(path, 0o600)
    fs.save_file(_model(2), path)
    assert os.stat(path).st_mode & 0o7777 == 0o600
    os.chmod(path, 0o4751)   # setuid is not carried over: a weights file is never run
    fs.save_file(_model(3), path)
    assert os.stat(path).st_mode & 0o7777 == 0o751
    new = tmp_path / "new.safetensors"
    fs.save_file(_model(1), new)
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(new).st_mode & 0o777 == 0o666 & ~umask


def test_each_shard_keeps_the_mode_of_the_file_it_replaces(tmp_path):
    fs.save_file(_model(1), tmp_path, max_shard_size=8000, fsync=False)
    modes = {"model-00001-of-00003.safetensors": 0o600, "model-00002-of-00003.safetensors": 0o640,
             "model-00003-of-00003.safetensors": 0o604, "model.safetensors.index.json": 0o400}
    for name, mode in modes.items():
        os.chmod(tmp_path / name, mode)
    fs.save_file(_model(2), tmp_path, max_shard_size=8000, fsync=False)
    assert {n: os.stat(tmp_path / n).st_mode & 0o7777 for n in modes} == modes


@pytest.mark.skipif(not hasattr(os, "setxattr"), reason="no extended attributes on this platform")
def test_a_save_keeps_the_owner_and_extended_attributes(tmp_path):
    path = tmp_path / "model.safetensors"
    fs.save_file(_model(1), path)
    try:
        os.setxattr(path, "user.origin", b"hub")
    except OSError as e:
        pytest.skip(f"no user xattrs here: {e}")
    acl = None
    try:   # a POSIX ACL giving uid 4321 read access (the kernel's xattr form: version 2, then entries)
        import struct
        entries = [(0x01, 6, 0xFFFFFFFF), (0x02, 4, 4321), (0x04, 4, 0xFFFFFFFF), (0x10, 4, 0xFFFFFFFF),
                   (0x20, 0, 0xFFFFFFFF)]
        acl = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)
        os.setxattr(path, "system.posix_acl_access", acl)
    except OSError:
        acl = None
    owner = None
    if os.geteuid() == 0:
        owner = (4321, 8765)
        os.chown(path, *owner)
    fs.save_file(_model(2), path)
    assert os.getxattr(path, "user.origin") == b"hub"
    if acl is not None:
        assert os.getxattr(path, "system.posix_acl_access") == acl
    if owner is not None:
        st = os.stat(path)
        assert (st.st_uid, st.st_gid) == owner


# ---------------------------------------------------------------- paths refused before anything is written

def test_save_file_onto_a_directory_is_refused_before_writing(tmp_path, monkeypatch):
    from foxhunt_stream.io import sink
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "keep.txt").write_text("x")
    created = []
    monkeypatch.setattr(sink, "fault_hook", lambda f, offset, n: created.append(f.path))
    with pytest.raises(IsADirectoryError) as e:
        fs.save_file(_model(1), d)
    assert e.value.filename == os.fspath(d) and "max_shard_size" in str(e.value)
    assert TEMP_MARK not in str(e.value)
    assert created == [] and os.listdir(d) == ["keep.txt"] and sorted(os.listdir(tmp_path)) == ["ckpt"]


@pytest.mark.parametrize("how", ["save_file", "save_sharded", "reshard", "existing directory"])
def test_a_sharded_save_refuses_a_path_named_like_a_file(tmp_path, how):
    from foxhunt_stream.engine.reshard import reshard, save_sharded
    target = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match="ending in .safetensors") as e:
        if how == "save_file":
            fs.save_file(_model(1), target, max_shard_size=8000)
        elif how == "save_sharded":
            target.mkdir()
            save_sharded([("w0", 4000)], lambda names: {"w0": _model(1)["w0"]}, target, 8000)
        elif how == "reshard":
            src = tmp_path / "src.safetensors"
            fs.save_file(_model(1), src)
            reshard(src, target, 8000)
        else:
            target.mkdir()
            fs.save_file(_model(1), str(target) + "/", max_shard_size=8000)
    assert os.fspath(target) in str(e.value) and "directory of shards" in str(e.value)
    if how in ("save_file", "reshard"):
        assert not target.exists()
    else:
        assert os.listdir(target) == []
