"""Resharding: the source's raw bytes handed shard by shard to the saver's ``save_sharded``, so host
memory peaks at one output shard and the output holds the whole new checkpoint or nothing new.
"""

from __future__ import annotations

import contextlib
import os

from ..io.checkpoint import INDEX_NAME, open_checkpoint
from .safe_open import safe_open
from .saver import RawTensor, check_shard_directory, save_sharded

__all__ = ["reshard", "save_sharded"]   # save_sharded is the saver's; importable from here too


def _output_directory(out_dir: str, source_paths: list[str]) -> bool:
    """Check ``out_dir`` (not the source's, holding no checkpoint); create it if missing, and say so."""
    real_out = os.path.realpath(out_dir)
    if any(os.path.realpath(p) == real_out for p in source_paths):
        raise ValueError(f"{out_dir}: source and destination are the same file; reshard writes a directory of "
                         "shards: name a new directory")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"{out_dir}: is a file, not a directory; reshard writes a directory of shards: "
                              "name a new directory")
    if any(os.path.dirname(os.path.realpath(p)) == real_out for p in source_paths):
        raise ValueError(f"{out_dir}: the output directory holds the source checkpoint; choose another one")
    if os.path.isdir(out_dir):
        existing = [f for f in os.listdir(out_dir) if f.endswith(".safetensors") or f == INDEX_NAME]
        if existing:
            raise FileExistsError(f"{out_dir}: already holds a checkpoint ({existing[0]}); choose an empty directory")
        return False
    os.makedirs(out_dir)
    return True


def reshard(source, out_dir, max_shard_size: int | str, *, fsync: bool = True, checksum: str | None = None,
            progress: bool | None = None, **options) -> list[str]:
    """Rewrite ``source`` into ``out_dir`` as shards of at most ``max_shard_size``: tensors byte-identical,
    in the source's file order, with the source shards' merged metadata (less their save id). ``out_dir``
    (not ``*.safetensors``; created if missing, removed on failure) must hold no checkpoint. ``checksum``
    stores fresh digests; ``options`` are settings. Returns the paths written, the index last."""
    out_dir = os.fspath(out_dir)
    check_shard_directory(out_dir, "reshard")
    ck = open_checkpoint(source)
    created = _output_directory(out_dir, ck.paths)
    metadata = None
    for h in ck.headers:   # a save id among them is dropped by the writer, which gives its own
        if h.metadata is not None:
            metadata = {**(metadata or {}), **h.metadata}
    # Shards in file-name order (an index lists them by tensor name), tensors in offset order.
    sizes = [(t.name, t.nbytes) for _, h in sorted(zip(ck.paths, ck.headers), key=lambda ph: ph[0])
             for t in h.tensors]

    def fetch(names: list[str]) -> dict[str, RawTensor]:
        # Raw bytes with the header's own dtype and shape: exact for every dtype, F4/F6 included.
        out = {}
        for name, arr in f.tensors(names, progress=False):
            info = ck.names[name][1]
            out[name] = RawTensor(info.dtype, info.shape, arr)
        return out

    try:
        with safe_open(source, framework="numpy", device="cpu", **options) as f:
            return save_sharded(sizes, fetch, out_dir, max_shard_size, metadata, fsync=fsync, progress=progress,
                                checksum=checksum, **options)
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(out_dir)   # only if still empty: the writer left nothing in it
        raise
