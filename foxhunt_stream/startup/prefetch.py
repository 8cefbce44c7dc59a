"""Getting ready before a load: warm the page cache (``prefetch``) and the device (``warmup``).

An inference server spends its first seconds importing torch and starting CUDA, while the disk
sits idle. ``prefetch(source)`` needs neither torch nor cupy, so it can be the very first
statement of the process: it reads the checkpoint's headers, then reader threads (a
``pipeline.Job``) pull the selected bytes into the page cache - ``sendfile`` into /dev/null, so
nothing is copied and a reader takes the GIL back once per call, not once per small read - and a
later load finds its bytes in memory. Files already resident are skipped. While a prefetch of a
file is in flight the loader does not choose O_DIRECT for it (``warming``), so the two read
through the same cache instead of racing for the disk, and a load that starts lifts the
prefetch's pacing (``loading``).

What decides a cold start is not the weights but the imports running meanwhile: each of their
reads waits behind whatever the prefetch keeps queued on the disk. So the code the imports need
is read first (``modules=`` packages, or an ``imports=`` trace of an earlier start: see
``importtrace``), and the weights then follow (``priority="idle"``) with a shallow queue: files
advised ``POSIX_FADV_RANDOM`` (no readahead: the kernel queues twice ``read_ahead_kb`` per reader
otherwise, whatever the step), 1 MiB per call, read by a helper process (``warmchild``) so that
~10^3 calls a second take none of this process's GIL; or at a set rate (``max_rate``). Either way
until the load begins. On the H200 machine a read of the imports waited 0.1-0.3 ms behind that
queue against ~7 ms behind readahead, and the cold start went from 0.8-0.9x transformers'
``from_pretrained`` to 0.56-0.61x (``benchmarks/RESULTS.md``, session 6).

``warmup(device)`` pays the other first-load costs up front (CUDA runtime import, context, the pinned
staging pool, one stream per worker) and says how long each took.
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
from .code_files import CODE_THREADS, RESIDENT_SAMPLE, SMALL_FILE, CodeWarm, Piece, sample_resident  # noqa: F401
from .importtrace import _quiet, _quietly, code_files, module_files, warm_records, watch_opens  # noqa: F401
from ..engine.pipeline import Cancelled, Job
from ..io import pagecache
from ..io.pagecache import resident_fraction
from ..io.source import FileSource, open_source

if TYPE_CHECKING:   # numpy and the header parser load in prefetch(), once the code readers run
    import numpy as np

    from ..io.checkpoint import Checkpoint, Names
    from .helper_process import ChildJob

log = logging.getLogger("foxhunt_stream")

READ_BYTES = 1 << 20   # the reusable buffer per reader thread (where sendfile cannot warm the cache)
WARM_BYTES = 64 << 20  # bytes per sendfile call: the GIL is taken back once per this many bytes
PACED_BYTES = 4 << 20  # ... for idle readers in this process, or while max_rate holds them back (see _step)
IDLE_STEP = 1 << 20    # ... for idle readers in the helper process (no GIL of ours to take back)
METHODS = ("read", "advise")
PRIORITIES = ("idle", "normal")
DEFAULT_THREADS = 8    # readers when the caller names none (at most the loader's thread count)
IDLE_THREADS = 8       # ... with priority="idle", in the helper process: 8 x 1 MiB queued at most
IDLE_THREADS_IN_PROCESS = 2   # ... in this process (helper_process=False): each takes our GIL back per step
# How idle readers warm: "sendfile" (no copy; the kernel's readahead behind it keeps up to twice
# read_ahead_kb queued on the disk per reader, whatever the step); "shallow", the same with the
# files advised POSIX_FADV_RANDOM (no readahead: each reader has about one step queued); or
# "pread", shallow through a buffer of one step. Once a load begins (unthrottle), sendfile and
# normal readahead again.
IDLE_READ = "shallow"   # H200, cold: 2tx 15.8-16.2 s against 20.0-25.4 s with "sendfile" (RESULTS, session 6)
IDLE_READS = ("sendfile", "shallow", "pread")   # shallow: sendfile of one step, no readahead

_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}
_IOPRIO_WHO_PROCESS, _IOPRIO_CLASS_IDLE, _IOPRIO_CLASS_SHIFT = 1, 3, 13


def set_idle_io_priority() -> bool:
    """Put the calling thread's disk reads in the idle I/O class (Linux ``ioprio_set``): the block
    layer's scheduler (mq-deadline, BFQ) serves them only when nobody else's reads wait, so a
    prefetch does not slow the imports it overlaps. Best effort: False where unsupported."""
    import ctypes
    import platform
    nr = _SYS_IOPRIO_SET.get(platform.machine())
    if nr is None or not hasattr(os, "sched_getaffinity"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(nr, _IOPRIO_WHO_PROCESS, threading.get_native_id(),
                            _IOPRIO_CLASS_IDLE << _IOPRIO_CLASS_SHIFT) == 0
    except (OSError, AttributeError):
        return False


def plan_pieces(spans: Sequence[Sequence[tuple[int, int]]], piece_bytes: int) -> list[Piece]:
    """Pure: per file, merge the ``(start, end)`` byte spans and cut them into pieces of at most
    ``piece_bytes``, ordered by file then offset (the order a load reads in)."""
    if piece_bytes <= 0:
        raise ValueError("piece size must be positive")
    out: list[Piece] = []
    for f, file_spans in enumerate(spans):
        merged: list[list[int]] = []
        for start, end in sorted(file_spans):
            if end <= start:
                continue
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        for start, end in merged:
            for off in range(start, end, piece_bytes):
                out.append(Piece(f, off, min(piece_bytes, end - off)))
    return out


def _spans(ck: Checkpoint, chosen: list[str], whole_files: bool) -> list[list[tuple[int, int]]]:
    if whole_files:   # headers too: the loader reads them again
        return [[(0, h.file_size)] for h in ck.headers]
    spans: list[list[tuple[int, int]]] = [[] for _ in ck.paths]
    for n in chosen:
        f, info = ck.names[n]
        base = ck.headers[f].data_start
        spans[f].append((base + info.start, base + info.end))
    return spans


class Pacer:
    """Spaces reads so that together they take at most ``rate`` bytes per second, until
    ``release()``; ``take(n)`` blocks the calling reader until its ``n`` bytes are due."""

    def __init__(self, rate: float | None, clock=time.monotonic) -> None:
        if rate is not None and (isinstance(rate, bool) or not rate > 0):
            raise ValueError(f"max_rate must be a positive number of bytes per second, got {rate!r}")
        self.rate = rate
        self._clock = clock
        self._next = clock()
        self._lock = threading.Lock()
        self._released = threading.Event()
        if rate is None:
            self._released.set()

    def take(self, n: int) -> None:
        if self._released.is_set():
            return
        with self._lock:
            now = self._clock()
            start = max(now, self._next)
            self._next = start + n / self.rate
        if start > now:
            self._released.wait(start - now)

    def release(self) -> None:
        self._released.set()

    @property
    def released(self) -> bool:
        return self._released.is_set()


class PrefetchHandle:
    """A prefetch in flight. ``wait()`` blocks until every piece is read (``wait(name)``: only
    that tensor's bytes) and re-raises a reader's error; ``done()`` polls; ``cancel()`` stops the
    readers and joins them."""

    def __init__(self, ck: Checkpoint, pieces: list[Piece], sources: dict[int, FileSource],
                 name_pieces: dict[str, tuple[int, int]], threads: int, method: str,
                 priority: str = "normal", code: CodeWarm | None = None,
                 max_rate: float | None = None, helper_process: bool = False) -> None:
        self.paths = list(ck.paths)
        self._code = code   # the code files, read first (started by prefetch before this handle)
        self._real_paths = {os.path.realpath(p) for p in ck.paths}
        self.pieces = pieces
        self.nbytes = sum(p.length for p in pieces)
        self._sources = sources
        self._name_pieces = name_pieces
        self._method = method
        self.priority = priority
        self._landed = bytearray(len(pieces))
        self._remaining = len(pieces)
        self._bytes_done = 0
        self._cond = threading.Condition()
        self._buffers: list[np.ndarray | None] = [None] * max(1, threads)
        self._pacer = Pacer(max_rate)
        self._loading = False
        self._closer = weakref.finalize(self, _close_sources, sources)
        self.started = time.perf_counter()
        self.finished: float | None = None
        self._helper = helper_process
        if IDLE_READ not in IDLE_READS:
            raise ValueError(f"warm.IDLE_READ must be one of {', '.join(IDLE_READS)}, got {IDLE_READ!r}")
        self._shallow = priority == "idle" and IDLE_READ != "sendfile" and method == "read"
        self._copy = self._shallow and IDLE_READ == "pread"
        self._threads = threads
        self._job_lock = threading.Lock()   # held while a failed helper is swapped for threads (_start_job)
        if helper_process:   # the checkpoint's reads in a child process: none of them takes our GIL
            from .helper_process import ChildJob  # (subprocess and tempfile: imported only when asked for)
            self._job: Job | ChildJob = ChildJob(
                ck.paths, [h.file_size for h in ck.headers], pieces, self._on_done, threads, priority,
                self._step(), WARM_BYTES, max_rate, shallow=self._shallow, copy=self._copy)
        else:
            self._job = self._threads_job()
        if not pieces:
            self._closer()
            self.finished = self.started
        pagecache.register_warmer(self)   # a load of these files reads through the cache, and unpaces us
        self._records_thread: threading.Thread | None = None    # warm_records (in process), not waited for
        if code is None:
            self._start_job()
        else:   # the checkpoint's readers start once the code files are read
            code.then(self._after_code)

    def covers(self, real_path: str) -> bool:
        """Whether this prefetch reads the file at ``real_path`` (``os.path.realpath``)."""
        return real_path in self._real_paths

    def _threads_job(self) -> Job:
        """The checkpoint's readers as threads of this process."""
        if self._shallow:
            _advise_all(self._sources, "POSIX_FADV_RANDOM")
        return Job(self.pieces, self._work, self._threads, self._on_done, name="foxhunt-prefetch", setup=self._setup)

    def _start_job(self) -> None:
        with self._job_lock:   # a waiter woken by a helper that failed to start sees the threads' job
            self._start_job_locked()

    def _start_job_locked(self) -> None:
        self._job.start()
        if self._helper and self._job.spawn_failed():
            # no child process here (an embedded interpreter, no fork allowed...): read in this one
            log.debug("prefetch: the helper process did not start (%s); reading in this process", self._job.error)
            cancelled, records = self._job.cancelled(), self._job.records
            self._helper = False
            self._threads = min(self._threads, IDLE_THREADS_IN_PROCESS) if self.priority == "idle" else self._threads
            self._job = self._threads_job()
            if cancelled:
                self._job.cancel()
            self._start_records(records)
            self._job.start()

    def _start_records(self, records: list[str]) -> None:
        """The RECORDs' files stat'ed on a thread of this process (the helper does it in its own)."""
        if records and not self._job.cancelled():
            self._records_thread = threading.Thread(target=_quietly, args=(warm_records, records, self._job.cancelled),
                                                    name="foxhunt-prefetch-records", daemon=True)
            self._records_thread.start()

    @property
    def module_paths(self) -> list[str]:
        """The code files read first (``imports=``, ``modules=``)."""
        return self._code.paths if self._code is not None else []

    @property
    def module_bytes(self) -> int:
        return self._code.nbytes if self._code is not None else 0

    @property
    def _modules_thread(self) -> threading.Thread | None:
        return self._code.thread if self._code is not None else None

    @property
    def _metadata_thread(self) -> threading.Thread | None:
        return self._code.metadata_thread if self._code is not None else None

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

    # -- workers
    def _setup(self, worker: int) -> None:
        import numpy as np
        _quiet.on = True
        if self.priority == "idle":
            set_idle_io_priority()
        if self._method == "read":
            self._buffers[worker] = np.empty(max(READ_BYTES, self._step()) if self._copy else READ_BYTES,
                                             np.uint8)

    def _work(self, worker: int, piece: Piece) -> None:
        src = self._sources[piece.file]
        # idle readers: no hint for the whole piece (see _advise); the kernel's readahead paces them
        if self._method == "advise" or self.priority != "idle":
            self._advise(src.fd, piece)
        if self._method == "advise":
            return
        off = piece.offset
        while off < piece.end:
            if self._job.cancelled():
                raise Cancelled("cancelled")   # not landed: on_done must not run for this piece
            n = min(self._step(), piece.end - off)
            self._pacer.take(n)
            # a short or failed read is an error
            src.warm(off, n, self._buffers[worker], copy=self._copy and not self._loading)
            off += n

    def _advise(self, fd: int, piece: Piece) -> None:
        """``posix_fadvise(WILLNEED)``: the kernel queues the whole piece at once. Not for the
        checkpoint at idle priority: on the H200 machine 4 readers' 8 MiB hints kept ~32 MiB
        queued on the disk ahead of every page fault of the imports running meanwhile, and
        ``import transformers`` took 21.7 s cold instead of 9.6 s; 1 MiB reads from 2 readers
        queue ~2 MiB. The code files (``modules``, ``imports``) are always hinted: the imports
        wait for them."""
        try:
            os.posix_fadvise(fd, piece.offset, piece.length, os.POSIX_FADV_WILLNEED)
        except (AttributeError, OSError):   # a hint only: not every platform/filesystem takes it
            pass

    def _on_done(self, i: int, piece: Piece, _result) -> None:
        with self._cond:
            self._landed[i] = 1
            self._bytes_done += piece.length
            self._remaining -= 1
            last = self._remaining == 0
            self._cond.notify_all()
        if last:
            self.finished = time.perf_counter()
            self._closer()

    # -- the handle
    @property
    def bytes_done(self) -> int:
        """Bytes of the pieces finished so far (skipped resident files not counted)."""
        return self._bytes_done

    def done(self) -> bool:
        t = self._modules_thread   # modules still being read count as running (even with no pieces)
        return self._job_done() and (t is None or not t.is_alive())

    def _job_done(self) -> bool:
        with self._job_lock:
            return self._job.done()

    def _wait_job(self, timeout: float | None = None) -> None:
        """The readers' job's wait(); where a helper that could not start was replaced by threads
        meanwhile (_start_job), the threads' job's."""
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
        """Block until the prefetch (or only tensor ``name``'s bytes) is in the page cache.

        Re-raises the first reader error (``pipeline.Cancelled`` after ``cancel``); TimeoutError
        if ``timeout`` seconds pass first.
        """
        if name is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            self._wait_job(timeout)
            t = self._modules_thread
            if t is not None:   # the checkpoint's job may have had nothing to read
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
                if t.is_alive():
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
        """Block until the code files (``imports=`` / ``modules=``) are read and their metadata
        warmed; the checkpoint's bytes go on in the background. A start that imports after this
        imports from memory: on the H200 machine, cold, ``import torch, transformers`` took
        12.9-13.5 s this way against 16.3-18.4 s with nothing warmed and 11.7 s hot
        (``benchmarks/cold_imports.py``). Returns at once when there were no code files."""
        if self._code is not None:
            self._code.wait(timeout)

    def _step(self) -> int:
        """Bytes per warming call. Idle or paced readers take small steps: the kernel's readahead
        behind one 64 MiB ``sendfile`` keeps the disk's queue full, and every read the imports
        still do waits behind it (H200 machine, cold: ``import transformers`` 16.3 s instead of
        9.5 s with 4 MiB steps). Once a load of the files began, big steps."""
        if self._loading or (self.priority != "idle" and self._pacer.released):
            return WARM_BYTES
        return IDLE_STEP if self._helper and self._shallow else PACED_BYTES

    def unthrottle(self) -> None:
        """Drop ``max_rate`` and the idle pace: read the rest as fast as the disk goes (a load of
        the files began)."""
        self._loading = True
        self._pacer.release()
        if self._helper:
            self._job.fast()
        elif self._shallow:
            _advise_all(self._sources, "POSIX_FADV_NORMAL")

    def cancel(self) -> None:
        """Stop the readers and close the files: each reader finishes at most its current call
        (a 4-64 MiB step of the checkpoint, or one piece of a code file)."""
        self._pacer.release()
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


def _advise_all(sources, advice: str) -> None:
    """``posix_fadvise(advice)`` on every open source (a hint: where it is refused, nothing changes)."""
    for src in sources.values():
        try:
            os.posix_fadvise(src.fd, 0, 0, getattr(os, advice))
        except (AttributeError, OSError, ValueError):
            pass


def _close_sources(sources: dict[int, FileSource]) -> None:
    for src in sources.values():
        src.close()


def prefetch(source, names: Names = None, *, method: str = "read", skip_resident: bool = True,
             priority: str = "idle", modules: Sequence[str] = (), imports: str | os.PathLike | None = None,
             max_rate: float | None = None, helper_process: bool | None = None, **options) -> PrefetchHandle:
    """Start warming the page cache with a checkpoint's bytes; returns at once with a handle.

    ``source`` and ``names`` are as in ``load_file`` (``names=None``: whole files). ``method``:
    ``"read"`` (hint, then read through a small buffer: done() means resident) or ``"advise"``
    (``posix_fadvise(WILLNEED)`` only: no copies, but the kernel may still be reading after
    done()). Files already fully resident are skipped (``skip_resident``). Options as for the
    loader: ``threads`` (readers; default the loader's count, at most 8), ``chunk_bytes`` (the
    piece each reader hints and reads at a time). ``priority``: ``"idle"`` (the startup case: the
    readers' I/O in the idle class, see ``set_idle_io_priority``; their files advised
    ``POSIX_FADV_RANDOM`` so the kernel reads no further ahead than each call, ``IDLE_READ``; 8
    readers of 1 MiB per call in the helper process, or 2 of 4 MiB here: at most ~8 MiB queued on
    the disk ahead of an import's read - it waited 0.2-0.3 ms there on the H200 machine, against
    6-8 ms behind readahead - until a load of the files begins) or ``"normal"`` (8 readers, hinted,
    64 MiB per call: fill the cache as fast as the disk goes).
    ``modules``: top-level packages the process is about to import (``("torch", "nvidia",
    "transformers")``), whose libraries and bytecode are read first (``module_files``): on a cold
    start the imports then find them in memory instead of waiting behind the checkpoint's reads.
    ``imports``: a trace written by ``fs.record_imports`` at an earlier start: exactly the files
    that start loaded (the packages' dependencies and the standard library too, and the touched
    parts of each shared library), read first in the order they were needed, by 8 hinted readers
    at normal priority (on a hot start - a sample of them resident - only the big ones still
    missing); a missing trace (the first start) reads nothing extra. Passing it also
    starts noting what this start opens (``importtrace.watch_opens``) for the next trace.
    ``max_rate``: at most this many bytes per second of the checkpoint (not of the code files),
    until a load of its files starts (``loading``) or ``unthrottle()``: a disk kept busy makes
    every read the imports still do wait behind the prefetch's queue.
    ``helper_process``: the checkpoint's bytes are read by a child process
    (``python -m foxhunt_stream.warmchild``, same readers, steps and pacing) instead of threads
    of this one, so its reads never take this process's GIL from the imports running meanwhile;
    the code files (``imports=``, ``modules=``) are still read here first. Default (None): yes
    for ``priority="idle"`` with ``method="read"``, no otherwise. The distributions' ``RECORD``
    files in an ``imports=`` trace have the files they list stat'ed beside the imports
    (``importtrace.warm_records``: ``importlib.metadata`` stats them), there or on a thread here.
    Needs neither torch nor cupy; call it before importing them.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
    Pacer(max_rate)   # a bad max_rate fails here, before any file is opened
    if helper_process and method != "read":
        raise ValueError("helper_process=True reads the pieces (method='read'); 'advise' needs no helper")
    if helper_process is None:   # the startup case: keep ~10^3 reads a second off this process's GIL
        helper_process = priority == "idle" and method == "read" and bool(sys.executable)
    if isinstance(modules, (str, bytes)):
        raise TypeError(f"modules takes a list of package names, got the string {modules!r}")
    for m in modules:
        if not m or "." in m:
            raise ValueError(f"modules takes top-level package names, got {m!r}")
    s = _settings.merge(**options)
    # A disk streams sequentially with a few readers (each has a whole piece in flight); more
    # would only compete with the imports running meanwhile for the same disk and cores.
    default = (IDLE_THREADS if helper_process else IDLE_THREADS_IN_PROCESS) if priority == "idle" else DEFAULT_THREADS
    threads = s.threads if options.get("threads") else min(default, s.threads)
    code = None
    if imports is not None:
        imports = os.path.expanduser(os.fspath(imports))
        watch_opens()   # so that record_imports can list what this start reads
    if modules or imports:   # first: the code readers fetch numpy's files while we import it
        code = CodeWarm(modules, imports, s.chunk_bytes, skip_resident, advise_only=method == "advise")
    sources: dict[int, FileSource] = {}
    try:
        from ..io.checkpoint import open_checkpoint, select
        ck = open_checkpoint(source)
        chosen = select(ck, names)
        spans = _spans(ck, chosen, names is None)
        if skip_resident:
            for f, path in enumerate(ck.paths):
                if spans[f] and resident_fraction(path, samples=1 << 62) >= 1.0:
                    spans[f] = []
        pieces = plan_pieces(spans, s.chunk_bytes)
        name_pieces = _name_pieces(ck, chosen, pieces)
        for f in sorted({p.file for p in pieces}):
            sources[f] = open_source(ck.paths[f], "pread", ck.headers[f].file_size)
    except BaseException:
        _close_sources(sources)
        if code is not None:   # a bad checkpoint: the code readers stop too
            code.cancel()
        raise
    return PrefetchHandle(ck, pieces, sources, name_pieces, threads, method, priority, code, max_rate,
                          helper_process)


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


class WarmupHandle:
    """A warmup running on a background thread (``warmup(..., background=True)``)."""

    def __init__(self, dev, s: _settings.Settings, verify: bool = False) -> None:
        self._out: dict[str, float] | None = None

        def work(worker: int, _item) -> None:
            self._out = _warm(dev, s, verify)
        self._job = Job([None], work, 1, name="foxhunt-warmup").start()

    def done(self) -> bool:
        return self._job.done()

    def result(self, timeout: float | None = None) -> dict[str, float]:
        """The seconds each step took; re-raises the warmup's error (no GPU, no cupy...)."""
        self._job.wait(timeout)
        return dict(self._out or {})


def warmup(device="cuda:0", *, background: bool = False, verify: bool = False,
           **options) -> dict[str, float] | WarmupHandle:
    """Pay a load's first-use costs now; returns the seconds each step took.

    For a GPU: importing the CUDA runtime wrapper (``cudart``), creating the CUDA context,
    allocating the pinned staging pool (sized by ``chunk_bytes``/``staging_bytes``, and reused
    by every later load and save with the same settings) and one stream per worker thread. For ``"cpu"``: the host scratch pool.
    With ``background=True`` it runs on a thread and a WarmupHandle is returned at once, so the
    work overlaps whatever the caller does next (building the model); a load that starts before
    it is done waits for the pinned pool instead of allocating a second one. ``verify=True`` also
    builds the GPU checksum kernel that ``load_file(..., verify=True)`` uses (an NVRTC compile).
    """
    from ..cuda.devices import parse_device

    s = _settings.merge(**options)   # in the caller: its settings overrides apply
    dev = parse_device(device)
    if background:
        return WarmupHandle(dev, s, verify)
    return _warm(dev, s, verify)


def _warm(dev, s: _settings.Settings, verify: bool = False) -> dict[str, float]:
    from ..cuda import runtime as cudart
    from ..cuda.devices import check_device, context
    from ..engine.targets import CudaTarget, HostTarget

    t = time.perf_counter()
    out: dict[str, float] = {}

    def lap(key: str) -> None:
        nonlocal t
        now = time.perf_counter()
        out[key] = now - t
        t = now

    if not dev.is_cuda:
        HostTarget(s.chunk_bytes, min(s.n_slots, s.threads)).pool().fill()   # the size the loader asks for
        lap("host_pool")
        return out
    rt = cudart.runtime()
    lap("import_runtime")
    check_device(dev)
    with cudart.on_device(dev.index):
        rt.free(0)   # forces the (primary) context into existence
    lap("context")
    CudaTarget(dev.index, s.chunk_bytes, s.n_slots, s.threads).pool().fill()   # pinned now, not at the load
    lap("pinned_pool")
    ctx = context(dev.index)
    for w in range(s.threads):
        ctx.stream(w)
    lap("streams")
    if verify:
        from ..cuda.digest import KernelUnavailable, _kernel
        try:
            _kernel(dev.index)
        except KernelUnavailable:   # loads will hash host copies; they warn about it themselves
            pass
        lap("digest_kernel")
    return out
