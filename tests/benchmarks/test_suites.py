"""The benchmark suites' shared pieces and the runner, on the CPU: the checkpoint they write, the
plans and helpers they use, and a runner that goes on past a suite that fails."""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest

import common
import disk_bench
from foxhunt_stream.cli import fresh
import run as runner
import tp_bench

import foxhunt_stream as fs


def test_16gb_is_llama_3_8b():
    config = common.llama_config(16e9)
    assert config["num_hidden_layers"] == 32 and config["hidden_size"] == 4096
    assert config["num_key_value_heads"] == 8 and config["vocab_size"] == 128256
    assert config["model_type"] == "llama" and config["torch_dtype"] == "bfloat16"
    total = sum(2 * math.prod(s) for _, s in common.config_shapes(config))
    assert total == 16_060_522_496   # 14.96 GiB
    shapes = dict(common.config_shapes(config))
    assert shapes["model.layers.31.self_attn.k_proj.weight"] == (1024, 4096)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (14336, 4096)


@pytest.mark.parametrize("size", [16 << 20, 64 << 20, 1 << 30, 8e9])
def test_the_config_comes_close_to_the_size_asked(size):
    total = sum(2 * math.prod(s) for _, s in common.config_shapes(common.llama_config(int(size))))
    assert 0.75 * size < total < 1.25 * size


def test_ensure_checkpoint_writes_once_and_reuses(tmp_path):
    d = str(tmp_path / "ck")
    files = common.ensure_checkpoint(d, "8MiB", shards=3)
    assert [os.path.basename(f) for f in files] == [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    index = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(n for n, _ in common.config_shapes(config))
    stamp = os.path.getmtime(files[0])
    assert common.ensure_checkpoint(d, "8MiB", shards=3) == files and os.path.getmtime(files[0]) == stamp
    assert common.ensure_checkpoint(d) == files                       # no size: whatever is there
    again = common.ensure_checkpoint(d, "8MiB", shards=2)              # another layout: written again
    assert len(again) == 2 and not os.path.exists(files[2])


def test_ensure_checkpoint_leaves_a_foreign_checkpoint_alone(tmp_path):
    fs.save_file({"w": np.ones(4, np.float32)}, tmp_path / "model.safetensors")
    with pytest.raises(SystemExit, match="did not write"):
        common.ensure_checkpoint(str(tmp_path), "8MiB")
    assert common.ensure_checkpoint(str(tmp_path)) == [str(tmp_path / "model.safetensors")]
    with pytest.raises(SystemExit, match="no checkpoint"):
        common.ensure_checkpoint(str(tmp_path / "empty"))


def test_hardware_is_described_as_hardware():
    m = {"gpus": ["NVIDIA H200, 5, 16"], "cpus": 16, "mem_gib": 125.8}
    assert common.hardware(m) == "1x NVIDIA H200, PCIe Gen5 x16; 16 CPUs, 125.8 GiB RAM"
    assert common.hardware({"gpus": [], "cpus": 2, "mem_gib": 23.5}) == "no GPU; 2 CPUs, 23.5 GiB RAM"


def test_interleaved_rounds_rotate_and_time_every_case():
    seen = []
    times = common.interleaved({"a": lambda: seen.append("a"), "b": lambda: seen.append("b"),
                                "c": lambda: seen.append("c")}, 2, "cpu")
    assert seen == ["a", "b", "c", "a", "b", "c", "b", "c", "a"]   # one warm-up each, then rotated rounds
    assert {k: len(v) for k, v in times.items()} == {"a": 2, "b": 2, "c": 2}


def test_the_llama_plan_splits_what_a_serving_stack_splits():
    shard = fs.Shard(0, 8, tp_bench.LLAMA_PLAN)
    assert shard.dim_for("model.embed_tokens.weight") == 0 and shard.dim_for("lm_head.weight") == 0
    for w in ("q_proj", "k_proj", "v_proj"):
        assert shard.dim_for(f"model.layers.3.self_attn.{w}.weight") == 0
    assert shard.dim_for("model.layers.3.self_attn.o_proj.weight") == 1
    assert shard.dim_for("model.layers.3.mlp.gate_proj.weight") == 0
    assert shard.dim_for("model.layers.3.mlp.up_proj.weight") == 0
    assert shard.dim_for("model.layers.3.mlp.down_proj.weight") == 1
    assert shard.dim_for("model.layers.3.input_layernorm.weight") is None
    assert shard.dim_for("model.norm.weight") is None
    shapes = {"w": (8, 4), "norm": (4,)}
    rows, cols = (p for name, p in tp_bench.plans(shapes).items() if not name.startswith("Llama"))
    assert (rows("w"), rows("norm"), cols("w"), cols("norm")) == (0, None, 1, None)


def test_check_sample_compares_with_the_file(tmp_path):
    files = common.ensure_checkpoint(str(tmp_path), "4MiB", shards=2)
    out = fs.load_file(str(tmp_path))
    fresh.check_sample(out, files)
    name = fs.read_header(files[0]).tensors[0].name   # the one it compares: the file's first
    out[name] = out[name].copy()
    out[name].reshape(-1)[0] += 1
    with pytest.raises(AssertionError, match="differ"):
        fresh.check_sample(out, files)


def test_disk_probe_while_streaming(tmp_path):
    paths = []
    for i in range(3):
        p = tmp_path / f"f{i}.bin"
        p.write_bytes(os.urandom(2 << 20))
        paths.append(str(p))
    r = disk_bench.stream_and_probe(paths[:2], paths[2], 2, 1 << 20, "rp", 0.4)
    assert r["n"] > 5 and r["GBps"] > 0 and r["p50"] <= r["p99"] <= r["max"]


def test_disk_rate_reads_every_byte(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(disk_bench.ce, "drop_caches", lambda files, whole_cache=False: calls.append(whole_cache))
    files = common.ensure_checkpoint(str(tmp_path / "ck"), "4MiB", shards=2)
    res = common.Results("disk", str(tmp_path / "out"))

    class Args:
        readers, step = "1,2", "1MiB"
    disk_bench.rate(Args, files, res)
    assert calls == [True, True] and set(res.data["seconds_by_readers"]) == {1, 2}


# ---------------------------------------------------------------- the runner

def test_every_suite_runs_a_script_that_exists():
    for name, suite in runner.SUITES.items():
        for cmd in suite.commands:
            scripts = [part for part in cmd if part.endswith(".py")]
            assert all(os.path.exists(s) for s in scripts), (name, scripts)


def test_fill_drops_empty_parts():
    assert runner.fill(["a", "{x}", "--out", "{out}"], {"x": "", "out": "/o"}) == ["a", "--out", "/o"]


def test_the_runner_goes_on_past_a_suite_that_fails_or_runs_out_of_time(tmp_path, monkeypatch, capsys):
    py = sys.executable
    monkeypatch.setitem(runner.SUITES, "boom", runner.Suite("fails", [[py, "-c", "raise SystemExit(3)"]], 60,
                                                            needs_ckpt=False))
    monkeypatch.setitem(runner.SUITES, "slow", runner.Suite("too slow", [[py, "-c", "import time; time.sleep(60)"]],
                                                            2, needs_ckpt=False))
    monkeypatch.setitem(runner.SUITES, "fine", runner.Suite("works", [[py, "-c", "print('all good')"]], 60,
                                                            needs_ckpt=False))
    out = tmp_path / "out"
    code = runner.main(["boom", "slow", "fine", "--out", str(out), "--peer-wheels", str(tmp_path / "none")])
    assert code == 1
    summary = (out / "summary.txt").read_text()
    assert "boom     failed: exit 3" in summary and "slow     stopped: out of time" in summary
    assert "fine     ok" in summary
    assert "all good" in (out / "fine.log").read_text()
    machine = json.loads((out / "machine.json").read_text())
    assert machine["hardware"] and machine["byte_compiled"] is True


def test_the_runner_writes_bytecode_even_where_the_environment_forbids_it(tmp_path, monkeypatch):
    """A fresh process then imports the package instead of compiling it, as after an install."""
    import importlib.util
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    sources = [package / "__init__.py", package / "sub" / "mod.py"]
    for source in sources:
        source.write_text("X = 1\n")
    assert runner.byte_compile([str(package)])
    assert all(os.path.exists(importlib.util.cache_from_source(str(s))) for s in sources)
    (package / "broken.py").write_text("def (:\n")
    assert not runner.byte_compile([str(package)])


def test_the_runner_on_the_cpu(tmp_path):
    """Two real suites on a small checkpoint: each writes its table and its figures."""
    out, ck = tmp_path / "out", tmp_path / "ck"
    code = runner.main(["load", "tp", "--device", "cpu", "--size", "16MiB", "--ckpt", str(ck), "--out", str(out),
                        "--peer-wheels", str(tmp_path / "none")])
    assert code == 0
    summary = (out / "summary.txt").read_text()
    assert "load     ok" in summary and "tp       ok" in summary
    load = json.loads((out / "load.json").read_text())
    firsts = [r["seconds"] for r in load["runs"]["foxhunt"]]
    assert firsts and all(t > 0 for t in firsts) and load["bytes"] > 0.7 * (16 << 20)
    assert [r["seconds"] for r in load["runs"]["host_foxhunt"]]
    tp = json.loads((out / "tp.json").read_text())
    assert set(tp["fraction"]) == {"full load", *tp_bench.plans({}).keys(), 'Llama, backend="pread"',
                                   'columns, backend="pread"', "full load, floor", "rows, floor"}
    assert tp["landed"]["rows (every 2-D tensor along dim 0)"] < tp["landed"]["full load"] / 4
    assert tp["landed"]["rows, floor"] == tp["landed"]["rows (every 2-D tensor along dim 0)"]
    assert tp["landed"]["full load, floor"] == tp["landed"]["full load"]
    assert math.isfinite(tp["floor_fraction"]) and tp["floor_fraction"] > 0   # a time ratio: no bound on a CPU smoke run


def test_the_chunk_size_sweep_times_every_plan_at_every_size_in_one_process(tmp_path):
    import subprocess
    here = os.path.dirname(os.path.abspath(common.__file__))
    out = tmp_path / "out"
    subprocess.run([sys.executable, os.path.join(here, "load_bench.py"), str(tmp_path / "ck"), "--size", "16MiB",
                    "--device", "cpu", "--chunks", "1MiB,2MiB/1MiB", "--rounds", "2", "--out", str(out)],
                   capture_output=True, text=True, timeout=300, check=True)
    data = json.loads((out / "chunks.json").read_text())
    assert data["chunks"] == [1 << 20, 2 << 20] and data["reads"] == [1 << 20, 1 << 20]
    assert set(data["seconds"]) == {f"{plan}, {label}" for label in ("1 MiB", "2 MiB, reads 1 MiB")
                                    for plan in ("full load", "rows", "Llama plan", "columns")}
    assert all(len(ts) == 2 for ts in data["seconds"].values())
    table = (out / "chunks.txt").read_text()
    assert "1 MiB" in table and "2 MiB, reads 1 MiB" in table and "rows / full" in table


def test_first_load_timeline_reports_each_step_of_both_loads(tmp_path):
    """The timeline script on the host: each variant in a new process, the loader's steps in the
    order a load takes them, and the files it writes."""
    import first_load_timeline as tl
    ck = str(tmp_path / "ck")
    common.ensure_checkpoint(ck, "4MiB", shards=2)
    assert tl.main([ck, "--device", "cpu", "--rounds", "1", "--variants", "plain,preimport+swi",
                    "--out", str(tmp_path / "o")]) == 0
    data = json.loads((tmp_path / "o" / "timeline.json").read_text())
    for variant in ("plain", "preimport+swi"):
        (run,) = data["runs"][variant]
        first, second = (tl.milestones(load) for load in run["loads"])
        steps = [first[k] for k in ("import", "placement", "headers", "plan", "workers", "done")]
        assert steps == sorted(steps) and second["done"] > 0
    plain, pre = (tl.milestones(data["runs"][v][0]["loads"][0]) for v in ("plain", "preimport+swi"))
    assert pre["import"] < plain["import"]   # imported before the clock: nothing left to import
    assert "medians" in (tmp_path / "o" / "timeline.txt").read_text()



def test_tiny_tensors_times_both_loaders_in_new_processes(tmp_path):
    """The many-tiny-tensors benchmark on the host: the file written once, each loader once per
    round in a new process, every load checked, the runs written out."""
    import tiny_tensors
    assert tiny_tensors.main([str(tmp_path / "d"), "--tensors", "3000", "--rounds", "2",
                              "--out", str(tmp_path / "o")]) == 0
    data = json.loads((tmp_path / "o" / "tiny_tensors_3000.json").read_text())
    for case in ("foxhunt", "safetensors"):
        assert len(data["runs"][case]) == 2
        assert all(r["ok"] and r["tensors"] == 3000 and r["seconds"] > 0 for r in data["runs"][case])
    assert os.listdir(tmp_path / "d") == ["tiny-3000.safetensors"]


def test_a_fresh_run_says_what_the_host_took_from_the_machine(tmp_path, monkeypatch):
    files = common.ensure_checkpoint(str(tmp_path / "ck"), "4MiB", shards=2)
    before = fresh.stolen_seconds()
    r = fresh.run("foxhunt", str(tmp_path / "ck"), "cpu", files, timeout=120)
    assert r["seconds"] > 0 and r["second"] > 0, r
    if before is None:   # no /proc/stat here
        assert "stolen" not in r
    else:
        assert 0 <= r["stolen"] <= fresh.stolen_seconds() - before + 0.01

    def no_proc(*a, **k):
        raise FileNotFoundError("/proc/stat")
    monkeypatch.setattr("builtins.open", no_proc)
    assert fresh.stolen_seconds() is None


def test_a_variants_pythonpath_comes_before_the_package(tmp_path):
    """``fresh_bench.py --variant name:PYTHONPATH=DIR`` times the package in DIR, not this one."""
    files = common.ensure_checkpoint(str(tmp_path / "ck"), "4MiB", shards=2)
    (tmp_path / "alt" / "foxhunt_stream").mkdir(parents=True)
    (tmp_path / "alt" / "foxhunt_stream" / "__init__.py").write_text('raise ImportError("the package in alt")\n')
    r = fresh.run("foxhunt", str(tmp_path / "ck"), "cpu", files, timeout=120, env={"PYTHONPATH": str(tmp_path / "alt")})
    assert "the package in alt" in r.get("error", ""), r


def test_startup_timeline_stamps_each_step_of_from_pretrained_and_the_load_alone(tmp_path):
    """The startup timeline on the host: a from_pretrained and a plain load, each in a new process,
    the steps in the order from_pretrained takes them, and the figures derived from them."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import startup_timeline as st
    ck = str(tmp_path / "ck")
    common.ensure_checkpoint(ck, "4MiB", shards=2)
    assert st.main([ck, "--device", "cpu", "--rounds", "1", "--out", str(tmp_path / "o")]) == 0
    data = json.loads((tmp_path / "o" / "startup_timeline.json").read_text())
    (model,), (load,) = data["runs"]["model"], data["runs"]["load"]
    order = ["imported", "prepare<", "load_file>", "build_on_meta<", "match<", "finalize<", "returned", "forward"]
    assert [model[k] for k in order] == sorted(model[k] for k in order)
    assert model["load_file>"] < model["load_end"] <= model["returned"]
    assert load["imported"] < load["load_end"] <= load["loaded"] and "prepare>" not in load
    figures = st.derived(model, load)
    assert figures["background_load"] > 0 and figures["after_load"] >= 0 and figures["load_alone"] > 0
    assert "background_load" in (tmp_path / "o" / "startup_timeline.txt").read_text()


def test_startup_timeline_splits_the_warm_forward_into_waiting_and_working():
    """``warm_up_working`` is the warm forward's time less what its hooks waited for weights; a
    run without a warm forward (the host) has no such figure."""
    import startup_timeline as st
    model = {"load_file>": 100.0, "warm_up>": 150.0, "warm_up_waited": 120.0, "warm_up_weights_in": 400.0,
             "load_end": 420.0, "warm_up<": 500.0, "returned": 505.0}
    figures = st.derived(model, None)
    assert figures == {"background_load": 320.0, "after_load": 85.0, "warm_up_working": 230.0}
    del model["warm_up>"], model["warm_up<"], model["warm_up_waited"]
    assert "warm_up_working" not in st.derived(model, None)


def test_startup_timeline_passes_no_warm_forward_to_from_pretrained(tmp_path, monkeypatch):
    """``--no-warm-forward`` reaches each model child as ``from_pretrained(..., warm_forward=False)``."""
    import startup_timeline as st
    calls = []

    def fake_child(args, timeout):
        calls.append(args)
        return {"imported": 1.0, "load_file>": 2.0, "load_end": 3.0, "returned": 4.0, "loaded": 3.5}
    monkeypatch.setattr(common, "run_child", fake_child)
    assert st.main([str(tmp_path), "--device", "cpu", "--rounds", "1", "--no-warm-forward"]) == 0
    assert [a[-1] for a in calls] == ["off", "off"] and {a[2] for a in calls} == {"model", "load"}
    calls.clear()
    assert st.main([str(tmp_path), "--device", "cpu", "--rounds", "1"]) == 0
    assert [a[-1] for a in calls] == ["default", "default"]
