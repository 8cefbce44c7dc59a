"""Sinks: a file that appears atomically (temp file, positional writes, fsync, rename) or not at all.

Temp files are named ``.<target>.foxhunt-tmp.<pid>.<random>`` in the target's directory: never
``*.safetensors``, so a crash leaves nothing a loader would mistake for a checkpoint, and
``clean_stale_temps`` removes the ones whose process is gone.
"""

from __future__ import annotations

import errno
import os
import secrets
from typing import Callable

TEMP_MARK = ".foxhunt-tmp."

# Test-only fault injection: called as hook(sink, offset, length) before each write; may raise.
fault_hook: Callable[["AtomicFile", int, int], None] | None = None


class AtomicFile:
    """Write a file of known size at ``path`` through a temp file; ``commit`` publishes it."""

    def __init__(self, path: str | os.PathLike, size: int, fsync: bool = True) -> None:
        self.path = os.path.abspath(os.fspath(path))
        directory = os.path.dirname(self.path)
        if not os.path.isdir(directory):
            raise FileNotFoundError(errno.ENOENT, f"directory does not exist: {directory}", directory)
        self.size = size
        self.fsync = fsync
        self.tmp = os.path.join(directory, f".{os.path.basename(self.path)}{TEMP_MARK}{os.getpid()}."
                                           f"{secrets.token_hex(4)}")
        mode = 0o666 & ~_umask()
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
        try:
            os.ftruncate(self.fd, size)
        except BaseException:
            self.abort()
            raise

    def write_at(self, data, offset: int) -> None:
        """Write all of ``data`` (any buffer) at ``offset``."""
        mv = memoryview(data).cast("B")
        if fault_hook is not None:
            try:
                fault_hook(self, offset, mv.nbytes)
            except OSError as e:   # reports like a failed pwrite
                raise OSError(e.errno, f"{self.path}: write of {mv.nbytes} bytes at offset {offset} failed: "
                                       f"{e.strerror}") from e
        if offset + mv.nbytes > self.size:
            raise ValueError(f"write past the planned end of {self.path}")
        done = 0
        while done < mv.nbytes:
            try:
                n = os.pwrite(self.fd, mv[done:], offset + done)
            except OSError as e:
                raise OSError(e.errno, f"{self.path}: write of {mv.nbytes} bytes at offset {offset} failed: "
                                       f"{e.strerror}") from e
            if n == 0:
                raise OSError(errno.EIO, f"{self.path}: write made no progress at offset {offset + done}")
            done += n

    def commit(self) -> None:
        try:
            if self.fsync:
                os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        if self.fsync:
            _fsync_dir(os.path.dirname(self.path))

    def abort(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_small(path: str | os.PathLike, data: bytes, fsync: bool = True, commit: bool = True) -> AtomicFile:
    """Atomically write a small file (an index.json); ``commit=False`` leaves the commit to the caller."""
    f = AtomicFile(path, len(data), fsync)
    try:
        f.write_at(data, 0)
    except BaseException:
        f.abort()
        raise
    if commit:
        f.commit()
    return f


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_temps(directory: str | os.PathLike) -> list[str]:
    """Remove temp files left in ``directory`` by saves whose process no longer exists."""
    removed = []
    for name in os.listdir(directory):
        if TEMP_MARK not in name or not name.startswith("."):
            continue
        try:
            pid = int(name.rsplit(TEMP_MARK, 1)[1].split(".")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            full = os.path.join(directory, name)
            try:
                os.unlink(full)
                removed.append(full)
            except FileNotFoundError:
                pass
    return removed
