"""Checkpoints: resolve a source (file, list, index.json, directory) into files and headers.

Reading a header is the only I/O here: the 8-byte prefix, then exactly the announced number
of bytes (capped by the format's limit and the file size), then the pure parser.
"""

from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .errors import FormatError
from .header import MAX_HEADER_SIZE, N_LEN, Header, TensorInfo, parse_header, read_header_len
from .source import file_identity

INDEX_NAME = "model.safetensors.index.json"


def read_header(path: str | os.PathLike) -> Header:
    """Read and validate the header of one file; FormatError names the file."""
    return _read_header(path)[0]


def _read_header(path: str | os.PathLike) -> tuple[Header, tuple]:
    """The header and the identity of the file it was read from (see ``source.file_identity``)."""
    path = os.fspath(path)
    with open(path, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        size = st.st_size
        prefix = _read_exact(f, 0, min(N_LEN, size))
        try:
            n = read_header_len(prefix, size)
            body = _read_exact(f, N_LEN, min(n, MAX_HEADER_SIZE))
            return parse_header(prefix + body, size), file_identity(st)
        except FormatError as e:
            raise e.with_path(path) from None


def _read_exact(f, offset: int, n: int) -> bytes:
    out = bytearray(n)
    mv = memoryview(out)
    got = 0
    while got < n:
        k = os.preadv(f.fileno(), [mv[got:]], offset + got)
        if k == 0:
            break
        got += k
    return bytes(out[:got])


@dataclass
class Checkpoint:
    """The files of a checkpoint, their headers, and one name map across them."""
    paths: list[str]
    headers: list[Header]
    names: dict[str, tuple[int, TensorInfo]] = field(default_factory=dict)
    index_metadata: dict | None = None
    identities: list[tuple] = field(default_factory=list)   # per file, as its header was read

    def metadata(self) -> dict[str, str] | None:
        """A single file's metadata; for several files, every shard's and the index's merged."""
        if len(self.paths) == 1 and self.index_metadata is None:
            return self.headers[0].metadata
        merged: dict[str, str] = {}
        for h in self.headers:
            merged.update(h.metadata or {})
        for k, v in (self.index_metadata or {}).items():
            merged[k] = v if isinstance(v, str) else json.dumps(v)
        return merged or None

    def file_order(self) -> list[str]:
        return [t.name for h in self.headers for t in h.tensors]


def resolve(source) -> tuple[list[str], dict | None, dict | None]:
    """(paths, index weight_map or None, index metadata or None) for any accepted source."""
    if isinstance(source, (list, tuple)):
        if not source:
            raise ValueError("empty list of checkpoint files")
        return [os.fspath(p) for p in source], None, None
    path = os.fspath(source)
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_NAME)
        if os.path.isfile(index):
            return _from_index(index)
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors files and no {INDEX_NAME}")
        return files, None, None
    if path.endswith(".json"):
        return _from_index(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    return [path], None, None


def _from_index(index_path: str) -> tuple[list[str], dict, dict | None]:
    try:
        with open(index_path, "rb") as f:
            raw = f.read(MAX_HEADER_SIZE + 1)
        if len(raw) > MAX_HEADER_SIZE:
            raise FormatError("index-too-large", f"index larger than {MAX_HEADER_SIZE} bytes", path=index_path)
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError("index-json", f"index is not valid JSON: {e}"[:300], path=index_path) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("weight_map"), dict):
        raise FormatError("index-weight-map", "index must be an object with a 'weight_map' object", path=index_path)
    base = os.path.dirname(os.path.abspath(index_path))
    real_base = os.path.realpath(base)
    files: list[str] = []
    seen: dict[str, str] = {}
    for name, fname in obj["weight_map"].items():
        if not isinstance(fname, str) or not fname:
            raise FormatError("index-weight-map", f"weight_map[{name!r}] must be a file name", path=index_path)
        if os.path.isabs(fname) or ".." in fname.replace("\\", "/").split("/"):
            raise FormatError("index-path-escape", f"weight_map[{name!r}] = {fname!r} leaves the checkpoint directory",
                              path=index_path, tensor=name)
        full = os.path.join(base, fname)
        if fname not in seen:
            real = os.path.realpath(full)
            if os.path.commonpath([real, real_base]) != real_base:
                raise FormatError("index-path-escape",
                                  f"weight_map[{name!r}] = {fname!r} resolves outside the checkpoint directory",
                                  path=index_path, tensor=name)
            if not os.path.isfile(full):
                raise FormatError("index-missing-file", f"weight_map[{name!r}] names {fname!r}, which does not exist",
                                  path=index_path, tensor=name)
            seen[fname] = full
            files.append(full)
    meta = obj.get("metadata")
    return files, {k: seen[v] for k, v in obj["weight_map"].items()}, meta if isinstance(meta, dict) else None


def open_checkpoint(source) -> Checkpoint:
    paths, weight_map, index_meta = resolve(source)
    read = [_read_header(p) for p in paths]
    headers = [h for h, _ in read]
    ck = Checkpoint(paths, headers, index_metadata=index_meta, identities=[i for _, i in read])
    for i, h in enumerate(headers):
        for t in h.tensors:
            prev = ck.names.get(t.name)
            if prev is not None:
                raise FormatError("duplicate-across-shards",
                                  f"tensor appears in both {paths[prev[0]]} and {paths[i]}", tensor=t.name)
            ck.names[t.name] = (i, t)
    if weight_map is not None:
        for name, full in weight_map.items():
            where = ck.names.get(name)
            if where is None or os.path.realpath(paths[where[0]]) != os.path.realpath(full):
                raise FormatError("index-mismatch", f"index maps it to {os.path.basename(full)} but that shard's "
                                  "header does not hold it", path=full, tensor=name)
        extra = [n for n in ck.names if n not in weight_map]
        if extra:
            raise FormatError("index-mismatch", f"shards hold {len(extra)} tensor(s) the index does not list, "
                              f"e.g. {extra[:3]}", path=paths[ck.names[extra[0]][0]])
    return ck


Names = None | str | Iterable[str] | Callable[[str], bool]


def select(ck: Checkpoint, names: Names) -> list[str]:
    """Resolve a ``names`` argument to tensor names: None = all in file order, a glob string,
    a predicate (both in file order), or a list of exact names (in the caller's order)."""
    if names is None:
        return ck.file_order()
    if isinstance(names, str):
        return [n for n in ck.file_order() if fnmatch.fnmatchcase(n, names)]
    if callable(names):
        return [n for n in ck.file_order() if names(n)]
    out = list(names)
    missing = [n for n in out if n not in ck.names]
    if missing:
        raise KeyError(f"no tensor(s) named {missing[:10]} in {ck.paths[0] if len(ck.paths) == 1 else 'the checkpoint'}")
    if len(set(out)) != len(out):
        raise ValueError("names lists a tensor more than once")
    return out
