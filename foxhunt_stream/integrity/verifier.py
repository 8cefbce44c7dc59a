"""The load's side of checksums (``verify=True``): each tensor checked as it lands, hashed on the
worker threads as read, or on its GPU once whole (``cuda.digest``).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import numpy as np

from .. import settings as _settings
from ..errors import ChecksumError
from ..format.plan import Selection
from ..io.checkpoint import Checkpoint
from .checksums import METADATA_KEY, Checksums, ChunkHasher, TensorHasher, algorithm, read_checksums

CHECK_STREAMS = 16   # verify_on="landed" on a GPU: hashing kernels of up to this many tensors at once


class Verifier:
    """Checks each destination the moment its last block is hashed, on the thread that hashed it.

    ``inspector(dest, run)``: a ChunkHasher fed the chunk's host bytes as they are read. With
    ``verify_on="landed"``, xxh3-64 tensors are hashed whole where they landed (``landed``): on the
    host at once, on a GPU by a kernel after the tensor's copies, or, for a plain load, in one batched
    launch per device and block size once every copy is done (``finish``).
    """

    def __init__(self, checks: list[tuple[str, str, Checksums] | None], sizes: Sequence[int],
                 on: str | Sequence[str] = "read") -> None:
        self._checks = checks
        ons = [on] * len(checks) if isinstance(on, str) else list(on)
        # "landed": xxh3-64 tensors are hashed once whole, where they landed (landed_digests)
        self._landed = [o == "landed" and c is not None and c[2].algorithm == "xxh3-64" for c, o in zip(checks, ons)]
        self._pending: dict[int, tuple] = {}   # dest -> (device digests, buffer, stream), not yet checked
        self._pending_lock = threading.Lock()
        self._settle_lock = threading.Lock()   # one settle at a time: a waiter sees a concurrent one's verdict
        self._failed: dict[int, BaseException] = {}
        self._streams: dict[Any, list] = {}    # device -> its hashing streams (cupy), made on first use
        self._streams_lock = threading.Lock()
        self._deferred: list[int] = []         # GPU destinations hashed together by finish()
        self._hashers = [None if c is None else TensorHasher(algorithm(c[2].algorithm), c[2].block_bytes, size)
                         for c, size in zip(checks, sizes)]
        self.granule = max((c[2].block_bytes for c in checks if c is not None), default=1)
        for d, h in enumerate(self._hashers):
            if h is not None and h.complete:    # empty tensors: nothing will pass, check now
                self._check(d)

    @classmethod
    def for_selections(cls, ck: Checkpoint, selections: Sequence[Selection], sizes: Sequence[int],
                       require: bool = True, on: str | Sequence[str] = "read") -> "Verifier":
        """A verifier for whole-tensor selections; ``require``: a tensor without a digest is an error
        (otherwise it is left unchecked); ``on``: "read" or "landed", for all or per selection."""
        per_file: dict[int, Checksums | None] = {}
        checks: list[tuple[str, str, Checksums] | None] = []
        for s in selections:
            name = s.info.name
            if s.index is not None:
                raise ValueError(f"verify=True checks whole-tensor checksums and cannot check a slice of {name!r}; "
                                 "load the whole tensor, or read slices without verify=True")
            if s.file not in per_file:
                per_file[s.file] = read_checksums(ck.headers[s.file], ck.paths[s.file])
            sums = per_file[s.file]
            path = ck.paths[s.file]
            if sums is None or name not in sums.tensors:
                if require:
                    what = (f"the file carries no {METADATA_KEY!r} metadata (save it with checksum=...)"
                            if sums is None else "the file's checksums do not list this tensor")
                    raise ChecksumError("checksum-missing", f"verify=True but {what}", path=path,
                                        tensor=name if sums is not None else None)
                checks.append(None)
            else:
                checks.append((path, name, sums))
        return cls(checks, sizes, on)

    @property
    def checked(self) -> list[bool]:
        return [h is not None for h in self._hashers]

    def settings(self, s: _settings.Settings) -> _settings.Settings:
        """``s`` with chunks large enough to hold whole blocks, and staging grown with them so each
        worker keeps as many slots as before (one slot per worker serializes its reads and copies)."""
        if self.granule <= s.chunk_bytes:
            return s
        # two slots per worker, within 1 GiB (a hostile file may claim 256 MiB blocks)
        slots = min(2 * s.threads, max(1, (1 << 30) // self.granule))
        return s._replace(chunk_bytes=self.granule, staging_bytes=max(s.staging_bytes, slots * self.granule))

    def add(self, dest: int, offset: int, data) -> None:
        h = self._hashers[dest]
        if h is not None and h.add(offset, data):
            self._check(dest)

    def inspector(self, dest: int, run) -> ChunkHasher | None:
        h = self._hashers[dest]
        if h is None or self._landed[dest]:
            return None
        if run.height != 1:
            raise ValueError("checksums cover whole tensors; a strided run cannot be verified")
        return ChunkHasher(h, run.dst, run.width, lambda: self._check(dest))

    # -- verify_on="landed": a whole tensor hashed where it landed, once all its chunks are in

    def hashes_landed(self, dest: int) -> bool:
        return self._landed[dest]

    def landed(self, dest: int, buf, events: Sequence[Any] = (), waited: bool = True) -> None:
        """Every chunk of ``dest`` is in ``buf`` (on a GPU: once ``events``, its copies, complete).
        Host bytes are hashed now; GPU bytes now too when someone waits for this one destination
        (``waited``: a kernel queued after its copies), else with the others in ``finish``."""
        if not self._landed[dest] or self._hashers[dest] is None:
            return
        if not buf.device.is_cuda:
            self.hash_landed(dest, buf)
        elif not waited:
            with self._pending_lock:
                self._deferred.append(dest)
        else:
            from ..cuda import runtime
            with runtime.on_device(buf.device.index):
                # a tensor's kernel runs ~ms (each block sequential): streams in turn, so kernels overlap
                stream = self._stream(buf.device, dest)
                rt = runtime.runtime()
                for ev in events:   # the hash runs after every copy of this destination
                    rt.streamWaitEvent(stream.ptr, ev.ptr)
                self.hash_landed(dest, buf, stream)

    def finish(self, buffer_of: Callable[[int], Any]) -> None:
        """Every copy is done: hash the deferred GPU destinations, then check everything queued."""
        with self._pending_lock:
            later, self._deferred = self._deferred, []   # once: a second finish() must not relaunch
        if later:
            self.landed_batch([(d, buffer_of(d)) for d in later], lambda dev: self._stream(dev, 0))
        self.settle()

    def drain(self) -> None:
        """Wait for every hashing kernel queued on the GPU (they read the destinations)."""
        with self._streams_lock:
            streams = [s for per_device in self._streams.values() for s in per_device]
        for stream in streams:
            stream.synchronize()

    def _stream(self, dev, d: int):
        """Hashing stream ``d % CHECK_STREAMS`` of device ``dev``."""
        from ..cuda.runtime import cupy
        cp = cupy()
        with self._streams_lock:
            streams = self._streams.get(dev)
            if streams is None:
                with cp.cuda.Device(dev.index):
                    streams = self._streams[dev] = [cp.cuda.Stream(non_blocking=True) for _ in range(CHECK_STREAMS)]
            return streams[d % CHECK_STREAMS]

    @property
    def algorithms(self) -> list[str]:
        """The checksum algorithms of the tensors this verifier checks."""
        return sorted({c[2].algorithm for c in self._checks if c is not None})

    def hash_landed(self, dest: int, buf, stream=None) -> None:
        """Destination ``dest`` has landed in ``buf`` (on a GPU: its copies queued before
        ``stream``'s current point): host bytes checked now, device bytes hashed on ``stream``."""
        h = self._hashers[dest]
        if h is None or not self._landed[dest] or h.size == 0:
            return
        if not buf.device.is_cuda:
            self.add(dest, 0, buf.host[:h.size])
            return
        from ..cuda.digest import KernelUnavailable, block_digests
        out = None   # an unaligned view (load_into a slice of a bigger tensor): hash a host copy
        if buf.ptr % 8 == 0:
            try:
                out = block_digests(buf.ptr, h.size, h.block, buf.device.index, stream)
            except KernelUnavailable as e:
                _warn_host_fallback(e)
        with self._pending_lock:
            self._pending[dest] = (out, buf, stream)

    def landed_batch(self, landed, stream_for) -> None:
        """Destinations [(dest, buffer)] whose copies are all complete, hashed in one kernel
        launch per device and block size (on ``stream_for(device)``); ``settle`` checks them."""
        from ..cuda.digest import KernelUnavailable, spans_digests
        groups: dict[tuple, list] = {}
        for d, buf in landed:
            h = self._hashers[d]
            if h is None or not self._landed[d] or h.size == 0:
                continue
            if not buf.device.is_cuda or buf.ptr % 8:
                self.hash_landed(d, buf)   # host bytes, or an unaligned view (hashed from a host copy)
                continue
            groups.setdefault((buf.device, h.block), []).append((d, buf))
        for (dev, block), items in groups.items():
            stream = stream_for(dev)
            try:
                out, first = spans_digests([(buf.ptr, self._hashers[d].size) for d, buf in items], block,
                                           dev.index, stream)
            except KernelUnavailable as e:   # settle hashes host copies of them instead
                _warn_host_fallback(e)
                with self._pending_lock:
                    for d, buf in items:
                        self._pending[d] = (None, buf, None)
                continue
            batch = _DigestBatch(out)
            with self._pending_lock:
                for i, (d, buf) in enumerate(items):
                    self._pending[d] = ((batch, first[i], first[i + 1]), buf, stream)

    def settle(self, dest: int | None = None) -> None:
        """Check what ``landed`` queued on a GPU (every destination, or just ``dest``), short last
        blocks and unaligned tensors hashed on the host; ChecksumError on a mismatch."""
        with self._settle_lock:
            self._settle(dest)
            if dest is not None and dest in self._failed:
                raise self._failed[dest]
            if dest is None and self._failed:   # reported to a waiter already: still no whole load
                raise next(iter(self._failed.values()))

    def _settle(self, dest: int | None) -> None:
        with self._pending_lock:
            todo = ([dest] if dest in self._pending else []) if dest is not None else list(self._pending)
            items = [(d, self._pending.pop(d)) for d in todo]
        for i, (d, (out, buf, stream)) in enumerate(items):
            try:
                self._settle_one(d, out, buf, stream)
            except BaseException as e:
                self._failed[d] = e
                with self._pending_lock:   # the rest stays pending for the caller's cleanup
                    for d2, v in items[i + 1:]:
                        self._pending[d2] = v
                raise

    def _settle_one(self, d: int, out, buf, stream) -> None:
        h = self._hashers[d]
        if stream is not None:
            stream.synchronize()
        if out is None:
            self.add(d, 0, _device_bytes(buf, 0, h.size))
            return
        from ..cuda.digest import MIN_LONG
        if isinstance(out, tuple):   # a slice of a batch's digests
            batch, lo, hi = out
            digests = batch.host()[lo:hi]
        else:
            digests = [int(x) for x in out.get()]
        last = (len(digests) - 1) * h.block
        if h.size - last < MIN_LONG:   # the kernel leaves short blocks to the host
            digests[-1] = h.algo.fn(_device_bytes(buf, last, h.size - last))
        if h.add_digests(0, digests) and digests:
            self._check(d)

    def _check(self, dest: int) -> None:
        path, name, sums = self._checks[dest]
        got, want = self._hashers[dest].digest(), sums.tensors[name]
        if got != want:
            raise ChecksumError("checksum", f"{sums.algorithm} digest {got} does not match {want} stored in the "
                                "file: the tensor's bytes changed after it was saved", path=path, tensor=name)


_fallback_warned = False


def _warn_host_fallback(e: Exception) -> None:
    """Once per process: verify=True still checks everything, but slowly (device -> host copies)."""
    global _fallback_warned
    if not _fallback_warned:
        _fallback_warned = True
        import warnings
        warnings.warn(f"{e}; verify=True hashes host copies of GPU tensors instead (slower; "
                      "verify_on='read' hashes them on their way in)", RuntimeWarning, stacklevel=3)


class _DigestBatch:
    """The device digests of one batched launch, copied to the host once for all its tensors."""

    def __init__(self, out) -> None:
        self._out = out
        self._host: list[int] | None = None

    def host(self) -> list[int]:
        if self._host is None:
            self._host = [int(x) for x in self._out.get()]
        return self._host


def _device_bytes(buf, offset: int, nbytes: int) -> np.ndarray:
    """``nbytes`` of a device buffer copied to the host (short tails, unaligned tensors)."""
    import cupy as cp

    from ..cuda.digest import device_view
    with cp.cuda.Device(buf.device.index):
        return device_view(buf.ptr + offset, nbytes, buf.device.index).get()
