"""The code a start imports, read before the weights (``prefetch(..., imports=, modules=)``).

A cold start waits for its imports, not for its weights. ``CodeWarm`` reads the files an import
trace lists (``importtrace``), or whole packages, with 8 hinted readers at normal priority, warms
their directories and inodes on a thread beside them (``warm_metadata``), and then runs what was
asked to follow (``then``: the weights' readers). It is started before anything heavy is imported:
this module and ``importtrace`` import no numpy, so ``fs.prefetch``'s code readers are already
fetching numpy's own files (they lead the trace) while the calling thread imports numpy to parse
the checkpoint's headers.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, NamedTuple, Sequence

from .importtrace import _quiet, _quietly, code_files, dist_records, warm_metadata
from ..engine.pipeline import Cancelled, Job
from ..io.pagecache import resident_fraction, sendfile_to_null

log = logging.getLogger("foxhunt_stream")

CODE_THREADS = 8       # readers of the code files: what the imports wait for
READ_BYTES = 1 << 20   # a reader's buffer where sendfile cannot warm the cache
SMALL_FILE = 16 << 20  # code files below this are judged by a sample (sample_resident), not one by one
RESIDENT_SAMPLE = 32


class Piece(NamedTuple):
    """One unit of prefetch work: ``length`` bytes at ``offset`` of file number ``file`` (a code
    file here, ``CodeWarm.paths[file]``; a checkpoint file in ``warm``)."""
    file: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


def sample_resident(paths: Sequence[str], k: int = RESIDENT_SAMPLE) -> bool:
    """Whether ``k`` of ``paths``, spread evenly over the list, are all wholly in the page cache:
    then the start is hot and the small code files need not be read again."""
    if not paths:
        return False
    step = max(1, len(paths) // k)
    try:
        return all(resident_fraction(p, samples=16) >= 1.0 for p in list(paths)[::step][:k])
    except (OSError, ValueError):
        return False


def _advise(fd: int, offset: int, length: int) -> None:
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    except (AttributeError, OSError):   # a hint only: not every platform/filesystem takes it
        pass


class CodeWarm:
    """Reads ``modules``' and the ``imports`` trace's files on its own threads, starting now.

    ``wait()`` returns once they are read and their metadata warmed (``PrefetchHandle.
    wait_imports``); ``then(fn)`` runs ``fn`` when the reads are over (at once if they are);
    ``cancel()`` stops the readers after their current piece. ``paths`` and ``nbytes``: what was
    read; ``records``: the distributions' ``RECORD`` files among them (``importtrace.warm_records``)."""

    def __init__(self, modules: Sequence[str], imports: str | None, piece_bytes: int,
                 skip_resident: bool = True, advise_only: bool = False) -> None:
        self.paths: list[str] = []
        self.nbytes = 0
        self.records: list[str] = []
        self.metadata_thread: threading.Thread | None = None
        self._args = (tuple(modules), imports, piece_bytes, skip_resident)
        self._advise_only = advise_only
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._over = False
        self._then: list[Callable[[], None]] = []
        self._buffers: list[bytearray | None] = [None] * CODE_THREADS
        self.thread = threading.Thread(target=self._run, name="foxhunt-prefetch-modules", daemon=True)
        self.thread.start()

    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def then(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if not self._over:
                self._then.append(fn)
                return
        fn()

    def _run(self) -> None:
        _quiet.on = True   # the trace, the residency checks: not the process's own reads
        try:
            modules, imports, piece_bytes, skip_resident = self._args
            try:
                files, dirs = code_files(modules, imports)
                if skip_resident and files and sample_resident([p for p, _ in files]):
                    # a hot start: thousands of small opens and stats would only cost the
                    # importing thread GIL hand-offs; big files are still checked one by one
                    files, dirs = [(p, r) for p, r in files if r[-1][1] >= SMALL_FILE], []
                if (files or dirs) and not self.cancelled():   # directories and inodes on their own thread
                    self.metadata_thread = threading.Thread(
                        target=_quietly, args=(warm_metadata, [p for p, _ in files], dirs, self.cancelled),
                        name="foxhunt-prefetch-metadata", daemon=True)
                    self.metadata_thread.start()
                self.records = dist_records([p for p, _ in files])
                if skip_resident:   # big libraries already in memory (a hot start): nothing to read
                    files = [(p, r) for p, r in files
                             if r[-1][1] < SMALL_FILE or resident_fraction(p, samples=64) < 1.0]
            except Exception:   # noqa: BLE001 - best effort like the reads: the checkpoint still warms
                log.debug("prefetch: finding the modules' files failed", exc_info=True)
                files = []
            self.paths = [p for p, _ in files]
            pieces = [Piece(i, off, min(piece_bytes, b - off))
                      for i, (_, ranges) in enumerate(files) for a, b in ranges for off in range(a, b, piece_bytes)]
            if pieces and not self.cancelled():
                # the imports are waiting for these: at normal priority, hinted, a deep queue
                job = Job(pieces, self._read, CODE_THREADS, self._counted, name="foxhunt-prefetch").start()
                try:
                    job.wait()
                except BaseException:   # noqa: BLE001 - warming imports is best effort
                    pass
        finally:
            with self._lock:
                self._over = True
                then, self._then = self._then, []
            for fn in then:
                fn()

    def _counted(self, _i: int, piece: Piece, _result) -> None:
        self.nbytes += piece.length   # under the GIL; a progress figure only

    def _read(self, worker: int, piece: Piece) -> None:
        _quiet.on = True
        if self.cancelled():   # not even opened and hinted: a hint queues the whole piece
            raise Cancelled("cancelled")
        try:
            fd = os.open(self.paths[piece.file], os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return   # gone or unreadable: the import will say so, not the prefetch
        try:
            _advise(fd, piece.offset, piece.length)
            if self._advise_only or self.cancelled():
                return
            got = sendfile_to_null(fd, piece.offset, piece.length) or 0
            if got < piece.length:   # no sendfile, or it stopped part way (or end of file)
                buf = self._buffers[worker] = self._buffers[worker] or bytearray(READ_BYTES)
                view = memoryview(buf)
                for off in range(piece.offset + got, piece.end, READ_BYTES):
                    if os.preadv(fd, [view[:min(READ_BYTES, piece.end - off)]], off) <= 0:
                        return   # shorter than listed (rewritten): nothing more to warm
        except OSError:
            return   # best effort: the import reads its own files
        finally:
            os.close(fd)

    def wait(self, timeout: float | None = None) -> None:
        """Until the files are read and their directories and inodes warmed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in (self.thread, self.metadata_thread):   # the second is started by the first
            if t is not None:
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
                if t.is_alive():
                    raise TimeoutError("prefetch of the code files still running")

    def cancel(self) -> None:
        self._cancelled.set()
        self.thread.join()
        if self.metadata_thread is not None:
            self.metadata_thread.join()
