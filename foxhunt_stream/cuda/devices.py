"""Devices: parse a device argument, check that a GPU exists, and one stream per worker per GPU
(the CUDA runtime imported lazily: ``import foxhunt_stream`` works on a machine without it)."""

from __future__ import annotations

import os
import threading
from typing import NamedTuple

from ..errors import DeviceError
from . import runtime as cudart
from .runtime import cupy  # noqa: F401  (the cupy module, or a DeviceError with the install hint)


class Device(NamedTuple):
    """A place arrays live: the host, or one GPU (a tuple, as the load's other value types)."""
    kind: str      # "cpu" | "cuda"
    index: int = 0

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"


CPU = Device("cpu")


def parse_device(device) -> Device:
    """``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``N`` or a ``torch.device``."""
    if isinstance(device, Device):
        return device
    if device is None:
        return CPU
    if isinstance(device, bool):
        raise DeviceError(f"invalid device {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise DeviceError(f"invalid device {device!r}: a GPU index is non-negative")
        return Device("cuda", device)
    if type(device).__module__ == "torch" and type(device).__name__ == "device":
        return Device("cpu") if device.type == "cpu" else parse_device(
            f"{device.type}:{device.index if device.index is not None else 0}")
    if isinstance(device, str):
        s = device.strip().lower()
        if s == "cpu":
            return CPU
        if s == "cuda":
            return Device("cuda", 0)
        if s.startswith("cuda:") and s[5:].isdigit():
            return Device("cuda", int(s[5:]))
    raise DeviceError(f"invalid device {device!r}; use 'cpu', 'cuda', 'cuda:N' or an int")


def check_device(device: Device) -> None:
    """DeviceError, saying why and what fixes it, unless ``device`` is a CUDA device that exists."""
    if not device.is_cuda:
        return
    try:
        rt = cudart.runtime()
    except DeviceError as e:
        raise DeviceError(f"{device} cannot be used: {e}") from None
    try:
        n = rt.getDeviceCount()
    except Exception as e:  # cudaErrorNoDevice, no driver or one too old...
        from .diagnose import runtime_failure
        raise DeviceError(f"{device} cannot be used: " + runtime_failure(
            str(e), cudart.describe(), _version(rt.runtimeGetVersion), _version(rt.driverGetVersion),
            os.environ.get("CUDA_VISIBLE_DEVICES"))) from None
    if device.index >= n:
        raise DeviceError(f"{device}: no such GPU; this machine has {n} CUDA device(s)")


def _version(call) -> int:
    try:
        return int(call())
    except Exception:
        return 0


_current = threading.local()


def use_device(index: int) -> None:
    """Make GPU ``index`` current for this thread (once: a worker thread keeps it)."""
    if getattr(_current, "index", None) != index:
        cudart.runtime().setDevice(index)
        _current.index = index


def cuda_available() -> bool:
    try:
        check_device(Device("cuda", 0))
        return True
    except DeviceError:
        return False


# ---------------------------------------------------------------- per-device streams

class CudaContext:
    """The non-blocking streams of one device (one per worker), created on first use, reused after."""

    def __init__(self, index: int) -> None:
        self.index = index
        self._streams: list = []
        self._lock = threading.Lock()

    def stream(self, worker: int) -> cudart.Stream:
        with self._lock:
            while len(self._streams) <= worker:
                with cudart.on_device(self.index):
                    self._streams.append(cudart.Stream())
            return self._streams[worker]

    @property
    def streams_made(self) -> int:
        """How many worker streams exist so far (``warmup`` makes one per worker up front)."""
        return len(self._streams)

    def synchronize(self) -> None:
        for s in list(self._streams):
            s.synchronize()


_contexts: dict[int, CudaContext] = {}
_ctx_lock = threading.Lock()


def context(index: int) -> CudaContext:
    with _ctx_lock:
        ctx = _contexts.get(index)
        if ctx is None:
            ctx = _contexts[index] = CudaContext(index)
        return ctx
