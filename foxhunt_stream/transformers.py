"""transformers front end: ``from_pretrained``, one call from a checkpoint to a ready model.

    import foxhunt_stream as fs
    fs.prefetch("llama/")        # optional first statement: a cold start reads while the imports run
    import torch, transformers
    model = fs.transformers.from_pretrained("llama/", device="cuda:0")

The result is what ``model_class.from_pretrained(path, dtype=dtype, device_map=device)`` gives,
with the weights streamed by foxhunt_stream. Needs torch and transformers
(``pip install torch 'transformers>=5.17,<6'``, or the checkout's ``transformers`` extra).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .models import hf_source

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["from_pretrained"]


def from_pretrained(path: str | os.PathLike, device: Any = "cuda:0", model_class: type | None = None,
                    dtype: Any = None, *, warm_forward: bool | None = None,
                    **kwargs: Any) -> PreTrainedModel | tuple[PreTrainedModel, dict]:
    """A ready model from a local checkpoint, equal to transformers' own ``from_pretrained``.

    ``path``: a directory (its ``model.safetensors`` or ``model.safetensors.index.json``, as
    transformers reads it), a ``.safetensors`` file or an index; ``config.json`` and
    ``generation_config.json`` come from its directory. ``device``: ``"cpu"`` or ``"cuda:N"``.
    ``model_class``: ``transformers.AutoModelForCausalLM`` when None, or any Auto or model class.
    ``dtype``: transformers' default when None (the config's dtype, else the checkpoint's).
    Other keywords are transformers' own (``attn_implementation``, config overrides,
    ``ignore_mismatched_sizes``, ``output_loading_info`` -- then ``(model, info)``...).

    The load starts once transformers has read the config and imported the model's code; the
    model is built on the meta device and tied while it runs, and the call returns only when
    every tensor has landed. With ``warm_forward`` (default: on for CUDA) the first forward's
    one-time costs are paid during the load: a thread runs its GEMM shapes from the load's start,
    and a one-token forward runs while the weights stream in; what it changed on the modules is
    put back.

    Missing, unexpected and mismatched tensors are reported in transformers' load report. What
    this path cannot serve (quantized checkpoints, weight conversions, remote code, adapters,
    ``.bin`` weights, ``device_map``...) is loaded by transformers' own ``from_pretrained``, with a
    warning naming the reason.
    """
    auto_name = "AutoModelForCausalLM" if model_class is None else (
        model_class.__name__ if getattr(model_class, "_model_mapping", None) is not None else None)
    source, reason = hf_source.plan(path, device, auto_name, kwargs)
    hf = machinery()   # imports transformers (before the load: its readers would slow that import)
    reason = reason or hf.missing_api()
    if reason is not None:
        return hf.load_with_transformers(path if source is None else source.directory, device, model_class,
                                         dtype, kwargs, reason, source)
    try:   # the config and the class (their modeling code imported) first: see hf.prepare
        r = hf.prepare(source, model_class, dtype, kwargs)
    except hf.Unservable as e:
        return hf.load_with_transformers(source.directory, device, model_class, dtype, kwargs, str(e), source)
    from .torch import load_file
    handle = load_file(source.weights, device=device, background=True)   # the I/O starts now
    return hf.finish(source, r, handle, device, model_class, dtype, kwargs, warm_forward)


def machinery():
    """The transformers-dependent part, or an ImportError that says how to install it."""
    try:
        from .models import hf
    except ImportError as e:
        if (e.name or "").split(".")[0] not in ("transformers", "torch"):
            raise
        raise ImportError(f"fs.transformers needs {e.name.split('.')[0]}: "
                          "pip install torch 'transformers>=5.17,<6'") from e
    return hf
