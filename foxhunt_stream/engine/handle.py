"""The handle of a background load (``load_file(..., background=True)``): ``wait(name)``, ``result()``,
``done()``, ``cancel()`` (then ``fs.CancelledError``). The load closes its own files when its last
worker stops, however the handle is used or dropped.
"""

from __future__ import annotations

from typing import Any

from ..format.dtypes import host_shape
from .inflight import LoadInFlight


class LoadHandle:
    """A background load: ``result()`` waits for all, ``wait(name)`` only for one tensor,
    ``done()`` polls, ``cancel()`` stops it."""

    def __init__(self, load: LoadInFlight, names: list[str]) -> None:
        self._load, self._names = load, names
        self._pos: dict[str, int] | None = None   # name -> destination, made on the first wait(name)
        self._result: dict | None = None

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
        if self._pos is None:
            self._pos = {n: i for i, n in enumerate(self._names)}
        d = self._pos[name]
        self._load.wait_dest(d)
        return self._load.dests.array(d)

    def done(self) -> bool:
        return self._load.job.done()

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """Every tensor, ``{name: array}``, once all have landed; re-raises the load's error
        (``fs.CancelledError`` after ``cancel()``). With ``timeout``, TimeoutError if the load is
        still running then (it goes on)."""
        if self._result is None:
            if timeout is not None and not self._load.finished(timeout):
                raise TimeoutError("background load still running")
            self._load.finish()
            self._result = dict(zip(self._names, self._load.dests.all_arrays()))
        return self._result

    def cancel(self) -> None:
        """Stop the load: its workers take no further chunk, and it waits for those in flight."""
        self._load.cancel()
        try:
            self._load.finish()
        except BaseException:  # noqa: BLE001 - the cancellation itself, or the error it overtook
            pass
