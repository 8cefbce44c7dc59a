"""The code a start imports, read before the weights: ``TracedCodeReader`` reads a trace's files or
whole packages and stats their directories and inodes, then starts the weights' readers. No numpy:
the readers fetch numpy's files while the caller imports it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from ..engine.pipeline import Job
from ..errors import CancelledError
from ..io.pagecache import resident_fraction
from ..io.source import FileSource
from .importtrace import code_files, dist_records, prefetch_metadata, run_unwatched, unwatch_this_thread
from .readers import Piece, read_range, scratch_buffer

log = logging.getLogger("foxhunt_stream")

CODE_THREADS = 8       # readers of the code files: what the imports wait for
SMALL_FILE = 16 << 20  # code files below this are judged by a sample (sample_resident), not one by one
RESIDENT_SAMPLE = 32


def sample_resident(paths: Sequence[str], k: int = RESIDENT_SAMPLE) -> bool:
    """Whether ``k`` of ``paths``, spread over the list, are wholly in the page cache (a hot start)."""
    if not paths:
        return False
    step = max(1, len(paths) // k)
    try:
        return all(resident_fraction(p, samples=16) >= 1.0 for p in list(paths)[::step][:k])
    except (OSError, ValueError):
        return False


class TracedCodeReader:
    """Reads the code files of the ``imports`` trace and the ``modules`` packages on its own
    threads, from now. ``wait()``: until read and their metadata prefetched; ``then(fn)``: ``fn``
    once the reads are over; ``paths``, ``nbytes``, ``records``: what was read."""

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
        self._scratch: dict[int, memoryview] = {}
        self.thread = threading.Thread(target=self._run, name="foxhunt-prefetch-modules", daemon=True)
        self.thread.start()

    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def reading(self) -> bool:
        """Whether the code files are still being found or read (their metadata aside)."""
        return self.thread.is_alive()

    def then(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if not self._over:
                self._then.append(fn)
                return
        fn()

    def _run(self) -> None:
        unwatch_this_thread()   # the trace, the residency checks: not the process's own reads
        try:
            modules, imports, piece_bytes, skip_resident = self._args
            files = self._find_files(modules, imports, skip_resident)
            self.paths = [p for p, _ in files]
            pieces = [Piece(i, off, min(piece_bytes, b - off))
                      for i, (_, ranges) in enumerate(files) for a, b in ranges for off in range(a, b, piece_bytes)]
            if pieces and not self.cancelled():
                # the imports are waiting for these: at normal priority, hinted, a deep queue
                job = Job(pieces, self._read, CODE_THREADS, self._counted, name="foxhunt-prefetch",
                          setup=self._setup).start()
                try:
                    job.wait()
                except BaseException:   # noqa: BLE001 - reading ahead of the imports is best effort
                    pass
        finally:
            with self._lock:
                self._over = True
                then, self._then = self._then, []
            for fn in then:
                fn()

    def _find_files(self, modules, imports, skip_resident: bool) -> list[tuple[str, list[tuple[int, int]]]]:
        """The files to read and their ranges; starts the metadata thread and notes the RECORDs."""
        try:
            files, dirs = code_files(modules, imports)
            if skip_resident and files and sample_resident([p for p, _ in files]):
                # a hot start: small files' opens and stats would only cost the importer GIL hand-offs
                files, dirs = [(p, r) for p, r in files if r[-1][1] >= SMALL_FILE], []
            if (files or dirs) and not self.cancelled():   # directories and inodes on their own thread
                self.metadata_thread = threading.Thread(
                    target=run_unwatched, args=(prefetch_metadata, [p for p, _ in files], dirs, self.cancelled),
                    name="foxhunt-prefetch-metadata", daemon=True)
                self.metadata_thread.start()
            self.records = dist_records([p for p, _ in files])
            if skip_resident:   # big libraries already in memory (a hot start): nothing to read
                files = [(p, r) for p, r in files if r[-1][1] < SMALL_FILE or resident_fraction(p, samples=64) < 1.0]
            return files
        except Exception:   # noqa: BLE001 - best effort like the reads: the checkpoint still gets read
            log.debug("prefetch: finding the modules' files failed", exc_info=True)
            return []

    def _setup(self, worker: int) -> None:
        unwatch_this_thread()
        self._scratch[worker] = scratch_buffer()

    def _counted(self, _i: int, piece: Piece, _result) -> None:
        self.nbytes += piece.length   # under the GIL; a progress figure only

    def _read(self, worker: int, piece: Piece) -> None:
        if self.cancelled():   # not even opened (and hinted: a hint queues the whole piece)
            raise CancelledError("cancelled")
        try:
            src = FileSource(self.paths[piece.file])
        except OSError:
            return   # gone or unreadable: the import will say so, not the prefetch
        with src:   # best effort: a failed or short read ends the file; the import reads its own files
            if not read_range(src, piece.offset, piece.length, self._scratch[worker], cancelled=self.cancelled,
                              hint=True, hint_only=self._advise_only, best_effort=True, count=False):
                raise CancelledError("cancelled")

    def wait(self, timeout: float | None = None) -> None:
        """Until the files are read and their directories and inodes prefetched."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for which in ("thread", "metadata_thread"):   # the second is started by the first: looked up after it
            t = getattr(self, which)
            if t is not None:
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
                if t.is_alive():
                    raise TimeoutError("prefetch of the code files still running")

    def cancel(self) -> None:
        self._cancelled.set()
        self.thread.join()
        if self.metadata_thread is not None:
            self.metadata_thread.join()
