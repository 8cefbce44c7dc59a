"""Host (numpy) load and save: foxhunt_stream against safetensors.numpy, file in page cache.

    pytest benchmarks/test_host_bench.py                          # 64 MiB, quick
    FOXHUNT_BENCH_BYTES=2GiB pytest benchmarks/test_host_bench.py

Speed is reported, never asserted; each benchmark's GB/s (on the median) is in extra_info.
For a table with ceilings, ratios and peak memory, run benchmarks/host_bench.py.
"""

from __future__ import annotations

import os

import pytest
import safetensors.numpy as stn

import foxhunt_stream as fs
from host_bench import fresh_path, nbytes_of

ROUNDS = 10


def _report(benchmark, nbytes):
    benchmark.extra_info["bytes"] = nbytes
    benchmark.extra_info["GB/s"] = round(nbytes / benchmark.stats.stats.median / 1e9, 3)


@pytest.mark.benchmark(group="host-load")
@pytest.mark.parametrize("lib", ["foxhunt", "safetensors"])
def test_load(benchmark, bench_file, bench_tensors, lib):
    load = (lambda: fs.load_file(bench_file)) if lib == "foxhunt" else (lambda: stn.load_file(str(bench_file)))
    out = benchmark.pedantic(load, rounds=ROUNDS, warmup_rounds=1)
    assert sorted(out) == sorted(bench_tensors)
    _report(benchmark, nbytes_of(bench_tensors))


@pytest.mark.benchmark(group="host-save")
@pytest.mark.parametrize("lib", ["foxhunt", "foxhunt-fsync", "safetensors"])
def test_save(benchmark, bench_tensors, tmp_path, lib):
    """Into a path that does not exist yet, after os.sync(): no round pays for the last one's
    writeback. ``foxhunt`` skips fsync like the reference; ``foxhunt-fsync`` is the default."""
    out = str(tmp_path / "out.safetensors")
    save = {"foxhunt": lambda: fs.save_file(bench_tensors, out, fsync=False),
            "foxhunt-fsync": lambda: fs.save_file(bench_tensors, out),
            "safetensors": lambda: stn.save_file(bench_tensors, out)}[lib]

    def setup():
        fresh_path(str(tmp_path), "out.safetensors")
    benchmark.pedantic(save, setup=setup, rounds=ROUNDS)
    assert os.path.getsize(out) > nbytes_of(bench_tensors)
    _report(benchmark, nbytes_of(bench_tensors))
