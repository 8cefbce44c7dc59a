"""The handle of a background load (``load_file(..., background=True)``).

It holds the load in flight and its open files: ``wait(name)`` blocks on one tensor only,
``result()`` on all of them, ``done()`` polls and ``cancel()`` stops the workers. The files are
closed once the load has finished, failed or been cancelled, never while a worker may read them.
"""

from __future__ import annotations

from typing import Any, Callable

from ..format.dtypes import host_shape
from .inflight import LoadInFlight


class LoadHandle:
    """A background load: ``result()`` waits for all, ``wait(name)`` only for one tensor,
    ``done()`` polls, ``cancel()`` stops it."""

    def __init__(self, load: LoadInFlight, names: list[str], on_close: Callable[[], None]) -> None:
        self._load, self._names = load, names
        self._pos = {n: i for i, n in enumerate(names)}
        self._on_close = on_close
        self._result: dict | None = None
        self._closed = False

    @property
    def names(self) -> list[str]:
        """The tensors this load fills, in the order they were selected."""
        return list(self._names)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of the array each tensor lands as (a slice's, with ``shard``; sub-byte types
        packed in bytes), known from the headers before any byte has landed."""
        return {n: host_shape(d.dtype, tuple(d.shape)) for n, d in zip(self._names, self._load.plan.destinations)}

    @property
    def workers(self) -> int:
        """The worker threads reading for this load."""
        return self._load.job.workers

    def wait(self, name: str) -> Any:
        """The array of tensor ``name``, once it has landed (the rest of the load goes on)."""
        try:
            self._load.wait_dest(self._pos[name])
        except BaseException:
            if self._load.job.done():   # failed or cancelled: release the files now
                self._close()
            raise
        return self._load.dests.array(self._pos[name])

    def done(self) -> bool:
        return self._load.job.done()

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """Every tensor, ``{name: array}``, once all have landed; re-raises the load's error."""
        if self._result is None:
            # A timeout leaves the load running, so its files must stay open: only close once finished.
            if timeout is not None and not self._load.finished(timeout):
                raise TimeoutError("background load still running")
            try:
                self._load.finish()
            finally:
                self._close()
            self._result = dict(zip(self._names, self._load.dests.all_arrays()))
        return self._result

    def cancel(self) -> None:
        self._load.cancel()
        try:
            self._load.finish()
        except BaseException:
            pass
        self._close()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._on_close()
