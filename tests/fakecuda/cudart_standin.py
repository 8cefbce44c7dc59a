"""A stand-in CUDA runtime library for tests without a GPU: C callbacks (ctypes) with the
runtime's own C signatures, so ``cuda.libcudart.LibCudart`` marshals every call exactly as it
does against libcudart. "Device" memory is host memory and the copies are memmoves; every call
is recorded in ``calls`` as (symbol, args)."""

from __future__ import annotations

import ctypes
from ctypes import CFUNCTYPE, POINTER, c_int, c_size_t, c_uint, c_void_p

ERRORS = {1: "cudaErrorInvalidValue", 35: "cudaErrorInsufficientDriver", 100: "cudaErrorNoDevice",
          101: "cudaErrorInvalidDevice"}


class StandIn:
    """Attributes named as the runtime's symbols (``cudaMemcpyAsync``...) are C function pointers.
    ``fail[symbol] = status`` makes that symbol return ``status``."""

    def __init__(self, devices: int = 1) -> None:
        self.calls: list[tuple] = []
        self.fail: dict[str, int] = {}
        self.devices, self.current = devices, 0
        self.host: dict[int, ctypes.Array] = {}
        self.registered: dict[int, int] = {}   # host memory registered (cudaHostRegister): address -> bytes
        self.last_error_calls = 0
        self._handles = 0x1000
        self._strings = {s: ctypes.create_string_buffer(n.encode()) for s, n in ERRORS.items()}
        self._unknown = ctypes.create_string_buffer(b"cudaErrorUnknown")
        self._define()

    def _c(self, restype, *argtypes):
        def wrap(f):
            symbol = f.__name__

            def call(*args):
                self.calls.append((symbol, args))
                return self.fail.get(symbol, 0) or f(*args)
            setattr(self, symbol, CFUNCTYPE(restype, *argtypes)(call))
            return f
        return wrap

    def _handle(self) -> int:
        self._handles += 0x10
        return self._handles

    def _define(self) -> None:   # noqa: C901 - one small function per runtime symbol
        c = self._c

        @c(c_int, POINTER(c_int))
        def cudaGetDeviceCount(out):
            out[0] = self.devices
            return 0

        @c(c_int, POINTER(c_int))
        def cudaGetDevice(out):
            out[0] = self.current
            return 0

        @c(c_int, c_int)
        def cudaSetDevice(i):
            if not 0 <= i < self.devices:
                return 101
            self.current = i
            return 0

        @c(c_int, POINTER(c_int))
        def cudaRuntimeGetVersion(out):
            out[0] = 13000
            return 0

        @c(c_int, POINTER(c_int))
        def cudaDriverGetVersion(out):
            out[0] = 13000
            return 0

        @c(c_int, POINTER(c_void_p), c_uint)
        def cudaStreamCreateWithFlags(out, flags):
            out[0] = self._handle()
            return 0

        @c(c_int, POINTER(c_void_p), c_uint)
        def cudaEventCreateWithFlags(out, flags):
            out[0] = self._handle()
            return 0

        for name in ("cudaStreamSynchronize", "cudaStreamDestroy", "cudaEventSynchronize", "cudaEventDestroy",
                     "cudaFree"):
            c(c_int, c_void_p)(_named(name, lambda handle: 0))

        @c(c_int, c_void_p, c_void_p, c_uint)
        def cudaStreamWaitEvent(stream, event, flags):
            return 0

        @c(c_int, c_void_p, c_void_p)
        def cudaEventRecord(event, stream):
            return 0

        @c(c_int, POINTER(c_void_p), c_size_t, c_uint)
        def cudaHostAlloc(out, nbytes, flags):
            buf = ctypes.create_string_buffer(nbytes)
            self.host[ctypes.addressof(buf)] = buf
            out[0] = ctypes.addressof(buf)
            return 0

        @c(c_int, c_void_p)
        def cudaFreeHost(ptr):
            return 0 if self.host.pop(ptr, None) is not None else 1

        @c(c_int, c_void_p, c_size_t, c_uint)
        def cudaHostRegister(ptr, nbytes, flags):
            self.registered[ptr] = nbytes
            return 0

        @c(c_int, c_void_p)
        def cudaHostUnregister(ptr):
            return 0 if self.registered.pop(ptr, None) is not None else 1

        @c(c_int, c_void_p, c_void_p, c_size_t, c_int, c_void_p)
        def cudaMemcpyAsync(dst, src, nbytes, kind, stream):
            if nbytes:
                ctypes.memmove(dst, src, nbytes)
            return 0

        @c(c_int, c_void_p, c_size_t, c_void_p, c_size_t, c_size_t, c_size_t, c_int, c_void_p)
        def cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream):
            for r in range(height):
                ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
            return 0

        # const char* results: addresses of buffers kept here (a c_char_p from a callback would leak)
        @c(c_void_p, c_int)
        def cudaGetErrorName(status):
            return ctypes.addressof(self._strings.get(status, self._unknown))

        @c(c_void_p, c_int)
        def cudaGetErrorString(status):
            return ctypes.addressof(self._strings.get(status, self._unknown))

        @c(c_int)
        def cudaGetLastError():
            self.last_error_calls += 1
            return 0


def _named(name, f):
    f.__name__ = name
    return f
