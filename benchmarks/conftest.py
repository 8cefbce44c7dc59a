"""Fixtures for ``pytest benchmarks``: a checkpoint of FOXHUNT_BENCH_BYTES (default 64 MiB, so the
suite is quick; e.g. ``FOXHUNT_BENCH_BYTES=2GiB pytest benchmarks`` for real sizes)."""

from __future__ import annotations

import os

import pytest
import safetensors.numpy as stn

from foxhunt_stream.settings import parse_size
from host_bench import make_tensors


@pytest.fixture(scope="session")
def bench_bytes() -> int:
    return parse_size(os.environ.get("FOXHUNT_BENCH_BYTES", "64MiB"))


@pytest.fixture(scope="session")
def bench_tensors(bench_bytes):
    """Llama-shaped float16 tensors, about ``bench_bytes`` in all, in memory."""
    return make_tensors(bench_bytes)


@pytest.fixture(scope="session")
def bench_file(bench_tensors, tmp_path_factory):
    """The tensors written by the reference serializer, read once so the file is in page cache."""
    path = tmp_path_factory.mktemp("bench") / "model.safetensors"
    stn.save_file(bench_tensors, str(path))
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    return path
