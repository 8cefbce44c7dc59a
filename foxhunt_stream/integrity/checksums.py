"""Integrity: optional per-tensor checksums, computed and checked where the bytes already pass.

Format. ``save_file(..., checksum="xxh3-64")`` adds ONE entry to ``__metadata__``,
``"foxhunt.checksums"``, a compact JSON string that other readers ignore::

    {"v":1,"algorithm":"xxh3-64","block_bytes":8388608,"tensors":{"<name>":"<hex digest>",...}}

Digest. A tensor's bytes are cut into blocks of ``block_bytes`` (the last one shorter), each
hashed on its own; the tensor digest is the hash of the block digests (fixed-width little-endian
integers, in block order); an empty tensor's is the hash of no bytes. Blocks, because chunks of
one tensor move on different threads in any order: each chunk, cut on block boundaries, hashes
its own blocks as it moves, with no second pass. Checksums cover whole tensors only.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..errors import FormatError
from ..format.header import Header
from ..format.shards import CHECKSUMS_KEY

METADATA_KEY = CHECKSUMS_KEY
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
        raise ImportError(f"checksum {name!r} needs its library: pip install xxhash google-crc32c ({e})") from None
    _algorithms[name] = a
    return a


def check_block(block_bytes: int) -> int:
    """A block size must be a power of two in [MIN_BLOCK, MAX_BLOCK] (whole items, aligned blocks)."""
    if (type(block_bytes) is not int or block_bytes < MIN_BLOCK or block_bytes > MAX_BLOCK
            or block_bytes & (block_bytes - 1)):
        raise ValueError(f"checksum block size must be a power of two between {MIN_BLOCK} and {MAX_BLOCK}, "
                         f"got {block_bytes!r}")
    return block_bytes


# ---------------------------------------------------------------- one tensor's digest

def _check_cut(offset: int, n: int, size: int, block: int) -> None:
    """Bytes ``[offset, offset + n)`` of a ``size``-byte tensor must be cut on ``block``-byte blocks."""
    if offset % block or (n % block and offset + n != size) or offset + n > size:
        raise ValueError(f"bytes [{offset}, {offset + n}) of a {size}-byte tensor are not cut on "
                         f"{block}-byte checksum blocks")


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
        """Hash the blocks in ``data`` (the tensor's bytes from ``offset``); True if now complete."""
        if not isinstance(data, np.ndarray):
            data = np.frombuffer(data, np.uint8)
        n, b = data.nbytes, self.block
        _check_cut(offset, n, self.size, b)
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
    """Hashes one chunk of a tensor piece by piece, in order, as the worker reads its bytes (no
    second pass); ``done()`` records the chunk's block digests and checks a completed tensor."""

    __slots__ = ("_tensor", "_first", "_pos", "_end", "_h", "_digests", "_on_complete")

    def __init__(self, tensor: TensorHasher, offset: int, nbytes: int, on_complete: Callable[[], None]) -> None:
        b = tensor.block
        _check_cut(offset, nbytes, tensor.size, b)
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
    """The saver's side: one hasher per tensor, and the metadata before (placeholder digests of
    the final width: the header keeps its length) and after hashing."""

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
