"""A prefetch's checkpoint reads in a child process (``prefetch(..., helper_process=True)``).

Reader threads in the importing process take its GIL back after every ``sendfile`` call; on
the H200 machine, cold, ``import transformers`` took 15-16 s beside them against 7.2-7.8 s after
the same code replay with nothing streaming, while a stream in *another* process slowed a hot
import by only 3-11%. ``ChildJob`` runs the same pieces in ``python -m foxhunt_stream.warmchild``:
its reads never touch this process's GIL.

The protocol, one line each way: the parent writes the job as JSON, then ``fast`` when a load of
the files begins (big steps, no rate cap); closing the child's stdin stops it. The child writes
``d i,j,...`` for the pieces it finished (in batches of about ``report_bytes``, so the parent's
monitor thread wakes a few times a second) and ``e {json}`` for the error that stopped it.
``ChildJob`` offers the part of ``pipeline.Job`` that ``PrefetchHandle`` uses.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any, Callable, Sequence

from ..errors import FormatError
from ..engine.pipeline import Cancelled

REPORT_BYTES = 256 << 20


def _error_record(e: BaseException) -> dict:
    if isinstance(e, FormatError):
        return {"type": "FormatError", "rule": e.rule, "message": e.detail, "path": e.path}
    if isinstance(e, OSError):
        return {"type": "OSError", "errno": e.errno, "message": e.strerror or str(e)}
    return {"type": type(e).__name__, "message": str(e)}


def _error_from(record: dict) -> BaseException:
    if record.get("type") == "FormatError":
        return FormatError(record.get("rule", "prefetch"), record.get("message", ""), path=record.get("path"))
    if record.get("type") == "OSError":
        return OSError(record.get("errno"), record.get("message", ""))
    return RuntimeError(f"prefetch helper process: {record.get('type')}: {record.get('message')}")


class ChildJob:
    """Warms ``pieces`` (``warm.Piece`` of ``paths``) in a child process; ``on_done(i, piece,
    None)`` runs here, on a monitor thread, for each piece the child reports."""

    def __init__(self, paths: Sequence[str], sizes: Sequence[int], pieces: Sequence[Any],
                 on_done: Callable[[int, Any, Any], None], threads: int, priority: str, step: int,
                 fast_step: int, max_rate: float | None = None, command: Sequence[str] | None = None,
                 shallow: bool = False, copy: bool = False) -> None:
        self.items = pieces
        self._spec = {"paths": list(paths), "sizes": list(sizes), "threads": threads, "priority": priority,
                      "step": step, "fast_step": fast_step, "max_rate": max_rate, "report_bytes": REPORT_BYTES,
                      "shallow": shallow, "copy": copy,
                      "pieces": [[p.file, p.offset, p.length] for p in pieces]}
        self._on_done = on_done
        self._command = list(command) if command else [sys.executable, "-m", "foxhunt_stream.startup.helper_process"]
        self._proc = None   # subprocess.Popen, from start()
        self._monitor: threading.Thread | None = None
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._fast = False
        self.records: list[str] = []   # RECORD files whose listed files the child stats (set before start)
        self.error: BaseException | None = None
        if not pieces:
            self._done.set()

    def start(self) -> "ChildJob":
        if self._done.is_set() or self._cancel.is_set():
            self._done.set()
            return self
        import subprocess
        import tempfile
        try:
            self._stderr = tempfile.TemporaryFile()
            self._proc = subprocess.Popen(self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=self._stderr, close_fds=True)
            with self._lock:
                self._proc.stdin.write(json.dumps({**self._spec, "records": self.records}).encode() + b"\n")
                if self._fast:
                    self._proc.stdin.write(b"fast\n")
                self._proc.stdin.flush()
        except (OSError, ValueError) as e:
            self.error = e
            self._done.set()
            return self
        self._monitor = threading.Thread(target=self._watch, name="foxhunt-prefetch-child", daemon=True)
        self._monitor.start()
        return self

    def _watch(self) -> None:
        proc = self._proc
        landed = 0
        try:
            for line in proc.stdout:
                if line.startswith(b"d "):
                    for i in map(int, line[2:].split(b",")):
                        self._on_done(i, self.items[i], None)
                        landed += 1
                elif line.startswith(b"e ") and self.error is None:
                    self.error = _error_from(json.loads(line[2:]))
            rc = proc.wait()
            if self.error is None and self._cancel.is_set():
                self.error = Cancelled("cancelled")
            elif self.error is None and (rc != 0 or landed < len(self.items)):
                self._stderr.seek(0)
                tail = self._stderr.read()[-2000:].decode("utf-8", "replace").strip()
                self.error = RuntimeError(f"prefetch helper process exited with status {rc} after {landed} of "
                                          f"{len(self.items)} pieces" + (f": {tail}" if tail else ""))
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            self.error = self.error or e
        finally:
            self._stderr.close()
            self._done.set()

    def fast(self) -> None:
        """A load of the files began: the child takes big steps and drops its rate cap."""
        with self._lock:
            self._fast = True
            if self._proc is not None and self._proc.poll() is None:
                try:
                    self._proc.stdin.write(b"fast\n")
                    self._proc.stdin.flush()
                except (OSError, ValueError):
                    pass

    def cancel(self) -> None:
        self._cancel.set()
        with self._lock:
            if self._proc is not None:
                try:
                    self._proc.stdin.close()   # EOF: the child's readers stop after their current step
                except (OSError, ValueError):
                    pass
        if self._proc is None:
            self._done.set()

    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def spawn_failed(self) -> bool:
        """start() could not start the child (the error is in ``error``)."""
        return self._proc is None and self.error is not None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError("prefetch helper process still running")
        if self._monitor is not None:
            self._monitor.join()
        if self.error is not None:
            raise self.error


def child_main(stdin=None, stdout=None) -> int:
    """The child: read the job, warm its pieces with ``threads`` readers, report; 0 when all
    were read, 1 after an error (reported first)."""
    import numpy as np

    from ..io.source import FileSource
    from .importtrace import warm_records
    from .prefetch import READ_BYTES, Pacer, _advise_all, set_idle_io_priority

    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer
    spec = json.loads(stdin.readline())
    pieces = spec["pieces"]
    sources = {f: FileSource(p, s) for f, (p, s) in enumerate(zip(spec["paths"], spec["sizes"]))
               if any(piece[0] == f for piece in pieces)}
    pacer = Pacer(spec.get("max_rate"))
    shallow = bool(spec.get("shallow"))   # warm.IDLE_READ shallow or pread: one step queued per reader
    copy = bool(spec.get("copy"))         # ... pread: through the scratch buffer
    if shallow:
        _advise_all(sources, "POSIX_FADV_RANDOM")
    fast, stop = threading.Event(), threading.Event()
    out_lock = threading.Lock()
    pending: list[int] = []
    pending_bytes = [0]
    next_piece = iter(range(len(pieces)))
    failed: list[BaseException] = []

    def control():
        for line in stdin:
            if line.strip() == b"fast":
                if shallow:
                    _advise_all(sources, "POSIX_FADV_NORMAL")
                fast.set()
                pacer.release()
        stop.set()   # the parent closed our stdin: cancelled, or gone
        pacer.release()

    def report(force: bool = False) -> None:
        if pending and (force or pending_bytes[0] >= spec["report_bytes"]):
            stdout.write(b"d " + ",".join(map(str, pending)).encode() + b"\n")
            stdout.flush()
            pending.clear()
            pending_bytes[0] = 0

    def reader():
        if spec["priority"] == "idle":
            set_idle_io_priority()
        scratch = np.empty(max(READ_BYTES, spec["step"]) if copy else READ_BYTES, np.uint8)
        try:
            while not stop.is_set():
                with out_lock:
                    i = next(next_piece, None)
                if i is None:
                    return
                f, off, length = pieces[i]
                end = off + length
                if spec["priority"] != "idle":   # as the in-process readers do (warm._advise)
                    try:
                        os.posix_fadvise(sources[f].fd, off, length, os.POSIX_FADV_WILLNEED)
                    except (AttributeError, OSError):
                        pass
                while off < end:
                    if stop.is_set():
                        return
                    n = min(spec["fast_step"] if fast.is_set() else spec["step"], end - off)
                    pacer.take(n)
                    sources[f].warm(off, n, scratch, copy=copy and not fast.is_set())
                    off += n
                with out_lock:
                    pending.append(i)
                    pending_bytes[0] += length
                    report()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            failed.append(e)
            stop.set()

    threading.Thread(target=control, daemon=True).start()
    threads = [threading.Thread(target=reader) for _ in range(max(1, spec["threads"]))]
    if spec.get("records"):   # beside the readers: the importer stats these within seconds
        threads.append(threading.Thread(target=warm_records, args=(spec["records"], stop.is_set)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with out_lock:
        report(force=True)
        if failed:
            stdout.write(b"e " + json.dumps(_error_record(failed[0])).encode() + b"\n")
            stdout.flush()
    for src in sources.values():
        src.close()
    return 1 if failed else 0


if __name__ == "__main__":
    code = child_main()
    sys.stdout.flush()
    os._exit(code)   # not sys.exit: the control thread is blocked reading stdin, which the parent keeps open
