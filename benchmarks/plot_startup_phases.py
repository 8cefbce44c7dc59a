#!/usr/bin/env python
"""Stacked phases of startup_bench runs, one bar per run, grouped by the file they came from:

    python benchmarks/plot_startup_phases.py out.png run1.json run2.json ... [--variants 1,2t,2tr] [--median]

Shows where a variant's seconds go (imports, CUDA + model + warmup, load, forward), so a
prefetch that slows the imports by what it saves in the load is visible at a glance. With
``--median`` one bar per variant over all the files: each phase group's median across its runs.
With ``--after-cuda`` only the phases after CUDA start (where the hot variants differ; the
imports before it swing by seconds between runs), each bar labelled with their sum."""

from __future__ import annotations

import argparse
import json
import os
import statistics

GROUPS = (("imports", ("python_start", "prefetch_started", "code_warmed", "import_torch", "import_transformers"), "#7570b3"),
          ("CUDA, model, warmup", ("cuda_init", "import_foxhunt", "meta_model", "to_empty", "fs_warmup"), "#bbbbbb"),
          ("load", ("load", "load_started", "streamed", "load_wait"), "#d95f02"),
          ("forward", ("forward",), "#1b9e77"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("png")
    ap.add_argument("json", nargs="+")
    ap.add_argument("--variants", default="1,2t,2tn,2tr,2T")
    ap.add_argument("--median", action="store_true", help="one bar per variant: median of each phase group")
    ap.add_argument("--title", default="cold start (drop_caches), seconds from spawn to first forward")
    ap.add_argument("--after-cuda", action="store_true", help="only the phases after CUDA start")
    args = ap.parse_args(argv)
    groups = [(label, tuple(k for k in keys if k != "cuda_init"), color) for label, keys, color in GROUPS
              if label != "imports"] if args.after_cuda else list(GROUPS)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keep = args.variants.split(",")
    bars: list[tuple[str, dict]] = []
    for path in args.json:
        with open(path) as f:
            runs = [r for r in json.load(f)["runs"] if r.get("variant") in keep and "phases_s" in r]
        tag = os.path.splitext(os.path.basename(path))[0].rsplit("_", 1)[-1]   # "call5", "2t-16M-2r"
        bars += [(f"{r['variant']}\n{tag}", r) for r in sorted(runs, key=lambda r: keep.index(r["variant"]))]
    if args.median:
        pooled = []
        for v in keep:
            rs = [r for _, r in bars if r["variant"] == v]
            if not rs:
                continue
            phases = {k: statistics.median(r["phases_s"].get(k, 0.0) for r in rs)
                      for _, keys, _ in groups for k in keys}
            pooled.append((f"{v}\n{len(rs)} runs", {"variant": v, "phases_s": phases,
                                                     "total_s": statistics.median(r["total_s"] for r in rs)}))
        bars = pooled
    fig, ax = plt.subplots(figsize=(0.55 * len(bars) + 2.5, 4.8))
    height: dict[str, float] = {}   # variant -> its bar's height (the last bar of a variant)
    for i, (_, r) in enumerate(bars):
        bottom = 0.0
        for label, keys, color in groups:
            h = sum(r["phases_s"].get(k, 0.0) for k in keys)
            ax.bar(i, h, 0.75, bottom=bottom, color=color, label=label if i == 0 else None)
            bottom += h
        height[r["variant"]] = bottom
        top = bottom if args.after_cuda else r["total_s"]
        ax.text(i, top, f"{top:.2f}" if args.after_cuda else f"{top:.1f}", ha="center", va="bottom", fontsize=7)
    if args.after_cuda and "F" in height and "1" in height:   # issue 6's first hot bar, from the bars drawn
        line = height["F"] + 0.25 * (height["1"] - height["F"])
        ax.axhline(line, color="k", linestyle="--", linewidth=0.8, label=f"F + 0.25 x ((1) - F) = {line:.2f}")
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([b for b, _ in bars], fontsize=7)
    ax.set_ylabel("seconds")
    ax.set_title(args.title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(args.png, dpi=130)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
