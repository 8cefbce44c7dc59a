"""The loaders a benchmark compares: foxhunt_stream, safetensors, and the peer loaders that
happen to be installed (fastsafetensors, InstantTensor, the Run:ai model streamer).

Each is a ``Loader``: a name, a function that loads every tensor of the checkpoint onto the
device and returns them (synchronized: the bytes are there when it returns), and a note. What
is not installed is left out and named in ``missing``, with how to get it.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..cuda.devices import Device

SAFETENSORS_HINT = "pip install safetensors (or 'foxhunt-stream[test]')"
PEERS = ("fastsafetensors", "instanttensor", "instanttensor-buffered", "runai_model_streamer")


@dataclass
class Loader:
    name: str
    load: Callable[[], Any]
    note: str = ""


@dataclass
class Loaders:
    loaders: list[Loader] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)   # one line per comparison left out, with the fix


def optional(module: str):
    """The module, or None when it is absent or its install is broken (a missing shared library)."""
    try:
        return importlib.import_module(module)
    except Exception:
        return None


def torch_cuda(device: Device):
    """torch when it can reach ``device`` (a GPU); None on the CPU, so CPU runs never import it."""
    if not device.is_cuda:
        return None
    torch = optional("torch")
    return torch if torch is not None and torch.cuda.is_available() else None


def gpu_sync(device: Device) -> None:
    if device.is_cuda:
        import cupy
        cupy.cuda.Device(device.index).synchronize()


def foxhunt(source, device: Device, framework: str | None = None) -> Loader:
    import foxhunt_stream as fs

    def load():
        out = fs.load_file(source, device=str(device), framework=framework, progress=False)
        gpu_sync(device)
        return out
    return Loader("foxhunt_stream load_file", load)


def safetensors_loader(paths: Sequence[str], device: Device) -> Loader | str:
    """safetensors' own load_file (torch onto a GPU, numpy on the CPU), or why it is left out."""
    if optional("safetensors") is None:
        return f"safetensors is not installed: its comparison rows are left out ({SAFETENSORS_HINT})"
    dev = str(device)
    if device.is_cuda:
        torch = torch_cuda(device)
        stt = optional("safetensors.torch")
        if torch is None or stt is None:
            return "safetensors onto a GPU needs torch with CUDA: its comparison rows are left out (pip install torch)"

        def load_torch():
            out = {}
            for p in paths:
                out.update(stt.load_file(p, device=dev))
            torch.cuda.synchronize(device.index)
            return out
        return Loader(f"safetensors.torch load_file ({dev})", load_torch)
    stn = optional("safetensors.numpy")

    def load_numpy():
        out = {}
        for p in paths:
            out.update(stn.load_file(p))
        return out
    return Loader("safetensors.numpy load_file", load_numpy)


def peer_loader(name: str, paths: Sequence[str], device: Device) -> Loader | str:
    """One of ``PEERS`` (each hands out torch tensors), or why it cannot run here."""
    module = "instanttensor" if name.startswith("instanttensor") else name
    mod = optional(module)
    if mod is None:
        return f"{name} is not installed"
    torch = optional("torch")
    if torch is None:
        return f"{name} needs torch"
    dev, files = str(device), list(paths)

    def sync():
        if device.is_cuda:
            torch.cuda.synchronize(device.index)
    version = getattr(mod, "__version__", "")
    if name == "fastsafetensors":
        def load():
            with mod.fastsafe_open(files, framework="pt", device=dev, nogds=True) as f:
                out = {k: f.get_tensor(k).clone() for k in f.keys()}   # its buffers go with the handle
                sync()
            return out
        return Loader(f"fastsafetensors {version}".strip(), load, "nogds")
    if module == "instanttensor":
        if not device.is_cuda:
            return f"{name} loads onto GPUs only"
        if name.endswith("buffered") and os.environ.get("INSTANTTENSOR_DIRECT_IO") != "0":
            return f"{name} needs INSTANTTENSOR_DIRECT_IO=0 set before the process starts"

        def load():
            with mod.safe_open(files, framework="pt", device=device.index) as f:
                out = {n: t.clone() for n, t in f.tensors()}   # its tensors may view a reused buffer
                sync()
            return out
        note = "buffered reads (INSTANTTENSOR_DIRECT_IO=0)" if name.endswith("buffered") else "O_DIRECT (its default)"
        return Loader(f"{name} {version}".strip(), load, note)

    def load():
        with mod.SafetensorsStreamer() as s:
            s.stream_files(files)
            out = {n: (t.to(dev) if device.is_cuda else t) for n, t in s.get_tensors()}
            sync()
        return out
    return Loader(f"runai_model_streamer {version}".strip(), load, "host ring, then .to(device)")


def loaders(paths: Sequence[str], source, device: Device, peers: bool) -> Loaders:
    """foxhunt_stream first, then safetensors, then (``peers``) the peer loaders installed here."""
    out = Loaders([foxhunt(source, device)])
    for made in [safetensors_loader(paths, device)] + ([peer_loader(n, paths, device) for n in PEERS
                                                         if n != "instanttensor-buffered"] if peers else []):
        if isinstance(made, Loader):
            out.loaders.append(made)
        else:
            out.missing.append(made)
    return out
