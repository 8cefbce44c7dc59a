"""Placement: where a load's tensors land and as which arrays, checked once at the front door
(``placement``) before any file is opened, and handed down the load as a ``Placement``.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

from ..cuda.devices import CPU, Device, DeviceError, check_device, parse_device
from .frameworks import Framework, get_framework

DeviceMap = Mapping[str, Any]


def parse_device_map(device_map: DeviceMap) -> dict[str, Device]:
    """``{key: Device}``: every value parsed (a bad one raises DeviceError naming its key)."""
    if not isinstance(device_map, Mapping):
        raise TypeError(f"device_map must be a mapping {{name or prefix: device}}, not {type(device_map).__name__}")
    if not device_map:
        raise ValueError("device_map is empty; map tensor names or prefixes to devices ('' is the default)")
    out = {}
    for key, value in device_map.items():
        if not isinstance(key, str):
            raise TypeError(f"device_map keys are tensor names or prefixes (str), not {key!r}")
        try:
            out[key] = parse_device(value)
        except DeviceError as e:
            raise DeviceError(f"device_map[{key!r}]: {e}") from None
    return out


def device_for(name: str, parsed: Mapping[str, Device]) -> Device | None:
    """The device of the longest key that is ``name`` itself or a prefix of it ending at a ``.``
    (``"a.b"`` or ``"a.b."`` match ``"a.b.c"``, not ``"a.bc"``); ``""`` matches everything."""
    got = parsed.get(name)
    if got is not None:
        return got
    i = len(name)
    while (i := name.rfind(".", 0, i)) >= 0:
        for key in (name[:i + 1], name[:i]):   # longest first: "a.b." before "a.b"
            got = parsed.get(key)
            if got is not None:
                return got
    return parsed.get("")


def resolve_device_map(names: Sequence[str], device_map: DeviceMap) -> list[Device]:
    """One device per name (same order). Raises ValueError listing (up to 10) unmapped names."""
    parsed = parse_device_map(device_map)
    devices = [device_for(n, parsed) for n in names]
    unmapped = [n for n, d in zip(names, devices) if d is None]
    if unmapped:
        raise ValueError(f"device_map maps no device for {len(unmapped)} selected tensor(s), e.g. {unmapped[:10]}; "
                         "add their names or prefixes, or a '' key as the default")
    return devices


class Placement(NamedTuple):
    """Where a load's tensors land: one ``device`` for all, or a parsed ``device_map``; and the
    ``framework`` name asked for (None: numpy on the host, cupy on a GPU)."""
    device: Device | None
    device_map: Mapping[str, Device] | None = None
    framework: str | None = None

    def for_names(self, names: Sequence[str]) -> tuple[Device | list[Device], Framework]:
        """The device of the selected tensors (one, or one per name, checked) and their framework."""
        if self.device_map is None:
            return self.device, get_framework(self.framework, self.device)
        devices = resolve_device_map(names, self.device_map)
        fw = get_framework(self.framework, next((d for d in devices if d.is_cuda), CPU))   # first: torch's runtime
        for d in sorted(set(devices), key=str):
            check_device(d)
        return devices, fw


def placement(device: Any = "cpu", framework: str | None = None, device_map: DeviceMap | None = None) -> Placement:
    """Parse and check a load's placement arguments, before any file is opened."""
    if device_map is None:
        dev = parse_device(device)
        try:
            get_framework(framework, dev)   # an unknown or missing framework fails here; torch loads its CUDA runtime
        except Exception:
            check_device(dev)   # a GPU that cannot be used at all is what to say first
            raise
        check_device(dev)
        return Placement(dev, None, framework)
    if device is not None and not (isinstance(device, str) and device.strip().lower() == "cpu"):
        raise ValueError(f"load_file: pass either device ({device!r}) or device_map, not both")
    return Placement(None, parse_device_map(device_map), framework)
