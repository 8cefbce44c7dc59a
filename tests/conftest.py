"""Shared by every test.

The helpers beside this file (``format_support``, ``gpu_util``, ``dist_harness``) are importable
from the test folders below it, which mirror the package (``format/``, ``io/``, ``cuda/``,
``engine/``, ``integrity/``, ``distributed/``, ``models/``, ``startup/``, ``cli/``), and
``REPO`` is the checkout's root. Tests of optional parts skip cleanly through the fixtures here
(and ``gpu_util.require_gpu``) when their package or device is missing.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture
def short_switches():
    """A 10 us thread switch interval for the test: races between threads become likely."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


@pytest.fixture
def torch():
    """torch, or a skip where it is not installed."""
    return pytest.importorskip("torch")


@pytest.fixture
def recorded_order(monkeypatch):
    """The chunks of each load started in the test, in the order its job was given them (one list
    per load)."""
    from foxhunt_stream.engine import inflight
    seen = []
    real = inflight.Job

    def job(items, *a, **k):
        seen.append(list(items))
        return real(items, *a, **k)
    monkeypatch.setattr(inflight, "Job", job)
    return seen
