"""A prefetch's checkpoint reads in a child process (``helper_process=True``): reader threads in the
importing process take its GIL back after every ``sendfile``, slowing the imports about twofold.

The protocol, one line each way: the parent writes the job as JSON, then ``fast`` when a load
begins; closing the child's stdin stops it. The child writes ``d i,j,...`` for pieces finished
(in batches of about ``report_bytes``) and ``e {json}`` for the error that stopped it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any, BinaryIO, Callable, Sequence

from ..engine.pipeline import Job
from ..errors import CancelledError, FormatError
from ..io.source import FileSource
from .importtrace import prefetch_record_metadata
from .readers import Piece, PieceReaders

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
    """Reads ``pieces`` of ``paths`` into the page cache in a child process (the other options as
    for ``readers.PieceReaders``); ``on_done(i, piece, None)`` runs on a monitor thread here."""

    def __init__(self, paths: Sequence[str], sizes: Sequence[int], pieces: Sequence[Any],
                 on_done: Callable[[int, Any, Any], None], threads: int, priority: str, step: int,
                 fast_step: int, max_rate: float | None = None, command: Sequence[str] | None = None,
                 no_readahead: bool = False, copy: bool = False) -> None:
        self.items = pieces
        # the job as the child gets it (the protocol's first line; "records" added at start)
        self.spec = {"paths": list(paths), "sizes": list(sizes), "threads": threads, "priority": priority,
                      "step": step, "fast_step": fast_step, "max_rate": max_rate, "report_bytes": REPORT_BYTES,
                      "no_readahead": no_readahead, "copy": copy,
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
                self._proc.stdin.write(json.dumps({**self.spec, "records": self.records}).encode() + b"\n")
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
                self.error = CancelledError("cancelled")
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


def child_main(stdin: BinaryIO | None = None, stdout: BinaryIO | None = None) -> int:
    """The child: the job from ``stdin``, its pieces read by ``threads`` readers, reports on
    ``stdout``; 0 when all were read (or the parent stopped it), 1 after an error."""
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer
    spec = json.loads(stdin.readline())
    pieces = [Piece(*p) for p in spec["pieces"]]
    files = {p.file for p in pieces}
    sources = {f: FileSource(p, s) for f, (p, s) in enumerate(zip(spec["paths"], spec["sizes"])) if f in files}
    try:
        report = _Report(stdout, spec["report_bytes"])
        job: Job | None = None
        readers = PieceReaders(sources, lambda: job is not None and job.cancelled(), step=spec["step"],
                               fast_step=spec["fast_step"], idle=spec["priority"] == "idle",
                               hint=spec["priority"] != "idle", no_readahead=bool(spec.get("no_readahead")),
                               copy=bool(spec.get("copy")), max_rate=spec.get("max_rate"))
        job = Job(pieces, readers.work, max(1, spec["threads"]), report.landed, name="foxhunt-prefetch",
                  setup=readers.setup, teardown=readers.teardown)
        readers.start()
        threading.Thread(target=_follow_parent, args=(stdin, readers, job), daemon=True).start()
        records = None
        if spec.get("records"):   # beside the readers: the importer stats these within seconds
            records = threading.Thread(target=prefetch_record_metadata, args=(spec["records"], job.cancelled))
            records.start()
        job.start()
        error = _outcome(job)
        if records is not None:
            records.join()
        return report.finish(error)
    finally:
        for src in sources.values():
            src.close()


def _follow_parent(stdin: BinaryIO, readers: PieceReaders, job: Job) -> None:
    """The child's control thread: ``fast`` lifts the pace; the end of stdin stops the readers."""
    for line in stdin:
        if line.strip() == b"fast":
            readers.go_fast()
    job.cancel()
    readers.pacer.release()


def _outcome(job: Job) -> BaseException | None:
    """The error that stopped the readers; None when they read everything or were stopped."""
    try:
        job.wait()
    except CancelledError:
        return None
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        return e
    return None


class _Report:
    """The child's ``d`` and ``e`` lines (see the module's docstring)."""

    def __init__(self, out: BinaryIO, batch_bytes: int) -> None:
        self._out = out
        self._batch_bytes = batch_bytes
        self._lock = threading.Lock()
        self._pending: list[int] = []
        self._pending_bytes = 0

    def landed(self, i: int, piece: Piece, _result: Any) -> None:
        """A reader finished piece ``i`` (``pipeline.Job``'s ``on_done``)."""
        with self._lock:
            self._pending.append(i)
            self._pending_bytes += piece.length
            if self._pending_bytes >= self._batch_bytes:
                self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._out.write(b"d " + ",".join(map(str, self._pending)).encode() + b"\n")
            self._out.flush()
            self._pending.clear()
            self._pending_bytes = 0

    def finish(self, error: BaseException | None) -> int:
        with self._lock:
            self._flush()
            if error is not None:
                self._out.write(b"e " + json.dumps(_error_record(error)).encode() + b"\n")
                self._out.flush()
        return 1 if error is not None else 0


if __name__ == "__main__":
    code = child_main()
    sys.stdout.flush()
    os._exit(code)   # not sys.exit: the control thread is blocked reading stdin, which the parent keeps open
