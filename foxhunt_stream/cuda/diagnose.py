"""Why a GPU cannot be used, and what fixes it: the words of the DeviceErrors of a load to
``cuda:N``, built from facts gathered elsewhere (``runtime``). Pure: no CUDA, no imports."""

from __future__ import annotations

from typing import NamedTuple

CUPY_INSTALL = "pip install cupy-cuda13x (or cupy-cuda12x where the driver supports CUDA 12 only)"


class TorchFacts(NamedTuple):
    """What this process knows of torch: whether it is ``installed`` and ``imported``, its
    ``version``, the CUDA version it was built for (``cuda``: None for a CPU-only build), and
    ``hip`` for a ROCm build."""
    installed: bool
    imported: bool = False
    version: str = ""
    cuda: str | None = None
    hip: str | None = None


NO_DRIVER = ("no NVIDIA driver on this machine (libcuda.so.1 cannot be loaded): a load to a GPU needs an "
             "NVIDIA GPU and its driver; load with device='cpu' instead")


def no_runtime(torch: TorchFacts, cupy_installed: bool, driver: bool = True) -> str:
    """No CUDA runtime of cupy or torch in the process: why, and the fixes (``driver``: it loads)."""
    if not driver:
        return NO_DRIVER
    why = ["cupy did not import" if cupy_installed else "cupy is not installed"]
    fixes = [f"install cupy: {CUPY_INSTALL}"]
    if not torch.installed:
        why.append("torch is not installed")
        fixes.append("or, to load torch tensors, install a CUDA build of torch (pip install torch, on Linux x86_64) "
                     "and pass framework='pt'")
    elif not torch.imported:
        why.append("torch is installed but not imported yet (its CUDA runtime loads with `import torch`)")
        fixes.append("or import torch first and pass framework='pt'")
    elif torch.hip:
        why.append(f"torch {torch.version} is a ROCm build (HIP {torch.hip}); this library drives CUDA GPUs")
    elif not torch.cuda:
        why.append(f"torch {torch.version} is a CPU-only build")
        fixes.append("or install a CUDA build of torch (pip install torch, on Linux x86_64) and pass framework='pt'")
    else:
        why.append(f"no CUDA runtime library of torch {torch.version} (CUDA {torch.cuda}) is loaded in this process")
    return f"no CUDA runtime: {'; '.join(why)}. To fix: {'; '.join(fixes)}"


def runtime_failure(error: str, runtime: str, runtime_version: int, driver_version: int,
                    visible_devices: str | None) -> str:
    """The runtime's device count failed with ``error`` (its text, as "cudaErrorNoDevice: ...").
    ``runtime`` says which runtime (``runtime.describe``), ``runtime_version`` is its CUDA version
    (12080 for 12.8), ``driver_version`` what the driver supports (0: no driver), and
    ``visible_devices`` is CUDA_VISIBLE_DEVICES (None: unset)."""
    if "InsufficientDriver" in error or "NoDriver" in error or "driver" in error.lower():
        if driver_version:
            why = (f"the NVIDIA driver supports CUDA up to {version(driver_version)}, and {runtime} is CUDA "
                   f"{version(runtime_version)}")
        else:
            why = f"no NVIDIA driver is loaded, and {runtime} (CUDA {version(runtime_version)}) needs one"
        return (f"{why}. To fix: install or update the NVIDIA driver, or use builds for the CUDA version the driver "
                f"supports (cupy-cuda12x, a torch built for CUDA 12). ({error})")
    if "NoDevice" in error:
        shown = "" if visible_devices is None else f" with CUDA_VISIBLE_DEVICES={visible_devices!r}"
        return f"the CUDA runtime ({runtime}) sees no GPU{shown}. ({error})"
    return f"the CUDA runtime ({runtime}) failed: {error}"


def version(v: int) -> str:
    """A CUDA version number as text: 13000 -> "13.0", 12080 -> "12.8" (0: "none")."""
    return f"{v // 1000}.{v % 1000 // 10}" if v else "none"
