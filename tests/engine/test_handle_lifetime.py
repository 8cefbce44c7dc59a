"""A load's files live exactly as long as a load needs them.

- A ``safe_open`` handle closed while one of its loads runs (from another thread, or a
  ``tensors()`` iterator consumed after its ``with`` block): the load returns the right bytes or
  raises the closed-handle error; it never reads a descriptor that was closed and perhaps reused
  for another file (another file's bytes, or EBADF).
- A background load closes its files once its last worker stops, however its handle is used:
  every tensor taken with ``wait(name)``, or the handle dropped.
- ``cancel()`` makes ``result()`` and ``wait(name)`` raise ``fs.CancelledError``.

Races are made likely with a short thread switch interval and many rounds, bounded in time.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import numpy as np
import pytest

import foxhunt_stream as fs

OPTS = dict(threads=2, chunk_bytes=4096)
SECONDS = 2.0


def open_fds() -> set[str]:
    return {fd for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}")}


def fds_of(path) -> int:
    """Descriptors of this process open on ``path``."""
    real = os.path.realpath(path)
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == real
        except OSError:
            pass
    return n


@pytest.fixture
def two_files(tmp_path):
    """The checkpoint loaded, and a decoy of the same layout whose bytes differ everywhere: a load
    that read the decoy's descriptor would return the decoy's values."""
    x = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)
    good, decoy = tmp_path / "good.safetensors", tmp_path / "decoy.safetensors"
    fs.save_file({"x": x}, good)
    fs.save_file({"x": -x - 1}, decoy)
    return str(good), str(decoy), x


def test_a_handle_closed_by_another_thread_during_get_tensor(two_files, short_switches):
    good, decoy, x = two_files
    deadline = time.monotonic() + SECONDS
    outcomes = {"right bytes": 0, "closed": 0}
    while time.monotonic() < deadline:
        f = fs.safe_open(good, **OPTS)
        got: list = []

        def load():
            try:
                got.append(f.get_tensor("x"))
            except fs.SafetensorError as e:   # the handle was closed first: the documented error
                got.append(e)
        t = threading.Thread(target=load)
        t.start()
        f.close()
        decoys = [os.open(decoy, os.O_RDONLY) for _ in range(4)]   # take the freed descriptor numbers
        t.join(30)
        for fd in decoys:
            os.close(fd)
        (out,) = got
        if isinstance(out, BaseException):
            assert "closed" in str(out).lower(), out
            outcomes["closed"] += 1
        else:
            np.testing.assert_array_equal(out, x)   # never the decoy's bytes
            outcomes["right bytes"] += 1
    assert sum(outcomes.values()) > 10, outcomes


def test_a_tensors_iterator_used_after_its_with_block(two_files, short_switches):
    good, decoy, x = two_files
    rows = {f"r{i}": x[i:i + 8].copy() for i in range(0, 64, 8)}
    fs.save_file(rows, good)
    for _ in range(50):
        with fs.safe_open(good, **OPTS) as f:
            it = f.tensors()
            first = next(it)
        decoys = [os.open(decoy, os.O_RDONLY) for _ in range(4)]
        rest = list(it)   # the load started inside the block goes on with the files it holds
        for fd in decoys:
            os.close(fd)
        got = dict([first] + rest)
        assert got.keys() == rows.keys()
        for k in rows:
            np.testing.assert_array_equal(got[k], rows[k])
    with fs.safe_open(good, **OPTS) as f:
        late = f.tensors()   # not started before the close
    with pytest.raises(fs.SafetensorError, match="closed"):
        next(late)
    assert fds_of(good) == 0


def _until(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not predicate() and time.monotonic() < end:
        time.sleep(0.005)
    return predicate()


def test_a_background_load_consumed_with_wait_closes_its_files(two_files):
    good, _, x = two_files
    before = open_fds()
    for _ in range(100):
        h = fs.load_file(good, background=True, **OPTS)
        for name in h.names:
            np.testing.assert_array_equal(h.wait(name), x)
        assert _until(h.done)
    assert _until(lambda: fds_of(good) == 0), fds_of(good)
    assert open_fds() <= before | set()


def test_a_dropped_background_load_closes_its_files(two_files):
    good, _, _ = two_files
    for _ in range(100):
        fs.load_file(good, background=True, **OPTS)   # the handle is dropped at once
    assert _until(lambda: fds_of(good) == 0), fds_of(good)


def test_cancel_makes_result_and_wait_raise_the_exported_cancelled_error(tmp_path):
    path = tmp_path / "big.safetensors"
    fs.save_file({f"t{i}": np.full(1 << 16, i, np.float32) for i in range(64)}, path)
    h = fs.load_file(path, background=True, threads=1, chunk_bytes=4096)
    h.cancel()
    with pytest.raises(fs.CancelledError) as e:
        h.result()
    assert isinstance(e.value, concurrent.futures.CancelledError)
    assert "CancelledError" in fs.__all__
    assert _until(lambda: fds_of(path) == 0)


def test_cancel_after_the_load_is_over_keeps_its_result(tmp_path):
    path = tmp_path / "small.safetensors"
    fs.save_file({"a": np.arange(10, dtype=np.float32)}, path)
    h = fs.load_file(path, background=True)
    out = h.result()
    h.cancel()
    np.testing.assert_array_equal(h.result()["a"], out["a"])


def test_an_empty_list_of_names_loads_nothing(tmp_path):
    path = tmp_path / "x.safetensors"
    fs.save_file({"a": np.arange(10, dtype=np.float32)}, path)
    assert fs.load_file(path, names=[]) == {}
    with pytest.raises(KeyError, match="matches no tensor"):
        fs.load_file(path, names="b*")
