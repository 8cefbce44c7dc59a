"""Paying a load's first-use costs before the load (``warmup``): the CUDA runtime's import, the
context, the pinned staging pool and the streams, now or on a thread.
"""

from __future__ import annotations

import time

from .. import settings as _settings
from ..engine.pipeline import Job


class WarmupHandle:
    """A warmup running on a background thread (``warmup(..., background=True)``)."""

    def __init__(self, dev, s: _settings.Settings, verify: bool = False) -> None:
        self._out: dict[str, float] | None = None

        def work(worker: int, _item) -> None:
            self._out = _pay_first_use_costs(dev, s, verify)
        self._job = Job([None], work, 1, name="foxhunt-warmup").start()

    def done(self) -> bool:
        return self._job.done()

    def result(self, timeout: float | None = None) -> dict[str, float]:
        """The seconds each step took; re-raises the warmup's error (no GPU, no cupy...)."""
        self._job.wait(timeout)
        return dict(self._out or {})


def warmup(device="cuda:0", *, background: bool = False, verify: bool = False,
           **options) -> dict[str, float] | WarmupHandle:
    """Pay a load's first-use costs now; returns the seconds each step took.

    For a GPU: the CUDA runtime's import, the context, the pinned staging pool (reused by later
    loads and saves) and one stream per worker; for ``"cpu"``: the host scratch pool.
    ``background=True``: on a thread, a WarmupHandle returned at once. ``verify=True`` also
    builds the GPU checksum kernel (an NVRTC compile).
    """
    from ..cuda.devices import parse_device

    s = _settings.merge(**options)   # in the caller: its settings overrides apply
    dev = parse_device(device)
    if background:
        return WarmupHandle(dev, s, verify)
    return _pay_first_use_costs(dev, s, verify)


def _pay_first_use_costs(dev, s: _settings.Settings, verify: bool = False) -> dict[str, float]:
    from ..cuda import runtime as cudart
    from ..cuda.devices import check_device, context
    from ..engine.targets import CudaTarget, HostTarget

    t = time.perf_counter()
    out: dict[str, float] = {}

    def lap(key: str) -> None:
        nonlocal t
        now = time.perf_counter()
        out[key] = now - t
        t = now

    if not dev.is_cuda:
        HostTarget(s.chunk_bytes, min(s.n_slots, s.threads)).pool().fill()   # the size the loader asks for
        lap("host_pool")
        return out
    rt = cudart.runtime()
    lap("import_runtime")
    check_device(dev)
    with cudart.on_device(dev.index):
        rt.free(0)   # forces the (primary) context into existence
    lap("context")
    CudaTarget(dev.index, s.chunk_bytes, s.n_slots, s.threads).pool().fill()   # pinned now, not at the load
    lap("pinned_pool")
    ctx = context(dev.index)
    for w in range(s.threads):
        ctx.stream(w)
    lap("streams")
    if verify:
        from ..cuda.digest import KernelUnavailable, build_kernel
        try:
            build_kernel(dev.index)
        except KernelUnavailable:   # loads will hash host copies; they warn about it themselves
            pass
        lap("digest_kernel")
    return out
