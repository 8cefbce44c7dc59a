"""The code a start reads, for the next start's prefetch to read first (docs/startup.md): every
library and bytecode file of named packages (``module_files``), or an import trace that
``record_imports`` writes and ``read_trace`` gives back; directory listings and inodes too.
"""

from __future__ import annotations

import os
import stat
import threading
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:   # numpy only where a trace is recorded: a prefetch replays one before numpy loads
    import numpy as np

MODULE_SUFFIXES = (".so", ".pyc", ".pyd", ".dylib")


def module_files(modules: Sequence[str]) -> list[tuple[str, int]]:
    """The files an import of each top-level package would read: its shared libraries and
    bytecode (``(path, size)``, packages in the order given, biggest files first within each).
    Found with ``importlib.util.find_spec``, which imports nothing; unknown names are skipped."""
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
    """Pure: ``(start, end)`` byte ranges sorted, merged where they overlap or lie under ``gap`` apart."""
    out: list[list[int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def present_runs(entries: np.ndarray) -> list[tuple[int, int]]:
    """Pure: ``[i, j)`` runs of pages whose ``/proc/self/pagemap`` entry has the present bit (63)."""
    import numpy as np
    present = np.concatenate(([False], (entries >> np.uint64(63)).astype(bool), [False]))
    edges = np.flatnonzero(present[1:] != present[:-1])
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def mapped_libraries() -> dict[str, list[tuple[int, int]]]:
    """The shared objects mapped into this process and, per file, the byte ranges its code has
    touched (pages present in ``/proc/self/pagemap``), which a replay reads instead of the whole
    file; ``[]`` where the pages cannot be inspected (read it whole); {} off Linux."""
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    out: dict[str, list[tuple[int, int]]] = {}
    whole: set[str] = set()   # pages not inspectable: read the whole file
    try:
        maps = open("/proc/self/maps")
    except OSError:
        return out
    try:
        pagemap = open("/proc/self/pagemap", "rb", buffering=0)
    except OSError:
        pagemap = None
    import numpy as np
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
                whole.add(path)
                continue
            ranges += [(offset + i * page, offset + j * page) for i, j in present_runs(entries)]
    if pagemap is not None:
        pagemap.close()
    return {p: [] if p in whole else merge_ranges(r) for p, r in out.items()}


_quiet = threading.local()       # .on in foxhunt's own threads (unwatch_this_thread): their opens are not noted
_opened: list[str] = []          # files opened for reading / directories listed, in order (watch_opens)
_watching = False
DATA_FILE_LIMIT = 64 << 20       # bigger files opened by Python code (checkpoints) are not traced
_UNTRACED = ("/proc/", "/sys/", "/dev/")
OPENED_LIMIT = 1 << 16           # notes kept at most: a start's imports read a few thousand files


def _audit(event: str, args: tuple) -> None:
    """The audit hook (PEP 578) of ``watch_opens``: cheap, and never raises (it runs in every
    thread for every audited event, for the rest of the process: hooks cannot be removed)."""
    if event != "open" and event != "os.listdir" and event != "os.scandir":
        return
    try:
        _note(event, args)
    except Exception:   # noqa: BLE001 - a hook must not break the open it watches
        pass


def _note(event: str, args: tuple) -> None:
    if len(_opened) >= OPENED_LIMIT:   # a long-running server keeps opening files: bounded
        return
    if event == "open":
        path, mode, flags = args
        if not isinstance(path, str):
            return
        if isinstance(mode, str) and mode:
            if "w" in mode or "a" in mode or "x" in mode or "+" in mode:
                return
        elif not isinstance(flags, int) or flags & 3:   # O_WRONLY / O_RDWR
            return
    else:
        path = args[0] if args else None
        if not isinstance(path, str) or not path:
            return
        path = path.rstrip(os.sep) + os.sep
    if getattr(_quiet, "on", False) or path.startswith(_UNTRACED):
        return
    _opened.append(os.path.abspath(path) + (os.sep if path.endswith(os.sep) else ""))


def unwatch_this_thread() -> None:
    """From now on, this (foxhunt) thread's opens are not noted by ``watch_opens``: a prefetch's
    own reads (the trace, the code files, the checkpoint) are not what the start read."""
    _quiet.on = True


def run_unwatched(fn, *args) -> None:
    """``fn(*args)`` as the body of a foxhunt thread whose opens are not noted."""
    unwatch_this_thread()
    fn(*args)


def watch_opens() -> None:
    """From now on, note each file Python code opens for reading and each directory it lists
    (an audit hook, installed once per process), for ``record_imports``."""
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


def loaded_files(libraries: dict[str, list[tuple[int, int]]], opened: list[str]) -> list[str]:
    """The code files this process has loaded so far (its ``libraries``, bytecode, extension
    modules) and the other files its Python code read (``opened``, in the order they were opened),
    in the order a restart needs them (``order_loaded_files``)."""
    import sys

    def real(f) -> str | None:
        if not isinstance(f, str) or not f:
            return None
        try:
            return os.path.realpath(f) if os.path.isfile(f) else None
        except (OSError, ValueError):
            return None
    mods = [(f, None) for f in opened] + [(real(getattr(m, "__file__", None)), real(getattr(m, "__cached__", None)))
                                          for m in list(sys.modules.values())]
    mapped = list(libraries)   # not Linux: modules only
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
    """Write this process's ``loaded_files`` to ``path`` (text, replaced atomically) for the
    next start's ``prefetch(..., imports=path)``; returns how many files it lists. Shared
    libraries are listed with the byte ranges this process touched (``mapped_libraries``).

    Call it once the model has answered (the first forward loads cuBLAS and friends too)."""
    from ..io.sink import write_small   # numpy: a trace is recorded long after the prefetch
    libraries = mapped_libraries()
    opened, dirs = opened_files()
    files = loaded_files(libraries, opened)   # one look at the process: the two cannot disagree
    text = format_trace(files + [d + os.sep for d in dirs], libraries)
    path = os.path.abspath(os.fspath(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_small(path, text.encode("utf-8", "surrogateescape"), fsync=False)   # any file name
    return len(files)


def parse_import_trace(text: str) -> list[tuple[str, list[tuple[int, int]] | None]]:
    """Pure: ``(path, ranges)`` per line of a trace (``format_trace``); ranges ``None`` means the
    whole file. Blank and ``#`` lines are skipped, as are ranges that do not parse."""
    out: list[tuple[str, list[tuple[int, int]] | None]] = []
    for line in text.split("\n"):   # only "\n" ends a line: "\r", "\x85"... are legal in names
        if not line.strip() or line.startswith("#"):
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
        out.append((path, ranges))
    return out


CodeFile = tuple[str, list[tuple[int, int]]]   # a file and the (start, end) ranges to read


def read_trace(path: str | os.PathLike) -> tuple[list[CodeFile], list[str]]:
    """The files of a trace that still exist, with the ranges to read (clipped to the file's
    size now), and the directories it lists (lines ending in a separator). A missing or
    unreadable trace lists nothing; lines that name no file are skipped."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:   # names as os gives them
            listed = parse_import_trace(f.read())
    except (OSError, ValueError):   # best effort: a trace never stops the prefetch
        return [], []
    out: list[CodeFile] = []
    dirs: list[str] = []
    for p, ranges in listed:
        if "\0" in p:
            continue
        if p.endswith(os.sep) and len(p) > 1:
            dirs.append(p.rstrip(os.sep) or os.sep)
            continue
        try:
            st = os.stat(p)
        except (OSError, ValueError):   # uninstalled or upgraded since (or not a path): skip it
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        spans = [(a, min(b, st.st_size)) for a, b in (ranges or [(0, st.st_size)]) if a < st.st_size]
        if spans:
            out.append((p, spans))
    return out, dirs


def code_files(modules: Sequence[str], imports: str | os.PathLike | None) -> tuple[list[CodeFile], list[str]]:
    """What a prefetch reads first: the trace's files, then the packages' others; the trace's directories."""
    out, dirs = read_trace(imports) if imports is not None else ([], [])
    if modules:
        listed = {p for p, _ in out}
        out += [(p, [(0, n)]) for p, n in module_files(modules) if p not in listed]
    return out, dirs


def prefetch_metadata(files: Sequence[str], dirs: Sequence[str] = (), stop=None) -> None:
    """What an import touches besides the bytecode, done ahead so that it finds them cached: the
    listing of each package directory (and of ``dirs``) and the source file's ``stat`` (the
    bytecode is checked against it). ``stop()`` true: return at once (cancel)."""
    listed: set[str] = set()

    def list_once(d: str) -> None:
        if d not in listed:
            listed.add(d)
            try:
                os.listdir(d)
            except (OSError, ValueError):   # gone, or a name with a NUL: best effort
                pass
    for d in dirs:
        if stop is not None and stop():
            return
        list_once(d)
    for p in files:
        if stop is not None and stop():
            return
        d = os.path.dirname(p)
        if os.path.basename(d) == "__pycache__":   # pkg/__pycache__/mod.cpython-312.pyc -> pkg, pkg/mod.py
            d = os.path.dirname(d)
            try:
                os.stat(os.path.join(d, os.path.basename(p).split(".", 1)[0] + ".py"))
            except (OSError, ValueError):
                pass
        list_once(d)


def dist_records(files: Sequence[str]) -> list[str]:
    """The ``RECORD`` files of installed distributions among ``files``: ``Distribution.files`` (called
    at ``import transformers``) stats every file one lists, seconds of a cold import."""
    return [p for p in files if os.path.basename(p) == "RECORD" and os.path.dirname(p).endswith(".dist-info")]


def record_paths(record: str, text: str) -> list[str]:
    """Pure: the paths a ``RECORD`` (CSV, first column) lists, made absolute against the directory
    that holds its ``.dist-info`` (where ``Distribution.locate_file`` looks)."""
    import csv
    base = os.path.dirname(os.path.dirname(record))
    out = []
    try:
        for row in csv.reader(text.splitlines()):
            if row and row[0] and "\0" not in row[0]:
                out.append(os.path.normpath(os.path.join(base, row[0])))
    except csv.Error:   # a damaged RECORD: what parsed so far
        pass
    return out


def prefetch_record_metadata(records: Sequence[str], stop=None, threads: int = 4) -> int:
    """``stat`` every file the ``records`` list (``dist_records``), with ``threads`` threads, so
    the inodes ``Distribution.files`` looks at are cached; returns how many were stat'ed.
    ``stop()`` true: return soon. Best effort: what is missing or unreadable is skipped."""
    paths: list[str] = []
    for r in records:
        try:
            with open(r, encoding="utf-8", errors="surrogateescape") as f:
                paths += record_paths(r, f.read())
        except (OSError, ValueError):
            continue
    if not paths:
        return 0
    done = [0] * threads

    def run(k: int) -> None:
        for p in paths[k::threads]:
            if stop is not None and stop():
                return
            try:
                os.stat(p)
            except (OSError, ValueError):
                pass
            done[k] += 1
    workers = [threading.Thread(target=run, args=(k,), name="foxhunt-prefetch-records", daemon=True)
               for k in range(1, threads)]
    for t in workers:
        t.start()
    run(0)
    for t in workers:
        t.join()
    return sum(done)
