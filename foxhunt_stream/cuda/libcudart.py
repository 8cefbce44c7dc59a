"""The CUDA runtime library torch has already loaded, called through ctypes under the names of
cupy's wrapper of it, so ``runtime.runtime()`` may hand out either; ctypes releases the GIL per call.
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


_INT, _PTR = POINTER(c_int), POINTER(c_void_p)   # a first argument of these: the value the call returns

# cupy's name of each call foxhunt_stream makes: the runtime's symbol and its argument types
CALLS = {
    "getDeviceCount": ("cudaGetDeviceCount", _INT),
    "getDevice": ("cudaGetDevice", _INT),
    "setDevice": ("cudaSetDevice", c_int),
    "runtimeGetVersion": ("cudaRuntimeGetVersion", _INT),
    "driverGetVersion": ("cudaDriverGetVersion", _INT),
    "streamCreateWithFlags": ("cudaStreamCreateWithFlags", _PTR, c_uint),
    "streamSynchronize": ("cudaStreamSynchronize", c_void_p),
    "_streamWaitEvent": ("cudaStreamWaitEvent", c_void_p, c_void_p, c_uint),
    "streamDestroy": ("cudaStreamDestroy", c_void_p),
    "eventCreateWithFlags": ("cudaEventCreateWithFlags", _PTR, c_uint),
    "eventRecord": ("cudaEventRecord", c_void_p, c_void_p),
    "eventSynchronize": ("cudaEventSynchronize", c_void_p),
    "eventDestroy": ("cudaEventDestroy", c_void_p),
    "hostAlloc": ("cudaHostAlloc", _PTR, c_size_t, c_uint),
    "freeHost": ("cudaFreeHost", c_void_p),
    "hostRegister": ("cudaHostRegister", c_void_p, c_size_t, c_uint),
    "hostUnregister": ("cudaHostUnregister", c_void_p),
    "free": ("cudaFree", c_void_p),
    "memcpyAsync": ("cudaMemcpyAsync", c_void_p, c_void_p, c_size_t, c_int, c_void_p),
    "memcpy2DAsync": ("cudaMemcpy2DAsync", c_void_p, c_size_t, c_void_p, c_size_t, c_size_t, c_size_t, c_int,
                      c_void_p),
}


class LibCudart:
    """The runtime calls of ``cupy_backends.cuda.api.runtime`` that foxhunt_stream makes
    (``CALLS``), on a loaded CUDA runtime library ``lib`` (found at ``path``)."""

    memcpyHostToDevice, memcpyDeviceToHost = 1, 2

    def __init__(self, lib, path: str = "") -> None:
        self.path = path
        self._lib = lib   # keeps a CDLL (and a stand-in's callbacks) alive
        self._error_name = _bind(lib, "cudaGetErrorName", c_char_p, c_int)
        self._error_string = _bind(lib, "cudaGetErrorString", c_char_p, c_int)
        self._last_error = _bind(lib, "cudaGetLastError", c_int)
        for method, (symbol, *argtypes) in CALLS.items():
            setattr(self, method, self._method(symbol, argtypes))

    def _method(self, symbol: str, argtypes: list):
        """The call as cupy spells it: a failed status raises, an out-pointer's value is returned."""
        fn = _bind(self._lib, symbol, c_int, *argtypes)
        out_type = {_INT: c_int, _PTR: c_void_p}.get(argtypes[0])

        def call(*args):
            if out_type is None:
                return self._check(symbol, fn(*args))
            out = out_type()
            self._check(symbol, fn(ctypes.byref(out), *args))
            return out.value or 0
        return call

    def _check(self, call: str, status: int) -> None:
        if status:
            self._last_error()   # reported here: the next call must not find it again
            name = (self._error_name(status) or b"cudaError %d" % status).decode(errors="replace")
            text = (self._error_string(status) or b"").decode(errors="replace")
            raise CudaRuntimeError(call, status, name, text)

    def streamWaitEvent(self, stream: int, event: int, flags: int = 0) -> None:
        self._streamWaitEvent(stream, event, flags)


def open_loaded() -> LibCudart | None:
    """A ``LibCudart`` on the CUDA runtime library this process has already loaded, or None."""
    path = find_loaded()
    return None if path is None else LibCudart(ctypes.CDLL(path), path)
