"""Python's cyclic garbage collector, held off while a load runs.

A load's small objects (plan chunks, header entries) hold no cycles, yet their count starts
collections: the first full one after ``import torch`` walks all of torch's objects (45 ms on the
2-vCPU box). The switch is the process's: a collection that was due runs after. As a decorator it
resumes once the call's own objects are freed (one right after a 1M-tensor load took 0.67 s).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Hold the collector off for the ``with`` body, then restore it as it was."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
