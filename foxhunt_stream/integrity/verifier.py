"""Integrity: optional per-tensor checksums, computed and checked where the bytes already pass.

Format. ``save_file(..., checksum="xxh3-64")`` adds ONE entry to ``__metadata__``,
``"foxhunt.checksums"``, whose value is a compact JSON string::

    {"v":1,"algorithm":"xxh3-64","block_bytes":8388608,"tensors":{"<name>":"<hex digest>",...}}

Any other reader sees one more metadata string and ignores it: the file stays plain safetensors.

Digest. A tensor's bytes are cut into blocks of ``block_bytes`` (the last one shorter), each
block is hashed on its own, and the tensor digest is the hash of the block digests (each as a
fixed-width little-endian integer, in block order); an empty tensor's digest is the hash of no
bytes. Why blocks: chunks of one tensor are read (or written) by different threads in any order,
so a single running hash cannot follow them; with chunks cut on block boundaries, every chunk
hashes its own blocks on the thread that moves it, and the last block in completes the tensor.
No second pass over the data is ever made.

Checksums cover whole tensors only: a slice of a tensor cannot be checked against them.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .. import settings as _settings
from ..io.checkpoint import Checkpoint, open_checkpoint
from ..errors import ChecksumError, FormatError
from ..format.header import Header
from ..engine.pipeline import Job
from ..format.plan import Selection, plan_load
from ..io.source import ALIGN
from ..engine.staging import host_pool

METADATA_KEY = "foxhunt.checksums"
FORMAT_VERSION = 1
ALGORITHMS = ("xxh3-64", "crc32c")
DEFAULT_BLOCK = 8 << 20    # = the default chunk: verify=True loads keep the default chunking
MIN_BLOCK = 4096           # a block must be a multiple of every itemsize, and cheap to track
MAX_BLOCK = 256 << 20      # bounds the chunk (and staging slot) a hostile file can make us allocate


# ---------------------------------------------------------------- algorithms

@dataclass(frozen=True)
class Algorithm:
    name: str
    width: int                          # digest bytes
    fn: Callable[[Any], int] = field(repr=False)   # bytes-like (numpy uint8) -> int
    new: Callable[[], Any] = field(repr=False)      # a streaming hasher: .update(bytes-like)
    final: Callable[[Any], int] = field(repr=False)  # streaming hasher -> int (== fn of all its bytes)

    def hex(self, value: int) -> str:
        return f"{value:0{2 * self.width}x}"


_algorithms: dict[str, Algorithm] = {}


def algorithm(name: str) -> Algorithm:
    """The named algorithm; its library is imported on first use (extra ``checksum``)."""
    a = _algorithms.get(name)
    if a is not None:
        return a
    if name not in ALGORITHMS:
        raise ValueError(f"unknown checksum algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}")
    try:
        if name == "xxh3-64":
            import xxhash
            a = Algorithm(name, 8, xxhash.xxh3_64_intdigest, xxhash.xxh3_64, lambda h: h.intdigest())
        else:
            import google_crc32c
            a = Algorithm(name, 4, google_crc32c.value, google_crc32c.Checksum,
                          lambda h: int.from_bytes(h.digest(), "big"))
    except ImportError as e:
        raise ImportError(f"checksum {name!r} needs its library: pip install 'foxhunt-stream[checksum]' ({e})") from None
    _algorithms[name] = a
    return a


def check_block(block_bytes: int) -> int:
    """A block size must be a power of two in [MIN_BLOCK, MAX_BLOCK] (so it divides into every
    dtype's itemsize and aligns to every other block size)."""
    if (type(block_bytes) is not int or block_bytes < MIN_BLOCK or block_bytes > MAX_BLOCK
            or block_bytes & (block_bytes - 1)):
        raise ValueError(f"checksum block size must be a power of two between {MIN_BLOCK} and {MAX_BLOCK}, "
                         f"got {block_bytes!r}")
    return block_bytes


# ---------------------------------------------------------------- one tensor's digest

class TensorHasher:
    """Block digests of one tensor, filled by any thread in any order; thread-safe."""

    __slots__ = ("algo", "block", "size", "_blocks", "_missing", "_lock")

    def __init__(self, algo: Algorithm, block: int, size: int) -> None:
        self.algo, self.block, self.size = algo, block, size
        n = -(-size // block)
        self._blocks: list[int | None] = [None] * n
        self._missing = n
        self._lock = threading.Lock()

    def add(self, offset: int, data) -> bool:
        """Hash the blocks in ``data`` (tensor bytes ``[offset, offset + len(data))``, cut on block
        boundaries); True when this completed the tensor."""
        if not isinstance(data, np.ndarray):
            data = np.frombuffer(data, np.uint8)
        n, b = data.nbytes, self.block
        if offset % b or (n % b and offset + n != self.size) or offset + n > self.size:
            raise ValueError(f"bytes [{offset}, {offset + n}) of a {self.size}-byte tensor are not cut on "
                             f"{b}-byte checksum blocks")
        fn = self.algo.fn
        return self.add_digests(offset // b, [fn(data[p:p + b]) for p in range(0, n, b)])

    def add_digests(self, first: int, digests: list[int]) -> bool:
        """Record the digests of blocks ``first, first + 1, ...``; True when this completed the tensor."""
        with self._lock:
            for k, d in enumerate(digests):
                if self._blocks[first + k] is not None:
                    raise ValueError(f"checksum block {first + k} hashed twice")
                self._blocks[first + k] = d
            self._missing -= len(digests)
            return self._missing == 0 and bool(digests)

    @property
    def complete(self) -> bool:
        return self._missing == 0

    def digest(self) -> str:
        """The tensor digest (hex); every block must have been added."""
        if self._missing:
            raise ValueError(f"{self._missing} checksum block(s) not hashed yet")
        w = self.algo.width
        return self.algo.hex(self.algo.fn(b"".join(d.to_bytes(w, "little") for d in self._blocks)))


class ChunkHasher:
    """Hashes one chunk of a tensor piece by piece, in order, as its bytes arrive.

    The loader feeds it the chunk's bytes on the worker thread right after reading them
    (``target.read_inspected``; pieces of ``target.PIECE_BYTES``, by default the whole chunk),
    so no second pass over the data is made. ``done()`` records the chunk's block digests and
    checks the tensor if it is now complete.
    """

    __slots__ = ("_tensor", "_first", "_pos", "_end", "_h", "_digests", "_on_complete")

    def __init__(self, tensor: TensorHasher, offset: int, nbytes: int, on_complete: Callable[[], None]) -> None:
        b = tensor.block
        if offset % b or (nbytes % b and offset + nbytes != tensor.size) or offset + nbytes > tensor.size:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) of a {tensor.size}-byte tensor are not cut on "
                             f"{b}-byte checksum blocks")
        self._tensor, self._first, self._pos, self._end = tensor, offset // b, offset, offset + nbytes
        self._h = None
        self._digests: list[int] = []
        self._on_complete = on_complete

    def update(self, data) -> None:
        """Hash the next ``len(data)`` bytes of the chunk."""
        t = self._tensor
        algo, b = t.algo, t.block
        n, i = len(data), 0
        if self._pos + n > self._end:
            raise ValueError("more bytes than the chunk holds")
        while i < n:
            if self._h is None:
                self._h = algo.new()
            take = min(n - i, b - self._pos % b, t.size - self._pos)
            self._h.update(data[i:i + take] if take != n else data)
            self._pos += take
            i += take
            if self._pos % b == 0 or self._pos == t.size:
                self._digests.append(algo.final(self._h))
                self._h = None

    def done(self) -> None:
        if self._pos != self._end:
            raise ValueError(f"chunk hashed {self._pos - self._first * self._tensor.block} of its bytes only")
        if self._tensor.add_digests(self._first, self._digests) and self._digests:
            self._on_complete()

def tensor_digest(data, algo: str = "xxh3-64", block: int = DEFAULT_BLOCK) -> str:
    """The digest of one tensor's bytes, computed in one go (for tests and tools)."""
    data = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    h = TensorHasher(algorithm(algo), block, data.nbytes)
    if data.nbytes:
        h.add(0, data)
    return h.digest()


# ---------------------------------------------------------------- the metadata entry

@dataclass(frozen=True)
class Checksums:
    """The parsed ``foxhunt.checksums`` entry of one file."""
    algorithm: str
    block_bytes: int
    tensors: dict[str, str]

    def encode(self) -> str:
        return json.dumps({"v": FORMAT_VERSION, "algorithm": self.algorithm, "block_bytes": self.block_bytes,
                           "tensors": self.tensors}, separators=(",", ":"), ensure_ascii=False)


def read_checksums(header: Header, path: str) -> Checksums | None:
    """The checksums a file carries, validated against its header; None when it has none."""
    raw = (header.metadata or {}).get(METADATA_KEY)
    if raw is None:
        return None

    def bad(detail: str) -> FormatError:
        return FormatError("checksum-metadata", f"__metadata__[{METADATA_KEY!r}]: {detail}", path=path)

    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        raise bad("not valid JSON") from None
    if not isinstance(obj, dict) or obj.get("v") != FORMAT_VERSION:
        raise bad(f"expected an object with \"v\": {FORMAT_VERSION}")
    algo, block, tensors = obj.get("algorithm"), obj.get("block_bytes"), obj.get("tensors")
    if algo not in ALGORITHMS:
        raise bad(f"unknown algorithm {algo!r}; known: {', '.join(ALGORITHMS)}")
    try:
        check_block(block)
    except ValueError as e:
        raise bad(str(e)) from None
    if not isinstance(tensors, dict):
        raise bad("'tensors' must be an object of name to hex digest")
    width = 2 * (8 if algo == "xxh3-64" else 4)
    for name, d in tensors.items():
        if name not in header.by_name:
            raise bad(f"lists tensor {name!r}, which the file does not hold")
        if not isinstance(d, str) or len(d) != width or any(c not in "0123456789abcdef" for c in d):
            raise bad(f"digest of {name!r} must be {width} lowercase hex digits, got {d!r}"[:200])
    return Checksums(algo, block, tensors)


def strip(metadata: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """User metadata without a stale checksum entry (say, metadata read from another file):
    digests describe one file's bytes and are only ever written by the saver itself."""
    if metadata is None or METADATA_KEY not in metadata:
        return metadata
    rest = {k: v for k, v in metadata.items() if k != METADATA_KEY}
    return rest or None


class SaveDigests:
    """The saver's side: one hasher per tensor, and the metadata before and after hashing.

    The header is written first, so it first carries placeholder digests of the final width
    (same header length, same offsets) and is rewritten once every block is hashed.
    """

    def __init__(self, algo: str, block: int | None, names: Sequence[str], sizes: Sequence[int]) -> None:
        self.algo = algorithm(algo)
        self.block = check_block(DEFAULT_BLOCK if block is None else block)
        self.names = list(names)
        self.hashers = [TensorHasher(self.algo, self.block, n) for n in sizes]

    def add(self, i: int, offset: int, data) -> None:
        self.hashers[i].add(offset, data)

    def metadata(self, metadata: Mapping[str, str] | None, final: bool) -> dict[str, str]:
        digests = {n: (h.digest() if final else "0" * 2 * self.algo.width) for n, h in zip(self.names, self.hashers)}
        out = dict(metadata or {})
        out[METADATA_KEY] = Checksums(self.algo.name, self.block, digests).encode()
        return out


# ---------------------------------------------------------------- the loader's side

class Verifier:
    """Checks each destination the moment its last block is hashed, on the thread that hashed it.

    ``inspector(dest, run)`` is the hook handed to ``target.land``: a ChunkHasher that is fed
    the chunk's host bytes as they are read (into the destination itself on the host, into the
    pinned slot on the way to a GPU).
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
        return replace(s, chunk_bytes=self.granule, staging_bytes=max(s.staging_bytes, slots * self.granule))

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

    def landed(self, dest: int, buf, stream=None) -> None:
        """Destination ``dest`` has landed in ``buf`` (its copies queued before ``stream``'s
        current point, on a GPU). Host bytes are hashed and checked now; device bytes get their
        block digests computed by a kernel queued on ``stream`` and are checked by ``settle``."""
        h = self._hashers[dest]
        if h is None or not self._landed[dest] or h.size == 0:
            return
        if not buf.device.is_cuda:
            data = buf.host[:h.size]
            if h.add(0, data):
                self._check(dest)
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
        """Destinations [(dest, buffer)] whose copies are all complete, hashed together: one
        kernel launch per device and block size (``stream_for(device)`` gives its stream) instead
        of one per tensor, whose Python overhead on the worker threads cost more than the hashing;
        ``settle`` checks them."""
        from ..cuda.digest import KernelUnavailable, spans_digests
        groups: dict[tuple, list] = {}
        for d, buf in landed:
            h = self._hashers[d]
            if h is None or not self._landed[d] or h.size == 0:
                continue
            if not buf.device.is_cuda or buf.ptr % 8:
                self.landed(d, buf)   # host bytes, or an unaligned view (hashed from a host copy)
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
        """Check what ``landed`` queued on a GPU (every destination, or just ``dest``): waits for
        the digests, hashes short last blocks (and unaligned tensors) on the host, raises
        ChecksumError on a mismatch."""
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
            if h.add(0, _device_bytes(buf, 0, h.size)):
                self._check(d)
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


# ---------------------------------------------------------------- fs.verify

@dataclass
class VerifyReport:
    """What ``verify`` checked: every header rule of every file, every byte read once, and the
    digest of every tensor that has one (``unchecked`` lists those without)."""
    files: list[str]
    tensors: int
    bytes_read: int
    checked: int
    unchecked: list[str]
    algorithms: list[str]


def verify(source, *, require_checksums: bool = False, **options) -> VerifyReport:
    """Validate a checkpoint without a GPU: headers (every format rule, shards against their
    index), then every tensor byte read once, in chunks, on worker threads, against its stored
    digest. Raises the first problem (FormatError / ChecksumError / OSError naming the file);
    returns a VerifyReport. With ``require_checksums``, a tensor without a digest is an error.
    Host memory: a few chunks, whatever the checkpoint size.
    """
    s = _settings.merge(**options)
    ck = open_checkpoint(source)
    names = ck.file_order()
    sels = [Selection(f, ck.headers[f].data_start, info) for f, info in (ck.names[n] for n in names)]
    sizes = [sel.info.nbytes for sel in sels]
    verifier = Verifier.for_selections(ck, sels, sizes, require=require_checksums)
    s = verifier.settings(s)
    plan = plan_load(sels, s.chunk_bytes, granule=verifier.granule)
    from ..engine.loader import open_sources  # the loader's: backend choice, same-file check
    from ..engine.targets import read_inspected
    sources = open_sources(ck, s)
    try:
        pool = host_pool(s.chunk_bytes + 2 * ALIGN, max(s.threads, 1))

        def work(worker: int, chunk) -> None:
            slot = pool.acquire()
            try:
                read_inspected(sources[chunk.file], chunk.run.src, chunk.run.span, slot.array,
                               verifier.inspector(chunk.dest, chunk.run))
            finally:
                pool.release(slot)

        Job(plan.chunks, work, s.threads, name="foxhunt-verify").start().wait()
        for src in sources:
            src.check_unchanged()
        read = sum(src.bytes_read for src in sources)
    finally:
        for src in sources:
            src.close()
    checked = verifier.checked
    algos = sorted({c[2].algorithm for c in verifier._checks if c is not None})
    return VerifyReport(list(ck.paths), len(names), read, sum(checked),
                        [n for n, c in zip(names, checked) if not c], algos)
