"""Shared helpers for GPU tests: skip cleanly without cupy or a CUDA device."""

import numpy as np
import pytest

import foxhunt_stream as fs
from foxhunt_stream.format.dtypes import DTYPES
from foxhunt_stream.format.header import layout, serialize_header


def require_gpu():
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as e:  # no driver
        pytest.skip(f"no CUDA device ({e})")
    return cp


def write_random_file(path, specs, seed=0, metadata=None):
    """Write a safetensors file of random bytes: specs = [(name, dtype_name, shape)].
    Returns {name: raw bytes}. Built from the header module + raw bytes (independent of the saver)."""
    rng = np.random.default_rng(seed)
    infos = layout([(n, DTYPES[d], tuple(s)) for n, d, s in specs])
    head = serialize_header(infos, metadata)
    raw = {t.name: rng.integers(0, 256, t.nbytes, dtype=np.uint8).tobytes() for t in infos}
    with open(path, "wb") as f:
        f.write(head)
        for t in infos:
            f.write(raw[t.name])
    return raw


ALL_DTYPE_SPECS = [(f"t_{d.lower()}", d, (3, 8)) for d in DTYPES]
