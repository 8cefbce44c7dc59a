"""Fault injection through the source and sink seams: failed reads and writes, files that change
under a load, killed saves, and a failing worker cancelling the rest.

Every test also checks what a failure leaves behind: no foxhunt thread still running, no file
descriptor leaked, no temp file left, the old checkpoint intact, and the next load working.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import foxhunt_stream as fs
from foxhunt_stream.io import mapping, sink, source
from foxhunt_stream.engine.pipeline import Job
from thread_support import foxhunt_threads_at_work

SMALL = dict(chunk_bytes=4096, staging_bytes=32 << 10)
BACKENDS = [dict(backend="pread", direct_io="off"), dict(backend="mmap", direct_io="off"), dict(direct_io="on")]


def model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal(9000).astype(np.float32),      # 36000 B: 9 chunks of 4096
            "b": rng.integers(-100, 100, 3000, dtype=np.int16),
            "s": np.arange(5, dtype=np.float64)}


def assert_equal(out, ref):
    assert out.keys() == ref.keys()
    for k in ref:
        np.testing.assert_array_equal(out[k], ref[k])


def foxhunt_threads() -> list[str]:
    return [t.name for t in foxhunt_threads_at_work()]


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def clean_process():
    """Snapshot fds before; after the test body, no foxhunt thread and no new fd may remain."""
    before = open_fds()
    yield
    assert mapping.wait_unmapped(30)   # a used mapping is unmapped on a thread of its own after the load
    assert foxhunt_threads() == []
    leaked = {fd for fd in open_fds() - before if os.path.exists(f"/proc/self/fd/{fd}")}
    assert leaked == set(), [os.readlink(f"/proc/self/fd/{fd}") for fd in leaked]


@pytest.fixture
def ckpt(tmp_path):
    p = tmp_path / "model.safetensors"
    fs.save_file(model(), p)
    return p


def nth_call(n: int, action):
    """A hook that runs ``action(offset, length)`` on its n-th call (0-based), counting all calls."""
    state = {"calls": 0}
    lock = threading.Lock()

    def hook(obj, offset, length):
        with lock:
            k = state["calls"]
            state["calls"] += 1
        if k == n:
            return action(obj, offset, length)
        return None
    hook.state = state
    return hook


def eio(obj, offset, length):
    raise OSError(errno.EIO, os.strerror(errno.EIO))


def enospc(obj, offset, length):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# ---------------------------------------------------------------- reads

@pytest.mark.parametrize("opts", BACKENDS, ids=["pread", "mmap", "direct"])
@pytest.mark.parametrize("at", [0, 4])
def test_read_error_names_the_file_and_the_next_load_works(ckpt, monkeypatch, clean_process, opts, at):
    monkeypatch.setattr(source, "fault_hook", nth_call(at, eio))
    with pytest.raises(OSError) as ei:
        fs.load_file(ckpt, threads=3, **SMALL, **opts)
    assert ei.value.errno == errno.EIO and os.fspath(ckpt) in str(ei.value)
    monkeypatch.setattr(source, "fault_hook", None)
    assert_equal(fs.load_file(ckpt, threads=3, **SMALL, **opts), model())


@pytest.mark.parametrize("opts", BACKENDS, ids=["pread", "mmap", "direct"])
def test_short_read_is_a_format_error_naming_the_file(ckpt, monkeypatch, clean_process, opts):
    monkeypatch.setattr(source, "fault_hook", nth_call(2, lambda o, off, n: n // 2))
    with pytest.raises(fs.FormatError) as ei:
        fs.load_file(ckpt, threads=2, **SMALL, **opts)
    assert ei.value.rule == "file-truncated" and ei.value.path == os.fspath(ckpt)
    monkeypatch.setattr(source, "fault_hook", None)
    assert_equal(fs.load_file(ckpt, **SMALL, **opts), model())


@pytest.mark.parametrize("opts", BACKENDS, ids=["pread", "mmap", "direct"])
def test_file_truncated_mid_load(ckpt, monkeypatch, clean_process, opts):
    original = ckpt.read_bytes()

    def truncate(obj, offset, length):
        os.truncate(ckpt, len(original) // 2)
    monkeypatch.setattr(source, "fault_hook", nth_call(0, truncate))
    with pytest.raises(fs.FormatError) as ei:
        fs.load_file(ckpt, threads=2, **SMALL, **opts)
    assert ei.value.rule in ("file-truncated", "file-changed") and ei.value.path == os.fspath(ckpt)
    monkeypatch.setattr(source, "fault_hook", None)
    ckpt.write_bytes(original)
    assert_equal(fs.load_file(ckpt, **SMALL, **opts), model())


def test_file_growing_or_rewritten_mid_load_is_caught(ckpt, monkeypatch, clean_process):
    """Every read succeeds, yet the file is no longer the one whose header was parsed."""
    def grow(obj, offset, length):
        with open(ckpt, "ab") as f:
            f.write(b"\0" * 100)
    monkeypatch.setattr(source, "fault_hook", nth_call(1, grow))
    with pytest.raises(fs.FormatError) as ei:
        fs.load_file(ckpt, threads=2, **SMALL)
    assert ei.value.rule == "file-changed" and ei.value.path == os.fspath(ckpt)

    fs.save_file(model(), ckpt)

    def rewrite_in_place(obj, offset, length):   # same size, new bytes, as a non-atomic writer would
        with open(ckpt, "r+b") as f:
            f.seek(-8, os.SEEK_END)
            f.write(np.arange(1, dtype=np.float64).tobytes())
            f.flush()
            os.utime(f.fileno(), ns=(1, 1))   # a distinct mtime even on coarse-clock file systems
    monkeypatch.setattr(source, "fault_hook", nth_call(1, rewrite_in_place))
    with pytest.raises(fs.FormatError, match="changed since its header was read"):
        fs.load_file(ckpt, threads=2, **SMALL)


@pytest.mark.parametrize("front", ["load_file", "load_into", "safe_open"])
def test_file_replaced_between_header_and_data_is_read_again(ckpt, monkeypatch, clean_process, front):
    """An atomic save landing between the header read and the data open must not mix versions:
    the load starts over and returns the new version whole; a file replaced every time is refused."""
    from foxhunt_stream.io import checkpoint
    real = checkpoint.read_header_with_identity
    pending = [model(1)]
    calls = []

    def read_then_replace(path):
        out = real(path)
        calls.append(path)
        if pending:
            fs.save_file(pending.pop(), ckpt)   # same layout, new bytes, new inode
        return out

    def load():
        if front == "load_file":
            return fs.load_file(ckpt)
        if front == "load_into":
            store = {k: np.zeros_like(v) for k, v in model().items()}
            fs.load_into(store, ckpt)
            return store
        with fs.safe_open(ckpt) as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    monkeypatch.setattr(checkpoint, "read_header_with_identity", read_then_replace)
    assert_equal(load(), model(1))
    assert len(calls) == 2
    calls.clear()
    pending.extend([model(2), model(3), model(4)])
    with pytest.raises(fs.FormatError) as ei:
        load()
    assert ei.value.rule == "file-replaced" and ei.value.path == os.fspath(ckpt) and len(calls) == 3


def test_failed_reads_through_every_front_end(ckpt, monkeypatch, clean_process):
    monkeypatch.setattr(source, "fault_hook", lambda o, off, n: eio(o, off, n) if off > 200 else None)
    store = {k: np.zeros_like(v) for k, v in model().items()}
    with pytest.raises(OSError, match="model.safetensors"):
        fs.load_into(store, ckpt, **SMALL)
    handle = fs.load_file(ckpt, background=True, threads=2, **SMALL)
    with pytest.raises(OSError, match="model.safetensors"):
        handle.result()
    with fs.safe_open(ckpt, **SMALL) as f:
        with pytest.raises(OSError, match="model.safetensors"):
            f.get_tensor("w")
        monkeypatch.setattr(source, "fault_hook", None)
        np.testing.assert_array_equal(f.get_tensor("w"), model()["w"])   # the handle stays usable
    fs.load_into(store, ckpt, **SMALL)
    assert_equal(store, model())


# ---------------------------------------------------------------- writes

def write_calls(save) -> int:
    counter = nth_call(-1, None)
    sink.fault_hook = counter
    try:
        save()
    finally:
        sink.fault_hook = None
    return counter.state["calls"]


def snapshot(directory) -> dict[str, bytes]:
    return {f: (directory / f).read_bytes() for f in sorted(os.listdir(directory))}


@pytest.mark.parametrize("kind", ["single", "single+checksum", "sharded", "sharded+checksum"])
def test_write_error_at_every_chunk_boundary_leaves_the_old_checkpoint(tmp_path, tmp_path_factory, monkeypatch,
                                                                      clean_process, kind):
    opts = dict(threads=2, **SMALL)
    if "checksum" in kind:
        opts.update(checksum="xxh3-64", checksum_block=4096)
    if kind.startswith("sharded"):
        opts["max_shard_size"] = 20_000
        target = tmp_path
    else:
        target = tmp_path / "model.safetensors"
    fs.save_file(model(0), target, **opts)
    old = snapshot(tmp_path)
    probe = tmp_path_factory.mktemp("probe")   # count the writes of the same save elsewhere
    n = write_calls(lambda: fs.save_file(model(1), probe if kind.startswith("sharded")
                                         else probe / "model.safetensors", **opts))
    assert n >= 10
    for k in range(n):
        monkeypatch.setattr(sink, "fault_hook", nth_call(k, enospc))
        with pytest.raises(OSError) as ei:
            fs.save_file(model(1), target, **opts)
        assert ei.value.errno == errno.ENOSPC and os.fspath(tmp_path) in str(ei.value)
        assert snapshot(tmp_path) == old, f"failure at write {k} of {n} changed the directory"
    monkeypatch.setattr(sink, "fault_hook", None)
    assert_equal(fs.load_file(target, verify="checksum" in kind), model(0))
    fs.save_file(model(1), target, **opts)   # and the next save works
    assert_equal(fs.load_file(target, verify="checksum" in kind), model(1))


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_failed_commit_leaves_the_old_file_and_no_temp(ckpt, monkeypatch, clean_process, step):
    old = snapshot(ckpt.parent)

    def boom(*a, **k):
        raise OSError(errno.EIO, "injected")
    monkeypatch.setattr(sink.os, step, boom)
    with pytest.raises(OSError):
        fs.save_file(model(1), ckpt)
    monkeypatch.undo()
    assert snapshot(ckpt.parent) == old


KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import foxhunt_stream as fs
    from foxhunt_stream.io import sink
    calls = [0]
    def hook(f, offset, length):
        calls[0] += 1
        if calls[0] == 4:
            os.kill(os.getpid(), signal.SIGKILL)
    sink.fault_hook = hook
    target = sys.argv[1]
    kw = dict(chunk_bytes=4096, threads=1)
    if os.path.isdir(target):
        kw["max_shard_size"] = 20_000
    fs.save_file({"w": np.full(9000, 7, np.float32), "b": np.ones(3000, np.int16), "s": np.ones(5)}, target, **kw)
""")


@pytest.mark.parametrize("sharded", [False, True])
def test_killed_save_leaves_temps_that_loads_ignore_and_clean_removes(tmp_path, clean_process, sharded):
    target = tmp_path if sharded else tmp_path / "model.safetensors"
    fs.save_file(model(), target, **({"max_shard_size": 20_000} if sharded else {}))
    old = snapshot(tmp_path)
    root = os.path.dirname(os.path.dirname(os.path.abspath(fs.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", KILLED_SAVE, os.fspath(target)], env=env, timeout=120,
                          capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    temps = sorted(set(os.listdir(tmp_path)) - set(old))
    assert temps, "the killed save left no temp file (the test did not kill it mid-save)"
    for name in temps:
        assert sink.TEMP_MARK in name and name.startswith(".") and not name.endswith(".safetensors")
        assert not name.endswith(".json")
    assert {f: (tmp_path / f).read_bytes() for f in old} == old    # the old files are untouched
    assert_equal(fs.load_file(tmp_path), model())                   # a directory load ignores temps
    # a temp whose writer holds its lock (this process, or another one) is never removed; an
    # unlocked one is, whatever pid its name carries (pids mean nothing across PID namespaces)
    mine = tmp_path / f".x.safetensors{sink.TEMP_MARK}{os.getpid()}.abcd1234"
    theirs = tmp_path / f".y.safetensors{sink.TEMP_MARK}999999.abcd1234"
    unlocked = tmp_path / f".z.safetensors{sink.TEMP_MARK}{os.getpid()}.abcd1234"
    for p in (mine, theirs, unlocked):
        p.write_bytes(b"in progress")
    live = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'rb+'); "
                             "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
                             os.fspath(theirs)], stdout=subprocess.PIPE, text=True)
    fd = os.open(mine, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert live.stdout.readline().strip() == "locked"
        removed = fs.clean_stale_temps(tmp_path)
        assert sorted(os.path.basename(r) for r in removed) == sorted(temps + [unlocked.name])
        assert sorted(os.listdir(tmp_path)) == sorted(list(old) + [mine.name, theirs.name])
    finally:
        os.close(fd)
        live.kill()
        live.wait()
    assert sorted(fs.clean_stale_temps(tmp_path)) == sorted([os.fspath(mine), os.fspath(theirs)])   # let go
    assert snapshot(tmp_path) == old


def test_directory_holding_only_a_temp_is_not_a_checkpoint(tmp_path):
    (tmp_path / f".model.safetensors{sink.TEMP_MARK}999999.abcd").write_bytes(b"partial")
    with pytest.raises(FileNotFoundError):
        fs.load_file(tmp_path)


# ---------------------------------------------------------------- cancellation

def test_pipeline_error_cancels_the_other_workers(clean_process):
    done = []
    lock = threading.Lock()

    def work(worker, item):
        if item == 3:
            raise RuntimeError("chunk 3 failed")
        with lock:
            done.append(item)

    job = Job(list(range(1000)), work, threads=8).start()
    with pytest.raises(RuntimeError, match="chunk 3"):
        job.wait(timeout=60)
    assert len(done) < 100


@pytest.fixture
def thousand_chunks(tmp_path):
    p = tmp_path / "big.safetensors"
    fs.save_file({"x": np.arange(1000 * 1024, dtype=np.float32)}, p)   # 1000 chunks of 4096 bytes
    return p


def test_failing_read_cancels_the_load_promptly(thousand_chunks, monkeypatch, clean_process):
    start = fs.read_header(thousand_chunks).data_start
    calls = []

    def hook(src, offset, length):
        calls.append(offset)
        if offset == start + 3 * 4096:
            raise OSError(errno.EIO, "injected")
    monkeypatch.setattr(source, "fault_hook", hook)
    result: list = []
    t = threading.Thread(target=lambda: result.append(_raises(lambda: fs.load_file(
        thousand_chunks, threads=8, chunk_bytes=4096, staging_bytes=64 << 10))))
    t.start()
    t.join(120)
    assert not t.is_alive(), "the load hung after a worker failed"
    assert isinstance(result[0], OSError)
    assert len(calls) < 200, f"{len(calls)} of 1000 chunks were still read after chunk 3 failed"


def test_failing_write_cancels_the_save_promptly(thousand_chunks, tmp_path, monkeypatch, clean_process):
    calls = []

    def hook(f, offset, length):
        calls.append(offset)
        if len(calls) == 4:   # the header, then chunks 0, 1, 2 (in some order)... the 4th write fails
            raise OSError(errno.EIO, "injected")
    monkeypatch.setattr(sink, "fault_hook", hook)
    target = tmp_path / "out.safetensors"
    with pytest.raises(OSError):
        fs.save_file({"x": np.zeros(1000 * 1024, np.float32)}, target, threads=8, chunk_bytes=4096)
    assert len(calls) < 200
    assert not target.exists() and os.listdir(tmp_path) == ["big.safetensors"]


def _raises(fn):
    try:
        fn()
    except BaseException as e:   # noqa: BLE001
        return e
    return None
