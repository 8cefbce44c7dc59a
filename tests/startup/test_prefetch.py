"""``fs.prefetch`` of a checkpoint: which bytes it reads, per-tensor waits, errors, cancel, the
files it skips, how it leaves the disk to the imports (idle steps, pacing, no readahead) until a
load of the files begins, and how a load reads through the cache it is filling. No torch.

Readiness and "blocks only on what it needs" are proven with a gate: the fault hook holds back
the reads of a later tensor until the test has seen an earlier one. No timing is asserted.
"""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
from hypothesis import given, settings as hsettings, strategies as st

import foxhunt_stream as fs
from foxhunt_stream.engine import pipeline

from foxhunt_stream.io import pagecache, read_policy, source
from foxhunt_stream.io.checkpoint import open_checkpoint
from foxhunt_stream.settings import merge
from foxhunt_stream.startup import prefetch as prefetch_mod
from foxhunt_stream.startup.prefetch import plan_pieces
from read_gates import range_of, gate_hook  # noqa: E402
from thread_support import foxhunt_threads_at_work


def _recording_hook(reads: list):
    lock = threading.Lock()

    def hook(src, offset, length):
        with lock:
            reads.append((os.path.basename(src.path), offset, length))
    return hook


def _fill_lengths(monkeypatch) -> list[int]:
    """The length of every FileSource.fill_cache call in this process."""
    calls: list[int] = []
    real = source.FileSource.fill_cache
    monkeypatch.setattr(source.FileSource, "fill_cache", lambda self, off, n, buf, copy=False, **k:
                        (calls.append(n), real(self, off, n, buf, copy, **k))[1])
    return calls


# ---------------------------------------------------------------- what it reads

@hsettings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 80)), max_size=6), min_size=1, max_size=3),
       st.integers(1, 64))
def test_plan_pieces_cover_exactly_the_spans(raw, piece):
    spans = [[(a, a + n) for a, n in f] for f in raw]
    pieces = plan_pieces(spans, piece)
    for f, fspans in enumerate(spans):
        want = set()
        for a, b in fspans:
            want.update(range(a, b))
        mine = [p for p in pieces if p.file == f]
        got = [i for p in mine for i in range(p.offset, p.end)]
        assert sorted(got) == sorted(want) and len(got) == len(set(got))   # covered once each
        assert all(0 < p.length <= piece for p in mine)
    assert [(p.file, p.offset) for p in pieces] == sorted((p.file, p.offset) for p in pieces)


def test_prefetch_reads_every_byte_of_the_files(checkpoint, foxhunt_threads):
    reads = []
    source.fault_hook = _recording_hook(reads)
    h = fs.prefetch(checkpoint, skip_resident=False, threads=2, chunk_bytes=8192, helper_process=False)
    h.wait()
    size = os.path.getsize(checkpoint)
    covered = sorted((off, off + n) for _, off, n in reads)
    pos = 0
    for a, b in covered:
        assert a == pos
        pos = b
    assert pos == size and h.done() and h.bytes_done == h.nbytes == size
    assert not foxhunt_threads()


def test_prefetch_with_names_reads_only_those(checkpoint):
    reads = []
    source.fault_hook = _recording_hook(reads)
    h = fs.prefetch(checkpoint, names=["t1", "t4"], skip_resident=False, chunk_bytes=4096, helper_process=False)
    h.wait("t4")
    h.wait()
    allowed = [range_of(checkpoint, "t1"), range_of(checkpoint, "t4")]
    assert reads and all(any(lo <= off and off + n <= hi for lo, hi in allowed) for _, off, n in reads)
    assert sum(n for *_, n in reads) == sum(hi - lo for lo, hi in allowed)


def test_prefetch_wait_name_blocks_only_on_that_tensor(checkpoint):
    gate, log = threading.Event(), []
    source.fault_hook = gate_hook(checkpoint, "t5", gate, log)
    h = fs.prefetch(checkpoint, skip_resident=False, threads=2, chunk_bytes=4096, helper_process=False)
    h.wait("t0")
    h.wait("t2")
    assert not h.done()
    assert pagecache.prefetching(checkpoint)
    gate.set()
    h.wait()
    assert log and all(log) and not pagecache.prefetching(checkpoint)


def test_prefetch_error_propagates(checkpoint, foxhunt_threads):
    lo, hi = range_of(checkpoint, "t3")

    def hook(src, offset, length):
        if lo <= offset < hi:
            raise OSError(errno.EIO, "injected")
    source.fault_hook = hook
    h = fs.prefetch(checkpoint, skip_resident=False, threads=2, chunk_bytes=4096, helper_process=False)
    with pytest.raises(OSError, match="injected"):
        h.wait("t3")
    with pytest.raises(OSError, match="injected"):
        h.wait()
    assert h.done() and not foxhunt_threads()


def test_prefetch_cancel(checkpoint, monkeypatch, foxhunt_threads):
    gate, log, arrived = threading.Event(), [], threading.Event()
    source.fault_hook = gate_hook(checkpoint, "t1", gate, log, arrived)
    real_cancel = pipeline.Job.cancel
    monkeypatch.setattr(pipeline.Job, "cancel", lambda self: (real_cancel(self), gate.set()))
    h = fs.prefetch(checkpoint, skip_resident=False, threads=1, chunk_bytes=4096, helper_process=False)
    assert arrived.wait(20)
    h.cancel()
    assert h.done() and log == [True] and not foxhunt_threads() and h.bytes_done < h.nbytes
    with pytest.raises(fs.CancelledError):
        h.wait()


def test_prefetch_skips_resident_files(checkpoint):
    if pagecache.resident_fraction(checkpoint, samples=1 << 62) < 1.0:
        pytest.skip("the freshly written file is not fully in the page cache here")
    h = fs.prefetch(checkpoint)
    h.wait()
    assert h.nbytes == 0 and h.pieces == []


def test_prefetch_rejects_unknown_method(checkpoint):
    with pytest.raises(ValueError, match="method"):
        fs.prefetch(checkpoint, method="mmap")


def test_the_loader_reads_through_the_cache_while_a_prefetch_fills_it(checkpoint, monkeypatch):
    """A cold file that would not stay in the page cache is loaded with O_DIRECT, except while a
    prefetch of it runs: then both read through the page cache instead of racing for the disk."""
    monkeypatch.setattr(pagecache, "resident_fraction", lambda p: 0.0)   # "cold"
    monkeypatch.setattr(read_policy, "available_memory", lambda: 0)      # ... and too big to keep
    monkeypatch.setattr(prefetch_mod, "_beyond_the_cache", lambda paths, spans, s: [])   # prefetched anyway
    s = merge(direct_io="auto")

    def backend() -> str:
        ck = open_checkpoint(checkpoint)
        (policy,) = read_policy.read_policies(ck.paths, [ck.headers[0].file_size], (), [ck.headers[0].file_size], s)
        src = policy.open(ck.paths[0])
        src.close()
        return src.backend
    if backend() != "direct":
        pytest.skip("no O_DIRECT on this filesystem")
    gate, log = threading.Event(), []
    source.fault_hook = gate_hook(checkpoint, "t5", gate, log)
    h = fs.prefetch(checkpoint, skip_resident=False, threads=1, chunk_bytes=4096)
    try:
        assert backend() == "pread"   # positional reads through the cache (not yet resident: no mapping)
    finally:
        gate.set()
        h.wait()
    assert backend() == "direct"


# ---------------------------------------------------------------- leaving the disk to the imports

def test_prefetch_takes_the_gil_back_once_per_64_mib_not_per_mib(tmp_path, monkeypatch):
    """A reader that needs the GIL after every 1 MiB read makes the importing main thread wait at
    each of its own system calls; at normal priority the checkpoint is read with one call per
    64 MiB piece."""
    path = str(tmp_path / "big.safetensors")
    fs.save_file({"w": np.zeros(40 << 20, np.uint8), "v": np.zeros(100, np.uint8)}, path)
    calls = _fill_lengths(monkeypatch)
    h = fs.prefetch(path, skip_resident=False, chunk_bytes=128 << 20, priority="normal")
    h.wait()
    assert sum(calls) == h.nbytes == os.path.getsize(path) and len(calls) == 1


def test_idle_readers_take_small_steps_until_a_load_begins(tmp_path, monkeypatch):
    """priority="idle": 4 MiB per call, so the kernel's readahead does not keep the disk's queue
    full in front of the imports; once a load of the file starts (unthrottle), the rest of the
    piece in one call."""
    path = str(tmp_path / "big.safetensors")
    fs.save_file({"w": np.zeros(40 << 20, np.uint8)}, path)
    calls = _fill_lengths(monkeypatch)
    h = fs.prefetch(path, skip_resident=False, chunk_bytes=128 << 20, helper_process=False)
    h.wait()
    assert sum(calls) == h.nbytes and max(calls) == prefetch_mod.PACED_BYTES
    calls.clear()
    h = fs.prefetch(path, skip_resident=False, chunk_bytes=128 << 20, helper_process=False, max_rate=1.0)
    for _ in range(2000):   # the first step is due at once, the second in 4 MiB / (1 byte/s)
        if calls:
            break
        threading.Event().wait(0.01)
    h.unthrottle()     # what pagecache.loading(path) does when a load opens the file
    h.wait(timeout=60)
    small = prefetch_mod.PACED_BYTES
    assert calls[0] == small and calls[-1] > small and sum(calls) == h.nbytes


def test_a_paced_normal_prefetch_reads_in_small_steps(tmp_path, monkeypatch):
    path = str(tmp_path / "big.safetensors")
    fs.save_file({"w": np.zeros(20 << 20, np.uint8)}, path)
    calls = _fill_lengths(monkeypatch)
    h = fs.prefetch(path, skip_resident=False, chunk_bytes=128 << 20, priority="normal", max_rate=1e12)
    h.wait()
    assert sum(calls) == h.nbytes and max(calls) == prefetch_mod.PACED_BYTES


def test_a_load_of_the_file_lifts_the_prefetch_rate_limit(tmp_path):
    """max_rate holds the prefetch back only until the load wants the bytes: at 1 byte/s it would
    take hours; the load starts, the prefetch is unthrottled, both finish."""
    rng = np.random.default_rng(1)
    path = str(tmp_path / "m.safetensors")
    t = {f"w{i}": rng.standard_normal(300_000).astype(np.float32) for i in range(4)}
    fs.save_file(t, path)
    h = fs.prefetch(path, skip_resident=False, max_rate=1.0)
    assert not h.done()
    got = fs.load_file(path)
    assert all(np.array_equal(got[k], v) for k, v in t.items())
    h.wait(timeout=60)
    assert h.done() and h.bytes_done == h.nbytes


def test_bad_max_rate_is_refused_before_anything_opens(checkpoint):
    for bad in (0, True):
        with pytest.raises(ValueError, match="max_rate"):
            fs.prefetch(checkpoint, max_rate=bad)
    assert not foxhunt_threads_at_work("foxhunt-prefetch")


def _advice_seen(monkeypatch) -> list[int]:
    advised: list[int] = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, a: (advised.append(a), real(fd, off, n, a))[1])
    return advised


@pytest.mark.parametrize("helper", [False, True])
def test_idle_pread_mode_queues_one_step_until_a_load_begins(tmp_path, monkeypatch, helper):
    """IDLE_READ_MODE = "pread-no-readahead": the idle readers' files are advised
    POSIX_FADV_RANDOM and read through a buffer (no readahead, so one step queued per reader);
    unthrottle() advises POSIX_FADV_NORMAL again. The bytes still land, here or in the helper."""
    path = str(tmp_path / "big.safetensors")
    data = np.arange(6 << 20, dtype=np.uint8)
    fs.save_file({"w": data}, path)
    monkeypatch.setattr(prefetch_mod, "IDLE_READ_MODE", "pread-no-readahead")
    monkeypatch.setattr(prefetch_mod, "PACED_BYTES", 1 << 20)
    advised, copies = _advice_seen(monkeypatch), []
    real_fill = source.FileSource.fill_cache
    monkeypatch.setattr(source.FileSource, "fill_cache",
                        lambda self, off, n, buf, copy=False, **k: (copies.append((n, copy)),
                                                                    real_fill(self, off, n, buf, copy, **k))[1])
    h = fs.prefetch(path, skip_resident=False, chunk_bytes=4 << 20, max_rate=None, helper_process=helper)
    h.wait(timeout=60)
    assert h.bytes_done == h.nbytes == os.path.getsize(path)
    if not helper:   # the child's calls are in its own process
        assert os.POSIX_FADV_RANDOM in advised and copies and all(c and n <= 1 << 20 for n, c in copies)
    h2 = fs.prefetch(path, skip_resident=False, max_rate=1e3, helper_process=helper)   # held back: still reading
    advised.clear()
    h2.unthrottle()
    h2.wait(timeout=60)
    if not helper:
        assert os.POSIX_FADV_NORMAL in advised
    assert h2.bytes_done == h2.nbytes
    np.testing.assert_array_equal(fs.load_file(path)["w"], data)


def test_readahead_stays_on_for_normal_priority_and_for_advise(checkpoint, monkeypatch):
    monkeypatch.setattr(prefetch_mod, "IDLE_READ_MODE", "pread-no-readahead")
    advised = _advice_seen(monkeypatch)
    fs.prefetch(checkpoint, skip_resident=False, helper_process=False).wait()
    assert os.POSIX_FADV_RANDOM in advised
    for kw in ({"priority": "normal"}, {"method": "advise"}):
        advised.clear()
        fs.prefetch(checkpoint, skip_resident=False, **kw).wait()
        assert advised and os.POSIX_FADV_RANDOM not in advised, kw


def test_an_unknown_idle_read_mode_is_refused(checkpoint, monkeypatch):
    monkeypatch.setattr(prefetch_mod, "IDLE_READ_MODE", "shallow")
    with pytest.raises(ValueError, match="IDLE_READ_MODE"):
        fs.prefetch(checkpoint, skip_resident=False)


def test_prefetch_imports_neither_torch_nor_cupy(checkpoint):
    """A prefetch is a start's first statement, before ``import torch``: it must not pull in
    torch, cupy or transformers itself (here or in its helper process)."""
    import subprocess
    import sys
    code = ("import sys, foxhunt_stream as fs\n"
            f"fs.prefetch({checkpoint!r}, skip_resident=False).wait(timeout=60)\n"
            "print(sorted(m for m in ('torch', 'cupy', 'transformers') if m in sys.modules))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(fs.__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": root})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]"
