"""The C library's calls of the I/O layer through ctypes, typed once and shared. ctypes releases the
GIL per call, so a long munmap or mincore does not stop other threads. A call the platform lacks is
simply absent: callers catch AttributeError and fall back.
"""

from __future__ import annotations

import ctypes
import functools

_SIGNATURES = {   # name: (return type, argument types)
    "mmap": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int64]),
    "munmap": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]),
    "madvise": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]),
    "mincore": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]),
    "fallocate": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]),
    "memset": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]),
    "syscall": (ctypes.c_long, [ctypes.c_long, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]),
}

MAP_FAILED = ctypes.c_void_p(-1).value


@functools.lru_cache(maxsize=None)
def libc() -> ctypes.CDLL:
    """This process's C library, with the signatures above set on the functions it has."""
    lib = ctypes.CDLL(None, use_errno=True)
    for name, (restype, argtypes) in _SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            continue
        fn.restype, fn.argtypes = restype, argtypes
    return lib
