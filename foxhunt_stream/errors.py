"""Exception types. Every malformed-file problem is a FormatError naming file, rule and tensor.
``SafetensorError`` subclasses keep the builtin type safetensors raises (ValueError...) as a second
base; where safetensors raises a plain builtin type, so do we.
"""

from __future__ import annotations

import os
from concurrent.futures import CancelledError as _FutureCancelled


class SafetensorError(Exception):
    """Base of the errors raised where ``safetensors`` raises ``SafetensorError``: a malformed
    file, a closed handle, a tensor the file lacks, a slice outside a tensor, an unknown option,
    device or dtype."""


class HandleClosedError(SafetensorError, ValueError):
    """An operation on a ``safe_open`` handle after it was closed."""


class TensorNotFoundError(SafetensorError, KeyError):
    """A tensor name the checkpoint does not hold."""


class SliceError(SafetensorError, IndexError):
    """``get_slice(name)[index]`` with an index outside the tensor, or of a form not supported."""


class UnsupportedTypeError(SafetensorError, TypeError):
    """A value of a kind the format or the reader cannot take: an array dtype the format lacks, an
    index that is not an int, a slice, ``...`` or the empty list."""


class OptionError(SafetensorError, ValueError):
    """An option value the library does not know: a framework, an I/O backend, a thread count..."""


class FormatError(SafetensorError, ValueError):
    """A safetensors file (or index) breaks a rule of the format; ``path``, ``rule`` and
    ``tensor`` are attributes, so callers can tell errors apart without parsing the message."""

    def __init__(self, rule: str, detail: str = "", *, path: str | os.PathLike | None = None,
                 tensor: str | None = None) -> None:
        self.rule = rule
        self.detail = detail
        self.path = os.fspath(path) if path is not None else None
        self.tensor = tensor
        parts = []
        if self.path is not None:
            parts.append(self.path)
        if tensor is not None:
            parts.append(f"tensor {tensor!r}")
        where = ": ".join(parts)
        msg = f"[{rule}] {detail}" if detail else f"[{rule}]"
        super().__init__(f"{where}: {msg}" if where else msg)

    def with_path(self, path: str | os.PathLike) -> "FormatError":
        """The same error, naming the file (parsing is pure and does not know it)."""
        return type(self)(self.rule, self.detail, path=path, tensor=self.tensor)


class CancelledError(_FutureCancelled):
    """A background load (``LoadHandle``) or a prefetch was cancelled: what ``result()`` and
    ``wait(name)`` raise after ``cancel()`` (a ``concurrent.futures.CancelledError``)."""


class DeviceError(SafetensorError, RuntimeError):
    """A device string names no usable GPU, or the GPU stack (cupy) is missing."""


class NotATensorError(TypeError, ValueError):
    """A value given to save is not an array of a supported library: the ValueError safetensors
    raises, and the TypeError foxhunt_stream raised before."""


class SparseTensorError(ValueError):
    """Tensors with a sparse layout, which the format cannot hold (safetensors' ValueError and words)."""

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        super().__init__(f"You are trying to save a sparse tensors: `{self.names}` which this library does not "
                         "support. You can make it a dense tensor before saving with `.to_dense()` but be aware "
                         "this might make a much larger file than needed.")


class MetaTensorError(NotImplementedError):
    """Tensors on the meta device have no data to save (the NotImplementedError torch raises in
    the reference, a RuntimeError)."""

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        super().__init__(f"Cannot copy out of meta tensor; no data! Tensors {self.names} are on the meta device: "
                         "give them storage and values first (module.to_empty(device=...), then a load)")


class DeviceOutOfMemoryError(MemoryError):
    """The device ran out of memory while placing a tensor; names the device and the tensor."""

    def __init__(self, device: str, tensor: str, nbytes: int) -> None:
        self.device = device
        self.tensor = tensor
        self.nbytes = nbytes
        super().__init__(f"{device}: out of memory allocating {nbytes} bytes for tensor {tensor!r}")


class StoreMismatchError(ValueError):
    """load_into found names, shapes or dtypes that do not match the store; lists every problem."""

    def __init__(self, problems: list[str], *, missing: list[str] = (), unexpected: list[str] = ()) -> None:
        self.problems = list(problems)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        super().__init__("load_into: the store does not match the checkpoint:\n  " + "\n  ".join(self.problems))


class ChecksumError(FormatError):
    """A tensor's bytes do not match the digest stored with them (rule ``checksum``), or
    ``verify=True`` found no digest to check (rule ``checksum-missing``). Names file and tensor."""
