"""Exception types. Every malformed-file problem is a FormatError naming file, rule and tensor."""

from __future__ import annotations

import os


class FormatError(ValueError):
    """A safetensors file (or index) breaks a rule of the format.

    ``path``, ``rule`` and ``tensor`` are kept as attributes so callers can tell errors apart
    without parsing the message.
    """

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
        return FormatError(self.rule, self.detail, path=path, tensor=self.tensor)


class DeviceError(RuntimeError):
    """A device string names no usable GPU, or the GPU stack (cupy) is missing."""


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

    def with_path(self, path: str | os.PathLike) -> "ChecksumError":
        return ChecksumError(self.rule, self.detail, path=path, tensor=self.tensor)
