"""Where a Hugging Face checkpoint is, and whether the streamed ``from_pretrained`` can serve it
(``Unservable``). No torch, no transformers: the load can start before either is imported.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from ..format.shards import INDEX_NAME, SINGLE_NAME

SAFETENSORS_FILE = SINGLE_NAME
SAFETENSORS_INDEX = INDEX_NAME
CONFIG_FILE = "config.json"
ADAPTER_FILE = "adapter_config.json"

# Keywords of transformers' from_pretrained that only its own loading implements.
TRANSFORMERS_ONLY = frozenset({
    "state_dict", "device_map", "max_memory", "offload_folder", "offload_buffers", "quantization_config",
    "subfolder", "variant", "gguf_file", "adapter_kwargs", "adapter_name", "distributed_config", "device_mesh",
    "tp_plan", "tp_size", "use_kernels", "kernel_config", "allow_all_kernels", "fusion_config",
})
# Keywords transformers accepts and no longer uses (it drops them; so does this path).
IGNORED = frozenset({"mirror", "_fast_init", "low_cpu_mem_usage", "from_tf", "from_flax", "offload_state_dict",
                     "weights_only", "disable_mmap", "tqdm_class", "_from_pipeline", "_from_auto", "_commit_hash"})
# config.json entries that need transformers' own loading.
CONFIG_ONLY = ("quantization_config", "transformers_weights", "fusion_config")


class Unservable(Exception):
    """This call needs transformers' own ``from_pretrained``; the message says why."""


@dataclass(frozen=True)
class CheckpointSource:
    """A local checkpoint as ``from_pretrained`` sees it."""
    directory: str     # config.json and generation_config.json live here
    weights: str       # what the loader reads: model.safetensors, the index, or the file given
    shown: str         # the name transformers records (config.name_or_path, the load report's "from:")

    def is_whole_directory(self) -> bool:
        """Whether ``weights`` is what transformers itself would load from ``directory``."""
        return os.path.abspath(self.weights) == os.path.abspath(directory_weights(self.directory) or "")


def directory_weights(directory: str) -> str | None:
    """The weights transformers loads from a local directory: the single file, else the index,
    by the rule every load of a directory follows (``io.checkpoint.directory_weights``)."""
    from ..io.checkpoint import directory_weights as rule   # the header parser's imports wait for the load
    return rule(directory)


def resolve(path: str | os.PathLike) -> CheckpointSource:
    """A directory (as transformers reads it), a ``.safetensors`` file or an index (the config is
    the one beside it). Anything else -- a hub name, a ``.bin``-only directory -- is Unservable."""
    p = os.fspath(path)
    if os.path.isdir(p):
        weights = directory_weights(p)
        if weights is None:
            raise Unservable(f"{p} holds neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX}")
        return CheckpointSource(p, weights, p)
    if os.path.isfile(p) and p.endswith((".safetensors", ".json")):
        directory = os.path.dirname(os.path.abspath(p))
        return CheckpointSource(directory, p, directory)
    raise Unservable(f"{p!r} is not a local directory, .safetensors file or safetensors index")


def config_obstacle(config: Mapping[str, Any], auto_class_name: str | None) -> str | None:
    """What in ``config.json`` needs transformers' own loading, or None. ``auto_class_name``: the
    Auto class asked for (its entry in ``auto_map`` means code shipped with the checkpoint)."""
    for key in CONFIG_ONLY:
        if config.get(key):
            return f"config.json sets {key}" + (" (a quantized checkpoint)" if key == "quantization_config" else "")
    auto_map = config.get("auto_map")
    if auto_class_name and isinstance(auto_map, dict) and {auto_class_name, "AutoConfig"} & set(auto_map):
        return f"the checkpoint brings its own code (auto_map: {sorted(auto_map)})"
    return None


def read_config(directory: str) -> dict:
    """``config.json`` as plain JSON (transformers reads it again, properly, later)."""
    path = os.path.join(directory, CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise Unservable(f"{path} does not exist") from None
    except (OSError, ValueError) as e:
        raise Unservable(f"{path} cannot be read ({e})") from None
    if not isinstance(config, dict):
        raise Unservable(f"{path} is not a JSON object")
    return config


def keyword_obstacle(kwargs: Mapping[str, Any]) -> str | None:
    """Which keyword arguments need transformers' own loading, or None."""
    only = sorted(k for k in kwargs if k in TRANSFORMERS_ONLY)
    if only:
        return f"{', '.join(only)} {'is' if len(only) == 1 else 'are'} implemented by transformers' own loading"
    if kwargs.get("use_safetensors") is False:
        return "use_safetensors=False"
    config = kwargs.get("config")
    if config is not None and isinstance(config, (str, os.PathLike)):
        return "config is given as a path"
    return None


def device_obstacle(device: Any) -> str | None:
    """The streamed load writes to the CPU or to one CUDA device."""
    kind = str(device).split(":", 1)[0] if not isinstance(device, int) else "cuda"
    if kind not in ("cpu", "cuda"):
        return f"device={device!r} (the streamed load writes to 'cpu' or 'cuda:N')"
    return None


def plan(path: str | os.PathLike, device: Any, auto_class_name: str | None,
         kwargs: Mapping[str, Any]) -> tuple[CheckpointSource | None, str | None]:
    """The checkpoint (None if not a local one) and the first thing this path cannot serve."""
    try:
        source = resolve(path)
    except Unservable as e:
        return None, str(e)
    reason = keyword_obstacle(kwargs) or device_obstacle(device)
    if reason is None and os.path.isfile(os.path.join(source.directory, ADAPTER_FILE)):
        reason = f"{source.directory} holds an adapter ({ADAPTER_FILE})"
    if reason is None:
        try:
            reason = config_obstacle(read_config(source.directory), auto_class_name)
        except Unservable as e:
            reason = str(e)
    return source, reason
