"""Filling the page cache with a checkpoint before its load: ``prefetch`` (docs/startup.md).

Needs neither torch nor cupy, so it can be a server's first statement: readers pull the code
the imports need (``code_files``), then the weights, into the page cache, where a later load
finds them (``pagecache``).
"""

from __future__ import annotations

import bisect
import logging
import os
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Sequence

from .. import settings as _settings
from ..engine.pipeline import Job
from ..io import pagecache, read_policy
from ..io.pagecache import resident_fraction
from ..io.source import FileSource, open_source
from .code_files import TracedCodeReader
from .helper_process import ChildJob
from .importtrace import merge_ranges, prefetch_record_metadata, run_unwatched, watch_opens
from .readers import Pacer, Piece, PieceReaders

if TYPE_CHECKING:
    from ..io.checkpoint import Checkpoint, Names

log = logging.getLogger("foxhunt_stream")

FAST_BYTES = 64 << 20  # bytes per call once nothing holds the readers back: the GIL is taken back once per this many
PACED_BYTES = 4 << 20  # ... for idle readers in this process, or while max_rate holds them back (see _first_step)
IDLE_STEP = 1 << 20    # ... for idle readers in the helper process (no GIL of ours to take back)
METHODS = ("read", "advise")
PRIORITIES = ("idle", "normal")
DEFAULT_THREADS = 8    # readers when the caller names none (at most the loader's thread count)
IDLE_THREADS = 8       # ... with priority="idle", in the helper process: 8 x 1 MiB queued at most
IDLE_THREADS_IN_PROCESS = 2   # ... in this process (helper_process=False): each takes our GIL back per step
# How idle readers read until a load begins: sendfile with or without the kernel's readahead, or
# pread through a buffer; without readahead a cold start took 16 s, not 20-25 s (RESULTS.md).
IDLE_READ_MODE = "sendfile-no-readahead"
IDLE_READ_MODES = ("sendfile-readahead", "sendfile-no-readahead", "pread-no-readahead")


def plan_pieces(spans: Sequence[Sequence[tuple[int, int]]], piece_bytes: int) -> list[Piece]:
    """Pure: per file, merge the ``(start, end)`` byte spans and cut them into pieces of at most
    ``piece_bytes``, ordered by file then offset (the order a load reads in)."""
    if piece_bytes <= 0:
        raise ValueError("piece size must be positive")
    return [Piece(f, off, min(piece_bytes, end - off)) for f, file_spans in enumerate(spans)
            for start, end in merge_ranges(file_spans, gap=0) for off in range(start, end, piece_bytes)]


def _spans(ck: Checkpoint, chosen: list[str], whole_files: bool) -> list[list[tuple[int, int]]]:
    if whole_files:   # headers too: the loader reads them again
        return [[(0, h.file_size)] for h in ck.headers]
    spans: list[list[tuple[int, int]]] = [[] for _ in ck.paths]
    for n in chosen:
        f, info = ck.names[n]
        base = ck.headers[f].data_start
        spans[f].append((base + info.start, base + info.end))
    return spans


def _name_pieces(ck: Checkpoint, chosen: list[str], pieces: list[Piece]) -> dict[str, tuple[int, int]]:
    """Pure: per tensor name, the range ``[a, b)`` of ``pieces`` that holds its bytes."""
    keys = [(p.file, p.offset) for p in pieces]
    out: dict[str, tuple[int, int]] = {}
    for n in chosen:
        f, info = ck.names[n]
        base = ck.headers[f].data_start
        start, end = base + info.start, base + info.end
        # pieces overlapping [start, end): from the last piece starting at or before start
        a = max(0, bisect.bisect_right(keys, (f, start)) - 1)
        while a < len(pieces) and (pieces[a].file, pieces[a].end) <= (f, start):
            a += 1
        b = bisect.bisect_left(keys, (f, end))
        out[n] = (a, max(a, b))
    return out


class PrefetchHandle:
    """A prefetch in flight: ``wait()`` / ``wait(name)`` (re-raising a reader's error),
    ``done()``, ``cancel()`` (stops the readers and joins them)."""

    def __init__(self, ck: Checkpoint, pieces: list[Piece], sources: dict[int, FileSource],
                 name_pieces: dict[str, tuple[int, int]], threads: int, method: str,
                 priority: str = "normal", code: TracedCodeReader | None = None,
                 max_rate: float | None = None, helper_process: bool = False, skipped: Sequence[str] = ()) -> None:
        self.paths = list(ck.paths)
        self.skipped = list(skipped)   # files a load would read around the page cache: not prefetched
        self.pieces = pieces
        self.nbytes = sum(p.length for p in pieces)
        self.priority = priority
        self._code = code   # the code files, read first (started by prefetch before this handle)
        self._real_paths = {os.path.realpath(p) for p in ck.paths if p not in self.skipped}
        self._sources = sources
        self._name_pieces = name_pieces
        self._method = method
        self._max_rate = max_rate
        self._landed = bytearray(len(pieces))
        self._remaining = len(pieces)
        self._bytes_done = 0
        self._cond = threading.Condition()
        self._loading = False
        self._closer = weakref.finalize(self, _close_sources, sources)
        self._helper = helper_process
        self._no_readahead = priority == "idle" and IDLE_READ_MODE != "sendfile-readahead" and method == "read"
        self._copy = self._no_readahead and IDLE_READ_MODE == "pread-no-readahead"
        self._threads = threads
        self._readers: PieceReaders | None = None   # the in-process readers (not with a helper process)
        self._job_lock = threading.Lock()   # held while a failed helper is swapped for threads (_start_job)
        if helper_process:   # the checkpoint's reads in a child process: none of them takes our GIL
            self._job: Job | ChildJob = ChildJob(
                ck.paths, [h.file_size for h in ck.headers], pieces, self._on_done, threads, priority,
                self._first_step(), FAST_BYTES, max_rate, no_readahead=self._no_readahead, copy=self._copy)
        else:
            self._job = self._threads_job()
        if not pieces:
            self._closer()
        pagecache.register_prefetch(self)   # a load of these files reads through the cache, and unpaces us
        self._records_thread: threading.Thread | None = None    # prefetch_record_metadata here, not waited for
        if code is None:
            self._start_job()
        else:   # the checkpoint's readers start once the code files are read
            code.then(self._after_code)

    def covers(self, real_path: str) -> bool:
        """Whether this prefetch reads the file at ``real_path`` (``os.path.realpath``)."""
        return real_path in self._real_paths

    @property
    def helper_process(self) -> bool:
        """Whether a helper process reads the checkpoint (False also where none could start)."""
        return self._helper

    @property
    def module_paths(self) -> list[str]:
        """The code files read first (``imports=``, ``modules=``)."""
        return self._code.paths if self._code is not None else []

    @property
    def module_bytes(self) -> int:
        return self._code.nbytes if self._code is not None else 0

    @property
    def bytes_done(self) -> int:
        """Bytes of the pieces finished so far (skipped resident files not counted)."""
        return self._bytes_done

    def _first_step(self) -> int:
        """Bytes per read until a load begins: small for idle or paced readers (they share the disk with the imports)."""
        if self.priority != "idle" and self._max_rate is None:
            return FAST_BYTES
        return IDLE_STEP if self._helper and self._no_readahead else PACED_BYTES

    def _threads_job(self) -> Job:
        """The checkpoint's readers as threads of this process; pieces hinted ``WILLNEED`` except at
        idle priority (the hints slow the imports beside them)."""
        readers = PieceReaders(self._sources, lambda: self._job.cancelled(), step=self._first_step(),
                               fast_step=FAST_BYTES, idle=self.priority == "idle",
                               hint=self._method == "advise" or self.priority != "idle",
                               hint_only=self._method == "advise", no_readahead=self._no_readahead,
                               copy=self._copy, max_rate=self._max_rate)
        self._readers = readers
        if self._loading:   # a load began before these readers exist
            readers.go_fast()
        readers.start()
        return Job(self.pieces, readers.work, self._threads, self._on_done, name="foxhunt-prefetch",
                   setup=readers.setup, teardown=readers.teardown)

    def _start_job(self) -> None:
        with self._job_lock:   # a waiter woken by a helper that failed to start sees the threads' job
            self._job.start()
            if self._helper and self._job.spawn_failed():
                self._read_here_instead()

    def _read_here_instead(self) -> None:
        """No child process here (an embedded interpreter, no fork allowed...): read in this one."""
        log.debug("prefetch: the helper process did not start (%s); reading in this process", self._job.error)
        cancelled, records = self._job.cancelled(), self._job.records
        self._helper = False
        if self.priority == "idle":
            self._threads = min(self._threads, IDLE_THREADS_IN_PROCESS)
        self._job = self._threads_job()
        if cancelled:
            self._job.cancel()
        self._start_records(records)
        self._job.start()

    def _start_records(self, records: list[str]) -> None:
        """The RECORDs' files stat'ed on a thread of this process (the helper does it in its own)."""
        if records and not self._job.cancelled():
            self._records_thread = threading.Thread(
                target=run_unwatched, args=(prefetch_record_metadata, records, self._job.cancelled),
                name="foxhunt-prefetch-records", daemon=True)
            self._records_thread.start()

    def _after_code(self) -> None:
        """The code files are read (or the reads were cancelled): the checkpoint's turn."""
        try:
            # the imports stat these later (importlib.metadata): beside them, not before
            if self._helper:
                self._job.records = self._code.records   # no GIL of ours taken by ~10^4-10^5 stats
            else:
                self._start_records(self._code.records)
        finally:
            self._start_job()   # cancelled: its readers stop at once and done() turns true

    def _on_done(self, i: int, piece: Piece, _result) -> None:
        with self._cond:
            self._landed[i] = 1
            self._bytes_done += piece.length
            self._remaining -= 1
            last = self._remaining == 0
            self._cond.notify_all()
        if last:
            self._closer()

    def done(self) -> bool:
        # code files still being read count as running (even with no pieces)
        return self._job_done() and (self._code is None or not self._code.reading())

    def _job_done(self) -> bool:
        with self._job_lock:
            return self._job.done()

    def _wait_job(self, timeout: float | None = None) -> None:
        """The readers' job's wait(), or that of the threads that replaced a helper meanwhile."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self._job
            try:
                job.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except BaseException:
                with self._job_lock:
                    if self._job is not job:
                        continue
                raise
            with self._job_lock:
                if self._job is job:
                    return

    def wait(self, name: str | None = None, timeout: float | None = None) -> None:
        """Block until the prefetch (or only tensor ``name``'s bytes) is in the page cache;
        re-raises the first reader error (``fs.CancelledError`` after ``cancel``)."""
        if name is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            self._wait_job(timeout)
            if self._code is not None:   # the checkpoint's job may have had nothing to read
                self._code.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
                if self._code.reading():
                    raise TimeoutError("prefetch of the modules' files still running")
            return
        try:
            a, b = self._name_pieces[name]
        except KeyError:
            raise KeyError(f"{name!r} is not part of this prefetch") from None
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not all(self._landed[a:b]):
                if self._job_done():
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"prefetch of {name!r} still running")
                self._cond.wait(0.05 if left is None else min(left, 0.05))
            ok = all(self._landed[a:b])
        if not ok:
            self._wait_job()   # raises the error that stopped it
            raise RuntimeError(f"prefetch ended before {name!r} was read")

    def wait_imports(self, timeout: float | None = None) -> None:
        """Block until the code files are read and their metadata prefetched."""
        if self._code is not None:
            self._code.wait(timeout)

    def unthrottle(self) -> None:
        """Drop ``max_rate`` and the idle pace: a load of the files began."""
        self._loading = True
        if self._readers is not None:
            self._readers.go_fast()
        job = self._job
        if isinstance(job, ChildJob):
            job.fast()

    def cancel(self) -> None:
        """Stop the readers (each after at most its current call) and close the files."""
        if self._readers is not None:
            self._readers.pacer.release()
        self._job.cancel()
        if self._code is not None:   # its readers stop after their current piece; then the job starts, cancelled
            self._code.cancel()
        try:
            self._wait_job()
        except BaseException:
            pass
        if self._records_thread is not None:   # started once the code files were read
            self._records_thread.join()
        self._closer()

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return (f"<PrefetchHandle {state}: {self._bytes_done}/{self.nbytes} bytes of {len(self.paths)} file(s), "
                f"{self._method}>")


def _close_sources(sources: dict[int, FileSource]) -> None:
    for src in sources.values():
        src.close()


def prefetch(source, names: Names = None, *, method: str = "read", skip_resident: bool = True,
             priority: str = "idle", modules: Sequence[str] = (), imports: str | os.PathLike | None = None,
             max_rate: float | None = None, helper_process: bool | None = None, **options) -> PrefetchHandle:
    """Start filling the page cache with a checkpoint's bytes; returns at once with a handle.

    ``source`` and ``names`` are as in ``load_file`` (``names=None``: whole files). ``method``:
    ``"read"`` (done() means resident) or ``"advise"`` (``posix_fadvise(WILLNEED)`` only). Files
    already resident are skipped (``skip_resident``), and so are those a load would read around
    the page cache (``io.read_policy``; listed in ``skipped``). Options as for the loader:
    ``threads`` (readers; default the loader's count, at most 8), ``chunk_bytes`` (a piece).
    ``priority``: ``"idle"`` (idle I/O class, readahead off, small steps until a load begins) or
    ``"normal"`` (8 hinted readers of 64 MiB per call). ``modules``: packages about to be
    imported, whose files are read first; ``imports``: a trace written by ``fs.record_imports``,
    its files read first (a missing one reads nothing extra), and this start's opens noted for
    the next. ``max_rate``: bytes per second of the checkpoint until a load begins or
    ``unthrottle()``. ``helper_process``: the checkpoint read by a child process (default: with
    ``priority="idle"`` and ``method="read"``). Needs neither torch nor cupy (docs/startup.md).
    """
    helper_process = _check_arguments(method, priority, max_rate, helper_process, modules)
    s = _settings.merge(**options)
    # A few readers stream a disk; more would compete with the imports for disk and cores.
    default = (IDLE_THREADS if helper_process else IDLE_THREADS_IN_PROCESS) if priority == "idle" else DEFAULT_THREADS
    threads = s.threads if options.get("threads") else min(default, s.threads)
    code = None
    if imports is not None:
        imports = os.path.expanduser(os.fspath(imports))
        watch_opens()   # so that record_imports can list what this start reads
    if modules or imports:   # first: the code readers fetch numpy's files while we import it
        code = TracedCodeReader(modules, imports, s.chunk_bytes, skip_resident, advise_only=method == "advise")
    try:
        ck, pieces, name_pieces, sources, skipped = _plan_reads(source, names, s, skip_resident)
    except BaseException:
        if code is not None:   # a bad checkpoint: the code readers stop too
            code.cancel()
        raise
    return PrefetchHandle(ck, pieces, sources, name_pieces, threads, method, priority, code, max_rate,
                          helper_process, skipped)


def _check_arguments(method: str, priority: str, max_rate: float | None, helper_process: bool | None,
                     modules: Sequence[str]) -> bool:
    """ValueError / TypeError for a bad argument; returns whether a helper process reads."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
    Pacer(max_rate)   # a bad max_rate fails here
    if IDLE_READ_MODE not in IDLE_READ_MODES:
        raise ValueError(f"prefetch.IDLE_READ_MODE must be one of {', '.join(IDLE_READ_MODES)}, got {IDLE_READ_MODE!r}")
    if helper_process and method != "read":
        raise ValueError("helper_process=True reads the pieces (method='read'); 'advise' needs no helper")
    if isinstance(modules, (str, bytes)):
        raise TypeError(f"modules takes a list of package names, got the string {modules!r}")
    for m in modules:
        if not m or "." in m:
            raise ValueError(f"modules takes top-level package names, got {m!r}")
    if helper_process is None:   # the startup case: keep ~10^3 reads a second off this process's GIL
        return priority == "idle" and method == "read" and bool(sys.executable)
    return bool(helper_process)


def _beyond_the_cache(paths: Sequence[str], spans: list[list[tuple[int, int]]], s: _settings.Settings) -> list[str]:
    """The files a load would read around the page cache (``io.read_policy``, or ``direct_io="on"``):
    warming them would only evict the rest, and the load would not read them from the cache."""
    if s.direct_io == "off":
        return []
    wanted = [f for f, file_spans in enumerate(spans) if file_spans]
    if s.direct_io == "on":
        skipped = [paths[f] for f in wanted]
    else:
        keep = read_policy.read_through_cache([paths[f] for f in wanted],
                                               [sum(end - start for start, end in spans[f]) for f in wanted])
        skipped = [paths[f] for f, k in zip(wanted, keep) if not k]
    if skipped:
        log.debug("prefetch: %d file(s) left to the load's direct reads (they would not stay in the page cache): %s",
                  len(skipped), skipped)
    return skipped


def _plan_reads(source, names: Names, s: _settings.Settings, skip_resident: bool):
    """The checkpoint, its pieces to read, each name's range of pieces, the files opened, and the
    paths left out because a load would read them around the page cache."""
    from ..io.checkpoint import open_checkpoint, select   # numpy: once the code readers run
    sources: dict[int, FileSource] = {}
    try:
        ck = open_checkpoint(source)
        chosen = select(ck, names)
        spans = _spans(ck, chosen, names is None)
        if skip_resident:
            for f, path in enumerate(ck.paths):
                if spans[f] and resident_fraction(path, samples=1 << 62) >= 1.0:
                    spans[f] = []
        skipped = _beyond_the_cache(ck.paths, spans, s)
        for f, path in enumerate(ck.paths):
            if path in skipped:
                spans[f] = []
        pieces = plan_pieces(spans, s.chunk_bytes)
        for f in sorted({p.file for p in pieces}):
            sources[f] = open_source(ck.paths[f], "pread", ck.headers[f].file_size)
        return ck, pieces, _name_pieces(ck, chosen, pieces), sources, skipped
    except BaseException:
        _close_sources(sources)
        raise
