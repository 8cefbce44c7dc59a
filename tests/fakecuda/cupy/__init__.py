"""A stand-in for cupy that runs on the host: "device" memory is host memory and the runtime's
copies are memmoves, so the GPU target's bookkeeping (pinned rings, events, 2-D copies) can be
tested on a machine without a GPU. Imported only by subprocesses of the stand-in tests (tests/cuda/test_cuda_target_fake.py, tests/integrity/test_landed_batch_fake.py)."""

import ctypes

import numpy as np


class _Runtime:
    memcpyHostToDevice, memcpyDeviceToHost, hostAllocPortable = 1, 2, 1
    copies = 0
    records = 0

    @staticmethod
    def memcpyAsync(dst, src, n, kind, stream):
        ctypes.memmove(dst, src, n)
        _Runtime.copies += 1

    @staticmethod
    def memcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream):
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
        _Runtime.copies += 1

    @staticmethod
    def eventRecord(event, stream):
        _Runtime.records += 1

    @staticmethod
    def eventSynchronize(event):
        pass

    @staticmethod
    def setDevice(i):
        pass

    @staticmethod
    def getDevice():
        return 0

    @staticmethod
    def free(ptr):
        pass

    # handles of foxhunt_stream.cudart: streams and events are numbers, pinned memory host bytes
    _handles = 0
    _host: dict = {}

    @staticmethod
    def _next():
        _Runtime._handles += 1
        return 5000 + _Runtime._handles

    @staticmethod
    def streamCreateWithFlags(flags):
        return _Runtime._next()

    @staticmethod
    def eventCreateWithFlags(flags):
        return _Runtime._next()

    @staticmethod
    def streamSynchronize(stream):
        pass

    @staticmethod
    def streamWaitEvent(stream, event, flags=0):
        pass

    @staticmethod
    def streamDestroy(stream):
        pass

    @staticmethod
    def eventDestroy(event):
        pass

    @staticmethod
    def hostAlloc(n, flags):
        buf = ctypes.create_string_buffer(n)
        _Runtime._host[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    @staticmethod
    def freeHost(ptr):
        _Runtime._host.pop(ptr)

    registered: dict = {}   # host memory registered (hostRegister): address -> bytes

    @staticmethod
    def hostRegister(ptr, n, flags):
        _Runtime.registered[ptr] = n

    @staticmethod
    def hostUnregister(ptr):
        _Runtime.registered.pop(ptr)

    @staticmethod
    def getDeviceCount():
        return 1


class Device:
    def __init__(self, i=0):
        self.id = i

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class Stream:
    _n = 0

    def __init__(self, non_blocking=False):
        Stream._n += 1
        self.ptr = Stream._n

    def synchronize(self):
        pass

    def wait_event(self, event):
        pass


class Event:
    _n = 0

    def __init__(self, block=False, disable_timing=True):
        Event._n += 1
        self.ptr = 1000 + Event._n

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


class PinnedMemory:
    def __init__(self, n, flags=0):
        self.n = n


class PinnedMemoryPointer(bytearray):
    def __init__(self, mem, offset):
        super().__init__(mem.n)


class _Pointer:
    def __init__(self, ptr):
        self.ptr = ptr


class _DeviceId:
    id = 0


class ndarray(np.ndarray):
    """A "device" array: host memory, known to the loader by its address (``.data.ptr``)."""

    @property
    def data(self):
        return _Pointer(self.ctypes.data)

    @property
    def device(self):
        return _DeviceId()


def empty(shape, dtype=np.float32):
    return np.empty(shape, dtype).view(ndarray)


def zeros(shape, dtype=np.float32):
    return np.zeros(shape, dtype).view(ndarray)


def asnumpy(x):
    return np.asarray(x).view(np.ndarray)


class _Memory:
    class OutOfMemoryError(MemoryError):
        pass


class _CurrentStream:
    def synchronize(self):
        pass


class _Cuda:
    runtime = _Runtime
    memory = _Memory
    Device, Stream, Event, PinnedMemory, PinnedMemoryPointer = Device, Stream, Event, PinnedMemory, PinnedMemoryPointer

    @staticmethod
    def get_current_stream():
        return _CurrentStream()


cuda = _Cuda()
__version__ = "fake"
