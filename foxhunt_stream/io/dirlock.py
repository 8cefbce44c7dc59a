"""The advisory lock of a checkpoint directory: ``flock`` on the directory's own descriptor. A commit
of several files holds it exclusively, a reader of an index shared while it reads the index and the
shards' headers, so it sees one commit's files (a writer that skips it is caught by the save id of
``format.shards``). Where the directory cannot be opened or locked, nothing is locked.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from typing import Iterator

_UNSUPPORTED = (errno.EBADF, errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


@contextlib.contextmanager
def locked(directory: str | os.PathLike, shared: bool = False) -> Iterator[bool]:
    """Hold the directory's lock (exclusive, or ``shared``) for the ``with`` body; yields whether
    it is held (False where it cannot be taken: an unreadable directory, a filesystem without
    ``flock`` on directories)."""
    try:
        fd = os.open(os.fspath(directory), os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            held = True
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                raise
            held = False
        yield held
    finally:
        os.close(fd)   # releases the lock
