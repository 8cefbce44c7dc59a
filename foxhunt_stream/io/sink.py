"""Sinks: a file that appears atomically (temp file, positional writes, fsync, rename) or not at all,
and a set of files that appears together (``commit_all``). Temp files (``.<target>.foxhunt-tmp.<pid>.<random>``,
never ``*.safetensors``) are ``flock``ed by their writer: ``clean_stale_temps`` removes only unlocked ones.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import secrets
import stat
import time
from typing import Callable, Iterable, Sequence

import numpy as np

from ..settings import WRITE_BACKENDS  # noqa: F401  (the settings table owns the names)
from . import dirlock
from .libc import libc

TEMP_MARK = ".foxhunt-tmp."
MAP_MIN_BYTES = 64 << 20   # "auto" maps files at least this large...
MAP_MIN_WRITERS = 8        # ...written by at least this many threads (parallel copies must beat one pwrite)
FRESH_SECONDS = 2.0        # an empty unlocked temp this young may be its writer's, not yet locked

# Test-only fault injection: called as hook(sink, offset, length) before each write; may raise.
fault_hook: Callable[["AtomicFile", int, int], None] | None = None


def _fallocate(fd: int, size: int) -> bool:
    """Reserve ``size`` bytes for real (Linux fallocate(2), no glibc emulation by writing zeros).
    False where the filesystem cannot; ENOSPC / EFBIG raise here, before any byte is written."""
    if size == 0:
        return True
    try:
        rc = libc().fallocate(fd, 0, 0, size)
    except (AttributeError, OSError):
        return False
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


def _in_memory_fs(directory: str) -> bool:
    """Whether ``directory`` is on tmpfs/ramfs (from /proc/self/mountinfo; False if unknown)."""
    try:
        real = os.path.realpath(directory)
        best, fstype = "", ""
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mount = left.split()[4].replace("\\040", " ")
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, fstype = mount, right.split()[0]
        return fstype in ("tmpfs", "ramfs")
    except (OSError, IndexError):
        return False


def copy_mapped(fd: int, data: np.ndarray, offset: int) -> None:
    """Copy ``data`` (uint8) to ``offset`` of ``fd`` through a mapping of just that window."""
    lo = offset - offset % mmap.ALLOCATIONGRANULARITY
    window = mmap.mmap(fd, offset + data.nbytes - lo, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=lo)
    try:
        dst = np.frombuffer(window, np.uint8, data.nbytes, offset - lo)
        np.copyto(dst, data)
        del dst
    finally:
        window.close()   # unmapped at once: the pages stay in the page cache, not in our RSS


class AtomicFile:
    """Write a file of known size at ``path`` through a temp file; ``commit`` publishes it.

    By ``pwrite`` or ``mmap`` (space reserved by fallocate first, so a full disk fails here and not as
    a SIGBUS). ``auto`` maps files of at least 64 MiB on tmpfs/ramfs written by at least 8 threads,
    where mapped copies beat the kernel's per-file serialized pwrite (docs/architecture.md).
    """

    def __init__(self, path: str | os.PathLike, size: int, fsync: bool = True, backend: str = "auto",
                 writers: int = 1) -> None:
        if backend not in WRITE_BACKENDS:
            raise ValueError(f"write backend must be one of {', '.join(WRITE_BACKENDS)}, got {backend!r}")
        self.path = os.path.abspath(os.fspath(path))
        directory = os.path.dirname(self.path)
        if not os.path.isdir(directory):
            raise FileNotFoundError(errno.ENOENT, f"directory does not exist: {directory}", directory)
        self.size = size
        self.fsync = fsync
        self.tmp = _temp_name(self.path)
        mode = 0o666 & ~_umask()
        self._mapped = False
        self._sealed = False
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)   # before it has a size: see clean_stale_temps
            _take_attributes(self.fd, self.path)
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError):
                raise OSError(e.errno, f"{self.path}: cannot prepare its temp file: {e.strerror}") from e
            raise
        try:
            want_map = backend == "mmap" or (backend == "auto" and size >= MAP_MIN_BYTES
                                             and writers >= MAP_MIN_WRITERS and _in_memory_fs(directory))
            self._mapped = bool(want_map and size and _fallocate(self.fd, size))
            if not self._mapped:
                os.ftruncate(self.fd, size)
        except OSError as e:
            self.abort()
            raise OSError(e.errno, f"{self.path}: cannot reserve {size} bytes: {e.strerror}") from e
        except BaseException:
            self.abort()
            raise

    @property
    def backend(self) -> str:
        return "mmap" if self._mapped else "pwrite"

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
        if self._mapped:   # space reserved by fallocate
            copy_mapped(self.fd, np.frombuffer(mv, np.uint8), offset)
            return
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

    def seal(self) -> None:
        """Every byte written: make them durable (fsync, when asked); the temp file stays open,
        locked and unpublished until ``commit``. Idempotent; on failure the caller aborts."""
        if self.fd >= 0 and not self._sealed:
            if self.fsync:
                os.fsync(self.fd)   # also writes back the pages dirtied through mappings
            self._sealed = True

    def commit(self) -> None:
        """Publish the file: sealed, then renamed over ``path``; on failure nothing changed."""
        try:
            self.seal()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        self._close()
        if self.fsync:
            _fsync_dir(os.path.dirname(self.path))

    def abort(self) -> None:
        """Remove the temp file (while still holding its lock) and close it."""
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass
        self._close()

    def _close(self) -> None:
        """Close the temp file's descriptor, which lets go of its lock."""
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1


def _take_attributes(fd: int, path: str) -> None:
    """Give the new file (``fd``) what the regular file it replaces at ``path`` has: its rwx
    permission bits, its owner and group where this process may set them, and its extended
    attributes (POSIX ACLs among them), each as far as allowed; none there: the umask's mode."""
    try:
        st = os.stat(path)
    except OSError:
        return
    if not stat.S_ISREG(st.st_mode):
        return
    mine = os.fstat(fd)
    if (mine.st_uid, mine.st_gid) != (st.st_uid, st.st_gid):
        for uid in (st.st_uid, -1):
            try:
                os.fchown(fd, uid, st.st_gid)
                break
            except OSError:
                continue
    os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o777)
    if not hasattr(os, "listxattr"):
        return
    try:
        names = os.listxattr(path)
    except OSError:
        return
    for name in names:
        with contextlib.suppress(OSError):
            os.setxattr(fd, name, os.getxattr(path, name))


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


def _temp_name(path: str) -> str:
    """A temp name next to ``path``: hidden, never ``*.safetensors``, marked with our pid."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}{TEMP_MARK}{os.getpid()}."
                                               f"{secrets.token_hex(4)}")


def _keep_old(path: str) -> tuple[bool, str | None]:
    """Before ``path`` is replaced: whether a file is there, and a hard link that keeps it, or None."""
    if not os.path.lexists(path):
        return False, None
    backup = _temp_name(path)
    try:
        os.link(path, backup, follow_symlinks=False)
    except OSError:
        return True, None
    return True, backup


def _undo_publish(path: str, existed: bool, backup: str | None) -> None:
    """Put back what was at ``path`` before a publish that is being rolled back."""
    try:
        if backup is not None:
            os.replace(backup, path)
        elif not existed:
            os.unlink(path)
    except OSError:
        pass
    if backup is not None:   # a rename between two links of one file does nothing: drop the link
        with contextlib.suppress(OSError):
            os.unlink(backup)


def commit_all(files: Sequence[AtomicFile], replaces: Callable[[], Iterable[str]] | None = None) -> None:
    """Publish several files as one, in order (an index last), under their directory's exclusive lock
    (``dirlock``): readers see the set before or after, and commits into one directory run in turn.

    All files are sealed first (fsync failures before any rename); each is then renamed into place and
    the earlier files it replaces moved aside (``replaces()``). A failed rename is undone from hard
    links and moved names, leaving the directory as it was; on success the links and moved files go.
    """
    published: list[tuple[str, bool, str | None]] = []
    directories = sorted({os.path.dirname(f.path) for f in files})
    with contextlib.ExitStack() as held:
        try:
            for f in files:
                f.seal()
            for directory in directories:
                held.enter_context(dirlock.locked(directory))
            ours = {f.path for f in files}
            earlier = [p for p in (replaces() if replaces is not None else ()) if p not in ours]
            for f in files:
                existed, backup = _keep_old(f.path)
                published.append((f.path, existed, backup))
                os.replace(f.tmp, f.path)
            for path in earlier:
                aside = _temp_name(path)
                try:
                    os.rename(path, aside)
                except FileNotFoundError:
                    continue
                published.append((path, True, aside))
        except BaseException:
            for path, existed, backup in reversed(published):
                _undo_publish(path, existed, backup)
            for f in files:
                f.abort()
            raise
        for f in files:
            f._close()
        for _, _, backup in published:
            if backup is not None:
                with contextlib.suppress(OSError):
                    os.unlink(backup)
        for directory in dict.fromkeys(os.path.dirname(f.path) for f in files if f.fsync):
            _fsync_dir(directory)


def clean_stale_temps(directory: str | os.PathLike) -> list[str]:
    """Remove the temp files in ``directory`` whose writer's ``flock`` can be taken at once (no save is
    writing them), keeping those empty and younger than ``FRESH_SECONDS``. Runs under the directory's
    shared lock, so it never sees a commit's links. Returns the paths removed."""
    directory = os.fspath(directory)
    removed = []
    with dirlock.locked(directory, shared=True):
        for name in sorted(os.listdir(directory)):
            if TEMP_MARK in name and name.startswith("."):
                full = os.path.join(directory, name)
                if _remove_if_unlocked(full):
                    removed.append(full)
    return removed


def _remove_if_unlocked(path: str) -> bool:
    """Unlink the regular file ``path`` if its lock can be taken without waiting (and it is not
    a fresh, empty one), holding that lock while it unlinks; whether it did."""
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)   # never a FIFO's open that waits
    try:
        fd = os.open(path, os.O_RDWR | flags)
    except PermissionError:
        try:
            fd = os.open(path, os.O_RDONLY | flags)
        except OSError:
            return False
    except OSError:   # gone already, a symlink, a directory
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:   # a live writer holds it (or the filesystem cannot say): keep it
            return False
        if st.st_size == 0 and time.time() - st.st_mtime < FRESH_SECONDS:
            return False
        try:
            now = os.lstat(path)
        except FileNotFoundError:
            return False
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False
        os.unlink(path)
        return True
    finally:
        os.close(fd)
