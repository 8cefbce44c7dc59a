"""benchmarks/device_map_bench.py on the host: its split of a checkpoint over two devices and one
run with both "devices" the CPU (the two-GPU figures come from a GPU machine)."""

from __future__ import annotations

import importlib.util
import os

import numpy as np

from gpu_util import write_random_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

def test_benchmark_smoke_run_on_cpu(tmp_path, capsys, torch):   # the benchmark loads torch tensors
    path = os.path.join(REPO, "benchmarks",
                        "device_map_bench.py")
    spec = importlib.util.spec_from_file_location("device_map_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    specs = [("model.embed_tokens.weight", "BF16", (64, 32)), ("lm_head.weight", "BF16", (64, 32)),
             ("model.norm.weight", "BF16", (32,))]
    specs += [(f"model.layers.{i}.mlp.weight", "BF16", (32, 32)) for i in range(4)]
    write_random_file(str(tmp_path / "m.safetensors"), specs)
    names = [n for n, _, _ in specs]
    assert bench.split_map(names, "cuda:0", "cuda:1") == {
        "model.embed_tokens": "cuda:0", "model.layers.0": "cuda:0", "model.layers.1": "cuda:0", "": "cuda:1"}
    got = bench.main([str(tmp_path / "m.safetensors"), "--device-a", "cpu", "--device-b", "cpu", "--repeat", "1"])
    assert got["bytes"] == sum(2 * np.prod(s) for _, _, s in specs)
    assert got["on_a"] == 2 * (64 * 32 + 2 * 32 * 32)   # embeddings and layers 0, 1
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row.startswith("| ") and row.endswith("| cpu, cpu |") and row.count("|") == 8
