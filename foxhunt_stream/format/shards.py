"""File shards of a checkpoint: which tensors go in which file, the files' names, and the index
(``model.safetensors.index.json``), as Hugging Face's ``save_pretrained`` makes them. Pure
functions, no I/O.

A save of several shards writes one save id under ``SAVE_KEY`` into every shard's
``__metadata__`` and the index's ``"metadata"``; a load checks they agree
(``io.checkpoint.assemble``), which finds a directory holding files of two saves.
"""

from __future__ import annotations

import json
import posixpath
import re
from typing import Mapping, Sequence

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SAVE_KEY = "foxhunt.save"
CHECKSUMS_KEY = "foxhunt.checksums"   # the digests of one file's tensors (integrity.checksums)
# metadata keys that describe one file, not the model: a sharded checkpoint's merged metadata leaves them out
PER_FILE_KEYS = frozenset((SAVE_KEY, CHECKSUMS_KEY))
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def split_shards(sizes: Sequence[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """``(name, nbytes)`` pairs grouped greedily, in order, into shards of at most ``max_shard_size``
    bytes; a larger tensor sits alone (Hugging Face's rule). At least one group, maybe empty."""
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


def shard_names(groups: int) -> list[str]:
    """The file names of ``groups`` shards: ``model.safetensors`` alone, else ``model-0000i-of-0000n.safetensors``."""
    if groups == 1:
        return [SINGLE_NAME]
    return [f"model-{i + 1:05d}-of-{groups:05d}.safetensors" for i in range(groups)]


def is_shard_name(name: str) -> bool:
    """Whether ``name`` is one ``shard_names`` gives, whatever the count."""
    return name == SINGLE_NAME or _SHARD_NAME.fullmatch(name) is not None


def index_json(weight_map: Mapping[str, str], total_size: int, save: str | None = None) -> bytes:
    """The index's bytes: ``{"metadata": {"total_size": ..., SAVE_KEY: save}, "weight_map":
    {name: file}}`` (the save id only when given), keys sorted, indented by two, a final newline."""
    meta: dict = {"total_size": total_size}
    if save is not None:
        meta[SAVE_KEY] = save
    index = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def index_file_names(raw: bytes) -> set[str]:
    """The ``*.safetensors`` file names an index's bytes map tensors to, those plainly in the index's
    own directory (``./x`` as ``x``); an empty set for bytes that are not such an index."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return set()
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict):
        return set()
    names = set()
    for fname in weight_map.values():
        if isinstance(fname, str) and "\\" not in fname and "\0" not in fname:
            plain = posixpath.normpath(fname)
            if "/" not in plain and plain.endswith(".safetensors"):
                names.add(plain)
    return names
