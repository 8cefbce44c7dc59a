"""The startup benchmark's own logic, without torch or a GPU: the schedule, the figures a start
yields, the summary and the criteria, and the order a child start does things in."""

from __future__ import annotations

import builtins
import json
import os
import subprocess
import sys
import types

import pytest

import startup_bench as sb


def test_rounds_interleave_the_variants_and_rotate_their_order():
    plan = sb.schedule(["floor", "transformers", "foxhunt"], ["hot", "cold"], 3)
    assert len(plan) == 3 * 2 * 3
    first = [(m, v) for r, m, v in plan if r == 0]
    assert first == [("hot", "floor"), ("hot", "transformers"), ("hot", "foxhunt"),
                     ("cold", "floor"), ("cold", "transformers"), ("cold", "foxhunt")]
    assert [v for r, m, v in plan if r == 1 and m == "hot"] == ["transformers", "foxhunt", "floor"]
    for r in range(3):   # every variant once per round and mode
        for mode in ("hot", "cold"):
            assert sorted(v for rr, m, v in plan if rr == r and m == mode) == ["floor", "foxhunt", "transformers"]


def test_cold_only_variants_stay_out_of_hot_rounds():
    plan = sb.schedule(["floor", "foxhunt", "foxhunt_no_prefetch"], ["hot", "cold"], 2)
    assert ("hot", "foxhunt_no_prefetch") not in {(m, v) for _, m, v in plan}
    assert sum(1 for _, m, v in plan if (m, v) == ("cold", "foxhunt_no_prefetch")) == 2


def test_phases_are_differences_between_stamps():
    stamps = {"start": 10.5, "imports": 20.0, "cuda": 20.5, "model": 21.0, "forward": 21.25}
    assert sb.phases(10.0, stamps) == {"start": 0.5, "imports": 9.5, "cuda": 0.5, "model": 0.5, "forward": 0.25}
    with_prefetch = sb.phases(10.0, {"start": 10.1, "prefetch": 10.3, "imports": 20.0, "cuda": 20.5, "model": 21.0})
    assert with_prefetch["prefetch"] == pytest.approx(0.2) and with_prefetch["imports"] == pytest.approx(9.7)


def test_a_start_ends_at_its_forward_or_for_the_floor_at_its_model():
    stamps = {"start": 1.0, "imports": 9.0, "cuda": 9.5, "model": 10.0, "forward": 10.5}
    assert sb.measured(0.0, stamps) == {"total_s": 10.5, "after_cuda_s": 1.0}
    del stamps["forward"]
    assert sb.measured(0.0, stamps) == {"total_s": 10.0, "after_cuda_s": 0.5}


def test_the_deadline_stops_a_start_that_would_end_past_it():
    runs = [{"mode": "hot", "variant": "floor", "wall_s": 11.0},
            {"mode": "hot", "variant": "transformers", "wall_s": 15.0}]
    assert sb.estimate(runs, "hot", "floor") == 11.0
    assert sb.estimate(runs, "hot", "foxhunt") == 15.0          # not seen yet: the longest of the mode
    assert sb.estimate(runs, "cold", "floor") == 60.0           # nothing seen: the default
    assert not sb.should_stop(100.0, 15.0, None)
    assert not sb.should_stop(100.0, 15.0, 120.0)
    assert sb.should_stop(110.0, 15.0, 120.0)


def _run(mode, variant, total, after=None, error=None):
    if error:
        return {"mode": mode, "variant": variant, "error": error}
    return {"mode": mode, "variant": variant, "total_s": total,
            "after_cuda_s": after if after is not None else total / 10,
            "phases_s": {"start": 0.1, "imports": total - 0.1}}


def test_summary_takes_medians_per_mode_and_keeps_the_last_error():
    runs = [_run("hot", "floor", 10.0), _run("hot", "floor", 12.0), _run("hot", "floor", 11.0),
            _run("cold", "floor", 14.0), _run("hot", "foxhunt", 0, error="exit 1: boom"),
            _run("hot", "foxhunt", 0, error="exit 1: bang")]
    s = sb.summarize(runs)
    assert list(s) == ["hot", "cold"]
    assert s["hot"]["floor"]["total_s"] == 11.0 and s["hot"]["floor"]["runs"] == 3
    assert s["hot"]["floor"]["phases_s"]["imports"] == pytest.approx(10.9)
    assert s["hot"]["foxhunt"] == {"error": "exit 1: bang"}
    assert "foxhunt" not in s["cold"]


def test_criteria_compare_with_the_floor_of_the_same_mode():
    runs = [_run("hot", "floor", 10.0, 0.4), _run("hot", "transformers", 14.0, 3.7),
            _run("hot", "foxhunt", 10.9, 1.1), _run("cold", "floor", 13.0, 0.5),
            _run("cold", "transformers", 23.0, 9.0), _run("cold", "foxhunt", 16.0, 1.5)]
    c = sb.criteria(sb.summarize(runs))
    hot, cold = c["hot"]["total_s"], c["cold"]["total_s"]
    assert c["hot"]["bar"] == 0.25 and c["cold"]["bar"] == 0.2
    assert hot["foxhunt_minus_F"] == pytest.approx(0.9) and hot["limit"] == pytest.approx(1.0) and hot["met"]
    assert cold["foxhunt_minus_F"] == pytest.approx(3.0) and cold["limit"] == pytest.approx(2.0) and not cold["met"]
    assert c["hot"]["after_cuda_s"]["ratio"] == pytest.approx(0.7 / 3.3)
    lines = sb.report_lines(sb.summarize(runs), c, 16_060_000_000, "cuda:0")
    assert any(line.startswith("hot, spawn to first forward (the criterion): foxhunt - F = +0.90 s")
               and line.endswith("met (ratio 0.23)") for line in lines)
    assert any(line.startswith("cold, spawn to first forward") and "missed" in line for line in lines)


def test_no_criteria_without_all_three_variants():
    runs = [_run("hot", "floor", 10.0), _run("hot", "transformers", 14.0), _run("hot", "foxhunt", 0, error="x")]
    assert sb.criteria(sb.summarize(runs)) == {}


def test_child_arguments():
    assert sb.child_args(["foxhunt", "/m", "--device", "cuda:1", "--prefetch"]) == ("foxhunt", "/m", "cuda:1", True, None)
    assert sb.child_args(["floor", "/m"]) == ("floor", "/m", "cuda:0", False, None)
    assert sb.child_args(["foxhunt", "/m", "--prefetch", "--trace", "/t"]) == ("foxhunt", "/m", "cuda:0", True, "/t")
    with pytest.raises(SystemExit, match="usage"):
        sb.child_args(["2s16", "/m"])


@pytest.mark.parametrize("traced", [False, True])
def test_a_cold_start_prefetches_before_anything_is_imported(monkeypatch, capsys, tmp_path, traced):
    """The order of a child start, with torch and transformers stood in for: the prefetch is the
    program's first statement (with the import trace, waiting for the code), the imports come
    after it, the forward after the model."""
    order = []
    real_import = builtins.__import__
    fake = types.ModuleType("fake")
    trace = tmp_path / "imports.trace"
    if traced:
        trace.write_text("")

    def importer(name, *args, **kwargs):
        if name in ("torch", "transformers"):
            order.append(f"import {name}")
            return fake
        return real_import(name, *args, **kwargs)

    class Prefetch:
        def wait_imports(self):
            order.append("wait_imports")

    def prefetch(d, imports=None):
        order.append(f"prefetch {d} {'trace' if imports == str(trace) else imports}")
        return Prefetch()
    import foxhunt_stream as fs
    monkeypatch.setattr(fs, "prefetch", prefetch, raising=False)
    monkeypatch.setattr(fs, "record_imports", lambda path: order.append("record") or 7, raising=False)
    monkeypatch.setattr(builtins, "__import__", importer)
    monkeypatch.setattr(sb, "start_cuda", lambda device: order.append("cuda"))
    monkeypatch.setitem(sb.BUILDERS, "foxhunt", lambda d, dev, notes: order.append("model") or "the model")
    monkeypatch.setattr(sb, "forward", lambda model, device: order.append(f"forward {model}"))
    sb.child_main(["foxhunt", "/m", "--device", "cpu", "--prefetch", "--trace", str(trace)])
    first = ["prefetch /m trace", "wait_imports"] if traced else ["prefetch /m trace"]
    last = [] if traced else ["record"]   # a missing trace is recorded at the end, for the next starts
    assert order == first + ["import torch", "import transformers", "cuda", "model", "forward the model"] + last
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1][len("RESULT "):])
    stamps = result["stamps"]
    assert list(stamps) == ["start", "prefetch", "imports", "cuda", "model", "forward"]
    assert sorted(stamps.values()) == list(stamps.values())


def test_a_hot_start_does_not_prefetch(monkeypatch, capsys):
    import foxhunt_stream as fs
    monkeypatch.setattr(fs, "prefetch", lambda d: pytest.fail("prefetched"), raising=False)
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    monkeypatch.setitem(sys.modules, "transformers", types.ModuleType("transformers"))
    monkeypatch.setattr(sb, "start_cuda", lambda device: None)
    monkeypatch.setitem(sb.BUILDERS, "floor", lambda d, dev, notes: None)
    sb.child_main(["floor", "/m", "--device", "cpu"])
    stamps = json.loads(capsys.readouterr().out.strip()[len("RESULT "):])["stamps"]
    assert "prefetch" not in stamps and "forward" not in stamps and "model" in stamps


def test_startup_on_the_cpu_end_to_end(tmp_path):
    """A real run, one hot round on the CPU with a small model: the checkpoint and config load in
    transformers and every figure comes out (needs torch and transformers)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(sb.__file__)))
    r = subprocess.run([sys.executable, sb.__file__, str(tmp_path / "ck"), "--size", "24MiB", "--device", "cpu",
                        "--modes", "hot", "--rounds", "1", "--variants", "floor,transformers", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads((out / "startup.json").read_text())
    hot = data["summary"]["hot"]
    assert set(hot) == {"floor", "transformers"}, hot
    assert hot["transformers"]["phases_s"]["forward"] > 0 and "forward" not in hot["floor"]["phases_s"]
    assert data["machine"]["hardware"] and data["machine"]["commit"]
    assert "spawn to the first forward" in (out / "startup.txt").read_text()


def test_only_cold_foxhunt_starts_prefetch_and_only_foxhunt_takes_the_import_trace():
    def flags(variant, mode, record=False):
        cmd = sb.child_command(variant, mode, "/m", "cuda:0", "/t", record)
        return "--prefetch" in cmd, cmd[cmd.index("--trace") + 1] if "--trace" in cmd else None
    assert flags("foxhunt", "cold") == (True, "/t")
    assert flags("foxhunt_no_trace", "cold") == (True, None)
    assert flags("foxhunt_no_prefetch", "cold") == (False, None)
    assert flags("foxhunt", "hot") == (False, None)
    assert flags("transformers", "cold") == (False, None)
    assert flags("foxhunt", "hot", record=True) == (True, "/t")   # the start that records the trace
