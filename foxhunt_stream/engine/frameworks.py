"""Frameworks: numpy, cupy and torch arrays for landed bytes. A framework allocates each
destination (``empty``) and says where its bytes live (``buffer``); the stages see only a ``Buffer``.
"""

from __future__ import annotations

import operator
import os
from typing import Any, NamedTuple, Protocol, Sequence

import numpy as np

from ..cuda.devices import CPU, Device, cupy
from ..format.dtypes import DType, from_numpy, from_torch, host_shape
from ..errors import DeviceError, DeviceOutOfMemoryError, OptionError


class Buffer(NamedTuple):
    """Where a destination's bytes go: host memory (``host``) or a device address (``ptr``)."""
    device: Device
    nbytes: int
    host: np.ndarray | None = None   # uint8, contiguous (cpu)
    ptr: int = 0                      # device address (cuda)


_new = tuple.__new__


class Framework(Protocol):
    """What the pipeline asks of an array library (numpy, cupy, torch)."""
    name: str

    def empty(self, dtype: DType, shape, device: Device, tensor: str = "") -> Any: ...
    def new(self, dtype: DType, shape, device: Device, tensor: str = "") -> tuple[Any, Buffer]: ...
    def copies(self, view: np.ndarray, dests: Sequence, device: Device) -> list | None: ...
    def buffer(self, arr) -> Buffer: ...
    def settle(self, device: Device) -> None: ...
    def reserve(self, device: Device, sizes: Sequence[int]) -> None: ...
    def owns(self, x) -> bool: ...
    def describe(self, arr) -> tuple[DType | None, tuple[int, ...], Device]: ...
    def array_dtype(self, dtype: DType) -> Any: ...


def _format_dtype(convert, dtype) -> DType | None:
    """The format's dtype of an array's element type, None where the format has none."""
    try:
        return convert(dtype)
    except TypeError:
        return None


def _host_bytes(arr: np.ndarray) -> np.ndarray:
    if not arr.flags.c_contiguous:
        raise ValueError("destination array must be C-contiguous")
    if not arr.flags.writeable:   # found here, before any byte lands, not as a BufferError midway
        raise ValueError("destination array is read-only")
    return arr.reshape(-1).view(np.uint8)


_DTYPE, _SHAPE = operator.itemgetter(1), operator.itemgetter(2)   # of a plan.Destination


def _alike(dests: Sequence) -> bool:
    """Whether the destinations all have one dtype and one shape, not a scalar's."""
    _, dtype, shape, _ = dests[0]
    n = len(dests)
    return (bool(shape) and dests[-1][1] is dtype and dests[-1][2] == shape   # (the last first: cheap)
            and list(map(_DTYPE, dests)).count(dtype) == n and list(map(_SHAPE, dests)).count(shape) == n)


class NumpyFramework:
    name = "numpy"

    def empty(self, dtype: DType, shape, device: Device, tensor: str = "") -> np.ndarray:
        if device.is_cuda:
            raise OptionError("framework 'numpy' holds host arrays only; use device='cpu' or framework='cupy'/'pt'")
        return np.empty(host_shape(dtype, tuple(shape)), dtype.numpy)

    def array_dtype(self, dtype: DType) -> np.dtype:
        """The element type of the arrays it makes for ``dtype`` (sub-byte types: raw uint8)."""
        return np.dtype(np.uint8) if dtype.sub_byte else np.dtype(dtype.numpy)

    def new(self, dtype: DType, shape, device: Device, tensor: str = "") -> tuple[np.ndarray, Buffer]:
        """A new array and its Buffer (a load's destination: one per tensor, made whole)."""
        arr = self.empty(dtype, shape, device, tensor)
        flat = arr if arr.ndim == 1 else arr.reshape(-1)
        return arr, _new(Buffer, (CPU, arr.nbytes, flat.view(np.uint8), 0))   # Buffer(...), without its __new__

    def copies(self, view: np.ndarray, dests: Sequence, device: Device) -> list[np.ndarray]:
        """New arrays, each a copy, of the destinations (``plan.Destination`` s) lying back to back in ``view``."""
        if device.is_cuda:
            raise OptionError("framework 'numpy' holds host arrays only; use device='cpu' or framework='cupy'/'pt'")
        make, copy = np.ndarray, np.ndarray.copy
        if _alike(dests):   # equal tensors: the rows of one array over the bytes, each copied
            _, dtype, shape, _ = dests[0]
            return list(map(copy, make((len(dests), *host_shape(dtype, shape)), dtype.numpy, view)))
        out = []
        add = out.append
        pos, last, host, sub = 0, None, None, False
        for _, dtype, shape, nbytes in dests:
            if dtype is not last:   # a shared chunk's tensors mostly share a dtype
                last, host, sub = dtype, dtype.numpy, dtype.sub_byte
            add(copy(make(host_shape(dtype, shape) if sub else shape, host, view, pos)))
            pos += nbytes
        return out

    def settle(self, device: Device) -> None:
        """Host arrays: nothing is queued."""

    def reserve(self, device: Device, sizes: Sequence[int]) -> None:
        """Host arrays are allocated one by one."""

    def owns(self, x) -> bool:
        return isinstance(x, np.ndarray)

    def buffer(self, arr: np.ndarray) -> Buffer:
        return Buffer(CPU, arr.nbytes, host=_host_bytes(arr))

    def describe(self, arr) -> tuple[DType | None, tuple[int, ...], Device]:
        return _format_dtype(from_numpy, arr.dtype), tuple(arr.shape), Device("cpu")


class CupyFramework:
    name = "cupy"

    _dtypes: dict = {}

    def array_dtype(self, dtype: DType):
        """cupy's own type where it has one; bf16/fp8 fall back to same-width unsigned views."""
        got = self._dtypes.get(dtype.name)
        if got is None:
            cp = cupy()
            if dtype.sub_byte:
                got = np.dtype(np.uint8)
            elif dtype.ml_dtypes:   # cupy has none of ml_dtypes' types (and they need not be imported)
                got = np.dtype(f"u{dtype.itemsize}")
            else:
                try:
                    cp.empty(0, dtype.numpy)
                    got = dtype.numpy
                except Exception:
                    got = np.dtype(f"u{dtype.itemsize}")
            self._dtypes[dtype.name] = got
        return got

    def empty(self, dtype: DType, shape, device: Device, tensor: str = ""):
        cp = cupy()
        shp = host_shape(dtype, tuple(shape))
        if not device.is_cuda:
            return NumpyFramework().empty(dtype, shape, device)
        with cp.cuda.Device(device.index):
            try:
                return cp.empty(shp, self.array_dtype(dtype))
            except cp.cuda.memory.OutOfMemoryError:
                raise DeviceOutOfMemoryError(str(device), tensor, int(np.prod(shp)) * max(1, dtype.itemsize)) from None

    def new(self, dtype: DType, shape, device: Device, tensor: str = ""):
        """A new array and its Buffer (a load's destination)."""
        arr = self.empty(dtype, shape, device, tensor)
        if not device.is_cuda:
            return arr, NumpyFramework().buffer(arr)
        return arr, Buffer(device, arr.nbytes, ptr=arr.data.ptr)

    def copies(self, view: np.ndarray, dests: Sequence, device: Device) -> list:
        """Host arrays (numpy's) of the destinations lying back to back in ``view``."""
        if device.is_cuda:
            raise OptionError("a shared chunk lands in host arrays only")
        return NumpyFramework().copies(view, dests, device)

    def settle(self, device: Device) -> None:
        """Wait for work queued on cupy's current stream of ``device`` (its freed blocks get reused)."""
        cp = cupy()
        with cp.cuda.Device(device.index):
            cp.cuda.get_current_stream().synchronize()

    def reserve(self, device: Device, sizes: Sequence[int]) -> None:
        """cupy's pool is left to allocate as it does."""

    def owns(self, x) -> bool:
        return type(x).__module__.startswith("cupy") and hasattr(x, "data") and hasattr(x, "device")

    def buffer(self, arr) -> Buffer:
        if not self.owns(arr):   # a host array
            return NumpyFramework().buffer(arr)
        if not arr.flags.c_contiguous:
            raise ValueError("destination array must be C-contiguous")
        return Buffer(Device("cuda", arr.device.id), arr.nbytes, ptr=arr.data.ptr)

    def describe(self, arr):
        return _format_dtype(from_numpy, arr.dtype), tuple(arr.shape), Device("cuda", arr.device.id)


TORCH_MISSING = ("framework='pt' makes torch tensors and needs torch: pip install torch (on Linux x86_64 a CUDA "
                 "build; the CPU-only one: pip install torch --index-url https://download.pytorch.org/whl/cpu)")


def import_torch():
    """The torch module, or a ModuleNotFoundError saying how to install it."""
    try:
        import torch
    except ModuleNotFoundError as e:
        if e.name != "torch":   # torch is there but broken: its own error says more
            raise
        raise ModuleNotFoundError(TORCH_MISSING, name="torch") from None
    return torch


# torch's caching allocator: blocks of 512-byte multiples; tensors of at most 1 MiB come from its small pool
_TORCH_BLOCK, _TORCH_SMALL = 512, 1 << 20


class TorchFramework:
    name = "pt"

    def __init__(self) -> None:
        self._devices: dict[Device, Any] = {}   # Device -> torch.device, made once
        self._dtypes: dict[str, Any] = {}       # DType.name -> torch dtype, looked up once

    def torch_dtype(self, dtype: DType):
        """The torch dtype of ``dtype`` (sub-byte types and types torch lacks: uint8)."""
        torch = import_torch()
        t = getattr(torch, dtype.torch_name, None) if dtype.torch_name else None
        return t if t is not None else torch.uint8

    array_dtype = torch_dtype

    def empty(self, dtype: DType, shape, device: Device, tensor: str = ""):
        torch = import_torch()
        where = self._devices.get(device)
        if where is None:
            where = self._devices[device] = torch.device(str(device))
        tdt = self._dtypes.get(dtype.name)
        if tdt is None:
            tdt = self._dtypes[dtype.name] = self.torch_dtype(dtype)
        shp = host_shape(dtype, tuple(shape))
        try:
            return torch.empty(shp, dtype=tdt, device=where)
        except getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError):
            raise DeviceOutOfMemoryError(str(device), tensor, int(np.prod(shp)) * max(1, dtype.itemsize)) from None

    def new(self, dtype: DType, shape, device: Device, tensor: str = ""):
        """A new tensor and its Buffer (a load's destination)."""
        t = self.empty(dtype, shape, device, tensor)
        if not device.is_cuda:
            return t, self.buffer(t)
        return t, Buffer(device, t.numel() * t.element_size(), None, t.data_ptr())

    def copies(self, view: np.ndarray, dests: Sequence, device: Device) -> None:
        """None: a tensor each from ``new``, the bytes copied in (``Destinations.land_shared``)."""
        return None

    def settle(self, device: Device) -> None:
        """Wait for work queued on torch's current stream of ``device`` (its freed blocks get reused)."""
        import_torch().cuda.current_stream(device.index).synchronize()

    def reserve(self, device: Device, sizes: Sequence[int]) -> None:
        """Grow torch's cache of ``device`` by one block where it holds less free than the tensors of
        ``sizes`` will take from its large pool, so that they are carved out of one ``cudaMalloc``
        instead of one each, which contend with the staging's pinning (as transformers'
        ``caching_allocator_warmup``). Not for a single tensor (one ``cudaMalloc`` either way), nor
        where torch does not split blocks (``max_split_size_mb``: the block would stay reserved
        beside them) or allocates through ``cudaMallocAsync``. Out of memory: each tensor is then
        allocated alone."""
        large = [-(-n // _TORCH_BLOCK) * _TORCH_BLOCK for n in sizes if n > _TORCH_SMALL]
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
        if len(large) < 2 or "max_split_size" in conf or "cudaMallocAsync" in conf:
            return
        torch = import_torch()
        try:   # the small pool's free blocks hold none of these tensors
            stats = torch.cuda.memory_stats(device.index)
        except RuntimeError:
            return
        free = stats.get("reserved_bytes.large_pool.current", 0) - stats.get("allocated_bytes.large_pool.current", 0)
        if sum(large) > free:
            try:
                torch.empty(sum(large) - free, dtype=torch.uint8, device=f"cuda:{device.index}")
            except getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError):
                pass

    def owns(self, x) -> bool:
        return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")

    def buffer(self, t) -> Buffer:
        torch = import_torch()
        if not t.is_contiguous():
            raise ValueError("destination tensor must be contiguous")
        nbytes = t.numel() * t.element_size()
        if t.device.type == "cpu":
            flat = t.detach().reshape(-1)
            host = flat.view(torch.uint8).numpy() if nbytes else np.empty(0, np.uint8)
            return Buffer(Device("cpu"), nbytes, host=host)
        if t.device.type != "cuda":
            raise ValueError(f"unsupported torch device {t.device}")
        return Buffer(Device("cuda", t.device.index or 0), nbytes, ptr=t.data_ptr())

    def describe(self, t):
        dev = Device("cpu") if t.device.type == "cpu" else Device("cuda", t.device.index or 0)
        return _format_dtype(from_torch, t.dtype), tuple(t.shape), dev


_FRAMEWORKS = {"numpy": NumpyFramework, "np": NumpyFramework, "cupy": CupyFramework, "cp": CupyFramework,
               "pt": TorchFramework, "torch": TorchFramework}


def get_framework(framework: str | None, device: Device):
    """The framework that makes a load's arrays on ``device`` (None: numpy on the host, cupy on a
    GPU), its library imported (a missing one: an error saying how to install it)."""
    if framework is None:
        framework = "numpy" if not device.is_cuda else "cupy"
    cls = _FRAMEWORKS.get(framework) if isinstance(framework, str) else None
    if cls is None:
        raise OptionError(f"unknown framework {framework!r}; choose numpy, cupy or pt")
    if cls is TorchFramework:
        import_torch()
    elif cls is CupyFramework:
        if not device.is_cuda:
            raise OptionError(f"framework 'cupy' makes GPU arrays, and device is {device}: pass device='cuda:N', or "
                             "framework='numpy' for host arrays")
        try:
            cupy()
        except DeviceError as e:
            raise DeviceError(f"framework 'cupy' (the default on a GPU) makes cupy arrays: {e}. For torch tensors, "
                              "pass framework='pt': torch's own CUDA runtime is then enough") from None
    return cls()


def framework_of(x):
    """The framework owning an array (numpy, cupy or torch)."""
    for cls in (TorchFramework, CupyFramework, NumpyFramework):
        f = cls()
        if f.owns(x):
            return f
    raise TypeError(f"unsupported array type {type(x).__module__}.{type(x).__name__}; "
                    "expected a numpy, cupy or torch array")


def expected_host_dtype(framework: Framework, dtype: DType) -> Any:
    """The element type a framework uses for ``dtype`` (for load_into checks)."""
    return framework.array_dtype(dtype)
