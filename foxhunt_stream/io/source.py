"""Sources: read byte ranges of a file into host memory, through one small interface.

Backends: ``pread`` (``os.preadv``: releases the GIL; a truncated file is a short read, not a
SIGBUS); ``auto`` (``pread``, and the file mapped to gather strided runs); ``mmap``; ``direct``
(``O_DIRECT``). Every source counts what it read (``bytes_read``), which tests use to prove that
unselected bytes are never read.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Callable

from ..errors import FormatError
from .mapping import FileMap, page_extents, touched_bytes
from .pagecache import sendfile_to_null

if TYPE_CHECKING:   # numpy is imported where it is used: a prefetch starts its code readers first
    import numpy as np

    from ..format.plan import Run

ALIGN = 4096
BACKENDS = ("auto", "pread", "mmap", "direct")

# Test-only fault injection: hook(source, offset, length) before each read (a gather: per extent of
# its pages); it may raise (EIO...) or return a byte count to cut the read short.
fault_hook: Callable[["FileSource", int, int], int | None] | None = None

# Bytes read by every source of this process: tests and benchmarks diff it around a load.
_total_lock = threading.Lock()
_total_read = 0


def total_bytes_read() -> int:
    """Tensor bytes read by all sources of this process so far (headers are not counted)."""
    return _total_read


def stream_of(offset: int, size: int, streams: int) -> int:
    """Which of ``streams`` equal stretches of a ``size``-byte file holds ``offset``."""
    if streams <= 1 or size <= 0:
        return 0
    return min(streams - 1, max(0, offset) * streams // size)


def file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What changes when a file is replaced (rename over it) or rewritten: device, inode, size, mtime."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class FileSource:
    """An open file, read with positional reads. Thread-safe: reads share no file position.

    With ``gather`` (backend ``auto``) it also maps the file, once, and ``gather`` packs strided
    runs out of that mapping; the load's plan was cut for it (``io.read_policy``), so a file that
    cannot be mapped is an error here, not a quiet fallback to reading whole spans."""

    backend = "pread"
    direct_reads = True   # can read straight into any host buffer (no alignment constraints)
    identity: tuple | None = None   # file_identity when its header was read (set by the loader)
    # Read from the disk: each range passed through the cache once more, so the kernel moves its
    # pages to its active list now and a restart reads them hot.
    promote: bool = False

    def __init__(self, path: str | os.PathLike, expected_size: int | None = None, gather: bool = False) -> None:
        self.path = os.fspath(path)
        self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.expected_size = expected_size
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.map: FileMap | None = None
        self._stream_fds: list[int] | None = None   # read_in_streams: one descriptor per stretch
        if gather:
            self.backend = "auto"
            self._map_file("gather column slices out of it")

    def _map_file(self, why: str) -> None:
        try:
            self.map = FileMap(self.fd, self.size())
        except (OSError, ValueError) as e:
            self.close()
            raise OSError(f"{self.path}: cannot map the file to {why} ({e}); load it with backend='pread'") from e

    @property
    def gathers(self) -> bool:
        """Whether ``gather`` packs strided runs (the plan cuts them by the bytes they land)."""
        return self.map is not None

    def count(self, n: int) -> None:
        """Add ``n`` tensor bytes read to this source's and the process's counts."""
        global _total_read
        with _total_lock:   # one short lock per read: both counters
            self.bytes_read += n
            _total_read += n

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def read_in_streams(self, streams: int) -> None:
        """Read each of ``streams`` equal stretches of the file (``stream_of``) through a descriptor of its
        own, so the kernel reads ahead per stretch, reopened through ``/proc/self/fd`` on first read (the
        same inode whatever happened to the path); where that fails, a stretch is read through ``fd``."""
        if streams > 1 and self.fd >= 0:
            self._stream_fds = [-1] * streams

    @property
    def streams(self) -> int:
        return len(self._stream_fds) if self._stream_fds is not None else 1

    def stream(self, offset: int) -> int | None:
        """The stream that reads ``offset`` (None when the file is not read in streams)."""
        if self._stream_fds is None:
            return None
        return stream_of(offset, self.expected_size or 0, len(self._stream_fds))

    def _fd_at(self, offset: int) -> int:
        """The descriptor that reads ``offset``."""
        k = self.stream(offset)
        if k is None:
            return self.fd
        fds = self._stream_fds
        fd = fds[k]
        if fd < 0:
            with self._lock:
                fd = fds[k]
                if fd < 0:
                    fd = fds[k] = self._reopen()
        return fd

    def _reopen(self) -> int:
        """A new descriptor (its own readahead state) of the file ``fd`` has open, or ``fd``."""
        try:
            fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return self.fd
        a, b = os.fstat(fd), os.fstat(self.fd)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            os.close(fd)
            return self.fd
        return fd

    def _short(self, offset: int, got: int, want: int) -> FormatError:
        return FormatError("file-truncated",
                           f"read of {want} bytes at offset {offset} returned only {got}: the file is shorter "
                           "than its header says (truncated or changed while loading?)", path=self.path)

    def _failed(self, e: OSError, offset: int, length: int) -> OSError:
        """A failed read, naming the file and the range."""
        return OSError(e.errno, f"{self.path}: read of {length} bytes at offset {offset} failed: {e.strerror}")

    def _inject(self, offset: int, length: int) -> int | None:
        """Run the test-only fault hook; an OSError it raises reports like a failed read."""
        try:
            return fault_hook(self, offset, length)
        except OSError as e:
            raise self._failed(e, offset, length) from e

    def check_unchanged(self, rule: str = "file-changed") -> None:
        """FormatError ``rule`` unless the open file is still the one its header was read from:
        not replaced before it was opened, not resized or rewritten since."""
        now = os.fstat(self.fd)
        if self.identity is not None:
            changed = file_identity(now) != self.identity
        else:
            changed = self.expected_size is not None and now.st_size != self.expected_size
        if changed:
            raise FormatError(rule, "the file changed since its header was read (replaced, rewritten or "
                              f"resized: now {now.st_size} bytes); load it again", path=self.path)

    def read_into(self, out: np.ndarray, offset: int) -> None:
        """Fill ``out`` (a contiguous uint8 array) with the bytes at ``offset``."""
        want = out.nbytes
        limit = want
        if fault_hook is not None:
            r = self._inject(offset, want)
            if r is not None:
                limit = r
        mv = memoryview(out).cast("B")
        fd = self._fd_at(offset)
        got = 0
        while got < want:
            if got >= limit:
                raise self._short(offset, got, want)
            try:
                n = os.preadv(fd, [mv[got:limit]], offset + got)
            except OSError as e:
                raise self._failed(e, offset, want) from e
            if n == 0:
                raise self._short(offset, got, want)
            got += n
        self.count(want)
        if self.promote:
            self._touch_again(offset, want, fd)

    def _touch_again(self, offset: int, length: int, fd: int | None = None) -> None:
        """The second use of freshly cached pages (``promote``) through ``fd``; best effort."""
        try:
            sendfile_to_null(self.fd if fd is None else fd, offset, length)
        except OSError:
            pass

    def fill_cache(self, offset: int, length: int, scratch: np.ndarray | memoryview, copy: bool = False, *,
                   count: bool = True) -> None:
        """Make ``[offset, offset+length)`` resident in the page cache (a prefetch): ``sendfile_to_null``
        where it works, else (or with ``copy``) read into ``scratch`` (a writable buffer) piece by piece. A
        truncated file is FormatError "file-truncated"; the fault hook applies. ``count=False``: not a
        checkpoint's bytes (a code file), so not counted in ``bytes_read`` / ``total_bytes_read``."""
        limit = length
        if fault_hook is not None:
            r = self._inject(offset, length)
            if r is not None:
                limit = r
        try:
            got = 0 if copy else (sendfile_to_null(self.fd, offset, limit) or 0)
            if got < limit:   # no sendfile here, or it stopped part way: read the rest
                while got < limit:
                    view = memoryview(scratch[:min(scratch.nbytes, limit - got)]).cast("B")
                    n = os.preadv(self.fd, [view], offset + got)
                    if n == 0:
                        break
                    got += n
        except OSError as e:
            raise self._failed(e, offset, length) from e
        if got < length:
            raise self._short(offset, got, length)
        if not copy:   # the load that follows reads them at the hot rate (``promote``)
            self._touch_again(offset, length)
        if count:
            self.count(length)

    def read_span(self, offset: int, length: int, scratch: np.ndarray) -> np.ndarray:
        """The bytes ``[offset, offset+length)`` as a view, read into ``scratch`` if needed."""
        if scratch.nbytes < length:
            raise ValueError(f"a span of {length} bytes does not fit a scratch buffer of {scratch.nbytes}")
        view = scratch[:length]
        self.read_into(view, offset)
        return view

    def scratch_bytes(self, length: int) -> int:
        """Scratch needed by read_span for ``length`` bytes."""
        return length

    def gather(self, run: "Run", out: np.ndarray) -> bool:
        """Pack the rows of a 2-D run into ``out[:run.nbytes]`` with one strided copy out of the
        mapping, touching (and counting as read) only the pages of those rows. False without a
        mapping: the caller reads the whole span with ``read_span``."""
        m = self.map
        if m is None:
            return False
        self._check_mapped(run.src, run.span, page_extents(run) if fault_hook is not None else ())
        out[:run.nbytes].reshape(run.height, run.width)[...] = m.rows(run)
        self.count(touched_bytes(run))
        return True

    def _check_mapped(self, offset: int, length: int, extents) -> None:
        """Before a copy out of the mapping: the fault hook (on each of ``extents``), then the
        file's size, so that a truncated file is FormatError "file-truncated", not a SIGBUS."""
        if fault_hook is not None:
            for off, n in extents:
                r = self._inject(off, n)
                if r is not None and r < n:
                    raise self._short(offset, off + r - offset, length)
        size = min(self.size(), self.map.size)
        if offset + length > size:
            raise self._short(offset, max(0, size - offset), length)

    def close(self) -> None:
        if self.map is not None:
            self.map.close()   # a used mapping goes on a thread of its own (mapping.FileMap.close)
            self.map = None
        fds, self._stream_fds = self._stream_fds, None
        for fd in set(fds or ()) - {-1, self.fd}:
            os.close(fd)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class MmapSource(FileSource):
    """Every read is a copy out of the mapping (a cold file's pages fault in one by one)."""

    backend = "mmap"

    def __init__(self, path, expected_size=None):
        super().__init__(path, expected_size)
        self._map_file("read it")

    def read_into(self, out: np.ndarray, offset: int) -> None:
        want = out.nbytes
        self._check_mapped(offset, want, [(offset, want)])
        import numpy as np
        np.copyto(out.reshape(-1), self.map.bytes(offset, want))
        self.count(want)


class DirectSource(FileSource):
    """O_DIRECT reads: page-aligned offset, length and buffer; bypasses the page cache."""

    backend = "direct"
    direct_reads = False

    def __init__(self, path, expected_size=None):
        super().__init__(path, expected_size)
        self._dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))

    def scratch_bytes(self, length: int) -> int:
        return length + 2 * ALIGN

    def read_span(self, offset: int, length: int, scratch: np.ndarray) -> np.ndarray:
        lo = offset - offset % ALIGN
        hi = -(-(offset + length) // ALIGN) * ALIGN
        addr = scratch.ctypes.data
        pad = (-addr) % ALIGN
        buf = scratch[pad:pad + (hi - lo)]
        if buf.nbytes < hi - lo:
            raise ValueError("scratch buffer too small for an aligned direct read")
        limit = hi - lo
        if fault_hook is not None:
            r = self._inject(offset, length)
            if r is not None:
                limit = min(limit, (r + (offset - lo)) // ALIGN * ALIGN)   # O_DIRECT lengths stay aligned
        mv = memoryview(buf).cast("B")
        got = 0
        need = offset + length - lo
        while got < need:
            if got >= limit:
                raise self._short(offset, max(0, got - (offset - lo)), length)
            try:
                n = os.preadv(self._dfd, [mv[got:limit]], lo + got)
            except OSError as e:
                raise OSError(e.errno, f"{self.path}: direct read at offset {lo} failed: {e.strerror}") from e
            if n == 0:
                raise self._short(offset, max(0, got - (offset - lo)), length)
            got += n
            if n % ALIGN:
                break   # end of file reached inside the last page
        if got < need:
            raise self._short(offset, max(0, got - (offset - lo)), length)
        self.count(length)
        return buf[offset - lo:offset - lo + length]

    def read_into(self, out, offset):
        import numpy as np
        scratch = np.empty(self.scratch_bytes(out.nbytes), np.uint8)
        np.copyto(out.reshape(-1), self.read_span(offset, out.nbytes, scratch))

    def close(self):
        if getattr(self, "_dfd", -1) >= 0:
            os.close(self._dfd)
            self._dfd = -1
        super().close()


def open_source(path, backend: str = "pread", expected_size: int | None = None, *, gather: bool = False) -> FileSource:
    """A source for ``backend`` (module docstring); with ``gather`` a ``pread`` source also maps
    the file and gathers its strided runs out of the mapping."""
    if backend in ("pread", "auto"):
        return FileSource(path, expected_size, gather=gather or backend == "auto")
    if backend == "mmap":
        return MmapSource(path, expected_size)
    if backend == "direct":
        try:
            return DirectSource(path, expected_size)
        except OSError:  # filesystem without O_DIRECT (tmpfs): buffered reads are all it has
            return FileSource(path, expected_size)
    raise ValueError(f"unknown I/O backend {backend!r}; choose one of {', '.join(BACKENDS)}")
