"""The saver: the loader's pipeline backwards. arrays -> (device -> pinned slot) -> file.

The header first, then workers write each chunk at its offset (device chunks through the pinned
ring), so host memory stays at a few chunks; the file appears atomically (``sink``). Sharded saves
go through one shard writer, ``_write_shards``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .. import settings as _settings
from ..cuda.devices import Device
from ..errors import MetaTensorError, NotATensorError, SparseTensorError
from ..format.dtypes import DType, from_numpy, from_torch
from ..format.dtypes import nbytes as _dtype_nbytes
from ..format.header import MAX_HEADER_SIZE, layout, serialize_header
from ..integrity.checksums import SaveDigests, strip
from .pipeline import Job
from ..format.plan import plan_save
from .progress import NO_PROGRESS, Progress, progress_bar
from ..format.shards import INDEX_NAME, SAVE_KEY, index_file_names, index_json, is_shard_name, shard_names, split_shards
from ..io.memory import MemorySink
from ..io.sink import AtomicFile, commit_all, write_small
from .targets import CudaTarget

log = logging.getLogger("foxhunt_stream")


@dataclass(eq=False)
class _Source:
    """One tensor to save, reduced to where its bytes can be had."""
    name: str
    dtype: DType
    shape: tuple[int, ...]
    nbytes: int
    device: Device
    host: np.ndarray | None = None          # contiguous host bytes (uint8)
    rows: Callable[[int, int], np.ndarray] | None = None  # host bytes of rows [r0, r1)
    row_bytes: int = 1
    ptr: int = 0                             # device address
    keep: Any = None


@dataclass(frozen=True)
class RawTensor:
    """A tensor given as its safetensors dtype, logical shape and raw little-endian bytes (a
    contiguous host buffer): saved exactly as is, for dtypes no array library spells (F6, F4)."""
    dtype: DType
    shape: tuple[int, ...]
    data: Any


def _rows_source(name, dt, shape, nbytes, make_rows, keep) -> _Source:
    row_bytes = nbytes // shape[0] if shape and shape[0] else max(nbytes, 1)
    return _Source(name, dt, shape, nbytes, Device("cpu"), rows=make_rows, row_bytes=max(row_bytes, 1), keep=keep)


def _describe(name: str, x) -> _Source:
    mod = type(x).__module__
    if isinstance(x, RawTensor):
        if isinstance(x.data, np.ndarray):
            if not x.data.flags.c_contiguous:
                raise ValueError(f"tensor {name!r}: RawTensor data must be contiguous")
            data = x.data.reshape(-1).view(np.uint8)
        else:
            data = np.frombuffer(x.data, np.uint8)
        want = _dtype_nbytes(x.dtype, tuple(x.shape))
        if data.nbytes != want:
            raise ValueError(f"tensor {name!r}: {x.dtype.name}{list(x.shape)} needs {want} bytes, got {data.nbytes}")
        return _Source(name, x.dtype, tuple(x.shape), want, Device("cpu"), host=data, keep=x)
    if isinstance(x, np.ndarray):
        dt = from_numpy(x.dtype)
        shape = tuple(x.shape)
        nbytes = x.nbytes
        little = x.dtype.byteorder != ">" and not (x.dtype.byteorder == "=" and np.little_endian is False)
        if x.flags.c_contiguous and little:
            return _Source(name, dt, shape, nbytes, Device("cpu"), host=x.reshape(-1).view(np.uint8), keep=x)
        le = x.dtype.newbyteorder("<")
        return _rows_source(name, dt, shape, nbytes, lambda r0, r1: np.ascontiguousarray(
            x[r0:r1] if shape else x, dtype=le).reshape(-1).view(np.uint8), x)
    if mod.startswith("torch"):
        import torch
        t = x.detach()
        if t.layout != torch.strided:
            raise SparseTensorError([name])
        if t.device.type == "meta":
            raise MetaTensorError([name])
        dt = from_torch(t.dtype)
        shape = tuple(t.shape)
        if dt.sub_byte and shape:   # packed x2 storage: logical last dim is twice as long
            shape = shape[:-1] + (shape[-1] * 8 // dt.bits,)
        nbytes = t.numel() * t.element_size()
        if t.device.type == "cuda":
            if not t.is_contiguous():
                t = t.contiguous()
            return _Source(name, dt, shape, nbytes, Device("cuda", t.device.index or 0), ptr=t.data_ptr(), keep=t)
        if t.device.type != "cpu":
            raise TypeError(f"tensor {name!r}: unsupported torch device {t.device}")

        def to_bytes(u):
            return u.reshape(-1).view(torch.uint8).numpy() if u.numel() else np.empty(0, np.uint8)
        if t.is_contiguous():
            return _Source(name, dt, shape, nbytes, Device("cpu"), host=to_bytes(t), keep=t)
        return _rows_source(name, dt, shape, nbytes,
                            lambda r0, r1: to_bytes((t[r0:r1] if t.dim() else t).contiguous()), t)
    if mod.startswith("cupy"):
        import cupy as cp
        dt = from_numpy(x.dtype)
        if not x.flags.c_contiguous:
            x = cp.ascontiguousarray(x)
        return _Source(name, dt, tuple(x.shape), x.nbytes, Device("cuda", x.device.id), ptr=x.data.ptr, keep=x)
    raise NotATensorError(f"Key `{name}` is invalid, expected a numpy, cupy or torch array but received {type(x)}")


def _wait_producers(sources: list[_Source]) -> None:
    """Order the copies after all work already enqueued on the producers' current streams."""
    devices = {s.device.index for s in sources if s.device.is_cuda}
    if not devices:
        return
    kinds = {type(s.keep).__module__.split(".")[0] for s in sources if s.device.is_cuda}
    for d in devices:
        if "torch" in kinds:
            import torch
            torch.cuda.current_stream(d).synchronize()
        if "cupy" in kinds:
            import cupy as cp
            with cp.cuda.Device(d):
                cp.cuda.get_current_stream().synchronize()


def _write_one(sources: list[_Source], path, metadata: Mapping[str, str] | None, s: _settings.Settings,
               fsync: bool, checksum: tuple[str, int | None] | None = None,
               progress: Progress = NO_PROGRESS, into: Callable[[int], Any] | None = None) -> AtomicFile:
    """Write one file to its temp file and return it, not yet committed (aborted on error).
    ``into(size)``: the sink to write into instead (``save_bytes``: a buffer in memory)."""
    infos = layout([(src.name, src.dtype, src.shape) for src in sources])
    by_name = {src.name: src for src in sources}
    ordered = [by_name[t.name] for t in infos]
    digests = None
    if checksum is not None:   # chunks cut on checksum blocks, each hashed where it passes
        digests = SaveDigests(checksum[0], checksum[1], [t.name for t in infos], [src.nbytes for src in ordered])
        if s.chunk_bytes < digests.block:
            s = s._replace(chunk_bytes=digests.block, staging_bytes=max(s.staging_bytes, digests.block))
    header = serialize_header(infos, metadata if digests is None else digests.metadata(metadata, final=False))
    total = len(header) + (infos[-1].end if infos else 0)
    items = plan_save([src.nbytes for src in ordered], [len(header) + t.start for t in infos], s.chunk_bytes,
                      [digests.block if digests is not None else 1 if src.rows is None else src.row_bytes
                       for src in ordered])
    targets: dict[int, CudaTarget] = {}
    for src in ordered:
        if src.device.is_cuda and src.device.index not in targets:
            targets[src.device.index] = CudaTarget(src.device.index, s.chunk_bytes, s.n_slots)
    sink = (into(total) if into is not None
            else AtomicFile(path, total, fsync=fsync, backend=s.write_backend, writers=s.threads))
    try:
        sink.write_at(header, 0)

        def work(worker: int, item) -> None:
            i, run = item
            src = ordered[i]
            slot = None
            if src.host is not None:
                data = src.host[run.src:run.src + run.width]
            elif src.rows is not None:
                r0 = run.src // src.row_bytes
                r1 = -(-(run.src + run.width) // src.row_bytes)
                skip = run.src - r0 * src.row_bytes   # nonzero only when chunks follow checksum blocks
                data = (src.rows(r0, r1) if src.shape else src.rows(0, 1))[skip:skip + run.width]
            else:   # device bytes, through a pinned slot
                pool, slot, data = targets[src.device.index].fetch(worker, src.ptr + run.src, run.width)
            try:
                if digests is not None:
                    digests.add(i, run.src, data)
                sink.write_at(data, run.dst)
            finally:
                if slot is not None:
                    pool.release(slot)
            progress.update(run.width)

        started = time.perf_counter()
        log.debug("save %s: %d tensors, %d bytes, %d chunks, %d threads, chunk %d, staging %d, from %s, "
                  "write backend %s, fsync %s", os.fspath(path), len(ordered), total, len(items), s.threads,
                  s.chunk_bytes, s.staging_bytes, sorted({str(src.device) for src in ordered}) or ["-"],
                  s.write_backend, fsync)
        if sink.backend in ("pwrite", "memory") and digests is None and all(src.host is not None for src in ordered):
            # host bytes by pwrite, which the kernel serializes per file: workers would only cost
            for item in items:
                work(0, item)
        else:
            Job(items, work, s.threads, name="foxhunt-save").start().wait()
        elapsed = time.perf_counter() - started
        if elapsed > 0:
            log.debug("save %s: %.3f s, %.2f GB/s (before commit)", os.fspath(path), elapsed, total / elapsed / 1e9)
        if digests is not None:   # same length as the placeholder header: offsets do not move
            final = serialize_header(infos, digests.metadata(metadata, final=True))
            if len(final) != len(header):
                raise RuntimeError("checksum header changed length")   # unreachable: digests are fixed-width
            sink.write_at(final, 0)
    except BaseException:
        sink.abort()
        raise
    return sink


def _save_options(metadata, checksum: str | None, checksum_block: int | None, options: dict):
    """save_file's and save_sharded's options checked: (settings, metadata, checksum spec or None)."""
    s = _settings.merge(**options)
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError("metadata must be a mapping of str to str")
    spec = None
    if checksum is not None:
        SaveDigests(checksum, checksum_block, [], [])   # validate the options before any work
        spec = (checksum, checksum_block)
    elif checksum_block is not None:
        raise ValueError("checksum_block needs checksum='xxh3-64' or 'crc32c'")
    return s, strip(metadata), spec


def _shard_limit(max_shard_size: int | str) -> int:
    limit = _settings.parse_size(max_shard_size)
    if limit <= 0:
        raise ValueError("max_shard_size must be positive")
    return limit


def _write_shards(sizes: Sequence[tuple[str, int]], produce: Callable[[list[str]], list[_Source]], directory: str,
                  limit: int, metadata, s: _settings.Settings, fsync: bool, spec, bar: Progress) -> list[str]:
    """The shard writer: ``sizes`` grouped into shards of at most ``limit`` bytes, each group's sources
    made by ``produce(names)`` only when its shard is written; all shards (one new ``SAVE_KEY``) and the
    index committed together (``sink.commit_all``), replacing an earlier save's files. On failure the
    old files are as they were. Returns the paths, index last."""
    groups = split_shards(sizes, limit)
    files = shard_names(len(groups))
    metadata = {k: v for k, v in metadata.items() if k != SAVE_KEY} if metadata else metadata
    save = secrets.token_hex(16) if len(groups) > 1 else None
    if save is not None:
        metadata = {**(metadata or {}), SAVE_KEY: save}
    weight_map: dict[str, str] = {}
    pending: list[AtomicFile] = []
    try:
        for names, fname in zip(groups, files):
            sources = produce(names)
            f = _write_one(sources, os.path.join(directory, fname), metadata, s, fsync, spec, bar)
            pending.append(f)
            del sources          # before the next group is produced: one shard's tensors at a time
            f.seal()             # durable; kept open (and locked) until the commit
            weight_map.update((n, fname) for n in names)
        if len(groups) > 1:
            pending.append(write_small(os.path.join(directory, INDEX_NAME),
                                       index_json(weight_map, sum(size for _, size in sizes), save), fsync,
                                       commit=False))
        commit_all(pending, replaces=lambda: _earlier_files(directory))
    except BaseException:
        for f in pending:
            f.abort()
        raise
    return [os.path.join(directory, fname) for fname in files] + ([os.path.join(directory, INDEX_NAME)]
                                                                   if len(groups) > 1 else [])


def _earlier_files(directory: str) -> list[str]:
    """The files in ``directory`` that a load of it could take as (part of) its checkpoint, each a
    regular file or a symlink: the index, the files it names, and every name a sharded save gives;
    no other file (configs and other ``*.safetensors`` files stay)."""
    names = {n for n in os.listdir(directory) if is_shard_name(n)}
    raw = _read_regular(os.path.join(directory, INDEX_NAME), MAX_HEADER_SIZE)
    if raw is not None:
        names |= {INDEX_NAME} | index_file_names(raw)
    out = []
    for name in sorted(names):
        full = os.path.join(directory, name)
        try:
            mode = os.lstat(full).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
            out.append(full)
    return out


def _read_regular(path: str, limit: int) -> bytes | None:
    """Up to ``limit`` bytes of ``path`` if it is a regular file (never a FIFO), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        out = bytearray()
        while len(out) < limit:
            chunk = os.read(fd, min(1 << 20, limit - len(out)))
            if not chunk:
                break
            out += chunk
        return bytes(out)
    except OSError:
        return None
    finally:
        os.close(fd)


def check_names(tensors: Any) -> None:
    """``tensors`` is a mapping and every name a str (ValueError, TypeError, as safetensors raises)."""
    if not isinstance(tensors, Mapping):
        raise ValueError(f"Expected a dict of [str, array] but received {type(tensors)}")
    for name in tensors:
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r} of type {type(name).__name__}")


def save_bytes(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None, **options) -> bytes:
    """The bytes ``save_file`` writes for the same tensors and metadata (``save`` of
    ``safetensors.numpy`` and ``safetensors.torch``), written the same way into memory."""
    check_names(tensors)
    s, metadata, _ = _save_options(metadata, None, None, options)
    sources = [_describe(name, x) for name, x in tensors.items()]
    _wait_producers(sources)
    sink = _write_one(sources, "<bytes>", metadata, s, False, into=MemorySink)
    sink.commit()
    return bytes(sink.buffer)


def save_file(tensors: Mapping[str, Any], path, metadata: Mapping[str, str] | None = None,
              max_shard_size: int | str | None = None, *, fsync: bool = True, checksum: str | None = None,
              checksum_block: int | None = None, progress: bool | None = None, **options) -> None:
    """Save ``{name: array}`` (numpy, cupy or torch, any device) as safetensors at ``path``.

    Byte-identical to the reference serializer; written incrementally (host memory: a few
    chunks); atomic. With ``max_shard_size``, ``path`` is a directory that receives
    ``model-0000i-of-0000n.safetensors`` shards and ``model.safetensors.index.json``, the index
    renamed into place last. ``checksum`` ("xxh3-64" or "crc32c") stores per-tensor digests under
    "foxhunt.checksums" (``checksum_block``: block size, default 8 MiB), for
    ``load_file(verify=True)`` and ``foxhunt_stream.verify``; such an entry in ``metadata`` is
    dropped. ``progress``: a bar on stderr (None: on a terminal, past about a second). A
    directory ``path`` without ``max_shard_size``, or a ``.safetensors`` one with it, is refused.
    """
    check_names(tensors)
    s, metadata, spec = _save_options(metadata, checksum, checksum_block, options)
    if max_shard_size is None and os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "is a directory; save_file writes one file there (with "
                                "max_shard_size it writes a directory of shards)", os.fspath(path))
    if max_shard_size is not None:
        check_shard_directory(path, "save_file with max_shard_size")
    sources = [_describe(name, x) for name, x in tensors.items()]
    _wait_producers(sources)
    bar = progress_bar(sum(src.nbytes for src in sources), "save", progress)
    try:
        if max_shard_size is None:
            _write_one(sources, path, metadata, s, fsync, spec, bar).commit()
            return
        limit = _shard_limit(max_shard_size)
        directory = os.fspath(path)
        created = _shard_directory(directory)
        by_name = {src.name: src for src in sources}
        try:
            _write_shards([(src.name, src.nbytes) for src in sources], lambda names: [by_name[n] for n in names],
                          directory, limit, metadata, s, fsync, spec, bar)
        except BaseException:
            if created:   # a failed save leaves no file in it: leave no directory either
                with contextlib.suppress(OSError):
                    os.rmdir(directory)
            raise
    finally:
        bar.close()


def check_shard_directory(path, writer: str) -> None:
    """A ValueError naming ``path`` when its name ends in ``.safetensors`` (a file's name, where
    ``writer`` writes a directory of shards); a file already there is left to the writer's check."""
    name = os.path.basename(os.path.normpath(os.fspath(path)))
    if name.endswith(".safetensors") and (os.path.isdir(path) or not os.path.lexists(path)):
        raise ValueError(f"{os.fspath(path)}: a name ending in .safetensors is a file's, but {writer} writes a "
                         f"directory of shards (model-0000i-of-0000n.safetensors and {INDEX_NAME}); name a "
                         "directory")


def _shard_directory(directory: str) -> bool:
    """The directory for the shards, created with its parents if missing; whether it was created."""
    if os.path.isdir(directory):
        return False
    if os.path.exists(directory):
        raise FileExistsError(f"{directory}: exists and is not a directory; with max_shard_size, path is the "
                              "directory that receives the shards")
    os.makedirs(directory, exist_ok=True)
    return True


def save_sharded(sizes: Sequence[tuple[str, int]], fetch: Callable[[list[str]], Mapping[str, Any]], directory,
                 max_shard_size: int | str, metadata: Mapping[str, str] | None = None, *, fsync: bool = True,
                 checksum: str | None = None, checksum_block: int | None = None, progress: bool | None = None,
                 **options) -> list[str]:
    """The streaming form of ``save_file(..., max_shard_size=)``: the tensors named in ``sizes``
    ((name, nbytes), in order) as shards in the existing ``directory``, ``fetch(names)`` giving one
    shard's ``{name: array}`` only when it is written (host memory: one shard). Same grouping,
    names, atomicity and options as save_file; returns the paths written, the index last."""
    s, metadata, spec = _save_options(metadata, checksum, checksum_block, options)
    limit = _shard_limit(max_shard_size)
    directory = os.fspath(directory)
    check_shard_directory(directory, "save_sharded")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory}: not a directory")

    def produce(names: list[str]) -> list[_Source]:
        tensors = fetch(names)
        sources = [_describe(n, tensors[n]) for n in names]
        _wait_producers(sources)
        return sources

    bar = progress_bar(sum(size for _, size in sizes), "save", progress)
    try:
        return _write_shards(list(sizes), produce, directory, limit, metadata, s, fsync, spec, bar)
    finally:
        bar.close()
