"""The CUDA runtime library called through ctypes: the one torch has already loaded.

``import torch`` (a CUDA build) maps the CUDA runtime library into the process: torch's wheels
bring it (``nvidia/cu13/lib/libcudart.so.13`` beside a CUDA 13 build, ``nvidia/cuda_runtime/lib/
libcudart.so.12`` beside a CUDA 12 one, ``torch/lib/libcudart-<hash>.so.*`` in older wheels).
``LibCudart`` calls that library under the names the pipeline uses from cupy's wrapper of the
runtime (``hostAlloc``, ``memcpyAsync``, ``eventRecord``...), so ``runtime.runtime()`` may hand
out either and no caller can tell them apart. ctypes releases the GIL around every call, as
cupy's wrapper does around the calls that wait.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from ctypes import POINTER, c_char_p, c_int, c_size_t, c_uint, c_void_p

_NAME = re.compile(r"libcudart(?:-[0-9a-f]{8})?\.so(?:\.\d+)*")


class CudaRuntimeError(RuntimeError):
    """A CUDA runtime call failed: ``status`` is its cudaError_t, ``name`` e.g. cudaErrorNoDevice."""

    def __init__(self, call: str, status: int, name: str, text: str) -> None:
        self.call, self.status, self.name, self.text = call, status, name, text
        super().__init__(f"{name}: {text} ({call})")


def loaded_paths(maps: str) -> list[str]:
    """Pure: the CUDA runtime libraries mapped into a process, from the text of its
    ``/proc/<pid>/maps``, in the order they first appear."""
    out: list[str] = []
    for line in maps.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6:
            path = fields[5].strip()
            if _NAME.fullmatch(os.path.basename(path)) and path not in out:
                out.append(path)
    return out


def pick(paths: list[str], cuda_version: str | None) -> str | None:
    """Pure: of several loaded runtimes, the one of ``cuda_version``'s major version (torch's),
    else the first."""
    if cuda_version:
        major = re.escape(cuda_version.split(".")[0])
        for p in paths:
            if re.search(rf"\.so\.{major}(\.|$)", os.path.basename(p)):
                return p
    return paths[0] if paths else None


def find_loaded() -> str | None:
    """The path of the CUDA runtime library this process has loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = loaded_paths(f.read())
    except OSError:
        return None
    torch = sys.modules.get("torch")
    return pick(paths, getattr(getattr(torch, "version", None), "cuda", None))


def _bind(lib, symbol: str, restype, *argtypes):
    """``symbol`` of ``lib`` as a C function of that prototype (by address: ``lib`` may be a
    ``ctypes.CDLL`` or anything whose attributes are C function pointers)."""
    return ctypes.CFUNCTYPE(restype, *argtypes)(ctypes.cast(getattr(lib, symbol), c_void_p).value)


class LibCudart:
    """The runtime calls of ``cupy_backends.cuda.api.runtime`` that foxhunt_stream makes, on a
    loaded CUDA runtime library ``lib`` (found at ``path``)."""

    memcpyHostToDevice, memcpyDeviceToHost = 1, 2

    def __init__(self, lib, path: str = "") -> None:
        self.path = path
        self._lib = lib   # keeps a CDLL (and a stand-in's callbacks) alive
        def b(symbol: str, *argtypes):
            return _bind(lib, symbol, c_int, *argtypes)
        self._error_name = _bind(lib, "cudaGetErrorName", c_char_p, c_int)
        self._error_string = _bind(lib, "cudaGetErrorString", c_char_p, c_int)
        self._last_error = _bind(lib, "cudaGetLastError", c_int)
        self._getDeviceCount = b("cudaGetDeviceCount", POINTER(c_int))
        self._getDevice = b("cudaGetDevice", POINTER(c_int))
        self._setDevice = b("cudaSetDevice", c_int)
        self._runtimeGetVersion = b("cudaRuntimeGetVersion", POINTER(c_int))
        self._driverGetVersion = b("cudaDriverGetVersion", POINTER(c_int))
        self._streamCreateWithFlags = b("cudaStreamCreateWithFlags", POINTER(c_void_p), c_uint)
        self._streamSynchronize = b("cudaStreamSynchronize", c_void_p)
        self._streamWaitEvent = b("cudaStreamWaitEvent", c_void_p, c_void_p, c_uint)
        self._streamDestroy = b("cudaStreamDestroy", c_void_p)
        self._eventCreateWithFlags = b("cudaEventCreateWithFlags", POINTER(c_void_p), c_uint)
        self._eventRecord = b("cudaEventRecord", c_void_p, c_void_p)
        self._eventSynchronize = b("cudaEventSynchronize", c_void_p)
        self._eventDestroy = b("cudaEventDestroy", c_void_p)
        self._hostAlloc = b("cudaHostAlloc", POINTER(c_void_p), c_size_t, c_uint)
        self._freeHost = b("cudaFreeHost", c_void_p)
        self._hostRegister = b("cudaHostRegister", c_void_p, c_size_t, c_uint)
        self._hostUnregister = b("cudaHostUnregister", c_void_p)
        self._free = b("cudaFree", c_void_p)
        self._memcpyAsync = b("cudaMemcpyAsync", c_void_p, c_void_p, c_size_t, c_int, c_void_p)
        self._memcpy2DAsync = b("cudaMemcpy2DAsync", c_void_p, c_size_t, c_void_p, c_size_t, c_size_t, c_size_t,
                                c_int, c_void_p)

    def _check(self, call: str, status: int) -> None:
        if status:
            self._last_error()   # reported here: the next call must not find it again
            name = (self._error_name(status) or b"cudaError %d" % status).decode(errors="replace")
            text = (self._error_string(status) or b"").decode(errors="replace")
            raise CudaRuntimeError(call, status, name, text)

    def _out_int(self, call: str, fn, *args) -> int:
        out = c_int()
        self._check(call, fn(ctypes.byref(out), *args))
        return out.value

    def _out_ptr(self, call: str, fn, *args) -> int:
        out = c_void_p()
        self._check(call, fn(ctypes.byref(out), *args))
        return out.value or 0

    # -- devices and versions
    def getDeviceCount(self) -> int:
        return self._out_int("cudaGetDeviceCount", self._getDeviceCount)

    def getDevice(self) -> int:
        return self._out_int("cudaGetDevice", self._getDevice)

    def setDevice(self, device: int) -> None:
        self._check("cudaSetDevice", self._setDevice(device))

    def runtimeGetVersion(self) -> int:
        return self._out_int("cudaRuntimeGetVersion", self._runtimeGetVersion)

    def driverGetVersion(self) -> int:
        return self._out_int("cudaDriverGetVersion", self._driverGetVersion)

    # -- streams and events
    def streamCreateWithFlags(self, flags: int) -> int:
        return self._out_ptr("cudaStreamCreateWithFlags", self._streamCreateWithFlags, flags)

    def streamSynchronize(self, stream: int) -> None:
        self._check("cudaStreamSynchronize", self._streamSynchronize(stream))

    def streamWaitEvent(self, stream: int, event: int, flags: int = 0) -> None:
        self._check("cudaStreamWaitEvent", self._streamWaitEvent(stream, event, flags))

    def streamDestroy(self, stream: int) -> None:
        self._check("cudaStreamDestroy", self._streamDestroy(stream))

    def eventCreateWithFlags(self, flags: int) -> int:
        return self._out_ptr("cudaEventCreateWithFlags", self._eventCreateWithFlags, flags)

    def eventRecord(self, event: int, stream: int) -> None:
        self._check("cudaEventRecord", self._eventRecord(event, stream))

    def eventSynchronize(self, event: int) -> None:
        self._check("cudaEventSynchronize", self._eventSynchronize(event))

    def eventDestroy(self, event: int) -> None:
        self._check("cudaEventDestroy", self._eventDestroy(event))

    # -- memory and copies
    def hostAlloc(self, nbytes: int, flags: int) -> int:
        return self._out_ptr("cudaHostAlloc", self._hostAlloc, nbytes, flags)

    def freeHost(self, ptr: int) -> None:
        self._check("cudaFreeHost", self._freeHost(ptr))

    def hostRegister(self, ptr: int, nbytes: int, flags: int) -> None:
        self._check("cudaHostRegister", self._hostRegister(ptr, nbytes, flags))

    def hostUnregister(self, ptr: int) -> None:
        self._check("cudaHostUnregister", self._hostUnregister(ptr))

    def free(self, ptr: int) -> None:
        self._check("cudaFree", self._free(ptr))

    def memcpyAsync(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        self._check("cudaMemcpyAsync", self._memcpyAsync(dst, src, nbytes, kind, stream))

    def memcpy2DAsync(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: int,
                      stream: int) -> None:
        self._check("cudaMemcpy2DAsync",
                    self._memcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream))


def open_loaded() -> LibCudart | None:
    """A ``LibCudart`` on the CUDA runtime library this process has already loaded, or None."""
    path = find_loaded()
    return None if path is None else LibCudart(ctypes.CDLL(path), path)
