"""The targets' evaluation (benchmarks/targets.py) on recorded runs and on made-up ones, and the
runner's ``targets`` suite handing each command the time left to it."""

from __future__ import annotations

import json
import os
import sys

import common
import run as runner
import targets

RESULTS = os.path.join(common.HERE, "results")


def _recorded(name: str) -> tuple[dict, dict, dict]:
    def load(kind: str) -> dict:
        with open(os.path.join(RESULTS, f"{kind}_{name}_2026-12-06.json")) as f:
            return json.load(f)
    return load("fresh_h100"), load("fresh_cold_h100"), load("startup_h100")


def _met(rows: list[dict]) -> dict[str, bool | None]:
    return {r["key"]: r["met"] for r in rows}


def test_a_recorded_run_is_judged_as_the_results_say():
    rows = targets.evaluate(targets.figures(*_recorded("steady092")))   # RESULTS: met nine, not the rows plan
    met = _met(rows)
    assert [k for k, v in met.items() if not v] == ["tp_rows"]
    figs = {r["key"]: r["figure"] for r in rows}
    assert 0.85 < figs["first_h2d"] < 0.86 and 0.233 < figs["tp_rows"] < 0.234
    rows = targets.evaluate(targets.figures(*_recorded("onetime029")))   # RESULTS: met six
    assert sorted(k for k, v in _met(rows).items() if not v) == ["first_h2d", "first_vs_instanttensor",
                                                                 "tp_llama", "tp_rows"]


def test_a_missing_group_is_not_measured_never_met():
    hot, cold, startup = _recorded("onetime029")
    met = _met(targets.evaluate(targets.figures(hot, None, None)))
    assert met["restart"] is met["cold_vs_raw"] is met["startup"] is None
    assert met["one_time_s"] is True and met["host"] is True
    no_peer = dict(hot, runs={k: v for k, v in hot["runs"].items() if k != "instanttensor"})
    assert _met(targets.evaluate(targets.figures(no_peer, cold, startup)))["first_vs_instanttensor"] is None


def test_a_startup_bench_cut_short_does_not_count():
    hot, cold, startup = _recorded("onetime029")
    short = json.loads(json.dumps(startup))
    short["summary"]["hot"]["transformers"]["runs"] = 3
    assert short["criteria"]["hot"]["total_s"]["met"] is True   # the bench's own verdict on 3 rounds
    assert _met(targets.evaluate(targets.figures(hot, cold, short)))["startup"] is None


def test_each_bound_is_checked_on_its_side():
    figs = {t.key: None for t in targets.TARGETS}
    figs.update(first_h2d=0.85, one_time_s=0.0301, tp_rows=0.22, host=0.71)
    met = _met(targets.evaluate(figs))
    assert met["first_h2d"] is True and met["tp_rows"] is True    # at the bound: met
    assert met["one_time_s"] is False and met["host"] is False


def test_the_script_writes_its_table_and_figures(tmp_path):
    names = {"hot": "fresh_h100", "cold": "fresh_cold_h100", "startup": "startup_h100"}
    argv = [str(tmp_path)] + [a for k, n in names.items()
                              for a in (f"--{k}", os.path.join(RESULTS, f"{n}_onetime029_2026-12-06.json"))]
    assert targets.main(argv) == 0
    text = (tmp_path / "targets.txt").read_text()
    assert "6 of 10 targets met in this run" in text
    data = json.loads((tmp_path / "targets.json").read_text())
    assert len(data["targets"]) == 10 and sum(r["met"] is True for r in data["targets"]) == 6


def test_the_targets_suite_runs_every_group_then_the_evaluation():
    cmds = runner.SUITES["targets"].commands
    scripts = [os.path.basename(next(p for p in c if p.endswith(".py"))) for c in cmds]
    assert scripts == ["fresh_bench.py", "fresh_bench.py", "startup_bench.py", "targets.py"]
    assert cmds[0][cmds[0].index("--groups") + 1] == "hot,host" and cmds[0][cmds[0].index("--rounds") + 1] == "5"
    assert cmds[1][cmds[1].index("--groups") + 1] == "cold"
    assert cmds[2][cmds[2].index("--rounds") + 1] == "5" and "{deadline}" in cmds[2]


def test_each_command_of_a_suite_gets_the_time_left_when_it_starts(tmp_path, monkeypatch):
    seen = tmp_path / "deadlines"
    py = sys.executable
    record = [py, "-c", f"import sys; open({str(seen)!r}, 'a').write(sys.argv[1] + '\\n')", "{deadline}"]
    wait = [py, "-c", "import time; time.sleep(2)"]
    monkeypatch.setitem(runner.SUITES, "two", runner.Suite("two steps", [record, wait, record], 100, needs_ckpt=False))
    code = runner.main(["two", "--out", str(tmp_path / "out"), "--peer-wheels", str(tmp_path / "none")])
    assert code == 0
    first, second = map(int, seen.read_text().split())
    assert first == 100 - 45 and first - second >= 2
