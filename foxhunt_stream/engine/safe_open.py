"""``safe_open``: lazy, random access to a checkpoint, a drop-in for ``safetensors.safe_open``.

The handle reads every header once and keeps the files open; ``get_tensor``, ``get_slice(...)[i]``
and ``tensors()`` each run a load of just what they ask for (``loader``), so unasked bytes are
never read.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from .. import settings as _settings
from ..format.header import TensorInfo
from ..format.tp import TPSlice, indices_for
from ..io.checkpoint import Names, open_checkpoint, select
from .destinations import Destinations
from .inflight import LoadInFlight
from .loader import close_all, open_sources, plan_selections, reopen_if_replaced, selections
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


class safe_open:
    """Drop-in for ``safetensors.safe_open``: lazy, random access to one checkpoint.

    ``with safe_open(path, framework="pt", device="cuda:0") as f: f.get_tensor(name)``.
    Arrays returned stay valid after the handle is closed. With ``verify=True`` whole tensors are
    checked against their saved digests (a slice cannot be, and is refused).
    """

    @reopen_if_replaced
    def __init__(self, filename, framework: str | None = None, device="cpu", *, verify: bool = False,
                 **options) -> None:
        self._verify = verify
        self._s = _settings.merge(**options)
        self._dev, self._fw = placement(device, framework).for_names(())
        self._ck = open_checkpoint(filename)
        self._sources = open_sources(self._ck, self._s)

    # -- lifecycle
    def __enter__(self) -> "safe_open":
        self._check()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._sources is not None:
            close_all(self._sources)
            self._sources = None

    def _check(self):
        if self._sources is None:
            raise ValueError("operation on a closed safe_open handle")

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
        self._check()
        if name not in self._ck.names:
            raise KeyError(f"no tensor named {name!r}")
        return SliceView(self._ck.names[name][1], lambda index: self._load([name], {name: index})[0])

    def get_tensor(self, name: str):
        self._check()
        if name not in self._ck.names:
            raise KeyError(f"no tensor named {name!r}")
        return self._load([name])[0]

    def _start(self, names: list[str], indices=None, progress: bool | None = False, per_dest: bool = False):
        self._check()
        plan, s, verifier = plan_selections(self._ck, selections(self._ck, names, indices), self._s, self._verify,
                                            self._dev)
        return LoadInFlight(plan, self._sources, Destinations.allocate(self._fw, plan, self._dev), s, check=verifier,
                            progress=progress_bar(plan.nbytes, "load", progress), per_dest=per_dest)

    def _load(self, names: list[str], indices=None) -> list:
        load = self._start(names, indices)
        load.finish()
        return load.dests.all_arrays()

    def tensors(self, names: Names = None, *, shard: TPSlice | None = None,
                progress: bool | None = None) -> Iterator[tuple[str, Any]]:
        """Yield ``(name, array)`` as each tensor lands (file order, or the order of a list);
        with ``shard``, each array is this rank's slice; ``progress`` as in load_file."""
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
                load.cancel()   # the rest is dropped, the hashing streams drained, memory released
                try:
                    load.finish()
                except BaseException:
                    pass
