"""The CUDA runtime calls the pipeline makes: pinned host memory, non-blocking streams, events.

``runtime()`` hands out one module-like object with the names of cupy's own thin wrapper of the
runtime API (``hostAlloc``, ``memcpyAsync``, ``eventRecord``...), chosen once per process:

- ``cupy_backends.cuda.api.runtime``, where cupy is installed, imported alone. A load onto torch
  tensors needs no cupy array, kernel or memory pool, and ``import cupy`` as a whole took
  0.11-0.22 s on an H200 machine, on the critical path of a streamed startup, holding the GIL.
- Else the CUDA runtime library torch has loaded (``libcudart.LibCudart``), so a torch user
  needs no cupy at all.
- Else ``cupy.cuda.runtime`` (another cupy layout).
- Else a DeviceError that says why and what fixes it (``diagnose``).

``FOXHUNT_CUDART=cupy`` takes cupy's from the start (to compare, or should the lone import
misbehave), ``FOXHUNT_CUDART=torch`` the one torch loaded even where cupy is installed.

Every object here is a raw handle (``ptr``) with the few methods the pipeline calls; the
runtime functions that wait (``streamSynchronize``, ``eventSynchronize``, ``hostAlloc``, the
async copies) release the GIL.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib.util
import mmap
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from ..errors import DeviceError
from . import libcudart

if TYPE_CHECKING:
    from .diagnose import TorchFacts

STREAM_NON_BLOCKING = 0x01     # cudaStreamNonBlocking: no implicit sync with the legacy default stream
EVENT_DISABLE_TIMING = 0x02    # cudaEventDisableTiming: the cheapest event to record and wait for
HOST_ALLOC_PORTABLE = 0x01     # cudaHostAllocPortable: pinned for every context, like cupy's pools
HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable: the same for registered memory
HUGE_PAGE = 2 << 20            # a transparent huge page (x86-64, arm64 with 4 KiB pages)
MADV_HUGEPAGE = 14             # Linux's madvise advice for transparent huge pages
H2D, D2H = 1, 2                # cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost

_rt: Any = None
CUDART_CHOICES = ("auto", "cupy", "torch")   # FOXHUNT_CUDART


def cupy():
    """The cupy module, or a DeviceError saying how to get it."""
    try:
        import cupy as cp
    except ImportError as e:
        from .diagnose import CUPY_INSTALL   # the words of errors: imported when one is raised
        raise DeviceError(f"this needs cupy: {CUPY_INSTALL} ({e})") from None
    return cp


def has_cupy() -> bool:
    """Whether cupy is installed (not imported: that costs 0.1-0.2 s)."""
    return _installed("cupy")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def torch_facts() -> TorchFacts:
    """What this process knows of torch, without importing it."""
    from . import diagnose
    torch = sys.modules.get("torch")
    if torch is None:
        return diagnose.TorchFacts(installed=_installed("torch"))
    version = getattr(torch, "version", None)
    return diagnose.TorchFacts(True, True, str(getattr(torch, "__version__", "")), getattr(version, "cuda", None),
                               getattr(version, "hip", None))


def runtime():
    """The runtime (``memcpyAsync``, ``eventRecord``... as in ``cupy.cuda.runtime``), chosen on
    first use; a DeviceError saying why and what fixes it where there is none."""
    global _rt
    if _rt is None:
        _rt = _choose(os.environ.get("FOXHUNT_CUDART", "").strip().lower() or "auto")
    return _rt


def _choose(choice: str):
    if choice not in CUDART_CHOICES:
        raise DeviceError(f"FOXHUNT_CUDART must be one of {', '.join(CUDART_CHOICES)} (or unset), got {choice!r}")
    if choice == "auto":
        try:
            from cupy_backends.cuda.api import runtime as rt
            return rt
        except Exception:   # absent, or a layout whose runtime needs cupy's own start-up first
            pass
    if choice in ("auto", "torch"):
        try:
            lib = libcudart.open_loaded()
        except (OSError, AttributeError):   # not a usable runtime library after all
            lib = None
        if lib is not None:
            return lib
        if choice == "torch":
            raise DeviceError(f"FOXHUNT_CUDART=torch, but no CUDA runtime library is loaded in this process: "
                              f"{_no_runtime()}")
    try:
        return cupy().cuda.runtime
    except DeviceError:
        if choice == "cupy":
            raise
        raise DeviceError(_no_runtime()) from None


def _no_runtime() -> str:
    """Why no CUDA runtime can be had here, and the fixes (the words of a DeviceError)."""
    from .diagnose import no_runtime
    return no_runtime(torch_facts(), has_cupy(), has_driver())


def has_driver() -> bool:
    """Whether the NVIDIA driver's library (libcuda) loads in this process."""
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def describe() -> str:
    """Which CUDA runtime the pipeline calls, in words (for errors, logs and the bench header)."""
    rt = runtime()
    if isinstance(rt, libcudart.LibCudart):
        return f"torch's CUDA runtime ({rt.path})"
    return "cupy's CUDA runtime"


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
    """A pinned slot of ``cudaHostAlloc`` memory: (uint8 array, the allocation it lives in)."""
    buf = PinnedBuffer(nbytes)
    return buf.array(), buf


class PinnedArena:
    """Page-locked host memory for ``n`` slots of ``slot_bytes``, in one anonymous mapping.

    Registering (``cudaHostRegister``) huge pages that several threads faulted in pinned 4-6x
    faster than ``cudaHostAlloc`` (RESULTS: "Pinned staging in a fresh process"). So the mapping
    asks for huge pages and ``pin(k)`` faults slot ``k`` in on the calling thread (a ``memset``,
    the GIL released; ``MADV_POPULATE_WRITE`` would hold the process's memory-map lock, which
    every ``mmap`` of the loading thread then waits for) and registers it; ``pin_slots`` does the
    same for several consecutive slots in one call (fewer registrations: each slows the process's
    other threads while it runs)."""

    def __init__(self, slot_bytes: int, n: int) -> None:
        from ..io.libc import MAP_FAILED, libc
        self._rt = runtime()
        if not hasattr(self._rt, "hostRegister"):
            raise OSError("this CUDA runtime cannot register host memory")
        self.slot_bytes, self.n = slot_bytes, n
        size = slot_bytes * n + HUGE_PAGE
        addr = libc().mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                           -1, 0)
        if addr in (None, MAP_FAILED):
            raise OSError(ctypes.get_errno(), "mmap of the pinned staging memory failed")
        self._mapping = (addr, size)
        self.base = addr + (-addr) % HUGE_PAGE
        libc().madvise(self.base, slot_bytes * n, MADV_HUGEPAGE)   # a hint: where refused, 4 KiB pages
        self._pinned: list[int] = []
        self._lock = threading.Lock()

    def pin(self, k: int) -> np.ndarray:
        """Slot ``k``, faulted in and registered: a uint8 array that keeps the arena alive."""
        return self.pin_slots(range(k, k + 1))[0]

    def pin_slots(self, ks: range) -> list[np.ndarray]:
        """Slots ``ks`` (consecutive), faulted in by one ``memset`` and registered by one call."""
        from ..io.libc import libc
        ptr, n = self.base + ks.start * self.slot_bytes, len(ks) * self.slot_bytes
        libc().memset(ptr, 0, n)
        self._rt.hostRegister(ptr, n, HOST_REGISTER_PORTABLE)
        with self._lock:
            self._pinned.append(ptr)
        views = []
        for k in ks:
            view = (ctypes.c_ubyte * self.slot_bytes).from_address(self.base + k * self.slot_bytes)
            view.owner = self
            views.append(np.frombuffer(view, np.uint8))
        return views

    def __del__(self) -> None:
        mapping = getattr(self, "_mapping", None)
        if mapping is None or _exiting:
            return
        for ptr in getattr(self, "_pinned", ()):
            try:
                self._rt.hostUnregister(ptr)
            except Exception:
                return   # still registered: leave the mapping to the process's end
        from ..io.libc import libc
        libc().munmap(mapping[0], mapping[1])


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
