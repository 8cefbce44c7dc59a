"""Getting ready before a load: warm the page cache (``prefetch``) and the device (``warmup``).

An inference server spends its first seconds importing torch and starting CUDA, while the disk
sits idle. ``prefetch(source)`` needs neither torch nor cupy, so it can be the very first
statement of the process: it reads the checkpoint's headers, then reader threads (a
``pipeline.Job``) pull the selected bytes into the page cache - a ``posix_fadvise(WILLNEED)``
hint per piece, so the kernel queues the whole piece at once, then ``pread`` through one small
reusable buffer per thread - and a later load finds its bytes in memory. Files already resident
are skipped. While a prefetch of a file is in flight the loader does not choose O_DIRECT for it
(``warming``), so the two read through the same cache instead of racing for the disk.

``warmup(device)`` pays the other first-load costs up front (cupy import, CUDA context, the pinned
staging pool, one stream per worker) and says how long each took.
"""

from __future__ import annotations

import bisect
import logging
import os
import stat
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from . import settings as _settings
from .checkpoint import Checkpoint, Names, open_checkpoint, select
from .pipeline import Cancelled, Job
from .source import FileSource, open_source, resident_fraction, sendfile_to_null

log = logging.getLogger("foxhunt_stream")

READ_BYTES = 1 << 20   # the reusable buffer per reader thread (where sendfile cannot warm the cache)
WARM_BYTES = 64 << 20  # bytes per sendfile call: the GIL is taken back once per this many bytes
PACED_BYTES = 4 << 20  # ... while max_rate holds the readers back
METHODS = ("read", "advise")
PRIORITIES = ("idle", "normal")
DEFAULT_THREADS = 8    # readers when the caller names none (at most the loader's thread count)
IDLE_THREADS = 2       # ... with priority="idle": a shallow queue in front of the imports' reads
CODE_THREADS = 8       # readers of the code files (modules=, imports=): what the imports wait for

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


@dataclass(frozen=True, slots=True)
class Piece:
    """One unit of prefetch work: ``length`` bytes at ``offset`` of file ``file``."""
    file: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


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


MODULE_SUFFIXES = (".so", ".pyc", ".pyd", ".dylib")


def module_files(modules: Sequence[str]) -> list[tuple[str, int]]:
    """The files an import of each top-level package would read: its shared libraries and
    bytecode (``(path, size)``, packages in the order given, biggest files first within each).
    Found with ``importlib.util.find_spec``, which imports nothing; unknown names are skipped.
    For a cold start: warming torch's libraries (GBs) ahead of ``import torch`` in big reads is
    faster than the import's own page faults, and keeps the checkpoint's reads off its path."""
    import importlib.util
    import sys
    tag = sys.implementation.cache_tag or ""
    out: list[tuple[str, int]] = []
    seen: set[str] = set()
    for name in modules:
        if not name or "." in name:
            raise ValueError(f"modules takes top-level package names, got {name!r}")
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        roots = list(spec.submodule_search_locations or []) or ([spec.origin] if spec.origin else [])
        files: list[tuple[str, int]] = []
        for root in roots:
            walk = os.walk(root) if os.path.isdir(root) else [(os.path.dirname(root), [], [os.path.basename(root)])]
            for d, _, names in walk:
                for fn in names:
                    if not (fn.endswith(MODULE_SUFFIXES) or ".so." in fn):
                        continue
                    if fn.endswith(".pyc") and tag and tag not in fn:
                        continue
                    path = os.path.join(d, fn)
                    real = os.path.realpath(path)
                    if real in seen:
                        continue
                    try:
                        size = os.stat(real).st_size
                    except OSError:
                        continue
                    seen.add(real)
                    if size:
                        files.append((real, size))
        files.sort(key=lambda f: (-f[1], f[0]))
        out += files
    return out


TRACE_HEADER = "# foxhunt-stream import trace v1"
MERGE_GAP = 1 << 20   # touched ranges of a library closer than this are read as one


def _is_shared_object(name: str) -> bool:
    return name.endswith((".so", ".pyd", ".dylib")) or ".so." in name


def _package_root(path: str, roots: Sequence[str]) -> str:
    """The top-level package directory ``path`` belongs to (``.../site-packages/torch``), found
    against the import roots (``sys.path``, longest first); else its own directory."""
    for r in roots:
        if path.startswith(r + os.sep):
            return os.path.join(r, path[len(r) + 1:].split(os.sep, 1)[0])
    return os.path.dirname(path)


def order_loaded_files(modules: Sequence[tuple[str | None, str | None]], mapped: Sequence[str],
                       roots: Sequence[str]) -> list[str]:
    """Pure: the order a restart reads code in. ``modules``: ``(__file__, __cached__)`` of each
    module in import order (``sys.modules`` keeps it); the bytecode stands for a module when it
    has any (Python reads the ``.pyc``, not the source). ``mapped``: shared objects mapped into
    the process (``/proc/self/maps``): each goes right before the first module of its package
    (``libtorch_cuda.so`` before ``torch/__init__``: ``import torch`` loads it), those of no
    imported package (CUDA's libraries, loaded by path) first. Duplicates dropped."""
    roots = sorted({r.rstrip(os.sep) for r in roots if r}, key=len, reverse=True)
    code: list[str] = []
    seen: set[str] = set()
    for file, cached in modules:
        f = cached or file
        if f and f not in seen:
            seen.add(f)
            code.append(f)
    first: dict[str, int] = {}
    for i, f in enumerate(code):
        first.setdefault(_package_root(f, roots), i)
    before: dict[int, list[str]] = {}
    for lib in mapped:
        if lib in seen:
            continue
        seen.add(lib)
        before.setdefault(first.get(_package_root(lib, roots), -1), []).append(lib)
    out = list(before.get(-1, []))
    for i, f in enumerate(code):
        out += before.get(i, [])
        out.append(f)
    return out


def merge_ranges(ranges: Sequence[tuple[int, int]], gap: int = MERGE_GAP) -> list[tuple[int, int]]:
    """Pure: ``(start, end)`` byte ranges sorted and merged where they overlap or lie less than
    ``gap`` apart (one big read beats many small ones on a disk)."""
    out: list[list[int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def present_runs(entries: np.ndarray) -> list[tuple[int, int]]:
    """Pure: ``[i, j)`` runs of pages whose ``/proc/self/pagemap`` entry has the present bit (63)."""
    present = np.concatenate(([False], (entries >> np.uint64(63)).astype(bool), [False]))
    edges = np.flatnonzero(present[1:] != present[:-1])
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def mapped_libraries() -> dict[str, list[tuple[int, int]]]:
    """The shared objects mapped into this process and, per file, the byte ranges its code has
    touched (pages present in this process's page tables, ``/proc/self/pagemap``): for torch's
    CUDA libraries a fraction of each file, which a replay reads instead of the whole file.
    A library whose pages cannot be inspected gets ``[]`` (read it whole); {} off Linux."""
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    out: dict[str, list[tuple[int, int]]] = {}
    try:
        maps = open("/proc/self/maps")
    except OSError:
        return out
    try:
        pagemap = open("/proc/self/pagemap", "rb", buffering=0)
    except OSError:
        pagemap = None
    with maps:
        for line in maps:
            parts = line.split(None, 5)
            if len(parts) < 6 or not _is_shared_object(os.path.basename(parts[5].strip())):
                continue
            path = os.path.realpath(parts[5].strip())
            if not os.path.isfile(path):
                continue
            ranges = out.setdefault(path, [])
            if pagemap is None:
                continue
            try:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                offset = int(parts[2], 16)
                pagemap.seek(lo // page * 8)
                entries = np.frombuffer(pagemap.read((hi - lo) // page * 8), dtype="<u8")
            except (OSError, ValueError):
                out[path] = []
                continue
            ranges += [(offset + i * page, offset + j * page) for i, j in present_runs(entries)]
    if pagemap is not None:
        pagemap.close()
    return {p: merge_ranges(r) for p, r in out.items()}


_quiet = threading.local()       # .on in foxhunt's own reader threads: their opens are not noted
_opened: list[str] = []          # files opened for reading / directories listed, in order (watch_opens)
_watching = False
DATA_FILE_LIMIT = 64 << 20       # bigger files opened by Python code (checkpoints) are not traced
_UNTRACED = ("/proc/", "/sys/", "/dev/")


def _audit(event: str, args: tuple) -> None:
    """The audit hook (PEP 578) of ``watch_opens``: cheap, and never raises."""
    if event == "open":
        path, mode, flags = args
        if not isinstance(path, str):
            return
        if isinstance(mode, str) and mode:
            if "w" in mode or "a" in mode or "x" in mode or "+" in mode:
                return
        elif not isinstance(flags, int) or flags & 3:   # O_WRONLY / O_RDWR
            return
    elif event == "os.listdir" or event == "os.scandir":
        path = args[0] if args else None
        if not isinstance(path, str) or not path:
            return
        path = path.rstrip(os.sep) + os.sep
    else:
        return
    if getattr(_quiet, "on", False) or path.startswith(_UNTRACED):
        return
    try:
        _opened.append(os.path.abspath(path) + (os.sep if path.endswith(os.sep) else ""))
    except Exception:   # noqa: BLE001 - a hook must not break the open it watches
        pass


def _quietly(fn, *args) -> None:
    """Run ``fn`` on this (foxhunt) thread without noting its opens as the process's."""
    _quiet.on = True
    fn(*args)


def watch_opens() -> None:
    """From now on, note each file Python code opens for reading and each directory it lists
    (an audit hook, PEP 578, installed once per process): a later ``record_imports`` then also
    lists what the imports read besides their modules (package metadata, configs, directory
    listings), in the order they read it. ``prefetch(..., imports=)`` calls this."""
    global _watching
    if _watching:
        return
    import sys
    _watching = True
    sys.addaudithook(_audit)


def opened_files() -> tuple[list[str], list[str]]:
    """What ``watch_opens`` noted, first use first: regular files (real paths, at most
    ``DATA_FILE_LIMIT`` bytes, ``.safetensors`` left to the weights' own prefetch) and directories."""
    files: list[str] = []
    dirs: list[str] = []
    seen: set[str] = set()
    for p in dict.fromkeys(_opened):
        if p.endswith(os.sep):
            dirs.append(p.rstrip(os.sep) or os.sep)
            continue
        try:
            real = os.path.realpath(p)
            st = os.stat(real)
        except (OSError, ValueError):
            continue
        if real in seen:
            continue
        seen.add(real)
        if stat.S_ISREG(st.st_mode) and st.st_size <= DATA_FILE_LIMIT and not real.endswith(".safetensors"):
            files.append(real)
    return files, dirs


def loaded_files() -> list[str]:
    """The code files this process has loaded so far (bytecode, extension modules, shared
    libraries) and, after ``watch_opens``, the other files its Python code read, in the order a
    restart needs them (``order_loaded_files``). Record it once the server answers
    (``record_imports``) and replay it with ``prefetch(..., imports=)``."""
    import sys

    def real(f) -> str | None:
        if not isinstance(f, str) or not f:
            return None
        try:
            return os.path.realpath(f) if os.path.isfile(f) else None
        except (OSError, ValueError):
            return None
    opened, _ = opened_files()   # in the order they were opened (bytecode included)
    mods = [(f, None) for f in opened] + [(real(getattr(m, "__file__", None)), real(getattr(m, "__cached__", None)))
                                          for m in list(sys.modules.values())]
    mapped = list(mapped_libraries())   # not Linux: the modules' own files only
    roots = [os.path.realpath(p) for p in sys.path if isinstance(p, str) and p and os.path.isdir(p)]
    return order_loaded_files(mods, mapped, roots)


def format_trace(files: Sequence[str], ranges: dict[str, list[tuple[int, int]]]) -> str:
    """Pure: the trace text: one file per line, whole (bytecode) or, after a tab, the byte
    ranges to read (``start+length`` comma list: the touched parts of a shared library)."""
    lines = [TRACE_HEADER]
    for p in files:
        if "\n" in p or "\t" in p:
            continue
        r = ranges.get(p)
        lines.append(p + ("\t" + ",".join(f"{a}+{b - a}" for a, b in r) if r else ""))
    return "\n".join(lines) + "\n"


def record_imports(path: str | os.PathLike) -> int:
    """Write this process's ``loaded_files()`` to ``path`` (text, replaced atomically) for the
    next start's ``prefetch(..., imports=path)``; returns how many files it lists. Shared
    libraries are listed with the byte ranges this process touched (``mapped_libraries``).

    Call it once the model has answered (the first forward loads cuBLAS and friends too)."""
    files = loaded_files()
    text = format_trace(files + [d + os.sep for d in opened_files()[1]], mapped_libraries())
    path = os.fspath(path)
    tmp = f"{path}.{os.getpid()}.tmp"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return len(files)


def parse_import_trace(text: str) -> list[tuple[str, list[tuple[int, int]] | None]]:
    """Pure: ``(path, ranges)`` per line of a trace (``format_trace``); ranges ``None`` means the
    whole file. Blank and ``#`` lines are skipped, as are ranges that do not parse."""
    out: list[tuple[str, list[tuple[int, int]] | None]] = []
    for raw in text.splitlines():
        line = raw.strip("\r\n")
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        path, _, spec = line.partition("\t")
        ranges: list[tuple[int, int]] | None = None
        if spec.strip():
            try:
                ranges = [(int(a), int(a) + int(n)) for a, n in (r.split("+") for r in spec.split(","))]
            except ValueError:
                ranges = None
            if ranges is not None and any(a < 0 or b <= a for a, b in ranges):
                ranges = None
        out.append((path.strip(), ranges))
    return out


CodeFile = tuple[str, list[tuple[int, int]]]   # a file and the (start, end) ranges to read


def read_trace(path: str | os.PathLike) -> tuple[list[CodeFile], list[str]]:
    """The files of a trace that still exist, with the ranges to read (clipped to the file's
    size now), and the directories it lists (lines ending in a separator: only listed, see
    ``warm_metadata``). A missing trace (the first start) lists nothing."""
    try:
        with open(path, encoding="utf-8") as f:
            listed = parse_import_trace(f.read())
    except FileNotFoundError:
        return [], []
    out: list[CodeFile] = []
    dirs: list[str] = []
    for p, ranges in listed:
        if p.endswith(os.sep) and len(p) > 1:
            dirs.append(p.rstrip(os.sep))
            continue
        try:
            st = os.stat(p)
        except OSError:   # uninstalled or upgraded since: the import will find its own files
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        spans = [(a, min(b, st.st_size)) for a, b in (ranges or [(0, st.st_size)]) if a < st.st_size]
        if spans:
            out.append((p, spans))
    return out, dirs


def trace_files(path: str | os.PathLike) -> list[CodeFile]:
    """``read_trace``'s files only."""
    return read_trace(path)[0]


def code_files(modules: Sequence[str], imports: str | os.PathLike | None) -> tuple[list[CodeFile], list[str]]:
    """What a prefetch reads before the checkpoint: the import trace's files in its order, then
    the named packages' files not already listed (whole); and the trace's directories."""
    out, dirs = read_trace(imports) if imports is not None else ([], [])
    if modules:
        listed = {p for p, _ in out}
        out += [(p, [(0, n)]) for p, n in module_files(modules) if p not in listed]
    return out, dirs


def warm_metadata(files: Sequence[str], dirs: Sequence[str] = ()) -> None:
    """What an import touches besides the bytecode: the listing of each package directory (and
    of ``dirs``, those the traced start listed) and the source file's ``stat`` (the bytecode is
    checked against it). After ``drop_caches`` these are small random reads of directories and
    inodes; done ahead, the import finds them cached."""
    listed: set[str] = set()
    for d in dirs:
        if d not in listed:
            listed.add(d)
            try:
                os.listdir(d)
            except OSError:
                pass
    for p in files:
        d = os.path.dirname(p)
        if os.path.basename(d) == "__pycache__":   # pkg/__pycache__/mod.cpython-312.pyc -> pkg, pkg/mod.py
            d = os.path.dirname(d)
            try:
                os.stat(os.path.join(d, os.path.basename(p).split(".", 1)[0] + ".py"))
            except OSError:
                pass
        if d not in listed:
            listed.add(d)
            try:
                os.listdir(d)
            except OSError:
                pass


_live: "weakref.WeakSet[PrefetchHandle]" = weakref.WeakSet()
_live_lock = threading.Lock()


def warming(path: str | os.PathLike) -> bool:
    """Whether a prefetch of ``path`` is still running in this process."""
    real = os.path.realpath(path)
    with _live_lock:
        handles = list(_live)
    return any(not h.done() and real in h._real_paths for h in handles)


def loading(path: str | os.PathLike) -> None:
    """A load of ``path`` starts: the prefetches warming it drop their ``max_rate`` (the rate
    left the disk to the imports; now the load waits for these bytes)."""
    real = os.path.realpath(path)
    with _live_lock:
        handles = list(_live)
    for h in handles:
        if real in h._real_paths:
            h.unthrottle()


class Pacer:
    """Spaces reads so that together they take at most ``rate`` bytes per second, until
    ``release()``; ``take(n)`` blocks the calling reader until its ``n`` bytes are due."""

    def __init__(self, rate: float | None, clock=time.monotonic) -> None:
        if rate is not None and not rate > 0:
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
                 priority: str = "normal", modules_first: tuple | None = None,
                 max_rate: float | None = None) -> None:
        self.paths = list(ck.paths)
        # modules_first = (packages, import trace, piece bytes, skip_resident): their files are
        # found and read on the readers' threads before the checkpoint's pieces (code_files); a piece
        # with file >= len(paths) reads module_paths[file - len(paths)], opened per piece
        # (thousands of small files: no descriptor is held between pieces)
        self.module_paths: list[str] = []
        self.module_bytes = 0
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
        self._code_buffers: list[np.ndarray | None] = [None] * CODE_THREADS
        self._closer = weakref.finalize(self, _close_sources, sources)
        self.started = time.perf_counter()
        self.finished: float | None = None
        self._job = Job(pieces, self._work, threads, self._on_done, name="foxhunt-prefetch",
                        setup=self._setup)
        if not pieces:
            self._closer()
            self.finished = self.started
        with _live_lock:
            _live.add(self)
        self._modules_thread: threading.Thread | None = None
        if modules_first is None:
            self._job.start()
        else:   # discovery takes ~0.1-0.3 s: the caller's imports start meanwhile
            self._modules_thread = threading.Thread(target=self._modules_then_checkpoint,
                                                    args=(threads, *modules_first),
                                                    name="foxhunt-prefetch-modules", daemon=True)
            self._modules_thread.start()

    def _modules_then_checkpoint(self, threads: int, modules, imports, piece_bytes: int,
                                 skip_resident: bool) -> None:
        _quiet.on = True   # the trace, the residency checks: not the process's own reads
        try:
            try:
                files, dirs = code_files(modules, imports)
                if files or dirs:   # directories and inodes on their own thread, beside the reads
                    threading.Thread(target=_quietly, args=(warm_metadata, [p for p, _ in files], dirs),
                                     name="foxhunt-prefetch-metadata", daemon=True).start()
                if skip_resident:   # big libraries already in memory (a hot start): nothing to read
                    files = [(p, r) for p, r in files
                             if r[-1][1] < (16 << 20) or resident_fraction(p, samples=64) < 1.0]
            except Exception:   # noqa: BLE001 - best effort like the reads: the checkpoint still warms
                log.debug("prefetch: finding the modules' files failed", exc_info=True)
                files = []
            self.module_paths = [p for p, _ in files]
            n = len(self.paths)
            pieces = [Piece(n + i, off, min(piece_bytes, b - off))
                      for i, (_, ranges) in enumerate(files) for a, b in ranges for off in range(a, b, piece_bytes)]

            def counted(_i: int, piece: Piece, _result) -> None:
                self.module_bytes += piece.length   # under the GIL; a progress figure only
            if pieces and not self._job.cancelled():
                # the imports are waiting for these: at normal priority, hinted, a deep queue
                job = Job(pieces, self._read_module_file, CODE_THREADS, counted, name="foxhunt-prefetch",
                          setup=self._setup_code).start()
                try:
                    job.wait()
                except BaseException:   # noqa: BLE001 - warming imports is best effort
                    pass
        finally:
            self._job.start()   # cancelled: its readers stop at once and done() turns true

    # -- workers
    def _setup(self, worker: int) -> None:
        _quiet.on = True
        if self.priority == "idle":
            set_idle_io_priority()
        if self._method == "read":
            self._buffers[worker] = np.empty(READ_BYTES, np.uint8)

    def _setup_code(self, worker: int) -> None:
        _quiet.on = True
        if self._method == "read":
            self._code_buffers[worker] = np.empty(READ_BYTES, np.uint8)

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
            # paced: small steps, so the disk's queue stays short between them
            n = min(WARM_BYTES if self._pacer.released else PACED_BYTES, piece.end - off)
            self._pacer.take(n)
            src.warm(off, n, self._buffers[worker])   # a short or failed read is an error
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

    def _read_module_file(self, worker: int, piece: Piece) -> None:
        path = self.module_paths[piece.file - len(self.paths)]
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return   # gone or unreadable: the import will say so, not the prefetch
        try:
            self._advise(fd, piece)
            if self._method == "advise" or self._job.cancelled():
                return
            if sendfile_to_null(fd, piece.offset, piece.length) is None:
                buf = self._code_buffers[worker]
                for off in range(piece.offset, piece.end, READ_BYTES):
                    if os.preadv(fd, [buf[:min(READ_BYTES, piece.end - off)]], off) <= 0:
                        return   # shorter than listed (rewritten): nothing more to warm
        except OSError:
            return   # best effort: the import reads its own files
        finally:
            os.close(fd)

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
        return self._job.done() and (t is None or not t.is_alive())

    def wait(self, name: str | None = None, timeout: float | None = None) -> None:
        """Block until the prefetch (or only tensor ``name``'s bytes) is in the page cache.

        Re-raises the first reader error (``pipeline.Cancelled`` after ``cancel``); TimeoutError
        if ``timeout`` seconds pass first.
        """
        if name is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            self._job.wait(timeout)
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
                if self._job.done():
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"prefetch of {name!r} still running")
                self._cond.wait(0.05 if left is None else min(left, 0.05))
            ok = all(self._landed[a:b])
        if not ok:
            self._job.wait()   # raises the error that stopped it
            raise RuntimeError(f"prefetch ended before {name!r} was read")

    def unthrottle(self) -> None:
        """Drop ``max_rate``: read the rest as fast as the disk goes (a load of the files began)."""
        self._pacer.release()

    def cancel(self) -> None:
        """Stop the readers (each finishes at most its current read) and close the files."""
        self._pacer.release()
        self._job.cancel()
        try:
            self._job.wait()
        except BaseException:
            pass
        if self._modules_thread is not None:   # its readers stop at their next 1 MiB read
            self._modules_thread.join()
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
             max_rate: float | None = None, **options) -> PrefetchHandle:
    """Start warming the page cache with a checkpoint's bytes; returns at once with a handle.

    ``source`` and ``names`` are as in ``load_file`` (``names=None``: whole files). ``method``:
    ``"read"`` (hint, then read through a small buffer: done() means resident) or ``"advise"``
    (``posix_fadvise(WILLNEED)`` only: no copies, but the kernel may still be reading after
    done()). Files already fully resident are skipped (``skip_resident``). Options as for the
    loader: ``threads`` (readers; default the loader's count, at most 8), ``chunk_bytes`` (the
    piece each reader hints and reads at a time). ``priority``: ``"idle"`` (the readers' I/O in the
    idle class, see ``set_idle_io_priority``, at most 2 of them by default, reading 1 MiB at a time
    without a WILLNEED hint for the whole piece: little queued ahead of the imports' reads) or
    ``"normal"``.
    ``modules``: top-level packages the process is about to import (``("torch", "nvidia",
    "transformers")``), whose libraries and bytecode are read first (``module_files``): on a cold
    start the imports then find them in memory instead of waiting behind the checkpoint's reads.
    ``imports``: a trace written by ``record_imports`` at an earlier start: exactly the files
    that start loaded (the packages' dependencies and the standard library too), read first in
    the order they were needed; a missing trace (the first start) reads nothing extra.
    ``max_rate``: at most this many bytes per second of the checkpoint (not of the code files),
    until a load of its files starts (``loading``) or ``unthrottle()``: a disk kept busy makes
    every read the imports still do wait behind the prefetch's queue.
    Needs neither torch nor cupy; call it before importing them.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
    Pacer(max_rate)   # a bad max_rate fails here, before any file is opened
    s = _settings.merge(**options)
    # A disk streams sequentially with a few readers (each has a whole piece in flight); more
    # would only compete with the imports running meanwhile for the same disk and cores.
    default = IDLE_THREADS if priority == "idle" else DEFAULT_THREADS
    threads = s.threads if options.get("threads") else min(default, s.threads)
    ck = open_checkpoint(source)
    chosen = select(ck, names)
    spans = _spans(ck, chosen, names is None)
    if skip_resident:
        for f, path in enumerate(ck.paths):
            if spans[f] and resident_fraction(path, samples=1 << 62) >= 1.0:
                spans[f] = []
    if isinstance(modules, (str, bytes)):
        raise TypeError(f"modules takes a list of package names, got the string {modules!r}")
    for m in modules:
        if not m or "." in m:
            raise ValueError(f"modules takes top-level package names, got {m!r}")
    pieces = plan_pieces(spans, s.chunk_bytes)
    keys = [(p.file, p.offset) for p in pieces]
    name_pieces: dict[str, tuple[int, int]] = {}
    for n in chosen:
        f, info = ck.names[n]
        base = ck.headers[f].data_start
        start, end = base + info.start, base + info.end
        # pieces overlapping [start, end): from the last piece starting at or before start
        a = max(0, bisect.bisect_right(keys, (f, start)) - 1)
        while a < len(pieces) and (pieces[a].file, pieces[a].end) <= (f, start):
            a += 1
        b = bisect.bisect_left(keys, (f, end))
        name_pieces[n] = (a, max(a, b))
    sources: dict[int, FileSource] = {}
    try:
        for f in sorted({p.file for p in pieces}):
            sources[f] = open_source(ck.paths[f], "pread", ck.headers[f].file_size)
    except BaseException:
        _close_sources(sources)
        raise
    if imports is not None:
        imports = os.path.expanduser(os.fspath(imports))
        watch_opens()   # so that record_imports can list what this start reads
    modules_first = (tuple(modules), imports, s.chunk_bytes, skip_resident) if modules or imports else None
    return PrefetchHandle(ck, pieces, sources, name_pieces, threads, method, priority, modules_first, max_rate)


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

    For a GPU: importing cupy, creating the CUDA context, allocating the pinned staging pool
    (sized by ``chunk_bytes``/``staging_bytes``, and reused by every later load and save with
    the same settings) and one stream per worker thread. For ``"cpu"``: the host scratch pool.
    With ``background=True`` it runs on a thread and a WarmupHandle is returned at once, so the
    work overlaps whatever the caller does next (building the model); a load that starts before
    it is done waits for the pinned pool instead of allocating a second one. ``verify=True`` also
    builds the GPU checksum kernel that ``load_file(..., verify=True)`` uses (an NVRTC compile).
    """
    from .device import parse_device

    s = _settings.merge(**options)   # in the caller: its settings overrides apply
    dev = parse_device(device)
    if background:
        return WarmupHandle(dev, s, verify)
    return _warm(dev, s, verify)


def _warm(dev, s: _settings.Settings, verify: bool = False) -> dict[str, float]:
    from .device import check_device, context, cupy
    from .target import CudaTarget, HostTarget

    t = time.perf_counter()
    out: dict[str, float] = {}

    def lap(key: str) -> None:
        nonlocal t
        now = time.perf_counter()
        out[key] = now - t
        t = now

    if not dev.is_cuda:
        HostTarget(s.chunk_bytes, min(s.n_slots, s.threads)).pool()   # the size the loader asks for
        lap("host_pool")
        return out
    cp = cupy()
    lap("import_cupy")
    check_device(dev)
    with cp.cuda.Device(dev.index):
        cp.cuda.runtime.free(0)   # forces the (primary) context into existence
    lap("context")
    CudaTarget(dev.index, s.chunk_bytes, s.n_slots, s.threads).pool()
    lap("pinned_pool")
    ctx = context(dev.index)
    for w in range(s.threads):
        ctx.stream(w)
    lap("streams")
    if verify:
        from .device_digest import KernelUnavailable, _kernel
        try:
            _kernel(dev.index)
        except KernelUnavailable:   # loads will hash host copies; they warn about it themselves
            pass
        lap("digest_kernel")
    return out
