"""The native chunk landing (``native_land.c``), where the install could compile it.

A GPU load's worker lands each contiguous chunk in four steps: wait for the slot's last copy,
read the chunk into the pinned slot, queue its copy, record the slot's event. Called from Python
each step releases and re-takes the GIL that all sixteen workers share; ``native_land.c`` runs
the four in one call, releasing it once. That matters where chunks are many and small for the
bytes they carry (a tensor-parallel rank's row shard): on the H200 machine the bare pipeline
moved rank 0 of TP=8's rows (2.008 GB, 641 chunks) in 43.9 ms with one native call per chunk
against 46.7 ms with the Python steps, and a full load's chunks equally fast either way.

``lander_for(runtime)`` hands out the function and the CUDA driver's entry points it calls, or
None when the library was not built (no compiler at install), is switched off
(``FOXHUNT_NATIVE=0``), there is no CUDA driver, or the pipeline's runtime is not a real one (a
test's stand-in); the worker then runs the same steps in Python. The driver's calls are used,
not a runtime's: cupy's runtime and the one torch loads hand out the same driver streams and
events, so one pointer table serves both.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.machinery
import os
from ctypes import POINTER, c_int, c_int32, c_int64, c_uint64, c_void_p
from typing import Any, Callable, NamedTuple

import numpy as np

from . import libcudart

ABI = 2   # native_land.c's FOXHUNT_LAND_ABI: a library built from another version is not used
# what land_chunk returns when a CUDA call failed (else the bytes it read)
SYNC_FAILED, COPY_FAILED, RECORD_FAILED = -1, -2, -3
LIBRARY_NAME = "_native_land"
OFF_VALUES = ("0", "off", "false", "no")


class Driver(ctypes.Structure):
    """``driver_t`` of native_land.c: the CUDA calls it makes, as function pointers."""

    _fields_ = [("htod", c_void_p), ("record", c_void_p), ("sync", c_void_p)]


class Lander(NamedTuple):
    """``land(driver, fd, src, nbytes, slot, event, wait, dst, stream) -> int``, and the driver
    table to pass it (its address); ``land_queue`` lands a ``Queue``'s records (see there)."""

    land: Callable[..., int]
    driver: int
    keep: Any = None   # what the driver table's pointers live in (ctypes callbacks in tests)
    land_queue: Callable[..., int] | None = None


RECORD = np.dtype([("fd", np.int64), ("src", np.int64), ("nbytes", np.int64), ("dst", np.uint64)])


class _QueueHead(ctypes.Structure):
    """``queue_t`` of native_land.c."""

    _fields_ = [("records", c_void_p), ("capacity", c_int64), ("published", c_int64), ("next", c_int64),
                ("sealed", c_int32), ("stop", c_int32)]


class Queue:
    """Contiguous chunks (file descriptor, file offset, bytes, device address) that one thread
    appends and publishes while the workers, each in ``land_queue`` with the GIL released, land
    them in order. ``capacity`` bounds the records; publishing, sealing and stopping are atomic
    stores in C (the workers see every record written before them)."""

    def __init__(self, capacity: int) -> None:
        lib = library()
        if lib is None:
            raise RuntimeError("the native library is not built")
        self._lib = lib
        self.records = np.zeros(max(1, capacity), RECORD)
        self.head = _QueueHead(self.records.ctypes.data, len(self.records), 0, 0, 0, 0)
        self.ptr = ctypes.addressof(self.head)
        self.count = 0

    def append(self, fd: int, src: int, nbytes: int, dst: int) -> None:
        if self.count >= len(self.records):
            raise RuntimeError(f"the landing queue holds {len(self.records)} chunks; a load planned more")
        self.records[self.count] = (fd, src, nbytes, dst)
        self.count += 1

    def publish(self) -> None:
        """Let the workers take every record appended so far."""
        self._lib.foxhunt_queue_publish(self.ptr, self.count)

    def seal(self) -> None:
        """No record comes after those published: a worker finding none left stops."""
        self.publish()
        self._lib.foxhunt_queue_seal(self.ptr)

    def stop(self) -> None:
        """The workers take no record more (a failure, a cancel)."""
        self._lib.foxhunt_queue_stop(self.ptr)

    @property
    def stopped(self) -> bool:
        return bool(self.head.stop)


def enabled() -> bool:
    """False when ``FOXHUNT_NATIVE`` says off (``0``, ``off``, ``false``, ``no``)."""
    return os.environ.get("FOXHUNT_NATIVE", "1").strip().lower() not in OFF_VALUES


def library_path() -> str | None:
    """The compiled library beside this module: this Python's extension name first, else any build."""
    here = os.path.dirname(os.path.abspath(__file__))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(here, LIBRARY_NAME + suffix)
        if os.path.exists(path):
            return path
    found = sorted(glob.glob(os.path.join(here, LIBRARY_NAME + "*.so")))
    return found[0] if found else None


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The loaded library with its functions typed, or None (not built, unloadable, another ABI)."""
    path = library_path()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        lib.foxhunt_land_abi.restype = c_int
        if lib.foxhunt_land_abi() != ABI:
            return None
    except (OSError, AttributeError):
        return None
    lib.foxhunt_land_chunk.restype = c_int64
    lib.foxhunt_land_chunk.argtypes = [c_void_p, c_int, c_int64, c_int64, c_void_p, c_void_p, c_int, c_uint64,
                                       c_void_p]
    lib.foxhunt_landed_chunks.restype = c_int64
    lib.foxhunt_landed_chunks.argtypes = []
    for name in ("foxhunt_queue_seal", "foxhunt_queue_stop"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [c_void_p]
    lib.foxhunt_queue_publish.restype = None
    lib.foxhunt_queue_publish.argtypes = [c_void_p, c_int64]
    lib.foxhunt_land_queue.restype = c_int64
    lib.foxhunt_land_queue.argtypes = [c_void_p, c_void_p, c_void_p, c_void_p, POINTER(c_int32), c_int32,
                                       POINTER(c_int32), c_void_p, POINTER(c_int64), POINTER(c_int64)]
    return lib


@functools.lru_cache(maxsize=None)
def _cuda_driver() -> Driver | None:
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        return Driver(*(ctypes.cast(getattr(cu, name), c_void_p).value
                        for name in ("cuMemcpyHtoDAsync_v2", "cuEventRecord", "cuEventSynchronize")))
    except (OSError, AttributeError):
        return None


def lander(driver: Driver | None = None, keep: Any = None) -> Lander | None:
    """The native landing with the CUDA driver's calls (or ``driver``'s), or None: the caller
    runs the steps in Python."""
    if not enabled():
        return None
    lib = library()
    driver = driver if driver is not None else _cuda_driver()
    if lib is None or driver is None:
        return None
    return Lander(lib.foxhunt_land_chunk, ctypes.addressof(driver), (driver, keep), lib.foxhunt_land_queue)


def backs(rt: Any) -> bool:
    """Whether the runtime object ``rt`` calls a real CUDA runtime library, so that its streams and
    events are the driver's: cupy's compiled wrapper, or a ``LibCudart`` on a library file that
    exists. A stand-in (a test's runtime of host memory) is not, and the driver must never see
    its handles."""
    if isinstance(rt, libcudart.LibCudart):
        return bool(rt.path) and os.path.isfile(rt.path)
    origin = getattr(rt, "__file__", None) or ""
    return origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def lander_for(rt: Any) -> Lander | None:
    """The native landing for a pipeline calling the runtime ``rt``, or None (see ``lander``, ``backs``)."""
    return lander() if backs(rt) else None


def landed_chunks() -> int:
    """Chunks landed natively in this process so far (0 without the library)."""
    lib = library()
    return lib.foxhunt_landed_chunks() if lib is not None else 0
