"""torch module state: which tensors share memory, and putting new tensors into a module.

The shared-tensor rules are safetensors' own (``shared_aliases``: one name kept per shared
storage, the alphabetically first one covering the whole storage). ``tensor_places`` finds every
slot a parameter or buffer sits in, so that replacing it (``put``, ``swap_tensors``,
``materialize``) keeps tied tensors tied and parameters parameters.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Mapping

import torch

from ..cuda.devices import parse_device


class MaterializeWarning(UserWarning):
    """``materialize`` allocated tensors that the state dict does not fill (non-persistent buffers)."""



def storage_key(t: torch.Tensor):
    """(device, storage address, storage bytes): equal for tensors viewing the same storage."""
    try:
        s = t.untyped_storage()
        return t.device, s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):
        return None


def is_complete(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its whole storage (a tensor that does can be saved for all its views)."""
    s = t.untyped_storage()
    return t.data_ptr() == s.data_ptr() and t.numel() * t.element_size() == s.nbytes()


def shared_groups(state: Mapping[str, torch.Tensor]) -> list[set[str]]:
    """Names whose tensors overlap in memory, grouped (safetensors' ``_find_shared_tensors``)."""
    by_storage: dict = defaultdict(set)
    for name, t in state.items():
        if t.device.type == "meta":
            continue
        key = storage_key(t)
        if key is None or key[1] == 0 or key[2] == 0:
            continue
        by_storage[key].add(name)
    groups: list[set[str]] = []
    for names in sorted(by_storage.values()):
        if len(names) < 2:
            groups.append(names)
            continue
        areas = sorted((state[n].data_ptr(), state[n].data_ptr() + state[n].numel() * state[n].element_size(), n)
                       for n in names)
        _, last_stop, first = areas[0]
        groups.append({first})
        for start, stop, name in areas[1:]:
            if start >= last_stop:
                groups.append({name})
            else:
                groups[-1].add(name)
            last_stop = stop
    return groups


def shared_aliases(state: Mapping[str, torch.Tensor], preferred_names=()) -> dict[str, list[str]]:
    """``{kept name: [dropped aliases]}`` for tensors sharing memory, chosen as safetensors does:
    the alphabetically first name covering the whole storage, preferring ``preferred_names``."""
    preferred = set(preferred_names)
    out: dict[str, list[str]] = {}
    for group in shared_groups(state):
        if len(group) < 2:
            continue
        complete = {n for n in group if is_complete(state[n])}
        if not complete:
            raise RuntimeError(f"tensors {sorted(group)} share memory but none of them covers the whole storage; "
                               "refusing to save (it could store much more than needed)")
        keep = sorted(complete)[0]
        if preferred & complete:
            keep = sorted(preferred & complete)[0]
        out[keep] = [n for n in sorted(group) if n != keep]
    return out


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
    """Put ``new_data(t)`` in place of each parameter and buffer ``t`` it gives data for (None:
    keep ``t``), wherever ``t`` sits, so tied tensors stay one tensor and parameters stay
    parameters. Returns the names replaced, aliases included."""
    done: list[str] = []
    for old, slots in tensor_places(model).values():
        data = new_data(old)
        if data is not None:
            done += put(old, slots, data)
    return done


def materialize(model: torch.nn.Module, device: str | int | torch.device = "cpu") -> list[str]:
    """``model.to_empty(device=...)`` for the meta tensors only, keeping tied tensors tied.

    Every parameter and buffer on the meta device gets uninitialised storage on ``device``
    (``to_empty`` alone would untie shared weights, and would also wipe tensors that are already
    real). Returns the names of the materialised tensors that the state dict does not hold
    (non-persistent buffers such as rotary ``inv_freq``), which no load fills: the caller must
    initialise those (a MaterializeWarning lists them too).
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
