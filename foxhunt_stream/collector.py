"""Python's cyclic garbage collector, held off while a load sets up and runs.

A load makes thousands of small objects (the plan's chunks, a header's entries) that hold no
reference cycles, so a collection during it finds nothing of ours; but the count of new objects
starts one, and the first full collection after ``import torch`` walks every object torch made:
45 ms on the 2-vCPU box, most of a fresh process's one-time cost. The switch is the process's:
while it is off, other threads' garbage cycles wait, and a collection that was due runs after.
As a decorator it resumes once the call's own objects are freed (only its result left): a
collection right after a load of 1M tensors, its plan still alive, took 0.67 s.
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
