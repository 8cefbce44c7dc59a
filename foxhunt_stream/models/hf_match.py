"""Which checkpoint tensor fills which tensor of a transformers model, from the headers, by
transformers' own rules (``convert_and_load_state_dict_in_model``: weight renamings, the
``base_model_prefix``; unexpected, missing, mismatched). A name that needs a weight *converter*
(fused or split tensors) is Unservable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, build_glob_alternation, rename_source_key
from transformers.utils.loading_report import LoadStateDictInfo

from .hf_source import Unservable


@dataclass
class KeyPlan:
    """``targets``: checkpoint name -> model key; ``dtypes``: model key -> the dtype it is loaded in;
    ``info``: transformers' missing / unexpected / mismatched record; ``conversions``: the weight
    transforms that matched (kept on the model, as transformers does, for ``save_pretrained``)."""
    targets: dict[str, str]
    dtypes: dict[str, torch.dtype]
    info: LoadStateDictInfo
    conversions: list


def match(model, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype, key_mapping=None) -> KeyPlan:
    """The plan for a checkpoint of ``shapes`` (name -> shape, every name of the checkpoint)."""
    meta_state = model.state_dict()
    mapping = get_model_conversion_mapping(model, key_mapping, None)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    prefix = model.base_model_prefix
    info = LoadStateDictInfo(missing_keys=set(meta_state), unexpected_keys=set(), mismatched_keys=set(),
                             error_msgs=[], conversion_errors={}, skipped_pp_keys=set())
    targets: dict[str, str] = {}
    taken: set[str] = set()
    for name, shape in shapes.items():
        key, pattern = rename_source_key(name, renamings, converters, prefix, meta_state)
        if key not in meta_state and name in meta_state:   # renamed away from a name the model has
            key, pattern = rename_source_key(name, [], [], base_model_prefix=prefix, meta_state_dict=meta_state)
        if pattern is not None:
            raise Unservable(f"{name} needs transformers' weight conversion {pattern!r}")
        if key.endswith("_extra_state"):
            raise Unservable(f"{name} is a module's extra state")
        if key not in meta_state:
            info.unexpected_keys.add(key)
            continue
        if key in taken:
            raise Unservable(f"two checkpoint tensors are renamed to {key}")
        taken.add(key)
        info.missing_keys.discard(key)
        expected = meta_state[key].shape
        if torch.Size(shape) != expected:
            info.mismatched_keys.add((key, torch.Size(shape), expected))
            continue
        targets[name] = key
    dtypes = load_dtypes(model, meta_state, targets.values(), dtype)
    return KeyPlan(targets, dtypes, info, [m for m in mapping if m.was_used()])


def load_dtypes(model, meta_state: Mapping[str, torch.Tensor], keys, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype transformers loads each key in: the model tensor's own, or float32 where the
    model keeps modules in float32 (``_keep_in_fp32_modules`` for float16, ``..._strict`` also
    for bfloat16)."""
    plan = model._get_dtype_plan(dtype)
    out = {key: meta_state[key].dtype for key in keys}
    if plan:
        pattern, group_to_glob, _ = build_glob_alternation(list(plan))
        for key in out:
            found = pattern.search(key)
            if found is not None:
                out[key] = plan[group_to_glob[found.lastgroup]]
    return out
