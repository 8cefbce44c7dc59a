"""Import traces for a cold start: ``record_imports`` writes the code files this process loaded,
in the order a restart needs them, and ``prefetch(..., imports=trace)`` reads them before the
checkpoint, so the next start's imports find their files in memory instead of queueing on the
disk behind the weights. No torch, no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import foxhunt_stream as fs
from foxhunt_stream.startup import code_files as codewarm
from foxhunt_stream.startup import importtrace as itrace
from foxhunt_stream.startup import prefetch as warm
from foxhunt_stream.startup.importtrace import (
    format_trace,
    merge_ranges,
    order_loaded_files,
    parse_import_trace,
    present_runs,
    trace_files,
)

SP = os.path.join(os.sep, "py", "site-packages")
STD = os.path.join(os.sep, "py", "lib")


def p(*parts: str) -> str:
    return os.path.join(*parts)


def test_bytecode_stands_for_its_module_and_import_order_is_kept():
    mods = [(p(STD, "os.py"), p(STD, "__pycache__", "os.pyc")),
            (p(SP, "pkg", "__init__.py"), None),   # no bytecode written: the source is read
            (None, None),                          # built-in or frozen: no file
            (p(STD, "os.py"), p(STD, "__pycache__", "os.pyc")),   # listed twice: once
            (p(SP, "pkg", "_ext.so"), None)]
    assert order_loaded_files(mods, [], [STD, SP]) == [
        p(STD, "__pycache__", "os.pyc"), p(SP, "pkg", "__init__.py"), p(SP, "pkg", "_ext.so")]


def test_shared_libraries_go_before_the_first_module_of_their_package():
    """``import torch`` maps libtorch_cuda.so while running torch/__init__: the library is needed
    as soon as the package's first module, not at the end of the trace. Libraries of no imported
    package (CUDA's, loaded by path) come first; a library already listed as a module is not
    listed again."""
    mods = [(p(STD, "os.py"), p(STD, "os.pyc")),
            (p(SP, "torch", "__init__.py"), p(SP, "torch", "__init__.pyc")),
            (p(SP, "torch", "_C.so"), None),
            (p(SP, "numpy", "__init__.py"), p(SP, "numpy", "__init__.pyc"))]
    mapped = [p(SP, "numpy.libs", "libopenblas.so"), p(SP, "torch", "lib", "libtorch_cuda.so"),
              p(SP, "torch", "_C.so"), p(SP, "nvidia", "cublas", "lib", "libcublas.so.12"),
              p(SP, "numpy", "core", "_multiarray.so"), p(SP, "torch", "lib", "libc10.so")]
    assert order_loaded_files(mods, mapped, [SP, STD, ""]) == [
        p(SP, "numpy.libs", "libopenblas.so"), p(SP, "nvidia", "cublas", "lib", "libcublas.so.12"),
        p(STD, "os.pyc"),
        p(SP, "torch", "lib", "libtorch_cuda.so"), p(SP, "torch", "lib", "libc10.so"),
        p(SP, "torch", "__init__.pyc"), p(SP, "torch", "_C.so"),
        p(SP, "numpy", "core", "_multiarray.so"), p(SP, "numpy", "__init__.pyc")]


def test_the_longest_import_root_names_the_package():
    """A virtualenv inside a project: ``/py/site-packages`` is under ``/py``; a file there belongs to
    its site-packages package, not to a package called ``site-packages``."""
    mods = [(p(SP, "a", "__init__.py"), None), (p(SP, "b", "__init__.py"), None)]
    mapped = [p(SP, "b", "libb.so")]
    assert order_loaded_files(mods, mapped, [os.path.dirname(SP), SP]) == [
        p(SP, "a", "__init__.py"), p(SP, "b", "libb.so"), p(SP, "b", "__init__.py")]


def test_parse_skips_comments_and_blank_lines():
    assert parse_import_trace("# foxhunt-stream import trace v1\n/a.pyc\n\n/b.so\n# note\n") == [
        ("/a.pyc", None), ("/b.so", None)]


def test_file_names_with_odd_characters_survive_the_trace():
    """Only "\n" ends a line: carriage returns, form feeds, NEL and spaces at either end are legal
    in Linux file names and must come back as written."""
    odd = ["/a\rb.so", "/c\x0cd.pyc", "/e\x85f.py", "/ lead.pyc", "/trail.pyc ", "/g\u2028h.py"]
    assert parse_import_trace(format_trace(odd, {"/a\rb.so": [(0, 4096)]})) == [
        ("/a\rb.so", [(0, 4096)])] + [(p, None) for p in odd[1:]]


def test_a_trace_round_trips_with_the_ranges_of_each_library():
    text = format_trace(["/a.pyc", "/lib/b.so", "/odd\tname.so"], {"/lib/b.so": [(0, 8192), (1 << 20, 3 << 20)]})
    assert text.splitlines()[0] == itrace.TRACE_HEADER
    assert parse_import_trace(text) == [("/a.pyc", None), ("/lib/b.so", [(0, 8192), (1 << 20, 3 << 20)])]


@pytest.mark.parametrize("spec", ["0+x", "5+0", "-4+8", "12"])
def test_ranges_that_do_not_parse_mean_the_whole_file(spec):
    assert parse_import_trace(f"/lib/c.so\t{spec}\n") == [("/lib/c.so", None)]


def test_merge_ranges_joins_overlaps_and_small_gaps():
    assert merge_ranges([(100, 200), (0, 50), (150, 300), (400, 400)], gap=10) == [(0, 50), (100, 300)]
    assert merge_ranges([(0, 50), (55, 60), (1000, 2000)], gap=10) == [(0, 60), (1000, 2000)]
    assert merge_ranges([]) == []


def test_present_runs_reads_bit_63_of_pagemap_entries():
    present = np.uint64(1) << np.uint64(63)
    swapped_only = np.uint64(1) << np.uint64(62)
    e = np.array([present, present, 0, swapped_only, present, 0, present], dtype=np.uint64)
    assert present_runs(e) == [(0, 2), (4, 5), (6, 7)]
    assert present_runs(np.zeros(3, np.uint64)) == [] and present_runs(np.zeros(0, np.uint64)) == []


def test_trace_files_skips_what_is_gone_and_a_missing_trace_lists_nothing(tmp_path):
    a = tmp_path / "a.pyc"
    a.write_bytes(b"x" * 100)
    (tmp_path / "empty.pyc").write_bytes(b"")
    trace = tmp_path / "t.txt"
    trace.write_text(f"{itrace.TRACE_HEADER}\n{tmp_path / 'gone.so'}\n{a}\n{tmp_path / 'empty.pyc'}\n"
                     f"{a}\t10+20,90+50,200+10\n")   # ranges clipped to the file as it is now
    assert trace_files(trace) == [(str(a), [(0, 100)]), (str(a), [(10, 30), (90, 100)])]
    assert trace_files(tmp_path / "no-trace-yet.txt") == []


def test_record_imports_lists_this_process_code_in_import_order(tmp_path):
    """In a fresh interpreter: the trace holds foxhunt_stream's and the stdlib's bytecode (or
    source), a module imported later is listed later, and only the trace file is left behind."""
    trace = tmp_path / "sub" / "imports.txt"
    code = ("import sys; sys.path.insert(0, sys.argv[2])\n"
            "import foxhunt_stream.startup.importtrace as w\n"
            "import colorsys\n"
            "print(w.record_imports(sys.argv[1]))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(fs.__file__)))
    out = subprocess.run([sys.executable, "-c", code, str(trace), root], capture_output=True, text=True,
                         check=True, timeout=60)
    lines = trace.read_text().splitlines()
    assert lines[0] == itrace.TRACE_HEADER
    entries = parse_import_trace(trace.read_text())
    files = [f for f, _ in entries]
    assert int(out.stdout.strip()) == len(files) and len(files) == len(set(files))
    assert all(os.path.isabs(f) and os.path.isfile(f) for f in files)
    page = os.sysconf("SC_PAGE_SIZE")
    for f, ranges in entries:   # a library's touched pages: page-aligned, inside the file
        assert ranges is None or all(a % page == 0 and a < b <= os.path.getsize(f) + page for a, b in ranges)

    def index(fragment: str) -> int:
        hits = [i for i, f in enumerate(files) if fragment in f]
        assert hits, f"{fragment} not in the trace"
        return hits[0]
    assert index("colorsys.") > index(os.path.join("foxhunt_stream", ""))   # imported later: listed later
    assert sorted(os.listdir(trace.parent)) == ["imports.txt"]


def _checkpoint(tmp_path) -> str:
    rng = np.random.default_rng(0)
    path = str(tmp_path / "s.safetensors")
    fs.save_file({f"t{i}": rng.standard_normal(4096).astype(np.float32) for i in range(4)}, path)
    return path


def test_prefetch_reads_the_trace_in_order_then_the_checkpoint(tmp_path, monkeypatch):
    files = []
    for i, size in enumerate([20_000, 300, 5_000]):
        f = tmp_path / f"lib{i}.so"
        f.write_bytes(bytes([i + 1]) * size)
        files.append(str(f))
    trace = tmp_path / "imports.txt"
    trace.write_text(itrace.TRACE_HEADER + "\n" + "\n".join([files[0], str(tmp_path / "gone.pyc"), *files[1:]]) + "\n")
    path = _checkpoint(tmp_path)
    order: list[str] = []
    real_work, real_code = warm.PrefetchHandle._work, codewarm.CodeWarm._read

    def work(self, worker, piece):
        order.append("checkpoint")
        return real_work(self, worker, piece)

    def code(self, worker, piece):
        order.append(self.paths[piece.file])
        return real_code(self, worker, piece)
    monkeypatch.setattr(warm.PrefetchHandle, "_work", work)
    monkeypatch.setattr(codewarm.CodeWarm, "_read", code)
    monkeypatch.setattr(codewarm, "CODE_THREADS", 1)   # one reader: the order is the trace's
    h = fs.prefetch(path, skip_resident=False, threads=1, chunk_bytes=8192, imports=trace, helper_process=False)
    h.wait()
    assert order[:5] == [files[0]] * 3 + [files[1], files[2]]   # 20 000 bytes = three 8 KiB pieces
    assert set(order[5:]) == {"checkpoint"}
    assert h.module_bytes == 25_300 and h.bytes_done == h.nbytes == os.path.getsize(path)


def test_prefetch_reads_only_the_listed_ranges_of_a_library(tmp_path, monkeypatch):
    lib = tmp_path / "libbig.so"
    lib.write_bytes(b"L" * 100_000)
    trace = tmp_path / "imports.txt"
    trace.write_text(f"{itrace.TRACE_HEADER}\n{lib}\t0+4096,40960+20000\n")
    path = _checkpoint(tmp_path)
    read: list[tuple[int, int]] = []
    real = codewarm.CodeWarm._read

    def code(self, worker, piece):
        read.append((piece.offset, piece.length))
        return real(self, worker, piece)
    monkeypatch.setattr(codewarm.CodeWarm, "_read", code)
    monkeypatch.setattr(codewarm, "CODE_THREADS", 1)
    h = fs.prefetch(path, skip_resident=False, threads=1, chunk_bytes=8192, imports=trace)
    h.wait()
    assert read == [(0, 4096), (40960, 8192), (49152, 8192), (57344, 3616)] and h.module_bytes == 24_096


def test_warm_metadata_lists_each_package_once_and_stats_the_sources(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    (pkg / "__pycache__").mkdir(parents=True)
    calls: list[tuple[str, str]] = []
    real_stat, real_listdir = os.stat, os.listdir
    monkeypatch.setattr(os, "stat", lambda q, *a, **k: (calls.append(("stat", str(q))), real_stat(q, *a, **k))[1])
    monkeypatch.setattr(os, "listdir", lambda q: (calls.append(("list", str(q))), real_listdir(q))[1])
    itrace.warm_metadata([str(pkg / "__pycache__" / "a.cpython-312.pyc"), str(pkg / "__pycache__" / "b.cpython-312.pyc"),
                        str(pkg / "_ext.so")])
    assert calls == [("stat", str(pkg / "a.py")), ("list", str(pkg)), ("stat", str(pkg / "b.py"))]


def test_prefetch_with_modules_and_a_trace_reads_each_file_once(tmp_path, monkeypatch):
    root = tmp_path / "site"
    pkg = root / "fhtracepkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_a.so").write_bytes(b"a" * 1000)
    (pkg / "_b.so").write_bytes(b"b" * 2000)
    monkeypatch.syspath_prepend(str(root))
    trace = tmp_path / "imports.txt"
    trace.write_text(f"{itrace.TRACE_HEADER}\n{os.path.realpath(pkg / '_a.so')}\n")
    path = _checkpoint(tmp_path)
    h = fs.prefetch(path, skip_resident=False, threads=1, imports=str(trace), modules=["fhtracepkg"])
    h.wait()
    assert [os.path.basename(f) for f in h.module_paths] == ["_a.so", "_b.so"] and h.module_bytes == 3000


def test_prefetch_with_no_trace_yet_reads_the_checkpoint_only(tmp_path):
    path = _checkpoint(tmp_path)
    h = fs.prefetch(path, skip_resident=False, imports=tmp_path / "first-start.txt")
    h.wait()
    assert h.done() and h.module_paths == [] and h.bytes_done == os.path.getsize(path)
    assert not {t for t in threading.enumerate() if t.name.startswith("foxhunt-prefetch")}


def test_record_imports_leaves_no_debris_when_it_cannot_write(tmp_path, monkeypatch):
    target = tmp_path / "imports.txt"
    target.write_text("old trace\n")

    def broken(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        itrace.record_imports(target)
    assert target.read_text() == "old trace\n" and sorted(os.listdir(tmp_path)) == ["imports.txt"]


def test_code_files_are_hinted_at_normal_priority_while_the_checkpoint_idles(tmp_path, monkeypatch):
    """The imports wait for the code files: they are read with a WILLNEED hint per piece and
    outside the idle I/O class, even when the checkpoint's readers (priority="idle") are in it
    and read 1 MiB at a time without hints."""
    lib = tmp_path / "libx.so"
    lib.write_bytes(b"x" * 50_000)
    trace = tmp_path / "imports.txt"
    trace.write_text(f"{itrace.TRACE_HEADER}\n{lib}\n")
    path = _checkpoint(tmp_path)
    idle_threads, code_threads, hinted = set(), set(), []
    monkeypatch.setattr(warm, "set_idle_io_priority", lambda: idle_threads.add(threading.current_thread()) or True)
    real_code, real_advise = codewarm.CodeWarm._read, os.posix_fadvise

    def code(self, worker, piece):
        code_threads.add(threading.current_thread())
        return real_code(self, worker, piece)

    def advise(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:   # (the idle readers advise RANDOM: no readahead)
            hinted.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else "?")
        return real_advise(fd, offset, length, advice)
    monkeypatch.setattr(codewarm.CodeWarm, "_read", code)
    monkeypatch.setattr(os, "posix_fadvise", advise)
    h = fs.prefetch(path, skip_resident=False, imports=trace, helper_process=False)   # priority="idle" by default
    h.wait()
    assert h.priority == "idle" and idle_threads and code_threads and not idle_threads & code_threads
    assert hinted and set(hinted) <= {str(lib), "?"}   # the checkpoint's idle reads are not hinted


# ---------------------------------------------------------------- warming without a copy

def test_sendfile_to_null_warms_the_range_and_stops_at_end_of_file(tmp_path):
    from foxhunt_stream.io.pagecache import resident_fraction, sendfile_to_null
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(3 << 20))
    fd = os.open(f, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)   # evict, where the filesystem allows it
        evicted = resident_fraction(str(f), samples=1 << 20) < 1.0
        assert sendfile_to_null(fd, 0, 3 << 20, step=1 << 20) == 3 << 20
        if evicted:
            assert resident_fraction(str(f), samples=1 << 20) == 1.0
        assert sendfile_to_null(fd, (3 << 20) - 100, 4096) == 100   # past the end: what there is
    finally:
        os.close(fd)


def test_file_source_warm_falls_back_to_reads_and_reports_truncation(tmp_path, monkeypatch):
    import errno as _errno

    from foxhunt_stream import errors
    from foxhunt_stream.io import pagecache, source
    f = tmp_path / "blob"
    f.write_bytes(b"z" * 10_000)
    calls = []

    def no_sendfile(*a):
        calls.append(a)
        raise OSError(_errno.EINVAL, "not here")
    monkeypatch.setattr(os, "sendfile", no_sendfile)
    monkeypatch.setattr(pagecache, "_devnull", -2)
    preads = []
    real_preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: (preads.append(off), real_preadv(fd, bufs, off))[1])
    with source.FileSource(f) as src:
        src.warm(0, 10_000, np.empty(4096, np.uint8))
        assert calls and preads == [0, 4096, 8192] and src.bytes_read == 10_000
        with pytest.raises(errors.FormatError, match="file-truncated"):
            src.warm(8000, 4000, np.empty(4096, np.uint8))


def test_prefetch_takes_the_gil_back_once_per_64_mib_not_per_mib(tmp_path, monkeypatch):
    """A reader that needs the GIL after every 1 MiB read makes the importing main thread wait at
    each of its own system calls; at normal priority the checkpoint is warmed with one call per
    64 MiB piece."""
    from foxhunt_stream.io import pagecache, source
    path = str(tmp_path / "big.safetensors")
    fs.save_file({"w": np.zeros(40 << 20, np.uint8), "v": np.zeros(100, np.uint8)}, path)
    calls = []
    real = source.FileSource.warm
    monkeypatch.setattr(source.FileSource, "warm", lambda self, off, n, buf, copy=False: (calls.append(n), real(self, off, n, buf, copy))[1])
    h = fs.prefetch(path, skip_resident=False, chunk_bytes=128 << 20, priority="normal")
    h.wait()
    assert sum(calls) == h.nbytes == os.path.getsize(path) and len(calls) == 1


def test_idle_readers_take_small_steps_until_a_load_begins(tmp_path, monkeypatch):
    """priority="idle": 4 MiB per call, so the kernel's readahead does not keep the disk's queue
    full in front of the imports; once a load of the file starts, 64 MiB per call."""
    from foxhunt_stream.io import pagecache, source
    path = str(tmp_path / "big.safetensors")
    fs.save_file({"w": np.zeros(40 << 20, np.uint8)}, path)
    calls = []
    real = source.FileSource.warm
    monkeypatch.setattr(source.FileSource, "warm", lambda self, off, n, buf, copy=False: (calls.append(n), real(self, off, n, buf, copy))[1])
    h = fs.prefetch(path, skip_resident=False, chunk_bytes=128 << 20, helper_process=False)
    h.wait()
    assert sum(calls) == h.nbytes and max(calls) == warm.PACED_BYTES
    steps = {}
    for prio, rate in (("idle", None), ("normal", None), ("normal", 1e9)):
        h = fs.prefetch(path, names=[], priority=prio, max_rate=rate, helper_process=False)
        before = h._step()
        h.unthrottle()   # what loading(path) does when a load opens the file
        steps[prio, rate] = (before, h._step())
    big, small = warm.WARM_BYTES, warm.PACED_BYTES
    assert steps == {("idle", None): (small, big), ("normal", None): (big, big), ("normal", 1e9): (small, big)}


# ---------------------------------------------------------------- what Python code opens (audit hook)

@pytest.fixture
def fresh_open_log(monkeypatch):
    monkeypatch.setattr(itrace, "_opened", [])
    return itrace._opened


def test_the_audit_hook_notes_reads_and_listings_only(tmp_path, fresh_open_log):
    f = str(tmp_path / "a.json")
    itrace._audit("open", (f, "r", 0))
    itrace._audit("open", (f + "2", None, os.O_RDONLY | os.O_CLOEXEC))
    for mode in ("w", "ab", "r+", "x"):
        itrace._audit("open", (str(tmp_path / f"w{mode}"), mode, 0))
    itrace._audit("open", (str(tmp_path / "wo"), None, os.O_WRONLY | os.O_CREAT))
    itrace._audit("open", (3, "rb", 0))                      # an fd, not a path
    itrace._audit("open", ("/proc/self/maps", "r", 0))        # not a file on a disk
    itrace._audit("os.listdir", (str(tmp_path),))
    itrace._audit("os.scandir", (None,))
    itrace._audit("compile", (b"x", "<string>"))
    assert fresh_open_log == [f, f + "2", str(tmp_path) + os.sep]


def test_reader_threads_opens_are_not_the_process(tmp_path, fresh_open_log):   # tmp_path made first: its
    # creation lists a directory, which an audit hook left installed by an earlier test would note
    def reader():
        itrace._quiet.on = True
        itrace._audit("open", (str(tmp_path / "checkpoint-piece"), None, os.O_RDONLY))
    t = threading.Thread(target=reader)
    t.start()
    t.join()
    assert fresh_open_log == []


def test_opened_files_are_real_small_regular_files_first_use_first(tmp_path, fresh_open_log, monkeypatch):
    a, b, big, st = tmp_path / "a.txt", tmp_path / "b.pyc", tmp_path / "big.bin", tmp_path / "m.safetensors"
    for f in (a, b, st):
        f.write_bytes(b"x" * 10)
    big.write_bytes(b"x" * 2000)
    link = tmp_path / "link.txt"
    link.symlink_to(a)
    monkeypatch.setattr(itrace, "DATA_FILE_LIMIT", 1000)
    fresh_open_log += [str(b), str(link), str(a), str(big), str(st), str(tmp_path / "gone"), str(tmp_path) + os.sep,
                       str(b)]
    assert itrace.opened_files() == ([os.path.realpath(b), os.path.realpath(a)], [str(tmp_path)])


def test_read_trace_separates_directories(tmp_path):
    a = tmp_path / "a.pyc"
    a.write_bytes(b"x" * 10)
    trace = tmp_path / "t.txt"
    trace.write_text(f"{itrace.TRACE_HEADER}\n{tmp_path}{os.sep}\n{a}\n{tmp_path}\n")   # a directory without the mark: skipped
    assert itrace.read_trace(trace) == ([(str(a), [(0, 10)])], [str(tmp_path)])


def test_a_recorded_trace_holds_the_files_and_directories_the_start_read(tmp_path):
    data = tmp_path / "config.json"
    data.write_text("{}")
    listed = tmp_path / "plugins"
    listed.mkdir()
    trace = tmp_path / "imports.txt"
    code = ("import sys, os; sys.path.insert(0, sys.argv[2])\n"
            "import foxhunt_stream.startup.importtrace as w\n"
            "w.watch_opens()\n"
            "import colorsys\n"
            "open(sys.argv[3]).read(); os.listdir(sys.argv[4])\n"
            "open(sys.argv[3] + '.out', 'w').write('x')\n"
            "w.record_imports(sys.argv[1])\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(fs.__file__)))
    subprocess.run([sys.executable, "-c", code, str(trace), root, str(data), str(listed)], check=True, timeout=60)
    files, dirs = itrace.read_trace(trace)
    paths = [p for p, _ in files]
    assert os.path.realpath(data) in paths and os.path.realpath(str(data) + ".out") not in paths
    assert str(listed) in dirs
    colorsys_at = [i for i, p in enumerate(paths) if "colorsys" in p]
    assert colorsys_at and colorsys_at[0] < paths.index(os.path.realpath(data))   # in the order they were read


# ---------------------------------------------------------------- max_rate: leave the disk to the imports

def test_pacer_spaces_reads_at_the_rate_until_released():
    now = [100.0]
    p = warm.Pacer(1000.0, clock=lambda: now[0])
    waits = []
    p._released.wait = lambda t: waits.append(round(t, 6)) or False
    p.take(500)            # due at once
    p.take(500)            # due 0.5 s later
    now[0] += 0.2
    p.take(1000)           # due at 101.0
    assert waits == [0.5, 0.8]
    now[0] += 5.0          # idle for a while: no burst credit beyond "now"
    p.take(100)
    assert waits == [0.5, 0.8]
    p.release()
    p.take(10 ** 9)
    assert waits == [0.5, 0.8] and p.released
    assert warm.Pacer(None).released
    for bad in (0, -5, float("nan")):
        with pytest.raises(ValueError, match="max_rate"):
            warm.Pacer(bad)


def test_a_paced_prefetch_reads_in_small_steps(tmp_path, monkeypatch):
    path = _checkpoint(tmp_path)
    steps = []
    real = warm.Pacer.take
    monkeypatch.setattr(warm.Pacer, "take", lambda self, n: (steps.append(n), real(self, n))[1])
    h = fs.prefetch(path, skip_resident=False, max_rate=1e12, helper_process=False)
    h.wait()
    assert sum(steps) == h.nbytes and max(steps) <= warm.PACED_BYTES


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


def test_bad_max_rate_is_refused_before_anything_opens(tmp_path):
    path = _checkpoint(tmp_path)
    with pytest.raises(ValueError, match="max_rate"):
        fs.prefetch(path, max_rate=0)
    assert not {t for t in threading.enumerate() if t.name.startswith("foxhunt-prefetch")}


# ---------------------------------------------------------------- traces that are not what format_trace wrote

def test_a_garbage_trace_is_read_line_by_line_and_never_raises(tmp_path):
    """A trace is a hint: binary garbage, a NUL in a line, an unreadable trace must cost only their
    own lines (before: UnicodeDecodeError / ValueError, and the prefetch dropped every code file,
    the ``modules=`` packages' too)."""
    a, b = tmp_path / "a.pyc", tmp_path / "b.pyc"
    a.write_bytes(b"x" * 10)
    b.write_bytes(b"y" * 20)
    trace = tmp_path / "t.txt"
    trace.write_bytes(itrace.TRACE_HEADER.encode() + b"\n" + os.fsencode(a) + b"\n\xff\xfe\x80garbage\n"
                      + os.fsencode(tmp_path) + b"/x\x00y\n" + os.fsencode(tmp_path) + b"/d\x00/\n"
                      + os.fsencode(b) + b"\t0+5\n")
    assert itrace.read_trace(trace) == ([(str(a), [(0, 10)]), (str(b), [(0, 5)])], [])
    assert itrace.read_trace(tmp_path) == ([], [])   # a directory, not a trace
    itrace.warm_metadata([str(tmp_path / "x\x00y.pyc")], [str(tmp_path / "d\x00")])   # no raise


def test_a_file_name_that_is_not_utf8_round_trips_through_a_trace(tmp_path, fresh_open_log):
    odd = tmp_path / os.fsdecode(b"caf\xe9.json")   # Latin-1 bytes: surrogate-escaped in Python
    odd.write_bytes(b"{}")
    fresh_open_log.append(str(odd))
    trace = tmp_path / "imports.txt"
    itrace.record_imports(trace)   # before: UnicodeEncodeError, and no trace at all
    assert str(odd) in [p for p, _ in itrace.read_trace(trace)[0]]


def test_the_audit_hook_never_raises_and_its_log_is_bounded(tmp_path, fresh_open_log, monkeypatch):
    """The hook stays installed for the life of the process and sees every thread's opens: an
    "open" event raised with other arguments (``sys.audit`` is public) must not make the audited
    call fail, and a server that keeps opening files must not grow the log without end."""
    itrace._audit("open", ("only-a-path",))   # before: ValueError out of the caller's open
    itrace._audit("os.listdir", 42)
    monkeypatch.setattr(itrace, "OPENED_LIMIT", 100)
    for i in range(1000):
        itrace._audit("open", (str(tmp_path / f"request-{i}.json"), "r", 0))
    assert len(fresh_open_log) == 100 and fresh_open_log[0] == str(tmp_path / "request-0.json")


def _small_files_traced(tmp_path, pattern: str, n: int, size: int, dirs=()):
    """``n`` files of ``size`` bytes and a trace listing them, then ``dirs`` (to be listed)."""
    files = []
    for i in range(n):
        f = tmp_path / pattern.format(i)
        f.write_bytes(b"c" * size)
        files.append(str(f))
    trace = tmp_path / "imports.txt"
    trace.write_text(itrace.TRACE_HEADER + "\n" + "".join(f + "\n" for f in files)
                     + "".join(f"{d}{os.sep}\n" for d in dirs))
    return files, trace


def test_cancel_stops_the_code_readers_and_the_metadata_thread(tmp_path, monkeypatch):
    """cancel() while the trace's files are read: the remaining code files are neither opened nor
    hinted (before: each got a WILLNEED hint after cancel, queueing the rest of the trace on the
    disk), and the metadata thread stops and is joined (before: it went on listing)."""
    libs, trace = _small_files_traced(tmp_path, "lib{}.so", 50, 10_000, [tmp_path / f"d{i}" for i in range(50)])
    path = _checkpoint(tmp_path)
    both_in, gate, cancelling, after_cancel = threading.Barrier(3), threading.Event(), threading.Event(), []
    real_sendfile, real_advise, real_listdir = codewarm.sendfile_to_null, os.posix_fadvise, os.listdir

    def sendfile(*a):
        if not gate.is_set():
            both_in.wait(10)   # both code readers are here, each with one piece hinted
            gate.wait(10)
        return real_sendfile(*a)

    def advise(fd, off, n, how):
        if cancelling.is_set():
            after_cancel.append(off)
        return real_advise(fd, off, n, how)

    def listdir(d):
        gate.wait(10)
        return real_listdir(d)
    monkeypatch.setattr(codewarm, "CODE_THREADS", 2)
    monkeypatch.setattr(codewarm, "sendfile_to_null", sendfile)
    monkeypatch.setattr(os, "posix_fadvise", advise)
    monkeypatch.setattr(os, "listdir", listdir)
    h = fs.prefetch(path, skip_resident=False, imports=trace)
    both_in.wait(10)
    cancelling.set()
    threading.Timer(0.2, gate.set).start()   # the two reads in flight finish their piece
    h.cancel()
    assert h.done() and after_cancel == []
    assert not [t for t in threading.enumerate() if t.name == "foxhunt-prefetch-metadata"]


def test_sendfile_that_stops_part_way_is_finished_with_reads(tmp_path, monkeypatch):
    """A filesystem where sendfile fails after some bytes (EINVAL part way): the rest is read
    with pread, not reported as a failed prefetch (before: the OSError ended the whole prefetch)."""
    import errno as _errno

    from foxhunt_stream.io import pagecache, source
    f = tmp_path / "blob"
    f.write_bytes(b"z" * 10_000)
    real_sendfile, calls = os.sendfile, []

    def flaky(out, fd, off, n):
        calls.append(off)
        if len(calls) == 1:
            return real_sendfile(out, fd, off, 4096)
        raise OSError(_errno.EINVAL, "not any more")
    monkeypatch.setattr(os, "sendfile", flaky)
    preads = []
    real_preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: (preads.append(off), real_preadv(fd, bufs, off))[1])
    with source.FileSource(f) as src:
        src.warm(0, 10_000, np.empty(4096, np.uint8))
        assert calls == [0, 4096] and preads == [4096, 8192] and src.bytes_read == 10_000


def test_reader_threads_starting_together_open_dev_null_once(tmp_path, monkeypatch):
    import time

    from foxhunt_stream.io import pagecache, source
    f = tmp_path / "blob"
    f.write_bytes(b"z" * 1000)
    monkeypatch.setattr(pagecache, "_devnull", -2)
    real_open, opened = os.open, []

    def slow_open(path, *a, **k):
        fd = real_open(path, *a, **k)
        if path == os.devnull:
            opened.append(fd)
            time.sleep(0.05)
        return fd
    monkeypatch.setattr(os, "open", slow_open)
    fd = real_open(f, os.O_RDONLY)
    start = threading.Barrier(8)
    threads = [threading.Thread(target=lambda: (start.wait(), pagecache.sendfile_to_null(fd, 0, 1000))) for _ in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(opened) == 1   # before: one per thread, all but the last leaked
    finally:
        os.close(fd)
        for d in opened:
            os.close(d)


def test_the_prefetch_own_reads_are_not_noted_as_the_process(tmp_path, fresh_open_log):
    """The trace, the code files, the listings of the metadata thread and the checkpoint's
    pieces are foxhunt's reads, not the start's: none may land in the next trace (before this
    test, dropping ``_quiet.on`` from every prefetch thread failed nothing)."""
    lib = tmp_path / "pkg" / "__pycache__" / "m.cpython-311.pyc"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"x" * 5000)
    trace = tmp_path / "imports.txt"
    trace.write_text(f"{itrace.TRACE_HEADER}\n{lib}\n{tmp_path / 'listed'}{os.sep}\n")
    (tmp_path / "listed").mkdir()
    path = _checkpoint(tmp_path)
    h = fs.prefetch(path, skip_resident=False, imports=trace)
    h.wait()
    for t in threading.enumerate():
        if t.name == "foxhunt-prefetch-metadata":
            t.join(10)
    ours = (str(lib), str(trace), str(tmp_path / "listed"), str(lib.parent.parent))
    assert not [p for p in fresh_open_log if p.rstrip(os.sep) in ours]


def test_a_pacer_rate_must_be_a_number_not_a_flag():
    with pytest.raises(ValueError, match="max_rate"):
        warm.Pacer(True)


def test_sendfile_never_writes_into_a_descriptor_that_is_no_longer_dev_null(tmp_path, monkeypatch):
    """Something closed our /dev/null descriptor and the number now names a file: the next warm
    must notice (fstat) and open /dev/null again instead of sending checkpoint bytes there."""
    from foxhunt_stream.io import pagecache, source
    src = tmp_path / "src.bin"
    src.write_bytes(b"s" * 100_000)
    victim = tmp_path / "victim.txt"
    fd = os.open(src, os.O_RDONLY)
    try:
        assert pagecache.sendfile_to_null(fd, 0, 100_000) == 100_000
        null = pagecache._devnull
        other = os.open(victim, os.O_WRONLY | os.O_CREAT, 0o600)
        os.dup2(other, null)   # the number now names victim.txt, as after a close and a reuse
        os.close(other)
        try:
            assert pagecache.sendfile_to_null(fd, 0, 100_000) == 100_000
            assert victim.stat().st_size == 0 and pagecache._devnull != null
        finally:
            os.close(null)
    finally:
        os.close(fd)


def test_a_hot_start_skips_the_small_code_files_and_their_metadata(tmp_path, monkeypatch):
    """When a sample of the trace's files is all in the page cache the start is hot: the small
    files are not opened again (thousands of opens would only cost the importing thread GIL
    hand-offs) and no metadata thread starts; one cold file in the sample and all are read."""
    files, trace = _small_files_traced(tmp_path, "m{}.pyc", 40, 1000, [tmp_path])
    path = _checkpoint(tmp_path)
    cold: set[str] = set()
    resident = lambda p, samples=64: 0.0 if str(p) in cold else 1.0   # noqa: E731
    monkeypatch.setattr(warm, "resident_fraction", resident)
    monkeypatch.setattr(codewarm, "resident_fraction", resident)
    h = fs.prefetch(path, imports=trace)
    h.wait()
    assert h.module_paths == [] and h.module_bytes == 0 and h._metadata_thread is None
    cold.add(files[0])   # the first file is always in the sample
    h = fs.prefetch(path, imports=trace)
    h.wait()
    assert h.module_paths == files and h.module_bytes == 40_000


def test_wait_imports_returns_once_the_code_files_are_read(tmp_path, monkeypatch):
    """wait_imports: the trace's files are read and its metadata pass done, while the checkpoint
    may still be streaming (here held back until the wait returned)."""
    files = []
    for i in range(3):
        f = tmp_path / f"m{i}.so"
        f.write_bytes(bytes([i + 1]) * 10_000)
        files.append(str(f))
    trace = tmp_path / "imports.txt"
    trace.write_text(itrace.TRACE_HEADER + "\n" + "\n".join(files) + "\n")
    path = _checkpoint(tmp_path)
    gate = threading.Event()
    real_work = warm.PrefetchHandle._work

    def held(self, worker, piece):
        assert gate.wait(10)
        return real_work(self, worker, piece)
    monkeypatch.setattr(warm.PrefetchHandle, "_work", held)
    h = fs.prefetch(path, skip_resident=False, threads=1, imports=trace)
    h.wait_imports(timeout=10)
    assert h.module_bytes == 30_000                                  # every code file read
    assert not h._modules_thread.is_alive()
    assert h._metadata_thread is None or not h._metadata_thread.is_alive()
    assert h.bytes_done == 0 and not h.done()                       # the checkpoint still to come
    gate.set()
    h.wait(timeout=10)
    assert h.bytes_done == h.nbytes


def test_wait_imports_without_code_files_returns_at_once(tmp_path):
    h = fs.prefetch(_checkpoint(tmp_path), skip_resident=False)
    h.wait_imports(timeout=5)
    h.wait(timeout=10)


@pytest.mark.parametrize("helper", [False, True])
def test_idle_pread_mode_queues_one_step_until_a_load_begins(tmp_path, monkeypatch, helper):
    """warm.IDLE_READ = "pread": the idle readers' files are advised POSIX_FADV_RANDOM and read
    through a buffer (no readahead, so one step queued per reader); unthrottle() advises
    POSIX_FADV_NORMAL again. The bytes still land, in process or in the helper."""
    from foxhunt_stream.io import pagecache, source
    path = str(tmp_path / "big.safetensors")
    data = np.arange(6 << 20, dtype=np.uint8)
    fs.save_file({"w": data}, path)
    monkeypatch.setattr(warm, "IDLE_READ", "pread")
    monkeypatch.setattr(warm, "PACED_BYTES", 1 << 20)
    advised, copies = [], []
    real_advise, real_warm = os.posix_fadvise, source.FileSource.warm
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, a: (advised.append(a), real_advise(fd, off, n, a))[1])
    monkeypatch.setattr(source.FileSource, "warm",
                        lambda self, off, n, buf, copy=False: (copies.append((n, copy)), real_warm(self, off, n, buf, copy))[1])
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


def test_idle_pread_mode_is_off_for_normal_priority(tmp_path, monkeypatch):
    path = str(tmp_path / "w.safetensors")
    fs.save_file({"w": np.zeros(1 << 20, np.uint8)}, path)
    monkeypatch.setattr(warm, "IDLE_READ", "pread")
    assert fs.prefetch(path, names=[], priority="idle")._shallow
    assert not fs.prefetch(path, names=[], priority="normal")._shallow
    assert not fs.prefetch(path, names=[], priority="idle", method="advise")._shallow


# ---------------------------------------------------------------- what importlib.metadata stats (RECORD files)

def test_record_paths_are_made_absolute_against_the_dist_infos_parent():
    rec = "/sp/foo-1.0.dist-info/RECORD"
    text = 'foo/__init__.py,sha256=x,10\n"foo/a,b.py",,\n../../bin/foo,,\nfoo-1.0.dist-info/RECORD,,\n\n'
    assert itrace.record_paths(rec, text) == ["/sp/foo/__init__.py", "/sp/foo/a,b.py", "/bin/foo",
                                              "/sp/foo-1.0.dist-info/RECORD"]
    assert itrace.dist_records(["/sp/foo-1.0.dist-info/RECORD", "/sp/foo/RECORD", "/sp/x.dist-info/METADATA"]) \
        == ["/sp/foo-1.0.dist-info/RECORD"]


def _fake_site(tmp_path, n=40):
    site = tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg-1.0.dist-info").mkdir()
    names = [f"pkg/m{i}.py" for i in range(n)]
    for name in names:
        (site / name).write_text("x = 1\n")
    record = site / "pkg-1.0.dist-info" / "RECORD"
    record.write_text("".join(f"{name},sha256=abc,6\n" for name in names) + "pkg/gone.py,,\n")
    return str(record), sorted(str(site / name) for name in names)


def test_warm_records_stats_every_listed_file(tmp_path, monkeypatch):
    record, files = _fake_site(tmp_path)
    seen = []
    real = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: (seen.append(os.fspath(p)), real(p, *a, **k))[1])
    assert itrace.warm_records([record, str(tmp_path / "missing" / "RECORD")], threads=3) == len(files) + 1
    assert set(files) <= set(seen) and str(tmp_path / "site" / "pkg" / "gone.py") in seen
    assert itrace.warm_records([record], stop=lambda: True) <= 3   # cancelled: each thread stops at once


@pytest.mark.parametrize("helper", [False, True])
def test_a_traced_record_is_warmed_beside_the_checkpoint(tmp_path, monkeypatch, helper):
    """A trace that read a distribution's RECORD (importlib.metadata did) gets the files it lists
    stat'ed by the prefetch: on its own thread here, or by the helper process."""
    record, files = _fake_site(tmp_path)
    trace = tmp_path / "trace.txt"
    trace.write_text(format_trace([record], {}))
    ck = str(tmp_path / "w.safetensors")
    fs.save_file({"w": np.zeros(1 << 16, np.uint8)}, ck)
    seen = []
    real = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: (seen.append(os.fspath(p)), real(p, *a, **k))[1])
    h = fs.prefetch(ck, imports=str(trace), skip_resident=False, helper_process=helper)
    h.wait_imports(timeout=30)
    h.wait(timeout=60)
    if helper:
        assert h._job.records == [record] and h._records_thread is None
    else:
        h._records_thread.join(10)
        assert set(files) <= set(seen)
    h.cancel()


def test_the_code_readers_start_before_numpy_is_imported(tmp_path):
    """A cold start's prefetch is its first statement: its code readers are running before the
    header parser pulls in numpy, so numpy's own files (they lead a trace) are fetched by 8
    readers while the calling thread imports it, not by that thread alone."""
    libs, trace = _small_files_traced(tmp_path, "lib{}.so", 3, 1000, [])
    path = _checkpoint(tmp_path)
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
h = fs.prefetch({path!r}, imports={str(trace)!r}, helper_process=False, skip_resident=False)
h.wait()
print(repr((events, h.module_bytes)))
"""
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(fs.__file__))})
    assert out.returncode == 0, out.stderr
    events, module_bytes = eval(out.stdout.strip().splitlines()[-1])
    assert module_bytes == 3000
    assert "numpy" in events and events.index("thread foxhunt-prefetch-modules") < events.index("numpy")
