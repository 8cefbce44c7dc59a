"""transformers' ``from_pretrained`` with the bytes from a foxhunt_stream background load: the model is
built, matched, initialised and tied by transformers' own functions while the load runs (on CUDA
with the first forward's kernels loaded by a thread and a one-token ``warm_up`` forward meanwhile);
what this path cannot serve goes to transformers.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

import torch
import transformers
from transformers.utils.loading_report import log_state_dict_report

from ..cuda.devices import parse_device
from ..engine.frameworks import TorchFramework
from ..io.checkpoint import open_checkpoint
from .first_kernels import KernelWarmer
from .hf_build import Recipe, build_on_meta, first_floating, missing_api, recipe, resolve_dtype
from .hf_match import KeyPlan, match
from .hf_source import CheckpointSource, Unservable, directory_weights
from .torch_load import StreamedLoad

__all__ = ["Unservable", "finish", "load_with_transformers", "missing_api", "prepare", "warm_up"]

log = logging.getLogger("foxhunt_stream")
REPORT_LOGGER = "transformers.modeling_utils"   # the logger transformers' own load report goes to


def prepare(source: CheckpointSource, model_class, dtype, kwargs: dict) -> Recipe:
    """The config, the concrete class and the dtype, found before the load starts (Unservable:
    transformers' own from_pretrained takes it); finding the class imports the modeling code, seconds
    of pure Python that a load beside it would slow."""
    model_class = model_class or transformers.AutoModelForCausalLM
    if dtype is not None:
        kwargs = dict(kwargs, dtype=dtype)
    r = recipe(model_class, source, kwargs)
    r.dtype = resolve_dtype(r.options["dtype"], r.config, lambda: checkpoint_dtype(source.weights))
    return r


def finish(source: CheckpointSource, r: Recipe, handle, device, model_class, dtype, kwargs: dict,
           warm_forward: bool | None):
    """The model from ``handle`` and ``r``, or (the load cancelled) transformers' own from_pretrained."""
    try:
        return streamed_model(source, r, handle, device, warm_forward)
    except Unservable as e:
        handle.cancel()
        return load_with_transformers(source.directory, device, model_class, dtype, kwargs, str(e), source)
    except BaseException:
        handle.cancel()
        raise


def streamed_model(source: CheckpointSource, r: Recipe, handle, device, warm_forward: bool | None):
    dtype = r.dtype
    dev = torch.device(str(parse_device(device)))
    warm = warm_forward if warm_forward is not None else dev.type == "cuda"
    kernels = None   # (on a GPU only: a CPU's first GEMM costs little)
    if warm and dev.type == "cuda" and isinstance(dtype, torch.dtype):
        kernels = KernelWarmer(handle.shapes, r.config, dtype, dev)
    model = build_on_meta(r, dtype, source.shown)
    plan = match(model, handle.shapes, dtype, r.options.get("key_mapping"))
    model._weight_conversions = plan.conversions   # as transformers keeps them, for save_pretrained
    pending = dict(plan.targets)
    for name in values_needed_to_tie(model, plan):   # tie_weights compares these two: load them first
        put(model, pending.pop(name), handle.wait(name), plan.dtypes)
    table = tensor_table(model)
    for key in pending.values():
        to_be_loaded(model, key, table[key], plan.dtypes[key])
    finalize(model, plan, dev, source.shown, r.options.get("ignore_mismatched_sizes", False))
    model.eval()
    load_generation_config(model, r, source)
    table = tensor_table(model)   # (tied now)
    streamed = StreamedLoad(model, handle, {name: table[key] for name, key in pending.items()}, set(), [])
    if warm:
        warm_up(model, dev)
    streamed.wait()   # every tensor in place; a load error is raised here
    if kernels is not None:
        kernels.join()
    table = tensor_table(model)
    for key in pending.values():
        mark_loaded(table[key])
    model.set_use_kernels(default_use_kernels(), None)   # kernelizing needs the weights on their device
    if r.options.get("output_loading_info", False):
        return model, plan.info.to_dict()
    return model


def checkpoint_dtype(weights: str) -> torch.dtype | str:
    """``dtype="auto"`` without a config dtype: the index's, else the first shard's first float's."""
    ck = open_checkpoint(weights)
    if ck.index_metadata and "dtype" in ck.index_metadata:
        return ck.index_metadata["dtype"]
    first = sorted(ck.paths)[0]
    fw = TorchFramework()
    return first_floating([fw.torch_dtype(info.dtype) for _, (i, info) in sorted(ck.names.items())
                           if ck.paths[i] == first])


def put(model, key: str, value: torch.Tensor, dtypes) -> None:
    """One loaded tensor into the model, as transformers' ``set_param_for_module`` puts it."""
    value = value.to(dtypes[key]) if value.dtype != dtypes[key] else value
    module_name, _, name = key.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if name not in module._buffers:
        value = torch.nn.Parameter(value, requires_grad=value.is_floating_point())
    mark_loaded(value)
    setattr(module, name, value)


def tensor_table(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, tied ones under each of their names."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def to_be_loaded(model, key: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """The meta tensor ``t`` the load will replace: in the dtype it is loaded in, flagged so that
    transformers' initialisation leaves it alone (as it leaves loaded tensors alone)."""
    if t.dtype != dtype:
        module_name, _, name = key.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        new = torch.empty_like(t, dtype=dtype)
        t = torch.nn.Parameter(new, requires_grad=t.requires_grad) if name in module._parameters else new
        setattr(module, name, t)
    t._is_hf_initialized = True


def mark_loaded(t: torch.Tensor) -> None:
    t._is_hf_initialized = True
    if isinstance(t, torch.nn.Parameter):
        t.requires_grad_(t.is_floating_point())


def values_needed_to_tie(model, plan: KeyPlan) -> list[str]:
    """Names of tied pairs the checkpoint holds both halves of: loaded before tying (values compared)."""
    by_key = {key: name for name, key in plan.targets.items()}
    out: list[str] = []
    for target, source in getattr(model, "all_tied_weights_keys", {}).items():
        if target in by_key and source in by_key:
            out += [n for n in (by_key[target], by_key[source]) if n not in out]
    return out


def finalize(model, plan: KeyPlan, device: torch.device, shown: str, ignore_mismatched_sizes: bool) -> None:
    """transformers' ``_finalize_model_loading``, the tensors still to land flagged as loaded: missing
    keys and non-persistent buffers get storage on ``device`` and the model's own ``_init_weights``,
    weights are tied and the load report logged (a shape mismatch raises here, before any wait)."""
    info = plan.info
    try:
        model.mark_tied_weights_as_initialized(info)
        for key in info.missing_and_mismatched() - model.all_tied_weights_keys.keys():
            empty(model, key, device)
        for key, _ in model.named_non_persistent_buffers():
            empty(model, key, device)
        model.initialize_weights()
        model.tie_weights(missing_keys=info.missing_keys, recompute_mapping=False)
        model._adjust_missing_and_unexpected_keys(info)
    finally:
        log_state_dict_report(model=model, pretrained_model_name_or_path=shown,
                              ignore_mismatched_sizes=ignore_mismatched_sizes, loading_info=info,
                              logger=logging.getLogger(REPORT_LOGGER))


def empty(model, key: str, device: torch.device) -> None:
    """Storage on ``device`` for a meta tensor (transformers' ``_move_missing_keys_from_meta_to_device``)."""
    t = model.get_parameter_or_buffer(key)
    module_name, _, name = key.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    value = torch.empty_like(t, device=device)
    if name in module._parameters:
        value = torch.nn.Parameter(value, requires_grad=value.is_floating_point())
    setattr(module, name, value)


def load_generation_config(model, r: Recipe, source: CheckpointSource) -> None:
    """``generation_config.json`` (else one from config.json), as transformers loads it."""
    if not (model.can_generate() and hasattr(model, "adjust_generation_fn")):
        return
    hub = r.hub
    model.adjust_generation_fn(r.options.get("generation_config"), r.auto, None, source.directory,
                               hub.get("cache_dir"), hub.get("force_download", False), hub.get("proxies"),
                               hub.get("local_files_only", False), hub.get("token"), hub.get("revision", "main"),
                               "", r.trust_remote_code, **r.generation_kwargs)


def warm_up(model, device: torch.device) -> None:
    """One token through the model while the weights land (each module's pre-hook waits for its
    own); what it changed on the modules is undone (``ModuleState``). A model whose forward wants
    other inputs is not warmed; a load error comes again from the wait that follows."""
    params = inspect.signature(model.forward).parameters
    if "input_ids" not in params:
        return
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    inputs: dict[str, Any] = {"input_ids": ids}
    if "attention_mask" in params:
        inputs["attention_mask"] = torch.ones_like(ids)
    if "use_cache" in params:
        inputs["use_cache"] = False
    state = ModuleState(model)
    try:
        with torch.no_grad():
            model(**inputs)
    except Exception as e:   # noqa: BLE001 -- an optimisation only
        log.debug("from_pretrained: the warm-up forward of %s failed: %r", type(model).__name__, e)
    finally:
        state.restore()


class ModuleState:
    """Every module's attributes and real buffers (their values too), so that what a forward
    changes on them can be put back. Parameters and the buffers still on meta (the load fills
    them) are left alone; hook tables are changed in place and so not restored."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.saved = []
        for m in model.modules():
            buffers = {k: (b, b.detach().clone()) for k, b in m._buffers.items() if b is not None and not b.is_meta}
            self.saved.append((m, dict(vars(m)), set(m._buffers), set(m._non_persistent_buffers_set), buffers))

    def restore(self) -> None:
        with torch.no_grad():
            for m, attrs, buffer_names, non_persistent, buffers in self.saved:
                for k in [k for k in vars(m) if k not in attrs]:
                    del m.__dict__[k]
                for k, v in attrs.items():
                    if m.__dict__.get(k) is not v:
                        m.__dict__[k] = v
                for k in [k for k in m._buffers if k not in buffer_names]:
                    del m._buffers[k]
                m._non_persistent_buffers_set.clear()
                m._non_persistent_buffers_set.update(non_persistent)
                for k, (b, value) in buffers.items():
                    m._buffers[k] = b
                    if not torch.equal(b, value):
                        b.copy_(value)


def load_with_transformers(path, device, model_class, dtype, kwargs: dict, reason: str,
                           source: CheckpointSource | None = None):
    """transformers' own ``model_class.from_pretrained(path, dtype=dtype, device_map=device)``."""
    if source is not None and not source.is_whole_directory():
        raise ValueError(f"{source.weights}: {reason}, and transformers' own from_pretrained reads the whole "
                         f"directory ({directory_weights(source.directory) or 'no safetensors weights'}), not this file")
    log.warning("fs.transformers.from_pretrained: %s; transformers' own from_pretrained loads it", reason)
    model_class = model_class or transformers.AutoModelForCausalLM
    kwargs = dict(kwargs)
    if dtype is not None:
        kwargs["dtype"] = dtype
    if "device_map" not in kwargs and str(device) != "cpu":
        kwargs["device_map"] = device
    return model_class.from_pretrained(os.fspath(path), **kwargs)


def default_use_kernels() -> bool:
    """transformers' default ``use_kernels``: from 5.25, on where hub kernels are enabled and
    installed; off in 5.17-5.24. (A call that passes it goes to transformers itself.)"""
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) < (5, 25):
        return False
    from transformers.integrations.hub_kernels import _kernels_enabled
    from transformers.utils import is_kernels_available
    return bool(_kernels_enabled() and is_kernels_available())
