"""``fs.warmup``: a load's first-use costs paid up front (here the host pool: no GPU, no torch),
in the caller's thread or on a background one, with the caller's settings and its errors."""

from __future__ import annotations

import pytest

import foxhunt_stream as fs
from foxhunt_stream.engine import staging


def test_warmup_cpu_allocates_the_host_pool():
    staging.pool_cache().clear()
    times = fs.warmup("cpu")
    assert set(times) == {"host_pool"} and times["host_pool"] >= 0
    assert staging.pool_cache()


def test_background_warmup_returns_a_handle_and_uses_the_callers_settings():
    staging.pool_cache().clear()
    with fs.settings.override(chunk_bytes="64KiB", threads=2):   # contextvars do not follow threads
        h = fs.warmup("cpu", background=True)
    assert isinstance(h, fs.WarmupHandle)
    times = h.result(timeout=30)
    assert set(times) == {"host_pool"} and h.done()
    assert any(slot_bytes == (64 << 10) + 2 * 4096 for slot_bytes, _ in staging.pool_cache())


def test_background_warmup_error_surfaces_at_result():
    h = fs.warmup("cuda:99", background=True)
    with pytest.raises(fs.DeviceError):
        h.result(timeout=30)
