"""torch module state: safetensors' shared-tensor rules (``find_shared_tensors``,
``remove_duplicate_names``, ``check_savable``), and ``tensor_places``, every slot a tensor sits in,
so that replacing it keeps tied tensors tied and parameters parameters.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any, Iterable, Mapping

import torch

from ..cuda.devices import parse_device
from ..errors import MetaTensorError, SparseTensorError

SHARED_TENSORS_DOC = "https://huggingface.co/docs/safetensors/torch_shared_tensors"


class MaterializeWarning(UserWarning):
    """``materialize`` allocated tensors that the state dict does not fill (non-persistent buffers)."""


def storage_ptr(tensor: torch.Tensor) -> int:
    """Address of the storage under ``tensor`` (0 where there is none: meta)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return 0


def storage_size(tensor: torch.Tensor) -> int:
    """Bytes of the storage under ``tensor`` (for a tensor without one: its own bytes)."""
    try:
        return tensor.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):
        return tensor.nelement() * tensor.element_size()


def end_ptr(tensor: torch.Tensor) -> int:
    """One past the last byte ``tensor`` reaches: its last element's address plus its size (for
    any strides, where safetensors' own needs a tensor it can flatten)."""
    if not tensor.nelement():
        return tensor.data_ptr()
    last = sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr() + (last + 1) * tensor.element_size()


def is_complete(tensor: torch.Tensor) -> bool:
    """``tensor`` starts where its storage starts and covers all of it."""
    return (tensor.data_ptr() == storage_ptr(tensor)
            and tensor.nelement() * tensor.element_size() == storage_size(tensor))


def _split_disjoint(names: set[str], state_dict: Mapping[str, torch.Tensor]) -> list[set[str]]:
    """One storage's names, split into groups whose byte ranges overlap (by start address)."""
    areas = sorted((state_dict[n].data_ptr(), end_ptr(state_dict[n]), n) for n in names)
    _, last_stop, first = areas[0]
    groups = [{first}]
    for start, stop, name in areas[1:]:
        if start >= last_stop:
            groups.append({name})
        else:
            groups[-1].add(name)
        last_stop = stop
    return groups


def find_shared_tensors(state_dict: Mapping[str, torch.Tensor]) -> list[set[str]]:
    """Every name with storage, grouped with the names whose bytes it overlaps (a group of one
    when none); meta tensors and empty storages are in no group. Groups come in state-dict order."""
    by_storage: dict[tuple, set[str]] = defaultdict(set)
    for name, t in state_dict.items():
        if t.device.type != "meta" and storage_ptr(t) != 0 and storage_size(t) != 0:
            by_storage[(t.device, storage_ptr(t), storage_size(t))].add(name)
    groups: list[set[str]] = []
    for names in by_storage.values():
        groups += [names] if len(names) < 2 else _split_disjoint(names, state_dict)
    return groups


def remove_duplicate_names(state_dict: Mapping[str, torch.Tensor], *, preferred_names: Iterable[str] | None = None,
                           discard_names: Iterable[str] | None = None) -> dict[str, list[str]]:
    """``{kept name: [the other names of its group]}`` for each group of ``find_shared_tensors``
    that has others: the name kept covers its whole storage, the first in sorted order, unless
    another complete one is in ``preferred_names`` (the names a file holds) or the first is in
    ``discard_names``. A group where no name covers the whole storage, a tensor alone in its group
    included, is a RuntimeError: saving it could store far more than its tensors."""
    preferred = set(preferred_names or ())
    discard = set(discard_names or ())
    out: dict[str, list[str]] = defaultdict(list)
    for group in find_shared_tensors(state_dict):
        complete = {n for n in group if is_complete(state_dict[n])}
        if not complete:
            raise RuntimeError(
                "Error while trying to find names to remove to save state dict, but found no suitable name to keep"
                f" for saving amongst: {group}. None is covering the entire storage.Refusing to save/load the model"
                f" since you could be storing much more memory than needed. Please refer to {SHARED_TENSORS_DOC}"
                " for more information. Or open an issue.")
        keep = sorted(complete - discard or complete)[0]
        if preferred & complete:
            keep = sorted(preferred & complete)[0]
        for name in sorted(group):
            if name != keep:
                out[keep].append(name)
    return out


def shared_aliases(state: Mapping[str, torch.Tensor], preferred_names=()) -> dict[str, list[str]]:
    """``remove_duplicate_names`` as a plain dict: ``{kept name: [dropped aliases]}``."""
    return dict(remove_duplicate_names(state, preferred_names=preferred_names))


def check_savable(tensors: Any) -> None:
    """What ``safetensors.torch.save_file`` refuses, refused up front with its exception types and
    in its order: not a dict, or a value not a tensor (ValueError); a name not a str (TypeError
    naming it); sparse tensors (ValueError); tensors sharing memory (RuntimeError: ``save_model``
    saves those); meta tensors (NotImplementedError, a RuntimeError). Non-contiguous tensors are
    saved, where safetensors refuses them."""
    if not isinstance(tensors, Mapping):
        raise ValueError(f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"Key `{name}` is invalid, expected torch.Tensor but received {type(t)}")
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r} of type {type(name).__name__}")
    sparse = [name for name, t in tensors.items() if t.layout != torch.strided]
    if sparse:
        raise SparseTensorError(sparse)
    shared = [group for group in find_shared_tensors(tensors) if len(group) > 1]
    if shared:
        raise RuntimeError(f"Some tensors share memory, this will lead to duplicate memory on disk and potential "
                           f"differences when loading them again: {shared}. A potential way to correctly save your "
                           f"model is to use `save_model`. More information at {SHARED_TENSORS_DOC}")
    meta = [name for name, t in tensors.items() if t.device.type == "meta"]
    if meta:
        raise MetaTensorError(meta)


def tensor_places(model: torch.nn.Module) -> dict[int, tuple[torch.Tensor, list[tuple[torch.nn.Module, str, str]]]]:
    """``{id(t): (t, [(module, key, name), ...])}`` for each parameter and buffer ``t``: every slot
    that holds it (tied tensors sit in several), so that replacing it keeps ties tied."""
    places: dict[int, tuple[torch.Tensor, list]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        owned = (*mod.named_parameters(recurse=False, remove_duplicate=False),
                 *mod.named_buffers(recurse=False, remove_duplicate=False))
        for key, t in owned:
            if t is not None:
                places.setdefault(id(t), (t, []))[1].append((mod, key, f"{mod_name}.{key}" if mod_name else key))
    return places


def put(old: torch.Tensor, slots: list[tuple[torch.nn.Module, str, str]], data: torch.Tensor) -> list[str]:
    """Put ``data`` in every slot of ``old`` (a parameter stays a parameter); returns the names."""
    new = torch.nn.Parameter(data, requires_grad=old.requires_grad) if isinstance(old, torch.nn.Parameter) else data
    for module, key, _ in slots:
        setattr(module, key, new)
    return [name for _, _, name in slots]


def swap_tensors(model: torch.nn.Module, new_data) -> list[str]:
    """Put ``new_data(t)`` (None: keep ``t``) in place of each parameter and buffer ``t`` wherever
    it sits, ties and parameters kept; returns the names replaced, aliases included."""
    done: list[str] = []
    for old, slots in tensor_places(model).values():
        data = new_data(old)
        if data is not None:
            done += put(old, slots, data)
    return done


def materialize(model: torch.nn.Module, device: str | int | torch.device = "cpu") -> list[str]:
    """``model.to_empty(device=...)`` for the meta tensors only, keeping tied tensors tied (``to_empty``
    would untie shared weights and wipe real ones): uninitialised storage on ``device``. Returns the
    materialised names the state dict lacks (non-persistent buffers such as ``inv_freq``), which no load
    fills and the caller must initialise (a MaterializeWarning lists them too).
    """
    dev = torch.device(str(parse_device(device)))
    done = swap_tensors(model, lambda t: torch.empty_like(t, device=dev) if t.is_meta else None)
    persistent = set(model.state_dict().keys())
    unfilled = sorted({n for n in done if n not in persistent})
    if unfilled:
        warnings.warn(MaterializeWarning(
            f"materialize: {len(unfilled)} tensor(s) are not in the state dict, so no load will fill them; "
            f"initialise them yourself: {unfilled[:10]}"), stacklevel=2)
    return unfilled
