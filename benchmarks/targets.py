#!/usr/bin/env python
"""The ten first-load targets of one run, each figure against its bound, from the suites' JSON.

    python3 benchmarks/targets.py OUT          # reads OUT/targets_hot.json, targets_cold.json, startup.json
    python3 benchmarks/targets.py OUT --hot results/fresh_h100_X.json --cold ... --startup ...

The runner's ``targets`` suite (``run.py``) writes the three files in one run: ``fresh_bench.py``'s
hot and host groups (5 rounds), its cold group (3 rounds) and the startup bench, hot (5 rounds), then
runs this. A figure whose cases are missing (a peer not installed, a group not run, a startup bench
with fewer than 5 rounds of each variant) is "not measured", never met. Writes ``OUT/targets.txt``
and ``OUT/targets.json``.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import sys
from typing import Any, Callable, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the suite's modules, wherever it runs from
import common  # noqa: E402

STARTUP_ROUNDS = 5


class Target(NamedTuple):
    key: str
    label: str
    holds: Callable[[float, float], bool]   # holds(figure, bound)
    bound: float


TARGETS = [
    Target("first_h2d", "full 16 GB hot first load / pinned H2D", operator.ge, 0.85),
    Target("first_vs_instanttensor", "full hot first load / InstantTensor buffered", operator.ge, 1.1),
    Target("one_time_s", "one-time cost: first load minus a second in the same process (s)", operator.le, 0.03),
    Target("tp_llama", "TP=8 rank 0, Llama plan / the full first load", operator.le, 0.25),
    Target("tp_rows", "TP=8 rank 0, rows plan / the full first load", operator.le, 0.22),
    Target("second_h2d", "second load in the same process / H2D", operator.ge, 0.85),
    Target("restart", "restart (a new process after a cold load) / hot first load", operator.ge, 0.95),
    Target("cold_vs_raw", "cold load / raw cold read", operator.ge, 0.97),
    Target("host", "host: fresh process, import + load 1 GiB F32 / safetensors.numpy", operator.le, 0.7),
    Target("startup", "startup hot: (ours - F) / (transformers - F)", operator.le, 0.25),
]


def _median(runs: dict[str, list[dict]], case: str, key: str = "seconds") -> float | None:
    return common.median([r[key] for r in runs.get(case, ()) if key in r])


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def figures(hot: dict | None, cold: dict | None, startup: dict | None) -> dict[str, float | None]:
    """Each target's figure (None: not measured) from ``fresh_bench.py``'s hot+host JSON, its cold
    JSON and ``startup_bench.py``'s JSON (any may be None)."""
    out: dict[str, float | None] = {t.key: None for t in TARGETS}
    first = None
    if hot is not None:
        runs, nbytes, ceiling = hot["runs"], hot["bytes"], hot.get("ceiling_GBps")
        first, second = _median(runs, "foxhunt"), _median(runs, "foxhunt", "second")
        rate = (lambda s: nbytes / s / 1e9 if s else None)
        out["first_h2d"] = _ratio(rate(first), ceiling)
        out["second_h2d"] = _ratio(rate(second), ceiling)
        out["first_vs_instanttensor"] = _ratio(_median(runs, "instanttensor"), first)
        out["one_time_s"] = first - second if first is not None and second is not None else None
        out["tp_llama"] = _ratio(_median(runs, "tp_llama"), first)
        out["tp_rows"] = _ratio(_median(runs, "tp_rows"), first)
        out["host"] = _ratio(_median(runs, "host_foxhunt"), _median(runs, "host_safetensors"))
    if cold is not None:
        runs = cold["runs"]
        raw, loaded = _median(runs, "raw_cold_read"), _median(runs, "cold")
        raw_bytes = _median(runs, "raw_cold_read", "bytes")
        if raw and loaded and raw_bytes:
            out["cold_vs_raw"] = (cold["bytes"] / loaded) / (raw_bytes / raw)
        out["restart"] = _ratio(first, _median(runs, "restart"))
    if startup is not None:
        summary = startup.get("summary", {}).get("hot", {})
        enough = all(summary.get(v, {}).get("runs", 0) >= STARTUP_ROUNDS for v in ("floor", "transformers", "foxhunt"))
        crit = startup.get("criteria", {}).get("hot", {}).get("total_s", {})
        out["startup"] = crit.get("ratio") if enough else None
    return out


def evaluate(figs: dict[str, float | None]) -> list[dict[str, Any]]:
    """One row per target: its figure, bound and whether it holds (None: not measured)."""
    return [{"key": t.key, "label": t.label, "bound": t.bound, "op": ">=" if t.holds is operator.ge else "<=",
             "figure": figs[t.key], "met": None if figs[t.key] is None else bool(t.holds(figs[t.key], t.bound))}
            for t in TARGETS]


def lines(rows: list[dict[str, Any]]) -> list[str]:
    table = [("figure", "target", "this run", "met")]
    table += [(r["label"], f"{r['op']} {r['bound']:g}", "-" if r["figure"] is None else f"{r['figure']:.4g}",
               {True: "yes", False: "no", None: "not measured"}[r["met"]]) for r in rows]
    met = sum(r["met"] is True for r in rows)
    return common.table(table, {2}) + ["", f"{met} of {len(rows)} targets met in this run"
                                       + (" (all of them)" if met == len(rows) else "")]


def _load(path: str | None) -> dict | None:
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the run's output folder (this writes targets.txt and targets.json there)")
    ap.add_argument("--hot", help="fresh_bench.py's hot+host JSON (default OUT/targets_hot.json)")
    ap.add_argument("--cold", help="fresh_bench.py's cold JSON (default OUT/targets_cold.json)")
    ap.add_argument("--startup", help="startup_bench.py's JSON (default OUT/startup.json)")
    args = ap.parse_args(argv)
    paths = {k: getattr(args, k) or os.path.join(args.out, name)
             for k, name in (("hot", "targets_hot.json"), ("cold", "targets_cold.json"), ("startup", "startup.json"))}
    rows = evaluate(figures(*(_load(paths[k]) for k in ("hot", "cold", "startup"))))
    text = lines(rows)
    print("\n".join(text), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "targets.txt"), "w") as f:
        f.write("\n".join(text) + "\n")
    with open(os.path.join(args.out, "targets.json"), "w") as f:
        json.dump({"sources": paths, "targets": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
