"""The public front door of a load: ``fs.load_file``, handed to the engine in this process or,
with ``process_group``, to ``distributed``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from .engine.handle import LoadHandle
    from .format.tp import TPSlice
    from .io.checkpoint import Names


def load_file(source, device: Any = "cpu", framework: str | None = None, names: Names = None, *,
              background: bool = False, shard: TPSlice | None = None, verify: bool = False,
              progress: bool | None = None, process_group=None, device_map: Mapping[str, Any] | None = None,
              **options) -> dict[str, Any] | LoadHandle:
    """Load the selected tensors of a checkpoint; returns ``{name: array}``.

    ``source`` is a file, a list of files, an index.json or a directory; unselected bytes are
    never read. ``background=True`` returns a ``LoadHandle`` at once. With
    ``shard=TPSlice(rank, world_size, dim)`` each array is this rank's slice of the tensor.
    ``verify=True`` checks every tensor against the digests saved with it as its chunks land
    (ChecksumError, nothing returned). ``progress``: a bar on stderr (None: on a terminal, past
    about a second). With ``process_group`` (every rank calls this; framework "pt") the checkpoint
    is read once across the group and shared by broadcasts (``exchange_bytes=`` bounds their
    memory). With ``device_map={name or prefix: device}`` instead of ``device``, each tensor lands
    on the device of the longest key that is its name or a prefix ending at a ``.`` (``""``: the
    default).
    """
    if process_group is None:
        from .collector import paused
        with paused():   # a first call's imports: no collection (see collector)
            where = _placed_and_pinning(device, framework, device_map, background, options)
            from .engine.loader import load_file as load_here
        return load_here(source, where, framework, names, background=background, shard=shard, verify=verify,
                         progress=progress, **options)
    if device_map is not None:
        raise ValueError("load_file: device_map and process_group are not supported together")
    from .distributed.load import load_file_distributed   # imports torch.distributed: only when asked
    return load_file_distributed(source, device, framework, names, process_group=process_group,
                                 background=background, shard=shard, verify=verify, progress=progress, **options)


def _placed_and_pinning(device, framework, device_map, background: bool, options: dict):
    """The load's checked placement, its GPU's pinned staging started before the rest of the
    loader is imported: a process's first load pins beside its imports, not after them."""
    from . import settings
    from .engine.placement import placement
    from .engine.staging import start_pinning
    where = placement(device, framework, device_map)
    if where.device is not None:
        start_pinning(where.device, settings.merge(background=background, **options))
    return where
