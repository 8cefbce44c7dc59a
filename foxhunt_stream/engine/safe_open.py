"""``safe_open``: lazy, random access to a checkpoint, a drop-in for ``safetensors.safe_open``.

Every header is read once and the files kept open; each access loads just what it asks for. Slices
outlive the handle, and a close during a load keeps the files open until it ends (``SharedSources``).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Iterator

from .. import settings as _settings
from ..errors import HandleClosedError, TensorNotFoundError
from ..format.header import TensorInfo
from ..format.tp import TPSlice, indices_for
from ..io import fileobj
from ..io.checkpoint import Names, open_checkpoint, select
from ..io.read_policy import read_policies
from .destinations import Destinations
from .inflight import LoadInFlight
from .loader import close_all, open_sources, prepare, reopen_if_replaced, selections
from .staging import start_pinning
from .placement import placement
from .progress import progress_bar


class SliceView:
    """``f.get_slice(name)``: shape and dtype without reading; ``[index]`` lands only those elements."""

    def __init__(self, info: TensorInfo, load: Callable[[Any], Any]) -> None:
        self._info = info
        self._load = load   # index -> the array of just those elements

    def get_shape(self) -> list[int]:
        return list(self._info.shape)

    def get_dtype(self) -> str:
        return self._info.dtype.name

    @property
    def shape(self):
        return tuple(self._info.shape)

    def __getitem__(self, index):
        if index is None:   # numpy's newaxis, not "no index" (which the planner reads as the whole tensor)
            index = (None,)
        return self._load(index)


class SharedSources:
    """A handle's open sources, shared with its slices and running loads, closed after the last."""

    def __init__(self, sources: list) -> None:
        self.sources = sources
        self._users = 1   # the handle
        self._lock = threading.Lock()

    def share_with(self, owner: object) -> None:
        """One more user, for as long as ``owner`` lives."""
        self.begin()
        weakref.finalize(owner, self.release)

    def begin(self) -> list:
        """One more user (a load about to read), or the closed-handle error if none is left."""
        with self._lock:
            if self._users == 0:
                raise HandleClosedError("File is closed")
            self._users += 1
        return self.sources

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last:
            close_all(self.sources)


class safe_open:
    """Drop-in for ``safetensors.safe_open``: lazy, random access to one checkpoint.

    ``with safe_open(path, framework="pt", device="cuda:0") as f: f.get_tensor(name)``.
    ``filename`` may also be a list of files, an index.json, a directory, an open file object or
    a ``memoryview``/``bytearray``. Arrays and slices stay valid after the handle is closed.
    ``verify=True`` checks whole tensors against their saved digests (a slice is refused).
    """

    @reopen_if_replaced
    def __init__(self, filename, framework: str | None = None, device="cpu", *, verify: bool = False,
                 **options) -> None:
        self._verify = verify
        self._s = _settings.merge(**options)
        self._dev, self._fw = placement(device, framework).for_names(())
        start_pinning(self._dev, self._s)
        opened = fileobj.open_object(filename) if fileobj.is_object_source(filename) else filename
        if isinstance(opened, tuple):   # a buffer, or a file object without a descriptor
            self._ck, sources = opened
            self._policies = []
        else:
            self._ck = open_checkpoint(opened)
            # how each file is read is decided once, here: every later plan of this handle is cut for it
            sizes = [h.file_size for h in self._ck.headers]
            self._policies = read_policies(self._ck.paths, sizes, range(len(sizes)), sizes, self._s, streams=False)
            sources = open_sources(self._ck, self._policies)
        self._shared: SharedSources | None = SharedSources(sources)
        self._release = weakref.finalize(self, self._shared.release)   # once: at close(), or when dropped

    # -- lifecycle
    def __enter__(self) -> "safe_open":
        self._check()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._release()
        self._shared = None

    @property
    def _sources(self) -> list | None:
        """The open sources, None once closed (what tests inspect: backends, bytes read)."""
        return None if self._shared is None else self._shared.sources

    def _check(self) -> SharedSources:
        if self._shared is None:
            raise HandleClosedError("File is closed")
        return self._shared

    def _named(self, name: str) -> str:
        self._check()
        if name not in self._ck.names:
            raise TensorNotFoundError(f"File does not contain tensor {name}")
        return name

    # -- header
    def keys(self) -> list[str]:
        self._check()
        return sorted(self._ck.names)

    def offset_keys(self) -> list[str]:
        self._check()
        return self._ck.file_order()

    def metadata(self) -> dict[str, str] | None:
        self._check()
        return self._ck.metadata()

    def get_slice(self, name: str) -> SliceView:
        shared = self._check()
        view = SliceView(self._ck.names[self._named(name)][1],
                         lambda index: self._load([name], {name: index}, shared)[0])
        shared.share_with(view)   # the files stay open for the slice after the handle closes
        return view

    def get_tensor(self, name: str):
        return self._load([self._named(name)])[0]

    def get_tensors(self) -> dict[str, Any]:
        """Every tensor, ``{name: array}`` in file order, landed by one load."""
        names = self._ck.file_order()
        return dict(zip(names, self._load(names)))

    def _start(self, names: list[str], indices=None, progress: bool | None = False, per_dest: bool = False,
               shared: SharedSources | None = None) -> LoadInFlight:
        """A load of ``names`` (``indices``: slices), holding the open files until it is over."""
        shared = shared or self._check()
        sources = shared.begin()
        try:
            sels = selections(self._ck, names, indices)
            plan, s, _, verifier = prepare(self._ck, sels, self._s, self._dev, verify=self._verify,
                                           policies=self._policies)
            return LoadInFlight(plan, sources, Destinations.allocate(self._fw, plan, self._dev), s, check=verifier,
                                progress=progress_bar(plan.nbytes, "load", progress), per_dest=per_dest,
                                on_end=shared.release)
        except BaseException:
            shared.release()
            raise

    def _load(self, names: list[str], indices=None, shared: SharedSources | None = None) -> list:
        load = self._start(names, indices, shared=shared)
        load.finish()
        return load.dests.all_arrays()

    def tensors(self, names: Names = None, *, shard: TPSlice | None = None,
                progress: bool | None = None) -> Iterator[tuple[str, Any]]:
        """Yield ``(name, array)`` as each tensor lands (file order, or a list's); ``shard``: slices."""
        chosen = select(self._ck, names)
        load = self._start(chosen, indices_for(self._ck, chosen, shard), progress, per_dest=True)
        finished = False
        try:
            for d, name in enumerate(chosen):
                load.wait_dest(d)
                yield name, load.dests.array(d)
            load.finish()
            finished = True
        finally:
            if not finished:   # stopped early, or a tensor failed its check after the reads were done:
                load.abandon()   # the rest is dropped, the hashing streams drained, memory released


class safe_open_handle(safe_open):
    """``safetensors._safe_open_handle``: ``safe_open`` of an open file object ``f``."""

    def __init__(self, f, framework: str | None = None, device="cpu", **options) -> None:
        super().__init__(f, framework, device, **options)
