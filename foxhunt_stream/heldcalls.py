"""The two CUDA calls of every loaded chunk, made while holding the GIL.

cupy's wrappers release the GIL around each CUDA call. With 16 workers, taking it back after a
call is a wait behind the other workers' Python (a convoy), so a call that takes microseconds
costs a hand-off that takes longer. ``cuMemcpyHtoDAsync`` from pinned memory and ``cuEventRecord``
only queue work on a stream (a worker has at most two copies queued, far below the stream's
limit), so they never block: the loader makes them through ``ctypes.PyDLL``, which keeps the GIL
during the call. The blocking calls (the read, ``cudaEventSynchronize``) still release it.

``held_calls()`` is None where the driver library cannot be loaded; the caller then uses cupy.
``ENABLED = False`` (or ``FOXHUNT_HELD_CALLS=0``) turns this off, for comparison.
"""

from __future__ import annotations

import ctypes
import os
import threading

from .errors import DeviceError

ENABLED = os.environ.get("FOXHUNT_HELD_CALLS", "1") != "0"
DRIVER_LIBRARY = "libcuda.so.1"


class HeldCalls:
    """``copy_h2d`` and ``record`` on driver handles (the runtime's streams and events are the
    same handles); a failure raises DeviceError with the driver's error name."""

    def __init__(self, lib) -> None:
        c = ctypes
        self._copy = lib.cuMemcpyHtoDAsync_v2
        self._copy.argtypes = [c.c_uint64, c.c_void_p, c.c_size_t, c.c_void_p]
        self._copy.restype = c.c_int
        self._record = lib.cuEventRecord
        self._record.argtypes = [c.c_void_p, c.c_void_p]
        self._record.restype = c.c_int
        self._error_name = lib.cuGetErrorName
        self._error_name.argtypes = [c.c_int, c.POINTER(c.c_char_p)]
        self._error_name.restype = c.c_int
        self._ctx_current = lib.cuCtxGetCurrent
        self._ctx_current.argtypes = [c.POINTER(c.c_void_p)]
        self._ctx_current.restype = c.c_int

    def copy_h2d(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        rc = self._copy(dst, src, nbytes, stream)
        if rc:
            self._fail(rc, f"cuMemcpyHtoDAsync of {nbytes} bytes")

    def record(self, event: int, stream: int) -> None:
        rc = self._record(event, stream)
        if rc:
            self._fail(rc, "cuEventRecord")

    def has_context(self) -> bool:
        """True when this thread has a current CUDA context (the driver calls need one)."""
        ctx = ctypes.c_void_p()
        return self._ctx_current(ctypes.byref(ctx)) == 0 and bool(ctx.value)

    def _fail(self, rc: int, what: str) -> None:
        name = ctypes.c_char_p()
        known = self._error_name(rc, ctypes.byref(name)) == 0 and name.value
        raise DeviceError(f"{what} failed: {name.value.decode() if known else f'CUDA driver error {rc}'}")


_held: HeldCalls | None = None
_loaded = False
_lock = threading.Lock()


def held_calls() -> HeldCalls | None:
    """The process's HeldCalls, or None (turned off, or no loadable driver library)."""
    global _held, _loaded
    if not ENABLED:
        return None
    with _lock:
        if not _loaded:
            _loaded = True
            try:
                _held = HeldCalls(ctypes.PyDLL(DRIVER_LIBRARY))
            except (OSError, AttributeError):
                _held = None
        return _held
