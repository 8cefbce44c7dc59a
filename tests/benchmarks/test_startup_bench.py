"""The startup benchmark's own logic (no torch, no GPU): the child programs it generates are
valid Python for every variant and device, and the summary subtracts the floor per mode."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks", "startup_bench.py")
_spec = importlib.util.spec_from_file_location("startup_bench", _PATH)
sb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sb)


@pytest.mark.parametrize("device", ["cuda:0", "cpu"])
@pytest.mark.parametrize("variant", sb.VARIANTS)
def test_child_programs_compile(variant, device):
    code = sb.child_program(variant, "/models/it's here", device)
    compile(code, f"<{variant}>", "exec")
    assert code.rstrip().endswith('flush=True)') and "RESULT " in code
    if variant in ("2p",) + sb.TRACED:   # prefetch comes before torch is imported
        assert code.index("fs.prefetch(") < code.index("import torch")
    if variant in sb.TRACED:   # the trace is replayed first and recorded again after the timing
        assert "imports='/tmp/foxhunt_startup_imports.txt'" in code
        assert code.index('T["done"]') < code.index("record_imports(")
    assert ("torch.cuda.synchronize()" in code) == device.startswith("cuda")


def test_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="unknown variant"):
        sb.child_program("4", "/x", "cpu")


def test_phases_are_differences_between_stamps():
    stamps = {"start": 10.5, "import_torch": 12.0, "load": 15.0, "done": 15.25}
    assert sb._phases(10.0, stamps) == {"python_start": 0.5, "import_torch": 1.5, "load": 3.0}


def test_summary_subtracts_each_modes_floor():
    def run(v, mode, total, load=None):
        phases = {"python_start": 0.1} | ({"load": load} if load else {})
        return {"variant": v, "mode": mode, "total_s": total, "phases_s": phases}
    runs = [run("F", "hot", 10.0), run("F", "hot", 12.0), run("2", "hot", 13.0, load=2.0),
            run("F", "cold", 20.0), run("2", "cold", 30.0, load=8.0),
            {"variant": "1", "mode": "hot", "error": "exit 1: boom"}]
    s = sb.summarize(runs, nbytes=4_000_000_000)
    assert s["hot"]["F"]["total_s"] == 11.0 and s["hot"]["2"]["minus_floor_s"] == 2.0
    assert s["hot"]["2"]["load_GBps"] == 2.0
    assert s["cold"]["2"]["minus_floor_s"] == 10.0 and s["cold"]["2"]["load_GBps"] == 0.5
    assert s["hot"]["1"] == {"error": "exit 1: boom"} and "1" not in s["cold"]


def test_prefetch_tuning_reaches_the_traced_variants_only():
    code = sb.child_program("2t", "/d", "cpu", tune="threads=4", step=16 << 20)
    compile(code, "<2t>", "exec")
    assert "threads=4)" in code and "PACED_BYTES = 16777216" in code
    assert code.index("PACED_BYTES") < code.index("fs.prefetch(")
    assert "threads=4" not in sb.child_program("2", "/d", "cpu", tune="threads=4")


def _print_runs():
    spec = importlib.util.spec_from_file_location("print_runs", os.path.join(os.path.dirname(_PATH), "print_runs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_print_runs_lists_each_run_with_its_side_measurements(tmp_path, capsys):
    print_runs = _print_runs()
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"runs": [
        {"mode": "hot", "variant": "2s", "total_s": 14.05, "phases_s": {"import_torch": 3.8, "forward": 0.826},
         "bg_load_s": 0.663, "fwd_layer_first_s": 0.473},
        {"mode": "cold", "variant": "1", "error": "exit 1: boom"}]}))
    assert print_runs.main([str(path), str(tmp_path / "absent.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("hot 2s 14.05 import_torch 3.800 forward 0.826")
    assert "'bg_load_s': 0.663" in lines[0] and "'fwd_layer_first_s': 0.473" in lines[0]
    assert lines[1].startswith("cold 1 0") and lines[1].endswith("exit 1: boom") and len(lines) == 2


def test_early_variants_start_the_load_before_building_the_model():
    for v in sb.EARLY:
        code = sb.child_program(v, "/d", "cuda:0")
        assert code.index("fs.torch.load_file(") < code.index("model = meta_model()") < code.index("load_model(")
    code = sb.child_program("2s", "/d", "cuda:0")
    assert code.index("model = meta_model()") < code.index("fs.torch.load_file(")
    assert "names=natural_order(DIR)" in sb.child_program("2en", "/d", "cuda:0")


def test_natural_order_puts_layer_2_before_layer_10(tmp_path):
    names = ["model.layers.10.mlp.weight", "model.layers.2.mlp.weight", "model.norm.weight",
             "model.layers.2.attn.weight", "lm_head.weight", "model.embed_tokens.weight"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: "a" for n in names}}))
    scope: dict = {"json": json}
    exec(sb.NATURAL_ORDER, scope)
    assert scope["natural_order"](str(tmp_path)) == [
        "lm_head.weight", "model.embed_tokens.weight", "model.layers.2.attn.weight", "model.layers.2.mlp.weight",
        "model.layers.10.mlp.weight", "model.norm.weight"]


def test_layer_line_shows_where_the_forward_waited():
    print_runs = _print_runs()
    landed = [0.1 * i for i in range(8)]
    fwd = [t + (0.3 if i == 5 else 0.01) for i, t in enumerate(landed)]
    line = print_runs.layer_line(landed, fwd)
    assert "0:0.000/0.010" in line and "7:0.700/0.710" in line and line.endswith("largest lag 0.300")
