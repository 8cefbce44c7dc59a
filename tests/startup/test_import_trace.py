"""Import traces for a cold start (``startup.importtrace``): ``record_imports`` writes the code
files this process loaded, in the order a restart needs them (``prefetch(..., imports=trace)``
reads them before the checkpoint: see test_code_files.py); the audit hook that notes what Python
code opens; traces that are not what ``format_trace`` wrote; ``module_files`` of a package; and
the metadata prefetched beside the reads (directory listings, the files RECORDs list). No torch,
no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import foxhunt_stream as fs
from foxhunt_stream.startup import importtrace as itrace
from foxhunt_stream.startup.importtrace import (
    format_trace,
    merge_ranges,
    order_loaded_files,
    parse_import_trace,
    present_runs,
    read_trace,
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
    assert read_trace(trace)[0] == [(str(a), [(0, 100)]), (str(a), [(10, 30), (90, 100)])]
    assert read_trace(tmp_path / "no-trace-yet.txt")[0] == []


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


def test_prefetch_metadata_lists_each_package_once_and_stats_the_sources(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    (pkg / "__pycache__").mkdir(parents=True)
    calls: list[tuple[str, str]] = []
    real_stat, real_listdir = os.stat, os.listdir
    monkeypatch.setattr(os, "stat", lambda q, *a, **k: (calls.append(("stat", str(q))), real_stat(q, *a, **k))[1])
    monkeypatch.setattr(os, "listdir", lambda q: (calls.append(("list", str(q))), real_listdir(q))[1])
    itrace.prefetch_metadata([str(pkg / "__pycache__" / "a.cpython-312.pyc"), str(pkg / "__pycache__" / "b.cpython-312.pyc"),
                        str(pkg / "_ext.so")])
    assert calls == [("stat", str(pkg / "a.py")), ("list", str(pkg)), ("stat", str(pkg / "b.py"))]


def test_record_imports_leaves_no_debris_when_it_cannot_write(tmp_path, monkeypatch):
    target = tmp_path / "imports.txt"
    target.write_text("old trace\n")

    def broken(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        itrace.record_imports(target)
    assert target.read_text() == "old trace\n" and sorted(os.listdir(tmp_path)) == ["imports.txt"]


# ---------------------------------------------------------------- what Python code opens (audit hook)

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
        itrace.unwatch_this_thread()
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
    itrace.prefetch_metadata([str(tmp_path / "x\x00y.pyc")], [str(tmp_path / "d\x00")])   # no raise


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


def test_prefetch_record_metadata_stats_every_listed_file(tmp_path, monkeypatch):
    record, files = _fake_site(tmp_path)
    seen = []
    real = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: (seen.append(os.fspath(p)), real(p, *a, **k))[1])
    assert itrace.prefetch_record_metadata([record, str(tmp_path / "missing" / "RECORD")], threads=3) == len(files) + 1
    assert set(files) <= set(seen) and str(tmp_path / "site" / "pkg" / "gone.py") in seen
    assert itrace.prefetch_record_metadata([record], stop=lambda: True) <= 3   # cancelled: each thread stops at once


def test_module_files_lists_a_packages_libraries_and_bytecode_without_importing_it(fake_package):
    pkg, tag = fake_package
    got = itrace.module_files(["fhfakepkg", "no_such_package_fh"])
    assert [os.path.relpath(p, pkg) for p, _ in got] == [os.path.join("lib", "libbig.so.12"), "_ext.so",
                                                          os.path.join("__pycache__", f"__init__.{tag}.pyc")]
    assert [n for _, n in got] == [20_000, 5_000, 300]
    assert "fhfakepkg" not in sys.modules
    with pytest.raises(ValueError, match="top-level"):
        itrace.module_files(["fhfakepkg.sub"])
