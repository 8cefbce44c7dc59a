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
from ctypes import c_int, c_int64, c_uint64, c_void_p
from typing import Any, Callable, NamedTuple

from . import libcudart

ABI = 1   # native_land.c's FOXHUNT_LAND_ABI: a library built from another version is not used
# what land_chunk returns when a CUDA call failed (else the bytes it read)
SYNC_FAILED, COPY_FAILED, RECORD_FAILED = -1, -2, -3
LIBRARY_NAME = "_native_land"
OFF_VALUES = ("0", "off", "false", "no")


class Driver(ctypes.Structure):
    """``driver_t`` of native_land.c: the CUDA calls it makes, as function pointers."""

    _fields_ = [("htod", c_void_p), ("record", c_void_p), ("sync", c_void_p)]


class Lander(NamedTuple):
    """``land(driver, fd, src, nbytes, slot, event, wait, dst, stream) -> int``, and the driver
    table to pass it (its address)."""

    land: Callable[..., int]
    driver: int
    keep: Any = None   # what the driver table's pointers live in (ctypes callbacks in tests)


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
    return Lander(lib.foxhunt_land_chunk, ctypes.addressof(driver), (driver, keep))


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
