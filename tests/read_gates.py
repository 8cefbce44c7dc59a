"""Fault hooks (``io.source.fault_hook``) that hold back or note the reads of one tensor, shared by
the tests that prove a load or a prefetch waits only for what it needs."""

from __future__ import annotations

import threading

from foxhunt_stream.io.checkpoint import open_checkpoint


def range_of(path: str, name: str) -> tuple[int, int]:
    """The file offsets ``[start, end)`` of tensor ``name``'s bytes."""
    ck = open_checkpoint(path)
    f, info = ck.names[name]
    base = ck.headers[f].data_start
    return base + info.start, base + info.end


def gate_hook(path, name, gate: threading.Event, log: list, arrived: threading.Event | None = None):
    """Hold reads of ``name`` until ``gate`` opens (at most 20 s); log whether the gate opened.
    ``arrived`` is set when a read is being held."""
    lo, hi = range_of(path, name)

    def hook(src, offset, length):
        if lo <= offset < hi:
            if arrived is not None:
                arrived.set()
            log.append(gate.wait(20))
        return None
    return hook
