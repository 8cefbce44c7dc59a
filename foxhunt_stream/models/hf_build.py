"""The model on the meta device, built as transformers' ``from_pretrained`` builds it (config, class,
dtype, ``get_init_context``; ties not yet made), each step by transformers' own functions.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import transformers
from transformers.monkey_patching import patch_output_recorders
from transformers.utils import ContextManagers

from .hf_source import IGNORED, CheckpointSource, Unservable

HUB_KEYWORDS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "proxies")
# What the streamed path uses of transformers (a release lacking one is served by its own from_pretrained).
MODEL_METHODS = ("get_init_context", "get_expanded_tied_weights_keys", "mark_tied_weights_as_initialized", "named_non_persistent_buffers",
                 "initialize_weights", "tie_weights", "_adjust_missing_and_unexpected_keys", "_get_dtype_plan",
                 "get_parameter_or_buffer", "set_use_kernels")


@dataclass
class Recipe:
    """What ``from_pretrained``'s keywords come to, once the config has taken its own."""
    config: Any
    model_class: type
    model_kwargs: dict
    hub: dict
    auto: bool
    generation_kwargs: dict
    trust_remote_code: bool | None = None
    dtype: torch.dtype | None = None
    options: dict = field(default_factory=dict)   # ignore_mismatched_sizes, output_loading_info, ...


def missing_api() -> str | None:
    """The first transformers function this path needs and the installed release lacks, or None."""
    from transformers import PreTrainedModel
    for name in MODEL_METHODS:
        if not hasattr(PreTrainedModel, name):
            return f"transformers {transformers.__version__} has no PreTrainedModel.{name}"
    for module, name in (("core_model_loading", "rename_source_key"), ("core_model_loading", "build_glob_alternation"),
                         ("conversion_mapping", "get_model_conversion_mapping"),
                         ("utils.loading_report", "log_state_dict_report"),
                         ("utils.loading_report", "LoadStateDictInfo"), ("initialization", "no_tie_weights")):
        try:
            mod = __import__(f"transformers.{module}", fromlist=[name])
        except ImportError:
            return f"transformers {transformers.__version__} has no module transformers.{module}"
        if not hasattr(mod, name):
            return f"transformers {transformers.__version__} has no transformers.{module}.{name}"
    from transformers.integrations import is_deepspeed_zero3_enabled, is_fsdp_enabled
    if is_deepspeed_zero3_enabled():
        return "DeepSpeed ZeRO-3 is enabled"
    if is_fsdp_enabled():
        return "FSDP is enabled"
    return None


def is_auto_class(model_class) -> bool:
    """transformers' Auto classes (AutoModel, AutoModelForCausalLM...) choose the class from the config."""
    return getattr(model_class, "_model_mapping", None) is not None


def recipe(model_class, source: CheckpointSource, kwargs: dict) -> Recipe:
    """The config and the concrete class, as ``model_class.from_pretrained(source.directory,
    **kwargs)`` finds them; the keywords the config does not take go to the model's __init__."""
    kwargs = {k: v for k, v in kwargs.items() if k not in IGNORED}
    options = {k: kwargs.pop(k) for k in ("ignore_mismatched_sizes", "output_loading_info", "generation_config",
                                          "key_mapping") if k in kwargs}
    torch_dtype = kwargs.pop("torch_dtype", None)
    dtype = kwargs.pop("dtype", None)
    options["dtype"] = dtype if dtype is not None else torch_dtype
    implementations = {k: kwargs.pop(k) for k in ("attn_implementation", "experts_implementation") if k in kwargs}
    hub = {k: kwargs.pop(k) for k in HUB_KEYWORDS if k in kwargs}
    trust = kwargs.pop("trust_remote_code", None)
    kwargs.pop("use_safetensors", None)
    code_revision = kwargs.pop("code_revision", None)
    config = kwargs.pop("config", None)
    if config is not None:
        config = copy.deepcopy(config)   # transformers never changes the caller's config
    auto = is_auto_class(model_class)
    if auto:
        if config is None:
            config, kwargs = transformers.AutoConfig.from_pretrained(
                source.directory, return_unused_kwargs=True, trust_remote_code=trust, code_revision=code_revision,
                **hub, **kwargs)
        cls, config = concrete_class(model_class, config)
        model_kwargs = generation_kwargs = kwargs
    else:
        cls = model_class
        if config is None:
            config, model_kwargs = cls.config_class.from_pretrained(source.directory, return_unused_kwargs=True,
                                                                    **hub, **kwargs)
        else:
            model_kwargs = kwargs
        generation_kwargs = kwargs
    for key, value in implementations.items():
        setattr(config, "_" + key, value)
    return Recipe(config, cls, dict(model_kwargs), hub, auto, dict(generation_kwargs), trust, options=options)


def concrete_class(model_class, config):
    """The class an Auto class builds for ``config`` (``config.architectures`` picks among
    several), and the config it takes (the text sub-config, for a text-only class of a
    multimodal checkpoint) -- what the Auto classes' ``from_pretrained`` does."""
    mapping = model_class._model_mapping
    if type(config) not in mapping:
        raise ValueError(f"Unrecognized configuration class {config.__class__} for this kind of AutoModel: "
                         f"{model_class.__name__}.\nModel type should be one of "
                         f"{', '.join(c.__name__ for c in mapping)}.")
    cls = mapping[type(config)]
    if isinstance(cls, (list, tuple)):
        by_name = {c.__name__: c for c in cls}
        cls = next((by_name[a] for a in (getattr(config, "architectures", None) or []) if a in by_name), cls[0])
    text_config_class = config.sub_configs.get("text_config", None)
    if text_config_class is not None and getattr(cls, "config_class", None) == text_config_class:
        parent = config
        config = config.get_text_config()
        if getattr(parent, "quantization_config", None) is not None:
            config.quantization_config = parent.quantization_config
    return cls, config


def resolve_dtype(dtype, config, checkpoint_dtype: Callable[[], torch.dtype | str]) -> torch.dtype:
    """transformers' dtype rule: a dtype or its name as given; ``None``/``"auto"`` (its default):
    the config's, else ``checkpoint_dtype()`` (read from the checkpoint only then). Written back
    to the config and its sub-configs."""
    if isinstance(dtype, dict):
        raise Unservable("a dtype per sub-model")
    if isinstance(dtype, str) and dtype != "auto":
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError("`dtype` provided as a `str` can only be `'auto'`, or a string representation of "
                             "a valid `torch.dtype`")
        dtype = getattr(torch, dtype)
    elif dtype is None or dtype == "auto":
        dtype = config.dtype if getattr(config, "dtype", None) is not None else checkpoint_dtype()
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    elif not isinstance(dtype, torch.dtype):
        raise ValueError(f"`dtype` can be one of: `torch.dtype`, `'auto'` or a string of a valid `torch.dtype`, "
                         f"but received {dtype}")
    config.dtype = dtype
    for key in config.sub_configs:
        sub = getattr(config, key, None)
        if sub is not None:
            sub.dtype = dtype
    return dtype


def first_floating(dtypes: list[torch.dtype]) -> torch.dtype:
    """The first floating dtype a model can be built in (not float8/float4), else the first, else float32."""
    for d in dtypes:
        if d.is_floating_point and "float8_" not in str(d) and "float4_" not in str(d):
            return d
    return dtypes[0] if dtypes else torch.float32


def build_on_meta(r: Recipe, dtype: torch.dtype, name_or_path: str):
    """``cls(config)`` under transformers' own init contexts: meta device, ``dtype``, no tying."""
    r.config.name_or_path = name_or_path
    with ContextManagers(r.model_class.get_init_context(dtype, False, False, False)):
        model = r.model_class(r.config, **r.model_kwargs)
        patch_output_recorders(model)
    return model

