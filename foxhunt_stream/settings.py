"""Settings: defaults in code, ``FOXHUNT_*`` environment overrides (validated loudly),
per-call keyword options, and a ``with settings.override(...)`` block."""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import os
import re
import warnings
from typing import Literal, NamedTuple, get_args

from .errors import OptionError

Backend = Literal["auto", "pread", "mmap", "direct"]   # how a load reads (io.source)
DirectIO = Literal["auto", "on", "off"]
WriteBackend = Literal["auto", "mmap", "pwrite"]   # how a save writes (io.sink.AtomicFile)
VerifyOn = Literal["auto", "read", "landed"]
WRITE_BACKENDS: tuple[str, ...] = get_args(WriteBackend)

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


MAX_SIZE = 2**63 - 1   # a size is a byte count or a file offset: at most the largest off_t


def parse_size(value: int | str) -> int:
    """``5GB`` -> 5_000_000_000, ``500MiB`` -> 524_288_000, ``0.5KiB`` -> 512, ints pass through.

    Exact (integer arithmetic, no float rounding); a size above ``MAX_SIZE`` is an OptionError."""
    if isinstance(value, bool):
        raise OptionError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise OptionError(f"size must be non-negative, got {value}")
        size = value
    else:
        m = re.fullmatch(r"\s*([0-9]+)(?:\.([0-9]{1,30}))?\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(3).lower() not in _UNITS:
            raise OptionError(f"not a size: {_shown(value)} (examples: 1048576, 512MiB, 5GB)")
        whole, frac, unit = m.group(1).lstrip("0"), m.group(2) or "", _UNITS[m.group(3).lower()]
        if len(whole) > 20:   # beyond MAX_SIZE whatever the unit (and int() of it may be refused)
            size = MAX_SIZE + 1
        else:
            size = int(whole + frac or "0") * unit // 10 ** len(frac)
    if size > MAX_SIZE:
        raise OptionError(f"size {_shown(value)} is too large (at most 2**63 - 1 bytes)")
    return size


def _shown(value) -> str:
    """``repr(value)``, cut short: a 400-digit value is named, not printed whole."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}...({len(text)} characters)"


def available_cpus() -> int:
    """CPUs this process may run on (its affinity, where the platform says)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_threads(background: bool = False) -> int:
    """Workers when none were asked for: one per CPU, less one CPU in eight left to the caller's
    thread and the CUDA driver's (14 of 16: a TP rank's first load came sooner, RESULTS.md), at most
    16; for a background load three quarters of that many CPUs, so that the caller's thread
    (building the model, running its forward) finds one."""
    cpus = available_cpus()
    return max(1, min(16, cpus) * 3 // 4 if background else min(16, cpus - cpus // 8))


class Settings(NamedTuple):
    """One load's or save's settings, immutable (a NamedTuple: made in a fraction of a frozen
    dataclass's time, and every load's first call imports it)."""

    threads: int = 0                 # reader/writer threads; 0 = one per CPU less one in eight, at most 16
                                     # (a background load: three quarters of the CPUs; default_threads)
    chunk_bytes: int = 8 << 20       # a staging slot: the most one copy moves (a gathered column slice
                                     # fills it; 8 MiB) and the checksum block
    read_bytes: int = 4 << 20        # a load to a GPU reads and copies contiguous runs (tensors, row slices)
                                     # of cached files in pieces of this much, at most chunk_bytes;
                                     # host loads and cold files: whole chunks
    staging_bytes: int = 256 << 20   # pinned staging per device (slots = staging / chunk; 2 per worker)
    backend: Backend = "auto"        # positional reads, and the column slices of files in the page cache
                                     # gathered out of a mapping (io.read_policy)
    direct_io: DirectIO = "auto"     # auto: O_DIRECT only for files that would not stay in the cache
    write_backend: WriteBackend = "auto"   # auto: mmap for big files on tmpfs written by >= 8 threads
    verify_on: VerifyOn = "auto"     # where verify=True hashes (auto: on the GPU for
                                     # xxh3-64 tensors landing there, else as chunks are read; integrity.Verifier)

    def resolved(self, background: bool = False) -> "Settings":
        """``threads=0`` made concrete (``background``: for a load the caller works beside)."""
        if self.threads:
            return self
        return self._replace(threads=default_threads(background))

    def validate(self) -> "Settings":
        problem = self.problem()
        if problem:
            raise OptionError(problem[1])
        return self

    def problem(self) -> tuple[tuple[str, ...], str] | None:
        """The first setting out of range: the fields involved and what is wrong; None if none is."""
        from .io.source import BACKENDS
        if not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads < 0:
            return ("threads",), f"threads must be a non-negative int, got {self.threads!r}"
        if self.chunk_bytes < 4096:
            return ("chunk_bytes",), f"chunk_bytes must be at least 4096, got {self.chunk_bytes}"
        if self.read_bytes < 4096:
            return ("read_bytes",), f"read_bytes must be at least 4096, got {self.read_bytes}"
        if self.staging_bytes < self.chunk_bytes:
            return (("staging_bytes", "chunk_bytes"),
                    f"staging_bytes ({self.staging_bytes}) must hold at least one chunk ({self.chunk_bytes})")
        if self.backend not in BACKENDS:
            return ("backend",), f"backend must be one of {', '.join(BACKENDS)}, got {_shown(self.backend)}"
        if self.write_backend not in WRITE_BACKENDS:
            return (("write_backend",),
                    f"write_backend must be one of {', '.join(WRITE_BACKENDS)}, got {_shown(self.write_backend)}")
        if self.verify_on not in get_args(VerifyOn):
            return ("verify_on",), f"verify_on must be 'auto', 'read' or 'landed', got {_shown(self.verify_on)}"
        if self.direct_io not in get_args(DirectIO):
            return ("direct_io",), f"direct_io must be 'auto', 'on' or 'off', got {_shown(self.direct_io)}"
        return None

    @property
    def n_slots(self) -> int:
        return max(1, self.staging_bytes // self.chunk_bytes)

    @property
    def read_cut(self) -> int:
        """The piece a contiguous run is cut into: ``read_bytes``, at most a slot."""
        return min(self.read_bytes, self.chunk_bytes)


_SIZE_FIELDS = {"chunk_bytes", "read_bytes", "staging_bytes"}


def _coerce(name: str, value):
    if name in _SIZE_FIELDS:
        return parse_size(value)
    if name == "threads":
        if isinstance(value, str):
            if not value.strip().isdigit():
                raise OptionError(f"threads must be an integer, got {value!r}")
            return int(value)
        return value
    if name == "direct_io" and isinstance(value, bool):
        return "on" if value else "off"
    return value


# FOXHUNT_* variables read elsewhere: cuda.runtime's choice of CUDA runtime, and the project's own
# test and benchmark knobs. Any other FOXHUNT_* name is a misspelling, warned about once.
OTHER_VARIABLES = ("FOXHUNT_CUDART", "FOXHUNT_STRESS_SECONDS", "FOXHUNT_BENCH_BYTES")
_warned: set[str] = set()


def _warn_unknown_variables() -> None:
    """One warning per unknown ``FOXHUNT_*`` variable of the environment, per process."""
    known = {"FOXHUNT_" + f.upper() for f in Settings._fields} | set(OTHER_VARIABLES)
    for name in sorted(os.environ):
        if name.startswith("FOXHUNT_") and name not in known and name not in _warned:
            _warned.add(name)
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            warnings.warn(f"environment variable {name} is not a foxhunt_stream setting ({hint}known: "
                          f"{', '.join(sorted(known))}); it is ignored", UserWarning, stacklevel=4)


def _env_name(field: str) -> str:
    return "FOXHUNT_" + field.upper()


def _from_env() -> Settings:
    """The defaults with the environment's ``FOXHUNT_*`` values; a bad value is an OptionError
    naming the variable and the value it holds."""
    _warn_unknown_variables()
    kw = {}
    for f in Settings._fields:
        env = _env_name(f)
        if env in os.environ:
            try:
                kw[f] = _coerce(f, os.environ[env])
            except ValueError as e:
                raise OptionError(f"environment variable {env}={_shown(os.environ[env])}: {e}") from None
    s = Settings(**kw)
    problem = s.problem()
    if problem:
        involved, message = problem
        named = [f"{_env_name(f)}={_shown(os.environ[_env_name(f)])}" for f in involved if f in kw]
        raise OptionError(f"environment variable {' and '.join(named)}: {message}")
    return s


_current: contextvars.ContextVar[Settings | None] = contextvars.ContextVar("foxhunt_settings", default=None)


def current() -> Settings:
    s = _current.get()
    if s is None:
        s = _from_env()
        _current.set(s)
    return s


def _apply(options: dict) -> Settings:
    """Current settings with ``options`` applied (None = keep); unknown names are a TypeError."""
    known = set(Settings._fields)
    unknown = set(options) - known
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(sorted(unknown))}; valid: {', '.join(sorted(known))}")
    kw = {k: _coerce(k, v) for k, v in options.items() if v is not None}
    return current()._replace(**kw).validate()


def merge(*, background: bool = False, **options) -> Settings:
    """Current settings with per-call options applied; unknown options are an error.
    ``background``: the settings of a load that runs beside its caller (fewer default threads)."""
    return _apply(options).resolved(background)


@contextlib.contextmanager
def override(**options):
    """``with foxhunt_stream.settings.override(threads=4): ...`` restores the old values after.

    Checked like per-call options (an unknown name is a TypeError listing the valid ones)."""
    token = _current.set(_apply(options))
    try:
        yield current()
    finally:
        _current.reset(token)
