"""Python's cyclic garbage collector, held off while a load runs: a load's many small objects hold
no cycles, yet start collections that walk all of torch's objects (45 ms on a 2-vCPU box). The
switch is the process's: a due collection runs after (as a decorator, once the call's objects are freed).
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
