"""Resharding: rewrite a checkpoint into new shards, one output shard in memory at a time.

``save_sharded`` is the streaming form of ``save_file(..., max_shard_size=...)``: the same
grouping (``split_shards``) and names (``shard_names``), but each shard's tensors are produced
only when that shard is written, so host memory peaks at one shard (or one tensor larger than
the limit), whatever the checkpoint's size. The index is written last; if anything fails, the
shards already written are removed again, so the directory holds the whole checkpoint or none.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Mapping, Sequence

from .. import settings as _settings
from ..io.checkpoint import INDEX_NAME, open_checkpoint
from .safe_open import safe_open
from .saver import RawTensor, index_file, save_file, shard_names, split_shards


def save_sharded(sizes: Sequence[tuple[str, int]], fetch: Callable[[list[str]], Mapping[str, Any]], directory,
                 max_shard_size: int | str, metadata: Mapping[str, str] | None = None, *, fsync: bool = True,
                 progress: bool | None = None, **options) -> list[str]:
    """Write the tensors named in ``sizes`` (name, nbytes; in that order) as shards of at most
    ``max_shard_size`` bytes into the existing ``directory``; ``fetch(names)`` returns one shard's
    ``{name: array}``. Returns the paths written, the index (when there are several shards) last."""
    limit = _settings.parse_size(max_shard_size)
    if limit <= 0:
        raise ValueError("max_shard_size must be positive")
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory}: not a directory")
    groups = split_shards(list(sizes), limit)
    files = shard_names(len(groups))
    written, weight_map = [], {}
    try:
        for names, fname in zip(groups, files):
            tensors = fetch(names)
            path = os.path.join(directory, fname)
            save_file({n: tensors[n] for n in names}, path, metadata, fsync=fsync, progress=progress, **options)
            del tensors
            written.append(path)
            weight_map.update((n, fname) for n in names)
        if len(groups) > 1:
            index_file(directory, weight_map, sum(size for _, size in sizes), fsync)
            written.append(os.path.join(directory, INDEX_NAME))
    except BaseException:
        for path in written:
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise
    return written


def reshard(source, out_dir, max_shard_size: int | str, *, fsync: bool = True, checksum: str | None = None,
            progress: bool | None = None, **options) -> list[str]:
    """Rewrite ``source`` (any checkpoint form) into ``out_dir`` as shards of at most
    ``max_shard_size``; tensors are byte-identical, their order is the source's file order, and
    the shards' metadata is the source shards' (merged). ``out_dir`` is created if missing and
    must not already hold a checkpoint. ``checksum`` ("xxh3-64", "crc32c") stores fresh digests
    (the source's, if any, are dropped: save_file writes new ones or none); ``options`` are settings."""
    out_dir = os.fspath(out_dir)
    ck = open_checkpoint(source)
    real_out = os.path.realpath(out_dir)
    if any(os.path.dirname(os.path.realpath(p)) == real_out for p in ck.paths):
        raise ValueError(f"{out_dir}: the output directory holds the source checkpoint; choose another one")
    if os.path.isdir(out_dir):
        existing = [f for f in os.listdir(out_dir) if f.endswith(".safetensors") or f == INDEX_NAME]
        if existing:
            raise FileExistsError(f"{out_dir}: already holds a checkpoint ({existing[0]}); choose an empty directory")
    else:
        os.makedirs(out_dir)
    metadata = None
    for h in ck.headers:
        if h.metadata is not None:
            metadata = {**(metadata or {}), **h.metadata}
    # Shards in file-name order (an index lists them by tensor name), tensors in offset order.
    sizes = [(t.name, t.nbytes) for _, h in sorted(zip(ck.paths, ck.headers), key=lambda ph: ph[0])
             for t in h.tensors]

    def fetch(names: list[str]) -> dict[str, RawTensor]:
        # Raw bytes with the header's own dtype and shape: exact for every dtype, F4/F6 included.
        out = {}
        for name, arr in f.tensors(names, progress=progress):
            info = ck.names[name][1]
            out[name] = RawTensor(info.dtype, info.shape, arr)
        return out

    with safe_open(source, framework="numpy", device="cpu", **options) as f:
        return save_sharded(sizes, fetch, out_dir, max_shard_size, metadata, fsync=fsync, progress=progress,
                            checksum=checksum, **options)
