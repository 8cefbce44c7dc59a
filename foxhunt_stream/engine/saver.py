"""The saver: the loader's pipeline backwards. arrays -> (device -> pinned slot) -> file.

The header is computed from shapes and dtypes and written first; then worker threads copy each
chunk back (device chunks through the shared pinned ring on the worker's stream) and write it at
its offset, so device-to-host of one chunk overlaps the write of another and host memory stays
at a few chunks. The file appears atomically (see ``sink``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import numpy as np

from .. import settings as _settings
from ..cuda.devices import Device
from ..format.dtypes import DType, from_numpy, from_torch
from ..format.dtypes import nbytes as _dtype_nbytes
from ..format.header import layout, serialize_header
from ..integrity.checksums import SaveDigests, strip
from .pipeline import Job
from ..format.plan import plan_save
from .progress import NO_PROGRESS, Progress, progress_bar
from ..io.sink import AtomicFile, write_small
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
        if not shape:
            return _rows_source(name, dt, shape, nbytes,
                                lambda r0, r1: np.ascontiguousarray(x, dtype=le).reshape(-1).view(np.uint8), x)
        return _rows_source(name, dt, shape, nbytes,
                            lambda r0, r1: np.ascontiguousarray(x[r0:r1], dtype=le).reshape(-1).view(np.uint8), x)
    if mod.startswith("torch"):
        import torch
        t = x.detach()
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
        if t.dim() == 0:
            return _rows_source(name, dt, shape, nbytes, lambda r0, r1: to_bytes(t.contiguous()), t)
        return _rows_source(name, dt, shape, nbytes, lambda r0, r1: to_bytes(t[r0:r1].contiguous()), t)
    if mod.startswith("cupy"):
        import cupy as cp
        dt = from_numpy(x.dtype)
        if not x.flags.c_contiguous:
            x = cp.ascontiguousarray(x)
        return _Source(name, dt, tuple(x.shape), x.nbytes, Device("cuda", x.device.id), ptr=x.data.ptr, keep=x)
    raise TypeError(f"tensor {name!r}: unsupported array type {mod}.{type(x).__name__}; "
                    "expected numpy, cupy or torch")


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
               progress: Progress = NO_PROGRESS) -> AtomicFile:
    """Write one file to its temp file and return it, not yet committed (aborted on error)."""
    infos = layout([(src.name, src.dtype, src.shape) for src in sources])
    by_name = {src.name: src for src in sources}
    ordered = [by_name[t.name] for t in infos]
    digests = None
    if checksum is not None:   # chunks cut on checksum blocks, each hashed where it passes
        digests = SaveDigests(checksum[0], checksum[1], [t.name for t in infos], [src.nbytes for src in ordered])
        if s.chunk_bytes < digests.block:
            s = replace(s, chunk_bytes=digests.block, staging_bytes=max(s.staging_bytes, digests.block))
    header = serialize_header(infos, metadata if digests is None else digests.metadata(metadata, final=False))
    total = len(header) + (infos[-1].end if infos else 0)
    items = plan_save([src.nbytes for src in ordered], [len(header) + t.start for t in infos], s.chunk_bytes,
                      [digests.block if digests is not None else 1 if src.rows is None else src.row_bytes
                       for src in ordered])
    targets: dict[int, CudaTarget] = {}
    for src in ordered:
        if src.device.is_cuda and src.device.index not in targets:
            targets[src.device.index] = CudaTarget(src.device.index, s.chunk_bytes, s.n_slots)
    sink = AtomicFile(path, total, fsync=fsync, backend=s.write_backend, writers=s.threads)
    try:
        sink.write_at(header, 0)

        def work(worker: int, item) -> None:
            i, run = item
            src = ordered[i]
            if src.host is not None:
                data = src.host[run.src:run.src + run.width]
                if digests is not None:
                    digests.add(i, run.src, data)
                sink.write_at(data, run.dst)
            elif src.rows is not None:
                r0 = run.src // src.row_bytes
                r1 = -(-(run.src + run.width) // src.row_bytes)
                skip = run.src - r0 * src.row_bytes   # nonzero only when chunks follow checksum blocks
                data = (src.rows(r0, r1) if src.shape else src.rows(0, 1))[skip:skip + run.width]
                if digests is not None:
                    digests.add(i, run.src, data)
                sink.write_at(data, run.dst)
            else:
                pool, slot, view = targets[src.device.index].fetch(worker, src.ptr + run.src, run.width)
                try:
                    if digests is not None:
                        digests.add(i, run.src, view)
                    sink.write_at(view, run.dst)
                finally:
                    pool.release(slot)
            progress.update(run.width)

        started = time.perf_counter()
        log.debug("save %s: %d tensors, %d bytes, %d chunks, %d threads, chunk %d, staging %d, from %s, "
                  "write backend %s, fsync %s", os.fspath(path), len(ordered), total, len(items), s.threads,
                  s.chunk_bytes, s.staging_bytes, sorted({str(src.device) for src in ordered}) or ["-"],
                  s.write_backend, fsync)
        if sink.backend == "pwrite" and digests is None and all(src.host is not None for src in ordered):
            # Bytes already in host memory, written by pwrite: the kernel serializes writes to one
            # file on its inode lock, so workers add nothing but cost (measured on the 2-core box,
            # 256 MiB, fsync=False: 0.86-0.91x of safetensors through the pool, 0.95x inline)
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


def shard_names(groups: int) -> list[str]:
    if groups == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{groups:05d}.safetensors" for i in range(groups)]


def split_shards(sizes: list[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Greedy, in the given order: a shard closes when the next tensor would overflow it;
    a tensor larger than the limit sits alone in its shard (Hugging Face's rule)."""
    shards: list[list[str]] = []
    cur: list[str] = []
    cur_size = 0
    for name, size in sizes:
        if size > max_shard_size:
            if cur:
                shards.append(cur)
                cur, cur_size = [], 0
            shards.append([name])
            continue
        if cur and cur_size + size > max_shard_size:
            shards.append(cur)
            cur, cur_size = [], 0
        cur.append(name)
        cur_size += size
    if cur or not shards:
        shards.append(cur)
    return shards


def index_file(directory, weight_map: Mapping[str, str], total_size: int, fsync: bool = True,
               commit: bool = True):
    """``model.safetensors.index.json`` (Hugging Face layout) for shards written into ``directory``."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    return write_small(os.path.join(os.fspath(directory), "model.safetensors.index.json"),
                       (json.dumps(index, indent=2, sort_keys=True) + "\n").encode(), fsync, commit=commit)


def save_file(tensors: Mapping[str, Any], path, metadata: Mapping[str, str] | None = None,
              max_shard_size: int | str | None = None, *, fsync: bool = True, checksum: str | None = None,
              checksum_block: int | None = None, progress: bool | None = None, **options) -> None:
    """Save ``{name: array}`` (numpy, cupy or torch, any device) as safetensors at ``path``.

    Byte-identical to the reference serializer; written incrementally (host memory: a few
    chunks); atomic. With ``max_shard_size``, ``path`` is a directory that receives
    ``model-0000i-of-0000n.safetensors`` shards and ``model.safetensors.index.json``: every shard
    is written before any is renamed into place, and the index last.
    ``checksum`` ("xxh3-64" or "crc32c") stores per-tensor digests in ``__metadata__`` under
    "foxhunt.checksums" (hashed as the chunks are written; ``checksum_block``: block size, default
    8 MiB), for ``load_file(verify=True)`` and ``foxhunt_stream.verify``. A "foxhunt.checksums"
    entry in ``metadata`` itself is dropped: it described some other file's bytes.
    ``progress``: a bar on stderr (None: only on a terminal and past about a second).
    """
    s = _settings.merge(**options)
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError("metadata must be a mapping of str to str")
    metadata = strip(metadata)
    spec = None
    if checksum is not None:
        SaveDigests(checksum, checksum_block, [], [])   # validate the options before any work
        spec = (checksum, checksum_block)
    elif checksum_block is not None:
        raise ValueError("checksum_block needs checksum='xxh3-64' or 'crc32c'")
    sources = [_describe(name, x) for name, x in tensors.items()]
    _wait_producers(sources)
    bar = progress_bar(sum(src.nbytes for src in sources), "save", progress)
    try:
        _save_all(sources, path, metadata, max_shard_size, s, fsync, spec, bar)
    finally:
        bar.close()


def _save_all(sources: list[_Source], path, metadata, max_shard_size, s: _settings.Settings, fsync: bool, spec,
              bar: Progress) -> None:
    if max_shard_size is None:
        _write_one(sources, path, metadata, s, fsync, spec, bar).commit()
        return
    limit = _settings.parse_size(max_shard_size)
    if limit <= 0:
        raise ValueError("max_shard_size must be positive")
    directory = os.fspath(path)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory}: with max_shard_size, path must be an existing directory")
    groups = split_shards([(src.name, src.nbytes) for src in sources], limit)
    files = shard_names(len(groups))
    by_name = {src.name: src for src in sources}
    weight_map = {}
    pending: list[AtomicFile] = []
    try:   # every file is written before any is renamed into place (the index last): a failure
        # while writing leaves every old file as it was
        for names, fname in zip(groups, files):
            pending.append(_write_one([by_name[n] for n in names], os.path.join(directory, fname), metadata, s,
                                      fsync, spec, bar))
            weight_map.update((n, fname) for n in names)
        if len(groups) > 1:
            pending.append(index_file(directory, weight_map, sum(src.nbytes for src in sources), fsync,
                                      commit=False))
        for f in pending:
            f.commit()
    except BaseException:
        for f in pending:
            f.abort()   # a no-op for those already committed
        raise
