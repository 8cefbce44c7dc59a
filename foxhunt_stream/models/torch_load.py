"""``load_model``'s machinery: the weights land in the module's own tensors (``load_into``), or a
background load's tensors are handed over, with ``StreamedLoad`` before the load is done.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from typing import Mapping

import torch

from .. import api
from ..engine.frameworks import TorchFramework
from ..engine.handle import LoadHandle
from ..engine.loader import load_into, reopen_if_replaced
from ..errors import StoreMismatchError
from ..format.dtypes import host_shape
from ..io.checkpoint import open_checkpoint
from . import torch_state
from .torch_state import put, shared_aliases, tensor_places

log = logging.getLogger("foxhunt_stream")


class LoadModelError(StoreMismatchError, RuntimeError):
    """load_model found missing/unexpected names (strict) or tensors that cannot be filled: a
    RuntimeError like the reference's, and a StoreMismatchError with its lists."""

    def __init__(self, model_name: str, problems: list[str], missing=(), unexpected=()) -> None:
        super().__init__(problems, missing=missing, unexpected=unexpected)
        msg = f"Error(s) in loading state_dict for {model_name}:"
        if self.missing:
            msg += "\n    Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(self.missing))
        if self.unexpected:
            msg += "\n    Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(self.unexpected))
        other = [p for p in self.problems if not p.endswith(("missing from the checkpoint",
                                                             "in the checkpoint but not in the store"))]
        if other:
            msg += "\n    " + "\n    ".join(other)
        self.args = (msg,)


def _match_names(model: torch.nn.Module, state: Mapping[str, torch.Tensor], file_names: list[str],
                 aliases: Mapping[str, list[str]], strict: bool) -> tuple[dict, set[str], list[str]]:
    """The model's tensors a file of ``file_names`` fills (one name per tied group) and the
    reference's ``(missing, unexpected)``; with ``strict`` either raises LoadModelError."""
    dropped = {n for names in aliases.values() for n in names}
    store = {n: t for n, t in state.items() if n not in dropped}
    in_file = set(file_names)
    missing = {n for n in store if n not in in_file}
    unexpected = [n for n in file_names if n not in store]
    if strict and (missing or unexpected):
        raise LoadModelError(type(model).__name__, [], missing=sorted(missing), unexpected=unexpected)
    return store, missing, unexpected


@reopen_if_replaced   # a file replaced under us: start over from the new headers
def load_model(model: torch.nn.Module, filename: str | os.PathLike | LoadHandle, strict: bool = True,
               device: str | int | torch.device | None = "cpu", *, materialize: bool = False,
               wait: bool = True, **options) -> tuple[set[str], list[str]] | StreamedLoad:
    """``safetensors.torch.load_model``: fill ``model``'s parameters and buffers from a checkpoint.

    Returns ``(missing, unexpected)`` like the reference: names of the model the file does not
    fill, names of the file the model does not take (tied aliases count as neither). With
    ``strict``, either raises LoadModelError (a RuntimeError) before any byte is read. A shape
    mismatch is always an error.

    The weights land in the module's own tensors, wherever they are (``device`` does not move
    them, as in the reference). A module built on the meta device needs storage first:
    ``model.to_empty(device=...)`` or ``materialize=True`` (on ``device``, ties kept). ``source``
    may also be a list, an index.json or a directory; options as for ``load_into``.

    ``source`` may also be the handle of a load already running (``load_file(...,
    background=True)``, started before the model existed): the model's meta tensors then take the
    loaded tensors (as ``load_state_dict(assign=True)``, ties kept, another dtype cast), tensors
    with storage are copied into. ``wait=False`` returns a ``StreamedLoad`` at once instead.
    """
    if isinstance(filename, LoadHandle):
        if options or materialize:
            raise TypeError("load_model(model, handle): the load is already running; pass its options "
                            f"to load_file(..., background=True), not here ({sorted(options) or 'materialize'})")
        return _load_from_handle(model, filename, strict, wait)
    if not wait:
        raise TypeError("load_model(..., wait=False) needs the handle of a running load: "
                        "load_model(model, load_file(..., device=..., background=True), wait=False)")
    state = model.state_dict(keep_vars=True)
    on_meta = [n for n, t in state.items() if t.is_meta]
    if on_meta:
        if not materialize:
            raise ValueError(f"load_model: {len(on_meta)} tensor(s) of the model are on the meta device "
                             f"(e.g. {on_meta[:3]}); pass materialize=True (and device=...) or call "
                             "model.to_empty(device=...) first")
        torch_state.materialize(model, "cpu" if device is None else device)
        state = model.state_dict(keep_vars=True)

    ck = open_checkpoint(filename)
    file_names = ck.file_order()
    store, missing, unexpected = _match_names(model, state, file_names,
                                              shared_aliases(state, preferred_names=file_names), strict)
    model_name = type(model).__name__

    owned = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    fw = TorchFramework()
    in_place: dict[str, torch.Tensor] = {}
    indirect: list[str] = []
    problems: list[str] = []
    for n in file_names:
        t = store.get(n)
        if t is None:
            continue
        info = ck.names[n][1]
        if tuple(t.shape) != host_shape(info.dtype, info.shape) and tuple(t.shape) != tuple(info.shape):
            problems.append(f"{n}: shape {list(t.shape)} in the model, {list(info.shape)} in the file")
        elif (id(t) in owned and t.dtype == fw.torch_dtype(info.dtype) and t.is_contiguous()
              and t.device.type in ("cpu", "cuda")):
            in_place[n] = t
        elif info.dtype.sub_byte:
            problems.append(f"{n}: {info.dtype.name} in the file cannot be cast to {t.dtype}")
        else:
            indirect.append(n)
    if problems:
        raise LoadModelError(model_name, problems, missing=sorted(missing), unexpected=unexpected)

    _wait_torch_streams(in_place.values())
    try:
        load_into(in_place, ck, strict=True, names=list(in_place), **options)
    except StoreMismatchError as e:
        raise LoadModelError(model_name, e.problems, missing=sorted(missing), unexpected=unexpected) from e
    if indirect:
        _load_indirect(model, ck, {n: store[n] for n in indirect}, options)
    return missing, unexpected


def _tied_names(state: Mapping[str, torch.Tensor], preferred_names) -> dict[str, list[str]]:
    """``{kept name: [aliases]}``: storage shared as ``shared_aliases`` finds it, and on the meta
    device (no storage to compare) the same tensor object under several names."""
    aliases = shared_aliases(state, preferred_names=preferred_names)
    by_object: dict[int, list[str]] = defaultdict(list)
    for name, t in state.items():
        if t.is_meta:
            by_object[id(t)].append(name)
    preferred = set(preferred_names)
    for names in by_object.values():
        if len(names) > 1:
            keep = sorted(set(names) & preferred or names)[0]
            aliases[keep] = sorted(n for n in names if n != keep)
    return aliases


def _match_handle(model: torch.nn.Module, handle, strict: bool) -> tuple[dict, set[str], list[str]]:
    """``_match_names`` for a running load, with the shapes checked from its headers: every
    refusal comes before the model changes and before any wait."""
    state = model.state_dict(keep_vars=True)
    file_names = handle.names
    store, missing, unexpected = _match_names(model, state, file_names, _tied_names(state, file_names), strict)
    problems = []
    for n, shape in handle.shapes.items():
        t = store.get(n)
        if t is not None and tuple(t.shape) != shape:
            problems.append(f"{n}: shape {list(t.shape)} in the model, {list(shape)} in the file")
    if problems:
        raise LoadModelError(type(model).__name__, problems, missing=sorted(missing), unexpected=unexpected)
    return store, missing, unexpected


def _hand_over(old: torch.Tensor, slots, loaded: torch.Tensor) -> None:
    """One loaded tensor into the model: a meta tensor takes it (cast), real storage is filled."""
    with torch.inference_mode(False), torch.no_grad():   # a forward's inference_mode must not leak in
        if old.is_meta:
            put(old, slots, loaded if loaded.dtype == old.dtype else loaded.to(old.dtype))
        else:
            old.copy_(loaded)


def _load_from_handle(model: torch.nn.Module, handle, strict: bool, wait: bool):
    """``load_model`` from a running background load: wait for it and hand its tensors over, or
    (``wait=False``) leave each module to take its own as it first runs (``StreamedLoad``)."""
    store, missing, unexpected = _match_handle(model, handle, strict)
    if not wait:
        return StreamedLoad(model, handle, store, missing, unexpected)
    loaded = handle.result()   # a worker's error surfaces here
    places = tensor_places(model)
    for n, t in loaded.items():
        old = store.get(n)
        if old is not None:
            _hand_over(old, places[id(old)][1], t)
    return missing, unexpected


class StreamedLoad:
    """``load_model(model, handle, wait=False)``: the model runs before its weights have landed.

    Each module owning tensors of the file gets a forward pre-hook that waits for just those, hands them
    over as ``load_model`` does and removes itself; ``wait()`` hands over the rest. A load error is
    raised by the forward needing the failed tensor, and by ``wait()``.
    """

    def __init__(self, model: torch.nn.Module, handle, store: dict, missing: set[str], unexpected: list[str]) -> None:
        self.missing, self.unexpected = missing, unexpected
        self._handle = handle
        places = tensor_places(model)
        name_of = {id(t): n for n, t in store.items()}
        self._pending: dict[int, tuple[str, torch.Tensor, list]] = {
            i: (name_of[i], old, slots) for i, (old, slots) in places.items() if i in name_of}
        self._hooks = []
        for mod in model.modules():
            mine = [id(t) for t in (*mod.parameters(recurse=False), *mod.buffers(recurse=False))
                    if t is not None and id(t) in self._pending]
            if mine:
                self._hooks.append(self._before(mod, mine))
        if not self._pending:
            self._finish()

    def _before(self, mod: torch.nn.Module, ids: list[int]):
        """Register the pre-hook that fills ``mod``'s own tensors and then removes itself."""
        def hook(module, args):
            self._take(ids)
            handle.remove()   # filled: later calls run without a hook
        handle = mod.register_forward_pre_hook(hook)
        return handle

    def _take(self, ids) -> None:
        for i in ids:
            entry = self._pending.get(i)
            if entry is None:
                continue
            name, old, slots = entry
            _hand_over(old, slots, self._handle.wait(name))   # blocks on this tensor alone
            self._pending.pop(i, None)   # (another thread's forward may have handed it over meanwhile)
        if not self._pending:
            self._finish()

    def _finish(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._handle.result()   # closes the files; every tensor has landed

    def done(self) -> bool:
        """Every tensor of the file the model takes is in place."""
        return not self._pending

    def wait(self) -> tuple[set[str], list[str]]:
        """Hand over everything still pending; returns ``(missing, unexpected)`` as load_model."""
        self._take(list(self._pending))   # ends with _finish(): nothing is pending now
        return self.missing, self.unexpected


def _wait_torch_streams(tensors) -> None:
    """Let torch finish what it queued on the destinations: the loader writes on its own streams."""
    for index in {t.device.index or 0 for t in tensors if t.device.type == "cuda"}:
        torch.cuda.current_stream(index).synchronize()


def _load_indirect(model: torch.nn.Module, ck, targets: dict[str, torch.Tensor], options) -> None:
    """Tensors that cannot take the bytes in place: load a temporary next to each and let
    ``load_state_dict`` cast/copy it in (and run any custom ``_load_from_state_dict``)."""
    by_device: dict[str, list[str]] = defaultdict(list)
    for n, t in targets.items():
        by_device[str(t.device) if t.device.type in ("cpu", "cuda") else "cpu"].append(n)
    log.debug("load_model: %d tensor(s) through a temporary (dtype, layout or device)", len(targets))
    for dev, names in by_device.items():
        tmp = api.load_file(ck, device=dev, framework="pt", names=names, **options)
        model.load_state_dict(tmp, strict=False)
