"""Every framework's ``new`` (how a load makes its destinations) gives an array of the dtype and
shape asked, and the Buffer that ``buffer`` would read off that array: the fast path skips the
checks, never the facts. On the host here; on a GPU for cupy and torch tensors."""

from __future__ import annotations

import numpy as np
import pytest

from foxhunt_stream.cuda.devices import CPU, Device
from foxhunt_stream.engine.frameworks import CupyFramework, NumpyFramework, TorchFramework
from foxhunt_stream.format.dtypes import DTYPES

CASES = [("F32", (3, 5)), ("BF16", (4, 1, 2)), ("I8", (7,)), ("F64", ()), ("U16", (0, 3)), ("F8_E4M3", (2, 6))]


def _frameworks(device: Device):
    out = []
    if not device.is_cuda:
        out.append(NumpyFramework())
    try:
        import torch  # noqa: F401
        if not device.is_cuda or torch.cuda.is_available():
            out.append(TorchFramework())
    except ImportError:
        pass
    if device.is_cuda:
        try:
            import cupy as cp
            if cp.cuda.runtime.getDeviceCount() > 0:
                out.append(CupyFramework())
        except Exception:   # no cupy, or no driver
            pass
    return out


def _check(fw, device: Device) -> None:
    for name, shape in CASES:
        dtype = DTYPES[name]
        arr, buf = fw.new(dtype, shape, device, f"t.{name}")
        ref = fw.buffer(arr)
        assert (buf.device, buf.nbytes, buf.ptr) == (ref.device, ref.nbytes, ref.ptr), (fw.name, name)
        if ref.host is None:
            assert buf.host is None
        else:   # the same bytes: the array's own memory, seen as uint8
            assert buf.host.dtype == np.uint8 and buf.host.nbytes == ref.host.nbytes
            assert buf.host.nbytes == 0 or buf.host.ctypes.data == ref.host.ctypes.data
        assert buf.device == device and buf.nbytes == int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        got_dtype, got_shape, got_device = fw.describe(arr)
        assert got_device == device
        assert arr.dtype == fw.array_dtype(dtype)
        if not dtype.sub_byte and arr.dtype == fw.array_dtype(dtype) and got_dtype == dtype:
            assert got_shape == shape


@pytest.mark.parametrize("fw", _frameworks(CPU), ids=lambda f: f.name)
def test_new_on_the_host_matches_buffer(fw):
    _check(fw, CPU)


def test_new_on_a_gpu_matches_buffer():
    frameworks = _frameworks(Device("cuda", 0))
    if not frameworks:
        pytest.skip("no CUDA device (or neither torch nor cupy)")
    for fw in frameworks:
        _check(fw, Device("cuda", 0))
