"""The CUDA runtime calls the pipeline makes: pinned host memory, non-blocking streams, events.

They come from cupy's own thin wrapper of the runtime API, ``cupy_backends.cuda.api.runtime``
(what ``cupy.cuda.runtime`` re-exports), imported alone: a load onto a torch tensor needs no cupy
array, kernel or memory pool, and ``import cupy`` as a whole took 0.11-0.22 s on the H200
machine (``fs.warmup``'s former ``import_cupy`` step), on the critical path of a streamed
startup and holding the GIL the whole time. Where that module cannot be imported by itself
(another cupy layout), cupy is imported and its ``cuda.runtime`` used: the same functions.
``FOXHUNT_CUDART=cupy`` in the environment takes that way from the start (to compare, or should
the lone import misbehave).

Every object here is a raw handle (``ptr``) with the few methods the pipeline calls; the
runtime functions that wait (``streamSynchronize``, ``eventSynchronize``, ``hostAlloc``, the
async copies) release the GIL.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
from typing import Any, Iterator

import numpy as np

from ..errors import DeviceError

STREAM_NON_BLOCKING = 0x01     # cudaStreamNonBlocking: no implicit sync with the legacy default stream
EVENT_DISABLE_TIMING = 0x02    # cudaEventDisableTiming: the cheapest event to record and wait for
HOST_ALLOC_PORTABLE = 0x01     # cudaHostAllocPortable: pinned for every context, like cupy's pools
H2D, D2H = 1, 2                # cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost

_rt: Any = None


def cupy():
    """The cupy module, or a DeviceError saying how to get it."""
    try:
        import cupy as cp
    except ImportError as e:
        raise DeviceError("GPU loading needs cupy: pip install 'foxhunt-stream[cuda12]' or "
                          f"'foxhunt-stream[cuda13]' ({e})") from None
    return cp


def runtime():
    """The runtime module (``memcpyAsync``, ``eventRecord``... as in ``cupy.cuda.runtime``)."""
    global _rt
    if _rt is None:
        try:
            if os.environ.get("FOXHUNT_CUDART", "").strip().lower() == "cupy":
                raise ImportError("FOXHUNT_CUDART=cupy")
            from cupy_backends.cuda.api import runtime as rt
        except Exception:   # absent, or a layout whose runtime needs cupy's own start-up first
            rt = cupy().cuda.runtime   # DeviceError with the install hint if cupy is absent
        _rt = rt
    return _rt


@contextlib.contextmanager
def on_device(index: int) -> Iterator[None]:
    """Make GPU ``index`` current for this thread inside the block (``cupy.cuda.Device``)."""
    rt = runtime()
    prev = rt.getDevice()
    if prev != index:
        rt.setDevice(index)
    try:
        yield
    finally:
        if prev != index:
            rt.setDevice(prev)


class Stream:
    """A non-blocking stream of the current device, destroyed with the object."""

    __slots__ = ("ptr",)

    def __init__(self) -> None:
        self.ptr = runtime().streamCreateWithFlags(STREAM_NON_BLOCKING)

    def synchronize(self) -> None:
        runtime().streamSynchronize(self.ptr)

    def wait_event(self, event: Event) -> None:
        """Later work on this stream waits for ``event`` (on the device, not the host)."""
        runtime().streamWaitEvent(self.ptr, event.ptr)

    def __del__(self) -> None:
        _destroy("streamDestroy", getattr(self, "ptr", 0))


class Event:
    """An event without timing, recorded on a stream; ``synchronize`` waits for it on the host."""

    __slots__ = ("ptr",)

    def __init__(self) -> None:
        self.ptr = runtime().eventCreateWithFlags(EVENT_DISABLE_TIMING)

    def record(self, stream_ptr: int) -> None:
        runtime().eventRecord(self.ptr, stream_ptr)

    def synchronize(self) -> None:
        runtime().eventSynchronize(self.ptr)

    def __del__(self) -> None:
        _destroy("eventDestroy", getattr(self, "ptr", 0))


class PinnedBuffer:
    """``nbytes`` of page-locked host memory (``cudaHostAlloc``), freed with the object."""

    __slots__ = ("ptr", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.ptr = runtime().hostAlloc(nbytes, HOST_ALLOC_PORTABLE)

    def array(self) -> np.ndarray:
        """A uint8 view of the whole buffer that keeps the buffer alive."""
        view = (ctypes.c_ubyte * self.nbytes).from_address(self.ptr)
        view.owner = self   # numpy's base is the ctypes array, which holds this
        return np.frombuffer(view, np.uint8)

    def __del__(self) -> None:
        _destroy("freeHost", getattr(self, "ptr", 0))


def pinned(nbytes: int) -> tuple[np.ndarray, PinnedBuffer]:
    """A pinned staging slot for ``StagingPool``: (uint8 array, the allocation it lives in)."""
    buf = PinnedBuffer(nbytes)
    return buf.array(), buf


_exiting = False


@atexit.register
def _at_exit() -> None:
    """From here on handles are left to the process's end, as cupy does: its finalization may
    already have torn down what a free would need."""
    global _exiting
    _exiting = True


def _destroy(call: str, ptr: int) -> None:
    """Free a handle at garbage collection (not at interpreter exit, see ``_at_exit``)."""
    if not ptr or _rt is None or _exiting:
        return
    try:
        getattr(_rt, call)(ptr)
    except Exception:
        pass
