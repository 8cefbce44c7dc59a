"""Progress bars for long loads and saves (tqdm, the optional ``progress`` extra): ``progress=None``
draws one on a terminal past about a second, ``True`` always (stderr), ``False`` never.
"""

from __future__ import annotations

import logging
import sys
import threading

log = logging.getLogger("foxhunt_stream")

AUTO_DELAY_S = 1.0   # with progress=None, show nothing for operations shorter than this
_warned = False


class Progress:
    """A thread-safe byte counter drawing a tqdm bar; a no-op when ``bar`` is None."""

    __slots__ = ("_bar", "_lock")

    def __init__(self, bar=None) -> None:
        self._bar = bar
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self._bar is not None

    def update(self, nbytes: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(nbytes)

    def close(self) -> None:
        """Idempotent: the bar is finished and released once."""
        with self._lock:
            bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()


NO_PROGRESS = Progress()


def _wanted(progress: bool | None, stream) -> bool:
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be True, False or None, got {progress!r}")
    if progress is None:
        isatty = getattr(stream, "isatty", None)
        try:
            return bool(isatty and isatty())
        except ValueError:   # closed stream
            return False
    return bool(progress)


def shown(progress: bool | None) -> bool:
    """Whether ``progress`` asks for a bar on stderr (None: when stderr is a terminal)."""
    return _wanted(progress, sys.stderr)


def progress_bar(total_bytes: int, desc: str, progress: bool | None = None, stream=None) -> Progress:
    """A bar over ``total_bytes`` (or the no-op NO_PROGRESS when none is wanted or possible)."""
    stream = sys.stderr if stream is None else stream
    if not _wanted(progress, stream) or total_bytes <= 0:
        return NO_PROGRESS
    try:
        from tqdm import tqdm
    except ImportError:
        global _warned
        if progress and not _warned:
            _warned = True
            log.warning("progress=True needs tqdm: pip install tqdm")
        return NO_PROGRESS
    bar = tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1000, file=stream,
               delay=0 if progress else AUTO_DELAY_S, leave=bool(progress), dynamic_ncols=True,
               mininterval=0.2)
    return Progress(bar)
