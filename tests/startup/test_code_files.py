"""The code files a prefetch reads before the checkpoint (``prefetch(..., imports=, modules=)``,
``startup.code_files``): in the trace's order, only the listed ranges, hinted at normal priority,
best effort, skipped on a hot start; their metadata and RECORDs beside them; cancel, waits, and
none of these reads noted as the start's own. No torch, no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import foxhunt_stream as fs
from foxhunt_stream.io import source
from foxhunt_stream.startup import code_files, helper_process, importtrace, prefetch as prefetch_mod, readers
from foxhunt_stream.startup.importtrace import TRACE_HEADER, format_trace
from thread_support import foxhunt_threads_at_work


def _fills(monkeypatch, before=None) -> list[tuple[str, int, int, threading.Thread]]:
    """(path, offset, length, thread) of every FileSource.fill_cache call in this process;
    ``before(path)`` runs first (to hold a read back)."""
    seen: list[tuple[str, int, int, threading.Thread]] = []
    real = source.FileSource.fill_cache

    def fill(self, off, n, buf, copy=False, **k):
        seen.append((self.path, off, n, threading.current_thread()))
        if before is not None:
            before(self.path)
        return real(self, off, n, buf, copy, **k)
    monkeypatch.setattr(source.FileSource, "fill_cache", fill)
    return seen


def _threads_named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def _small_files_traced(tmp_path, pattern: str, n: int, size: int, dirs=()):
    """``n`` files of ``size`` bytes and a trace listing them, then ``dirs`` (to be listed)."""
    files = []
    for i in range(n):
        f = tmp_path / pattern.format(i)
        f.write_bytes(b"c" * size)
        files.append(str(f))
    trace = tmp_path / "imports.txt"
    trace.write_text(TRACE_HEADER + "\n" + "".join(f + "\n" for f in files) + "".join(f"{d}{os.sep}\n" for d in dirs))
    return files, trace


# ---------------------------------------------------------------- an import trace

def test_prefetch_reads_the_trace_in_order_then_the_checkpoint(tmp_path, checkpoint, monkeypatch):
    files = []
    for i, size in enumerate([20_000, 300, 5_000]):
        f = tmp_path / f"lib{i}.so"
        f.write_bytes(bytes([i + 1]) * size)
        files.append(str(f))
    trace = tmp_path / "imports.txt"
    trace.write_text(TRACE_HEADER + "\n" + "\n".join([files[0], str(tmp_path / "gone.pyc"), *files[1:]]) + "\n")
    seen = _fills(monkeypatch)
    monkeypatch.setattr(code_files, "CODE_THREADS", 1)   # one reader: the order is the trace's
    h = fs.prefetch(checkpoint, skip_resident=False, threads=1, chunk_bytes=8192, imports=trace, helper_process=False)
    h.wait()
    order = [path for path, *_ in seen]
    assert order[:5] == [files[0]] * 3 + [files[1], files[2]]   # 20 000 bytes = three 8 KiB pieces
    assert set(order[5:]) == {checkpoint}
    assert h.module_bytes == 25_300 and h.bytes_done == h.nbytes == os.path.getsize(checkpoint)


def test_prefetch_reads_only_the_listed_ranges_of_a_library(tmp_path, checkpoint, monkeypatch):
    lib = tmp_path / "libbig.so"
    lib.write_bytes(b"L" * 100_000)
    trace = tmp_path / "imports.txt"
    trace.write_text(f"{TRACE_HEADER}\n{lib}\t0+4096,40960+20000\n")
    seen = _fills(monkeypatch)
    monkeypatch.setattr(code_files, "CODE_THREADS", 1)
    h = fs.prefetch(checkpoint, skip_resident=False, threads=1, chunk_bytes=8192, imports=trace)
    h.wait()
    read = [(off, n) for path, off, n, _ in seen if path == str(lib)]
    assert read == [(0, 4096), (40960, 8192), (49152, 8192), (57344, 3616)] and h.module_bytes == 24_096


def test_prefetch_with_modules_and_a_trace_reads_each_file_once(tmp_path, checkpoint, monkeypatch):
    root = tmp_path / "site"
    pkg = root / "fhtracepkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_a.so").write_bytes(b"a" * 1000)
    (pkg / "_b.so").write_bytes(b"b" * 2000)
    monkeypatch.syspath_prepend(str(root))
    trace = tmp_path / "imports.txt"
    trace.write_text(f"{TRACE_HEADER}\n{os.path.realpath(pkg / '_a.so')}\n")
    h = fs.prefetch(checkpoint, skip_resident=False, threads=1, imports=str(trace), modules=["fhtracepkg"])
    h.wait()
    assert [os.path.basename(f) for f in h.module_paths] == ["_a.so", "_b.so"] and h.module_bytes == 3000


def test_prefetch_with_no_trace_yet_reads_the_checkpoint_only(tmp_path, checkpoint):
    h = fs.prefetch(checkpoint, skip_resident=False, imports=tmp_path / "first-start.txt")
    h.wait()
    assert h.done() and h.module_paths == [] and h.bytes_done == os.path.getsize(checkpoint)
    assert not foxhunt_threads_at_work("foxhunt-prefetch")


def test_code_files_are_hinted_at_normal_priority_while_the_checkpoint_idles(tmp_path, checkpoint, monkeypatch):
    """The imports wait for the code files: they are read with a WILLNEED hint per piece and
    outside the idle I/O class, even when the checkpoint's readers (priority="idle") are in it
    and read 4 MiB at a time without hints."""
    lib = tmp_path / "libx.so"
    lib.write_bytes(b"x" * 50_000)
    trace = tmp_path / "imports.txt"
    trace.write_text(f"{TRACE_HEADER}\n{lib}\n")
    hinted, priority, reads = [], {}, []   # priority: each thread's I/O class, as the readers set it

    def set_priority(value):
        priority[threading.current_thread()] = value
        return True
    monkeypatch.setattr(readers, "io_priority", lambda: priority.get(threading.current_thread(), "normal"))
    monkeypatch.setattr(readers, "set_io_priority", set_priority)
    monkeypatch.setattr(readers, "set_idle_io_priority", lambda: set_priority("idle"))
    _fills(monkeypatch, before=lambda path: reads.append((path, priority.get(threading.current_thread(), "normal"))))
    real_advise = os.posix_fadvise

    def advise(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:   # (the idle readers advise RANDOM: no readahead)
            hinted.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else "?")
        return real_advise(fd, offset, length, advice)
    monkeypatch.setattr(os, "posix_fadvise", advise)
    h = fs.prefetch(checkpoint, skip_resident=False, imports=trace, helper_process=False)   # priority="idle" by default
    h.wait()
    code = {p for path, p in reads if path == str(lib)}
    data = {p for path, p in reads if path != str(lib)}
    # worker threads are reused between jobs (engine.workers): a reader goes back at the class it came with
    assert h.priority == "idle" and code == {"normal"} and data == {"idle"}
    assert hinted and set(hinted) <= {str(lib), "?"}   # the checkpoint's idle reads are not hinted


def test_a_code_file_that_shrank_or_vanished_is_no_error(tmp_path, checkpoint, monkeypatch):
    """Reading ahead of the imports is best effort: a code file rewritten shorter since the trace
    was read, or removed, ends its reads quietly (the import reads its own files), and the
    checkpoint is still read."""
    shrunk, gone, after = tmp_path / "libshrunk.so", tmp_path / "libgone.so", tmp_path / "libafter.so"
    for f in (shrunk, gone, after):
        f.write_bytes(b"s" * 10_000)
    trace = tmp_path / "imports.txt"
    trace.write_text(f"{TRACE_HEADER}\n{shrunk}\n{gone}\n{after}\n")
    real_open = code_files.FileSource

    def opened(path, *a):
        if path == str(gone):
            os.unlink(gone)   # between the trace's stat and the reader's open
        return real_open(path, *a)
    monkeypatch.setattr(code_files, "FileSource", opened)
    seen = _fills(monkeypatch, before=lambda path: path == str(shrunk) and shrunk.write_bytes(b"s" * 3_000))
    monkeypatch.setattr(code_files, "CODE_THREADS", 1)   # one reader: the files after the bad ones too
    h = fs.prefetch(checkpoint, skip_resident=False, imports=trace, helper_process=False)
    h.wait(timeout=30)
    assert h.module_paths == [str(shrunk), str(gone), str(after)]
    assert (str(after), 0, 10_000) in [s[:3] for s in seen]
    assert h.bytes_done == h.nbytes == os.path.getsize(checkpoint)


def test_cancel_stops_the_code_readers_and_the_metadata_thread(tmp_path, checkpoint, monkeypatch):
    """cancel() while the trace's files are read: the remaining code files are neither opened nor
    hinted (a hint would queue the rest of the trace on the disk), and the metadata thread stops
    and is joined."""
    libs, trace = _small_files_traced(tmp_path, "lib{}.so", 50, 10_000, [tmp_path / f"d{i}" for i in range(50)])
    both_in, gate, cancelling, after_cancel = threading.Barrier(3), threading.Event(), threading.Event(), []
    real_advise, real_listdir = os.posix_fadvise, os.listdir

    def hold(path):
        if path in libs and not gate.is_set():
            both_in.wait(10)   # both code readers are here, each with one piece hinted
            gate.wait(10)

    def advise(fd, off, n, how):
        if cancelling.is_set():
            after_cancel.append(off)
        return real_advise(fd, off, n, how)

    def listdir(d):
        gate.wait(10)
        return real_listdir(d)
    monkeypatch.setattr(code_files, "CODE_THREADS", 2)
    _fills(monkeypatch, before=hold)
    monkeypatch.setattr(os, "posix_fadvise", advise)
    monkeypatch.setattr(os, "listdir", listdir)
    h = fs.prefetch(checkpoint, skip_resident=False, imports=trace)
    both_in.wait(10)
    cancelling.set()
    threading.Timer(0.2, gate.set).start()   # the two reads in flight finish their piece
    h.cancel()
    assert h.done() and after_cancel == []
    assert not _threads_named("foxhunt-prefetch-metadata")


def test_a_hot_start_skips_the_small_code_files_and_their_metadata(tmp_path, checkpoint, monkeypatch):
    """When a sample of the trace's files is all in the page cache the start is hot: the small
    files are not opened again (thousands of opens would only cost the importing thread GIL
    hand-offs) and their directories are not listed; one cold file in the sample and all are read."""
    files, trace = _small_files_traced(tmp_path, "m{}.pyc", 40, 1000, [tmp_path])
    cold: set[str] = set()
    resident = lambda p, samples=64: 0.0 if str(p) in cold else 1.0   # noqa: E731
    monkeypatch.setattr(prefetch_mod, "resident_fraction", resident)
    monkeypatch.setattr(code_files, "resident_fraction", resident)
    listed = []
    real_listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda d: (listed.append(str(d)), real_listdir(d))[1])
    h = fs.prefetch(checkpoint, imports=trace)
    h.wait_imports(timeout=30)
    h.wait()
    assert h.module_paths == [] and h.module_bytes == 0 and str(tmp_path) not in listed
    cold.add(files[0])   # the first file is always in the sample
    h = fs.prefetch(checkpoint, imports=trace)
    h.wait_imports(timeout=30)
    h.wait()
    assert h.module_paths == files and h.module_bytes == 40_000 and str(tmp_path) in listed


def test_wait_imports_returns_once_the_code_files_are_read(tmp_path, checkpoint, monkeypatch):
    """wait_imports: the trace's files are read and its metadata pass done, while the checkpoint
    may still be streaming (here held back until the wait returned)."""
    files = []
    for i in range(3):
        f = tmp_path / f"m{i}.so"
        f.write_bytes(bytes([i + 1]) * 10_000)
        files.append(str(f))
    trace = tmp_path / "imports.txt"
    trace.write_text(TRACE_HEADER + "\n" + "\n".join(files) + "\n")
    gate = threading.Event()
    _fills(monkeypatch, before=lambda path: path == checkpoint and gate.wait(10))
    h = fs.prefetch(checkpoint, skip_resident=False, threads=1, imports=trace, helper_process=False)
    try:
        h.wait_imports(timeout=10)
        assert h.module_bytes == 30_000                                  # every code file read
        assert not _threads_named("foxhunt-prefetch-modules") and not _threads_named("foxhunt-prefetch-metadata")
        assert h.bytes_done == 0 and not h.done()                       # the checkpoint still to come
    finally:
        gate.set()   # a failure above must not leave the reader held for the tests after this one
    h.wait(timeout=10)
    assert h.bytes_done == h.nbytes


def test_wait_imports_waits_for_a_metadata_pass_started_after_it_was_called(tmp_path, checkpoint, monkeypatch):
    """The code reader starts the metadata thread only once it has found the files; a wait that
    began before must still wait for that thread, not only for the reader."""
    f = tmp_path / "m.so"
    f.write_bytes(b"x" * 10_000)
    trace = tmp_path / "imports.txt"
    trace.write_text(TRACE_HEADER + "\n" + str(f) + "\n")
    finished = threading.Event()
    real_find = code_files.code_files

    def slow_find(*a, **k):   # the wait below begins before the metadata thread exists
        time.sleep(0.3)
        return real_find(*a, **k)

    def slow_metadata(*a, **k):
        time.sleep(0.5)
        finished.set()
    monkeypatch.setattr(code_files, "code_files", slow_find)
    monkeypatch.setattr(code_files, "prefetch_metadata", slow_metadata)
    h = fs.prefetch(checkpoint, skip_resident=False, imports=trace, helper_process=False)
    h.wait_imports(timeout=10)
    assert finished.is_set() and not _threads_named("foxhunt-prefetch-metadata")
    h.wait(timeout=10)


def test_wait_imports_without_code_files_returns_at_once(checkpoint):
    h = fs.prefetch(checkpoint, skip_resident=False)
    h.wait_imports(timeout=5)
    h.wait(timeout=10)


def test_the_prefetch_own_reads_are_not_noted_as_the_process(tmp_path, checkpoint, fresh_open_log):
    """The trace, the code files, the listings of the metadata thread and the checkpoint's
    pieces are foxhunt's reads, not the start's: none may land in the next trace."""
    lib = tmp_path / "pkg" / "__pycache__" / "m.cpython-311.pyc"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"x" * 5000)
    trace = tmp_path / "imports.txt"
    trace.write_text(f"{TRACE_HEADER}\n{lib}\n{tmp_path / 'listed'}{os.sep}\n")
    (tmp_path / "listed").mkdir()
    h = fs.prefetch(checkpoint, skip_resident=False, imports=trace)
    h.wait_imports(timeout=30)
    h.wait()
    ours = (str(lib), str(trace), str(tmp_path / "listed"), str(lib.parent.parent))
    assert not [p for p in fresh_open_log if p.rstrip(os.sep) in ours]


@pytest.mark.parametrize("helper", [False, True])
def test_a_traced_record_has_its_files_stat_ed_beside_the_checkpoint(tmp_path, monkeypatch, helper):
    """A trace that read a distribution's RECORD (importlib.metadata did) gets the files it lists
    stat'ed by the prefetch: on its own thread here, or by the helper process."""
    site = tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg-1.0.dist-info").mkdir()
    names = [f"pkg/m{i}.py" for i in range(40)]
    for name in names:
        (site / name).write_text("x = 1\n")
    record = site / "pkg-1.0.dist-info" / "RECORD"
    record.write_text("".join(f"{name},sha256=abc,6\n" for name in names))
    trace = tmp_path / "trace.txt"
    trace.write_text(format_trace([str(record)], {}))
    ck = str(tmp_path / "w.safetensors")
    fs.save_file({"w": np.zeros(1 << 16, np.uint8)}, ck)
    seen, handed = [], []
    real_stat, real_start = os.stat, helper_process.ChildJob.start
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: (seen.append(os.fspath(p)), real_stat(p, *a, **k))[1])
    monkeypatch.setattr(helper_process.ChildJob, "start", lambda self: (handed.append(list(self.records)),
                                                                       real_start(self))[1])
    h = fs.prefetch(ck, imports=str(trace), skip_resident=False, helper_process=helper)
    h.wait_imports(timeout=30)
    h.wait(timeout=60)
    for t in _threads_named("foxhunt-prefetch-records"):
        t.join(10)
    if helper:
        assert handed == [[str(record)]]
    else:
        assert handed == [] and {str(site / name) for name in names} <= set(seen)
    h.cancel()


def test_the_code_readers_start_before_numpy_is_imported(tmp_path, checkpoint):
    """A cold start's prefetch is its first statement: its code readers are running before the
    header parser pulls in numpy, so numpy's own files (they lead a trace) are fetched by 8
    readers while the calling thread imports it, not by that thread alone."""
    _, trace = _small_files_traced(tmp_path, "lib{}.so", 3, 1000, [])
    program = f"""
import sys, threading
events = []
real_start = threading.Thread.start
def start(self):
    events.append("thread " + self.name)
    return real_start(self)
threading.Thread.start = start
def hook(event, args):
    if event == "import" and args[0] == "numpy":
        events.append("numpy")
sys.addaudithook(hook)
import foxhunt_stream as fs
h = fs.prefetch({checkpoint!r}, imports={str(trace)!r}, helper_process=False, skip_resident=False)
h.wait()
print(repr((events, h.module_bytes)))
"""
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(fs.__file__))})
    assert out.returncode == 0, out.stderr
    events, module_bytes = eval(out.stdout.strip().splitlines()[-1])
    assert module_bytes == 3000
    assert "numpy" in events and events.index("thread foxhunt-prefetch-modules") < events.index("numpy")


# ---------------------------------------------------------------- modules=: whole packages

def test_prefetch_reads_the_modules_files_before_the_checkpoint(checkpoint, fake_package, monkeypatch):
    seen = _fills(monkeypatch)
    h = fs.prefetch(checkpoint, skip_resident=False, threads=1, chunk_bytes=8192, modules=["fhfakepkg"],
                    helper_process=False)
    h.wait()
    order = ["checkpoint" if path == checkpoint else "module" for path, *_ in seen]
    n_mod = 3 + 1 + 1   # libbig.so.12 (20 000 bytes) in three 8 KiB pieces, _ext.so, the .pyc
    assert order[:n_mod] == ["module"] * n_mod and set(order[n_mod:]) == {"checkpoint"}
    assert h.nbytes == os.path.getsize(checkpoint) == h.bytes_done and h.module_bytes == 20_000 + 5_000 + 300
    h.wait("t3")   # per-name waits still find the checkpoint's pieces


def test_prefetch_with_modules_cancels_promptly(checkpoint, fake_package, foxhunt_threads):
    h = fs.prefetch(checkpoint, skip_resident=False, threads=1, chunk_bytes=4096, modules=["fhfakepkg"])
    h.cancel()
    assert h.done() and not foxhunt_threads()


def test_prefetch_of_modules_alone_is_done_only_once_its_readers_stop(checkpoint, fake_package, monkeypatch,
                                                                      foxhunt_threads):
    """A checkpoint with nothing left to read (here: no names) and modules still being read: the
    handle is not done() yet, wait() waits for the module readers, and cancel() stops and joins
    them (no reader keeps going behind a handle that says it is done)."""
    started, release, cancelling = threading.Event(), threading.Event(), threading.Event()

    def slow(path):
        started.set()
        while not (release.is_set() or cancelling.is_set()):
            release.wait(0.01)
    _fills(monkeypatch, before=slow)
    real_cancel = code_files.TracedCodeReader.cancel
    monkeypatch.setattr(code_files.TracedCodeReader, "cancel", lambda self: (cancelling.set(), real_cancel(self)))
    h = fs.prefetch(checkpoint, names=[], skip_resident=False, threads=1, chunk_bytes=8192, modules=["fhfakepkg"])
    assert started.wait(10)
    assert not h.done()
    with pytest.raises(TimeoutError):
        h.wait(timeout=0.05)
    release.set()
    h.wait()
    assert h.done() and h.module_bytes == 20_000 + 5_000 + 300 and not foxhunt_threads()
    release.clear()
    started.clear()
    h = fs.prefetch(checkpoint, names=[], skip_resident=False, threads=1, chunk_bytes=8192, modules=["fhfakepkg"])
    assert started.wait(10)
    h.cancel()
    assert h.done() and not foxhunt_threads()


def test_prefetch_module_discovery_errors_are_best_effort(checkpoint, monkeypatch, foxhunt_threads):
    """Finding the modules' files is best effort like reading them: an error there (a file gone
    between listing and the residency check, a broken import finder) leaves the checkpoint's
    prefetch running and raises nothing on the handle or in the thread."""
    def broken(modules):
        raise RuntimeError("finder broke")
    monkeypatch.setattr(importtrace, "module_files", broken)
    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    h = fs.prefetch(checkpoint, skip_resident=False, threads=1, chunk_bytes=8192, modules=["fhfakepkg"])
    h.wait()
    assert h.done() and h.bytes_done == h.nbytes == os.path.getsize(checkpoint)
    assert errors == [] and not foxhunt_threads()


def test_prefetch_modules_must_be_a_list_of_names(checkpoint):
    with pytest.raises(TypeError, match="modules"):
        fs.prefetch(checkpoint, modules="torch")   # not the packages 't', 'o', 'r', 'c', 'h'
    with pytest.raises(ValueError, match="top-level"):
        fs.prefetch(checkpoint, modules=["torch.cuda"])
