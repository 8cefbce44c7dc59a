"""Dropping a file from the page cache, for the tests of what a load does with a cold file."""

import os


def evict(path) -> None:
    """fsync, then POSIX_FADV_DONTNEED (the advice drops clean pages only). Filesystems that keep
    their pages whatever the advice (tmpfs) keep them: callers check residency after."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
