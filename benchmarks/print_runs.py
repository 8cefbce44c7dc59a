#!/usr/bin/env python
"""One line per startup_bench run of the given JSON files: mode, variant, total, each phase and
the side measurements (background load, kernel warm, forward marks, bytes prefetched).

    python benchmarks/print_runs.py hot.json [cold.json ...]   (missing files are skipped)
"""

from __future__ import annotations

import json
import os
import sys

SIDE = ("bg_load_s", "kernels_warm_s", "fwd_layer_first_s", "fwd_layer_last_s", "fwd_head_s")


def main(paths: list[str]) -> int:
    for path in paths:
        if not os.path.exists(path):
            continue
        for r in json.load(open(path))["runs"]:
            ph = r.get("phases_s", {})
            extra = {k: round(r[k], 3) for k in SIDE if k in r}
            if "prefetch_bytes_at_load" in r:
                extra["prefetched_GB_at_load"] = round(r["prefetch_bytes_at_load"] / 1e9, 2)
            print(r["mode"], r["variant"], round(r.get("total_s", 0), 2),
                  " ".join(f"{k} {v:.3f}" for k, v in ph.items()), extra, r.get("error", "")[-300:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
