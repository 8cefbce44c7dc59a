"""Checkpoints: resolve a source (file, list, index.json, directory) into files and headers.

A directory is read by transformers' rule: ``model.safetensors`` if it is a file there, else
``model.safetensors.index.json``, else every ``*.safetensors`` entry (regular files only) in
name order. What it takes, and an index's files, must lie in the directory (or a hub snapshot's
``blobs/``). An index and its shards' headers are read under the directory's shared lock
(``dirlock``), which a sharded save's commit holds exclusively.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import stat
from typing import Callable, Iterable, NamedTuple, Sequence

from ..errors import FormatError
from ..format.header import MAX_HEADER_SIZE, N_LEN, Header, TensorInfo, parse_header, read_header_len
from ..format.shards import INDEX_NAME, PER_FILE_KEYS, SAVE_KEY, SINGLE_NAME
from . import dirlock
from .source import file_identity


def read_header(path: str | os.PathLike) -> Header:
    """Read and validate the header of one file; FormatError names the file."""
    return read_header_with_identity(path)[0]


def read_header_with_identity(path: str | os.PathLike) -> tuple[Header, tuple]:
    """The header and the identity of the file it was read from (see ``source.file_identity``)."""
    path = os.fspath(path)
    with open(path, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        size = st.st_size
        prefix = _read_exact(f, 0, min(N_LEN + 1, size))   # the length, and the header's first byte
        try:
            n = read_header_len(prefix, size)
            body = _read_exact(f, N_LEN, min(n, MAX_HEADER_SIZE))
            return parse_header(prefix[:N_LEN] + body, size), file_identity(st)
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


class Checkpoint(NamedTuple):
    """The files of a checkpoint, their headers, and one name map across them (a NamedTuple, not
    a dataclass: every first load imports it, and a dataclass takes several times longer to make)."""
    paths: list[str]
    headers: list[Header]
    names: dict[str, tuple[int, TensorInfo]]   # name -> (file index, its entry)
    index_metadata: dict | None = None
    index_path: str | None = None
    identities: Sequence[tuple] = ()   # per file, as its header was read (none: a file object)

    def metadata(self) -> dict[str, str] | None:
        """One flat ``dict[str, str]`` (or None when nothing has any), the shape every caller expects.

        A single file: its header's metadata as is. Several files: every shard's metadata and
        the index's ``"metadata"`` object merged (non-string index values as JSON text), without
        ``format.shards.PER_FILE_KEYS``; a key given two different values is a FormatError naming
        the key and both files. Per-file metadata: ``read_header(path).metadata``.
        """
        if len(self.paths) == 1 and self.index_metadata is None:
            return self.headers[0].metadata
        merged: dict[str, str] = {}
        where: dict[str, str] = {}
        sources = [(p, h.metadata or {}) for p, h in zip(self.paths, self.headers)]
        index_meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in (self.index_metadata or {}).items()}
        sources.append((self.index_path or "the index", index_meta))
        for path, meta in sources:
            for k, v in meta.items():
                if k in PER_FILE_KEYS:   # which save wrote the file, its digests: not the model's metadata
                    continue
                if k in merged and merged[k] != v:
                    raise FormatError("metadata-conflict",
                                      f"metadata key {k!r} is {merged[k]!r} in {where[k]} but {v!r} in {path}",
                                      path=path)
                merged.setdefault(k, v)
                where.setdefault(k, path)
        return merged or None

    def file_order(self) -> list[str]:
        """Every tensor name in file order: the files in their order, each file's tensors by offset."""
        return [t.name for h in self.headers for t in h.tensors]


class Resolved(NamedTuple):
    paths: list[str]
    weight_map: dict[str, str] | None      # tensor name -> full path of its shard
    index_metadata: dict | None
    index_path: str | None = None
    index_identity: tuple | None = None    # file_identity of the index, taken before it was read
    directory: str | None = None           # the directory whose rule chose the files, if one did


def resolve(source) -> Resolved:
    """The files of any accepted source; with an index, its weight_map and metadata too (an index
    and a directory read under the directory's shared lock)."""
    if isinstance(source, (list, tuple)):
        if not source:
            raise ValueError("empty list of checkpoint files")
        paths = [os.fspath(p) for p in source]
        real = [os.path.realpath(p) for p in paths]
        twice = [p for i, p in enumerate(paths) if real[i] in real[:i]]
        if twice:
            raise ValueError(f"the list of checkpoint files names {twice[0]} more than once")
        return Resolved(paths, None, None)
    path = os.fspath(source)
    if os.path.isdir(path):
        with dirlock.locked(path, shared=True):
            return _in_directory(path)
    if path.endswith(".json"):
        with dirlock.locked(os.path.dirname(os.path.abspath(path)), shared=True):
            return _index(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"No such file or directory: {path}")   # safetensors' words
    return Resolved([path], None, None)


def directory_weights(directory: str | os.PathLike) -> str | None:
    """What the directory rule loads from ``directory`` when it is one file (``model.safetensors``,
    else the index), or None; a file that resolves outside it is a FormatError ``path-escape``."""
    directory = os.fspath(directory)
    for name in (SINGLE_NAME, INDEX_NAME):
        full = os.path.join(directory, name)
        if os.path.isfile(full):
            _confine(full, _allowed_roots(os.path.abspath(directory)))
            return full
    return None


def _in_directory(path: str) -> Resolved:
    chosen = directory_weights(path)
    if chosen is not None and chosen.endswith(".json"):
        return _index(chosen)._replace(directory=path)
    if chosen is not None:
        return Resolved([chosen], None, None, directory=path)
    roots = _allowed_roots(os.path.abspath(path))
    files = []
    for name in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        full = os.path.join(path, name)
        _confine(full, roots)
        try:
            st = os.stat(full)
        except FileNotFoundError:
            raise FileNotFoundError(f"No such file or directory: {full}") from None
        if not stat.S_ISREG(st.st_mode):
            raise FormatError("not-a-regular-file", f"{name} in the checkpoint directory is not a regular file "
                              f"({_kind(st.st_mode)}); a directory load reads only regular *.safetensors files",
                              path=full)
        files.append(full)
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files and no {INDEX_NAME}")
    return Resolved(files, None, None, directory=path)


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "another kind of file"


def _confine(full: str, roots: list[str]) -> None:
    """``full`` must really lie under one of ``roots`` (``_allowed_roots``), symlinks resolved."""
    real = os.path.realpath(full)
    if not any(os.path.commonpath([real, r]) == r for r in roots):
        raise FormatError("path-escape", f"{os.path.basename(full)} resolves outside the checkpoint directory "
                          f"(to {real})", path=full)


def _index(index_path: str) -> Resolved:
    """``_from_index`` with the index's identity, taken before it is read."""
    try:
        identity = file_identity(os.stat(index_path))
    except OSError:
        identity = None
    return _from_index(index_path)._replace(index_identity=identity)


def _allowed_roots(base: str) -> list[str]:
    """Where the index's shards may really live: the index's own directory and, for a hub cache
    snapshot (``<repo>/snapshots/<rev>/``), that repository's ``blobs/``."""
    roots = [os.path.realpath(base)]
    parent = os.path.dirname(base)
    if os.path.basename(parent) == "snapshots":
        blobs = os.path.join(os.path.dirname(parent), "blobs")
        if os.path.isdir(blobs):
            roots.append(os.path.realpath(blobs))
    return roots


def _check_shard_name(index_path: str, name: str, fname) -> None:
    """A weight_map value must be a file name the OS can take (non-empty, encodable, no NUL)."""
    if not isinstance(fname, str) or not fname:
        raise FormatError("index-weight-map", f"weight_map[{name!r}] must be a file name", path=index_path,
                          tensor=name)
    try:
        ok = b"\0" not in os.fsencode(fname)
    except UnicodeError:
        ok = False
    if not ok:
        raise FormatError("index-weight-map", f"weight_map[{name!r}] = {fname!r} is not a file name (a NUL byte or "
                          "a character no path can hold)", path=index_path, tensor=name)


def _from_index(index_path: str) -> Resolved:
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
    if not obj["weight_map"]:
        raise FormatError("index-weight-map", "the weight_map maps no tensor: an index names each tensor's shard",
                          path=index_path)
    base = os.path.dirname(os.path.abspath(index_path))
    roots = _allowed_roots(base)
    files: list[str] = []
    seen: dict[str, str] = {}
    checked: dict[str, str] = {}   # file name as written -> its path (a few files, many names)
    for name, fname in obj["weight_map"].items():
        if isinstance(fname, str) and fname in checked:
            continue
        _check_shard_name(index_path, name, fname)
        if os.path.isabs(fname) or ".." in fname.replace("\\", "/").split("/"):
            raise FormatError("index-path-escape", f"weight_map[{name!r}] = {fname!r} leaves the checkpoint directory",
                              path=index_path, tensor=name)
        full = os.path.normpath(os.path.join(base, fname))
        if full not in seen:
            real = os.path.realpath(full)
            if not any(os.path.commonpath([real, r]) == r for r in roots):
                raise FormatError("index-path-escape",
                                  f"weight_map[{name!r}] = {fname!r} resolves outside the checkpoint directory",
                                  path=index_path, tensor=name)
            if not os.path.isfile(full):
                raise FormatError("index-missing-file", f"weight_map[{name!r}] names {fname!r}, which does not exist",
                                  path=index_path, tensor=name)
            seen[full] = full
            files.append(full)
        checked[fname] = full
    meta = obj.get("metadata")
    weight_map = {k: checked[v] for k, v in obj["weight_map"].items()}
    files.sort()   # file order is file-name order (model-00001-of-N first), not the index's name order
    return Resolved(files, weight_map, meta if isinstance(meta, dict) else None, index_path)


def open_checkpoint(source) -> Checkpoint:
    """Resolve ``source``, read every header, and build one name map across the files (with an
    index, the index and the headers must agree exactly)."""
    if isinstance(source, Checkpoint):   # already open (callers that inspect names first)
        return source
    return open_resolved(resolve(source))


def open_resolved(resolved: Resolved) -> Checkpoint:
    """``open_checkpoint`` of a source already resolved, its headers read under the directory's
    shared lock (resolved again if its index was replaced; a file gone: ``file-replaced``)."""
    where = resolved.directory or (os.path.dirname(os.path.abspath(resolved.index_path))
                                   if resolved.index_path is not None else None)
    with dirlock.locked(where, shared=True) if where is not None else contextlib.nullcontext():
        if resolved.index_path is not None and _changed(resolved.index_path, resolved.index_identity):
            resolved = _in_directory(resolved.directory) if resolved.directory else _index(resolved.index_path)
        read = []
        for p in resolved.paths:
            try:
                read.append(read_header_with_identity(p))
            except FileNotFoundError:
                if where is None:
                    raise
                raise FormatError("file-replaced", "was removed after the checkpoint's files were listed (a "
                                  "concurrent save replaced the checkpoint)", path=p) from None
    return assemble(resolved, read)


def assemble(resolved: Resolved, read: list[tuple[Header, tuple]]) -> Checkpoint:
    """The checkpoint of ``resolved``'s files from their headers and identities, checked across
    files: one save's files, no tensor in two shards, an index that agrees with the headers."""
    paths, weight_map, index_meta, index_path = (resolved.paths, resolved.weight_map, resolved.index_metadata,
                                                 resolved.index_path)
    headers = [h for h, _ in read]
    ck = Checkpoint(paths, headers, {}, index_metadata=index_meta, index_path=index_path,
                    identities=[i for _, i in read])
    if weight_map is not None and index_meta is not None and SAVE_KEY in index_meta:
        _one_save(resolved, read)
    names = ck.names
    for i, h in enumerate(headers):
        if names.keys() & h.by_name.keys():   # a file's own names are unique (its header's keys)
            t = next(t for t in h.tensors if t.name in names)
            raise FormatError("duplicate-across-shards",
                              f"tensor appears in both {paths[names[t.name][0]]} and {paths[i]}", tensor=t.name)
        names.update({t[0]: (i, t) for t in h.tensors})   # t[0]: its name
    if weight_map is not None:
        for name, full in weight_map.items():
            where = ck.names.get(name)
            if where is None or paths[where[0]] != full:
                actually = "no shard holds it" if where is None else f"it is in {paths[where[0]]}"
                raise FormatError("index-mismatch", f"index maps it to {os.path.basename(full)} but that shard's "
                                  f"header does not hold it ({actually})", path=full, tensor=name)
        extra = [n for n in ck.names if n not in weight_map]
        if extra:
            raise FormatError("index-mismatch", f"shards hold {len(extra)} tensor(s) the index does not list, "
                              f"e.g. {extra[:3]}", path=paths[ck.names[extra[0]][0]])
    return ck


def _one_save(resolved: Resolved, read: list[tuple[Header, tuple]]) -> None:
    """Every shard carries the index's save id (``format.shards.SAVE_KEY``); else ``file-replaced``
    when a file changed since it was read (a concurrent save), or ``mixed-saves``."""
    save = resolved.index_metadata.get(SAVE_KEY)
    for path, (header, _) in zip(resolved.paths, read):
        theirs = (header.metadata or {}).get(SAVE_KEY)
        if theirs == save:
            continue
        with dirlock.locked(os.path.dirname(os.path.abspath(resolved.index_path)), shared=True):
            changed = _changed_since(resolved, read)
        if changed:
            raise FormatError("file-replaced", "the checkpoint changed while its files were read (a concurrent "
                              "save replaced it)", path=path)
        raise FormatError("mixed-saves", f"written by save {theirs!r}, but {os.path.basename(resolved.index_path)} "
                          f"by save {save!r}: the directory holds files of two saves", path=path)


def _changed_since(resolved: Resolved, read: list[tuple[Header, tuple]]) -> bool:
    """Whether the index or a shard is not the file it was when read (replaced, removed)."""
    return any(_changed(path, identity) for path, identity in [(resolved.index_path, resolved.index_identity)]
               + [(p, i) for p, (_, i) in zip(resolved.paths, read)])


def _changed(path: str, identity: tuple | None) -> bool:
    """Whether ``path`` is no longer the file of ``identity`` (False when that is unknown)."""
    if identity is None:
        return False
    try:
        return file_identity(os.stat(path)) != identity
    except OSError:
        return True


Names = None | str | Iterable[str] | Callable[[str], bool]


def select(ck: Checkpoint, names: Names) -> list[str]:
    """Resolve a ``names`` argument to tensor names: None = all in file order, a glob string,
    a predicate (both in file order), or a list of exact names (in the caller's order). A glob or
    predicate that selects nothing, or a listed name the checkpoint lacks, is a KeyError."""
    if names is None:
        return ck.file_order()
    if isinstance(names, str):
        out = [n for n in ck.file_order() if fnmatch.fnmatchcase(n, names)]
        if not out:
            raise KeyError(f"names={names!r} matches no tensor of {_where(ck)}{_examples(ck)}")
        return out
    if callable(names):
        out = [n for n in ck.file_order() if names(n)]
        if not out and ck.names:
            raise KeyError(f"names={names!r} selects no tensor of {_where(ck)}{_examples(ck)}")
        return out
    out = list(names)
    missing = [n for n in out if n not in ck.names]
    if missing:
        hint = ("; names lists exact names: for a pattern pass one string, such as 'model.layers.*'"
                if any(any(c in n for c in "*?[") for n in missing if isinstance(n, str)) else "")
        raise KeyError(f"no tensor(s) named {missing[:10]} in {_where(ck)}{hint}")
    if len(set(out)) != len(out):
        raise ValueError("names lists a tensor more than once")
    return out


def _where(ck: Checkpoint) -> str:
    return ck.paths[0] if len(ck.paths) == 1 else f"the checkpoint ({len(ck.paths)} files)"


def _examples(ck: Checkpoint) -> str:
    order = ck.file_order()
    if not order:
        return " (it holds no tensor)"
    return f" (its {len(order)} tensor(s) are named like {order[:3]})"
