"""heldcalls: the driver calls made while holding the GIL, on a stand-in driver library (no GPU):
arguments pass through, a failure raises DeviceError with the driver's error name, and a
missing library or ENABLED=False gives None (the target then uses cupy)."""

from __future__ import annotations

import ctypes

import pytest

from foxhunt_stream import heldcalls
from foxhunt_stream.errors import DeviceError


class FakeDriver:
    """Functions named like libcuda's; each notes its call and returns ``rc``."""

    def __init__(self, rc: int = 0) -> None:
        self.rc, self.calls = rc, []

        def copy(dst, src, n, stream):
            self.calls.append(("copy", dst, src, n, stream))
            return self.rc

        def record(event, stream):
            self.calls.append(("record", event, stream))
            return self.rc

        def error_name(rc, out):
            out._obj.value = b"CUDA_ERROR_ILLEGAL_ADDRESS" if rc == 700 else None
            return 0 if rc == 700 else 1

        def ctx_current(out):
            out._obj.value = 0x1234
            return 0
        self.cuMemcpyHtoDAsync_v2, self.cuEventRecord = copy, record
        self.cuGetErrorName, self.cuCtxGetCurrent = error_name, ctx_current


def test_calls_pass_their_arguments_through():
    lib = FakeDriver()
    held = heldcalls.HeldCalls(lib)
    held.copy_h2d(0x7000, 0x8000, 4096, 0x99)
    held.record(0x55, 0x99)
    assert lib.calls == [("copy", 0x7000, 0x8000, 4096, 0x99), ("record", 0x55, 0x99)]
    assert held.has_context()


def test_a_failed_call_raises_with_the_driver_error_name():
    held = heldcalls.HeldCalls(FakeDriver(rc=700))
    with pytest.raises(DeviceError, match="cuMemcpyHtoDAsync of 4096 bytes failed: CUDA_ERROR_ILLEGAL_ADDRESS"):
        held.copy_h2d(1, 2, 4096, 0)
    held = heldcalls.HeldCalls(FakeDriver(rc=999))
    with pytest.raises(DeviceError, match="cuEventRecord failed: CUDA driver error 999"):
        held.record(1, 0)


def test_no_driver_library_or_turned_off_gives_none(monkeypatch):
    monkeypatch.setattr(heldcalls, "_loaded", False)
    monkeypatch.setattr(heldcalls, "_held", None)
    monkeypatch.setattr(heldcalls, "DRIVER_LIBRARY", "libfoxhunt-no-such-driver.so.1")
    assert heldcalls.held_calls() is None
    monkeypatch.setattr(heldcalls, "_held", heldcalls.HeldCalls(FakeDriver()))
    monkeypatch.setattr(heldcalls, "_loaded", True)
    assert heldcalls.held_calls() is not None
    monkeypatch.setattr(heldcalls, "ENABLED", False)
    assert heldcalls.held_calls() is None


def test_ctypes_pydll_keeps_the_gil():
    """What the module relies on: PyDLL functions run with the GIL held (CDLL releases it)."""
    assert ctypes.PyDLL._func_flags_ & ctypes._FUNCFLAG_PYTHONAPI
    assert not ctypes.CDLL._func_flags_ & ctypes._FUNCFLAG_PYTHONAPI
