"""prefetch(helper_process=True): the checkpoint's pieces are read into the page cache by a child
process (``startup.helper_process``) with the same readers, steps and pacing; progress,
per-tensor waits, cancel, the load's unthrottle and errors all come back to the parent's handle."""

from __future__ import annotations

import io
import json
import os
import sys
import threading
import time

import numpy as np
import pytest

import foxhunt_stream as fs
from foxhunt_stream.errors import CancelledError as Cancelled
from foxhunt_stream.errors import FormatError
from foxhunt_stream.io import source
from foxhunt_stream.io.pagecache import resident_fraction
from foxhunt_stream.startup import helper_process, prefetch as prefetch_mod
from foxhunt_stream.startup.readers import Piece
from page_cache_support import evict


@pytest.fixture
def ckpt(tmp_path):
    rng = np.random.default_rng(5)
    p = tmp_path / "w.safetensors"
    fs.save_file({f"t{i}": rng.standard_normal(1 << 18).astype(np.float32) for i in range(6)}, p)
    return str(p)


def _children_watched() -> list[threading.Thread]:
    """The threads that watch a helper process: each ends once its child has exited."""
    return [t for t in threading.enumerate() if t.name == "foxhunt-prefetch-child"]


def test_the_child_reads_every_piece(ckpt, monkeypatch):
    evict(ckpt)
    here = []
    monkeypatch.setattr(source, "fault_hook", lambda *a: here.append(a))   # this process's reads
    h = fs.prefetch(ckpt, skip_resident=False, helper_process=True, chunk_bytes=1 << 20)
    h.wait("t2", timeout=60)
    h.wait(timeout=60)   # raises if the child exited with an error or before reporting every piece
    assert h.done() and h.bytes_done == h.nbytes > 0 and h.helper_process and here == []
    assert resident_fraction(ckpt, samples=64) == 1.0


def test_cancel_stops_the_child(ckpt):
    h = fs.prefetch(ckpt, skip_resident=False, helper_process=True, max_rate=2e5, chunk_bytes=1 << 20)
    time.sleep(0.3)
    h.cancel()
    assert h.done() and h.bytes_done < h.nbytes
    assert not _children_watched()                        # gone, not left running
    with pytest.raises(Cancelled):
        h.wait(timeout=5)


def test_a_load_of_the_file_lifts_the_childs_rate_cap(ckpt):
    h = fs.prefetch(ckpt, skip_resident=False, helper_process=True, max_rate=1e5, chunk_bytes=1 << 20)
    time.sleep(0.2)
    t = time.perf_counter()
    out = fs.load_file(ckpt)                              # loader.open_sources calls pagecache.loading(path)
    h.wait(timeout=30)
    assert time.perf_counter() - t < 10                  # ~6 MB at 100 kB/s would take a minute
    assert h.bytes_done == h.nbytes and len(out) == 6


def test_advise_needs_no_helper(ckpt):
    with pytest.raises(ValueError, match="helper_process"):
        fs.prefetch(ckpt, method="advise", helper_process=True)


def test_the_child_reports_a_truncated_file_as_a_format_error(ckpt):
    size = os.path.getsize(ckpt)
    spec = {"paths": [ckpt], "sizes": [size], "threads": 1, "priority": "normal", "step": 1 << 20,
            "fast_step": 1 << 20, "max_rate": None, "report_bytes": 1,
            "pieces": [[0, 0, 4096], [0, size - 100, 4096]]}   # the second runs past the end
    r, w = os.pipe()                      # stdin stays open while it works (EOF would mean: stop)
    os.write(w, json.dumps(spec).encode() + b"\n")
    out = io.BytesIO()
    rc = helper_process.child_main(os.fdopen(r, "rb"), out)
    os.close(w)                           # its control thread reads EOF and ends
    lines = out.getvalue().splitlines()
    assert rc == 1 and lines[0] == b"d 0"
    err = json.loads(lines[-1][2:])
    assert lines[-1].startswith(b"e ") and err["type"] == "FormatError" and err["rule"] == "file-truncated"
    assert err["path"] == ckpt


def _fake_child(tmp_path, body: str):
    script = tmp_path / "child.py"
    script.write_text("import sys\nsys.stdin.readline()\n" + body)
    return [sys.executable, str(script)]


def test_an_error_line_from_the_child_is_raised_here_with_its_type(tmp_path):
    record = {"type": "FormatError", "rule": "file-truncated", "message": "short read", "path": "/x/y.safetensors"}
    cmd = _fake_child(tmp_path, f"print('d 0'); print('e ' + {json.dumps(json.dumps(record))}); sys.exit(1)")
    landed = []
    job = helper_process.ChildJob(["/x/y.safetensors"], [10], [Piece(0, 0, 4), Piece(0, 4, 4)],
                             lambda i, p, r: landed.append(i), 1, "idle", 4, 4, command=cmd).start()
    with pytest.raises(FormatError) as e:
        job.wait(timeout=30)
    assert e.value.rule == "file-truncated" and e.value.path == "/x/y.safetensors" and landed == [0]


def test_a_child_that_dies_is_an_error_naming_its_status(tmp_path):
    cmd = _fake_child(tmp_path, "sys.stderr.write('boom'); sys.exit(3)")
    job = helper_process.ChildJob(["/x"], [10], [Piece(0, 0, 4)], lambda *a: None, 1, "idle", 4, 4, command=cmd).start()
    with pytest.raises(RuntimeError, match="status 3 after 0 of 1 pieces: boom"):
        job.wait(timeout=30)


def test_code_files_first_here_then_the_checkpoint_in_the_child(ckpt, tmp_path):
    from foxhunt_stream.startup import importtrace as itrace
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"\x01" * 50_000)
    trace = tmp_path / "imports.txt"
    trace.write_text(itrace.TRACE_HEADER + "\n" + str(lib) + "\n")
    h = fs.prefetch(ckpt, skip_resident=False, helper_process=True, imports=trace)
    h.wait_imports(timeout=30)
    assert h.module_bytes == 50_000
    h.wait(timeout=60)
    assert h.bytes_done == h.nbytes and h.helper_process


def test_the_child_stats_the_files_of_the_records_it_is_given(ckpt, tmp_path, monkeypatch):
    """spec["records"] (importlib.metadata RECORDs from the import trace): the child stats every
    file they list beside its readers, and still reads and reports its pieces."""
    site = tmp_path / "site"
    (site / "p-1.dist-info").mkdir(parents=True)
    (site / "p").mkdir()
    for i in range(5):
        (site / "p" / f"m{i}.py").write_text("")
    record = site / "p-1.dist-info" / "RECORD"
    record.write_text("".join(f"p/m{i}.py,,\n" for i in range(5)))
    seen = []
    real = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: (seen.append(os.fspath(p)), real(p, *a, **k))[1])
    spec = {"paths": [ckpt], "sizes": [os.path.getsize(ckpt)], "threads": 1, "priority": "idle", "step": 1 << 20,
            "fast_step": 1 << 20, "max_rate": None, "report_bytes": 1, "no_readahead": True, "copy": False,
            "pieces": [[0, 0, 4096]], "records": [str(record)]}
    r, w = os.pipe()
    os.write(w, json.dumps(spec).encode() + b"\n")
    out = io.BytesIO()
    rc = helper_process.child_main(os.fdopen(r, "rb"), out)
    os.close(w)
    assert rc == 0 and out.getvalue().splitlines() == [b"d 0"]
    assert {str(site / "p" / f"m{i}.py") for i in range(5)} <= set(seen)


def test_an_idle_prefetch_reads_in_a_helper_by_default_and_a_normal_one_here(ckpt, monkeypatch):
    """The startup case (priority="idle", the default) keeps its ~10^3 small reads a second off
    this process's GIL: 8 readers of 1 MiB in the helper, their files' readahead off;
    priority="normal" stays here."""
    jobs = []
    real_start = helper_process.ChildJob.start
    monkeypatch.setattr(helper_process.ChildJob, "start", lambda self: (jobs.append(self), real_start(self))[1])
    idle = fs.prefetch(ckpt, skip_resident=False)
    idle.wait(timeout=60)
    assert idle.helper_process and len(jobs) == 1
    spec = jobs[0].spec
    assert spec["threads"] == min(prefetch_mod.IDLE_THREADS, fs.settings.merge().threads)
    assert spec["step"] == prefetch_mod.IDLE_STEP and spec["fast_step"] == prefetch_mod.FAST_BYTES
    assert spec["no_readahead"] and not spec["copy"] and spec["priority"] == "idle"
    normal = fs.prefetch(ckpt, skip_resident=False, priority="normal")
    normal.wait(timeout=60)
    assert not normal.helper_process and len(jobs) == 1


def test_no_helper_process_here_means_reading_in_this_one(ckpt, monkeypatch):
    """Where no child can be started (an embedded interpreter, a sandbox), the default idle
    prefetch still reads every byte, with threads of this process."""
    monkeypatch.setattr(sys, "executable", "/nonexistent/python3")
    evict(ckpt)
    h = fs.prefetch(ckpt, skip_resident=False)
    h.wait(timeout=60)
    assert not h.helper_process
    assert h.bytes_done == h.nbytes == os.path.getsize(ckpt)
    assert resident_fraction(ckpt, samples=64) == 1.0


def test_without_a_helper_the_traced_records_are_stat_ed_here(ckpt, tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "p-1.dist-info").mkdir(parents=True)
    (site / "p").mkdir()
    (site / "p" / "m.py").write_text("")
    record = site / "p-1.dist-info" / "RECORD"
    record.write_text("p/m.py,,\n")
    trace = tmp_path / "trace.txt"
    trace.write_text("# foxhunt-stream import trace v1\n" + str(record) + "\n")
    monkeypatch.setattr(sys, "executable", "/nonexistent/python3")
    seen = []
    real = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: (seen.append(os.fspath(p)), real(p, *a, **k))[1])
    h = fs.prefetch(ckpt, imports=str(trace), skip_resident=False)
    h.wait(timeout=60)
    assert not h.helper_process
    for t in [t for t in threading.enumerate() if t.name == "foxhunt-prefetch-records"]:
        t.join(10)
    assert str(site / "p" / "m.py") in seen
